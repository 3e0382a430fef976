"""Ablations in one command: a grid of config overrides, one trainer per point.

    python -m gspo_jax.sweep --config=configs/default.py:smoke --workdir=runs/sweep \\
        --grid objective.hparams.eps_high=0.2,0.28 --grid seed=0,1 \\
        --metric eval_reward_mean --metric clip_frac --config.total_rl_steps=20

Every ``--grid <path>=<v1>,<v2>,...`` is an axis over a ``config.<path>`` field; the
points are their cartesian product. Any other ``--config.<path>=<value>`` applies to
every point. Each point runs in ``<workdir>/<point name>`` (e.g.
``eps_high=0.2__seed=0``; values made safe for a file name, and values of an axis
that would read alike, ``ckpt/step_100`` and ``ckpt_step_100``, told apart by a hash:
`value_names`) as its own ``python -m gspo_jax.train`` subprocess, one at a time: a
crash in one point leaves the others running, and an interrupted point resumes from
its own checkpoints when the sweep runs again. A finished point (its
metrics.jsonl holds the final RL step with ``eval_reward_mean``, and its recorded
config is the one the sweep would run now) is skipped, so re-running the command
finishes the sweep. ``--index i --count n`` runs points ``j`` with ``j % n == i``
(one share per machine on a shared filesystem).

Before any point runs, every point's config is built as its trainer will build it and
validated (`gspo_jax.sweep_grid`): an invalid point stops the sweep, naming each.
An ``objective.name`` axis picks the objective through the config file's argument
(``objective=<name>``), with that objective's hyperparameters. A point's workdir
that holds a run of another config (a changed override) stops the sweep naming the
fields that differ; ``--move-aside`` renames such a workdir to ``<point>.other-<k>``
and runs the point afresh. SIGTERM or SIGINT to the sweep is forwarded to the
running trainer, which checkpoints and exits; the sweep waits for it and exits with
128 + the signal's number. A ``--metric`` that no point logged is named, with the
closest logged name.

At the end (or alone, with ``--report-only``) the sweep writes
``<workdir>/sweep.md``: a row per group (a point without its seed axis) and, for
each ``--metric``, the mean over the group's finished seeds of the metric's value
in each point's final RL record, with the min-max over seeds; and
``<workdir>/sweep.png``: each metric against the RL step, per group, the mean over
seeds with a min-max band (needs matplotlib).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import itertools
import json
import math
import os
import re
import runpy
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Collection, Sequence

from gspo_jax import sweep_grid
from gspo_jax.sweep_grid import finished, rl_records

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


def _safe(value: str) -> str:
    """``value`` made safe for a file name: each run of other characters than letters,
    digits and ``.+-`` as one ``_``, none at either end."""
    return re.sub(r"[^\w.+-]+", "_", value).strip("_") or "_"


def value_names(grid: Sequence[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Each axis's values (by path) by the name they have in a point's name: the value
    made safe for a file name (`_safe`). Distinct values of an axis that `_safe` makes
    alike (``ckpt/step_100``, ``ckpt_step_100``, ``ckpt:step_100``) would share one
    workdir: of those, a value that is a safe name itself keeps it, and each other one
    gets ``-`` and 8 hex digits of the SHA-256 of its text (``ckpt_step_100-1b0e…``). So
    a value that collides with no other keeps the name it always had, and a name
    depends on the axis's values only, not on their order.

    Raises:
      ValueError: if two values of an axis would still share a name (a value written
        as another one's hashed name).
    """
    axes: dict[str, list[str]] = {}
    for pt in grid:
        for p, v in pt.items():
            axes.setdefault(p, [])
            if str(v) not in axes[p]:
                axes[p].append(str(v))
    out: dict[str, dict[str, str]] = {}
    for p, values in axes.items():
        alike: dict[str, list[str]] = {}
        for v in values:
            alike.setdefault(_safe(v), []).append(v)
        names = {}
        for safe, vs in alike.items():
            for v in vs:
                hashed = len(vs) > 1 and v != safe
                digest = hashlib.sha256(v.encode("utf-8")).hexdigest()[:8]
                names[v] = f"{safe}-{digest}" if hashed else safe
        by_name: dict[str, list[str]] = {}
        for v, name in names.items():
            by_name.setdefault(name, []).append(v)
        for name, vs in by_name.items():
            if len(vs) > 1:
                raise ValueError(
                    f"--grid {p}: the values {vs} would share the point name {name!r}, and "
                    "so one workdir; write one of them another way"
                )
        out[p] = names
    return out


def point_name(
    point: dict[str, Any],
    paths: Sequence[str] | None = None,
    grid: Sequence[dict[str, Any]] | None = None,
) -> str:
    """A readable directory name for a point: ``eps_high=0.2__seed=0`` (each path by
    its shortest unambiguous suffix among ``paths``, default the point's own; each
    value by its name among the values of its axis in ``grid``, default the point
    alone: `value_names`). ``base`` for the point of an empty grid. Distinct points of
    one grid have distinct names."""
    if not point:
        return "base"
    short = _short_keys(list(paths or point))
    names = value_names(list(grid or ()) + [point])
    return "__".join(f"{short[p]}={names[p][str(v)]}" for p, v in point.items())


# --------------------------------------------------------------------------
# Points and their results.


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
    done: Collection[str] | None = None,
) -> str:
    """The sweep's table (markdown): a row per group of points (a point without its
    ``seed_axis``), its finished seeds of all, and per metric the mean over finished
    seeds of the final RL record's value, with the min-max over seeds. ``done``: the
    names of the finished points; else ``steps``: the RL steps that make a point
    finished (an int, or by point name); None: every point with RL records counts."""
    paths = list(points[0]) if points else []
    group_paths = [p for p in paths if p != seed_axis]
    groups: dict[str, list[dict[str, str]]] = {}
    for pt in points:
        g = point_name({p: pt[p] for p in group_paths}, paths, points) if group_paths else "all"
        groups.setdefault(g, []).append(pt)
    head = ["group", "seeds done"] + [f"{m}: mean (min-max)" for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g, pts in groups.items():
        values = []
        for pt in pts:
            name = point_name(pt, paths, points)
            d = os.path.join(workdir, name)
            n = steps.get(name) if isinstance(steps, dict) else steps
            if done is not None:
                ok = name in done
            else:
                ok = finished(d, n) if n is not None else bool(rl_records(d))
            if ok:
                values.append(final_values(d, metrics))
        row = [g, f"{len(values)}/{len(pts)}"]
        for m in metrics:
            xs = [v[m] for v in values if m in v]
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
    skip: Collection[str] = (),
) -> bool:
    """``path``: each metric against the RL step, a line per group (the mean over its
    seeds at the steps they all logged) with a min-max band; the points named in
    ``skip`` (runs of another config) left out. False without matplotlib or without
    data."""
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
        g = point_name({p: pt[p] for p in group_paths}, paths, points) if group_paths else "all"
        name = point_name(pt, paths, points)
        if name not in skip:
            groups.setdefault(g, []).append(os.path.join(workdir, name))
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


def unknown_metrics(workdir: str, names: Sequence[str], metrics: Sequence[str]) -> list[str]:
    """A line for each of ``metrics`` that no RL record of any point holds, with the
    closest logged name and all of them (none while no point has logged)."""
    logged = set()
    for name in names:
        for r in rl_records(os.path.join(workdir, name)):
            logged.update(k for k in r if k not in ("step", "phase"))
    out = []
    for m in metrics:
        if logged and m not in logged:
            near = difflib.get_close_matches(m, sorted(logged), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            out.append(
                f"--metric {m}: no point's metrics.jsonl has it{hint} (they have: "
                f"{', '.join(sorted(logged))})"
            )
    return out


def write_report(
    workdir, points, metrics, *, steps=None, seed_axis="seed", done=None, skip=()
) -> str:
    """``<workdir>/sweep.md`` (and ``sweep.png``); returns the table."""
    table = summarize(workdir, points, metrics, steps=steps, seed_axis=seed_axis, done=done)
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
    png = os.path.join(workdir, "sweep.png")
    plot(workdir, points, metrics, png, seed_axis=seed_axis, skip=skip)
    return table


# --------------------------------------------------------------------------
# The command line.


def load_config(spec: str):
    """``get_config(arg)`` of the config file of ``spec``, ``PATH`` or ``PATH:ARG`` (as
    ``--config`` of gspo_jax.train; no ARG: ``get_config(None)``)."""
    path, _, arg = spec.partition(":")
    return runpy.run_path(path)["get_config"](arg or None)


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
    p.add_argument(
        "--move-aside",
        action="store_true",
        help="rename a point's workdir that holds a run of another config to "
        "<point>.other-<k> and run the point afresh (default: refuse, naming the fields)",
    )
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
        paths = list(points[0])
        names = [point_name(pt, paths, points) for pt in points]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    metrics = args.metric or list(DEFAULT_METRICS)
    for p in paths:
        base.pop(p, None)  # the grid's value wins

    if not os.path.isfile(args.config.partition(":")[0]):
        raise SystemExit(f"--config {args.config}: no such file")
    # Every point's config, built (and validated, unless only reporting) before any runs.
    num_devices = None if args.report_only else sweep_grid.device_count()
    overrides = {n: {**base, **pt} for n, pt in zip(names, points)}
    configs = sweep_grid.check_points(args.config, overrides, num_devices)
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
    mine = [j for j in range(len(points)) if j % args.count == args.index]
    if args.dry_run:
        for j, n in enumerate(names):
            print(f"[{j}] {n}{'' if j in mine else ' (another machine)'}")
        return 0
    state = {n: sweep_grid.point_state(os.path.join(args.workdir, n), configs[n]) for n in names}
    other = [n for n in names if state[n][0] == "other"]
    if other and not args.report_only:
        _refuse_or_move(args, [n for j, n in enumerate(names) if j in mine], state)
    failed = []
    if not args.report_only:
        ran = 0
        for j in mine:
            name = names[j]
            wd = os.path.join(args.workdir, name)
            if state[name][0] == "finished":
                print(f"[{j + 1}/{len(points)}] {name}: finished, skipped", flush=True)
                continue
            if args.max_points is not None and ran >= args.max_points:
                print(f"stopping: --max-points {args.max_points} reached", flush=True)
                break
            ran += 1
            rc, dt = _run_point(args.config, wd, overrides[name])
            status = "done" if rc == 0 else f"FAILED (exit {rc}; see {wd}/{LOG_FILE})"
            print(f"[{j + 1}/{len(points)}] {name}: {status} in {dt:.0f} s", flush=True)
            if rc != 0:
                failed.append(name)
        state = {
            n: sweep_grid.point_state(os.path.join(args.workdir, n), configs[n]) for n in names
        }
    other = [n for n in names if state[n][0] == "other"]
    for n in other:  # another machine's share, or --report-only
        why = sweep_grid.other_config_message(os.path.join(args.workdir, n), n, state[n][1])
        print(f"{why}\n  (left out of the report)", file=sys.stderr)
    done = {n for n in names if state[n][0] == "finished"}
    table = write_report(
        args.workdir, points, metrics, seed_axis=args.seed_axis, done=done, skip=other
    )
    print(table, end="")
    print(f"wrote {os.path.join(args.workdir, 'sweep.md')}", flush=True)
    unknown = unknown_metrics(args.workdir, names, metrics)
    for line in unknown:
        print(line, file=sys.stderr)
    if failed:
        print(f"{len(failed)} point(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or unknown else 0


def _refuse_or_move(args, mine: Sequence[str], state: dict) -> None:
    """The points of this machine whose workdir holds a run of another config: moved
    aside with ``--move-aside``; else the sweep stops before running any point."""
    other = [n for n in mine if state[n][0] == "other"]
    messages = []
    for n in other:
        wd = os.path.join(args.workdir, n)
        if args.move_aside:
            print(f"{n}: moved {wd} aside to {sweep_grid.move_aside(wd)}", flush=True)
            state[n] = ("new", [])
        else:
            messages.append(sweep_grid.other_config_message(wd, n, state[n][1]))
    if messages:
        raise SystemExit(
            "\n".join(messages) + "\nTheir results would be reported under this sweep's "
            "config; nothing was run. Use another --workdir, or --move-aside to rename "
            "each such workdir to <point>.other-<k> and run the point afresh."
        )


def trainer_command(config: str, workdir: str, overrides: dict[str, str]) -> list[str]:
    """The trainer's command line for a point (`sweep_grid.trainer_config`)."""
    config, overrides = sweep_grid.trainer_config(config, overrides)
    cmd = [sys.executable, "-m", "gspo_jax.train", f"--config={config}", f"--workdir={workdir}"]
    return cmd + [f"--config.{k}={v}" for k, v in overrides.items()]


def _run_point(config: str, workdir: str, overrides: dict[str, str]) -> tuple[int, float]:
    """One point: ``python -m gspo_jax.train`` in its own process (output appended to
    ``<workdir>/sweep_train.log``), in a session of its own. SIGTERM or SIGINT to the
    sweep (``kill``, ``docker stop``, Kubernetes, Ctrl-C) is forwarded to it, once per
    signal: it checkpoints and exits, the sweep waits for it and exits with 128 +
    the signal's number."""
    os.makedirs(workdir, exist_ok=True)
    cmd = trainer_command(config, workdir, overrides)
    t0 = time.perf_counter()
    received: list[int] = []
    procs: list[subprocess.Popen] = []

    def forward(signum, frame):
        received.append(signum)
        for proc in procs:
            proc.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    rc = None
    try:
        with open(os.path.join(workdir, LOG_FILE), "a", encoding="utf-8") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            if not received:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
                rc = procs[0].wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if procs and procs[0].poll() is None:  # the wait itself failed: no orphan
            procs[0].terminate()
            procs[0].wait()
    if received:
        name = signal.Signals(received[0]).name
        print(
            f"{name}: forwarded to the trainer of {os.path.basename(workdir)}, which exited "
            f"with {rc} (see {workdir}/{LOG_FILE}). Run the same sweep command to resume: "
            "finished points are skipped, this one resumes from its last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + received[0])
    return rc, time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
