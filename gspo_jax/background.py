"""A writer that the training loop never waits on: TensorBoard's event file and the
Weights & Biases run are written by a thread of their own (`BackgroundWriter`).

The loop hands each write over without blocking. The writer is switched off, with one
message on stderr naming it, where it writes and why, and the run goes on without it:

* on the first error of a write (a full disk, a quota, EIO, a stale NFS handle);
* when a write has not returned within ``timeout`` seconds (a hung file system or
  server; ``config.log_write_timeout``);
* when ``max_pending`` writes are waiting (it does not keep up).

A switched-off writer drops everything handed to it afterwards; its thread, if stuck,
is left behind (a daemon thread: it does not keep the process alive). Signals are
honoured as ever, since the loop never waits on a write: ``flush`` and ``close`` wait
for the queue to drain only while the writer makes progress, at most ``timeout``
seconds on a write that does not return.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any, Callable

_STOP = object()


class BackgroundWriter:
    """Runs the calls handed to `submit`, in order, on one daemon thread.

    ``name`` (``"TensorBoard"``) and ``where`` (its directory) make the message that
    switches it off: ``gspo_jax: TensorBoard (<where>) is switched off: <why>; <then>``.
    """

    def __init__(
        self,
        name: str,
        where: str,
        *,
        timeout: float,
        then: str = "the run goes on without it",
        max_pending: int = 1000,
    ):
        self.name, self.where, self.timeout, self.then = name, where, float(timeout), then
        self.off = False
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._busy_since: float | None = None  # time.monotonic() when the running call began
        self._thread = threading.Thread(target=self._work, name=f"{name} writer", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hand ``fn(*args)`` to the thread; never blocks."""
        self._watch()
        if self.off:
            return
        try:
            self._queue.put_nowait((fn, args))
        except queue.Full:
            self.switch_off(f"{self._queue.maxsize} writes are waiting (it does not keep up)")

    def flush(self) -> None:
        """Wait until every write handed over is done, or the writer is switched off."""
        q = self._queue
        with q.all_tasks_done:
            while q.unfinished_tasks and not self.off:
                q.all_tasks_done.wait(0.05)
                self._watch()

    def close(self, last: Callable[[], Any] | None = None) -> None:
        """Run ``last`` (the writer's own close) after the writes handed over, then end the
        thread; waits as `flush` does. A writer switched off runs nothing more."""
        if last is not None:
            self.submit(last)
        self.flush()
        if not self.off:
            self._queue.put_nowait(_STOP)  # room: the queue is empty
            self._thread.join()
        self.off = True

    def switch_off(self, why: str) -> None:
        """Switch the writer off with its one message (later calls say nothing)."""
        with self._lock:
            if self.off:
                return
            self.off = True
        print(
            f"gspo_jax: {self.name} ({self.where}) is switched off: {why}; {self.then}",
            file=sys.stderr,
            flush=True,
        )

    def _watch(self) -> None:
        """The watchdog, run by the caller's thread: a write that has not returned within
        ``timeout`` seconds switches the writer off."""
        since = self._busy_since
        if not self.off and since is not None and time.monotonic() - since > self.timeout:
            self.switch_off(
                f"a write has not returned in {self.timeout:g} s "
                "(config.log_write_timeout: a hung file system or server)"
            )

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP or self.off:
                return
            fn, args = item
            self._busy_since = time.monotonic()
            try:
                fn(*args)
            except Exception as e:  # any error: the writer is of no further use
                self.switch_off(f"{type(e).__name__}: {e}")
                return
            finally:
                self._busy_since = None
            self._queue.task_done()
