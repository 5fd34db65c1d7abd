r"""Exact W2: POT's network simplex (``ot.emd2``) on squared distances, and the d = 1 closed form.

W2(mu, nu)^2 = min over couplings pi of sum_ij pi_ij \|x_i - y_j\|^2 (docs/math.md section 3).
Both routines take normalized clouds (see :mod:`transport.problem`) and return W2^2 in those units.
"""

from __future__ import annotations

import warnings

import ot
import torch

from particles.validation import check_allocation

from .problem import sq_dists

#: Network-simplex iteration cap; POT's default (1e5) stops early above N ~ 1000.
EMD_MAX_ITER = 50_000_000
#: Peak memory of ``ot.emd2`` per pair of atoms, measured (ru_maxrss) at N = M = 1500: 5.2 float64
#: matrices (cost, plan, network-simplex arcs); 6 leaves a margin.
EMD_BYTES_PER_PAIR = 6 * 8


def emd_squared(x, a, y, b, *, return_plan: bool = False, memory_limit=None):
    """W2^2 by linear programming (POT ``emd2``), differentiable through POT's torch backend.

    Returns ``(value, plan, (u, v))``: a 0-d tensor, the (N, M) optimal plan (or None) and the
    Kantorovich potentials. Raises MemoryLimitError before allocating above the memory limit, and
    RuntimeError when the network simplex reports anything but an optimal solution.
    """
    n, m = x.shape[0], y.shape[0]
    check_allocation(EMD_BYTES_PER_PAIR * n * m, f"w2 (exact) between {n} and {m} atoms",
                     "use method='streaming' (memory O(N + M)) or 'auto'", memory_limit)
    M = sq_dists(x, y)
    # POT signals an unfinished simplex only through a warning: turn it into an error
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        try:
            value, log = ot.emd2(a, b, M, numItermax=EMD_MAX_ITER, log=True, return_matrix=return_plan)
        except UserWarning as exc:
            raise RuntimeError(f"w2 (exact): POT's network simplex did not finish: {exc}") from exc
    if log.get("result_code", 1) != 1:
        raise RuntimeError(f"w2 (exact): POT's network simplex failed: {log.get('warning')}")
    return value, (log["G"] if return_plan else None), (log["u"], log["v"])


def quantile_squared(x, a, y, b, *, return_plan: bool = False, memory_limit=None):
    r"""W2^2 in d = 1 from quantile functions: int_0^1 \|F_mu^{-1}(t) - F_nu^{-1}(t)\|^2 dt.

    Both quantile functions are step functions; between consecutive breakpoints of the merged
    cumulative weights they are constant, so the integral is an exact finite sum (O(N log N)).
    Differentiable in the points (and weights). The monotone (north-west corner) coupling is
    returned as the plan on request. Returns ``(value, plan)``.
    """
    n, m = x.shape[0], y.shape[0]
    x, y = x[:, 0], y[:, 0]
    if return_plan:
        check_allocation(n * m * x.element_size(), f"the plan of w2 between {n} and {m} atoms",
                         "ask for the value only (return_plan=False)", memory_limit)
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
    i = torch.searchsorted(ca.detach().contiguous(), mid).clamp_max(n - 1)
    j = torch.searchsorted(cb.detach().contiguous(), mid).clamp_max(m - 1)
    value = (dt * (xs[i] - ys[j]) ** 2).sum()
    plan = None
    if return_plan:
        plan = torch.zeros(n, m, dtype=x.dtype, device=x.device)
        plan.index_put_((ix[i], iy[j]), dt.detach(), accumulate=True)
    return value, plan


def solve_exact(problem, eps, opts: dict, return_plan: bool = False, memory_limit=None) -> dict:
    """Routine of method "exact": W2^2 in normalized units; the sorted formula in d = 1."""
    if problem.dim == 1:
        x, y = problem.plain_points()
        value, plan = quantile_squared(x, problem.a, y, problem.b, return_plan=return_plan,
                                       memory_limit=memory_limit)
        potentials = None
    else:
        value, plan, potentials = emd_squared(problem.x, problem.a, problem.y, problem.b,
                                              return_plan=return_plan, memory_limit=memory_limit)
    return dict(value=value, plan=plan, potentials=potentials, error=0.0, iterations=None)
