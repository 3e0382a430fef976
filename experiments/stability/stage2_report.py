"""Stage 2's table, figures and decision from the runs' summaries
(experiments/stability/README.md, "Stage 2"); made by

    python -m experiments.stability.stage2_frontier --report

The frontier (`frontier`) holds the numbers: per (arm, variant) and lr the collapse
flags, the final held-out rewards and the critical lr with its interval; the table,
the decision and the figures render it.
"""

from __future__ import annotations

import collections
import math
import os

import numpy as np

from experiments.stability import common, stage3_rules
from experiments.stability.stats import bootstrap_ci, critical_lr_ci, fmt_ci


def frontier(runs: list[dict]) -> dict:
    """Per (arm, variant): per lr the collapse flags and final rewards, the critical lr
    with its bootstrap interval."""
    by = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in runs:
        by[(r["arm"], r["variant"])][float(r["lr"])].append(r)
    out = {}
    for key, per_lr in sorted(by.items()):
        flags = {lr: [bool(r["collapsed"]) for r in rs] for lr, rs in sorted(per_lr.items())}
        finals = {
            lr: [r["eval_final"] for r in rs if r["eval_final"] is not None]
            for lr, rs in sorted(per_lr.items())
        }
        fell = {  # runs without both evaluations (None) are not counted
            lr: [f for f in map(held_out_fell, rs) if f is not None]
            for lr, rs in sorted(per_lr.items())
        }
        out[key] = dict(
            flags=flags,
            finals=finals,
            fell=fell,
            critical=critical_lr_ci(flags),
        )
    return out


# Descriptive, not part of the decision rule (added after stage 2's runs): a run whose
# training reward settles on a low plateau above 0.3x its peak is no collapse to the
# detector, though its held-out reward may fall as far (moe2 GRPO, lr 1e-3, seed 1).
HELD_OUT_FELL = 0.3


def held_out_fell(run: dict) -> bool | None:
    """Final held-out reward below `HELD_OUT_FELL` x the warm start's (None: unknown)."""
    start, final = run.get("eval_start"), run.get("eval_final")
    if start is None or final is None:
        return None
    return final < HELD_OUT_FELL * start


def decide(fr: dict, sc) -> list[str]:
    """The README's rule: MoE-specific iff the MoE's interval lies below the dense one's.
    An objective whose grid (every lr × every seed of ``sc``, both architectures) is
    not complete gets its numbers marked preliminary, not a verdict."""
    lines = []
    moe_arm, dense_arm = sc.arms
    for v in sc.variants:
        moe, dense = fr.get((moe_arm, v)), fr.get((dense_arm, v))
        if moe is None or dense is None:
            lines.append(f"- {v}: undecided (an architecture has no runs).")
            continue
        numbers = (
            f"MoE critical lr {fmt_ci(*moe['critical'], '.3g')}, dense "
            f"{fmt_ci(*dense['critical'], '.3g')}"
        )
        runs = sum(len(f) for d in (moe, dense) for f in d["flags"].values())
        full = 2 * len(sc.lrs) * len(common.planned_seeds(sc))
        if runs < full:
            lines.append(f"- {v}: preliminary, {runs} of {full} runs: {numbers}.")
            continue
        specific = moe["critical"][2] < dense["critical"][1]
        lines.append(
            f"- {v}: {numbers} → "
            + ("**MoE-specific collapse**." if specific else "not MoE-specific at this scale.")
        )
    return lines


def setting(runs: list[dict], sc) -> list[str]:
    """Stage 3's setting rule on this grid's GRPO runs, read before the grid is
    finished: each lr qualifies, cannot qualify whatever its missing runs show, or is
    open."""
    moe_arm, dense_arm = sc.arms
    verdict, lr, status = stage3_rules.setting_verdict(
        runs, sc.lrs, len(common.planned_seeds(sc)), moe_arm, dense_arm
    )
    lines = [f"- lr {x:g}: {st}" for x, st in status.items()]
    if verdict == "found":
        lines.append(f"\n**Setting: lr {lr:g}** ({moe_arm} GRPO collapses, {dense_arm} does not).")
    elif verdict == "none":
        lines.append(
            f"\n**No lr qualifies** for {moe_arm} against {dense_arm}, whatever the "
            "missing runs show."
        )
    else:
        lines.append(f"\n**Open:** lr {lr:g} can still qualify or fail; it needs more runs.")
    return lines


def table(fr: dict) -> str:
    lines = [
        "| arm | variant | lr | collapsed / runs | final held-out reward [95% CI] "
        f"| held-out fell below {HELD_OUT_FELL:g}× its start (descriptive) |",
        "|---|---|---:|---:|---|---:|",
    ]
    for (arm, variant), d in fr.items():
        for lr, flags in d["flags"].items():
            f, fell = d["finals"][lr], d["fell"][lr]
            ci = fmt_ci(*bootstrap_ci(f)) if f else "-"
            lines.append(
                f"| {arm} | {variant} | {lr:g} | {sum(flags)} / {len(flags)} | {ci} "
                f"| {sum(fell)} / {len(fell)} |"
            )
    return "\n".join(lines) + "\n"


def figures(runs: list[dict], fr: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One column per objective, MoE beside its dense twin: the collapse rate with each
    # point's count (k/n) on top, the final held-out reward below. The two architectures
    # are drawn a little apart on the lr axis so that equal rates do not hide each other.
    variants = sorted({k[1] for k in fr})
    fig, axes = plt.subplots(
        2, len(variants), figsize=(3.6 * len(variants), 6.0), squeeze=False, sharey="row"
    )
    style = {
        True: dict(color="C0", ls="-", marker="o"),
        False: dict(color="C2", ls="--", marker="s"),
    }
    for (arm, variant), d in fr.items():
        moe = arm.startswith("moe")
        st = style[moe]
        col = variants.index(variant)
        shift = 0.93 if moe else 1.07
        lrs = list(d["flags"])
        x = [lr * shift for lr in lrs]
        hits = [int(np.sum(d["flags"][lr])) for lr in lrs]
        n = [len(d["flags"][lr]) for lr in lrs]
        ax = axes[0][col]
        ax.plot(x, [h / k for h, k in zip(hits, n)], ms=6, label=arm, **st)
        for xi, h, k in zip(x, hits, n):
            y = h / k
            ax.annotate(
                f"{h}/{k}",
                (xi, y),
                textcoords="offset points",
                xytext=(0, 7 if moe else -13),
                ha="center",
                fontsize=7,
                color=st["color"],
            )
        crit = d["critical"][0]
        if math.isfinite(crit):
            ax.axvline(crit, color=st["color"], ls=st["ls"], lw=1, alpha=0.5)
        f = [bootstrap_ci(d["finals"][lr]) if d["finals"][lr] else (math.nan,) * 3 for lr in lrs]
        f = np.asarray(f)
        axes[1][col].errorbar(
            x, f[:, 0], yerr=[f[:, 0] - f[:, 1], f[:, 2] - f[:, 0]], capsize=2, label=arm, **st
        )
    for col, v in enumerate(variants):
        axes[0][col].set_title(v, fontsize=10)
        axes[0][col].set_ylim(-0.15, 1.15)
        axes[1][col].set_xlabel("learning rate")
        for ax in axes[:, col]:
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("P(collapse) (runs collapsed / seeds)")
    axes[1][0].set_ylabel("final held-out reward\n(seed mean, 95% bootstrap interval)")
    fig.suptitle(
        "Stability frontier: MoE (blue, solid) and dense twin (green, dashed), drawn slightly "
        "apart in lr; vertical lines: critical lr",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "frontier.png"), dpi=110)
    plt.close(fig)

    # Training-reward curves, one panel per (variant, lr), a line per run.
    keys = sorted({(r["variant"], float(r["lr"])) for r in runs})
    variants = sorted({k[0] for k in keys})
    lrs = sorted({k[1] for k in keys})
    fig, axes = plt.subplots(
        len(variants),
        len(lrs),
        figsize=(3.2 * len(lrs), 2.6 * len(variants)),
        squeeze=False,
        sharey=True,
    )
    for r in runs:
        ax = axes[variants.index(r["variant"])][lrs.index(float(r["lr"]))]
        y = r["series"].get("reward_mean", [])
        ax.plot(
            r["steps"][: len(y)],
            y,
            "-" if r["arm"].startswith("moe") else "--",
            color="C0" if r["arm"].startswith("moe") else "C2",
            lw=0.9,
        )
        if r["collapse_step"] is not None:
            ax.axvline(r["collapse_step"], color="C3", lw=0.6, alpha=0.5)
    for i, v in enumerate(variants):
        for j, lr in enumerate(lrs):
            axes[i][j].set_title(f"{v}, lr {lr:g}", fontsize=8)
            axes[i][j].grid(alpha=0.3)
    fig.suptitle(
        "Training reward per run: MoE (blue, solid), dense (green, dashed); red: detected collapse",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=100)
    plt.close(fig)


def report(out: str, sc) -> None:
    runs = common.read_records(os.path.join(out, "runs"))
    if not runs:
        raise SystemExit(f"{out}/runs: no finished runs yet")
    fr = frontier(runs)
    figures(runs, fr, out)
    title = (
        f"Stage 3's setting search: {sc.search}" if sc.search else "Stage 2: the stability frontier"
    )
    text = [
        f"# {title}\n",
        f"{len(runs)} finished runs; arms {', '.join(sc.arms)}, {sc.updates} updates per rollout.\n",
        table(fr),
    ]
    text += ["\n## Decision (README, Stage 2)\n"] + decide(fr, sc)
    text += ["\n## Stage 3's setting (README, Stage 3)\n"] + setting(runs, sc)
    with open(os.path.join(out, "frontier.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    print(f"stage 2 report: {len(runs)} runs -> {out}")
