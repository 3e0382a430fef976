"""Router noise in the sampler (`Sampler(..., router_noise_std=σ)`): a controllable
sampler/trainer routing mismatch.

The trainer's reference is the model's plain teacher-forced forward over the
sampled sequences (no cache, no noise, no replay) and its free routing
(`RouterAux.free_topk_indices`).  Disagreement: the share of the sampler's
top-K choices, at the positions that produced valid response tokens (every MoE
layer), that are not in the trainer's free top-K of the same token and layer.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import decode, rollout
from gspo_jax.models import ModelConfig, Transformer

T = 8
GENERATE = "jit(_generate)"  # the sampler's compiled function, in compile_counts
PROMPTS = [[1, 2, 3], list(range(4, 15)), [7, 8, 9, 10, 11], [20, 30, 40, 50]]  # P = 11
KW = dict(num_samples=4, max_new_tokens=T, eos_id=5)  # B = 16 rows


@pytest.fixture(scope="module")
def sampler():
  # 3 layers: one dense, two MoE (L = 2, K = 2, E = 8), routing far from uniform.
  model = Transformer(ModelConfig.tiny(num_layers=3, init_std=0.3), rngs=nnx.Rngs(0))
  return rollout.Sampler.from_model(model)


def _sequence(r):
  """concat(prompt_tokens, tokens), the sampler's positions and the attention mask."""
  tokens = jnp.concatenate([r.prompt_tokens, r.tokens], axis=1)
  mask = jnp.concatenate([r.prompt_mask, r.mask > 0], axis=1)
  positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
  return tokens, positions, mask


@functools.partial(jax.jit, static_argnums=0)
def _trainer_forward(graphdef, state, tokens, positions, mask):
  logits, aux = nnx.merge(graphdef, state)(tokens, positions=positions, attn_mask=mask)
  return jax.nn.log_softmax(logits, axis=-1), aux.free_topk_indices


def _trainer(sampler, r):
  """The trainer's teacher-forced forward at the positions that produced the
  response tokens: (logp f32[N, T] of the sampled tokens, free top-K
  int[N, T, L, K]) and the free top-K of the prompt int[N, P, L, K]."""
  logp_all, topk = _trainer_forward(sampler.graphdef, sampler.state, *_sequence(r))
  P = r.prompt_tokens.shape[1]
  lp = jnp.take_along_axis(logp_all[:, P - 1:P - 1 + T], r.tokens[..., None], -1)[..., 0]
  return np.asarray(lp), np.asarray(topk[:, P - 1:P - 1 + T]), np.asarray(topk[:, :P])


def _disagreement(r, free_topk):
  """Share of the recorded top-K choices (valid response positions, all layers)
  that the trainer's free router did not make."""
  valid = np.asarray(r.mask) > 0
  rec, ref = np.asarray(r.experts)[valid], free_topk[valid]  # [M, L, K]
  return 1.0 - np.mean(np.any(rec[..., :, None] == ref[..., None, :], axis=-1))


def test_without_noise_the_record_is_the_trainers_free_routing(sampler):
  r = sampler(PROMPTS, rng=jax.random.key(0), **KW)
  _, topk, prompt_topk = _trainer(sampler, r)
  valid = (np.asarray(r.mask) > 0)[..., None, None]
  np.testing.assert_array_equal(np.asarray(r.experts), np.where(valid, topk, -1))
  prompt_valid = np.asarray(r.prompt_mask)[..., None, None]
  np.testing.assert_array_equal(np.asarray(r.prompt_experts), np.where(prompt_valid, prompt_topk, -1))
  assert _disagreement(r, topk) == 0.0


def test_disagreement_grows_with_the_noise(sampler):
  got = []
  for sigma in (0.0, 0.1, 0.3, 1.0):
    r = sampler(PROMPTS, rng=jax.random.key(0), router_noise_std=sigma, **KW)
    lp, topk, _ = _trainer(sampler, r)
    valid = np.asarray(r.mask) > 0
    got.append((_disagreement(r, topk), np.abs(lp - np.asarray(r.logp))[valid].mean()))
  d, dlogp = np.array(got).T
  assert d[0] == 0.0 and dlogp[0] < 1e-5
  assert np.all(np.diff(d) > 0), d
  assert d[1] > 0.0 and d[-1] > 0.2, d
  assert np.all(np.diff(dlogp) > 0), dlogp


def test_same_rng_and_noise_give_the_same_rollout_and_noise_does_not_recompile(
    sampler, compile_counts):
  kw = dict(rng=jax.random.key(3), router_noise_std=0.3, **KW)
  a = sampler(PROMPTS, **kw)  # compiles the noisy program (once)
  compile_counts.clear()
  b = sampler(PROMPTS, **kw)
  for name in ("tokens", "mask", "logp", "experts", "router_logp", "prompt_experts"):
    np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
  c = sampler(PROMPTS, **{**kw, "router_noise_std": 0.7})  # another σ: a traced value
  d = sampler(PROMPTS, **{**kw, "rng": jax.random.key(4)})  # another key: other noise
  assert compile_counts[GENERATE] == 0
  for other in (c, d):
    assert np.any(np.asarray(other.prompt_experts) != np.asarray(a.prompt_experts))


def test_record_is_the_noisy_forward_with_the_documented_noise(sampler):
  # Rebuild the noise from the documented keys (rollout module docstring) and
  # run the whole sequence through `decode` with it: its top-K is the record,
  # its log-probs at the sampling temperature are logp.
  sigma, temperature, prompt_ids = 0.5, 0.8, [11, 3, 7, 2]
  rng = jax.random.key(5)
  r = sampler(PROMPTS, rng=rng, router_noise_std=sigma, temperature=temperature,
              prompt_ids=prompt_ids, **KW)
  tokens, positions, mask = _sequence(r)
  n, P = r.prompt_tokens.shape
  G = KW["num_samples"]
  cfg = nnx.merge(sampler.graphdef, sampler.state).cfg
  root = jax.random.fold_in(rng, decode.NOISE_STREAM)
  pid = jnp.repeat(jnp.asarray(prompt_ids), G)
  g = jnp.tile(jnp.arange(G), len(PROMPTS))
  row_key = lambda i, s: jax.random.fold_in(jax.random.fold_in(root, i), s)
  keys = jax.vmap(row_key)(pid, g)
  prompt_keys = jax.vmap(row_key)(pid, jnp.zeros_like(g))  # the shared prefill: sample 0's

  def noise(key, p):
    return sigma * jax.random.normal(jax.random.fold_in(key, p), (cfg.num_moe_layers,
                                                                  cfg.num_experts))

  per_pos = jax.vmap(jax.vmap(noise, (None, 0)))
  z = jnp.concatenate([per_pos(prompt_keys, positions[:, :P]), per_pos(keys, positions[:, P:])],
                      axis=1)

  @jax.jit
  def forward(state, tokens, positions, mask, z):
    mdl = nnx.merge(sampler.graphdef, state)
    cache = mdl.init_cache(*tokens.shape)
    logits, aux, _ = mdl.decode(tokens, cache, positions=positions, attn_mask=mask,
                                router_noise=z)
    return logits, aux.topk_indices, aux.router_logits

  logits, topk, router_logits = forward(sampler.state, tokens, positions, mask, z)
  logits = logits[:, P - 1:P - 1 + T]
  valid = np.asarray(r.mask) > 0
  m4 = valid[..., None, None]
  np.testing.assert_array_equal(np.asarray(r.experts), np.where(m4, topk[:, P - 1:P - 1 + T], -1))
  pm4 = np.asarray(r.prompt_mask)[..., None, None]
  np.testing.assert_array_equal(np.asarray(r.prompt_experts), np.where(pm4, topk[:, :P], -1))
  want = jnp.take_along_axis(jax.nn.log_softmax(logits / temperature), r.tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(r.logp), np.where(valid, want, 0.0), atol=1e-5, rtol=0)
  # router_logp: the noisy router's log-softmax at the experts it used.
  noisy = jax.nn.log_softmax(router_logits[:, P - 1:P - 1 + T], axis=-1)
  want = np.take_along_axis(np.asarray(noisy), np.maximum(np.asarray(r.experts), 0), -1)
  np.testing.assert_allclose(np.asarray(r.router_logp), np.where(m4, want, 0.0), atol=1e-5, rtol=0)
  # ... and not the trainer's: the noise moved some choices.
  _, free_topk, _ = _trainer(sampler, r)
  assert _disagreement(r, free_topk) > 0.1


def test_a_rows_noise_does_not_depend_on_the_batch(sampler):
  kw = dict(rng=jax.random.key(6), router_noise_std=0.5, **KW)
  full = sampler(PROMPTS, **kw)
  alone = sampler(PROMPTS[1:2], prompt_ids=[1], **kw)  # prompt 1 in a batch of its own
  rows = slice(KW["num_samples"], 2 * KW["num_samples"])
  for name in ("tokens", "experts", "prompt_experts"):
    np.testing.assert_array_equal(np.asarray(getattr(alone, name)),
                                  np.asarray(getattr(full, name))[rows])
  np.testing.assert_allclose(np.asarray(alone.logp), np.asarray(full.logp)[rows], atol=1e-5)
  np.testing.assert_allclose(np.asarray(alone.router_logp), np.asarray(full.router_logp)[rows],
                             atol=1e-5)


def test_bad_router_noise_std_raises(sampler):
  for bad in (-0.1, float("nan"), float("inf"), True, "0.1", None):
    with pytest.raises(ValueError, match="router_noise_std"):
      sampler(PROMPTS, rng=jax.random.key(0), router_noise_std=bad, **KW)
