"""Test session settings.

* Rank promotion raises, so silently broadcasting f32[N] against f32[N,T]
  fails loudly.
* 8 fake CPU devices, for the sharding tests; must be set before JAX starts.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
