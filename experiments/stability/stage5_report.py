"""Stage 5's report: the probes' rule and the learned-collapse grid's rules
(experiments/stability/README.md, "Stage 5"), from the committed records alone.

    python -m experiments.stability.stage5_learn_collapse --report
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import numpy as np

from experiments.stability import common, stats

# The probes' rule (README, "Stage 5", "Probes"): the half-decade KL bin of the hint,
# and the neighbouring one below it (reported, not ruled on).
HINT_BIN = (-3.0, -2.5)  # log10 KL(pi_old || pi_theta) in [-3, -2.5)
LOWER_BIN = (-3.5, -3.0)
HINT_LOW = 1.5  # the hint's size: 1.5-2.2x


# --------------------------------------------------------------------------
# The probes.


def bin_f2(records, arm: str, lo: float, hi: float) -> dict[int, float]:
    """Per seed, the mean F(tau=2) of ``arm``'s records (k >= 1) whose exact KL has
    log10 in [lo, hi)."""
    per = defaultdict(list)
    for r in records:
        if r["arm"] != arm or r["k"] < 1 or not r["kl_exact"] > 0:
            continue
        if lo <= math.log10(r["kl_exact"]) < hi:
            per[int(r["seed"])].append(float(r["f2"]))
    return {s: float(np.mean(v)) for s, v in sorted(per.items())}


def ratio_ci(a, b, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0):
    """(mean(a) / mean(b), lower, upper): percentile bootstrap of the ratio of means,
    each group's seeds resampled independently. A resample whose denominator is 0
    counts as +inf."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or b.ndim != 1 or not len(a) or not len(b):
        raise ValueError("a, b: expected non-empty 1-D sequences")
    rng = np.random.default_rng(seed)
    num = a[rng.integers(0, len(a), (n_boot, len(a)))].mean(axis=1)
    den = b[rng.integers(0, len(b), (n_boot, len(b)))].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.inf)
    r = np.sort(r)
    q = (1.0 - level) / 2.0
    est = float(a.mean() / b.mean()) if b.mean() > 0 else math.inf
    return (
        est,
        float(np.quantile(r, q, method="lower")),
        float(np.quantile(r, 1 - q, method="higher")),
    )


def probe_rule(records, moe: str = "moe2", dense: str = "dense2", planned_seeds=None) -> dict:
    """The probes' verdict: R = F2(moe) / F2(dense) in `HINT_BIN`, seed means, with its
    bootstrap interval. "supported" if the interval is above 1; "the hint's size
    excluded" if its upper end is below `HINT_LOW`; else "inconclusive". With fewer
    seeds than planned the verdict is "preliminary"."""
    out = {}
    for name, (lo, hi) in (("hint_bin", HINT_BIN), ("lower_bin", LOWER_BIN)):
        fm, fd = bin_f2(records, moe, lo, hi), bin_f2(records, dense, lo, hi)
        row = dict(moe=fm, dense=fd, n_moe=len(fm), n_dense=len(fd))
        if fm and fd:
            row["ratio"] = ratio_ci(list(fm.values()), list(fd.values()))
        out[name] = row
    hint = out["hint_bin"]
    seeds = set(planned_seeds or ())
    if "ratio" not in hint:
        verdict = "no records in the bin"
    else:
        _, lo, hi = hint["ratio"]
        verdict = (
            "supported"
            if lo > 1
            else ("the hint's size excluded" if hi < HINT_LOW else "inconclusive")
        )
        if seeds and not (seeds <= set(hint["moe"]) and seeds <= set(hint["dense"])):
            verdict = f"preliminary ({verdict})"
    out["verdict"] = verdict
    return out


# --------------------------------------------------------------------------
# The grid.


def outcome(summary: dict, *, frac: float = 0.3) -> dict:
    """`stats.learned_collapse` of one run's summary (threshold ``frac``)."""
    steps = summary["steps"]
    series = summary["series"]
    rewards = series["reward_mean"]
    evals = [(s, e) for s, e in zip(steps, series.get("eval_reward_mean", [])) if e is not None]
    return stats.learned_collapse(
        steps,
        rewards,
        [s for s, _ in evals],
        [e for _, e in evals],
        float(summary["eval_start"]),
        frac=frac,
    )


REGIME = ("kl_step1", "kl_median", "f2_median")


def regime(runs) -> dict[str, list[float]]:
    """Per run, where it trains (README, "The regime the study ran in"): KL(pi_old ||
    pi_theta) after a rollout's last update at RL step 1 and its median over the run's
    steps, and the median share of tokens at a probability ratio above 2."""
    out = defaultdict(list)
    for r in runs:
        kl = [x for x in r["series"].get("ppo_kl_klast", ()) if x is not None]
        f2 = [x for x in r["series"].get("frac_ratio_gt_2_klast", ()) if x is not None]
        if not (kl and f2):
            continue  # a run that logged neither (none of the stage's own)
        out["kl_step1"].append(float(kl[0]))
        out["kl_median"].append(float(np.median(kl)))
        out["f2_median"].append(float(np.median(f2)))
    return dict(out)


def cells(runs):
    """Runs grouped by (variant, arm, lr), seeds in order."""
    out = defaultdict(list)
    for r in sorted(runs, key=lambda r: r["seed"]):
        out[(r["variant"], r["arm"], float(r["lr"]))].append(r)
    return out


def grid_rules(runs, sc) -> dict:
    """The stage's rules on the runs so far (README, "Stage 5", "Decision rules").

    Per cell (variant, arm, lr): each outcome's count, at thresholds 0.3 (the rule's)
    and 0.5; the final and peak held-out reward, seed means with bootstrap intervals.
    Rule 1: a cell *reproduces* learn-then-collapse when at least 2 of its seeds do.
    Rule 2 (per variant): the MoE's learned collapses against the dense twin's, pooled
    over both lrs, one-sided Fisher p < 0.05 -> "MoE more prone" (and the reverse test).
    Rule 3 (per arm): GMPO's learned collapses against GRPO's, pooled, p < 0.05 ->
    "GMPO protects in this regime"."""
    planned = len(common.planned_seeds(sc))
    by_cell = cells(runs)
    table = {}
    for key, rs in sorted(by_cell.items()):
        row = dict(n=len(rs), seeds=[r["seed"] for r in rs])
        for frac in (0.3, 0.5):
            outs = [outcome(r, frac=frac) for r in rs]
            row[f"counts@{frac}"] = {
                o: sum(x["outcome"] == o for x in outs) for o in stats.OUTCOMES
            }
            row[f"outcomes@{frac}"] = outs
        row["eval_start"] = [r["eval_start"] for r in rs]
        row["eval_final"] = stats.bootstrap_ci([r["eval_final"] for r in rs])
        row["peak_eval"] = stats.bootstrap_ci([o["peak_eval"] for o in row["outcomes@0.3"]])
        for name, value in regime(rs).items():
            row[name] = stats.bootstrap_ci(value)
        lc = row["counts@0.3"][stats.LEARNED_COLLAPSED]
        row["reproduces"] = lc >= 2
        row["complete"] = len(rs) >= planned
        table[key] = row

    def pooled(variant, arm):
        rs = [r for (v, a, _), x in by_cell.items() if v == variant and a == arm for r in x]
        hits = sum(outcome(r)["outcome"] == stats.LEARNED_COLLAPSED for r in rs)
        return hits, len(rs)

    arms = tuple(sc.arms)
    moe, dense = arms[0], arms[1]
    rule2, rule3 = {}, {}
    for v in sc.variants:
        (hm, nm), (hd, nd) = pooled(v, moe), pooled(v, dense)
        if nm and nd:
            rule2[v] = dict(
                moe=(hm, nm),
                dense=(hd, nd),
                p_moe_more=stats.fisher_one_sided(hd, nd, hm, nm),
                p_dense_more=stats.fisher_one_sided(hm, nm, hd, nd),
                complete=nm >= planned * len(sc.lrs) and nd >= planned * len(sc.lrs),
            )
    if "grpo" in sc.variants and "gmpo" in sc.variants:
        for a in arms:
            (hg, ng), (hm_, nm_) = pooled("grpo", a), pooled("gmpo", a)
            if ng and nm_:
                rule3[a] = dict(
                    grpo=(hg, ng),
                    gmpo=(hm_, nm_),
                    p=stats.fisher_one_sided(hm_, nm_, hg, ng),
                    complete=min(ng, nm_) >= planned * len(sc.lrs),
                )
    return dict(table=table, rule2=rule2, rule3=rule3)


# --------------------------------------------------------------------------
# Writing it out.


def _fmt_counts(c: dict) -> str:
    return " / ".join(str(c[o]) for o in stats.OUTCOMES)


def probes_markdown(p: dict, seeds) -> list[str]:
    lines = ["## The probes (rule P)", ""]
    for name, (lo, hi) in (("hint_bin", HINT_BIN), ("lower_bin", LOWER_BIN)):
        row = p[name]
        ratio = row.get("ratio")
        lines.append(
            f"- log10 KL in [{lo}, {hi}): F2 moe2 per seed {_seedfmt(row['moe'])}; dense2 "
            f"{_seedfmt(row['dense'])}; ratio "
            + (stats.fmt_ci(*ratio, spec=".2f") if ratio else "n/a")
        )
    lines += ["", f"**Verdict (the hint bin, seeds {list(seeds)}):** {p['verdict']}.", ""]
    return lines


def _seedfmt(d: dict) -> str:
    return "{" + ", ".join(f"s{s}: {v:.2e}" for s, v in d.items()) + "}"


def grid_markdown(g: dict, sc) -> list[str]:
    lines = [
        "## The grid",
        "",
        "Outcomes (`stats.learned_collapse`) as counts of: "
        + " / ".join(stats.OUTCOMES)
        + ". Held-out rewards: seed means [95% bootstrap over seeds].",
        "",
        "| objective | arm | lr | seeds | outcomes at 0.3 (rule) | at 0.5 | learned at "
        "| collapse at | peak held-out | final held-out | rule 1 |",
        "|---|---|---|---:|---|---|---|---|---|---|---|",
    ]
    for (v, a, lr), row in g["table"].items():
        outs = row["outcomes@0.3"]
        lines.append(
            f"| {v} | {a} | {lr:g} | {row['n']} | {_fmt_counts(row['counts@0.3'])} | "
            f"{_fmt_counts(row['counts@0.5'])} | "
            f"{[o['learned_at'] for o in outs]} | {[o['collapse_at'] for o in outs]} | "
            f"{stats.fmt_ci(*row['peak_eval'])} | {stats.fmt_ci(*row['eval_final'])} | "
            + ("**reproduces**" if row["reproduces"] else "no")
            + ("" if row["complete"] else " (preliminary)")
            + " |"
        )
    lines += [
        "",
        "### The regime: per-rollout KL(π_old‖π_θ) after the last update, nats/token",
        "",
        "Seed means [95% bootstrap over seeds] of each run's value at RL step 1 and of its "
        "median over RL steps; F(τ=2), the share of tokens at a ratio above 2, its median.",
        "",
        "| objective | arm | lr | KL at RL step 1 | KL, median | F(τ=2), median |",
        "|---|---|---|---|---|---|",
    ]
    for (v, a, lr), row in g["table"].items():
        cols = [stats.fmt_ci(*row[k]) if k in row else "n/a" for k in REGIME]
        lines.append(f"| {v} | {a} | {lr:g} | " + " | ".join(cols) + " |")
    lines += ["", "### Rule 2: MoE against its dense twin (learned collapses, both lrs pooled)", ""]
    for v, r in g["rule2"].items():
        verdict = (
            "MoE more prone"
            if r["p_moe_more"] < 0.05
            else ("dense more prone" if r["p_dense_more"] < 0.05 else "no difference shown")
        )
        lines.append(
            f"- {v}: MoE {r['moe'][0]}/{r['moe'][1]}, dense {r['dense'][0]}/{r['dense'][1]}; "
            f"p(MoE more) = {r['p_moe_more']:.3g}, p(dense more) = {r['p_dense_more']:.3g}: "
            f"**{verdict}**" + ("" if r["complete"] else " (preliminary)")
        )
    if g["rule3"]:
        lines += ["", "### Rule 3: GMPO against GRPO (learned collapses, both lrs pooled)", ""]
        for a, r in g["rule3"].items():
            lines.append(
                f"- {a}: GMPO {r['gmpo'][0]}/{r['gmpo'][1]}, GRPO {r['grpo'][0]}/{r['grpo'][1]}; "
                f"p = {r['p']:.3g}: **{'GMPO protects' if r['p'] < 0.05 else 'not shown'}**"
                + ("" if r["complete"] else " (preliminary)")
            )
    return lines + [""]


def plot_curves(runs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = cells(runs)
    lrs = sorted({k[2] for k in by}, reverse=True)
    arms = sorted({k[1] for k in by}, key=lambda a: (not a.startswith("moe"), a))
    variants = sorted({k[0] for k in by}, key=lambda v: v != "grpo")
    fig, axes = plt.subplots(
        2 * len(lrs), len(arms), figsize=(5.5 * len(arms), 3.2 * 2 * len(lrs)), squeeze=False
    )
    colors = {"grpo": "tab:red", "gmpo": "tab:blue"}
    for i, lr in enumerate(lrs):
        for j, arm in enumerate(arms):
            ax_e, ax_t = axes[2 * i][j], axes[2 * i + 1][j]
            for v in variants:
                for r in by.get((v, arm, lr), []):
                    s = r["steps"]
                    e = [
                        (t, x)
                        for t, x in zip(s, r["series"].get("eval_reward_mean", []))
                        if x is not None
                    ]
                    ax_e.plot(
                        [0] + [t for t, _ in e],
                        [r["eval_start"]] + [x for _, x in e],
                        color=colors.get(v, "k"),
                        alpha=0.7,
                        lw=1,
                    )
                    ax_t.plot(
                        s,
                        stats.moving_average(r["series"]["reward_mean"], 3),
                        color=colors.get(v, "k"),
                        alpha=0.7,
                        lw=0.8,
                    )
                    o = outcome(r)
                    if o["collapse_at"] is not None and o["outcome"] == stats.LEARNED_COLLAPSED:
                        ax_t.axvline(o["collapse_at"], color=colors.get(v, "k"), ls=":", lw=0.8)
                    if o["learned_at"] is not None:
                        ax_e.plot(
                            [o["learned_at"]],
                            [1.25 * r["eval_start"]],
                            marker="^",
                            color=colors.get(v, "k"),
                            ms=4,
                        )
            ax_e.set_title(f"{arm}, lr {lr:g}: held-out reward")
            ax_t.set_title(f"{arm}, lr {lr:g}: training reward (3-step mean)")
            ax_t.set_xlabel("RL step")
    # One scale per quantity, so the cells' panels compare at a glance.
    for row in (0, 1):
        panels = [ax for i in range(len(lrs)) for ax in axes[2 * i + row]]
        top = max((ax.get_ylim()[1] for ax in panels if ax.has_data()), default=1.0)
        for ax in panels:
            ax.set_ylim(0, top)
    handles = [
        plt.Line2D([], [], color=c, label=v.upper()) for v, c in colors.items() if v in variants
    ]
    fig.legend(handles=handles, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_probes(records, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, c in (("moe2", "tab:red"), ("dense2", "tab:blue")):
        pts = [
            (r["kl_exact"], r["f2"])
            for r in records
            if r["arm"] == arm and r["k"] >= 1 and r["kl_exact"] > 0
        ]
        if pts:
            ax.scatter(*zip(*pts), s=4, alpha=0.4, color=c, label=arm)
    ax.axvspan(
        10 ** HINT_BIN[0], 10 ** HINT_BIN[1], color="grey", alpha=0.15, label="the hint's bin"
    )
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_ylim(bottom=0)  # a share: nothing below 0 to show
    ax.set_xlabel("KL(π_old‖π_θ), nats/token")
    ax.set_ylabel("F(τ=2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: str, sc) -> None:
    probes = common.read_records(os.path.join(out, "probes"))
    runs = common.read_records(os.path.join(out, "runs"))
    lines = ["# Stage 5: learn, then collapse", ""]
    if probes:
        p = probe_rule(probes, planned_seeds=sc.probes.seeds)
        lines += probes_markdown(p, sc.probes.seeds)
        plot_probes(probes, os.path.join(out, "probes.png"))
    if runs:
        g = grid_rules(runs, sc)
        lines += grid_markdown(g, sc)
        plot_curves(runs, os.path.join(out, "curves.png"))
    if not probes and not runs:
        lines.append("No records yet.")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
