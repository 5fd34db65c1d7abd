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

from .sweep.files import atomic_write, normalize
from .sweep.files import write_csv as _write_csv

__all__ = ["to_json", "write_json", "write_text", "write_csv", "read_csv", "save_figure", "write_with",
           "probe_output", "OutputError", "is_output_error"]

# errno values that mean "no file can be written here any more", whoever writes it
_FULL_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG}
# and those that, raised while writing a file of the run, mean "this output folder cannot take it"
_OUTPUT_ERRNOS = _FULL_ERRNOS | {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                                 errno.ENAMETOOLONG}


class OutputError(OSError):
    """The run's output cannot be written (disk full, read-only or unwritable folder, ...)."""


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
            raise OutputError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from exc
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
    """Read a table written by :func:`write_csv`, converting numeric fields back to numbers."""
    def conv(v: str):
        for t in (int, float):
            try:
                return t(v)
            except ValueError:
                pass
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
    temporary file in the same folder, which then replaces ``path`` (animations, for example)."""
    import contextlib
    import uuid

    path = Path(path)

    def write():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}"
        try:
            writer(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return path

    return _guard(path, write)


def probe_output(folder) -> Path:
    """Create ``folder`` and check that a file can be written in it; :class:`OutputError` otherwise."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(errno.ENOTDIR, f"{folder} is a file, not a folder")
    probe = folder / f".write-test.{os.getpid()}"

    def check():
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(probe, b"")
        probe.unlink()
        return folder

    return _guard(folder, check)
