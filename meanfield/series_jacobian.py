"""The certified local constant through the series engine: the Jacobian of the truncated series and a proved bound
on its distance to the exact Jacobian (docs/math.md section 4.8).

``local_lipschitz(op, X, attention="series")`` runs the matrix-free solvers on the Jacobian J~ of the map whose
exponentials are Taylor polynomials of degree K (:mod:`meanfield.series_attention`): each product costs
O(N M) instead of O(N^2), in O(N) memory. Weyl's inequality then carries the certificate over to the exact
Jacobian J: every singular value of J lies within ``||J~ - J||`` of the matching one of J~, and
:func:`truncation_bound` bounds that operator norm (in the norm of the estimate: Euclidean for sequences, the W2
sense of Lemma C.5 for measures) by::

    eps_J = alpha e^{(2 r + beta_c) / 2} + beta,
    alpha = eta0 ||V|| + gamma1 Q ||K|| + gamma0 |c|,   beta = gamma1 R ||Q||,

with, for SelfAttention's q = Q x, k = K x (K = I for a score matrix A), v = V x and key bias c:
r = max_i ``|q_i|`` max_j ``|k_j - k0|`` (the centred scores, k0 the keys' box midpoint), Q = max_i ``|q_i|``,
R = max_j ``|k_j - k0|``, V = max_j ``|v_j - v0|`` (v0 the values' box midpoint), beta_c the spread of <c, x_j> over the
keys, delta_p = e^r tau_p(r) (:func:`meanfield.series_attention.tail_bound`), eta0 = 2 delta_K / (1 - delta_K),
eta1 = (delta_K + delta_{K-1}) / (1 - delta_K), gamma1 = (2 eta1 + (1 + eta1) eta0) V and
gamma0 = (2 eta0 + (1 + eta0) eta0) V. The proof (docs/math.md section 4.8): T_K(s) = e^s (1 + eps) and
T_K'(s) = T_{K-1}(s) = e^s (1 + eps') with ``|eps| <= delta_K`` and ``|eps'| <= delta_{K-1}`` on [-r, r], so every
weight, derivative weight and output of the series is within a relative eta of the exact one; the error of the
Jacobian applied to u at row i is then at most alpha sum_j P_ij ``|u_j|`` + beta ``|u_i|``, and the row-stochastic
P with P_ij <= w_j e^{2 r + beta_c} has norm at most e^{(2 r + beta_c) / 2} on L2(w).

:func:`degree` takes the smallest K whose eta's are below the machine epsilon of float64, so eps_J is 1e-15 to
1e-12 of the operator's scale (the larger with key biases and r near the limit): the certificate's error grows by
2 eps_J and its value drops by eps_J. eps_J covers the truncation, not the products' rounding, as the exact path's
certificate does not: ``value`` is a lower bound of the exact constant up to that rounding, which in the series
grows like e^{2 r} (r <= :data:`MAX_RADIUS`: up to 2e5 epsilons; a review measured the distance of the two
Jacobians at the default degree up to 1e-14 of their norm), far below a certificate's tolerance.
"""

from __future__ import annotations

import math

import torch

from . import series_attention as series

__all__ = ["degree", "truncation_bound", "supports", "preferred", "auto_degree", "product_cost", "MAX_RADIUS",
           "DENSE_PASSES", "SERIES_THRESHOLD", "COST_RATIO", "ROW_DEGREE_COST"]

#: the largest r = max ``|q|`` max ``|k - k0|`` the certified series takes (its rounding grows like e^{2 r}: 2e5 times
#: float64's epsilon here, against a certificate's tolerance of 1e-6 and above)
MAX_RADIUS = 6.0


def supports(op) -> str | None:
    """None where the series' certificate covers ``op`` (an unmasked :class:`~meanfield.SelfAttention`), else why
    not."""
    from .attention import SelfAttention

    if type(op) is not SelfAttention:
        return (f"the series' truncation bound covers SelfAttention operators, not {type(op).__name__}; use "
                "attention='exact'")
    if op.masked:
        return "a causal mask does not factor through the series' features; use attention='exact'"
    return None


#: Score entries above which ``local_lipschitz(attention="auto")`` considers the series on the CPU (N of about 2050;
#: the cost model decides above it); :data:`meanfield.kernels.SERIES_THRESHOLD_ACCELERATOR` off the CPU. Measured on 2
#: CPU cores since the kernel sums' faster products (benchmarks/README.md), series against exact: the disc of
#: radius 1.5 in d = 2 (degree 36) 1.0x at 2000, 1.1x at 3000, 1.7x at 4000, 4.2x at 6000; sphere tokens in d = 3
#: 1.0x at about 2400 (r = 0.9, degree 18), 5000 (r = 1.3, degree 21) and 5500 (r = 2, degree 25). With
#: :func:`product_cost` and :data:`COST_RATIO` auto takes the series from about 2900 points on the disc and from 4400,
#: 6400 and 10000 on the sphere: never where it was measured slower. It was 2^26 (N of about 8200)
SERIES_THRESHOLD = 2**22

#: ``local_lipschitz(attention="auto")`` takes the series where :func:`product_cost` is at most this fraction of the
#: exact path's product (:data:`DENSE_PASSES` dense passes): with the model's per-row overhead the measured break-even
#: points lie at ratios of 0.6-0.9 (2 CPU cores), so 0.5 keeps a margin
COST_RATIO = 0.5


def auto_degree(op, X, log_weights=None) -> int | None:
    """The degree (:func:`degree`) at which ``local_lipschitz(attention="auto")`` runs its products through the series
    at X (b, n, d), or None where it keeps the exact path. The series where: an operator
    it covers (:func:`supports`), float64 points, more than :data:`SERIES_THRESHOLD` score entries
    (:data:`~meanfield.kernels.SERIES_THRESHOLD_ACCELERATOR` off the CPU), r within :data:`MAX_RADIUS`, and a
    Jacobian product through the series at the certificate's degree (:func:`product_cost`) at most
    :data:`COST_RATIO` of the exact path's (:data:`DENSE_PASSES` dense passes). One O(n) pass over X where the first
    conditions hold. Measured on 2 CPU cores (:data:`SERIES_THRESHOLD`): the disc of radius 1.5 in d = 2 (r = 4.4)
    at ratio 0.47 (N = 3000) 1.1x faster, at 0.23 (6000) 4.2x; sphere tokens in d = 3 at r = 0.9 and ratio 0.36
    (6000) 2.5x, at 0.72 (3000, left exact) 1.3x; at r = 1.3 and ratio 0.53 (6000, left exact) 1.1x."""
    from . import kernels

    if supports(op) is not None or X.dtype != torch.float64:
        return None
    b, n, d = X.shape
    entries = b * n * n
    floor = SERIES_THRESHOLD if X.device.type == "cpu" else kernels.SERIES_THRESHOLD_ACCELERATOR
    if entries <= floor:
        return None
    e, c = op._Qf.shape[0], op._V.shape[0]
    dense = DENSE_PASSES * series.dense_cost(entries, e, c)
    if product_cost(b, n, e, c, 0) > COST_RATIO * dense:
        return None
    try:
        K = degree(op, X, log_weights)
    except (ValueError, FloatingPointError):
        return None
    return K if product_cost(b, n, e, c, K) <= COST_RATIO * dense else None


def preferred(op, X, log_weights=None) -> bool:
    """Whether ``local_lipschitz(attention="auto")`` takes the series at X (:func:`auto_degree`)."""
    return auto_degree(op, X, log_weights) is not None




#: a Jacobian product of the exact path costs about this many dense forward passes (the JVP and the VJP recompute
#: the scores and carry a tangent or a cotangent through them)
DENSE_PASSES = 3


#: The overhead of a Jacobian product through the series per row and degree, in multiply-adds. It is the cost of
#: building the features degree by degree in blocks of rows (small operations, whose fixed cost dominates where the
#: features are few). Fitted on one CPU thread at n = 3000 (sphere tokens, d = 2 to 6, degrees 15-20): with it
#: :func:`product_cost` over the exact path's came within 0.99-1.38x of the measured ratios (0.197 to 56), where d = 2
#: came out at 0.068, a third, without it
ROW_DEGREE_COST = 780


def product_cost(b: int, n: int, e: int, c: int, K: int) -> int:
    """Multiply-adds of one Jacobian product through the series of degree K (a J u or a J^T w): per row and feature
    one product to build it and, in the sums, the c + 1 values and the e (c + 1) values of the degree K - 1 sums
    twice (the tangent's, or the backward pass's two sides): 1 + (c + 1)(1 + 2 e); plus :data:`ROW_DEGREE_COST` per
    row and degree."""
    return b * (2 * n * series.feature_count(e, K) * (1 + (c + 1) * (1 + 2 * e)) + ROW_DEGREE_COST * n * K)


def _quantities(op, X, log_weights):
    """Per batch member (tensors (b,)): r, Q, R, V, beta_c of the module docstring, at X (b, n, d)."""
    X = X.detach().to(torch.float64)
    Qf = op._Qf.detach().to(torch.float64)
    Kf = None if op._Kf is None else op._Kf.detach().to(torch.float64)
    q = X @ Qf.T
    k = X if Kf is None else X @ Kf.T
    v = X @ op._V.detach().to(torch.float64).T
    lw = None if log_weights is None else log_weights.detach().expand(X.shape[:-1])
    # the keys' box and radius as the series takes them (its centre k0), the values' alike
    R, Vr = series.box(k, lw)[1], series.box(v, lw)[1]
    Qmax = q.norm(dim=-1).amax(dim=-1)
    spread = torch.zeros_like(R)
    if op._c is not None:
        live = torch.ones(X.shape[:-1], dtype=torch.bool, device=X.device) if lw is None else lw != float("-inf")
        ck = X @ op._c.detach().to(torch.float64)
        far = torch.full((), math.inf, dtype=ck.dtype, device=ck.device)
        spread = torch.where(live, ck, -far).amax(dim=-1) - torch.where(live, ck, far).amin(dim=-1)
    return Qmax * R, Qmax, R, Vr, spread


def _norm2(t) -> float:
    return float(torch.linalg.matrix_norm(t.detach().to(torch.float64), 2)) if t is not None else 1.0


def degree(op, X, log_weights=None, *, tol=None) -> int:
    """The degree K the certified series runs at X (b, n, d): one above the smallest whose proved forward bound
    (:func:`meanfield.series_attention.error_bound`) at the largest r of the batch is at most ``tol`` (default
    float64's machine epsilon), so that the derivative's series (degree K - 1) meets it too. A ValueError where r
    exceeds :data:`MAX_RADIUS` or no degree up to :data:`meanfield.series_attention.MAX_DEGREE` reaches ``tol``."""
    tol = torch.finfo(torch.float64).eps if tol is None else tol
    r = float(_quantities(op, X, log_weights)[0].max())
    if not math.isfinite(r):
        raise FloatingPointError("X: the scores of this input are not finite")
    if r > MAX_RADIUS:
        raise ValueError(f"attention: the series needs r = max |q| max |k - k0| <= {MAX_RADIUS:g} (its rounding grows "
                         f"like e^(2 r)), got r = {r:.3g} at this input; use attention='exact'")
    for K in range(series.MAX_DEGREE):
        if series.error_bound(r, K) <= tol:
            return K + 1
    raise ValueError(f"attention: no series degree up to {series.MAX_DEGREE} reaches {tol:.3g} at r = {r:.3g}; use "
                     "attention='exact'")


def _etas(r: float, K: int) -> tuple[float, float]:
    """(eta0, eta1): bounds on the relative errors ``|p~_ij - p_ij| / p_ij`` of the series' weights and
    ``|rho_ij - p_ij| / p_ij`` of its derivative weights rho_ij = a_j T_{K-1}(s_ij) / sum_l a_l T_K(s_il), for
    centred scores in [-r, r] (inf where a delta reaches 1)."""
    d0 = math.exp(r) * series.tail_bound(r, K) if r > 0 else 0.0
    d1 = math.exp(r) * series.tail_bound(r, K - 1) if r > 0 else 0.0
    if d0 >= 1 or d1 >= 1:
        return math.inf, math.inf
    return 2 * d0 / (1 - d0), (d0 + d1) / (1 - d0)


def truncation_bound(op, X, log_weights=None, *, K: int) -> torch.Tensor:
    """eps_J (b,) of the module docstring: a bound on ``||J~ - J||`` at each batch member of X (b, n, d) for the
    series of degree K >= 1, in the norm of ``local_lipschitz``'s estimate (Euclidean for sequences, whose
    ``log_weights`` are None; L2 of the measure's weights otherwise). inf where a delta reaches 1."""
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"K: expected a degree >= 1 (the derivative has degree K - 1), got {K!r}")
    r, Qmax, R, V, spread = _quantities(op, X, log_weights)
    out = torch.empty_like(r)
    nQ, nK, nV = _norm2(op._Qf), _norm2(op._Kf), _norm2(op._V)
    nc = 0.0 if op._c is None else float(op._c.detach().to(torch.float64).norm())
    for i in range(r.shape[0]):
        ri = float(r[i])
        eta0, eta1 = _etas(ri, K)
        if not math.isfinite(eta0 + eta1):
            out[i] = math.inf
            continue
        Vi = float(V[i])
        gamma1 = (2 * eta1 + (1 + eta1) * eta0) * Vi
        gamma0 = (2 * eta0 + (1 + eta0) * eta0) * Vi
        alpha = eta0 * nV + gamma1 * float(Qmax[i]) * nK + gamma0 * nc
        beta = gamma1 * float(R[i]) * nQ
        out[i] = alpha * math.exp((2 * ri + float(spread[i])) / 2) + beta
    return out
