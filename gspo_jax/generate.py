"""Moved to `gspo_jax.decode` (the decode loop: prefill and KV-cache steps); this path works for one release."""

import sys
import warnings

from gspo_jax import decode as _moved

warnings.warn(
    "gspo_jax.generate moved to gspo_jax.decode; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
