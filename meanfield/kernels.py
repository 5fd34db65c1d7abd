"""The attention kernel: weighted, optionally causal softmax attention in log-sum-exp form.

    out_i = sum_j softmax_j(<q_i, k_j> + log a_j + mask_ij) v_j,   mask_ij = -inf if s_j > t_i

with queries q (..., m, e), keys k (..., n, e), values v (..., n, c), log-weights log a (..., n)
(Measure.log_weights; None for uniform), query positions t (..., m) and key positions s (..., n)
for masked attention (docs/math.md section 2). For self-attention q = X A^T, k = X, v = X V^T, so
that <q_i, k_j> = <A x_i, x_j> = s_ij.

Every operator of the framework calls :func:`attend`. Two paths compute the same map:

* ``"dense"`` materializes the (m, n) score matrix; plain autograd; the ground truth.
* ``"stream"`` (:mod:`meanfield.streaming`) works in tiles with an online softmax, memory
  O((m + n)(d + c) + block^2), with analytic streamed JVP / VJP (torch.func compatible).

``method="auto"`` (the default) takes the dense path while batch * m * n <= :data:`STREAM_THRESHOLD`
(2^22 scores, 32 MiB in float64) and streams above it. Force a path per call
(``attend(..., method="stream", block_size=256)``) or for a block of code::

    with meanfield.kernels.use("stream", block_size=512):
        ...
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["attend", "attention_probs", "use", "STREAM_THRESHOLD", "METHODS"]

#: auto dispatch streams when the score matrix (all batch entries) has more entries than this
STREAM_THRESHOLD = 2**22
METHODS = ("auto", "dense", "stream", "fused")

_DEFAULTS = contextvars.ContextVar("meanfield_kernel_defaults", default=("auto", None, STREAM_THRESHOLD))


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


def _check_method(method):
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


@contextlib.contextmanager
def use(method="auto", *, block_size=None, threshold=None):
    """Set the default path of :func:`attend` inside a ``with`` block (per thread / task).

    ``method`` is "auto", "dense", "stream" or "fused"; ``block_size`` the tile edge of the
    streaming path (int or (block_q, block_k)); ``threshold`` the auto-dispatch size (entries of
    the score matrix). An explicit ``method=`` / ``block_size=`` given to ``attend`` wins.
    """
    _check_method(method)
    if threshold is None:
        threshold = STREAM_THRESHOLD
    elif not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
        raise ValueError(f"threshold: expected a non-negative int, got {threshold!r}")
    if block_size is not None:
        from .streaming import _check_block

        _check_block(block_size)
    token = _DEFAULTS.set((method, block_size, threshold))
    try:
        yield
    finally:
        _DEFAULTS.reset(token)


def _score_entries(q, k, log_weights, q_pos, k_pos) -> int:
    shapes = [q.shape[:-2], k.shape[:-2]]
    shapes += [t.shape[:-1] for t in (log_weights, q_pos, k_pos) if t is not None]
    batch = torch.broadcast_shapes(*shapes)
    return batch.numel() * q.shape[-2] * k.shape[-2]


def _check_shapes(q, k, v, log_weights, q_pos, k_pos) -> None:
    """Shape errors that name the argument (cheap: shapes only, no data is read)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise ValueError(f"{name}: expected a tensor of shape (..., rows, features), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k: queries have {q.shape[-1]} features and keys {k.shape[-1]}; they must agree")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v: expected one value per key ({k.shape[-2]}), got shape {tuple(v.shape)}")
    if log_weights is not None and log_weights.shape[-1] != k.shape[-2]:
        raise ValueError(f"log_weights: expected one entry per key ({k.shape[-2]}), "
                         f"got shape {tuple(log_weights.shape)}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos, k_pos: give both positions (masked attention) or neither")
    if q_pos is not None:
        if q_pos.shape[-1] != q.shape[-2]:
            raise ValueError(f"q_pos: expected one position per query ({q.shape[-2]}), got shape {tuple(q_pos.shape)}")
        if k_pos.shape[-1] != k.shape[-2]:
            raise ValueError(f"k_pos: expected one position per key ({k.shape[-2]}), got shape {tuple(k_pos.shape)}")


def attend(q, k, v, log_weights=None, q_pos=None, k_pos=None, *, method=None, block_size=None) -> torch.Tensor:
    """sum_j P_ij v_j with P from :func:`attention_probs`; shape (..., m, c).

    ``method``: "dense" (materialize P), "stream" (tiles of ``block_size``, O(N) memory), "fused"
    (torch's scaled_dot_product_attention, opt-in), or "auto"; None takes the default set by
    :func:`use` ("auto": dense up to :data:`STREAM_THRESHOLD` score entries, streaming above).
    """
    _check_shapes(q, k, v, log_weights, q_pos, k_pos)
    default_method, default_block, threshold = _DEFAULTS.get()
    method = default_method if method is None else method
    _check_method(method)
    if block_size is None:
        block_size = default_block
    if method == "auto":
        method = "stream" if _score_entries(q, k, log_weights, q_pos, k_pos) > threshold else "dense"
    if method == "dense":
        return attention_probs(q, k, log_weights, q_pos, k_pos) @ v
    from . import streaming

    if method == "fused":
        return streaming.fused_attend(q, k, v, log_weights, q_pos, k_pos)
    return streaming.stream_attend(q, k, v, log_weights, q_pos, k_pos, block_size=block_size)
