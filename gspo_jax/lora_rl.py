"""Moved to `gspo_jax.lora_training` (LoRA in a run: what each phase trains, the frozen base, pi_ref with the adapters off); this path works for one release."""

import sys
import warnings

from gspo_jax import lora_training as _moved

warnings.warn(
    "gspo_jax.lora_rl moved to gspo_jax.lora_training; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
