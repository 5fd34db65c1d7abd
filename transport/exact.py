r"""Exact W2: POT's network simplex (``ot.emd2``) on squared distances, and the d = 1 closed form.

W2(mu, nu)^2 = min over couplings pi of sum_ij pi_ij \|x_i - y_j\|^2 (docs/math.md section 3).
Both routines take normalized clouds (see :mod:`transport.problem`) and return W2^2 in those units.
"""

from __future__ import annotations

import math
import warnings

import ot
import torch

from particles.validation import check_allocation

from .problem import ldexp, sq_dists

#: Network-simplex iteration cap; POT's default (1e5) stops early above N ~ 1000.
EMD_MAX_ITER = 50_000_000
#: Peak memory of ``ot.emd2`` per pair of atoms, 5.2 float64 matrices measured (ru_maxrss) at
#: N = M = 1500 (cost, plan, network-simplex arcs); 6 leaves a margin.
EMD_BYTES_PER_PAIR = 6 * 8


#: POT's verdicts (``log["result_code"]`` of ``ot.emd2``, the ``ProblemType`` of its network simplex,
#: ot/lp/emd_wrap.pyx): only OPTIMAL is a solution.
EMD_INFEASIBLE, EMD_OPTIMAL, EMD_UNBOUNDED, EMD_MAX_ITER_REACHED = 0, 1, 2, 3


def _network_simplex(a, b, M, return_plan: bool):
    """``ot.emd2`` with POT's own verdict read from ``log["result_code"]``; other warnings pass through.

    POT reports a failed simplex twice, by ``log["result_code"]`` and by a UserWarning whose text is
    ``log["warning"]``. Warnings raised during the call are recorded and, after it, every one but that
    verdict is re-emitted where it was raised (a backend's initialization warning, e.g. JAX's about
    float64, is not a failure of the simplex, and is not swallowed either).
    """
    log = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value, log = ot.emd2(a, b, M, numItermax=EMD_MAX_ITER, log=True, return_matrix=return_plan)
    finally:
        verdict = None if log is None else log.get("warning")
        for w in caught:
            if verdict is not None and issubclass(w.category, UserWarning) and str(w.message) == verdict:
                continue
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    code = log.get("result_code")
    if code != EMD_OPTIMAL:
        raise RuntimeError(f"w2 (exact): POT's network simplex did not find an optimal plan (result_code "
                           f"{code}): {verdict}")
    return value, log


def emd_squared(x, a, y, b, *, return_plan: bool = False, memory_limit=None):
    """W2^2 by linear programming (POT ``emd2``), differentiable through POT's torch backend.

    The cost matrix is formed in float64 whatever the dtype of the points (POT's network simplex works
    in float64 anyway), its close pairs from their differences (:func:`transport.problem.sq_dists`):
    a float32 matrix of squared norms minus twice the inner products loses the distances of close
    clouds to cancellation (relative error ~1e-7 (R / delta)^2 for clouds of radius R at distance
    delta: 1.6% at delta = 1e-3 R).
    The simplex runs on the costs scaled by a power of two to a largest entry in [1/2, 1) (exact; its optimality
    test has an absolute tolerance, which costs of 1e-12 pass unsolved), the results scaled back.
    Returns ``(value, plan, (u, v))`` in float64: a 0-d tensor (with the autograd graph of the
    points and weights), the (N, M) optimal plan (or None) and the Kantorovich potentials. Raises
    MemoryLimitError before allocating above the memory limit, and RuntimeError when POT's verdict
    (``log["result_code"]``) is anything but an optimal solution.
    """
    n, m = x.shape[0], y.shape[0]
    check_allocation(EMD_BYTES_PER_PAIR * n * m, f"w2 (exact) between {n} and {m} atoms",
                     "use method='streaming' (memory O(N + M)) or 'auto'", memory_limit)
    x, a, y, b = (t.to(torch.float64) for t in (x, a, y, b))
    M = sq_dists(x, y)
    # the simplex decides optimality on an absolute tolerance: costs of 1e-12 and below (clouds of size 1e-6)
    # came back from a plan that was not optimal (W2 off by 5-20%, potentials all zero). It runs on the costs
    # scaled by a power of two (exact) to a largest entry in [1/2, 1), and the results are scaled back
    top = float(M.detach().max()) if M.numel() else 0.0
    shift = -math.frexp(top)[1] if 0.0 < top < math.inf else 0
    value, log = _network_simplex(a, b, ldexp(M, shift), return_plan)
    return ldexp(value, -shift), (log["G"] if return_plan else None), (ldexp(log["u"], -shift),
                                                                     ldexp(log["v"], -shift))


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
    """Routine of method "exact": W2^2 in normalized units; the sorted formula in d = 1.

    In float64 whatever the measures' dtype: the network simplex works in float64 anyway, and float32
    sums and costs would round W2^2 by ~1e-7 relative, more for close clouds (see :func:`emd_squared`).
    """
    problem = problem.to(torch.float64)
    if problem.dim == 1:
        x, y = problem.plain_points()
        value, plan = quantile_squared(x, problem.a, y, problem.b, return_plan=return_plan,
                                       memory_limit=memory_limit)
        potentials = None
    else:
        value, plan, potentials = emd_squared(problem.x, problem.a, problem.y, problem.b,
                                              return_plan=return_plan, memory_limit=memory_limit)
    return dict(value=value, plan=plan, potentials=potentials, error=0.0, iterations=None, precision=value.dtype)
