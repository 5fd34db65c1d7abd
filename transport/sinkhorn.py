"""Entropic W2 with POT's log-domain Sinkhorn (dense N x M cost matrix; meant for N, M <= ~5000).

Conventions shared with :mod:`transport.streaming` (Feydy et al. 2019, "Interpolating between
optimal transport and MMD using Sinkhorn divergences"):

* ``OT_eps(mu, nu) = min_pi <pi, C> + eps KL(pi | mu x nu)``, C_ij = |x_i - y_j|^2;
* ``debias=True``: the Sinkhorn divergence S_eps = OT_eps(mu, nu) - (OT_eps(mu, mu) + OT_eps(nu, nu)) / 2,
  which is zero for mu = nu and tends to W2^2 as eps -> 0 (the reported W2 is sqrt(S_eps));
* ``debias=False``: the transport cost <pi_eps, C> of the entropic plan (POT's ``sinkhorn2``
  value), which is >= W2^2 (pi_eps is a coupling) and tends to W2^2 as eps -> 0.
"""

from __future__ import annotations

import math

import ot
import torch

from particles import Measure

from ._common import common_shift, report_nonconvergence, sq_dists


def _entropic(x, y, log_a, log_b, eps, tol, max_iter, strict, warm=None):
    """Solve OT_eps between (x, log_a) and (y, log_b): returns (OT_eps, <pi, C>, plan).

    OT_eps is evaluated with the plan detached: at the optimum its derivative in the points is
    sum_ij pi_ij grad C_ij (envelope theorem), exact even when POT was warm-started.
    <pi, C> keeps the autodiff graph through POT's iterations (it is not stationary in pi).
    """
    C = sq_dists(x, y)
    a, b = log_a.exp(), log_b.exp()
    # POT stops on the L2 column error; L1 <= sqrt(M) L2, so this threshold implies ours
    _, log = ot.sinkhorn(a, b, C, eps, method="sinkhorn_log", numItermax=max_iter,
                         stopThr=tol / math.sqrt(C.shape[1]), log=True, warn=False, warmstart=warm)
    log_plan = log["log_u"][:, None] + log["log_v"][None, :] - C / eps
    plan = log_plan.exp()
    err = float(((plan.sum(1) - a).abs().sum() + (plan.sum(0) - b).abs().sum()).detach())
    if not err <= tol:
        report_nonconvergence(err, tol, int(log["niter"]) + 1, strict, "w2 (sinkhorn)")
    cost = (plan * C).sum()
    p, lp = plan.detach(), log_plan.detach()
    kl = (p * (lp - log_a[:, None] - log_b[None, :])).sum()
    return (p * C).sum() + eps * kl, cost, plan


def w2_squared_sinkhorn(mu: Measure, nu: Measure, reg: float, *, debias: bool = True,
                        return_plan: bool = False, tol: float = 1e-7, max_iter: int = 10_000,
                        strict: bool = False):
    """Entropic estimate of W2^2 with POT (see the module docstring for the two conventions).

    Atoms of zero mass are dropped before solving (log 0 would poison the log-domain
    iterations) and get zero rows/columns in the returned plan. Non-convergence (L1 marginal
    error above ``tol`` after ``max_iter`` iterations) emits a SinkhornConvergenceWarning, or
    raises RuntimeError when ``strict``.
    """
    c = common_shift(mu, nu)
    sa, sb = mu.log_weights > -math.inf, nu.log_weights > -math.inf
    x, la = mu.points[sa] - c, mu.log_weights[sa]
    y, lb = nu.points[sb] - c, nu.log_weights[sb]
    ot_xy, cost, plan = _entropic(x, y, la, lb, reg, tol, max_iter, strict)
    if debias:
        ot_xx = _entropic(x, x, la, la, reg, tol, max_iter, strict, _symmetric_warmstart(x, la, reg, tol))[0]
        ot_yy = _entropic(y, y, lb, lb, reg, tol, max_iter, strict, _symmetric_warmstart(y, lb, reg, tol))[0]
        value = ot_xy - 0.5 * (ot_xx + ot_yy)
    else:
        value = cost
    full = None
    if return_plan:
        full = torch.zeros(mu.n, nu.n, dtype=plan.dtype, device=plan.device)
        full[torch.nonzero(sa)[:, 0][:, None], torch.nonzero(sb)[:, 0][None, :]] = plan.detach()
    return value, full


def _symmetric_warmstart(x, log_a, reg, tol):
    """Log-scalings for POT from the averaged symmetric iteration f <- (f + softmin(f)) / 2.

    POT's alternating updates on a self-problem OT_eps(mu, mu) can stall near 1e-7 marginal
    error for hours of iterations; started from the symmetric fixed point they confirm it in a
    few steps, and POT's own iterations and our marginal check still decide convergence.
    """
    from .streaming import DEFAULT_CHUNK_ELEMENTS, _solve_self

    with torch.no_grad():
        f, _ = _solve_self(x.detach(), log_a.detach(), reg, tol, 10_000, 0.5, DEFAULT_CHUNK_ELEMENTS)
    u = (log_a.detach() + f / reg)
    return u, u.clone()
