"""Stage 4's statistics, decision rules, table and figure from the runs' summaries
(experiments/stability/README.md, "Stage 4"); made by

    python -m experiments.stability.stage4_mismatch --report

`cells` groups the runs, `run_mean` and `r3_removes` give the numbers and rule 1,
`decisions` reads both rules; `table` and `figure` render them.
"""

from __future__ import annotations

import collections
import json
import math
import os

import numpy as np

from experiments.stability import common, stage4_config
from experiments.stability.stats import bootstrap_ci, bootstrap_diff_ci, fmt_ci

# The R3 paper's train–inference KL (k3 estimate, as `mismatch_kl`), measured between
# its training and inference engines without replay: the levels drawn on the figure,
# (label, level, line style).
PAPER_KL = (
    ("R3 paper, MoE (Qwen3-30B-A3B)", 1.535e-3, "--"),
    ("R3 paper, dense (Qwen3-8B)", 6.4e-4, ":"),
)


def calibration_path(out: str) -> str:
    return os.path.join(out, "calibration.json")


# --------------------------------------------------------------------------
# Statistics and the decision rules.


def _mean(values) -> float:
    v = [float(x) for x in (values or []) if x is not None and math.isfinite(float(x))]
    return float(np.mean(v)) if v else math.nan


def run_mean(run: dict, key: str) -> float:
    """A run's mean of a per-step series over its RL steps (nan if never logged)."""
    return _mean(run["series"].get(key))


def r3_removes(grpo_kl, r3_kl, factor: float = 10.0) -> bool:
    """Rule 1 at one noise level: R3's seed-mean mismatch_kl at least ``factor`` × below
    GRPO's, with non-overlapping bootstrap intervals. Arguments: (mean, lo, hi)."""
    g, g_lo, _ = grpo_kl
    r, _, r_hi = r3_kl
    return bool(r * factor <= g and r_hi < g_lo)


def cells(runs: list[dict]) -> dict:
    """{(updates, target): {arm: [runs]}}, arms in the table's order."""
    order = [row[0] for row in stage4_config.ARMS]
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in runs:
        out[(r["updates"], r["target"])][r["arm"]].append(r)
    rank = lambda a: (order.index(a) if a in order else len(order), a)  # noqa: E731
    return {
        k: {a: sorted(v[a], key=lambda r: r["seed"]) for a in sorted(v, key=rank)}
        for k, v in sorted(out.items())
    }


def _ci(values, spec=".3g"):
    v = [x for x in values if x is not None and math.isfinite(x)]
    return fmt_ci(*bootstrap_ci(v), spec) if v else "-"


def table(cs: dict) -> str:
    lines = [
        "| updates / rollout | target disagreement (σ) | arm | seeds | mismatch_kl [95% CI] "
        "| mismatch_f2 [95% CI] | mismatch_route | final held-out reward [95% CI] |",
        "|---:|---|---|---:|---|---|---:|---|",
    ]
    for (u, t), arms in cs.items():
        for arm, rs in arms.items():
            sigma = rs[0]["sigma"]
            route = _mean([run_mean(r, "mismatch_route") for r in rs])
            finals = [r["eval_final"] for r in rs if r["eval_final"] is not None]
            lines.append(
                f"| {u} | {t:g} ({sigma:.3g}) | {arm} | {len(rs)} "
                f"| {_ci([run_mean(r, 'mismatch_kl') for r in rs])} "
                f"| {_ci([run_mean(r, 'mismatch_f2') for r in rs])} | {route:.3g} "
                f"| {_ci(finals, '.3f')} |"
            )
    return "\n".join(lines) + "\n"


def _short(n_seeds: int, *groups) -> str:
    """ "" when every group has all ``n_seeds`` runs, else the words that mark a
    comparison preliminary: a verdict needs the whole grid."""
    have = min(len(g) for g in groups)
    return "" if have >= n_seeds else f"preliminary, {have} of {n_seeds} seeds: "


def decisions(cs: dict, n_seeds: int) -> list[str]:
    """The README's two rules per cell; a comparison whose arms lack some of the
    ``n_seeds`` planned seeds shows its numbers marked preliminary, and no verdict."""
    lines = ["### Rule 1: R3 removes the train–inference mismatch\n"]
    for u in sorted({u for u, _ in cs}):
        verdicts = []
        for (uu, t), arms in cs.items():
            if uu != u:
                continue
            if "grpo" not in arms or "grpo_r3" not in arms:
                lines.append(f"- {u} updates, target {t:g}: undecided (grpo or grpo_r3 missing).")
                verdicts.append(None)
                continue
            g = bootstrap_ci([run_mean(r, "mismatch_kl") for r in arms["grpo"]])
            r3 = bootstrap_ci([run_mean(r, "mismatch_kl") for r in arms["grpo_r3"]])
            short = _short(n_seeds, arms["grpo"], arms["grpo_r3"])
            ok = None if short else r3_removes(g, r3)
            verdicts.append(ok)
            ratio = g[0] / r3[0] if r3[0] > 0 else math.inf
            numbers = f"GRPO {fmt_ci(*g, '.3g')}, R3 {fmt_ci(*r3, '.3g')} (GRPO / R3 = {ratio:.3g})"
            if short:
                lines.append(f"- {u} updates, target {t:g}: {short}{numbers}.")
                continue
            lines.append(
                f"- {u} updates, target {t:g}: {numbers} → "
                + (
                    "≥ 10× below, intervals apart."
                    if ok
                    else "not ≥ 10× below with intervals apart."
                )
            )
        n_levels = len(verdicts)
        if n_levels >= 2 and all(v is True for v in verdicts):
            lines.append(f"- **{u} updates per rollout: R3 removes the mismatch** (both levels).")
        elif any(v is None for v in verdicts) or n_levels < 2:
            lines.append(
                f"- {u} updates per rollout: undecided (both noise levels, every seed, needed)."
            )
        else:
            lines.append(f"- {u} updates per rollout: R3 does **not** remove the mismatch.")
    lines.append("\n### Rule 2: TIS helps (final held-out reward, +TIS minus without)\n")
    for (u, t), arms in cs.items():
        for with_tis, without in (("grpo_tis", "grpo"), ("grpo_r3_tis", "grpo_r3")):
            if with_tis not in arms or without not in arms:
                continue
            a = [r["eval_final"] for r in arms[with_tis] if r["eval_final"] is not None]
            b = [r["eval_final"] for r in arms[without] if r["eval_final"] is not None]
            if not a or not b:
                continue
            d = bootstrap_diff_ci(a, b)
            head = f"- {u} updates, target {t:g}: {with_tis} − {without} = "
            short = _short(n_seeds, a, b)
            if short:
                lines.append(f"{head}{short}{fmt_ci(*d, '+.3f')}.")
                continue
            helps = d[1] > 0
            lines.append(
                f"{head}{fmt_ci(*d, '+.3f')} → "
                + ("**TIS helps**." if helps else "TIS does not help (interval not above 0).")
            )
    return lines


# --------------------------------------------------------------------------
# The figure and the report.


def figure(cs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(cs)
    order = [row[0] for row in stage4_config.ARMS]
    fig, axes = plt.subplots(
        2, len(keys), figsize=(3.4 * len(keys), 5.2), squeeze=False, sharex="col"
    )
    for j, (u, t) in enumerate(keys):
        for arm, rs in cs[(u, t)].items():
            color = f"C{order.index(arm)}" if arm in order else "k"
            for i, key in enumerate(("mismatch_kl", "mismatch_f2")):
                per_step: dict = collections.defaultdict(list)
                for r in rs:
                    for s, v in zip(r["steps"], r["series"].get(key, [])):
                        if v is not None:
                            per_step[s].append(float(v))
                steps = sorted(per_step)
                y = [np.mean(per_step[s]) for s in steps]
                axes[i][j].plot(steps, y, color=color, lw=1.0, label=f"{arm} ({len(rs)})")
        sigma = next(iter(cs[(u, t)].values()))[0]["sigma"]
        axes[0][j].set_title(f"{u} updates/rollout, target {t:g} (σ {sigma:.3g})", fontsize=8)
        for name, level, style in PAPER_KL:
            axes[0][j].axhline(level, color="0.4", ls=style, lw=0.9, label=name)
        for i, key in enumerate(("mismatch_kl", "mismatch_f2")):
            ax = axes[i][j]
            if any(np.any(np.asarray(line.get_ydata()) > 0) for line in ax.get_lines()):
                ax.set_yscale("log", nonpositive="mask")  # none positive: stays linear
            ax.set_ylabel(key, fontsize=8)
            ax.grid(alpha=0.3)
        axes[1][j].set_xlabel("RL step")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(
        "Train–inference mismatch per RL step (seed mean; log scale); grey: the R3 paper's "
        "KL without replay",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(out: str, n_seeds: int) -> None:
    runs = common.read_records(os.path.join(out, "runs"))
    if not runs:
        raise SystemExit(f"{out}/runs: no finished runs yet")
    cs = cells(runs)
    figure(cs, os.path.join(out, "mismatch.png"))
    calib = ""
    if os.path.exists(calibration_path(out)):
        with open(calibration_path(out)) as f:
            cal = json.load(f)
        calib = "Calibration ({} warm start, seed {}): {}.\n".format(
            cal["arm"],
            cal["seed"],
            "; ".join(
                f"target {r['target']:g} → σ {r['sigma']:.4g} (disagreement "
                f"{r['disagreement']:.4f}, {len(r['points'])} evaluations"
                + ("" if r["within_tol"] else ", NOT within tolerance")
                + ")"
                for r in cal["targets"]
            ),
        )
    text = [
        "# Stage 4: train–inference mismatch\n",
        f"{len(runs)} finished runs; lr {', '.join(sorted({format(r['lr'], 'g') for r in runs}))}.",
        calib,
        "Per run: the mean over its RL steps of mismatch_kl (k3 estimate of "
        "KL(π_sampler‖π_old)), mismatch_f2 (share of tokens with π_old/π_sampler outside "
        "[1/2, 2]) and mismatch_route (routing disagreement); final held-out reward: the "
        "mean of its last two evaluations. Seed means with 95% bootstrap intervals.\n",
        table(cs),
        "## Decision rules (README, Stage 4)\n",
        *decisions(cs, n_seeds),
    ]
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    print(f"stage 4 report: {len(runs)} runs -> {out}")
