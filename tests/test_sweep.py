"""gspo_jax.sweep: the grid, point names, the report, and a sweep interrupted
between points that skips its finished point when run again."""

import json
import os

import pytest

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
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
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
