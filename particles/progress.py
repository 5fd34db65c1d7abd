"""Signs of life of long computations: at most one INFO line per :data:`PROGRESS_SECONDS`.

The solvers that can run for minutes (the streaming and dense Sinkhorn of :mod:`transport`, the Lanczos and
power iterations of :mod:`meanfield.krylov`) log where they are on their own loggers; a call shorter than
the period says nothing. Each keeps one :class:`Heartbeat` and formats its own line when it is due.
"""

from __future__ import annotations

import time

__all__ = ["PROGRESS_SECONDS", "Heartbeat"]

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
