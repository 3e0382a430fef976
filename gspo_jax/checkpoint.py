"""Orbax checkpoints of a training phase: state arrays plus a JSON record.

Each phase (``sft``, ``rl``) has its own directory under ``<workdir>/checkpoints``
and its own step count. A checkpoint holds

* ``state``: the :class:`~gspo_jax.step.TrainState` pytree (parameters,
  optimizer state, step, skipped-update count), restored with the shardings of
  a target state so a resumed run lands on the same mesh;
* ``meta``: a JSON dict with what the host loop needs to continue exactly
  (the data position, counters).

Saves are asynchronous; ``max_to_keep`` keeps the last K. Orbax writes into a
temporary directory and renames it when complete, so a run killed mid-save
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class PhaseCheckpointer:
    """Save and restore one phase's checkpoints."""

    def __init__(self, workdir: str, phase: str, *, every: int, keep: int, async_save: bool = True):
        self.phase = phase
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints", phase))
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every,
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        return self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restore onto the shapes, dtypes and shardings of ``target_state``."""
        step = self._mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no {self.phase!r} checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["meta"]), step

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
