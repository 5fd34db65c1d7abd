"""The one entry point ``w2``: dispatch to the exact, dense entropic or streaming solver."""

from __future__ import annotations

import warnings

from particles import Measure

from ._common import check_pair, check_reg, check_tol_iter, finish, needs_grad
from .exact import w2_squared_1d, w2_squared_exact
from .sinkhorn import w2_squared_sinkhorn
from .streaming import sinkhorn_streaming

METHODS = ("exact", "sinkhorn", "streaming", "auto")

#: "auto" solves exactly while N * M is at most this (N = M ~ 2000; about a second on one core).
AUTO_EXACT_MAX_PAIRS = 2000 * 2000
#: "auto" with reg=None uses eps = (AUTO_BLUR * diameter)^2 on the streaming path.
AUTO_BLUR = 0.05


def w2(mu: Measure, nu: Measure, method: str = "exact", *, reg: float | None = None, debias: bool = True,
       return_plan: bool = False, squared: bool = False, tol: float | None = None, max_iter: int | None = None,
       strict: bool = False, **options):
    """Wasserstein-2 distance between two measures on R^d (MATH.md section 3).

    W2(mu, nu)^2 = min over couplings pi of sum_ij pi_ij |x_i - y_j|^2. Positions of masked
    measures are ignored here (use :func:`transport.conditional_w2` for Definition 4.1).

    method:
      "exact"     POT's network simplex on the squared-distance matrix; d = 1 uses the sorted
                  (quantile) closed form in O(N log N) instead.
      "sinkhorn"  POT's log-domain Sinkhorn with entropic regularization ``reg`` on the dense
                  cost matrix; ``debias=True`` gives sqrt of the Sinkhorn divergence S_eps,
                  ``debias=False`` sqrt of the cost <pi_eps, C> of the entropic plan (>= W2).
      "streaming" the same S_eps (or <pi_eps, C>) from :func:`transport.sinkhorn_streaming`,
                  memory O(N + M), eps-scaling; float32 or float64, CPU or CUDA.
      "auto"      exact when d = 1 or N * M <= AUTO_EXACT_MAX_PAIRS, else streaming with
                  ``reg`` (default (0.05 * diameter)^2) and ``debias``.

    Returns a float, or a 0-d tensor carrying the autograd graph when points (or weights)
    require grad. ``squared=True`` returns W2^2. ``return_plan=True`` returns (value, plan), the
    (N, M) coupling (not available for "streaming"). Entropic methods that do not reach
    ``tol`` (L1 marginal error; default 1e-7 in float64, 1e-5 in float32) within ``max_iter``
    (default 10000 "sinkhorn", 5000 "streaming") warn with SinkhornConvergenceWarning, or
    raise RuntimeError when ``strict=True``. Extra ``options`` go to the streaming solver
    (``scaling``, ``chunk_elements``).
    """
    check_pair(mu, nu)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if options and method not in ("streaming", "auto"):
        raise TypeError(f"w2: unexpected options {sorted(options)} for method={method!r}")
    grad = needs_grad(mu, nu)
    if method == "auto":
        if mu.dim == 1 or mu.n * nu.n <= AUTO_EXACT_MAX_PAIRS:
            method = "exact"
        else:
            method = "streaming"
            if reg is None:
                both = [mu.points.detach(), nu.points.detach()]
                lo = min(float(p.min()) for p in both)
                hi = max(float(p.max()) for p in both)
                reg = max((AUTO_BLUR * (hi - lo) * mu.dim ** 0.5) ** 2, 1e-12)
    if method == "exact":
        if reg is not None:
            warnings.warn("w2: reg is ignored by method='exact'", UserWarning, stacklevel=2)
        solver = w2_squared_1d if mu.dim == 1 else w2_squared_exact
        value, plan = solver(mu, nu, return_plan)
    elif method == "sinkhorn":
        reg = check_reg(reg, method)
        t = (1e-7 if mu.dtype.itemsize == 8 else 1e-5) if tol is None else tol
        t, it = check_tol_iter(t, 10_000 if max_iter is None else max_iter)
        value, plan = w2_squared_sinkhorn(mu, nu, reg, debias=debias, return_plan=return_plan, tol=t,
                                          max_iter=it, strict=strict)
    else:
        if return_plan:
            raise ValueError("return_plan: the streaming method never forms the N x M plan; "
                             "use method='sinkhorn' (dense) for a plan")
        res = sinkhorn_streaming(mu, nu, reg, debias=debias, tol=tol,
                                 max_iter=5000 if max_iter is None else max_iter, strict=strict, **options)
        value, plan = res.value, None
    out = finish(value, squared, grad)
    return (out, plan) if return_plan else out
