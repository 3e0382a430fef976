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
* ``slow``: a test that took `SLOW_SECONDS` or more in the last measurement of the whole
  suite (tests/durations.json, from an empty compilation cache on two cores) is marked
  ``slow``; ``pytest -m "not slow" -n 2`` is the fast loop. Measure again with
  ``--record-durations=tests/durations.json`` (it writes every test).
* ``compile_counts``: the compilations during a test, from JAX's own monitoring
  events.
* ``fake_stage_runs``: the stability study's RL runs replaced by a record of their
  arguments, for tests of what a stage script runs.
* ``smoke_root``: a stability ``--root`` holding the smoke warm starts and data, trained
  once per test process (the stage tests after stages 1 and 2 start from it).
* Mappings: XLA:CPU maps the code of every compiled program into memory areas of its
  own, and a jitted function keeps each program it compiled for as long as it lives. A
  test process that runs thousands of programs passes Linux's limit on a process's memory
  mappings (``vm.max_map_count``, 65,530 by default) and the next ``mmap`` inside XLA
  ends it with a segmentation fault: test_qlora, test_lora, test_packing, test_step,
  test_offpolicy, test_rollout, test_models and test_refill in one process reached 63,847
  mappings and crashed in the compilation cache's write (`experiments/test_time.md`).
  After any test that leaves its process above `MAPPING_SHARE` of the limit, JAX's
  in-memory caches are dropped (``jax.clear_caches``); a program needed again is read
  back from the persistent cache. Only compile time changes.
* The suite's budget: every worker sums JAX's compilations and their backend seconds; the
  controller prints the totals and, for a whole-suite run (no test selected by name, file,
  ``-k`` or ``-m``), fails the session when they or the session's seconds exceed
  ``tests/budget.json``, so that the suite's time cannot drift back up unnoticed.
"""

import collections
import json
import os
import tempfile
import time

# The session's XLA:CPU flags besides the device count (the docstring says why).
CPU_FLAGS = "--xla_cpu_enable_concurrency_optimized_scheduler=false --xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` of the session with ``devices`` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={int(devices)} {CPU_FLAGS}"


def subprocess_env(devices: int = 1) -> dict:
    """The environment of a subprocess a test starts (a trainer, an export): the
    session's own (its compilation cache included) with its XLA flags at ``devices``
    fake CPU devices, JAX on the CPU. A subprocess given other flags compiles at XLA's
    default optimisation level: the one-process run of tests/test_multihost.py took 65 s
    of CPU that way against 35 s with these flags, from an empty cache."""
    return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")


os.environ.setdefault("XLA_FLAGS", xla_flags(8))
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

# A test this slow or slower (seconds, tests/durations.json) is marked `slow`.
SLOW_SECONDS = 3.0
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        default=None,
        help="write each test's seconds (setup + call + teardown) and the session's totals to PATH",
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    with open(DURATIONS) as f:
        seconds = json.load(f)["seconds"]
    for item in items:
        if seconds.get(item.nodeid, 0.0) >= SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)


_durations = collections.Counter()

# Drop JAX's in-memory caches after a test that leaves the process above this share of
# the kernel's limit on memory mappings (the docstring says why).
MAPPING_SHARE = 0.5


def _mappings_and_limit():
    """(the process's memory mappings now, the kernel's limit), or None off Linux."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n"), limit
    except (OSError, ValueError):
        return None


def drop_caches_near_the_mapping_limit(share: float = MAPPING_SHARE) -> bool:
    """Drop JAX's in-memory caches if the process holds more than ``share`` of the
    kernel's limit on memory mappings; whether it did."""
    counts = _mappings_and_limit()
    if not counts or counts[0] <= share * counts[1]:
        return False
    import gc

    jax.clear_caches()
    gc.collect()
    _compiles["cache_clears"] += 1
    return True


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's own fixtures are gone: what they held can be freed
    drop_caches_near_the_mapping_limit()


def pytest_runtest_logreport(report):  # in the controlling process under xdist too
    _durations[report.nodeid] += report.duration


# The suite's compilations: every process that runs tests counts them (the trainer
# subprocesses a test starts are not counted, as in experiments/restructuring.md).
_compiles = {"compilations": 0, "compile_seconds": 0.0, "cache_clears": 0}


def _count_compile(event, duration, **kwargs):
    del kwargs
    if event == COMPILE_EVENT:
        _compiles["compilations"] += 1
        _compiles["compile_seconds"] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)

BUDGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "budget.json")
_session = {}


def pytest_sessionstart(session):
    _session["start"] = time.monotonic()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist's controller: a worker's totals
    out = getattr(node, "workeroutput", {})
    for key in _compiles:
        _compiles[key] += out.get(key, 0)


def _whole_suite(config) -> bool:
    """Whether this session runs every test: no path, -k, -m, --deselect or --lf."""
    o = config.option
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not o.keyword
        and not o.markexpr
        and not getattr(o, "deselect", None)
        and not getattr(o, "lf", False)
        and not getattr(o, "exitfirst", False)
    )


def pytest_sessionfinish(session):
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: hand its totals to the controller
        config.workeroutput.update(_compiles)
        return
    totals = dict(_compiles, session_seconds=time.monotonic() - _session.get("start", 0.0))
    _session["totals"] = totals
    path = config.getoption("--record-durations")
    if path:
        seconds = {k: round(v, 2) for k, v in sorted(_durations.items())}
        with open(path, "w") as f:
            about = "seconds per test, setup + call + teardown (tests/conftest.py)"
            json.dump({"_about": about, "totals": _rounded(totals), "seconds": seconds}, f, indent=1)
            f.write("\n")
    if _whole_suite(config) and session.testscollected:
        with open(BUDGET) as f:
            budget = json.load(f)
        over = [f"{k} {totals[k]:,.0f} > budget {budget[k]:,}" for k in budget if not k.startswith("_")
                and totals[k] > budget[k]]
        _session["over"] = over
        if over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _rounded(totals):
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in totals.items()}


def pytest_terminal_summary(terminalreporter):
    if "totals" not in _session:
        return
    t = _session["totals"]
    terminalreporter.write_line(
        f"suite budget: {t['compilations']:,} compilations, {t['compile_seconds']:,.0f} s of backend "
        f"compile in the test processes, {t['session_seconds']:,.0f} s (tests/budget.json); "
        f"JAX's caches dropped {t['cache_clears']:,} times for the mapping limit"
    )
    for line in _session.get("over", []):
        terminalreporter.write_line(f"OVER BUDGET: {line}", red=True)


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


class _SmokeWarmStarts:
    """The stability study's smoke warm starts (small task), each trained once per test
    process in one root and copied into the root of each test that asks for it."""

    def __init__(self, root):
        self.root = str(root)

    def root_with(self, dst, arms, seed=0):
        """``dst`` as a stage's ``--root`` holding the prepared data (if any: the synthetic
        tasks write none) and the finished smoke warm starts of ``arms`` (seed ``seed``),
        as if the stage had built them."""
        import shutil

        from experiments.stability import common

        for arm in arms:
            common.ensure_warm_start(self.root, arm, seed, smoke=True)
        os.makedirs(os.path.join(dst, "warm"), exist_ok=True)
        if os.path.isdir(os.path.join(self.root, "data")):
            shutil.copytree(os.path.join(self.root, "data"), os.path.join(dst, "data"))
        for arm in arms:
            name = os.path.join("warm", f"{arm}_s{seed}")
            shutil.copytree(os.path.join(self.root, name), os.path.join(dst, name))
        return dst


@pytest.fixture(scope="session")
def _smoke_warm_starts(tmp_path_factory):
    return _SmokeWarmStarts(tmp_path_factory.mktemp("stability_warm"))


@pytest.fixture
def smoke_root(tmp_path, _smoke_warm_starts):
    """``smoke_root(arms)``: a stability ``--root`` (``tmp_path/root``) that already holds
    the smoke warm starts of ``arms`` (seed 0) and the data. The stage tests start from
    these, so that a test process trains each warm start once (building them from an
    empty root is what the GPU replication's test, on the hard task, still does)."""
    return lambda arms=("moe2", "dense2"): _smoke_warm_starts.root_with(tmp_path / "root", arms)
