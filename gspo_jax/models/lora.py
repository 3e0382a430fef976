"""LoRA adapters: low-rank updates of the model's weights, experts included.

For a weight W (``module.w``) the adapters are ``module.w_lora_a`` (A) and
``module.w_lora_b`` (B), parameters of type `LoRAParam` in the same module, so that
``nnx.split(model, LoRAParam, ...)`` separates them from the base.  The forward
computes

    x W + (alpha / r) (x A) B

where A contracts x over W's input dims into r and B maps r to W's output dims
(docs/lora.md has the shapes of every target).  Every adapter carries the weight's
leading stack (layer) dims, and the experts' A [E, D, r] and B [E, r, F] their expert
dim: the MoE dispatch runs them through the same grouping as the expert weights
(`gspo_jax.models.dispatch`), never forming W + s A B.

Init as PEFT's: A ~ N(0, 1 / fan_in), B = 0, so a fresh adapter changes nothing.
Adapters are stored in f32 whatever the base's dtype; the forward casts them to the
compute dtype as it does every weight.  Logical axes: A takes the weight's input axis
names and ``"lora_rank"`` (in no rule: unsharded), B ``"lora_rank"`` and the
output axis names; the experts' keep ``"expert"``, so expert parallelism shards them
with their experts.

`add_adapters` attaches adapters to a built model (after its base parameters, so the
base's initialisation, and its RNG stream, is the same with LoRA as without);
`merge` folds them into the base (tests, the merged export; `fold` in place, the one
fold of W + (alpha/r) A B, which the Hugging Face export uses too); `adapters_off` is the
reference policy's parameters: the same arrays with every B zeroed (no copy of the
base).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models import quantized

# Target names (``config.lora.targets``) -> (module kind, weight name).
TARGETS = {
    "q": ("attention", "q"),
    "k": ("attention", "k"),
    "v": ("attention", "v"),
    "o": ("attention", "o"),
    "gate": ("mlp", "gate"),
    "up": ("mlp", "up"),
    "down": ("mlp", "down"),
    "expert_gate": ("moe", "gate"),
    "expert_up": ("moe", "up"),
    "expert_down": ("moe", "down"),
}
RANK_AXIS = "lora_rank"


class LoRAParam(nnx.Param):
    """An adapter matrix (A or B of a LoRA pair): trainable when the base is frozen."""


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """What reaches the modules: rank r (> 0), alpha, the targets (`TARGETS` keys)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


class LoRAWeight(NamedTuple):
    """A weight with its adapters, as the forward uses them: w the base, a, and b
    already multiplied by alpha / r, all in the compute dtype."""

    w: jax.Array
    a: jax.Array
    b: jax.Array


def base(w):
    """The base weight of ``w`` (an array or a `LoRAWeight`)."""
    return w.w if isinstance(w, LoRAWeight) else w


def weight(module, name: str, dtype):
    """``module.<name>`` in ``dtype`` (dequantized when the base is quantized,
    `gspo_jax.models.quantized`), with its adapters (a `LoRAWeight`) when it has them;
    the plain array otherwise (the forward without LoRA, unchanged)."""
    w = quantized.read(getattr(module, name), dtype)
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return w
    spec = getattr(module, "lora", None)
    if spec is None:
        raise ValueError(
            f"{type(module).__name__}.{name}_lora_a: adapters without their scaling; attach "
            "them with gspo_jax.models.lora.add_adapters (or set the module's lora spec)"
        )
    b = getattr(module, f"{name}_lora_b")[...].astype(dtype) * spec.scale
    return LoRAWeight(w, a[...].astype(dtype), b)


def einsum(spec: str, x, w, *, n_out: int = 1, n_lead: int = 0):
    """``jnp.einsum(spec, x, W)``, plus ``(x A) B`` when ``w`` is a `LoRAWeight`.

    spec "X,W->O": W's subscripts are ``n_lead`` lead dims (the experts'), its input
    dims, then ``n_out`` output dims, the last of O; A's are W's with its output dims
    replaced by r, B's the lead dims, r and the output dims."""
    if not isinstance(w, LoRAWeight):
        return jnp.einsum(spec, x, w)
    xs, rest = spec.split(",")
    ws, out = rest.split("->")
    a_spec = f"{xs},{ws[:-n_out]}r->{out[:-n_out]}r"
    b_spec = f"{out[:-n_out]}r,{ws[:n_lead]}r{ws[-n_out:]}->{out}"
    return jnp.einsum(spec, x, w.w) + jnp.einsum(b_spec, jnp.einsum(a_spec, x, w.a), w.b)


def _names(var) -> tuple:
    meta = var.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding_names"))
    return tuple(names) if names is not None else (None,) * var.ndim


def _pair(w: nnx.Param, key, rank: int, n_lead: int, n_in: int, n_dims: int):
    """(A, B) for the weight ``w``: its stack dims, then ``n_dims`` dims (``n_lead``
    lead, ``n_in`` input, the rest output)."""
    shape, names = tuple(w.shape), _names(w)
    st = w.ndim - n_dims
    lead, inp, out = (
        slice(st, st + n_lead),
        slice(st + n_lead, st + n_lead + n_in),
        slice(st + n_lead + n_in, None),
    )
    a_shape = shape[:st] + shape[lead] + shape[inp] + (rank,)
    a_names = names[:st] + names[lead] + names[inp] + (RANK_AXIS,)
    b_shape = shape[:st] + shape[lead] + (rank,) + shape[out]
    b_names = names[:st] + names[lead] + (RANK_AXIS,) + names[out]
    a = jax.random.normal(key, a_shape, jnp.float32) * math.prod(shape[inp]) ** -0.5
    b = jnp.zeros(b_shape, jnp.float32)
    kw = dict(eager_sharding=False)
    return LoRAParam(a, out_sharding=a_names, **kw), LoRAParam(b, out_sharding=b_names, **kw)


def add_adapters(model: nnx.Module, spec: LoRASpec, key: jax.Array) -> nnx.Module:
    """Attach ``spec``'s adapters to ``model`` (in place; also returned): every module
    with a ``LORA_WEIGHTS`` table (attention, dense MLP, MoE) gets ``<w>_lora_a`` /
    ``<w>_lora_b`` for its weights among the targets, and ``lora = spec``.  The keys
    are ``fold_in(key, i)``, i counting the adapted weights in module order."""
    unknown = sorted(set(spec.targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"lora.targets: unknown {unknown}; targets are {sorted(TARGETS)}")
    i = 0
    for _, module in nnx.iter_modules(model):
        table = getattr(module, "LORA_WEIGHTS", None)
        if not table:
            continue
        for name, (target, n_lead, n_in, n_dims) in table.items():
            if target not in spec.targets:
                continue
            w = getattr(module, name)
            a, b = _pair(w, jax.random.fold_in(key, i), spec.rank, n_lead, n_in, n_dims)
            setattr(module, f"{name}_lora_a", a)
            setattr(module, f"{name}_lora_b", b)
            module.lora = spec
            i += 1
    return model


def _adapted(model: nnx.Module):
    """(module, weight name, n_lead, n_in, n_dims) of every adapted weight."""
    for _, module in nnx.iter_modules(model):
        for name, (_, n_lead, n_in, n_dims) in (
            getattr(module, "LORA_WEIGHTS", None) or {}
        ).items():
            if hasattr(module, f"{name}_lora_a"):
                yield module, name, n_lead, n_in, n_dims


def delta(a, b, scale: float, n_lead: int, n_in: int, n_dims: int, w_shape):
    """scale * A B as an f32 array of the weight's shape (stack + lead + in + out); A and
    B jax or numpy arrays, with the weight's stack dims or without (one layer's)."""
    st = len(w_shape) - n_dims
    lead = a.shape[: st + n_lead]
    a2 = a.reshape(lead + (-1, a.shape[-1])).astype(jnp.float32)  # [..., I, r]
    b2 = b.reshape(lead + (b.shape[st + n_lead], -1)).astype(jnp.float32)  # [..., r, O]
    return (scale * jnp.matmul(a2, b2, precision="highest")).reshape(w_shape)


def merged(w, a, b, scale: float, dims: tuple[int, int, int]):
    """W + scale * A B, summed in f32 (the caller casts); ``dims`` the weight's
    (n_lead, n_in, n_dims) of its module's ``LORA_WEIGHTS``."""
    return w.astype(jnp.float32) + delta(a, b, scale, *dims, w.shape)


def fold(model: nnx.Module, scale: float | None = None, *, drop: bool = True) -> nnx.Module:
    """Fold every adapter of ``model`` into its weight, in place: W <- W + scale A B
    (`merged`, stored in W's dtype; ``scale`` by default each module's alpha / r); then
    the adapters are removed (``drop``) or every B zeroed, so the model computes the
    same with the adapters on or off."""
    for module, name, n_lead, n_in, n_dims in list(_adapted(model)):
        w = getattr(module, name)
        a, b = getattr(module, f"{name}_lora_a"), getattr(module, f"{name}_lora_b")
        s = module.lora.scale if scale is None else scale
        dims = (n_lead, n_in, n_dims)
        if quantized.is_quantized(w.get_value()):  # dequantized; the merged weight f32
            w.set_value(merged(quantized.read(w, jnp.float32), a[...], b[...], s, dims))
        else:
            w[...] = merged(w[...], a[...], b[...], s, dims).astype(w.dtype)
        if drop:
            delattr(module, f"{name}_lora_a")
            delattr(module, f"{name}_lora_b")
        else:
            b[...] = jnp.zeros_like(b[...])
    if drop:
        _drop_spec(model)
    return model


def _drop_spec(model: nnx.Module) -> None:
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "lora"):
            del module.lora


def without_adapters(model: nnx.Module) -> nnx.Module:
    """``model`` (in place; also returned) with its adapters removed: the base alone."""
    for module, name, *_ in list(_adapted(model)):
        delattr(module, f"{name}_lora_a")
        delattr(module, f"{name}_lora_b")
    _drop_spec(model)
    return model


def merge(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with every adapter folded into its weight (W + (alpha/r) A B,
    summed in f32, stored in W's dtype) and no adapters: the model a LoRA model
    computes, as a plain model (tests; the merged Hugging Face export).  A quantized
    weight (`gspo_jax.models.quantized`) is dequantized first, the merged weight f32."""
    return fold(nnx.clone(model))


def merge_params(graphdef, params):
    """`merge` on a split model: (the graphdef and the parameters of the merged model,
    without adapters)."""
    return nnx.split(merge(nnx.merge(graphdef, params)))


def adapters_off(params):
    """The parameters (an ``nnx.State``) with every adapter's B zeroed: the base's
    forward (x W + (x A) 0 = x W), the reference policy of the KL terms.  Only the
    B matrices are new arrays; the base is the same arrays."""

    def off(path, x):
        last = path[-2] if len(path) > 1 else path[-1]
        key = str(getattr(last, "key", getattr(last, "name", last)))
        return jnp.zeros_like(x) if key.endswith("_lora_b") else x

    return jax.tree_util.tree_map_with_path(off, params)


# Which parameters a train step updates (`gspo_jax.step`): 'all'; 'lora' (the
# adapters, and a PPO critic's value head, which no adapter stands for);
# 'lora+router' (and the routers, `config.lora.train_router`); 'base' (all but the
# adapters: a warm start of a model that carries fresh ones).
TRAINABLE = ("all", "lora", "lora+router", "base")


def trainable_filter(kind: str):
    """The nnx filter of the parameters ``kind`` (`TRAINABLE`) trains."""
    head = (nnx.PathContains("value_w"), nnx.PathContains("value_b"))
    if kind == "lora":
        return nnx.Any(LoRAParam, *head)
    if kind == "lora+router":
        return nnx.Any(LoRAParam, nnx.PathContains("router"), *head)
    if kind == "base":
        return nnx.Not(LoRAParam)
    raise ValueError(f"trainable: expected one of {TRAINABLE}, got {kind!r}")


def partition(params, kind: str):
    """(trainable, frozen) parts of ``params`` (an ``nnx.State``) for ``kind``;
    (params, None) for 'all'."""
    if kind == "all":
        return params, None
    return nnx.split_state(params, trainable_filter(kind), ...)


def join(trainable, frozen):
    """The inverse of `partition`."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def count(params) -> tuple[int, int]:
    """(elements, bytes) of the arrays of ``params``."""
    leaves = jax.tree.leaves(params)
    return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)
