r"""GMPO and RSPO: geometric-mean ratios; RSPO adds router-shift reweighting.

    python -m gspo_jax.train --config=configs/gmpo_rspo.py --workdir=runs/rspo
    python -m gspo_jax.train --config=configs/gmpo_rspo.py:variant=gmpo --workdir=runs/gmpo
    python -m gspo_jax.train --config=configs/gmpo_rspo.py:gamma_min=0.3,replay=R2 --workdir=runs/rspo_r2

Arguments: ``variant`` = rspo (default) | gmpo; ``gamma_min`` (RSPO's floor on
γ, ``objective.hparams.gamma_min``, default 0.5: the paper does not fix it, sweep it);
``replay`` = none | R2 | R3; ``smoke``.
"""

from gspo_jax import config as config_lib


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("variant", "gamma_min", "replay", "smoke"))
    variant = args.get("variant", "rspo")
    if variant not in ("rspo", "gmpo"):
        raise config_lib.ConfigError(
            f"configs/gmpo_rspo.py: variant must be rspo or gmpo, got {variant!r}"
        )
    hparams = {}
    if "gamma_min" in args:
        if variant != "rspo":
            raise config_lib.ConfigError(
                "configs/gmpo_rspo.py: gamma_min is RSPO's floor; variant gmpo takes none"
            )
        hparams["gamma_min"] = float(args["gamma_min"])
    c = config_lib.base_config()
    config_lib.set_objective(c, variant, hparams)
    c.updates.routing_replay = args.get("replay", "none")
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    return c
