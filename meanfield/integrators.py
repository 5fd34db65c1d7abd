"""Time integrators of the token dynamics: fixed-step Euler and RK4, and torchdiffeq's adaptive solvers.

:data:`FIXED` maps a method name to one step ``step(f, t, Y, h, layer) -> Y_next``; :data:`ADAPTIVE` lists the
adaptive Runge-Kutta methods of ``torchdiffeq.odeint`` (its public entry point). Explicit Euler with
step 1/L on [0, 1] is exactly L residual layers x <- x + (1/L) Gamma(x) (docs/math.md section 6).

Both integrate piece by piece between the requested output times and the layer boundaries of
piecewise-constant parameters, so that no step straddles a change of parameters and a scheme keeps
its order. A requested time within a few ulps of its dtype of a boundary is taken to be on it
(:func:`snap_to_edges`), so that rounding makes no sliver piece.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import logging
import math
import numbers

import torch

from particles.progress import Heartbeat
from particles.validation import ConvergenceError, check_positive_int

log = logging.getLogger("meanfield.dynamics")

__all__ = ["FIXED", "ADAPTIVE", "NONCONVERGENCE", "RTOL_MIN", "SNAP_ULPS", "euler_step", "rk4_step", "snap_to_edges",
           "integrate_fixed", "integrate_adaptive"]

#: the fixed-step default: 100 steps over the whole time span
DEFAULT_STEPS = 100


def euler_step(f, t, Y, h, layer):
    return Y + h * f(t, Y, layer)


def rk4_step(f, t, Y, h, layer):
    k1 = f(t, Y, layer)
    k2 = f(t + h / 2, Y + (h / 2) * k1, layer)
    k3 = f(t + h / 2, Y + (h / 2) * k2, layer)
    k4 = f(t + h, Y + h * k3, layer)
    return Y + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)


#: The fixed-step methods by name, each one step ``step(f, t, Y, h, layer) -> Y_next``
FIXED = {"euler": euler_step, "rk4": rk4_step}
#: Adaptive methods of torchdiffeq.odeint (documented names; the solver is reached through odeint only)
ADAPTIVE = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")


#: the beginnings of torchdiffeq's assertion messages that mean its adaptive solver did not converge (too many
#: steps, a step smaller than the time's resolution, a state that left the floating-point range)
NONCONVERGENCE = ("max_num_steps exceeded", "underflow in dt", "non-finite values in state")


def check_finite(Y, t):
    if not bool(torch.isfinite(Y.detach()).all()):
        raise FloatingPointError(f"simulate: the particles left the floating-point range at t = {t:g} "
                                 "(reduce the step or the time span)")


#: a requested time within this many ulps (of the times' dtype, at the magnitude of the span's ends) of a layer
#: boundary is taken to be on it
SNAP_ULPS = 4


def snap_to_edges(times, edges, dtype):
    """The requested times with each interior one that lies within ``SNAP_ULPS`` ulps of its nearest layer edge
    moved onto it.

    The edges t0 + (t1 - t0) l / L are float64 and the requested times are rounded to their dtype (float32 1/3 is
    0.33333334, float64 linspace's 0.3 is 0.30000000000000004): merged as they are, they make sliver pieces
    [1/3, 0.33333334] that cost steps, and that collapse to one time when cast back to the dtype. Each time goes to
    its nearest edge only, within ``SNAP_ULPS`` ulps of the dtype at that edge and never a quarter of the layer
    spacing (coarse dtypes, or a span far from 0, leave a time where it is rather than on another layer's edge);
    a time already on an edge stays; at most one time goes to an edge (the nearest), so the times stay strictly
    increasing; the ends (the span that defines the edges) never move.
    """
    out = list(times)
    inner = sorted(e for e in edges if out[0] < e < out[-1]) if len(out) >= 3 else []
    if not inner:
        return out
    points = [out[0], *inner, out[-1]]
    spacing = min(b - a for a, b in zip(points[:-1], points[1:]))
    eps = torch.finfo(dtype).eps
    best = {}   # edge index -> (distance, time index): the nearest time of each edge
    for i in range(1, len(out) - 1):
        k = bisect.bisect_left(inner, out[i])
        e = min((j for j in (k - 1, k) if 0 <= j < len(inner)), key=lambda j: abs(inner[j] - out[i]))
        dist = abs(inner[e] - out[i])
        if 0 < dist <= min(SNAP_ULPS * eps * abs(inner[e]), spacing / 4) and (e not in best or dist < best[e][0]):
            best[e] = (dist, i)
    for e, (_, i) in best.items():
        if inner[e] not in out:
            out[i] = inner[e]
    return out


def _segments(field, times):
    """Consecutive pieces [a, b] between requested times and layer boundaries; k = output index.

    ``times`` are already snapped onto the boundaries they round to (:func:`snap_to_edges`).
    """
    cuts = sorted(set(times) | {e for e in field.breakpoints() if times[0] < e < times[-1]})
    idx = {s: k for k, s in enumerate(times)}
    return [(a, b, idx.get(b)) for a, b in zip(cuts[:-1], cuts[1:])]


#: the default budget of a fixed-step integration: a step size or count that needs more steps is refused before the
#: first one (options={"max_steps": ...} raises it)
FIXED_MAX_STEPS = 1_000_000


def integrate_fixed(field, Y, times, method, step, steps, max_steps=FIXED_MAX_STEPS):
    """Fixed-step integration; returns (points at each requested time, number of steps).

    The requested times are snapped onto the layer boundaries they round to (:func:`snap_to_edges`; the times have
    the particles' dtype), so that no sliver piece costs a step. The steps are counted before the first one: more
    than ``max_steps`` is a ValueError (a step of 1e-12 would otherwise run for days).
    """
    stepper = FIXED[method]
    max_steps = check_positive_int(max_steps, "max_steps")
    times = snap_to_edges(times, field.breakpoints(), Y.dtype)
    if step is not None and steps is not None:
        raise ValueError("step, steps: give at most one of them")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, numbers.Real):
            raise TypeError(f"step: expected a positive real number (a Python float), got {type(step).__name__} "
                            f"{step!r}")
        if not math.isfinite(step) or step <= 0:
            raise ValueError(f"step: expected a positive step size, got {step!r}")
        h_max = [float(step)] * (len(times) - 1)
    elif steps is None:
        h_max = [(times[-1] - times[0]) / DEFAULT_STEPS] * (len(times) - 1)
    else:
        k = check_positive_int(steps, "steps")
        h_max = [(b - a) / k for a, b in zip(times[:-1], times[1:])]
    plan = []
    for a, b, k_out in _segments(field, times):
        # a piece between layer boundaries inherits the step of the requested interval holding it: the
        # interval [times[i], times[i + 1]] with times[i] <= a (a bisection, not a scan: many output times)
        i = min(bisect.bisect_right(times, a) - 1, len(h_max) - 1)
        m = (b - a) / h_max[i] - 1e-9
        plan.append((a, b, k_out, max(1, math.ceil(m)) if math.isfinite(m) else math.inf))
    total = sum(m for *_, m in plan)
    if total > max_steps:
        what = "step" if step is not None else "steps" if steps is not None else "the default 100 steps"
        raise ValueError(f"{what}: {total:.4g} steps over [{times[0]:g}, {times[-1]:g}] exceed max_steps = "
                         f"{max_steps} (the fixed-step budget); take a larger step, or raise options['max_steps']")
    out, nsteps = [field.retract(Y)], 0
    Y = out[0]
    beat = Heartbeat()
    for a, b, k_out, m in plan:
        layer = field.layer_of(a, b)
        h = (b - a) / m
        for s in range(m):
            Y = field.retract(stepper(field, a + s * h, Y, h, layer))
            if beat.due():   # a long run says where it is (two RK4 steps of 1e6 tokens took 49 s on a GPU)
                log.info("simulate (%s): t = %.6g of [%g, %g], step %d of %d, %.0f s", method, a + (s + 1) * h,
                         times[0], times[-1], nsteps + s + 1, total, beat.elapsed)
        nsteps += m
        check_finite(Y, b)
        if k_out is not None:
            out.append(Y)
    return out, nsteps


@functools.cache
def _solver_options(method) -> frozenset:
    """The options torchdiffeq's solver ``method`` takes (the keywords of its class's constructors), or an empty
    set where torchdiffeq does not say (then nothing is checked here)."""
    try:
        from torchdiffeq._impl.odeint import SOLVERS

        names = set()
        for klass in SOLVERS[method].__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None:
                names |= {q.name for q in inspect.signature(init).parameters.values()
                          if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)}
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return frozenset()
    return frozenset(names - {"self", "func", "y0", "rtol", "atol"})


#: The smallest rtol the adaptive methods take, float64's unit roundoff 2^-53. An rtol below it asks each step for
#: more than any dtype holds, and torchdiffeq then shrinks its steps until the budget runs out.
RTOL_MIN = 2.0 ** -53


def _below_eps(rtol, dtype) -> str:
    """The part of a non-convergence message that names an rtol below the tokens' machine epsilon."""
    eps = torch.finfo(dtype).eps
    return "" if rtol >= eps else (f" (rtol = {rtol:g} is below the machine epsilon of the {dtype} tokens, {eps:.3g}: "
                                   "loosen it, or simulate in float64)")


class _StepBudget(Exception):
    """Raised when a layer's attempted steps exceed its budget (:func:`integrate_adaptive`)."""


def integrate_adaptive(field, Y, t, method, rtol, atol, max_steps, options):
    """torchdiffeq.odeint layer by layer; returns (points at each requested time, None).

    ``max_steps`` bounds the steps of each layer, accepted and rejected, whatever the number of output times in
    it (torchdiffeq's own ``max_num_steps`` counts them per output interval): the attempts are counted by the
    ``callback_step`` torchdiffeq calls before each, and a layer that needs more than ``max_steps`` stops with a
    ConvergenceError (a RuntimeError). Solvers that make no such call (``scipy_solver``) keep torchdiffeq's count."""
    from torchdiffeq import odeint

    for name, val in (("rtol", rtol), ("atol", atol)):
        if isinstance(val, bool) or not isinstance(val, numbers.Real) or not (val > 0 and math.isfinite(val)):
            raise ValueError(f"{name}: expected a positive finite tolerance, got {val!r}")
    if rtol < RTOL_MIN:
        # below every dtype's resolution: the solver shrinks its steps until max_steps (minutes), or its first
        # step size overflows (rtol = 1e-300: a NaN time)
        raise ValueError(f"rtol: {rtol:g} is below float64's unit roundoff 2^-53 = {RTOL_MIN:.3g}, the resolution of "
                         "the tokens themselves in any dtype: no step can be that accurate (float64 tokens resolve "
                         "about 1e-15)")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options: expected a dict of torchdiffeq options, got {type(options).__name__}")
    unknown = sorted(set(options or {}) - _solver_options(method))
    if unknown and _solver_options(method):
        raise ValueError(f"options: {unknown} are not options of torchdiffeq's {method!r} solver (it takes "
                         f"{sorted(_solver_options(method) - {'max_num_steps'})}; its step budget is max_steps=)")
    for name in ("first_step", "step_size", "max_step", "min_step"):
        # torchdiffeq turns a step <= 0 into an 'underflow in dt' (max_step = 0: "did not converge"), and takes a
        # negative min_step as none
        val = (options or {}).get(name)
        if val is None:
            continue
        if isinstance(val, bool) or not isinstance(val, numbers.Real) or math.isnan(val):
            raise ValueError(f"options: {name} = {val!r}; expected a step size (a real number)")
        if name == "min_step" and not (val >= 0 and math.isfinite(val)):
            raise ValueError(f"options: min_step = {val!r}; expected a finite step >= 0 (0: no lower limit)")
        if name == "max_step" and not val > 0:
            raise ValueError(f"options: max_step = {val!r}; expected a step > 0 (inf: no upper limit)")
        if name in ("first_step", "step_size") and not (math.isfinite(val) and val > 0):
            raise ValueError(f"options: {name} = {val!r}; expected a positive finite step")
    lo, hi = (options or {}).get("min_step", 0.0), (options or {}).get("max_step", math.inf)
    if lo > hi:
        raise ValueError(f"options: min_step = {lo!r} exceeds max_step = {hi!r}")
    max_steps = check_positive_int(max_steps, "max_steps")
    opts = {"max_num_steps": max_steps}
    opts.update(options or {})

    # the requested times on a layer boundary (to a few ulps of their dtype) are put on it: a float64 boundary
    # next to a float32 time would make a sliver that collapses in the solver's float32 grid
    times = snap_to_edges([float(s) for s in t], field.breakpoints(), t.dtype)
    edges = [times[0]] + [e for e in field.breakpoints() if times[0] < e < times[-1]] + [times[-1]]
    out = [field.retract(Y)]
    Y = out[0]
    beat = Heartbeat()
    for a, b in zip(edges[:-1], edges[1:]):
        layer = field.layer_of(a, b)
        inner = [s for s in times if a < s <= b]
        grid = [a] + inner + ([b] if not inner or inner[-1] < b else [])
        grid_t = torch.tensor(grid, dtype=Y.dtype, device=Y.device)
        if not bool((grid_t[1:] > grid_t[:-1]).all()):
            res = torch.finfo(Y.dtype).eps * max(abs(a), abs(b))
            raise ValueError(f"simulate: the times {grid} of the layer [{a:.10g}, {b:.10g}] are not distinct in "
                             f"{Y.dtype} (its resolution there is about {res:.3g}); simulate in float64, or with "
                             "fewer layers or output times")
        def func(tt, yy, _l=layer):
            return field(tt, yy, _l)

        attempts = [0]

        def count_step(t0, y0, dt, _attempts=attempts, _a=a, _b=b):
            _attempts[0] += 1
            if _attempts[0] > max_steps:
                raise _StepBudget
            if beat.due():   # a stiff field can take minutes of small steps: say where the solver is
                log.info("simulate (%s): t = %.6g of the layer [%g, %g] (whole run [%g, %g]), step %d of at most "
                         "%d in this layer, step size %.3g, %.0f s", method, float(t0), _a, _b, times[0], times[-1],
                         _attempts[0], max_steps, float(dt), beat.elapsed)

        func.callback_step = count_step
        try:
            sol = odeint(func, Y, grid_t, method=method, rtol=float(rtol), atol=float(atol), options=opts)
        except _StepBudget:
            raise ConvergenceError(f"simulate: the adaptive solver {method!r} did not converge on [{a:g}, {b:g}] (more "
                               f"than max_steps = {max_steps} steps in this layer); raise max_steps or loosen "
                               f"rtol/atol{_below_eps(rtol, Y.dtype)}") from None
        except AssertionError as exc:
            # torchdiffeq asserts both its failures to converge and its checks of the input: only the former
            # are relabelled, any other assertion propagates as it is
            if not str(exc).startswith(NONCONVERGENCE):
                raise
            raise ConvergenceError(f"simulate: the adaptive solver {method!r} did not converge on [{a:g}, {b:g}] "
                               f"({exc}); raise max_steps or loosen rtol/atol{_below_eps(rtol, Y.dtype)}") from exc
        check_finite(sol, b)
        # the requested times are the grid's entries 1..len(inner) (a membership test of a list per entry took
        # 7.5 s for 4e4 output times)
        out.extend(field.retract(sol[k]) for k in range(1, len(inner) + 1))
        Y = field.retract(sol[-1])
    return out, None
