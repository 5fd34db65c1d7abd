"""Exact W2: POT's network simplex (``ot.emd2``) on squared distances, and the d = 1 closed form.

W2(mu, nu)^2 = min over couplings pi of sum_ij pi_ij |x_i - y_j|^2 (MATH.md section 3).
"""

from __future__ import annotations

import warnings

import ot
import torch

from particles import Measure

from ._common import common_shift, sq_dists

#: Network-simplex iteration cap; POT's default (1e5) stops early above N ~ 1000.
EMD_MAX_ITER = 50_000_000


def w2_squared_exact(mu: Measure, nu: Measure, return_plan: bool = False):
    """W2^2 by linear programming (POT ``emd2``), differentiable through POT's torch backend.

    Returns ``(value, plan)`` with a 0-d tensor value and the (N, M) optimal plan (or None).
    Raises ``RuntimeError`` when the network simplex reports anything but an optimal solution.
    """
    c = common_shift(mu, nu)
    M = sq_dists(mu.points - c, nu.points - c)
    a, b = mu.weights, nu.weights
    # POT signals an unfinished simplex only through a warning: turn it into an error
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        try:
            value, log = ot.emd2(a, b, M, numItermax=EMD_MAX_ITER, log=True, return_matrix=return_plan)
        except UserWarning as exc:
            raise RuntimeError(f"w2 (exact): POT's network simplex did not finish: {exc}") from exc
    if log.get("result_code", 1) != 1:
        raise RuntimeError(f"w2 (exact): POT's network simplex failed: {log.get('warning')}")
    return value, (log["G"] if return_plan else None)


def w2_squared_1d(mu: Measure, nu: Measure, return_plan: bool = False):
    """W2^2 in d = 1 from quantile functions: int_0^1 |F_mu^{-1}(t) - F_nu^{-1}(t)|^2 dt.

    Both quantile functions are step functions; between consecutive breakpoints of the merged
    cumulative weights they are constant, so the integral is an exact finite sum (O(N log N)).
    Differentiable in the points (and weights). The monotone (north-west corner) coupling is
    returned as the plan on request.
    """
    x, a = mu.points[:, 0], mu.weights
    y, b = nu.points[:, 0], nu.weights
    ix = torch.argsort(x.detach())
    iy = torch.argsort(y.detach())
    xs, ws_a = x[ix], a[ix]
    ys, ws_b = y[iy], b[iy]
    ca, cb = torch.cumsum(ws_a, 0), torch.cumsum(ws_b, 0)
    # breakpoints of both quantile functions; the last one is 1 up to rounding, pinned to it
    t = torch.sort(torch.cat([ca, cb]))[0]
    t = torch.cat([t.new_zeros(1), t[:-1], t.new_ones(1)])
    dt = (t[1:] - t[:-1]).clamp_min(0.0)
    mid = (0.5 * (t[1:] + t[:-1])).detach()
    i = torch.searchsorted(ca.detach().contiguous(), mid).clamp_max(mu.n - 1)
    j = torch.searchsorted(cb.detach().contiguous(), mid).clamp_max(nu.n - 1)
    value = (dt * (xs[i] - ys[j]) ** 2).sum()
    plan = None
    if return_plan:
        plan = torch.zeros(mu.n, nu.n, dtype=mu.dtype, device=mu.device)
        plan.index_put_((ix[i], iy[j]), dt.detach(), accumulate=True)
    return value, plan
