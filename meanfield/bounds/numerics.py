"""What the bounds share: their arguments read as float64 numpy arrays, spectral norms, and exponentials that say
when they overflow.

Bounds containing ``exp(c R^2)`` accept ``log=True`` and then return the natural logarithm of the bound, finite
while its exponent is (c R^2 below about 1.8e308: R up to about 1e153 for c = 2). Their plain value is ``math.inf``
only when the true number exceeds the float64 range (about 1.8e308), and then with a :class:`BoundOverflowWarning`
that gives the logarithm; so is a logarithm that overflows; never NaN.
"""

from __future__ import annotations

import math
import numbers
import warnings

import numpy as np
import torch

from particles.validation import as_tensor, check_allocation, check_bool, scalar

__all__ = ["spectral_norm", "BoundOverflowWarning"]


def _matrix(M, name: str) -> np.ndarray:
    t = as_tensor(M, name, dtype=torch.float64)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a matrix (2-D), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty matrix, got shape {tuple(t.shape)}")
    return t.detach().cpu().numpy()


def _check_scores_memory(n: int, what: str) -> None:
    """The (n, n) float64 score matrix of every token against every other, and the two copies the
    argmax and the runner-up take: checked against the memory limit before they are allocated."""
    check_allocation(3 * 8 * n * n, f"{what}: the ({n}, {n}) score matrix of X", "give fewer tokens (rows of X)")


def _square(A, name: str = "A") -> np.ndarray:
    a = _matrix(A, name)
    if a.shape[0] != a.shape[1]:
        raise ValueError(f"{name}: expected a square (d, d) matrix, got shape {a.shape}")
    return a


def _A_V(A, V) -> tuple[np.ndarray, np.ndarray]:
    a = _square(A)
    v = _matrix(V, "V")
    if v.shape[1] != a.shape[0]:
        raise ValueError(f"V: expected {a.shape[0]} columns to match A of shape {a.shape}, got shape {v.shape}")
    return a, v


def spectral_norm(M, name: str = "M") -> float:
    """||M||_2, the largest singular value of a matrix (numpy or torch)."""
    return float(np.linalg.norm(_matrix(M, name), 2))


def _check_log(log) -> bool:
    return check_bool(log, "log")


class BoundOverflowWarning(RuntimeWarning):
    """A bound whose value exceeds float64's range (about exp(709.78)) was returned as ``math.inf``: its
    logarithm (``log=True`` where the function has it) is the number to use."""


def _log_or_inf(log_value: float, what: str, stacklevel: int = 3) -> float:
    """``log_value`` for a ``log=True`` caller, with a :class:`BoundOverflowWarning` where it is inf (the exponent
    itself beyond float64's range, R above about 1e153: math.exp(inf) raises nothing, so it is warned here)."""
    if log_value == math.inf:
        warnings.warn(f"{what}: the bound's logarithm exceeds float64's range (the exponent overflows); returned "
                      "inf", BoundOverflowWarning, stacklevel=stacklevel)
    return log_value


def _exp_or_inf(log_value: float, what: str | None = None, log_option: bool = False) -> float:
    """exp(log_value), math.inf only when the number itself exceeds the float64 range; then, for a public
    bound (``what`` names it), a :class:`BoundOverflowWarning` that gives the logarithm and how to get it."""
    if log_value == -math.inf:
        return 0.0
    if log_value == math.inf:
        return math.inf if what is None else _log_or_inf(log_value, what, stacklevel=4)
    try:
        return math.exp(log_value)
    except OverflowError:
        if what is not None:
            warnings.warn(f"{what}: the bound is exp({log_value:.6g}), beyond float64's range; returned inf"
                          + ("; log=True returns its logarithm" if log_option else ""),
                          BoundOverflowWarning, stacklevel=3)
        return math.inf


def _check_tol(tol):
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol: expected a finite tolerance >= 0, got {tol!r}")


def _gamma_value(gamma) -> float:
    gamma = scalar(gamma, "gamma")
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(f"gamma: expected a real number, got {type(gamma).__name__}")
    g = float(gamma)
    if not math.isfinite(g) or g < 0:
        raise ValueError(f"gamma: expected a finite number >= 0, got {g}")
    return g


def _length(n, name: str = "n"):
    """A length n >= 1: a float, or a Python int kept exact when it exceeds the float range."""
    n = scalar(n, name)
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(n).__name__}")
    if isinstance(n, numbers.Integral) and int(n) >= 1:
        return int(n) if int(n) > 2**1000 else float(n)
    x = float(n)
    if not math.isfinite(x) or x < 1:
        raise ValueError(f"{name}: expected a finite number >= 1, got {n!r}")
    return x


def _heads_tensor(M, name: str, ndim: int) -> torch.Tensor:
    t = as_tensor(M, name, dtype=torch.float64)
    if t.dim() == ndim - 1:
        t = t[None]
    if t.dim() != ndim or t.numel() == 0:
        raise ValueError(f"{name}: expected {'(H, k, d) or (k, d)' if ndim == 3 else '(H, k) or (k,)'}, "
                         f"got shape {tuple(t.shape)}")
    return t
