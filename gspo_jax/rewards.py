r"""Rule-based verifiers: Countdown, integer arithmetic, GSM8K, and a user's file.

Model output is never passed to ``eval`` or ``exec``. A Countdown answer goes
through a small recursive-descent parser over ``+ - * /``, parentheses and
ASCII integers, with limits on length, nesting depth and literal size, and is
evaluated exactly with :class:`fractions.Fraction`. A numeric answer is read as
one plain number (below) and compared exactly as a rational.

Every response gets a reward and a status; garbage text gets reward 0 and a
failure status, never an exception. The batch entry point is :func:`score`.

Answer format (shared with the prompts in :mod:`gspo_jax.data`): the last
``<answer>...</answer>`` span of the response holds the answer. The closing
tag is required, so a sampler that stops on ``</answer>`` must keep the stop
string in the response text. Countdown needs the span.

Numeric answers (arithmetic, GSM8K; :func:`read_final_answer`). The final-answer
span is chosen by the first of these rules that finds its marker; a later rule
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

A user's file (task "file", :mod:`gspo_jax.data.user_file`) picks a verifier by
name from :data:`VERIFIERS`: ``numeric`` and ``countdown`` (the above),
``exact_match`` (the answer-tag content, else the whole response, equals the
reference after whitespace normalisation) and ``boxed_math`` (the last
``\\boxed{...}``, else the answer tag, equals the reference after
:func:`normalize_math`, as strings or as the same exact number). Or it names a
plug-in reward ``module:function`` with the signature
``fn(response: str, reference: str, row: dict) -> float`` (``row``: the file's whole
row); its value replaces ``correct`` below (> 0 counts as correct). A plug-in that
raises or returns anything but a finite real number gives 0 and the status
``reward_fn_error`` (logged), never an exception.

Reward, per response::

    reward = correct + format_weight * formatted

``correct`` is 1 when the answer is right; ``formatted`` is 1 when an answer
span exists and its content parses (an expression for Countdown, a number
otherwise). With ``format_weight=0`` (the default) the reward is the 0/1
correctness of DeepSeek-R1 and TinyZero.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
from fractions import Fraction
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

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
_REFERENCE_LIMITS = Limits(max_answer_chars=10**6, max_digits=10**6)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Result for one response: correctness, format, and the status."""

    correct: bool
    formatted: bool
    status: Status
    reward: float | None = None  # a plug-in reward function's value; None: ``float(correct)``


class _Reject(Exception):
    """Internal: verification stops with this status."""

    def __init__(self, status: Status):
        super().__init__(status.value)
        self.status = status


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
# Countdown expressions.

_OPS = {"+": "+", "-": "-", "*": "*", "/": "/", "\u00d7": "*", "\u00f7": "/"}
_WHITESPACE = " \t\n\r"
_ASCII_DIGITS = "0123456789"


def _tokenize(expr: str, limits: Limits) -> list[tuple[str, Any]]:
    """Tokens ``("num", int)``, ``("op", "+-*/")``, ``("(", None)``, ``(")", None)``.

    Only ASCII digits make numbers (``str.isdigit`` would accept other scripts'
    digits); ``×`` and ``÷`` are read as ``*`` and ``/``. Any other character,
    including ``^`` and ``.``, is a parse error; ``**`` fails in the parser.
    """
    tokens = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in _WHITESPACE:
            i += 1
        elif c in _ASCII_DIGITS:
            j = i
            while j < n and expr[j] in _ASCII_DIGITS:
                j += 1
            if j - i > limits.max_digits:
                raise _Reject(Status.NUMBER_TOO_LARGE)
            tokens.append(("num", int(expr[i:j])))
            i = j
        elif c in _OPS:
            tokens.append(("op", _OPS[c]))
            i += 1
        elif c in "()":
            tokens.append((c, None))
            i += 1
        else:
            raise _Reject(Status.PARSE_ERROR)
    return tokens


class _Parser:
    """Recursive descent over the grammar::

        expr   := term (("+" | "-") term)*
        term   := factor (("*" | "/") factor)*
        factor := NUMBER | "(" expr ")"

    Binary operators only (no unary minus). Evaluates exactly with Fraction.
    Recursion happens only at "(", and is cut at ``limits.max_depth``.
    """

    def __init__(self, tokens, limits: Limits):
        self.tokens = tokens
        self.pos = 0
        self.limits = limits
        self.numbers: list[int] = []

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def parse(self) -> Fraction:
        value = self._expr(0)
        if self.pos != len(self.tokens):
            raise _Reject(Status.PARSE_ERROR)
        return value

    def _expr(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self._peek() in (("op", "+"), ("op", "-")):
            op = self.tokens[self.pos][1]
            self.pos += 1
            rhs = self._term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._factor(depth)
        while self._peek() in (("op", "*"), ("op", "/")):
            op = self.tokens[self.pos][1]
            self.pos += 1
            rhs = self._factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise _Reject(Status.DIV_BY_ZERO)
            else:
                value = value / rhs
        return value

    def _factor(self, depth: int) -> Fraction:
        kind, val = self._peek()
        if kind == "num":
            self.pos += 1
            self.numbers.append(val)
            return Fraction(val)
        if kind == "(":
            if depth + 1 > self.limits.max_depth:
                raise _Reject(Status.TOO_DEEP)
            self.pos += 1
            value = self._expr(depth + 1)
            if self._peek()[0] != ")":
                raise _Reject(Status.PARSE_ERROR)
            self.pos += 1
            return value
        raise _Reject(Status.PARSE_ERROR)


def _evaluate(expr: str, limits: Limits) -> tuple[Fraction, list[int]]:
    """Exact value of a Countdown expression and the literals it uses, in order;
    raises `_Reject` with the failure status for an invalid expression."""
    if len(expr) > limits.max_answer_chars:
        raise _Reject(Status.TOO_LONG)
    parser = _Parser(_tokenize(expr, limits), limits)
    value = parser.parse()
    return value, parser.numbers


def verify_countdown(
    text: str, numbers: Sequence[int], target: int, limits: Limits = DEFAULT_LIMITS
) -> Verdict:
    """Countdown check: the expression uses each given number exactly once and equals target.

    The answer content may end with ``= N``; then N must be an integer literal
    equal to the target as well.
    """
    content = extract_answer(text)
    if content is None:
        return Verdict(False, False, Status.NO_ANSWER)
    try:
        if len(content) > limits.max_answer_chars:
            raise _Reject(Status.TOO_LONG)
        stated = None
        if "=" in content:
            lhs, _, rhs = content.partition("=")
            rhs = rhs.strip(_WHITESPACE)
            if not rhs or any(c not in _ASCII_DIGITS for c in rhs) or len(rhs) > limits.max_digits:
                raise _Reject(Status.PARSE_ERROR)
            content, stated = lhs, int(rhs)
        value, used = _evaluate(content, limits)
    except _Reject as e:
        return Verdict(
            False,
            e.status
            not in (Status.PARSE_ERROR, Status.TOO_LONG, Status.TOO_DEEP, Status.NUMBER_TOO_LARGE),
            e.status,
        )
    if sorted(used) != sorted(int(x) for x in numbers):
        return Verdict(False, True, Status.WRONG_NUMBERS)
    if value != target or (stated is not None and stated != target):
        return Verdict(False, True, Status.WRONG_ANSWER)
    return Verdict(True, True, Status.CORRECT)


# ---------------------------------------------------------------------------
# Numeric answers (arithmetic, GSM8K). The rules are in the module docstring.

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
    truth = parse_number(str(answer), _REFERENCE_LIMITS)
    if truth is None:
        raise ValueError(f"meta 'answer' is not a number: {answer!r}")
    reading = read_final_answer(text, limits)
    if reading.value is None:
        return Verdict(False, False, reading.status)
    if reading.value != truth:
        return Verdict(False, reading.tagged, Status.WRONG_ANSWER)
    return Verdict(True, reading.tagged, Status.CORRECT)


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
    if parse_number(tail, _REFERENCE_LIMITS) is None:
        raise ValueError(f"GSM8K final answer is not a plain number: {tail!r}")
    return tail.replace(",", "").replace("$", "")


# ---------------------------------------------------------------------------
# Verifiers by name, for a user's own data (task "file"), and plug-in rewards.


def normalize_text(s: str) -> str:
    """Whitespace runs as one space, ends stripped: ``exact_match``'s normalisation."""
    return " ".join(s.split())


def verify_exact_match(text: str, answer: str, limits: Limits = DEFAULT_LIMITS) -> Verdict:
    """The answer (the last ``<answer>`` span's content, else the whole response)
    equals ``answer`` after :func:`normalize_text`. ``formatted``: the span exists."""
    content = extract_answer(text)
    tagged = content is not None
    got = normalize_text(content if tagged else text)
    if not got:
        return Verdict(False, False, Status.NO_ANSWER)
    if got != normalize_text(str(answer)):
        return Verdict(False, tagged, Status.WRONG_ANSWER)
    return Verdict(True, tagged, Status.CORRECT)


_TEX_FRAC_RE = re.compile(r"\\[dt]?frac(?![a-zA-Z])")
_TEX_SIZING_RE = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])")
_TEX_SPACES = ("\\!", "\\,", "\\;", "\\:", "\\ ", "~")
_SIMPLE_PARENS_RE = re.compile(r"(?<![\w)\]}])\((-?[\w.]+)\)(?![\w(\[{])")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TRAILING_ZEROS_RE = re.compile(r"(\d)\.0+(?![\d])")
_SCRIPT_BRACES_RE = re.compile(r"(?<=[\^_])\{(\w)\}")
_MATH_NUMBER_RE = re.compile(r"(-?)(\d+(?:\.\d+)?)(?:/(-?)(\d+(?:\.\d+)?))?", re.ASCII)


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


def normalize_math(s: str) -> str:
    r"""``boxed_math``'s normal form of an answer: surrounding ``$``/``\(\)``/``\[\]``
    dropped, ``\text{x}`` as ``x``, ``\left``/``\right`` and ``\!`` ``\,`` spacing
    dropped, all whitespace removed, ``\dfrac``/``\tfrac`` as ``\frac`` and
    ``\frac{a}{b}`` as ``a/b``, ``{,}`` and thousands separators removed, a trailing
    ``.0`` and a final period dropped, ``x^{2}`` as ``x^2``, parentheses around one
    plain atom dropped."""
    s = s.strip()
    for open_, close in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        while len(s) >= len(open_) + len(close) and s.startswith(open_) and s.endswith(close):
            s = s[len(open_) : len(s) - len(close)].strip()
    s = _TEX_TEXT_RE.sub(r"\1", s)
    s = _TEX_SIZING_RE.sub("", s)
    for space in _TEX_SPACES:
        s = s.replace(space, " ")
    s = "".join(s.split()).replace("{,}", ",").replace("\\%", "%")
    s = _SCRIPT_BRACES_RE.sub(r"\1", _unfrac(s))
    s = _THOUSANDS_RE.sub("", s)
    s = _TRAILING_ZEROS_RE.sub(r"\1", s)
    s = s.rstrip(".") if not s.endswith("..") else s
    while True:
        t = _SIMPLE_PARENS_RE.sub(r"\1", s)
        if t == s:
            return s
        s = t


def _math_number(s: str, limits: Limits) -> Fraction | None:
    """The exact value of a normalised answer that is one number or a ratio of two."""
    m = _MATH_NUMBER_RE.fullmatch(s)
    if m is None or sum(map(str.isdigit, s)) > limits.max_digits:
        return None
    value = Fraction(m.group(2))
    if m.group(4) is not None:
        den = Fraction(m.group(4))
        if den == 0:
            return None
        value /= den
    return -value if (m.group(1) == "-") != (m.group(3) == "-") else value


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


def verify_boxed_math(text: str, answer: str, limits: Limits = DEFAULT_LIMITS) -> Verdict:
    r"""The answer of :func:`boxed_answer` equals ``answer`` (itself read from its last
    ``\boxed{}`` if it has one) after :func:`normalize_math`, as strings or as the
    same exact number (``\frac{1}{2}`` = ``1/2`` = ``0.5``). ``formatted``: an
    answer was found."""
    got = boxed_answer(text, limits)
    if isinstance(got, Status):
        return Verdict(False, False, got)
    got = normalize_math(got)
    if not got:
        return Verdict(False, False, Status.NO_ANSWER)
    truth = _math_reference(str(answer))
    if got == truth:
        return Verdict(True, True, Status.CORRECT)
    a, b = _math_number(got, limits), _math_number(truth, _REFERENCE_LIMITS)
    if a is not None and a == b:
        return Verdict(True, True, Status.CORRECT)
    return Verdict(False, True, Status.WRONG_ANSWER)


def _math_reference(answer: str) -> str:
    ref = boxed_answer(answer, _REFERENCE_LIMITS) if "\\boxed" in answer else answer
    return normalize_math(ref) if isinstance(ref, str) else ""


def _countdown(text: str, meta: Mapping[str, Any], limits: Limits) -> Verdict:
    return verify_countdown(text, meta["numbers"], int(meta["target"]), limits)


# name -> fn(text, meta, limits) -> Verdict. meta: {"answer": str} (countdown:
# {"numbers": tuple[int], "target": int}).
VERIFIERS = {
    "numeric": lambda text, meta, limits: verify_numeric(text, meta["answer"], limits),
    "countdown": _countdown,
    "exact_match": lambda text, meta, limits: verify_exact_match(text, meta["answer"], limits),
    "boxed_math": lambda text, meta, limits: verify_boxed_math(text, meta["answer"], limits),
}


def reference_problem(verifier: str, meta: Mapping[str, Any]) -> str | None:
    """Why ``meta`` (from a data row) cannot be verified by ``verifier``, or None.
    A plug-in reward function takes any reference."""
    if verifier == "numeric":
        if parse_number(str(meta["answer"]), _REFERENCE_LIMITS) is None:
            return f"answer {meta['answer']!r} is not a plain number (verifier 'numeric')"
    elif verifier == "countdown":
        nums, target = meta.get("numbers"), meta.get("target")
        if not isinstance(target, int) or isinstance(target, bool):
            return f"countdown target must be an integer, got {target!r}"
        if (
            not isinstance(nums, (list, tuple))
            or not nums
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in nums)
        ):
            return (
                f"countdown 'numbers' must be a non-empty list of positive integers, got {nums!r}"
            )
    elif verifier == "exact_match":
        if not normalize_text(str(meta["answer"])):
            return "answer is empty"
    elif verifier == "boxed_math":
        if not _math_reference(str(meta["answer"])):
            return f"answer {meta['answer']!r} is empty after normalisation"
    return None


def is_reward_fn(verifier: str) -> bool:
    """Whether a ``task.verifier`` value names a plug-in ``module:function``."""
    return ":" in verifier


_REWARD_FNS: dict[str, Any] = {}


def load_reward_fn(spec: str):
    """The function ``module:function`` names (imported once, then cached).

    Raises:
      ValueError: if ``spec`` is malformed, the module cannot be imported, or the
        attribute is missing or not callable.
    """
    if spec in _REWARD_FNS:
        return _REWARD_FNS[spec]
    module, sep, name = spec.partition(":")
    if not sep or not module or not name or ":" in name:
        raise ValueError(f"a reward function is 'module:function', got {spec!r}")
    import importlib

    try:
        mod = importlib.import_module(module)
    except Exception as e:
        raise ValueError(f"cannot import module {module!r} of {spec!r}: {e}") from None
    fn = mod
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"module {module!r} has no function {name!r}")
    _REWARD_FNS[spec] = fn
    return fn


def _plugin_verdict(spec: str, text: str, meta: Mapping[str, Any]) -> Verdict:
    """A plug-in reward ``fn(response, reference, row) -> float``: the value is the
    reward's correctness component; > 0 counts as CORRECT. Raising, or returning
    anything but a finite real number, gives reward 0 and REWARD_FN_ERROR."""
    formatted = extract_answer(text) is not None
    try:
        value = load_reward_fn(spec)(text, str(meta["answer"]), dict(meta.get("row", {})))
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"returned {type(value).__name__}, not a float")
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"returned {value}")
    except Exception:
        _log.exception("reward function %s failed on text %r", spec, text[:200])
        return Verdict(False, formatted, Status.REWARD_FN_ERROR, 0.0)
    return Verdict(
        value > 0, formatted, Status.CORRECT if value > 0 else Status.WRONG_ANSWER, value
    )


# ---------------------------------------------------------------------------
# Batch API.

TASKS = ("countdown", "arithmetic", "gsm8k", "file")
_log = logging.getLogger(__name__)


def verify(
    task: str, text: str, meta: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS
) -> Verdict:
    """Verdict for one response. ``meta`` as produced by :mod:`gspo_jax.data`:
    Countdown ``{"numbers", "target"}``; arithmetic and GSM8K ``{"answer"}``; a
    user's file (task "file") ``{"verifier", "answer", "row"}`` (plus Countdown's
    fields), ``verifier`` a name in :data:`VERIFIERS` or a plug-in ``module:function``.

    Raises:
      ValueError: for an unknown task, a non-str text, or meta missing a field
        (caller bugs). Never for the content of ``text``.
    """
    if not isinstance(text, str):
        raise ValueError(f"texts must be str, got {type(text).__name__}")
    if task == "countdown":
        if "numbers" not in meta or "target" not in meta:
            raise ValueError(
                f"countdown meta needs 'numbers' and 'target', got keys {sorted(meta)}"
            )
        fn = lambda: verify_countdown(text, meta["numbers"], int(meta["target"]), limits)
    elif task in ("arithmetic", "gsm8k"):
        if "answer" not in meta:
            raise ValueError(f"{task} meta needs 'answer', got keys {sorted(meta)}")
        answer = meta["answer"]
        if parse_number(str(answer), _REFERENCE_LIMITS) is None:
            raise ValueError(f"{task} meta 'answer' is not a number: {answer!r}")
        fn = lambda: verify_numeric(text, answer, limits)
    elif task == "file":
        verifier = meta.get("verifier")
        if not isinstance(verifier, str) or "answer" not in meta:
            raise ValueError(f"file meta needs 'verifier' and 'answer', got keys {sorted(meta)}")
        if is_reward_fn(verifier):
            return _plugin_verdict(verifier, text, meta)
        if verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {sorted(VERIFIERS)}, got {verifier!r}")
        fn = lambda: VERIFIERS[verifier](text, meta, limits)
    else:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    try:
        return fn()
    except Exception:  # A verifier bug must not end a training run: count it.
        _log.exception("verifier error on task %s, text %r", task, text[:200])
        return Verdict(False, False, Status.VERIFIER_ERROR)


def score(
    task: str,
    texts: Sequence[str],
    metas: Sequence[Mapping[str, Any]],
    *,
    format_weight: float = 0.0,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, int]]:
    """Rewards for a batch of responses.

    Args:
      task: "countdown", "arithmetic", "gsm8k" or "file".
      texts: N decoded responses.
      metas: N task metadata dicts (one per response; repeat a prompt's meta
        for its G samples).
      format_weight: weight of the format component.
      limits: parser bounds.

    Returns:
      rewards: f32[N], ``correct + format_weight * format``.
      components: ``{"correct": f32[N], "format": f32[N]}``.
      counts: number of responses per :class:`Status` value, every status
        present (zeros included) so logged keys are stable across steps.
    """
    if len(texts) != len(metas):
        raise ValueError(
            f"texts and metas must have the same length, got {len(texts)} and {len(metas)}"
        )
    correct = np.zeros(len(texts), np.float32)
    formatted = np.zeros(len(texts), np.float32)
    counts = {s.value: 0 for s in Status}
    for i, (text, meta) in enumerate(zip(texts, metas)):
        v = verify(task, text, meta, limits)
        correct[i] = v.correct if v.reward is None else v.reward
        formatted[i] = v.formatted
        counts[v.status.value] += 1
    rewards = (correct + np.float32(format_weight) * formatted).astype(np.float32)
    return rewards, {"correct": correct, "format": formatted}, counts
