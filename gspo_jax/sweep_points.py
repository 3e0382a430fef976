"""Moved to `gspo_jax.sweep_grid` (a sweep file's grid of points, expanded and validated); this path works for one release."""

import sys
import warnings

from gspo_jax import sweep_grid as _moved

warnings.warn(
    "gspo_jax.sweep_points moved to gspo_jax.sweep_grid; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
