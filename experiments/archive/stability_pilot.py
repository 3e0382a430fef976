"""Superseded and not maintained (experiments/archive/README.md).

MoE stability study: every variant of configs/stability.py from one shared warm start.

    python -m experiments.archive.stability_pilot --workdir runs/stab
    python -m experiments.archive.stability_pilot --workdir runs/stab --variants grpo,grpo_r3,gspo --steps 20
    python -m experiments.archive.stability_pilot --workdir /tmp/stab --smoke      # seconds

1. ``<workdir>/warm_start``: the supervised warm start alone (RL steps = 0).
2. For each variant, ``<workdir>/<variant>`` starts as a copy of the warm start's
   checkpoints and data, so every variant begins RL from the same parameters, and
   runs its RL phase (the trainer restores the finished warm start and goes on).
   A variant that was interrupted resumes from its own checkpoints when the
   script is run again; a finished one is skipped.
3. ``<workdir>/stability.png`` overlays the variants' curves, and
   ``<workdir>/summary.md`` tabulates them (first and last held-out reward, best,
   and the means of the drift diagnostics over the run).

With ``--seeds 0,1,2`` the whole study runs once per seed (warm start included) in
``<workdir>/seed<k>``; ``<workdir>/seeds.md`` then tabulates each variant's last
held-out reward per seed with their mean and range, and ``<workdir>/seeds.png``
plots the held-out reward of every seed with the mean over seeds.

    python -m experiments.archive.stability_pilot --workdir runs/stab_seeds --seeds 0,1,2 --lr 1e-3 --minibatches 16
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics

from configs import stability as stability_config
from gspo_jax import config as config_lib
from gspo_jax.metrics_log import read_metrics

PLOT_METRICS = (
    "eval_reward_mean",
    "reward_mean",
    "entropy",
    "clip_frac",
    "flip_frac",
    "replay_mismatch",
    "router_shift_mean",
    "frac_ratio_gt_2",
    "logratio_std",
)
# flip_frac compares the current free router's top-K with pi_old's free top-K: the
# same quantity under every replay mode. replay_mismatch is the share of replayed
# choices the free router would have made differently.
# Averaged per seed, then over seeds, in seeds.md.
SEED_METRICS = ("flip_frac", "replay_mismatch", "router_shift_mean", "frac_ratio_gt_2")
SUMMARY_METRICS = (
    "clip_frac",
    "flip_frac",
    "replay_mismatch",
    "router_shift_mean",
    "frac_ratio_gt_2",
    "logratio_std",
    "entropy",
    "grad_norm",
)


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
    recs = (
        [r for r in read_metrics(workdir) if r.get("phase") == "rl"]
        if os.path.exists(os.path.join(workdir, "metrics.jsonl"))
        else []
    )
    return any(r["step"] >= steps and "eval_reward_mean" in r for r in recs)


def rl_stats(workdir: str, metrics) -> tuple[list[float], dict[str, float]]:
    """A run's held-out rewards over its RL phase, and the mean over RL steps of each
    metric in ``metrics`` that it logged."""
    recs = [r for r in read_metrics(workdir) if r.get("phase") == "rl"]
    evals = [r["eval_reward_mean"] for r in recs if "eval_reward_mean" in r]
    means = {}
    for m in metrics:
        xs = [r[m] for r in recs if isinstance(r.get(m), (int, float))]
        if xs:
            means[m] = statistics.fmean(xs)
    return evals, means


def summarize(workdirs: dict[str, str]) -> str:
    head = ["variant", "eval reward: first", "last", "best"] + [
        f"mean {m}" for m in SUMMARY_METRICS
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, wd in workdirs.items():
        ev, means = rl_stats(wd, SUMMARY_METRICS)
        row = (
            [variant, f"{ev[0]:.3f}", f"{ev[-1]:.3f}", f"{max(ev):.3f}"]
            if ev
            else [variant, "-", "-", "-"]
        )
        row += [f"{means[m]:.4g}" if m in means else "-" for m in SUMMARY_METRICS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def summarize_seeds(runs: dict[int, dict[str, str]]) -> str:
    """Across seeds: each variant's last held-out reward per seed, their mean and range,
    and the per-seed means of the drift diagnostics averaged over seeds."""
    seeds = sorted(runs)
    variants = list(runs[seeds[0]])
    head = (
        ["variant"]
        + [f"last eval reward, seed {s}" for s in seeds]
        + ["mean", "min", "max"]
        + [f"mean {m}" for m in SEED_METRICS]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant in variants:
        last, diag = [], {m: [] for m in SEED_METRICS}
        for s in seeds:
            ev, means = rl_stats(runs[s][variant], SEED_METRICS)
            last.append(ev[-1] if ev else None)
            for m, x in means.items():
                diag[m].append(x)
        got = [x for x in last if x is not None]
        row = [variant] + [f"{x:.3f}" if x is not None else "-" for x in last]
        row += (
            [f"{statistics.fmean(got):.3f}", f"{min(got):.3f}", f"{max(got):.3f}"]
            if got
            else ["-"] * 3
        )
        row += [f"{statistics.fmean(diag[m]):.4g}" if diag[m] else "-" for m in SEED_METRICS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_seeds(runs: dict[int, dict[str, str]], out: str) -> None:
    """Held-out reward per variant: one colour per variant, a thin line per seed and
    the mean over seeds (at the steps every seed evaluated) in bold."""
    from experiments import plot_curves

    plt = plot_curves.plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    seeds = sorted(runs)
    for i, variant in enumerate(runs[seeds[0]]):
        curves = []
        for s in seeds:
            x, y = plot_curves.series(read_metrics(runs[s][variant]), "eval_reward_mean")
            ax.plot(x, y, color=f"C{i % 10}", lw=0.8, alpha=0.45)
            curves.append(dict(zip(x, y)))
        common = sorted(set.intersection(*(set(c) for c in curves)))
        ax.plot(
            common,
            [statistics.fmean(c[k] for c in curves) for k in common],
            color=f"C{i % 10}",
            lw=2.2,
            marker="o",
            ms=3,
            label=f"{variant} (mean of {len(seeds)})",
        )
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out reward (eval_reward_mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_study(args, workdir: str, variants: list[str]) -> dict[str, str]:
    """The warm start, then every variant from it, in ``workdir`` (see the module doc)."""
    from gspo_jax import train

    base = os.path.join(workdir, "warm_start")
    c = build_config(variants[0], args)
    c.total_rl_steps = 0
    if not os.path.isdir(os.path.join(base, "checkpoints", "sft")) or not finished(base, 0):
        print(f"warm start -> {base}", flush=True)
        train.run(c, base)

    workdirs = {}
    for variant in variants:
        wd = os.path.join(workdir, variant)
        workdirs[variant] = wd
        c = build_config(variant, args)
        if finished(wd, int(c.total_rl_steps)):
            print(f"{variant}: finished, skipped", flush=True)
            continue
        copy_warm_start(base, wd)
        print(f"{variant} -> {wd}", flush=True)
        train.run(c, wd)

    summary = summarize(workdirs)
    with open(os.path.join(workdir, "summary.md"), "w") as f:
        f.write(summary)
    print(summary)
    from experiments import plot_curves

    plot_curves.main(
        sum((["--workdir", wd, "--label", v] for v, wd in workdirs.items()), [])
        + sum((["--metric", m] for m in PLOT_METRICS), [])
        + ["--cols", "3", "--out", os.path.join(workdir, "stability.png")]
    )
    return workdirs


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: expected distinct integers, got {text!r}")
    return seeds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--variants", default="grpo,grpo_r2,grpo_r3,gspo,rspo")
    ap.add_argument("--steps", type=int, default=40, help="RL steps per variant")
    ap.add_argument("--minibatches", type=int, default=8, help="optimizer steps per rollout")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=None, help="the run's seed (default 0)")
    ap.add_argument(
        "--seeds",
        default="",
        help="comma-separated seeds: the whole study once per seed, in "
        "<workdir>/seed<k>, then seeds.md and seeds.png across them",
    )
    ap.add_argument("--smoke", action="store_true", help="the smoke config: seconds, for a check")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(stability_config.VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {sorted(stability_config.VARIANTS)}")
    try:
        seeds = parse_seeds(args.seeds) if args.seeds else None
    except ValueError as e:
        ap.error(str(e))
    if seeds is not None and args.seed is not None:
        ap.error("give --seed or --seeds, not both")
    if args.seed is None:
        args.seed = 0
    import jax  # after argument errors: importing JAX takes seconds

    from experiments import plot_curves  # noqa: F401  (without matplotlib: its error now, not after the runs)

    for variant in variants:  # every config checked before the first one runs
        config_lib.validate(build_config(variant, args), jax.device_count())

    if seeds is None:
        run_study(args, args.workdir, variants)
        return
    runs = {}
    for seed in seeds:
        args.seed = seed
        runs[seed] = run_study(args, os.path.join(args.workdir, f"seed{seed}"), variants)
    table = summarize_seeds(runs)
    with open(os.path.join(args.workdir, "seeds.md"), "w") as f:
        f.write(table)
    print(table)
    plot_seeds(runs, os.path.join(args.workdir, "seeds.png"))


if __name__ == "__main__":
    main()
