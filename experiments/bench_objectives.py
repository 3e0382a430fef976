"""Times every objective, jitted forward + backward, at N x T (default 512 x 2048).

Baseline: a plain masked mean of logp, sum(mask * logp) / sum(mask), forward +
backward at the same shape. Each objective is timed two ways:

  * with its metrics returned (what a step that logs pays);
  * with the metrics dropped inside jit (XLA then removes their computation).

The three functions (baseline, objective with metrics, objective without) are
called in turn, --runs rounds after --warmup rounds, each call ended by
block_until_ready, so load from other processes falls on all three alike. The
table gives the median (and the minimum) per call and the ratio of medians to the
baseline timed in the same rounds.

    PYTHONPATH=. python experiments/bench_objectives.py                 # N=512, T=2048
    PYTHONPATH=. python experiments/bench_objectives.py --n 64 --t 256  # quick
    PYTHONPATH=. python experiments/bench_objectives.py --ops           # cost of one pass

--ops times single jitted elementwise passes and reductions at the same shape instead:
what one stored [N,T] array or one extra pass costs on this backend.
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


def time_interleaved(calls, warmup: int, runs: int):
    """calls: list of (fn, args). Returns per call (median ms, min ms)."""
    for _ in range(warmup):
        for fn, args in calls:
            jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for _ in range(runs):
        for k, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - t0)
    return [(statistics.median(t) * 1e3, min(t) * 1e3) for t in times]


def time_fn(fn, args, warmup: int, runs: int) -> float:
    """Median ms of one function (for ad-hoc use)."""
    return time_interleaved([(fn, args)], warmup, runs)[0][0]


# One pass each, at the benchmark's shape (see --ops): (op, what it does, fn).
PASSES = (
    ("lp * m", "writes one [N,T] array", lambda lp, old, m: lp * m),
    ("exp(lp - old)", "writes one [N,T] array", lambda lp, old, m: jnp.exp(lp - old)),
    ("clip(where(m > 0, lp - old, 0), -20, 20)", "writes one",
     lambda lp, old, m: jnp.clip(jnp.where(m > 0, lp - old, 0.0), -20.0, 20.0)),
    ("sum(m * (lp - old), -1)", "one row reduction",
     lambda lp, old, m: jnp.sum(m * (lp - old), -1)),
    ("sum(m * exp(lp - old), -1)", "one row reduction",
     lambda lp, old, m: jnp.sum(m * jnp.exp(lp - old), -1)),
)


def time_passes(x, warmup: int, runs: int) -> None:
    args = (x["logp"], x["old"], x["mask"])
    times = time_interleaved([(jax.jit(fn), args) for _, _, fn in PASSES], warmup, runs)
    print("| op | median us | min us |\n|---|---:|---:|")
    for (op, what, _), (med, mn) in zip(PASSES, times):
        print(f"| `{op}` ({what}) | {med * 1e3:.0f} | {mn * 1e3:.0f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--t", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=21)
    p.add_argument("--kl", action="store_true", help="add a k3 KL term (kl_coef=0.04) to all")
    p.add_argument("--ops", action="store_true", help="time single passes instead (see above)")
    args = p.parse_args()

    x = make_inputs(args.n, args.t)
    if args.ops:
        print(f"N={args.n}, T={args.t}, {jax.devices()[0].platform}, jax {jax.__version__}, "
              f"{args.runs} interleaved rounds after {args.warmup} warm-up\n")
        time_passes(x, args.warmup, args.runs)
        return

    @jax.jit
    def baseline(logp, mask):
        return jax.value_and_grad(
            lambda lp: jnp.sum(mask * lp) / jnp.maximum(jnp.sum(mask), 1.0))(logp)

    dev = jax.devices()[0]
    print(f"N={args.n}, T={args.t}, {dev.platform}, jax {jax.__version__}, "
          f"kl={'k3, kl_coef=0.04' if args.kl else 'off'}, {args.runs} interleaved rounds "
          f"after {args.warmup} warm-up; ms per call, median (min)\n")
    print("| objective | baseline ms | fwd+bwd+metrics ms | ratio | fwd+bwd, metrics dropped, ms"
          " | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in objectives.names():
        fn = objectives.get(name)
        kw = {"kl_coef": 0.04 if args.kl else 0.0}

        def loss(lp, old, adv, mask, ref, gamma, fn=fn, name=name, kw=kw):
            extra = {"router_shift": gamma} if name == "rspo" else {}
            return fn(lp, old, adv, mask, ref_logp=ref, **extra, **kw)

        inputs = (x["logp"], x["old"], x["adv"], x["mask"], x["ref"], x["gamma"])
        with_metrics = jax.jit(jax.value_and_grad(loss, has_aux=True))
        loss_only = jax.jit(jax.value_and_grad(lambda *a, loss=loss: loss(*a)[0]))
        (b, bmin), (w, wmin), (l, lmin) = time_interleaved(
            [(baseline, (x["logp"], x["mask"])), (with_metrics, inputs), (loss_only, inputs)],
            args.warmup, args.runs)
        print(f"| {name} | {b:.2f} ({bmin:.2f}) | {w:.2f} ({wmin:.2f}) | {w / b:.2f} | "
              f"{l:.2f} ({lmin:.2f}) | {l / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
