"""The runner's options on a command line: ``--backend``, ``--workers``, ``--scheduler``, ...

    parser = add_sweep_arguments(argparse.ArgumentParser())
    res = run_sweep(fn, grid, out, **sweep_options(parser.parse_args()))
"""

from __future__ import annotations

import argparse
import logging
import os

from .runner import BACKENDS

__all__ = ["add_sweep_arguments", "sweep_options", "SCHEDULER_ENV"]

log = logging.getLogger(__name__)

SCHEDULER_ENV = "DASK_SCHEDULER_ADDRESS"   # Dask's own convention


def add_sweep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --backend, --workers, --scheduler, --resume/--no-resume, --retries, --progress/--no-progress.

    ``--scheduler`` defaults to the ``DASK_SCHEDULER_ADDRESS`` environment variable, so a job
    script can point every study at a cluster without changing the command; :func:`sweep_options`
    says so in the log when it adopts it.
    """
    g = parser.add_argument_group("sweep execution")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="where tasks run (auto: in-process, or dask when a scheduler is given)")
    g.add_argument("--workers", type=int, default=2, metavar="N",
                   help="worker processes for --backend processes or a local dask cluster (default 2)")
    g.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help=f"dask scheduler address, e.g. tcp://10.0.0.1:8786 (default ${SCHEDULER_ENV})")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip tasks already stored, and studies that finished in --out with the same code and "
                        "settings (default); --no-resume recomputes everything")
    g.add_argument("--retries", type=int, default=2, metavar="K", help="extra attempts for a failing task (2)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show progress (a bar on a terminal, plain lines otherwise)")
    return parser


def sweep_options(args: argparse.Namespace, environ=None) -> dict:
    """The keyword arguments of :func:`~studies.sweep.run_sweep` from arguments parsed with :func:`add_sweep_arguments`.

    Without ``--scheduler``, the address in ``$DASK_SCHEDULER_ADDRESS`` (``environ``, default
    ``os.environ``) is used, and logged: a job never sends its tasks to a scheduler unnoticed.
    """
    environ = os.environ if environ is None else environ
    scheduler = args.scheduler
    if scheduler is None and environ.get(SCHEDULER_ENV):
        scheduler = environ[SCHEDULER_ENV]
        log.info("using the Dask scheduler %s from $%s", scheduler, SCHEDULER_ENV)
    return {"backend": args.backend, "n_workers": args.workers, "scheduler": scheduler,
            "resume": args.resume, "retries": args.retries, "progress": args.progress}
