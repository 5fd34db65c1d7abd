"""The mean-field regime: Theorem 3.5 (the upper bound on measures in B_R; Theorem 4.4's masked version as stated
fails, :func:`cesaro_norm`) and Proposition 3.6 (the exponential two-Dirac lower bound), docs/math.md sections 5.2
and 5.4.

The ``*_from_gamma`` entry points take gamma instead of the matrix A, for callers that computed it once (a real
layer's heads, a sweep of many radii) or cannot form A at all (n beyond the integers); they evaluate the same
formulas."""

from __future__ import annotations

import math

import numpy as np

from particles.validation import check_positive_int, check_radius

from .eigen import gamma
from .numerics import _A_V, _check_log, _exp_or_inf, _gamma_value, _log_or_inf

__all__ = ["mean_field_upper", "cesaro_norm", "two_dirac_lower", "two_dirac_lower_from_gamma",
           "two_dirac_ratio_from_gamma", "two_dirac_ratio"]


def mean_field_upper(A, V, R, *, log: bool = False) -> float:
    """Theorem 3.5 (mean-field, Geshkovski et al. 2023): the W2 Lipschitz constant of unmasked mean-field
    attention on P(B_R) is at most ``||V||_2 (1 + 3 ||A||_2 R^2) exp(2 ||A||_2 R^2)``.

    By Lemma 3.2 it also bounds Lip_X(f) for unmasked sequences X in B_R^n of every length n.
    ``log=True`` returns the natural logarithm of the bound (``-inf`` when V = 0).

    Not for masked attention: the paper's Theorem 4.4 states this same bound for the masked map in the
    conditional W2, and it fails where ||A|| R^2 is small: at A = 0 the masked map is the running mean,
    whose constant is :func:`cesaro_norm` (n) ||V|| on sequences of length n, above ||V|| for n >= 2 and
    tending to 2 ||V|| (docs/math.md section 5.2).
    """
    a, v = _A_V(A, V)
    R = check_radius(R, "R")
    _check_log(log)
    na, nv = float(np.linalg.norm(a, 2)), float(np.linalg.norm(v, 2))
    if nv == 0.0:
        value = -math.inf
    else:
        t = na * R * R
        value = math.log(nv) + math.log1p(3.0 * t) + 2.0 * t
    return _log_or_inf(value, "mean_field_upper") if log else _exp_or_inf(value, "mean_field_upper", log_option=True)


def cesaro_norm(n) -> float:
    """||C_n||_2 of the running-mean matrix (C_n)_ij = 1/i for j <= i: the Lipschitz constant of masked
    attention with A = 0 and V = I on sequences of length n (then f^m(X)_i = (1/i) sum_{j<=i} x_j), in the
    Euclidean sense and, for the sequence's masked measure, in the conditional W2 sense (docs/math.md
    section 5.2). Increases with n to 2 (Hardy's inequality): the counterexample to Theorem 4.4's stated bound.
    Computed as the square root of the largest eigenvalue of C_n^T C_n (n up to a few thousand)."""
    n = check_positive_int(n, "n")
    if n > 20_000:
        raise ValueError(f"n: {n} is too large for a dense n x n matrix here (at most 20000); the limit is 2")
    C = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    return float(np.sqrt(np.linalg.eigvalsh(C.T @ C)[-1]))


def two_dirac_lower(A, R, *, log: bool = False) -> float:
    """Proposition 3.6 (V = I_d): the asymptotic value ``(gamma / 2) R^2 exp(gamma R^2)`` of the
    mean-field Lipschitz constant at the two-Dirac witness
    :func:`meanfield.adversarial.two_dirac` as R grows.

    It is an asymptotic equivalent, not an inequality at every R. ``log=True`` returns its natural
    logarithm (``-inf`` when gamma = 0 or R = 0).
    """
    g = gamma(A)
    R = check_radius(R, "R")
    _check_log(log)
    value = -math.inf if g == 0.0 or R == 0.0 else math.log(g / 2.0) + 2.0 * math.log(R) + g * R * R
    return _log_or_inf(value, "two_dirac_lower") if log else _exp_or_inf(value, "two_dirac_lower", log_option=True)


def two_dirac_lower_from_gamma(gamma, R, *, log: bool = False) -> float:
    """Proposition 3.6 from gamma: the asymptotic value ``(gamma / 2) R^2 exp(gamma R^2)``
    (as :func:`two_dirac_lower`); ``log=True`` returns its natural logarithm (``-inf`` when gamma = 0
    or R = 0)."""
    g = _gamma_value(gamma)
    R = check_radius(R, "R")
    _check_log(log)
    value = -math.inf if g == 0.0 or R == 0.0 else math.log(g / 2.0) + 2.0 * math.log(R) + g * R * R
    what = "two_dirac_lower_from_gamma"
    return _log_or_inf(value, what) if log else _exp_or_inf(value, what, log_option=True)


def two_dirac_ratio_from_gamma(gamma, R) -> float:
    """``1 + 1 / (gamma R^2)``: the ratio of the two-Dirac witness's constant to Proposition 3.6's
    asymptotic value ``(gamma / 2) R^2 exp(gamma R^2)`` (docs/math.md sections 5.4 and 7.5).

    It is the constant of the witness's two-atom measure (:func:`meanfield.adversarial.sqrt_n_witness_constant`
    with ``of="measure"``) at ``n = exp(2 gamma R^2)`` (where the witness family is the two-Dirac
    measure) divided by the asymptotic value, to leading order: with b = 1/2 there, ``sqrt(n - 1) b
    (1 + gamma R^2) / ((gamma/2) R^2 e^{gamma R^2}) = 1 + 1/(gamma R^2)``. The neglected terms are of
    relative order ``exp(-2 gamma R^2)`` (times ``(R^2 |A^T u - lambda u|)^2`` for a non-normal A), so
    the ratio tends to 1 as Proposition 3.6 states, at the rate
    ``1/(gamma R^2)``. ``math.inf`` when gamma = 0 or R = 0.
    """
    g = _gamma_value(gamma)
    R = check_radius(R, "R")
    t = g * R * R
    return math.inf if t == 0.0 else 1.0 + 1.0 / t


def two_dirac_ratio(A, R) -> float:
    """:func:`two_dirac_ratio_from_gamma` with gamma = :func:`gamma` (A)."""
    return two_dirac_ratio_from_gamma(gamma(A), R)
