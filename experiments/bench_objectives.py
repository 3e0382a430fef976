"""Times every objective, jitted forward + backward (with its metrics), at N x T.

Baseline: a plain masked mean of logp, sum(mask * logp) / sum(mask), forward +
backward at the same shape. Each timing is the median of --runs calls after
--warmup calls, each ended by block_until_ready.

    python experiments/bench_objectives.py                 # N=512, T=2048
    python experiments/bench_objectives.py --n 64 --t 256  # quick

Prints a markdown table: ms per call and the ratio to the baseline, with the metrics
returned (what a logging step pays) and with them dropped inside jit (XLA then
removes their computation).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import objectives


def make_inputs(n: int, t: int, seed: int = 0):
    rs = np.random.RandomState(seed)
    old = rs.normal(-2.0, 1.0, (n, t)).astype(np.float32)
    logp = (old + rs.normal(0.0, 0.1, (n, t))).astype(np.float32)
    ref = (old + rs.normal(0.0, 0.1, (n, t))).astype(np.float32)
    lengths = rs.randint(1, t + 1, n)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    adv = rs.normal(0.0, 1.0, n).astype(np.float32)
    gamma = rs.uniform(0.5, 1.0, (n, t)).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in dict(logp=logp, old=old, ref=ref, mask=mask, adv=adv,
                                                gamma=gamma).items()}


def time_fn(fn, args, warmup: int, runs: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--t", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--kl", action="store_true", help="add a k3 KL term (kl_coef=0.04) to all")
    args = p.parse_args()

    x = make_inputs(args.n, args.t)

    @jax.jit
    def baseline(logp, mask):
        return jax.value_and_grad(lambda lp: jnp.sum(mask * lp) / jnp.maximum(jnp.sum(mask), 1.0))(logp)

    base_ms = time_fn(baseline, (x["logp"], x["mask"]), args.warmup, args.runs)
    rows = [("masked mean of logp (baseline)", base_ms, base_ms)]
    for name in objectives.names():
        fn = objectives.get(name)
        kw = {"kl_coef": 0.04 if args.kl else 0.0}

        def loss(lp, old, adv, mask, ref, gamma, fn=fn, name=name, kw=kw):
            extra = {"router_shift": gamma} if name == "rspo" else {}
            return fn(lp, old, adv, mask, ref_logp=ref, **extra, **kw)

        inputs = (x["logp"], x["old"], x["adv"], x["mask"], x["ref"], x["gamma"])
        with_metrics = jax.jit(jax.value_and_grad(loss, has_aux=True))
        # Metrics dropped inside jit: XLA removes their computation (steps that do not log).
        loss_only = jax.jit(jax.value_and_grad(lambda *a, loss=loss: loss(*a)[0]))
        rows.append((name, time_fn(with_metrics, inputs, args.warmup, args.runs),
                     time_fn(loss_only, inputs, args.warmup, args.runs)))

    dev = jax.devices()[0]
    print(f"N={args.n}, T={args.t}, {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
          f"kl={'k3' if args.kl else 'off'}, median of {args.runs} after {args.warmup} warm-up\n")
    print("| objective | fwd+bwd+metrics ms | ratio | fwd+bwd (metrics dropped) ms | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, ms, ms_loss in rows:
        print(f"| {name} | {ms:.2f} | {ms / base_ms:.2f} | {ms_loss:.2f} | "
              f"{ms_loss / base_ms:.2f} |")

if __name__ == "__main__":
    main()
