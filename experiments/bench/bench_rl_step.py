"""Benchmark of a full RL step (rollout, old log-probs, update) at a config (the default's).

    python -m experiments.bench.bench_rl_step                 # default config, 5 timed steps
    python -m experiments.bench.bench_rl_step --steps 10 --arg objective=grpo
    python -m experiments.bench.bench_rl_step --config configs/bench_rl_h200.py --steps 3  # one GPU

Reports the share of step time in rollout (sampling, rewards, advantages),
old log-probs and the update, and the update's achieved FLOP/s against this
machine's dense f32 matmul FLOP/s measured in the same run, and the step's throughput
in tokens/s per device as NeMo-RL reports it (the rollout's prompt and response tokens
over the whole step's time, divided by the devices). It also times the
config's objective alone (jitted value and gradient with its metrics, on the
update's own old log-probs, advantages, mask, reference log-probs and router
shift) and gives its share of one update. The update's FLOPs
come from XLA's cost analysis of the compiled train step. The policy is the
config's freshly initialised model (no warm start): its responses run to
max_new_tokens more often than a trained policy's, so rollout time is an upper
bound for the config.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from configs import default as default_config
from experiments.bench.bench_model import matmul_peak
from gspo_jax import objectives, sweep
from gspo_jax.rl import RLPhase
from gspo_jax.run_parts import RunParts


def load_config(spec: str):
    """``path[:argument]`` -> the config file's ``get_config(argument)``."""
    path, _, _ = spec.partition(":")
    if not os.path.exists(path):
        raise SystemExit(f"--config: no file {path}")
    return sweep.load_config(spec)


def time_fn(fn, args, warmup: int, runs: int) -> float:
    """Median ms of ``fn(*args)`` over ``runs`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def objective_ms(cfg, mini, warmup: int = 3, runs: int = 21) -> float:
    """Median ms of the objective's jitted value-and-grad with metrics, on a mini-batch.

    The current log-probs are the old ones shifted by a little noise, so that some
    tokens clip; the router shift is drawn in [0.5, 1].
    """
    fn = objectives.get(cfg.objective)
    old, mask = mini["old_logp"], mini["mask"].astype(np.float32)
    noise = jax.random.normal(jax.random.key(1), old.shape) * 0.1
    extra = {}
    if mini.get("ref_logp") is not None:
        extra["ref_logp"] = mini["ref_logp"]
    if fn.needs_router_shift:
        extra["router_shift"] = jax.random.uniform(
            jax.random.key(2), old.shape, minval=0.5, maxval=1.0
        )

    @jax.jit
    def vg(lp):
        return jax.value_and_grad(
            lambda x: fn(x, old, mini["advantages"], mask, **extra, hp=cfg.hparams), has_aux=True
        )(lp)

    return time_fn(vg, (old + noise,), warmup, runs)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--config",
        default="configs/default.py",
        help="a config file, optionally with its argument: configs/bench_rl_h200.py:layers=16",
    )
    ap.add_argument("--arg", default="", help="the default config's argument, e.g. objective=grpo")
    ap.add_argument("--data_dir", default="")
    args = ap.parse_args(argv)

    if args.config == "configs/default.py":
        c = default_config.get_config(args.arg)
    else:
        c = load_config(args.config)
    c.sft.steps = 0
    c.progress_bar = False
    c.total_rl_steps = args.steps + 1
    work = tempfile.mkdtemp(prefix="bench_rl_")
    if args.data_dir:
        c.task.data_dir = args.data_dir
    trainer = RunParts(c, work)
    rl = RLPhase(trainer, trainer.init_params)

    rl.step(0)  # compiles everything
    ms = [rl.step(s)[0] for s in range(1, args.steps + 1)]

    # FLOPs of one update (one mini-batch) from XLA's cost analysis.
    batch, _ = rl.prepare(rl.collect_batch(0, version=0), 0)
    mb = batch["tokens"].shape[0] // int(c.updates.num_minibatches)
    mini = {k: v[:mb] for k, v in batch.items()}
    compiled = rl.train_fn.lower(rl.state, mini, jax.random.key(0)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops_per_update = float(cost["flops"])
    peak = matmul_peak()
    obj_ms = objective_ms(rl.step_cfg, mini)

    def mean(k):
        return float(np.mean([m[k] for m in ms]))

    step_t, roll_t, old_t, upd_t = (
        mean("step_time"),
        mean("rollout_time"),
        mean("old_logp_time"),
        mean("update_time"),
    )
    updates = int(c.updates.num_minibatches) * int(c.updates.num_epochs)
    achieved = flops_per_update * updates / upd_t
    print(
        f"config: {args.config}:{args.arg}  prompts={c.rollout.prompts_per_step} G={c.rollout.group_size} "
        f"max_new_tokens={c.rollout.max_new_tokens} updates/step={updates} devices={jax.device_count()}"
    )
    print(
        f"mean over {args.steps} steps after one warm-up step; response length {mean('response_len'):.1f}"
    )
    print("| part | seconds | share |")
    print("|---|---:|---:|")
    for name, t in (
        ("rollout (sample + rewards + advantages)", roll_t),
        ("old log-probs", old_t),
        ("update", upd_t),
    ):
        print(f"| {name} | {t:.3f} | {t / step_t:.0%} |")
    print(f"| whole step | {step_t:.3f} | 100% |")
    print()
    print(
        f"update: {flops_per_update / 1e9:.2f} GFLOP per mini-batch (XLA cost analysis), "
        f"{achieved / 1e9:.1f} GFLOP/s achieved; dense f32 matmul peak in this run {peak / 1e9:.1f} GFLOP/s "
        f"-> {achieved / peak:.1%} of peak"
    )
    print(f"tokens/s (generated + trained): {mean('tokens_per_s'):.0f}")
    rows = int(c.rollout.prompts_per_step) * int(c.rollout.group_size)
    step_tokens = rows * (int(c.rollout.max_prompt_len) + mean("response_len"))
    print(
        f"tokens/s/device (the rollout's prompt, at its padded length, and response tokens "
        f"over the whole step; NeMo-RL's measure): {step_tokens / step_t / jax.device_count():.0f} "
        f"({rows} rows x ({c.rollout.max_prompt_len} + {mean('response_len'):.0f}) tokens, "
        f"{jax.device_count()} device(s))"
    )
    upd_ms = upd_t / updates * 1e3
    print(
        f"objective {rl.step_cfg.objective} alone (value and gradient with metrics, {tuple(mini['mask'].shape)} "
        f"tokens): {obj_ms:.3f} ms median, {obj_ms / upd_ms:.3%} of one update ({upd_ms:.0f} ms)"
    )


if __name__ == "__main__":
    main()
