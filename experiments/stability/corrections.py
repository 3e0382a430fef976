"""The numbers behind the README's "Corrections" section (experiments/stability/README.md),
each recomputed from the committed run summaries in ``results/`` and the code's own
schedule, with no new run:

    python -m experiments.stability.corrections      # writes results/corrections.md

* the regime the study ran in: where each collapsed run had its best reward, how far the
  first rollout's updates moved the policy (KL and F(τ=2) at RL step 1);
* stage 3's GRPO, GSPO and dense-GRPO seeds 0–2 against stage 2's runs of the same
  setting, and the warm-up every RL run of stages 2–4 starts with;
* stage 3's held-out endpoint beside the detector's counts, the counts at two detector
  thresholds, R3 against R2, RSPO's router-shift weight γ, and when the collapses fall
  against the precursors' baseline window;
* stage 4's GRPO / R3 ratio of the train–inference KL with a bootstrap interval;
* stages 5, 6 and 7 (the corrections of 2026-12-07): `corrections_567.sections`.
"""

from __future__ import annotations

import argparse
import collections
import math
import os

import numpy as np

from experiments.stability import common, stage3_rules
from experiments.stability.stats import (
    bootstrap_ci,
    collapse_step,
    fisher_one_sided,
    fmt_ci,
    moving_average,
)

RESULTS = common.RESULTS
STAGE3_ARMS = ("grpo", "grpo_r2", "grpo_r3", "gspo", "gmpo", "rspo_g0.5", "rspo_g0.1", "sapo")
DETECTOR_WINDOW = 3  # stats.collapse_step's default trailing window


def load(folder: str) -> list[dict]:
    """The summaries of ``results/<folder>``, each with its file name as ``file``."""
    out = []
    path = os.path.join(RESULTS, folder)
    for name in sorted(os.listdir(path)):
        if name.endswith(".jsonl"):
            for r in common.read_jsonl(os.path.join(path, name)):
                out.append(dict(r, file=f"{folder}/{name}"))
    return out


def series(run: dict, key: str) -> np.ndarray:
    """A per-step series as floats (nan where a step did not log it)."""
    return np.asarray([np.nan if v is None else v for v in run["series"].get(key, [])], float)


def fmt_range(xs, spec=".3g") -> str:
    xs = np.asarray(xs, float)
    return f"{np.median(xs):{spec}} [{xs.min():{spec}}, {xs.max():{spec}}]"


# --------------------------------------------------------------------------
# The regime.


def peak_at_first_step(run: dict, window: int = DETECTOR_WINDOW) -> bool:
    """Whether the detector's smoothed reward (the trailing ``window``-step mean) is
    highest at RL step 1, i.e. the run's peak is the warm start's own first rollout."""
    m = moving_average(series(run, "reward_mean"), window)
    return int(np.argmax(m)) == 0


def regime(stage2: list[dict], stage3: list[dict]) -> list[str]:
    runs = [r for r in stage2 + stage3 if r["collapsed"]]
    raw_first = [int(np.argmax(series(r, "reward_mean"))) == 0 for r in runs]
    smooth_first = [peak_at_first_step(r) for r in runs]
    late = [r["file"] for r, s in zip(runs, smooth_first) if not s]
    lines = [
        "## The regime: where the collapsed runs peaked, and their first step\n",
        f"Collapsed runs in the summaries of stages 2 and 3 (stage 3's seeds 0–2 of GRPO, "
        f"GSPO and dense GRPO counted in both, as they are committed): {len(runs)}.",
        f"- The detector's smoothed reward (trailing {DETECTOR_WINDOW}-step mean) peaks at RL "
        f"step 1, the warm start's own rollout, in {sum(smooth_first)} of {len(runs)}; "
        f"the exceptions: {', '.join(late) or 'none'}.",
        f"- The raw training reward is highest at RL step 1 in {sum(raw_first)} of {len(runs)}.",
        "",
        "KL(π_old‖π_θ) (`ppo_kl_klast`) and F(τ=2) (`frac_ratio_gt_2_klast`) after the first "
        "rollout's last update (RL step 1), median [range] over runs, every run of the "
        "group (collapsed or not):\n",
        "| stage | model | objective | lr | runs | collapsed | KL at step 1 | F(τ=2) at step 1 |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    groups = collections.defaultdict(list)
    for r in stage2:
        groups[("2", r["arm"], r["variant"], r["lr"])].append(r)
    for r in stage3:
        groups[("3", r["model"], r["arm"], r["lr"])].append(r)
    for (stage, model, obj, lr), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        if stage == "2" and lr < 1e-3:
            continue  # no collapse below 1e-3 in stage 2
        kl = [series(r, "ppo_kl_klast")[0] for r in rs]
        f2 = [series(r, "frac_ratio_gt_2_klast")[0] for r in rs]
        hits = sum(r["collapsed"] for r in rs)
        lines.append(
            f"| {stage} | {model} | {obj} | {lr:.3g} | {len(rs)} | {hits} | {fmt_range(kl)} "
            f"| {fmt_range(f2, '.2f')} |"
        )
    c_kl = [series(r, "ppo_kl_klast")[0] for r in runs]
    c_f2 = [series(r, "frac_ratio_gt_2_klast")[0] for r in runs]
    lines += [
        "",
        f"Over the {len(runs)} collapsed runs: KL at step 1 {fmt_range(c_kl)}, "
        f"F(τ=2) at step 1 {fmt_range(c_f2, '.2f')}.\n",
    ]
    return lines


# --------------------------------------------------------------------------
# Stage 3's runs that are stage 2's.

SAME_AS_STAGE2 = {  # stage-3 arm -> stage-2 summary name prefix at lr 1e-3
    "grpo": "moe2_grpo_lr0.001",
    "gspo": "moe2_gspo_lr0.001",
    "grpo_dense": "dense2_grpo_lr0.001",
}


def max_difference(a: dict, b: dict, steps: int) -> float:
    """The largest absolute difference of any series both runs logged but the wall-clock
    ``step_time``, over the first ``steps`` RL steps (steps both left unlogged are
    skipped; one logged and not the other: inf)."""
    worst = 0.0
    for key in (set(a["series"]) & set(b["series"])) - {"step_time"}:
        x, y = series(a, key)[:steps], series(b, key)[:steps]
        both = ~(np.isnan(x) | np.isnan(y))
        if np.any(np.isnan(x) != np.isnan(y)):
            return math.inf
        if both.any():
            worst = max(worst, float(np.max(np.abs(x[both] - y[both]))))
    return worst


def shared_runs(stage2: list[dict], stage3: list[dict]) -> list[str]:
    by2 = {r["file"].split("/")[-1][: -len(".jsonl")]: r for r in stage2}
    lines = [
        "## Stage 3's seeds 0–2 of GRPO, GSPO and dense GRPO are stage 2's runs\n",
        "Each stage-3 run against stage 2's run of the same model, objective, lr (1e-3), "
        "seed and updates per rollout, over stage 2's 60 RL steps: the largest absolute "
        "difference of any logged series (every metric and evaluation; not the wall-clock "
        "`step_time`), and the collapse steps.\n",
        "| stage-3 run | stage-2 run | max abs difference | collapse step (3 / 2) |",
        "|---|---|---:|---|",
    ]
    for r in sorted(stage3, key=lambda r: (r["arm"], r["seed"])):
        if r["arm"] not in SAME_AS_STAGE2 or r["seed"] > 2:
            continue
        name = f"{SAME_AS_STAGE2[r['arm']]}_s{r['seed']}"
        other = by2[name]
        d = max_difference(r, other, len(other["steps"]))
        lines.append(
            f"| {r['arm']}_s{r['seed']} | {name} | {d:.3g} "
            f"| {r['collapse_step']} / {other['collapse_step']} |"
        )
    return lines + [""]


def warmup() -> list[str]:
    """The learning rate of the first updates of an RL run of stages 2–4: the config
    every stage starts from (`common.rl_config`), through the optimizer's own schedule."""
    from gspo_jax import optim

    c = common.rl_config("moe2", 0, "/nonexistent")
    o = c.optimizer
    _, sched = optim.make_optimizer(
        lr=1.0,
        schedule=o.schedule,
        total_steps=1000,
        warmup_steps=o.warmup_steps,
        end_lr_ratio=o.end_lr_ratio,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        grad_clip=o.grad_clip,
    )
    first = ", ".join(f"{float(sched(i)):.2g}" for i in range(o.warmup_steps + 1))
    return [
        "## The warm-up of stages 2–4\n",
        f"`common.rl_config` (configs/stability.py, which stages 2–4 do not override here) "
        f"has `optimizer.warmup_steps` = {o.warmup_steps} and schedule `{o.schedule}`; "
        f"through `gspo_jax.optim.make_optimizer` the learning rate of updates 0..{o.warmup_steps}, "
        f"as a fraction of the set lr: {first}. With 1 update per rollout (stage 4) RL step 1 "
        f"makes no change to the policy, and steps 2–{o.warmup_steps} run at 0.2–0.8× the lr; "
        "with 16 (stages 2 and 3) the first rollout's 16 updates hold 4 warm-up updates "
        "after the zero one.\n",
    ]


# --------------------------------------------------------------------------
# Stage 3.


def stage3_endpoint(stage3: list[dict]) -> list[str]:
    by = {(r["arm"], r["seed"]): r for r in stage3}
    seeds = sorted({r["seed"] for r in stage3})
    lines = [
        "## Stage 3: the held-out endpoint beside the detector\n",
        "Final held-out reward (mean of the last two evaluations) per seed, the seeds in "
        "which it is above GRPO's on the same seed, and the collapse counts by the "
        "detector at its threshold 0.3 (the rule's) and at 0.5 (`stats.collapse_step` with "
        "`frac=0.5`, recomputed on the committed training-reward curves), each with the "
        "one-sided Fisher p of fewer collapses than GRPO.\n",
        "| arm | final held-out per seed | above GRPO | collapsed at 0.3 (p) "
        "| collapsed at 0.5 (p) |",
        "|---|---|---:|---|---|",
    ]
    counts = {}
    for arm in STAGE3_ARMS + ("grpo_dense", "gmpo_dense"):
        rs = [by[(arm, s)] for s in seeds if (arm, s) in by]
        counts[arm] = {
            f: sum(collapse_step(series(r, "reward_mean"), frac=f) is not None for r in rs)
            for f in (0.3, 0.5)
        }
        stored = sum(r["collapsed"] for r in rs)
        assert stored == counts[arm][0.3], f"{arm}: the detector does not reproduce the summary"
    for arm in STAGE3_ARMS + ("grpo_dense", "gmpo_dense"):
        rs = [by[(arm, s)] for s in seeds if (arm, s) in by]
        ref = "grpo_dense" if arm == "gmpo_dense" else "grpo"
        finals = " ".join(f"{r['eval_final']:.3f}" for r in rs)
        above = sum(r["eval_final"] > by[(ref, r["seed"])]["eval_final"] for r in rs)

        def cell(f):
            n = counts[arm][f]
            if arm == ref or arm == "grpo_dense":
                return f"{n} / {len(rs)}"
            p = fisher_one_sided(n, len(rs), counts[ref][f], len(rs))
            return f"{n} / {len(rs)} ({p:.2g})"

        against = "-" if arm in ("grpo", "grpo_dense") else f"{above} / {len(rs)}"
        if arm == "gmpo_dense":
            against += " (vs dense GRPO)"
        lines.append(f"| {arm} | {finals} | {against} | {cell(0.3)} | {cell(0.5)} |")
    return lines + [""]


def first_difference(a: dict, b: dict, key: str) -> int | None:
    """The first RL step at which two runs' ``key`` series differ (None: never)."""
    x, y = series(a, key), series(b, key)
    n = min(len(x), len(y))
    diff = np.nonzero(~((x[:n] == y[:n]) | (np.isnan(x[:n]) & np.isnan(y[:n]))))[0]
    return int(a["steps"][diff[0]]) if len(diff) else None


def replay_and_gamma(stage3: list[dict]) -> list[str]:
    by = {(r["arm"], r["seed"]): r for r in stage3}
    seeds = sorted({r["seed"] for r in stage3})
    r3 = [by[("grpo_r3", s)] for s in seeds]
    mm_route = max(np.nanmax(series(r, "mismatch_route")) for r in r3)
    moe = [r for r in stage3 if r["model"] == "moe2"]
    any_route = max(np.nanmax(series(r, "mismatch_route")) for r in moe)
    any_kl = max(np.nanmax(series(r, "mismatch_kl")) for r in moe)
    lines = [
        "## Stage 3: R3 is R2 here\n",
        f"GRPO+R3's sampler routes as its trainer at every step of every seed "
        f"(`mismatch_route` at most {mm_route:.3g}); over all {len(moe)} stage-3 MoE runs "
        f"`mismatch_route` is at most {any_route:.2g} and `mismatch_kl` at most {any_kl:.2g}. "
        "The sampler and the trainer compute in the same dtype (float32) with no router "
        "noise (`rollout.router_noise_std` "
        f"{common.rl_config('moe2', 0, '/nonexistent').rollout.router_noise_std:g}), so the "
        "sampler's routing, which R3 replays, is π_old's, which R2 replays. The two arms "
        "differ only by float rounding along two code paths, which the chaotic training "
        "amplifies:\n",
        "| seed | KL at step 1, R2 / R3 | training reward first differs at step "
        "| collapse step R2 / R3 |",
        "|---:|---|---:|---|",
    ]
    for s in seeds:
        a, b = by[("grpo_r2", s)], by[("grpo_r3", s)]
        ka, kb = series(a, "ppo_kl_klast")[0], series(b, "ppo_kl_klast")[0]
        lines.append(
            f"| {s} | {ka:.7f} / {kb:.7f} | {first_difference(a, b, 'reward_mean')} "
            f"| {a['collapse_step']} / {b['collapse_step']} |"
        )
    lines += [
        "",
        "## Stage 3: RSPO's router-shift weight γ\n",
        "RSPO is GMPO with each sequence's loss multiplied by the geometric mean of "
        "γ_t = max(floor, γ_raw,t), a constant (stop-gradient). The logged token mean of the "
        "raw γ after each rollout's last update (`gamma_raw_mean_klast`) per RSPO run: "
        "median [min, max] over its RL steps; and the first RL step at which the run's "
        "training reward departs from GMPO's and from the other floor's run.\n",
        "| run | γ_raw mean after the last update | departs from GMPO at step "
        "| floors 0.5 and 0.1 depart at step |",
        "|---|---|---:|---:|",
    ]

    for s in seeds:
        for arm in ("rspo_g0.5", "rspo_g0.1"):
            r = by[(arm, s)]
            g = series(r, "gamma_raw_mean_klast")
            other = by[("rspo_g0.1" if arm == "rspo_g0.5" else "rspo_g0.5", s)]
            lines.append(
                f"| {arm}_s{s} | {fmt_range(g[~np.isnan(g)], '.2f')} "
                f"| {first_difference(r, by[('gmpo', s)], 'reward_mean')} "
                f"| {first_difference(r, other, 'reward_mean')} |"
            )
    allg = np.concatenate(
        [series(r, "gamma_raw_mean_klast") for r in stage3 if r["arm"].startswith("rspo")]
    )
    lines += [
        "",
        f"Over every RSPO step: γ_raw mean {fmt_range(allg[~np.isnan(allg)], '.2f')}.\n",
    ]
    return lines


def precursor_window(stage3: list[dict]) -> list[str]:
    arms = set(STAGE3_ARMS) | {"grpo_dense"}
    rs = [r for r in stage3 if r["arm"] in arms and r["collapsed"]]
    steps = sorted(r["collapse_step"] for r in rs)
    inside = sum(s <= stage3_rules.BASELINE_STEPS for s in steps)
    return [
        "## Stage 3: collapses against the precursors' baseline window\n",
        f"Collapsed runs of the eight arms and dense GRPO: {len(rs)}; their collapse steps: "
        f"{', '.join(map(str, steps))}. Inside the baseline window (steps "
        f"1..{stage3_rules.BASELINE_STEPS}): {inside} of {len(rs)}; after it: "
        f"{len(rs) - inside}.\n",
    ]


# --------------------------------------------------------------------------
# Stage 4.


def ratio_ci(a, b, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0):
    """(mean(a) / mean(b), lower, upper): percentile bootstrap interval of the ratio of
    means, resampling each group's runs (seeds) independently."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    rng = np.random.default_rng(seed)
    ra = a[rng.integers(0, len(a), (n_boot, len(a)))].mean(axis=1)
    rb = b[rng.integers(0, len(b), (n_boot, len(b)))].mean(axis=1)
    q = (1.0 - level) / 2.0
    r = ra / rb
    return float(a.mean() / b.mean()), float(np.quantile(r, q)), float(np.quantile(r, 1 - q))


def stage4(runs: list[dict]) -> list[str]:
    cells = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in runs:
        kl = series(r, "mismatch_kl")
        cells[(r["updates"], r["target"])][r["arm"]].append(float(np.nanmean(kl)))
    lines = [
        "## Stage 4: GRPO / R3, train–inference KL\n",
        "Per run the mean `mismatch_kl` over its RL steps (as `stage4_report`); the ratio of "
        "GRPO's seed mean to GRPO+R3's, with a 95% percentile bootstrap interval resampling "
        "each arm's 3 seeds independently (2000 resamples, seed 0).\n",
        "| updates / rollout | target disagreement | GRPO / R3 [95% CI] |",
        "|---:|---:|---|",
    ]
    for (u, t), arms in sorted(cells.items()):
        lines.append(f"| {u} | {t:g} | {fmt_ci(*ratio_ci(arms['grpo'], arms['grpo_r3']), '.3g')} |")
    finals = collections.defaultdict(list)
    for r in runs:
        finals[r["arm"]].append(r["eval_final"])
    lines += [
        "",
        "Final held-out reward over all 12 runs of each arm (both update counts and noise "
        "levels): "
        + "; ".join(f"{a} {fmt_ci(*bootstrap_ci(v))}" for a, v in sorted(finals.items()))
        + f". Warm starts: {fmt_range(sorted({r['eval_start'] for r in runs}))}.\n",
    ]
    return lines


def report(out: str) -> str:
    """Every section from the committed summaries, written to ``<out>/corrections.md``;
    returns the text."""
    stage2, stage3 = load("stage2/runs"), load("stage3/runs")
    text = [
        "# Corrections: the numbers, recomputed\n",
        "Made by `python -m experiments.stability.corrections` from the committed summaries "
        '(no run); read in experiments/stability/README.md, "Corrections".\n',
    ]
    text += regime(stage2, stage3)
    text += shared_runs(stage2, stage3)
    text += warmup()
    text += stage3_endpoint(stage3)
    text += replay_and_gamma(stage3)
    text += precursor_window(stage3)
    text += stage4(load("stage4/runs"))
    from experiments.stability import corrections_567  # it imports this module's helpers

    text += corrections_567.sections()
    text = "\n".join(text)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "corrections.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=RESULTS, help="where corrections.md goes")
    args = ap.parse_args(argv)
    report(args.out)
    print(f"corrections -> {os.path.join(args.out, 'corrections.md')}")


if __name__ == "__main__":
    main()
