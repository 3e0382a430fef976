"""The stability study's corrections (experiments/stability/corrections.py) on hand-made
runs and on the committed summaries, and the redrawn report figures' choices (which
runs the precursor figure draws, the arm each reward panel is drawn against)."""

import os

import numpy as np
import pytest

from experiments.stability import (
    corrections,
    corrections_567,
    stage2_report,
    stage3_report,
    stats,
)


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


# --------------------------------------------------------------------------
# The corrections of 2026-12-07 (stages 5, 6 and 7): experiments/stability/corrections_567.py
# on the committed records, each figure checked against the README's section.

README = os.path.join(os.path.dirname(corrections.__file__), "README.md")
SECTION = "## Corrections (2026-12-07: stages 5, 6 and 7)"


def _section() -> str:
    """The README's section of 2026-12-07, its lines joined (a figure may wrap)."""
    text = open(README).read()
    start = text.index(SECTION)
    body = text[start : text.index("\n## ", start + len(SECTION))]
    return " ".join(line.strip() for line in body.splitlines())


def _signed(x: float, spec: str = "+.3f") -> str:
    return format(x, spec).replace("-", "−")  # the README's minus sign


@pytest.fixture(scope="module")
def records():
    load = corrections.load
    return dict(
        s5=load("stage5/runs"),
        s6=load("stage6/runs"),
        c1=load("stage6_small_steps/runs"),
        s7=load("stage7/runs"),
    )


def test_false_learning_is_stats_learned_step_on_the_same_draws():
    rng = np.random.default_rng(0)
    x = rng.binomial(512, 0.2, (300, 26)) / 512
    ref = np.mean([stats.learned_step(row[1:], row[0]) is not None for row in x])
    assert corrections_567.false_learning(0.2, n=512, n_evals=25, sims=300, seed=0) == ref
    assert corrections_567.false_learning(0.2, 0.0, sims=50) == 0.0  # no noise: never


def test_holm_and_the_scientific_format():
    assert corrections_567.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert corrections_567.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert corrections_567.sci(1.5e-3) == "1.5e-3"
    assert corrections_567.sci(1.6363e-3, 3) == "1.64e-3"


def test_stage5_corrections_from_the_records(records):
    text, s5, s6 = _section(), records["s5"], records["s6"]
    p = corrections_567.s5_progress(s5)
    assert (p["below"], p["n"]) == (7, 8)
    assert f"{_signed(p['lo'])} to {_signed(p['hi'])} above" in text
    assert "7 of 8 end below" in text
    rest = [v for c, v in p["cells"].items() if c[0] == "gmpo" or c[2] == 3e-4]
    lo, hi = min(v["lo"] for v in rest), max(v["hi"] for v in rest)
    assert f"{_signed(lo)} to {_signed(hi)}, and 1 of those 24" in text
    assert sum(v["below"] for v in rest) == 1 and sum(v["n"] for v in rest) == 24
    noise = corrections_567.s5_eval_noise(s5, s6)
    assert (noise["prompts"], noise["samples"]) == (128, 4)
    assert "128 prompts × 4 samples" in text
    for lo, hi in (noise["se_independent"], noise["se_prompt"]):
        assert f"{lo:.3f}–{hi:.3f}" in text
    assert f"by {noise['copies_rms']:.3f} (root mean square), {noise['copies_sd']:.3f}" in text
    low, high = 0.10 / noise["copies_sd"], 0.10 / noise["se_independent"][0]
    assert f"+0.10 ({low:.1f}–{high:.1f}× the" in text
    fl = corrections_567.s5_false_learning(s5, noise)
    for model in ("binomial", "copies"):
        r = [v for (_, m), v in fl["rates"].items() if m == model]
        assert f"{min(r):.0%}–{max(r):.0%}".replace("%–", "–") in text
    bar = corrections_567.s5_bar(s5)
    assert bar["total"] == 0 and "no run of the 32 learned, then collapsed" in text
    grpo_high = [row[0.10][0] for c, row in bar["cells"].items() if c[0] == "grpo" and c[2] == 4.2e-4]
    assert sum(grpo_high) == 2 and "only 2 of the 8" in text
    th = corrections_567.s5_threshold(s5)
    assert th[0.3]["cell"][("grpo", "dense2", 4.2e-4)] == 2  # the rule's reading
    assert th[0.5]["cell"][("grpo", "moe2", 4.2e-4)] == 2
    assert th[0.5]["cell"][("grpo", "dense2", 4.2e-4)] == 3
    assert "(MoE 2 of 4, dense 3 of 4)" in text
    assert th[0.5]["rule2"]["grpo"][:4] == (3, 8, 4, 8) and "(3/8 against 4/8 at 0.5)" in text
    dense, moe = th[0.5]["rule3"]["dense2"], th[0.5]["rule3"]["moe2"]
    assert dense[:4] == (0, 8, 4, 8) and f"p = {dense[4]:.3f}" in text
    assert moe[:4] == (0, 8, 3, 8) and f"p = {moe[4]:.2f}" in text
    pairs = corrections_567.s5_pairs(s5)
    assert (pairs["above"], pairs["n"]) == (16, 16) and "16 of 16 pairs" in text
    assert [o[:3] for o in pairs["odd"]] == [("moe2", 4.2e-4, 0)]
    assert f"{pairs['odd'][0][3]:.4f}" in text and f"{pairs['odd'][0][4]:.4f}" in text


def test_stage6_corrections_from_the_records(records):
    text = _section()
    c1 = corrections_567.s6_c1(records["s6"], records["c1"])
    small, grid = c1["4 updates (C1)"], c1["16 updates (grid)"]
    assert stats.fmt_ci(*small["e"]).replace("-", "−") in text
    assert stats.fmt_ci(*grid["e"]).replace("-", "−") in text
    assert small["e"][1] < 0 < small["e"][2] and grid["e"][2] < 0
    kb, kd = small["kl"]["behaviour"][1], small["kl"]["decoupled_tis"][1]
    assert f"{kd:.2f} nats/token, is {small['ratio']:.1f}× the behaviour arm's {kb:.2f}" in text
    assert f"{grid['kl']['decoupled_tis'][1]:.2f} against {grid['kl']['behaviour'][1]:.2f}" in text
    assert f"{grid['ratio']:.1f}×" in text
    d = small["d"]
    assert f"D(8) {_signed(d['behaviour'][0], '.3f')} behaviour, " in text
    assert f"{_signed(d['decoupled_tis'][0], '.3f')} decoupled" in text
    k = grid["kl"]["decoupled_tis"]
    assert f"drifts {k[0]:.2f} (steps 11–20) to {k[1]:.2f} (last 10 steps)" in text
    gaps = corrections_567.s6_onset(records["s6"], records["c1"])["gaps"]
    steps, beh = gaps[("grid", "dense2", "behaviour")]
    assert steps[0] == 10 and f"{-beh[0]:.3f} below its k = 0 run at RL step 10" in text
    assert f"{-beh[1:].max():.3f}–{-beh[1:].min():.3f} below after" in text
    assert f"{-gaps[('C1', 'dense2', 'behaviour')][1][0]:.3f} at step 10 in C1" in text
    dec = gaps[("grid", "dense2", "decoupled_tis")][1]
    assert f"starts at {-dec[0]:.3f} below" in text and f"{-dec[1:].max():.2f}–{-dec[1:].min():.2f}" in text
    rows = corrections_567.s6_copies(records["s5"], records["s6"])["rows"]
    parts = [r["part"] for r in rows]
    assert f"at RL step {min(parts)}–{max(parts)}" in text and max(r["kl_rel"] for r in rows) < 5e-6
    collapsed = [r for r in rows if r["collapse6"] is not None]
    assert [r["name"] for r in collapsed] == ["moe2 s2"]
    assert (collapsed[0]["first_low"], collapsed[0]["collapse6"]) == (55, 56)
    assert collapsed[0]["out5"] == ["learned, held", "learned, held"]
    assert "from RL step 55, the detector's step 56" in text


def test_stage7_corrections_from_the_records(records):
    text, s7 = _section(), records["s7"]
    tests = corrections_567.s7_tests(s7)["tests"]
    bf16 = tests[("moe2", "bf16")]
    assert bf16["ci"][2] < 0 and all(d < 0 for d in bf16["d"])  # the rule's "hurts"
    assert all(t["ci"][1] <= 0 <= t["ci"][2] for k, t in tests.items() if k != ("moe2", "bf16"))
    assert f"p = {bf16['t']:.2f}, an exact sign test {bf16['sign']:.4g}" in text
    d = sorted(bf16["d"], key=abs)
    assert f"differences are {_signed(d[0], '.3f')} to {_signed(d[-1], '.3f')}" in text
    assert f"tests {bf16['holm']:.2f}" in text and bf16["holm"] > 0.05
    mm = corrections_567.s7_mismatch(s7)
    i8 = mm["rows"]["int8"]["last"]
    assert i8[0] > corrections_567.R3_PAPER_KL and f"is {corrections_567.sci(i8[0], 3)}" in text
    assert f"{np.mean(i8) / corrections_567.R3_PAPER_KL:.0%} of it" in text
    rows = mm["rows"]
    assert f"{rows['bf16']['share']:.2%} (bf16) and {rows['int8']['share']:.2%} (int8)" in text
    assert f"{rows['bf16_tis']['share']:.2%} with token TIS" in text
    assert rows["bf16_r3"]["share"] == rows["int8_r3"]["share"] == 0
    top = max(r["top"] for r in rows.values())
    assert f"the largest {corrections_567.sci(top)}" in text
    warm = mm["warm"][("moe2", "bf16")]
    assert f"bf16 {corrections_567.sci(warm)}, {1.5e-3 / warm:.0f}× below" in text
    warm = mm["warm"][("moe2", "int8")]
    assert f"int8 {corrections_567.sci(warm)}, {1.5e-3 / warm:.0f}×" in text
    ctl = corrections_567.s7_control(records["s5"], s7)
    assert ctl["same"] == 7 and [r["name"] for r in ctl["rows"] if r["diff"]] == ["moe2 s0"]
    assert ctl["late"] == [155, 197, 231] and "RL steps 155, 197 and 231" in text


def test_the_report_holds_the_corrections_of_stages_5_6_and_7():
    text = "\n".join(corrections_567.sections())
    assert "Learned collapses at +0.10: 0 of 32 runs." in text
    assert "7 of 8 are identical" in text
    committed = open(os.path.join(corrections.RESULTS, "corrections.md")).read()
    assert text in committed  # results/corrections.md is regenerated
