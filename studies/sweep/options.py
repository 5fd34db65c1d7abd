"""The runner's options on a command line: ``--backend``, ``--workers``, ``--scheduler``, ...

    parser = add_sweep_arguments(argparse.ArgumentParser())
    res = run_sweep(fn, grid, out, **sweep_options(parser.parse_args()))
"""

from __future__ import annotations

import argparse
import logging
import os

from .runner import BACKENDS

__all__ = ["add_sweep_arguments", "sweep_options", "scheduler_from_environment", "SCHEDULER_ENV", "LOCAL_BACKENDS"]

log = logging.getLogger(__name__)

SCHEDULER_ENV = "DASK_SCHEDULER_ADDRESS"   # Dask's own convention


def _address(text: str) -> str:
    """The --scheduler value: an address; an empty one is refused (it is not the way to ignore the variable)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a scheduler address such as tcp://host:8786, got {text!r} (to "
                                         f"ignore ${SCHEDULER_ENV}, pass --backend processes or inprocess)")
    return text


def add_sweep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --backend, --workers, --scheduler, --resume/--no-resume, --retries, --progress/--no-progress.

    ``--scheduler`` defaults to the ``DASK_SCHEDULER_ADDRESS`` environment variable, so a job
    script can point every study at a cluster without changing the command, unless ``--backend``
    names a local backend (``inprocess`` or ``processes``), which wins over the variable;
    :func:`sweep_options` says in the log what it did with the variable.
    """
    g = parser.add_argument_group("sweep execution")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help=f"where tasks run (auto: in-process, or dask when a scheduler is given; inprocess or "
                        f"processes also ignore ${SCHEDULER_ENV})")
    g.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes for --backend processes or a local dask cluster (default 2); with "
                        "the tasks in this process (auto without a scheduler, inprocess) a note says it is unused")
    g.add_argument("--scheduler", type=_address, default=None, metavar="ADDRESS",
                   help=f"dask scheduler address, e.g. tcp://10.0.0.1:8786 (default ${SCHEDULER_ENV}, unless "
                        "--backend is inprocess or processes)")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip tasks already stored, and studies that finished in --out with the same code and "
                        "settings (default); --no-resume recomputes everything")
    g.add_argument("--retries", type=int, default=2, metavar="K", help="extra attempts for a failing task (2)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show progress (a bar on a terminal, plain lines otherwise)")
    return parser


#: the backends that run on this machine: chosen explicitly, they win over $DASK_SCHEDULER_ADDRESS
LOCAL_BACKENDS = ("inprocess", "processes")


def scheduler_from_environment(args: argparse.Namespace, environ=None) -> str | None:
    """The scheduler address that :func:`sweep_options` takes from ``$DASK_SCHEDULER_ADDRESS`` for ``args``, or
    None: the variable is read only when ``--scheduler`` is not given and ``--backend`` is ``auto`` or ``dask``
    (an explicit local backend wins over it)."""
    environ = os.environ if environ is None else environ
    address = environ.get(SCHEDULER_ENV)
    if args.scheduler is not None or not address or args.backend in LOCAL_BACKENDS:
        return None
    return address


def sweep_options(args: argparse.Namespace, environ=None) -> dict:
    """The keyword arguments of :func:`~studies.sweep.run_sweep` from arguments parsed with :func:`add_sweep_arguments`.

    Without ``--scheduler``, the address in ``$DASK_SCHEDULER_ADDRESS`` (``environ``, default
    ``os.environ``) is used with ``--backend auto`` or ``dask``, and logged: a job never sends its
    tasks to a scheduler unnoticed. ``--backend inprocess`` or ``processes`` wins over the variable:
    the tasks run on this machine, and the log says that the variable is ignored.
    """
    environ = os.environ if environ is None else environ
    scheduler = args.scheduler
    if scheduler is None:
        scheduler = scheduler_from_environment(args, environ)
        if scheduler is not None:
            log.info("using the Dask scheduler %s from $%s", scheduler, SCHEDULER_ENV)
        elif environ.get(SCHEDULER_ENV):
            log.info("--backend %s: running on this machine; $%s=%s is ignored", args.backend, SCHEDULER_ENV,
                     environ[SCHEDULER_ENV])
    if args.workers is not None and (args.backend == "inprocess" or (args.backend == "auto" and scheduler is None)):
        log.warning("note: --workers %d is not used: --backend %s runs the tasks in this process (give --backend "
                    "processes, or dask, for worker processes)", args.workers, args.backend)
    return {"backend": args.backend, "n_workers": 2 if args.workers is None else args.workers, "scheduler": scheduler,
            "resume": args.resume, "retries": args.retries, "progress": args.progress}
