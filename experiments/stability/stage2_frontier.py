"""Stage 2 of the stability study: the stability frontier (experiments/stability/README.md).

MoE and its dense twin × {GRPO, GRPO with a dual clip, GSPO at the calibrated range}
× learning rates × seeds, 16 updates per rollout, router losses off. Each run resumes
from its own checkpoints in ``<root>/stage2/<name>``; its compact summary (per-step
series, collapse step, final held-out reward) goes to ``<out>/runs/<name>.jsonl``
when it finishes, and a run with a summary is skipped.

    PYTHONPATH=. python experiments/stability/stage2_frontier.py --root runs/stability \
        --only-seeds 0 --max-minutes 55                                 # one chunk
    PYTHONPATH=. python experiments/stability/stage2_frontier.py --report

Stage 3's setting search (``--config ...stage2_config.py:search=<name>``) writes to
``results/stage2_search/<name>``; its report reads the setting rule per lr on the runs
so far, and ``--only-lrs`` runs just the lrs that are still open.
"""

from __future__ import annotations

import collections
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from experiments.stability import common  # noqa: E402

OUT = os.path.join(common.RESULTS, "stage2")


def stage_name(sc) -> str:
    """Where the grid's runs live under ``--root`` and its results under ``results/``:
    ``stage2``, or ``stage2_search/<fallback>`` for stage 3's setting search."""
    return f"stage2_search/{sc.search}" if sc.search else "stage2"


def overrides(sc, variant: str, lr: float) -> dict:
    """The config overrides of one arm of the grid."""
    lo, hi = sc.grpo_eps
    grpo = {"eps_low": float(lo), "eps_high": float(hi), "kl_coef": 0.0}
    objective = {
        "grpo": ("grpo", grpo),
        "grpo_dual": ("grpo", dict(grpo, dual_clip=float(sc.dual_clip))),
        "gspo": (
            "gspo",
            {"eps_low": float(sc.gspo_eps[0]), "eps_high": float(sc.gspo_eps[1]), "kl_coef": 0.0},
        ),
    }
    if variant not in objective:
        raise ValueError(f"variant {variant!r}: expected one of {sorted(objective)}")
    return {
        "objective": objective[variant],
        "optimizer.lr": float(lr),
        "updates.num_minibatches": int(sc.updates),
    }


def run_name(arm: str, variant: str, lr: float, seed: int) -> str:
    return f"{arm}_{variant}_lr{lr:g}_s{seed}"


def stage2_twin(sc, out: str, name: str, meta: dict) -> str | None:
    """The summary of stage 2's own run of ``name`` when a search's run is that very run
    (the same arm, variant, lr, seed, updates and task: dense2 in ``search=moe2k1``),
    so the search reuses it instead of training it again; None otherwise."""
    if not sc.search:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(out)), "stage2", "runs", name + ".jsonl")
    if not os.path.exists(path):
        return None
    from experiments.stability import stage2_config

    (summary,) = common.read_jsonl(path)
    base = stage2_config.get_config()  # stage 2's summaries predate `updates` and `task`
    summary = dict(dict(updates=int(base.updates), task=base.task), **summary)
    return path if all(summary[k] == v for k, v in meta.items()) else None


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    """Every run of the grid without a summary, seed by seed (a chunk that ends early
    leaves whole seeds), until the budget expires. Returns the number of runs done."""
    done = 0
    for seed in sc.seeds:
        for lr in sc.lrs:
            for arm in sc.arms:
                for variant in sc.variants:
                    name = run_name(arm, variant, lr, seed)
                    path = os.path.join(out, "runs", name + ".jsonl")
                    if os.path.exists(path):
                        continue
                    meta = dict(
                        arm=arm,
                        variant=variant,
                        lr=float(lr),
                        seed=int(seed),
                        updates=int(sc.updates),
                        task=sc.task,
                    )
                    twin = stage2_twin(sc, out, name, meta)
                    if twin is not None:
                        common.write_jsonl(path, common.read_jsonl(twin))
                        log(f"{name}: stage 2's run, reused ({twin})")
                        continue
                    if budget.expired():
                        return done
                    wd = common.run_rl(
                        root,
                        stage_name(sc),
                        name,
                        arm,
                        int(seed),
                        overrides(sc, variant, lr),
                        int(sc.steps),
                        smoke=sc.smoke,
                        task=sc.task,
                    )
                    summary = common.summarize_run(wd, meta)
                    common.write_jsonl(path, [summary])
                    log(
                        f"{name}: collapsed={summary['collapsed']} at {summary['collapse_step']}, "
                        f"held-out {summary['eval_start']} -> {summary['eval_final']}"
                    )
                    done += 1
    return done


# --------------------------------------------------------------------------
# Report.


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
            critical=common.critical_lr_ci(flags),
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
            f"MoE critical lr {common.fmt_ci(*moe['critical'], '.3g')}, dense "
            f"{common.fmt_ci(*dense['critical'], '.3g')}"
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
    from experiments.stability import stage3_replay

    moe_arm, dense_arm = sc.arms
    verdict, lr, status = stage3_replay.setting_verdict(
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
            ci = common.fmt_ci(*common.bootstrap_ci(f)) if f else "-"
            lines.append(
                f"| {arm} | {variant} | {lr:g} | {sum(flags)} / {len(flags)} | {ci} "
                f"| {sum(fell)} / {len(fell)} |"
            )
    return "\n".join(lines) + "\n"


def figures(runs: list[dict], fr: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {v: f"C{i}" for i, v in enumerate(sorted({k[1] for k in fr}))}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (arm, variant), d in fr.items():
        ls = "-" if arm.startswith("moe") else "--"
        lrs = list(d["flags"])
        p = [np.mean(d["flags"][lr]) for lr in lrs]
        axes[0].plot(lrs, p, ls, marker="o", color=colors[variant], label=f"{arm} {variant}")
        crit = d["critical"][0]
        if math.isfinite(crit):
            axes[0].axvline(crit, ls=ls, color=colors[variant], alpha=0.35)
        f = [
            common.bootstrap_ci(d["finals"][lr]) if d["finals"][lr] else (math.nan,) * 3
            for lr in lrs
        ]
        f = np.asarray(f)
        axes[1].errorbar(
            lrs,
            f[:, 0],
            yerr=[f[:, 0] - f[:, 1], f[:, 2] - f[:, 0]],
            fmt=ls,
            marker="o",
            color=colors[variant],
            capsize=2,
            label=f"{arm} {variant}",
        )
    axes[0].set_ylabel("P(collapse)")
    axes[1].set_ylabel("final held-out reward")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(
        "Stability frontier: MoE (solid) and dense twin (dashed); vertical lines: critical lr",
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


def main(argv=None) -> None:
    only = ("arms", "variants", "lrs", "seeds")
    args = common.stage_parser(__doc__, OUT, "stage2_config.py", only).parse_args(argv)
    sc = common.stage_config(args, only)
    if sc.search and args.out == OUT:
        args.out = os.path.join(common.RESULTS, stage_name(sc))
    if args.report:
        report(args.out, sc)
        return
    n = run_all(sc, args.root, args.out, common.Budget(args.max_minutes))
    print(f"stage 2: {n} runs finished into {args.out}")


if __name__ == "__main__":
    main()
