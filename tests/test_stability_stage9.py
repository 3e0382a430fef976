"""Stage 9 of the stability study (experiments/stability/): the events on hand-made
curves (a fall, a dip that recovers, noise, a KL blow-up), the pilot's rule, the
comparisons' rule and its sensitivity on hand-made runs, and the stage script end to
end on its smoke setting."""

import os

import numpy as np
import pytest

from experiments.stability import common, stage9_config, stage9_hazard, stage9_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG9 = os.path.join(REPO, "experiments", "stability", "stage9_config.py")
STEPS = list(range(1, 101))


def run(reward, kl=None, **meta):
    """A run's summary as `common.summarize_run` writes it, over RL steps 1..len."""
    n = len(reward)
    kl = np.full(n, 0.1) if kl is None else kl
    return dict(meta, steps=list(range(1, n + 1)),
                series={"reward_mean": [float(x) for x in reward], "ppo_kl_klast": [float(x) for x in kl]})


def test_a_fall_below_half_the_warm_start_is_an_event_at_its_onset():
    # 0.2 for 40 steps, then 0: the trailing 10-step mean is 0.2 * (non-zero steps) / 10,
    # below 0.5 * 0.2 once six zeros are in the window: step 46, and it stays there.
    assert stage9_report.primary_event(run(np.r_[np.full(40, 0.2), np.zeros(60)])) == (46, True)
    # At 0.75 of the warm start (0.15) three zeros suffice (step 43); window 5: 3 zeros of 5.
    fall = run(np.r_[np.full(40, 0.2), np.zeros(60)])
    assert stage9_report.primary_event(fall, frac=0.75) == (43, True)
    assert stage9_report.primary_event(fall, frac=0.5, window=5) == (43, True)


def test_a_dip_that_recovers_and_noise_are_censored_at_the_last_confirmable_onset():
    # Eight zero steps (41-48): the mean is low from step 46 to 52, 7 steps < 10.
    dip = run(np.r_[np.full(40, 0.2), np.zeros(8), np.full(52, 0.2)])
    assert stage9_report.primary_event(dip) == (91, False)
    rng = np.random.default_rng(0)
    noise = run(np.clip(0.2 + 0.05 * rng.standard_normal(100), 0, 1))
    assert stage9_report.primary_event(noise) == (91, False)
    # The same dip lasting 12 steps (41-52) is low from 46 to 56: 11 steps, an event.
    assert stage9_report.primary_event(run(np.r_[np.full(40, 0.2), np.zeros(12), np.full(48, 0.2)])) == (46, True)
    # The baseline is step 1's reward: a run that starts low has far to fall.
    assert stage9_report.primary_event(run(np.r_[0.02, np.full(99, 0.011)])) == (91, False)


def test_the_other_families_and_their_inputs():
    # KL 0.1, then 2.0 from step 30: the 10-step mean passes 0.5 with three high steps.
    kl = np.r_[np.full(29, 0.1), np.full(71, 2.0)]
    assert stage9_report.kl_event(run(np.full(100, 0.2), kl), 0.5) == (32, True)
    assert stage9_report.kl_event(run(np.full(100, 0.2)), 0.5) == (91, False)
    # Stage 2's detector: 3-step mean below 0.3 of its peak (0.2) from step 43.
    assert stage9_report.detector_event(run(np.r_[np.full(40, 0.2), np.zeros(60)]), 0.3) == (43, True)
    names = [d[0] for d in stage9_report.definitions()]
    assert names[0].endswith("(primary)") and len(names) == 9 + 2 + 3
    with pytest.raises(ValueError, match="reward_mean"):
        stage9_report.primary_event(dict(steps=STEPS, series={"reward_mean": [0.1] * 99 + [None]}))
    assert stage9_report.primary_event(run(np.zeros(3))) == (0, False)  # too short to confirm


def _pilot(lr, events, seeds=(100, 101, 102, 103)):
    fall, held = np.r_[np.full(40, 0.2), np.zeros(110)], np.full(150, 0.2)
    return [run(fall if i < events else held, arm="moe2", variant="grpo", lr=lr, seed=s) for i, s in enumerate(seeds)]


def test_the_pilots_rule():
    sc = stage9_config.get_config()
    lo, hi = sc.pilot.lrs
    assert stage9_report.pilot_choice(sc, _pilot(lo, 2)) == lo
    assert stage9_report.pilot_choice(sc, _pilot(lo, 1)) is None  # the higher rate must run
    assert stage9_report.pilot_choice(sc, _pilot(lo, 1) + _pilot(hi, 0)) == hi
    assert stage9_report.pilot_choice(sc, _pilot(lo, 2, seeds=(100, 101, 102))) is None  # a seed missing
    # The grid waits for the rate (set by the pilot, 2026-12-07).
    assert sc.lr == lo
    sc.lr = None
    with pytest.raises(SystemExit, match="config.lr is not set"):
        list(stage9_hazard.grid(sc))
    sc.lr = lo
    order = [(r.seed, r.arm, r.meta["variant"]) for r in stage9_hazard.grid(sc)]
    assert len(order) == 36 and order[:3] == [(0, "moe2", "grpo"), (0, "moe2", "gmpo"), (0, "dense2", "grpo")]
    assert {r.seed for r in stage9_hazard.grid(sc)}.isdisjoint(sc.pilot.seeds)


def _grid(lr, falls):
    """12 seeds a cell; ``falls[cell]`` of them fall, at steps 30 + 5 * seed."""
    out = []
    for (arm, variant), k in falls.items():
        for s in range(12):
            reward = np.r_[np.full(20 + 5 * s, 0.2), np.zeros(130 - 5 * s)] if s < k else np.full(150, 0.2)
            out.append(run(reward, arm=arm, variant=variant, lr=lr, seed=s))
    return out


def test_comparisons_holm_and_the_sensitivity_rule(tmp_path):
    lr = 5.5e-4
    runs = _grid(lr, {("moe2", "grpo"): 10, ("moe2", "gmpo"): 1, ("dense2", "grpo"): 9})
    rows = stage9_report.compare(runs, lr)
    gmpo, dense = rows
    assert gmpo["events"] == (10, 1) and gmpo["test"]["hr"] > 1
    assert gmpo["p_holm"] == pytest.approx(min(1.0, 2 * gmpo["test"]["p"])) and gmpo["p_holm"] < 0.05
    assert gmpo["verdict"] == "higher hazard: moe2 grpo"
    assert dense["verdict"] == "no difference shown" and dense["p_holm"] >= dense["test"]["p"]
    sens = stage9_report.sensitivity(runs, lr)
    assert stage9_report.robust(sens, 0) == "robust" and stage9_report.robust(sens, 1) == "robust"
    # The report: tables, the figure, and stage 5's committed runs read the same way.
    sc = stage9_config.get_config()
    sc.lr = lr
    common.write_jsonl(str(tmp_path / "runs" / "all.jsonl"), runs)
    stage9_report.report(str(tmp_path), sc)
    text = (tmp_path / "table.md").read_text()
    assert "higher hazard: moe2 grpo" in text and "(preliminary)" not in text
    assert "## Stage 5's runs read as a hazard (post hoc, descriptive)" in text
    for name in ("km.png", "stage5_km.png"):
        assert (tmp_path / name).exists(), name


def test_stage9_runs_pilot_grid_and_report_on_smoke(tmp_path, smoke_root):
    root, out = smoke_root(), tmp_path / "out"
    args = ["--root", str(root), "--out", str(out), "--config", CFG9 + ":smoke"]
    stage9_hazard.main(args + ["--pilot"])
    pilot = common.read_records(str(out / "pilot"))
    assert [(r["arm"], r["variant"], r["part"], r["steps"]) for r in pilot] == [("moe2", "grpo", "pilot", [1, 2, 3])]
    stage9_hazard.main(args + ["--only-arms", "dense2"])
    runs = common.read_records(str(out / "runs"))
    assert [(r["arm"], r["variant"], r["part"]) for r in runs] == [("dense2", "grpo", "grid")]
    stage9_hazard.main(args + ["--report"])
    text = (out / "table.md").read_text()
    assert "The pilot's rule picks: **lr 0.001**" in text
    # The moe2 cells have not run: neither comparison has a verdict yet.
    assert text.count("| no runs |") == 2 and "| dense2 grpo | 1 |" in text


def test_pilot_processes_on_parts_of_the_seeds_wait_for_each_other(tmp_path, monkeypatch):
    """Two processes run two pilot seeds each: neither moves to the higher rate until the
    rule has read all four runs of the lower one."""
    calls = []

    def run_rl(root, stage, name, arm, seed, overrides, steps, *, smoke=False, task="small"):
        calls.append((name, overrides["optimizer.lr"]))
        return name

    def summarize_run(workdir, meta):  # a run that holds: no event, censored at 141
        return run(np.full(meta["steps"], 0.2), **meta, eval_start=0.2, eval_final=0.2)

    monkeypatch.setattr(common, "run_rl", run_rl)
    monkeypatch.setattr(common, "summarize_run", summarize_run)
    sc = stage9_config.get_config()
    lo, hi = sc.pilot.lrs
    budget, out = common.Budget(None), str(tmp_path)
    quiet = dict(log=lambda *_: None)
    assert stage9_hazard.run_pilot(sc, "root", out, budget, (100, 101), **quiet) == 2
    assert [lr for _, lr in calls] == [lo, lo]  # the other two runs of lo are missing: wait
    assert stage9_hazard.run_pilot(sc, "root", out, budget, (102, 103), **quiet) == 4  # lo, then hi
    assert [lr for _, lr in calls[2:]] == [lo, lo, hi, hi]
    assert stage9_report.pilot_choice(sc, common.read_records(str(tmp_path / "pilot"))) is None
    assert stage9_hazard.run_pilot(sc, "root", out, budget, (100, 101), **quiet) == 2
    assert stage9_report.pilot_choice(sc, common.read_records(str(tmp_path / "pilot"))) == hi
