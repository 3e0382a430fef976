"""What keeps a run's work safe from its users and its cluster (docs/reliability.md).

* `check_resume_config` / `save_run_config`: a workdir's checkpoints belong to the
  config that made them; resuming with a config that changes what they mean is
  refused, naming every field and both values, and ``config.json`` keeps the
  original.
* `WorkdirLock`: one trainer per workdir; a lock whose owner is gone is taken over.
* `GracefulShutdown`: SIGTERM / SIGINT finish the current step, checkpoint and exit;
  a second signal exits at once.
* `check_health`: non-finite parameters, or too many skipped updates in a row, stop
  the run with an error that says so.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Mapping, Sequence

import ml_collections

from gspo_jax import config as config_lib
from gspo_jax import old_keys
from gspo_jax.checkpoint import step_dirs
from gspo_jax.config import ConfigError

CONFIG_FILE = "config.json"


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_record(c: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as ``config.json`` (and each checkpoint's record) stores it: plain
    JSON, so that a saved and a requested config compare alike."""
    return json.loads(json.dumps(c.to_dict(), default=str))


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], exempt: Sequence[str] | None = None
) -> list[str]:
    """``config.<field>: <saved> -> <current>`` for every field whose value differs (or
    exists on one side only, but for a field the saved config predates, requested at
    its default), but those declared ``resume=True``: the run's length, how
    it is logged, evaluated and checkpointed, where its data lives, how it is laid out
    on devices, and safety limits (`gspo_jax.config.resumable_fields`); and the
    removed keys (`gspo_jax.old_keys.REMOVED_KEYS`). ``exempt``: other field patterns
    than the resumable ones to leave out."""
    resumable = config_lib.resumable_fields() if exempt is None else exempt
    a, b = _flatten(saved), _flatten(current)
    defaults = _flatten(config_record(config_lib.base_config()))
    out = []
    for key in sorted(set(a) | set(b)):
        if key in old_keys.REMOVED_KEYS or any(
            fnmatch.fnmatchcase(key, pattern) for pattern in resumable
        ):
            continue
        if key not in a and key in defaults and b[key] == defaults[key]:
            continue  # a field added since, at its default: what the saved run ran
        va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")
        if va != vb:
            out.append(f"config.{key}: {va!r} -> {vb!r}")
    return out


def has_checkpoints(workdir: str) -> bool:
    """Whether a phase directory under ``<workdir>/checkpoints`` holds a step."""
    from gspo_jax.checkpoint import step_dirs

    return any(step_dirs(os.path.join(workdir, "checkpoints", p)) for p in ("sft", "rl"))


def check_resume_config(c: ml_collections.ConfigDict, workdir: str) -> None:
    """Refuse to resume a workdir's checkpoints with a config that changes what they
    mean (ConfigError naming each field, saved -> requested). Nothing is written.

    The saved config is ``config.json``; without it (checkpoints copied to another
    cluster, a run forked from them) the newest checkpoint's own record of its config
    (`saved_checkpoint_config`). A ``config.json`` that is not a run's config (a
    Hugging Face checkpoint given as the workdir) is refused, as the run would replace
    it."""
    check_config_file_is_a_runs(workdir)
    if not has_checkpoints(workdir):
        return
    found = saved_config_differences(c, workdir)
    if found is None:
        return
    diffs, path = found
    if diffs:
        raise ConfigError(
            f"{workdir} holds checkpoints of another config; resuming would change what "
            f"they mean ({len(diffs)} field(s), saved -> requested):\n  "
            + "\n  ".join(diffs)
            + f"\nUse the saved values ({path}) or a new --workdir. Fields that may change "
            "on resume: " + ", ".join(config_lib.resumable_fields())
        )


def saved_config_differences(
    c: ml_collections.ConfigDict, workdir: str, exempt: Sequence[str] | None = None
) -> tuple[list[str], str] | None:
    """(`config_differences` from the config the workdir's checkpoints were made with
    to ``c``, the file that config was read from), or None when none is recorded.
    ``exempt``: as for `config_differences`."""
    found = saved_checkpoint_config(workdir)
    if found is None:
        return None
    saved = old_keys.move_deprecated_record(found[0])
    return config_differences(saved, config_record(c), exempt), found[1]


def saved_checkpoint_config(workdir: str) -> tuple[dict, str] | None:
    """(the config the workdir's checkpoints were made with, the file it was read from):
    ``config.json``, else the record in the newest RL checkpoint whose metadata reads;
    None if neither exists. A warm start's own record is not used: its checkpoints are
    shared between runs that differ only in RL (the stability study places one warm
    start under each of its arms), and `gspo_jax.sft` restores them by shape."""
    path = os.path.join(workdir, CONFIG_FILE)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f), path
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"{path}: cannot read the config of this workdir's checkpoints ({e}); restore "
                "it or use a new --workdir"
            ) from None
    steps = step_dirs(os.path.join(workdir, "checkpoints", "rl"))
    for step in sorted(steps, reverse=True):
        meta = os.path.join(steps[step], "meta", "metadata")
        try:
            with open(meta, encoding="utf-8") as f:
                record = json.load(f)["config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an unfinished or damaged step: an older one records it too
        if isinstance(record, dict):
            return record, meta
    return None


def check_sources(meta: Mapping[str, Any], current: Mapping[str, str], where: str) -> None:
    """Refuse a checkpoint (its JSON record ``meta``, at ``where``) trained with inputs
    from outside the workdir that have changed on disk since (`RunParts.sources`: the
    tokenizer); a checkpoint that predates the record is not checked."""
    from gspo_jax.checkpoint import SourceChanged

    saved = meta.get("tokenizer")
    if saved is not None and saved != current["tokenizer"]:
        raise SourceChanged(
            f"{where}: config.tokenizer encodes text differently from the tokenizer this "
            f"checkpoint was trained with (fingerprint {saved}, now {current['tokenizer']}): "
            "its files (vocabulary, merges, chat template) changed since. Restore them to "
            "resume, or start a new run in another workdir"
        )


RUN_CONFIG_KEYS = ("objective", "rollout", "sft", "task")  # in every run's config.json


def check_config_file_is_a_runs(workdir: str) -> None:
    """A ConfigError when ``<workdir>/config.json`` exists and is not a run's config:
    the run would overwrite another program's file (a Hugging Face checkpoint's)."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError, RecursionError):
        record = None
    if isinstance(record, dict) and all(k in record for k in RUN_CONFIG_KEYS):
        return
    what = ""
    if isinstance(record, dict) and "model_type" in record:
        what = f" (model_type {record['model_type']!r}: a Hugging Face checkpoint?)"
    raise ConfigError(
        f"{path} is not a gspo_jax run's config{what}; a run in this workdir would "
        "replace it. Use another --workdir (to start from that checkpoint, set "
        "config.model.pretrained to its folder)"
    )


def save_run_config(c: ml_collections.ConfigDict, workdir: str) -> None:
    """Write ``config.json`` (atomically; after `check_resume_config` accepted it)."""
    path = os.path.join(workdir, CONFIG_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config_record(c), f, indent=2, sort_keys=True)
    os.replace(tmp, path)


class WorkdirLock:
    """``<workdir>/.lock``: one live trainer per workdir.

    The lock records the owner's host and pid and its heartbeat (the file's mtime,
    touched every step). A lock is the owner's while its process lives (same host) or
    its heartbeat is younger than ``stale_after`` seconds (another host, where the
    process cannot be checked); otherwise it is taken over, with a message.
    """

    def __init__(self, workdir: str, *, stale_after: float = 3600.0):
        self.path = os.path.join(workdir, ".lock")
        self.stale_after = stale_after
        self.held = False

    def _owner(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return None

    def _alive(self, owner: dict | None) -> bool:
        if owner is None:  # unreadable: a crash mid-write; treat as gone
            return False
        if owner.get("host") == socket.gethostname():
            try:
                os.kill(int(owner.get("pid", -1)), 0)
            except ProcessLookupError:
                return False
            except (PermissionError, OverflowError, ValueError):
                return True
            return True
        try:
            age = time.time() - os.path.getmtime(self.path)
        except OSError:
            return False
        return age < self.stale_after

    def acquire(self) -> None:
        record = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        )
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = self._owner()
            if self._alive(owner):
                raise RuntimeError(
                    f"{os.path.dirname(self.path)} is in use by another trainer (pid "
                    f"{owner.get('pid')} on {owner.get('host')}); two trainers in one "
                    f"workdir would overwrite each other's checkpoints and logs. Stop it, "
                    f"or remove {self.path} if it is gone"
                ) from None
            print(f"{self.path}: taking over the lock of a trainer that is gone ({owner})")
            tmp = f"{self.path}.{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(record)
            os.replace(tmp, self.path)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(record)
        self.held = True

    def heartbeat(self) -> None:
        if self.held:
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if self.held:
            owner = self._owner()
            if owner and owner.get("pid") == os.getpid():
                os.remove(self.path)
            self.held = False


class Preempted(SystemExit):
    """The run stopped on a signal after saving a checkpoint (exit code 128 + signal)."""


class GracefulShutdown:
    """SIGTERM and SIGINT set `requested` (the loop checkpoints after its current step
    and calls `exit`); a second signal exits at once. Installed only in the main
    thread (signal handlers can live nowhere else)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"\n{name} again: exiting now, without a checkpoint", file=sys.stderr)
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        print(
            f"\n{name}: finishing the current step, then a checkpoint and exit "
            f"(send {name} again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> "GracefulShutdown":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def exit(self, where: str) -> None:
        """Say where the run stopped and exit with 128 + the signal's number (SIGTERM's
        where another process of the run was the one signalled)."""
        signum = self.signum or signal.SIGTERM
        why = (
            f"by {signal.Signals(signum).name}"
            if self.signum
            else "because another process of the run was asked to stop"
        )
        print(
            f"stopped {why} after {where}; the checkpoint of that step is saved: run the "
            "same command to resume",
            file=sys.stderr,
            flush=True,
        )
        raise Preempted(128 + signum)


def check_health(metrics: Mapping[str, Any], c: ml_collections.ConfigDict, where: str) -> None:
    """Stop the run when its parameters are no longer finite, or when more than
    ``updates.max_consecutive_skips`` updates in a row were skipped for a non-finite
    loss or gradient (FloatingPointError saying which)."""
    if float(metrics["params_finite"]) < 1:  # the minimum over the step's updates
        raise FloatingPointError(
            f"{where}: the parameters are no longer finite after an update with a finite "
            "loss and gradient; the run stops before saving them. Lower the learning rate."
        )
    in_a_row = int(metrics["skipped_in_a_row"])
    limit = int(c.updates.max_consecutive_skips)
    if in_a_row > limit:
        raise FloatingPointError(
            f"{where}: {in_a_row} updates in a row were skipped for a non-finite loss or "
            f"gradient (config.updates.max_consecutive_skips={limit}); the run stops. "
            "Skipped updates leave the parameters as they were; lower the learning rate "
            "or inspect the data."
        )


class RunGuard:
    """A run's `WorkdirLock` (taken by process 0) and `GracefulShutdown`, as one context
    manager that the training loops ask after every step: ``requested`` (checkpoint and
    `exit`), and ``heartbeat`` (the lock's liveness)."""

    def __init__(self, workdir: str, *, lock: bool = True):
        self.lock = WorkdirLock(workdir) if lock else None
        self.shutdown = GracefulShutdown()

    def __enter__(self) -> "RunGuard":
        if self.lock is not None:
            self.lock.acquire()
        try:
            self.shutdown.__enter__()
        except BaseException:
            self.lock and self.lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown.__exit__(*exc)
        if self.lock is not None:
            self.lock.release()

    @property
    def requested(self) -> bool:
        """Whether this process, or any process of the run, was asked to stop: every
        process saves the same step's checkpoint and stops after it. Ask once a step."""
        from gspo_jax import multihost

        return multihost.any_process(self.shutdown.requested)

    def exit(self, where: str) -> None:
        self.shutdown.exit(where)

    def heartbeat(self) -> None:
        if self.lock is not None:
            self.lock.heartbeat()
