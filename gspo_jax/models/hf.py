"""Hugging Face checkpoints: Qwen3-MoE, Qwen3 and Qwen2 (config.json + safetensors).

Layout conversions (HF nn.Linear stores [out, in]):

    q_proj.weight [H*hd, D]  <->  attn.q [D, H, hd]       (transpose, reshape)
    k/v_proj.weight [KV*hd, D] <-> attn.k/v [D, KV, hd]
    o_proj.weight [D, H*hd]  <->  attn.o [H, hd, D]
    q/k/v_proj.bias [N*hd]   <->  attn.q/k/v_bias [N, hd]            (Qwen2)
    gate/up_proj.weight [F, D] <-> gate/up [D, F];  down_proj [D, F] <-> down [F, D]
    mlp.gate.weight [E, D]   <->  mlp.router [D, E]
    mlp.experts.{e}.gate_proj.weight [I, D] <-> mlp.gate[e] [D, I]   (also the fused
      mlp.experts.gate_up_proj [E, 2I, D] / down_proj [E, D, I] layout on read)
    lm_head.weight [V, D]    <->  lm_head [D, V]

Qwen3-MoE's layer rule (decoder_sparse_step, mlp_only_layers) maps to
ModelConfig.moe_every / dense_layers; norm_topk_prob to renormalize_topk.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.safetensors_io import read_safetensors, write_safetensors
from gspo_jax.models.transformer import Transformer

SUPPORTED = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
}


# ---------------------------------------------------------------- config
def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a HF config.json dict (+ ModelConfig field overrides)."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        by_type = {v: k for k, v in SUPPORTED.items()}
        if arch is None and hf.get("model_type") in by_type:
            arch = by_type[hf["model_type"]]
        else:
            raise ValueError(
                f"config.json: unsupported architecture {arch or hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED)}"
            )
    kind = SUPPORTED[arch]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} unsupported (only 'silu')")
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf.get("rope_scaling"):
        raise ValueError(
            f"config.json: rope scaling {hf.get('rope_scaling') or rope!r} unsupported "
            "(only the default RoPE)"
        )
    if hf.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is unsupported")
    if kind != "qwen2" and hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is unsupported for Qwen3 (o_proj bias)")
    heads = hf["num_attention_heads"]
    num_experts = (
        hf.get("num_experts", hf.get("num_local_experts", 0)) if kind == "qwen3_moe" else 0
    )
    kw = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        d_ff=hf["intermediate_size"],
        qk_norm=kind != "qwen2",
        qkv_bias=kind == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    if num_experts:
        kw.update(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            moe_d_ff=hf["moe_intermediate_size"],
            moe_every=hf.get("decoder_sparse_step", 1),
            dense_layers=tuple(hf.get("mlp_only_layers") or ()),
            renormalize_topk=bool(hf.get("norm_topk_prob", False)),
            # transformers' load-balancing loss is K times ours (its load sums to K
            # over experts, ours to 1): the same regularisation needs K times the coef.
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)) * hf["num_experts_per_tok"],
        )
    kw.update(overrides)
    return ModelConfig(**kw)


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
    """HF config.json dict for `cfg` (raises if no supported architecture fits)."""
    if cfg.num_experts > 0:
        arch, mtype = "Qwen3MoeForCausalLM", "qwen3_moe"
    elif cfg.qk_norm:
        arch, mtype = "Qwen3ForCausalLM", "qwen3"
    else:
        arch, mtype = "Qwen2ForCausalLM", "qwen2"
    if (mtype == "qwen2") != cfg.qkv_bias or (mtype != "qwen2") != cfg.qk_norm:
        raise ValueError(
            f"export_pretrained: qk_norm={cfg.qk_norm} with qkv_bias={cfg.qkv_bias} "
            "matches no supported HF architecture (Qwen3: q/k norm, no bias; Qwen2: "
            "bias, no norm)"
        )
    hf = dict(
        architectures=[arch],
        model_type=mtype,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.d_ff,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
        initializer_range=cfg.init_std,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        max_position_embeddings=32768,
        dtype=dtype,
    )
    if mtype != "qwen2":
        hf["attention_bias"] = False
    if cfg.num_experts > 0:
        hf.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.moe_d_ff,
            decoder_sparse_step=cfg.moe_every,
            mlp_only_layers=sorted(set(cfg.dense_layers) | set(range(cfg.first_dense_layers))),
            norm_topk_prob=cfg.renormalize_topk,
            router_aux_loss_coef=cfg.aux_loss_coef / cfg.top_k,
        )  # see config_from_hf
    return hf


# ---------------------------------------------------------------- layout
def _layer_slots(model: Transformer):
    """For each layer i in order: (block module, repeat index r)."""
    slots = []
    for seg in model.segments:
        for r in range(seg.repeats):
            for blk in seg.blocks:
                slots.append((blk, r))
    return slots


def _get(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _layer_table(cfg: ModelConfig, moe: bool):
    """(hf suffix, module path, hf -> ours, ours -> hf) for one layer."""
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = lambda w: w.T
    rows = [
        ("input_layernorm.weight", "attn_norm.scale", None, None),
        ("post_attention_layernorm.weight", "mlp_norm.scale", None, None),
        (
            "self_attn.q_proj.weight",
            "attn.q",
            lambda w: w.T.reshape(d, h, hd),
            lambda w: w.reshape(d, h * hd).T,
        ),
        (
            "self_attn.k_proj.weight",
            "attn.k",
            lambda w: w.T.reshape(d, kv, hd),
            lambda w: w.reshape(d, kv * hd).T,
        ),
        (
            "self_attn.v_proj.weight",
            "attn.v",
            lambda w: w.T.reshape(d, kv, hd),
            lambda w: w.reshape(d, kv * hd).T,
        ),
        (
            "self_attn.o_proj.weight",
            "attn.o",
            lambda w: w.T.reshape(h, hd, d),
            lambda w: w.reshape(h * hd, d).T,
        ),
    ]
    if cfg.qkv_bias:
        rows += [
            (
                f"self_attn.{n}_proj.bias",
                f"attn.{n}_bias",
                lambda b, m=m: b.reshape(m, hd),
                lambda b: b.reshape(-1),
            )
            for n, m in (("q", h), ("k", kv), ("v", kv))
        ]
    if cfg.qk_norm:
        rows += [
            ("self_attn.q_norm.weight", "attn.q_norm.scale", None, None),
            ("self_attn.k_norm.weight", "attn.k_norm.scale", None, None),
        ]
    if moe:
        rows += [("mlp.gate.weight", "mlp.router", t, t)]
    else:
        rows += [
            ("mlp.gate_proj.weight", "mlp.gate", t, t),
            ("mlp.up_proj.weight", "mlp.up", t, t),
            ("mlp.down_proj.weight", "mlp.down", t, t),
        ]
    return rows


# ---------------------------------------------------------------- files
def _allowed_roots(path: str) -> list[str]:
    """Where the weight files of the checkpoint folder ``path`` may really live: the
    folder itself and, for a Hugging Face hub cache snapshot
    (``<repo>/snapshots/<revision>``, whose files link to ``<repo>/blobs/``), that
    repository's blob store."""
    real = os.path.realpath(path)
    roots = [real]
    if os.path.basename(os.path.dirname(os.path.abspath(path))) == "snapshots":
        roots.append(os.path.realpath(os.path.join(path, "..", "..", "blobs")))
    return roots


def _weight_file(path: str, name, where: str) -> str:
    """The file ``name`` inside the checkpoint folder ``path`` (``where`` names who
    asked for it); refuses absolute paths, ``..``, links that lead elsewhere, and
    names that are not an existing ``.safetensors`` file."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: weight file {name!r} is not a file name")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
        raise ValueError(f"{where}: weight file {name!r} is not inside the checkpoint folder")
    if not name.endswith(".safetensors"):
        raise ValueError(f"{where}: weight file {name!r} is not a .safetensors file")
    full = os.path.join(path, *parts)
    real = os.path.realpath(full)
    if not any(os.path.commonpath([real, root]) == root for root in _allowed_roots(path)):
        raise ValueError(
            f"{where}: weight file {name!r} links to {real}, outside the checkpoint folder"
        )
    if not os.path.isfile(full):
        raise ValueError(f"{where}: weight file {name!r} does not exist")
    return full


def _read_index(index: str) -> list[str]:
    """The weight file names of ``model.safetensors.index.json`` (untrusted JSON)."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, too deeply nested
        raise ValueError(f"{index}: invalid JSON: {type(e).__name__}: {e}") from None
    except (KeyError, TypeError):
        raise ValueError(f"{index}: no 'weight_map' object") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, not an object")
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise ValueError(f"{index}: tensor {tensor!r} maps to {name!r}, not a file name")
    return sorted(set(weight_map.values()))


def _read_checkpoint(path: str) -> dict[str, np.ndarray]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = [_weight_file(path, name, index) for name in _read_index(index)]
    else:
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        files = [_weight_file(path, os.path.basename(p), path) for p in files]
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (pickle checkpoints are not read)")
    tensors, source = {}, {}
    for file in files:
        for name, array in read_safetensors(file).items():
            if name in tensors:
                raise ValueError(f"{path}: tensor {name!r} is in both {source[name]} and {file}")
            tensors[name], source[name] = array, file
    return tensors


def _take(tensors: dict, name: str, path: str, shape=None) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"{path}: missing tensor {name!r}")
    a = tensors.pop(name)
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(
            f"{path}: tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}"
        )
    return np.asarray(a, dtype=np.float32)


def from_pretrained(
    path: str,
    *,
    dtype="float32",
    param_dtype=None,
    moe_backend: str = "blocked",
    mesh: Optional[jax.sharding.Mesh] = None,
    **overrides,
) -> Transformer:
    """Load a HF checkpoint directory (config.json + *.safetensors) as a Transformer.

    Args:
      path: directory with config.json and model.safetensors (or shards with
        model.safetensors.index.json).
      dtype: compute dtype.
      param_dtype: parameter dtype (default: `dtype`).
      moe_backend: 'blocked' | 'ragged' | 'dense'.
      mesh: if given, parameters are placed with `param_shardings(model, mesh)`.
      **overrides: any other ModelConfig field (scan_layers, remat_policy, ...).

    Raises ValueError naming the architecture, config field or tensor that is
    unsupported, missing or of the wrong shape.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path}: no config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    dtype = jnp.dtype(dtype).name
    param_dtype = jnp.dtype(param_dtype).name if param_dtype is not None else dtype
    cfg = config_from_hf(
        hf, dtype=dtype, param_dtype=param_dtype, moe_backend=moe_backend, **overrides
    )
    tensors = _read_checkpoint(path)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    bufs: dict[int, tuple[nnx.Param, np.ndarray]] = {}

    def buf(param):
        if id(param) not in bufs:
            bufs[id(param)] = (param, np.zeros(param.shape, np.float32))
        return bufs[id(param)][1]

    d, e, f_moe = cfg.d_model, cfg.num_experts, cfg.moe_d_ff
    for i, (blk, r) in enumerate(_layer_slots(model)):
        pre = f"model.layers.{i}."
        for suffix, attr, to_ours, _ in _layer_table(cfg, blk.is_moe):
            p = _get(blk, attr)
            w = _take(tensors, pre + suffix, path)
            w = to_ours(w) if to_ours else w
            if w.shape != tuple(p.shape[1:]):
                raise ValueError(
                    f"{path}: tensor {pre + suffix!r} converts to {w.shape}, "
                    f"expected {tuple(p.shape[1:])}"
                )
            buf(p)[r] = w
        if blk.is_moe:
            mlp = blk.mlp
            fused = pre + "mlp.experts.gate_up_proj"
            if fused in tensors:
                gu = _take(tensors, fused, path, (e, 2 * f_moe, d))
                buf(mlp.gate)[r] = gu[:, :f_moe].transpose(0, 2, 1)
                buf(mlp.up)[r] = gu[:, f_moe:].transpose(0, 2, 1)
                buf(mlp.down)[r] = _take(
                    tensors, pre + "mlp.experts.down_proj", path, (e, d, f_moe)
                ).transpose(0, 2, 1)
            else:
                for x in range(e):
                    q = f"{pre}mlp.experts.{x}."
                    buf(mlp.gate)[r, x] = _take(tensors, q + "gate_proj.weight", path, (f_moe, d)).T
                    buf(mlp.up)[r, x] = _take(tensors, q + "up_proj.weight", path, (f_moe, d)).T
                    buf(mlp.down)[r, x] = _take(tensors, q + "down_proj.weight", path, (d, f_moe)).T
    v = cfg.vocab_size
    buf(model.embed)[...] = _take(tensors, "model.embed_tokens.weight", path, (v, d))
    buf(model.final_norm.scale)[...] = _take(tensors, "model.norm.weight", path, (d,))
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store a copy
    else:
        buf(model.lm_head)[...] = _take(tensors, "lm_head.weight", path, (v, d)).T
    leftover = sorted(k for k in tensors if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise ValueError(
            f"{path}: unexpected tensors (unsupported features?): {leftover[:8]}"
            + (" ..." if len(leftover) > 8 else "")
        )
    params = [p for _, p in nnx.iter_graph(model) if isinstance(p, nnx.Param)]
    missing = [p for p in params if id(p) not in bufs]
    if missing:
        raise ValueError(
            f"{path}: {len(missing)} parameters were not loaded (internal layout error)"
        )
    pd = jnp.dtype(param_dtype)
    for p, a in bufs.values():
        p.set_value(jnp.asarray(a, pd))
    if mesh is not None:
        from gspo_jax.models.sharding import param_shardings

        gdef, state = nnx.split(model)
        state = jax.device_put(state, param_shardings(state, mesh, cfg))
        model = nnx.merge(gdef, state)
    return model


def export_pretrained(model: Transformer, path: str, *, dtype: Optional[str] = None) -> None:
    """Write `model` as a HF checkpoint: config.json + model.safetensors.

    dtype: tensor dtype in the file (default: the parameters' dtype).
    """
    cfg = model.cfg
    dtype = jnp.dtype(dtype or cfg.param_dtype)
    hf = config_to_hf(cfg, dtype.name)
    out: dict[str, np.ndarray] = {}
    get = lambda p: np.asarray(jax.device_get(p[...]), np.float32)
    for i, (blk, r) in enumerate(_layer_slots(model)):
        pre = f"model.layers.{i}."
        for suffix, attr, _, to_hf in _layer_table(cfg, blk.is_moe):
            w = get(_get(blk, attr))[r]
            out[pre + suffix] = to_hf(w) if to_hf else w
        if blk.is_moe:
            g, u, dn = (get(blk.mlp.gate)[r], get(blk.mlp.up)[r], get(blk.mlp.down)[r])
            for x in range(cfg.num_experts):
                q = f"{pre}mlp.experts.{x}."
                out[q + "gate_proj.weight"] = g[x].T
                out[q + "up_proj.weight"] = u[x].T
                out[q + "down_proj.weight"] = dn[x].T
    out["model.embed_tokens.weight"] = get(model.embed)
    out["model.norm.weight"] = get(model.final_norm.scale)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get(model.lm_head).T
    os.makedirs(path, exist_ok=True)
    write_safetensors(
        os.path.join(path, "model.safetensors"),
        {k: np.ascontiguousarray(v).astype(dtype) for k, v in out.items()},
        metadata={"format": "pt"},
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
