"""Logical axis names -> mesh axes, and parameters created already sharded.

Every parameter carries logical axis names (`make_param`); the config's
`axis_rules` map each to a mesh axis of a ('data', 'fsdp', 'expert', 'tensor')
mesh (or a tuple of them, or None).  A mesh axis is used at most once per
array; a mesh axis that is absent from the mesh, or whose size does not divide
the dimension, is dropped for that dimension (it is replicated instead).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.models.config import MESH_AXES, ModelConfig

# The mesh axes a batch's rows are split over: every axis but 'tensor' (the model's
# 'batch' rule; with an 'expert' axis, expert parallelism moves rows, not weights).
BATCH_AXES = ("data", "fsdp", "expert")


def make_mesh(shape: dict[str, int]) -> Mesh:
    """The run's device mesh: ``shape`` (`gspo_jax.config.mesh_shape`) over `MESH_AXES`."""
    devices = np.asarray(jax.devices()).reshape(tuple(shape[a] for a in MESH_AXES))
    return Mesh(devices, MESH_AXES)


def on_mesh(fn, mesh: Mesh):
    """``fn`` (jit-compiled) called, and so traced, with ``mesh`` set (`jax.set_mesh`):
    the model's full forward reads it to shard cuDNN attention's inputs by rows
    (`gspo_jax.models.layers._rows_sharded`). Only the programs are traced under it:
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
            return var.replace(
                NamedSharding(
                    mesh, logical_to_mesh_spec(_names(var), var.shape, cfg.axis_rules, mesh)
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


def init_sharded(cfg: ModelConfig, mesh: Mesh, *, seed: int = 0):
    """A Transformer whose parameters are created directly in their sharding
    (`jax.jit(init, out_shardings=...)`; no full replica is ever materialised)."""
    from gspo_jax.models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    gdef, abs_state = nnx.split(abstract)
    shardings = param_shardings(abs_state, mesh, cfg)

    @jax.jit
    def init():
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(gdef, state)
