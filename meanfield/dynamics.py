"""Token dynamics: Transformers as PDEs on measures (MATH.md section 6).

A stack of residual attention layers ``x <- x + (1/L) Gamma_mu(x)`` is the explicit Euler scheme of

    x_i'(t) = Gamma_{mu(t)}(x_i(t)),    mu(t) = sum_i a_i delta_{x_i(t)},

the particle form of the continuity equation d/dt mu + div(mu Gamma_mu) = 0. A weighted particle is
a group of tokens: the weights a_i of ``mu0`` never change, and the velocity field reads them as
additive log-weights in the softmax (MATH.md section 2). Masked measures keep their positions.

:func:`simulate` is the one entry point (the torchdiffeq style: ``simulate(op, mu0, times)``, the rest
optional). It integrates with fixed-step Euler or classical RK4, or with any adaptive solver of
``torchdiffeq.odeint`` ("dopri5", ...), and returns a :class:`Trajectory` holding only the
requested times. Variants:

* ``rescale=True``: the rescaled tokens y = exp(-tV) x of Geshkovski, Letrouit, Polyanskiy and
  Rigollet (2023), y_i' = exp(-tV) (Gamma_{mu(t)}(e^{tV} y_i) - V e^{tV} y_i), which for
  self-attention is y_i' = sum_j P_ij(t) V (y_j - y_i) with P_ij proportional to
  a_j exp(<A e^{tV} y_i, e^{tV} y_j>);
* ``sphere=True``: the field projected on the tangent space, x_i' = Proj_{x_i}^perp Gamma(x_i), so
  that every |x_i| is conserved; ``sphere="SA"`` / ``"USA"`` with ``beta`` are the sphere models
  of Geshkovski et al. (:class:`SphereAttention`: A = beta I, V = I, softmax or 1/n normalization);
* time-dependent parameters: ``op`` may be a callable ``t -> operator`` or a list of operators, one
  per layer, acting on equal sub-intervals of [times[0], times[-1]];
* masked (causal) operators on [0, 1] x R^d and multi-head operators: anything with
  ``.velocity(mu, x, positions=None)``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence

import torch

from particles import Measure
from particles.validation import as_tensor, check_ndim, check_positive_int

from .kernels import attend

__all__ = ["simulate", "Trajectory", "SphereAttention", "FIXED_METHODS"]

FIXED_METHODS = ("euler", "rk4")
_SPHERE_MODELS = ("SA", "USA")
_DEFAULT_STEPS = 100  # fixed-step default: 100 steps over the whole time span


class SphereAttention:
    """The velocity fields of the sphere models of Geshkovski et al. (2023), before projection.

    ``normalization="SA"`` (self-attention): Gamma(x) = sum_j a_j e^{beta <x, x_j>} x_j / Z(x),
    Z(x) = sum_j a_j e^{beta <x, x_j>}, i.e. attention with A = beta I and V = I.
    ``normalization="USA"`` (unnormalized): Gamma(x) = sum_j a_j e^{beta <x, x_j>} x_j, the
    1/n normalization for uniform weights a_j = 1/n.
    :func:`simulate` with ``sphere=...`` projects it: x_i' = Proj_{x_i}^perp Gamma(x_i).
    Along both flows the interaction energy E_beta = (1/(2 beta)) sum_ij a_i a_j e^{beta <x_i, x_j>}
    is non-decreasing (for USA the field is a_i^{-1} times the gradient of E_beta in x_i).
    With positions (``masked=True``) only atoms with s_j <= s are seen (causal sphere model).
    """

    def __init__(self, beta: float, normalization: str = "SA", masked: bool = False):
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or beta < 0:
            raise ValueError(f"beta: expected a finite inverse temperature >= 0, got {beta!r}")
        if normalization not in _SPHERE_MODELS:
            raise ValueError(f"normalization: expected 'SA' or 'USA', got {normalization!r}")
        self.beta = float(beta)
        self.normalization = normalization
        self.masked = bool(masked)

    def __repr__(self) -> str:
        return f"SphereAttention(beta={self.beta}, normalization={self.normalization!r}, masked={self.masked})"

    def velocity(self, mu: Measure, x, positions=None) -> torch.Tensor:
        """Gamma_mu(x) for queries x (m, d); ``positions`` (m,) for the causal model."""
        pts = mu.points
        x = as_tensor(x, "x", dtype=pts.dtype, device=pts.device)
        if x.dim() != 2 or x.shape[1] != mu.dim:
            raise ValueError(f"x: expected (m, {mu.dim}) queries, got shape {tuple(x.shape)}")
        qp = kp = None
        if self.masked:
            if positions is None or mu.positions is None:
                raise ValueError("positions: the causal sphere model needs query positions and a measure "
                                 "with positions (Measure.sequence)")
            qp = as_tensor(positions, "positions", dtype=pts.dtype, device=pts.device)
            kp = mu.positions
        q = self.beta * x
        out = attend(q, pts, pts, mu.log_weights, qp, kp)
        if self.normalization == "USA":
            out = out * torch.exp(_row_logsumexp(q, pts, mu.log_weights, qp, kp))[:, None]
        return out

    def __call__(self, mu: Measure) -> Measure:
        """The pushforward (Gamma_mu)_# mu."""
        return mu.pushforward(lambda X: self.velocity(mu, X, mu.positions if self.masked else None))


def _row_logsumexp(q, k, log_weights, q_pos, k_pos, block: int = 2048) -> torch.Tensor:
    """log sum_j exp(<q_i, k_j> + log a_j) over visible keys, in row blocks (O(block * n) memory)."""
    rows = []
    for i0 in range(0, q.shape[0], block):
        s = q[i0:i0 + block] @ k.T + log_weights
        if q_pos is not None:
            s = s.masked_fill(k_pos[None, :] > q_pos[i0:i0 + block, None], float("-inf"))
        rows.append(torch.logsumexp(s, dim=1))
    return torch.cat(rows)


class Trajectory:
    """The measures mu(t_k) = sum_i a_i delta_{x_i(t_k)} at the requested times.

    Attributes: ``times`` (T,), ``points`` (T, N, d), ``weights`` / ``log_weights`` (N,) (constant in
    time), ``positions`` (N,) or None (constant in time), ``method``, ``nfev`` (velocity-field
    evaluations), ``steps`` (solver steps), ``rescale_V`` (the V of y = exp(-tV) x, or None),
    ``sphere`` (False, True, "SA" or "USA"). Indexing and iteration give :class:`Measure` objects.
    """

    def __init__(self, times, points, template: Measure, *, method: str, nfev: int, steps: int,
                 rescale_V=None, sphere=False):
        self.times = times
        self.points = points
        self._template = template
        self.method = method
        self.nfev = nfev
        self.steps = steps
        self.rescale_V = rescale_V
        self.sphere = sphere

    weights = property(lambda self: self._template.weights, doc="Masses a_i, shape (N,).")
    log_weights = property(lambda self: self._template.log_weights, doc="log a_i, shape (N,).")
    positions = property(lambda self: self._template.positions, doc="Positions s_i (N,) or None.")

    def __len__(self) -> int:
        return self.points.shape[0]

    def __getitem__(self, k: int) -> Measure:
        return self._template.with_points(self.points[k])

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
                          steps=self.steps, rescale_V=None, sphere=self.sphere)

    def __repr__(self) -> str:
        extra = (", rescaled" if self.rescale_V is not None else "") + (f", sphere={self.sphere!r}"
                                                                         if self.sphere else "")
        return (f"Trajectory(T={len(self)}, n={self.points.shape[1]}, dim={self.points.shape[2]}, "
                f"method={self.method!r}{extra}, nfev={self.nfev})")


# ---------------------------------------------------------------------------- the velocity field
class _Field:
    """x -> velocity of every particle at time t, with the variants folded in."""

    def __init__(self, op, template: Measure, t0: float, t1: float, rescale_V, sphere: bool):
        self.template = template
        self.rescale_V = rescale_V
        self.sphere = sphere
        self.nfev = 0
        self.layers = None
        self.factory = None
        if hasattr(op, "velocity"):
            self.constant = op
        elif isinstance(op, (list, tuple)):
            if not op:
                raise ValueError("op: an empty list of layers")
            for i, o in enumerate(op):
                if not hasattr(o, "velocity"):
                    raise TypeError(f"op: layer {i} has no .velocity(mu, x) method ({type(o).__name__})")
            self.constant, self.layers = None, list(op)
            self.edges = [t0 + (t1 - t0) * l / len(op) for l in range(len(op) + 1)]
        elif callable(op):
            self.constant, self.factory = None, op
        else:
            raise TypeError("op: expected an operator with .velocity(mu, x), a list of them (one per layer) "
                            f"or a callable t -> operator, got {type(op).__name__}")
        if sphere:
            norms = template.points.detach().norm(dim=1)
            if bool((norms == 0).any()):
                raise ValueError("mu0: sphere dynamics need non-zero points (the projection divides by |x|^2)")
            self.radii = template.points.norm(dim=1, keepdim=True)

    def breakpoints(self) -> list[float]:
        return self.edges[1:-1] if self.layers is not None else []

    def operator(self, t: float, layer: int | None):
        if self.constant is not None:
            return self.constant
        if self.layers is not None:
            return self.layers[layer]
        o = self.factory(t)
        if not hasattr(o, "velocity"):
            raise TypeError(f"op: op({t:g}) returned {type(o).__name__}, which has no .velocity(mu, x)")
        return o

    def layer_of(self, a: float, b: float) -> int | None:
        if self.layers is None:
            return None
        mid = 0.5 * (a + b)
        return min(max(sum(e <= mid for e in self.edges) - 1, 0), len(self.layers) - 1)

    def __call__(self, t, Y: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        self.nfev += 1
        t = float(t)
        X = Y
        if self.rescale_V is not None:
            E = torch.linalg.matrix_exp(t * self.rescale_V)
            X = Y @ E.T
        mu = self.template.with_points(X)
        op = self.operator(t, layer)
        # positions are query positions for causal operators; unmasked operators ignore the coordinate
        if self.template.positions is not None and getattr(op, "masked", False):
            v = op.velocity(mu, X, positions=self.template.positions)
        else:
            v = op.velocity(mu, X)
        if not isinstance(v, torch.Tensor) or v.shape != X.shape:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"op: velocity must map the ({X.shape[0]}, {X.shape[1]}) particles to "
                             f"({X.shape[0]}, {X.shape[1]}) velocities (d_out = d), got {shape}")
        if self.sphere:
            v = v - ((v * X).sum(1, keepdim=True) / (X * X).sum(1, keepdim=True)) * X
        if self.rescale_V is not None:
            v = (v - X @ self.rescale_V.T) @ torch.linalg.matrix_exp(-t * self.rescale_V).T
        return v

    def retract(self, Y: torch.Tensor) -> torch.Tensor:
        """Back onto the spheres |x_i| = r_i (the exact flow stays there; RK steps drift by O(h^5))."""
        if not self.sphere:
            return Y
        return Y * (self.radii / Y.norm(dim=1, keepdim=True))


# ---------------------------------------------------------------------------- solvers
def _euler(f, t, Y, h, layer):
    return Y + h * f(t, Y, layer)


def _rk4(f, t, Y, h, layer):
    k1 = f(t, Y, layer)
    k2 = f(t + h / 2, Y + (h / 2) * k1, layer)
    k3 = f(t + h / 2, Y + (h / 2) * k2, layer)
    k4 = f(t + h, Y + h * k3, layer)
    return Y + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)


def _check_finite(Y, t):
    if not bool(torch.isfinite(Y.detach()).all()):
        raise FloatingPointError(f"simulate: the particles left the floating-point range at t = {t:g} "
                                 "(reduce the step or the time span)")


def simulate(op, mu0, times, method: str = "rk4", rescale=False, sphere=False, *, step: float | None = None,
             steps: int | None = None, rtol: float = 1e-7, atol: float = 1e-9, beta: float | None = None,
             max_steps: int = 100_000, options: dict | None = None) -> Trajectory:
    """Integrate the token dynamics x_i' = Gamma_{mu(t)}(x_i) (MATH.md section 6) from ``mu0``.

    Parameters
    ----------
    op : operator, list of operators, callable ``t -> operator``, or None
        Anything with ``.velocity(mu, x[, positions])`` (SelfAttention, MultiHeadAttention,
        masked operators, :class:`SphereAttention`). A list gives one operator per layer on equal
        sub-intervals of [times[0], times[-1]] (layer boundaries are step boundaries, so piecewise
        constant parameters keep the order of the scheme); a callable is evaluated at every stage
        time (use it for smooth t-dependence). None only with ``sphere="SA"`` or ``"USA"``.
    mu0 : Measure or tensor (N, d)
        Initial particles at ``times[0]`` (a tensor is the empirical measure). Weights, and the
        positions of a masked measure, are kept constant.
    times : increasing sequence (T,) or a number t1
        Requested output times; ``times[0]`` is the initial time (a number means [0, t1]).
    method : "euler", "rk4", or a torchdiffeq adaptive method ("dopri5", "bosh3", "dopri8", ...)
        Fixed-step methods use ``step`` (largest step size) or ``steps`` (steps between consecutive
        requested times); by default 100 steps over the whole span. Euler with step 1/L on [0, 1] is
        exactly L residual layers x <- x + (1/L) Gamma(x). Adaptive methods use ``rtol``, ``atol``
        and at most ``max_steps`` steps per layer (else RuntimeError: not converged).
    rescale : bool or matrix (d, d)
        True: return y = exp(-tV) x with V = op.V (or the matrix given). See the module docstring.
    sphere : False, True, "SA" or "USA"
        True: project the field of ``op`` on the tangent spaces (norms conserved, and restored
        after each fixed step). "SA"/"USA": the sphere models with inverse temperature ``beta``.

    Returns
    -------
    Trajectory with the measures at the requested times only.
    """
    mu0 = mu0 if isinstance(mu0, Measure) else Measure(mu0)
    dtype, device = mu0.dtype, mu0.device
    t = _check_times(times, dtype)
    if not isinstance(method, str):
        raise TypeError(f"method: expected a string, got {type(method).__name__}")

    sphere_flag = _resolve_sphere(sphere)
    if sphere_flag in _SPHERE_MODELS:
        if op is not None:
            raise ValueError(f"op: with sphere={sphere_flag!r} the operator is SphereAttention(beta); pass op=None "
                             "(or sphere=True to project another operator's field)")
        if beta is None:
            raise ValueError(f"beta: sphere={sphere_flag!r} needs an inverse temperature beta")
        op = SphereAttention(beta, sphere_flag, masked=mu0.masked)
    elif beta is not None:
        raise ValueError("beta: only used with sphere='SA' or 'USA' (the operator carries its own parameters)")
    if op is None:
        raise ValueError("op: give an operator (or op=None with sphere='SA'/'USA' and beta)")

    V = _resolve_rescale(rescale, op, mu0.dim, dtype, device)
    if V is not None and sphere_flag:
        raise ValueError("rescale, sphere: the rescaled tokens exp(-tV) x and the sphere models do not combine")
    t0, t1 = float(t[0]), float(t[-1])
    field = _Field(op, mu0, t0, t1, V, bool(sphere_flag))
    Y = mu0.points
    if V is not None:
        Y = Y @ torch.linalg.matrix_exp(-t0 * V).T

    if method in FIXED_METHODS:
        out, nsteps = _integrate_fixed(field, Y, [float(s) for s in t], method, step, steps)
    else:
        if step is not None or steps is not None:
            raise ValueError(f"step, steps: only for the fixed-step methods {FIXED_METHODS}, not {method!r}")
        if method not in _adaptive_methods():
            raise ValueError(f"method: unknown solver {method!r}; fixed-step: {FIXED_METHODS}, adaptive "
                             f"(torchdiffeq): {_adaptive_methods()}")
        out, nsteps = _integrate_adaptive(field, Y, t, method, rtol, atol, max_steps, options)
    points = torch.stack(out)
    return Trajectory(t, points, mu0, method=method, nfev=field.nfev, steps=nsteps, rescale_V=V,
                      sphere=sphere_flag)


def _adaptive_methods() -> tuple[str, ...]:
    try:
        from torchdiffeq._impl.odeint import SOLVERS
    except ImportError:  # pragma: no cover - torchdiffeq moved its table
        return ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")
    from torchdiffeq._impl.rk_common import RKAdaptiveStepsizeODESolver
    return tuple(k for k, v in SOLVERS.items() if isinstance(v, type) and issubclass(v, RKAdaptiveStepsizeODESolver))


def _check_times(times, dtype) -> torch.Tensor:
    if isinstance(times, numbers.Real) and not isinstance(times, bool):
        times = [0.0, float(times)]
    t = as_tensor(times, "times", dtype=dtype).detach().cpu()
    check_ndim(t, "times", 1, "a 1-D sequence of output times")
    if t.shape[0] < 2:
        raise ValueError("times: need an initial time and at least one output time")
    if not bool((t[1:] > t[:-1]).all()):
        raise ValueError("times: must be strictly increasing (times[0] is the time of mu0)")
    return t


def _resolve_sphere(sphere):
    if sphere is False or sphere is None:
        return False
    if sphere is True:
        return True
    if isinstance(sphere, str) and sphere.upper() in _SPHERE_MODELS:
        return sphere.upper()
    raise ValueError(f"sphere: expected False, True, 'SA' or 'USA', got {sphere!r}")


def _resolve_rescale(rescale, op, dim, dtype, device):
    if rescale is False or rescale is None:
        return None
    if rescale is True:
        V = getattr(op, "V", None)
        if V is None:
            raise ValueError("rescale: the operator has no attribute V; pass the matrix, rescale=V")
        name = "op.V"
    else:
        V, name = rescale, "rescale"
    V = as_tensor(V, name, dtype=dtype, device=device).detach()
    if V.shape != (dim, dim):
        raise ValueError(f"{name}: the rescaling exp(-tV) needs a square ({dim}, {dim}) matrix, "
                         f"got {tuple(V.shape)}")
    return V


def _segments(field: _Field, times: Sequence[float]):
    """Consecutive pieces [a, b] between requested times and layer boundaries; k = output index."""
    cuts = sorted(set(times) | {e for e in field.breakpoints() if times[0] < e < times[-1]})
    idx = {s: k for k, s in enumerate(times)}
    return [(a, b, idx.get(b)) for a, b in zip(cuts[:-1], cuts[1:])]


def _integrate_fixed(field, Y, times, method, step, steps):
    stepper = _rk4 if method == "rk4" else _euler
    if step is not None and steps is not None:
        raise ValueError("step, steps: give at most one of them")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, numbers.Real) or not math.isfinite(step) or step <= 0:
            raise ValueError(f"step: expected a positive step size, got {step!r}")
        h_max = {(a, b): float(step) for a, b in zip(times[:-1], times[1:])}
    elif steps is None:
        h_max = {(a, b): (times[-1] - times[0]) / _DEFAULT_STEPS for a, b in zip(times[:-1], times[1:])}
    else:
        k = check_positive_int(steps, "steps")
        h_max = {(a, b): (b - a) / k for a, b in zip(times[:-1], times[1:])}
    out, nsteps = [field.retract(Y)], 0
    Y = out[0]
    for a, b, k_out in _segments(field, times):
        layer = field.layer_of(a, b)
        # a piece between layer boundaries inherits the step of the requested interval holding it
        h_piece = next(h for (lo, hi), h in h_max.items() if lo <= a and b <= hi)
        m = max(1, math.ceil((b - a) / h_piece - 1e-9))
        h = (b - a) / m
        for s in range(m):
            Y = field.retract(stepper(field, a + s * h, Y, h, layer))
        nsteps += m
        _check_finite(Y, b)
        if k_out is not None:
            out.append(Y)
    return out, nsteps


def _integrate_adaptive(field, Y, t, method, rtol, atol, max_steps, options):
    try:
        from torchdiffeq import odeint
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ImportError("method: adaptive solvers need torchdiffeq (pip install torchdiffeq)") from exc
    for name, val in (("rtol", rtol), ("atol", atol)):
        if not isinstance(val, numbers.Real) or not val > 0:
            raise ValueError(f"{name}: expected a positive tolerance, got {val!r}")
    opts = {"max_num_steps": check_positive_int(max_steps, "max_steps")}
    opts.update(options or {})
    times = [float(s) for s in t]
    # integrate layer by layer so that no step straddles a change of parameters
    edges = [times[0]] + [e for e in field.breakpoints() if times[0] < e < times[-1]] + [times[-1]]
    out = [field.retract(Y)]
    Y = out[0]
    for a, b in zip(edges[:-1], edges[1:]):
        layer = field.layer_of(a, b)
        inner = [s for s in times if a < s <= b]
        grid = [a] + inner + ([b] if not inner or inner[-1] < b else [])
        try:
            grid_t = torch.tensor(grid, dtype=Y.dtype, device=Y.device)
            sol = odeint(lambda tt, yy, _l=layer: field(tt, yy, _l), Y, grid_t, method=method, rtol=rtol,
                         atol=atol, options=opts)
        except AssertionError as exc:
            raise RuntimeError(f"simulate: the adaptive solver {method!r} did not converge on [{a:g}, {b:g}] "
                               f"({exc}); raise max_steps or loosen rtol/atol") from exc
        _check_finite(sol, b)
        for k, s in enumerate(grid[1:], start=1):
            if s in inner:
                out.append(field.retract(sol[k]))
        Y = field.retract(sol[-1])
    return out, None


def residual_layers(op, X: torch.Tensor, L: int, T: float = 1.0) -> torch.Tensor:
    """L residual layers x <- x + (T/L) Gamma(x) on a sequence X (n, d): Euler on [0, T]."""
    L = check_positive_int(L, "L")
    traj = simulate(op, X if isinstance(X, Measure) else Measure(X), [0.0, float(T)], method="euler", steps=L)
    return traj.points[-1]

