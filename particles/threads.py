"""The framework's thread policy: how many CPU threads torch uses inside each call.

torch parallelizes an operation over a team of threads that meet at a barrier when it ends. When
other processes keep the cores busy (a shared workstation, a cluster node), a team member is often
descheduled, and every barrier waits for the scheduler: small and mid-sized operations then run 10
to 100 times slower than on one thread, with the same results (benchmarks/threads.md). More threads
only pay when each step has enough work and free cores exist. So every long-running entry point
of the framework (:func:`~meanfield.local_lipschitz`, the worst-case search, :func:`~meanfield.simulate`,
:func:`transport.solve`) runs under a :class:`ThreadPolicy`:

1. an override, if any, wins: :func:`set_threads` (or ``meanfield --threads N``), else the
   environment variable ``SMOOTH_ATTENTION_THREADS`` (a positive integer, or ``auto``);
2. a call whose steps take less than :data:`SMALL_STEP` seconds on one thread stays on one thread
   (a second thread could save at most half of that, a busy core costs far more);
3. otherwise it takes the cores that are free: the cores this process may run on, minus the
   threads of other processes that are running now (sampled from ``/proc`` on Linux; elsewhere
   the one-minute load average). Processes started with ``nice`` count too: measured with three
   niced jobs on 2 cores, calls that ignored them ran on 2 threads 2 to 7 times slower than on one
   (a niced thread still gets its time slices, and the team's barrier waits for the member it
   displaced). Never more than torch's own setting at the call (``torch.set_num_threads`` stays an
   upper bound), and re-checked while the call runs, so a machine that becomes busy during a long
   call moves it to fewer threads.

Torch's setting is restored when the call ends.

A call with no steps of its own to time (one attention pass, its VJP or JVP: :func:`meanfield.kernels.attend`,
``op(mu)``, ``op.sequence(X)`` called directly) runs under :func:`one_call` instead: the same rules decided at its
entry from an estimate of its one-thread time, the free cores sampled at most every :data:`RECHECK` seconds
for consecutive calls; inside a :class:`ThreadPolicy` (a framework entry point) the entry point decides.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time

import torch

__all__ = ["ThreadPolicy", "parse_threads", "timed_probe", "set_threads", "using_threads", "requested_threads",
           "free_cores", "one_call", "active_policy", "tick", "SMALL_STEP", "ENV"]

log = logging.getLogger(__name__)

#: The environment variable that overrides the policy, a positive integer or "auto"
ENV = "SMOOTH_ATTENTION_THREADS"
#: seconds of one-thread work per step below which a call stays on one thread
SMALL_STEP = 2e-3
#: seconds between two checks of the machine's load during a call
RECHECK = 0.25

_override: int | None = None


def parse_threads(value, name: str) -> int | None:
    """A thread count as ``set_threads`` and ``$SMOOTH_ATTENTION_THREADS`` take it: a positive integer (or its
    text), or None / "" / "auto" for the automatic choice (None); a ValueError or TypeError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "auto"):
            return None
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{name}: expected a positive integer or 'auto', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a positive integer, 'auto' or None, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive integer or 'auto', got {value}")
    return value


def set_threads(n) -> None:
    """Fix the number of threads of every framework call (a positive integer), or give the choice
    back to the policy (None or "auto"). Wins over ``$SMOOTH_ATTENTION_THREADS``."""
    global _override
    _override = parse_threads(n, "threads")


@contextlib.contextmanager
def using_threads(n, *, environment: bool = False):
    """:func:`set_threads` for a block: ``with using_threads(1): ...``. With ``environment``, also
    ``$SMOOTH_ATTENTION_THREADS``, so that processes started in the block (pool or Dask workers)
    inherit it. Both are restored on exit."""
    global _override
    value = parse_threads(n, "threads")
    saved, saved_env = _override, os.environ.get(ENV)
    _override = value
    if environment:
        os.environ[ENV] = "auto" if value is None else str(value)
    try:
        yield value
    finally:
        _override = saved
        if environment:
            if saved_env is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = saved_env


def requested_threads() -> int | None:
    """The override in force: :func:`set_threads`, else ``$SMOOTH_ATTENTION_THREADS``, else None."""
    if _override is not None:
        return _override
    return parse_threads(os.environ.get(ENV), ENV)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _running_here() -> int:
    """Threads of this process in the running state now (Linux)."""
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "R":
                    n += 1
        except (OSError, IndexError):
            continue
    return n


def _running_elsewhere() -> float:
    """Threads of other processes that are running now: procs_running of /proc/stat minus this
    process's running threads, median of three samples; elsewhere the load average minus one."""
    try:
        samples = []
        for i in range(3):
            with open("/proc/stat") as f:
                running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
            samples.append(max(0, running - max(1, _running_here())))
            if i < 2:
                time.sleep(2e-4)
        return float(sorted(samples)[1])
    except (OSError, StopIteration, ValueError):
        try:
            return max(0.0, os.getloadavg()[0] - 1.0)
        except (AttributeError, OSError):
            return 0.0


def free_cores() -> int:
    """The cores this process may use that no other process is running on now (at least 1)."""
    return max(1, _cores() - int(round(_running_elsewhere())))


class ThreadPolicy:
    """The threads of one call (module docstring). Use as a context manager::

        with ThreadPolicy() as policy:      # starts on one thread: the first step is the probe
            step()                          # ... timed by the caller
            policy.observe(seconds)         # decides from the one-thread time of a step
            for _ in range(k):
                step(); policy.tick()       # re-checks the load now and then

    ``step_seconds`` given up front decides at once. Torch's thread count is restored on exit.
    """

    def __init__(self, step_seconds: float | None = None):
        self.step_seconds = step_seconds
        self.threads = 1
        self._entry = None
        self._checked = 0.0
        self._small = False

    def __enter__(self) -> ThreadPolicy:
        self._entry = torch.get_num_threads()
        try:
            fixed = requested_threads()   # (a malformed $SMOOTH_ATTENTION_THREADS raises here)
            if fixed is not None:
                self._set(fixed)
                self._small = True   # nothing to re-check: the user decided
            elif self.step_seconds is not None:
                self.observe(self.step_seconds)
            else:
                self._set(1)
        except BaseException:
            torch.set_num_threads(self._entry)
            raise
        self._token = _ACTIVE.set(self)   # only once entered: a failed entry leaves no policy active
        return self

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self._entry)
        _ACTIVE.reset(self._token)

    def _set(self, n: int) -> None:
        if n != self.threads and log.isEnabledFor(logging.DEBUG):
            log.debug("threads: %d -> %d (%s)", self.threads, n,
                      "requested" if requested_threads() is not None else
                      f"one-thread step {self.step_seconds:.2g} s, {'small' if self._small else 'free cores'}"
                      if self.step_seconds is not None else "probe")
        self.threads = n
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def observe(self, step_seconds: float) -> int:
        """Decide from the one-thread time of a step; returns the threads chosen."""
        if requested_threads() is not None:
            return self.threads
        self.step_seconds = step_seconds
        self._small = _small(step_seconds, self._entry)
        self._recheck(force=True)
        return self.threads

    def tick(self) -> None:
        """Re-check the machine's load (at most every :data:`RECHECK` seconds) and adjust."""
        if not self._small and self.step_seconds is not None:
            self._recheck()

    def _recheck(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < RECHECK:
            return
        self._checked = now
        self._set(1 if self._small else _on_free_cores(self._entry, free_cores()))


def _small(step_seconds: float, entry: int) -> bool:
    """The small-step rule (module docstring, 2): steps under :data:`SMALL_STEP`, or torch on one thread already."""
    return step_seconds < SMALL_STEP or entry <= 1


def _on_free_cores(entry: int, free: int) -> int:
    """The free-core rule (module docstring, 3): the free cores, at most torch's setting at the call."""
    return max(1, min(entry, free))


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("particles_thread_policy", default=None)
#: (when, free cores) of the last sample taken for :func:`one_call`
_SAMPLE = [-float("inf"), 1]
#: the calls of :func:`one_call` running now, in any thread, and torch's setting before the first of them: torch's
#: thread count is one per process, so the first call decides it for all and the last one restores it
_RUNNING = {"count": 0, "entry": None, "lock": threading.Lock()}
if hasattr(os, "register_at_fork"):   # a child starts with no call running and a free lock
    os.register_at_fork(after_in_child=lambda: _RUNNING.update(count=0, entry=None, lock=threading.Lock()))


def active_policy() -> ThreadPolicy | None:
    """The :class:`ThreadPolicy` of the entry point running around this code, if any."""
    return _ACTIVE.get()


def tick() -> None:
    """:meth:`ThreadPolicy.tick` of the entry point running around this code (none: nothing), for the loops of
    solvers that do not hold their entry point's policy (the Sinkhorn updates of :func:`transport.solve`)."""
    policy = _ACTIVE.get()
    if policy is not None:
        policy.tick()


@contextlib.contextmanager
def one_call(step_seconds: float):
    """The threads of one call with no steps of its own (one kernel pass), whose one-thread time is estimated at
    ``step_seconds``: the override if any, one thread below :data:`SMALL_STEP`, else the free cores (at most torch's
    setting at the call), sampled at most every :data:`RECHECK` seconds across consecutive calls (a sample costs
    about a millisecond). Inside an active :class:`ThreadPolicy` nothing changes. Torch's setting is restored.

    Torch has one thread count per process: calls that overlap in several Python threads share the choice of the
    first, and the last to end restores the setting it found (each restoring its own left another's count)."""
    if _ACTIVE.get() is not None:
        yield
        return
    lock = _RUNNING["lock"]
    with lock:
        if _RUNNING["count"] == 0:
            entry = torch.get_num_threads()
            n = _one_call_threads(step_seconds, entry)
            _RUNNING["entry"] = entry
            if n != entry:
                torch.set_num_threads(n)
        _RUNNING["count"] += 1
    try:
        yield
    finally:
        with lock:
            _RUNNING["count"] -= 1
            if _RUNNING["count"] == 0 and torch.get_num_threads() != _RUNNING["entry"]:
                torch.set_num_threads(_RUNNING["entry"])


def _one_call_threads(step_seconds: float, entry: int) -> int:
    n = requested_threads()
    if n is not None:
        return n
    if _small(step_seconds, entry):
        return 1
    now = time.monotonic()
    if now - _SAMPLE[0] >= RECHECK:
        _SAMPLE[:] = [now, free_cores()]
    return _on_free_cores(entry, _SAMPLE[1])


@contextlib.contextmanager
def timed_probe(policy: ThreadPolicy | None):
    """Time the block (on the policy's current threads) and hand the seconds to ``policy.observe``."""
    t0 = time.perf_counter()
    yield
    if policy is not None:
        policy.observe(time.perf_counter() - t0)
