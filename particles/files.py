"""Atomic file writing: a reader sees the old file or the new one, never a part of it.

The one writer of the framework's files (measures and estimates, sweep records, study tables and
figures, the extracted model cache): the content goes to a temporary file next to the target,
which is flushed, fsynced and renamed over it (``os.replace`` is atomic on POSIX and Windows); the
folder's entry is then fsynced where the platform allows. Any failure (a full disk, a read-only
file system, an interruption) removes the temporary file and re-raises: the target keeps its
previous content, or stays absent.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_with", "fsync_dir"]


def fsync_dir(folder) -> None:
    """Make a rename in ``folder`` durable (its directory entry); a no-op where the platform refuses."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temporary(path: Path, keep_suffix: bool) -> Path:
    # same folder (the rename stays on one file system), hidden, unique per process and call. The
    # suffix is kept only for libraries that choose the format from the file name (numpy's savez,
    # animations); otherwise the name ends in ".tmp", so that a glob for the final files ("*.rec")
    # never sees a file being written
    tail = f".tmp{path.suffix}" if keep_suffix else f"{path.suffix}.tmp"
    return path.parent / f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}{tail}"


def atomic_write_with(path, writer: Callable[[Path], object], *, make_parents: bool = True,
                      keep_suffix: bool = True) -> Path:
    """Write ``path`` atomically with ``writer(tmp)``, which writes the whole file at the temporary path
    ``tmp`` (hidden, next to ``path``; it ends with ``path``'s suffix when ``keep_suffix``, for writers
    that choose the format from the name, else with ``.tmp``). Returns ``path``."""
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path, keep_suffix)
    try:
        writer(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        with contextlib.suppress(OSError):
            # a file written over keeps its permission bits (a 0600 file came back 0644, the umask's)
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode) & 0o777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    return path


def atomic_write(path, data: bytes | str) -> Path:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically. Returns ``path``."""
    if isinstance(data, str):
        data = data.encode()

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)

    return atomic_write_with(path, write, keep_suffix=False)
