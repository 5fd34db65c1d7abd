r"""Entropic W2 with POT's log-domain Sinkhorn (dense N x M cost matrix; meant for N, M <= ~5000).

Conventions shared with :mod:`transport.streaming_sinkhorn` (Feydy et al. 2019, "Interpolating between
optimal transport and MMD using Sinkhorn divergences"; docs/math.md section 3):

* ``OT_eps(mu, nu) = min_pi <pi, C> + eps KL(pi | mu x nu)``, C_ij = \|x_i - y_j\|^2, eps = ``reg``:
  POT's ``reg`` (``pot().sinkhorn(a, b, M, reg)`` with M the squared-distance matrix);
* ``debias=True``: the Sinkhorn divergence S_eps = OT_eps(mu, nu) - (OT_eps(mu, mu) + OT_eps(nu, nu)) / 2,
  which is zero for mu = nu and tends to W2^2 as eps -> 0 (the reported W2 is sqrt(S_eps));
* ``debias=False``: the transport cost <pi_eps, C> of the entropic plan (POT's ``sinkhorn2``
  value), which is >= W2^2 (pi_eps is a coupling) and tends to W2^2 as eps -> 0.
"""

from __future__ import annotations

import logging
import math

import torch

from particles import Measure, progress
from particles.progress import Heartbeat
from particles.threads import tick
from particles.validation import ConvergenceError, check_allocation

from .options import DEFAULT_CHUNK_ELEMENTS
from .problem import Problem, pot, same_atoms, sq_dists
from .result import worst_error
from .streaming_sinkhorn import extend_potential, symmetric_potential

#: Peak memory of a dense solve per pair of atoms, in matrices of the dtype, measured (ru_maxrss) at
#: N = M = 1500 in float64: 7.4 (debiased) to 9.3 (plan cost); 10 leaves a margin.
SINKHORN_MATRICES = 10
#: Iterations of the symmetric warm start of the self problems OT_eps(mu, mu), OT_eps(nu, nu).
WARMSTART_MAX_ITER = 10_000
#: Iterations of POT's first round (``_pot_sinkhorn``), which times one iteration. A multiple of 10 (POT
#: checks its error every 10th iteration), so that the rounds check where one uninterrupted run would.
FIRST_ROUND = 10

logger = logging.getLogger(__name__)


def _pot_sinkhorn(a, b, C, eps, max_iter, stop, warm, what):
    """POT's log-domain Sinkhorn for at most ``max_iter`` iterations, run in rounds of about
    :data:`particles.progress.PROGRESS_SECONDS` each, continued from the last round's log-scalings (POT's
    state), so that a long solve logs its progress at INFO between rounds; the iterates and the stopping test
    are those of one uninterrupted run, and so is the gradient through them (to rounding: each round adds its
    own node -C / eps to the graph). Returns (POT's log of the last round, iterations in all)."""
    beat = Heartbeat()
    done, size = 0, FIRST_ROUND
    while True:
        k = min(size, max_iter - done)
        _, log = pot().sinkhorn(a, b, C, eps, method="sinkhorn_log", numItermax=k, stopThr=stop, log=True,
                             warn=False, warmstart=warm)
        ran = int(log["niter"]) + 1
        done += ran
        if ran < k or done >= max_iter:   # POT stopped on its test (only on an iteration 10 j), or the budget is spent
            return log, done
        warm = (log["log_u"], log["log_v"])
        tick()   # between rounds: a machine that became busy moves the solve to fewer threads
        if beat.due():
            err = log["err"][-1] if log["err"] else math.nan
            err = float(err.detach() if isinstance(err, torch.Tensor) else err)
            logger.info("%s: %d of at most %d iterations, POT's column L2 error %.3g (stops below %.3g), %.0f s",
                        what, done, max_iter, err, stop, beat.elapsed)
        per = max(beat.elapsed / done, 1e-9)
        size = FIRST_ROUND * max(1, int(progress.PROGRESS_SECONDS / per / FIRST_ROUND))


def _entropic(x, y, log_a, log_b, eps, tol, max_iter, warm=None, what="w2 (sinkhorn)"):
    """Solve OT_eps between (x, log_a) and (y, log_b) with POT.

    Returns (OT_eps, <pi, C>, plan, (f, g), error, iterations). OT_eps is evaluated with the plan
    detached: at the optimum its derivative in the points is sum_ij pi_ij grad C_ij (envelope
    theorem), exact even when POT was warm-started. <pi, C> keeps the autodiff graph through POT's
    iterations (it is not stationary in pi).
    """
    C = sq_dists(x, y)
    a, b = log_a.exp(), log_b.exp()
    # POT stops on the L2 column error; L1 <= sqrt(M) L2, so this threshold implies ours
    log, iterations = _pot_sinkhorn(a, b, C, eps, max_iter, tol / math.sqrt(C.shape[1]), warm, what)
    log_plan = log["log_u"][:, None] + log["log_v"][None, :] - C / eps
    plan = log_plan.exp()
    # the plan's marginals summed in float64: the rounding of N or M float32 terms would blur tol
    p64 = plan.detach().to(torch.float64)
    err = float((p64.sum(1) - a.detach()).abs().sum() + (p64.sum(0) - b.detach()).abs().sum())
    cost = (plan * C).sum()
    p = plan.detach()
    # POT's log-scalings are log a + f / eps (resp. log b + g / eps) in the a_i b_j exp((f + g - C) / eps) form
    f = eps * (log["log_u"].detach() - log_a.detach())
    g = eps * (log["log_v"].detach() - log_b.detach())
    # the value is the dual objective <a, f> + <b, g> - eps (sum_ij pi_ij - 1) (pi_ij = a_i b_j exp((f_i + g_j -
    # C_ij) / eps)), summed in float64 from the plan's float64 copy above: its error is second order in the marginal
    # error, where the primal <pi, C> + eps KL(pi | a x b) of a plan that misses its marginals by tol is off to first
    # order (a review: 37% of a debiased value of 1e-8 between a cloud and its translate by 1e-4, at reg = 1,
    # converged)
    f64, g64 = f.to(torch.float64), g.to(torch.float64)
    value = ((a.detach().to(torch.float64) * f64).sum() + (b.detach().to(torch.float64) * g64).sum()
             - eps * (p64.sum() - 1.0))
    # the derivatives: in the points, sum_ij pi_ij grad C_ij (envelope theorem: the plan held fixed); in the weights
    # the dual one, dOT_eps / da_i = f_i (and g_j in b). Zero-valued terms carry them
    primal = (p * C).sum()
    dual = (a * f).sum() + (b * g).sum()
    graph = (primal - primal.detach()) + (dual - dual.detach())
    return value.to(C.dtype) + graph, cost, plan, (f, g), err, iterations


def _symmetric_warmstart(x, log_a, eps, tol):
    """Log-scalings for POT from :func:`transport.streaming_sinkhorn.symmetric_potential`.

    POT's alternating updates on a self-problem OT_eps(mu, mu) can stall near 1e-7 marginal
    error for hours of iterations; started from the symmetric fixed point they confirm it in a
    few steps, and POT's own iterations and our marginal check still decide convergence.
    """
    # a start, not a result: the log-weights of the measure given (accepted at a sum within 1e-9 of 1) are
    # renormalized rather than re-checked, whose re-summed rounding could land just outside that tolerance
    mu = Measure(x.detach(), log_weights=log_a.detach(), normalize=True)
    try:
        f = symmetric_potential(mu, eps, tol=tol, max_iter=WARMSTART_MAX_ITER)[0]
    except ConvergenceError as exc:  # a start, not a result: POT iterates on from it
        f = exc.estimate[0]
    u = log_a.detach() + f.to(log_a.dtype) / eps
    return u, u.clone()


def solve_sinkhorn(problem: Problem, eps: float, opts: dict, return_plan: bool = False, memory_limit=None) -> dict:
    """Routine of method "sinkhorn": S_eps or <pi_eps, C> in normalized units, and what it reached.

    Atoms of zero mass are dropped before solving (log 0 would poison the log-domain
    iterations) and get zero rows/columns in the returned plan; so are atoms whose mass underflows the dtype
    (a log-weight below -745 in float64, -103 in float32: measures built from log-weights), which the
    iterations, working with the masses exp(log a), cannot tell from zero.
    """
    debias, tol, max_iter = opts["debias"], opts["tol"], opts["max_iter"]
    n, m = problem.n, problem.m
    pairs = max(n * m, n * n, m * m) if debias else n * m
    check_allocation(SINKHORN_MATRICES * pairs * problem.x.element_size(),
                     f"{problem.caller} (sinkhorn) between {n} and {m} atoms",
                     "use method='streaming' (same entropic value, memory O(N + M))", memory_limit)
    sa, sb = problem.log_a.exp() > 0, problem.log_b.exp() > 0
    x, la = problem.x[sa], problem.log_a[sa]
    y, lb = problem.y[sb], problem.log_b[sb]
    what = f"{problem.caller} (sinkhorn)"
    # a measure against itself is the self problem, whose alternating updates crawl at small reg (10000 did not
    # reach tol = 1e-5 at reg 1e-3 on 300 points): started from its symmetric fixed point as the debiasing terms
    # (the symmetric start of mu is solved once: for the pair and for the self problem of mu, and, permuted, for nu's)
    match = same_atoms(x, la, y, lb)
    start_x = _symmetric_warmstart(x, la, eps, tol) if debias or match is not None else None
    permuted = None if match is None else start_x[0][match]
    ot_xy, cost, plan, (f, g), err, it = _entropic(x, y, la, lb, eps, tol, max_iter,
                                                   None if match is None else (start_x[0], permuted),
                                                   what=f"{what}, {n} x {m} atoms")
    if debias:
        start_y = _symmetric_warmstart(y, lb, eps, tol) if match is None else (permuted, permuted.clone())
        ot_xx, _, _, _, err_x, _ = _entropic(x, x, la, la, eps, tol, max_iter, start_x, f"{what}, self problem of mu")
        ot_yy, _, _, _, err_y, _ = _entropic(y, y, lb, lb, eps, tol, max_iter, start_y, f"{what}, self problem of nu")
        value = ot_xy - 0.5 * (ot_xx + ot_yy)
        err = worst_error(err, err_x, err_y)
    else:
        value = cost
    full = None
    if return_plan:
        full = torch.zeros(n, m, dtype=plan.dtype, device=plan.device)
        full[torch.nonzero(sa)[:, 0][:, None], torch.nonzero(sb)[:, 0][None, :]] = plan.detach()
    with torch.no_grad():
        x_all, y_all = problem.x.detach(), problem.y.detach()
        potentials = (extend_potential(f, sa, x_all, y.detach(), lb.detach(), g, eps, DEFAULT_CHUNK_ELEMENTS),
                      extend_potential(g, sb, y_all, x.detach(), la.detach(), f, eps, DEFAULT_CHUNK_ELEMENTS))
    return dict(value=value, plan=full, potentials=potentials, error=err, iterations=it, precision=problem.dtype)
