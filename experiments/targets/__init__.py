"""Compile-only accelerators: a GPU described by XLA's target spec (this folder's
``*.txtpb``) or a TPU slice through libtpu, with no such device on the machine.

    devices = compile_devices("h200")        # one compile-only H200
    devices = compile_devices("h100x8")      # one node of 8 H100s
    devices = compile_devices("v5p:2x2x1")   # a TPU v5p slice of 4 chips

A GPU target needs JAX's CUDA plugin (``pip install -e '.[compile]'``); a TPU target
needs ``libtpu``. Both compile with ``JAX_PLATFORMS=cpu``: nothing runs on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
GPUS = ("h100", "h200", "b200")

# HBM per TPU chip (GiB), from the vendor's published figures.
TPU_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}


class TargetUnavailable(RuntimeError):
    """The compiler for a target is not installed (the message says what to install)."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given: h200, h100x8, v5p:2x2x1
    platform: str  # cuda or tpu
    devices: tuple
    device_bytes: int  # one device's memory

    @property
    def kind(self) -> str:
        return self.devices[0].device_kind


def _cudnn_version() -> tuple[int, int, int]:
    """The cuDNN the CUDA plugin would run with (the installed wheel's version)."""
    for dist in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            v = importlib.metadata.version(dist).split(".")
            return int(v[0]), int(v[1]), int(v[2])
        except importlib.metadata.PackageNotFoundError:
            continue
    return 9, 10, 0


def gpu_spec(gpu: str) -> str:
    """The text GpuTargetConfigProto of ``gpu`` with the installed cuDNN version."""
    path = os.path.join(HERE, f"{gpu}.txtpb")
    if not os.path.exists(path):
        raise ValueError(f"target: no GPU spec {path}; known GPUs: {', '.join(GPUS)}")
    major, minor, patch = _cudnn_version()
    text = open(path).read()
    return (
        text.replace("DNNVER", f"{major}.{minor}.{patch}")
        .replace("DNNMAJ", str(major))
        .replace("DNNMIN", str(minor))
    )


def _device_memory(spec: str) -> int:
    m = re.search(r"device_memory_size:\s*(\d+)", spec)
    return int(m.group(1))


def compile_devices(name: str) -> Target:
    """The compile-only devices of target ``name`` (module docstring)."""
    from jax.experimental import topologies

    m = re.fullmatch(r"(h100|h200|b200)(?:x(\d+))?", name)
    if m:
        gpu, n = m.group(1), int(m.group(2) or 1)
        try:
            import jax_plugins.xla_cuda13  # noqa: F401
        except ImportError as e:
            raise TargetUnavailable(
                f"target {name!r}: JAX's CUDA plugin is not installed; "
                "pip install -e '.[compile]' (jax-cuda13-plugin[with-cuda])"
            ) from e
        spec = gpu_spec(gpu)
        topo = topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{n}", target_config=spec
        )
        return Target(name, "cuda", tuple(topo.devices), _device_memory(spec))
    m = re.fullmatch(r"(v4|v5e|v5p|v6e):([\dx]+)", name)
    if m:
        try:
            import libtpu  # noqa: F401
        except ImportError as e:
            raise TargetUnavailable(
                f"target {name!r}: libtpu is not installed; pip install -e '.[compile]'"
            ) from e
        # libtpu admits one process per machine (a lock file), for the chips' sake; a
        # compile-only topology touches no chip, so several compiling processes may share.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
        return Target(name, "tpu", tuple(topo.devices), TPU_HBM_GIB[m.group(1)] * 2**30)
    raise ValueError(
        f"target: {name!r} is not a known target; expected one of {', '.join(GPUS)} "
        "(optionally xN devices, e.g. h100x8) or a TPU slice such as v5e:2x2, v5p:2x2x1, "
        "v6e:2x2"
    )


@contextlib.contextmanager
def compiling_for(target: Target):
    """Programs traced inside see ``target`` as the device they are for: JAX's default
    device is its first device (the model's `moe_backend='auto'` and tokamax's kernel
    choice read it), and tokamax's hardware checks are off (its cross-compile flag),
    so its Pallas kernels are the ones the target itself would run."""
    import jax
    from tokamax._src import config as tokamax_config

    with jax.default_device(target.devices[0]), tokamax_config.cross_compile(True):
        yield
