"""Packed buffers: the real tokens of a batch's sequences laid end to end.

A rollout batch is rectangular (`gspo_jax.step`'s module docstring): every row is a
prompt left-padded to P and a response right-padded to T, and the model reads its
S = P + T - 1 input positions. A packed buffer holds the valid input positions of
several rows one after another in buffer rows of L >= S slots (`Packing.length`), so
that the forward computes (nearly) only real tokens:

    padded   [n, S]   row i: ....pppppprrrr..      (. padding, p prompt, r response)
    packed   [m, r, L]  micro-batch j, buffer row b: pppppprrrr ppprr pppppprrr.. ..

A `Plan` says where each valid position goes; it is computed on the devices from the
batch's validity mask, inside the program that uses it (no host round trip), by a
deterministic rule:

1. **Buffer rows.** Rows are placed into buffer rows of capacity L by first-fit
   decreasing: longest first (ties by row index), each into the first buffer row with
   room. A sequence never spans two buffer rows, and every sequence fits in one.
2. **Micro-batches and devices.** The K buffer rows used make ``used = ceil(K / r)``
   micro-batches of ``r`` buffer rows each. Buffer rows, fullest first, are dealt to
   the ``used x shards`` lanes (one lane per micro-batch and batch shard, a shard
   holding ``r / shards`` consecutive buffer rows of a micro-batch), each to the lane
   with the fewest tokens so far that has room (longest-processing-time first), so
   that micro-batches, and the devices within each, hold about the same number of
   real tokens.

Inside a buffer row each sequence is a segment (``segment`` = its batch row + 1; 0 an
empty slot); positions (RoPE) are the padded layout's, which count real tokens and so
restart at every sequence; attention is causal within a segment and blind across
(`gspo_jax.models.transformer.Transformer`, ``segment_ids``). Per-token outputs come
back to the padded layout with `unpack` (one micro-batch) or `unpack_all` (every one),
so the objectives read the arrays they read without packing.

The plan's arrays are a few integers per input position ([n, S] and [m, r, L]); the
gather of `pack` reads rows of the whole batch, so under a mesh XLA brings the batch's
token ids (and a replayed routing record) to every device that packs them.
"""

from __future__ import annotations

import dataclasses
import math

import flax
import jax
import jax.numpy as jnp

from gspo_jax.config_fields import err


@dataclasses.dataclass(frozen=True)
class Packing:
    """The static shape of a plan (hashable; bound before jit).

    rows: buffer rows per micro-batch (``r``), a multiple of ``shards``.
    length: slots per buffer row (``L``), at least the batch's S; 0: S. Sequences never
      span two buffer rows, so with L = S only sequences shorter than S / 2 share one;
      a longer L packs more, at attention over L keys instead of S.
    micro: micro-batches the program holds room for (``m``): enough for the worst
      case, every sequence as long as the longest possible (``m * r * (L // S) >= n``);
      only the ``used`` ones are computed.
    shards: the batch shards a micro-batch's buffer rows are split over.
    """

    rows: int
    micro: int
    shards: int = 1
    length: int = 0

    def __post_init__(self):
        if self.rows < 1 or self.micro < 1 or self.shards < 1 or self.rows % self.shards:
            raise ValueError(
                f"Packing: rows={self.rows}, micro={self.micro}, shards={self.shards}: "
                "each must be >= 1 and rows a multiple of shards"
            )

    @classmethod
    def for_batch(
        cls, n: int, rows: int, shards: int = 1, length: int = 0, seq: int = 0
    ) -> Packing:
        """Room for ``n`` sequences of at most ``seq`` tokens in micro-batches of ``rows``
        buffer rows of ``length`` slots: a buffer row holds ``length // seq`` sequences
        however long they are (1 when either is 0)."""
        per_row = max(1, length // seq) if length and seq else 1
        return cls(rows=rows, micro=math.ceil(n / (rows * per_row)), shards=shards, length=length)


@flax.struct.dataclass
class Plan:
    """Where every valid input position of a [n, S] batch goes (`plan`).

    The packed layout, [m, r, S] each: ``src_row`` / ``src_pos`` the batch row and
    input position a slot holds (0 in an empty slot) and ``segment`` its batch row + 1
    (0: empty). The padded layout: ``micro`` int32[n] the micro-batch of each row;
    ``slot_row`` / ``slot_col`` int32[n, S] the buffer row and column of each input
    position; ``valid`` bool[n, S]. ``used`` int32[]: the micro-batches holding any
    sequence.
    """

    src_row: jax.Array
    src_pos: jax.Array
    segment: jax.Array
    micro: jax.Array
    slot_row: jax.Array
    slot_col: jax.Array
    valid: jax.Array
    used: jax.Array


def _first_fit_decreasing(lengths: jax.Array, capacity: int):
    """Bins of ``capacity`` for items of ``lengths`` int32[n] (each <= capacity), longest
    first and ties by index, each into the first bin with room. Returns (bin int32[n],
    offset int32[n] within its bin, loads int32[n] of bins 0..n-1)."""
    n = lengths.shape[0]
    order = jnp.argsort(-lengths, stable=True)

    def place(loads, i):
        size = lengths[i]
        b = jnp.argmax(loads + size <= capacity)  # the first bin with room
        return loads.at[b].add(size), (b, loads[b])

    loads, (bins, offsets) = jax.lax.scan(place, jnp.zeros(n, jnp.int32), order)
    back = lambda a: jnp.zeros(n, jnp.int32).at[order].set(a.astype(jnp.int32))  # noqa: E731
    return back(bins), back(offsets), loads


def _deal(loads: jax.Array, *, lanes: int, open_lanes, per_lane: int):
    """Bins of ``loads`` int32[k], largest first (ties by index), each to the open lane
    (of the first ``open_lanes``) with the least load and fewer than ``per_lane`` bins,
    ties to the lowest lane. Returns (lane int32[k], its place in the lane int32[k])."""
    k = loads.shape[0]
    is_open = jnp.arange(lanes) < open_lanes

    def deal(carry, b):
        lane_load, count = carry
        room = is_open & (count < per_lane)
        lane = jnp.argmin(jnp.where(room, lane_load, jnp.iinfo(jnp.int32).max))
        return (lane_load.at[lane].add(loads[b]), count.at[lane].add(1)), (lane, count[lane])

    zeros = jnp.zeros(lanes, jnp.int32)
    order = jnp.argsort(-loads, stable=True)
    _, (lane, place) = jax.lax.scan(deal, (zeros, zeros), order)
    back = lambda a: jnp.zeros(k, jnp.int32).at[order].set(a.astype(jnp.int32))  # noqa: E731
    return back(lane), back(place)


def plan(valid: jax.Array, packing: Packing) -> Plan:
    """The `Plan` of a batch whose valid input positions are ``valid`` [n, S] (the
    padded layout's attention mask, `gspo_jax.passes.sequence_inputs`): the rule of the
    module docstring. A row's valid positions keep their order; they need not be
    contiguous."""
    valid = valid > 0
    n, s = valid.shape
    r, m, d = packing.rows, packing.micro, packing.shards
    cap = packing.length or s
    if cap < s:
        raise ValueError(f"Packing: buffer rows of {cap} slots cannot hold a sequence of {s}")
    if m * r * (cap // s) < n:
        raise ValueError(
            f"Packing: {m} micro-batches of {r} buffer rows of {cap} slots cannot hold {n} "
            f"sequences of up to {s} tokens"
        )
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
    bins, offsets, loads = _first_fit_decreasing(lengths, cap)
    used_bins = jnp.sum(loads > 0, dtype=jnp.int32)
    used = jnp.maximum((used_bins + r - 1) // r, 1)
    # Bins fullest first, each to the lane with the fewest tokens that has room.
    lane, turn = _deal(loads, lanes=m * d, open_lanes=used * d, per_lane=r // d)
    bin_micro, bin_row = lane // d, (lane % d) * (r // d) + turn
    micro, slot = bin_micro[bins], bin_row[bins]
    # Each valid position's column: its sequence's offset plus its rank among the
    # row's valid positions; invalid positions point past the buffer (dropped below).
    col = offsets[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    slot_col = jnp.where(valid, col, cap)
    slot_row = jnp.broadcast_to(slot[:, None], (n, s))
    at_micro = jnp.broadcast_to(micro[:, None], (n, s))
    rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, s))
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (n, s))

    def scatter(values):
        out = jnp.zeros((m, r, cap), jnp.int32)
        return out.at[at_micro, slot_row, slot_col].set(values, mode="drop")

    filled = scatter(jnp.ones((n, s), jnp.int32))
    return Plan(
        src_row=scatter(rows),
        src_pos=scatter(pos),
        segment=jnp.where(filled > 0, scatter(rows) + 1, 0),
        micro=micro,
        slot_row=slot_row,
        slot_col=jnp.minimum(slot_col, cap - 1),
        valid=valid,
        used=used,
    )


def pack(p: Plan, j, x: jax.Array) -> jax.Array:
    """Micro-batch ``j``'s buffers of a padded-layout array x [n, S, ...] -> [r, S, ...]
    (an empty slot holds row 0's first position; its segment is 0)."""
    return x[p.src_row[j], p.src_pos[j]]


def computed(p: Plan, j, window: tuple[int, int] | None = None) -> jax.Array:
    """bool[n, S] (or [n, length] of ``window`` = (start, length)): the positions
    micro-batch ``j`` computes, its rows' valid ones."""
    return _window(p.valid & (p.micro == j)[:, None], window)


def unpack(p: Plan, j, y: jax.Array, window: tuple[int, int] | None = None) -> jax.Array:
    """Micro-batch ``j``'s per-token outputs y [r, S, ...] back to the padded layout
    [n, S, ...] (or its positions ``window`` = (start, length)): a row of micro-batch
    ``j`` at its valid positions (`computed`), 0 everywhere else."""
    return _gather(p, y[None], jnp.zeros_like(p.micro), computed(p, j, window), window)


def unpack_all(p: Plan, y: jax.Array, window: tuple[int, int] | None = None) -> jax.Array:
    """Every micro-batch's outputs y [m, r, S, ...] back to the padded layout [n, S, ...]
    (or its positions ``window``), 0 at the invalid positions."""
    valid = p.valid if window is None else _window(p.valid, window)
    return _gather(p, y, p.micro, valid, window)


def _window(x, window):
    return x if window is None else jax.lax.slice_in_dim(x, window[0], sum(window), axis=1)


def _gather(p: Plan, y, micro, sel, window):
    out = y[micro[:, None], _window(p.slot_row, window), _window(p.slot_col, window)]
    sel = sel.reshape(sel.shape + (1,) * (out.ndim - sel.ndim))
    return jnp.where(sel, out, jnp.zeros((), out.dtype))


def computed_slots(p: Plan, packing: Packing) -> jax.Array:
    """f32[]: the buffer slots the used micro-batches compute (real tokens and empty)."""
    return (p.used * packing.rows * p.segment.shape[-1]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """How a run's train step and log-prob passes lay out their rows (`shapes`).

    train, logprob: the packed shapes of the mini-batch and of the rollout batch, or
      None (padded rows).
    micro_batches, logprob_micro_batches: the padded rows' pieces (unused when packed).
    """

    train: Packing | None
    logprob: Packing | None
    micro_batches: int = 1
    logprob_micro_batches: int = 1


def shapes(updates, run, shards: int) -> Shapes:
    """The `Shapes` of a run (``run``, its `gspo_jax.run_config.RunConfig`, and
    ``updates``, its ``config.updates``) over ``shards`` batch shards.

    Without a token budget (``updates.micro_batch_tokens`` 0) micro-batches hold the
    padded rows' count (``micro_batches``, ``logprob_micro_batches``), packed (in buffer
    rows of S = max_prompt_len + max_new_tokens - 1 slots) or not. With one, a
    micro-batch holds ``budget // L`` packed buffer rows of L = ``updates.pack_length``
    slots (0: S), or with ``updates.packing`` False ``budget // S`` padded rows (the
    padded twin of a packed run: the same tokens per micro-batch). Raises the error
    naming the field of a buffer row shorter than the longest sequence, a budget below
    one buffer row or whose rows the batch shards do not divide, or padded micro-batches
    that do not divide the batch.
    """
    budget, packed, length = updates.micro_batch_tokens, updates.packing, updates.pack_length
    n = run.rollout.prompts_per_step * run.rollout.group_size
    mini = n // updates.num_minibatches
    seq = run.rollout.max_prompt_len + run.rollout.max_new_tokens - 1
    if packed and length and length < seq:
        raise err(
            "updates.pack_length",
            f"{length} is shorter than the longest sequence, max_prompt_len + "
            f"max_new_tokens - 1 = {seq} tokens",
        )
    if not budget:
        micro, lp = updates.micro_batches, updates.logprob_micro_batches
        if not packed:
            return Shapes(None, None, micro, lp)
        if length:
            raise err("updates.pack_length", f"{length} needs updates.micro_batch_tokens")
        return Shapes(
            Packing.for_batch(mini, mini // micro, shards), Packing.for_batch(n, n // lp, shards)
        )
    row = (length or seq) if packed else seq
    rows = budget // row
    if rows < 1:
        raise err(
            "updates.micro_batch_tokens",
            f"{budget} is smaller than one {'buffer ' if packed else ''}row of {row} tokens "
            f"(the longest sequence is max_prompt_len + max_new_tokens - 1 = {seq})",
        )
    if rows % shards:
        raise err(
            "updates.micro_batch_tokens",
            f"{budget} holds {rows} rows of {row} tokens, not divisible by the "
            f"data*fsdp*expert = {shards} batch shards: use a multiple of {row * shards}",
        )
    for name in ("micro_batches", "logprob_micro_batches"):
        if getattr(updates, name) != 1:
            raise err(
                f"updates.{name}",
                f"{getattr(updates, name)}: with updates.micro_batch_tokens the token "
                "budget makes the micro-batches; leave it at 1",
            )
    train_rows, logprob_rows = min(rows, mini), min(rows, n)
    if packed:
        return Shapes(
            Packing.for_batch(mini, train_rows, shards, length, seq),
            Packing.for_batch(n, logprob_rows, shards, length, seq),
        )
    if mini % train_rows or n % logprob_rows:
        raise err(
            "updates.micro_batch_tokens",
            f"{budget} makes padded micro-batches of {rows} rows, which do not divide the "
            f"mini-batch of {mini} rows and the rollout batch of {n} (updates.packing=False)",
        )
    return Shapes(None, None, mini // train_rows, n // logprob_rows)
