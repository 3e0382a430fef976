"""experiments/stability_pilot.py's bookkeeping: the shared warm start and the summary table."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from experiments import stability_pilot as stability  # noqa: E402


def _write(workdir, records):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_copy_warm_start_copies_sft_and_data_only_once(tmp_path):
    src, dst = tmp_path / "warm_start", tmp_path / "grpo"
    (src / "checkpoints" / "sft" / "300").mkdir(parents=True)
    (src / "checkpoints" / "rl" / "0").mkdir(parents=True)
    (src / "data" / "ds").mkdir(parents=True)
    _write(src, [{"phase": "sft", "step": 300}])
    stability.copy_warm_start(str(src), str(dst))
    assert (dst / "checkpoints" / "sft" / "300").is_dir()
    assert (dst / "data" / "ds").is_dir()
    assert not (dst / "checkpoints" / "rl").exists()  # RL starts fresh in every variant
    # A variant that already ran keeps its own log and checkpoints.
    _write(dst, [{"phase": "sft", "step": 300}, {"phase": "rl", "step": 5}])
    stability.copy_warm_start(str(src), str(dst))
    assert len(open(dst / "metrics.jsonl").read().splitlines()) == 2


def test_finished_and_summary(tmp_path):
    wd = tmp_path / "gspo"
    recs = [{"phase": "sft", "step": 1}, {"phase": "rl", "step": 0, "eval_reward_mean": 0.2},
            {"phase": "rl", "step": 1, "clip_frac": 0.1, "flip_frac": 0.02},
            {"phase": "rl", "step": 2, "clip_frac": 0.3, "flip_frac": 0.04,
             "eval_reward_mean": 0.5}]
    _write(wd, recs[:3])
    assert not stability.finished(str(wd), 2)
    _write(wd, recs)
    assert stability.finished(str(wd), 2)
    row = stability.summarize({"gspo": str(wd)}).splitlines()[2].split(" | ")
    assert row[:4] == ["| gspo", "0.200", "0.500", "0.500"]
    cols = stability.summarize({"gspo": str(wd)}).splitlines()[0].split(" | ")
    assert row[cols.index("mean clip_frac")] == "0.2"
    assert row[cols.index("mean replay_mismatch")] == "-"  # not logged without replay


def test_summarize_and_plot_seeds(tmp_path):
    runs = {}
    for seed, (last, flips) in {0: (0.0, 0.1), 3: (0.5, 0.3)}.items():
        wd = tmp_path / f"seed{seed}" / "grpo"
        _write(wd, [{"phase": "sft", "step": 5, "eval_reward_mean": 0.9},
                    {"phase": "rl", "step": 0, "eval_reward_mean": 0.2},
                    {"phase": "rl", "step": 1, "flip_frac": flips},
                    {"phase": "rl", "step": 2, "flip_frac": 3 * flips,
                     "eval_reward_mean": last}])
        runs[seed] = {"grpo": str(wd)}
    lines = stability.summarize_seeds(runs).splitlines()
    cols = lines[0].split(" | ")
    row = lines[2].split(" | ")
    assert cols[1:3] == ["last eval reward, seed 0", "last eval reward, seed 3"]
    assert row[1:6] == ["0.000", "0.500", "0.250", "0.000", "0.500"]
    # per-seed means 0.2 and 0.6, then their mean
    assert row[cols.index("mean flip_frac")] == "0.4"
    assert row[cols.index("mean replay_mismatch")].startswith("-")
    out = tmp_path / "seeds.png"
    stability.plot_seeds(runs, str(out))
    assert out.stat().st_size > 0


def test_parse_seeds():
    assert stability.parse_seeds("0, 1,2") == [0, 1, 2]


@pytest.mark.parametrize("bad", ["", "0,0", "a,1"])
def test_parse_seeds_rejects_bad_lists(bad):
    with pytest.raises(ValueError, match="--seeds"):
        stability.parse_seeds(bad)
