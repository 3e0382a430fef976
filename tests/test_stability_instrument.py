"""The stability instrument: updates with no signal, free-router flips under replay,
the raw router shift, the train-inference mismatch, the reference pass, the
temperature of the training log-probs, the skip limit and per-update records."""

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gspo_jax import config as config_lib
from gspo_jax import metrics as metrics_lib
from gspo_jax import optim, routing, step
from gspo_jax import passes
from gspo_jax.metrics import compute_all
from gspo_jax.metrics_log import MetricsWriter, read_metrics
from gspo_jax.models import ModelConfig, Transformer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from configs import default as default_config  # noqa: E402

CFG = ModelConfig(vocab_size=24, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32,
                  moe_d_ff=16, num_experts=4, top_k=2)
N, P, T = 8, 4, 5


@pytest.fixture(scope="module")
def setup():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rs = np.random.RandomState(0)
    mask = np.ones((N, T), np.float32)
    mask[1, 3:] = 0
    batch = {
        "prompt_tokens": jnp.asarray(rs.randint(3, 24, (N, P)), jnp.int32),
        "prompt_mask": jnp.ones((N, P), jnp.float32),
        "tokens": jnp.asarray(rs.randint(3, 24, (N, T)), jnp.int32),
        "mask": jnp.asarray(mask),
    }
    old = passes.logprob_pass(params, batch, graphdef=graphdef)
    batch.update(old_logp=old["logp"], old_topk=old["topk_resp"], old_free_topk=old["free_topk_resp"],
                 old_router_logp=old["router_logp"], advantages=jnp.asarray(rs.normal(size=N), jnp.float32))
    return graphdef, params, batch, old


def _move_router(params, scale, seed=1):
    """The parameters with Gaussian noise of std ``scale`` on every router matrix."""
    flat = nnx.to_flat_state(params)
    key = jax.random.key(seed)
    out = []
    for i, (path, var) in enumerate(flat):
        if "router" in path:
            var = var.replace(var[...] + scale * jax.random.normal(jax.random.fold_in(key, i), var[...].shape))
        out.append((path, var))
    return nnx.from_flat_state(out)


# One optimizer (a linear decay: the rate after a skipped update is not the first) and
# one compiled train step per step config, shared by the tests of the skipped update:
# `test_logged_learning_rate_is_the_one_applied` runs the program of GSPO without signal.
OPT = dict(lr=1e-2, schedule="linear", total_steps=10, warmup_steps=0, end_lr_ratio=0.1, weight_decay=0.0,
           b1=0.9, b2=0.99, grad_clip=1.0)


@functools.lru_cache(maxsize=None)
def _train_fn(graphdef, **cfg_kw):
    """(jitted train_step, optimizer, schedule) of `OPT` and ``step.step_config(**cfg_kw)``."""
    opt, sched = optim.make_optimizer(**OPT)
    cfg = step.step_config(**cfg_kw)
    return jax.jit(functools.partial(step.train_step, graphdef=graphdef, optimizer=opt, schedule=sched,
                                     cfg=cfg)), opt, sched


def _metrics(graphdef, params, batch, **cfg_kw):
    cfg = step.step_config(**{"objective": "gspo", **cfg_kw})
    loss_fn = functools.partial(step.policy_loss, graphdef=graphdef, cfg=cfg, norm=step.objectives.normalizer(
        batch["mask"]), num_router_tokens=step.router_tokens(batch))
    _, m = jax.jit(loss_fn)(params, batch)
    return metrics_lib.compute_all(m)


# --------------------------------------------------------------------------
# Updates with no RL signal.


@pytest.mark.parametrize("objective", ["grpo", "gspo", "rspo"])
def test_uniform_groups_move_no_parameter_by_default(setup, objective):
    """Every advantage zero (uniform groups): with router losses and GRPO's KL on,
    nothing but those terms would drive the update, and by default there is none:
    parameters and Adam's moments stay bit-for-bit, the optimizer's count with them.
    With ``update_without_signal`` the same mini-batch does move them."""
    graphdef, params, batch, old = setup
    b = dict(batch, advantages=jnp.zeros((N,), jnp.float32), ref_logp=old["logp"] - 0.1)
    hp = (("kl_coef", 0.04),) if objective == "grpo" else ()
    for without_signal in (False, True):
        fn, opt, _ = _train_fn(graphdef, objective=objective, hparams=hp, aux_loss_coef=0.01, z_loss_coef=0.001,
                               update_without_signal=without_signal)
        state0 = step.TrainState.create(params, opt.init(params))
        state, m = fn(state0, b, jax.random.key(0))
        m = compute_all(m)
        assert float(m["no_signal"]) == 1.0 and float(m["grad_norm"]) > 0  # there was a gradient
        same = [np.array_equal(x, y) for x, y in zip(jax.tree.leaves((state.params, state.opt_state)),
                                                     jax.tree.leaves((params, opt.init(params))))]
        if without_signal:
            assert not all(same) and int(state.applied) == 1
        else:
            assert all(same) and int(state.applied) == 0 and float(m["update_norm"]) == 0.0
            assert int(state.skipped) == 0 and int(state.skipped_in_a_row) == 0


def test_has_signal():
    mask = jnp.asarray([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert not bool(step.has_signal(jnp.zeros(2), mask))
    assert not bool(step.has_signal(jnp.asarray([0.0, 3.0]), mask))  # only on the empty row
    assert bool(step.has_signal(jnp.asarray([-0.5, 0.0]), mask))
    assert not bool(step.has_signal(jnp.zeros((2, 3)).at[0, 2].set(1.0), mask))  # only on padding
    assert bool(step.has_signal(jnp.zeros((2, 3)).at[0, 1].set(1.0), mask))


def test_logged_learning_rate_is_the_one_applied(setup):
    """A skipped update does not advance the optimizer's schedule, and ``lr`` is the
    schedule at the optimizer's own count: after a skip, the next update logs (and
    applies) the rate the skipped one would have."""
    graphdef, params, batch, _ = setup
    # test_uniform_groups_move_no_parameter_by_default[gspo]'s program (its router losses
    # included): compiled once for both.
    fn, opt, sched = _train_fn(graphdef, objective="gspo", hparams=(), aux_loss_coef=0.01, z_loss_coef=0.001,
                               update_without_signal=False)
    assert float(sched(0)) > float(sched(1)) > float(sched(2))  # a skip that advanced it would show
    state = step.TrainState.create(params, opt.init(params))
    state, m0 = fn(state, batch, jax.random.key(0))
    bad = dict(batch, advantages=batch["advantages"].at[0].set(jnp.nan))
    state, m1 = fn(state, bad, jax.random.key(0))
    state, m2 = fn(state, batch, jax.random.key(0))
    m0, m1, m2 = (compute_all(m) for m in (m0, m1, m2))
    assert float(m1["skipped_update"]) == 1.0 and int(state.skipped) == 1 and int(state.applied) == 2
    assert float(m0["lr"]) == pytest.approx(float(sched(0)))
    assert float(m1["lr"]) == pytest.approx(float(sched(1))) == pytest.approx(float(m2["lr"]))
    assert int(state.step) == 3 and int(state.skipped_in_a_row) == 0
    counted = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    counts = [int(x.count) for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, counted))
              if isinstance(x, counted)]
    assert counts and set(counts) == {2}  # Adam's and the schedule's counts


# --------------------------------------------------------------------------
# Routing diagnostics that mean the same in every arm.


def test_free_router_flips_are_the_same_under_every_replay_mode(setup):
    """Once the router has moved, the free-router flip fraction is non-zero and equal
    under no replay, R2 (pi_old's routing) and R3 (a sampler record that differs from
    both), at the same parameters; it equals the flips of the current free top-K
    against pi_old's computed by hand. The flips of the *used* experts would be 0
    under R2 by construction."""
    graphdef, params, batch, old = setup
    moved = _move_router(params, 0.5)
    model = nnx.merge(graphdef, moved)
    inputs, targets, positions, attn = passes.sequence_inputs(batch)
    *_, aux = model.token_logprobs(inputs, targets, positions=positions, attn_mask=attn)
    free_now = passes.response_slice(aux.free_topk_indices, P, T)
    expected = np.asarray(routing.expert_flip_fraction(old["free_topk_resp"], free_now, batch["mask"]))
    assert expected.mean() > 0.05

    rs = np.random.RandomState(3)
    r3 = np.stack([rs.permutation(CFG.num_experts)[:CFG.top_k] for _ in range(N * (P + T - 1) * 2)])
    r3 = jnp.asarray(r3.reshape(N, P + T - 1, 2, CFG.top_k), jnp.int32)
    sampler_topk = passes.response_slice(r3, P, T)
    results = {}
    for name, replay in (("none", None), ("R2", old["topk"]), ("R3", r3)):
        b = dict(batch, sampler_topk=sampler_topk)
        if replay is not None:
            b["replay"] = replay
        results[name] = _metrics(graphdef, moved, b)
    for name, m in results.items():
        np.testing.assert_allclose(m["flip_frac_layer"], expected, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(m["flip_frac"], expected.mean(), rtol=1e-6, err_msg=name)
        for key in ("token_flip_rate", "flip_frac_vs_sampler"):
            np.testing.assert_allclose(m[key], results["none"][key], rtol=1e-6, err_msg=f"{name} {key}")
    assert float(results["R3"]["flip_frac_vs_sampler"]) > 0.2
    used = routing.expert_flip_fraction(old["topk_resp"], passes.response_slice(
        nnx.merge(graphdef, moved).token_logprobs(inputs, targets, positions=positions, attn_mask=attn,
                                                  replay=old["topk"])[2].topk_indices, P, T), batch["mask"])
    assert float(jnp.max(used)) == 0.0  # what the old diagnostic reported under R2


def test_raw_router_shift_below_the_floor_is_reported_as_is(setup):
    """A router moved far: RSPO's gamma sits on its floor (gamma_min 0.9) while the raw
    gamma and the raw shift, computed here by hand in NumPy, are reported below it."""
    graphdef, params, batch, old = setup
    moved = _move_router(params, 2.0)
    m = _metrics(graphdef, moved, batch, objective="rspo", hparams=(("gamma_min", 0.9),))
    model = nnx.merge(graphdef, moved)
    inputs, targets, positions, attn = passes.sequence_inputs(batch)
    *_, aux = model.token_logprobs(inputs, targets, positions=positions, attn_mask=attn)
    logits = np.asarray(passes.response_slice(aux.router_logits, P, T), np.float64)  # [N,T,L,E]
    logp_new = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    at_old = np.take_along_axis(logp_new, np.asarray(old["topk_resp"]), axis=-1)
    shift = np.abs(at_old - np.asarray(old["router_logp"], np.float64)).mean(-1)  # [N,T,L]
    gamma = np.exp(-shift.mean(-1))
    mask = np.asarray(batch["mask"]) > 0
    assert gamma[mask].min() < 0.9
    np.testing.assert_allclose(m["gamma_raw_min"], gamma[mask].min(), rtol=1e-5)
    np.testing.assert_allclose(m["gamma_raw_mean"], gamma[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["router_shift_raw"], shift[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["router_shift_raw_layer"], shift[mask].mean(0), rtol=1e-5)
    assert float(m["router_shift_min"]) == pytest.approx(0.9)
    np.testing.assert_allclose(m["router_shift_mean"], np.maximum(gamma, 0.9)[mask].mean(), rtol=1e-5)
    # The diagnostic is the gamma RSPO's loss uses: its own metrics agree.
    assert float(m["gamma_min"]) == float(m["router_shift_min"])
    np.testing.assert_allclose(m["gamma_mean"], m["router_shift_mean"], rtol=1e-6)
    # Under any other objective the diagnostic floors at RSPO's default, 0.5.
    m = _metrics(graphdef, moved, batch)
    np.testing.assert_allclose(m["router_shift_mean"], np.maximum(gamma, 0.5)[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["router_shift_min"], max(gamma[mask].min(), 0.5), rtol=1e-6)


def test_mismatch_metrics_hand_values():
    sampler = jnp.log(jnp.asarray([[0.5, 0.2, 0.1], [0.3, 0.3, 0.3]]))
    old = jnp.log(jnp.asarray([[0.5, 0.5, 0.9], [0.1, 0.3, 0.3]]))
    mask = jnp.asarray([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    r = np.array([1.0, 2.5, 1 / 3, 1.0, 1.0])  # valid tokens only
    m = passes.mismatch_metrics(sampler, old, mask)
    np.testing.assert_allclose(m["mismatch_kl"], np.mean(r - 1 - np.log(r)), rtol=1e-5)
    np.testing.assert_allclose(m["mismatch_f2"], 2 / 5)
    np.testing.assert_allclose(m["mismatch_logp_abs"], np.mean(np.abs(np.log(r))), rtol=1e-5)
    s_topk = jnp.asarray([[[[0, 1]], [[2, 3]], [[0, 1]]], [[[0, 1]], [[0, 1]], [[0, 1]]]], jnp.int32)
    o_topk = jnp.asarray([[[[1, 0]], [[2, 0]], [[3, 2]]], [[[0, 1]], [[0, 1]], [[0, 2]]]], jnp.int32)
    m = passes.mismatch_metrics(sampler, old, mask, s_topk, o_topk)
    np.testing.assert_allclose(m["mismatch_route_layer"], [(0 + 0.5 + 0 + 0 + 0.5) / 5])
    np.testing.assert_allclose(m["mismatch_route_token"], 2 / 5)


# --------------------------------------------------------------------------
# The trainer: reference pass, temperature, router noise, rollout correction,
# dynamic sampling on correctness, the skip limit, per-update records.


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _config(data_dir, **overrides):
    c = default_config.get_config("objective=grpo,smoke")
    c.task.data_dir = data_dir
    c.sft.steps = 0
    c.rollout.prompts_per_step = 8  # 32 rows: mini-batches of 16 over 8 fake devices
    c.update_from_flattened_dict(overrides)  # a misspelt key fails the RunParts's validation
    return c


def _prepared(c, workdir):
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    trainer = RunParts(c, str(workdir))
    rl = RLPhase(trainer, trainer.init_params)
    queued = rl.collect_batch(0, version=0)
    batch, info = rl.prepare(queued, 0)
    host = jax.device_get(queued.device)
    return trainer, rl, host, batch, jax.device_get(info)


def test_reference_pass_routes_freely_under_r3(data_dir, tmp_path):
    """Under R3 the old-policy pass replays the sampler's routing, but pi_ref's pass
    routes freely: with router noise in the sampler, the two routings differ, and
    ref_logp equals a free-routing pass, not a replayed one."""
    c = _config(data_dir, **{"updates.routing_replay": "R3", "rollout.router_noise_std": 1.0})
    trainer, rl, host, batch, info = _prepared(c, tmp_path)
    dev = trainer.put_batch(host)
    free = passes.logprob_pass(rl.ref_params, dev, graphdef=trainer.graphdef)["logp"]
    replayed = passes.logprob_pass(rl.ref_params, dev, graphdef=trainer.graphdef, replay_key="replay_r3")["logp"]
    m = np.asarray(host["mask"]) > 0
    np.testing.assert_allclose(np.asarray(batch["ref_logp"])[m], np.asarray(free)[m], rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(np.asarray(replayed) - np.asarray(free))[m]) > 1e-3
    assert info["mismatch_route"] > 0.1  # the noise made the sampler route differently


@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_router_noise_sets_the_routing_mismatch(data_dir, tmp_path, sigma):
    """No noise: the sampler's and the trainer's routing agree exactly, and their
    log-probs to rounding. Noise: they disagree, and the log-probs drift apart."""
    c = _config(data_dir, **{"rollout.router_noise_std": sigma})
    *_, info = _prepared(c, tmp_path)
    if sigma == 0:
        assert info["mismatch_route"] == 0.0 and info["mismatch_route_token"] == 0.0
        assert info["mismatch_logp_abs"] < 1e-4 and info["mismatch_f2"] == 0.0
    else:
        assert info["mismatch_route"] > 0.05 and info["mismatch_logp_abs"] > 1e-3


def test_training_log_probs_are_at_the_sampling_temperature(data_dir, tmp_path):
    """At temperature 0.7 the old-policy pass gives the sampler's log-probs of the
    distribution that drew the tokens (softmax(logits / 0.7)); at temperature 1 it
    would not."""
    c = _config(data_dir, **{"rollout.temperature": 0.7})
    trainer, rl, host, batch, info = _prepared(c, tmp_path)
    m = np.asarray(host["mask"]) > 0
    np.testing.assert_allclose(np.asarray(batch["old_logp"])[m], host["rollout_logp"][m], atol=1e-4)
    assert info["mismatch_logp_abs"] < 1e-5
    at_one = passes.logprob_pass(rl.state.params, trainer.put_batch(host), graphdef=trainer.graphdef)["logp"]
    assert np.mean(np.abs(np.asarray(at_one)[m] - host["rollout_logp"][m])) > 1e-2


@pytest.mark.parametrize("field, value", [("rollout.top_p", 0.9), ("rollout.top_k", 5), ("rollout.temperature", 0.0),
                                          ("rollout.router_noise_std", -0.1),
                                          ("rollout_correction.mode", "token_clip"),
                                          ("updates.max_consecutive_skips", -1)])
def test_sampling_settings_rl_cannot_train_on_are_refused(field, value):
    c = default_config.get_config("smoke")
    node = c
    *path, last = field.split(".")
    for p in path:
        node = node[p]
    node[last] = value
    with pytest.raises(config_lib.ConfigError, match="config." + field.rsplit(".", 1)[0]):
        config_lib.validate(c, jax.device_count())


def test_rollout_correction_weights_reach_the_batch(data_dir, tmp_path):
    """Truncated IS at the token level: the batch carries w = min(pi_old / pi_sampler, C)
    on valid tokens (0 on padding), and the step's metrics describe it."""
    c = _config(data_dir, **{"rollout.router_noise_std": 0.5, "rollout_correction.mode": "token_tis",
                             "rollout_correction.cap": 1.5})
    trainer, rl, host, batch, info = _prepared(c, tmp_path)
    m = np.asarray(host["mask"]) > 0
    w = np.asarray(batch["rc_weight"])
    expected = np.minimum(np.exp(np.asarray(batch["old_logp"]) - host["rollout_logp"]), 1.5)
    np.testing.assert_allclose(w[m], expected[m], rtol=1e-5)
    assert np.all(w[~m] == 0) and info["rc_weight_max"] <= 1.5
    assert {"rc_weight_mean", "rc_truncated_frac"} <= set(info)
    rl.state, metrics = rl.train_fn(rl.state, trainer.put_batch(jax.device_get(
        {k: v[:16] for k, v in batch.items()})), jax.random.key(0))
    assert np.isfinite(float(compute_all(metrics)["loss"]))


def test_dynamic_sampling_filters_on_correctness_not_the_shaped_reward(data_dir, tmp_path):
    """Two groups whose answers are all correct, one with a length-dependent shaped
    reward: both are dropped (no accuracy signal); a mixed group is kept."""
    from gspo_jax import collect

    c = _config(data_dir, **{"dapo.dynamic_sampling": True})
    g, n = 4, 3
    host = {"tokens": np.zeros((n * g, 16), np.int32), "lengths": np.full(n * g, 16, np.int32),
            "truncated": np.zeros(n * g, bool)}
    correct = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0], np.float32)
    shaped = correct + np.array([0, 0, 0, 0, 0.1, -0.2, 0.3, 0, 0, 0, 0, 0], np.float32)
    r, rows, kept = collect.shape_and_filter(config_lib.typed(c), host, shaped, correct)
    assert kept == 1 and rows.tolist() == [8, 9, 10, 11]
    np.testing.assert_array_equal(r[rows], shaped[8:])


def test_consecutive_skip_limit_stops_a_run(data_dir, tmp_path):
    """A learning rate of 1e30: the first update makes the parameters huge, every
    later loss is non-finite and skipped; past max_consecutive_skips the run stops
    with an error naming the setting. The updates done are on record. (The random
    policy earns no reward, so the load-balancing loss, allowed to update without an
    RL signal, gives the gradient.)"""
    from gspo_jax import train

    c = _config(data_dir, **{"optimizer.lr": 1e30, "optimizer.warmup_steps": 0, "updates.num_minibatches": 4,
                             "updates.max_consecutive_skips": 2, "total_rl_steps": 3,
                             "updates.aux_loss_coef": 0.01, "updates.update_without_signal": True})
    with pytest.raises(FloatingPointError, match=r"3 updates in a row.*max_consecutive_skips=2"):
        train.run(c, str(tmp_path))
    ups = read_metrics(str(tmp_path), "updates.jsonl")
    assert [u["k"] for u in ups] == [0, 1, 2, 3] and [u["skipped_update"] for u in ups] == [0, 1, 1, 1]
    assert not os.path.isdir(tmp_path / "checkpoints" / "rl" / "1")


def test_updates_jsonl_one_record_per_update_and_cut_back_on_resume(data_dir, tmp_path):
    """Two RL steps of two epochs x two mini-batches: four records per step, k = 0..3;
    the step record keeps k = 0 and last-k drift values equal to those records, and its
    token metrics are pooled over the four updates' tokens."""
    from gspo_jax import train

    c = _config(data_dir, **{"updates.num_epochs": 2, "total_rl_steps": 2, "checkpoint_every": 1})
    records = train.run(c, str(tmp_path))
    ups = read_metrics(str(tmp_path), "updates.jsonl")
    assert [(u["step"], u["k"], u["epoch"], u["minibatch"]) for u in ups] == [
        (s, k, k // 2, k % 2) for s in (1, 2) for k in range(4)]
    for rec in (r for r in records if r["step"] > 0):
        mine = [u for u in ups if u["step"] == rec["step"]]
        tokens = np.array([u["num_tokens"] for u in mine])
        assert rec["num_tokens"] == tokens.sum()
        for key in ("flip_frac", "clip_frac", "ppo_kl"):
            assert rec[f"{key}_k0"] == pytest.approx(mine[0][key])
            assert rec[f"{key}_klast"] == pytest.approx(mine[-1][key])
            # The step's value is the pooled one: over all its updates' tokens.
            pooled = np.sum(tokens * np.array([u[key] for u in mine])) / tokens.sum()
            assert rec[key] == pytest.approx(pooled)
        assert {"mismatch_kl", "mismatch_f2", "mismatch_route", "no_signal_minibatches"} <= set(rec)
    # A resume from step 1 cuts step 2's records, as for metrics.jsonl.
    w = MetricsWriter(str(tmp_path), resume_step=1, resume_phase="rl", filename="updates.jsonl",
                      tensorboard=False)
    w.close()
    assert [u["step"] for u in read_metrics(str(tmp_path), "updates.jsonl")] == [1] * 4
    assert os.path.isdir(tmp_path / "tb" / "updates")


def test_update_writer_tensorboard_steps(tmp_path):
    """Per-update TensorBoard points go to their own run at the global update index."""
    w = MetricsWriter(str(tmp_path), filename="updates.jsonl", tb_prefix="updates")
    for k in range(3):
        w.write(1, "rl", {"k": k, "flip_frac": 0.1 * k}, tb_step=8 + k)
    w.close()
    lines = [json.loads(x) for x in open(tmp_path / "updates.jsonl")]
    assert [x["k"] for x in lines] == [0, 1, 2] and all(x["step"] == 1 for x in lines)
    points = _tb_scalars(tmp_path / "tb" / "updates", "updates/flip_frac")
    assert [step_ for step_, _ in points] == [8, 9, 10]
    assert math.isclose(points[2][1], 0.2, rel_tol=1e-6)


def _tb_scalars(logdir, tag):
    """(step, value) of a scalar tag in the TFRecord event files of ``logdir``."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(os.listdir(logdir)):
        with open(os.path.join(logdir, name), "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4
            for v in event.summary.value:
                if v.tag == tag:
                    out.append((event.step, v.simple_value))
    return out
