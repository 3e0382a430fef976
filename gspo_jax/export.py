"""Export a run's model in the Hugging Face layout, or its LoRA adapters in PEFT's.

    python -m gspo_jax.export --config=configs/default.py:lora --workdir=runs/lora \\
        --out=runs/lora/hf [--format=merged|peft|base] [--dtype=bfloat16] [--max_shard_size=5GB]

The parameters are those `gspo_jax.evaluate` scores: the workdir's newest RL checkpoint
that restores, else its newest warm-start one; a LoRA run's adapters on the frozen base
rebuilt from its source (the warm start's last checkpoint, ``model.pretrained`` or the
seed), its checksum checked as a resume checks it. Read-only like the evaluation:
``--config`` must be the run's (a ``ConfigError`` names every field that differs), and
nothing under the workdir is written (``--out`` may be inside it).

``--out`` is a new or empty folder, or one an earlier export of the same format wrote:
it records what it wrote (``gspo_jax_export.json``), and those files are replaced.
Anything else is refused before the run is read (`check_out`): the workdir itself, a
folder holding it, a folder with other files, and an export of another format (a
merged model and a PEFT adapter in one folder load in transformers as the adapters
applied twice).

``--format``:

* ``merged`` (the default): ``config.json`` and ``model.safetensors`` (shards with an
  index past ``--max_shard_size``), which transformers and vLLM load; a LoRA run's
  adapted weights are written merged, W + (alpha/r) A B (`export_pretrained`);
* ``peft`` (LoRA runs): ``adapter_model.safetensors`` and ``adapter_config.json``, for
  ``peft.PeftModel.from_pretrained`` (or vLLM's LoRA loader) on the base; with
  ``lora.train_router`` the trained routers too, as PEFT's ``modules_to_save``
  (``mlp.gate``), so that the adapter on its base is the trained model. Its
  ``base_model_name_or_path`` names ``model.pretrained`` when RL trained on it as it is
  (no warm start, no quantized base), and is null otherwise;
* ``base`` (LoRA runs): the frozen base alone, in the layout of ``merged``: the model the
  ``peft`` adapters load onto when the base is not a Hugging Face checkpoint already
  (a warm start, the seed's initialisation, a quantized base: its dequantized values).

With ``config.tokenizer`` a directory, its tokenizer files are copied beside the
weights of ``merged`` and ``base``. Prints one JSON object (``workdir``, ``restored``,
``format``, ``out``, ``files``). A config, checkpoint or file error is printed in one
message, exit status 2 for the config, else 1.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from typing import Any, Sequence

import ml_collections

FORMATS = ("merged", "peft", "base")
EXPORT_RECORD = "gspo_jax_export.json"  # what an export wrote into --out (`check_out`)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def export_run(
    c: ml_collections.ConfigDict,
    workdir: str,
    out: str,
    *,
    format: str = "merged",
    dtype: str | None = None,
    max_shard_size: str = "5GB",
) -> dict[str, Any]:
    """Write the model of the run in ``workdir`` (config ``c``) to ``out`` in
    ``format`` (module docstring); returns what `main` prints."""
    from flax import nnx

    from gspo_jax import config as config_lib
    from gspo_jax.evaluate import open_workdir, restore_params
    from gspo_jax.models import export_peft, export_pretrained, lora, quantized

    if format not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {format!r}")
    if format != "merged" and not c.lora.rank:
        raise config_lib.ConfigError(
            f"--format={format} exports LoRA adapters or their base, but the run trains "
            "every parameter (config.lora.rank=0): export it with --format=merged"
        )
    workdir, out = os.path.abspath(workdir), os.path.abspath(out)
    earlier = check_out(out, workdir, format)  # before anything is built or restored
    trainer, tmp = open_workdir(copy.deepcopy(c), workdir)
    try:
        params, restored = restore_params(trainer)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    model, lc, cfg = nnx.merge(trainer.graphdef, params), trainer.cfg.lora, trainer.cfg
    quantized.dequantize_base(model)  # a quantized base (lora.base_quantization) in f32
    for name in earlier:  # the files of the earlier export this one replaces
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    record = {"format": format, "workdir": workdir, "restored": restored}
    _write_record(out, {**record, "complete": False, "files": []})
    if format == "peft":
        # The base's name: the Hugging Face checkpoint, when RL trained on it as it is
        # (no warm start, no quantized base); otherwise `--format=base` writes it.
        # Trained routers travel in the adapter (modules_to_save).
        exact = cfg.sft.steps == 0 and lc.base_quantization == "none"
        base = cfg.model.pretrained if exact else ""
        files = export_peft(
            model,
            out,
            lc,
            dtype=dtype or "float32",
            base_model_name_or_path=base or None,
            routers=lc.train_router,
        )
    else:
        if format == "base":
            lora.without_adapters(model)
        kw = dict(lora=lc) if lc.rank and format == "merged" else {}
        files = export_pretrained(model, out, dtype=dtype, max_shard_size=max_shard_size, **kw)
        if cfg.tokenizer != "char":
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(cfg.tokenizer, name)):
                    shutil.copyfile(os.path.join(cfg.tokenizer, name), os.path.join(out, name))
    written = sorted(set(os.listdir(out)) - {EXPORT_RECORD})
    _write_record(out, {**record, "complete": True, "files": written})
    return {"workdir": workdir, "restored": restored, "format": format, "out": out, "files": files}


def _write_record(out: str, record: dict[str, Any]) -> None:
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, EXPORT_RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(out, EXPORT_RECORD))


def check_out(out: str, workdir: str, format: str) -> list[str]:
    """Where an export may write: a new or empty folder, or one an earlier export of the
    same format wrote (its `EXPORT_RECORD` says which files it holds: they are
    replaced). Never the run's workdir, a folder holding it, or any other folder with
    files in it (a run's ``config.json`` would be overwritten; a merged model and a PEFT
    adapter in one folder load in transformers as the adapters applied twice). Returns
    the earlier export's files; raises FileExistsError naming the folder otherwise."""
    real_out, real_work = os.path.realpath(out), os.path.realpath(workdir)
    if real_work == real_out or real_work.startswith(real_out + os.sep):
        raise FileExistsError(
            f"--out={out} is the run's workdir or holds it: an export writes config.json "
            f"and weights, which would replace the run's own; export into a folder of its "
            f"own (for example {os.path.join(workdir, 'hf')}). Nothing was written"
        )
    if not os.path.exists(out):
        return []
    if not os.path.isdir(out):
        raise FileExistsError(f"--out={out} is a file, not a folder. Nothing was written")
    present = sorted(os.listdir(out))
    if not present:
        return []
    try:
        with open(os.path.join(out, EXPORT_RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("files"), list):
        shown = ", ".join(present[:5]) + (
            f" and {len(present) - 5} more" if len(present) > 5 else ""
        )
        raise FileExistsError(
            f"--out={out} is not empty ({shown}) and no export of ours wrote it: export into "
            "a new or empty folder. Nothing was written"
        )
    if record.get("format") != format:
        raise FileExistsError(
            f"--out={out} holds a --format={record.get('format')} export; a --format={format} "
            "one beside it would load as one model (transformers, with peft installed, "
            "applies an adapter_config.json it finds onto the merged weights): export into "
            "another folder. Nothing was written"
        )
    if not record.get("complete"):  # it stopped midway: all it left is its own
        return [f for f in present if f != EXPORT_RECORD]
    return [str(f) for f in record["files"]]


def main(argv: Sequence[str]) -> None:
    from gspo_jax.checkpoint import SourceChanged
    from gspo_jax.evaluate import run_command

    del argv
    result = run_command(
        lambda f: export_run(
            f.config,
            f.workdir,
            f.out,
            format=f.format,
            dtype=f.dtype or None,
            max_shard_size=f.max_shard_size,
        ),
        {"workdir": "the run's", "out": "the folder to write"},
        (OSError, ValueError, SourceChanged),
    )
    print(json.dumps(result, indent=2, sort_keys=True), flush=True)


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "The run's config file (configs/*.py[:arg]).", lock_config=True
    )
    flags.DEFINE_string("workdir", "", "The run's workdir.")
    flags.DEFINE_string("out", "", "The folder to write.")
    flags.DEFINE_enum("format", "merged", list(FORMATS), "merged, peft (LoRA) or base (LoRA).")
    flags.DEFINE_string("dtype", "", "The files' dtype (default: the parameters').")
    flags.DEFINE_string("max_shard_size", "5GB", "Bytes per weight file (merged, base).")


if __name__ == "__main__":
    from absl import app

    from gspo_jax.train import _parse_flags

    _define_flags()
    sys.exit(app.run(main, flags_parser=_parse_flags))
