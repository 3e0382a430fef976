"""Model throughput: forward+backward tokens/s, achieved FLOP/s against this
machine's dense f32 matmul FLOP/s (measured in the same run), and step time as
the expert count grows at fixed top-K and fixed active parameters.

    cd /work/main && . .venv/bin/activate
    python -m experiments.bench.bench_model                 # full run (README figures)
    python -m experiments.bench.bench_model --quick         # a few-second smoke run

One "step" is jit(value_and_grad) of the policy loss -mean(token_logprobs) +
router losses over a [B, T] batch (no optimizer update).  Model FLOPs count
every executed matmul (attention over all T keys, as computed), forward x 3 for
forward + backward; MoE layers count K experts per token (active parameters).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax.models import ModelConfig, Transformer


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    """Best-of-`reps` f32 n x n matmul FLOP/s (jitted)."""
    a = jnp.asarray(np.random.RandomState(0).randn(n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def step_flops(cfg: ModelConfig, b: int, t: int) -> float:
    """Forward+backward model FLOPs of one step (3 x forward matmul FLOPs)."""
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_tok = 0.0
    for moe in cfg.layer_kinds:
        per_tok += 2 * d * hd * (h + 2 * kv) + 2 * h * hd * d  # q, k, v, o
        per_tok += 4 * t * h * hd  # scores and weighted values over all T keys
        if moe:
            per_tok += 2 * d * cfg.num_experts + cfg.top_k * 6 * d * cfg.moe_d_ff
        else:
            per_tok += 6 * d * cfg.d_ff
    per_tok += 2 * d * cfg.vocab_size
    return 3 * per_tok * b * t


def time_step(cfg: ModelConfig, b: int, t: int, steps: int) -> tuple[float, float]:
    """(median seconds per step, compile seconds)."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, cfg.vocab_size, (b, t)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)

    def loss(st):
        m = nnx.merge(graphdef, st)
        lp, _, aux = m.token_logprobs(tokens, targets)
        return -jnp.mean(lp) + aux.loss(0.01, 1e-3)

    f = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    jax.block_until_ready(f(state))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(state))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), compile_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    q = args.quick
    res = {"devices": str(jax.devices()[0].platform), "jax": jax.__version__}

    peak = matmul_peak(512 if q else 2048)
    res["matmul_peak_flops"] = peak
    print(f"dense f32 matmul peak: {peak / 1e9:.1f} GFLOP/s", flush=True)

    # ---- ~100M-parameter model: forward+backward throughput.
    big = ModelConfig(
        vocab_size=32768,
        d_model=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        d_ff=2048,
        moe_d_ff=768,
        num_experts=8,
        top_k=2,
        tie_embeddings=True,
        moe_backend="blocked",
    )
    b, t = 4, 256
    if q:
        big = big.replace(vocab_size=4096, d_model=128, num_layers=2, head_dim=32, moe_d_ff=128)
        b, t = 2, 64
    rows = []
    for backend in ("blocked", "ragged", "dense"):
        cfg = big.replace(moe_backend=backend)
        sec, comp = time_step(cfg, b, t, args.steps)
        fl = step_flops(cfg, b, t)
        row = dict(
            backend=backend,
            params=cfg.num_params(),
            active=cfg.num_params(active=True),
            tokens=b * t,
            step_s=sec,
            compile_s=comp,
            tokens_per_s=b * t / sec,
            flops=fl / sec,
            frac_peak=fl / sec / peak,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    res["big"] = rows

    # ---- expert scaling at fixed top-K and active parameters.
    base = ModelConfig(
        vocab_size=4096,
        d_model=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        d_ff=1024,
        moe_d_ff=512,
        num_experts=8,
        top_k=2,
        tie_embeddings=True,
    )
    b, t = 16, 256
    if q:
        base = base.replace(d_model=64, moe_d_ff=64, head_dim=16)
        b, t = 2, 64
    sweep = []
    for backend, experts in (("blocked", (8, 16, 32, 64)), ("ragged", (8, 16)), ("dense", (8, 16))):
        for e in experts:
            cfg = base.replace(num_experts=e, moe_backend=backend)
            sec, comp = time_step(cfg, b, t, args.steps)
            row = dict(
                backend=backend,
                experts=e,
                params=cfg.num_params(),
                active=cfg.num_params(active=True),
                step_s=sec,
                compile_s=comp,
                flops_frac_peak=step_flops(cfg, b, t) / sec / peak,
            )
            sweep.append(row)
            print(json.dumps(row), flush=True)
    res["sweep"] = sweep

    print(
        "\n| backend | params | active | tokens/step | step s | tokens/s | model GFLOP/s | of matmul peak |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['params'] / 1e6:.1f}M | {r['active'] / 1e6:.1f}M | {r['tokens']} "
            f"| {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['flops'] / 1e9:.1f} "
            f"| {100 * r['frac_peak']:.0f}% |"
        )
    print("\n| backend | experts | params | active | step s | vs 8 experts | of matmul peak |")
    print("|---|---|---|---|---|---|---|")
    for r in sweep:
        ref = next(s for s in sweep if s["backend"] == r["backend"] and s["experts"] == 8)
        print(
            f"| {r['backend']} | {r['experts']} | {r['params'] / 1e6:.1f}M | {r['active'] / 1e6:.1f}M "
            f"| {r['step_s']:.3f} | {r['step_s'] / ref['step_s']:.2f}x "
            f"| {100 * r['flops_frac_peak']:.0f}% |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
