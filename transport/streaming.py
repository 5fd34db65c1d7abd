r"""Large-N entropic W2: a streaming log-domain Sinkhorn in torch, memory O((N + M) d + chunk).

The N x M cost matrix is never stored: every Sinkhorn half-step is a soft-min

    f_i = -eps log sum_j b_j exp((g_j - \|x_i - y_j\|^2) / eps)
        = \|x_i\|^2 - eps LSE_j( log b_j + (g_j - \|y_j\|^2) / eps + (2 / eps) <x_i, y_j> ),

evaluated tile by tile (:mod:`transport.tiles`): relative to the current potential, one matrix
product of thin factors writes a tile's exponents, ``exp_`` and one reduction finish it, without the
max-shift of a log-sum-exp; rows where that would overflow or lose terms to underflow (first
iterations, far-off potentials) are recomputed with the max-shifted log-sum-exp. Plain torch, so
the same code runs on CPU and CUDA, float32 or float64.

eps-scaling (annealing eps from the squared diameter down to ``reg``, one update per level, then
iterating to convergence at ``reg``) cuts the iteration count from O(diam^2 / eps) to a few dozen.
Conventions are those of :mod:`transport.sinkhorn` (docs/math.md section 3.2).

Gradients with respect to the points use the envelope theorem (the potentials are optimal, so
dOT_eps/dx_i = sum_j pi_ij 2 (x_i - y_j)), computed block by block in a custom autograd
function: the backward pass is O(N) in memory too. Weights are treated as constants.

Every loop is bounded: the eps-scaling levels and the Sinkhorn updates together by ``max_iter``.
"""

from __future__ import annotations

import math
import warnings

import torch

from particles import Measure
from particles.validation import ConvergenceError, check_allocation, check_on_failure

from .options import DEFAULT_CHUNK_ELEMENTS, check_memory_limit, resolve
from .problem import Problem, ldexp
from .result import worst_error
from .tiles import device_chunk, plan_tiles, softmin, update

__all__ = ["symmetric_potential"]

#: Temporaries of one block of the soft-min (the product, its exponentials, the reduction), in elements
#: of the block: used to estimate the solver's memory before running it.
BLOCK_TEMPORARIES = 3


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
        row_mass = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        for rs, cs, pi in plan_tiles(x, y, log_a, log_b, f, g, ctx.eps, ctx.chunk):
            gx[rs] -= pi @ y[cs]
            gy[cs] -= pi.T @ x[rs]
            row_mass[rs] += pi.sum(1)
            col_mass[cs] += pi.sum(0)
        gx += row_mass[:, None] * x
        gy += col_mass[:, None] * y
        return 2.0 * grad * gx, 2.0 * grad * gy, None, None, None, None, None, None


def _schedule(x, y, eps, scaling, max_iter):
    """eps levels from the squared diameter of both clouds down to eps (factor scaling^2 each).

    At most ``max_iter`` levels: a longer schedule (scaling close to 1, or eps far below the squared
    diameter) is refused before any work, so that the annealing can never run away.
    """
    if scaling == 0:
        return [eps]
    both = torch.cat([x.detach(), y.detach()])
    diam2 = float(((both.max(0).values - both.min(0).values) ** 2).sum())
    levels, e = [], max(diam2, eps)
    for _ in range(max_iter):
        if not e > eps:
            return levels + [eps]
        levels.append(e)
        e *= scaling ** 2
    raise ValueError(f"scaling: annealing over squared diameter / reg = {diam2 / eps:.3g} with scaling = {scaling} "
                     f"takes more than max_iter = {max_iter} levels; use a smaller scaling or a larger max_iter")


def _solve_pair(x, y, log_a, log_b, eps, tol, max_iter, scaling, chunk):
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    a = log_a.exp()
    f = torch.zeros_like(xx)
    g = torch.zeros_like(yy)
    levels = _schedule(x, y, eps, scaling, max_iter)
    # every half-step is tiled relative to the current potentials (tiles.update); rows where they are
    # too far off for that (the first levels) fall back to the max-shifted soft-min
    for e in levels:
        f = f + update(x, xx, y, yy, log_b, f, g, e, chunk)
        g = g + update(y, yy, x, xx, log_a, g, f, e, chunk)
    it = len(levels) - 1
    while True:
        delta = update(x, xx, y, yy, log_b, f, g, eps, chunk)
        # row marginal of the plan (f, g) is a_i exp(-delta_i / eps); its columns are exact
        err = float((a * torch.expm1(-delta / eps).abs()).sum())
        f = f + delta
        it += 1
        if err <= tol or it >= max_iter or math.isnan(err):
            break
        g = g + update(y, yy, x, xx, log_a, g, f, eps, chunk)
    return f, g, err, it


def _solve_symmetric(x, log_a, eps, tol, max_iter, scaling, chunk):
    """Symmetric Sinkhorn for OT_eps(mu, mu): f <- (f + softmin(f)) / 2 converges in few steps."""
    xx = (x * x).sum(1)
    a = log_a.exp()
    f = torch.zeros_like(xx)
    levels = _schedule(x, x, eps, scaling, max_iter)
    for e in levels[:-1]:
        f = f + 0.5 * update(x, xx, x, xx, log_a, f, f, e, chunk)
    it, err = 0, math.inf
    while it < max_iter:
        delta = update(x, xx, x, xx, log_a, f, f, eps, chunk)
        err = float((a * torch.expm1(-delta / eps).abs()).sum())
        f = f + 0.5 * delta
        it += 1
        if err <= tol or math.isnan(err):
            break
    return f, err, it


def _transport_cost(x, y, log_a, log_b, f, g, eps, chunk):
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    total = x.new_zeros(())
    for rs, cs, pi in plan_tiles(x, y, log_a, log_b, f, g, eps, chunk):
        C = torch.addmm(xx[rs, None] + yy[None, cs], x[rs], y[cs].T, alpha=-2.0).clamp_min_(0.0)
        total = total + (pi * C).sum()
    return total


def _check_blocks(n: int, m: int, chunk: int, element_size: int, memory_limit) -> None:
    check_allocation(BLOCK_TEMPORARIES * max(chunk, n, m) * element_size,
                     f"w2 (streaming) with blocks of chunk_elements = {chunk}",
                     "use a smaller chunk_elements", memory_limit)


def extend_potential(f, support, x_all, y, log_b, g, eps, chunk):
    """Potential on every atom: ``f`` on the support, the soft c-transform of ``g`` on atoms of zero mass."""
    if bool(support.all()):
        return f
    out = torch.empty(x_all.shape[0], dtype=f.dtype, device=f.device)
    out[support] = f
    rest = x_all[~support]
    out[~support] = softmin(rest, (rest * rest).sum(1), y, (y * y).sum(1), log_b, g, eps, chunk)
    return out


def solve_streaming(problem: Problem, eps: float, opts: dict, return_plan: bool = False, memory_limit=None) -> dict:
    """Routine of method "streaming": S_eps or <pi_eps, C> in normalized units, and what it reached.

    Never forms the plan (``return_plan`` is refused by :func:`transport.solve` before this runs).
    """
    debias, tol, max_iter = opts["debias"], opts["tol"], opts["max_iter"]
    scaling = opts["scaling"]
    chunk = device_chunk(opts["chunk_elements"], DEFAULT_CHUNK_ELEMENTS, problem.x.device, problem.x.element_size(),
                         BLOCK_TEMPORARIES, memory_limit)
    if problem.grad and not debias:
        raise ValueError("debias: gradients of the streaming path are available for debias=True only "
                         "(the cost of the entropic plan has no envelope formula)")
    _check_blocks(problem.n, problem.m, chunk, problem.x.element_size(), memory_limit)
    sa, sb = problem.log_a > -math.inf, problem.log_b > -math.inf
    xg, yg = problem.x[sa], problem.y[sb]
    la, lb = problem.log_a[sa].detach(), problem.log_b[sb].detach()
    x, y = xg.detach(), yg.detach()
    with torch.no_grad():
        f, g, err, it = _solve_pair(x, y, la, lb, eps, tol, max_iter, scaling, chunk)
        if debias:
            f_xx, err_x, _ = _solve_symmetric(x, la, eps, tol, max_iter, scaling, chunk)
            f_yy, err_y, _ = _solve_symmetric(y, lb, eps, tol, max_iter, scaling, chunk)
            err = worst_error(err, err_x, err_y)
    if debias:
        val = _EntropicValue.apply(xg, yg, f, g, la, lb, eps, chunk)
        val = val - 0.5 * _EntropicValue.apply(xg, xg, f_xx, f_xx, la, la, eps, chunk)
        val = val - 0.5 * _EntropicValue.apply(yg, yg, f_yy, f_yy, lb, lb, eps, chunk)
    else:
        with torch.no_grad():
            val = _transport_cost(x, y, la, lb, f, g, eps, chunk)
    with torch.no_grad():
        x_all, y_all = problem.x.detach(), problem.y.detach()
        potentials = (extend_potential(f, sa, x_all, y, lb, g, eps, chunk),
                      extend_potential(g, sb, y_all, x, la, f, eps, chunk))
    return dict(value=val, plan=None, potentials=potentials, error=err, iterations=it)


def symmetric_potential(mu: Measure, reg, *, tol=None, max_iter=None, scaling=None, chunk_elements=None,
                        on_failure: str = "raise", memory_limit=None):
    r"""The potential f of OT_eps(mu, mu), the self-transport term of the Sinkhorn divergence.

    f is the fixed point of f = softmin_eps(f), f_i = -eps log sum_j a_j exp((f_j - \|x_i - x_j\|^2) / eps),
    found by the averaged iteration f <- (f + softmin_eps(f)) / 2 (Feydy et al. 2019, section 3.1),
    which converges in a few steps where the alternating updates of a general solver stall near
    tol = 1e-7. Then OT_eps(mu, mu) = 2 <a, f> and the self coupling is
    pi_ij = a_i a_j exp((f_i + f_j - \|x_i - x_j\|^2) / eps). Memory O(N) (streamed).

    Parameters
    ----------
    mu : Measure (float32 or float64)
    reg : eps > 0, POT's entropic regularization on squared distances (see :func:`transport.solve`).
    tol, max_iter, scaling, chunk_elements : as for ``method="streaming"`` of :func:`transport.solve`
        (defaults in :data:`transport.DEFAULTS`).
    on_failure : "raise" (a ConvergenceError whose ``.estimate`` is the triple below) or "warn".
    memory_limit : bytes (or "16G") the blocks may take (default ``$SMOOTH_ATTENTION_MEMORY_LIMIT``).

    Returns
    -------
    (f, error, iterations) : the potential (N,) in squared-distance units (the soft c-transform on
        atoms of zero mass), the L1 marginal error of the self coupling, the updates made.
    """
    check_on_failure(on_failure)
    memory_limit = check_memory_limit(memory_limit)
    problem = Problem(mu, mu)
    opts = resolve("streaming", dict(reg=reg, tol=tol, max_iter=max_iter, scaling=scaling,
                                     chunk_elements=chunk_elements), mu.dtype)
    if opts["reg"] is None:
        raise ValueError("reg: symmetric_potential needs an entropic regularization reg > 0")
    eps = problem.eps(opts["reg"])
    chunk = device_chunk(opts["chunk_elements"], DEFAULT_CHUNK_ELEMENTS, problem.x.device, problem.x.element_size(),
                         BLOCK_TEMPORARIES, memory_limit)
    _check_blocks(mu.n, mu.n, chunk, problem.x.element_size(), memory_limit)
    sa = problem.log_a > -math.inf
    x, la = problem.x.detach()[sa], problem.log_a.detach()[sa]
    with torch.no_grad():
        f, err, it = _solve_symmetric(x, la, eps, opts["tol"], opts["max_iter"], opts["scaling"], chunk)
        f = ldexp(extend_potential(f, sa, problem.x.detach(), x, la, f, eps, chunk), 2 * problem.k)
    if not bool(torch.isfinite(f).all()):
        raise ConvergenceError("symmetric_potential: the potential is not finite in "
                               f"{mu.dtype} (squared distances beyond its range)", (f, err, it))
    if not err <= opts["tol"]:
        msg = (f"symmetric_potential: did not converge in {it} iterations (marginal L1 error {err:.3g} > tol "
               f"{opts['tol']:.3g}); increase max_iter or reg")
        if on_failure == "raise":
            raise ConvergenceError(msg, (f, err, it))
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return f, err, it
