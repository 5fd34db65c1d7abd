"""Saving and loading trajectories and Lipschitz estimates, in the ``.npz`` format of :mod:`particles.io`.

Both are NumPy ``.npz`` archives with the JSON ``header`` of :mod:`particles.io` (format name,
format version, kind, dtype, library version, user metadata) and plain numeric arrays; nothing is
pickled, and loading uses ``np.load(..., allow_pickle=False)``.

A :class:`~meanfield.dynamics.Trajectory` (``kind = "trajectory"``) stores the arrays

``times`` (T,), ``points`` (T, N, d), ``weights`` (N,), ``log_weights`` (N,), ``positions`` (N,)
(masked measures only) and ``rescale_V`` (d, d) (rescaled trajectories only),

and in the header ``method``, ``nfev``, ``steps`` and ``geometry`` ("euclidean" or "sphere"; files of
the previous release carry ``sphere`` instead, False, True, "SA" or "USA", and still load).

A :class:`~meanfield.lipschitz.LipschitzEstimate` (``kind = "lipschitz_estimate"``) stores its
tensor fields as arrays (``vector``) and its other fields (``value``, ``error``, ``iterations``,
``method``, ``converged``, ``applications``, ``residual``, ``stalled``, ``batched``) in the header's
``"fields"`` object; a batch of estimates (``batched``: ``local_lipschitz`` on a (b, n, d) batch) stores
``vector`` as (b, ...) and its per-member ``value``, ``error``, ``residual``, ``converged`` and ``stalled``
as lists of b entries, each member checked on loading as one estimate is.
Non-finite floats are written as the ``NaN`` / ``Infinity`` tokens that Python's ``json`` reads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing

import torch

from particles.io import (
    FileFormatError,
    check_array,
    check_keys,
    measure_from_arrays,
    read_archive,
    tensor_of,
    to_numpy,
    write_archive,
)
from particles.validation import check_device

from .dynamics import Trajectory
from .geometry import GEOMETRIES
from .integrators import ADAPTIVE, FIXED
from .lipschitz import METHODS as _ESTIMATE_METHODS
from .lipschitz import LipschitzEstimate

__all__ = ["save_trajectory", "load_trajectory", "save_estimate", "load_estimate"]

#: what an estimate's ``attention`` field may say (LipschitzEstimate)
_ATTENTION_PATHS = ("exact", "series", "mixed", "not recorded")

_SPHERE = (False, True, "SA", "USA")


# ---------------------------------------------------------------------- trajectories
def save_trajectory(traj: Trajectory, path, *, metadata: dict | None = None):
    """Write a :class:`~meanfield.dynamics.Trajectory` (from :func:`meanfield.simulate`) to ``path``.

    Parameters
    ----------
    traj : Trajectory
    path : str or os.PathLike
        Written exactly there (no suffix added), atomically.
    metadata : dict or None
        A JSON object stored in the header (:func:`particles.io.read_header` reads it back).

    Returns
    -------
    pathlib.Path
    """
    if not isinstance(traj, Trajectory):
        raise TypeError(f"traj: expected a meanfield Trajectory, got {type(traj).__name__}")
    arrays = {"times": to_numpy(traj.times), "points": to_numpy(traj.points), "weights": to_numpy(traj.weights),
              "log_weights": to_numpy(traj.log_weights)}
    if traj.positions is not None:
        arrays["positions"] = to_numpy(traj.positions)
    if traj.rescale_V is not None:
        arrays["rescale_V"] = to_numpy(traj.rescale_V)
    # adaptive solvers count no fixed steps: steps is None, and stays None through the file
    fields = {"method": traj.method, "nfev": int(traj.nfev),
              "steps": None if traj.steps is None else int(traj.steps), "geometry": traj.geometry}
    return write_archive(path, "trajectory", arrays, dtype=traj.points.dtype, metadata=metadata, fields=fields)


def load_trajectory(path, *, device=None) -> Trajectory:
    """Read a trajectory written by :func:`save_trajectory` (checked like a new measure at each time).

    Raises
    ------
    particles.io.FileFormatError
        Not a trajectory archive, a newer format version, or inconsistent arrays (named in the message).
    """
    device = check_device(device)
    header, arrays = read_archive(path, "trajectory")
    name = os.fspath(path)
    check_keys(arrays, {"times", "points", "weights", "log_weights"}, {"positions", "rescale_V"}, name)
    # every shape from the npy headers before any data is read
    T, N, d = check_array(arrays, "points", header, name, ndim=3)
    if T == 0:
        raise FileFormatError(f"{name}: array 'points' holds no time")
    n_times = check_array(arrays, "times", header, name, ndim=1)[0]
    if n_times != T:
        raise FileFormatError(f"{name}: {n_times} times for {T} point sets in 'points'")
    for key in ("weights", "log_weights", "positions"):
        if key in arrays:
            check_array(arrays, key, header, name, ndim=1, length=N)
    if "rescale_V" in arrays and check_array(arrays, "rescale_V", header, name, ndim=2) != (d, d):
        raise FileFormatError(f"{name}: array 'rescale_V' has shape {arrays['rescale_V'].shape}; expected ({d}, {d})")
    method = _field(header, "method", str, name)
    if method not in FIXED and method not in ADAPTIVE:
        raise FileFormatError(f"{name}: header field 'method' is {method!r}; expected one of "
                              f"{(*FIXED, *ADAPTIVE)}")
    nfev = _count(header, "nfev", name)
    steps = None if header.get("steps") is None else _count(header, "steps", name)   # None: adaptive
    points = tensor_of(arrays, "points", header, name, ndim=3, device=device)
    times = tensor_of(arrays, "times", header, name, ndim=1)
    if not bool(torch.isfinite(times).all()) or not bool((times[1:] > times[:-1]).all()):
        raise FileFormatError(f"{name}: array 'times' must be finite and strictly increasing")
    if not bool(torch.isfinite(points).all()):
        raise FileFormatError(f"{name}: array 'points' contains NaN or infinite entries")
    template = measure_from_arrays(arrays, header, name, device=device, points=points[0])
    V = None
    if "rescale_V" in arrays:
        V = tensor_of(arrays, "rescale_V", header, name, ndim=2, device=device)
        if not bool(torch.isfinite(V).all()):
            raise FileFormatError(f"{name}: array 'rescale_V' contains NaN or infinite entries")
    if "geometry" in header:
        geometry = header["geometry"]
        if geometry not in GEOMETRIES:
            raise FileFormatError(f"{name}: header field 'geometry' is {geometry!r}; expected one of "
                                  f"{sorted(GEOMETRIES)}")
    else:   # a file of the previous release
        sphere = header.get("sphere")
        if sphere not in _SPHERE or isinstance(sphere, int) and not isinstance(sphere, bool):
            raise FileFormatError(f"{name}: header field 'sphere' is {sphere!r}; expected one of {_SPHERE}")
        geometry = "sphere" if sphere else "euclidean"
    return Trajectory(times, points, template, method=method, nfev=nfev, steps=steps, rescale_V=V,
                      geometry=geometry)


# ---------------------------------------------------------------------- Lipschitz estimates
def save_estimate(est: LipschitzEstimate, path, *, metadata: dict | None = None):
    """Write a :class:`~meanfield.lipschitz.LipschitzEstimate` (from :func:`meanfield.local_lipschitz`).

    Parameters
    ----------
    est : LipschitzEstimate
    path : str or os.PathLike
        Written exactly there (no suffix added), atomically.
    metadata : dict or None
        A JSON object stored in the header, e.g. what the estimate is of.

    Returns
    -------
    pathlib.Path
    """
    if not isinstance(est, LipschitzEstimate):
        raise TypeError(f"est: expected a meanfield LipschitzEstimate, got {type(est).__name__}")
    arrays, fields = {"vector": to_numpy(est.vector)}, {}
    for f in dataclasses.fields(est):
        value = getattr(est, f.name)
        if f.name == "vector":
            continue
        if isinstance(value, torch.Tensor):   # a batch's per-member fields (values, errors, flags): JSON lists
            fields[f.name] = value.tolist()
        else:
            fields[f.name] = value.item() if hasattr(value, "item") else value
    return write_archive(path, "lipschitz_estimate", arrays, dtype=est.vector.dtype, metadata=metadata,
                         fields={"fields": fields})


def load_estimate(path, *, device=None) -> LipschitzEstimate:
    """Read an estimate written by :func:`save_estimate`; every field is checked against its type and
    its meaning: ``value`` finite and >= 0, ``error`` and ``residual`` >= 0 (infinite only for an
    estimate that did not converge), counts >= 0, ``method`` one of :func:`~meanfield.local_lipschitz`'s, ``vector`` a
    finite unit vector.

    Raises
    ------
    particles.io.FileFormatError
        Not an estimate archive, a newer format version, missing or unknown fields, or fields of the
        wrong type or meaning (named in the message).
    """
    device = check_device(device)
    header, arrays = read_archive(path, "lipschitz_estimate")
    name = os.fspath(path)
    stored = header.get("fields")
    if not isinstance(stored, dict):
        raise FileFormatError(f"{name}: the header has no 'fields' object")
    hints = typing.get_type_hints(LipschitzEstimate)
    tensors = {k for k, t in hints.items() if t is torch.Tensor}
    check_keys(arrays, tensors, set(), name)
    if "attention" not in stored:   # written before estimates recorded their attention path
        stored = {**stored, "attention": "not recorded"}
    missing = sorted(set(hints) - tensors - set(stored))
    unknown = sorted(set(stored) - set(hints))
    if missing or unknown:
        raise FileFormatError(f"{name}: estimate fields missing: {missing or 'none'}; unknown: {unknown or 'none'}")
    if stored.get("batched") is True:
        return _load_batch(stored, arrays, header, hints, tensors, name, device)
    values = {key: _field(stored, key, kind, name) for key, kind in hints.items() if key not in tensors}
    _check_estimate(values, name)
    for key in tensors:
        values[key] = tensor_of(arrays, key, header, name, ndim=arrays[key].ndim, device=device)
    _check_vector(values["vector"], name)
    return LipschitzEstimate(**values)


#: the fields a batch of estimates holds per member (the others are the whole batch's)
_PER_MEMBER = ("value", "error", "residual", "converged", "stalled")


def _load_batch(stored, arrays, header, hints, tensors, name, device) -> LipschitzEstimate:
    """A batch written by :func:`save_estimate`: per-member fields as lists, each member checked as one
    estimate is."""
    vector = tensor_of(arrays, "vector", header, name, ndim=arrays["vector"].ndim, device=device)
    b = vector.shape[0] if vector.dim() >= 1 else 0
    lists = {}
    for key in _PER_MEMBER:
        v = stored.get(key)
        if not isinstance(v, list) or len(v) != b or b == 0:
            raise FileFormatError(f"{name}: header field {key!r} of a batch of {b} estimates is {v!r}; expected a "
                                  f"list of {b} entries")
        lists[key] = v
    shared = {key: _field(stored, key, kind, name) for key, kind in hints.items()
              if key not in tensors and key not in _PER_MEMBER}
    for i in range(b):
        member = {**shared, **{key: _field({key: lists[key][i]}, key, hints[key], name) for key in _PER_MEMBER}}
        _check_estimate(member, f"{name} (batch member {i})")
        _check_vector(vector[i], f"{name} (batch member {i})")
    col = lambda key, dtype: torch.tensor([float(x) if dtype != torch.bool else bool(x) for x in lists[key]],
                                          dtype=dtype)
    return LipschitzEstimate(value=col("value", torch.float64), vector=vector, error=col("error", torch.float64),
                             residual=col("residual", torch.float64), converged=col("converged", torch.bool),
                             stalled=col("stalled", torch.bool), **{k: v for k, v in shared.items() if k != "batched"},
                             batched=True)


def _check_estimate(v: dict, name: str) -> None:
    """The scalar fields of an estimate mean what local_lipschitz's do (LipschitzEstimate's docstring)."""
    if not (math.isfinite(v["value"]) and v["value"] >= 0):
        raise FileFormatError(f"{name}: field 'value' is {v['value']!r}; a local Lipschitz constant is finite and "
                              ">= 0")
    for key in ("error", "residual"):
        x = v[key]
        if math.isnan(x) or x < 0 or (math.isinf(x) and v["converged"]):
            raise FileFormatError(f"{name}: field {key!r} is {x!r}; expected a number >= 0 (infinite only for an "
                                  "estimate that did not converge)")
    for key in ("iterations", "applications"):
        if v[key] < 0:
            raise FileFormatError(f"{name}: field {key!r} is {v[key]}; a count is >= 0")
    if v["method"] not in _ESTIMATE_METHODS:
        raise FileFormatError(f"{name}: field 'method' is {v['method']!r}; expected one of {_ESTIMATE_METHODS}")
    if v["attention"] not in _ATTENTION_PATHS:
        raise FileFormatError(f"{name}: field 'attention' is {v['attention']!r}; expected one of {_ATTENTION_PATHS}")


def _check_vector(u: torch.Tensor, name: str) -> None:
    """The direction of maximal change is a finite unit vector (its norm within the dtype's rounding)."""
    if u.numel() == 0 or not bool(torch.isfinite(u).all()):
        raise FileFormatError(f"{name}: array 'vector' is empty or contains NaN or infinite entries")
    norm = float(u.double().norm())
    tol = max(1e-6, 8 * torch.finfo(u.dtype).eps)
    if abs(norm - 1.0) > tol:
        raise FileFormatError(f"{name}: array 'vector' has norm {norm:.6g}; the direction of maximal change is a "
                              "unit vector")


def _count(header: dict, key: str, name: str) -> int:
    value = _field(header, key, int, name)
    if value < 0:
        raise FileFormatError(f"{name}: header field {key!r} is {value}; a count is >= 0")
    return value


def _field(header: dict, key: str, kind: type, name: str):
    """Header field ``key`` checked against ``kind`` (an int is a float; a bool is not an int)."""
    value = header.get(key)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind in (bool, str) and isinstance(value, kind):
        return value
    if kind not in (float, int, bool, str):  # pragma: no cover - a new field type needs a reader
        raise FileFormatError(f"{name}: no reader for field {key!r} of type {kind}")
    raise FileFormatError(f"{name}: header field {key!r} is {value!r}; expected a {kind.__name__}")

