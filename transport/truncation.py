r"""Kernel truncation of the streaming Sinkhorn at its last eps: block-sparse soft-min passes.

At a small eps the terms of a Sinkhorn row, exp((f_i + g_j - C_ij) / eps + log b_j), are negligible
except for the j whose y_j lies near the image of x_i: at blur 0.05 on the unit cube about a fifth of
the pairs matter. The points of each side are sorted along a Z-order (Morton) curve and cut into
blocks of consecutive points, spatially compact, with their bounding boxes; for a row block I and a
column tile J every exponent of the half-step is bounded by

    bound_IJ = (max_I f + max_J (g + eps log b) - dist(box_I, box_J)^2) / eps,

and the tiles with bound_IJ < -tau are skipped (each row block keeps its best tile whatever the bound).
A row's skipped terms sum to at most m e^-tau relative to the scale f_i sets, which near the solution
is the row's own mass: tau = log m + log(100 / tol) keeps that below tol / 100. This is the kernel
truncation of Schmitzer (2019) and of GeomLoss's multiscale backend, with a bound instead of cluster
centres, and recomputed at every half-step from the current potentials (a few milliseconds against a
pass over the N M entries).

The truncated passes only drive the iterations: before the solver's stopping test the last step of g is
redone dense (the columns exact) and the test itself uses a dense pass of the rows
(:func:`transport.tiles.update`), so a reported error is always that of the whole plan
(``transport.streaming_sinkhorn._solve_pair``). A truncated pass that computes more than
:data:`MAX_FRACTION` of the entries turns truncation off for its problem (the boxes are too wide for the
blur: small N, or a blur comparable to the cloud). On CUDA a truncated half-step is one
Triton kernel over each row block's kept tiles (:func:`transport.triton_softmin.lse_rows_blocks`);
on CPU a loop over row blocks, each one product against the kept columns.
"""

from __future__ import annotations

import math

import torch

from particles.device import run_triton

from . import tiles
from .tiles import cofactors, exp_floor, factors, safe, update

__all__ = ["ENABLED", "MIN_ENTRIES", "CUDA_FACTOR", "MAX_DIM", "MAX_FRACTION", "TILE", "large_enough", "applies",
           "morton_order", "tau", "Blocks", "kept_tiles", "truncated_update"]

#: Truncate at all (benchmarks turn it off to time the dense passes beside the truncated ones)
ENABLED = True
#: below this many entries N M a dense pass is cheap enough (and the blocks too coarse to skip much)
MIN_ENTRIES = 2**26
#: the largest dimension truncated; in more, boxes of a few hundred points are nearly as wide as the cloud
MAX_DIM = 6
#: a truncated pass computing more than this fraction of the entries turns truncation off for the problem
#: (per entry it costs about what a dense pass costs, plus the bounds)
MAX_FRACTION = 0.5
#: columns per tile (a multiple of every Triton column block)
TILE = 256
#: rows per block on CPU; on CUDA the Triton kernel's rows per program
CPU_ROWS = 64


#: the gate on CUDA is this many times MIN_ENTRIES, since a dense pass there is one fast kernel launch and the
#: bounds cost host syncs (measured on an H200, benchmarks/gpu.md, an untruncated solve took 60.7 ms against
#: 75.9 at N = M = 1e4, 139 against 142 at 2e4, 1.16 s against 0.88 at 1e5)
CUDA_FACTOR = 4


def on_cuda(device) -> bool:
    """Whether ``device`` (a torch.device, a string, an index, which torch reads as a GPU's, or None: the CPU)
    is a CUDA device."""
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return torch.device(device).type == "cuda"


def large_enough(n: int, m: int, d: int, device=None, cuda_factor: int = CUDA_FACTOR) -> bool:
    """Whether an n x m problem in dimension d on ``device`` is one for blocks of Z-ordered points: d at most
    MAX_DIM and n m at least MIN_ENTRIES (on CUDA ``cuda_factor`` times that)."""
    return d <= MAX_DIM and n * m >= MIN_ENTRIES * (cuda_factor if on_cuda(device) else 1)


def applies(n: int, m: int, d: int, device=None) -> bool:
    """Whether the last eps level runs truncated passes (for an n x m problem in dimension d on ``device``)."""
    return ENABLED and large_enough(n, m, d, device)


def tau(m: int, tol: float) -> float:
    """The skipping threshold: m e^-tau = tol / 100."""
    return math.log(m) + math.log(100.0 / tol)


def morton_order(x: torch.Tensor) -> torch.Tensor:
    """The permutation sorting the rows of x (N, d) along a Z-order curve of a 2^bits grid (bits = 63 // d,
    at most 16): consecutive points are spatially close, so blocks of them have small boxes."""
    n, d = x.shape
    bits = min(16, 63 // max(1, d))
    lo, hi = x.min(0).values, x.max(0).values
    q = ((x - lo) / (hi - lo).clamp_min(torch.finfo(x.dtype).tiny) * (2**bits - 1)).round().long()
    code = torch.zeros(n, dtype=torch.long, device=x.device)
    for b in range(bits):
        for k in range(d):
            code |= ((q[:, k] >> b) & 1) << (b * d + k)
    return torch.argsort(code)


class Blocks:
    """Points already in Z-order, cut into blocks of ``size``: each block's box (lo, hi), and per-block maxima."""

    def __init__(self, x: torch.Tensor, size: int):
        self.n, self.size = x.shape[0], int(size)
        self.count = -(-self.n // self.size)
        pad = self.count * self.size - self.n
        xp = torch.cat([x, x[-1:].expand(pad, -1)]) if pad else x
        xb = xp.view(self.count, self.size, -1)
        self.lo, self.hi = xb.min(1).values, xb.max(1).values

    def max(self, v: torch.Tensor) -> torch.Tensor:
        pad = self.count * self.size - self.n
        vp = torch.cat([v, v.new_full((pad,), -math.inf)]) if pad else v
        return vp.view(self.count, self.size).max(1).values


def kept_tiles(rows: Blocks, cols: Blocks, fmax, hmax, eps: float, threshold: float):
    """(ptr, tiles) in CSR form, int32 on the rows' device: row block r keeps the column tiles
    tiles[ptr[r]:ptr[r + 1]], those whose bound (module docstring) is at least -threshold, and its best one."""
    counts, kept = [], []
    chunk = max(1, 2**22 // max(1, cols.count * rows.lo.shape[1]))
    for s in range(0, rows.count, chunk):
        lo, hi = rows.lo[s:s + chunk, None], rows.hi[s:s + chunk, None]
        gap = (cols.lo[None] - hi).clamp_min(0.0) + (lo - cols.hi[None]).clamp_min(0.0)
        bound = (fmax[s:s + chunk, None] + hmax[None, :] - (gap * gap).sum(-1)) / eps
        keep = bound >= -threshold
        keep[torch.arange(keep.shape[0], device=keep.device), bound.argmax(1)] = True
        counts.append(keep.sum(1))
        kept.append(keep.nonzero()[:, 1])
    ptr = torch.zeros(rows.count + 1, dtype=torch.int64, device=rows.lo.device)
    ptr[1:] = torch.cumsum(torch.cat(counts), 0)
    return ptr.to(torch.int32), torch.cat(kept).to(torch.int32)


def truncated_update(x, xx, y, yy, log_b, f, g, eps, rows: Blocks, cols: Blocks, threshold: float):
    """delta = T(g) - f as :func:`transport.tiles.update` computes it, over the kept tiles only; also returns
    the fraction of the N M entries computed. Points of both sides in Z-order, cut as ``rows`` / ``cols``."""
    fmax = rows.max(f)
    hmax = cols.max(g + eps * log_b)
    ptr, kept = kept_tiles(rows, cols, fmax, hmax, eps, threshold)
    A, B = factors(x, xx, f, eps), cofactors(y, yy, g, log_b, eps)
    fraction = kept.numel() * cols.size / max(1, rows.count * cols.count * cols.size)
    if tiles._fused(x):   # where the dense half-step is the Triton soft-min, the truncated one is its twin
        def kernel():
            from .triton_softmin import lse_rows_blocks

            return lse_rows_blocks(A, B, ptr, kept, cols.size).mul_(-eps)

        return run_triton(("sinkhorn truncated soft-min", x.device.type, x.dtype, x.shape[1]), kernel,
                          lambda: _tiles(A, B, ptr, kept, rows, cols, eps), "w2 (streaming)"), fraction
    return _tiles(A, B, ptr, kept, rows, cols, eps), fraction


def _tiles(A, B, ptr, kept, rows: Blocks, cols: Blocks, eps):
    """The truncated half-step in torch: per row block, one product against its kept columns, summed in one
    pass relative to f as :func:`transport.tiles.row_sums` does; rows outside its safe range (:func:`safe`)
    again, max-shifted."""
    n, m = A.shape[0], B.shape[1]
    out = torch.empty(n, dtype=A.dtype, device=A.device)
    floor = exp_floor(A.dtype)
    ptr, kept = ptr.tolist(), kept.to(torch.int64)
    offsets = torch.arange(cols.size, device=A.device)
    for r in range(rows.count):
        r0, r1 = r * rows.size, min(n, (r + 1) * rows.size)
        idx = (kept[ptr[r]:ptr[r + 1], None] * cols.size + offsets).reshape(-1)
        idx = idx[idx < m]
        Bk = B[:, idx]
        S = (A[r0:r1] @ Bk).clamp_min_(floor).exp_().sum(1)
        bad = ~safe(S, idx.numel())
        delta = S.log_().mul_(-eps)
        if bool(bad.any()):
            delta[bad] = torch.logsumexp(A[r0:r1][bad] @ Bk, 1).mul_(-eps)
        out[r0:r1] = delta
    return out


#: a dense stopping test that misses tol although the truncated one met it raises tau by this much
TIGHTEN = 5.0


def row_size(x: torch.Tensor) -> int:
    """Rows per block: the Triton kernel's rows per program where the half-steps run as Triton kernels
    (:func:`transport.tiles.update`'s rule: CUDA with Triton), else :data:`CPU_ROWS`."""
    if tiles._fused(x):
        from .triton_softmin import row_block

        return row_block(x.dtype, x.shape[1] + 2)[0]
    return CPU_ROWS


class Truncation:
    """The truncated half-steps of one problem at its last eps, points of both sides in Z-order."""

    def __init__(self, x, xx, y, yy, log_a, log_b, eps: float, tol: float, chunk: int):
        self.x, self.xx, self.y, self.yy, self.log_a, self.log_b, self.eps = x, xx, y, yy, log_a, log_b, eps
        self.chunk, self.off = chunk, False
        self.rx, self.cy = Blocks(x, row_size(x)), Blocks(y, TILE)
        self.ry, self.cx = (self.rx, self.cy) if y is x else (Blocks(y, row_size(y)), Blocks(x, TILE))
        self.threshold = tau(max(x.shape[0], y.shape[0]), tol)

    def rows(self, f, g):
        """delta of f (the x side), truncated (dense once truncation no longer pays, :data:`MAX_FRACTION`)."""
        return self._step(self.x, self.xx, self.y, self.yy, self.log_b, f, g, self.rx, self.cy)

    def cols(self, g, f):
        """delta of g (the y side), truncated (or dense, as :meth:`rows`)."""
        return self._step(self.y, self.yy, self.x, self.xx, self.log_a, g, f, self.ry, self.cx)

    def _step(self, x, xx, y, yy, log_b, f, g, rows, cols):
        if self.off:
            return update(x, xx, y, yy, log_b, f, g, self.eps, self.chunk)
        out, fraction = truncated_update(x, xx, y, yy, log_b, f, g, self.eps, rows, cols, self.threshold)
        if fraction > MAX_FRACTION:
            self.off = True   # the boxes are too wide for this blur: dense passes from now on
        return out

    def tighten(self) -> None:
        self.threshold += TIGHTEN


def unsort(v: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """v given in the order ``perm`` sorted to, back in the caller's order."""
    out = torch.empty_like(v)
    out[perm] = v
    return out
