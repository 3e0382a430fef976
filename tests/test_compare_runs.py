"""experiments/compare_runs.py: two runs' logs compared value by value."""

import json

from experiments import compare_runs


def _write(d, name, records):
  d.mkdir(exist_ok=True)
  with open(d / name, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def test_equal_runs_differ_in_timing_only(tmp_path, capsys):
  a, b = tmp_path / "a", tmp_path / "b"
  _write(a, "metrics.jsonl", [{"phase": "rl", "step": 1, "reward_mean": 0.5, "step_time": 1.0}])
  _write(b, "metrics.jsonl", [{"phase": "rl", "step": 1, "reward_mean": 0.5, "step_time": 2.0, "new": 1}])
  assert compare_runs.main([str(a), str(b)]) == 0
  out = compare_runs.compare(str(a), str(b))
  assert out["equal"] == 1 and not out["differ"] and out["only_b"] == ["metrics.jsonl:new"]


def test_a_differing_value_fails_and_pooled_excuses_only_update_metrics(tmp_path, capsys):
  a, b = tmp_path / "a", tmp_path / "b"
  for d, clip, reward in ((a, 0.1, 0.5), (b, 0.2, 0.5)):
    _write(d, "metrics.jsonl", [{"phase": "rl", "step": 1, "clip_frac": clip, "reward_mean": reward}])
    _write(d, "updates.jsonl", [{"phase": "rl", "step": 1, "k": 0, "clip_frac": 0.1}])
  assert compare_runs.main([str(a), str(b)]) == 1
  assert "metrics.jsonl:clip_frac first at ('rl', 1, None): 0.1 vs 0.2" in capsys.readouterr().out
  assert compare_runs.main([str(a), str(b), "--pooled"]) == 0
  _write(b, "metrics.jsonl", [{"phase": "rl", "step": 1, "clip_frac": 0.2, "reward_mean": 0.6}])
  assert compare_runs.main([str(a), str(b), "--pooled"]) == 1  # reward_mean is not an update metric
  _write(b, "updates.jsonl", [{"phase": "rl", "step": 1, "k": 0, "clip_frac": 0.3}])
  assert compare_runs.main([str(a), str(b), "--pooled"]) == 1  # a per-update record differs
