"""Writers that never hang the run: TensorBoard and W&B are written by threads of their
own, and a write error or a write that does not return switches that writer off with
one message while the run goes on; SIGTERM is honoured while a writer is stuck; a
metrics.jsonl that cannot be written stops the run naming it.

The faults are a full file system (a small tmpfs, where this user may mount one) and
the same errors injected into the event file's record writer
(`gspo_jax.event_file.EventWriter.write_record`), the file under every TensorBoard event
write. Before the writers had threads of their own, each of these
tests hung: tensorboardX's writer thread died on the error, its queue filled, and
``add_scalar`` blocked for ever (SIGTERM only set a flag that the loop never read).
Each wait here is bounded, so a hang fails the test instead.
"""

import errno
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from configs import default as default_config
from gspo_jax import event_file
from gspo_jax.metrics_log import MetricsWriter, WandbWriter, read_metrics

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _smoke(data_dir, **overrides):
    c = default_config.get_config("smoke")
    c.task.data_dir = data_dir
    c.update_from_flattened_dict(overrides)
    return c


def _bounded(fn, seconds):
    """``fn()`` on a daemon thread; fails if it has not returned within ``seconds``."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test's thread
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"blocked for more than {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _switched_off(err):
    return [line for line in err.splitlines() if "is switched off" in line]


@pytest.fixture
def events_fail(monkeypatch):
    """Every TensorBoard event write after its file's first record raises ENOSPC."""
    write = event_file.EventWriter.write_record

    def failing(self, data):
        self.test_writes = getattr(self, "test_writes", 0) + 1
        if self.test_writes > 1:
            raise ENOSPC
        return write(self, data)

    monkeypatch.setattr(event_file.EventWriter, "write_record", failing)


class Stuck:
    """Every TensorBoard event write blocks (a hung file system) until `release`, or at
    most ``cap`` seconds; ``expired`` says whether the cap was ever reached (the run
    waited on the writer). ``on_block`` runs at the first write that blocks."""

    def __init__(self, monkeypatch, cap, on_block=None):
        self.cap, self.on_block = cap, on_block
        self.released = threading.Event()
        self.expired = False
        self.blocked = 0
        write = event_file.EventWriter.write_record

        def stuck(writer, data):
            self.blocked += 1
            if self.blocked == 1 and self.on_block is not None:
                self.on_block()
            if not self.released.wait(self.cap):
                self.expired = True
                self.released.set()  # only once: the cap shows the hang already
            return write(writer, data)

        monkeypatch.setattr(event_file.EventWriter, "write_record", stuck)


def test_a_tensorboard_write_error_switches_it_off_once_and_the_run_finishes(
    data_dir, tmp_path, events_fail, capsys
):
    """ENOSPC from TensorBoard's event file mid-run: one message per TensorBoard
    directory (the run's and the updates'), naming it and the error; the run trains to
    its end and metrics.jsonl holds every step."""
    from gspo_jax import train

    c = _smoke(data_dir, **{"sft.steps": 1, "total_rl_steps": 1})
    _bounded(lambda: train.run(c, str(tmp_path)), 300)
    err = capsys.readouterr().err
    off = _switched_off(err)
    assert len(off) == 2, err[-3000:]
    for line, where in zip(sorted(off), ("tb", os.path.join("tb", "updates"))):
        assert line.startswith(f"gspo_jax: TensorBoard ({tmp_path / where}) is switched off: ")
        assert "No space left on device" in line and "the run goes on" in line
    assert "Traceback" not in err
    rl = [r["step"] for r in read_metrics(str(tmp_path)) if r["phase"] == "rl"]
    assert rl == list(range(c.total_rl_steps + 1))


def test_a_tensorboard_write_that_never_returns_does_not_block_the_loop(
    tmp_path, monkeypatch, capsys
):
    """Writes to a file system that hangs: each `write` returns at once; once a write has
    taken longer than the limit the writer is switched off, with one message; `close`
    waits no longer than that."""
    stuck = Stuck(monkeypatch, cap=60)
    try:

        def log():
            w = MetricsWriter(str(tmp_path), timeout=0.5)
            for s in range(50):
                w.write(s, "rl", {"reward_mean": 0.5, "flips": [1, 2]})
            time.sleep(0.6)
            w.write(50, "rl", {"reward_mean": 0.5})
            w.close()

        t0 = time.monotonic()
        _bounded(log, 30)
        assert time.monotonic() - t0 < 10
    finally:
        stuck.released.set()
    assert not stuck.expired
    off = _switched_off(capsys.readouterr().err)
    assert len(off) == 1 and "a write has not returned in 0.5 s (config.log_write_timeout: " in off[0]
    assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(51))


def test_sigterm_while_tensorboard_is_stuck_checkpoints_and_exits(
    data_dir, tmp_path, monkeypatch, capsys
):
    """SIGTERM arrives while TensorBoard's file system hangs: the run finishes its step,
    saves that step's checkpoint and exits with 128 + SIGTERM, without waiting for the
    hung write (beyond config.log_write_timeout)."""
    from gspo_jax import train

    stuck = Stuck(monkeypatch, cap=40, on_block=lambda: os.kill(os.getpid(), signal.SIGTERM))
    c = _smoke(data_dir, **{"sft.steps": 3, "log_write_timeout": 1.0})
    try:
        with pytest.raises(SystemExit) as e:
            train.run(c, str(tmp_path))
    finally:
        stuck.released.set()
    assert e.value.code == 128 + signal.SIGTERM
    assert not stuck.expired, "the run waited on the hung TensorBoard write"
    err = capsys.readouterr().err
    stopped = re.search(r"stopped by SIGTERM after sft step (\d+)", err)
    assert stopped, err[-3000:]
    assert (tmp_path / "checkpoints" / "sft" / stopped.group(1) / "checksums.json").exists()
    assert len(_switched_off(err)) == 1


class FakeRun:
    """A W&B run whose `log` raises, or blocks, from its second call on."""

    def __init__(self, fault):
        self.fault, self.rows, self.finished = fault, [], None
        self.released = threading.Event()
        self.dir = "/nowhere/wandb/run-x/files"

    def define_metric(self, *args, **kw):
        pass

    def log(self, row):
        if self.rows and self.fault == "raises":
            raise ConnectionResetError("the wandb service went away")
        if self.rows and self.fault == "hangs":
            self.released.wait(60)
        self.rows.append(row)

    def finish(self, exit_code=0):
        self.finished = exit_code


@pytest.mark.parametrize("fault", ["raises", "hangs"])
def test_a_wandb_writer_that_fails_is_switched_off_with_one_message(tmp_path, capsys, fault):
    run = FakeRun(fault)
    try:

        def log():
            wb = WandbWriter(run, where=str(tmp_path / "wandb"), timeout=0.5)
            w = MetricsWriter(str(tmp_path), tensorboard=False, wandb=wb)
            for s in range(5):
                w.write(s, "rl", {"reward_mean": 0.1 * s})
                time.sleep(0.2)
            w.close()
            wb.finish(0)

        _bounded(log, 30)
    finally:
        run.released.set()
    off = _switched_off(capsys.readouterr().err)
    assert len(off) == 1, off
    assert off[0].startswith(f"gspo_jax: Weights & Biases ({tmp_path / 'wandb'}) is switched off: ")
    why = "ConnectionResetError: the wandb service went away" if fault == "raises" else "0.5 s"
    assert why in off[0] and "metrics.jsonl keeps every record" in off[0]
    assert run.finished is None  # nothing more is sent to a writer switched off
    assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(5))


class FullFile:
    """A text file on a full disk: every write raises ENOSPC."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        raise ENOSPC

    def flush(self):
        self.f.flush()

    def close(self):
        self.f.close()


def test_a_metrics_jsonl_write_error_stops_the_run_naming_the_file(tmp_path):
    """metrics.jsonl is what a resume continues from: a write that fails stops the run
    (before the step's checkpoint is saved), naming the file and the error."""
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    w.write(0, "rl", {"reward_mean": 0.5})
    w._f = FullFile(w._f)
    with pytest.raises(OSError) as e:
        w.write(1, "rl", {"reward_mean": 0.5})
    assert e.value.errno == errno.ENOSPC
    msg = str(e.value)
    assert str(tmp_path / "metrics.jsonl") in msg and "No space left on device" in msg
    assert "run the same command to resume" in msg
    w.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0]


@pytest.fixture
def full_fs(tmp_path):
    """A small tmpfs mounted at ``tmp_path / "full"`` and filled up (skipped where this
    user may not mount one)."""
    path = tmp_path / "full"
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)]
    try:
        done = subprocess.run(mount, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is None or done.returncode:
        pytest.skip("cannot mount a tmpfs here; the faults are injected by the other tests")
    try:
        with open(path / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def test_a_full_file_system(full_fs, tmp_path, capsys):
    """TensorBoard's directory on a full tmpfs: switched off with one message, the
    records go on. metrics.jsonl on it: the run stops, naming the file."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    os.symlink(full_fs, workdir / "tb")

    def log():
        w = MetricsWriter(str(workdir), timeout=5)
        for s in range(20):
            w.write(s, "rl", {"reward_mean": 0.5})
        w.close()

    _bounded(log, 30)
    off = _switched_off(capsys.readouterr().err)
    assert len(off) == 1 and "No space left on device" in off[0], off
    assert [r["step"] for r in read_metrics(str(workdir))] == list(range(20))
    w = MetricsWriter(str(full_fs), tensorboard=False)
    with pytest.raises(OSError, match=re.escape(str(full_fs / "metrics.jsonl"))):
        w.write(0, "rl", {"reward_mean": 0.5})
    try:
        w.close()  # flushes what is still buffered: the disk is as full as before
    except OSError:
        pass


def test_a_full_disk_under_metrics_jsonl_keeps_the_checkpoints_and_resumes(
    data_dir, tmp_path, monkeypatch
):
    """The disk fills as RL step 2's record is written: the run stops with the OSError
    naming metrics.jsonl, before step 2's checkpoint (the record and the checkpoints stay
    in step) and after step 1's is finished; once there is room the same command
    resumes, and every step is recorded once."""
    from gspo_jax import metrics_log, train

    class FillsUp:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            rec = json.loads(text)
            if (rec["phase"], rec["step"]) == ("rl", 2):
                raise ENOSPC
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def open_(path, mode="r", **kw):
        f = open(path, mode, **kw)
        return FillsUp(f) if path.endswith("metrics.jsonl") and mode == "a" else f

    c = _smoke(data_dir, **{"sft.steps": 1, "total_rl_steps": 3})
    monkeypatch.setattr(metrics_log, "open", open_, raising=False)
    with pytest.raises(OSError, match=re.escape(str(tmp_path / "metrics.jsonl"))):
        train.run(c, str(tmp_path))
    ckpt = tmp_path / "checkpoints" / "rl"
    assert (ckpt / "1" / "checksums.json").exists() and not (ckpt / "2").exists()
    monkeypatch.undo()
    train.run(c, str(tmp_path))
    rl = [r["step"] for r in read_metrics(str(tmp_path)) if r["phase"] == "rl"]
    assert rl == [0, 1, 2, 3]
