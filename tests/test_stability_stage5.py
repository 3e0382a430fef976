"""Stage 5 of the stability study (experiments/stability/): the learned-collapse detector
on hand-made curves (learn then fall, a decline from the start, noise), the probes'
rule on hand-made records, the grid's rules and report, and the stage script end to
end on its smoke setting."""

import os

import numpy as np
import pytest

from experiments.stability import common, stage5_config, stage5_learn_collapse, stage5_report, stats
from gspo_jax import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG5 = os.path.join(REPO, "experiments", "stability", "stage5_config.py")

# --------------------------------------------------------------------------
# The detector on hand-made curves: 100 RL steps, held-out evaluations every 10.

STEPS = list(range(1, 101))
EVAL_STEPS = list(range(10, 101, 10))


def read(train, evals, start=0.2, **kw):
    return stats.learned_collapse(STEPS, list(train), EVAL_STEPS, list(evals), start, **kw)


def test_learn_then_fall_is_a_learned_collapse_after_the_learning_step():
    # Training reward climbs 0.2 -> 0.5 by step 40, holds, and falls to 0.02 at step 71.
    train = np.concatenate([np.linspace(0.2, 0.5, 40), np.full(30, 0.5), np.full(30, 0.02)])
    evals = [0.22, 0.24, 0.27, 0.30, 0.31, 0.32, 0.30, 0.05, 0.02, 0.01]
    o = read(train, evals)
    # Learned at the first evaluation whose two-evaluation mean reaches 1.25 x 0.2 = 0.25:
    # (0.24 + 0.27) / 2 = 0.255 at step 30.
    assert o["outcome"] == stats.LEARNED_COLLAPSED
    assert o["learned_at"] == 30
    # The 3-step mean is below 0.3 x 0.5 = 0.15 from step 73 on (72's is (0.5 + 2 x 0.02) / 3).
    assert o["collapse_at"] == 73
    assert o["peak_eval"] == pytest.approx(0.32)


def test_a_decline_from_the_start_is_not_a_learned_collapse():
    # The stages-2-3 regime: the first rollout is the best the run ever does.
    train = np.concatenate([[0.3, 0.25, 0.2, 0.12], np.full(96, 0.01)])
    evals = [0.1, 0.05, 0.02] + [0.0] * 7
    o = read(train, evals)
    assert o["outcome"] == stats.EARLY_COLLAPSE
    assert o["learned_at"] is None
    # Stage 2's detector on the whole curve: m_t < 0.3 x 0.3 from step 6 on.
    assert o["collapse_at"] == stats.collapse_step(train) + 1 == 6


def test_noise_around_a_plateau_is_no_collapse_learned_or_not():
    rng = np.random.default_rng(0)
    train = np.clip(0.3 + 0.05 * rng.standard_normal(100), 0, 1)
    flat = read(train, 0.2 + 0.02 * rng.standard_normal(10))
    assert flat["outcome"] == stats.NEVER_LEARNED and flat["collapse_at"] is None
    learned = read(train, 0.3 + 0.02 * rng.standard_normal(10))
    assert learned["outcome"] == stats.LEARNED_HELD
    assert learned["learned_at"] == 10 and learned["collapse_at"] is None


def test_one_lucky_evaluation_is_not_learning():
    # A single evaluation at 1.3x the start between two at the start: the two-evaluation
    # mean never reaches 1.25x, so the run has not learned.
    evals = [0.2, 0.26, 0.2, 0.2, 0.21, 0.2, 0.2, 0.2, 0.2, 0.2]
    assert stats.learned_step(evals, 0.2) is None
    assert stats.learned_step([0.26, 0.25], 0.2) == 0  # the first averages over itself
    # A warm start near 0 must still gain 0.05: 1.25 x 0.01 alone would be noise.
    assert stats.learned_step([0.02, 0.03, 0.04], 0.01) is None
    assert stats.learned_step([0.02, 0.07, 0.08], 0.0) == 2


def test_a_fall_before_learning_is_counted_from_the_learned_peak_only():
    # Training reward dips early (a low stretch that would be a collapse from the
    # first-rollout peak 0.4), then learns: after learning nothing falls, so the run
    # learned and held. The early dip is not counted against it.
    train = np.concatenate([[0.4, 0.4, 0.4], np.full(10, 0.05), np.linspace(0.1, 0.5, 87)])
    evals = [0.15, 0.18, 0.22, 0.26, 0.28, 0.3, 0.31, 0.33, 0.34, 0.35]
    o = read(train, evals)
    assert o["outcome"] == stats.LEARNED_HELD
    assert o["learned_at"] == 50


def test_the_threshold_moves_only_what_counts_as_low():
    train = np.concatenate([np.linspace(0.2, 0.5, 40), np.full(30, 0.5), np.full(30, 0.2)])
    evals = [0.22, 0.24, 0.27, 0.30, 0.31, 0.32, 0.30, 0.2, 0.2, 0.2]
    assert read(train, evals)["outcome"] == stats.LEARNED_HELD  # 0.2 > 0.3 x 0.5
    assert read(train, evals, frac=0.5)["outcome"] == stats.LEARNED_COLLAPSED  # 0.2 < 0.25


def test_the_detector_names_its_bad_inputs():
    with pytest.raises(ValueError, match="unequal"):
        stats.learned_collapse([1, 2], [0.1], [], [], 0.2)
    with pytest.raises(ValueError, match="ascending"):
        stats.learned_collapse([2, 1], [0.1, 0.1], [], [], 0.2)
    with pytest.raises(ValueError, match="eval_start"):
        stats.learned_step([0.3], -0.1)
    with pytest.raises(ValueError, match="finite"):
        stats.learned_step([float("nan")], 0.2)


# --------------------------------------------------------------------------
# The probes' rule.


def probe_records(f2_moe, f2_dense, kl=2e-3):
    recs = []
    for arm, f2s in (("moe2", f2_moe), ("dense2", f2_dense)):
        for seed, f2 in enumerate(f2s):
            recs.append(dict(arm=arm, seed=seed, k=3, kl_exact=kl, f2=f2))
            recs.append(dict(arm=arm, seed=seed, k=0, kl_exact=0.0, f2=0.0))  # pi_old itself
            recs.append(dict(arm=arm, seed=seed, k=5, kl_exact=0.05, f2=0.5))  # another bin
    return recs


def test_probe_rule_supported_excluded_and_inconclusive():
    seeds = (0, 1, 2, 3)
    up = stage5_report.probe_rule(probe_records([2e-3] * 4, [1e-3] * 4), planned_seeds=seeds)
    assert up["verdict"] == "supported"
    assert up["hint_bin"]["ratio"] == pytest.approx((2.0, 2.0, 2.0))
    same = stage5_report.probe_rule(
        probe_records([1.0e-3, 1.1e-3, 0.9e-3, 1.0e-3], [1.0e-3, 0.95e-3, 1.05e-3, 1.0e-3]),
        planned_seeds=seeds,
    )
    assert same["verdict"] == "the hint's size excluded"
    mixed = stage5_report.probe_rule(
        probe_records([3e-3, 0.5e-3, 2e-3, 0.2e-3], [1e-3] * 4), planned_seeds=seeds
    )
    assert mixed["verdict"] == "inconclusive"
    few = stage5_report.probe_rule(probe_records([2e-3] * 2, [1e-3] * 2), planned_seeds=seeds)
    assert few["verdict"] == "preliminary (supported)"
    # Records of another bin never enter the hint's.
    assert stage5_report.bin_f2(probe_records([2e-3], [1e-3], kl=2e-4), "moe2", -3.0, -2.5) == {}


# --------------------------------------------------------------------------
# The grid's rules on hand-made summaries.


def summary(arm, variant, lr, seed, kind):
    if kind == "learn_fall":
        train = np.concatenate([np.linspace(0.2, 0.5, 40), np.full(30, 0.5), np.full(30, 0.02)])
        evals = [0.22, 0.24, 0.27, 0.30, 0.31, 0.32, 0.30, 0.05, 0.02, 0.01]
    elif kind == "hold":
        train = np.linspace(0.2, 0.5, 100)
        evals = [0.22, 0.26, 0.27, 0.30, 0.31, 0.32, 0.33, 0.34, 0.34, 0.35]
    else:  # early
        train = np.concatenate([[0.3, 0.25, 0.2, 0.12], np.full(96, 0.01)])
        evals = [0.1, 0.05, 0.02] + [0.0] * 7
    ev = [None] * 100
    for s, e in zip(EVAL_STEPS, evals):
        ev[s - 1] = e
    return dict(
        arm=arm,
        variant=variant,
        lr=lr,
        seed=seed,
        steps=STEPS,
        series=dict(
            reward_mean=list(train),
            eval_reward_mean=ev,
            # the per-rollout KL: 0.3 at RL step 1, then 0.1 + seed / 100; a missing step
            ppo_kl_klast=[0.3] + [0.1 + seed / 100] * 98 + [None],
            frac_ratio_gt_2_klast=[0.2] + [0.05] * 99,
        ),
        eval_start=0.2,
        eval_final=float(np.mean(evals[-2:])),
    )


def test_grid_rules_count_outcomes_and_compare_moe_with_dense(tmp_path):
    sc = sweep.load_config(CFG5)
    runs = []
    for lr in sc.lrs:
        for s in sc.seeds:
            runs.append(summary("moe2", "grpo", lr, s, "learn_fall"))
            runs.append(summary("dense2", "grpo", lr, s, "hold" if s else "early"))
            runs.append(summary("moe2", "gmpo", lr, s, "hold"))
    g = stage5_report.grid_rules(runs, sc)
    row = g["table"][("grpo", "moe2", 4.2e-4)]
    assert row["counts@0.3"][stats.LEARNED_COLLAPSED] == 4 and row["reproduces"]
    assert row["kl_step1"][0] == pytest.approx(0.3)
    assert row["kl_median"][0] == pytest.approx(0.1 + np.mean(sc.seeds) / 100)
    assert row["f2_median"][0] == pytest.approx(0.05)
    dense = g["table"][("grpo", "dense2", 4.2e-4)]["counts@0.3"]
    assert (dense[stats.LEARNED_HELD], dense[stats.EARLY_COLLAPSE]) == (3, 1)
    r2 = g["rule2"]["grpo"]
    assert r2["moe"] == (8, 8) and r2["dense"] == (0, 8) and r2["complete"]
    assert r2["p_moe_more"] == pytest.approx(stats.fisher_one_sided(0, 8, 8, 8))
    assert r2["p_moe_more"] < 0.05 and r2["p_dense_more"] == 1.0
    assert g["rule3"]["moe2"]["p"] < 0.05  # GMPO 0/8 against GRPO 8/8
    assert "dense2" not in g["rule3"]  # no GMPO runs on the dense twin
    text = "\n".join(stage5_report.grid_markdown(g, sc))
    assert "**MoE more prone**" in text and "**GMPO protects**" in text
    # A chunk with half the seeds is preliminary.
    half = [r for r in runs if r["seed"] < 2]
    assert "(preliminary)" in "\n".join(stage5_report.grid_markdown(stage5_report.grid_rules(half, sc), sc))


# --------------------------------------------------------------------------
# The config and the script.


def test_stage5_config_is_below_stage2s_critical_rate_and_valid():
    sc = stage5_config.get_config()
    assert all(lr < stage5_config.STAGE2_CRITICAL_LR for lr in sc.lrs)
    assert len(sc.seeds) >= 4 and sc.steps >= 250
    assert set(sc.probes.seeds) == set(sc.seeds) and max(sc.probes.lrs) <= 1e-4
    assert sc.probes.batch_offset >= 2  # not the rollouts of stage 1, the hint's data
    from gspo_jax import config as config_lib

    for run in stage5_learn_collapse.grid(sc):
        c = common.rl_config(run.arm, run.seed, "/tmp/unused")
        common.apply_overrides(c, run.overrides)
        config_lib.validate(c, num_devices=1)
    names = [r.name for r in stage5_learn_collapse.grid(sc)]
    assert names[0] == "moe2_grpo_lr0.00042_s0" and names[1] == "dense2_grpo_lr0.00042_s0"
    assert len(names) == len(set(names)) == 2 * 2 * 2 * 4


def test_stage5_runs_probes_and_reports_on_smoke(tmp_path, smoke_root):
    root, out = smoke_root(), tmp_path / "out"
    args = ["--root", str(root), "--out", str(out), "--config", CFG5 + ":smoke"]
    stage5_learn_collapse.main(args + ["--probes"])
    probes = common.read_records(str(out / "probes"))
    assert {r["arm"] for r in probes} == {"moe2", "dense2"}
    assert {r["batch"] for r in probes} == {2}  # after stage 1's batches 0 and 1
    stage5_learn_collapse.main(args + ["--only-variants", "grpo"])
    runs = common.read_records(str(out / "runs"))
    assert sorted(r["arm"] for r in runs) == ["dense2", "moe2"]
    assert all(r["steps"] == [1, 2, 3] and r["variant"] == "grpo" for r in runs)
    # A second invocation resumes: every run has its summary of this setting.
    sc = sweep.load_config(CFG5 + ":smoke")
    sc.variants = ("grpo",)
    assert stage5_learn_collapse.run_all(sc, str(root), str(out), common.Budget(None)) == 0
    # A summary of another setting stops the grid by name.
    path = out / "runs" / "moe2_grpo_lr0.001_s0.jsonl"
    old = common.read_jsonl(str(path))[0]
    common.write_jsonl(str(path), [dict(old, steps_meta=1, updates=99)])
    with pytest.raises(SystemExit, match="another setting"):
        stage5_learn_collapse.main(args + ["--only-variants", "grpo"])
    common.write_jsonl(str(path), [old])
    stage5_learn_collapse.main(args + ["--report"])
    text = (out / "table.md").read_text()
    assert "## The probes (rule P)" in text and "| grpo | moe2 | 0.001 | 1 |" in text
    for name in ("curves.png", "probes.png"):
        assert (out / name).exists(), name
