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

    python -m experiments.stability.stage3_replay --root runs/stability \
        --config experiments/stability/stage3_config.py:lr=0.003 \
        --only-seeds 0 --max-minutes 55                                 # one chunk
    python -m experiments.stability.stage3_replay --report
"""

from __future__ import annotations

import glob
import os

from experiments.stability import common, stage3_config, stage3_report
from experiments.stability.stage3_rules import KL_KEY, first_step, kl_matched_lr, setting_lr

OUT = os.path.join(common.RESULTS, "stage3")
STAGE = "stage3"
STAGE2_RUNS = os.path.join(common.RESULTS, "stage2", "runs")


# --------------------------------------------------------------------------
# The setting's learning rate, chosen from stage 2.


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


def grid(sc, out: str, stage2_runs: str = STAGE2_RUNS):
    """The stage's runs, seed by seed (a chunk that ends early leaves whole seeds). A
    KL-matched arm runs at the lr `kl_matched_lr` gives from ``stage2_runs`` and the
    summaries of the arm it matches in ``<out>/runs``, fixed on first use."""
    rows = table_rows(sc)
    base = setting_meta(sc)
    matched = {}  # KL-matched arm -> its lr, fixed from the committed runs on first use
    for seed in sc.seeds:
        for name in sc.arms:
            setting = base
            if name in stage3_config.KL_MATCHED:
                if name not in matched:
                    matched[name] = matched_arm_lr(sc, name, out, stage2_runs)
                setting = dict(setting, lr=matched[name]["lr"], kl_matched=matched[name])
            arm = model_arm(sc, name)
            _, objective, _, replay, gamma_min = rows[name]
            meta = dict(
                setting,
                arm=name,
                model=arm,
                objective=objective,
                replay=replay,
                gamma_min=gamma_min,
                seed=int(seed),
            )
            yield common.GridRun(
                run_name(name, seed),
                arm,
                int(seed),
                overrides(sc, name, setting["lr"]),
                int(sc.steps),
                meta,
                sc.task,
            )


def run_all(
    sc, root: str, out: str, budget: common.Budget, log=print, stage2_runs: str = STAGE2_RUNS
) -> int:
    """Every (arm, seed) of `grid` without a summary in ``<out>/runs``, until the
    budget expires. Returns the number of runs done. A summary of another setting (lr,
    updates, arms, task, dtype or seeds) is refused."""
    check_setting(sc)
    keys = list(setting_meta(sc))

    def same_setting(path: str, old: dict, run: common.GridRun) -> None:
        setting = {k: run.meta[k] for k in keys}
        if any(old.get(k) != v for k, v in setting.items()):
            raise SystemExit(
                f"{path}: a run of another setting "
                f"({ {k: old.get(k) for k in setting} }, now {setting}); "
                "use another --out and --root"
            )

    return common.run_grid(
        grid(sc, out, stage2_runs),
        root,
        stage_name(sc),
        os.path.join(out, "runs"),
        budget,
        smoke=sc.smoke,
        check=same_setting,
        log=log,
    )


# --------------------------------------------------------------------------
# The KL-matched controls' runs.


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
    runs = (
        common.GridRun(
            grid_name(objective, lr, seed),
            sc.arm,
            int(seed),
            overrides(sc, arms[0], lr),
            1,
            dict(
                arm=sc.arm,
                variant=objective,
                lr=float(lr),
                seed=int(seed),
                updates=int(sc.updates),
                task=sc.task,
                dtype=sc.dtype,
            ),
            sc.task,
        )
        for seed in [s for s in stage3_config.KL_GRID_SEEDS if s in sc.seeds]
        for lr in stage3_config.KL_GRID_LRS
    )
    return common.run_grid(
        runs,
        root,
        stage_name(sc) + "_" + KL_GRID,
        os.path.join(out, KL_GRID),
        budget,
        smoke=sc.smoke,
        describe=lambda summary: f"first-rollout KL {first_step(summary, KL_KEY)}",
        log=log,
    )


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
        stage3_report.report(args.out)
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
