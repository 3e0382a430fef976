"""Model core: MoE dispatch backends, replay, token log-probs, KV cache, layer plan."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax.models import ModelConfig, Transformer
from gspo_jax.models import dispatch
from gspo_jax.models.blocks import plan_segments

V = 97


def _model(**kw):
  return Transformer(ModelConfig.tiny(**kw), rngs=nnx.Rngs(0))


def _tokens(b=2, t=12, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(0, V, (b, t)), jnp.int32)


def _left_pad_mask():
  mask = np.ones((3, 12), np.int32)
  mask[0, :4] = 0
  mask[2, :1] = 0
  mask = jnp.asarray(mask)
  pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
  return mask, pos


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jit_method(graphdef, method, static, state, args, arrays):
  return getattr(nnx.merge(graphdef, state), method)(*args, **arrays, **dict(static))


def _fwd(model, method="__call__", *args, **kw):
  """Jitted `getattr(model, method)(*args, **kw)` (eager op-by-op is slow); one
  module-level jit, so a call repeated with the same structure and shapes is not
  traced again."""
  graphdef, state = nnx.split(model)
  static = tuple(sorted((k, v) for k, v in kw.items() if v is None or isinstance(v, (int, float))))
  arrays = {k: v for k, v in kw.items() if k not in dict(static)}
  return _jit_method(graphdef, method, static, state, args, arrays)


def _value_and_grad(model, loss, has_aux=False):
  """Jitted value_and_grad of loss(model) w.r.t. the model's state."""
  graphdef, state = nnx.split(model)
  f = jax.jit(jax.value_and_grad(lambda st: loss(nnx.merge(graphdef, st)), has_aux=has_aux))
  return f(state)


def _max_tree_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ------------------------------------------------------------------ dispatch
_BLOCKED = functools.partial(dispatch.dispatch_blocked, max_block=64)
# Module-level, so that both parametrised cases run the same compiled programs (the
# expert indices are an argument, not a constant of the program).
DISPATCH_BACKENDS = [
    dispatch.dispatch_ragged,
    _BLOCKED,  # small-batch rule
    functools.partial(_BLOCKED, block_size=4),
    functools.partial(_BLOCKED, block_size=16),
    functools.partial(_BLOCKED, block_size=64),
    # both ways of ordering assignments within an expert
    functools.partial(_BLOCKED, block_size=4, rank="sort"),
    functools.partial(_BLOCKED, block_size=4, rank="compare"),
    # both backwards of the per-block weight gather (CPU's default: scatter)
    functools.partial(_BLOCKED, block_size=4, weight_grad="matmul"),
    functools.partial(_BLOCKED, weight_grad="matmul"),
]


@functools.partial(jax.jit, static_argnums=0)
def _dispatch_grad(fn, x, idx, gates, ws):
  """Gradient of sum(sin(y)) w.r.t. (x, gates, ws) and y = fn(x, idx, gates, *ws)."""
  def loss(x, gates, ws):
    y = fn(x, idx, gates, *ws)
    return jnp.sum(jnp.sin(y)), y

  return jax.grad(loss, (0, 1, 2), has_aux=True)(x, gates, ws)


@pytest.mark.parametrize("skew", [False, True])
def test_dispatch_backends_equal_dense_values_and_grads(skew):
  rs = np.random.RandomState(1)
  n, d, f, e, k = 40, 8, 6, 8, 2
  x = jnp.asarray(rs.randn(n, d), jnp.float32)
  if skew:  # every token on experts {0, 1}: groups far larger than a block
    idx = np.stack([np.zeros(n), np.ones(n)], 1).astype(np.int32)
  else:
    idx = np.stack([rs.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
  idx = jnp.asarray(idx)
  gates = jnp.asarray(rs.rand(n, k), jnp.float32)
  ws = [jnp.asarray(rs.randn(*s) * 0.3, jnp.float32) for s in [(e, d, f), (e, d, f), (e, f, d)]]

  ref_g, ref_y = _dispatch_grad(dispatch.dispatch_dense, x, idx, gates, ws)
  for fn in DISPATCH_BACKENDS:
    g, y = _dispatch_grad(fn, x, idx, gates, ws)
    np.testing.assert_allclose(y, ref_y, atol=1e-5, rtol=1e-5)
    assert _max_tree_diff(g, ref_g) < 1e-5


def test_block_size_shrinks_for_few_rows():
  assert dispatch.block_size_for(16384 * 2, 8, 64) == 64
  assert dispatch.block_size_for(8192, 64, 64) == 64  # padding 64 * 63 <= 8192 / 2
  assert dispatch.block_size_for(4096, 64, 64) == 32
  assert dispatch.block_size_for(128, 64, 64) == 2  # decode step: padding 64 <= 128 / 2
  assert dispatch.block_size_for(3, 64, 64) == 1
  # A decode step at batch 64, 8 experts top-2: padding 8 * 7 <= 128 / 2, and
  # with the small-batch bound 8 * 15 <= 128.
  assert dispatch.block_size_for(128, 8, 64) == 8
  assert dispatch.block_size_for(128, 8, 64, dispatch.SMALL_BATCH_MAX_PADDING) == 16
  assert dispatch.block_size_for(128, 8, 8, dispatch.SMALL_BATCH_MAX_PADDING) == 8  # max_block


@functools.lru_cache(maxsize=None)
def _backend_loss_and_grad(backend):
  """Loss (masked token log-probs + router losses) and its gradient, per backend."""
  mask, pos = _left_pad_mask()
  tokens = _tokens(3)

  def loss(model):
    lp, _, aux = model.token_logprobs(tokens, jnp.roll(tokens, -1, 1), positions=pos,
                                      attn_mask=mask)
    return jnp.sum(lp * mask) + aux.aux_loss + aux.z_loss, aux

  return _value_and_grad(_model(moe_backend=backend), loss, has_aux=True)


@pytest.mark.parametrize("backend", ["ragged", "blocked"])
def test_model_backends_equal_dense(backend):
  (l_ref, aux_ref), g_ref = _backend_loss_and_grad("dense")
  (l, aux), g = _backend_loss_and_grad(backend)
  np.testing.assert_allclose(l, l_ref, rtol=1e-5)
  np.testing.assert_array_equal(aux.topk_indices, aux_ref.topk_indices)
  assert _max_tree_diff(g, g_ref) < 1e-5
  # The router receives gradient through the gates.
  router_grad = g["segments"][1]["blocks"][0]["mlp"]["router"][...]
  assert float(jnp.max(jnp.abs(router_grad))) > 0


# ------------------------------------------------------------------ outputs
def test_router_aux_shapes_and_hand_values():
  model = _model()
  # Zero router weights: uniform probabilities 1/E, so z = logsumexp(0) = log E
  # and the top-K ties pick experts 0..K-1 -> load 1/K there, aux = 1.
  for seg in model.segments:
    for blk in seg.blocks:
      if blk.is_moe:
        blk.mlp.router.set_value(jnp.zeros_like(blk.mlp.router[...]))
  tokens = _tokens()
  logits, aux = _fwd(model, "__call__", tokens)
  cfg = model.cfg
  assert logits.shape == (2, 12, V) and logits.dtype == jnp.float32
  assert aux.router_logits.shape == (2, 12, 3, 8)
  assert aux.topk_indices.shape == (2, 12, 3, 2) and aux.topk_indices.dtype == jnp.int32
  assert aux.free_topk_indices.dtype == jnp.int32
  np.testing.assert_array_equal(aux.free_topk_indices, aux.topk_indices)  # no replay
  np.testing.assert_allclose(aux.z_loss, np.log(8.0) ** 2, rtol=1e-6)
  np.testing.assert_allclose(aux.aux_loss, 1.0, rtol=1e-6)
  np.testing.assert_allclose(aux.topk_weights, 0.5, rtol=1e-6)  # renormalised 1/8, 1/8
  np.testing.assert_allclose(aux.expert_load[:, :2], 0.5)
  np.testing.assert_allclose(aux.replay_mismatch, 0.0)
  assert cfg.num_moe_layers == 3


def test_dense_model_router_aux_is_empty():
  model = _model(num_experts=0)
  _, aux = _fwd(model, "__call__", _tokens())
  for x in (aux.topk_indices, aux.free_topk_indices):
    assert x.shape == (2, 12, 0, model.cfg.top_k) and x.dtype == jnp.int32
  assert aux.router_logits.shape == (2, 12, 0, 0) and aux.expert_load.shape == (0, 0)


def test_padding_tokens_do_not_change_real_tokens():
  model = _model()
  mask, pos = _left_pad_mask()
  t1 = _tokens(3, seed=1)
  t2 = jnp.where(mask == 0, (t1 + 5) % V, t1)
  l1, a1 = _fwd(model, "__call__", t1, positions=pos, attn_mask=mask)
  l2, a2 = _fwd(model, "__call__", t2, positions=pos, attn_mask=mask)
  m = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(l1)[m], np.asarray(l2)[m], atol=1e-6)
  np.testing.assert_allclose(a1.aux_loss, a2.aux_loss, rtol=1e-6)
  np.testing.assert_allclose(a1.expert_load, a2.expert_load, rtol=1e-6)


@pytest.mark.parametrize("chunk", [None, 5, 64])
def test_token_logprobs_match_full_logits(chunk):
  model = _model(tie_embeddings=True)
  tokens = _tokens()
  targets = jnp.roll(tokens, -1, axis=1)
  logits, _ = _fwd(model, "__call__", tokens)
  logz = jax.nn.log_softmax(logits)
  ref_lp = jnp.take_along_axis(logz, targets[..., None], -1)[..., 0]
  ref_ent = -jnp.sum(jnp.exp(logz) * logz, -1)
  lp, ent, _ = _fwd(model, "token_logprobs", tokens, targets, chunk_size=chunk)
  np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
  # A temperature divides the logits (the sampler's tempered distribution).
  logz_t = jax.nn.log_softmax(logits / 0.7)
  lp_t, ent_t, _ = _fwd(model, "token_logprobs", tokens, targets, chunk_size=chunk,
                        temperature=0.7)
  np.testing.assert_allclose(lp_t, jnp.take_along_axis(logz_t, targets[..., None], -1)[..., 0],
                             atol=1e-5)
  np.testing.assert_allclose(ent_t, -jnp.sum(jnp.exp(logz_t) * logz_t, -1), atol=1e-5)
  assert float(jnp.max(jnp.abs(lp_t - lp))) > 1e-2
  if chunk != 5:
    return  # gradients: checked once, with a chunk that does not divide T

  def via_full(m):
    lg, _ = m(tokens)
    return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(lg), targets[..., None], -1))

  def via_chunks(m):
    return jnp.sum(m.token_logprobs(tokens, targets, chunk_size=chunk)[0])

  _, g1 = _value_and_grad(model, via_full)
  _, g2 = _value_and_grad(model, via_chunks)
  assert _max_tree_diff(g1, g2) < 1e-5


def test_temperature_one_is_bitwise_the_default_and_bad_values_raise():
  model = _model()
  tokens = _tokens()
  targets = jnp.roll(tokens, -1, axis=1)
  lp, ent, _ = _fwd(model, "token_logprobs", tokens, targets)
  lp1, ent1, _ = _fwd(model, "token_logprobs", tokens, targets, temperature=1.0)
  np.testing.assert_array_equal(lp1, lp)
  np.testing.assert_array_equal(ent1, ent)
  h, _ = _fwd(model, "hidden", tokens)
  for bad in (0.0, -0.5, float("nan"), float("inf"), True, jnp.float32(0.7)):
    with pytest.raises(ValueError, match="temperature"):
      model.token_logprobs(tokens, targets, temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
      model.logprobs_from_hidden(h, targets, temperature=bad)


def test_value_head_and_errors():
  model = _model(value_head=True)
  h, _ = _fwd(model, "hidden", _tokens())
  assert model.value(h).shape == (2, 12)
  with pytest.raises(ValueError, match="value_head"):
    _model().value(h)
  with pytest.raises(ValueError, match="replay"):
    model(_tokens(), replay=jnp.zeros((2, 12, 2, 2), jnp.int32))
  with pytest.raises(ValueError, match="replay"):
    model(_tokens(), replay=jnp.full((2, 12, 3, 2), 8, jnp.int32))
  with pytest.raises(ValueError, match="attn_mask"):
    model(_tokens(), attn_mask=jnp.ones((2, 11), jnp.int32))
  with pytest.raises(ValueError, match="targets"):
    model.token_logprobs(_tokens(), jnp.full((2, 12), V, jnp.int32))


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig.tiny(num_kv_heads=3)
  with pytest.raises(ValueError, match="top_k"):
    ModelConfig.tiny(top_k=9)
  with pytest.raises(ValueError, match="moe_backend"):
    ModelConfig.tiny(moe_backend="capacity")
  with pytest.raises(ValueError, match="axis_rules"):
    ModelConfig.tiny(axis_rules=(("embed", "model"),))


# ------------------------------------------------------------------ replay
def test_replay_own_choices_equals_free_forward():
  model = _model()
  tokens = _tokens()
  logits, aux = _fwd(model, "__call__", tokens)
  logits2, aux2 = _fwd(model, "__call__", tokens, replay=aux.topk_indices)
  np.testing.assert_allclose(logits2, logits, atol=1e-6)
  np.testing.assert_array_equal(aux2.topk_indices, aux.topk_indices)
  np.testing.assert_allclose(aux2.replay_mismatch, 0.0)
  # All -1: free.
  logits3, aux3 = _fwd(model, "__call__", tokens, replay=jnp.full_like(aux.topk_indices, -1))
  np.testing.assert_allclose(logits3, logits, atol=1e-6)


def test_replay_other_experts_changes_output_and_router_gets_gradient():
  model = _model()
  tokens = _tokens()
  logits, aux = _fwd(model, "__call__", tokens)
  e = model.cfg.num_experts
  other = (aux.topk_indices + 3) % e  # mostly, not always, outside the free top-K
  # Replay only layer 0 of the MoE layers (other layers free: -1).
  replay = jnp.full_like(aux.topk_indices, -1).at[:, :, 0].set(other[:, :, 0])
  logits_r, aux_r = _fwd(model, "__call__", tokens, replay=replay)
  assert float(jnp.max(jnp.abs(logits_r - logits))) > 1e-3
  np.testing.assert_array_equal(aux_r.topk_indices[:, :, 0], other[:, :, 0])
  own = np.asarray(aux.topk_indices[:, :, 0]).reshape(-1, 2)
  forced = np.asarray(other[:, :, 0]).reshape(-1, 2)
  expected = np.mean([[f not in o for f in fr] for o, fr in zip(own, forced)])
  assert expected > 0.5
  np.testing.assert_allclose(aux_r.replay_mismatch[0], expected, rtol=1e-6)
  np.testing.assert_allclose(aux_r.replay_mismatch[1:], 0.0)

  def loss(m):
    lg, _ = m(tokens, replay=replay)
    return jnp.sum(jax.nn.log_softmax(lg)[..., 0])

  _, g = _value_and_grad(model, loss)
  assert float(jnp.max(jnp.abs(g["segments"][1]["blocks"][0]["mlp"]["router"][...][0]))) > 0


def test_load_balancing_loss_counts_the_free_router_under_replay():
  # One MoE layer (dense, then MoE): a replay there changes nothing upstream of
  # its router, so its free choices, load and aux_loss are the free forward's,
  # while the experts used are the replayed ones.
  model = _model(num_layers=2)
  assert model.cfg.num_moe_layers == 1
  mask, pos = _left_pad_mask()
  tokens = _tokens(3, seed=4)
  _, aux = _fwd(model, "__call__", tokens, positions=pos, attn_mask=mask)
  other = (aux.topk_indices + 3) % model.cfg.num_experts
  _, aux_r = _fwd(model, "__call__", tokens, positions=pos, attn_mask=mask, replay=other)
  assert float(aux_r.replay_mismatch[0]) > 0.5
  np.testing.assert_array_equal(aux_r.topk_indices, other)
  np.testing.assert_array_equal(aux_r.free_topk_indices, aux.topk_indices)
  np.testing.assert_allclose(aux_r.expert_load, aux.expert_load, rtol=1e-6)
  np.testing.assert_allclose(aux_r.aux_loss, aux.aux_loss, rtol=1e-6)
  # The replayed assignment's load is another one (what the loss used to count).
  m = np.asarray(mask, bool)
  replayed = np.bincount(np.asarray(other)[m].ravel(), minlength=8) / (2 * m.sum())
  assert np.abs(replayed - np.asarray(aux.expert_load[0])).max() > 0.05


# ------------------------------------------------------------------ layers
def test_plan_segments():
  D, M = False, True
  assert plan_segments((D, M, M, M)) == [((D,), 1), ((M,), 3)]
  assert plan_segments((D, M) * 3) == [((D, M), 3)]
  assert plan_segments((M, M, D, M, M)) == [((M,), 2), ((D,), 1), ((M,), 2)]
  assert plan_segments((D,) * 4) == [((D,), 4)]


def test_moe_layer_spec_matches_qwen_rules():
  cfg = ModelConfig.tiny(num_layers=6, first_dense_layers=0, moe_every=2, dense_layers=(3,))
  assert cfg.layer_kinds == (False, True, False, False, False, True)


def test_scan_unrolled_and_remat_agree():
  tokens = _tokens()
  kw = dict(num_layers=4, first_dense_layers=0, moe_every=2)  # plan: (D, M) x 2

  def loss(m):
    lg, aux = m(tokens)
    return jnp.mean(jax.nn.log_softmax(lg)[..., 3]) + aux.z_loss

  l0, g0 = _value_and_grad(_model(**kw), loss)
  for overrides in [dict(scan_layers=False, remat_policy="dots"), dict(remat_policy="full")]:
    l1, g1 = _value_and_grad(_model(**kw, **overrides), loss)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)  # f32 reassociation only (~5e-7 seen)
    assert _max_tree_diff(g0, g1) < 1e-6


def test_bf16_compute_with_f32_params():
  tokens = _tokens()
  m32 = _model()
  m16 = _model(dtype="bfloat16")
  assert m16.embed[...].dtype == jnp.float32
  l32, _ = _fwd(m32, "__call__", tokens)
  l16, _ = _fwd(m16, "__call__", tokens)
  assert l16.dtype == jnp.float32
  # bf16 rounding only: logits of this tiny model are O(0.1).
  assert float(jnp.max(jnp.abs(l16 - l32))) < 2e-2


# ------------------------------------------------------------------ KV cache
@pytest.mark.parametrize("backend", ["blocked", "dense"])
def test_kv_cache_decode_equals_full_forward_left_padded(backend):
  model = _model(moe_backend=backend)
  mask, pos = _left_pad_mask()
  tokens = _tokens(3, seed=2)
  logits, aux = _fwd(model, "__call__", tokens, positions=pos, attn_mask=mask)
  prompt = 7
  graphdef, state = nnx.split(model)

  @jax.jit
  def prefill(state, toks, p, m):
    mdl = nnx.merge(graphdef, state)
    return mdl.decode(toks, mdl.init_cache(3, 16), positions=p, attn_mask=m)

  @jax.jit
  def steps(state, cache, toks, p):
    mdl = nnx.merge(graphdef, state)

    def body(cache, xs):
      tok, pp = xs
      lg, ax, cache = mdl.decode(tok[:, None], cache, positions=pp[:, None])
      return cache, (lg[:, 0], ax.topk_indices[:, 0])
    return jax.lax.scan(body, cache, (toks.T, p.T))

  l0, a0, cache = prefill(state, tokens[:, :prompt], pos[:, :prompt], mask[:, :prompt])
  cache, (l1, idx1) = steps(state, cache, tokens[:, prompt:], pos[:, prompt:])
  got = jnp.concatenate([l0, l1.swapaxes(0, 1)], axis=1)
  got_idx = jnp.concatenate([a0.topk_indices, idx1.swapaxes(0, 1)], axis=1)
  m = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(got)[m], np.asarray(logits)[m], atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got_idx)[m], np.asarray(aux.topk_indices)[m])
  assert int(cache.index) == 12
  np.testing.assert_array_equal(cache.valid[:, :12], m)
  assert not bool(jnp.any(cache.valid[:, 12:]))


def test_decode_rejects_overflow():
  model = _model()
  cache = model.init_cache(2, 4)
  with pytest.raises(ValueError, match="max_len"):
    model.decode(_tokens(2, 5), cache, positions=jnp.zeros((2, 5), jnp.int32))
