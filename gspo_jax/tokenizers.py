"""Tokenizers: a character-level one for the synthetic tasks, and Hugging Face
``tokenizer.json`` files (with the checkpoint's chat template) for real models.

Both satisfy :class:`Tokenizer`.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import os
import threading
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What the sampler, trainer and data pipeline need from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]  # ids that end a response: eos_id first

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; adds no BOS/EOS of its own."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered as the model's prompt text."""


# ---------------------------------------------------------------------------
# Character level.

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Printable ASCII (space .. ~) and newline: digits, operators, letters, punctuation.
DEFAULT_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
    """One id per character over a fixed alphabet, plus special tokens.

    Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, then each entry of
    ``words`` (multi-character tokens, e.g. ``"<answer>"``, matched greedily
    longest first before single characters), then the characters of
    ``chars`` in the given order. The default alphabet is newline and the 95
    printable ASCII characters, so ``vocab_size`` is 100 without words.
    Deterministic: the ids depend only on the constructor arguments.

    Out-of-vocabulary characters raise ValueError by default; with
    ``unknown="unk"`` they map to ``<unk>`` (and decode as ``<unk>`` unless
    special tokens are skipped).

    Args:
      chars: the alphabet; no duplicates.
      words: multi-character tokens; none may be a single character.
      unknown: "error" or "unk".
    """

    def __init__(
        self, chars: str = DEFAULT_CHARS, words: Sequence[str] = (), unknown: str = "error"
    ):
        if unknown not in ("error", "unk"):
            raise ValueError(f"unknown must be 'error' or 'unk', got {unknown!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("chars has duplicate characters")
        words = tuple(words)
        for w in words:
            if len(w) < 2:
                raise ValueError(f"words must have at least 2 characters, got {w!r}")
        if len(set(words)) != len(words):
            raise ValueError(f"words has duplicates: {words}")
        self.specials = (PAD, BOS, EOS, UNK)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
        self.stop_ids = (self.eos_id,)
        self.words = words
        self.chars = chars
        self._id_to_str = list(self.specials) + list(words) + list(chars)
        self._char_to_id = {c: i + len(self.specials) + len(words) for i, c in enumerate(chars)}
        self._word_to_id = {w: i + len(self.specials) for i, w in enumerate(words)}
        # Greedy longest-match order for words, grouped by first character.
        self._words_by_first: dict[str, list[str]] = {}
        for w in sorted(words, key=len, reverse=True):
            self._words_by_first.setdefault(w[0], []).append(w)
        self.unknown = unknown
        self.vocab_size = len(self._id_to_str)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (no BOS/EOS added).

        Raises:
          ValueError: naming the character and its position, for a character
            outside the alphabet when ``unknown="error"``.
        """
        ids, i, n = [], 0, len(text)
        while i < n:
            c = text[i]
            for w in self._words_by_first.get(c, ()):
                if text.startswith(w, i):
                    ids.append(self._word_to_id[w])
                    i += len(w)
                    break
            else:
                idx = self._char_to_id.get(c)
                if idx is None:
                    if self.unknown == "error":
                        raise ValueError(
                            f"text has character {c!r} (U+{ord(c):04X}) at position {i}, "
                            "outside the CharTokenizer alphabet"
                        )
                    idx = self.unk_id
                ids.append(idx)
                i += 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; PAD/BOS/EOS/UNK are dropped when ``skip_special_tokens``.

        Raises:
          ValueError: for an id outside ``[0, vocab_size)``.
        """
        out = []
        for t in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} outside [0, {self.vocab_size})")
            if t < len(self.specials) and skip_special_tokens:
                continue
            out.append(self._id_to_str[t])
        return "".join(out)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """No chat format: the concatenated message contents (for models trained from scratch)."""
        del add_generation_prompt
        return "".join(m["content"] for m in messages)

    def token_to_id(self, token: str) -> int:
        """Id of a special token, word or character."""
        for table in (dict(zip(self.specials, range(4))), self._word_to_id, self._char_to_id):
            if token in table:
                return table[token]
        raise ValueError(f"{token!r} is not a CharTokenizer token")

    def fingerprint(self) -> str:
        """What decides the ids of a text (data prepared for one tokenizer names it)."""
        return json.dumps(["char", self.chars, self.words, self.unknown])


# ---------------------------------------------------------------------------
# Hugging Face tokenizer.json.


def _token_content(value) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token entry must be a string or {{'content': str}}, got {value!r}")


# Limits on running a chat template (untrusted text from a checkpoint).
CHAT_TEMPLATE_TIMEOUT_S = 5.0  # wall clock for one rendering
CHAT_TEMPLATE_MAX_CHARS = 1 << 22  # output, and any string or list a template builds
CHAT_TEMPLATE_MAX_SOURCE = 1 << 20  # characters of template source


class ChatTemplateLimit(Exception):
    """A chat template went past a limit (raised inside the rendering)."""


class _ChatTemplateTimeout(BaseException):
    """Raised asynchronously in a rendering thread that ran out of time."""


def _limited_environment(max_chars: int):
    """A jinja2 sandbox whose operators, ``~`` joins, block captures, macros, filters
    and calls may not build a string or list longer than ``max_chars`` (``"x" * 10**10``
    and joins are refused before they are allocated; other results are checked after,
    which stops a doubling loop at the limit). ``range`` is already capped by the
    sandbox (100,000 items). One filter or method call with a huge argument
    (``"x"|center(10**10)``) can still allocate before its result is checked: only a
    separate process could bound memory completely."""
    import jinja2.compiler  # pylint: disable=g-import-not-at-top
    from jinja2 import sandbox  # pylint: disable=g-import-not-at-top

    def checked(value):
        if isinstance(value, (str, list, tuple, dict)) and len(value) > max_chars:
            raise ChatTemplateLimit(f"it built a value of {len(value)} items (limit {max_chars})")
        return value

    def join(parts):  # jinja's concat: block captures, macro results
        parts = list(parts)
        if sum(map(len, parts)) > max_chars:
            raise ChatTemplateLimit(f"it built a string longer than {max_chars} characters")
        return "".join(parts)

    class CodeGenerator(jinja2.compiler.CodeGenerator):
        def visit_Concat(self, node, frame):  # ``a ~ b``: str_join, through the size check
            if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
                return super().visit_Concat(node, frame)
            self.write("environment.checked_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Environment(sandbox.ImmutableSandboxedEnvironment):
        code_generator_class = CodeGenerator
        intercepted_binops = frozenset(["+", "*", "**", "%"])
        concat = staticmethod(join)

        @staticmethod
        def checked_concat(parts):
            return join(map(str, parts))

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, k in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(k, int):
                        if len(seq) * k > max_chars:
                            raise ChatTemplateLimit(
                                f"it repeats a value {k} times (limit {max_chars} items)"
                            )
            if operator == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 0 and abs(left) > 1 and right * abs(left).bit_length() > 8 * max_chars:
                    raise ChatTemplateLimit(f"{left} ** {right} is too large a number")
            return checked(super().call_binop(context, operator, left, right))

        def call(self, context, obj, /, *args, **kwargs):
            return checked(super().call(context, obj, *args, **kwargs))

    def limit_filter(f):
        @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
        def g(*args, **kwargs):
            return checked(f(*args, **kwargs))

        return g

    return Environment, limit_filter


def _compile_chat_template(source: str, where: str = "<chat template>"):
    """Compiles a chat template in a sandboxed jinja2 environment.

    Same environment as transformers renders templates in: trim_blocks,
    lstrip_blocks, the loopcontrols extension, a ``tojson`` that keeps
    non-ASCII text, ``raise_exception`` and ``strftime_now``. The sandbox keeps
    a template (untrusted text from a checkpoint) from reaching Python internals,
    and caps the size of what it builds (:data:`CHAT_TEMPLATE_MAX_CHARS`);
    :func:`_render_limited` caps the time and the output.
    """
    import jinja2  # pylint: disable=g-import-not-at-top
    import jinja2.ext  # pylint: disable=g-import-not-at-top

    if len(source) > CHAT_TEMPLATE_MAX_SOURCE:
        raise ValueError(
            f"{where}: chat template is longer than {CHAT_TEMPLATE_MAX_SOURCE} characters"
        )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers
        uses the tag to mark assistant tokens; the text is the same)."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    Environment, limit_filter = _limited_environment(CHAT_TEMPLATE_MAX_CHARS)
    env = Environment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationTag]
    )
    env.filters["tojson"] = tojson
    env.filters = {k: limit_filter(f) for k, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except (RecursionError, MemoryError) as e:
        raise ValueError(f"{where}: chat template nests too deeply ({type(e).__name__})") from None


def _stop_thread(thread: threading.Thread) -> None:
    """Raises :class:`_ChatTemplateTimeout` in ``thread`` at its next Python bytecode
    (CPython's ``PyThreadState_SetAsyncExc``; elsewhere the thread runs on, a daemon)."""
    try:
        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    except AttributeError:
        return
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
    set_async_exc(thread.ident, _ChatTemplateTimeout)


def _render_limited(
    template, context: Mapping[str, Any], where: str, *, timeout_s: float, max_chars: int
) -> str:
    """``template.render(**context)`` under a time and an output-size limit.

    The rendering runs in a daemon thread that the caller waits on for
    ``timeout_s`` (a watchdog: Python cannot bound a jinja loop otherwise); past
    it, an exception is raised in that thread to stop it and ValueError here. The
    output is streamed and refused once past ``max_chars`` characters. A template
    error (``raise_exception``, a sandbox refusal) is raised as it is.
    """
    result: dict[str, Any] = {}

    def work():
        try:
            out, n = [], 0
            for chunk in template.generate(**context):
                n += len(chunk)
                if n > max_chars:
                    raise ChatTemplateLimit(f"its output passed {max_chars} characters")
                out.append(chunk)
            result["text"] = "".join(out)
        except BaseException as e:  # pylint: disable=broad-except  # handed to the caller
            result["error"] = e

    thread = threading.Thread(target=work, name="chat-template", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _stop_thread(thread)
        raise ValueError(f"{where}: chat template did not finish within {timeout_s:g} s")
    error = result.get("error")
    if isinstance(error, ChatTemplateLimit):
        raise ValueError(f"{where}: chat template refused: {error}") from None
    if isinstance(error, (RecursionError, MemoryError)):
        raise ValueError(
            f"{where}: chat template refused: {type(error).__name__} (recursion or size)"
        ) from None
    if error is not None:
        raise error
    return result["text"]


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with the checkpoint's config.

    Build with :meth:`from_dir` on a checkpoint directory holding
    ``tokenizer.json`` and, optionally, ``tokenizer_config.json`` (special
    tokens, ``chat_template``) and ``chat_template.jinja`` (where newer
    checkpoints keep the template).

    ``eos_id`` comes from ``eos_token`` in tokenizer_config.json; ``pad_id``
    from ``pad_token``, else the EOS id; ``bos_id`` from ``bos_token`` or None.
    ``stop_ids`` is ``eos_id`` followed by the other ``eos_token_id`` entries of
    the checkpoint's generation_config.json (Qwen3 lists ``<|im_end|>`` and
    ``<|endoftext|>``): a rollout stops at any of them.
    ``encode`` adds no special tokens (the chat template writes them as text,
    and they are matched as added tokens).

    Args:
      tokenizer: a ``tokenizers.Tokenizer``.
      config: the parsed tokenizer_config.json (may be empty).
      chat_template: template source, or None.
      name: where it came from, for error messages.
      extra_stop_ids: further ids that end a response (generation_config.json).
      chat_template_file: the file the template came from, for error messages
        (default: ``name``).

    The template is untrusted text: it runs in a jinja2 sandbox, for at most
    ``template_timeout_s`` seconds, and may write at most ``template_max_chars``
    characters (attributes; see :func:`_render_limited`).
    """

    template_timeout_s: float = CHAT_TEMPLATE_TIMEOUT_S
    template_max_chars: int = CHAT_TEMPLATE_MAX_CHARS

    def __init__(
        self,
        tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        name: str = "<tokenizer>",
        extra_stop_ids: Sequence[int] = (),
        chat_template_file: str | None = None,
    ):
        self._tok = tokenizer
        self.config = dict(config or {})
        self.name = name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.pad_token = _token_content(self.config.get("pad_token"))
        self.unk_token = _token_content(self.config.get("unk_token"))
        if self.eos_token is None:
            raise ValueError(f"{name}: tokenizer_config.json has no 'eos_token'")
        self.eos_id = self._special_id("eos_token", self.eos_token)
        self.bos_id = (
            None if self.bos_token is None else self._special_id("bos_token", self.bos_token)
        )
        self.pad_id = (
            self.eos_id if self.pad_token is None else self._special_id("pad_token", self.pad_token)
        )
        for i in extra_stop_ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"{name}: generation_config.json eos_token_id {i!r} is not a token id "
                    f"in [0, {self.vocab_size})"
                )
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *extra_stop_ids]))
        self.chat_template = chat_template
        self.chat_template_file = chat_template_file or name
        self._template = (
            None
            if chat_template is None
            else _compile_chat_template(chat_template, self.chat_template_file)
        )

    def _special_id(self, field: str, token: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise ValueError(
                f"{self.name}: tokenizer_config.json field {field!r} is {token!r}, "
                "which is not in the vocabulary"
            )
        return int(idx)

    @classmethod
    def from_dir(cls, path: os.PathLike | str) -> "HFTokenizer":
        """Loads ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``)."""
        from tokenizers import Tokenizer as _HF  # pylint: disable=g-import-not-at-top

        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"{path!r} has no tokenizer.json")
        tokenizer = _HF.from_file(tok_file)
        config: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{cfg_file}: invalid JSON: {e}") from None
        template, template_file = None, None
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read(CHAT_TEMPLATE_MAX_SOURCE + 1)
            template_file = jinja_file
        elif "chat_template" in config:
            template, template_file = config["chat_template"], cfg_file
            if isinstance(template, list):  # Named templates: [{"name": ..., "template": ...}].
                named = {
                    t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)
                }
                if "default" not in named:
                    raise ValueError(
                        f"{cfg_file}: field 'chat_template' is a list without a 'default' entry"
                    )
                template = named["default"]
            if not isinstance(template, str):
                raise ValueError(
                    f"{cfg_file}: field 'chat_template' must be a string, "
                    f"got {type(template).__name__}"
                )
        stops: list[int] = []
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file, encoding="utf-8") as f:
                try:
                    eos = json.load(f).get("eos_token_id")
                except json.JSONDecodeError as e:
                    raise ValueError(f"{gen_file}: invalid JSON: {e}") from None
            stops = [] if eos is None else [eos] if not isinstance(eos, list) else eos
        return cls(
            tokenizer,
            config,
            template,
            name=path,
            extra_stop_ids=stops,
            chat_template_file=template_file,
        )

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, without the post-processor's special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} outside [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise ValueError(f"{token!r} is not in the vocabulary of {self.name}")
        return int(idx)

    def fingerprint(self) -> str:
        """What decides the ids of a prompt: the model, the chat template, BOS."""
        return json.dumps(["hf", self._tok.to_str(), self.chat_template, self.bos_id])

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Renders ``messages`` (``[{"role": ..., "content": ...}]``) with the chat template.

        The template sees ``messages``, ``add_generation_prompt``, the special
        tokens (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) and
        any ``kwargs`` (e.g. ``enable_thinking=False`` for Qwen3).

        Raises:
          ValueError: if the checkpoint has no chat template, a message lacks
            "role"/"content", or the template runs past its time or size limit
            (naming the file it came from).
          jinja2.exceptions.TemplateError: the template's own error, or a sandbox
            refusal (``SecurityError``).
        """
        if self._template is None:
            raise ValueError(
                f"{self.name} has no chat template (no 'chat_template' in "
                "tokenizer_config.json and no chat_template.jinja)"
            )
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] needs 'role' and 'content', got keys {sorted(m)}")
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        context = {k: v for k, v in context.items() if v is not None}
        context.update(tools=None, documents=None)  # as transformers passes them: "is none" holds
        context.update(kwargs)
        context.update(messages=[dict(m) for m in messages])
        context.update(add_generation_prompt=add_generation_prompt)
        return _render_limited(
            self._template,
            context,
            self.chat_template_file,
            timeout_s=self.template_timeout_s,
            max_chars=self.template_max_chars,
        )
