"""Independent ground truths for the tests, sharing no code with the library (nor with POT):
attention written out from its formulas (docs/math.md sections 1 and 5), dense Jacobians and their
top singular values, W2 as an assignment problem or a linear program solved by scipy, entropic OT by
a numpy Sinkhorn, and the paper's bounds typed in by hand."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment, linprog
from scipy.special import lambertw


def naive_attention(X, A, V, masked=False, log_weights=None, b_Q=None, positions=None):
    """f(X)_i = sum_j P_ij V x_j, P_ij = softmax_j(<A x_i, x_j> (+ log a_j)); causal if masked.

    ``b_Q`` (optional, (d,)) adds <b_Q-term, x_j>: the score becomes <A x_i + c, x_j> with c given.
    Masked: token i sees j <= i, or, with ``positions`` s, the atoms with s_j <= s_i.
    """
    n = X.shape[-2]
    S = (X @ A.T) @ X.transpose(-1, -2)
    if b_Q is not None:
        S = S + (X @ b_Q)[..., None, :]
    if log_weights is not None:
        S = S + log_weights
    if masked and positions is not None:
        S = S.masked_fill(positions[None, :] > positions[:, None], float("-inf"))
    elif masked:
        S = S.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    P = torch.softmax(S, dim=-1)
    return P @ X @ V.T


def dense_jacobian(f, X):
    """J of shape (numel(f(X)), numel(X)) by reverse-mode autograd, row by row."""
    J = torch.autograd.functional.jacobian(f, X)
    out_numel = int(np.prod(J.shape[: J.dim() - X.dim()]))
    return J.reshape(out_numel, X.numel())


def dense_lipschitz(f, X, weights=None):
    """Top singular value of D_X f (Euclidean) or of D^{1/2} J D^{-1/2} (weighted, Lemma C.5)."""
    J = dense_jacobian(f, X)
    if weights is not None:
        d_in = X.shape[-1]
        d_out = J.shape[0] // X.shape[0]
        s_in = torch.repeat_interleave(weights.sqrt(), d_in)
        s_out = torch.repeat_interleave(weights.sqrt(), d_out)
        J = s_out[:, None] * J / s_in[None, :]
    return float(torch.linalg.matrix_norm(J, ord=2))


def dense_jacobian_logweights(f, X, log_weights):
    """The weighted Jacobian D^{1/2} J D^{-1/2} of Lemma C.5 with the scalings formed from
    log-weights, entry by entry: J_ij sqrt(a_i / a_j) = J_ij exp((log a_i - log a_j) / 2)."""
    J = dense_jacobian(f, X)
    d_in = X.shape[-1]
    d_out = J.shape[0] // X.shape[0]
    lo = torch.repeat_interleave(log_weights, d_out)
    li = torch.repeat_interleave(log_weights, d_in)
    return J * torch.exp((lo[:, None] - li[None, :]) / 2)


def dense_lipschitz_logweights(f, X, log_weights):
    """Weighted (Lemma C.5) top singular value of :func:`dense_jacobian_logweights`. Stays finite where
    the weights themselves (or their square roots) leave the float64 range, as long as the constant
    does not."""
    Jw = dense_jacobian_logweights(f, X, log_weights)
    if not bool(torch.isfinite(Jw).all()):
        return float("inf")  # the constant itself is beyond float64
    return float(torch.linalg.matrix_norm(Jw, ord=2))


# ---------------------------------------------------------------------- attention variants, written out
def naive_qkv(X, Q, K, V, b_Q, b_K, b_V, masked=False):
    """softmax((X Q^T + b_Q)(X K^T + b_K)^T / sqrt(k)) (X V^T + b_V), written out directly."""
    q = X @ Q.T + b_Q
    k = X @ K.T + b_K
    S = q @ k.T / math.sqrt(Q.shape[0])
    if masked:
        S = S.masked_fill(torch.triu(torch.ones_like(S, dtype=torch.bool), 1), -math.inf)
    return torch.softmax(S, -1) @ (X @ V.T + b_V)


def naive_l2(X, WQ, WV, WO, masked=False):
    """Kim et al. (2021) L2 multi-head attention with tied W_Q = W_K, written from the paper:
    P^h = softmax_j(-|x_i^T W_Q^h - x_j^T W_Q^h|^2 / sqrt(k)), head output P^h X A_h W_V^h with
    A_h = W_Q^h W_Q^h^T / sqrt(k), heads concatenated, times W_O. WQ, WV: sequences of (D, k)."""
    outs = []
    for q, v in zip(WQ, WV):
        k = q.shape[1]
        Y = X @ q
        S = -((Y[:, None, :] - Y[None, :, :]) ** 2).sum(-1) / math.sqrt(k)
        if masked:
            S = S.masked_fill(torch.triu(torch.ones_like(S, dtype=torch.bool), 1), -math.inf)
        outs.append(torch.softmax(S, dim=-1) @ X @ (q @ q.T / math.sqrt(k)) @ v)
    return torch.cat(outs, dim=-1) @ WO


# ---------------------------------------------------------------------- Wasserstein distances
def _np(x):
    return x.detach().cpu().numpy().astype(np.float64) if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def w2_assignment(X, Y):
    """W2 between two uniform clouds of n points each: an assignment problem (Birkhoff's theorem)."""
    X, Y = _np(X), _np(Y)
    C = ((X[:, None, :] - Y[None, :, :]) ** 2).sum(-1)
    r, c = linear_sum_assignment(C)
    return math.sqrt(C[r, c].mean())


def w2_lp(X, a, Y, b):
    """W2 between weighted clouds by the transport linear program, solved by scipy's HiGHS (no POT)."""
    X, Y, a, b = _np(X), _np(Y), _np(a), _np(b)
    n, m = len(a), len(b)
    C = ((X[:, None, :] - Y[None, :, :]) ** 2).sum(-1).ravel()
    rows = np.kron(np.eye(n), np.ones((1, m)))
    cols = np.kron(np.ones((1, n)), np.eye(m))
    res = linprog(C, A_eq=np.vstack([rows, cols]), b_eq=np.concatenate([a, b]), bounds=(0, None), method="highs")
    assert res.success, res.message
    return math.sqrt(max(res.fun, 0.0))


def entropic_ot(X, a, Y, b, eps, tol=1e-12, max_iter=200_000):
    """OT_eps = min_pi <pi, C> + eps KL(pi | a x b), C_ij = |x_i - y_j|^2, by log-domain Sinkhorn in numpy
    (no POT, no torch). Returns (OT_eps, <pi_eps, C>, f, g) with pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps).
    Atoms of zero mass are left out (their potentials are returned as NaN). A problem with itself
    (``Y is X``) uses the averaged symmetric update f <- (f + T f) / 2, where alternating updates stall."""
    from scipy.special import logsumexp

    symmetric = Y is X
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    sa, sb = a > 0, b > 0
    Xs, Ys, la, lb = X[sa], Y[sb], np.log(a[sa]), np.log(b[sb])
    C = ((Xs[:, None, :] - Ys[None, :, :]) ** 2).sum(-1)
    f, g = np.zeros(len(Xs)), np.zeros(len(Ys))
    for _ in range(max_iter):
        if symmetric:
            f = 0.5 * (f - eps * logsumexp(la[None, :] + (f[None, :] - C) / eps, axis=1))
            g = f
        else:
            f = -eps * logsumexp(lb[None, :] + (g[None, :] - C) / eps, axis=1)
            g = -eps * logsumexp(la[:, None] + (f[:, None] - C) / eps, axis=0)
        P = np.exp(la[:, None] + lb[None, :] + (f[:, None] + g[None, :] - C) / eps)
        if np.abs(P.sum(1) - np.exp(la)).sum() + np.abs(P.sum(0) - np.exp(lb)).sum() < tol:
            break
    else:
        raise AssertionError(f"entropic_ot: no convergence in {max_iter} iterations")
    F, G = np.full(len(a), np.nan), np.full(len(b), np.nan)
    F[sa], G[sb] = f, g
    return float(np.exp(la) @ f + np.exp(lb) @ g), float((P * C).sum()), F, G


def sinkhorn_divergence(X, a, Y, b, eps):
    """S_eps = OT_eps(mu, nu) - (OT_eps(mu, mu) + OT_eps(nu, nu)) / 2 (Feydy et al. 2019), from entropic_ot."""
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    return (entropic_ot(X, a, Y, b, eps)[0]
            - 0.5 * (entropic_ot(X, a, X, a, eps)[0] + entropic_ot(Y, b, Y, b, eps)[0]))


# ---------------------------------------------------------------------- the paper's bounds, by hand
def _norm2(M):
    return float(np.linalg.norm(np.asarray(M, dtype=np.float64), 2))


def thm33_upper(A, V, R, n):
    """Theorems 3.3 / 4.3: sqrt(3) ||V|| (||A||^2 R^4 (4n + 1) + n)^(1/2)."""
    return math.sqrt(3) * _norm2(V) * math.sqrt(_norm2(A) ** 2 * R**4 * (4 * n + 1) + n)


def thm35_upper_log(A, V, R):
    """log of Theorem 3.5 (unmasked; Theorem 4.4 states it for masked measures, falsely): ||V|| (1 + 3 ||A|| R^2)
    exp(2 ||A|| R^2)."""
    a = _norm2(A)
    return math.log(_norm2(V)) + math.log(1 + 3 * a * R * R) + 2 * a * R * R


def prop34_lower(gamma, R, n):
    """Proposition 3.4: sqrt(n - 1) / (1 + (n - 1) exp(-2 gamma R^2))."""
    return math.sqrt(n - 1) / (1 + (n - 1) * math.exp(-2 * gamma * R * R))


def prop36_asymptotic_log(gamma, R):
    """log of Proposition 3.6's asymptotic value (gamma / 2) R^2 exp(gamma R^2)."""
    return math.log(gamma / 2) + 2 * math.log(R) + gamma * R * R


def lemma38_upper(head_lips, W_O):
    """Lemma 3.8: ||W_O|| (sum_h Lip_h^2)^(1/2)."""
    return _norm2(W_O) * math.sqrt(sum(x * x for x in head_lips))


def kim_l2_upper(WQ, WV, WO, N):
    """Kim et al. Theorem 3.2, 2-norm form with ||W_Q^h||^4 inside the root (docs/math.md section 5):
    (sqrt(N) / sqrt(k)) (4 W0((N-1)/e) + 1) (sum_h ||W_Q^h||^4 ||W_V^h||^2)^(1/2) ||W_O||."""
    c = 4 * float(lambertw((N - 1) / math.e).real) + 1
    terms = [_norm2(q) ** 4 * _norm2(v) ** 2 / q.shape[1] for q, v in zip(WQ, WV)]
    return math.sqrt(N) * c * math.sqrt(sum(terms)) * _norm2(WO)
