"""Pickle-free reading and writing of .safetensors files, bf16 included.

Format: u64 little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes (offsets relative to the data start).
numpy has no bfloat16, so bf16 tensors use `ml_dtypes.bfloat16` (a jax
dependency); the `safetensors` package's numpy API cannot load them.

Files are untrusted: :func:`read_header` checks every header field (and the
header length against the file size, before reading it) and raises ValueError
naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Mapping, Optional

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
