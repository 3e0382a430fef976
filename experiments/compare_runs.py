"""Compare two runs' logs value by value: are they the same run?

    python -m experiments.compare_runs runs/before runs/after [--ignore KEY ...]

Reads ``metrics.jsonl`` and ``updates.jsonl`` of both workdirs and compares every key
that both records of one (phase, step[, k]) hold, exactly (a float differs if a bit of
its JSON digits differs). Wall-clock figures (`TIMING`) are left out. Prints the counts
and each key that differs (with its first differing record); exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

# Figures of the machine's speed, not of the run.
TIMING = frozenset(
    {
        "step_time",
        "tokens_per_s",
        "sample_time",
        "rollout_time",
        "old_logp_time",
        "update_time",
    }
)


def _records(path: str) -> dict[tuple, dict]:
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out[(r.get("phase"), r.get("step"), r.get("k"))] = r
    return out


def compare(a: str, b: str, ignore: frozenset[str] = frozenset()) -> dict:
    """``{"equal": n, "differ": {key: (record id, value a, value b)}, "only_a": [...],
    "only_b": [...]}`` over ``metrics.jsonl`` and ``updates.jsonl`` of workdirs ``a``, ``b``."""
    equal, differ = 0, {}
    only = defaultdict(set)
    for name in ("metrics.jsonl", "updates.jsonl"):
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        if not (os.path.exists(pa) and os.path.exists(pb)):
            continue
        ra, rb = _records(pa), _records(pb)
        for rid in sorted(set(ra) & set(rb), key=str):
            x, y = ra[rid], rb[rid]
            for k in set(x) & set(y):
                if k in TIMING or k in ignore:
                    continue
                if x[k] == y[k]:
                    equal += 1
                else:
                    differ.setdefault(f"{name}:{k}", (rid, x[k], y[k]))
            only["a"].update(f"{name}:{k}" for k in set(x) - set(y))
            only["b"].update(f"{name}:{k}" for k in set(y) - set(x))
    return {
        "equal": equal,
        "differ": differ,
        "only_a": sorted(only["a"]),
        "only_b": sorted(only["b"]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--ignore", nargs="*", default=[], help="keys not compared")
    args = p.parse_args(argv)
    out = compare(args.a, args.b, frozenset(args.ignore))
    print(f"{out['equal']} values equal, {len(out['differ'])} keys differ")
    for key, (rid, x, y) in sorted(out["differ"].items()):
        print(f"  {key} first at {rid}: {x!r} vs {y!r}")
    for side in ("only_a", "only_b"):
        if out[side]:
            print(f"keys {side.replace('_', ' in ')}: {', '.join(out[side])}")
    return 1 if out["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
