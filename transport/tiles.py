r"""The soft-min of the streaming Sinkhorn, in cache-sized tiles with one exponential per entry.

A Sinkhorn half-step replaces the potential f by the soft c-transform of g (docs/math.md section 3.2),

    T(g)_i = -eps log sum_j b_j exp((g_j - C_ij) / eps),       C_ij = \|x_i - y_j\|^2.

Written relative to the current f it is

    T(g)_i = f_i - eps log S_i,       S_i = sum_j b_j exp((f_i + g_j - C_ij) / eps),

where a_i S_i is the i-th row mass of the plan pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps). Sinkhorn
drives S_i to 1, so from the first iterations on the terms of S_i are summed as they are, without the
max-shift of a log-sum-exp (a pass over every entry and two temporaries): one matrix product writes
the exponents of a tile, ``exp_`` overwrites them in place, one reduction sums them. The exponent is
the product of two thin factors,

    (f_i + g_j - C_ij) / eps + log b_j = <A_i, B_j>,
    A_i = (2 x_i / eps, (f_i - \|x_i\|^2) / eps, 1),     B_j = (y_j, 1, (g_j - \|y_j\|^2) / eps + log b_j),

whose rounding is that of the log-sum-exp it replaces (the same terms, summed by the same product).
A row whose S_i leaves the range where its terms are exact (overflow, or the terms that matter
underflowing: the first iterations, a new eps level, far-off potentials) is recomputed with the
max-shifted log-sum-exp of :func:`softmin`, so the result never depends on how good f was.
Memory: one tile of ``chunk_elements`` entries and O(N + M) vectors; CPU and CUDA alike.

On CUDA with Triton (shipped with torch's CUDA wheels on Linux) the half-step is one kernel instead
(:mod:`transport.triton_softmin`): the tiles stay in registers and the log-sum-exp is max-shifted
online, exact for any potentials, so neither the safe-range test nor the fallback (nor their host
synchronisations) is needed. The routines still made of tiles there (:func:`plan_tiles` for gradients
and costs, :func:`softmin` for atoms of zero mass) take tiles sized by the device's memory budget
(:func:`device_chunk`) rather than the CPU-cache-sized default.
"""

from __future__ import annotations

import math

import torch

from particles.device import memory_budget, run_triton, triton_runs

__all__ = ["softmin", "factors", "cofactors", "exp_floor", "row_sums", "safe", "update", "plan_tiles", "device_chunk"]

#: on CUDA the default chunk (cache-sized for a CPU) becomes tiles of this fraction of the memory budget
DEVICE_BUDGET_FRACTION = 0.25
#: ... and at most this many entries (1 GiB of float32): larger tiles no longer amortize anything
DEVICE_MAX_CHUNK = 2**28


def rows_per_block(m: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(m, 1))


def softmin(x, xx, y, yy, log_b, g, eps, chunk_elements):
    """f_i = -eps log sum_j exp(log b_j + (g_j - \\|x_i - y_j\\|^2) / eps), max-shifted, block by block over i.

    ``xx``, ``yy``: the squared norms of the rows of ``x``, ``y``. Exact for any potentials (the
    fallback of :func:`update`). Tensor routine of the solver (no checks): points should be centred so
    that \\|x\\|^2 carries no avoidable cancellation.
    """
    h = (log_b + (g - yy) / eps)[None, :]
    yt = y.T
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    step = rows_per_block(y.shape[0], chunk_elements)
    for s in range(0, x.shape[0], step):
        block = torch.addmm(h, x[s:s + step], yt, alpha=2.0 / eps)
        out[s:s + step] = torch.logsumexp(block, dim=1)
    return xx - eps * out


def factors(x, xx, f, eps, log_a=None):
    """A (N, d + 2): rows (2 x_i / eps, (f_i - \\|x_i\\|^2) / eps [+ log a_i], 1)."""
    u = (f - xx) / eps
    if log_a is not None:
        u = u + log_a
    return torch.cat([x * (2.0 / eps), u[:, None], torch.ones_like(u)[:, None]], dim=1)


def cofactors(y, yy, g, log_b, eps):
    """B (d + 2, M): columns (y_j, 1, (g_j - \\|y_j\\|^2) / eps + log b_j), so that A @ B is the exponent."""
    v = (g - yy) / eps + log_b
    return torch.cat([y, torch.ones_like(v)[:, None], v[:, None]], dim=1).T.contiguous()


#: Fewest rows of a tile: below it the product of the thin factors runs far from the GEMM rate when they
#: are wide (d = 64, one thread: 26 ns per entry with tiles of 2 whole rows of M = 10^5, 3.5 ns with 64
#: rows of 4096 columns; d = 3 gains 1.7x, benchmarks/transport.md).
MIN_ROWS = {True: 64, False: 16}


def _tile_shape(n: int, m: int, chunk_elements: int, k: int) -> tuple[int, int]:
    """(rows, cols) of a tile of at most ``chunk_elements`` entries for factors of width k: whole rows
    while that leaves enough rows (MIN_ROWS), else MIN_ROWS rows of a part of a row."""
    rows = max(1, chunk_elements // max(m, 1))
    floor = MIN_ROWS[k > 8]
    if rows < floor:
        rows = floor
    rows = min(n, rows)
    return rows, max(1, min(m, chunk_elements // rows))


#: Raise tile exponents to :func:`exp_floor` before ``exp_`` (benchmarks/bench_transport.py --relaxation turns
#: it off to time the previous tiles beside the current ones)
CLAMP_UNDERFLOW = True


def _clamped_exp_(tile, floor):
    return (tile.clamp_min_(floor) if CLAMP_UNDERFLOW else tile).exp_()


def exp_floor(dtype) -> float:
    """The exponent every tile is raised to before ``exp_``: log of the smallest normal number, plus 1.

    On CPU, exponentials whose result is subnormal or zero take the vector library's slow path: 5 ns
    instead of 0.4-0.8 ns per entry (float32 / float64, 2 threads, benchmarks/transport.md), and a
    Sinkhorn plan at small blur is mostly such entries. Raised to this floor, each lost term becomes
    e x tiny instead of below tiny: :func:`safe` accounts for it.
    """
    return math.log(torch.finfo(dtype).tiny) + 1.0


def row_sums(A, B, chunk_elements):
    """S_i = sum_j exp(<A_i, B_j>), tile by tile (tiles of at most ``chunk_elements`` entries), no max-shift.

    Exact where the terms neither overflow nor underflow (see :func:`safe`); one buffer for every tile.
    Exponents below :func:`exp_floor` are raised to it (terms of at most e x tiny).
    """
    n, m = A.shape[0], B.shape[1]
    rows, cols = _tile_shape(n, m, chunk_elements, A.shape[1])
    buf = torch.empty(rows * cols, dtype=A.dtype, device=A.device)
    out = torch.empty(n, dtype=A.dtype, device=A.device)
    floor = exp_floor(A.dtype)
    if cols == m:
        for s in range(0, n, rows):
            r = min(rows, n - s)
            tile = buf[:r * m].view(r, m)
            torch.mm(A[s:s + r], B, out=tile)
            _clamped_exp_(tile, floor)
            torch.sum(tile, 1, out=out[s:s + r])
        return out
    out.zero_()
    part = torch.empty(rows, dtype=A.dtype, device=A.device)
    for s, r, _, _, tile in _exp_tiles(A, B, rows, cols, buf):
        torch.sum(tile, 1, out=part[:r])
        out[s:s + r] += part[:r]
    return out


def _exp_tiles(A, B, rows, cols, buf):
    """Yield (row start, rows, column start, columns, exp(A_rows B_cols)) over every tile, in ``buf``
    (overwritten by the next tile); exponents below :func:`exp_floor` raised to it."""
    n, m = A.shape[0], B.shape[1]
    floor = exp_floor(A.dtype)
    for s in range(0, n, rows):
        r = min(rows, n - s)
        for c in range(0, m, cols):
            w = min(cols, m - c)
            tile = buf[:r * w].view(r, w)
            torch.mm(A[s:s + r], B[:, c:c + w], out=tile)
            yield s, r, c, w, _clamped_exp_(tile, floor)


def safe(S, m: int):
    """Where a sum of ``m`` exponentials is exact to the dtype's precision: every term finite (S <= max)
    and the terms lost to underflow (each below e x the smallest normal number once raised to
    :func:`exp_floor`) negligible against S (m e tiny / S <= machine epsilon). False for NaN."""
    fi = torch.finfo(S.dtype)
    return (S >= m * math.e * fi.tiny / fi.eps) & (S <= fi.max)


def _fused(x) -> bool:
    """Whether the half-step runs as the Triton kernel: CUDA tensors, Triton installed."""
    return x.device.type == "cuda" and triton_runs("cuda")


def device_chunk(chunk_elements: int, default: int, device, element_size: int, temporaries: int,
                 memory_limit=None) -> int:
    """The tile size of the tiled routines on ``device``: ``chunk_elements`` as given on CPU, or when it is
    not the ``default`` (a choice of the caller); on another device the default, sized for a CPU's cache
    (thousands of tiny launches per half-step on a GPU), grows to :data:`DEVICE_BUDGET_FRACTION` of the
    memory budget (:func:`particles.device.memory_budget`) spread over ``temporaries`` buffers."""
    device = torch.device(device)
    if device.type == "cpu" or chunk_elements != default:
        return chunk_elements
    room = int(DEVICE_BUDGET_FRACTION * memory_budget(device, memory_limit)) // (temporaries * element_size)
    return max(chunk_elements, min(DEVICE_MAX_CHUNK, room))


def update(x, xx, y, yy, log_b, f, g, eps, chunk_elements):
    """delta = T(g) - f, the change of a Sinkhorn half-step on the x side (see the module docstring).

    Returns delta (N,): -eps log S_i where S_i is :func:`safe`, ``softmin(...) - f`` on the other rows
    (T(g) never depends on f; only the cost does: the fallback rows are computed twice). a_i
    exp(-delta_i / eps) is the i-th row mass of the plan (f, g), so the marginal error needs no
    subtraction of close numbers. On CUDA with Triton: -eps times the max-shifted log-sum-exp of the
    same exponents, in one kernel (:func:`transport.triton_softmin.lse_rows`), for every row.
    """
    if _fused(x):
        def kernel():
            from .triton_softmin import lse_rows

            return lse_rows(factors(x, xx, f, eps), cofactors(y, yy, g, log_b, eps)).mul_(-eps)

        return run_triton(("sinkhorn soft-min", x.device.type, x.dtype, x.shape[1]), kernel,
                          lambda: _update_tiles(x, xx, y, yy, log_b, f, g, eps, chunk_elements), "w2 (streaming)")
    return _update_tiles(x, xx, y, yy, log_b, f, g, eps, chunk_elements)


def _update_tiles(x, xx, y, yy, log_b, f, g, eps, chunk_elements):
    S = row_sums(factors(x, xx, f, eps), cofactors(y, yy, g, log_b, eps), chunk_elements)
    bad = ~safe(S, y.shape[0])
    delta = S.log_().mul_(-eps)
    if bool(bad.any()):
        idx = bad.nonzero()[:, 0]
        delta[idx] = softmin(x[idx], xx[idx], y, yy, log_b, g, eps, chunk_elements) - f[idx]
    return delta


def plan_tiles(x, y, log_a, log_b, f, g, eps, chunk_elements):
    """Yield (rows, cols, pi tile) covering pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps), one buffer reused.

    The tile is overwritten by the next one: use it before asking for the next.
    """
    A = factors(x, (x * x).sum(1), f, eps, log_a)
    B = cofactors(y, (y * y).sum(1), g, log_b, eps)
    n, m = x.shape[0], y.shape[0]
    rows, cols = _tile_shape(n, m, chunk_elements, A.shape[1])
    buf = torch.empty(rows * cols, dtype=x.dtype, device=x.device)
    for s, r, c, w, tile in _exp_tiles(A, B, rows, cols, buf):
        yield slice(s, s + r), slice(c, c + w), tile
