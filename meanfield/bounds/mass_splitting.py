"""Mass splitting in closed form: the query terms ||V Sigma_mu(x_i) A||_2 and the constant of a measure with split atoms
(docs/math.md section 4.7)."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from particles.validation import as_tensor, check_positive_float

from .numerics import _A_V, _matrix

__all__ = ["query_term_norms", "split_constant"]


def query_term_norms(A, V, X, log_weights=None, *, positions=None) -> np.ndarray:
    """``||V Sigma_mu(x_i) A||_2`` for every atom i of ``mu = sum_j a_j delta_{x_j}``.

    ``Sigma_mu(x_i)`` is the covariance of the attention distribution of the query x_i,
    ``P_ij = softmax_j(<A x_i, x_j> + log a_j)`` over the visible atoms (``s_j <= s_i`` when
    ``positions`` s are given: masked attention), and ``V Sigma A`` is the query term of the
    Jacobian (docs/math.md section 4.1). It is the constant that splitting atom i contributes
    (:func:`split_constant`, docs/math.md section 4.7). ``log_weights=None`` means uniform weights; a
    log-weight of -inf (an atom of zero mass, which splitting does not change) gives 0.
    Returns a float64 array of length N.
    """
    a, v = _A_V(A, V)
    x = _matrix(X, "X")
    if x.shape[1] != a.shape[0]:
        raise ValueError(f"X: expected points of dimension {a.shape[0]} to match A, got shape {x.shape}")
    N = x.shape[0]
    if log_weights is None:
        lw = np.full(N, -math.log(N))
    else:
        lw = as_tensor(log_weights, "log_weights", dtype=torch.float64, finite=False).detach().cpu().numpy()
        lw = lw.reshape(-1)
        if lw.shape != (N,):
            raise ValueError(f"log_weights: expected {N} log-weights (finite or -inf), got shape {lw.shape}")
        if np.isnan(lw).any() or np.isposinf(lw).any():
            raise ValueError("log_weights: contains NaN or +inf (-inf, a zero mass, is the only infinity allowed)")
    S = (x @ a.T) @ x.T + lw[None, :]
    if positions is not None:
        s = as_tensor(positions, "positions", dtype=torch.float64).detach().cpu().numpy().reshape(-1)
        if s.shape != (N,):
            raise ValueError(f"positions: expected {N} positions, got shape {s.shape}")
        S = np.where(s[None, :] <= s[:, None], S, -np.inf)
    m = S.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    P = np.exp(S - m)
    z = P.sum(axis=1, keepdims=True)
    P = P / np.where(z > 0, z, 1.0)
    out = np.empty(N)
    for i in range(N):
        if lw[i] == -np.inf:   # no mass: splitting the atom changes nothing (as splitting.split_lipschitz)
            out[i] = 0.0
            continue
        mean = P[i] @ x
        C = x - mean
        cov = (C * P[i][:, None]).T @ C
        out[i] = np.linalg.norm(v @ cov @ a, 2)
    return out


def split_constant(lip_unsplit, query_norms, split) -> float:
    """docs/math.md section 4.7: the weighted (W2-sense) local constant of a measure whose atoms in
    ``split`` are each split into parts, whatever the fractions:
    ``max(lip_unsplit, max_{i in split} query_norms[i])``.

    ``lip_unsplit`` is the constant of the unsplit measure, ``query_norms`` the values
    ``||V Sigma_mu(x_i) A||_2`` of :func:`query_term_norms` (of the unsplit measure). Perturbations
    that move the parts of an atom in opposite directions leave the key side of every softmax unchanged to
    first order (the parts' own queries still move) and are orthogonal to the unsplit ones, so only the query
    term acts on them.

    ``lip_unsplit`` and every entry of ``query_norms`` (a 1-D list) must be finite and >= 0; ``split``
    is a list of integer atom indices in [0, N) (a float index, even a whole one, is a TypeError:
    nothing is truncated).
    """
    lip = check_positive_float(lip_unsplit, "lip_unsplit", allow_zero=True)
    q = as_tensor(query_norms, "query_norms", dtype=torch.float64).detach().cpu()
    if q.dim() != 1:
        raise ValueError(f"query_norms: expected one norm per atom (1-D), got shape {tuple(q.shape)}")
    q = q.numpy()
    if (q < 0).any():
        raise ValueError(f"query_norms: expected norms >= 0, got a minimum of {q.min():.3g}")
    if isinstance(split, (str, bytes)) or not hasattr(split, "__iter__"):
        raise TypeError(f"split: expected a list of atom indices, got {type(split).__name__}")
    idx = split.tolist() if isinstance(split, (np.ndarray, torch.Tensor)) else list(split)
    idx = idx if isinstance(idx, list) else [idx]
    bad = [i for i in idx if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral)]
    if bad:
        raise TypeError(f"split: expected integer atom indices, got {bad[0]!r} ({type(bad[0]).__name__})")
    idx = [int(i) for i in idx]
    if any(not 0 <= i < q.size for i in idx):
        raise ValueError(f"split: atom indices must lie in [0, {q.size}), got {idx}")
    if not idx:
        return lip
    return float(max(lip, float(q[idx].max())))
