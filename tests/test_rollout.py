"""Tests of gspo_jax.rollout: the sampler against the full teacher-forced forward.

The reference for every recorded quantity is the model's plain full forward
(no KV cache) over the sampled sequence: KV-cache decoding, left padding and
batch composition must not change a log-prob or a routing choice.
Expected values never come from JAX's RNG: distributions are checked with a
chi-square test (fixed significance), sets and log-probs against numpy.
"""
import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx
from jax.sharding import Mesh

from gspo_jax import decode, passes, rollout
from gspo_jax.models import ModelConfig, Transformer, layers

T = 8  # max_new_tokens shared by most tests (one compile per shape)
GENERATE = "jit(_generate)"  # the sampler's compiled function, in compile_counts
PROMPTS = [[1, 2, 3], list(range(4, 21)), [7, 8, 9, 10, 11, 12, 13, 14, 15]]  # 3, 17, 9 tokens


def _cfg(**kw):
    # 3 layers: one dense, two MoE (L = 2, K = 2, E = 8); init_std large enough
    # that next-token distributions and routing are far from uniform.
    return ModelConfig.tiny(num_layers=3, init_std=0.3, **kw)


@pytest.fixture(scope="module")
def model():
    return Transformer(_cfg(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sampler(model):
    return rollout.Sampler.from_model(model)


@functools.partial(jax.jit, static_argnums=0)
def _jit_forward(graphdef, state, tokens, positions, mask):
    logits, aux = nnx.merge(graphdef, state)(tokens, positions=positions, attn_mask=mask)
    return jax.nn.log_softmax(logits, axis=-1), aux.topk_indices


def _forward(sampler, tokens, positions, mask, rows=16, length=40):
    """Full forward (no cache), padded to one [rows, length] shape so that every
    test shares one compile.  Returns (log-softmax f64[N, L, V], top-K [N, L, L', K])."""
    n, t = tokens.shape
    pad = ((0, rows - n), (0, length - t))
    lp, topk = _jit_forward(sampler.graphdef, sampler.state, np.pad(np.asarray(tokens), pad),
                            np.pad(np.asarray(positions), pad), np.pad(np.asarray(mask), pad))
    return np.asarray(lp, np.float64)[:n, :t], np.asarray(topk)[:n, :t]


def _sequence(r):
    """The full sequences of a rollout: tokens ``concat(prompt_tokens, tokens)``
    int32[N, P+T], the positions the sampler used (0 at the first real prompt
    token, padding clamped to 0) and the attention mask bool[N, P+T] (numpy: eager
    jnp ops would compile one program each)."""
    tokens = np.concatenate([np.asarray(r.prompt_tokens), np.asarray(r.tokens)], axis=1)
    mask = np.concatenate([np.asarray(r.prompt_mask), np.asarray(r.mask) > 0], axis=1)
    positions = np.maximum(np.cumsum(mask.astype(np.int32), axis=1) - 1, 0).astype(np.int32)
    return tokens, positions, mask


def _teacher_forced(sampler, r, **kw):
    """Full-forward log-probs f64[N, T, V] predicting response token t, the
    top-K int[N, T, L, K] at those positions, and the prompt's int[N, P, L, K]."""
    logp_all, topk = _forward(sampler, *_sequence(r), **kw)
    P, T_ = r.prompt_tokens.shape[1], r.tokens.shape[1]
    return logp_all[:, P - 1:P - 1 + T_], topk[:, P - 1:P - 1 + T_], topk[:, :P]


def _check_record(sampler, r, temperature=1.0, **kw):
    """The recorded logp (of softmax(logits / temperature); 0 for greedy) and experts
    equal the teacher-forced forward's (kw: `_forward`'s padded shape)."""
    lp_all, topk, ptopk = _teacher_forced(sampler, r, **kw)
    tokens, mask = np.asarray(r.tokens), np.asarray(r.mask)
    lp = np.take_along_axis(lp_all, tokens[..., None], -1)[..., 0]
    if temperature == 0:
        lp = np.zeros_like(lp)
    else:
        lp = np.take_along_axis(_np_log_softmax(lp_all / temperature), tokens[..., None], -1)[..., 0]
    diff = np.where(mask > 0, np.abs(lp - np.asarray(r.logp)), 0.0)
    assert diff.max() <= 1e-5, diff.max()
    m4 = (mask > 0)[..., None, None]
    np.testing.assert_array_equal(np.where(m4, topk, -1), np.asarray(r.experts))
    pm4 = np.asarray(r.prompt_mask)[..., None, None]
    np.testing.assert_array_equal(np.where(pm4, ptopk, -1), np.asarray(r.prompt_experts))
    # After the stop: padding everywhere.
    assert np.all(np.asarray(r.logp)[mask == 0] == 0)
    assert np.all(np.asarray(r.experts)[mask == 0] == -1)
    return lp_all


# ---------------------------------------------------------------------------
# Token sampling on hand-made logits: uniforms from numpy, sets from numpy.
# Both formulations (`decode.use_cpu_sampling`) on CPU: cpu=True is what the
# sampler runs here, cpu=False what it runs on accelerators.


@functools.partial(jax.jit, static_argnames=("greedy", "cpu"))
def _jit_sample_token(logits, u, temperature, *, greedy, cpu):
    # Jitted, as in the decode loop (op by op, every operation compiles on its own).
    return decode.sample_token(logits, u, temperature, greedy=greedy, cpu=cpu)


def _sample_token(logits, u, *, temperature, greedy=False, cpu=True):
    """The decode loop's sampling step with the sampler's static mode."""
    return _jit_sample_token(jnp.asarray(logits, jnp.float32), u, jnp.float32(temperature),
                             greedy=greedy, cpu=cpu)


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _draw(logits_row, n, seed, **kw):
    u = np.random.RandomState(seed).uniform(size=n).astype(np.float32)
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n, len(logits_row)))
    tok, lp = _sample_token(logits, jnp.asarray(u), **kw)
    return np.asarray(tok), np.asarray(lp)


def _chi2_pvalue(tokens, probs):
    support = probs > 0
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    return scipy.stats.chisquare(counts[support], probs[support] * len(tokens)).pvalue


LOGITS = np.array([2.0, -1.0, 0.5, 1.5, -3.0, 0.0, 1.0, -0.5, 2.5, -2.0])


@pytest.mark.parametrize("cpu", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sample_token_matches_tempered_distribution(temperature, cpu):
    tok, lp = _draw(LOGITS, 20000, seed=0, temperature=temperature, cpu=cpu)
    q = np.exp(_np_log_softmax(LOGITS / temperature))
    assert _chi2_pvalue(tok, q) > 1e-3
    np.testing.assert_allclose(lp, np.log(q)[tok], atol=1e-5)


@pytest.mark.parametrize("cpu", [True, False])
def test_sample_token_greedy(cpu):
    tok, lp = _draw(LOGITS, 4, seed=4, temperature=1.0, greedy=True, cpu=cpu)
    assert np.all(tok == 8) and np.all(lp == 0)


@pytest.mark.parametrize("cpu", [True, False])
def test_sample_token_masked_logits_never_sampled(cpu):
    # A -inf logit (probability 0) is never drawn, even with u at the ends of [0, 1).
    logits = np.array([-np.inf, 0.0, -np.inf, 1.0, -np.inf], np.float32)
    u = np.array([0.0, 1e-9, 0.5, 1 - 2**-24, 0.999999], np.float32)
    tok, _ = _sample_token(jnp.broadcast_to(jnp.asarray(logits), (5, 5)), jnp.asarray(u),
                           temperature=1.0, cpu=cpu)
    assert set(np.asarray(tok).tolist()) <= {1, 3}


@pytest.mark.parametrize("kw", [dict(), dict(greedy=True)])
def test_cpu_and_plain_sampling_draw_the_same_tokens(kw):
    # The same logits and uniforms: the same token, except where the uniform
    # falls within f32 rounding of a boundary of the cumulative sum (none here);
    # the same log-probs.  V = 1000, a realistic spread of logits, ties included.
    rs = np.random.RandomState(5)
    logits = rs.normal(0.0, 3.0, (512, 1000)).astype(np.float32)
    logits[:8, :4] = logits[:8, 4:8]  # ties
    logits[8:16, rs.randint(0, 1000, 200)] = -np.inf  # masked entries
    u = jnp.asarray(rs.uniform(size=512).astype(np.float32))
    a = _sample_token(logits, u, temperature=0.8, cpu=True, **kw)
    b = _sample_token(logits, u, temperature=0.8, cpu=False, **kw)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), atol=1e-5)


# ---------------------------------------------------------------------------
# The sampler against the model's full forward.


# G = 4 samples per prompt, as in the mixed-length and sharded tests: one program for all.
G = 4


@functools.partial(jax.jit, static_argnums=0)
def _jit_replayed_logprobs(graphdef, state, tokens, positions, mask, replay):
    lp, _, aux = nnx.merge(graphdef, state).token_logprobs(
        tokens, jnp.roll(tokens, -1, axis=1), positions=positions, attn_mask=mask, replay=replay)
    return lp, aux.replay_mismatch


def test_logp_and_experts_match_teacher_forced_forward(model, sampler, compile_counts):
    r = sampler(PROMPTS, num_samples=G, max_new_tokens=T, rng=jax.random.key(0), eos_id=5)
    # A new sampler of the same model re-splits it but reuses the compiled function.
    compile_counts.clear()
    r1 = rollout.Sampler.from_model(model)(PROMPTS, num_samples=G, max_new_tokens=T,
                                           rng=jax.random.key(0), eos_id=5)
    assert compile_counts[GENERATE] == 0
    np.testing.assert_array_equal(np.asarray(r1.tokens), np.asarray(r.tokens))
    N = 3 * G
    assert r.tokens.shape == (N, T) and r.tokens.dtype == jnp.int32
    assert r.experts.shape == (N, T, 2, 2) and r.prompt_experts.shape == (N, 17, 2, 2)
    assert r.experts.dtype == jnp.int32 and r.truncated.shape == (N,) and r.truncated.dtype == bool
    assert r.router_logp.shape == (N, T, 2, 2) and r.router_logp.dtype == jnp.float32
    for x in (r.mask, r.logp):
        assert x.shape == (N, T) and x.dtype == jnp.float32
    assert r.prompt_tokens.shape == (N, 17)  # padded to the longest prompt
    _check_record(sampler, r)
    # Layout: prompt-major rows, left-padded prompts.
    for i, p in enumerate(PROMPTS):
        for g in range(G):
            np.testing.assert_array_equal(np.asarray(r.prompt_tokens)[G * i + g, -len(p):], p)
            assert int(np.asarray(r.prompt_mask)[G * i + g].sum()) == len(p)
    # The R3 replay array reproduces the same log-probs when forced: `replay_r3` (what
    # the trainer's batch holds) at the P+T-1 input positions, -1 (free) at the last.
    np.testing.assert_array_equal(np.asarray(r.replay()[:, :-1]),
                                  np.asarray(rollout.replay_r3(r.prompt_experts, r.experts)))
    assert np.all(np.asarray(r.replay()[:, -1]) == -1)
    tokens, positions, mask = _sequence(r)
    lp, replay_mismatch = _jit_replayed_logprobs(sampler.graphdef, sampler.state, tokens,
                                                 positions, mask, r.replay())
    P = r.prompt_tokens.shape[1]
    np.testing.assert_allclose(np.where(r.mask > 0, lp[:, P - 1:P - 1 + T], 0), r.logp, atol=1e-5)
    assert float(jnp.max(replay_mismatch)) == 0.0


@functools.partial(jax.jit, static_argnums=(0, 5))
def _jit_token_logprobs(graphdef, state, tokens, positions, mask, temperature):
  return nnx.merge(graphdef, state).token_logprobs(
      tokens, jnp.roll(tokens, -1, axis=1), positions=positions, attn_mask=mask,
      temperature=temperature)[0]


def test_training_forward_at_the_sampling_temperature_gives_logp(sampler):
  # The sampler draws from softmax(logits / 0.7): the training forward at temperature
  # 0.7 gives its logp; at 1.0 it would not.
  r = sampler(PROMPTS, num_samples=G, max_new_tokens=T, rng=jax.random.key(2), temperature=0.7,
              eos_id=5)
  tokens, positions, mask = _sequence(r)
  P = r.prompt_tokens.shape[1]
  _check_record(sampler, r, temperature=0.7)
  got = {}
  for temperature in (0.7, 1.0):
    lp = _jit_token_logprobs(sampler.graphdef, sampler.state, tokens, positions, mask, temperature)
    got[temperature] = np.where(r.mask > 0, lp[:, P - 1:P - 1 + T], 0.0)
  np.testing.assert_allclose(got[0.7], np.asarray(r.logp), atol=1e-5, rtol=0)
  assert np.max(np.abs(got[1.0] - np.asarray(r.logp))) > 0.1


def test_plain_sampling_method_gives_the_same_rollout(sampler, monkeypatch, compile_counts):
    # What the sampler runs off CPU (`decode.use_cpu_sampling()` False: argmax,
    # jnp.cumsum), here on CPU: a program of its own, the same rollout.
    if not decode.use_cpu_sampling():
        pytest.skip("off CPU the sampler runs the plain method already (seen on an H200)")
    kw = dict(num_samples=G, max_new_tokens=T, rng=jax.random.key(1), temperature=0.7, eos_id=5)
    cpu = sampler(PROMPTS, **kw)  # the program of test_logp_and_experts_...
    monkeypatch.setattr(rollout, "use_cpu_sampling", lambda: False)
    compile_counts.clear()
    plain = sampler(PROMPTS, **kw)
    assert compile_counts[GENERATE] == 1
    for name in ("tokens", "mask", "experts"):
        np.testing.assert_array_equal(np.asarray(getattr(plain, name)), np.asarray(getattr(cpu, name)))
    np.testing.assert_allclose(np.asarray(plain.logp), np.asarray(cpu.logp), atol=1e-5)


def test_fused_cached_attention_gives_the_same_rollout(sampler, monkeypatch):
    # The sampler with the KV cache of a fused attention kernel ([B, S, KV, hd], cuDNN on
    # a GPU), here through jax.nn's 'xla' implementation of the same calls: the same
    # tokens and experts, log-probs to rounding.
    kw = dict(num_samples=G, max_new_tokens=T, rng=jax.random.key(2), temperature=0.7, eos_id=5)
    einsums = sampler(PROMPTS, **kw)  # the program of test_logp_and_experts_...
    calls = collections.Counter()
    fused = layers._attention_with_lse

    def counted(*args):
        calls["fused"] += 1
        return fused(*args)

    monkeypatch.setattr(layers, "fused_cached_attention", lambda cfg: True)
    monkeypatch.setattr(layers, "_attention_with_lse", counted)
    decode.generate_jit.clear_cache()  # the layout is chosen while tracing
    try:
        r = sampler(PROMPTS, **kw)
    finally:
        decode.generate_jit.clear_cache()
    assert calls["fused"] > 0
    for name in ("tokens", "mask", "experts"):
        np.testing.assert_array_equal(np.asarray(getattr(r, name)), np.asarray(getattr(einsums, name)))
    np.testing.assert_allclose(np.asarray(r.logp), np.asarray(einsums.logp), atol=1e-5)


def test_greedy_equals_stepwise_argmax_of_full_forward(sampler):
    r = sampler(PROMPTS, num_samples=1, max_new_tokens=T, rng=jax.random.key(0), temperature=0.0)
    assert np.all(np.asarray(r.logp) == 0) and np.all(np.asarray(r.truncated))
    _check_record(sampler, r, temperature=0.0)
    # Reference: grow each sequence one token at a time with the full forward
    # (fixed length buffer, right-padded, so it compiles once).
    for i, p in enumerate(PROMPTS):
        n = len(p) + T
        seq = np.zeros((1, n), np.int32)
        seq[0, :len(p)] = p
        pos = np.arange(n, dtype=np.int32)[None]
        for t in range(T):
            m = (np.arange(n) < len(p) + t)[None]
            logp_all, _ = _forward(sampler, seq, pos, m)
            seq[0, len(p) + t] = int(np.argmax(logp_all[0, len(p) + t - 1]))
        np.testing.assert_array_equal(np.asarray(r.tokens[i]), seq[0, len(p):])


def test_mixed_prompt_lengths_equal_each_prompt_alone(sampler):
    # G = 4: the programs of test_logp_and_experts_... and (prompt 0 alone) of
    # test_sharded_batch_equals_single_device.
    kw = dict(num_samples=G, max_new_tokens=T, rng=jax.random.key(0), eos_id=5)
    mixed = sampler(PROMPTS, **kw)
    for i, p in enumerate(PROMPTS):
        alone = sampler([p], prompt_ids=[i], **kw)  # P = len(p), B = 4
        rows = slice(G * i, G * i + G)
        np.testing.assert_array_equal(np.asarray(alone.tokens), np.asarray(mixed.tokens[rows]))
        np.testing.assert_array_equal(np.asarray(alone.mask), np.asarray(mixed.mask[rows]))
        np.testing.assert_array_equal(np.asarray(alone.experts), np.asarray(mixed.experts[rows]))
        np.testing.assert_allclose(np.asarray(alone.logp), np.asarray(mixed.logp[rows]), atol=1e-5)
        P = alone.prompt_tokens.shape[1]
        np.testing.assert_array_equal(np.asarray(alone.prompt_experts),
                                      np.asarray(mixed.prompt_experts[rows, -P:]))
    # Samples of one prompt differ from each other; a new key gives new samples.
    assert len({tuple(x) for x in np.asarray(mixed.tokens)[:G].tolist()}) > 1
    again = sampler(PROMPTS, **kw)  # the same key: the same rollout, every field bit for bit
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(mixed), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    other = sampler(PROMPTS, **{**kw, "rng": jax.random.key(1)})
    assert np.any(np.asarray(other.tokens) != np.asarray(mixed.tokens))


def test_stop_on_any_eos(sampler):
    kw = dict(num_samples=1, max_new_tokens=T, rng=jax.random.key(0), temperature=0.0)
    free = np.asarray(sampler(PROMPTS, **kw).tokens)  # greedy: the same prefix with stops
    # EOS ids: prompt 0's greedy token at step 3 and prompt 1's at step 5.
    eos = [int(free[0, 3]), int(free[1, 5])]
    r = sampler(PROMPTS, eos_id=eos, **kw)
    stopped = 0
    for i in range(len(PROMPTS)):
        hits = np.flatnonzero(np.isin(free[i], eos))  # reference: the first EOS token
        n = int(hits[0]) + 1 if hits.size else None
        stopped += n is not None
        assert bool(r.truncated[i]) == (n is None)
        n = T if n is None else n
        assert int(r.lengths[i]) == n
        np.testing.assert_array_equal(np.asarray(r.tokens[i, :n]), free[i, :n])
        assert np.all(np.asarray(r.tokens[i, n:]) == 0)  # pad_id after the stop
        np.testing.assert_array_equal(np.asarray(r.mask[i]), np.arange(T) < n)
    assert stopped >= 2 and int(r.lengths[0]) <= 4 and int(r.lengths[1]) <= 6
    _check_record(sampler, r, temperature=0.0)


def test_compile_count_is_one_per_batch_bucket(model, compile_counts):
    # One prompt length for every call (the trainer's ``rollout.max_prompt_len``).
    sampler = rollout.Sampler.from_model(model, prompt_len=32)
    kw = dict(num_samples=2, max_new_tokens=5, rng=jax.random.key(0))  # T=5: fresh programs
    # Different prompts, lengths, temperatures, EOS ids and keys in one batch
    # bucket (B = 2, P = 32): one compile.
    for i, (prompts, temperature) in enumerate((([[1, 2]], 1.0), ([[7] * 16], 0.5), ([[9]], 0.8))):
        sampler(prompts, temperature=temperature, eos_id=5 + i, **{**kw, "rng": jax.random.key(i)})
        assert compile_counts[GENERATE] == 1, i
    # 3 or 4 prompts: one new batch bucket (b = 4 prompts, B = 8 rows).
    compile_counts.clear()
    sampler([[1] * 20, [2] * 3, [3]], temperature=0.7, eos_id=5, **kw)
    assert compile_counts[GENERATE] == 1
    sampler([[2] * 30, [4], [5] * 17, [6] * 2], temperature=0.9, eos_id=9, **kw)
    assert compile_counts[GENERATE] == 1


def test_decode_loop_is_one_device_program(sampler):
    # The lowered program is the same, op for op, for 3 and 40 new tokens: the
    # decode loop is a device while loop (not unrolled per token), with no host
    # callback inside.
    def ops(steps):
        args, spec, _ = sampler._prepare(PROMPTS, num_samples=2, max_new_tokens=steps,
                                         rng=jax.random.key(0), eos_id=5)
        text = decode.generate_jit.lower(*args, spec=spec).as_text()
        assert "callback" not in text and "custom_call" not in text
        return collections.Counter(re.findall(r"stablehlo\.\w+|call @\w+", text))

    short, long = ops(3), ops(40)
    assert short == long and short["stablehlo.while"] >= 1


@pytest.mark.parametrize("axes,shape,shards,buckets", [
    (("data", "tensor"), (4, 2), 4, [4, 2, 4, 8]),
    (("data", "fsdp", "expert"), (2, 2, 2), 8, [8, 4, 8, 8]),
])
def test_sharded_batch_equals_single_device(model, sampler, axes, shape, shards, buckets):
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 (fake) devices")
    # Batch over the data axes ('data' = 4, or 'data' x 'fsdp' x 'expert' = 2 x 2 x 2),
    # the parameters sharded by the model's rules over the other axes.
    mesh = Mesh(devices.reshape(shape), axes)
    from gspo_jax.models import param_shardings
    state = jax.device_put(sampler.state, param_shardings(sampler.state, mesh, model.cfg))
    sharded = rollout.Sampler(sampler.graphdef, state, vocab_size=model.cfg.vocab_size, mesh=mesh)
    data_axes = tuple(a for a in axes if a in ("data", "fsdp", "expert"))
    assert sharded.data_axes == data_axes and sharded.data_shards == shards
    assert any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
               for x in jax.tree.leaves(state))  # some parameters are sharded
    # Prompt buckets b such that the b * G rows divide over the data shards.
    assert [sharded.batch_bucket(n, g) for n, g in ((3, 3), (1, 2), (1, 1), (5, 3))] == buckets
    kw = dict(num_samples=4, max_new_tokens=T, rng=jax.random.key(0), eos_id=5)
    # 4 prompts x 4 = 16 rows: no padding rows, the prefill batch sharded too;
    # shards / 4 prompts x 4: the prefill replicated, the rows sharded.
    for prompts in (PROMPTS + [[5, 6]], PROMPTS[: shards // 4]):
        a, b = sharded(prompts, **kw), sampler(prompts, **kw)
        for x in (a.tokens, a.logp, a.experts):
            spec0 = x.sharding.spec[0]
            assert (spec0 if isinstance(spec0, tuple) else (spec0,)) == data_axes, x.sharding
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        np.testing.assert_array_equal(np.asarray(a.experts), np.asarray(b.experts))
        np.testing.assert_array_equal(np.asarray(a.prompt_experts), np.asarray(b.prompt_experts))
        np.testing.assert_allclose(np.asarray(a.logp), np.asarray(b.logp), atol=1e-5)


def test_sampling_matches_model_distribution_chi_square():
    # Tiny vocabulary; 4096 first tokens of one prompt against the model's
    # softmax; then the second token's conditional given the most common first.
    cfg = _cfg(vocab_size=8)
    m = Transformer(cfg, rngs=nnx.Rngs(1))
    s = rollout.Sampler.from_model(m)
    prompt = [3, 1, 4, 1, 5]
    r = s([prompt], num_samples=4096, max_new_tokens=2, rng=jax.random.key(42))
    lp_all, _, _ = _teacher_forced(s, r, rows=4096, length=18)
    tok = np.asarray(r.tokens)
    p0 = np.exp(lp_all[0, 0])
    assert p0.max() < 0.9  # a non-trivial distribution
    assert _chi2_pvalue(tok[:, 0], p0 / p0.sum()) > 1e-3
    a = np.bincount(tok[:, 0]).argmax()
    rows = tok[:, 0] == a
    p1 = np.exp(lp_all[np.flatnonzero(rows)[0], 1])
    assert _chi2_pvalue(tok[rows, 1], p1 / p1.sum()) > 1e-3


def test_bad_arguments_raise(sampler):
    kw = dict(num_samples=2, max_new_tokens=4, rng=jax.random.key(0))
    V = sampler.vocab_size
    for bad, field in [(dict(prompts=[]), "prompts"), (dict(prompts=[[]]), "prompts\\[0\\]"),
                       (dict(prompts=[[1, V]]), "prompts\\[0\\]"),
                       (dict(prompts=["abc"]), "prompts\\[0\\]"),
                       (dict(num_samples=0), "num_samples"), (dict(max_new_tokens=0), "max_new_tokens"),
                       (dict(temperature=-1.0), "temperature"), (dict(eos_id=V), "eos_id"),
                       (dict(eos_id=[5, -1]), "eos_id"),
                       (dict(pad_id=-1), "pad_id"), (dict(prompt_ids=[0, 0]), "prompt_ids"),
                       (dict(rng=jnp.zeros((3,), jnp.int32)), "rng")]:
        args = {**kw, "prompts": [[1, 2], [3]], **bad}
        with pytest.raises(ValueError, match=field):
            sampler(args.pop("prompts"), **args)
    with pytest.raises(ValueError, match="prompt_len=8"):
        rollout.Sampler(sampler.graphdef, sampler.state, vocab_size=V,
                        prompt_len=8)([[1] * 9], **kw)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="prompt_len"):
            rollout.Sampler(sampler.graphdef, sampler.state, vocab_size=V, prompt_len=bad)


# Jitted, as in the decode loop (op by op, every operation compiles on its own).
_jit_cumsum = jax.jit(decode._cumsum, static_argnames="cpu")


def test_cumsum_by_matmuls_equals_cumsum():
    rs = np.random.RandomState(0)
    for c in (7, 32, 33, 512, 1000):  # below, at and above one block; ragged last block
        w = jnp.asarray(rs.exponential(1.0, (3, c)).astype(np.float32))
        got, want = _jit_cumsum(w, cpu=True), jnp.cumsum(w, axis=-1)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(want[:, -1].max()))


def test_first_true_and_argmax_equal_jnp_argmax():
    rs = np.random.RandomState(1)
    x = rs.randint(0, 4, (64, 50)).astype(np.float32)  # many ties: the first maximum wins
    x[3] = -np.inf
    x[5, 7] = np.nan  # argmax returns the first NaN
    x = jnp.asarray(x)
    m = x > 2
    for cpu in (True, False):
        np.testing.assert_array_equal(decode._argmax(x, cpu), jnp.argmax(x, axis=-1))
        np.testing.assert_array_equal(decode._first_true(m, cpu), jnp.argmax(m, axis=-1))


STOPS = list(range(0, 97, 4))  # a quarter of the vocabulary: most rows stop early
# With router noise: a few stop tokens (some rows stop early, most run to T); the
# routing record's test and the noisy router's share this program.
NOISY_STOPS = STOPS[:8]


def test_routing_record_can_be_left_out(sampler, compile_counts):
    # routing="response" keeps the response tokens' record only, "none" none at all
    # (a program of its own each); the samples are the same.
    kw = dict(num_samples=3, max_new_tokens=T, rng=jax.random.key(0), eos_id=NOISY_STOPS,
              router_noise_std=0.5)
    full = sampler(PROMPTS, **kw)
    compile_counts.clear()
    resp = sampler(PROMPTS, routing="response", **kw)
    none = sampler(PROMPTS, routing="none", **kw)
    assert compile_counts[GENERATE] == 2
    assert resp.prompt_experts is None and none.experts is None and none.prompt_experts is None
    assert none.router_logp is None
    np.testing.assert_array_equal(np.asarray(resp.experts), np.asarray(full.experts))
    np.testing.assert_array_equal(np.asarray(resp.router_logp), np.asarray(full.router_logp))
    for r in (resp, none):
        for name in ("tokens", "mask", "logp"):
            np.testing.assert_array_equal(np.asarray(getattr(r, name)), np.asarray(getattr(full, name)))
    with pytest.raises(ValueError, match="routing='all'"):
        resp.replay()
    with pytest.raises(ValueError, match="routing"):
        sampler(PROMPTS, routing="prompt", **kw)


_jit_logprob_pass = jax.jit(passes.logprob_pass, static_argnames=("graphdef", "replay_key"))


def _trainer_router_logp(sampler, r):
    """The trainer's old-log-prob pass (`passes.logprob_pass`) over the rollout's
    sequences, replaying the sampler's routing (R3): its experts and router
    log-probs at the response positions, int32 / f32[N, T, L, K]."""
    batch = dict(prompt_tokens=r.prompt_tokens, prompt_mask=r.prompt_mask.astype(jnp.float32),
                 tokens=r.tokens, mask=r.mask,
                 replay_r3=rollout.replay_r3(r.prompt_experts, r.experts))
    out = _jit_logprob_pass(sampler.state, batch, graphdef=sampler.graphdef,
                            replay_key="replay_r3")
    return np.asarray(out["topk_resp"]), np.asarray(out["router_logp"])


def test_router_logp_is_the_trainers_at_the_sampled_experts(sampler):
    # Without router noise the sampler's router is the trainer's: the recorded
    # router_logp is the old pass's router_logp (R3: the same experts), 0 after the stop.
    r = sampler(PROMPTS, num_samples=3, max_new_tokens=T, rng=jax.random.key(0),
                eos_id=STOPS)
    topk, want = _trainer_router_logp(sampler, r)
    valid = (np.asarray(r.mask) > 0)[..., None, None]
    assert 0 < valid.sum() < valid.size  # some rows stopped early
    np.testing.assert_array_equal(np.asarray(r.experts), np.where(valid, topk, -1))
    got = np.asarray(r.router_logp)
    assert got.shape == want.shape == (9, T, 2, 2) and got.dtype == np.float32
    np.testing.assert_allclose(got, np.where(valid, want, 0.0), atol=1e-5, rtol=0)
    assert np.all(got[np.broadcast_to(~valid, got.shape)] == 0)
    assert np.all(got[np.broadcast_to(valid, got.shape)] < 0)  # log-probs of E = 8 experts


def test_router_logp_with_router_noise_is_the_noisy_routers(sampler):
    # With router noise the record is the router the sampler routed with, not the
    # trainer's noise-free one at the same experts (tests/test_router_noise.py checks
    # it against the noisy forward itself).
    r = sampler(PROMPTS, num_samples=3, max_new_tokens=T, rng=jax.random.key(0),
                eos_id=NOISY_STOPS, router_noise_std=0.5)  # test_routing_record_...'s program
    topk, clean = _trainer_router_logp(sampler, r)
    valid = np.asarray(r.mask) > 0
    assert 0 < valid.sum() < valid.size  # some rows stopped early
    np.testing.assert_array_equal(np.asarray(r.experts)[valid], topk[valid])  # replayed
    diff = np.abs(np.asarray(r.router_logp) - clean)[valid]
    assert diff.mean() > 0.05, diff.mean()
    assert np.all(np.asarray(r.router_logp)[~valid] == 0)
