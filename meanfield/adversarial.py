"""Adversarial inputs of *How Smooth Is Attention?*: the witnesses of the lower bounds.

* :func:`sqrt_n_sequence`: Proposition 3.4, Lip >= sqrt(n-1) / (1 + (n-1) e^{-2 gamma R^2});
* :func:`sqrt_n_witness_constant`, :func:`sqrt_n_witness_factor`,
  :func:`sqrt_n_witness_singular_values`: the constant the witness of Proposition 3.4 actually has
  (in closed form, exact), its ratio to the bound, and the Jacobian's whole spectrum there;
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

from particles import Measure, into_ball
from particles.validation import check_bool, check_positive_int, check_radius, check_seed, resolve_dtype, scalar

from .bounds import GammaInfo, argmax_indices, gamma_info, sqrt_n_lower, two_dirac_lower
from .bounds.numerics import _exp_or_inf, _gamma_value, _square

__all__ = ["WitnessInfo", "large_radius_configuration", "sqrt_n_measure", "sqrt_n_sequence",
           "sqrt_n_sequence_from_info", "sqrt_n_witness_constant", "sqrt_n_witness_factor",
           "sqrt_n_witness_singular_values", "two_dirac", "zero_plus_spread"]


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
    X = sqrt_n_sequence_from_info(info, R, n, dtype=dtype)
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
    a, r = _witness_radii(info, R)
    x0, x1 = into_ball(torch.stack((a * u, r * u)), R)
    kw = {"positions": torch.ones(2, dtype=dt)} if _bool(positions, "positions") else {}
    mu = Measure.two_dirac(x0, x1, log_p=-2.0 * info.gamma * R * R, dtype=dt, **kw)
    if not _bool(return_info, "return_info"):
        return mu
    # the info's bound is inf beyond float64 (its logarithm: bounds.two_dirac_lower(A, R, log=True))
    return mu, _witness(info, _exp_or_inf(two_dirac_lower(A, R, log=True)))


def large_radius_configuration(A, *, n, R=1.0, masked: bool = False, hub: int = 0, dtype=None) -> torch.Tensor:
    """A direction X (n, d), ``max_i |x_i| = R``, where every token attends to the same token ``hub``:
    m_i = argmax_j <A x_i, x_j> = hub for all i (Theorem 3.7; j <= i and hub = 0 when ``masked``,
    Theorem 4.5). Then Lip_{tX}(f) -> ||V||_2 sqrt(n) as t -> inf, the largest large-radius limit.

    Construction, with w a unit vector and q = <A w, w>: if q > 0 the others are t_k w with
    distinct t_k in [1/2, 3/4] (the hub has t = 1); if q < 0 they have t_k in [5/4, 3/2]; if A is
    skew-symmetric (q = 0 for every w) they are ``w - a_k A w / |A w|`` with distinct a_k in
    [1/2, 1]. Each case makes the hub the strict, unique maximizer of every row (checked).

    ``n`` and ``R`` are keywords (``large_radius_configuration(A, n=8, R=2.0)``): the other builders and the bounds
    take ``(A, R, n)``, and this one took ``(A, n, R)``, so that two integers given in the usual order built n = R
    tokens at radius n without a word.
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
    return into_ball(torch.as_tensor(X, dtype=_dtype(dtype)), R)


def zero_plus_spread(R, n, d, *, seed=None, dtype=None) -> torch.Tensor:
    """Appendix C.7 (after Kim et al. 2021): token 0 at the origin, the n - 1 others at radius R.

    The origin's softmax row is uniform, so its Jacobian block contains the empirical covariance of
    the tokens (times A and V), which grows like R^2: dot-product attention is not globally
    Lipschitz. Without ``seed`` the others are evenly spread on the circle of the first two
    coordinates (d >= 2; +-R alternating when d = 1, centred when n - 1 is even); with ``seed``
    (an integer, or a CPU torch.Generator, which is advanced) they are i.i.d. uniform on the sphere of
    radius R. Any other seed (a float, a string) is a TypeError: nothing is truncated.
    """
    R = check_radius(R, "R")
    n = check_positive_int(n, "n", minimum=2)
    d = check_positive_int(d, "d")
    seed = check_seed(seed, "seed")
    dt = _dtype(dtype)
    X = torch.zeros(n, d, dtype=torch.float64)
    if seed is not None:
        g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
        if g.device.type != "cpu":
            raise ValueError(f"seed: expected a CPU torch.Generator (the tokens are drawn on the CPU), got one on "
                             f"{g.device}")
        Z = torch.randn(n - 1, d, generator=g, dtype=torch.float64)
        X[1:] = R * Z / Z.norm(dim=1, keepdim=True)
    elif d == 1:
        X[1:, 0] = R * torch.tensor([(-1.0) ** k for k in range(n - 1)], dtype=torch.float64)
    else:
        theta = 2.0 * math.pi * torch.arange(n - 1, dtype=torch.float64) / (n - 1)
        X[1:, 0], X[1:, 1] = R * torch.cos(theta), R * torch.sin(theta)
    return into_ball(X.to(dt), R)


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
    a, r = _witness_radii(info, R)
    return into_ball(torch.cat([a * u[None, :], (r * u)[None, :].expand(n - 1, -1)], dim=0), R).contiguous()


def sqrt_n_measure(A, R, n, *, dtype=None) -> Measure:
    """Proposition 3.4's witness of n tokens as the two-atom measure it is: weight 1/n on the first
    token, (n - 1)/n on the repeated one (docs/math.md section 2: a sequence is the uniform measure
    on its tokens, and repeated tokens merge).

    Two atoms for any n, so the constant of the witness family is computable for n up to 10^15 and
    beyond; ``n`` may be any real > 1 (integer n gives the measure of a sequence; other n
    interpolate the family), a Python integer even beyond the float range (10**400: the first
    atom's log-weight -log n is still exact, its weight underflows to 0 in the dtype). The weights
    are stored as log-weights ``(-log n, log1p(-1/n))``.
    """
    n = scalar(n, "n")
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Real):
        raise ValueError(f"n: expected a finite number > 1, got {n!r}")
    if isinstance(n, numbers.Integral):
        n = int(n)
        if n <= 1:
            raise ValueError(f"n: expected a finite number > 1, got {n!r}")
        inv = 1 / n            # exact integer division, correctly rounded: 0.0 beyond the float range
    else:
        n = float(n)
        if not math.isfinite(n) or not n > 1:
            raise ValueError(f"n: expected a finite number > 1, got {n!r}")
        inv = 1.0 / n
    X2 = sqrt_n_sequence(A, R, 2, dtype=dtype)  # the two distinct tokens: x_1 and the repeated one
    log_w = torch.tensor([-math.log(n), math.log1p(-inv)], dtype=X2.dtype)
    return Measure(X2, log_weights=log_w)


def sqrt_n_witness_singular_values(A, R, n, *, of: str = "sequence") -> np.ndarray:
    """The distinct singular values of the Jacobian of self-attention (V = I_d) at Proposition 3.4's
    witness, in closed form, largest first (values equal to 1e-12 relative are merged; multiplicities
    are not given).

    ``of="sequence"``: the witness of n tokens (:func:`sqrt_n_sequence`, integer n >= 1), the
    Euclidean Jacobian. ``of="measure"``: the two-atom measure (1/n, (n - 1)/n) of
    :func:`sqrt_n_measure` (any real n >= 1), the Jacobian in the W2 sense (atom moves weighted by
    their masses). ``A`` is the matrix, or a :class:`meanfield.bounds.GammaInfo` that carries
    ``transpose_image`` (all those the framework builds do).

    Derivation (docs/math.md section 5.3). Write the first token a u and the n - 1 copies r u
    ((a, r) = (R, R/2) in case "max", (-R, R) in case "min"), w = A^T u, b (the attention a copy pays
    to the first token) and p (the first token's attention to itself) the logistic weights of the
    score gaps (a - r) r lambda and (a - r) a lambda against log(n - 1). Moving the first token by e,
    every copy by f and the copies apart by g_c (sum 0), the output moves exactly (first order) by

    * first token: ``p e + (1 - p) f + p (1 - p) (a - r) u [a lambda u.(e - f) + (a - r) w.e]``;
    * each copy: ``b e + (1 - b) f + b (1 - b) (a - r) u [r lambda u.(e - f) + (a - r) w.(f + g_c)]``.

    The moves g_c (n >= 3 tokens) form their own block, of singular value ``b (1 - b) (a - r)^2 |w|``;
    (e, f) with the copies' rows scaled by sqrt(n - 1) leave span(u, w) and its complement invariant:
    a 4 x 4 (or 2 x 2 when w is parallel to u) matrix and, on the complement, the value-only
    2 x 2 matrix ``[[p, (1 - p)/sqrt(n - 1)], [sqrt(n - 1) b, 1 - b]]``. Nothing is neglected:
    against dense Jacobians (dimensions 3 to 7, normal and strongly non-normal A, R up to 3, n from
    1 to 100, and the measure up to n = 1e12) the two agree to 1e-13 (tests/meanfield/test_predicted_forms.py;
    an independent review went to dimensions 1 to 6, R from 0.1 to 100 and measures up to n = 1e18).
    """
    info, d = _witness_info(A)
    seq = _witness_of(of)
    n = scalar(n, "n")
    if seq:
        n = _token_count(n)
    elif isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise ValueError(f"n: expected a finite number >= 1, got {n!r}")
    try:
        m = float(n) - 1.0
    except OverflowError:
        raise ValueError(f"n: expected a number a float can hold, got one with {len(str(n))} digits") from None
    if not seq and not (math.isfinite(m) and m >= 0.0):
        raise ValueError(f"n: expected a finite number >= 1, got {n!r}")
    R = check_radius(R, "R")
    if m == 0.0:
        return np.ones(1)          # one token: f(x) = x
    lam = float(info.eigenvalue)
    u = np.asarray(info.eigenvector, dtype=np.float64)
    w = np.asarray(info.transpose_image, dtype=np.float64)
    a, r, zb = _copy_attention(info, R, m)
    s = math.sqrt(m)
    # logistic weights from their log-odds (1 - b without cancellation); p: the first token's on itself
    zp = (a - r) * a * lam - math.log(m)
    b, nb = _expit(zb), _expit(-zb)
    p, np_ = _expit(zp), _expit(-zp)
    kb, kp = b * nb * (a - r), p * np_ * (a - r)
    w_perp = w - lam * u
    basis = [u]
    if np.linalg.norm(w_perp) > 1e-14 * (abs(lam) + np.linalg.norm(w)):
        basis.append(w_perp / np.linalg.norm(w_perp))
    E = np.stack(basis, axis=1)
    I = np.eye(E.shape[1])
    uu = np.outer(E.T @ u, E.T @ u)
    uw = np.outer(E.T @ u, E.T @ w)
    T = np.block([[p * I + kp * (a * lam * uu + (a - r) * uw), np_ / s * I - kp * a * lam * uu / s],
                  [s * b * I + kb * r * lam * s * uu, nb * I - kb * r * lam * uu + kb * (a - r) * uw]])
    values = list(np.linalg.svd(T, compute_uv=False))
    if d > E.shape[1]:
        values += list(np.linalg.svd(np.array([[p, np_ / s], [s * b, nb]]), compute_uv=False))
    if seq and n >= 3:
        values.append(kb * (a - r) * float(np.linalg.norm(w)))   # kb first: no overflow where b (1 - b) is 0
    values = sorted(values, reverse=True)
    distinct = [values[0]]
    for v in values[1:]:
        if distinct[-1] - v > 1e-12 * values[0]:
            distinct.append(v)
    return np.array(distinct)


def sqrt_n_witness_constant(A, R, n, *, of: str = "sequence") -> float:
    """The local Lipschitz constant of Proposition 3.4's witness (V = I_d), exactly: the largest of
    :func:`sqrt_n_witness_singular_values` (same arguments; ``of="measure"`` for the two-atom
    measure of :func:`sqrt_n_measure` at any real n >= 1).

    Where (n - 1) e^{-2 gamma R^2} is small and A is normal it reduces to the simple forms
    ``sqrt(n - 1) b c`` (case "min") and ``sqrt((n - 1) b^2 c^2 + 1)`` (case "max"), with
    ``b = 1 / (1 + (n - 1) e^{-2 gamma R^2})`` and ``c = 1 + 2 gamma R^2 (1 - b)``: the copies move by
    b through the value term and by ``2 gamma R^2 b (1 - b)`` through the key term. For a non-normal
    A (trained heads: A^T u far from lambda u) the copies' queries add the term in w = A^T u, and near
    the transition the constant can be 2.5 times the simple form (MiniLM, docs/math.md section 5.3).
    At ``n = exp(2 gamma R^2)`` the measure's constant over Proposition 3.6's asymptotic value tends
    to the correction factor :func:`meanfield.bounds.two_dirac_ratio_from_gamma`.
    """
    return float(sqrt_n_witness_singular_values(A, R, n, of=of)[0])


def sqrt_n_witness_factor(A, R, n, *, of: str = "sequence") -> float:
    """The ratio of the witness's constant (:func:`sqrt_n_witness_constant`) to Proposition 3.4's bound,
    ``math.inf`` at n = 1 (where the bound is 0). The bound's value sqrt(n - 1) b is formed here from
    the eigenvalue and the witness's geometry (b from the score gap (a - r) r lambda), not from
    gamma and Proposition 3.4's formula, so that a measured constant over the formula's bound,
    compared with this factor, tests the formula as well as the witness."""
    info, _ = _witness_info(A)
    value = sqrt_n_witness_constant(info, R, n, of=of)
    m = float(n) - 1.0
    if m == 0.0:
        return math.inf
    _, _, zb = _copy_attention(info, check_radius(R, "R"), m)
    return value / (math.sqrt(m) * _expit(zb))


def _witness_radii(info: GammaInfo, R: float) -> tuple[float, float]:
    """(a, r): the witnesses' first token is a u and the other(s) r u: (R, R/2) in case "max", (-R, R) in
    case "min" (Propositions 3.4 and 3.6)."""
    return (R, R / 2.0) if info.case == "max" else (-R, R)


def _copy_attention(info: GammaInfo, R: float, m: float) -> tuple[float, float, float]:
    """The witness's geometry (:func:`_witness_radii`) and the log-odds of b, the attention a copy pays to the
    first token: b = 1 / (1 + m e^{-(a - r) r lambda}) with m = n - 1 copies."""
    a, r = _witness_radii(info, R)
    return a, r, (a - r) * r * float(info.eigenvalue) - math.log(m)


def _expit(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def _witness_of(of) -> bool:
    if of not in ("sequence", "measure"):
        raise ValueError(f"of: expected 'sequence' or 'measure', got {of!r}")
    return of == "sequence"


def _token_count(n) -> int:
    if isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1:
        return int(n)
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or n < 1 or n != int(n):
        raise ValueError(f"n: expected a whole number of tokens >= 1 for of='sequence', got {n!r} (use "
                         "of='measure' for the two-atom measure at real n)")
    return int(n)


def _witness_info(A) -> tuple[GammaInfo, int]:
    info = A if isinstance(A, GammaInfo) else gamma_info(A)
    _gamma_value(info.gamma)
    if info.eigenvector is None or info.gamma == 0.0:
        raise ValueError("A: gamma = 0 (every real eigenvalue is 0), so Proposition 3.4 gives no witness")
    if info.transpose_image is None:
        raise ValueError("A: this GammaInfo has no transpose_image (A^T u), which the witness's constant needs; "
                         "pass the matrix, or a record from meanfield.bounds.gamma_info / gamma_info_factored")
    return info, int(np.asarray(info.eigenvector).shape[0])
