"""Partial rollouts in steady state (`gspo_jax.partial`): responses finished per decode
step and per second, against one step's rollout decoded all at once, on the same policy.

    python -m experiments.bench.bench_partial                      # CPU, the default run's model
    python -m experiments.bench.bench_partial --json experiments/bench/results/partial_cpu.json

**The policy and its lengths** are `bench_refill`'s: the default run's architecture,
randomly initialised over a 512-token vocabulary, with ``--stop`` stop tokens, so that a
response ends at each token with probability about stop / 512 (geometric, long-tailed
lengths) up to ``--max-new-tokens``. The parameters do not change between steps: this
measures the sampler alone, not what training on carried responses does.

**Partial.** ``--prompts`` x ``--group-size`` rows in group slots (`partial.Slots`): each
step goes on with the carried rows and starts fresh prompts in the vacant slots, decodes
at most ``--budget`` tokens per row (`decode.generate_jit` with its prefix,
`partial.merge_jit`), and the groups whose rows have all ended leave. After ``--warmup`` steps (the pool reaches its
mix of carried and fresh groups) ``--steps`` steps are timed. **All at once:** the batch
program on ``--prompts`` fresh prompts, until its longest response ends.

What is reported: responses finished per decode step and per second, decode steps per
step, the groups finished per step, and the lengths. Each step's decode count is checked
against `decode_steps`, the program's rule (at most the budget, less when every live row
stops sooner), which `simulate` then runs on the host over drawn lengths, at the
flagship's (`experiments/bench/lengths.py`) too: there a decode step is memory-bound and
steps, not rows, are what a rollout waits on. A group is trained on only when its G
responses have ended, so a partial step trains on fewer groups than a step all at once,
partly on tokens of earlier policies.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.bench import bench_refill
from experiments.bench import lengths as lengths_lib
from gspo_jax import decode, partial, rollout

VOCAB = bench_refill.VOCAB
PROMPT_LEN = 40


def decode_steps(segment_lengths, budget: int) -> int:
    """The decode steps of one partial step: the batch program draws a live row's first
    new token from its prefill and one more per step, until every live row has stopped
    or the budget is drawn (``segment_lengths``: the new tokens each live row would draw
    before its stop token, uncapped)."""
    return min(budget, int(np.max(segment_lengths))) - 1 if len(segment_lengths) else 0


def simulate(
    draw, *, groups: int, group_size: int, max_new_tokens: int, budget: int, steps: int, warmup: int
) -> dict:
    """The partial schedule on the host: ``draw(n)`` gives n rows' uncapped lengths (a
    row's length to its stop token). Returns responses finished and decode steps over the
    ``steps`` steps after ``warmup``."""
    slots = partial.Slots(groups, group_size, max_new_tokens)
    natural = np.zeros(slots.n, np.int64)
    finished = total = 0
    for s in range(warmup + steps):
        vacant, k, live = slots.begin()
        starts = np.repeat(vacant, group_size)
        natural[starts] = draw(int(starts.sum()))
        want = np.where(live, natural - k, 0)
        n = decode_steps(want[live], budget)
        new = np.minimum(want, budget)
        length = np.minimum(k + new, max_new_tokens)
        stopped = (want <= budget) & (natural <= max_new_tokens)
        done = slots.end(live, length, stopped)
        slots.vacate(done)
        if s >= warmup:
            finished += int(done.sum()) * group_size
            total += n
    return dict(finished=finished, decode_steps=total)


def run_partial(model, prompts_at, args) -> dict:
    """The partial program's steady state (the module docstring)."""
    graphdef, state = nnx.split(model)
    g, t = args.group_size, args.max_new_tokens
    slots = partial.Slots(args.prompts, g, t)
    pool = {
        k: jnp.zeros((slots.n, t), d)
        for k, d in (("tokens", jnp.int32), ("logp", jnp.float32), ("version", jnp.int32))
    }
    spec = partial.spec_for(args.budget, g, 0, None, False, "none")
    stop = jnp.asarray(np.arange(VOCAB - args.stop, VOCAB), jnp.int32)
    times, steps, finished, checked, lengths = [], [], [], 0, []
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        vacant, k, live = slots.begin()
        toks = np.zeros((args.prompts, PROMPT_LEN), np.int32)
        mask = np.zeros(toks.shape, bool)
        for i, pos in enumerate(slots.positions):
            p = prompts_at(int(pos))
            toks[i, PROMPT_LEN - len(p) :], mask[i, PROMPT_LEN - len(p) :] = p, True
        new = decode.generate_jit(
            graphdef,
            state,
            jax.random.key(s),
            toks,
            mask,
            slots.positions.astype(np.int32),
            live,
            stop,
            jnp.float32(1.0),
            jnp.float32(0.0),
            spec=spec,
            prefix=pool["tokens"],
            prefix_len=k,
        )
        pool, length, stopped = partial.merge_jit(pool, new, k, live, np.int32(s), pad_id=0)
        length, stopped = np.asarray(length), np.asarray(stopped)
        seg = np.asarray(new["lengths"])[live]
        seg_stopped = ~np.asarray(new["truncated"])[live]
        done = slots.end(live, length, stopped)
        lengths += slots.lengths.reshape(-1, g)[done].ravel().tolist()
        slots.vacate(done)
        times.append(time.perf_counter() - t0)
        n = int(new["decode_steps"])
        # The program's count is the rule's: a row that drew the whole budget without a
        # stop token would have gone on (its uncapped length is more than the budget).
        assert n == decode_steps(np.where(seg_stopped, seg, args.budget + 1), args.budget), s
        checked += 1
        steps.append(n)
        finished.append(int(done.sum()) * g)
    timed = slice(args.warmup, None)
    seconds, fin, dec = sum(times[timed]), sum(finished[timed]), sum(steps[timed])
    return dict(
        steps_timed=args.steps,
        decode_steps_per_step=dec / args.steps,
        responses_finished=fin,
        responses_per_decode_step=fin / max(dec, 1),
        responses_per_second=fin / seconds,
        seconds_per_step=seconds / args.steps,
        decode_counts_checked=checked,
        finished_lengths_mean=float(np.mean(lengths)) if lengths else 0.0,
    )


def run_all_at_once(model, prompts, args) -> dict:
    sampler = rollout.Sampler(*nnx.split(model), vocab_size=VOCAB, prompt_len=PROMPT_LEN)
    kw = dict(
        num_samples=args.group_size,
        max_new_tokens=args.max_new_tokens,
        eos_id=list(range(VOCAB - args.stop, VOCAB)),
        routing="none",
    )
    jax.block_until_ready(sampler(prompts, rng=jax.random.key(0), **kw))  # warm-up
    times, steps, lengths = [], [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(sampler(prompts, rng=jax.random.key(1 + r), **kw))
        times.append(time.perf_counter() - t0)
        steps.append(int(out.decode_steps))
        lengths.append(np.asarray(out.lengths))
    n = len(prompts) * args.group_size * args.repeats
    return dict(
        decode_steps_per_rollout=float(np.mean(steps)),
        responses_per_decode_step=n / sum(steps),
        responses_per_second=n / sum(times),
        seconds_per_rollout=float(np.mean(times)),
        lengths_mean=float(np.mean(np.concatenate(lengths))),
    )


def flagship(budgets=(256, 512), seed: int = 0, steps: int = 40, warmup: int = 20) -> dict:
    """Responses finished per decode step at the flagship's lengths (no model): 64 groups
    of 8, responses of at most 1,024 tokens, against all at once."""
    out = {}
    for name in sorted(lengths_lib.DISTRIBUTIONS):
        rs = np.random.RandomState(seed)

        def draw(n):
            _, r = lengths_lib.sample(
                n,
                seed=int(rs.randint(2**31)),
                max_prompt_len=384,
                max_new_tokens=4096,
                name=name,
                group_size=1,
            )
            return r

        once = [int(np.minimum(draw(512), 1024).max()) - 1 for _ in range(steps)]
        row = dict(all_at_once=512 * steps / sum(once))
        for b in budgets:
            sim = simulate(
                draw,
                groups=64,
                group_size=8,
                max_new_tokens=1024,
                budget=b,
                steps=steps,
                warmup=warmup,
            )
            row[f"partial_{b}"] = sim["finished"] / sim["decode_steps"]
        out[name] = row
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--stop", type=int, default=10, help="stop tokens (of 512): mean ~512/stop")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="all-at-once rollouts timed")
    ap.add_argument("--layers", type=int, default=0, help="0: the default run's")
    ap.add_argument("--flagship", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    model = bench_refill.policy(args.layers)
    rs = np.random.RandomState(0)
    pool = [rs.randint(1, VOCAB, int(n)).tolist() for n in rs.randint(8, PROMPT_LEN, 4096)]
    prompts_at = lambda pos: pool[pos % len(pool)]  # noqa: E731
    result = dict(
        args=vars(args),
        device=str(jax.devices()[0].device_kind),
        all_at_once=run_all_at_once(model, pool[: args.prompts], args),
        partial=run_partial(model, prompts_at, args),
    )
    if args.flagship:
        result["flagship_responses_per_decode_step"] = flagship()
    for name in ("all_at_once", "partial"):
        print(
            name,
            json.dumps(
                {k: round(v, 4) if isinstance(v, float) else v for k, v in result[name].items()}
            ),
        )
    if args.flagship:
        print("responses finished per decode step at the flagship's lengths (host simulation):")
        for name, row in result["flagship_responses_per_decode_step"].items():
            print(f"  {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
