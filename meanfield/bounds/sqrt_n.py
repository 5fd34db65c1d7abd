"""The sqrt(n) regime: Theorem 3.3 / 4.3 (the upper bound on sequences of n tokens in B_R) and Proposition 3.4 (the
lower bound of its witness sequence), with the radius and length where the regime holds (docs/math.md sections 5.1
and 5.3).

The ``*_from_gamma`` entry points take gamma instead of the matrix A, for callers that computed it once (a real
layer's heads, a sweep of many radii) or cannot form A at all (n beyond the integers); they evaluate the same
formulas."""

from __future__ import annotations

import math

import numpy as np

from particles.validation import check_positive_int, check_radius

from .eigen import gamma
from .numerics import _A_V, _check_log, _exp_or_inf, _gamma_value, _length, _log_or_inf

__all__ = ["sqrt_n_upper", "sqrt_n_lower", "sqrt_n_lower_from_gamma", "sqrt_n_regime_radius", "sqrt_n_regime_length"]


def sqrt_n_upper(A, V, R, n, *, log: bool = False) -> float:
    """Theorem 3.3 (unmasked) and Theorem 4.3 (masked): the Lipschitz constant of self-attention
    on B_R^n is at most ``sqrt(3) ||V||_2 (||A||_2^2 R^4 (4n + 1) + n)^{1/2}``, roughly R^2 sqrt(n).

    The same number bounds masked (causal) self-attention (Theorem 4.3). ``log=True`` returns the natural logarithm
    of the bound (``-inf`` when V = 0), finite where the bound itself is beyond float64's range.
    """
    a, v = _A_V(A, V)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    _check_log(log)
    na, nv = float(np.linalg.norm(a, 2)), float(np.linalg.norm(v, 2))
    # in logarithms: n may be an integer beyond float range (10**400), and R^4 may overflow
    log_terms = [math.log(n)]
    if na > 0 and R > 0:
        log_terms.append(2 * math.log(na) + 4 * math.log(R) + math.log(4 * n + 1))
    if nv == 0:
        return -math.inf if log else 0.0
    top = max(log_terms)
    log_root = 0.5 * (top + math.log(sum(math.exp(t - top) for t in log_terms)))
    value = 0.5 * math.log(3.0) + math.log(nv) + log_root
    return _log_or_inf(value, "sqrt_n_upper") if log else _exp_or_inf(value, "sqrt_n_upper", log_option=True)


def sqrt_n_lower(A, R, n) -> float:
    """Proposition 3.4 (V = I_d): the Lipschitz constant of self-attention on B_R^n is at least
    ``sqrt(n - 1) / (1 + (n - 1) exp(-2 gamma R^2))``, gamma from :func:`gamma`.

    Reached or exceeded at the witness :func:`meanfield.adversarial.sqrt_n_sequence` (in case "min"
    the witness's constant matches it to about 1e-4 while (n - 1) exp(-2 gamma R^2) is small, and is above
    it beyond: 5x at n = 1024 with gamma R^2 = 3.1; in case "max" it is above it, at n = 2 by a
    factor that tends to sqrt(2) as exp(-2 gamma R^2) gets small: 2.0, 1.69, 1.415 at gamma R^2 = 0.125, 1.125,
    4.5 for A = I); it grows like sqrt(n) while n << exp(2 gamma R^2).
    """
    g = gamma(A)
    return sqrt_n_lower_from_gamma(g, R, check_positive_int(n, "n"))


def sqrt_n_lower_from_gamma(gamma, R, n) -> float:
    """Proposition 3.4 from gamma: ``sqrt(n - 1) / (1 + (n - 1) exp(-2 gamma R^2))``.

    The value :func:`sqrt_n_lower` gives for a matrix A with ``gamma(A) = gamma``. ``n`` may be any
    real >= 1: the proposition is about sequences (integer n); at other n this is the same formula
    evaluated on the two-atom family (1/n, (n-1)/n) of :func:`meanfield.adversarial.sqrt_n_measure`,
    and n may exceed the range of integers a caller can form (10^15 and beyond).
    """
    g = _gamma_value(gamma)
    R = check_radius(R, "R")
    n = _length(n)
    if isinstance(n, float):
        return float(math.sqrt(n - 1) / (1.0 + (n - 1) * math.exp(-2.0 * g * R * R)))
    # n beyond the float range (10**400): in logarithms
    log_m = math.log(n - 1)
    t = log_m - 2.0 * g * R * R                      # log((n-1) e^{-2 gamma R^2}), of either sign (large R)
    log1p_et = max(t, 0.0) + math.log1p(math.exp(-abs(t)))   # log(1 + e^t) without overflow
    return _exp_or_inf(0.5 * log_m - log1p_et, "sqrt_n_lower_from_gamma")


def sqrt_n_regime_radius(gamma, n) -> float:
    """The radius R at which ``exp(2 gamma R^2) = n``: ``sqrt(log(n) / (2 gamma))``.

    Proposition 3.4's bound grows like sqrt(m) for lengths m << exp(2 gamma R^2) and saturates
    beyond; a study that wants a whole grid of lengths in the sqrt(n) regime takes R at least this
    radius for n well above its largest length (say 1000 times).
    """
    g = _gamma_value(gamma)
    n = _length(n)
    if g == 0.0:
        raise ValueError("gamma: is 0, so exp(2 gamma R^2) = 1 at every radius and no radius reaches n")
    return math.sqrt(math.log(n) / (2.0 * g))


def sqrt_n_regime_length(gamma, R) -> float:
    """``exp(2 gamma R^2)``: the length near which Proposition 3.4's sqrt(n) growth stops (math.inf
    beyond the float64 range)."""
    g = _gamma_value(gamma)
    R = check_radius(R, "R")
    return _exp_or_inf(2.0 * g * R * R)
