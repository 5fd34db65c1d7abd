r"""The soft-min of the streaming Sinkhorn as one Triton kernel: L_i = log sum_j exp(<A_i, B_j>), O(N) memory.

With the thin factors of :mod:`transport.tiles` (A_i = (2 x_i / eps, (f_i - \|x_i\|^2) / eps, 1),
B_j = (y_j, 1, (g_j - \|y_j\|^2) / eps + log b_j)), the Sinkhorn half-step is delta_i = -eps L_i. Each
program holds a block of rows and sweeps the columns in (BLOCK_M, BLOCK_N) tiles kept in registers,
with an online max-shifted log-sum-exp: one exponential per entry, nothing of size N M in memory, and
exact for any potentials (no overflow, no lost terms), so the safe-range test and the fallback of
:func:`transport.tiles.update` are not needed. The exponent is formed as the CPU path forms it (the same
products of the same factors) by an IEEE matrix product (no TF32) of the factors zero-padded to a power
of two.

Runs compiled on CUDA; on CPU tensors in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
``triton`` was first imported (the tests do so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lse_rows", "lse_rows_blocks", "row_block"]

_INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"


def _width(K: int, dtype) -> int:
    """Columns of the factors in the kernel: zero-padded to a power of two, at least the smallest reduction
    of a Triton matrix product that the installed Triton accepts (:func:`particles.device.triton_min_dot_k`:
    8 in float32 and 4 in float64 with Triton 3.9, 16 with 3.6): d = 3 (K = 5) takes 8 or 16."""
    from particles.device import triton_min_dot_k

    return max(triton_min_dot_k(8 * torch.empty((), dtype=dtype).element_size()), triton.next_power_of_2(K))


def _blocks(dtype, width: int):
    """(BLOCK_M, BLOCK_N, num_warps): for these widths the kernel compiles for sm_80 and sm_90 without
    register spills (tests/test_triton_compile.py); IEEE products of wide factors are CUDA-core
    FMAs whose registers grow with the width, hence the small tiles."""
    if _INTERPRETED:
        return 16, 16, 1
    if width <= 8:
        return (128, 64, 8) if dtype == torch.float32 else (64, 64, 4)
    if width <= 16:
        return 64, 32, 4
    return (32, 16, 4) if dtype == torch.float32 else (32, 32, 4)


@triton.jit
def _lse_rows_start(A, pid, n, sa_n, sa_k, K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr,
                    ACC: tl.constexpr):
    """A program's rows, their mask, the factor columns, the rows' factors and the empty running (max, sum)."""
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n
    fk = tl.arange(0, KP)
    a = tl.load(A + rows[:, None] * sa_n + fk[None, :] * sa_k, mask=rmask[:, None] & (fk[None, :] < K), other=0.0)
    return rows, rmask, fk, a, tl.full([BLOCK_M], -float("inf"), ACC), tl.zeros([BLOCK_M], ACC)


@triton.jit
def _lse_rows_store(OUT, rows, rmask, run_max, run_sum):
    """L = max + log(shifted sum) of each row (-inf where no term), stored in OUT's dtype."""
    out = tl.where(run_sum > 0, run_max + tl.log(tl.where(run_sum > 0, run_sum, 1.0)), -float("inf"))
    tl.store(OUT + rows, out.to(OUT.dtype.element_ty), mask=rmask)


@triton.jit
def _lse_step(a, B, cols, m, fk, sb_k, sb_m, run_max, run_sum, K: tl.constexpr, ACC: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of the online max-shifted log-sum-exp: the columns ``cols`` of B (those
    at or beyond m masked out) against the rows' factors ``a``; returns the updated (max, shifted sum)."""
    cmask = cols < m
    b = tl.load(B + fk[:, None] * sb_k + cols[None, :] * sb_m, mask=(fk[:, None] < K) & cmask[None, :], other=0.0)
    s = tl.dot(a, b, input_precision="ieee").to(ACC)
    s = tl.where(cmask[None, :], s, -float("inf"))
    new_max = tl.maximum(run_max, tl.max(s, 1))
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)
    run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
    return new_max, run_sum


@triton.jit
def _lse_kernel(A, B, OUT, n, m, sa_n, sa_k, sb_k, sb_m,
                K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    rows, rmask, fk, a, run_max, run_sum = _lse_rows_start(A, pid, n, sa_n, sa_k, K, KP, BLOCK_M, ACC)
    for j0 in range(0, m, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        run_max, run_sum = _lse_step(a, B, cols, m, fk, sb_k, sb_m, run_max, run_sum, K, ACC)
    _lse_rows_store(OUT, rows, rmask, run_max, run_sum)


def _launch_shape(A: torch.Tensor, B: torch.Tensor):
    """(n, m, K, KP, BLOCK_M, BLOCK_N, num_warps) of a soft-min launch, after the checks of its factors."""
    if A.dtype not in (torch.float32, torch.float64) or B.dtype != A.dtype:
        raise TypeError(f"A, B: expected one dtype, float32 or float64, got {A.dtype} and {B.dtype}")
    if A.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError(f"A: the Triton soft-min runs on CUDA tensors (got {A.device}); on CPU set "
                           "TRITON_INTERPRET=1 before triton is first imported")
    n, K = A.shape
    KP = _width(K, A.dtype)
    return (n, B.shape[1], K, KP, *_blocks(A.dtype, KP))


def lse_rows(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """L (n,): L_i = log sum_j exp(sum_k A_ik B_kj) for A (n, K) and B (K, m) (float32 or float64)."""
    n, m, K, KP, bm, bn, warps = _launch_shape(A, B)
    out = A.new_empty(n)
    if n == 0:
        return out
    grid = (triton.cdiv(n, bm),)
    _lse_kernel[grid](A, B, out, n, m, *A.stride(), *B.stride(), K=K, KP=KP, BLOCK_M=bm, BLOCK_N=bn,
                      ACC=tl.float64 if A.dtype == torch.float64 else tl.float32,
                      **({} if _INTERPRETED else dict(num_warps=warps)))
    return out


@triton.jit
def _lse_blocks_kernel(A, B, OUT, PTR, TILES, n, m, sa_n, sa_k, sb_k, sb_m, TILE: tl.constexpr,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       ACC: tl.constexpr):
    # as _lse_kernel, over the column tiles TILES[PTR[pid]:PTR[pid + 1]] (each TILE columns) only
    pid = tl.program_id(0)
    rows, rmask, fk, a, run_max, run_sum = _lse_rows_start(A, pid, n, sa_n, sa_k, K, KP, BLOCK_M, ACC)
    start = tl.load(PTR + pid)
    end = tl.load(PTR + pid + 1)
    for t in range(start, end):
        c0 = tl.load(TILES + t) * TILE
        for j0 in range(0, TILE, BLOCK_N):
            cols = c0 + j0 + tl.arange(0, BLOCK_N)
            run_max, run_sum = _lse_step(a, B, cols, m, fk, sb_k, sb_m, run_max, run_sum, K, ACC)
    _lse_rows_store(OUT, rows, rmask, run_max, run_sum)


def row_block(dtype, K: int) -> tuple[int, int]:
    """(rows per program, column granularity) of :func:`lse_rows_blocks` for factors of K columns: the
    truncation's row blocks must have that many rows, its column tiles a multiple of the granularity."""
    bm, bn, _ = _blocks(dtype, _width(K, dtype))
    return bm, bn


def lse_rows_blocks(A: torch.Tensor, B: torch.Tensor, ptr: torch.Tensor, tiles: torch.Tensor, tile: int):
    """L (n,): L_i = log sum over the kept columns j of exp(<A_i, B_j>): row block r (rows r BLOCK_M ..,
    BLOCK_M from :func:`row_block`) sums the column tiles ``tiles[ptr[r]:ptr[r + 1]]``, tile t being the
    columns t ``tile`` .. (t + 1) ``tile`` - 1 (``tile`` a multiple of :func:`row_block`'s granularity).
    Max-shifted online as :func:`lse_rows`; -inf for a row block with no tile."""
    n, m, K, KP, bm, bn, warps = _launch_shape(A, B)
    out = A.new_empty(n)
    if n == 0:
        return out
    if tile % bn or ptr.numel() != triton.cdiv(n, bm) + 1:
        raise ValueError(f"tile, ptr: expected a tile multiple of {bn} and {triton.cdiv(n, bm) + 1} offsets (row "
                         f"blocks of {bm}), got tile {tile} and {ptr.numel()} offsets")
    _lse_blocks_kernel[(triton.cdiv(n, bm),)](
        A, B, out, ptr, tiles, n, m, *A.stride(), *B.stride(), TILE=tile, K=K, KP=KP, BLOCK_M=bm, BLOCK_N=bn,
        ACC=tl.float64 if A.dtype == torch.float64 else tl.float32, **({} if _INTERPRETED else dict(num_warps=warps)))
    return out
