"""The off-policy runs of the default config: held-out reward and the behaviour-vs-proximal
KL over RL steps, at staleness k in {0, 1, 2, 4}, under each trust region.

    python -m gspo_jax.sweep --config=configs/default.py --workdir=runs/offpolicy \\
        --grid rollout.staleness=0,1,2,4 --grid updates.trust_region=decoupled,behaviour \\
        --metric eval_reward_mean --metric behaviour_kl --config.progress_bar=False
    python -m experiments.offpolicy.report --root runs/offpolicy \
        --seeds-root runs/offpolicy_seeds --tis-root runs/offpolicy_tis

writes experiments/offpolicy/results.json (the compact per-step series, and part 2's
paired differences and verdicts), offpolicy.png and prints the tables of
experiments/offpolicy/README.md (part 2's runs: that file's commands).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from gspo_jax.metrics_log import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
SERIES = (
    "eval_reward_mean",
    "eval_greedy_reward",
    "behaviour_kl",
    "behaviour_f2",
    "staleness_mean",
    "reward_mean",
    "step_time",
)
KS = (0, 1, 2, 4)
REGIONS = ("decoupled", "behaviour")


def point(k: int, region: str) -> str:
    return f"staleness={k}__trust_region={region}"


def load(root: str) -> dict[str, dict[str, list]]:
    """Per grid point, per metric: [[step, value], ...] of the RL records that hold it."""
    out = {}
    for k in KS:
        for region in REGIONS:
            workdir = os.path.join(root, point(k, region))
            if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
                continue
            rl = [r for r in read_metrics(workdir) if r["phase"] == "rl"]
            out[point(k, region)] = {
                m: [[r["step"], float(r[m])] for r in rl if m in r] for m in SERIES
            }
    return out


def table(results: dict) -> str:
    head = (
        "| k | trust region | held-out reward, step 0 → 60 (sampled) | greedy | "
        "behaviour_kl, mean over steps | behaviour_f2, mean |\n"
        "|---|---|---|---|---|---|\n"
    )
    rows = []
    for k in KS:
        for region in REGIONS:
            r = results.get(point(k, region))
            if r is None:
                continue
            ev, gr = r["eval_reward_mean"], r["eval_greedy_reward"]
            kl = [v for s, v in r["behaviour_kl"] if s > 0]
            f2 = [v for s, v in r["behaviour_f2"] if s > 0]
            rows.append(
                f"| {k} | {region} | {ev[0][1]:.3f} → {ev[-1][1]:.3f} | "
                f"{gr[0][1]:.3f} → {gr[-1][1]:.3f} | {np.mean(kl):.2e} | {np.mean(f2):.4f} |"
            )
    return head + "\n".join(rows) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    colors = dict(zip(KS, ("black", "tab:blue", "tab:orange", "tab:red")))
    for col, region in enumerate(REGIONS):
        for k in KS:
            r = results.get(point(k, region))
            if r is None:
                continue
            ev = np.asarray(r["eval_reward_mean"])
            axes[0, col].plot(ev[:, 0], ev[:, 1], "o-", color=colors[k], label=f"k = {k}")
            kl = np.asarray([p for p in r["behaviour_kl"] if p[0] > 0])
            if k:  # k = 0: the sampler's and the trainer's numerics only (below 1e-12)
                axes[1, col].semilogy(kl[:, 0], kl[:, 1], color=colors[k], label=f"k = {k}")
        axes[0, col].set_title(f"trust region: {region}")
        axes[0, col].set_ylabel("held-out reward (sampled)")
        axes[1, col].set_ylabel("KL(behaviour || proximal), k3")
        axes[1, col].set_ylim(1e-4, 0.5)
        axes[1, col].legend(fontsize=8, title="k = 0: below 1e-12", title_fontsize=8)
        axes[1, col].set_xlabel("RL step")
        axes[0, col].legend(fontsize=8)
    fig.suptitle("Default config (tiny MoE, Countdown, GSPO): staleness k")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def final_reward(workdir: str) -> float | None:
    """Held-out sampled reward at the run's last RL step (None if unfinished)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rl = [r for r in read_metrics(workdir) if r["phase"] == "rl" and "eval_reward_mean" in r]
    return float(rl[-1]["eval_reward_mean"]) if rl and rl[-1]["step"] == 60 else None


def seeded(root: str, seeds_root: str, tis_root: str) -> tuple[dict, str]:
    """Part 2 (README.md): per arm the k = 4 minus k = 0 differences of the final held-out
    reward, paired by seed, and the verdict of the rule written before the runs."""

    def run(seed: int, k: int, region: str) -> str:
        if seed == 0:
            return os.path.join(root, point(k, region))
        return os.path.join(seeds_root, f"seed={seed}__" + point(k, region))

    arms = {
        "behaviour": (lambda s: run(s, 4, "behaviour"), lambda s: run(s, 0, "behaviour")),
        "decoupled": (lambda s: run(s, 4, "decoupled"), lambda s: run(s, 0, "decoupled")),
        "decoupled + token_tis": (
            lambda s: os.path.join(tis_root, f"seed={s}__mode=token_tis"),
            lambda s: run(s, 0, "decoupled"),
        ),
    }
    out, lines = {}, []
    lines.append(
        "| arm (k = 4) | k = 4, seeds 0/1/2 | k = 0, seeds 0/1/2 | d_s | mean d | verdict |"
    )
    lines.append("|---|---|---|---|---|---|")
    for name, (stale, fresh) in arms.items():
        a = [final_reward(stale(s)) for s in (0, 1, 2)]
        b = [final_reward(fresh(s)) for s in (0, 1, 2)]
        if None in a or None in b:
            lines.append(f"| {name} | (unfinished) | | | | |")
            continue
        d = [x - y for x, y in zip(a, b)]
        mean = float(np.mean(d))
        if all(x < 0 for x in d) and mean < -0.02:
            verdict = "degrades"
        elif mean >= -0.02 and sum(x < -0.02 for x in d) <= 1:
            verdict = "holds"
        else:
            verdict = "not resolved at this scale"
        out[name] = dict(stale=a, fresh=b, d=d, mean=mean, verdict=verdict)
        fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        lines.append(
            f"| {name} | {fmt(a)} | {fmt(b)} | {' / '.join(f'{x:+.3f}' for x in d)} | "
            f"{mean:+.3f} | {verdict} |"
        )
    return out, "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/offpolicy")
    p.add_argument("--seeds-root", default="runs/offpolicy_seeds")
    p.add_argument("--tis-root", default="runs/offpolicy_tis")
    args = p.parse_args()
    results = load(args.root)
    verdicts, seeded_table = seeded(args.root, args.seeds_root, args.tis_root)
    results["seeded"] = verdicts
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(results, f, separators=(",", ":"))
    plot(results, os.path.join(HERE, "offpolicy.png"))
    print(table(results))
    print(seeded_table, end="")


if __name__ == "__main__":
    main()
