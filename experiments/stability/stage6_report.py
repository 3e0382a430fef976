"""Stage 6's statistics, decision rules, table and figures from the runs' summaries
(experiments/stability/README.md, "Stage 6"); made by

    python -m experiments.stability.stage6_staleness --report

`index` groups the runs; `cell_table` gives each cell's numbers; `rules` reads R1-R4
(fixed before any run) on the seed-paired differences `deltas`; `markdown`,
`plot_reward` and `plot_kl` render them.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import numpy as np

from experiments.stability import common, stats

HOLD_MARGIN = 0.02  # R1's "holds": D(k) >= -0.02, about one evaluation's standard error
STAGE2_DETECTOR = "collapsed (stage 2's detector)"


# --------------------------------------------------------------------------
# The arms table.


def arm_table(sc) -> dict[str, tuple[str, str, str]]:
    """{arm: (trust region, rollout correction mode, routing replay)} of the config's
    table (`stage6_config.ARMS`)."""
    return {row[0]: tuple(row[1:]) for row in sc.table}


def k0_variant(sc, variant: str) -> str:
    """The arm whose k = 0 run is ``variant``'s k = 0 point: the decoupled arm with the
    same routing replay (at k = 0 both trust regions are the same policy)."""
    table = arm_table(sc)
    if variant not in table:
        raise ValueError(f"variant {variant!r}: expected one of {sorted(table)}")
    replay = table[variant][2]
    found = [v for v, (tr, _, r) in table.items() if tr == "decoupled" and r == replay]
    if len(found) != 1:
        raise ValueError(f"variant {variant!r}: no single decoupled arm with replay {replay!r}")
    return found[0]


def r3_twin(sc, variant: str) -> str | None:
    """The arm that is ``variant`` (one without replay) with R3, or None."""
    table = arm_table(sc)
    tr, mode, replay = table[variant]
    if replay != "none":
        return None
    found = [v for v, row in table.items() if row == (tr, mode, "R3")]
    return found[0] if found else None


# --------------------------------------------------------------------------
# Numbers per run and per cell.


def run_mean(run: dict, key: str) -> float:
    """A run's mean of a per-step series over its RL steps (nan if never logged)."""
    return window_mean(run, key, slice(None))


def window_mean(run: dict, key: str, steps: slice) -> float:
    """A run's mean of a per-step series over the RL steps ``steps`` selects (a slice
    of the series: ``slice(10, 20)`` is steps 11-20, ``slice(-10, None)`` the last ten),
    logged and finite values only; nan if there are none."""
    v = [float(x) for x in (run["series"].get(key) or [])[steps] if x is not None]
    v = [x for x in v if math.isfinite(x)]
    return float(np.mean(v)) if v else math.nan


def index(runs) -> dict[tuple[str, str, int], dict[int, dict]]:
    """{(architecture, arm, k): {seed: summary}} of the runs on disk."""
    out: dict = defaultdict(dict)
    for r in runs:
        out[(r["arm"], r["variant"], int(r["staleness"]))][int(r["seed"])] = r
    return out


def cell_order(idx, sc) -> list[tuple[str, str, int]]:
    """The cells of ``idx`` in the report's order: architecture as in ``sc.arms``, arm
    as in the table, then k."""
    order = {v: i for i, v in enumerate(arm_table(sc))}
    archs = {a: i for i, a in enumerate(sc.arms)}
    return sorted(idx, key=lambda t: (archs.get(t[0], 99), order.get(t[1], 99), t[2]))


def cell_runs(idx, sc, arm: str, variant: str, k: int) -> dict[int, dict]:
    """{seed: summary} of ``variant`` on ``arm`` at staleness ``k``; at k = 0 the runs
    of its `k0_variant` (the decoupled arm with the same replay)."""
    if int(k) == 0:
        variant = k0_variant(sc, variant)
    return idx.get((arm, variant, int(k)), {})


def finals(idx, sc, arm: str, variant: str, k: int) -> dict[int, float]:
    """{seed: final held-out reward} of a cell (`cell_runs`), runs without one left out."""
    return {
        s: float(r["eval_final"])
        for s, r in sorted(cell_runs(idx, sc, arm, variant, k).items())
        if r.get("eval_final") is not None
    }


def paired(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """{seed: a[seed] - b[seed]} over the seeds both have."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}


def deltas(idx, sc, arm: str, variant: str, k: int) -> dict[int, float]:
    """d_s(k) = eval_final(variant, arm, k, s) - eval_final(its k = 0 run, arm, s), per
    seed s with both runs (k = 0 and k of one seed share warm start and prompts)."""
    return paired(finals(idx, sc, arm, variant, k), finals(idx, sc, arm, variant, 0))


def ci(values) -> tuple[float, float, float] | None:
    """`stats.bootstrap_ci` of the mean of ``values`` (a dict's values or a list), None
    when empty."""
    v = list(values.values()) if isinstance(values, dict) else list(values)
    return stats.bootstrap_ci(v) if v else None


def outcome(summary: dict) -> str:
    """Stage 5's learned-collapse outcome of a run (`stats.learned_collapse` at 0.3)."""
    from experiments.stability.stage5_report import outcome as stage5_outcome

    return stage5_outcome(summary)["outcome"]


def cell_table(runs, sc) -> dict[tuple[str, str, int], dict]:
    """Per cell (architecture, arm, k) with runs: seeds, the final held-out reward
    (seed mean, bootstrap interval), D(k) against the arm's k = 0 runs, the count of
    stage 2's detector and of each learned-collapse outcome, and seed means of the
    per-run means of behaviour_kl, behaviour_f2, staleness_mean and (MoE)
    mismatch_route."""
    idx = index(runs)
    planned = len(common.planned_seeds(sc))
    out = {}
    for key in cell_order(idx, sc):
        arm, variant, k = key
        rs = [idx[key][s] for s in sorted(idx[key])]
        outs = [outcome(r) for r in rs]
        row = dict(
            n=len(rs),
            seeds=[r["seed"] for r in rs],
            complete=len(rs) >= planned,
            eval_final=ci([r["eval_final"] for r in rs if r.get("eval_final") is not None]),
            eval_start=[r["eval_start"] for r in rs],
            d=ci(deltas(idx, sc, arm, variant, k)) if k > 0 else None,
            collapsed=sum(bool(r["collapsed"]) for r in rs),
            outcomes={o: sum(x == o for x in outs) for o in stats.OUTCOMES},
        )
        keys = ["behaviour_kl", "behaviour_f2", "staleness_mean"]
        if common.is_moe(arm):
            keys.append("mismatch_route")
        for name in keys:
            per = [run_mean(r, name) for r in rs]
            per = [x for x in per if math.isfinite(x)]
            row[name] = float(np.mean(per)) if per else math.nan
        out[key] = row
    return out


# What each trust region lets the policy do (described, no rule): (column, series,
# the RL steps as a slice of the series).
MOVEMENT = (
    ("behaviour_kl, steps 11-20", "behaviour_kl", slice(10, 20)),
    ("behaviour_kl, last 10", "behaviour_kl", slice(-10, None)),
    ("ppo_kl_klast", "ppo_kl_klast", slice(None)),
    ("clip_frac", "clip_frac", slice(None)),
    ("rc_truncated_frac", "rc_truncated_frac", slice(None)),
    ("rc_weight_mean", "rc_weight_mean", slice(None)),
)


def movement_table(runs, sc) -> dict[tuple[str, str, int], dict[str, float]]:
    """Per cell (architecture, arm, k): the seed means of `MOVEMENT`'s per-run window
    means. ``ppo_kl_klast`` is KL(π_old‖π) before the step's last update: under
    'decoupled' (π_old = π_proximal) how far one RL step moves the policy, under
    'behaviour' (π_old = π_behaviour) how far the policy is from the sampler by then."""
    idx = index(runs)
    return {key: movement_row(idx[key].values()) for key in cell_order(idx, sc)}


def movement_row(cell) -> dict[str, float]:
    """One cell's `MOVEMENT` columns: over its runs ``cell``, the seed mean of each
    run's window mean (nan where no run logged the series)."""
    row = {}
    for col, series, steps in MOVEMENT:
        per = [window_mean(r, series, steps) for r in cell]
        per = [x for x in per if math.isfinite(x)]
        row[col] = float(np.mean(per)) if per else math.nan
    return row


# --------------------------------------------------------------------------
# The decision rules (README, "Stage 6", "Decision rules"; fixed before any run).


def r1_verdict(d: tuple[float, float, float] | None, n: int) -> str:
    """R1 on D(k) = (mean, lower, upper) over ``n`` seeds: "degrades" if the interval is
    below 0, "holds" if it contains 0 and the mean is >= -`HOLD_MARGIN`, else "not
    resolved"; `stats.ONE_SEED` from fewer than `stats.MIN_SEEDS` seeds."""
    if d is None:
        return "no runs"
    mean, lo, hi = d
    if hi < 0:
        verdict = "degrades"
    elif lo <= 0 <= hi and mean >= -HOLD_MARGIN:
        verdict = "holds"
    else:
        verdict = "not resolved"
    return stats.seeds_allow(verdict, n)


def _mark(verdict: str, n_min: int, planned: int) -> str:
    """``verdict``, "(preliminary)" after it on fewer seeds than planned
    (`stats.preliminary`)."""
    return f"{verdict} (preliminary)" if stats.preliminary(verdict, n_min >= planned) else verdict


def rules(runs, sc) -> dict:
    """R1-R4 on the runs so far, at staleness ``sc.rule_staleness`` (8).

    D(k) per (architecture, arm): the seed mean of d_s(k) (`deltas`) with its bootstrap
    interval, for every k of the config. R1 per (architecture, arm): `r1_verdict` of
    D(8). R2 per architecture: "the decoupled loss holds where the naive one degrades"
    if R1 says behaviour degrades and decoupled_tis holds; E = the seed mean of
    eval_final(decoupled_tis, 8) - eval_final(behaviour, 8), paired by seed. R3 per arm
    on both architectures: D_moe(8) - D_dense(8), each architecture's seeds resampled
    independently (`stats.bootstrap_diff_ci`); below 0: the MoE is more sensitive. R4
    on the MoE, per arm b without replay: G = the seed mean of eval_final(b with R3, 8)
    - eval_final(b, 8); above 0: R3 helps, below: R3 hurts. A verdict on fewer seeds
    than planned is marked "(preliminary)"; from one seed there is none
    (`stats.ONE_SEED`)."""
    idx = index(runs)
    planned = len(common.planned_seeds(sc))
    table = arm_table(sc)
    kr = int(sc.rule_staleness)
    ks = sorted(int(k) for k in sc.stalenesses if int(k) > 0)
    moe = [a for a in sc.arms if common.is_moe(a)]
    dense = [a for a in sc.arms if not common.is_moe(a)]

    d_table, r1 = {}, {}
    for arm in sc.arms:
        for v in table:
            if table[v][2] != "none" and not common.is_moe(arm):
                continue
            per_k = {k: deltas(idx, sc, arm, v, k) for k in ks}
            if not any(per_k.values()):
                continue
            d_table[(arm, v)] = {k: dict(d=ci(ds), n=len(ds), values=ds) for k, ds in per_k.items()}
            ds = per_k.get(kr, {})
            d = ci(ds)
            r1[(arm, v)] = dict(
                d=d,
                n=len(ds),
                values=ds,
                verdict=_mark(r1_verdict(d, len(ds)), len(ds), planned),
                plain=r1_verdict(d, len(ds)),
            )

    r2 = {}
    naive = [v for v, row in table.items() if row == ("behaviour", "none", "none")]
    decoupled = [v for v, row in table.items() if row == ("decoupled", "token_tis", "none")]
    for arm in sc.arms:
        if not naive or not decoupled:
            break
        b, dt = naive[0], decoupled[0]
        if (arm, b) not in r1 or (arm, dt) not in r1:
            continue
        e_vals = paired(finals(idx, sc, arm, dt, kr), finals(idx, sc, arm, b, kr))
        holds = r1[(arm, b)]["plain"] == "degrades" and r1[(arm, dt)]["plain"] == "holds"
        verdict = "the decoupled loss holds where the naive one degrades" if holds else "not shown"
        n_min = min(r1[(arm, b)]["n"], r1[(arm, dt)]["n"], len(e_vals))
        verdict = stats.seeds_allow(verdict, n_min)
        r2[arm] = dict(
            naive=b,
            decoupled=dt,
            r1=(r1[(arm, b)]["plain"], r1[(arm, dt)]["plain"]),
            e=ci(e_vals),
            n=len(e_vals),
            verdict=_mark(verdict, n_min, planned),
        )

    r3 = {}
    if moe and dense:
        for v in table:
            a, b = r1.get((moe[0], v)), r1.get((dense[0], v))
            if not a or not b or not a["values"] or not b["values"]:
                continue
            delta = stats.bootstrap_diff_ci(list(a["values"].values()), list(b["values"].values()))
            verdict = stats.sign_verdict(
                delta,
                min(a["n"], b["n"]),
                above="the dense twin is more sensitive to staleness",
                below="the MoE is more sensitive to staleness",
                neither="no difference shown",
            )
            r3[v] = dict(
                delta=delta,
                n=(a["n"], b["n"]),
                verdict=_mark(verdict, min(a["n"], b["n"]), planned),
            )

    r4 = {}
    if moe:
        for b in table:
            twin = r3_twin(sc, b)
            if twin is None:
                continue
            g_vals = paired(finals(idx, sc, moe[0], twin, kr), finals(idx, sc, moe[0], b, kr))
            if not g_vals:
                continue
            g = ci(g_vals)
            verdict = stats.sign_verdict(
                g, len(g_vals), above="R3 helps", below="R3 hurts", neither="no difference shown"
            )
            r4[b] = dict(r3=twin, g=g, n=len(g_vals), verdict=_mark(verdict, len(g_vals), planned))
    return dict(staleness=kr, d=d_table, r1=r1, r2=r2, r3=r3, r4=r4)


C1_LEARNED = 0.05  # C1's precondition: k = 0 ends this far above the warm start
C1_KL = 0.3  # C1's bound on the decoupled arm's behaviour KL over the last 10 steps


def c1_verdict(runs, sc, g: dict) -> dict:
    """Control C1's rule (README, "Stage 6", "Control C1") on the small-steps runs and
    their rules ``g``: the precondition (the k = 0 runs' final held-out reward above
    their warm start's by `C1_LEARNED` in the seed mean), then "supported" if R1 says
    ``decoupled_tis`` holds at k = 8 with its behaviour KL over the last 10 steps below
    `C1_KL`, "refuted" if it degrades with that KL below `C1_KL`, else "not resolved"."""
    idx = index(runs)
    k0 = [
        r["eval_final"] - r["eval_start"]
        for r in cell_runs(idx, sc, sc.arms[0], "decoupled_tis", 0).values()
        if r.get("eval_final") is not None and r.get("eval_start") is not None
    ]
    gain = float(np.mean(k0)) if k0 else math.nan
    kr = int(sc.rule_staleness)
    kl_last = movement_row(idx.get((sc.arms[0], "decoupled_tis", kr), {}).values())[
        "behaviour_kl, last 10"
    ]
    r1 = g["r1"].get((sc.arms[0], "decoupled_tis"))
    if r1 is None or not k0:
        verdict = "no runs"
    elif not gain >= C1_LEARNED:
        verdict = "says nothing (the k = 0 runs did not learn)"
    elif r1["plain"] == "holds" and kl_last < C1_KL:
        verdict = "the hypothesis is supported"
    elif r1["plain"] == "degrades" and kl_last < C1_KL:
        verdict = "the hypothesis is refuted"
    else:
        verdict = "not resolved"
    n = r1["n"] if r1 else 0
    if r1 is not None:
        verdict = _mark(stats.seeds_allow(verdict, n), n, len(common.planned_seeds(sc)))
    return dict(gain=gain, kl_last=kl_last, r1=r1["plain"] if r1 else None, n=n, verdict=verdict)


# --------------------------------------------------------------------------
# Writing it out.


def _ci(d, spec: str = ".3f") -> str:
    return "n/a" if d is None else stats.fmt_ci(*d, spec=spec)


def _g(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.3g}"


def markdown(cells: dict, g: dict, sc, movement: dict | None = None) -> list[str]:
    """The report's text: the cells' table, what the trust regions let the policy do
    (``movement``, `movement_table`), D(k) and the rules' verdicts with their
    numbers."""
    kr = g["staleness"]
    planned = common.planned_seeds(sc)
    lines = [
        "## The cells",
        "",
        "Held-out rewards: the final held-out reward (mean of a run's last two "
        "evaluations), seed means [95% bootstrap over seeds]. D(k): the seed mean of "
        "d_s(k) = final(k, s) - final(k = 0, s), the k = 0 run being the decoupled arm's "
        "with the same replay. Outcomes (stage 5's `stats.learned_collapse`) as counts of: "
        + " / ".join(stats.OUTCOMES)
        + f". Planned seeds: {list(planned)}.",
        "",
        "| architecture | arm | k | seeds | final held-out | D(k) | "
        f"{STAGE2_DETECTOR} | outcomes | behaviour_kl | behaviour_f2 | staleness_mean "
        "| mismatch_route |",
        "|---|---|---:|---:|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for (arm, v, k), row in cells.items():
        lines.append(
            f"| {arm} | {v} | {k} | {row['n']}{'' if row['complete'] else ' (preliminary)'} | "
            f"{_ci(row['eval_final'])} | {_ci(row['d'], '+.3f')} | {row['collapsed']} | "
            + " / ".join(str(row["outcomes"][o]) for o in stats.OUTCOMES)
            + f" | {_g(row['behaviour_kl'])} | {_g(row['behaviour_f2'])} | "
            f"{_g(row['staleness_mean'])} | {_g(row.get('mismatch_route', math.nan))} |"
        )
    if movement:
        cols = [m[0] for m in MOVEMENT]
        lines += [
            "",
            "## What the trust regions let the policy do (described, no rule)",
            "",
            "Seed means of per-run means. behaviour_kl: KL(π_behaviour‖π_proximal) at the "
            "step's start, over RL steps 11-20 and the last 10. ppo_kl_klast: KL(π_old‖π) "
            "before the step's last update; π_old is π_proximal under `decoupled` (how far "
            "one RL step moves the policy) and π_behaviour under `behaviour` (how far from "
            "the sampler the policy has gone by then). clip_frac: the share of tokens "
            "whose gradient the clip removes. rc_truncated_frac, rc_weight_mean: the "
            "share of tokens whose behaviour weight π_proximal / π_behaviour is truncated "
            "at the cap, and the weight's mean (`decoupled_tis` only).",
            "",
            "| architecture | arm | k | " + " | ".join(cols) + " |",
            "|---|---|---:|" + "---:|" * len(cols),
        ]
        for (arm, v, k), row in movement.items():
            lines.append(f"| {arm} | {v} | {k} | " + " | ".join(_g(row[c]) for c in cols) + " |")
    ks = sorted({k for row in g["d"].values() for k in row})
    lines += [
        "",
        "## D(k): the change of the final held-out reward from k = 0, paired by seed",
        "",
        "| architecture | arm | " + " | ".join(f"D({k})" for k in ks) + " |",
        "|---|---|" + "---|" * len(ks),
    ]
    for (arm, v), row in g["d"].items():
        lines.append(
            f"| {arm} | {v} | "
            + " | ".join(
                _ci(row[k]["d"], "+.3f")
                + ("" if row[k]["n"] >= len(planned) else f" (n={row[k]['n']})")
                for k in ks
            )
            + " |"
        )
    lines += ["", f"## R1: does the held-out reward degrade at k = {kr}?", ""]
    for (arm, v), r in g["r1"].items():
        lines.append(
            f"- {arm}, {v}: D({kr}) = {_ci(r['d'], '+.3f')} over {stats.seeds_text(r['n'])} "
            f"{_seeds(r['values'])}: **{r['verdict']}**"
        )
    lines += ["", f"## R2: AReaL's comparison at k = {kr}", ""]
    if not g["r2"]:
        lines.append("- no architecture has runs of both arms yet")
    for arm, r in g["r2"].items():
        lines.append(
            f"- {arm}: R1 says {r['naive']} {r['r1'][0]}, {r['decoupled']} {r['r1'][1]}; "
            f"E = final({r['decoupled']}) - final({r['naive']}) = {_ci(r['e'], '+.3f')} over "
            f"{stats.seeds_text(r['n'])}: **{r['verdict']}**"
        )
    lines += ["", f"## R3: the MoE against its dense twin, D_moe({kr}) - D_dense({kr})", ""]
    if not g["r3"]:
        lines.append("- no arm has D on both architectures yet")
    for v, r in g["r3"].items():
        lines.append(
            f"- {v}: Δ = {_ci(r['delta'], '+.3f')} (seeds {r['n'][0]} MoE, {r['n'][1]} dense): "
            f"**{r['verdict']}**"
        )
    lines += ["", f"## R4: R3 under staleness, the MoE at k = {kr}", ""]
    if not g["r4"]:
        lines.append("- no arm has runs with and without R3 on the MoE yet")
    for b, r in g["r4"].items():
        lines.append(
            f"- {b}: G = final({r['r3']}) - final({b}) = {_ci(r['g'], '+.3f')} over "
            f"{stats.seeds_text(r['n'])}: **{r['verdict']}**"
        )
    lines += [
        "",
        "Collapse (no rule): each cell's count of stage 2's detector and of stage 5's "
        "outcomes is in the table above.",
        "",
    ]
    return lines


def _seeds(values: dict[int, float]) -> str:
    return "{" + ", ".join(f"s{s}: {v:+.3f}" for s, v in values.items()) + "}"


def _by_k(idx, sc, arm: str, v: str, get) -> tuple[list[int], list[tuple]]:
    """(ks, per-k (mean, lower, upper)) of ``get(run)`` over a line's seeds, k = 0 from
    the arm's `k0_variant`."""
    ks, ys = [], []
    for k in sorted(int(x) for x in sc.stalenesses):
        vals = [get(r) for r in cell_runs(idx, sc, arm, v, k).values()]
        vals = [x for x in vals if x is not None and math.isfinite(x)]
        if vals:
            ks.append(k)
            ys.append(stats.bootstrap_ci(vals))
    return ks, ys


def _plot_vs_k(runs, sc, path: str, get, ylabel: str, title: str, log: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = index(runs)
    archs = [a for a in sc.arms if any(key[0] == a for key in idx)]
    table = list(arm_table(sc))
    fig, axes = plt.subplots(1, max(len(archs), 1), figsize=(5.5 * max(len(archs), 1), 4))
    axes = np.atleast_1d(axes)
    for ax, arm in zip(axes, archs):
        for i, v in enumerate(table):
            ks, ys = _by_k(idx, sc, arm, v, get)
            if not ks:
                continue
            x = np.asarray(ks, float) + 0.06 * (i - (len(table) - 1) / 2)
            m = np.array([y[0] for y in ys])
            err = np.array([[y[0] - y[1] for y in ys], [y[2] - y[0] for y in ys]])
            ax.errorbar(x, m, yerr=err, marker="o", ms=4, capsize=3, lw=1.2, color=f"C{i}", label=v)
        ax.set_title(f"{arm}: {title}", fontsize=9)
        ax.set_xlabel("staleness k (RL steps)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted(int(k) for k in sc.stalenesses))
        if log and any(np.any(np.asarray(line.get_ydata()) > 0) for line in ax.get_lines()):
            ax.set_yscale("log", nonpositive="mask")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reward(runs, sc, path: str) -> None:
    """Final held-out reward against k per architecture, one line per arm (k = 0: the
    decoupled arm's run with the same replay), seed means with bootstrap bars."""
    _plot_vs_k(
        runs,
        sc,
        path,
        lambda r: r.get("eval_final"),
        "final held-out reward",
        "held-out reward after the run (seed mean, 95% bootstrap)",
        log=False,
    )


def plot_kl(runs, sc, path: str) -> None:
    """behaviour_kl (KL(π_behaviour‖π_proximal), the mean over a run's steps) against k
    per architecture, one line per arm, seed means with bootstrap bars; log scale."""
    _plot_vs_k(
        runs,
        sc,
        path,
        lambda r: run_mean(r, "behaviour_kl"),
        "behaviour_kl, mean over RL steps",
        "KL(π_behaviour‖π_proximal)",
        log=True,
    )


def report(out: str, sc) -> None:
    """``<out>/table.md`` (printed), ``reward_vs_k.png`` and ``kl_vs_k.png`` from the
    summaries in ``<out>/runs``."""
    runs = common.read_records(os.path.join(out, "runs"))
    title = "Stage 6: staleness" + ("" if sc.name == "stage6" else f" ({sc.name})")
    lines = [f"# {title}", ""]
    if runs:
        lrs = ", ".join(sorted({format(r["lr"], "g") for r in runs}))
        lines += [
            f"{len(runs)} finished runs; GRPO, lr {lrs}, {sc.updates} updates per rollout, "
            f"{sc.steps} RL steps.",
            "",
        ]
        g = rules(runs, sc)
        lines += markdown(cell_table(runs, sc), g, sc, movement_table(runs, sc))
        if sc.name == "stage6_small_steps":
            c1 = c1_verdict(runs, sc, g)
            lines += [
                '## Control C1: small steps (README, "Stage 6")',
                "",
                f"- k = 0 runs' final held-out minus their warm start's: {_g(c1['gain'])} "
                f"(precondition: at least {C1_LEARNED}); decoupled_tis at k = "
                f"{g['staleness']}: R1 {c1['r1']}, behaviour_kl over the last 10 steps "
                f"{_g(c1['kl_last'])} (bound {C1_KL}), {stats.seeds_text(c1['n'])}: **{c1['verdict']}**",
                "",
            ]
        plot_reward(runs, sc, os.path.join(out, "reward_vs_k.png"))
        plot_kl(runs, sc, os.path.join(out, "kl_vs_k.png"))
    else:
        lines.append("No runs yet.")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
