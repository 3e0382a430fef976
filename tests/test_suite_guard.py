"""The suite's guard against Linux's limit on memory mappings (tests/conftest.py): the
count it reads is the process's, and past the share it releases the programs that jit
keeps, so that a test process cannot run out of mappings (experiments/test_time.md)."""

import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import _mappings_and_limit, drop_caches_near_the_mapping_limit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _program():
    """A jitted function of its own (jit shares its cache between wrappers of one function)."""

    def f(x):
        return jnp.sin(x) * 3.0 + 1.0

    return jax.jit(f)


def test_the_count_is_this_processes():
    count, limit = _mappings_and_limit()
    with open("/proc/self/maps") as f:
        assert abs(sum(1 for _ in f) - count) < 50
    assert 0 < count < limit


def test_past_the_share_the_programs_are_released_and_below_it_kept():
    f = _program()
    f(jnp.ones(5)).block_until_ready()
    assert not drop_caches_near_the_mapping_limit(share=1.0)  # below the whole limit
    assert f._cache_size() == 1
    assert drop_caches_near_the_mapping_limit(share=0.0)  # past a share of nothing
    assert f._cache_size() == 0
    assert float(f(jnp.ones(5))[0]) == pytest.approx(3 * float(jnp.sin(1.0)) + 1)
