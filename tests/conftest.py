"""Test session settings.

* Rank promotion raises, so silently broadcasting f32[N] against f32[N,T]
  fails loudly.
* f32 matmuls at full precision. The tests compare code paths (decode against the
  full forward, dispatch backends, remat) at f32 tolerances; on GPU the default
  would use TF32 (errors ~1e-3), on CPU full precision is already the default.
* 8 fake CPU devices, for the sharding tests; must be set before JAX starts.
  XLA's CPU scheduler that orders a program for concurrency is off: with it, the
  devices of one sharded program (one pool thread each on a small machine) can sit
  in two different all-reduces at once, waiting for each other, until XLA aborts
  the process after 40 s (seen on 2 cores in the stage-1 probe's update: 6 threads
  in one all-reduce, 2 in another). `docs/distributed.md` says the same to users.
* XLA's CPU code generation at LLVM optimisation level 0 (``xla_backend_optimization_level``;
  XLA's own HLO passes, fusion included, run as always). The suite compiles hundreds of
  small programs and runs each a few times, so compile time is most of its time: on two
  cores tests/test_step.py's fast tests took 108 s at the default level and 72 s at 0,
  from an empty compilation cache. Only the tests are compiled this way.
* One persistent XLA compilation cache for the session, its xdist workers and
  the trainer subprocesses they start: the trainer tests run the same programs
  (SFT step, sampler, log-prob pass) many times, and each is compiled once.
  Only compile time changes: an executable loaded from the cache is the one the
  compiler produced for the same program.
* ``compile_counts``: the compilations during a test, from JAX's own monitoring
  events.
* ``fake_stage_runs``: the stability study's RL runs replaced by a record of their
  arguments, for tests of what a stage script runs.
"""

import collections
import os
import tempfile

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
    " --xla_backend_optimization_level=0",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "gspo_jax_tests_xla_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compile_counts():
    """A ``collections.Counter`` of the XLA compilations during the test, by
    function name (``"jit(_generate)"`` for ``jax.jit(_generate)``).

    Counts JAX's ``/jax/core/compile/backend_compile_duration`` monitoring event,
    which every compilation records (an executable loaded from the persistent
    cache included) and a call served by jit's in-memory cache does not; its
    ``fun_name`` is the jitted function's name.  Call ``.clear()`` between the
    phases of a test.
    """
    counts = collections.Counter()

    def listener(event, duration, **kwargs):
        del duration
        if event == COMPILE_EVENT:
            counts[kwargs.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def fake_stage_runs(monkeypatch):
    """The stability study's RL runs replaced (``experiments/stability/common.run_rl``
    and ``summarize_run``): each run's arguments are recorded in the returned list, as
    a dict, and its summary is that of a run that did not collapse (held-out 0.2 →
    0.3) and logged no step. For tests of what a stage script runs, not of the runs."""
    from experiments.stability import common

    calls = []

    def run_rl(root, stage, name, arm, seed, overrides, steps, *, smoke=False, task="small"):
        calls.append(
            dict(
                stage=stage,
                name=name,
                arm=arm,
                seed=seed,
                overrides=overrides,
                steps=steps,
                task=task,
            )
        )
        return name

    def summarize_run(workdir, meta):
        return dict(
            meta,
            steps=[],
            series={},
            collapsed=False,
            collapse_step=None,
            eval_start=0.2,
            eval_final=0.3,
        )

    monkeypatch.setattr(common, "run_rl", run_rl)
    monkeypatch.setattr(common, "summarize_run", summarize_run)
    return calls
