"""Stage 6, staleness: the grid (experiments/stability/README.md, "Stage 6"). Every value
here was committed before the stage's first run.

    taskset -c 0 python -m experiments.stability.stage6_staleness --root runs/stability \
        --only-arms moe2 --max-minutes 55
    python -m experiments.stability.stage6_staleness --root /tmp/s6 \
        --config experiments/stability/stage6_config.py:smoke          # minutes

The arms (`ARMS`): each a trust region, a rollout correction and a routing replay.

* ``behaviour``: the clip around the sampler's policy π_behaviour, no weight (AReaL's
  "naive PPO").
* ``decoupled_tis``: the clip around the proximal policy (the step's own parameters),
  each token's loss weighted by π_proximal / π_behaviour truncated at ``tis_cap``
  (AReaL's decoupled loss).
* ``behaviour_r3``, ``decoupled_tis_r3``: the same with R3 (the update replays the
  sampler's routing, k steps old), MoE only.

At staleness k = 0 the sampler is the policy the step starts from, so π_behaviour and
π_proximal are the same policy up to rounding and both trust regions train the same run.
k = 0 therefore runs only the decoupled arms (``decoupled_tis``, and
``decoupled_tis_r3`` on the MoE), and the report takes that run as the k = 0 point of
every arm of its architecture with the same replay: ``behaviour`` at k = 0 is
``decoupled_tis`` at k = 0, ``behaviour_r3`` at k = 0 is ``decoupled_tis_r3`` at k = 0
(`stage6_report.k0_variant`). The dense twin runs the arms without R3 only. The grid:
moe2 2 + 4 × 4 = 18 cells, dense2 1 + 2 × 4 = 9, × 3 seeds = 81 runs.

The control ``small_steps`` (README, "Stage 6", "Control C1"; fixed after the grid's
first 23 runs and before any run of its own): the dense twin, the two arms without R3,
k in {0, 8}, with 4 updates per rollout instead of 16, so that one RL step moves the
policy about 0.015 nats per token instead of about 0.08 and eight steps stay within the
behaviour arm's distance from its sampler. Its runs go to ``<root>/stage6_small_steps``
and ``results/stage6_small_steps``.

Arguments (comma-separated): ``smoke``, ``small_steps``.
"""

import ml_collections

# The critical learning rate stage 2 measured for GRPO on both moe2 and dense2
# (results/stage2/frontier.md): the stage's rate sits below it.
STAGE2_CRITICAL_LR = 5.5e-4

# name -> (updates.trust_region, rollout_correction.mode, updates.routing_replay)
ARMS = (
    ("behaviour", "behaviour", "none", "none"),
    ("decoupled_tis", "decoupled", "token_tis", "none"),
    ("behaviour_r3", "behaviour", "none", "R3"),
    ("decoupled_tis_r3", "decoupled", "token_tis", "R3"),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    from gspo_jax import config as config_lib

    args = config_lib.parse_arg(arg, known=("smoke", "small_steps"))
    c = ml_collections.ConfigDict()
    c.smoke = bool(args.get("smoke", False))
    c.name = "stage6"  # the runs' folder under --root, and the results' under results/
    c.task = "small"
    c.arms = ("moe2", "dense2")  # the architectures (common.arm_fields)
    c.variants = tuple(row[0] for row in ARMS)  # the arms of the table, by name
    c.table = ARMS
    c.seeds = (0, 1, 2)
    c.steps = 60
    c.updates = 16  # optimizer updates per rollout, stage 2's
    # Stage 2's grid point below its critical rate 5.5e-4, where every run learned in 60
    # steps at k = 0.
    c.lr = 3e-4
    c.grpo_eps = (0.2, 0.28)
    c.kl_coef = 0.0
    c.stalenesses = (0, 1, 2, 4, 8)
    # The staleness the rules R1-R4 read (README, "Stage 6", "Decision rules").
    c.rule_staleness = 8
    c.tis_cap = 2.0  # rollout_correction.cap: the truncation of token_tis's weight
    if args.get("small_steps", False):
        c.name = "stage6_small_steps"
        c.arms = ("dense2",)
        c.variants = ("behaviour", "decoupled_tis")
        c.stalenesses = (0, 8)
        # KL(pi_proximal || pi after m updates), k = 0 runs of the grid, RL steps 6-60:
        # about 0.015 after 4 updates, 0.07-0.11 after 15 (README, "Control C1").
        c.updates = 4
    if c.smoke:
        c.seeds = (0,)
        c.steps = 3
        c.updates = 2
        c.stalenesses = (0, 2)
        c.rule_staleness = 2
        c.lr = 1e-3
    return c
