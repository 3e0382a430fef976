"""Runs with several processes: the host-side helpers (`gspo_jax.multihost`), the
detection of a cluster, and a real two-process run on localhost (jax.distributed with
gloo CPU collectives, 4 fake devices each) against a one-process 8-device run, with one
process killed and both resumed."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import subprocess_env

from gspo_jax import config as config_lib
from gspo_jax import multihost
from gspo_jax.metrics_log import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {
    "step_time",
    "rollout_time",
    "old_logp_time",
    "update_time",
    "sample_time",
    "tokens_per_s",
}


# --------------------------------------------------------------------------
# One process: the helpers are the identity.


def test_one_process_helpers_are_the_identity():
    x = jax.device_put(np.arange(12, dtype=np.int32).reshape(6, 2))
    rows, host = multihost.local_rows({"a": x, "b": x[:, 0]})
    assert rows == slice(0, 6)
    np.testing.assert_array_equal(host["a"], np.arange(12).reshape(6, 2))
    local = np.arange(6, dtype=np.float32)
    assert multihost.gather_rows(local, x) is local
    assert multihost.sum_counts({"ok": 3, "bad": 1}, x) == {"ok": 3, "bad": 1}
    assert multihost.owns_rows(x) and multihost.is_primary()
    assert multihost.any_process(True) and not multihost.any_process(False)
    multihost.barrier("nothing to wait for")


def test_local_rows_reads_each_block_of_a_sharded_array_once():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("fsdp", "expert"))
    x = jax.device_put(np.arange(16, dtype=np.int32), NamedSharding(mesh, P("fsdp")))
    rows, host = multihost.local_rows({"x": x})  # fully addressable here: every row
    assert rows == slice(0, 16)
    np.testing.assert_array_equal(host["x"], np.arange(16))
    # Every block appears on two devices (expert axis): read once each.
    spans = multihost._row_spans(x)
    assert sorted(spans) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert all(len(v) == 2 for v in spans.values())


def test_answer_codes_keep_equality_and_none():
    answers = ["12", None, "12", "7", "", None]
    codes = multihost.answer_codes(answers)
    assert codes.dtype == np.int32 and codes.shape == (6, 2)
    back = multihost.codes_to_answers(codes)
    assert back[1] is None and back[5] is None
    assert back[0] == back[2] and back[0] != back[3] and back[4] not in (None, back[0], back[3])
    # The majority vote over codes is the vote over the answers.
    from gspo_jax import heldout

    correct = np.array([[1, 0, 1, 0, 0, 0]])
    assert (
        heldout.maj_at_k([back], correct, 6)[0] == heldout.maj_at_k([answers], correct, 6)[0]
    )


@pytest.mark.parametrize(
    "env, found",
    [
        ({}, None),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "JAX_COORDINATOR_ADDRESS"),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, None),  # the batch script itself
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16"}, "SLURM"),
        ({"SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "1"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI"),
        ({"TPU_WORKER_HOSTNAMES": "t-0"}, None),
        ({"TPU_WORKER_HOSTNAMES": "t-0,t-1"}, "TPU pod"),
    ],
)
def test_cluster_detection(env, found):
    assert multihost.cluster_detected(env) == found


def test_distributed_off_or_alone_starts_nothing(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    c = config_lib.base_config()
    c.distributed.mode = "off"
    assert multihost.maybe_initialize_distributed(c.distributed) is False
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    c.distributed.mode = "auto"
    assert multihost.maybe_initialize_distributed(c.distributed) is False
    assert jax.process_count() == 1


def test_distributed_fields_are_validated():
    c = config_lib.base_config()
    c.distributed.mode = "sometimes"
    with pytest.raises(config_lib.ConfigError, match="distributed.mode"):
        config_lib.validate(c, jax.device_count())
    c = config_lib.base_config()
    c.distributed.process_id = -2
    with pytest.raises(config_lib.ConfigError, match="distributed.process_id"):
        config_lib.validate(c, jax.device_count())


# --------------------------------------------------------------------------
# Two processes on localhost.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


ARGS = [
    "--config=configs/default.py:smoke",
    "--config.total_rl_steps=3",
    "--config.mesh.data=2",
    "--config.mesh.fsdp=2",
    "--config.mesh.expert=2",
    "--config.progress_bar=False",
]


def _start(workdir, devices, data_dir, *, process_id=None, port=None, extra=()):
    env = subprocess_env(devices)
    cmd = [sys.executable, "-m", "gspo_jax.train", f"--workdir={workdir}", *ARGS, *extra]
    cmd.append(f"--config.task.data_dir={data_dir}")
    if process_id is not None:
        cmd += [
            f"--config.distributed.coordinator_address=localhost:{port}",
            "--config.distributed.num_processes=2",
            f"--config.distributed.process_id={process_id}",
        ]
    log = open(f"{workdir}.p{process_id or 0}.log", "a")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _start_pair(workdir, data_dir):
    port = _free_port()
    return [_start(workdir, 4, data_dir, process_id=i, port=port) for i in (0, 1)]


def _log(workdir, process_id):
    with open(f"{workdir}.p{process_id}.log") as f:
        return f.read()


def _wait(procs, workdir, timeout=600):
    for i, p in enumerate(procs):
        rc = p.wait(timeout=timeout)
        assert rc == 0, f"process {i} exited with {rc}:\n{_log(workdir, i)[-4000:]}"


def _saved_rl_steps(workdir) -> list[int]:
    ckpt = os.path.join(workdir, "checkpoints", "rl")
    if not os.path.isdir(ckpt):
        return []
    return [
        int(d)
        for d in os.listdir(ckpt)
        if d.isdigit() and os.path.exists(os.path.join(ckpt, d, "_CHECKPOINT_METADATA"))
    ]


def test_two_processes_match_one_and_resume_after_one_is_killed(tmp_path):
    data_dir = str(tmp_path / "data")
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _wait([_start(one, 8, data_dir)], one)

    # Two processes; once an RL step is saved, process 1 dies (SIGKILL), and the launcher
    # then stops process 0, which cannot go on without it.
    procs = _start_pair(two, data_dir)
    deadline, killed_after = time.time() + 600, None
    while time.time() < deadline and procs[1].poll() is None:
        steps = _saved_rl_steps(two)
        if steps and max(steps) >= 1:
            procs[1].send_signal(signal.SIGKILL)
            killed_after = max(steps)
            break
        time.sleep(0.05)
    procs[1].wait()
    try:
        procs[0].wait(timeout=20)
    except subprocess.TimeoutExpired:
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
    assert killed_after is not None and killed_after < 3, "the run ended before the kill"
    assert "process 0 of 2, 4 of 8 devices" in _log(two, 0)
    assert "process 1 of 2, 4 of 8 devices" in _log(two, 1)

    # Both start again with the same command: they resume from the checkpoint.
    _wait(_start_pair(two, data_dir), two)

    a = {r["step"]: r for r in read_metrics(one) if r["phase"] == "rl"}
    b_all = [json.loads(line) for line in open(os.path.join(two, "metrics.jsonl"))]
    b = {r["step"]: r for r in b_all if r["phase"] == "rl"}
    # Written once, by process 0: one line per step, none repeated by the resume.
    assert [r["step"] for r in b_all if r["phase"] == "rl"] == [0, 1, 2, 3]
    assert [r["step"] for r in b_all if r["phase"] == "sft"] == [1, 2]
    assert sorted(a) == [0, 1, 2, 3]
    for s in a:
        assert set(a[s]) == set(b[s]), (s, set(a[s]) ^ set(b[s]))
        for k in sorted(set(a[s]) - TIMING - {"phase"}):
            np.testing.assert_allclose(
                np.asarray(b[s][k], float),
                np.asarray(a[s][k], float),
                rtol=2e-3,
                atol=2e-4,  # reductions split differently (gloo across the processes)
                err_msg=f"step {s} metric {k}",
            )
    # The sampled rewards are the same rewards of the same responses.
    for s in (1, 2, 3):
        assert b[s]["reward_mean"] == a[s]["reward_mean"], s

    # Process 1 opened no log of its own: as many TensorBoard files per launch as in one
    # process (two launches here: each opens the run's writers once).
    def events(w):
        return [f for _, _, files in os.walk(os.path.join(w, "tb")) for f in files]

    assert len(events(two)) == 2 * len(events(one)) > 0


OVERLAP = [  # the sampler on 2 devices of each process, overlapped with training on 2 + 2
    "--config.rollout.staleness=1",
    "--config.rollout.devices=4",
    "--config.rollout.overlap=True",
    "--config.mesh.data=2",
    "--config.mesh.fsdp=1",
    "--config.mesh.expert=2",
]


def test_two_processes_overlap_sampling_with_training_as_one_does(tmp_path):
    """rollout.overlap across two processes: each gives 2 of its 4 devices to the sampler
    and scores its own rollout rows; process 0 writes. The metrics are one process's."""
    data_dir = str(tmp_path / "data")
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _wait([_start(one, 8, data_dir, extra=OVERLAP)], one)
    port = _free_port()
    _wait([_start(two, 4, data_dir, process_id=i, port=port, extra=OVERLAP) for i in (0, 1)], two)
    a = {r["step"]: r for r in read_metrics(one) if r["phase"] == "rl"}
    b_all = [json.loads(line) for line in open(os.path.join(two, "metrics.jsonl"))]
    assert [r["step"] for r in b_all if r["phase"] == "rl"] == [0, 1, 2, 3]
    b = {r["step"]: r for r in b_all if r["phase"] == "rl"}
    for s in (1, 2, 3):
        assert b[s]["staleness_max"] == a[s]["staleness_max"] == min(s - 1, 1)
        assert b[s]["reward_mean"] == a[s]["reward_mean"], s  # the same responses, scored
        for k in sorted(set(a[s]) - TIMING - {"phase", "collect_time", "train_wait_time"}):
            np.testing.assert_allclose(np.asarray(b[s][k], float), np.asarray(a[s][k], float),
                                       rtol=2e-3, atol=2e-4, err_msg=f"step {s} metric {k}")


def test_a_process_stopped_for_another_says_so(capsys):
    from gspo_jax import safety

    shutdown = safety.GracefulShutdown()  # this process got no signal
    with pytest.raises(safety.Preempted) as e:
        shutdown.exit("rl step 3")
    assert e.value.code == 128 + signal.SIGTERM
    assert "another process of the run was asked to stop after rl step 3" in capsys.readouterr().err


def test_hf_export_and_load_across_two_processes_match_one(tmp_path):
    """Parameters spread over two processes export to the files one process writes
    (every gather collective, process 0 writing), and load back onto the mesh of both
    processes: exporting the loaded model gives the same files again."""
    from gspo_jax.models.safetensors_io import read_safetensors

    worker = os.path.join(REPO, "tests", "hf_export_worker.py")

    def start(out, devices, *extra):
        env = subprocess_env(devices)
        log = open(f"{out}.{extra[-1] if extra else 0}.log", "w")
        cmd = [sys.executable, worker, str(out), *map(str, extra)]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def reports(out, ids):
        logs = [open(f"{out}.{i}.log").read() for i in ids]
        return [json.loads(log.strip().splitlines()[-1]) for log in logs]

    one, two = tmp_path / "one", tmp_path / "two"
    port = _free_port()
    procs = [start(one, 8)] + [start(two, 4, port, i) for i in (0, 1)]
    for p, name in zip(procs, ("one.0", "two.0", "two.1")):
        rc = p.wait(timeout=600)
        assert rc == 0, open(tmp_path / f"{name}.log").read()[-4000:]
    (r1,), (p0, p1) = reports(one, [0]), reports(two, [0, 1])
    assert not r1["spread"] and p0["spread"] and p1["spread"]
    assert p0["files_a"] == r1["files_a"] and len(p0["files_a"]) > 2  # shards and the index
    assert p1["files_a"] == p1["files_b"] == []  # process 1 wrote nothing

    def tensors(folder):
        out = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                out.update(read_safetensors(os.path.join(folder, f)))
        return out

    want = tensors(one / "a")
    for folder in (two / "a", two / "b", one / "b"):
        got = tensors(folder)
        assert sorted(got) == sorted(want), folder
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{folder}: {name}")
        assert (folder / "config.json").read_text() == (one / "a" / "config.json").read_text()
