"""Stage 2, the stability frontier: the grid (experiments/stability/README.md, "Stage 2").

The learning rates and GSPO's calibrated range come from stage 1's report
(``results/stage1/stage2_plan.json``, decision rules 3 and 4), never chosen by hand.

    PYTHONPATH=. python experiments/stability/stage2_frontier.py --root runs/stability
    PYTHONPATH=. python experiments/stability/stage2_frontier.py --root /tmp/s2 \
        --config experiments/stability/stage2_config.py:smoke          # seconds
"""

import json
import os

import ml_collections

PLAN = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "stage1", "stage2_plan.json"
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.arms = ("moe2", "dense2")
    c.variants = ("grpo", "grpo_dual", "gspo")
    c.seeds = (0, 1, 2)
    c.steps = 60
    c.updates = 16  # optimizer updates per rollout
    c.dual_clip = 3.0
    c.grpo_eps = (0.2, 0.28)
    c.smoke = arg == "smoke"
    if c.smoke:
        c.arms = ("moe2", "dense2")
        c.variants = ("grpo", "gspo")
        c.seeds = (0,)
        c.steps = 2
        c.updates = 2
        c.lrs = (1e-3,)
        c.gspo_eps = (3e-4, 4e-4)
        return c
    if arg:
        raise ValueError(f"stage2_config: unknown argument {arg!r} (known: smoke)")
    if not os.path.exists(PLAN):
        raise FileNotFoundError(
            f"{PLAN}: missing. Stage 2's learning rates and GSPO's calibrated range come "
            "from stage 1: run `python experiments/stability/stage1_probes.py --report`"
        )
    with open(PLAN) as f:
        plan = json.load(f)
    c.lrs = tuple(float(x) for x in plan["lrs"])
    c.gspo_eps = (float(plan["eps_low"]), float(plan["eps_high"]))
    return c
