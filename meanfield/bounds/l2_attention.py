"""L2 self-attention: Kim, Papamakarios, Mnih (ICML 2021), Theorem 3.2, as recalled and corrected (docs/math.md
section 5.8)."""

from __future__ import annotations

import math
import numbers
import warnings

import numpy as np
import torch

from particles.validation import as_tensor, check_positive_int

from .numerics import _exp_or_inf, _matrix

__all__ = ["lambert_phi_inverse", "l2_attention_upper"]


def lambert_phi_inverse(x) -> float:
    """phi^{-1}(x) for phi(t) = t exp(t + 1), t >= 0: W_0(x / e) (principal Lambert W), O(log x)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or x < 0 or (
            not isinstance(x, numbers.Integral) and not math.isfinite(x)):
        raise ValueError(f"x: expected a finite non-negative number, got {x!r}")
    if isinstance(x, numbers.Integral) and x > 1e300:
        # an integer beyond float range (a length of 10^400): W_0(y) solves w + log w = log y, by Newton's method from
        # log y (math.log takes integers of any size); W_0(y) is about log y - log log y there, near 690 and beyond
        L = math.log(x) - 1.0
        w = L - math.log(L)
        for _ in range(50):
            step = (w + math.log(w) - L) / (1.0 + 1.0 / w)
            w -= step
            if abs(step) <= 4 * math.ulp(w):
                break
        return w
    from scipy.special import lambertw

    return float(lambertw(float(x) / math.e, 0).real)


def _heads(W, name: str) -> list[np.ndarray]:
    """Per-head matrices from a list of (D, k) matrices, one (D, k) matrix or an (H, D, k) array."""
    if isinstance(W, (list, tuple)):
        mats = [_matrix(w, f"{name}[{h}]") for h, w in enumerate(W)]
    else:
        t = as_tensor(W, name, dtype=torch.float64).detach().cpu()
        if t.dim() not in (2, 3):
            raise ValueError(f"{name}: expected (D, k), (H, D, k) or a list of (D, k) matrices, "
                             f"got shape {tuple(t.shape)}")
        mats = [m.numpy() for m in (t[None] if t.dim() == 2 else t)]
    if not mats or any(m.size == 0 for m in mats):
        raise ValueError(f"{name}: expected at least one non-empty head")
    for h, w in enumerate(mats):
        if w.shape[0] != mats[0].shape[0]:
            raise ValueError(f"{name}[{h}]: expected {mats[0].shape[0]} rows (the model dimension), "
                             f"got shape {w.shape}")
    return mats


def l2_attention_upper(W_Q, W_V=None, W_O=None, N=None, *, norm: str = "2") -> float:
    """Lipschitz bounds of L2 multi-head attention: Kim, Papamakarios, Mnih (ICML 2021), Theorem 3.2 as recalled, its
    2-norm form corrected (a fourth power of ||W_Q^h||_2: not the statement as usually cited; docs/math.md 5.8).

    Layout (row tokens, X of shape (N, D)): head h has tied query/key weights ``W_Q[h]`` (D, k),
    scores ``P_ij = softmax_j(-|W_Q^T x_i - W_Q^T x_j|^2 / sqrt(k))``, output
    ``P X A_h W_V[h]`` with ``A_h = W_Q W_Q^T / sqrt(k)`` and ``W_V[h]`` (D, k_v); heads are
    concatenated and multiplied by ``W_O`` (H k_v, D_out). A single head may be given as plain
    matrices. k = D/H in Kim et al.; here k is read from each W_Q[h].

    ``norm="inf"`` (as recalled; it held on every case tried): ``(4 phi^{-1}(N-1) + 1/sqrt(k)) ||W_O^T||_inf
    max_h ||W_Q^h||_inf ||W_Q^h^T||_inf max_h ||W_V^h^T||_inf``.

    ``norm="2"``: ``(sqrt(N)/sqrt(k)) (4 phi^{-1}(N-1) + 1) (sum_h ||W_Q^h||_2^4 ||W_V^h||_2^2)^{1/2}
    ||W_O||_2``. The form as commonly recalled, with ``||W_Q^h||_2^2`` inside the sum, is false
    (docs/math.md section 5): it scales linearly in W_Q while L2 attention scales quadratically (at
    N = 1 the map is x -> x A W_V W_O, of constant ||W_Q W_Q^T W_V W_O||_2 / sqrt(k)); the tests
    check a counterexample and the fourth-power form on random and adversarial inputs. Both forms, and the
    theorem's number, are as recalled (the published PDF was not consulted); the fourth power is what a per-head
    factor ||W_Q||_2 ||W_Q^T||_2, as the infinity-norm form has, gives.

    phi^{-1}(N-1) = W_0((N-1)/e) (:func:`lambert_phi_inverse`). Different heads may have
    different k; the factor 1/sqrt(k) is then taken per head (largest value for ``"inf"``).

    ``W_Q`` may be a list of (D, k) matrices, an (H, D, k) array or a (D, k) matrix; ``W_V``
    likewise; ``W_O=None`` is the identity (plain concatenation). For an operator, use
    :func:`meanfield.upper.operator_upper` (passing it as the first argument still works, with a
    DeprecationWarning). The theorem is stated for unmasked attention.
    """
    if callable(getattr(W_Q, "parameters", None)):
        # an operator in the W_Q argument (the previous release's spelling): read its parameter record
        warnings.warn("l2_attention_upper(op, N=...): passing an operator is deprecated; use "
                      "meanfield.operator_upper(op, R, n) or pass its matrices", DeprecationWarning, stacklevel=2)
        if W_V is not None or W_O is not None:
            raise ValueError("W_V, W_O: give them only with matrices, not with an L2SelfAttention operator")
        p = W_Q.parameters()
        if p is None or p.kind != "l2":
            raise ValueError("W_Q: expected matrices, or an operator made of L2 heads")
        for h, head in enumerate(p.heads):
            if (head.key_bias is not None and bool((head.key_bias != 0).any())) or head.scale < 0:
                raise ValueError(f"W_Q: L2 head {h} has a key bias or a negative scale, which Kim et al.'s bound "
                                 "does not cover (meanfield.operator_upper says so)")
        # the record's scale s in Kim et al.'s layout, which builds in 1/sqrt(k): W_Q = sqrt(s sqrt(k)) Q^T
        # (meanfield.upper, docs/math.md section 5.8)
        W_Q = [h.Q.T * math.sqrt(h.scale * math.sqrt(h.Q.shape[0])) for h in p.heads]
        W_V, W_O = [h.V.T for h in p.heads], None if p.W_O is None else p.W_O.T
    if W_V is None:
        raise ValueError("W_V: the value weights are required")
    if N is None:
        raise ValueError("N: the sequence length is required")
    N = check_positive_int(N, "N")
    if norm not in ("2", "inf"):
        raise ValueError(f"norm: expected '2' or 'inf', got {norm!r}")
    WQ = _heads(W_Q, "W_Q")
    D = WQ[0].shape[0]
    WV = _heads(W_V, "W_V")
    if WV[0].shape[0] != D:
        raise ValueError(f"W_V: expected {D} rows to match W_Q, got shape {WV[0].shape}")
    if len(WV) != len(WQ):
        raise ValueError(f"W_V: expected one value matrix per head ({len(WQ)}), got {len(WV)}")
    kv = sum(w.shape[1] for w in WV)
    wo = np.eye(kv) if W_O is None else _matrix(W_O, "W_O")
    if wo.shape[0] != kv:
        raise ValueError(f"W_O: expected {kv} rows (concatenated head outputs), got shape {wo.shape}")
    c = lambert_phi_inverse(N - 1)
    ks = [w.shape[1] for w in WQ]
    if norm == "2":
        terms = [(4.0 * c + 1.0) ** 2 * np.linalg.norm(q, 2) ** 4 * np.linalg.norm(v, 2) ** 2 / k
                 for q, v, k in zip(WQ, WV, ks)]
        if N > 1e300:
            # sqrt(N) in logarithms: N an integer beyond float range (10^400), as the other bounds take it
            if sum(terms) == 0 or np.linalg.norm(wo, 2) == 0:
                return 0.0
            return _exp_or_inf(0.5 * math.log(N) + 0.5 * math.log(sum(terms)) + math.log(np.linalg.norm(wo, 2)),
                               "l2_attention_upper")
        return float(math.sqrt(N) * math.sqrt(sum(terms)) * np.linalg.norm(wo, 2))
    inf = np.inf
    q_term = max((4.0 * c + 1.0 / math.sqrt(k)) * np.linalg.norm(q, inf) * np.linalg.norm(q.T, inf)
                 for q, k in zip(WQ, ks))
    v_term = max(np.linalg.norm(v.T, inf) for v in WV)
    return float(np.linalg.norm(wo.T, inf) * q_term * v_term)
