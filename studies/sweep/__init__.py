"""Sweeps: run a grid of independent tasks in-process, on a process pool or on a Dask cluster.

Resumable after any kill (each finished task is a checksummed record written atomically),
failures reported with their errors, one runner per folder. This subpackage stands alone: it
imports nothing from the rest of :mod:`studies`. See docs/sweeps.md.

:func:`run_sweep`, :func:`load_sweep`, :func:`expand_grid`   the runner (``runner.py``)
:class:`SweepStore`, :func:`task_key`                        records on disk (``store.py``)
:func:`add_sweep_arguments`, :func:`sweep_options`           command-line options (``options.py``)
:func:`scheduler_from_environment`                           the address taken from ``$DASK_SCHEDULER_ADDRESS``
:class:`Progress`                                           bars on a terminal, plain lines elsewhere
:func:`normalize`, :func:`atomic_write`, :func:`write_csv`, :class:`FolderLock`   files (``files.py``)
"""

from .files import FolderBusy, FolderLock, atomic_write, canonical_json, normalize, write_csv
from .options import SCHEDULER_ENV, add_sweep_arguments, scheduler_from_environment, sweep_options
from .progress import Progress
from .runner import BACKENDS, SweepResult, TaskFailure, expand_grid, load_sweep, run_sweep
from .store import CorruptRecord, SweepStore, read_record, task_key

__all__ = ["run_sweep", "load_sweep", "expand_grid", "SweepResult", "TaskFailure", "BACKENDS",
           "SweepStore", "CorruptRecord", "read_record", "task_key", "add_sweep_arguments", "sweep_options",
           "scheduler_from_environment", "SCHEDULER_ENV", "Progress", "normalize", "canonical_json", "atomic_write",
           "write_csv", "FolderLock", "FolderBusy"]
