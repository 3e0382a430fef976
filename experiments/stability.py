"""MoE stability study: every variant of configs/stability.py from one shared warm start.

    PYTHONPATH=. python experiments/stability.py --workdir runs/stab
    PYTHONPATH=. python experiments/stability.py --workdir runs/stab --variants grpo,grpo_r3,gspo --steps 20
    PYTHONPATH=. python experiments/stability.py --workdir /tmp/stab --smoke      # seconds

1. ``<workdir>/warm_start``: the supervised warm start alone (RL steps = 0).
2. For each variant, ``<workdir>/<variant>`` starts as a copy of the warm start's
   checkpoints and data, so every variant begins RL from the same parameters, and
   runs its RL phase (the trainer restores the finished warm start and goes on).
   A variant that was interrupted resumes from its own checkpoints when the
   script is run again; a finished one is skipped.
3. ``<workdir>/stability.png`` overlays the variants' curves, and
   ``<workdir>/summary.md`` tabulates them (first and last held-out reward, best,
   and the means of the drift diagnostics over the run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import stability as stability_config  # noqa: E402
from gspo_jax import config as config_lib  # noqa: E402
from gspo_jax.metrics_log import read_metrics  # noqa: E402

PLOT_METRICS = ("eval_reward_mean", "reward_mean", "entropy", "clip_frac", "expert_flip_frac",
                "replay_mismatch", "router_shift_mean", "frac_ratio_gt_2", "logratio_std")
# expert_flip_frac compares the routing the update used with the sampler's: 0 under
# replay, where replay_mismatch is the share of replayed choices the free router
# would have made differently.
SUMMARY_METRICS = ("clip_frac", "expert_flip_frac", "replay_mismatch", "router_shift_mean",
                   "frac_ratio_gt_2", "logratio_std", "entropy", "grad_norm")


def build_config(variant: str, args) -> "config_lib.ml_collections.ConfigDict":
    arg = f"variant={variant},minibatches={args.minibatches},lr={args.lr}"
    if args.smoke:
        arg += ",smoke"
    c = stability_config.get_config(arg)
    if not args.smoke:
        c.total_rl_steps = int(args.steps)
    c.progress_bar = False
    c.seed = int(args.seed)
    return c


def copy_warm_start(src: str, dst: str) -> None:
    """The warm start's SFT checkpoints, data and log, so that dst resumes after them."""
    os.makedirs(dst, exist_ok=True)
    for name in ("data", os.path.join("checkpoints", "sft")):
        if os.path.isdir(os.path.join(src, name)) and not os.path.exists(os.path.join(dst, name)):
            shutil.copytree(os.path.join(src, name), os.path.join(dst, name))
    log = os.path.join(src, "metrics.jsonl")
    if os.path.exists(log) and not os.path.exists(os.path.join(dst, "metrics.jsonl")):
        shutil.copy(log, os.path.join(dst, "metrics.jsonl"))


def finished(workdir: str, steps: int) -> bool:
    recs = [r for r in read_metrics(workdir) if r.get("phase") == "rl"] if os.path.exists(
        os.path.join(workdir, "metrics.jsonl")) else []
    return any(r["step"] >= steps and "eval_reward_mean" in r for r in recs)


def summarize(workdirs: dict[str, str]) -> str:
    head = ["variant", "eval reward: first", "last", "best"] + [f"mean {m}" for m in SUMMARY_METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, wd in workdirs.items():
        recs = [r for r in read_metrics(wd) if r.get("phase") == "rl"]
        ev = [r["eval_reward_mean"] for r in recs if "eval_reward_mean" in r]
        row = [variant, f"{ev[0]:.3f}", f"{ev[-1]:.3f}", f"{max(ev):.3f}"] if ev else [variant, "-", "-", "-"]
        for m in SUMMARY_METRICS:
            xs = [r[m] for r in recs if isinstance(r.get(m), (int, float))]
            row.append(f"{statistics.fmean(xs):.4g}" if xs else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--variants", default="grpo,grpo_r2,grpo_r3,gspo,rspo")
    ap.add_argument("--steps", type=int, default=40, help="RL steps per variant")
    ap.add_argument("--minibatches", type=int, default=8, help="optimizer steps per rollout")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="the smoke config: seconds, for a check")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(stability_config.VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {sorted(stability_config.VARIANTS)}")

    import jax

    from gspo_jax import train  # after argument errors: importing JAX takes seconds

    for variant in variants:  # every config checked before the first one runs
        config_lib.validate(build_config(variant, args), jax.device_count())

    base = os.path.join(args.workdir, "warm_start")
    c = build_config(variants[0], args)
    c.total_rl_steps = 0
    if not os.path.isdir(os.path.join(base, "checkpoints", "sft")) or not finished(base, 0):
        print(f"warm start -> {base}", flush=True)
        train.run(c, base)

    workdirs = {}
    for variant in variants:
        wd = os.path.join(args.workdir, variant)
        workdirs[variant] = wd
        c = build_config(variant, args)
        if finished(wd, int(c.total_rl_steps)):
            print(f"{variant}: finished, skipped", flush=True)
            continue
        copy_warm_start(base, wd)
        print(f"{variant} -> {wd}", flush=True)
        train.run(c, wd)

    summary = summarize(workdirs)
    with open(os.path.join(args.workdir, "summary.md"), "w") as f:
        f.write(summary)
    print(summary)
    from experiments import plot_curves

    plot_curves.main(sum((["--workdir", wd, "--label", v] for v, wd in workdirs.items()), [])
                     + sum((["--metric", m] for m in PLOT_METRICS), [])
                     + ["--cols", "3", "--out", os.path.join(args.workdir, "stability.png")])


if __name__ == "__main__":
    main()
