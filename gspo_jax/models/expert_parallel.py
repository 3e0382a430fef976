"""The ragged MoE dispatch on a device mesh: each device sorts its own tokens, and
with an expert axis the token rows travel to the experts' devices and back.

Inside one `jax.shard_map` over every mesh axis, a device holds

* its rows of the batch (the config's 'batch' rule: by default the data, FSDP and
  expert axes, so each expert-axis device has rows of its own; where the expert
  axis does not divide the rows, or a rule leaves it out, the devices along it
  share the same rows; they are always the same along the tensor axis);
* its experts' weights: gate/up [E/ep, D, F/tp], down [E/ep, F/tp, D] (the
  'expert' and 'mlp' rules; the FSDP-sharded model dimension is gathered, as
  FSDP gathers every weight before it is used).

Without an expert axis (ep = 1) a device runs `dispatch.dispatch_ragged` on its rows.
With one, a device takes m rows: its own, or, where the ep devices of the
expert axis share the same rows, rows [r*m, (r+1)*m) of them on device r; then

1. sorts its m*K assignments by expert, so that the rows bound for expert
   shard s are contiguous (experts s*E/ep .. (s+1)*E/ep - 1);
2. all-to-all over the expert axis: the rows for shard s go to device s.  Each
   sender owns a slot of m*K rows in every receiver's buffer [ep, m*K, D] (a
   dropless bound: all its rows may choose one shard);
3. the receiver sorts its buffer by local expert and runs the grouped SwiGLU
   over its own experts' weights, read where they lie;
4. the reverse all-to-all returns each row's output to its sender, which
   undoes its sort and combines the K outputs of each token with its gates
   (shared rows: and all-gathers the m-row pieces over the expert axis).

With a tensor axis, F is split: each device's SwiGLU output is a partial sum
over its F/tp columns, summed over the tensor axis (psum).

LoRA adapters of the experts (`gspo_jax.models.lora.LoRAWeight`) travel with their
weights: A and B sharded over the expert axis like them, B of gate/up and A of down
over the tensor axis like F (the low-rank term of down is then a partial sum too,
summed by the same psum); the received rows go through them in the same grouped
products (`dispatch.grouped_swiglu`).

Tests: tests/test_moe_dispatch.py compares every layout on 8 CPU devices with
one device, in values and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gspo_jax.models import dispatch, lora
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.sharding import logical_to_mesh_spec


def _axes(spec_entry) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return spec_entry if isinstance(spec_entry, tuple) else (spec_entry,)


def _sorted_to_slots(xs, send, send_off, ep: int, slot: int):
    """Rows sorted by destination -> [ep, slot, D]: slot s holds the send[s] rows
    bound for device s (from send_off[s]), then zeros."""
    j = jnp.arange(slot, dtype=jnp.int32)
    src = send_off[:, None] + j[None, :]  # [ep, slot]
    valid = j[None, :] < send[:, None]
    rows = xs[jnp.minimum(src, xs.shape[0] - 1)]
    return jnp.where(valid[..., None], rows, jnp.zeros((), xs.dtype))


def _slots_to_sorted(buf, send, send_off, ep: int):
    """The inverse of `_sorted_to_slots`: [ep, slot, D] -> rows sorted by destination."""
    slot = buf.shape[1]  # = a sender's m*K rows
    p = jnp.arange(slot, dtype=jnp.int32)
    dest = jnp.sum(p[:, None] >= (send_off + send)[None, :], axis=1, dtype=jnp.int32)
    dest = jnp.minimum(dest, ep - 1)
    return buf.reshape(ep * slot, -1)[dest * slot + (p - send_off[dest])]


def _expert_parallel_local(x, idx, gates, wg, wu, wd, *, ep_axis, ep: int, rows_split: bool):
    """One device's part of the expert-parallel dispatch (module docstring,
    steps 1-4).  x [n, D], idx/gates [n, K]: the same on every device of `ep_axis`,
    or, with `rows_split` (the batch rule shards rows over the expert axis too),
    this device's own rows; wg/wu [E/ep, D, F'], wd [E/ep, F', D] this device's
    experts.  Returns [n, D] (a partial sum over F' when the tensor axis splits F)."""
    n, k = idx.shape
    e_loc = lora.base(wg).shape[0]
    e = e_loc * ep
    me = jax.lax.axis_index(ep_axis)
    if rows_split:
        m, xm, im, gm = n, x, idx, gates
    else:
        m = -(-n // ep)
        pad = m * ep - n
        if pad:  # padding rows: expert 0 with gate 0, outputs dropped below
            x = jnp.pad(x, ((0, pad), (0, 0)))
            idx = jnp.pad(idx, ((0, pad), (0, 0)))
            gates = jnp.pad(gates, ((0, pad), (0, 0)))
        xm = jax.lax.dynamic_slice_in_dim(x, me * m, m)
        im = jax.lax.dynamic_slice_in_dim(idx, me * m, m)
        gm = jax.lax.dynamic_slice_in_dim(gates, me * m, m)

    # 1. sort this device's assignments by expert (so by destination shard).
    flat_e = im.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat_e, stable=True)
    xs = xm[order // k]  # [m*K, D]
    counts = jnp.bincount(flat_e, length=e).astype(jnp.int32)  # [E]
    send = counts.reshape(ep, e_loc).sum(axis=1)  # rows to each shard
    send_off = jnp.cumsum(send) - send

    # 2. rows to their experts' devices: slot s of my buffer = sender s's rows.
    slot = m * k
    out = _sorted_to_slots(xs, send, send_off, ep, slot)  # [ep, slot, D]
    buf = jax.lax.all_to_all(out, ep_axis, 0, 0, tiled=False)
    # How many rows of each of my experts every sender sent: [ep, E/ep].
    all_counts = jax.lax.all_gather(counts, ep_axis)  # [ep (senders), E]
    mine = jax.lax.dynamic_slice_in_dim(all_counts, me * e_loc, e_loc, axis=1)

    # 3. sort the received rows by local expert; rows past a sender's count
    # get expert e_loc (no group) and sort last.
    j = jnp.arange(slot, dtype=jnp.int32)
    local_e = jnp.sum(j[None, :, None] >= jnp.cumsum(mine, axis=1)[:, None, :], axis=2)
    local_e = local_e.reshape(-1).astype(jnp.int32)  # [ep*slot], in 0..e_loc
    order2 = jnp.argsort(local_e, stable=True)
    sizes = jnp.sum(mine, axis=0).astype(jnp.int32)  # [E/ep]
    y2 = dispatch.grouped_swiglu(buf.reshape(ep * slot, -1)[order2], sizes, wg, wu, wd)
    valid = (local_e < e_loc)[:, None]
    ybuf = jnp.where(valid, y2[dispatch.inverse_permutation(order2)], jnp.zeros((), y2.dtype))
    ybuf = ybuf.reshape(ep, slot, -1)

    # 4. outputs back to their senders, unsorted, combined, gathered.
    back = jax.lax.all_to_all(ybuf, ep_axis, 0, 0, tiled=False)  # slot s: my rows from s
    ys = _slots_to_sorted(back, send, send_off, ep)  # [m*K, D], sorted order
    ym = dispatch.combine(ys[dispatch.inverse_permutation(order)], gm, m, k)  # [m, D]
    if rows_split:
        return ym
    y = jax.lax.all_gather(ym, ep_axis, tiled=True, to="invarying")  # [m*ep, D]
    return y[:n]


def _mesh_layout(cfg: ModelConfig, mesh, xf, wg, wd):
    """PartitionSpecs of the rows and the weights inside the shard_map, and the
    expert and tensor mesh axes (a name or None).  Mesh axes of size 1 are left
    out: they split nothing."""

    def spec(names, shape):
        full = logical_to_mesh_spec(names, shape, cfg.axis_rules, mesh)
        kept = [tuple(a for a in _axes(entry) if mesh.shape[a] > 1) for entry in full]
        return P(*(None if not a else a[0] if len(a) == 1 else a for a in kept))

    rows = spec(("batch", None), xf.shape)
    up = spec(("expert", None, "mlp"), lora.base(wg).shape)
    down = spec(("expert", "mlp", None), lora.base(wd).shape)
    ep_axes, tp_axes = _axes(up[0]), _axes(up[2])
    if len(ep_axes) > 1 or len(tp_axes) > 1:
        raise ValueError(
            "ModelConfig.axis_rules: the ragged MoE dispatch takes the 'expert' and 'mlp' "
            f"rules onto one mesh axis each, got {up}"
        )
    return rows, up, down, (ep_axes or (None,))[0], (tp_axes or (None,))[0]


def ragged_ffn(cfg: ModelConfig, xf, idx, gates, wg, wu, wd):
    """The ragged dispatch for the rows xf [N, D] with assignments idx/gates
    [N, K]: on the mesh set with `jax.set_mesh` (module docstring) when the
    config's rules shard anything over it, else per `cfg.moe_groups` row group on
    one device (`jax.lax.map`: one group at a time, the weights shared)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        rows, up, down, ep_axis, tp_axis = _mesh_layout(cfg, mesh, xf, wg, wd)
        if any(s is not None for s in (*rows, *up, *down)):
            return _on_mesh(mesh, rows, up, down, ep_axis, tp_axis, xf, idx, gates, wg, wu, wd)
    n = xf.shape[0]
    g = cfg.moe_groups if n % cfg.moe_groups == 0 else 1
    if g == 1:
        return dispatch.dispatch_ragged(xf, idx, gates, wg, wu, wd)

    def grouped(a):
        return a.reshape((g, n // g) + a.shape[1:])

    def one(args):
        return dispatch.dispatch_ragged(*args, wg, wu, wd)

    y = jax.lax.map(one, (grouped(xf), grouped(idx), grouped(gates)))
    return y.reshape(n, -1)


def _weight_spec(w, spec: P, down: bool):
    """The in_spec of an expert weight, or of a `lora.LoRAWeight` (its adapters: the
    expert dim like the weight's, F where the weight has it, the rest replicated)."""
    if not isinstance(w, lora.LoRAWeight):
        return spec
    if down:  # A [E, F, r], B [E, r, D]
        return lora.LoRAWeight(spec, P(spec[0], spec[1], None), P(spec[0], None, None))
    return lora.LoRAWeight(spec, P(spec[0], None, None), P(spec[0], None, spec[2]))


def _on_mesh(mesh, rows, up, down, ep_axis, tp_axis, xf, idx, gates, wg, wu, wd):
    ep = mesh.shape[ep_axis] if ep_axis else 1

    def local(x, i, gt, a, b, c):
        if ep > 1:
            y = _expert_parallel_local(
                x, i, gt, a, b, c, ep_axis=ep_axis, ep=ep, rows_split=ep_axis in _axes(rows[0])
            )
        else:
            y = dispatch.dispatch_ragged(x, i, gt, a, b, c)
        if tp_axis is not None:
            y = jax.lax.psum(y, tp_axis)
        return y

    row_spec = P(rows[0], None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            row_spec,
            row_spec,
            row_spec,
            _weight_spec(wg, up, False),
            _weight_spec(wu, up, False),
            _weight_spec(wd, down, True),
        ),
        out_specs=row_spec,
    )(xf, idx, gates, wg, wu, wd)
