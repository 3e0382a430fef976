"""docs/package.md names every module of the package, and nothing that is not there."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(REPO, "gspo_jax")


def _doc() -> str:
  with open(os.path.join(REPO, "docs", "package.md")) as f:
    return f.read()


def test_every_module_is_on_the_map():
  doc = _doc()
  missing = []
  for name in sorted(os.listdir(PKG)):
    path = os.path.join(PKG, name)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "__init__.py")):
      if f"`{name}/`" not in doc:
        missing.append(f"{name}/")
    elif name.endswith(".py") and name != "__init__.py" and f"`{name}`" not in doc:
      missing.append(name)
  assert not missing, f"docs/package.md does not name {missing}"


def test_every_module_on_the_map_exists():
  files = {os.path.relpath(os.path.join(d, f), PKG) for d, _, fs in os.walk(PKG) for f in fs}
  named = set(re.findall(r"`([a-z_/]+\.py)`", _doc())) - {"tests/test_package_map.py"}
  absent = [m for m in named if not any(f == m or f.endswith("/" + m) for f in files)]
  assert named and not absent, f"docs/package.md names modules that do not exist: {absent}"
