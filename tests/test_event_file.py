"""TensorBoard event files without TensorFlow (`gspo_jax.event_file`): the bytes are
tensorboardX's (its protos and record writer are the reference), TensorBoard's reader
reads them back, and nothing the trainer imports pulls in torch."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from gspo_jax import event_file


@pytest.fixture(autouse=True)
def _tensorboardx():
    # Imported by the tests that need it, not at collection (it imports torch).
    pytest.importorskip("tensorboardX")

SCALARS = [("rl/loss", 0.25), ("rl/x/0", -3.5e-7), ("sft/ü", 1e30), ("rl/nan", float("nan"))]


@pytest.mark.parametrize("step", [0, 1, 300, 2**40, -3])
def test_events_are_tensorboardx_bytes(step):
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.summary import scalar

    wall = time.time()
    summary = Summary(value=[v for tag, x in SCALARS for v in scalar(tag, x).value])
    want = Event(wall_time=wall, step=step, summary=summary).SerializeToString()
    assert event_file.event(wall, step, scalars=SCALARS) == want
    version = Event(wall_time=wall, file_version="brain.Event:2").SerializeToString()
    assert event_file.event(wall, file_version="brain.Event:2") == version


def test_records_and_checksums_are_tensorboardx_ones(tmp_path):
    from tensorboardX.crc32c import crc32c
    from tensorboardX.record_writer import RecordWriter

    rs = np.random.RandomState(0)
    for n in (0, 1, 7, 300):
        data = rs.randint(0, 256, n).astype(np.uint8).tobytes()
        assert event_file.crc32c(data) == crc32c(data)
        path = str(tmp_path / f"r{n}")
        w = RecordWriter(path)
        w.write(data)
        w.close()
        with open(path, "rb") as f:
            assert f.read() == event_file.record(data)


def test_written_scalars_read_back_and_a_cut_record_is_skipped(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    w = event_file.EventWriter(str(tmp_path / "tb"))
    w.scalars(3, SCALARS[:2], time.time())
    w.scalars(4, SCALARS[2:3], time.time())
    w.close()
    assert os.path.basename(w.path).startswith("events.out.tfevents.")
    got = event_file.read_scalars(w.path)
    assert [(s, t) for s, t, _ in got] == [(3, "rl/loss"), (3, "rl/x/0"), (4, "sft/ü")]
    np.testing.assert_array_equal([x for *_, x in got], np.float32([0.25, -3.5e-7, 1e30]))
    # tensorboardX's protos parse every record; the first is the file version.
    with open(w.path, "rb") as f:
        data = f.read()
    first = Event.FromString(data[12 : 12 + int.from_bytes(data[:8], "little")])
    assert first.file_version == "brain.Event:2"
    # A crash mid-record: the whole records are read; a flipped byte is named.
    with open(w.path, "ab") as f:
        f.write(event_file.record(event_file.event(1.0, 5, scalars=[("a", 1.0)]))[:-3])
    assert len(event_file.read_scalars(w.path)) == 3
    bad = bytearray(data)
    bad[20] ^= 1
    (tmp_path / "bad").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="bad data checksum"):
        event_file.read_scalars(str(tmp_path / "bad"))


def test_the_trainer_imports_neither_torch_nor_tensorboardx(tmp_path):
    """A run's TensorBoard writes import nothing heavy (tensorboardX imports torch
    when it is installed: seconds of every trainer's start)."""
    code = f"""
import sys, gspo_jax.train
from gspo_jax.metrics_log import MetricsWriter
w = MetricsWriter({str(tmp_path)!r})
w.write(1, "rl", {{"loss": 0.5}})
w.close()
print(sorted(m for m in ("torch", "tensorboardX", "tensorflow") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    (events,) = os.listdir(tmp_path / "tb")
    assert event_file.read_scalars(str(tmp_path / "tb" / events)) == [(1, "rl/loss", 0.5)]
