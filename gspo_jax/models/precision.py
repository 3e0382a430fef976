"""Where the model's precision departs from the compute dtype, and a copy for inference.

`F32_PARAMS` are read in float32 whatever the compute dtype; `head_logits` is
the output projection with f32 logits and a backward in the compute dtype;
`inference_params` casts a model's parameters to the compute dtype once, ahead
of the forward passes that would cast them every time; `SamplerPrecision` is the
sampler's own precision (``rollout.sampler_dtype``, ``rollout.sampler_quantization``),
the numerical train-inference mismatch of an inference engine that computes in bf16
or reads quantized weights while the trainer computes in f32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models import quantized
from gspo_jax.models.config import ModelConfig

# Parameters the forward reads in float32 whatever the compute dtype: the router
# (its logits are an f32 matmul, moe.MoE) and the value head (Transformer.value).
F32_PARAMS = ("router", "value_w", "value_b")


@jax.custom_vjp
def head_logits(h: jax.Array, w: jax.Array) -> jax.Array:
    """f32 logits h [..., D] @ w [D, V], computed in h's dtype with f32 accumulation.

    Its backward also runs in h's dtype: the f32 logit cotangent is rounded to h's dtype
    before both products, and the weight's gradient comes out in w's dtype (f32
    accumulation). Autodiff of the forward alone would run both backward products in
    f32 (TF32 on a GPU: half the bf16 rate, over the whole vocabulary; 13% of the
    16-layer benchmark's train-step FLOPs, experiments/accelerator/compile/). With h in
    f32 it is autodiff's result."""
    return jnp.einsum("...d,dv->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def _head_logits_fwd(h, w):
    return head_logits(h, w), (h, w)


def _head_logits_bwd(res, dz):
    h, w = res
    dz = dz.astype(h.dtype)
    dh = jnp.einsum("...v,dv->...d", dz, w.astype(h.dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum("...d,...v->dv", h, dz, preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), dw.astype(w.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def inference_params(params, cfg: ModelConfig):
    """A copy of a model's parameters for forward passes only (the RL reference
    policy): every floating parameter the forward casts to the compute dtype
    (`cfg.dtype`) stored in it, those of `F32_PARAMS` as they are.

    The forward gives bitwise the logits it gives from `params`: each of its
    ``param.astype(dtype)`` casts is made once here instead of in every forward
    (a cast to the dtype a value already has is the identity); a quantized weight
    (`gspo_jax.models.quantized`) is kept as it is.  At bf16 compute and
    f32 storage the copy takes half the memory.  Always a new buffer (the trainer
    donates `params` to its update)."""
    dt = cfg.jnp_dtype

    def cast(path, a):
        if quantized.is_quantized(a):  # a quantized base weight: its values and f32 scales
            return jax.tree.map(jnp.copy, a)
        keys = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
        if keys & set(F32_PARAMS) or not jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.copy(a)
        return jnp.copy(a) if a.dtype == dt else a.astype(dt)

    return jax.tree_util.tree_map_with_path(cast, params, is_leaf=quantized.is_quantized)


def with_compute_dtype(graphdef, params, dtype: str):
    """The graphdef of the model ``graphdef`` computing in ``dtype``: every module's
    ``cfg`` (the one place the modules keep the compute dtype) with ``dtype``, the
    parameters' paths and structure (adapters included) unchanged."""
    model = nnx.merge(graphdef, params)
    for _, module in nnx.iter_modules(model):
        cfg = getattr(module, "cfg", None)
        if isinstance(cfg, ModelConfig):
            module.cfg = dataclasses.replace(cfg, dtype=dtype)
    return nnx.split(model)[0]


class SamplerPrecision:
    """The parameters and graph the sampler computes with, when its precision is not
    the trainer's: compute in ``dtype`` ('' or the model's: the trainer's) and the linear
    weights ``quantization`` ('none', 'int8', 'int4'; `gspo_jax.models.quantized`, the
    same weights and schemes as QLoRA's base), re-quantized from the current
    parameters at each publication, as an inference engine loads each new policy.
    Routers, norms and embeddings keep their precision (`inference_params`).

    ``view(params)`` is the sampler's copy (one jitted cast and quantization); with
    the trainer's own precision it is ``params`` itself and ``graphdef`` the model's."""

    def __init__(self, graphdef, params, model_cfg: ModelConfig, dtype: str, quantization: str):
        if quantization not in quantized.SCHEMES:
            raise ValueError(
                f"sampler_quantization: expected one of {quantized.SCHEMES}, got {quantization!r}"
            )
        dtype = dtype or model_cfg.dtype
        self.cfg = dataclasses.replace(model_cfg, dtype=dtype)
        self.same = dtype == model_cfg.dtype and quantization == "none"
        self.graphdef = (
            graphdef if dtype == model_cfg.dtype else with_compute_dtype(graphdef, params, dtype)
        )
        cfg, gd = self.cfg, self.graphdef

        def view(p):
            p = inference_params(p, cfg)
            if quantization == "none":
                return p
            model = quantized.quantize_base(nnx.merge(gd, p), quantization)
            return nnx.split(model)[1]

        self._view = jax.jit(view)

    def view(self, params):
        return params if self.same else self._view(params)
