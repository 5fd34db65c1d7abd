"""The attention kernel: weighted, optionally causal softmax attention in log-sum-exp form.

    out_i = sum_j softmax_j(<q_i, k_j> + log a_j + mask_ij) v_j,   mask_ij = -inf if s_j > t_i

with queries q (..., m, e), keys k (..., n, e), values v (..., n, c), log-weights log a (..., n)
(Measure.log_weights; None for uniform), query positions t (..., m) and key positions s (..., n)
for masked attention (MATH.md section 2). For self-attention q = X A^T, k = X, v = X V^T, so
that <q_i, k_j> = <A x_i, x_j> = s_ij.

Every operator of the framework calls :func:`attend`; the dense path materializes the (m, n)
score matrix and is the ground truth for small sizes.
"""

from __future__ import annotations

import torch

__all__ = ["attend", "attention_probs"]


def attention_probs(q, k, log_weights=None, q_pos=None, k_pos=None) -> torch.Tensor:
    """The row-stochastic matrix P_ij of weighted (causal) attention, shape (..., m, n).

    Rows whose every key is masked (a query placed before every key) are all zeros.
    """
    scores = q @ k.transpose(-1, -2)
    if log_weights is not None:
        scores = scores + log_weights.unsqueeze(-2)
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos, k_pos: give both positions (masked attention) or neither")
    if q_pos is not None:
        visible = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
        scores = scores.masked_fill(~visible, float("-inf"))
    # log-sum-exp softmax; rows with no visible key would give nan, they give zeros instead
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(scores - m)
    z = e.sum(dim=-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def attend(q, k, v, log_weights=None, q_pos=None, k_pos=None) -> torch.Tensor:
    """sum_j P_ij v_j with P from :func:`attention_probs`; shape (..., m, c)."""
    return attention_probs(q, k, log_weights, q_pos, k_pos) @ v
