"""Jacobian products of attention: u -> J u and w -> J^T w, matrix-free (docs/math.md section 4.2).

The Lipschitz solvers (:mod:`meanfield.krylov`) see the Jacobian of an operator's points map only
through :class:`Jacobian`: ``J(u)`` (a tangent: forward-mode AD or reverse-over-reverse) and
``JT(w)`` (a vector-Jacobian product on the graph recorded once), both divided by a power of two
``c`` set from the first product so that every quantity a solver forms is of order one. This
module also builds the problems of :func:`meanfield.local_lipschitz` from what users pass
(:func:`make_problems`): the points map of an operator at X with weights and positions held fixed,
the Lemma C.5 scalings of a measure (docs/math.md section 4.5), and the float32 twin used by the
mixed-precision Lanczos.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.autograd import forward_ad

from particles import Measure
from particles.validation import memory_limit as memory_limit_bytes

from . import forward_mode
from .adapters import as_operator
from .operator import AttentionOperator, sequence_positions

__all__ = ["Jacobian", "Problem", "make_problems", "norms", "RR_BUDGET"]

#: bytes the recorded graph of J^T w (reverse-over-reverse J u) may save; above it (or above an
#: eighth of the memory limit) J u runs in forward mode, which recomputes f but stores nothing
RR_BUDGET = 512 * 2**20


class _OverBudget(Exception):
    pass


@contextlib.contextmanager
def _saved_bytes_budget(budget):
    """Abort (``_OverBudget``) a graph recording once its saved tensors exceed ``budget`` bytes."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        if total[0] > budget:
            raise _OverBudget
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


class Jacobian:
    """The linear map u -> (weighted) J u at a batch of points, with J^T available.

    ``fn`` maps X (b, n, d) to (b, n, d') independently per batch member; ``s_in`` and ``s_out``
    (n, 1) are the Lemma C.5 scalings a^{-1/2} and a^{1/2} (up to a common factor), or None.

    Products. f is evaluated once with its autograd graph recorded; J^T w is a backward pass on
    that graph (f is never recomputed). J u is, in order of preference:

    1. ``"rr"``: reverse-over-reverse on the same graph. g(w) = J^T w is linear in w, so
       J u = d<g(w), u>/dw: one backward pass through the recorded graph of g, built once (with
       create_graph) while its saved tensors stay within :data:`RR_BUDGET`;
    2. ``"rr-math"``: the same on a graph recorded with torch's SDPA on its "math" backend (its
       fused CPU kernels have no double backward nor forward-mode derivative), within the budget;
       skipped when "rr" failed on the budget;
    3. ``"forward"``: forward-mode AD (``torch.autograd.forward_ad``), which re-runs f with tangents
       (nothing stored; the streamed attention kernel has an analytic JVP);
    4. ``"forward-math"``: the same on SDPA's math backend;
    5. ``"rr-unbudgeted"``: reverse-over-reverse on the math backend without the budget (functions
       with neither forward-mode AD nor a graph within the budget).

    A mode that fails on its first product hands over to the next; J u is the *tangent* output,
    never f(X) (the pitfall of docs/math.md section 4.2).

    The solvers see J / c, with c (b,) a power of two per batch member set from the first product
    (``J(u)``): c is about ``|J u|`` for the random start, so every quantity the solvers form (J u,
    J^T J u, their norms and Gram entries) is of order one however large or small Lip is. Scaling
    by a power of two is exact, so the results are those of the unscaled solve wherever that one
    does not overflow. Every product is checked: a non-finite one raises OverflowError (the
    constant is beyond the dtype's range at this input), never a silent 0 or NaN.
    """

    _MODES = ("rr", "rr-math", "forward", "forward-math", "rr-unbudgeted")

    def __init__(self, fn, X, s_in=None, s_out=None, memory_limit=None, forward_first=False):
        self.fn, self.X, self.s_in, self.s_out = fn, X, s_in, s_out
        self.budget = min(RR_BUDGET, memory_limit_bytes(memory_limit) // 8)
        self.math_sdpa = False  # run torch's SDPA on its math backend (forward-mode AD available)
        self._record()
        if not bool(torch.isfinite(self.out.detach()).all()):
            # an arithmetic failure at this input (scores beyond the dtype's range), as the operators'
            # own maps report it: callers that search over inputs reject the input and go on
            raise FloatingPointError("f: produced NaN or infinite outputs at X (the attention scores overflow "
                                     f"{self.X.dtype} at this input, a field that is not a softmax average, such "
                                     "as USA's, overflows, or f is not finite there)")
        self.out_shape = self.out.shape
        self.applications = 0
        self.scale = None      # (b,) powers of two, set by the first J product
        self.zero = None       # (b,) members whose Jacobian is exactly zero
        self.forward_mode = True
        self.cheap_checks = False
        # index into _MODES; forward_first: f's own tangent is cheaper than reverse-over-reverse (the series, whose
        # tangent is one pass over its features where reverse-over-reverse differentiates its backward pass)
        self.mode = self._MODES.index("forward") if forward_first else 0
        self.on_product = None  # called after each product (the thread policy's re-check)
        self._proven = False   # the current mode has returned a product
        self._rr = None

    def _record(self):
        self.Xr = self.X.detach().requires_grad_(True)
        with torch.enable_grad(), _sdpa_backends(self.math_sdpa):
            self.out = self.fn(self.Xr)
        # an output that does not depend on X (a zero Jacobian) has no graph
        self.constant = not self.out.requires_grad
        if self.constant and self.X.numel():
            self._refuse_cut_graph()

    def _refuse_cut_graph(self):
        """An output without autograd's graph of X is the output of a constant map, or of one that cut the graph
        (``.detach()``, numpy, ``torch.no_grad``): f at a perturbed input tells them apart. A cut graph would
        give a certified 0 (a review: ``Y.detach() * 2``, constant 2), so it is a ValueError."""
        # a step of sqrt(eps) of the input's scale: far above the rounding of f, and close enough that a
        # piecewise-constant map (a comparison) rarely has a jump within it
        step = math.sqrt(torch.finfo(self.X.dtype).eps) * (float(self.X.detach().abs().max()) + 1.0)
        g = torch.Generator(device="cpu").manual_seed(0)
        delta = (torch.rand(self.X.shape, generator=g, dtype=torch.float64) - 0.5).to(self.X.device, self.X.dtype)
        try:
            with torch.no_grad(), _sdpa_backends(self.math_sdpa):
                moved = self.fn(self.X.detach() + step * delta)
        except Exception:   # f not defined there: no evidence either way, the map is taken as constant near X
            return
        out = self.out.detach()
        if not isinstance(moved, torch.Tensor) or moved.shape != out.shape:
            return
        tol = 64 * torch.finfo(out.dtype).eps * (float(out.abs().max()) + 1.0) if out.is_floating_point() else 0.0
        if float((moved - out).abs().max()) > tol:
            raise ValueError(f"f: its output carries no autograd graph of X (a .detach(), a conversion to numpy, "
                             f"or torch.no_grad inside f), yet it changes when X moves by {step:.2g}: its Jacobian "
                             "cannot be computed. Keep f differentiable in torch (the local constant of a constant "
                             "map is 0; a piecewise-constant one with a jump that close to X has none)")

    def _jt(self, w):
        if self.constant:
            return torch.zeros_like(self.X)
        g = torch.autograd.grad(self.out, self.Xr, w, retain_graph=True, allow_unused=True)[0]
        return torch.zeros_like(self.X) if g is None else g

    def _rr_product(self, u, budget):
        if self._rr is None:
            w0 = torch.zeros_like(self.out, requires_grad=True)
            budget_ctx = contextlib.nullcontext() if budget is None else _saved_bytes_budget(budget)
            with torch.enable_grad(), _sdpa_backends(self.math_sdpa), budget_ctx:
                g = torch.autograd.grad(self.out, self.Xr, w0, create_graph=True, allow_unused=True)[0]
            self._rr = (w0, g)
        w0, g = self._rr
        if g is None or not g.requires_grad:  # J^T w does not depend on w: J = 0
            return torch.zeros_like(self.out)
        Ju = torch.autograd.grad(g, w0, u, retain_graph=True, allow_unused=True)[0]
        return torch.zeros_like(self.out) if Ju is None else Ju

    def _forward_product(self, u):
        forward_mode.ready()
        with forward_ad.dual_level(), _sdpa_backends(self.math_sdpa):
            t = forward_ad.unpack_dual(self.fn(forward_ad.make_dual(self.X, u))).tangent
        return torch.zeros_like(self.out) if t is None else t.detach()

    def _jvp(self, u):
        if self.constant:
            return torch.zeros_like(self.out)
        while True:
            mode = self._MODES[self.mode]
            try:
                if mode.startswith("rr"):
                    w = self._rr_product(u, None if mode == "rr-unbudgeted" else self.budget)
                else:
                    w = self._forward_product(u)
            except (NotImplementedError, RuntimeError, _OverBudget) as exc:
                forward_failure = mode.startswith("forward") and isinstance(exc, NotImplementedError)
                if self._proven or self.mode == len(self._MODES) - 1 or not (mode.startswith("rr") or forward_failure):
                    raise
                self._next_mode(over_budget=isinstance(exc, _OverBudget))
                continue
            self._proven = True
            return w.detach()

    def _next_mode(self, over_budget=False):
        self._rr = None
        self.mode += 1
        if self._MODES[self.mode] == "rr-math" and over_budget:
            self.mode += 1  # the math backend saves at least as much
        mode = self._MODES[self.mode]
        self.forward_mode = mode.startswith("forward")
        if mode in ("rr-math", "forward-math", "rr-unbudgeted") and not self.math_sdpa:
            # torch's fused SDPA kernels have no forward-mode derivative (nor a double backward) on
            # CPU; its "math" backend is made of ordinary differentiable operations
            self.math_sdpa = True
            self._record()

    def _raw_J(self, u):
        return self._product(self._jvp, u, self.s_in, self.s_out, "J u")

    def _raw_JT(self, w):
        return self._product(self._jt, w, self.s_out, self.s_in, "J^T w")

    def _product(self, apply, x, scale_before, scale_after, what):
        """One counted product: ``apply`` between the range scalings on its two sides (J u: s_in, then
        s_out; J^T w the other way round), checked for finite output."""
        if scale_before is not None:
            x = x * scale_before
        y = apply(x)
        self.applications += 1
        if self.on_product is not None:
            self.on_product()
        y = y if scale_after is None else y * scale_after
        _check_product(y, what, self.cheap_checks)
        return y

    def _calibrate(self, u, w):
        size = norms(w).flatten()
        zero = size == 0
        if bool(zero.any()):
            # exactly zero for a random start: a zero Jacobian, or one below the dtype's range; a
            # tangent scaled by 2^(maxexp/2) (exact) tells the two apart
            big = 2.0 ** (math.frexp(torch.finfo(u.dtype).max)[1] // 2)
            probe = norms(self._raw_J(u * big)).flatten()
            _refuse_underflow(zero & (probe > 0), u.dtype)
        # products near the subnormal range have lost their precision: no certificate can hold there
        _refuse_underflow(~zero & (size < _UNDERFLOW[u.dtype]), u.dtype)
        self.zero = zero
        exponent = torch.frexp(torch.where(zero, torch.ones_like(size), size))[1]
        self.scale = torch.ldexp(torch.ones_like(size), exponent)

    def _per_member(self, t):
        return t.reshape(-1, *([1] * (self.X.dim() - 1)))

    def J(self, u):
        w = self._raw_J(u)
        if self.scale is None:
            self._calibrate(u, w)
        return w / self._per_member(self.scale)

    def JT(self, w):
        return self._raw_JT(w) / self._per_member(self.scale)


class _Underflow(dict):
    def __missing__(self, dtype):
        fi = torch.finfo(dtype)
        return fi.tiny / fi.eps


#: below this, ``|J u|`` has lost its relative precision to the subnormal range of the dtype
_UNDERFLOW = _Underflow()


def _refuse_underflow(mask, dtype):
    if bool(mask.any()):
        raise OverflowError(
            f"X: the Jacobian at this input is too small for {dtype} to certify (|J u| below "
            f"{_UNDERFLOW[dtype]:.3g}, where a product loses its relative precision to subnormal numbers, for batch "
            f"member(s) {mask.nonzero().flatten().tolist()}); rescale f"
            + (" or use float64" if dtype != torch.float64 else ""))


def _sdpa_backends(math_only: bool):
    """A context restricting torch's scaled_dot_product_attention to its math backend, or doing nothing."""
    if not math_only:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _check_product(t, what, cheap=False):
    # cheap: one sum (the float32 phase, whose products are of order one after the scaling; an
    # overflowing sum only hands the work to float64, never hides a non-finite product)
    finite = torch.isfinite(t.sum()) if cheap else torch.isfinite(t).all()
    if not bool(finite):
        fix = "use float64 or a smaller radius" if t.dtype != torch.float64 else "use a smaller radius or weights"
        raise OverflowError(f"X: the Jacobian product {what} overflows the {t.dtype} range at this input "
                            f"(the local constant, or the weights' scalings, exceed what the dtype holds); {fix}")


def _scalings(log_weights, dtype):
    """s_in = sqrt(a_max / a_j), s_out = sqrt(a_j / a_max); zero-mass atoms get 0 (they are not in the measure)."""
    lw = log_weights.to(dtype)
    half = (lw - lw.max()) / 2
    present = torch.isfinite(half)
    # s_in = exp(-half) must stay representable with headroom (e^12, or the square root of the range for float16,
    # whose whole range is e^11) for the products it enters; what still overflows inside a product is caught there
    # (OverflowError)
    top = math.log(torch.finfo(dtype).max)
    limit = max(top - 12.0, 0.5 * top)
    if bool((present & (half < -limit)).any()):
        raise ValueError("X: the weights of this measure span more than the floating range allows for the "
                         "weighted Jacobian D^{1/2} J D^{-1/2} (ratio of largest to smallest mass over "
                         f"e^{2 * limit:.0f} in {dtype}); "
                         + ("use float64, or " if dtype != torch.float64 else "")
                         + "merge or drop the tiniest atoms")
    s_in = torch.where(present, torch.exp(-half.clamp(min=-limit)), torch.zeros_like(half))
    s_out = torch.where(present, torch.exp(half), torch.zeros_like(half))
    return s_in[:, None], s_out[:, None]


def _converted_operator(op, dtype):
    """The operator with parameters of ``dtype``, or None when it cannot convert (bare callables, layers without
    ``to``)."""
    if op.points_only:
        return None
    try:
        converted = op.to(dtype=dtype)
    except (NotImplementedError, TypeError, ValueError, AttributeError, RuntimeError):
        return None
    return converted if isinstance(converted, AttentionOperator) else None


class Problem(NamedTuple):
    """One solver run: the points map ``fn`` of (b, n, d) batches at ``X`` (b, n, d), the Lemma C.5
    scalings ``s_in`` = a^{-1/2}, ``s_out`` = a^{1/2} of a measure (None for sequences), ``lower``,
    which builds the float32 twin (fn32, X32, s_in32, s_out32) of the problem, and ``higher``, its float64 twin
    (the same inputs and parameters, exactly widened), each None where there is none."""

    fn: Callable
    X: torch.Tensor
    s_in: torch.Tensor | None
    s_out: torch.Tensor | None
    lower: Callable | None
    higher: Callable | None = None


def make_problems(f, X):
    """(operator, list of :class:`Problem`, batched flag) for f at X: one problem for a measure, a
    sequence or a batch of sequences, one per sequence for a points-only callable (which may not batch).
    """
    op = as_operator(f)

    def twin(lw, pos, X_, log_weights=None, dtype=torch.float32):
        def build():
            converted = _converted_operator(op, dtype)
            if converted is None:
                return None
            lw2, pos2 = (None if t is None else t.to(dtype) for t in (lw, pos))
            s2 = (None, None) if log_weights is None else _scalings(log_weights, dtype)
            return (lambda Y: converted.points_map(Y, lw2, pos2)), X_.to(dtype), *s2
        return build

    def lowering(lw, pos, X_, log_weights=None):
        return twin(lw, pos, X_, log_weights) if getattr(op, "mixed_precision", True) else None

    def raising(lw, pos, X_, log_weights=None):
        return None if X_.dtype == torch.float64 else twin(lw, pos, X_, log_weights, torch.float64)

    if isinstance(X, Measure):
        mu = op.check_measure(X, "X")
        lw = None if op.points_only else mu.log_weights
        pos = mu.positions if op.masked else None
        fn = lambda Y: op.points_map(Y, lw, pos)
        s_in, s_out = _scalings(mu.log_weights, mu.dtype)
        Xb = mu.points.detach().unsqueeze(0)
        return op, [Problem(fn, Xb, s_in, s_out, lowering(lw, pos, Xb, mu.log_weights),
                         raising(lw, pos, Xb, mu.log_weights))], False
    Xt = op.check_points(X, "X")
    if Xt.dim() not in (2, 3):
        raise ValueError(f"X: expected a sequence (n, d) or a batch of sequences (b, n, d), got {tuple(Xt.shape)}")
    batched = Xt.dim() == 3
    Xb = (Xt if batched else Xt.unsqueeze(0)).detach()
    if Xb.shape[0] == 0 or Xb.shape[1] == 0:
        raise ValueError(f"X: empty input of shape {tuple(Xt.shape)}")
    pos = sequence_positions(Xb.shape[1], Xb) if op.masked else None
    fn = lambda Y: op.points_map(Y, None, pos)
    if op.points_only:
        # a bare callable may not batch: one problem per sequence
        return op, [Problem(fn, Xb[i:i + 1], None, None, None) for i in range(Xb.shape[0])], batched
    return op, [Problem(fn, Xb, None, None, lowering(None, pos, Xb), raising(None, pos, Xb))], batched


def norms(u):
    """Per-member Euclidean norms (b, 1, ...), free of overflow and underflow in the squares."""
    flat = u.flatten(1)
    m = flat.abs().amax(dim=1)
    safe = torch.where((m > 0) & torch.isfinite(m), m, torch.ones_like(m))
    return ((flat / safe[:, None]).norm(dim=1) * safe).reshape(-1, *([1] * (u.dim() - 1)))
