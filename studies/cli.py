"""Command line ``meanfield``: the reproduction report and every study as a subcommand.

    meanfield reproduce [--quick] [--out DIR] [--seed S] [--only NAME ...]
    meanfield <study> [--quick] [--out DIR] [--seed S]
    meanfield list
    meanfield --help | --version

Every run writes one folder (default ``runs/<timestamp>``) with config.json, summary.json,
report.md and one subfolder per study. The exit code is 0 when every study ran and every claim
agreed, 1 when a claim disagreed, 2 when a study failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .core import TINY_ENV, import_errors, registry, sweep_settings
from .sweep import add_sweep_arguments, sweep_options


def _version() -> str:
    try:
        return version("smooth-attention")
    except PackageNotFoundError:  # running from a source tree
        return "0.1.0+src"


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small grids (all studies in about 10 minutes on 2 cores)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/<timestamp>)")
    p.add_argument("--seed", type=int, default=0, help="random seed (runs are deterministic for a seed)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # test-size grids
    add_sweep_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meanfield",
        description="How smooth is attention? Reproduce the claims of Castin, Ablin & Peyre (ICML 2024) "
                    "and neighbours: each study computes, plots next to the theory, and says whether "
                    "the numbers agree.",
        epilog="Example: meanfield reproduce --quick --out runs/quick  (then open runs/quick/report.md). "
               "Real models: SMOOTH_ATTENTION_CHECKPOINTS=dir1:dir2 measures local pretrained checkpoints "
               "(otherwise random-init GPT-2 and BERT); SMOOTH_ATTENTION_TEXT=file.txt replaces the default text.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    rp = sub.add_parser("reproduce", help="run every study and write the report",
                        description="Run the registered studies and write config.json, summary.json, report.md.")
    _add_run_options(rp)
    rp.add_argument("--only", nargs="+", metavar="NAME", default=None, help="run only these studies")
    sub.add_parser("list", help="list the registered studies")
    for name, study in registry().items():
        sp = sub.add_parser(name, help=study.title, description=f"{study.title}. {study.description}")
        _add_run_options(sp)
    return p


def _run(args, names: list[str] | None) -> int:
    previous = os.environ.get(TINY_ENV)
    if args.tiny:
        os.environ[TINY_ENV] = "1"
    try:
        return _run_inner(args, names)
    finally:
        if previous is None:
            os.environ.pop(TINY_ENV, None)
        else:
            os.environ[TINY_ENV] = previous


def _run_inner(args, names: list[str] | None) -> int:
    from .report import default_run_dir, reproduce

    opts = sweep_options(args)
    if opts:
        sweep_settings(**opts)
    out = args.out if args.out is not None else default_run_dir()
    summary = reproduce(out, quick=args.quick, seed=args.seed, only=names, progress=args.progress,
                        argv=sys.argv)
    n_claims = summary["n_claims"]
    bad = len(summary["disagreeing_claims"])
    print(f"report: {Path(out) / 'report.md'}")
    print(f"{n_claims - bad} of {n_claims} claims agree; failed studies: {', '.join(summary['failed']) or 'none'}")
    if summary["failed"]:
        return 2
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "list":
        for name, study in registry().items():
            print(f"{name:24s} {study.title}")
        for mod, err in import_errors().items():
            print(f"{mod:24s} FAILED TO IMPORT: {err}")
        return 0
    if args.command == "reproduce":
        unknown = [n for n in args.only or [] if n not in registry()]
        if unknown:
            parser.error(f"--only: unknown study name(s) {', '.join(unknown)}; see `meanfield list`")
        return _run(args, args.only)
    return _run(args, [args.command])


if __name__ == "__main__":
    raise SystemExit(main())
