"""``python -m studies``: the ``meanfield`` command line."""

from .cli import main

if __name__ == "__main__":   # the 'processes' backend's workers import this module again: they must not run it
    raise SystemExit(main())
