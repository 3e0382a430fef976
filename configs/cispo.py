r"""CISPO: clipped importance-sampling weights, no token ever dropped.

    python -m gspo_jax.train --config=configs/cispo.py --workdir=runs/cispo

Defaults: no lower bound on the IS weight (the MiniMax-M1 setting), upper bound
from the objective's defaults, token-mean. Arguments: ``smoke``.
"""

from gspo_jax import config as config_lib


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("smoke",))
    c = config_lib.base_config()
    config_lib.set_objective(c, "cispo")
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    return c
