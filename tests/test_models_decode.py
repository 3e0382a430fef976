"""KV-cache decoding paths of `Transformer.decode` beyond the scanned default:
unrolled and rematerialised layer stacks, `last_only`, cache validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax.models import ModelConfig, Transformer, layers

V = 97


def _model(**kw):
  return Transformer(ModelConfig.tiny(**kw), rngs=nnx.Rngs(0))


def _inputs():
  rs = np.random.RandomState(3)
  tokens = jnp.asarray(rs.randint(0, V, (2, 9)), jnp.int32)
  mask = np.ones((2, 9), np.int32)
  mask[1, :3] = 0  # left padding
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, jnp.asarray(mask), jnp.asarray(pos)


def _decode_all(model, tokens, mask, pos, prompt, *, last_only=False):
  """Prefill `prompt` tokens, then one token per step: (prefill logits,
  step logits [B, T - prompt, V], final cache)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state):
    mdl = nnx.merge(graphdef, state)
    cache = mdl.init_cache(tokens.shape[0], tokens.shape[1] + 2)
    l0, _, cache = mdl.decode(tokens[:, :prompt], cache, positions=pos[:, :prompt],
                              attn_mask=mask[:, :prompt], last_only=last_only)

    def body(cache, xs):
      tok, p = xs
      lg, _, cache = mdl.decode(tok[:, None], cache, positions=p[:, None])
      return cache, lg[:, 0]
    cache, ls = jax.lax.scan(body, cache, (tokens[:, prompt:].T, pos[:, prompt:].T))
    return l0, ls.swapaxes(0, 1), cache
  return run(state)


@pytest.mark.parametrize("overrides", [dict(scan_layers=False), dict(remat_policy="full")],
                         ids=["unrolled", "remat"])
def test_decode_equals_full_forward(overrides):
  # Unrolled layers index the per-layer caches with Python ints, scanned ones
  # through lax.switch; a wrong layer's cache would change every logit.
  model = _model(**overrides)
  tokens, mask, pos = _inputs()
  want, _ = jax.jit(lambda t, p, m: model(t, positions=p, attn_mask=m))(tokens, pos, mask)
  l0, ls, cache = _decode_all(model, tokens, mask, pos, prompt=5)
  got = np.concatenate([np.asarray(l0), np.asarray(ls)], axis=1)
  m = np.asarray(mask, bool)
  np.testing.assert_allclose(got[m], np.asarray(want)[m], atol=1e-5)
  assert int(cache.index) == 9
  np.testing.assert_array_equal(np.asarray(cache.valid[:, :9]), m)


@pytest.mark.parametrize("overrides", [dict(), dict(scan_layers=False)], ids=["scan", "unrolled"])
def test_fused_cached_attention_equals_the_einsums(monkeypatch, overrides):
  """The KV-cache path of a fused kernel (cuDNN on a GPU; here jax.nn's 'xla'
  implementation of the same call): cache in [B, S, KV, hd], the cache and the new
  tokens merged by their log-sum-exps. Same logits as the full forward and the same
  cache contents as the einsum path's, transposed."""
  model = _model(**overrides)
  tokens, mask, pos = _inputs()
  want, _ = jax.jit(lambda t, p, m: model(t, positions=p, attn_mask=m))(tokens, pos, mask)
  l0_e, ls_e, cache_e = _decode_all(model, tokens, mask, pos, prompt=5)
  monkeypatch.setattr(layers, "fused_cached_attention", lambda cfg: True)
  l0, ls, cache = _decode_all(model, tokens, mask, pos, prompt=5)
  cfg = model.cfg
  assert cache.k[0].shape == cache.v[0].shape == (2, 11, cfg.num_kv_heads, cfg.head_dim)
  got = np.concatenate([np.asarray(l0), np.asarray(ls)], axis=1)
  m = np.asarray(mask, bool)
  np.testing.assert_allclose(got[m], np.asarray(want)[m], atol=1e-5)
  einsum = np.concatenate([np.asarray(l0_e), np.asarray(ls_e)], axis=1)
  assert np.abs(got[m] - einsum[m]).max() > 0  # not the einsum path run twice
  # Layer 0's keys and values come before any attention: bitwise the same. Later
  # layers' differ by the attention's rounding at real tokens (the padding tokens'
  # queries see no key; the two paths average different nothing there).
  valid = np.asarray(cache.valid)
  np.testing.assert_array_equal(valid, np.asarray(cache_e.valid))
  for layer, (k_f, v_f, k_e, v_e) in enumerate(zip(cache.k, cache.v, cache_e.k, cache_e.v)):
    k_e, v_e = np.asarray(k_e).transpose(0, 3, 1, 2), np.asarray(v_e).transpose(0, 2, 1, 3)
    if layer == 0:
      np.testing.assert_array_equal(np.asarray(k_f), k_e)
      np.testing.assert_array_equal(np.asarray(v_f), v_e)
    np.testing.assert_allclose(np.asarray(k_f)[valid], k_e[valid], atol=1e-5)
    np.testing.assert_allclose(np.asarray(v_f)[valid], v_e[valid], atol=1e-5)
  with pytest.raises(ValueError, match=r"cache\.k: expected .* \[B, S, KV, hd\]"):
    model.decode(tokens[:, :1], cache_e, positions=pos[:, :1])


def test_last_only_is_the_last_column():
  model = _model()
  tokens, mask, pos = _inputs()
  # prompt=5: the first program is test_fused_cached_attention_equals_the_einsums[scan]'s
  # einsum run (a compilation cache hit).
  l_all, ls_all, c_all = _decode_all(model, tokens, mask, pos, prompt=5)
  l_last, ls_last, c_last = _decode_all(model, tokens, mask, pos, prompt=5, last_only=True)
  assert l_last.shape == (2, 1, V)
  np.testing.assert_array_equal(np.asarray(l_last[:, 0]), np.asarray(l_all[:, -1]))
  np.testing.assert_array_equal(np.asarray(ls_last), np.asarray(ls_all))
  for a, b in zip(jax.tree.leaves(c_last), jax.tree.leaves(c_all)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cache_layout_is_checked():
  model = _model()
  cache = model.init_cache(2, 8)
  cfg = model.cfg
  assert len(cache.k) == len(cache.v) == cfg.num_layers
  assert cache.k[0].shape == (2, cfg.num_kv_heads, cfg.head_dim, 8)  # keys transposed
  assert cache.v[0].shape == (2, cfg.num_kv_heads, 8, cfg.head_dim)
  toks = jnp.zeros((2, 1), jnp.int32)
  pos = jnp.zeros((2, 1), jnp.int32)
  stacked = cache.replace(k=jnp.stack(cache.k))  # a stacked [L, ...] array
  with pytest.raises(ValueError, match=r"cache\.k"):
    model.decode(toks, stacked, positions=pos)
  untransposed = cache.replace(k=cache.v)  # keys in the values' [B, KV, S, hd] layout
  with pytest.raises(ValueError, match=r"cache\.k: expected .* \[B, KV, hd, S\]"):
    model.decode(toks, untransposed, positions=pos)
  with pytest.raises(ValueError, match=r"cache\.v"):
    model.decode(toks, cache.replace(v=cache.v[:-1]), positions=pos)


def test_router_noise_is_added_to_the_router_logits():
  # Zero noise is no noise (bit for bit); noise enters every MoE layer's logits
  # before top-K: the first MoE layer's logits are the clean ones plus the noise
  # (its input does not depend on the noise), and the top-K is theirs.
  model = _model()
  cfg = model.cfg
  tokens, mask, pos = _inputs()
  graphdef, state = nnx.split(model)
  shape = tokens.shape + (cfg.num_moe_layers, cfg.num_experts)
  noise = 2.0 * jax.random.normal(jax.random.key(0), shape)

  @jax.jit
  def prefill(state, noise):
    mdl = nnx.merge(graphdef, state)
    cache = mdl.init_cache(*tokens.shape)
    logits, aux, _ = mdl.decode(tokens, cache, positions=pos, attn_mask=mask, router_noise=noise)
    return logits, aux

  clean, aux = prefill(state, None)
  zero, aux0 = prefill(state, jnp.zeros(shape))
  for a, b in zip(jax.tree.leaves((clean, aux)), jax.tree.leaves((zero, aux0))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  noisy, aux_n = prefill(state, noise)
  np.testing.assert_allclose(aux_n.router_logits[:, :, 0],
                             aux.router_logits[:, :, 0] + noise[:, :, 0], atol=1e-6)
  want = jax.lax.top_k(aux_n.router_logits, cfg.top_k)[1]
  np.testing.assert_array_equal(aux_n.topk_indices, want)
  np.testing.assert_array_equal(aux_n.free_topk_indices, want)
  m = np.asarray(mask, bool)
  flipped = np.any(np.asarray(aux_n.topk_indices) != np.asarray(aux.topk_indices), axis=(-2, -1))
  assert flipped[m].mean() > 0.5
  assert float(jnp.max(jnp.abs(noisy - clean))) > 1e-3
  with pytest.raises(ValueError, match="router_noise"):
    model.decode(tokens, model.init_cache(*tokens.shape), positions=pos,
                 router_noise=jnp.zeros(shape[:-1] + (cfg.num_experts + 1,)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_into_an_empty_cache_skips_its_slots(dtype):
  """decode(prefill=True) attends among the new tokens only: the same logits and the
  same cached keys and values at every real token as attending to the empty slots too
  (they get probability 0), bitwise; and a cache that holds tokens is refused."""
  model = _model(dtype=dtype)
  tokens, mask, pos = _inputs()
  graphdef, state = nnx.split(model)

  def prefill(flag):
    @jax.jit
    def run(state):
      mdl = nnx.merge(graphdef, state)
      cache = mdl.init_cache(tokens.shape[0], tokens.shape[1] + 6)
      return mdl.decode(tokens, cache, positions=pos, attn_mask=mask, prefill=flag)
    return run(state)

  (l_all, aux_all, c_all), (l_new, aux_new, c_new) = prefill(False), prefill(True)
  m = np.asarray(mask, bool)
  np.testing.assert_array_equal(np.asarray(l_new)[m], np.asarray(l_all)[m])
  np.testing.assert_array_equal(np.asarray(aux_new.topk_indices)[m],
                                np.asarray(aux_all.topk_indices)[m])
  for a, b in zip(c_new.v + c_new.k, c_all.v + c_all.k):  # [B, KV, S, hd] / [B, KV, hd, S]
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    slots = np.zeros(c_all.valid.shape, bool)
    slots[:, : tokens.shape[1]] = m
    if a.shape[2] == slots.shape[1]:  # values: slots on axis 2
      np.testing.assert_array_equal(a.transpose(0, 2, 1, 3)[slots], b.transpose(0, 2, 1, 3)[slots])
    else:  # keys: slots on axis 3
      np.testing.assert_array_equal(a.transpose(0, 3, 1, 2)[slots], b.transpose(0, 3, 1, 2)[slots])
  # c_all holds the 9 tokens just prefilled, 6 slots free (a cache filled eagerly here
  # would compile the forward op by op).
  with pytest.raises(ValueError, match="already holds 9 tokens"):
    model.decode(tokens[:, :6], c_all, positions=pos[:, :6], attn_mask=mask[:, :6], prefill=True)
