r"""Default config: a tiny MoE policy on Countdown (3 numbers in 1..9), on a 2-core CPU.

A supervised warm start on generated solutions, then GSPO with group
advantages, two mini-batch updates per rollout (the off-policy regime).

    python -m gspo_jax.train --config=configs/default.py --workdir=runs/default
    python -m gspo_jax.train --config=configs/default.py:objective=grpo,smoke --workdir=/tmp/smoke

Arguments (comma-separated): ``objective=<name>`` picks any registered
objective with its own defaults; ``smoke`` shrinks everything to two steps; ``lora``
trains rank-8 LoRA adapters in the RL phase (`LORA`; the warm start stays full).
Any field can be overridden: ``--config.updates.routing_replay=R3``.
"""

from gspo_jax import config as config_lib

# Clip ranges for short responses (docs/objectives.md, "GSPO": the published 3e-4/4e-4
# are tuned for long ones; a 10-token answer needs a wider sequence-level band).
SHORT_RESPONSE_HPARAMS = {
    "gspo": dict(eps_low=0.02, eps_high=0.03),
    "gspo_token": dict(eps_low=0.02, eps_high=0.03),
}


# The LoRA variant (docs/lora.md): rank 8 (alpha 16) on the attention projections and
# the experts, every layer of the tiny MoE being an MoE layer; the routers frozen; a
# learning rate 5x full fine-tuning's, as low-rank adapters usually take.
LORA = dict(
    rank=8,
    alpha=16.0,
    targets=("q", "k", "v", "o", "expert_gate", "expert_up", "expert_down"),
    train_router=False,
)
LORA_LR = 1e-3


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("objective", "smoke", "lora"))
    c = config_lib.base_config()
    name = args.get("objective", "gspo")
    config_lib.set_objective(c, name, SHORT_RESPONSE_HPARAMS.get(name, {}))
    if args.get("lora"):
        c.lora.update(LORA)
        c.optimizer.lr = LORA_LR
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    else:
        # Micro-batches of 32 rows' tokens, packed (gspo_jax.packing). At this shape
        # nothing packs: a Countdown prompt takes 44-45 of a row's 87 slots, so no two
        # sequences share a buffer row (updates.pack_length=348 packs them, but attention
        # over 348 keys costs more on a CPU than it saves). The 32-row micro-batches
        # themselves make the step faster than one of 256 rows (experiments/packing.md).
        seq = c.rollout.max_prompt_len + c.rollout.max_new_tokens - 1
        c.updates.micro_batch_tokens = 32 * seq
    return c
