r"""Reading a response's final answer: the answer tags, numbers, TeX, and the verdict.

The prompt format of every task asks for the final answer inside
``<answer>...</answer>`` (:data:`ANSWER_OPEN`, :data:`ANSWER_CLOSE`): the last such
span of a response holds the answer. The closing tag is required, so a sampler that
stops on ``</answer>`` must keep the stop string in the response text.

A verifier (each task's, :mod:`gspo_jax.tasks`; a user's file's by name,
:mod:`gspo_jax.verifiers`) returns a :class:`Verdict` with a :class:`Status`; garbage
text gets a failure status, never an exception. Every parse is bounded by
:class:`Limits`. Model output is never passed to ``eval`` or ``exec``.

Numeric answers (arithmetic, GSM8K, a file's ``numeric``; :func:`read_final_answer`).
The final-answer span is chosen by the first of these rules that finds its marker; a later rule
is never consulted, even when that span is refused:

1. The last ``<answer>...</answer>`` span. Rules 2-4 then look inside it only;
   without their markers the whole content is the span.
2. ``#### N``: the last ``####`` followed by a number, to the end of its line
   (GSM8K's convention).
3. ``\\boxed{...}``: the content of the last one.
4. ``answer is`` / ``answer:`` in any case ("The final answer is 72.",
   "Answer: 72"): the last one, to the end of its sentence or line, if that
   holds a number.
5. Otherwise (no answer tag) the last number of the text, with the rest of its
   sentence back to the number before it.

A span must state exactly one number (else AMBIGUOUS) and it must be plain (else
NOT_PLAIN): an optional ``-`` and ``$`` (``$18``, ``-$5``), ASCII digits without a
leading zero, thousands commas in groups of three (``1,234,567``; not ``1,00``),
an optional decimal part (``72.0`` and ``72.00`` are 72); around it only quotes,
brackets, markdown emphasis, ``$...$``, a trailing ``%`` (GSM8K writes 25% as 25)
and punctuation. Words around it are allowed ("she has 72 apples", "18
dollars"; units are not converted) unless they take it back or hedge it (HEDGED:
``not 72``, ``isn't 72``, ``about 72``, ``at least 72``, ``72 or 73``, ``~72``)
or make it part of something larger (NOT_PLAIN: ``100 minus 28``, ``72
thousand``, ``72 and a half``). So ``100-28``, ``1/2``, ``3*4``, ``72e-1``,
``1.5e3``, ``7²``, ``7^2``, ``0x48``, ``0b11``, ``½``, ``72nd`` and non-ASCII
digits are refused, never read as the number inside them. In free text (rule 5)
a number that follows another one of its sentence with nothing but punctuation or
list words between (``72, 73``, ``70 to 72``, ``3 x 4``) is AMBIGUOUS, while ``48
+ 24 = 72`` states 72. A few LaTeX forms are read (``\\text{...}``, ``\\$``, ``\\%``,
``1{,}000``, ``\\(...\\)``); others (``\\frac``) are refused. The reference answer
must be a plain number with no words (:func:`parse_number`).

The other verifiers of a user's file read with :func:`normalize_text` (``exact_match``)
and :func:`boxed_answer` and :func:`normalize_math` (``boxed_math``).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from fractions import Fraction
from typing import Any, Mapping, NamedTuple, Sequence

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


class Status(str, enum.Enum):
    """Outcome of verifying one response. Everything but CORRECT is a failure."""

    CORRECT = "correct"
    WRONG_ANSWER = "wrong_answer"  # parsed, valid, but not the right value
    NO_ANSWER = "no_answer"  # Countdown: no <answer>...</answer> span; numeric: no number at all
    PARSE_ERROR = "parse_error"  # not a valid expression; numeric: the answer span holds no number
    NOT_PLAIN = "not_plain_number"  # numeric: a number inside a larger construct (1/2, 72e-1, 0x48)
    HEDGED = "hedged"  # numeric: negated, hedged or compared ("not 72", "about 72", "72 or 73")
    AMBIGUOUS = "ambiguous"  # numeric: more than one number where one answer belongs ("72, 73")
    WRONG_NUMBERS = "wrong_numbers"  # Countdown: not each given number exactly once
    DIV_BY_ZERO = "div_by_zero"  # Countdown: division by zero
    TOO_LONG = "too_long"  # answer content longer than the limit
    TOO_DEEP = "too_deep"  # parenthesis nesting deeper than the limit
    NUMBER_TOO_LARGE = "number_too_large"  # a literal with more digits than the limit
    VERIFIER_ERROR = "verifier_error"  # an unexpected exception (a bug); logged
    REWARD_FN_ERROR = "reward_fn_error"  # a plug-in reward function raised or gave no finite float
    REWARD_FN_TIMEOUT = "reward_fn_timeout"  # a plug-in reward function ran past its time limit


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds that keep verification time and memory small on any input.

    Attributes:
      max_answer_chars: longest answer-tag content, or numeric final-answer span,
        that is parsed at all.
      max_depth: deepest parenthesis nesting in a Countdown expression.
      max_digits: most digits in one literal.
    """

    max_answer_chars: int = 256
    max_depth: int = 32
    max_digits: int = 24


DEFAULT_LIMITS = Limits()
# For reference answers, which come from the dataset, not the model.
REFERENCE_LIMITS = Limits(max_answer_chars=10**6, max_digits=10**6)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Result for one response: correctness, format, and the status."""

    correct: bool
    formatted: bool
    status: Status
    reward: float | None = None  # a plug-in reward function's value; None: ``float(correct)``


def extract_answer(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` span, or None. O(len(text))."""
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN) : end]


# ---------------------------------------------------------------------------
# Numeric answers. The rules are in the module docstring.

_UNICODE_MINUS = "\u2212"
# A plain number: "-" and "$" in either order, digits without a leading zero,
# thousands commas only in complete groups of three, an optional decimal part.
_PLAIN_RE = re.compile(
    r"(-\$|\$-|-|\$|)(0|[1-9][0-9]{0,2}(?:,[0-9]{3})+|[1-9][0-9]*)(?:\.([0-9]+))?", re.ASCII
)


def _parse_plain(s: str, limits: Limits) -> Fraction | Status:
    """Exact value of ``s`` if it is a plain number (`_PLAIN_RE`), else the failure status."""
    m = _PLAIN_RE.fullmatch(s)
    if m is None:
        return Status.NOT_PLAIN
    sign, digits, frac = m.group(1), m.group(2).replace(",", ""), m.group(3) or ""
    if len(digits) + len(frac) > limits.max_digits:
        return Status.NUMBER_TOO_LARGE
    value = Fraction(int(digits + frac), 10 ** len(frac))
    return -value if "-" in sign else value


def parse_number(s: str, limits: Limits = DEFAULT_LIMITS) -> Fraction | None:
    """Exact value of a plain number: ``72``, ``-3``, ``$18``, ``-$5``, ``1,234.50``, ``18.``.

    The form a reference answer must have (GSM8K's ``#### N``): surrounding
    whitespace, one ``-`` (or U+2212) and one ``$`` in either order, ASCII digits
    without a leading zero, thousands commas in groups of three, an optional
    decimal part, and a trailing period. Returns None for anything else
    (``1,00``, ``072``, ``1e5``, ``0x48``, ``1/2``, ``5 apples``, ``٣``).
    """
    s = s.strip().replace(_UNICODE_MINUS, "-")
    if s.endswith("."):
        s = s[:-1]
    value = _parse_plain(s, limits)
    return value if isinstance(value, Fraction) else None


class _Token(NamedTuple):
    text: str
    line_start: bool  # the first token of its line
    number: bool  # holds a numeric character of any script (7, ², ½, ٣)


# Runs of non-space characters; "=" and ":" are tokens of their own (except the
# ":" of "12:30"), so "48+24=72" ends with the token "72".
_TOKEN_RE = re.compile(r"=|:|(?:[^\s=:]|(?<=[0-9]):(?=[0-9]))+")


def _tokens(text: str) -> list[_Token]:
    tokens, end = [], 0
    for m in _TOKEN_RE.finditer(text):
        tok = m.group()
        line_start = not tokens or "\n" in text[end : m.start()]
        tokens.append(_Token(tok, line_start, any(map(str.isnumeric, tok))))
        end = m.end()
    return tokens


# Around a number, characters that only quote, emphasise or punctuate it.
_OPENERS = "([{\"'`*_$\u201c\u2018"
_CLOSERS = ")]}\"'`*_$%\u201d\u2019"
_TERMINATORS = ".!?;:\u2026"
_PUNCT = frozenset(_OPENERS + _CLOSERS + _TERMINATORS + ",#=|\u2014")
_PUNCT_CHARS = "".join(sorted(_PUNCT))


def _read_number_token(tok: str, limits: Limits) -> tuple[Fraction | Status, bool]:
    """Value of a token that holds a number, and whether a terminator (``.!?;:``)
    followed the number. Only quotes, brackets, markdown emphasis, ``$`` and a
    trailing ``%`` or punctuation may surround it: ``72e-1``, ``0x48``, ``1/2``,
    ``100-28``, ``7²``, ``72nd`` and ``1,00`` are NOT_PLAIN."""
    s = tok.replace(_UNICODE_MINUS, "-")
    t = s.rstrip(_CLOSERS + _TERMINATORS + ",")
    closed = any(c in _TERMINATORS for c in s[len(t) :])
    return _parse_plain(t.lstrip(_OPENERS), limits), closed


def _ends_sentence(tokens: list[_Token], i: int) -> bool:
    """Whether a sentence (or line) ends after token ``i``."""
    if i + 1 == len(tokens) or tokens[i + 1].line_start:
        return True
    return tokens[i].text.rstrip(_CLOSERS)[-1:] in (".", "!", "?")


# Words on either side of an answer number that take it back or hedge it
# ("not 72", "about 72", "72 or so", "72 is wrong").
_HEDGE_WORDS = frozenset(
    "not no never nor neither none nothing cannot without except instead rather wrong "
    "incorrect false or either approximately approx about around roughly nearly almost "
    "circa maybe perhaps possibly probably likely guess estimate estimated".split()
)
_HEDGE_SIGNS = frozenset("~\u2248\u2243\u2245\u223c<>\u2264\u2265\u00b1")
# Before the number, words that compare it ("more than 72", "at least 72", "over
# 72"); after it they state a difference ("72 more than Tommy") and are allowed.
_COMPARISON_WORDS = frozenset("than least over under above below between exceeds".split())
# Before the number, words that make it an operand ("100 minus 28", "3 times 72").
_OPERATOR_WORDS = frozenset(
    "plus minus times multiplied divided power root sqrt mod modulo".split()
)
# Right after the number (past "and", "a", "an"), words that raise, scale or extend
# it ("7 squared", "72 thousand", "72 and a half"); later ones ("6 barrels on the
# third day") and "72 times" (a count) are allowed.
_EXTENSION_WORDS = frozenset(
    "squared cubed factorial hundred hundreds thousand thousands million millions billion "
    "billions trillion trillions k bn dozen dozens half halves third thirds quarter quarters "
    "fourth fourths fifth fifths tenth tenths hundredth hundredths thousandth thousandths "
    "point zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty "
    "seventy eighty ninety".split()
)
# Between two numbers of one sentence, words that make them a list, a range or a
# product ("72 and 73", "70 to 72", "3 x 4"), so the second states no answer alone.
_LIST_WORDS = frozenset("and or to through then vs versus x by of out from till until".split())
_BULLETS = frozenset("-*+\u2022\u2013")
_WORD_RE = re.compile(r"[^\W\d_]+(?:['\u2019/-][^\W\d_]+)*")


def _context_status(tokens: Sequence[_Token], *, after: bool) -> Status | None:
    """The failure status that the tokens before (``after=False``) or after an
    answer number give it, or None when they are plain words and punctuation."""
    prev, next_extends = "", after
    for i, tok in enumerate(tokens):
        if all(c in _PUNCT for c in tok.text):
            if after and "=" in tok.text:  # "72 = 8*9": the number is one side of an equation
                return Status.NOT_PLAIN
            continue
        if tok.line_start and tok.text in _BULLETS and (after or i + 1 < len(tokens)):
            continue  # "- Total: 72"; but "- 72" may be a minus sign
        core = tok.text.strip(_PUNCT_CHARS)
        if not _WORD_RE.fullmatch(core):  # a symbol: "-", "/", "~", "\times"
            return Status.HEDGED if _HEDGE_SIGNS & set(core) else Status.NOT_PLAIN
        word = core.lower()
        if word.endswith(("n't", "n\u2019t")):  # isn't, wasn't, can't
            return Status.HEDGED
        for part in re.split(r"[/-]", word):
            if part in _HEDGE_WORDS:
                return Status.HEDGED
            if next_extends and part in _EXTENSION_WORDS:
                return Status.NOT_PLAIN
            if not after and (part in _COMPARISON_WORDS or (part == "most" and prev == "at")):
                return Status.HEDGED
            if not after and part in _OPERATOR_WORDS:
                return Status.NOT_PLAIN
        prev, next_extends = word, next_extends and word in ("and", "a", "an")
    return None


def _separates(tokens: Sequence[_Token]) -> bool:
    """Whether the tokens between two numbers of a sentence make the second a
    statement of its own ("= 72", "so she has 72") rather than a list ("72, 73")."""
    for tok in tokens:
        core = tok.text.strip(_PUNCT_CHARS).lower()
        if tok.text == "=" or (_WORD_RE.fullmatch(core) and core not in _LIST_WORDS):
            return True
    return False


def _read_span(span: str, limits: Limits) -> tuple[Fraction | None, Status]:
    """The number a final-answer span states: exactly one number, plain, in its
    span's only sentence, with words around it that neither take it back nor
    extend it. Status CORRECT when a number was read."""
    if len(span) > limits.max_answer_chars:
        return None, Status.TOO_LONG
    tokens = _tokens(span)
    at = [i for i, tok in enumerate(tokens) if tok.number]
    if not at:
        return None, Status.PARSE_ERROR
    if len(at) > 1:
        return None, Status.AMBIGUOUS
    k = at[0]
    value, closed = _read_number_token(tokens[k].text, limits)
    if not isinstance(value, Fraction):
        return None, value
    if closed and k + 1 < len(tokens):  # "#### 2. Compute the total"
        return None, Status.AMBIGUOUS
    status = _context_status(tokens[:k], after=False) or _context_status(
        tokens[k + 1 :], after=True
    )
    return (None, status) if status else (value, Status.CORRECT)


def _read_last_number(text: str, limits: Limits) -> tuple[Fraction | None, Status]:
    """The last number of free text, read with the rest of its sentence back to
    the number before it: ``so she has 72 apples.`` and ``48 + 24 = 72`` give 72;
    ``not 72``, ``100 - 28``, ``72, 73`` and ``72 thousand`` give a failure status."""
    tokens = _tokens(text)
    at = [i for i, tok in enumerate(tokens) if tok.number]
    if not at:
        return None, Status.NO_ANSWER
    k = at[-1]
    value, _ = _read_number_token(tokens[k].text, limits)
    if not isinstance(value, Fraction):
        return None, value
    start, end = k, k
    while start > 0 and not _ends_sentence(tokens, start - 1):
        start -= 1
    while not _ends_sentence(tokens, end):
        end += 1
    prev = at[-2] if len(at) > 1 else -1
    lead = tokens[max(start, prev + 1) : k]
    status = _context_status(lead, after=False) or _context_status(
        tokens[k + 1 : end + 1], after=True
    )
    if status is None and prev >= start and not _separates(lead):
        status = Status.AMBIGUOUS
    return (None, status) if status else (value, Status.CORRECT)


# LaTeX that model answers wrap numbers in: \text{ apples}, \$, \%, 1{,}000, \(72\).
_TEX_TEXT_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_TEX_REPLACEMENTS = (
    ("\\$", "$"),
    ("\\%", "%"),
    ("{,}", ","),
    ("\\,", " "),
    ("\\ ", " "),
    ("\\(", " "),
    ("\\)", " "),
    ("\\[", " "),
    ("\\]", " "),
)
_GSM8K_MARK_RE = re.compile(r"####[ \t]*(?=[-\u2212$*(]*[0-9])")
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_ANSWER_IS_RE = re.compile(r"\banswer\s*(?:is\b|:)", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"[.!?](?=\s|$)|\n")


def _untex(text: str) -> str:
    text = _TEX_TEXT_RE.sub(r" \1 ", text)
    for old, new in _TEX_REPLACEMENTS:
        text = text.replace(old, new)
    return text


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    m = None
    for m in pattern.finditer(text):
        pass
    return m


def _boxed_content(text: str, m: re.Match, limits: Limits) -> str | Status:
    """The brace-balanced content of the ``\\boxed{`` that ``m`` matched."""
    depth, stop = 1, min(len(text), m.end() + limits.max_answer_chars + 1)
    for i in range(m.end(), stop):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[m.end() : i]
    return Status.TOO_LONG if stop < len(text) else Status.PARSE_ERROR


def _final_span(region: str, limits: Limits) -> tuple[str, str | Status] | None:
    """(rule, span) of the first rule after the answer tag that finds its marker
    in ``region``, or None when none does."""
    m = _last_match(_GSM8K_MARK_RE, region)
    if m:
        end = region.find("\n", m.end())
        return "####", region[m.end() : end if end >= 0 else len(region)]
    m = _last_match(_BOXED_RE, region)
    if m:
        return "boxed", _boxed_content(region, m, limits)
    m = _last_match(_ANSWER_IS_RE, region)
    if m:
        end = _SENTENCE_END_RE.search(region, m.end())
        span = region[m.end() : end.start() if end else len(region)]
        if any(map(str.isnumeric, span)):  # else "The answer is below:" states none
            return "answer is", span
    return None


@dataclasses.dataclass(frozen=True)
class Reading:
    """The final answer read from a response.

    Attributes:
      value: the number, or None when none was read.
      status: CORRECT when a number was read, else why not (NO_ANSWER, PARSE_ERROR,
        NOT_PLAIN, HEDGED, AMBIGUOUS, TOO_LONG, NUMBER_TOO_LARGE).
      rule: the rule that chose the span: "####", "boxed", "answer is", "tag" (the
        whole answer-tag content), "last number", or "" (the answer tag is too long).
      tagged: the response has an ``<answer>...</answer>`` span.
    """

    value: Fraction | None
    status: Status
    rule: str
    tagged: bool


def read_final_answer(text: str, limits: Limits = DEFAULT_LIMITS) -> Reading:
    """The final answer a response states, by the rules of the module docstring.

    Linear in ``len(text)``; a span is parsed only up to ``limits.max_answer_chars``.
    """
    content = extract_answer(text)
    tagged = content is not None
    if tagged and len(content) > limits.max_answer_chars:
        return Reading(None, Status.TOO_LONG, "", True)
    if tagged:
        region = _untex(content)
    else:  # An unclosed tag marks nothing: "<answer>72" reads like "72".
        region = _untex(text.replace(ANSWER_OPEN, " ").replace(ANSWER_CLOSE, " "))
    found = _final_span(region, limits)
    if found is None:
        rule, span = ("tag", region) if tagged else ("last number", None)
    else:
        rule, span = found
    if span is None:
        value, status = _read_last_number(region, limits)
    elif isinstance(span, Status):
        value, status = None, span
    else:
        value, status = _read_span(span, limits)
    return Reading(value, status, rule, tagged)


def verify_numeric(text: str, answer: str | int, limits: Limits = DEFAULT_LIMITS) -> Verdict:
    """Arithmetic / GSM8K check: the final answer (:func:`read_final_answer`)
    equals ``answer`` exactly. ``formatted`` is True when the response has an
    answer tag and a number was read.

    Raises:
      ValueError: if ``answer`` (the dataset's ground truth, not model output)
        is not a plain number (:func:`parse_number`).
    """
    truth = parse_number(str(answer), REFERENCE_LIMITS)
    if truth is None:
        raise ValueError(f"meta 'answer' is not a number: {answer!r}")
    reading = read_final_answer(text, limits)
    if reading.value is None:
        return Verdict(False, False, reading.status)
    if reading.value != truth:
        return Verdict(False, reading.tagged, Status.WRONG_ANSWER)
    return Verdict(True, reading.tagged, Status.CORRECT)


def check_numeric_meta(task: str, meta: Mapping[str, Any]) -> None:
    """A numeric task's example ``meta`` holds ``"answer"``, a plain number; else
    ValueError (the dataset's ground truth is wrong, not the model)."""
    if "answer" not in meta:
        raise ValueError(f"{task} meta needs 'answer', got keys {sorted(meta)}")
    if parse_number(str(meta["answer"]), REFERENCE_LIMITS) is None:
        raise ValueError(f"{task} meta 'answer' is not a number: {meta['answer']!r}")


def verify_numeric_meta(
    text: str, meta: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS
) -> Verdict:
    """:func:`verify_numeric` against an example's ``meta`` ``{"answer"}``."""
    return verify_numeric(text, meta["answer"], limits)


# ---------------------------------------------------------------------------
# Normal forms for exact_match and boxed_math.


def normalize_text(s: str) -> str:
    """Whitespace runs as one space, ends stripped: ``exact_match``'s normalisation."""
    return " ".join(s.split())


_TEX_FRAC_RE = re.compile(r"\\[dt]?frac(?![a-zA-Z])")
_TEX_SIZING_RE = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])")
# TeX's spacing: named spaces as the symbols they are (\thinspace is \,), then every
# positive space as whitespace; \! (a negative thin space) closes a gap, opens none.
_TEX_SPACE_WORD_RE = re.compile(
    r"\\(thinspace|negthinspace|quad|qquad|enspace|medspace|thickspace)(?![a-zA-Z])\s*"
)
_TEX_SPACE_WORDS = {"thinspace": "\\,", "negthinspace": "\\!"}
_TEX_SPACE_RE = re.compile(r"\\[,;:> \t\n]|~")
_SIMPLE_PARENS_RE = re.compile(r"(?<![\w)\]}])\((-?[\w.]+)\)(?![\w(\[{])")
# TeX's own thousands separators (1{,}000, 10,\!000, 1\,000; a space after one is
# not typeset): always inside one number.
_TEX_THOUSANDS_RE = re.compile(r"(?<=\d)(?:\{,\}|,\\!|\\,)[ \t]*(?=\d{3}(?!\d))")
# \frac's one-character arguments, apart: "\frac 1 2" is \frac{1}{2} (TeX skips the
# spaces), not \frac of 12.
_TEX_FRAC_SPACED_RE = re.compile(r"(\\[dt]?frac)\s*(\w)\s+(?=\w)")
# Either side of whitespace, a number's end ("1", "1.") and a number's start ("2",
# ".5"): the whitespace keeps them two numbers.
_NUMBER_END_RE = re.compile(r"[0-9]\.?$")
_NUMBER_START_RE = re.compile(r"\.?[0-9]")
# A whole answer that is one number with its thousands in groups of three (an
# assignment's name may precede it): its commas are separators, not a list.
_ONE_GROUPED_NUMBER_RE = re.compile(
    r"(?:[A-Za-z](?:_\{?\w+\}?)?=)?-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]*)?%?", re.ASCII
)
_LEADING_POINT_RE = re.compile(r"(?<![\w.)\]}])\.(?=[0-9])")
_TRAILING_ZEROS_RE = re.compile(r"(\d)\.0+(?![\d])")
_SCRIPT_BRACES_RE = re.compile(r"(?<=[\^_])\{(\w)\}")
_DEGREES = ("^{\\circ}", "^\\circ", "\u00b0")


def _braced(s: str, i: int) -> tuple[str, int] | None:
    """(content, end) of the brace group opening at ``s[i]``, or None if unbalanced."""
    if i >= len(s) or s[i] != "{":
        return None
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
    return None


def _unfrac(s: str) -> str:
    """``\\frac{a}{b}`` (after the whitespace is gone) as ``(a)/(b)``, innermost first;
    ``\\frac12`` as ``(1)/(2)``; a malformed one is left as it is."""
    out, i = [], 0
    while True:
        m = _TEX_FRAC_RE.search(s, i)
        if m is None:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i : m.start()])
        j = m.end()
        num = _braced(s, j)
        if num is None and j < len(s):
            num = (s[j], j + 1)
        den = _braced(s, num[1]) if num else None
        if num and den is None and num[1] < len(s):
            den = (s[num[1]], num[1] + 1)
        if num is None or den is None:
            out.append(s[m.start() : m.end()])
            i = m.end()
            continue
        out.append(f"({_unfrac(num[0])})/({_unfrac(den[0])})")
        i = den[1]


def _without_spaces(s: str) -> str:
    """``s`` without its whitespace, except one space wherever whitespace keeps two
    numbers apart (``1 2``, ``1 .5``): removing it would make them one (12, 1.5)."""
    out, last = [], ""
    for part in s.split():
        if _NUMBER_END_RE.search(last) and _NUMBER_START_RE.match(part):
            out.append(" ")
        out.append(part)
        last = part
    return "".join(out)


def normalize_math(s: str) -> str:
    r"""``boxed_math``'s normal form of an answer: surrounding ``$``/``\(\)``/``\[\]``
    dropped, ``\text{x}`` as ``x``, ``\left``/``\right`` dropped, ``$`` and ``\$``
    dropped, whitespace and TeX spacing (``~``, ``\ ``, ``\,``, ``\;``, ``\:``,
    ``\>``, ``\quad``, ``\qquad``, ...) removed, ``\dfrac``/``\tfrac`` as ``\frac``
    and ``\frac{a}{b}`` (``\frac 1 2``) as ``a/b``, a trailing ``.0``, a final period,
    a ``%`` after a number and degrees (``^\circ``) dropped, ``.5`` as ``0.5``,
    ``x^{2}`` as ``x^2``, parentheses around one plain atom dropped.

    Spacing never joins two numbers (``1 2``, ``2~3``, ``3\ 4``, ``1\quad 2``, ``1 .5``
    keep one space); ``\!`` (a negative space) is dropped: ``1\!000`` is 1000.

    Thousands separators are removed only inside one number: ``{,}``, ``,\!`` and a
    thin space ``\,`` before three digits always (TeX's: ``1{,}234``, ``10,\!000``,
    ``1\,234``; ``1\,2``, ``1 234``, ``1~234`` are two numbers); a plain comma only
    when the whole answer is one number in groups of three with no space after a comma
    (``1,234``, ``x = 1,234,567``). Every other comma separates list elements: ``1, 234``,
    ``(1,234)``, ``[1, 234]`` and ``3,4`` are pairs (`gspo_jax.verifiers.verify_boxed_math`)."""
    s = s.strip()
    for open_, close in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        while len(s) >= len(open_) + len(close) and s.startswith(open_) and s.endswith(close):
            s = s[len(open_) : len(s) - len(close)].strip()
    s = _TEX_TEXT_RE.sub(r"\1", s)
    s = _TEX_SPACE_WORD_RE.sub(lambda m: _TEX_SPACE_WORDS.get(m.group(1), " "), s)
    s = _TEX_SIZING_RE.sub("", _TEX_THOUSANDS_RE.sub("", s)).replace("\\!", "")
    s = _TEX_SPACE_RE.sub(" ", s)
    spaced_list = re.search(r",\s", s) is not None
    s = s.replace("{,}", ",").replace("\\%", "%").replace("\\$", "").replace("$", "")
    s = _without_spaces(_TEX_FRAC_SPACED_RE.sub(r"\1{\2}", s))
    if not spaced_list and _ONE_GROUPED_NUMBER_RE.fullmatch(s):
        s = s.replace(",", "")
    for degrees in _DEGREES:
        s = s.replace(degrees, "")
    s = _SCRIPT_BRACES_RE.sub(r"\1", _unfrac(s))
    s = re.sub(r"(?<=[0-9])%", "", s)
    s = _TRAILING_ZEROS_RE.sub(r"\1", _LEADING_POINT_RE.sub("0.", s))
    s = s.rstrip(".") if not s.endswith("..") else s
    while True:
        t = _SIMPLE_PARENS_RE.sub(r"\1", s)
        if t == s:
            return s
        s = t


def boxed_answer(text: str, limits: Limits = DEFAULT_LIMITS) -> str | Status:
    r"""The content of the last ``\boxed{...}`` (braces matched), else of the last
    ``<answer>`` span; else NO_ANSWER (TOO_LONG / PARSE_ERROR for a bad box)."""
    m = _last_match(_BOXED_RE, text)
    if m is not None:
        return _boxed_content(text, m, limits)
    content = extract_answer(text)
    if content is None:
        return Status.NO_ANSWER
    return Status.TOO_LONG if len(content) > limits.max_answer_chars else content
