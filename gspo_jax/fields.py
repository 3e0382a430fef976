"""Moved to `gspo_jax.config_fields` (the config's declaration toolkit: setting, section, checks, docs table); this path works for one release."""

import sys
import warnings

from gspo_jax import config_fields as _moved

warnings.warn(
    "gspo_jax.fields moved to gspo_jax.config_fields; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
