"""The stability study's instruments (experiments/stability/): the collapse detector
and the intervals on hand-made curves, the dense twin's width, stage 1's drift
metrics against a NumPy reference, and stages 1 and 2 end to end on their smoke
settings."""

import json
import math
import os

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments.stability import common, stats
from gspo_jax import passes, sweep

# --------------------------------------------------------------------------
# The collapse detector.


def test_moving_average_is_trailing():
    np.testing.assert_allclose(stats.moving_average([3, 6, 9, 0], 2), [3, 4.5, 7.5, 4.5])
    np.testing.assert_allclose(stats.moving_average([1, 2, 3], 5), [1, 1.5, 2])


def test_a_rising_curve_never_collapses():
    assert stats.collapse_step(np.linspace(0.2, 0.6, 60)) is None


def test_a_sustained_drop_collapses_where_it_begins():
    curve = [0.2, 0.3, 0.4, 0.5, 0.5, 0.5] + [0.0] * 10
    # Trailing 3-step means: ..., 0.5, 0.333, 0.167, 0.0, ...; peak 0.5, threshold 0.15.
    # m first drops below 0.15 at index 8 (the third zero) and stays there.
    assert stats.collapse_step(curve) == 8


def test_a_dip_that_recovers_within_patience_is_not_a_collapse():
    curve = [0.5] * 5 + [0.0] * 6 + [0.5] * 10
    # m < 0.15 at indices 7..10 only: four steps, patience is five.
    assert stats.collapse_step(curve) is None
    assert stats.collapse_step(curve, patience=4) == 7


def test_a_streak_cut_off_by_the_end_of_the_run_is_not_a_collapse():
    assert stats.collapse_step([0.5] * 5 + [0.0] * 6) is None
    assert stats.collapse_step([0.5] * 5 + [0.0] * 7) == 7


def test_a_run_that_never_learned_has_nothing_to_collapse_from():
    curve = [0.08, 0.09, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert stats.collapse_step(curve) is None
    assert stats.collapse_step(curve, min_peak=0.05) is not None


def test_collapse_detector_refuses_bad_input():
    with pytest.raises(ValueError, match="finite"):
        stats.collapse_step([0.1, float("nan")])
    with pytest.raises(ValueError, match="frac"):
        stats.collapse_step([0.1], frac=1.5)


# --------------------------------------------------------------------------
# Intervals and the critical learning rate.


def test_bootstrap_ci_brackets_the_mean_and_is_reproducible():
    x = [0.1, 0.4, 0.35, 0.2, 0.5, 0.3]
    est, lo, hi = stats.bootstrap_ci(x)
    assert est == pytest.approx(np.mean(x))
    assert min(x) <= lo < est < hi <= max(x)
    assert stats.bootstrap_ci(x) == (est, lo, hi)
    assert stats.bootstrap_ci([0.3, 0.3, 0.3]) == (0.3, 0.3, 0.3)
    assert stats.bootstrap_ci([0.7]) == (0.7, 0.7, 0.7)


def test_bootstrap_ci_covers_the_true_mean_about_as_often_as_it_says():
    rng = np.random.default_rng(1)
    hits = 0
    for i in range(200):
        x = rng.normal(1.0, 1.0, size=30)
        _, lo, hi = stats.bootstrap_ci(x, n_boot=400, seed=i)
        hits += lo <= 1.0 <= hi
    assert 0.88 <= hits / 200 <= 0.99


def test_critical_lr_interpolates_in_log_lr():
    lrs = [1e-4, 1e-3, 1e-2]
    assert stats.critical_lr(lrs, [0, 0, 1]) == pytest.approx(math.sqrt(1e-3 * 1e-2))
    assert stats.critical_lr(lrs, [0, 0.25, 0.75]) == pytest.approx(math.sqrt(1e-3 * 1e-2))
    assert stats.critical_lr(lrs, [0.5, 1, 1]) == 1e-4
    assert stats.critical_lr(lrs, [0, 1 / 3, 1 / 3]) == math.inf
    # The first crossing counts, not a later one.
    assert stats.critical_lr(lrs, [0, 1, 0]) == pytest.approx(math.sqrt(1e-4 * 1e-3))
    with pytest.raises(ValueError, match="ascending"):
        stats.critical_lr([1e-3, 1e-4], [0, 1])


def test_critical_lr_ci_is_exact_for_unanimous_seeds_and_censored_above_the_grid():
    est, lo, hi = stats.critical_lr_ci({1e-4: [0, 0, 0], 1e-3: [1, 1, 1]})
    assert est == lo == hi == pytest.approx(math.sqrt(1e-4 * 1e-3))
    est, lo, hi = stats.critical_lr_ci({1e-4: [0, 0, 0], 1e-3: [0, 0, 0]})
    assert est == lo == hi == math.inf
    est, lo, hi = stats.critical_lr_ci({1e-4: [0, 0, 1], 1e-3: [0, 1, 1], 1e-2: [1, 1, 1]})
    assert lo <= est <= hi and lo >= 1e-4 and hi <= 1e-2
    assert "> grid" in stats.fmt_ci(1e-3, 1e-4, math.inf, ".3g")


def test_stage2_decision_needs_the_whole_grid_and_separated_intervals():
    import ml_collections

    from experiments.stability import stage2_report

    sc = ml_collections.ConfigDict(
        dict(arms=("moe2", "dense2"), variants=("grpo",), lrs=(1e-4, 1e-3), seeds=(0, 1, 2))
    )

    def runs(arm, collapsed_at_1e3):
        return [
            dict(arm=arm, variant="grpo", lr=lr, seed=s, eval_final=0.5, collapsed=c)
            for lr, flags in ((1e-4, [False] * 3), (1e-3, collapsed_at_1e3))
            for s, c in enumerate(flags)
        ]

    # The MoE collapses at 1e-3 in every seed, the dense twin in none: above the grid.
    fr = stage2_report.frontier(runs("moe2", [True] * 3) + runs("dense2", [False] * 3))
    (line,) = stage2_report.decide(fr, sc)
    assert "**MoE-specific collapse**" in line and "> grid" in line
    # Both collapse in every seed: the same critical lr, no verdict of specificity.
    fr = stage2_report.frontier(runs("moe2", [True] * 3) + runs("dense2", [True] * 3))
    assert "not MoE-specific" in stage2_report.decide(fr, sc)[0]
    # A seed missing: numbers, marked preliminary, and no verdict.
    fr = stage2_report.frontier(runs("moe2", [True] * 3) + runs("dense2", [False] * 3)[:-1])
    (line,) = stage2_report.decide(fr, sc)
    assert line.startswith("- grpo: preliminary, 11 of 12 runs") and "MoE-specific" not in line

    # The table's descriptive column: held-out reward below 0.3x the warm start's, the
    # detector's verdict aside; a run without both evaluations is not counted.
    rs = runs("moe2", [False] * 3)
    for r, start in zip(rs[3:], (0.5, 2.0, None)):  # finals 0.5: 0.5 < 0.6 only for 2.0
        r["eval_start"] = start
    (d,) = stage2_report.frontier(rs).values()
    assert d["flags"] == {1e-4: [False] * 3, 1e-3: [False] * 3}
    assert d["finals"] == {1e-4: [0.5] * 3, 1e-3: [0.5] * 3}
    assert d["fell"] == {1e-4: [], 1e-3: [False, True]}
    assert d["critical"] == (math.inf, math.inf, math.inf)
    # The rendering, lightly: a row per lr, the counts in it.
    text = stage2_report.table(stage2_report.frontier(rs))
    assert len(text.splitlines()) == 2 + 2
    assert "| 0.001 | 0 / 3 | 0.500 [0.500, 0.500] | 1 / 2 |" in text


# --------------------------------------------------------------------------
# Arms.


def test_the_dense_twin_has_the_moe_active_ffn_width():
    from gspo_jax.models import ModelConfig

    base = dict(vocab_size=40, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32)
    for layers in (2, 4, 8):
        moe = ModelConfig(**base, **common.arm_fields(f"moe{layers}"))
        dense = ModelConfig(**base, **common.arm_fields(f"dense{layers}"))
        top1 = ModelConfig(**base, **common.arm_fields(f"moe{layers}k1"))
        router = layers * moe.num_experts * moe.d_model
        assert moe.num_moe_layers == layers and dense.num_moe_layers == 0
        assert moe.num_params(active=True) - router == dense.num_params(active=True)
        assert top1.num_params(active=True) == moe.num_params(active=True)
    with pytest.raises(ValueError, match="moe<layers>"):
        common.arm_fields("dense2k1")
    with pytest.raises(ValueError, match="arm 'mixture'"):
        common.arm_fields("mixture")


def test_apply_overrides_names_an_unknown_field():
    c = common.base_config("moe2", 0, smoke=True)
    common.apply_overrides(c, {"optimizer.lr": 5e-4, "objective": ("grpo", {"eps_high": 0.28})})
    assert c.optimizer.lr == 5e-4 and c.objective.hparams.eps_high == 0.28
    with pytest.raises(KeyError, match="optimizer.lrr"):
        common.apply_overrides(c, {"optimizer.lrr": 1.0})


# --------------------------------------------------------------------------
# The command line every stage shares.


def test_stage_filters_select_a_subset_and_name_a_value_the_config_lacks():
    from experiments.stability import stage3_replay

    only = ("arms", "updates", "seeds")
    ap = common.stage_parser("doc", "/tmp/out", "stage4_config.py", only)
    args = ap.parse_args(["--config", ap.get_default("config") + ":smoke", "--only-seeds", "0"])
    sc = common.stage_config(args, only)
    assert sc.seeds == (0,) and sc.arms == ("grpo", "grpo_r3", "grpo_tis")
    args = ap.parse_args(["--config", args.config, "--only-updates", "2", "--only-arms", "grpo"])
    sc = common.stage_config(args, only)
    assert sc.updates == (2,) and isinstance(sc.updates[0], int) and sc.arms == ("grpo",)
    for flag, value, message in [
        ("--only-arms", "grpo,grpo_r9", r"--only-arms 'grpo,grpo_r9'.*\['grpo_r9'\].*known: grpo"),
        ("--only-seeds", "0,7", r"--only-seeds '0,7'.*\[7\]"),
        ("--only-seeds", "one", r"--only-seeds 'one': expected int"),
        ("--only-updates", ",", r"--only-updates ',': not in the config \(empty\)"),
    ]:
        with pytest.raises(SystemExit, match=message):
            common.stage_config(ap.parse_args(["--config", args.config, flag, value]), only)
    # Stage 3 also accepts the dense reference row, which is not one of its default arms.
    ap3 = common.stage_parser("doc", "/tmp/out", "stage3_config.py", ("arms", "seeds"))
    args = ap3.parse_args(
        ["--config", ap3.get_default("config") + ":smoke", "--only-arms", "grpo_dense"]
    )
    sc = common.stage_config(args, ("arms", "seeds"), known={"arms": stage3_replay.table_rows})
    assert sc.arms == ("grpo_dense",)


# --------------------------------------------------------------------------
# Stage 1's drift metrics against NumPy.


def _probe_batch(cfg, seed=0, n=6, p=5, t=7):
    import jax
    import jax.numpy as jnp

    from gspo_jax import step

    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, cfg.vocab_size, (n, p))
    pmask = np.ones((n, p), np.int32)
    pmask[0, :2] = 0  # left padding
    tokens = rng.integers(1, cfg.vocab_size, (n, t))
    mask = np.ones((n, t), np.int32)
    mask[1, 4:] = 0
    mask[2, 1:] = 0
    batch = {
        "prompt_tokens": jnp.asarray(prompt * pmask, jnp.int32),
        "prompt_mask": jnp.asarray(pmask),
        "tokens": jnp.asarray(tokens * mask, jnp.int32),
        "mask": jnp.asarray(mask),
        "advantages": jnp.asarray([1.0, -1.0, 0.5, -0.5, 0.0, 2.0], jnp.float32),
    }
    return batch, step, jax


def test_drift_metrics_match_numpy():
    import jax
    from flax import nnx

    from experiments.stability import stage1_probes
    from gspo_jax.models import ModelConfig, Transformer

    cfg = ModelConfig.tiny(num_layers=2, first_dense_layers=0, moe_every=1)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch, step, _ = _probe_batch(cfg)
    old = passes.logprob_pass(params, batch, graphdef=graphdef)
    batch.update(
        old_logp=old["logp"],
        old_topk=old["topk_resp"],
        old_free_topk=old["free_topk_resp"],
        old_router_logp=old["router_logp"],
    )
    old_lp = stage1_probes.full_logprobs(params, batch, graphdef=graphdef, temperature=1.0)
    ranges = ((3e-4, 4e-4), (0.01, 0.02), (0.3, 0.4))
    kw = dict(
        graphdef=graphdef,
        temperature=1.0,
        grpo_eps=(0.2, 0.28),
        gspo_ranges=ranges,
        edges=(2, 5),
        moe=True,
    )

    same = jax.device_get(stage1_probes.drift_metrics(params, batch, old_lp, **kw))
    for key in ("kl_exact", "f2", "logratio_abs_max", "flip_frac", "router_shift_raw", "clip_grpo"):
        assert abs(float(same[key])) < 1e-6, key
    assert np.all(np.asarray(same["clip_gspo"]) == 0)

    # Move every parameter: a policy that differs, measured against the NumPy reference.
    new = jax.tree.map(
        lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), params
    )
    got = jax.device_get(stage1_probes.drift_metrics(new, batch, old_lp, **kw))
    new_lp = np.asarray(stage1_probes.full_logprobs(new, batch, graphdef=graphdef, temperature=1.0))
    o = np.asarray(old_lp, np.float64)
    m = np.asarray(batch["mask"], np.float64)
    kl = (np.exp(o) * (o - new_lp)).sum(-1)
    tok = np.asarray(batch["tokens"])
    lr = (
        np.take_along_axis(new_lp, tok[..., None], -1)[..., 0]
        - np.take_along_axis(o, tok[..., None], -1)[..., 0]
    )
    lr = lr * m
    n = m.sum()
    assert float(got["kl_exact"]) == pytest.approx((kl * m).sum() / n, rel=1e-4)
    assert float(got["f2"]) == pytest.approx(((np.abs(lr) > math.log(2)) * m).sum() / n)
    a = np.broadcast_to(np.asarray(batch["advantages"])[:, None], m.shape)
    r = np.exp(lr)
    grpo = (((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8))) * m
    assert float(got["clip_grpo"]) == pytest.approx(grpo.sum() / n)
    length = m.sum(1)
    s = np.exp(lr.sum(1) / np.maximum(length, 1))
    for j, (lo, hi) in enumerate(ranges):
        clipped = ((a[:, 0] > 0) & (s > 1 + hi)) | ((a[:, 0] < 0) & (s < 1 - lo))
        assert float(got["clip_gspo"][j]) == pytest.approx((clipped * length).sum() / n)
    # Buckets: lengths <= 2, 3..5, >= 6; token-weighted within each.
    bucket = (length[:, None] > np.array([2, 5])[None]).sum(1)
    for b in range(3):
        sel = bucket == b
        np.testing.assert_allclose(got["bucket_tokens"][b], length[sel].sum())
        if length[sel].sum():
            assert got["clip_grpo_bucket"][b] == pytest.approx(grpo[sel].sum() / length[sel].sum())
    # Flips: the free router's top-K against pi_old's, per layer.
    inputs, _, positions, attn = passes.sequence_inputs(batch)
    _, aux = nnx.merge(graphdef, new)(inputs, positions=positions, attn_mask=attn)
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    free = np.asarray(passes.response_slice(aux.free_topk_indices, p, t))
    old_free = np.asarray(batch["old_free_topk"])
    for layer in range(2):
        miss = [
            len(set(old_free[i, j, layer]) - set(free[i, j, layer]))
            for i in range(m.shape[0])
            for j in range(m.shape[1])
            if m[i, j]
        ]
        assert got["flip_frac_layer"][layer] == pytest.approx(sum(miss) / (n * cfg.top_k))
    assert got["kl_exact"] > 0 and got["flip_frac"] > 0


# --------------------------------------------------------------------------
# Stages 1 and 2 end to end on their smoke settings.


def test_stage1_and_stage2_run_end_to_end_on_smoke(tmp_path, smoke_root):
    from experiments.stability import stage1_probes, stage2_frontier

    # The smoke warm starts the process trains once (stage 1 would build the same ones:
    # one of another config would be refused by name, not reused).
    root, out1, out2 = smoke_root(("moe2", "dense2")), tmp_path / "s1", tmp_path / "s2"
    cfg1 = os.path.join(REPO, "experiments", "stability", "stage1_config.py") + ":smoke"
    stage1_probes.main(["--root", str(root), "--out", str(out1), "--config", cfg1])
    probes = sorted(os.listdir(out1 / "probes"))
    assert len(probes) == 4  # moe2 and dense2 x grpo and gspo
    recs = common.read_jsonl(str(out1 / "probes" / "moe2_grpo_lr0.001_s0.jsonl"))
    assert [r["k"] for r in recs] == [0, 1, 2]
    assert "flip_frac_layer" in recs[0] and len(recs[0]["clip_gspo"]) == 22
    dense = common.read_jsonl(str(out1 / "probes" / "dense2_gspo_lr0.001_s0.jsonl"))
    assert "flip_frac" not in dense[0]
    # A second invocation resumes: nothing left to run.
    assert (
        stage1_probes.run_all(
            sweep.load_config(cfg1.split(":")[0] + ":smoke"),
            str(root),
            str(out1),
            common.Budget(None),
        )
        == 0
    )
    stage1_probes.main(["--report", "--out", str(out1), "--config", cfg1])
    for name in ("decisions.md", "clip_table.md", "flips_vs_k.png", "tails_vs_kl.png"):
        assert (out1 / name).exists(), name

    cfg2 = os.path.join(REPO, "experiments", "stability", "stage2_config.py") + ":smoke"
    stage2_frontier.main(
        ["--root", str(root), "--out", str(out2), "--config", cfg2, "--only-arms", "moe2"]
    )
    runs = sorted(os.listdir(out2 / "runs"))
    assert runs == ["moe2_grpo_lr0.001_s0.jsonl", "moe2_gspo_lr0.001_s0.jsonl"]
    summary = common.read_jsonl(str(out2 / "runs" / runs[0]))[0]
    assert summary["steps"] == [1, 2] and summary["collapsed"] is False
    assert len(summary["series"]["reward_mean"]) == 2
    stage2_frontier.main(["--report", "--out", str(out2), "--config", cfg2])
    text = (out2 / "frontier.md").read_text()
    assert "| moe2 | grpo | 0.001 | 0 / 1 |" in text
    assert (out2 / "frontier.png").exists()
    json.dumps(summary)  # the summary is plain JSON


def test_stage2_refuses_to_run_without_stage1s_plan(tmp_path, monkeypatch):
    from experiments.stability import stage2_config

    monkeypatch.setattr(stage2_config, "PLAN", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="experiments.stability.stage1_probes --report"):
        stage2_config.get_config()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"lrs": [3e-4, 1e-3], "eps_low": 0.01, "eps_high": 0.0133}))
    monkeypatch.setattr(stage2_config, "PLAN", str(plan))
    c = stage2_config.get_config()
    assert c.lrs == (3e-4, 1e-3) and c.gspo_eps == (0.01, 0.0133)


def test_stage3s_setting_search_is_stage2s_grpo_frontier_on_each_fallback(
    tmp_path, monkeypatch, fake_stage_runs
):
    from experiments.stability import stage2_config, stage2_frontier

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"lrs": [3e-4, 1e-3], "eps_low": 0.01, "eps_high": 0.0133}))
    monkeypatch.setattr(stage2_config, "PLAN", str(plan))
    full = stage2_config.get_config()
    for name, arms, updates in [
        ("moe4", ("moe4", "dense4"), 16),
        ("moe2k1", ("moe2k1", "dense2"), 16),
        ("updates32", ("moe2", "dense2"), 32),
        ("hard", ("moe2", "dense2"), 16),
    ]:
        c = stage2_config.get_config(f"search={name}")
        assert (c.arms, c.updates, c.variants) == (arms, updates, ("grpo",))
        assert c.task == ("hard" if name == "hard" else "small")
        assert (c.lrs, c.seeds, c.steps) == (full.lrs, full.seeds, full.steps)
        assert stage2_frontier.stage_name(c) == f"stage2_search/{name}"
    assert stage2_frontier.stage_name(full) == "stage2"
    with pytest.raises(ValueError, match="search='moe3'.*known: moe4, moe2k1, updates32, hard"):
        stage2_config.get_config("search=moe3")

    # The search's runs go to their own folders under --root and results/, with their
    # updates per rollout in each summary.
    calls = fake_stage_runs
    monkeypatch.setattr(common, "RESULTS", str(tmp_path / "results"))
    cfg = os.path.join(REPO, "experiments", "stability", "stage2_config.py")
    stage2_frontier.main(["--root", str(tmp_path), "--config", cfg + ":search=updates32"])
    n = 2 * len(sweep.load_config(cfg + ":search=updates32").lrs) * 3
    assert len(calls) == n  # arms × lrs × seeds, GRPO only (the file loads the real plan)
    assert {c["stage"] for c in calls} == {"stage2_search/updates32"}
    assert {c["overrides"]["updates.num_minibatches"] for c in calls} == {32}
    runs = common.read_records(str(tmp_path / "results" / "stage2_search" / "updates32" / "runs"))
    assert len(runs) == n and {r["updates"] for r in runs} == {32}
    assert {c["task"] for c in calls} == {"small"} and {r["task"] for r in runs} == {"small"}
    calls.clear()
    stage2_frontier.main(
        ["--root", str(tmp_path), "--config", cfg + ":search=hard", "--only-seeds", "0"]
    )
    assert {c["stage"] for c in calls} == {"stage2_search/hard"}
    assert {c["task"] for c in calls} == {"hard"}

    # search=moe2k1's dense twin is stage 2's dense2: a run stage 2 made with the same
    # lr, seed, updates and task is reused (its summary predates `updates` and `task`),
    # one made otherwise is trained; --only-lrs picks learning rates.
    lr = sweep.load_config(cfg + ":search=moe2k1").lrs[1]
    stage2_runs = tmp_path / "results" / "stage2" / "runs"
    legacy = dict(arm="dense2", variant="grpo", lr=lr, seed=0, collapsed=True, collapse_step=9)
    common.write_jsonl(str(stage2_runs / f"dense2_grpo_lr{lr:g}_s0.jsonl"), [legacy])
    other = dict(legacy, seed=1, updates=8)
    common.write_jsonl(str(stage2_runs / f"dense2_grpo_lr{lr:g}_s1.jsonl"), [other])
    calls.clear()
    stage2_frontier.main(
        ["--root", str(tmp_path), "--config", cfg + ":search=moe2k1", "--only-lrs", f"{lr:g}"]
        + ["--only-seeds", "0,1"]
    )
    assert sorted(c["name"] for c in calls) == [
        f"dense2_grpo_lr{lr:g}_s1",
        f"moe2k1_grpo_lr{lr:g}_s0",
        f"moe2k1_grpo_lr{lr:g}_s1",
    ]
    out = tmp_path / "results" / "stage2_search" / "moe2k1" / "runs"
    assert common.read_jsonl(str(out / f"dense2_grpo_lr{lr:g}_s0.jsonl")) == [legacy]
    assert common.read_jsonl(str(out / f"dense2_grpo_lr{lr:g}_s1.jsonl"))[0]["collapsed"] is False
    with pytest.raises(SystemExit, match=r"--only-lrs '0.5'.*\[0.5\]"):
        stage2_frontier.main(["--config", cfg + ":search=moe2k1", "--only-lrs", "0.5"])


def test_the_hard_task_is_its_own_setting_with_its_own_warm_starts():
    small = common.rl_config("moe2", 0, "/r")
    hard = common.rl_config("moe2", 0, "/r", task="hard")
    assert (small.task.difficulty, small.rollout.max_new_tokens) == ("small", 24)
    assert (hard.task.difficulty, hard.rollout.max_new_tokens) == ("hard", 48)
    # "Make 999 from 99 99 99 99 with + - * /, each once." does not fit the small task's 48.
    assert (
        small.rollout.max_prompt_len == common.RL_PROMPT_LEN["small"] == 48
        and hard.rollout.max_prompt_len == 64
    )
    assert hard.model.fields.num_experts == small.model.fields.num_experts
    assert common.warm_start_dir("/r", "moe2", 1) == "/r/warm/moe2_s1"
    assert common.warm_start_dir("/r", "moe2", 1, "hard") == "/r/warm/hard/moe2_s1"
    with pytest.raises(ValueError, match="task 'medium': expected one of small, hard"):
        common.base_config("moe2", 0, task="medium")


def test_stage8_is_stage2s_frontier_at_depth_in_bf16(tmp_path, smoke_root):
    """scale=gpu (stage 8): the 12-layer, 64-expert top-8 MoE and its dense twin, GRPO
    only, in bf16, results in results/stage8; its smoke runs the same plumbing on a
    2-layer model."""
    from experiments.stability import stage2_config, stage2_frontier
    from gspo_jax import config as config_lib

    sc = stage2_config.get_config("scale=gpu")
    assert sc.arms == ("moe12e64k8", "dense12") and sc.variants == ("grpo",)
    assert sc.lrs == (3e-4, 5.5e-4, 1e-3) and len(sc.seeds) == 3 and sc.task == "small"
    assert stage2_frontier.stage_name(sc) == "stage8"
    fields = common.arm_fields("moe12e64k8")
    assert (fields["num_experts"], fields["top_k"], fields["moe_d_ff"] * fields["top_k"]) == (
        64,
        8,
        256,
    )
    assert common.arm_fields("dense12")["d_ff"] == 256  # the same active FFN width
    runs = list(stage2_frontier.grid(sc))
    assert len(runs) == 2 * 3 * 3
    for r in runs:
        c = common.rl_config(r.arm, r.seed, "/tmp/unused")
        common.apply_overrides(c, r.overrides)
        config_lib.validate(c, num_devices=1)
        assert c.model.dtype == "bfloat16" and r.meta["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="no setting search"):
        stage2_config.get_config("scale=gpu,search=moe4")
    with pytest.raises(ValueError, match="top-3 does not divide"):
        common.arm_fields("moe2k3")

    # The dense twin's warm start is stage 2's (bf16 is the RL runs' compute dtype only).
    root, out = smoke_root(("dense2",)), tmp_path / "s8"
    cfg = os.path.join(REPO, "experiments", "stability", "stage2_config.py") + ":scale=gpu,smoke"
    stage2_frontier.main(["--root", str(root), "--out", str(out), "--config", cfg])
    names = sorted(os.listdir(out / "runs"))
    assert names == ["dense2_grpo_lr0.001_s0.jsonl", "moe2e8k4_grpo_lr0.001_s0.jsonl"]
    summary = common.read_jsonl(str(out / "runs" / names[1]))[0]
    assert summary["dtype"] == "bfloat16" and summary["steps"] == [1, 2]
    assert (root / "stage8" / "moe2e8k4_grpo_lr0.001_s0" / "metrics.jsonl").exists()
    stage2_frontier.main(["--report", "--out", str(out), "--config", cfg])
    assert "| moe2e8k4 | grpo | 0.001 | 0 / 1 |" in (out / "frontier.md").read_text()


def test_sign_verdict_reads_the_interval_and_refuses_one_seed():
    words = dict(above="up", below="down", neither="none")
    assert stats.sign_verdict((0.2, 0.1, 0.3), 3, **words) == "up"
    assert stats.sign_verdict((-0.2, -0.3, -0.1), 3, **words) == "down"
    assert stats.sign_verdict((0.1, -0.1, 0.3), 3, **words) == "none"
    # One seed: the bootstrap of one value is that value, an interval of zero width.
    one = stats.bootstrap_ci([-0.2])
    assert one[1] == one[2] == -0.2
    assert stats.sign_verdict(one, 1, **words) == stats.ONE_SEED
    # "(preliminary)" marks a verdict on fewer seeds than planned, never a non-verdict.
    assert stats.preliminary("up", complete=False) and not stats.preliminary("up", complete=True)
    assert not stats.preliminary(stats.ONE_SEED, complete=False)
    assert not stats.preliminary("no runs", complete=False)
    assert (stats.seeds_text(1), stats.seeds_text(3)) == ("1 seed", "3 seeds")


def test_a_warm_start_of_another_config_is_refused_by_name(smoke_root):
    """The runs restore a warm start's checkpoints by shape: one built under other SFT
    settings is refused, not reused."""
    root = str(smoke_root(("dense2",)))
    assert common.ensure_warm_start(root, "dense2", 0, smoke=True) == os.path.join(
        root, "warm", "dense2_s0"
    )
    path = os.path.join(root, "warm", "dense2_s0", "config.json")
    with open(path) as f:
        saved = json.load(f)
    saved["sft"]["steps"] = 3
    with open(path, "w") as f:
        json.dump(saved, f)
    with pytest.raises(
        ValueError,
        match=r"another config \(saved -> now: config.sft.steps: 3 -> 2; from .*config.json\)",
    ):
        common.ensure_warm_start(root, "dense2", 0, smoke=True)
