"""LoRA (gspo_jax.models.lora, docs/lora.md): a LoRA forward equals the merged weights'
on every MoE dispatch (dense, ragged, blocked, expert parallel on a mesh), with and
without replay; the KV-cache sampler's path too; training updates the adapters only;
a full-rank LoRA reaches what full fine-tuning reaches; the config section's checks."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.models import ModelConfig, Transformer, lora
from gspo_jax.models.moe import MoE
from gspo_jax.models.sharding import param_shardings

AXES = ("data", "fsdp", "expert", "tensor")
ALL = tuple(lora.TARGETS)


def _randomize_b(model, seed=1, std=0.3):
    """Nonzero B everywhere (a fresh adapter is a no-op, so a test with B = 0 could
    not fail)."""
    key = jax.random.key(seed)
    for i, (_, module) in enumerate(nnx.iter_modules(model)):
        for name in getattr(module, "LORA_WEIGHTS", None) or {}:
            b = getattr(module, f"{name}_lora_b", None)
            if b is not None:
                b[...] = std * jax.random.normal(jax.random.fold_in(key, i * 7 + len(name)), b.shape)
    return model


def _lora_model(cfg, targets=ALL, rank=4, alpha=8.0, seed=0):
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    lora.add_adapters(model, lora.LoRASpec(rank, alpha, tuple(targets)), jax.random.key(seed + 5))
    return _randomize_b(model)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, tokens, replay):
    """The forward of ``nnx.merge(graphdef, state)``, compiled once per model structure
    and shapes (for speed: an eager forward compiles every op on its own)."""
    return nnx.merge(graphdef, state)(tokens, replay=replay)


def _forward(model, tokens, replay=None):
    return _apply(*nnx.split(model), tokens, replay)


def _replay(cfg, b, t, seed=0):
    rs = np.random.RandomState(seed)
    r = np.stack(
        [rs.permutation(cfg.num_experts)[: cfg.top_k] for _ in range(b * t * cfg.num_moe_layers)]
    ).reshape(b, t, cfg.num_moe_layers, cfg.top_k)
    r[rs.rand(b, t) < 0.25] = -1  # some rows free
    return jnp.asarray(r, jnp.int32)


def test_add_adapters_keeps_the_base_and_its_init():
    """Adapters come after the base: the base parameters are those of a model without
    LoRA (the same RNG stream), the shapes and axes are the spec's, A random, B zero,
    all f32 over a bf16 base."""
    cfg = ModelConfig.tiny(param_dtype="bfloat16")
    plain = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    lora.add_adapters(model, lora.LoRASpec(4, 8.0, ALL), jax.random.key(1))
    base = nnx.state(model, nnx.Not(lora.LoRAParam))
    assert jax.tree.structure(base) == jax.tree.structure(plain)
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    seg = model.segments[1].blocks[0]  # an MoE layer (stacked over its repeats)
    n = seg.attn.q.shape[0]
    d, h, kv, hd, e, f = 32, 4, 2, 16, 8, 24
    want = [
        (seg.attn.q_lora_a, (n, d, 4)),
        (seg.attn.q_lora_b, (n, 4, h, hd)),
        (seg.attn.k_lora_b, (n, 4, kv, hd)),
        (seg.attn.o_lora_a, (n, h, hd, 4)),
        (seg.attn.o_lora_b, (n, 4, d)),
        (seg.mlp.gate_lora_a, (n, e, d, 4)),
        (seg.mlp.gate_lora_b, (n, e, 4, f)),
        (seg.mlp.down_lora_a, (n, e, f, 4)),
        (seg.mlp.down_lora_b, (n, e, 4, d)),
    ]
    for var, shape in want:
        assert isinstance(var, lora.LoRAParam) and var.shape == shape and var.dtype == jnp.float32
    assert seg.mlp.gate_lora_a.get_metadata()["out_sharding"] == (
        "layers",
        "expert",
        "embed",
        "lora_rank",
    )
    assert seg.mlp.gate_lora_b.get_metadata()["out_sharding"] == (
        "layers",
        "expert",
        "lora_rank",
        "mlp",
    )
    dense = model.segments[0].blocks[0].mlp
    assert dense.down_lora_a.shape == (1, 64, 4) and dense.down_lora_b.shape == (1, 4, d)
    assert float(jnp.max(jnp.abs(seg.mlp.up_lora_b[...]))) == 0.0
    assert float(jnp.std(seg.mlp.up_lora_a[...])) > 0.05
    assert not hasattr(seg.mlp, "router_lora_a")


@pytest.mark.parametrize("backend", ["dense", "ragged", "blocked"])
@pytest.mark.parametrize("replay", [False, True])
def test_forward_equals_the_merged_weights(backend, replay):
    cfg = ModelConfig.tiny(moe_backend=backend, moe_groups=2)
    model = _lora_model(cfg)
    merged = lora.merge(model)
    assert not jax.tree.leaves(nnx.state(merged, lora.LoRAParam))
    b, t = 4, 7
    tokens = jax.random.randint(jax.random.key(3), (b, t), 0, cfg.vocab_size)
    rep = _replay(cfg, b, t) if replay else None
    logits, aux = _forward(model, tokens, rep)
    ref, ref_aux = _forward(merged, tokens, rep)
    no_lora, _ = _forward(Transformer(cfg, rngs=nnx.Rngs(0)), tokens, rep)
    assert float(jnp.max(jnp.abs(logits - no_lora))) > 1e-2  # the adapters do something
    np.testing.assert_allclose(logits, ref, atol=2e-5, rtol=1e-5)
    graphdef, state = lora.merge_params(*nnx.split(model))  # the same on a split model
    np.testing.assert_array_equal(_apply(graphdef, state, tokens, rep)[0], ref)
    if replay:  # replayed rows use exactly the replayed experts, with adapters or not
        replayed = np.all(np.asarray(rep) >= 0, axis=-1)
        got = np.asarray(aux.topk_indices)[replayed]
        np.testing.assert_array_equal(got, np.asarray(rep)[replayed])
    np.testing.assert_array_equal(aux.topk_indices, ref_aux.topk_indices)


@functools.partial(jax.jit, static_argnums=0)
def _moe_grads(graphdef, st, x, mask):
    """The gradient of sum(sin(MoE(x))) in the layer's state, compiled (for speed)."""

    def loss(st):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, st)(x, mask)[0]))

    return jax.grad(loss)(st)


@pytest.mark.parametrize("backend", ["dense", "ragged", "blocked"])
def test_expert_gradients_equal_across_dispatches(backend):
    """The adapters' gradients through each dispatch equal the dense reference's."""
    cfg = ModelConfig.tiny(moe_backend="dense")
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    lora.add_adapters(layer, lora.LoRASpec(3, 6.0, ALL), jax.random.key(2))
    _randomize_b(layer)
    x = jax.random.normal(jax.random.key(4), (4, 6, cfg.d_model))
    mask = jnp.ones((4, 6), bool)

    def grads(c):
        layer.cfg = c
        return _moe_grads(*nnx.split(layer), x, mask)

    ref = grads(cfg)
    out = grads(cfg.replace(moe_backend=backend))
    for name in ("gate", "up", "down"):
        for part in ("lora_a", "lora_b"):
            g, r = out[f"{name}_{part}"][...], ref[f"{name}_{part}"][...]
            assert float(jnp.max(jnp.abs(r))) > 0
            np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def ep_reference():
    """The expert-parallel test's model, inputs and one device's results, per replay
    (shared by its mesh shapes, which only read them: computed once for speed)."""
    cfg = ModelConfig.tiny(moe_backend="ragged")
    model = _lora_model(cfg)
    graphdef, state = nnx.split(model)
    b, t = 8, 5
    tokens = jax.random.randint(jax.random.key(3), (b, t), 0, cfg.vocab_size)

    def loss(st, tokens, rep):
        logits, _ = nnx.merge(graphdef, st)(tokens, replay=rep)
        return jnp.sum(jnp.sin(logits)), logits

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    out = {}
    for replay in (False, True):
        rep = _replay(cfg, b, t) if replay else None
        ref, _ = _forward(lora.merge(model), tokens, rep)
        (_, g_ref) = fn(state, tokens, rep)
        out[replay] = (tokens, rep, ref, g_ref)
    return cfg, state, fn, out


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8, 1), (1, 2, 2, 2), (2, 1, 4, 1)])
@pytest.mark.parametrize("replay", [False, True])
def test_expert_parallel_forward_equals_the_merged_weights(ep_reference, mesh_shape, replay):
    """On 8 CPU devices (expert, FSDP and tensor axes): the adapters sharded with
    their experts, the rows exchanged with all-to-alls; values and the adapters'
    gradients equal one device's merged / unsharded ones."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(mesh_shape), AXES)
    cfg, state, fn, out = ep_reference
    tokens, rep, ref, g_ref = out[replay]
    with jax.set_mesh(mesh):
        st = jax.device_put(state, param_shardings(state, mesh, cfg))
        rows = NamedSharding(mesh, P(("data", "fsdp", "expert")))
        args = jax.device_put((tokens, rep), rows)
        compiled = fn.lower(st, *args).compile()  # what fn(st, *args) runs, compiled once
        (_, logits), g = compiled(st, *args)
        text = compiled.as_text()
    np.testing.assert_allclose(logits, ref, atol=2e-5, rtol=1e-5)
    # Adapters' included; on the host (numpy, the same f32 values): jnp ops on the
    # sharded leaves would compile a program per leaf.
    for x, y in zip(jax.device_get(jax.tree.leaves(g)), jax.device_get(jax.tree.leaves(g_ref))):
        assert float(np.max(np.abs(x - y))) <= 1e-4 * max(float(np.max(np.abs(y))), 1.0)
    if mesh_shape[2] > 1:
        assert "all-to-all(" in text
        e, d, f = cfg.num_experts, cfg.d_model, cfg.moe_d_ff
        assert f"f32[{e},{d},{f}]" not in text  # no merged (or whole) expert weights


def test_kv_cache_decode_with_adapters():
    """The sampler's path: prefill then one-token decode steps with adapters give the
    full forward's logits (the same modules)."""
    cfg = ModelConfig.tiny(moe_backend="blocked")
    model = _lora_model(cfg)
    b, t = 2, 6
    tokens = jax.random.randint(jax.random.key(3), (b, t), 0, cfg.vocab_size)
    full, _ = _forward(model, tokens)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="prefill")  # compiled, for speed
    def decode(state, tokens, cache, positions, prefill=False):
        return nnx.merge(graphdef, state).decode(tokens, cache, positions=positions, prefill=prefill)

    cache = model.init_cache(b, t)
    pos = jnp.broadcast_to(jnp.arange(4), (b, 4))
    logits, _, cache = decode(state, tokens[:, :4], cache, pos, prefill=True)
    steps = [logits]
    for i in range(4, t):
        logits, _, cache = decode(state, tokens[:, i : i + 1], cache, jnp.full((b, 1), i))
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5, rtol=1e-5)


def test_adapters_off_is_the_base():
    cfg = ModelConfig.tiny()
    model = _lora_model(cfg)
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(3), (2, 5), 0, cfg.vocab_size)
    off, _ = _apply(graphdef, lora.adapters_off(state), tokens, None)
    base, _ = _forward(Transformer(cfg, rngs=nnx.Rngs(0)), tokens)
    np.testing.assert_array_equal(off, base)
    base_leaves = jax.tree.leaves(nnx.state(model, nnx.Not(lora.LoRAParam)))
    off_leaves = jax.tree.leaves(nnx.split_state(lora.adapters_off(state), nnx.Not(lora.LoRAParam), ...)[0])
    assert all(x is y for x, y in zip(off_leaves, base_leaves))  # the same arrays, no copy


# --------------------------------------------------------------------------
# Training: the RL phase with LoRA (gspo_jax.lora_training).

from configs import default as default_config  # noqa: E402
from gspo_jax import config as config_lib  # noqa: E402
from gspo_jax import lora_training  # noqa: E402
from gspo_jax.metrics_log import read_metrics  # noqa: E402

TIMING = {"step_time", "rollout_time", "old_logp_time", "update_time", "sample_time", "tokens_per_s"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _lora_smoke(data_dir, **lora_fields):
    """The smoke run with LoRA, a KL term, and updates that move the adapters whatever
    the (smoke-sized, often zero) rewards: an entropy bonus and updates without signal."""
    c = default_config.get_config("lora,smoke")
    c.task.data_dir = data_dir
    c.objective.hparams.kl_coef = 0.05
    c.entropy_coef = 0.05
    c.updates.update_without_signal = True
    c.optimizer.warmup_steps = 0
    for k, v in lora_fields.items():
        c.lora[k] = v
    return c


@pytest.mark.parametrize("train_router", [False, True])
def test_one_rl_step_changes_only_the_adapters(data_dir, tmp_path, train_router):
    from gspo_jax.models.lora import LoRAParam
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    c = _lora_smoke(data_dir, train_router=train_router)
    c.updates.routing_replay = "R3"
    t = RunParts(c, str(tmp_path))
    rl = RLPhase(t, t.init_params)
    kind = "lora+router" if train_router else "lora"
    assert rl.step_cfg.trainable == kind
    before = jax.device_get(rl.state.params)
    _, updates = rl.step(0)
    after = jax.device_get(rl.state.params)
    changed = lora_training.nonzero_delta(before, after)
    assert changed and all("_lora_" in p or (train_router and "router" in p) for p in changed)
    assert any("expert" not in p and "mlp" in p and "_lora_b" in p for p in changed)  # experts' B
    if train_router:
        assert any("router" in p for p in changed)
    # The optimizer's moments: the trainable parameters only, f32.
    mu = rl.state.opt_state[1][0].mu
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(mu)[0]]
    assert paths and all("_lora_" in p or (train_router and "router" in p) for p in paths)
    adapters = nnx.split_state(after, LoRAParam, ...)[0]
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(adapters))
    sizes = lora_training.sizes(rl.state.params, rl.state.opt_state, kind)
    assert sizes["trainable_params"] < 0.5 * sizes["frozen_params"]
    assert sizes["optimizer_state_bytes"] <= 2 * sizes["trainable_bytes"] + 64
    assert np.isfinite(updates[0]["loss"])
    # What an RL checkpoint holds: the trainable parameters (and their moments), and
    # the base's identity.
    tree, meta = rl.checkpoint_items()
    assert tree["queue"] == [] and meta["layout"] == 2  # rl.CHECKPOINT_LAYOUT
    saved = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree["train"].params)[0]]
    assert saved == paths
    assert set(meta["lora_base"]) == {"source", "checksum"}


def _rl_records(workdir):
    return {r["step"]: r for r in read_metrics(workdir) if r["phase"] == "rl"}


def test_resumed_lora_run_equals_an_uninterrupted_one(data_dir, tmp_path):
    """4 RL steps at once, and 2 then a resume for 2 more: every metric the same, bit
    for bit; the checkpoint holds the adapters and their moments, not the base."""
    from gspo_jax import train

    full, cut = tmp_path / "full", tmp_path / "cut"
    c = _lora_smoke(data_dir)
    c.total_rl_steps = 4
    train.run(c, str(full))
    c2 = _lora_smoke(data_dir)
    c2.total_rl_steps = 2
    train.run(c2, str(cut))
    ckpt = cut / "checkpoints"
    meta = json.loads((ckpt / "rl" / "2" / "meta" / "metadata").read_text())
    assert set(meta["lora_base"]) == {"source", "checksum"}
    assert meta["lora_base"]["source"] == "warm start checkpoint sft/2"
    c3 = _lora_smoke(data_dir)
    c3.total_rl_steps = 4
    train.run(c3, str(cut))
    a, b = _rl_records(full), _rl_records(cut)
    assert sorted(b) == [0, 1, 2, 3, 4]
    for s in (1, 2, 3, 4):
        keys = set(a[s]) - TIMING
        assert keys == set(b[s]) - TIMING
        for k in keys:
            assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])
    assert a[4]["kl_k3"] != 0.0 or a[4]["grad_norm"] > 0


def test_resume_refuses_a_changed_base(data_dir, tmp_path):
    from gspo_jax import train

    c = _lora_smoke(data_dir)
    c.sft.steps = 0  # the base: the seed's initialisation
    train.run(c, str(tmp_path))
    c.total_rl_steps = 3
    real = lora_training.checksum
    try:
        lora_training.checksum = lambda frozen: "deadbeef"
        with pytest.raises(lora_training.BaseMismatch, match="checksum deadbeef.*checksum"):
            train.run(c, str(tmp_path))
    finally:
        lora_training.checksum = real


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rank", -1, "config.lora.rank"),
        ("alpha", 0.0, "config.lora.alpha"),
        ("targets", ("q", "experts"), "config.lora.targets: unknown targets"),
        ("targets", (), "config.lora.targets"),
        ("targets", ("q", "q"), "config.lora.targets: names a target twice"),
    ],
)
def test_config_errors_name_the_field(field, value, message):
    c = default_config.get_config("lora,smoke")
    c.lora[field] = value
    with pytest.raises(config_lib.ConfigError, match="^" + message.replace(".", r"\.")):
        config_lib.validate(c, 1)


def test_lora_configs_validate():
    from configs import qwen3_moe_gsm8k

    config_lib.validate(default_config.get_config("lora"), 1)
    for c in (default_config.get_config("lora"), qwen3_moe_gsm8k.get_config("ckpt=/ckpt,lora")):
        assert c.lora.rank > 0 and "expert_up" in c.lora.targets
    assert default_config.get_config("").lora.rank == 0  # off by default


def test_full_rank_lora_on_a_zeroed_base_reaches_full_fine_tuning():
    """A toy regression through one dense MLP: its down projection [F, D] learnt from
    zero in full, and as LoRA with r = D (the rank covers the matrix) on a zeroed base;
    gate/up frozen. A thousand Adam steps: LoRA's loss reaches full fine-tuning's (the noise floor)."""
    import optax

    from gspo_jax.models.layers import MLP

    d, f, n = 8, 16, 256
    cfg = ModelConfig.tiny(d_model=d, d_ff=f)
    rs = np.random.RandomState(0)
    x = jnp.asarray(rs.normal(size=(n, d)), jnp.float32)
    gate, up = (jnp.asarray(rs.normal(size=(d, f)) / np.sqrt(d), jnp.float32) for _ in "gu")
    teacher = MLP(cfg, rngs=nnx.Rngs(1))
    teacher.gate[...], teacher.up[...] = gate, up
    teacher.down[...] = jnp.asarray(rs.normal(size=(f, d)), jnp.float32)
    y = teacher(x) + 0.01 * jnp.asarray(rs.normal(size=(n, d)), jnp.float32)

    def fit(use_lora):
        model = MLP(cfg, rngs=nnx.Rngs(1))
        model.gate[...], model.up[...] = gate, up  # the teacher's, frozen
        model.down[...] = jnp.zeros((f, d))
        if use_lora:
            lora.add_adapters(model, lora.LoRASpec(d, float(d), ("down",)), jax.random.key(2))
            train = lora.LoRAParam
        else:
            train = nnx.PathContains("down")
        graphdef, params, rest = nnx.split(model, train, ...)
        opt = optax.adam(3e-2)
        state = opt.init(params)

        @jax.jit
        def step(params, state):
            def loss(p):
                return jnp.mean((nnx.merge(graphdef, p, rest)(x) - y) ** 2)

            value, g = jax.value_and_grad(loss)(params)
            updates, state = opt.update(g, state)
            return optax.apply_updates(params, updates), state, value

        for _ in range(1000):
            params, state, value = step(params, state)
        return float(value), nnx.merge(graphdef, params, rest)

    full, _ = fit(False)
    low, model = fit(True)
    start = float(jnp.mean(y**2))
    assert full < 1e-2 * start  # the least-squares fit (the noise's 1e-4 left)
    assert low < 1e-2 * start and abs(low - full) < 0.1 * full, (low, full)
    assert float(jnp.max(jnp.abs(model.down[...]))) == 0.0  # all of it in the adapters


@pytest.mark.parametrize("backend", ["ragged", "blocked_scatter", "blocked_matmul"])
def test_dispatch_takes_adapters_like_weights(backend):
    """Each dispatch on `lora.LoRAWeight`s equals the dense dispatch on the merged
    weights, in values and in the adapters' gradients (the blocked one with either
    backward of its per-block gather)."""
    from gspo_jax.models import dispatch

    rs = np.random.RandomState(0)
    n, k, e, d, f, r = 20, 2, 4, 8, 6, 3
    x = jnp.asarray(rs.normal(size=(n, d)), jnp.float32)
    idx = jnp.asarray(np.stack([rs.permutation(e)[:k] for _ in range(n)]), jnp.int32)
    idx = idx.at[:12].set(jnp.asarray([0, 1], jnp.int32))  # a large group, others small
    gates = jnp.asarray(rs.rand(n, k), jnp.float32)
    mats = lambda *s: jnp.asarray(rs.normal(size=s) / np.sqrt(s[-2]), jnp.float32)  # noqa: E731
    ws = [
        lora.LoRAWeight(mats(e, d, f), mats(e, d, r), mats(e, r, f)),
        lora.LoRAWeight(mats(e, d, f), mats(e, d, r), mats(e, r, f)),
        lora.LoRAWeight(mats(e, f, d), mats(e, f, r), mats(e, r, d)),
    ]
    run = {
        "ragged": dispatch.dispatch_ragged,
        "blocked_scatter": lambda *a: dispatch.dispatch_blocked(*a, max_block=4, weight_grad="scatter"),
        "blocked_matmul": lambda *a: dispatch.dispatch_blocked(*a, max_block=4, weight_grad="matmul"),
    }[backend]

    def loss(fn, ws):
        return jnp.sum(jnp.sin(fn(x, idx, gates, *ws)))

    merged = [w.w + jnp.einsum("edr,erf->edf", w.a, w.b) for w in ws]
    # Each side compiled as one program (for speed; eager would compile every op).
    np.testing.assert_allclose(
        jax.jit(run)(x, idx, gates, *ws), jax.jit(dispatch.dispatch_dense)(x, idx, gates, *merged), atol=1e-5
    )
    g = jax.jit(jax.grad(functools.partial(loss, run)))(ws)
    g_ref = jax.jit(jax.grad(functools.partial(loss, dispatch.dispatch_dense)))(ws)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_ppo_critic_trains_with_lora(data_dir, tmp_path):
    """PPO's value head has no adapter: with LoRA it trains in full beside them."""
    from configs import ppo
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    c = ppo.get_config("smoke")
    c.task.data_dir = data_dir
    c.lora.rank = 4
    c.updates.update_without_signal = True
    t = RunParts(c, str(tmp_path))
    rl = RLPhase(t, t.init_params)
    before = jax.device_get(rl.state.params)
    rl.step(0)
    changed = lora_training.nonzero_delta(before, jax.device_get(rl.state.params))
    assert any("value_w" in p for p in changed)
    assert all("_lora_" in p or "value_" in p for p in changed)
