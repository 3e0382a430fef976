"""Stage 3 of the stability study: replay and the router-aware objectives
(experiments/stability/README.md, "Stage 3").

In the setting where the MoE collapses and its dense twin does not (stage 2, the
README's "Setting" rule), every arm (GRPO, GRPO+R2, GRPO+R3, GSPO at the calibrated
range, GMPO, RSPO with gamma floors 0.5 and 0.1, SAPO) is run from the MoE's warm start
for 5 seeds and 80 RL steps. Each run resumes from its own checkpoints in
``<root>/stage3/<arm>_s<seed>``; its compact summary (per-step series, collapse step,
final held-out reward) goes to ``<out>/runs/<arm>_s<seed>.jsonl`` when it finishes,
and a run with a summary is skipped.

The report applies the README's decision rule (one-sided Fisher exact test of each
arm's collapse count against GRPO's) and the precursors' lead times and false alarms,
each precursor with the threshold fixed in the README (`PRECURSORS`).

    PYTHONPATH=. python experiments/stability/stage3_replay.py --root runs/stability \
        --config experiments/stability/stage3_config.py:lr=0.003 \
        --only-seeds 0 --max-minutes 55                                 # one chunk
    PYTHONPATH=. python experiments/stability/stage3_replay.py --report
"""

from __future__ import annotations

import collections
import glob
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from experiments.stability import common, stage3_config  # noqa: E402

OUT = os.path.join(common.RESULTS, "stage3")
STAGE = "stage3"
STAGE2_RUNS = os.path.join(common.RESULTS, "stage2", "runs")

# --------------------------------------------------------------------------
# The decision rule: a one-sided Fisher exact test.


def fisher_one_sided(a_hits: int, a_n: int, b_hits: int, b_n: int) -> float:
    """P-value of "group a has fewer hits than group b" (one-sided Fisher exact test):
    with the margins fixed, the probability that a holds ``a_hits`` or fewer of the
    ``a_hits + b_hits`` hits, under the hypergeometric distribution.

    >>> round(fisher_one_sided(0, 5, 5, 5) * 252, 9)  # 1 / C(10, 5)
    1.0
    """
    for v, name in ((a_hits, "a_hits"), (a_n, "a_n"), (b_hits, "b_hits"), (b_n, "b_n")):
        if int(v) != v or v < 0:
            raise ValueError(f"{name}={v}: expected a non-negative integer")
    if a_hits > a_n or b_hits > b_n:
        raise ValueError(f"hits exceed runs: {a_hits}/{a_n}, {b_hits}/{b_n}")
    n, k = a_n + b_n, a_hits + b_hits
    total = math.comb(n, a_n)
    lo = max(0, k - b_n)
    return sum(math.comb(k, x) * math.comb(n - k, a_n - x) for x in range(lo, a_hits + 1)) / total


def prevents_collapse(arm_hits, arm_n, grpo_hits, grpo_n, alpha: float = 0.05):
    """README's rule: fewer collapses than GRPO with one-sided Fisher p < ``alpha``.
    Returns (p, decided)."""
    p = fisher_one_sided(arm_hits, arm_n, grpo_hits, grpo_n)
    return p, bool(arm_hits < grpo_hits and p < alpha)


def collapses(runs: list[dict]) -> int:
    return sum(bool(r["collapsed"]) for r in runs)


def preliminary(n_a: int, n_b: int, planned: int) -> str | None:
    """The mark of a comparison of ``n_a`` against ``n_b`` seeds while fewer than the
    ``planned`` are in (no verdict then); None once both have every seed."""
    n = min(n_a, n_b)
    return f"preliminary ({n} of {planned} seeds)" if n < planned else None


# --------------------------------------------------------------------------
# Precursors (README, "Decision rule"; thresholds fixed before the runs).

BASELINE_STEPS = 10  # the baseline: the median over the run's first 10 RL steps


class Precursor(collections.namedtuple("Precursor", "label key rule lo hi floor")):
    """``rule``: "above" (value > max(hi × baseline, floor)), "below_minus" (value <
    baseline − lo) or "outside" (value < lo × baseline or value > hi × baseline).
    ``floor`` keeps a baseline of 0 from making every positive value a crossing
    (README, amendment to stage 3's rule)."""


PRECURSORS = (
    Precursor("F(τ=2)", "frac_ratio_gt_2_klast", "above", None, 3.0, 0.01),
    Precursor("free flips", "flip_frac_klast", "above", None, 3.0, 0.01),
    Precursor("raw γ", "gamma_raw_mean_klast", "below_minus", 0.1, None, None),
    Precursor("token clip fraction", "clip_frac_klast", "above", None, 3.0, 0.01),
    Precursor("grad norm", "grad_norm", "above", None, 3.0, None),
    Precursor("entropy", "entropy", "outside", 0.5, 2.0, None),
    Precursor("KL", "ppo_kl_klast", "above", None, 3.0, 1e-3),
)


def _finite(v) -> bool:
    return v is not None and math.isfinite(float(v))


def baseline(steps, values, first: int = BASELINE_STEPS) -> float | None:
    """The median of ``values`` over RL steps 1..``first`` (None where none logged)."""
    base = [float(v) for s, v in zip(steps, values) if 1 <= s <= first and _finite(v)]
    return float(np.median(base)) if base else None


def crosses(value: float, base: float, p: Precursor) -> bool:
    """Whether ``value`` is past precursor ``p``'s threshold around ``base``."""
    if p.rule == "above":
        return value > max(p.hi * base, p.floor or 0.0)
    if p.rule == "below_minus":
        return value < base - p.lo
    if p.rule == "outside":
        return value < p.lo * base or value > p.hi * base
    raise ValueError(f"precursor {p.label}: unknown rule {p.rule!r}")


def first_crossing(steps, values, p: Precursor, first: int = BASELINE_STEPS) -> int | None:
    """The first RL step (any step of the run, the baseline's included) at which the
    series crosses ``p``'s threshold; None when it never does or has no baseline."""
    base = baseline(steps, values, first)
    if base is None:
        return None
    for s, v in zip(steps, values):
        if _finite(v) and crosses(float(v), base, p):
            return int(s)
    return None


def lead_time(collapse: int | None, crossing: int | None) -> int | None:
    """Collapse step minus first crossing (negative: it crossed after the collapse)."""
    if collapse is None or crossing is None:
        return None
    return int(collapse) - int(crossing)


def precursor_stats(runs: list[dict], p: Precursor) -> dict:
    """Over ``runs`` (summaries): the lead times of the collapsed runs in which ``p``
    crossed, how many collapsed runs it crossed in, and its false alarms (crossed in a
    run that did not collapse). Runs without the series are left out (``missing``)."""
    leads, crossed_c, n_c, alarms, n_ok, missing = [], 0, 0, 0, 0, 0
    for r in runs:
        values = r["series"].get(p.key)
        if values is None:
            missing += 1
            continue
        x = first_crossing(r["steps"], values, p)
        if r["collapsed"]:
            n_c += 1
            lt = lead_time(r["collapse_step"], x)
            if lt is not None:
                crossed_c += 1
                leads.append(lt)
        else:
            n_ok += 1
            alarms += x is not None
    return dict(
        leads=leads,
        median=float(np.median(leads)) if leads else None,
        range=(min(leads), max(leads)) if leads else None,
        crossed=crossed_c,
        collapsed=n_c,
        false_alarms=alarms,
        not_collapsed=n_ok,
        missing=missing,
    )


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


# --------------------------------------------------------------------------
# The setting (README, "Setting") from stage 2's results.


# The setting rule's thresholds (README, Stage 3, "Setting").
SETTING_MOE_RATE, SETTING_DENSE_RATE = 2 / 3, 1 / 3


def setting_lr(runs: list[dict], arm: str = "moe2", dense: str = "dense2") -> float | None:
    """The smallest stage-2 lr at which ``arm``'s GRPO collapse rate is >= 2/3 and
    ``dense``'s <= 1/3 (both with runs at that lr); None if no lr qualifies."""
    flags = _grpo_flags(runs)
    for lr in sorted({lr for _, lr in flags}):
        m, d = flags.get((arm, lr)), flags.get((dense, lr))
        if (
            m
            and d
            and np.mean(m) >= SETTING_MOE_RATE - 1e-9
            and np.mean(d) <= SETTING_DENSE_RATE + 1e-9
        ):
            return lr
    return None


def _grpo_flags(runs: list[dict]) -> dict:
    flags = collections.defaultdict(list)
    for r in runs:
        if r.get("variant") == "grpo":
            flags[(r["arm"], float(r["lr"]))].append(bool(r["collapsed"]))
    return flags


def setting_status(moe: list[bool], dense: list[bool], seeds: int) -> str:
    """One lr of a grid planned with ``seeds`` runs per architecture, read on the runs
    so far: "qualifies" when the setting rule holds whatever the missing runs show,
    "cannot" when it fails whatever they show, "open" otherwise."""
    if len(moe) > seeds or len(dense) > seeds:
        raise ValueError(f"{len(moe)} MoE and {len(dense)} dense runs: more than {seeds} seeds")
    need = math.ceil(SETTING_MOE_RATE * seeds - 1e-9)  # MoE collapses the rule needs
    allow = math.floor(SETTING_DENSE_RATE * seeds + 1e-9)  # dense collapses it allows
    if sum(moe) + seeds - len(moe) < need or sum(dense) > allow:
        return "cannot"
    if sum(moe) >= need and sum(dense) + seeds - len(dense) <= allow:
        return "qualifies"
    return "open"


def setting_verdict(
    runs: list[dict], lrs, seeds: int, arm: str, dense: str
) -> tuple[str, float | None, dict[float, str]]:
    """The setting rule on a grid that may be unfinished: ``("found", lr, status)`` when
    every smaller lr cannot qualify and ``lr`` does, ``("none", None, status)`` when no
    lr can, ``("open", lr, status)`` with the smallest lr still open otherwise; ``status``
    maps each lr to `setting_status`."""
    flags = _grpo_flags(runs)
    status = {
        float(lr): setting_status(
            flags.get((arm, float(lr)), []), flags.get((dense, float(lr)), []), seeds
        )
        for lr in sorted(lrs)
    }
    for lr, st in status.items():
        if st != "cannot":
            return ("found" if st == "qualifies" else "open"), lr, status
    return "none", None, status


def check_setting(sc, stage2_runs: str = STAGE2_RUNS) -> None:
    """Refuses to run without the setting's learning rate (chosen from stage 2)."""
    if sc.lr is not None:
        return
    hint = ""
    paths = sorted(glob.glob(os.path.join(stage2_runs, "*.jsonl")))
    if paths:
        runs = [r for p in paths for r in common.read_jsonl(p)]
        lr = setting_lr(runs, sc.arm, sc.dense_arm)
        hint = (
            f" Stage 2's results ({stage2_runs}) give lr={lr:g} for {sc.arm}/{sc.dense_arm}."
            if lr is not None
            else f" Stage 2's results ({stage2_runs}) give none for {sc.arm}/{sc.dense_arm}: "
            "the README's fallbacks come next, each a GRPO frontier "
            "(stage2_frontier.py --config experiments/stability/stage2_config.py:search=<name>, "
            "results in results/stage2_search/<name>) read by the same rule: search=moe4 "
            "(then arm=moe4,dense_arm=dense4), search=moe2k1 (arm=moe2k1), search=updates32 "
            "(updates=32), search=hard (task=hard)."
        )
    raise SystemExit(
        "stage 3: the setting's learning rate is not given. It is chosen from stage 2 by "
        'the README\'s rule (experiments/stability/README.md, Stage 3, "Setting": the '
        "smallest stage-2 lr at which moe2 GRPO's collapse rate is >= 2/3 and dense2 "
        "GRPO's <= 1/3); pass it as "
        "--config experiments/stability/stage3_config.py:lr=<lr>." + hint
    )


# --------------------------------------------------------------------------
# Runs.


def table_rows(sc) -> dict:
    return {row[0]: row for row in sc.table}


def model_arm(sc, name: str) -> str:
    return sc.dense_arm if name in stage3_config.DENSE_ARMS else sc.arm


def overrides(sc, name: str, lr: float | None = None) -> dict:
    """The config overrides of arm ``name`` in the setting (at ``lr``, the setting's by
    default)."""
    rows = table_rows(sc)
    if name not in rows:
        raise ValueError(f"arm {name!r}: expected one of {sorted(rows)}")
    _, objective, hparams, replay, gamma_min = rows[name]
    if gamma_min is not None:  # RSPO's floor
        hparams = (*hparams, ("gamma_min", float(gamma_min)))
    o = {
        "objective": (objective, dict(hparams)),
        "model.dtype": sc.dtype,
        "optimizer.lr": float(sc.lr if lr is None else lr),
        "updates.num_minibatches": int(sc.updates),
        "updates.routing_replay": replay,
    }
    return o


# --------------------------------------------------------------------------
# The KL-matched controls (README, Stage 3, "The KL-matched GRPO control" and "... GSPO
# control").

KL_KEY = "ppo_kl_klast"  # KL(pi_old || pi_theta) after a rollout's last update


def kl_matched_lr(
    grid_runs: list[dict], target_runs: list[dict], arm: str = "moe2", variant: str = "grpo"
) -> dict:
    """The lr at which an objective's first-rollout KL matches the target arm's: the seed
    median of the first-rollout KL of ``arm`` under stage 2's objective ``variant`` at each
    lr of its grid (``grid_runs``),
    interpolated linearly in log KL against log lr to the seed median of the target's
    (``target_runs``, stage-3 summaries). Returns ``lr``, ``target_kl`` and the ``grid``
    (lr -> median KL); refuses a target outside the grid or a grid whose KL does not
    rise with lr between the two points it interpolates."""
    by_lr = collections.defaultdict(list)
    for r in grid_runs:
        if r.get("variant") == variant and r.get("arm") == arm:
            v = first_step(r, KL_KEY)
            if v is not None and v > 0:
                by_lr[float(r["lr"])].append(v)
    grid = {lr: float(np.median(v)) for lr, v in sorted(by_lr.items())}
    target = [first_step(r, KL_KEY) for r in target_runs]
    target = [v for v in target if v is not None and v > 0]
    if len(grid) < 2 or not target:
        raise ValueError(
            f"KL matching needs {arm} {variant}'s first-rollout KL at two or more grid lrs "
            f"(got {sorted(grid)}) and the target arm's (got {len(target)} runs)"
        )
    t = float(np.median(target))
    lrs = list(grid)
    for lo, hi in zip(lrs, lrs[1:]):
        a, b = grid[lo], grid[hi]
        if min(a, b) <= t <= max(a, b):
            if not a < b:
                raise ValueError(
                    f"{variant}'s KL falls from lr {lo:g} ({a:.3g}) to {hi:g} ({b:.3g})"
                )
            w = (math.log(t) - math.log(a)) / (math.log(b) - math.log(a))
            lr = math.exp(math.log(lo) + w * (math.log(hi) - math.log(lo)))
            return dict(lr=float(f"{lr:.4g}"), target_kl=t, grid=grid)
    raise ValueError(
        f"the target's first-rollout KL {t:.3g} is outside {variant}'s on its lr grid "
        f"({', '.join(f'{lr:g}: {k:.3g}' for lr, k in grid.items())})"
    )


KL_GRID = "kl_grid"  # <out>/kl_grid: the one-step lr grids `run_kl_grid` makes


def grid_name(objective: str, lr: float, seed: int) -> str:
    return f"{objective}_lr{lr:g}_s{seed}"


def run_kl_grid(sc, objective: str, root: str, out: str, budget: common.Budget, log=print) -> int:
    """The one-step lr grid of ``objective`` (README, "The KL-matched SAPO control"): one
    RL step, the first rollout's updates, at each of `stage3_config.KL_GRID_LRS` and
    seeds (those of ``sc.seeds`` among `stage3_config.KL_GRID_SEEDS`), from the setting's
    MoE warm starts, with the objective's stage-3 hyperparameters. Each summary (as
    stage 2's: ``arm`` the model, ``variant`` the objective) goes to
    ``<out>/kl_grid/<objective>_lr<lr>_s<seed>.jsonl``; one with a summary is skipped.
    Returns the number of runs done."""
    check_setting(sc)
    arms = [row[0] for row in sc.table if row[1] == objective and row[3] == "none"]
    if not arms:
        raise SystemExit(f"--kl-grid {objective!r}: no stage-3 arm has that objective")
    done = 0
    for seed in [s for s in stage3_config.KL_GRID_SEEDS if s in sc.seeds]:
        for lr in stage3_config.KL_GRID_LRS:
            name = grid_name(objective, lr, seed)
            path = os.path.join(out, KL_GRID, name + ".jsonl")
            if os.path.exists(path):
                continue
            if budget.expired():
                return done
            wd = common.run_rl(
                root,
                stage_name(sc) + "_" + KL_GRID,
                name,
                sc.arm,
                int(seed),
                overrides(sc, arms[0], lr),
                1,
                smoke=sc.smoke,
                task=sc.task,
            )
            meta = dict(
                arm=sc.arm,
                variant=objective,
                lr=float(lr),
                seed=int(seed),
                updates=int(sc.updates),
                task=sc.task,
                dtype=sc.dtype,
            )
            summary = common.summarize_run(wd, meta)
            common.write_jsonl(path, [summary])
            log(f"{name}: first-rollout KL {first_step(summary, KL_KEY)}")
            done += 1
    return done


def matched_arm_lr(sc, name: str, out: str, stage2_runs: str = STAGE2_RUNS) -> dict:
    """`kl_matched_lr` for the KL-matched arm ``name`` from the committed stage-2 runs
    and one-step grids (``<out>/kl_grid``) and the summaries of the arm it matches,
    which must hold every planned seed."""
    objective, target = stage3_config.KL_MATCHED[name]
    runs = [r for r in common.read_records(os.path.join(out, "runs")) if r["arm"] == target]
    missing = sorted(set(common.planned_seeds(sc)) - {r["seed"] for r in runs})
    if missing:
        raise SystemExit(
            f"{name} matches {target}'s first-rollout KL, and {out}/runs lacks {target}'s "
            f"seeds {missing}: run `--only-arms {target}` first"
        )
    grid = common.read_records(stage2_runs) + common.read_records(os.path.join(out, KL_GRID))
    return kl_matched_lr(grid, runs, sc.arm, objective)


def matched_verdict(hits: int, n: int, arm_hits: int, arm_n: int, planned: int) -> tuple:
    """The KL-matched control's rule for one arm that prevented the collapse: "not the
    step" if the control collapses more often with one-sided Fisher p < 0.05, "the step
    can explain it" if it collapses in at most a fifth of its seeds (1 of 5),
    "inconclusive" otherwise; "preliminary" before every planned seed is in. Returns
    (p, verdict)."""
    p, fewer = prevents_collapse(arm_hits, arm_n, hits, n)
    if short := preliminary(n, arm_n, planned):
        return p, short
    if fewer:
        return p, "**not explained by the smaller step**"
    if hits <= n / 5:
        return p, "the smaller step can explain it"
    return p, "inconclusive"


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
        ci = common.fmt_ci(*common.bootstrap_ci(finals)) if finals else "-"
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


def run_name(name: str, seed: int) -> str:
    return f"{name}_s{seed}"


def setting_meta(sc) -> dict:
    return dict(
        lr=float(sc.lr),
        updates=int(sc.updates),
        setting=f"{sc.arm}/{sc.dense_arm}",
        task=sc.task,
        dtype=sc.dtype,
        seeds=len(common.planned_seeds(sc)),  # a verdict needs every one
    )


def stage_name(sc) -> str:
    """Where the runs live under ``--root`` and the results under ``results/``:
    ``stage3``, or ``stage3_gpu`` for the GPU replication."""
    return STAGE if sc.scale == "cpu" else f"{STAGE}_{sc.scale}"


def run_all(
    sc, root: str, out: str, budget: common.Budget, log=print, stage2_runs: str = STAGE2_RUNS
) -> int:
    """Every (arm, seed) without a summary, seed by seed (a chunk that ends early leaves
    whole seeds), until the budget expires. Returns the number of runs done. A
    KL-matched arm runs at the lr `kl_matched_lr` gives from ``stage2_runs`` and the
    summaries of the arm it matches in ``<out>/runs``."""
    check_setting(sc)
    rows = table_rows(sc)
    base = setting_meta(sc)
    matched = {}  # KL-matched arm -> its lr, fixed from the committed runs on first use
    done = 0
    for seed in sc.seeds:
        for name in sc.arms:
            setting = base
            if name in stage3_config.KL_MATCHED:
                if name not in matched:
                    matched[name] = matched_arm_lr(sc, name, out, stage2_runs)
                setting = dict(setting, lr=matched[name]["lr"])
            path = os.path.join(out, "runs", run_name(name, seed) + ".jsonl")
            if os.path.exists(path):
                old = common.read_jsonl(path)[0]
                if any(old.get(k) != v for k, v in setting.items()):
                    raise SystemExit(
                        f"{path}: a run of another setting "
                        f"({ {k: old.get(k) for k in setting} }, now {setting}); "
                        "use another --out and --root"
                    )
                continue
            if budget.expired():
                return done
            arm = model_arm(sc, name)
            wd = common.run_rl(
                root,
                stage_name(sc),
                run_name(name, seed),
                arm,
                int(seed),
                overrides(sc, name, setting["lr"]),
                int(sc.steps),
                smoke=sc.smoke,
                task=sc.task,
            )
            _, objective, _, replay, gamma_min = rows[name]
            if name in matched:
                setting = dict(setting, kl_matched=matched[name])
            meta = dict(
                setting,
                arm=name,
                model=arm,
                objective=objective,
                replay=replay,
                gamma_min=gamma_min,
                seed=int(seed),
            )
            summary = common.summarize_run(wd, meta)
            common.write_jsonl(path, [summary])
            log(
                f"{run_name(name, seed)}: collapsed={summary['collapsed']} at "
                f"{summary['collapse_step']}, held-out {summary['eval_start']} -> "
                f"{summary['eval_final']}"
            )
            done += 1
    return done


# --------------------------------------------------------------------------
# Report.


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


def table(groups: dict[str, list[dict]]) -> str:
    """The decision rule's table: each arm against GRPO on the MoE; a dense-twin control
    (``gmpo_dense``) against GRPO on the dense twin; the dense reference is only shown."""
    lines = [
        "| arm | collapsed / seeds | one-sided Fisher p vs GRPO | prevents the collapse "
        "| median collapse update | final held-out reward [95% CI] |",
        "|---|---:|---:|---|---:|---|",
    ]
    for arm, rs in groups.items():
        hits, n = collapses(rs), len(rs)
        control = arm in stage3_config.DENSE_ARMS and arm != stage3_config.DENSE_REFERENCE
        against = stage3_config.DENSE_REFERENCE if control else "grpo"
        ref = groups.get(against)
        if ref is None or arm == against:
            p_txt, dec = "-", "-"
        else:
            p, yes = prevents_collapse(hits, n, collapses(ref), len(ref))
            p_txt, dec = f"{p:.3g}", "**yes**" if yes else "no"
            planned = max(r.get("seeds", 0) for r in rs + ref)
            dec = preliminary(n, len(ref), planned) or dec
            if control:
                p_txt, dec = f"{p_txt} (vs {against})", f"{dec} (on the dense twin)"
            if arm == stage3_config.DENSE_REFERENCE:  # the dense twin: not an arm of the rule
                dec = "(dense reference)"
        upd = [r["collapse_step"] * r["updates"] for r in rs if r["collapsed"]]
        med = f"{np.median(upd):g}" if upd else "-"
        finals = [r["eval_final"] for r in rs if r["eval_final"] is not None]
        ci = common.fmt_ci(*common.bootstrap_ci(finals)) if finals else "-"
        lines.append(f"| {arm} | {hits} / {n} | {p_txt} | {dec} | {med} | {ci} |")
    return "\n".join(lines) + "\n"


def precursor_table(groups: dict[str, list[dict]]) -> str:
    head = "| arm | " + " | ".join(p.label for p in PRECURSORS) + " |"
    lines = [head, "|---|" + "---|" * len(PRECURSORS)]
    everything = [r for rs in groups.values() for r in rs]
    # A collapse inside the baseline window drags the baseline itself down (a collapsed
    # run's series fall to 0), so its lead times are artefacts; the last row keeps the
    # collapses after the window and every run that did not collapse.
    clean = [r for r in everything if not r["collapsed"] or r["collapse_step"] > BASELINE_STEPS]
    late = f"all arms, collapses after step {BASELINE_STEPS}"
    for arm, rs in list(groups.items()) + [("all arms", everything), (late, clean)]:
        cells = [fmt_precursor(precursor_stats(rs, p)) for p in PRECURSORS]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fig_reward_vs_updates(groups: dict[str, list[dict]], path: str, title: str = "") -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (arm, rs) in enumerate(groups.items()):
        curves = [eval_curve(r) for r in rs]
        steps = sorted({s for c in curves for s in c})
        if not steps:
            continue
        stats = np.asarray([common.bootstrap_ci([c[s] for c in curves if s in c]) for s in steps])
        x = np.asarray(steps) * rs[0]["updates"]
        other = arm in stage3_config.DENSE_ARMS or arm in stage3_config.KL_MATCHED
        ls = "--" if other else "-"
        ax.plot(x, stats[:, 0], ls, marker="o", ms=3, color=f"C{i}", label=f"{arm} ({len(rs)})")
        ax.fill_between(x, stats[:, 1], stats[:, 2], color=f"C{i}", alpha=0.15)
    ax.set_xlabel("optimizer updates (RL step × updates per rollout)")
    ax.set_ylabel("held-out reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(
        title + "Held-out reward: seed mean, band: 95% bootstrap interval (seeds)", fontsize=9
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
    pts = [(s, float(v)) for s, v in zip(run["steps"], values) if _finite(v)]
    x = np.asarray([s - run["collapse_step"] for s, _ in pts], np.float64)
    v = np.asarray([v for _, v in pts], np.float64)
    if p.rule == "below_minus":
        return x, v - base
    with np.errstate(divide="ignore", invalid="ignore"):
        return x, v / base if base != 0 else np.full_like(v, np.nan)


def fig_precursors(groups: dict[str, list[dict]], path: str) -> None:
    plt = _plt()
    cols = 4
    rows = math.ceil(len(PRECURSORS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows), squeeze=False)
    colors = {arm: f"C{i}" for i, arm in enumerate(groups)}
    drawn = set()
    for j, p in enumerate(PRECURSORS):
        ax = axes[j // cols][j % cols]
        n = 0
        for arm, rs in groups.items():
            for r in rs:
                xy = aligned(r, p)
                if xy is None:
                    continue
                ax.plot(*xy, lw=0.9, color=colors[arm], label=None if arm in drawn else arm)
                drawn.add(arm)
                n += 1
        ax.axvline(0, color="k", lw=0.6)
        if p.rule == "below_minus":
            ax.axhline(-p.lo, color="C3", ls=":", lw=0.8)
            ax.set_ylabel("value − baseline", fontsize=7)
        else:
            for t in (p.lo, p.hi):
                if t is not None:
                    ax.axhline(t, color="C3", ls=":", lw=0.8)
            ax.set_ylabel("value / baseline", fontsize=7)
            if n:
                ax.set_yscale("log")
        ax.set_title(f"{p.label} ({p.key})", fontsize=8)
        ax.set_xlabel("RL steps relative to the collapse", fontsize=7)
        ax.grid(alpha=0.3)
        if not n:
            ax.text(0.5, 0.5, "no collapsed run", ha="center", va="center", transform=ax.transAxes)
    for j in range(len(PRECURSORS), rows * cols):
        axes[j // cols][j % cols].axis("off")
    if drawn:
        fig.legend(fontsize=7, loc="lower right")
    fig.suptitle(
        "Precursors aligned on each collapsed run's collapse step (baseline: median of "
        f"RL steps 1..{BASELINE_STEPS}; dotted: thresholds)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def first_step(run: dict, key: str) -> float | None:
    """A series' value at RL step 1: after the first rollout's updates, which every arm
    of a seed takes from the same warm start on the same rollout batch."""
    values = run["series"].get(key)
    if not values or 1 not in run["steps"]:
        return None
    v = values[run["steps"].index(1)]
    return float(v) if _finite(v) else None


def step_taken_table(groups: dict[str, list[dict]]) -> str:
    """How far each arm moves the policy on its first rollout: KL(pi_old || pi_theta)
    (``ppo_kl``) and F(tau=2) at the rollout's last update, and KL's ratio to GRPO's on
    the same seed (same start, same batch). Descriptive: no rule reads it."""
    grpo = {r["seed"]: first_step(r, KL_KEY) for r in groups.get("grpo", [])}
    lines = [
        "| arm | seeds | KL after the first rollout [range] | F(τ=2) [range] "
        "| KL / MoE GRPO's, same seed [range] |",
        "|---|---:|---|---|---|",
    ]

    def cell(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return "-"
        return f"{np.median(xs):.3g} [{min(xs):.3g}, {max(xs):.3g}]"

    for arm, rs in groups.items():
        kl = [first_step(r, KL_KEY) for r in rs]
        f2 = [first_step(r, "frac_ratio_gt_2_klast") for r in rs]
        ratio = [
            k / grpo[r["seed"]]
            for k, r in zip(kl, rs)
            if k is not None and grpo.get(r["seed"]) not in (None, 0.0)
        ]
        lines.append(f"| {arm} | {len(rs)} | {cell(kl)} | {cell(f2)} | {cell(ratio)} |")
    return "\n".join(lines) + "\n"


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
            title="KL-matched controls (dashed). ",
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


def main(argv=None) -> None:
    only = ("arms", "seeds")
    ap = common.stage_parser(__doc__, OUT, "stage3_config.py", only)
    ap.add_argument(
        "--kl-grid",
        metavar="OBJECTIVE",
        help="run OBJECTIVE's one-step lr grid for a KL-matched control, not the arms",
    )
    args = ap.parse_args(argv)
    if args.report:  # the report reads --out alone: the config needs stage 2's choice
        report(args.out)
        return
    sc = common.stage_config(args, only, known={"arms": table_rows})
    if sc.scale != "cpu" and args.out == OUT:
        args.out = os.path.join(common.RESULTS, stage_name(sc))
    if args.kl_grid:
        n = run_kl_grid(sc, args.kl_grid, args.root, args.out, common.Budget(args.max_minutes))
        print(f"stage 3: {n} one-step {args.kl_grid} runs finished into {args.out}/{KL_GRID}")
        return
    n = run_all(sc, args.root, args.out, common.Budget(args.max_minutes))
    print(f"stage 3: {n} runs finished into {args.out}")


if __name__ == "__main__":
    main()
