"""Stage 3's decision rules (experiments/stability/README.md, "Stage 3"), fixed before
its runs: each arm's collapses against GRPO's (one-sided Fisher exact test), the
precursors' thresholds and lead times, the setting rule that picks stage 3's learning
rate from stage 2's GRPO runs, the KL-matched lr and the KL-matched controls' rule.
Functions of run summaries: no training, files or rendering.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from experiments.stability.stats import fisher_one_sided

# --------------------------------------------------------------------------
# The decision rule: fewer collapses than GRPO's, one-sided Fisher p < 0.05.


def prevents_collapse(arm_hits, arm_n, grpo_hits, grpo_n, alpha: float = 0.05):
    """README's rule: fewer collapses than GRPO with one-sided Fisher p < ``alpha``.
    Returns (p, decided)."""
    p = fisher_one_sided(arm_hits, arm_n, grpo_hits, grpo_n)
    return p, bool(arm_hits < grpo_hits and p < alpha)


def collapses(runs: list[dict]) -> int:
    return sum(bool(r["collapsed"]) for r in runs)


def preliminary(n_a: int, n_b: int, planned: int) -> str | None:
    """The mark of a comparison of ``n_a`` against ``n_b`` seeds while fewer than the
    ``planned`` are in (no verdict then); None once both have every seed."""
    n = min(n_a, n_b)
    return f"preliminary ({n} of {planned} seeds)" if n < planned else None


# --------------------------------------------------------------------------
# Precursors (README, "Decision rule"; thresholds fixed before the runs).

BASELINE_STEPS = 10  # the baseline: the median over the run's first 10 RL steps


class Precursor(collections.namedtuple("Precursor", "label key rule lo hi floor")):
    """``rule``: "above" (value > max(hi × baseline, floor)), "below_minus" (value <
    baseline − lo) or "outside" (value < lo × baseline or value > hi × baseline).
    ``floor`` keeps a baseline of 0 from making every positive value a crossing
    (README, amendment to stage 3's rule)."""


PRECURSORS = (
    Precursor("F(τ=2)", "frac_ratio_gt_2_klast", "above", None, 3.0, 0.01),
    Precursor("free flips", "flip_frac_klast", "above", None, 3.0, 0.01),
    Precursor("raw γ", "gamma_raw_mean_klast", "below_minus", 0.1, None, None),
    Precursor("token clip fraction", "clip_frac_klast", "above", None, 3.0, 0.01),
    Precursor("grad norm", "grad_norm", "above", None, 3.0, None),
    Precursor("entropy", "entropy", "outside", 0.5, 2.0, None),
    Precursor("KL", "ppo_kl_klast", "above", None, 3.0, 1e-3),
)


def finite(v) -> bool:
    return v is not None and math.isfinite(float(v))


def baseline(steps, values, first: int = BASELINE_STEPS) -> float | None:
    """The median of ``values`` over RL steps 1..``first`` (None where none logged)."""
    base = [float(v) for s, v in zip(steps, values) if 1 <= s <= first and finite(v)]
    return float(np.median(base)) if base else None


def crosses(value: float, base: float, p: Precursor) -> bool:
    """Whether ``value`` is past precursor ``p``'s threshold around ``base``."""
    if p.rule == "above":
        return value > max(p.hi * base, p.floor or 0.0)
    if p.rule == "below_minus":
        return value < base - p.lo
    if p.rule == "outside":
        return value < p.lo * base or value > p.hi * base
    raise ValueError(f"precursor {p.label}: unknown rule {p.rule!r}")


def first_crossing(steps, values, p: Precursor, first: int = BASELINE_STEPS) -> int | None:
    """The first RL step (any step of the run, the baseline's included) at which the
    series crosses ``p``'s threshold; None when it never does or has no baseline."""
    base = baseline(steps, values, first)
    if base is None:
        return None
    for s, v in zip(steps, values):
        if finite(v) and crosses(float(v), base, p):
            return int(s)
    return None


def lead_time(collapse: int | None, crossing: int | None) -> int | None:
    """Collapse step minus first crossing (negative: it crossed after the collapse)."""
    if collapse is None or crossing is None:
        return None
    return int(collapse) - int(crossing)


def precursor_stats(runs: list[dict], p: Precursor) -> dict:
    """Over ``runs`` (summaries): the lead times of the collapsed runs in which ``p``
    crossed, how many collapsed runs it crossed in, and its false alarms (crossed in a
    run that did not collapse). Runs without the series are left out (``missing``)."""
    leads, crossed_c, n_c, alarms, n_ok, missing = [], 0, 0, 0, 0, 0
    for r in runs:
        values = r["series"].get(p.key)
        if values is None:
            missing += 1
            continue
        x = first_crossing(r["steps"], values, p)
        if r["collapsed"]:
            n_c += 1
            lt = lead_time(r["collapse_step"], x)
            if lt is not None:
                crossed_c += 1
                leads.append(lt)
        else:
            n_ok += 1
            alarms += x is not None
    return dict(
        leads=leads,
        median=float(np.median(leads)) if leads else None,
        range=(min(leads), max(leads)) if leads else None,
        crossed=crossed_c,
        collapsed=n_c,
        false_alarms=alarms,
        not_collapsed=n_ok,
        missing=missing,
    )


# --------------------------------------------------------------------------
# The setting (README, "Setting") from stage 2's results.


# The setting rule's thresholds (README, Stage 3, "Setting").
SETTING_MOE_RATE, SETTING_DENSE_RATE = 2 / 3, 1 / 3


def setting_lr(runs: list[dict], arm: str = "moe2", dense: str = "dense2") -> float | None:
    """The smallest stage-2 lr at which ``arm``'s GRPO collapse rate is >= 2/3 and
    ``dense``'s <= 1/3 (both with runs at that lr); None if no lr qualifies."""
    flags = _grpo_flags(runs)
    for lr in sorted({lr for _, lr in flags}):
        m, d = flags.get((arm, lr)), flags.get((dense, lr))
        if (
            m
            and d
            and np.mean(m) >= SETTING_MOE_RATE - 1e-9
            and np.mean(d) <= SETTING_DENSE_RATE + 1e-9
        ):
            return lr
    return None


def _grpo_flags(runs: list[dict]) -> dict:
    flags = collections.defaultdict(list)
    for r in runs:
        if r.get("variant") == "grpo":
            flags[(r["arm"], float(r["lr"]))].append(bool(r["collapsed"]))
    return flags


def setting_status(moe: list[bool], dense: list[bool], seeds: int) -> str:
    """One lr of a grid planned with ``seeds`` runs per architecture, read on the runs
    so far: "qualifies" when the setting rule holds whatever the missing runs show,
    "cannot" when it fails whatever they show, "open" otherwise."""
    if len(moe) > seeds or len(dense) > seeds:
        raise ValueError(f"{len(moe)} MoE and {len(dense)} dense runs: more than {seeds} seeds")
    need = math.ceil(SETTING_MOE_RATE * seeds - 1e-9)  # MoE collapses the rule needs
    allow = math.floor(SETTING_DENSE_RATE * seeds + 1e-9)  # dense collapses it allows
    if sum(moe) + seeds - len(moe) < need or sum(dense) > allow:
        return "cannot"
    if sum(moe) >= need and sum(dense) + seeds - len(dense) <= allow:
        return "qualifies"
    return "open"


def setting_verdict(
    runs: list[dict], lrs, seeds: int, arm: str, dense: str
) -> tuple[str, float | None, dict[float, str]]:
    """The setting rule on a grid that may be unfinished: ``("found", lr, status)`` when
    every smaller lr cannot qualify and ``lr`` does, ``("none", None, status)`` when no
    lr can, ``("open", lr, status)`` with the smallest lr still open otherwise; ``status``
    maps each lr to `setting_status`."""
    flags = _grpo_flags(runs)
    status = {
        float(lr): setting_status(
            flags.get((arm, float(lr)), []), flags.get((dense, float(lr)), []), seeds
        )
        for lr in sorted(lrs)
    }
    for lr, st in status.items():
        if st != "cannot":
            return ("found" if st == "qualifies" else "open"), lr, status
    return "none", None, status


# --------------------------------------------------------------------------
# The KL-matched controls (README, Stage 3, "The KL-matched GRPO control" and "... GSPO
# control").

KL_KEY = "ppo_kl_klast"  # KL(pi_old || pi_theta) after a rollout's last update


def first_step(run: dict, key: str) -> float | None:
    """A series' value at RL step 1: after the first rollout's updates, which every arm
    of a seed takes from the same warm start on the same rollout batch."""
    values = run["series"].get(key)
    if not values or 1 not in run["steps"]:
        return None
    v = values[run["steps"].index(1)]
    return float(v) if finite(v) else None


def kl_matched_lr(
    grid_runs: list[dict], target_runs: list[dict], arm: str = "moe2", variant: str = "grpo"
) -> dict:
    """The lr at which an objective's first-rollout KL matches the target arm's: the seed
    median of the first-rollout KL of ``arm`` under stage 2's objective ``variant`` at each
    lr of its grid (``grid_runs``),
    interpolated linearly in log KL against log lr to the seed median of the target's
    (``target_runs``, stage-3 summaries). Returns ``lr``, ``target_kl`` and the ``grid``
    (lr -> median KL); refuses a target outside the grid or a grid whose KL does not
    rise with lr between the two points it interpolates."""
    by_lr = collections.defaultdict(list)
    for r in grid_runs:
        if r.get("variant") == variant and r.get("arm") == arm:
            v = first_step(r, KL_KEY)
            if v is not None and v > 0:
                by_lr[float(r["lr"])].append(v)
    grid = {lr: float(np.median(v)) for lr, v in sorted(by_lr.items())}
    target = [first_step(r, KL_KEY) for r in target_runs]
    target = [v for v in target if v is not None and v > 0]
    if len(grid) < 2 or not target:
        raise ValueError(
            f"KL matching needs {arm} {variant}'s first-rollout KL at two or more grid lrs "
            f"(got {sorted(grid)}) and the target arm's (got {len(target)} runs)"
        )
    t = float(np.median(target))
    lrs = list(grid)
    for lo, hi in zip(lrs, lrs[1:]):
        a, b = grid[lo], grid[hi]
        if min(a, b) <= t <= max(a, b):
            if not a < b:
                raise ValueError(
                    f"{variant}'s KL falls from lr {lo:g} ({a:.3g}) to {hi:g} ({b:.3g})"
                )
            w = (math.log(t) - math.log(a)) / (math.log(b) - math.log(a))
            lr = math.exp(math.log(lo) + w * (math.log(hi) - math.log(lo)))
            return dict(lr=float(f"{lr:.4g}"), target_kl=t, grid=grid)
    raise ValueError(
        f"the target's first-rollout KL {t:.3g} is outside {variant}'s on its lr grid "
        f"({', '.join(f'{lr:g}: {k:.3g}' for lr, k in grid.items())})"
    )


def matched_verdict(hits: int, n: int, arm_hits: int, arm_n: int, planned: int) -> tuple:
    """The KL-matched control's rule for one arm that prevented the collapse: "not the
    step" if the control collapses more often with one-sided Fisher p < 0.05, "the step
    can explain it" if it collapses in at most a fifth of its seeds (1 of 5),
    "inconclusive" otherwise; "preliminary" before every planned seed is in. Returns
    (p, verdict)."""
    p, fewer = prevents_collapse(arm_hits, arm_n, hits, n)
    if short := preliminary(n, arm_n, planned):
        return p, short
    if fewer:
        return p, "**not explained by the smaller step**"
    if hits <= n / 5:
        return p, "the smaller step can explain it"
    return p, "inconclusive"
