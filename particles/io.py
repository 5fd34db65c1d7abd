"""Saving and loading measures: a documented ``.npz`` format, never pickle.

A file is a standard NumPy ``.npz`` archive (readable with ``np.load(path, allow_pickle=False)``)
holding plain numeric arrays and one JSON header:

``header``
    a 0-d unicode array holding a JSON object with ``"format": "smooth-attention"``,
    ``"version"`` (the format version, :data:`FORMAT_VERSION`), ``"kind"`` (``"measure"`` here;
    ``"trajectory"`` and ``"lipschitz_estimate"`` for :mod:`meanfield.io`), ``"dtype"`` (the
    torch dtype name of the floating arrays), ``"library_version"`` (the smooth-attention version that
    wrote it) and ``"metadata"`` (whatever JSON object the user passed, e.g. a seed).

A measure (``kind = "measure"``) adds the arrays

``points`` (N, d), ``weights`` (N,), ``log_weights`` (N,) (``-inf`` for atoms of mass zero,
kept exactly, also where ``weights`` underflows to 0) and, for a masked measure, ``positions`` (N,),

all of the measure's dtype (``bfloat16``, which NumPy lacks, is stored as float32 and restored).
Tensors are detached and copied to the CPU; :func:`load_measure` takes a ``device``.

Loading checks everything a crafted or damaged file could get wrong: the header, the version (a
newer version is refused with a message to upgrade), the kind, unknown or missing arrays, shapes
and dtypes, object (pickled) arrays, and the measure itself (weights that sum to one, positions in
[0, 1], finite points), and raises :class:`FileFormatError` (a ``ValueError``) naming the file and
what was wrong.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from ._version import DISTRIBUTION, __version__
from .measure import Measure
from .validation import weight_tolerance

__all__ = ["FORMAT_VERSION", "FileFormatError", "save_measure", "load_measure", "read_header"]

#: version of the file format written by this library (readers accept this version and older ones)
FORMAT_VERSION = 1
FORMAT_NAME = DISTRIBUTION
_HEADER = "header"
_FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


class FileFormatError(ValueError):
    """A file is not a valid smooth-attention archive (or not of the expected kind or version)."""


# ---------------------------------------------------------------------- measures
def save_measure(mu: Measure, path, *, metadata: dict | None = None) -> Path:
    """Write the measure ``mu`` to ``path`` (an ``.npz`` archive; see the module docstring).

    Parameters
    ----------
    mu : Measure
        The measure (any device and floating dtype; gradients are not saved).
    path : str or os.PathLike
        Where to write; written exactly there (no suffix is added), atomically (a file that exists is
        replaced only once the new one is complete).
    metadata : dict, optional
        A JSON-serializable object stored in the header (read it back with :func:`read_header`).

    Returns
    -------
    pathlib.Path
        The path written.
    """
    if not isinstance(mu, Measure):
        raise TypeError(f"mu: expected a particles.Measure, got {type(mu).__name__}")
    return write_archive(path, "measure", measure_arrays(mu), dtype=mu.dtype, metadata=metadata)


def load_measure(path, *, device=None) -> Measure:
    """Read a measure written by :func:`save_measure`, validated as a new :class:`Measure` would be.

    Parameters
    ----------
    path : str or os.PathLike
    device : torch device, optional
        Where to put the tensors (default: CPU).

    Raises
    ------
    FileFormatError
        The file is not a smooth-attention archive, holds another kind of object, was written by a
        newer format version, or its arrays are inconsistent (the message says which).
    """
    header, arrays = read_archive(path, "measure")
    check_keys(arrays, {"points", "weights", "log_weights"}, {"positions"}, path)
    return measure_from_arrays(arrays, header, path, device=device)


def read_header(path) -> dict:
    """The JSON header of a smooth-attention archive (format, version, kind, dtype, metadata, ...)."""
    header, _ = read_archive(path, None)
    return header


# ---------------------------------------------------------------------- shared by meanfield.io
def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A detached CPU copy as a NumPy array (bfloat16 widened to float32, exactly)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    return t.numpy().copy()


def measure_arrays(mu: Measure) -> dict[str, np.ndarray]:
    """The arrays that store ``mu``: points, weights, log_weights and, when masked, positions."""
    out = {"points": to_numpy(mu.points), "weights": to_numpy(mu.weights), "log_weights": to_numpy(mu.log_weights)}
    if mu.positions is not None:
        out["positions"] = to_numpy(mu.positions)
    return out


def write_archive(path, kind: str, arrays: dict[str, np.ndarray], *, dtype: torch.dtype, metadata=None,
                  fields: dict | None = None) -> Path:
    """Write ``arrays`` and the JSON header (kind, dtype, ``fields``, user ``metadata``) to ``path``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path, got {type(path).__name__}")
    path = Path(path)
    if metadata is not None and not isinstance(metadata, dict):
        raise TypeError(f"metadata: expected a dict (a JSON object), got {type(metadata).__name__}")
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "kind": kind, "dtype": _dtype_name(dtype),
              "library_version": __version__, **(fields or {}), "metadata": metadata or {}}
    try:
        text = json.dumps(header)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata: must be JSON-serializable ({exc})") from exc
    if path.is_dir():
        raise IsADirectoryError(f"path: {path} is a folder; give a file name such as {path / 'measure.npz'}")
    # write next to the target, then rename: an interrupted save never leaves half a file behind
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **{_HEADER: np.array(text)}, **arrays)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_archive(path, kind: str | None) -> tuple[dict, dict[str, np.ndarray]]:
    """The header and arrays of a smooth-attention archive of the given ``kind`` (None: any), checked."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path, got {type(path).__name__}")
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"path: no such file: {name}")
    try:
        archive = np.load(name, allow_pickle=False)
    except ValueError as exc:
        raise FileFormatError(f"{name}: not a smooth-attention archive (an .npz file); refusing pickled data "
                              f"({exc})") from exc
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise FileFormatError(f"{name}: not a readable .npz archive ({exc})") from exc
    if not hasattr(archive, "files"):
        raise FileFormatError(f"{name}: a single .npy array, not a smooth-attention .npz archive")
    with archive:
        arrays = {}
        for key in archive.files:
            try:
                arrays[key] = archive[key]
            except ValueError as exc:
                raise FileFormatError(f"{name}: array {key!r} holds Python objects (pickled data), which "
                                      "smooth-attention files never contain; refusing to load it") from exc
            except (OSError, zipfile.BadZipFile, EOFError) as exc:
                raise FileFormatError(f"{name}: array {key!r} is damaged ({exc})") from exc
    header = _parse_header(arrays.pop(_HEADER, None), name)
    if kind is not None and header["kind"] != kind:
        where = {"measure": "particles.load_measure", "trajectory": "meanfield.load_trajectory",
                 "lipschitz_estimate": "meanfield.load_estimate"}.get(header["kind"], "another reader")
        raise FileFormatError(f"{name}: holds a {header['kind']!r}, not a {kind!r}; load it with {where}")
    for key, arr in arrays.items():
        if arr.dtype.kind not in "fiub":
            raise FileFormatError(f"{name}: array {key!r} has dtype {arr.dtype}; expected numbers")
    return header, arrays


def check_keys(arrays: dict, required: set[str], optional: set[str], name) -> None:
    """Refuse missing and unknown arrays (a damaged or hand-made file), naming them."""
    missing = sorted(required - set(arrays))
    unknown = sorted(set(arrays) - required - optional)
    if missing:
        raise FileFormatError(f"{os.fspath(name)}: missing array(s) {', '.join(missing)}")
    if unknown:
        raise FileFormatError(f"{os.fspath(name)}: unknown array(s) {', '.join(unknown)} "
                              f"(not written by smooth-attention {FORMAT_NAME} format version {FORMAT_VERSION})")


def tensor_of(arrays: dict, key: str, header: dict, name, *, ndim: int, device=None) -> torch.Tensor:
    """Array ``key`` as a tensor of the header's dtype, after checking its dtype and number of dimensions."""
    arr = arrays[key]
    dtype = _FLOATS[header["dtype"]]
    stored = torch.float32 if dtype == torch.bfloat16 else dtype
    if arr.dtype.kind != "f" or torch.from_numpy(np.zeros(0, arr.dtype)).dtype != stored:
        raise FileFormatError(f"{os.fspath(name)}: array {key!r} has dtype {arr.dtype}, but the header says "
                              f"{header['dtype']}")
    if arr.ndim != ndim:
        raise FileFormatError(f"{os.fspath(name)}: array {key!r} has shape {arr.shape}; expected {ndim} "
                              "dimension(s)")
    return torch.from_numpy(np.ascontiguousarray(arr)).to(dtype=dtype, device=device)


def measure_from_arrays(arrays: dict, header: dict, name, *, device=None,
                        points: torch.Tensor | None = None) -> Measure:
    """Rebuild a measure from its arrays (keys already checked); ``points`` given: a trajectory's first atoms."""
    name = os.fspath(name)
    if points is None:
        points = tensor_of(arrays, "points", header, name, ndim=2, device=device)
    n = points.shape[0]
    vectors = {}
    for key in ("weights", "log_weights", "positions"):
        if key not in arrays:
            continue
        t = tensor_of(arrays, key, header, name, ndim=1, device=device)
        if t.shape[0] != n:
            raise FileFormatError(f"{name}: array {key!r} has {t.shape[0]} entries for {n} atoms")
        vectors[key] = t
    try:
        # the constructor's checks: finite points, log-weights that sum to one, positions in [0, 1]
        checked = Measure(points, positions=vectors.get("positions"), log_weights=vectors["log_weights"])
    except (ValueError, TypeError) as exc:
        raise FileFormatError(f"{name}: not a valid measure: {exc}") from exc
    w = vectors["weights"]
    tol = weight_tolerance(points.dtype)
    if not bool(torch.allclose(w.double(), checked.weights.double(), rtol=math.sqrt(tol), atol=tol)):
        raise FileFormatError(f"{name}: arrays 'weights' and 'log_weights' disagree "
                              "(weights != exp(log_weights))")
    # the stored tensors themselves, so that a round trip is exact
    return Measure._trusted(points, w, vectors["log_weights"], vectors.get("positions"))


# ---------------------------------------------------------------------- internals
def _dtype_name(dtype: torch.dtype) -> str:
    for key, value in _FLOATS.items():
        if value == dtype:
            return key
    raise TypeError(f"dtype: cannot store {dtype} (expected one of {', '.join(_FLOATS)})")


def _parse_header(raw, name: str) -> dict:
    if raw is None:
        raise FileFormatError(f"{name}: no {_HEADER!r} entry; not a smooth-attention archive")
    if raw.dtype.kind != "U" or raw.ndim != 0:
        raise FileFormatError(f"{name}: the {_HEADER!r} entry is not a JSON text")
    try:
        header = json.loads(str(raw))
    except ValueError as exc:
        raise FileFormatError(f"{name}: the header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise FileFormatError(f"{name}: not a {FORMAT_NAME} archive (header format "
                              f"{header.get('format') if isinstance(header, dict) else header!r})")
    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise FileFormatError(f"{name}: invalid format version {version!r}")
    if version > FORMAT_VERSION:
        raise FileFormatError(f"{name}: written in format version {version} by smooth-attention "
                              f"{header.get('library_version', '?')}; this smooth-attention ({__version__}) reads "
                              f"format version {FORMAT_VERSION} and older: upgrade smooth-attention to read it")
    if not isinstance(header.get("kind"), str):
        raise FileFormatError(f"{name}: the header names no kind of object")
    if header.get("dtype") not in _FLOATS:
        raise FileFormatError(f"{name}: unknown dtype {header.get('dtype')!r} in the header "
                              f"(expected one of {', '.join(_FLOATS)})")
    if not isinstance(header.get("metadata", {}), dict):
        raise FileFormatError(f"{name}: the header's metadata is not a JSON object")
    return header


