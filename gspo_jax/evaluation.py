"""Moved to `gspo_jax.heldout` (held-out evaluation of a run: pass@k, maj@k, mean@n, greedy); this path works for one release."""

import sys
import warnings

from gspo_jax import heldout as _moved

warnings.warn(
    "gspo_jax.evaluation moved to gspo_jax.heldout; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
