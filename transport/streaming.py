"""Large-N entropic W2: a streaming log-domain Sinkhorn in torch, memory O((N + M) d + chunk).

The N x M cost matrix is never stored: every Sinkhorn half-step is a soft-min

    f_i = -eps log sum_j b_j exp((g_j - |x_i - y_j|^2) / eps)
        = |x_i|^2 - eps LSE_j( log b_j + (g_j - |y_j|^2) / eps + (2 / eps) <x_i, y_j> ),

evaluated on blocks of rows with one matrix product and one log-sum-exp per block (the online
log-sum-exp of Feydy et al.'s GeomLoss, here in plain torch so the same code runs on CPU and
CUDA, float32 or float64). eps-scaling (annealing eps from the squared diameter down to ``reg``,
one update per level, then iterating to convergence at ``reg``) cuts the iteration count from
O(diam^2 / eps) to a few dozen. Conventions are those of :mod:`transport.sinkhorn`.

Gradients with respect to the points use the envelope theorem (the potentials are optimal, so
dOT_eps/dx_i = sum_j pi_ij 2 (x_i - y_j)), computed block by block in a custom autograd
function: the backward pass is O(N) in memory too. Weights are treated as constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from particles import Measure

from ._common import check_reg, check_tol_iter, common_shift, report_nonconvergence

#: Elements of the largest (rows x M) block held at once: 2^18 is 2 MiB in float64, small enough to stay in
#: cache (2.3x faster than 32 MiB blocks at N = 4000 on one CPU thread, benchmarks/transport.md).
DEFAULT_CHUNK_ELEMENTS = 2 ** 18


@dataclass(frozen=True)
class SinkhornResult:
    """Outcome of :func:`sinkhorn_streaming`.

    value: S_eps (debias) or <pi_eps, C> (no debias), a 0-d tensor (with autograd graph when the
    points require grad). f, g: dual potentials of OT_eps(mu, nu) on the supports of mu and nu.
    error: L1 marginal error reached; iterations: Sinkhorn updates of the (mu, nu) problem,
    eps-scaling levels included; converged: error <= tol.
    """

    value: torch.Tensor
    f: torch.Tensor
    g: torch.Tensor
    error: float
    iterations: int
    converged: bool


def _rows_per_block(m: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(m, 1))


def _softmin(x, xx, y, yy, log_b, g, eps, chunk_elements):
    """f_i = -eps log sum_j exp(log b_j + (g_j - |x_i - y_j|^2) / eps), block by block over i."""
    h = (log_b + (g - yy) / eps)[None, :]
    yt = y.T
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    step = _rows_per_block(y.shape[0], chunk_elements)
    for s in range(0, x.shape[0], step):
        block = torch.addmm(h, x[s:s + step], yt, alpha=2.0 / eps)
        out[s:s + step] = torch.logsumexp(block, dim=1)
    return xx - eps * out


def _plan_blocks(x, y, log_a, log_b, f, g, eps, chunk_elements):
    """Yield (row slice, pi block) of pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)."""
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    step = _rows_per_block(y.shape[0], chunk_elements)
    col = (log_b + (g - yy) / eps)[None, :]
    for s in range(0, x.shape[0], step):
        sl = slice(s, s + step)
        row = (log_a[sl] + (f[sl] - xx[sl]) / eps)[:, None]
        yield sl, torch.exp(torch.addmm(col + row, x[sl], y.T, alpha=2.0 / eps))


class _EntropicValue(torch.autograd.Function):
    """<a, f> + <b, g> = OT_eps at optimal potentials; backward by the envelope theorem, streamed."""

    @staticmethod
    def forward(ctx, x, y, f, g, log_a, log_b, eps, chunk_elements):
        ctx.save_for_backward(x, y, f, g, log_a, log_b)
        ctx.eps, ctx.chunk = eps, chunk_elements
        return (log_a.exp() * f).sum() + (log_b.exp() * g).sum()

    @staticmethod
    def backward(ctx, grad):
        x, y, f, g, log_a, log_b = ctx.saved_tensors
        gx, gy = torch.zeros_like(x), torch.zeros_like(y)
        col_mass = torch.zeros(y.shape[0], dtype=y.dtype, device=y.device)
        for sl, pi in _plan_blocks(x, y, log_a, log_b, f, g, ctx.eps, ctx.chunk):
            gx[sl] = pi.sum(1)[:, None] * x[sl] - pi @ y
            gy -= pi.T @ x[sl]
            col_mass += pi.sum(0)
        gy += col_mass[:, None] * y
        return 2.0 * grad * gx, 2.0 * grad * gy, None, None, None, None, None, None


def _schedule(x, y, reg, scaling):
    """eps levels from the squared diameter of both clouds down to reg (factor scaling^2 each)."""
    if scaling is None:
        return [reg]
    both = torch.cat([x.detach(), y.detach()])
    diam2 = float(((both.max(0).values - both.min(0).values) ** 2).sum())
    levels, eps = [], max(diam2, reg)
    while eps > reg:
        levels.append(eps)
        eps *= scaling ** 2
    return levels + [reg]


def _solve_pair(x, y, log_a, log_b, reg, tol, max_iter, scaling, chunk):
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    a = log_a.exp()
    f = torch.zeros_like(xx)
    g = torch.zeros_like(yy)
    levels = _schedule(x, y, reg, scaling)
    for eps in levels[:-1]:
        f = _softmin(x, xx, y, yy, log_b, g, eps, chunk)
        g = _softmin(y, yy, x, xx, log_a, f, eps, chunk)
    it = len(levels) - 1
    f = _softmin(x, xx, y, yy, log_b, g, reg, chunk)
    g = _softmin(y, yy, x, xx, log_a, f, reg, chunk)
    err = math.inf
    while True:
        f_new = _softmin(x, xx, y, yy, log_b, g, reg, chunk)
        # row marginal of the plan (f, g) is a_i exp((f_i - f_new_i) / eps); its columns are exact
        err = float((a * torch.expm1((f - f_new) / reg).abs()).sum())
        f = f_new
        it += 1
        if err <= tol or it >= max_iter:
            break
        g = _softmin(y, yy, x, xx, log_a, f, reg, chunk)
    return f, g, err, it


def _solve_self(x, log_a, reg, tol, max_iter, scaling, chunk):
    """Symmetric Sinkhorn for OT_eps(mu, mu): f <- (f + softmin(f)) / 2 converges in few steps."""
    xx = (x * x).sum(1)
    a = log_a.exp()
    f = torch.zeros_like(xx)
    levels = _schedule(x, x, reg, scaling)
    for eps in levels[:-1]:
        f = 0.5 * (f + _softmin(x, xx, x, xx, log_a, f, eps, chunk))
    it, err = 0, math.inf
    while it < max_iter:
        t = _softmin(x, xx, x, xx, log_a, f, reg, chunk)
        err = float((a * torch.expm1((f - t) / reg).abs()).sum())
        f = 0.5 * (f + t)
        it += 1
        if err <= tol:
            break
    return f, err


def _transport_cost(x, y, log_a, log_b, f, g, eps, chunk):
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    total = x.new_zeros(())
    for sl, pi in _plan_blocks(x, y, log_a, log_b, f, g, eps, chunk):
        C = (xx[sl, None] + yy[None, :] - 2.0 * x[sl] @ y.T).clamp_min(0.0)
        total = total + (pi * C).sum()
    return total


def sinkhorn_streaming(mu: Measure, nu: Measure, reg: float, *, debias: bool = True, tol: float | None = None,
                       max_iter: int = 5000, scaling: float | None = 0.5,
                       chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, strict: bool = False) -> SinkhornResult:
    """Entropic W2^2 between two Measures without forming the N x M cost matrix.

    ``reg`` is eps (squared-distance units). ``tol``: L1 marginal error at which to stop (None:
    1e-7 in float64, 1e-5 in float32; the relative error of the value is of that order).
    Plain Sinkhorn converges linearly with a rate that degrades when reg falls far below the
    squared spacing of the atoms (isolated atoms are weakly coupled): thousands of iterations.
    ``scaling``: eps-scaling ratio in (0, 1) (None: no
    annealing). Not converged after ``max_iter`` updates: SinkhornConvergenceWarning with the
    reached error (RuntimeError when ``strict``). Differentiable in the points when
    ``debias=True`` (envelope gradient); ``debias=False`` returns a value without gradient.
    """
    reg = check_reg(reg, "streaming")
    if tol is None:
        tol = 1e-7 if mu.dtype == torch.float64 else 1e-5
    tol, max_iter = check_tol_iter(tol, max_iter)
    if scaling is not None and not 0.0 < float(scaling) < 1.0:
        raise ValueError(f"scaling: expected a ratio in (0, 1) or None, got {scaling}")
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements: expected a positive integer, got {chunk_elements!r}")
    grad = mu.points.requires_grad or nu.points.requires_grad
    if grad and not debias:
        raise ValueError("debias: gradients of the streaming path are available for debias=True only "
                         "(the cost of the entropic plan has no envelope formula)")
    c = common_shift(mu, nu)
    sa, sb = mu.log_weights > -math.inf, nu.log_weights > -math.inf
    xg, yg = mu.points[sa] - c, nu.points[sb] - c
    la, lb = mu.log_weights[sa].detach(), nu.log_weights[sb].detach()
    x, y = xg.detach(), yg.detach()
    with torch.no_grad():
        f, g, err, it = _solve_pair(x, y, la, lb, reg, tol, max_iter, scaling, chunk_elements)
        if debias:
            f_xx, err_x = _solve_self(x, la, reg, tol, max_iter, scaling, chunk_elements)
            f_yy, err_y = _solve_self(y, lb, reg, tol, max_iter, scaling, chunk_elements)
            err_all = max(err, err_x, err_y)
        else:
            err_all = err
    if err_all > tol:
        report_nonconvergence(err_all, tol, it, strict, "w2 (streaming)")
    if debias:
        val = _EntropicValue.apply(xg, yg, f, g, la, lb, reg, chunk_elements)
        val = val - 0.5 * _EntropicValue.apply(xg, xg, f_xx, f_xx, la, la, reg, chunk_elements)
        val = val - 0.5 * _EntropicValue.apply(yg, yg, f_yy, f_yy, lb, lb, reg, chunk_elements)
    else:
        with torch.no_grad():
            val = _transport_cost(x, y, la, lb, f, g, reg, chunk_elements)
    return SinkhornResult(val, f, g, err_all, it, err_all <= tol)
