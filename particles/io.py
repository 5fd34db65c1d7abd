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

all of the measure's dtype (``bfloat16``, which NumPy lacks, is stored as float32 and restored), except
positions of float16 / bfloat16 measures, kept in float32 (:func:`particles.measure.position_dtype`).
Tensors are detached and copied to the CPU; :func:`load_measure` takes a ``device``.

Loading checks everything a crafted or damaged file could get wrong: the header, the version (a
newer version is refused with a message to upgrade), the kind, unknown or missing arrays, shapes
and dtypes, object (pickled) arrays, and the measure itself (weights that sum to one, positions in
[0, 1], finite points), and raises :class:`FileFormatError` (a ``ValueError``) naming the file and
what was wrong. Names, dtypes, shapes and sizes are read from the arrays' ``.npy`` headers before
any data: an array whose member holds fewer (or more) bytes than its header declares is named as
truncated, and the arrays' total size is checked against the memory limit
(:func:`particles.validation.check_allocation`, a :class:`~particles.validation.MemoryLimitError`)
before anything is decompressed, so a small compressed file cannot request gigabytes.
"""

from __future__ import annotations

import errno
import json
import math
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from ._version import DISTRIBUTION, __version__
from .files import atomic_write_with
from .measure import Measure, position_dtype
from .validation import check_allocation, check_device, weight_tolerance

__all__ = ["FORMAT_VERSION", "FileFormatError", "save_measure", "load_measure", "read_header", "LazyArray"]

#: version of the file format written by this library (readers accept this version and older ones)
FORMAT_VERSION = 1
FORMAT_NAME = DISTRIBUTION
_HEADER = "header"
#: the JSON header is a few hundred bytes plus the user's metadata; beyond this it is not one
_HEADER_MAX_BYTES = 4 << 20
#: arrays in a file of this format: at most 6 (a trajectory), with margin
_MAX_MEMBERS = 64
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
    metadata : dict or None
        A JSON-serializable object stored in the header (read it back with :func:`read_header`); numpy
        bool, integer and real scalars are stored as the Python bool, int and float of the same value.

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
    device : torch.device, str or None
        Where to put the tensors (default: CPU).

    Raises
    ------
    FileFormatError
        The file is not a smooth-attention archive, holds another kind of object, was written by a
        newer format version, or its arrays are inconsistent (the message says which).
    """
    device = check_device(device)
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
    _check_keys(metadata, "metadata")
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "kind": kind, "dtype": _dtype_name(dtype),
              "library_version": __version__, **(fields or {}), "metadata": metadata or {}}
    try:
        text = json.dumps(header, default=_numpy_scalar)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata: must be JSON-serializable: dicts with str keys, lists, str, int, float, bool, "
                        f"None, or numpy scalars of those ({exc}); convert other values first, e.g. a tensor "
                        "with .tolist()") from exc
    size = np.array(text).nbytes
    if size > _HEADER_MAX_BYTES:
        # the readers refuse a header above this size (a file would be written that nothing reads back)
        own = np.array(json.dumps(metadata or {}, default=_numpy_scalar)).nbytes
        if 2 * own > size:
            raise ValueError(f"metadata: {own} bytes once stored (4 per character), the header {size}, above the "
                             f"{_HEADER_MAX_BYTES} a header may hold; store large data as arrays of a file of its own")
        raise ValueError(f"the {kind}'s own fields need a header of {size} bytes once stored (4 per character), "
                         f"above the {_HEADER_MAX_BYTES} a header may hold (a batch of many members?): save it in "
                         "parts")
    if path.is_dir():
        raise IsADirectoryError(f"path: {path} is a folder; give a file name such as {path / 'measure.npz'}")
    if not path.parent.is_dir():
        where = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise FileNotFoundError(errno.ENOENT, f"path: the folder {path.parent} {where}; create it first "
                                f"(to write {path.name} into it)", str(path.parent))
    def write(tmp):
        with open(tmp, "wb") as fh:   # a handle: np.savez would append ".npz" to a temporary name
            np.savez(fh, **{_HEADER: np.array(text)}, **arrays)

    # an interrupted save never leaves half a file behind
    return atomic_write_with(path, write, make_parents=False)


def _check_keys(obj, where: str, _open: frozenset = frozenset()) -> None:
    """TypeError naming the place of a dict key that is not a str: JSON would turn it into one (1 -> "1", None ->
    "null", True colliding with 1), and the metadata read back would differ from what was saved; also of a
    container that holds itself (JSON cannot write it)."""
    if isinstance(obj, (dict, list, tuple)):
        if id(obj) in _open:
            raise TypeError(f"{where}: a container that holds itself (a cycle); JSON cannot store it")
        _open = _open | {id(obj)}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} (of type {type(k).__name__}) is not a str; metadata keys must "
                                f"be str (JSON would store it as {json.dumps(str(k) if k is not None else None)}, and "
                                "read it back so), e.g. " + repr(str(k)))
            _check_keys(v, f"{where}[{k!r}]", _open)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_keys(v, f"{where}[{i}]", _open)


def _numpy_scalar(value):
    """A numpy bool, integer or real scalar as the Python bool, int or float of the same value (``.item()``), which
    the header stores and reads back exactly; anything else (a complex or datetime scalar, an array, a
    tensor) stays refused."""
    if isinstance(value, (np.bool_, np.integer, np.floating)):
        out = value.item()
        if type(out) in (bool, int, float):   # np.longdouble.item() may stay a numpy scalar: refused
            return out
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class LazyArray:
    """An array of an archive known by its ``.npy`` header (dtype, shape) until :meth:`load` reads it.

    The archive readers make them; the parameters are the fields of the same names.

    Parameters
    ----------
    archive : the ``.npz`` file's index of members (private)
    """

    __slots__ = ("archive", "member", "dtype", "shape", "fortran_order", "offset")

    def __init__(self, archive: _Archive, member: str, dtype: np.dtype, shape: tuple, fortran_order: bool,
                 offset: int):
        self.archive, self.member, self.dtype, self.shape = archive, member, dtype, shape
        self.fortran_order, self.offset = fortran_order, offset

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"LazyArray({self.member!r}, dtype={self.dtype}, shape={self.shape})"

    def load(self) -> np.ndarray:
        """The array's data (read once the archive's total size passed the memory limit)."""
        self.archive.check_memory()
        return self.archive.read(self)


class _Archive:
    """The members of an ``.npz`` file, read from their ``.npy`` headers; data only on request."""

    def __init__(self, name: str):
        self.name, self.arrays, self._checked = name, {}, False

    def check_memory(self) -> None:
        if not self._checked:
            total = sum(a.nbytes for a in self.arrays.values())
            check_allocation(total, f"{self.name}: its arrays ({', '.join(map(repr, self.arrays))})",
                             "a file this large is damaged or crafted, or needs a larger limit")
            self._checked = True

    def read(self, arr: LazyArray) -> np.ndarray:
        out = np.empty(arr.size, dtype=arr.dtype)
        view = out.view(np.uint8).reshape(-1)
        pos = 0
        try:
            with zipfile.ZipFile(self.name) as zf, zf.open(arr.member) as fh:
                fh.seek(arr.offset)
                while pos < arr.nbytes:
                    chunk = fh.read(min(1 << 24, arr.nbytes - pos))
                    if not chunk:
                        break
                    view[pos:pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
                    pos += len(chunk)
        except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
            raise FileFormatError(f"{self.name}: array {_key(arr.member)!r} is damaged or truncated ({exc})") from exc
        if pos < arr.nbytes:
            raise FileFormatError(f"{self.name}: array {_key(arr.member)!r} is truncated: its header declares "
                                  f"{arr.nbytes} bytes of data, the file holds {pos}")
        return out.reshape(arr.shape, order="F" if arr.fortran_order else "C")


def _key(member: str) -> str:
    return member[:-4] if member.endswith(".npy") else member


def _open_members(name: str) -> _Archive:
    """The archive's members with their npy headers; FileFormatError naming what is not an array of numbers."""
    with open(name, "rb") as fh:
        magic = fh.read(8)
    if magic.startswith(b"\x93NUMPY"):
        raise FileFormatError(f"{name}: a single .npy array, not a smooth-attention .npz archive")
    try:
        zf = zipfile.ZipFile(name)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        if magic.startswith(b"PK\x03\x04"):
            raise FileFormatError(f"{name}: a damaged or truncated .npz archive (its zip directory is unreadable: "
                                  f"{exc})") from exc
        what = "pickled data, which smooth-attention files never contain; refusing it" \
            if magic[:1] == b"\x80" else "not a zip file"
        raise FileFormatError(f"{name}: not a smooth-attention archive (an .npz file): {what}") from exc
    archive = _Archive(name)
    with zf:
        infos = zf.infolist()
        if len(infos) > _MAX_MEMBERS:
            raise FileFormatError(f"{name}: {len(infos)} members; a smooth-attention archive has at most a few")
        for info in infos:
            key = _key(info.filename)
            if not info.filename.endswith(".npy") or key in archive.arrays:
                what = "a duplicate" if key in archive.arrays else "not an .npy array"
                raise FileFormatError(f"{name}: member {info.filename!r} is {what}; not a smooth-attention archive")
            try:
                with zf.open(info) as fh:
                    version = np.lib.format.read_magic(fh)
                    read = {(1, 0): np.lib.format.read_array_header_1_0,
                            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                    if read is None:
                        raise ValueError(f"unsupported .npy format version {version}")
                    shape, fortran, dtype = read(fh)
                    offset = fh.tell()
            except (ValueError, OSError, zipfile.BadZipFile, EOFError, zlib.error, SyntaxError) as exc:
                raise FileFormatError(f"{name}: array {key!r} has an unreadable header ({exc})") from exc
            if dtype.hasobject:
                raise FileFormatError(f"{name}: array {key!r} holds Python objects (pickled data), which "
                                      "smooth-attention files never contain; refusing to load it")
            if dtype.kind not in "fiubU" or dtype.fields is not None or dtype.subdtype is not None:
                if key == _HEADER:
                    raise FileFormatError(f"{name}: the {_HEADER!r} entry is not a JSON text (it holds {dtype})")
                raise FileFormatError(f"{name}: array {key!r} has dtype {dtype}; expected numbers")
            arr = LazyArray(archive, info.filename, dtype, tuple(int(s) for s in shape), bool(fortran), offset)
            if info.file_size != offset + arr.nbytes:
                state = "truncated" if info.file_size < offset + arr.nbytes else "followed by stray bytes"
                raise FileFormatError(f"{name}: array {key!r} is {state}: its header declares shape {arr.shape} "
                                      f"of {dtype} ({arr.nbytes} bytes), its member holds {info.file_size - offset}")
            archive.arrays[key] = arr
    return archive


def read_archive(path, kind: str | None) -> tuple[dict, dict[str, LazyArray]]:
    """The header and arrays of a smooth-attention archive of the given ``kind`` (None: any), checked.

    The arrays are :class:`LazyArray` objects (dtype and shape from their npy headers, data on
    :meth:`LazyArray.load`): check names and shapes first, then load.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path, got {type(path).__name__}")
    name = os.fspath(path)
    if os.path.isdir(name):
        raise IsADirectoryError(f"path: {name} is a folder; give the path of a file written by save_measure, "
                                "save_trajectory or save_estimate")
    if not os.path.isfile(name):
        raise FileNotFoundError(f"path: no such file: {name}")
    archive = _open_members(name)
    arrays = dict(archive.arrays)
    raw = arrays.pop(_HEADER, None)
    if raw is not None:
        if raw.dtype.kind != "U" or raw.ndim != 0:
            raise FileFormatError(f"{name}: the {_HEADER!r} entry is not a JSON text")
        if raw.nbytes > _HEADER_MAX_BYTES:
            raise FileFormatError(f"{name}: the {_HEADER!r} entry holds {raw.nbytes} bytes, not a header")
        raw = archive.read(raw)
    header = _parse_header(raw, name)
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
                              f"(not written by {FORMAT_NAME} format version {FORMAT_VERSION})")


def check_array(arrays: dict, key: str, header: dict, name, *, ndim: int, length: int | None = None) -> tuple:
    """The shape of array ``key``, after checking (from its npy header, before reading it) that its dtype is
    the header's, its number of dimensions ``ndim`` and, when given, its first dimension ``length``."""
    arr = arrays[key]
    dtype = _FLOATS[header["dtype"]]
    allowed = {torch.float32 if dtype == torch.bfloat16 else dtype}
    if key == "positions":   # kept in float32 for half-precision points (files before that: the points' dtype)
        allowed.add(position_dtype(dtype))
    # compared in native byte order: a big-endian '>f8' is float64 (torch.from_numpy refuses non-native data)
    if arr.dtype.kind != "f" or torch.from_numpy(np.zeros(0, arr.dtype.newbyteorder("="))).dtype not in allowed:
        raise FileFormatError(f"{os.fspath(name)}: array {key!r} has dtype {arr.dtype}, but the header says "
                              f"{header['dtype']}")
    if arr.ndim != ndim:
        raise FileFormatError(f"{os.fspath(name)}: array {key!r} has shape {arr.shape}; expected {ndim} "
                              "dimension(s)")
    if length is not None and arr.shape[0] != length:
        raise FileFormatError(f"{os.fspath(name)}: array {key!r} has {arr.shape[0]} entries for {length} atoms")
    return tuple(arr.shape)


def tensor_of(arrays: dict, key: str, header: dict, name, *, ndim: int, device=None) -> torch.Tensor:
    """Array ``key`` as a tensor of the header's dtype (positions: :func:`particles.measure.position_dtype` of
    it), after :func:`check_array`; data stored in the other byte order (a big-endian ``'>f8'`` written on
    another machine) is converted to the native one, values unchanged."""
    check_array(arrays, key, header, name, ndim=ndim)
    arr = arrays[key]
    data = arr.load() if isinstance(arr, LazyArray) else np.ascontiguousarray(arr)
    if not data.dtype.isnative:
        data = data.astype(data.dtype.newbyteorder("="))
    dtype = _FLOATS[header["dtype"]]
    dtype = position_dtype(dtype) if key == "positions" else dtype
    return torch.from_numpy(np.ascontiguousarray(data)).to(dtype=dtype, device=device)


def measure_from_arrays(arrays: dict, header: dict, name, *, device=None,
                        points: torch.Tensor | None = None) -> Measure:
    """Rebuild a measure from its arrays (keys already checked); ``points`` given: a trajectory's first atoms."""
    name = os.fspath(name)
    n = check_array(arrays, "points", header, name, ndim=2)[0] if points is None else points.shape[0]
    keys = [key for key in ("weights", "log_weights", "positions") if key in arrays]
    for key in keys:   # every shape before any data
        check_array(arrays, key, header, name, ndim=1, length=n)
    if points is None:
        points = tensor_of(arrays, "points", header, name, ndim=2, device=device)
    vectors = {key: tensor_of(arrays, key, header, name, ndim=1, device=device) for key in keys}
    try:
        # the constructor's checks: finite points, log-weights that sum to one, positions in [0, 1]
        # views: the constructor copies a tensor given to it as itself, and these were just read from the file
        pos = vectors.get("positions")
        checked = Measure(points.view_as(points), positions=None if pos is None else pos.view_as(pos),
                          log_weights=vectors["log_weights"].view_as(vectors["log_weights"]))
    except (ValueError, TypeError) as exc:
        raise FileFormatError(f"{name}: not a valid measure: {exc}") from exc
    w = vectors["weights"]
    tol = weight_tolerance(points.dtype)
    if not bool(torch.allclose(w.double(), checked.weights.double(), rtol=math.sqrt(tol), atol=tol)):
        raise FileFormatError(f"{name}: arrays 'weights' and 'log_weights' disagree "
                              "(weights != exp(log_weights))")
    # the weights returned are the stored ones: they must be masses themselves, not only close to exp(log_weights)
    if bool((w < 0).any()) or abs(float(w.double().sum()) - 1.0) > tol:
        raise FileFormatError(f"{name}: array 'weights' holds negative masses or does not sum to one (sum "
                              f"{float(w.double().sum())!r}, min {float(w.min()):.3g})")
    # the stored tensors themselves, so that a round trip is exact (positions in the measure's position dtype:
    # a file of half-precision positions widens to float32 exactly)
    return Measure._trusted(points, w, vectors["log_weights"], checked.positions)


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
    except RecursionError:
        raise FileFormatError(f"{name}: the header is JSON nested too deeply to be a smooth-attention header") \
            from None
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


