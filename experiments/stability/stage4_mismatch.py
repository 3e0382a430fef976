"""Stage 4 of the stability study: train–inference mismatch
(experiments/stability/README.md, "Stage 4").

A sampler whose routing differs from the trainer's by a known amount: Gaussian router
noise σ on the sampler's router logits only (``rollout.router_noise_std``), calibrated
(``--calibrate``) on the MoE's warm start to the target routing disagreements by
bisection on log σ. The disagreement is measured as the trainer measures its
``mismatch_route``: the sampler's record against the trainer's free routing of the same
sequences (``Trainer.collect`` then ``RLPhase.prepare``, at the warm start's
parameters, on the first RL rollout(s) of the calibration seed).

Then GRPO, GRPO+R3, GRPO+token TIS (cap 2) and GRPO+R3+TIS, at 1 and 8 updates per
rollout, at both noise levels, 3 seeds, 40 RL steps. Each run resumes from its own
checkpoints in ``<root>/stage4/<name>``; its compact summary goes to
``<out>/runs/<name>.jsonl`` when it finishes, and a run with a summary is skipped.

    PYTHONPATH=. python experiments/stability/stage4_mismatch.py --root runs/stability --calibrate
    PYTHONPATH=. python experiments/stability/stage4_mismatch.py --root runs/stability \
        --only-seeds 0 --max-minutes 55                                 # one chunk
    PYTHONPATH=. python experiments/stability/stage4_mismatch.py --report
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from experiments.stability import common, stage4_config  # noqa: E402
from experiments.stability.common import bootstrap_diff_ci  # noqa: E402

OUT = os.path.join(common.RESULTS, "stage4")
STAGE = "stage4"
MISMATCH = ("mismatch_kl", "mismatch_f2", "mismatch_route")
# The R3 paper's train–inference KL (k3 estimate, as `mismatch_kl`), measured between
# its training and inference engines without replay: the levels drawn on the figure,
# (label, level, line style).
PAPER_KL = (
    ("R3 paper, MoE (Qwen3-30B-A3B)", 1.535e-3, "--"),
    ("R3 paper, dense (Qwen3-8B)", 6.4e-4, ":"),
)

# --------------------------------------------------------------------------
# Calibration.


def bisect_log_sigma(
    measure: Callable[[float], float],
    target: float,
    *,
    lo: float,
    hi: float,
    max_evals: int,
    tol: float,
) -> dict:
    """σ in [lo, hi] whose disagreement ``measure(σ)`` is nearest ``target``: bisection
    on log σ (``measure`` increasing in σ), at most ``max_evals`` evaluations, stopping
    once within ``tol`` × target. Returns the chosen σ, its disagreement, the points
    evaluated and whether it got within the tolerance. ``measure`` may cache: the two
    targets' bisections share their first midpoint."""
    if not 0 < lo < hi or max_evals < 1 or target <= 0:
        raise ValueError(f"lo={lo}, hi={hi}, max_evals={max_evals}, target={target}")
    a, b = math.log(lo), math.log(hi)
    points = []
    for _ in range(int(max_evals)):
        s = math.exp(0.5 * (a + b))
        d = float(measure(s))
        points.append((s, d))
        if abs(d - target) <= tol * target:
            break
        if d < target:
            a = math.log(s)
        else:
            b = math.log(s)
    sigma, d = min(points, key=lambda p: abs(p[1] - target))
    return dict(
        target=float(target),
        sigma=float(sigma),
        disagreement=float(d),
        within_tol=abs(d - target) <= tol * target,
        points=[dict(sigma=float(s), disagreement=float(v)) for s, v in points],
    )


def calibration_path(out: str) -> str:
    return os.path.join(out, "calibration.json")


def calibrate(sc, root: str, out: str, log=print) -> dict:
    """Bisection for every target on the warm start of ``sc.arm``, seed
    ``sc.calib_seed``; writes ``<out>/calibration.json``."""
    import jax

    from gspo_jax import train

    seed = int(sc.calib_seed)
    warm = common.ensure_warm_start(root, sc.arm, seed, smoke=sc.smoke)
    c = common.rl_config(sc.arm, seed, root, smoke=sc.smoke)  # as the stage's RL runs
    trainer = train.Trainer(c, warm)
    params = trainer.warm_start_params()
    if params is None:
        raise RuntimeError(f"{warm}: the warm start's final checkpoint does not restore")
    phase = train.RLPhase(trainer, params)
    evaluations: dict[float, dict] = {}

    def measure(sigma: float) -> float:
        """The mismatch at σ, averaged over the seed's first calib_batches rollouts
        (the rollouts of its RL steps 1.. at the warm start: the same keys the trainer
        uses, so every σ sees the same prompts and sampling noise)."""
        if sigma not in evaluations:
            trainer.c.rollout.router_noise_std = float(sigma)
            per = []
            for b in range(int(sc.calib_batches)):
                rng = jax.random.fold_in(jax.random.key(c.seed + 1), b)
                host_batch, _ = trainer.collect(params, b, rng)
                _, info = phase.prepare(host_batch)
                per.append(
                    {k: float(v) for k, v in jax.device_get(info).items() if np.ndim(v) == 0}
                )
            evaluations[sigma] = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
            log(
                f"calibration σ={sigma:.4g}: mismatch_route={evaluations[sigma]['mismatch_route']:.4f} "
                f"mismatch_kl={evaluations[sigma]['mismatch_kl']:.3g}"
            )
        return evaluations[sigma]["mismatch_route"]

    results = [
        bisect_log_sigma(
            measure,
            float(t),
            lo=float(sc.sigma_lo),
            hi=float(sc.sigma_hi),
            max_evals=int(sc.max_evals),
            tol=float(sc.tol),
        )
        for t in sc.targets
    ]
    calib = dict(
        arm=sc.arm,
        seed=seed,
        batches=int(sc.calib_batches),
        smoke=bool(sc.smoke),
        targets=results,
        evaluations=[dict(sigma=s, **m) for s, m in sorted(evaluations.items())],
    )
    os.makedirs(out, exist_ok=True)
    with open(calibration_path(out), "w") as f:
        json.dump(calib, f, indent=1, sort_keys=True)
    for r in results:
        flag = "" if r["within_tol"] else " (NOT within tolerance: widen sigma_lo/sigma_hi?)"
        log(
            f"target {r['target']:g}: σ={r['sigma']:.4g}, disagreement "
            f"{r['disagreement']:.4f} after {len(r['points'])} evaluations{flag}"
        )
    return calib


def load_sigmas(out: str, targets) -> dict[float, float]:
    """{target: σ} from ``<out>/calibration.json``; refuses without it."""
    path = calibration_path(out)
    if not os.path.exists(path):
        raise SystemExit(
            f"{path}: missing. Stage 4's router noise levels are calibrated first: run "
            "`python experiments/stability/stage4_mismatch.py --calibrate` (same --root, "
            "--out and --config)"
        )
    with open(path) as f:
        calib = json.load(f)
    found = {float(r["target"]): float(r["sigma"]) for r in calib["targets"]}
    missing = [t for t in targets if float(t) not in found]
    if missing:
        raise SystemExit(f"{path}: no σ for target(s) {missing}; run --calibrate again")
    return {float(t): found[float(t)] for t in targets}


# --------------------------------------------------------------------------
# Runs.


def overrides(sc, arm: str, updates: int, sigma: float) -> dict:
    rows = {row[0]: row for row in sc.table}
    if arm not in rows:
        raise ValueError(f"arm {arm!r}: expected one of {sorted(rows)}")
    _, replay, mode, cap = rows[arm]
    lo, hi = sc.grpo_eps
    return {
        "objective": ("grpo", {"eps_low": float(lo), "eps_high": float(hi), "kl_coef": 0.0}),
        "optimizer.lr": float(sc.lr),
        "updates.num_minibatches": int(updates),
        "updates.routing_replay": replay,
        "rollout.router_noise_std": float(sigma),
        "rollout_correction.mode": mode,
        "rollout_correction.cap": float(cap),
    }


def run_name(arm: str, updates: int, target: float, seed: int) -> str:
    return f"{arm}_u{updates}_d{target:g}_s{seed}"


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    """Every run of the grid without a summary, seed by seed, until the budget
    expires. Returns the number of runs done."""
    sigmas = load_sigmas(out, sc.targets)
    rows = {row[0]: row for row in sc.table}
    done = 0
    for seed in sc.seeds:
        for updates in sc.updates:
            for target, sigma in sigmas.items():
                for arm in sc.arms:
                    name = run_name(arm, int(updates), target, int(seed))
                    path = os.path.join(out, "runs", name + ".jsonl")
                    if os.path.exists(path):
                        old = common.read_jsonl(path)[0]
                        if not math.isclose(old["sigma"], sigma) or old["lr"] != float(sc.lr):
                            raise SystemExit(
                                f"{path}: run at σ={old['sigma']:.4g}, lr={old['lr']:g}; the "
                                f"setting is now σ={sigma:.4g}, lr={sc.lr:g}: use another "
                                "--out and --root"
                            )
                        continue
                    if budget.expired():
                        return done
                    wd = common.run_rl(
                        root,
                        STAGE,
                        name,
                        sc.arm,
                        int(seed),
                        overrides(sc, arm, int(updates), sigma),
                        int(sc.steps),
                        smoke=sc.smoke,
                    )
                    _, replay, mode, cap = rows[arm]
                    meta = dict(
                        arm=arm,
                        model=sc.arm,
                        updates=int(updates),
                        target=float(target),
                        sigma=float(sigma),
                        seed=int(seed),
                        lr=float(sc.lr),
                        replay=replay,
                        rc_mode=mode,
                        rc_cap=float(cap),
                    )
                    summary = common.summarize_run(wd, meta)
                    common.write_jsonl(path, [summary])
                    s = summary["series"]
                    log(
                        f"{name}: mismatch_kl {_mean(s.get('mismatch_kl')):.3g}, "
                        f"mismatch_route {_mean(s.get('mismatch_route')):.3g}, held-out "
                        f"{summary['eval_start']} -> {summary['eval_final']}"
                    )
                    done += 1
    return done


# --------------------------------------------------------------------------
# Statistics and the decision rules.


def _mean(values) -> float:
    v = [float(x) for x in (values or []) if x is not None and math.isfinite(float(x))]
    return float(np.mean(v)) if v else math.nan


def run_mean(run: dict, key: str) -> float:
    """A run's mean of a per-step series over its RL steps (nan if never logged)."""
    return _mean(run["series"].get(key))


def r3_removes(grpo_kl, r3_kl, factor: float = 10.0) -> bool:
    """Rule 1 at one noise level: R3's seed-mean mismatch_kl at least ``factor`` × below
    GRPO's, with non-overlapping bootstrap intervals. Arguments: (mean, lo, hi)."""
    g, g_lo, _ = grpo_kl
    r, _, r_hi = r3_kl
    return bool(r * factor <= g and r_hi < g_lo)


def cells(runs: list[dict]) -> dict:
    """{(updates, target): {arm: [runs]}}, arms in the table's order."""
    order = [row[0] for row in stage4_config.ARMS]
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in runs:
        out[(r["updates"], r["target"])][r["arm"]].append(r)
    rank = lambda a: (order.index(a) if a in order else len(order), a)  # noqa: E731
    return {
        k: {a: sorted(v[a], key=lambda r: r["seed"]) for a in sorted(v, key=rank)}
        for k, v in sorted(out.items())
    }


def _ci(values, spec=".3g"):
    v = [x for x in values if x is not None and math.isfinite(x)]
    return common.fmt_ci(*common.bootstrap_ci(v), spec) if v else "-"


def table(cs: dict) -> str:
    lines = [
        "| updates / rollout | target disagreement (σ) | arm | seeds | mismatch_kl [95% CI] "
        "| mismatch_f2 [95% CI] | mismatch_route | final held-out reward [95% CI] |",
        "|---:|---|---|---:|---|---|---:|---|",
    ]
    for (u, t), arms in cs.items():
        for arm, rs in arms.items():
            sigma = rs[0]["sigma"]
            route = _mean([run_mean(r, "mismatch_route") for r in rs])
            finals = [r["eval_final"] for r in rs if r["eval_final"] is not None]
            lines.append(
                f"| {u} | {t:g} ({sigma:.3g}) | {arm} | {len(rs)} "
                f"| {_ci([run_mean(r, 'mismatch_kl') for r in rs])} "
                f"| {_ci([run_mean(r, 'mismatch_f2') for r in rs])} | {route:.3g} "
                f"| {_ci(finals, '.3f')} |"
            )
    return "\n".join(lines) + "\n"


def _short(n_seeds: int, *groups) -> str:
    """ "" when every group has all ``n_seeds`` runs, else the words that mark a
    comparison preliminary: a verdict needs the whole grid."""
    have = min(len(g) for g in groups)
    return "" if have >= n_seeds else f"preliminary, {have} of {n_seeds} seeds: "


def decisions(cs: dict, n_seeds: int) -> list[str]:
    """The README's two rules per cell; a comparison whose arms lack some of the
    ``n_seeds`` planned seeds shows its numbers marked preliminary, and no verdict."""
    lines = ["### Rule 1: R3 removes the train–inference mismatch\n"]
    for u in sorted({u for u, _ in cs}):
        verdicts = []
        for (uu, t), arms in cs.items():
            if uu != u:
                continue
            if "grpo" not in arms or "grpo_r3" not in arms:
                lines.append(f"- {u} updates, target {t:g}: undecided (grpo or grpo_r3 missing).")
                verdicts.append(None)
                continue
            g = common.bootstrap_ci([run_mean(r, "mismatch_kl") for r in arms["grpo"]])
            r3 = common.bootstrap_ci([run_mean(r, "mismatch_kl") for r in arms["grpo_r3"]])
            short = _short(n_seeds, arms["grpo"], arms["grpo_r3"])
            ok = None if short else r3_removes(g, r3)
            verdicts.append(ok)
            ratio = g[0] / r3[0] if r3[0] > 0 else math.inf
            numbers = (
                f"GRPO {common.fmt_ci(*g, '.3g')}, R3 {common.fmt_ci(*r3, '.3g')} "
                f"(GRPO / R3 = {ratio:.3g})"
            )
            if short:
                lines.append(f"- {u} updates, target {t:g}: {short}{numbers}.")
                continue
            lines.append(
                f"- {u} updates, target {t:g}: {numbers} → "
                + (
                    "≥ 10× below, intervals apart."
                    if ok
                    else "not ≥ 10× below with intervals apart."
                )
            )
        n_levels = len(verdicts)
        if n_levels >= 2 and all(v is True for v in verdicts):
            lines.append(f"- **{u} updates per rollout: R3 removes the mismatch** (both levels).")
        elif any(v is None for v in verdicts) or n_levels < 2:
            lines.append(
                f"- {u} updates per rollout: undecided (both noise levels, every seed, needed)."
            )
        else:
            lines.append(f"- {u} updates per rollout: R3 does **not** remove the mismatch.")
    lines.append("\n### Rule 2: TIS helps (final held-out reward, +TIS minus without)\n")
    for (u, t), arms in cs.items():
        for with_tis, without in (("grpo_tis", "grpo"), ("grpo_r3_tis", "grpo_r3")):
            if with_tis not in arms or without not in arms:
                continue
            a = [r["eval_final"] for r in arms[with_tis] if r["eval_final"] is not None]
            b = [r["eval_final"] for r in arms[without] if r["eval_final"] is not None]
            if not a or not b:
                continue
            d = bootstrap_diff_ci(a, b)
            head = f"- {u} updates, target {t:g}: {with_tis} − {without} = "
            short = _short(n_seeds, a, b)
            if short:
                lines.append(f"{head}{short}{common.fmt_ci(*d, '+.3f')}.")
                continue
            helps = d[1] > 0
            lines.append(
                f"{head}{common.fmt_ci(*d, '+.3f')} → "
                + ("**TIS helps**." if helps else "TIS does not help (interval not above 0).")
            )
    return lines


def figure(cs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(cs)
    order = [row[0] for row in stage4_config.ARMS]
    fig, axes = plt.subplots(
        2, len(keys), figsize=(3.4 * len(keys), 5.2), squeeze=False, sharex="col"
    )
    for j, (u, t) in enumerate(keys):
        for arm, rs in cs[(u, t)].items():
            color = f"C{order.index(arm)}" if arm in order else "k"
            for i, key in enumerate(("mismatch_kl", "mismatch_f2")):
                per_step: dict = collections.defaultdict(list)
                for r in rs:
                    for s, v in zip(r["steps"], r["series"].get(key, [])):
                        if v is not None:
                            per_step[s].append(float(v))
                steps = sorted(per_step)
                y = [np.mean(per_step[s]) for s in steps]
                axes[i][j].plot(steps, y, color=color, lw=1.0, label=f"{arm} ({len(rs)})")
        sigma = next(iter(cs[(u, t)].values()))[0]["sigma"]
        axes[0][j].set_title(f"{u} updates/rollout, target {t:g} (σ {sigma:.3g})", fontsize=8)
        for name, level, style in PAPER_KL:
            axes[0][j].axhline(level, color="0.4", ls=style, lw=0.9, label=name)
        for i, key in enumerate(("mismatch_kl", "mismatch_f2")):
            ax = axes[i][j]
            if any(np.any(np.asarray(line.get_ydata()) > 0) for line in ax.get_lines()):
                ax.set_yscale("log", nonpositive="mask")  # none positive: stays linear
            ax.set_ylabel(key, fontsize=8)
            ax.grid(alpha=0.3)
        axes[1][j].set_xlabel("RL step")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(
        "Train–inference mismatch per RL step (seed mean; log scale); grey: the R3 paper's "
        "KL without replay",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(out: str, n_seeds: int) -> None:
    runs = common.read_records(os.path.join(out, "runs"))
    if not runs:
        raise SystemExit(f"{out}/runs: no finished runs yet")
    cs = cells(runs)
    figure(cs, os.path.join(out, "mismatch.png"))
    calib = ""
    if os.path.exists(calibration_path(out)):
        with open(calibration_path(out)) as f:
            cal = json.load(f)
        calib = "Calibration ({} warm start, seed {}): {}.\n".format(
            cal["arm"],
            cal["seed"],
            "; ".join(
                f"target {r['target']:g} → σ {r['sigma']:.4g} (disagreement "
                f"{r['disagreement']:.4f}, {len(r['points'])} evaluations"
                + ("" if r["within_tol"] else ", NOT within tolerance")
                + ")"
                for r in cal["targets"]
            ),
        )
    text = [
        "# Stage 4: train–inference mismatch\n",
        f"{len(runs)} finished runs; lr {', '.join(sorted({format(r['lr'], 'g') for r in runs}))}.",
        calib,
        "Per run: the mean over its RL steps of mismatch_kl (k3 estimate of "
        "KL(π_sampler‖π_old)), mismatch_f2 (share of tokens with π_old/π_sampler outside "
        "[1/2, 2]) and mismatch_route (routing disagreement); final held-out reward: the "
        "mean of its last two evaluations. Seed means with 95% bootstrap intervals.\n",
        table(cs),
        "## Decision rules (README, Stage 4)\n",
        *decisions(cs, n_seeds),
    ]
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    print(f"stage 4 report: {len(runs)} runs -> {out}")


def main(argv=None) -> None:
    only = ("arms", "updates", "seeds")
    ap = common.stage_parser(__doc__, OUT, "stage4_config.py", only)
    ap.add_argument("--calibrate", action="store_true", help="find σ, write calibration.json")
    args = ap.parse_args(argv)
    sc = common.stage_config(args, only)
    if args.report:
        report(args.out, len(sc.planned_seeds))
        return
    if args.calibrate:
        calibrate(sc, args.root, args.out)
        return
    n = run_all(sc, args.root, args.out, common.Budget(args.max_minutes))
    print(f"stage 4: {n} runs finished into {args.out}")


if __name__ == "__main__":
    main()
