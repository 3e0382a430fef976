"""Building blocks: parameters with logical axes, RMSNorm, RoPE, attention, SwiGLU.

Every module may be created with leading `stack` dimensions on all of its
parameters (logical axis 'layers'); `transformer.py` stacks identical layers
this way and slices them inside `lax.scan`, so the modules' forward code only
ever sees one layer's parameters.

Conventions: B batch, T query length, S key length, D d_model, H query heads,
G = H / KV query heads per KV head, hd head_dim, F MLP width.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models.config import ModelConfig

# Finite "minus infinity" for masked attention scores: a row with no valid key
# gives a finite (uniform) softmax instead of NaN.
NEG_INF = -1e30


def make_param(rngs: Optional[nnx.Rngs], stack: Sequence[int], shape: Sequence[int],
               names: Sequence[Optional[str]], dtype, init: str = "normal",
               std: float = 0.02) -> nnx.Param:
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


def attention_mask(q_slots: jax.Array, k_slots: jax.Array, k_valid: jax.Array) -> jax.Array:
  """bool[B, T, S]: query at slot q may see key slot s iff s <= q and s is valid.

  q_slots int32[T], k_slots int32[S], k_valid bool[B, S].
  """
  causal = k_slots[None, :] <= q_slots[:, None]  # [T, S]
  return causal[None, :, :] & k_valid[:, None, :]


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, optional q/k RMSNorm and q/k/v bias.

  Parameters: q [D, H, hd], k/v [D, KV, hd], o [H, hd, D] (+ biases [H|KV, hd],
  q_norm / k_norm scales [hd]).
  """

  def __init__(self, cfg: ModelConfig, *, stack=(), rngs: nnx.Rngs):
    d, h, kv, hd, pd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_param_dtype
    self.cfg = cfg
    std = cfg.init_std
    self.q = make_param(rngs, stack, (d, h, hd), ("embed", "heads", "head_dim"), pd, std=std)
    self.k = make_param(rngs, stack, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd, std=std)
    self.v = make_param(rngs, stack, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd, std=std)
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

    cos/sin f32[B, T, hd] at the tokens' positions.  Without `cache`, keys are
    the T tokens themselves and mask is bool[B, T, T].  With cache = (k, v,
    index) (k, v [B, S, KV, hd] in compute dtype, index int32 scalar), the new
    keys/values are written at slots [index, index + T), attention runs over
    all S slots with mask bool[B, T, S], and the updated (k, v) is returned.

    Returns (out [B, T, D], (k, v) of the keys attended to).
    """
    cfg = self.cfg
    dt = x.dtype
    b, t, _ = x.shape
    q = jnp.einsum("btd,dnh->btnh", x, self.q[...].astype(dt))
    k = jnp.einsum("btd,dnh->btnh", x, self.k[...].astype(dt))
    v = jnp.einsum("btd,dnh->btnh", x, self.v[...].astype(dt))
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(dt)[None, None]
      k = k + self.k_bias[...].astype(dt)[None, None]
      v = v + self.v_bias[...].astype(dt)[None, None]
    if cfg.qk_norm:
      q = self.q_norm(q)
      k = self.k_norm(k)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    if cache is not None:
      k_cache, v_cache, index = cache
      k = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, index, 0, 0))
      v = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, index, 0, 0))
    kvh = cfg.num_kv_heads
    g = cfg.num_heads // kvh
    qg = q.reshape(b, t, kvh, g, cfg.head_dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(dt),
                        preferred_element_type=jnp.float32)
    scores = scores * (cfg.head_dim ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(dt))
    out = out.reshape(b, t, cfg.num_heads, cfg.head_dim)
    return jnp.einsum("btnh,nhd->btd", out, self.o[...].astype(dt)), (k, v)


def swiglu(x, w_gate, w_up, w_down):
  """down(silu(x @ gate) * (x @ up)) for x [..., D], gate/up [D, F], down [F, D]."""
  h = jax.nn.silu(x @ w_gate) * (x @ w_up)
  return h @ w_down


class MLP(nnx.Module):
  """Dense SwiGLU feed-forward: gate/up [D, F], down [F, D]."""

  def __init__(self, cfg: ModelConfig, *, stack=(), rngs: nnx.Rngs):
    d, f, pd = cfg.d_model, cfg.d_ff, cfg.jnp_param_dtype
    self.gate = make_param(rngs, stack, (d, f), ("embed", "mlp"), pd, std=cfg.init_std)
    self.up = make_param(rngs, stack, (d, f), ("embed", "mlp"), pd, std=cfg.init_std)
    self.down = make_param(rngs, stack, (f, d), ("mlp", "embed"), pd, std=cfg.init_std)

  def __call__(self, x):
    dt = x.dtype
    return swiglu(x, self.gate[...].astype(dt), self.up[...].astype(dt), self.down[...].astype(dt))
