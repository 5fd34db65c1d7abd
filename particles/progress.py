"""Signs of life of long computations: at most one INFO line per :data:`PROGRESS_SECONDS`.

The solvers that can run for minutes (the streaming and dense Sinkhorn of :mod:`transport`, the Lanczos and
power iterations of :mod:`meanfield.krylov`, the steps of ``simulate``) log where they are on their own loggers; a
call shorter than the period says nothing. Each keeps one :class:`Heartbeat` and formats its own line when it is due.

A single call with no iteration of its own to count (one attention pass over 1e5 tokens: a fused kernel of
minutes on CPU) runs inside :func:`long_call`: a watcher thread logs what the call is and the seconds spent while
it runs, with the share done where the call reports one (:func:`advance`, the tile loops' query blocks).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time

__all__ = ["PROGRESS_SECONDS", "Heartbeat", "long_call", "advance"]

#: a long computation logs its progress at INFO about this often (seconds); read at every beat
PROGRESS_SECONDS = 5.0


class Heartbeat:
    """When the next progress line of one computation is due: :meth:`due` is True at most once per
    :data:`PROGRESS_SECONDS`, counted from the computation's start; :attr:`elapsed` is the time since then."""

    def __init__(self):
        self.start = self.last = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < PROGRESS_SECONDS:
            return False
        self.last = now
        return True

    def long_running(self) -> bool:
        """Whether the computation has run for a period or more, however recent its last line: its milestones (a
        certificate, say) are then each worth one. True counts as a beat (the next :meth:`due` waits a period)."""
        if self.elapsed < PROGRESS_SECONDS:
            return False
        self.last = time.monotonic()
        return True


class _Call:
    """One watched call: what it is, when it started, the share done so far (None while unknown)."""

    def __init__(self, logger, what):
        self.logger, self.what = logger, what
        self.start = self.last = time.monotonic()
        self.done = self.stage = None
        self.lines = 0

    def line(self, text):
        self.lines += 1
        self.logger.info("%s: %s", self.what, text)

    def beat(self, now):
        done, stage = self.done, self.stage
        share = "" if done is None else f"; {stage or 'pass'} {100 * done:.0f}% done"
        self.last = now
        self.line(f"running for {now - self.start:.0f} s{share}")


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("particles_progress_call", default=None)


class _Watcher:
    """One daemon thread for every watched call of the process: it sleeps until the next line is due (or until a
    call is registered) and logs the lines of the calls whose period has passed. Registering a call costs a few
    microseconds (a thread started per call cost 0.15-0.35 ms)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.calls: dict[int, _Call] = {}
        self.thread = None

    def add(self, call: _Call) -> None:
        with self.lock:
            self.calls[id(call)] = call
            if self.thread is None or not self.thread.is_alive():
                thread = threading.Thread(target=self._run, name="particles-progress", daemon=True)
                try:
                    thread.start()
                except RuntimeError:   # no thread to be had (a process at its limit): the call runs without lines
                    return
                self.thread = thread
        self.wake.set()

    def remove(self, call: _Call) -> None:
        with self.lock:
            self.calls.pop(id(call), None)

    def _run(self) -> None:
        while True:
            period = PROGRESS_SECONDS
            with self.lock:
                now = time.monotonic()
                for call in list(self.calls.values()):
                    if now - call.last >= period:
                        call.beat(now)
                due = min((c.last + period for c in self.calls.values()), default=None)
            self.wake.wait(None if due is None else max(due - time.monotonic(), 1e-3))
            self.wake.clear()


_WATCHER = _Watcher()
if hasattr(os, "register_at_fork"):   # a child process starts without the thread, and with a free lock
    os.register_at_fork(after_in_child=lambda: globals().update(_WATCHER=_Watcher()))


@contextlib.contextmanager
def long_call(logger, what: str):
    """Watch one long call: while the block runs, an INFO line on ``logger`` every :data:`PROGRESS_SECONDS`
    (``what``, the seconds spent, the share done where :func:`advance` reports one), and a last line with the
    time taken if any was logged. A block shorter than the period says nothing.

    The lines come from one daemon thread of the process (the call itself is busy in one kernel); nothing is
    registered where ``logger`` does not log INFO, or a watched call encloses this one (the outer call's lines
    cover it).
    """
    if _CURRENT.get() is not None or not logger.isEnabledFor(logging.INFO):
        yield
        return
    call = _Call(logger, what)
    token = _CURRENT.set(call)
    watcher = _WATCHER
    ended = "done in"
    try:
        watcher.add(call)
        yield
    except BaseException as error:
        ended = f"stopped by {type(error).__name__} after"
        raise
    finally:
        watcher.remove(call)
        _CURRENT.reset(token)
        if call.lines:
            call.line(f"{ended} {time.monotonic() - call.start:.1f} s")


def advance(done: int, total: int, stage: str | None = None) -> None:
    """Report that ``done`` of ``total`` parts of the watched call's current ``stage`` (a name such as "JVP" for a
    call of several passes) are finished; a no-op outside :func:`long_call`."""
    call = _CURRENT.get()
    if call is not None and total > 0:
        call.stage, call.done = stage, done / total
