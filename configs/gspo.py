r"""GSPO and GSPO-token: the sequence-level importance ratio.

    python -m gspo_jax.train --config=configs/gspo.py --workdir=runs/gspo
    python -m gspo_jax.train --config=configs/gspo.py:variant=gspo_token --workdir=runs/gspo_token
    python -m gspo_jax.train --config=configs/gspo.py:eps=paper --workdir=runs/gspo_paper_eps

Arguments: ``variant`` = gspo (default) | gspo_token; ``eps`` = short (default:
0.02/0.03, for the ~10-token answers of the CPU tasks) | paper (3e-4/4e-4, the
published values, tuned for long responses); ``smoke``.
"""

from gspo_jax import config as config_lib

EPS = {"short": dict(eps_low=0.02, eps_high=0.03), "paper": dict(eps_low=3e-4, eps_high=4e-4)}


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("variant", "eps", "smoke"))
    variant = args.get("variant", "gspo")
    if variant not in ("gspo", "gspo_token"):
        raise config_lib.ConfigError(
            f"configs/gspo.py: variant must be gspo or gspo_token, got {variant!r}"
        )
    eps = args.get("eps", "short")
    if eps not in EPS:
        raise config_lib.ConfigError(
            f"configs/gspo.py: eps must be one of {sorted(EPS)}, got {eps!r}"
        )
    c = config_lib.base_config()
    config_lib.set_objective(c, variant, EPS[eps])
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    return c
