"""``python -m studies``: the ``meanfield`` command line."""

from .cli import main

raise SystemExit(main())
