"""Tokenizers: a character-level one for the synthetic tasks, and Hugging Face
``tokenizer.json`` files (with the checkpoint's chat template) for real models.

Both satisfy :class:`Tokenizer`.
"""

from __future__ import annotations

import datetime
import json
import os
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


# ---------------------------------------------------------------------------
# Hugging Face tokenizer.json.


def _token_content(value) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token entry must be a string or {{'content': str}}, got {value!r}")


def _compile_chat_template(source: str):
    """Compiles a chat template in a sandboxed jinja2 environment.

    Same environment as transformers renders templates in: trim_blocks,
    lstrip_blocks, the loopcontrols extension, a ``tojson`` that keeps
    non-ASCII text, ``raise_exception`` and ``strftime_now``. The sandbox keeps
    a template (untrusted text from a checkpoint) from reaching Python internals.
    """
    import jinja2  # pylint: disable=g-import-not-at-top
    import jinja2.ext  # pylint: disable=g-import-not-at-top
    from jinja2 import sandbox  # pylint: disable=g-import-not-at-top

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

    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationTag]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


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
    """

    def __init__(
        self,
        tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        name: str = "<tokenizer>",
        extra_stop_ids: Sequence[int] = (),
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
        self._template = None if chat_template is None else _compile_chat_template(chat_template)

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
        template = None
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        elif "chat_template" in config:
            template = config["chat_template"]
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
        return cls(tokenizer, config, template, name=path, extra_stop_ids=stops)

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

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Renders ``messages`` (``[{"role": ..., "content": ...}]``) with the chat template.

        The template sees ``messages``, ``add_generation_prompt``, the special
        tokens (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) and
        any ``kwargs`` (e.g. ``enable_thinking=False`` for Qwen3).

        Raises:
          ValueError: if the checkpoint has no chat template, or a message lacks
            "role"/"content".
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
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **context,
        )
