"""Stage 9, collapse as a hazard: the pilot, the grid and the event definitions
(experiments/stability/README.md, "Stage 9"). Every value here was committed before the
stage's first run; ``lr`` is set once, by the pilot's rule, in a commit of its own.

    python -m experiments.stability.stage9_hazard --pilot --root runs/stability
    python -m experiments.stability.stage9_hazard --root runs/stability
    python -m experiments.stability.stage9_hazard --report
    python -m experiments.stability.stage9_hazard --root /tmp/s9 \
        --config experiments/stability/stage9_config.py:smoke           # seconds

Arguments (comma-separated): ``smoke``.
"""

import ml_collections

# The primary event, "a sustained fall below the warm start": b is the training reward
# of the warm start's own rollout (RL step 1, 64 prompts x 8 samples, drawn before any
# update); m_t the trailing `window`-step mean of the training reward. The event is at
# the first step that begins `patience` consecutive steps with m_t < `frac` * b. A run
# without one is censored at steps - patience + 1, the last onset its horizon can
# confirm. It asks nothing of a learning bar or of a running peak.
PRIMARY = dict(frac=0.5, window=10, patience=10)

# Its sensitivity: every (frac, window) below, patience = window; the report gives the
# comparisons' hazard ratio and p under each, beside the study's own detector (stage
# 2's: trailing 3-step mean below 0.3 or 0.5 of its running peak for 5 steps) and a KL
# blow-up (the trailing 10-step mean of KL(pi_old || pi) after a rollout's last update,
# `ppo_kl_klast`, above kappa for 10 steps).
SENSITIVITY_FRACS = (0.25, 0.5, 0.75)
SENSITIVITY_WINDOWS = (5, 10, 20)
STAGE2_DETECTOR_FRACS = (0.3, 0.5)
KL_KAPPAS = (0.25, 0.5, 1.0)

# The two comparisons (reference arm first): GRPO against GMPO on the MoE, and the MoE
# against its dense twin under GRPO. Holm's correction runs over both.
COMPARISONS = (
    ("grpo_vs_gmpo", ("moe2", "grpo"), ("moe2", "gmpo")),
    ("moe_vs_dense", ("moe2", "grpo"), ("dense2", "grpo")),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    from gspo_jax import config as config_lib

    args = config_lib.parse_arg(arg, known=("smoke",))
    c = ml_collections.ConfigDict()
    c.smoke = bool(args.get("smoke", False))
    c.task = "small"
    c.arms = ("moe2", "dense2")
    c.variants = ("grpo", "gmpo")
    c.cells = (("moe2", "grpo"), ("moe2", "gmpo"), ("dense2", "grpo"))  # (arm, variant)
    c.steps = 150
    c.updates = 16  # optimizer updates per rollout, stages 2 and 5's
    c.grpo_eps = (0.2, 0.28)
    # The compute budget: 12 seeds per cell, 36 runs (about 14 min a moe2 run of 150
    # steps on one core, stage 5's pace). With D events in a comparison a two-sided
    # log-rank test at 0.05 has 80% power for a hazard ratio of
    # exp(2.80 / sqrt(D / 4)) (Schoenfeld): 4.2 at D = 15, 3.0 at 24, 2.0 needs 66 events
    # (about 131 runs at an event probability of 0.5): README, "Stage 9", "Power".
    c.seeds = tuple(range(12))
    # Set by the pilot's rule (README, "Stage 9", "Pilot") in a commit of its own; the
    # grid refuses to run while it is None. 2026-12-07: 2 of the 4 pilot runs at 5.5e-4
    # had the primary event (results/stage9/pilot).
    c.lr = 5.5e-4

    # The pilot: moe2 GRPO at each candidate rate in turn, on seeds the grid does not
    # use (their runs never enter the comparisons). The lower rate is chosen if at least
    # 2 of its 4 runs have the primary event (the higher is then not run); otherwise the
    # higher, whatever its count (the report then says how few events the grid expects).
    p = ml_collections.ConfigDict()
    p.arm, p.variant = "moe2", "grpo"
    p.lrs = (5.5e-4, 7e-4)  # stage 2's critical 5.5e-4, and 1.27x it
    p.seeds = (100, 101, 102, 103)
    p.min_events = 2
    c.pilot = p

    if c.smoke:
        c.seeds = (0,)
        c.steps = 3
        c.updates = 2
        c.lr = 1e-3
        p.lrs = (1e-3,)
        p.seeds = (0,)
    return c
