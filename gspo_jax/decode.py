"""The sampler's device program: token sampling and the prefill + decode loop.

`gspo_jax.rollout.Sampler` validates and pads a call's arguments on the host and
calls `generate_jit`, one compiled function per `Spec` and argument shapes; its
module docstring describes what the program computes (sampling, randomness, router
noise, stopping) and what it records.  Here: the per-step draw (`sample_token`,
with the XLA:CPU formulations that `use_cpu_sampling` chooses) and the program
itself (`_generate`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from gspo_jax.routing import topk_router_logp

NOISE_STREAM = 2**31  # folded into rng for the router noise's keys (prompt ids are < 2**31)


# ----------------------------------------------------------------------------
# Token sampling (pure, per step).


def use_cpu_sampling() -> bool:
    """Whether token sampling uses its XLA:CPU formulations: the one backend
    check of this module (it decides `Spec.cpu`).

    Measured on XLA:CPU at a decode step's shapes (experiments/rollout.md,
    profiled at batch 64, V = 512): ``argmax`` lowers to a (value, index) pair
    reduction (~167 µs per token for the zero-weight guard over [64, 512]),
    several times slower than a min-reduction of one int32 operand
    (`_first_true`); ``jnp.cumsum`` to a reduce-window (~57 µs per token over
    512 entries), about 3x slower than two small triangular matmuls
    (`_cumsum`).  Elsewhere these would be wrong: the matmul cumsum is quadratic in V (about
    23 GFLOP per decode step at V = 152k and 512 rows), so every other backend
    uses the plain operations (``jnp.argmax``, ``jnp.cumsum``).  Both
    give the same tokens up to f32 rounding in the cumulative sum.
    """
    return jax.default_backend() == "cpu"


def _first_true(m: jax.Array, cpu: bool) -> jax.Array:
    """int32[B]: the first index j with m[:, j] True (0 when there is none), as
    ``argmax(m, axis=-1)``; on CPU a min-reduction of one int32 operand."""
    if not cpu:
        return jnp.argmax(m, axis=-1).astype(jnp.int32)
    n = m.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, m.shape, m.ndim - 1)
    j = jnp.min(jnp.where(m, iota, n), axis=-1)
    return jnp.where(j < n, j, 0)


def _argmax(x: jax.Array, cpu: bool, x_max: Optional[jax.Array] = None) -> jax.Array:
    """int32[B]: ``argmax(x, axis=-1)`` (the first maximum; the first NaN if
    any); on CPU through `_first_true`.  x_max: ``max(x, axis=-1)`` if known."""
    if not cpu:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if x_max is None:
        x_max = jnp.max(x, axis=-1)
    return _first_true((x == x_max[:, None]) | jnp.isnan(x), cpu)


def _cumsum(w: jax.Array, cpu: bool, block: int = 32) -> jax.Array:
    """``cumsum(w, axis=-1)`` for w f32[B, C]; on CPU as two small matmuls with
    triangular 0/1 matrices: prefix sums within blocks of ``block`` entries,
    plus the exclusive prefix of the block totals.  Those sums are f32 sums in
    another order, so they may differ from ``jnp.cumsum`` by rounding (a few
    ulp of the total; `_inverse_cdf` guards against the rounding picking an
    entry of zero weight)."""
    b, c = w.shape
    if not cpu or c <= block:
        return jnp.cumsum(w, axis=-1)
    nb = -(-c // block)
    wp = jnp.pad(w, ((0, 0), (0, nb * block - c))).reshape(b, nb, block)
    i = jnp.arange(block)
    within = jnp.einsum(
        "bnc,cd->bnd",
        wp,
        (i[:, None] <= i[None, :]).astype(w.dtype),
        precision=jax.lax.Precision.HIGHEST,
    )
    n = jnp.arange(nb)
    before = jnp.einsum(
        "bn,nm->bm",
        within[:, :, -1],
        (n[:, None] < n[None, :]).astype(w.dtype),
        precision=jax.lax.Precision.HIGHEST,
    )
    return (within + before[:, :, None]).reshape(b, nb * block)[:, :c]


def _inverse_cdf(x: jax.Array, u: jax.Array, cpu: bool) -> tuple[jax.Array, jax.Array]:
    """Index drawn from softmax(x) along the last axis, by inverse CDF.

    Args:
      x: f32[B, C] logits; -inf marks excluded entries (at least one finite).
      u: f32[B] uniforms in [0, 1).
      cpu: the XLA:CPU formulations (`use_cpu_sampling`).

    Returns:
      (int32[B]: the first j with cdf_j >= (1 - u) · total, which has w_j > 0;
       f32[B]: log_softmax(x)[j]).
    """
    x_max = jnp.max(x, axis=-1)
    shifted = x - x_max[:, None]
    w = jnp.exp(shifted)  # excluded entries: 0
    cdf = _cumsum(w, cpu)
    v = (1.0 - u)[:, None] * cdf[:, -1:]  # in (0, total]
    j = _first_true(cdf >= v, cpu)
    # Guard against rounding in the scan picking an entry of zero weight.
    wj = jnp.take_along_axis(w, j[:, None], axis=-1)[:, 0]
    j = jnp.where(wj > 0, j, _argmax(x, cpu, x_max))
    # log_softmax(x)[j], as jax.nn.log_softmax computes it.
    log_total = jnp.log(jnp.sum(w, axis=-1))
    return j, jnp.take_along_axis(shifted, j[:, None], axis=-1)[:, 0] - log_total


def sample_token(
    logits: jax.Array, u: jax.Array, temperature, *, greedy: bool, cpu: bool
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; the sampling step of the decode loop.

    Args:
      logits: f32[B, V], the policy's next-token logits ℓ.
      u: f32[B], uniforms in [0, 1) (one per row; the only randomness).
      temperature: f32[], τ > 0 (ignored when greedy).
      greedy: argmax ℓ instead of a draw.
      cpu: the XLA:CPU formulations (`use_cpu_sampling`).

    Returns:
      (tokens int32[B], logp f32[B] = log softmax(ℓ / τ)[token], the log-prob
       under the distribution sampled from; 0 for greedy).
    """
    if greedy:
        return _argmax(logits, cpu), jnp.zeros(logits.shape[:1], jnp.float32)
    return _inverse_cdf(logits / jnp.asarray(temperature, jnp.float32), u, cpu)


# ----------------------------------------------------------------------------
# The compiled generation function.


class Spec(NamedTuple):
    """Static configuration of one compiled generation function (its cache key
    together with the graphdef and the argument shapes)."""

    max_new_tokens: int
    num_samples: int  # G: each prompt's prefill is shared by its G rows
    greedy: bool  # temperature 0: argmax (the temperature itself is traced)
    cpu: bool  # the XLA:CPU sampling formulations (`use_cpu_sampling`)
    pad_id: int
    batch_sharding: Optional[NamedSharding]  # of [rows, ...] arrays
    router_noise: bool  # router_noise_std > 0 (the value itself is traced)
    routing: str = (
        "all"  # the routing record kept: all, response, none (`gspo_jax.rollout.ROUTING`)
    )
    prefix: bool = False  # rows go on from responses begun before (`gspo_jax.partial`)


class _Carry(NamedTuple):
    t: jax.Array  # int32[], the response index being sampled
    cache: Any  # the model's KVCache
    logits: jax.Array  # f32[B, V], next-token logits for response token t
    route: Optional[jax.Array]  # int32[B, L, K], routing of the position that gave them
    route_logp: Optional[jax.Array]  # f32[B, L, K], its router's log-softmax at `route`
    tokens: jax.Array  # int32[B, T]
    logp: jax.Array  # f32[B, T]
    experts: Optional[jax.Array]  # int32[B, T, L, K] (None: no routing record)
    router_logp: Optional[jax.Array]  # f32[B, T, L, K] (None: no routing record)
    stopped: jax.Array  # bool[B], emitted a stop token
    lengths: jax.Array  # int32[B]


def _repeat_rows(cache, g: int):
    """The KV cache of [b] prompts -> that of [b * g] rows (each prompt g times,
    consecutively).  Written against `gspo_jax.models.KVCache`'s fields."""
    names = tuple(f.name for f in dataclasses.fields(cache))
    if names != ("k", "v", "valid", "index"):
        raise ValueError(f"cache: expected a KVCache with fields (k, v, valid, index), got {names}")
    rep = lambda a: jnp.repeat(a, g, axis=0)  # per-layer k, v [b, ...]; valid [b, S]
    return cache.replace(
        k=jax.tree.map(rep, cache.k), v=jax.tree.map(rep, cache.v), valid=rep(cache.valid)
    )


def router_logp_at(aux, j: int) -> jax.Array:
    """f32[R, L, K]: at the forward's position j, the router's log-softmax over the
    experts, evaluated at the experts used: `topk_router_logp`, the trainer's
    formula, on ``aux.router_logits``, which hold the router noise when the forward
    was given one (the logits the sampler routed with)."""
    at = lambda x: x[:, j, None]  # [R, 1, L, X]
    return topk_router_logp(at(aux.router_logits), at(aux.topk_indices))[:, 0]


def noise_at(cfg, std, keys, positions) -> jax.Array:
    """The sampler's router noise, σ · N(0, 1) f32[R, T', L, E]: entry [r, t] drawn from
    fold_in(keys[r], positions[r, t]) (`gspo_jax.rollout`'s module docstring)."""
    shape = (cfg.num_moe_layers, cfg.num_experts)
    draw = lambda key, p: jax.random.normal(jax.random.fold_in(key, p), shape, jnp.float32)
    return std * jax.vmap(jax.vmap(draw, (None, 0)))(keys, positions)


def _generate(
    graphdef,
    state,
    rng,
    prompt_tokens,
    prompt_mask,
    prompt_ids,
    live,
    eos_ids,
    temperature,
    router_noise_std,
    spec: Spec,
    prefix=None,
    prefix_len=None,
):
    """Prefill + on-device decode loop; see `gspo_jax.rollout`'s module docstring.

    Shapes, with b prompts (bucketed) and B = b * G rows: prompt_tokens
    int32[b, P] (left-padded), prompt_mask bool[b, P], prompt_ids int32[b] (the
    keys), live bool[B] (False on padding rows), eos_ids int32[S] (the stop
    tokens; S may be 0), temperature / router_noise_std f32[] (the last used
    when ``spec.router_noise``).

    With ``spec.prefix`` (partial rollouts, `gspo_jax.partial`), row r goes on from
    the first ``prefix_len[r]`` (< T') tokens of a response begun before, ``prefix``
    int32[B, T']. After the prompts' prefill they are fed in one pass, right-aligned in
    W = T' - 1 columns, into cache columns [P, P + W) at RoPE positions that follow the
    prompt's; the next token is drawn from the logits after the last of them (after
    the prompt where ``prefix_len`` is 0), and the T new tokens follow in the cache.
    """
    nb, plen = prompt_tokens.shape
    G = spec.num_samples
    batch = nb * G
    steps = spec.max_new_tokens
    model = nnx.merge(graphdef, state)

    def shard(x, sharding=spec.batch_sharding):
        if sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, sharding)

    def rows(x):  # [b, ...] per prompt -> [B, ...] per row, prompt-major
        return shard(jnp.repeat(x, G, axis=0))

    # One uniform per (row, step), from the row's own key.
    sample_ids = jnp.tile(jnp.arange(G, dtype=jnp.int32), nb)
    if spec.greedy:
        uniforms = jnp.zeros((batch, steps), jnp.float32)
    else:

        def row_uniforms(i, g):
            key = jax.random.fold_in(jax.random.fold_in(rng, i), g)
            return jax.random.uniform(key, (steps,), jnp.float32)

        uniforms = shard(jax.vmap(row_uniforms)(rows(prompt_ids), sample_ids))

    # Router noise keys (`gspo_jax.rollout`'s module docstring): one per prompt (its sample 0's, for
    # the shared prefill) and one per row.
    prompt_keys = row_keys = None
    if spec.router_noise:
        noise_root = jax.random.fold_in(rng, NOISE_STREAM)
        row_key = lambda i, g: jax.random.fold_in(jax.random.fold_in(noise_root, i), g)
        prompt_keys = jax.vmap(row_key)(prompt_ids, jnp.zeros_like(prompt_ids))
        row_keys = jax.vmap(row_key)(rows(prompt_ids), sample_ids)

    def router_noise(keys, positions):
        return noise_at(model.cfg, router_noise_std, keys, positions) if spec.router_noise else None

    # Prefill, once per prompt; positions count real tokens only, so left
    # padding is invisible.  Then each prompt's cache is copied to its G rows.
    mask_i = prompt_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask_i, axis=1) - 1, 0)
    width = prefix.shape[1] - 1 if spec.prefix else 0
    cache = model.init_cache(nb, plen + width + steps - 1)
    logits, aux, cache = model.decode(
        prompt_tokens,
        cache,
        positions=positions,
        attn_mask=prompt_mask,
        last_only=True,
        router_noise=router_noise(prompt_keys, positions),
        prefill=True,
    )
    cache = _repeat_rows(cache, G)
    cache = cache.replace(
        k=jax.tree.map(shard, cache.k), v=jax.tree.map(shard, cache.v), valid=shard(cache.valid)
    )  # every cache array is [rows, ...]
    prompt_mask = rows(prompt_mask)
    n_prompt = jnp.sum(prompt_mask.astype(jnp.int32), axis=1)
    record = spec.routing != "none"  # the response tokens' routing (experts)
    if record:
        last_route = rows(aux.topk_indices[:, -1].astype(jnp.int32))  # [B, L, K]
        last_route_logp = rows(router_logp_at(aux, -1))
        route_shape = last_route.shape[1:]
    prompt_experts = None
    if spec.routing == "all":
        topk = rows(aux.topk_indices.astype(jnp.int32))  # [B, P, L, K]
        prompt_experts = jnp.where(prompt_mask[:, :, None, None], topk, -1)

    logits = rows(logits[:, 0].astype(jnp.float32))
    if spec.prefix:  # the responses so far, after the prompts (right-aligned in W)
        k = prefix_len.astype(jnp.int32)
        col = jnp.arange(width, dtype=jnp.int32)[None, :] - (width - k)[:, None]
        positions = n_prompt[:, None] + jnp.maximum(col, 0)
        right_aligned = jnp.take_along_axis(prefix, jnp.maximum(col, 0), axis=1)
        more, aux, cache = model.decode(
            jnp.where(col >= 0, right_aligned, spec.pad_id),
            cache,
            positions=positions,
            attn_mask=col >= 0,
            last_only=True,
            router_noise=router_noise(row_keys, positions),
        )
        going_on = k > 0
        logits = jnp.where(going_on[:, None], more[:, 0].astype(jnp.float32), logits)
        if record:
            on = going_on[:, None, None]
            last_route = jnp.where(on, aux.topk_indices[:, -1].astype(jnp.int32), last_route)
            last_route_logp = jnp.where(on, router_logp_at(aux, -1), last_route_logp)
        n_prompt = n_prompt + k  # the positions of the new tokens follow the prefix's

    carry = _Carry(
        t=jnp.zeros((), jnp.int32),
        cache=cache,
        logits=logits,
        route=last_route if record else None,
        route_logp=last_route_logp if record else None,
        tokens=shard(jnp.full((batch, steps), spec.pad_id, jnp.int32)),
        logp=shard(jnp.zeros((batch, steps), jnp.float32)),
        experts=shard(jnp.full((batch, steps) + route_shape, -1, jnp.int32)) if record else None,
        router_logp=shard(jnp.zeros((batch, steps) + route_shape, jnp.float32)) if record else None,
        stopped=jnp.zeros((batch,), bool),
        lengths=jnp.zeros((batch,), jnp.int32),
    )

    def emit(c: _Carry) -> tuple[_Carry, jax.Array]:
        """Samples response token c.t for every row still running and records it."""
        active = live & ~c.stopped
        u = jax.lax.dynamic_index_in_dim(uniforms, c.t, axis=1, keepdims=False)
        tok, lp = sample_token(c.logits, u, temperature, greedy=spec.greedy, cpu=spec.cpu)
        tok = jnp.where(active, tok, spec.pad_id)
        lp = jnp.where(active, lp, 0.0)
        hit = jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
        put = functools.partial(jax.lax.dynamic_update_index_in_dim, index=c.t, axis=1)
        on = active[:, None, None]
        c = c._replace(
            tokens=put(c.tokens, tok),
            logp=put(c.logp, lp),
            experts=put(c.experts, jnp.where(on, c.route, -1)) if record else None,
            router_logp=put(c.router_logp, jnp.where(on, c.route_logp, 0.0)) if record else None,
            stopped=c.stopped | (active & hit),
            lengths=jnp.where(active, c.t + 1, c.lengths),
        )
        return c, tok

    def body(c: _Carry) -> _Carry:
        c, tok = emit(c)
        positions = (n_prompt + c.t)[:, None]
        logits, aux, cache = model.decode(
            tok[:, None],
            c.cache,
            positions=positions,
            router_noise=router_noise(row_keys, positions),
        )
        return c._replace(
            t=c.t + 1,
            cache=cache,
            logits=logits[:, 0].astype(jnp.float32),
            route=aux.topk_indices[:, 0].astype(jnp.int32) if record else None,
            route_logp=router_logp_at(aux, 0) if record else None,
        )

    def cond(c: _Carry) -> jax.Array:
        return (c.t < steps - 1) & jnp.any(live & ~c.stopped)

    c = jax.lax.while_loop(cond, body, carry)
    c, _ = emit(c)  # the last token needs no forward of its own

    mask = jnp.arange(steps, dtype=jnp.int32)[None, :] < c.lengths[:, None]
    out = dict(
        tokens=c.tokens,
        mask=mask.astype(jnp.float32),
        lengths=c.lengths,
        truncated=~c.stopped,
        logp=c.logp,
        experts=c.experts,
        router_logp=c.router_logp,
        prompt_tokens=rows(prompt_tokens),
        prompt_mask=prompt_mask,
        prompt_experts=prompt_experts,
    )
    out = {k: None if v is None else shard(v) for k, v in out.items()}
    return dict(out, decode_steps=c.t)  # the steps run (forwards after the prefill)


generate_jit = jax.jit(_generate, static_argnums=(0,), static_argnames=("spec",))
