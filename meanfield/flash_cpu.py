"""torch's fused flash-attention kernel on CPU, called directly (the C++ kernel behind
``scaled_dot_product_attention``): the forward pass with the row log-sum-exp L, and the VJP, of the
streamed kernel (:mod:`meanfield.streamed_attention`) wherever its mask allows (none, or the causal
mask of a sequence). ``FORWARD`` / ``BACKWARD`` (the operators) are None on a torch without these operators;
the streamed kernel then takes its tiles.
"""

from __future__ import annotations

import math

import torch

from particles.validation import zero_mass_log_weight

__all__ = ["FORWARD", "BACKWARD", "aten_op", "weight_coordinates", "layout", "rows_contiguous", "empty_rows",
           "clear_empty_rows", "forward", "backward"]


def aten_op(name):
    """``torch.ops.aten.<name>``, or None on a torch without it."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


#: the forward operator (out, L, ...), or None
FORWARD = aten_op("_scaled_dot_product_flash_attention_for_cpu")
#: its backward (dq, dk, dv), or None
BACKWARD = aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")


#: float16's log 0 as coordinates (:func:`weight_coordinates`): a key of weight 0 scores DEAD_SCALE * DEAD_SHIFT
#: (about -1.7e7, exact in the float32 accumulators of the fused kernels), far below any float16 score
DEAD_SCALE, DEAD_SHIFT = 1024.0, -16376.0


def weight_coordinates(q, k, lw):
    """(q', k') with <q'_i, k'_j> = <q_i, k_j> + log a_j, the log-weights as coordinates (..., rows, features).

    log 0 cannot ride as -inf (0 * inf in the padding and the derivatives): q' = [q, 1], k' = [k, log a] with
    log 0 replaced by the dtype's most negative number / 4, far below every score, except in float16, whose
    -16376 scores at radius 100 reach (a key of weight 0 would win): there q' = [q, 1, DEAD_SCALE] and
    k' = [k, log a or 0, 0 or DEAD_SHIFT], a key of weight 0 scoring about -1.7e7 in the float32 accumulators.
    The gradient in log a is the first extra column of dk' in both layouts.
    """
    one = torch.ones_like(q[..., :1])
    if q.dtype != torch.float16:
        low = zero_mass_log_weight(q.dtype)
        return torch.cat([q, one], -1), torch.cat([k, lw.clamp(min=low).unsqueeze(-1)], -1)
    dead = (lw == -math.inf).unsqueeze(-1)
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    return (torch.cat([q, one, one * DEAD_SCALE], -1),
            torch.cat([k, torch.where(dead, zero, lw.unsqueeze(-1).to(k.dtype)),
                       torch.where(dead, torch.full((), DEAD_SHIFT, dtype=k.dtype, device=k.device), zero)], -1))


def layout(q, k, v, lw, causal, fold, *, align=1, heads=1):
    """4-D inputs of the flash kernel: (Q, K, V, additive mask row or None, width of the real values).

    Log-weights become a broadcast additive mask row (unmasked) or, with the causal mask (which the
    kernel cannot combine with a mask) or when their gradient is needed, extra coordinates
    (:func:`weight_coordinates`; rows left with no visible key are handled by the caller). The kernel needs one
    width for q, k and v: the narrower side is padded with zero columns, which change no product, and
    the width is rounded up to a multiple of ``align``. ``heads``: the axis of the (single) head in the
    4-D layout, 1 for (B, H, rows, features), 2 for (B, rows, H, features) (CUDA's memory-efficient
    kernel, :mod:`meanfield.efficient_cuda`). The fused kernels read each row's features as consecutive
    memory (they take the strides of every other dimension, not of the last): Q, K and V come back with
    stride 1 in the features (:func:`rows_contiguous`).
    """
    mask = None
    if lw is not None and (causal or fold):
        q, k = weight_coordinates(q, k, lw)
    elif lw is not None:
        mask = lw[:, None, None, :]
    c = v.shape[-1]
    width = align * -(-max(q.shape[-1], c) // align)
    pad = lambda t: t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    return (rows_contiguous(pad(q)).unsqueeze(heads), rows_contiguous(pad(k)).unsqueeze(heads),
            rows_contiguous(pad(v)).unsqueeze(heads), mask, c)


def rows_contiguous(t):
    """``t`` with stride 1 in its last dimension, copied only where it is not (a transposed or sliced view, a
    feature dimension expanded with stride 0, a Fortran-ordered array): torch's fused CPU flash kernel (and
    its backward) read the features of a row as consecutive memory whatever the strides say, so such a view
    gave wrong results. Other strides (an expanded batch) the kernels take as they are."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def empty_rows(lw, causal, m):
    """(B, m) bool: rows with no visible key of positive weight (their output is 0 and L = -inf)."""
    dead = lw == -math.inf
    if causal:
        return torch.cummin(dead.to(torch.int32), dim=-1).values.bool()
    return dead.all(-1, keepdim=True).expand(lw.shape[0], m)


def clear_empty_rows(out, lse, lw, causal):
    """(out, L) of a fused kernel with the rows that see no key of positive weight (:func:`empty_rows`) set to
    out = 0 and L = -inf, whatever the kernel left there (NaN, or an average under a finite stand-in for log 0)."""
    if lw is None:
        return out, lse
    empty = empty_rows(lw, causal, out.shape[-2])
    return (torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out),
            torch.where(empty, torch.full_like(lse, -math.inf), lse))


def forward(q, k, v, lw, causal):
    """(out, L) of 3-D inputs (B, rows, features), log-weights ``lw`` (B, n) or None; ``causal``: the
    sequence's mask. Rows with no visible key of positive weight give out = 0 and L = -inf."""
    Q, K, V, mask, c = layout(q, k, v, lw, causal, fold=False)
    out, lse = FORWARD(Q, K, V, 0.0, causal, attn_mask=mask, scale=1.0)
    out, lse = clear_empty_rows(out[:, 0, :, :c], lse[:, 0], lw, causal)
    return out.contiguous(), lse.contiguous()


def backward(q, k, v, lw, out, lse, g_out, causal, need):
    """(dq, dk, dv, dlw) for the cotangent ``g_out`` of ``out`` (none on L); ``need`` flags which (None
    for the others). d(log a) comes from the extra key coordinate of :func:`layout`."""
    fold = need[3]
    Q, K, V, mask, c = layout(q, k, v, lw, causal, fold)
    live = torch.isfinite(lse)
    # a row with no visible key has output 0 whatever its inputs: zero cotangent, and any finite L
    # (the kernel recomputes P = exp(s - L) and needs no -inf there)
    g = torch.where(live.unsqueeze(-1), g_out, torch.zeros_like(g_out))
    L = torch.where(live, lse, torch.zeros_like(lse))
    width = Q.shape[-1]
    pad = lambda t: t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    dQ, dK, dV = BACKWARD(pad(g)[:, None].contiguous(), Q, K, V, pad(out)[:, None].contiguous(),
                            L[:, None].contiguous(), 0.0, causal, attn_mask=mask, scale=1.0)
    e = q.shape[-1]
    dq = dQ[:, 0, :, :e] if need[0] else None
    dk = dK[:, 0, :, :e] if need[1] else None
    dv = dV[:, 0, :, :c] if need[2] else None
    dlw = dK[:, 0, :, e] if fold else None   # d/d(log a_j) = sum_i ds_ij, the extra key coordinate
    return dq, dk, dv, dlw
