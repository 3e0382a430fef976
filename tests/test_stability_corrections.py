"""The stability study's corrections (experiments/stability/corrections.py) on hand-made
runs and on the committed summaries, and the redrawn report figures' choices (which
runs the precursor figure draws, the arm each reward panel is drawn against)."""

import pytest

from experiments.stability import corrections, stage2_report, stage3_report


def _run(rewards, arm="grpo", seed=0, collapse=None, **series):
    return dict(
        arm=arm,
        seed=seed,
        updates=16,
        steps=list(range(1, len(rewards) + 1)),
        series=dict(reward_mean=list(rewards), **series),
        collapsed=collapse is not None,
        collapse_step=collapse,
        eval_start=0.25,
        eval_final=0.1,
    )


def test_peak_at_first_step_tells_a_decline_from_a_run_that_learned():
    decline = _run([0.3, 0.25, 0.2, 0.1, 0.05, 0.0, 0.0])
    learned = _run([0.2, 0.3, 0.4, 0.5, 0.1, 0.0, 0.0])
    # One good step after the first is not a peak of the trailing 3-step mean.
    blip = _run([0.3, 0.1, 0.35, 0.05, 0.0, 0.0])
    assert corrections.peak_at_first_step(decline)
    assert not corrections.peak_at_first_step(learned)
    assert corrections.peak_at_first_step(blip)


def test_run_comparisons_ignore_wall_clock_and_find_the_first_difference():
    a = _run([0.3, 0.2, 0.1], step_time=[5.0, 4.0, 4.0], entropy=[1.0, None, 0.5])
    b = _run([0.3, 0.2, 0.1], step_time=[9.0, 1.0, 2.0], entropy=[1.0, None, 0.5])
    assert corrections.max_difference(a, b, 3) == 0.0
    assert corrections.first_difference(a, b, "reward_mean") is None
    c = _run([0.3, 0.2, 0.15], entropy=[1.0, None, 0.5])
    assert corrections.max_difference(a, c, 3) == pytest.approx(0.05)
    assert corrections.max_difference(a, c, 2) == 0.0
    assert corrections.first_difference(a, c, "reward_mean") == 3
    d = _run([0.3, 0.2, 0.1], entropy=[1.0, 0.7, 0.5])  # logged where a did not
    assert corrections.max_difference(a, d, 3) == float("inf")


def test_ratio_interval_of_seed_means():
    est, lo, hi = corrections.ratio_ci([2.0, 2.0, 2.0], [0.5, 0.5, 0.5])
    assert (est, lo, hi) == pytest.approx((4.0, 4.0, 4.0))
    est, lo, hi = corrections.ratio_ci([1.0, 2.0, 3.0], [1.0, 1.0, 1.0])
    assert est == pytest.approx(2.0) and 1.0 <= lo < 2.0 < hi <= 3.0


def test_corrections_reproduce_the_committed_numbers(tmp_path):
    text = corrections.report(str(tmp_path))
    assert (tmp_path / "corrections.md").read_text() == text
    assert "in 69 of 71" in text  # the smoothed peak at RL step 1
    assert "Inside the baseline window (steps 1..10): 19 of 28" in text
    assert "| 1 | 0.1 | 9.84 [8.58, 11.3] |" in text and "| 8 | 0.1 | 10.1 [8.01, 13] |" in text
    # Stage 3's seeds 0-2 of GRPO, GSPO and dense GRPO are stage 2's runs, exactly.
    rows = [line for line in text.splitlines() if "_lr0.001_s" in line]
    assert len(rows) == 9 and all(line.split("|")[3].strip() == "0" for line in rows)
    assert "as a fraction of the set lr: 0, 0.2, 0.4, 0.6, 0.8, 1." in text


def test_the_precursor_figure_draws_only_collapses_after_the_baseline_window(tmp_path):
    early = _run([0.3] * 4 + [0.0] * 26, collapse=5, grad_norm=[1.0] * 30)
    late = _run([0.3] * 19 + [0.0] * 11, seed=1, collapse=20, grad_norm=[1.0] * 30)
    quiet = _run([0.3] * 30, seed=2, grad_norm=[1.0] * 30)
    late_runs, n_early = stage3_report.late_collapses({"grpo": [early, late, quiet]})
    assert late_runs == {"grpo": [late]} and n_early == 1
    path = tmp_path / "p.png"
    stage3_report.fig_precursors({"grpo": [early, quiet]}, str(path))  # nothing late
    assert path.stat().st_size > 0


def test_each_reward_panel_is_drawn_against_its_architectures_grpo(tmp_path):
    groups = {a: [] for a in ("grpo", "gmpo", "grpo_dense", "gmpo_dense", "grpo_kl_matched")}
    ref = {a: stage3_report._reference(groups, a) for a in groups}
    assert ref == {
        "grpo": None,
        "gmpo": "grpo",
        "grpo_dense": "grpo",
        "gmpo_dense": "grpo_dense",
        "grpo_kl_matched": "grpo",
    }
    run = _run([0.3] * 20, eval_reward_mean=[None] * 9 + [0.2] + [None] * 9 + [0.1])
    path = tmp_path / "r.png"
    stage3_report.fig_reward_vs_updates({"grpo": [run], "gmpo": [dict(run, arm="gmpo")]}, str(path))
    assert path.stat().st_size > 0


def test_stage2_frontier_figure_from_hand_made_runs(tmp_path):
    runs = []
    for arm in ("moe2", "dense2"):
        for lr, hit in ((1e-4, False), (1e-3, True)):
            for seed in range(3):
                r = _run([0.3] * 5, arm=arm, seed=seed, collapse=2 if hit else None)
                runs.append(dict(r, variant="grpo", lr=lr, eval_final=0.1))
    fr = stage2_report.frontier(runs)
    stage2_report.figures(runs, fr, str(tmp_path))
    assert (tmp_path / "frontier.png").stat().st_size > 0
    assert (tmp_path / "curves.png").stat().st_size > 0
