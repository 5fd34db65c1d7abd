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
iterating to convergence at ``reg``) cuts the iteration count from O(diam^2 / eps) to a few dozen;
on large low-dimensional clouds its first levels run on cluster centres (:mod:`transport.multiscale`)
and the passes at ``reg`` skip negligible tiles (:mod:`transport.truncation`); at ``reg`` the steps of
the pair problem are over-relaxed (:mod:`transport.overrelaxation`, a factor adapted to the observed
convergence rate, plain steps at the end so that the reported error still certifies the plan): 1.8-8x
fewer passes at blur 0.05 (benchmarks/transport.md).
A measure against itself (the same points and weights, in any order) is solved as the self problem, f <- (f + T(f)) / 2:
its pair problem is that one, and alternating steps crawl on it at small reg (the antisymmetric smooth
modes of (f, g) are the dual's flat directions; eps-annealing by alternating steps excites them). For
measures that are close but not equal the pair iteration runs as usual, and can be slow at small reg.
Conventions are those of :mod:`transport.sinkhorn` (docs/math.md section 3.2).

Gradients with respect to the points use the envelope theorem (the potentials are optimal, so
dOT_eps/dx_i = sum_j pi_ij 2 (x_i - y_j)), computed block by block in a custom autograd
function: the backward pass is O(N) in memory too. Weights are treated as constants.

Every loop is bounded: the eps-scaling levels and the Sinkhorn updates together by ``max_iter``.

Certificate of float32 solves: the iterates measure their marginals with the rounding that made
them, which cannot see an error below about 6e-8 squared diameter / eps. A float32 solve (run only
where that is below tol, :meth:`transport.problem.Problem.precision`) is checked by summing again
in float64, on the measures' own points, the marginals of the plan its potentials define; where it
misses tol the solve continues in float64.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings

import torch

from particles import Measure
from particles.device import run_triton
from particles.progress import Heartbeat
from particles.threads import tick
from particles.validation import ConvergenceError, check_allocation, check_on_failure

from . import multiscale, tiles, truncation
from .options import DEFAULT_CHUNK_ELEMENTS, check_memory_limit, resolve
from .overrelaxation import Relaxation
from .problem import Problem, ldexp, same_atoms
from .result import failure_advice, worst_error
from .tiles import cofactors, device_chunk, factors, plan_tiles, softmin, update

__all__ = ["symmetric_potential"]

#: Over-relaxed steps whose (uncertified) error falls below this many times tol are followed by a plain step,
#: whose error certifies the plan; a probe that misses tol halves the level for the next one. 1 waited for the
#: relaxed error itself, which can stay above tol long after the plan's is below (3000 steps instead of 1288 on
#: 400 points at reg 1e-3, tol 1e-6); 100 interrupted the relaxation too often there
PROBE = 10.0

#: Temporaries of one block of the soft-min (the product, its exponentials, the reduction), in elements
#: of the block: used to estimate the solver's memory before running it.
BLOCK_TEMPORARIES = 3

log = logging.getLogger(__name__)


class Progress:
    """INFO lines of a long solve (:class:`particles.progress.Heartbeat`): a sign of life with the updates made
    and the error reached (a solve shorter than the period says nothing). ``what`` names the problem."""

    def __init__(self, what: str, max_iter: int, tol: float):
        self.what, self.max_iter, self.tol = what, max_iter, tol
        self.beat = Heartbeat()
        self.lowest = math.inf

    def __call__(self, it: int, err: float | None = None) -> None:
        tick()   # every update: a machine that became busy moves the solve to fewer threads (at most every 0.25 s)
        if err is not None and err < self.lowest:
            self.lowest = err
        if self.beat.due():
            # over-relaxed and first updates at the final eps can raise the error for a while: the lowest reached
            # says where the solve stands
            lowest = f"; lowest so far {self.lowest:.3g}" if err is not None and err > self.lowest else ""
            where = "annealing" if err is None else f"marginal L1 error {err:.3g} (tol {self.tol:.3g}{lowest})"
            log.info("%s: %d of at most %d updates, %s, %.0f s", self.what, it, self.max_iter, where,
                     self.beat.elapsed)


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


def _squared_diameter(x, y) -> float:
    both = torch.cat([x.detach(), y.detach()])
    return float(((both.max(0).values - both.min(0).values) ** 2).sum())


def annealing_levels(diam2: float, eps: float, scaling: float) -> int:
    """Levels above eps of the whole eps-scaling schedule from ``diam2`` (factor scaling^2 each): the schedule
    fits ``max_iter`` when this is below it (the solve at eps takes one more update). Counted as
    :func:`_schedule` makes them (exactly up to 10^6 levels, from the logarithms beyond)."""
    if scaling == 0 or not diam2 > eps:
        return 0
    estimate = math.log(diam2 / eps) / (-2.0 * math.log(scaling))
    if not estimate <= 1e6:
        return math.ceil(estimate) if math.isfinite(estimate) else sys.maxsize
    count, e = 0, diam2
    while e > eps:
        count += 1
        e *= scaling ** 2
    return count


def _schedule(x, y, eps, scaling, max_iter):
    """eps levels from the squared diameter of both clouds down to eps (factor scaling^2 each).

    At most ``max_iter`` levels: a longer schedule (scaling close to 1, or eps far below the squared
    diameter) is compressed to ``max_iter - 1`` geometric levels over the same range, then eps, so that the
    annealing never runs away (:func:`transport.solve` refuses that case beforehand with
    ``on_failure="raise"``, see :func:`annealing_shortfall`; with "warn" the solve runs within ``max_iter``
    and is reported as not converged unless it certifies tol anyway).
    """
    if scaling == 0:
        return [eps]
    diam2 = _squared_diameter(x, y)
    if annealing_levels(diam2, eps, scaling) >= max_iter:
        n = max_iter - 1
        ratio = (eps / diam2) ** (1.0 / n) if n else 0.0
        return [diam2 * ratio ** k for k in range(n)] + [eps]
    levels, e = [], max(diam2, eps)
    while e > eps:
        levels.append(e)
        e *= scaling ** 2
    return levels + [eps]


def annealing_shortfall(x, y, eps: float, scaling: float, max_iter: int) -> str | None:
    """None where the eps-scaling annealing from the squared diameter of (x, y) down to ``eps`` fits ``max_iter``,
    else the sentence that says so, naming both options and the smallest ``max_iter`` that runs it whole."""
    if scaling == 0:
        return None
    diam2 = _squared_diameter(x, y)
    count = annealing_levels(diam2, eps, scaling)
    if count < max_iter:
        return None
    return (f"annealing over squared diameter / reg = {diam2 / eps:.3g} with scaling = {scaling} takes more than "
            f"max_iter = {max_iter} levels ({count} levels, then the updates at reg): the smallest max_iter that "
            f"runs it is {count + 1} (more to converge at reg); or a smaller scaling (0: no annealing)")


def refuse_or_hint(shortfall: str | None, on_failure: str, max_iter: int) -> str | None:
    """With ``on_failure="raise"`` an annealing longer than ``max_iter`` is a ValueError before any work; with
    "warn" the solve runs compressed within ``max_iter`` (:func:`_schedule`) and this returns the advice of
    its warning."""
    if shortfall is None:
        return None
    if on_failure == "raise":
        raise ValueError(f"scaling: {shortfall}; or on_failure='warn' to run within max_iter = {max_iter} "
                         "(the annealing compressed, the result flagged converged=False if it misses tol)")
    return f"The eps-scaling ran compressed into max_iter = {max_iter} updates: its {shortfall}."


def _row_error(a, delta, eps) -> float:
    """L1 error of the rows of the plan (f, g), whose i-th row mass is a_i exp(-delta_i / eps) for the change
    delta = T(g) - f of a half-step (no subtraction of close numbers); one host sync."""
    return float((a * torch.expm1(-delta / eps).abs()).sum())


def _solve_pair(x, y, log_a, log_b, eps, tol, max_iter, scaling, chunk, start=None, done=0, omega="auto"):
    """:func:`_iterate_pair`, on the points in Z-order with truncated passes at eps where
    :func:`transport.truncation.applies` and the first annealing levels on cluster centres where
    :func:`transport.multiscale.applies`; potentials in the caller's order."""
    n, m, d = x.shape[0], y.shape[0], x.shape[1]
    cut, coarse = truncation.applies(n, m, d, x.device), start is None and multiscale.applies(n, m, d, x.device)
    if not (cut or coarse):
        return _iterate_pair(x, y, log_a, log_b, eps, tol, max_iter, scaling, chunk, start, done, omega)
    px, py = truncation.morton_order(x), truncation.morton_order(y)
    if start is not None:
        start = (start[0][px], start[1][py])
    f, g, err, it = _iterate_pair(x[px], y[py], log_a[px], log_b[py], eps, tol, max_iter, scaling, chunk, start,
                                  done, omega, truncate=cut, coarse=coarse)
    return truncation.unsort(f, px), truncation.unsort(g, py), err, it


def _iterate_pair(x, y, log_a, log_b, eps, tol, max_iter, scaling, chunk, start=None, done=0, omega="auto",
                  truncate=False, coarse=False):
    """Sinkhorn for OT_eps between (x, log_a) and (y, log_b): (f, g, error, updates).

    From ``start`` = (f, g) (no annealing; ``done`` updates already spent) or from zero through the
    eps-scaling levels; at eps, steps over-relaxed by ``omega`` ("auto" or a factor in [1, 2),
    :mod:`transport.overrelaxation`), the last ones plain; with ``truncate`` (points in Z-order) the steps at
    eps are truncated (:mod:`transport.truncation`) but the last step of g and the stopping test dense; with
    ``coarse`` (points in Z-order) the first annealing levels run on cluster centres (:mod:`transport.multiscale`).
    The error is the L1 row error of the plan (f, g) before the last update of f, after a plain, dense
    step of g (its columns are exact: from ``start`` one such step comes first), as the iterates' own
    dtype computes it.
    """
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    a = log_a.exp()
    if start is None:
        f = torch.zeros_like(xx)
        g = torch.zeros_like(yy)
        levels = _schedule(x, y, eps, scaling, max_iter)
        it = len(levels) - 1
        if coarse:
            fc, gc, count = multiscale.start_pair(x, y, log_a, log_b, levels[:-1], chunk)
            if count:
                f, g, levels = fc, gc, levels[count:]
    else:
        (f, g), levels, it = start, [], done
    progress = Progress(f"streaming Sinkhorn, {x.shape[0]} x {y.shape[0]} atoms", max_iter, tol)
    # every half-step is tiled relative to the current potentials (tiles.update); rows where they are
    # too far off for that (the first levels) fall back to the max-shifted soft-min
    for k, e in enumerate(levels):
        f = f + update(x, xx, y, yy, log_b, f, g, e, chunk)
        g = g + update(y, yy, x, xx, log_a, g, f, e, chunk)
        progress(k + 1)
    relax = Relaxation(omega)
    dense_x = lambda f, g: update(x, xx, y, yy, log_b, f, g, eps, chunk)
    dense_y = lambda g, f: update(y, yy, x, xx, log_a, g, f, eps, chunk)
    cut = truncation.Truncation(x, xx, y, yy, log_a, log_b, eps, tol, chunk) if truncate else None
    step_x, step_y = (cut.rows, cut.cols) if cut is not None else (dense_x, dense_y)
    if start is not None:
        # the potentials given (a float32 solve's, continued in float64) end with a step of f: one plain step
        # of g makes the columns of the plan exact, so that the first error below counts them
        g = g + dense_y(g, f)
    # the last step of g was a plain, untruncated Sinkhorn step: the columns of the plan (f, g) are exact
    plain = True
    probe_at, probe_err = PROBE * tol, None
    while True:
        delta = step_x(f, g)
        # row marginal of the plan (f, g) is a_i exp(-delta_i / eps); after a plain step of g its columns
        # are exact, and err is the plan's whole L1 error
        err = _row_error(a, delta, eps)
        it += 1
        progress(it, err)
        stop = math.isnan(err) or (plain and (err <= tol or it >= max_iter))
        if stop and cut is not None:
            # the stopping test again on the whole plan: the truncated passes left out terms, in the last step
            # of g too, so it is redone dense (columns exact) before the rows' error is measured densely
            g = g + dense_y(g, f)
            delta = dense_x(f, g)
            err = _row_error(a, delta, eps)
            stop = math.isnan(err) or err <= tol or it >= max_iter
            plain = True
            if not stop:
                cut.tighten()
        if stop:
            f = f + delta
            break
        if probe_err is not None:
            probe_at = min(probe_at, 0.5 * probe_err)   # a plain step that did not certify tol: probe again later
            probe_err = None
        w = relax.observe(err)
        if err <= probe_at or it >= max_iter - 1:
            # a plain step, so that the next error certifies the plan: the error after a relaxed step also
            # counts the columns the relaxation left off, and can stay above tol where the plan's is below
            w, probe_err = 1.0, err
        f = f + w * delta
        g = g + w * step_y(g, f)
        plain = w == 1.0
    return f, g, err, it


def _solve_symmetric(x, log_a, eps, tol, max_iter, scaling, chunk, start=None):
    """Symmetric Sinkhorn for OT_eps(mu, mu): f <- (f + softmin(f)) / 2 converges in few steps, two alternating
    steps finish it (:func:`_finish_symmetric`).

    Returns (f, error, updates); ``start``: a potential to continue from (no annealing). The error is the L1
    error of the plan of the last alternating pair before its last update (its rows exact), or, where the budget
    left no room for those two steps, of both marginals of the self coupling (f, f) before the last update.
    Where :func:`transport.truncation.applies`, on the points in Z-order with truncated passes at eps (the
    last pass dense), and, where :func:`transport.multiscale.applies`, with the first annealing levels on
    cluster centres; the potential given back in the caller's order.
    """
    n, d = x.shape
    cut, coarse = truncation.applies(n, n, d, x.device), start is None and multiscale.applies(n, n, d, x.device)
    if not (cut or coarse):
        return _iterate_symmetric(x, log_a, eps, tol, max_iter, scaling, chunk, start)
    px = truncation.morton_order(x)
    f, err, it = _iterate_symmetric(x[px], log_a[px], eps, tol, max_iter, scaling, chunk,
                                    None if start is None else start[px], truncate=cut, coarse=coarse)
    return truncation.unsort(f, px), err, it


def _iterate_symmetric(x, log_a, eps, tol, max_iter, scaling, chunk, start=None, truncate=False, coarse=False):
    xx = (x * x).sum(1)
    a = log_a.exp()
    if start is None:
        f = torch.zeros_like(xx)
        levels = _schedule(x, x, eps, scaling, max_iter)[:-1]
        annealed = len(levels)   # counted in the budget, as the pair problem counts them
        if coarse:
            fc, count = multiscale.start_symmetric(x, log_a, levels, chunk)
            if count:
                f, levels = fc, levels[count:]
    else:
        f, levels, annealed = start, [], 0
    progress = Progress(f"streaming Sinkhorn, self problem of {x.shape[0]} atoms", max_iter, tol)
    for k, e in enumerate(levels):
        f = f + 0.5 * update(x, xx, x, xx, log_a, f, f, e, chunk)
        progress(annealed - len(levels) + k + 1)
    it, err = annealed, math.inf
    cut = truncation.Truncation(x, xx, x, xx, log_a, log_a, eps, tol, chunk) if truncate else None
    while it < max_iter:
        delta = update(x, xx, x, xx, log_a, f, f, eps, chunk) if cut is None else cut.rows(f, f)
        err = 2.0 * _row_error(a, delta, eps)
        it += 1
        progress(it, err)
        if cut is not None and (err <= tol or math.isnan(err) or it >= max_iter):
            # the stopping test again on the whole coupling: a truncated pass left out terms
            delta = update(x, xx, x, xx, log_a, f, f, eps, chunk)
            err = 2.0 * _row_error(a, delta, eps)
            if not err <= tol:
                cut.tighten()
        if err <= tol and it + 2 <= max_iter:
            f, err_pair = _finish_symmetric(x, xx, log_a, a, f, delta, eps, chunk)
            it += 2
            progress(it, err_pair)
            if err_pair <= tol:
                return f, err_pair, it
            err = err_pair   # (rare) the alternating steps left tol: the averaged iteration goes on from them
            continue
        f = f + 0.5 * delta
        if err <= tol or math.isnan(err):
            break
    return f, err, it


def _finish_symmetric(x, xx, log_a, a, f, delta, eps, chunk):
    """Two alternating Sinkhorn steps from a converged averaged iterate f (``delta = T(f) - f``): (f', error).

    The averaged update f <- (f + T(f)) / 2 removes the oscillation of a constant (T(f + c) = T(f) - c) at once,
    but contracts the rest of the error by (1 - lambda) / 2, about 1/2 per step where eps is large against the
    squared diameter (lambda, the second eigenvalue of the plan's conditional, near 0): it stops with an error
    near tol, and 2 <a, f> off by about eps times that (a cloud against its translate by 1e-5 at reg 1000: the
    self terms off by 1.5e-8 D^2, the Sinkhorn divergence, 1e-10 D^2, 153 times too large, converged). Alternating
    steps (g = T(f), free here, then f2 = T(g) and g2 = T(f2)) contract it by lambda each, and a constant in the
    pair (f + c, g - c) changes neither the plan nor the value. The symmetric potential (f2 + g2) / 2 has
    2 <a, f'> = <a, f2> + <a, g2>, the dual objective at a pair whose columns are exact: a lower bound of
    OT_eps(mu, mu) at least the averaged iterate's (block coordinate ascent). ``error``: the L1 error of the plan
    (f2, g), whose rows are exact (the convention of the pair problem: before the last update)."""
    g = f + delta                                           # T(f)
    f2 = g + update(x, xx, x, xx, log_a, g, g, eps, chunk)   # T(g)
    delta2 = update(x, xx, x, xx, log_a, g, f2, eps, chunk)  # T(f2) - g
    return f2 + 0.5 * delta2 + 0.5 * (g - f2), _row_error(a, delta2, eps)


def _transport_cost(x, y, log_a, log_b, f, g, eps, chunk):
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    total = x.new_zeros(())
    for rs, cs, pi in plan_tiles(x, y, log_a, log_b, f, g, eps, chunk):
        C = torch.addmm(xx[rs, None] + yy[None, cs], x[rs], y[cs].T, alpha=-2.0).clamp_min_(0.0)
        total = total + (pi * C).sum()
    return total


def plan_check(x, y, log_a, log_b, f, g, eps, chunk, cost: bool = False):
    """The L1 error of both marginals of the plan (f, g), and its cost <pi, C> if asked, in float64.

    The certificate of a float32 solve: its iterates measure their marginals with the rounding that
    made them (exponents of absolute error ~ u D2 / eps), so a float32 solve that cannot resolve the plan
    reports a small error for a wrong one. Here the plan the returned potentials define,
    pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps), is summed again in float64: one pass over the N x M
    entries, tile by tile, or on CUDA as two launches of the Triton soft-min (row and column log-sums,
    max-shifted, in float64). Returns (error, cost or None); the error is inf or NaN where the potentials
    are far from optimal (a sum overflows).
    """
    x, y, log_a, log_b, f, g = (t.to(torch.float64) for t in (x, y, log_a, log_b, f, g))
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    total = x.new_zeros(())

    def tiled():
        rows = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        cols = torch.zeros(y.shape[0], dtype=torch.float64, device=x.device)
        nonlocal total
        for rs, cs, pi in plan_tiles(x, y, log_a, log_b, f, g, eps, chunk):
            rows[rs] += pi.sum(1)
            cols[cs] += pi.sum(0)
            if cost:
                C = torch.addmm(xx[rs, None] + yy[None, cs], x[rs], y[cs].T, alpha=-2.0).clamp_min_(0.0)
                total = total + (pi * C).sum()
        return rows, cols

    if cost or not tiles._fused(x):
        rows, cols = tiled()
    else:
        # on CUDA: the row and column sums as two launches of the soft-min kernel (its exponents are those of
        # the plan, <A_i, B_j> = log pi_ij), instead of float64 tiles written to and read from memory
        A, B = factors(x, xx, f, eps, log_a), cofactors(y, yy, g, log_b, eps)

        def kernel():
            from .triton_softmin import lse_rows

            return lse_rows(A, B).exp_(), lse_rows(B.T, A.T).exp_()

        rows, cols = run_triton(("sinkhorn plan marginals", x.device.type, x.dtype, x.shape[1]), kernel, tiled,
                                "w2 (streaming) certificate")
    err = float((rows - log_a.exp()).abs().sum() + (cols - log_b.exp()).abs().sum())
    return err, (total if cost else None)


def _check_blocks(n: int, m: int, chunk: int, element_size: int, memory_limit, caller: str = "w2 (streaming)") -> None:
    check_allocation(BLOCK_TEMPORARIES * max(chunk, n, m) * element_size,
                     f"{caller} with blocks of chunk_elements = {chunk}",
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


def _certified_pair(x, y, la, lb, eps, opts, wide, cost: bool = False):
    """:func:`_solve_pair`, certified: (f, g, error, updates, cost or None).

    In float64 the error is the solver's own. A float32 solve is certified by :func:`plan_check` in
    float64 on ``wide()`` (the problem's (x, y, log_a, log_b) in float64, centred from the measures'
    points: the plan of the data given, not of its float32 rounding), which also gives <pi, C> in
    float64 when ``cost``. Where it misses ``tol`` there, the solve continues in float64 on ``wide()``
    from the float32 potentials (no new annealing) within the remaining ``max_iter``, and the
    potentials come back in float64 (cost None: the caller computes it).
    """
    tol, max_iter, scaling, chunk = opts["tol"], opts["max_iter"], opts["scaling"], opts["chunk_elements"]
    omega = opts.get("overrelaxation", "auto")
    f, g, err, it = _solve_pair(x, y, la, lb, eps, tol, max_iter, scaling, chunk, omega=omega)
    if x.dtype == torch.float64:
        return f, g, err, it, None
    x, y, la, lb = wide()
    err, total = plan_check(x, y, la, lb, f, g, eps, chunk, cost=cost)
    if err <= tol or it >= max_iter:
        return f, g, err, it, total
    f, g = f.to(torch.float64), g.to(torch.float64)
    f, g, err, it = _solve_pair(x, y, la, lb, eps, tol, max_iter, scaling, chunk, start=(f, g), done=it,
                                omega=omega)
    return f, g, err, it, None


def _certified_self(x, la, eps, opts, wide):
    """:func:`_solve_symmetric`, certified as :func:`_certified_pair` is: (f, error, updates)."""
    tol, max_iter, scaling, chunk = opts["tol"], opts["max_iter"], opts["scaling"], opts["chunk_elements"]
    f, err, it = _solve_symmetric(x, la, eps, tol, max_iter, scaling, chunk)
    if x.dtype == torch.float64:
        return f, err, it
    x, la = wide()
    err = plan_check(x, x, la, la, f, f, eps, chunk)[0]
    if err <= tol or it >= max_iter:
        return f, err, it
    f = f.to(torch.float64)
    f, err, more = _solve_symmetric(x, la, eps, tol, max_iter - it, scaling, chunk, start=f)
    return f, err, it + more


def _solve_all(x, y, la, lb, eps, opts, debias, wide):
    """The pair problem and, when ``debias``, the two self problems, each certified (``wide()``: the
    problem's (x, y, log_a, log_b) in float64, for a float32 solve that has to continue in float64).

    Returns (potentials, errors, updates, cost): ``potentials`` (f, g) or (f, g, f_xx, f_yy), all in
    float64 if any problem had to continue in float64, one error per problem, the updates of the pair
    problem, and <pi, C> of the pair's plan in float64 when the certificate computed it, else None.
    """
    match = same_atoms(x, la, y, lb)
    if match is not None:
        # mu = nu, whatever the order of the atoms: the pair problem is the self problem (g = f on nu's order),
        # whose averaged update converges in a few steps where alternating Sinkhorn steps crawl (200 uniform
        # points at reg 1e-3: 18 updates, against more than 5000)
        f, err, it = _certified_self(x, la, eps, opts, lambda: wide()[0::2])
        g = f[match]
        pots = [f, g, f, g] if debias else [f, g]
        return pots, [err] * (3 if debias else 1), it, None
    f, g, err, it, cost = _certified_pair(x, y, la, lb, eps, opts, wide, cost=not debias)
    pots, errs = [f, g], [err]
    if debias:
        for side, (z, lz) in enumerate(((x, la), (y, lb))):
            f_zz, err_zz, _ = _certified_self(z, lz, eps, opts, lambda side=side: wide()[side::2])
            pots.append(f_zz)
            errs.append(err_zz)
    work = torch.float64 if any(p.dtype == torch.float64 for p in pots) else x.dtype
    return [p.to(work) for p in pots], errs, it, cost


def solve_streaming(problem: Problem, eps: float, opts: dict, return_plan: bool = False, memory_limit=None) -> dict:
    """Routine of method "streaming": S_eps or <pi_eps, C> in normalized units, and what it reached.

    Works in the problem's dtype; a float32 solve is certified in float64 and continued in float64
    where it misses ``tol`` (:func:`_solve_all`), the returned ``precision`` saying which dtype the
    potentials come in. Never forms the plan (``return_plan`` is refused by :func:`transport.solve`
    before this runs).
    """
    # blocks sized by the device's memory budget off the CPU (an explicit chunk_elements is kept)
    chunk = device_chunk(opts["chunk_elements"], DEFAULT_CHUNK_ELEMENTS, problem.x.device, problem.x.element_size(),
                         BLOCK_TEMPORARIES, memory_limit)
    opts = {**opts, "chunk_elements": chunk}
    debias = opts["debias"]
    if problem.grad and not debias:
        raise ValueError("debias: gradients of the streaming path are available for debias=True only (the cost "
                         "<pi_eps, C> of the entropic plan is not stationary in the plan: no envelope formula); use "
                         "debias=True (the Sinkhorn divergence), method='sinkhorn' (dense, differentiated through "
                         "its iterations; N, M up to a few thousand), or detach the points")
    if problem.log_a.requires_grad or problem.log_b.requires_grad:
        # the envelope gradient below is taken in the points; a weight gradient would be silently missing
        raise ValueError("mu, nu: weights that require grad: the streaming path differentiates in the points only "
                         "(its envelope formula); use method='exact' or 'sinkhorn', or detach the weights")
    # the certificate's blocks are float64
    _check_blocks(problem.n, problem.m, chunk, 8, memory_limit, f"{problem.caller} (streaming)")
    sa, sb = problem.log_a > -math.inf, problem.log_b > -math.inf
    la, lb = problem.log_a[sa].detach(), problem.log_b[sb].detach()
    x, y = problem.x[sa].detach(), problem.y[sb].detach()

    def wide():
        p = problem.to(torch.float64)
        return p.x[sa].detach(), p.y[sb].detach(), p.log_a[sa].detach(), p.log_b[sb].detach()

    with torch.no_grad():
        pots, errs, it, cost = _solve_all(x, y, la, lb, eps, opts, debias, wide)
    work = pots[0].dtype
    problem = problem.to(work)
    xg, yg = problem.x[sa], problem.y[sb]
    x, y, la, lb = xg.detach(), yg.detach(), la.to(work), lb.to(work)
    f, g = pots[:2]
    if debias:
        val = _EntropicValue.apply(xg, yg, f, g, la, lb, eps, chunk)
        val = val - 0.5 * _EntropicValue.apply(xg, xg, pots[2], pots[2], la, la, eps, chunk)
        val = val - 0.5 * _EntropicValue.apply(yg, yg, pots[3], pots[3], lb, lb, eps, chunk)
    else:
        with torch.no_grad():
            val = _transport_cost(x, y, la, lb, f, g, eps, chunk) if cost is None else cost
    with torch.no_grad():
        x_all, y_all = problem.x.detach(), problem.y.detach()
        potentials = (extend_potential(f, sa, x_all, y, lb, g, eps, chunk),
                      extend_potential(g, sb, y_all, x, la, f, eps, chunk))
    return dict(value=val, plan=None, potentials=potentials, error=worst_error(*errs), iterations=it,
                precision=work)


def symmetric_potential(mu: Measure, reg, *, tol=None, max_iter=None, scaling=None, chunk_elements=None,
                        on_failure: str = "raise", memory_limit=None):
    r"""The potential f of OT_eps(mu, mu), the self-transport term of the Sinkhorn divergence.

    f is the fixed point of f = softmin_eps(f), f_i = -eps log sum_j a_j exp((f_j - \|x_i - x_j\|^2) / eps),
    found by the averaged iteration f <- (f + softmin_eps(f)) / 2 (Feydy et al. 2019, section 3.1),
    which converges in a few steps where the alternating updates of a general solver stall near
    tol = 1e-7, then finished by two alternating steps (g = softmin(f), f2 = softmin(g), g2 = softmin(f2);
    f = (f2 + g2) / 2), which remove the error the averaged step leaves near tol where eps is large against
    the squared diameter (there it contracts by only 1/2 per step). Then OT_eps(mu, mu) = 2 <a, f> and the
    self coupling is
    pi_ij = a_i a_j exp((f_i + f_j - \|x_i - x_j\|^2) / eps). Memory O(N) (streamed).

    Parameters
    ----------
    mu : Measure
        Of dtype float32 or float64.
    reg : float
        eps > 0, POT's entropic regularization on squared distances (see :func:`transport.solve`).
    tol, max_iter, scaling, chunk_elements
        As for ``method="streaming"`` of :func:`transport.solve` (defaults in :data:`transport.DEFAULTS`).
    on_failure : ``"raise"`` or ``"warn"``
        "raise": a :class:`~particles.validation.ConvergenceError` whose ``.estimate`` is the triple
        below.
    memory_limit : int or str
        Bytes (or "16G") the blocks may take (default ``$SMOOTH_ATTENTION_MEMORY_LIMIT``).

    Returns
    -------
    tuple
        (f, error, iterations): the potential (N,) in squared-distance units (the soft c-transform on
        atoms of zero mass), the L1 error of the marginals of the self problem's coupling as measured
        before its last update (the convention of :func:`transport.solve`'s ``error``; for a float32 solve, of
        the coupling (f, f) itself, summed in float64), the updates made.
        Precision as for :func:`transport.solve`: float32 measures are solved in float32 where it
        resolves the plan (:meth:`transport.problem.Problem.precision`), the error then measured in
        float64, else in float64, and ``f`` comes in the dtype of the solve.
    """
    check_on_failure(on_failure)
    memory_limit = check_memory_limit(memory_limit)
    problem = Problem(mu, mu)
    if problem.grad:
        # the fixed point is computed without a graph: a gradient through f would be silently missing
        raise ValueError("mu: points or weights that require grad: symmetric_potential returns the potential "
                         "without an autograd graph; detach them (mu.detach()), or differentiate the Sinkhorn "
                         "divergence itself (transport.w2 with debias=True)")
    opts = resolve("streaming", dict(reg=reg, tol=tol, max_iter=max_iter, scaling=scaling,
                                     chunk_elements=chunk_elements), mu.dtype)
    if opts["reg"] is None:
        raise ValueError("reg: symmetric_potential needs an entropic regularization reg > 0")
    problem = problem.to(problem.precision(opts["reg"], opts["tol"]))
    eps = problem.eps(opts["reg"])
    support = problem.support_points()
    hint = refuse_or_hint(annealing_shortfall(support, support, eps, opts["scaling"], opts["max_iter"]),
                          on_failure, opts["max_iter"])
    chunk = device_chunk(opts["chunk_elements"], DEFAULT_CHUNK_ELEMENTS, problem.x.device, problem.x.element_size(),
                         BLOCK_TEMPORARIES, memory_limit)
    opts = {**opts, "chunk_elements": chunk}
    _check_blocks(mu.n, mu.n, chunk, 8, memory_limit, "symmetric_potential")  # the certificate's blocks are float64
    sa = problem.log_a > -math.inf
    x, la = problem.x.detach()[sa], problem.log_a.detach()[sa]

    def wide():
        p = problem.to(torch.float64)
        return p.x.detach()[sa], p.log_a.detach()[sa]

    with torch.no_grad():
        f, err, it = _certified_self(x, la, eps, opts, wide)
        x_all = problem.x.detach().to(f.dtype)
        f = ldexp(extend_potential(f, sa, x_all, x.to(f.dtype), la.to(f.dtype), f, eps, chunk), 2 * problem.k)
    if not bool(torch.isfinite(f).all()):
        raise ConvergenceError("symmetric_potential: the potential is not finite in "
                               f"{f.dtype} (squared distances beyond its range)", (f, err, it))
    if not err <= opts["tol"]:
        advice = hint or failure_advice(it, opts["max_iter"], opts["tol"], opts["reg"], sentence=False)
        msg = (f"symmetric_potential: did not converge in {it} iterations (marginal L1 error {err:.3g} > tol "
               f"{opts['tol']:.3g}); {advice}")
        if on_failure == "raise":
            raise ConvergenceError(msg, (f, err, it))
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return f, err, it
