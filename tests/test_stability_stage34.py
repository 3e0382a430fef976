"""Stages 3 and 4 of the stability study (experiments/stability/): the Fisher exact test,
the precursors' lead times and false alarms on hand-made series, the calibration's
bisection and the stage-4 rules, the refusals of the configs, a stage-3 report with
collapsed runs, and both stages end to end on their smoke settings."""

import json
import math
import os
import re

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments.stability import (
    common,
    stage3_config,
    stage3_replay,
    stage3_report,
    stage3_rules,
    stage4_mismatch,
    stage4_report,
    stats,
)
from gspo_jax import sweep

CFG3 = os.path.join(REPO, "experiments", "stability", "stage3_config.py")
CFG4 = os.path.join(REPO, "experiments", "stability", "stage4_config.py")

# --------------------------------------------------------------------------
# The one-sided Fisher exact test.


def test_fisher_matches_hand_computed_values():
    # 0/5 vs 5/5: the arm holds none of the 5 collapses, P = C(5,0) C(5,5) / C(10,5).
    assert stats.fisher_one_sided(0, 5, 5, 5) == pytest.approx(1 / 252)
    # 0/5 vs 4/5: P(X = 0) = C(4,0) C(6,5) / C(10,5) = 6 / 252.
    assert stats.fisher_one_sided(0, 5, 4, 5) == pytest.approx(6 / 252)
    # 1/5 vs 5/5: K = 6, P(X <= 1) = [C(6,0) C(4,5) + C(6,1) C(4,4)] / 252 = 6 / 252.
    assert stats.fisher_one_sided(1, 5, 5, 5) == pytest.approx(6 / 252)
    # 1/5 vs 4/5: K = 5, P(X <= 1) = [1 + C(5,1) C(5,4)] / 252 = 26 / 252.
    assert stats.fisher_one_sided(1, 5, 4, 5) == pytest.approx(26 / 252)
    # Equal counts, or more than the reference: no evidence at all.
    assert stats.fisher_one_sided(5, 5, 5, 5) == 1.0
    assert stats.fisher_one_sided(0, 5, 0, 5) == 1.0
    assert stats.fisher_one_sided(5, 5, 0, 5) == 1.0
    # Unequal groups: 0/3 vs 3/3, P = 1 / C(6, 3).
    assert stats.fisher_one_sided(0, 3, 3, 3) == pytest.approx(1 / 20)
    with pytest.raises(ValueError, match="exceed"):
        stats.fisher_one_sided(6, 5, 0, 5)


def test_fisher_agrees_with_scipy_where_available():
    scipy_stats = pytest.importorskip("scipy.stats")
    for a in range(6):
        for b in range(6):
            want = scipy_stats.fisher_exact([[a, 5 - a], [b, 5 - b]], alternative="less")[1]
            assert stats.fisher_one_sided(a, 5, b, 5) == pytest.approx(want, rel=1e-9), (a, b)


def test_prevents_collapse_needs_fewer_collapses_and_p_below_005():
    assert stage3_rules.prevents_collapse(0, 5, 5, 5) == (pytest.approx(1 / 252), True)
    assert stage3_rules.prevents_collapse(1, 5, 4, 5)[1] is False  # p = 26/252 > 0.05
    assert stage3_rules.prevents_collapse(0, 5, 4, 5)[1] is True  # p = 6/252
    assert stage3_rules.prevents_collapse(3, 5, 3, 5)[1] is False


# --------------------------------------------------------------------------
# Precursors: thresholds, lead times, false alarms.

P = {p.key: p for p in stage3_rules.PRECURSORS}


def test_precursor_thresholds_are_the_readmes():
    assert P["frac_ratio_gt_2_klast"].rule == "above" and P["frac_ratio_gt_2_klast"].hi == 3.0
    assert P["flip_frac_klast"].hi == P["clip_frac_klast"].hi == P["grad_norm"].hi == 3.0
    assert P["ppo_kl_klast"].hi == 3.0
    # The amendment's floors: a zero baseline does not make every positive value a crossing.
    assert P["frac_ratio_gt_2_klast"].floor == P["flip_frac_klast"].floor == 0.01
    assert P["clip_frac_klast"].floor == 0.01 and P["ppo_kl_klast"].floor == 1e-3
    assert P["grad_norm"].floor is None
    assert (P["gamma_raw_mean_klast"].rule, P["gamma_raw_mean_klast"].lo) == ("below_minus", 0.1)
    assert (P["entropy"].rule, P["entropy"].lo, P["entropy"].hi) == ("outside", 0.5, 2.0)
    assert stage3_rules.BASELINE_STEPS == 10


def test_baseline_is_the_median_of_the_first_ten_steps():
    steps = list(range(1, 16))
    values = [1.0] * 5 + [3.0] * 5 + [100.0] * 5
    assert stage3_rules.baseline(steps, values) == 2.0
    assert stage3_rules.baseline(steps, [None] * 3 + values[3:]) == 3.0  # missing values left out
    assert stage3_rules.baseline([11, 12], [1.0, 2.0]) is None


def test_first_crossing_per_rule():
    steps = list(range(1, 21))
    flat = [0.1] * 10
    # above: > 3 x baseline (0.1); exactly 3x does not count.
    assert stage3_rules.first_crossing(steps, flat + [0.3, 0.31] + [0.1] * 8, P["grad_norm"]) == 12
    assert stage3_rules.first_crossing(steps, flat + [0.3] * 10, P["grad_norm"]) is None
    # below_minus: gamma below baseline - 0.1.
    g = [0.9] * 10 + [0.85, 0.79, 0.5] + [0.5] * 7
    assert stage3_rules.first_crossing(steps, g, P["gamma_raw_mean_klast"]) == 12
    # outside: entropy below 0.5x or above 2x.
    e = [1.0] * 10 + [0.6, 2.1] + [1.0] * 8
    assert stage3_rules.first_crossing(steps, e, P["entropy"]) == 12
    e = [1.0] * 10 + [0.49] + [1.0] * 9
    assert stage3_rules.first_crossing(steps, e, P["entropy"]) == 11
    # A spike inside the baseline window counts too (the first step at which it crosses).
    spike = [0.1] * 4 + [1.0] + [0.1] * 15
    assert stage3_rules.first_crossing(steps, spike, P["clip_frac_klast"]) == 5
    # The floor: from a zero baseline, 0.005 does not cross 0.01, 0.02 does.
    quiet = [0.0] * 10 + [0.005] * 3 + [0.02] * 7
    assert stage3_rules.first_crossing(steps, quiet, P["frac_ratio_gt_2_klast"]) == 14
    kl = [1e-8, -1e-8] * 5 + [5e-4] * 5 + [2e-3] * 5
    assert stage3_rules.first_crossing(steps, kl, P["ppo_kl_klast"]) == 16
    # No baseline: never crosses.
    assert stage3_rules.first_crossing(steps, [None] * 10 + [5.0] * 10, P["clip_frac_klast"]) is None


def test_lead_time_sign():
    assert stage3_rules.lead_time(30, 22) == 8
    assert stage3_rules.lead_time(30, 33) == -3
    assert stage3_rules.lead_time(None, 5) is None and stage3_rules.lead_time(30, None) is None


def _run(collapse, series, arm="grpo", seed=0, updates=16, n=30, final=0.3):
    steps = list(range(1, n + 1))
    return dict(
        arm=arm,
        seed=seed,
        updates=updates,
        lr=1e-3,
        setting="moe2/dense2",
        seeds=5,
        steps=steps,
        series={k: list(v) for k, v in series.items()},
        collapsed=collapse is not None,
        collapse_step=collapse,
        eval_start=0.2,
        eval_final=final,
    )


def test_precursor_stats_lead_times_and_false_alarms():
    base = [0.01] * 10
    runs = [
        _run(25, {"flip_frac_klast": base + [0.01] * 8 + [0.05] * 12}),  # crosses at 19: +6
        _run(20, {"flip_frac_klast": base + [0.01] * 12 + [0.05] * 8}),  # 23: -3
        _run(15, {"flip_frac_klast": base + [0.01] * 20}),  # never crosses
        _run(None, {"flip_frac_klast": base + [0.02] * 5 + [0.04] * 15}),  # false alarm at 16
        _run(None, {"flip_frac_klast": base + [0.02] * 20}),
        _run(None, {"grad_norm": [1.0] * 30}),  # no flips series: left out
    ]
    st = stage3_rules.precursor_stats(runs, P["flip_frac_klast"])
    assert sorted(st["leads"]) == [-3, 6]
    assert st["median"] == 1.5 and st["range"] == (-3, 6)
    assert (st["crossed"], st["collapsed"]) == (2, 3)
    assert (st["false_alarms"], st["not_collapsed"], st["missing"]) == (1, 2, 1)
    assert stage3_report.fmt_precursor(st) == "+1.5 [-3, +6] (2/3); FA 1/2"
    none = stage3_rules.precursor_stats(runs[2:3], P["flip_frac_klast"])
    assert none["median"] is None and stage3_report.fmt_precursor(none) == "- (0/1); FA -"


def test_setting_lr_follows_the_readme_rule():
    def r(arm, lr, collapsed, variant="grpo"):
        return dict(arm=arm, lr=lr, collapsed=collapsed, variant=variant)

    runs = (
        [r("moe2", 1e-3, c) for c in (1, 0, 0)]  # 1/3: not enough
        + [r("dense2", 1e-3, c) for c in (0, 0, 0)]
        + [r("moe2", 3e-3, c) for c in (1, 1, 0)]  # 2/3
        + [r("dense2", 3e-3, c) for c in (1, 0, 0)]  # 1/3
        + [r("moe2", 1e-2, c) for c in (1, 1, 1)]
        + [r("dense2", 1e-2, c) for c in (1, 1, 1)]
        + [r("moe2", 1e-3, 1, "gspo")] * 3  # another objective: ignored
    )
    assert stage3_rules.setting_lr(runs) == 3e-3
    assert stage3_rules.setting_lr([x for x in runs if x["lr"] != 3e-3]) is None
    # The whole grid read as it fills: the verdict agrees with setting_lr when finished.
    lrs = (1e-3, 3e-3, 1e-2)
    assert stage3_rules.setting_verdict(runs, lrs, 3, "moe2", "dense2") == (
        "found",
        3e-3,
        {1e-3: "cannot", 3e-3: "qualifies", 1e-2: "cannot"},
    )
    no_3e3 = [x for x in runs if x["lr"] != 3e-3]
    assert stage3_rules.setting_verdict(no_3e3, lrs, 3, "moe2", "dense2")[:2] == ("open", 3e-3)
    no_3e3 += [r("moe2", 3e-3, 0), r("moe2", 3e-3, 0)]  # 2 of 3 MoE seeds held: ruled out
    assert stage3_rules.setting_verdict(no_3e3, lrs, 3, "moe2", "dense2")[:2] == ("none", None)


def test_setting_status_rules_an_lr_in_or_out_only_when_the_missing_seeds_cannot_matter():
    st = stage3_rules.setting_status
    assert st([1, 1], [0, 0], 3) == "qualifies"  # 2/3 MoE at least, 1/3 dense at most
    assert st([1, 1], [0], 3) == "open"  # dense could still reach 2/3
    assert st([1], [0, 0], 3) == "open"  # MoE could still reach 2/3
    assert st([0, 0], [], 3) == "cannot"  # MoE at most 1/3
    assert st([1, 1, 1], [1, 1], 3) == "cannot"  # dense at least 2/3
    assert st([], [], 3) == "open"
    assert st([1, 1, 1, 1], [0, 0, 0, 1], 5) == "open"  # 4/5 needs dense <= 1 of 5
    assert st([1, 1, 1, 1], [0, 0, 0, 0, 1], 5) == "qualifies"
    with pytest.raises(ValueError, match="more than 3 seeds"):
        st([1, 1, 1, 1], [], 3)


# --------------------------------------------------------------------------
# Configs: their refusals and their tables.


def test_stage3_config_refuses_without_stage1s_calibration(tmp_path, monkeypatch):
    monkeypatch.setattr(stage3_config, "CALIBRATION", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="experiments.stability.stage1_probes --report"):
        stage3_config.get_config("lr=0.003")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"eps_low": None, "note": "GRPO's clip fraction is off the grid"}))
    monkeypatch.setattr(stage3_config, "CALIBRATION", str(bad))
    with pytest.raises(ValueError, match="off the grid"):
        stage3_config.get_config("lr=0.003")
    good = tmp_path / "calibration.json"
    good.write_text(json.dumps({"eps_low": 0.004, "eps_high": 0.0053}))
    monkeypatch.setattr(stage3_config, "CALIBRATION", str(good))
    c = stage3_config.get_config("lr=0.003,arm=moe4,dense_arm=dense4,updates=32")
    assert (c.arm, c.dense_arm, c.lr, c.updates, c.steps) == ("moe4", "dense4", 3e-3, 32, 80)
    assert c.seeds == (0, 1, 2, 3, 4) and c.task == "small"
    assert stage3_config.get_config("lr=0.003,task=hard").task == "hard"
    gpu = stage3_config.get_config("lr=0.003,scale=gpu")
    assert (gpu.arm, gpu.dense_arm, gpu.task, gpu.dtype) == (
        "moe12e64",
        "dense12",
        "hard",
        "bfloat16",
    )
    assert gpu.arms == ("grpo", "grpo_r3", "gspo", "rspo_g0.5", "grpo_dense") and gpu.seeds == (
        0,
        1,
        2,
    )
    assert stage3_replay.stage_name(gpu) == "stage3_gpu" and stage3_replay.stage_name(c) == "stage3"
    assert stage3_replay.overrides(gpu, "grpo")["model.dtype"] == "bfloat16"
    assert stage3_replay.overrides(c, "grpo")["model.dtype"] == "float32"
    assert common.arm_fields(gpu.arm)["num_experts"] == 64
    with pytest.raises(ValueError, match="scale='tpu'"):
        stage3_config.get_config("lr=0.003,scale=tpu")
    with pytest.raises(ValueError, match="task 'medium'"):
        stage3_config.get_config("lr=0.003,task=medium")
    assert c.arms == (
        "grpo",
        "grpo_r2",
        "grpo_r3",
        "gspo",
        "gmpo",
        "rspo_g0.5",
        "rspo_g0.1",
        "sapo",
    )
    c.lr = 3e-3
    o = {name: stage3_replay.overrides(c, name) for name in c.arms}
    assert o["gspo"]["objective"] == ("gspo", {"eps_low": 0.004, "eps_high": 0.0053})
    assert o["grpo"]["objective"] == ("grpo", {"eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0})
    assert o["grpo_r2"]["updates.routing_replay"] == "R2"
    assert o["grpo_r3"]["updates.routing_replay"] == "R3"
    assert o["rspo_g0.1"]["objective"] == ("rspo", {"gamma_min": 0.1})
    assert o["rspo_g0.5"]["objective"] == ("rspo", {"gamma_min": 0.5})
    assert o["gmpo"]["objective"] == ("gmpo", {})
    assert not any("gamma_min" in key for x in o.values() for key in x)
    assert all(x["updates.num_minibatches"] == 32 and x["optimizer.lr"] == 3e-3 for x in o.values())
    # Every arm's overrides make a config the trainer accepts.
    from gspo_jax import config as config_lib

    for name in c.arms + (stage3_config.DENSE_REFERENCE,):
        base = common.base_config(stage3_replay.model_arm(c, name), 0)
        common.apply_overrides(base, stage3_replay.overrides(c, name))
        config_lib.validate(base, 1, tokenizer_vocab_size=64)


def test_stage3_refuses_to_run_without_the_settings_lr(tmp_path, monkeypatch):
    good = tmp_path / "calibration.json"
    good.write_text(json.dumps({"eps_low": 0.004, "eps_high": 0.0053}))
    monkeypatch.setattr(stage3_config, "CALIBRATION", str(good))
    sc = stage3_config.get_config()
    assert sc.lr is None
    with pytest.raises(SystemExit, match='"Setting"'):
        stage3_replay.check_setting(sc, stage2_runs=str(tmp_path / "none"))
    s2 = tmp_path / "s2"
    s2.mkdir()
    rows = [
        dict(arm=a, variant="grpo", lr=1e-3, collapsed=c)
        for a, c in [("moe2", True)] * 3 + [("dense2", False)] * 3
    ]
    common.write_jsonl(str(s2 / "runs.jsonl"), rows)
    with pytest.raises(SystemExit, match="give lr=0.001"):
        stage3_replay.check_setting(sc, stage2_runs=str(s2))
    with pytest.raises(SystemExit, match="lr=<lr>"):
        stage3_replay.run_all(sc, str(tmp_path / "r"), str(tmp_path / "o"), common.Budget(None))
    assert not (tmp_path / "r").exists()


def test_stage4_config_and_overrides_make_valid_trainer_configs():
    from experiments.stability import stage4_config
    from gspo_jax import config as config_lib

    sc = stage4_config.get_config()
    assert sc.arms == ("grpo", "grpo_r3", "grpo_tis", "grpo_r3_tis")
    assert sc.updates == (1, 8) and sc.seeds == (0, 1, 2) and sc.steps == 40
    assert sc.targets == (0.05, 0.10)
    for arm in sc.arms:
        o = stage4_mismatch.overrides(sc, arm, 8, 0.3)
        assert o["rollout.router_noise_std"] == 0.3 and o["updates.num_minibatches"] == 8
        assert o["updates.routing_replay"] == ("R3" if "r3" in arm else "none")
        assert o["rollout_correction.mode"] == ("token_tis" if "tis" in arm else "none")
        assert o["rollout_correction.cap"] == 2.0
        c = common.base_config(sc.arm, 0)
        common.apply_overrides(c, o)
        config_lib.validate(c, 1, tokenizer_vocab_size=64)


# --------------------------------------------------------------------------
# Stage 4's calibration and rules.


def test_bisection_on_log_sigma_finds_the_target():
    calls = []

    def measure(s):  # disagreement ~ sigma / (sigma + 0.5), increasing
        calls.append(s)
        return s / (s + 0.5)

    r = stage4_mismatch.bisect_log_sigma(measure, 0.05, lo=0.005, hi=2.0, max_evals=8, tol=0.1)
    assert r["within_tol"] and abs(r["disagreement"] - 0.05) <= 0.005
    assert r["sigma"] == pytest.approx(0.05 * 0.5 / 0.95, rel=0.15)
    assert len(calls) <= 8 and len(r["points"]) == len(calls)
    # Every midpoint is the geometric mean of its bracket: the first is sqrt(lo * hi).
    assert calls[0] == pytest.approx(math.sqrt(0.005 * 2.0))
    # Out of range: the nearest end point evaluated, flagged.
    r = stage4_mismatch.bisect_log_sigma(measure, 0.9, lo=0.005, hi=2.0, max_evals=4, tol=0.1)
    assert not r["within_tol"] and len(r["points"]) == 4


def test_bootstrap_diff_and_rule_one():
    est, lo, hi = stats.bootstrap_diff_ci([0.5, 0.6, 0.55], [0.2, 0.25, 0.3])
    assert est == pytest.approx(0.3) and 0 < lo <= est <= hi
    est, lo, hi = stats.bootstrap_diff_ci([0.5, 0.1, 0.3], [0.3, 0.2, 0.4])
    assert lo < 0 < hi
    assert stats.bootstrap_diff_ci([0.4], [0.1]) == pytest.approx((0.3, 0.3, 0.3))
    assert stage4_report.r3_removes((1e-3, 8e-4, 1.2e-3), (5e-5, 4e-5, 6e-5))
    assert not stage4_report.r3_removes((1e-3, 8e-4, 1.2e-3), (2e-4, 1e-4, 3e-4))  # only 5x
    assert not stage4_report.r3_removes((1e-3, 5e-5, 1.2e-3), (9e-5, 4e-5, 1e-4))  # overlap


def test_stage4_rules_give_a_verdict_only_on_every_seed():
    def run(arm, seed, kl, final):
        return dict(
            arm=arm,
            seed=seed,
            updates=1,
            target=0.05,
            sigma=0.08,
            series={"mismatch_kl": [kl, kl]},
            eval_final=final,
        )

    full = [run("grpo", s, 1e-3 * (1 + 0.01 * s), 0.30 + 0.01 * s) for s in range(3)]
    full += [run("grpo_r3", s, 5e-5 * (1 + 0.01 * s), 0.31 + 0.01 * s) for s in range(3)]
    full += [run("grpo_tis", s, 1e-3, 0.40 + 0.01 * s) for s in range(3)]
    text = "\n".join(stage4_report.decisions(stage4_report.cells(full), 3))
    assert "GRPO / R3 = 20" in text and "≥ 10× below, intervals apart." in text
    assert re.search(r"grpo_tis − grpo = \+0\.100 \[\+0\.0\d\d, \+0\.1\d\d\] → \*\*TIS helps", text)
    assert "preliminary" not in text
    # One seed of three: the numbers, marked preliminary, and no verdict.
    one = [r for r in full if r["seed"] == 0]
    text = "\n".join(stage4_report.decisions(stage4_report.cells(one), 3))
    assert text.count("preliminary, 1 of 3 seeds") == 2 and "→" not in text
    assert "**TIS helps**" not in text and "undecided" in text


def test_stage4_runs_refuse_without_calibration(tmp_path):
    with pytest.raises(SystemExit, match="--calibrate"):
        stage4_mismatch.main(
            [
                "--root",
                str(tmp_path / "r"),
                "--out",
                str(tmp_path / "o"),
                "--config",
                CFG4 + ":smoke",
            ]
        )


# --------------------------------------------------------------------------
# A stage-3 report with collapsed runs (hand-made summaries).


def test_stage3_report_on_hand_made_runs(tmp_path):
    rng = np.random.default_rng(0)
    out = tmp_path / "out"

    def series(collapse):
        n = 30
        flips = [0.01] * n
        reward = [0.3] * n
        if collapse:
            flips = [0.01] * (collapse - 4) + [0.08] * (n - collapse + 4)
            reward = [0.3] * (collapse - 1) + [0.0] * (n - collapse + 1)
        return {
            "reward_mean": reward,
            "flip_frac_klast": flips,
            "grad_norm": list(1 + 0.1 * rng.random(n)),
            "entropy": [1.0] * n,
            "gamma_raw_mean_klast": [0.9] * n,
            "eval_reward_mean": [None] * 9 + [0.3] + [None] * 9 + [0.3] + [None] * 9 + [0.1],
        }

    for seed in range(5):
        runs = {"grpo": 15 + seed, "grpo_r3": None, "gspo": 20 if seed < 2 else None}
        for arm, cs in runs.items():
            r = _run(cs, series(cs), arm=arm, seed=seed)
            # The first rollout's KL: GRPO's 0.1 × (seed + 1), R3 half of it, GSPO's
            # 0.4 whatever the seed; F(τ=2) only for GRPO.
            kl = {"grpo": 0.1 * (seed + 1), "grpo_r3": 0.05 * (seed + 1), "gspo": 0.4}[arm]
            r["series"]["ppo_kl_klast"] = [kl] + [0.0] * 29
            if arm == "grpo":
                r["series"]["frac_ratio_gt_2_klast"] = [0.2] + [0.0] * 29
            assert stats.collapse_step(r["series"]["reward_mean"]) is None or cs is not None
            common.write_jsonl(str(out / "runs" / f"{arm}_s{seed}.jsonl"), [r])
    stage3_replay.main(["--report", "--out", str(out)])
    text = (out / "table.md").read_text()
    groups = _groups(out)
    rows = {r["arm"]: r for r in stage3_report.arm_rows(groups)}
    assert list(rows) == ["grpo", "grpo_r3", "gspo"]
    grpo, r3, gspo = rows["grpo"], rows["grpo_r3"], rows["gspo"]
    assert (grpo["collapsed"], grpo["seeds"], grpo["p"], grpo["prevents"]) == (5, 5, None, None)
    assert grpo["median_update"] == 272  # median collapse step 17 x 16 updates
    assert (r3["collapsed"], r3["seeds"], r3["against"]) == (0, 5, "grpo")
    assert r3["p"] == pytest.approx(1 / 252) and r3["prevents"] is True
    assert r3["preliminary"] is None and r3["median_update"] is None
    assert (gspo["collapsed"], gspo["seeds"]) == (2, 5)
    assert gspo["p"] == pytest.approx(21 / 252) and gspo["prevents"] is False
    assert gspo["median_update"] == 320  # collapses at step 20 x 16 updates
    # Held-out: every run's summary gives 0.3, so the interval is a point.
    for row in rows.values():
        assert row["final"] == pytest.approx((0.3, 0.3, 0.3))
    # Flips cross 3 steps before every collapse (0.08 > 3 x 0.01), never elsewhere;
    # precursors without a series have no runs to count.
    prec = stage3_report.precursor_rows(groups)
    flips = {arm: per["free flips"] for arm, per in prec.items()}
    assert flips["grpo"]["leads"] == [3] * 5 and flips["grpo"]["crossed"] == 5
    assert flips["grpo"]["not_collapsed"] == 0
    everything = flips["all arms"]
    assert everything["leads"] == [3] * 7 and everything["median"] == 3
    assert (everything["crossed"], everything["collapsed"]) == (7, 7)
    assert (everything["false_alarms"], everything["not_collapsed"]) == (0, 8)
    # Every hand-made collapse is after step 10, so the clean-baseline row is the same.
    assert flips["all arms, collapses after step 10"] == everything
    clip = prec["all arms"]["token clip fraction"]  # no run logs it: n/a
    assert clip["collapsed"] == clip["not_collapsed"] == 0 and clip["missing"] == 15
    assert stage3_report.fmt_precursor(clip) == "n/a"
    assert prec["grpo_r3"]["F(τ=2)"]["missing"] == 5  # GRPO's alone
    # The step each arm takes: medians over seeds, and the ratio to GRPO's on the same
    # seed (GSPO: 0.4 / 0.1 = 4 at seed 0 down to 0.4 / 0.5 = 0.8 at seed 4).
    steps = {r["arm"]: r for r in stage3_report.step_rows(groups)}
    assert steps["grpo"]["kl"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert steps["grpo"]["f2"] == pytest.approx([0.2] * 5)
    assert steps["grpo"]["ratio"] == pytest.approx([1] * 5)
    assert steps["grpo_r3"]["kl"] == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.25])
    assert steps["grpo_r3"]["f2"] == [] and steps["grpo_r3"]["ratio"] == pytest.approx([0.5] * 5)
    assert steps["gspo"]["kl"] == pytest.approx([0.4] * 5)
    assert steps["gspo"]["ratio"] == pytest.approx([4, 2, 4 / 3, 1, 0.8])
    # The rendering, lightly: a row per arm in each table, the rule's numbers in them.
    for arm in rows:
        assert text.count(f"| {arm} |") == 3  # the rule's, the precursors' and the step's
    assert "| 0.00397 | **yes** |" in text and "| n/a |" in text
    for name in ("reward_vs_updates.png", "precursors.png"):
        assert (out / name).stat().st_size > 0
    # An arm short of the planned seeds gets its numbers and no verdict.
    os.remove(out / "runs" / "grpo_r3_s4.jsonl")
    stage3_replay.main(["--report", "--out", str(out)])
    rows = {r["arm"]: r for r in stage3_report.arm_rows(_groups(out))}
    r3 = rows["grpo_r3"]
    assert (r3["collapsed"], r3["seeds"]) == (0, 4) and r3["p"] == pytest.approx(1 / 126)
    assert r3["preliminary"] == "preliminary (4 of 5 seeds)"
    assert rows["gspo"]["p"] == pytest.approx(21 / 252) and rows["gspo"]["preliminary"] is None
    assert "| preliminary (4 of 5 seeds) |" in (out / "table.md").read_text()
    # The dense twin: GRPO there is a reference (no verdict); GMPO there is read against
    # it, not against GRPO on the MoE.
    for seed in range(5):
        for arm, cs in (("grpo_dense", 10), ("gmpo_dense", 12 if seed == 0 else None)):
            r = _run(cs, series(cs), arm=arm, seed=seed)
            common.write_jsonl(str(out / "runs" / f"{arm}_s{seed}.jsonl"), [r])
    stage3_replay.main(["--report", "--out", str(out)])
    text = (out / "table.md").read_text()
    rows = {r["arm"]: r for r in stage3_report.arm_rows(_groups(out))}
    ref, gmpo = rows["grpo_dense"], rows["gmpo_dense"]
    assert (ref["collapsed"], ref["seeds"], ref["against"], ref["p"]) == (5, 5, "grpo", 1)
    assert ref["median_update"] == 160
    # 1 of 5 against 5 of 5: p = C(6,1) C(4,4) / C(10,5) = 6/252
    assert (gmpo["collapsed"], gmpo["against"], gmpo["prevents"]) == (1, "grpo_dense", True)
    assert gmpo["p"] == pytest.approx(6 / 252)
    assert "| (dense reference) |" in text and "(vs grpo_dense) | **yes** (on the dense twin) |" in text


def _groups(out) -> dict[str, list[dict]]:
    """A stage-3 report's runs by arm, as its tables read them."""
    return stage3_report.by_arm(common.read_records(str(out / "runs")))


# --------------------------------------------------------------------------
# End to end on the smoke settings.


def test_stage3_runs_end_to_end_on_smoke(tmp_path, smoke_root, monkeypatch):
    root, out = smoke_root(("moe2",)), tmp_path / "out"
    # The KL grid's real one-step runs at one lr of the grid: the lr is a constant of the
    # compiled step, so each lr is a program of its own. That the grid runs every lr and
    # seed is test_the_one_step_kl_grid_feeds_the_sapo_control's.
    monkeypatch.setattr(stage3_config, "KL_GRID_LRS", stage3_config.KL_GRID_LRS[-1:])
    stage3_replay.main(["--root", str(root), "--out", str(out), "--config", CFG3 + ":smoke"])
    runs = sorted(os.listdir(out / "runs"))
    assert runs == ["grpo_r3_s0.jsonl", "grpo_s0.jsonl", "rspo_g0.5_s0.jsonl"]
    summary = common.read_jsonl(str(out / "runs" / "rspo_g0.5_s0.jsonl"))[0]
    assert summary["steps"] == [1, 2] and summary["gamma_min"] == 0.5
    assert summary["objective"] == "rspo" and summary["updates"] == 2
    assert len(summary["series"]["reward_mean"]) == 2
    assert (root / "stage3" / "grpo_r3_s0" / "metrics.jsonl").exists()
    # A second invocation resumes: nothing left to run.
    sc = sweep.load_config(CFG3 + ":smoke")
    assert stage3_replay.run_all(sc, str(root), str(out), common.Budget(None)) == 0
    stage3_replay.main(["--report", "--out", str(out)])
    for name in ("reward_vs_updates.png", "precursors.png", "table.md"):
        assert (out / name).exists(), name
    assert "| grpo_r3 | 0 / 1 | 1 | no |" in (out / "table.md").read_text()
    # The one-step lr grid of a KL-matched control: one RL step per lr.
    stage3_replay.main(
        ["--root", str(root), "--out", str(out), "--config", CFG3 + ":smoke"]
        + ["--kl-grid", "sapo"]
    )
    grid = common.read_records(str(out / stage3_replay.KL_GRID))
    assert len(grid) == len(stage3_config.KL_GRID_LRS)
    assert all(r["steps"] == [1] and stage3_rules.first_step(r, stage3_rules.KL_KEY) is not None for r in grid)


def test_the_gpu_replication_runs_end_to_end_on_smoke(tmp_path):
    """scale=gpu: the MoE and its dense twin in bf16 on the hard task, runs under
    <root>/stage3_gpu, warm starts under <root>/warm/hard (smoke: a 2-layer model)."""
    root, out = tmp_path / "root", tmp_path / "out"
    stage3_replay.main(["--root", str(root), "--out", str(out), "--config", CFG3 + ":smoke,scale=gpu"])
    assert sorted(os.listdir(out / "runs")) == ["grpo_dense_s0.jsonl", "grpo_s0.jsonl"]
    moe = common.read_jsonl(str(out / "runs" / "grpo_s0.jsonl"))[0]
    dense = common.read_jsonl(str(out / "runs" / "grpo_dense_s0.jsonl"))[0]
    assert (moe["model"], dense["model"]) == ("moe2e8", "dense2")
    assert moe["dtype"] == dense["dtype"] == "bfloat16" and moe["task"] == "hard"
    assert sorted(os.listdir(root / "warm" / "hard")) == ["dense2_s0", "moe2e8_s0"]
    assert (root / "stage3_gpu" / "grpo_s0" / "metrics.jsonl").exists()
    stage3_replay.main(["--report", "--out", str(out)])
    assert "task hard, bfloat16 compute" in (out / "table.md").read_text()


def test_stage4_calibrates_runs_and_reports_on_smoke(tmp_path, smoke_root):
    root, out = smoke_root(("moe2",)), tmp_path / "out"
    cfg = CFG4 + ":smoke"
    stage4_mismatch.main(["--root", str(root), "--out", str(out), "--config", cfg, "--calibrate"])
    calib = json.loads((out / "calibration.json").read_text())
    assert [t["target"] for t in calib["targets"]] == [0.05, 0.1]
    assert all(1 <= len(t["points"]) <= 2 for t in calib["targets"])
    assert len(calib["evaluations"]) <= 4 and all(e["sigma"] > 0 for e in calib["evaluations"])
    stage4_mismatch.main(
        ["--root", str(root), "--out", str(out), "--config", cfg, "--only-arms", "grpo,grpo_r3"]
    )
    runs = sorted(os.listdir(out / "runs"))
    assert len(runs) == 4 and "grpo_r3_u2_d0.05_s0.jsonl" in runs
    s = common.read_jsonl(str(out / "runs" / "grpo_u2_d0.05_s0.jsonl"))[0]
    sigma = {t["target"]: t["sigma"] for t in calib["targets"]}[0.05]
    assert s["sigma"] == sigma and s["steps"] == [1, 2]
    # The calibration measured what the run's first step logs: same rollout, same params.
    first = [t for t in calib["evaluations"] if t["sigma"] == sigma][0]
    assert s["series"]["mismatch_route"][0] == pytest.approx(first["mismatch_route"], rel=1e-5)
    r3 = common.read_jsonl(str(out / "runs" / "grpo_r3_u2_d0.05_s0.jsonl"))[0]
    assert r3["series"]["mismatch_kl"][0] < s["series"]["mismatch_kl"][0]
    stage4_mismatch.main(["--report", "--out", str(out)])
    text = (out / "table.md").read_text()
    assert "Rule 1" in text and "| 2 | 0.05" in text
    assert (out / "mismatch.png").exists()


def test_precursor_tables_last_row_drops_collapses_inside_the_baseline_window():
    base = [0.01] * 10
    # Collapses at 5: its baseline (median of steps 1..10) is already 0.05, so it never
    # crosses; it counts among the collapsed runs only in the row with every run.
    early = _run(5, {"flip_frac_klast": [0.01] * 4 + [0.05] * 26})
    late = _run(25, {"flip_frac_klast": base + [0.01] * 8 + [0.05] * 12})  # 19: +6
    quiet = _run(None, {"flip_frac_klast": base + [0.01] * 20})
    text = stage3_report.precursor_table({"grpo": [early, late, quiet]})
    rows = {ln.split(" | ")[0]: ln.split(" | ")[2] for ln in text.splitlines()[2:]}
    assert rows["| all arms"] == "+6 [+6, +6] (1/2); FA 0/1"
    assert rows["| all arms, collapses after step 10"] == "+6 [+6, +6] (1/1); FA 0/1"


# --------------------------------------------------------------------------
# The KL-matched controls (README, Stage 3).


def _kl_run(arm, lr, seed, kl, collapse=None, variant=None):
    r = _run(collapse, {"ppo_kl_klast": [kl] + [0.0] * 29}, arm=arm, seed=seed)
    r["lr"] = lr
    if variant:
        r["variant"] = variant
    return r


def test_kl_matched_lr_interpolates_log_kl_against_log_lr():
    # GRPO's KL: medians 0.01 at 1e-4, 0.1 at 1e-3 (seeds 0.05, 0.1, 0.4), 1 at 1e-2;
    # a dense arm and another variant at the same lrs are ignored.
    grid = [_kl_run("moe2", 1e-4, 0, 0.01, variant="grpo")]
    grid += [_kl_run("moe2", 1e-3, s, k, variant="grpo") for s, k in enumerate((0.05, 0.1, 0.4))]
    grid += [_kl_run("moe2", 1e-2, 0, 1.0, variant="grpo")]
    grid += [_kl_run("dense2", 1e-3, 0, 5.0, variant="grpo")]
    grid += [_kl_run("moe2", 1e-3, 0, 5.0, variant="gspo")]
    target = [_kl_run("gmpo", 1e-3, s, k) for s, k in enumerate((0.02, 0.03, 0.5))]
    m = stage3_rules.kl_matched_lr(grid, target)
    # log-linear: KL 0.03 lies log10(3) = 0.477 of the way from 0.01 to 0.1.
    assert m["lr"] == pytest.approx(1e-4 * 10 ** math.log10(3), rel=1e-3)
    assert m["target_kl"] == pytest.approx(0.03)
    assert m["grid"] == {1e-4: 0.01, 1e-3: 0.1, 1e-2: 1.0}
    # Exactly on a grid point gives that point; the upper segment interpolates too.
    assert stage3_rules.kl_matched_lr(grid, [_kl_run("gmpo", 1e-3, 0, 0.1)])["lr"] == pytest.approx(1e-3)
    assert stage3_rules.kl_matched_lr(grid, [_kl_run("gmpo", 1e-3, 0, 0.3)])["lr"] == pytest.approx(
        1e-3 * 10 ** math.log10(3), rel=1e-3
    )
    with pytest.raises(ValueError, match="outside grpo's"):
        stage3_rules.kl_matched_lr(grid, [_kl_run("gmpo", 1e-3, 0, 3.0)])
    with pytest.raises(ValueError, match="two or more"):
        stage3_rules.kl_matched_lr(grid[:1], target)
    with pytest.raises(ValueError, match="moe2 gspo's first-rollout KL at two or more"):
        stage3_rules.kl_matched_lr(grid, target, variant="gspo")  # one GSPO point only
    falling = [_kl_run("moe2", 1e-4, 0, 0.2, variant="grpo"), grid[-1]]
    falling[1] = _kl_run("moe2", 1e-2, 0, 0.01, variant="grpo")
    with pytest.raises(ValueError, match="falls"):
        stage3_rules.kl_matched_lr(falling, target)


def test_matched_verdict_follows_the_readme_rule():
    # 0 of 5 (the arm) against 4 of 5 (the control): p = 6/252 = 0.0238 < 0.05.
    p, v = stage3_rules.matched_verdict(4, 5, 0, 5, 5)
    assert p == pytest.approx(6 / 252) and v == "**not explained by the smaller step**"
    assert stage3_rules.matched_verdict(5, 5, 0, 5, 5)[1] == "**not explained by the smaller step**"
    assert stage3_rules.matched_verdict(1, 5, 0, 5, 5)[1] == "the smaller step can explain it"
    assert stage3_rules.matched_verdict(0, 5, 0, 5, 5)[1] == "the smaller step can explain it"
    for hits in (2, 3):
        assert stage3_rules.matched_verdict(hits, 5, 0, 5, 5)[1] == "inconclusive"
    assert stage3_rules.matched_verdict(4, 4, 0, 5, 5)[1] == "preliminary (4 of 5 seeds)"


def test_the_kl_matched_control_has_its_own_report_section(tmp_path):
    out = tmp_path / "out"
    for seed in range(5):
        for arm, cs, kl in (
            ("grpo", 15, 0.3),
            ("gmpo", None, 0.2),
            ("grpo_r3", 12, 0.3),
            ("grpo_kl_matched", 14 if seed else None, 0.1),  # 4 of 5, half GMPO's step
            ("gspo_kl_matched", None if seed < 4 else 9, 0.6),  # 1 of 5, twice GRPO's step
        ):
            lr = {"grpo_kl_matched": 8e-4, "gspo_kl_matched": 4e-4}.get(arm, 1e-3)
            r = _kl_run(arm, lr, seed, kl, cs)
            r["series"]["reward_mean"] = [0.3] * 30
            common.write_jsonl(str(out / "runs" / f"{arm}_s{seed}.jsonl"), [r])
    stage3_replay.main(["--report", "--out", str(out)])
    text = (out / "table.md").read_text()
    # The rule's table and the step table do not hold the control.
    head, control = text.split("## The KL-matched controls")
    assert "kl_matched" not in head and "15 finished runs, and 10 of the" in head
    # Only GMPO prevented the collapse (R3 did not), so the control is read against it.
    assert "| grpo_kl_matched | 0.0008 | 4 / 5 | gmpo | 0 / 5 | 0.0238 |" in control
    assert "**not explained by the smaller step** | 0.5 [0.5, 0.5] |" in control
    assert "| grpo_r3 |" not in control
    # GSPO matched to GRPO is read against GRPO: 1 of 5 against 5 of 5, p = 6/252.
    assert "| gspo_kl_matched | 0.0004 | 1 / 5 | grpo | 5 / 5 | 0.0238 |" in control
    assert "**prevents the collapse at a matched step** | 2 [2, 2] |" in control
    assert (out / "kl_matched.png").stat().st_size > 0


def test_the_kl_matched_arm_runs_at_the_matched_lr(tmp_path, monkeypatch, fake_stage_runs):
    good = tmp_path / "calibration.json"
    good.write_text(json.dumps({"eps_low": 0.004, "eps_high": 0.0053}))
    monkeypatch.setattr(stage3_config, "CALIBRATION", str(good))
    sc = stage3_config.get_config("lr=0.001")
    sc.arms, sc.seeds = ("grpo_kl_matched",), (0, 1)
    s2, out = tmp_path / "s2", tmp_path / "out"
    grid = [_kl_run("moe2", lr, 0, k, variant="grpo") for lr, k in ((1e-4, 0.01), (1e-3, 0.1))]
    grid += [_kl_run("moe2", lr, 0, k, variant="gspo") for lr, k in ((1e-4, 0.02), (1e-3, 0.2))]
    common.write_jsonl(str(s2 / "runs.jsonl"), grid)
    common.write_jsonl(str(out / "runs" / "gmpo_s0.jsonl"), [_kl_run("gmpo", 1e-3, 0, 0.03)])
    with pytest.raises(SystemExit, match=r"lacks gmpo's seeds \[1\]"):
        stage3_replay.run_all(sc, str(tmp_path / "r"), str(out), common.Budget(None), stage2_runs=str(s2))
    common.write_jsonl(str(out / "runs" / "gmpo_s1.jsonl"), [_kl_run("gmpo", 1e-3, 1, 0.03)])
    log = []
    assert stage3_replay.run_all(sc, "r", str(out), common.Budget(None), log.append, str(s2)) == 2
    lr = 1e-4 * 10 ** math.log10(3)
    seen = fake_stage_runs
    assert [(c["name"], c["arm"]) for c in seen] == [
        ("grpo_kl_matched_s0", "moe2"),
        ("grpo_kl_matched_s1", "moe2"),
    ]
    assert all(c["overrides"]["optimizer.lr"] == pytest.approx(lr, rel=1e-3) for c in seen)
    assert {c["overrides"]["objective"][0] for c in seen} == {"grpo"}
    summary = common.read_jsonl(str(out / "runs" / "grpo_kl_matched_s1.jsonl"))[0]
    assert summary["lr"] == pytest.approx(lr, rel=1e-3)
    assert summary["kl_matched"]["target_kl"] == pytest.approx(0.03)
    # Resuming skips both; the summaries' lr is the matched one, not the setting's.
    assert stage3_replay.run_all(sc, "r", str(out), common.Budget(None), log.append, str(s2)) == 0
    # GSPO matched to GRPO: GSPO at its calibrated range, on GSPO's grid (KL 0.06 lies
    # log10(3) of the way from 0.02 to 0.2).
    for seed in (0, 1):
        common.write_jsonl(
            str(out / "runs" / f"grpo_s{seed}.jsonl"), [_kl_run("grpo", 1e-3, seed, 0.06)]
        )
    sc.arms, seen[:] = ("gspo_kl_matched",), []
    assert stage3_replay.run_all(sc, "r", str(out), common.Budget(None), log.append, str(s2)) == 2
    assert all(c["overrides"]["optimizer.lr"] == pytest.approx(lr, rel=1e-3) for c in seen)
    assert {c["overrides"]["objective"][0] for c in seen} == {"gspo"}
    assert stage3_replay.overrides(sc, "gspo_kl_matched")["objective"] == (
        "gspo",
        {"eps_low": 0.004, "eps_high": 0.0053},
    )


def test_a_chunk_of_seeds_records_the_planned_seed_count(tmp_path, monkeypatch):
    """A summary's ``seeds`` is what a verdict needs (the config's seeds), not how many
    seeds the chunk that wrote it ran: a chunk of ``--only-seeds 0,1`` records 5."""
    good = tmp_path / "calibration.json"
    good.write_text(json.dumps({"eps_low": 0.004, "eps_high": 0.0053}))
    monkeypatch.setattr(stage3_config, "CALIBRATION", str(good))
    ap = common.stage_parser("doc", str(tmp_path), "stage3_config.py", ("arms", "seeds"))
    args = ap.parse_args(["--config", CFG3 + ":lr=0.001", "--only-seeds", "0,1"])
    sc = common.stage_config(args, ("arms", "seeds"), known={"arms": stage3_replay.table_rows})
    assert sc.seeds == (0, 1) and sc.planned_seeds == (0, 1, 2, 3, 4)
    assert stage3_replay.setting_meta(sc)["seeds"] == 5
    # A KL-matched control needs every planned seed of the arm it matches, not the chunk's.
    out = tmp_path / "out"
    for seed in (0, 1):
        common.write_jsonl(
            str(out / "runs" / f"gmpo_s{seed}.jsonl"), [_kl_run("gmpo", 1e-3, seed, 0.1)]
        )
    with pytest.raises(SystemExit, match=r"lacks gmpo's seeds \[2, 3, 4\]"):
        stage3_replay.matched_arm_lr(sc, "grpo_kl_matched", str(out))


def test_the_one_step_kl_grid_feeds_the_sapo_control(tmp_path, monkeypatch, fake_stage_runs):
    """``--kl-grid sapo``: one RL step of SAPO at each grid lr and seed, summaries as
    stage 2's (model as ``arm``, objective as ``variant``); the SAPO control then
    interpolates on them."""
    good = tmp_path / "calibration.json"
    good.write_text(json.dumps({"eps_low": 0.004, "eps_high": 0.0053}))
    monkeypatch.setattr(stage3_config, "CALIBRATION", str(good))
    out = tmp_path / "out"
    cfg = CFG3 + ":lr=0.001"
    stage3_replay.main(
        ["--root", str(tmp_path / "r"), "--out", str(out), "--config", cfg]
        + ["--kl-grid", "sapo", "--only-seeds", "0,1"]
    )
    calls = fake_stage_runs
    grid = [(lr, seed) for seed in (0, 1) for lr in stage3_config.KL_GRID_LRS]
    assert [(c["overrides"]["optimizer.lr"], c["seed"]) for c in calls] == grid
    assert {c["steps"] for c in calls} == {1} and {c["arm"] for c in calls} == {"moe2"}
    assert {c["overrides"]["objective"][0] for c in calls} == {"sapo"}
    assert {c["stage"] for c in calls} == {"stage3_kl_grid"}
    runs = common.read_records(str(out / stage3_replay.KL_GRID))
    assert sorted((r["variant"], r["arm"], r["lr"], r["seed"]) for r in runs) == sorted(
        ("sapo", "moe2", lr, seed) for lr, seed in grid
    )
    # Resuming skips them; an objective no stage-3 arm has is refused by name.
    stage3_replay.main(
        ["--root", str(tmp_path / "r"), "--out", str(out), "--config", cfg]
        + ["--kl-grid", "sapo", "--only-seeds", "0,1"]
    )
    assert len(calls) == len(grid)
    with pytest.raises(SystemExit, match="'ppo'"):
        stage3_replay.main(["--out", str(out), "--config", cfg, "--kl-grid", "ppo"])
    # The control reads the grid (KL 0.01, 0.1, 1 at the three lrs) beside stage 2's.
    for r in runs:
        k = {1e-4: 0.01, 3e-4: 0.1, 1e-3: 1.0}[r["lr"]]
        r["series"] = {"ppo_kl_klast": [k]}
        r["steps"] = [1]
        common.write_jsonl(str(out / stage3_replay.KL_GRID / f"sapo_lr{r['lr']:g}_s{r['seed']}.jsonl"), [r])
    for seed in range(5):
        common.write_jsonl(
            str(out / "runs" / f"grpo_s{seed}.jsonl"), [_kl_run("grpo", 1e-3, seed, 0.1)]
        )
    sc = stage3_config.get_config("lr=0.001")
    m = stage3_replay.matched_arm_lr(sc, "sapo_kl_matched", str(out), str(tmp_path / "no_stage2"))
    assert m["lr"] == pytest.approx(3e-4) and m["grid"] == {1e-4: 0.01, 3e-4: 0.1, 1e-3: 1.0}
