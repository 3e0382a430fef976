"""The package, configs and experiments keep one format and import order (ruff, with
the settings in pyproject.toml). Fix with ``ruff format . && ruff check --fix .``."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATHS = ["gspo_jax", "configs", "experiments"]


def _ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT,
                          capture_output=True, text=True)


def test_format():
    out = _ruff("format", "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_imports_and_names():
    out = _ruff("check")
    assert out.returncode == 0, out.stdout + out.stderr
