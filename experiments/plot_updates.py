"""Plot per-update diagnostics against the update's index k within its rollout.

Reads ``<workdir>/updates.jsonl`` (one record per optimizer update: RL ``step``,
``k``, ``epoch``, ``minibatch`` and the update's metrics) of one or more runs and
draws, for each metric, every RL step's curve against k (thin, coloured from early
to late steps) and their mean over steps (bold), one panel per metric:

    python -m experiments.plot_updates --workdir runs/flip --metric flip_frac \\
        --metric flip_frac_vs_sampler --metric ppo_kl --metric clip_frac \\
        --out experiments/flip_vs_k.png
    python -m experiments.plot_updates --workdir a --workdir b --label grpo --label gspo ...

With several workdirs only the means are drawn, one line per run. ``--table`` also
prints the mean over steps at each k as a markdown table.
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import numpy as np

from gspo_jax.metrics_log import read_metrics

DEFAULT_METRICS = ("flip_frac", "flip_frac_vs_sampler", "ppo_kl", "clip_frac")


def by_step_and_k(records: list[dict], metric: str) -> dict[int, dict[int, float]]:
    """{RL step: {k: value}} of one metric (records without it are left out)."""
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for r in records:
        if metric in r and isinstance(r[metric], (int, float)):
            out[int(r["step"])][int(r["k"])] = float(r[metric])
    return dict(out)


def mean_over_steps(series: dict[int, dict[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """(k, mean over RL steps of the metric at k)."""
    ks = sorted({k for per_k in series.values() for k in per_k})
    means = [np.mean([per_k[k] for per_k in series.values() if k in per_k]) for k in ks]
    return np.asarray(ks), np.asarray(means)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", action="append", required=True)
    ap.add_argument("--label", action="append", default=None)
    ap.add_argument("--metric", action="append", default=None)
    ap.add_argument("--out", default="updates.png")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args(argv)
    metrics = args.metric or list(DEFAULT_METRICS)
    labels = args.label or [os.path.basename(os.path.normpath(w)) for w in args.workdir]
    if len(labels) != len(args.workdir):
        ap.error("give one --label per --workdir")
    runs = {lab: read_metrics(w, "updates.jsonl") for lab, w in zip(labels, args.workdir)}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for lab, records in runs.items():
            series = by_step_and_k(records, metric)
            if not series:
                continue
            if len(runs) == 1:
                steps = sorted(series)
                cmap = plt.get_cmap("viridis")
                for i, s in enumerate(steps):
                    ks = sorted(series[s])
                    color = cmap(i / max(len(steps) - 1, 1))
                    ax.plot(ks, [series[s][k] for k in ks], color=color, lw=0.6, alpha=0.6)
            ks, means = mean_over_steps(series)
            ax.plot(ks, means, lw=2.2, label=f"{lab} (mean over steps)")
            if args.table:
                print(f"\n{lab} {metric}\n\n| k | " + " | ".join(str(k) for k in ks) + " |")
                print("|---|" + "---:|" * len(ks))
                print("| mean | " + " | ".join(f"{m:.4g}" for m in means) + " |")
        ax.set_xlabel("update index k within the rollout")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
