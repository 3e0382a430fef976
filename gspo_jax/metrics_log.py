"""Where a run's metrics go: ``metrics.jsonl``, ``updates.jsonl``, TensorBoard, and
the console.

``metrics.jsonl`` holds one JSON object per logged step; ``updates.jsonl`` one per
optimizer update of RL (its RL ``step``, its index ``k`` within the rollout, its
epoch and mini-batch). Both are flushed after every line, so they survive a crash.
On resume, :class:`MetricsWriter` drops the lines of steps after the restored
checkpoint: the resumed run writes them again, and the file then reads as if the
run had never stopped.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np


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
    prefix is given), at the record's step or the ``tb_step`` given to `write`.
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
    ):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, filename)
        self.tb_prefix = tb_prefix
        if resume_step is not None:
            self._truncate_after(resume_step, resume_phase)
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # A prefixed writer gets its own event directory (a TensorBoard run).
            tb_dir = os.path.join(workdir, "tb", *([tb_prefix] if tb_prefix else []))
            self._tb = SummaryWriter(tb_dir)

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
        self._f.write(json.dumps(rec, sort_keys=True) + "\n")
        self._f.flush()
        if self._tb is not None:
            prefix, at = self.tb_prefix or phase, int(step if tb_step is None else tb_step)
            for k, v in rec.items():
                if k in ("step", "phase"):
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{prefix}/{k}", v, at)
                elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"{prefix}/{k}/{i}", x, at)
        return rec

    def flush(self) -> None:
        self._f.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


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
