"""Rollout: a jit-compiled batched sampler with a KV cache that records what RL needs.

A `Sampler` (built once, called every RL step and at every evaluation) turns a
list of prompts into ``len(prompts) * num_samples`` responses, prompt-major (row
``r = i * num_samples + g`` is sample g of prompt i), and returns a `Rollout`
that holds, per response token:

* ``logp``, the log-prob of the token under the distribution that drew it,
  softmax(logits / temperature) (0 for greedy decoding).  The trainer keeps it as
  the batch's ``rollout_logp``: the sampler's side of the train-inference
  mismatch metrics and of the rollout correction.  The objectives' old log-probs
  π_old are not these: the trainer recomputes them with its own forward at the
  same temperature (the old-log-prob pass, `gspo_jax.step.logprob_pass`);
* the MoE routing record (R3): the top-K experts every MoE layer chose at the
  forward position that produced the token, and those of the prompt prefill
  (`replay_r3` aligns them with the trainer's forward).

How it runs
-----------
1. Host side (once per call): prompts are left-padded to one length P (the
   sampler's ``prompt_len``; without one, the call's longest prompt), the prompt
   list is padded to a *batch bucket* b (a power of two, or a multiple of one, so
   that the B = b * G rows divide over the data-parallel shards), and every array
   is placed on the device (sharded over the mesh's data axes when a mesh is
   given).  The trainer passes ``prompt_len=rollout.max_prompt_len`` and a fixed
   prompt count per call site, so it compiles one program per call site for the
   whole run.
2. Device side, one ``jax.jit``-compiled function per (B, P, max_new_tokens, G,
   greedy or not, routing record): one prefill of the [b, P] prompts into a KV
   cache, then a ``lax.while_loop`` that samples token t from the last logits,
   records it and feeds it back through ``model.decode`` (one token per row),
   until every row has stopped or ``max_new_tokens`` tokens are out.  Nothing
   returns to the host between tokens.

The prefill runs once per prompt, on [b, P], and its KV cache is copied to the
prompt's G rows; it projects only the last prompt position to logits
(``decode(..., last_only=True)``).  The decode step's cost is the model's
(`Transformer.decode`); see experiments/rollout.md.

Sampling (per row, per step, logits ℓ ∈ R^V):

* greedy (``temperature == 0``): o_t = argmax ℓ; ``logp`` = 0 (log 1).
* otherwise o_t is drawn from softmax(ℓ / temperature) by inverse-CDF sampling
  with one uniform u_{r,t}.  How the cumulative sum and argmax are computed
  depends on the backend, in one place: `_use_cpu_sampling`.

RL trains on the log-probs of the distribution that sampled, so the sampler
offers no truncation of it (top-k, top-p): the trainer would not compute the
truncated distribution's log-probs, and the gradient would be biased.

Randomness: row r = (prompt i, sample g) uses the key
``fold_in(fold_in(rng, prompt_ids[i]), g)`` and draws all its uniforms from it,
so a row's sample does not depend on the other rows of the batch, on the
padding, or on the prompt's position in the list (pass the same ``prompt_ids``
to reproduce a prompt's samples in another batch).

Router noise (``router_noise_std`` σ > 0): a controllable sampler/trainer
mismatch.  The sampler adds N(0, σ²) noise to the router logits of every MoE
layer at every token it feeds (prefill and decode steps), before top-K and the
gates; the trainer's forwards never do.  The noise of row r at the token of
RoPE position p is σ · normal(fold_in(k_r, p)) of shape [L, E], with
``k_r = fold_in(fold_in(fold_in(rng, NOISE_STREAM), prompt_ids[i]), g)``
(NOISE_STREAM = 2**31, outside the prompt ids' range, so the uniforms' keys are
untouched); the prompt's prefill, shared by its G rows, uses sample 0's key.
So it is independent per token, layer and expert, and, like the uniforms, a
row's noise does not depend on the batch or the padding.  Everything recorded
is the noisy forward's: ``experts`` holds the experts actually used, ``logp``
the log-prob of the distribution that drew the token.  σ is a traced value
(changing it does not recompile); σ = 0 (the default) runs the noise-free
program, bit for bit.

Stopping: a row stops after emitting any ``eos_id`` token, inside the response
only; the stop token belongs to the response (mask 1).  A row that emits
``max_new_tokens`` tokens without stopping is ``truncated``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence, Union

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["ROUTING", "Rollout", "Sampler", "replay_r3"]

# What of the routing record a rollout keeps (`Sampler.__call__`'s ``routing``):
# everything (R3 replays it), the response tokens' only (``experts``: the
# sampler/trainer routing mismatch), or nothing.
ROUTING = ("all", "response", "none")
NOISE_STREAM = 2**31  # folded into rng for the router noise's keys (prompt ids are < 2**31)


def replay_r3(prompt_experts: jax.Array, experts: jax.Array) -> jax.Array:
    """int32[N, P+T-1, L, K]: the R3 replay array of a rollout's routing record, for
    the forward whose logits at positions P-1 ... P+T-2 give the response log-probs
    (the input ``concat(prompt_tokens, tokens)`` without its last token).

    Position j < P routes prompt token j (``prompt_experts[:, j]``); position P + t
    routes response token t, whose routing the sampler recorded when it fed o_t to
    produce o_{t+1} (``experts[:, t+1]``).  ``experts[:, 0]`` is the last prompt
    position's, which ``prompt_experts[:, P-1]`` already holds.
    """
    return jnp.concatenate([prompt_experts, experts[:, 1:]], axis=1)


@flax.struct.dataclass
class Rollout:
    """Sampled responses and the record RL needs, N = len(prompts) * num_samples
    rows in prompt-major order (row i * num_samples + g is sample g of prompt i).

    T = max_new_tokens, P = the padded prompt length (left padding included),
    L = number of MoE layers, K = experts per token.

    Attributes:
      tokens: int32[N, T], the response; ``pad_id`` after the row stopped.
      mask: f32[N, T], 1.0 on the response tokens (the stop token included),
        0.0 after.  ``mask[r, t] = t < lengths[r]``.
      lengths: int32[N], number of response tokens (= mask.sum(-1)).
      truncated: bool[N], reached T tokens without emitting a stop token.
      logp: f32[N, T], the log-prob of o_t under the distribution that drew it,
        log softmax(logits / temperature)[o_t] (0 for greedy decoding, which
        draws with probability 1).  The trainer's ``rollout_logp``; the
        objectives' old log-probs come from the trainer's own forward (module
        docstring).  0 where mask is 0.
      experts: int32[N, T, L, K], the R3 routing record: experts[r, t] is the
        top-K chosen by every MoE layer at the forward position whose output
        produced o_t, i.e. the input position (P - 1 + t) of the padded sequence
        ``concat(prompt_tokens, tokens)`` (the last prompt token for t = 0).  It
        is aligned with logp[r, t].  -1 where mask is 0.  With router noise, the
        experts actually used (the noisy router's top-K); logp is then that of
        the noisy forward too.  None when the sampler was asked for no routing
        record (``routing="none"``).
      prompt_tokens: int32[N, P], the prompts, left-padded with ``pad_id``.
      prompt_mask: bool[N, P], True on real prompt tokens.
      prompt_experts: int32[N, P, L, K], the prefill's top-K at every prompt
        position; -1 on padding.  ``prompt_experts[:, P-1] == experts[:, 0]``.
        None unless the sampler was asked for the whole record (``routing="all"``).
    """

    tokens: jax.Array
    mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    logp: jax.Array
    experts: jax.Array
    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    prompt_experts: jax.Array

    def replay(self) -> jax.Array:
        """int32[N, P+T, L, K]: the R3 replay array (`replay_r3`) for a forward over
        the full sequence ``concat(prompt_tokens, tokens)``.  The last response
        token is never fed during sampling, so its position holds -1 (free
        routing); no response log-prob depends on it.  Needs the whole record
        (``routing="all"``)."""
        if self.prompt_experts is None or self.experts is None:
            raise ValueError(
                "Rollout.replay: the rollout has no prompt routing record; sample with "
                "routing='all'"
            )
        tail = jnp.full_like(self.experts[:, :1], -1)
        return jnp.concatenate([replay_r3(self.prompt_experts, self.experts), tail], axis=1)


# ----------------------------------------------------------------------------
# Token sampling (pure, per step).


def _use_cpu_sampling() -> bool:
    """Whether token sampling uses its XLA:CPU formulations: the one backend
    check of this module (it decides `_Spec.cpu`).

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
      cpu: the XLA:CPU formulations (`_use_cpu_sampling`).

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


def _sample_token(
    logits: jax.Array, u: jax.Array, temperature, *, greedy: bool, cpu: bool
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; the sampling step of the decode loop.

    Args:
      logits: f32[B, V], the policy's next-token logits ℓ.
      u: f32[B], uniforms in [0, 1) (one per row; the only randomness).
      temperature: f32[], τ > 0 (ignored when greedy).
      greedy: argmax ℓ instead of a draw.
      cpu: the XLA:CPU formulations (`_use_cpu_sampling`).

    Returns:
      (tokens int32[B], logp f32[B] = log softmax(ℓ / τ)[token], the log-prob
       under the distribution sampled from; 0 for greedy).
    """
    if greedy:
        return _argmax(logits, cpu), jnp.zeros(logits.shape[:1], jnp.float32)
    return _inverse_cdf(logits / jnp.asarray(temperature, jnp.float32), u, cpu)


# ----------------------------------------------------------------------------
# The compiled generation function.


class _Spec(NamedTuple):
    """Static configuration of one compiled generation function (its cache key
    together with the graphdef and the argument shapes)."""

    max_new_tokens: int
    num_samples: int  # G: each prompt's prefill is shared by its G rows
    greedy: bool  # temperature 0: argmax (the temperature itself is traced)
    cpu: bool  # the XLA:CPU sampling formulations (`_use_cpu_sampling`)
    pad_id: int
    batch_sharding: Optional[NamedSharding]  # of [rows, ...] arrays
    router_noise: bool  # router_noise_std > 0 (the value itself is traced)
    routing: str = "all"  # the routing record kept: all, response, none (ROUTING)


class _Carry(NamedTuple):
    t: jax.Array  # int32[], the response index being sampled
    cache: Any  # the model's KVCache
    logits: jax.Array  # f32[B, V], next-token logits for response token t
    route: Optional[jax.Array]  # int32[B, L, K], routing of the position that gave them
    tokens: jax.Array  # int32[B, T]
    logp: jax.Array  # f32[B, T]
    experts: Optional[jax.Array]  # int32[B, T, L, K] (None: no routing record)
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
    spec: _Spec,
):
    """Prefill + on-device decode loop; see the module docstring.

    Shapes, with b prompts (bucketed) and B = b * G rows: prompt_tokens
    int32[b, P] (left-padded), prompt_mask bool[b, P], prompt_ids int32[b] (the
    keys), live bool[B] (False on padding rows), eos_ids int32[S] (the stop
    tokens; S may be 0), temperature / router_noise_std f32[] (the last used
    when ``spec.router_noise``).
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

    # Router noise keys (module docstring): one per prompt (its sample 0's, for
    # the shared prefill) and one per row.
    prompt_keys = row_keys = None
    if spec.router_noise:
        noise_root = jax.random.fold_in(rng, NOISE_STREAM)
        row_key = lambda i, g: jax.random.fold_in(jax.random.fold_in(noise_root, i), g)
        prompt_keys = jax.vmap(row_key)(prompt_ids, jnp.zeros_like(prompt_ids))
        row_keys = jax.vmap(row_key)(rows(prompt_ids), sample_ids)

    def router_noise(keys, positions):
        """None when off, else σ · N(0, 1) f32[R, T', L, E]: entry [r, t] drawn
        from fold_in(keys[r], positions[r, t])."""
        if not spec.router_noise:
            return None
        shape = (model.cfg.num_moe_layers, model.cfg.num_experts)
        draw = lambda key, p: jax.random.normal(jax.random.fold_in(key, p), shape, jnp.float32)
        return router_noise_std * jax.vmap(jax.vmap(draw, (None, 0)))(keys, positions)

    # Prefill, once per prompt; positions count real tokens only, so left
    # padding is invisible.  Then each prompt's cache is copied to its G rows.
    mask_i = prompt_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask_i, axis=1) - 1, 0)
    cache = model.init_cache(nb, plen + steps - 1)
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
        route_shape = last_route.shape[1:]
    prompt_experts = None
    if spec.routing == "all":
        topk = rows(aux.topk_indices.astype(jnp.int32))  # [B, P, L, K]
        prompt_experts = jnp.where(prompt_mask[:, :, None, None], topk, -1)

    carry = _Carry(
        t=jnp.zeros((), jnp.int32),
        cache=cache,
        logits=rows(logits[:, 0].astype(jnp.float32)),
        route=last_route if record else None,
        tokens=shard(jnp.full((batch, steps), spec.pad_id, jnp.int32)),
        logp=shard(jnp.zeros((batch, steps), jnp.float32)),
        experts=shard(jnp.full((batch, steps) + route_shape, -1, jnp.int32)) if record else None,
        stopped=jnp.zeros((batch,), bool),
        lengths=jnp.zeros((batch,), jnp.int32),
    )

    def emit(c: _Carry) -> tuple[_Carry, jax.Array]:
        """Samples response token c.t for every row still running and records it."""
        active = live & ~c.stopped
        u = jax.lax.dynamic_index_in_dim(uniforms, c.t, axis=1, keepdims=False)
        tok, lp = _sample_token(c.logits, u, temperature, greedy=spec.greedy, cpu=spec.cpu)
        tok = jnp.where(active, tok, spec.pad_id)
        lp = jnp.where(active, lp, 0.0)
        hit = jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
        put = functools.partial(jax.lax.dynamic_update_index_in_dim, index=c.t, axis=1)
        c = c._replace(
            tokens=put(c.tokens, tok),
            logp=put(c.logp, lp),
            experts=(
                put(c.experts, jnp.where(active[:, None, None], c.route, -1)) if record else None
            ),
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
        prompt_tokens=rows(prompt_tokens),
        prompt_mask=prompt_mask,
        prompt_experts=prompt_experts,
    )
    return {k: None if v is None else shard(v) for k, v in out.items()}


_generate_jit = jax.jit(_generate, static_argnums=(0,), static_argnames=("spec",))


# ----------------------------------------------------------------------------
# Host side: validation, padding, placement.


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _token_list(seq, name: str, vocab_size: int) -> list[int]:
    """A non-empty sequence of token ids in [0, vocab_size), or ValueError."""
    if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
        raise ValueError(f"{name}: expected a sequence of token ids, got {type(seq).__name__}")
    arr = np.asarray(seq)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(
            f"{name}: expected a non-empty 1-D sequence of token ids, got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}: token ids must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        raise ValueError(
            f"{name}: token id {int(arr[bad][0])} outside [0, vocab_size={vocab_size})"
        )
    return arr.astype(np.int32).tolist()


class Sampler:
    """A batched sampler bound to one model structure; split the model once, call
    it every RL step (passing the latest parameters as ``state=``).

    Compiled functions are cached per (batch bucket, prompt length P,
    max_new_tokens, number of stop tokens, sampling mode): temperature and
    router_noise_std are traced values, so changing them does not recompile;
    greedy-vs-sampling, whether router noise is on (router_noise_std > 0) and
    the routing record kept (``routing``) are static.

    Args:
      graphdef, state: ``nnx.split(model)`` of a model with the
        ``init_cache`` / ``decode`` API of `gspo_jax.models.Transformer`.
      vocab_size: V, for input validation.
      mesh: optional device mesh; the batch is sharded over ``data_axes`` and the
        parameters keep whatever sharding ``state`` has.
      data_axes: mesh axes the batch is sharded over (default: those of
        ("data", "fsdp", "expert") that the mesh has: the trainer's batch axes).
      prompt_len: every prompt is left-padded to this many tokens (a longer one
        raises ValueError), so every call compiles the same program; None: to
        the longest prompt of each call.
    """

    def __init__(
        self,
        graphdef,
        state,
        *,
        vocab_size: int,
        mesh: Optional[Mesh] = None,
        data_axes: Optional[Sequence[str]] = None,
        prompt_len: Optional[int] = None,
    ):
        if not (_is_int(vocab_size) and vocab_size > 0):
            raise ValueError(f"vocab_size: must be a positive int, got {vocab_size!r}")
        if prompt_len is not None and not (_is_int(prompt_len) and prompt_len > 0):
            raise ValueError(f"prompt_len: must be a positive int or None, got {prompt_len!r}")
        self.graphdef = graphdef
        self.state = state
        self.vocab_size = int(vocab_size)
        self.prompt_len = None if prompt_len is None else int(prompt_len)
        self.mesh = mesh
        if mesh is None:
            if data_axes is not None:
                raise ValueError("data_axes: given without a mesh")
            self.data_axes, self.data_shards = (), 1
            self._sharding = None
        else:
            if data_axes is None:
                data_axes = tuple(a for a in ("data", "fsdp", "expert") if a in mesh.axis_names)
            data_axes = tuple(data_axes)
            for a in data_axes:
                if a not in mesh.axis_names:
                    raise ValueError(
                        f"data_axes: {a!r} is not an axis of the mesh {tuple(mesh.axis_names)}"
                    )
            self.data_axes = data_axes
            self.data_shards = math.prod(mesh.shape[a] for a in data_axes)
            self._sharding = NamedSharding(mesh, PartitionSpec(data_axes or None))

    @classmethod
    def from_model(cls, model: nnx.Module, **kwargs) -> "Sampler":
        """Splits ``model`` once; kwargs as for the constructor."""
        graphdef, state = nnx.split(model)
        return cls(graphdef, state, vocab_size=model.cfg.vocab_size, **kwargs)

    def padded_prompt_len(self, length: int) -> int:
        """The padded prompt length P used for a longest prompt of ``length``."""
        if self.prompt_len is None:
            return length
        if length > self.prompt_len:
            raise ValueError(
                f"prompts: a prompt of {length} tokens is longer than the sampler's "
                f"prompt_len={self.prompt_len}"
            )
        return self.prompt_len

    def batch_bucket(self, num_prompts: int, num_samples: int) -> int:
        """The padded prompt count b (rows B = b * num_samples): the smallest
        multiple of next_pow2(num_prompts) that makes B a multiple of the data
        shard count."""
        step = _next_pow2(num_prompts)
        b = step
        while (b * num_samples) % self.data_shards:
            b += step
        return b

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        rng: jax.Array,
        temperature: float = 1.0,
        eos_id: Union[None, int, Sequence[int]] = None,
        pad_id: int = 0,
        prompt_ids: Optional[Sequence[int]] = None,
        state=None,
        router_noise_std: float = 0.0,
        routing: str = "all",
    ) -> Rollout:
        """Samples ``num_samples`` responses for every prompt.

        Args:
          prompts: list of token-id lists (each non-empty, ids in [0, V)).
          num_samples: G, responses per prompt.
          max_new_tokens: T, the response length bound (and the output width).
          rng: a JAX PRNG key (typed or raw uint32[2]).
          temperature: τ >= 0; 0 = greedy.
          eos_id: a token id or a list of them; emitting one stops the row.
          pad_id: the token written at padding (prompt and response).
          prompt_ids: distinct ints, one per prompt, folded into the row keys
            (default 0 .. len(prompts) - 1).  The same prompt with the same
            prompt id and rng gives the same samples in any batch.
          state: parameters to use instead of ``self.state`` (same structure).
          router_noise_std: σ >= 0 of the Gaussian noise added to the sampler's
            router logits (every MoE layer, every token fed; module docstring):
            a controllable sampler/trainer routing mismatch.  0 = none.
          routing: the routing record to keep (static: each value is a program
            of its own): "all" (``experts`` and ``prompt_experts``, what R3
            replays), "response" (``experts`` only; ``prompt_experts`` is None)
            or "none" (both None: no [N, T, L, K] record in the decode loop).

        Returns:
          a `Rollout` with N = len(prompts) * num_samples rows (device arrays).
        """
        args, spec, n_rows = self._prepare(
            prompts,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            rng=rng,
            temperature=temperature,
            eos_id=eos_id,
            pad_id=pad_id,
            prompt_ids=prompt_ids,
            state=state,
            router_noise_std=router_noise_std,
            routing=routing,
        )
        # Traced on the mesh, as the trainer's programs are: the ragged MoE dispatch
        # takes its per-device row groups (and expert parallelism) from it.
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            out = _generate_jit(*args, spec=spec)
        if n_rows < out["tokens"].shape[0]:
            out = {k: None if v is None else v[:n_rows] for k, v in out.items()}
        return Rollout(**out)

    def _prepare(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        rng: jax.Array,
        temperature: float = 1.0,
        eos_id: Union[None, int, Sequence[int]] = None,
        pad_id: int = 0,
        prompt_ids: Optional[Sequence[int]] = None,
        state=None,
        router_noise_std: float = 0.0,
        routing: str = "all",
    ):
        """Validates the arguments of `__call__` and builds the compiled
        function's arguments: (positional args, spec, number of real rows)."""
        V = self.vocab_size
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
            raise ValueError("prompts: expected a non-empty list of token-id lists")
        plist = [_token_list(p, f"prompts[{i}]", V) for i, p in enumerate(prompts)]
        for name, val in (("num_samples", num_samples), ("max_new_tokens", max_new_tokens)):
            if not (_is_int(val) and val >= 1):
                raise ValueError(f"{name}: must be an int >= 1, got {val!r}")
        if not (
            isinstance(temperature, (int, float, np.integer, np.floating))
            and math.isfinite(temperature)
            and temperature >= 0
        ):
            raise ValueError(f"temperature: must be a finite float >= 0, got {temperature!r}")
        if not (
            isinstance(router_noise_std, (int, float, np.integer, np.floating))
            and not isinstance(router_noise_std, (bool, np.bool_))
            and math.isfinite(router_noise_std)
            and router_noise_std >= 0
        ):
            raise ValueError(
                f"router_noise_std: must be a finite float >= 0, got {router_noise_std!r}"
            )
        if routing not in ROUTING:
            raise ValueError(f"routing: must be one of {ROUTING}, got {routing!r}")
        if not (_is_int(pad_id) and 0 <= pad_id < V):
            raise ValueError(f"pad_id: must be a token id in [0, {V}), got {pad_id!r}")
        if eos_id is None:
            eos = []
        elif _is_int(eos_id):
            eos = _token_list([eos_id], "eos_id", V)
        else:
            eos = _token_list(eos_id, "eos_id", V)
        n, G = len(plist), int(num_samples)
        if prompt_ids is None:
            pids = np.arange(n, dtype=np.int64)
        else:
            pids = np.asarray(prompt_ids)
            if pids.shape != (n,) or not np.issubdtype(pids.dtype, np.integer):
                raise ValueError(
                    f"prompt_ids: expected {n} ints (one per prompt), got {pids.shape} {pids.dtype}"
                )
            if len(set(pids.tolist())) != n:
                raise ValueError("prompt_ids: must be distinct (equal ids give equal samples)")
            if pids.min() < 0 or pids.max() >= 2**31:
                raise ValueError("prompt_ids: must be in [0, 2**31)")
        rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
        if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            if rng.shape != (2,) or rng.dtype != jnp.uint32:
                raise ValueError(f"rng: expected a PRNG key, got {rng.dtype}{list(rng.shape)}")
            rng = jax.random.wrap_key_data(rng)
        if rng.shape != ():
            raise ValueError(f"rng: expected a single key, got shape {rng.shape}")

        # Padded, left-aligned host arrays.
        N = n * G
        P = self.padded_prompt_len(max(len(p) for p in plist))
        nb = self.batch_bucket(n, G)
        B = nb * G
        toks = np.full((nb, P), pad_id, np.int32)
        pmask = np.zeros((nb, P), bool)
        for i, p in enumerate(plist):
            toks[i, P - len(p) :] = p
            pmask[i, P - len(p) :] = True
        pmask[n:, -1] = True  # padding prompts: one pad token, discarded
        pid = np.zeros((nb,), np.int32)
        pid[:n] = pids
        live = np.arange(B) < N

        spec = _Spec(
            max_new_tokens=int(max_new_tokens),
            num_samples=G,
            greedy=temperature == 0,
            cpu=_use_cpu_sampling(),
            pad_id=int(pad_id),
            batch_sharding=self._sharding,
            router_noise=bool(router_noise_std > 0),
            routing=routing,
        )
        if self._sharding is None:
            put = put_prompts = jnp.asarray
        else:
            put = functools.partial(jax.device_put, device=self._sharding)
            # The prefill batch is sharded too where it divides evenly.
            put_prompts = (
                put
                if nb % self.data_shards == 0
                else functools.partial(
                    jax.device_put, device=NamedSharding(self.mesh, PartitionSpec())
                )
            )
        args = (
            self.graphdef,
            self.state if state is None else state,
            rng,
            put_prompts(toks),
            put_prompts(pmask),
            put_prompts(pid),
            put(live),
            jnp.asarray(np.asarray(eos, np.int32)),
            jnp.float32(temperature if temperature > 0 else 1.0),
            jnp.float32(router_noise_std),
        )
        return args, spec, N
