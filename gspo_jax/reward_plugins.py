"""Plug-in rewards: a user's function ``module:function`` in place of a verifier.

A user's file (task "file", ``config.task.verifier``) may name a function by import
path. Its signature is ``fn(response: str, reference: str, row: dict) -> float``
(``row``: the file's whole row); its value replaces the reward's ``correct`` component
(> 0 counts as correct). A plug-in that raises or returns anything but a finite real
number gives 0 and the status ``reward_fn_error``; one that runs past its time limit
gives 0 and ``reward_fn_timeout``. Neither is an exception of the run, except as below.

Time limit (``config.task.reward_fn_timeout``). Each call runs in a worker thread (a
daemon) and is waited for at most that many seconds; a call past it counts as failed
and is not waited for. Python cannot stop a thread: the late call runs on until it
returns (its value is dropped) and the next call gets a fresh worker. When
`MAX_LATE_CALLS` late calls are still running at once, the run stops
(`RewardFnError`, naming the function and the response): a function that hangs would
otherwise hold threads, and CPU, for ever. ``reward_fn_timeout=0`` calls the function
in the training thread, with no limit (for a function that must run in the main thread,
such as one that times itself with ``signal.alarm``). A call that holds the GIL without
releasing it (one long C routine) stalls the training thread too; only a separate
process could bound that, at the price of a plug-in's module state (caches, counters)
and of sending every response across, so plug-ins share the trainer's process.

A plug-in that would end or interrupt the process (``sys.exit()``: SystemExit; a
KeyboardInterrupt or GeneratorExit it raises: any exception that is no ``Exception``)
stops the run at once, whatever the policy below: `RewardFnError` naming the function,
the response and what it raised (a ``sys.exit(0)`` would otherwise end the trainer with
status 0). A KeyboardInterrupt is passed on unchanged only where it may be the user's
Ctrl-C: raised in the main thread while SIGINT's handler is Python's own (the trainer
installs its own, `gspo_jax.safety.GracefulShutdown`, under which SIGINT raises
nothing, and no signal is raised in the worker thread). A module that ends the process
when imported is a load error (`load_reward_fn`).

Failures (``config.task.reward_fn_all_failed``) are summarised once per batch scored (a
step's sampling round, an evaluation batch): one warning with the count, the first
failure's type, message and response, and its traceback only the first time. A batch
in which every call failed has nothing to train on: it stops the run ("stop", the
default: `RewardFnError`) or is only summarised ("continue"). On several hosts each
process judges the rows it scores.

Built-in verifiers never come here: only rows whose verifier is a ``module:function``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import queue
import signal
import threading
from typing import Any, Mapping

import numpy as np

from gspo_jax.answers import Status, Verdict, extract_answer

_log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0  # seconds per call
ALL_FAILED = ("stop", "continue")
MAX_LATE_CALLS = 4  # late calls still running at once that stop the run


class RewardFnError(RuntimeError):
    """A plug-in reward failed on every response of a batch, keeps hanging, or would
    end the process."""


def _may_be_ctrl_c(e: BaseException) -> bool:
    """Whether ``e``, raised in this thread while a plug-in ran here, may be the user's
    Ctrl-C rather than the plug-in's own: a KeyboardInterrupt in the main thread while
    SIGINT's handler is Python's, which raises it."""
    return (
        isinstance(e, KeyboardInterrupt)
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )


def _raised(e: BaseException) -> str:
    """What a plug-in raised, as ``SystemExit(0)``, ``KeyboardInterrupt``,
    ``ValueError: message``."""
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r})"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class _Ended(Exception):
    """A plug-in raised ``error``, an exception that is no ``Exception`` (SystemExit,
    KeyboardInterrupt, GeneratorExit, ...) and not the user's Ctrl-C."""

    def __init__(self, error: BaseException):
        super().__init__(_raised(error))
        self.error = error


def is_reward_fn(verifier: str) -> bool:
    """Whether a ``task.verifier`` value names a plug-in ``module:function``."""
    return ":" in verifier


def reward_fn_of(meta: Mapping[str, Any]) -> str | None:
    """The plug-in ``module:function`` that scores a row of this ``meta`` (a user's
    file names it as its ``"verifier"``), or None (a built-in verifier scores it)."""
    spec = meta.get("verifier")
    return spec if isinstance(spec, str) and is_reward_fn(spec) else None


_REWARD_FNS: dict[str, Any] = {}


def load_reward_fn(spec: str):
    """The function ``module:function`` names (imported once, then cached).

    Raises:
      ValueError: if ``spec`` is malformed, the module cannot be imported (or ends
        the process when imported: SystemExit), or the attribute is missing or not
        callable.
    """
    if spec in _REWARD_FNS:
        return _REWARD_FNS[spec]
    module, sep, name = spec.partition(":")
    if not sep or not module or not name or ":" in name:
        raise ValueError(f"a reward function is 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        raise ValueError(f"cannot import module {module!r} of {spec!r}: {e}") from None
    except BaseException as e:  # sys.exit() at import (a script's argument parser)
        if _may_be_ctrl_c(e):
            raise
        raise ValueError(
            f"cannot import module {module!r} of {spec!r}: it raised {_raised(e)} when "
            "imported (it would end the process); import nothing that exits or parses "
            "the command line at the module's top level"
        ) from None
    fn = mod
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"module {module!r} has no function {name!r}")
    _REWARD_FNS[spec] = fn
    return fn


class _TimedOut(Exception):
    pass


class _Call:
    """One call of a plug-in, run by a `_Worker`; ``done`` is set when it returns."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def __call__(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # handed to the waiting thread, which raises it
            self.error = e
        finally:
            self.done.set()


class _Worker:
    """A daemon thread that runs `_Call`s one at a time."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="reward-fn", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def run(self, call: _Call) -> None:
        self._jobs.put(call)

    def retire(self) -> None:
        """The thread ends once its current call returns."""
        self._jobs.put(None)


@dataclasses.dataclass(frozen=True)
class _Failure:
    spec: str
    response: int  # its index in the batch
    text: str
    error: BaseException | None  # None: timed out

    def describe(self, timeout: float) -> str:
        what = (
            f"timed out after {timeout:g} s"
            if self.error is None
            else f"{type(self.error).__name__}: {self.error}"
        )
        return f"response {self.response} ({self.text[:60]!r}): {what}"


def _checked(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"returned {type(value).__name__}, not a float")
    if not np.isfinite(value):
        raise ValueError(f"returned {value}")
    return float(value)


class RewardFnCalls:
    """Calls of plug-in rewards, each under a time limit, and their failures per batch.

    ``timeout``: seconds one call may take (0: no limit, the function runs in the
    calling thread). ``all_failed``: "stop" (raise `RewardFnError`) or "continue" when
    every call of a batch failed. Score a batch inside ``with calls.batch():``.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, all_failed: str = "stop"):
        if not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
        if all_failed not in ALL_FAILED:
            raise ValueError(f"all_failed must be one of {ALL_FAILED}, got {all_failed!r}")
        self.timeout, self.all_failed = float(timeout), all_failed
        self._worker: _Worker | None = None
        self._late: list[threading.Thread] = []  # timed-out calls' threads
        self._calls = 0  # this batch's
        self._failures: list[_Failure] = []  # this batch's
        self._traced: set[str] = set()  # the specs whose traceback was logged

    def verdict(self, spec: str, text: str, meta: Mapping[str, Any], response: int) -> Verdict:
        """Response ``response`` of the batch scored by the plug-in ``spec``: its value
        is the correctness component; > 0 counts as CORRECT; a failure gives reward 0
        and REWARD_FN_ERROR or REWARD_FN_TIMEOUT, recorded for `end_batch`.

        Raises:
          RewardFnError: when `MAX_LATE_CALLS` timed-out calls are still running, or
            the plug-in raised an exception that is no ``Exception`` (``sys.exit()``).
        """
        formatted = extract_answer(text) is not None
        self._calls += 1
        try:
            fn = load_reward_fn(spec)
            value = _checked(self._call(fn, (text, str(meta["answer"]), dict(meta.get("row", {})))))
        except _TimedOut:
            self._failures.append(_Failure(spec, response, text, None))
            self._check_late(spec, response)
            return Verdict(False, formatted, Status.REWARD_FN_TIMEOUT, 0.0)
        except _Ended as e:
            raise RewardFnError(
                f"plug-in reward {spec} raised {_raised(e.error)} on response {response} "
                f"({text[:60]!r}), which would end the trainer unannounced; a reward "
                "function must return a number, so the run stops here. Fix the function"
            ) from e.error
        except Exception as e:
            self._failures.append(_Failure(spec, response, text, e))
            return Verdict(False, formatted, Status.REWARD_FN_ERROR, 0.0)
        status = Status.CORRECT if value > 0 else Status.WRONG_ANSWER
        return Verdict(value > 0, formatted, status, value)

    def _call(self, fn, args) -> Any:
        """``fn(*args)``; an exception that is no ``Exception`` it raised as `_Ended`
        (a Ctrl-C that interrupts it, or the wait for it, passes unchanged)."""
        if not self.timeout:
            try:
                return fn(*args)
            except Exception:
                raise
            except BaseException as e:
                if _may_be_ctrl_c(e):
                    raise
                raise _Ended(e) from e
        if self._worker is None:
            self._worker = _Worker()
        call = _Call(fn, args)
        self._worker.run(call)
        if not call.done.wait(self.timeout):
            self._worker.retire()
            self._late.append(self._worker.thread)
            self._worker = None
            raise _TimedOut
        if isinstance(call.error, Exception):
            raise call.error
        if call.error is not None:  # no signal reaches the worker: the plug-in's own
            raise _Ended(call.error) from call.error
        return call.value

    def _check_late(self, spec: str, response: int) -> None:
        self._late = [t for t in self._late if t.is_alive()]
        if len(self._late) >= MAX_LATE_CALLS:
            raise RewardFnError(
                f"plug-in reward {spec}: {len(self._late)} calls are still running past "
                f"task.reward_fn_timeout={self.timeout:g} s (the latest on response "
                f"{response} of this batch); a Python thread cannot be stopped, so the run "
                "stops rather than keep them. Fix the function (it hangs on these "
                "responses) or raise task.reward_fn_timeout"
            )

    @contextlib.contextmanager
    def batch(self):
        """Scores one batch: on leaving (without an exception), `end_batch`."""
        self._calls, self._failures = 0, []
        yield self
        self.end_batch()

    def end_batch(self) -> None:
        """One summary of the batch's failures: a warning (the first failure's
        traceback the first time a plug-in fails), or `RewardFnError` if every call
        failed and ``all_failed`` is "stop"."""
        calls, failures = self._calls, self._failures
        self._calls, self._failures = 0, []
        if not failures:
            return
        first = failures[0]
        timed_out = sum(f.error is None for f in failures)
        summary = (
            f"plug-in reward {first.spec}: {len(failures)} of {calls} calls failed "
            f"({len(failures) - timed_out} raised or returned no finite float, {timed_out} "
            f"timed out after task.reward_fn_timeout={self.timeout:g} s); the first on "
            f"{first.describe(self.timeout)}"
        )
        if len(failures) == calls and self.all_failed == "stop":
            raise RewardFnError(
                f"{summary}. Every response of this batch failed, so there is nothing to "
                "train on: fix the function, or set task.reward_fn_all_failed='continue' "
                "to go on through such batches"
            ) from first.error
        trace = first.error is not None and first.spec not in self._traced
        if trace:
            self._traced.add(first.spec)
        _log.warning("%s", summary, exc_info=first.error if trace else None)


_DEFAULT: dict[str, RewardFnCalls] = {}


def default_calls(all_failed: str = "stop") -> RewardFnCalls:
    """A shared `RewardFnCalls` with the default time limit, for callers without a
    config (made on first use)."""
    if all_failed not in _DEFAULT:
        _DEFAULT[all_failed] = RewardFnCalls(DEFAULT_TIMEOUT, all_failed)
    return _DEFAULT[all_failed]


def plugin_verdict(spec: str, text: str, meta: Mapping[str, Any]) -> Verdict:
    """One response scored by the plug-in ``spec`` under the default time limit (a
    failure is logged, never raised). A batch goes through `RewardFnCalls`."""
    calls = default_calls("continue")
    with calls.batch():
        return calls.verdict(spec, text, meta, 0)
