"""Stage 1's figures, tables and decision rules from the probe records
(experiments/stability/README.md, "Stage 1"); made by

    python -m experiments.stability.stage1_probes --report

Works on whatever part of the grid has run: an arm, lr or seed without records is
left out of the figures and reported as missing by the rules that need it.
"""

from __future__ import annotations

import collections
import json
import math
import os

import numpy as np

from experiments.stability import common
from experiments.stability.stage1_config import gspo_grid
from experiments.stability.stats import bootstrap_ci, fmt_ci

MOE_ARMS = ("moe2", "moe4", "moe8")
PAIRS = ((2, "moe2", "dense2"), (4, "moe4", "dense4"))


class Index:
    """Probe records by (arm, objective, lr, seed): per-seed values of a metric at an
    update index k, averaged over the rollout batches."""

    def __init__(self, recs: list[dict]):
        self.by = collections.defaultdict(list)
        for r in recs:
            self.by[(r["arm"], r["objective"], float(r["lr"]), int(r["seed"]))].append(r)
        self.arms = sorted({k[0] for k in self.by})
        self.objectives = sorted({k[1] for k in self.by})
        self.lrs = sorted({k[2] for k in self.by})
        self.seeds = sorted({k[3] for k in self.by})

    def runs(self, arm, obj, lr):
        return {s: self.by[(arm, obj, lr, s)] for s in self.seeds if (arm, obj, lr, s) in self.by}

    def per_seed(self, arm, obj, lr, k, metric) -> np.ndarray:
        """f64[seeds(, ...)]: each seed's batch-mean of ``metric`` at update index k."""
        vals = []
        for recs in self.runs(arm, obj, lr).values():
            xs = [r[metric] for r in recs if r["k"] == k and r.get(metric) is not None]
            if xs:
                vals.append(np.mean(np.asarray(xs, np.float64), axis=0))
        return np.asarray(vals, np.float64)

    def num_seeds(self, arm: str) -> int:
        """Seeds for which every (objective, lr) probe of ``arm`` has run."""
        keys = {(o, lr) for (a, o, lr, _) in self.by if a == arm}
        if not keys:
            return 0
        return sum(all((arm, o, lr, s) in self.by for o, lr in keys) for s in self.seeds)

    def max_k(self) -> int:
        return max(r["k"] for recs in self.by.values() for r in recs)


def _ci(x: np.ndarray) -> tuple[float, float, float]:
    return bootstrap_ci(x) if len(x) else (math.nan, math.nan, math.nan)


# --------------------------------------------------------------------------
# Decision rules.


def tails_difference(idx: Index, moe: str, dense: str, *, n_boot: int = 2000, seed: int = 0):
    """Rule 1: D = mean over shared (objective, half-decade KL bin) cells of the seed-mean
    F(2) of ``moe`` minus that of ``dense``, and its bootstrap interval over seeds
    (resampled per arm). Returns (D, lower, upper, number of shared cells) or None."""

    def cells(arm):  # (objective, bin) -> {seed: mean F2 of that seed's records in the bin}
        out = collections.defaultdict(dict)
        for (a, obj, _, s), recs in idx.by.items():
            if a != arm:
                continue
            for r in recs:
                if r["k"] >= 1 and r["kl_exact"] > 0:
                    b = math.floor(math.log10(r["kl_exact"]) * 2)
                    out[(obj, b)].setdefault(s, []).append(r["f2"])
        return {c: {s: float(np.mean(v)) for s, v in d.items()} for c, d in out.items()}

    cm, cd = cells(moe), cells(dense)
    shared = sorted(set(cm) & set(cd))
    if not shared:
        return None

    def d_of(pick_m, pick_d):
        diffs = []
        for c in shared:
            xm = [cm[c][s] for s in pick_m if s in cm[c]]
            xd = [cd[c][s] for s in pick_d if s in cd[c]]
            if xm and xd:
                diffs.append(np.mean(xm) - np.mean(xd))
        return float(np.mean(diffs)) if diffs else math.nan

    seeds_m = sorted({s for c in shared for s in cm[c]})
    seeds_d = sorted({s for c in shared for s in cd[c]})
    est = d_of(seeds_m, seeds_d)
    rng = np.random.default_rng(seed)
    boots = [
        d_of(list(rng.choice(seeds_m, len(seeds_m))), list(rng.choice(seeds_d, len(seeds_d))))
        for _ in range(n_boot)
    ]
    boots = np.asarray([b for b in boots if math.isfinite(b)])
    return est, float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975)), len(shared)


def calibrate(idx: Index, grid, *, arm="moe2", objective="grpo", lr=1e-3, named: int = 2):
    """Rule 3: the sequence range whose GSPO clip fraction equals GRPO's token clip
    fraction on ``arm``'s ``objective``-trained records at ``lr``, k >= 1 (pooled),
    interpolated linearly in clip fraction against log eps_low between grid points.
    ``grid``: every measured range (the first ``named`` are not on the grid)."""
    recs = [r for s, rs in idx.runs(arm, objective, lr).items() for r in rs if r["k"] >= 1]
    if not recs:
        return None
    target = float(np.mean([r["clip_grpo"] for r in recs]))
    curve = np.mean([r["clip_gspo"] for r in recs], axis=0)[named:]
    lows = np.asarray([g[0] for g in grid[named:]])
    out = dict(arm=arm, objective=objective, lr=lr, records=len(recs), grpo_clip_frac=target)
    # The clip fraction falls as the range widens: find where it crosses the target.
    for j in range(len(lows) - 1):
        a, b = curve[j], curve[j + 1]
        if (a - target) * (b - target) <= 0 and a != b:
            w = (a - target) / (a - b)
            lo = math.exp(math.log(lows[j]) + w * (math.log(lows[j + 1]) - math.log(lows[j])))
            return dict(out, eps_low=lo, eps_high=lo * 4.0 / 3.0, bracket=[lows[j], lows[j + 1]])
    return dict(out, eps_low=None, eps_high=None, note="GRPO's clip fraction is outside the grid's")


def clip_at(rec_curve: np.ndarray, lows: np.ndarray, eps_low: float) -> np.ndarray:
    """A grid of clip fractions (f[G] or f[G, B]) read at ``eps_low`` (linear in log eps)."""
    x = np.log(lows)
    j = int(np.clip(np.searchsorted(x, math.log(eps_low)) - 1, 0, len(x) - 2))
    w = (math.log(eps_low) - x[j]) / (x[j + 1] - x[j])
    return (1 - w) * rec_curve[j] + w * rec_curve[j + 1]


def stage2_lrs(idx: Index, *, arm="moe2", k: int | None = None, threshold: float = 0.01):
    """Rule 4: the stage-1 lrs from the smallest one whose 16-update KL under GRPO
    exceeds ``threshold``, continued by factors of sqrt(10) to four values."""
    k = idx.max_k() if k is None else k
    kl = {lr: idx.per_seed(arm, "grpo", lr, k, "kl_exact") for lr in idx.lrs}
    kl = {lr: float(v.mean()) for lr, v in kl.items() if len(v)}
    moving = [lr for lr in sorted(kl) if kl[lr] > threshold]
    if not moving:
        return kl, []
    lrs = [lr for lr in sorted(kl) if lr >= moving[0]]
    while len(lrs) < 4:
        lrs.append(float(f"{lrs[-1] * math.sqrt(10):.2g}"))
    return kl, lrs[:4]


# --------------------------------------------------------------------------
# Figures and tables.


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


STYLE = {"grpo": "-", "gspo": "--"}
COLOR = {"moe2": "C0", "moe4": "C1", "moe8": "C3", "dense2": "C2", "dense4": "C4"}


def fig_flips_vs_k(idx: Index, path: str) -> None:
    plt = _plt()
    lrs = idx.lrs
    fig, axes = plt.subplots(1, len(lrs), figsize=(3.4 * len(lrs), 3.3), sharey=True, squeeze=False)
    ks = np.arange(idx.max_k() + 1)
    for ax, lr in zip(axes[0], lrs):
        for arm in [a for a in MOE_ARMS if a in idx.arms]:
            for obj in idx.objectives:
                ys = (
                    np.stack([idx.per_seed(arm, obj, lr, k, "flip_frac") for k in ks], axis=1)
                    if idx.runs(arm, obj, lr)
                    else None
                )
                if ys is None or ys.size == 0:
                    continue
                ax.plot(ks, ys.mean(0), STYLE.get(obj, ":"), color=COLOR[arm], label=f"{arm} {obj}")
                ax.fill_between(ks, ys.min(0), ys.max(0), color=COLOR[arm], alpha=0.12)
        ax.set_title(f"lr {lr:g}")
        ax.set_xlabel("updates since π_old (k)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("free-router flip fraction")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(
        "Router flips against the update index (mean over seeds; band: seed range)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fig_flips_vs_lr(idx: Index, path: str) -> None:
    plt = _plt()
    kmax = idx.max_k()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=False)
    for ax, k in zip(axes, (1, kmax)):
        for arm in [a for a in MOE_ARMS if a in idx.arms]:
            for obj in idx.objectives:
                pts = [(lr, _ci(idx.per_seed(arm, obj, lr, k, "flip_frac"))) for lr in idx.lrs]
                pts = [(lr, c) for lr, c in pts if math.isfinite(c[0])]
                if not pts:
                    continue
                x = [p[0] for p in pts]
                y = np.asarray([p[1] for p in pts])
                ax.errorbar(
                    x,
                    y[:, 0],
                    yerr=[y[:, 0] - y[:, 1], y[:, 2] - y[:, 0]],
                    fmt="o" + STYLE.get(obj, ":"),
                    color=COLOR[arm],
                    capsize=2,
                    label=f"{arm} {obj}",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(f"after {k} update{'s' if k > 1 else ''}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("free-router flip fraction")
    axes[1].legend(fontsize=7)
    fig.suptitle(
        "Flips against learning rate (seed mean, 95% bootstrap interval over seeds)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fig_flips_per_layer(idx: Index, path: str, arm: str = "moe8") -> bool:
    if arm not in idx.arms:
        return False
    plt = _plt()
    kmax = idx.max_k()
    fig, axes = plt.subplots(
        1, len(idx.objectives), figsize=(4 * len(idx.objectives), 3.3), squeeze=False
    )
    for ax, obj in zip(axes[0], idx.objectives):
        for i, lr in enumerate(idx.lrs):
            for k, ls in ((1, ":"), (kmax, "-")):
                y = idx.per_seed(arm, obj, lr, k, "flip_frac_layer")
                if y.size:
                    ax.plot(
                        np.arange(y.shape[1]),
                        y.mean(0),
                        ls,
                        marker="o",
                        ms=3,
                        color=f"C{i}",
                        label=f"lr {lr:g}, k={k}",
                    )
        ax.set_xlabel("layer")
        ax.set_yscale("log")
        ax.set_title(f"{arm}, {obj}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("free-router flip fraction")
    for ax in axes[0]:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fig_tails_vs_kl(idx: Index, path: str) -> None:
    plt = _plt()
    metrics = (
        ("f2", "F(τ=2)"),
        ("logratio_abs_q99", "q99 |log r|"),
        ("flip_frac", "free-router flips"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    kmax = idx.max_k()
    for ax, (metric, label) in zip(axes, metrics):
        for arm in idx.arms:
            xs, ys = [], []
            for obj in idx.objectives:
                for lr in idx.lrs:
                    for k in range(1, kmax + 1):
                        kl = idx.per_seed(arm, obj, lr, k, "kl_exact")
                        y = idx.per_seed(arm, obj, lr, k, metric)
                        if kl.size and y.size:
                            xs.append(kl.mean())
                            ys.append(y.mean())
            if xs:
                dense = arm.startswith("dense")
                ax.scatter(
                    xs,
                    ys,
                    s=9,
                    color=COLOR.get(arm, "k"),
                    marker="o",
                    facecolors="none" if dense else COLOR.get(arm, "k"),
                    label=arm,
                    alpha=0.7,
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("exact KL(π_old‖π_θ) per token")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "Ratio tails and flips against KL: MoE (filled) beside dense (hollow); one point per arm, objective, lr and k (seed mean)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def clip_table(idx: Index, grid, calib, sc, arm="moe2") -> str:
    """Token clip fractions by response length on ``arm``'s records (k = 1..16, pooled
    over batches and seeds): GRPO's range, GSPO's named ranges and the calibrated one,
    on each trained objective's trajectory, at each lr."""
    edges = list(sc.length_edges)
    names = (
        [f"≤{edges[0]}"]
        + [f"{a + 1}–{b}" for a, b in zip(edges, edges[1:])]
        + [f"≥{edges[-1] + 1}"]
    )
    named = len(sc.gspo_named)
    lows = np.asarray([g[0] for g in grid[named:]])
    lines = []
    for lr in idx.lrs:
        for obj in idx.objectives:
            recs = [r for rs in idx.runs(arm, obj, lr).values() for r in rs if r["k"] >= 1]
            if not recs:
                continue
            tok = np.sum([r["bucket_tokens"] for r in recs], axis=0)  # [B]

            def pooled(key, j=None):  # token-weighted over records, per bucket and overall
                per = np.asarray([r[key] if j is None else r[key][j] for r in recs])  # [R, B]
                w = np.asarray([r["bucket_tokens"] for r in recs])
                b = (per * w).sum(0) / np.maximum(w.sum(0), 1)
                return b, float((per * w).sum() / max(w.sum(), 1))

            rows = [("GRPO token 0.2/0.28",) + pooled("clip_grpo_bucket")]
            for j, (lo, hi) in enumerate(sc.gspo_named):
                rows.append((f"GSPO seq {lo:g}/{hi:g}",) + pooled("clip_gspo_bucket", j))
            if calib and calib.get("eps_low"):
                per = np.asarray(
                    [np.asarray(r["clip_gspo_bucket"])[named:] for r in recs]
                )  # [R, G, B]
                w = np.asarray([r["bucket_tokens"] for r in recs])[:, None, :]
                grid_b = (per * w).sum(0) / np.maximum(w.sum(0), 1)  # [G, B]
                grid_all = (per * w).sum((0, 2)) / max(w.sum(), 1)  # [G]
                e = calib["eps_low"]
                rows.append(
                    (
                        f"GSPO seq calibrated {e:.3g}/{4 * e / 3:.3g}",
                        clip_at(grid_b, lows, e),
                        float(clip_at(grid_all, lows, e)),
                    )
                )
            lines.append(
                f"\n**{arm}, trained with {obj}, lr {lr:g}** ({len(recs)} records; tokens per bucket: {', '.join(str(int(t)) for t in tok)})\n"
            )
            lines.append("| range | " + " | ".join(names) + " | all |")
            lines.append("|---|" + "---:|" * (len(names) + 1))
            for name, b, overall in rows:
                lines.append(
                    f"| {name} | " + " | ".join(f"{v:.4f}" for v in b) + f" | {overall:.4f} |"
                )
            g = rows[0][2]
            if g > 0:
                ratio = ", ".join(
                    f"{row[0].split(' seq ')[1]}: {row[2] / g:.3g}×" for row in rows[1:]
                )
                lines.append(f"\nGSPO / GRPO clip fraction: {ratio}")
    return "\n".join(lines) + "\n" + clip_by_k(idx, grid, calib, sc, arm)


def clip_by_k(idx: Index, grid, calib, sc, arm="moe2") -> str:
    """The same ranges' clip fractions (all lengths) after k = 1, 4 and 16 updates: near
    π_old, where GSPO's paper measured them, and far off-policy. Seed mean of the
    batch means, on each trained objective's own trajectory."""
    named = len(sc.gspo_named)
    lows = np.asarray([g[0] for g in grid[named:]])
    ks = [k for k in (1, 4, idx.max_k()) if k <= idx.max_k()]
    head = "| objective | lr | range | " + " | ".join(f"k = {k}" for k in ks) + " |"
    lines = [
        "\n## Clip fractions against the update index k\n",
        head,
        "|---|---:|---|" + "---:|" * len(ks),
    ]
    for obj in idx.objectives:
        for lr in idx.lrs:
            if not idx.runs(arm, obj, lr):
                continue
            grpo = [idx.per_seed(arm, obj, lr, k, "clip_grpo").mean() for k in ks]
            gspo = [idx.per_seed(arm, obj, lr, k, "clip_gspo").mean(0) for k in ks]
            rows = [("GRPO token 0.2/0.28", grpo)]
            for j, (lo, hi) in enumerate(sc.gspo_named):
                rows.append((f"GSPO seq {lo:g}/{hi:g}", [g[j] for g in gspo]))
            if calib and calib.get("eps_low"):
                e = calib["eps_low"]
                rows.append(
                    (
                        f"GSPO seq calibrated {e:.3g}",
                        [float(clip_at(g[named:], lows, e)) for g in gspo],
                    )
                )
            for name, vals in rows:
                lines.append(
                    f"| {obj} | {lr:g} | {name} | " + " | ".join(f"{v:.4f}" for v in vals) + " |"
                )
    return "\n".join(lines) + "\n"


def decisions(idx: Index, calib, sc) -> str:
    out = [
        "# Stage 1: the decision rules applied\n",
        f"Records: arms {idx.arms}, objectives {idx.objectives}, lrs {idx.lrs}, seeds {idx.seeds}.\n",
    ]
    out.append("## Rule 1: MoE vs dense ratio tails at matched KL\n")
    verdicts = []
    for depth, moe, dense in PAIRS:
        got = tails_difference(idx, moe, dense) if moe in idx.arms and dense in idx.arms else None
        if got is None:
            out.append(
                f"- L = {depth}: missing ({moe} and {dense} share no (objective, KL bin) cell)."
            )
            verdicts.append(None)
            continue
        d, lo, hi, cells = got
        n = min(idx.num_seeds(moe), idx.num_seeds(dense))
        full = n >= len(common.planned_seeds(sc))
        out.append(
            f"- L = {depth}: D = F2({moe}) − F2({dense}) = {d:+.4f} [{lo:+.4f}, {hi:+.4f}] "
            f"over {cells} shared (objective, KL bin) cells"
            + (
                "."
                if full
                else f"; preliminary: {n} of {len(common.planned_seeds(sc))} seeds, no verdict."
            )
        )
        verdicts.append((1 if lo > 0 else -1 if hi < 0 else 0) if full else None)
    if None in verdicts:
        answer = "undecided: not every depth has run"
    elif all(v == 1 for v in verdicts):
        answer = "MoE has heavier ratio tails at matched KL"
    elif all(v == -1 for v in verdicts):
        answer = "dense has heavier ratio tails at matched KL"
    else:
        answer = "no difference at this scale"
    out.append(f"\n**Answer:** {answer}.\n")

    out.append("## Rule 2: router drift against depth\n")
    kmax = idx.max_k()
    arms = [a for a in MOE_ARMS if a in idx.arms]
    monotone, rows = True, []
    for lr in idx.lrs:
        vals = {a: _ci(idx.per_seed(a, "grpo", lr, kmax, "flip_frac")) for a in arms}
        rows.append(f"| {lr:g} | " + " | ".join(fmt_ci(*vals[a], ".4f") for a in arms) + " |")
        if lr >= 3e-4:
            means = [vals[a][0] for a in MOE_ARMS if a in vals]
            monotone &= len(means) == 3 and all(x < y for x, y in zip(means, means[1:]))
    out.append("| lr | " + " | ".join(f"{a} flips after {kmax} (GRPO)" for a in arms) + " |")
    out.append("|---|" + "---|" * len(arms))
    out.extend(rows)
    complete = all(idx.num_seeds(a) >= len(common.planned_seeds(sc)) for a in MOE_ARMS)
    if not complete:
        seen = ", ".join(f"{a}: {idx.num_seeds(a)}" for a in MOE_ARMS)
        answer = f"undecided: the rule needs {len(common.planned_seeds(sc))} seeds of every depth (have {seen})"
    elif {"moe2", "moe8"} <= set(arms) and 1e-3 in idx.lrs:
        a = _ci(idx.per_seed("moe2", "grpo", 1e-3, kmax, "flip_frac"))
        b = _ci(idx.per_seed("moe8", "grpo", 1e-3, kmax, "flip_frac"))
        apart = a[2] < b[1] or b[2] < a[1]
        answer = (
            "router drift grows with depth" if monotone and apart else "not shown at this scale"
        )
    else:
        answer = "undecided: moe2, moe8 or lr 1e-3 missing"
    out.append(f"\n**Answer:** {answer}.\n")

    out.append("## Rule 3: the calibrated GSPO range\n")
    if calib is None:
        out.append("missing: no moe2 GRPO records at lr 1e-3.\n")
    elif calib.get("eps_low"):
        out.append(
            f"GRPO's token clip fraction (0.2/0.28) on moe2's GRPO records at lr 1e-3: {calib['grpo_clip_frac']:.4f} ({calib['records']} records). GSPO's sequence clip fraction equals it at ε_low* = {calib['eps_low']:.3g}, ε_high* = {calib['eps_high']:.3g} (between grid points {calib['bracket'][0]:.3g} and {calib['bracket'][1]:.3g}).\n"
        )
    else:
        out.append(f"{calib['note']} (GRPO: {calib['grpo_clip_frac']:.4f}).\n")

    out.append("## Rule 4: stage 2's learning rates\n")
    kl, lrs = stage2_lrs(idx)
    out.append(
        "moe2 GRPO KL(π_old‖π_θ) after {} updates: {}.".format(
            kmax, ", ".join(f"lr {lr:g}: {v:.4g}" for lr, v in sorted(kl.items()))
        )
    )
    out.append(
        f"\n**Stage 2 learning rates:** {', '.join(f'{x:g}' for x in lrs) if lrs else 'none qualifies'}.\n"
    )
    return "\n".join(out)


def report(out: str, sc) -> None:
    recs = common.read_records(os.path.join(out, "probes"))
    if not recs:
        raise SystemExit(f"{out}/probes: no probe records yet")
    idx = Index(recs)
    grid = gspo_grid(sc)
    calib = calibrate(idx, grid, named=len(sc.gspo_named)) if 1e-3 in idx.lrs else None
    if calib is not None:
        with open(os.path.join(out, "calibration.json"), "w") as f:
            json.dump(calib, f, indent=1, sort_keys=True)
    fig_flips_vs_k(idx, os.path.join(out, "flips_vs_k.png"))
    fig_flips_vs_lr(idx, os.path.join(out, "flips_vs_lr.png"))
    fig_flips_per_layer(idx, os.path.join(out, "flips_per_layer.png"))
    fig_tails_vs_kl(idx, os.path.join(out, "tails_vs_kl.png"))
    with open(os.path.join(out, "clip_table.md"), "w") as f:
        f.write(
            "# Token clip fractions by response length (stage 1)\n"
            + clip_table(idx, grid, calib, sc)
        )
    with open(os.path.join(out, "decisions.md"), "w") as f:
        f.write(decisions(idx, calib, sc))
    _, lrs = stage2_lrs(idx)
    if calib is not None and calib.get("eps_low") and lrs:  # rules 3 and 4: stage 2's grid
        plan = dict(lrs=lrs, eps_low=calib["eps_low"], eps_high=calib["eps_high"])
        with open(os.path.join(out, "stage2_plan.json"), "w") as f:
            json.dump(plan, f, indent=1, sort_keys=True)
    print(f"stage 1 report: {len(recs)} records -> {out}")
