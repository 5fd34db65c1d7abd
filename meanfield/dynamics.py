"""Token dynamics: Transformers as PDEs on measures (docs/math.md section 6).

A stack of residual attention layers ``x <- x + (1/L) Gamma_mu(x)`` is the explicit Euler scheme of

    x_i'(t) = Gamma_{mu(t)}(x_i(t)),    mu(t) = sum_i a_i delta_{x_i(t)},

the particle form of the continuity equation d/dt mu + div(mu Gamma_mu) = 0. A weighted particle is
a group of tokens: the weights a_i of ``mu0`` never change, and the velocity field reads them as
additive log-weights in the softmax (docs/math.md section 2). Masked measures keep their positions.

:func:`simulate` is the one entry point (the torchdiffeq style: ``simulate(op, mu0, times)``, the rest
optional). ``op`` is anything :func:`meanfield.as_operator` accepts that has a velocity field (every
meanfield operator, a Hugging Face attention layer, ``torch.nn.MultiheadAttention``), a list of them
(one per layer) or a callable ``t -> operator``. The integrators live in
:mod:`meanfield.integrators` (Euler, RK4, torchdiffeq's adaptive methods), the geometry in
:mod:`meanfield.geometry` (R^d, or tokens kept on their spheres). It returns a :class:`Trajectory`
holding only the requested times. Variants:

* ``rescale=True``: the rescaled tokens y = exp(-tV) x of Geshkovski, Letrouit, Polyanskiy and
  Rigollet (2023), y_i' = exp(-tV) (Gamma_{mu(t)}(e^{tV} y_i) - V e^{tV} y_i), which for
  self-attention is y_i' = sum_j P_ij(t) V (y_j - y_i) with P_ij proportional to
  a_j exp(<A e^{tV} y_i, e^{tV} y_j>);
* ``geometry=Sphere()`` (or ``"sphere"``): the field projected on the tangent spaces, so that every
  ``|x_i|`` is conserved; with ``op=IsotropicAttention(beta, "SA" / "USA")`` the sphere models of
  Geshkovski et al.;
* time-dependent parameters: a list of operators, one per layer, acting on equal sub-intervals of
  [times[0], times[-1]], or a callable ``t -> operator``;
* masked (causal) operators on [0, 1] x R^d, and multi-head operators.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import time
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from particles import Measure
from particles.threads import ThreadPolicy
from particles.validation import as_tensor, check_allocation, check_ndim, check_positive_int, output_checks_deferred

from .adapters import as_operator
from .geometry import GEOMETRIES, Euclidean, Sphere, resolve_geometry
from .integrators import ADAPTIVE, FIXED, FIXED_MAX_STEPS, check_finite, integrate_adaptive, integrate_fixed
from .isotropic import NORMALIZATIONS, IsotropicAttention
from .operator import AttentionOperator

log = logging.getLogger(__name__)

__all__ = ["simulate", "Trajectory", "FIXED_METHODS", "residual_layers"]

FIXED_METHODS = tuple(FIXED)


class Trajectory:
    """The measures mu(t_k) = sum_i a_i delta_{x_i(t_k)} at the requested times.

    Attributes: ``times`` (T,), ``points`` (T, N, d), ``weights`` / ``log_weights`` (N,) (constant in
    time), ``positions`` (N,) or None (constant in time), ``method``, ``nfev`` (velocity-field
    evaluations), ``steps`` (solver steps of a fixed-step method; None for an adaptive one, whose accepted
    and rejected steps torchdiffeq does not report: ``nfev`` counts its work), ``rescale_V`` (the V of
    y = exp(-tV) x, or None), ``geometry`` ("euclidean" or "sphere"). Indexing and iteration give
    :class:`Measure` objects.
    """

    def __init__(self, times, points, template: Measure, *, method: str, nfev: int, steps: int | None,
                 rescale_V=None, geometry: str = "euclidean", sphere=None):
        self.times = times
        self.points = points
        self._template = template
        self.method = method
        self.nfev = nfev
        self.steps = steps
        self.rescale_V = rescale_V
        if sphere is not None:   # the previous release's record: False, True, "SA" or "USA"
            geometry = "sphere" if sphere else "euclidean"
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry: expected one of {sorted(GEOMETRIES)}, got {geometry!r}")
        self.geometry = geometry

    @property
    def sphere(self) -> bool:
        """Deprecated, the same as ``geometry == "sphere"``."""
        warnings.warn("Trajectory.sphere: use Trajectory.geometry ('euclidean' or 'sphere')", DeprecationWarning,
                      stacklevel=2)
        return self.geometry == "sphere"

    weights = property(lambda self: self._template.weights, doc="Masses a_i, shape (N,).")
    log_weights = property(lambda self: self._template.log_weights, doc="log a_i, shape (N,).")
    positions = property(lambda self: self._template.positions, doc="Positions s_i (N,) or None.")

    def __len__(self) -> int:
        return self.points.shape[0]

    def __getitem__(self, k: int) -> Measure:
        # the frame's points with the template's weights and positions, as they are (no copy: with_points copies
        # points given to it, the caller's to change)
        t = self._template
        return Measure._trusted(self.points[k], t.weights, t.log_weights, t.positions)

    def __iter__(self) -> Iterator[Measure]:
        return (self[k] for k in range(len(self)))

    @property
    def measures(self) -> list[Measure]:
        return list(self)

    @property
    def final(self) -> Measure:
        """The measure at the last requested time."""
        return self[len(self) - 1]

    def unscaled(self) -> Trajectory:
        """For a rescaled trajectory, the original tokens x(t) = exp(tV) y(t)."""
        if self.rescale_V is None:
            return self
        E = torch.linalg.matrix_exp(self.times[:, None, None] * self.rescale_V)
        X = self.points @ E.transpose(-1, -2)
        return Trajectory(self.times, X, self._template, method=self.method, nfev=self.nfev,
                          steps=self.steps, rescale_V=None, geometry=self.geometry)

    def __repr__(self) -> str:
        extra = (", rescaled" if self.rescale_V is not None else "") + (f", geometry={self.geometry!r}"
                                                                         if self.geometry != "euclidean" else "")
        return (f"Trajectory(T={len(self)}, n={self.points.shape[1]}, dim={self.points.shape[2]}, "
                f"method={self.method!r}{extra}, nfev={self.nfev})")


# ---------------------------------------------------------------------------- the velocity field
def _all_masked(op) -> bool:
    """Whether tokens given as a tensor are a causal sequence for ``op``: an operator, or a list of them, all masked
    (a callable t -> operator is not asked; anything as_operator refuses is left for the field to name)."""
    ops = list(op) if isinstance(op, (list, tuple)) else [op]
    if not ops or not all(isinstance(o, (AttentionOperator, torch.nn.Module)) for o in ops):
        return False
    try:
        return all(as_operator(o).masked for o in ops)
    except (TypeError, ValueError):
        return False


def _velocity_operator(o, where: str) -> AttentionOperator:
    op = as_operator(o)
    if op.points_only:
        raise TypeError(f"op: {where} is points-only ({op!r}): a bare callable on sequences has no velocity field "
                        "at arbitrary points; give a meanfield operator, a Hugging Face layer or "
                        "torch.nn.MultiheadAttention")
    return op


class _Field:
    """x -> velocity of every particle at time t, with the variants folded in."""

    def __init__(self, op, template: Measure, t0: float, t1: float, rescale_V, geometry, *,
                 defer_output_checks: bool = False):
        self.template = template
        self.rescale_V = rescale_V
        self.geometry = geometry
        self.policy = None   # the call's ThreadPolicy: the first evaluation decides the threads
        self.nfev = 0
        # fixed-step methods only: an adaptive solver's error estimate turns a NaN velocity into ever smaller
        # steps (torchdiffeq: "underflow in dt") instead of a next stage whose particles are checked
        self.defer_output_checks = defer_output_checks
        self.layers = None
        self.factory = None
        self.constant = None
        if isinstance(op, (list, tuple)):
            if not op:
                raise ValueError("op: an empty list of layers")
            self.layers = [_velocity_operator(o, f"layer {i}") for i, o in enumerate(op)]
            self.edges = [t0 + (t1 - t0) * l / len(op) for l in range(len(op) + 1)]
        elif isinstance(op, (AttentionOperator, torch.nn.Module)):
            self.constant = _velocity_operator(op, "the operator")
        elif callable(op):
            self.factory = op
            # the callable must map a time to an operator: a bare callable on sequences is not one
            try:
                first = op(t0)
            except Exception as exc:
                raise TypeError(f"op: a callable must map a time t to an operator (op({t0:g}) raised "
                                f"{type(exc).__name__}: {exc}); a bare callable on sequences is points-only "
                                "and has no velocity field") from exc
            if not isinstance(first, (AttentionOperator, torch.nn.Module)):
                raise TypeError(f"op: a callable must map a time t to an operator; op({t0:g}) returned "
                                f"{type(first).__name__} (a bare callable on sequences is points-only and has "
                                "no velocity field)")
        else:
            raise TypeError("op: expected an attention operator (anything meanfield.as_operator accepts), a list "
                            f"of them (one per layer) or a callable t -> operator, got {type(op).__name__}")

    def breakpoints(self) -> list[float]:
        return self.edges[1:-1] if self.layers is not None else []

    def operator(self, t: float, layer: int | None):
        if self.constant is not None:
            return self.constant
        if self.layers is not None:
            return self.layers[layer]
        o = self.factory(t)
        if not isinstance(o, (AttentionOperator, torch.nn.Module)):
            raise TypeError(f"op: op({t:g}) returned {type(o).__name__}, not an attention operator")
        return _velocity_operator(o, f"op({t:g})")

    def layer_of(self, a: float, b: float) -> int | None:
        if self.layers is None:
            return None
        mid = 0.5 * (a + b)
        return min(max(sum(e <= mid for e in self.edges) - 1, 0), len(self.layers) - 1)

    def __call__(self, t, Y: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        if self.policy is None:
            return self._velocity(t, Y, layer)
        if self.nfev == 0:
            start = time.perf_counter()
            v = self._velocity(t, Y, layer)
            self.policy.observe(time.perf_counter() - start)
            return v
        self.policy.tick()
        return self._velocity(t, Y, layer)

    def _velocity(self, t, Y: torch.Tensor, layer: int | None) -> torch.Tensor:
        self.nfev += 1
        t = float(t)
        X = Y
        if self.rescale_V is not None:
            E = torch.linalg.matrix_exp(t * self.rescale_V)
            X = Y @ E.T
        # a stage of a step can leave the range before the step ends: the documented error, with the time
        check_finite(X, t)
        # X is the integrator's state, of the template's dtype, device and shape, and checked just above:
        # with_points would check it again (a second host sync per evaluation on an accelerator)
        tpl = self.template
        mu = Measure._trusted(X, tpl.weights, tpl.log_weights, tpl.positions)
        op = self.operator(t, layer)
        # positions are query positions for causal operators; unmasked operators ignore the coordinate
        try:
            # fixed steps: the outputs' own finiteness checks are left to the next stage's check_finite (one
            # host sync per evaluation instead of three on an accelerator): a non-finite velocity makes it fail
            with output_checks_deferred() if self.defer_output_checks else contextlib.nullcontext():
                if self.template.positions is not None and op.masked:
                    v = op.velocity(mu, X, positions=self.template.positions)
                else:
                    v = op.velocity(mu, X)
        except FloatingPointError as exc:
            raise FloatingPointError(f"simulate: the velocity field left the floating-point range at t = {t:g} "
                                     f"(reduce the step or the time span): {exc}") from exc
        if v.shape != X.shape:
            raise ValueError(f"op: velocity must map the ({X.shape[0]}, {X.shape[1]}) particles to "
                             f"({X.shape[0]}, {X.shape[1]}) velocities (d_out = d), got {tuple(v.shape)}")
        v = self.geometry.project(X, v)
        if self.rescale_V is not None:
            v = (v - X @ self.rescale_V.T) @ torch.linalg.matrix_exp(-t * self.rescale_V).T
        return v

    def retract(self, Y: torch.Tensor) -> torch.Tensor:
        return self.geometry.retract(Y)


#: the options of simulate for each kind of method (everything else in ``options`` goes to torchdiffeq)
FIXED_OPTIONS = ("step", "steps", "max_steps")
ADAPTIVE_OPTIONS = ("max_steps",)
#: keywords of the previous release, moved into ``options`` or ``geometry`` (they warn for one release)
_MOVED = ("step", "steps", "max_steps", "sphere", "beta")


def simulate(op, mu0, times, method: str = "rk4", *, rtol: float | None = None, atol: float | None = None,
             geometry=None, rescale=False, options: dict | None = None, **deprecated) -> Trajectory:
    """Integrate the token dynamics x_i' = Gamma_{mu(t)}(x_i) (docs/math.md section 6) from ``mu0``.

    torchdiffeq's ``odeint(func, y0, t, rtol, atol, method, options)``, for measures.

    Parameters
    ----------
    op : operator, list of operators, or callable ``t -> operator``
        Anything :func:`meanfield.as_operator` accepts with a velocity field (SelfAttention,
        MultiHeadAttention, L2SelfAttention, IsotropicAttention, a Hugging Face attention layer,
        torch.nn.MultiheadAttention; masked or not). A list gives one operator per layer on equal
        sub-intervals of [times[0], times[-1]] (layer boundaries are step boundaries, so piecewise
        constant parameters keep the order of the scheme); a callable is evaluated at every stage
        time (use it for smooth t-dependence).
    mu0 : :class:`~particles.Measure` or tensor ``(N, d)``
        Initial particles at ``times[0]``. A tensor is the empirical measure, and for masked operators (every
        layer masked) the causal sequence ``Measure.sequence(X)`` (positions i/n), as :func:`meanfield.local_lipschitz`
        reads it. Weights, and the positions of a masked measure, are kept constant.
    times : increasing sequence ``(T,)`` or a number ``t1``
        Requested output times; ``times[0]`` is the initial time (a number means [0, t1]).
    method : str
        "euler", "rk4", or a torchdiffeq adaptive method ("dopri5", "bosh3", "dopri8", ...).
        Euler with 1 step per layer on [0, 1] is exactly L residual layers x <- x + (1/L) Gamma(x).
    rtol, atol : float or None
        Tolerances of the adaptive methods (default 1e-7 and 1e-9); an error with a fixed-step method. rtol
        below 2^-53 (:data:`meanfield.integrators.RTOL_MIN`) is refused. They bound the local error per step, not
        the global error. Measured against scipy's DOP853 at rtol 1e-13 on 6 tokens over [0, 1] (atol = rtol / 100):
        dopri5 and adaptive_heun stayed at 0.07-0.14 rtol for rtol from 1e-7 to 1e-10; bosh3 at 0.4 rtol at 1e-7
        but 99-425 rtol below (its error at rtol 1e-8 was 25 times its error at 1e-7), torchdiffeq's dopri8 at
        13-200 rtol (each the same as torchdiffeq called directly). So a tighter rtol does not show the error of
        bosh3 or dopri8: check a result against dopri5 at a 100 times smaller rtol, or rk4 with half the step.
    geometry : ``Euclidean()``, ``Sphere()``, ``"euclidean"`` or ``"sphere"`` (default: Euclidean)
        Where the tokens live (:mod:`meanfield.geometry`): the field is projected on the tangent
        spaces and the points retracted after each step. The sphere models of Geshkovski et al. are
        ``simulate(IsotropicAttention(beta, "SA"), mu0, times, geometry="sphere")``.
    rescale : bool or matrix ``(d, d)``
        True: return y = exp(-tV) x with V the value matrix of a single-head operator (read from
        ``op.parameters()``), or the matrix given. See the module docstring.
    options : dict or None
        Fixed-step methods: ``step`` (largest step size) or ``steps`` (steps between consecutive
        requested times); by default 100 steps over the whole span, with no error control: on the sphere
        (Geshkovski et al.'s models, beta 1-4) rk4's default was 1e-8 to 2e-6 (relative) off DOP853-level
        references at T = 5 and 20, but where the tokens' norms and so the scores grow (32 tokens going from
        radius 4.5 to 73 over [0, 5] under a random head) it was 6e-4 off and still 3e-4 with 400 steps, so
        compare with twice the steps or an adaptive method; ``max_steps`` (default 1000000): more
        steps than that are refused before the first one. Adaptive methods: ``max_steps``
        (per layer, default 100000; beyond it a ConvergenceError, a RuntimeError, says it did not converge) and any
        option of torchdiffeq's solver. An option of the other kind of method is an error.

    Returns
    -------
    Trajectory
        The measures at the requested times only.

    Raises
    ------
    FloatingPointError
        When the particles leave the floating-point range (with the time).

    Notes
    -----
    A run longer than a few seconds says where it is (the time reached, the step, the seconds spent) in INFO lines
    of the logger ``meanfield.dynamics``, every 5 s: ``logging.basicConfig(level=logging.INFO)`` shows them. A step
    that alone takes longer (an attention pass over 1e5 tokens on CPU) is covered by the kernel's own lines
    (logger ``meanfield.kernels``).

    The keywords of the previous release (``step=``, ``steps=``, ``max_steps=``, ``sphere=``,
    ``beta=``) still work, with a DeprecationWarning: the first three go into ``options``,
    ``sphere=True`` is ``geometry="sphere"``, and ``sphere="SA"`` / ``"USA"`` with ``beta`` is
    ``op=IsotropicAttention(beta, "SA" / "USA")`` on the sphere.
    """
    op, geometry, options = _legacy_spelling(op, mu0, geometry, options, deprecated)
    if not isinstance(mu0, Measure):
        mu0 = Measure.sequence(mu0) if _all_masked(op) else Measure(mu0)
    dtype, device = mu0.dtype, mu0.device
    t = _check_times(times, dtype)
    # the particles at every requested time are kept (one tensor each, about 1 KiB of bookkeeping), then stacked
    check_allocation(t.shape[0] * (2 * mu0.points.numel() * mu0.points.element_size() + _BYTES_PER_STORED_TIME),
                     f"simulate: the particles ({mu0.n} x {mu0.dim}) at {t.shape[0]} requested times",
                     "request fewer output times (times=[t0, ..., t1]; the solver's steps do not need them)")
    if not isinstance(method, str):
        raise TypeError(f"method: expected a string, got {type(method).__name__}")
    if method not in FIXED and method not in ADAPTIVE:
        raise ValueError(f"method: unknown solver {method!r}; fixed-step: {tuple(FIXED)}, adaptive "
                         f"(torchdiffeq): {ADAPTIVE}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options: expected a dict, got {type(options).__name__}")
    options = dict(options or {})
    geo = resolve_geometry(geometry)

    V = _resolve_rescale(rescale, op, mu0.dim, dtype, device)
    if V is not None and not isinstance(geo, Euclidean):
        raise ValueError("rescale, geometry: the rescaled tokens exp(-tV) x live in R^d; they do not combine "
                         "with the sphere")
    t0, t1 = float(t[0]), float(t[-1])
    field = _Field(op, mu0, t0, t1, V, geo.prepare(mu0.points), defer_output_checks=method in FIXED)
    Y = mu0.points
    if V is not None:
        Y = Y @ torch.linalg.matrix_exp(-t0 * V).T

    with ThreadPolicy() as policy:
        field.policy = policy
        if method in FIXED:
            for name, val in (("rtol", rtol), ("atol", atol)):
                if val is not None:
                    raise ValueError(f"{name}: only for the adaptive methods {ADAPTIVE}, not {method!r}")
            wrong = sorted(set(options) - set(FIXED_OPTIONS))
            if wrong:
                raise ValueError(f"options: {wrong} do not apply to the fixed-step method {method!r} "
                                 f"(its options: {FIXED_OPTIONS})")
            out, nsteps = integrate_fixed(field, Y, [float(s) for s in t], method, options.get("step"),
                                          options.get("steps"), options.get("max_steps", FIXED_MAX_STEPS))
        else:
            wrong = sorted(set(options) & (set(FIXED_OPTIONS) - set(ADAPTIVE_OPTIONS)))
            if wrong:
                raise ValueError(f"options: {wrong} only for the fixed-step methods {tuple(FIXED)}, not {method!r}")
            max_steps = options.pop("max_steps", 100_000)
            out, nsteps = integrate_adaptive(field, Y, t, method, 1e-7 if rtol is None else rtol,
                                             1e-9 if atol is None else atol, max_steps, options or None)
    points = torch.stack(out)
    log.debug("simulate: %s, %d tokens in d = %d (%s), %s from t = %g to %g, %s steps, %d evaluations, %d thread(s)",
              type(op).__name__, points.shape[1], points.shape[2], geo.name, method, float(t[0]), float(t[-1]),
              nsteps, field.nfev, policy.threads)
    return Trajectory(t, points, mu0, method=method, nfev=field.nfev, steps=nsteps, rescale_V=V,
                      geometry=geo.name)


def _legacy_spelling(op, mu0, geometry, options, given: dict):
    """(op, geometry, options) from the keywords of the previous release, each with a DeprecationWarning."""
    unknown = sorted(set(given) - set(_MOVED))
    if unknown:
        raise TypeError(f"simulate() got unexpected keyword argument(s) {unknown}")
    if not given:
        return op, geometry, options
    warnings.warn(f"simulate({', '.join(f'{k}=...' for k in given)}): step, steps and max_steps go into options=, "
                  "sphere=True is geometry='sphere', and sphere='SA'/'USA' with beta is "
                  "op=IsotropicAttention(beta, 'SA'/'USA') with geometry='sphere'; the keywords will be removed in the "
                  "next release", DeprecationWarning, stacklevel=3)
    options = dict(options or {})
    for k in ("step", "steps", "max_steps"):
        if given.get(k) is not None:
            if k in options:
                raise ValueError(f"{k}: given twice (as a keyword and in options)")
            options[k] = given[k]
    model = _resolve_sphere(given.get("sphere", False))
    beta = given.get("beta")
    if model:
        geo = resolve_geometry(geometry)
        if geometry is not None and not isinstance(geo, Sphere):
            raise ValueError(f"geometry: sphere={model!r} puts the tokens on the sphere; {geo!r} contradicts it")
        geometry = "sphere"
    if model in NORMALIZATIONS:
        if op is not None:
            raise ValueError(f"op: with sphere={model!r} the operator is IsotropicAttention(beta); pass op=None "
                             "(or sphere=True to project another operator's field)")
        if beta is None:
            raise ValueError(f"beta: sphere={model!r} needs an inverse temperature beta")
        masked = mu0.masked if isinstance(mu0, Measure) else False
        op = IsotropicAttention(beta, model, masked=masked)
    elif beta is not None:
        raise ValueError("beta: only used with sphere='SA' or 'USA' (the operator carries its own parameters)")
    if op is None:
        raise ValueError("op: give an operator (or op=None with sphere='SA'/'USA' and beta)")
    return op, geometry, options


#: memory of one stored time besides its data: a torch tensor object and its allocation (measured: ~0.8 KiB)
_BYTES_PER_STORED_TIME = 1024


def _check_times(times, dtype) -> torch.Tensor:
    if isinstance(times, numbers.Real) and not isinstance(times, bool):
        times = [0.0, float(times)]
    given = as_tensor(times, "times", dtype=torch.float64).detach().cpu()   # exact for every float32 or int time
    check_ndim(given, "times", 1, "a 1-D sequence of output times")
    if given.shape[0] < 2:
        raise ValueError("times: need an initial time and at least one output time")
    if not bool((given[1:] > given[:-1]).all()):
        raise ValueError("times: must be strictly increasing (times[0] is the time of mu0)")
    t = given.to(dtype)
    if not bool((t[1:] > t[:-1]).all()):
        k = int(torch.nonzero(t[1:] <= t[:-1])[0, 0])
        a, b = float(given[k]), float(given[k + 1])
        raise ValueError(f"times: {a:.12g} and {b:.12g} are not distinct in {dtype} (its resolution there is about "
                         f"{torch.finfo(dtype).eps * max(abs(a), abs(b)):.3g}), the measure's dtype; simulate in "
                         "float64, or with fewer output times")
    return t


def _resolve_sphere(sphere):
    if sphere is False or sphere is None:
        return False
    if sphere is True:
        return True
    if isinstance(sphere, str) and sphere.upper() in NORMALIZATIONS:
        return sphere.upper()
    raise ValueError(f"sphere: expected False, True, 'SA' or 'USA', got {sphere!r}")


def _resolve_rescale(rescale, op, dim, dtype, device):
    if rescale is False or rescale is None:
        return None
    if isinstance(rescale, (bool, numbers.Number, np.bool_, np.number)) and rescale is not True:
        # 1, 0, numpy booleans: neither True/False nor a matrix (a 0-d "matrix" would fail on its shape)
        raise TypeError(f"rescale: expected True, False or a ({dim}, {dim}) matrix V, got {rescale!r} "
                        f"({type(rescale).__name__})")
    if rescale is True:
        # the value map of a single head, read from the operator's parameters (meanfield.parameters)
        p = op.parameters(dim) if isinstance(op, AttentionOperator) else None
        if p is None or len(p.heads) != 1 or p.W_O is not None:
            raise ValueError("rescale: rescale=True reads the value matrix V of a single-head operator from "
                             f"op.parameters(), and {op!r} has "
                             + ("no parameters" if p is None else f"{len(p.heads)} head(s) and an output matrix")
                             + "; pass the matrix, rescale=V")
        V = p.heads[0].value_map
        name = "op.parameters().heads[0].V"
    else:
        V, name = rescale, "rescale"
    V = as_tensor(V, name, dtype=dtype, device=device).detach()
    if V.shape != (dim, dim):
        raise ValueError(f"{name}: the rescaling exp(-tV) needs a square ({dim}, {dim}) matrix, "
                         f"got {tuple(V.shape)}")
    return V


def residual_layers(op, X: torch.Tensor, L: int, T: float = 1.0) -> torch.Tensor:
    """L residual layers x <- x + (T/L) Gamma(x) on a sequence X (n, d): Euler on [0, T]."""
    L = check_positive_int(L, "L")
    traj = simulate(op, X if isinstance(X, Measure) else Measure(X), [0.0, float(T)], method="euler",
                    options={"steps": L})
    return traj.points[-1]

