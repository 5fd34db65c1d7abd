"""Progress of a long loop, readable on a terminal and in a log file.

On a terminal (or in a notebook) :class:`Progress` draws a tqdm bar. Anywhere else (output
redirected to a file, CI, a SLURM job) a bar would write one carriage-return line per update
with cursor codes; :class:`Progress` prints plain lines instead: one when the loop starts, one
at most every ``interval`` seconds while it runs, and one when it ends::

    masked/ratios: 0/30 tasks
    masked/ratios: 12/30 tasks (40%), done=12 running=1 failed=0, 31 s elapsed, about 46 s left
    masked/ratios: 30/30 tasks in 1.3 min, done=30 running=0 failed=0

A step that runs longer than ``interval`` (one certified constant of a million atoms) still shows signs of
life: a background ticker adds a plain line once ``interval`` has passed since the last line and the last
finished step, saying for how long none has finished (``..., 2.5 min elapsed, no task finished for 95 s``), and
keeps a bar's elapsed time moving (log lines then go through :class:`BarAwareHandler`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref

__all__ = ["Progress", "BarAwareHandler", "is_interactive", "format_seconds"]


def is_interactive(stream) -> bool:
    """Whether ``stream`` is a terminal, or the process runs in a notebook (which renders bars)."""
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def format_seconds(s: float) -> str:
    """12 s, 3.4 min, 1.2 h."""
    if s < 100:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 6000:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


class Progress:
    """Count finished steps of a loop of ``total`` steps.

    Parameters
    ----------
    total : int
        Number of steps.
    desc : str
        What is counted, shown in full (``"masked/ratios"``, ``"real_models/gpt2"``).
    unit : str
        Name of one step (``"task"``, ``"step"``).
    initial : int
        Steps already done (a resumed sweep).
    enabled : bool
        ``False`` prints nothing.
    file : text stream (``io.TextIOBase``) or None
        Where to write (default ``sys.stderr``, looked up when the object is created).
    interval : float
        Seconds between two plain lines (not on a terminal).
    """

    def __init__(self, total: int, desc: str, *, unit: str = "step", initial: int = 0, enabled: bool = True,
                 file=None, interval: float = 15.0):
        self.total, self.desc, self.unit, self.n = int(total), str(desc), unit, int(initial)
        self.file = sys.stderr if file is None else file
        self.enabled = bool(enabled)
        self.interval = float(interval)
        self.postfix: dict = {}
        self._t0 = time.monotonic()
        self._last = self._t0
        self._n0 = self.n
        self._step_t0 = self._t0   # when the step now running started (the last update that counted a step)
        self._bar = None
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if not self.enabled:
            return
        if is_interactive(self.file):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, initial=self.n, desc=self.desc, unit=self.unit, file=self.file,
                             leave=True, dynamic_ncols=True)
        else:
            self._line(f"{self.n}/{self.total} {self.unit}s")
        if self.n < self.total:
            threading.Thread(target=_ticker, args=(weakref.ref(self), self._stop, TICK_SECONDS),
                             name=f"progress ticker ({self.desc})", daemon=True).start()

    # ------------------------------------------------------------------ updates
    def update(self, n: int = 1, **postfix) -> None:
        """``n`` more steps done; ``postfix`` replaces the status shown after the count."""
        with self._lock:
            self.n += n
            if postfix:
                self.postfix = dict(postfix)
            now = time.monotonic()
            if n:
                self._step_t0 = now
            if not self.enabled or self._closed:
                return
            if self._bar is not None:
                if postfix:
                    self._bar.set_postfix(self.postfix, refresh=False)
                self._bar.update(n)
                return
            if now - self._last >= self.interval and self.n < self.total:
                self._last = now
                self._line(self._status(now))

    def _tick(self) -> None:
        """The ticker's work (module docstring): a bar redrawn (its elapsed time), or, off a terminal, a plain line
        once ``interval`` has passed since the last line and the running step started."""
        with self._lock:
            if self._closed or not self.enabled:
                return
            if self._bar is not None:
                self._bar.refresh()
                return
            now = time.monotonic()
            if min(now - self._last, now - self._step_t0) >= self.interval and self.n < self.total:
                self._last = now
                self._line(f"{self._status(now)}, no {self.unit} finished for {format_seconds(now - self._step_t0)}")

    def set_postfix(self, **postfix) -> None:
        """Replace the status shown after the count (``running=2, failed=0``, ``layer="3"``)."""
        self.update(0, **postfix)

    def close(self, interrupted: bool = False, note: str = "") -> None:
        """The last line: the count and the time; ``interrupted=True`` says the run stopped before the end (a
        count short of the total read as a finished run); ``note`` ends the plain line (where the results are; a bar
        on a terminal ends as it is)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
        if not self.enabled:
            return
        if self._bar is not None:
            if interrupted:
                self._bar.set_description_str(f"{self.desc} (interrupted)", refresh=False)
            self._bar.close()
            return
        elapsed = time.monotonic() - self._t0
        stop = ", interrupted" if interrupted else ""
        end = f"; {note}" if note else ""
        self._line(f"{self.n}/{self.total} {self.unit}s in {format_seconds(elapsed)}{stop}{self._postfix()}{end}")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plain lines
    def _postfix(self) -> str:
        return (", " + " ".join(f"{k}={v}" for k, v in self.postfix.items())) if self.postfix else ""

    def _status(self, now: float) -> str:
        elapsed = now - self._t0
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        text = f"{self.n}/{self.total} {self.unit}s{pct}{self._postfix()}, {format_seconds(elapsed)} elapsed"
        done_now = self.n - self._n0
        if 0 < done_now and self.n < self.total:
            text += f", about {format_seconds(elapsed / done_now * (self.total - self.n))} left"
        return text

    def _line(self, text: str) -> None:
        try:
            print(f"{self.desc}: {text}", file=self.file, flush=True)
        except (OSError, ValueError):  # a closed or broken stream must not stop the computation
            pass


class BarAwareHandler(logging.StreamHandler):
    """A logging handler that, on a terminal, writes each line through ``tqdm.write``: the bars on the stream are
    cleared first and drawn again after, so that a log line never lands after a bar on the same line (a bar
    redrawn by its ticker, then a solver's progress line: ``study/grid:   0%| | 0/3 [...]streaming Sinkhorn: 200
    of at most 5000 updates``). Off a terminal, a plain StreamHandler."""

    def emit(self, record: logging.LogRecord) -> None:
        if not is_interactive(self.stream):
            super().emit(record)
            return
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except RecursionError:   # logging's own convention
            raise
        except Exception:   # noqa: BLE001 - a broken stream is logging's to report, not the run's to die of
            self.handleError(record)


#: seconds between two looks of the ticker at least (a plain line needs ``interval`` seconds without one)
TICK_SECONDS = 1.0


def _ticker(ref, stop: threading.Event, period: float) -> None:
    """The ticker thread: every ``period`` seconds until ``stop`` is set or the Progress is gone (a loop that never
    closed its Progress: the weak reference ends the thread with the object)."""
    while not stop.wait(period):
        progress = ref()
        if progress is None:
            return
        progress._tick()
        del progress
