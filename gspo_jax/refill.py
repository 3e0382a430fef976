"""The refilling decode program: a fixed number of decode slots that take the next
waiting rows as rows finish (`gspo_jax.rollout.Sampler`'s ``slots``; the run's
``rollout.decode_slots``).

The batch program (`gspo_jax.decode`) decodes all its rows together until the longest
one ends. A step's responses are long-tailed (a group's few long answers among many
short ones), and a decode step reads the weights and the whole cache however few of its
rows are live, so the tail's steps cost what full ones do. Here the N rows of a call
(prompts x samples, prompt-major) wait in a queue in their order, and S slots decode
them, each slot one row at a time:

1. **Fill.** While rows wait and at least min(C, rows waiting) slots are free, the next
   C rows (``chunk``) are prefilled into a fresh [C, P + T - 1] cache and their first
   token is drawn from the prefill's last logits; the C caches, first tokens and
   records move into the first free slots (a scatter of C slots; chunk entries past the
   last row go nowhere). At the start every slot is free.
2. **Step.** Every slot feeds its row's last token at the row's own cache column
   P + t - 1 (`KVCache.index` per row) and RoPE position, and draws the row's next
   token; a row that emits a stop token or its T-th token frees its slot. A free slot
   computes a step that is discarded (the shapes are fixed).
3. Fill and step until no slot is live: one ``while_loop`` with the fills nested in it,
   compiled once per shape; nothing returns to the host between tokens.

A row's computation is the batch program's for it: the prefill of its prompt, the same
cache columns and RoPE positions, its uniforms drawn from its own key
``fold_in(fold_in(rng, prompt_id), g)``, its router noise from its own keys. So its
tokens and log-probs do not depend on its slot or on when it ran, and on CPU in f32 they
are the batch program's, bit for bit (tests/test_refill.py). Where the two programs
differ is cost: the batch program prefills each prompt once and copies the cache to its
G rows, this one prefills every row (G times the prefill's FLOPs, in [C, P] chunks).

Records: a slot keeps its row's tokens, log-probs and routing record in per-slot
buffers [S, T, ...], written in place each step (under a mesh, on the slot's device: no
write across devices per token); they move to the row's place in the outputs
[B, T, ...] when the slot is refilled, and after the loop for the last rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.config_fields import err, setting
from gspo_jax.decode import NOISE_STREAM, Spec, noise_at, router_logp_at, sample_token
from gspo_jax.models.transformer import write_slots


@dataclasses.dataclass(frozen=True)
class SlotSettings:
    """The decode slots of ``config.rollout`` (`gspo_jax.rollout.RolloutConfig` extends
    this), and their rules against the step's rows and the sampler's mesh."""

    decode_slots: int = setting(
        0,
        low=0,
        resume=True,
        doc="0: the sampler decodes a call's rows all at once, until the longest ends; n: in "
        "n slots, each taking the next waiting row as its row finishes (gspo_jax.refill)",
    )
    refill_chunk: int = setting(
        8,
        low=1,
        resume=True,
        doc="with decode_slots: rows prefilled together into freed slots (a fill waits for "
        "this many free slots, or for all the rows still waiting)",
    )

    def check_run(self, run, ctx) -> None:
        """Fewer slots than a step's rows, a multiple of the sampler's batch shards, and
        a chunk no larger than the slots."""
        n = self.decode_slots
        if not n:
            return
        rows = run.rollout.prompts_per_step * run.rollout.group_size
        if n >= rows:
            raise err(
                "rollout.decode_slots",
                f"{n} slots hold all {rows} rows of a step (prompts_per_step*group_size) at "
                "once: nothing is refilled; use 0",
            )
        shape = ctx.mesh_shape
        shards = ctx.batch_shards
        if run.rollout.devices:  # the sampler's own mesh (`gspo_jax.offpolicy.sampler_mesh`)
            copy = shape["fsdp"] * shape["expert"] * shape["tensor"]
            shards = run.rollout.devices // copy * shape["fsdp"] * shape["expert"]
        if n % shards:
            raise err(
                "rollout.decode_slots",
                f"{n} is not a multiple of the sampler's {shards} batch shards "
                "(data*fsdp*expert of its mesh), over which the slots divide",
            )
        if self.refill_chunk > n:
            raise err(
                "rollout.refill_chunk", f"{self.refill_chunk} is more than the {n} decode_slots"
            )


class RefillSpec(NamedTuple):
    """Static configuration of one refilling program: the batch program's settings
    (sampling, stop, routing record, sharding) and the slots."""

    batch: Spec
    slots: int  # S, rows decoded at once
    chunk: int  # C, rows prefilled together when slots free


class _State(NamedTuple):
    cache: Any  # the model's KVCache of the S slots
    row: jax.Array  # int32[S]: the row a slot decodes (B: none yet)
    t: jax.Array  # int32[S]: its row's tokens emitted so far
    free: jax.Array  # bool[S]: its row has finished (or it has none)
    stopped: jax.Array  # bool[S]: its row emitted a stop token
    last: jax.Array  # int32[S]: its row's last token, fed at the next step
    n_prompt: jax.Array  # int32[S]: its row's prompt length
    uniforms: jax.Array  # f32[S, T]: its row's uniforms
    noise_keys: Optional[jax.Array]  # key[S]: its row's router-noise key
    buf: dict  # per slot: tokens, logp [S, T]; experts, router_logp [S, T, L, K]
    out: dict  # per row [B, ...]: the same, lengths, truncated, prompt_experts
    next_row: jax.Array  # int32[]: the first row waiting
    steps: jax.Array  # int32[]: decode steps run


def _at(buf: jax.Array, t: jax.Array) -> jax.Array:
    """buf[s, t[s]] for every slot s (buf [S, T, ...])."""
    return jax.vmap(lambda b, i: jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False))(buf, t)


def _record(buf: jax.Array, x: jax.Array, t: jax.Array, live: jax.Array) -> jax.Array:
    """buf [S, T, ...] with x[s] at column t[s] of every live slot s (the others kept:
    a free slot's buffer still holds its finished row until it is refilled)."""
    on = live.reshape(live.shape + (1,) * (x.ndim - 1))
    return write_slots(buf, jnp.where(on, x, _at(buf, t))[:, None], t, 1)


def _generate_refill(
    graphdef,
    state,
    rng,
    prompt_tokens,
    prompt_mask,
    prompt_ids,
    n_rows,
    eos_ids,
    temperature,
    router_noise_std,
    spec: RefillSpec,
):
    """The refilling program; see the module docstring.

    Shapes, with b prompts (bucketed) and B = b * G output rows: prompt_tokens
    int32[b, P] (left-padded), prompt_mask bool[b, P], prompt_ids int32[b] (the keys),
    n_rows int32[] (the real rows N <= B, decoded in order), eos_ids int32[E], temperature
    and router_noise_std f32[]. Returns the batch program's outputs (`gspo_jax.decode`)
    and ``decode_steps``, the steps the slots ran.
    """
    s = spec.batch
    nb, plen = prompt_tokens.shape
    G, T, S, C = s.num_samples, s.max_new_tokens, spec.slots, spec.chunk
    B = nb * G
    model = nnx.merge(graphdef, state)
    record = s.routing != "none"
    shard = (
        (lambda x: x)
        if s.batch_sharding is None
        else (lambda x: jax.lax.with_sharding_constraint(x, s.batch_sharding))
    )

    def key_of(root, rows, sample):  # row r = sample g of prompt r // G
        fold = lambda r, g: jax.random.fold_in(jax.random.fold_in(root, prompt_ids[r // G]), g)
        return jax.vmap(fold)(rows, sample)

    noise_root = jax.random.fold_in(rng, NOISE_STREAM)

    def noise(keys, positions):
        return noise_at(model.cfg, router_noise_std, keys, positions) if s.router_noise else None

    def flush(st: _State, slots: jax.Array) -> dict:
        """The outputs with the rows of ``slots`` (S: none) written from their buffers."""
        at = jnp.minimum(slots, S - 1)
        rows = jnp.where(slots < S, st.row[at], B)
        put = lambda a, v: shard(a.at[rows].set(v[at], mode="drop"))
        out = {k: put(st.out[k], v) for k, v in st.buf.items()}
        out["lengths"] = put(st.out["lengths"], st.t)
        out["stopped"] = put(st.out["stopped"], st.stopped)
        return {**st.out, **out}

    def fill(st: _State) -> _State:
        k = jnp.minimum(C, n_rows - st.next_row)
        rank = jnp.cumsum(st.free.astype(jnp.int32)) - 1
        take = st.free & (rank < k)
        slot_of = (
            jnp.full((C,), S, jnp.int32)
            .at[jnp.where(take, rank, C)]
            .set(jnp.arange(S, dtype=jnp.int32), mode="drop")
        )  # chunk entry j -> its slot (S: none)
        out = flush(st, slot_of)
        j = jnp.arange(C, dtype=jnp.int32)
        rows = jnp.where(j < k, st.next_row + j, B)
        r = jnp.minimum(rows, B - 1)
        ptok, pmask = prompt_tokens[r // G], prompt_mask[r // G]
        positions = jnp.maximum(jnp.cumsum(pmask.astype(jnp.int32), axis=1) - 1, 0)
        logits, aux, cache = model.decode(
            ptok,
            model.init_cache(C, plen + T - 1),
            positions=positions,
            attn_mask=pmask,
            last_only=True,
            router_noise=noise(key_of(noise_root, r, jnp.zeros_like(r)), positions),
            prefill=True,
        )
        if s.greedy:
            u = jnp.zeros((C, T), jnp.float32)
        else:
            u = jax.vmap(lambda key: jax.random.uniform(key, (T,), jnp.float32))(
                key_of(rng, r, r % G)
            )
        tok, lp = sample_token(
            logits[:, 0].astype(jnp.float32), u[:, 0], temperature, greedy=s.greedy, cpu=s.cpu
        )
        hit = jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)

        def first(x0, empty):  # [C, T, ...]: x0 at column 0, ``empty`` after
            full = jnp.full((C, T) + x0.shape[1:], empty, x0.dtype)
            return full.at[:, 0].set(x0)

        put = lambda a, v: shard(a.at[slot_of].set(v, mode="drop"))
        new = dict(tokens=first(tok, s.pad_id), logp=first(lp, 0.0))
        if record:
            new["experts"] = first(aux.topk_indices[:, -1].astype(jnp.int32), -1)
            new["router_logp"] = first(router_logp_at(aux, -1), 0.0)
        if s.routing == "all":
            topk = aux.topk_indices.astype(jnp.int32)
            routed = jnp.where(pmask[:, :, None, None], topk, -1)
            out["prompt_experts"] = shard(out["prompt_experts"].at[rows].set(routed, mode="drop"))
        return st._replace(
            cache=st.cache.replace(
                k=tuple(map(put, st.cache.k, cache.k)),
                v=tuple(map(put, st.cache.v, cache.v)),
                valid=put(st.cache.valid, cache.valid),
            ),
            row=put(st.row, rows),
            t=put(st.t, jnp.ones_like(rows)),
            free=put(st.free, hit | (T == 1)),
            stopped=put(st.stopped, hit),
            last=put(st.last, tok),
            n_prompt=put(st.n_prompt, jnp.sum(pmask.astype(jnp.int32), axis=1)),
            uniforms=put(st.uniforms, u),
            noise_keys=put(st.noise_keys, key_of(noise_root, r, r % G)) if s.router_noise else None,
            buf={name: put(st.buf[name], v) for name, v in new.items()},
            out=out,
            next_row=st.next_row + k,
        )

    def fill_cond(st: _State) -> jax.Array:
        waiting = n_rows - st.next_row
        return (waiting > 0) & (jnp.sum(st.free.astype(jnp.int32)) >= jnp.minimum(C, waiting))

    def step(st: _State) -> _State:
        live = ~st.free
        col = jnp.minimum(plen + st.t - 1, plen + T - 2)  # the last token's cache column
        positions = (st.n_prompt + st.t - 1)[:, None]
        logits, aux, cache = model.decode(
            st.last[:, None],
            st.cache.replace(index=col),
            positions=positions,
            router_noise=noise(st.noise_keys, positions),
        )
        t = jnp.minimum(st.t, T - 1)
        tok, lp = sample_token(
            logits[:, 0].astype(jnp.float32),
            _at(st.uniforms, t),
            temperature,
            greedy=s.greedy,
            cpu=s.cpu,
        )
        hit = live & jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
        buf = dict(tokens=_record(st.buf["tokens"], tok, t, live))
        buf["logp"] = _record(st.buf["logp"], lp, t, live)
        if record:
            route = aux.topk_indices[:, 0].astype(jnp.int32)
            buf["experts"] = _record(st.buf["experts"], route, t, live)
            buf["router_logp"] = _record(st.buf["router_logp"], router_logp_at(aux, 0), t, live)
        n = jnp.where(live, st.t + 1, st.t)
        st = st._replace(
            cache=cache,
            t=n,
            free=st.free | hit | (n >= T),
            stopped=st.stopped | hit,
            last=jnp.where(live, tok, st.last),
            buf=buf,
            steps=st.steps + 1,
        )
        return jax.lax.while_loop(fill_cond, fill, st)

    # Every slot free, then the first fills; then steps (each followed by fills) until
    # no slot is live.
    route_shape = (model.cfg.num_moe_layers, model.cfg.top_k)
    per_slot = lambda shape, v, dt: shard(jnp.full((S,) + shape, v, dt))
    per_row = lambda shape, v, dt: shard(jnp.full((B,) + shape, v, dt))
    buf = dict(tokens=per_slot((T,), s.pad_id, jnp.int32), logp=per_slot((T,), 0.0, jnp.float32))
    out = dict(tokens=per_row((T,), s.pad_id, jnp.int32), logp=per_row((T,), 0.0, jnp.float32))
    if record:
        for d, per in ((buf, per_slot), (out, per_row)):
            d["experts"] = per((T,) + route_shape, -1, jnp.int32)
            d["router_logp"] = per((T,) + route_shape, 0.0, jnp.float32)
    out["lengths"] = per_row((), 0, jnp.int32)
    out["stopped"] = per_row((), False, bool)
    if s.routing == "all":
        out["prompt_experts"] = per_row((plen,) + route_shape, -1, jnp.int32)
    cache = model.init_cache(S, plen + T - 1)
    st = _State(
        cache=cache.replace(
            k=tuple(map(shard, cache.k)),
            v=tuple(map(shard, cache.v)),
            valid=shard(cache.valid),
            index=jnp.zeros((S,), jnp.int32),
        ),
        row=per_slot((), B, jnp.int32),
        t=per_slot((), 0, jnp.int32),
        free=per_slot((), True, bool),
        stopped=per_slot((), False, bool),
        last=per_slot((), s.pad_id, jnp.int32),
        n_prompt=per_slot((), 0, jnp.int32),
        uniforms=per_slot((T,), 0.0, jnp.float32),
        noise_keys=key_of(noise_root, jnp.zeros((S,), jnp.int32), jnp.zeros((S,), jnp.int32))
        if s.router_noise
        else None,
        buf=buf,
        out=out,
        next_row=jnp.zeros((), jnp.int32),
        steps=jnp.zeros((), jnp.int32),
    )
    st = jax.lax.while_loop(fill_cond, fill, st)
    st = jax.lax.while_loop(lambda st: jnp.any(~st.free), step, st)
    out = flush(st, jnp.arange(S, dtype=jnp.int32))

    rows = lambda x: shard(jnp.repeat(x, G, axis=0))
    mask = jnp.arange(T, dtype=jnp.int32)[None, :] < out["lengths"][:, None]
    out = dict(
        tokens=out["tokens"],
        mask=mask.astype(jnp.float32),
        lengths=out["lengths"],
        truncated=~out["stopped"],
        logp=out["logp"],
        experts=out.get("experts"),
        router_logp=out.get("router_logp"),
        prompt_tokens=rows(prompt_tokens),
        prompt_mask=rows(prompt_mask),
        prompt_experts=out.get("prompt_experts"),
    )
    out = {k: None if v is None else shard(v) for k, v in out.items()}
    return dict(out, decode_steps=st.steps)


generate_refill_jit = jax.jit(_generate_refill, static_argnums=(0,), static_argnames=("spec",))
