"""Plot a run's learning curves from its metrics.jsonl.

    python -m experiments.plot_curves --workdir runs/default --out experiments/default_curve.png
    python -m experiments.plot_curves --workdir runs/a --workdir runs/b --label GSPO --label GRPO \
        --metric eval_reward_mean --metric flip_frac --out cmp.png

One panel per metric, RL phase only; several workdirs are overlaid.
"""

from __future__ import annotations

import argparse
import os

try:
    import matplotlib
except ImportError:  # plotting is an extra: training does not need it
    raise ImportError(
        "experiments/plot_curves.py needs matplotlib: "
        "pip install -e '.[plot]' (or pip install 'matplotlib>=3.8')"
    ) from None

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gspo_jax.metrics_log import read_metrics  # noqa: E402

DEFAULT_METRICS = ("eval_reward_mean", "reward_mean", "clip_frac", "flip_frac")


def series(records, metric):
    pts = [
        (r["step"], r[metric])
        for r in records
        if r.get("phase") == "rl" and isinstance(r.get(metric), (int, float))
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workdir", action="append", required=True)
    ap.add_argument("--label", action="append")
    ap.add_argument("--metric", action="append")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--cols", type=int, default=0, help="panels per row (0: all in one row)")
    args = ap.parse_args(argv)
    metrics = args.metric or list(DEFAULT_METRICS)
    labels = args.label or [os.path.basename(os.path.normpath(w)) for w in args.workdir]
    if len(labels) != len(args.workdir):
        ap.error("give one --label per --workdir")
    cols = args.cols or len(metrics)
    rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(metrics) :]:
        ax.axis("off")
    axes = [list(axes.flat[: len(metrics)])]
    for i, (workdir, label) in enumerate(zip(args.workdir, labels)):
        recs = read_metrics(workdir)
        for ax, metric in zip(axes[0], metrics):
            x, y = series(recs, metric)
            if x:  # one colour per run in every panel, also where some runs lack the metric
                ax.plot(
                    x,
                    y,
                    marker="o" if metric.startswith("eval") else None,
                    ms=3,
                    label=label,
                    color=f"C{i % 10}",
                )
    for ax, metric in zip(axes[0], metrics):
        ax.set_title(metric)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    if len(args.workdir) > 1:
        axes[0][0].legend()
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
