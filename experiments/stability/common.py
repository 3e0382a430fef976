"""What every stage of the stability study shares (experiments/stability/README.md).

* **Arms** name a policy architecture: ``moe<L>`` is the study's MoE (L layers, every
  layer MoE, E experts top-K, expert width ``moe_d_ff``); ``dense<L>`` is its dense
  twin: the same attention, embeddings and depth, and one SwiGLU MLP as wide as the K
  active experts together (``d_ff = K * moe_d_ff``), so that both spend the same
  FFN compute per token. ``moe<L>k1`` routes top-1 to experts twice as wide (the same
  active parameters as top-2), and ``moe<L>k<K>`` top-K to experts of width 256 / K.
  ``moe<L>e<E>`` has E experts in place of 8 (the GPU replication's ``moe12e64``,
  stage 8's ``moe12e64k8``; its dense twin is ``dense<L>``, the active width being the
  same).
* **Warm starts**: one supervised warm start per (arm, seed), shared by every probe and
  RL run of that arm and seed, in ``<root>/warm/<arm>_s<seed>``.
* **RL runs** start from a copy of their warm start (`copy_warm_start`) and resume from
  their own checkpoints when a chunk stops them.
* **A stage's grid** (`run_grid`): each `GridRun` trained once, its compact summary
  (`summarize_run`) written to ``<out>/.../<name>.jsonl``; a run with a summary is
  skipped, so a stage resumes chunk by chunk.

The statistics that give the stages their answers (the collapse detector, the
bootstrap, the critical lr, Fisher's test) are in `stats`.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from experiments.stability.stats import collapse_step
from gspo_jax.sweep import finished, load_config, rl_records

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "experiments", "stability", "results")

# The study's MoE: configs/stability.py's model (d_model 128, 4 heads, 8 experts top-2,
# expert width 128). Router losses are off in RL for every arm.
NUM_EXPERTS = 8
TOP_K = 2
MOE_D_FF = 128

_ARM = re.compile(r"^(moe|dense)(\d+)(?:e(\d+))?(?:k(\d+))?$")


def arm_fields(arm: str, *, smoke: bool = False) -> dict:
    """ModelConfig fields of an arm name (see the module docstring).

    ``moe<L>[e<E>][k<K>]``: top-K routing (default 2) over E experts (default 8) whose
    width makes the active FFN width K x width the study's (2 x 128 = 256): ``k1`` has
    experts of width 256, ``moe12e64k8`` 64 experts of width 32 top-8 (stage 8). Its
    dense twin is ``dense<L>``, one MLP of that active width.

    >>> arm_fields("dense4")["d_ff"], arm_fields("dense4")["num_experts"]
    (256, 0)
    >>> f = arm_fields("moe12e64k8"); f["num_experts"], f["top_k"], f["moe_d_ff"], f["d_ff"]
    (64, 8, 32, 256)
    """
    m = _ARM.match(arm)
    if not m or (m.group(1) == "dense" and (m.group(3) or m.group(4))):
        raise ValueError(
            f"arm {arm!r}: expected moe<layers>, moe<layers>k<top-K>, moe<layers>e<experts>"
            "[k<top-K>] or dense<layers> (e.g. moe2, moe8, moe2k1, moe12e64, moe12e64k8, dense4)"
        )
    kind, layers = m.group(1), int(m.group(2))
    if layers < 1:
        raise ValueError(f"arm {arm!r}: needs at least one layer")
    e, k, f = (4, 2, 32) if smoke else (NUM_EXPERTS, TOP_K, MOE_D_FF)
    active = k * f  # the active FFN width every arm keeps
    if kind == "dense":
        return dict(num_layers=layers, num_experts=0, d_ff=active)
    top = int(m.group(4)) if m.group(4) else k
    if m.group(3):
        e = int(m.group(3))
    if top < 1 or e < top:
        raise ValueError(f"arm {arm!r}: {e} experts, fewer than the top-{top} it routes to")
    if active % top:
        raise ValueError(
            f"arm {arm!r}: top-{top} does not divide the active FFN width {active} into "
            "equal experts"
        )
    return dict(num_layers=layers, num_experts=e, top_k=top, moe_d_ff=active // top, d_ff=active)


def is_moe(arm: str) -> bool:
    return arm.startswith("moe")


# The task of a setting. "small" is configs/stability.py's Countdown (3 numbers in 1..9,
# responses up to 24 characters), every stage's task; "hard" is stage 3's last fallback
# (README, Stage 3, "Setting"): Countdown ``hard`` (4 numbers in 1..99, target
# 100..999) with responses up to 48 characters and its own warm starts.
TASKS = {
    "small": {},
    "hard": {"task.difficulty": "hard", "rollout.max_new_tokens": 48},
}


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"task {task!r}: expected one of {', '.join(TASKS)}")
    return task


def base_config(
    arm: str, seed: int, *, smoke: bool = False, data_dir: str = "", task: str = "small"
):
    """configs/stability.py's setting for ``arm`` and ``seed``: the Countdown task (or
    the ``task`` of `TASKS`), the supervised warm start, router losses off in RL, no
    progress bar."""
    from configs import stability as stability_config

    c = stability_config.get_config("smoke" if smoke else None)
    for key, value in arm_fields(arm, smoke=smoke).items():
        c.model.fields[key] = value
    apply_overrides(c, TASKS[check_task(task)])
    c.seed = int(seed)
    c.updates.aux_loss_coef = 0.0
    c.updates.z_loss_coef = 0.0
    c.progress_bar = False
    if data_dir:
        c.task.data_dir = data_dir
    return c


# --------------------------------------------------------------------------
# Runs on disk.


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    """All of ``records`` to ``path`` at once (written aside, then renamed): a chunk
    stopped mid-write leaves either the old file or the new one, never half."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_records(folder: str) -> list[dict]:
    """Every record of every ``*.jsonl`` file in ``folder``, files in name order (a
    stage's per-run summaries or per-probe records)."""
    return [r for p in sorted(glob.glob(os.path.join(folder, "*.jsonl"))) for r in read_jsonl(p)]


def warm_start_dir(root: str, arm: str, seed: int, task: str = "small") -> str:
    """``<root>/warm/<arm>_s<seed>``; another task's under ``<root>/warm/<task>/``."""
    sub = () if check_task(task) == "small" else (task,)
    return os.path.join(root, "warm", *sub, f"{arm}_s{seed}")


def ensure_warm_start(
    root: str, arm: str, seed: int, *, smoke: bool = False, task: str = "small"
) -> str:
    """`warm_start_dir`: the supervised warm start of that arm, seed and task (trained
    here unless already finished), with its held-out evaluation at RL step 0.

    A warm start found there of another config (the study's SFT settings changed since
    it was built) is refused, naming the fields: the runs restore its checkpoints by
    shape, so reusing it would start them from what the current settings do not build."""
    from gspo_jax import safety, train
    from gspo_jax.config import ConfigError

    workdir = warm_start_dir(root, arm, seed, task)
    c = base_config(arm, seed, smoke=smoke, data_dir=os.path.join(root, "data"), task=task)
    c.total_rl_steps = 0
    found = safety.saved_config_differences(c, workdir)
    if found is not None and found[0]:
        raise ConfigError(
            f"{workdir}: a warm start of another config (saved -> now: "
            f"{'; '.join(found[0])}; from {found[1]}); move it away to build this "
            "config's, or use another --root"
        )
    if not finished(workdir, 0):
        train.run(c, workdir)
    return workdir


def copy_warm_start(src: str, dst: str) -> None:
    """The warm start's SFT checkpoints and log, so that ``dst`` resumes after them."""
    os.makedirs(dst, exist_ok=True)
    ckpt = os.path.join("checkpoints", "sft")
    if not os.path.exists(os.path.join(dst, ckpt)):
        shutil.copytree(os.path.join(src, ckpt), os.path.join(dst, ckpt))
    log = os.path.join(src, "metrics.jsonl")
    if not os.path.exists(os.path.join(dst, "metrics.jsonl")):
        shutil.copy(log, os.path.join(dst, "metrics.jsonl"))


class Budget:
    """A chunk's wall-clock budget: ``expired()`` once ``minutes`` have passed (None:
    never). Work already started finishes; nothing new starts after it expires."""

    def __init__(self, minutes: float | None):
        self.deadline = None if minutes is None else time.monotonic() + 60.0 * minutes

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


# --------------------------------------------------------------------------
# The command line every stage script shares.


def stage_parser(doc: str, out: str, config_file: str, only: Sequence[str]):
    """``--root``, ``--out``, ``--config``, ``--max-minutes``, ``--report`` and one
    comma-separated ``--only-<field>`` per name in ``only``; a stage adds its own flags
    to the parser it gets back."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--root", default="runs/stability", help="warm starts, data and runs (large)")
    ap.add_argument("--out", default=out, help="compact results (committed)")
    ap.add_argument(
        "--config",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), config_file),
        help="the stage's config file, PATH or PATH:ARG (e.g. ...:smoke)",
    )
    for field in only:
        ap.add_argument(
            f"--only-{field}", default="", help=f"a comma-separated subset of config.{field}"
        )
    ap.add_argument("--max-minutes", type=float, default=None, help="the chunk's budget")
    ap.add_argument("--report", action="store_true", help="figures and tables from --out")
    return ap


def planned_seeds(sc) -> tuple:
    """The seeds a verdict needs: the config's own, whatever ``--only-seeds`` a chunk
    or a report was given (`stage_config` keeps them as ``planned_seeds``)."""
    return tuple(sc.get("planned_seeds", sc.seeds))


def stage_config(args, only: Sequence[str], known: dict[str, Callable] | None = None):
    """The stage config of ``--config`` with each ``--only-<field>`` applied, and the
    config's own seeds kept as ``planned_seeds``. A value the config does not list
    (``known[field](config)``; by default ``config.<field>``) is an error that names the
    flag and the values it accepts."""
    sc = load_config(args.config)
    sc.planned_seeds = planned_seeds(sc)
    for field in only:
        given = getattr(args, "only_" + field)
        if not given:
            continue
        allowed = tuple((known or {}).get(field, lambda c: c[field])(sc))
        cast = type(allowed[0]) if allowed else str
        try:
            values = tuple(cast(v) for v in given.split(",") if v)
        except ValueError:
            raise SystemExit(f"--only-{field} {given!r}: expected {cast.__name__} values") from None
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise SystemExit(
                f"--only-{field} {given!r}: not in the config ({unknown or 'empty'}); "
                f"known: {', '.join(map(str, allowed))}"
            )
        sc[field] = values
    return sc


# --------------------------------------------------------------------------
# RL runs from a warm start, and their compact summaries.


def apply_overrides(c, overrides: dict) -> None:
    """``overrides`` on config ``c``: ``"objective"`` -> (name, hparams) through
    `config.set_objective`; every other key a dotted config path (``"optimizer.lr"``).
    An unknown path raises KeyError naming it."""
    from gspo_jax import config as config_lib

    for key, value in overrides.items():
        if key == "objective":
            name, hparams = value
            config_lib.set_objective(c, name, dict(hparams))
            continue
        *groups, leaf = key.split(".")
        node = c
        for g in groups:
            node = node[g]
        if leaf not in node:
            raise KeyError(f"override {key!r}: the config has no such field")
        node[leaf] = value


# RL runs pad prompts to 48 tokens, not configs/stability.py's 64 (which the warm starts
# and stage 1's probes use): the longest prompt of the task ("Make 30 from 9 8 7 with
# + - * /, each once." with BOS and newline) is 45 tokens, and a longer one is refused
# by name. Padding is masked and RoPE is relative, so this changes rounding only (one
# stage-2 run, moe2 GRPO lr 1e-3: rewards equal and losses within 1e-6 over 3 steps),
# and the step is compute-bound: 6.1 s at 64 against 4.5 s at 46 on this 2-core CPU.
# The `hard` task's prompts ("Make 999 from 99 99 99 99 with + - * /, each once.") reach
# 53 tokens: they keep configs/stability.py's 64. Per task of `TASKS`.
RL_PROMPT_LEN = {"small": 48, "hard": 64}


def rl_config(arm: str, seed: int, root: str, *, smoke: bool = False, task: str = "small"):
    """`base_config` as every RL run of stages 2-4 uses it: data under ``root``,
    prompts padded to the task's `RL_PROMPT_LEN`."""
    c = base_config(arm, seed, smoke=smoke, data_dir=os.path.join(root, "data"), task=task)
    c.rollout.max_prompt_len = RL_PROMPT_LEN[task]
    return c


def run_rl(
    root: str,
    stage: str,
    name: str,
    arm: str,
    seed: int,
    overrides: dict,
    steps: int,
    *,
    smoke: bool = False,
    task: str = "small",
) -> str:
    """``<root>/<stage>/<name>``: ``steps`` RL steps of ``arm`` on ``task`` from its
    warm start for ``seed`` under ``overrides``; resumed from its own checkpoints when
    a previous chunk stopped it, skipped when finished. Returns the workdir."""
    from gspo_jax import train

    workdir = os.path.join(root, stage, name)
    if finished(workdir, steps):
        return workdir
    warm = ensure_warm_start(root, arm, seed, smoke=smoke, task=task)
    copy_warm_start(warm, workdir)
    c = rl_config(arm, seed, root, smoke=smoke, task=task)
    apply_overrides(c, overrides)
    c.total_rl_steps = int(steps)
    train.run(c, workdir)
    return workdir


# Per-step series kept in a run's summary: what the figures and the precursors need.
SERIES = (
    "reward_mean",
    "reward_correct",
    "eval_reward_mean",
    "eval_greedy_reward",
    "entropy",
    "grad_norm",
    "clip_frac",
    "clip_frac_klast",
    "ppo_kl_klast",
    "flip_frac_k1",
    "flip_frac_klast",
    "frac_ratio_gt_2_klast",
    "gamma_raw_mean_klast",
    "router_shift_raw_klast",
    "token_flip_rate_klast",
    "mismatch_kl",
    "mismatch_f2",
    "mismatch_route",
    "behaviour_kl",
    "behaviour_f2",
    "rc_truncated_frac",
    "rc_weight_mean",
    "staleness_mean",
    "no_signal_minibatches",
    "step_time",
)


def summarize_run(workdir: str, meta: dict, *, collapse_kw: dict | None = None) -> dict:
    """The compact record of one RL run: ``meta``, the per-step ``SERIES`` (None where
    a step did not log one), the collapse step of its training reward (the index of
    the RL step, 1-based, or None) and its final held-out reward (the mean of its last
    two evaluations)."""
    recs = sorted((r for r in rl_records(workdir) if r["step"] >= 1), key=lambda r: r["step"])
    steps = [r["step"] for r in recs]
    series = {k: [r.get(k) for r in recs] for k in SERIES}
    series = {k: v for k, v in series.items() if any(x is not None for x in v)}
    rewards = [r.get("reward_mean") for r in recs]
    cs = collapse_step(rewards, **(collapse_kw or {})) if rewards else None
    evals = [r["eval_reward_mean"] for r in recs if "eval_reward_mean" in r]
    first = [r for r in rl_records(workdir) if r["step"] == 0 and "eval_reward_mean" in r]
    return dict(
        meta,
        steps=steps,
        series=series,
        collapsed=cs is not None,
        collapse_step=None if cs is None else steps[cs],
        eval_start=first[0]["eval_reward_mean"] if first else None,
        eval_final=float(np.mean(evals[-2:])) if evals else None,
    )


# --------------------------------------------------------------------------
# A stage's grid of RL runs.


@dataclasses.dataclass(frozen=True)
class GridRun:
    """One RL run of a stage's grid: ``steps`` RL steps of the model ``arm`` from its
    warm start for ``seed`` under ``overrides`` (`run_rl`), summarized with ``meta``
    (`summarize_run`) into ``<folder>/<name>.jsonl``."""

    name: str
    arm: str
    seed: int
    overrides: dict
    steps: int
    meta: dict
    task: str = "small"


def resummarize(runs: Iterable[GridRun], root: str, stage: str, folder: str, log=print) -> int:
    """Rewrites the summary in ``folder`` of every run of ``runs`` that has one, from
    its logs in ``<root>/<stage>/<name>``, so that a series added to `SERIES` after a
    run finished reaches its summary. Everything the old summary holds must come out
    the same (SystemExit naming the first difference otherwise): this adds series, it
    never changes a result. Runs without a summary or without their logs are left.
    Returns the number rewritten."""
    n = 0
    for run in runs:
        path = os.path.join(folder, run.name + ".jsonl")
        workdir = os.path.join(root, stage, run.name)
        if not os.path.exists(path) or not finished(workdir, run.steps):
            continue
        old = read_jsonl(path)[0]
        new = summarize_run(workdir, run.meta)
        for key, value in old.items():
            if key == "series":
                for name, v in value.items():
                    if new["series"].get(name) != v:
                        raise SystemExit(f"{path}: series {name!r} differs from {workdir}'s logs")
            elif new.get(key) != value:
                raise SystemExit(f"{path}: {key!r} differs from {workdir}'s logs")
        added = sorted(set(new["series"]) - set(old["series"]))
        if added:
            write_jsonl(path, [new])
            log(f"{run.name}: added {', '.join(added)}")
            n += 1
    return n


def same_setting(path: str, old: dict, run: GridRun) -> None:
    """Stops the grid (SystemExit naming the fields) when the summary ``old`` on disk
    at ``path`` is not of ``run``'s setting: the grid changed after it ran, and a report
    would mix settings. A summary's ``steps`` is the list of its RL steps
    (`summarize_run` writes it over the meta's step count), so the run's step count
    is compared with the last of them."""
    diff = {k: (old.get(k), v) for k, v in run.meta.items() if k != "steps" and old.get(k) != v}
    logged = old.get("steps") or [None]
    if logged[-1] != run.steps:
        diff["steps"] = (logged[-1], run.steps)
    if diff:
        raise SystemExit(
            f"{path}: summarised under another setting ({diff}, as (on disk, now)); "
            "move it aside to rerun"
        )


def collapse_line(summary: dict) -> str:
    """A finished run in one line: its collapse and held-out reward."""
    return (
        f"collapsed={summary['collapsed']} at {summary['collapse_step']}, "
        f"held-out {summary['eval_start']} -> {summary['eval_final']}"
    )


def run_grid(
    runs: Iterable[GridRun],
    root: str,
    stage: str,
    folder: str,
    budget: Budget,
    *,
    smoke: bool = False,
    check: Callable[[str, dict, GridRun], None] | None = None,
    reuse: Callable[[GridRun], str | None] | None = None,
    describe: Callable[[dict], str] = collapse_line,
    log=print,
) -> int:
    """Every run of ``runs`` (in their order) without a summary in ``folder``, each in
    ``<root>/<stage>/<name>``, until the budget expires; work started finishes. A run
    with a summary is skipped after ``check(path, summary, run)`` (which raises when
    that summary is of another setting); one for which ``reuse(run)`` names another
    summary file takes a copy of it. Returns the number of runs done."""
    done = 0
    for run in runs:
        path = os.path.join(folder, run.name + ".jsonl")
        if os.path.exists(path):
            if check is not None:
                check(path, read_jsonl(path)[0], run)
            continue
        same = reuse(run) if reuse is not None else None
        if same is not None:
            write_jsonl(path, read_jsonl(same))
            log(f"{run.name}: the same run's summary, reused ({same})")
            continue
        if budget.expired():
            return done
        workdir = run_rl(
            root,
            stage,
            run.name,
            run.arm,
            run.seed,
            run.overrides,
            run.steps,
            smoke=smoke,
            task=run.task,
        )
        summary = summarize_run(workdir, run.meta)
        write_jsonl(path, [summary])
        log(f"{run.name}: {describe(summary)}")
        done += 1
    return done
