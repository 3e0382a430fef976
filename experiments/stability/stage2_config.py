"""Stage 2, the stability frontier: the grid (experiments/stability/README.md, "Stage 2").

The learning rates and GSPO's calibrated range come from stage 1's report
(``results/stage1/stage2_plan.json``, decision rules 3 and 4), never chosen by hand.

    python -m experiments.stability.stage2_frontier --root runs/stability
    python -m experiments.stability.stage2_frontier --root /tmp/s2 \
        --config experiments/stability/stage2_config.py:smoke          # seconds
    python -m experiments.stability.stage2_frontier --root runs/stability \
        --config experiments/stability/stage2_config.py:search=moe4    # stage 3's search
    python -m experiments.stability.stage2_frontier --root /tmp/s8 \
        --config experiments/stability/stage2_config.py:scale=gpu      # stage 8, on a GPU

``scale=gpu`` is stage 8 (README, "Stage 8: depth on a GPU"): the frontier of a
12-layer MoE with 64 experts top-8 (``moe12e64k8``, experts of width 32: the study's
active FFN width) and its dense twin ``dense12``, GRPO only, three learning rates
around the CPU critical rate, 3 seeds, bf16 compute (warm starts in f32, as every
warm start), the small task. Its results go to ``results/stage8``.
"""

import json
import os

import ml_collections

PLAN = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "stage1", "stage2_plan.json"
)


# Stage 3's setting search (README, Stage 3, "Setting"): when stage 2 finds no lr at
# which moe2 GRPO collapses and dense2 GRPO does not, the same frontier, GRPO only, is
# run for each fallback in this order until one qualifies. ``search=<name>``.
SEARCH = {
    "moe4": dict(arms=("moe4", "dense4")),
    "moe2k1": dict(arms=("moe2k1", "dense2")),  # top-1 at equal active parameters
    "updates32": dict(updates=32),
    # Countdown `hard`, responses up to 48 characters, its own warm starts (common.TASKS)
    "hard": dict(task="hard"),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    from gspo_jax import config as config_lib

    args = config_lib.parse_arg(arg, known=("smoke", "search", "scale"))
    search = str(args.get("search", ""))
    scale = str(args.get("scale", "cpu"))
    if scale not in ("cpu", "gpu"):
        raise ValueError(f"stage2_config: scale={scale!r}; expected cpu or gpu")
    if scale == "gpu" and search:
        raise ValueError("stage2_config: scale=gpu is stage 8, which has no setting search")
    if search and search not in SEARCH:
        raise ValueError(
            f"stage2_config: search={search!r} is not a fallback; known: {', '.join(SEARCH)}"
        )
    c = ml_collections.ConfigDict()
    c.search = search
    c.scale = scale
    c.dtype = "float32"  # the RL runs' compute dtype (model.dtype)
    c.task = "small"  # common.TASKS
    c.arms = ("moe2", "dense2")
    c.variants = ("grpo", "grpo_dual", "gspo")
    c.seeds = (0, 1, 2)
    c.steps = 60
    c.updates = 16  # optimizer updates per rollout
    c.dual_clip = 3.0
    c.grpo_eps = (0.2, 0.28)
    c.smoke = bool(args.get("smoke", False))
    if scale == "gpu":
        c.arms = ("moe2e8k4", "dense2") if c.smoke else ("moe12e64k8", "dense12")
        c.variants = ("grpo",)
        c.dtype = "bfloat16"
        # Around the CPU critical rate 5.5e-4 (stage 2): its grid points either side and it.
        c.lrs = (3e-4, 5.5e-4, 1e-3)
        if c.smoke:
            c.seeds, c.steps, c.updates, c.lrs = (0,), 2, 2, (1e-3,)
        return c
    if search:
        c.variants = ("grpo",)
        c.update(SEARCH[search])
    if c.smoke:
        if not search:
            c.variants = ("grpo", "gspo")
        c.seeds = (0,)
        c.steps = 2
        c.updates = 2
        c.lrs = (1e-3,)
        c.gspo_eps = (3e-4, 4e-4)
        return c
    if not os.path.exists(PLAN):
        raise FileNotFoundError(
            f"{PLAN}: missing. Stage 2's learning rates and GSPO's calibrated range come "
            "from stage 1: run `python -m experiments.stability.stage1_probes --report`"
        )
    with open(PLAN) as f:
        plan = json.load(f)
    c.lrs = tuple(float(x) for x in plan["lrs"])
    c.gspo_eps = (float(plan["eps_low"]), float(plan["eps_high"]))
    return c
