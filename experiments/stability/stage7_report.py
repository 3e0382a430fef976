"""Stage 7's report: the measured mismatch of each sampler precision and the grid's
rules (experiments/stability/README.md, "Stage 7"), from the committed records alone.

    python -m experiments.stability.stage7_numerics --report
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from experiments.stability import common, stats

CONTROL = "f32"
R3_FACTOR = 10.0  # stage 4's "removes the mismatch"


def run_mismatch(summary: dict, key: str = "mismatch_kl") -> float | None:
    """A run's mean of ``key`` over its RL steps (None if it logged none)."""
    xs = [x for x in summary["series"].get(key, []) if x is not None]
    return float(np.mean(xs)) if xs else None


def by_arm(runs) -> dict:
    """(arm, variant) -> {seed: summary}."""
    out = defaultdict(dict)
    for r in runs:
        out[(r["arm"], r["variant"])][int(r["seed"])] = r
    return out


def paired(a: dict, b: dict, key=lambda r: r["eval_final"]):
    """Per seed present in both, key(a) - key(b)."""
    return [key(a[s]) - key(b[s]) for s in sorted(set(a) & set(b))]


def rules(runs, sc) -> dict:
    """The stage's rules on the runs so far (README, "Stage 7", "Decision rules").

    R1, per architecture and precision p in (bf16, int8): d_s = final held-out reward
    of p minus the f32 control's, paired by seed; "hurts" if the bootstrap interval of
    mean d_s is below 0, "helps" if above, else no effect shown. Beside it, the
    collapse counts (stage 2's detector) and a one-sided Fisher test of the control
    having fewer.
    R2, MoE: "R3 removes the mismatch" at a precision if the seed-mean mismatch_kl of
    p is at least 10x p+R3's with non-overlapping bootstrap intervals.
    R3, MoE: "TIS helps" if bf16+TIS minus bf16, paired by seed, has an interval above 0.
    R4: "the mismatch hurts the MoE more than the dense twin" if the interval of
    mean d_s(MoE) - mean d_s(dense) (seeds resampled per architecture) is below 0."""
    planned = len(common.planned_seeds(sc))
    arms = by_arm(runs)
    table = {}
    for (arm, variant), per in sorted(arms.items()):
        rs = [per[s] for s in sorted(per)]
        kl = [run_mismatch(r) for r in rs]
        route = [run_mismatch(r, "mismatch_route") for r in rs]
        table[(arm, variant)] = dict(
            n=len(rs),
            eval_final=stats.bootstrap_ci([r["eval_final"] for r in rs]),
            mismatch_kl=stats.bootstrap_ci(kl) if None not in kl else None,
            mismatch_route=stats.bootstrap_ci(route) if None not in route else None,
            collapsed=sum(bool(r["collapsed"]) for r in rs),
            learned_collapsed=sum(_outcome(r) == stats.LEARNED_COLLAPSED for r in rs),
            complete=len(rs) >= planned,
        )
    r1, r2, r3, r4 = {}, {}, {}, {}
    effects = {}
    for arm in sc.arms:
        ctrl = arms.get((arm, CONTROL), {})
        for p in ("bf16", "int8"):
            cur = arms.get((arm, p), {})
            d = paired(cur, ctrl)
            if not d:
                continue
            effects[(arm, p)] = d
            hits = sum(bool(r["collapsed"]) for r in cur.values())
            chits = sum(bool(r["collapsed"]) for r in ctrl.values())
            ci = stats.bootstrap_ci(d)
            r1[(arm, p)] = dict(
                d=d,
                ci=ci,
                verdict=stats.sign_verdict(
                    ci, len(d), above="helps", below="hurts", neither="no effect shown"
                ),
                collapsed=(hits, len(cur)),
                control_collapsed=(chits, len(ctrl)),
                p_more_collapses=stats.fisher_one_sided(chits, len(ctrl), hits, len(cur)),
                complete=min(len(cur), len(ctrl)) >= planned,
            )
    moe = sc.arm
    for p in ("bf16", "int8"):
        a, b = table.get((moe, p)), table.get((moe, p + "_r3"))
        if a and b and a["mismatch_kl"] and b["mismatch_kl"]:
            ratio = a["mismatch_kl"][0] / b["mismatch_kl"][0] if b["mismatch_kl"][0] > 0 else np.inf
            apart = a["mismatch_kl"][1] > b["mismatch_kl"][2]
            r2[p] = dict(
                ratio=float(ratio),
                apart=bool(apart),
                verdict=stats.seeds_allow(
                    "R3 removes it" if ratio >= R3_FACTOR and apart else "not shown",
                    min(a["n"], b["n"]),
                ),
                complete=a["complete"] and b["complete"],
            )
    tis, base = arms.get((moe, "bf16_tis"), {}), arms.get((moe, "bf16"), {})
    d = paired(tis, base)
    if d:
        ci = stats.bootstrap_ci(d)
        r3["bf16"] = dict(
            d=d,
            ci=ci,
            verdict=stats.sign_verdict(
                ci, len(d), above="TIS helps", below="TIS hurts", neither="not shown"
            ),
            complete=len(d) >= planned,
        )
    for p in ("bf16", "int8"):
        dm, dd = effects.get((moe, p)), effects.get((sc.dense_arm, p))
        if dm and dd:
            ci = stats.bootstrap_diff_ci(dm, dd)
            r4[p] = dict(
                ci=ci,
                verdict=stats.sign_verdict(
                    ci,
                    min(len(dm), len(dd)),
                    above="hurts the dense twin more",
                    below="hurts the MoE more",
                    neither="no difference shown",
                ),
                complete=min(len(dm), len(dd)) >= planned,
            )
    return dict(table=table, r1=r1, r2=r2, r3=r3, r4=r4)


def _outcome(summary: dict) -> str:
    from experiments.stability.stage5_report import outcome

    return outcome(summary)["outcome"]


# --------------------------------------------------------------------------
# Writing it out.


def _verdict(r: dict) -> str:
    """The rule's verdict in bold, "(preliminary)" after it on fewer seeds than planned
    (none after `stats.ONE_SEED`, which is no verdict)."""
    marked = stats.preliminary(r["verdict"], r["complete"])
    return f"**{r['verdict']}**" + (" (preliminary)" if marked else "")


def measure_markdown(records) -> list[str]:
    lines = [
        "## The mismatch of each precision, at the warm starts",
        "",
        "Seed means [95% bootstrap over seeds] over each seed's first RL rollouts.",
        "",
        "| arm | sampler | seeds | train-inference KL | F(τ=2) | routing disagreement |",
        "|---|---|---:|---|---|---|",
    ]
    groups = defaultdict(list)
    for r in records:
        groups[(r["arm"], r["precision"])].append(r)
    for (arm, p), rs in sorted(groups.items()):
        kl = stats.bootstrap_ci([r["mismatch_kl"] for r in rs])
        f2 = stats.bootstrap_ci([r["mismatch_f2"] for r in rs])
        route = (
            stats.fmt_ci(*stats.bootstrap_ci([r["mismatch_route"] for r in rs]), spec=".4f")
            if all("mismatch_route" in r for r in rs)
            else "—"
        )
        lines.append(
            f"| {arm} | {p} | {len(rs)} | {stats.fmt_ci(*kl, spec='.3g')} | "
            f"{stats.fmt_ci(*f2, spec='.2e')} | {route} |"
        )
    return lines + [""]


def grid_markdown(g: dict) -> list[str]:
    lines = [
        "## The grid",
        "",
        "| arm | variant | seeds | final held-out | train-inference KL (run mean) | routing "
        "disagreement | collapsed (stage 2) | learned, then collapsed |",
        "|---|---|---:|---|---|---|---:|---:|",
    ]
    for (arm, v), row in g["table"].items():
        kl = stats.fmt_ci(*row["mismatch_kl"], spec=".3g") if row["mismatch_kl"] else "—"
        route = stats.fmt_ci(*row["mismatch_route"], spec=".4f") if row["mismatch_route"] else "—"
        lines.append(
            f"| {arm} | {v} | {row['n']} | {stats.fmt_ci(*row['eval_final'])} | {kl} | {route} | "
            f"{row['collapsed']} | {row['learned_collapsed']} |"
        )
    lines += [
        "",
        "### R1: does the mismatch hurt? (final held-out minus the f32 control's, paired by seed)",
        "",
    ]
    for (arm, p), r in g["r1"].items():
        lines.append(
            f"- {arm}, {p}: {stats.fmt_ci(*r['ci'])}; collapsed {r['collapsed'][0]}/"
            f"{r['collapsed'][1]} against the control's {r['control_collapsed'][0]}/"
            f"{r['control_collapsed'][1]} (p = {r['p_more_collapses']:.3g}): "
            f"{_verdict(r)}"
        )
    lines += ["", "### R2: does R3 remove it? (MoE, seed-mean train-inference KL)", ""]
    for p, r in g["r2"].items():
        lines.append(
            f"- {p}: {p} / {p}+R3 = {r['ratio']:.3g}, intervals "
            f"{'apart' if r['apart'] else 'overlap'}: {_verdict(r)}"
        )
    lines += ["", "### R3: does token TIS help? (MoE, bf16 + TIS minus bf16, paired)", ""]
    for p, r in g["r3"].items():
        lines.append(f"- {p}: {stats.fmt_ci(*r['ci'])}: {_verdict(r)}")
    lines += ["", "### R4: the MoE against its dense twin (R1's effect, MoE minus dense)", ""]
    for p, r in g["r4"].items():
        lines.append(f"- {p}: {stats.fmt_ci(*r['ci'])}: {_verdict(r)}")
    return lines + [""]


def plot(runs, path: str) -> None:
    """Per architecture: the seed-mean held-out reward against RL step, and the seed-mean
    train-inference KL (a 10-step moving average; the f32 control's ~1e-13 is left off
    the axis and named in the title). One colour per variant in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = by_arm(runs)
    archs = sorted({a for a, _ in arms}, key=lambda a: (not common.is_moe(a), a))
    variants = sorted({v for _, v in arms}, key=lambda v: (v != CONTROL, v))
    colour = {v: f"C{i}" for i, v in enumerate(variants)}
    fig, axes = plt.subplots(2, len(archs), figsize=(6 * len(archs), 7), squeeze=False)
    for j, arch in enumerate(archs):
        control_kl = None
        for v in variants:
            per = arms.get((arch, v))
            if not per:
                continue
            rs = list(per.values())
            steps = rs[0]["steps"]
            ev = [
                [
                    (t, x)
                    for t, x in zip(r["steps"], r["series"].get("eval_reward_mean", []))
                    if x is not None
                ]
                for r in rs
            ]
            n = min(len(e) for e in ev)
            if n:
                xs = [0] + [t for t, _ in ev[0][:n]]
                ys = [np.mean([r["eval_start"] for r in rs])] + [
                    float(np.mean([e[i][1] for e in ev])) for i in range(n)
                ]
                axes[0][j].plot(xs, ys, label=v, color=colour[v])
            kl = [r["series"].get("mismatch_kl") for r in rs]
            if any(k is None for k in kl):
                continue
            mean = np.array([np.mean([k[i] or 0.0 for k in kl]) for i in range(len(steps))])
            if v == CONTROL:
                control_kl = float(np.mean(mean))
                continue
            smooth = stats.moving_average(mean, 10)
            axes[1][j].plot(steps, smooth, label=v, color=colour[v], lw=1.0)
        axes[0][j].set_title(f"{arch}: held-out reward (seed mean)")
        title = f"{arch}: train-inference KL (seed mean, 10-step average)"
        if control_kl is not None:
            title += f"\n{CONTROL} control: {control_kl:.1e}, off the axis"
        axes[1][j].set_title(title, fontsize=10)
        axes[1][j].set_yscale("log")
        axes[1][j].set_xlabel("RL step")
        axes[0][j].legend(fontsize=7)
        axes[1][j].legend(fontsize=7)
    # One KL scale across architectures, so that their levels compare at a glance.
    lims = [ax.get_ylim() for ax in axes[1]]
    for ax in axes[1]:
        ax.set_ylim(min(lo for lo, _ in lims), max(hi for _, hi in lims))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: str, sc) -> None:
    measured = common.read_jsonl(os.path.join(out, "measure.jsonl"))
    runs = common.read_records(os.path.join(out, "runs"))
    lines = ["# Stage 7: a mismatch from numerics", ""]
    if measured:
        lines += measure_markdown(measured)
    if runs:
        lines += grid_markdown(rules(runs, sc))
        plot(runs, os.path.join(out, "curves.png"))
    if not measured and not runs:
        lines.append("No records yet.")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
