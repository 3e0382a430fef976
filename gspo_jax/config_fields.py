"""Declaring a config section once: each field's default, type, range, doc and whether
it may change on resume.

A section is a frozen dataclass, owned by the module that uses it, whose fields are
`setting`s (a value) or `section`s (a nested group)::

    @dataclasses.dataclass(frozen=True)
    class GaeConfig:
        gamma: float = setting(1.0, low=0, high=1, doc="discount")

Everything else is derived from those declarations: the ConfigDict of defaults
(`defaults`), each value's check (`check`, raising `ConfigError` that names the
field's ``config.`` path), the docs table (`docs_table`), the fields that may change
on resume (`resumable`) and the typed instance of a validated ConfigDict (`build`).
This module imports nothing from gspo_jax.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from typing import Any, Callable, Iterator

import ml_collections
import numpy as np


class ConfigError(ValueError):
    """An invalid experiment config; the message names the field."""


def err(path: str, msg: str) -> ConfigError:
    return ConfigError(f"config.{path}: {msg}")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    choices: tuple | Callable[[], tuple] | None = None,
    nonempty: bool = False,
    resume: bool = False,
    why: str = "",
    check: Callable[[Any], str | None] | None = None,
    domain: str = "",
    factory: Callable[[], Any] | None = None,
    open_group: bool = False,
) -> Any:
    """A field of a config section.

    doc: one line for the docs table. low/high (closed unless ``*_open``): the range of
    a number. choices: the strings allowed (or a function returning them, for a list
    that is costly to import). nonempty: a string must not be "". resume: the field may
    differ when a run resumes (it changes nothing the checkpoints mean). why: appended
    to the range in the error message. check: a custom check, value -> error message or
    None, in place of the type's. domain: the docs table's text where the declaration
    does not say it all. factory: a default built per instance (a dict). open_group: a
    group of keys checked elsewhere (an objective's hyperparameters, ModelConfig's
    fields); its default is a dict.
    """
    meta = dict(
        doc=doc,
        low=low,
        high=high,
        low_open=low_open,
        high_open=high_open,
        choices=choices,
        nonempty=nonempty,
        resume=resume,
        why=why,
        check=check,
        domain=domain,
        open_group=open_group,
    )
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, *, doc: str = "", resume: bool = False, own_checks: bool = False) -> Any:
    """A nested group of settings. resume: every field of it may change on resume.
    own_checks: ``cls`` checks its values where it is made (its ``__post_init__``), so
    `check` leaves them to it."""
    meta = dict(doc=doc, section=True, resume=resume, own_checks=own_checks)
    return dataclasses.field(default_factory=cls, metadata=meta)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def entries(cls: type, prefix: str = "", resume: bool = False) -> Iterator[tuple]:
    """(path, dataclasses.Field, type, resume) of every setting, nested sections
    flattened in declaration order (a section's ``resume`` covers its fields)."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        may = resume or f.metadata.get("resume", False)
        if f.metadata.get("section"):
            yield from entries(hints[f.name], path + ".", may)
        elif "doc" in f.metadata:
            yield path, f, hints[f.name], may


def open_groups(cls: type) -> tuple[str, ...]:
    """The paths of the open groups (their keys are checked by their owners)."""
    return tuple(p for p, f, _, _ in entries(cls) if f.metadata["open_group"])


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def defaults(cls: type) -> ml_collections.ConfigDict:
    """The ConfigDict of ``cls``'s defaults (nested sections as groups)."""
    c = ml_collections.ConfigDict()
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            c[f.name] = defaults(hints[f.name])
        elif "doc" in f.metadata:
            value = _default(f)
            if value is None:  # Optional[X]: a placeholder that takes an X (or None)
                kind = next(a for a in typing.get_args(hints[f.name]) if a is not type(None))
                value = ml_collections.config_dict.placeholder(kind)
            c[f.name] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
    return c


def resumable(cls: type) -> tuple[str, ...]:
    """The paths that may change on resume; a section all of whose fields may is
    ``<section>.*``."""
    out: list[str] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            inner = resumable(hints[f.name])
            every = [p for p, *_ in entries(hints[f.name])]
            if f.metadata.get("resume") or (inner and len(inner) == len(every)):
                out.append(f"{f.name}.*")
            else:
                out += [f"{f.name}.{p}" for p in inner]
        elif f.metadata.get("resume"):
            out.append(f.name)
    return tuple(out)


# --------------------------------------------------------------------------
# Checks.


def is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def range_text(low=None, high=None, low_open=False, high_open=False) -> str:
    """`` >= 0``, `` > 0``, `` in [0, 1)`` ... (with a leading space), or ``""``."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


def _in_range(v, low, high, low_open, high_open) -> bool:
    if low is not None and (v <= low if low_open else v < low):
        return False
    return high is None or (v < high if high_open else v <= high)


def choices_of(meta) -> tuple | None:
    choices = meta.get("choices")
    return choices() if callable(choices) else choices


def problem(v: Any, tp: Any, meta) -> str | None:
    """What is wrong with value ``v`` of a field of type ``tp``, or None."""
    if meta.get("check") is not None:
        return meta["check"](v)
    bounds = [meta.get(k) for k in ("low", "high", "low_open", "high_open")]
    why = meta.get("why", "")
    if tp is bool:
        if not isinstance(v, (bool, np.bool_)):
            return f"must be a bool (True or False), got {v!r}"
    elif tp is int:
        if not (is_int(v) and _in_range(v, *bounds)):
            return f"must be an int{range_text(*bounds)}{why}, got {v!r}"
    elif tp is float:
        if not (is_real(v) and math.isfinite(v) and _in_range(v, *bounds)):
            domain = range_text(*bounds)
            return f"must be finite{' and' + domain if domain else ''}{why}, got {v!r}"
    elif tp is str:
        if not isinstance(v, str):
            return f"must be a string, got {v!r}"
        choices = choices_of(meta)
        if choices is not None and v not in choices:
            return f"must be one of {choices}, got {v!r}"
        if meta.get("nonempty") and not v:
            return "must not be empty"
    return None


def check(cls: type, node: Any, prefix: str = "") -> None:
    """Each setting of ``node`` (a ConfigDict shaped as ``cls``) on its own: type,
    finiteness, range, choices; then what the section checks of its raw values itself,
    its ``check_node(node)`` classmethod where it declares one (its open groups' keys,
    or all of a section declared with ``own_checks``)."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        meta, path = f.metadata, prefix + f.name
        if meta.get("section"):
            if meta.get("own_checks"):
                hints[f.name].check_node(node[f.name])
            else:
                check(hints[f.name], node[f.name], path + ".")
            continue
        if "doc" not in meta or meta.get("open_group"):
            continue
        msg = problem(node[f.name], hints[f.name], meta)
        if msg:
            raise err(path, msg)
    own = getattr(cls, "check_node", None)
    if own is not None:
        own(node)


def sections(run: Any) -> Iterator[Any]:
    """``run`` (a built config) and every section in it, depth first in declaration
    order: the objects whose ``check_run(run, ctx)`` holds their rules across fields."""
    yield run
    for f in dataclasses.fields(run):
        if f.metadata.get("section"):
            yield from sections(getattr(run, f.name))


def check_across(run: Any, ctx: Any) -> None:
    """Every section's rules across fields and sections, in `sections` order: its
    ``check_run(run, ctx)`` where it declares one (``ctx``: what the rules need besides
    the config, as the device count). Each raises `ConfigError` naming its field."""
    for sec in sections(run):
        rule = getattr(sec, "check_run", None)
        if rule is not None:
            rule(run, ctx)


def from_dataclass_error(
    e: Exception, name: str, group: str, keys, moved: dict[str, str] | None = None
) -> ConfigError:
    """A dataclass's error (``"<name>.key: msg"`` or ``"<name>: key msg"``) as a
    `ConfigError` naming ``config.<group>.key`` (``moved``: keys whose field is elsewhere,
    key -> its path)."""
    msg = str(e)
    for sep in (".", ": "):
        head = f"{name}{sep}"
        if msg.startswith(head):
            key, _, rest = msg[len(head) :].partition(":" if sep == "." else " ")
            if key in keys:
                return err((moved or {}).get(key, f"{group}.{key}"), rest.strip())
    return err(group, msg)


def build(cls: type, node: Any) -> Any:
    """The frozen ``cls`` instance of a validated ConfigDict (lists become tuples,
    open groups dicts, an int where a float is declared a float)."""
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in node:
            continue
        value = node[f.name]
        if f.metadata.get("section"):
            value = build(hints[f.name], value)
        elif isinstance(value, ml_collections.ConfigDict):
            value = value.to_dict()
        elif isinstance(value, list):
            value = tuple(value)
        elif hints[f.name] is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        values[f.name] = value
    return cls(**values)


# --------------------------------------------------------------------------
# The docs table.


def _type_name(tp: Any) -> str:
    if tp in (bool, int, str):
        return tp.__name__
    if tp is float:
        return "finite float"
    return str(tp).replace("typing.", "")


def domain_text(tp: Any, meta) -> str:
    if meta.get("domain"):
        return meta["domain"]
    if meta.get("open_group"):
        return "a group of keys"
    choices = choices_of(meta)
    if choices is not None:
        return ", ".join(map(str, choices))
    text = _type_name(tp) + range_text(
        *[meta.get(k) for k in ("low", "high")] + [meta.get("low_open"), meta.get("high_open")]
    )
    return text + (" (not empty)" if meta.get("nonempty") else "")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def docs_table(cls: type, prefix: str = "config.") -> str:
    """A Markdown table: every setting's path, default, domain, resume and doc."""
    rows = [
        "| field | default | domain | on resume | what it is |",
        "| --- | --- | --- | --- | --- |",
    ]
    for path, f, tp, may in entries(cls):
        default = _default(f)
        default = "required" if default is dataclasses.MISSING else f"`{_cell(repr(default))}`"
        rows.append(
            f"| `{prefix}{path}` | {default} | {_cell(domain_text(tp, f.metadata))} "
            f"| {'may change' if may else 'fixed'} | {_cell(f.metadata['doc'])} |"
        )
    return "\n".join(rows) + "\n"
