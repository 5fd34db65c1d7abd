"""The entry points :func:`solve` (a :class:`TransportResult`) and :func:`w2` (a number).

Problem, solver and output are kept apart: :class:`~transport.problem.Problem` holds the two
measures (normalized), a routine of :data:`ROUTINES` solves it with the options of
:data:`~transport.options.DEFAULTS`, and :class:`~transport.result.TransportResult` reports.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch

from particles import Measure
from particles.threads import ThreadPolicy
from particles.validation import ConvergenceError, check_bool, check_on_failure

from .exact import solve_exact
from .options import TOL, UNIT_ROUNDOFF, check_memory_limit, check_method, resolve
from .problem import Problem, ldexp, same_atoms, to_units
from .result import TransportResult, report_failure
from .sinkhorn import solve_sinkhorn
from .streaming_sinkhorn import annealing_shortfall, refuse_or_hint, solve_streaming

log = logging.getLogger(__name__)

#: Method name -> routine(problem, eps, options, return_plan, memory_limit) -> dict of raw outputs
#: (value in normalized units, plan, potentials, error, iterations).
ROUTINES = {
    "exact": solve_exact,
    "sinkhorn": solve_sinkhorn,
    "streaming": solve_streaming,
}
ENTROPIC = ("sinkhorn", "streaming")

#: "auto" solves exactly while N * M is at most this. N = M = 2000 takes about a second on one core
#: and 190 MB for the network simplex.
AUTO_EXACT_MAX_PAIRS = 2000 * 2000
#: "auto" without reg uses reg = (AUTO_BLUR * diameter)^2 on the streaming path, the diameter being the diagonal
#: of the cube [lo, hi]^d spanned by the smallest and largest coordinates of both clouds, (hi - lo) sqrt(d)
#: (docs/math.md section 3.2): at least the diagonal of their bounding box, larger for clouds stretched along
#: one axis.
AUTO_BLUR = 0.05
#: one-thread seconds per cost entry of a Sinkhorn half-step (the tiled soft-min on a 2-core Xeon,
#: benchmarks/transport.md): the thread policy's estimate of a step, N M times this
SECONDS_PER_ENTRY = 1.5e-9

#: a float32 debiased entropic value below this many float32 unit roundoffs of the squared diameter (its three
#: terms' size: their rounding then exceeds 1e-3 of it) is solved again in float64
DEBIASED_RESOLUTION = 1e3


def _auto(problem: Problem) -> str:
    """The method "auto" stands for, from the sizes alone (never from the values).

    * d = 1: the sorted formula is exact in O(N log N) time and O(N + M) memory, at any size;
    * N * M <= AUTO_EXACT_MAX_PAIRS: the network simplex, exact, dense but small;
    * otherwise: streaming Sinkhorn, memory O(N + M) and time O(N M) per iteration, at the reg given
      or (AUTO_BLUR * diameter)^2, an entropic scale sqrt(reg) of 5% of the diameter (GeomLoss's blur,
      sqrt(reg / 2), of 3.5%): W2^2 within a few percent on the clouds of
      benchmarks/transport.md, but the debiased value does not see structure finer than that scale (a scale
      review: a sphere of radius 2 against a standard Gaussian in d = 3, N = 3000: 0.64 for W2^2 = 0.79, 19%
      low in W2); halve ``reg`` to see how far the value still moves, or give the reg the problem needs.
    """
    if problem.dim == 1 or problem.n * problem.m <= AUTO_EXACT_MAX_PAIRS:
        return "exact"
    return "streaming"


def _auto_eps(problem: Problem) -> float:
    """(AUTO_BLUR * diameter)^2 in normalized units, the diameter of the atoms of positive mass (a zero-weight atom
    changes neither measure); never 0: one point repeated still gets a positive eps."""
    both = problem.support_points()
    spread = float(both.max()) - float(both.min())
    return max((AUTO_BLUR * spread * problem.dim ** 0.5) ** 2, 1e-12)


def _solve(mu, nu, method, return_plan, on_failure, memory_limit, given, stacklevel, caller) -> TransportResult:
    """``caller``: the function the user called ("solve", "w2"), which the messages name."""
    problem = Problem(mu, nu)
    problem.caller = caller
    if getattr(mu, "positions", None) is not None and getattr(nu, "positions", None) is not None:
        # both masked: W2 of their points may pair atoms across positions (0 for two atoms that swap positions)
        warnings.warn(f"{caller}: the measures' positions are not used (W2 between their points on R^d, which may "
                      "move mass across positions); transport.conditional_w2 keeps each position's atoms together. "
                      "Pass mu.unmasked() and nu.unmasked() to compare the points on purpose", UserWarning,
                      stacklevel=stacklevel + 1)
    method = check_method(method)
    return_plan = check_bool(return_plan, "return_plan")
    check_on_failure(on_failure)
    limit = check_memory_limit(memory_limit)
    opts = resolve(method, given, problem.dtype)
    if method == "auto":
        if return_plan:
            raise ValueError("return_plan: method='auto' may choose 'streaming', which never forms the plan; "
                             "choose method='exact' or 'sinkhorn' for a plan")
        method = _auto(problem)
        if method == "exact":
            opts = {}  # the entropic options were checked; they serve only the streaming branch
        elif opts["reg"] is None:
            opts["reg"] = problem.reg(_auto_eps(problem))
    eps, hint = None, None
    if method in ENTROPIC:
        if opts["reg"] is None:
            raise ValueError(f"reg: method={method!r} needs an entropic regularization reg > 0 "
                             "(POT's epsilon, in units of squared distance)")
        # float32 that cannot resolve the plan at this reg works in float64 (Problem.precision)
        problem = problem.to(problem.precision(opts["reg"], opts["tol"]))
        eps = problem.eps(opts["reg"])
        if method == "streaming" and return_plan:
            raise ValueError("return_plan: the streaming method never forms the N x M plan; "
                             "use method='sinkhorn' (dense) for a plan, or the potentials of the result")
        if method == "streaming":
            # an annealing longer than max_iter: refused before any work ("raise"), or run compressed ("warn")
            support = problem.support_points()
            hint = refuse_or_hint(annealing_shortfall(support, support, eps, opts["scaling"], opts["max_iter"]),
                                  on_failure, opts["max_iter"])
    # one thread for small problems, the free cores for large ones (particles/threads.py)
    with ThreadPolicy(step_seconds=SECONDS_PER_ENTRY * problem.n * problem.m):
        raw = ROUTINES[method](problem, eps, opts, return_plan, limit)
        # (float32 measures that Problem.precision moved to float64 from the start were solved at float32's
        # tolerance, as loose for such a value: a translate by 1e-6 at reg 1e-2 came out 0, converged)
        loose = problem.dtype == torch.float32 or opts.get("tol", 0.0) > TOL[torch.float64]
        if eps is not None and opts.get("debias") and problem.input_dtype == torch.float32 and loose and not (
                float(raw["value"].detach()) >= DEBIASED_RESOLUTION * UNIT_ROUNDOFF[torch.float32]
                * problem.squared_diameter()):
            # a float32 debiased value within float32's rounding of its three terms (each of the squared
            # diameter's size): a cloud against its translate by 1e-4 came out 0 (a negative value clamped) or 11
            # times too large, converged. It is solved again in float64, to float64's tolerance where the one
            # asked is looser: a marginal error tol leaves the value off by about eps tol^2, which a value this
            # small may be below too (a translate by 1e-6 at reg 0.1 came out 0, converged at float32's 1e-5)
            problem = problem.to(torch.float64)
            raw = ROUTINES[method](problem, eps, {**opts, "tol": min(opts["tol"], TOL[torch.float64])}, return_plan,
                                   limit)
    if not bool(torch.isfinite(raw["value"].detach())):
        if eps is not None:
            # float64 is kept whatever D2 / eps (Problem.precision): far beyond what it resolves, the plan's
            # exponents (f + g - C) / eps are rounding noise amplified by D2 / eps, and the value overflows
            noise = UNIT_ROUNDOFF[problem.dtype] * problem.squared_diameter() / eps
            raise ValueError(f"reg: reg = {opts['reg']:.3g} is too small for {problem.dtype} at this scale: the "
                             f"plan's exponents carry rounding errors of about {noise:.2g} (unit roundoff x squared "
                             "diameter / reg), and its value overflows; use a larger reg or method='exact'")
        # the normalization keeps every finite input finite: reaching this is a solver failure
        raise ConvergenceError(f"{caller} ({method}): the computed value is {float(raw['value'])} "
                               f"(error {raw['error']:.3g} after {raw['iterations']} iterations)")
    if eps is not None and opts.get("debias"):
        _check_resolution(problem, eps, raw, method, caller, stacklevel + 1)
    raw_value = raw["value"]
    if problem.grad:  # a value with gradients comes in the measures' dtype, whatever the solver worked in
        raw_value = raw_value.to(problem.input_dtype)
    value, value_sq = to_units(raw_value, problem.k, problem.grad)
    potentials = raw["potentials"]
    if potentials is not None:
        potentials = tuple(ldexp(p.detach(), 2 * problem.k) for p in potentials)
        if not all(bool(torch.isfinite(p).all()) for p in potentials):
            potentials = None
    tol = opts.get("tol")
    err = float(raw["error"])
    result = TransportResult(
        value=value, value_squared=value_sq, method=method, plan=raw["plan"], potentials=potentials,
        error=err, converged=tol is None or err <= tol, iterations=raw["iterations"], precision=raw["precision"],
        reg=opts.get("reg"), debias=opts.get("debias"), tol=tol, max_iter=opts.get("max_iter"))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("transport %s: %d x %d atoms, d = %d, %s, reg %s, %s iterations, error %.3g, converged %s, "
                  "value %.6g", method, problem.n, problem.m, mu.points.shape[-1], result.precision, result.reg,
                  result.iterations, err, result.converged,
                  float(value.detach() if isinstance(value, torch.Tensor) else value))
    if not result.converged:
        report_failure(result, on_failure, stacklevel + 1, caller, hint or _rounding_floor_hint(problem, eps, method,
                                                                                                err))
    return result


#: a debiased value below this many unit roundoffs of (eps + squared diameter), the size of the log-domain sums'
#: rounding, is said to be unresolved (a RuntimeWarning of :func:`transport.solve` and :func:`transport.w2`)
RESOLUTION_FACTOR = 100.0


def _check_resolution(problem: Problem, eps: float, raw: dict, method: str, caller: str, stacklevel: int) -> None:
    """A RuntimeWarning where the Sinkhorn divergence is within the rounding of its three terms: the soft-mins are
    -eps log sums, rounded to about u eps, and the terms are of the squared diameter's size, so a value below
    :data:`RESOLUTION_FACTOR` u (eps + D^2) (u of the dtype the solve worked in) may be off by several percent or
    more though every marginal met tol: a cloud against its translate by 1e-6 at reg 1000 D^2, float64, came out
    between 0 and 1.43 times the closed form |t|^2, converged. Measures with the same atoms (exactly 0) pass."""
    value = float(raw["value"].detach())
    work = raw.get("precision") or problem.dtype
    floor = RESOLUTION_FACTOR * UNIT_ROUNDOFF.get(work, UNIT_ROUNDOFF[torch.float32]) * (
        eps + problem.squared_diameter())
    if not value < floor:
        return
    if same_atoms(problem.x, problem.log_a, problem.y, problem.log_b) is not None:
        return

    def units(v):   # back to the measures' squared units
        try:
            return math.ldexp(v, 2 * problem.k)
        except OverflowError:
            return math.inf

    warnings.warn(f"{caller} ({method}): the Sinkhorn divergence {units(max(value, 0.0)):.3g} is below "
                  f"{RESOLUTION_FACTOR:g} roundings of its terms (unit roundoff of {str(work).replace('torch.', '')} "
                  f"x (reg + squared diameter) = {units(floor / RESOLUTION_FACTOR):.2g}): its relative error may "
                  "be several percent or more, though the marginals met tol; a smaller reg (or the exact W2) "
                  "resolves it", RuntimeWarning, stacklevel=stacklevel + 1)


def _rounding_floor_hint(problem: Problem, eps, method: str, err: float) -> str | None:
    """What to change when the streaming solver stalls at the rounding of its costs: it forms |x - y|^2 as
    |x|^2 + |y|^2 - 2 <x, y> (centred points), so coordinates of size R round the costs by about u R^2 (u the unit
    roundoff), and the marginals by about u R^2 / reg. Clusters 1e5 apart at reg = 1 stalled near 1e-7 in
    float64 after 5000 iterations, and more made it worse, while dense Sinkhorn (close pairs from their
    differences) converged in 41. None where the error is far above that floor (the generic advice applies)."""
    if method != "streaming" or eps is None or not math.isfinite(err):
        return None
    pts = problem.support_points()
    floor = UNIT_ROUNDOFF[problem.dtype] * float((pts.detach() ** 2).sum(-1).max()) / eps if pts.numel() else 0.0
    if not err <= 10.0 * floor:
        return None
    return (f"The error is near the rounding floor of the costs the streaming solver forms from the points' norms "
            f"(unit roundoff x largest squared norm / reg = {floor:.2g}): more iterations (max_iter) will not lower "
            "it. Use method='sinkhorn' (dense: close pairs from their differences), solve each far-apart cluster "
            "on its own, or loosen tol to about this floor.")


def solve(mu: Measure, nu: Measure, method: str = "exact", *, reg=None, debias=None, tol=None, max_iter=None,
          scaling=None, overrelaxation=None, chunk_elements=None, return_plan=False, on_failure: str = "raise",
          memory_limit=None) -> TransportResult:
    r"""Optimal transport between two measures for the cost \|x - y\|^2: W2 and what the solver reached.

    W2(mu, nu)^2 = min over couplings pi of sum_ij pi_ij \|x_i - y_j\|^2 (docs/math.md section 3).
    Positions of masked measures are ignored here (:func:`transport.conditional_w2` uses them).

    Parameters
    ----------
    mu, nu : :class:`particles.Measure`
        Same dimension, dtype (float32 or float64) and device.
    method : ``"exact"``, ``"sinkhorn"``, ``"streaming"`` or ``"auto"``
        "exact": POT's network simplex (``ot.emd2``) on the squared-distance matrix; d = 1 uses
        the sorted (quantile) closed form in O(N log N) instead.
        "sinkhorn": POT's log-domain Sinkhorn (``ot.sinkhorn(..., method="sinkhorn_log")``) on the
        dense cost matrix, N, M up to a few thousand.
        "streaming": the same entropic problem without the N x M matrix (memory O(N + M),
        eps-scaling, CPU or CUDA); N up to ~10^5 on a CPU.
        "auto": "exact" when d = 1 or N * M <= :data:`AUTO_EXACT_MAX_PAIRS`, else "streaming"
        (the entropic options given then apply; :attr:`TransportResult.method` says which ran).
    reg : float
        Entropic regularization eps of the entropic methods, in units of squared distance: POT's
        ``reg`` for the cost matrix M_ij = \|x_i - y_j\|^2 (``ot.sinkhorn2(a, b, M, reg)`` gives our
        ``debias=False`` value), OT_eps = min <pi, M> + eps KL(pi \| mu x nu). GeomLoss's
        ``SamplesLoss("sinkhorn", p=2, blur=...)`` uses the cost \|x - y\|^2 / 2 and eps = blur^2: the
        same problem for blur^2 = reg / 2, its value being S_eps / 2 (checked numerically against
        GeomLoss 0.3.1: its value tends to half ours as its ``scaling`` -> 1, 4e-9 relative at
        0.9999). Required for "sinkhorn" and "streaming"; "auto" defaults to (AUTO_BLUR * diameter)^2 (GeomLoss's
        blur 0.05 / sqrt 2 = 3.5% of the diameter), an
        estimate of W2 that can be far off where the measures differ below that scale (19% low in W2 between a
        sphere and a Gaussian, N = 3000): halve reg and compare.
    debias : bool
        True (the default): the Sinkhorn divergence S_eps = OT_eps(mu, nu) - (OT_eps(mu, mu) + OT_eps(nu, nu)) / 2
        (zero for mu = nu, tends to W2^2 as reg -> 0; GeomLoss's ``debias=True``). False:
        <pi_eps, C>, the cost of the entropic plan (>= W2^2; POT's ``sinkhorn2`` value). The three terms are
        of the squared diameter's size and their soft-mins round to about u reg: a divergence below 100 u
        (reg + squared diameter) is unresolved (off by percents or more, whatever tol), and a RuntimeWarning
        says so (a float32 one is first solved again in float64).
    tol : float
        L1 error of the plan's marginals, sum_i \|pi 1 - a\|_i + sum_j \|pi^T 1 - b\|_j, at which
        Sinkhorn stops; default by the measures' dtype, :data:`transport.TOL` (1e-7 in float64, 1e-5 in
        float32, also when float32 measures are solved in float64).
        Not POT's ``stopThr`` (an L2 error of one marginal): the dense method passes POT
        tol / sqrt(M), which implies ours. At least ``transport.options.TOL_FLOOR`` (1e-14, about 90 unit
        roundoffs of float64: the rounding of the marginals themselves), below 2 (the L1 error of a plan whose
        marginals are probability measures never exceeds 2; a plan from potentials that did not converge is not
        normalized, and its reported error can be far larger). ``converged``
        certifies the marginals; the value (both methods take the dual objective, whose error is second order in
        the marginal error) is then known to a small multiple of tol x squared diameter in absolute terms: for
        measures much closer than their diameter, tighten tol (200 points of squared diameter 113 against their
        translate by 1.2e-4, reg = 1: W2 2-3% low at tol = 1e-5, 2e-6 at 1e-7, exact to rounding at 1e-9). A
        float32 debiased value within float32's rounding of its terms is solved again in float64; a reg whose
        potentials no dtype resolves (reg above about 1e8 times the squared diameter in float64) is a ValueError
        naming reg.
    max_iter : int
        Sinkhorn updates, eps-scaling levels included (POT's ``numItermax``; default 10000
        "sinkhorn", 5000 "streaming"). Every loop of every solver is bounded by it.
    scaling : float
        "streaming": eps-scaling ratio in [0, 1) (default 0.5), GeomLoss's ``scaling``: sqrt(eps) is
        multiplied by it per level, from the squared diameter of the clouds down to reg; 0 solves at reg
        directly. An annealing of ``max_iter`` levels or more is refused before any work with
        ``on_failure="raise"`` (a ValueError naming the smallest ``max_iter`` that runs it); with "warn" it is
        compressed to ``max_iter - 1`` levels over the same range and the solve reported as any other that
        misses ``tol``.
    overrelaxation : ``"auto"`` or float
        "streaming": the factor omega in [1, 2) of the over-relaxed steps at reg
        (f <- f + omega (T(g) - f); 1: plain Sinkhorn), or "auto" (the default), adapted to the observed
        convergence rate (:mod:`transport.overrelaxation`; 1.8-8x fewer passes at blur 0.05). The last
        steps are plain, so ``error`` certifies the plan whatever the factor. A fixed factor near 2 can
        stall (1.9 missed tol = 1e-4 within 5000 steps on a weighted float32 problem that "auto" solved);
        "auto" backs off when the error grows.
    chunk_elements : int
        "streaming": elements of the largest block of the cost held at once (memory, not accuracy;
        default 2^18).
    return_plan : bool
        Also return the (N, M) coupling ("exact" and "sinkhorn").
    on_failure : ``"raise"`` or ``"warn"``
        An entropic solve that misses ``tol`` within ``max_iter``: "raise" a
        :class:`~particles.validation.ConvergenceError` carrying this result (``.estimate``), or
        "warn" (RuntimeWarning) and return it with ``converged=False``. As for
        :func:`meanfield.local_lipschitz`. A solve running longer than a few seconds logs its progress at
        INFO on the ``transport`` logger (every :data:`particles.progress.PROGRESS_SECONDS`, 5 s).
    memory_limit : int or str
        Bytes (or "16G") a dense method may take; default ``$SMOOTH_ATTENTION_MEMORY_LIMIT`` or
        8 GiB. Above it a :class:`~particles.validation.MemoryLimitError` names the size and the
        method to use instead, before anything is allocated.

    Returns
    -------
    TransportResult
        ``value`` (W2, a float or a 0-d tensor carrying the autograd graph when the points require
        grad; points requiring grad are a ValueError for ``method="streaming"`` with ``debias=False``),
        ``value_squared``, ``plan``, ``potentials``, ``error``, ``converged``, ``iterations``, ``method``,
        ``precision`` (the dtype the solver worked in) and the options used.

    Notes
    -----
    Options that do not apply to the method are a TypeError; values are checked (a
    ValueError or TypeError names the option). The clouds are centred and, far outside unit
    scales (coordinates beyond ~1e149 or below ~1e-149 in float64, ~1e14 / 1e-14 in float32),
    rescaled by a power of two before solving, so that squared distances never overflow or
    underflow; a ``reg`` too small or too large for the dtype at that scale is a ValueError.

    Precision: "exact" works in float64 whatever the dtype (POT's network simplex does anyway), the
    close pairs of the cost matrix recomputed from their differences (no cancellation for close
    clouds, see :func:`transport.problem.sq_dists`). The entropic methods work in the measures'
    dtype, except float32 measures whose plan float32 cannot resolve: its exponents
    (f_i + g_j - C_ij) / reg carry an error of about 6e-8 squared diameter / reg, which must stay
    below ``tol`` (squared diameter / reg <= ~170 at the default tol = 1e-5); those are solved in
    float64. A float32 "streaming" solve is certified: the marginal error of the plan its potentials
    define is measured again in float64 (one pass over the N M entries), and if it misses ``tol``
    there the solve continues in float64 from those potentials; "sinkhorn" forms its plan and
    measures that plan's marginals, summed in float64. ``precision`` of the result says which dtype
    ran; plan and potentials come in it, a value with gradients in the measures' dtype. float32
    weights whose sum is off 1 by more than float32's rounding (Measure accepts 1e-5) are renormalized in
    float64. A float32 result is therefore never
    ``converged=True`` on float32's own rounding (docs/math.md section 3.2).

    Examples
    --------
    >>> from particles import Measure
    >>> from transport import solve
    >>> res = solve(Measure([[0.0, 0.0]]), Measure([[3.0, 4.0]]))
    >>> res.value, res.method
    (5.0, 'exact')
    """
    given = dict(reg=reg, debias=debias, tol=tol, max_iter=max_iter, scaling=scaling,
                 overrelaxation=overrelaxation, chunk_elements=chunk_elements)
    return _solve(mu, nu, method, return_plan, on_failure, memory_limit, given, stacklevel=2, caller="solve")


def w2(mu: Measure, nu: Measure, method: str = "exact", *, squared=False, return_plan=False, reg=None,
       debias=None, tol=None, max_iter=None, scaling=None, overrelaxation=None, chunk_elements=None,
       on_failure: str = "raise", memory_limit=None):
    """Wasserstein-2 distance between two measures on R^d (docs/math.md section 3): a number.

    Of masked measures, the distance between their points (positions not used; a UserWarning says so when both
    measures have positions): :func:`transport.conditional_w2` is the transport that keeps positions apart
    (Definition 4.1), and is never below it.

    The value of :func:`transport.solve` (same parameters; see it for the methods, their options
    and conventions): a float, or a 0-d tensor carrying the autograd graph when the points (or
    weights) require grad, for every method and option except ``method="streaming"`` (or "auto"
    choosing it) with ``debias=False``: the cost of the entropic plan has no envelope formula there, and
    points that require grad are a ValueError (use ``debias=True``, or ``method="sinkhorn"``, which
    differentiates through its iterations). The streaming path differentiates in the points only: weights
    that require grad are a ValueError there. A gradient in the weights is defined along changes that keep
    their sum (1); its component along (1, ..., 1) is a convention that differs by method, so differentiate
    normalized weights (``Measure(x, log_weights=torch.log_softmax(z, 0))``), not raw ones.
    ``squared=True`` returns W2^2 (OverflowError when it exceeds the float range although W2 does not).
    The exact method computes W2^2 to float64's resolution, about 1e-16 of the squared scale of the clouds, and
    takes its square root: the same measure written differently (an atom split in two, points that differ in
    their last bit) comes out at up to about 1e-8 of that scale, not 0. Compare W2^2 (``squared=True``) with
    zero, or W2 with 1e-7 times the scale.
    The plan, the potentials and the certificate come from :func:`transport.solve`, which returns a
    :class:`~transport.result.TransportResult` (``return_plan=True`` here still returns ``(value, plan)``,
    with a DeprecationWarning).

    Examples
    --------
    >>> import torch
    >>> from particles import Measure
    >>> from transport import w2
    >>> mu = Measure(torch.tensor([[0.0], [1.0]], dtype=torch.float64))
    >>> w2(mu, mu.pushforward(lambda x: x + 2.0))
    2.0
    """
    squared = check_bool(squared, "squared")
    if check_bool(return_plan, "return_plan"):
        warnings.warn("w2(..., return_plan=True): w2 returns a number; use transport.solve(mu, nu, method, "
                      "return_plan=True).plan (its TransportResult also has the potentials and the error)",
                      DeprecationWarning, stacklevel=2)
    given = dict(reg=reg, debias=debias, tol=tol, max_iter=max_iter, scaling=scaling,
                 overrelaxation=overrelaxation, chunk_elements=chunk_elements)
    res = _solve(mu, nu, method, return_plan, on_failure, memory_limit, given, stacklevel=2, caller="w2")
    if squared and not isinstance(res.value_squared, torch.Tensor) and math.isinf(res.value_squared):
        raise OverflowError(f"squared: W2^2 = ({float(res.value):.6g})^2 exceeds the float range; "
                            "ask for W2 (squared=False)")
    out = res.value_squared if squared else res.value
    return (out, res.plan) if return_plan else out
