"""Stage 7 of the stability study (experiments/stability/): a train-inference mismatch
from numerics. The grid's arms and overrides, the rules on hand-made summaries, and the
measurement, the runs and the report end to end on the smoke setting."""

import os

import pytest

from experiments.stability import common, stage7_config, stage7_numerics, stage7_report, stats
from gspo_jax import config as config_lib
from gspo_jax import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG7 = os.path.join(REPO, "experiments", "stability", "stage7_config.py")


def test_the_grid_is_the_readmes_and_every_run_validates():
    sc = stage7_config.get_config()
    runs = list(stage7_numerics.grid(sc))
    assert len(runs) == len({r.name for r in runs}) == (6 + 3) * 4
    assert {r.meta["variant"] for r in runs if r.arm == "dense2"} == {"f32", "bf16", "int8"}
    for r in runs:
        c = common.rl_config(r.arm, r.seed, "/tmp/unused")
        common.apply_overrides(c, r.overrides)
        config_lib.validate(c, num_devices=1)
        precision = r.meta["precision"]
        assert (c.rollout.sampler_dtype, c.rollout.sampler_quantization) == stage7_config.PRECISIONS[precision]
        assert c.optimizer.lr == sc.lr < 5.5e-4
    tis = next(r for r in runs if r.meta["variant"] == "bf16_tis")
    assert tis.overrides["rollout_correction.mode"] == "token_tis"
    assert tis.overrides["rollout_correction.cap"] == stage7_config.TIS_CAP
    r3 = next(r for r in runs if r.meta["variant"] == "int8_r3")
    assert r3.overrides["updates.routing_replay"] == "R3"
    assert r3.overrides["rollout.sampler_quantization"] == "int8"


def _summary(arm, variant, seed, final, kl, collapsed=False):
    steps = list(range(1, 11))
    return dict(
        arm=arm,
        variant=variant,
        seed=seed,
        steps=steps,
        series=dict(
            reward_mean=[0.3] * 10,
            eval_reward_mean=[None] * 9 + [final],
            mismatch_kl=[kl] * 10,
            mismatch_route=[kl * 10] * 10,
        ),
        eval_start=0.2,
        eval_final=final,
        collapsed=collapsed,
    )


def test_rules_on_hand_made_runs():
    sc = sweep.load_config(CFG7)
    runs = []
    for s in range(4):
        runs += [
            _summary("moe2", "f32", s, 0.40 + 0.01 * s, 1e-14),
            _summary("moe2", "bf16", s, 0.30 + 0.01 * s, 1e-3, collapsed=True),
            _summary("moe2", "bf16_r3", s, 0.40 + 0.01 * s, 5e-5),
            _summary("moe2", "bf16_tis", s, 0.31 + 0.01 * s + 0.001 * (s % 2), 1e-3),
            _summary("moe2", "int8", s, 0.41 + 0.01 * s, 2e-3),
            _summary("moe2", "int8_r3", s, 0.41 + 0.01 * s, 1e-3),
            _summary("dense2", "f32", s, 0.40 + 0.01 * s, 1e-14),
            _summary("dense2", "bf16", s, 0.40 + 0.01 * s + 0.002 * (s % 2), 1e-4),
        ]
    g = stage7_report.rules(runs, sc)
    r1 = g["r1"][("moe2", "bf16")]
    assert r1["verdict"] == "hurts" and r1["ci"][0] == pytest.approx(-0.1)
    assert r1["collapsed"] == (4, 4) and r1["p_more_collapses"] == pytest.approx(1 / 70)
    assert g["r1"][("moe2", "int8")]["verdict"] == "helps"
    # +0.002 in two seeds, 0 in two: a resample of the zeros alone puts 0 in the interval.
    assert g["r1"][("dense2", "bf16")]["verdict"] == "no effect shown"
    assert g["r2"]["bf16"]["verdict"] == "R3 removes it" and g["r2"]["bf16"]["ratio"] == pytest.approx(20)
    assert g["r2"]["int8"]["verdict"] == "not shown"  # 2x only
    assert g["r3"]["bf16"]["verdict"] == "TIS helps"
    assert g["r4"]["bf16"]["verdict"] == "hurts the MoE more"
    text = "\n".join(stage7_report.grid_markdown(g))
    assert "**hurts**" in text and "(preliminary)" not in text
    few = stage7_report.rules([r for r in runs if r["seed"] < 2], sc)
    assert "(preliminary)" in "\n".join(stage7_report.grid_markdown(few))
    # One seed gives an interval of zero width: no rule calls a verdict on it.
    one = stage7_report.rules([r for r in runs if r["seed"] == 0], sc)
    verdicts = [one["r1"][k]["verdict"] for k in one["r1"]] + [
        one[r][k]["verdict"] for r in ("r2", "r3", "r4") for k in one[r]
    ]
    assert len(verdicts) == 7 and set(verdicts) == {stats.ONE_SEED}  # 3 + 2 + 1 + 1
    # ... and no verdict is not a preliminary one.
    one_text = "\n".join(stage7_report.grid_markdown(one))
    assert f"**{stats.ONE_SEED}**" in one_text and "(preliminary)" not in one_text


def test_stage7_measures_runs_and_reports_on_smoke(tmp_path, smoke_root):
    root, out = smoke_root(), tmp_path / "out"
    args = ["--root", str(root), "--out", str(out), "--config", CFG7 + ":smoke"]
    stage7_numerics.main(args + ["--measure"])
    measured = common.read_jsonl(str(out / "measure.jsonl"))
    by = {(r["arm"], r["precision"]): r for r in measured}
    assert set(by) == {("moe2", "f32"), ("moe2", "int8"), ("dense2", "f32"), ("dense2", "int8")}
    assert by[("moe2", "f32")]["mismatch_kl"] < 1e-10 < by[("moe2", "int8")]["mismatch_kl"]
    assert "mismatch_route" in by[("moe2", "int8")] and "mismatch_route" not in by[("dense2", "f32")]
    stage7_numerics.main(args + ["--measure"])  # nothing left: the file is unchanged
    assert common.read_jsonl(str(out / "measure.jsonl")) == measured
    stage7_numerics.main(args + ["--only-arms", "moe2", "--only-variants", "f32,bf16_r3"])
    runs = {r["variant"]: r for r in common.read_records(str(out / "runs"))}
    assert set(runs) == {"f32", "bf16_r3"}
    kl = [x for x in runs["bf16_r3"]["series"]["mismatch_kl"] if x is not None]
    assert kl and all(x > 1e-10 for x in kl)
    assert max(runs["f32"]["series"]["mismatch_kl"]) < 1e-10
    # Resumed: nothing left to run, each summary checked against its setting.
    sc = sweep.load_config(CFG7 + ":smoke")
    sc.arms, sc.variants = ("moe2",), ("f32", "bf16_r3")
    assert stage7_numerics.run_all(sc, str(root), str(out), common.Budget(None)) == 0
    sc.steps = 3
    with pytest.raises(SystemExit, match="another setting"):
        stage7_numerics.run_all(sc, str(root), str(out), common.Budget(None))
    stage7_numerics.main(args + ["--report"])
    text = (out / "table.md").read_text()
    assert "## The mismatch of each precision" in text and "| moe2 | bf16_r3 | 1 |" in text
    assert (out / "curves.png").exists()
