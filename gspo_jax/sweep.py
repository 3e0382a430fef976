"""Ablations in one command: a grid of config overrides, one trainer per point.

    python -m gspo_jax.sweep --config=configs/default.py:smoke --workdir=runs/sweep \\
        --grid objective.hparams.eps_high=0.2,0.28 --grid seed=0,1 \\
        --metric eval_reward_mean --metric clip_frac --config.total_rl_steps=20

Every ``--grid <path>=<v1>,<v2>,...`` is an axis over a ``config.<path>`` field; the
points are their cartesian product. Any other ``--config.<path>=<value>`` applies to
every point. Each point runs in ``<workdir>/<point name>`` (e.g.
``eps_high=0.2__seed=0``) as its own ``python -m gspo_jax.train`` subprocess, one at
a time: a crash in one point leaves the others running, and an interrupted point
resumes from its own checkpoints when the sweep runs again. A finished point (its
metrics.jsonl holds the final RL step with ``eval_reward_mean``) is skipped, so
re-running the command finishes the sweep. ``--index i --count n`` runs points
``j`` with ``j % n == i`` (one share per machine on a shared filesystem).

At the end (or alone, with ``--report-only``) the sweep writes
``<workdir>/sweep.md``: a row per group (a point without its seed axis) and, for
each ``--metric``, the mean over the group's finished seeds of the metric's value
in each point's final RL record, with the min-max over seeds; and
``<workdir>/sweep.png``: each metric against the RL step, per group, the mean over
seeds with a min-max band (needs matplotlib).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import runpy
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

from gspo_jax.metrics_log import read_metrics

DEFAULT_METRICS = ("eval_reward_mean",)
LOG_FILE = "sweep_train.log"


# --------------------------------------------------------------------------
# The grid.


def _key(path: str) -> str:
    """``config.<path>`` written any of the ways the command line allows, as ``<path>``."""
    path = path.strip()
    for prefix in ("--config.", "config."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
    if not path or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", path):
        raise ValueError(f"not a config field path: {path!r}")
    return path


def parse_axis(spec: str) -> tuple[str, list[str]]:
    """``"objective.hparams.eps_high=0.2,0.28"`` -> (path, ["0.2", "0.28"])."""
    path, sep, values = spec.partition("=")
    if not sep:
        raise ValueError(f"--grid {spec!r}: expected <config path>=<v1>,<v2>,...")
    vals = [v.strip() for v in values.split(",")]
    if not all(vals):
        raise ValueError(f"--grid {spec!r}: empty value")
    if len(set(vals)) != len(vals):
        raise ValueError(f"--grid {spec!r}: repeated value")
    return _key(path), vals


def expand_grid(axes: Sequence[tuple[str, Sequence[Any]]] | dict) -> list[dict[str, str]]:
    """The cartesian product of the axes, as one ``{path: value}`` per point, in the
    order the axes are given (the last varies fastest). Axes: ``(path, values)`` pairs,
    a dict of them, or ``"path=v1,v2"`` strings. No axes: one point, ``{}``."""
    if isinstance(axes, dict):
        axes = list(axes.items())
    axes = [parse_axis(a) if isinstance(a, str) else (_key(a[0]), list(a[1])) for a in axes]
    paths = [p for p, _ in axes]
    if len(set(paths)) != len(paths):
        raise ValueError(f"a config path is a grid axis twice: {paths}")
    return [
        {p: str(v) for p, v in zip(paths, values)}
        for values in itertools.product(*(vals for _, vals in axes))
    ]


def _short_keys(paths: Sequence[str]) -> dict[str, str]:
    """Each path's shortest dotted suffix that no other path ends with."""
    out = {}
    for p in paths:
        parts = p.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if not any(q != p and (q == short or q.endswith("." + short)) for q in paths):
                break
        out[p] = short
    return out


def point_name(point: dict[str, Any], paths: Sequence[str] | None = None) -> str:
    """A readable directory name for a point: ``eps_high=0.2__seed=0`` (each path by
    its shortest unambiguous suffix among ``paths``, default the point's own; values
    made safe for a file name). ``base`` for the point of an empty grid."""
    if not point:
        return "base"
    short = _short_keys(list(paths or point))
    items = []
    for p, v in point.items():
        value = re.sub(r"[^\w.+-]+", "_", str(v)).strip("_") or "_"
        items.append(f"{short[p]}={value}")
    return "__".join(items)


# --------------------------------------------------------------------------
# Points and their results.


def finished(workdir: str, steps: int) -> bool:
    """Whether the run in ``workdir`` logged RL step ``steps`` (or later) with its
    held-out evaluation: the trainer's last record of a finished run."""
    return any(r["step"] >= steps and "eval_reward_mean" in r for r in rl_records(workdir))


def rl_records(workdir: str) -> list[dict]:
    """The RL records of ``<workdir>/metrics.jsonl`` in file order; none when the file
    is missing or unreadable (a point not started, or one a crash left unreadable)."""
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        return []
    try:
        return [r for r in read_metrics(workdir) if r["phase"] == "rl"]
    except (OSError, ValueError):
        return []


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return None
    try:
        x = float(v)  # non-finite values are logged as strings
    except ValueError:
        return None
    return x


def final_values(workdir: str, metrics: Sequence[str]) -> dict[str, float]:
    """Each metric in the point's final RL record (the last RL record holding it)."""
    out = {}
    for r in reversed(rl_records(workdir)):
        for m in metrics:
            if m not in out and _number(r.get(m)) is not None:
                out[m] = _number(r[m])
    return out


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def summarize(
    workdir: str,
    points: Sequence[dict[str, str]],
    metrics: Sequence[str] = DEFAULT_METRICS,
    *,
    steps: int | dict[str, int] | None = None,
    seed_axis: str = "seed",
) -> str:
    """The sweep's table (markdown): a row per group of points (a point without its
    ``seed_axis``), its finished seeds of all, and per metric the mean over finished
    seeds of the final RL record's value, with the min-max over seeds. ``steps``: the
    RL steps that make a point finished (an int, or by point name); None: every point
    with RL records counts."""
    paths = list(points[0]) if points else []
    group_paths = [p for p in paths if p != seed_axis]
    groups: dict[str, list[dict[str, str]]] = {}
    for pt in points:
        g = point_name({p: pt[p] for p in group_paths}, paths) if group_paths else "all"
        groups.setdefault(g, []).append(pt)
    head = ["group", "seeds done"] + [f"{m}: mean (min-max)" for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g, pts in groups.items():
        done = []
        for pt in pts:
            name = point_name(pt, paths)
            d = os.path.join(workdir, name)
            n = steps.get(name) if isinstance(steps, dict) else steps
            if finished(d, n) if n is not None else bool(rl_records(d)):
                done.append(final_values(d, metrics))
        row = [g, f"{len(done)}/{len(pts)}"]
        for m in metrics:
            xs = [v[m] for v in done if m in v]
            if not xs:
                row.append("-")
            elif len(xs) == 1:
                row.append(_fmt(xs[0]))
            else:
                row.append(f"{_fmt(statistics.fmean(xs))} ({_fmt(min(xs))}-{_fmt(max(xs))})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(
    workdir: str,
    points: Sequence[dict[str, str]],
    metrics: Sequence[str],
    path: str,
    *,
    seed_axis: str = "seed",
) -> bool:
    """``path``: each metric against the RL step, a line per group (the mean over its
    seeds at the steps they all logged) with a min-max band. False without
    matplotlib or without data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    paths = list(points[0]) if points else []
    group_paths = [p for p in paths if p != seed_axis]
    groups: dict[str, list[str]] = {}
    for pt in points:
        g = point_name({p: pt[p] for p in group_paths}, paths) if group_paths else "all"
        groups.setdefault(g, []).append(os.path.join(workdir, point_name(pt, paths)))
    fig, axes = plt.subplots(
        len(metrics), 1, figsize=(7, 3 * len(metrics)), squeeze=False, sharex=True
    )
    drawn = False
    for ax, m in zip(axes[:, 0], metrics):
        for g, dirs in groups.items():
            curves = []
            for d in dirs:
                c = {r["step"]: _number(r.get(m)) for r in rl_records(d)}
                c = {s: x for s, x in c.items() if x is not None and math.isfinite(x)}
                if c:
                    curves.append(c)
            if not curves:
                continue
            xs = sorted(set.intersection(*(set(c) for c in curves)))
            if not xs:
                continue
            vals = [[c[s] for c in curves] for s in xs]
            mean = [statistics.fmean(v) for v in vals]
            (line,) = ax.plot(xs, mean, marker="." if len(xs) < 30 else None, label=g)
            if len(curves) > 1:
                ax.fill_between(
                    xs,
                    [min(v) for v in vals],
                    [max(v) for v in vals],
                    color=line.get_color(),
                    alpha=0.2,
                    linewidth=0,
                )
            drawn = True
        ax.set_ylabel(m)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("RL step")
    if drawn:
        axes[0, 0].legend(fontsize="small")
        axes[0, 0].set_title("mean over seeds, band: min-max")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def write_report(workdir, points, metrics, *, steps=None, seed_axis="seed") -> str:
    """``<workdir>/sweep.md`` (and ``sweep.png``); returns the table."""
    table = summarize(workdir, points, metrics, steps=steps, seed_axis=seed_axis)
    paths = list(points[0]) if points else []
    axes = ", ".join(
        f"{p} in {{{', '.join(dict.fromkeys(pt[p] for pt in points))}}}" for p in paths
    )
    text = (
        "# Sweep\n\n"
        f"Grid: {axes or '(none)'}; seed axis: {seed_axis}. Each metric: its value in "
        "each point's final RL record, the mean over the group's finished seeds "
        "(min-max over seeds).\n\n" + table
    )
    with open(os.path.join(workdir, "sweep.md"), "w", encoding="utf-8") as f:
        f.write(text)
    plot(workdir, points, metrics, os.path.join(workdir, "sweep.png"), seed_axis=seed_axis)
    return table


# --------------------------------------------------------------------------
# The command line.


def load_config(spec: str):
    """``get_config(arg)`` of the config file of ``spec``, ``PATH`` or ``PATH:ARG`` (as
    ``--config`` of gspo_jax.train; no ARG: ``get_config(None)``)."""
    path, _, arg = spec.partition(":")
    return runpy.run_path(path)["get_config"](arg or None)


def _check_paths(c, paths: Sequence[str]) -> None:
    import ml_collections

    from gspo_jax import config as config_lib

    for key in paths:
        node = c
        for part in key.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                raise SystemExit(config_lib.unknown_key_message(key, c))
            node = node[part]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gspo_jax.sweep",
        description="Run a grid of config overrides, one trainer per point; tabulate "
        "and plot the results. Any --config.<path>=<value> applies to every point.",
    )
    p.add_argument("--config", required=True, help="config file[:arg], as for gspo_jax.train")
    p.add_argument("--workdir", required=True, help="the sweep's folder; a subfolder per point")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="PATH=V1,V2,...",
        help="a grid axis over config.<PATH> (repeatable; the points are the product)",
    )
    p.add_argument(
        "--metric",
        action="append",
        default=None,
        metavar="NAME",
        help=f"a metric of metrics.jsonl to report (repeatable; default {DEFAULT_METRICS[0]})",
    )
    p.add_argument("--seed-axis", default="seed", help="the axis averaged over (default seed)")
    p.add_argument("--index", type=int, default=0, help="this machine's share: points j with")
    p.add_argument("--count", type=int, default=1, help="j %% count == index (default 0 of 1)")
    p.add_argument("--report-only", action="store_true", help="only write sweep.md/.png")
    p.add_argument(
        "--max-points",
        type=int,
        default=None,
        help="run at most this many points now (finished points skipped do not count)",
    )
    p.add_argument("--dry-run", action="store_true", help="list the points and stop")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    base: dict[str, str] = {}
    for a in rest:
        if not (a.startswith("--config.") and "=" in a):
            raise SystemExit(f"unknown argument {a!r}; overrides are --config.<path>=<value>")
        key, _, value = a.partition("=")
        base[_key(key)] = value
    if args.count < 1 or not 0 <= args.index < args.count:
        raise SystemExit(f"--index {args.index} --count {args.count}: need 0 <= index < count")
    try:
        points = expand_grid(args.grid)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    paths = list(points[0])
    metrics = args.metric or list(DEFAULT_METRICS)
    c = load_config(args.config)
    _check_paths(c, paths + list(base))
    for p in paths:
        base.pop(p, None)  # the grid's value wins

    def total_steps(pt):
        v = pt.get("total_rl_steps", base.get("total_rl_steps", c.total_rl_steps))
        return int(v)

    names = [point_name(pt, paths) for pt in points]
    steps = {n: total_steps(pt) for n, pt in zip(names, points)}
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "config": args.config,
                "grid": args.grid,
                "overrides": base,
                "seed_axis": args.seed_axis,
                "points": dict(zip(names, points)),
            },
            f,
            indent=2,
        )
    failed = []
    if args.dry_run:
        for j, (n, pt) in enumerate(zip(names, points)):
            mine = j % args.count == args.index
            print(f"[{j}] {n}{'' if mine else ' (another machine)'}")
        return 0
    if not args.report_only:
        ran = 0
        for j, (name, pt) in enumerate(zip(names, points)):
            if j % args.count != args.index:
                continue
            wd = os.path.join(args.workdir, name)
            if finished(wd, steps[name]):
                print(f"[{j + 1}/{len(points)}] {name}: finished, skipped", flush=True)
                continue
            if args.max_points is not None and ran >= args.max_points:
                print(f"stopping: --max-points {args.max_points} reached", flush=True)
                break
            ran += 1
            rc, dt = _run_point(args.config, wd, {**base, **pt})
            status = "done" if rc == 0 else f"FAILED (exit {rc}; see {wd}/{LOG_FILE})"
            print(f"[{j + 1}/{len(points)}] {name}: {status} in {dt:.0f} s", flush=True)
            if rc != 0:
                failed.append(name)
    table = write_report(args.workdir, points, metrics, steps=steps, seed_axis=args.seed_axis)
    print(table, end="")
    print(f"wrote {os.path.join(args.workdir, 'sweep.md')}", flush=True)
    if failed:
        print(f"{len(failed)} point(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _run_point(config: str, workdir: str, overrides: dict[str, str]) -> tuple[int, float]:
    """One point: ``python -m gspo_jax.train`` in its own process (output appended to
    ``<workdir>/sweep_train.log``). Ctrl-C lets the trainer checkpoint, then stops."""
    os.makedirs(workdir, exist_ok=True)
    cmd = [sys.executable, "-m", "gspo_jax.train", f"--config={config}", f"--workdir={workdir}"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    t0 = time.perf_counter()
    with open(os.path.join(workdir, LOG_FILE), "a", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:  # the trainer got the SIGINT too: it checkpoints
            proc.wait()
            raise SystemExit(130) from None
    return rc, time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
