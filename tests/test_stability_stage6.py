"""Stage 6 of the stability study (experiments/stability/): the staleness rules R1-R4 on
hand-made summaries, the grid (its cells, order and configs), and the stage script end
to end on its smoke setting."""

import math
import os

import numpy as np
import pytest

from experiments.stability import (
    common,
    stage6_config,
    stage6_report,
    stage6_staleness,
    stats,
)
from gspo_jax import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG6 = os.path.join(REPO, "experiments", "stability", "stage6_config.py")

# --------------------------------------------------------------------------
# Hand-made summaries: one per run of the full grid, 60 RL steps, evaluations every 10.

STEPS = list(range(1, 61))
EVAL_STEPS = list(range(10, 61, 10))
NOISE = {0: 0.005, 1: -0.004, 2: 0.001}  # per seed: inside one evaluation's error


def final_of(arm, variant, k, seed):
    """The final held-out reward of a hand-made run: seed s's k = 0 at 0.40 + 0.01 s;
    on the MoE behaviour falls 0.02 per step of staleness, behaviour_r3 0.01,
    decoupled_tis holds and decoupled_tis_r3 sits 0.05 below it; on the dense twin
    both hold."""
    base = 0.40 + 0.01 * seed
    if k == 0:
        return base
    if arm == "dense2":
        return base + NOISE[seed] - (0.01 if variant == "behaviour" else 0.0) * (seed == 0)
    return (
        base
        + {
            "behaviour": -0.02 * k,
            "behaviour_r3": -0.01 * k,
            "decoupled_tis": NOISE[seed],
            "decoupled_tis_r3": NOISE[seed] - 0.05,
        }[variant]
    )


def summary(meta, final, *, fall=False):
    """A summary of ``meta`` (`stage6_staleness.grid`'s) ending at held-out ``final``;
    ``fall``: the held-out reward reaches 0.32 by step 30 and the training reward climbs
    to 0.5, holds, then falls to 0.02 at step 41 (a learned collapse)."""
    if fall:
        train = np.concatenate([np.linspace(0.2, 0.5, 20), np.full(20, 0.5), np.full(20, 0.02)])
        evals = [0.26, 0.30, 0.32, 0.32, final, final]
    else:
        train = np.full(60, 0.3)
        evals = [0.2, 0.2, 0.2, 0.2, final, final]
    ev = [None] * 60
    for s, e in zip(EVAL_STEPS, evals):
        ev[s - 1] = e
    k = meta["staleness"]
    return dict(
        meta,
        steps=STEPS,
        series=dict(
            reward_mean=list(train),
            eval_reward_mean=ev,
            behaviour_kl=[1e-3 * k + 1e-13] * 60,
            staleness_mean=[float(min(t - 1, k)) for t in STEPS],
        ),
        collapsed=stats.collapse_step(train) is not None,
        collapse_step=None,
        eval_start=0.2,
        eval_final=float(np.mean(evals[-2:])),
    )


def hand_made(sc, seeds=None, fall=()):
    return [
        summary(
            run.meta,
            final_of(run.arm, run.meta["variant"], run.meta["staleness"], run.seed),
            fall=run.name in fall,
        )
        for run in stage6_staleness.grid(sc)
        if seeds is None or run.seed in seeds
    ]


def test_rules_on_hand_made_summaries():
    sc = sweep.load_config(CFG6)
    runs = hand_made(sc, fall={"moe2_behaviour_k8_s0"})
    g = stage6_report.rules(runs, sc)
    assert g["staleness"] == 8
    # D(k) of the MoE's behaviour arm: -0.02 k in every seed, against the k = 0 run of
    # decoupled_tis (the same policy at k = 0).
    d = g["d"][("moe2", "behaviour")]
    for k in (1, 2, 4, 8):
        assert d[k]["d"] == pytest.approx((-0.02 * k,) * 3) and d[k]["n"] == 3
    # R1: behaviour degrades, decoupled_tis holds, on the MoE; both hold on the dense twin.
    r1 = g["r1"]
    assert r1[("moe2", "behaviour")]["verdict"] == "degrades"
    assert r1[("moe2", "decoupled_tis")]["verdict"] == "holds"
    assert r1[("moe2", "decoupled_tis")]["d"][0] == pytest.approx(np.mean(list(NOISE.values())))
    assert r1[("dense2", "behaviour")]["verdict"] == "holds"
    assert ("dense2", "behaviour_r3") not in r1
    # R2: AReaL's result on the MoE; on the dense twin the naive loss does not degrade.
    assert g["r2"]["moe2"]["verdict"] == "the decoupled loss holds where the naive one degrades"
    e = g["r2"]["moe2"]["e"]
    assert e[0] == pytest.approx(0.16 + np.mean(list(NOISE.values()))) and e[1] > 0
    assert g["r2"]["dense2"]["verdict"] == "not shown"
    # R3: the MoE's behaviour arm loses 0.16 where the dense twin's loses ~0.
    assert g["r3"]["behaviour"]["verdict"] == "the MoE is more sensitive to staleness"
    assert g["r3"]["behaviour"]["delta"][2] < 0
    assert g["r3"]["decoupled_tis"]["verdict"] == "no difference shown"
    assert set(g["r3"]) == {"behaviour", "decoupled_tis"}
    # R4: R3 halves behaviour's fall (helps) and costs decoupled_tis 0.05 (hurts).
    assert g["r4"]["behaviour"]["g"] == pytest.approx((0.08,) * 3)
    assert g["r4"]["behaviour"]["verdict"] == "R3 helps"
    assert g["r4"]["decoupled_tis"]["verdict"] == "R3 hurts"
    # Collapse: counted per cell, by stage 2's detector and by stage 5's outcome.
    cells = stage6_report.cell_table(runs, sc)
    row = cells[("moe2", "behaviour", 8)]
    assert row["collapsed"] == 1 and row["outcomes"][stats.LEARNED_COLLAPSED] == 1
    assert cells[("moe2", "behaviour", 4)]["collapsed"] == 0
    assert ("moe2", "behaviour", 0) not in cells  # k = 0 runs only the decoupled arms
    assert cells[("dense2", "decoupled_tis", 2)]["behaviour_kl"] == pytest.approx(2e-3)
    assert math.isnan(cells[("dense2", "decoupled_tis", 2)].get("mismatch_route", math.nan))
    text = "\n".join(stage6_report.markdown(cells, g, sc))
    assert "**the decoupled loss holds where the naive one degrades**" in text
    assert "**R3 helps**" in text and "(preliminary)" not in text


def test_r1_reads_the_interval_and_the_margin():
    assert stage6_report.r1_verdict((-0.05, -0.08, -0.01), 3) == "degrades"
    assert stage6_report.r1_verdict((-0.01, -0.03, 0.02), 3) == "holds"
    # The interval contains 0 but the mean is below -0.02: not resolved.
    assert stage6_report.r1_verdict((-0.03, -0.10, 0.02), 3) == "not resolved"
    # The interval above 0 (staleness helped): neither degrades nor contains 0.
    assert stage6_report.r1_verdict((0.05, 0.02, 0.08), 3) == "not resolved"
    assert stage6_report.r1_verdict(None, 0) == "no runs"
    # One seed: its bootstrap interval has zero width, below 0 or not; no verdict.
    assert stage6_report.r1_verdict((-0.05, -0.05, -0.05), 1) == stats.ONE_SEED


def test_one_seed_gives_no_verdict_in_any_rule():
    sc = sweep.load_config(CFG6)
    g = stage6_report.rules(hand_made(sc, seeds=(0,)), sc)
    verdicts = [r["verdict"] for rule in ("r1", "r2", "r3", "r4") for r in g[rule].values()]
    assert verdicts and set(verdicts) == {stats.ONE_SEED}
    # Two seeds of the same hand-made curves are enough for the rules to read them.
    g = stage6_report.rules(hand_made(sc, seeds=(0, 1)), sc)
    assert g["r1"][("moe2", "behaviour")]["verdict"] == "degrades (preliminary)"


def test_fewer_seeds_than_planned_are_preliminary():
    sc = sweep.load_config(CFG6)
    runs = hand_made(sc, seeds=(0, 1))
    g = stage6_report.rules(runs, sc)
    assert g["r1"][("moe2", "behaviour")]["verdict"] == "degrades (preliminary)"
    assert g["r2"]["moe2"]["verdict"].endswith("(preliminary)")
    assert g["r4"]["behaviour"]["verdict"] == "R3 helps (preliminary)"
    # A missing k = 8 run of one seed leaves that seed out of the pairing.
    partial = [r for r in hand_made(sc) if r["seed"] != 2 or r["staleness"] != 8]
    g = stage6_report.rules(partial, sc)
    assert g["r1"][("moe2", "behaviour")]["n"] == 2
    assert g["r1"][("moe2", "behaviour")]["verdict"].endswith("(preliminary)")
    assert g["d"][("moe2", "behaviour")][4]["n"] == 3


# --------------------------------------------------------------------------
# The grid.


def test_the_grid_cells_order_and_configs():
    sc = stage6_config.get_config()
    assert sc.lr < stage6_config.STAGE2_CRITICAL_LR and sc.rule_staleness == max(sc.stalenesses)
    runs = list(stage6_staleness.grid(sc))
    names = [r.name for r in runs]
    assert len(names) == len(set(names)) == 27 * 3 == 81
    assert sum(r.arm == "moe2" for r in runs) == 18 * 3
    assert sum(r.arm == "dense2" for r in runs) == 9 * 3
    assert all(r.meta["trust_region"] == "decoupled" for r in runs if r.meta["staleness"] == 0)
    assert {r.meta["variant"] for r in runs if r.meta["staleness"] == 0} == {
        "decoupled_tis",
        "decoupled_tis_r3",
    }
    assert all(r.meta["replay"] == "none" for r in runs if r.arm == "dense2")
    # k = 0 and k = 8 first, then 4, 2, 1; within a k seed by seed, moe2 before dense2.
    ks = [r.meta["staleness"] for r in runs]
    assert [k for i, k in enumerate(ks) if i == 0 or ks[i - 1] != k] == [0, 8, 4, 2, 1]
    assert names[:3] == [
        "moe2_decoupled_tis_k0_s0",
        "moe2_decoupled_tis_r3_k0_s0",
        "dense2_decoupled_tis_k0_s0",
    ]
    assert names[9] == "moe2_behaviour_k8_s0"
    # The overrides: token TIS truncated at 2 through rollout_correction.cap (c_high is
    # the mask modes' bound), no weight under the behaviour trust region.
    by = {r.name: r for r in runs}
    tis = by["moe2_decoupled_tis_r3_k4_s1"].overrides
    assert tis["rollout_correction.cap"] == 2.0 and tis["rollout_correction.mode"] == "token_tis"
    assert tis["rollout.staleness"] == 4 and tis["updates.routing_replay"] == "R3"
    beh = by["dense2_behaviour_k1_s2"].overrides
    assert beh["updates.trust_region"] == "behaviour" and "rollout_correction.cap" not in beh
    assert beh["objective"] == ("grpo", {"eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0})
    from gspo_jax import config as config_lib

    for run in runs:
        c = common.rl_config(run.arm, run.seed, "/tmp/unused")
        common.apply_overrides(c, run.overrides)
        config_lib.validate(c, num_devices=1)
        assert c.rollout_correction.cap == 2.0 and c.optimizer.lr == 3e-4
    # The validation is not vacuous: a weight under the behaviour trust region is refused.
    c = common.rl_config("moe2", 0, "/tmp/unused")
    common.apply_overrides(
        c, dict(by["moe2_behaviour_k8_s0"].overrides, **{"rollout_correction.mode": "token_tis"})
    )
    with pytest.raises(config_lib.ConfigError, match="rollout_correction.mode"):
        config_lib.validate(c, num_devices=1)
    # Each arm's k = 0 point: the decoupled arm with its replay.
    assert stage6_report.k0_variant(sc, "behaviour") == "decoupled_tis"
    assert stage6_report.k0_variant(sc, "behaviour_r3") == "decoupled_tis_r3"


def test_the_small_steps_control_is_its_own_grid():
    """Control C1: the dense twin's two arms at k = 0 and 8 with 4 updates per rollout,
    in a folder of its own (its run names equal the grid's)."""
    sc = stage6_config.get_config("small_steps")
    main = stage6_config.get_config()
    runs = list(stage6_staleness.grid(sc))
    assert [r.name for r in runs] == [
        f"dense2_{v}_k{k}_s{s}"
        for k, s, v in [(0, s, "decoupled_tis") for s in (0, 1, 2)]
        + [(8, s, v) for s in (0, 1, 2) for v in ("behaviour", "decoupled_tis")]
    ]
    assert all(r.overrides["updates.num_minibatches"] == 4 for r in runs)
    assert all(r.meta["updates"] == 4 for r in runs)
    assert (sc.lr, sc.steps, sc.seeds) == (main.lr, main.steps, main.seeds)
    assert sc.name != main.name
    assert stage6_staleness.out_dir(sc) != stage6_staleness.out_dir(main)


def test_c1_rule_reads_precondition_r1_and_the_kl_bound():
    sc = stage6_config.get_config("small_steps")
    runs = hand_made(sc)  # dense2: decoupled_tis holds at k = 8, behaviour_kl 0.008

    def verdict(rs):
        return stage6_report.c1_verdict(rs, sc, stage6_report.rules(rs, sc))["verdict"]

    assert verdict(runs) == "the hypothesis is supported"

    def edit(fn):
        return [fn(dict(r, series=dict(r["series"]))) for r in runs]

    def far(r):  # the decoupled arm 0.5 nats from its sampler at k = 8
        if r["variant"] == "decoupled_tis" and r["staleness"] == 8:
            r["series"]["behaviour_kl"] = [0.5] * 60
        return r

    assert verdict(edit(far)) == "not resolved"

    def worse(r):  # the decoupled arm 0.1 below its k = 0 run at k = 8
        if r["variant"] == "decoupled_tis" and r["staleness"] == 8:
            r["eval_final"] -= 0.1
        return r

    assert verdict(edit(worse)) == "the hypothesis is refuted"
    # k = 0 ends 0.04 above its warm start: the control says nothing.
    flat = edit(lambda r: dict(r, eval_start=r["eval_final"] - 0.04) if r["staleness"] == 0 else r)
    assert verdict(flat) == "says nothing (the k = 0 runs did not learn)"
    assert verdict([r for r in runs if r["seed"] == 0]) == stats.ONE_SEED
    assert (
        verdict([r for r in runs if r["seed"] < 2]) == "the hypothesis is supported (preliminary)"
    )
    assert verdict([]) == "no runs"


def test_movement_table_reads_windows_and_counts_the_last_ten_from_the_end():
    sc = stage6_config.get_config()
    run = next(r for r in stage6_staleness.grid(sc) if r.name == "dense2_decoupled_tis_k8_s0")
    rec = summary(run.meta, 0.3)
    kl = [0.0] * 10 + [0.5] * 10 + [1.0] * 30 + [2.0] * 10
    rec["series"].update(
        behaviour_kl=kl,
        ppo_kl_klast=[0.1] * 60,
        clip_frac=[0.03] * 59 + [None],
        rc_truncated_frac=[0.02] * 60,
        rc_weight_mean=[0.9] * 60,
    )
    other = dict(rec, seed=1, series=dict(rec["series"], ppo_kl_klast=[0.3] * 60))
    row = stage6_report.movement_table([rec, other], sc)[("dense2", "decoupled_tis", 8)]
    assert row["behaviour_kl, steps 11-20"] == pytest.approx(0.5)
    assert row["behaviour_kl, last 10"] == pytest.approx(2.0)
    assert row["ppo_kl_klast"] == pytest.approx(0.2)  # the seed mean of 0.1 and 0.3
    assert row["clip_frac"] == pytest.approx(0.03)  # a step that did not log is left out
    assert row["rc_weight_mean"] == pytest.approx(0.9)
    # A series no run logged (the behaviour arm's weight) is nan, printed "n/a".
    beh = summary(
        next(r for r in stage6_staleness.grid(sc) if r.name == "dense2_behaviour_k8_s0").meta, 0.3
    )
    assert math.isnan(
        stage6_report.movement_table([beh], sc)[("dense2", "behaviour", 8)]["rc_weight_mean"]
    )


# --------------------------------------------------------------------------
# The script end to end.


def test_stage6_runs_resumes_and_reports_on_smoke(tmp_path, capsys, smoke_root):
    root, out = smoke_root(("moe2",)), tmp_path / "out"
    args = [
        "--root",
        str(root),
        "--out",
        str(out),
        "--config",
        CFG6 + ":smoke",
        "--only-arms",
        "moe2",
    ]
    stage6_staleness.main(args)
    runs = common.read_records(str(out / "runs"))
    assert sorted(r["variant"] + str(r["staleness"]) for r in runs) == [
        "behaviour2",
        "behaviour_r32",
        "decoupled_tis0",
        "decoupled_tis2",
        "decoupled_tis_r30",
        "decoupled_tis_r32",
    ]
    for r in runs:
        assert r["steps"] == [1, 2, 3] and r["arm"] == "moe2"
        assert "behaviour_kl" in r["series"] and "staleness_mean" in r["series"]
        stale = r["series"]["staleness_mean"]
        assert (max(stale) > 0) == (r["staleness"] == 2), (r["variant"], stale)
    capsys.readouterr()
    stage6_staleness.main(args)  # resumes to nothing
    assert "stage 6: 0 runs finished" in capsys.readouterr().out
    # A summary of another setting stops the grid by name.
    path = out / "runs" / "moe2_behaviour_k2_s0.jsonl"
    old = common.read_jsonl(str(path))[0]
    common.write_jsonl(str(path), [dict(old, updates=99)])
    with pytest.raises(SystemExit, match="another setting"):
        stage6_staleness.main(args)
    common.write_jsonl(str(path), [old])
    # --resummarize adds a series a summary lacks from the run's logs, and refuses a
    # summary whose numbers its logs do not give.
    path = out / "runs" / "moe2_decoupled_tis_k2_s0.jsonl"
    full = common.read_jsonl(str(path))[0]
    assert "rc_weight_mean" in full["series"]
    series = {k: v for k, v in full["series"].items() if k != "rc_weight_mean"}
    common.write_jsonl(str(path), [dict(full, series=series)])
    stage6_staleness.main(args + ["--resummarize"])
    assert "stage 6: 1 summaries rewritten" in capsys.readouterr().out
    assert common.read_jsonl(str(path))[0] == full
    common.write_jsonl(str(path), [dict(full, eval_final=0.999)])
    with pytest.raises(SystemExit, match="'eval_final' differs"):
        stage6_staleness.main(args + ["--resummarize"])
    common.write_jsonl(str(path), [full])
    stage6_staleness.main(args + ["--report"])
    text = (out / "table.md").read_text()
    assert "## R1: does the held-out reward degrade at k = 2?" in text
    assert "| moe2 | behaviour | 2 | 1 |" in text and "- moe2, behaviour: D(2) =" in text
    assert "## What the trust regions let the policy do" in text
    assert "| moe2 | decoupled_tis | 2 | " in text.split("## What the trust regions")[1]
    for name in ("reward_vs_k.png", "kl_vs_k.png"):
        assert (out / name).exists(), name
