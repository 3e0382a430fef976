r"""GRPO-family runs: GRPO, Dr.GRPO and DAPO (with its four techniques).

    python -m gspo_jax.train --config=configs/grpo.py --workdir=runs/grpo
    python -m gspo_jax.train --config=configs/grpo.py:variant=dr_grpo --workdir=runs/dr_grpo
    python -m gspo_jax.train --config=configs/grpo.py:variant=dapo --workdir=runs/dapo

Arguments: ``variant`` = grpo (default) | dr_grpo | dapo; ``smoke``.

* grpo: token-level clip 0.2/0.2, seq-mean-token-mean, KL k3 with β=0.04 to the
  warm-started policy, group advantages (std-normalised).
* dr_grpo: no std division, seq-mean-token-sum-norm (no 1/|o|), β=0.
* dapo: clip-higher (0.2/0.28), token-mean, dynamic sampling, overlong filtering
  and soft overlong punishment, β=0.
"""

from gspo_jax import config as config_lib

VARIANTS = ("grpo", "dr_grpo", "dapo")


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("variant", "smoke"))
    variant = args.get("variant", "grpo")
    if variant not in VARIANTS:
        raise config_lib.ConfigError(
            f"configs/grpo.py: variant must be one of {VARIANTS}, got {variant!r}"
        )
    c = config_lib.base_config()
    config_lib.set_objective(c, variant)
    if variant == "dr_grpo":
        c.advantage = "group_no_std"
    if variant == "dapo":
        c.dapo.dynamic_sampling = True
        c.dapo.overlong_filter = True
        c.dapo.soft_overlong = True
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    return c
