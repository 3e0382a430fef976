"""The package's module-level imports form no cycle, and no module is over ~600 lines."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(REPO, "gspo_jax")
MAX_LINES = 620  # "about 600"


def _modules() -> dict[str, str]:
  out = {}
  for d, _, files in os.walk(PKG):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(d, f), REPO)[:-3].replace(os.sep, ".")
        out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
  return out


def _imports(path: str, modules) -> set[str]:
  """The package modules ``path`` imports at module level (not inside functions)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  out = set()
  for node in tree.body:
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    out.update(n for n in names if n in modules)
  return out


def test_no_import_cycle():
  modules = _modules()
  graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      # A package's __init__ importing its own submodules is how a package exports.
      if n.startswith(m + "."):
        continue
      if state.get(n) == "open":
        cycles.append(stack[stack.index(n):] + [n])
      elif n not in state:
        visit(n)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m)
  assert not cycles, f"import cycles: {cycles}"


def test_no_module_is_over_about_600_lines():
  long = {m: n for m, p in _modules().items() if (n := sum(1 for _ in open(p))) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_tasks_import_nothing_of_the_data_package():
  """A task is one module of gspo_jax/tasks/, its examples and its reward: the tasks are
  below gspo_jax.data (whose PromptSource batches any task), never the other way round,
  not even inside a function."""
  found = []
  for d, _, files in os.walk(os.path.join(PKG, "tasks")):
    for f in files:
      if f.endswith(".py"):
        with open(os.path.join(d, f)) as fh:
          tree = ast.parse(fh.read())
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
          elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
          else:
            names = []
          found += [f"{f}: {n}" for n in names if n == "gspo_jax.data" or n.startswith("gspo_jax.data.")]
  assert not found, found
