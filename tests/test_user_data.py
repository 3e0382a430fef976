"""Task "file": a user's prompts and answers from JSONL/Parquet, verifiers by name,
plug-in reward functions, chat messages, and an end-to-end run of the entry point."""

import json
import logging
import os
import pathlib
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gspo_jax import reward_plugins, rewards, verifiers
from gspo_jax import tokenizers as gtok
from gspo_jax.answers import Status
from gspo_jax.data import PromptSource, encoding
from gspo_jax.tasks import countdown as countdown_task
from gspo_jax.tasks import user_file

REPO = pathlib.Path(__file__).resolve().parents[1]


def _write_jsonl(path, rows, raw_lines=()):
    """Rows as JSON lines; ``raw_lines``: {line index: raw text} inserted as they are."""
    lines = [json.dumps(r) for r in rows]
    for i, raw in sorted(dict(raw_lines).items()):
        lines.insert(i, raw)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _rows(n=20):
    return [{"prompt": f"What is {i}+1?\n", "answer": i + 1} for i in range(n)]


def _spec(path, **kw):
    return user_file.FileTask(file=path, **kw)


def _load(tmp_path, spec, split):
    """The examples of ``split``, prepared under ``tmp_path / "data"``."""
    return user_file.load_split(spec, split, tmp_path / "data")


# --------------------------------------------------------------------------
# Reading.


def test_jsonl_bad_row_skip_reports_file_and_row_once(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(), {3: '{"prompt": "x", "answer": '})
    spec = _spec(path)
    with caplog.at_level(logging.WARNING, logger="gspo_jax.tasks.user_file"):
        train = _load(tmp_path, spec, "train")
        test = _load(tmp_path, spec, "test")
    assert len(train) + len(test) == 20 and test  # the bad line 4 left out
    bad = [r.getMessage() for r in caplog.records if "bad row(s)" in r.getMessage()]
    assert len(bad) == 1, bad  # reported once, though both splits were read
    assert f"{path}: row 4: invalid JSON" in bad[0]
    assert [ex.index for ex in train] == list(range(len(train)))
    ex = train[0]
    assert ex.task == "file" and ex.meta["verifier"] == "numeric" and ex.reference is None
    assert rewards.verify("file", f"<answer>{ex.meta['answer']}</answer>", ex.meta).correct


def test_jsonl_bad_row_refuse_names_file_and_row(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(), {5: '{"prompt": "", "answer": 3}'})
    with pytest.raises(ValueError, match=r"p\.jsonl: row 6: column 'prompt' is empty"):
        _load(tmp_path, _spec(path, bad_rows="refuse"), "train")


@pytest.mark.parametrize(
    "raw, why",
    [
        ('{"prompt": "What?"}', "missing column 'answer'"),
        ('{"prompt": 3, "answer": 1}', "column 'prompt' must be a string"),
        ('{"prompt": "What?", "answer": [1]}', "must be a string or a number"),
        ('{"prompt": "What?", "answer": "seven"}', "not a plain number"),
        ("[1, 2]", "not a JSON object"),
        ("{oops", "invalid JSON"),
    ],
)
def test_each_kind_of_bad_row(tmp_path, raw, why):
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(4), {1: raw})
    with pytest.raises(ValueError, match=r"row 2: ") as e:
        _load(tmp_path, _spec(path, bad_rows="refuse", test_fraction=0.25), "train")
    assert why in str(e.value)


def test_bom_blank_lines_and_line_numbers(tmp_path):
    path = tmp_path / "p.jsonl"
    body = "\n".join(json.dumps(r) for r in _rows(3))
    path.write_bytes(b"\xef\xbb\xbf" + b"\n" + body.encode() + b"\n\n" + b'{"prompt": 1}\n')
    with pytest.raises(ValueError, match=r"row 6: column 'prompt' must be a string"):
        _load(tmp_path, _spec(str(path), bad_rows="refuse", test_fraction=0.3), "train")


def test_test_file_split_and_prompt_source_order(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", _rows(10))
    test_rows = [{"prompt": f"Held out {i}?", "answer": i} for i in range(3)]
    test = _write_jsonl(tmp_path / "test.jsonl", test_rows)
    spec = _spec(train, test_file=test, test_fraction=0.0)
    src = PromptSource("file", "train", data_dir=str(tmp_path), seed=3, file_task=spec)
    ev = PromptSource("file", "test", data_dir=str(tmp_path), shuffle=False, file_task=spec)
    assert len(src) == 10 and len(ev) == 3
    order = src.order(1)
    assert sorted(order) == list(range(10)) and not np.array_equal(order, src.order(0))
    assert [ex.index for ex in src.batch(12, 4)] == order[2:6].tolist()  # epoch 1
    assert [ex.prompt for ex in ev.first(5)] == [r["prompt"] for r in test_rows]
    with pytest.raises(ValueError, match="file_task"):
        PromptSource("file", "train", data_dir=str(tmp_path))


def test_prepared_dataset_is_reused_until_the_file_or_a_setting_changes(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(10))
    calls = []
    splits = user_file._splits
    monkeypatch.setattr(
        user_file, "_splits", lambda spec, check: calls.append(spec) or splits(spec, check)
    )
    first = user_file.prepare(_spec(path), tmp_path / "data")
    again = user_file.prepare(_spec(path), tmp_path / "data")
    assert len(calls) == 1 and again.data_dir == first.data_dir  # reused, not regenerated
    assert len(_load(tmp_path, _spec(path), "train") + _load(tmp_path, _spec(path), "test")) == 10
    assert len(calls) == 1
    _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"New {i}?", "answer": i} for i in range(10)])
    edited = user_file.prepare(_spec(path), tmp_path / "data")
    assert len(calls) == 2 and edited.data_dir != first.data_dir
    train = _load(tmp_path, _spec(path), "train") + _load(tmp_path, _spec(path), "test")
    assert sorted(ex.prompt for ex in train) == sorted(f"New {i}?" for i in range(10))
    user_file.prepare(_spec(path, verifier="exact_match"), tmp_path / "data")
    assert len(calls) == 3  # a changed setting prepares a new dataset too


def test_unknown_extension_and_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        _load(tmp_path, _spec(str(tmp_path / "nope.jsonl")), "train")
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"\.jsonl"):
        _load(tmp_path, _spec(str(tmp_path / "p.csv")), "train")


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"q": f"What is {i}*2?", "a": str(2 * i), "sol": f"<answer>{2 * i}</answer>"}
        for i in range(1, 11)
    ]
    rows[4] = {"q": "", "a": "1", "sol": "x"}  # bad: empty prompt
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    spec = _spec(
        str(tmp_path / "p.parquet"),
        prompt_column="q",
        answer_column="a",
        solution_column="sol",
        test_fraction=0.2,
    )
    exs = _load(tmp_path, spec, "train") + _load(tmp_path, spec, "test")
    assert len(exs) == 9 and all(ex.reference.startswith("<answer>") for ex in exs)
    with pytest.raises(ValueError, match=r"p\.parquet: row 5: column 'q' is empty"):
        _load(
            tmp_path,
            _spec(spec.file, prompt_column="q", answer_column="a", bad_rows="refuse"),
            "train",
        )


# --------------------------------------------------------------------------
# A file edited between runs, duplicates, prompts the run cannot use, unreadable values.


def _split_prompts(tmp_path, spec, check=None):
    """{split: its prompts}; ``check``: the run's PromptCheck, if any."""
    kw = {"prompt_check": check} if check else {}
    return {
        split: {ex.prompt for ex in user_file.load_split(spec, split, tmp_path / "data", **kw)}
        for split in ("train", "test")
    }


def test_an_edited_file_moves_no_other_row_between_the_splits(tmp_path, caplog):
    rows = [{"prompt": f"What is {i}*3?", "answer": 3 * i} for i in range(200)]
    rows[10]["answer"] = "thirty"  # a bad row, fixed before the second run
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    before = _split_prompts(tmp_path, _spec(path))
    assert 5 <= len(before["test"]) <= 40  # about test_fraction=0.1 of the rows
    rows[10]["answer"] = 30
    rows[20]["answer"] = 61  # an answer corrected
    removed = {rows[i]["prompt"] for i in (3, 50, 120)}
    rows = [r for r in rows if r["prompt"] not in removed]
    rows = rows[:5] + [{"prompt": f"New {i}?", "answer": i} for i in range(5)] + rows[5:]
    _write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="gspo_jax.tasks.user_file"):
        after = _split_prompts(tmp_path, _spec(path))
    for split in ("train", "test"):
        assert before[split] - removed <= after[split], split  # no unchanged row moved
    assert not after["train"] & after["test"]
    notes = [r.getMessage() for r in caplog.records if "differ from its last preparation" in r.getMessage()]
    assert len(notes) == 1 and path in notes[0], notes
    added = {split: len(after[split] - before[split]) for split in after}
    gone = {split: len(before[split] & removed) for split in before}
    assert f"train: {added['train']} row(s) added, {gone['train']} removed, 1 edited" in notes[0]
    assert sum(added.values()) == 6 and sum(gone.values()) == 3  # 5 new rows and row 10
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gspo_jax.tasks.user_file"):
        assert _split_prompts(tmp_path, _spec(path)) == after  # unchanged: no notice
    assert not [r for r in caplog.records if "differ from" in r.getMessage()]


def test_duplicate_prompts_are_kept_once_in_one_split(tmp_path, caplog):
    rows = [{"prompt": f"What is {i}+7?", "answer": i + 7} for i in range(60)]
    rows += [{"prompt": f"What is  {i}+7?\n", "answer": i + 7} for i in range(0, 60, 6)]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="gspo_jax.tasks.user_file"):
        got = _split_prompts(tmp_path, _spec(path))
    norm = {split: {" ".join(p.split()) for p in got[split]} for split in got}
    assert not norm["train"] & norm["test"]
    assert len(got["train"]) + len(got["test"]) == 60  # each prompt once
    (note,) = [r.getMessage() for r in caplog.records if "repeat the prompt" in r.getMessage()]
    assert f"{path}: 10 row(s) repeat the prompt of an earlier row, kept once" in note
    assert "row 61 (as row 1)" in note
    # A test file's prompts are left out of training.
    test = _write_jsonl(tmp_path / "t.jsonl", rows[:3])
    got = _split_prompts(tmp_path, _spec(path, test_file=test))
    assert got["test"] == {r["prompt"] for r in rows[:3]}
    assert len(got["train"]) == 57 and not got["train"] & got["test"]


def _unusable_rows():
    ok = [{"prompt": f"What is {i}-1?", "answer": i - 1} for i in range(20)]
    bad = [
        {"prompt": "Combien font 2+2 ? Réponds.", "answer": 4},
        {"prompt": "What’s 2+2?", "answer": 4},
        {"prompt": "What is 3×4?", "answer": 12},
        {"prompt": "What is\t5+5?", "answer": 10},
        {"prompt": "What is " + "1+" * 60 + "1?", "answer": 61},  # 130 characters and BOS
    ]
    return ok[:4] + bad + ok[4:]  # the bad ones are rows 5 to 9


def test_prompts_the_run_cannot_encode_or_fit_are_reported_up_front(tmp_path):
    from configs import file_task
    from gspo_jax.run_parts import RunParts

    path = _write_jsonl(tmp_path / "p.jsonl", _unusable_rows())
    c = file_task.get_config(f"file={path},smoke")
    c.task.bad_rows = "refuse"
    c.rollout.max_prompt_len = 100
    with pytest.raises(ValueError, match=r"5 bad row\(s\)") as e:
        RunParts(c, str(tmp_path / "run"))  # fails while preparing the data
    msg = str(e.value)
    for row, char in [(5, "é"), (6, "’"), (7, "×"), (8, "\t")]:
        assert f"{path}: row {row}: the prompt cannot be encoded" in msg and repr(char) in msg
    assert f"{path}: row 9: the prompt is 131 tokens, longer than config.rollout.max_prompt_len=100" in msg
    # Skipped: the run's data holds the good rows only; truncated prompts are usable.
    check = encoding.PromptCheck(gtok.CharTokenizer(), 100, "refuse")
    got = _split_prompts(tmp_path, _spec(path), check)
    assert len(got["train"]) + len(got["test"]) == 20
    check = encoding.PromptCheck(gtok.CharTokenizer(), 100, "truncate")
    got = _split_prompts(tmp_path, _spec(path), check)
    assert len(got["train"]) + len(got["test"]) == 21
    # A tokenizer with a chat template: its tokens, template included, are counted.
    (tmp_path / "tok").mkdir()
    hf = _hf_dir(tmp_path / "tok")
    n = len(encoding.encode_prompt(hf, "What is 1-1?"))
    assert encoding.PromptCheck(hf, n, "refuse").problem("What is 1-1?") is None
    assert f"is {n} tokens" in encoding.PromptCheck(hf, n - 1, "refuse").problem("What is 1-1?")


def test_unreadable_values_are_named_by_file_and_row(tmp_path, caplog):
    raw = {
        2: '{"prompt": "Big?", "answer": ' + "7" * 5000 + "}",
        3: '{"prompt": "Big string?", "answer": "' + "7" * 5000 + '"}',
        4: '{"prompt": "Deep?", "answer": 1, "x": ' + "[" * 100000 + "]" * 100000 + "}",
        5: '{"prompt": "Deep?", "answer": 1, "x": ' + "[" * 200 + "]" * 200 + "}",
    }
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(10), raw)
    with pytest.raises(ValueError, match=r"4 bad row\(s\)") as e:
        _load(tmp_path, _spec(path, bad_rows="refuse"), "train")
    msg = str(e.value)
    assert f"{path}: row 3: unreadable value: Exceeds the limit (4300 digits)" in msg
    assert f"{path}: row 4: column 'answer': unreadable value: Exceeds the limit" in msg
    assert f"{path}: row 5: a value nested more than 64 levels deep" in msg
    assert f"{path}: row 6: a value nested more than 64 levels deep" in msg
    assert len(msg) < 2000  # values are not echoed whole
    with caplog.at_level(logging.WARNING, logger="gspo_jax.tasks.user_file"):
        got = _split_prompts(tmp_path, _spec(path))
    assert len(got["train"]) + len(got["test"]) == 10
    (note,) = [r.getMessage() for r in caplog.records if "bad row(s)" in r.getMessage()]
    assert "skipping 4 bad row(s)" in note


def test_rows_that_are_json_but_not_objects_are_named_by_their_type(tmp_path):
    """A line of valid JSON that is no object is "not a JSON object", named by its JSON
    type: a string row's own text is not taken for the error (it read ``row 2: What is
    1+1?``, as if the file said so), even a string that looks like one."""
    raw = {1: '"What is 1+1?"', 2: "7", 3: "2.5", 4: "[1, 2]", 5: "null", 6: "true",
           7: '"invalid JSON (x at column 1)"'}
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(10), raw)
    with pytest.raises(ValueError, match=r"7 bad row\(s\)") as e:
        _load(tmp_path, _spec(path, bad_rows="refuse"), "train")
    lines = str(e.value).splitlines()[1:]
    want = ["string", "number", "number", "array", "null", "boolean", "string"]
    assert lines == [f"  {path}: row {i + 2}: not a JSON object (got {t})" for i, t in enumerate(want)]
    # Read errors keep their own messages.
    path = _write_jsonl(tmp_path / "q.jsonl", _rows(4), {1: "{oops", 2: '"text"'})
    with pytest.raises(ValueError) as e:
        _load(tmp_path, _spec(path, bad_rows="refuse", test_fraction=0.25), "train")
    assert "row 2: invalid JSON (Expecting property name" in str(e.value)
    assert "row 3: not a JSON object (got string)" in str(e.value)


def test_every_bad_row_in_one_message_capped(tmp_path):
    rows = [{"prompt": "", "answer": i} for i in range(30)] + _rows(5)
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match=r"30 bad row\(s\)") as e:
        _load(tmp_path, _spec(path, bad_rows="refuse"), "train")
    assert str(e.value).count(": column 'prompt' is empty") == user_file.MAX_LISTED
    assert "… and 10 more" in str(e.value)


# --------------------------------------------------------------------------
# Verifiers by name.


def _file(text, answer, verifier, **meta):
    return rewards.verify("file", text, {"verifier": verifier, "answer": answer, **meta})


def test_numeric_and_countdown_by_name():
    assert _file("<answer>72</answer>", "72", "numeric").correct
    assert _file("<answer>73</answer>", "72", "numeric").status == Status.WRONG_ANSWER
    v = _file("<answer>(3+5)*2</answer>", "16", "countdown", numbers=(3, 5, 2), target=16)
    assert v == countdown_task.verify_countdown("<answer>(3+5)*2</answer>", (3, 5, 2), 16)
    assert v.correct


def test_exact_match():
    assert _file("<answer>  Paris\n</answer>", "Paris", "exact_match").correct
    assert _file("the  capital is\tParis", "the capital is Paris", "exact_match").correct
    v = _file("<answer>paris</answer>", "Paris", "exact_match")
    assert (v.correct, v.formatted, v.status) == (False, True, Status.WRONG_ANSWER)
    assert _file("<answer> </answer>", "Paris", "exact_match").status == Status.NO_ANSWER


@pytest.mark.parametrize(
    "got, ref",
    [
        (r"\frac{1}{2}", "1/2"),
        (r"\frac{1}{2}", "0.5"),
        ("1/2", "0.5"),
        (r"\dfrac{1}{2}", r"\frac12"),
        ("1,000", "1000"),
        ("3.0", "3"),
        (r"\left( 2 \right)", "(2)"),
        (r"$\frac{\sqrt{3}}{2}$", r"\tfrac{\sqrt{3}}{2}"),
        (r"1\!000", "1000"),
        (r"-\frac{3}{4}", "-0.75"),
        ("x^{2}+1", "x^2 + 1"),
        ("12", r"\boxed{12}"),
        (".5", "0.5"),
        ("-.25", r"-\frac{1}{4}"),
        (r"\$5", "5"),
        ("$5", "5"),
        ("x = 3", "3"),
        (r"5\%", "5"),
        (r"90^\circ", "90"),
        ("1,234", "1234"),
        (r"10,\!000", "10000"),
        ("(1,234)", "(1, 234)"),
        (r"\left( \frac{1}{2}, 3 \right)", "(0.5, 3.0)"),
        ("[0, .5)", "[0,1/2)"),
        (r"1\,234", "1234"),  # a thin space before three digits: a thousands separator
        (r"1\,234\,567.5", "1234567.5"),
        (r"1\thinspace 234", "1234"),
        (r"\frac 1 2", "0.5"),  # TeX's arguments, not the number 12
        (r"- 5", "-5"),
        ("x = 3 .", "3"),
        (r"(1,\quad 2)", "(1, 2)"),
        (r"(1,~2)", "(1, 2)"),
        ("2 x", "2x"),
    ],
)
def test_boxed_math_equivalences(got, ref):
    assert _file(f"So the answer is \\boxed{{{got}}}.", ref, "boxed_math").correct
    assert verifiers.verify_boxed_math(f"\\boxed{{{ref}}}", got).correct  # symmetric


def test_boxed_math_failures():
    assert _file(r"\boxed{3}", "4", "boxed_math").status == Status.WRONG_ANSWER
    assert _file(r"\boxed{1/3}", "0.33", "boxed_math").status == Status.WRONG_ANSWER
    assert _file("no box", "4", "boxed_math").status == Status.NO_ANSWER
    assert _file(r"\boxed{4", "4", "boxed_math").status == Status.PARSE_ERROR
    assert _file(r"\boxed{1/0}", "1/0", "boxed_math").correct  # same string; no division
    assert _file("<answer>4</answer>", "4", "boxed_math").correct  # no box: the answer tag
    assert _file(r"\boxed{2} then \boxed{4}", "4", "boxed_math").correct  # the last box


@pytest.mark.parametrize(
    "got, ref",
    [
        ("1234", "(1, 234)"),  # a pair is not one thousands-separated number
        ("1234", "[1, 234]"),
        ("1234", "1, 234"),
        ("1,234", "(1, 234)"),
        ("1{,}234", "(1, 234)"),
        ("1, 234", "1234"),  # a space after the comma: a list
        ("(1,234)", "1234"),  # in brackets: a tuple
        ("[1, 234]", "(1, 234)"),  # other brackets
        ("(234, 1)", "(1, 234)"),  # elements in order
        ("(1, 234, 0)", "(1, 234)"),
        ("(1)", "(1, 234)"),
        ("1,2", "1.2"),  # not a decimal comma
        ("y = 3", "x = 3"),  # both assignments: the names are compared too
    ],
)
def test_boxed_math_lists_and_single_numbers_differ(got, ref):
    assert _file(f"\\boxed{{{got}}}", ref, "boxed_math").status == Status.WRONG_ANSWER
    assert not verifiers.verify_boxed_math(f"\\boxed{{{ref}}}", got).correct  # symmetric


@pytest.mark.parametrize(
    "got, ref",
    [
        ("1 2", "12"),  # the three
        ("2~3", "23"),
        (r"3\ 4", "34"),
        ("1\t2", "12"),
        ("1\n2", "12"),
        (r"1\;2", "12"),
        (r"1\:2", "12"),
        (r"1\>2", "12"),
        (r"1\quad 2", "12"),
        (r"1\,2", "12"),  # a thin space not before three digits: no separator
        (r"12\,34", "1234"),
        (r"1\,2345", "12345"),
        ("1 234", "1234"),  # only TeX's thin space separates thousands
        ("1~234", "1234"),
        (r"1\ 234", "1234"),
        ("-1 2", "-12"),
        ("1 .5", "1.5"),
        ("1. 5", "1.5"),
        ("x = 1 2", "12"),
        ("$1$ $2$", "12"),
        (r"\text{1} \text{2}", "12"),
        ("(1 2, 3)", "(12, 3)"),
        ("1 2/3", "12/3"),  # a mixed number is not twelve thirds
    ],
)
def test_boxed_math_digits_apart_are_not_one_number(got, ref):
    """Digits that whitespace or TeX spacing keeps apart are not one number: ``1 2``,
    ``2~3`` and ``3\\ 4`` were read as 12, 23 and 34 (whitespace was dropped before
    the numbers were read)."""
    assert _file(f"\\boxed{{{got}}}", ref, "boxed_math").status == Status.WRONG_ANSWER
    assert not verifiers.verify_boxed_math(f"\\boxed{{{ref}}}", got).correct  # symmetric


def test_score_counts_every_status_including_reward_fn_error():
    _, _, counts = rewards.score("file", ["x"], [{"verifier": "numeric", "answer": "1"}])
    assert set(counts) == {s.value for s in Status} and "reward_fn_error" in counts


# --------------------------------------------------------------------------
# Plug-in reward functions by import path.

PLUGIN = """
import math
import sys
import threading

calls = []

def partial(response, reference, row):
    calls.append(row)
    return 1.0 if reference in response else 0.25

def boom(response, reference, row):
    raise RuntimeError("bug in the user's reward")

def nan(response, reference, row):
    return math.nan

def text(response, reference, row):
    return "1"

release = threading.Event()  # set by the tests' teardown: hanging calls then return

def hang(response, reference, row):
    release.wait(60)
    return 1.0

def picky(response, reference, row):
    if "bad" in response:
        raise ValueError(f"cannot score {response!r}")
    if "slow" in response:
        release.wait(60)
    return 1.0

def leave(response, reference, row):
    sys.exit(0)

def interrupt(response, reference, row):
    raise KeyboardInterrupt

def close(response, reference, row):
    raise GeneratorExit
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_reward_mod"
    if "my_reward_mod" in sys.modules:
        sys.modules["my_reward_mod"].release.set()
    sys.modules.pop("my_reward_mod", None)
    for key in [k for k in reward_plugins._REWARD_FNS if k.startswith("my_reward_mod:")]:
        del reward_plugins._REWARD_FNS[key]


def test_plugin_reward(plugin, tmp_path):
    metas = [{"verifier": f"{plugin}:partial", "answer": "42", "row": {"id": 7}}] * 2
    r, comp, counts = rewards.score("file", ["<answer>42</answer>", "41"], metas, format_weight=0.5)
    np.testing.assert_allclose(r, [1.5, 0.25])
    np.testing.assert_allclose(comp["correct"], [1.0, 0.25])
    assert counts["correct"] == 2 and counts["reward_fn_error"] == 0
    assert sys.modules[plugin].calls == [{"id": 7}, {"id": 7}]
    # Through a file: the row is passed whole; any answer is accepted.
    path = _write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": f"Say hi {i}", "answer": "hi", "id": i} for i in range(5)]
    )
    ex = _load(tmp_path, _spec(path, verifier=f"{plugin}:partial"), "train")[0]
    assert rewards.verify("file", "hi there", ex.meta).reward == 1.0
    assert sys.modules[plugin].calls[-1]["prompt"] == ex.prompt


@pytest.mark.parametrize("fn", ["boom", "nan", "text"])
def test_plugin_failure_is_counted_not_raised(plugin, fn, caplog):
    metas = [{"verifier": f"{plugin}:{fn}", "answer": "1", "row": {}}]
    calls = reward_plugins.RewardFnCalls(all_failed="continue")
    with caplog.at_level(logging.WARNING, logger="gspo_jax.reward_plugins"):
        r, comp, counts = rewards.score("file", ["<answer>1</answer>"], metas, reward_fns=calls)
    assert r.tolist() == [0.0] and counts["reward_fn_error"] == 1
    assert any(fn in rec.getMessage() for rec in caplog.records)


def _metas(plugin, fn, n):
    return [{"verifier": f"{plugin}:{fn}", "answer": "1", "row": {}}] * n


def test_a_hanging_plugin_times_out_and_is_named(plugin, caplog):
    calls = reward_plugins.RewardFnCalls(timeout=0.2, all_failed="continue")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gspo_jax.reward_plugins"):
        r, _, counts = rewards.score("file", ["a", "b"], _metas(plugin, "hang", 2), reward_fns=calls)
    assert time.monotonic() - t0 < 5
    assert r.tolist() == [0.0, 0.0] and counts["reward_fn_timeout"] == 2
    (rec,) = caplog.records  # one summary for the batch
    assert f"{plugin}:hang" in rec.getMessage() and "2 of 2 calls failed" in rec.getMessage()
    assert "timed out after task.reward_fn_timeout=0.2 s" in rec.getMessage()
    # Under the default policy a batch of timeouts stops the run, naming the plug-in.
    calls = reward_plugins.RewardFnCalls(timeout=0.2)
    with pytest.raises(reward_plugins.RewardFnError, match=f"{plugin}:hang: 1 of 1 calls"):
        rewards.score("file", ["a"], _metas(plugin, "hang", 1), reward_fns=calls)


def test_a_plugin_that_keeps_hanging_stops_the_run(plugin):
    calls = reward_plugins.RewardFnCalls(timeout=0.05, all_failed="continue")
    t0 = time.monotonic()
    with pytest.raises(reward_plugins.RewardFnError) as e:
        rewards.score("file", ["x"] * 100, _metas(plugin, "hang", 100), reward_fns=calls)
    assert time.monotonic() - t0 < 5  # four late calls, not a hundred
    msg = str(e.value)
    want = f"{plugin}:hang: {reward_plugins.MAX_LATE_CALLS} calls are still running"
    assert want in msg and "response 3 of this batch" in msg and "reward_fn_timeout" in msg


def test_a_plugin_that_always_raises_stops_the_run_by_default(plugin, caplog):
    with caplog.at_level(logging.WARNING, logger="gspo_jax.reward_plugins"):
        with pytest.raises(reward_plugins.RewardFnError) as e:
            rewards.score("file", ["<answer>1</answer>"] * 64, _metas(plugin, "boom", 64))
    msg = str(e.value)
    assert f"plug-in reward {plugin}:boom: 64 of 64 calls failed" in msg
    assert "RuntimeError: bug in the user's reward" in msg and "response 0" in msg
    assert "task.reward_fn_all_failed='continue'" in msg
    assert isinstance(e.value.__cause__, RuntimeError)  # the plug-in's own traceback
    assert not caplog.records  # no line per response


def test_failures_are_summarised_once_per_batch(plugin, caplog):
    calls = reward_plugins.RewardFnCalls(all_failed="continue")
    with caplog.at_level(logging.DEBUG, logger="gspo_jax"):
        for _ in range(3):  # three steps
            r, _, counts = rewards.score("file", ["x"] * 64, _metas(plugin, "boom", 64), reward_fns=calls)
            assert r.sum() == 0 and counts["reward_fn_error"] == 64
    assert len(caplog.records) == 3  # one summary per batch, not one per response
    assert [rec.exc_info is not None for rec in caplog.records] == [True, False, False]
    assert all("64 of 64 calls failed" in rec.getMessage() for rec in caplog.records)
    assert caplog.text.count("Traceback") == 1


def test_a_plugin_that_fails_on_some_responses_is_counted_once(plugin, caplog):
    texts = ["ok", "bad 1", "ok", "slow", "bad 2", "ok"]
    calls = reward_plugins.RewardFnCalls(timeout=0.2)  # the default policy: some succeeded
    with caplog.at_level(logging.WARNING, logger="gspo_jax.reward_plugins"):
        r, _, counts = rewards.score("file", texts, _metas(plugin, "picky", 6), reward_fns=calls)
    assert r.tolist() == [1, 0, 1, 0, 0, 1]
    assert counts["reward_fn_error"] == 2 and counts["reward_fn_timeout"] == 1
    assert counts["correct"] == 3
    (rec,) = caplog.records
    assert "3 of 6 calls failed (2 raised or returned no finite float, 1 timed out" in rec.getMessage()
    assert "the first on response 1 ('bad 1'): ValueError: cannot score 'bad 1'" in rec.getMessage()


@pytest.mark.parametrize("timeout", [5.0, 0.0], ids=["worker", "this thread"])
@pytest.mark.parametrize(
    "fn, raised",
    [("leave", "SystemExit(0)"), ("interrupt", "KeyboardInterrupt"), ("close", "GeneratorExit")],
)
def test_a_plugin_that_would_end_the_process_stops_the_run_naming_it(
    plugin, fn, raised, timeout
):
    """``sys.exit(0)`` (or a KeyboardInterrupt, a GeneratorExit) from a plug-in is no
    Exception, so it passed every handler and ended the trainer with status 0: now a
    RewardFnError naming the plug-in, at once, whatever the failure policy. A
    KeyboardInterrupt of the function is not the user's Ctrl-C: under the trainer's
    signal handler (as here) SIGINT raises none, and none reaches the worker thread."""
    from gspo_jax import safety

    calls = reward_plugins.RewardFnCalls(timeout=timeout, all_failed="continue")
    try:
        with safety.GracefulShutdown():
            rewards.score("file", ["ok", "ok"], _metas(plugin, fn, 2), reward_fns=calls)
    except reward_plugins.RewardFnError as e:
        error = e
    except BaseException as e:  # not left to end the test session
        pytest.fail(f"the plug-in's {type(e).__name__} escaped")
    else:
        pytest.fail("no RewardFnError")
    msg = str(error)
    assert f"plug-in reward {plugin}:{fn} raised {raised}" in msg
    assert "on response 0 ('ok')" in msg and "a reward function must return a number" in msg
    assert type(error.__cause__).__name__ == raised.partition("(")[0]


def test_a_real_ctrl_c_during_a_plugin_is_not_taken_for_the_plugins(plugin):
    """Where SIGINT raises KeyboardInterrupt (Python's own handler, not the trainer's),
    one raised in the calling thread during a plug-in may be the user's Ctrl-C: it
    passes unchanged, as does one that interrupts the wait for the worker."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        calls = reward_plugins.RewardFnCalls(timeout=0)
        with pytest.raises(KeyboardInterrupt):
            rewards.score("file", ["ok"], _metas(plugin, "interrupt", 1), reward_fns=calls)
        calls = reward_plugins.RewardFnCalls(timeout=30)
        main = threading.main_thread().ident
        timer = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT))  # Ctrl-C
        timer.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                rewards.score("file", ["slow"], _metas(plugin, "picky", 1), reward_fns=calls)
        finally:
            timer.join()
        assert time.monotonic() - t0 < 10  # at once, not after the time limit
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_plugin_module_that_exits_when_imported_is_a_load_error(tmp_path, monkeypatch):
    """A module that ends the process on import (a script's argument parser, a
    ``sys.exit()`` at top level) is a ValueError naming it (config.task.verifier's
    error), not the trainer's exit."""
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"cannot import module 'exits_on_import' of "
                       r"'exits_on_import:f': it raised SystemExit\(2\)"):
        reward_plugins.load_reward_fn("exits_on_import:f")
    sys.modules.pop("exits_on_import", None)


def test_built_in_verifiers_do_not_use_the_plugin_worker(monkeypatch):
    def no_worker(*a, **k):
        raise AssertionError("a worker thread for a built-in verifier")

    monkeypatch.setattr(reward_plugins, "_Worker", no_worker)
    _, _, counts = rewards.score("file", ["<answer>1</answer>"], [{"verifier": "numeric", "answer": "1"}])
    assert counts["correct"] == 1


def test_no_time_limit_calls_in_this_thread(plugin):
    calls = reward_plugins.RewardFnCalls(timeout=0)
    r, _, _ = rewards.score("file", ["ok"], _metas(plugin, "picky", 1), reward_fns=calls)
    assert r.tolist() == [1.0] and calls._worker is None
    with pytest.raises(ValueError, match="timeout"):
        reward_plugins.RewardFnCalls(timeout=-1)
    with pytest.raises(ValueError, match="all_failed"):
        reward_plugins.RewardFnCalls(all_failed="ignore")


def test_plugin_load_errors():
    with pytest.raises(ValueError, match="module:function"):
        reward_plugins.load_reward_fn("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        reward_plugins.load_reward_fn("surely_not_a_module_xyz:f")
    with pytest.raises(ValueError, match="no function"):
        reward_plugins.load_reward_fn("math:not_there")


# --------------------------------------------------------------------------
# Chat-format prompts.

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _hf_dir(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["You are terse. What is 2+2?"], trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return gtok.HFTokenizer.from_dir(path)


def test_messages_column(tmp_path):
    from gspo_jax.data.encoding import encode_prompt

    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    rows = [{"chat": msgs[:1] + [{"role": "user", "content": f"What is 2+{i}?"}], "answer": 2 + i}
            for i in (2, 3, 4, 5)] + [{"chat": [{"role": "user"}], "answer": 4}]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 5: column 'chat': message 0"):
        _load(tmp_path, _spec(path, messages_column="chat", bad_rows="refuse"), "train")
    spec = _spec(path, messages_column="chat", test_fraction=0.25)
    exs = _load(tmp_path, spec, "train") + _load(tmp_path, spec, "test")
    ex = next(ex for ex in exs if ex.messages[1]["content"] == "What is 2+2?")
    assert ex.prompt == "You are terse.\nWhat is 2+2?" and len(ex.messages) == 2
    char = gtok.CharTokenizer()
    assert encode_prompt(char, ex.prompt, ex.messages) == [char.bos_id] + char.encode(ex.prompt)
    (tmp_path / "tok").mkdir()
    hf = _hf_dir(tmp_path / "tok")
    want = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert encode_prompt(hf, ex.prompt, ex.messages) == hf.encode(want)


# --------------------------------------------------------------------------
# End to end: the entry point on a user's file with one bad row.


def _train_on_file(tmp_path, path, verifier):
    """The entry point's smoke run on the file ``path`` (``tmp_path`` on the import path)."""
    cmd = [
        sys.executable,
        "-m",
        "gspo_jax.train",
        "--config=configs/file_task.py:smoke",
        f"--config.task.file={path}",
        f"--config.task.verifier={verifier}",
        f"--config.task.data_dir={tmp_path / 'data'}",
        f"--workdir={tmp_path / 'run'}",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_train_on_a_users_file(tmp_path):
    rng = random.Random(0)
    rows = []
    for _ in range(40):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": f"What is {a}+{b}?\n", "answer": a + b})
    path = _write_jsonl(tmp_path / "mine.jsonl", rows, {7: '{"prompt": "What is 1+1?"}'})
    out = _train_on_file(tmp_path, path, "numeric")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{path}: row 8: missing column 'answer'" in out.stderr
    assert out.stderr.count("row 8:") == 1  # reported once
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    rl = [r for r in records if r.get("phase") == "rl"]
    assert rl and not [r for r in records if r.get("phase") == "sft"]
    assert any("eval_reward_mean" in r for r in rl)
    assert any("eval/pass@1" in r for r in rl)


def test_a_run_whose_plugin_always_raises_stops_with_one_error(tmp_path):
    (tmp_path / "e2e_reward_mod.py").write_text(PLUGIN)
    path = _write_jsonl(tmp_path / "mine.jsonl", _rows(20))
    out = _train_on_file(tmp_path, path, "e2e_reward_mod:boom")
    assert out.returncode != 0
    assert "RewardFnError: plug-in reward e2e_reward_mod:boom: " in out.stderr, out.stderr[-3000:]
    assert "Every response of this batch failed" in out.stderr
    # One error, not a traceback per response (the plug-in's own once, as its cause).
    assert out.stderr.count("bug in the user's reward") <= 3, out.stderr[-3000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not [json.loads(x) for x in metrics.open() if '"rl"' in x]


def test_a_run_whose_plugin_calls_sys_exit_0_fails_naming_it(tmp_path):
    """A plug-in calling ``sys.exit(0)`` ended the trainer with status 0, no RL record
    and the plug-in unnamed, so ``train && export`` went on with the warm start."""
    (tmp_path / "e2e_reward_mod.py").write_text(PLUGIN)
    path = _write_jsonl(tmp_path / "mine.jsonl", _rows(20))
    out = _train_on_file(tmp_path, path, "e2e_reward_mod:leave")
    assert out.returncode != 0, out.stderr[-3000:]
    assert "RewardFnError: plug-in reward e2e_reward_mod:leave raised SystemExit(0)" in out.stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not [json.loads(x) for x in metrics.open() if '"rl"' in x]
