"""gspo_jax.metrics: each kind merges exactly (hand values), over a pair and over a
stacked leading axis, inside jit and scan."""

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.metrics import Max, Mean, Min, Std, Sum, compute_all, reduce_all


def test_mean_masked_and_merge():
    a = Mean.masked(jnp.array([1.0, 2.0, 9.0]), jnp.array([1, 1, 0]))  # 3 / 2
    b = Mean.masked(jnp.array([4.0]), jnp.array([1]))  # 4 / 1
    np.testing.assert_allclose(a.compute(), 1.5)
    np.testing.assert_allclose(a.merge(b).compute(), 7.0 / 3.0, rtol=1e-6)


def test_mean_of_weights_and_empty():
    # Two micro-batch token means (0.25 over 1 token, 0.5 over 3): 1.75 / 4.
    m = Mean.of(0.25, weight=1.0).merge(Mean.of(0.5, weight=3.0))
    np.testing.assert_allclose(m.compute(), 1.75 / 4)
    assert float(Mean.masked(jnp.array([jnp.nan]), jnp.array([0])).compute()) == 0.0
    assert float(Mean.of(5.0, weight=0.0).compute()) == 0.0


def test_vector_mean_over_scalar_count():
    layers = Mean.of(jnp.array([0.1, 0.2]), weight=1.0).merge(Mean.of(jnp.array([0.3, 0.0]), weight=3.0))
    np.testing.assert_allclose(layers.compute(), [0.25, 0.05], rtol=1e-6)


def test_extrema_and_empty_values():
    x, mask = jnp.array([3.0, -1.0, 7.0]), jnp.array([1, 1, 0])
    assert float(Max.masked(x, mask).compute()) == 3.0
    assert float(Min.masked(x, mask).compute()) == -1.0
    assert float(Max.masked(x, jnp.zeros(3), empty=0.5).compute()) == 0.5
    assert float(Min.masked(x, jnp.zeros(3), empty=1.0).compute()) == 1.0
    assert float(Max.of(2.0).merge(Max.of(5.0)).compute()) == 5.0
    assert float(Min.of(2.0).merge(Min.of(5.0)).compute()) == 2.0
    assert float(Sum.of(2.0).merge(Sum.of(5.0)).compute()) == 7.0


def test_std_pools_exactly():
    rs = np.random.RandomState(0)
    x = rs.normal(size=10)
    mask = np.array([1, 1, 1, 0, 1, 1, 0, 1, 1, 1])
    whole = Std.masked(x, mask)
    parts = Std.masked(x[:4], mask[:4]).merge(Std.masked(x[4:], mask[4:]))
    np.testing.assert_allclose(whole.compute(), x[mask > 0].std(), rtol=1e-5)
    np.testing.assert_allclose(parts.compute(), x[mask > 0].std(), rtol=1e-5)


def test_reduce_over_a_scan_equals_merge():
    xs = jnp.arange(12.0).reshape(3, 4)
    masks = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])

    def body(carry, inp):
        x, m = inp
        return carry, {"mean": Mean.masked(x, m), "max": Max.masked(x, m), "min": Min.masked(x, m, 99.0),
                       "n": Sum.of(jnp.sum(m)), "std": Std.masked(x, m)}

    _, stacked = jax.jit(lambda a, b: jax.lax.scan(body, 0, (a, b)))(xs, masks)
    out = compute_all(reduce_all(stacked))
    valid = np.asarray(xs)[np.asarray(masks) > 0]
    np.testing.assert_allclose(out["mean"], valid.mean(), rtol=1e-6)
    np.testing.assert_allclose(out["max"], valid.max())
    np.testing.assert_allclose(out["min"], valid.min())
    np.testing.assert_allclose(out["n"], valid.size)
    np.testing.assert_allclose(out["std"], valid.std(), rtol=1e-5)
