"""Stage 9 of the stability study: collapse as a hazard (experiments/stability/README.md).

Two parts, each resuming chunk by chunk:

* ``--pilot``: moe2 GRPO at the candidate learning rates in turn, on seeds the grid
  does not use, until the pilot's rule (`stage9_report.pilot_choice`) picks the rate.
  Records in ``<out>/pilot/``.
* the grid: moe2 GRPO, moe2 GMPO and dense2 GRPO at the chosen rate, seed by seed
  (the three cells of a seed together, so that a grid stopped early stays balanced),
  ``steps`` RL steps each from the stage's warm starts. Records in ``<out>/runs/``.

The report (``--report``) reads both: Kaplan-Meier curves per cell, the log-rank
comparisons with Holm's correction, and their sensitivity to the event's definition;
and stage 5's runs read the same way (post hoc).

    taskset -c 0 python -m experiments.stability.stage9_hazard --pilot \
        --root runs/stability --only-seeds 100,101 --max-minutes 55    # beside 102,103
    taskset -c 0 python -m experiments.stability.stage9_hazard --root runs/stability \
        --only-arms moe2 --max-minutes 55
    python -m experiments.stability.stage9_hazard --report
"""

from __future__ import annotations

import os

from experiments.stability import common, stage5_learn_collapse, stage9_report

OUT = os.path.join(common.RESULTS, "stage9")
STAGE = "stage9"


def _run(sc, arm: str, variant: str, lr: float, seed: int, part: str) -> common.GridRun:
    name = stage5_learn_collapse.run_name(arm, variant, lr, seed)
    meta = dict(
        arm=arm,
        variant=variant,
        lr=float(lr),
        seed=int(seed),
        updates=int(sc.updates),
        steps=int(sc.steps),
        task=sc.task,
        part=part,
    )
    overrides = stage5_learn_collapse.overrides(sc, variant, lr)
    return common.GridRun(name, arm, int(seed), overrides, int(sc.steps), meta, sc.task)


def pilot_runs(sc, lr: float, seeds=None):
    """The pilot's runs at ``lr``: its arm and objective on each pilot seed (or on
    ``seeds``, this process's share of them)."""
    p = sc.pilot
    for seed in p.seeds if seeds is None else seeds:
        yield _run(sc, p.arm, p.variant, lr, seed, "pilot")


def grid(sc):
    """The grid's runs in the order they run: seed by seed, the three cells of a seed
    together. Refused until the pilot has set ``lr``."""
    if sc.lr is None:
        raise SystemExit(
            "stage 9: config.lr is not set; run the pilot (--pilot) and commit the rate "
            "its rule picks (stage9_report.pilot_choice) to stage9_config.py first"
        )
    for seed in sc.seeds:
        for arm, variant in sc.cells:
            if arm in sc.arms and variant in sc.variants:
                yield _run(sc, arm, variant, sc.lr, seed, "grid")


def describe(summary: dict) -> str:
    t, seen = stage9_report.primary_event(summary)
    what = f"event at step {t}" if seen else f"censored at step {t}"
    return f"{what}; held-out {summary['eval_start']} -> {summary['eval_final']}"


def _run_into(sc, runs, root: str, folder: str, budget: common.Budget, log) -> int:
    """`common.run_grid` of ``runs`` with their summaries in ``folder``."""
    return common.run_grid(
        runs,
        root,
        STAGE,
        folder,
        budget,
        smoke=sc.smoke,
        check=common.same_setting,
        describe=describe,
        log=log,
    )


def run_pilot(sc, root: str, out: str, budget: common.Budget, seeds=None, log=print) -> int:
    """The pilot's runs (of ``seeds``, by default every pilot seed), rate by rate, until
    its rule, which reads every pilot seed's run, has an answer or the budget ends."""
    p, folder = sc.pilot, os.path.join(out, "pilot")
    done = 0
    for lr in p.lrs:
        done += _run_into(sc, pilot_runs(sc, lr, seeds), root, folder, budget, log)
        records = common.read_records(folder)
        choice = stage9_report.pilot_choice(sc, records)
        # A rate's runs still missing (another process runs them, or the budget ended):
        # the next rate waits for the rule, which needs them all.
        waiting = len(stage9_report.cell_runs(records, p.arm, p.variant, lr)) < len(p.seeds)
        if choice is not None or waiting or budget.expired():
            log(f"stage 9 pilot: {'rate ' + format(choice, 'g') if choice else 'not decided yet'}")
            return done
    return done


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    return _run_into(sc, grid(sc), root, os.path.join(out, "runs"), budget, log)


def main(argv=None) -> None:
    only = ("arms", "variants", "seeds")
    ap = common.stage_parser(__doc__, OUT, "stage9_config.py", only)
    ap.add_argument("--pilot", action="store_true", help="the pilot that sets the rate")
    known = {"seeds": lambda c: tuple(c.seeds) + tuple(c.pilot.seeds)}
    args = ap.parse_args(argv)
    sc = common.stage_config(args, only, known)
    if args.report:
        stage9_report.report(args.out, sc)
        return
    budget = common.Budget(args.max_minutes)
    if args.pilot:
        seeds = tuple(s for s in sc.pilot.seeds if s in sc.seeds) if args.only_seeds else None
        n = run_pilot(sc, args.root, args.out, budget, seeds)
        print(f"stage 9: {n} pilot runs into {args.out}/pilot")
        return
    n = run_all(sc, args.root, args.out, budget)
    print(f"stage 9: {n} runs finished into {args.out}/runs")


if __name__ == "__main__":
    main()
