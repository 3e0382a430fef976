"""Moved to `gspo_jax.run_parts` (the run's parts: tokenizer, mesh, data, model, sampler); this path works for one release."""

import sys
import warnings

from gspo_jax import run_parts as _moved

warnings.warn(
    "gspo_jax.trainer moved to gspo_jax.run_parts; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
