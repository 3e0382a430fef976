"""Tests of gspo_jax.refill: decode slots refilled with the next waiting row.

The reference is the batch program (`gspo_jax.decode`, itself checked against the
model's teacher-forced forward in test_rollout.py): a refilled row's computation is the
batch program's for it, so its tokens, lengths and routing record are the same bit for
bit, and its log-probs differ only by the float rounding that the batch program's own
rows show when the batch grows (XLA:CPU's matmuls round by their row count).
"""
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from test_rollout import _check_record

from gspo_jax import config as config_lib
from gspo_jax import refill, rollout
from gspo_jax.models import ModelConfig, Transformer, param_shardings

T = 12
REFILL = "jit(_generate_refill)"
# 10 prompts of 2-11 tokens; 4 samples each = 40 rows. Five stop tokens give lengths
# from 1 to T (some truncated): a long-tailed batch.
PROMPTS = [list(range(5 + i, 5 + i + 2 + i % 10)) for i in range(0, 30, 3)]
STOP = [5, 6, 7, 9, 11]
EXACT = ("tokens", "mask", "lengths", "truncated", "experts", "prompt_experts", "prompt_tokens",
         "prompt_mask")
CLOSE = ("logp", "router_logp")


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny(num_layers=3, init_std=0.3), rngs=nnx.Rngs(0))


def _sample(model, slots=0, chunk=1, mesh=None, state=None, prompts=PROMPTS, **kw):
    sampler = rollout.Sampler(*nnx.split(model), vocab_size=model.cfg.vocab_size, prompt_len=12,
                              slots=slots, refill_chunk=chunk, mesh=mesh)
    args = dict(num_samples=4, max_new_tokens=T, rng=jax.random.key(3), eos_id=STOP, routing="all")
    return sampler(prompts, **{**args, **kw}, state=state)


def _assert_same_rows(a, b, greedy=False):
    """Rows of ``a`` are those of ``b``: bit for bit but the log-probs (float rounding), or,
    where rounding moved a draw across the boundary between two tokens of the inverse CDF,
    the same up to that draw, which picked a neighbouring token id (every token has
    positive probability under this model); then they are different samples. Greedy
    draws have no such boundary: equal throughout."""
    ta, tb = np.asarray(a.tokens), np.asarray(b.tokens)
    same = (ta == tb).all(axis=1)
    for r in np.flatnonzero(~same):
        t = np.flatnonzero(ta[r] != tb[r])[0]
        assert not greedy and abs(int(ta[r, t]) - int(tb[r, t])) == 1, (r, t, ta[r], tb[r])
    assert same.mean() >= 0.9, same.mean()
    kept = [f for f in EXACT + CLOSE if getattr(b, f) is not None]
    assert kept == [f for f in EXACT + CLOSE if getattr(a, f) is not None]
    for f in (f for f in EXACT if f in kept):
        np.testing.assert_array_equal(np.asarray(getattr(a, f))[same], np.asarray(getattr(b, f))[same],
                                      err_msg=f)
    for f in (f for f in CLOSE if f in kept):
        np.testing.assert_allclose(np.asarray(getattr(a, f))[same], np.asarray(getattr(b, f))[same],
                                   atol=1e-5, err_msg=f)


@pytest.mark.parametrize("slots,chunk,kw", [
    (8, 1, {}),  # a fill per freed slot; the whole routing record
    # Fills wait for 3 free slots; the noise keyed by row; the response tokens' record only.
    (8, 3, dict(router_noise_std=0.5, routing="response")),
    (16, 16, dict(temperature=0.0, routing="none")),  # greedy, fills of 16; no record
])
def test_refilled_rows_are_the_batch_programs(model, slots, chunk, kw):
    batch = _sample(model, **kw)
    a = _sample(model, slots, chunk, **kw)
    _assert_same_rows(a, batch, greedy=kw.get("temperature") == 0.0)
    routing = kw.get("routing", "all")
    assert (a.experts is None) == (routing == "none") and (a.prompt_experts is None) == (routing != "all")
    lengths = np.asarray(a.lengths)
    assert 1 <= lengths.min() < T and lengths.max() == T and np.asarray(a.truncated).any()
    # Each slot step feeds at most one token of a row, and every token but a row's last
    # is fed: the slots ran at least the steps that needs, and the batch program ran
    # until its longest row's last token (nothing is fed after it).
    fed = np.maximum(lengths - 1, 0).sum()
    assert int(a.decode_steps) * slots >= fed and int(batch.decode_steps) == lengths.max() - 1
    assert int(a.decode_steps) > int(batch.decode_steps)  # fewer rows at once, more steps


def test_refilled_record_matches_teacher_forced_forward(model):
    """The record of a refilled rollout against the model's own full forward (not the
    batch program): log-probs, experts, prompt experts, padding after the stop."""
    # 9 prompts (batch bucket 16): the program of test_one_program_for_every_call.
    r = rollout.Sampler.from_model(model, prompt_len=12, slots=8, refill_chunk=2)(
        PROMPTS[:9], num_samples=4, max_new_tokens=T, rng=jax.random.key(5), eos_id=STOP)
    assert int(r.decode_steps) > int(np.asarray(r.lengths).max()) - 1  # 36 rows in 8 slots
    _check_record(rollout.Sampler.from_model(model), r, rows=36, length=2 * T)


def test_one_program_for_every_call(model, compile_counts):
    """Other prompts, temperatures, stop tokens and row counts in one batch bucket run the
    program the first call compiled; nothing is compiled per step."""
    _sample(model, 8, 2, temperature=0.8)
    compile_counts.clear()
    sampler = rollout.Sampler.from_model(model, prompt_len=12, slots=8, refill_chunk=2)
    for i, prompts in enumerate((PROMPTS[:9], PROMPTS[1:10][::-1], PROMPTS[:10])):
        r = sampler(prompts, num_samples=4, max_new_tokens=T, rng=jax.random.key(i),
                    eos_id=STOP[i:] + STOP[:i], temperature=0.5 + 0.1 * i)
        assert r.tokens.shape == (4 * len(prompts), T)
    assert compile_counts[REFILL] == 0


def test_the_loop_is_one_device_program(model):
    """No host callback inside, and the same program, op for op, for 4 and 40 new tokens."""
    sampler = rollout.Sampler.from_model(model, prompt_len=12, slots=8, refill_chunk=2)

    def ops(steps):
        args, spec, n = sampler._prepare(PROMPTS, num_samples=4, max_new_tokens=steps,
                                         rng=jax.random.key(0), eos_id=5)
        args = (*args[:6], jnp.int32(n), *args[7:])
        text = refill.generate_refill_jit.lower(*args, spec=refill.RefillSpec(spec, 8, 2)).as_text()
        assert "callback" not in text
        import re
        return collections.Counter(re.findall(r"stablehlo\.\w+|call @\w+", text))

    short, long = ops(4), ops(40)
    assert short == long and short["stablehlo.while"] >= 3  # steps, fills in a step, first fills


def test_no_refill_when_the_slots_hold_every_row(model):
    r = _sample(model, 40, 4)  # 40 rows in 40 slots: the batch program
    assert int(r.decode_steps) == int(np.asarray(r.lengths).max()) - 1


def test_sharded_slots_equal_single_device(model):
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = Mesh(devices.reshape(4, 2), ("data", "tensor"))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, param_shardings(state, mesh, model.cfg))
    # 8 prompts x 4 = 32 rows, the bucket's: the outputs keep the rows' sharding.
    a = _sample(model, 8, 4, mesh=mesh, state=state, prompts=PROMPTS[:8])
    _assert_same_rows(a, _sample(model, 8, 4, prompts=PROMPTS[:8]))
    spec0 = a.tokens.sharding.spec[0]
    assert (spec0 if isinstance(spec0, tuple) else (spec0,)) == ("data",)
    with pytest.raises(ValueError, match="slots: must be an int >= 0 and a multiple of the 4 data"):
        rollout.Sampler(graphdef, state, vocab_size=model.cfg.vocab_size, mesh=mesh, slots=6)


def test_bad_settings_are_refused(model):
    with pytest.raises(ValueError, match=r"refill_chunk: must be an int in \[1, slots=4\], got 5"):
        rollout.Sampler.from_model(model, slots=4, refill_chunk=5)
    with pytest.raises(ValueError, match="slots: must be an int >= 0"):
        rollout.Sampler.from_model(model, slots=-1)

    def load(**fields):
        c = config_lib.base_config()
        c.rollout.prompts_per_step, c.rollout.group_size = 8, 4
        for k, v in fields.items():
            setattr(c.rollout, k, v)
        return config_lib.load(c, 8)

    assert load(decode_slots=16).rollout.decode_slots == 16
    with pytest.raises(config_lib.ConfigError,
                       match=r"^config.rollout.decode_slots: 32 slots hold all 32 rows"):
        load(decode_slots=32)
    with pytest.raises(config_lib.ConfigError,
                       match=r"^config.rollout.decode_slots: 12 is not a multiple of the sampler's 8"):
        load(decode_slots=12)
    with pytest.raises(config_lib.ConfigError,
                       match=r"^config.rollout.refill_chunk: 17 is more than the 16 decode_slots"):
        load(decode_slots=16, refill_chunk=17)


@functools.partial(jax.jit, static_argnums=0)
def _jit_decode(graphdef, state, tok, cache, positions):
    return nnx.merge(graphdef, state).decode(tok, cache, positions=positions)


def test_a_row_index_per_row_writes_each_rows_column(model):
    """The model side: a decode step with one cache column per row equals, row by row, a
    step with that column for every row; a per-row index takes one token per row."""
    cache = model.init_cache(3, 6)
    tok = jnp.asarray([[4], [5], [6]], jnp.int32)
    cols = jnp.asarray([1, 4, 2], jnp.int32)
    # Jitted (op by op, each decode compiles its every operation): one program for the
    # per-row index, one for the scalar index of every r.
    graphdef, state = nnx.split(model)
    logits, _, out = _jit_decode(graphdef, state, tok, cache.replace(index=cols), cols[:, None])
    for r in range(3):
        want, _, ref = _jit_decode(graphdef, state, tok, cache.replace(index=cols[r]),
                                   cols[:, None])
        np.testing.assert_array_equal(np.asarray(logits[r]), np.asarray(want[r]))
        for a, b in zip(out.k + out.v, ref.k + ref.v):
            np.testing.assert_array_equal(np.asarray(a[r]), np.asarray(b[r]))
        np.testing.assert_array_equal(np.asarray(out.valid[r]), np.asarray(ref.valid[r]))
    with pytest.raises(ValueError, match=r"cache.index: int32\[\] or, for one token per row, int32\[3\]"):
        model.decode(jnp.zeros((3, 2), jnp.int32), cache.replace(index=cols),
                     positions=jnp.zeros((3, 2), jnp.int32))
