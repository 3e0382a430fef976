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

Both directions stream (docs/checkpoints.md): `from_pretrained` reads the headers,
checks every tensor against the config, then memory-maps one tensor at a time and
puts each device's block of it (converted to our layout and dtype) on that device
alone; `export_pretrained` gathers one tensor (one layer of a stacked parameter)
at a time and writes shards of a bounded size with model.safetensors.index.json.
Neither ever holds the whole model on the host or on one device.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import multihost
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.safetensors_io import (
    TensorInfo,
    TensorReader,
    tensor_infos,
    write_sharded,
)
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


def _read_checkpoint(path: str) -> dict[str, TensorInfo]:
    """Where each tensor of the checkpoint folder ``path`` lies, from the validated
    headers of its weight files (the index's files, or else every
    ``*.safetensors``); no tensor data is read."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = [_weight_file(path, name, index) for name in _read_index(index)]
    else:
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        files = [_weight_file(path, os.path.basename(p), path) for p in files]
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (pickle checkpoints are not read)")
    infos: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in tensor_infos(file).items():
            if name in infos:
                raise ValueError(
                    f"{path}: tensor {name!r} is in both {infos[name].file} and {file}"
                )
            infos[name] = info
    return infos


# ---------------------------------------------------------------- loading
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_FILE_TO_PARAM_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float32"}


def _file_dtype(infos: dict[str, TensorInfo]) -> str:
    """The parameter dtype that keeps the checkpoint's precision: the floating dtype
    holding most of its bytes (F64 becomes float32, the widest ModelConfig allows)."""
    total: dict[str, int] = {}
    for info in infos.values():
        if info.dtype in _FLOAT_DTYPES:
            total[info.dtype] = total.get(info.dtype, 0) + info.nbytes
    if not total:
        return "float32"
    return _FILE_TO_PARAM_DTYPE[max(total, key=total.get)]


def _hf_shape(to_hf, shape) -> tuple[int, ...]:
    """The checkpoint shape of a tensor whose shape in our layout is ``shape``."""
    if to_hf is None:
        return tuple(shape)
    return tuple(jax.eval_shape(to_hf, jax.ShapeDtypeStruct(tuple(shape), jnp.float32)).shape)


class _Tensor:
    """One checkpoint tensor as an array of our layout: ``view`` (transposes,
    reshapes and slices only, so no data is copied or read) turns the mapped file
    array into ours, and :meth:`read` copies the block ``index`` of that into
    ``out``, converting the dtype; only the pages the block covers are read."""

    def __init__(self, info: TensorInfo, view=None):
        self.info, self.view = info, view

    def read(self, reader: TensorReader, index: tuple, out: np.ndarray) -> None:
        a = reader.array(self.info)
        out[...] = (self.view(a) if self.view else a)[index]
        # `a` goes out of scope here: its memory map (and its pages) are released.


class _Stack:
    """An array whose leading axis is gathered from several tensors (the experts
    of one layer, each its own tensor in the checkpoint)."""

    def __init__(self, parts: list):
        self.parts = parts

    def read(self, reader: TensorReader, index: tuple, out: np.ndarray) -> None:
        for j, k in enumerate(range(*index[0].indices(len(self.parts)))):
            self.parts[k].read(reader, index[1:], out[j])


class _Checkpoint:
    """The checkpoint's tensors, checked as the loader claims them: each must exist,
    have the shape the config implies and a floating dtype; the tensors no
    parameter claims are reported by :meth:`check_all_used`."""

    def __init__(self, path: str, infos: dict[str, TensorInfo], param_dtype: str):
        self.path, self.infos, self.param_dtype = path, infos, param_dtype
        self.used: set[str] = set()

    def tensor(self, name: str, hf_shape, our_shape, view=None) -> _Tensor:
        info = self.infos.get(name)
        if info is None:
            raise ValueError(f"{self.path}: missing tensor {name!r}")
        where = f"{info.file}: tensor {name!r}"
        if info.shape != tuple(hf_shape):
            raise ValueError(f"{where} has shape {info.shape}, expected {tuple(hf_shape)}")
        if info.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{where} has dtype {info.dtype}, which does not convert to "
                f"{self.param_dtype} parameters (floating dtypes only: "
                f"{', '.join(_FLOAT_DTYPES)})"
            )
        # The view on a zero-strided stand-in: its shape, without touching data.
        got = np.broadcast_to(np.zeros((), np.float32), info.shape)
        got = (view(got) if view else got).shape
        if got != tuple(our_shape):
            raise ValueError(f"{where} converts to {got}, expected {tuple(our_shape)}")
        self.used.add(name)
        return _Tensor(info, view)

    def check_all_used(self, ignore=()) -> None:
        leftover = sorted(
            k
            for k in self.infos
            if k not in self.used and k not in ignore and not k.endswith("rotary_emb.inv_freq")
        )
        if leftover:
            raise ValueError(
                f"{self.path}: unexpected tensors (unsupported features?): {leftover[:8]}"
                + (" ..." if len(leftover) > 8 else "")
            )


def _plan(model: Transformer, ckpt: _Checkpoint) -> dict[int, tuple[nnx.Param, object]]:
    """For each parameter (by id): ``(param, source)``, where the source is a list
    with one source per stacked layer for the parameters of a segment's blocks, or
    one source for the others. Every tensor is checked here, before any is read."""
    cfg = model.cfg
    plan: dict[int, tuple[nnx.Param, object]] = {}

    def layer(param, r, source):
        if id(param) not in plan:
            plan[id(param)] = (param, [None] * param.shape[0])
        plan[id(param)][1][r] = source

    d, e, f, v = cfg.d_model, cfg.num_experts, cfg.moe_d_ff, cfg.vocab_size
    t = lambda w: w.T  # noqa: E731
    for i, (blk, r) in enumerate(_layer_slots(model)):
        pre = f"model.layers.{i}."
        for suffix, attr, to_ours, to_hf in _layer_table(cfg, blk.is_moe):
            p = _get(blk, attr)
            inner = tuple(p.shape[1:])
            layer(p, r, ckpt.tensor(pre + suffix, _hf_shape(to_hf, inner), inner, to_ours))
        if not blk.is_moe:
            continue
        mlp = blk.mlp
        fused = pre + "mlp.experts.gate_up_proj"
        if fused in ckpt.infos:  # transformers' fused layout: [E, 2I, D] and [E, D, I]
            gu = (e, 2 * f, d)
            layer(mlp.gate, r, ckpt.tensor(fused, gu, (e, d, f), lambda w: w[:, :f].swapaxes(1, 2)))
            layer(mlp.up, r, ckpt.tensor(fused, gu, (e, d, f), lambda w: w[:, f:].swapaxes(1, 2)))
            down = pre + "mlp.experts.down_proj"
            layer(mlp.down, r, ckpt.tensor(down, (e, d, f), (e, f, d), lambda w: w.swapaxes(1, 2)))
        else:
            for attr, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
                parts = [
                    ckpt.tensor(f"{pre}mlp.experts.{x}.{attr}_proj.weight", shape, shape[::-1], t)
                    for x in range(e)
                ]
                layer(getattr(mlp, attr), r, _Stack(parts))
    whole = [
        (model.embed, ckpt.tensor("model.embed_tokens.weight", (v, d), (v, d))),
        (model.final_norm.scale, ckpt.tensor("model.norm.weight", (d,), (d,))),
    ]
    if not cfg.tie_embeddings:
        whole.append((model.lm_head, ckpt.tensor("lm_head.weight", (v, d), (d, v), t)))
    for p, source in whole:
        plan[id(p)] = (p, source)
    # Tied checkpoints may store a copy of the embedding as lm_head.weight.
    ckpt.check_all_used(ignore=("lm_head.weight",) if cfg.tie_embeddings else ())
    return plan


def _block_key(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _assemble(shape: tuple, sharding, np_dtype: np.dtype, fill) -> jax.Array:
    """A global array of ``shape`` on ``sharding``, built block by block on the host.

    ``fill(index, out)`` writes the block ``index`` (a tuple of slices) into the
    host array ``out``. Each distinct block is filled once, put on every device
    that holds it, and freed before the next: the host holds one device's block at
    a time, and each device receives only its shard.
    """
    index_map = sharding.addressable_devices_indices_map(shape)
    groups: dict[tuple, list] = {}
    for device, index in index_map.items():
        groups.setdefault(_block_key(index, shape), []).append(device)
    pieces = {}
    for key, devices in groups.items():
        block = np.empty(tuple(b - a for a, b in key), np_dtype)
        fill(tuple(slice(a, b) for a, b in key), block)
        for device in devices:
            pieces[device] = jax.device_put(block, device)
        jax.block_until_ready([pieces[device] for device in devices])
        del block
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [pieces[device] for device in index_map]
    )


def _layer_sharding(sharding, ndim: int):
    """The sharding of one layer of a stacked parameter (its leading axis dropped)."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, P(*spec[1:]))
    return sharding  # one device


def _set_layer(stack, layer, r):
    return jax.lax.dynamic_update_index_in_dim(stack, layer, r, 0)


def _load_param(param, source, sharding, dtype, reader: TensorReader) -> jax.Array:
    """One parameter, read from the checkpoint straight onto its sharding.

    A stacked parameter (``source`` a list, one per layer) starts as zeros on its
    sharding and receives one layer at a time through an in-place (donated) update,
    so host and devices hold one layer's blocks beyond the parameter itself.
    """
    shape, np_dtype = tuple(param.shape), np.dtype(dtype)
    if not isinstance(source, list):
        return _assemble(shape, sharding, np_dtype, lambda i, out: source.read(reader, i, out))
    inner = _layer_sharding(sharding, len(shape))
    stack = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    set_layer = jax.jit(_set_layer, donate_argnums=0, out_shardings=sharding)
    for r, src in enumerate(source):
        fill = lambda i, out, src=src: src.read(reader, i, out)  # noqa: E731
        stack = set_layer(stack, _assemble(shape[1:], inner, np_dtype, fill), np.int32(r))
        stack.block_until_ready()
    return stack


def _init_param(name: str, param, sharding, cfg: ModelConfig) -> jax.Array:
    """A parameter that checkpoints do not hold (the value head), initialised as
    the Transformer initialises it, directly on its sharding."""
    shape, dtype = tuple(param.shape), cfg.jnp_param_dtype
    if name == "value_w":
        key = jax.random.key(0)
        fn = lambda: (cfg.init_std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)  # noqa: E731
    elif name == "value_b":
        fn = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    else:
        raise ValueError(
            f"from_pretrained: parameter {name!r} is not loaded (internal layout error)"
        )
    return jax.jit(fn, out_shardings=sharding)()


def from_pretrained(
    path: str,
    *,
    dtype=None,
    param_dtype=None,
    moe_backend: str = "blocked",
    mesh: Optional[jax.sharding.Mesh] = None,
    **overrides,
) -> Transformer:
    """Load a HF checkpoint directory (config.json + *.safetensors) as a Transformer,
    streaming each tensor from its file onto its sharding.

    Nothing is materialised whole: every tensor is memory-mapped from its file on
    its own, converted (transposed, reshaped, cast) one device block at a time, and
    put only on the devices that hold that block, so peak host memory is the
    parameters' own device copies (on CPU devices) plus about one layer's block,
    and no device holds more than its shard. See docs/checkpoints.md.

    Args:
      path: directory with config.json and model.safetensors (or shards with
        model.safetensors.index.json).
      dtype: compute dtype (default float32).
      param_dtype: parameter dtype. Default: ``dtype`` when that is given, else the
        checkpoint's own dtype (bf16 files give bf16 parameters; F64 gives float32).
      moe_backend: 'blocked' | 'ragged' | 'dense'.
      mesh: if given, each parameter is placed on the sharding `param_shardings`
        gives it; else on the default device.
      **overrides: any other ModelConfig field (scan_layers, remat_policy,
        value_head, num_valid_tokens, ...). A value head, which checkpoints do not
        hold, is initialised as `Transformer` initialises it.

    Raises ValueError naming the architecture or config field that is unsupported,
    or the file and tensor that is missing, of the wrong shape or of a dtype that
    does not convert to floating-point parameters.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path}: no config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    infos = _read_checkpoint(path)
    if param_dtype is None:
        param_dtype = dtype if dtype is not None else _file_dtype(infos)
    dtype = jnp.dtype(dtype if dtype is not None else "float32").name
    param_dtype = jnp.dtype(param_dtype).name
    cfg = config_from_hf(
        hf, dtype=dtype, param_dtype=param_dtype, moe_backend=moe_backend, **overrides
    )
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    plan = _plan(model, _Checkpoint(path, infos, param_dtype))

    if mesh is not None:
        from gspo_jax.models.sharding import param_shardings

        by_path = dict(nnx.to_flat_state(param_shardings(nnx.state(model), mesh, cfg)))
        sharding_of = lambda graph_path: by_path[graph_path].get_value()  # noqa: E731
    else:
        device = jax.config.jax_default_device  # set by `with jax.default_device(...)`
        if not isinstance(device, jax.Device):
            device = jax.devices()[0]
        default = SingleDeviceSharding(device)
        sharding_of = lambda graph_path: default  # noqa: E731
    values = []
    with TensorReader() as reader:
        for graph_path, p in nnx.iter_graph(model):
            if not isinstance(p, nnx.Param):
                continue
            sharding = sharding_of(graph_path)
            if id(p) in plan:
                value = _load_param(p, plan[id(p)][1], sharding, cfg.jnp_param_dtype, reader)
            else:
                value = _init_param(str(graph_path[-1]), p, sharding, cfg)
            values.append((p, value))
    for p, value in values:
        p.set_value(value)
    return model


# ---------------------------------------------------------------- export
@functools.partial(jax.jit, static_argnames="dtype")
def _layer_as(a, r, dtype):
    return a[r].astype(dtype)


class _Fetch:
    """Host copies of parameters (or one layer of a stacked one) in the file dtype,
    one at a time: fetching the next frees the last, so the host holds one layer's
    tensor (for experts: one layer's [E, D, I] stack) at a time."""

    def __init__(self, dtype: np.dtype):
        self.dtype, self.key, self.value = dtype, None, None

    def __call__(self, param, r=None) -> np.ndarray:
        if self.key != (id(param), r):
            self.key, self.value = None, None  # free the previous copy first
            a = jnp.asarray(param[...])
            a = a.astype(self.dtype) if r is None else _layer_as(a, np.int32(r), self.dtype)
            if a.is_fully_addressable:
                value = jax.device_get(a)
            else:  # shards on several processes: every process takes part in the gather
                from jax.experimental import multihost_utils

                value = multihost_utils.process_allgather(a, tiled=True)
            self.key, self.value = (id(param), r), np.asarray(value)
        return self.value


def _export_entries(model: Transformer, dtype: np.dtype) -> list[tuple]:
    """``(name, hf_shape, produce)`` for every tensor of the HF checkpoint, in the
    order they are written; ``produce()`` returns the array (a view of the
    fetched parameter in the HF layout)."""
    cfg, fetch = model.cfg, _Fetch(dtype)
    out = []
    for i, (blk, r) in enumerate(_layer_slots(model)):
        pre = f"model.layers.{i}."
        for suffix, attr, _, to_hf in _layer_table(cfg, blk.is_moe):
            p = _get(blk, attr)

            def produce(p=p, r=r, to_hf=to_hf):
                w = fetch(p, r)
                return to_hf(w) if to_hf else w

            out.append((pre + suffix, _hf_shape(to_hf, p.shape[1:]), produce))
        if blk.is_moe:
            # One projection at a time over the experts: fetched once per layer.
            for attr in ("gate", "up", "down"):
                p = getattr(blk.mlp, attr)
                _, e, a, b = p.shape
                for x in range(e):
                    name = f"{pre}mlp.experts.{x}.{attr}_proj.weight"
                    out.append((name, (b, a), lambda p=p, r=r, x=x: fetch(p, r)[x].T))
    v, d = cfg.vocab_size, cfg.d_model
    out.append(("model.embed_tokens.weight", (v, d), lambda: fetch(model.embed)))
    out.append(("model.norm.weight", (d,), lambda: fetch(model.final_norm.scale)))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", (v, d), lambda: fetch(model.lm_head).T))
    return out


def export_pretrained(
    model: Transformer,
    path: str,
    *,
    dtype: Optional[str] = None,
    max_shard_size: Union[int, str] = "5GB",
) -> list[str]:
    """Write `model` as a HF checkpoint that transformers and vLLM load: config.json
    plus ``model.safetensors``, or, past ``max_shard_size``, shards
    ``model-0000k-of-0000N.safetensors`` with ``model.safetensors.index.json``.

    Streams: one parameter (or one layer of a stacked one) at a time is gathered
    from its devices to the host, converted and written, so the host holds about
    one tensor; parameters may be sharded over any mesh. With several processes,
    every process calls this (each gather is collective) and process 0 writes the
    files to ``path``, which it must be able to reach; the others return once the
    files are there. Weight files of an earlier export in ``path`` that this one does
    not overwrite are removed. The value head, which HF models lack, is not written.

    Args:
      dtype: tensor dtype in the files (default: the parameters' dtype, so bf16
        models export bf16).
      max_shard_size: bytes per file (an int, or "5GB", "500MB", "2GiB"); a tensor
        larger than that gets a file of its own.

    Returns the names of the weight files written (index included); [] on every
    process but 0.
    """
    cfg = model.cfg
    dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    hf = config_to_hf(cfg, dtype.name)
    hf["torch_dtype"] = dtype.name  # the key transformers < 4.56 (and vLLM with it) read
    entries = _export_entries(model, dtype)
    if not multihost.is_primary():
        for _, _, produce in entries:  # the gathers process 0 waits on
            produce()
        multihost.barrier("export_pretrained")
        return []
    files = write_sharded(
        path,
        [(name, dtype, shape) for name, shape, _ in entries],
        (produce() for _, _, produce in entries),
        max_shard_size=max_shard_size,
        metadata={"format": "pt"},
    )
    tmp = os.path.join(path, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(path, "config.json"))
    multihost.barrier("export_pretrained")
    return files
