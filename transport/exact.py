r"""Exact W2: POT's network simplex (``ot.emd2``) on squared distances, and the d = 1 closed form.

W2(mu, nu)^2 = min over couplings pi of sum_ij pi_ij \|x_i - y_j\|^2 (docs/math.md section 3).
Both routines take normalized clouds (see :mod:`transport.problem`) and return W2^2 in those units.
"""

from __future__ import annotations

import math
import warnings

import torch

from particles.validation import check_allocation

from .problem import ldexp, pot, sq_dists

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
            value, log = pot().emd2(a, b, M, numItermax=EMD_MAX_ITER, log=True, return_matrix=return_plan)
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


#: The exact method's plan is checked against a dual lower bound (c-transforms of its potentials). A W2 above a
#: positive bound by more than this fraction is not the optimum the simplex reports (RuntimeError): costs spanning
#: more than float64 resolves (clusters 1e7 apart: the plan's W2 10% above the assignment problem's).
DUAL_GAP_RTOL = 1e-3


def _dual_bound(M, u, a, b):
    """A lower bound of min over couplings of sum pi M (weak duality), and its rounding: the c-transforms
    v = min_i (M_ij - u_i), then u = min_j (M_ij - v_j) make (u, v) feasible whatever u was, and sum a u + sum b v
    bounds the optimum from below. Each entry of the transforms rounds by at most 2 eps (|M| + |potential|) at the
    entry that attains it; the second return value sums those with the weights. Float64, detached, the atoms of
    positive weight only."""
    eps = torch.finfo(torch.float64).eps
    Dv = M - u[:, None]
    v, iv = Dv.min(0)
    err_v = 2 * eps * (M.gather(0, iv[None, :])[0] + u[iv].abs())
    Du = M - v[None, :]
    u, iu = Du.min(1)
    err_u = 2 * eps * (M.gather(1, iu[:, None])[:, 0] + v[iu].abs() + err_v[iu])
    return float((a * u).sum() + (b * v).sum()), float((a * err_u).sum() + (b * err_v).sum())


def _check_gap(C, u, a, b, reduced: float, shifts: float):
    """RuntimeError when the plan's cost on the reduced costs C is above a positive dual bound (:func:`_dual_bound`)
    by more than :data:`DUAL_GAP_RTOL` of W2 and the bound's own rounding: then the simplex did not find the optimum
    it reports. ``u`` is the simplex's row potential (the column one is its c-transform, recomputed). A bound at or
    below 0 is no evidence (measures equal to rounding) and raises nothing."""
    if C.numel() == 0:
        return
    bound, noise = _dual_bound(C, u, a, b)
    lower, upper = shifts + bound, shifts + reduced
    # W2^2 within the bound's own rounding (4 noise) of 0: measures equal to rounding (a split measure against
    # itself, W2 = 1e-8) leave the simplex's potentials unresolved at that level, and their plan is kept as it was.
    # Above it, the plan must be certified: the bound less its rounding within DUAL_GAP_RTOL of W2. Costs that
    # span more than float64 resolves (clusters 1e7 apart) give a bound too coarse to certify anything (its
    # rounding 8% of W2^2, the plan's W2 0.7-6% high): that is an error too, not a value
    certified = lower - 4 * noise
    if upper > 4 * noise and (certified <= 0 or math.sqrt(certified) < (1.0 - DUAL_GAP_RTOL) * math.sqrt(upper)):
        got = f"a dual lower bound {math.sqrt(certified):.6g}" if certified > 0 else "no positive dual lower bound"
        raise RuntimeError(
            f"w2 (exact): the network simplex's plan cannot be certified optimal to float64's resolution: its W2 "
            f"is {math.sqrt(upper):.6g}, {got} after the bound's own rounding ({DUAL_GAP_RTOL:g} relative "
            f"needed); the reduced squared distances reach {float(C.max()):.3g} (far-apart clusters?): compute W2 "
            "within each cluster, or use method='sinkhorn' with a small reg")


def emd_squared(x, a, y, b, *, return_plan: bool = False, memory_limit=None):
    """W2^2 by linear programming (POT ``emd2``), differentiable through POT's torch backend.

    The cost matrix is formed in float64 whatever the dtype of the points (POT's network simplex works
    in float64 anyway), its close pairs from their differences (:func:`transport.problem.sq_dists`):
    a float32 matrix of squared norms minus twice the inner products loses the distances of close
    clouds to cancellation (relative error ~1e-7 (R / delta)^2 for clouds of radius R at distance
    delta: 1.6% at delta = 1e-3 R).

    The simplex decides optimality with an absolute tolerance (about float64's epsilon, on costs it does not
    rescale), so what it is given is prepared, each step exact for the optimum: atoms of zero weight are left out
    (they carry no mass; a zero-weight atom 1e8 away doubled W2, its cost of 3e16 putting the others' below the
    tolerance); each row of the costs, then each column, is reduced by its minimum (r_i, c_j: the plan is
    unchanged and W2^2 moves by sum a r + sum b c); the reduced costs are scaled by a power of two to a largest
    entry in [1/2, 1) (costs of 1e-12 passed the tolerance unsolved). The plan is then checked against a dual lower
    bound (c-transforms of the simplex's potentials on the reduced costs, ``_dual_bound``): a W2 more than
    :data:`DUAL_GAP_RTOL` above a positive bound is a RuntimeError (costs spanning more than float64 resolves,
    clusters 1e7 apart). Returns ``(value, plan, (u, v))`` in float64: a 0-d tensor (with the autograd graph of
    the points and weights), the (N, M) optimal plan (or None) and Kantorovich potentials (those of zero-weight
    atoms their c-transforms). Raises MemoryLimitError before allocating above the memory limit, and RuntimeError
    when POT's verdict (``log["result_code"]``) is anything but an optimal solution.
    """
    n, m = x.shape[0], y.shape[0]
    check_allocation(EMD_BYTES_PER_PAIR * n * m, f"w2 (exact) between {n} and {m} atoms",
                     "use method='streaming' (memory O(N + M)) or 'auto'", memory_limit)
    x, a, y, b = (t.to(torch.float64) for t in (x, a, y, b))
    ka, kb = a.detach() > 0, b.detach() > 0
    full_a, full_b = bool(ka.all()), bool(kb.all())
    xs, as_ = (x, a) if full_a else (x[ka], a[ka])
    ys, bs = (y, b) if full_b else (y[kb], b[kb])
    M = sq_dists(xs, ys)
    r = M.amin(1) if M.numel() else M.new_zeros(M.shape[0])
    c = (M - r[:, None]).amin(0) if M.numel() else M.new_zeros(M.shape[1])
    C = (M - r[:, None] - c[None, :]).clamp_min(0.0)
    top = float(C.detach().max()) if C.numel() else 0.0
    shift = -math.frexp(top)[1] if 0.0 < top < math.inf else 0
    reduced, log = _network_simplex(as_, bs, ldexp(C, shift), return_plan)
    reduced = ldexp(reduced, -shift)
    shifts = (as_ * r).sum() + (bs * c).sum()
    u_red, v_red = ldexp(log["u"], -shift), ldexp(log["v"], -shift)
    _check_gap(C.detach(), u_red, as_.detach(), bs.detach(), float(reduced.detach()), float(shifts.detach()))
    u, v = u_red + r.detach(), v_red + c.detach()
    plan = log["G"] if return_plan else None
    if not (full_a and full_b):
        # the left-out atoms: no mass in the plan; their potentials the c-transforms of the others'
        if return_plan:
            plan = plan.new_zeros(n, m)
            plan[torch.nonzero(ka).flatten()[:, None], torch.nonzero(kb).flatten()[None, :]] = log["G"]
        if not full_b:
            v = v.new_zeros(m).index_put_((kb,), v)
            v[~kb] = (sq_dists(xs.detach(), y[~kb].detach()) - u[:, None]).amin(0)
        if not full_a:
            u = u.new_zeros(n).index_put_((ka,), u)
            u[~ka] = (sq_dists(x[~ka].detach(), ys.detach()) - v[kb][None, :]).amin(1)
    return reduced + shifts, plan, (u, v)


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
