"""Files that stay consistent whatever happens to the process writing them.

* :func:`normalize`: the one conversion of results to plain JSON data (records, tables, reports);
* :func:`atomic_write`, :func:`write_csv`: a reader sees the old file or the new one, never a part,
  also when the disk fills up or the writer is killed;
* :class:`FolderLock`: one writer per folder, released by the kernel when its holder dies.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from particles.files import atomic_write  # the framework's one atomic writer

__all__ = ["normalize", "canonical_json", "atomic_write", "write_csv", "FolderLock", "FolderBusy"]


def normalize(value, where: str, *, nonfinite: str = "keep"):
    """``value`` as plain JSON data: dicts with str keys, lists, str, int, float, bool, None.

    numpy and torch scalars become Python numbers, arrays and tensors nested lists, tuples lists,
    paths strings. Anything else raises a ``TypeError`` naming ``where`` (the argument, or the
    place inside it). Non-finite floats are kept (``nonfinite="keep"``: Python's json writes and
    reads them back as the ``NaN``/``Infinity`` tokens) or written as the strings ``"nan"``,
    ``"inf"``, ``"-inf"`` (``nonfinite="string"``: strict JSON, for files other programs read).
    """
    if nonfinite not in ("keep", "string"):
        raise ValueError(f"nonfinite: expected 'keep' or 'string', got {nonfinite!r}")
    return _normalize(value, where, nonfinite == "string")


def _normalize(value, where: str, as_string: bool):
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return str(value) if as_string and not math.isfinite(value) else value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: keys must be strings, got {k!r} ({type(k).__name__})")
            out[k] = _normalize(v, f"{where}[{k!r}]", as_string)
        return out
    if isinstance(value, (list, tuple)):
        return [_normalize(v, f"{where}[{i}]", as_string) for i, v in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist") and callable(value.tolist) and hasattr(value, "shape"):
        if hasattr(value, "detach"):  # torch tensor: leave autograd and the device first
            value = value.detach().cpu()
        return _normalize(value.tolist(), where, as_string)
    raise TypeError(f"{where}: cannot be stored as JSON ({type(value).__name__}: {value!r:.80})")


def canonical_json(obj) -> str:
    """One text per value: sorted keys, no spaces, ASCII only. Floats round-trip exactly."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def write_csv(rows: Iterable[Mapping], path) -> Path:
    """Write a tidy table atomically: one dict per row, the union of keys as columns (first-seen order).

    Values go through :func:`normalize` (non-finite floats are written ``nan``/``inf``).
    """
    rows = [normalize(dict(r), f"rows[{i}]") for i, r in enumerate(rows)]
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
    return atomic_write(path, buf.getvalue())


class FolderBusy(ValueError):
    """A folder is locked by another live process. ``argument`` names the folder's argument in the message,
    ``detail`` is the message without it (a command line names its own option: ``--out``)."""

    def __init__(self, argument: str, detail: str):
        super().__init__(f"{argument}: {detail}")
        self.argument, self.detail = argument, detail

    def __reduce__(self):   # pickled with both fields (a process pool re-raises it in the parent)
        return type(self), (self.argument, self.detail)


def _file_in_the_way(folder: Path) -> Path | None:
    """The path or nearest existing ancestor of ``folder`` that is not a folder (so that ``folder`` cannot be
    created), or None."""
    for p in (folder, *folder.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


class FolderLock:
    """An exclusive ``flock`` on ``folder/.lock`` that keeps a second writer out of ``folder``.

    The kernel releases the lock when its holder dies, even by SIGKILL, so a killed run never
    leaves a stale lock behind. The holder writes its pid into the lock file, so that a refused
    process can say who holds the folder. On file systems without ``flock`` (some NFS mounts) and
    on non-POSIX systems the lock is skipped.
    """

    def __init__(self, folder, what: str = "folder", argument: str = "out_dir"):
        self.folder = Path(folder)
        self.path = self.folder / ".lock"
        self.what, self.argument = what, argument
        self._fh = None

    @property
    def held(self) -> bool:
        return self._fh is not None

    def acquire(self) -> FolderLock:
        """Take the lock, creating the folder; :class:`FolderBusy` (a ValueError) when another live process holds
        it, a ValueError naming the argument when the folder is, or lies below, an existing file."""
        if self._fh is not None:
            return self
        blocker = _file_in_the_way(self.folder)
        if blocker == self.folder:
            raise ValueError(f"{self.argument}: {self.folder} is an existing file, not a folder; give a folder path")
        if blocker is not None:
            raise ValueError(f"{self.argument}: {self.folder} cannot be created: {blocker} is a file, not a folder; "
                             "give a folder path")
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return self
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip()
            fh.close()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise FolderBusy(self.argument, f"{self.folder} is in use by another running {self.what}{who}; "
                             "wait for it to finish or choose another folder") from None
        except OSError:  # file systems without flock: run unlocked rather than refuse
            pass
        with contextlib.suppress(OSError):
            fh.seek(0)
            fh.truncate()
            fh.write(str(os.getpid()))
            fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        """Unlock, first emptying the lock file (still held), so that a finished folder names no pid: the file
        itself stays, since removing it could let two later writers lock two different files."""
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.seek(0)
                self._fh.truncate()
                self._fh.flush()
            self._fh.close()
            self._fh = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
