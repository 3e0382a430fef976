"""`experiments/bench/bench_partial.py`: the decode-count rule by hand, its host
simulation, and the bench's programs (each partial step's count checked against the rule)."""

import numpy as np

from experiments.bench import bench_partial


def test_decode_steps_rule_by_hand():
    assert bench_partial.decode_steps([3, 5, 2], budget=8) == 4  # every row stops: the longest
    assert bench_partial.decode_steps([3, 9], budget=8) == 7  # one goes on: the budget
    assert bench_partial.decode_steps([], budget=8) == 0


def test_simulation_of_fixed_lengths():
    # 2 groups of 2, responses of 5 tokens, budget 3, cap 8: every group needs two steps
    # (3 + 2 tokens), so 2 steps finish 4 responses, after 2 + 1 decode steps.
    sim = bench_partial.simulate(lambda n: np.full(n, 5), groups=2, group_size=2,
                                 max_new_tokens=8, budget=3, steps=2, warmup=0)
    assert sim == dict(finished=4, decode_steps=3)
    # Past the cap (12 > 8): truncated at 8 tokens, the program runs its whole budget.
    sim = bench_partial.simulate(lambda n: np.full(n, 12), groups=1, group_size=2,
                                 max_new_tokens=8, budget=3, steps=3, warmup=0)
    assert sim == dict(finished=2, decode_steps=6)


def test_bench_runs_and_checks_every_count(capsys):
    out = bench_partial.main(["--prompts", "4", "--group-size", "4", "--max-new-tokens", "24",
                              "--stop", "40", "--budget", "8", "--warmup", "2", "--steps", "4",
                              "--layers", "1", "--repeats", "1", "--no-flagship"])
    p = out["partial"]
    assert p["decode_counts_checked"] == 6 and p["responses_finished"] > 0
    assert p["decode_steps_per_step"] <= 7
    assert out["all_at_once"]["decode_steps_per_rollout"] <= 23
    assert "partial" in capsys.readouterr().out
