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
header (a truncated write on a file system without atomic rename, a bit flip, a hand edit), or
whose payload is not a task record (including JSON nested too deeply to parse), is reported as
corrupt and the task is run again; its content is never read as a result.

The manifest only repeats what the records hold (each record carries its sweep name and
parameters), so a manifest that does not parse is rebuilt from the verified records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from .files import FolderLock, atomic_write, canonical_json

__all__ = ["RECORD_FORMAT", "MANIFEST_FORMAT", "task_key", "write_record", "read_record", "CorruptRecord",
           "SweepStore"]

log = logging.getLogger(__name__)

RECORD_FORMAT = "smooth-attention-sweep-record/1"
MANIFEST_FORMAT = "smooth-attention-sweep/1"


class CorruptRecord(Exception):
    """A record on disk that does not verify (truncated, bad checksum, wrong key, unparsable)."""


def task_key(name: str, params: Mapping) -> str:
    """Stable key of one task: SHA-256 of canonical JSON of ``{"name", "params"}`` (24 hex digits).

    Independent of dict order, of the process and of the machine; ``1`` and ``1.0`` differ (the
    function may treat them differently).
    """
    text = canonical_json({"name": name, "params": params})
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def write_record(path: Path, payload: Mapping) -> Path:
    """The payload as canonical JSON (sorted keys: a resumed sweep's table is the uninterrupted run's, whichever
    release wrote its records; a result's columns therefore come back sorted by name), after a canonical header."""
    body = canonical_json(payload).encode()
    header = {"format": RECORD_FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    return atomic_write(path, canonical_json(header).encode() + b"\n" + body + b"\n")


MAX_DEPTH = 64   # results are flat tables: anything nested deeper is not a record this runner wrote


def _depth(obj) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    depth, level = 0, [obj]
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            break
        nxt = []
        for o in level:
            if isinstance(o, dict):
                nxt.extend(o.values())
            elif isinstance(o, list):
                nxt.extend(o)
        level = nxt
    return depth


def _loads(data):
    """json.loads, with JSON nested too deeply to handle reported as a ValueError."""
    try:
        obj = json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
    if _depth(obj) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return obj


def read_record(path: Path) -> dict:
    """The payload of a record, after checking its format, length and SHA-256; else CorruptRecord."""
    raw = Path(path).read_bytes()
    head, sep, rest = raw.partition(b"\n")
    if not sep:
        raise CorruptRecord(f"{path}: no header line (truncated?)")
    try:
        header = _loads(head)
    except ValueError as exc:
        raise CorruptRecord(f"{path}: unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != RECORD_FORMAT:
        raise CorruptRecord(f"{path}: not a {RECORD_FORMAT} record")
    body = rest[:-1] if rest.endswith(b"\n") else rest
    if len(body) != header.get("bytes"):
        raise CorruptRecord(f"{path}: payload has {len(body)} bytes, header says {header.get('bytes')} (truncated?)")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise CorruptRecord(f"{path}: SHA-256 of the payload does not match the header")
    try:
        payload = _loads(body)
    except ValueError as exc:
        raise CorruptRecord(f"{path}: payload is not usable JSON ({exc})") from None
    if not isinstance(payload, dict) or payload.get("status") not in ("ok", "failed") \
            or not isinstance(payload.get("params"), dict) or not isinstance(payload.get("name"), str):
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
        self._lock = FolderLock(self.root, what="sweep")

    # ------------------------------------------------------------------ manifest
    def read_manifest(self, *, rebuild: bool = True) -> dict | None:
        """The manifest, or None for a folder without one (and without records).

        A manifest that does not parse (a hand edit, a bit flip) is rebuilt from the verified
        records when ``rebuild`` (the default; see :meth:`rebuild_manifest`), else a ValueError.
        """
        problem = None
        if self.manifest_path.exists():
            try:
                manifest = _loads(self.manifest_path.read_bytes())
            except (ValueError, OSError) as exc:
                problem = f"is not valid JSON ({exc})"
            else:
                if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT \
                        and isinstance(manifest.get("name"), str) and isinstance(manifest.get("grid"), list):
                    return manifest
                problem = f"is not a sweep manifest ({MANIFEST_FORMAT})"
        elif not self.records.exists():
            return None
        else:
            problem = "is missing"
        if not rebuild:
            raise ValueError(f"out_dir: {self.manifest_path} {problem}")
        manifest = self.rebuild_manifest()
        if manifest is None:
            log.warning("%s %s and no valid record remains: treated as an empty sweep", self.manifest_path, problem)
        else:
            log.warning("%s %s: rebuilt from %d verified record(s) of sweep %r", self.manifest_path, problem,
                        len(manifest["grid"]), manifest["name"])
        return manifest

    def rebuild_manifest(self) -> dict | None:
        """A manifest rebuilt from the verified records (None when there is none).

        Records carry their sweep name and parameters, not the position of their task in the grid:
        the rebuilt grid lists the tasks in the order they finished. :func:`~studies.sweep.run_sweep` replaces it by the
        grid it is given. Records of another name than the most common one are left out.
        """
        recs, corrupt = [], 0
        if self.records.exists():
            for path in sorted(self.records.glob("*.rec")):
                try:
                    rec = read_record(path)
                except (CorruptRecord, OSError):
                    corrupt += 1
                    continue
                if rec.get("key") == path.stem == task_key(rec["name"], rec["params"]):
                    recs.append(rec)
                else:
                    corrupt += 1
        if not recs:
            return None
        name = Counter(r["name"] for r in recs).most_common(1)[0][0]
        recs = sorted((r for r in recs if r["name"] == name), key=lambda r: (str(r.get("finished_at", "")), r["key"]))
        return {"format": MANIFEST_FORMAT, "name": name, "grid": [r["params"] for r in recs], "rebuilt": True,
                "corrupt": corrupt}

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
                # parameters compared as canonical JSON, as the key was made: NaN == NaN there (a grid value of
                # NaN never counted as done, and ran again at every resume)
                if (rec.get("key") != key or rec.get("name") != name
                        or canonical_json(rec.get("params")) != canonical_json(params)):
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

    def reset(self) -> None:
        """Empty the folder of another sweep: records, corrupt records, manifest and tables (not the lock)."""
        import shutil

        for sub in (self.records, self.corrupt):
            if sub.exists():
                shutil.rmtree(sub)
        for name in ("sweep.json", "results.csv", "results.parquet", "failures.json"):
            with contextlib.suppress(FileNotFoundError):
                (self.root / name).unlink()

    def remove_temporaries(self) -> None:
        # Left behind by a writer killed between open and rename; never valid records.
        for folder in (self.records, self.root):
            if folder.exists():
                for p in folder.glob(".*.tmp"):
                    with contextlib.suppress(OSError):
                        p.unlink()

    # ------------------------------------------------------------------ lock
    def lock(self) -> None:
        """Take an exclusive lock on the folder; a ValueError if another live runner holds it."""
        self._lock.acquire()

    def unlock(self) -> None:
        self._lock.release()
