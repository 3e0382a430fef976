"""The MoE layer's dispatch: the N*K (token, expert) assignments to their experts.

Every dispatch computes, for rows x [N, D], assignments idx int32[N, K] and gates
[N, K], y[n] = sum_k gates[n, k] * SwiGLU_{idx[n, k]}(x[n]) with the experts'
weights wg/wu [E, D, F], wd [E, F, D].  Same math, tests compare them, values and
gradients (docs/moe.md):

* ``dense`` (`dispatch_dense`): every expert on every token, combined with a
  [N, E] gate matrix that is zero off the chosen experts.  O(E) compute; the
  reference.
* ``ragged`` (`dispatch_ragged`): the N*K assignments are sorted by expert and fed
  to a grouped matmul (`grouped_matmul`: tokamax's Mosaic kernel on GPU and
  TPU) with the per-expert group sizes.  Token rows move; each expert's weights
  are read where they lie.  Dropless.  The accelerator dispatch; slow on CPU
  (experiments/model.md).  On a mesh, and with expert parallelism, it runs in
  `gspo_jax.models.expert_parallel`, which builds on this module.
* ``blocked`` (`dispatch_blocked`): the sorted assignments are laid out in
  fixed-size blocks of `bk` rows, each block holding rows of one expert only
  (each expert's group is padded to a multiple of bk); a batched matmul runs
  every block against its expert's weights, gathered per block (off CPU by
  `take_expert_blocks`, whose backward is a matmul, not a scatter).  Dropless:
  the static number of blocks nb = floor((N*K + E*(bk - 1)) / bk) bounds
  sum_e ceil(c_e / bk) for any expert counts c_e.  Compute follows active (not
  total) parameters, plus at most E*(bk-1) padding rows.  The CPU dispatch.
* ``auto``: `resolve_backend`, per device kind.

Every dispatch also takes LoRA adapters (`gspo_jax.models.lora.LoRAWeight`: an expert
weight [E, D, F] with A [E, D, r] and B [E, r, F]) in place of a weight, and runs them
through the same grouping as the weight: x W + (x A) B per expert, the dense one per
expert, the ragged one as grouped matmuls with the same group sizes, the blocked one
on the same per-block gather; W + A B is never formed.

Routing (which experts, with which gates) is `gspo_jax.models.moe`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gspo_jax.models import lora


def dispatch_dense(x, idx, gates, wg, wu, wd):
    """Reference: y [N, D] = sum_e C[n, e] SwiGLU_e(x_n), C = scatter of gates."""
    e = lora.base(wg).shape[0]
    gate_matrix = jnp.sum(jax.nn.one_hot(idx, e, dtype=gates.dtype) * gates[..., None], axis=1)
    up = functools.partial(lora.einsum, "nd,edf->enf", n_lead=1)
    h = jax.nn.silu(up(x, wg)) * up(x, wu)
    ye = lora.einsum("enf,efd->end", h, wd, n_lead=1)
    return jnp.einsum("ne,end->nd", gate_matrix.astype(x.dtype), ye)


def combine(y_assign, gates, n, k):
    """y [N, D] = sum_k gates[n, k] * y_assign[n*K + k]: each token's K expert
    outputs (rows in assignment order, [N*K, D]) weighted by its gates."""
    y = y_assign.reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, gates.astype(y.dtype))


# The GPU kernels tile the rows: by 8 in the forward and by 64 where the weight
# gradient contracts over them (seen compiling for the H200 and H100 targets, which
# refuse other row counts). 128 covers both, at most 127 rows of no group per call.
GROUPED_ROW_TILE = 128

# The three products of a grouped matmul, as `jax.lax.RaggedDotDimensionNumbers`
# fields (contracting dims, batch dims, ragged lhs dims, group dims of the rhs):
# out [M, N] = lhs [M, K] . rhs[g] [K, N]; dlhs [M, K] = dout [M, N] . rhs[g]^T;
# drhs [G, K, N] = per group, lhs^T [K, M_g] . dout [M_g, N] (M is contracted).
_FORWARD = (([1], [1]), ([], [])), [0], [0]
_LHS_GRAD = (([1], [2]), ([], [])), [0], [0]
_RHS_GRAD = (([0], [0]), ([], [])), [0], []


def _ragged_dot(a, b, sizes, dims, dtype, varying):
    """tokamax's ragged_dot_general with ``dims``; the result typed as varying over
    the mesh axes ``varying`` (inside a shard_map: the kernels are per device)."""
    import tokamax  # imported here: only the ragged dispatch needs it

    dot, ragged, group = dims
    mat = jax.sharding.ManualAxisType(varying=varying) if varying else None
    out = tokamax.ragged_dot_general(
        a,
        b,
        sizes,
        jax.lax.RaggedDotDimensionNumbers(dot, ragged, group),
        preferred_element_type=dtype,
        manual_axis_type=mat,
    )
    missing = tuple(sorted(varying - jax.typeof(out).manual_axis_type.varying))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(lhs, rhs, sizes, varying):
    return _ragged_dot(lhs, rhs, sizes, _FORWARD, lhs.dtype, varying)


def _grouped_fwd(lhs, rhs, sizes, varying):
    return _grouped(lhs, rhs, sizes, varying), (lhs, rhs, sizes)


def transposed_in_place(w):
    """w [G, K, N] -> [G, N, K], transposed from this value, where it is.

    The GPU kernel reads a group's weights [K, N] row-major, so the lhs gradient's
    ``rhs[g]^T`` is an XLA transpose (tokamax's own, for `_LHS_GRAD`). Left to
    itself, XLA's layout assignment makes that transpose free by giving its operand
    the transposed layout, and carries the layout up through the cast to bf16, the
    layer scan's slice and the loop: the whole stacked f32 expert weights are
    transposed into a copy before the backward's layer loop, once per micro-batch,
    and the copy lives through it (18 GiB on the 16-layer H200 train step, more
    than `blocked` needs in all; docs/moe.md). Here the value goes through a
    [G, K*N] view behind an optimization barrier: no layout of that view is a
    transposed [G, K, N], so the layout stops at the barrier and the transpose is
    of this one bf16 weight. Values unchanged (data movement only)."""
    flat = jax.lax.optimization_barrier(w.reshape(w.shape[0], -1))
    return jnp.swapaxes(flat.reshape(w.shape), 1, 2)


def _lhs_grad(dout, rhs, sizes, dtype, varying, *, in_place: bool):
    """dlhs [M, K] = dout [M, N] . rhs[g]^T for the rows of group g. ``in_place``:
    with the transpose made here (`transposed_in_place`); else the kernel's own
    transposed form (`_LHS_GRAD`: in place on TPU, ``jax.lax.ragged_dot`` on CPU)."""
    if in_place:
        return _ragged_dot(dout, transposed_in_place(rhs), sizes, _FORWARD, dtype, varying)
    return _ragged_dot(dout, rhs, sizes, _LHS_GRAD, dtype, varying)


def _grouped_bwd(varying, res, dout):
    lhs, rhs, sizes = res
    # tokamax's GPU kernel reads the weights in one layout only (`transposed_in_place`);
    # its TPU kernel reads them transposed where they lie.
    in_place = _platform() not in ("cpu", "tpu")
    dlhs = _lhs_grad(dout, rhs, sizes, lhs.dtype, varying, in_place=in_place)
    drhs = _ragged_dot(lhs, dout, sizes, _RHS_GRAD, rhs.dtype, varying)
    return dlhs, drhs, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(lhs, rhs, sizes):
    """out[r] = lhs[r] @ rhs[g] for the rows r of group g, rows sorted by group.

    lhs [M, K]; rhs [G, K, N]; sizes int32[G] with sum <= M (rows past the sum
    belong to no group: their output is unspecified and must not be read).  Each
    group's weights are read where they lie, never gathered or copied per row.

    The kernel is tokamax's `ragged_dot_general`, which picks per device: its
    Pallas Mosaic kernel on Hopper/Blackwell GPUs and on TPU, `jax.lax.ragged_dot`
    elsewhere (CPU).  The backward is two more grouped matmuls (`_grouped_bwd`:
    rows against the transposed weights, and per group lhs^T dout), so no scatter
    of weights appears either way; on GPU the transposed weights are a copy of
    this call's rhs only (`transposed_in_place`), never of what it was cut from.
    Written here rather than left to tokamax's own VJP so that inside a shard_map
    every product is typed as varying over the operands' mesh axes (its GPU
    kernel's weight gradient comes out untyped).  The choice over
    `jax.lax.ragged_dot` on GPU, which XLA expands into a dense [M, G*K] product
    there, is recorded in docs/moe.md.
    """
    # Pad the rows to the kernels' tile with rows of no group; drop their outputs.
    m = lhs.shape[0]
    pad = -m % GROUPED_ROW_TILE
    if pad:
        lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
    # Inside a shard_map: both operands varying over the axes either varies over (the
    # weights' pvary transposes to the psum their gradient needs).
    varying = frozenset(
        jax.typeof(lhs).manual_axis_type.varying | jax.typeof(rhs).manual_axis_type.varying
    )

    def vary(a):
        missing = tuple(sorted(varying - jax.typeof(a).manual_axis_type.varying))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    out = _grouped(vary(lhs), vary(rhs), vary(sizes), varying)
    return out[:m] if pad else out


def grouped_lora(lhs, rhs, sizes):
    """`grouped_matmul`, where ``rhs`` may be a `lora.LoRAWeight`: then
    lhs W + (lhs A) B, each product grouped by the same sizes."""
    if not isinstance(rhs, lora.LoRAWeight):
        return grouped_matmul(lhs, rhs, sizes)
    low = grouped_matmul(grouped_matmul(lhs, rhs.a, sizes), rhs.b, sizes)
    return grouped_matmul(lhs, rhs.w, sizes) + low


def grouped_swiglu(rows, sizes, wg, wu, wd):
    """SwiGLU of expert g on each row of group g: rows [M, D] sorted by expert,
    sizes int32[E], wg/wu [E, D, F], wd [E, F, D] -> [M, D].  The rows are padded
    to the kernels' tile once here, not by each of the three products."""
    m = rows.shape[0]
    pad = -m % GROUPED_ROW_TILE
    if pad:
        rows = jnp.pad(rows, ((0, pad), (0, 0)))
    h = jax.nn.silu(grouped_lora(rows, wg, sizes)) * grouped_lora(rows, wu, sizes)
    return grouped_lora(h, wd, sizes)[:m]


def inverse_permutation(order):
    """inv with inv[order[i]] = i: where each entry of a permuted array came from."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def dispatch_ragged(x, idx, gates, wg, wu, wd):
    """Sort-based dropless dispatch through a grouped matmul (`grouped_matmul`).

    The N*K (token, expert) assignments are sorted by expert; the sort moves token
    rows (x[order // K], a [N*K, D] gather whose backward is a scatter-add of token
    rows), never weights."""
    n, k = idx.shape
    e = lora.base(wg).shape[0]
    flat_e = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat_e, stable=True)
    sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)
    ys = grouped_swiglu(x[order // k], sizes, wg, wu, wd)  # [NK, D], sorted order
    return combine(ys[inverse_permutation(order)], gates, n, k)


def block_size_for(
    num_rows: int, num_experts: int, max_block: int, max_padding: float = 0.5
) -> int:
    """Rows per block of the blocked dispatch.

    The largest power of two bk <= max_block whose worst-case padding
    E * (bk - 1) is at most `max_padding` times the N*K real rows (at least 1):
    big blocks for training-sized batches (few blocks, so little per-block weight
    gathering), down to per-row blocks for decode steps.
    """
    bk = 1
    while 2 * bk <= max_block and num_experts * (2 * bk - 1) <= max_padding * num_rows:
        bk *= 2
    return bk


# The blocked dispatch's padding bound (`block_size_for`'s max_padding) for
# small batches (up to COMPARE_RANK_MAX_ROWS assignments, decode steps): there
# each block's gathered expert weights cost more than its padding rows, so the
# padding may reach the real rows (a decode step at batch 64, 8 experts top-2:
# 15 blocks of 16 rows instead of 23 of 8; experiments/rollout.md).
SMALL_BATCH_MAX_PADDING = 1.0


# Up to this many (token, expert) assignments, the blocked dispatch ranks each
# assignment within its expert by an [NK, NK] comparison instead of a sort:
# decode steps (NK = batch * K) then run no sort and no scatter of the
# permutation; above it the comparison's O(NK^2) work would dominate.
COMPARE_RANK_MAX_ROWS = 512


def _rank_within_expert(flat_e, e: int, method: str):
    """rank[j] = #{i < j : flat_e[i] == flat_e[j]}: the stable position of
    assignment j among its expert's assignments (int32[NK])."""
    nk = flat_e.shape[0]
    if method == "compare":
        j = jnp.arange(nk, dtype=jnp.int32)
        earlier_same = (flat_e[None, :] == flat_e[:, None]) & (j[None, :] < j[:, None])  # [j, i]
        return jnp.sum(earlier_same, axis=1, dtype=jnp.int32)
    order = jnp.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    counts = jnp.bincount(flat_e, length=e).astype(jnp.int32)
    start = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(nk, dtype=jnp.int32) - start[sorted_e]
    return jnp.zeros((nk,), jnp.int32).at[order].set(rank_sorted)


@jax.custom_vjp
def take_expert_blocks(w, block_e):
    """w[block_e]: each block's expert matrix, [E, ...] -> [blocks, ...].

    Autodiff's backward of this gather is a scatter-add of [blocks, ...] into
    [E, ...], which on GPU serialises on atomics (60% of the H200 train step,
    experiments/accelerator.md).  The backward here is the same sum written as a
    matmul with the blocks' one-hot expert matrix: dw[e] = sum_b [block_e[b] = e]
    dy[b], a `dot` with f32 accumulation."""
    return w[block_e]


def _take_expert_blocks_fwd(w, block_e):
    return w[block_e], (block_e, w.shape[0])


def _take_expert_blocks_bwd(res, dy):
    block_e, e = res
    onehot = jax.nn.one_hot(block_e, e, dtype=dy.dtype)  # [blocks, E], exact in any dtype
    dw = jnp.tensordot(onehot, dy, axes=(0, 0), preferred_element_type=jnp.float32)
    return dw.astype(dy.dtype), None


take_expert_blocks.defvjp(_take_expert_blocks_fwd, _take_expert_blocks_bwd)


def dispatch_blocked(
    x,
    idx,
    gates,
    wg,
    wu,
    wd,
    *,
    max_block: int,
    block_size: int | None = None,
    rank: str | None = None,
    weight_grad: str | None = None,
):
    """Sort-based dropless dispatch as a batched matmul over expert blocks.

    block_size: rows per block (default `block_size_for(N*K, E, max_block)`,
      with max_padding SMALL_BATCH_MAX_PADDING up to COMPARE_RANK_MAX_ROWS
      assignments).
    rank: how assignments are ordered within an expert, 'compare' ([NK, NK]
      comparison) or 'sort' (stable argsort); default 'compare' up to
      COMPARE_RANK_MAX_ROWS assignments.  Same result either way.
    weight_grad: the per-block weight gather's backward, 'matmul'
      (`take_expert_blocks`) or 'scatter' (autodiff's scatter-add); default
      'scatter' on CPU, 'matmul' elsewhere.  The same gradient up to rounding.
    """
    n, k = idx.shape
    e, d, _ = lora.base(wg).shape
    nk = n * k
    small = nk <= COMPARE_RANK_MAX_ROWS
    bk = block_size or block_size_for(nk, e, max_block, SMALL_BATCH_MAX_PADDING if small else 0.5)
    nb = (nk + e * (bk - 1)) // bk
    if rank is None:
        rank = "compare" if small else "sort"
    if rank not in ("compare", "sort"):
        raise ValueError(f"rank: expected 'compare' or 'sort', got {rank!r}")
    flat_e = idx.reshape(-1).astype(jnp.int32)
    counts = jnp.bincount(flat_e, length=e).astype(jnp.int32)
    padded = (counts + bk - 1) // bk * bk
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    # Row of the padded block layout that assignment j (= token j // K) fills.
    dest = pad_start[flat_e] + _rank_within_expert(flat_e, e, rank)
    row_tok = (
        jnp.full((nb * bk,), n, jnp.int32)
        .at[dest]
        .set(jnp.arange(nk, dtype=jnp.int32) // k, unique_indices=True)
    )
    xp = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)], axis=0)  # row n = padding
    xb = xp[row_tok].reshape(nb, bk, d)
    # Expert of each block: the number of experts whose padded range ends at or
    # before the block's first row (blocks past the end hold padding only).
    block_start = jnp.arange(nb, dtype=jnp.int32) * bk
    block_e = jnp.sum(pad_end[None, :] <= block_start[:, None], axis=1, dtype=jnp.int32)
    block_e = jnp.minimum(block_e, e - 1)
    if weight_grad is None:
        # One backend check, measured: on CPU the gather's own scatter-add backward
        # is 4-21% faster than the matmul (experiments/model.md) and keeps the CPU
        # runs' rounding; on GPU the scatter-add was 53% of the H200 train step.
        weight_grad = "scatter" if _platform() == "cpu" else "matmul"
    if weight_grad not in ("matmul", "scatter"):
        raise ValueError(f"weight_grad: expected 'matmul' or 'scatter', got {weight_grad!r}")
    take = take_expert_blocks if weight_grad == "matmul" else lambda w, b: w[b]
    # Each block's expert weights (and adapters, gathered alike).
    wgb, wub, wdb = (jax.tree.map(lambda a: take(a, block_e), w) for w in (wg, wu, wd))
    up = functools.partial(lora.einsum, "bcd,bdf->bcf", n_lead=1)
    h = jax.nn.silu(up(xb, wgb)) * up(xb, wub)
    yb = lora.einsum("bcf,bfd->bcd", h, wdb, n_lead=1).reshape(nb * bk, d)
    return combine(yb[dest], gates, n, k)


def resolve_backend(backend: str) -> str:
    """The dispatch that `backend` ('auto', 'blocked', 'ragged' or 'dense') names
    on the device programs are compiled for (JAX's default device, which a
    compile-only target sets): 'auto' is 'blocked' on CPU and 'ragged' on GPU and
    TPU, in training and in decode (the evidence: docs/moe.md)."""
    return backend_for(backend, _platform())


def backend_for(backend: str, platform: str) -> str:
    """`resolve_backend` for programs compiled for ``platform`` ('cpu', 'gpu', 'cuda' or
    'tpu')."""
    if backend != "auto":
        return backend
    return "blocked" if platform == "cpu" else "ragged"


def _platform() -> str:
    """'cpu', 'gpu' or 'tpu': the device programs are compiled for (JAX's default
    device, which `experiments.targets.compiling_for` sets to a compile-only one)."""
    return jax.extend.backend.get_default_device().platform
