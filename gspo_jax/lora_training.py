"""LoRA in a run (``config.lora``): adapters on the policy, the base frozen in the RL
phase, the reference policy, and what an RL checkpoint holds (docs/lora.md).

With ``lora.rank`` > 0 the trainer attaches adapters to the model it builds
(`attach`, after the base: the base is the model a run without LoRA builds), and

* the warm start trains the base in full, the fresh adapters (B = 0: no effect)
  untouched (`gspo_jax.models.lora.TRAINABLE` 'base');
* the RL phase starts from its result (or the Hugging Face checkpoint): the base is
  frozen in the compute dtype (its linear weights quantized to int8 or int4 with
  ``lora.base_quantization``, `gspo_jax.models.quantized`), the adapters (and the routers with
  ``lora.train_router``; a PPO critic's value head always) are its trainable
  parameters, in f32 (`rl_params`); gradients and the optimizer's state exist for
  them only (`gspo_jax.step`);
* the reference policy of a KL term is the same parameters with every B zeroed and
  the routers as RL found them (`reference`): no second copy of the base;
* an RL checkpoint holds the trainable parameters and their optimizer state, and the
  base's identity (`identity`: where it came from and a checksum of its arrays); a
  resume rebuilds the base from its source and refuses one whose checksum differs
  (`check_identity`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import checkpoint
from gspo_jax.config_fields import err, setting
from gspo_jax.models import lora, quantized
from gspo_jax.models.hf_peft import load_peft, read_peft_config
from gspo_jax.models.precision import inference_params
from gspo_jax.models.sharding import param_shardings

DEFAULT_TARGETS = tuple(lora.TARGETS)


def _peft_folder(v) -> str | None:
    if not isinstance(v, str):
        return f"must be a path (a string), got {v!r}"
    for name in ("adapter_config.json", "adapter_model.safetensors") if v else ():
        if not os.path.isfile(os.path.join(v, name)):
            return f"{v!r} is not a PEFT adapter folder (no {name})"
    return None


def _targets(v) -> str | None:
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(t, str) for t in v):
        return f"must be a non-empty tuple of target names, got {v!r}"
    unknown = [t for t in v if t not in lora.TARGETS]
    if unknown:
        return f"unknown targets {unknown}; the targets are {list(lora.TARGETS)}"
    if len(set(v)) != len(v):
        return f"names a target twice: {list(v)}"
    return None


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``config.lora``: low-rank adapters for the RL phase (docs/lora.md).

    Dropout on the adapters is not offered: a stochastic forward would make the
    trainer's log-probs of a response differ from the sampler's (and from pi_old's and
    the reference's passes) by the dropout noise, which every ratio, KL term and
    mismatch metric would then read as policy change.
    """

    rank: int = setting(0, low=0, doc="adapter rank r (0 = off: RL trains every parameter)")
    alpha: float = setting(
        16.0, low=0, low_open=True, doc="the low-rank term is scaled by alpha / rank"
    )
    targets: tuple[str, ...] = setting(
        DEFAULT_TARGETS,
        check=_targets,
        domain="non-empty tuple of q, k, v, o, gate, up, down, expert_gate, expert_up, expert_down",
        doc="the weights adapted (gate/up/down: dense MLPs; expert_*: the MoE experts)",
    )
    train_router: bool = setting(
        False, doc="train the routers in full (f32) besides the adapters; frozen otherwise"
    )
    peft_adapter: str = setting(
        "",
        check=_peft_folder,
        domain="'' or a PEFT adapter folder",
        doc="RL starts from this PEFT LoRA adapter (its rank, alpha, targets: lora's) "
        "on the model.pretrained base, not from fresh adapters",
    )
    base_quantization: str = setting(
        "none",
        choices=quantized.SCHEMES,
        doc="the frozen base's linear weights stored in int8 (per channel) or int4 (groups "
        "of 32) for the RL phase (QLoRA; needs rank > 0)",
    )

    def check_run(self, run, ctx) -> None:
        """A quantized base needs adapters; a PEFT adapter needs the pretrained base
        RL starts from, and no warm start."""
        if self.base_quantization != "none" and not self.rank:
            raise err(
                "lora.base_quantization",
                f"{self.base_quantization!r} quantizes the frozen base of a LoRA run; "
                "set lora.rank > 0 (with lora.rank = 0 RL trains the base in full)",
            )
        if self.peft_adapter and (not self.rank or not run.model.pretrained or run.sft.steps > 0):
            raise err(
                "lora.peft_adapter",
                "loads an adapter onto the pretrained base RL starts from: it needs "
                f"lora.rank > 0 (got {self.rank}), model.pretrained (got "
                f"{run.model.pretrained!r}) and no warm start, which would train the base "
                f"under the adapter (sft.steps=0, got {run.sft.steps})",
            )


def trainable(lc: LoRAConfig, phase: str) -> str:
    """What ``phase`` ('sft' or 'rl') trains (`lora.TRAINABLE`): everything without
    LoRA; with it, the base in the warm start and the adapters (+ routers) in RL."""
    if not lc.rank:
        return "all"
    if phase == "sft":
        return "base"
    return "lora+router" if lc.train_router else "lora"


def spec(lc: LoRAConfig) -> lora.LoRASpec:
    return lora.LoRASpec(int(lc.rank), float(lc.alpha), tuple(lc.targets))


# The adapters' initialisation key: the run's seed, folded with this.
ADAPTER_KEY = 0x10A


def attach(model: nnx.Module, lc: LoRAConfig, seed: int, mesh, model_cfg) -> nnx.Module:
    """``model`` with ``lc``'s adapters, placed in their sharding on ``mesh``
    (ConfigError naming ``lora.targets`` when none of them is in the model)."""
    lora.add_adapters(model, spec(lc), jax.random.fold_in(jax.random.key(seed), ADAPTER_KEY))
    adapters = nnx.state(model, lora.LoRAParam)
    if not jax.tree.leaves(adapters):
        raise err("lora.targets", f"{list(lc.targets)} adapt no weight of this model")
    nnx.update(model, jax.device_put(adapters, param_shardings(adapters, mesh, model_cfg)))
    if lc.peft_adapter:
        load_adapter(model, lc)
    return model


def load_adapter(model: nnx.Module, lc: LoRAConfig) -> None:
    """Set the model's adapters from the PEFT adapter ``lc.peft_adapter``, whose rank
    and alpha must be ``lc``'s, and its targets those of the model's adapters
    (ConfigError naming the field)."""

    path = lc.peft_adapter
    try:
        got = read_peft_config(path, model.cfg)
    except ValueError as e:
        raise err("lora.peft_adapter", str(e)) from None
    for field, want, have in (("rank", got.rank, lc.rank), ("alpha", got.alpha, lc.alpha)):
        if not math.isclose(want, have, rel_tol=1e-9):
            raise err(
                f"lora.{field}",
                f"{have!r}, but the PEFT adapter {path!r} (lora.peft_adapter) has "
                f"{field} {want!r}: set lora.{field}={want!r}",
            )
    try:
        load_peft(path, model)  # its targets must be those the model holds adapters for
    except ValueError as e:
        raise err("lora.peft_adapter", f"{e} (the model's adapters: lora.targets)") from None


def rl_start(trainer, params, kind: str):
    """(the parameters RL starts from, the base's `identity`): `rl_params` of
    ``params`` with LoRA; ``(params, None)`` without."""
    if kind == "all":
        return params, None
    quantization = trainer.cfg.lora.base_quantization
    params = rl_params(params, trainer.model_cfg, kind, trainer.graphdef, quantization)
    return params, identity(trainer, params, kind)


def rl_params(params, model_cfg, kind: str, graphdef=None, quantization: str = "none"):
    """Where the RL phase starts: the trainable parameters (``kind``) in f32, the frozen
    base in the compute dtype (`inference_params`: the routers and value head in f32);
    with ``quantization`` 'int8' or 'int4' (``lora.base_quantization``; ``graphdef`` is
    the model's) its linear weights quantized from their f32 values first
    (`gspo_jax.models.quantized`)."""
    train, frozen = lora.partition(params, kind)
    train = jax.tree.map(lambda a: a.astype(jnp.float32), train)
    if quantization != "none":
        model = nnx.merge(graphdef, lora.join(train, frozen), copy=True)  # not in place
        quantized.quantize_base(model, quantization)
        frozen = lora.partition(nnx.state(model), kind)[1]
    return lora.join(train, inference_params(frozen, model_cfg))


def routers(params):
    """A copy of the routers' parameters (the reference policy's, when RL trains them)."""
    return jax.tree.map(jnp.copy, nnx.split_state(params, nnx.PathContains("router"), ...)[0])


def reference(params, ref_routers=None):
    """The reference policy's parameters: ``params`` with the adapters off (every B
    zeroed) and, when RL trains the routers, ``ref_routers`` in their place."""
    off = lora.adapters_off(params)
    if ref_routers is None:
        return off
    rest = nnx.split_state(off, nnx.Not(nnx.PathContains("router")), ...)[0]
    return nnx.merge_state(rest, ref_routers)


def reference_pass(logp_pass):
    """``logp_pass(params, batch)`` as the reference policy's pass: called with
    (params, the reference routers or None), it runs on `reference`'s parameters."""

    def ref_pass(params_and_routers, batch):
        params, ref_routers = params_and_routers
        return logp_pass(reference(params, ref_routers), batch)

    return ref_pass


def checksum(frozen) -> str:
    """A checksum of the frozen base's arrays (`gspo_jax.checkpoint.tree_checksum`)."""
    return checkpoint.tree_checksum(frozen)


def source(trainer) -> str:
    """Where the policy RL starts from comes from: the warm start's last checkpoint, the
    Hugging Face checkpoint, or the seed's initialisation."""
    cfg = trainer.cfg
    if cfg.sft.steps > 0:
        return f"warm start checkpoint sft/{cfg.sft.steps}"
    if cfg.model.pretrained:
        return f"pretrained {cfg.model.pretrained}"
    return f"initialised, seed {cfg.seed}"


def identity(trainer, params, kind: str) -> dict:
    """The identity of the base (the parameters ``kind`` freezes): its `source` and
    `checksum`."""
    return {"source": source(trainer), "checksum": checksum(lora.partition(params, kind)[1])}


class BaseMismatch(checkpoint.SourceChanged):
    """A resumed LoRA run's base is not the one its checkpoint was trained on."""


def check_identity(saved: dict | None, current: dict) -> None:
    """Refuse a resume whose rebuilt base differs from the checkpoint's."""
    if saved is None:
        raise BaseMismatch(
            "lora: the RL checkpoint records no LoRA base (it was saved by a run without "
            "LoRA); resume it with lora.rank=0"
        )
    if saved["checksum"] != current["checksum"]:
        raise BaseMismatch(
            f"lora: the frozen base rebuilt from {current['source']!r} has checksum "
            f"{current['checksum']}, but the RL checkpoint was trained on base "
            f"{saved['source']!r} with checksum {saved['checksum']}: the base's source "
            "changed since (its checkpoint or files); restore it to resume"
        )


def saved_state(state, kind: str):
    """The train state as an RL checkpoint holds it: the trainable parameters only."""
    return state.replace(params=lora.partition(state.params, kind)[0])


def restored_state(saved, state, kind: str):
    """`saved_state`'s tree back onto the full state ``state`` (its frozen base)."""
    return saved.replace(params=lora.join(saved.params, lora.partition(state.params, kind)[1]))


def loaded_state(saved, meta: dict, state, kind: str, base: dict | None):
    """The train state from an RL checkpoint's ``saved`` state (`saved_state`'s tree)
    and ``meta``, onto ``state``'s frozen base, whose identity ``base`` must be the
    checkpoint's (`check_identity`); ``saved`` itself without LoRA."""
    if kind == "all":
        return saved
    check_identity(meta.get("lora_base"), base)
    return restored_state(saved, state, kind)


def sizes(params, opt_state, kind: str) -> dict[str, float]:
    """Parameter counts and bytes: trainable, frozen, the optimizer's state."""
    train, frozen = lora.partition(params, kind)
    frozen = {} if frozen is None else frozen
    (nt, bt), (nf, bf), (_, bo) = lora.count(train), lora.count(frozen), lora.count(opt_state)
    return {
        "trainable_params": float(nt),
        "frozen_params": float(nf),
        "trainable_bytes": float(bt),
        "frozen_bytes": float(bf),
        "frozen_stored_bytes": float(quantized.stored_bytes(frozen)),
        "optimizer_state_bytes": float(bo),
    }


def nonzero_delta(before, after) -> list[str]:
    """The paths whose arrays differ between two states (tests, diagnostics)."""
    out = []
    fa = jax.tree_util.tree_flatten_with_path(after)[0]
    for (path, a), b in zip(fa, jax.tree.leaves(before)):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            out.append(jax.tree_util.keystr(path))
    return out
