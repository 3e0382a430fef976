"""Sharded (8 fake CPU devices, (data, fsdp, expert, tensor) mesh) == single device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from gspo_jax.models import ModelConfig, init_sharded, logical_to_mesh_spec, param_shardings
from gspo_jax.models.sharding import batch_sharding


def _mesh(shape):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  devices = np.asarray(jax.devices()[:8]).reshape(shape)
  return Mesh(devices, ("data", "fsdp", "expert", "tensor"))


def test_logical_to_mesh_spec_rules():
  mesh = _mesh((1, 2, 2, 2))
  rules = ModelConfig.tiny().axis_rules
  assert logical_to_mesh_spec(("expert", "embed", "mlp"), (8, 32, 24), rules, mesh) == P(
      "expert", "fsdp", "tensor")
  # 97 is not divisible by tensor=2: replicated instead.
  assert logical_to_mesh_spec(("vocab", "embed"), (97, 32), rules, mesh) == P(None, "fsdp")
  # batch -> (data, fsdp); data has size 1 but is still a valid factor.
  assert logical_to_mesh_spec(("batch", None), (4, 7), rules, mesh) == P(("data", "fsdp"), None)
  # A mesh axis is used once per array.
  rules2 = (("embed", "tensor"), ("mlp", "tensor"))
  assert logical_to_mesh_spec(("embed", "mlp"), (32, 64), rules2, mesh) == P("tensor", None)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(1, 2, 2, 2), (2, 1, 2, 2)])
def test_sharded_forward_and_grads_match_single_device(mesh_shape):
  mesh = _mesh(mesh_shape)
  cfg = ModelConfig.tiny()
  model = init_sharded(cfg, mesh, seed=0)
  # Parameters are created in their shardings.
  spec = model.segments[1].blocks[0].mlp.gate[...].sharding.spec
  assert spec == P(None, "expert", "fsdp", "tensor")  # leading axis: stacked layers

  rs = np.random.RandomState(0)
  tokens = rs.randint(0, cfg.vocab_size, (4, 10)).astype(np.int32)
  mask = np.ones((4, 10), np.int32)
  mask[1, :3] = 0
  pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
  graphdef, state = nnx.split(model)

  def loss_fn(st, tokens, mask, pos):
    m = nnx.merge(graphdef, st)
    lp, ent, aux = m.token_logprobs(tokens, jnp.roll(tokens, -1, 1), positions=pos,
                                    attn_mask=mask, chunk_size=4)
    return jnp.sum(lp * mask) / jnp.sum(mask) + 0.01 * aux.aux_loss + 1e-3 * aux.z_loss, (
        lp, aux.topk_indices)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  bs = batch_sharding(mesh, cfg, 2, 4)
  sharded = jax.jit(grad_fn, in_shardings=(param_shardings(state, mesh, cfg), bs, bs, bs))
  (l_s, (lp_s, idx_s)), g_s = sharded(state, tokens, mask, pos)

  cpu = jax.devices()[0]
  state1 = jax.device_put(jax.device_get(state), cpu)
  (l_1, (lp_1, idx_1)), g_1 = jax.jit(grad_fn)(state1, tokens, mask, pos)

  np.testing.assert_allclose(l_s, l_1, rtol=1e-5)
  np.testing.assert_allclose(lp_s, lp_1, atol=1e-5)
  np.testing.assert_array_equal(idx_s, idx_1)
  for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)
