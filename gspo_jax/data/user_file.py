"""A user's own prompts and reference answers from a JSONL or Parquet file (task "file").

Rows: one JSON object per line (``.jsonl``; a UTF-8 BOM is allowed, blank lines are
skipped) or one Parquet row (``.parquet``, read with ``pyarrow``: ``pip install
pyarrow`` or the ``parquet`` extra). A row number in a message is the 1-based line
number of a JSONL file, or the 1-based row of a Parquet file.

Columns (names set in ``config.task``):

* ``prompt_column`` (default ``"prompt"``): the prompt text, used verbatim (the
  ``task.style`` templates are for the built-in tasks only). A pretrained model's
  tokenizer wraps it as one user message in its chat template.
* ``messages_column`` (default ``""``, off): when set, it replaces the prompt column;
  the row holds a non-empty list of ``{"role": str, "content": str}``. A tokenizer with
  a chat template renders the list (and the generation prompt); the character
  tokenizer reads the contents joined by newlines.
* ``answer_column`` (default ``"answer"``): the reference answer the verifier
  compares with, a string or a number. With verifier ``countdown`` it is the target
  integer and the row also needs ``numbers``, a list of positive integers.
* ``solution_column`` (default ``""``, none): the completion the supervised warm
  start trains on, verbatim; ``sft.steps > 0`` needs it.

A row is bad when it is not a JSON object (or not valid JSON or UTF-8), lacks a
column, holds the wrong type, has an empty prompt, or holds a reference the verifier
cannot read (``numeric`` needs a plain number). With ``bad_rows="skip"`` each bad row
is logged once, as ``<file>: row <n>: <what is wrong>``, and left out; with
``"refuse"`` the first raises ValueError with that message. All rows are checked before
the dataset is prepared, so no bad row reaches a running training loop.

Splits: with ``test_file`` set, it is the test split and ``file`` the train split;
otherwise a held-out ``test_fraction`` of the valid rows of ``file`` (``round(fraction
* n)``, at least 1, chosen by a fixed seeded permutation that does not depend on
``config.seed``, so the test set is the same for every run on the file) is the test
split, the rest the train split. Both keep file order.

Preparation: like the other tasks, the checked rows are prepared as a TFDS dataset
(:class:`GspoUserFile`, array_record) under ``task.data_dir``, with a config named
after a hash of the file contents and every ``FileTask`` setting: an unchanged file
and settings reuse the prepared dataset (the file is then only hashed, not checked
again, and its bad rows not reported again); a changed file or setting prepares a new
one. Batches come from :class:`~gspo_jax.data.PromptSource` with the same position ->
example rule as every other task. The whole row is kept as JSON for plug-in reward
functions (a Parquet value JSON cannot hold, such as a date, as its ``str``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from gspo_jax import verifiers
from gspo_jax.data import prompts

BAD_ROWS = ("skip", "refuse")
EXTENSIONS = (".jsonl", ".parquet")
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FileTask:
    """The ``config.task`` fields of task "file" (see the module docstring)."""

    file: str
    test_file: str = ""
    test_fraction: float = 0.1
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    messages_column: str = ""
    solution_column: str = ""
    verifier: str = "numeric"
    bad_rows: str = "skip"

    @classmethod
    def from_config(cls, task) -> FileTask:
        return cls(**{f.name: task[f.name] for f in dataclasses.fields(cls)})


class BadRow(ValueError):
    """A row that cannot be used; the message names the file and the row."""


def _read_jsonl(path: str) -> list[tuple[int, Any]]:
    """(line number, decoded row or an error message) per non-blank line."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.append((lineno, f"not UTF-8 ({e.reason} at byte {e.start})"))
                continue
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                out.append((lineno, f"invalid JSON ({e.msg} at column {e.colno})"))
    return out


def _read_parquet(path: str) -> list[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path!r} needs pyarrow: pip install pyarrow (or the 'parquet' extra)"
        ) from None
    return list(enumerate(pq.read_table(path).to_pylist(), 1))


def read_rows(path: str) -> list[tuple[int, Any]]:
    """(row number, row or error string) of each row of a .jsonl or .parquet file."""
    _check_path(path)
    return _read_jsonl(path) if path.endswith(".jsonl") else _read_parquet(path)


def _column(row: dict, name: str) -> Any:
    if name not in row:
        raise BadRow(f"missing column {name!r}")
    return row[name]


def _string(row: dict, name: str) -> str:
    v = _column(row, name)
    if not isinstance(v, str):
        raise BadRow(f"column {name!r} must be a string, got {type(v).__name__}")
    if not v.strip():
        raise BadRow(f"column {name!r} is empty")
    return v


def _messages(row: dict, name: str) -> tuple[dict[str, str], ...]:
    v = _column(row, name)
    if not isinstance(v, (list, tuple)) or not v:
        raise BadRow(f"column {name!r} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise BadRow(f"column {name!r}: message {i} is not a {{role: str, content: str}}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in out):
        raise BadRow(f"column {name!r}: every message is empty")
    return tuple(out)


def _answer(row: dict, name: str) -> str | int:
    v = _column(row, name)
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise BadRow(f"column {name!r} must be a string or a number, got {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v):
        raise BadRow(f"column {name!r} is {v}")
    return v


def to_example(row: Any, spec: FileTask, index: int) -> prompts.Example:
    """One row as an Example; raises BadRow saying what is wrong."""
    if not isinstance(row, dict):
        raise BadRow(f"not a JSON object (got {type(row).__name__})")
    messages = None
    if spec.messages_column:
        messages = _messages(row, spec.messages_column)
        prompt = "\n".join(m["content"] for m in messages)
    else:
        prompt = _string(row, spec.prompt_column)
    answer = _answer(row, spec.answer_column)
    meta: dict[str, Any] = {"verifier": spec.verifier, "answer": str(answer), "row": row}
    if spec.verifier == "countdown":
        meta["target"] = answer
        meta["numbers"] = row.get("numbers")
    problem = verifiers.get(spec.verifier).reference_problem(meta)  # None for a plug-in
    if problem:
        raise BadRow(problem)
    if spec.verifier == "countdown":
        meta["numbers"] = tuple(meta["numbers"])
    reference = _string(row, spec.solution_column) if spec.solution_column else None
    return prompts.Example("file", prompt, meta, reference, index, messages)


def _examples(path: str, spec: FileTask) -> list[prompts.Example]:
    """The valid rows of ``path``; bad ones logged and skipped, or refused."""
    out, bad = [], 0
    for rowno, row in read_rows(path):
        try:
            if isinstance(row, str):  # a read error
                raise BadRow(row)
            out.append(to_example(row, spec, len(out)))
        except BadRow as e:
            msg = f"{path}: row {rowno}: {e}"
            if spec.bad_rows == "refuse":
                raise ValueError(f"{msg} (config.task.bad_rows='refuse')") from None
            _log.warning("skipping bad row: %s", msg)
            bad += 1
    if bad:
        _log.warning("%s: skipped %d bad row(s), kept %d", path, bad, len(out))
    if not out:
        raise ValueError(f"{path}: no valid rows")
    return out


def _splits(spec: FileTask) -> dict[str, list[prompts.Example]]:
    """The train and test examples, every row checked (bad ones reported) first."""
    train = _examples(spec.file, spec)
    if spec.test_file:
        return {"train": train, "test": _examples(spec.test_file, spec)}
    n = len(train)
    k = max(1, round(spec.test_fraction * n))
    if n - k < 1:
        raise ValueError(
            f"{spec.file}: {n} valid row(s) cannot be split into train and a test "
            f"fraction of {spec.test_fraction}; add rows or set config.task.test_file"
        )
    held = np.zeros(n, bool)
    held[np.random.RandomState(0).permutation(n)[:k]] = True
    return {
        "train": [ex for ex, h in zip(train, held) if not h],
        "test": [ex for ex, h in zip(train, held) if h],
    }


def _check_path(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path!r}")
    if not path.endswith(EXTENSIONS):
        raise ValueError(f"{path!r}: the file must end in one of {EXTENSIONS}")
    return path


def config_name(spec: FileTask) -> str:
    """The TFDS config name of ``spec``: a hash of the file contents and every setting,
    so a changed file or setting prepares a new dataset instead of reusing a stale one."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode())
    for path in filter(None, (spec.file, spec.test_file)):
        with open(_check_path(path), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return "sha256_" + h.hexdigest()[:24]


class GspoUserFile(tfds.core.GeneratorBasedBuilder):
    """TFDS builder of a user's checked rows (one config per file contents and settings).

    Features: ``prompt``; ``messages`` (JSON list, or "" without a messages column);
    ``solution`` ("" without a solution column); ``meta`` (the verifier's metadata as
    JSON, with the whole row for plug-in reward functions).
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def __init__(self, *, spec: FileTask, data_dir: str):
        self.rows: dict[str, list[prompts.Example]] = {}  # set by prepare()
        config = tfds.core.BuilderConfig(name=config_name(spec), description=spec.file)
        super().__init__(data_dir=data_dir, config=config)

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {"prompt": text, "messages": text, "solution": text, "meta": text}
            ),
            supervised_keys=None,
            disable_shuffling=True,  # File order.
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # The rows were read and checked before preparation.
        return {split: self._generate_examples(exs) for split, exs in self.rows.items()}

    def _generate_examples(self, examples):
        for i, ex in enumerate(examples):
            yield (
                i,
                {
                    "prompt": ex.prompt,
                    "messages": json.dumps(ex.messages) if ex.messages else "",
                    "solution": ex.reference or "",
                    "meta": json.dumps(ex.meta, default=str),
                },
            )


def prepare(spec: FileTask, data_dir: os.PathLike | str) -> GspoUserFile:
    """The prepared builder of ``spec`` under ``data_dir``; the files are read, their
    rows checked and bad rows reported only when that dataset is not prepared yet."""
    if spec.bad_rows not in BAD_ROWS:
        raise ValueError(f"bad_rows must be one of {BAD_ROWS}, got {spec.bad_rows!r}")
    builder = GspoUserFile(spec=spec, data_dir=os.fspath(data_dir))
    if not builder.is_prepared():
        builder.rows = _splits(spec)
        builder.download_and_prepare(file_format="array_record")
    return builder


def from_record(record: dict[str, Any], index: int) -> prompts.Example:
    """A decoded TFDS record of :class:`GspoUserFile` as an Example."""
    text = {k: v.decode("utf-8") if isinstance(v, bytes) else str(v) for k, v in record.items()}
    meta = json.loads(text["meta"])
    if "numbers" in meta:
        meta["numbers"] = tuple(meta["numbers"])
    messages = tuple(json.loads(text["messages"])) if text["messages"] else None
    return prompts.Example("file", text["prompt"], meta, text["solution"] or None, index, messages)


def load_split(spec: FileTask, split: str, data_dir: os.PathLike | str) -> list[prompts.Example]:
    """All examples of ``split`` ("train" or "test"), prepared under ``data_dir``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test' for task 'file', got {split!r}")
    ds = prepare(spec, data_dir).as_data_source(split)
    return [from_record(ds[i], i) for i in range(len(ds))]
