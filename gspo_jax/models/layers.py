"""Building blocks: parameters with logical axes, RMSNorm, RoPE, attention, SwiGLU.

Every module may be created with leading `stack` dimensions on all of its
parameters (logical axis 'layers'); `blocks.py` stacks identical layers
this way and slices them inside `lax.scan`, so the modules' forward code only
ever sees one layer's parameters.

Conventions: B batch, T query length, S key length, D d_model, H query heads,
G = H / KV query heads per KV head, hd head_dim, F MLP width.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gspo_jax.models import lora
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.sharding import logical_to_mesh_spec

# Finite "minus infinity" for masked attention scores: a row with no valid key
# gives a finite (uniform) softmax instead of NaN.
NEG_INF = -1e30


def make_param(
    rngs: Optional[nnx.Rngs],
    stack: Sequence[int],
    shape: Sequence[int],
    names: Sequence[Optional[str]],
    dtype,
    init: str = "normal",
    std: float = 0.02,
) -> nnx.Param:
    """A parameter of shape stack + shape with logical axis names.

    init: 'normal' (N(0, std^2)), 'ones' or 'zeros'.  `rngs` may be None for
    'ones' / 'zeros'.
    """
    full = tuple(stack) + tuple(shape)
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), full, jnp.float32)
    elif init == "ones":
        value = jnp.ones(full, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(full, jnp.float32)
    else:
        raise ValueError(f"make_param: unknown init {init!r}")
    names = ("layers",) * len(stack) + tuple(names)
    return nnx.Param(value.astype(dtype), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps), statistics in f32, result in x.dtype.

    Matches Qwen's RMSNorm: normalise in f32, cast back to the input dtype, then
    scale.
    """

    def __init__(self, dim: int, eps: float, *, stack=(), param_dtype=jnp.float32):
        self.eps = eps
        self.scale = make_param(None, stack, (dim,), ("norm",), param_dtype, "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        y = (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        scale = self.scale[...].astype(x.dtype)
        return scale.reshape((1,) * (y.ndim - 1) + scale.shape) * y


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
    """cos, sin f32[B, T, head_dim] for integer positions [B, T].

    inv_freq_j = theta^(-2j / head_dim), j < head_dim / 2; the angle table is
    duplicated over the two halves (the rotate-half convention of Llama/Qwen).
    """
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang = positions.astype(jnp.float32)[..., None] * inv[None, None, :]  # [B, T, hd/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, hd] rotated: x*cos + rotate_half(x)*sin, rotate_half(a,b)=(-b,a)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c = cos[:, :, None, :].astype(x.dtype)
    s = sin[:, :, None, :].astype(x.dtype)
    return x * c + rot * s


def attention_implementation(cfg: ModelConfig, dtype) -> str:
    """'xla' or 'cudnn': the `implementation` of `jax.nn.dot_product_attention` in
    the full forward, from ``cfg.attention_impl``.

    'auto' takes cuDNN's flash kernel (no [B, H, T, S] scores in memory, causal
    tiles skipped) where it applies, XLA's einsum attention elsewhere.  The one
    backend check: ``jax.default_backend() == 'gpu'`` (this project's GPUs are
    NVIDIA's; cuDNN is CUDA-only), with the kernel's own limits on the inputs: f16
    or bf16, head_dim a multiple of 8 and <= 128 (256 on Hopper; 128 holds on every
    GPU).  Its third limit, an even length when a mask is differentiated, is met by
    padding (`_pad_to_even`).  TPUs and CPUs get 'xla': a TPU flash kernel (Pallas
    splash attention) is not wired in, so there the scores of one layer exist at a
    time (and remat policies other than 'dots' keep them out of the saved
    residuals).
    """
    impl = cfg.attention_impl
    if impl != "auto":
        return impl
    ok = (
        jax.default_backend() == "gpu"
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and cfg.head_dim % 8 == 0
        and cfg.head_dim <= 128
    )
    return "cudnn" if ok else "xla"


def fused_cached_attention(cfg: ModelConfig) -> bool:
    """Whether the KV-cache path of `Attention` (the sampler's prefill and decode steps)
    runs through the fused kernel of `attention_implementation` (cuDNN's flash attention
    on a GPU: no [B, H, T, S] scores over the cache in memory), or through einsums over
    every cached slot.

    The one backend choice is `attention_implementation`'s ('cudnn' here). On the CPU
    the einsums are kept: a decode step's attention at the rollout benchmark's shapes
    (batch 64, 2 KV heads x 2 query heads of 32) took 63 us per layer with the einsums
    against 153 us through ``jax.nn.dot_product_attention(implementation='xla')``
    (80 slots; 2.2 against 8.5 ms at 1,024 slots), which needs the keys as [S, hd]
    per head: XLA:CPU's product with that operand is the slow one
    (experiments/rollout.md, 2026-11-25)."""
    return attention_implementation(cfg, cfg.jnp_dtype) == "cudnn"


def cache_layouts(cfg: ModelConfig) -> tuple[str, str]:
    """The axis order of one layer's cached keys and values (b rows, k KV heads, s slots,
    h head_dim): keys [B, KV, hd, S] and values [B, KV, S, hd] for the einsums (a decode
    step's scores are then a plain [G, hd] x [hd, S] product per (row, KV head), 3x
    faster on XLA:CPU than with [S, hd] keys); both [B, S, KV, hd] for the fused kernel,
    its operands' layout (another would be transposed, the whole cache, every step)."""
    return ("bskh", "bskh") if fused_cached_attention(cfg) else ("bkhs", "bksh")


def _attention_with_lse(q, k, v, mask, scale: float, impl: str, causal: bool):
    """Attention of q [B, T, H, hd] over k, v [B, S, KV, hd] under mask bool[B, 1, T, S],
    and the log-sum-exp of each query's scaled, masked scores: (out [B, T, H, hd] in q's
    dtype, lse f32[B, T, H]).  ``causal``: the mask is also causal (T == S); cuDNN then
    skips the tiles above the diagonal.

    Through cuDNN, the function ``jax.nn.dot_product_attention`` itself calls: jax.nn
    returns cuDNN's log-sum-exp (computed in f32) rounded to the output's dtype, and a
    bf16 log-sum-exp (error up to |lse| / 256) would misweigh the new tokens against
    the cache in `Attention._attend_cached_fused`. (A private module of jax: setup.cfg
    pins jax below 0.13.)"""
    if impl == "cudnn":
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

        out, lse = dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            scale=scale,
            mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
            qkv_layout="BTNH",
            return_residual=True,
        )
        return out, lse.astype(jnp.float32).swapaxes(1, 2)  # cuDNN's stats are [B, H, T]
    out, lse = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal, implementation=impl, return_residual=True
    )
    return out, lse.astype(jnp.float32)


def rows_sharded(cfg: ModelConfig, *xs):
    """``xs`` constrained to the rows' sharding (the config's 'batch' rule) and
    replicated on every other axis, under a mesh set with `jax.set_mesh`; unchanged
    without one. cuDNN's attention partitioner refuses q, k and v sharded unlike
    ("Query, key and value should have same sharding"), which is what sharding
    propagation gives under FSDP when the KV heads do not divide over the devices
    (Qwen3-30B-A3B's 4 over 8 GPUs: experiments/compile_report.py)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return xs

    def one(x):
        names = ("batch",) + (None,) * (x.ndim - 1)
        return jax.lax.with_sharding_constraint(
            x, logical_to_mesh_spec(names, x.shape, cfg.axis_rules, mesh)
        )

    return tuple(one(x) for x in xs)


def _pad_to_even(q, k, v, mask):
    """One more position on q, k, v [B, T, N, hd] and the mask [B, 1, T, T] when T is
    odd (cuDNN's backward with a mask needs even lengths): the new key is visible to
    no query (the mask is False there; it is also later than every query), and the
    new query's output is dropped by the caller."""
    if q.shape[1] % 2 == 0:
        return q, k, v, mask
    widen = lambda a: jnp.pad(a, ((0, 0), (0, 1), (0, 0), (0, 0)))
    return widen(q), widen(k), widen(v), jnp.pad(mask, ((0, 0), (0, 0), (0, 1), (0, 1)))


def attention_mask(q_slots: jax.Array, k_slots: jax.Array, k_valid: jax.Array) -> jax.Array:
    """bool[B, T, S]: query at slot q may see key slot s iff s <= q and s is valid.

    q_slots int32[T], k_slots int32[S], k_valid bool[B, S].
    """
    causal = k_slots[None, :] <= q_slots[:, None]  # [T, S]
    return causal[None, :, :] & k_valid[:, None, :]


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k RMSNorm and q/k/v bias.

    Parameters: q [D, H, hd], k/v [D, KV, hd], o [H, hd, D] (+ biases [H|KV, hd],
    q_norm / k_norm scales [hd]; LoRA adapters, `gspo_jax.models.lora`).
    """

    # weight -> (LoRA target, lead dims, input dims, dims): `lora.add_adapters`.
    LORA_WEIGHTS = {
        "q": ("q", 0, 1, 3),
        "k": ("k", 0, 1, 3),
        "v": ("v", 0, 1, 3),
        "o": ("o", 0, 2, 3),
    }

    def __init__(self, cfg: ModelConfig, *, stack=(), rngs: nnx.Rngs):
        d, h, kv, hd, pd = (
            cfg.d_model,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.jnp_param_dtype,
        )
        self.cfg = cfg
        std = cfg.init_std
        self.q = make_param(rngs, stack, (d, h, hd), ("embed", "heads", "head_dim"), pd, std=std)
        self.k = make_param(
            rngs, stack, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd, std=std
        )
        self.v = make_param(
            rngs, stack, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd, std=std
        )
        self.o = make_param(rngs, stack, (h, hd, d), ("heads", "head_dim", "embed"), pd, std=std)
        if cfg.qkv_bias:
            self.q_bias = make_param(None, stack, (h, hd), ("heads", "head_dim"), pd, "zeros")
            self.k_bias = make_param(None, stack, (kv, hd), ("kv_heads", "head_dim"), pd, "zeros")
            self.v_bias = make_param(None, stack, (kv, hd), ("kv_heads", "head_dim"), pd, "zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, stack=stack, param_dtype=pd)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, stack=stack, param_dtype=pd)

    def __call__(self, x, cos, sin, mask, cache=None):
        """Self-attention of x [B, T, D].

        cos/sin f32[B, T, hd] at the tokens' positions; mask bool[B, T, T] over the
        T tokens themselves (query t may see token s).

        With cache = (k_layers, v_layers, layer, cache_mask): the KV cache of every
        layer (sequences of arrays holding earlier tokens, in the cache's dtype and
        `cache_layouts`: keys [B, KV, hd, S] and values [B, KV, S, hd] for the
        einsums, both [B, S, KV, hd] for the fused kernel), this layer's index (a
        Python int, or an int32 scalar inside a scan over layers) and cache_mask
        bool[B, T, S] (None: the cache is empty, and the new tokens attend among
        themselves only).  The queries attend to the S cached slots and the T new
        tokens at once, one softmax over S + T scores:

            p_t = softmax([q_t . k_s / sqrt(hd)]_{s < S} ++ [q_t . k_u / sqrt(hd)]_{u < T}),
            out_t = sum_s p_ts v_s (cached) + sum_u p_tu v_u (new),

        which equals attention over a cache into which the new keys had been
        written first.  The cache is only read here; the caller writes the returned
        new keys/values into it.  A traced `layer` selects the layer's arrays with
        `lax.switch` around the attention itself, so each branch reads its layer's
        buffer where it lies (a dynamic slice of a stacked cache would copy the
        whole layer every token).  The new keys/values are rounded to the cache's
        dtype before use, as if read back from it.  Where `fused_cached_attention`
        holds (cuDNN on a GPU) the fused kernel computes it
        (`_attend_cached_fused`), elsewhere einsums over every slot
        (`_attend_cached`).

        Returns (out [B, T, D], (k, v) of the T new tokens: with a cache, in its
        layouts with T slots, in its dtype; without one, both [B, KV, T, hd] in x's
        dtype).
        """
        cfg = self.cfg
        dt = x.dtype
        b, t, _ = x.shape
        q, k, v = (
            lora.einsum("btd,dnh->btnh", x, lora.weight(self, w, dt), n_out=2) for w in "qkv"
        )
        if cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt)[None, None]
            k = k + self.k_bias[...].astype(dt)[None, None]
            v = v + self.v_bias[...].astype(dt)[None, None]
        if cfg.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)  # [B, T, H, hd]
        k = apply_rope(k, cos, sin)  # [B, T, KV, hd]
        scale = cfg.head_dim**-0.5
        if cache is None:
            # The full forward (training, log-prob passes): q [B, T, H, hd] against
            # k, v [B, T, KV, hd] under the slot mask [B, 1, T, T] (causal & key
            # valid, one mask for all heads).  The XLA implementation does the
            # decode path's arithmetic below (f32 scores, scaled, masked to a
            # finite minimum, f32 softmax, probabilities in x's dtype) with the same
            # head grouping (query head n reads KV head n // G).  is_causal repeats
            # what the mask says; it lets cuDNN skip the tiles above the diagonal.
            impl = attention_implementation(cfg, dt)
            qkvm = (q, k, v, mask[:, None])
            if impl == "cudnn":
                qkvm = _pad_to_even(*rows_sharded(cfg, *qkvm))
            out = jax.nn.dot_product_attention(
                *qkvm[:3],
                mask=qkvm[3],
                scale=scale,
                is_causal=impl == "cudnn",
                implementation=impl,
            )[:, :t]
            # [B, T, H, hd]; saved by the remat policy 'dots_no_scores'
            # (blocks.CHECKPOINT_POLICIES), which saves no [B, H, T, S] scores.
            out = checkpoint_name(out, "attn_ctx")
            k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, KV, T, hd], the cache's layout
        elif fused_cached_attention(cfg):
            out, k, v = self._attend_cached_fused(q, k, v, mask, cache, scale)
        else:
            out, k, v = self._attend_cached(q, k, v, mask, cache, scale)
        return lora.einsum("btnh,nhd->btd", out, lora.weight(self, "o", dt)), (k, v)

    def _attend_cached_fused(self, q, k, v, mask, cache, scale):
        """The KV-cache path of `__call__` through the fused kernel
        (`fused_cached_attention`), keys and values cached as [B, S, KV, hd].  One kernel
        call attends the T new tokens among themselves (causal, ``mask``); with a
        cache that holds tokens, another attends them to its valid slots
        (``cache_mask``), and the two are merged by their log-sum-exps:

            lse = logaddexp(lse_c, lse_n),  out = e^(lse_c - lse) out_c + e^(lse_n - lse) out_n,

        which is the one softmax over S + T scores of `__call__`'s docstring, with no
        [B, H, T, S] scores in memory, no copy of the cache and no write into it (the
        caller writes the new keys after the layer stack).  Returns (out [B, T, H, hd],
        new keys and values [B, T, KV, hd] in the cache's dtype)."""
        cfg = self.cfg
        dt = q.dtype
        impl = attention_implementation(cfg, dt)
        k_layers, v_layers, layer, cache_mask = cache
        k = k.astype(k_layers[0].dtype)  # [B, T, KV, hd]: the cache's layout
        v = v.astype(v_layers[0].dtype)

        def attend(keys, values, m, causal):
            qkvm = rows_sharded(cfg, q, keys.astype(dt), values.astype(dt), m[:, None])
            return _attention_with_lse(*qkvm, scale, impl, causal)

        out_new, lse_new = attend(k, v, mask, causal=True)
        if cache_mask is None:  # an empty cache (`Transformer.decode(prefill=True)`)
            return out_new, k, v

        def attend_cache(j):  # this layer's queries over layer j's cache, merged
            out_c, lse_c = attend(k_layers[j], v_layers[j], cache_mask, causal=False)
            lse = jnp.logaddexp(lse_c, lse_new)
            weigh = lambda out, part: jnp.exp(part - lse)[..., None] * out.astype(jnp.float32)
            return (weigh(out_c, lse_c) + weigh(out_new, lse_new)).astype(dt)

        if isinstance(layer, int):
            return attend_cache(layer), k, v
        out = jax.lax.switch(
            layer, [functools.partial(attend_cache, j) for j in range(len(k_layers))]
        )
        return out, k, v

    def _attend_cached(self, q, k, v, mask, cache, scale):
        """The KV-cache path of `__call__` (prefill and decode steps), in einsums:
        one softmax over the cached slots' and the new tokens' scores.  Returns
        (out [B, T, H, hd], new keys [B, KV, hd, T], new values [B, KV, T, hd])."""
        cfg = self.cfg
        dt = q.dtype
        b, t = q.shape[:2]
        k_layers, v_layers, layer, cache_mask = cache
        k = k.swapaxes(1, 2).astype(k_layers[0].dtype)  # [B, KV, T, hd]
        v = v.swapaxes(1, 2).astype(v_layers[0].dtype)
        kvh = cfg.num_kv_heads
        g = cfg.num_heads // kvh
        qg = q.reshape(b, t, kvh, g, cfg.head_dim).transpose(0, 2, 3, 1, 4)  # [B, KV, G, T, hd]

        def scores(keys, m, spec="bkgth,bksh->bkgts"):
            # keys [B, KV, S', hd] (or [B, KV, hd, S'] with spec "...,bkhs->..."),
            # m bool[B, T, S'] -> f32[B, KV, G, T, S']
            s = jnp.einsum(spec, qg, keys.astype(dt), preferred_element_type=jnp.float32) * scale
            return jnp.where(m[:, None, None, :, :], s, NEG_INF)

        def mix(p, values):  # p [B, KV, G, T, S'], values [B, KV, S', hd] -> [B, KV, G, T, hd]
            return jnp.einsum("bkgts,bksh->bkgth", p.astype(dt), values.astype(dt))

        s_new = scores(k, mask)
        if cache_mask is None:  # an empty cache (`Transformer.decode(prefill=True)`)
            out = mix(jax.nn.softmax(s_new, axis=-1), v)
            out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_heads, cfg.head_dim)
            return out, k.swapaxes(2, 3), v

        def attend(j):  # this layer's queries over layer j's cache + the new tokens
            kc, vc = k_layers[j], v_layers[j]  # [B, KV, hd, S], [B, KV, S, hd]
            s_cached = scores(kc, cache_mask, "bkgth,bkhs->bkgts")
            p = jax.nn.softmax(jnp.concatenate([s_cached, s_new], axis=-1), axis=-1)
            return mix(p[..., : vc.shape[2]], vc) + mix(p[..., vc.shape[2] :], v)

        if isinstance(layer, int):
            out = attend(layer)
        else:
            out = jax.lax.switch(
                layer, [functools.partial(attend, j) for j in range(len(k_layers))]
            )
        out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_heads, cfg.head_dim)
        return out, k.swapaxes(2, 3), v  # keys [B, KV, hd, T]: the cached keys' layout


def swiglu(x, w_gate, w_up, w_down):
    """down(silu(x @ gate) * (x @ up)) for x [..., D], gate/up [D, F], down [F, D]."""
    h = jax.nn.silu(x @ w_gate) * (x @ w_up)
    return h @ w_down


class MLP(nnx.Module):
    """Dense SwiGLU feed-forward: gate/up [D, F], down [F, D] (+ LoRA adapters)."""

    LORA_WEIGHTS = {"gate": ("gate", 0, 1, 2), "up": ("up", 0, 1, 2), "down": ("down", 0, 1, 2)}

    def __init__(self, cfg: ModelConfig, *, stack=(), rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.jnp_param_dtype
        self.gate = make_param(rngs, stack, (d, f), ("embed", "mlp"), pd, std=cfg.init_std)
        self.up = make_param(rngs, stack, (d, f), ("embed", "mlp"), pd, std=cfg.init_std)
        self.down = make_param(rngs, stack, (f, d), ("mlp", "embed"), pd, std=cfg.init_std)

    def __call__(self, x):
        dt = x.dtype
        if hasattr(self, "lora"):
            gate, up, down = (lora.weight(self, w, dt) for w in ("gate", "up", "down"))
            h = jax.nn.silu(lora.einsum("...d,df->...f", x, gate)) * lora.einsum(
                "...d,df->...f", x, up
            )
            return lora.einsum("...f,fd->...d", h, down)
        return swiglu(x, *(lora.weight(self, w, dt) for w in ("gate", "up", "down")))
