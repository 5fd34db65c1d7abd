"""Adversarial inputs of *How Smooth Is Attention?*: the witnesses of the lower bounds.

* :func:`sqrt_n_sequence`: Proposition 3.4, Lip >= sqrt(n-1) / (1 + (n-1) e^{-2 gamma R^2});
* :func:`sqrt_n_witness_constant`, :func:`sqrt_n_witness_factor`: the constant the witness of
  Proposition 3.4 actually has (leading order), and its ratio to the bound;
* :func:`two_dirac`: Proposition 3.6, mean-field Lip ~ (gamma/2) R^2 e^{gamma R^2};
* :func:`large_radius_configuration`: Theorems 3.7 / 4.5, one token takes the attention of all,
  Lip_{RX} -> ``||V||_2`` sqrt(n);
* :func:`zero_plus_spread`: Appendix C.7 (after Kim et al. 2021), one token at 0, the others on
  the sphere of radius R; Lip grows like R^2.

Sequences are float64 tensors of shape (n, d) (``dtype=`` for another floating type), measures
are :class:`particles.Measure` objects. Every configuration lies in the closed ball B_R.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from particles import Measure
from particles.validation import check_bool, check_positive_int, check_radius, resolve_dtype

from .bounds import GammaInfo, _gamma_value, _square, argmax_indices, gamma_info, sqrt_n_lower, two_dirac_lower

__all__ = ["WitnessInfo", "large_radius_configuration", "sqrt_n_measure", "sqrt_n_sequence",
           "sqrt_n_sequence_from_info", "sqrt_n_witness_constant", "sqrt_n_witness_factor", "two_dirac",
           "zero_plus_spread"]


@dataclass(frozen=True)
class WitnessInfo:
    """What a witness was built from: gamma, the eigenvalue case ("max" or "min"), the unit
    eigenvector u, and the lower-bound value it reaches (Proposition 3.4) or approaches (3.6)."""

    gamma: float
    case: str
    eigenvalue: float
    eigenvector: np.ndarray
    bound: float


def _dtype(dtype) -> torch.dtype:
    dt = resolve_dtype(dtype) or torch.float64
    if not dt.is_floating_point:
        raise TypeError(f"dtype: expected a floating dtype, got {dt}")
    return dt


_bool = check_bool


def sqrt_n_sequence(A, R, n, *, return_info: bool = False, dtype=None):
    """The witness of Proposition 3.4 (V = I_d), a tensor (n, d) in B_R^n.

    With gamma, u from :func:`meanfield.bounds.gamma_info`: if lambda_max / 8 >= -lambda_min,
    X = (R u, R u/2, ..., R u/2) with A u = lambda_max u; otherwise X = (-R u, R u, ..., R u) with
    A u = lambda_min u. Lip_X(f) >= sqrt(n-1) / (1 + (n-1) exp(-2 gamma R^2)). A with no real
    eigenvalue raises a ValueError. ``return_info=True`` also returns a :class:`WitnessInfo`.
    """
    info = gamma_info(A)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    dt = _dtype(dtype)
    u = torch.as_tensor(info.eigenvector, dtype=dt)
    first, rest = (R, R / 2.0) if info.case == "max" else (-R, R)
    X = torch.cat([first * u[None, :], (rest * u)[None, :].expand(n - 1, -1)], dim=0).contiguous()
    if not _bool(return_info, "return_info"):
        return X
    return X, _witness(info, sqrt_n_lower(A, R, n))


def _witness(info: GammaInfo, bound: float) -> WitnessInfo:
    return WitnessInfo(info.gamma, info.case, info.eigenvalue, info.eigenvector, bound)


def two_dirac(A, R, *, positions: bool = False, return_info: bool = False, dtype=None):
    """The witness of Proposition 3.6 (V = I_d): the Measure p delta_{R u} + (1 - p) delta_{R u / 2}
    (case "max") or p delta_{-R u} + (1 - p) delta_{R u} (case "min"), p = exp(-2 gamma R^2).

    The small mass is stored as a log-weight (Measure.two_dirac(..., log_p=...)), so the measure
    stays exact at radii where p underflows. Its mean-field Lipschitz constant (W2 sense,
    Lemma C.5) is ~ (gamma / 2) R^2 exp(gamma R^2) as R grows. With n-1 copies of the second
    token, the sequence of Proposition 3.4 is this family with p = 1/n (docs/math.md section 2).
    ``positions=True`` gives both atoms position 1 (a masked measure whose atoms see each other).
    ``return_info=True`` also returns a :class:`WitnessInfo` whose ``bound`` is the asymptotic value.
    """
    info = gamma_info(A)
    R = check_radius(R, "R")
    dt = _dtype(dtype)
    if info.gamma == 0.0:
        raise ValueError("A: gamma(A) = 0 (every real eigenvalue is 0), so Proposition 3.6 gives no witness")
    u = torch.as_tensor(info.eigenvector, dtype=dt)
    x0, x1 = (R * u, R * u / 2.0) if info.case == "max" else (-R * u, R * u)
    kw = {"positions": torch.ones(2, dtype=dt)} if _bool(positions, "positions") else {}
    mu = Measure.two_dirac(x0, x1, log_p=-2.0 * info.gamma * R * R, dtype=dt, **kw)
    if not _bool(return_info, "return_info"):
        return mu
    return mu, _witness(info, two_dirac_lower(A, R))


def large_radius_configuration(A, n, R=1.0, *, masked: bool = False, hub: int = 0, dtype=None) -> torch.Tensor:
    """A direction X (n, d), ``max_i |x_i| = R``, where every token attends to the same token ``hub``:
    m_i = argmax_j <A x_i, x_j> = hub for all i (Theorem 3.7; j <= i and hub = 0 when ``masked``,
    Theorem 4.5). Then Lip_{tX}(f) -> ||V||_2 sqrt(n) as t -> inf, the largest large-radius limit.

    Construction, with w a unit vector and q = <A w, w>: if q > 0 the others are t_k w with
    distinct t_k in [1/2, 3/4] (the hub has t = 1); if q < 0 they have t_k in [5/4, 3/2]; if A is
    skew-symmetric (q = 0 for every w) they are ``w - a_k A w / |A w|`` with distinct a_k in
    [1/2, 1]. Each case makes the hub the strict, unique maximizer of every row (checked).
    """
    a = _square(A)
    n = check_positive_int(n, "n")
    R = check_radius(R, "R")
    if R == 0:
        raise ValueError("R: expected a positive radius (at R = 0 every score ties and no token is a hub)")
    if _bool(masked, "masked") and hub != 0:
        raise ValueError(f"hub: masked attention lets token 0 see only itself, so the hub must be 0, got {hub}")
    if isinstance(hub, bool) or not isinstance(hub, numbers.Integral) or not 0 <= hub < n:
        raise ValueError(f"hub: expected a token index in [0, {n}), got {hub!r}")
    hub = int(hub)
    if not np.any(a):
        raise ValueError("A: is zero, every score ties and no token can take the attention of all")
    sym = (a + a.T) / 2.0
    evals, evecs = np.linalg.eigh(sym)
    k = int(np.argmax(np.abs(evals)))
    scale = max(np.abs(evals).max(), np.linalg.norm(a, 2))
    others = max(n - 1, 1)
    if abs(evals[k]) > 1e-8 * scale:
        w = evecs[:, k]
        t = np.linspace(0.5, 0.75, others) if evals[k] > 0 else np.linspace(1.25, 1.5, others)
        pts = t[:, None] * w[None, :]
    else:  # skew-symmetric A: <A x, x> = 0 for every x
        w = np.linalg.svd(a)[2][0]
        b = a @ w
        b = b / np.linalg.norm(b)
        pts = w[None, :] - np.linspace(0.5, 1.0, others)[:, None] * b[None, :]
    X = np.insert(pts[: n - 1], hub, w, axis=0)
    X = X * (R / np.linalg.norm(X, axis=1).max())
    if not (argmax_indices(a, X, masked=masked) == hub).all():  # pragma: no cover - guaranteed by construction
        raise RuntimeError("large_radius_configuration: construction failed to make one hub")
    return torch.as_tensor(X, dtype=_dtype(dtype))


def zero_plus_spread(R, n, d, *, seed=None, dtype=None) -> torch.Tensor:
    """Appendix C.7 (after Kim et al. 2021): token 0 at the origin, the n - 1 others at radius R.

    The origin's softmax row is uniform, so its Jacobian block contains the empirical covariance of
    the tokens (times A and V), which grows like R^2: dot-product attention is not globally
    Lipschitz. Without ``seed`` the others are evenly spread on the circle of the first two
    coordinates (d >= 2; +-R alternating when d = 1, centred when n - 1 is even); with ``seed``
    they are i.i.d. uniform on the sphere of radius R.
    """
    R = check_radius(R, "R")
    n = check_positive_int(n, "n", minimum=2)
    d = check_positive_int(d, "d")
    dt = _dtype(dtype)
    X = torch.zeros(n, d, dtype=torch.float64)
    if seed is not None:
        g = torch.Generator().manual_seed(int(seed))
        Z = torch.randn(n - 1, d, generator=g, dtype=torch.float64)
        X[1:] = R * Z / Z.norm(dim=1, keepdim=True)
    elif d == 1:
        X[1:, 0] = R * torch.tensor([(-1.0) ** k for k in range(n - 1)], dtype=torch.float64)
    else:
        theta = 2.0 * math.pi * torch.arange(n - 1, dtype=torch.float64) / (n - 1)
        X[1:, 0], X[1:, 1] = R * torch.cos(theta), R * torch.sin(theta)
    return X.to(dt)


def sqrt_n_sequence_from_info(info: GammaInfo, R, n, *, dtype=None, device=None) -> torch.Tensor:
    """Proposition 3.4's witness (n, d) from an eigen-structure already computed: ``(R u, R u/2, ...,
    R u/2)`` (case "max") or ``(-R u, R u, ..., R u)`` (case "min"), u = ``info.eigenvector``.

    ``info`` is a :class:`meanfield.bounds.GammaInfo`, e.g. from
    :func:`meanfield.bounds.gamma_info_factored` for a head given by its factors (A = scale K^T Q)
    where forming and diagonalizing the d x d matrix A is wasteful. Same tensor as
    :func:`sqrt_n_sequence` for ``info = gamma_info(A)``.
    """
    if not isinstance(info, GammaInfo):
        raise TypeError(f"info: expected a meanfield.bounds.GammaInfo, got {type(info).__name__}")
    if info.eigenvector is None or info.gamma == 0.0:
        raise ValueError("info: gamma = 0 (every real eigenvalue is 0), so Proposition 3.4 gives no witness")
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    u = torch.as_tensor(info.eigenvector, dtype=_dtype(dtype), device=device)
    first, rest = (R, R / 2.0) if info.case == "max" else (-R, R)
    return torch.cat([first * u[None, :], (rest * u)[None, :].expand(n - 1, -1)], dim=0).contiguous()


def sqrt_n_measure(A, R, n, *, dtype=None) -> Measure:
    """Proposition 3.4's witness of n tokens as the two-atom measure it is: weight 1/n on the first
    token, (n - 1)/n on the repeated one (docs/math.md section 2: a sequence is the uniform measure
    on its tokens, and repeated tokens merge).

    Two atoms for any n, so the constant of the witness family is computable for n up to 10^15 and
    beyond; ``n`` may be any real > 1 (integer n gives the measure of a sequence; other n
    interpolate the family). The weights are stored as log-weights ``(-log n, log1p(-1/n))``.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or not n > 1:
        raise ValueError(f"n: expected a finite number > 1, got {n!r}")
    X2 = sqrt_n_sequence(A, R, 2, dtype=dtype)  # the two distinct tokens: x_1 and the repeated one
    log_w = torch.tensor([-math.log(n), math.log1p(-1.0 / n)], dtype=X2.dtype)
    return Measure(X2, log_weights=log_w)


def sqrt_n_witness_constant(A, R, n) -> float:
    """The local constant of Proposition 3.4's witness of n tokens (V = I_d) to leading order.

    With q = exp(-2 gamma R^2), b = 1 / (1 + (n - 1) q) the attention each repeated token pays to
    the first one, and c = 1 + 2 gamma R^2 (1 - b):

    * case "min": ``sqrt(n - 1) b c``;
    * case "max": ``sqrt((n - 1) b^2 c^2 + 1)``.

    Derivation (docs/math.md sections 4.1 and 5.3): move the first token along u by e. Each of
    the n - 1 others moves by ``b e`` through the value term (Proposition 3.4's bound is these
    moves alone, ``sqrt(n - 1) b``) and by ``2 gamma R^2 b (1 - b) e`` through the key term, in
    the same direction (A u = lambda u makes both parallel to u). In case "max" the first token
    attends to itself and moves by e as well (a separate output row, hence the ``+ 1`` under the
    root); in case "min" it attends to the others and hardly moves. Other directions couple to
    this one only at second order in the leaked attention. So Lip / bound = c (case "min") and
    the witness reaches Proposition 3.4's bound up to this factor.

    ``A`` is the matrix, or a :class:`meanfield.bounds.GammaInfo` already computed. ``n`` is a real
    >= 1 (the two-atom family of :func:`sqrt_n_measure` interpolates between integers). The form
    holds while (n - 1) q is of order one or less (the sqrt(n) regime and the transition, up to
    the peak); compared with dense Jacobians its relative error stayed below
    ``2 q (1 + gamma R^2)^2`` (dimensions 3 to 7, n from 2 to exp(2 gamma R^2)). At
    ``n = exp(2 gamma R^2)`` it gives Proposition 3.6's correction factor
    (:func:`meanfield.bounds.two_dirac_ratio_from_gamma`).
    """
    case, m, t, b, c = _witness_terms(A, R, n)
    if case == "min":
        return math.sqrt(m) * b * c
    return math.sqrt(m * b * b * c * c + 1.0)


def sqrt_n_witness_factor(A, R, n) -> float:
    """The predicted ratio of the witness's constant to Proposition 3.4's bound: ``c`` in case "min",
    ``sqrt(c^2 + 1 / ((n - 1) b^2))`` in case "max" (notation of :func:`sqrt_n_witness_constant`;
    ``math.inf`` at n = 1, where the bound is 0). It is computed from gamma, R and n alone, without
    Proposition 3.4's formula, so that comparing it with the measured ratio tests that formula too."""
    case, m, t, b, c = _witness_terms(A, R, n)
    if case == "min":
        return c
    return math.inf if m == 0.0 else math.sqrt(c * c + 1.0 / (m * b * b))


def _witness_terms(A, R, n):
    info = A if isinstance(A, GammaInfo) else gamma_info(A)
    g = _gamma_value(info.gamma)
    R = check_radius(R, "R")
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or n < 1:
        raise ValueError(f"n: expected a finite number >= 1, got {n!r}")
    m = float(n) - 1.0
    t = g * R * R
    b = 1.0 / (1.0 + m * math.exp(-2.0 * t))
    return info.case, m, t, b, 1.0 + 2.0 * t * (1.0 - b)
