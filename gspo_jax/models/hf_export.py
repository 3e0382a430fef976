"""Writing a Hugging Face checkpoint: `export_pretrained`, streaming.

`export_pretrained` gathers one tensor (one layer of a stacked parameter) at a
time, converts it to the HF layout (`hf_layout`'s table) and writes shards of a
bounded size with model.safetensors.index.json, never holding the whole model on
the host or on one device (docs/checkpoints.md). A model with LoRA adapters is
written merged (W + (alpha/r)·A·B per weight, in f32, then cast), or as the
adapters alone in PEFT's format (`export_peft`, layout in `hf_peft`).
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import multihost
from gspo_jax.models import lora
from gspo_jax.models.hf_layout import config_to_hf, dotted_attr, hf_shape, layer_slots, layer_table
from gspo_jax.models.hf_peft import (
    ADAPTER_CONFIG,
    EXPERT_TARGETS,
    PREFIX,
    ROUTER,
    TARGETS,
    adapter_config,
    block_adapters,
    check_exportable,
    model_targets,
    to_peft,
)
from gspo_jax.models.safetensors_io import write_sharded
from gspo_jax.models.transformer import Transformer


@functools.partial(jax.jit, static_argnames="dtype")
def _layer_as(a, r, dtype):
    return a[r].astype(dtype)


class _Fetch:
    """Host copies of parameters (or one layer of a stacked one) in the file dtype,
    one at a time: fetching the next frees the last, so the host holds one layer's
    tensor (for experts: one layer's [E, D, I] stack) at a time."""

    def __init__(self, dtype: np.dtype):
        self.dtype, self.key, self.value = dtype, None, None

    def __call__(self, param, r=None) -> np.ndarray:
        if self.key != (id(param), r):
            self.key, self.value = None, None  # free the previous copy first
            a = jnp.asarray(param[...])
            a = a.astype(self.dtype) if r is None else _layer_as(a, np.int32(r), self.dtype)
            if a.is_fully_addressable:
                value = jax.device_get(a)
            else:  # shards on several processes: every process takes part in the gather
                from jax.experimental import multihost_utils

                value = multihost_utils.process_allgather(a, tiled=True)
            self.key, self.value = (id(param), r), np.asarray(value)
        return self.value


class _Merged:
    """Like `_Fetch`, for the weights that carry LoRA adapters: W + scaling·A·B of one
    layer, computed in f32 on the host and cast to the file dtype (cached: the
    experts of a layer are written one by one from one merged stack)."""

    def __init__(self, dtype: np.dtype, scaling: float):
        self.dtype, self.scaling, self.key, self.value = dtype, scaling, None, None
        self.w, self.a, self.b = _Fetch(np.float32), _Fetch(np.float32), _Fetch(np.float32)

    def __call__(self, module, w: str, r) -> np.ndarray:
        p = getattr(module, w)
        if self.key != (id(p), r):
            self.key, self.value = None, None
            a, b = getattr(module, f"{w}_lora_a"), getattr(module, f"{w}_lora_b")
            dims = module.LORA_WEIGHTS[w][1:]  # (n_lead, n_in, n_dims)
            m = lora.merged(self.w(p, r), self.a(a, r), self.b(b, r), self.scaling, dims)
            for f in (self.w, self.a, self.b):  # hold the merged layer only
                f.key, f.value = None, None
            self.key, self.value = (id(p), r), np.asarray(m.astype(self.dtype))
        return self.value


def _export_entries(model: Transformer, dtype: np.dtype, scaling=None) -> list[tuple]:
    """``(name, hf_shape, produce)`` for every tensor of the HF checkpoint, in the
    order they are written; ``produce()`` returns the array (a view of the
    fetched parameter in the HF layout). Weights with LoRA adapters are merged
    with ``scaling`` (alpha / r)."""
    cfg, fetch = model.cfg, _Fetch(dtype)
    merged = _Merged(dtype, scaling)
    out = []
    for i, (blk, r) in enumerate(layer_slots(model)):
        pre = f"model.layers.{i}."
        adapted = {(id(m), w) for _, m, w in block_adapters(blk)}
        for suffix, attr, _, to_hf in layer_table(cfg, blk.is_moe):
            p = dotted_attr(blk, attr)
            mod, _, w = attr.rpartition(".")
            if (id(getattr(blk, mod, None)), w) in adapted:

                def produce(m=getattr(blk, mod), w=w, r=r, to_hf=to_hf):
                    return to_hf(merged(m, w, r))

                out.append((pre + suffix, hf_shape(to_hf, p.shape[1:]), produce))
                continue

            def produce(p=p, r=r, to_hf=to_hf):
                w = fetch(p, r)
                return to_hf(w) if to_hf else w

            out.append((pre + suffix, hf_shape(to_hf, p.shape[1:]), produce))
        if blk.is_moe:
            # One projection at a time over the experts: fetched once per layer.
            for attr in ("gate", "up", "down"):
                p = getattr(blk.mlp, attr)
                _, e, a, b = p.shape
                if (id(blk.mlp), attr) in adapted:
                    get = lambda p, r, m=blk.mlp, w=attr: merged(m, w, r)  # noqa: E731
                else:
                    get = fetch
                for x in range(e):
                    name = f"{pre}mlp.experts.{x}.{attr}_proj.weight"
                    out.append((name, (b, a), lambda p=p, r=r, x=x, g=get: g(p, r)[x].T))
    v, d = cfg.vocab_size, cfg.d_model
    out.append(("model.embed_tokens.weight", (v, d), lambda: fetch(model.embed)))
    out.append(("model.norm.weight", (d,), lambda: fetch(model.final_norm.scale)))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", (v, d), lambda: fetch(model.lm_head).T))
    return out


def export_pretrained(
    model: Transformer,
    path: str,
    *,
    dtype: Optional[str] = None,
    max_shard_size: Union[int, str] = "5GB",
    lora=None,
    lora_format: str = "merged",
) -> list[str]:
    """Write `model` as a HF checkpoint that transformers and vLLM load: config.json
    plus ``model.safetensors``, or, past ``max_shard_size``, shards
    ``model-0000k-of-0000N.safetensors`` with ``model.safetensors.index.json``.

    Streams: one parameter (or one layer of a stacked one) at a time is gathered
    from its devices to the host, converted and written, so the host holds about
    one tensor; parameters may be sharded over any mesh. With several processes,
    every process calls this (each gather is collective) and process 0 writes the
    files to ``path``, which it must be able to reach; the others return once the
    files are there. Weight files of an earlier export in ``path`` that this one does
    not overwrite are removed. The value head, which HF models lack, is not written.

    Args:
      dtype: tensor dtype in the files (default: the parameters' dtype, so bf16
        models export bf16).
      max_shard_size: bytes per file (an int, or "5GB", "500MB", "2GiB"); a tensor
        larger than that gets a file of its own.
      lora: for a model with LoRA adapters, its rank, alpha and targets (config.lora,
        or any object with those attributes; `hf_peft.PeftLora`).
      lora_format: with adapters, "merged" writes the checkpoint with every adapted
        weight merged, W + (alpha/r)·A·B (computed per weight in f32, one layer at a time,
        then cast); "peft" writes the adapters alone in PEFT's format
        (`export_peft`; ``dtype`` is then theirs, default float32).

    Returns the names of the weight files written (index included); [] on every
    process but 0.
    """
    cfg = model.cfg
    if lora_format not in ("merged", "peft"):
        raise ValueError(f"export_pretrained: lora_format={lora_format!r}: 'merged' or 'peft'")
    targets = model_targets(model)
    if lora is None and (targets or lora_format == "peft"):
        raise ValueError(
            f"export_pretrained: LoRA adapters ({', '.join(targets) or 'none'}) with "
            f"lora_format={lora_format!r}: pass lora= (their rank, alpha and targets)"
        )
    if lora_format == "peft":
        return export_peft(model, path, lora, dtype=dtype or "float32")
    dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    hf = config_to_hf(cfg, dtype.name)
    hf["torch_dtype"] = dtype.name  # the key transformers < 4.56 (and vLLM with it) read
    scaling = lora.alpha / lora.rank if targets else None
    entries = _export_entries(model, dtype, scaling)
    return _write(path, entries, dtype, max_shard_size, "model", "config.json", hf)


def _write(path, entries, dtype, max_shard_size, prefix, config_name, config) -> list[str]:
    """Write ``entries`` (`_export_entries`'s) and the JSON ``config`` as process 0;
    the other processes take part in the gathers only."""
    if not multihost.is_primary():
        for _, _, produce in entries:  # the gathers process 0 waits on
            produce()
        multihost.barrier("export_pretrained")
        return []
    files = write_sharded(
        path,
        [(name, dtype, shape) for name, shape, _ in entries],
        (produce() for _, _, produce in entries),
        max_shard_size=max_shard_size,
        metadata={"format": "pt"},
        prefix=prefix,
    )
    tmp = os.path.join(path, config_name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(path, config_name))
    multihost.barrier("export_pretrained")
    return files


def export_peft(
    model: Transformer,
    path: str,
    lora,
    *,
    dtype: str = "float32",
    base_model_name_or_path: Optional[str] = None,
    routers: bool = False,
) -> list[str]:
    """Write the model's LoRA adapters in PEFT's format: ``adapter_model.safetensors``
    and ``adapter_config.json`` (layout in `hf_peft`), for ``peft.PeftModel.
    from_pretrained`` on the transformers model of the base (e.g. the base written by
    `export_pretrained` before training) and vLLM's LoRA loader.

    ``lora``: rank, alpha and targets (config.lora, or `hf_peft.PeftLora`). The
    experts are written per expert (``mlp.experts.{e}.gate_proj``), which PEFT
    converts to transformers >= 5's fused expert parameters. Raises ValueError for
    what PEFT cannot express (`hf_peft.check_exportable`). Streams like
    `export_pretrained` (one layer of one adapter gathered at a time; collective
    with several processes, process 0 writes). ``routers``: the MoE layers' routers
    too (trained with the adapters, ``lora.train_router``), as PEFT's
    ``modules_to_save`` (``mlp.gate``, which replaces the base's router). Returns the
    weight file's name.
    """
    targets = check_exportable(model, lora)
    dt = np.dtype(jnp.dtype(dtype))
    fa, fb = _Fetch(np.float32), _Fetch(np.float32)
    entries = []
    for i, (blk, r) in enumerate(layer_slots(model)):
        for target, module, w in block_adapters(blk):
            a, b = getattr(module, f"{w}_lora_a"), getattr(module, f"{w}_lora_b")
            hf = PREFIX + str(i) + "." + TARGETS[target][2]
            experts = target in EXPERT_TARGETS
            k = 2 if experts else 1  # the stack (and expert) dims
            rank, din, dout = a.shape[-1], math.prod(a.shape[k:-1]), math.prod(b.shape[k + 1 :])
            for x in range(a.shape[1]) if experts else [None]:
                name = hf.format(e=x)

                def pair(a=a, b=b, r=r, x=x):
                    av, bv = fa(a, r), fb(b, r)
                    return to_peft(av, bv) if x is None else to_peft(av[x], bv[x])

                entries.append((f"{name}.lora_A.weight", (rank, din), lambda p=pair: p()[0]))
                entries.append((f"{name}.lora_B.weight", (dout, rank), lambda p=pair: p()[1]))
    saved = []
    if routers:  # [D, E] per layer -> PEFT's copy of HF's mlp.gate.weight [E, D]
        for i, (blk, r) in enumerate(layer_slots(model)):
            if blk.is_moe:
                p = blk.mlp.router
                shape = (p.shape[-1], p.shape[-2])
                entries.append((f"{PREFIX}{i}.{ROUTER}.weight", shape, lambda p=p, r=r: fa(p, r).T))
                saved = [ROUTER]
    config = adapter_config(lora, targets, base_model_name_or_path, modules_to_save=saved)
    return _write(path, entries, dt, 2**62, "adapter_model", ADAPTER_CONFIG, config)
