"""Verifiers: hand cases, the batch API, and fuzzing with garbage and adversarial input."""
import functools
import time
from fractions import Fraction

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from gspo_jax import answers, rewards
from gspo_jax.answers import Status
from gspo_jax.tasks import countdown as countdown_task
from gspo_jax.tasks import gsm8k as gsm8k_data


def cd(text, numbers=(3, 5, 2), target=16):
  return countdown_task.verify_countdown(text, numbers, target)


@pytest.mark.parametrize("text", [
    "<answer>(3+5)*2</answer>",
    "<answer> ( 3 + 5 ) * 2 </answer>",
    "<answer>2*(5+3)</answer>",
    "<answer>(3+5)\u00d72</answer>",                # x sign
    "<answer>(3+5)*2 = 16</answer>",               # stated result matching target
    "thinking <answer>3</answer> more <answer>(5+3)*2</answer>",  # last span counts
])
def test_countdown_correct(text):
  assert cd(text) == answers.Verdict(True, True, Status.CORRECT)


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
  assert countdown_task.verify_countdown("<answer>8/(3-8/3)</answer>", (8, 3, 8, 3), 24).correct
  evaluate = functools.partial(countdown_task._evaluate, limits=answers.DEFAULT_LIMITS)
  assert evaluate("1/3+1/3+1/3")[0] == 1
  # Left associativity: 8-3-2 = 3 (a right-associative bug gives 7); 8/4/2 = 1 (not 4).
  assert evaluate("8-3-2") == (Fraction(3), [8, 3, 2])
  assert evaluate("8/4/2")[0] == 1
  assert evaluate("2+3*4")[0] == 14  # precedence (20 if ignored)


@pytest.mark.parametrize("content, value", [
    ("72", 72), (" 72 ", 72), ("72.", 72), ("$72", 72), ("-5", -5), ("$-5", -5), ("-$5", -5),
    ("\u22125", -5), ("0", 0), ("0.25", Fraction(1, 4)), ("1,234", 1234),
    ("$1,234,567.50", Fraction(123456750, 100)), ("18.0", 18), ("18.000", 18),
])
def test_parse_number(content, value):
  assert answers.parse_number(content) == value


@pytest.mark.parametrize("content", [
    "", "$", "-", "1,23", "12,3456", "1,00", "1000,000", "10,00,000", "1e5", "\u0663", "1.2.3",
    "seven", ".5", "1..", "--5", "+5", "072", "0x48", "0b11", "1/2", "100-28", "5 apples", "1 000",
    "1_000", "7\u00b2", "\uff17\uff12",
])
def test_parse_number_rejects(content):
  assert answers.parse_number(content) is None


def num(text, answer="72"):
  return answers.verify_numeric(text, answer)


# The wrong forms named in the verifier's history: each was once read as the answer.
@pytest.mark.parametrize("text, answer, status", [
    ("not 72", "72", Status.HEDGED),
    ("The answer is not 72.", "72", Status.HEDGED),
    ("It isn't 72", "72", Status.HEDGED),
    ("\\boxed{not 72}", "72", Status.HEDGED),
    ("#### not 72", "72", Status.HEDGED),
    ("72 or 73", "73", Status.HEDGED),
    ("either 72 or 73", "72", Status.HEDGED),
    ("<answer>72 or 73</answer>", "72", Status.AMBIGUOUS),
    ("about 72", "72", Status.HEDGED),
    ("at least 72", "72", Status.HEDGED),
    ("more than 72", "72", Status.HEDGED),
    ("~72", "72", Status.NOT_PLAIN),
    ("\u2248 72", "72", Status.HEDGED),
    ("72 is wrong", "72", Status.HEDGED),
    ("100-28", "28", Status.NOT_PLAIN),
    ("100 - 28", "28", Status.NOT_PLAIN),
    ("100 minus 28", "28", Status.NOT_PLAIN),
    ("<answer>100-28</answer>", "28", Status.NOT_PLAIN),
    ("\\boxed{100-28}", "72", Status.NOT_PLAIN),
    ("1/2", "2", Status.NOT_PLAIN),
    ("\\boxed{\\frac{144}{2}}", "72", Status.NOT_PLAIN),
    ("3*4", "4", Status.NOT_PLAIN),
    ("3 \u00d7 4", "4", Status.NOT_PLAIN),
    ("72e-1", "7", Status.NOT_PLAIN),
    ("72e-1", "72", Status.NOT_PLAIN),
    ("1.5e3", "1", Status.NOT_PLAIN),
    ("1.5e3", "1500", Status.NOT_PLAIN),
    ("The answer is 1.5E3.", "1500", Status.NOT_PLAIN),
    ("7\u00b2", "7", Status.NOT_PLAIN),
    ("7^2", "2", Status.NOT_PLAIN),
    ("7 ^ 2", "2", Status.NOT_PLAIN),
    ("7 squared", "7", Status.NOT_PLAIN),
    ("0x48", "48", Status.NOT_PLAIN),
    ("0b11", "11", Status.NOT_PLAIN),
    ("072", "72", Status.NOT_PLAIN),
    ("72\u00bd", "72", Status.NOT_PLAIN),
    ("72 and a half", "72", Status.NOT_PLAIN),
    ("72 thousand", "72", Status.NOT_PLAIN),
    ("72k", "72", Status.NOT_PLAIN),
    ("the 72nd", "72", Status.NOT_PLAIN),
    ("1,00", "100", Status.NOT_PLAIN),
    ("7,2", "72", Status.NOT_PLAIN),
    ("\u0667\u0662", "72", Status.NOT_PLAIN),       # Arabic-Indic digits
    ("12:72", "72", Status.NOT_PLAIN),
    ("72 = 8*9", "72", Status.NOT_PLAIN),
    ("72, 73", "73", Status.AMBIGUOUS),
    ("72 73", "73", Status.AMBIGUOUS),
    ("from 70 to 72", "72", Status.AMBIGUOUS),
    ("1 500", "500", Status.AMBIGUOUS),
    ("<answer>72, 73</answer>", "72", Status.AMBIGUOUS),
    ("\\boxed{72, 72}", "72", Status.AMBIGUOUS),
    ("Total:\n- 72", "72", Status.NOT_PLAIN),      # a bullet, or a minus sign?
    ("#### 2. Compute the total", "2", Status.AMBIGUOUS),
    ("The answer is 72 or 73.", "72", Status.AMBIGUOUS),
])
def test_numeric_refused(text, answer, status):
  assert num(text, answer) == answers.Verdict(False, False, status)


@pytest.mark.parametrize("text", [
    "72", "<answer>72</answer>", "<answer> 72. </answer>", "#### 72", "She sold 72 clips.\n#### 72",
    "\\boxed{72}", "$\\boxed{72}$.", "\\boxed{72 \\text{ clips}}", "The answer is 72.",
    "the answer is: 72", "THE FINAL ANSWER IS 72!", "Answer: **72**", "So she sold 72 clips in total.",
    "48 + 24 = 72", "$48+24=72$.", "x = 72", "The most she can sell is 72 clips.", "72.0", "72.00",
    "$72", "72 dollars", "72%", "(72)", "\\(72\\)", "- Total: 72 clips", "| total | 72 |",
    "It is not 73 but 72.", "She has 5 apples, so 72.", "72\n\nI hope this helps!",
    "<answer>She sold 72 clips</answer>", "<answer>The answer is 72.</answer>",
    "<answer>\\boxed{72}</answer>", "\\boxed{73} is tempting but #### 72",
    "The answer is 73. \\boxed{72}", "#### 73 <answer>72</answer>", "<answer>72",
])
def test_numeric_right(text):
  assert num(text).correct, answers.read_final_answer(text)


@pytest.mark.parametrize("text, answer", [
    ("<answer>1,200</answer>", "1200"), ("<answer>$1,200.</answer>", "1200"),
    ("The answer is 1,234,567.", "1234567"), ("\\boxed{1{,}200}", "1200"),
    ("<answer>The answer is 1,200 dollars.</answer>", "1200"), ("<answer>1200,</answer>", "1200"),
    ("<answer>The total is 1,200, so that is it</answer>", "1200"), ("#### -3", "-3"),
    ("It is \u22123 degrees.", "-3"), ("She owes -$5.", "-5"), ("pay $-5 now", "-5"),
    ("#### 7.25", "7.25"), ("\\boxed{7.250}", "7.25"), ("\\boxed{0.5}", "0.5"),
])
def test_numeric_right_forms(text, answer):
  assert num(text, answer).correct, answers.read_final_answer(text)


def test_numeric_exact_comparison():
  # Exact rationals: no float tolerance lets a near miss through.
  assert not num("0.30000000000000004", "0.3").correct
  assert num("0.3", "0.3").correct
  big = "123456789012345678901234"  # 24 digits: exact, where a float would round
  assert num(big, big).correct and not num(big[:-1] + "5", big).correct


def test_read_final_answer_rules():
  read = answers.read_final_answer
  assert read("so 5\n#### 72 \n\\boxed{6} the answer is 7").rule == "####"
  assert read("#### Step 2: think\nthe answer is 7 \\boxed{72}") == answers.Reading(72, Status.CORRECT, "boxed", False)
  assert read("the answer is 72. Next, 5 more") == answers.Reading(72, Status.CORRECT, "answer is", False)
  assert read("The answer is below.\n72").rule == "last number"  # no number in the sentence
  assert read("<answer>72</answer> #### 5") == answers.Reading(72, Status.CORRECT, "tag", True)
  assert read("<answer>Answer: 72</answer>").rule == "answer is"
  # A rule that finds its marker decides, even when it refuses the span.
  assert read("\\boxed{100-28} so 28").status == Status.NOT_PLAIN
  assert read("\\boxed{72").status == Status.PARSE_ERROR
  assert read("\\boxed{" + "7" * 300 + "}").status == Status.TOO_LONG


def test_numeric_statuses_and_format():
  assert num("many apples") == answers.Verdict(False, False, Status.NO_ANSWER)
  assert num("<answer>many</answer>") == answers.Verdict(False, False, Status.PARSE_ERROR)
  assert num("<answer>73</answer>") == answers.Verdict(False, True, Status.WRONG_ANSWER)
  assert num("73") == answers.Verdict(False, False, Status.WRONG_ANSWER)
  assert num("<answer>72</answer>") == answers.Verdict(True, True, Status.CORRECT)
  assert num("so 72") == answers.Verdict(True, False, Status.CORRECT)  # right, but no answer tag
  assert num("<answer>-3</answer>", "-3").correct
  assert num("<answer>" + "9" * 40 + "</answer>", "1").status == Status.NUMBER_TOO_LARGE
  assert num("<answer>" + "1 " * 200 + "</answer>").status == Status.TOO_LONG
  with pytest.raises(ValueError, match="'answer'"):
    num("<answer>1</answer>", "n/a")
  with pytest.raises(ValueError, match="'answer'"):
    num("<answer>5</answer>", "5 apples")


def test_gsm8k_final_answer():
  assert gsm8k_data.gsm8k_final_answer("She has 3+4=<<3+4=7>>7 apples.\n#### 7") == "7"
  assert gsm8k_data.gsm8k_final_answer("...\n#### 1,000") == "1000"
  assert gsm8k_data.gsm8k_final_answer("...\n#### $-2.50") == "-2.50"
  with pytest.raises(ValueError, match="####"):
    gsm8k_data.gsm8k_final_answer("no final line")
  for bad in ("seven", "5 apples", "1,00", "3/4", "1e3", "072", "7 or 8"):
    with pytest.raises(ValueError, match="not a plain number"):
      gsm8k_data.gsm8k_final_answer(f"#### {bad}")


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
  with pytest.raises(ValueError, match="unknown task"):
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
  assert countdown_task.verify_countdown(f"<answer>{deep}</answer>", (3, 5, 2), 16,
                                  answers.Limits(max_depth=64)).correct
  assert cd("<answer>" + "9" * 30 + "</answer>").status == Status.NUMBER_TOO_LARGE
  assert cd("<answer>" + "1+" * 200 + "1</answer>").status == Status.TOO_LONG
