"""Numeric verifier fuzz: for random integer and decimal answers, many wrong-answer forms
(expressions holding the answer, negations, hedges, exponents, other bases, near misses,
lists) score 0 and the right-answer forms (####, boxed, "the answer is", a closing
sentence, thousands separators, trailing zeros, $) score 1. Seeded: the same cases every run."""
import random
import time
from decimal import Decimal

import numpy as np
import pytest

from gspo_jax import answers, rewards

SEED = 20240611
N_ANSWERS = 250
_ARABIC_INDIC = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")
_FULLWIDTH = str.maketrans("0123456789", "\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19")


def _answer(rng):
  """A random answer: an integer of 1 to 10 digits or a decimal with 1 to 3 places, either sign."""
  value = Decimal(rng.randrange(10 ** rng.choice([1, 1, 2, 3, 4, 5, 7, 10])))
  if rng.random() < 0.4:
    places = rng.randint(1, 3)
    value += Decimal(rng.randrange(10 ** (places - 1)) * 10 + rng.randint(1, 9)).scaleb(-places)
  return -value if rng.random() < 0.25 else value


def _text(d):
  return format(d, "f")


def _near_misses(rng, d):
  """Numbers close to d (off by one, a sign, a digit, a place), none equal to it."""
  out = [d + 1, d - 1, d + Decimal("0.1"), d * 10 + (1 if d == 0 else 0), d + rng.randint(2, 999)]
  if d != 0:
    out += [-d, d / 10]
  return [x for x in out if x != d]


def _bad_grouping(rng, digits):
  """``digits`` with commas that are not groups of three (1,00 / 12,34 / 1,2,345)."""
  while True:
    cuts = sorted(rng.sample(range(1, len(digits)), rng.randint(1, len(digits) - 1)))
    parts = [digits[i:j] for i, j in zip([0] + cuts, cuts + [len(digits)])]
    if len(parts[0]) > 3 or any(len(p) != 3 for p in parts[1:]):
      return ",".join(parts)


def right_forms(rng, d):
  a, g = _text(d), format(d, ",f")
  x, y, z = (rng.randint(1, 999) for _ in range(3))
  w = _text(rng.choice(_near_misses(rng, d)))
  forms = [
      a, f"#### {a}", f"She sold {x} and then {y}.\n{x} + {y} = {z}\n#### {a}", f"#### {g}",
      f"\\boxed{{{a}}}", f"So the answer is $\\boxed{{{a}}}$.", f"\\boxed{{{g.replace(',', '{,}')}}}",
      f"The answer is {a}.", f"the answer is {g}", f"THE FINAL ANSWER IS {a}!", f"Answer: **{a}**",
      f"First {x} + {y} = {z}. So in total she has {a} apples.", f"{x} + {y} = {a}",
      f"Therefore, the total is {g}.", f"<answer>{a}</answer>", f"<answer>{g}</answer>",
      f"<answer>The answer is {a}.</answer>", f"<answer>She pays ${a}.</answer>",
      f"It costs ${g}.", f"{a} dollars", f"{a}%", f"It is not {w} but {a}.",
      f"\\boxed{{{w}}} was a slip.\n#### {a}", f"The answer is {w}. Checking again: \\boxed{{{a}}}",
      f"#### {w}\n<answer>{a}</answer>", f"{a}\n\nI hope this helps!",
  ]
  forms += [f"{a}.0", f"The answer is {a}.00.", f"#### {g}.000"] if "." not in a else [f"{a}0", f"\\boxed{{{g}00}}"]
  if d < 0:
    forms.append(f"She owes -${_text(-d)}.")
  return forms


def wrong_forms(rng, d):
  a = _text(d)
  x = rng.randint(1, 999)
  w = _text(rng.choice(_near_misses(rng, d)))
  forms = [
      # Expressions that contain the answer.
      f"{x}-{a}", f"{x} - {a}", f"{a}+0", f"{a} + 0", f"{a}*1", f"{a} * 1", f"{a}/1", f"1/{a}",
      f"{x}/{a}", f"{x} minus {a}", f"{x} times {a}", f"{a} = {x} - {w}", f"\\boxed{{{x}-{a}}}",
      f"<answer>{a}+0</answer>", f"The answer is {x} + {a}.", f"#### {a}*1",
      f"\\boxed{{\\frac{{{a}}}{{1}}}}",
      # Negations and hedges.
      f"not {a}", f"It is not {a}.", f"The answer isn't {a}.", f"The answer is not {a}",
      f"\\boxed{{not {a}}}", f"#### not {a}", f"<answer>not {a}</answer>", f"{a} is wrong",
      f"It can't be {a}", f"about {a}", f"approximately {a}", f"roughly {a} apples",
      f"at least {a}", f"at most {a}", f"more than {a}", f"less than {a}", f"maybe {a}",
      f"\u2248 {a}", f"{a} or {w}", f"{w} or {a}", f"either {w} or {a}", f"{a} or so",
      f"\\boxed{{{a} or {w}}}", f"The answer is {a} or {w}.",
      # Exponents and scientific notation.
      f"{a}e0", f"{a}E0", f"{a}e+0", f"{d:e}", f"{d:E}", f"{d * 10:f}e-1", f"{a}\u00b2",
      f"{a}^1", f"{a} ^ 1", f"{a}**1", f"{a} x 10^0", f"{a}\u00d710^0", f"The answer is {a}e0.",
      # Read out of a larger construct: fractions, magnitudes, other digits, attached words.
      f"{a} 1/2", f"{a}\u00bd", f"{a} and a half", f"{a} thousand", f"{a}k", f"{a} million",
      f"{a}th", f"{a}-ish", f"#{a}", f"12:{a}", a.translate(_ARABIC_INDIC), a.translate(_FULLWIDTH),
      # Near misses, in every span.
      w, f"#### {w}", f"\\boxed{{{w}}}", f"The answer is {w}.", f"<answer>{w}</answer>",
      # The answer with another number after it, or in a list.
      f"{a} {w}", f"{a}, {w}", f"{a} and {w}", f"She has {a} apples. Later {w}.", f"{a}\n{w}",
      f"{w} {a}", f"{w}, {a}", f"{w} and {a}", f"from {w} to {a}", f"<answer>{a} {w}</answer>",
      f"<answer>{w}, {a}</answer>", f"\\boxed{{{a}, {w}}}", f"#### {a} {w}",
  ]
  digits = a.lstrip("-").partition(".")[0]
  if "." not in a:
    if d >= 0:  # other bases
      forms += [f"0x{a}", f"0b{a}", f"0o{a}", hex(int(d)), bin(int(d)), f"0{a}"]
    if d != 0:
      forms += [f"{a}0", f"#### {a}0"]
  if len(digits) >= 2:
    bad = a.replace(digits, _bad_grouping(rng, digits), 1)
    forms += [bad, f"#### {bad}", f"The answer is {bad}."]
  if "." in a:  # a decimal comma: 7,25 for 7.25
    forms.append(a.replace(".", ","))
  return forms


def _cases():
  rng = random.Random(SEED)
  answers = [_answer(rng) for _ in range(N_ANSWERS)]
  answers += [Decimal(0), Decimal(72), Decimal(-3), Decimal(1000), Decimal("0.5")]
  return [(d, right_forms(rng, d), wrong_forms(rng, d)) for d in answers]


CASES = _cases()


def test_case_count():
  n = sum(len(r) + len(w) for _, r, w in CASES)
  assert n > 20_000, n


@pytest.mark.parametrize("i", range(0, len(CASES), 25))
def test_right_forms_score_one_wrong_forms_zero(i):
  for d, right, wrong in CASES[i : i + 25]:
    for truth in (_text(d), format(d, ",f")):  # the reference as GSM8K writes it, commas or not
      r, comps, counts = rewards.score("gsm8k", right, [{"answer": truth}] * len(right))
      bad = [(t, answers.read_final_answer(t)) for t, ok in zip(right, r) if ok != 1]
      assert not bad, (truth, bad)
      r, comps, counts = rewards.score("gsm8k", wrong, [{"answer": truth}] * len(wrong))
      bad = [(t, answers.read_final_answer(t)) for t, ok in zip(wrong, r) if ok != 0]
      assert not bad, (truth, bad)
      assert counts["verifier_error"] == 0


def test_wrong_forms_count_a_failure_reason():
  # Refusals are counted by reason, not lumped with wrong values.
  _, _, wrong = CASES[0]
  _, _, counts = rewards.score("arithmetic", wrong, [{"answer": _text(CASES[0][0])}] * len(wrong))
  for status in ("hedged", "not_plain_number", "ambiguous", "wrong_answer"):
    assert counts[status] > 0, counts
  assert counts["correct"] == 0 and sum(counts.values()) == len(wrong)


def test_fuzz_is_fast():
  texts = [t for _, r, w in CASES[:50] for t in r + w]
  t0 = time.perf_counter()
  r, _, _ = rewards.score("gsm8k", texts, [{"answer": "1"}] * len(texts))
  dt = time.perf_counter() - t0
  assert np.isfinite(r).all() and dt < 2.0, f"{len(texts)} responses took {dt:.2f} s"


# ---------------------------------------------------------------------------
# boxed_math: single numbers, fractions, tuples and lists, each with the forms a model
# writes for the right answer and with wrong answers that share its digits (a pair read
# as one thousands-separated number, swapped or missing elements, other brackets).

BOXED_SEED = 20261126
N_BOXED = 150


def _boxed_single(rng, d):
  """(references, right, wrong) for the number d."""
  a, g = _text(d), format(d, ",f")
  w = _text(rng.choice(_near_misses(rng, d)))
  mag = _text(abs(d))
  cash = f"-\\${mag}" if d < 0 else f"\\${a}"
  right = [a, f"${a}$", f"\\({a}\\)", cash, cash.replace("\\$", "$"), f"x = {a}", f"x={a}",
           f"\\text{{{a}}}", f"({a})", g, g.replace(",", "{,}"), f"{a}\\%", f"{a}."]
  right += [f"{a}.0", f"{a}.00"] if "." not in a else [f"{a}0"]
  if 0 < abs(d) < 1:
    right.append(a.replace("0.", ".", 1))  # .5
  if d == d.to_integral_value() and d != 0:
    right.append(f"\\frac{{{_text(d * 2)}}}{{2}}")
  wrong = [w, f"x = {w}", f"({a}, {w})", f"{a}, {w}", f"[{a}, {w}]", f"\\{{{a}, {w}\\}}",
           f"{a}e0", f"{a}^2", f"\\sqrt{{{a}}}"]
  if d != 0:
    wrong.append(f"{a}0" if "." not in a else f"{a}1")
  digits = mag.partition(".")[0]
  if len(digits) >= 4:  # the number's thousands as a list: 1, 234 / (1,234) / [1,234]
    wrong += [g.replace(",", ", "), f"({g})", f"[{g}]", f"\\left({g}\\right)"]
    right.append(g.replace(",", "\\,"))  # TeX's thin space between thousands: 1\,234
  if len(digits) >= 2:
    wrong.append(a.replace(digits, _bad_grouping(rng, digits), 1))
    # Digits that a space keeps apart are two numbers (1 2 is not 12), thin space too
    # where three digits do not follow it.
    for sep in (" ", "~", "\\ ", "\\;", "\\:", "\\quad ", "\\,", "\n"):
      wrong.append(a.replace(digits, digits[:-1] + sep + digits[-1], 1))
    wrong.append(a.replace(digits, digits[0] + " " + digits[1:], 1))
  return [a, f"\\boxed{{{a}}}", f"${a}$", g, f"x = {a}"], right, wrong


def _boxed_fraction(rng):
  """(references, right, wrong) for p/q in lowest terms, q > 1."""
  from fractions import Fraction
  while True:
    f = Fraction(rng.randint(-99, 99), rng.randint(2, 99))
    if f.denominator > 1:
      break
  sign, p, q = "-" if f < 0 else "", abs(f.numerator), f.denominator
  frac = f"{sign}\\frac{{{p}}}{{{q}}}"
  right = [frac, frac.replace("\\frac", "\\dfrac"), frac.replace("\\frac", "\\tfrac"),
           f"{sign}{p}/{q}", f"{sign}\\frac{{{2 * p}}}{{{2 * q}}}", f"${frac}$", f"x = {frac}"]
  if all(c in "25" for c in _prime_factors(q)):  # a finite decimal: 0.25 and .25
    dec = _text(Decimal(f.numerator) / Decimal(f.denominator))
    right += [dec, dec.replace("0.", ".", 1)]
  wrong = [f"{sign}\\frac{{{q}}}{{{p}}}" if p != q else "0", f"{sign}\\frac{{{p + 1}}}{{{q}}}",
           f"{sign}{p}", f"{sign}{p},{q}", f"({sign}{p}, {q})", f"{sign}0.{p}{q}"]
  return [frac, f"{sign}{p}/{q}"], right, wrong


def _prime_factors(n):
  out, k = "", 2
  while n > 1:
    while n % k == 0:
      out, n = out + str(k), n // k
    k += 1
  return out


def _boxed_tuple(rng):
  """(references, right, wrong) for a pair or triple of integers, the second often of three
  digits (so that "1,234" could be misread as one number)."""
  n = rng.choice([2, 2, 3])
  xs = [rng.randint(-99, 999) for _ in range(n)]
  if rng.random() < 0.5:
    xs[1] = rng.randint(100, 999)
  xs[0] = abs(xs[0]) or 1
  t = [str(x) for x in xs]
  spaced, tight = ", ".join(t), ",".join(t)
  right = [f"({spaced})", f"({tight})", f"\\left( {spaced} \\right)", f"$({spaced})$",
           f"( {' , '.join(t)} )", "(" + ", ".join(f"{x}.0" for x in t) + ")",
           "(" + ", ".join([f"\\frac{{{2 * xs[0]}}}{{2}}"] + t[1:]) + ")"]
  wrong = ["".join(t), tight if n == 2 else "".join(t) + "0", spaced, f"[{spaced}]",
           f"\\{{{spaced}\\}}", f"({', '.join(reversed(t))})" if t != t[::-1] else f"({t[0]})",
           f"({spaced}, 0)", f"({', '.join(t[:-1])})", f"({', '.join([str(xs[0] + 1)] + t[1:])})",
           "{,}".join(t), t[0], t[-1]]
  return [f"({spaced})", f"({tight})", f"\\boxed{{({spaced})}}"], right, wrong


def _boxed_cases():
  rng = random.Random(BOXED_SEED)
  cases = []
  for _ in range(N_BOXED):
    kind = rng.random()
    if kind < 0.5:
      cases.append(_boxed_single(rng, _answer(rng)))
    elif kind < 0.7:
      cases.append(_boxed_fraction(rng))
    else:
      cases.append(_boxed_tuple(rng))
  cases += [_boxed_single(rng, Decimal(d)) for d in ("1234", "0.5", "-0.25", "1000000")]
  return cases


BOXED_CASES = _boxed_cases()


def _boxed_scores(texts, reference):
  metas = [{"verifier": "boxed_math", "answer": reference}] * len(texts)
  r, _, counts = rewards.score("file", texts, metas)
  assert counts["verifier_error"] == 0
  return r


@pytest.mark.parametrize("i", range(0, len(BOXED_CASES), 40))
def test_boxed_math_right_forms_score_one_wrong_forms_zero(i):
  for refs, right, wrong in BOXED_CASES[i : i + 40]:
    # Each form boxed, boxed in a sentence, and (no box) in the answer tag.
    right_texts = [t for f in right for t in (f"\\boxed{{{f}}}", f"So $\\boxed{{{f}}}$.", f"<answer>{f}</answer>")]
    wrong_texts = [t for f in wrong for t in (f"\\boxed{{{f}}}", f"<answer>{f}</answer>")]
    for ref in refs:
      r = _boxed_scores(right_texts, ref)
      assert r.all(), (ref, [t for t, ok in zip(right_texts, r) if not ok])
      r = _boxed_scores(wrong_texts, ref)
      assert not r.any(), (ref, [t for t, ok in zip(wrong_texts, r) if ok])


def test_boxed_math_fuzz_count_and_speed():
  texts = [f"\\boxed{{{f}}}" for _, right, wrong in BOXED_CASES for f in right + wrong]
  n = sum(len(refs) * (3 * len(right) + 2 * len(wrong)) for refs, right, wrong in BOXED_CASES)
  assert n > 15_000, n
  t0 = time.perf_counter()
  _boxed_scores(texts, "(1, 234)")
  dt = time.perf_counter() - t0
  assert dt < 1.0, f"{len(texts)} responses took {dt:.2f} s"
