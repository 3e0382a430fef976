"""The host side of a run with several processes (hosts), each driving its own devices.

Every process runs the same program on the same global arrays (JAX's multi-controller
model). What runs on the host is split where it costs: each process decodes and scores
only the rollout rows that live on its own devices (`local_rows`), and the small per-row
results (rewards, lengths, ...) are then gathered to every process (`gather_rows`), so
that every process holds the same host values and takes the same decisions (which groups
to keep, whether to stop). Only process 0 writes files (`is_primary`).

In one process every function here is the identity or a plain read, so a single-process
run takes exactly the path it always took. `docs/distributed.md` has the whole picture.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Sequence

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.config_fields import setting

DISTRIBUTED_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """``config.distributed``: several processes (hosts) in one run
    (`maybe_initialize_distributed`). May change on resume."""

    mode: str = setting(
        "auto",
        choices=DISTRIBUTED_MODES,
        doc="auto: start jax.distributed when a coordinator is named (here or in "
        "JAX_COORDINATOR_ADDRESS) or the environment is a multi-process srun or Open MPI job "
        "or a TPU pod; on: always (JAX detects what is not given); off: never",
    )
    coordinator_address: str = setting("", doc='host:port of process 0 ("" = detected)')
    num_processes: int = setting(0, low=0, doc="processes in the run (0 = detected)")
    process_id: int = setting(-1, low=-1, doc="this process's index (-1 = detected)")


def is_primary() -> bool:
    """Whether this process writes the run's files (metrics, TensorBoard, progress)."""
    return jax.process_index() == 0


def _row_spans(x: jax.Array) -> dict[tuple[int, int], list]:
    """``{(first row, end row): [(device, shard), ...]}`` of the shards of ``x`` on this
    process's devices, by the block of rows each holds."""
    n = x.shape[0]
    spans: dict[tuple[int, int], list] = {}
    for shard in x.addressable_shards:
        lo, hi, _ = (shard.index[0] if shard.index else slice(None)).indices(n)
        spans.setdefault((lo, hi), []).append(shard)
    return spans


def local_rows(arrays: dict[str, jax.Array]) -> tuple[slice, dict[str, np.ndarray]]:
    """This process's rows of row-sharded arrays (all sharded alike): their slice of the
    global rows and their values on the host. Only shards on this process's devices are
    read, each block of rows once (a block several devices hold is not read twice).

    Raises:
      ValueError: this process's rows are not one contiguous block (a mesh whose batch
        axes interleave processes); `docs/distributed.md` says how to lay it out.
    """
    first = next(iter(arrays.values()))
    if first.is_fully_addressable:
        return slice(0, first.shape[0]), jax.device_get(dict(arrays))
    spans = sorted(_row_spans(first))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start != end:
            raise ValueError(
                f"process {jax.process_index()} holds rows {spans} of the batch, not one "
                "block: order the mesh's devices so that each process's devices hold "
                "consecutive rows (docs/distributed.md)"
            )
    out = {}
    for k, x in arrays.items():
        blocks = _row_spans(x)
        if sorted(blocks) != spans:
            raise ValueError(f"{k}: sharded unlike the other rollout arrays")
        out[k] = np.concatenate(jax.device_get([blocks[s][0].data for s in spans]))
    return slice(spans[0][0], spans[-1][1]), out


@functools.cache
def _replicate_fn(mesh):
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))


def gather_rows(local: np.ndarray, like: jax.Array) -> np.ndarray:
    """Every row of a per-row host array, on every process, of which this process holds
    the rows `local_rows` gave it for ``like`` (a row-sharded global array). The pieces
    travel through the devices (an all-gather of ``rows x ...`` small values)."""
    local = np.asarray(local)
    if like.is_fully_addressable:
        return local
    sh = like.sharding
    if not isinstance(sh, NamedSharding):
        raise TypeError(f"gather_rows: expected rows sharded by a NamedSharding, got {sh}")
    row_axis = sh.spec[0] if len(sh.spec) else None
    sharding = NamedSharding(sh.mesh, P(row_axis, *([None] * (local.ndim - 1))))
    shape = (like.shape[0],) + local.shape[1:]
    dtype = np.int32 if local.dtype == np.int64 else local.dtype
    arr = jax.make_array_from_process_local_data(sharding, local.astype(dtype), shape)
    return np.asarray(jax.device_get(_replicate_fn(sh.mesh)(arr)))


def owns_rows(like: jax.Array) -> bool:
    """Whether this process is the lowest-numbered one holding its block of rows of
    ``like``: the one whose counts of that block count (`sum_counts`)."""
    if like.is_fully_addressable:
        return True
    mine = set(_row_spans(like))
    n = like.shape[0]
    for device, index in like.sharding.devices_indices_map(like.shape).items():
        span = (index[0] if index else slice(None)).indices(n)[:2]
        if span in mine and device.process_index < jax.process_index():
            return False
    return True


def sum_counts(counts: dict[str, int], like: jax.Array) -> dict[str, int]:
    """Counts over this process's rows of ``like``, summed over the processes (each block
    of rows counted once, by its owner); every process passes the same keys."""
    if like.is_fully_addressable:
        return dict(counts)
    from jax.experimental import multihost_utils

    keys = sorted(counts)
    owner = owns_rows(like)
    mine = np.asarray([counts[k] if owner else 0 for k in keys], np.int32)
    total = np.asarray(multihost_utils.process_allgather(mine)).sum(axis=0)
    return {k: int(v) for k, v in zip(keys, total)}


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a stop one process was asked for)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).any())


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (no-op in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def answer_codes(answers: Sequence[str | None]) -> np.ndarray:
    """int32 ``[n, 2]``: a 64-bit digest of each answer, (-1, -1) for None. Equal answers,
    equal codes, so a majority vote (`gspo_jax.heldout.maj_at_k`) over the codes is
    the vote over the answers (barring a 2**-64 collision); unlike strings, codes can be
    gathered across processes."""
    out = np.full((len(answers), 2), -1, np.int32)
    for i, a in enumerate(answers):
        if a is not None:
            out[i] = np.frombuffer(hashlib.blake2b(a.encode(), digest_size=8).digest(), np.int32)
    return out


def codes_to_answers(codes: np.ndarray) -> list[str | None]:
    """`answer_codes` back to hashable answers (None where none was given)."""
    return [None if (c == -1).all() else f"{c[0]}:{c[1]}" for c in np.asarray(codes)]


# --------------------------------------------------------------------------
# Start-up: before anything touches a device.


def cluster_detected(environ=os.environ) -> str | None:
    """The multi-process launcher the environment shows, or None: a coordinator named in
    JAX_COORDINATOR_ADDRESS, an srun step or Open MPI job of more than one task, a TPU
    pod on GKE or a Cloud TPU VM. JAX finds the coordinator, process count and id in each."""
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    # srun's step, not the batch script's allocation (SLURM_NTASKS is set there too).
    if int(environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        return "SLURM"
    if int(environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if len([h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "TPU pod"
    try:  # JAX's own test (private): on a Cloud TPU VM initialize() needs no arguments
        from jax._src.clusters.cloud_tpu_cluster import running_in_cloud_tpu_vm
    except ImportError:
        running_in_cloud_tpu_vm = False
    return "Cloud TPU VM" if running_in_cloud_tpu_vm else None


# What XLA may preallocate of each GPU's memory. JAX's default is 75%, which leaves a
# quarter of an H200 (35 GiB) unused; the memory figures of docs/memory.md are against
# 95%. A user's own XLA_PYTHON_CLIENT_MEM_FRACTION (or PREALLOCATE=false) wins.
DEVICE_MEMORY_FRACTION = "0.95"


def claim_device_memory() -> str | None:
    """Set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to `DEVICE_MEMORY_FRACTION` where the user
    has not set it or turned preallocation off; call before anything touches a device.
    Returns the line to log when it set it (None otherwise)."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return None
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
        return None
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = DEVICE_MEMORY_FRACTION
    return (
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={DEVICE_MEMORY_FRACTION} (JAX's default is 0.75; "
        "set the variable to choose another)"
    )


def maybe_initialize_distributed(d: ml_collections.ConfigDict) -> bool:
    """Start multi-process JAX (`jax.distributed.initialize`) where the run has several
    processes; call before anything touches a device. ``d``: the config's
    ``distributed`` block (`gspo_jax.config`); JAX_NUM_PROCESSES and JAX_PROCESS_ID in
    the environment stand in for its counts. Returns whether it started. CPU processes
    exchange data through gloo (`docs/distributed.md`)."""
    address = str(d.coordinator_address) or None
    if d.mode == "off" or jax.distributed.is_initialized():
        return False
    if d.mode == "auto" and address is None and cluster_detected() is None:
        return False
    num = int(d.num_processes) or int(os.environ.get("JAX_NUM_PROCESSES", 0)) or None
    pid = int(d.process_id)
    pid = pid if pid >= 0 else int(os.environ.get("JAX_PROCESS_ID", -1))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address, num_processes=num, process_id=pid if pid >= 0 else None
    )
    print(
        f"jax.distributed: process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.local_device_count()} of {jax.device_count()} devices",
        flush=True,
    )
    return True
