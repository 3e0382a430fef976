"""Task "gsm8k": grade-school word problems (Cobbe et al., 2021).

Examples: TFDS's own ``gsm8k`` builder, prepared on disk under the data dir
(:mod:`gspo_jax.tasks.data_dir`: TFDS is imported only when this task is used). With
network access, ``prepare_gsm8k(data_dir)`` lets TFDS download the four jsonl files of
openai/grade-school-math and prepare them. Without network, supply the files: put
``train.jsonl``, ``test.jsonl``, ``train_socratic.jsonl`` and ``test_socratic.jsonl``
(from the repository's ``grade_school_math/data/``) in a folder and call
``prepare_gsm8k(data_dir, files_dir=folder)`` (``config.task.gsm8k_files``). The files
are placed in TFDS's download cache exactly as its download manager leaves a finished
download (file named from the URL, ``.INFO`` file beside it); the real builder and
download manager then run unchanged and find them cached. The cache check is TFDS's
own, so nothing is patched.

Each jsonl line is ``{"question": ..., "answer": "...#### 72"}``; the builder splits the
answer into ``annotation`` and ``short_answer``. Supplied files are checked line by line
before anything is prepared (:func:`read_gsm8k_file`): a UTF-8 BOM and blank lines are
accepted, anything the builder or the verifier could not read is a ValueError naming the
file and line. The cache gets a normalised copy (one ASCII JSON object per line, only
``question`` and ``answer``), so the builder reads exactly what was checked.

Reward: the answer is a number, read and compared exactly by
:func:`gspo_jax.answers.verify_numeric`. The warm start trains on the worked solutions.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from typing import Any, Mapping

from etils import epath

from gspo_jax import tasks
from gspo_jax.answers import ANSWER_CLOSE, ANSWER_OPEN, REFERENCE_LIMITS, parse_number
from gspo_jax.tasks import data_dir as data_dir_lib
from gspo_jax.tasks import prompts

SPLITS = ("train", "test", "train_socratic", "test_socratic")


def gsm8k_urls() -> dict[str, str]:
    """The URLs the TFDS builder downloads, by split."""
    data_dir_lib.tfds()
    from tensorflow_datasets.text.gsm8k import gsm8k as tfds_gsm8k

    return dict(tfds_gsm8k._URLS)  # pylint: disable=protected-access


def read_gsm8k_file(path: os.PathLike | str) -> list[dict[str, str]]:
    """The examples of one GSM8K jsonl file, every line checked.

    A UTF-8 BOM is stripped and blank lines are skipped. Each other line must be
    a JSON object with a non-empty string ``question`` and a string ``answer``
    holding one ``#### N`` mark, N a plain number (:func:`gspo_jax.answers.parse_number`;
    ``#### 5 apples`` is not). Other fields are dropped.

    Raises:
      ValueError: naming the file, the line number and what is wrong.
    """
    path = epath.Path(path)
    data = path.read_bytes()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    examples = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"GSM8K file {os.fspath(path)!r}, line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
        examples.append(_check_example(example, where))
    return examples


def read_gsm8k_files(files_dir: os.PathLike | str) -> dict[str, list[dict[str, str]]]:
    """:func:`read_gsm8k_file` of ``<files_dir>/<split>.jsonl`` for every split in SPLITS.

    Raises:
      ValueError: naming a missing file, or the file and line of a bad example.
    """
    return {split: read_gsm8k_file(_split_file(files_dir, split)) for split in SPLITS}


def supply_gsm8k_files(files_dir: os.PathLike | str, download_dir: os.PathLike | str) -> None:
    """Places local GSM8K jsonl files in a TFDS download cache, checked
    (:func:`read_gsm8k_files`) and normalised.

    Args:
      files_dir: folder with ``<split>.jsonl`` for every split in SPLITS.
      download_dir: the ``download_dir`` later given to ``download_and_prepare``.

    Raises:
      ValueError: naming the missing file if one is absent, or the file and line
        of a bad example.
    """
    _supply(read_gsm8k_files(files_dir), download_dir)


def _supply(examples: dict[str, list[dict[str, str]]], download_dir: os.PathLike | str) -> None:
    """Writes each split's examples where TFDS's download manager looks for the
    split's URL, as a finished download."""
    data_dir_lib.tfds()
    from tensorflow_datasets.core.download import checksums as tfds_checksums
    from tensorflow_datasets.core.download import resource as tfds_resource

    download_dir = epath.Path(download_dir)
    for split, url in gsm8k_urls().items():
        resource = tfds_resource.Resource(url=url)
        # The path the download manager checks for a URL whose checksum is not
        # registered (gsm8k registers none): <download_dir>/<dataset>/<name(url)>.
        dst = (
            download_dir
            / "gsm8k"
            / resource.relative_download_dir
            / tfds_resource.get_dl_fname(url)
        )
        dst.parent.mkdir(parents=True, exist_ok=True)
        # json.dumps escapes non-ASCII: the builder reads it under any locale.
        dst.write_text("".join(json.dumps(ex) + "\n" for ex in examples[split]), encoding="utf-8")
        info_path = tfds_resource.get_info_path(dst)
        if info_path.exists():
            info_path.unlink()  # A new file replaces a previous supply.
        tfds_resource.write_info_file(
            url=url,
            path=dst,
            dataset_name="gsm8k",
            original_fname=f"{split}.jsonl",
            url_info=tfds_checksums.compute_url_info(dst),
        )


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _check_example(example, where: str) -> dict[str, str]:
    """``{"question", "answer"}`` of one decoded jsonl line; ValueError starting with ``where``."""
    if not isinstance(example, dict):
        raise ValueError(
            f"{where}: expected a JSON object with 'question' and 'answer', "
            f"got {_json_type(example)}"
        )
    for key in ("question", "answer"):
        if key not in example:
            raise ValueError(f"{where}: no {key!r} field (fields: {sorted(example)})")
        if not isinstance(example[key], str):
            raise ValueError(f"{where}: {key!r} must be a string, got {_json_type(example[key])}")
    question, answer = example["question"], example["answer"]
    if not question.strip():
        raise ValueError(f"{where}: 'question' is empty")
    # TFDS's builder splits the answer at its one "#### " into annotation and short answer.
    marks = answer.count("####")
    if marks != 1:
        raise ValueError(
            f"{where}: 'answer' must hold one '#### N' final answer, found {marks} '####': "
            f"{answer[-80:]!r}"
        )
    if "#### " not in answer:
        raise ValueError(
            f"{where}: 'answer' needs a space after '####' ('#### 72'): {answer[-80:]!r}"
        )
    try:
        gsm8k_final_answer(answer)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return {"question": question, "answer": answer}


def gsm8k_final_answer(solution: str) -> str:
    """The ground-truth number of a GSM8K solution: the text after its last
    ``####``, which must be a plain number (:func:`parse_number`; ``#### 5 apples``
    is not), with ``$`` and thousands commas removed.

    Raises:
      ValueError: if the solution has no ``#### N`` line or N is not a plain number.
    """
    head, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError(f"GSM8K answer has no '#### N' line: {solution[-80:]!r}")
    tail = tail.strip()
    if parse_number(tail, REFERENCE_LIMITS) is None:
        raise ValueError(f"GSM8K final answer is not a plain number: {tail!r}")
    return tail.replace(",", "").replace("$", "")


def gsm8k_builder(data_dir: os.PathLike | str):
    """``tfds.builder("gsm8k")`` under ``data_dir``."""
    tfds = data_dir_lib.tfds()
    # Importing the module registers the `gsm8k` builder with tfds.builder(...)
    # (tfds.list_builders() needs TensorFlow; this does not).
    from tensorflow_datasets.text.gsm8k import gsm8k  # noqa: F401

    return tfds.builder("gsm8k", data_dir=os.fspath(data_dir))


def prepare_gsm8k(
    data_dir: os.PathLike | str,
    *,
    files_dir: os.PathLike | str | None = None,
    download_dir: os.PathLike | str | None = None,
) -> Any:
    """Prepares GSM8K as array_record under ``data_dir`` and returns the builder.

    Args:
      data_dir: TFDS data dir.
      files_dir: optional folder with the four jsonl files (no network needed), each
        checked line by line (:func:`read_gsm8k_file`) first. If ``data_dir`` already
        holds GSM8K prepared from different files, ValueError.
      download_dir: TFDS download cache; default ``<data_dir>/downloads``.
    """
    builder = gsm8k_builder(data_dir)
    download_dir = epath.Path(download_dir or epath.Path(data_dir) / "downloads")
    if files_dir is None:
        with data_dir_lib.prepare_lock(builder):
            builder = data_dir_lib.current(builder, lambda: gsm8k_builder(data_dir))
            builder.download_and_prepare(download_dir=download_dir, file_format="array_record")
        return builder
    examples = read_gsm8k_files(files_dir)  # Every line checked before anything else.
    digests = _file_digests(files_dir)
    with data_dir_lib.prepare_lock(builder):
        builder = data_dir_lib.current(builder, lambda: gsm8k_builder(data_dir))
        return _prepare_from_files(builder, examples, digests, files_dir, download_dir)


def _prepare_from_files(builder, examples, digests, files_dir, download_dir):
    record = epath.Path(builder.data_dir) / _SOURCES_FILE
    if builder.is_prepared() and record.exists():
        if json.loads(record.read_text()) != digests:
            raise ValueError(
                f"GSM8K under {os.fspath(builder.data_dir)!r} was prepared from other files than those "
                f"in files_dir {os.fspath(files_dir)!r}; remove that folder to prepare it again, or "
                "use another data_dir"
            )
        return builder
    _supply(examples, download_dir)
    builder.download_and_prepare(download_dir=download_dir, file_format="array_record")
    record.write_text(json.dumps(digests, sort_keys=True))
    return builder


# Beside a GSM8K prepared from supplied files: the sha256 of each file, so that
# other files given later are noticed instead of being silently ignored.
_SOURCES_FILE = "gspo_jax_supplied_files.json"


def _file_digests(files_dir: os.PathLike | str) -> dict[str, str]:
    """sha256 of ``<split>.jsonl`` for every split; ValueError naming a missing file."""
    return {
        split: hashlib.sha256(_split_file(files_dir, split).read_bytes()).hexdigest()
        for split in SPLITS
    }


def _split_file(files_dir: os.PathLike | str, split: str) -> epath.Path:
    """``<files_dir>/<split>.jsonl``; ValueError naming it if it is missing."""
    path = epath.Path(files_dir) / f"{split}.jsonl"
    if not path.exists():
        raise ValueError(
            f"files_dir {os.fspath(files_dir)!r} lacks {split}.jsonl; GSM8K needs "
            f"{', '.join(s + '.jsonl' for s in SPLITS)}"
        )
    return path


# ---------------------------------------------------------------------------
# The task record.


def prompt(question: str, style: str = "compact") -> str:
    """Prompt for a GSM8K word problem."""
    question = question.strip()
    return prompts.in_style(
        style,
        compact=f"{question}\n",
        instruct=(
            f"{question}\nSolve the problem step by step, then give the final number "
            f"inside {ANSWER_OPEN}{ANSWER_CLOSE}, for example {prompts.answer_span('42')}."
        ),
    )


_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")


def reference(annotation: str, answer: str) -> str:
    """Warm-start completion for GSM8K: the worked solution without its
    ``<<48/2=24>>`` calculator annotations, then the answer span."""
    steps = _CALCULATOR_RE.sub("", annotation).strip()
    return f"{steps}\n{prompts.answer_span(answer)}"


def _prepare(data_dir, gsm8k_files=None):
    return prepare_gsm8k(data_dir, files_dir=gsm8k_files)


def _example(record: Mapping[str, Any], index: int, style: str) -> prompts.Example:
    answer = gsm8k_final_answer(prompts.as_text(record["answer"]))
    return prompts.Example(
        "gsm8k",
        prompt(prompts.as_text(record["question"]), style),
        {"answer": answer},
        reference(prompts.as_text(record["annotation"]), answer),
        index,
    )


TASK = tasks.register(
    tasks.numeric_task(
        "gsm8k",
        prepare=_prepare,
        example=_example,
        options=lambda task_config: {"gsm8k_files": task_config.gsm8k_files or None},
    )
)
