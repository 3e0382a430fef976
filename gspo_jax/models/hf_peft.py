"""LoRA adapters in PEFT's format, and the merged weights export_pretrained writes.

Our adapters (docs/lora spec) are parameters beside the weight they adapt, in the
same module: ``<w>_lora_a`` and ``<w>_lora_b``, stacked over layers like every
parameter, f32, scaling alpha / r; the layer computes x·W + (alpha/r)·(x·A)·B.
PEFT's Linear adapter is ``lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r]
(HF's [out, in] convention), same scaling. Per layer i (``P`` is
``base_model.model.model.layers.{i}``)::

    attn.q_lora_a [D, r]   <-> P.self_attn.q_proj.lora_A.weight [r, D]      (A.T)
    attn.q_lora_b [r, H, hd] <-> P.self_attn.q_proj.lora_B.weight [H*hd, r]
    attn.o_lora_a [H, hd, r] <-> P.self_attn.o_proj.lora_A.weight [r, H*hd]
    mlp.gate_lora_a [D, r] <-> P.mlp.gate_proj.lora_A.weight          (dense MLP)
    mlp.gate_lora_a [E, D, r] <-> P.mlp.experts.{e}.gate_proj.lora_A.weight [r, D]

The experts are written per expert (the checkpoint layout of Qwen3-MoE, which
transformers >= 5 fuses on load into ``experts.gate_up_proj`` [E, 2I, D] and
``experts.down_proj`` [E, D, I]; PEFT >= 0.18 converts such an adapter to LoRA on
those parameters, and vLLM's LoRA loader reads per-expert adapters). Reading also
accepts the adapters PEFT itself writes on transformers >= 5, LoRA on the fused
parameters (``target_parameters``): ``P.mlp.experts.base_layer.lora_A.weight``
[E*r, D] / ``lora_B.weight`` [2I, r*E] (gate_up_proj, gate and up sharing A, or
block-diagonal at rank 2r when converted from per-expert adapters) and
``P.mlp.experts.lora_A.weight`` [E*r, I] / ``lora_B.weight`` [D, r*E] (down_proj).

`export_peft` (in hf_export) writes; `read_peft_config` and `load_peft` read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.models.hf_layout import layer_slots
from gspo_jax.models.safetensors_io import TensorReader, tensor_infos
from gspo_jax.models.transformer import Transformer

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model.model.layers."

# target -> (module in the block, weight, HF module; {e} is the expert)
TARGETS: dict[str, tuple[str, str, str]] = {
    "q": ("attn", "q", "self_attn.q_proj"),
    "k": ("attn", "k", "self_attn.k_proj"),
    "v": ("attn", "v", "self_attn.v_proj"),
    "o": ("attn", "o", "self_attn.o_proj"),
    "gate": ("mlp", "gate", "mlp.gate_proj"),
    "up": ("mlp", "up", "mlp.up_proj"),
    "down": ("mlp", "down", "mlp.down_proj"),
    "expert_gate": ("mlp", "gate", "mlp.experts.{e}.gate_proj"),
    "expert_up": ("mlp", "up", "mlp.experts.{e}.up_proj"),
    "expert_down": ("mlp", "down", "mlp.experts.{e}.down_proj"),
}
EXPERT_TARGETS = ("expert_gate", "expert_up", "expert_down")
DENSE_MLP_TARGETS = ("gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class PeftLora:
    """What a PEFT adapter needs besides its tensors (the fields of config.lora
    it uses): rank, alpha (scaling alpha / rank) and the targets (TARGETS' keys)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


# ---------------------------------------------------------------- the layout
def lora_delta(a, b, experts: bool):
    """A·B contracted over the rank, in the weight's layout: a [in..., r] and
    b [r, out...] give [in..., out...]; with ``experts`` a [E, in, r] and b [E, r, out]
    give [E, in, out]. numpy or jax arrays, computed in f32."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    r = a.shape[-1]
    if experts:
        e = a.shape[0]
        d = a.reshape(e, -1, r) @ b.reshape(e, r, -1)
        return d.reshape(a.shape[:-1] + b.shape[2:])
    return (a.reshape(-1, r) @ b.reshape(r, -1)).reshape(a.shape[:-1] + b.shape[1:])


def merged_weight(w, a, b, scaling: float, experts: bool):
    """W + scaling·A·B in f32 (the caller casts)."""
    return w.astype(np.float32) + scaling * lora_delta(a, b, experts)


def merge_lora(model: Transformer, scaling: float) -> None:
    """Fold the adapters into their weights in place: W <- W + scaling·A·B (in f32,
    cast to W's dtype), then B <- 0, so the model computes what the merged
    weights compute with the adapters on or off."""
    for seg in model.segments:
        for blk in seg.blocks:
            for target, module, w in block_adapters(blk):
                p, a, b = (getattr(module, n) for n in (w, f"{w}_lora_a", f"{w}_lora_b"))
                experts = target in EXPERT_TARGETS
                fn = lambda w_, a_, b_, e=experts: merged_weight(w_, a_, b_, scaling, e)  # noqa: E731
                p.set_value(jax.vmap(fn)(p[...], a[...], b[...]).astype(p[...].dtype))
                b.set_value(jnp.zeros_like(b[...]))


def block_adapters(blk) -> Iterator[tuple[str, object, str]]:
    """``(target, module, weight)`` for each adapted weight of the block ``blk``."""
    for target, (mod, w, _) in TARGETS.items():
        if mod == "mlp" and (target in EXPERT_TARGETS) != bool(blk.is_moe):
            continue
        module = getattr(blk, mod)
        if getattr(module, f"{w}_lora_a", None) is not None:
            yield target, module, w


def model_targets(model: Transformer) -> tuple[str, ...]:
    """The targets the model holds adapters for, in TARGETS' order."""
    found = {t for blk, _ in layer_slots(model) for t, _, _ in block_adapters(blk)}
    return tuple(t for t in TARGETS if t in found)


def to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One (expert's) adapter, ours -> PEFT's: (lora_A [r, in], lora_B [out, r])."""
    r = a.shape[-1]
    return a.reshape(-1, r).T, b.reshape(r, -1).T


def check_exportable(model: Transformer, lora) -> tuple[str, ...]:
    """The model's targets, checked against ``lora`` and against what PEFT on
    transformers >= 5 can express; raises ValueError naming what is not."""
    targets = model_targets(model)
    if not targets:
        raise ValueError("export_peft: the model holds no LoRA adapters (<w>_lora_a)")
    if set(lora.targets) != set(targets):
        raise ValueError(
            f"export_peft: lora.targets {sorted(lora.targets)} but the model holds "
            f"adapters for {sorted(targets)}"
        )
    cfg = model.cfg
    if cfg.num_experts > 0 and any(t in targets for t in DENSE_MLP_TARGETS):
        if not all(cfg.layer_kinds):
            raise ValueError(
                "export_peft: dense-MLP targets (gate, up, down) on a Qwen3-MoE with dense "
                "layers: PEFT on transformers >= 5 maps gate_proj / up_proj / down_proj to "
                "the experts' fused parameters only, so these adapters would be dropped; "
                "export merged weights instead"
            )
    if ("expert_gate" in targets) != ("expert_up" in targets):
        raise ValueError(
            "export_peft: expert_gate without expert_up (or the reverse): transformers >= 5 "
            "fuses them into experts.gate_up_proj and PEFT refuses an adapter on one "
            "alone; target both"
        )
    return targets


def adapter_config(lora, targets, base_model_name_or_path: Optional[str]) -> dict:
    """adapter_config.json for ``targets`` (what peft's LoraConfig and vLLM read)."""
    modules = sorted({TARGETS[t][2].rsplit(".", 1)[-1] for t in targets})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(lora.rank),
        "lora_alpha": float(lora.alpha),
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }


# ---------------------------------------------------------------- reading
def read_peft_config(path: str) -> PeftLora:
    """rank, alpha and targets of the PEFT adapter in the folder ``path`` (targets
    from the tensor names, so the model can be built with the matching
    config.lora before `load_peft`). Raises ValueError on what ours cannot hold:
    DoRA, trained biases, modules_to_save, per-module ranks or alphas (beyond the
    2r of a fused gate_up_proj converted by PEFT)."""
    cfg, infos = _read(path)
    roles, targets = _fused_roles(cfg), set()
    for name in infos:
        targets.update(_targets_of(name, roles))
    return PeftLora(cfg["r"], cfg["lora_alpha"], tuple(t for t in TARGETS if t in targets))


def _read(path: str):
    """The validated adapter_config.json (``lora_alpha`` with use_rslora folded in)
    and the headers of adapter_model.safetensors."""
    cfg_file, file = os.path.join(path, ADAPTER_CONFIG), os.path.join(path, ADAPTER_FILE)
    for f in (cfg_file, file):
        if not os.path.isfile(f):
            raise ValueError(f"{path}: no {os.path.basename(f)} (not a PEFT adapter folder)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{cfg_file}: invalid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_file}: peft_type is not 'LORA'")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{cfg_file}: r={r!r} is not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{cfg_file}: lora_alpha={alpha!r} is not a number")
    for key in ("use_dora", "lora_bias", "modules_to_save", "fan_in_fan_out"):
        if cfg.get(key):
            raise ValueError(f"{cfg_file}: {key}={cfg[key]!r} is not supported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise ValueError(f"{cfg_file}: bias={cfg['bias']!r} is not supported")
    patterns = {**(cfg.get("rank_pattern") or {}), **(cfg.get("alpha_pattern") or {})}
    if any("gate_up_proj" not in k for k in patterns):
        raise ValueError(
            f"{cfg_file}: rank_pattern / alpha_pattern {sorted(patterns)}: per-module "
            "ranks are not supported (one rank and alpha for every adapter)"
        )
    if cfg.get("use_rslora"):  # scaling alpha / sqrt(r) = (alpha * sqrt(r)) / r
        alpha = alpha * math.sqrt(r)
    return dict(cfg, r=r, lora_alpha=float(alpha)), tensor_infos(file)


def _fused_roles(cfg: dict) -> dict[str, tuple[str, ...]]:
    """Which module names hold PEFT's LoRA on the fused expert parameters: with both
    targeted, gate_up_proj's wrapper is the inner one (``experts.base_layer``)."""
    tp = cfg.get("target_parameters") or []
    gate_up = any(str(t).endswith("gate_up_proj") for t in tp)
    down = any(str(t).endswith("down_proj") for t in tp)
    if gate_up and down:
        return {"mlp.experts.base_layer": GATE_UP, "mlp.experts": ("expert_down",)}
    if gate_up or down:
        return {"mlp.experts": GATE_UP if gate_up else ("expert_down",)}
    return {}


GATE_UP = ("expert_gate", "expert_up")


def _parse(name: str):
    """``(layer, module, lora)`` of a PEFT tensor name, e.g. (3, 'self_attn.q_proj',
    'lora_A'), or None for a name that is not a layer's LoRA tensor."""
    if not name.startswith(PREFIX) or not name.endswith(".weight"):
        return None
    rest = name[len(PREFIX) : -len(".weight")]
    layer, _, rest = rest.partition(".")
    module, _, lora = rest.rpartition(".")
    if not layer.isdigit() or lora not in ("lora_A", "lora_B"):
        return None
    return int(layer), module, lora


def _targets_of(name: str, roles: dict) -> tuple[str, ...]:
    parsed = _parse(name)
    if parsed is None:
        raise ValueError(f"{ADAPTER_FILE}: tensor {name!r} is not a LoRA tensor we read")
    module = parsed[1]
    if module in roles:
        return roles[module]
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit():
        module = "mlp.experts.{e}." + parts[3]
    for target, (_, _, hf) in TARGETS.items():
        if hf == module:
            return (target,)
    raise ValueError(f"{ADAPTER_FILE}: tensor {name!r} adapts no module we have")


def _from_peft(la: np.ndarray, lb: np.ndarray, in_shape, out_shape):
    """PEFT's (lora_A [r, in], lora_B [out, r]) -> ours (A [in..., r], B [r, out...])."""
    r = la.shape[0]
    return la.T.reshape(tuple(in_shape) + (r,)), lb.T.reshape((r,) + tuple(out_shape))


def _fused(la, lb, e, rank, target, f):
    """Our (A [E, in, rank], B [E, rank, out]) from PEFT's LoRA on a fused expert
    parameter: la [E*r', in] (expert-major), lb [out', r'*E] (expert-minor)."""
    rr = la.shape[0] // e
    a = la.reshape(e, rr, -1).swapaxes(1, 2)  # [E, in, r']
    b = lb.reshape(lb.shape[0], rr, e).transpose(2, 1, 0)  # [E, r', out']
    if target == "expert_down":
        return a, b
    half = slice(0, f) if target == "expert_gate" else slice(f, 2 * f)
    b = b[:, :, half]
    if rr == rank:  # gate and up share A
        return a, b
    if rr != 2 * rank:
        raise ValueError(
            f"{ADAPTER_FILE}: gate_up_proj LoRA of rank {rr}, expected {rank} or {2 * rank}"
        )
    ours = slice(0, rank) if target == "expert_gate" else slice(rank, 2 * rank)
    other = slice(rank, 2 * rank) if target == "expert_gate" else slice(0, rank)
    if np.any(b[:, other, :]):
        raise ValueError(
            f"{ADAPTER_FILE}: gate_up_proj LoRA of rank 2r={rr} is not block-diagonal "
            "over gate and up: it needs rank 2r for each, not r"
        )
    return a[:, :, ours], b[:, ours, :]


def load_peft(path: str, model: Transformer) -> PeftLora:
    """Set the model's adapters from the PEFT adapter in the folder ``path``.

    The model must hold adapters (``<w>_lora_a`` / ``<w>_lora_b``) for exactly the
    adapter's targets at its rank (build it with config.lora from
    `read_peft_config`); each is replaced whole, on its sharding, in its dtype.
    Layers the file leaves out (PEFT's layers_to_transform) get zero adapters.
    Returns the adapter's rank, alpha (``use_rslora``'s alpha / sqrt(r) scaling
    folded into it) and targets: the caller's config.lora must use that alpha.
    """
    cfg, infos = _read(path)
    roles = _fused_roles(cfg)
    lora = read_peft_config(path)
    held = model_targets(model)
    if set(held) != set(lora.targets):
        raise ValueError(
            f"{path}: the adapter targets {sorted(lora.targets)}, the model holds adapters "
            f"for {sorted(held)}"
        )
    files: dict[tuple[int, str], dict[str, str]] = {}
    for name in infos:
        layer, module, which = _parse(name)
        files.setdefault((layer, module), {})[which] = name
    fused_of = {t: m for m, ts in roles.items() for t in ts}
    values: dict[int, tuple[object, np.ndarray]] = {}
    used = set()
    with TensorReader() as reader:

        def get(layer, module):
            names = files.get((layer, module))
            if names is None:
                return None
            if set(names) != {"lora_A", "lora_B"}:
                raise ValueError(f"{path}: layer {layer} {module}: lora_A or lora_B missing")
            used.add((layer, module))
            return [
                np.asarray(reader.array(infos[names[w]]), np.float32) for w in ("lora_A", "lora_B")
            ]

        for i, (blk, r) in enumerate(layer_slots(model)):
            for target, module, w in block_adapters(blk):
                pa, pb = getattr(module, f"{w}_lora_a"), getattr(module, f"{w}_lora_b")
                if pa.shape[-1] != lora.rank:
                    raise ValueError(
                        f"{path}: rank {lora.rank}, the model's {target} adapters {pa.shape[-1]}"
                    )
                for p in (pa, pb):
                    values.setdefault(id(p), (p, np.zeros(p.shape, np.float32)))
                a_out, b_out = values[id(pa)][1][r], values[id(pb)][1][r]
                hf = TARGETS[target][2]
                if target not in EXPERT_TARGETS:
                    got = get(i, hf)
                    if got is not None:
                        a_out[...], b_out[...] = _from_peft(*got, a_out.shape[:-1], b_out.shape[1:])
                elif (i, fused_of.get(target)) in files:
                    la, lb = get(i, fused_of[target])
                    a, b = _fused(la, lb, a_out.shape[0], lora.rank, target, model.cfg.moe_d_ff)
                    if a.shape != a_out.shape or b.shape != b_out.shape:
                        raise ValueError(
                            f"{path}: layer {i} {fused_of[target]}: LoRA of shapes "
                            f"{la.shape}, {lb.shape} does not fit {target}"
                        )
                    a_out[...], b_out[...] = a, b
                else:
                    for x in range(a_out.shape[0]):
                        got = get(i, hf.format(e=x))
                        if got is not None:
                            a_out[x], b_out[x] = _from_peft(
                                *got, a_out.shape[1:-1], b_out.shape[2:]
                            )
    unused = sorted(set(files) - used)
    if unused:
        raise ValueError(
            f"{path}: LoRA tensors for modules the model has no adapter at: {unused[:4]}"
        )
    for p, value in values.values():
        old = p[...]
        p.set_value(jax.device_put(jnp.asarray(value, old.dtype), old.sharding))
    return lora
