"""Generation throughput: gspo_jax.rollout vs Hugging Face transformers' `generate`.

The same tiny Qwen3-MoE weights (4 layers, d_model 128, 8 experts top-2, vocab
512, created by transformers with a fixed torch seed and saved with
`save_pretrained`) are sampled by

* gspo_jax: the checkpoint loaded through `gspo_jax.models.from_pretrained`, and
  `gspo_jax.rollout.Sampler` (jit, KV cache, on-device decode loop);
* transformers: `Qwen3MoeForCausalLM.generate(do_sample=True, use_cache=True)`,

on the same CPU, in the same process, with the same left-padded prompts, at
temperature 1 without truncation, and exactly `--max-new-tokens` tokens per row
(no EOS; transformers gets min_new_tokens = max_new_tokens).  Throughput is
generated tokens (rows x new tokens) per second of wall time, the best of
`--repeats` timed calls after one warm-up call each; the warm-up (compile) time
of the JAX sampler is reported separately.  The timed calls are interleaved
(JAX, then transformers) round by round, so that load from other processes on
a shared CPU falls on both; the ratio of the medians is reported beside the
ratio of the bests.  transformers is timed with 1 torch thread and with
torch's default, and the faster is kept (on a shared CPU its OpenMP threads
can be 10x slower than one thread).

    python -m experiments.bench.bench_rollout            # batch 1, 16, 64; 5 rounds
    python -m experiments.bench.bench_rollout --batch-sizes=64 --repeats=5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import torch
import transformers

from gspo_jax import rollout
from gspo_jax.models import from_pretrained

HF_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    output_router_logits=False,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)


def make_checkpoint(path: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF_CONFIG)).eval()
    model.save_pretrained(path)
    return model


def make_prompts(batch: int, seed: int = 0, min_len: int = 8, max_len: int = 16) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [
        rs.randint(1, HF_CONFIG["vocab_size"], size=rs.randint(min_len, max_len + 1)).tolist()
        for _ in range(batch)
    ]


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="", help="also write the results to this JSON file")
    args = ap.parse_args()
    T = args.max_new_tokens

    with tempfile.TemporaryDirectory() as ckpt:
        hf = make_checkpoint(ckpt)
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        model = from_pretrained(ckpt)
    sampler = rollout.Sampler.from_model(model)

    # The two models must be the same function: compare one forward's logits.
    ids, mask = left_pad(make_prompts(4, seed=123))
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits[:, -1].numpy()
    pos = np.maximum(np.cumsum(mask.numpy(), 1) - 1, 0).astype(np.int32)
    got, _ = model(
        jax.numpy.asarray(ids.numpy(), jax.numpy.int32),
        positions=pos,
        attn_mask=jax.numpy.asarray(mask.numpy()),
    )
    logit_diff = float(np.max(np.abs(np.asarray(got[:, -1]) - ref)))

    default_threads = torch.get_num_threads()
    env = dict(
        jax=jax.__version__,
        torch=torch.__version__,
        transformers=transformers.__version__,
        torch_threads=default_threads,
        cpus=os.cpu_count(),
        load_avg=os.getloadavg(),
        max_logit_diff=logit_diff,
    )
    print(json.dumps(env))
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = make_prompts(B)

        def run_jax(i):
            r = sampler(prompts, num_samples=1, max_new_tokens=T, rng=jax.random.key(i))
            jax.block_until_ready(r)
            assert int(r.lengths.min()) == T

        ids, mask = left_pad(prompts)

        def run_hf(i):
            torch.manual_seed(i)
            with torch.no_grad():
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=T,
                    min_new_tokens=T,
                    use_cache=True,
                )
            assert out.shape == (B, ids.shape[1] + T), out.shape

        # Interleaved rounds (JAX, then transformers at each thread count) so
        # that load from other processes on the shared CPU falls on both alike.
        # torch's OpenMP threads spin-wait and collapse when the CPU is shared:
        # transformers runs with 1 thread and with its default, the faster kept.
        t0 = time.perf_counter()
        run_jax(0)
        jw = time.perf_counter() - t0
        thread_counts = sorted({1, default_threads})
        for threads in thread_counts:
            torch.set_num_threads(threads)
            run_hf(0)
        jt, hf_runs = [], {t: [] for t in thread_counts}
        for i in range(args.repeats):
            t0 = time.perf_counter()
            run_jax(i + 1)
            jt.append(time.perf_counter() - t0)
            for threads in thread_counts:
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                run_hf(i + 1)
                hf_runs[threads].append(time.perf_counter() - t0)
        torch.set_num_threads(default_threads)
        hf_threads = min(hf_runs, key=lambda k: min(hf_runs[k]))
        ht = hf_runs[hf_threads]
        row = dict(
            batch=B,
            new_tokens=T,
            jax_tok_s=B * T / min(jt),
            hf_tok_s=B * T / min(ht),
            jax_warmup_s=jw,
            jax_best_s=min(jt),
            jax_median_s=statistics.median(jt),
            hf_best_s=min(ht),
            hf_median_s=statistics.median(ht),
            hf_threads=hf_threads,
            hf_best_s_by_threads={k: min(v) for k, v in hf_runs.items()},
        )
        row["ratio"] = row["jax_tok_s"] / row["hf_tok_s"]
        row["ratio_of_medians"] = row["hf_median_s"] / row["jax_median_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        "\n| batch | gspo_jax tok/s | transformers tok/s (threads) | ratio (best) "
        "| ratio (medians) | gspo_jax compile + first call (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['jax_tok_s']:,.0f} | {r['hf_tok_s']:,.0f} ({r['hf_threads']}) "
            f"| {r['ratio']:.2f}x | {r['ratio_of_medians']:.2f}x | {r['jax_warmup_s']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
