"""TFDS 4.9 looks up ``importlib_resources.abc.Traversable`` (the PyPI
backport) whenever it locates a builder's code, which every
``download_and_prepare`` does. Recent ``etils[epath]`` no longer installs the
backport, so without it no builder defined in a package (ours, or TFDS's own
``gsm8k``) can prepare. The standard library's ``importlib.resources`` has the
same ``abc.Traversable``; it stands in when the backport is absent.
"""

import importlib.resources
import sys

try:
    import importlib_resources  # noqa: F401  pylint: disable=unused-import
except ImportError:
    sys.modules.setdefault("importlib_resources", importlib.resources)
