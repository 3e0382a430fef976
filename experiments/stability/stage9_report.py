"""Stage 9's report (experiments/stability/README.md, "Stage 9"): the event definitions,
the pilot's rule, the log-rank comparisons with Holm's correction, their sensitivity
to the definition, Kaplan-Meier figures, and stage 5's runs read the same way (post
hoc). Every rule here was committed before the stage's first run."""

from __future__ import annotations

import math
import os

import numpy as np

from experiments.stability import common, hazard, stage9_config, stats
from experiments.stability.corrections_567 import holm

ALPHA = 0.05

# --------------------------------------------------------------------------
# The events. Each takes a run's summary and gives (time, observed): the RL step of
# the event's onset, or the last step at which its horizon could confirm one (censored).


def _series(summary: dict, key: str) -> np.ndarray:
    x = summary["series"].get(key)
    if x is None or any(v is None for v in x):
        raise ValueError(
            f"{summary.get('arm')}/{summary.get('seed')}: series {key!r} missing or incomplete"
        )
    return np.asarray(x, np.float64)


def _onset(summary: dict, flags: np.ndarray, patience: int) -> tuple[int, bool]:
    steps = summary["steps"]
    if len(steps) < patience:  # no onset confirmable (a smoke run): censored at 0
        return 0, False
    t = hazard.first_sustained(flags, patience)
    if t is None:
        return int(steps[len(steps) - patience]), False
    return int(steps[t]), True


def primary_event(
    summary: dict, frac: float | None = None, window: int | None = None
) -> tuple[int, bool]:
    """A sustained fall below the warm start (`stage9_config.PRIMARY`): the trailing
    ``window``-step mean of the training reward below ``frac`` times the reward of the
    warm start's own rollout (RL step 1) for ``window`` consecutive steps."""
    frac = stage9_config.PRIMARY["frac"] if frac is None else frac
    window = stage9_config.PRIMARY["window"] if window is None else window
    reward = _series(summary, "reward_mean")
    if summary["steps"][0] != 1:
        raise ValueError(f"the run's first recorded RL step is {summary['steps'][0]}, not 1")
    m = stats.moving_average(reward, window)
    return _onset(summary, m < frac * reward[0], window)


def detector_event(summary: dict, frac: float) -> tuple[int, bool]:
    """Stage 2's detector (`stats.collapse_step`: trailing 3-step mean below ``frac``
    of its running peak for 5 steps, peak >= 0.1)."""
    reward = _series(summary, "reward_mean")
    t = stats.collapse_step(reward, frac=frac)
    steps = summary["steps"]
    if t is not None:
        return int(steps[t]), True
    return (int(steps[len(steps) - 5]), False) if len(steps) >= 5 else (0, False)


def kl_event(summary: dict, kappa: float, window: int = 10) -> tuple[int, bool]:
    """A KL blow-up: the trailing ``window``-step mean of ``ppo_kl_klast`` above
    ``kappa`` for ``window`` consecutive steps."""
    m = stats.moving_average(_series(summary, "ppo_kl_klast"), window)
    return _onset(summary, m > kappa, window)


def definitions() -> list[tuple[str, str, object]]:
    """(name, family, event function): the primary first, then its sensitivity grid,
    stage 2's detector and the KL blow-up."""
    p = stage9_config.PRIMARY
    out = [
        (
            f"below {p['frac']:g} x warm start, window {p['window']} (primary)",
            "reward",
            primary_event,
        )
    ]
    for frac in stage9_config.SENSITIVITY_FRACS:
        for window in stage9_config.SENSITIVITY_WINDOWS:
            if (frac, window) != (p["frac"], p["window"]):
                out.append(
                    (
                        f"below {frac:g} x warm start, window {window}",
                        "reward",
                        lambda s, f=frac, w=window: primary_event(s, f, w),
                    )
                )
    for frac in stage9_config.STAGE2_DETECTOR_FRACS:
        out.append(
            (
                f"stage 2's detector at {frac:g} of the peak",
                "detector",
                lambda s, f=frac: detector_event(s, f),
            )
        )
    for kappa in stage9_config.KL_KAPPAS:
        out.append(
            (f"KL after the last update > {kappa:g}", "kl", lambda s, k=kappa: kl_event(s, k))
        )
    return out


# --------------------------------------------------------------------------
# The pilot's rule and the comparisons.


def pilot_choice(sc, runs: list[dict]) -> float | None:
    """The rate the pilot's rule picks, or None while its runs are missing: the lower
    candidate if at least ``min_events`` of its runs have the primary event, otherwise
    the higher (the last candidate) once its runs are in."""
    p = sc.pilot
    for i, lr in enumerate(p.lrs):
        mine = [r for r in runs if math.isclose(r["lr"], lr) and r["seed"] in p.seeds]
        if len(mine) < len(p.seeds):
            return None
        if sum(primary_event(r)[1] for r in mine) >= p.min_events or i == len(p.lrs) - 1:
            return float(lr)
    return None


def cell_runs(runs: list[dict], arm: str, variant: str, lr: float, seeds=None) -> list[dict]:
    return [
        r
        for r in runs
        if r["arm"] == arm
        and r["variant"] == variant
        and math.isclose(r["lr"], lr)
        and (seeds is None or r["seed"] in seeds)
    ]


def survival(runs: list[dict], event=primary_event) -> tuple[np.ndarray, np.ndarray]:
    te = [event(r) for r in runs]
    return np.array([t for t, _ in te], np.float64), np.array([e for _, e in te], bool)


def compare(runs: list[dict], lr: float, event=primary_event, seeds=None) -> list[dict]:
    """Each comparison of `stage9_config.COMPARISONS` at ``lr``: the log-rank test (the
    hazard ratio is the reference cell's against the other's), Holm-adjusted over both."""
    rows = []
    for name, ref, other in stage9_config.COMPARISONS:
        a, b = cell_runs(runs, *ref, lr, seeds), cell_runs(runs, *other, lr, seeds)
        ta, ea = survival(a, event)
        tb, eb = survival(b, event)
        lr_test = hazard.logrank(ta, ea, tb, eb) if len(a) and len(b) else None
        rows.append(
            dict(
                name=name,
                ref=ref,
                other=other,
                n=(len(a), len(b)),
                events=(int(ea.sum()), int(eb.sum())),
                test=lr_test,
            )
        )
    ps = [r["test"]["p"] if r["test"] else 1.0 for r in rows]
    for r, adj in zip(rows, holm(ps)):
        r["p_holm"] = adj
        r["verdict"] = verdict(r)
    return rows


def verdict(row: dict) -> str:
    """The rule: a higher hazard in one cell when Holm's p < 0.05 (its side from the
    hazard ratio); otherwise no difference shown, with the ratio's interval."""
    t = row["test"]
    if t is None:
        return "no runs"
    if row["p_holm"] < ALPHA:
        hi = row["ref"] if t["log_hr"] > 0 else row["other"]
        return f"higher hazard: {hi[0]} {hi[1]}"
    return "no difference shown"


def sensitivity(runs: list[dict], lr: float, seeds=None) -> list[dict]:
    """Every definition's comparisons (unadjusted p beside Holm's)."""
    return [
        dict(definition=name, family=family, rows=compare(runs, lr, fn, seeds))
        for name, family, fn in definitions()
    ]


def robust(sens: list[dict], k: int) -> str:
    """Whether comparison ``k``'s primary verdict holds over the reward definitions:
    'robust' when at least 7 of the 9 give the same side at unadjusted p < 0.05 (or,
    for no difference, at most 2 of them find one); otherwise it turns on the definition."""
    reward = [s["rows"][k] for s in sens if s["family"] == "reward"]
    primary = reward[0]
    sides = [
        (r["test"]["log_hr"] > 0) if r["test"] and r["test"]["p"] < ALPHA else None for r in reward
    ]
    if primary["verdict"].startswith("higher"):
        want = primary["test"]["log_hr"] > 0
        return "robust" if sum(s is want for s in sides) >= 7 else "turns on the definition"
    return "robust" if sum(s is not None for s in sides) <= 2 else "turns on the definition"


# --------------------------------------------------------------------------
# Tables and figures.


def power_lines() -> list[str]:
    """What a comparison can detect (80% power, two-sided 0.05, equal arms)."""
    lines = ["| events in a comparison | detectable hazard ratio |", "|---:|---:|"]
    for d in (8, 12, 16, 24, 32, 66):
        lines.append(f"| {d} | {hazard.detectable_hr(d):.2f} |")
    need = ", ".join(f"{hazard.runs_needed(2.0, p)} at p = {p:g}" for p in (0.3, 0.5, 0.7))
    lines += [
        "",
        f"A hazard ratio of 2 needs {math.ceil(hazard.schoenfeld_events(2.0))} events: "
        f"runs (both arms) by the probability of an event within the horizon: {need}.",
    ]
    return lines


def _fmt_test(t: dict | None) -> str:
    if t is None:
        return "– | – | –"
    return f"{t['hr']:.2f} [{t['hr_low']:.2f}, {t['hr_high']:.2f}] | {t['chi2']:.2f} | {t['p']:.3g}"


def comparison_lines(rows: list[dict], complete: bool) -> list[str]:
    lines = [
        "| comparison | runs | events | hazard ratio, reference / other [95%] | chi2 | p | Holm p | verdict |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        v = r["verdict"] + (" (preliminary)" if not complete and r["test"] is not None else "")
        lines.append(
            f"| {r['name']} ({r['ref'][0]} {r['ref'][1]} / {r['other'][0]} {r['other'][1]}) | "
            f"{r['n'][0]} / {r['n'][1]} | {r['events'][0]} / {r['events'][1]} | {_fmt_test(r['test'])} | "
            f"{r['p_holm']:.3g} | {v} |"
        )
    return lines


def cell_lines(runs: list[dict], lr: float, cells, seeds=None, marks=(50, 100, 141)) -> list[str]:
    lines = [
        "| cell | runs | events | event steps | "
        + " | ".join(f"S({m}) [95%]" for m in marks)
        + " |",
        "|---|---:|---:|---|" + "---|" * len(marks),
    ]
    for arm, variant in cells:
        t, e = survival(cell_runs(runs, arm, variant, lr, seeds))
        if not len(t):
            continue
        km = hazard.kaplan_meier(t, e)
        at = []
        for m in marks:
            s = hazard.survival_at(km, m)
            j = np.searchsorted(km["time"], m, side="right") - 1
            lo, hi = (km["lower"][j], km["upper"][j]) if j >= 0 else (1.0, 1.0)
            at.append(f"{s:.2f} [{lo:.2f}, {hi:.2f}]")
        when = ", ".join(str(int(x)) for x in sorted(t[e])) or "–"
        lines.append(
            f"| {arm} {variant} | {len(t)} | {int(e.sum())} | {when} | " + " | ".join(at) + " |"
        )
    return lines


def sensitivity_lines(sens: list[dict]) -> list[str]:
    names = [r["name"] for r in sens[0]["rows"]]
    lines = [
        "| definition | " + " | ".join(f"{n}: events, HR, p" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for s in sens:
        cells = []
        for r in s["rows"]:
            t = r["test"]
            hr = "–" if t is None or not np.isfinite(t["hr"]) else f"{t['hr']:.2f}"
            cells.append(f"{r['events'][0]}/{r['events'][1]}, {hr}, {t['p']:.3g}" if t else "–")
        lines.append(f"| {s['definition']} | " + " | ".join(cells) + " |")
    return lines


def plot_km(runs: list[dict], lr: float, cells, path: str, title: str, seeds=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, variant in cells:
        t, e = survival(cell_runs(runs, arm, variant, lr, seeds))
        if not len(t):
            continue
        km = hazard.kaplan_meier(t, e)
        x = np.concatenate([[0.0], km["time"], [t.max()]])
        y = np.concatenate(
            [[1.0], km["survival"], [km["survival"][-1] if len(km["survival"]) else 1.0]]
        )
        line = ax.step(x, y, where="post", label=f"{arm} {variant} ({int(e.sum())}/{len(t)})")[0]
        lo = np.concatenate([[1.0], km["lower"], [km["lower"][-1] if len(km["lower"]) else 1.0]])
        hi = np.concatenate([[1.0], km["upper"], [km["upper"][-1] if len(km["upper"]) else 1.0]])
        ax.fill_between(x, lo, hi, step="post", alpha=0.15, color=line.get_color())
    ax.set_xlabel("RL step")
    ax.set_ylabel("share of runs without the event")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stage5_posthoc(out: str) -> list[str]:
    """Stage 5's runs (250 steps, 4 seeds a cell) read with stage 9's definitions: post
    hoc, seen before these definitions were written; descriptive."""
    runs = common.read_records(os.path.join(common.RESULTS, "stage5", "runs"))
    if not runs:
        return []
    lines = [
        "## Stage 5's runs read as a hazard (post hoc, descriptive)",
        "",
        "Stage 5's 32 runs (250 RL steps, seeds 0-3) under stage 9's primary event; the"
        " definitions were written after these runs were seen, so nothing here is a test"
        " of a rule.",
        "",
    ]
    cells = [("moe2", "grpo"), ("moe2", "gmpo"), ("dense2", "grpo"), ("dense2", "gmpo")]
    for lr in sorted({r["lr"] for r in runs}, reverse=True):
        lines += (
            [f"### lr {lr:g}", ""] + cell_lines(runs, lr, cells, marks=(50, 100, 150, 241)) + [""]
        )
        lines += comparison_lines(compare(runs, lr), True) + [""]
        lines += (
            [f"Under every definition (lr {lr:g}):", ""]
            + sensitivity_lines(sensitivity(runs, lr))
            + [""]
        )
    plot_km(
        runs,
        max(r["lr"] for r in runs),
        cells,
        os.path.join(out, "stage5_km.png"),
        "stage 5, lr 4.2e-4 (post hoc)",
    )
    lines.append("Kaplan-Meier curves at 4.2e-4: `stage5_km.png`.")
    return lines


def report(out: str, sc) -> None:
    pilot = common.read_records(os.path.join(out, "pilot"))
    runs = common.read_records(os.path.join(out, "runs"))
    lines = ["# Stage 9: collapse as a hazard", "", "## Power", ""] + power_lines() + [""]
    if pilot:
        lines += ["## Pilot", ""]
        for lr in sc.pilot.lrs:
            if cell_runs(pilot, sc.pilot.arm, sc.pilot.variant, lr):
                lines += (
                    [f"lr {lr:g}:", ""]
                    + cell_lines(pilot, lr, [(sc.pilot.arm, sc.pilot.variant)])
                    + [""]
                )
        choice = pilot_choice(sc, pilot)
        lines += [
            f"The pilot's rule picks: **{'lr ' + format(choice, 'g') if choice else 'not decided yet'}**.",
            "",
        ]
    if runs and sc.lr is not None:
        seeds = common.planned_seeds(sc)
        complete = all(len(cell_runs(runs, a, v, sc.lr, seeds)) == len(seeds) for a, v in sc.cells)
        lines += ["## The grid", ""] + cell_lines(runs, sc.lr, sc.cells, seeds) + [""]
        lines += comparison_lines(compare(runs, sc.lr, seeds=seeds), complete) + [""]
        sens = sensitivity(runs, sc.lr, seeds)
        for k, (name, *_) in enumerate(stage9_config.COMPARISONS):
            lines.append(
                f"- {name}: the primary verdict is {robust(sens, k)} over the reward definitions."
            )
        lines += (
            ["", "### Sensitivity to the event's definition", ""] + sensitivity_lines(sens) + [""]
        )
        plot_km(runs, sc.lr, sc.cells, os.path.join(out, "km.png"), f"stage 9, lr {sc.lr:g}", seeds)
    lines += stage5_posthoc(out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
