"""Docs that cannot go stale: every reference to the project's code, config and files in
the docs, the experiments' write-ups and the package's docstrings resolves.

Where references are read (`sources`, `docstring_refs`):

* the Markdown of README.md, docs/*.md, experiments/*.md and experiments/*/README.md:
  its inline code spans (`...`) and the paths in its prose. Fenced code blocks are
  examples and are not read here (tests/test_extending.py runs the extend pages' ones);
* the docstrings of every module, class and function of gspo_jax/: spans in `single`
  or ``double`` backticks, Sphinx roles (:func:`...`, :class:`~...`) and the paths in
  the prose.

What counts as a reference, and what it must resolve to (`Ref.check`):

1. A path: a span, or a word of prose, that begins with ``gspo_jax/``, ``configs/``,
   ``experiments/``, ``tests/`` or ``docs/``. The file or folder must exist; a glob
   (``*``, ``{a,b}``, a ``<placeholder>``) must match for each alternative;
   ``configs/default.py:objective=gspo`` is the path before the colon, and
   ``tests/test_x.py::name`` must also define ``name``. (A path relative to somewhere
   else, ``objectives/gspo.py``, or a bare file name, ``step.py``, is not checked.)
   The target of a Markdown link, ``[text](../x.md)``, must exist, relative to the file
   (web addresses are not followed).
2. A dotted name ``a.b.c`` (alone, with ``()``, called as ``a.b(x, y)``, or set as
   ``a.b=value``, ``--config.a.b=value`` or ``a.b = value``) whose first part is
     - ``gspo_jax``: the modules and attributes it names (`gspo_jax.rollout.Sampler`);
     - the name of a module or package of the project (``rl``, ``safety``,
       ``dispatch``, ``stats``: any under gspo_jax/ or experiments/; a name that two
       modules share, like ``config``, resolves if either has it): an attribute of it;
     - a class defined at the top level of a module of the project (``RunParts``,
       ``Rollout``): a method, field, class attribute or ``self.`` attribute of it or
       of its bases;
     - ``config``, or a top-level key of the config (``rollout``, ``updates``, ``task``,
       ...): a path of `gspo_jax.config.base_config` (under ``model.fields`` the
       ModelConfig fields docs/config.md documents, not the runtime settings, which are
       ``model.<key>``; under ``objective.hparams`` any objective's hyperparameter; the
       removed keys of `gspo_jax.old_keys.REMOVED_KEYS` too).
   A name that reads more than one of these ways resolves if one of them does
   (``config.validate``: the module; ``rollout.staleness``: the config). Any other
   dotted name is not the project's (``jax.jit``, ``hp.eps_low``), nor is one whose
   last part is a file extension (``metrics.jsonl``, ``step.py``).
3. A bare capitalised name (``RunParts``, ``RolloutQueue``): a name defined at the top
   level of a module of the project, a builtin, or one of `EXTERNAL_NAMES` (other
   libraries' classes that the docs name bare).
4. In a docstring, the target of a Sphinx role (:func:`register`, :meth:`run`): a
   bare name must be one of the enclosing class, of the module (defined or imported),
   a module or top-level class of the project, or a builtin; a dotted one resolves
   from the module's names or as in 2.
Spans that look like references and are not, on purpose (an example of a misspelt
key, a file that the history names, what an extend page adds), are listed with the
reason in `NOT_REFERENCES`.

Code is resolved from the syntax trees of gspo_jax/ and experiments/, without
importing it (only where the tree cannot say, a class whose base is another
library's or a module ``__getattr__``, is the module imported); config paths from
`gspo_jax.config.base_config`. Every reference that does not resolve is reported
with its file and line.
"""

from __future__ import annotations

import ast
import bisect
import builtins
import dataclasses
import functools
import glob
import importlib
import pathlib
import re

import pytest

from gspo_jax import config as config_lib
from gspo_jax import objectives, old_keys

REPO = pathlib.Path(__file__).resolve().parents[1]
PATH_ROOTS = ("gspo_jax/", "configs/", "experiments/", "tests/", "docs/")
CODE_ROOTS = ("gspo_jax", "experiments")
FILE_EXTENSIONS = {
    "py", "md", "json", "jsonl", "png", "txt", "txtpb", "csv", "parquet", "yaml", "yml",
    "toml", "cfg", "safetensors", "npz", "npy", "pkl", "html", "svg", "log", "lock", "bin",
    "pdf", "sh", "msgpack", "index", "tfrecord", "gz", "zip", "ipynb",
}

# Other libraries' classes that the docs name without their module.
EXTERNAL_NAMES = {
    "QArray", "LoraProvider", "QtProvider", "PtqProvider",  # qwix
    "PreTrainedTokenizerFast",  # transformers
    "NamedSharding",  # jax.sharding
    "LoRARequest",  # vLLM
    "GRPOConfig",  # TRL
    "SecurityError",  # jinja2.sandbox
    "PyThreadState_SetAsyncExc",  # CPython's C API
    "DatasetInfo",  # tensorflow_datasets.core
    "Event",  # TensorBoard's event.proto (gspo_jax.event_file encodes it)
}

# Spans that look like references and are not, on purpose: (file, text) -> why.
NOT_REFERENCES = {
    ("experiments/archive/README.md", "tests/test_stability_pilot.py"):
        "the archive names the pilot's test, removed with the move",
    ("experiments/restructuring.md", "gspo_jax/models/hf.py"):
        "the line counts before the restructuring name the file it split",
    # What the extend pages add, built by their examples (tests/test_extending.py).
    ("docs/extending.md", "optimizer.eps"): "the field docs/extend_config.md adds",
    ("docs/extend_config.md", "optimizer.eps"): "the field the page adds",
    ("docs/extend_objective.md", "gspo_jax/objectives/pg.py"): "the module the page adds",
    ("docs/extend_objective.md", "PGHparams"): "the class the page adds",
    ("docs/extend_task.md", "gspo_jax/tasks/digit_sum.py"): "the task the page adds",
    ("gspo_jax/config.py", "sft.lrr"): "a misspelt key: closest_key's example",
    ("gspo_jax/config.py", "config.lr"): "a misspelt key: closest_key's example",
    ("docs/reliability.md", "--config.updates.aux_los_coef=0.1"): "a misspelt key: the example",
}


def sources() -> list[pathlib.Path]:
    """The Markdown files whose references are checked (the docstrings: `modules`)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    files += sorted((REPO / "experiments").glob("*.md"))
    files += sorted((REPO / "experiments").glob("*/README.md"))
    return [f for f in files if f.exists()]


# ---------------------------------------------------------------------------
# The project's modules, from their syntax trees.


@dataclasses.dataclass
class Module:
    name: str  # gspo_jax.objectives.registry
    path: pathlib.Path
    tree: ast.Module
    names: dict  # top-level name -> its binding (ast node, or ("import", module, attr))
    has_getattr: bool


def _bindings(body, module: str, is_package: bool) -> dict:
    """The names a module body binds, walking into if/try/with blocks."""
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        out[n.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = ("module", a.name)
                else:
                    out[a.name.split(".")[0]] = ("module", a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            for a in node.names:
                if a.name == "*":
                    out.setdefault("*", []).append(base)
                else:
                    out[a.asname or a.name] = ("import", base, a.name)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                out.update(_bindings(block, module, is_package))
    return out


@functools.cache
def modules() -> dict[str, Module]:
    """Every module and package of gspo_jax/ and experiments/, by dotted name."""
    out = {}
    for root in CODE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join(parts)
            tree = ast.parse(path.read_text(), str(path))
            names = _bindings(tree.body, name, is_package)
            has_getattr = "__getattr__" in names
            out[name] = Module(name, path, tree, names, has_getattr)
    return out


@functools.cache
def by_short_name() -> dict[str, list[str]]:
    """A module's own name (its last part) -> the dotted names of the modules so named."""
    out: dict[str, list[str]] = {}
    for name in modules():
        out.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return out


@functools.cache
def top_level_classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """A class name -> (module, class node) of each top-level class so named."""
    out: dict[str, list] = {}
    for m in modules().values():
        for key, node in m.names.items():
            if isinstance(node, ast.ClassDef) and node.name == key:
                out.setdefault(key, []).append((m.name, node))
    return out


@functools.cache
def top_level_names() -> frozenset[str]:
    """Every name defined (not imported) at the top level of a module of the project."""
    return frozenset(
        key for m in modules().values() for key, node in m.names.items()
        if isinstance(node, ast.AST)
    )


def _import_attr(module: str, parts: list[str]) -> bool:
    """The live lookup, where the syntax tree cannot say."""
    try:
        obj = importlib.import_module(module)
        for p in parts:
            obj = getattr(obj, p)
    except Exception:
        return False
    return True


@functools.cache
def _class_members(node: ast.ClassDef) -> frozenset[str]:
    out = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            out |= {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.add(stmt.target.id)
    for fn in ast.walk(node):  # self.x = ... in the methods
        if isinstance(fn, (ast.Assign, ast.AnnAssign)):
            targets = fn.targets if isinstance(fn, ast.Assign) else [fn.target]
            for t in targets:
                for n in ast.walk(t):
                    if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                            and n.value.id == "self"):
                        out.add(n.attr)
    return frozenset(out)


def _expr_parts(e) -> list[str] | None:
    if isinstance(e, ast.Subscript):  # Generic[T]
        e = e.value
    if isinstance(e, ast.Name):
        return [e.id]
    if isinstance(e, ast.Attribute):
        inner = _expr_parts(e.value)
        return None if inner is None else inner + [e.attr]
    return None


def _resolve_class(module: str, node: ast.ClassDef, parts: list[str], depth: int = 0) -> bool:
    """``parts`` (attribute names) of class ``node`` defined in ``module``."""
    if not parts:
        return True
    if depth > 20:
        return False
    head, rest = parts[0], parts[1:]
    for stmt in node.body:  # a nested class
        if isinstance(stmt, ast.ClassDef) and stmt.name == head:
            return _resolve_class(module, stmt, rest, depth + 1)
    if head in _class_members(node):
        return True  # a member's own attributes are not typed by the tree
    # The bases: the project's are read, another library's is looked up live.
    for base in node.bases:
        bparts = _expr_parts(base)
        if bparts is None:
            continue
        found = _lookup(module, bparts)
        if isinstance(found, tuple) and found[0] == "class":
            if _resolve_class(found[1], found[2], parts, depth + 1):
                return True
        elif found is not None and found[0] == "external":
            return _import_attr(module, [*_class_path(module, node), *parts])
    return False


def _class_path(module: str, node: ast.ClassDef) -> list[str]:
    """The attribute path of a class in its module (nested classes included)."""
    tree = modules()[module].tree

    def walk(body, path):
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                if stmt is node:
                    return path + [stmt.name]
                found = walk(stmt.body, path + [stmt.name])
                if found:
                    return found
        return None

    return walk(tree.body, []) or [node.name]


def _lookup(module: str, parts: list[str]):
    """What a name path means in ``module``'s namespace: ("module", name),
    ("class", module, node), ("value",), ("external",) or None (not bound)."""
    m = modules().get(module)
    if m is None:
        return None
    head = parts[0]
    binding = m.names.get(head)
    if binding is None:
        for star in m.names.get("*", []):
            found = _lookup(star, parts) if star in modules() else None
            if found is not None:
                return found
        if f"{module}.{head}" in modules():
            binding = ("module", f"{module}.{head}")
        else:
            return None
    if isinstance(binding, tuple):
        if binding[0] == "module":
            target = binding[1]
            if target not in modules():
                return ("external",)
            return _walk_module(target, parts[1:])
        _, base, attr = binding
        if f"{base}.{attr}" in modules():
            return _walk_module(f"{base}.{attr}", parts[1:])
        if base not in modules():
            return ("external",)
        return _lookup(base, [attr, *parts[1:]])
    if isinstance(binding, ast.ClassDef):
        if len(parts) == 1:
            return ("class", module, binding)
        return ("value",) if _resolve_class(module, binding, parts[1:]) else None
    return ("value",)


def _walk_module(module: str, parts: list[str]):
    if not parts:
        return ("module", module)
    found = _lookup(module, parts)
    if found is None and modules()[module].has_getattr:
        return ("value",) if _import_attr(module, parts) else None
    return found


def resolve_in_module(module: str, parts: list[str]) -> bool:
    return _walk_module(module, parts) is not None


# ---------------------------------------------------------------------------
# The config.


@functools.cache
def config_paths() -> frozenset[str]:
    """Every path of base_config(), its groups, the open groups' keys and the removed keys."""
    out = set()

    def walk(node, prefix):
        for key in node.keys():
            value = node[key]
            out.add(prefix + key)
            if hasattr(value, "keys"):
                walk(value, prefix + key + ".")

    walk(config_lib.base_config(), "")
    for name in objectives.names():
        out |= {f"objective.hparams.{k}" for k in objectives.get(name).defaults}
    # model.fields: base_config holds every field docs/config.md documents (not the runtime
    # settings, which are config.model's, nor those the trainer derives).
    out |= set(old_keys.REMOVED_KEYS)
    return frozenset(out)


@functools.cache
def config_sections() -> frozenset[str]:
    return frozenset(p.split(".")[0] for p in config_paths())


# ---------------------------------------------------------------------------
# Checking one reference: None if the text is no reference, OK if it resolves, else
# why not.

OK = ""
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_NAME = re.compile(r"[A-Za-z_]\w*")
_CAPITALISED = re.compile(r"[A-Z]\w*[a-z]\w*")
_SETTING = re.compile(r"(?:--)?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+) ?= ?[^=].*")
_CALL = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\([^()]*\)")
_PATH = re.compile(r"(?:gspo_jax|configs|experiments|tests|docs)/[\w./*{},<>-]*")


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [
        q for alt in m.group(1).split(",")
        for q in _expand_braces(path[: m.start()] + alt + path[m.end() :])
    ]


def check_path(text: str) -> str:
    """Rule 1."""
    path, _, name = text.partition("::")
    path = path.split()[0].split(":", 1)[0].rstrip(".,;")
    for one in _expand_braces(re.sub(r"<[^<>/]*>", "*", path)):
        if any(c in one for c in "*?"):
            if not glob.glob(str(REPO / one)):
                return f"{one} matches no file"
        elif not (REPO / one).exists():
            return f"{one}: no such file or folder"
    name = name.strip().split("[")[0].split("::")[0]
    if name and name not in _defined_in(path):
        return f"{path} defines no {name}"
    return OK


@functools.cache
def _defined_in(path: str) -> frozenset[str]:
    """The functions and classes a file defines (a test's ``path::name``)."""
    tree = ast.parse((REPO / path).read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))


def _resolve_dotted_module(parts: list[str]) -> bool:
    """gspo_jax.a.b.c: the longest module prefix, then attributes."""
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in modules():
            return resolve_in_module(name, parts[i:])
    return False


def check_dotted(text: str) -> str | None:
    """Rule 2."""
    parts = text.split(".")
    if parts[-1] in FILE_EXTENSIONS:
        return None
    readings = []  # (kind, resolves)
    head = parts[0]
    if head == "gspo_jax":
        readings.append(("code", _resolve_dotted_module(parts)))
    if head in by_short_name():
        found = any(resolve_in_module(m, parts[1:]) for m in by_short_name()[head])
        readings.append(("code", found))
    if head in top_level_classes():
        found = any(_resolve_class(m, node, parts[1:]) for m, node in top_level_classes()[head])
        readings.append(("code", found))
    if head == "config" or head in config_sections():
        path = ".".join(parts[1:] if head == "config" else parts)
        readings.append(("config", path in config_paths()))
    if not readings:
        return None
    if any(ok for _, ok in readings):
        return OK
    return "resolves neither as " + " nor as ".join(sorted({k for k, _ in readings}))


def check_capitalised(text: str) -> str:
    """Rule 3."""
    if text in EXTERNAL_NAMES or hasattr(builtins, text) or text in top_level_names():
        return OK
    return "is no name of the project (nor a builtin, nor in EXTERNAL_NAMES)"


def check_span(text: str) -> str | None:
    """A code span: a path, a setting, a dotted name or a capitalised name, alone or
    called (``lora.merge(model)``) or assigned to (``rollout.staleness = k``)."""
    text = " ".join(text.split())
    if text.startswith(PATH_ROOTS):
        return check_path(text)
    m = _SETTING.fullmatch(text) or _CALL.fullmatch(text)
    if m:
        text = m.group(1)
    text = text.removesuffix("()")
    if _DOTTED.fullmatch(text):
        return check_dotted(text)
    if _CAPITALISED.fullmatch(text):
        return check_capitalised(text)
    return None


def check_role(text: str, scope) -> str | None:
    """A Sphinx role's target: rule 4 for a bare name, else relative to the module or
    as a span."""
    text = text.strip().lstrip("~!").removesuffix("()")
    module, cls = scope
    if _NAME.fullmatch(text):
        if cls is not None and _resolve_class(module, cls, [text]):
            return OK
        if _lookup(module, [text]) is not None or hasattr(builtins, text):
            return OK
        if text in by_short_name() or text in top_level_classes():
            return OK
        return f"is not defined in {module}" + (f".{cls.name}" if cls else "")
    if _DOTTED.fullmatch(text) and resolve_in_module(module, text.split(".")):
        return OK
    return check_span(text)


# ---------------------------------------------------------------------------
# Reading the references.


@dataclasses.dataclass(frozen=True)
class Ref:
    file: str
    line: int
    kind: str  # "span", "role" or "path" (in the prose)
    text: str
    scope: tuple | None = None  # a docstring's (module, class node or None)

    def check(self) -> str | None:
        if (self.file, self.text) in NOT_REFERENCES:
            return None
        if self.kind == "role":
            return check_role(self.text, self.scope)
        if self.kind == "path":
            return check_path(self.text)
        if self.kind == "link":
            return OK if pathlib.Path(self.text).exists() else "links to no file"
        return check_span(self.text)


_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"\]\(<?([^()\s#<>]+)(?:#[^()\s]*)?>?\)")
_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):`([^`]+)`")


def _text_refs(text: str, rel: str, first_line: int, scope=None) -> list[Ref]:
    out, taken = [], bytearray(len(text) + 1)  # taken[i]: inside a role or span
    newlines = [i for i, c in enumerate(text) if c == "\n"]

    def line_of(pos):
        return first_line + bisect.bisect_left(newlines, pos)

    for kind, pattern in (("role", _ROLE), ("span", _SPAN), ("path", _PATH)):
        for m in pattern.finditer(text):
            if taken[m.start()]:
                continue
            body = m.group(m.lastindex or 0)
            if kind == "path":  # in the prose: not a part of a longer path or of a URL
                before = text[m.start() - 1 : m.start()]
                if before and (before.isalnum() or before in "/._-<"):
                    continue
                body = body.rstrip(".,;:")
            else:
                taken[m.start() : m.end()] = b"\1" * (m.end() - m.start())
            out.append(Ref(rel, line_of(m.start()), kind, " ".join(body.split()), scope))
    return out


def markdown_refs(path: pathlib.Path, rel: str | None = None) -> list[Ref]:
    """The code spans and prose paths of a Markdown file, outside fenced blocks."""
    kept, fenced = [], False
    for line in path.read_text().split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
            line = ""
        kept.append("" if fenced else line)
    rel = rel or str(path.relative_to(REPO))
    text = "\n".join(kept)
    refs = _text_refs(text, rel, 1)
    for m in _LINK.finditer(text):  # [text](target): relative to the file
        target = m.group(1)
        if "://" not in target and not target.startswith(("mailto:", "#")):
            line = 1 + text.count("\n", 0, m.start())
            refs.append(Ref(rel, line, "link", str(path.parent / target), None))
    return refs


def docstring_refs(module: Module) -> list[Ref]:
    """The references in the docstrings of a module, its classes and functions."""
    rel, out = str(module.path.relative_to(REPO)), []

    def visit(node, cls):
        body = getattr(node, "body", [])
        first = body[0] if body else None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            out.extend(_text_refs(first.value.value, rel, first.lineno, (module.name, cls)))
        for child in body:
            if isinstance(child, ast.ClassDef):
                visit(child, child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, cls)

    visit(module.tree, None)
    return out


def all_refs() -> list[Ref]:
    """Every candidate reference of the `sources` and of gspo_jax's docstrings."""
    refs = [r for f in sources() for r in markdown_refs(f)]
    for name, m in sorted(modules().items()):
        if name == "gspo_jax" or name.startswith("gspo_jax."):
            refs += docstring_refs(m)
    return refs


def unresolved(refs) -> tuple[int, list[str]]:
    """(how many of ``refs`` are references, ``file:line: text: why`` of each that does
    not resolve)."""
    checked, bad = 0, []
    for r in refs:
        why = r.check()
        if why is None:
            continue
        checked += 1
        if why:
            bad.append(f"{r.file}:{r.line}: {r.text!r} {why}")
    return checked, bad


# ---------------------------------------------------------------------------
# The tests.


def test_every_reference_resolves():
    checked, bad = unresolved(all_refs())
    assert checked > 1000, checked  # the reading found them
    assert not bad, f"{len(bad)} reference(s) do not resolve:\n" + "\n".join(bad)


# The stale references issue 48 found (all since fixed), and others of each kind.
STALE = [
    "`RolloutQueue`",
    "`rl._assemble`",
    "`gspo_jax.rl._assemble`",
    "`RunParts.collect`",
    "`train.maybe_initialize_distributed`",
    "`gspo_jax.safety.RESUMABLE_FIELDS`",
    "`train.BATCH_AXES`",
    "`gspo_jax.rollout.NoSampler`",
    "`objectives.registry.deregister`",
    "`Sampler.no_such_method()`",
    "`rollout.max_new_token`",
    "`config.updates.packingg`",
    "`--config.rollout.stalenes=2`",
    "`objective.hparams.eps_middle`",
    "`lora.merge_all(model)`",
    "`gspo_jax/objectives.py`",
    "`experiments/bench_objectives.py`",
    "`experiments/targets.compiling_for`",
    "`tests/test_objectives.py::test_no_such_test`",
    "`experiments/accelerator/compile/lora_*.{json,csv}`",
    "see gspo_jax/no_such_module.py for the details",
]
RESOLVED = [
    "`gspo_jax.rollout.Sampler`",
    "`gspo_jax.objectives.get`",
    "`collect._assemble`",
    "`Collector.collect`",
    "`RLPhase.queue`",
    "`multihost.maybe_initialize_distributed`",
    "`gspo_jax.config.resumable_fields()`",
    "`config.validate`",
    "`config.ConfigError`",
    "`sharding.BATCH_AXES`",
    "`objectives.registry.ObjectiveConfig`",
    "`models.config.ModelSection`",
    "`Rollout.replay()`",
    "`Status.CORRECT`",
    "`RunParts`",
    "`lora.merge(model)`",
    "`rollout.max_new_tokens`",
    "`config.updates.micro_batches`",
    "`--config.rollout.staleness=2`",
    "`rollout.staleness = k`",
    "`objective.hparams.tau_neg`",
    "`model.fields.num_experts`",
    "`rollout.top_p`",
    "`gspo_jax/decode.py`",
    "`experiments/bench/bench_rollout.py`",
    "`configs/default.py:objective=gspo,smoke`",
    "`tests/test_objectives.py::test_names`",
    "`experiments/accelerator/compile/{before,after}_h200_L{8,12,16}.json`",
    "`experiments.targets.compiling_for`",
    "`stats.bootstrap_diff_ci`",
    "see gspo_jax/decode.py for the details",
]
NOT_REFERENCES_OF_THE_PROJECT = [
    "`jax.jit`", "`jnp.where`", "`hp.eps_low`", "`metrics.jsonl`", "`step.py`",
    "`clip_frac`", "`NamedSharding`", "`ValueError`", "`python -m gspo_jax.train`",
]


def _one(markdown: str) -> Ref:
    refs = _text_refs(markdown, "example.md", 1)
    assert len(refs) == 1, refs
    return refs[0]


@pytest.mark.parametrize("markdown", STALE)
def test_a_stale_reference_is_reported(markdown):
    assert _one(markdown).check(), markdown


@pytest.mark.parametrize("markdown", RESOLVED)
def test_a_reference_that_resolves_passes(markdown):
    assert _one(markdown).check() == OK, markdown


@pytest.mark.parametrize("markdown", NOT_REFERENCES_OF_THE_PROJECT)
def test_what_is_not_the_projects_is_not_checked(markdown):
    assert not _one(markdown).check(), markdown


def test_docstrings_are_read_with_their_module_and_class():
    source = '''"""A module: `RolloutQueue`, ``rollout.max_new_tokens``, :func:`names`."""
from gspo_jax.objectives.registry import names


class Thing:
    """Its own `run`, :meth:`run`, :meth:`Collector.collect` and :meth:`RunParts.collect`."""

    def run(self):
        """Sees ``self.x`` and :class:`Thing`; ``RunParts.fill_batch`` is gone."""
'''
    name, tree = "gspo_jax._docstring_example", ast.parse(source)
    module = Module(name, REPO / "gspo_jax" / "__init__.py", tree,
                    _bindings(tree.body, name, False), False)
    modules()[name] = module
    try:
        bad = {r.text for r in docstring_refs(module) if r.check()}
    finally:
        del modules()[name]
    assert bad == {"RolloutQueue", "RunParts.collect", "RunParts.fill_batch"}, bad


def test_a_stale_reference_in_a_doc_fails_the_check(tmp_path):
    """The whole path: a Markdown file that names moved code is reported with its line."""
    doc = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Another page\n")
    doc.write_text("# A page\n\nThe queue (`RolloutQueue`) is built by\n`rl._assemble`.\n\n"
                   "```python\nrl._assemble  # a code block is an example, not read\n```\n"
                   "See [the other page](other.md), [a third](third.md#top) and "
                   "[the web](https://example.com/x.md).\n")
    checked, bad = unresolved(markdown_refs(doc, "page.md"))
    assert checked == 4
    assert [b.split(" ")[0] for b in bad] == ["page.md:3:", "page.md:4:", "page.md:9:"], bad
