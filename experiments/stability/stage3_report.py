"""Stage 3's tables and figures from the runs' summaries, read by the rules of
`stage3_rules` (experiments/stability/README.md, "Stage 3"); made by

    python -m experiments.stability.stage3_replay --report

`arm_rows`, `precursor_rows`, `step_rows` and `matched_rows` hold the numbers of each
table; the tables render them.
"""

from __future__ import annotations

import collections
import math
import os

import numpy as np

from experiments.stability import common, stage3_config
from experiments.stability.stage3_rules import (
    BASELINE_STEPS,
    KL_KEY,
    PRECURSORS,
    Precursor,
    baseline,
    collapses,
    finite,
    first_step,
    matched_verdict,
    precursor_stats,
    preliminary,
    prevents_collapse,
)
from experiments.stability.stats import bootstrap_ci, fmt_ci

# --------------------------------------------------------------------------
# Tables.


def arm_order(runs: list[dict]) -> list[str]:
    known = [row[0] for row in stage3_config.ARMS] + list(stage3_config.DENSE_ARMS)
    present = {r["arm"] for r in runs}
    return [a for a in known if a in present] + sorted(present - set(known))


def by_arm(runs: list[dict]) -> dict[str, list[dict]]:
    out = collections.defaultdict(list)
    for r in runs:
        out[r["arm"]].append(r)
    return {a: sorted(out[a], key=lambda r: r["seed"]) for a in arm_order(runs)}


def eval_curve(run: dict) -> dict[int, float]:
    """Held-out reward by RL step, the warm start's (step 0) included."""
    curve = {}
    if run.get("eval_start") is not None:
        curve[0] = float(run["eval_start"])
    for s, v in zip(run["steps"], run["series"].get("eval_reward_mean", [])):
        if v is not None:
            curve[int(s)] = float(v)
    return curve


def arm_rows(groups: dict[str, list[dict]]) -> list[dict]:
    """The numbers of the decision rule's table, a dict per arm: its ``collapsed`` runs
    of ``seeds``, the arm it is read ``against`` (GRPO on the MoE; a dense-twin control
    such as ``gmpo_dense``: GRPO on the dense twin), the one-sided Fisher ``p``, whether
    it ``prevents`` the collapse and the ``preliminary`` mark before every planned seed
    is in (all None for the arm read against itself), the ``median_update`` of its
    collapses (RL step × updates per rollout) and its ``final`` held-out reward's
    (mean, lower, upper) bootstrap interval (None without runs)."""
    rows = []
    for arm, rs in groups.items():
        hits, n = collapses(rs), len(rs)
        control = arm in stage3_config.DENSE_ARMS and arm != stage3_config.DENSE_REFERENCE
        against = stage3_config.DENSE_REFERENCE if control else "grpo"
        ref = groups.get(against)
        row = dict(arm=arm, collapsed=hits, seeds=n, against=None, p=None, prevents=None)
        row["preliminary"] = None
        if ref is not None and arm != against:
            p, yes = prevents_collapse(hits, n, collapses(ref), len(ref))
            planned = max(r.get("seeds", 0) for r in rs + ref)
            row.update(against=against, p=p, prevents=yes)
            row["preliminary"] = preliminary(n, len(ref), planned)
        upd = [r["collapse_step"] * r["updates"] for r in rs if r["collapsed"]]
        row["median_update"] = np.median(upd) if upd else None
        finals = [r["eval_final"] for r in rs if r["eval_final"] is not None]
        row["final"] = bootstrap_ci(finals) if finals else None
        rows.append(row)
    return rows


def table(groups: dict[str, list[dict]]) -> str:
    """The decision rule's table (`arm_rows`); the dense reference is only shown."""
    lines = [
        "| arm | collapsed / seeds | one-sided Fisher p vs GRPO | prevents the collapse "
        "| median collapse update | final held-out reward [95% CI] |",
        "|---|---:|---:|---|---:|---|",
    ]
    for row in arm_rows(groups):
        arm = row["arm"]
        if row["p"] is None:
            p_txt, dec = "-", "-"
        else:
            p_txt = f"{row['p']:.3g}"
            dec = row["preliminary"] or ("**yes**" if row["prevents"] else "no")
            if row["against"] != "grpo":  # a control on the dense twin
                p_txt, dec = f"{p_txt} (vs {row['against']})", f"{dec} (on the dense twin)"
            if arm == stage3_config.DENSE_REFERENCE:  # the dense twin: not an arm of the rule
                dec = "(dense reference)"
        med = "-" if row["median_update"] is None else f"{row['median_update']:g}"
        ci = "-" if row["final"] is None else fmt_ci(*row["final"])
        lines.append(
            f"| {arm} | {row['collapsed']} / {row['seeds']} | {p_txt} | {dec} | {med} | {ci} |"
        )
    return "\n".join(lines) + "\n"


def fmt_precursor(st: dict) -> str:
    """``+4 [1, 9] (5/5); FA 1/3``: median lead [range] (crossed / collapsed runs); false
    alarms / runs that did not collapse."""
    if st["collapsed"] == 0 and st["not_collapsed"] == 0:
        return "n/a"
    if st["leads"]:
        lo, hi = st["range"]
        lead = f"{st['median']:+g} [{lo:+d}, {hi:+d}] ({st['crossed']}/{st['collapsed']})"
    else:
        lead = f"- ({st['crossed']}/{st['collapsed']})"
    fa = f"{st['false_alarms']}/{st['not_collapsed']}" if st["not_collapsed"] else "-"
    return f"{lead}; FA {fa}"


def precursor_rows(groups: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    """The numbers of the precursor table: per row (each arm, all arms, and all arms
    keeping only the collapses after the baseline's window) `precursor_stats` by
    precursor label."""
    everything = [r for rs in groups.values() for r in rs]
    # A collapse inside the baseline window drags the baseline itself down (a collapsed
    # run's series fall to 0), so its lead times are artefacts; the last row keeps the
    # collapses after the window and every run that did not collapse.
    clean = [r for r in everything if not r["collapsed"] or r["collapse_step"] > BASELINE_STEPS]
    late = f"all arms, collapses after step {BASELINE_STEPS}"
    return {
        arm: {p.label: precursor_stats(rs, p) for p in PRECURSORS}
        for arm, rs in list(groups.items()) + [("all arms", everything), (late, clean)]
    }


def precursor_table(groups: dict[str, list[dict]]) -> str:
    head = "| arm | " + " | ".join(p.label for p in PRECURSORS) + " |"
    lines = [head, "|---|" + "---|" * len(PRECURSORS)]
    for arm, per in precursor_rows(groups).items():
        cells = [fmt_precursor(st) for st in per.values()]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def step_rows(groups: dict[str, list[dict]]) -> list[dict]:
    """The numbers of the step table, a dict per arm: its ``seeds``, and over the seeds
    that logged them its first-rollout ``kl`` (``ppo_kl``) and ``f2`` (F(τ=2)) at the
    rollout's last update, and ``ratio``, KL over GRPO's on the MoE on the same seed."""
    grpo = {r["seed"]: first_step(r, KL_KEY) for r in groups.get("grpo", [])}
    rows = []
    for arm, rs in groups.items():
        kl = [first_step(r, KL_KEY) for r in rs]
        f2 = [first_step(r, "frac_ratio_gt_2_klast") for r in rs]
        ratio = [
            k / grpo[r["seed"]]
            for k, r in zip(kl, rs)
            if k is not None and grpo.get(r["seed"]) not in (None, 0.0)
        ]
        present = lambda xs: [x for x in xs if x is not None]  # noqa: E731
        rows.append(dict(arm=arm, seeds=len(rs), kl=present(kl), f2=present(f2), ratio=ratio))
    return rows


def step_taken_table(groups: dict[str, list[dict]]) -> str:
    """How far each arm moves the policy on its first rollout (`step_rows`): medians
    [range] over seeds. Descriptive: no rule reads it."""
    lines = [
        "| arm | seeds | KL after the first rollout [range] | F(τ=2) [range] "
        "| KL / MoE GRPO's, same seed [range] |",
        "|---|---:|---|---|---|",
    ]

    def cell(xs):
        if not xs:
            return "-"
        return f"{np.median(xs):.3g} [{min(xs):.3g}, {max(xs):.3g}]"

    for row in step_rows(groups):
        lines.append(
            f"| {row['arm']} | {row['seeds']} | {cell(row['kl'])} | {cell(row['f2'])} "
            f"| {cell(row['ratio'])} |"
        )
    return "\n".join(lines) + "\n"


def matched_table(groups: dict[str, list[dict]], controls: dict[str, list[dict]]) -> str:
    """Each KL-matched control with its lr, its first-rollout KL as a ratio to its
    target's on the same seed, and its final held-out reward, read by its rule (README,
    Stage 3): GRPO matched to another arm against each arm that prevented the collapse
    (`matched_verdict`); any other objective against GRPO by the stage's rule."""
    lines = [
        "| control | lr | collapsed / seeds | against | its collapses | one-sided Fisher p "
        "| verdict | first-rollout KL / target's, same seed [range] | final held-out [95% CI] |",
        "|---|---:|---:|---|---:|---:|---|---|---|",
    ]
    grpo = groups.get("grpo", [])
    prevented = [
        a
        for a, rs in groups.items()
        if a != "grpo"
        and a not in stage3_config.DENSE_ARMS
        and prevents_collapse(collapses(rs), len(rs), collapses(grpo), len(grpo))[1]
    ]
    for name, rs in controls.items():
        objective, target_arm = stage3_config.KL_MATCHED[name]
        target = {r["seed"]: first_step(r, KL_KEY) for r in groups.get(target_arm, [])}
        ratio = [
            first_step(r, KL_KEY) / target[r["seed"]]
            for r in rs
            if first_step(r, KL_KEY) is not None and target.get(r["seed"])
        ]
        ratio_txt = f"{np.median(ratio):.3g} [{min(ratio):.3g}, {max(ratio):.3g}]" if ratio else "-"
        hits, n = collapses(rs), len(rs)
        finals = [r["eval_final"] for r in rs if r["eval_final"] is not None]
        ci = fmt_ci(*bootstrap_ci(finals)) if finals else "-"
        lrs = ", ".join(sorted({f"{r['lr']:.3g}" for r in rs}))
        planned = max(r.get("seeds", 0) for r in rs)
        against = prevented if objective == "grpo" else ["grpo"]
        for arm in against or ["-"]:
            ars = groups.get(arm, [])
            a_hits = collapses(ars)
            if not ars:
                p_txt, verdict = "-", "- (no arm prevented the collapse)"
            elif objective == "grpo":
                p, verdict = matched_verdict(hits, n, a_hits, len(ars), planned)
                p_txt = f"{p:.3g}"
            else:
                p, yes = prevents_collapse(hits, n, a_hits, len(ars))
                p_txt = f"{p:.3g}"
                verdict = preliminary(n, len(ars), planned) or (
                    "**prevents the collapse at a matched step**" if yes else "no"
                )
            lines.append(
                f"| {name} | {lrs} | {hits} / {n} | {arm} | {a_hits} / {len(ars)} | {p_txt} "
                f"| {verdict} | {ratio_txt} | {ci} |"
            )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Figures.


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _reference(groups: dict[str, list[dict]], arm: str) -> str | None:
    """The arm a panel of ``arm`` is drawn against: GRPO on the dense twin for a dense
    arm, GRPO on the MoE otherwise; None for the reference itself or without one."""
    ref = stage3_config.DENSE_REFERENCE if arm in stage3_config.DENSE_ARMS else "grpo"
    if arm == ref or ref not in groups:
        ref = "grpo" if arm != "grpo" and "grpo" in groups else None
    return ref


def fig_reward_vs_updates(groups: dict[str, list[dict]], path: str, title: str = "") -> None:
    """Small multiples, one panel per arm: each seed's held-out reward (thin) and the seed
    mean (thick) against optimizer updates, beside the mean of its reference arm (GRPO;
    dense GRPO for a dense arm) in grey, and the warm starts' mean as a dotted line."""
    plt = _plt()
    arms = [a for a, rs in groups.items() if any(eval_curve(r) for r in rs)]
    if not arms:
        return
    cols = min(4, len(arms))
    rows = math.ceil(len(arms) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.3 * cols, 2.6 * rows), squeeze=False, sharex=True, sharey=True
    )

    def mean_curve(rs):
        curves = [eval_curve(r) for r in rs]
        steps = sorted({s for c in curves for s in c})
        y = [np.mean([c[s] for c in curves if s in c]) for s in steps]
        return np.asarray(steps) * rs[0]["updates"], np.asarray(y)

    starts = [r["eval_start"] for rs in groups.values() for r in rs if r.get("eval_start")]
    for j, arm in enumerate(arms):
        ax = axes[j // cols][j % cols]
        rs = groups[arm]
        ref = _reference(groups, arm)
        if ref is not None:
            ax.plot(*mean_curve(groups[ref]), color="0.55", lw=2, label=f"{ref} (mean)")
        for r in rs:
            c = eval_curve(r)
            steps = sorted(c)
            ax.plot(
                np.asarray(steps) * r["updates"],
                [c[s] for s in steps],
                color="C0",
                lw=0.7,
                alpha=0.6,
            )
        hits = collapses(rs)
        ax.plot(*mean_curve(rs), color="C0", lw=2.2, label=f"{arm} (mean)")
        if starts:
            ax.axhline(np.mean(starts), color="k", ls=":", lw=0.8)
        ax.set_title(f"{arm}: {hits}/{len(rs)} collapsed", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper right")
    for j in range(len(arms), rows * cols):
        axes[j // cols][j % cols].axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("optimizer updates", fontsize=8)
    for row in axes:
        row[0].set_ylabel("held-out reward", fontsize=8)
    fig.suptitle(
        title + "Held-out reward per seed (thin) and seed mean (thick), beside GRPO's mean "
        "(grey); dotted: the warm starts' mean",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def aligned(run: dict, p: Precursor):
    """(steps relative to the collapse, the series relative to its baseline: ratio, or
    difference for "below_minus"); None without a collapse, series or baseline."""
    values = run["series"].get(p.key)
    if not run["collapsed"] or values is None:
        return None
    base = baseline(run["steps"], values)
    if base is None:
        return None
    pts = [(s, float(v)) for s, v in zip(run["steps"], values) if finite(v)]
    x = np.asarray([s - run["collapse_step"] for s, _ in pts], np.float64)
    v = np.asarray([v for _, v in pts], np.float64)
    if p.rule == "below_minus":
        return x, v - base
    with np.errstate(divide="ignore", invalid="ignore"):
        return x, v / base if base != 0 else np.full_like(v, np.nan)


# The precursor figure's window and floor: RL steps around the collapse, and the ratio
# drawn for a value of 0 (log axis).
PRECURSOR_WINDOW = (-40, 15)
RATIO_FLOOR = 1e-2


def late_collapses(groups: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], int]:
    """({arm: its collapsed runs whose collapse comes after the baseline's window}, the
    number of collapses inside the window): the runs `fig_precursors` draws, and those
    it leaves out because their baseline already holds the collapse."""
    late = {
        a: [r for r in rs if r["collapsed"] and r["collapse_step"] > BASELINE_STEPS]
        for a, rs in groups.items()
    }
    n_early = sum(
        bool(r["collapsed"]) and r["collapse_step"] <= BASELINE_STEPS
        for rs in groups.values()
        for r in rs
    )
    return late, n_early


def fig_precursors(groups: dict[str, list[dict]], path: str) -> None:
    """Each precursor against RL steps relative to the collapse, for the collapsed runs
    whose collapse comes after the baseline's window (the only ones whose baseline does
    not already hold the collapse), one line per run, coloured by arm; ratios below
    `RATIO_FLOOR` (a value of 0) are drawn at it."""
    plt = _plt()
    cols = 4
    rows = math.ceil(len(PRECURSORS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    colors = {arm: f"C{i}" for i, arm in enumerate(groups)}
    late, n_early = late_collapses(groups)
    drawn = set()
    lo, hi = PRECURSOR_WINDOW
    for j, p in enumerate(PRECURSORS):
        ax = axes[j // cols][j % cols]
        n = 0
        for arm, rs in late.items():
            for r in rs:
                xy = aligned(r, p)
                if xy is None:
                    continue
                x, v = xy
                keep = (x >= lo) & (x <= hi)
                x, v = x[keep], v[keep]
                if p.rule != "below_minus":
                    v = np.where(np.isfinite(v), np.maximum(v, RATIO_FLOOR), np.nan)
                ax.plot(x, v, lw=1.1, color=colors[arm], label=None if arm in drawn else arm)
                drawn.add(arm)
                n += 1
        ax.axvline(0, color="k", lw=0.8)
        ax.axvspan(lo, 0, color="0.9", zorder=0)
        if p.rule == "below_minus":
            ax.axhline(-p.lo, color="C3", ls="--", lw=1)
            ax.set_ylabel("value − baseline", fontsize=8)
        else:
            for t in (p.lo, p.hi):
                if t is not None:
                    ax.axhline(t, color="C3", ls="--", lw=1)
            ax.set_ylabel("value / baseline", fontsize=8)
            if n:
                ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_title(f"{p.label} ({n} runs)", fontsize=9)
        ax.set_xlabel("RL steps from the collapse", fontsize=8)
        ax.grid(alpha=0.3)
        if not n:
            ax.text(0.5, 0.5, "no late collapse", ha="center", va="center", transform=ax.transAxes)
    for j in range(len(PRECURSORS), rows * cols):
        axes[j // cols][j % cols].axis("off")
    if drawn:
        handles = {}
        for ax in axes.flat:
            for h, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, h)
        axes[-1][-1].legend(handles.values(), handles.keys(), fontsize=8, loc="center", title="arm")
    fig.suptitle(
        f"Precursors before the collapses after RL step {BASELINE_STEPS} (baseline: median of "
        f"steps 1..{BASELINE_STEPS}; red dashed: thresholds; grey: before the collapse). "
        f"{n_early} collapses at or before step {BASELINE_STEPS} are left out: their baseline "
        "holds the collapse.",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------
# The report.


def report(out: str) -> None:
    runs = common.read_records(os.path.join(out, "runs"))
    if not runs:
        raise SystemExit(f"{out}/runs: no finished runs yet")
    groups = by_arm(runs)
    # The KL-matched controls stay out of the rule's table, the precursors and the
    # figures: they have their own section and rule.
    controls = {a: groups.pop(a) for a in list(groups) if a in stage3_config.KL_MATCHED}
    runs = [r for rs in groups.values() for r in rs]
    fig_reward_vs_updates(groups, os.path.join(out, "reward_vs_updates.png"))
    fig_precursors(groups, os.path.join(out, "precursors.png"))
    settings = sorted(
        {
            (r["setting"], r["lr"], r["updates"], r.get("task", "small"), r.get("dtype", "float32"))
            for r in runs
        }
    )
    setting = "; ".join(
        f"{s}, lr {lr:g}, {u} updates per rollout, task {task}, {dtype} compute"
        for s, lr, u, task, dtype in settings
    )
    text = [
        "# Stage 3: replay and the router-aware objectives\n",
        f"Setting: {setting}. {len(runs)} finished runs"
        + (
            f", and {sum(map(len, controls.values()))} of the KL-matched controls"
            if controls
            else ""
        )
        + ".\n",
        "## Collapses (README, Stage 3, decision rule)\n",
        "An arm prevents the collapse if its collapse count is below GRPO's with one-sided "
        "Fisher exact p < 0.05. Collapse update: the collapse's RL step × updates per "
        "rollout. Final held-out reward: the mean of a run's last two evaluations; seed "
        "mean with its 95% bootstrap interval.\n",
        table(groups),
        "## Precursors\n",
        "Per precursor: median lead time in RL steps (collapse step minus the first step "
        "past the threshold; negative: after the collapse) [range] over the collapsed runs "
        "in which it crossed (crossed / collapsed); FA: the runs that did not collapse in "
        f"which it crossed anyway. Baseline: the median over RL steps 1..{BASELINE_STEPS}; "
        "thresholds: F(τ=2), free flips, clip fraction, grad norm and KL above 3× it, raw "
        "γ below it minus 0.1, entropy below 0.5× or above 2× it. A collapse within the "
        "first steps falls inside the baseline's window and drags the baseline down, so "
        "its lead times are not meaningful; the last row keeps only the collapses after "
        f"step {BASELINE_STEPS} (and every run that did not collapse).\n",
        precursor_table(groups),
        "## The step each arm takes\n",
        "Every arm of a seed starts from the same warm start and takes its first rollout's "
        "updates on the same batch, so the first rollout shows how far each objective "
        "moves the policy at this lr: KL(π_old‖π_θ) and F(τ=2) measured at the rollout's "
        "last update (`ppo_kl_klast`, `frac_ratio_gt_2_klast` at RL step 1), median over "
        "seeds, and KL's ratio to GRPO's on the MoE on the same seed (for the dense arms "
        "too). An arm that avoids the collapse "
        "while moving much less than GRPO may owe it to the smaller step, not to its "
        "objective's form. Descriptive: no decision rule reads this table.\n",
        step_taken_table(groups),
    ]
    if controls:
        # Each control beside the arms it is read against or matched to.
        near = {a for pair in stage3_config.KL_MATCHED.values() for a in pair}
        beside = {a: rs for a, rs in groups.items() if a in near}
        fig_reward_vs_updates(
            {**beside, **controls},
            os.path.join(out, "kl_matched.png"),
            title="KL-matched controls (after the arms they are matched to). ",
        )
        text += [
            "## The KL-matched controls (README, Stage 3)\n",
            "An objective on the MoE at the lr at which its first-rollout KL matches another "
            "arm's (`kl_matched_lr`: stage 2's grid of the objective, seed medians, "
            "interpolated in log KL against log lr). GRPO matched to GMPO is read against "
            "each arm that prevented the collapse: the smaller step does not explain an "
            "arm's protection if the control collapses more often with one-sided Fisher "
            "p < 0.05; it can explain it if the control collapses in at most 1 of 5 seeds; "
            "otherwise inconclusive. GSPO and SAPO matched to GRPO are read against GRPO by the "
            "stage's rule (fewer collapses, p < 0.05). Figure: `kl_matched.png`.\n",
            matched_table(groups, controls),
        ]
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(text))
    print(f"stage 3 report: {len(runs)} runs -> {out}")
