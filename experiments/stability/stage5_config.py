"""Stage 5, learn then collapse: the probes and the grid (experiments/stability/README.md,
"Stage 5"). Every value here was committed before the stage's first run.

    python -m experiments.stability.stage5_learn_collapse --probes --root runs/stability
    python -m experiments.stability.stage5_learn_collapse --root runs/stability
    python -m experiments.stability.stage5_learn_collapse --root /tmp/s5 \
        --config experiments/stability/stage5_config.py:smoke          # seconds

Arguments (comma-separated): ``smoke``.
"""

import ml_collections

# The critical learning rate stage 2 measured for GRPO on both moe2 and dense2
# (results/stage2/frontier.md): stage 5's rates sit below it.
STAGE2_CRITICAL_LR = 5.5e-4


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    from gspo_jax import config as config_lib

    args = config_lib.parse_arg(arg, known=("smoke",))
    c = ml_collections.ConfigDict()
    c.smoke = bool(args.get("smoke", False))
    c.task = "small"
    c.arms = ("moe2", "dense2")
    # GRPO, and GMPO, which prevented stage 3's collapse on both architectures. The grid
    # runs GRPO's cells first: a chunk that ends early leaves GMPO's for later.
    c.variants = ("grpo", "gmpo")
    # 0.55x and 0.77x stage 2's critical rate (a factor of sqrt(2) apart); 3e-4 is
    # stage 2's grid point below it, where every run learned in 60 steps.
    c.lrs = (4.2e-4, 3e-4)
    c.seeds = (0, 1, 2, 3)
    c.steps = 250
    c.updates = 16  # optimizer updates per rollout, stage 2's
    c.grpo_eps = (0.2, 0.28)

    # The probes (README, "Stage 5", "Probes"): stage 1's measurement at low learning
    # rates with three times stage 1's rollouts per cell, on rollout batches stage 1 did
    # not use (batch indices from `batch_offset`), GRPO only. Read by
    # `stage5_report.probe_rule`.
    p = ml_collections.ConfigDict()
    p.arms = ("moe2", "dense2")
    p.objectives = ("grpo",)
    p.lrs = (3e-5, 1e-4)
    p.seeds = (0, 1, 2, 3)
    p.batches = 6
    p.batch_offset = 2  # stage 1 used batches 0 and 1, the hint's data
    p.updates = 16
    p.prompts = 64
    p.group_size = 8
    p.grpo_eps = (0.2, 0.28)
    p.gspo_eps = (3e-4, 4e-4)
    p.gspo_named = ()
    p.gspo_grid_lo = 1e-4
    p.gspo_grid_hi = 0.9
    p.gspo_grid_points = 2  # no calibration here: two points keep the record small
    p.length_edges = (6, 8, 10)
    p.smoke = c.smoke
    c.probes = p

    if c.smoke:
        c.seeds = (0,)
        c.steps = 3
        c.updates = 2
        c.lrs = (1e-3,)
        p.seeds = (0,)
        p.lrs = (1e-4,)
        p.batches = 1
        p.updates = 2
        p.prompts = 4
        p.group_size = 4
    return c
