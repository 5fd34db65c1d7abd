"""Solvers for the top singular value of a Jacobian: Lanczos, power iteration, dense (docs/math.md 4.3).

Every solver has one signature and returns one object::

    SOLVERS[method](jac, tol, max_iter, seed, memory_limit=None, low_build=None) -> SolverResult

with ``jac`` a :class:`meanfield.jacobian.Jacobian` (the map u -> J u / c and its transpose, over a
batch of b inputs). The result holds, per batch member, the certified value ``|J u|`` / c, the unit
vector u, the error bound, the residual, and whether ``tol`` was met; :func:`meanfield.local_lipschitz`
turns it into :class:`~meanfield.lipschitz.LipschitzEstimate` objects.

Certificate. For B = J^T J and a unit u with v = ``|J u|`` and normalized residual
rho = ||B u - v^2 u|| / v, some singular value sigma of J has ``|sigma - v| <= min(rho, sqrt(rho v))``:
that is ``error``. v never exceeds the top singular value (it is the square root of a Rayleigh
quotient), so ``value`` is a certified lower bound; ``value + error`` bounds the top from above once
the Ritz value approximates the top of the spectrum (Krylov methods from a random start reach it
with probability one).

Termination. Every solver stops within its budget and says whether it met ``tol``:

* ``"lanczos"`` builds at most ``max_iter`` Krylov vectors (at most the problem size); each
  certification pass after the first adds at least one vector, and the run stops when the certified
  error stops improving although the Lanczos estimate says the target is met (``stalled``: the
  rounding of the products at this input is above ``tol``). Each Krylov vector costs 2 products
  and each certification pass at most 2, so a run uses at most ``4 max_iter + 2`` products (plus
  those of the float32 phase of the mixed-precision variant).
* ``"power"`` runs at most ``max_iter`` iterations (2 products each) and stops early when its best
  certified error has not improved by 1% in :data:`PATIENCE` iterations (``stalled``).
* ``"dense"`` builds the explicit Jacobian (one pass).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from dataclasses import dataclass

import torch
from torch.func import jacfwd, jacrev

from particles.progress import Heartbeat
from particles.validation import SEED_LIMIT, check_allocation, make_generator
from particles.validation import memory_limit as memory_limit_bytes

from . import forward_mode
from .jacobian import _UNDERFLOW, Jacobian, _check_product, _refuse_underflow, _sdpa_backends, norms

__all__ = ["SolverResult", "SOLVERS", "lanczos", "power", "dense", "PATIENCE"]

#: Iterations of the power iteration without a 1% gain of the best certified error, after which it has stalled
PATIENCE = 50
#: target of the float32 phase of the mixed Lanczos: its own rounding (~1e-7 of |J|) limits what it can certify
_LOW_TARGET = 2 * torch.finfo(torch.float32).eps
#: a Krylov residual below this fraction of the largest diagonal entry (or 1e3 machine epsilons, if smaller) is a
#: breakdown: the space is exhausted, and the next vector is a fresh direction
_BREAKDOWN_MAX = 1e-3
#: a certification pass whose error is not below this fraction of the previous one made no progress
_PROGRESS = 0.5
#: Lanczos steps that check a converged power iteration found the top singular value (:func:`power`)
POWER_CHECK_STEPS = 8
#: Lanczos vectors before any certificate may meet tol (a loose tol met after one or two steps by a Ritz value far
#: below the top: 12% at tol = 0.1 in a review's scan of 40 random attention inputs)
LANCZOS_MIN_STEPS = 8
#: restarts of the power iteration from the check's Ritz vector before a member is reported not converged
POWER_RESTARTS = 2
#: Lanczos steps that check a converged Lanczos run found the top singular value, from its certified vector
#: (:func:`lanczos`), and the restarts from the check's Ritz vector before a member is reported not converged
LANCZOS_CHECK_STEPS = 8
LANCZOS_RESTARTS = 2
#: whether Lanczos runs that check (:func:`lower_bounds_only` turns it off)
_CHECKED = contextvars.ContextVar("lanczos_checked", default=True)


@contextlib.contextmanager
def lower_bounds_only():
    """Within this block Lanczos skips the check of its converged certificates (:data:`LANCZOS_CHECK_STEPS`): for
    callers that use the value only as a lower bound of ||J|| (a Rayleigh quotient is one whatever singular value
    the certificate is about), such as the worst-case search, whose budget of Jacobian products the check would
    spend. ``error`` and ``converged`` then carry the unchecked guarantee (within ``error`` of *some* singular
    value)."""
    token = _CHECKED.set(False)
    try:
        yield
    finally:
        _CHECKED.reset(token)


@dataclass
class SolverResult:
    """What a solver returns, per batch member (tensors of length b), in units of the scaled J / c
    (of J itself for dense).

    Attributes
    ----------
    value : torch.Tensor
        The certified ``|J u|``.
    error : torch.Tensor
        Its error bound.
    residual : torch.Tensor
        The normalized residual rho.
    vector : torch.Tensor
        (b, ...) unit vectors u, shaped like the inputs.
    converged : torch.Tensor
        error <= tol * value (and a nonzero value unless J is exactly zero).
    stalled : torch.Tensor
        The run stopped because the certified error stopped improving (its rounding floor at this
        input lies above tol), not because the budget ran out.
    iterations : int
        Krylov dimension (lanczos), iterations (power) or 1 (dense).
    """

    value: torch.Tensor
    vector: torch.Tensor
    error: torch.Tensor
    residual: torch.Tensor
    iterations: int
    converged: torch.Tensor
    stalled: torch.Tensor


def _random_start(shape, like, seed):
    g = make_generator(seed)
    u = torch.randn(shape, generator=g, dtype=like.dtype).to(like.device)
    return u / norms(u)


def _dot(u, v):
    return (u * v).flatten(1).sum(1)


def _meets(err, value, tol, zero):
    """Converged members: error <= tol * value; a zero value only for a Jacobian that is exactly zero
    (for any other member it is an underflow and never meets the tolerance)."""
    return (err <= tol * value) & ((value > 0) | zero)


def _relative(err, value):
    return torch.where(value > 0, err / torch.where(value > 0, value, torch.ones_like(value)),
                       torch.full_like(err, math.inf))


def _rayleigh(p, u):
    """For unit vectors u (b, ...): v = ``|J u|`` (sqrt of the Rayleigh quotient of J^T J), the
    normalized residual rho = ||J^T (J u / v) - v u|| = ||J^T J u - v^2 u|| / v, and the error bound
    min(rho, sqrt(rho v)) on the distance from v to a singular value (module docstring). Working with
    v and rho instead of v^2 and the plain residual keeps every quantity at the scale of Lip itself.
    Also returns z = J^T J u / v (the next power iterate, up to its norm)."""
    w = p.J(u)
    v = norms(w)
    z = p.JT(w / torch.where(v > 0, v, torch.ones_like(v)))
    rho = norms(z - v * u).flatten()
    v = v.flatten()
    err = torch.minimum(rho, (rho * v).sqrt())
    return v, rho, err, z


def _rayleigh_from_image(u, Bu):
    """:func:`_rayleigh` for a unit u whose image B u = J^T J u is known (a combination of computed
    products): v = sqrt(u . B u), rho = ||B u / v - v u||, the same error bound."""
    theta = _dot(u, Bu).clamp(min=0)
    v = theta.sqrt().reshape(-1, *([1] * (u.dim() - 1)))
    z = Bu / torch.where(v > 0, v, torch.ones_like(v))
    rho = norms(z - v * u).flatten()
    v = v.flatten()
    return v, rho, torch.minimum(rho, (rho * v).sqrt()), z


# ---------------------------------------------------------------------- power iteration
log = logging.getLogger(__name__)

class _Progress:
    """INFO lines of a long estimate (:class:`particles.progress.Heartbeat`): the Jacobian products made of the
    budget and the largest estimated relative error (a solve shorter than the period says nothing). On CPU a
    product at N = 1e5 atoms takes about a minute: without them a run gave no sign of life for hours."""

    def __init__(self, what: str, budget: int, problem=None, beat: Heartbeat | None = None):
        self.what, self.budget, self.problem = what, budget, problem
        self.beat = Heartbeat() if beat is None else beat

    def _constant(self, value) -> float:
        """The largest member's value in the units of the constant returned: the solvers work with J / c, c the
        problem's scale (a power of two per member, set by its first product)."""
        scale = getattr(self.problem, "scale", None)
        if scale is not None and scale.numel() == value.numel():
            value = value * scale.to(value.dtype).reshape(value.shape)
        return float(value.max())

    @staticmethod
    def _relative(value, err) -> float:
        return float((err / value.clamp(min=torch.finfo(torch.float64).tiny)).max())

    def __call__(self, step: int, value, err) -> None:
        if self.beat.due():
            log.info("%s: step %d of at most %d, estimate %.6g, relative error about %.2g, %.0f s", self.what, step,
                     self.budget, self._constant(value), self._relative(value, err), self.beat.elapsed)

    def certified(self, value, err, dtype) -> None:
        """A certificate (products in ``dtype``, the input's): in a call that has run for a period or more, every
        one is logged, since its products are the long ones and the steps' estimates may be of another operator
        (the float32 twin) and far from the value returned."""
        if self.beat.long_running():
            log.info("%s: certified with products in %s: value %.6g, relative error %.2g, %.0f s", self.what,
                     str(dtype).replace("torch.", ""), self._constant(value), self._relative(value, err),
                     self.beat.elapsed)


def _check_steps(apply, u, steps, g, what, progress):
    """The check of a converged certificate (:func:`power`, :func:`lanczos`): ``steps`` Lanczos steps from its
    vector ``u`` (b, N); their top Ritz values (``.sig``, vectors from ``.ritz()``) are lower bounds of ||J||.
    ``progress``: the call's, whose heartbeat and scale the check's lines share, under the check's name."""
    K = _Krylov(apply, u, steps, g, progress=_Progress(what, steps, progress.problem, progress.beat))
    K.run(0.0, at_least=steps)
    return K


def _above(sig, value, err, done):
    """The members of ``done`` whose lower bound ``sig`` of ||J|| is above value + error, beyond the rounding of
    the products in the working dtype (value's): their certificate was about a lower singular value."""
    return done & (sig.to(value.dtype) > value + err + 16 * torch.finfo(value.dtype).eps * value)


def _confirmed_above(p, K, value, err, done):
    """:func:`_above` for the check ``K``'s top Ritz values, each confirmed by |J u| of its Ritz vector in p's dtype
    (a lower bound of ||J|| with p's rounding only): the Ritz value of float32 products, or of long float64 ones,
    can exceed ||J|| by their rounding, which would reopen a right certificate."""
    higher = _above(K.sig, value, err, done)
    if bool(higher.any()):
        ritz = K.ritz()[0].to(p.X.dtype).reshape(p.X.shape)
        higher = higher & _above(_rayleigh(p, ritz / norms(ritz))[0], value, err, done)
    return higher


def power(p: Jacobian, tol, max_iter, seed, memory_limit=None, low_build=None) -> SolverResult:
    """Power iteration on J^T J (Castin et al. 2024, Appendix E.1), stopped on the explicit
    certificate (not on the change of the estimate, which stops early on flat spectra), on
    ``max_iter``, or when the best certified error has not improved by 1% in :data:`PATIENCE`
    iterations. Members keep the iterate of their best certificate.

    The certificate bounds the distance to *some* singular value (docs/math.md section 4.4): with two close
    top singular values an iterate still mixing their vectors has a small residual near the lower one. So a
    converged member is checked with ``POWER_CHECK_STEPS`` Lanczos steps from its vector, whose top Ritz
    value is a lower bound of ||J|| at least the member's value: above value + error (and confirmed there by
    the norm of J u for its Ritz vector u, free of the check's own rounding), the certificate was
    about a lower singular value, and the iteration restarts from the Ritz vector (at most
    ``POWER_RESTARTS`` times, or once no budget is left to restart; then the member is reported as not
    converged). The check's steps count in ``max_iter`` and in the iterations reported; a budget too small
    for them (below the iterations plus 8) leaves the certificate unchecked. Iterations that converge on no member
    go on with the check's reserve, so a larger ``max_iter`` never iterates less."""
    u = _random_start(p.X.shape, p.X, seed)
    shape = p.X.shape
    b, N = shape[0], p.X[0].numel()
    progress = _Progress("local_lipschitz (power iteration)", max_iter, p)
    # the check's steps are kept out of the iterations' budget (one singular value in dimension 1: no check)
    steps = min(POWER_CHECK_STEPS, N) if N >= 2 else 0
    used = 0
    restarts = 0
    g = make_generator(None if seed is None else (seed + 1) % SEED_LIMIT)
    while True:
        room = max_iter - used - steps
        if room < 1:   # no room for the check after any iteration: the whole budget iterates, unchecked
            room = max_iter - used
        value, rho, err, vector, done, stalled, it = _power_loop(p, u, tol, room, progress, used)
        used += it
        if steps and not bool((done | stalled).any()) and max_iter - used > 0:
            # no member converged in the iterations left beside the check's reserve: the reserve iterates too, from
            # the best iterates (whose first certificate is theirs), so that a larger max_iter never does less
            value, rho, err, vector, done, stalled, it = _power_loop(p, vector, tol, max_iter - used, progress, used)
            used += it
        if not steps or not bool(done.any()):
            break
        if max_iter - used < steps:
            # no budget left for the check (max_iter below the iterations plus its steps): the certificate stands
            # unchecked, as before the check existed (converged means error <= tol * value)
            break
        K = _check_steps(lambda v: p.JT(p.J(v.reshape(shape))).reshape(b, N), vector.reshape(b, N), steps, g,
                         "local_lipschitz (power iteration: its check, Lanczos steps)", progress)
        used += K.m
        higher = _confirmed_above(p, K, value, err, done)
        if not bool(higher.any()):
            break
        if restarts >= POWER_RESTARTS or max_iter - used < 1 + steps:
            # still below a Ritz value: the certificate holds for a lower singular value only. After the
            # restarts a close top pair stalls the iteration (stalled: the message names close singular values);
            # a budget that allows no restart is the budget's doing (not stalled: 'increase max_iter')
            done = done & ~higher
            if restarts >= POWER_RESTARTS:
                stalled = stalled | higher
            break
        restarts += 1
        ritz = K.ritz()[0].to(vector.dtype).reshape(shape)
        u = torch.where(higher.reshape(-1, *([1] * (vector.dim() - 1))), ritz / norms(ritz), vector)
    return SolverResult(value, vector, err, rho, used, done, stalled)


def _power_loop(p, u, tol, max_iter, progress, offset):
    """The power iteration from unit vectors u, at most ``max_iter`` iterations (two products each): (value, rho,
    error, vector, done, stalled, iterations), each member with its best certificate."""
    shape = (-1, *([1] * (u.dim() - 1)))
    b = u.shape[0]
    done = torch.zeros(b, dtype=torch.bool, device=u.device)
    stalled = torch.zeros_like(done)
    best = since = None
    kept = None
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - the count is reported (power passes at least 1)
        v_new, r_new, e_new, z = _rayleigh(p, u)
        progress(offset + it, v_new.double(), e_new.double())
        rel = _relative(e_new, v_new)
        if kept is None:
            kept = [v_new, r_new, e_new, u]
            best, since = rel, torch.zeros(b, dtype=torch.long, device=u.device)
        else:
            # members keep their best certificate (the one that met tol, for converged members)
            better = ~done & ~stalled & (rel < best)
            kept = [torch.where(better.reshape(shape) if new.dim() > 1 else better, new, old)
                    for old, new in zip(kept, (v_new, r_new, e_new, u))]
            gain = rel < 0.99 * best
            since = torch.where(gain, torch.zeros_like(since), since + 1)
            best = torch.minimum(best, rel)
        done = done | _meets(kept[2], kept[0], tol, p.zero)
        stalled = stalled | (~done & (since >= PATIENCE))
        if bool((done | stalled).all()):
            break
        zn = norms(z)
        nxt = torch.where(zn > 0, z / torch.where(zn > 0, zn, torch.ones_like(zn)), u)
        u = torch.where((done | stalled).reshape(shape), u, nxt)
    value, rho, err, vector = kept
    return value, rho, err, vector, done, stalled, it


# ---------------------------------------------------------------------- Lanczos
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

    def __init__(self, apply, q, m_max, g, first=None, images=False, min_steps=0, *, progress: _Progress):
        self.apply, self.q, self.m_max, self.g, self.first = apply, q, m_max, g, first
        # no target counts as met before min_steps vectors: after one or two steps a loose target is met by
        # a Ritz value still far below the top (the certificate then bounds the distance to a lower one)
        self.min_steps = min(min_steps, m_max)
        b, N = q.shape
        self.basis = _Basis(b, N, q, capacity=min(m_max, 16))
        # with ``images`` the products B q_j are kept, so that B u of a Ritz vector costs no product
        self.images = _Basis(b, N, q, capacity=min(m_max, 16)) if images else None
        self.alpha, self.beta = [], []
        self.q_prev = self.w = self.y = self.err = self.sig = None
        # the call's progress, shared by its phases (one per phase would stay silent for a period after each start)
        self.progress = progress

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
            # (1e3 eps: 1 in float16, 8 in bfloat16, where every step would count as a breakdown: at most 1e-3)
            broke = beta <= min(1e3 * tiny, _BREAKDOWN_MAX) * scale
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
        self.progress(self.m, self.sig, self.err)

    def run(self, target, at_least=0):
        """Extend the basis by at least ``at_least`` vectors, then until every member's estimated
        relative error is at most ``target``, or until the basis holds ``m_max`` vectors; returns
        whether the target was met."""
        start = self.m
        while True:
            if self.m > 0 and self.m - start >= at_least and self.m >= self.min_steps \
                    and bool((self.err <= target * self.sig).all()):
                return True
            if self.m >= self.m_max:
                return False
            self._step()

    def ritz(self):
        """The unit top Ritz vectors (b, N), and B applied to them when the images are kept (else None)."""
        y = self.y.to(self.q.dtype).unsqueeze(1)
        u = torch.bmm(y, self.basis.view()).squeeze(1)
        norm = norms(u)
        Bu = None if self.images is None else torch.bmm(y, self.images.view()).squeeze(1) / norm
        return u / norm, Bu


class _LowRange(Exception):
    """A float32 product of the mixed-precision phase overflowed (float64 takes over)."""


def _low_problem(build, u0):
    """The float32 twin of a problem and its first product J u0 (scaled), the scale calibrated on it;
    None where float32 cannot stand in: no float32 operator, products outside the float32 range, or a
    Jacobian that is zero or below the float32 range for some member (float64 decides those)."""
    try:
        parts = build()
        if parts is None:
            return None
        fn32, X32, s_in32, s_out32 = parts
        low = Jacobian(fn32, X32, s_in32, s_out32)
        w = low.J(u0.to(torch.float32))
        low.cheap_checks = True
    except (ValueError, ArithmeticError, RuntimeError, NotImplementedError):
        # (ArithmeticError: OverflowError, and the FloatingPointError of an output beyond float32's range)
        return None
    if bool(low.zero.any()) or not bool(torch.isfinite(low.scale).all()):
        return None
    return low, w


class _Certificates:
    """The best certificate of each batch member so far: members that met ``tol`` keep theirs."""

    def __init__(self, p, tol, shape, progress=None):
        self.p, self.tol, self.shape, self.progress = p, tol, shape, progress
        b = shape[0]
        self.member = (-1, *([1] * (len(shape) - 1)))
        self.value = self.u = self.err = self.rho = None
        self.done = torch.zeros(b, dtype=torch.bool, device=p.X.device)
        self.passes = 0

    def certify(self, u, Bu=None):
        """Certificate of u in p's dtype (from the products J u, J^T J u, or from B u when given).
        Returns B u = ``|J u|`` z, flattened (b, N)."""
        v, rho, err, z = _rayleigh(self.p, u) if Bu is None else _rayleigh_from_image(u, Bu.reshape(self.shape))
        ok = _meets(err, v, self.tol, self.p.zero)
        if self.value is None:
            self.value, self.u, self.err, self.rho = v, u, err, rho
        else:
            keep = self.done
            self.value, self.err, self.rho = (torch.where(keep, old, new) for old, new in
                                              ((self.value, v), (self.err, err), (self.rho, rho)))
            self.u = torch.where(keep.reshape(self.member), self.u, u)
        self.done = self.done | ok
        self.passes += 1
        if self.progress is not None:
            self.progress.certified(self.value, self.err, self.p.X.dtype)
        return (z * v.reshape(self.member)).reshape(self.shape[0], -1)

    @property
    def relative(self):
        return _relative(self.err, self.value)


def lanczos(p: Jacobian, tol, max_iter, seed, memory_limit=None, low_build=None) -> SolverResult:
    """Lanczos on B = J^T J with full reorthogonalization, one Krylov basis per batch member.

    Stops when the explicit certificate of the Ritz vector (from fresh products J u) meets ``tol``; the
    Lanczos residual estimate only decides when to compute it. When the estimate says the target is
    met but the certificate misses ``tol``, the next pass tightens the target and adds at least one
    vector; once a pass no longer halves the certified error, the run stops (``stalled``: the
    rounding of the products at this input, not the Krylov space, limits the certificate). With
    ``low_build`` (mixed precision), a first phase runs entirely in float32 (products and basis) to at
    most float32 accuracy, its Ritz vectors certified with products in p's dtype; only if those miss
    ``tol`` does a Lanczos in p's dtype continue from the last one. Every returned value, error and
    residual comes from products in p's dtype.
    """
    b = p.X.shape[0]
    shape = p.X.shape
    N = p.X[0].numel()
    m_max = min(max_iter, N)
    check_allocation(b * m_max * N * p.X.element_size(), "method='lanczos'",
                     f"the Krylov basis of up to max_iter = {m_max} vectors of {N} entries; lower max_iter "
                     "(or tol), or use method='power', which stores no basis", memory_limit)
    g = make_generator(None if seed is None else (seed + 1) % SEED_LIMIT)
    q = _random_start(shape, p.X, seed)
    progress = _Progress("local_lipschitz (lanczos)", m_max, p)
    best = _Certificates(p, tol, shape, progress)
    stalled = torch.zeros(b, dtype=torch.bool, device=p.X.device)

    used = 0
    first = None
    twin = None if low_build is None else _low_problem(low_build, q)
    check_apply = check_dtype = None
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
            K = _Krylov(apply_low, q32, m_max, g, first=apply_low(q32, w32), min_steps=LANCZOS_MIN_STEPS,
                        progress=progress)
            while True:
                met = K.run(target)
                q = K.ritz()[0].to(p.X.dtype).reshape(shape)
                q = q / norms(q)
                first = best.certify(q)
                left = ~best.done
                # float32 rounding dominates once the certified error is well above the float32 estimate
                # (the float32 operator's eigenvector is not the float64 one): float64 takes over
                estimate = (K.err / K.sig.clamp(min=torch.finfo(torch.float64).tiny)).to(best.err.dtype)
                floor = bool((best.err > 2 * estimate * best.value)[left].any())
                if bool(best.done.all()) or not met or target <= _LOW_TARGET or floor:
                    break
                target = max(0.25 * target, _LOW_TARGET)
            used = K.m
            check_apply, check_dtype = apply_low, torch.float32   # the check below runs in float32 too
        except _LowRange:
            # a float32 product left the float32 range: float64 from the start
            if best.value is None:
                q, first = _random_start(shape, p.X, seed), None
            used = 0
    apply = lambda v: p.JT(p.J(v.reshape(shape))).reshape(b, N)
    if check_dtype is None:   # no float32 phase (or it left the float32 range): the check in p's dtype
        check_apply, check_dtype = apply, p.X.dtype
    steps = min(LANCZOS_CHECK_STEPS, N) if N >= 2 and _CHECKED.get() else 0
    restarts = 0
    while True:
        if not bool(best.done.all()) and used < m_max:
            # after a float32 phase, keep the images B q_j (a second basis) where memory allows: the
            # certificate of the Ritz vector then costs no product
            images = twin is not None and 2 * b * (m_max - used) * N * p.X.element_size() <= memory_limit_bytes(
                memory_limit)
            K = _Krylov(apply, q.reshape(b, N), m_max - used, g, first, images=images,
                        min_steps=max(0, LANCZOS_MIN_STEPS - used), progress=progress)
            target = 0.5 * tol
            previous = None
            while True:
                # after a pass whose certificate missed tol, extend by at least one vector: a pass that
                # only re-certifies the same Ritz vector learns nothing
                met = K.run(target, at_least=0 if previous is None else 1)
                u, Bu = K.ritz()
                best.certify(u.reshape(shape), Bu)
                if bool(best.done.all()) or not met:
                    break
                # the Lanczos estimate met its target and the explicit certificate did not: the estimate was
                # optimistic (it ignores rounding). Tighten the target while the certificate keeps improving;
                # members whose certified error no longer halves per pass are at their rounding floor
                rel = best.relative
                if previous is not None:
                    stalled = stalled | (~best.done & ~(rel < _PROGRESS * previous))
                    if bool((best.done | stalled).all()):
                        break
                previous = rel
                target *= 0.1
            used += K.m
        elif best.value is None:  # max_iter exhausted by the float32 phase before any certificate
            best.certify(q)
        # the certificate bounds the distance to *some* singular value: with a close top pair the Ritz value
        # can sit within its error of the lower one. A few Lanczos steps from the certified vector (which
        # still holds some of the top singular vector) give a Ritz value that is a lower bound of ||J||:
        # above value + error, the certificate was about a lower singular value, and Lanczos goes on from
        # that Ritz vector (at most LANCZOS_RESTARTS times; then the member has not converged)
        if not steps or not bool(best.done.any()) or m_max - used < steps:
            break
        # (after a float32 phase, in float32: a check far cheaper than the certificates, its rounding allowed for)
        try:
            C = _check_steps(check_apply, best.u.reshape(b, N).to(check_dtype), steps, g,
                             "local_lipschitz (lanczos: its check)", progress)
        except _LowRange:   # the float32 products left their range: the check in p's dtype
            check_apply, check_dtype = apply, p.X.dtype
            continue
        used += C.m
        # (the float32 twin has p's scale: its Ritz values are in the units of best.value)
        higher = _confirmed_above(p, C, best.value, best.err, best.done)
        if not bool(higher.any()):
            break
        if restarts >= LANCZOS_RESTARTS or m_max - used < 1 + steps:
            best.done = best.done & ~higher
            if restarts >= LANCZOS_RESTARTS:
                stalled = stalled | higher
            break
        restarts += 1
        best.done = best.done & ~higher   # certified again from the check's Ritz vector on
        q, first = C.ritz()[0].to(p.X.dtype).reshape(shape), None
    if twin is not None:
        p.applications += low.applications
    return SolverResult(best.value, best.u, best.err, best.rho, used, best.done, stalled & ~best.done)


# ---------------------------------------------------------------------- dense
def dense(p: Jacobian, tol=None, max_iter=None, seed=None, memory_limit=None, low_build=None) -> SolverResult:
    """Explicit (weighted) Jacobian of each batch member and its top singular triple (ground truth for
    small sizes); the certificate is the rounding-level residual of the explicit product, at least
    sqrt(min(n_in, n_out)) machine epsilons of the value (the rounding of the entries and the SVD). A member
    whose rounding-level error is above ``tol`` (float32 at a tight tol) has not converged: it is
    ``stalled`` at the rounding floor, which no further work in this dtype lowers."""
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
        # torch's SDPA on its math backend: its fused CPU kernels have no forward-mode derivative and
        # no batching rule for the vmap inside jacrev (a slow fallback with a warning)
        with _sdpa_backends(True):
            try:
                forward = n_in < n_out and p.forward_mode
                if forward:
                    forward_mode.ready()
                J = (jacfwd(fn1) if forward else jacrev(fn1))(X).reshape(n_out, n_in)
            except NotImplementedError:  # no forward-mode derivative: reverse mode only
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
        if J.dtype in (torch.float16, torch.bfloat16):
            # no SVD in the half types: the matrix widened to float32 (exactly); the certificate below in float32
            J, c = J.float(), c.float()
        _, S, Vh = torch.linalg.svd(J / c, full_matrices=False)
        s, v = S[0], Vh[0]
        # rounding-level certificate from the explicit product (normalized residual, as in _rayleigh)
        w = (J / c) @ v
        rho = float(((J / c).T @ (w / s if s > 0 else w) - s * v).norm()) if s > 0 else 0.0
        c, s = float(c), float(s)
        values.append(s * c)
        vectors.append(v.reshape(X.shape).to(X.dtype))
        # the residual misses the rounding of the Jacobian's entries and of the SVD (a value of 4.4e99 reported
        # with an error of 0.015 where the exact one differs by 1e83): at least sqrt(min(n_in, n_out)) units of
        # the input dtype's rounding of the value
        floor = math.sqrt(min(n_in, n_out)) * torch.finfo(X.dtype).eps * s * c
        errs.append(max(min(rho, math.sqrt(rho * s)) * c, floor))
        res.append(rho * c)
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    value, err = t(values), t(errs)
    ok = _meets(err, value, tol, value == 0) if tol is not None else torch.ones(len(values), dtype=torch.bool)
    return SolverResult(value, torch.stack(vectors), err, t(res), 1, ok, ~ok)


#: the solvers by method name, one signature (module docstring)
SOLVERS = {"lanczos": lanczos, "power": power, "dense": dense}
