"""Pickle-free reading and writing of .safetensors files, bf16 included.

Format: u64 little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes (offsets relative to the data start).
numpy has no bfloat16, so bf16 tensors use `ml_dtypes.bfloat16` (a jax
dependency); the `safetensors` package's numpy API cannot load them.

Files are untrusted: :func:`read_header` checks every header field (and the
header length against the file size, before reading it) and raises ValueError
naming the file and the tensor.

Two ways to read and two to write:

* :func:`read_safetensors` maps a whole file and returns every tensor (small
  files, tests);
* :func:`tensor_infos` + :class:`TensorReader` read the headers only, then map
  one tensor at a time, so a process holds at most the tensors it is using (the
  model loader: the checkpoint of a 30B model never sits in host memory);
* :func:`write_safetensors` writes one file from a dict of arrays;
* :func:`write_sharded` writes a Hugging Face sharded checkpoint
  (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``)
  from the tensors' names and shapes, known in advance, and an iterator that
  produces the arrays one by one: the writer holds one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import struct
from typing import Iterable, Mapping, Optional, Sequence, Union

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


MAX_HEADER_BYTES = 100_000_000  # the limit the `safetensors` package enforces


def _unique_keys(pairs):
    """json object_pairs_hook: refuse a key given twice (json.loads keeps the last)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str) -> tuple[dict, int, int]:
    """The validated header of a safetensors file: ``(tensors, data_start, data_size)``.

    ``tensors`` maps each name to ``(dtype, shape, begin, end)``, offsets relative
    to the data start. The file is untrusted: every field is checked before use
    (header length against the file size, a JSON object, known dtypes,
    non-negative integer shapes, offsets inside the data that match the shape
    and do not overlap, ``__metadata__`` a str -> str map).

    Raises:
      ValueError: naming the file and, where there is one, the tensor.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(
                f"{path}: header length {n} is more than the {size - 8} bytes after it "
                "(truncated, or not a safetensors file)"
            )
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} is over the {MAX_HEADER_BYTES} limit")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError(f"{path}: bad safetensors header: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a duplicate key
        raise ValueError(f"{path}: bad safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(
            f"{path}: bad safetensors header: a JSON {type(header).__name__}, not an object"
        )
    data_size = size - 8 - n
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{path}: __metadata__ must map strings to strings")
    tensors = {}
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ValueError(f"{where}: entry is a {type(info).__name__}, not an object")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
        if missing:
            raise ValueError(f"{where}: entry has no {', '.join(missing)}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ValueError(
                f"{where}: unsupported dtype {dtype!r} (supported: {', '.join(_DTYPES)})"
            )
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
            raise ValueError(f"{where}: data_offsets {offsets!r} is not two integers")
        b, e = offsets
        if not 0 <= b <= e <= data_size:
            raise ValueError(
                f"{where}: data_offsets [{b}, {e}] outside the {data_size} data bytes "
                "(or begin > end)"
            )
        nbytes = _DTYPES[dtype].itemsize * math.prod(shape)
        if e - b != nbytes:
            raise ValueError(
                f"{where}: data_offsets [{b}, {e}] hold {e - b} bytes, but {dtype} {shape} "
                f"needs {nbytes}"
            )
        tensors[name] = (dtype, tuple(shape), b, e)
    spans = sorted((b, e, name) for name, (_, _, b, e) in tensors.items() if e > b)
    for (_, e0, first), (b1, _, second) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors {first!r} and {second!r} overlap in the data")
    return tensors, 8 + n, data_size


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file, as read-only numpy arrays backed by a memory map.

    Raises ValueError naming the file and the tensor for a malformed file (see
    :func:`read_header`).
    """
    tensors, start, data_size = read_header(path)
    if data_size == 0:
        data = np.zeros(0, np.uint8)
    else:
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(data_size,))
    return {
        name: data[b:e].view(_DTYPES[dtype]).reshape(shape)
        for name, (dtype, shape, b, e) in tensors.items()
    }


def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], metadata: Optional[Mapping[str, str]] = None
) -> None:
    """Write tensors (numpy arrays; bf16 as ml_dtypes.bfloat16) to `path`."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype.newbyteorder("<") in _NAMES:
            a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        if a.dtype not in _NAMES:
            raise ValueError(f"write_safetensors: tensor {name!r} has unsupported dtype {a.dtype}")
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data start to 8 bytes
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)


# ---------------------------------------------------------------- per-tensor reading
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file (from its validated header).

    ``begin`` and ``end`` are absolute byte offsets in ``file``.
    """

    file: str
    name: str
    dtype: str  # the safetensors name: "BF16", "F32", ...
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return _DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def tensor_infos(path: str) -> dict[str, TensorInfo]:
    """Every tensor of the file at ``path``, read from its header alone (validated by
    :func:`read_header`; no tensor data is read)."""
    tensors, start, _ = read_header(path)
    return {
        name: TensorInfo(path, name, dtype, shape, start + b, start + e)
        for name, (dtype, shape, b, e) in tensors.items()
    }


class TensorReader:
    """Maps tensors one at a time from their files.

    :meth:`array` returns a read-only array backed by a memory map of that tensor's
    bytes alone; the map is released when the array (and every view of it) is
    freed. Pages are read from disk as they are touched, so slicing the array
    reads only the pages the slice covers, and dropping it takes its pages out of
    the process's resident memory. Files stay open until :meth:`close` (or the end
    of a ``with`` block).
    """

    def __init__(self):
        self._files: dict[str, object] = {}

    def array(self, info: TensorInfo) -> np.ndarray:
        if info.nbytes == 0:
            out = np.zeros(info.shape, info.np_dtype)
            out.flags.writeable = False
            return out
        f = self._files.get(info.file)
        if f is None:
            f = self._files[info.file] = open(info.file, "rb")
        start = info.begin - info.begin % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(f.fileno(), info.end - start, offset=start, access=mmap.ACCESS_READ)
        count = info.nbytes // info.np_dtype.itemsize
        return np.frombuffer(
            mapped, dtype=info.np_dtype, count=count, offset=info.begin - start
        ).reshape(info.shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- sharded writing
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: Union[int, str]) -> int:
    """Bytes in ``size``: an int, or a string such as "5GB" (10**9) or "500MiB" (2**20)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if not m or m.group(2).upper() not in _SIZE_UNITS:
            raise ValueError(f"size {size!r}: expected bytes, or a number with KB/MB/GB/MiB/GiB")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"size {size!r}: must be positive")
    return n


def _tensor_bytes(a, name: str, dtype: np.dtype, shape: tuple) -> memoryview:
    """The bytes of array ``a`` for tensor ``name`` of ``dtype`` and ``shape`` (checked)."""
    if a is None:
        raise ValueError(f"write_sharded: the arrays ran out before tensor {name!r}")
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"write_sharded: tensor {name!r} has shape {a.shape}, expected {shape}")
    a = np.ascontiguousarray(a.astype(dtype, copy=False))
    return a.reshape(-1).view(np.uint8).data


_SHARD_NAME = re.compile(r"(?P<prefix>.+)-\d{5}-of-\d{5}\.safetensors")


def write_sharded(
    folder: str,
    specs: Sequence[tuple[str, np.dtype, Sequence[int]]],
    arrays: Iterable[np.ndarray],
    *,
    max_shard_size: Union[int, str] = "5GB",
    metadata: Optional[Mapping[str, str]] = None,
    prefix: str = "model",
) -> list[str]:
    """Write tensors in the Hugging Face sharded layout, one tensor in memory at a time.

    ``specs`` lists every tensor ``(name, dtype, shape)`` in the order ``arrays``
    yields them; each array is checked against its spec (shape) and converted to
    its dtype as it is written. Tensors go, in order, into shards of at most
    ``max_shard_size`` bytes of data (a tensor larger than that gets a shard of its
    own). With one shard the file is ``{prefix}.safetensors`` (what
    ``save_pretrained`` writes too); with more, ``{prefix}-00001-of-0000N.safetensors``
    ... plus ``{prefix}.safetensors.index.json`` (``{"metadata": {"total_size"},
    "weight_map": {tensor: file}}``).

    Each file is written to a temporary name and renamed when complete. Then weight
    files of an earlier export under the same prefix (``{prefix}.safetensors``,
    its index, ``{prefix}-*-of-*.safetensors``) that this export did not write are
    removed, so that no loader picks a stale one.

    Returns the names of the files written, index included.
    """
    limit = parse_size(max_shard_size)
    entries, seen = [], set()
    for name, dtype, shape in specs:
        dtype = np.dtype(dtype)
        if dtype.newbyteorder("<") in _NAMES:
            dtype = dtype.newbyteorder("<")
        if dtype not in _NAMES:
            raise ValueError(f"write_sharded: tensor {name!r} has unsupported dtype {dtype}")
        if name in seen:
            raise ValueError(f"write_sharded: tensor {name!r} is listed twice")
        seen.add(name)
        shape = tuple(int(d) for d in shape)
        entries.append((name, dtype, shape, dtype.itemsize * math.prod(shape)))
    shards, size = [[]], 0
    for entry in entries:
        if shards[-1] and size + entry[3] > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[3]
    n = len(shards)
    names = (
        [f"{prefix}.safetensors"]
        if n == 1
        else [f"{prefix}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    os.makedirs(folder, exist_ok=True)
    it = iter(arrays)
    weight_map = {}
    for file_name, shard in zip(names, shards):
        header, offset = {}, 0
        for name, dtype, shape, nbytes in shard:
            header[name] = {
                "dtype": _NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file_name
        if metadata:
            header["__metadata__"] = dict(metadata)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # align the data start to 8 bytes
        path = os.path.join(folder, file_name)
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(blob)))
                f.write(blob)
                for name, dtype, shape, _ in shard:
                    f.write(_tensor_bytes(next(it, None), name, dtype, shape))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    if next(it, None) is not None:
        raise ValueError(f"write_sharded: more arrays than the {len(entries)} specs")
    written = list(names)
    index_name = f"{prefix}.safetensors.index.json"
    if n > 1:
        index = {
            "metadata": {"total_size": sum(e[3] for e in entries)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        tmp = os.path.join(folder, index_name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
        os.replace(tmp, os.path.join(folder, index_name))
        written.append(index_name)
    for old in os.listdir(folder):
        m = _SHARD_NAME.fullmatch(old)
        stale = old in (f"{prefix}.safetensors", index_name) or (
            m is not None and m.group("prefix") == prefix
        )
        if stale and old not in written:
            os.remove(os.path.join(folder, old))
    return written
