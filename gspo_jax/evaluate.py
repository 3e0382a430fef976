"""Score a checkpoint on a task's held-out split, without training.

    python -m gspo_jax.evaluate --config=configs/default.py --checkpoint=runs/default \\
        [--split=test] [--num_prompts=0] [--out=metrics.json]

``--checkpoint`` is either

* a workdir of ours (it has ``checkpoints/``): the parameters of its newest RL
  checkpoint that restores (a LoRA run's adapters on its frozen base, rebuilt from its
  source and checked as a resume checks it), else of its newest warm-start (SFT) one. ``--config`` must
  be the run's (the same config file and arguments): before anything is built it is
  compared with the config the run recorded (``<workdir>/config.json``, else its newest
  RL checkpoint's record), as a resume compares it (`gspo_jax.safety`), and a
  ``ConfigError`` names every field that differs. Nothing under the workdir is written,
  so a read-only workdir (an archive, another user's run) can be scored: no lock is
  taken (a job still training there is not disturbed; it may delete an old checkpoint
  meanwhile, which is then skipped), and a checkpoint that does not restore is skipped
  but not moved aside (``PhaseCheckpointer(read_only=True)``). Prompts are read from
  ``task.data_dir``, else from the run's ``<workdir>/data`` (prepared data are read
  without a lock, so that folder may be read-only); when that does not exist, or lacks
  the data and cannot be written, they are prepared in a temporary directory, deleted
  afterwards (set ``--config.task.data_dir`` to keep them);
* or a Hugging Face directory (``config.json`` and ``*.safetensors``): loaded as
  ``config.model.pretrained``, with the directory's ``tokenizer.json`` unless
  ``--config.tokenizer`` names another one. Without ``task.data_dir`` the prompts are
  generated in a temporary directory.

The first ``--num_prompts`` prompts of ``--split`` in stored order (0: the config's
``task.eval_size``; -1: the whole split) are scored as during training
(`gspo_jax.heldout.evaluate`: ``task.eval_samples`` samples each at the rollout's temperature,
plus one greedy). Prints (and with ``--out`` writes) one JSON object: the metrics of
:mod:`gspo_jax.heldout` (``eval/pass@k``, ``eval/maj@k``, ``eval/mean@n``,
``eval/greedy``, and ``eval_reward_mean`` / ``eval_greedy_reward``), with
``checkpoint``, ``restored`` (``"rl/<step>"``, ``"sft/<step>"`` or ``"pretrained"``),
``split`` and ``num_prompts``. A config, checkpoint or file error is printed in one
message (``ConfigError: …``), exit status 2 for the config, else 1.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Sequence

import ml_collections

SPLITS = ("test", "train")


def is_hf_dir(path: str) -> bool:
    """A Hugging Face checkpoint directory: config.json and safetensors weights."""
    return os.path.isfile(os.path.join(path, "config.json")) and bool(
        glob.glob(os.path.join(path, "*.safetensors"))
    )


def is_workdir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints"))


def restore_params(trainer) -> tuple[Any, str]:
    """(parameters, ``"rl/<step>"`` or ``"sft/<step>"``) of a workdir's newest RL
    checkpoint that restores, else of its newest warm-start one; for a LoRA run the
    adapters on the frozen base rebuilt from its source, as a resume rebuilds it
    (`gspo_jax.lora_training`). Read-only: nothing under the workdir is written, and each
    checkpointer is closed on every way out."""
    from gspo_jax.checkpoint import step_dirs

    workdir = trainer.workdir
    for phase, restore in (("rl", _restore_rl), ("sft", _restore_sft)):
        if step_dirs(os.path.join(workdir, "checkpoints", phase)):
            params, step = restore(trainer)
            return params, f"{phase}/{step}"
    raise FileNotFoundError(
        f"{workdir}: no RL or warm-start checkpoint under {os.path.join(workdir, 'checkpoints')}"
    )


def _reader(trainer, phase: str):
    from gspo_jax.checkpoint import PhaseCheckpointer

    keep = trainer.cfg.keep_checkpoints
    return PhaseCheckpointer(trainer.workdir, phase, every=1, keep=keep, read_only=True)


def _restore_sft(trainer, step: int | None = None) -> tuple[Any, int]:
    """(parameters, step) of the newest warm-start checkpoint that restores (or ``step``)."""
    from gspo_jax import lora_training, sft

    kind = lora_training.trainable(trainer.cfg.lora, "sft")
    target = trainer.new_state(trainer.init_params, sft.sft_optimizer(trainer.cfg)[0], kind)
    with _reader(trainer, "sft") as ckpt:
        state, _, step = ckpt.restore(target, step)
    return state.params, step


def _restore_rl(trainer) -> tuple[Any, int]:
    """(parameters, step) of the newest RL checkpoint that restores: the state train.py
    saves (`gspo_jax.rl.RLPhase.checkpoint_items`), with LoRA onto its base."""
    from gspo_jax import lora_training, rl

    cfg = trainer.cfg
    kind = lora_training.trainable(cfg.lora, "rl")
    params = trainer.init_params
    if kind != "all" and cfg.sft.steps > 0:  # LoRA's frozen base: the warm start's result
        try:
            params = _restore_sft(trainer, cfg.sft.steps)[0]
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{trainer.workdir}: the LoRA run's frozen base is its warm start's result, "
                f"but its last checkpoint (checkpoints/sft/{cfg.sft.steps}) is gone"
            ) from None
    params, base = lora_training.rl_start(trainer, params, kind)
    state = trainer.new_state(params, rl.rl_optimizer(cfg)[0], kind)
    target = rl.checkpoint_target(trainer, lora_training.saved_state(state, kind))
    with _reader(trainer, "rl") as ckpt:
        tree, meta, step = ckpt.restore(target)
    saved, _ = rl.unpack_checkpoint(tree, meta)
    return lora_training.loaded_state(saved, meta, state, kind, base).params, step


def check_run_config(c: ml_collections.ConfigDict, workdir: str) -> None:
    """A ConfigError naming every field in which ``c`` differs from the config that
    made the workdir's checkpoints (the resume comparison,
    `gspo_jax.safety.saved_config_differences`; the fields a resume may change may
    differ here too)."""
    from gspo_jax import config as config_lib
    from gspo_jax import old_keys, safety

    old_keys.move_deprecated(c)  # as a resume does, before the comparison
    found = safety.saved_config_differences(c, workdir)
    if found is None or not found[0]:
        return
    diffs, path = found
    raise config_lib.ConfigError(
        f"{workdir} was trained with another config; its checkpoints are read with the run's "
        f"({len(diffs)} field(s) differ, the run's -> given):\n  "
        + "\n  ".join(diffs)
        + f"\nGive the run's values (recorded in {path}). Fields that may differ: "
        + ", ".join(config_lib.resumable_fields())
    )


def open_workdir(c: ml_collections.ConfigDict, workdir: str):
    """(the run's `RunParts` on ``workdir``, a temporary directory to delete afterwards
    or None), read-only: ``c`` (changed here: pass a copy) is first checked against the
    run's config (`check_run_config`); the prompts are ``task.data_dir``'s, else the
    run's prepared data in ``<workdir>/data`` (read without a lock: a read-only workdir
    serves), else prepared in that temporary directory: when ``<workdir>/data`` does not
    exist, or lacks them and cannot be written (`gspo_jax.data.source.DataDirNotWritable`)."""
    from gspo_jax.data.source import DataDirNotWritable
    from gspo_jax.run_parts import RunParts

    if not is_workdir(workdir):
        raise FileNotFoundError(f"{workdir}: not a workdir (no checkpoints/)")
    check_run_config(c, workdir)  # before anything is built or read
    tmp = None
    own = not c.task.data_dir  # the run's prepared data, else prepared outside
    if own:
        c.task.data_dir = os.path.join(workdir, "data")
        if not os.path.isdir(c.task.data_dir):
            c.task.data_dir = tmp = tempfile.mkdtemp(prefix="gspo_eval_")
    try:
        try:
            return RunParts(c, workdir), tmp
        except DataDirNotWritable:
            if not own or tmp is not None:
                raise
            # <workdir>/data lacks this task's data and cannot take them: as without it.
            c.task.data_dir = tmp = tempfile.mkdtemp(prefix="gspo_eval_")
            return RunParts(c, workdir), tmp
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def evaluate_checkpoint(
    c: ml_collections.ConfigDict,
    checkpoint: str,
    *,
    split: str = "test",
    num_prompts: int = 0,
) -> dict[str, Any]:
    """The metric dict of ``checkpoint`` (a workdir of ours or a Hugging Face
    directory) on the first ``num_prompts`` prompts of ``split`` (module docstring)."""
    from gspo_jax import heldout
    from gspo_jax.run_parts import RunParts
    from gspo_jax.train import enable_compilation_cache

    if split not in SPLITS:
        raise ValueError(f"--split must be one of {SPLITS}, got {split!r}")
    checkpoint = os.path.abspath(checkpoint)
    c = copy.deepcopy(c)
    hf = is_hf_dir(checkpoint) and not is_workdir(checkpoint)  # a run's own checkpoints first
    if not hf and not is_workdir(checkpoint):
        raise FileNotFoundError(
            f"{checkpoint}: neither a workdir (no checkpoints/) nor a Hugging Face "
            "directory (config.json and *.safetensors)"
        )
    enable_compilation_cache(str(c.get("compilation_cache_dir", "")))
    tmp = None
    try:
        if hf:
            c.model.pretrained = checkpoint
            if c.tokenizer == "char":
                c.tokenizer = checkpoint
            tmp = tempfile.mkdtemp(prefix="gspo_eval_")
            trainer = RunParts(c, tmp)
            params, restored = trainer.init_params, "pretrained"
        else:
            trainer, tmp = open_workdir(c, checkpoint)
            params, restored = restore_params(trainer)
        data = trainer.eval_data if split == "test" else trainer.train_data
        count = len(data) if num_prompts < 0 else num_prompts or trainer.cfg.task.eval_size
        examples = data.first(count)
        metrics = heldout.evaluate(trainer, params, examples=examples)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {
        "checkpoint": checkpoint,
        "restored": restored,
        "split": split,
        "num_prompts": len(examples),
    }
    out.update(metrics)
    return out


def run_command(fn, required: dict[str, str], more: tuple = ()):
    """A command's main (this one's, `gspo_jax.export`'s): ``fn(flags)`` once
    ``--config`` and the ``required`` flags (name: what it is) are given and each GPU's
    memory is claimed as in training. A config, checkpoint or file error (or one of
    ``more``) is printed in one line, and the process exits with status 2 for the
    config, else 1."""
    from absl import flags, logging

    from gspo_jax import config as config_lib
    from gspo_jax.checkpoint import CheckpointError
    from gspo_jax.data.source import DataDirNotWritable
    from gspo_jax.multihost import claim_device_memory

    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS
    if f.config is None:
        raise config_lib.ConfigError("--config is required, e.g. --config=configs/default.py")
    for name, what in required.items():
        if not f[name].value:
            raise config_lib.ConfigError(f"--{name} is required: {what}")
    claim_device_memory()  # 95% of each GPU for XLA, as in training
    try:
        return fn(f)
    except (
        config_lib.ConfigError,
        CheckpointError,
        FileNotFoundError,
        FileExistsError,
        DataDirNotWritable,
        *more,
    ) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(2 if isinstance(e, config_lib.ConfigError) else 1)


def main(argv: Sequence[str]) -> None:
    from absl import flags

    del argv

    def evaluate(f):
        if f.out:
            check_out_file(f.out)  # before the evaluation, not after
        return evaluate_checkpoint(
            f.config, f.checkpoint, split=f.split, num_prompts=int(f.num_prompts)
        )

    result = run_command(evaluate, {"checkpoint": "a workdir or a HF directory"})
    f = flags.FLAGS
    text = json.dumps(result, indent=2, sort_keys=True)
    if f.out:
        out = os.path.abspath(f.out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        os.replace(out + ".tmp", out)
    print(text, flush=True)


def check_out_file(path: str) -> None:
    """``--out`` may be a new file or an earlier evaluation's (a JSON object with
    ``checkpoint`` and ``restored``), which is replaced; anything else (a run's
    ``config.json`` or ``metrics.jsonl``, a folder) is refused by FileExistsError."""
    if not os.path.lexists(path):
        return
    record = None
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError, RecursionError):
            pass
    if not (isinstance(record, dict) and {"checkpoint", "restored"} <= set(record)):
        raise FileExistsError(
            f"--out={path} exists and is not an earlier evaluation's output; writing the "
            "scores there would replace it: name a new file. Nothing was evaluated"
        )


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Experiment config file (configs/*.py[:arg]).", lock_config=True
    )
    flags.DEFINE_string("checkpoint", "", "A workdir of ours, or a Hugging Face directory.")
    flags.DEFINE_enum("split", "test", list(SPLITS), "The task's split to score.")
    flags.DEFINE_integer(
        "num_prompts", 0, "Prompts to score: 0 = config.task.eval_size, -1 = the whole split."
    )
    flags.DEFINE_string("out", "", "Also write the JSON here.")


if __name__ == "__main__":
    from absl import app

    from gspo_jax.train import _parse_flags

    _define_flags()
    sys.exit(app.run(main, flags_parser=_parse_flags))
