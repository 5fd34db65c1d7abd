"""Local Lipschitz constants of attention: certified Krylov estimates of ||D_X f||_2 (docs/math.md section 4).

``local_lipschitz(f, X)`` estimates Lip_X(f) = ||D_X f||_2, the largest singular value of the
Jacobian, matrix-free: J u is the *tangent* of f along u and J^T w a vector-Jacobian product, so
J^T J is never formed (docs/math.md section 4.2). f runs once with its graph recorded: J^T w is a
backward pass on it, and J u a backward pass through the recorded graph of w -> J^T w
(reverse-over-reverse), or forward-mode AD where that graph would exceed its memory budget or
cannot be built (see :class:`_Problem`). Three methods:

* ``"lanczos"`` (default): Lanczos on J^T J with full reorthogonalization, batched over inputs;
  certified by the explicit residual r = ||J^T J u - s^2 u|| of the returned vector. For float64
  inputs of at least :data:`MIXED_MIN_SIZE` entries a first phase runs on float32 products
  (``mixed``); it only proposes the vector, whose certificate comes from float64 products.
* ``"power"``: power iteration on J^T J (Castin et al. 2024, Appendix E.1), stopped on the same
  residual (not on the absolute change of the estimate, which stops early on flat spectra).
* ``"dense"``: the explicit Jacobian and its top singular value (ground truth for small sizes).

For a :class:`~particles.Measure` the constant is taken in the W2 sense of Lemma C.5:
Lip = ||D^{1/2} J D^{-1/2}||_2 with D = diag(a) (x) I_d, J the Jacobian of the points map with
the log-weights (and, for masked operators, positions) held fixed.

Error bound. For the symmetric matrix B = J^T J (or its weighted form), a unit vector u with
Rayleigh quotient ``theta = |J u|^2`` and residual ``r = ||B u - theta u||`` has an eigenvalue lambda of B
with ``|lambda - theta| <= r``, so a singular value sigma = sqrt(lambda) with
``|sigma - sqrt(theta)| <= min(r / sqrt(theta), sqrt(r))``: that is ``error``. Moreover sqrt(theta)
never exceeds the top singular value (a Rayleigh quotient), so ``value`` is a certified lower
bound of the Lipschitz constant; ``value + error`` bounds it from above as soon as the Ritz value
approximates the top of the spectrum, which Krylov methods from a random start reach with
probability one.

Mixed precision. The float32 phase (products, Krylov basis) stops at its own accuracy (about 1e-7
of ``|J|``, or ``tol``); its Ritz vector u is then certified with float64 products: value ``|J u|`` and the
residual of the float64 J^T J. If that misses ``tol``, a float64 Lanczos continues from u, and its
Ritz vector is certified from the float64 images B q_j it computed (B u = sum_j y_j B q_j: a
combination of float64 products, the same statement as a fresh product up to float64 rounding).
The float32 phase is skipped where float32 cannot represent the problem (constants or weight
scalings beyond its range, operators without ``to(dtype=...)``), and abandoned if a float32 product
overflows. ``converged`` is set only from float64 certificates.

Range. The solvers work on J / c with c a power of two near ``|J u|`` for the random start, and form
``|J u|`` and the normalized residual ``||J^T J u - theta u|| / sqrt(theta)`` rather than theta and the
plain residual, so values up to the dtype's largest number are computed (float64: the two-Dirac
witness at gamma R^2 = 450, Lip ~ 6e197). A product that overflows, or a Jacobian that
underflows, raises OverflowError; a zero value is returned only for a Jacobian that is exactly 0.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad
from torch.func import jacfwd, jacrev

from particles import Measure
from particles.validation import (
    ConvergenceError,
    check_allocation,
    check_on_failure,
    check_positive_float,
    check_positive_int,
    check_seed,
    make_generator,
)
from particles.validation import memory_limit as memory_limit_bytes

from .operator import AttentionOperator, as_operator, sequence_positions

__all__ = ["local_lipschitz", "lipschitz_ratio", "LipschitzEstimate", "ConvergenceError"]

_METHODS = ("lanczos", "power", "dense")
_DEFAULT_MAX_ITER = {"lanczos": 300, "power": 5000}


@dataclass(frozen=True)
class LipschitzEstimate:
    """A local Lipschitz constant and its certificate.

    Attributes
    ----------
    value : float
        sqrt of the Rayleigh quotient ``|J u|^2`` (weighted J for measures): a lower bound of Lip.
    vector : torch.Tensor
        The unit direction u of maximal change, shaped like the points X. For a measure it is
        the right singular vector of D^{1/2} J D^{-1/2}; the point perturbation is u / sqrt(a).
    error : float
        A bound on the distance from ``value`` to a singular value of J (0 for dense up to
        rounding); see the module docstring.
    iterations : int
        Solver iterations (Krylov dimension for lanczos).
    method : str
        "lanczos", "power" or "dense".
    converged : bool
        Whether error <= tol * value was reached.
    applications : int
        Jacobian products used (each J u and each J^T w counts one; dense counts the
        rows or columns of the Jacobian it built).
    residual : float
        ``||J^T J u - value^2 u||``.
    """

    value: float
    vector: torch.Tensor
    error: float
    iterations: int
    method: str
    converged: bool
    applications: int
    residual: float

    @property
    def lower(self) -> float:
        """Certified lower bound of Lip (a Rayleigh quotient never exceeds the top eigenvalue)."""
        return self.value

    @property
    def upper(self) -> float:
        """value + error: an upper bound once the Ritz value is the top of the spectrum."""
        return self.value + self.error

    def __float__(self) -> float:
        return self.value


# ---------------------------------------------------------------------- problem set-up
#: bytes the recorded graph of J^T w (reverse-over-reverse J u) may save; above it (or above an
#: eighth of the memory limit) J u runs in forward mode, which recomputes f but stores nothing
RR_BUDGET = 512 * 2**20
#: entries per batch member from which float32 products pay for their set-up (mixed="auto")
MIXED_MIN_SIZE = 4096
#: how close the first float32 product must come to the float64 one for the float32 phase to run
_MIXED_AGREEMENT = 1e-5
#: target of the float32 phase: its own rounding (~1e-7 of |J|) limits what it can certify
_LOW_TARGET = 2 * torch.finfo(torch.float32).eps


class _OverBudget(Exception):
    pass


class _LowRange(Exception):
    """A float32 product of the mixed-precision phase overflowed (float64 takes over)."""


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


class _Problem:
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
    (``J(u)``): c is about |J u| for the random start, so every quantity the solvers form (J u,
    J^T J u, their norms and Gram entries) is of order one however large or small Lip is. Scaling
    by a power of two is exact, so the results are those of the unscaled solve wherever that one
    does not overflow. Every product is checked: a non-finite one raises OverflowError (the
    constant is beyond the dtype's range at this input), never a silent 0 or NaN.
    """

    _MODES = ("rr", "rr-math", "forward", "forward-math", "rr-unbudgeted")

    def __init__(self, fn, X, s_in=None, s_out=None, memory_limit=None):
        self.fn, self.X, self.s_in, self.s_out = fn, X, s_in, s_out
        self.budget = min(RR_BUDGET, memory_limit_bytes(memory_limit) // 8)
        self.math_sdpa = False  # run torch's SDPA on its math backend (forward-mode AD available)
        self._record()
        if not bool(torch.isfinite(self.out.detach()).all()):
            raise ValueError("f: produced NaN or infinite outputs at X")
        self.out_shape = self.out.shape
        self.applications = 0
        self.scale = None      # (b,) powers of two, set by the first J product
        self.zero = None       # (b,) members whose Jacobian is exactly zero
        self.forward_mode = True
        self.cheap_checks = False
        self.mode = 0          # index into _MODES
        self._proven = False   # the current mode has returned a product
        self._rr = None

    def _record(self):
        self.Xr = self.X.detach().requires_grad_(True)
        with torch.enable_grad(), _sdpa_backends(self.math_sdpa):
            self.out = self.fn(self.Xr)
        # an output that does not depend on X (a zero Jacobian) has no graph
        self.constant = not self.out.requires_grad

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
        if self.s_in is not None:
            u = u * self.s_in
        w = self._jvp(u)
        self.applications += 1
        w = w if self.s_out is None else w * self.s_out
        _check_product(w, "J u", self.cheap_checks)
        return w

    def _raw_JT(self, w):
        if self.s_out is not None:
            w = w * self.s_out
        u = self._jt(w)
        self.applications += 1
        u = u if self.s_in is None else u * self.s_in
        _check_product(u, "J^T w", self.cheap_checks)
        return u

    def _calibrate(self, u, w):
        norms = _norms(w).flatten()
        zero = norms == 0
        if bool(zero.any()):
            # exactly zero for a random start: a zero Jacobian, or one below the dtype's range; a
            # tangent scaled by 2^(maxexp/2) (exact) tells the two apart
            big = 2.0 ** (math.frexp(torch.finfo(u.dtype).max)[1] // 2)
            probe = _norms(self._raw_J(u * big)).flatten()
            _refuse_underflow(zero & (probe > 0), u.dtype)
        # products near the subnormal range have lost their precision: no certificate can hold there
        _refuse_underflow(~zero & (norms < _UNDERFLOW[u.dtype]), u.dtype)
        self.zero = zero
        exponent = torch.frexp(torch.where(zero, torch.ones_like(norms), norms))[1]
        self.scale = torch.ldexp(torch.ones_like(norms), exponent)

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


#: below this, |J u| has lost its relative precision to the subnormal range of the dtype
_UNDERFLOW = _Underflow()


def _refuse_underflow(mask, dtype):
    if bool(mask.any()):
        raise OverflowError(
            f"X: the Jacobian at this input is below the {dtype} range (|J u| underflows to 0 or to subnormal "
            f"numbers for batch member(s) {mask.nonzero().flatten().tolist()}); rescale f"
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
    # s_in = exp(-half) must stay representable with headroom (e^12) for the products it enters;
    # what still overflows inside a product is caught there (OverflowError)
    limit = math.log(torch.finfo(dtype).max) - 12.0
    if bool((present & (half < -limit)).any()):
        raise ValueError("X: the weights of this measure span more than the floating range allows for the "
                         "weighted Jacobian D^{1/2} J D^{-1/2} (ratio of largest to smallest mass over "
                         f"e^{2 * limit:.0f} in {dtype}); "
                         + ("use float64, or " if dtype != torch.float64 else "")
                         + "merge or drop the tiniest atoms")
    s_in = torch.where(present, torch.exp(-half.clamp(min=-limit)), torch.zeros_like(half))
    s_out = torch.where(present, torch.exp(half), torch.zeros_like(half))
    return s_in[:, None], s_out[:, None]


def _float32_operator(op):
    """The operator with float32 parameters, or None when it cannot convert (bare callables, layers
    without ``to``)."""
    if op.points_only:
        return None
    try:
        op32 = op.to(dtype=torch.float32)
    except (NotImplementedError, TypeError, ValueError, AttributeError, RuntimeError):
        return None
    return op32 if isinstance(op32, AttentionOperator) else None


def _make_problems(f, X):
    """(operator, list of (fn, X_batch, s_in, s_out, low), batched flag) for f at X.

    ``low`` builds the float32 twin (fn32, X32, s_in32, s_out32) of a problem, or is None.
    """
    op = as_operator(f)

    def lowering(lw, pos, X_, log_weights=None):
        def build():
            op32 = _float32_operator(op)
            if op32 is None:
                return None
            lw32, pos32 = (None if t is None else t.to(torch.float32) for t in (lw, pos))
            s32 = (None, None) if log_weights is None else _scalings(log_weights, torch.float32)
            return (lambda Y: op32.points_map(Y, lw32, pos32)), X_.to(torch.float32), *s32
        return build

    if isinstance(X, Measure):
        mu = op.check_measure(X, "X")
        lw = None if op.points_only else mu.log_weights
        pos = mu.positions if op.masked else None
        fn = lambda Y: op.points_map(Y, lw, pos)
        s_in, s_out = _scalings(mu.log_weights, mu.dtype)
        Xb = mu.points.detach().unsqueeze(0)
        return op, [(fn, Xb, s_in, s_out, lowering(lw, pos, Xb, mu.log_weights))], False
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
        return op, [(fn, Xb[i:i + 1], None, None, None) for i in range(Xb.shape[0])], batched
    return op, [(fn, Xb, None, None, lowering(None, pos, Xb))], batched


# ---------------------------------------------------------------------- solvers
def _random_start(shape, like, seed):
    g = make_generator(seed)
    u = torch.randn(shape, generator=g, dtype=like.dtype).to(like.device)
    return u / _norms(u)


def _norms(u):
    """Per-member Euclidean norms (b, 1, ...), free of overflow and underflow in the squares."""
    flat = u.flatten(1)
    m = flat.abs().amax(dim=1)
    safe = torch.where((m > 0) & torch.isfinite(m), m, torch.ones_like(m))
    return ((flat / safe[:, None]).norm(dim=1) * safe).reshape(-1, *([1] * (u.dim() - 1)))


def _dot(u, v):
    return (u * v).flatten(1).sum(1)


def _rayleigh(p, u):
    """For unit vectors u (b, ...): v = |J u| (sqrt of the Rayleigh quotient of J^T J), the
    normalized residual rho = ||J^T (J u / v) - v u|| = ||J^T J u - v^2 u|| / v, and the error bound
    min(rho, sqrt(rho v)) on the distance from v to a singular value (module docstring). Working with
    v and rho instead of v^2 and the plain residual keeps every quantity at the scale of Lip itself.
    Also returns z = J^T J u / v (the next power iterate, up to its norm)."""
    w = p.J(u)
    v = _norms(w)
    z = p.JT(w / torch.where(v > 0, v, torch.ones_like(v)))
    rho = _norms(z - v * u).flatten()
    v = v.flatten()
    err = torch.minimum(rho, (rho * v).sqrt())
    return v, rho, err, z


def _rayleigh_from_image(u, Bu):
    """:func:`_rayleigh` for a unit u whose image B u = J^T J u is known (a combination of computed
    products): v = sqrt(u . B u), rho = ||B u / v - v u||, the same error bound."""
    theta = _dot(u, Bu).clamp(min=0)
    v = theta.sqrt().reshape(-1, *([1] * (u.dim() - 1)))
    z = Bu / torch.where(v > 0, v, torch.ones_like(v))
    rho = _norms(z - v * u).flatten()
    v = v.flatten()
    return v, rho, torch.minimum(rho, (rho * v).sqrt()), z


def _power(p, tol, max_iter, seed):
    u = _random_start(p.X.shape, p.X, seed)
    shape = (-1, *([1] * (u.dim() - 1)))
    done = torch.zeros(u.shape[0], dtype=torch.bool, device=u.device)
    value = rho = err = None
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - the count is reported
        v_new, r_new, e_new, z = _rayleigh(p, u)
        if value is None:
            value, rho, err = v_new, r_new, e_new
        else:
            # converged batch members keep the vector that met the tolerance
            value, rho, err = (torch.where(done, a, b) for a, b in ((value, v_new), (rho, r_new), (err, e_new)))
        # a zero value is a converged answer only for a Jacobian that is exactly zero (p.zero); for any
        # other member it is an underflow and never meets the tolerance
        done = done | ((err <= tol * value) & ((value > 0) | p.zero))
        if bool(done.all()):
            break
        zn = _norms(z)
        nxt = torch.where(zn > 0, z / torch.where(zn > 0, zn, torch.ones_like(zn)), u)
        u = torch.where(done.reshape(shape), u, nxt)
    return value, u, err, rho, it, done


class _Basis:
    """Krylov basis (b, m, N) that grows by doubling its capacity (never max_iter * N up front)."""

    def __init__(self, b, N, like, capacity=16):
        self.data = torch.empty(b, capacity, N, dtype=like.dtype, device=like.device)
        self.m = 0

    def append(self, q):
        if self.m == self.data.shape[1]:
            grown = torch.empty(self.data.shape[0], 2 * self.m, self.data.shape[2], dtype=self.data.dtype,
                                device=self.data.device)
            grown[:, : self.m] = self.data
            self.data = grown
        self.data[:, self.m] = q
        self.m += 1

    def view(self):
        return self.data[:, : self.m]


def _project_out(w, Q):
    return w - torch.bmm(torch.bmm(Q, w.unsqueeze(-1)).transpose(1, 2), Q).squeeze(1)


class _Krylov:
    """Lanczos on a symmetric B with full reorthogonalization, one Krylov basis per batch member,
    extended on demand (:meth:`run`) so that a caller can certify and go on.

    ``apply(Q)`` returns B Q for Q (b, N); ``q`` (b, N) are unit start vectors in the working dtype
    (the basis's); ``first`` is B q when already known. The small tridiagonal problem is solved in
    float64 whatever the working dtype.
    """

    def __init__(self, apply, q, m_max, g, first=None, images=False):
        self.apply, self.q, self.m_max, self.g, self.first = apply, q, m_max, g, first
        b, N = q.shape
        self.basis = _Basis(b, N, q, capacity=min(m_max, 16))
        # with ``images`` the products B q_j are kept, so that B u of a Ritz vector costs no product
        self.images = _Basis(b, N, q, capacity=min(m_max, 16)) if images else None
        self.alpha, self.beta = [], []
        self.q_prev = self.w = self.y = self.err = self.sig = None

    @property
    def m(self):
        return self.basis.m

    def _step(self):
        q = self.q
        dtype = q.dtype
        tiny = torch.finfo(dtype).eps
        j = self.m
        if j > 0:
            # the next vector from the last residual; an exhausted Krylov space (beta ~ 0) restarts with
            # a fresh direction orthogonal to the basis
            w, beta = self.w, self.beta[j - 1]
            scale = torch.stack(self.alpha, 1).abs().amax(1).clamp(min=tiny)
            broke = beta <= 1e3 * tiny * scale
            self.q_prev = q
            if bool(broke.any()):
                Qj = self.basis.view()
                fresh = torch.randn(q.shape, generator=self.g, dtype=dtype).to(q.device)
                fresh = _project_out(_project_out(fresh, Qj), Qj)
                fresh = fresh / fresh.norm(dim=1, keepdim=True)
                self.beta[j - 1] = beta = torch.where(broke, torch.zeros_like(beta), beta)
                q = torch.where(broke[:, None], fresh, w / beta[:, None].clamp(min=tiny))
            else:
                q = w / beta[:, None]
            self.q = q
        self.basis.append(q)
        w = self.first if (j == 0 and self.first is not None) else self.apply(q)
        if self.images is not None:
            self.images.append(w)
        self.alpha.append(_dot(q, w))
        # three-term recurrence, then one pass of full reorthogonalization; a second pass only where
        # the first removed most of what was left (the Daniel-Gragg-Kaufman-Stewart criterion)
        w = w - self.alpha[j][:, None] * q
        if self.q_prev is not None:
            w = w - self.beta[j - 1][:, None] * self.q_prev
        Qj = self.basis.view()
        before = w.norm(dim=1)
        w = _project_out(w, Qj)
        after = w.norm(dim=1)
        if bool((after < 0.7 * before).any()):
            w = _project_out(w, Qj)
            after = w.norm(dim=1)
        self.w = w
        self.beta.append(after)
        a_t, b_t = torch.stack(self.alpha, 1).double(), torch.stack(self.beta, 1).double()
        off = b_t[:, :j]
        T = torch.diag_embed(a_t) + torch.diag_embed(off, 1) + torch.diag_embed(off, -1)
        evals, evecs = torch.linalg.eigh(T)
        theta, self.y = evals[:, -1], evecs[:, :, -1]
        # Lanczos residual of the top Ritz pair: beta_m |last component of y|; the error bound on
        # sqrt(theta) as in the certificate (module docstring)
        r_est = b_t[:, j] * self.y[:, -1].abs()
        self.sig = theta.clamp(min=0).sqrt()
        self.err = torch.minimum(r_est / self.sig.clamp(min=torch.finfo(torch.float64).tiny), r_est.sqrt())

    def run(self, target):
        """Extend the basis until every member's estimated relative error is at most ``target`` or the
        basis holds ``m_max`` vectors; returns whether the target was met."""
        while True:
            if self.m > 0 and bool((self.err <= target * self.sig).all()):
                return True
            if self.m >= self.m_max:
                return False
            self._step()

    def ritz(self):
        """The unit top Ritz vectors (b, N), and B applied to them when the images are kept (else None)."""
        y = self.y.to(self.q.dtype).unsqueeze(1)
        u = torch.bmm(y, self.basis.view()).squeeze(1)
        norm = _norms(u)
        Bu = None if self.images is None else torch.bmm(y, self.images.view()).squeeze(1) / norm
        return u / norm, Bu


def _low_problem(build, u0):
    """The float32 twin of a problem and its first product J u0 (scaled), the scale calibrated on it;
    None where float32 cannot stand in: no float32 operator, products outside the float32 range, or a
    Jacobian that is zero or below the float32 range for some member (float64 decides those)."""
    try:
        parts = build()
        if parts is None:
            return None
        fn32, X32, s_in32, s_out32 = parts
        low = _Problem(fn32, X32, s_in32, s_out32)
        w = low.J(u0.to(torch.float32))
        low.cheap_checks = True
    except (ValueError, OverflowError, RuntimeError, NotImplementedError):
        return None
    if bool(low.zero.any()) or not bool(torch.isfinite(low.scale).all()):
        return None
    return low, w


def _lanczos(p, tol, max_iter, seed, memory_limit=None, low_build=None):
    """Lanczos on B = J^T J with full reorthogonalization, one Krylov basis per batch member.

    Stops when the explicit certificate of the Ritz vector (:func:`_rayleigh`) meets ``tol``; the
    Lanczos residual estimate only decides when to compute it. With ``low_build`` (mixed precision),
    a first phase runs entirely in float32 (products and basis) to at most float32 accuracy, its
    Ritz vectors certified with products in p's dtype; only if those miss ``tol`` does a Lanczos in
    p's dtype continue from the last one. Every returned value, error and residual comes from
    products in p's dtype.
    """
    b = p.X.shape[0]
    shape = p.X.shape
    N = p.X[0].numel()
    m_max = min(max_iter, N)
    check_allocation(b * m_max * N * p.X.element_size(), "method='lanczos'",
                     f"the Krylov basis of up to max_iter = {m_max} vectors of {N} entries; lower max_iter "
                     "(or tol), or use method='power', which stores no basis", memory_limit)
    g = make_generator(None if seed is None else seed + 1)
    q = _random_start(shape, p.X, seed)
    member = (-1, *([1] * (q.dim() - 1)))
    state = {"value": None, "done": torch.zeros(b, dtype=torch.bool, device=p.X.device)}

    def certify(u, Bu=None):
        """Certificate of u in p's dtype (from the products J u, J^T J u, or from B u when given);
        members certified earlier keep their result. Returns B u."""
        v, rho, err, z = _rayleigh(p, u) if Bu is None else _rayleigh_from_image(u, Bu.reshape(shape))
        ok = (err <= tol * v) & ((v > 0) | p.zero)
        if state["value"] is None:
            state.update(value=v, u=u, err=err, rho=rho)
        else:
            done = state["done"]
            for key, new in (("value", v), ("err", err), ("rho", rho)):
                state[key] = torch.where(done, state[key], new)
            state["u"] = torch.where(done.reshape(member), state["u"], u)
        state["done"] = state["done"] | ok
        return (z * v.reshape(member)).reshape(b, N)  # B u = |J u| z

    used = 0
    first = None
    twin = None if low_build is None else _low_problem(low_build, q)
    if twin is not None:
        low, w32 = twin
        # the scale (a power of two: any one is exact) comes from the float32 product
        p.scale, p.zero = low.scale.to(p.X.dtype), torch.zeros_like(low.zero)
        # the whole phase in float32, basis included: it only has to reach float32 accuracy

        def apply_low(v, Jv=None):
            try:
                return low.JT(low.J(v.reshape(shape)) if Jv is None else Jv).reshape(b, N)
            except OverflowError as exc:
                raise _LowRange from exc

        target = max(0.5 * tol, _LOW_TARGET)
        try:
            q32 = q.reshape(b, N).to(torch.float32)
            K = _Krylov(apply_low, q32, m_max, g, first=apply_low(q32, w32))
            while True:
                met = K.run(target)
                q = K.ritz()[0].to(p.X.dtype).reshape(shape)
                q = q / _norms(q)
                first = certify(q)
                left = ~state["done"]
                # float32 rounding dominates once the certified error is well above the float32 estimate
                # (the float32 operator's eigenvector is not the float64 one): float64 takes over
                estimate = (K.err / K.sig.clamp(min=torch.finfo(torch.float64).tiny)).to(state["err"].dtype)
                floor = bool((state["err"] > 2 * estimate * state["value"])[left].any())
                if bool(state["done"].all()) or not met or target <= _LOW_TARGET or floor:
                    break
                target = max(0.25 * target, _LOW_TARGET)
            used = K.m
        except _LowRange:
            # a float32 product left the float32 range: float64 from the start
            if state["value"] is None:
                q, first = _random_start(shape, p.X, seed), None
            used = 0
        p.applications += low.applications
        del low
    apply = lambda v: p.JT(p.J(v.reshape(shape))).reshape(b, N)
    if not bool(state["done"].all()) and used < m_max:
        # after a float32 phase, keep the images B q_j (a second basis) where memory allows: the
        # certificate of the Ritz vector then costs no product
        images = twin is not None and 2 * b * (m_max - used) * N * p.X.element_size() <= memory_limit_bytes(
            memory_limit)
        K = _Krylov(apply, q.reshape(b, N), m_max - used, g, first, images=images)
        target = 0.5 * tol
        while True:
            met = K.run(target)
            u, Bu = K.ritz()
            certify(u.reshape(shape), Bu)
            if bool(state["done"].all()) or not met:
                break
            # the residual estimate was optimistic: go on with a tighter target
            target *= 0.1
        used += K.m
    elif state["value"] is None:  # max_iter exhausted by the float32 phase before any certificate
        certify(q)
    return state["value"], state["u"], state["err"], state["rho"], used, state["done"]


def _dense(p, memory_limit):
    """Explicit (weighted) Jacobian of each batch member and its top singular triple."""
    n_in, n_out = p.X[0].numel(), math.prod(p.out_shape[1:])
    check_allocation(3 * n_in * n_out * p.X.element_size(), "method='dense'",
                     "the explicit Jacobian; use method='lanczos', which is matrix-free", memory_limit)
    values, vectors, errs, res = [], [], [], []
    for i in range(p.X.shape[0]):
        X = p.X[i]
        # members are independent, so the Jacobian of member i only needs f at member i
        fn1 = lambda Y, i=i: p.fn(torch.cat([p.X[:i], Y.unsqueeze(0), p.X[i + 1:]]))[i]
        if p.X.shape[0] == 1:
            fn1 = lambda Y: p.fn(Y.unsqueeze(0))[0]
        try:
            J = (jacfwd(fn1) if n_in < n_out and p.forward_mode else jacrev(fn1))(X).reshape(n_out, n_in)
        except NotImplementedError:  # no forward-mode derivative (fused kernels): reverse mode only
            p.forward_mode = False
            J = jacrev(fn1)(X).reshape(n_out, n_in)
        if p.s_in is not None:
            s_out = p.s_out.expand(p.out_shape[1:]).reshape(-1)
            s_in = p.s_in.expand(X.shape).reshape(-1)
            J = s_out[:, None] * J * s_in[None, :]
        _check_product(J, "(the explicit Jacobian)")
        p.applications += min(n_in, n_out)
        # J / c with c a power of two near its largest entry: exact, and keeps S^2 in range
        big = J.abs().max()
        _refuse_underflow((big > 0) & (big < _UNDERFLOW[J.dtype]), J.dtype)
        c = torch.ldexp(torch.ones_like(big), torch.frexp(big)[1]) if big > 0 else torch.ones_like(big)
        _, S, Vh = torch.linalg.svd(J / c, full_matrices=False)
        s, v = S[0], Vh[0]
        # rounding-level certificate from the explicit product (normalized residual, as in _rayleigh)
        w = (J / c) @ v
        rho = float(((J / c).T @ (w / s if s > 0 else w) - s * v).norm()) if s > 0 else 0.0
        c, s = float(c), float(s)
        values.append(s * c)
        vectors.append(v.reshape(X.shape))
        errs.append(min(rho, math.sqrt(rho * s)) * c)
        res.append(rho * c)
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    return t(values), torch.stack(vectors), t(errs), t(res), 1, torch.ones(len(values), dtype=torch.bool)


def _canonical_sign(u):
    """Flip u so that its largest-magnitude entry is positive (singular vectors are defined up to sign)."""
    flat = u.reshape(-1)
    return -u if float(flat[flat.abs().argmax()]) < 0 else u


# ---------------------------------------------------------------------- public API
def local_lipschitz(f, X, method="lanczos", tol=1e-6, *, max_iter=None, seed=0, on_failure="raise",
                    memory_limit=None, mixed=None):
    """Local Lipschitz constant Lip_X(f) = ||D_X f||_2 (docs/math.md section 4), certified.

    Parameters
    ----------
    f : an operator of :mod:`meanfield.attention` or any callable on tensors (n, d) -> (n, d')
        (e.g. a Hugging Face attention module wrapped in a function).
    X : tensor (n, d), batch (b, n, d), or :class:`~particles.Measure`
        Tensors use the Euclidean (Frobenius) norm; a measure uses the W2 sense of Lemma C.5,
        ||D^{1/2} J D^{-1/2}||_2 with its weights (and positions, for masked operators) held fixed.
        A batch gives a list of b estimates computed in one solver run with batched operator
        applications; an arbitrary callable, which may not batch, is looped over the sequences.
    method : "lanczos" (default), "power" (Appendix E.1) or "dense".
    tol : relative accuracy: stop when error <= tol * value.
    max_iter : iteration cap (lanczos: Krylov dimension, default 300; power: default 5000).
    seed : seed of the random start.
    on_failure : "raise" (a :class:`ConvergenceError` carrying the estimate) or "warn" (return
        the estimate with ``converged=False`` and emit a RuntimeWarning).
    memory_limit : bytes (or a size such as "16G") the dense Jacobian or the Krylov basis may take;
        default ``$SMOOTH_ATTENTION_MEMORY_LIMIT`` or 8 GiB. Above it a
        :class:`~particles.validation.MemoryLimitError` is raised before allocating.
    mixed : None (auto), True or False: whether Lanczos may run its first phase on float32 products
        (about twice as fast on CPU) for a float64 input. The float32 phase only proposes a vector;
        its value, error and ``converged`` come from float64 products, and a float64 Lanczos
        continues from it when that certificate misses ``tol``. None uses it for operators that
        convert to float32 (``op.to(dtype=torch.float32)``) with at least :data:`MIXED_MIN_SIZE`
        entries per batch member; True for every such operator; False never.

    Failures are never returned as values: a product that overflows the dtype's range raises
    OverflowError, a Jacobian below it (|J u| = 0 for a random start, while J is not zero) raises
    OverflowError too, and an estimate whose certificate does not meet ``tol`` is a
    ConvergenceError (or a warning with ``converged=False``). A zero value is returned only for a
    Jacobian that is exactly zero.

    Returns
    -------
    LipschitzEstimate, or a list of them for a batch.
    """
    if method not in _METHODS:
        raise ValueError(f"method: expected one of {_METHODS}, got {method!r}")
    tol = check_positive_float(tol, "tol")
    check_on_failure(on_failure)
    if max_iter is None:
        max_iter = _DEFAULT_MAX_ITER.get(method, 1)
    max_iter = check_positive_int(max_iter, "max_iter")
    seed = check_seed(seed)
    memory_limit_bytes(memory_limit)  # a malformed limit is an error whatever the method
    if mixed is not None and not isinstance(mixed, bool):
        raise TypeError(f"mixed: expected None, True or False, got {mixed!r}")

    op, problems, batched = _make_problems(f, X)
    results = []
    for fn, Xb, s_in, s_out, low_build in problems:
        p = _Problem(fn, Xb, s_in, s_out, memory_limit)
        if low_build is not None and (Xb.dtype != torch.float64 or mixed is False
                                      or (mixed is None and Xb[0].numel() < MIXED_MIN_SIZE)):
            low_build = None
        if method == "dense":
            value, u, err, rho, it, done = _dense(p, memory_limit)
        elif method == "power":
            value, u, err, rho, it, done = _power(p, tol, max_iter, seed)
        else:
            value, u, err, rho, it, done = _lanczos(p, tol, max_iter, seed, memory_limit, low_build)
        per = p.applications
        for i in range(Xb.shape[0]):
            # back from J / c to J (c = 1 for dense); residual ||J^T J u - value^2 u|| = rho * value
            c = 1.0 if p.scale is None else float(p.scale[i])
            val, rho_i = float(value[i].detach()) * c, float(rho[i].detach()) * c
            results.append(LipschitzEstimate(
                value=val, vector=_canonical_sign(u[i].detach()), error=float(err[i].detach()) * c,
                iterations=int(it), method=method, converged=bool(done[i]), applications=int(per),
                residual=rho_i * val))
    failed = [e for e in results if not e.converged]
    if failed:
        worst = max(failed, key=lambda e: e.error / max(e.value, 1e-300))
        msg = (f"local_lipschitz: method {method!r} did not reach tol={tol:g} in {worst.iterations} iterations "
               f"(relative error bound {worst.error / max(worst.value, 1e-300):.3g}, value {worst.value:.6g}); "
               "raise max_iter or loosen tol")
        if on_failure == "raise":
            raise ConvergenceError(msg, results if batched else results[0])
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return results if batched else results[0]


def lipschitz_ratio(op, mu, nu) -> float:
    """W2(F mu, F nu) / W2(mu, nu), with conditional W2 (Definition 4.1) for masked operators.

    ``op`` is anything :func:`meanfield.as_operator` accepts (a meanfield operator, a Hugging Face
    attention layer, ...; a bare callable only on uniform, unpositioned measures). As nu -> mu the
    ratio tends to at most the local constant of F at mu (docs/math.md section 4).
    """
    op = as_operator(op)
    mu = op.check_measure(mu, "mu")
    nu = op.check_measure(nu, "nu")
    # imported here: transport loads POT (~0.8 s), which nothing else in this module needs
    from transport import conditional_w2, w2

    dist = conditional_w2 if op.masked else w2
    den = dist(mu, nu)
    if den == 0:
        raise ValueError("mu, nu: W2(mu, nu) = 0 (the same measure); the ratio is undefined")
    if math.isinf(den):
        raise ValueError("mu, nu: conditional W2 is infinite (position marginals differ); the ratio is undefined")
    return float(dist(op(mu), op(nu))) / float(den)
