"""gspo_jax.sweep: the grid, point names, the report, and a sweep interrupted
between points that skips its finished point when run again."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import xla_flags

from gspo_jax import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_expand_grid():
    pts = sweep.expand_grid(["objective.hparams.eps_high=0.2,0.28", "--config.seed=0,1"])
    assert pts == [
        {"objective.hparams.eps_high": "0.2", "seed": "0"},
        {"objective.hparams.eps_high": "0.2", "seed": "1"},
        {"objective.hparams.eps_high": "0.28", "seed": "0"},
        {"objective.hparams.eps_high": "0.28", "seed": "1"},
    ]
    assert sweep.expand_grid({"seed": [0, 1]}) == [{"seed": "0"}, {"seed": "1"}]
    assert sweep.expand_grid([]) == [{}]
    for bad in (["seed"], ["seed=0,,1"], ["seed=0,0"], ["seed=0", "config.seed=1"], ["a b=1"]):
        with pytest.raises(ValueError):
            sweep.expand_grid(bad)


def test_point_name():
    pt = {"objective.hparams.eps_high": "0.28", "seed": "1"}
    assert sweep.point_name(pt) == "eps_high=0.28__seed=1"
    assert sweep.point_name({}) == "base"
    # Paths with the same last component keep enough of the path to tell them apart.
    pt = {"optimizer.lr": "1e-3", "sft.lr": "3e-3", "tokenizer": "/ckpt/my model"}
    assert sweep.point_name(pt) == "optimizer.lr=1e-3__sft.lr=3e-3__tokenizer=ckpt_my_model"
    # A group (no seed) is named as in the full grid.
    paths = ["optimizer.lr", "sft.lr", "seed"]
    assert sweep.point_name({"optimizer.lr": "1"}, paths) == "optimizer.lr=1"


def test_values_made_safe_alike_get_names_of_their_own():
    """Values of one axis that read the same once made safe for a file name
    (``ckpt/step_100``, ``ckpt_step_100``) name different points: a value that is a
    safe name itself keeps it, each other one gets a hash of its raw text; a value
    that collides with nothing keeps its name as before."""
    grid = sweep.expand_grid(
        ["tokenizer=ckpt/step_100,ckpt_step_100,ckpt:step_100,/ckpt/my model", "seed=0,1"]
    )
    names = [sweep.point_name(pt, grid=grid) for pt in grid]
    assert len(set(names)) == len(grid) == 8, names
    plain, slash, colon = "tokenizer=ckpt_step_100", names[0], names[4]
    assert names[2] == f"{plain}__seed=0"  # safe as it is: its name, unchanged
    assert slash.startswith(f"{plain}-") and colon.startswith(f"{plain}-") and slash != colon
    assert names[6] == "tokenizer=ckpt_my_model__seed=0"  # no collision: no hash
    # The same names for the same grid, in any order, and for its groups.
    assert [sweep.point_name(pt, grid=grid[::-1]) for pt in grid] == names
    assert sweep.point_name({"tokenizer": "ckpt/step_100"}, ["tokenizer", "seed"], grid) == (
        slash.partition("__")[0]
    )
    # A value written as another one's hashed name: refused, not run twice.
    hashed = slash.partition("__")[0].partition("=")[2]
    with pytest.raises(ValueError, match="would share the point name"):
        sweep.value_names(sweep.expand_grid({"tokenizer": ["ckpt/step_100", "ckpt_step_100", hashed]}))
    # Plug-ins by import path, the other example.
    grid = sweep.expand_grid({"task.verifier": ["pkg.mod:fn", "pkg.mod_fn"]})
    assert len({sweep.point_name(pt, grid=grid) for pt in grid}) == 2


def test_points_named_alike_each_run_in_a_workdir_of_their_own(tmp_path, no_trainer, capsys):
    """``--grid task.file=<d>/x/a.jsonl,<d>/x_a.jsonl``: two points, each run once in its
    own workdir (they shared one: the first ran twice, the second never, "2/2")."""
    w = str(tmp_path / "sweep")
    files = [str(tmp_path / "x" / "a.jsonl"), str(tmp_path / "x_a.jsonl")]
    argv = [f"--config={SMOKE}", f"--workdir={w}", *ONE_STEP, "--grid",
            "task.file=" + ",".join(files)]
    assert sweep.main(argv) == 0
    ran = {name: overrides["task.file"] for _, name, overrides in no_trainer}
    assert sorted(ran.values()) == sorted(files), no_trainer
    assert len(ran) == 2  # two workdirs
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| file=")]
    assert len(rows) == 2 and all("| 0/1 |" in r for r in rows), rows  # a row each
    with open(os.path.join(w, "sweep.json")) as f:
        assert sorted(json.load(f)["points"]) == sorted(ran)


def _fake_point(workdir, name, rewards, clip):
    d = os.path.join(workdir, name)
    os.makedirs(d)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for s, r in enumerate(rewards):
            rec = {"step": s, "phase": "rl", "eval_reward_mean": r, "clip_frac": clip}
            f.write(json.dumps(rec) + "\n")


def test_summarize_means_over_seeds(tmp_path):
    w = str(tmp_path)
    pts = sweep.expand_grid(["objective.hparams.eps_high=0.2,0.28", "seed=0,1"])
    _fake_point(w, "eps_high=0.2__seed=0", [0.0, 0.5], 0.1)
    _fake_point(w, "eps_high=0.2__seed=1", [0.0, 0.7], 0.3)
    _fake_point(w, "eps_high=0.28__seed=0", [0.0, 0.2], 0.2)  # seed 1 not run
    table = sweep.summarize(w, pts, ["eval_reward_mean", "clip_frac"], steps=1)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert "| 2/2 | 0.6 (0.5-0.7) | 0.2 (0.1-0.3) |" in rows["eps_high=0.2"]
    assert "| 1/2 | 0.2 | 0.2 |" in rows["eps_high=0.28"]
    assert sweep.finished(os.path.join(w, "eps_high=0.2__seed=0"), 1)
    assert not sweep.finished(os.path.join(w, "eps_high=0.2__seed=0"), 2)
    assert not sweep.finished(os.path.join(w, "eps_high=0.28__seed=1"), 1)


def test_sweep_interrupted_then_resumed(tmp_path, tmp_path_factory, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("XLA_FLAGS", xla_flags(1))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    w = str(tmp_path / "sweep")
    argv = [
        "--config=configs/default.py:smoke", f"--workdir={w}",
        "--grid", "objective.hparams.eps_high=0.2,0.28", "--grid", "seed=0,1",
        "--metric", "eval_reward_mean", "--metric", "clip_frac",
        "--config.total_rl_steps=1", "--config.sft.steps=1", "--config.progress_bar=False",
        f"--config.task.data_dir={data_dir}",
    ]
    # Stopped after the first point, as a sweep killed between points.
    assert sweep.main(argv + ["--max-points", "1"]) == 0
    first = os.path.join(w, "eps_high=0.2__seed=0")
    assert sweep.finished(first, 1)
    assert not os.path.exists(os.path.join(w, "eps_high=0.2__seed=1"))
    log = os.path.join(first, "metrics.jsonl")
    before = (os.stat(log).st_mtime_ns, open(log).read())
    capsys.readouterr()

    # Run again: the finished point is skipped, the others run.
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    assert "eps_high=0.2__seed=0: finished, skipped" in out
    assert out.count(": done in ") == 3
    assert (os.stat(log).st_mtime_ns, open(log).read()) == before
    md = open(os.path.join(w, "sweep.md")).read()
    for group in ("eps_high=0.2", "eps_high=0.28"):
        row = next(line for line in md.splitlines() if line.startswith(f"| {group} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "2/2", row
        assert all(c != "-" for c in cells[2:]), row  # both metrics, over both seeds
    assert os.path.getsize(os.path.join(w, "sweep.png")) > 0

    # --report-only runs nothing; --index/--count share the points out.
    assert sweep.main(argv + ["--report-only"]) == 0
    assert "done in" not in capsys.readouterr().out
    assert sweep.main(argv + ["--index", "1", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert "eps_high=0.2__seed=1: finished, skipped" in out
    assert "eps_high=0.2__seed=0" not in out.split("|")[0]  # point 0 is machine 0's


# --------------------------------------------------------------------------
# Points checked before they run; a workdir of another config; signals; metrics.

SMOKE = "configs/default.py:smoke"
ONE_STEP = ["--config.total_rl_steps=1", "--config.sft.steps=1"]


@pytest.fixture
def no_trainer(monkeypatch):
    """The sweep with its trainers replaced by a record of the points they would run
    (and one device, without asking a process for it)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sweep.sweep_grid, "device_count", lambda: 1)
    ran = []

    def run_point(config, workdir, overrides):
        ran.append((config, os.path.basename(workdir), dict(overrides)))
        return 0, 0.0

    monkeypatch.setattr(sweep, "_run_point", run_point)
    return ran


def _finished_point(workdir, name, overrides, reward=0.5, config=SMOKE):
    """A point's workdir as its trainer leaves it when finished: config.json and the
    final RL record with its evaluation."""
    from gspo_jax import safety

    c = sweep.sweep_grid.build_config(config, overrides)
    d = os.path.join(workdir, name)
    os.makedirs(d)
    safety.save_run_config(c, d)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        rec = {"step": int(c.total_rl_steps), "phase": "rl", "eval_reward_mean": reward}
        f.write(json.dumps(rec) + "\n")


def test_a_point_of_another_config_is_not_reported_as_finished(tmp_path, no_trainer, capsys):
    w = str(tmp_path)
    argv = [f"--config={SMOKE}", f"--workdir={w}", "--grid", "seed=0", *ONE_STEP]
    overrides = {"total_rl_steps": "1", "sft.steps": "1", "seed": "0"}
    _finished_point(w, "seed=0", overrides, reward=0.25)

    # The same config: finished, skipped, reported.
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    assert "seed=0: finished, skipped" in out and "| all | 1/1 | 0.25 |" in out
    assert no_trainer == []

    # A changed override: refused before anything runs, naming the field.
    with pytest.raises(SystemExit) as e:
        sweep.main(argv + ["--config.optimizer.lr=0.002"])
    msg = str(e.value)
    assert "holds a run of another config than this sweep's point seed=0" in msg
    assert "config.optimizer.lr: 0.0002 -> 0.002" in msg
    assert "--move-aside" in msg and no_trainer == []

    # A field a resume may change, but that changes the reported numbers.
    with pytest.raises(SystemExit, match=r"config.task.eval_samples: 2 -> 4"):
        sweep.main(argv + ["--config.task.eval_samples=4"])
    # One that changes no reported number: still finished.
    assert sweep.main(argv + ["--config.keep_checkpoints=5"]) == 0
    assert "seed=0: finished, skipped" in capsys.readouterr().out

    # The report alone leaves it out, saying why.
    assert sweep.main(argv + ["--config.optimizer.lr=0.002", "--report-only"]) == 0
    out, err = capsys.readouterr()
    assert "| all | 0/1 | - |" in out and "0.25" not in out
    assert "config.optimizer.lr: 0.0002 -> 0.002" in err and "left out of the report" in err

    # --move-aside keeps the old run under another name and runs the point afresh.
    assert sweep.main(argv + ["--config.optimizer.lr=0.002", "--move-aside"]) == 0
    assert os.path.exists(os.path.join(w, "seed=0.other-1", "metrics.jsonl"))
    assert not os.path.exists(os.path.join(w, "seed=0"))
    assert [name for _, name, _ in no_trainer] == ["seed=0"]


def test_a_longer_finished_run_is_not_this_shorter_runs_result(tmp_path, no_trainer):
    w = str(tmp_path)
    _finished_point(w, "base", {"total_rl_steps": "2", "sft.steps": "1"})
    with pytest.raises(SystemExit, match=r"config.total_rl_steps: 2 -> 1"):
        sweep.main([f"--config={SMOKE}", f"--workdir={w}", *ONE_STEP])
    # A run asked for more steps resumes (its trainer accepts the longer run).
    state, _ = sweep.sweep_grid.point_state(
        os.path.join(w, "base"),
        sweep.sweep_grid.build_config(SMOKE, {"total_rl_steps": "3", "sft.steps": "1"}),
    )
    assert state == "resume"


def test_without_config_json_the_checkpoints_record_is_compared(tmp_path):
    """A point whose config.json is gone: its newest RL checkpoint's record of its config."""
    from gspo_jax import safety

    d = tmp_path / "base"
    meta = d / "checkpoints" / "rl" / "1" / "meta"
    meta.mkdir(parents=True)
    c = sweep.sweep_grid.build_config(os.path.join(REPO, SMOKE), {"seed": "3"})
    (meta / "metadata").write_text(json.dumps({"config": safety.config_record(c)}))
    other = sweep.sweep_grid.build_config(os.path.join(REPO, SMOKE), {"seed": "4"})
    assert sweep.sweep_grid.point_state(str(d), other) == ("other", ["config.seed: 3 -> 4"])
    assert sweep.sweep_grid.point_state(str(d), c) == ("resume", [])


def test_every_point_is_validated_before_any_runs(tmp_path, no_trainer):
    w = str(tmp_path)
    argv = [f"--config={SMOKE}", f"--workdir={w}", *ONE_STEP]
    with pytest.raises(SystemExit) as e:
        sweep.main(argv + ["--grid", "optimizer.lr=1e-3,inf,-1", "--grid", "seed=0,1"])
    msg = str(e.value)
    assert "4 of 6 point(s) have an invalid config; nothing was run" in msg
    assert "lr=inf__seed=0: config.optimizer.lr: must be finite" in msg
    assert "lr=-1__seed=1: config.optimizer.lr:" in msg
    assert no_trainer == []
    # A hyperparameter the objective of one point does not take.
    with pytest.raises(SystemExit, match=r"name=grpo: config.objective.hparams.eps_low_ratio"):
        sweep.main(argv + ["--grid", "objective.name=cispo,grpo"]
                   + ["--config.objective.hparams.eps_low_ratio=0.5"])
    # An objective axis needs a config file that takes objective=<name>.
    with pytest.raises(SystemExit, match=r"configs/file_task.py takes none"):
        sweep.main(["--config=configs/file_task.py", f"--workdir={w}",
                    "--grid", "objective.name=gspo,grpo"])
    assert no_trainer == []


def test_an_objective_axis_runs_each_objective_with_its_hyperparameters(tmp_path, no_trainer):
    w = str(tmp_path)
    argv = [f"--config={SMOKE}", f"--workdir={w}", *ONE_STEP]
    assert sweep.main(argv + ["--grid", "objective.name=gspo,grpo,cispo"]) == 0
    assert [name for _, name, _ in no_trainer] == ["name=gspo", "name=grpo", "name=cispo"]
    config, _, overrides = no_trainer[1]
    cmd = sweep.trainer_command(config, "wd", overrides)
    assert f"--config={SMOKE},objective=grpo" in cmd
    assert not any(a.startswith("--config.objective.name") for a in cmd)
    c = sweep.sweep_grid.build_config(config, overrides)
    assert c.objective.name == c.objective.hparams_of == "grpo"
    # The config's own argument is replaced, not repeated.
    spec, rest = sweep.sweep_grid.trainer_config(
        "configs/default.py:objective=gspo,smoke", {"objective.name": "ppo", "seed": "1"}
    )
    assert spec == "configs/default.py:smoke,objective=ppo" and rest == {"seed": "1"}


def test_an_unknown_metric_is_named(tmp_path, no_trainer, capsys):
    w = str(tmp_path)
    _finished_point(w, "base", {"total_rl_steps": "1", "sft.steps": "1"})
    argv = [f"--config={SMOKE}", f"--workdir={w}", *ONE_STEP, "--report-only"]
    assert sweep.main(argv + ["--metric", "eval_rewrad_mean"]) == 1
    err = capsys.readouterr().err
    assert "--metric eval_rewrad_mean: no point's metrics.jsonl has it; did you mean " \
        "eval_reward_mean?" in err
    assert sweep.main(argv + ["--metric", "eval_reward_mean"]) == 0


STAND_IN = """
import os, signal, sys, time
def stop(signum, frame):
    with open(os.environ["SIGNALS"], "a") as f:
        f.write(f"{signum}\\n")
    time.sleep(0.5)  # a checkpoint being written
    with open(os.environ["SIGNALS"], "a") as f:
        f.write("saved\\n")
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
with open(os.environ["PIDFILE"], "w") as f:
    f.write(str(os.getpid()))
time.sleep(60)
"""

SWEEP = """
import sys
from gspo_jax import sweep
sweep.sweep_grid.device_count = lambda: 1
sweep.trainer_command = lambda config, workdir, overrides: [sys.executable, {stand_in!r}]
sys.exit(sweep.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_to_the_sweep_reaches_its_trainer(tmp_path, signum):
    """kill, docker stop and Kubernetes signal the sweep's process alone: the trainer
    gets the signal once, the sweep waits for it, exits with 128 + signal and says how
    to resume; no trainer is left running."""
    stand_in, script = tmp_path / "trainer.py", tmp_path / "sweep.py"
    stand_in.write_text(STAND_IN)
    script.write_text(SWEEP.format(stand_in=str(stand_in)))
    env = dict(os.environ, PYTHONPATH=REPO, SIGNALS=str(tmp_path / "signals"),
               PIDFILE=str(tmp_path / "pid"))
    proc = subprocess.Popen(
        [sys.executable, str(script), f"--config={SMOKE}", f"--workdir={tmp_path / 'w'}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 60
    while not os.path.exists(tmp_path / "pid") and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    pid = int((tmp_path / "pid").read_text())
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert (tmp_path / "signals").read_text() == f"{signum}\nsaved\n"  # once, then waited for
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    name = signal.Signals(signum).name
    assert f"{name}: forwarded to the trainer of base, which exited with {128 + signum}" in err
    assert "Run the same sweep command to resume" in err


def test_fields_a_finished_point_may_differ_in_are_ones_a_resume_accepts():
    import fnmatch

    from gspo_jax import config as config_lib

    resumable = config_lib.resumable_fields()
    for pattern in sweep.sweep_grid.UNREPORTED:
        field = pattern.replace("*", "x")
        assert any(fnmatch.fnmatchcase(field, r) for r in resumable), pattern
