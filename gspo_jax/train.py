"""The main job: the run as a loop over its phases, with its logs, checkpoints, stop and
resume.

    python -m gspo_jax.train --config=configs/default.py --workdir=runs/default
    python -m gspo_jax.train --config=configs/default.py:objective=grpo,smoke \\
        --config.updates.routing_replay=R3 --workdir=/tmp/run

    run(c, workdir)
      RunParts(c, workdir)           the run's parts: tokenizer, mesh, data, model, sampler
                                    (gspo_jax.run_parts); validates the config
      sft.WarmStart(trainer)        the supervised warm start (gspo_jax.sft)
      RLPhase(trainer, params)      RL: sample, score, filter, old pass, advantages,
                                    correction, updates (gspo_jax.rl); the held-out
                                    evaluation every ``eval_every`` steps
      loop.run(phase, ...)          each phase's steps, health checks, logs,
                                    checkpoints and stop (gspo_jax.loop)

Everything is resumable: each phase restores its latest checkpoint (parameters,
optimizer state, step; the data position and RNG are functions of the step), and
``metrics.jsonl`` (``updates.jsonl``: one record per optimizer update) is cut back to
it. The workdir is locked; a resume with a config that changes what its checkpoints
mean is refused; SIGTERM or SIGINT ends the run after the current step with a
checkpoint (`gspo_jax.safety`).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import jax
import ml_collections

from gspo_jax import config as config_lib
from gspo_jax import heldout, loop, multihost, old_keys, safety, sft
from gspo_jax.checkpoint import PhaseCheckpointer
from gspo_jax.metrics_log import MetricsWriter, open_wandb
from gspo_jax.rl import RLPhase
from gspo_jax.run_parts import RunParts


def enable_compilation_cache(path: str) -> str | None:
    """Turn on JAX's persistent compilation cache at `path` (every program,
    however fast it compiled), unless the environment already names a cache
    directory.  Returns the directory in use (None when off)."""
    current = jax.config.jax_compilation_cache_dir
    if current or not path:
        return current or None
    path = os.path.expanduser(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run; it only compiles every time
        print(
            f"config.compilation_cache_dir: cannot create {path!r} ({e}); running without "
            "the persistent compilation cache",
            flush=True,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # pick up the directory even after earlier compiles
    return path


def run(c: ml_collections.ConfigDict, workdir: str) -> list[dict]:
    """Run (or resume) the whole job: supervised warm start, then RL.

    The workdir is locked for this trainer; a resume with a config that changes what
    its checkpoints mean is refused before anything is written; SIGTERM or SIGINT
    ends the run after the current step with a checkpoint (`gspo_jax.safety`).
    With several processes (`multihost.maybe_initialize_distributed`) every process calls this
    with the same config and workdir (a file system they share); only the first writes
    logs and the run's config (`gspo_jax.multihost`).
    """
    enable_compilation_cache(str(c.get("compilation_cache_dir", "")))
    os.makedirs(workdir, exist_ok=True)
    primary = multihost.is_primary()
    with safety.RunGuard(workdir, lock=primary) as guard:
        old_keys.move_deprecated(c)  # before the comparison with the saved config
        safety.check_resume_config(c, workdir)
        trainer = RunParts(c, workdir)  # loads the config: the run reads trainer.cfg alone
        multihost.barrier("resume config checked")  # by every process, before it is replaced
        if primary:
            safety.save_run_config(c, workdir)
        cfg = trainer.cfg
        with open_wandb(
            cfg.wandb, workdir, trainer.record, enabled=primary, timeout=cfg.log_write_timeout
        ) as wb:
            return _run(trainer, guard, wb)


def _run(trainer: RunParts, guard: safety.RunGuard, wb=None) -> list[dict]:
    cfg, workdir = trainer.cfg, trainer.workdir
    rl_ckpt = PhaseCheckpointer(
        workdir, "rl", every=cfg.checkpoint_every, keep=cfg.keep_checkpoints
    )
    resuming_rl = rl_ckpt.latest_step() is not None
    primary = multihost.is_primary()  # the one process that writes the logs

    def open_log(phase: str, step_: int) -> MetricsWriter:
        """metrics.jsonl cut back to (phase, step_): where this run resumes."""
        return MetricsWriter(
            workdir,
            resume_step=step_,
            resume_phase=phase,
            wandb=wb,
            enabled=primary,
            timeout=cfg.log_write_timeout,
        )

    writer = None
    if cfg.sft.steps > 0 and not resuming_rl:
        params, writer = sft.run(trainer, open_log, guard)
    elif cfg.sft.steps > 0 and (trainer.kl_coef or cfg.lora.rank):  # RL resumes: pi_ref, base
        params = sft.reference_for_resume(trainer)
    else:  # no warm start, or RL resumes from its own checkpoint and needs nothing else
        params = trainer.init_params

    with rl_ckpt:  # every way out waits for the save in flight (checkpoint.py)
        rl = RLPhase(trainer, params)
        if resuming_rl:  # the newest checkpoint that restores (checkpoint.PhaseCheckpointer)
            tree, meta, rl.start = rl_ckpt.restore(rl.checkpoint_target())
            safety.check_sources(meta, trainer.sources(), f"{rl_ckpt.directory}/{rl.start}")
            rl.load_checkpoint(tree, meta)
        if writer is None:  # RL resumes at its start, or starts afresh (-1: no RL line kept)
            writer = open_log("rl", rl.start if resuming_rl else -1)
        # One record per optimizer update, cut back to the RL checkpoint like metrics.jsonl.
        rl.update_writer = MetricsWriter(
            workdir,
            resume_step=rl.start,
            resume_phase="rl",
            filename="updates.jsonl",
            tb_prefix="updates",
            wandb=wb,
            enabled=primary,
            timeout=cfg.log_write_timeout,
        )
        records = []
        if rl.start == 0:
            records.append(writer.write(0, "rl", heldout.evaluate(trainer, rl.state.params)))
        records += loop.run(rl, trainer, rl_ckpt, writer, guard)
        rl.close()
        writer.close()
        return records


def main(argv: Sequence[str]) -> None:
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    cfg = flags.FLAGS.config
    if cfg is None:
        raise config_lib.ConfigError("--config is required, e.g. --config=configs/default.py")
    claimed = multihost.claim_device_memory()
    multihost.maybe_initialize_distributed(cfg.distributed)
    if claimed and jax.default_backend() == "gpu":
        print(f"gspo_jax: {claimed}", file=sys.stderr)
    run(cfg, flags.FLAGS.workdir)


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Experiment config file (configs/*.py[:arg]).", lock_config=True
    )
    flags.DEFINE_string(
        "workdir", "runs/default", "Where checkpoints, metrics and TensorBoard events go."
    )


def unknown_override(argv: Sequence[str]) -> str | None:
    """The one-line message for the first ``--config.<key>=...`` of ``argv`` that names no
    field of the config ``--config=<file>[:arg]`` builds (None if every key exists)."""
    import runpy

    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        return None
    path, _, arg = spec.partition(":")
    c = runpy.run_path(path)["get_config"](arg or None)
    for a in argv:
        if not a.startswith("--config."):
            continue
        key = a[len("--config.") :].split("=", 1)[0]
        node = c
        for part in key.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                return config_lib.unknown_key_message(key, c)
            node = node[part]
    return None


def _parse_flags(argv: Sequence[str]):
    """absl's flag parsing, but an unknown ``--config.<key>`` is one line naming it and
    its closest known key (ml_collections raises a long AttributeError)."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError, flags.Error):
        message = unknown_override(argv)
        if message is None:
            raise
        print(message, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main, flags_parser=_parse_flags)
