"""Time of one bare `Transformer.decode` step against the KV cache's length.

The model is the tiny Qwen3-MoE of `bench_rollout.py` (4 layers, d_model 128,
4 heads / 2 KV heads of 32, 8 experts top-2, vocab 512), loaded through
`from_pretrained`.  For each cache length S, a jitted `fori_loop` runs
`--steps` one-token decode steps at batch `--batch` (greedy argmax feedback, no
sampling or recording), on a cache of S slots whose first `--prompt` slots hold
a prefilled prompt; the cache is donated to the call.  Reported: the best of
`--repeats` timed calls (after one warm-up call) divided by the step count.

A decode step must cost the attention over S slots (O(B S) reads of K and V)
plus the fixed per-token work; anything that copies the cache per layer shows
up as a much steeper growth in S.

    python -m experiments.bench.bench_decode_step                # S = 80, 1024
    python -m experiments.bench.bench_decode_step --slots=80,256,1024 --batch=64
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.bench_rollout import make_checkpoint  # the same weights
from gspo_jax.models import from_pretrained


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", default="80,1024")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--moe-backend", default="blocked", choices=["blocked", "ragged", "dense", "auto"]
    )
    ap.add_argument("--unrolled", action="store_true", help="scan_layers=False")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as ckpt:
        make_checkpoint(ckpt)
        model = from_pretrained(ckpt, moe_backend=args.moe_backend, scan_layers=not args.unrolled)
    B, P, n = args.batch, args.prompt, args.steps
    rs = np.random.RandomState(0)
    prompt = jnp.asarray(rs.randint(1, model.cfg.vocab_size, size=(B, P)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))

    @jax.jit
    def prefill(cache):
        logits, _, cache = model.decode(prompt, cache, positions=pos)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnums=(1,))
    def steps(tok, cache):
        def body(i, c):
            tok, cache = c
            logits, _, cache = model.decode(tok[:, None], cache, positions=jnp.full((B, 1), P + i))
            return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, n, body, (tok, cache))

    print(
        json.dumps(
            dict(
                jax=jax.__version__,
                batch=B,
                prompt=P,
                steps=n,
                moe_backend=args.moe_backend,
                scan_layers=not args.unrolled,
                load_avg=os.getloadavg(),
            )
        )
    )
    for S in [int(s) for s in args.slots.split(",")]:
        if S < P + n:
            raise ValueError(f"--slots: {S} < prompt {P} + steps {n}")
        tok, cache = prefill(model.init_cache(B, S))
        times = []
        for r in range(args.repeats + 1):
            c = jax.tree.map(jnp.copy, cache)
            jax.block_until_ready(c)
            t0 = time.perf_counter()
            jax.block_until_ready(steps(tok, c))
            times.append(time.perf_counter() - t0)
        best = min(times[1:])
        print(
            json.dumps(
                dict(
                    slots=S,
                    ms_per_step=round(1e3 * best / n, 2),
                    all_ms_per_step=[round(1e3 * t / n, 2) for t in times[1:]],
                )
            )
        )
    print(json.dumps(dict(load_avg_end=os.getloadavg())))


if __name__ == "__main__":
    main()
