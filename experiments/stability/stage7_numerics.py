"""Stage 7 of the stability study: a train-inference mismatch from numerics
(experiments/stability/README.md, "Stage 7").

Stage 4 made the sampler's routing differ from the trainer's with injected router
noise. Here the difference is what an inference engine's arithmetic gives: the sampler
computes in bf16, or in bf16 with int8 weights, while the trainer computes in f32
(``rollout.sampler_dtype``, ``rollout.sampler_quantization``).

* ``--measure``: on each seed's warm start (MoE and dense twin), each precision's
  train-inference KL, F(tau=2) and routing disagreement, over the first RL rollouts
  (measured as the trainer measures its ``mismatch_*``: the sampler's record against
  the old-policy pass on the same tokens). ``<out>/measure.jsonl``.
* the grid: GRPO on the MoE with the sampler at f32 (the control), bf16, bf16 + R3,
  bf16 + token TIS, int8 and int8 + R3; on the dense twin at f32, bf16 and int8;
  4 seeds, 100 RL steps, lr near the stability boundary. Each run resumes from its
  own checkpoints in ``<root>/stage7/<name>``; its summary goes to
  ``<out>/runs/<name>.jsonl``.

    python -m experiments.stability.stage7_numerics --root runs/stability --measure
    taskset -c 1 python -m experiments.stability.stage7_numerics --root runs/stability \
        --only-arms moe2 --max-minutes 55                               # one chunk
    python -m experiments.stability.stage7_numerics --report
"""

from __future__ import annotations

import os

import numpy as np

from experiments.stability import common, stage7_config, stage7_report

OUT = os.path.join(common.RESULTS, "stage7")
STAGE = "stage7"


def arm_rows(sc, arm: str) -> dict:
    """name -> (precision, replay, correction) of the arms run on ``arm``."""
    rows = sc.moe_arms if common.is_moe(arm) else sc.dense_arms
    return {r[0]: tuple(r[1:]) for r in rows}


def precision_overrides(precision: str) -> dict:
    dtype, quantization = stage7_config.PRECISIONS[precision]
    return {"rollout.sampler_dtype": dtype, "rollout.sampler_quantization": quantization}


def overrides(sc, arm: str, variant: str) -> dict:
    """The config overrides of one run: stage 2's GRPO at the stage's lr, the sampler's
    precision, the replay and the rollout correction (token TIS truncated at
    ``sc.tis_cap``, stage 4's)."""
    rows = arm_rows(sc, arm)
    if variant not in rows:
        raise ValueError(f"{arm}: variant {variant!r}; expected one of {sorted(rows)}")
    precision, replay, correction = rows[variant]
    lo, hi = sc.grpo_eps
    o = {
        "objective": ("grpo", {"eps_low": float(lo), "eps_high": float(hi), "kl_coef": 0.0}),
        "optimizer.lr": float(sc.lr),
        "updates.num_minibatches": int(sc.updates),
        "updates.routing_replay": replay,
        "rollout_correction.mode": correction,
        **precision_overrides(precision),
    }
    if correction != "none":
        o["rollout_correction.cap"] = float(sc.tis_cap)
    return o


def run_name(arm: str, variant: str, seed: int) -> str:
    return f"{arm}_{variant}_s{seed}"


def grid(sc):
    """Seed by seed; within a seed the MoE's arms, then the dense twin's."""
    for seed in sc.seeds:
        for arm in sc.arms:
            for variant, (precision, replay, correction) in arm_rows(sc, arm).items():
                if variant not in sc.variants:
                    continue
                meta = dict(
                    arm=arm,
                    variant=variant,
                    precision=precision,
                    replay=replay,
                    correction=correction,
                    lr=float(sc.lr),
                    seed=int(seed),
                    updates=int(sc.updates),
                    steps=int(sc.steps),
                    task=sc.task,
                )
                yield common.GridRun(
                    run_name(arm, variant, seed),
                    arm,
                    int(seed),
                    overrides(sc, arm, variant),
                    int(sc.steps),
                    meta,
                    sc.task,
                )


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    return common.run_grid(
        grid(sc),
        root,
        STAGE,
        os.path.join(out, "runs"),
        budget,
        smoke=sc.smoke,
        check=common.same_setting,
        log=log,
    )


# --------------------------------------------------------------------------
# The measurement.

MEASURED = ("mismatch_kl", "mismatch_f2", "mismatch_logp_abs", "mismatch_route")


def measure(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    """Each (arm, seed, precision) not yet in ``<out>/measure.jsonl``: the warm start's
    mismatch over the seed's first ``sc.measure_batches`` RL rollouts, sampled at that
    precision and passed through the f32 trainer (the same keys and prompts for every
    precision). Returns the number of records added."""
    import jax

    from gspo_jax import sft
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    path = os.path.join(out, "measure.jsonl")
    records = common.read_jsonl(path)
    have = {(r["arm"], r["seed"], r["precision"]) for r in records}
    added = 0
    for seed in sc.seeds:
        for arm in sc.arms:
            for precision in sc.precisions:
                if (arm, int(seed), precision) in have:
                    continue
                if budget.expired():
                    return added
                warm = common.ensure_warm_start(root, arm, int(seed), smoke=sc.smoke)
                c = common.rl_config(arm, int(seed), root, smoke=sc.smoke)
                common.apply_overrides(c, precision_overrides(precision))
                trainer = RunParts(c, warm)
                params = sft.final_params(trainer)
                if params is None:
                    raise RuntimeError(
                        f"{warm}: the warm start's final checkpoint does not restore"
                    )
                phase = RLPhase(trainer, params)
                per = []
                for b in range(int(sc.measure_batches)):
                    rng = jax.random.fold_in(jax.random.key(c.seed + 1), b)
                    queued = phase.queued(*phase.collect(params, b, rng), step=b, version=0)
                    _, info = phase.prepare(queued, 0)
                    info = jax.device_get(info)
                    per.append({k: float(info[k]) for k in MEASURED if k in info})
                rec = dict(
                    arm=arm,
                    seed=int(seed),
                    precision=precision,
                    batches=int(sc.measure_batches),
                    **{k: float(np.mean([p[k] for p in per])) for k in per[0]},
                )
                records.append(rec)
                common.write_jsonl(path, records)
                log(
                    f"measure {arm} s{seed} {precision}: "
                    + " ".join(f"{k}={rec[k]:.3g}" for k in MEASURED if k in rec)
                )
                added += 1
    return added


def main(argv=None) -> None:
    only = ("arms", "variants", "seeds")
    ap = common.stage_parser(__doc__, OUT, "stage7_config.py", only)
    ap.add_argument("--measure", action="store_true", help="the mismatch of each precision")
    args = ap.parse_args(argv)
    sc = common.stage_config(args, only)
    if args.report:
        stage7_report.report(args.out, sc)
        return
    budget = common.Budget(args.max_minutes)
    if args.measure:
        n = measure(sc, args.root, args.out, budget)
        print(f"stage 7: {n} measurements into {args.out}/measure.jsonl")
        return
    n = run_all(sc, args.root, args.out, budget)
    print(f"stage 7: {n} runs finished into {args.out}")


if __name__ == "__main__":
    main()
