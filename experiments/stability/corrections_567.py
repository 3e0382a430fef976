"""The numbers behind the README's "Corrections (2026-12-07: stages 5, 6 and 7)"
(experiments/stability/README.md), each recomputed from the committed per-run summaries
in ``results/`` and the code's own config, with no new run; `corrections.report` writes
them (`sections`) into results/corrections.md after those of stages 2-4. Each function
returns a dict of its numbers, with the section's Markdown under ``"lines"``: stage 5
(`s5_progress`, `s5_eval_noise`, `false_learning` and `s5_false_learning`, `s5_bar`,
`s5_threshold`, `s5_pairs`), stage 6 (`s6_c1`, `s6_onset`, `s6_copies`), stage 7
(`s7_tests`, `s7_mismatch`, `s7_control`).
"""

from __future__ import annotations

import collections
import math
import os

import numpy as np
from scipy import stats as sps

from experiments.stability import common, stage5_report, stage6_config, stage6_report, stats
from experiments.stability.corrections import first_difference, load, max_difference, series

LR_HIGH = 4.2e-4  # stage 5's higher rate (and stage 7's)
WINDOW = (10, 120)  # RL steps over which a run's held-out reward is averaged
R3_PAPER_KL = 1.5e-3  # the train-inference KL the R3 paper reports for a 30B MoE
GAP = 0.05  # training reward below this: the policy has stopped solving anything
BAR = 0.10  # a stricter learning bar, several times the evaluation's noise


def evals(run: dict) -> tuple[np.ndarray, np.ndarray]:
    """(RL steps, held-out rewards) of a run's evaluations after RL step 0."""
    e = series(run, "eval_reward_mean")
    keep = ~np.isnan(e)
    return np.asarray(run["steps"])[keep], e[keep]


def sci(x: float, digits: int = 2) -> str:
    """``1.6e-3``: scientific notation without the exponent's padding."""
    m, e = f"{x:.{digits - 1}e}".split("e")
    return f"{m}e{int(e)}"


def grid5(runs5: list[dict]) -> dict:
    """Stage 5's runs by (objective, architecture, lr, seed)."""
    return {(r["variant"], r["arm"], float(r["lr"]), int(r["seed"])): r for r in runs5}


def _cells(grid: dict):
    return sorted({k[:3] for k in grid}, key=lambda c: (c[0] != "grpo", -c[2], c[1] != "moe2"))


# --------------------------------------------------------------------------
# Stage 5.


def s5_progress(runs5: list[dict]) -> dict:
    """Per run: the mean held-out reward over RL steps `WINDOW` minus the warm start's,
    and the final held-out reward (mean of the last two evaluations) minus it; per cell
    their range and the runs that end below their warm start."""
    g = grid5(runs5)
    gain, end = {}, {}
    for k, r in g.items():
        st, ev = evals(r)
        sel = (st >= WINDOW[0]) & (st <= WINDOW[1])
        gain[k] = float(ev[sel].mean() - r["eval_start"])
        end[k] = float(r["eval_final"] - r["eval_start"])
    lines = [
        "## Stage 5: how far the runs rose above their warm start\n",
        f"Per run, the mean held-out reward over RL steps {WINDOW[0]}–{WINDOW[1]} minus the "
        "warm start's, and the final held-out reward (mean of the last two evaluations) "
        "minus it. GRPO at lr 4.2e-4, run by run:\n",
        "| arm | seed | warm start | mean, steps 10–120, − start | final − start | outcome (0.3) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for k in sorted(k for k in g if k[0] == "grpo" and k[2] == LR_HIGH):
        lines.append(
            f"| {k[1]} | {k[3]} | {g[k]['eval_start']:.3f} | {gain[k]:+.3f} | {end[k]:+.3f} "
            f"| {stage5_report.outcome(g[k])['outcome']} |"
        )
    lines += ["", "Every cell:\n", "| objective | arm | lr | mean − start | end below start |"]
    lines += ["|---|---|---|---|---|"]
    cells = {}
    for c in _cells(g):
        ks = [k for k in g if k[:3] == c]
        lo, hi = min(gain[k] for k in ks), max(gain[k] for k in ks)
        below = sum(end[k] < 0 for k in ks)
        cells[c] = dict(lo=lo, hi=hi, below=below, n=len(ks))
        lines.append(
            f"| {c[0]} | {c[1]} | {c[2]:g} | {lo:+.3f} to {hi:+.3f} | {below} of {len(ks)} |"
        )
    high = [k for k in g if k[0] == "grpo" and k[2] == LR_HIGH]
    hg = [gain[k] for k in high]
    out = dict(lo=min(hg), hi=max(hg), below=sum(end[k] < 0 for k in high), n=len(high))
    out["cells"] = cells
    lines += [
        "",
        f"GRPO at 4.2e-4: mean held-out reward over steps 10–120 {out['lo']:+.3f} to "
        f"{out['hi']:+.3f} above the warm start; {out['below']} of {out['n']} runs end below "
        "it.\n",
    ]
    return dict(out, lines=lines)


def copy_pairs(runs5: list[dict], runs6: list[dict]) -> list[tuple[dict, dict]]:
    """(stage-6 run, stage-5 run): each of stage 6's k = 0 runs without replay beside
    stage 5's GRPO run of the same architecture and seed at stage 6's lr (3e-4)."""
    g = grid5(runs5)
    out = []
    for r in sorted(runs6, key=lambda r: (r["arm"], r["seed"])):
        if int(r["staleness"]) == 0 and r["replay"] == "none":
            out.append((r, g[("grpo", r["arm"], float(r["lr"]), int(r["seed"]))]))
    return out


def s5_eval_noise(runs5: list[dict], runs6: list[dict]) -> dict:
    """The held-out evaluation's size from the config the runs used, its binomial
    standard error at the warm starts' levels (samples independent; a prompt's samples
    all alike), and the spread between two copies of one run (`copy_pairs`) at the same
    evaluation, after their training rewards part and before either collapses."""
    c = common.rl_config("moe2", 0, "/nonexistent")
    prompts, samples = int(c.task.eval_size), int(c.task.eval_samples)
    levels = sorted({float(r["eval_start"]) for r in runs5})
    lo, hi = levels[0], levels[-1]

    def se(p, n):
        return math.sqrt(p * (1 - p) / n)

    diffs = []
    for a, b in copy_pairs(runs5, runs6):
        part = first_difference(a, b, "reward_mean") or math.inf
        stop = min(a["collapse_step"] or math.inf, b["collapse_step"] or math.inf)
        sa, ea = evals(a)
        sb, eb = evals(b)
        eb = dict(zip(sb, eb))
        diffs += [e - eb[s] for s, e in zip(sa, ea) if part < s < stop and s in eb]
    rms = float(np.sqrt(np.mean(np.square(diffs))))
    out = dict(prompts=prompts, samples=samples, levels=(lo, hi), copies_n=len(diffs))
    out.update(
        copies_rms=rms, copies_sd=rms / math.sqrt(2), se_prompt=(se(lo, prompts), se(hi, prompts))
    )
    out["se_independent"] = (se(lo, prompts * samples), se(hi, prompts * samples))
    lines = [
        "## Stage 5: the held-out evaluation's noise\n",
        f"The held-out evaluation of stages 5–7 scores `task.eval_size` = {prompts} prompts "
        f"× `task.eval_samples` = {samples} samples (`common.rl_config`; {prompts * samples} "
        "samples, 0/1 rewards), the same prompts and sampling keys every time. Its binomial "
        f"standard error at the warm starts' levels ({lo:.3f}–{hi:.3f}): "
        f"{out['se_independent'][0]:.3f}–{out['se_independent'][1]:.3f} with the samples "
        f"independent, {out['se_prompt'][0]:.3f}–{out['se_prompt'][1]:.3f} if a prompt's "
        "samples were all alike (the two bounds).\n",
        f"Two copies of one run (stage 6's {len(copy_pairs(runs5, runs6))} k = 0 runs without "
        "replay and stage 5's GRPO runs at 3e-4, which differ by float rounding only) "
        f"differ at the same evaluation, once their training rewards part and before either "
        f"collapses, by {rms:.3f} (root mean square over {len(diffs)} evaluations), "
        f"{out['copies_sd']:.3f} for each evaluation: the evaluation's noise and the "
        "rounding-driven wander of training together.\n",
    ]
    return dict(out, lines=lines)


def false_learning(level, sd=None, *, n=512, n_evals=25, sims=20000, seed=0) -> float:
    """The share of ``sims`` simulated runs whose held-out reward stays at ``level`` and
    which `stats.learned_step` still calls learned within ``n_evals`` evaluations: the
    warm start's evaluation and each later one drawn independently, as binomial(n,
    level) / n or, with ``sd``, as level + sd × N(0, 1)."""
    rng = np.random.default_rng(seed)
    if sd is None:
        x = rng.binomial(n, level, (sims, n_evals + 1)) / n
    else:
        x = level + sd * rng.standard_normal((sims, n_evals + 1))
    start, ev = x[:, 0], x[:, 1:]
    # stats.learned_step's trailing mean of two evaluations (the first one alone).
    m = np.concatenate([ev[:, :1], (ev[:, 1:] + ev[:, :-1]) / 2], axis=1)
    bar = np.maximum(stats.LEARN_FACTOR * start, start + stats.LEARN_MIN_GAIN)
    return float(np.mean((m >= bar[:, None]).any(axis=1)))


def s5_false_learning(runs5: list[dict], noise: dict) -> dict:
    """`false_learning` at the lowest, median and highest warm start of stage 5, with
    binomial noise of the evaluation's samples and with the copies' spread."""
    starts = sorted(float(r["eval_start"]) for r in runs5)
    levels = (starts[0], float(np.median(starts)), starts[-1])
    n_evals = max(len(evals(r)[0]) for r in runs5)
    n = noise["prompts"] * noise["samples"]
    rates = {
        (p, m): false_learning(
            p, None if m == "binomial" else noise["copies_sd"], n=n, n_evals=n_evals
        )
        for p in levels
        for m in ("binomial", "copies")
    }
    lines = [
        '## Stage 5: how often the "learned" bar passes a run that does not move\n',
        f"Simulated runs (20000 each, seed 0) whose held-out reward stays at a warm start's "
        f"level for {n_evals} evaluations, the warm start's evaluation and each later one "
        "drawn independently; the share that `stats.learned_step` (1.25× and +0.05 on the "
        "two-evaluation mean) calls learned. Noise: binomial over the "
        f"{n} samples, or normal with the copies' spread ({noise['copies_sd']:.3f}).\n",
        "| warm start | binomial | copies' spread |",
        "|---:|---:|---:|",
    ]
    for p in levels:
        lines.append(f"| {p:.3f} | {rates[(p, 'binomial')]:.1%} | {rates[(p, 'copies')]:.1%} |")
    vals = list(rates.values())
    lines += [
        "",
        f"Range: {min(vals):.0%}–{max(vals):.0%}. Independent draws overstate the noise of a "
        "policy that changes little (the evaluation's fixed keys make nearby policies' "
        "evaluations alike), so these are rates for a run whose samples change but whose "
        "reward does not.\n",
    ]
    return dict(rates=rates, lo=min(vals), hi=max(vals), levels=levels, lines=lines)


def learned_collapse_at(run: dict, min_gain: float, frac: float = 0.3) -> tuple:
    """(RL step learned, RL step collapsed after learning) under stage 5's detector with
    the learning bar max(1.25×, +``min_gain``) (None where it did not)."""
    st, ev = evals(run)
    i = stats.learned_step(ev, float(run["eval_start"]), min_gain=min_gain)
    if i is None:
        return None, None
    steps, rewards = list(run["steps"]), series(run, "reward_mean")
    j = next(k for k, s in enumerate(steps) if s >= st[i])
    c = stats.collapse_step(rewards[j:], frac=frac)
    return int(st[i]), None if c is None else int(steps[j + c])


def s5_bar(runs5: list[dict], min_gain: float = BAR) -> dict:
    """Per cell: the runs that learned, and learned then collapsed, at the rule's bar
    (+0.05) and at +``min_gain``; the rule's bar reproduces `stats.learned_collapse`."""
    g = grid5(runs5)
    for r in g.values():
        o = stage5_report.outcome(r)
        assert learned_collapse_at(r, stats.LEARN_MIN_GAIN) == (o["learned_at"], o["collapse_at"])
    cells = {}
    for c in _cells(g):
        rs = [g[k] for k in sorted(g) if k[:3] == c]
        row = {}
        for gain in (stats.LEARN_MIN_GAIN, min_gain):
            got = [learned_collapse_at(r, gain) for r in rs]
            row[gain] = (sum(t is not None for t, _ in got), sum(x is not None for _, x in got))
        cells[c] = row
    total = sum(row[min_gain][1] for row in cells.values())
    lines = [
        f"## Stage 5: learned collapses at a bar of +{min_gain:.2f}\n",
        "Runs that learned / learned, then collapsed, at the rule's bar (max(1.25×, +0.05)) "
        f"and at max(1.25×, +{min_gain:.2f}); stage 2's detector at 0.3 after learning.\n",
        f"| objective | arm | lr | at +0.05 | at +{min_gain:.2f} |",
        "|---|---|---|---|---|",
    ]
    for c, row in cells.items():
        a, b = row[stats.LEARN_MIN_GAIN], row[min_gain]
        lines.append(f"| {c[0]} | {c[1]} | {c[2]:g} | {a[0]} / {a[1]} | {b[0]} / {b[1]} |")
    lines += ["", f"Learned collapses at +{min_gain:.2f}: {total} of {len(g)} runs.\n"]
    return dict(cells=cells, total=total, lines=lines)


def s5_threshold(runs5: list[dict]) -> dict:
    """Rules 1-3 of stage 5 with stage 2's detector at its threshold 0.3 and at 0.5:
    learned collapses per cell, rule 2's and rule 3's one-sided Fisher p."""
    g = grid5(runs5)
    out = {}
    for frac in (0.3, 0.5):
        hits = {
            k: stage5_report.outcome(r, frac=frac)["outcome"] == stats.LEARNED_COLLAPSED
            for k, r in g.items()
        }

        def pooled(variant, arm):
            ks = [k for k in g if k[0] == variant and k[1] == arm]
            return sum(hits[k] for k in ks), len(ks)

        cell = {c: sum(hits[k] for k in g if k[:3] == c) for c in _cells(g)}
        rule3 = {}
        for arm in ("moe2", "dense2"):
            (hg, ng), (hm, nm) = pooled("grpo", arm), pooled("gmpo", arm)
            rule3[arm] = (hm, nm, hg, ng, stats.fisher_one_sided(hm, nm, hg, ng))
        rule2 = {}
        for v in ("grpo", "gmpo"):
            (a, na), (b, nb) = pooled(v, "moe2"), pooled(v, "dense2")
            p = stats.fisher_one_sided(b, nb, a, na), stats.fisher_one_sided(a, na, b, nb)
            rule2[v] = (a, na, b, nb) + p
        out[frac] = dict(
            cell=cell, rule1={c: n >= 2 for c, n in cell.items()}, rule2=rule2, rule3=rule3
        )
    lines = [
        "## Stage 5: the rules at detector threshold 0.5\n",
        "Learned collapses per cell (stage 5's detector with stage 2's at 0.3, the rule's, "
        "and at 0.5); rule 1 reproduces a cell at 2 of 4.\n",
        "| objective | arm | lr | at 0.3 | at 0.5 |",
        "|---|---|---|---:|---:|",
    ]
    for c in _cells(g):
        marks = [
            f"{out[f]['cell'][c]}{' (rule 1)' if out[f]['rule1'][c] else ''}" for f in (0.3, 0.5)
        ]
        lines.append(f"| {c[0]} | {c[1]} | {c[2]:g} | {marks[0]} | {marks[1]} |")
    lines.append("")
    for f in (0.3, 0.5):
        r3 = out[f]["rule3"]
        r2 = out[f]["rule2"]["grpo"]
        lines.append(
            f"- At {f}: rule 3 (GMPO against GRPO, pooled over both lrs, one-sided Fisher) "
            + "; ".join(
                f"{a} {v[0]}/{v[1]} against {v[2]}/{v[3]}, p = {v[4]:.3f}" for a, v in r3.items()
            )
            + f". Rule 2 under GRPO: MoE {r2[0]}/{r2[1]} against dense {r2[2]}/{r2[3]}, "
            f"p(MoE more prone) = {r2[4]:.2f}, p(dense more prone) = {r2[5]:.2f}."
        )
    return dict(out, lines=lines + [""])


def s5_pairs(runs5: list[dict]) -> dict:
    """GMPO's final held-out reward minus GRPO's, same architecture, lr and seed; and
    whether each pair starts from one warm start (equal held-out reward at RL step 0 and
    equal training reward at RL step 1, the warm start's own rollout)."""
    g = grid5(runs5)
    diff, odd = {}, []
    for (v, a, lr, s), r in sorted(g.items()):
        if v != "gmpo":
            continue
        q = g[("grpo", a, lr, s)]
        diff[(a, lr, s)] = float(r["eval_final"] - q["eval_final"])
        same = (
            r["eval_start"] == q["eval_start"]
            and series(r, "reward_mean")[0] == series(q, "reward_mean")[0]
        )
        if not same:
            odd.append((a, lr, s, q["eval_start"], r["eval_start"]))
    above = sum(d > 0 for d in diff.values())
    lines = [
        "## Stage 5: GMPO against GRPO, seed by seed\n",
        f"GMPO's final held-out reward is above GRPO's in {above} of {len(diff)} pairs of the "
        f"same architecture, lr and seed (differences {min(diff.values()):+.3f} to "
        f"{max(diff.values()):+.3f}); the two lrs' pairs of a seed share its warm start.",
    ]
    for a, lr, s, x, y in odd:
        lines.append(
            f"- Not from one warm start: {a}, lr {lr:g}, seed {s}: GRPO's held-out reward at "
            f"RL step 0 is {x:.4f}, GMPO's {y:.4f}, and their first rollouts differ."
        )
    return dict(above=above, n=len(diff), odd=odd, lines=lines + [""])


# --------------------------------------------------------------------------
# Stage 6.


def s6_c1(runs6: list[dict], runs_c1: list[dict]) -> dict:
    """Control C1 beside the grid on the dense twin: E (decoupled minus behaviour at
    k = 8, paired by seed) and each arm's distance from its sampler (behaviour_kl,
    seed means of the window means of `stage6_report.MOVEMENT`)."""
    out = {}
    for name, runs, sc in (
        ("16 updates (grid)", runs6, stage6_config.get_config()),
        ("4 updates (C1)", runs_c1, stage6_config.get_config("small_steps")),
    ):
        g = stage6_report.rules(runs, sc)
        mv = stage6_report.movement_table(runs, sc)
        row = dict(e=g["r2"]["dense2"]["e"], d={}, kl={})
        for v in ("behaviour", "decoupled_tis"):
            m = mv[("dense2", v, 8)]
            row["d"][v] = g["r1"][("dense2", v)]["d"]
            row["kl"][v] = (m["behaviour_kl, steps 11-20"], m["behaviour_kl, last 10"])
        row["ratio"] = row["kl"]["decoupled_tis"][1] / row["kl"]["behaviour"][1]
        out[name] = row
    lines = [
        "## Stage 6: control C1 beside the grid (dense twin, k = 8)\n",
        "D(8) per arm and E = final(decoupled_tis) − final(behaviour), paired by seed, with "
        "95% bootstrap intervals over the 3 seeds; the distance from the sampler "
        "(`behaviour_kl`, KL(π_behaviour‖π_proximal), seed means; under `behaviour` measured "
        "on the first update's mini-batch, under `decoupled` on the whole batch).\n",
        "| setting | D(8) behaviour | D(8) decoupled_tis | E | sampler distance, steps 11–20 "
        "(behaviour / decoupled) | last 10 (behaviour / decoupled) | ratio, last 10 |",
        "|---|---|---|---|---|---|---:|",
    ]
    for name, row in out.items():
        kb, kd = row["kl"]["behaviour"], row["kl"]["decoupled_tis"]
        lines.append(
            f"| {name} | {stats.fmt_ci(*row['d']['behaviour'])} "
            f"| {stats.fmt_ci(*row['d']['decoupled_tis'])} | {stats.fmt_ci(*row['e'])} "
            f"| {kb[0]:.2f} / {kd[0]:.2f} | {kb[1]:.2f} / {kd[1]:.2f} | {row['ratio']:.1f} |"
        )
    return dict(out, lines=lines + [""])


def s6_onset(runs6: list[dict], runs_c1: list[dict]) -> dict:
    """At k = 8, per architecture and arm: the seed mean, at each held-out evaluation, of
    the arm's reward minus its k = 0 run's (same seed and replay), in the grid and C1."""
    out = {}
    for name, runs, sc in (
        ("grid", runs6, stage6_config.get_config()),
        ("C1", runs_c1, stage6_config.get_config("small_steps")),
    ):
        idx = stage6_report.index(runs)
        for arm in sc.arms:
            for v in sc.variants:
                stale = stage6_report.cell_runs(idx, sc, arm, v, 8)
                ref = stage6_report.cell_runs(idx, sc, arm, v, 0)
                gaps = []
                for s in sorted(set(stale) & set(ref)):
                    (sa, ea), (sb, eb) = evals(stale[s]), evals(ref[s])
                    assert list(sa) == list(sb)
                    gaps.append(ea - eb)
                if gaps:
                    out[(name, arm, v)] = (list(sa), np.mean(gaps, axis=0))
    steps = next(iter(out.values()))[0]
    lines = [
        "## Stage 6: when the staleness loss appears\n",
        "At k = 8, the held-out reward minus the k = 0 run's of the same seed (and replay), "
        "seed means at each evaluation; at k = 8 the first 8 RL steps train on the warm "
        "start's samples.\n",
        "| setting | architecture | arm | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|---|---|" + "---:|" * len(steps),
    ]
    for (name, arm, v), (_, gap) in out.items():
        lines.append(f"| {name} | {arm} | {v} | " + " | ".join(f"{x:+.3f}" for x in gap) + " |")
    return dict(gaps=out, lines=lines + [""])


def s6_copies(runs5: list[dict], runs6: list[dict]) -> dict:
    """Each `copy_pairs` pair: the first RL step whose training reward differs, the
    relative difference of KL(π_old‖π_θ) at RL step 1, stage 2's detector on each and
    stage 5's outcome of the 250-step run; for a collapse, the first RL step whose
    training reward is below `GAP`."""
    rows = []
    for a, b in copy_pairs(runs5, runs6):
        ka, kb = series(a, "ppo_kl_klast")[0], series(b, "ppo_kl_klast")[0]
        low = [s for s, x in zip(a["steps"], series(a, "reward_mean")) if x < GAP]
        row = dict(name=f"{a['arm']} s{a['seed']}", part=first_difference(a, b, "reward_mean"))
        row.update(
            kl_rel=abs(ka - kb) / kb, collapse6=a["collapse_step"], collapse5=b["collapse_step"]
        )
        row["first_low"] = low[0] if a["collapse_step"] else None
        row["out5"] = [stage5_report.outcome(b, frac=f)["outcome"] for f in (0.3, 0.5)]
        rows.append(row)
    lines = [
        "## Stage 6: its k = 0 runs are copies of stage 5's runs\n",
        "Stage 6's k = 0 runs without replay (decoupled trust region, a behaviour weight of "
        "1 up to rounding) beside stage 5's GRPO runs of the same architecture and seed at "
        "lr 3e-4, which are the same computation along another code path.\n",
        "| run | training reward first differs at step | KL at step 1, relative difference "
        "| stage 6 (60 steps): collapse | stage 5 (250 steps): collapse; outcome at 0.3 / 0.5 |",
        "|---|---:|---:|---|---|",
    ]
    for r in rows:
        c6, c5 = "–", "–" if r["collapse5"] is None else f"step {r['collapse5']}"
        if r["collapse6"] is not None:
            c6 = f"step {r['collapse6']} (reward < {GAP} from step {r['first_low']})"
        o5 = " / ".join(r["out5"])
        lines.append(f"| {r['name']} | {r['part']} | {r['kl_rel']:.1e} | {c6} | {c5}; {o5} |")
    return dict(rows=rows, lines=lines + [""])


# --------------------------------------------------------------------------
# Stage 7.


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order."""
    order = np.argsort(pvalues)
    adj, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adj[i] = running
    return adj


def s7_tests(runs7: list[dict]) -> dict:
    """Rule 1's four tests (precision minus the f32 control, final held-out, paired by
    seed): the rule's percentile bootstrap, a two-sided one-sample t-test, an exact
    one-sided sign test in the direction of the mean, and Holm's correction of the
    t-tests over the four."""
    by = {(r["arm"], r["variant"], int(r["seed"])): r for r in runs7}
    tests = {}
    for arm in ("moe2", "dense2"):
        for p in ("bf16", "int8"):
            seeds = sorted(s for a, v, s in by if a == arm and v == p)
            d = np.array(
                [by[(arm, p, s)]["eval_final"] - by[(arm, "f32", s)]["eval_final"] for s in seeds]
            )
            k = int(np.sum(d < 0) if d.mean() < 0 else np.sum(d > 0))
            sign = sps.binomtest(k, int(np.sum(d != 0)), 0.5, alternative="greater").pvalue
            t = float(sps.ttest_1samp(d, 0.0).pvalue)
            tests[(arm, p)] = dict(d=d, ci=stats.bootstrap_ci(d), t=t, sign=float(sign))
    for t, h in zip(tests.values(), holm([t["t"] for t in tests.values()])):
        t["holm"] = h
    lines = [
        "## Stage 7: rule 1's tests beside a t-test, a sign test and Holm's correction\n",
        "| arm | precision | d_s per seed | bootstrap (the rule's) | t-test p (two-sided) "
        "| sign test p (one-sided) | t-test p, Holm over the four |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for (arm, p), t in tests.items():
        lines.append(
            f"| {arm} | {p} | {' '.join(f'{x:+.3f}' for x in t['d'])} | {stats.fmt_ci(*t['ci'])} "
            f"| {t['t']:.2f} | {t['sign']:.4g} | {t['holm']:.2f} |"
        )
    n = len(next(iter(tests.values()))["d"])
    lines += [
        "",
        f"With {n} seeds the smallest one-sided p a sign test can give is {0.5**n:.4f}, and "
        "the percentile bootstrap's interval excludes 0 whenever every seed has the same "
        "sign.\n",
    ]
    return dict(tests=tests, lines=lines)


def s7_mismatch(runs7: list[dict]) -> dict:
    """The train-inference KL against `R3_PAPER_KL`: at the warm start (the measurement,
    seed means) and during training per MoE arm (the share of RL steps above it, the
    largest step, each seed's mean over its last 10 steps)."""
    meas = common.read_jsonl(os.path.join(common.RESULTS, "stage7", "measure.jsonl"))
    warm = collections.defaultdict(list)
    for m in meas:
        warm[(m["arm"], m["precision"])].append(m["mismatch_kl"])
    warm = {k: float(np.mean(v)) for k, v in warm.items()}
    arms = collections.defaultdict(list)
    for r in sorted(runs7, key=lambda r: r["seed"]):
        if r["arm"] == "moe2" and r["variant"] != "f32":
            arms[r["variant"]].append(r)
    rows = {}
    for v, rs in arms.items():
        kls = [series(r, "mismatch_kl") for r in rs]
        allk = np.concatenate([k[~np.isnan(k)] for k in kls])
        last = [float(np.nanmean(k[-10:])) for k in kls]
        rows[v] = dict(share=float(np.mean(allk > R3_PAPER_KL)), top=float(allk.max()), last=last)
    lines = [
        f"## Stage 7: the mismatch against the R3 paper's {sci(R3_PAPER_KL)}\n",
        "At the warm start (the measurement, seed means): MoE bf16 "
        f"{sci(warm[('moe2', 'bf16')])} ({R3_PAPER_KL / warm[('moe2', 'bf16')]:.0f}× below), "
        f"int8 {sci(warm[('moe2', 'int8')])} ({R3_PAPER_KL / warm[('moe2', 'int8')]:.0f}× "
        "below). During training, per MoE arm over its 4 seeds' RL steps:\n",
        f"| arm | steps above {sci(R3_PAPER_KL)} | largest step | last 10 steps' mean, per seed |",
        "|---|---:|---:|---|",
    ]
    for v, row in rows.items():
        last = " ".join(sci(x, 3) for x in row["last"])
        lines.append(f"| {v} | {row['share']:.2%} | {sci(row['top'])} | {last} |")
    i8 = rows["int8"]["last"]
    lines += [
        "",
        f"int8's seed mean over the last 10 steps: {sci(np.mean(i8))} "
        f"({np.mean(i8) / R3_PAPER_KL:.0%} of {sci(R3_PAPER_KL)}).\n",
    ]
    return dict(warm=warm, rows=rows, lines=lines)


def s7_control(runs5: list[dict], runs7: list[dict]) -> dict:
    """Stage 7's f32 control runs beside stage 5's GRPO runs at lr 4.2e-4 of the same
    architecture and seed: the largest difference of any logged series over stage 7's
    steps (`corrections.max_difference`), and where stage 5's run collapsed later."""
    g = grid5(runs5)
    rows = []
    for r in sorted(runs7, key=lambda r: (r["arm"], r["seed"])):
        if r["variant"] != "f32":
            continue
        q = g[("grpo", r["arm"], LR_HIGH, int(r["seed"]))]
        o, n = stage5_report.outcome(q), len(r["steps"])
        row = dict(name=f"{r['arm']} s{r['seed']}", diff=max_difference(r, q, n), steps=n)
        row.update(starts=(r["eval_start"], q["eval_start"]), outcome=o["outcome"])
        rows.append(dict(row, collapse=o["collapse_at"]))
    same = sum(x["diff"] == 0 for x in rows)
    late = sorted(x["collapse"] for x in rows if x["collapse"] is not None)
    lines = [
        "## Stage 7: the f32 control is stage 5's runs\n",
        "Each f32 control run beside stage 5's GRPO run at lr 4.2e-4 of the same "
        f"architecture and seed, over stage 7's {rows[0]['steps']} RL steps:\n",
        "| run | max abs difference | held-out at step 0 (7 / 5) | stage 5 outcome (250 steps) |",
        "|---|---:|---|---|",
    ]
    for x in rows:
        c = f", after learning at step {x['collapse']}" if x["collapse"] else ""
        st = f"{x['starts'][0]:.4f} / {x['starts'][1]:.4f}"
        lines.append(f"| {x['name']} | {x['diff']:.3g} | {st} | {x['outcome']}{c} |")
    lines += [
        "",
        f"{same} of {len(rows)} are identical (every logged series but `step_time`); "
        f"{len(rows) - same} started from another warm start (held-out reward at step 0). "
        "Stage 5's "
        f"learned collapses of these runs come at RL steps {', '.join(map(str, late))}, after "
        f"stage 7's {rows[0]['steps']}.\n",
    ]
    return dict(rows=rows, same=same, late=late, lines=lines)


def sections() -> list[str]:
    """Every section above from the committed summaries, in the README's order."""
    runs5, runs6 = load("stage5/runs"), load("stage6/runs")
    runs_c1, runs7 = load("stage6_small_steps/runs"), load("stage7/runs")
    noise = s5_eval_noise(runs5, runs6)
    parts = [s5_progress(runs5), noise, s5_false_learning(runs5, noise), s5_bar(runs5)]
    parts += [s5_threshold(runs5), s5_pairs(runs5), s6_c1(runs6, runs_c1)]
    parts += [s6_onset(runs6, runs_c1), s6_copies(runs5, runs6), s7_tests(runs7)]
    parts += [s7_mismatch(runs7), s7_control(runs5, runs7)]
    head = ["# Stages 5, 6 and 7 (corrections of 2026-12-07)\n"]
    return head + [line for part in parts for line in part["lines"]]
