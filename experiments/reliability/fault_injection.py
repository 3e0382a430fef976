"""The default run under faults: five SIGKILLs at random points and one exception right
after a checkpoint save, resumed each time by the same command, against a run that was
never interrupted.

    python -m experiments.reliability.fault_injection --workdir runs/faults \
        --reference runs/default [--seed 0] [-- --config.total_rl_steps=...]

Each launch is ``python -m gspo_jax.train --config=configs/default.py`` on the same
workdir, and the plan is drawn from ``--seed`` before the first: SIGKILL a random time
(uniform in ``[0, --max-delay]`` s) after the checkpoint of SFT step a appears, then of
SFT step b; then a launch under a wrapper that raises ``RuntimeError`` in the trainer right
after its first checkpoint save returns (the save is still being written in the
background: the run must finish it before it exits); then SIGKILLs after the checkpoints
of SFT step c, RL step 20 and RL step 40; then a launch that runs to the end (a < b < c
are multiples of ``checkpoint_every``, 20 at the default config). Then every record of
the two ``metrics.jsonl`` files is compared value by value, timing fields excepted, and
each step must be logged exactly once.
The result (each launch's end, the checkpoints before and after it, the comparison) goes
to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from gspo_jax.metrics_log import read_metrics

TIMING = {"step_time", "rollout_time", "old_logp_time", "update_time", "sample_time"}
TIMING |= {"tokens_per_s", "collect_time", "train_wait_time", "eval_time"}


def plan(rs: np.random.RandomState, every: int = 20) -> list[tuple[str, tuple | None]]:
    """Five kills after the checkpoints named, one exception, and the run to the end."""
    a = every * rs.randint(1, 6)  # SFT 20..100
    b = a + every * rs.randint(1, 5)
    c = b + every * rs.randint(4, 7)  # past the exception launch's first save
    return [
        ("sigkill", ("sft", a)),
        ("sigkill", ("sft", b)),
        ("exception", None),
        ("sigkill", ("sft", c)),
        ("sigkill", ("rl", every)),
        ("sigkill", ("rl", 2 * every)),
        ("finish", None),
    ]


def complete_steps(workdir: str) -> dict[str, list[int]]:
    """Steps whose checkpoint is finished (checksums written) per phase."""
    out = {}
    for phase in ("sft", "rl"):
        d = os.path.join(workdir, "checkpoints", phase)
        steps = []
        if os.path.isdir(d):
            for name in os.listdir(d):
                if name.isdigit() and os.path.exists(os.path.join(d, name, "checksums.json")):
                    steps.append(int(name))
        out[phase] = sorted(steps)
    return out


def child(argv: list[str]) -> None:
    """The trainer with an exception right after its first checkpoint save in this
    process (``save`` returned True: the write goes on in the background)."""
    from gspo_jax import checkpoint

    save = checkpoint.PhaseCheckpointer.save

    def save_then_fail(self, step, state, meta, *, force=False):
        saved = save(self, step, state, meta, force=force)
        if saved:
            raise RuntimeError(f"injected right after the save of {self.phase} step {step}")
        return saved

    checkpoint.PhaseCheckpointer.save = save_then_fail
    from absl import app

    from gspo_jax import train

    train._define_flags()
    app.run(train.main, argv=[sys.argv[0], *argv], flags_parser=train._parse_flags)


def compare(reference: str, workdir: str) -> dict:
    a, b = read_metrics(reference), read_metrics(workdir)
    keys_a = [(r["phase"], r["step"]) for r in a]
    keys_b = [(r["phase"], r["step"]) for r in b]
    result = dict(
        records=len(b),
        reference_records=len(a),
        each_step_once=len(set(keys_b)) == len(keys_b),
        same_steps=keys_a == keys_b,
        values_compared=0,
        differences=[],
    )
    ref = {(r["phase"], r["step"]): r for r in a}
    for r in b:
        other = ref.get((r["phase"], r["step"]))
        if other is None:
            continue
        for k in sorted((set(r) | set(other)) - TIMING):
            result["values_compared"] += 1
            if k not in r or k not in other:
                result["differences"].append([r["phase"], r["step"], k, "missing"])
            elif not np.array_equal(np.asarray(r[k]), np.asarray(other[k])):
                result["differences"].append([r["phase"], r["step"], k, r[k], other[k]])
    result["equal"] = (
        result["same_steps"] and result["each_step_once"] and not result["differences"]
    )
    return result


def main() -> None:
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--reference", required=True, help="an uninterrupted run's workdir")
    ap.add_argument("--config", default="configs/default.py")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=20.0)
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*", help="after --: --config.<key>=<value> ...")
    args = ap.parse_args()
    common = [f"--config={args.config}", f"--workdir={args.workdir}", "--config.progress_bar=False"]
    common += args.overrides
    rs = np.random.RandomState(args.seed)
    launches = []
    for i, (kind, target) in enumerate(plan(rs), start=1):
        before = complete_steps(args.workdir)
        if kind == "exception":
            cmd = [sys.executable, "-m", "experiments.reliability.fault_injection", "child"]
        else:
            cmd = [sys.executable, "-m", "gspo_jax.train"]
        log = open(
            os.path.join(os.path.dirname(os.path.abspath(args.workdir)), f"launch{i}.log"), "w"
        )
        t0 = time.time()
        proc = subprocess.Popen(cmd + common, stdout=log, stderr=subprocess.STDOUT)
        killed_at = None
        if kind == "sigkill":
            phase, step = target
            while proc.poll() is None and step not in complete_steps(args.workdir)[phase]:
                time.sleep(0.2)
            delay = float(rs.uniform(0.0, args.max_delay))
            time.sleep(delay)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                killed_at = round(delay, 2)
        rc = proc.wait()
        log.close()
        after = complete_steps(args.workdir)
        tail = open(log.name).read().strip().splitlines()[-3:]
        launches.append(
            dict(
                launch=i,
                kind=kind,
                after_checkpoint=target,
                rc=rc,
                seconds=round(time.time() - t0, 1),
                killed_after_new_checkpoint_s=killed_at,
                checkpoints_before={p: v[-1:] for p, v in before.items()},
                checkpoints_after={p: v[-1:] for p, v in after.items()},
                last_lines=tail,
            )
        )
        print(json.dumps(launches[-1]), flush=True)
    result = dict(launches=launches, comparison=compare(args.reference, args.workdir))
    print(json.dumps(result["comparison"])[:2000], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
