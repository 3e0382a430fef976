"""Task "file": a user's own prompts and reference answers from a JSONL or Parquet file.

Reward: each row is scored by the verifier ``config.task.verifier`` names
(:mod:`gspo_jax.verifiers`, or a plug-in ``module:function``,
:mod:`gspo_jax.reward_plugins`). The prompts are the file's own, so the task has no
prompt styles and no difficulty levels.

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
column, holds the wrong type, has an empty prompt, holds a value Python cannot read (an
integer of more than 4300 digits, values nested more than ``MAX_DEPTH`` levels) or a
reference the verifier cannot read (``numeric`` needs a plain number), or, in a run,
has a prompt (or solution) the run's tokenizer cannot encode or a prompt longer than
``rollout.max_prompt_len`` that ``rollout.long_prompts="refuse"`` would refuse (the
trainer passes its :class:`~gspo_jax.data.encoding.PromptCheck`). Every row is checked
before the dataset is prepared, and the bad ones are reported in one message, one
``<file>: row <n>: <what is wrong>`` a line (the first ``MAX_LISTED``, then a count):
with ``bad_rows="skip"`` as a warning, and left out; with ``"refuse"`` as a ValueError.
So no bad row reaches a running training loop.

Duplicates: rows whose prompts are the same (as the model reads them, each run of
whitespace one space; the messages with their roles for a messages column) are kept
once, the first in the file, and the others counted and named in one line; with a
``test_file``, a row of ``file`` whose prompt is in the test file is left out of
training. So no prompt is in both splits.

Splits: with ``test_file`` set, it is the test split and ``file`` the train split;
otherwise a row is held out for the test split when the hash of its prompt
(:func:`prompt_key`, read as a number in [0, 1)) is below ``test_fraction``: about that
fraction of the rows, the same for every run and seed, and a row's split depends on its
prompt alone. A row edited, added or removed between runs moves no other row between
the splits (an edit to a row's prompt may move that row; a fixed answer does not). In a
file so small that no row's hash is below the fraction, the row of the lowest hash is
held out (and of the highest trains, where every one is below). Both splits keep file
order; evaluation scores the first ``task.eval_size`` of the test split.

Changes between runs: each prepared dataset keeps a hash of every row of each split
(``row_keys.json``); when ``file`` is prepared again in the same data dir with other
rows in use (edited, or a setting or the tokenizer changed which rows are usable), one
warning says how many rows each split gained, lost and had edited.

Preparation: the checked rows are prepared as a TFDS dataset (``gspo_user_file``,
array_record) under ``task.data_dir`` (:mod:`gspo_jax.tasks.data_dir`: the lock,
read-only data dirs; TFDS is imported only for this task), with a config named after a
hash of the file contents and every ``FileTask`` setting: an unchanged file and settings
reuse the prepared dataset (the file is then only hashed, not checked again, and its bad
rows not reported again); a changed file or setting prepares a new one. Batches come
from :class:`~gspo_jax.data.PromptSource` with the same position -> example rule as
every other task. The whole row is kept as JSON for plug-in reward functions (a Parquet
value JSON cannot hold, such as a date, as its ``str``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
from typing import Any, Mapping

from gspo_jax import reward_plugins, tasks, verifiers
from gspo_jax.answers import Limits, Verdict
from gspo_jax.tasks import TaskConfigError, prompts
from gspo_jax.tasks import data_dir as data_dir_lib

BAD_ROWS = ("skip", "refuse")
EXTENSIONS = (".jsonl", ".parquet")
MAX_DEPTH = 64  # nesting levels of a row's values (deeper ones break json's recursion)
MAX_LISTED = 20  # rows named in one report; the rest are counted
ROW_KEYS = "row_keys.json"  # each prepared split's prompts and rows, hashed
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
        """From ``config.task`` (the config dict or its typed `TaskConfig`)."""
        return cls(**{f.name: getattr(task, f.name) for f in dataclasses.fields(cls)})


class BadRow(ValueError):
    """A row that cannot be used; the message names the file and the row."""


# A valid JSON value that is no object, by its JSON type (as a user wrote it).
_JSON_TYPES = {str: "string", int: "number", float: "number", list: "array", bool: "boolean"}


def _json_type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _read_jsonl(path: str) -> list[tuple[int, Any]]:
    """(line number, decoded row or the `BadRow` that says why it cannot be read) per
    non-blank line. A read error is a `BadRow`, never a string: a line that is a JSON
    string is a row (a bad one), not its own error message."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.append((lineno, BadRow(f"not UTF-8 ({e.reason} at byte {e.start})")))
                continue
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                out.append((lineno, BadRow(f"invalid JSON ({e.msg} at column {e.colno})")))
            except RecursionError:
                out.append((lineno, BadRow(f"a value nested more than {MAX_DEPTH} levels deep")))
            except ValueError as e:  # Python's limit on an integer's digits
                out.append((lineno, BadRow(f"unreadable value: {str(e).split(';')[0]}")))
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
    """(row number, row or the `BadRow` it cannot be read for) of each row of a .jsonl
    or .parquet file."""
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


def _nesting(value: Any) -> int:
    """How many levels of lists and objects ``value`` holds (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list, tuple)) and depth <= MAX_DEPTH + 1:
            deepest = max(deepest, depth)
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def to_example(row: Any, spec: FileTask, index: int) -> prompts.Example:
    """One row as an Example; raises BadRow saying what is wrong."""
    if not isinstance(row, dict):
        raise BadRow(f"not a JSON object (got {_json_type(row)})")
    if _nesting(row) > MAX_DEPTH:
        raise BadRow(f"a value nested more than {MAX_DEPTH} levels deep")
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
    try:
        problem = verifiers.get(spec.verifier).reference_problem(meta)  # None for a plug-in
    except ValueError as e:  # e.g. Python's limit on an integer's digits
        problem = f"column {spec.answer_column!r}: unreadable value: {str(e).split(';')[0]}"
    if problem:
        raise BadRow(problem)
    if spec.verifier == "countdown":
        meta["numbers"] = tuple(meta["numbers"])
    reference = _string(row, spec.solution_column) if spec.solution_column else None
    return prompts.Example("file", prompt, meta, reference, index, messages)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def _listed(items: list[str]) -> str:
    """The first `MAX_LISTED` of ``items``, one a line, and how many more there are."""
    more = [f"… and {len(items) - MAX_LISTED} more"] if len(items) > MAX_LISTED else []
    return "".join(f"\n  {x}" for x in items[:MAX_LISTED] + more)


def _examples(path: str, spec: FileTask, check=None) -> list[tuple[int, prompts.Example]]:
    """(row number, Example) of the valid rows of ``path``. ``check``: a
    :class:`~gspo_jax.data.encoding.PromptCheck`, the run's tokenizer and prompt length,
    that every prompt must pass. The bad rows are reported in one message, then left
    out (``bad_rows="skip"``) or refused."""
    out, bad = [], []
    for rowno, row in read_rows(path):
        try:
            if isinstance(row, BadRow):  # a read error
                raise row
            ex = to_example(row, spec, len(out))
            problem = check and check.problem(ex.prompt, ex.messages, ex.reference)
            if problem:
                raise BadRow(problem)
            out.append((rowno, ex))
        except BadRow as e:
            bad.append(f"{path}: row {rowno}: {_clip(str(e))}")
    if bad and spec.bad_rows == "refuse":
        raise ValueError(
            f"{path}: {len(bad)} bad row(s) (config.task.bad_rows='refuse'; 'skip' leaves "
            f"them out):{_listed(bad)}"
        )
    if bad:
        _log.warning(
            "skipping %d bad row(s) of %s, kept %d:%s", len(bad), path, len(out), _listed(bad)
        )
    if not out:
        raise ValueError(f"{path}: no valid rows")
    return out


def prompt_key(ex: prompts.Example) -> str:
    """A hash of the prompt as the model reads it (each run of whitespace one space):
    rows with the same key are duplicates, and the key decides a row's split."""
    if ex.messages:
        text = json.dumps([[m["role"], " ".join(m["content"].split())] for m in ex.messages])
    else:
        text = " ".join(ex.prompt.split())
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _held_out(key: str, fraction: float) -> bool:
    return int(key, 16) / 16 ** len(key) < fraction


def _once(path: str, rows: list, seen: dict[str, str]) -> list[tuple[int, prompts.Example]]:
    """``rows`` without those whose prompt is in ``seen`` (prompt key -> where it was
    first) or repeats an earlier row; what was left out is reported in one line."""
    kept, repeats = [], []
    for rowno, ex in rows:
        key = prompt_key(ex)
        if key in seen:
            repeats.append(f"row {rowno} (as {seen[key]})")
        else:
            seen[key] = f"row {rowno}"
            kept.append((rowno, ex))
    if repeats:
        _log.warning(
            "%s: %d row(s) repeat the prompt of an earlier row, kept once (a prompt is in one "
            "split only):%s",
            path,
            len(repeats),
            _listed(repeats),
        )
    return kept


def _splits(spec: FileTask, check=None) -> dict[str, list[prompts.Example]]:
    """The train and test examples, every row checked (bad ones reported) first.

    Each distinct prompt is kept once, in one split. Without a test file a row is held
    out when the hash of its prompt (`prompt_key`, read as a number in [0, 1)) is below
    ``test_fraction``: an edited, added or removed row moves no other row between the
    splits."""
    rows = _examples(spec.file, spec, check)
    if spec.test_file:
        seen: dict[str, str] = {}
        test = _once(spec.test_file, _examples(spec.test_file, spec, check), seen)
        seen = {key: f"{spec.test_file} {where}" for key, where in seen.items()}
        train = _once(spec.file, rows, seen)
        if not train:
            raise ValueError(f"{spec.file}: every prompt is also in {spec.test_file}")
    else:
        rows = _once(spec.file, rows, {})
        held = [_held_out(prompt_key(ex), spec.test_fraction) for _, ex in rows]
        if len(rows) < 2:
            raise ValueError(
                f"{spec.file}: {len(rows)} distinct valid row(s) cannot be split into train "
                "and test; add rows or set config.task.test_file"
            )
        ranked = sorted(range(len(rows)), key=lambda i: prompt_key(rows[i][1]))
        if not any(held):  # a file too small for the fraction: the lowest hash is held out
            held[ranked[0]] = True
        if all(held):  # and the highest trains
            held[ranked[-1]] = False
        test = [r for r, h in zip(rows, held) if h]
        train = [r for r, h in zip(rows, held) if not h]
    return {"train": [ex for _, ex in train], "test": [ex for _, ex in test]}


def _row_keys(rows: dict[str, list[prompts.Example]]) -> dict[str, dict[str, str]]:
    """Per split, each row's prompt key -> a hash of the whole row (to tell edits)."""

    def digest(ex: prompts.Example) -> str:
        whole = json.dumps([ex.prompt, ex.messages, ex.reference, ex.meta], default=str)
        return hashlib.sha256(whole.encode("utf-8")).hexdigest()[:12]

    return {split: {prompt_key(ex): digest(ex) for ex in exs} for split, exs in rows.items()}


def _check_path(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path!r}")
    if not path.endswith(EXTENSIONS):
        raise ValueError(f"{path!r}: the file must end in one of {EXTENSIONS}")
    return path


def config_name(spec: FileTask, check=None) -> str:
    """The TFDS config name of ``spec``: a hash of the file contents, every setting and
    the prompt check (``check.digest()``), so a changed file, setting or tokenizer
    prepares a new dataset instead of reusing a stale one."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode())
    if check is not None:
        h.update(check.digest().encode())
    for path in filter(None, (spec.file, spec.test_file)):
        with open(_check_path(path), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return "sha256_" + h.hexdigest()[:24]


@functools.cache
def _builder_class():
    """The TFDS builder of a user's checked rows, ``gspo_user_file`` (one config per file
    contents and settings), made on first use: TFDS is imported only for this task.

    Features: ``prompt``; ``messages`` (JSON list, or "" without a messages column);
    ``solution`` ("" without a solution column); ``meta`` (the verifier's metadata as
    JSON, with the whole row for plug-in reward functions).
    """
    tfds = data_dir_lib.tfds()

    class GspoUserFile(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("2.0.0")
        RELEASE_NOTES = {
            "1.0.0": "Initial release.",
            "2.0.0": "Rows split by a hash of their prompt, each prompt kept once; prompts "
            "checked with the run's tokenizer and prompt length.",
        }

        def __init__(self, *, spec: FileTask, data_dir: str, check=None):
            self.rows: dict[str, list[prompts.Example]] = {}  # set by prepare()
            config = tfds.core.BuilderConfig(name=config_name(spec, check), description=spec.file)
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

    return GspoUserFile


def prepare(spec: FileTask, data_dir: os.PathLike | str, prompt_check=None):
    """The prepared builder of ``spec`` under ``data_dir``; the files are read, their
    rows checked (with ``prompt_check``, a :class:`~gspo_jax.data.encoding.PromptCheck`,
    where given) and bad rows reported only when that dataset is not prepared yet."""
    if spec.bad_rows not in BAD_ROWS:
        raise ValueError(f"bad_rows must be one of {BAD_ROWS}, got {spec.bad_rows!r}")

    def make():
        return _builder_class()(spec=spec, data_dir=os.fspath(data_dir), check=prompt_check)

    builder = make()
    with data_dir_lib.prepare_lock(builder):
        builder = data_dir_lib.current(builder, make)
        if not builder.is_prepared():
            builder.rows = _splits(spec, prompt_check)
            builder.download_and_prepare(file_format="array_record")
            _write_json(os.path.join(builder.data_dir, ROW_KEYS), _row_keys(builder.rows))
    _note_change(spec, builder)
    return builder


def _write_json(path: str, value: Any) -> None:
    """``value`` to ``path`` atomically; a data dir that cannot be written is left as is
    (what is written here serves only the notice of `_note_change`)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError as e:
        _log.debug("not written: %s (%s)", path, e)


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _changes(before: dict, after: dict) -> list[str]:
    """What differs between two `_row_keys` records, per split (empty when nothing)."""
    out = []
    for split in ("train", "test"):
        old, new = before.get(split, {}), after.get(split, {})
        added, removed = len(new.keys() - old.keys()), len(old.keys() - new.keys())
        edited = sum(old[k] != new[k] for k in old.keys() & new.keys())
        if added or removed or edited:
            out.append(f"{split}: {added} row(s) added, {removed} removed, {edited} edited")
    moved = len(before.get("test", {}).keys() & after.get("train", {}).keys())
    moved += len(before.get("train", {}).keys() & after.get("test", {}).keys())
    if moved:
        out.append(f"{moved} row(s) moved between the splits")
    return out


def _note_change(spec: FileTask, builder) -> None:
    """One notice when the rows in use differ from the last preparation of ``spec.file``
    in this data dir (the file edited between runs, or a setting or tokenizer changed
    which rows are usable): rows added, removed and edited, per split."""
    configs = os.path.dirname(os.path.dirname(builder.data_dir))
    name = hashlib.sha256(os.path.abspath(spec.file).encode()).hexdigest()[:16]
    pointer = os.path.join(configs, ".last_prepared", name + ".json")
    keys = os.path.join(builder.data_dir, ROW_KEYS)
    last = _read_json(pointer)
    if last == keys:
        return
    before, after = _read_json(last) if isinstance(last, str) else None, _read_json(keys)
    changes = _changes(before, after) if before and after else []
    if changes:
        _log.warning(
            "%s: the rows in use differ from its last preparation here (%s): %s; every "
            "other row keeps its split",
            spec.file,
            os.path.relpath(os.path.dirname(last), configs),
            "; ".join(changes),
        )
    _write_json(pointer, keys)


def load_split(
    spec: FileTask, split: str, data_dir: os.PathLike | str, prompt_check=None
) -> list[prompts.Example]:
    """All examples of ``split`` ("train" or "test"), prepared under ``data_dir``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test' for task 'file', got {split!r}")
    ds = prepare(spec, data_dir, prompt_check).as_data_source(split)
    return [from_record(ds[i], i) for i in range(len(ds))]


def from_record(record: dict[str, Any], index: int) -> prompts.Example:
    """A decoded TFDS record of a prepared user's file as an Example."""
    text = {k: v.decode("utf-8") if isinstance(v, bytes) else str(v) for k, v in record.items()}
    meta = json.loads(text["meta"])
    if "numbers" in meta:
        meta["numbers"] = tuple(meta["numbers"])
    messages = tuple(json.loads(text["messages"])) if text["messages"] else None
    return prompts.Example("file", text["prompt"], meta, text["solution"] or None, index, messages)


# ---------------------------------------------------------------------------
# The task record.


def _check_meta(meta: Mapping[str, Any]) -> None:
    if not isinstance(meta.get("verifier"), str) or "answer" not in meta:
        raise ValueError(f"file meta needs 'verifier' and 'answer', got keys {sorted(meta)}")
    verifiers.get(meta["verifier"])


def _verify(text: str, meta: Mapping[str, Any], limits: Limits) -> Verdict:
    return verifiers.get(meta["verifier"]).verify(text, meta, limits)


def _check_config(c) -> None:
    """The fields that make a user's file usable (the file is read later)."""
    t = c.task
    if not t.file:
        raise TaskConfigError(
            "task.file", "task 'file' needs the path of a .jsonl or .parquet file"
        )
    for path in ("file", "test_file"):
        value = getattr(t, path)
        if value and not value.endswith((".jsonl", ".parquet")):
            raise TaskConfigError(f"task.{path}", f"must end in .jsonl or .parquet, got {value!r}")
    if not t.test_file and not t.test_fraction > 0:
        raise TaskConfigError(
            "task.test_fraction", "must be > 0 without task.test_file (the test split)"
        )
    if not t.messages_column and not t.prompt_column:
        raise TaskConfigError(
            "task.prompt_column", "must name a column (or set task.messages_column)"
        )
    if not t.answer_column:
        raise TaskConfigError("task.answer_column", "must name a column")
    if int(c.sft.steps) > 0 and not t.solution_column:
        raise TaskConfigError(
            "task.solution_column",
            f"the warm start (sft.steps={c.sft.steps}) trains on reference solutions: "
            "name the column holding them, or set sft.steps=0",
        )
    if reward_plugins.is_reward_fn(t.verifier):
        try:
            reward_plugins.load_reward_fn(t.verifier)
        except ValueError as e:
            raise TaskConfigError("task.verifier", " ".join(str(e).split())) from None
    elif t.verifier not in verifiers.names():
        raise TaskConfigError(
            "task.verifier",
            f"unknown verifier {t.verifier!r}; known: {verifiers.names()} or 'module:function'",
        )


TASK = tasks.register(
    tasks.Task(
        name="file",
        prepare=lambda data_dir, file_task, prompt_check=None: prepare(
            file_task, data_dir, prompt_check
        ),
        example=lambda record, index, style: from_record(record, index),
        check_meta=_check_meta,
        verify=_verify,
        options=lambda task_config: {"file_task": FileTask.from_config(task_config)},
        check_config=_check_config,
        answer_kind=lambda task_config: verifiers.get(task_config.verifier).answer_kind,
    )
)
