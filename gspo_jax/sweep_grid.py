"""A sweep's points before any of them runs (`gspo_jax.sweep`): each point's config,
built as its trainer will build it and validated; and what each point's workdir
already holds (nothing, a run to resume, a finished run of this config, or a run of
another config, which is refused or moved aside).

A finished point counts only when its recorded config (``config.json``, else the
newest RL checkpoint's record: `gspo_jax.safety.saved_config_differences`) is the one
the sweep would run now, up to the fields in `UNREPORTED`, which change no number the
sweep reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import ml_collections

from gspo_jax import safety
from gspo_jax.metrics_log import read_metrics

# Fields a finished point's record may differ in and still count as this config's run:
# none changes a number the sweep reports (all of them may also change on resume).
UNREPORTED = (
    "progress_bar",
    "compilation_cache_dir",
    "wandb.*",
    "keep_checkpoints",
    "checkpoint_every",
    "task.data_dir",
    "mesh.*",
    "model.moe_backend",
    "model.remat_policy",
    "model.logits_chunk_size",
    "model.attention_impl",
    "updates.max_consecutive_skips",
)


def trainer_config(config: str, overrides: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The ``--config`` and the ``--config.<path>`` overrides a point's trainer gets.

    An ``objective.name`` override goes into the config's argument
    (``configs/default.py:smoke`` -> ``configs/default.py:smoke,objective=grpo``): the
    config file sets the objective with all its hyperparameters
    (`gspo_jax.config.set_objective`), where ``--config.objective.name`` alone would
    leave the hyperparameters of the file's objective (refused by validation)."""
    overrides = dict(overrides)
    name = overrides.pop("objective.name", None)
    if name is None:
        return config, overrides
    path, _, arg = config.partition(":")
    items = [i.strip() for i in arg.split(",") if i.strip()]
    items = [i for i in items if i.split("=", 1)[0].strip() != "objective"]
    return f"{path}:{','.join(items + [f'objective={name}'])}", overrides


def build_config(config: str, overrides: dict[str, str]) -> ml_collections.ConfigDict:
    """The config ``python -m gspo_jax.train --config=<config> --config.<k>=<v> ...``
    runs: parsed by the same absl flag, deprecated paths moved as the trainer does."""
    from gspo_jax import config as config_lib
    from gspo_jax import old_keys

    spec, rest = trainer_config(config, overrides)
    try:
        c = _parse(spec, rest)
    except config_lib.ConfigError as e:
        if "objective.name" not in overrides or "argument 'objective'" not in str(e):
            raise
        raise config_lib.ConfigError(
            f"config.objective.name: a sweep over it passes objective=<name> to the config "
            f"file's argument, and {spec.partition(':')[0]} takes none ({e}); use a config "
            "file that picks the objective from its argument, like configs/default.py"
        ) from None
    old_keys.move_deprecated(c)
    return c


def _parse(config: str, overrides: dict[str, str]) -> ml_collections.ConfigDict:
    from absl import flags
    from ml_collections import config_flags

    argv = ["gspo_jax.train", f"--config={config}"]
    argv += [f"--config.{k}={v}" for k, v in overrides.items()]
    values = flags.FlagValues()
    try:
        config_flags.DEFINE_config_file(
            "config", None, "", flag_values=values, lock_config=True, sys_argv=argv
        )
        values(argv)
    except (AttributeError, KeyError, flags.Error) as e:
        from gspo_jax import config as config_lib
        from gspo_jax.train import unknown_override

        # The trainer's own message for an unknown key; else absl's, its first line.
        message = unknown_override(argv) or str(e).splitlines()[0]
        raise config_lib.ConfigError(message) from None
    return values.config


def device_count() -> int:
    """The number of devices a trainer started from here sees (asked of a process like
    the trainer's, so that this one claims no accelerator memory)."""
    cmd = [sys.executable, "-c", "import jax; print(jax.device_count())"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"cannot count the devices a trainer would see:\n{tail}")
    return int(out.stdout.strip().splitlines()[-1])


def check_points(
    config: str, points: dict[str, dict[str, str]], num_devices: int | None
) -> dict[str, ml_collections.ConfigDict]:
    """Each point's config (by point name), built and, given ``num_devices``,
    validated as its trainer will (`gspo_jax.config.validate`). Every invalid point is
    named with its problem before any runs (SystemExit)."""
    from gspo_jax import config as config_lib

    configs, errors = {}, []
    for name, overrides in points.items():
        try:
            c = build_config(config, overrides)
            if num_devices is not None:
                config_lib.validate(c, num_devices)
        except (config_lib.ConfigError, ValueError, TypeError) as e:
            errors.append(f"  {name}: {e}")
            continue
        configs[name] = c
    if errors:
        raise SystemExit(
            f"{len(errors)} of {len(points)} point(s) have an invalid config; nothing was "
            "run:\n" + "\n".join(errors)
        )
    return configs


# --------------------------------------------------------------------------
# What a point's workdir holds.


def rl_records(workdir: str) -> list[dict]:
    """The RL records of ``<workdir>/metrics.jsonl`` in file order; none when the file
    is missing or unreadable (a point not started, or one a crash left unreadable)."""
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        return []
    try:
        return [r for r in read_metrics(workdir) if r["phase"] == "rl"]
    except (OSError, ValueError):
        return []


def finished(workdir: str, steps: int) -> bool:
    """Whether the run in ``workdir`` logged RL step ``steps`` (or later) with its
    held-out evaluation: the trainer's last record of a finished run."""
    return any(r["step"] >= steps and "eval_reward_mean" in r for r in rl_records(workdir))


def point_state(workdir: str, c: ml_collections.ConfigDict) -> tuple[str, list[str]]:
    """What ``workdir`` holds for a point of config ``c``, with the fields (``saved ->
    this sweep's``) that make it another config's:

    * ``"new"``: no recorded config (nothing run; or only logs, which the trainer
      cuts back to its checkpoints);
    * ``"resume"``: an unfinished run its trainer resumes (fields a resume may change
      differ at most);
    * ``"finished"``: this config's run, finished;
    * ``"other"``: a run of another config: one its trainer would refuse to resume, or
      a finished one whose results a field the sweep reports on changes.
    """
    found = safety.saved_config_differences(c, workdir)
    if found is None:
        return "new", []
    diffs, path = found
    if diffs:
        return "other", diffs
    if not finished(workdir, int(c.total_rl_steps)):
        return "resume", []
    diffs, _ = safety.saved_config_differences(c, workdir, exempt=UNREPORTED)
    return ("other", diffs) if diffs else ("finished", [])


def other_config_message(workdir: str, name: str, diffs: Sequence[str]) -> str:
    return (
        f"{workdir} holds a run of another config than this sweep's point {name} "
        f"({len(diffs)} field(s), saved -> this sweep):\n    " + "\n    ".join(diffs)
    )


def move_aside(workdir: str) -> str:
    """Rename ``workdir`` to ``<workdir>.other-<k>`` (the first free k), unless a live
    trainer holds it (RuntimeError naming it); returns the new name."""
    lock = safety.WorkdirLock(workdir)
    lock.acquire()  # refuses a live trainer's workdir
    lock.release()
    k = 1
    while os.path.exists(f"{workdir}.other-{k}"):
        k += 1
    os.rename(workdir, f"{workdir}.other-{k}")
    return f"{workdir}.other-{k}"
