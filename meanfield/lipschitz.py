"""Local Lipschitz constants of attention: certified Krylov estimates of ||D_X f||_2 (MATH.md section 4).

``local_lipschitz(f, X)`` estimates Lip_X(f) = ||D_X f||_2, the largest singular value of the
Jacobian, matrix-free: J u is the *tangent* output of a forward-mode JVP and J^T w a VJP, so
J^T J is never formed. Three methods:

* ``"lanczos"`` (default): Lanczos on J^T J with full reorthogonalization, batched over inputs;
  certified by the explicit residual r = ||J^T J u - s^2 u|| of the returned vector.
* ``"power"``: power iteration on J^T J (Castin et al. 2024, Appendix E.1), stopped on the same
  residual (not on the absolute change of the estimate, which stops early on flat spectra).
* ``"dense"``: the explicit Jacobian and its top singular value (ground truth for small sizes).

For a :class:`~particles.Measure` the constant is taken in the W2 sense of Lemma C.5:
Lip = ||D^{1/2} J D^{-1/2}||_2 with D = diag(a) (x) I_d, J the Jacobian of the points map with
the log-weights (and, for masked operators, positions) held fixed.

Error bound. For the symmetric matrix B = J^T J (or its weighted form), a unit vector u with
Rayleigh quotient theta = |J u|^2 and residual r = ||B u - theta u|| has an eigenvalue lambda of B
with |lambda - theta| <= r, so a singular value sigma = sqrt(lambda) with
|sigma - sqrt(theta)| <= min(r / sqrt(theta), sqrt(r)): that is ``error``. Moreover sqrt(theta)
never exceeds the top singular value (a Rayleigh quotient), so ``value`` is a certified lower
bound of the Lipschitz constant; ``value + error`` bounds it from above as soon as the Ritz value
approximates the top of the spectrum, which Krylov methods from a random start reach with
probability one.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch.func import jacfwd, jacrev, jvp, vjp

from particles import Measure
from particles.validation import as_tensor, make_generator

from .attention import _AttentionOperator, _sequence_positions

__all__ = ["local_lipschitz", "lipschitz_ratio", "LipschitzEstimate", "ConvergenceError"]

_METHODS = ("lanczos", "power", "dense")
_DEFAULT_MAX_ITER = {"lanczos": 300, "power": 5000}


class ConvergenceError(ValueError, RuntimeError):
    """An iterative estimator stopped before reaching its tolerance; ``.estimate`` holds what it reached."""

    def __init__(self, message, estimate=None):
        super().__init__(message)
        self.estimate = estimate


@dataclass(frozen=True)
class LipschitzEstimate:
    """A local Lipschitz constant and its certificate.

    value : sqrt of the Rayleigh quotient |J u|^2 (weighted J for measures): a lower bound of Lip.
    vector : the unit direction u of maximal change, shaped like the points X. For a measure it is
        the right singular vector of D^{1/2} J D^{-1/2}; the point perturbation is u / sqrt(a).
    error : a bound on the distance from ``value`` to a singular value of J (0 for dense up to
        rounding); see the module docstring.
    iterations : solver iterations (Krylov dimension for lanczos).
    method : "lanczos", "power" or "dense".
    converged : whether error <= tol * value was reached.
    applications : Jacobian products used (each J u and each J^T w counts one; dense counts the
        rows or columns of the Jacobian it built).
    residual : ||J^T J u - value^2 u||.
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
class _Problem:
    """The linear map u -> (weighted) J u at a batch of points, with J^T available by VJP.

    ``fn`` maps X (b, n, d) to (b, n, d') independently per batch element; ``s_in`` and ``s_out``
    (n, 1) are the Lemma C.5 scalings a^{-1/2} and a^{1/2} (up to a common factor), or None.
    """

    def __init__(self, fn, X, s_in=None, s_out=None):
        self.fn, self.X, self.s_in, self.s_out = fn, X, s_in, s_out
        out, self._vjp = vjp(fn, X)
        if not bool(torch.isfinite(out).all()):
            raise ValueError("f: produced NaN or infinite outputs at X")
        self.out_shape = out.shape
        self.applications = 0

    def J(self, u):
        if self.s_in is not None:
            u = u * self.s_in
        # the tangent output [1], not the primal [0]: the pitfall of MATH.md section 4
        w = jvp(self.fn, (self.X,), (u,))[1]
        self.applications += 1
        return w if self.s_out is None else w * self.s_out

    def JT(self, w):
        if self.s_out is not None:
            w = w * self.s_out
        u = self._vjp(w)[0]
        self.applications += 1
        return u if self.s_in is None else u * self.s_in


def _scalings(log_weights, dtype):
    """s_in = sqrt(a_max / a_j), s_out = sqrt(a_j / a_max); zero-mass atoms get 0 (they are not in the measure)."""
    lw = log_weights.to(dtype)
    half = (lw - lw.max()) / 2
    present = torch.isfinite(half)
    if bool((present & (half < -0.5 * math.log(torch.finfo(dtype).max) + 1)).any()):
        raise ValueError("X: the weights of this measure span more than the floating range allows for the "
                         "weighted Jacobian D^{1/2} J D^{-1/2} (ratio of largest to smallest mass over "
                         f"{torch.finfo(dtype).max:.1e}); merge or drop the tiniest atoms")
    s_in = torch.where(present, torch.exp(-half.clamp(min=-700)), torch.zeros_like(half))
    s_out = torch.where(present, torch.exp(half), torch.zeros_like(half))
    return s_in[:, None], s_out[:, None]


def _make_problems(f, X):
    """Returns (list of (fn, X_batch, s_in, s_out), batched_flag, input shape)."""
    is_op = isinstance(f, _AttentionOperator)
    if not is_op and not callable(f):
        raise TypeError(f"f: expected an attention operator or a callable on tensors, got {type(f).__name__}")
    if isinstance(X, Measure):
        mu = X
        if is_op:
            mu = f._check_measure(mu, "X")
            lw, pos = mu.log_weights, mu.positions if f.masked else None
            fn = lambda Y: f._forward(Y, lw, None if pos is None else pos)
        else:
            with torch.no_grad():
                _call(f, mu.points)
            fn = lambda Y: _call(f, Y[0]).unsqueeze(0)
        s_in, s_out = _scalings(mu.log_weights, mu.dtype)
        return [(fn, mu.points.detach().unsqueeze(0), s_in, s_out)], False
    if is_op:
        Xt = f._check_points(X, "X")
    else:
        Xt = as_tensor(X, "X")
        if not Xt.is_floating_point():  # pragma: no cover - as_tensor converts
            raise TypeError("X: expected floating-point data")
    if Xt.dim() not in (2, 3):
        raise ValueError(f"X: expected a sequence (n, d) or a batch of sequences (b, n, d), got {tuple(Xt.shape)}")
    batched = Xt.dim() == 3
    Xb = (Xt if batched else Xt.unsqueeze(0)).detach()
    if Xb.shape[0] == 0 or Xb.shape[1] == 0:
        raise ValueError(f"X: empty input of shape {tuple(Xt.shape)}")
    if is_op:
        pos = _sequence_positions(Xb.shape[1], Xb) if f.masked else None
        fn = lambda Y: f._forward(Y, None, pos)
        return [(fn, Xb, None, None)], batched
    # one plain call first, outside autograd transforms, so that a wrong return type gets a clear error
    with torch.no_grad():
        _call(f, Xb[0])
    # an arbitrary callable may not batch: one problem per sequence
    fn = lambda Y: _call(f, Y[0]).unsqueeze(0)
    return [(fn, Xb[i:i + 1], None, None) for i in range(Xb.shape[0])], batched


def _call(f, Y):
    out = f(Y)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"f: expected it to return a torch tensor, got {type(out).__name__}")
    if out.dim() == 0:
        raise ValueError("f: returned a scalar; expected outputs of shape (n, d')")
    return out


# ---------------------------------------------------------------------- solvers
def _random_start(shape, like, seed):
    g = make_generator(seed)
    u = torch.randn(shape, generator=g, dtype=like.dtype).to(like.device)
    return u / _norms(u)


def _norms(u):
    return u.flatten(1).norm(dim=1).reshape(-1, *([1] * (u.dim() - 1)))


def _dot(u, v):
    return (u * v).flatten(1).sum(1)


def _certify(p, u):
    """value, residual, error for unit vectors u (b, ...) by one explicit J^T J u."""
    w = p.J(u)
    theta = _dot(w, w)
    z = p.JT(w)
    r = _norms(z - theta.reshape(-1, *([1] * (u.dim() - 1))) * u).flatten()
    value = theta.clamp(min=0).sqrt()
    err = torch.minimum(r / value.clamp(min=torch.finfo(u.dtype).tiny), r.sqrt())
    return value, r, err


def _power(p, tol, max_iter, seed):
    u = _random_start(p.X.shape, p.X, seed)
    done = torch.zeros(u.shape[0], dtype=torch.bool, device=u.device)
    value = r = err = None
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - the count is reported
        w = p.J(u)
        theta = _dot(w, w)
        z = p.JT(w)
        shape = (-1, *([1] * (u.dim() - 1)))
        r_new = _norms(z - theta.reshape(shape) * u).flatten()
        v_new = theta.clamp(min=0).sqrt()
        e_new = torch.minimum(r_new / v_new.clamp(min=torch.finfo(u.dtype).tiny), r_new.sqrt())
        if value is None:
            value, r, err = v_new, r_new, e_new
        else:
            # converged batch members keep the vector that met the tolerance
            value, r, err = (torch.where(done, a, b) for a, b in ((value, v_new), (r, r_new), (err, e_new)))
        done = done | (err <= tol * value)
        if bool(done.all()):
            break
        zn = _norms(z)
        nxt = torch.where(zn > 0, z / zn.clamp(min=torch.finfo(u.dtype).tiny), u)
        u = torch.where(done.reshape(shape), u, nxt)
    return value, u, err, r, it, done


def _lanczos(p, tol, max_iter, seed):
    """Lanczos on B = J^T J with full reorthogonalization, one Krylov basis per batch member."""
    b = p.X.shape[0]
    shape = p.X.shape
    N = p.X[0].numel()
    m_max = min(max_iter, N)
    dtype, device = p.X.dtype, p.X.device
    tiny = torch.finfo(dtype).eps
    q = _random_start(shape, p.X, seed).reshape(b, N)
    basis = torch.empty(b, m_max, N, dtype=dtype, device=device)
    alpha = torch.zeros(b, m_max, dtype=dtype, device=device)
    beta = torch.zeros(b, m_max, dtype=dtype, device=device)
    g = make_generator(None if seed is None else seed + 1)
    theta = y = None
    m = 0
    for j in range(m_max):
        basis[:, j] = q
        w = p.JT(p.J(q.reshape(shape))).reshape(b, N)
        alpha[:, j] = _dot(q, w)
        # full reorthogonalization, twice ("twice is enough"), keeps the basis orthonormal
        Qj = basis[:, : j + 1]
        for _ in range(2):
            w = w - torch.einsum("bk,bkn->bn", torch.einsum("bkn,bn->bk", Qj, w), Qj)
        beta[:, j] = w.norm(dim=1)
        m = j + 1
        off = beta[:, : m - 1]
        T = torch.diag_embed(alpha[:, :m]) + torch.diag_embed(off, 1) + torch.diag_embed(off, -1)
        evals, evecs = torch.linalg.eigh(T)
        theta, y = evals[:, -1], evecs[:, :, -1]
        # Lanczos residual of the top Ritz pair: beta_m |last component of y|
        r_est = beta[:, j] * y[:, -1].abs()
        sig = theta.clamp(min=0).sqrt()
        err = torch.minimum(r_est / sig.clamp(min=torch.finfo(dtype).tiny), r_est.sqrt())
        if bool((err <= 0.5 * tol * sig).all()) or m == m_max:
            break
        # an exhausted Krylov space (beta ~ 0) restarts with a fresh direction orthogonal to the basis
        scale = alpha[:, :m].abs().amax(1).clamp(min=tiny)
        broke = beta[:, j] <= 1e3 * tiny * scale
        if bool(broke.any()):
            fresh = torch.randn(b, N, generator=g, dtype=dtype).to(device)
            for _ in range(2):
                fresh = fresh - torch.einsum("bk,bkn->bn", torch.einsum("bkn,bn->bk", Qj, fresh), Qj)
            fresh = fresh / fresh.norm(dim=1, keepdim=True)
            beta[:, j] = torch.where(broke, torch.zeros_like(beta[:, j]), beta[:, j])
            w = torch.where(broke[:, None], fresh, w / beta[:, j : j + 1].clamp(min=tiny))
            q = w
        else:
            q = w / beta[:, j : j + 1]
    u = torch.einsum("bk,bkn->bn", y, basis[:, :m])
    u = (u / u.norm(dim=1, keepdim=True)).reshape(shape)
    value, r, err = _certify(p, u)
    done = err <= tol * value
    return value, u, err, r, m, done


def _dense(p):
    """Explicit (weighted) Jacobian of each batch member and its top singular triple."""
    n_in, n_out = p.X[0].numel(), math.prod(p.out_shape[1:])
    values, vectors, errs, res = [], [], [], []
    for i in range(p.X.shape[0]):
        X = p.X[i]
        # members are independent, so the Jacobian of member i only needs f at member i
        fn1 = lambda Y, i=i: p.fn(torch.cat([p.X[:i], Y.unsqueeze(0), p.X[i + 1:]]))[i]
        if p.X.shape[0] == 1:
            fn1 = lambda Y: p.fn(Y.unsqueeze(0))[0]
        jac = jacfwd(fn1) if n_in < n_out else jacrev(fn1)
        J = jac(X).reshape(n_out, n_in)
        if p.s_in is not None:
            s_out = p.s_out.expand(p.out_shape[1:]).reshape(-1)
            s_in = p.s_in.expand(X.shape).reshape(-1)
            J = s_out[:, None] * J * s_in[None, :]
        _, S, Vh = torch.linalg.svd(J, full_matrices=False)
        p.applications += min(n_in, n_out)
        # rounding-level certificate from the explicit product |J^T J u - s^2 u|
        r = float((J.T @ (J @ Vh[0]) - S[0] ** 2 * Vh[0]).norm())
        s = float(S[0])
        values.append(s)
        vectors.append(Vh[0].reshape(X.shape))
        errs.append(min(r / s, math.sqrt(r)) if s > 0 else math.sqrt(r))
        res.append(r)
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    return t(values), torch.stack(vectors), t(errs), t(res), 1, torch.ones(len(values), dtype=torch.bool)


def _canonical_sign(u):
    """Flip u so that its largest-magnitude entry is positive (singular vectors are defined up to sign)."""
    flat = u.reshape(-1)
    return -u if float(flat[flat.abs().argmax()]) < 0 else u


# ---------------------------------------------------------------------- public API
def local_lipschitz(f, X, method="lanczos", tol=1e-6, *, max_iter=None, seed=0, on_failure="raise"):
    """Local Lipschitz constant Lip_X(f) = ||D_X f||_2 (MATH.md section 4), certified.

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

    Returns
    -------
    LipschitzEstimate, or a list of them for a batch.
    """
    if method not in _METHODS:
        raise ValueError(f"method: expected one of {_METHODS}, got {method!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (tol > 0 and math.isfinite(tol)):
        raise ValueError(f"tol: expected a positive finite number, got {tol!r}")
    if on_failure not in ("raise", "warn"):
        raise ValueError(f"on_failure: expected 'raise' or 'warn', got {on_failure!r}")
    if max_iter is None:
        max_iter = _DEFAULT_MAX_ITER.get(method, 1)
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter: expected a positive integer, got {max_iter!r}")

    problems, batched = _make_problems(f, X)
    results = []
    for fn, Xb, s_in, s_out in problems:
        p = _Problem(fn, Xb, s_in, s_out)
        if method == "dense":
            value, u, err, r, it, done = _dense(p)
        elif method == "power":
            value, u, err, r, it, done = _power(p, tol, max_iter, seed)
        else:
            value, u, err, r, it, done = _lanczos(p, tol, max_iter, seed)
        per = p.applications
        for i in range(Xb.shape[0]):
            results.append(LipschitzEstimate(
                value=float(value[i].detach()), vector=_canonical_sign(u[i].detach()), error=float(err[i].detach()),
                iterations=int(it), method=method, converged=bool(done[i]), applications=int(per),
                residual=float(r[i].detach())))
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

    As nu -> mu this tends to at most the local constant of F at mu (MATH.md section 4).
    """
    if not isinstance(op, _AttentionOperator):
        raise TypeError(f"op: expected an attention operator of meanfield.attention, got {type(op).__name__}")
    mu = op._check_measure(mu, "mu")
    nu = op._check_measure(nu, "nu")
    # imported here: transport loads POT (~0.8 s), which nothing else in this module needs
    from transport import conditional_w2, w2

    dist = conditional_w2 if op.masked else w2
    den = dist(mu, nu)
    if den == 0:
        raise ValueError("mu, nu: W2(mu, nu) = 0 (the same measure); the ratio is undefined")
    if math.isinf(den):
        raise ValueError("mu, nu: conditional W2 is infinite (position marginals differ); the ratio is undefined")
    return float(dist(op(mu), op(nu))) / float(den)
