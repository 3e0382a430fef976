"""Trainer runs that several test files read, each trained once per test session
(conftest's ``shared_once``; not a test module). A test that writes into one copies it
first (`copy_run`).

Each run's config is built here, and only here, so that the tests that share a run, and
the tests that run the same config themselves, compile the same programs (the learning
rate schedules depend on the step counts, so a smoke run of other step counts is other
train-step programs).

* `smoke_run`: ``configs/default.py:smoke`` in the test process (8 fake devices, the
  mesh's data axis over all of them).
* `mesh222_run`: the same with ``mesh.data=2, mesh.fsdp=2, mesh.expert=2``: the
  one-process reference of the sharded and the two-process runs.
* `grpo_paths_run`: GRPO with gradient accumulation over a (data, expert, tensor) mesh
  and the log-prob passes in pieces (tests/test_train.py's path of the loop).
* `kill_reference_run`: ``KILL_ARGS`` on one device, in a subprocess: the uninterrupted
  run that the kill-and-resume tests compare with.
"""

import os
import shutil
import subprocess
import sys

from conftest import subprocess_env

from configs import default as default_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The kill-and-resume runs (tests/test_train.py, tests/test_reliability.py): six warm-start
# and six RL steps on one device, a checkpoint after each, three kept.
KILL_ARGS = [
    "--config=configs/default.py:smoke",
    "--config.progress_bar=False",
    "--config.total_rl_steps=6",
    "--config.sft.steps=6",
    "--config.checkpoint_every=1",
    "--config.keep_checkpoints=3",
]


def smoke_config(data_dir, arg="smoke", **overrides):
    """``configs/default.py:<arg>`` on ``data_dir``, with dotted-key ``overrides``."""
    c = default_config.get_config(arg)
    c.task.data_dir = data_dir
    c.update_from_flattened_dict(overrides)  # a misspelt key fails the Trainer's validation
    return c


def mesh222_config(data_dir):
    return smoke_config(data_dir, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.expert": 2})


def grpo_paths_config(data_dir):
    # Micro-batches of 4 rows over the 4 batch shards (data x expert); experts over 2,
    # their width over the tensor axis; the old-policy and reference passes in 4 pieces.
    return smoke_config(
        data_dir,
        "objective=grpo,smoke",
        **{
            "updates.micro_batches": 2,  # gradient accumulation through the full loop
            "mesh.data": 2,
            "mesh.expert": 2,
            "mesh.tensor": -1,
            "updates.logprob_micro_batches": 4,
        },
    )


def _trained(shared_once, name, c):
    def build(path):
        from gspo_jax import train

        train.run(c, path)

    return shared_once(name, build)


def smoke_run(shared_once, data_dir):
    """(workdir, config) of the default smoke run."""
    return _trained(shared_once, "smoke_runs.default", smoke_config(data_dir)), smoke_config(data_dir)


def mesh222_run(shared_once, data_dir):
    """(workdir, config) of the smoke run on a (data=2, fsdp=2, expert=2) mesh."""
    return _trained(shared_once, "smoke_runs.mesh222", mesh222_config(data_dir)), mesh222_config(
        data_dir
    )


def grpo_paths_run(shared_once, data_dir):
    """(workdir, config) of the GRPO run with accumulation and pieces."""
    c = grpo_paths_config(data_dir)
    return _trained(shared_once, "smoke_runs.grpo_paths", c), grpo_paths_config(data_dir)


def kill_reference_run(shared_once, data_dir):
    """The workdir of ``KILL_ARGS`` run to its end, uninterrupted, on one device."""

    def build(path):
        cmd = [sys.executable, "-m", "gspo_jax.train", f"--workdir={path}", *KILL_ARGS,
               f"--config.task.data_dir={data_dir}"]
        out = subprocess.run(cmd, cwd=REPO, env=subprocess_env(1), capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-4000:]

    return shared_once("smoke_runs.kill_reference_1dev", build)


def copy_run(workdir, dst, *ignore):
    """A copy of a shared run's workdir that a test may write into (without the files
    named by the patterns ``ignore``)."""
    shutil.copytree(workdir, dst, ignore=shutil.ignore_patterns(".lock", ".built", *ignore))
    return str(dst)
