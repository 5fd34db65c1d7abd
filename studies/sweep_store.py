"""On-disk store of a sweep: one checksummed record per task, written atomically.

Layout of a sweep folder::

    out_dir/
      sweep.json            manifest: sweep name, grid (in order), format version
      records/<key>.rec     one record per task, keyed by task_key(name, params)
      corrupt/              records that failed verification, moved aside for inspection
      results.csv           the tidy table (written by run_sweep at the end; load_sweep rebuilds it)
      failures.json         tasks that failed after their retries, with their errors

A record is two lines: a JSON header ``{"format": ..., "sha256": ..., "bytes": ...}`` and the
payload (canonical JSON). It is written to a temporary file in the same folder, flushed, fsynced
and renamed over the final name (``os.replace`` is atomic on POSIX), so a reader sees either the
whole previous state or the whole new record. A record whose length or SHA-256 does not match its
header (a truncated write on a file system without atomic rename, a bit flip, a hand edit) is
reported as corrupt and the task is run again; its content is never read as a result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

__all__ = ["RECORD_FORMAT", "canonical_json", "normalize", "task_key", "atomic_write", "write_record",
           "read_record", "CorruptRecord", "SweepStore"]

RECORD_FORMAT = "smooth-attention-sweep-record/1"
MANIFEST_FORMAT = "smooth-attention-sweep/1"


class CorruptRecord(Exception):
    """A record on disk that does not verify (truncated, bad checksum, wrong key)."""


def normalize(value, where: str):
    """``value`` as plain JSON data: dicts with str keys, lists, str, int, float, bool, None.

    numpy and torch scalars become Python numbers, arrays and tensors become nested lists, tuples
    become lists. Anything else raises a ``TypeError`` naming ``where``. Non-finite floats are kept
    (written as the ``NaN``/``Infinity`` tokens that Python's json reads back).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: keys must be strings, got {k!r} ({type(k).__name__})")
            out[k] = normalize(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [normalize(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "tolist") and callable(value.tolist) and hasattr(value, "shape"):
        if hasattr(value, "detach"):  # torch tensor: leave autograd and the device first
            value = value.detach().cpu()
        return normalize(value.tolist(), where)
    raise TypeError(f"{where}: cannot be stored as JSON ({type(value).__name__}: {value!r:.80})")


def canonical_json(obj) -> str:
    """One text per value: sorted keys, no spaces, ASCII only. Floats round-trip exactly."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def task_key(name: str, params: Mapping) -> str:
    """Stable key of one task: SHA-256 of canonical JSON of ``{"name", "params"}`` (24 hex digits).

    Independent of dict order, of the process and of the machine; ``1`` and ``1.0`` differ (the
    function may treat them differently).
    """
    text = canonical_json({"name": name, "params": params})
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _fsync_dir(folder: Path) -> None:
    # The rename is durable only once the directory entry is; not every platform allows it.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return path


def write_record(path: Path, payload: Mapping) -> Path:
    body = canonical_json(payload).encode()
    header = {"format": RECORD_FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    return atomic_write(path, canonical_json(header).encode() + b"\n" + body + b"\n")


def read_record(path: Path) -> dict:
    """The payload of a record, after checking its format, length and SHA-256; else CorruptRecord."""
    raw = Path(path).read_bytes()
    head, sep, rest = raw.partition(b"\n")
    if not sep:
        raise CorruptRecord(f"{path}: no header line (truncated?)")
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise CorruptRecord(f"{path}: unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != RECORD_FORMAT:
        raise CorruptRecord(f"{path}: not a {RECORD_FORMAT} record")
    body = rest[:-1] if rest.endswith(b"\n") else rest
    if len(body) != header.get("bytes"):
        raise CorruptRecord(f"{path}: payload has {len(body)} bytes, header says {header.get('bytes')} (truncated?)")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise CorruptRecord(f"{path}: SHA-256 of the payload does not match the header")
    payload = json.loads(body)
    if not isinstance(payload, dict) or payload.get("status") not in ("ok", "failed"):
        raise CorruptRecord(f"{path}: payload is not a task record")
    return payload


class SweepStore:
    """The folder of one sweep: manifest, records, and the lock that keeps a second runner out."""

    def __init__(self, out_dir):
        if not isinstance(out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir: expected a path, got {type(out_dir).__name__}")
        self.root = Path(out_dir)
        self.records = self.root / "records"
        self.corrupt = self.root / "corrupt"
        self.manifest_path = self.root / "sweep.json"
        self._lock_fh = None

    # ------------------------------------------------------------------ manifest
    def read_manifest(self) -> dict | None:
        if not self.manifest_path.exists():
            return None
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except ValueError as exc:
            raise ValueError(f"out_dir: {self.manifest_path} is not valid JSON ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"out_dir: {self.manifest_path} is not a sweep manifest ({MANIFEST_FORMAT})")
        return manifest

    def write_manifest(self, name: str, grid: list[dict]) -> None:
        manifest = {"format": MANIFEST_FORMAT, "name": name, "grid": grid}
        atomic_write(self.manifest_path, (json.dumps(manifest, indent=1, allow_nan=True) + "\n").encode())

    # ------------------------------------------------------------------ records
    def path(self, key: str) -> Path:
        return self.records / f"{key}.rec"

    def write(self, key: str, payload: Mapping) -> None:
        write_record(self.path(key), payload)

    def load(self, name: str, grid: list[dict], *, move_corrupt: bool = False) -> tuple[dict, list[str]]:
        """Verified records of the tasks in ``grid``, by key, and the keys whose record was corrupt.

        A record counts only if it verifies and holds exactly the task's name and parameters.
        ``move_corrupt`` moves bad records to ``corrupt/`` (the runner does; readers do not write).
        """
        found: dict[str, dict] = {}
        bad: list[str] = []
        for params in grid:
            key = task_key(name, params)
            path = self.path(key)
            if not path.exists():
                continue
            try:
                rec = read_record(path)
                if rec.get("key") != key or rec.get("name") != name or rec.get("params") != params:
                    raise CorruptRecord(f"{path}: holds another task than its name says")
            except (CorruptRecord, OSError, ValueError):
                bad.append(key)
                if move_corrupt:
                    self.corrupt.mkdir(parents=True, exist_ok=True)
                    os.replace(path, self.corrupt / f"{key}.{uuid.uuid4().hex[:8]}.rec")
                continue
            found[key] = rec
        return found, bad

    def clear(self) -> None:
        """Remove every record (``resume=False``: start the sweep from scratch)."""
        if self.records.exists():
            for p in self.records.iterdir():
                p.unlink()

    def remove_temporaries(self) -> None:
        # Left behind by a writer killed between open and rename; never valid records.
        if self.records.exists():
            for p in self.records.glob(".*.tmp"):
                with contextlib.suppress(OSError):
                    p.unlink()

    # ------------------------------------------------------------------ lock
    def lock(self) -> None:
        """Take an exclusive lock on the folder; ValueError if another live runner holds it.

        ``flock`` is released by the kernel when its holder dies, even by SIGKILL, so a killed
        sweep never leaves a stale lock behind.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, as before
            return
        fh = open(self.root / ".lock", "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise ValueError(f"out_dir: {self.root} is in use by another running sweep") from None
        except OSError:  # file systems without flock (some NFS): run unlocked rather than refuse
            pass
        self._lock_fh = fh

    def unlock(self) -> None:
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None
