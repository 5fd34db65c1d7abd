"""Multi-head layers and biases: Lemma 3.8 over heads, the bias-augmented heads and the lift that absorbs a key bias
(docs/math.md section 5.6)."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from particles.validation import as_tensor, check_positive_float, check_positive_int, check_radius

from .eigen import _factored_norm
from .numerics import _exp_or_inf, _heads_tensor, _matrix, _square

__all__ = ["multihead_upper", "augmented_head_norms", "biased_multihead_upper", "absorb_key_bias"]


def multihead_upper(head_lips, W_O) -> float:
    """Lemma 3.8: ``Lip(f_MH) <= ||W_O||_2 (sum_h Lip(f^h)^2)^{1/2}`` for f_MH = W_O concat_h f^h.

    ``head_lips`` are per-head Lipschitz constants (local values at one X or bounds on a set; the
    result is then of the same kind). An output bias does not change the constant.
    """
    lips = as_tensor(head_lips, "head_lips", dtype=torch.float64).detach().cpu()
    if lips.dim() != 1:
        raise ValueError(f"head_lips: expected a list of per-head constants (1-D), got shape {tuple(lips.shape)}")
    lips = lips.numpy()
    if lips.size == 0:
        raise ValueError("head_lips: expected at least one per-head constant")
    if (lips < 0).any():
        raise ValueError(f"head_lips: Lipschitz constants must be non-negative (min is {lips.min():.3g})")
    w = _matrix(W_O, "W_O")
    if w.shape[1] < lips.size:
        # W_O maps the concatenated head outputs, at least one column per head
        raise ValueError(f"W_O: has {w.shape[1]} column(s), fewer than the {lips.size} heads of head_lips (W_O maps "
                         "the concatenation of the heads' outputs: one column per output feature of every head)")
    return float(np.linalg.norm(w, 2) * math.sqrt(float(np.sum(lips * lips))))


def augmented_head_norms(Q, K, V, b_Q=None, b_V=None, scale=1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(||A'_h||_2, ||V'_h||_2)`` for every head of a layer with biases, as arrays of length H.

    Head h scores ``scale <Q_h x_i + b_Q, K_h x_j + b_K>`` and values ``V_h x_j + b_V`` (Q_h, K_h of
    shape (k, d), V_h (k_v, d); Q, K, V of shape (H, k, d) or one head (k, d)). Terms constant in j
    leave the softmax unchanged, so with x' = (x, 1) the head is self-attention with
    ``A'_h = scale [K_h^T; 0] [Q_h, b_Q]`` and ``V'_h = [V_h, b_V]`` on (d+1)-dimensional tokens of
    radius sqrt(R^2 + 1): Theorems 3.3 / 4.3 apply with these norms (:func:`biased_multihead_upper`).
    With the reduced QR factorization K_h^T = U T (U with orthonormal columns),
    ``||A'_h|| = |scale| ||T [Q_h, b_Q]||``, a min(k, d) x (d+1) matrix (``_factored_norm``): no d x d
    matrix, and no condition on K_h (a pruned, zero key unit, or k > d, is fine). ``b_K`` does not
    enter. Missing biases are zero.

    This is the lift of :func:`absorb_key_bias` at t = 1, in factored form (no d x d matrix is
    formed, which keeps it cheap for every head of every layer of a real model), with b_V kept in
    V'. :func:`~meanfield.operator_upper` is tighter: it picks the best t per head and drops b_V, which adds a
    constant to the output and changes no Lipschitz constant. Use this pair for a quick bound of many
    layers; use :func:`~meanfield.operator_upper` for the best bound of one operator.
    """
    Qh, Kh, Vh = (_heads_tensor(M, name, 3) for M, name in ((Q, "Q"), (K, "K"), (V, "V")))
    H, k, d = Qh.shape
    if Kh.shape != Qh.shape or Vh.shape[0] != H or Vh.shape[2] != d:
        raise ValueError(f"Q, K, V: expected Q and K of the same shape and V with {H} heads of width {d}, got "
                         f"{tuple(Qh.shape)}, {tuple(Kh.shape)}, {tuple(Vh.shape)}")
    bQ = torch.zeros(H, k, dtype=Qh.dtype, device=Qh.device) if b_Q is None else _heads_tensor(b_Q, "b_Q", 2)
    bV = (torch.zeros(H, Vh.shape[1], dtype=Vh.dtype, device=Vh.device) if b_V is None
          else _heads_tensor(b_V, "b_V", 2))
    if bQ.shape != (H, k) or bV.shape != (H, Vh.shape[1]):
        raise ValueError(f"b_Q, b_V: expected shapes {(H, k)} and {(H, Vh.shape[1])}, got {tuple(bQ.shape)} and "
                         f"{tuple(bV.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale: expected a finite real number, got {scale!r}")
    a = abs(scale) * _factored_norm(Kh, torch.cat([Qh, bQ[:, :, None]], 2))
    v = torch.linalg.matrix_norm(torch.cat([Vh, bV[:, :, None]], 2), ord=2)
    return a.cpu().numpy().astype(np.float64), v.cpu().numpy().astype(np.float64)


def biased_multihead_upper(a_norms, v_norms, w_norm, R, n) -> float:
    """Lemma 3.8 with Theorem 3.3 / 4.3 per bias-augmented head: an upper bound on the Lipschitz
    constant of a multi-head layer with biases on sequences of n tokens of norm at most R,
    ``||W_O||_2 (sum_h 3 ||V'_h||^2 (||A'_h||^2 R'^4 (4n + 1) + n))^{1/2}`` with ``R'^2 = R^2 + 1``.

    ``a_norms``, ``v_norms``: the per-head norms of :func:`augmented_head_norms` (finite, >= 0);
    ``w_norm``: ``||W_O||_2`` (finite, >= 0). The output bias does not change the constant. Evaluated
    in logarithms, like :func:`~meanfield.bounds.sqrt_n_upper`: never NaN, and ``math.inf`` (with a
    :class:`~meanfield.bounds.BoundOverflowWarning`) only when the bound exceeds the float64 range.
    """
    a = as_tensor(a_norms, "a_norms", dtype=torch.float64).detach().cpu().numpy()
    v = as_tensor(v_norms, "v_norms", dtype=torch.float64).detach().cpu().numpy()
    if a.ndim != 1 or a.shape != v.shape or a.size == 0 or (a < 0).any() or (v < 0).any():
        raise ValueError(f"a_norms, v_norms: expected two non-empty lists of norms >= 0 of the same length, got "
                         f"shapes {a.shape} and {v.shape}")
    w_norm = check_positive_float(w_norm, "w_norm", allow_zero=True)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    # head h squared: 3 ||V'||^2 (||A'||^2 R'^4 (4n + 1) + n), R'^2 = R^2 + 1; n may exceed the float range
    log_R2, log_n, log_4n1 = math.log1p(R * R), math.log(n), math.log(4 * n + 1)
    logs = []
    for ah, vh in zip(a.tolist(), v.tolist()):
        if vh == 0.0:
            continue
        inner = log_n if ah == 0.0 else float(np.logaddexp(2 * math.log(ah) + 2 * log_R2 + log_4n1, log_n))
        logs.append(math.log(3.0) + 2 * math.log(vh) + inner)
    if not logs or w_norm == 0.0:
        return 0.0
    top = max(logs)
    log_sum = top + math.log(sum(math.exp(t - top) for t in logs))
    return _exp_or_inf(math.log(w_norm) + 0.5 * log_sum, "biased_multihead_upper")


def absorb_key_bias(A, c, R) -> tuple[np.ndarray, float, float]:
    """Absorb a key bias into the score matrix by lifting tokens to one more coordinate.

    Scores with a key bias, ``<A x_i, x_j> + <c, x_j>`` (what a query bias b_Q becomes,
    docs/math.md section 1), equal plain scores ``<A' x'_i, x'_j>`` of the lifted tokens
    ``x' = (x, t)`` with

        A' = [[A, c / t], [0, 0]]   ((d+1) x (d+1)),     ``|x'|`` <= R' = (R^2 + t^2)^{1/2} on B_R,

    for every t > 0. The lift moves no token (the last coordinate is the constant t), so a perturbation
    of X is the same perturbation of X' and every Lipschitz bound for (A', R') holds with the key bias
    (values are lifted as V' = [V, 0], with ||V'||_2 = ||V||_2). Theorems 3.3 and 3.5 depend on A and R
    only through ||A||_2 R^2, so t is chosen to minimize ``||[A, c/t]||_2 (R^2 + t^2)``: a grid in
    log t, refined by a bounded scalar search; any t would give a valid bound.

    Returns
    -------
    tuple
        (A', R', t); for c = 0 (or None) the lift is skipped: (A, R, 0.0).
    """
    a = _square(A)
    R = check_radius(R, "R")
    if c is None:
        return a, R, 0.0
    cv = as_tensor(c, "c", dtype=torch.float64).detach().cpu().numpy().reshape(-1)
    if cv.shape[0] != a.shape[0]:
        raise ValueError(f"c: expected {a.shape[0]} entries to match A of shape {a.shape}, got {cv.shape[0]}")
    d = a.shape[0]
    if not np.any(cv):
        return a, R, 0.0
    if R == 0.0:
        # on B_0 = {0}: the key-bias term has no effect at X = 0, and the lift's optimum is t -> 0
        return np.pad(a, ((0, 1), (0, 1))), 0.0, 0.0
    # ||[A, c/t]||_2^2 = lambda_max(A A^T + c c^T / t^2): a rank-one update of a fixed matrix, whose
    # top eigenvalue is the root above lambda_1 of the secular equation 1 + sum w_i^2 / (lambda_i - x) = 0
    # t's optimum is unchanged when A and c are scaled together: the secular equation runs on A / s and c / s
    # (their squares overflowed for entries above about 1e154, leaving t 1e5 times off)
    s = max(float(np.abs(a).max()), float(np.abs(cv).max()))
    lam, U = np.linalg.eigh((a / s) @ (a / s).T)
    lam = np.clip(lam, 0.0, None)
    w2 = (U.T @ (cv / s)) ** 2

    def top(t: float) -> float:
        w = w2 / (t * t)
        lo, hi = float(lam[-1]), float(lam[-1] + w.sum())
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            gap = lam - mid
            if mid <= lo or mid >= hi:
                break
            if 1.0 + float(np.sum(w / gap)) < 0:   # below the root
                lo = mid
            else:
                hi = mid
        return hi

    def phi(log_t: float) -> float:
        t = math.exp(log_t)
        # log(R^2 + t^2) through hypot: R * R overflowed from R of about 1.3e154, and the lifted radius with it
        return 0.5 * math.log(top(t)) + 2.0 * math.log(math.hypot(R, t))

    grid = np.log(R) + np.linspace(-12.0, 12.0, 97)
    vals = [phi(float(s)) for s in grid]
    k = int(np.argmin(vals))
    from scipy.optimize import minimize_scalar

    lo_s, hi_s = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    res = minimize_scalar(phi, bounds=(float(lo_s), float(hi_s)), method="bounded",
                          options={"xatol": 1e-10})
    log_t = float(res.x) if res.fun <= vals[k] else float(grid[k])
    t = math.exp(log_t)
    lifted = np.zeros((d + 1, d + 1))
    lifted[:d, :d] = a
    lifted[:d, d] = cv / t
    return lifted, math.hypot(R, t), t
