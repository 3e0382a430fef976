"""The sampler's tail: one step's rollout decoded all at once (`gspo_jax.decode`), in
sequential batches of S rows, and in S refilled slots (`gspo_jax.refill`), side by side
in one process, on the same prompts and keys.

    python -m experiments.bench.bench_refill                      # CPU, the default run's model
    python -m experiments.bench.bench_refill --json experiments/bench/results/refill_cpu.json

**The policy and its lengths.** The default run's architecture (configs/default.py: 2
MoE layers, d_model 128, 8 experts top-2), randomly initialised (init_std 0.02), over a
512-token vocabulary: its next-token distribution is close to uniform, so with ``--stop``
stop tokens a response ends at each step with probability about stop / 512, and the
lengths are geometric (memoryless, long-tailed: the longest of 512 is about six times
the mean) up to ``--max-new-tokens``, where the rest are truncated. The lengths each
program drew are reported (they are the same rows: a row's samples are keyed by the row).

**What is reported**, per program: decode steps after the prefill; slot-steps (steps x
the rows each step computes); the share of them that fed a live row's token (every
response token but a row's last is fed once); the prefill rows; wall time to finish the
rollout, the median and the best of ``--repeats`` interleaved rounds after a warm-up
call each. The refilled program's step count is checked against `simulate_steps`, the
fill rule run on the host over the lengths drawn, which then gives the steps at the
flagship's lengths (`experiments/bench/lengths.py`, 512 responses of at most 1,024
tokens) without a model: there a decode step is memory-bound (it reads the weights and
the cache whatever its live rows), so steps, not rows, are what a rollout waits on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx

from experiments.bench import lengths as lengths_lib
from gspo_jax import rollout
from gspo_jax.models import Transformer

VOCAB = 512


def simulate_steps(lengths, slots: int, chunk: int) -> int:
    """The decode steps `gspo_jax.refill` runs for rows of these response ``lengths`` (in
    queue order) in ``slots`` slots filled ``chunk`` rows at a time: a fill (while rows wait
    and min(chunk, waiting) slots are free) draws each new row's first token, each step one
    more token of every live row; a row of length L frees its slot after L - 1 steps."""
    lengths = [int(x) for x in lengths]
    left = [0] * slots  # tokens each slot's row has still to draw (0: free)
    nxt, steps = 0, 0

    def fill():
        nonlocal nxt
        while nxt < len(lengths):
            free = [s for s in range(slots) if left[s] == 0]
            k = min(chunk, len(lengths) - nxt)
            if len(free) < k:
                return
            for s, n in zip(free, lengths[nxt : nxt + k]):
                left[s] = n - 1
            nxt += k

    fill()
    while any(left):
        left = [max(x - 1, 0) for x in left]
        steps += 1
        fill()
    return steps


def policy(layers: int, seed: int = 0):
    """The default run's policy architecture over a `VOCAB`-token vocabulary, initialised
    (``layers``: another depth; 0 keeps the default's)."""
    from configs import default
    from gspo_jax import config as config_lib

    cfg = config_lib.load(default.get_config(), 1).model.model_config(VOCAB)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def run_programs(args) -> dict:
    model = policy(args.layers)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(1, VOCAB, int(n)).tolist() for n in rs.randint(8, 40, args.prompts)]
    stop = list(range(VOCAB - args.stop, VOCAB))
    kw = dict(
        num_samples=args.group_size,
        max_new_tokens=args.max_new_tokens,
        eos_id=stop,
        rng=jax.random.key(1),
        routing="none",
    )
    split = nnx.split(model)
    make = lambda **s: rollout.Sampler(*split, vocab_size=VOCAB, prompt_len=40, **s)  # noqa: E731
    per_call = args.slots // args.group_size  # prompts per sequential batch
    programs = {
        "all_at_once": lambda: [make()(prompts, **kw)],
        f"batches_of_{args.slots}": lambda: [
            make()(prompts[i : i + per_call], prompt_ids=list(range(i, i + per_call)), **kw)
            for i in range(0, len(prompts), per_call)
        ],
        f"refill_{args.slots}x{args.chunk}": lambda: [
            make(slots=args.slots, refill_chunk=args.chunk)(prompts, **kw)
        ],
    }
    times = {name: [] for name in programs}
    outs = {name: jax.block_until_ready(fn()) for name, fn in programs.items()}  # warm-up
    for _ in range(args.repeats):
        for name, fn in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    n_rows = args.prompts * args.group_size
    lengths = np.asarray(outs["all_at_once"][0].lengths)
    rows = {}
    for name, rolls in outs.items():
        got = np.concatenate([np.asarray(r.lengths) for r in rolls])
        width = args.slots if name.startswith(("refill", "batches")) else n_rows
        steps = sum(int(r.decode_steps) for r in rolls)
        rows[name] = dict(
            decode_steps=steps,
            rows_per_step=width,
            slot_steps=steps * width,
            live_share=float(np.maximum(got - 1, 0).sum()) / (steps * width),
            prefill_rows=n_rows if name.startswith("refill") else args.prompts,
            seconds_median=statistics.median(times[name]),
            seconds_best=min(times[name]),
            same_lengths=bool(np.array_equal(got, lengths)),
        )
    refill = rows[f"refill_{args.slots}x{args.chunk}"]
    refill["simulated_steps"] = simulate_steps(lengths, args.slots, args.chunk)
    return dict(
        lengths=dict(
            mean=float(lengths.mean()),
            median=float(np.median(lengths)),
            p90=float(np.percentile(lengths, 90)),
            max=int(lengths.max()),
            truncated=float(np.mean(lengths >= args.max_new_tokens)),
        ),
        programs=rows,
    )


def flagship_steps(slots_list=(128, 256), chunk: int = 32, seed: int = 0) -> dict:
    """Decode steps for 512 responses at the flagship's lengths (no model): all at once,
    in sequential batches of S, and in S refilled slots."""
    out = {}
    for name in sorted(lengths_lib.DISTRIBUTIONS):
        _, r = lengths_lib.sample(
            512, seed=seed, max_prompt_len=384, max_new_tokens=1024, name=name, group_size=8
        )
        row = dict(mean=float(r.mean()), max=int(r.max()), all_at_once=int(r.max()) - 1)
        for s in slots_list:
            row[f"batches_of_{s}"] = sum(int(r[i : i + s].max()) - 1 for i in range(0, 512, s))
            row[f"refill_{s}x{chunk}"] = simulate_steps(r, s, chunk)
        out[name] = row
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--stop", type=int, default=10, help="stop tokens (of 512): mean ~512/stop")
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--layers", type=int, default=0, help="0: the default run's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    result = dict(
        args=vars(args),
        device=str(jax.devices()[0].device_kind),
        **run_programs(args),
        flagship_steps=flagship_steps(),
    )
    print(f"lengths drawn: {result['lengths']}")
    print(
        f"{'program':<22}{'steps':>7}{'rows/step':>10}{'slot-steps':>12}{'live':>7}"
        f"{'prefill rows':>13}{'median s':>10}{'best s':>8}"
    )
    for name, r in result["programs"].items():
        print(
            f"{name:<22}{r['decode_steps']:>7}{r['rows_per_step']:>10}{r['slot_steps']:>12,}"
            f"{r['live_share']:>7.1%}{r['prefill_rows']:>13}{r['seconds_median']:>10.2f}"
            f"{r['seconds_best']:>8.2f}"
        )
    refill = result["programs"][f"refill_{args.slots}x{args.chunk}"]
    print(f"refill steps simulated on the host from the lengths: {refill['simulated_steps']}")
    print("decode steps for 512 responses at the flagship's lengths (host simulation):")
    for name, row in result["flagship_steps"].items():
        print(f"  {name}: {row}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
