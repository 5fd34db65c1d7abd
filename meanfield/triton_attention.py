"""Triton kernels of the attention kernel (forward, JVP, VJP) in O(N) memory: one launch per pass.

They compute the maps of :mod:`meanfield.streamed_attention` (same notation: s_ij = <q_i, k_j> + log a_j, -inf
where s_j > t_i; P_ij = exp(s_ij - L_i); rows with no visible key give 0 and L = -inf):

* forward: out_i = sum_j P_ij v_j and L_i = log sum_j exp(s_ij), online softmax over key blocks;
* JVP: d out_i = sum_j P_ij dv_j + sum_j P_ij ds_ij v_j - (sum_j P_ij ds_ij) out_i,  dL_i = sum_j P_ij ds_ij,
  ds_ij = <dq_i, k_j> + <q_i, dk_j> + d(log a)_j (docs/math.md section 4.1 at the kernel level);
* VJP: with D_i = <dO_i, out_i> - dL_i, ds_ij = P_ij (<dO_i, v_j> - D_i); dq_i = sum_j ds_ij k_j (one
  program per query block), dk_j = sum_i ds_ij q_i, dv_j = sum_i P_ij dO_i, d(log a)_j = sum_i ds_ij (one
  program per key block). Scores are recomputed from the saved L, as in flash attention.

Each program holds a (BLOCK_M, BLOCK_N) tile of scores in registers; nothing of size m n touches
memory. The mask is either none, the causal mask of a sequence (key index <= query index; the loops stop
at the diagonal) or arbitrary positions (kp_j <= qp_i, every key block visited). Feature sizes are
padded with zeros (which change no product) to a power of two, at least the smallest reduction of a
Triton matrix product (4 in float64, 8 in float32, 16 in the half types, with Triton 3.9; heads of at most 3
features in float32 and the half types take the FMA kernels of :mod:`meanfield.triton_small_heads` instead);
float32 and float64 products are IEEE (no TF32), so results agree with the CPU to rounding; each
block's product is summed apart and the sums over blocks are compensated (Kahan summation,
``meanfield.triton_shared.kahan_add``), so a float32 pass over 1e5 keys keeps the error of one block (1.3e-7
relative on an H200, where one accumulation chain lost 2.5e-4).

Inputs are 3-D (batch, rows, features) with any strides (a key tensor expanded over the batch is read,
never copied). On a machine without a GPU the kernels run in Triton's interpreter on CPU tensors when
``TRITON_INTERPRET=1`` is set before ``triton`` is first imported (the tests do so). Which path uses them:
:mod:`meanfield.accelerator_paths`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .accelerator_paths import TRITON_DTYPES, TRITON_MAX_FEATURES, small_heads, triton_width
from .triton_shared import INTERPRETED as _INTERPRETED
from .triton_shared import kahan_add as _add
from .triton_shared import kahan_sum as _sum

__all__ = ["forward", "jvp", "backward", "padded"]


def padded(size: int, dtype=torch.float32) -> int:
    """The tile width of a feature size (:func:`meanfield.accelerator_paths.triton_width`)."""
    return triton_width(size, dtype)


def _blocks(dtype, width: int, kernel: str = "forward"):
    """(BLOCK_M, BLOCK_N, num_warps) of ``kernel`` for this dtype and padded width: for the widths the
    streamed kernel sends here (accelerator_paths.TRITON_MAX_WIDTH) every kernel compiles without register
    spills for sm_80 and sm_90 (tests/test_triton_compile.py); wider ones (forced) get small tiles."""
    if _INTERPRETED:
        return 16, 16, 1
    if kernel == "backward_q" and dtype == torch.float32 and width <= 8:
        return 64, 64, 4
    if dtype in (torch.float16, torch.bfloat16):
        return (64, 32, 4) if width <= 32 else (32, 32, 4)
    if dtype == torch.float64:
        return 32, 32, 4
    if width <= 8:
        return 64, 64, 8
    if width <= IEEE_MAX_WIDTH:
        return 64, 32, 4
    if width <= 64:
        # three-pass TF32 products (:func:`_precision`); no spills for sm_90 at width 64 with these
        return WIDE_BLOCKS[kernel]
    return 32, 16, 4


#: float32 products are IEEE (CUDA-core FMAs) up to this padded width, and three-pass TF32 above it
IEEE_MAX_WIDTH = 16
#: tiles of the float32 kernels at widths 32 and 64 (three-pass TF32 products)
WIDE_BLOCKS = {"forward": (128, 32, 8), "jvp": (64, 16, 4), "backward_q": (128, 32, 8), "backward_kv": (32, 32, 8)}


def _precision(dtype, width: int = 0):
    """Products in IEEE float32 / float64 (TF32 alone would lose 3 decimal digits); for float32 heads wider
    than :data:`IEEE_MAX_WIDTH` "tf32x3": each operand split into a TF32 part and a TF32 remainder, three
    tensor-core products (all but the remainders' product), about float32's accuracy, as torch's
    memory-efficient attention kernel computes in float32. Ignored for the half types."""
    if dtype == torch.float32 and width > IEEE_MAX_WIDTH:
        return "tf32x3"
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


# ---------------------------------------------------------------------- tile helpers (inlined)
@triton.jit
def _load_rows(ptr, rows, rmask, cols, ncols, s_row, s_col):
    """A (rows, cols) tile of a row-major-strided matrix, zero outside."""
    return tl.load(ptr + rows[:, None] * s_row + cols[None, :] * s_col,
                   mask=rmask[:, None] & (cols[None, :] < ncols), other=0.0)


@triton.jit
def _load_cols(ptr, rows, rmask, cols, ncols, s_row, s_col):
    """The transpose (cols, rows) of :func:`_load_rows`'s tile."""
    return tl.load(ptr + rows[None, :] * s_row + cols[:, None] * s_col,
                   mask=rmask[None, :] & (cols[:, None] < ncols), other=0.0)


@triton.jit
def _scores(q, kT, LW, s_lw, QP_i, KP, s_kp, rows, cols, cmask, HAS_LW: tl.constexpr, HAS_POS: tl.constexpr,
            CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """s_ij for a (BLOCK_M, BLOCK_N) tile: q k^T + log a_j, -inf where masked or beyond the keys."""
    s = tl.dot(q, kT, input_precision=PREC)
    if HAS_LW:
        s += tl.load(LW + cols * s_lw, mask=cmask, other=-float("inf"))[None, :]
    else:
        s = tl.where(cmask[None, :], s, -float("inf"))
    if HAS_POS:
        kp = tl.load(KP + cols * s_kp, mask=cmask, other=0)
        s = tl.where(kp[None, :] <= QP_i[:, None], s, -float("inf"))
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None], s, -float("inf"))
    return s


# ---------------------------------------------------------------------- forward
@triton.jit
def _forward_kernel(Q, K, V, LW, QP, KP, OUT, LSE,
                    sqb, sqm, sqe, skb, skn, ske, svb, svn, svc, slb, sln, spb, spm, skpb, skpn,
                    sob, som, soc, sLb, sLm,
                    m, n, e, c,
                    HAS_LW: tl.constexpr, HAS_POS: tl.constexpr, CAUSAL: tl.constexpr,
                    E: tl.constexpr, C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREC: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < m
    fe, fc = tl.arange(0, E), tl.arange(0, C)
    q = _load_rows(Q + b * sqb, rows, rmask, fe, e, sqm, sqe)
    qp = rows
    if HAS_POS:
        qp = tl.load(QP + b * spb + rows * spm, mask=rmask, other=0)
    run_max = tl.full([BLOCK_M], -float("inf"), ACC)
    run_sum = tl.zeros([BLOCK_M], ACC)
    sum_carry = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, C], ACC)
    acc_carry = tl.zeros([BLOCK_M, C], ACC)
    hi = n
    if CAUSAL:
        hi = tl.minimum(n, (pid + 1) * BLOCK_M)
    for j0 in range(0, hi, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cmask = cols < n
        kT = _load_cols(K + b * skb, cols, cmask, fe, e, skn, ske)
        s = _scores(q, kT, LW + b * slb, sln, qp, KP + b * skpb, skpn, rows, cols, cmask,
                    HAS_LW, HAS_POS, CAUSAL, PREC).to(ACC)
        new_max = tl.maximum(run_max, tl.max(s, 1))
        # a row whose keys are all masked so far has max -inf: shift by 0 instead (its terms are all 0)
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(run_max - shift)
        vb = _load_rows(V + b * svb, cols, cmask, fc, c, svn, svc)
        pv = tl.dot(p.to(vb.dtype), vb, input_precision=PREC).to(ACC)
        acc, acc_carry = _add(acc * alpha[:, None], acc_carry * alpha[:, None], pv)
        run_sum, sum_carry = _add(run_sum * alpha, sum_carry * alpha, tl.sum(p, 1))
        run_max = new_max
    acc = _sum(acc, acc_carry)
    run_sum = _sum(run_sum, sum_carry)
    live = run_sum > 0
    out = acc / tl.where(live, run_sum, 1.0)[:, None]
    lse = tl.where(live, run_max + tl.log(tl.where(live, run_sum, 1.0)), -float("inf"))
    tl.store(OUT + b * sob + rows[:, None] * som + fc[None, :] * soc, out.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & (fc[None, :] < c))
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
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < m
    fe, fc = tl.arange(0, E), tl.arange(0, C)
    q = _load_rows(Q + b * sqb, rows, rmask, fe, e, sqm, sqe)
    qp = rows
    if HAS_POS:
        qp = tl.load(QP + b * spb + rows * spm, mask=rmask, other=0)
    lse = tl.load(LSE + b * sLb + rows * sLm, mask=rmask, other=-float("inf")).to(ACC)
    # rows with no visible key (L = -inf): P = exp(s - inf) = 0
    lse = tl.where(lse == -float("inf"), float("inf"), lse)
    tq = q
    if HAS_TQ:
        tq = _load_rows(TQ + b * stqb, rows, rmask, fe, e, stqm, stqe)
    acc = tl.zeros([BLOCK_M, C], ACC)
    acc_carry = tl.zeros([BLOCK_M, C], ACC)
    row = tl.zeros([BLOCK_M], ACC)
    row_carry = tl.zeros([BLOCK_M], ACC)
    hi = n
    if CAUSAL:
        hi = tl.minimum(n, (pid + 1) * BLOCK_M)
    for j0 in range(0, hi, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cmask = cols < n
        kT = _load_cols(K + b * skb, cols, cmask, fe, e, skn, ske)
        s = _scores(q, kT, LW + b * slb, sln, qp, KP + b * skpb, skpn, rows, cols, cmask,
                    HAS_LW, HAS_POS, CAUSAL, PREC).to(ACC)
        p = tl.exp(s - lse[:, None])
        if HAS_TV:
            tvb = _load_rows(TV + b * stvb, cols, cmask, fc, c, stvn, stvc)
            acc, acc_carry = _add(acc, acc_carry, tl.dot(p.to(tvb.dtype), tvb, input_precision=PREC).to(ACC))
        if HAS_TQ or HAS_TK or HAS_TLW:
            ds = tl.zeros([BLOCK_M, BLOCK_N], ACC)
            if HAS_TQ:
                ds += tl.dot(tq, kT, input_precision=PREC).to(ACC)
            if HAS_TK:
                tkT = _load_cols(TK + b * stkb, cols, cmask, fe, e, stkn, stke)
                ds += tl.dot(q, tkT, input_precision=PREC).to(ACC)
            if HAS_TLW:
                ds += tl.load(TLW + b * stlb + cols * stln, mask=cmask, other=0.0).to(ACC)[None, :]
            pds = p * ds
            vb = _load_rows(V + b * svb, cols, cmask, fc, c, svn, svc)
            acc, acc_carry = _add(acc, acc_carry, tl.dot(pds.to(vb.dtype), vb, input_precision=PREC).to(ACC))
            row, row_carry = _add(row, row_carry, tl.sum(pds, 1))
    acc = _sum(acc, acc_carry)
    row = _sum(row, row_carry)
    out = _load_rows(OUT + b * sob, rows, rmask, fc, c, som, soc).to(ACC)
    d_out = acc - row[:, None] * out
    # the outputs are contiguous (B, m, c) and (B, m)
    tl.store(DOUT + b * m * c + rows[:, None] * c + fc[None, :], d_out.to(DOUT.dtype.element_ty),
             mask=rmask[:, None] & (fc[None, :] < c))
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
    """dq for one query block: dq_i = sum_j P_ij (<dO_i, v_j> - D_i) k_j."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < m
    fe, fc = tl.arange(0, E), tl.arange(0, C)
    q = _load_rows(Q + b * sqb, rows, rmask, fe, e, sqm, sqe)
    qp = rows
    if HAS_POS:
        qp = tl.load(QP + b * spb + rows * spm, mask=rmask, other=0)
    lse = tl.load(LSE + b * sLb + rows * sLm, mask=rmask, other=-float("inf")).to(ACC)
    lse = tl.where(lse == -float("inf"), float("inf"), lse)
    go = _load_rows(GO + b * sgb, rows, rmask, fc, c, sgm, sgc)
    delta = tl.load(DELTA + b * m + rows, mask=rmask, other=0.0).to(ACC)
    dq = tl.zeros([BLOCK_M, E], ACC)
    dq_carry = tl.zeros([BLOCK_M, E], ACC)
    hi = n
    if CAUSAL:
        hi = tl.minimum(n, (pid + 1) * BLOCK_M)
    for j0 in range(0, hi, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cmask = cols < n
        kT = _load_cols(K + b * skb, cols, cmask, fe, e, skn, ske)
        s = _scores(q, kT, LW + b * slb, sln, qp, KP + b * skpb, skpn, rows, cols, cmask,
                    HAS_LW, HAS_POS, CAUSAL, PREC).to(ACC)
        p = tl.exp(s - lse[:, None])
        vT = _load_cols(V + b * svb, cols, cmask, fc, c, svn, svc)
        dp = tl.dot(go, vT, input_precision=PREC).to(ACC)
        ds = p * (dp - delta[:, None])
        dq, dq_carry = _add(dq, dq_carry, tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PREC).to(ACC))
    dq = _sum(dq, dq_carry)
    tl.store(DQ + b * m * e + rows[:, None] * e + fe[None, :], dq.to(DQ.dtype.element_ty),
             mask=rmask[:, None] & (fe[None, :] < e))


@triton.jit
def _backward_kv_kernel(Q, K, V, LW, QP, KP, LSE, GO, DELTA, DK, DV, DLW,
                        sqb, sqm, sqe, skb, skn, ske, svb, svn, svc, slb, sln, spb, spm, skpb, skpn,
                        sLb, sLm, sgb, sgm, sgc,
                        m, n, e, c,
                        HAS_LW: tl.constexpr, HAS_POS: tl.constexpr, CAUSAL: tl.constexpr,
                        NEED_DK: tl.constexpr, NEED_DV: tl.constexpr, NEED_DLW: tl.constexpr,
                        E: tl.constexpr, C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        PREC: tl.constexpr, ACC: tl.constexpr):
    """dk, dv, d(log a) for one key block, summing over query blocks (scores as (BLOCK_M, BLOCK_N) tiles)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    fe, fc = tl.arange(0, E), tl.arange(0, C)
    kT = _load_cols(K + b * skb, cols, cmask, fe, e, skn, ske)
    vT = _load_cols(V + b * svb, cols, cmask, fc, c, svn, svc)
    dk = tl.zeros([BLOCK_N, E], ACC)
    dv = tl.zeros([BLOCK_N, C], ACC)
    dlw = tl.zeros([BLOCK_N], ACC)
    dk_carry = tl.zeros([BLOCK_N, E], ACC)
    dv_carry = tl.zeros([BLOCK_N, C], ACC)
    dlw_carry = tl.zeros([BLOCK_N], ACC)
    lo = 0
    if CAUSAL:
        lo = (pid * BLOCK_N // BLOCK_M) * BLOCK_M  # query blocks before the diagonal see none of these keys
    for i0 in range(lo, m, BLOCK_M):
        rows = i0 + tl.arange(0, BLOCK_M)
        rmask = rows < m
        q = _load_rows(Q + b * sqb, rows, rmask, fe, e, sqm, sqe)
        qp = rows
        if HAS_POS:
            qp = tl.load(QP + b * spb + rows * spm, mask=rmask, other=0)
        lse = tl.load(LSE + b * sLb + rows * sLm, mask=rmask, other=-float("inf")).to(ACC)
        lse = tl.where(lse == -float("inf"), float("inf"), lse)
        s = _scores(q, kT, LW + b * slb, sln, qp, KP + b * skpb, skpn, rows, cols, cmask,
                    HAS_LW, HAS_POS, CAUSAL, PREC).to(ACC)
        p = tl.exp(s - lse[:, None])
        go = _load_rows(GO + b * sgb, rows, rmask, fc, c, sgm, sgc)
        if NEED_DV:
            dv, dv_carry = _add(dv, dv_carry, tl.dot(tl.trans(p.to(go.dtype)), go, input_precision=PREC).to(ACC))
        if NEED_DK or NEED_DLW:
            delta = tl.load(DELTA + b * m + rows, mask=rmask, other=0.0).to(ACC)
            dp = tl.dot(go, vT, input_precision=PREC).to(ACC)
            ds = p * (dp - delta[:, None])
            if NEED_DK:
                dk, dk_carry = _add(dk, dk_carry, tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC).to(ACC))
            if NEED_DLW:
                dlw, dlw_carry = _add(dlw, dlw_carry, tl.sum(ds, 0))
    dk, dv, dlw = _sum(dk, dk_carry), _sum(dv, dv_carry), _sum(dlw, dlw_carry)
    if NEED_DK:
        tl.store(DK + b * n * e + cols[:, None] * e + fe[None, :], dk.to(DK.dtype.element_ty),
                 mask=cmask[:, None] & (fe[None, :] < e))
    if NEED_DV:
        tl.store(DV + b * n * c + cols[:, None] * c + fc[None, :], dv.to(DV.dtype.element_ty),
                 mask=cmask[:, None] & (fc[None, :] < c))
    if NEED_DLW:
        tl.store(DLW + b * n + cols, dlw.to(DLW.dtype.element_ty), mask=cmask)


# ---------------------------------------------------------------------- launchers
def _common(q, k, v, lw, qp, kp, causal):
    """Pointer arguments, strides and flags shared by every kernel (absent tensors: q and zero strides)."""
    B, m, e = q.shape
    n, c = k.shape[1], v.shape[2]
    has_pos = qp is not None and not causal
    lw_, qp_, kp_ = (lw if lw is not None else q), (qp if has_pos else q), (kp if has_pos else q)
    s_lw = lw.stride() if lw is not None else (0, 0)
    s_qp = qp.stride() if has_pos else (0, 0)
    s_kp = kp.stride() if has_pos else (0, 0)
    ptrs = (q, k, v, lw_, qp_, kp_)
    strides = (*q.stride(), *k.stride(), *v.stride(), *s_lw, *s_qp, *s_kp)
    flags = dict(HAS_LW=lw is not None, HAS_POS=has_pos, CAUSAL=bool(causal))
    # small heads: the FMA kernels of meanfield.triton_small_heads, on the features themselves (no padding)
    E, C = (e, c) if small_heads(e, c, q.dtype) else (padded(e, q.dtype), padded(c, q.dtype))
    meta = dict(E=E, C=C, PREC=_precision(q.dtype, max(E, C)),
                ACC=tl.float64 if q.dtype == torch.float64 else tl.float32)
    return B, m, n, e, c, ptrs, strides, flags, meta


def _kernel(name, q, e, c):
    """The kernel ``name`` for heads of e (q, k) and c (v) features in q's dtype: :mod:`meanfield.triton_small_heads`'s
    where :func:`meanfield.accelerator_paths.small_heads` says so, this module's otherwise."""
    if small_heads(e, c, q.dtype):
        from .triton_small_heads import KERNELS

        return KERNELS[name]
    return globals()[f"_{name}_kernel"]   # looked up at the call (a test's spy replaces the module's)


def _tiles(q, meta, kernel, e, c):
    """Block sizes and launch options of ``kernel`` (:func:`_blocks`, or the small heads' own)."""
    if small_heads(e, c, q.dtype):
        from .triton_small_heads import blocks

        bm, bn, warps = blocks(q.dtype, kernel)
    else:
        bm, bn, warps = _blocks(q.dtype, max(meta["E"], meta["C"]), kernel)
    return dict(BLOCK_M=bm, BLOCK_N=bn, **({} if _INTERPRETED else dict(num_warps=warps)))


def _check(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in TRITON_DTYPES:
            raise TypeError(f"{name}: the Triton kernels take {TRITON_DTYPES}, got {t.dtype}")
    if max(q.shape[-1], v.shape[-1]) > TRITON_MAX_FEATURES:
        raise ValueError(f"q, v: the Triton kernels take at most {TRITON_MAX_FEATURES} features, "
                         f"got {q.shape[-1]} and {v.shape[-1]}")
    if q.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError(f"q: the Triton kernels run on CUDA tensors (got {q.device}); on CPU set "
                           "TRITON_INTERPRET=1 before triton is first imported")


#: the largest grid size CUDA takes on its second axis (the batch of every kernel here)
GRID_Y_MAX = 65535


def _batch_chunks(kernel_call):
    """``kernel_call`` over batches above :data:`GRID_Y_MAX` entries: run on chunks of at most that many (every
    tensor argument is batched along its first dimension, expanded ones included: slicing keeps their stride 0),
    the results concatenated."""
    def run(q, *args):
        B = q.shape[0]
        if B <= GRID_Y_MAX:
            return kernel_call(q, *args)
        parts = []
        for b0 in range(0, B, GRID_Y_MAX):
            cut = lambda t, b0=b0: t[b0:b0 + GRID_Y_MAX] if isinstance(t, torch.Tensor) else t
            parts.append(kernel_call(cut(q), *map(cut, args)))
        return tuple(None if r[0] is None else torch.cat(r) for r in zip(*parts))
    run.__doc__, run.__name__, run.__wrapped__ = kernel_call.__doc__, kernel_call.__name__, kernel_call
    return run


def _lse_dtype(dtype):
    # L of the half types in float32: the backward recomputes P = exp(s - L), whose relative error is
    # the absolute error of L (bfloat16 would give percents)
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@_batch_chunks
def forward(q, k, v, lw, qp, kp, causal):
    """(out (B, m, c), L (B, m)) of 3-D inputs; ``causal``: the positions are a sequence's causal mask.
    L is float32 for the half types."""
    _check(q, k, v)
    B, m, n, e, c, ptrs, strides, flags, meta = _common(q, k, v, lw, qp, kp, causal)
    out = q.new_empty(B, m, c)
    lse = q.new_empty(B, m, dtype=_lse_dtype(q.dtype))
    if m == 0 or B == 0:
        return out, lse
    tiles = _tiles(q, meta, "forward", e, c)
    grid = (triton.cdiv(m, tiles["BLOCK_M"]), B)
    _kernel("forward", q, e, c)[grid](*ptrs, out, lse, *strides, *out.stride(), *lse.stride(), m, n, e, c,
                          **flags, **meta, **tiles)
    return out, lse


@_batch_chunks
def jvp(q, k, v, lw, qp, kp, causal, out, lse, tq, tk, tv, tlw):
    """(d out, d L): the JVP of :func:`forward` at (q, k, v, lw) along (tq, tk, tv, tlw) (None: zero)."""
    _check(q, k, v)
    B, m, n, e, c, ptrs, strides, flags, meta = _common(q, k, v, lw, qp, kp, causal)
    d_out = q.new_empty(B, m, c)
    d_lse = q.new_empty(B, m, dtype=_lse_dtype(q.dtype))
    if m == 0 or B == 0:
        return d_out, d_lse
    tans = [t if t is not None else q for t in (tq, tk, tv)] + [tlw if tlw is not None else q]
    tstr = []
    for t, rank in zip((tq, tk, tv, tlw), (3, 3, 3, 2)):
        tstr += list(t.stride()) if t is not None else [0] * rank
    tiles = _tiles(q, meta, "jvp", e, c)
    grid = (triton.cdiv(m, tiles["BLOCK_M"]), B)
    _kernel("jvp", q, e, c)[grid](*ptrs, out, lse, *tans, d_out, d_lse, *strides, *out.stride(), *lse.stride(), *tstr,
                      m, n, e, c, **flags, HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
                      HAS_TLW=tlw is not None, **meta, **tiles)
    return d_out, d_lse


@_batch_chunks
def backward(q, k, v, lw, qp, kp, causal, out, lse, g_out, g_lse, need):
    """(dq, dk, dv, dlw): the VJP of (out, L) with cotangents (g_out, g_lse or None); ``need`` = 4 flags."""
    _check(q, k, v)
    B, m, n, e, c, ptrs, strides, flags, meta = _common(q, k, v, lw, qp, kp, causal)
    need = (need[0], need[1], need[2], bool(need[3]) and lw is not None)
    # D_i = <dO_i, out_i> in the kernels' accumulator precision (_lse_dtype: float32 for the half types, as L): in
    # float16 the products and their sum overflow where each factor is finite (|dO| = 2000 against |out| = 10
    # over 4 features: 8e4 > 65504), and every row's rounding would enter ds_ij = P_ij (dP_ij - D_i), a
    # difference of two nearly equal numbers. (float32 and float64: .to is no copy)
    wide = _lse_dtype(q.dtype)
    delta = (g_out.to(wide) * out.to(wide)).sum(-1)
    if g_lse is not None:
        delta = delta - g_lse  # a cotangent on L_i adds P_ij g_i to ds_ij
    delta = delta.contiguous()
    dq = q.new_zeros(B, m, e) if need[0] else None
    dk = q.new_zeros(B, n, e) if need[1] else None
    dv = q.new_zeros(B, n, c) if need[2] else None
    dlw = q.new_zeros(B, n) if need[3] else None
    if m == 0 or n == 0 or B == 0:
        return dq, dk, dv, dlw
    tail = (*lse.stride(), *g_out.stride(), m, n, e, c)
    if need[0]:
        tiles = _tiles(q, meta, "backward_q", e, c)
        grid = (triton.cdiv(m, tiles["BLOCK_M"]), B)
        _kernel("backward_q", q, e, c)[grid](*ptrs, lse, g_out, delta, dq, *strides, *tail, **flags, **meta, **tiles)
    if need[1] or need[2] or need[3]:
        tiles = _tiles(q, meta, "backward_kv", e, c)
        grid = (triton.cdiv(n, tiles["BLOCK_N"]), B)
        _kernel("backward_kv", q, e, c)[grid](*ptrs, lse, g_out, delta, dk if need[1] else q, dv if need[2] else q,
                                  dlw if need[3] else q, *strides, *tail, **flags, NEED_DK=need[1],
                                  NEED_DV=need[2], NEED_DLW=need[3], **meta, **tiles)
    return dq, dk, dv, dlw
