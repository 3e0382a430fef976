"""Countdown / arithmetic generated in memory, GSM8K through TFDS's builder, and
PromptSource's grain order."""
import json
import os
import re
import shutil
import subprocess
import sys

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds

from gspo_jax import answers, rewards
from gspo_jax.data.source import PromptSource, shuffle_seed
from gspo_jax.tasks import arithmetic, countdown, prompts
from gspo_jax.tasks import data_dir as data_dir_lib
from gspo_jax.tasks import gsm8k as gsm8k_lib

tfds.disable_progress_bar()
countdown_task = countdown  # the verifier and the examples are one module

SMALL_CD = countdown.CountdownConfig.make(min_count=3, max_count=4, max_number=30,
                                          max_target=60, train_size=300, test_size=40, seed=3)
SMALL_AR = arithmetic.ArithmeticConfig.make(min_digits=1, max_digits=3, train_size=200,
                                            test_size=30, seed=1)
# The first problems of two levels (see test_the_levels_examples_are_pinned).
EASY_TEST_HEAD = [((1, 3, 1), 2, "(3-1)*1"), ((14, 18, 3), 29, "14+18-3")]
EASY_TRAIN_HEAD = [((11, 18, 20), 49, "11+20+18"), ((11, 17, 4), 32, "4+17+11")]
DIGITS3_TEST_HEAD = [("673+34", "707"), ("0*1", "0")]
DIGITS3_TRAIN_HEAD = [("90+601", "691"), ("863*328", "283064")]
# The first positions of SMALL_CD's test split with seed 0, and grain's seed for it.
SEED0_EPOCH0_HEAD = [18, 35, 16, 7, 20, 13, 24, 0, 19, 17]
SHUFFLE_SEED_0 = 2968811710


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


# ---------------------------------------------------------------------------
# Countdown generation.

@pytest.mark.parametrize("name", ["small", "easy", "tinyzero", "hard"])
def test_countdown_configs_solvable(name):
  cfg = countdown.LEVELS[name]
  problems = countdown.generate_split(cfg, "test")[:200]
  assert len(problems) == 200
  for p in problems:
    assert cfg.min_count <= len(p.numbers) <= cfg.max_count
    assert all(cfg.min_number <= n <= cfg.max_number for n in p.numbers)
    assert cfg.min_target <= p.target <= cfg.max_target
    # The reference passes the verifier (an independent parser, exact rationals).
    v = countdown_task.verify_countdown(prompts.answer_span(p.solution), p.numbers, p.target)
    assert v.status == answers.Status.CORRECT, p


def test_countdown_deterministic_and_disjoint():
  a = countdown.generate_split(SMALL_CD, "train")
  b = countdown.generate_split(SMALL_CD, "train")
  assert a == b
  other = countdown.CountdownConfig.make(**{**_fields(SMALL_CD), "seed": 4})
  assert countdown.generate_split(other, "train") != a
  test = countdown.generate_split(SMALL_CD, "test")
  test_keys = {countdown.problem_key(p.numbers, p.target) for p in test}
  assert len(test_keys) == len(test) == 40  # distinct test problems
  assert not test_keys & {countdown.problem_key(p.numbers, p.target) for p in a}


def test_countdown_minimal_parentheses():
  atom = lambda s: (s, 3)
  assert countdown._format("-", atom("7"), ("3-2", 1)) == ("7-(3-2)", 1)
  assert countdown._format("+", atom("7"), ("3-2", 1)) == ("7+3-2", 1)
  assert countdown._format("*", ("1+2", 1), atom("3")) == ("(1+2)*3", 2)
  assert countdown._format("/", atom("8"), ("2*2", 2)) == ("8/(2*2)", 2)
  assert countdown._format("*", atom("8"), ("4/2", 2)) == ("8*4/2", 2)


def _fields(cfg):
  return {k: getattr(cfg, k) for k in countdown._COUNTDOWN_FIELDS}


def test_countdown_config_errors():
  with pytest.raises(ValueError, match="unknown field"):
    countdown.CountdownConfig.make(num_count=3)
  with pytest.raises(ValueError, match="min_count"):
    countdown.CountdownConfig.make(min_count=1)
  with pytest.raises(ValueError, match="operators"):
    countdown.CountdownConfig.make(operators="+^")
  with pytest.raises(ValueError, match="min_target > max_target"):
    countdown.CountdownConfig.make(min_target=10, max_target=5)
  with pytest.raises(ValueError, match="widen the target range"):
    countdown.generate_problem(np.random.default_rng(0), num_numbers=3, min_number=1, max_number=2,
                               min_target=1000, max_target=2000, max_tries=50)
  with pytest.raises(ValueError, match="split must be"):
    countdown.generate_split(SMALL_CD, "validation")


# ---------------------------------------------------------------------------
# Arithmetic generation.

def test_arithmetic_answers_and_precedence():
  assert arithmetic.evaluate_integer_expression([2, 3, 4], ["+", "*"]) == 14
  assert arithmetic.evaluate_integer_expression([2, 3, 4], ["-", "-"]) == -5
  cfg = arithmetic.ArithmeticConfig.make(min_digits=1, max_digits=6, min_operands=2,
                                         max_operands=4, test_size=300, train_size=10)
  for p in arithmetic.generate_split(cfg, "test"):
    # The Countdown parser is an independent evaluator of the same grammar.
    assert countdown_task._evaluate(p.question, answers.Limits(max_answer_chars=1000))[0] == int(p.answer)
    assert answers.verify_numeric(prompts.answer_span(p.answer), p.answer).correct
    for operand in p.question.replace("*", " ").replace("+", " ").replace("-", " ").split():
      assert 1 <= len(operand) <= 6 and (len(operand) == 1 or operand[0] != "0")


def test_arithmetic_splits_and_errors():
  test = arithmetic.generate_split(SMALL_AR, "test")
  train = arithmetic.generate_split(SMALL_AR, "train")
  assert len({p.question for p in test}) == 30
  assert not {p.question for p in test} & {p.question for p in train}
  assert train == arithmetic.generate_split(SMALL_AR, "train")
  tiny = arithmetic.ArithmeticConfig.make(min_digits=1, max_digits=1, operators="+", test_size=150)
  with pytest.raises(ValueError, match="too small"):  # only 100 distinct one-digit sums
    arithmetic.generate_split(tiny, "test")
  with pytest.raises(ValueError, match="max_digits"):
    arithmetic.ArithmeticConfig.make(max_digits=19)
  with pytest.raises(ValueError, match="operators"):
    arithmetic.ArithmeticConfig.make(operators="/")
  # Answers the verifier could not read are refused when the difficulty is made.
  with pytest.raises(ValueError, match="26 digits"):
    arithmetic.ArithmeticConfig.make(min_digits=13, max_digits=13, operators="*")
  widest = arithmetic.ArithmeticConfig.make(min_digits=12, max_digits=12, operators="*", test_size=20)
  for p in arithmetic.generate_split(widest, "test"):
    assert answers.verify_numeric(f"<answer>{p.answer}</answer>", p.answer).correct


# ---------------------------------------------------------------------------
# Generated in memory: deterministic, disjoint, cheap, and no TFDS on the way.

def test_synthetic_splits_are_generated_in_memory_deterministically(tmp_path):
  for task, cfg, key in (("countdown", SMALL_CD, lambda e: countdown.problem_key(**e.meta)),
                         ("arithmetic", SMALL_AR, lambda e: e.prompt)):
    train = PromptSource(task, "train", data_dir=tmp_path / "data", config=cfg, shuffle=False)
    test = PromptSource(task, "test", data_dir=tmp_path / "data", config=cfg, shuffle=False)
    assert (len(train), len(test)) == (cfg.train_size, cfg.test_size)
    assert train.config_name == cfg.name
    # The split's own order is the generator's; example i is made from its index alone.
    module = countdown if task == "countdown" else arithmetic
    for split, src in (("train", train), ("test", test)):
      want = [module._example(p, i, "compact") for i, p in enumerate(module.generate_split(cfg, split))]
      assert src.first(len(src)) == want
    assert train.example(123) == train.first(124)[123]
    # Train and test disjoint; the test split distinct.
    test_keys = {key(e) for e in test.first(cfg.test_size)}
    assert len(test_keys) == cfg.test_size
    assert not test_keys & {key(e) for e in train.first(cfg.train_size)}
  assert not (tmp_path / "data").exists()  # nothing written, no lock


def test_the_levels_examples_are_pinned():
  """The examples of a level are a function of its config alone; a change to the
  generator (or to numpy's streams) changes what every run trains on, and shows here."""
  easy, digits3 = countdown.generated(countdown.LEVELS["easy"]), arithmetic.generated(
      arithmetic.LEVELS["digits3"])
  assert [(p.numbers, p.target, p.solution) for p in easy.test[:2]] == EASY_TEST_HEAD
  assert [(p.numbers, p.target, p.solution) for p in easy.train[:2]] == EASY_TRAIN_HEAD
  assert [(p.question, p.answer) for p in digits3.test[:2]] == DIGITS3_TEST_HEAD
  assert [(p.question, p.answer) for p in digits3.train[:2]] == DIGITS3_TRAIN_HEAD
  assert easy.train[19_999] == easy.train_example(19_999) and len(easy.train) == 20_000


def test_a_train_example_is_made_when_read():
  cfg = countdown.CountdownConfig.make(**{**_fields(SMALL_CD), "train_size": 10**9, "seed": 11})
  g = countdown.generated(cfg)  # startup: the test split only
  assert len(g.train) == 10**9
  far = g.train[10**9 - 1]
  assert countdown.problem_key(far.numbers, far.target) not in {
      countdown.problem_key(p.numbers, p.target) for p in g.test}
  with pytest.raises(IndexError):
    g.train[10**9]


def test_a_difficulty_whose_problems_are_all_test_problems_is_refused():
  # Two-digit sums of one-digit numbers: 100 questions, all of them in the test split.
  every = arithmetic.ArithmeticConfig.make(min_digits=1, max_digits=1, operators="+",
                                           test_size=100, train_size=5)
  with pytest.raises(ValueError, match="train example 0 is a test problem in each of 1000 draws"):
    arithmetic.generate_split(every, "train")


def test_no_tensorflow_datasets_on_a_synthetic_tasks_path(tmp_path):
  """A synthetic task's examples, batches and scores import no TFDS (nor TensorFlow)
  and write nothing; another process draws the same batches."""
  code = """if True:
      import sys
      from gspo_jax import rewards, tasks
      from gspo_jax.data import PromptSource
      tasks.names()  # every task module imported
      batches = []
      for task in ("countdown", "arithmetic"):
          for split in ("train", "test"):
              exs = PromptSource(task, split, data_dir=sys.argv[1], seed=7).batch(500, 8)
              rewards.score(task, [e.reference for e in exs], [e.meta for e in exs])
              batches.append([(e.prompt, e.index) for e in exs])
      print(sorted(m for m in sys.modules if m.startswith("tensorflow")))
      print(repr(batches))
  """
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "data")], capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  modules, batches = out.stdout.strip().split("\n")
  assert modules == "[]"
  assert not (tmp_path / "data").exists()
  here = [[(e.prompt, e.index) for e in PromptSource(t, s, data_dir=tmp_path, seed=7).batch(500, 8)]
          for t in ("countdown", "arithmetic") for s in ("train", "test")]
  assert batches == repr(here)


# ---------------------------------------------------------------------------
# PromptSource.

@pytest.fixture(scope="module")
def cd_source(data_dir):
  return PromptSource("countdown", "train", data_dir=data_dir, config=SMALL_CD, seed=7)


def test_source_examples_and_references(cd_source, data_dir):
  batch = cd_source.batch(0, 16)
  for ex in batch:
    assert ex.task == "countdown"
    assert ex.prompt.startswith(f"Make {ex.meta['target']} from ")
    assert ex.reference.startswith("<answer>") and ex.reference.endswith("</answer>")
  r, _, counts = rewards.score("countdown", [e.reference for e in batch], [e.meta for e in batch])
  np.testing.assert_array_equal(r, 1.0)
  ar = PromptSource("arithmetic", "test", data_dir=data_dir, config=SMALL_AR, style="instruct")
  exs = ar.first(30)
  assert [e.index for e in exs] == list(range(30))
  assert all("<answer></answer>" in e.prompt for e in exs)
  r, _, _ = rewards.score("arithmetic", [e.reference for e in exs], [e.meta for e in exs])
  np.testing.assert_array_equal(r, 1.0)


def test_source_order_is_pure_function_of_position(cd_source):
  n = len(cd_source)
  assert n == 300
  whole = [e.index for e in cd_source.batch(0, 50)]
  parts = [e.index for e in cd_source.batch(0, 20)] + [e.index for e in cd_source.batch(20, 30)]
  assert whole == parts
  assert whole == cd_source.indices(0, 50).tolist()  # the examples are those of the indices
  # Each epoch visits every example exactly once, in a different order per epoch.
  e0 = cd_source.indices(0, n)
  e1 = cd_source.indices(n, n)
  assert sorted(e0) == sorted(e1) == list(range(n))
  assert not np.array_equal(e0, e1)
  np.testing.assert_array_equal(cd_source.order(0), e0)
  np.testing.assert_array_equal(cd_source.order(1), e1)
  # A batch across the epoch boundary is the tail of epoch 0 and the head of epoch 1.
  np.testing.assert_array_equal(cd_source.indices(n - 3, 6), np.concatenate([e0[-3:], e1[:3]]))
  # The order is grain's per-epoch shuffle of the split, seeded from the run's seed.
  grain_order = grain.MapDataset.range(n).shuffle(seed=shuffle_seed(7)).repeat()
  assert [grain_order[p] for p in range(2 * n)] == e0.tolist() + e1.tolist()
  with pytest.raises(ValueError, match="batch_size"):
    cd_source.batch(0, 0)
  with pytest.raises(ValueError, match="position"):
    cd_source.batch(-1, 2)


def test_epoch_orders_are_permutations_that_differ_by_epoch_and_seed(tmp_path):
  orders = {}
  for seed in (0, 1, 2, 2**32 - 1):
    src = PromptSource("countdown", "test", data_dir=tmp_path, config=SMALL_CD, seed=seed)
    assert len(src) == 40
    for epoch in range(3):
      order = tuple(src.order(epoch).tolist())
      assert sorted(order) == list(range(40))
      orders[seed, epoch] = order
  assert len(set(orders.values())) == len(orders)  # no two (seed, epoch) alike
  # grain reseeds epoch e with seed + e: the run's seed is spread first, so seed 1's
  # first epoch is not seed 0's second.
  assert orders[1, 0] != orders[0, 1] and orders[2, 0] != orders[1, 1]
  # Pinned: the order of a run's data is a function of (seed, epoch, size) alone; a
  # change here (grain's index shuffle, the seed's spreading) changes resumed runs.
  src = PromptSource("countdown", "test", data_dir=tmp_path, config=SMALL_CD, seed=0)
  assert src.order(0)[:10].tolist() == SEED0_EPOCH0_HEAD
  assert shuffle_seed(0) == SHUFFLE_SEED_0
  # shuffle=False: the split's own order, every epoch.
  fixed = PromptSource("countdown", "test", data_dir=tmp_path, config=SMALL_CD, shuffle=False)
  assert fixed.indices(35, 10).tolist() == [35, 36, 37, 38, 39, 0, 1, 2, 3, 4]


def test_resuming_at_a_position_draws_the_uninterrupted_batches(tmp_path):
  """A run stopped after k batches and started again (a new process: a new source) at
  position k * batch draws what the uninterrupted run drew, across epoch boundaries."""
  batch = 12
  run = PromptSource("arithmetic", "train", data_dir=tmp_path, config=SMALL_AR, seed=5)
  uninterrupted = [run.batch(k * batch, batch) for k in range(40)]  # 480 positions: 2.4 epochs
  for stop in (1, 16, 17, 33):
    resumed = PromptSource("arithmetic", "train", data_dir=tmp_path, config=SMALL_AR, seed=5)
    assert [resumed.batch(k * batch, batch) for k in range(stop, 40)] == uninterrupted[stop:]
  assert uninterrupted[16] != uninterrupted[0]


def test_stream_ids_are_distinct_across_an_epoch_boundary(cd_source):
  n = len(cd_source)
  np.testing.assert_array_equal(cd_source.stream_ids(5, 40), cd_source.indices(5, 40))
  # Batches of 64 that cross the boundary; some hold an example twice.
  repeats = 0
  for pos in range(n - 63, n):
    idx, ids = cd_source.indices(pos, 64), cd_source.stream_ids(pos, 64)
    repeats += len(set(idx.tolist())) < 64
    assert len(set(ids.tolist())) == 64
    np.testing.assert_array_equal(ids % n, idx)
    np.testing.assert_array_equal(ids // n, np.arange(pos, pos + 64) // n)
  assert repeats > 0


def test_source_argument_errors(data_dir):
  with pytest.raises(ValueError, match="unknown task"):
    PromptSource("chess", data_dir=data_dir)
  with pytest.raises(ValueError, match="style must be"):
    PromptSource("countdown", data_dir=data_dir, config=SMALL_CD, style="verbose")
  with pytest.raises(ValueError, match="split 'validation'"):
    PromptSource("countdown", "validation", data_dir=data_dir, config=SMALL_CD)
  with pytest.raises(ValueError, match="gsm8k_files is only for"):
    PromptSource("countdown", data_dir=data_dir, config=SMALL_CD, gsm8k_files=data_dir)


# ---------------------------------------------------------------------------
# GSM8K through TFDS's own builder, on files written here.

GSM8K_LINES = [
    {"question": "Natalia sold clips to 48 friends in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A house costs $1,200 more than a car costing $3,000. What does the house cost?",
     "answer": "3,000 + 1,200 = <<3000+1200=4200>>4,200\n#### 4,200"},
    {"question": "It is 5 degrees and falls by 8. What is the temperature?",
     "answer": "5 - 8 = <<5-8=-3>>-3\n#### -3"},
]


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory):
  folder = tmp_path_factory.mktemp("gsm8k_files")
  for k, split in enumerate(gsm8k_lib.SPLITS):
    lines = GSM8K_LINES[: 3 - (k % 2)]  # test splits get 2 lines, train splits 3
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  return folder


@pytest.fixture
def no_network(monkeypatch):
  """Any real download attempt fails the test."""
  from tensorflow_datasets.core.download import downloader

  def refuse(self, url, *args, **kwargs):
    raise AssertionError(f"network download attempted: {url}")

  monkeypatch.setattr(downloader._Downloader, "download", refuse)


def test_gsm8k_builder_from_supplied_files(tmp_path, gsm8k_files, no_network):
  builder = gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=gsm8k_files)
  assert type(builder).__module__ == "tensorflow_datasets.text.gsm8k.gsm8k"  # TFDS's own builder
  assert {s: builder.info.splits[s].num_examples for s in gsm8k_lib.SPLITS} == {
      "train": 3, "test": 2, "train_socratic": 3, "test_socratic": 2}
  ds = builder.as_data_source("train")
  records = sorted((ds[i]["question"].decode(), ds[i]["short_answer"].decode()) for i in range(3))
  assert records == sorted((x["question"], x["answer"].split("#### ")[1]) for x in GSM8K_LINES)

  source = PromptSource("gsm8k", "train", data_dir=tmp_path / "data", shuffle=False)
  exs = source.first(3)
  by_answer = {e.meta["answer"]: e for e in exs}
  assert sorted(by_answer) == ["-3", "4200", "72"]  # "#### 4,200" -> "4200"
  ex = by_answer["72"]
  assert ex.prompt == GSM8K_LINES[0]["question"] + "\n"
  assert "<<" not in ex.reference and ex.reference.endswith("<answer>72</answer>")
  r, comps, _ = rewards.score("gsm8k", [e.reference for e in exs], [e.meta for e in exs])
  np.testing.assert_array_equal(r, 1.0)
  texts = ["<answer>$4,200.</answer>", "It is -3", "<answer>71</answer>", "I do not know", "not 72"]
  metas = [by_answer[a].meta for a in ("4200", "-3", "72", "72", "72")]
  r, comps, counts = rewards.score("gsm8k", texts, metas)
  np.testing.assert_array_equal(r, [1, 1, 0, 0, 0])  # "It is -3": right, read as the last number
  np.testing.assert_array_equal(comps["format"], [1, 0, 1, 0, 0])  # ... but not in the answer tag
  assert counts["wrong_answer"] == counts["no_answer"] == counts["hedged"] == 1


def test_gsm8k_other_files_for_a_prepared_dataset_are_refused(tmp_path, gsm8k_files, no_network):
  gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=gsm8k_files)
  gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=gsm8k_files)  # the same files: fine
  other = tmp_path / "other"
  shutil.copytree(gsm8k_files, other)
  (other / "train.jsonl").write_text(json.dumps(GSM8K_LINES[0]) + "\n")
  with pytest.raises(ValueError, match="prepared from other files"):
    gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=other)


def test_gsm8k_missing_file(tmp_path, gsm8k_files, no_network):
  partial = tmp_path / "partial"
  partial.mkdir()
  (partial / "train.jsonl").write_text((gsm8k_files / "train.jsonl").read_text())
  with pytest.raises(ValueError, match="lacks test.jsonl"):
    gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=partial)


def test_gsm8k_without_files_tries_the_network(tmp_path, no_network):
  # Proves the supplied-files test above ran offline: without the files the
  # real builder asks the downloader for the openai/grade-school-math URLs.
  with pytest.raises(AssertionError, match="network download attempted: https://raw"):
    gsm8k_lib.prepare_gsm8k(tmp_path / "data")


# ---------------------------------------------------------------------------
# Supplied GSM8K files are checked line by line before anything is prepared.

def _write_gsm8k(folder, train: bytes, split="train"):
  """The four split files in ``folder``, valid except ``split``, which holds ``train``."""
  folder.mkdir(exist_ok=True)
  good = "".join(json.dumps(x) + "\n" for x in GSM8K_LINES).encode()
  for s in gsm8k_lib.SPLITS:
    (folder / f"{s}.jsonl").write_bytes(train if s == split else good)
  return folder


def test_gsm8k_files_with_bom_blank_lines_and_crlf_are_read(tmp_path, no_network):
  lines = [json.dumps({**x, "id": k}) for k, x in enumerate(GSM8K_LINES)]  # extra fields are dropped
  text = "\ufeff" + lines[0] + "\r\n\n   \n" + lines[1] + "\r\n" + lines[2] + "\n\n"
  files = _write_gsm8k(tmp_path / "files", text.encode("utf-8"))
  assert gsm8k_lib.read_gsm8k_file(files / "train.jsonl") == GSM8K_LINES
  builder = gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=files)
  assert builder.info.splits["train"].num_examples == 3
  source = PromptSource("gsm8k", "train", data_dir=tmp_path / "data", shuffle=False)
  assert sorted(e.meta["answer"] for e in source.first(3)) == ["-3", "4200", "72"]


_GOOD = json.dumps(GSM8K_LINES[0])


@pytest.mark.parametrize("bad, message", [
    ('{"question": "How many?", "answer": "#### 5"', "not valid JSON"),
    ("\ufeff" + _GOOD, "not valid JSON"),  # a BOM is stripped only at the start of the file
    ('["How many?", "#### 5"]', "expected a JSON object with 'question' and 'answer', got an array"),
    ('"#### 5"', "got a string"),
    ('{"answer": "#### 5"}', "no 'question' field"),
    ('{"question": "How many?", "solution": "#### 5"}', "no 'answer' field"),
    ('{"question": 5, "answer": "#### 5"}', "'question' must be a string, got a number"),
    ('{"question": "How many?", "answer": null}', "'answer' must be a string, got null"),
    ('{"question": "  ", "answer": "#### 5"}', "'question' is empty"),
    ('{"question": "How many?", "answer": "5 apples"}', "found 0 '####'"),
    ('{"question": "How many?", "answer": "#### 4\\n#### 5"}', "found 2 '####'"),
    ('{"question": "How many?", "answer": "####5"}', "needs a space after '####'"),
    ('{"question": "How many?", "answer": "#### 5 apples"}', "not a plain number: '5 apples'"),
    ('{"question": "How many?", "answer": "#### 1,00"}', "not a plain number: '1,00'"),
    ('{"question": "How many?", "answer": "#### 1/2"}', "not a plain number: '1/2'"),
    ('{"question": "How many?", "answer": "#### 7e2"}', "not a plain number: '7e2'"),
    ('{"question": "How many?", "answer": "#### "}', "not a plain number: ''"),
])
def test_gsm8k_bad_line_names_file_and_line(tmp_path, bad, message):
  # Line 3: after a good line and a blank one.
  files = _write_gsm8k(tmp_path / "files", (_GOOD + "\n\n" + bad + "\n" + _GOOD + "\n").encode())
  path = str(files / "train.jsonl")
  with pytest.raises(ValueError, match=re.escape(f"GSM8K file {path!r}, line 3: ") + ".*" + re.escape(message)):
    gsm8k_lib.read_gsm8k_file(path)


def test_gsm8k_bad_files_fail_before_anything_is_prepared(tmp_path, no_network):
  files = _write_gsm8k(tmp_path / "files", b"\xff\xfe{}\n", split="test_socratic")
  where = re.escape(f"{str(files / 'test_socratic.jsonl')!r}, line 1: not UTF-8")
  with pytest.raises(ValueError, match=where):
    gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=files)
  assert not (tmp_path / "data").exists()
  with pytest.raises(ValueError, match=where):  # the trainer's data source, before any step
    PromptSource("gsm8k", "train", data_dir=tmp_path / "data", gsm8k_files=files)
  with pytest.raises(ValueError, match=where):
    gsm8k_lib.supply_gsm8k_files(files, tmp_path / "downloads")
  assert not (tmp_path / "downloads").exists()


def test_gsm8k_bad_files_are_refused_even_for_a_prepared_dataset(tmp_path, gsm8k_files, no_network):
  gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=gsm8k_files)
  bad = _write_gsm8k(tmp_path / "bad", (_GOOD + "\n" + _GOOD.replace("#### 72", "#### 72 clips")).encode())
  with pytest.raises(ValueError, match=r"line 2: GSM8K final answer is not a plain number: '72 clips'"):
    gsm8k_lib.prepare_gsm8k(tmp_path / "data", files_dir=bad)


def test_two_runs_preparing_one_dataset_at_once_both_succeed(tmp_path, gsm8k_files, monkeypatch,
                                                             no_network):
  """Two runs started together on a fresh data dir (a sweep's points, a study's two
  pinned processes): the second waits for the first's preparation and reuses it. Without
  the lock both generate, and the second fails renaming into the folder the first made.
  (GSM8K and a user's file are prepared on disk; the synthetic tasks write nothing.)"""
  import threading
  import time

  cls = type(gsm8k_lib.gsm8k_builder(tmp_path / "probe"))
  real = cls.download_and_prepare
  inside = []

  def slow(self, *a, **kw):  # both threads inside at once, unless one waits
    inside.append(threading.get_ident())
    time.sleep(0.5)
    return real(self, *a, **kw)

  monkeypatch.setattr(cls, "download_and_prepare", slow)
  errors, sources = [], []

  def prepare():
    try:
      sources.append(PromptSource("gsm8k", "test", data_dir=tmp_path / "data",
                                  gsm8k_files=gsm8k_files, shuffle=False))
    except Exception as e:  # noqa: BLE001 - reported below
      errors.append(e)

  threads = [threading.Thread(target=prepare) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  assert len(inside) == 1  # prepared once: the second found it prepared
  assert [len(s) for s in sources] == [2, 2] and sources[0].first(2) == sources[1].first(2)


def test_a_prepared_dataset_is_read_without_the_lock(tmp_path, gsm8k_files, no_network):
  """Reading a dataset already prepared takes no lock and writes nothing, so a
  read-only data dir (a workdir's data/ on an archive) serves: the lock file was once
  opened first, and `evaluate` of a read-only workdir failed on it (EROFS;
  tests/test_evaluation.py evaluates workdirs on a read-only mount)."""
  data = tmp_path / "data"
  PromptSource("gsm8k", "test", data_dir=data, gsm8k_files=gsm8k_files)
  shutil.rmtree(data / ".prepare_locks")
  before = sorted((p.relative_to(data), p.stat().st_mtime_ns) for p in [data, *data.rglob("*")])
  for files in (gsm8k_files, None):  # with the files it was prepared from, or none
    exs = PromptSource("gsm8k", "test", data_dir=data, gsm8k_files=files).first(30)
    assert len(exs) == 2
  after = sorted((p.relative_to(data), p.stat().st_mtime_ns) for p in [data, *data.rglob("*")])
  assert after == before and not os.path.exists(data / ".prepare_locks")
  assert data_dir_lib.is_prepared(gsm8k_lib.gsm8k_builder(data))


def test_a_dataset_to_prepare_under_a_data_dir_that_cannot_be_written(tmp_path, gsm8k_files,
                                                                      monkeypatch, no_network):
  """Not prepared, and nothing can be written (a read-only mount; as root, chmod would
  not stop a write, so the refusal is simulated where the lock file is made): one
  DataDirNotWritable naming the data set and the data dir, before anything is written.
  tests/test_evaluation.py meets it on a real read-only mount."""
  import errno

  def read_only(path, *a, **kw):
    raise OSError(errno.EROFS, "Read-only file system", path)

  monkeypatch.setattr(data_dir_lib.os, "makedirs", read_only)
  data = tmp_path / "data"
  with pytest.raises(data_dir_lib.DataDirNotWritable) as e:
    PromptSource("gsm8k", "test", data_dir=data, gsm8k_files=gsm8k_files)
  assert str(e.value) == (
      f"gsm8k/{gsm8k_lib.gsm8k_builder(tmp_path).version} is not prepared under the data dir "
      f"{data}, and nothing can be written "
      "there to prepare it (Read-only file system): prepare it in a data dir that can be written")
  assert not data.exists()
  from gspo_jax.data.source import DataDirNotWritable  # where `evaluate` catches it
  assert DataDirNotWritable is data_dir_lib.DataDirNotWritable
  # A synthetic task needs nothing there.
  assert len(PromptSource("countdown", "test", data_dir=data, config=SMALL_CD)) == 40
