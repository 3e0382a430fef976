"""Property tests (hypothesis) of the objectives' identities over random shapes, masks,
advantages and log-ratios. Arrays come from numpy RandomState(seed) with the seed,
shapes and scales drawn by hypothesis; example counts are kept small for CPU CI.

For speed (compile time is most of these tests' time), each objective runs as one
compiled program (loss, metrics and gradient together, `evaluate`), and the drawn
(N, T) arrays are placed in a fixed padded shape `PAD` with mask 0 outside the drawn
extent, so that one program serves every example of a configuration. Masked positions
are provably inert: every objective reads logp, old_logp, advantages and router_shift
only through ``where(mask > 0, ., 0)`` (or on rows with a valid token), counts only
valid tokens and sequences in its denominators, and reads T itself only as the default
``norm_len`` of ``seq-mean-token-sum-norm`` (Dr.GRPO's default, in
`test_finite_everywhere` only: a positive constant factor, which leaves finiteness and
exact zero as they are). The micro-batch
test keeps the drawn shapes (a bug that read the row count of the array would show
there only), compiled as one program per example.
"""

import functools

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

PAD = (4, 8)  # the padded shape: the largest N and T drawn by the padded tests
ARRAY_KWARGS = ("router_shift", "ref_logp", "normalizer", "weight")


def draw_exact(shape, seed, scale, mask_p=0.3):
    """numpy arrays of the drawn shape: logp, old_logp, advantages, mask, gamma."""
    rs = np.random.RandomState(seed)
    n, t = shape
    old = rs.normal(-1.0, 0.5, (n, t)).astype(np.float32)
    delta = rs.normal(0.0, scale, (n, t)).astype(np.float32)
    mask = (rs.rand(n, t) > mask_p).astype(np.float32)
    adv = rs.normal(0.0, 1.0, n).astype(np.float32)
    adv[rs.rand(n) < 0.15] = 0.0
    gamma = rs.uniform(0.3, 1.0, (n, t)).astype(np.float32)
    return old + delta, old, adv, mask, gamma


def draw(shape, seed, scale, mask_p=0.3):
    """`draw_exact`'s arrays (the same values) inside `PAD`: mask 0, logp = old_logp =
    -1, A = 0 and gamma = 1 outside the drawn extent."""
    n, t = shape
    out = []
    for x, fill in zip(draw_exact(shape, seed, scale, mask_p), (-1.0, -1.0, 0.0, 0.0, 1.0)):
        padded = np.full(PAD[: x.ndim], fill, np.float32)
        padded[(slice(0, n), slice(0, t))[: x.ndim]] = x
        out.append(jnp.asarray(padded))
    return tuple(out)


@functools.cache
def _program(name, hp):
    fn = O.get(name)

    def run(lp, old, adv, mask, arrays):
        return jax.value_and_grad(lambda x: fn(x, old, adv, mask, **arrays, **dict(hp)),
                                  has_aux=True)(lp)

    return jax.jit(run)


def evaluate(name, lp, old, adv, mask, **kw):
    """(loss, metrics, d loss / d logp) of objective ``name``: one compiled program per
    objective, hyperparameters and shapes (only for speed)."""
    arrays = {k: v for k, v in kw.items() if k in ARRAY_KWARGS}
    hp = tuple(sorted((k, v) for k, v in kw.items() if k not in ARRAY_KWARGS))
    (loss, metrics), g = _program(name, hp)(lp, old, adv, mask, arrays)
    return loss, metrics, np.asarray(g)


def grad(name, lp, old, adv, mask, **kw):
    return evaluate(name, lp, old, adv, mask, **kw)[2]


@SETTINGS
@given(shapes, seeds, scales, st.sampled_from([(3e-4, 4e-4), (0.05, 0.1)]))
def test_gspo_token_equals_gspo(shape, seed, scale, eps):
    lp, old, adv, mask, _ = draw(shape, seed, scale)
    hp = dict(eps_low=eps[0], eps_high=eps[1])
    adv2 = jnp.broadcast_to(adv[:, None], PAD)
    lg, mg, gg = evaluate("gspo", lp, old, adv, mask, **hp)
    lt, mt, gt = evaluate("gspo_token", lp, old, adv2, mask, **hp)
    np.testing.assert_allclose(lt, lg, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mt["clip_frac_high"], mg["clip_frac_high"], atol=1e-7)
    np.testing.assert_allclose(mt["clip_frac_low"], mg["clip_frac_low"], atol=1e-7)
    np.testing.assert_allclose(mt["clip_frac"], mg["clip_frac"], atol=1e-7)
    np.testing.assert_allclose(gt, gg, rtol=1e-5, atol=1e-8)


@SETTINGS
@given(shapes, seeds, scales)
def test_ppo_clip_zeroes_exactly_the_clipped_tokens(shape, seed, scale):
    lp, old, adv, mask, _ = draw(shape, seed, scale)
    r = np.exp(np.float64(lp) - np.float64(old))
    a = np.asarray(adv)[:, None]
    # Stay off the bounds themselves, where f32 rounding decides (padding has r = 1).
    assume(np.all((np.abs(r - 1.2) > 1e-4) & (np.abs(r - 0.8) > 1e-4)))
    clipped = ((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8))
    m = np.asarray(mask)
    _, metrics, g = evaluate("ppo", lp, old, adv, mask)
    expected = np.where(clipped, 0.0, -a * r * m) / max(m.sum(), 1.0)
    np.testing.assert_allclose(g, expected, rtol=2e-5, atol=1e-9)
    assert (g[clipped | (m == 0)] == 0).all()
    # clip_frac: the share of valid tokens whose gradient the clip removes.
    np.testing.assert_allclose(metrics["clip_frac"], (clipped & (m > 0)).sum() / max(m.sum(), 1.0),
                               atol=1e-7)


@SETTINGS
@given(shapes, seeds, scales)
def test_rspo_is_gmpo_scaled_by_geometric_mean_of_gamma(shape, seed, scale):
    lp, old, adv, mask, gamma = draw(shape, seed, scale)
    ones = jnp.ones(PAD)
    gg = grad("gmpo", lp, old, adv, mask)
    np.testing.assert_allclose(evaluate("rspo", lp, old, adv, mask, router_shift=ones)[0],
                               evaluate("gmpo", lp, old, adv, mask)[0], rtol=1e-6, atol=1e-8)
    m = np.asarray(mask)

    def geo(g):
        return np.exp((m * np.log(g)).sum(-1) / np.maximum(m.sum(-1), 1))[:, None]

    # gamma_min 0.3, the draw's lower end: the floor binds nowhere.
    gr = grad("rspo", lp, old, adv, mask, router_shift=gamma, gamma_min=0.3)
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
    lg = evaluate("gmpo", lp, old, adv, mask, eps_low=100.0, eps_high=100.0)[0]
    lr = evaluate("grpo", lp, old, adv, mask, eps_low=0.999, eps_high=1e9, kl_coef=0.0)[0]
    assert abs(float(lg)) <= abs(float(lr)) * (1 + 1e-5) + 1e-7


@SETTINGS
@given(st.tuples(st.integers(2, 6), st.integers(1, 6)), seeds, scales,
       st.sampled_from(O.names()), st.sampled_from(O.AGG_MODES), st.integers(1, 5))
def test_micro_batch_sum_equals_whole(shape, seed, scale, name, agg, cut):
    lp, old, adv, mask, gamma = (jnp.asarray(x) for x in draw_exact(shape, seed, scale))
    cut = min(cut, shape[0] - 1)
    obj = O.get(name)
    hp = {"agg": agg} if "agg" in obj.defaults else {}
    if name == "grpo":
        hp["kl_coef"] = 0.0

    def f(x, old, adv, mask, gamma, sl, norm=None):
        kw = {"router_shift": gamma[sl]} if name == "rspo" else {}
        return obj(x, old[sl], adv[sl], mask[sl], normalizer=norm, **kw, **hp)[0]

    @jax.jit  # the whole example as one program (only for speed)
    def sums(lp, old, adv, mask, gamma):
        norm = O.normalizer(mask)
        a, b = slice(0, cut), slice(cut, None)

        def whole(x):
            return f(x, old, adv, mask, gamma, slice(None))

        def split(x):
            return f(x[a], old, adv, mask, gamma, a, norm) + f(x[b], old, adv, mask, gamma, b, norm)

        return split(lp), whole(lp), jax.grad(split)(lp), jax.grad(whole)(lp)

    split, whole, g_split, g_whole = sums(lp, old, adv, mask, gamma)
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_split, g_whole, rtol=1e-5, atol=1e-8)


@SETTINGS
@given(shapes, seeds, st.sampled_from([20.0, 50.0, 300.0]), st.sampled_from(O.names()))
def test_finite_everywhere(shape, seed, big, name):
    lp, old, adv, mask, gamma = draw(shape, seed, big)
    kw = {"router_shift": gamma} if name == "rspo" else {}
    if name == "grpo":
        kw["kl_coef"] = 0.0
    loss, metrics, g = evaluate(name, lp, old, adv, mask, **kw)
    assert np.isfinite(float(loss)) and np.isfinite(g).all()
    assert all(np.isfinite(float(v)) for v in metrics.values())
    zero = evaluate(name, lp, old, adv, jnp.zeros(PAD), **kw)[0]
    assert float(zero) == 0.0
