"""The quantized LoRA base's error against the bf16 base (docs/lora.md, "QLoRA").

The default config's model (configs/default.py:lora: d_model 128, 2 MoE layers of 8
experts, adapters of rank 8) after its supervised warm start (``--sft-steps``, 300 as
the config's; 0: the random initialisation), its frozen base put as the RL phase puts
it (`gspo_jax.lora_training.rl_params`) with bf16 compute: unquantized (bf16 weights), and
with ``lora.base_quantization`` int8 and int4.  Over the valid positions of a batch
of warm-start sequences (Countdown prompts and reference solutions), each quantized
base's next-token distribution against the bf16 base's: max and mean |logit
difference|, the mean and max KL(p_bf16 || p_quantized), the share of positions whose
argmax differs, the share of routed experts that differ; the f32 base against the
bf16 one for scale; and the bytes of the stored base (its quantized weights, and all
of it).

    python -m experiments.lora.qlora_error                 # warm start, then measure
    python -m experiments.lora.qlora_error --sft-steps=0   # the random initialisation
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import default as default_config
from gspo_jax import lora_training, sft
from gspo_jax.models import lora, quantized
from gspo_jax.run_parts import RunParts


class _NoLog:
    def write(self, *args):
        pass

    def close(self):
        pass


def _sequences(t: RunParts, batch: int):
    """tokens, positions, mask [B, P + T] of warm-start sequences (held-out positions
    of the data: after the warm start's own)."""
    host, _ = sft.sft_batch(t, t.cfg.sft.steps * t.cfg.sft.batch_size)
    tokens = np.concatenate([host["prompt_tokens"], host["tokens"]], axis=1)[:batch]
    mask = np.concatenate([host["prompt_mask"], host["mask"]], axis=1)[:batch].astype(bool)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)


def _logits(graphdef, params, model_cfg, seq):
    """f32 logits of the model ``params`` with compute dtype ``model_cfg.dtype``."""
    model = nnx.merge(graphdef, params, copy=True)
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "cfg"):
            module.cfg = model_cfg
    tokens, positions, mask = seq
    logits, aux = jax.jit(lambda m: m(tokens, positions=positions, attn_mask=mask))(model)
    return logits, aux.topk_indices


def _compare(ref_out, out, mask):
    """Errors of ``out``'s next-token distribution against ``ref_out``'s at the valid
    positions (the embedding's padding ids excluded), and the share of their experts
    (per position, MoE layer and top-K slot) not among the reference's."""
    (ref, ref_idx), (other, idx) = ref_out, out
    moved = ~jnp.any(idx[..., :, None] == ref_idx[..., None, :], axis=-1)  # [B, T, L, K]
    valid = ref[0, 0] > -1e29
    d = jnp.abs(ref - other)[mask][:, valid]
    lp, lq = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(other, -1)
    kl = jnp.sum(jnp.where(valid, jnp.exp(lp) * (lp - lq), 0.0), -1)[mask]
    flip = (jnp.argmax(ref, -1) != jnp.argmax(other, -1))[mask]
    return {
        "max_abs_logit_diff": float(jnp.max(d)),
        "mean_abs_logit_diff": float(jnp.mean(d)),
        "mean_kl": float(jnp.mean(kl)),
        "max_kl": float(jnp.max(kl)),
        "argmax_changed": float(jnp.mean(flip)),
        "experts_changed": float(jnp.mean(moved[mask])),
    }


def _weight_bytes(frozen):
    """Bytes of the quantizable weights (attention, MLPs, experts) as stored."""
    names = {w for _, w in lora.TARGETS.values()}
    flat = jax.tree_util.tree_flatten_with_path(frozen, is_leaf=quantized.is_quantized)[0]
    keep = [a for p, a in flat if str(getattr(p[-2], "key", "")) in names]
    return quantized.stored_bytes(keep), len(keep)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    c = default_config.get_config("lora")
    c.sft.steps = args.sft_steps
    c.seed = args.seed
    with tempfile.TemporaryDirectory() as workdir:
        t = RunParts(c, workdir)
        params = t.init_params
        if args.sft_steps:
            params, _ = sft.run(t, lambda phase, step: _NoLog())
        seq = _sequences(t, args.batch)
        bf16 = dataclasses.replace(t.model_cfg, dtype="bfloat16")
        kind = lora_training.trainable(c.lora, "rl")
        base = {"f32": lora_training.rl_params(params, t.model_cfg, kind)}
        for scheme in quantized.SCHEMES:
            base[scheme] = lora_training.rl_params(params, bf16, kind, t.graphdef, scheme)
        logits = {
            k: _logits(t.graphdef, p, t.model_cfg if k == "f32" else bf16, seq)
            for k, p in base.items()
        }
        mask = seq[2]
        out = {"sft_steps": args.sft_steps, "positions": int(mask.sum()), "errors": {}}
        for k in ("f32", "int8", "int4"):
            out["errors"][k] = _compare(logits["none"], logits[k], mask)
        out["stored_bytes"] = {}
        for k in ("f32", "none", "int8", "int4"):
            frozen = lora.partition(base[k], kind)[1]
            w, n = _weight_bytes(frozen)
            out["stored_bytes"][k if k != "none" else "bf16"] = {
                "weights": w,
                "frozen_base": quantized.stored_bytes(frozen),
            }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
