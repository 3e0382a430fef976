"""Stage 1, drift probes: the grid (experiments/stability/README.md, "Stage 1").

    python -m experiments.stability.stage1_probes --root runs/stability
    python -m experiments.stability.stage1_probes --root /tmp/s1 \
        --config experiments/stability/stage1_config.py:smoke          # seconds
"""

import ml_collections
import numpy as np


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.arms = ("moe2", "dense2", "moe4", "dense4", "moe8")
    c.objectives = ("grpo", "gspo")
    c.lrs = (1e-4, 3e-4, 1e-3, 3e-3)
    c.seeds = (0, 1, 2)
    c.batches = 2  # rollout batches per probe, each from the warm start
    c.updates = 16  # sequential updates per batch, one mini-batch each
    c.prompts = 64  # per rollout batch
    c.group_size = 8
    # The objectives being trained: GRPO's token clip (DAPO's clip-higher range) and
    # GSPO's paper range.
    c.grpo_eps = (0.2, 0.28)
    c.gspo_eps = (3e-4, 4e-4)
    # Counterfactual clip fractions measured after every update, whatever the arm trains:
    # GRPO's range, GSPO's paper range and ten times it, and a grid of sequence ranges
    # (eps_low, 4/3 eps_low) from which the calibrated range is read (README).
    c.gspo_named = ((3e-4, 4e-4), (3e-3, 4e-3))
    # (Amended: the grid first ended at 0.3, below the calibrated range; README, rule 3.)
    c.gspo_grid_lo = 1e-4
    c.gspo_grid_hi = 0.9
    c.gspo_grid_points = 20
    # Response-length buckets (characters): <= 6, 7-8, 9-10, >= 11. (Amended from
    # 8/12/16: Countdown's responses here are at most 12 characters; README.)
    c.length_edges = (6, 8, 10)
    c.smoke = False
    if arg == "smoke":
        c.arms = ("moe2", "dense2")
        c.objectives = ("grpo", "gspo")
        c.lrs = (1e-3,)
        c.seeds = (0,)
        c.batches = 1
        c.updates = 2
        c.prompts = 4
        c.group_size = 4
        c.smoke = True
    elif arg:
        raise ValueError(f"stage1_config: unknown argument {arg!r} (known: smoke)")
    return c


def gspo_grid(sc) -> tuple[tuple[float, float], ...]:
    """The sequence clip ranges measured: the named ones, then the calibration grid
    (eps_low log-spaced, eps_high = 4/3 eps_low, GSPO's proportion)."""
    lows = np.geomspace(sc.gspo_grid_lo, sc.gspo_grid_hi, int(sc.gspo_grid_points))
    grid = tuple((float(lo), float(lo) * 4.0 / 3.0) for lo in lows)
    return tuple(tuple(map(float, r)) for r in sc.gspo_named) + grid
