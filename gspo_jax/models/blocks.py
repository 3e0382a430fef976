"""The layer stack: the decoder layer and the segments that stack its repeats.

The layer kinds (dense / MoE, `ModelConfig.layer_kinds`) are cut into segments
(`plan_segments`), each a unit of consecutive layer kinds repeated n times, e.g.
"1 dense, then 47 MoE" -> [(D,) x 1, (M,) x 47] and "MoE every 2nd layer" ->
[(D, M) x 24].  A `Segment` stores each unit position's parameters stacked over
its n repeats (leading logical axis 'layers'); `Transformer`'s forward runs
`lax.scan` over the repeats (one compiled body per segment, rematerialised under
one of `CHECKPOINT_POLICIES`) or, with `scan_layers=False`, an unrolled loop over the
same parameters.
"""

from __future__ import annotations

import jax
from flax import nnx

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import MLP, Attention, RMSNorm
from gspo_jax.models.moe import MoE


def plan_segments(
    kinds: tuple[bool, ...], max_period: int = 4
) -> list[tuple[tuple[bool, ...], int]]:
    """Greedy cut of layer kinds into (unit, repeats): at each point, the unit of
    <= max_period layers whose repeats cover the most layers (ties: shorter)."""
    out, i, n = [], 0, len(kinds)
    while i < n:
        best = None
        for p in range(1, min(max_period, n - i) + 1):
            unit = kinds[i : i + p]
            r = 1
            while i + (r + 1) * p <= n and kinds[i + r * p : i + (r + 1) * p] == unit:
                r += 1
            score = r * p if r > 1 else 1  # a unit that does not repeat: take 1 layer
            if best is None or score > best[0]:
                best = (score, unit, r)
        out.append((best[1], best[2]))
        i += len(best[1]) * best[2]
    return out


_CP = jax.checkpoint_policies
# What the backward pass of a rematerialised layer group reads back instead of
# recomputing.  'dots' saves every dot_general output, the full forward's attention
# scores [B, KV, G, T, S] (f32) and probabilities @ values among them: L layers of
# B * H * T^2 * 4 bytes.  'dots_no_scores' saves the dot_generals without batch
# dims (q/k/v/o projections, dense MLP, router logits) and the attention output
# [B, T, H, hd] (named "attn_ctx" in layers.Attention); the backward pass then
# recomputes one layer's scores at a time.  No policy saves the experts' grouped
# products (`lax.ragged_dot` is not a dot_general; the CPU backend's are batched).
# tests/test_memory.py checks what each policy saves.
CHECKPOINT_POLICIES = {
    "full": _CP.nothing_saveable,
    "dots": _CP.checkpoint_dots,
    "dots_no_batch": _CP.dots_with_no_batch_dims_saveable,
    "dots_no_scores": _CP.save_from_both_policies(
        _CP.dots_with_no_batch_dims_saveable, _CP.save_only_these_names("attn_ctx")
    ),
}


class Block(nnx.Module):
    """Pre-norm decoder layer: x + Attn(norm(x)), then x + FFN(norm(x))."""

    def __init__(self, cfg: ModelConfig, moe: bool, *, stack=(), rngs: nnx.Rngs):
        pd = cfg.jnp_param_dtype
        self.is_moe = moe
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, stack=stack, param_dtype=pd)
        self.attn = Attention(cfg, stack=stack, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, stack=stack, param_dtype=pd)
        self.mlp = MoE(cfg, stack=stack, rngs=rngs) if moe else MLP(cfg, stack=stack, rngs=rngs)

    def __call__(self, x, cos, sin, mask, token_mask, replay=None, cache=None, router_noise=None):
        a, kv = self.attn(self.attn_norm(x), cos, sin, mask, cache)
        x = x + a
        h = self.mlp_norm(x)
        if self.is_moe:
            y, stats = self.mlp(h, token_mask, replay, router_noise)
        else:
            y, stats = self.mlp(h), None
        return x + y, stats, kv


class Segment(nnx.Module):
    """`repeats` copies of a unit of layers; parameters stacked over repeats."""

    def __init__(self, cfg: ModelConfig, unit: tuple[bool, ...], repeats: int, *, rngs):
        self.unit = tuple(unit)
        self.repeats = repeats
        self.blocks = nnx.List([Block(cfg, kind, stack=(repeats,), rngs=rngs) for kind in unit])
