"""Tests of gspo_jax.shaping (DAPO's data side)."""

import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import shaping


def test_soft_overlong_penalty_hand_values():
    # L_max = 10, L_cache = 4: free up to 6, linear ramp to -1 at 10, -1 beyond.
    lengths = jnp.array([3, 6, 7, 8, 10, 11, 50])
    p = shaping.soft_overlong_penalty(lengths, max_len=10, cache_len=4)
    np.testing.assert_allclose(p, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0], rtol=1e-6)


def test_soft_overlong_penalty_validation():
    with pytest.raises(ValueError, match="cache_len"):
        shaping.soft_overlong_penalty(jnp.array([1]), max_len=4, cache_len=5)
    with pytest.raises(ValueError, match="max_len"):
        shaping.soft_overlong_penalty(jnp.array([1]), max_len=0, cache_len=1)
    with pytest.raises(ValueError, match="lengths"):
        shaping.soft_overlong_penalty(jnp.ones((2, 2)), max_len=4, cache_len=2)


def test_overlong_mask():
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = shaping.overlong_mask(jnp.array([False, True, False]), mask)
    np.testing.assert_array_equal(out, [[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert out.dtype == mask.dtype
    with pytest.raises(ValueError, match="truncated"):
        shaping.overlong_mask(jnp.array([True]), mask)


def test_dynamic_sampling_keep():
    r = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5],
                   [0.2, 0.3, 0.2]])
    np.testing.assert_array_equal(shaping.dynamic_sampling_keep(r),
                                  [False, True, False, False, True])
    with pytest.raises(ValueError, match="rewards"):
        shaping.dynamic_sampling_keep(jnp.zeros(3))
