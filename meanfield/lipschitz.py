"""Local Lipschitz constants of attention, certified: :func:`local_lipschitz` and :func:`lipschitz_ratio`
(docs/math.md section 4).

``local_lipschitz(f, X)`` estimates Lip_X(f) = ||D_X f||_2, the largest singular value of the
Jacobian, matrix-free: J u is the *tangent* of f along u and J^T w a vector-Jacobian product, so
J^T J is never formed (docs/math.md section 4.2). The computation is split in three rooms:

* :mod:`meanfield.jacobian`: the products J u and J^T w of an operator's points map at X (five AD
  modes, the range scaling, the checks of every product) and the problem set-up from what users pass;
* :mod:`meanfield.krylov`: the solvers ``"lanczos"`` (default; Lanczos on J^T J with full
  reorthogonalization, batched, optionally mixed precision), ``"power"`` (Castin et al. 2024,
  Appendix E.1) and ``"dense"`` (the explicit Jacobian: ground truth for small sizes), one
  signature, one result type;
* this module: the API, the tolerance by dtype (:data:`TOL`) and the estimate users get.

For a :class:`~particles.Measure` the constant is taken in the W2 sense of Lemma C.5:
Lip = ||D^{1/2} J D^{-1/2}||_2 with D = diag(a) (x) I_d, J the Jacobian of the points map with
the log-weights (and, for masked operators, positions) held fixed.

Certificate. ``value`` = ``|J u|`` for the returned unit vector u is a certified lower bound of the
constant; ``error`` bounds its distance to a singular value of J (min(rho, sqrt(rho value)) with
rho the normalized residual ||J^T J u - value^2 u|| / value), so ``value + error`` bounds Lip from
above once the Ritz value is the top of the spectrum (:mod:`meanfield.krylov`).

Mixed precision. For float64 inputs of at least :data:`MIXED_MIN_SIZE` entries a first Lanczos
phase runs on float32 products; it only proposes the vector, whose certificate comes from float64
products (``converged`` is set only from float64 certificates).

Range. The solvers work on J / c with c a power of two near ``|J u|`` for the random start, so
values up to the dtype's largest number are computed (float64: the two-Dirac witness at
gamma R^2 = 450, Lip ~ 6e197). A product that overflows, or a Jacobian that underflows, raises
OverflowError; a zero value is returned only for a Jacobian that is exactly 0.

Termination. Every call returns within its budget (``max_iter``; :mod:`meanfield.krylov` says how
many products that is) and says whether ``tol`` was met. A ``tol`` below the dtype's machine epsilon
is refused up front (the value itself is only known to that relative accuracy); a ``tol`` above it
that the products cannot reach at this input (their rounding grows with the size and the radius)
ends in a ConvergenceError whose message names the level where the certificate stalled.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass

import torch

from particles import Measure
from particles.threads import ThreadPolicy, timed_probe
from particles.validation import (
    SEED_LIMIT,
    ConvergenceError,
    check_on_failure,
    check_positive_float,
    check_positive_int,
    check_seed,
)
from particles.validation import memory_limit as memory_limit_bytes

from . import kernels, krylov, series_attention, series_jacobian
from .adapters import as_operator
from .jacobian import Jacobian, make_problems, norms
from .krylov import PATIENCE, SOLVERS
from .operator import WRAP_POINTS

log = logging.getLogger(__name__)

__all__ = ["local_lipschitz", "lipschitz_ratio", "LipschitzEstimate", "ConvergenceError", "TOL", "MAX_ITER",
           "default_tol", "MIXED_MIN_SIZE"]

METHODS = tuple(SOLVERS)

#: Default relative tolerance of the certificate (error <= tol * value) by the input's dtype, what a solve with
#: products of that precision reaches on the framework's problems (attention layers up to d = 768). In float32
#: the result is checked with float64 products (:func:`local_lipschitz`, ``tol``): 120 runs of single-head and
#: L2 attention at radii 1 to 100 all met 1e-3 (worst 4.8e-4), but scores of order 1e4 (an unscaled A at
#: R = 100) round enough to miss it, which is reported as not converged. Other tolerances are given with ``tol=``.
TOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 1e-1}

#: Default iteration budget by method (the Krylov dimension for lanczos, iterations for power, one pass for dense)
MAX_ITER = {"lanczos": 300, "power": 5000, "dense": 1}

#: a stalled certificate above sqrt(this many machine epsilons) (relative error) is not at a rounding floor:
#: products round at 10 to 1e4 epsilons, and the certificate's error bound is the square root of such a residual
#: where it is smaller than the residual itself. Power iteration stalls above it on close singular values
ROUNDING_FLOOR = 1e4

#: entries per batch member from which float32 products pay for their set-up (mixed=None)
MIXED_MIN_SIZE = 4096

#: float64 power steps (two products each) that the float64 check of a float32 or half solve may take from the
#: solve's vector before it reports the certificate (:func:`_checked_in_float64`)
CHECK_STEPS = 3


def default_tol(dtype: torch.dtype) -> float:
    """The default ``tol`` of :func:`local_lipschitz` (and of the worst-case search) for inputs of ``dtype``."""
    if dtype not in TOL:
        raise TypeError(f"X: no default tolerance for dtype {dtype}; use float64 or float32 (or give tol=)")
    return TOL[dtype]


def _check_tol(tol, dtype: torch.dtype) -> float:
    """tol as a float, at least the machine epsilon of ``dtype`` (the relative rounding of the value itself)."""
    if tol is None:
        return default_tol(dtype)
    tol = check_positive_float(tol, "tol")
    if tol >= 1:
        raise ValueError(f"tol: {tol:g} is a relative error (error <= tol * value); at 1 or more it certifies "
                         "nothing about the value: use tol < 1 (the default is 1e-6 in float64)")
    eps = torch.finfo(dtype).eps
    if tol < eps:
        raise ValueError(f"tol: {tol:g} is below what {dtype} can certify: its machine epsilon {eps:.3g} is the "
                         f"relative rounding of the value itself; use tol >= {eps:.3g} (in practice the "
                         f"certificate of attention products stalls between {10 * eps:.0e} and {1e4 * eps:.0e}), "
                         + ("or float64 inputs" if dtype != torch.float64 else "or leave tol=None for the default "
                                                                                 f"{TOL[torch.float64]:g}"))
    return tol


@dataclass(frozen=True)
class LipschitzEstimate:
    """A local Lipschitz constant and its certificate (one input), or those of a batch of inputs.

    For one input X (n, d) or a measure, the fields are plain numbers. For a batch X (b, n, d) the
    same object holds b estimates: ``value``, ``error``, ``residual`` are float64 tensors (b,),
    ``converged`` a bool tensor (b,), ``vector`` (b, n, d); ``len(est)`` is b and ``est[i]`` (or
    iterating) gives the estimate of input i.

    Attributes
    ----------
    value : float
        ``|J u|`` (weighted J for measures): a certified lower bound of Lip.
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
        rows or columns of the Jacobian it built). For a batch: those of the whole batch.
    residual : float
        ``||J^T J u - value^2 u||``.
    stalled : bool
        The solver stopped because its certificate stopped improving (the rounding of the
        products at this input is above ``tol``), not because it ran out of iterations.
    attention : str
        How the products evaluated attention (``local_lipschitz(attention=...)``): "exact", or "series" (the
        truncated exponential series, whose truncation bound eps_J is carried into ``value``, lowered by it, and
        ``error``, raised by 2 eps_J: docs/math.md section 4.8); "mixed" for a batch whose members took different
        paths (a member of it, ``est[i]``, says "not recorded"); "not recorded" for an estimate loaded from a file
        written before this field existed (a reader from before it refuses a file that has it, naming the field).
    """

    value: float
    vector: torch.Tensor
    error: float
    iterations: int
    method: str
    converged: bool
    applications: int
    residual: float
    stalled: bool = False
    batched: bool = False
    attention: str = "exact"

    @property
    def lower(self):
        """Certified lower bound of Lip (a Rayleigh quotient never exceeds the top eigenvalue)."""
        return self.value

    @property
    def upper(self):
        """``value + error``, an upper bound once the Ritz value is the top of the spectrum. ``error`` bounds the
        distance to *some* singular value: where the top two are close, the iteration may certify the second
        before it has separated them, and ``upper`` then falls short of the top by up to their gap, which need not
        be below ``tol * value`` (seen: a relative gap of 1.4e-6 at tol = 1e-6, ``upper`` 1.3e-6 short, for one
        random start of five; docs/math.md section 4.4). Both iterations check a converged vector with a few
        Lanczos steps, which catches a higher singular value that stands apart; a pair or a cluster of top
        values within a few ``tol`` of each other can still be missed, ``upper`` falling short of the top by a
        small multiple of ``tol`` (up to 4.3 ``tol`` seen, on eight top values about ``tol`` apart, for about one
        random start in a hundred). ``value`` stays a lower bound (to the dtype's rounding)."""
        return self.value + self.error

    def __float__(self) -> float:
        if self.batched:
            raise TypeError(f"float(): this estimate holds a batch of {len(self)} values; use est.value or est[i]")
        return self.value

    # ---------------------------------------------------------------- a batch as a sequence of estimates
    def __len__(self) -> int:
        if not self.batched:
            raise TypeError("len(): this estimate is of one input, not a batch")
        return int(self.value.shape[0])

    def __getitem__(self, i) -> LipschitzEstimate:
        if not self.batched:
            raise TypeError("this estimate is of one input, not a batch: it has no members to index")
        if not isinstance(i, int):
            i = int(i)
        b = len(self)
        if not -b <= i < b:
            raise IndexError(f"batch member {i} out of range for a batch of {b}")
        return LipschitzEstimate(
            value=float(self.value[i]), vector=self.vector[i], error=float(self.error[i]),
            iterations=self.iterations, method=self.method, converged=bool(self.converged[i]),
            applications=self.applications, residual=float(self.residual[i]), stalled=bool(self.stalled[i]),
            attention=self.attention if self.attention != "mixed" else "not recorded")

    def __iter__(self):
        if not self.batched:
            raise TypeError("this estimate is of one input, not a batch: it is not iterable")
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        path = "" if self.attention == "exact" else f", attention={self.attention!r}"
        if self.batched:
            return (f"LipschitzEstimate(batch of {len(self)}, values {self.value.tolist()}, method={self.method!r}, "
                    f"converged {int(self.converged.sum())} of {len(self)}{path})")
        state = "converged" if self.converged else ("stalled" if self.stalled else "not converged")
        return (f"LipschitzEstimate(value={self.value:.10g}, error={self.error:.3g}, method={self.method!r}, "
                f"{state}, iterations={self.iterations}, applications={self.applications}{path})")


def _canonical_sign(u):
    """Flip u so that its largest-magnitude entry is positive (singular vectors are defined up to sign)."""
    flat = u.reshape(-1)
    return -u if float(flat[flat.abs().argmax()]) < 0 else u


def _estimates(result, jac: Jacobian, method: str):
    """Per-member (value, vector, error, residual, converged, stalled) in the units of J (not J / c)."""
    out = []
    for i in range(jac.X.shape[0]):
        # back from J / c to J (c = 1 for dense); residual ||J^T J u - value^2 u|| = rho * value
        c = 1.0 if jac.scale is None else float(jac.scale[i])
        val = float(result.value[i].detach()) * c
        out.append((val, _canonical_sign(result.vector[i].detach()), float(result.error[i].detach()) * c,
                    float(result.residual[i].detach()) * c * val, bool(result.converged[i]),
                    bool(result.stalled[i])))
    return out


def _checked_in_float64(members, jac, tol):
    """The members of a float32 (or half) solve, certified with float64 products of ``jac``, the float64 twin of
    the problem (:func:`_float64_twin`).

    The solver's certificate covers the Jacobian its products compute, in the input's dtype; at large radii
    that Jacobian differs from the map's own (the same inputs and parameters in exact arithmetic) by more than
    tol (float32, R = 50-100: 2e-4 to 3e-3 relative, where the float32 certificates said 1e-6). The returned
    vector u of each member is therefore certified again by float64 products (two per member, the float64 twin
    of the problem): value |J u|, error min(rho, sqrt(rho |J u|)) (docs/math.md section 4.4), converged where
    that error meets tol. A member whose own certificate met tol and whose float64 one does not is at the
    rounding floor of its dtype (``stalled``)."""
    from .krylov import _meets, _rayleigh

    u = torch.stack([m[1] for m in members]).to(device=jac.X.device, dtype=torch.float64)
    u = u / norms(u)
    value, rho, err, z = _rayleigh(jac, u)
    met = _meets(err, value, tol, jac.zero)
    shape = (-1, *([1] * (u.dim() - 1)))
    stepped = False
    for _ in range(CHECK_STEPS):
        # a float64 power step (z = J^T J u / |J u|, already formed) for the members above tol: the float32
        # vector's error is first order in the certificate, second order in the value
        if bool(met.all()):
            break
        u = torch.where(met.reshape(shape), u, z / norms(z))
        stepped = True
        step = _rayleigh(jac, u)
        value, rho, err, z = (torch.where(met.reshape(shape) if old.dim() > 1 else met, old, new)
                              for old, new in zip((value, rho, err, z), step))
        met = _meets(err, value, tol, jac.zero)
    vectors = [m[1] for m in members]
    if stepped:
        # the vector returned is the stepped one in the input's dtype, and value, error and residual are certified
        # at exactly that vector (two more products): they describe what the estimate holds
        low = u.to(vectors[0].dtype)
        u = low.to(torch.float64)
        value, rho, err, _ = _rayleigh(jac, u / norms(u))
        met = _meets(err, value, tol, jac.zero)
        vectors = [_canonical_sign(low[i].to(v.device)) for i, v in enumerate(vectors)]
    out = []
    for i, (_, _, _, _, ok, stalled) in enumerate(members):
        c = float(jac.scale[i])
        v = float(value[i]) * c
        out.append((v, vectors[i], float(err[i]) * c, float(rho[i]) * c * v, bool(met[i]),
                    stalled or (ok and not met[i])))
    return out


def _float64_twin(prob):
    """(fn, X, s_in, s_out) of the problem in float64 (the same inputs and parameters, exactly widened), or None:
    a float64 input, or an operator that does not convert (a bare callable keeps the certificate of its own
    products). A float32 solve is certified with it (:func:`_checked_in_float64`); a float16 or bfloat16 problem
    is solved in it: half-precision products are too coarse to find the top of the spectrum (a bfloat16 Lanczos
    certified the second singular value, 27.8, of a Jacobian whose top one is 93.9: with rounding of 4e-3 the
    Krylov space did not see it), and its vector, returned in the input's dtype, is certified at exactly it."""
    if prob.higher is None:
        return None
    try:
        return prob.higher()
    except (ValueError, ArithmeticError, RuntimeError, NotImplementedError):
        return None


# ---------------------------------------------------------------------- public API
def local_lipschitz(f, X, method="lanczos", tol=None, *, max_iter=None, seed=0, on_failure="raise",
                    memory_limit=None, mixed=None, attention="auto") -> LipschitzEstimate:
    """Local Lipschitz constant Lip_X(f) = ||D_X f||_2 (docs/math.md section 4), certified.

    Parameters
    ----------
    f : anything :func:`meanfield.as_operator` accepts
        An operator of :mod:`meanfield.attention`, a Hugging Face attention layer, a callable on
        tensors (n, d) -> (n, d'), ...
    X : torch.Tensor, numpy.ndarray or particles.Measure
        A sequence (n, d), a batch (b, n, d), or a measure; arrays are taken as the operator's
        :meth:`~meanfield.operator.AttentionOperator.sequence` takes them (a floating dtype must be the
        operator's). Tensors use the Euclidean (Frobenius)
        norm; a measure uses the W2 sense of Lemma C.5, ||D^{1/2} J D^{-1/2}||_2 with its weights
        (and positions, for masked operators) held fixed. That constant depends on how the measure is written:
        splitting an atom (``mu.split(i)``, the same measure) moves its atoms apart independently and can raise
        it (docs/math.md sections 2.3 and 4.7; the mass-splitting study); each is a valid lower bound on the
        constant of F on measures. A batch is solved in one run with batched
        operator applications (an arbitrary callable, which may not batch, is looped over the
        sequences) and gives one batched estimate.
    method : str
        "lanczos" (default), "power" (Appendix E.1) or "dense".
    tol : float or None
        Relative accuracy: stop when error <= tol * value. None: :data:`TOL` for the input's dtype
        (1e-6 in float64, 1e-3 in float32). A tol below the dtype's machine epsilon, or of 1 or more, is a
        ValueError.
        For a float32 operator and input, where the operator can be converted to float64 (the framework's
        operators, ``op.to(torch.float64)``; not a bare callable), the solve's vector is certified again by
        float64 products of the same numbers (docs/math.md section 4.4): the value, error and ``converged`` are
        those of the map itself, not of its rounding in the input's dtype; a float16 or bfloat16 input of such an
        operator is solved with float64 products (half-precision products are too coarse to find the top of the
        spectrum), its vector returned in the input's dtype and certified at exactly it.
    max_iter : int or None
        Iteration budget (lanczos: Krylov dimension; power: iterations); default :data:`MAX_ITER`.
    seed : int, None or torch.Generator
        Seed of the random start (None: torch's global generator). A Generator gives one integer seed, drawn from it
        (and advancing it), so that every phase of the call (float32, then float64) starts from the same vector.
    on_failure : str
        "raise" (a :class:`ConvergenceError` carrying the estimate) or "warn" (return the estimate
        with ``converged=False`` and emit a RuntimeWarning).
    memory_limit : int, str or None
        Bytes (or a size such as "16G") the dense Jacobian or the Krylov basis may take; default
        ``$SMOOTH_ATTENTION_MEMORY_LIMIT`` or 8 GiB. Above it a
        :class:`~particles.validation.MemoryLimitError` is raised before allocating.
    mixed : bool or None
        Whether Lanczos may run its first phase on float32 products (about twice as fast on CPU)
        for a float64 input. The float32 phase only proposes a vector; its value, error and
        ``converged`` come from float64 products, and a float64 Lanczos continues from it when that
        certificate misses ``tol``. None uses it for operators that convert to float32
        (``op.to(dtype=torch.float32)``) with at least :data:`MIXED_MIN_SIZE` entries per batch
        member; True for every such operator; False never. Hugging Face layers (``HFAttention``) never take it
        (``mixed_precision = False``: unmeasured on them). The series (``attention``) runs no mixed precision:
        True with ``attention="series"`` is an error, and with "auto" keeps the exact path.
    attention : str
        How the products evaluate attention: "auto" (default), "exact" or "series". "exact":
        :func:`meanfield.kernels.attend`'s default path (exact to rounding). "series": the truncated exponential
        series (:mod:`meanfield.series_attention`), O(N M) per product instead of O(N^2) and O(N) memory, for an
        unmasked :class:`~meanfield.SelfAttention` whose centred scores stay in r = max ``|q|`` max ``|k - k0|`` <=
        :data:`meanfield.series_jacobian.MAX_RADIUS` (particles in a ball: tokens in d = 2 or 3 at radius about
        1-2). The solvers certify the series' Jacobian, and a proved bound eps_J on its distance to the exact
        Jacobian (Weyl's inequality, :func:`meanfield.series_jacobian.truncation_bound`, 1e-15 to 1e-12 of the
        operator's scale; docs/math.md section 4.8) carries the certificate over: ``value`` drops by eps_J and
        ``error`` grows by 2 eps_J, so that ``value`` stays a lower bound of the exact constant. Lanczos or power
        only (dense builds the exact Jacobian), no mixed precision. "auto": the series where
        :func:`meanfield.series_jacobian.auto_degree` says its products cost at most half the exact path's
        (float64 measures or sequences of more than 2^22 score entries: N above about 2050), "exact" otherwise; a
        member whose ``tol`` the series' truncation bound (2 eps_J of its error) keeps out of reach is certified
        again on the exact path.

    Returns
    -------
    LipschitzEstimate
        Of one input, or of a batch (indexable, iterable; see :class:`LipschitzEstimate`).

    A solve that runs longer than a few seconds says where it is (Jacobian products made, the estimate and its
    relative error) in INFO lines of the logger ``meanfield.krylov``, every 5 s:
    ``logging.basicConfig(level=logging.INFO)`` shows them.

    Raises
    ------
    ConvergenceError
        When the certificate did not meet ``tol`` within the budget, or stalled above it (with
        ``on_failure="raise"``); its ``estimate`` holds the certified lower bound reached.
    OverflowError
        A product overflows the dtype's range, or the Jacobian is below it (``|J u|`` = 0 for a random
        start while J is not zero). A zero value is returned only for a Jacobian that is exactly zero.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if tol is not None:
        check_positive_float(tol, "tol")
    check_on_failure(on_failure)
    max_iter = check_positive_int(MAX_ITER[method] if max_iter is None else max_iter, "max_iter")
    seed = check_seed(seed)
    if isinstance(seed, torch.Generator):   # one integer for every phase (the solvers derive their streams from it)
        seed = int(torch.randint(SEED_LIMIT, (), generator=seed, device=seed.device))
    memory_limit_bytes(memory_limit)  # a malformed limit is an error whatever the method
    if mixed is not None and not isinstance(mixed, bool):
        raise TypeError(f"mixed: expected None, True or False, got {mixed!r}")
    if attention not in ("auto", "exact", "series"):
        raise ValueError(f"attention: expected 'auto', 'exact' or 'series', got {attention!r}")
    if attention == "series" and method == "dense":
        raise ValueError("attention: 'series' runs with the matrix-free solvers (method='lanczos' or 'power'); "
                         "method='dense' builds the exact Jacobian")
    if attention == "series" and mixed is True:
        raise ValueError("mixed: the series' products run in the input's float64 (its degree is set for float64's "
                         "epsilon), with no float32 phase; use mixed=None or False, or attention='exact'")

    op, problems, batched = make_problems(f, X)
    if attention == "series":
        why = series_jacobian.supports(op)
        if why is not None:
            raise ValueError(f"attention: {why}")
    tol = _check_tol(tol, problems[0].X.dtype)
    solve = SOLVERS[method]
    members, applications, iterations, paths = [], 0, 0, set()
    floors = []   # per member: 2 eps_J where the series carried its certificate over (0 on the exact path)
    with ThreadPolicy() as policy:
        for k, prob in enumerate(problems):
            lw = X.log_weights if isinstance(X, Measure) else None
            K = None   # the series' degree where the products take it
            if attention == "series":
                K = series_jacobian.degree(op, prob.X, lw)
            elif attention == "auto" and method != "dense" and mixed is not True:
                K = series_jacobian.auto_degree(op, prob.X, lw)
            series = K is not None
            with contextlib.ExitStack() as context:
                if series:
                    context.enter_context(kernels.use("series"))
                    context.enter_context(series_attention.pinned(K))
                found, used, its = _solve(prob, k == 0, policy, solve, tol, max_iter, seed, method, memory_limit,
                                          False if series else mixed, series)
            floor = [0.0] * len(found)
            if series:
                eps = series_jacobian.truncation_bound(op, prob.X, lw, K=K)
                found = _carried_over(found, eps, tol)
                floor = [2 * e for e in eps.tolist()]
                if attention == "auto" and any(not m[4] and f >= tol * m[0] / 2 for m, f in zip(found, floor)):
                    # a tol within reach of the series' truncation bound (2 eps_J of the error, 1e-15 to 1e-12 of
                    # the operator's scale): auto certifies on the exact path instead
                    applications += used
                    found, used, its = _solve(prob, k == 0, policy, solve, tol, max_iter, seed, method,
                                              memory_limit, mixed, False)
                    floor = [0.0] * len(found)
                    series = False
            paths.add("series" if series else "exact")
            members += found
            floors += floor
            applications += used
            iterations = max(iterations, its)
    if isinstance(X, Measure):
        members = _without_absent_atoms(members, X.log_weights)
    est = _assemble(members, method, iterations, applications, batched,
                    paths.pop() if len(paths) == 1 else "mixed")
    if log.isEnabledFor(logging.DEBUG):
        X0 = problems[0].X
        log.debug("local_lipschitz: %s, %d input(s) of shape %s %s, %s %d iterations, %d Jacobian products, "
                  "value %s, error %s, converged %s, %d thread(s)", type(op).__name__, len(problems),
                  tuple(X0.shape), str(X0.dtype).replace("torch.", ""), method, iterations, applications,
                  _short(est.value), _short(est.error), _short(est.converged), policy.threads)
    failed = [(m, f) for m, f in zip(members, floors) if not m[4]]
    if failed:
        worst, truncation = max(failed, key=lambda mf: mf[0][2] / max(mf[0][0], 1e-300))
        rel = worst[2] / max(worst[0], 1e-300)
        dtype = problems[0].X.dtype
        if truncation >= tol * worst[0] / 2:
            why = (f"did not reach tol={tol:g} (relative error bound {rel:.3g}, value {worst[0]:.6g}): "
                   f"{truncation / max(worst[0], 1e-300):.3g} of it is the series' truncation bound (2 eps_J, "
                   "meanfield.series_jacobian.truncation_bound), which more iterations do not lower; use "
                   f"attention='exact' or tol >= {2 * rel:.2g}")
        elif worst[5] and method == "power":
            # power iteration stalls on close top singular values (it moves by their ratio squared per iteration)
            # long before any rounding floor; far above that floor it can be nothing else
            floor = rel <= math.sqrt(ROUNDING_FLOOR * torch.finfo(dtype).eps)
            why = (f"the certificate stalled at relative error {rel:.3g} after {iterations} iterations "
                   f"(no 1% gain in {PATIENCE} iterations)"
                   + (f": the top singular values are close, which power iteration separates slowly, or the "
                      f"rounding of {dtype} products is reached; method='lanczos' certifies as far as rounding "
                      f"allows (or use tol >= {2 * rel:.2g})" if floor else
                      f", far above the rounding of {dtype} products: the top singular values are close, which "
                      "power iteration separates slowly; use method='lanczos' (or a larger tol)"))
        elif worst[5] and 2 * rel >= 0.5:
            why = (f"the certificate stalled at relative error {rel:.3g} after {iterations} iterations: {dtype} "
                   "products cannot certify this constant; use float32 or float64 inputs")
        elif worst[5]:
            why = (f"the certificate stalled at relative error {rel:.3g} after {iterations} iterations: the rounding "
                   f"of {dtype} products at this input is above tol={tol:g}; use tol >= {2 * rel:.2g}"
                   + (" or float64" if dtype != torch.float64 else ""))
        elif method == "power" and rel <= tol:
            # its certificate met tol, but the check that it is about the top singular value found a larger one
            # and the budget allowed no restart (meanfield.krylov.power)
            why = (f"met tol={tol:g} (relative error bound {rel:.3g}, value {worst[0]:.6g}), but its check "
                   f"({krylov.POWER_CHECK_STEPS} Lanczos steps) found a larger singular value and max_iter={max_iter} "
                   "left no room to go on from it (the certificate is about a lower one); raise max_iter or use "
                   "method='lanczos'")
        else:
            why = (f"did not reach tol={tol:g} in {iterations} iterations (relative error bound {rel:.3g}, value "
                   f"{worst[0]:.6g}); raise max_iter or loosen tol")
        msg = f"local_lipschitz: method {method!r} " + why
        if on_failure == "raise":
            raise ConvergenceError(msg, est)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return est


def _solve(prob, first, policy, solve, tol, max_iter, seed, method, memory_limit, mixed, forward_first=False):
    """One problem's solve: (per-member estimates, Jacobian products, iterations); ``forward_first``: J u in forward
    mode from the start (:class:`~meanfield.jacobian.Jacobian`)."""
    applications = 0
    wide = _float64_twin(prob)
    half = wide is not None and prob.X.dtype in (torch.float16, torch.bfloat16)
    # the first evaluation of f (recorded for the products) is the policy's probe
    with timed_probe(policy if first else None):
        jac = Jacobian(*(wide if half else (prob.fn, prob.X, prob.s_in, prob.s_out)), memory_limit,
                       forward_first=forward_first)
    jac.on_product = policy.tick
    low = prob.lower
    if low is not None and (prob.X.dtype != torch.float64 or mixed is False
                            or (mixed is None and prob.X[0].numel() < MIXED_MIN_SIZE)):
        low = None
    result = solve(jac, tol, max_iter, seed, memory_limit, low)
    found = _estimates(result, jac, method)
    if wide is not None:
        if half:   # solved in float64: the vectors in the input's dtype, certified at exactly them
            found = [(v, u.to(prob.X.dtype), *rest) for v, u, *rest in found]
        check = jac if half else Jacobian(*wide, memory_limit, forward_first=forward_first)
        found = _checked_in_float64(found, check, tol)
        if check is not jac:
            applications += check.applications
    return found, applications + jac.applications, int(result.iterations)


def _carried_over(found, eps, tol):
    """Per-member estimates of the series' Jacobian J~ carried over to the exact J (Weyl: every singular value moves
    by at most eps_J = ``||J~ - J||``, :func:`meanfield.series_jacobian.truncation_bound`): value - eps_J (still a
    lower bound), error + 2 eps_J (the upper end moves by eps_J too), converged recomputed against tol."""
    out = []
    for (val, u, err, res, ok, stalled), e in zip(found, eps.tolist()):
        val, err = max(val - e, 0.0), err + 2 * e
        out.append((val, u, err, res, bool(ok and err <= tol * val), stalled))
    return out


def _short(x) -> str:
    """A value, or a batch's range, for a log line."""
    if isinstance(x, torch.Tensor) and x.numel() > 1:
        if x.dtype == torch.bool:
            return f"{int(x.sum())} of {x.numel()}"
        return f"[{x.min().item():.6g} .. {x.max().item():.6g}]"
    return f"{float(x):.6g}" if not isinstance(x, bool) else str(x)


def _without_absent_atoms(members, log_weights):
    """The members with the vector's rows of zero-mass atoms set to 0 (renormalized): those atoms are not in the
    measure and the weighted Jacobian ignores them, but the solver's random start leaves rounding-level entries
    there, which the point perturbation u / sqrt(a) turns into infinities. |J u| is unchanged (their columns of
    D^{1/2} J D^{-1/2} are 0) and the norm falls by their square, so the value stays a lower bound."""
    absent = ~torch.isfinite(log_weights.detach())
    if not bool(absent.any()):
        return members
    absent = absent.reshape(-1, absent.shape[-1])
    out = []
    for i, (val, vec, *rest) in enumerate(members):
        rows = absent[min(i, absent.shape[0] - 1)].to(vec.device)
        kept = torch.where(rows[:, None], torch.zeros_like(vec), vec)
        norm = kept.norm()
        out.append((val, kept / norm if float(norm) > 0 else kept, *rest))
    return out


def _assemble(members, method, iterations, applications, batched, attention="exact") -> LipschitzEstimate:
    if not batched:
        val, vec, err, res, ok, stalled = members[0]
        return LipschitzEstimate(value=val, vector=vec, error=err, iterations=iterations, method=method,
                                 converged=ok, applications=applications, residual=res, stalled=stalled and not ok,
                                 attention=attention)
    col = lambda k, dtype=torch.float64: torch.tensor([m[k] for m in members], dtype=dtype)
    return LipschitzEstimate(
        value=col(0), vector=torch.stack([m[1] for m in members]), error=col(2), iterations=iterations,
        method=method, converged=col(4, torch.bool), applications=applications, residual=col(3),
        stalled=col(5, torch.bool) & ~col(4, torch.bool), batched=True, attention=attention)


def lipschitz_ratio(op, mu, nu, *, method: str = "exact", **options) -> float:
    """W2(F mu, F nu) / W2(mu, nu), with conditional W2 (Definition 4.1) for masked operators.

    ``op`` is anything :func:`meanfield.as_operator` accepts (a meanfield operator, a Hugging Face
    attention layer, ...; a bare callable only on uniform, unpositioned measures). As nu -> mu the
    ratio tends to at most the local constant of F at mu (docs/math.md section 4). An unmasked operator
    ignores positions, and so does its ratio: measures with positions (``Measure.sequence``) are then compared
    by plain W2 of their points, which may move mass across positions (a UserWarning says so, once per measure:
    pass ``mu.unmasked()`` to mean it); a masked operator
    (``masked=True``) takes conditional W2. Measures of a half
    precision (an operator in float16 or bfloat16) are widened to float32, exactly, for the distances:
    transport works in float32 or float64.

    ``method`` and ``options``: how both distances are computed. Unmasked: :func:`transport.w2`'s ``method``
    ("exact" by default, the network simplex, dense: N M costs, for N up to a few thousand) and its options
    (``reg``, ``tol``, ``memory_limit``, ...). ``method="streaming"`` (or "auto" above its exact size) takes the
    debiased Sinkhorn distance sqrt(S_eps), O(N) memory: it approximates W2 only where ``reg`` is small against
    the squared displacement between the measures (S_eps sees nothing finer than its blur sqrt(reg / 2)), so the
    ratio of a perturbation smaller than the blur is not the W2 ratio; halve ``reg`` to see the ratio settle. Masked:
    :func:`transport.conditional_w2`, exact slice by slice (``method`` "exact" only), with its options (``atol``,
    ``mass_atol``, ``memory_limit``). An option the distance does not take is a TypeError naming it.

    Where W2(mu, nu) is below sqrt(eps) times the points' largest coordinate (eps of the measures' dtype), a
    RuntimeWarning says that the ratio carries the rounding of the two pushforwards (a share of about eps x scale /
    W2 of it): a ratio at a displacement of a few roundings is noise.
    """
    if not isinstance(method, str):
        raise TypeError(f"method: expected a transport method name such as 'exact' or 'streaming', got {method!r}")
    op = as_operator(op)
    points = f"the ratio compares measures: {WRAP_POINTS}"
    mu = op.check_measure(mu, "mu", tensors=points)
    nu = op.check_measure(nu, "nu", tensors=points)
    if not op.masked and not op.points_only:
        # positions an unmasked operator does not read (check_measure has said so, once per measure): dropped here,
        # so that op(mu) and op(nu) below do not say it again
        mu, nu = (m.unmasked() if m.positions is not None else m for m in (mu, nu))
    # imported here: transport loads POT (~0.8 s), which nothing else in this module needs
    from transport import conditional_w2, w2

    for name in ("squared", "return_plan"):
        if name in options:   # the ratio is of distances, and a number
            raise TypeError(f"{name}: lipschitz_ratio is a ratio of W2 distances (a number); it takes no {name}")
    if op.masked:
        if method != "exact":
            raise ValueError(f"method: a masked operator's ratio takes conditional W2, computed exactly slice by slice "
                             f"(method='exact'); got {method!r}")
        unknown = sorted(set(options) - {"atol", "mass_atol", "memory_limit"})
        if unknown:
            raise TypeError(f"{unknown[0]}: not an option of conditional_w2 (the distance of a masked operator's "
                            "ratio): it takes atol, mass_atol and memory_limit")

    def dist(a, b):
        if a.dtype in (torch.float16, torch.bfloat16):
            a, b = a.to(dtype=torch.float32), b.to(dtype=torch.float32)
        # an unmasked operator ignores positions: so does its distance (w2 of the laws on R^d)
        if op.masked:
            return conditional_w2(a, b, **options)
        return w2(a.unmasked(), b.unmasked(), method, **options)

    den = dist(mu, nu)
    if den == 0:
        raise ValueError("mu, nu: W2(mu, nu) = 0 (the same measure); the ratio is undefined")
    if math.isinf(den):
        raise ValueError("mu, nu: conditional W2 is infinite (position marginals differ); the ratio is undefined")
    _warn_if_rounding(mu, nu, float(den))
    return float(dist(op(mu), op(nu))) / float(den)


def _warn_if_rounding(mu, nu, den: float) -> None:
    """A RuntimeWarning where W2(mu, nu) is below sqrt(eps) times the points' scale: the numerator of the ratio, a
    distance between two computed pushforwards, then carries their rounding, a share of about eps x scale / W2 of
    the ratio, and more where the scores are large (a review: 0.5646 at a relative displacement of 1e-9, 0.567 at
    1e-14, 0.960 at 1e-16 in float64). The usual finite-difference step, sqrt(eps) x scale, stays clear of it."""
    eps = torch.finfo(mu.dtype).eps
    scale = max((float(m.points.detach().abs().max()) for m in (mu, nu) if m.points.numel()), default=0.0)
    if not math.isfinite(scale) or den >= math.sqrt(eps) * scale:
        return
    warnings.warn(f"lipschitz_ratio: W2(mu, nu) = {den:.3g} is {den / (eps * scale):.3g} roundings of the points' "
                  f"scale {scale:.3g} in {str(mu.dtype).replace('torch.', '')}: the numerator, a distance between two "
                  f"computed pushforwards, carries their rounding, about {eps * scale / den:.2g} of the ratio (more "
                  f"where the scores are large). Move nu at least sqrt(eps) x scale = {math.sqrt(eps) * scale:.2g} "
                  "away in W2, or use float64", RuntimeWarning, stacklevel=3)
