"""Stage 2 of the stability study: the stability frontier (experiments/stability/README.md).

MoE and its dense twin × {GRPO, GRPO with a dual clip, GSPO at the calibrated range}
× learning rates × seeds, 16 updates per rollout, router losses off. Each run resumes
from its own checkpoints in ``<root>/stage2/<name>``; its compact summary (per-step
series, collapse step, final held-out reward) goes to ``<out>/runs/<name>.jsonl``
when it finishes, and a run with a summary is skipped.

    python -m experiments.stability.stage2_frontier --root runs/stability \
        --only-seeds 0 --max-minutes 55                                 # one chunk
    python -m experiments.stability.stage2_frontier --report

Stage 3's setting search (``--config ...stage2_config.py:search=<name>``) writes to
``results/stage2_search/<name>``; its report reads the setting rule per lr on the runs
so far, and ``--only-lrs`` runs just the lrs that are still open.
"""

from __future__ import annotations

import os

from experiments.stability import common, stage2_report

OUT = os.path.join(common.RESULTS, "stage2")


def stage_name(sc) -> str:
    """Where the grid's runs live under ``--root`` and its results under ``results/``:
    ``stage2``, ``stage2_search/<fallback>`` for stage 3's setting search, or
    ``stage8`` for the GPU frontier (``scale=gpu``)."""
    if sc.get("scale", "cpu") == "gpu":
        return "stage8"
    return f"stage2_search/{sc.search}" if sc.search else "stage2"


def overrides(sc, variant: str, lr: float) -> dict:
    """The config overrides of one arm of the grid."""
    lo, hi = sc.grpo_eps
    grpo = {"eps_low": float(lo), "eps_high": float(hi), "kl_coef": 0.0}
    objective = {
        "grpo": lambda: ("grpo", grpo),
        "grpo_dual": lambda: ("grpo", dict(grpo, dual_clip=float(sc.dual_clip))),
        "gspo": lambda: (
            "gspo",
            {"eps_low": float(sc.gspo_eps[0]), "eps_high": float(sc.gspo_eps[1]), "kl_coef": 0.0},
        ),
    }
    if variant not in objective:
        raise ValueError(f"variant {variant!r}: expected one of {sorted(objective)}")
    o = {
        "objective": objective[variant](),
        "optimizer.lr": float(lr),
        "updates.num_minibatches": int(sc.updates),
    }
    if sc.get("dtype", "float32") != "float32":  # stage 8's bf16 compute
        o["model.dtype"] = sc.dtype
    return o


def run_name(arm: str, variant: str, lr: float, seed: int) -> str:
    return f"{arm}_{variant}_lr{lr:g}_s{seed}"


def stage2_twin(sc, out: str, run: common.GridRun) -> str | None:
    """The summary of stage 2's own run when a search's run is that very run (the same
    arm, variant, lr, seed, updates and task: dense2 in ``search=moe2k1``), so the
    search reuses it instead of training it again; None otherwise."""
    if not sc.search:
        return None
    path = os.path.join(
        os.path.dirname(os.path.dirname(out)), "stage2", "runs", run.name + ".jsonl"
    )
    if not os.path.exists(path):
        return None
    from experiments.stability import stage2_config

    (summary,) = common.read_jsonl(path)
    base = stage2_config.get_config()  # stage 2's summaries predate `updates` and `task`
    summary = dict(dict(updates=int(base.updates), task=base.task), **summary)
    return path if all(summary[k] == v for k, v in run.meta.items()) else None


def grid(sc):
    """The grid's runs, seed by seed (a chunk that ends early leaves whole seeds)."""
    for seed in sc.seeds:
        for lr in sc.lrs:
            for arm in sc.arms:
                for variant in sc.variants:
                    meta = dict(
                        arm=arm,
                        variant=variant,
                        lr=float(lr),
                        seed=int(seed),
                        updates=int(sc.updates),
                        task=sc.task,
                    )
                    if sc.get("dtype", "float32") != "float32":
                        meta["dtype"] = sc.dtype
                    yield common.GridRun(
                        run_name(arm, variant, lr, seed),
                        arm,
                        int(seed),
                        overrides(sc, variant, lr),
                        int(sc.steps),
                        meta,
                        sc.task,
                    )


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    """Every run of the grid without a summary in ``<out>/runs``, until the budget
    expires. Returns the number of runs done."""
    return common.run_grid(
        grid(sc),
        root,
        stage_name(sc),
        os.path.join(out, "runs"),
        budget,
        smoke=sc.smoke,
        reuse=lambda run: stage2_twin(sc, out, run),
        log=log,
    )


def main(argv=None) -> None:
    only = ("arms", "variants", "lrs", "seeds")
    args = common.stage_parser(__doc__, OUT, "stage2_config.py", only).parse_args(argv)
    sc = common.stage_config(args, only)
    if (sc.search or sc.scale == "gpu") and args.out == OUT:
        args.out = os.path.join(common.RESULTS, stage_name(sc))
    if args.report:
        stage2_report.report(args.out, sc)
        return
    n = run_all(sc, args.root, args.out, common.Budget(args.max_minutes))
    print(f"stage 2: {n} runs finished into {args.out}")


if __name__ == "__main__":
    main()
