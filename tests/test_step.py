"""The pure train step: learning direction, exact micro-batch accumulation,
skipping non-finite updates."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gspo_jax import optim, step

from gspo_jax import passes
from gspo_jax.metrics import compute_all
from gspo_jax.models import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=24, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32,
                  moe_d_ff=16, num_experts=4, top_k=2)
N, P, T = 8, 4, 5

# The old-policy pass as one jitted program per model and setting (called eagerly it
# compiles every primitive on its own); only for speed.
_logprob = jax.jit(passes.logprob_pass, static_argnames=("graphdef", "replay_key", "values", "micro_batches"))


@functools.lru_cache(maxsize=None)
def _step_fn(graphdef, objective, micro, lr, hparams, router_coefs):
    """The jitted SGD train step of one setting, built once and shared by the tests that
    run it (a new jit per call traces and lowers the same program again)."""
    opt = optax.sgd(lr)
    cfg = step.step_config(objective=objective, hparams=hparams, micro_batches=micro, aux_loss_coef=router_coefs[0],
                          z_loss_coef=router_coefs[1])
    fn = jax.jit(functools.partial(step.train_step, graphdef=graphdef, optimizer=opt,
                                   schedule=optax.constant_schedule(lr), cfg=cfg))
    return opt, fn


@pytest.fixture(scope="module")
def setup():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rs = np.random.RandomState(0)
    prompt_mask = np.ones((N, P), np.float32)
    prompt_mask[::2, :2] = 0  # left padding on half the rows
    mask = np.ones((N, T), np.float32)
    mask[1, 3:] = 0
    mask[5, 1:] = 0
    batch = {
        "prompt_tokens": jnp.asarray(rs.randint(3, 24, (N, P)), jnp.int32),
        "prompt_mask": jnp.asarray(prompt_mask),
        "tokens": jnp.asarray(rs.randint(3, 24, (N, T)), jnp.int32),
        "mask": jnp.asarray(mask),
    }
    old = _logprob(params, batch, graphdef=graphdef)
    batch.update(
        old_logp=old["logp"] + jnp.asarray(rs.normal(0, 0.05, (N, T)), jnp.float32),  # slightly off-policy
        old_topk=old["topk_resp"],
        old_free_topk=old["free_topk_resp"],
        old_router_logp=old["router_logp"],
        ref_logp=old["logp"] - 0.1,  # GRPO's default KL term needs it
        advantages=jnp.asarray(rs.normal(size=N), jnp.float32),
    )
    return graphdef, params, batch


def _run(setup, objective, micro, *, lr=1e-3, batch=None, hparams=(), router_coefs=(0.0, 0.0)):
    graphdef, params, base = setup
    batch = base if batch is None else batch
    # Plain SGD: the update is linear in the gradient, so comparing parameters
    # compares gradients (Adam's g/sqrt(v) would amplify rounding where g ~ 0).
    opt, fn = _step_fn(graphdef, objective, micro, lr, tuple(hparams), tuple(router_coefs))
    state = step.TrainState.create(params, opt.init(params))
    state, m = fn(state, batch, jax.random.key(0))
    return state, compute_all(m)


# The objectives and router-loss coefficients of test_micro_batches_equal_whole_mini_batch
# (the load-balancing coefficient 0: that loss is not additive over micro-batches).
# test_non_finite_loss_skips_update runs these objectives at these coefficients too, so
# that one compiled micro=1 step serves them all.
MICRO_OBJECTIVES, MICRO_COEFS = ("grpo", "gspo", "rspo", "cispo"), (0.0, 0.01)


@pytest.mark.parametrize("objective", MICRO_OBJECTIVES)
def test_micro_batches_equal_whole_mini_batch(setup, objective):
    """Splitting into 4 micro-batches gives the same loss, gradient norm, update and
    metrics (a per-micro-batch denominator would change them all). The router z-loss
    is in the identity; the load-balancing loss, a product of two means over a batch's
    tokens, is taken per micro-batch (as everywhere) and is not: its coefficient is 0."""
    s1, m1 = _run(setup, objective, 1, router_coefs=MICRO_COEFS)
    for micro in (4,):
        s2, m2 = _run(setup, objective, micro, router_coefs=MICRO_COEFS)
        np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-5)
        chex.assert_trees_all_close(s1.params, s2.params, rtol=1e-5, atol=1e-7)
        assert set(m1) == set(m2)
        for key in sorted(set(m1) - {"aux_loss"}):
            np.testing.assert_allclose(m2[key], m1[key], rtol=2e-5, atol=1e-7, err_msg=key)


def _on_policy_batch(cfg, n, *, seed, mask):
    """A fresh model of ``cfg`` and n unpadded prompts with responses, their old-policy
    records taken from that model and random advantages."""
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    rs = np.random.RandomState(seed)
    batch = {"prompt_tokens": jnp.asarray(rs.randint(3, 24, (n, P)), jnp.int32), "prompt_mask": jnp.ones((n, P)),
             "tokens": jnp.asarray(rs.randint(3, 24, (n, T)), jnp.int32), "mask": mask}
    old = _logprob(params, batch, graphdef=graphdef)
    batch.update(old_logp=old["logp"], old_topk=old["topk_resp"], old_router_logp=old["router_logp"],
                 old_free_topk=old["free_topk_resp"], advantages=jnp.asarray(rs.normal(size=n), jnp.float32))
    return graphdef, params, batch


def test_dense_model_trains():
    """A model with no MoE layer (num_experts=0): no router, so gamma = 1, nothing
    flips, and every objective's step runs (RSPO is then GMPO)."""
    cfg = ModelConfig(vocab_size=24, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32)
    graphdef, params, batch = _on_policy_batch(cfg, N, seed=1, mask=jnp.ones((N, T)).at[2, 2:].set(0.0))
    assert batch["old_topk"].shape == (N, T, 0, 0)
    for objective in ("gspo", "rspo"):
        state, m = _run((graphdef, params, None), objective, 2, batch=batch, router_coefs=(0.01, 0.001))
        assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0 and int(state.skipped) == 0
        # γ is exactly 1 at every token (the minimum says so exactly); its mean is a
        # quotient of two f32 sums, which an H200 gave as 0.99999994 (one ulp).
        assert float(m["router_shift_mean"]) == pytest.approx(1.0, rel=2**-23)
        assert float(m["router_shift_min"]) == 1.0
        assert float(m["flip_frac"]) == 0.0 and float(m["token_flip_rate"]) == 0.0
        assert m["flip_frac_layer"].shape == (0,) and float(m["router_shift_raw"]) == 0.0


def test_update_raises_log_prob_of_positive_advantage(setup):
    """One sample with A > 0, the rest A < 0: after a few steps its sequence
    log-prob rises and the others fall (a sign error would do the opposite)."""
    graphdef, params, batch = setup
    adv = np.full(N, -1.0 / (N - 1), np.float32)
    adv[0] = 1.0
    b = dict(batch, advantages=jnp.asarray(adv), old_logp=_logprob(params, batch, graphdef=graphdef)["logp"])
    opt, sched = optim.make_optimizer(lr=1e-2, schedule="constant", total_steps=10, warmup_steps=0, end_lr_ratio=1.0,
                                     weight_decay=0.0, b1=0.9, b2=0.99, grad_clip=0.0)
    cfg = step.step_config(objective="gspo", hparams=(("eps_high", 0.2), ("eps_low", 0.2)))
    fn = jax.jit(functools.partial(step.train_step, graphdef=graphdef, optimizer=opt, schedule=sched, cfg=cfg))
    state = step.TrainState.create(params, opt.init(params))
    for _ in range(3):
        state, _ = fn(state, b, jax.random.key(0))
    new = _logprob(state.params, b, graphdef=graphdef)["logp"]
    d = np.sum((np.asarray(new) - np.asarray(b["old_logp"])) * np.asarray(b["mask"]), axis=1)
    assert d[0] > 0.1 and np.all(d[1:] < 0), d


def test_bfloat16_first_moment(setup):
    """optimizer.mu_dtype: Adam's first moment stored in bf16 (the parameters and the second
    moment stay f32); the update is the f32-moment one to bf16's rounding."""
    graphdef, params, batch = setup
    b = dict(batch, old_logp=_logprob(params, batch, graphdef=graphdef)["logp"])
    cfg = step.step_config(objective="grpo", hparams=(("kl_coef", 0.0),))
    out = {}
    for mu in ("float32", "bfloat16"):
        opt, sched = optim.make_optimizer(lr=1e-2, schedule="constant", total_steps=10, warmup_steps=0,
                                         end_lr_ratio=1.0, weight_decay=0.0, b1=0.9, b2=0.99,
                                         grad_clip=1.0, mu_dtype=mu)
        fn = jax.jit(functools.partial(step.train_step, graphdef=graphdef, optimizer=opt, schedule=sched, cfg=cfg))
        state = step.TrainState.create(params, opt.init(params))
        for _ in range(2):
            state, _ = fn(state, b, jax.random.key(0))
        adam = state.opt_state[1][0]
        assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(mu)}
        assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype("float32")}
        out[mu] = state.params
    chex.assert_type(jax.tree.leaves(out), jnp.float32)
    # Two steps of lr 1e-2 move a weight by at most 2e-2; bf16's rounding of m
    # (2^-8 relative) changes that by at most 2e-2 * 2^-8.
    chex.assert_trees_all_close(out["bfloat16"], out["float32"], atol=2e-2 * 2**-8, rtol=0)


def test_non_finite_loss_skips_update(setup):
    graphdef, params, batch = setup
    bad = dict(batch, advantages=batch["advantages"].at[0].set(jnp.nan))
    state, m = _run(setup, "grpo", 1, batch=bad, router_coefs=MICRO_COEFS)  # one program with the good step
    assert not np.isfinite(m["loss"])
    assert int(state.skipped) == 1 and float(m["skipped_update"]) == 1.0 and float(m["update_norm"]) == 0.0
    chex.assert_trees_all_equal(state.params, params)
    # The optimizer moments are untouched too, so the next good step is unaffected.
    s_good, _ = _run(setup, "grpo", 1, router_coefs=MICRO_COEFS)
    assert int(s_good.skipped) == 0


def _flops_per_device(jitted, *args) -> float:
    """XLA's FLOPs of the compiled program (per device under SPMD)."""
    cost = jitted.lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def _four_row_shards():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices")
    return NamedSharding(Mesh(np.asarray(jax.devices()[:4]), ("data",)), PartitionSpec("data"))


@pytest.mark.parametrize("values", [False, True])
def test_logprob_pass_in_pieces_is_the_whole_pass(setup, values):
    """The old-policy pass in 4 strided pieces gives every row its own log-probs,
    entropies, routing record (replayed under R3 as given) and critic values."""
    graphdef, params, batch = setup
    if values:
        graphdef, params = nnx.split(Transformer(dataclasses.replace(CFG, value_head=True), rngs=nnx.Rngs(1)))
    first = _logprob(params, batch, graphdef=graphdef)
    # A replay record unlike the free routing: R3's experts shifted by one.
    b = dict(batch, replay_r3=(first["topk"] + 1) % CFG.num_experts)
    run = functools.partial(passes.logprob_pass, graphdef=graphdef, replay_key="replay_r3", values=values)
    whole = jax.jit(run)(params, b)
    pieces = jax.jit(functools.partial(run, micro_batches=4))(params, b)
    assert set(pieces) == set(whole) and ("values" in whole) == values
    np.testing.assert_array_equal(whole["topk"], b["replay_r3"])
    for key in whole:
        assert pieces[key].shape == whole[key].shape, key
        if whole[key].dtype == jnp.int32:
            np.testing.assert_array_equal(pieces[key], whole[key], err_msg=key)
        else:
            np.testing.assert_allclose(pieces[key], whole[key], rtol=1e-5, atol=1e-6, err_msg=key)
    with pytest.raises(ValueError, match="micro_batches=3 does not divide 8 rows"):
        passes.logprob_pass(params, b, graphdef=graphdef, micro_batches=3)


def test_logprob_pass_in_pieces_keeps_the_work_on_every_batch_device():
    """Strided pieces hold rows of every device: per-device FLOPs of the compiled
    pass are a quarter of one device's, in pieces as whole."""
    rows = _four_row_shards()
    cfg = ModelConfig(vocab_size=24, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32)
    graphdef, params, batch = _on_policy_batch(cfg, 128, seed=3, mask=jnp.ones((128, T)))
    for micro in (1, 4):
        fn = jax.jit(functools.partial(passes.logprob_pass, graphdef=graphdef, micro_batches=micro))
        ratio = _flops_per_device(fn, params, jax.device_put(batch, rows)) / _flops_per_device(fn, params, batch)
        assert ratio == pytest.approx(0.25, rel=0.1), (micro, ratio)


def test_micro_batches_keep_the_work_on_every_batch_device():
    """With the mini-batch sharded over 4 devices, each micro-batch holds rows of
    every device: per-device FLOPs of the compiled step are a quarter of one
    device's (within 10%), with micro-batches as without. (Contiguous micro-batches
    made XLA gather the whole mini-batch to every device, which then computed all of
    it: 1.0x.)"""
    rows = _four_row_shards()
    cfg = ModelConfig(vocab_size=24, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32)
    graphdef, params, batch = _on_policy_batch(cfg, 128, seed=2, mask=jnp.ones((128, T)))
    opt = optax.sgd(1e-3)
    state = step.TrainState.create(params, opt.init(params))

    def flops(micro, b):
        cfg = step.step_config(objective="grpo", hparams=(("kl_coef", 0.0),), micro_batches=micro)
        fn = jax.jit(functools.partial(step.train_step, graphdef=graphdef, optimizer=opt,
                                       schedule=optax.constant_schedule(1e-3), cfg=cfg))
        return _flops_per_device(fn, state, b, jax.random.key(0))

    for micro in (1, 4):
        ratio = flops(micro, jax.device_put(batch, rows)) / flops(micro, batch)
        assert ratio == pytest.approx(0.25, rel=0.1), (micro, ratio)
