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
    PYTHONPATH=. python experiments/bench_objectives.py --chain 8       # accelerators
    PYTHONPATH=. python experiments/bench_objectives.py --profile       # GPU kernel time

--chain S makes each timed call run S forward+backward passes inside one jit, over S
distinct input sets, each pass's log-probs offset by 1e-30 x the previous pass's loss
(so the passes run in order and none can be hoisted or merged), and reports time per
pass. On an accelerator this is what the device spends: one call's dispatch and
host sync (tens of microseconds) are shared by S passes, where at S=1 they would
outweigh a pass of a few microseconds, and S input sets do not fit in the cache.

--profile (GPU) replaces the wall clock by the profiler's record: for each function,
--runs calls are traced (jax.profiler) and the table gives the summed duration of
the GPU kernels per call, and the number of kernels per call. This is the device
time the computation costs inside a larger program, without the launch gaps a
standalone call has.

--ops times single jitted elementwise passes and reductions at the same shape instead:
what one stored [N,T] array or one extra pass costs on this backend.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
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


def stacked_inputs(n: int, t: int, sets: int):
    """`sets` independent input sets, each array stacked on a new leading axis."""
    xs = [make_inputs(n, t, seed) for seed in range(sets)]
    return {k: jnp.stack([x[k] for x in xs]) for k in xs[0]}


def chained(vg, sets: int):
    """jit of: vg over `sets` stacked input sets in turn (see --chain).

    vg(*args) returns (value, grad) or ((value, aux), grad); args[0] is the
    log-probs. Pass i+1's log-probs get 1e-30 x pass i's loss added: far below half
    an ulp of any log-prob here, so the values do not change, but a data dependency
    that XLA keeps."""

    def run(*stacked):
        offset = jnp.zeros((), jnp.float32)
        outs = []
        for i in range(sets):
            args = [a[i] for a in stacked]
            args[0] = args[0] + offset
            out = vg(*args)
            value = out[0][0] if isinstance(out[0], tuple) else out[0]
            offset = value * 1e-30
            outs.append(out)
        return outs

    return jax.jit(run)


def _warm_up(calls, warmup: int) -> None:
    for _ in range(warmup):
        for fn, args in calls:
            jax.block_until_ready(fn(*args))


def time_interleaved(calls, warmup: int, runs: int):
    """calls: list of (fn, args). Returns per call (median ms, min ms)."""
    _warm_up(calls, warmup)
    times = [[] for _ in calls]
    for _ in range(runs):
        for k, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - t0)
    return [(statistics.median(t) * 1e3, min(t) * 1e3) for t in times]


def _gpu_kernels(data, show_lines: bool):
    """Kernel events of the GPU planes of a profile (lines named "Stream ...")."""
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            evs = list(line.events)
            if show_lines:
                print(f"  profile: {plane.name} / {line.name}: {len(evs)} events", file=sys.stderr)
            if line.name.startswith("Stream"):
                events.extend(evs)
    return events


def profile_calls(calls, warmup: int, runs: int, show_lines: bool = False):
    """calls: list of (fn, args). Per function: (GPU kernel ms per call, kernels per
    call), from its own profiler trace of `runs` calls (see --profile)."""
    _warm_up(calls, warmup)
    out = []
    for fn, args in calls:
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            for _ in range(runs):
                jax.block_until_ready(fn(*args))
            jax.profiler.stop_trace()
            paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
            if len(paths) != 1:
                raise RuntimeError(f"expected one .xplane.pb under the trace folder, found {paths}")
            events = _gpu_kernels(jax.profiler.ProfileData.from_file(paths[0]), show_lines)
            show_lines = False
        if not events:
            raise RuntimeError("--profile found no GPU kernels in the trace: it needs a GPU "
                               f"backend (this one is {jax.default_backend()})")
        out.append((sum(e.duration_ns for e in events) / runs / 1e6, len(events) / runs))
    return out


def _ms(v: float) -> str:
    return f"{v:.2f}" if v >= 0.995 else f"{v:.4f}"


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
    p.add_argument("--profile", action="store_true",
                   help="GPU kernel time per call from a profiler trace (see above)")
    p.add_argument("--chain", type=int, default=1,
                   help="forward+backward passes per timed call, over distinct inputs (see above)")
    args = p.parse_args()
    if args.chain < 1:
        p.error(f"--chain must be >= 1, got {args.chain}")
    if args.profile and args.chain != 1:
        p.error("--profile measures kernel time per call; it takes no --chain")

    x = make_inputs(args.n, args.t)
    if args.ops:
        print(f"N={args.n}, T={args.t}, {jax.devices()[0].platform}, jax {jax.__version__}, "
              f"{args.runs} interleaved rounds after {args.warmup} warm-up\n")
        time_passes(x, args.warmup, args.runs)
        return

    def baseline_vg(logp, mask):
        return jax.value_and_grad(
            lambda lp: jnp.sum(mask * lp) / jnp.maximum(jnp.sum(mask), 1.0))(logp)

    s = args.chain
    if s > 1:
        x = stacked_inputs(args.n, args.t, s)
    wrap = (lambda vg: chained(vg, s)) if s > 1 else jax.jit
    baseline = wrap(baseline_vg)

    dev = jax.devices()[0]
    print(f"N={args.n}, T={args.t}, {dev.platform}, jax {jax.__version__}, "
          f"kl={'k3, kl_coef=0.04' if args.kl else 'off'}, {args.runs} interleaved rounds "
          f"after {args.warmup} warm-up; "
          + ("GPU kernel ms per call from a profiler trace (kernels per call)\n" if args.profile
             else f"ms per pass (one call = {s} chained passes), median (min)\n" if s > 1
             else "ms per call, median (min)\n"))
    print("| objective | baseline ms | fwd+bwd+metrics ms | ratio | fwd+bwd, metrics dropped, ms"
          " | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    base_times = []
    for name in objectives.names():
        fn = objectives.get(name)
        kw = {"kl_coef": 0.04 if args.kl else 0.0}

        def loss(lp, old, adv, mask, ref, gamma, fn=fn, name=name, kw=kw):
            extra = {"router_shift": gamma} if name == "rspo" else {}
            return fn(lp, old, adv, mask, ref_logp=ref, **extra, **kw)

        inputs = (x["logp"], x["old"], x["adv"], x["mask"], x["ref"], x["gamma"])
        with_metrics = wrap(jax.value_and_grad(loss, has_aux=True))
        loss_only = wrap(jax.value_and_grad(lambda *a, loss=loss: loss(*a)[0]))
        calls = [(baseline, (x["logp"], x["mask"])), (with_metrics, inputs), (loss_only, inputs)]
        if args.profile:  # (kernel ms, kernels per call)
            rows = [(ms, f"{k:g}")
                    for ms, k in profile_calls(calls, args.warmup, args.runs,
                                               show_lines=not base_times)]
        else:  # (median ms, min ms) per pass
            rows = [(med / s, _ms(mn / s))
                    for med, mn in time_interleaved(calls, args.warmup, args.runs)]
        (b, bd), (w, wd), (l, ld) = rows
        print(f"| {name} | {_ms(b)} ({bd}) | {_ms(w)} ({wd}) | {w / b:.2f} | "
              f"{_ms(l)} ({ld}) | {l / b:.2f} |", flush=True)
        base_times.append(b)
    # The baseline reads logp and mask and writes the gradient: 3 x N x T x 4 bytes.
    moved = 3 * args.n * args.t * 4
    b = statistics.median(base_times)
    print(f"\nbaseline: {moved / 1e6:.3g} MB moved per pass in {_ms(b)} ms (median over the "
          f"rows), {moved / (b * 1e-3) / 1e9:.3g} GB/s")


if __name__ == "__main__":
    main()
