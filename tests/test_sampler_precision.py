"""The sampler's own precision (rollout.sampler_dtype, rollout.sampler_quantization;
gspo_jax.models.precision.SamplerPrecision): a bf16 sampler computes what a bf16 model
of the same weights computes, bit for bit; an int8 sampler reads the weights QLoRA's
scheme stores, re-quantized from the current parameters; the trainer's own precision
is the parameters themselves; an RL run with a bf16 sampler measures a mismatch that a
same-precision run does not; the config's conflict with a quantized base is named."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import stability as stability_config
from gspo_jax import config as config_lib
from gspo_jax import train
from gspo_jax.models import ModelConfig, Transformer, quantized
from gspo_jax.models.precision import SamplerPrecision, with_compute_dtype


def _split(cfg, seed=0):
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))


@functools.partial(jax.jit, static_argnums=0)  # one program per model, not op by op
def _logits(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)[0]


def test_the_trainers_own_precision_is_the_parameters_themselves():
    cfg = ModelConfig.tiny()
    graphdef, params = _split(cfg)
    sp = SamplerPrecision(graphdef, params, cfg, "", "none")
    assert sp.same and sp.graphdef is graphdef and sp.view(params) is params
    assert SamplerPrecision(graphdef, params, cfg, "float32", "none").same


@pytest.mark.parametrize("backend", ["blocked", "dense"])
def test_a_bf16_sampler_computes_what_a_bf16_model_computes(backend):
    cfg = ModelConfig.tiny(moe_backend=backend)
    graphdef, params = _split(cfg)
    sp = SamplerPrecision(graphdef, params, cfg, "bfloat16", "none")
    assert not sp.same and sp.cfg.dtype == "bfloat16"
    view = sp.view(params)
    kinds = {
        "/".join(map(str, path)): leaf.dtype
        for path, leaf in jax.tree_util.tree_leaves_with_path(view)
    }
    assert all(d == jnp.float32 for k, d in kinds.items() if "router" in k)
    assert any(d == jnp.bfloat16 for d in kinds.values())
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
    want_gd, _ = _split(dataclasses.replace(cfg, dtype="bfloat16"))
    want = _logits(want_gd, params, tokens)
    np.testing.assert_array_equal(np.asarray(_logits(sp.graphdef, view, tokens)), np.asarray(want))
    # ... and not what the f32 model computes.
    f32 = _logits(graphdef, params, tokens)
    assert float(jnp.max(jnp.abs(f32 - want))) > 0
    # with_compute_dtype changes the dtype only: the same parameter paths.
    gd = with_compute_dtype(graphdef, params, "bfloat16")
    assert jax.tree.structure(nnx.split(nnx.merge(gd, params))[1]) == jax.tree.structure(params)


def test_an_int8_sampler_reads_the_current_weights_quantized():
    cfg = ModelConfig.tiny()
    graphdef, params = _split(cfg)
    sp = SamplerPrecision(graphdef, params, cfg, "", "int8")
    view = sp.view(params)
    q = [a for a in jax.tree.leaves(view, is_leaf=quantized.is_quantized) if quantized.is_quantized(a)]
    assert q and all(a.qvalue.dtype == jnp.int8 for a in q)
    # The model holding the dequantized weights computes what the sampler computes.
    tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, cfg.vocab_size)
    deq = quantized.dequantized(view)
    np.testing.assert_allclose(
        np.asarray(_logits(sp.graphdef, view, tokens)),
        np.asarray(_logits(graphdef, deq, tokens)),
        rtol=1e-6,
        atol=1e-6,
    )
    # Re-quantized from the parameters given: a changed policy, a changed sampler.
    moved = jax.tree.map(lambda a: a * 1.5, params)
    assert not np.allclose(
        np.asarray(_logits(sp.graphdef, sp.view(moved), tokens)),
        np.asarray(_logits(sp.graphdef, view, tokens)),
    )
    with pytest.raises(ValueError, match="sampler_quantization"):
        SamplerPrecision(graphdef, params, cfg, "", "int3")


def test_a_quantized_sampler_over_a_quantized_base_is_refused():
    c = stability_config.get_config("smoke")
    c.lora.rank = 4
    c.lora.base_quantization = "int8"
    c.rollout.sampler_quantization = "int8"
    with pytest.raises(config_lib.ConfigError, match="rollout.sampler_quantization"):
        config_lib.validate(c, num_devices=1)


def _rl_mismatch(tmp_path, name, **rollout):
    c = stability_config.get_config("smoke")
    c.total_rl_steps = 1
    for k, v in rollout.items():
        c.rollout[k] = v
    train.run(c, str(tmp_path / name))
    with open(tmp_path / name / "metrics.jsonl") as f:
        (rec,) = [r for r in map(json.loads, f) if r.get("phase") == "rl" and r["step"] == 1]
    return rec["mismatch_kl"]


def test_an_rl_run_with_a_bf16_sampler_measures_the_mismatch(tmp_path):
    same = _rl_mismatch(tmp_path, "same")
    bf16 = _rl_mismatch(tmp_path, "bf16", sampler_dtype="bfloat16")
    assert same < 1e-12 < 1e-9 < bf16
    assert os.path.exists(tmp_path / "bf16" / "config.json")
