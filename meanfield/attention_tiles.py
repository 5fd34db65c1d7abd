"""The tiles of the streamed attention kernel (:mod:`meanfield.streamed_attention`).

Queries are cut into blocks of ``block_q`` rows and keys into blocks of ``block_k``; a tile is the
(block_q, block_k) matrix of scores of one query block against one key block, never more. This module
holds the three parts that work tile by tile (the formulas, online softmax and streamed derivatives,
are in :mod:`meanfield.streamed_attention`'s docstring):

* the layout of the mask (:class:`Plan`, :func:`tile_plan`): which tiles to visit and which of them
  need the mask, read from the positions once;
* the functional tiles (:func:`backward_functional`, :func:`jvp_functional`): out of place, so that
  autograd and ``torch.func`` transforms differentiate through them;
* the fast tiles (:func:`forward_tiles`, :func:`jvp_tiles`, :func:`backward_tiles`, with
  :func:`score_tile`): in place on 3-D inputs (batch, rows, features), for passes that nothing
  differentiates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from particles.progress import advance
from particles.validation import zero_mass_log_weight

__all__ = ["Plan", "tile_plan", "blocks", "HALF", "widen", "narrow_to", "backward_functional", "jvp_functional",
           "score_tile", "forward_tiles", "jvp_tiles", "backward_tiles"]


def blocks(size: int, block: int):
    return [(i, min(i + block, size)) for i in range(0, size, block)]


#: dtypes whose tiles compute in float32 (:func:`widen`)
HALF = (torch.float16, torch.bfloat16)


def widen(*tensors):
    """float32 copies of the half-precision (float16, bfloat16) tensors among ``tensors``, the others (None,
    positions, wider dtypes) as they are.

    The tile loops carry sums across key tiles: the online softmax's running sum and accumulator
    (sum_j exp(s_ij - max) and sum_j exp(s_ij - max) v_j), the JVP's sum_j P_ij ds_ij v_j and the VJP's
    dq_i = sum_j ds_ij k_j, dk_j, dv_j. Kept in a half type, each tile's addition rounds them again, and the
    error grew with the number of keys (bfloat16, 32768 keys: 1e-1 against the dense path's 1e-3). In float32,
    as the Triton kernels accumulate, the inputs (exact in float32) give the float32 computation, rounded
    once at the end (:func:`narrow_to`). Costs one copy of the inputs, O(N d), against the tiles' O(N^2 d)."""
    return tuple(t.float() if t is not None and t.dtype in HALF else t for t in tensors)


def narrow_to(results, likes):
    """Each result in the dtype of its input (``likes``): the half types' results rounded once, after the
    float32 tiles (:func:`widen`). None stays None."""
    return tuple(None if r is None else r.to(like.dtype) for r, like in zip(results, likes))


# ---------------------------------------------------------------------- layout of the mask
@dataclass(frozen=True)
class Plan:
    """Tile sizes and what the positions allow: ``tiles`` lists, per query block, the key blocks with a
    visible key and whether they need the mask (None: visit and mask all); ``causal`` says that the
    mask is the sequence's lower-triangular one (q_pos == k_pos, strictly increasing, m == n); ``engine``
    the fast engine of plain passes: "auto" (CPU: the flash kernel where the mask allows, tiles otherwise),
    "tiles" (the in-place tile loops) or "triton" (:mod:`meanfield.triton_attention`); ``fused``: on CUDA,
    forward passes and VJPs that the mask allows go to torch's memory-efficient kernel
    (:mod:`meanfield.efficient_cuda`; the engine was chosen by device, not forced); ``efficient`` False: not
    that kernel (it refused such a call), the engine still as chosen by device; ``sized_for``: the batch
    entries (vmap levels included) the tiles were sized for by the device's memory budget (0: fixed tiles,
    the CPU's or a given ``block_size``), so that a backward or JVP under more vmap levels is tiled again."""

    bq: int
    bk: int
    tiles: tuple | None = None
    causal: bool = False
    engine: str = "auto"
    fused: bool = False
    efficient: bool = True
    sized_for: int = 0


def _block_extremes(p, block, fill_min, fill_max):
    """Per block of the last dimension: min and max over the block and all batch entries (the padding of the last
    block: ``fill_min`` and ``fill_max``, for integer positions the dtype's largest and smallest values)."""
    if not p.dtype.is_floating_point:
        info = torch.iinfo(p.dtype)
        fill_min, fill_max = info.max, info.min
    size = p.shape[-1]
    flat = p.reshape(-1, size)

    def padded(fill):   # torch.full keeps an int64 fill exact (pad's fill is a float)
        out = torch.full((flat.shape[0], size + (-size) % block), fill, dtype=p.dtype, device=p.device)
        out[:, :size] = flat
        return out.reshape(flat.shape[0], -1, block)

    return padded(fill_min).amin(dim=(0, 2)), padded(fill_max).amax(dim=(0, 2))


def tile_plan(qp, kp, m, n, bq, bk, engine="auto", fused=False) -> Plan:
    """The mask layout from the positions, read from the device once (one host sync).

    A tile whose keys all come after all its queries contributes exactly 0 (exp(-inf)), so skipping
    it changes no result; a tile whose keys all come before all its queries needs no mask. For a
    causal sequence this halves the work. Positions hidden behind a torch.func transform cannot be
    read: then every tile is visited and masked.
    """
    if qp is None:
        return Plan(bq, bk, engine=engine, fused=fused)
    try:
        q_lo, q_hi = _block_extremes(qp, bq, math.inf, -math.inf)
        k_lo, k_hi = _block_extremes(kp, bk, math.inf, -math.inf)
        causal = torch.zeros(1, dtype=qp.dtype, device=qp.device)
        if m == n and qp.shape == kp.shape:
            seq = (qp == kp).all() & (kp[..., 1:] > kp[..., :-1]).all()
            causal = seq.to(qp.dtype).reshape(1)
        vals = torch.cat([q_lo, q_hi, k_lo, k_hi, causal]).tolist()
    except RuntimeError:
        return Plan(bq, bk, engine=engine, fused=fused)
    nq, nk = len(q_lo), len(k_lo)
    q_lo, q_hi = vals[:nq], vals[nq:2 * nq]
    k_lo, k_hi = vals[2 * nq:2 * nq + nk], vals[2 * nq + nk:2 * nq + 2 * nk]
    tiles = tuple(
        tuple((b, not k_hi[b] <= q_lo[a]) for b in range(nk) if k_lo[b] <= q_hi[a])
        for a in range(nq)
    )
    return Plan(bq, bk, tiles, bool(vals[-1]), engine, fused)


def _visit(plan, a, count):
    """The (key block, needs a mask) pairs to visit for query block ``a``."""
    return [(b, True) for b in range(count)] if plan.tiles is None else plan.tiles[a]


def _keys(plan, block, i1):
    """The key range (j0, j1) of a visited key block for the query rows below ``i1``: under a sequence's
    causal mask the keys from i1 on are masked for every one of those rows (exp(-inf) = 0), so the range
    stops there. With the accelerators' row blocks against all keys (one key block) this halves the work
    of a causal pass, as skipping whole tiles does with square tiles."""
    j0, j1 = block
    return (j0, min(j1, i1)) if plan.causal else (j0, j1)


def _key_ranges(plan, a, kb, i1):
    """(key block, j0, j1, needs a mask) of the fast tile loops for query block ``a`` (rows below ``i1``):
    :func:`_visit`'s blocks with their ranges stopped at the diagonal (:func:`_keys`); a block that this
    leaves empty is not visited (a batch's loose block extremes can visit one wholly above the diagonal)."""
    for b, mask in _visit(plan, a, len(kb)):
        j0, j1 = _keys(plan, kb[b], i1)
        if j1 > j0:
            yield b, j0, j1, mask


# ---------------------------------------------------------------------- functional tiles (differentiable)
# Blocks are cut with narrow: t[..., i0:i1, :] over a whole dimension is an alias, which torch's legacy batched
# tensors (torch.autograd.functional's vectorize=True, grad(..., is_grads_batched=True)) have no rule for
def _rows(t, i0, i1):
    """Rows i0:i1 of (..., rows, features)."""
    return t.narrow(-2, i0, i1 - i0)


def _cols(t, j0, j1):
    """Entries j0:j1 of the last dimension."""
    return t.narrow(-1, j0, j1 - j0)


def _scores(q, k, lw, qp, kp, i0, i1, j0, j1, mask=True):
    """Tile of scores s_ij for query rows i0:i1 and keys j0:j1 (masked entries -inf)."""
    s = _rows(q, i0, i1) @ _rows(k, j0, j1).transpose(-1, -2)
    if lw is not None:
        s = s + _cols(lw, j0, j1).unsqueeze(-2)
    if qp is not None and mask:
        visible = _cols(kp, j0, j1).unsqueeze(-2) <= _cols(qp, i0, i1).unsqueeze(-1)
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _probs(s, lse_rows):
    """P = exp(s - L) with rows of L = -inf (no visible key) giving zeros instead of nan, in the scores' dtype
    (the half types' L is float32 when a fused kernel or Triton computed it)."""
    safe = torch.where(torch.isfinite(lse_rows), lse_rows, torch.full_like(lse_rows, float("inf")))
    return torch.exp(s - safe.unsqueeze(-1)).to(s.dtype)


def backward_functional(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need):
    """Streamed VJP; ``need`` = (dq, dk, dv, dlw) flags. Differentiable in all its tensor inputs. The half types
    compute in float32 (:func:`widen`), the derivatives returned in the dtypes of q, k, v and log a."""
    if q.dtype in HALF:
        wide = widen(q, k, v, lw, out, lse, g_out, g_lse)
        return narrow_to(backward_functional(*wide[:4], qp, kp, *wide[4:], plan, need), (q, k, v, lw))
    m, n = q.shape[-2], k.shape[-2]
    qb, kb = blocks(m, plan.bq), blocks(n, plan.bk)
    dq = [None] * len(qb)
    dk, dv, dlw = [None] * len(kb), [None] * len(kb), [None] * len(kb)

    def add(acc, x):
        return x if acc is None else acc + x

    for a, (i0, i1) in enumerate(qb):
        advance(a, len(qb), "VJP")
        if plan.tiles is not None and not plan.tiles[a]:
            continue
        go = _rows(g_out, i0, i1)
        delta = (go * _rows(out, i0, i1)).sum(-1, keepdim=True)
        if g_lse is not None:
            # a cotangent on L_i adds P_ij g_i to ds_ij, i.e. shifts (dP - D) by + g_i
            delta = delta - _cols(g_lse, i0, i1).unsqueeze(-1).to(delta.dtype)   # (the half types' L may be float32)
        for b, mask in _visit(plan, a, len(kb)):
            j0, j1 = kb[b]
            p = _probs(_scores(q, k, lw, qp, kp, i0, i1, j0, j1, mask), _cols(lse, i0, i1))
            if need[2]:
                dv[b] = add(dv[b], p.transpose(-1, -2) @ go)
            if not (need[0] or need[1] or need[3]):
                continue
            ds = p * (go @ _rows(v, j0, j1).transpose(-1, -2) - delta)
            if need[0]:
                dq[a] = add(dq[a], ds @ _rows(k, j0, j1))
            if need[1]:
                dk[b] = add(dk[b], ds.transpose(-1, -2) @ _rows(q, i0, i1))
            if need[3]:
                dlw[b] = add(dlw[b], ds.sum(-2).unsqueeze(-1))

    def gather(parts, blocks, like, dim):
        # blocks never visited (all their scores masked) have zero derivative
        parts = [torch.zeros_like(_rows(like, i0, i1)) if p is None else p for p, (i0, i1) in zip(parts, blocks)]
        return torch.cat(parts, dim=dim)

    return (
        gather(dq, qb, q, -2) if need[0] else None,
        gather(dk, kb, k, -2) if need[1] else None,
        gather(dv, kb, v, -2) if need[2] else None,
        gather(dlw, kb, lw.unsqueeze(-1), -2).squeeze(-1) if need[3] else None,
    )


def jvp_functional(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw, plan):
    """Streamed JVP (docs/math.md section 4.1 at the kernel level): returns (d out, d L). Differentiable. The half
    types compute in float32 (:func:`widen`); d out is returned in out's dtype, d L in L's."""
    if q.dtype in HALF:
        wide = widen(q, k, v, lw, out, lse, tq, tk, tv, tlw)
        return narrow_to(jvp_functional(*wide[:4], qp, kp, *wide[4:], plan), (out, lse))
    m, n = q.shape[-2], k.shape[-2]
    kb = blocks(n, plan.bk)
    d_outs, d_lses = [], []
    qb = blocks(m, plan.bq)
    for a, (i0, i1) in enumerate(qb):
        advance(a, len(qb), "JVP")
        acc = mean_ds = None
        for b, mask in _visit(plan, a, len(kb)):
            j0, j1 = kb[b]
            p = _probs(_scores(q, k, lw, qp, kp, i0, i1, j0, j1, mask), _cols(lse, i0, i1))
            ds = None
            if tq is not None:
                ds = _rows(tq, i0, i1) @ _rows(k, j0, j1).transpose(-1, -2)
            if tk is not None:
                term = _rows(q, i0, i1) @ _rows(tk, j0, j1).transpose(-1, -2)
                ds = term if ds is None else ds + term
            if tlw is not None:
                term = _cols(tlw, j0, j1).unsqueeze(-2)
                ds = term if ds is None else ds + term
            contrib = None
            if tv is not None:
                contrib = p @ _rows(tv, j0, j1)
            if ds is not None:
                pds = p * ds
                term = pds @ _rows(v, j0, j1)
                contrib = term if contrib is None else contrib + term
                row = pds.sum(-1, keepdim=True)
                mean_ds = row if mean_ds is None else mean_ds + row
            if contrib is not None:
                acc = contrib if acc is None else acc + contrib
        o = _rows(out, i0, i1)
        if acc is None:
            acc = torch.zeros_like(o)
        if mean_ds is None:
            mean_ds = torch.zeros_like(o.narrow(-1, 0, 1))
        d_outs.append(acc - mean_ds * o)
        d_lses.append(mean_ds.squeeze(-1))
    return torch.cat(d_outs, dim=-2), torch.cat(d_lses, dim=-1).to(lse.dtype)


# ---------------------------------------------------------------------- fast tiles (in place, 3-D)
def score_tile(qa, kT, lwT, qpa, kp, j0, j1, mask, out=None):
    """s = q_a k_j^T + log a_j, masked, into a fresh (or the given) buffer; inputs are 3-D (B, rows, e)."""
    s = torch.bmm(qa, kT[:, :, j0:j1], out=out)
    if lwT is not None:
        s += lwT[:, :, j0:j1]
    if mask and qpa is not None:
        s.masked_fill_(kp[:, None, j0:j1] > qpa, -math.inf)
    return s


def forward_tiles(q, k, v, lw, qp, kp, plan):
    """Online-softmax forward on 3-D inputs (B, m, e): returns (out, L). The half types run in float32
    (:func:`widen`: the running sum and the accumulator carried across key tiles) and return out in their
    dtype and L in float32, as the Triton kernels and CUDA's fused kernel do (a half L would put its rounding,
    about 0.03 at L = 10 in bfloat16, into every exp(s - L) of the derivatives)."""
    if q.dtype in HALF:
        out, lse = forward_tiles(*widen(q, k, v, lw), qp, kp, plan)
        return out.to(q.dtype), lse
    m, n = q.shape[-2], k.shape[-2]
    kb = blocks(n, plan.bk)
    kT = k.transpose(-1, -2)
    lwT = None if lw is None else lw[:, None, :]
    low = torch.finfo(q.dtype).min
    outs, lses = [], []
    qb = blocks(m, plan.bq)
    for a, (i0, i1) in enumerate(qb):
        advance(a, len(qb), "forward")
        qa = q[:, i0:i1]
        qpa = None if qp is None else qp[:, i0:i1, None]
        run_max = run_sum = acc = None
        for _b, j0, j1, mask in _key_ranges(plan, a, kb, i1):
            s = score_tile(qa, kT, lwT, qpa, kp, j0, j1, mask)
            tile_max = s.amax(dim=-1, keepdim=True)
            # a row whose keys are all masked so far has max -inf: shift by a finite number instead
            shift = (tile_max if run_max is None else torch.maximum(run_max, tile_max)).clamp(min=low)
            p = s.sub_(shift).exp_()
            if run_max is None:
                run_sum, acc = p.sum(-1, keepdim=True), torch.bmm(p, v[:, j0:j1])
            else:
                alpha = run_max.sub_(shift).exp_()
                run_sum.mul_(alpha).add_(p.sum(-1, keepdim=True))
                acc = torch.baddbmm(acc.mul_(alpha), p, v[:, j0:j1])
            run_max = shift
        if run_max is None:  # every key of this query block is masked
            outs.append(q.new_zeros(q.shape[0], i1 - i0, v.shape[-1]))
            lses.append(q.new_full((q.shape[0], i1 - i0), -math.inf))
            continue
        empty = run_sum == 0
        outs.append(acc.div_(torch.where(empty, torch.ones_like(run_sum), run_sum)))
        lse = run_max.add_(run_sum.log())  # log 0 = -inf for an empty row
        lses.append(torch.where(empty, torch.full_like(lse, -math.inf), lse).squeeze(-1))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _probs_tile(qa, kT, lwT, qpa, kp, j0, j1, mask, lse_safe):
    """P tile = exp(s - L) in place; ``lse_safe`` (B, rows, 1) has +inf for rows with no visible key."""
    return score_tile(qa, kT, lwT, qpa, kp, j0, j1, mask).sub_(lse_safe).exp_()


def _safe_lse(lse):
    return torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf)).unsqueeze(-1)


def _folded(q, k, lw, lse):
    """(q', k'^T) whose product is s - L in one GEMM: q' = [q, 1, -L], k' = [k, log a, 1] (without log a:
    [q, -L], [k, 1]). -inf (log 0, and -L of a row with no visible key) becomes a finite number far below
    every score, so that no 0 * inf arises and exp gives 0 there. One product instead of a product and two
    passes over the tile (+ log a, - L): on an accelerator, where a tile is a block of rows against all keys
    and every pass over it reads and writes memory, that is what the tile loops' time goes to."""
    from .flash_cpu import weight_coordinates

    low = zero_mass_log_weight(q.dtype)
    neg_l = torch.where(torch.isfinite(lse), -lse, torch.full_like(lse, low)).clamp(min=low).unsqueeze(-1)
    if lw is not None:
        q, k = weight_coordinates(q, k, lw)
    return torch.cat([q, neg_l], -1), torch.cat([k, k.new_ones(*k.shape[:-1], 1)], -1).transpose(-1, -2)


def _probs_folded(qx, kxT, qpa, kp, j0, j1, mask):
    """P tile = exp(q' k'^T) (:func:`_folded`), the positions' mask applied before the exponential."""
    s = torch.bmm(qx, kxT[:, :, j0:j1])
    if mask and qpa is not None:
        s.masked_fill_(kp[:, None, j0:j1] > qpa, -math.inf)
    return s.exp_()


def jvp_tiles(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw, plan, cache=None, fold=False):
    """Streamed JVP on 3-D inputs, in place (results not differentiated): returns (d out, d L).

    ``cache`` (a dict, or None) keeps the probability tiles between calls at the same primal point.
    ``fold`` (used on accelerators): fewer passes over each tile, the same products regrouped
    (``_folded``: s - L as one product; ds with d(log a) as one product [dq, q, 1] [k, dk, d log a]^T; the row sums
    sum_j P_ij ds_ij as the extra column of P ds [v, 1]).
    The half types compute in float32 (:func:`widen`; cached tiles then are float32); d out is returned in
    out's dtype, d L in L's.
    """
    if q.dtype in HALF:
        wide = widen(q, k, v, lw, out, lse, tq, tk, tv, tlw)
        return narrow_to(jvp_tiles(*wide[:4], qp, kp, *wide[4:], plan, cache=cache, fold=fold), (out, lse))
    m, n = q.shape[-2], k.shape[-2]
    c = v.shape[-1]
    kb = blocks(n, plan.bk)
    kT = k.transpose(-1, -2)
    lwT = None if lw is None else lw[:, None, :]
    tlwT = None if tlw is None else tlw[:, None, :]
    # ds = <dq_i, k_j> + <q_i, dk_j> (+ d log a_j) as one product: [dq, q (, 1)] [k, dk (, d log a)]^T
    lefts, rights = [], []
    if tq is not None:
        lefts.append(tq)
        rights.append(k)
    if tk is not None:
        lefts.append(q)
        rights.append(tk)
    if fold and tlw is not None:
        lefts.append(q.new_ones(*q.shape[:-1], 1))
        rights.append(tlw.unsqueeze(-1))
        tlwT = None
    if lefts:
        left = lefts[0] if len(lefts) == 1 else torch.cat(lefts, -1)
        rightT = (rights[0] if len(rights) == 1 else torch.cat(rights, -1)).transpose(-1, -2)
    else:
        left = rightT = None
    safe = _safe_lse(lse)
    if fold:
        qx, kxT = _folded(q, k, lw, lse)
        # the row sums ride as an extra column: P ds [v, 1], P [dv, 0]
        v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1)
        if tv is not None:
            tv = torch.cat([tv, tv.new_zeros(*tv.shape[:-1], 1)], -1)
        d_ext = out.new_zeros(*out.shape[:-1], c + 1)
        d_lse = d_ext[..., c]
    else:
        d_ext, d_lse = torch.zeros_like(out), torch.zeros_like(lse)
    qb = blocks(m, plan.bq)
    for a, (i0, i1) in enumerate(qb):
        advance(a, len(qb), "JVP")
        qa = q[:, i0:i1]
        qpa = None if qp is None else qp[:, i0:i1, None]
        acc, row = d_ext[:, i0:i1], d_lse[:, i0:i1, None]
        for b, j0, j1, mask in _key_ranges(plan, a, kb, i1):
            p = None if cache is None else cache.get((a, b))
            if p is None:
                if fold:
                    p = _probs_folded(qx[:, i0:i1], kxT, qpa, kp, j0, j1, mask)
                else:
                    p = _probs_tile(qa, kT, lwT, qpa, kp, j0, j1, mask, safe[:, i0:i1])
                if cache is not None:
                    cache[(a, b)] = p
            if tv is not None:
                acc.baddbmm_(p, tv[:, j0:j1])
            if left is None and tlwT is None:
                continue
            if left is not None:
                pds = torch.bmm(left[:, i0:i1], rightT[:, :, j0:j1])
                if tlwT is not None:
                    pds += tlwT[:, :, j0:j1]
            else:
                pds = tlwT[:, :, j0:j1].expand_as(p).clone()
            pds.mul_(p)
            acc.baddbmm_(pds, v[:, j0:j1])
            if not fold:
                row += pds.sum(-1, keepdim=True)
    if fold:
        d_lse = d_lse.contiguous()
        return d_ext[..., :c] - d_lse.unsqueeze(-1) * out, d_lse
    d_ext.sub_(d_lse.unsqueeze(-1) * out)
    return d_ext, d_lse


def backward_tiles(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need, fold=False):
    """Streamed VJP on 3-D inputs, in place (results not differentiated). ``fold`` (used on accelerators):
    fewer passes over each tile, the same products regrouped (``_folded``: s - L as one product; dP - D as one product
    [dO, -D] [v, 1]^T). The half types compute in float32 (:func:`widen`: dq, dk, dv and d log a are sums over
    tiles), the derivatives returned in the dtypes of q, k, v and log a."""
    if q.dtype in HALF:
        wide = widen(q, k, v, lw, out, lse, g_out, g_lse)
        return narrow_to(backward_tiles(*wide[:4], qp, kp, *wide[4:], plan, need, fold=fold), (q, k, v, lw))
    m, n = q.shape[-2], k.shape[-2]
    kb = blocks(n, plan.bk)
    kT, vT = k.transpose(-1, -2), v.transpose(-1, -2)
    lwT = None if lw is None else lw[:, None, :]
    safe = _safe_lse(lse)
    delta = (g_out * out).sum(-1, keepdim=True)
    if g_lse is not None:
        delta = delta - g_lse.unsqueeze(-1)
    if fold:
        qx, kxT = _folded(q, k, lw, lse)
        g_ext = torch.cat([g_out, -delta], -1)
        vT = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1).transpose(-1, -2)
    dq = torch.zeros_like(q) if need[0] else None
    dk = torch.zeros_like(k) if need[1] else None
    dv = torch.zeros_like(v) if need[2] else None
    dlw = torch.zeros_like(lw) if need[3] else None
    qb = blocks(m, plan.bq)
    for a, (i0, i1) in enumerate(qb):
        advance(a, len(qb), "VJP")
        if plan.tiles is not None and not plan.tiles[a]:
            continue
        qa, go = q[:, i0:i1], g_out[:, i0:i1]
        qpa = None if qp is None else qp[:, i0:i1, None]
        for _b, j0, j1, mask in _key_ranges(plan, a, kb, i1):
            if fold:
                p = _probs_folded(qx[:, i0:i1], kxT, qpa, kp, j0, j1, mask)
            else:
                p = _probs_tile(qa, kT, lwT, qpa, kp, j0, j1, mask, safe[:, i0:i1])
            if dv is not None:
                dv[:, j0:j1].baddbmm_(p.transpose(-1, -2), go)
            if not (need[0] or need[1] or need[3]):
                continue
            if fold:
                ds = torch.bmm(g_ext[:, i0:i1], vT[:, :, j0:j1]).mul_(p)
            else:
                ds = torch.bmm(go, vT[:, :, j0:j1]).sub_(delta[:, i0:i1]).mul_(p)
            if dq is not None:
                dq[:, i0:i1].baddbmm_(ds, k[:, j0:j1])
            if dk is not None:
                dk[:, j0:j1].baddbmm_(ds.transpose(-1, -2), qa)
            if dlw is not None:
                dlw[:, j0:j1] += ds.sum(-2)
    return dq, dk, dv, dlw
