"""Reading a Hugging Face checkpoint: `from_pretrained`, streaming.

`from_pretrained` reads the headers of the weight files (only files inside the
checkpoint folder, refusing links that lead elsewhere), checks every tensor against
the config (`hf_layout`'s table), then memory-maps one tensor at a time and puts
each device's block of it (converted to our layout and dtype) on that device
alone; it never holds the whole model on the host or on one device
(docs/checkpoints.md).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.hf_layout import (
    config_from_hf,
    dotted_attr,
    hf_shape,
    layer_slots,
    layer_table,
)
from gspo_jax.models.safetensors_io import TensorInfo, TensorReader, tensor_infos
from gspo_jax.models.transformer import Transformer


# ---------------------------------------------------------------- files
def _allowed_roots(path: str) -> list[str]:
    """Where the weight files of the checkpoint folder ``path`` may really live: the
    folder itself and, for a Hugging Face hub cache snapshot
    (``<repo>/snapshots/<revision>``, whose files link to ``<repo>/blobs/``), that
    repository's blob store."""
    real = os.path.realpath(path)
    roots = [real]
    if os.path.basename(os.path.dirname(os.path.abspath(path))) == "snapshots":
        roots.append(os.path.realpath(os.path.join(path, "..", "..", "blobs")))
    return roots


def _weight_file(path: str, name, where: str) -> str:
    """The file ``name`` inside the checkpoint folder ``path`` (``where`` names who
    asked for it); refuses absolute paths, ``..``, links that lead elsewhere, and
    names that are not an existing ``.safetensors`` file."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: weight file {name!r} is not a file name")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
        raise ValueError(f"{where}: weight file {name!r} is not inside the checkpoint folder")
    if not name.endswith(".safetensors"):
        raise ValueError(f"{where}: weight file {name!r} is not a .safetensors file")
    full = os.path.join(path, *parts)
    real = os.path.realpath(full)
    if not any(os.path.commonpath([real, root]) == root for root in _allowed_roots(path)):
        raise ValueError(
            f"{where}: weight file {name!r} links to {real}, outside the checkpoint folder"
        )
    if not os.path.isfile(full):
        raise ValueError(f"{where}: weight file {name!r} does not exist")
    return full


def _read_index(index: str) -> list[str]:
    """The weight file names of ``model.safetensors.index.json`` (untrusted JSON)."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, too deeply nested
        raise ValueError(f"{index}: invalid JSON: {type(e).__name__}: {e}") from None
    except (KeyError, TypeError):
        raise ValueError(f"{index}: no 'weight_map' object") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, not an object")
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise ValueError(f"{index}: tensor {tensor!r} maps to {name!r}, not a file name")
    return sorted(set(weight_map.values()))


def _read_checkpoint(path: str) -> dict[str, TensorInfo]:
    """Where each tensor of the checkpoint folder ``path`` lies, from the validated
    headers of its weight files (the index's files, or else every
    ``*.safetensors``); no tensor data is read."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = [_weight_file(path, name, index) for name in _read_index(index)]
    else:
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        files = [_weight_file(path, os.path.basename(p), path) for p in files]
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (pickle checkpoints are not read)")
    infos: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in tensor_infos(file).items():
            if name in infos:
                raise ValueError(
                    f"{path}: tensor {name!r} is in both {infos[name].file} and {file}"
                )
            infos[name] = info
    return infos


# ---------------------------------------------------------------- loading
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_FILE_TO_PARAM_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float32"}


def _file_dtype(infos: dict[str, TensorInfo]) -> str:
    """The parameter dtype that keeps the checkpoint's precision: the floating dtype
    holding most of its bytes (F64 becomes float32, the widest ModelConfig allows)."""
    total: dict[str, int] = {}
    for info in infos.values():
        if info.dtype in _FLOAT_DTYPES:
            total[info.dtype] = total.get(info.dtype, 0) + info.nbytes
    if not total:
        return "float32"
    return _FILE_TO_PARAM_DTYPE[max(total, key=total.get)]


class _Tensor:
    """One checkpoint tensor as an array of our layout: ``view`` (transposes,
    reshapes and slices only, so no data is copied or read) turns the mapped file
    array into ours, and :meth:`read` copies the block ``index`` of that into
    ``out``, converting the dtype; only the pages the block covers are read."""

    def __init__(self, info: TensorInfo, view=None):
        self.info, self.view = info, view

    def read(self, reader: TensorReader, index: tuple, out: np.ndarray) -> None:
        a = reader.array(self.info)
        out[...] = (self.view(a) if self.view else a)[index]
        # `a` goes out of scope here: its memory map (and its pages) are released.


class _Stack:
    """An array whose leading axis is gathered from several tensors (the experts
    of one layer, each its own tensor in the checkpoint)."""

    def __init__(self, parts: list):
        self.parts = parts

    def read(self, reader: TensorReader, index: tuple, out: np.ndarray) -> None:
        for j, k in enumerate(range(*index[0].indices(len(self.parts)))):
            self.parts[k].read(reader, index[1:], out[j])


class _Checkpoint:
    """The checkpoint's tensors, checked as the loader claims them: each must exist,
    have the shape the config implies and a floating dtype; the tensors no
    parameter claims are reported by :meth:`check_all_used`."""

    def __init__(self, path: str, infos: dict[str, TensorInfo], param_dtype: str):
        self.path, self.infos, self.param_dtype = path, infos, param_dtype
        self.used: set[str] = set()

    def tensor(self, name: str, hf_shape, our_shape, view=None) -> _Tensor:
        info = self.infos.get(name)
        if info is None:
            raise ValueError(f"{self.path}: missing tensor {name!r}")
        where = f"{info.file}: tensor {name!r}"
        if info.shape != tuple(hf_shape):
            raise ValueError(f"{where} has shape {info.shape}, expected {tuple(hf_shape)}")
        if info.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{where} has dtype {info.dtype}, which does not convert to "
                f"{self.param_dtype} parameters (floating dtypes only: "
                f"{', '.join(_FLOAT_DTYPES)})"
            )
        # The view on a zero-strided stand-in: its shape, without touching data.
        got = np.broadcast_to(np.zeros((), np.float32), info.shape)
        got = (view(got) if view else got).shape
        if got != tuple(our_shape):
            raise ValueError(f"{where} converts to {got}, expected {tuple(our_shape)}")
        self.used.add(name)
        return _Tensor(info, view)

    def check_all_used(self, ignore=()) -> None:
        leftover = sorted(
            k
            for k in self.infos
            if k not in self.used and k not in ignore and not k.endswith("rotary_emb.inv_freq")
        )
        if leftover:
            raise ValueError(
                f"{self.path}: unexpected tensors (unsupported features?): {leftover[:8]}"
                + (" ..." if len(leftover) > 8 else "")
            )


def _plan(model: Transformer, ckpt: _Checkpoint) -> dict[int, tuple[nnx.Param, object]]:
    """For each parameter (by id): ``(param, source)``, where the source is a list
    with one source per stacked layer for the parameters of a segment's blocks, or
    one source for the others. Every tensor is checked here, before any is read."""
    cfg = model.cfg
    plan: dict[int, tuple[nnx.Param, object]] = {}

    def layer(param, r, source):
        if id(param) not in plan:
            plan[id(param)] = (param, [None] * param.shape[0])
        plan[id(param)][1][r] = source

    d, e, f, v = cfg.d_model, cfg.num_experts, cfg.moe_d_ff, cfg.vocab_size
    t = lambda w: w.T  # noqa: E731
    for i, (blk, r) in enumerate(layer_slots(model)):
        pre = f"model.layers.{i}."
        for suffix, attr, to_ours, to_hf in layer_table(cfg, blk.is_moe):
            p = dotted_attr(blk, attr)
            inner = tuple(p.shape[1:])
            layer(p, r, ckpt.tensor(pre + suffix, hf_shape(to_hf, inner), inner, to_ours))
        if not blk.is_moe:
            continue
        mlp = blk.mlp
        fused = pre + "mlp.experts.gate_up_proj"
        if fused in ckpt.infos:  # transformers' fused layout: [E, 2I, D] and [E, D, I]
            gu = (e, 2 * f, d)
            layer(mlp.gate, r, ckpt.tensor(fused, gu, (e, d, f), lambda w: w[:, :f].swapaxes(1, 2)))
            layer(mlp.up, r, ckpt.tensor(fused, gu, (e, d, f), lambda w: w[:, f:].swapaxes(1, 2)))
            down = pre + "mlp.experts.down_proj"
            layer(mlp.down, r, ckpt.tensor(down, (e, d, f), (e, f, d), lambda w: w.swapaxes(1, 2)))
        else:
            for attr, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
                parts = [
                    ckpt.tensor(f"{pre}mlp.experts.{x}.{attr}_proj.weight", shape, shape[::-1], t)
                    for x in range(e)
                ]
                layer(getattr(mlp, attr), r, _Stack(parts))
    whole = [
        (model.embed, ckpt.tensor("model.embed_tokens.weight", (v, d), (v, d))),
        (model.final_norm.scale, ckpt.tensor("model.norm.weight", (d,), (d,))),
    ]
    if not cfg.tie_embeddings:
        whole.append((model.lm_head, ckpt.tensor("lm_head.weight", (v, d), (d, v), t)))
    for p, source in whole:
        plan[id(p)] = (p, source)
    # Tied checkpoints may store a copy of the embedding as lm_head.weight.
    ckpt.check_all_used(ignore=("lm_head.weight",) if cfg.tie_embeddings else ())
    return plan


def _block_key(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _assemble(shape: tuple, sharding, np_dtype: np.dtype, fill) -> jax.Array:
    """A global array of ``shape`` on ``sharding``, built block by block on the host.

    ``fill(index, out)`` writes the block ``index`` (a tuple of slices) into the
    host array ``out``. Each distinct block is filled once, put on every device
    that holds it, and freed before the next: the host holds one device's block at
    a time, and each device receives only its shard.
    """
    index_map = sharding.addressable_devices_indices_map(shape)
    groups: dict[tuple, list] = {}
    for device, index in index_map.items():
        groups.setdefault(_block_key(index, shape), []).append(device)
    pieces = {}
    for key, devices in groups.items():
        block = np.empty(tuple(b - a for a, b in key), np_dtype)
        fill(tuple(slice(a, b) for a, b in key), block)
        for device in devices:
            pieces[device] = jax.device_put(block, device)
        jax.block_until_ready([pieces[device] for device in devices])
        del block
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [pieces[device] for device in index_map]
    )


def _layer_sharding(sharding, ndim: int):
    """The sharding of one layer of a stacked parameter (its leading axis dropped)."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, P(*spec[1:]))
    return sharding  # one device


def _set_layer(stack, layer, r):
    return jax.lax.dynamic_update_index_in_dim(stack, layer, r, 0)


def _load_param(param, source, sharding, dtype, reader: TensorReader) -> jax.Array:
    """One parameter, read from the checkpoint straight onto its sharding.

    A stacked parameter (``source`` a list, one per layer) starts as zeros on its
    sharding and receives one layer at a time through an in-place (donated) update,
    so host and devices hold one layer's blocks beyond the parameter itself.
    """
    shape, np_dtype = tuple(param.shape), np.dtype(dtype)
    if not isinstance(source, list):
        return _assemble(shape, sharding, np_dtype, lambda i, out: source.read(reader, i, out))
    inner = _layer_sharding(sharding, len(shape))
    stack = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    set_layer = jax.jit(_set_layer, donate_argnums=0, out_shardings=sharding)
    for r, src in enumerate(source):
        fill = lambda i, out, src=src: src.read(reader, i, out)  # noqa: E731
        stack = set_layer(stack, _assemble(shape[1:], inner, np_dtype, fill), np.int32(r))
        stack.block_until_ready()
    return stack


def _init_param(name: str, param, sharding, cfg: ModelConfig) -> jax.Array:
    """A parameter that checkpoints do not hold (the value head), initialised as
    the Transformer initialises it, directly on its sharding."""
    shape, dtype = tuple(param.shape), cfg.jnp_param_dtype
    if name == "value_w":
        key = jax.random.key(0)
        fn = lambda: (cfg.init_std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)  # noqa: E731
    elif name == "value_b":
        fn = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    else:
        raise ValueError(
            f"from_pretrained: parameter {name!r} is not loaded (internal layout error)"
        )
    return jax.jit(fn, out_shardings=sharding)()


def from_pretrained(
    path: str,
    *,
    dtype=None,
    param_dtype=None,
    moe_backend: str = "blocked",
    mesh: Optional[jax.sharding.Mesh] = None,
    **overrides,
) -> Transformer:
    """Load a HF checkpoint directory (config.json + *.safetensors) as a Transformer,
    streaming each tensor from its file onto its sharding.

    Nothing is materialised whole: every tensor is memory-mapped from its file on
    its own, converted (transposed, reshaped, cast) one device block at a time, and
    put only on the devices that hold that block, so peak host memory is the
    parameters' own device copies (on CPU devices) plus about one layer's block,
    and no device holds more than its shard. See docs/checkpoints.md.

    Args:
      path: directory with config.json and model.safetensors (or shards with
        model.safetensors.index.json).
      dtype: compute dtype (default float32).
      param_dtype: parameter dtype. Default: ``dtype`` when that is given, else the
        checkpoint's own dtype (bf16 files give bf16 parameters; F64 gives float32).
      moe_backend: 'blocked' | 'ragged' | 'dense'.
      mesh: if given, each parameter is placed on the sharding `param_shardings`
        gives it; else on the default device.
      **overrides: any other ModelConfig field (scan_layers, remat_policy,
        value_head, num_valid_tokens, ...). A value head, which checkpoints do not
        hold, is initialised as `Transformer` initialises it.

    Raises ValueError naming the architecture or config field that is unsupported,
    or the file and tensor that is missing, of the wrong shape or of a dtype that
    does not convert to floating-point parameters.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path}: no config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    infos = _read_checkpoint(path)
    if param_dtype is None:
        param_dtype = dtype if dtype is not None else _file_dtype(infos)
    dtype = jnp.dtype(dtype if dtype is not None else "float32").name
    param_dtype = jnp.dtype(param_dtype).name
    cfg = config_from_hf(
        hf, dtype=dtype, param_dtype=param_dtype, moe_backend=moe_backend, **overrides
    )
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    plan = _plan(model, _Checkpoint(path, infos, param_dtype))

    if mesh is not None:
        from gspo_jax.models.sharding import param_shardings

        by_path = dict(nnx.to_flat_state(param_shardings(nnx.state(model), mesh, cfg)))
        sharding_of = lambda graph_path: by_path[graph_path].get_value()  # noqa: E731
    else:
        device = jax.config.jax_default_device  # set by `with jax.default_device(...)`
        if not isinstance(device, jax.Device):
            device = jax.devices()[0]
        default = SingleDeviceSharding(device)
        sharding_of = lambda graph_path: default  # noqa: E731
    values = []
    with TensorReader() as reader:
        for graph_path, p in nnx.iter_graph(model):
            if not isinstance(p, nnx.Param):
                continue
            sharding = sharding_of(graph_path)
            if id(p) in plan:
                value = _load_param(p, plan[id(p)][1], sharding, cfg.jnp_param_dtype, reader)
            else:
                value = _init_param(str(graph_path[-1]), p, sharding, cfg)
            values.append((p, value))
    for p, value in values:
        p.set_value(value)
    return model
