"""The task registry: a new task is one record, defined here in this one file, and
the config check, the prompt source and the reward dispatcher all find it by name."""

import dataclasses

import numpy as np
import pytest

from configs import default as default_config
from gspo_jax import config as config_lib
from gspo_jax import rewards, tasks
from gspo_jax.answers import DEFAULT_LIMITS, Status, Verdict, extract_answer
from gspo_jax.data import PromptSource
from gspo_jax.tasks import prompts

# ---------------------------------------------------------------------------
# A toy task, "parity": is n even? Everything it needs is below.


def _parity_splits(size):
    """The task's examples: a record per split index, made in memory."""
    rows = {"train": range(size), "test": range(size, size + 4)}
    return tasks.Splits(("train", "test"), lambda split: [{"n": n} for n in rows[split]])


class _ToyBuilder:
    """The little of a TFDS builder that PromptSource reads (a task whose ``prepare``
    returns a prepared TFDS builder)."""

    builder_config = None

    def __init__(self, size):
        rows = {"train": range(size), "test": range(size, size + 4)}
        self._splits = {k: [{"n": n} for n in v] for k, v in rows.items()}
        self.info = type("Info", (), {"splits": self._splits})()

    def as_data_source(self, split):
        return self._splits[split]


def _parity_example(record, index, style):
    n = int(record["n"])
    answer = "even" if n % 2 == 0 else "odd"
    prompt = f"Is {n} even or odd?\n"
    return prompts.Example("parity", prompt, {"answer": answer}, prompts.answer_span(answer), index)


def _parity_check_meta(meta):
    if "answer" not in meta:
        raise ValueError(f"parity meta needs 'answer', got keys {sorted(meta)}")


def _parity_verify(text, meta, limits):
    got = extract_answer(text)
    if got is None:
        return Verdict(False, False, Status.NO_ANSWER)
    right = got.strip() == meta["answer"]
    return Verdict(right, True, Status.CORRECT if right else Status.WRONG_ANSWER)


def _parity_check_config(c):
    if c.task.format_reward > 1:
        raise tasks.TaskConfigError("task.format_reward", "parity keeps the format reward <= 1")


PARITY = tasks.Task(
    name="parity",
    prepare=lambda data_dir, size=12: _parity_splits(size),
    example=_parity_example,
    check_meta=_parity_check_meta,
    verify=_parity_verify,
    options=lambda task_config: {"size": 12},
    check_config=_parity_check_config,
)


@pytest.fixture
def parity():
    tasks.register(PARITY)
    yield PARITY
    tasks.unregister("parity")


def _config(name):
    c = default_config.get_config("objective=gspo,smoke")
    c.task.name, c.task.difficulty = name, ""
    return c


# ---------------------------------------------------------------------------


def test_builtin_tasks_are_registered():
    assert set(tasks.names()) == {"countdown", "arithmetic", "gsm8k", "file"}
    for name in tasks.names():
        assert tasks.get(name).name == name
    with pytest.raises(ValueError, match="unknown task 'chess'; known: "):
        tasks.get("chess")


def test_a_task_from_one_file_is_validated_sourced_and_scored(parity, tmp_path):
    assert "parity" in tasks.names()
    # The config check takes the name from the registry, and runs the task's own check.
    c = _config("parity")
    config_lib.validate(c, 8)
    c.task.format_reward = 2.0
    with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.format_reward: parity"):
        config_lib.validate(c, 8)
    c = _config("parity")
    c.task.difficulty = "small"
    with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.difficulty: parity has no"):
        config_lib.validate(c, 8)
    # The prompt source reads its data and words its prompts.
    options = parity.options(c.task)
    src = PromptSource("parity", "test", data_dir=str(tmp_path), shuffle=False, **options)
    examples = src.first(4)
    assert [e.prompt for e in examples] == [f"Is {n} even or odd?\n" for n in range(12, 16)]
    with pytest.raises(ValueError, match=r"size is only for task \['parity'\]"):
        PromptSource("countdown", data_dir=str(tmp_path), size=3)
    # The dispatcher scores with its verifier.
    texts = [e.reference for e in examples] + ["<answer>odd</answer>", "no tag"]
    metas = [e.meta for e in examples] + [examples[0].meta, examples[0].meta]
    r, comps, counts = rewards.score("parity", texts, metas, format_weight=0.5)
    np.testing.assert_array_equal(r, [1.5, 1.5, 1.5, 1.5, 0.5, 0.0])
    assert counts["correct"] == 4 and counts["wrong_answer"] == 1 and counts["no_answer"] == 1
    with pytest.raises(ValueError, match="parity meta needs 'answer'"):
        rewards.verify("parity", "x", {}, DEFAULT_LIMITS)
    assert parity.answer_kind(c.task) == "tag"


def test_a_task_whose_data_are_a_tfds_builder(parity, tmp_path):
    builder_task = dataclasses.replace(
        PARITY, name="parity_tfds", prepare=lambda data_dir, size=12: _ToyBuilder(size)
    )
    tasks.register(builder_task)
    try:
        src = PromptSource("parity_tfds", "test", data_dir=str(tmp_path), shuffle=False)
        train = PromptSource("parity_tfds", "train", data_dir=str(tmp_path), seed=1, size=6)
    finally:
        tasks.unregister("parity_tfds")
    assert [e.prompt for e in src.first(4)] == [f"Is {n} even or odd?\n" for n in range(12, 16)]
    assert src.config_name is None and len(train) == 6
    assert sorted(e.index for e in train.batch(6, 6)) == list(range(6))  # epoch 1, all of it
    with pytest.raises(ValueError, match=r"split 'dev' not in parity: \['test', 'train'\]"):
        PromptSource("parity", "dev", data_dir=str(tmp_path))


def test_a_verifier_that_raises_counts_as_verifier_error(parity):
    broken = tasks.Task(
        name="broken",
        prepare=PARITY.prepare,
        example=PARITY.example,
        check_meta=lambda meta: None,
        verify=lambda text, meta, limits: 1 / 0,
    )
    tasks.register(broken)
    try:
        r, _, counts = rewards.score("broken", ["a"], [{}])
    finally:
        tasks.unregister("broken")
    assert r.tolist() == [0.0] and counts["verifier_error"] == 1


def test_names_are_unique(parity):
    tasks.register(PARITY)  # the same record again is a no-op
    with pytest.raises(ValueError, match="already registered"):
        tasks.register(tasks.Task("parity", PARITY.prepare, PARITY.example, None, None))
    c = _config("chess")
    with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.name: must be one of \(.*'parity'\), got 'chess'"):
        config_lib.validate(c, 8)
