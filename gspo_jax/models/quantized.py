"""A quantized frozen base for LoRA (QLoRA): the linear weights stored in int8 or int4.

``config.lora.base_quantization`` 'int8' or 'int4' stores every weight of a module's
``LORA_WEIGHTS`` table (attention q/k/v/o, the dense MLPs' gate/up/down, the experts'
gate/up/down) as a qwix `QArray` (integer values and f32 scales) in the value of its own
``nnx.Param``, so the model's graphdef, its parameter paths and its scan over layers are
those of the unquantized model.  The embedding, the output head, the norms and the
routers stay as they are (the compute dtype; the routers f32).  The adapters are not
quantized: they stay f32 and trained (`gspo_jax.models.lora`).

The quantization is qwix's (``qwix.quantize``: symmetric, absmax calibration,
round to nearest): scale s = absmax / (qmax + 1/2), q = round(w / s) clipped to the
integer range, so |dequantize(q) - w| <= s / 2 elementwise.

* int8: one scale per output channel, i.e. absmax over the weight's input dims, for
  every layer of the stack and every expert separately;
* int4: one scale per group of `INT4_GROUP` consecutive elements of the last input dim
  (gcd(size, `INT4_GROUP`) when the dim is not a multiple of it), for every index of
  the other dims (attention o [H, hd, D]: per head, 32 of hd, output channel).

The forward reads a quantized weight through `read`: ``qwix.dequantize`` (q * s in f32)
rounded to the compute dtype, one layer's weights at a time inside the layer scan; the
result goes where the unquantized weight went, so every MoE dispatch (dense, ragged,
blocked, expert parallel) and the adapters' low-rank term run unchanged.  qwix's own
interception (``qwix.PtqProvider`` with ``qwix.quantize_model``) does not work on these
modules; docs/lora.md says why.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

SCHEMES = ("none", "int8", "int4")
QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
# int4's group size along the last input dim (QLoRA's NF4 uses 64; 32 keeps the scale
# overhead at 1 f32 per 32 weights, 1 bit per weight).
INT4_GROUP = 32


def is_quantized(x) -> bool:
    return isinstance(x, qwix.QArray)


def axes(shape, n_lead: int, n_in: int, n_dims: int, scheme: str):
    """(channelwise axes, tiled axes) of a weight of ``shape``: its stack dims, then
    ``n_dims`` dims (``n_lead`` lead (experts), ``n_in`` input, the rest output), as in
    the modules' ``LORA_WEIGHTS`` tables."""
    st = len(shape) - n_dims
    inputs = range(st + n_lead, st + n_lead + n_in)
    if scheme == "int8":  # one scale per output channel: over every input dim
        return tuple(i for i in range(len(shape)) if i not in inputs), {}
    # int4: groups along the last input dim, a scale per index of every other dim
    last = inputs[-1]
    channelwise = tuple(i for i in range(len(shape)) if i != last)
    return channelwise, {last: math.gcd(shape[last], INT4_GROUP)}


def quantize(w: jax.Array, n_lead: int, n_in: int, n_dims: int, scheme: str) -> qwix.QArray:
    """``w`` (any float dtype; quantized from its f32 values) as a `QArray` of
    ``scheme`` ('int8' or 'int4'), the scales in f32."""
    if scheme not in QTYPES:
        raise ValueError(f"base_quantization: expected one of {SCHEMES[1:]}, got {scheme!r}")
    channelwise, tiled = axes(w.shape, n_lead, n_in, n_dims, scheme)
    return qwix.quantize(
        w.astype(jnp.float32), QTYPES[scheme], channelwise_axes=channelwise, tiled_axes=tiled
    )


def quantize_base(model: nnx.Module, scheme: str) -> nnx.Module:
    """Every weight of ``model``'s ``LORA_WEIGHTS`` tables quantized in place (its
    Param's value a `QArray`); ``model`` returned.  'none' leaves it as it is."""
    if scheme == "none":
        return model
    for _, module in nnx.iter_modules(model):
        for name, (_, n_lead, n_in, n_dims) in (
            getattr(module, "LORA_WEIGHTS", None) or {}
        ).items():
            var = getattr(module, name)
            if is_quantized(var.get_value()):
                raise ValueError(f"{type(module).__name__}.{name}: already quantized")
            var.set_value(quantize(var.get_value(), n_lead, n_in, n_dims, scheme))
    return model


def dequantize_base(model: nnx.Module) -> nnx.Module:
    """Every quantized weight of ``model`` replaced, in place, by its dequantized f32
    value (the export of a quantized run: the base its adapters were trained on)."""
    for _, module in nnx.iter_modules(model):
        for name in getattr(module, "LORA_WEIGHTS", None) or {}:
            var = getattr(module, name)
            if is_quantized(var.get_value()):
                var.set_value(read(var, jnp.float32))
    return model


def read(var: nnx.Variable, dtype) -> jax.Array:
    """The weight ``var`` in ``dtype``: dequantized (in f32, then rounded) when quantized,
    ``var[...].astype(dtype)`` otherwise."""
    value = var.get_value()
    if is_quantized(value):
        return qwix.dequantize(value).astype(dtype)
    return var[...].astype(dtype)


def dequantized(tree):
    """``tree`` with every quantized weight replaced by its dequantized f32 value (the
    same leaves where there is none)."""
    return jax.tree.map(
        lambda a: qwix.dequantize(a) if is_quantized(a) else a, tree, is_leaf=is_quantized
    )


def stored_bytes(tree) -> int:
    """The bytes of ``tree``'s arrays at their logical widths: int4 values at 4 bits
    (numpy's itemsize counts them as 1 byte; XLA may store them either way)."""
    total = 0
    for a in jax.tree.leaves(tree):
        bits = 4 if a.dtype == jnp.int4 else 8 * a.dtype.itemsize
        total += a.size * bits // 8
    return total
