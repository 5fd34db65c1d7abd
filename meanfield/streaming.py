"""Streaming attention: the kernel of :mod:`meanfield.kernels` in O(N (d + block)) memory.

Computes the same map as the dense kernel,

    out_i = sum_j P_ij v_j,   P_ij = exp(s_ij - L_i),   s_ij = <q_i, k_j> + log a_j  (-inf where s_j > t_i),
    L_i = log sum_j exp(s_ij)                         (row log-sum-exp; -inf for a row with no visible key),

without ever holding the (m, n) matrix: queries and keys are cut into tiles of at most
``block_q x block_k`` scores and the softmax is accumulated online (running max, running sum,
flash-attention style). Rows with no visible key give zeros, as in the dense kernel.

Derivatives are analytic and streamed the same way (:class:`StreamAttention`):

* VJP (reverse mode): with dO the output cotangent and D_i = <dO_i, out_i>,
  ds_ij = P_ij (<dO_i, v_j> - D_i) (+ P_ij dL_i for a cotangent on L), then
  dq_i = sum_j ds_ij k_j, dk_j = sum_i ds_ij q_i, dv_j = sum_i P_ij dO_i, d(log a)_j = sum_i ds_ij.
  Scores are recomputed tile by tile from the saved L (no stored probabilities).
* JVP (forward mode), the kernel-level form of the Jacobian of Lemma C.2 / D.1:
  ds_ij = <dq_i, k_j> + <q_i, dk_j> + d(log a)_j,
  d out_i = sum_j P_ij dv_j + sum_j P_ij ds_ij v_j - (sum_j P_ij ds_ij) out_i,   dL_i = sum_j P_ij ds_ij.

The function returns (out, L) so that the backward is itself a differentiable expression of the
inputs and outputs: double backward and forward-over-reverse are exact (their recorded graph is
O(m n), as any second-order quantity built from tiles is). All loops depend on shapes only, so
``torch.func`` transforms (jvp, vjp, vmap via ``generate_vmap_rule``, jacrev, jacfwd) apply.

:func:`fused_attend` is an opt-in path through ``torch.nn.functional.scaled_dot_product_attention``
(fused kernels on CUDA) with the log-weights folded into an extra key coordinate.
"""

from __future__ import annotations

import math

import torch

__all__ = ["StreamAttention", "stream_attend", "fused_attend", "DEFAULT_BLOCK"]

#: default tile edge: a 512 x 512 tile of float64 is 2 MiB and stays in cache; measured in benchmarks/attention.md
DEFAULT_BLOCK = 512


def _blocks(size: int, block: int):
    return [(i, min(i + block, size)) for i in range(0, size, block)]


def _live_tiles(qp, kp, m, n, bq, bk):
    """For each query block, the pairs (key block, needs a mask) of key blocks with a visible key.

    A tile whose keys all come after all its queries contributes exactly 0 (exp(-inf)), so skipping
    it changes no result; a tile whose keys all come before all its queries needs no mask. For a
    causal sequence this halves the work. Positions hidden behind a torch.func transform cannot be
    read: then every tile is visited and masked (None).
    """
    if qp is None:
        return None
    try:
        q_lo_hi = [(float(qp[..., i0:i1].min()), float(qp[..., i0:i1].max())) for i0, i1 in _blocks(m, bq)]
        k_lo_hi = [(float(kp[..., j0:j1].min()), float(kp[..., j0:j1].max())) for j0, j1 in _blocks(n, bk)]
    except RuntimeError:
        return None
    return tuple(
        tuple((b, not k_hi <= q_lo) for b, (k_lo, k_hi) in enumerate(k_lo_hi) if k_lo <= q_hi)
        for q_lo, q_hi in q_lo_hi
    )


def _visit(tiles, a, count):
    """The (key block, needs a mask) pairs to visit for query block ``a``."""
    return [(b, True) for b in range(count)] if tiles is None else tiles[a]


def _scores(q, k, lw, qp, kp, i0, i1, j0, j1, mask=True):
    """Tile of scores s_ij for query rows i0:i1 and keys j0:j1 (masked entries -inf)."""
    s = q[..., i0:i1, :] @ k[..., j0:j1, :].transpose(-1, -2)
    if lw is not None:
        s = s + lw[..., None, j0:j1]
    if qp is not None and mask:
        visible = kp[..., None, j0:j1] <= qp[..., i0:i1, None]
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _probs(s, lse_rows):
    """P = exp(s - L) with rows of L = -inf (no visible key) giving zeros instead of nan."""
    safe = torch.where(torch.isfinite(lse_rows), lse_rows, torch.full_like(lse_rows, float("inf")))
    return torch.exp(s - safe.unsqueeze(-1))


def _forward(q, k, v, lw, qp, kp, bq, bk, tiles=None):
    """Online-softmax forward: returns (out, L), shapes (..., m, c) and (..., m)."""
    m, n = q.shape[-2], k.shape[-2]
    kb = _blocks(n, bk)
    outs, lses = [], []
    for a, (i0, i1) in enumerate(_blocks(m, bq)):
        run_max = run_sum = acc = None
        for b, mask in _visit(tiles, a, len(kb)):
            j0, j1 = kb[b]
            s = _scores(q, k, lw, qp, kp, i0, i1, j0, j1, mask)
            tile_max = s.amax(dim=-1, keepdim=True)
            new_max = tile_max if run_max is None else torch.maximum(run_max, tile_max)
            # a row whose keys are all masked so far has max -inf: shift by 0 to avoid -inf - -inf
            shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            p = torch.exp(s - shift)
            if run_max is None:
                run_sum, acc = p.sum(dim=-1, keepdim=True), p @ v[..., j0:j1, :]
            else:
                alpha = torch.exp(run_max - shift)
                run_sum = run_sum * alpha + p.sum(dim=-1, keepdim=True)
                acc = acc * alpha + p @ v[..., j0:j1, :]
            run_max = new_max
        if run_max is None:  # every key of this query block is masked
            shape = q.shape[:-2] + (i1 - i0,)
            outs.append(q.new_zeros(shape + (v.shape[-1],)))
            lses.append(q.new_full(shape, float("-inf")))
            continue
        outs.append(acc / torch.where(run_sum > 0, run_sum, torch.ones_like(run_sum)))
        lses.append((run_max + torch.log(run_sum)).squeeze(-1))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _backward(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, bq, bk, tiles, need):
    """Streamed VJP; ``need`` = (dq, dk, dv, dlw) flags. Differentiable in all its tensor inputs."""
    m, n = q.shape[-2], k.shape[-2]
    qb, kb = _blocks(m, bq), _blocks(n, bk)
    dq = [None] * len(qb)
    dk, dv, dlw = [None] * len(kb), [None] * len(kb), [None] * len(kb)

    def add(acc, x):
        return x if acc is None else acc + x

    for a, (i0, i1) in enumerate(qb):
        if tiles is not None and not tiles[a]:
            continue
        go = g_out[..., i0:i1, :]
        delta = (go * out[..., i0:i1, :]).sum(-1, keepdim=True)
        if g_lse is not None:
            # a cotangent on L_i adds P_ij g_i to ds_ij, i.e. shifts (dP - D) by + g_i
            delta = delta - g_lse[..., i0:i1, None]
        for b, mask in _visit(tiles, a, len(kb)):
            j0, j1 = kb[b]
            p = _probs(_scores(q, k, lw, qp, kp, i0, i1, j0, j1, mask), lse[..., i0:i1])
            if need[2]:
                dv[b] = add(dv[b], p.transpose(-1, -2) @ go)
            if not (need[0] or need[1] or need[3]):
                continue
            ds = p * (go @ v[..., j0:j1, :].transpose(-1, -2) - delta)
            if need[0]:
                dq[a] = add(dq[a], ds @ k[..., j0:j1, :])
            if need[1]:
                dk[b] = add(dk[b], ds.transpose(-1, -2) @ q[..., i0:i1, :])
            if need[3]:
                dlw[b] = add(dlw[b], ds.sum(-2).unsqueeze(-1))

    def gather(parts, blocks, like, dim):
        # blocks never visited (all their scores masked) have zero derivative
        parts = [torch.zeros_like(like[..., i0:i1, :]) if p is None else p for p, (i0, i1) in zip(parts, blocks)]
        return torch.cat(parts, dim=dim)

    return (
        gather(dq, qb, q, -2) if need[0] else None,
        gather(dk, kb, k, -2) if need[1] else None,
        gather(dv, kb, v, -2) if need[2] else None,
        gather(dlw, kb, lw.unsqueeze(-1), -2).squeeze(-1) if need[3] else None,
    )


def _jvp(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw, bq, bk, tiles=None):
    """Streamed JVP (Lemma C.2 / D.1 at the kernel level): returns (d out, d L)."""
    m, n = q.shape[-2], k.shape[-2]
    kb = _blocks(n, bk)
    d_outs, d_lses = [], []
    for a, (i0, i1) in enumerate(_blocks(m, bq)):
        acc = mean_ds = None
        for b, mask in _visit(tiles, a, len(kb)):
            j0, j1 = kb[b]
            p = _probs(_scores(q, k, lw, qp, kp, i0, i1, j0, j1, mask), lse[..., i0:i1])
            ds = None
            if tq is not None:
                ds = tq[..., i0:i1, :] @ k[..., j0:j1, :].transpose(-1, -2)
            if tk is not None:
                term = q[..., i0:i1, :] @ tk[..., j0:j1, :].transpose(-1, -2)
                ds = term if ds is None else ds + term
            if tlw is not None:
                term = tlw[..., None, j0:j1]
                ds = term if ds is None else ds + term
            contrib = None
            if tv is not None:
                contrib = p @ tv[..., j0:j1, :]
            if ds is not None:
                pds = p * ds
                term = pds @ v[..., j0:j1, :]
                contrib = term if contrib is None else contrib + term
                row = pds.sum(-1, keepdim=True)
                mean_ds = row if mean_ds is None else mean_ds + row
            if contrib is not None:
                acc = contrib if acc is None else acc + contrib
        o = out[..., i0:i1, :]
        if acc is None:
            acc = torch.zeros_like(o)
        if mean_ds is None:
            mean_ds = torch.zeros_like(o[..., :1])
        d_outs.append(acc - mean_ds * o)
        d_lses.append(mean_ds.squeeze(-1))
    return torch.cat(d_outs, dim=-2), torch.cat(d_lses, dim=-1)


class StreamAttention(torch.autograd.Function):
    """(out, L) = streamed attention of (q, k, v, log a, t, s); see the module docstring.

    Inputs must share their leading (batch) dimensions; :func:`stream_attend` broadcasts them.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, lw, qp, kp, bq, bk, tiles):
        return _forward(q, k, v, lw, qp, kp, bq, bk, tiles)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, lw, qp, kp, bq, bk, tiles = inputs
        out, lse = output
        ctx.blocks = (bq, bk, tiles)
        ctx.has_lw = lw is not None
        ctx.save_for_backward(q, k, v, lw, qp, kp, out, lse)
        ctx.save_for_forward(q, k, v, lw, qp, kp, out, lse)

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, lw, qp, kp, out, lse = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3]) + (ctx.has_lw and ctx.needs_input_grad[3],)
        if g_out is None:
            g_out = torch.zeros_like(out)
        dq, dk, dv, dlw = _backward(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, *ctx.blocks, need)
        return dq, dk, dv, dlw, None, None, None, None, None

    @staticmethod
    def jvp(ctx, tq, tk, tv, tlw, tqp, tkp, tbq, tbk, ttiles):
        q, k, v, lw, qp, kp, out, lse = ctx.saved_tensors
        return _jvp(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw if ctx.has_lw else None, *ctx.blocks)


def _check_block(block_size):
    if block_size is None:
        return DEFAULT_BLOCK, DEFAULT_BLOCK
    pair = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(pair) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in pair):
        raise ValueError(f"block_size: expected a positive int or a pair (block_q, block_k), got {block_size!r}")
    return pair


def _broadcast(q, k, v, log_weights, q_pos, k_pos):
    """Check shapes and expand every tensor to the common leading (batch) shape (views, no copies)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise TypeError(f"{name}: expected a tensor of shape (..., rows, features), got {type(t).__name__}")
    m, e = q.shape[-2:]
    n = k.shape[-2]
    if k.shape[-1] != e:
        raise ValueError(f"k: feature size {k.shape[-1]} differs from q's {e}")
    if v.shape[-2] != n:
        raise ValueError(f"v: {v.shape[-2]} rows but k has {n}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos, k_pos: give both positions (masked attention) or neither")
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    for name, t, size in (("log_weights", log_weights, n), ("q_pos", q_pos, m), ("k_pos", k_pos, n)):
        if t is not None:
            if t.dim() < 1 or t.shape[-1] != size:
                raise ValueError(f"{name}: last dimension must be {size}, got shape {tuple(t.shape)}")
            shapes.append(t.shape[:-1])
    batch = torch.broadcast_shapes(*shapes)
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    log_weights, q_pos, k_pos = (
        None if t is None else t.expand(*batch, t.shape[-1]) for t in (log_weights, q_pos, k_pos)
    )
    return q, k, v, log_weights, q_pos, k_pos


def stream_attend(q, k, v, log_weights=None, q_pos=None, k_pos=None, *, block_size=None, return_lse=False):
    """Weighted (causal) softmax attention in tiles of ``block_size`` (int or (block_q, block_k)).

    Same result as :func:`meanfield.kernels.attend`'s dense path (to rounding), memory
    O((m + n)(d + c) + block_q block_k). With ``return_lse`` also returns the row log-sum-exp L.
    """
    bq, bk = _check_block(block_size)
    q, k, v, log_weights, q_pos, k_pos = _broadcast(q, k, v, log_weights, q_pos, k_pos)
    tiles = _live_tiles(q_pos, k_pos, q.shape[-2], k.shape[-2], bq, bk)
    out, lse = StreamAttention.apply(q, k, v, log_weights, q_pos, k_pos, bq, bk, tiles)
    return (out, lse) if return_lse else out


def fused_attend(q, k, v, log_weights=None, q_pos=None, k_pos=None):
    """Attention through ``torch.nn.functional.scaled_dot_product_attention`` (opt-in; fused on CUDA).

    The log-weights are folded into one extra coordinate, q' = [q, 1], k' = [k, log a], so that
    <q'_i, k'_j> = <q_i, k_j> + log a_j exactly, and SDPA's own 1/sqrt(e) scale is replaced by 1.
    The position mask is an (m, n) boolean ``attn_mask`` (so masked inputs are not O(N) here);
    rows with no visible key are set to zero as in the dense kernel (SDPA leaves them undefined).
    Which SDPA backend runs (flash, memory-efficient, math) is torch's choice for the device and
    dtype; float64 on CUDA uses the math backend, which materializes the scores.
    """
    q, k, v, log_weights, q_pos, k_pos = _broadcast(q, k, v, log_weights, q_pos, k_pos)
    if log_weights is not None:
        q = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)
        k = torch.cat([k, log_weights.unsqueeze(-1).to(k.dtype)], dim=-1)
    mask = None
    if q_pos is not None:
        mask = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    # a row is empty when every key is masked or has weight 0; its SDPA value is nan or arbitrary
    live = torch.ones(out.shape[:-1], dtype=torch.bool, device=out.device)
    if log_weights is not None or mask is not None:
        ok = torch.ones(*q.shape[:-2], 1, k.shape[-2], dtype=torch.bool, device=q.device)
        if log_weights is not None:
            ok = ok & (log_weights > -math.inf).unsqueeze(-2)
        if mask is not None:
            ok = ok & mask
        live = ok.any(dim=-1)
    return torch.where(live.unsqueeze(-1), out, torch.zeros_like(out))
