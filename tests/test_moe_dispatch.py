"""The MoE dispatches against the dense reference, in values and gradients: with
replay and router noise, at ragged group sizes with empty experts, on one device
and on 8 CPU devices (batch groups, expert parallelism, tensor parallelism); and
what the ragged dispatch compiles to for an H200."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.models import ModelConfig
from gspo_jax.models import dispatch
from gspo_jax.models.moe import MoE
from gspo_jax.models.sharding import param_shardings

AXES = ("data", "fsdp", "expert", "tensor")


def _max_diff(a, b):
    # On the host: jnp ops on (sharded) arrays would compile a program per op and shape.
    a, b = jax.device_get((a, b))
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def test_take_expert_blocks_backward_is_the_gathers_gradient():
    """The matmul backward of the per-block weight gather equals autodiff's
    scatter-add, with blocks that repeat an expert and experts no block takes."""
    rs = np.random.RandomState(0)
    w = jnp.asarray(rs.randn(6, 5, 4), jnp.float32)
    block_e = jnp.asarray([0, 0, 3, 3, 3, 5, 1], jnp.int32)  # experts 2 and 4: none
    dy = jnp.asarray(rs.randn(7, 5, 4), jnp.float32)

    def vjp(f):  # jitted: one program instead of one per primitive (speed only)
        return np.asarray(jax.jit(lambda w, dy: jax.vjp(f, w)[1](dy)[0])(w, dy))

    ours = vjp(lambda w: dispatch.take_expert_blocks(w, block_e))
    plain = vjp(lambda w: w[block_e])
    np.testing.assert_allclose(ours, plain, rtol=1e-6, atol=1e-6)
    assert float(np.max(np.abs(ours[2]))) == 0.0 and float(np.max(np.abs(ours[4]))) == 0.0


def _routing(b, t, cfg, seed):
    """Replay that sends most rows to experts {0, 1} (large groups), a few rows
    free (-1), and router noise that keeps the last expert out of every free
    choice (so it is empty): the cases a dispatch must get right besides uniform
    routing."""
    rs = np.random.RandomState(seed)
    k, e = cfg.top_k, cfg.num_experts
    replay = np.tile(np.arange(k, dtype=np.int32), (b, t, 1))
    free = rs.rand(b, t) < 0.2
    replay[free] = -1
    some = rs.rand(b, t) < 0.1  # a few replayed rows on other experts
    replay[some] = np.stack([rs.permutation(e - 1)[:k] for _ in range(int(some.sum()))])
    noise = rs.normal(size=(b, t, e)).astype(np.float32)
    noise[..., e - 1] = -1e4
    return jnp.asarray(replay), jnp.asarray(noise)


def _layer_loss_and_grads(cfg, b, t, *, mesh=None, seed=0, rows=P(("data", "fsdp"))):
    """Loss, output, routing and parameter gradients of one MoE layer (the same
    parameters for every config: they depend on the seed and shapes only)."""
    graphdef, state = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))
    rs = np.random.RandomState(seed)
    x = jnp.asarray(rs.normal(size=(b, t, cfg.d_model)), jnp.float32)
    mask = jnp.asarray(rs.rand(b, t) > 0.1)
    replay, noise = _routing(b, t, cfg, seed)

    def loss(st, x, mask, replay, noise):
        y, stats = nnx.merge(graphdef, st)(x, mask, replay=replay, router_noise=noise)
        value = jnp.sum(jnp.sin(y) * mask[..., None]) + 0.1 * stats.aux_loss + 0.01 * stats.z_loss
        return value, (y, stats.topk_indices)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    args = (state, x, mask, replay, noise)
    if mesh is None:
        return fn(*args)
    with jax.set_mesh(mesh):
        state = jax.device_put(state, param_shardings(state, mesh, cfg))
        return fn(state, *jax.device_put(args[1:], NamedSharding(mesh, rows)))


@functools.lru_cache(maxsize=None)
def _dense_ref(b, t):
    """The dense layer's result on one device, on the host: shared by the tests that
    compare against it (they only read it; computed once per shape for speed)."""
    return jax.device_get(_layer_loss_and_grads(ModelConfig.tiny(moe_backend="dense"), b, t))


def _assert_same(out, ref):
    (loss, (y, idx)), grads = out
    (loss_r, (y_r, idx_r)), grads_r = ref
    np.testing.assert_array_equal(idx, idx_r)
    np.testing.assert_allclose(loss, loss_r, rtol=1e-5)
    np.testing.assert_allclose(y, y_r, atol=1e-5)
    assert _max_diff(grads, grads_r) < 1e-5


@pytest.mark.parametrize("backend", ["blocked", "ragged"])
@pytest.mark.parametrize("groups", [1, 4])
def test_layer_with_replay_and_noise_equals_dense(backend, groups):
    ref = _dense_ref(8, 6)
    out = _layer_loss_and_grads(ModelConfig.tiny(moe_backend=backend, moe_groups=groups), 8, 6)
    _assert_same(out, ref)
    (_, (_, idx)), _ = out
    e = ModelConfig.tiny().num_experts
    assert e - 1 not in np.asarray(idx) and len(np.unique(np.asarray(idx))) > 2


@pytest.mark.parametrize(
    "mesh_shape",
    [
        (2, 1, 1, 1),  # rows over data: each device sorts its own
        (1, 1, 8, 1),  # 8-way expert parallel, one expert per device
        (2, 1, 4, 1),  # data x expert
        (1, 2, 2, 2),  # FSDP x expert x tensor
        (2, 2, 2, 1),
        (1, 1, 2, 4),  # expert x tensor: the expert width split 4 ways
    ],
)
def test_ragged_dispatch_on_a_mesh_equals_one_device(mesh_shape):
    """On 8 CPU devices the ragged dispatch (shard_map with its all-to-alls and
    psums written out) gives one device's values and gradients. 6 x 5 rows: where
    the expert axis does not divide a batch shard's rows, its devices share them and
    pad their split (15 rows over 2, 4 or 8); 8 x 5 rows divide, and each device
    dispatches its own."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    devices = np.asarray(jax.devices()[: int(np.prod(mesh_shape))]).reshape(mesh_shape)
    mesh = Mesh(devices, AXES)
    b, t = 6 if mesh_shape[0] * mesh_shape[1] < 4 else 8, 5
    groups = mesh_shape[0] * mesh_shape[1]
    ref = _dense_ref(b, t)
    cfg = ModelConfig.tiny(moe_backend="ragged", moe_groups=groups)
    _assert_same(_layer_loss_and_grads(cfg, b, t, mesh=mesh), ref)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8, 1), (2, 1, 2, 2)])
@pytest.mark.parametrize("rows_over_expert", [True, False])
def test_ragged_dispatch_with_rows_split_or_shared_over_the_expert_axis(
    mesh_shape, rows_over_expert
):
    """The trainer's layout, rows sharded over the expert axis too (each expert-axis
    device dispatches its own rows, none is all-gathered), and a batch rule without
    it (the expert-axis devices share their rows and split them in the layer)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(mesh_shape), AXES)
    batch = ("data", "fsdp", "expert") if rows_over_expert else ("data", "fsdp")
    rules = tuple(
        (name, batch if name == "batch" else target)
        for name, target in ModelConfig.tiny().axis_rules
    )
    ref = _dense_ref(8, 5)
    cfg = ModelConfig.tiny(moe_backend="ragged", axis_rules=rules)
    _assert_same(_layer_loss_and_grads(cfg, 8, 5, mesh=mesh, rows=P(batch)), ref)


def test_expert_parallel_program_exchanges_token_rows():
    """With an expert axis, each device holds only its experts' weights and the
    compiled program moves token rows with all-to-alls (the dispatch and its
    return, and their transposes in the backward)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 1, 8, 1), AXES)
    cfg = ModelConfig.tiny(moe_backend="ragged")
    graphdef, state = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))
    x = jnp.zeros((4, 6, cfg.d_model), jnp.float32)

    def loss(st, x):
        return jnp.sum(nnx.merge(graphdef, st)(x, jnp.ones(x.shape[:2], bool))[0])

    with jax.set_mesh(mesh):
        state = jax.device_put(state, param_shardings(state, mesh, cfg))
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile().as_text()
    assert text.count("all-to-all(") == 4
    e, d, f = cfg.num_experts, cfg.d_model, cfg.moe_d_ff
    assert f"f32[{e},{d},{f}]" not in text  # no device holds every expert's weights
    assert f"f32[1,{d},{f}]" in text


def test_ragged_gradient_with_the_gpus_transpose_is_the_same(monkeypatch):
    """On a GPU the grouped matmul's lhs gradient transposes the weights itself
    (`dispatch.transposed_in_place`, through a flat view and a barrier) and runs the
    forward product; elsewhere it asks for the transposed product. The same values:
    the dispatch's gradients taken both ways on this CPU, bit for bit, with an empty
    expert."""
    rs = np.random.RandomState(0)
    n, k, e, d, f = 40, 2, 6, 32, 24
    x = jnp.asarray(rs.randn(n, d), jnp.float32)
    idx = jnp.asarray(np.stack([rs.choice(e - 1, k, replace=False) for _ in range(n)]))
    gates = jnp.asarray(rs.rand(n, k), jnp.float32)
    shapes = [(e, d, f), (e, d, f), (e, f, d)]
    ws = [jnp.asarray(rs.randn(*s) * 0.1, jnp.float32) for s in shapes]

    def loss(x, gates, *ws):
        return jnp.sum(jnp.sin(dispatch.dispatch_ragged(x, idx.astype(jnp.int32), gates, *ws)))

    def run():  # traced afresh each time: a new function for jit's cache
        grads = jax.grad(lambda *a: loss(*a), argnums=(0, 1, 2, 3, 4))
        barrier = "optimization_barrier" in str(jax.make_jaxpr(grads)(x, gates, *ws))
        return jax.jit(grads)(x, gates, *ws), barrier

    plain, barrier = run()
    assert not barrier
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    on_gpu, barrier = run()
    assert barrier  # the GPU's form was the one traced
    for a, b in zip(plain, on_gpu):
        np.testing.assert_array_equal(a, b)


def test_auto_is_blocked_on_cpu():
    assert jax.default_backend() == "cpu"
    assert dispatch.resolve_backend("auto") == "blocked"
    assert dispatch.resolve_backend("dense") == "dense"
    with pytest.raises(ValueError, match="moe_backend"):
        ModelConfig.tiny(moe_backend="grouped")
