"""Reading and writing the files of a run: JSON, CSV tables, markdown, PNG figures.

Every file is written atomically (a temporary file renamed over the final name), so a full disk,
a read-only folder or a killed process leaves the previous file or none, never a truncated one.
One conversion to JSON data, :func:`studies.sweep.normalize`, serves records, tables and reports.
A write that fails for lack of space or permission raises :class:`OutputError`.
"""

from __future__ import annotations

import csv
import errno
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from particles.files import atomic_write, atomic_write_with

from .sweep.files import normalize
from .sweep.files import write_csv as _write_csv

__all__ = ["to_json", "write_json", "write_text", "write_csv", "read_csv", "save_figure", "write_with",
           "probe_output", "OutputError", "output_error", "is_output_error"]

# errno values that mean "no file can be written here any more", whoever writes it
_FULL_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG}
# and those that, raised while writing a file of the run, mean "this output folder cannot take it"
_OUTPUT_ERRNOS = _FULL_ERRNOS | {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                                 errno.ENAMETOOLONG}


class OutputError(OSError):
    """The run's output cannot be written (disk full, read-only or unwritable folder, ...).

    Its message is the path and the reason, once (no ``[Errno N]`` prefix: the reason already says it)."""

    def __str__(self) -> str:
        return self.strerror if self.strerror else super().__str__()


def output_error(exc: OSError, where) -> OutputError:
    """``exc`` as an :class:`OutputError` naming the file it failed on (``exc.filename``, else ``where``)."""
    if isinstance(exc, OutputError):
        return exc
    return OutputError(exc.errno, f"{exc.filename or where}: {exc.strerror or exc}")


def is_output_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the run cannot write its files: an :class:`OutputError`, a full disk
    or a read-only file system (a study failing on such an error stops the run)."""
    return isinstance(exc, OutputError) or (isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS)


def _guard(path: Path, write):
    try:
        return write()
    except OutputError:
        raise
    except OSError as exc:
        if exc.errno in _OUTPUT_ERRNOS:
            raise OutputError(exc.errno, f"{path}: {exc.strerror or exc}") from exc
        raise


def to_json(obj, where: str = "obj"):
    """``obj`` as strict JSON data (:func:`studies.sweep.normalize`; non-finite floats as strings)."""
    return normalize(obj, where, nonfinite="string")


def write_json(obj, path) -> Path:
    """Write ``obj`` as indented, key-sorted JSON, atomically."""
    path = Path(path)
    text = json.dumps(to_json(obj, path.name), indent=2, sort_keys=True) + "\n"
    return _guard(path, lambda: atomic_write(path, text))


def write_text(text: str, path) -> Path:
    """Write a text file (report.md) atomically."""
    path = Path(path)
    return _guard(path, lambda: atomic_write(path, text))


def write_csv(rows: Iterable[Mapping], path) -> Path:
    """Write a tidy table (one dict per row; the union of keys as columns, first-seen order), atomically."""
    path = Path(path)
    return _guard(path, lambda: _write_csv(rows, path))


def read_csv(path) -> list[dict]:
    """Read a table written by :func:`write_csv`, converting numeric fields back to numbers: the fields that
    :func:`write_csv` writes for a number (Python's repr: a string "007" or "1.50" stays a string)."""
    def conv(v: str):
        for t in (int, float):
            try:
                x = t(v)
            except ValueError:
                continue
            if repr(x) == v:
                return x
        return {"True": True, "False": False, "": None}.get(v, v)

    with Path(path).open(newline="") as fh:
        return [{k: conv(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def save_figure(fig, path, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG, atomically, and close it (figures are never left open).

    The figure first goes through :func:`studies.plotting.finalize` (labelled ticks on short log
    axes, legends off the data)."""
    import io

    import matplotlib.pyplot as plt

    from . import plotting

    path = Path(path)
    try:
        plotting.finalize(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    finally:
        plt.close(fig)
    return _guard(path, lambda: atomic_write(path, buf.getvalue()))


def write_with(path, writer) -> Path:
    """Atomically write a file that a library writes by name: ``writer(tmp_path)`` writes a
    temporary file in the same folder (with the target's suffix), which then replaces ``path``
    (animations, for example)."""
    path = Path(path)
    return _guard(path, lambda: atomic_write_with(path, writer))


def probe_output(folder) -> Path:
    """Create ``folder`` and check that a file can be written in it; :class:`OutputError` otherwise (any
    failure to create the folder or a file in it: a path through a file, a read-only or virtual file
    system such as /proc, permissions, a full disk)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(errno.ENOTDIR, f"{folder} is a file, not a folder")
    probe = folder / f".write-test.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(probe, b"")
        probe.unlink()
    except OSError as exc:
        raise output_error(exc, folder) from exc
    return folder
