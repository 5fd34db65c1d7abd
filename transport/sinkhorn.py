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


def _entropic(x, y, log_a, log_b, eps, tol, max_iter, strict):
    """Solve OT_eps between (x, log_a) and (y, log_b): returns (OT_eps, <pi, C>, plan)."""
    C = sq_dists(x, y)
    a, b = log_a.exp(), log_b.exp()
    # POT stops on the L2 column error; L1 <= sqrt(M) L2, so this threshold implies ours
    _, log = ot.sinkhorn(a, b, C, eps, method="sinkhorn_log", numItermax=max_iter,
                         stopThr=tol / math.sqrt(C.shape[1]), log=True, warn=False)
    log_plan = log["log_u"][:, None] + log["log_v"][None, :] - C / eps
    plan = log_plan.exp()
    err = float((plan.sum(1) - a).abs().sum() + (plan.sum(0) - b).abs().sum())
    if not err <= tol:
        report_nonconvergence(err, tol, int(log["niter"]) + 1, strict, "w2 (sinkhorn)")
    cost = (plan * C).sum()
    kl = (plan * (log_plan - log_a[:, None] - log_b[None, :])).sum()
    return cost + eps * kl, cost, plan


def w2_squared_sinkhorn(mu: Measure, nu: Measure, reg: float, *, debias: bool = True,
                        return_plan: bool = False, tol: float = 1e-9, max_iter: int = 10_000,
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
        ot_xx = _entropic(x, x, la, la, reg, tol, max_iter, strict)[0]
        ot_yy = _entropic(y, y, lb, lb, reg, tol, max_iter, strict)[0]
        value = ot_xy - 0.5 * (ot_xx + ot_yy)
    else:
        value = cost
    full = None
    if return_plan:
        full = torch.zeros(mu.n, nu.n, dtype=plan.dtype, device=plan.device)
        full[torch.nonzero(sa)[:, 0][:, None], torch.nonzero(sb)[:, 0][None, :]] = plan.detach()
    return value, full
