"""Throughput of sampling overlapped with training against the serial schedule, on the same
split of the devices (docs/offpolicy.md).

    python -m experiments.bench.bench_overlap                    # default config, 8 fake CPU devices
    python -m experiments.bench.bench_overlap --config configs/bench_rl_h200.py --devices 4

Both schedules run ``--steps`` timed RL steps (after one that compiles) at
``rollout.staleness=1`` with the sampler on ``--devices`` devices of its own and training on
the rest; they compute the same numbers, so the ratio of their median step times is what
overlap buys. It also reports, for the overlapped schedule, the median time the host spent
collecting the next batch (sampling and scoring) and then waiting for the updates: which
side is the bottleneck. On a CPU host every fake device shares the same cores, so the
two sides compete for them and overlap cannot be faster there; the figure that matters is
from machines with several accelerators.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import jax

from experiments.bench.bench_rl_step import load_config
from gspo_jax.rl import RLPhase
from gspo_jax.run_parts import RunParts


def run(spec: str, devices: int, overlap: bool, steps: int, workdir: str) -> dict[str, float]:
    c = load_config(spec)
    c.rollout.staleness = max(int(c.rollout.staleness), 1)
    c.rollout.devices, c.rollout.overlap = devices, overlap
    c.sft.steps = 0
    trainer = RunParts(c, workdir)
    rl = RLPhase(trainer, trainer.init_params)
    rl.step(0)  # compiles every program
    ms = [rl.step(s)[0] for s in range(1, steps + 1)]
    out = {"step_time": statistics.median(m["step_time"] for m in ms)}
    if overlap:
        out["collect_time"] = statistics.median(m["collect_time"] for m in ms)
        out["train_wait_time"] = statistics.median(m["train_wait_time"] for m in ms)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/default.py")
    p.add_argument("--devices", type=int, default=0, help="the sampler's (default: half)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    n = args.devices or jax.device_count() // 2
    with tempfile.TemporaryDirectory() as tmp:
        serial = run(args.config, n, False, args.steps, os.path.join(tmp, "serial"))
        overlap = run(args.config, n, True, args.steps, os.path.join(tmp, "overlap"))
    dev = jax.devices()[0]
    print(
        f"{jax.device_count()} x {dev.device_kind} ({dev.platform}); sampler on {n}, training on "
        f"{jax.device_count() - n}; {args.config}; median of {args.steps} steps"
    )
    print(f"serial    step {serial['step_time']:.3f} s")
    print(
        f"overlap   step {overlap['step_time']:.3f} s (collect {overlap['collect_time']:.3f} s, "
        f"then waited {overlap['train_wait_time']:.3f} s for the updates)"
    )
    print(f"overlap / serial step time: {overlap['step_time'] / serial['step_time']:.3f}")


if __name__ == "__main__":
    main()
