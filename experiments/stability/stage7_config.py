"""Stage 7, a mismatch from numerics: the measurement and the grid
(experiments/stability/README.md, "Stage 7"). Every value here was committed before
the stage's first run.

The sampler computes in bf16, or in bf16 reading int8 weights (W8A16, as an inference
engine may), while the trainer computes in f32 (``rollout.sampler_dtype``,
``rollout.sampler_quantization``; `gspo_jax.models.precision.SamplerPrecision`). The
same-precision arm (``f32``) is the control: its mismatch is float rounding between two
code paths (about 1e-14 nats/token), the σ = 0 of stage 4.

    python -m experiments.stability.stage7_numerics --root runs/stability --measure
    python -m experiments.stability.stage7_numerics --root runs/stability
    python -m experiments.stability.stage7_numerics --root /tmp/s7 \
        --config experiments/stability/stage7_config.py:smoke           # seconds

Arguments (comma-separated): ``smoke``.
"""

import ml_collections

GRPO_EPS = (0.2, 0.28)

# The sampler's precisions: name -> (rollout.sampler_dtype, rollout.sampler_quantization).
PRECISIONS = {
    "f32": ("", "none"),  # the trainer's own: the control
    "bf16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),  # int8 weights, bf16 compute
}

# The arms: name -> (precision, routing replay, rollout correction). MoE arms run on
# ``arm``, dense arms (no replay) on ``dense_arm``.
MOE_ARMS = (
    ("f32", "f32", "none", "none"),
    ("bf16", "bf16", "none", "none"),
    ("bf16_r3", "bf16", "R3", "none"),
    ("bf16_tis", "bf16", "none", "token_tis"),
    ("int8", "int8", "none", "none"),
    ("int8_r3", "int8", "R3", "none"),
)
DENSE_ARMS = (
    ("f32", "f32", "none", "none"),
    ("bf16", "bf16", "none", "none"),
    ("int8", "int8", "none", "none"),
)
TIS_CAP = 2.0  # stage 4's


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    from gspo_jax import config as config_lib

    args = config_lib.parse_arg(arg, known=("smoke",))
    c = ml_collections.ConfigDict()
    c.smoke = bool(args.get("smoke", False))
    c.task = "small"
    c.arm = "moe2"
    c.dense_arm = "dense2"
    c.arms = (c.arm, c.dense_arm)
    c.moe_arms = MOE_ARMS
    c.dense_arms = DENSE_ARMS
    c.variants = tuple(row[0] for row in MOE_ARMS)
    c.precisions = tuple(PRECISIONS)
    # Near the stability boundary: stage 5's higher rate, 0.77x stage 2's critical
    # 5.5e-4 (stage 4 ran at 2e-4, far inside the stable region).
    c.lr = 4.2e-4
    c.updates = 16
    c.steps = 100
    c.seeds = (0, 1, 2, 3)
    c.grpo_eps = GRPO_EPS
    c.tis_cap = TIS_CAP
    # The measurement: each precision's mismatch on each seed's warm start, over its
    # first `measure_batches` RL rollouts (the keys and prompts the runs' first steps use).
    c.measure_batches = 2
    if c.smoke:
        c.seeds = (0,)
        c.steps = 2
        c.updates = 2
        c.lr = 1e-3
        c.measure_batches = 1
        c.variants = ("f32", "bf16_r3", "int8")
        c.precisions = ("f32", "int8")
    return c
