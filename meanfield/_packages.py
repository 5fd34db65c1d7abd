"""Is the ``particles`` (or ``transport``) that Python finds smooth-attention's own?

The top-level names ``particles``, ``transport`` and ``meanfield`` are also names of unrelated
packages on PyPI (``particles`` is a sequential Monte Carlo library). Installed in the same
environment, or put earlier on ``sys.path``, one of them shadows this project's package, and the
failure would surface as an AttributeError or ImportError deep inside. :func:`require_own` turns it
into one ImportError that says what happened and how to fix it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

#: attribute set by smooth-attention's own packages (value: the distribution name)
MARKER = "__smooth_attention__"
DISTRIBUTION = "smooth-attention"
_HOME = Path(__file__).resolve().parent.parent  # the folder that holds meanfield and its siblings

FIX = ("Install smooth-attention in its own virtual environment (python3 -m venv .venv && "
       ". .venv/bin/activate && pip install -e /path/to/smooth-attention), or uninstall the other package "
       "(pip uninstall {name}) or remove its folder from sys.path / PYTHONPATH.")


def foreign_package_error(name: str, where, cause: str | None = None) -> ImportError:
    """The ImportError for a module ``name`` found at ``where`` that is not smooth-attention's."""
    what = cause or f"it lacks the marker attribute {MARKER!r} that smooth-attention's packages carry"
    return ImportError(f"{name}: the module Python imports as {name!r} ({where}) is not smooth-attention's own "
                       f"{name} package ({what}): an unrelated package of the same name shadows it. "
                       + FIX.format(name=name), name=name)


def require_own(name: str) -> None:
    """Raise :func:`foreign_package_error` unless ``import name`` gives smooth-attention's package.

    Cheap in the usual case: a package found next to meanfield is this installation's and is not
    imported here (``transport`` imports POT, which takes a second); a module found elsewhere is
    imported and must carry :data:`MARKER`.
    """
    module = sys.modules.get(name)
    if module is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise ImportError(f"{name}: smooth-attention's {name} package is not installed next to meanfield "
                              f"({_HOME}); reinstall smooth-attention (pip install -e /path/to/smooth-attention)",
                              name=name)
        origin = Path(spec.origin).resolve() if spec.origin else None
        if origin is not None and origin.parent == _HOME / name:
            return
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            raise foreign_package_error(name, spec.origin or "a namespace package",
                                        f"importing it failed with {type(exc).__name__}: {exc}") from exc
    if getattr(module, MARKER, None) != DISTRIBUTION:
        raise foreign_package_error(name, getattr(module, "__file__", None) or "a namespace package")
