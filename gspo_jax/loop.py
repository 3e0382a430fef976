"""The loop every phase of a run goes through: the warm start (`gspo_jax.sft.WarmStart`)
and RL (`gspo_jax.rl.RLPhase`) alike.

    for s in range(phase.start, phase.steps):
        metrics, health = phase.run_step(s)       the step's work, on the devices
        safety.check_health(health)               non-finite parameters, skipped updates
        record = phase.finish_step(s, metrics)    its evaluation, and what to log (or None)
        writer.write(record)                      metrics.jsonl, TensorBoard, W&B
        ckpt.save(phase.checkpoint_items())       with the run's config and inputs' record
        SIGTERM / SIGINT: that checkpoint forced, the writers closed, exit 128 + signal

The phases differ only in what a step is, when it logs and evaluates, and what their
checkpoints hold; progress, health, logging, saving and stopping are here, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from gspo_jax import safety
from gspo_jax.checkpoint import PhaseCheckpointer
from gspo_jax.metrics_log import MetricsWriter, progress_bar

if TYPE_CHECKING:
    from gspo_jax.run_parts import RunParts


class Phase(Protocol):
    """A phase of a run, as `run` drives it."""

    name: str  # "sft" or "rl": its checkpoints' folder and its records' phase
    steps: int  # the step it ends at
    start: int  # the step it resumes at (its newest checkpoint's; 0 afresh)

    def run_step(self, s: int) -> tuple[Any, dict[str, float]]:
        """Step s (0-based): its metrics, and the host scalars `safety.check_health`
        reads (``params_finite``, ``skipped_in_a_row``)."""

    def finish_step(self, s: int, metrics: Any) -> dict[str, Any] | None:
        """After the health check: the record to log for step s (its evaluation
        included), or None when this step logs nothing."""

    def postfix(self, metrics: Any, record: dict[str, Any] | None) -> dict[str, str]:
        """The progress bar's figures after step s ({}: leave them)."""

    def checkpoint_items(self) -> tuple[Any, dict[str, Any]]:
        """The checkpoint's tree and the phase's part of its JSON record."""

    def close(self) -> None:
        """Close what the phase writes besides ``metrics.jsonl``."""


def run(
    phase: Phase,
    trainer: RunParts,
    ckpt: PhaseCheckpointer,
    writer: MetricsWriter,
    guard: safety.RunGuard | None = None,
) -> list[dict[str, Any]]:
    """Steps ``phase.start`` to ``phase.steps`` of ``phase``: each checked, logged by
    ``writer`` when the phase says so, and checkpointed (``checkpoint_every``, the last
    step always) with the run's config record and inputs (`RunParts.record`,
    `RunParts.sources`). ``guard`` (`safety.RunGuard`): a SIGTERM or SIGINT during a step
    ends the run after it, with its checkpoint. Returns the records written."""
    cfg, records = trainer.cfg, []
    bar = progress_bar(cfg, phase.steps, phase.start, phase.name)
    for s in range(phase.start, phase.steps):
        metrics, health = phase.run_step(s)
        safety.check_health(health, cfg, f"{phase.name} step {s + 1}")
        record = phase.finish_step(s, metrics)
        if record is not None:
            records.append(writer.write(s + 1, phase.name, record))
        postfix = phase.postfix(metrics, record)
        if postfix:
            bar.set_postfix(**postfix)
        bar.update(1)
        tree, phase_meta = phase.checkpoint_items()
        meta = {"phase": phase.name, "step": s + 1, "config": trainer.record}
        meta.update(trainer.sources(), **phase_meta)
        stop = guard is not None and guard.requested
        ckpt.save(s + 1, tree, meta, force=(s + 1 == phase.steps) or stop)
        if stop:
            ckpt.close()
            phase.close()
            writer.close()
            guard.exit(f"{phase.name} step {s + 1}")
        if guard is not None:
            guard.heartbeat()
    bar.close()
    return records
