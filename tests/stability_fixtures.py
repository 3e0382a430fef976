"""The stability study's smoke fixtures, built once per test session (across xdist
workers, through tests/conftest.py's ``shared_once``) and shared by the stage tests.

* ``stability_stage1``: stage 1's smoke run from an empty ``--root``: ``<path>/root``
  holds the prepared data and the smoke warm starts of moe2 and dense2 (seed 0) that
  stage 1 trained, ``<path>/s1`` its probes. Tests that write there copy it first.
* ``smoke_root``: ``smoke_root(arms)``, a stability ``--root`` (``tmp_path/root``) that
  already holds the data and those warm starts of ``arms``, copied from stage 1's root:
  every stage test after stages 1 and 2 starts from them, so that the session trains
  each warm start once (it overrides tests/conftest.py's fixture of the same name,
  which trains them once per test process).
"""

import os
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG1 = os.path.join(REPO, "experiments", "stability", "stage1_config.py") + ":smoke"
# The warm starts stage 1's smoke trains (stage1_config.py's smoke arms, seed 0).
STAGE1_ARMS = ("moe2", "dense2")


def build_stage1(path: str) -> None:
    from experiments.stability import stage1_probes

    root, out = os.path.join(path, "root"), os.path.join(path, "s1")
    stage1_probes.main(["--root", root, "--out", out, "--config", CFG1])


@pytest.fixture(scope="session")
def stability_stage1(shared_once):
    """The folder of stage 1's smoke run (``root`` and ``s1``), built once per session."""
    return shared_once("stability_stage1", build_stage1)


def root_with(src_root: str, dst: str, arms, seed: int = 0) -> str:
    """``dst`` as a stage's ``--root`` holding ``src_root``'s data and the finished smoke
    warm starts of ``arms`` (seed ``seed``), as if the stage had built them."""
    missing = [a for a in arms if seed != 0 or a not in STAGE1_ARMS]
    if missing:
        raise ValueError(f"no shared smoke warm start of {missing} (seed {seed})")
    os.makedirs(os.path.join(dst, "warm"), exist_ok=True)
    shutil.copytree(os.path.join(src_root, "data"), os.path.join(dst, "data"))
    for arm in arms:
        name = os.path.join("warm", f"{arm}_s{seed}")
        shutil.copytree(os.path.join(src_root, name), os.path.join(dst, name))
    return dst


@pytest.fixture
def smoke_root(tmp_path, stability_stage1):
    """``smoke_root(arms)``: a stability ``--root`` (``tmp_path/root``) that already holds
    the smoke warm starts of ``arms`` (seed 0) and the data, stage 1's."""
    src = os.path.join(stability_stage1, "root")
    return lambda arms=STAGE1_ARMS: root_with(src, tmp_path / "root", arms)
