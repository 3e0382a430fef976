"""Logical axis names -> mesh axes, and parameters created already sharded.

Every parameter carries logical axis names (`make_param`); the config's
`axis_rules` map each to a mesh axis of a ('data', 'fsdp', 'expert', 'tensor')
mesh (or a tuple of them, or None).  A mesh axis is used at most once per
array; a mesh axis that is absent from the mesh, or whose size does not divide
the dimension, is dropped for that dimension (it is replicated instead).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.config_fields import err, is_int, setting
from gspo_jax.models.config import MESH_AXES, ModelConfig

# The mesh axes a batch's rows are split over: every axis but 'tensor' (the model's
# 'batch' rule; with an 'expert' axis, expert parallelism moves rows, not weights).
BATCH_AXES = ("data", "fsdp", "expert")


def make_mesh(shape: dict[str, int], devices: Optional[Sequence] = None) -> Mesh:
    """The run's device mesh: ``shape`` (`gspo_jax.config.Context.mesh_shape`) over `MESH_AXES`,
    of ``devices`` (default: every device)."""
    devices = jax.devices() if devices is None else list(devices)
    devices = np.asarray(devices).reshape(tuple(shape[a] for a in MESH_AXES))
    return Mesh(devices, MESH_AXES)


def on_mesh(fn, mesh: Mesh):
    """``fn`` (jit-compiled) called, and so traced, with ``mesh`` set (`jax.set_mesh`):
    the model's full forward reads it to shard cuDNN attention's inputs by rows
    (`gspo_jax.models.layers.rows_sharded`). Only the programs are traced under it:
    creating parameters under a mesh would read their logical axis names as mesh axes."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)

    def lower(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn.lower(*args, **kwargs)

    call.lower = lower
    return call


def _axis_size(v) -> str | None:
    if is_int(v) and (v >= 1 or v == -1):
        return None
    return f"size must be an int >= 1, or -1 (the rest), got {v!r}"


def _axis(doc: str):
    return setting(
        -1 if doc.startswith("batch") else 1,
        check=_axis_size,
        doc=doc,
        domain="int >= 1, or -1 (one axis at most: the remaining devices)",
    )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """``config.mesh``: the device mesh's size per axis; their product is the device
    count. May change on resume."""

    data: int = _axis("batch rows (data parallel)")
    fsdp: int = _axis("parameters sharded over it, batch rows too")
    expert: int = _axis("experts (expert parallel), batch rows too")
    tensor: int = _axis("heads and MLP columns (tensor parallel)")


def mesh_shape(sizes, num_devices: int) -> dict[str, int]:
    """Resolve ``config.mesh`` (its axes checked one by one; at most one -1) against
    the device count (ConfigError naming the ``config.mesh`` field)."""
    for axis in MESH_AXES:
        if axis not in sizes:
            raise err(f"mesh.{axis}", "missing mesh axis")
    for axis in sizes.keys():
        if axis not in MESH_AXES:
            raise err(f"mesh.{axis}", f"unknown mesh axis; axes are {MESH_AXES}")
        msg = _axis_size(sizes[axis])
        if msg:
            raise err(f"mesh.{axis}", msg)
    shape = {a: int(sizes[a]) for a in MESH_AXES}
    free = [a for a, v in shape.items() if v == -1]
    if len(free) > 1:
        raise err(f"mesh.{free[1]}", "only one mesh axis may be -1")
    fixed = math.prod(v for v in shape.values() if v != -1)
    if free:
        if num_devices % fixed:
            raise err(
                f"mesh.{free[0]}",
                f"the fixed axes multiply to {fixed}, which does not divide the {num_devices} devices",
            )
        shape[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise err(
            "mesh", f"axis sizes {shape} multiply to {fixed}, but there are {num_devices} devices"
        )
    return shape


def logical_to_mesh_spec(
    names: Sequence[Optional[str]], shape: Sequence[int], rules, mesh: Mesh
) -> P:
    """PartitionSpec for an array of `shape` with logical axis `names`."""
    table = dict(rules)
    used, out = set(), []
    for name, dim in zip(names, shape):
        target = table.get(name) if name is not None else None
        targets = target if isinstance(target, tuple) else (target,)
        chosen, size = [], 1
        for ax in targets:
            if ax is None or ax not in mesh.shape or ax in used:
                continue
            if dim % (size * mesh.shape[ax]) != 0:
                continue
            chosen.append(ax)
            size *= mesh.shape[ax]
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*out)


def _names(var) -> tuple:
    meta = var.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding_names"))
    return tuple(names) if names is not None else (None,) * len(var.shape)


def param_shardings(model_or_state, mesh: Mesh, cfg: ModelConfig):
    """NamedSharding pytree matching `nnx.state(model)` (or the given state)."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

    def one(var):
        if isinstance(var, nnx.Variable):
            names = _names(var)
            # Over the value's arrays: one, or a quantized weight's values and scales
            # (gspo_jax.models.quantized), whose scales' size-1 dims stay unsharded.
            return var.replace(
                jax.tree.map(
                    lambda a: NamedSharding(
                        mesh, logical_to_mesh_spec(names, a.shape, cfg.axis_rules, mesh)
                    ),
                    var.get_value(),
                )
            )
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, cfg: ModelConfig, ndim: int, batch_size: int) -> NamedSharding:
    """Sharding of a [B, ...] activation/batch array by the 'batch' rule."""
    spec = logical_to_mesh_spec(
        ("batch",) + (None,) * (ndim - 1), (batch_size,) + (1,) * (ndim - 1), cfg.axis_rules, mesh
    )
    return NamedSharding(mesh, spec)
