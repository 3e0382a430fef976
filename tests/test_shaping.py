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


def test_shape_and_filter_stays_on_the_host():
    """DAPO's length penalty and group filter act on the verifier's host results: a
    round's shaping sends nothing to the devices (the transfer guard would raise)."""
    import jax

    from gspo_jax import collect
    from gspo_jax import config as config_lib

    c = config_lib.base_config()
    c.dapo.soft_overlong, c.dapo.dynamic_sampling, c.dapo.overlong_cache_len = True, True, 4
    c.rollout.group_size, c.rollout.max_new_tokens = 2, 10
    cfg = config_lib.load(c, 1)
    host = {"lengths": np.array([3, 8, 10, 11], np.int32)}
    r = np.array([1.0, 1.0, 0.0, 1.0], np.float32)
    correct = np.array([1.0, 1.0, 0.0, 1.0], np.float32)
    with jax.transfer_guard("disallow"):
        shaped, rows, kept = collect.shape_and_filter(cfg, host, r, correct)
    np.testing.assert_allclose(shaped, [1.0, 0.5, -1.0, 0.0], rtol=1e-6)
    assert shaped.dtype == np.float32 and rows.tolist() == [2, 3] and kept == 1
