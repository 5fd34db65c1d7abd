"""Independent ground truths for the tests: naive attention written from MATH.md section 1,
and the dense Jacobian's top singular value. Deliberately shares no code with the library."""

from __future__ import annotations

import numpy as np
import torch


def naive_attention(X, A, V, masked=False, log_weights=None, b_Q=None):
    """f(X)_i = sum_j P_ij V x_j, P_ij = softmax_j(<A x_i, x_j> (+ log a_j)); causal if masked.

    ``b_Q`` (optional, (d,)) adds <b_Q-term, x_j>: the score becomes <A x_i + c, x_j> with c given.
    """
    n = X.shape[-2]
    S = (X @ A.T) @ X.transpose(-1, -2)
    if b_Q is not None:
        S = S + (X @ b_Q)[..., None, :]
    if log_weights is not None:
        S = S + log_weights
    if masked:
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


def dense_lipschitz_logweights(f, X, log_weights):
    """Weighted (Lemma C.5) top singular value with the scalings formed from log-weights, entry by
    entry: J_ij sqrt(a_i / a_j) = J_ij exp((log a_i - log a_j) / 2). Stays finite where the weights
    themselves (or their square roots) leave the float64 range, as long as the constant does not."""
    J = dense_jacobian(f, X)
    d_in = X.shape[-1]
    d_out = J.shape[0] // X.shape[0]
    lo = torch.repeat_interleave(log_weights, d_out)
    li = torch.repeat_interleave(log_weights, d_in)
    Jw = J * torch.exp((lo[:, None] - li[None, :]) / 2)
    if not bool(torch.isfinite(Jw).all()):
        return float("inf")  # the constant itself is beyond float64
    return float(torch.linalg.matrix_norm(Jw, ord=2))
