"""The large-radius regime: the limit of Theorem 3.7 (unmasked) / 4.5 (masked) and the score gaps that govern its
rate (docs/math.md section 5.5)."""

from __future__ import annotations

import math

import numpy as np
import torch

from particles.validation import as_tensor, check_bool, check_positive_float, check_positive_int

from .numerics import _A_V, _check_scores_memory, _matrix, _square

__all__ = ["argmax_indices", "large_radius_limit", "score_gap", "large_radius_sup"]


def argmax_indices(A, X, *, masked: bool = False, rtol: float = 1e-9) -> np.ndarray:
    """m_i = argmax_j <A x_i, x_j> (over j <= i when ``masked``), as an int array of length n.

    Raises a ValueError when some row's maximum is not unique: the runner-up score lies within
    ``rtol |A x_i| max_j |x_j|`` of the maximum (the bound on row i's scores and on their rounding; Theorems 3.7 /
    4.5 need unique maximizers). The test, like the maximizers, does not depend on the scale of X (a direction
    multiplied by 1e-6 was refused where the direction itself was not), and the scores are formed from X and A
    scaled to a largest entry of one, so that no radius overflows them. ``rtol`` is a finite number >= 0 (0: only
    exact ties); NaN or a negative value, which would switch the test off, is a ValueError.
    """
    a = _square(A)
    x = _matrix(X, "X")
    if x.shape[1] != a.shape[0]:
        raise ValueError(f"X: expected tokens of dimension {a.shape[0]} to match A, got shape {x.shape}")
    masked = check_bool(masked, "masked")
    rtol = check_positive_float(rtol, "rtol", allow_zero=True)
    _check_scores_memory(x.shape[0], "argmax_indices")
    # positive scales of X and A: the same maximizers and relative gaps, from scores that cannot overflow
    x, a = _unit_entries(x), _unit_entries(a)
    ax = x @ a.T
    S = ax @ x.T
    n = S.shape[0]
    if masked:
        S = np.where(np.tril(np.ones((n, n), dtype=bool)), S, -np.inf)
    m = np.argmax(S, axis=1)
    top = S[np.arange(n), m]
    rest = S.copy()
    rest[np.arange(n), m] = -np.inf
    second = rest.max(axis=1)
    scale = np.linalg.norm(ax, axis=1) * (np.linalg.norm(x, axis=1).max() if n else 0.0)
    with np.errstate(invalid="ignore"):   # a row of one key: top - (-inf) = inf, never a tie
        gap = top - second
    ties = np.nonzero(gap <= rtol * scale)[0]
    if ties.size:
        i = int(ties[0])
        relative = gap[i] / scale[i] if scale[i] > 0 else 0.0
        raise ValueError(f"X: the maximizer of <A x_i, x_j> over j is not unique for {ties.size} row(s) "
                         f"(first: row {i}, gap {relative:.3g} of |A x_i| max_j |x_j|); Theorem "
                         f"{'4.5' if masked else '3.7'} needs a unique argmax in every row")
    return m


def _unit_entries(t: np.ndarray) -> np.ndarray:
    """``t`` divided by its largest absolute entry (as it is when that is 0 or not finite)."""
    top = float(np.abs(t).max()) if t.size else 0.0
    return t / top if 0 < top < math.inf else t


def large_radius_limit(A, V, X, *, masked: bool = False, rtol: float = 1e-9) -> float:
    """The norm of the Jacobian's limit of Theorem 3.7 (unmasked) / Theorem 4.5 (masked): ``lim_{R -> inf}
    Lip_{RX}(f) = ||V||_2 sqrt(max_j #{i : m_i = j})`` with m_i from :func:`argmax_indices` (j <= i if masked). The
    theorems give the limit D_{RX} f and the bound ||V||_2 sqrt(n); its norm is this framework's step
    (docs/math.md section 5.5).

    The convergence is exponentially fast in R^2; X is the direction (n, d). Raises when some
    argmax is not unique.
    """
    a, v = _A_V(A, V)
    m = argmax_indices(a, X, masked=masked, rtol=rtol)
    mult = int(np.bincount(m).max())
    return float(np.linalg.norm(v, 2) * math.sqrt(mult))


def score_gap(A, X, *, masked: bool = False) -> float:
    """The smallest margin between the two largest scores ``<A x_i, x_j>`` of a row (over j <= i
    when ``masked``); ``math.inf`` when no row has two keys.

    Theorems 3.7 / 4.5 need a positive margin, and the constant at R X approaches its limit
    (:func:`large_radius_limit`) like ``exp(-gap R^2)``.
    """
    a = as_tensor(A, "A", dtype=torch.float64)
    x = as_tensor(X, "X", dtype=torch.float64)
    if a.dim() != 2 or a.shape[0] != a.shape[1] or x.dim() != 2 or x.shape[1] != a.shape[0] or x.shape[0] == 0:
        raise ValueError(f"A, X: expected A (d, d) and X (n, d), got {tuple(a.shape)} and {tuple(x.shape)}")
    masked = check_bool(masked, "masked")
    _check_scores_memory(x.shape[0], "score_gap")
    S = x @ a.T @ x.T
    if masked:
        S = S.masked_fill(torch.triu(torch.ones_like(S, dtype=torch.bool), 1), -math.inf)
    top = torch.topk(S, min(2, S.shape[1]), dim=1).values
    gaps = top[:, 0] - top[:, 1] if top.shape[1] > 1 else torch.full((S.shape[0],), math.inf)
    gaps = torch.where(torch.isfinite(gaps), gaps, torch.full_like(gaps, math.inf))
    return float(gaps.min())


def large_radius_sup(V, n) -> float:
    """``||V||_2 sqrt(n)``: the largest value the limit of Theorems 3.7 / 4.5 takes over directions
    of n tokens (every token attends to the same one: multiplicity n)."""
    v = as_tensor(V, "V", dtype=torch.float64)
    if v.dim() != 2 or v.numel() == 0:
        raise ValueError(f"V: expected a non-empty matrix, got shape {tuple(v.shape)}")
    n = check_positive_int(n, "n")
    return float(torch.linalg.matrix_norm(v, ord=2)) * math.sqrt(n)
