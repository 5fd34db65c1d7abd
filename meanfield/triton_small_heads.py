"""Triton kernels of the attention kernel for small heads (q, k and v of at most 3 features): FMAs, no matrix products.

The maps are those of :mod:`meanfield.triton_attention` (forward, JVP, the two VJP passes; same arguments, same
outputs), for the particle regime of the mean-field papers (tokens in d = 2 or 3). There a tile's products are
padded to Triton's smallest matrix product (16 columns in float32 with Triton 3.6, 8 with 3.9, for 3 features): 13
of each 16 multiply-adds of a score, and of its share of the output, are on zero columns. Here each score costs ``d``
multiply-adds, written out feature by feature, and every reduction stays inside one thread:

* a tile is ``(loop, thread)``: axis 1 holds the rows a program owns (queries; keys in the key-side VJP pass), one
  per thread (``THREADS = 32 * num_warps``), axis 0 the block of the other side visited at each step of the loop;
* the owned rows' features are loaded once, as vectors; the visited block's features are vectors along axis 0,
  the same for every thread (Triton stages them in shared memory and each thread reads them as broadcasts:
  :func:`blocks`); a score is ``sum_f y_f[j] x_f[i]``;
* every sum over the visited side (the softmax's row sums, the outputs, the gradients) is a sum along axis 0,
  within each thread: no shuffles between threads.

Compiled for sm_90 with Triton 3.9 (``python tests/triton_compile_check.py``, its ``loop_per_entry``), the float32
loops take per score entry and thread, at d = 3: forward 24 instructions, JVP 41, VJP 26 + 33; the matrix-product
kernels at 16 columns (Triton 3.6's padding of d = 3) 70, 129 and 80 + 119, at 8 columns (Triton 3.9's) 48, 75 and
47 + 78. Timed on an H200 (2026-11-29, ``bench_gpu.py --sections small``, benchmarks/README.md): 2.6-3.8x faster than
the best of the matrix-product kernels and SDPA (or its backward) at N = 1e4, 6-9x at 1e5 and 1e6, forward, JVP and
VJP, which is why ``auto`` takes them for such heads (:data:`meanfield.accelerator_paths.SMALL_HEADS_FIRST`). Sums
over blocks are compensated (``meanfield.triton_shared.kahan_add``) as in the general kernels. Which calls take
them: :func:`meanfield.accelerator_paths.small_heads` (float32 and the half types, read into float32; float64 keeps
the matrix-product kernels, whose products of 4 columns run on the tensor cores).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .accelerator_paths import SMALL_HEAD_MAX
from .triton_shared import INTERPRETED as _INTERPRETED
from .triton_shared import kahan_add as _add
from .triton_shared import kahan_sum as _sum

__all__ = ["MAX_FEATURES", "blocks", "KERNELS"]

#: The largest feature size of q, k and v these kernels take, whose features are unrolled one by one (with 4 the
#: JVP and the dq pass spill registers at the tiles of :func:`blocks`, so the default limit is 3)
MAX_FEATURES = SMALL_HEAD_MAX


def blocks(dtype, kernel: str):  # noqa: ARG001 - one tile for every dtype and kernel, so far
    """(BLOCK_M, BLOCK_N, num_warps) of ``kernel``: one warp, whose 32 threads own 32 rows (BLOCK_M for the
    query-side kernels, BLOCK_N for the key-side VJP pass), visiting 32 rows of the other side per step. A step of
    at least the warp's threads is what makes Triton stage the visited rows in shared memory and read them as
    broadcasts (with 16, or with two warps, each thread loads every visited value from global memory: 2.5-3x the
    instructions per entry); 32 keeps every kernel within the registers, with no spills for sm_80 and sm_90 but
    8 bytes in the causal dq pass (tests/test_triton_compile.py)."""
    if _INTERPRETED:
        return 16, 16, 1
    return 32, 32, 1


# ---------------------------------------------------------------------- helpers (inlined)
@triton.jit
def _col(ptr, idx, mask, s_idx, s_f, f: tl.constexpr, ACC: tl.constexpr):
    return tl.load(ptr + idx * s_idx + f * s_f, mask=mask, other=0.0).to(ACC)


@triton.jit
def _cols(ptr, idx, mask, s_idx, s_f, F: tl.constexpr, ACC: tl.constexpr):
    """The first F feature columns of rows ``idx`` as vectors (unused ones repeat the first: never read)."""
    y0 = _col(ptr, idx, mask, s_idx, s_f, 0, ACC)
    y1 = y0
    y2 = y0
    y3 = y0
    if F > 1:
        y1 = _col(ptr, idx, mask, s_idx, s_f, 1, ACC)
    if F > 2:
        y2 = _col(ptr, idx, mask, s_idx, s_f, 2, ACC)
    if F > 3:
        y3 = _col(ptr, idx, mask, s_idx, s_f, 3, ACC)
    return y0, y1, y2, y3


@triton.jit
def _outer(y0, y1, y2, y3, x0, x1, x2, x3, F: tl.constexpr):
    """The (len(y), len(x)) tile sum_{f < F} y_f[j] x_f[i]: F multiply-adds per entry."""
    t = y0[:, None] * x0[None, :]
    if F > 1:
        t += y1[:, None] * x1[None, :]
    if F > 2:
        t += y2[:, None] * x2[None, :]
    if F > 3:
        t += y3[:, None] * x3[None, :]
    return t


@triton.jit
def _reduce(a0, a1, a2, a3, k0, k1, k2, k3, w, y0, y1, y2, y3, F: tl.constexpr):
    """a_f += sum_j w[j, :] y_f[j] for f < F, compensated (the carries k_f)."""
    a0, k0 = _add(a0, k0, tl.sum(w * y0[:, None], 0))
    if F > 1:
        a1, k1 = _add(a1, k1, tl.sum(w * y1[:, None], 0))
    if F > 2:
        a2, k2 = _add(a2, k2, tl.sum(w * y2[:, None], 0))
    if F > 3:
        a3, k3 = _add(a3, k3, tl.sum(w * y3[:, None], 0))
    return a0, a1, a2, a3, k0, k1, k2, k3


@triton.jit
def _store(ptr, idx, mask, s_idx, s_f, a0, a1, a2, a3, F: tl.constexpr):
    tl.store(ptr + idx * s_idx, a0.to(ptr.dtype.element_ty), mask=mask)
    if F > 1:
        tl.store(ptr + idx * s_idx + s_f, a1.to(ptr.dtype.element_ty), mask=mask)
    if F > 2:
        tl.store(ptr + idx * s_idx + 2 * s_f, a2.to(ptr.dtype.element_ty), mask=mask)
    if F > 3:
        tl.store(ptr + idx * s_idx + 3 * s_f, a3.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mask_q(s, LW, s_lw, QP_i, KP, s_kp, rows, cols, cmask, HAS_LW: tl.constexpr, HAS_POS: tl.constexpr,
            CAUSAL: tl.constexpr, ACC: tl.constexpr):
    """The scores of a (keys, queries) tile: + log a_j, -inf where masked or beyond the keys."""
    if HAS_LW:
        s += tl.load(LW + cols * s_lw, mask=cmask, other=-float("inf")).to(ACC)[:, None]
    else:
        s = tl.where(cmask[:, None], s, -float("inf"))
    if HAS_POS:
        kp = tl.load(KP + cols * s_kp, mask=cmask, other=0)
        s = tl.where(kp[:, None] <= QP_i[None, :], s, -float("inf"))
    if CAUSAL:
        s = tl.where(cols[:, None] <= rows[None, :], s, -float("inf"))
    return s


@triton.jit
def _lse(LSE, rows, rmask, s_L, ACC: tl.constexpr):
    """L of the owned queries, +inf where no key is visible (then P = exp(s - inf) = 0)."""
    lse = tl.load(LSE + rows * s_L, mask=rmask, other=-float("inf")).to(ACC)
    return tl.where(lse == -float("inf"), float("inf"), lse)


@triton.jit
def _queries(Q, QP, spm, sqm, sqe, m, n, BLOCK_M: tl.constexpr, E: tl.constexpr, HAS_POS: tl.constexpr,
             CAUSAL: tl.constexpr, ACC: tl.constexpr):
    """The query-side kernels' own rows (pointers at their batch entry): indices, mask, features, positions (the
    indices for a causal mask) and the end of the keys they see."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < m
    q0, q1, q2, q3 = _cols(Q, rows, rmask, sqm, sqe, E, ACC)
    qp = rows
    if HAS_POS:
        qp = tl.load(QP + rows * spm, mask=rmask, other=0)
    hi = n
    if CAUSAL:
        hi = tl.minimum(n, (pid + 1) * BLOCK_M)
    return rows, rmask, q0, q1, q2, q3, qp, hi


@triton.jit
def _keys(K, skn, ske, LW, sln, KP, skpn, j0, n, rows, q0, q1, q2, q3, qp, BLOCK_N: tl.constexpr, E: tl.constexpr,
          HAS_LW: tl.constexpr, HAS_POS: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr):
    """The key block from ``j0`` of a query-side kernel: indices, mask, features and the (keys, queries) scores."""
    cols = j0 + tl.arange(0, BLOCK_N)
    cmask = cols < n
    y0, y1, y2, y3 = _cols(K, cols, cmask, skn, ske, E, ACC)
    s = _mask_q(_outer(y0, y1, y2, y3, q0, q1, q2, q3, E), LW, sln, qp, KP, skpn, rows, cols, cmask,
                HAS_LW, HAS_POS, CAUSAL, ACC)
    return cols, cmask, y0, y1, y2, y3, s


# ---------------------------------------------------------------------- forward
@triton.jit
def _forward_kernel(Q, K, V, LW, QP, KP, OUT, LSE,
                    sqb, sqm, sqe, skb, skn, ske, svb, svn, svc, slb, sln, spb, spm, skpb, skpn,
                    sob, som, soc, sLb, sLm,
                    m, n, e, c,
                    HAS_LW: tl.constexpr, HAS_POS: tl.constexpr, CAUSAL: tl.constexpr,
                    E: tl.constexpr, C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREC: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    rows, rmask, q0, q1, q2, q3, qp, hi = _queries(Q + b * sqb, QP + b * spb, spm, sqm, sqe, m, n, BLOCK_M, E,
                                                   HAS_POS, CAUSAL, ACC)
    run_max = tl.full([BLOCK_M], -float("inf"), ACC)
    run_sum = tl.zeros([BLOCK_M], ACC)
    sum_carry = tl.zeros([BLOCK_M], ACC)
    a0 = tl.zeros([BLOCK_M], ACC)
    a1, a2, a3, k0, k1, k2, k3 = a0, a0, a0, a0, a0, a0, a0
    for j0 in range(0, hi, BLOCK_N):
        cols, cmask, y0, y1, y2, y3, s = _keys(K + b * skb, skn, ske, LW + b * slb, sln, KP + b * skpb, skpn, j0, n,
                                               rows, q0, q1, q2, q3, qp, BLOCK_N, E, HAS_LW, HAS_POS, CAUSAL, ACC)
        new_max = tl.maximum(run_max, tl.max(s, 0))
        # a query whose keys are all masked so far has max -inf: shift by 0 instead (its terms are all 0)
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        p = tl.exp(s - shift[None, :])
        alpha = tl.exp(run_max - shift)
        v0, v1, v2, v3 = _cols(V + b * svb, cols, cmask, svn, svc, C, ACC)
        a0, a1, a2, a3, k0, k1, k2, k3 = _reduce(a0 * alpha, a1 * alpha, a2 * alpha, a3 * alpha, k0 * alpha,
                                                 k1 * alpha, k2 * alpha, k3 * alpha, p, v0, v1, v2, v3, C)
        run_sum, sum_carry = _add(run_sum * alpha, sum_carry * alpha, tl.sum(p, 0))
        run_max = new_max
    run_sum = _sum(run_sum, sum_carry)
    live = run_sum > 0
    inv = 1.0 / tl.where(live, run_sum, 1.0)
    _store(OUT + b * sob, rows, rmask, som, soc, _sum(a0, k0) * inv, _sum(a1, k1) * inv, _sum(a2, k2) * inv,
           _sum(a3, k3) * inv, C)
    lse = tl.where(live, run_max + tl.log(tl.where(live, run_sum, 1.0)), -float("inf"))
    tl.store(LSE + b * sLb + rows * sLm, lse.to(LSE.dtype.element_ty), mask=rmask)


# ---------------------------------------------------------------------- JVP
@triton.jit
def _jvp_kernel(Q, K, V, LW, QP, KP, OUT, LSE, TQ, TK, TV, TLW, DOUT, DLSE,
                sqb, sqm, sqe, skb, skn, ske, svb, svn, svc, slb, sln, spb, spm, skpb, skpn,
                sob, som, soc, sLb, sLm,
                stqb, stqm, stqe, stkb, stkn, stke, stvb, stvn, stvc, stlb, stln,
                m, n, e, c,
                HAS_LW: tl.constexpr, HAS_POS: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_TLW: tl.constexpr,
                E: tl.constexpr, C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PREC: tl.constexpr, ACC: tl.constexpr):
    """d out_i = sum_j P_ij dv_j + sum_j P_ij ds_ij v_j - (sum_j P_ij ds_ij) out_i, dL_i = sum_j P_ij ds_ij."""
    b = tl.program_id(1).to(tl.int64)
    rows, rmask, q0, q1, q2, q3, qp, hi = _queries(Q + b * sqb, QP + b * spb, spm, sqm, sqe, m, n, BLOCK_M, E,
                                                   HAS_POS, CAUSAL, ACC)
    t0, t1, t2, t3 = q0, q1, q2, q3
    if HAS_TQ:
        t0, t1, t2, t3 = _cols(TQ + b * stqb, rows, rmask, stqm, stqe, E, ACC)
    lse = _lse(LSE + b * sLb, rows, rmask, sLm, ACC)
    a0 = tl.zeros([BLOCK_M], ACC)
    a1, a2, a3, k0, k1, k2, k3 = a0, a0, a0, a0, a0, a0, a0
    row = a0
    row_carry = a0
    for j0 in range(0, hi, BLOCK_N):
        cols, cmask, y0, y1, y2, y3, s = _keys(K + b * skb, skn, ske, LW + b * slb, sln, KP + b * skpb, skpn, j0, n,
                                               rows, q0, q1, q2, q3, qp, BLOCK_N, E, HAS_LW, HAS_POS, CAUSAL, ACC)
        p = tl.exp(s - lse[None, :])
        if HAS_TV:
            w0, w1, w2, w3 = _cols(TV + b * stvb, cols, cmask, stvn, stvc, C, ACC)
            a0, a1, a2, a3, k0, k1, k2, k3 = _reduce(a0, a1, a2, a3, k0, k1, k2, k3, p, w0, w1, w2, w3, C)
        if HAS_TQ or HAS_TK or HAS_TLW:
            ds = tl.zeros([BLOCK_N, BLOCK_M], ACC)
            if HAS_TQ:
                ds += _outer(y0, y1, y2, y3, t0, t1, t2, t3, E)
            if HAS_TK:
                z0, z1, z2, z3 = _cols(TK + b * stkb, cols, cmask, stkn, stke, E, ACC)
                ds += _outer(z0, z1, z2, z3, q0, q1, q2, q3, E)
            if HAS_TLW:
                ds += tl.load(TLW + b * stlb + cols * stln, mask=cmask, other=0.0).to(ACC)[:, None]
            pds = p * ds
            v0, v1, v2, v3 = _cols(V + b * svb, cols, cmask, svn, svc, C, ACC)
            a0, a1, a2, a3, k0, k1, k2, k3 = _reduce(a0, a1, a2, a3, k0, k1, k2, k3, pds, v0, v1, v2, v3, C)
            row, row_carry = _add(row, row_carry, tl.sum(pds, 0))
    row = _sum(row, row_carry)
    o0, o1, o2, o3 = _cols(OUT + b * sob, rows, rmask, som, soc, C, ACC)
    # the outputs are contiguous (B, m, c) and (B, m)
    _store(DOUT + b * m * c, rows, rmask, c, 1, _sum(a0, k0) - row * o0, _sum(a1, k1) - row * o1,
           _sum(a2, k2) - row * o2, _sum(a3, k3) - row * o3, C)
    tl.store(DLSE + b * m + rows, row.to(DLSE.dtype.element_ty), mask=rmask)


# ---------------------------------------------------------------------- VJP
@triton.jit
def _backward_q_kernel(Q, K, V, LW, QP, KP, LSE, GO, DELTA, DQ,
                       sqb, sqm, sqe, skb, skn, ske, svb, svn, svc, slb, sln, spb, spm, skpb, skpn,
                       sLb, sLm, sgb, sgm, sgc,
                       m, n, e, c,
                       HAS_LW: tl.constexpr, HAS_POS: tl.constexpr, CAUSAL: tl.constexpr,
                       E: tl.constexpr, C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PREC: tl.constexpr, ACC: tl.constexpr):
    """dq for the owned queries: dq_i = sum_j P_ij (<dO_i, v_j> - D_i) k_j."""
    b = tl.program_id(1).to(tl.int64)
    rows, rmask, q0, q1, q2, q3, qp, hi = _queries(Q + b * sqb, QP + b * spb, spm, sqm, sqe, m, n, BLOCK_M, E,
                                                   HAS_POS, CAUSAL, ACC)
    g0, g1, g2, g3 = _cols(GO + b * sgb, rows, rmask, sgm, sgc, C, ACC)
    lse = _lse(LSE + b * sLb, rows, rmask, sLm, ACC)
    delta = tl.load(DELTA + b * m + rows, mask=rmask, other=0.0).to(ACC)
    a0 = tl.zeros([BLOCK_M], ACC)
    a1, a2, a3, k0, k1, k2, k3 = a0, a0, a0, a0, a0, a0, a0
    for j0 in range(0, hi, BLOCK_N):
        cols, cmask, y0, y1, y2, y3, s = _keys(K + b * skb, skn, ske, LW + b * slb, sln, KP + b * skpb, skpn, j0, n,
                                               rows, q0, q1, q2, q3, qp, BLOCK_N, E, HAS_LW, HAS_POS, CAUSAL, ACC)
        p = tl.exp(s - lse[None, :])
        v0, v1, v2, v3 = _cols(V + b * svb, cols, cmask, svn, svc, C, ACC)
        ds = p * (_outer(v0, v1, v2, v3, g0, g1, g2, g3, C) - delta[None, :])
        a0, a1, a2, a3, k0, k1, k2, k3 = _reduce(a0, a1, a2, a3, k0, k1, k2, k3, ds, y0, y1, y2, y3, E)
    _store(DQ + b * m * e, rows, rmask, e, 1, _sum(a0, k0), _sum(a1, k1), _sum(a2, k2), _sum(a3, k3), E)


@triton.jit
def _backward_kv_kernel(Q, K, V, LW, QP, KP, LSE, GO, DELTA, DK, DV, DLW,
                        sqb, sqm, sqe, skb, skn, ske, svb, svn, svc, slb, sln, spb, spm, skpb, skpn,
                        sLb, sLm, sgb, sgm, sgc,
                        m, n, e, c,
                        HAS_LW: tl.constexpr, HAS_POS: tl.constexpr, CAUSAL: tl.constexpr,
                        NEED_DK: tl.constexpr, NEED_DV: tl.constexpr, NEED_DLW: tl.constexpr,
                        E: tl.constexpr, C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        PREC: tl.constexpr, ACC: tl.constexpr):
    """dk, dv, d(log a) for the owned keys (a (queries, keys) tile), summing over query blocks."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    x0, x1, x2, x3 = _cols(K + b * skb, cols, cmask, skn, ske, E, ACC)
    v0, v1, v2, v3 = _cols(V + b * svb, cols, cmask, svn, svc, C, ACC)
    if HAS_LW:
        lw = tl.load(LW + b * slb + cols * sln, mask=cmask, other=-float("inf")).to(ACC)
    else:
        lw = tl.where(cmask, 0.0, -float("inf")).to(ACC)
    kp = cols
    if HAS_POS:
        kp = tl.load(KP + b * skpb + cols * skpn, mask=cmask, other=0)
    z = tl.zeros([BLOCK_N], ACC)
    dk0, dk1, dk2, dk3, ck0, ck1, ck2, ck3 = z, z, z, z, z, z, z, z
    dv0, dv1, dv2, dv3, cv0, cv1, cv2, cv3 = z, z, z, z, z, z, z, z
    dlw = z
    dlw_carry = z
    lo = 0
    if CAUSAL:
        lo = (pid * BLOCK_N // BLOCK_M) * BLOCK_M  # query blocks before the diagonal see none of these keys
    for i0 in range(lo, m, BLOCK_M):
        rows = i0 + tl.arange(0, BLOCK_M)
        rmask = rows < m
        y0, y1, y2, y3 = _cols(Q + b * sqb, rows, rmask, sqm, sqe, E, ACC)
        s = _outer(y0, y1, y2, y3, x0, x1, x2, x3, E) + lw[None, :]
        if HAS_POS:
            qp = tl.load(QP + b * spb + rows * spm, mask=rmask, other=0)
            s = tl.where(kp[None, :] <= qp[:, None], s, -float("inf"))
        if CAUSAL:
            s = tl.where(cols[None, :] <= rows[:, None], s, -float("inf"))
        lse = _lse(LSE + b * sLb, rows, rmask, sLm, ACC)
        p = tl.exp(s - lse[:, None])
        g0, g1, g2, g3 = _cols(GO + b * sgb, rows, rmask, sgm, sgc, C, ACC)
        if NEED_DV:
            dv0, dv1, dv2, dv3, cv0, cv1, cv2, cv3 = _reduce(dv0, dv1, dv2, dv3, cv0, cv1, cv2, cv3, p,
                                                             g0, g1, g2, g3, C)
        if NEED_DK or NEED_DLW:
            delta = tl.load(DELTA + b * m + rows, mask=rmask, other=0.0).to(ACC)
            ds = p * (_outer(g0, g1, g2, g3, v0, v1, v2, v3, C) - delta[:, None])
            if NEED_DK:
                dk0, dk1, dk2, dk3, ck0, ck1, ck2, ck3 = _reduce(dk0, dk1, dk2, dk3, ck0, ck1, ck2, ck3, ds,
                                                                 y0, y1, y2, y3, E)
            if NEED_DLW:
                dlw, dlw_carry = _add(dlw, dlw_carry, tl.sum(ds, 0))
    if NEED_DK:
        _store(DK + b * n * e, cols, cmask, e, 1, _sum(dk0, ck0), _sum(dk1, ck1), _sum(dk2, ck2), _sum(dk3, ck3), E)
    if NEED_DV:
        _store(DV + b * n * c, cols, cmask, c, 1, _sum(dv0, cv0), _sum(dv1, cv1), _sum(dv2, cv2), _sum(dv3, cv3), C)
    if NEED_DLW:
        tl.store(DLW + b * n + cols, _sum(dlw, dlw_carry).to(DLW.dtype.element_ty), mask=cmask)


#: the kernels by the names of meanfield.triton_attention's (same arguments)
KERNELS = {"forward": _forward_kernel, "jvp": _jvp_kernel, "backward_q": _backward_q_kernel,
           "backward_kv": _backward_kv_kernel}
