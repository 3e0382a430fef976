"""Writing a Hugging Face checkpoint: `export_pretrained`, streaming.

`export_pretrained` gathers one tensor (one layer of a stacked parameter) at a
time, converts it to the HF layout (`hf_layout`'s table) and writes shards of a
bounded size with model.safetensors.index.json, never holding the whole model on
the host or on one device (docs/checkpoints.md).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import multihost
from gspo_jax.models.hf_layout import config_to_hf, dotted_attr, hf_shape, layer_slots, layer_table
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


def _export_entries(model: Transformer, dtype: np.dtype) -> list[tuple]:
    """``(name, hf_shape, produce)`` for every tensor of the HF checkpoint, in the
    order they are written; ``produce()`` returns the array (a view of the
    fetched parameter in the HF layout)."""
    cfg, fetch = model.cfg, _Fetch(dtype)
    out = []
    for i, (blk, r) in enumerate(layer_slots(model)):
        pre = f"model.layers.{i}."
        for suffix, attr, _, to_hf in layer_table(cfg, blk.is_moe):
            p = dotted_attr(blk, attr)

            def produce(p=p, r=r, to_hf=to_hf):
                w = fetch(p, r)
                return to_hf(w) if to_hf else w

            out.append((pre + suffix, hf_shape(to_hf, p.shape[1:]), produce))
        if blk.is_moe:
            # One projection at a time over the experts: fetched once per layer.
            for attr in ("gate", "up", "down"):
                p = getattr(blk.mlp, attr)
                _, e, a, b = p.shape
                for x in range(e):
                    name = f"{pre}mlp.experts.{x}.{attr}_proj.weight"
                    out.append((name, (b, a), lambda p=p, r=r, x=x: fetch(p, r)[x].T))
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

    Returns the names of the weight files written (index included); [] on every
    process but 0.
    """
    cfg = model.cfg
    dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    hf = config_to_hf(cfg, dtype.name)
    hf["torch_dtype"] = dtype.name  # the key transformers < 4.56 (and vLLM with it) read
    entries = _export_entries(model, dtype)
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
    )
    tmp = os.path.join(path, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(path, "config.json"))
    multihost.barrier("export_pretrained")
    return files
