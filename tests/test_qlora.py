"""A quantized frozen base for LoRA (gspo_jax.models.quantized, docs/lora.md "QLoRA"):
every stored weight within half a quantization step of its f32 value; the forward on
each MoE dispatch is, bit for bit, the forward of the model holding the dequantized
weights, and each projection's error is within the bound the step gives; gradients
reach the adapters only; the config field is checked; an RL step runs on a quantized
base and moves the adapters only."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import default as default_config
from gspo_jax import config as config_lib
from gspo_jax import lora_training
from gspo_jax.models import ModelConfig, Transformer, lora, quantized

ALL = tuple(lora.TARGETS)


def _model(cfg, seed=0):
    """A tiny model with adapters on every target and nonzero B (a fresh B = 0 would
    hide whether the adapters take part)."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    lora.add_adapters(model, lora.LoRASpec(4, 8.0, ALL), jax.random.key(seed + 5))
    key = jax.random.key(seed + 9)
    for i, (_, module) in enumerate(nnx.iter_modules(model)):
        for name in getattr(module, "LORA_WEIGHTS", None) or {}:
            b = getattr(module, f"{name}_lora_b")
            b[...] = 0.3 * jax.random.normal(jax.random.fold_in(key, 7 * i + len(name)), b.shape)
    return model


def _weights(model):
    """(module, name, n_lead, n_in, n_dims) of every quantizable weight."""
    for _, module in nnx.iter_modules(model):
        for name, (_, n_lead, n_in, n_dims) in (getattr(module, "LORA_WEIGHTS", None) or {}).items():
            yield module, name, n_lead, n_in, n_dims


def _dequantized_model(model):
    """``model`` (quantized) with each quantized weight replaced by its dequantized f32
    value: the plain model the quantized one should compute."""
    return quantized.dequantize_base(nnx.clone(model))


def _as_matrix(a, n_lead, n_in, n_dims):
    """[..., I, O]: the stack and lead dims, the input dims flattened, the output dims
    flattened."""
    st = a.ndim - n_dims
    lead = a.shape[: st + n_lead]
    i = int(np.prod(a.shape[st + n_lead : st + n_lead + n_in]))
    return a.reshape(lead + (i, -1))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_stored_weights_within_half_a_step(scheme):
    """Round to nearest with scale s = absmax / (qmax + 1/2): |w_hat - w| <= s / 2 for
    every element, the values stored in ``scheme``'s integer type, the scales f32 with
    one per output channel (int8) or per group of 32 (or gcd(size, 32)) elements of the
    last input dim (int4)."""
    cfg = ModelConfig.tiny()
    model = _model(cfg)
    before = {(id(m), n): np.asarray(getattr(m, n)[...]) for m, n, *_ in _weights(model)}
    quantized.quantize_base(model, scheme)
    for module, name, n_lead, n_in, n_dims in _weights(model):
        q = getattr(module, name).get_value()
        assert quantized.is_quantized(q) and q.qvalue.dtype == quantized.QTYPES[scheme]
        assert q.scale.dtype == jnp.float32
        w = before[(id(module), name)]
        st = w.ndim - n_dims
        inputs = list(range(st + n_lead, st + n_lead + n_in))
        for ax in range(w.ndim):
            if scheme == "int8" and ax in inputs:  # per output channel
                assert q.scale.shape[ax] == 1
            elif ax == inputs[-1]:
                assert q.scale.shape[ax] == w.shape[ax] // np.gcd(w.shape[ax], quantized.INT4_GROUP)
            else:
                assert q.scale.shape[ax] == w.shape[ax]
        step = np.asarray(q.scale)
        for ax in range(w.ndim):  # the scale of each element (groups repeated)
            step = np.repeat(step, w.shape[ax] // step.shape[ax], axis=ax)
        err = np.abs(np.asarray(qwix_dequantize(q)) - w)
        # s / 2, and the f32 rounding of w / s and of q * s (a few ulps of |w|).
        assert np.all(err <= step / 2 * (1 + 1e-6) + 4e-7 * np.abs(w))
        assert err.max() > 0.1 * (step / 2).max()  # it is quantized, not a copy


def qwix_dequantize(q):
    import qwix

    return qwix.dequantize(q)


@pytest.mark.parametrize("backend", ["dense", "ragged", "blocked"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_forward_is_the_dequantized_models(backend, scheme):
    """The quantized base's forward (bf16 compute, adapters on) is, bit for bit, the
    forward of the plain model holding the dequantized weights, on every dispatch; and
    it differs from the unquantized model's (the quantization is in the forward)."""
    cfg = ModelConfig.tiny(moe_backend=backend, moe_groups=2, dtype="bfloat16")
    model = _model(cfg)
    tokens = jax.random.randint(jax.random.key(3), (4, 7), 0, cfg.vocab_size)
    plain, _ = model(tokens)
    quantized.quantize_base(model, scheme)
    logits, aux = model(tokens)
    ref, ref_aux = _dequantized_model(model)(tokens)
    np.testing.assert_array_equal(logits, ref)
    np.testing.assert_array_equal(aux.topk_indices, ref_aux.topk_indices)
    assert float(jnp.max(jnp.abs(logits - plain))) > 0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_each_projection_within_the_bound_of_its_step(scheme):
    """For every weight (attention, dense MLP, experts) and inputs x (f32): each output
    of x W_hat - x W is at most sum_i |x_i| s_i / 2 (|W_hat - W| <= s / 2 elementwise),
    and the bound is not vacuous (the largest error is over a tenth of it)."""
    cfg = ModelConfig.tiny()
    model = _model(cfg)
    ref = {(id(m), n): getattr(m, n)[...] for m, n, *_ in _weights(model)}
    quantized.quantize_base(model, scheme)
    key = jax.random.key(11)
    for k, (module, name, n_lead, n_in, n_dims) in enumerate(_weights(model)):
        q = getattr(module, name).get_value()
        w = _as_matrix(ref[(id(module), name)], n_lead, n_in, n_dims)
        w_hat = _as_matrix(quantized.read(getattr(module, name), jnp.float32), n_lead, n_in, n_dims)
        step = np.asarray(q.scale)
        for ax in range(step.ndim):
            step = np.repeat(step, q.shape[ax] // step.shape[ax], axis=ax)
        half = _as_matrix(jnp.asarray(step / 2), n_lead, n_in, n_dims)
        x = jax.random.normal(jax.random.fold_in(key, k), (5, w.shape[-2]))
        mm = lambda a, b: jnp.einsum("ni,...io->...no", a, b, precision="highest")
        err = jnp.abs(mm(x, w_hat) - mm(x, w))
        bound = mm(jnp.abs(x), half) + 1e-5 * mm(jnp.abs(x), jnp.abs(w))  # + f32 sums
        assert bool(jnp.all(err <= bound)), (type(module).__name__, name)
        assert float(jnp.max(err / bound)) > 0.1


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_base_on_a_mesh(scheme):
    """On 8 CPU devices (FSDP, expert and tensor axes, the experts' rows exchanged by
    all-to-alls): `param_shardings` gives a quantized weight's values the weight's
    partition spec and its scales the same spec less the dims they do not divide; the
    forward equals one device's."""
    from jax.sharding import Mesh

    from gspo_jax.models.sharding import logical_to_mesh_spec, param_shardings

    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    axes = ("data", "fsdp", "expert", "tensor")
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 2, 2, 2), axes)
    cfg = ModelConfig.tiny(moe_backend="ragged")
    model = quantized.quantize_base(_model(cfg), scheme)
    tokens = jax.random.randint(jax.random.key(3), (8, 5), 0, cfg.vocab_size)
    ref, _ = model(tokens)
    graphdef, state = nnx.split(model)
    shardings = param_shardings(state, mesh, cfg)
    gate = shardings["segments"][1]["blocks"][0]["mlp"]["gate"]
    var = state["segments"][1]["blocks"][0]["mlp"]["gate"]
    names = var.get_metadata()["out_sharding"]
    want = logical_to_mesh_spec(names, var.shape, cfg.axis_rules, mesh)
    assert gate.get_value().qvalue.spec == want and "expert" in str(want)
    fn = jax.jit(lambda st, tok: nnx.merge(graphdef, st)(tok)[0])
    with jax.set_mesh(mesh):
        logits = fn(jax.device_put(state, shardings), tokens)
    np.testing.assert_allclose(logits, ref, atol=2e-5, rtol=1e-5)


def test_gradients_reach_the_adapters_only():
    """On a quantized base the trainable part ('lora') is the adapters (f32), the frozen
    part holds the integer weights; the adapters' gradients equal those of the plain
    model holding the dequantized weights, and each adapter gets one."""
    cfg = ModelConfig.tiny()
    model = _model(cfg)
    quantized.quantize_base(model, "int8")
    tokens = jax.random.randint(jax.random.key(3), (2, 6), 0, cfg.vocab_size)
    probe = jax.random.normal(jax.random.key(4), (2, 6, cfg.vocab_size))

    def grads(m):
        graphdef, params = nnx.split(m)
        train, frozen = lora.partition(params, "lora")

        def loss(tr):
            logits, _ = nnx.merge(graphdef, lora.join(tr, frozen))(tokens)
            return jnp.sum(jnp.where(logits > -1e29, logits, 0.0) * probe)

        return train, frozen, jax.grad(loss)(train)

    train, frozen, g = grads(model)
    ints = [a for a in jax.tree.leaves(frozen) if jnp.issubdtype(a.dtype, jnp.integer)]
    assert len(ints) == sum(1 for _ in _weights(model))  # every weight's stored values
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(g)[0]]
    assert paths and all("_lora_" in p for p in paths)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(train))
    assert all(float(jnp.max(jnp.abs(a))) > 0 for a in jax.tree.leaves(g))
    _, _, g_ref = grads(_dequantized_model(model))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "rank, value, message",
    [
        (8, "int3", "config.lora.base_quantization"),
        (8, "nf4", "config.lora.base_quantization"),
        (0, "int8", "config.lora.base_quantization: 'int8' quantizes the frozen base"),
    ],
)
def test_config_field_is_checked(rank, value, message):
    c = default_config.get_config("lora,smoke")
    c.lora.rank = rank
    c.lora.base_quantization = value
    with pytest.raises(config_lib.ConfigError, match="^" + message.replace(".", r"\.")):
        config_lib.validate(c, 1)
    c.lora.rank = 8
    c.lora.base_quantization = "int4"
    config_lib.validate(c, 1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_rl_step_on_a_quantized_base(data_dir, tmp_path, scheme):
    """The LoRA smoke run's RL phase with a quantized base: the frozen weights (attention
    and experts of its MoE layers) are stored quantized, in fewer bytes than the base
    without quantization; one step moves the adapters only; the base's identity is
    recorded."""
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    from test_lora import _lora_smoke  # the LoRA smoke run whose updates move the adapters

    c = _lora_smoke(data_dir, base_quantization=scheme)
    t = RunParts(c, str(tmp_path))
    rl = RLPhase(t, t.init_params)
    frozen = lora.partition(rl.state.params, "lora")[1]
    flat = jax.tree_util.tree_flatten_with_path(frozen)[0]
    stored = {jax.tree_util.keystr(p) for p, a in flat if a.dtype == quantized.QTYPES[scheme]}
    names = [f"['{m}']['{w}'].value.qvalue" for m, ws in (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for w in ws]
    assert len(stored) == len(names) and all(any(p.endswith(n) for p in stored) for n in names)
    before = jax.device_get(rl.state.params)
    _, updates = rl.step(0)
    after = jax.device_get(rl.state.params)
    changed = lora_training.nonzero_delta(before, after)
    assert changed and all("_lora_" in p for p in changed)
    assert np.isfinite(updates[0]["loss"])
    # param_norm: the dequantized base's weights and the adapters (not the integers)
    norm = float(optax.tree.norm(quantized.dequantized(rl.state.params)))
    np.testing.assert_allclose(updates[-1]["param_norm"], norm, rtol=1e-5)
    sizes = lora_training.sizes(rl.state.params, rl.state.opt_state, "lora")
    plain = lora_training.sizes(
        lora_training.rl_params(t.init_params, t.model_cfg, "lora"), rl.state.opt_state, "lora"
    )
    assert sizes["frozen_stored_bytes"] < plain["frozen_stored_bytes"]
    assert set(rl.checkpoint_items()[1]["lora_base"]) == {"source", "checksum"}


def test_export_of_a_quantized_run(data_dir, tmp_path):
    """A LoRA smoke run on an int8 base, restored as the evaluation and the export read
    it (the base rebuilt, quantized again and its checksum checked): the exported base
    (HF layout) is the dequantized base, and the merged export the run's model with its
    adapters, both loaded in transformers."""
    pytest.importorskip("transformers")
    from test_export import _hf, _restored, _tokens
    from test_lora import _lora_smoke
    from test_peft import _ours, _torch_logits

    from gspo_jax import train
    from gspo_jax.export import export_run
    from gspo_jax.models.lora import adapters_off

    workdir = str(tmp_path / "run")
    c = _lora_smoke(data_dir, base_quantization="int8")
    train.run(c, workdir)
    model, restored = _restored(c, workdir)
    assert restored == "rl/2"
    q = model.segments[0].blocks[0].attn.q.get_value()
    assert quantized.is_quantized(q) and q.qvalue.dtype == jnp.int8
    tokens = _tokens(model)
    ours = _ours(model, tokens)
    graphdef, state = nnx.split(model)
    off = _ours(nnx.merge(graphdef, adapters_off(state)), tokens)
    base = export_run(c, workdir, str(tmp_path / "base"), format="base")
    merged = export_run(c, workdir, str(tmp_path / "merged"), format="merged")
    np.testing.assert_allclose(_torch_logits(_hf(base["out"]), tokens), off, atol=1e-4)
    np.testing.assert_allclose(_torch_logits(_hf(merged["out"]), tokens), ours, atol=1e-4)
