"""Verifiers: hand cases, the batch API, and fuzzing with garbage and adversarial input."""
import functools
import time
from fractions import Fraction

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from gspo_jax import rewards
from gspo_jax.rewards import Status


def cd(text, numbers=(3, 5, 2), target=16):
  return rewards.verify_countdown(text, numbers, target)


@pytest.mark.parametrize("text", [
    "<answer>(3+5)*2</answer>",
    "<answer> ( 3 + 5 ) * 2 </answer>",
    "<answer>2*(5+3)</answer>",
    "<answer>(3+5)\u00d72</answer>",                # x sign
    "<answer>(3+5)*2 = 16</answer>",               # stated result matching target
    "thinking <answer>3</answer> more <answer>(5+3)*2</answer>",  # last span counts
])
def test_countdown_correct(text):
  assert cd(text) == rewards.Verdict(True, True, Status.CORRECT)


@pytest.mark.parametrize("text, status", [
    ("(3+5)*2", Status.NO_ANSWER),                   # no tags
    ("<answer>(3+5)*2", Status.NO_ANSWER),           # no closing tag
    ("<answer>3+5+2</answer>", Status.WRONG_ANSWER),  # 10
    ("<answer>(3+5)*2 = 17</answer>", Status.WRONG_ANSWER),
    ("<answer>(3+5)*2*1</answer>", Status.WRONG_NUMBERS),  # extra number
    ("<answer>(3+5)*5</answer>", Status.WRONG_NUMBERS),    # 5 twice, 2 missing
    ("<answer>8*2</answer>", Status.WRONG_NUMBERS),        # numbers not all used
    ("<answer>-3+5*2+9</answer>", Status.PARSE_ERROR),     # unary minus
    ("<answer>3**5*2</answer>", Status.PARSE_ERROR),
    ("<answer>3^5*2</answer>", Status.PARSE_ERROR),
    ("<answer>(3+5*2</answer>", Status.PARSE_ERROR),
    ("<answer>3+5)*2</answer>", Status.PARSE_ERROR),
    ("<answer>()</answer>", Status.PARSE_ERROR),
    ("<answer></answer>", Status.PARSE_ERROR),
    ("<answer>3.0+5*2</answer>", Status.PARSE_ERROR),
    ("<answer>__import__('os')</answer>", Status.PARSE_ERROR),
    ("<answer>\u0663+5*2</answer>", Status.PARSE_ERROR),    # Arabic-Indic digit three
    ("<answer>3/(5-5)*2</answer>", Status.DIV_BY_ZERO),
])
def test_countdown_failures(text, status):
  v = cd(text)
  assert not v.correct and v.status == status


def test_countdown_exact_fractions():
  # 8 / (3 - 8/3) = 24 needs exact rationals: floats give 23.999999999999993.
  assert rewards.verify_countdown("<answer>8/(3-8/3)</answer>", (8, 3, 8, 3), 24).correct
  evaluate = functools.partial(rewards._evaluate, limits=rewards.DEFAULT_LIMITS)
  assert evaluate("1/3+1/3+1/3")[0] == 1
  # Left associativity: 8-3-2 = 3 (a right-associative bug gives 7); 8/4/2 = 1 (not 4).
  assert evaluate("8-3-2") == (Fraction(3), [8, 3, 2])
  assert evaluate("8/4/2")[0] == 1
  assert evaluate("2+3*4")[0] == 14  # precedence (20 if ignored)


@pytest.mark.parametrize("content, value", [
    ("72", 72), (" 72 ", 72), ("72.", 72), ("$72", 72), ("-5", -5), ("$-5", -5), ("-$5", -5),
    ("1,234", 1234), ("$1,234,567.50", Fraction(123456750, 100)), ("18.0", 18), ("0.25", Fraction(1, 4)),
])
def test_parse_number(content, value):
  assert rewards.parse_number(content) == value


@pytest.mark.parametrize("content", ["", "$", "-", "1,23", "12,3456", "1e5", "\u0663", "1.2.3",
                                     "seven", ".5", "1.", "1..", "--5"])
def test_parse_number_rejects(content):
  # "1." is accepted only as "1" + trailing period; "1.." is not a number.
  if content == "1.":
    assert rewards.parse_number(content) == 1
  else:
    assert rewards.parse_number(content) is None


@pytest.mark.parametrize("text, correct", [
    ("<answer>1200</answer>", True),
    ("<answer>1,200</answer>", True),
    ("<answer>$1,200.</answer>", True),
    ("<answer>The answer is 1,200 dollars.</answer>", True),   # last number in the span
    ("<answer>1200.00</answer>", True),
    ("<answer>1201</answer>", False),
    ("<answer>12,00</answer>", False),
    ("<answer>1200,</answer>", True),   # a comma after the number is punctuation
    ("<answer>The total is 1,200, so that is it</answer>", True),
    ("<answer>1,200; or 1200</answer>", True),
    ("<answer>Not 1e3 but 1200</answer>", True),
])
def test_numeric(text, correct):
  assert rewards.verify_numeric(text, "1200").correct == correct


@pytest.mark.parametrize("content, value, status", [
    ("x = 1e5", None, Status.PARSE_ERROR),       # an exponent: not 5, not 1
    ("about 1E-3", None, Status.PARSE_ERROR),
    ("it is .5", None, Status.PARSE_ERROR),      # not 5
    ("\u22125", -5, Status.CORRECT),             # U+2212 MINUS SIGN
    ("we get \u22125 degrees", -5, Status.CORRECT),
    ("10-3", 3, Status.CORRECT),                 # no -3: a minus after a digit is no sign
    ("pay $-5 now", -5, Status.CORRECT),
    ("42, final", 42, Status.CORRECT),
])
def test_extract_number_in_text(content, value, status):
  assert rewards.extract_number(content) == (value, status)


def test_numeric_statuses():
  assert rewards.verify_numeric("1200", "1200").status == Status.NO_ANSWER
  assert rewards.verify_numeric("<answer>many</answer>", "1200").status == Status.PARSE_ERROR
  assert rewards.verify_numeric("<answer>-3</answer>", "-3").correct
  assert rewards.verify_numeric("<answer>" + "9" * 40 + "</answer>", "1").status == Status.NUMBER_TOO_LARGE
  with pytest.raises(ValueError, match="'answer'"):
    rewards.verify_numeric("<answer>1</answer>", "n/a")


def test_gsm8k_final_answer():
  assert rewards.gsm8k_final_answer("She has 3+4=<<3+4=7>>7 apples.\n#### 7") == "7"
  assert rewards.gsm8k_final_answer("...\n#### 1,000") == "1000"
  with pytest.raises(ValueError, match="####"):
    rewards.gsm8k_final_answer("no final line")
  with pytest.raises(ValueError, match="not a number"):
    rewards.gsm8k_final_answer("#### seven")


def test_score_batch():
  texts = ["<answer>(3+5)*2</answer>", "<answer>3+5+2</answer>", "garbage", "<answer>3/0*5</answer>"]
  metas = [{"numbers": [3, 5, 2], "target": 16}] * 3 + [{"numbers": [3, 0, 5], "target": 1}]
  r, comps, counts = rewards.score("countdown", texts, metas, format_weight=0.1)
  assert r.dtype == np.float32 and r.shape == (4,)
  np.testing.assert_array_equal(comps["correct"], [1, 0, 0, 0])
  np.testing.assert_array_equal(comps["format"], [1, 1, 0, 1])
  np.testing.assert_allclose(r, [1.1, 0.1, 0.0, 0.1], rtol=1e-6)
  assert counts == {**{s.value: 0 for s in Status}, "correct": 1, "wrong_answer": 1,
                    "no_answer": 1, "div_by_zero": 1}
  r, _, counts = rewards.score("gsm8k", ["<answer>7</answer>", "x"], [{"answer": "7"}] * 2)
  np.testing.assert_array_equal(r, [1, 0])
  assert sum(counts.values()) == 2


def test_score_bad_arguments():
  with pytest.raises(ValueError, match="same length"):
    rewards.score("countdown", ["a"], [])
  with pytest.raises(ValueError, match="task must be"):
    rewards.score("chess", ["a"], [{}])
  with pytest.raises(ValueError, match="'numbers' and 'target'"):
    rewards.score("countdown", ["a"], [{"target": 3}])
  with pytest.raises(ValueError, match="texts must be str"):
    rewards.score("arithmetic", [b"<answer>1</answer>"], [{"answer": "1"}])
  with pytest.raises(ValueError, match="'answer' is not a number"):
    rewards.score("arithmetic", ["x"], [{"answer": "one"}])


# ---------------------------------------------------------------------------
# Fuzzing: any text gives a reward in {0, 1(+format)} and a status, fast, never an exception.

_BOUND_S = 1.0  # Generous wall-time bound per call; typical calls take microseconds.


def _timed(fn, *args):
  t0 = time.perf_counter()
  out = fn(*args)
  dt = time.perf_counter() - t0
  assert dt < _BOUND_S, f"verifier took {dt:.3f} s"
  return out


_ALPHABET = st.sampled_from(list("0123456789+-*/()^=. ,$<>/answer\u00d7\u00f7\u0663\n") + ["<answer>", "</answer>", "**"])


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(st.one_of(st.text(max_size=300), st.lists(_ALPHABET, max_size=120).map("".join)))
def test_fuzz_random_text(body):
  for text in (body, f"<answer>{body}</answer>", f"x<answer>{body}"):
    for task, meta in (("countdown", {"numbers": [3, 5, 2], "target": 16}),
                       ("arithmetic", {"answer": "42"}), ("gsm8k", {"answer": "1,200"})):
      r, comps, counts = _timed(rewards.score, task, [text], [meta])
      assert r.shape == (1,) and np.isfinite(r).all()
      assert counts["verifier_error"] == 0, text
      assert sum(counts.values()) == 1


ADVERSARIAL = [
    "9**9**9**9", "9^9^9^9", "2**100000000", "(" * 10_000 + "1" + ")" * 10_000,
    "(" * 10_000, ")" * 10_000, "1/0", "1/(2-2)", "(3-3)/(3-3)", "9" * 100_000, "1" + "0" * 5000 + "/7",
    "1e999999999", "\u0661\u0662\u0663" * 1000, "\uff11+\uff12", "+" * 50_000, "*" * 50_000,
    "99999999999999999999*99999999999999999999*99999999999999999999",
    "9" * 24 + "*" + "9" * 24 + "*" + "9" * 24 + "/" + "7" * 24,
    "<answer>" * 50_000, "</answer>" * 50_000, "<answer>" * 10_000 + "1" + "</answer>" * 10_000,
    "\x00\x01\x02", "\ud800", "1" + " " * 100_000 + "2", "__import__('os').system('true')",
    "lambda: 1", "[1]*10**9", "'a'*10**10",
]


@pytest.mark.parametrize("expr", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_bounded(expr):
  texts = [f"<answer>{expr}</answer>", expr, "<answer>" + expr]
  for task, meta in (("countdown", {"numbers": [9, 9, 9], "target": 81}),
                     ("arithmetic", {"answer": "424242"}), ("gsm8k", {"answer": "-424242"})):
    r, _, counts = _timed(rewards.score, task, texts, [meta] * 3)
    np.testing.assert_array_equal(r, 0.0)
    assert counts["verifier_error"] == 0


def test_deep_nesting_within_limit_is_parsed():
  # The depth limit is 32: 30 levels parse, 10,000 are refused without recursion errors.
  ok = "(" * 30 + "3+5" + ")" * 30 + "*2"
  assert cd(f"<answer>{ok}</answer>").correct
  deep = "(" * 40 + "3+5" + ")" * 40 + "*2"
  assert cd(f"<answer>{deep}</answer>").status == Status.TOO_DEEP
  assert rewards.verify_countdown(f"<answer>{deep}</answer>", (3, 5, 2), 16,
                                  rewards.Limits(max_depth=64)).correct
  assert cd("<answer>" + "9" * 30 + "</answer>").status == Status.NUMBER_TOO_LARGE
  assert cd("<answer>" + "1+" * 200 + "1</answer>").status == Status.TOO_LONG
