"""Stage 4 of the stability study: train–inference mismatch
(experiments/stability/README.md, "Stage 4").

A sampler whose routing differs from the trainer's by a known amount: Gaussian router
noise σ on the sampler's router logits only (``rollout.router_noise_std``), calibrated
(``--calibrate``) on the MoE's warm start to the target routing disagreements by
bisection on log σ. The disagreement is measured as the trainer measures its
``mismatch_route``: the sampler's record against the trainer's free routing of the same
sequences (``RLPhase.collect`` then ``RLPhase.prepare``, at the warm start's
parameters, on the first RL rollout(s) of the calibration seed).

Then GRPO, GRPO+R3, GRPO+token TIS (cap 2) and GRPO+R3+TIS, at 1 and 8 updates per
rollout, at both noise levels, 3 seeds, 40 RL steps. Each run resumes from its own
checkpoints in ``<root>/stage4/<name>``; its compact summary goes to
``<out>/runs/<name>.jsonl`` when it finishes, and a run with a summary is skipped.

    python -m experiments.stability.stage4_mismatch --root runs/stability --calibrate
    python -m experiments.stability.stage4_mismatch --root runs/stability \
        --only-seeds 0 --max-minutes 55                                 # one chunk
    python -m experiments.stability.stage4_mismatch --report
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable

import numpy as np

from experiments.stability import common, stage4_report
from experiments.stability.stage4_report import calibration_path, run_mean

OUT = os.path.join(common.RESULTS, "stage4")
STAGE = "stage4"


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


def calibrate(sc, root: str, out: str, log=print) -> dict:
    """Bisection for every target on the warm start of ``sc.arm``, seed
    ``sc.calib_seed``; writes ``<out>/calibration.json``."""
    import jax

    from gspo_jax import sft
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    seed = int(sc.calib_seed)
    warm = common.ensure_warm_start(root, sc.arm, seed, smoke=sc.smoke)
    c = common.rl_config(sc.arm, seed, root, smoke=sc.smoke)  # as the stage's RL runs
    trainer = RunParts(c, warm)
    params = sft.final_params(trainer)
    if params is None:
        raise RuntimeError(f"{warm}: the warm start's final checkpoint does not restore")
    phase = RLPhase(trainer, params)
    evaluations: dict[float, dict] = {}

    def measure(sigma: float) -> float:
        """The mismatch at σ, averaged over the seed's first calib_batches rollouts
        (the rollouts of its RL steps 1.. at the warm start: the same keys the trainer
        uses, so every σ sees the same prompts and sampling noise)."""
        if sigma not in evaluations:
            rollout = dataclasses.replace(trainer.cfg.rollout, router_noise_std=float(sigma))
            trainer.cfg = dataclasses.replace(trainer.cfg, rollout=rollout)
            per = []
            for b in range(int(sc.calib_batches)):
                rng = jax.random.fold_in(jax.random.key(c.seed + 1), b)
                queued = phase.queued(*phase.collect(params, b, rng), step=b, version=0)
                _, info = phase.prepare(queued, 0)
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
            "`python -m experiments.stability.stage4_mismatch --calibrate` (same --root, "
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


def grid(sc, sigmas: dict[float, float]):
    """The grid's runs at the calibrated ``sigmas`` ({target: σ}), seed by seed."""
    rows = {row[0]: row for row in sc.table}
    for seed in sc.seeds:
        for updates in sc.updates:
            for target, sigma in sigmas.items():
                for arm in sc.arms:
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
                    yield common.GridRun(
                        run_name(arm, int(updates), target, int(seed)),
                        sc.arm,
                        int(seed),
                        overrides(sc, arm, int(updates), sigma),
                        int(sc.steps),
                        meta,
                    )


def same_noise(path: str, old: dict, run: common.GridRun) -> None:
    """Refuses a summary run at another σ or lr than ``run``'s."""
    sigma, lr = run.meta["sigma"], run.meta["lr"]
    if not math.isclose(old["sigma"], sigma) or old["lr"] != lr:
        raise SystemExit(
            f"{path}: run at σ={old['sigma']:.4g}, lr={old['lr']:g}; the "
            f"setting is now σ={sigma:.4g}, lr={lr:g}: use another "
            "--out and --root"
        )


def mismatch_line(summary: dict) -> str:
    return (
        f"mismatch_kl {run_mean(summary, 'mismatch_kl'):.3g}, "
        f"mismatch_route {run_mean(summary, 'mismatch_route'):.3g}, held-out "
        f"{summary['eval_start']} -> {summary['eval_final']}"
    )


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    """Every run of the grid without a summary in ``<out>/runs``, until the budget
    expires. Returns the number of runs done."""
    return common.run_grid(
        grid(sc, load_sigmas(out, sc.targets)),
        root,
        STAGE,
        os.path.join(out, "runs"),
        budget,
        smoke=sc.smoke,
        check=same_noise,
        describe=mismatch_line,
        log=log,
    )


def main(argv=None) -> None:
    only = ("arms", "updates", "seeds")
    ap = common.stage_parser(__doc__, OUT, "stage4_config.py", only)
    ap.add_argument("--calibrate", action="store_true", help="find σ, write calibration.json")
    args = ap.parse_args(argv)
    sc = common.stage_config(args, only)
    if args.report:
        stage4_report.report(args.out, len(sc.planned_seeds))
        return
    if args.calibrate:
        calibrate(sc, args.root, args.out)
        return
    n = run_all(sc, args.root, args.out, common.Budget(args.max_minutes))
    print(f"stage 4: {n} runs finished into {args.out}")


if __name__ == "__main__":
    main()
