"""Stage 4, train–inference mismatch: the calibration and the grid
(experiments/stability/README.md, "Stage 4").

Router noise σ is calibrated on the MoE's warm start (``stage4_mismatch.py
--calibrate``, written to ``<out>/calibration.json``) to the target routing
disagreements; the runs read σ from that file, never a hand-chosen value.

    python -m experiments.stability.stage4_mismatch --root runs/stability --calibrate
    python -m experiments.stability.stage4_mismatch --root runs/stability
    python -m experiments.stability.stage4_mismatch --root /tmp/s4 \
        --config experiments/stability/stage4_config.py:smoke --calibrate     # seconds

Arguments (comma-separated): ``lr`` (RL learning rate, default 2e-4), ``smoke``.
"""

import ml_collections

GRPO_EPS = (0.2, 0.28)

# The arms (README, "Setup"): name -> (routing replay, rollout correction mode, its cap).
ARMS = (
    ("grpo", "none", "none", 2.0),
    ("grpo_r3", "R3", "none", 2.0),
    ("grpo_tis", "none", "token_tis", 2.0),
    ("grpo_r3_tis", "R3", "token_tis", 2.0),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    from gspo_jax import config as config_lib

    args = config_lib.parse_arg(arg, known=("smoke", "lr"))
    c = ml_collections.ConfigDict()
    c.smoke = bool(args.get("smoke", False))
    c.arm = "moe2"  # the MoE whose warm start the noise is calibrated on, and trained
    # Calibration: bisection on log σ within [sigma_lo, sigma_hi] for each target
    # routing disagreement (the trainer's `mismatch_route`: the share of the sampler's
    # top-K choices the trainer's free router does not make), on the warm start of
    # calib_seed, over the first calib_batches RL rollouts of that seed.
    c.calib_seed = 0
    c.calib_batches = 1
    c.targets = (0.05, 0.10)
    c.sigma_lo = 0.005
    c.sigma_hi = 2.0
    c.max_evals = 8  # per target; evaluations are shared between targets
    c.tol = 0.1  # stop a target's bisection within this relative distance of it
    # The grid.
    c.arms = tuple(row[0] for row in ARMS)
    c.table = ARMS
    c.updates = (1, 8)  # optimizer updates per rollout
    c.seeds = (0, 1, 2)
    c.steps = 40
    # The README fixes no learning rate for stage 4: configs/stability.py's RL rate.
    c.lr = float(args.get("lr", 2e-4))
    c.grpo_eps = GRPO_EPS
    if c.smoke:
        c.arms = ("grpo", "grpo_r3", "grpo_tis")
        c.updates = (2,)
        c.seeds = (0,)
        c.steps = 2
        c.max_evals = 2
        c.lr = float(args.get("lr", 1e-3))
    return c
