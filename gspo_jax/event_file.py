"""TensorBoard event files, written without TensorFlow or tensorboardX.

An event file is a sequence of TFRecords (little-endian ``uint64`` length, masked
CRC-32C of the length, the bytes, masked CRC-32C of the bytes), each an ``Event``
protocol buffer. The writer needs three messages, encoded here by hand (field numbers
from TensorBoard's ``event.proto`` and ``summary.proto``):

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

tensorboardX writes the same bytes, but importing it imports torch when torch is
installed (seconds of a trainer's start for four scalars a step).
"""

import os
import socket
import struct
import time


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecords."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    c = crc32c(data)
    return struct.pack("<I", (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    n = struct.pack("<Q", len(data))
    return n + _masked(n) + data + _masked(data)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: a negative step is ten bytes, as protobuf writes it
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # a length-delimited field
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, *, scalars=(), file_version: str | None = None):
    """The bytes of an ``Event``: ``scalars`` as (tag, value) simple values."""
    out = b"\x09" + struct.pack("<d", wall_time)
    if step:  # proto3 leaves out a field at its default
        out += b"\x10" + _varint(int(step))
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", float(x)))
            for tag, x in scalars
        )
        out += _field(5, values)
    return out


class EventWriter:
    """Appends events to ``<logdir>/events.out.tfevents.<time>.<host>``, TensorBoard's
    file name, starting with the version record TensorBoard reads first."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path = os.path.join(logdir, name)
        self._f = open(self.path, "ab")
        self.write_record(event(time.time(), file_version="brain.Event:2"))

    def write_record(self, data: bytes) -> None:
        self._f.write(record(data))

    def scalars(self, step: int, values, wall_time: float) -> None:
        self.write_record(event(wall_time, step, scalars=values))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_scalars(path: str) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every simple value in the event file ``path``, checking
    each record's checksums (a last record cut short by a crash is skipped)."""
    with open(path, "rb") as f:
        data = f.read()
    out, i = [], 0
    while i + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        if data[i + 8 : i + 12] != _masked(data[i : i + 8]):
            raise ValueError(f"{path}: record at byte {i}: bad length checksum")
        body = data[i + 12 : i + 12 + n]
        if len(body) < n or i + 16 + n > len(data):
            break  # cut short
        if data[i + 12 + n : i + 16 + n] != _masked(body):
            raise ValueError(f"{path}: record at byte {i}: bad data checksum")
        out += _scalars_of(body)
        i += 16 + n
    return out


def _read_varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        byte = b[i]
        n |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            return n, i
        shift += 7


def _fields(b: bytes):
    """(field number, wire type, value) of a message's fields."""
    i = 0
    while i < len(b):
        key, i = _read_varint(b, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(b, i)
        elif wire == 1:
            v, i = b[i : i + 8], i + 8
        elif wire == 5:
            v, i = b[i : i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(b, i)
            v, i = b[i : i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, v


def _scalars_of(body: bytes) -> list[tuple[int, str, float]]:
    step, summaries = 0, []
    for number, _, v in _fields(body):
        if number == 2:
            step = v - (1 << 64) if v >= 1 << 63 else v
        elif number == 5:
            summaries.append(v)
    out = []
    for summary in summaries:
        for number, _, value in _fields(summary):
            if number != 1:
                continue
            tag, x = None, None
            for n, wire, v in _fields(value):
                if n == 1:
                    tag = v.decode()
                elif n == 2 and wire == 5:
                    (x,) = struct.unpack("<f", v)
            if tag is not None and x is not None:
                out.append((step, tag, x))
    return out
