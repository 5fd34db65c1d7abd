"""Command line: ``meanfield --help``. Placeholder until the studies land (issue 4)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("smooth-attention")
    except PackageNotFoundError:  # running from a source tree
        return "0.1.0+src"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meanfield", description="How smooth is attention? Studies and report.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("reproduce", help="run every study and write the report")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 0
    print("reproduce: the studies are not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
