"""Stage 5 of the stability study: learn, then collapse (experiments/stability/README.md).

Two parts, each resuming chunk by chunk:

* ``--probes``: stage 1's drift probes at low learning rates (3e-5, 1e-4) with three
  times stage 1's rollouts per cell, on rollout batches stage 1 did not use, to test
  the hint stage 1 left post hoc (near KL 1e-3 the MoE's F(tau=2) looked 1.5-2.2x its
  dense twin's). Records in ``<out>/probes/``, as stage 1's.
* the grid: moe2 and dense2 x {GRPO, GMPO} x two learning rates below stage 2's
  critical rate x 4 seeds, 250 RL steps each, from the same warm starts as every
  stage. Each run resumes from its own checkpoints in ``<root>/stage5/<name>``; its
  compact summary goes to ``<out>/runs/<name>.jsonl`` when it finishes.

The report (``--report``) reads both with the rules the README fixed before any run:
`stage5_report.probe_rule` and the learned-collapse detector
(`stats.learned_collapse`).

    python -m experiments.stability.stage5_learn_collapse --probes --root runs/stability \
        --max-minutes 55                                                # one chunk
    taskset -c 0 python -m experiments.stability.stage5_learn_collapse \
        --root runs/stability --only-arms moe2 --max-minutes 55         # beside dense2
    python -m experiments.stability.stage5_learn_collapse --report
"""

from __future__ import annotations

import os

from experiments.stability import common, stage5_report

OUT = os.path.join(common.RESULTS, "stage5")
STAGE = "stage5"


def overrides(sc, variant: str, lr: float) -> dict:
    """The config overrides of one run: stage 2's GRPO (0.2/0.28, no KL) or GMPO at
    its defaults (stage 3's arm), ``sc.updates`` updates per rollout."""
    lo, hi = sc.grpo_eps
    objective = {
        "grpo": ("grpo", {"eps_low": float(lo), "eps_high": float(hi), "kl_coef": 0.0}),
        "gmpo": ("gmpo", {}),
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


def grid(sc):
    """The grid's runs in the order they run: GRPO before GMPO, then the higher lr
    first, then seed by seed with both architectures of a seed together."""
    for variant in sc.variants:
        for lr in sc.lrs:
            for seed in sc.seeds:
                for arm in sc.arms:
                    meta = dict(
                        arm=arm,
                        variant=variant,
                        lr=float(lr),
                        seed=int(seed),
                        updates=int(sc.updates),
                        steps=int(sc.steps),
                        task=sc.task,
                    )
                    yield common.GridRun(
                        run_name(arm, variant, lr, seed),
                        arm,
                        int(seed),
                        overrides(sc, variant, lr),
                        int(sc.steps),
                        meta,
                        sc.task,
                    )


def describe(summary: dict) -> str:
    from experiments.stability.stage5_report import outcome

    o = outcome(summary)
    return (
        f"{o['outcome']} (learned at {o['learned_at']}, collapse at {o['collapse_at']}), "
        f"held-out {summary['eval_start']} -> {summary['eval_final']}"
    )


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    """Every run of the grid without a summary in ``<out>/runs``, until the budget
    expires. Returns the number of runs done."""
    return common.run_grid(
        grid(sc),
        root,
        STAGE,
        os.path.join(out, "runs"),
        budget,
        smoke=sc.smoke,
        check=common.same_setting,
        describe=describe,
        log=log,
    )


def run_probes(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    from experiments.stability import stage1_probes

    return stage1_probes.run_all(sc.probes, root, out, budget, log=log)


def main(argv=None) -> None:
    only = ("arms", "variants", "lrs", "seeds")
    ap = common.stage_parser(__doc__, OUT, "stage5_config.py", only)
    ap.add_argument("--probes", action="store_true", help="the low-lr probes, not the grid")
    args = ap.parse_args(argv)
    sc = common.stage_config(args, only)
    if args.report:
        stage5_report.report(args.out, sc)
        return
    budget = common.Budget(args.max_minutes)
    if args.probes:
        if args.only_arms or args.only_seeds:
            sc.probes.arms = tuple(a for a in sc.probes.arms if a in sc.arms)
            sc.probes.seeds = tuple(s for s in sc.probes.seeds if s in sc.seeds)
        n = run_probes(sc, args.root, args.out, budget)
        print(f"stage 5: {n} probes run into {args.out}/probes")
        return
    n = run_all(sc, args.root, args.out, budget)
    print(f"stage 5: {n} runs finished into {args.out}")


if __name__ == "__main__":
    main()
