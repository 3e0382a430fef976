"""Sharded (8 fake CPU devices, (data, fsdp, expert, tensor) mesh) == single device."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

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
  # batch -> (data, fsdp, expert); data has size 1 but is still a valid factor.
  assert logical_to_mesh_spec(("batch", None), (4, 7), rules, mesh) == P(
      ("data", "fsdp", "expert"), None)
  # An axis that does not divide the rows is left out (2 rows: fsdp only).
  assert logical_to_mesh_spec(("batch", None), (2, 7), rules, mesh) == P(("data", "fsdp"), None)
  # A mesh axis is used once per array.
  rules2 = (("embed", "tensor"), ("mlp", "tensor"))
  assert logical_to_mesh_spec(("embed", "mlp"), (32, 64), rules2, mesh) == P("tensor", None)


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


def _moe_inputs(cfg, b, t, seed=0):
  rs = np.random.RandomState(seed)
  return jnp.asarray(rs.normal(size=(b, t, cfg.d_model)), jnp.float32), jnp.ones((b, t), bool)


def _moe_layer(groups, **fields):
  from gspo_jax.models.moe import MoE

  cfg = ModelConfig.tiny(moe_groups=groups, **fields)
  return nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))  # the same parameters for every group count


@pytest.mark.parametrize("backend", ["blocked", "ragged"])
def test_moe_groups_change_no_value_or_gradient(backend):
  """Dispatching each block of rows on its own is the same layer: outputs, routing
  and gradients agree with one dispatch over every token, for a group count that
  divides the rows and for one that does not (gcd: 6 rows in 4 groups -> 2)."""
  for b, groups in ((8, 4), (6, 4)):
    out = []
    for g in (groups, 1):
      graphdef, state = _moe_layer(g, moe_backend=backend)
      x, mask = _moe_inputs(ModelConfig.tiny(), b, 5)

      def loss(st, x, graphdef=graphdef, mask=mask):
        y, stats = nnx.merge(graphdef, st)(x, mask)
        return jnp.sum(jnp.sin(y)), (y, stats.topk_indices)

      # jit: one program per layer instead of one per primitive (speed only).
      out.append(jax.device_get(jax.jit(jax.value_and_grad(loss, has_aux=True))(state, x)))
    ((_, (y_g, i_g)), grads_g), ((_, (y_1, i_1)), grads_1) = out
    np.testing.assert_array_equal(i_g, i_1)
    np.testing.assert_allclose(y_g, y_1, rtol=1e-6, atol=1e-6)
    for a, c in zip(jax.tree.leaves(grads_g), jax.tree.leaves(grads_1)):
      np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["blocked", "ragged"])
def test_moe_dispatch_is_partitioned_over_the_batch_devices(backend):
  """With the rows sharded over 4 data devices and moe_groups=4, each device's
  compiled MoE layer does a quarter of the FLOPs of the same layer on one device
  (within 10%); one dispatch over all tokens (moe_groups=1) makes every device do
  all of them. (Groups add their own block padding, hence the same layer.)"""
  if jax.device_count() < 4:
    pytest.skip("needs 4 (fake) devices")
  mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))
  rows = jax.sharding.NamedSharding(mesh, P("data"))

  def flops(groups, sharded):
    graphdef, state = _moe_layer(groups, moe_backend=backend)
    x, mask = _moe_inputs(ModelConfig.tiny(), 16, 32)
    if sharded:
      x, mask = jax.device_put((x, mask), rows)
    fn = jax.jit(lambda st, x, mask: nnx.merge(graphdef, st)(x, mask)[0])
    # Traced on the mesh, as the trainer and the sampler trace: the ragged dispatch
    # takes its groups from the mesh (a shard_map), the blocked one from moe_groups.
    with jax.set_mesh(mesh) if sharded else contextlib.nullcontext():
      cost = fn.lower(state, x, mask).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]

  # One device's layer: for ragged, one dispatch (its groups run in a loop, which
  # the cost analysis counts once).
  one_device = flops(4 if backend == "blocked" else 1, sharded=False)
  assert flops(4, sharded=True) / one_device == pytest.approx(0.25, rel=0.1)
  if backend == "blocked":
    assert flops(1, sharded=True) / flops(1, sharded=False) > 0.9  # what the groups are for
