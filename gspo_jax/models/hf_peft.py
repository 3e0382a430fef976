"""LoRA adapters in PEFT's format, and the merged weights export_pretrained writes.

Our adapters are parameters beside the weight they adapt, in the
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
``experts.down_proj`` [E, D, I]; PEFT >= 0.21, tested with 0.21.2, converts such
an adapter to LoRA on those parameters, and vLLM's LoRA loader reads per-expert
adapters). Reading also accepts the adapters PEFT itself writes on transformers
>= 5, LoRA on the fused parameters (``target_parameters``):
``P.mlp.experts.base_layer.lora_A.weight`` [E*r, D] / ``lora_B.weight`` [2I, r*E]
(gate_up_proj: gate and up sharing A, or block-diagonal at rank 2r when converted
from per-expert adapters) and ``P.mlp.experts.lora_A.weight`` [E*r, I] /
``lora_B.weight`` [D, r*E] (down_proj). docs/checkpoints.md has the details.

`export_peft` (in hf_export) writes; `read_peft` (`read_peft_config`) and `load_peft`
read; `merge_lora` folds the adapters into the weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.models import lora
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.hf_layout import layer_slots
from gspo_jax.models.safetensors_io import TensorReader, tensor_infos
from gspo_jax.models.transformer import Transformer

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model.model.layers."
LORA_AB = ("lora_A", "lora_B")
ROUTER = "mlp.gate"  # an MoE layer's router in HF's layout; PEFT's modules_to_save name

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
def merge_lora(model: Transformer, scaling: float) -> None:
    """Fold the adapters into their weights in place: W <- W + scaling·A·B (in f32,
    cast to W's dtype; `lora.fold`), then B <- 0, so the model computes what the
    merged weights compute with the adapters on or off."""
    lora.fold(model, scaling, drop=False)


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
    if not set(targets) <= set(lora.targets):  # targets a model lacks are fine
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


def adapter_config(
    lora, targets, base_model_name_or_path: Optional[str], modules_to_save=()
) -> dict:
    """adapter_config.json for ``targets`` (what peft's LoraConfig and vLLM read), and
    whole modules the adapter replaces (``modules_to_save``: `ROUTER`)."""
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
        "modules_to_save": list(modules_to_save) or None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }


# ---------------------------------------------------------------- reading
def _shapes(cfg: ModelConfig, target: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input dims, output dims) of the weight ``target`` adapts (one expert's)."""
    d, h, kv, hd, f, mf = (
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.moe_d_ff,
    )
    return {
        "q": ((d,), (h, hd)),
        "k": ((d,), (kv, hd)),
        "v": ((d,), (kv, hd)),
        "o": ((h, hd), (d,)),
        "gate": ((d,), (f,)),
        "up": ((d,), (f,)),
        "down": ((f,), (d,)),
        "expert_gate": ((d,), (mf,)),
        "expert_up": ((d,), (mf,)),
        "expert_down": ((mf,), (d,)),
    }[target]


def read_peft_config(path: str, cfg: ModelConfig) -> PeftLora:
    """rank, alpha and targets of the PEFT adapter in the folder ``path`` for the
    base ``cfg`` (`read_peft`), to build the model with the matching config.lora
    before `load_peft`."""
    return read_peft(path, cfg)[0]


def read_peft(path: str, cfg: ModelConfig):
    """The PEFT adapter in the folder ``path`` in our layout, for the base ``cfg``:
    ``(lora, {(layer, target): (A, B)})`` with A [(E,) in..., rank] and
    B [(E,) rank, out...] as f32 host arrays (experts the file leaves out are zero).

    One rank and one scaling for all: ``PeftLora.rank`` is the largest rank in the file
    (smaller adapters are padded with zeros, which changes nothing), and each B is
    scaled by its module's scaling over ``PeftLora.scaling`` (the file's lora_alpha / r,
    or / sqrt(r) with use_rslora), so per-module rank_pattern / alpha_pattern and
    PEFT's rank-2r gate_up_proj are exact. A gate_up_proj adapter that is
    block-diagonal over gate and up (PEFT's conversion of per-expert adapters)
    splits into rank-r gate and up adapters. Raises ValueError on what ours cannot
    hold (DoRA, trained biases, modules_to_save, a module we do not adapt).
    """
    conf, infos = _read(path)
    roles = _fused_roles(conf)
    files: dict[tuple[int, str], dict[str, str]] = {}
    routers: dict[int, np.ndarray] = {}  # modules_to_save: layer -> router [D, E]
    with TensorReader() as reader:
        for name in infos:
            parsed = _parse(name)
            layer = _router_layer(name) if conf.get("modules_to_save") else None
            if layer is not None:
                w = np.asarray(reader.array(infos[name]), np.float32)
                want = (cfg.num_experts, cfg.d_model)
                if layer >= cfg.num_layers or w.shape != want:
                    raise ValueError(
                        f"{path}: {name}: a router of shape {w.shape} for layer {layer}; "
                        f"the base's MoE layers have routers of shape {want} "
                        f"(HF's [experts, d_model]) and there are {cfg.num_layers} layers"
                    )
                routers[layer] = w.T
                continue
            if parsed is None:
                raise ValueError(f"{path}: tensor {name!r} is not a layer's LoRA tensor")
            files.setdefault(parsed[:2], {})[parsed[2]] = name
    pieces: dict[tuple[int, str], tuple] = {}  # (layer, target) -> (A, B, scaling)
    with TensorReader() as reader:
        for (layer, module), names in sorted(files.items()):
            if set(names) != set(LORA_AB) or layer >= cfg.num_layers:
                raise ValueError(f"{path}: layer {layer} {module}: no lora_A/lora_B pair here")
            la, lb = (np.asarray(reader.array(infos[names[w]]), np.float32) for w in LORA_AB)
            for target, a, b, key, expert, rank in _convert(module, la, lb, roles, cfg, path):
                s = _scaling(conf, f"model.layers.{layer}.{key}", rank)
                _put(pieces, (layer, target), a, b, s, expert, cfg, path)
    if not pieces:
        raise ValueError(f"{path}: {ADAPTER_FILE} holds no LoRA tensors")
    rank = max(a.shape[-1] for a, _, _ in pieces.values())
    scaling = _scaling(conf, "", conf["r"])
    out = {}
    for key, (a, b, s) in pieces.items():
        pad = rank - a.shape[-1]
        a = np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), np.float32)], -1)
        b = (s / scaling) * b
        rb = 1 if key[1] in EXPERT_TARGETS else 0
        b = np.concatenate([b, np.zeros(b.shape[:rb] + (pad,) + b.shape[rb + 1 :], np.float32)], rb)
        out[key] = (a, b)
    targets = tuple(t for t in TARGETS if any(k[1] == t for k in out))
    for layer, w in routers.items():
        out[(layer, "router")] = w
    return PeftLora(rank, scaling * rank, targets), out


def _router_layer(name: str) -> int | None:
    """The layer of a router saved whole (modules_to_save, `ROUTER`), or None."""
    hit = re.fullmatch(re.escape(PREFIX) + r"(\d+)\." + re.escape(ROUTER) + r"\.weight", name)
    return int(hit.group(1)) if hit else None


def _read(path: str):
    """The validated adapter_config.json and the headers of adapter_model.safetensors."""
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
    for key in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if cfg.get(key):
            raise ValueError(f"{cfg_file}: {key}={cfg[key]!r} is not supported")
    saved = cfg.get("modules_to_save") or []
    if not isinstance(saved, list) or any(m not in (ROUTER, "gate") for m in saved):
        raise ValueError(
            f"{cfg_file}: modules_to_save={saved!r} is not supported (only the MoE routers, "
            f"{ROUTER!r})"
        )
    if cfg.get("bias", "none") not in (None, "none"):
        raise ValueError(f"{cfg_file}: bias={cfg['bias']!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise ValueError(f"{cfg_file}: {key} is not an object")
    return cfg, tensor_infos(file)


def _scaling(conf: dict, module: str, rank: int) -> float:
    """PEFT's scaling of ``module`` (its alpha_pattern entry or lora_alpha, over its
    rank or, with use_rslora, its square root)."""
    alpha = conf["lora_alpha"]
    for key, value in (conf.get("alpha_pattern") or {}).items():
        try:
            hit = re.match(rf"(.*\.)?({key})$", module)
        except re.error as e:
            raise ValueError(f"{ADAPTER_CONFIG}: alpha_pattern key {key!r}: {e}") from None
        if hit:
            alpha = value
            break
    return alpha / (math.sqrt(rank) if conf.get("use_rslora") else rank)


def _fused_roles(conf: dict) -> dict[str, str]:
    """Which module names hold PEFT's LoRA on the fused expert parameters: with both
    targeted, gate_up_proj's wrapper is the inner one (``experts.base_layer``)."""
    tp = [str(t) for t in conf.get("target_parameters") or []]
    gate_up = any(t.endswith("gate_up_proj") for t in tp)
    down = any(t.endswith("down_proj") for t in tp)
    if gate_up and down:
        return {"mlp.experts.base_layer": "gate_up_proj", "mlp.experts": "down_proj"}
    if gate_up or down:
        return {"mlp.experts": "gate_up_proj" if gate_up else "down_proj"}
    return {}


def _parse(name: str):
    """``(layer, module, 'lora_A' | 'lora_B')`` of a PEFT tensor name, or None."""
    if not name.startswith(PREFIX) or not name.endswith(".weight"):
        return None
    rest = name[len(PREFIX) : -len(".weight")]
    layer, _, rest = rest.partition(".")
    module, _, lora = rest.rpartition(".")
    if not layer.isdigit() or lora not in LORA_AB:
        return None
    return int(layer), module, lora


def _convert(module: str, la, lb, roles: dict, cfg: ModelConfig, path: str):
    """``(target, A, B, PEFT module name, expert or None, the file's rank)``, A and B
    in our layout (one expert's, or all experts' for a fused parameter), from one
    module's lora_A [r, in] and lora_B [out, r]."""
    if module in roles:
        e, f = cfg.num_experts, cfg.moe_d_ff
        name = "mlp.experts." + roles[module]
        rr = la.shape[0] // max(e, 1)
        if e == 0 or la.shape[0] != e * rr or lb.shape[1] != e * rr:
            raise ValueError(f"{path}: {module}: LoRA shapes {la.shape}, {lb.shape} do not fit")
        a = la.reshape(e, rr, -1).swapaxes(1, 2)  # expert-major rows: [E, in, r']
        b = lb.reshape(lb.shape[0], rr, e).transpose(2, 1, 0)  # expert-minor: [E, r', out']
        if roles[module] == "down_proj":
            return [("expert_down", a, b, name, None, rr)]
        gate, up = b[:, :, :f], b[:, :, f:]
        h = rr // 2
        if rr % 2 == 0 and not np.any(gate[:, h:]) and not np.any(up[:, :h]):
            # PEFT's block-diagonal conversion of per-expert gate and up adapters.
            return [
                ("expert_gate", a[..., :h], gate[:, :h], name, None, rr),
                ("expert_up", a[..., h:], up[:, h:], name, None, rr),
            ]
        return [("expert_gate", a, gate, name, None, rr), ("expert_up", a, up, name, None, rr)]
    parts = module.split(".")
    expert = None
    if len(parts) == 4 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit():
        generic, expert = "mlp.experts.{e}." + parts[3], int(parts[2])
    else:
        generic = module
    for target, (_, _, hf) in TARGETS.items():
        if hf == generic:
            i, o = _shapes(cfg, target)
            r = la.shape[0]
            if la.shape != (r, math.prod(i)) or lb.shape != (math.prod(o), r):
                raise ValueError(f"{path}: {module}: LoRA shapes {la.shape}, {lb.shape} do not fit")
            return [(target, la.T.reshape(i + (r,)), lb.T.reshape((r,) + o), module, expert, r)]
    raise ValueError(f"{path}: LoRA on {module!r}, a module we do not adapt")


def _put(pieces, key, a, b, s, expert, cfg, path) -> None:
    """Record one module's adapter (one expert's into its layer's stack)."""
    if expert is None:
        if key in pieces:
            raise ValueError(f"{path}: layer {key[0]}: {key[1]} given twice")
        pieces[key] = (a, b, s)
        return
    e = cfg.num_experts
    if key not in pieces:
        pieces[key] = (
            np.zeros((e,) + a.shape, np.float32),
            np.zeros((e,) + b.shape, np.float32),
            s,
        )
    pa, pb, _ = pieces[key]
    if pa.shape[1:] != a.shape or pb.shape[1:] != b.shape or expert >= e:
        raise ValueError(f"{path}: layer {key[0]}: expert {expert} of {key[1]} does not fit")
    pa[expert], pb[expert] = a, b


def load_peft(path: str, model: Transformer) -> PeftLora:
    """Set the model's adapters from the PEFT adapter in the folder ``path``
    (`read_peft`; the model must hold adapters for exactly its targets, at its
    rank: build it with config.lora from `read_peft_config`). Each adapter is
    replaced whole, on its sharding, in its dtype; layers the file leaves out
    (PEFT's layers_to_transform) get zeros. Returns the adapter's rank, alpha and
    targets: the model's config.lora must use that alpha."""
    lora, pieces = read_peft(path, model.cfg)
    held = model_targets(model)
    if set(held) != set(lora.targets):
        raise ValueError(
            f"{path}: the adapter targets {sorted(lora.targets)}, the model holds adapters "
            f"for {sorted(held)}"
        )
    values: dict[int, tuple[object, np.ndarray]] = {}
    used = set()
    for i, (blk, r) in enumerate(layer_slots(model)):
        for target, module, w in block_adapters(blk):
            pa, pb = getattr(module, f"{w}_lora_a"), getattr(module, f"{w}_lora_b")
            for p in (pa, pb):
                values.setdefault(id(p), (p, np.zeros(p.shape, np.float32)))
            got = pieces.get((i, target))
            if got is None:
                continue
            used.add((i, target))
            for p, v in zip((pa, pb), got):
                if values[id(p)][1][r].shape != v.shape:
                    raise ValueError(
                        f"{path}: layer {i} {target}: adapter of shape {v.shape}, the "
                        f"model's {values[id(p)][1][r].shape} (rank {lora.rank}?)"
                    )
                values[id(p)][1][r] = v
    for i, (blk, r) in enumerate(layer_slots(model)):  # routers saved whole
        got = pieces.get((i, "router"))
        if got is None:
            continue
        if not blk.is_moe:
            raise ValueError(f"{path}: a router for layer {i}, which is not an MoE layer")
        p = blk.mlp.router
        values.setdefault(id(p), (p, np.array(jax.device_get(p[...]), np.float32)))
        values[id(p)][1][r] = got
        used.add((i, "router"))
    unused = sorted(set(pieces) - used)
    if unused:
        raise ValueError(f"{path}: adapters for weights the model does not adapt: {unused[:4]}")
    for p, value in values.values():
        old = p[...]
        p.set_value(jax.device_put(jnp.asarray(value, old.dtype), old.sharding))
    return lora
