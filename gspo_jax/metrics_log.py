"""Where a run's metrics go: ``metrics.jsonl``, ``updates.jsonl``, TensorBoard,
Weights & Biases (optional, `WandbWriter`), and the console.

``metrics.jsonl`` holds one JSON object per logged step; ``updates.jsonl`` one per
optimizer update of RL (its RL ``step``, its index ``k`` within the rollout, its
epoch and mini-batch). Both are flushed after every line, so they survive a crash.
On resume, :class:`MetricsWriter` drops the lines of steps after the restored
checkpoint: the resumed run writes them again, and the file then reads as if the
run had never stopped.

The JSONL files are the run's record and are written by the loop itself: a write that
fails (a full disk, EIO) stops the run with an OSError naming the file, before the
step's checkpoint is saved, so that the checkpoints and the record stay in step (a
full disk stops checkpoints too). TensorBoard and W&B are written by threads of their
own (`gspo_jax.background`): an error, or a write that does not return within
``config.log_write_timeout`` seconds, switches that writer off with one message, and
the run goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Mapping

import numpy as np

from gspo_jax import event_file, multihost
from gspo_jax.background import BackgroundWriter
from gspo_jax.config_fields import ConfigError, setting

WANDB_MODES = ("auto", "online", "offline", "disabled")
WRITE_TIMEOUT = 60.0  # config.log_write_timeout's default


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """``config.wandb``: Weights & Biases, beside TensorBoard and the JSONL files
    (pip install -e '.[wandb]'). May change on resume."""

    enabled: bool = setting(False, doc="log to Weights & Biases")
    project: str = setting("gspo_jax", doc="the W&B project")
    entity: str = setting("", doc='the W&B entity ("" = the default)')
    name: str = setting("", doc="the run's name (\"\" = the workdir's name)")
    mode: str = setting(
        "auto",
        choices=WANDB_MODES,
        doc="auto: online when credentials are set and the server answers, else offline",
    )
    dir: str = setting("", doc='runs go to <dir>/wandb ("" = the workdir)')


def _scalar(v: Any) -> Any:
    if isinstance(v, (str, bool)) or v is None:
        return v
    a = np.asarray(v)
    if a.ndim == 0:
        x = a.item()
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)  # JSON has no NaN/inf; keep them visible as strings
        return x
    return [_scalar(x) for x in a.tolist()] if a.ndim == 1 else a.tolist()


class MetricsWriter:
    """Appends records to ``<workdir>/<filename>`` and TensorBoard events.

    TensorBoard tags are ``<phase>/<metric>`` (``<tb_prefix>/<metric>`` when a
    prefix is given), at the record's step or the ``tb_step`` given to `write`; a
    `WandbWriter`, when given, gets each record under the same names. A writer that
    is not ``enabled`` (every process of a run but the first) writes nothing; `write`
    still returns the record.
    """

    def __init__(
        self,
        workdir: str,
        *,
        resume_step: int | None = None,
        resume_phase: str | None = None,
        tensorboard: bool = True,
        filename: str = "metrics.jsonl",
        tb_prefix: str | None = None,
        wandb: WandbWriter | None = None,
        enabled: bool = True,
        timeout: float = WRITE_TIMEOUT,
    ):
        self.path = os.path.join(workdir, filename)
        self.tb_prefix = tb_prefix
        self._wandb = wandb if enabled else None
        self._f = self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step, resume_phase)
        self._f = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            # A prefixed writer gets its own event directory (a TensorBoard run).
            tb_dir = os.path.join(workdir, "tb", *([tb_prefix] if tb_prefix else []))
            self._tb = BackgroundWriter(
                "TensorBoard",
                tb_dir,
                timeout=timeout,
                then=f"the run goes on; {os.path.basename(self.path)} keeps every record",
            )
            self._events = EventFile()
            self._tb.submit(self._events.open, tb_dir)

    def _truncate_after(self, step: int, phase: str | None) -> None:
        """Keep lines up to (phase, step) of the checkpoint we resume from (step -1:
        none of that phase, which starts afresh). Only a last line cut short by a crash
        is dropped; any other bad line stops the resume (`read_metrics`)."""
        if not os.path.exists(self.path):
            return
        order = {"sft": 0, "rl": 1}
        keep = []
        for lineno, rec in _records(self.path):
            key = (order[rec["phase"]], rec["step"])
            if phase is None or key <= (order[phase], step):
                keep.append(json.dumps(rec, sort_keys=True) + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, self.path)

    def write(
        self, step: int, phase: str, metrics: Mapping[str, Any], *, tb_step: int | None = None
    ) -> dict:
        rec = {"step": int(step), "phase": phase}
        rec.update({k: _scalar(v) for k, v in metrics.items()})
        if self._f is None:  # not enabled
            return rec
        try:
            self._f.write(json.dumps(rec, sort_keys=True) + "\n")
            self._f.flush()
        except OSError as e:
            raise OSError(
                e.errno,
                f"{self.path}: cannot write the run's record ({e.strerror or e}); the run stops, "
                "keeping its checkpoints (this file is what a resume continues from): free "
                "the space or fix the file system, then run the same command to resume",
            ) from e
        prefix, at = self.tb_prefix or phase, int(step if tb_step is None else tb_step)
        if self._wandb is not None:
            self._wandb.log(prefix, at, rec)
        if self._tb is not None:
            values = []
            for k, v in rec.items():
                if k in ("step", "phase"):
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    values.append((f"{prefix}/{k}", v))
                elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                    values += [(f"{prefix}/{k}/{i}", x) for i, x in enumerate(v)]
            self._tb.submit(self._events.write, at, values, time.time())
        return rec

    def flush(self) -> None:
        """Flush the record, and wait (boundedly, `BackgroundWriter.flush`) for TensorBoard."""
        if self._f is not None:
            self._f.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close(self._events.close)


class EventFile:
    """A TensorBoard event file (`gspo_jax.event_file`), written and flushed record by
    record by the thread of a `BackgroundWriter`, so that a write error or a hung file
    system never blocks the run (tensorboardX's own writer thread died on a write error
    and then blocked the caller for ever, its queue full)."""

    def __init__(self):
        self._writer = None

    def open(self, logdir: str) -> None:
        self._writer = event_file.EventWriter(logdir)

    def write(self, step: int, values: list[tuple[str, float]], wall_time: float) -> None:
        if not values:
            return
        self._writer.scalars(step, values, wall_time)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_metrics(workdir: str, filename: str = "metrics.jsonl") -> list[dict]:
    """All records of ``<workdir>/metrics.jsonl`` (or ``updates.jsonl``).

    A last line cut short by a crash is skipped; a bad line anywhere else (not JSON,
    or not a record with an integer ``step`` and a ``phase`` of sft/rl) raises
    ValueError naming the file and line.
    """
    return [rec for _, rec in _records(os.path.join(workdir, filename))]


def _records(path: str) -> list[tuple[int, dict]]:
    """(line number, record) of every record line of a metrics file (see `read_metrics`)."""
    with open(path, encoding="utf-8") as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    out = []
    for k, (i, line) in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if k == len(lines) - 1 and not line.endswith("\n"):
                break  # the line a crash cut short
            raise ValueError(
                f"{path}:{i}: not a JSON record ({e}); fix or delete the line to resume"
            ) from None
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("step"), int)
            or isinstance(rec.get("step"), bool)
            or rec.get("phase") not in ("sft", "rl")
        ):
            raise ValueError(
                f"{path}:{i}: not a metrics record (needs an integer 'step' and a 'phase' "
                f"of 'sft' or 'rl'): {line.strip()[:80]!r}; fix or delete the line to resume"
            )
        out.append((i, rec))
    return out


# --------------------------------------------------------------------------
# Weights & Biases (optional: config.wandb, pip install -e '.[wandb]').

WANDB_ID_FILE = "wandb_run_id"
_WANDB_PHASES = ("sft", "rl", "updates")


def wandb_mode(mode: str, *, timeout: float = 2.0) -> str:
    """The W&B mode for ``config.wandb.mode``: any but "auto" as is. "auto": the
    environment's WANDB_MODE when set; else "online" when an API key is known
    (WANDB_API_KEY or ~/.netrc) and the server (WANDB_BASE_URL, default
    api.wandb.ai) accepts a connection within ``timeout`` seconds; else "offline"
    (``wandb sync <workdir>/wandb/offline-run-*`` uploads it later)."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE", "").strip()
    if env:
        return env
    import netrc
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host = url.hostname or "api.wandb.ai"
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        try:
            key = (netrc.netrc().authenticators(host) or (None, None, None))[2]
        except (OSError, netrc.NetrcParseError):
            key = None
    if not key:
        return "offline"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "online"
    except OSError:
        return "offline"


def wandb_run_id(workdir: str) -> str:
    """The W&B run id of this workdir, made once and kept in ``<workdir>/wandb_run_id``,
    so that a resumed run continues the same W&B run."""
    path = os.path.join(workdir, WANDB_ID_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            run_id = f.read().strip()
        if run_id:
            return run_id
    import uuid

    run_id = uuid.uuid4().hex[:12]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)
    return run_id


class WandbWriter:
    """One W&B run of a workdir; `MetricsWriter` logs each record to it too.

    Keys are ``<phase>/<metric>`` like TensorBoard's tags: ``sft/*`` and ``rl/*`` at
    the record's step, ``updates/*`` at the global update index, each against its own
    step metric (``<phase>/step``; W&B's own step just counts the log calls). Rows go to
    the run from a thread of their own (`BackgroundWriter`): an error or a call that
    hangs switches W&B off with one message, and the run goes on.
    """

    def __init__(self, run: Any, *, where: str = "", timeout: float = WRITE_TIMEOUT):
        self.run = run
        for phase in _WANDB_PHASES:
            run.define_metric(f"{phase}/step")
            run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
        self._bg = BackgroundWriter(
            "Weights & Biases",
            where or str(getattr(run, "dir", "")),
            timeout=timeout,
            then="the run goes on; metrics.jsonl keeps every record",
        )

    @classmethod
    def open(
        cls, wb: Any, workdir: str, config: Mapping[str, Any], *, timeout: float = WRITE_TIMEOUT
    ) -> WandbWriter:
        """Start (or resume) the workdir's run; ``wb`` is ``config.wandb``."""
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "config.wandb.enabled: is True but the wandb package is not installed; "
                "pip install -e '.[wandb]' (or set --config.wandb.enabled=False)"
            ) from None
        root = os.path.abspath(os.path.expanduser(wb.dir or workdir))
        os.makedirs(os.path.join(root, "wandb"), exist_ok=True)
        run = wandb.init(
            project=wb.project or None,
            entity=wb.entity or None,
            name=wb.name or os.path.basename(os.path.abspath(workdir)),
            dir=root,
            id=wandb_run_id(workdir),
            resume="allow",
            mode=wandb_mode(wb.mode),
            config=dict(config),
            allow_val_change=True,  # a resume may change the fields that may change
        )
        return cls(run, where=os.path.join(root, "wandb"), timeout=timeout)

    def log(self, prefix: str, at: int, rec: Mapping[str, Any]) -> None:
        row: dict[str, Any] = {f"{prefix}/step": int(at)}
        if prefix == "updates":
            row["updates/rl_step"] = rec["step"]
        for k, v in rec.items():
            if k in ("step", "phase"):
                continue
            if isinstance(v, str) and v in ("nan", "inf", "-inf"):
                v = float(v)  # `_scalar` keeps non-finite values as strings
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[f"{prefix}/{k}"] = v
            elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                row.update({f"{prefix}/{k}/{i}": x for i, x in enumerate(v)})
        self._bg.submit(self.run.log, row)

    def flush(self) -> None:
        """Wait (boundedly) until every row is handed to W&B."""
        self._bg.flush()

    def finish(self, exit_code: int = 0) -> None:
        """Finish the run after its rows (nothing more once switched off)."""
        self._bg.close(functools.partial(self.run.finish, exit_code=exit_code))


@contextlib.contextmanager
def open_wandb(
    wb: Any,
    workdir: str,
    config: Mapping[str, Any],
    *,
    enabled: bool = True,
    timeout: float = WRITE_TIMEOUT,
):
    """The workdir's `WandbWriter` while the block runs (None when ``wb.enabled`` or
    ``enabled``, e.g. "this is process 0", is false), finished on the way out: with
    exit code 0, the code of a SystemExit, or 1 for an exception."""
    if not (enabled and wb.enabled):
        yield None
        return
    writer = WandbWriter.open(wb, workdir, config, timeout=timeout)
    code = 0
    try:
        yield writer
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        raise
    except BaseException:
        code = 1
        raise
    finally:
        writer.finish(code)


def progress_bar(c, total: int, start: int, desc: str):
    """A tqdm bar on the primary process where ``config.progress_bar`` is on; else one that
    does nothing."""
    if c.progress_bar and multihost.is_primary():
        from tqdm import tqdm

        return tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)

    class _Null:
        def update(self, n): ...
        def set_postfix(self, **kw): ...
        def close(self): ...

    return _Null()
