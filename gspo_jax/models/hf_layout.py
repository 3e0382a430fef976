"""The Hugging Face layout of Qwen3-MoE, Qwen3 and Qwen2, and its mapping to ours.

What reading (`hf_load`) and writing (`hf_export`) a checkpoint share: the
supported architectures, config.json <-> ModelConfig, and for each layer the
tensor names with their layout conversions (HF nn.Linear stores [out, in]):

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

import jax
import jax.numpy as jnp

from gspo_jax.models.config import ModelConfig
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
def layer_slots(model: Transformer):
    """For each layer i in order: (block module, repeat index r)."""
    slots = []
    for seg in model.segments:
        for r in range(seg.repeats):
            for blk in seg.blocks:
                slots.append((blk, r))
    return slots


def dotted_attr(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def layer_table(cfg: ModelConfig, moe: bool):
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


def hf_shape(to_hf, shape) -> tuple[int, ...]:
    """The checkpoint shape of a tensor whose shape in our layout is ``shape``."""
    if to_hf is None:
        return tuple(shape)
    return tuple(jax.eval_shape(to_hf, jax.ShapeDtypeStruct(tuple(shape), jnp.float32)).shape)
