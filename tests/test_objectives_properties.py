"""Property tests (hypothesis) of the objectives' identities over random shapes, masks,
advantages and log-ratios. Arrays come from numpy RandomState(seed) with the seed,
shapes and scales drawn by hypothesis; example counts are kept small for CPU CI."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, assume
from hypothesis import strategies as st

from gspo_jax import objectives as O

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)

shapes = st.tuples(st.integers(1, 4), st.integers(1, 6))
seeds = st.integers(0, 2**31 - 1)
scales = st.sampled_from([0.01, 0.1, 0.5, 2.0])


def draw(shape, seed, scale, mask_p=0.3):
    rs = np.random.RandomState(seed)
    n, t = shape
    old = rs.normal(-1.0, 0.5, (n, t)).astype(np.float32)
    delta = rs.normal(0.0, scale, (n, t)).astype(np.float32)
    mask = (rs.rand(n, t) > mask_p).astype(np.float32)
    adv = rs.normal(0.0, 1.0, n).astype(np.float32)
    adv[rs.rand(n) < 0.15] = 0.0
    gamma = rs.uniform(0.3, 1.0, (n, t)).astype(np.float32)
    return (jnp.asarray(old + delta), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
            jnp.asarray(gamma))


def grad(name, lp, old, adv, mask, **kw):
    return np.asarray(jax.grad(lambda x: O.get(name)(x, old, adv, mask, **kw)[0])(lp))


@SETTINGS
@given(shapes, seeds, scales, st.sampled_from([(3e-4, 4e-4), (0.05, 0.1)]))
def test_gspo_token_equals_gspo(shape, seed, scale, eps):
    lp, old, adv, mask, _ = draw(shape, seed, scale)
    hp = dict(eps_low=eps[0], eps_high=eps[1])
    adv2 = jnp.broadcast_to(adv[:, None], shape)
    lg, mg = O.get("gspo")(lp, old, adv, mask, **hp)
    lt, mt = O.get("gspo_token")(lp, old, adv2, mask, **hp)
    np.testing.assert_allclose(lt, lg, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mt["clip_frac_high"], mg["clip_frac_high"], atol=1e-7)
    np.testing.assert_allclose(mt["clip_frac_low"], mg["clip_frac_low"], atol=1e-7)
    np.testing.assert_allclose(mt["clip_frac"], mg["clip_frac"], atol=1e-7)
    np.testing.assert_allclose(grad("gspo_token", lp, old, adv2, mask, **hp),
                               grad("gspo", lp, old, adv, mask, **hp), rtol=1e-5, atol=1e-8)


@SETTINGS
@given(shapes, seeds, scales)
def test_ppo_clip_zeroes_exactly_the_clipped_tokens(shape, seed, scale):
    lp, old, adv, mask, _ = draw(shape, seed, scale)
    r = np.exp(np.float64(lp) - np.float64(old))
    a = np.asarray(adv)[:, None]
    # Stay off the bounds themselves, where f32 rounding decides.
    assume(np.all((np.abs(r - 1.2) > 1e-4) & (np.abs(r - 0.8) > 1e-4)))
    clipped = ((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8))
    m = np.asarray(mask)
    g = grad("ppo", lp, old, adv, mask)
    expected = np.where(clipped, 0.0, -a * r * m) / max(m.sum(), 1.0)
    np.testing.assert_allclose(g, expected, rtol=2e-5, atol=1e-9)
    assert (g[clipped | (m == 0)] == 0).all()
    # clip_frac: the share of valid tokens whose gradient the clip removes.
    clip_frac = O.get("ppo")(lp, old, adv, mask)[1]["clip_frac"]
    np.testing.assert_allclose(clip_frac, (clipped & (m > 0)).sum() / max(m.sum(), 1.0), atol=1e-7)


@SETTINGS
@given(shapes, seeds, scales)
def test_rspo_is_gmpo_scaled_by_geometric_mean_of_gamma(shape, seed, scale):
    lp, old, adv, mask, gamma = draw(shape, seed, scale)
    ones = jnp.ones(shape)
    np.testing.assert_allclose(O.get("rspo")(lp, old, adv, mask, router_shift=ones)[0],
                               O.get("gmpo")(lp, old, adv, mask)[0], rtol=1e-6, atol=1e-8)
    m = np.asarray(mask)

    def geo(g):
        return np.exp((m * np.log(g)).sum(-1) / np.maximum(m.sum(-1), 1))[:, None]

    # gamma_min 0.3, the draw's lower end: the floor binds nowhere.
    gr = grad("rspo", lp, old, adv, mask, router_shift=gamma, gamma_min=0.3)
    gg = grad("gmpo", lp, old, adv, mask)
    np.testing.assert_allclose(gr, gg * geo(np.asarray(gamma)), rtol=1e-5, atol=1e-9)
    assert np.all(np.abs(gr) <= np.abs(gg) + 1e-9)  # gamma <= 1 never amplifies
    # The default floor, 0.5: the geometric mean of max(0.5, gamma).
    gr = grad("rspo", lp, old, adv, mask, router_shift=gamma)
    np.testing.assert_allclose(gr, gg * geo(np.maximum(0.5, np.asarray(gamma))), rtol=1e-5, atol=1e-9)


@SETTINGS
@given(st.integers(1, 8), seeds, scales)
def test_gmpo_magnitude_below_grpo_per_sequence(t, seed, scale):
    lp, old, adv, mask, _ = draw((1, t), seed, scale, mask_p=0.0)
    assume(np.all(np.abs(np.asarray(lp - old)) < 4.0))  # inside the wide GRPO bounds below
    lg = O.get("gmpo")(lp, old, adv, mask, eps_low=100.0, eps_high=100.0)[0]
    lr = O.get("grpo")(lp, old, adv, mask, eps_low=0.999, eps_high=1e9, kl_coef=0.0)[0]
    assert abs(float(lg)) <= abs(float(lr)) * (1 + 1e-5) + 1e-7


@SETTINGS
@given(st.tuples(st.integers(2, 6), st.integers(1, 6)), seeds, scales,
       st.sampled_from(O.names()), st.sampled_from(O.AGG_MODES), st.integers(1, 5))
def test_micro_batch_sum_equals_whole(shape, seed, scale, name, agg, cut):
    lp, old, adv, mask, gamma = draw(shape, seed, scale)
    cut = min(cut, shape[0] - 1)
    obj = O.get(name)
    hp = {"agg": agg} if "agg" in obj.defaults else {}
    if name == "grpo":
        hp["kl_coef"] = 0.0

    def f(x, sl, norm=None):
        kw = {"router_shift": gamma[sl]} if name == "rspo" else {}
        return obj(x, old[sl], adv[sl], mask[sl], normalizer=norm, **kw, **hp)[0]

    norm = O.normalizer(mask)
    a, b = slice(0, cut), slice(cut, None)
    whole = f(lp, slice(None))
    np.testing.assert_allclose(f(lp[a], a, norm) + f(lp[b], b, norm), whole,
                               rtol=1e-5, atol=1e-7)
    g_split = jax.grad(lambda x: f(x[a], a, norm) + f(x[b], b, norm))(lp)
    np.testing.assert_allclose(g_split, jax.grad(lambda x: f(x, slice(None)))(lp),
                               rtol=1e-5, atol=1e-8)


@SETTINGS
@given(shapes, seeds, st.sampled_from([20.0, 50.0, 300.0]), st.sampled_from(O.names()))
def test_finite_everywhere(shape, seed, big, name):
    lp, old, adv, mask, gamma = draw(shape, seed, big)
    kw = {"router_shift": gamma} if name == "rspo" else {}
    if name == "grpo":
        kw["kl_coef"] = 0.0
    loss, metrics = O.get(name)(lp, old, adv, mask, **kw)
    g = grad(name, lp, old, adv, mask, **kw)
    assert np.isfinite(float(loss)) and np.isfinite(g).all()
    assert all(np.isfinite(float(v)) for v in metrics.values())
    zero = O.get(name)(lp, old, adv, jnp.zeros(shape), **kw)[0]
    assert float(zero) == 0.0
