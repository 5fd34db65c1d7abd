"""Worst-case inputs of attention: a certified bracket on its Lipschitz constant on a ball.

The paper's question is the Lipschitz constant of attention on inputs of bounded radius,

    Lip(f on B_R^n) = sup over X in B_R^n of Lip_X(f)        (docs/math.md section 1),

the supremum of the local constants over sequences whose every token lies in the closed ball of
radius R; for measures, the W2 (conditional W2 when masked) constant of F on measures supported in
B_R, with local constants in the sense of Lemma C.5 (section 4.5) and atoms allowed to split
(section 4.7). Formulas bracket it: Theorems 3.3 / 3.5 (and Lemma 3.8, Kim et al.) above,
Proposition 3.4's witness below (section 5). This module searches for inputs that maximize the
local constant and returns

* the best input found and its certified constant (:func:`meanfield.local_lipschitz`): a certified
  **lower** bound on the Lipschitz constant on the ball (any input of the ball gives one);
* the best **upper** bound the framework knows (:func:`meanfield.bounds.operator_upper`);
* their ratio, the search trace, the Jacobian products spent, the wall time, and why it stopped.

Search: projected ascent on sigma(X) = Lip_X(f) with the gradient of the top singular value
(:mod:`meanfield.sigma_gradient`, d sigma = <u, dJ v>), per-token radial projection onto the ball,
and a step rule that never accepts a decrease of the certified value (backtracking: a rejected trial
shrinks the step). Directions are L-BFGS directions built from the projected gradients (the
gradient itself where no curvature is usable), tokens that coincide in a start move together
until that tied ascent stops, a stationary point is left by a few random kicks (kept only if they
raise the value), and successive halving gives most of the budget to the best starts. Starts:
Proposition 3.4's witness in both eigen-cases and the large-radius hub configurations of every
head's score matrix (:mod:`meanfield.adversarial`), one token at 0 with the others spread
(Appendix C.7), random tokens on the sphere of radius R and clustered random tokens; sequences are
evaluated in batches over starts (one batched Lanczos run per step).

:func:`plain_gradient_ascent` is the baseline the paper reports as giving poor results: fixed
steps along the gradient from random starts, no line search, with the same budget.

Entry points: :func:`worst_case_sequence`, :func:`worst_case_measure`, :func:`plain_gradient_ascent`;
the starts alone: :func:`sequence_starts`, :func:`measure_starts`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from particles import Measure
from particles.validation import (
    MemoryLimitError,
    check_bool,
    check_positive_float,
    check_positive_int,
    check_radius,
    check_seed,
    make_generator,
)

from . import adversarial
from .bounds import UpperBound, _heads_of, _real_unit_eigenvector, operator_upper
from .lipschitz import ConvergenceError, LipschitzEstimate, local_lipschitz
from .operator import as_operator, sequence_positions
from .sigma_gradient import sigma_gradient
from .splitting import query_jacobians, query_term_gradient, split_measure

__all__ = ["StartRecord", "TracePoint", "WorstCaseResult", "measure_starts", "plain_gradient_ascent",
           "sequence_starts", "worst_case_measure", "worst_case_sequence"]

#: Jacobian products a gradient pass is counted as (one JVP, one VJP through it)
GRADIENT_PRODUCTS = 2


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class StartRecord:
    """One start of the search: its ``name``, the certified value at the start (``initial``, after
    projection onto the ball) and at its last accepted iterate (``final``), accepted ``steps``, and
    why it stopped: ``"stationary"`` (projected-gradient test), ``"stalled"`` (no increase found
    down to the smallest step, or a relative gain below 1e-6 over 20 iterations: the ascent crawls,
    typically along a ridge where the top singular value is multiple), ``"budget"``,
    ``"max_steps"``, ``"pruned"`` (dropped to spend the budget on better starts) or ``"overflow"``
    (the constant or its gradient left the dtype's range there; failed trials are only rejected)."""

    name: str
    initial: float
    final: float
    steps: int
    stopped: str


@dataclass(frozen=True)
class TracePoint:
    """The search after one iteration: ``products`` and ``seconds`` spent so far, ``best`` value so
    far, and the number of starts still ``active``."""

    iteration: int
    products: int
    seconds: float
    best: float
    active: int


@dataclass(frozen=True)
class WorstCaseResult:
    """A certified bracket on the Lipschitz constant of an attention operator on a ball.

    Attributes
    ----------
    input : tensor (n, d) or Measure
        The best input found; every token (atom) lies in B_R up to rounding. For a measure whose
        constant is raised by splitting, the representation with the split atom (section 4.7).
    estimate : LipschitzEstimate
        Its certified local constant (:func:`meanfield.local_lipschitz`): ``lower`` = its value is a
        certified lower bound on Lip(f on B_R^n) (measures: on the W2 constant of F on P(B_R)).
    upper : UpperBound
        The best upper bound the framework knows (:func:`meanfield.bounds.operator_upper`).
    R, n : float, int
        The radius and the number of tokens (atoms for measures).
    start : str
        Name of the start the best input was reached from.
    starts : tuple
        One :class:`StartRecord` per start.
    trace : tuple
        One :class:`TracePoint` per iteration.
    products : int
        Jacobian products spent (each J u and each J^T w on one sequence counts one; a gradient pass
        counts :data:`GRADIENT_PRODUCTS`).
    seconds : float
        Wall time.
    stopped : str
        ``"budget"`` (products ran out with starts still ascending), ``"max_steps"``, or
        ``"converged"`` (every start stopped on the stationarity test, stalled, or was pruned).
    method : str
        ``"projected ascent"`` or ``"plain gradient ascent"``.
    search_value : float
        The value the search maximized at ``input`` (for split measures the closed form
        of section 4.7, otherwise ``estimate.value``).
    split : bool
        Whether ``input`` is a split representation.
    """

    input: object
    estimate: LipschitzEstimate
    upper: UpperBound
    R: float
    n: int
    start: str
    starts: tuple
    trace: tuple
    products: int
    seconds: float
    stopped: str
    method: str
    search_value: float
    split: bool = False
    options: dict = field(default_factory=dict)

    @property
    def lower(self) -> float:
        """Certified lower bound on the Lipschitz constant on the ball (the estimate's value)."""
        return self.estimate.value

    @property
    def error(self) -> float:
        """The estimate's error bound (docs/math.md section 4.4)."""
        return self.estimate.error

    @property
    def log_ratio(self) -> float | None:
        """log(lower / upper), or None when no upper bound is known."""
        if not self.upper.known:
            return None
        if self.lower == 0:
            return -math.inf
        return math.log(self.lower) - self.upper.log_value

    @property
    def ratio(self) -> float | None:
        """lower / upper (at most 1 when both are right), or None when no upper bound is known."""
        lr = self.log_ratio
        return None if lr is None else math.exp(lr) if lr > -745 else 0.0

    @property
    def converged(self) -> bool:
        """Whether the search stopped on its own tests rather than on its budget or step cap."""
        return self.stopped == "converged"

    def start_record(self, name: str) -> StartRecord:
        """The record of the start called ``name``."""
        for s in self.starts:
            if s.name == name:
                return s
        raise KeyError(f"name: no start called {name!r} (starts: {[s.name for s in self.starts]})")

    def _upper_text(self) -> str:
        if not self.upper.known:
            return "unknown"
        if self.upper.value < math.inf:
            return f"{self.upper.value:.6g}"
        return f"exp({self.upper.log_value:.6g})"

    def __repr__(self) -> str:
        # the full record (inputs, starts, trace) is in the attributes; the repr is the bracket
        return (f"WorstCaseResult(lower={self.lower:.6g} +/- {self.error:.2g}, upper={self._upper_text()}, "
                f"R={self.R:g}, n={self.n}, start={self.start!r}, products={self.products}, stopped={self.stopped!r})")

    def summary(self) -> str:
        """One paragraph: the bracket, the ratio, where it came from, what it cost."""
        up = self._upper_text()
        if self.ratio is None:
            ratio = ""
        elif self.ratio > 0:
            ratio = f", ratio {self.ratio:.3g}"
        else:
            ratio = f", ratio exp({self.log_ratio:.6g})"
        what = "atoms" if isinstance(self.input, Measure) else "tokens"
        return (f"{self.method}, n = {self.n} {what}, R = {self.R:g}: {self.lower:.6g} (+/- {self.error:.2g}) "
                f"<= Lip <= {up} [{self.upper.source}]{ratio}; best from start {self.start!r}; "
                f"{self.products} Jacobian products, {self.seconds:.2f} s, stopped: {self.stopped}")


# ---------------------------------------------------------------------- starts
def _score_matrices(op) -> list[tuple[str, np.ndarray]]:
    """(label, A) of every head: the bilinear part of the scores, A x_i . x_j."""
    from .attention import L2SelfAttention
    from .hf import HFAttention

    if isinstance(op, L2SelfAttention):
        # -|q_i - q_j|^2 / sqrt(k) = 2 <q_i, q_j> / sqrt(k) + terms in i alone or j alone
        WQ = op.W_Q.detach().to(torch.float64).cpu().numpy()
        k = WQ.shape[2]
        mats = [2.0 * w @ w.T / math.sqrt(k) for w in WQ]
    elif isinstance(op, HFAttention) and op.kind != "bert_self":
        # the whole block too: its attention's score matrices are the layer's (LayerNorm aside)
        p = op.parameters()
        mats = [p.A(h).detach().to(torch.float64).cpu().numpy() for h in range(p.num_heads)]
    else:
        heads, _, _ = _heads_of(op)
        mats = [] if heads is None else [h[0] for h in heads]
    if len(mats) == 1:
        return [("", mats[0])]
    return [(f"[head {h}]", a) for h, a in enumerate(mats)]


def _prop34_pair(u, case, R):
    """(first token, the others) of Proposition 3.4's witness for eigenvector u (section 5.3)."""
    return (R * u, R * u / 2.0) if case == "max" else (-R * u, R * u)


def _witness_cases(A, R):
    """[(case, gamma_case, u)] for both eigen-cases of Proposition 3.4 that exist (lambda_max > 0:
    gamma_case = lambda_max / 8; lambda_min < 0: gamma_case = -lambda_min), the case of gamma(A)
    first, u its unit real eigenvector as :func:`meanfield.bounds.gamma_info` gives it.

    One eigen-decomposition serves both cases (for a real layer's d x d heads it is the expensive
    part of building the starts)."""
    a = np.asarray(A, dtype=np.float64)
    evals, evecs = np.linalg.eig(a)
    real = np.abs(evals.imag) <= 1e-10 * (1.0 + np.abs(evals))
    if not real.any():  # Proposition 3.4 gives no witness
        return []
    lam, vecs = evals.real[real], evecs[:, real]
    i_max, i_min = int(np.argmax(lam)), int(np.argmin(lam))
    cases = [("max", lam[i_max] / 8.0, i_max), ("min", -lam[i_min], i_min)]
    if cases[0][1] < cases[1][1]:  # gamma_info's tie-break: "max" when lambda_max / 8 >= -lambda_min
        cases.reverse()
    return [(case, float(g), _real_unit_eigenvector(a, float(lam[i]), vecs[:, i])) for case, g, i in cases if g > 0]


def _sphere(shape, R, g, dtype):
    Z = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (R * Z / Z.norm(dim=-1, keepdim=True)).to(dtype)


def _dims(op, d):
    if op.d_in is not None:
        if d is not None and d != op.d_in:
            raise ValueError(f"d: {d} differs from the operator's input dimension {op.d_in}")
        return op.d_in
    if d is None:
        raise ValueError(f"d: the token dimension is required for {op!r}, which does not fix it")
    return check_positive_int(d, "d")


def _dtype_device(op):
    return (op.dtype or torch.float64), (op.device or torch.device("cpu"))


def sequence_starts(f, R, n, *, random=8, clusters=4, structured=True, seed=0, d=None
                    ) -> list[tuple[str, torch.Tensor]]:
    """Starting sequences (name, X (n, d)) in B_R^n for :func:`worst_case_sequence`.

    Structured (``structured=True``), for the score matrix A of every head (docs/math.md section 5):

    * ``prop3.4-max`` / ``prop3.4-min``: Proposition 3.4's witness (R u, R u/2, ..., R u/2) with
      A u = lambda_max u, and (-R u, R u, ..., R u) with A u = lambda_min u, each where that
      eigenvalue exists with the right sign; the case of gamma(A) is
      :func:`meanfield.adversarial.sqrt_n_sequence` itself;
    * ``hub``: :func:`meanfield.adversarial.large_radius_configuration` (every token attends to
      token 0; Theorems 3.7 / 4.5);
    * ``zero+spread`` (once): :func:`meanfield.adversarial.zero_plus_spread` (Appendix C.7);

    ``random`` sequences of i.i.d. tokens uniform on the sphere of radius R (``random-k``), and
    ``clusters`` clustered ones (``cluster-k``): one or two single tokens at random places and n-1 or
    n-2 copies of a third, all uniform on the sphere (the worst cases found are often of this form:
    a few tokens and a cluster). Operators without readable score matrices (bare callables) get
    the random, clustered and zero-plus-spread starts only.
    """
    op = as_operator(f)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    random = check_positive_int(random, "random", minimum=0)
    clusters = check_positive_int(clusters, "clusters", minimum=0)
    structured = check_bool(structured, "structured")
    d = _dims(op, d)
    dtype, device = _dtype_device(op)
    out = []
    if structured and R > 0:
        for label, A in _score_matrices(op):
            for case, _, u in _witness_cases(A, R):
                first, rest = _prop34_pair(u, case, R)
                X = torch.as_tensor(np.vstack([first] + [rest] * (n - 1)), dtype=dtype)
                out.append((f"prop3.4-{case}{label}", X))
            try:
                out.append((f"hub{label}", adversarial.large_radius_configuration(A, n, R, masked=op.masked,
                                                                                  dtype=dtype)))
            except ValueError:  # A = 0: no hub
                pass
        if n >= 2:
            out.append(("zero+spread", adversarial.zero_plus_spread(R, n, d, dtype=dtype)))
    g = make_generator(seed)
    for k in range(random):
        out.append((f"random-{k}", _sphere((n, d), R, g, dtype)))
    for k in range(clusters if n >= 3 else 0):
        P = _sphere((3, d), R, g, dtype)
        singles = 1 + k % 2
        X = P[2].expand(n, d).clone()
        where = torch.randperm(n, generator=g)[:singles]
        X[where] = P[:singles]
        out.append((f"cluster-{k}", X))
    return [(name, X.to(device)) for name, X in out]


def measure_starts(f, R, atoms, *, positions=None, random=8, structured=True, seed=0, d=None
                   ) -> list[tuple[str, Measure]]:
    """Starting measures (name, mu) with ``atoms`` atoms in B_R for :func:`worst_case_measure`.

    Structured, for every head's score matrix A (docs/math.md section 5):

    * ``prop3.6-max`` / ``prop3.6-min``: the two-Dirac witness of Proposition 3.6 in each eigen-case,
      p delta_{x0} + (1 - p) delta_{x1} with p = exp(-2 gamma_case R^2) (the case of gamma(A) is
      :func:`meanfield.adversarial.two_dirac`), its heavy atom split into atoms - 1 equal parts;
    * ``prop3.4-max`` / ``-min``: Proposition 3.4's sequence witness with uniform weights;
    * ``hub``: the hub configuration with uniform weights;

    and ``random`` measures: atoms uniform on the sphere of radius R, weights softmax of standard
    Gaussian logits. ``positions`` (masked operators; default i/atoms) are shared by every start.
    """
    op = as_operator(f)
    R = check_radius(R, "R")
    atoms = check_positive_int(atoms, "atoms")
    random = check_positive_int(random, "random", minimum=0)
    structured = check_bool(structured, "structured")
    d = _dims(op, d)
    dtype, device = _dtype_device(op)
    pos = _positions(op, positions, atoms, dtype)
    out = []

    def measure(points, log_weights):
        pts = torch.as_tensor(np.asarray(points), dtype=dtype) if not isinstance(points, torch.Tensor) else points
        lw = torch.as_tensor(log_weights, dtype=dtype)
        lw = lw - torch.logsumexp(lw, 0)
        return Measure(pts.to(dtype), log_weights=lw, positions=pos)

    if structured and R > 0:
        for label, A in _score_matrices(op):
            for case, g_case, u in _witness_cases(A, R):
                if atoms >= 2:
                    x0, x1 = (torch.as_tensor(x, dtype=dtype) for x in _prop34_pair(u, case, R))
                    log_p = -2.0 * g_case * R * R
                    log_q = math.log(-math.expm1(log_p)) if log_p < 0 else -math.inf
                    pts = torch.stack([x0] + [x1] * (atoms - 1))
                    lw = [log_p] + [log_q - math.log(atoms - 1)] * (atoms - 1)
                    if all(math.isfinite(v) for v in lw):
                        out.append((f"prop3.6-{case}{label}", measure(pts, lw)))
                first, rest = _prop34_pair(u, case, R)
                out.append((f"prop3.4-{case}{label}", measure(np.vstack([first] + [rest] * (atoms - 1)),
                                                             [0.0] * atoms)))
            try:
                hub = adversarial.large_radius_configuration(A, atoms, R, masked=op.masked, dtype=dtype)
                out.append((f"hub{label}", measure(hub, [0.0] * atoms)))
            except ValueError:
                pass
    g = make_generator(seed)
    for k in range(random):
        pts = _sphere((atoms, d), R, g, dtype)
        logits = torch.randn(atoms, generator=g, dtype=torch.float64)
        out.append((f"random-{k}", measure(pts, logits)))
    return [(name, mu.to(device=device)) for name, mu in out]


def _positions(op, positions, atoms, dtype):
    if positions is None:
        return sequence_positions(atoms, torch.zeros(0, dtype=dtype)) if op.masked else None
    if not op.masked:
        raise ValueError("positions: only masked operators use positions")
    pos = torch.as_tensor(positions, dtype=dtype).detach().cpu()
    if pos.shape != (atoms,):
        raise ValueError(f"positions: expected {atoms} entries (one per atom), got shape {tuple(pos.shape)}")
    return pos


# ---------------------------------------------------------------------- problems
class _Problem:
    """States Y in normalized coordinates: X / R (rows in the unit ball), plus for measures a last
    column of log-weights. ``evaluate`` gives certified values, ``gradient`` d sigma / dY."""

    def __init__(self, op, R, tol, seed, batch_size):
        self.op, self.R, self.tol, self.seed, self.batch_size = op, R, tol, seed, batch_size
        self.products = 0

    def project(self, Y):
        X = Y[..., : self.dx]
        norm = X.norm(dim=-1, keepdim=True)
        X = X * torch.where(norm > 1, 1.0 / norm, torch.ones_like(norm))
        if Y.shape[-1] == self.dx:
            return X
        z = Y[..., self.dx:]
        # masses below e^-span of the largest are raised to it: the weighted Jacobian of Lemma C.5
        # needs a^{-1/2} in floating range (local_lipschitz refuses wider spans)
        span = _LOG_SPAN[z.dtype]
        z = torch.maximum(z, z.amax(dim=-2, keepdim=True) - span)
        return torch.cat([X, z - torch.logsumexp(z, dim=-2, keepdim=True)], dim=-1)

    def projected_gradient(self, Y, G):
        """G with the outward radial part removed on tokens at the boundary (KKT of the ball)."""
        X, Gx = Y[..., : self.dx], G[..., : self.dx]
        norm = X.norm(dim=-1, keepdim=True)
        radial = (Gx * X).sum(-1, keepdim=True) / torch.where(norm > 0, norm, torch.ones_like(norm))
        on = (norm >= 1 - 1e-9) & (radial > 0)
        Gx = torch.where(on, Gx - radial * X / torch.where(norm > 0, norm, torch.ones_like(norm)), Gx)
        return torch.cat([Gx, G[..., self.dx:]], dim=-1)


#: inputs of at most this many numbers are evaluated with the dense Jacobian (fewer products than Lanczos)
DENSE_MAX = 32
#: failures of an evaluation or a gradient at an input: the trial is rejected (the constant or the
#: weights leave the dtype's range there)
_FAILURES = (OverflowError, FloatingPointError)


class _LogSpan(dict):
    def __missing__(self, dtype):
        # local_lipschitz accepts log-weight spans up to 2 (log(max) - 12); keep a margin
        return 2.0 * (math.log(torch.finfo(dtype).max) - 12.0) - 8.0


_LOG_SPAN = _LogSpan()


def _lipschitz(op, X, tol, seed):
    size = X.points.numel() if isinstance(X, Measure) else X[0].numel()
    method = "dense" if size <= DENSE_MAX else "lanczos"
    try:
        return local_lipschitz(op, X, method=method, tol=tol, seed=seed)
    except ConvergenceError as err:  # the value is still a Rayleigh quotient: a certified lower bound
        return err.estimate
    except MemoryLimitError as err:   # its advice names local_lipschitz's options, which the search does not take
        size = str(err).split("); ", 1)[0] + ")"
        batch = X.points.shape[0] if isinstance(X, Measure) else X.shape[0]
        raise MemoryLimitError(f"the worst-case search certifying {1 if isinstance(X, Measure) else batch} "
                               f"input(s) at once ({method}) {size.split(': ', 1)[-1]}; lower batch_size (starts "
                               "certified per Lanczos run, an option of worst_case_sequence and "
                               "plain_gradient_ascent), or n / atoms, or raise the limit") from err


class _Sequences(_Problem):
    tied = True

    def __init__(self, op, R, n, d, **kw):
        super().__init__(op, R, **kw)
        self.n, self.dx = n, d

    def evaluate(self, Ys):
        """[(value, aux)] for a list of states: one batched Lanczos run per chunk; (-inf, None) for a
        state where the evaluation fails (then the batch is evaluated one by one)."""
        out = []
        size = self.batch_size or len(Ys)
        for i in range(0, len(Ys), size):
            chunk = torch.stack(Ys[i:i + size]) * self.R
            try:
                ests = _lipschitz(self.op, chunk, self.tol, self.seed)
            except _FAILURES:
                if chunk.shape[0] == 1:
                    out.append((-math.inf, None))
                else:
                    out += [r for Y in Ys[i:i + size] for r in self.evaluate([Y])]
                continue
            if self.op.points_only:  # one solver run per sequence
                self.products += sum(e.applications for e in ests)
            elif ests[0].method == "dense":  # one count for the whole batch: the Jacobians' columns
                self.products += ests[0].applications
            else:  # one count per batched product: b products on single sequences
                self.products += ests[0].applications * len(ests)
            out += [(e.value, e) for e in ests]
        return out

    def gradient(self, Ys, auxs):
        """d sigma / dY per state (None where it fails)."""
        grads = []
        size = self.batch_size or len(Ys)
        for i in range(0, len(Ys), size):
            X = torch.stack(Ys[i:i + size]) * self.R
            V = torch.stack([a.vector for a in auxs[i:i + size]])
            try:
                g = sigma_gradient(self.op, X, V).points * self.R
            except _FAILURES:
                if X.shape[0] == 1:
                    grads.append(None)
                else:
                    grads += [G for Y, a in zip(Ys[i:i + size], auxs[i:i + size]) for G in self.gradient([Y], [a])]
                continue
            self.products += GRADIENT_PRODUCTS * X.shape[0]
            grads += list(g)
        return grads

    def certify(self, Y, aux):
        return Y * self.R, aux, False


class _Measures(_Problem):
    tied = False

    def __init__(self, op, R, atoms, d, positions, split, **kw):
        super().__init__(op, R, **kw)
        self.n, self.dx, self.positions, self.split = atoms, d, positions, split

    def measure(self, Y):
        return Measure._trusted(Y[:, : self.dx] * self.R, torch.exp(Y[:, -1]), Y[:, -1], self.positions)

    def evaluate(self, Ys):
        out = []
        for Y in Ys:
            mu = self.measure(Y)
            try:
                est = _lipschitz(self.op, mu, self.tol, self.seed)
                self.products += est.applications
                value, atom = est.value, None
                if self.split:
                    norms = torch.linalg.matrix_norm(query_jacobians(self.op, mu), ord=2)
                    self.products += self.dx
                    k = int(norms.argmax())
                    if not math.isfinite(float(norms[k])):
                        raise OverflowError("the query derivative overflows")
                    if float(norms[k]) > value:
                        value, atom = float(norms[k]), k
            except _FAILURES:
                out.append((-math.inf, None))
                continue
            out.append((value, (est, atom)))
        return out

    def gradient(self, Ys, auxs):
        grads = []
        for Y, (est, atom) in zip(Ys, auxs):
            mu = self.measure(Y)
            try:
                if atom is None:
                    g = sigma_gradient(self.op, mu, est.vector)
                    gx, gz = g.points, g.log_weights
                else:
                    _, gx, gz = query_term_gradient(self.op, mu, atom)
            except _FAILURES:
                grads.append(None)
                continue
            self.products += GRADIENT_PRODUCTS
            G = torch.cat([gx * self.R, gz[:, None]], dim=-1)
            grads.append(G if bool(torch.isfinite(G).all()) else None)
        return grads

    def certify(self, Y, aux):
        est, atom = aux
        mu = self.measure(Y)
        if atom is None:
            return mu, est, False
        split = split_measure(mu, [atom])
        cert = _lipschitz(self.op, split, min(self.tol, 1e-10), self.seed)
        self.products += cert.applications
        return split, cert, True


# ---------------------------------------------------------------------- the ascent
class _Member:
    """One start during the ascent: its state, value, certified pair (aux), gradient, L-BFGS memory."""

    __slots__ = ("name", "Y", "value", "aux", "initial", "eta", "G", "pg", "direction", "t", "memory", "pending",
                 "steps", "stopped", "best", "history", "lr", "kicks", "kick", "tie")

    def __init__(self, name, Y, value, aux, eta, tie=None):
        self.name, self.Y, self.value, self.aux, self.initial, self.eta = name, Y, value, aux, value, eta
        self.tie = tie  # token -> row of Y, while coinciding tokens move together
        self.G = self.pg = self.direction = self.pending = self.lr = None
        self.t, self.memory, self.steps, self.stopped = 1.0, [], 0, None
        self.best = (value, self.full(Y), aux)
        self.history = [value]
        self.kicks, self.kick = _KICKS, False

    def full(self, Y):
        return Y if self.tie is None else Y[self.tie]

    def stop(self, reason):
        """Stop, or first untie: tied tokens separate and the ascent goes on in the full space."""
        if self.tie is None or reason not in ("stationary", "stalled"):
            self.stopped = reason
            return
        self.Y, self.tie = self.Y[self.tie], None
        self.G = self.pg = self.direction = self.pending = None
        self.memory, self.t, self.kicks, self.kick, self.history = [], 1.0, _KICKS, False, [self.value]


#: a start whose value rose by less than _PROGRESS (relative) over _WINDOW iterations has stalled
_WINDOW, _PROGRESS = 20, 1e-6
#: L-BFGS memory, largest step (root mean square over tokens, in units of R), smallest step
_MEMORY, _MAX_STEP, _MIN_STEP = 10, 0.5, 1e-7
#: random kicks (root mean square _KICK, in units of R) tried at a stationary point before stopping
_KICKS, _KICK = 3, 0.05


def _rms(G):
    return float(G.pow(2).sum(-1).mean().sqrt())


def _dot(a, b):
    return float((a * b).sum())


def _lbfgs_direction(memory, pg):
    """H pg by the two-loop recursion: the quasi-Newton ascent direction for sigma (minimizing -sigma)."""
    q = pg.clone()
    alphas = []
    for s, y, rho in reversed(memory):
        a = rho * _dot(s, q)
        q = q - a * y
        alphas.append(a)
    s, y, _ = memory[-1]
    r = (_dot(s, y) / _dot(y, y)) * q
    for (s, y, rho), a in zip(memory, reversed(alphas)):
        r = r + s * (a - rho * _dot(y, r))
    return r


def _new_direction(m, gtol, rng):
    """Direction of the next trial from the projected gradient; False when the start is stationary.

    At a stationary point a few random kicks are tried first: symmetric starts (the witnesses)
    are often saddle points, where the gradient vanishes but some directions still ascend; a
    kick is a trial like any other, kept only if the certified value rises."""
    if m.pending is not None:
        # curvature pair of the accepted step: s = Y_new - Y_old, y = -(pg_new - pg_old) (for -sigma)
        s, pg_old = m.pending
        y = pg_old - m.pg
        sy = _dot(s, y)
        if sy > 1e-12 * math.sqrt(_dot(s, s) * _dot(y, y)):
            m.memory = (m.memory + [(s, y, 1.0 / sy)])[-_MEMORY:]
        m.pending = None
    size = _rms(m.pg)
    m.kick = False
    if not math.isfinite(size) or size == 0 or size <= gtol * m.value:
        if m.kicks == 0:
            return False
        m.kicks -= 1
        d = torch.randn(m.Y.shape, generator=rng, dtype=torch.float64).to(m.Y)
        m.direction, m.t, m.kick = _KICK * d / _rms(d), 1.0, True
        return True
    d = _lbfgs_direction(m.memory, m.pg) if m.memory else None
    if d is None or not bool(torch.isfinite(d).all()) or _dot(d, m.pg) <= 0:
        # no usable curvature (often negative along the path: sigma is convex there): a gradient
        # step whose length eta adapts (doubled after a success, divided by 4 after a failure)
        m.memory = []
        d = m.eta * m.pg / size
    m.direction, m.t = d, 1.0
    return True


def _tie(Y):
    """(distinct rows, token -> row) when some rows coincide exactly, else (Y, None)."""
    rows, inverse = torch.unique(Y, dim=0, return_inverse=True)
    return (Y, None) if rows.shape[0] == Y.shape[0] else (rows, inverse)


def _ascend(problem, starts, *, budget, max_steps, gtol, eta, line_search, keep, t0, seed):
    Ys = [problem.project(Y) for _, Y in starts]
    evals = problem.evaluate(Ys)
    members = []
    for (name, _), Y, (v, aux) in zip(starts, Ys, evals):
        # tokens that coincide in a start (the witnesses' copies, clustered starts) first move together:
        # at exact copies sigma has a kink (the copies may split, docs/math.md section 4.7), which slows
        # a free ascent down; the tie is released when the tied ascent stops
        rows, tie = _tie(Y) if (line_search and problem.tied) else (Y, None)
        members.append(_Member(name, rows, v, aux, eta, tie))
        if aux is None:  # the constant at this start is beyond the dtype's range
            members[-1].stopped = "overflow"
    if all(m.stopped == "overflow" for m in members):
        fix = "use float64 or a smaller radius" if Ys[0].dtype != torch.float64 else "use a smaller radius"
        raise OverflowError("R: the local constant (or the weighted Jacobian) overflows the dtype's range at every "
                            f"start; {fix}")
    trace = []
    best = lambda: max(m.best[0] for m in members)
    stopped = "converged"
    it, last_cost, halvings = 0, 0, 0
    rng = torch.Generator().manual_seed(seed)
    while True:
        active = [m for m in members if m.stopped is None]
        if not active:
            break
        if it >= max_steps:
            for m in active:
                m.stopped = "max_steps"
            stopped = "max_steps"
            break
        if problem.products + last_cost > budget:
            for m in active:
                m.stopped = "budget"
            stopped = "budget"
            break
        before = problem.products
        need = [m for m in active if m.G is None]
        if need:
            for m, G in zip(need, problem.gradient([m.full(m.Y) for m in need], [m.aux for m in need])):
                if G is None:
                    m.stopped = "overflow"
                    continue
                if m.tie is not None:  # chain rule through X = Y[tie]
                    G = torch.zeros_like(m.Y).index_add_(0, m.tie, G)
                # ascent follows the projected gradient: an outward push on tokens already on the
                # sphere would be undone by the projection and would shrink the useful step
                m.G, m.pg, m.direction = G, problem.projected_gradient(m.Y, G), None
        active = [m for m in active if m.stopped is None]
        for m in active:
            while line_search and m.stopped is None and m.direction is None and not _new_direction(m, gtol, rng):
                m.stop("stationary")
                if m.stopped is None:  # untied: its gradient in the full space is needed first
                    break
        active = [m for m in active if m.stopped is None]
        need = [m for m in active if m.G is None]
        if need:
            for m, G in zip(need, problem.gradient([m.Y for m in need], [m.aux for m in need])):
                if G is None:
                    m.stopped = "overflow"
                    continue
                m.G, m.pg, m.direction = G, problem.projected_gradient(m.Y, G), None
                if line_search and not _new_direction(m, gtol, rng):
                    m.stop("stationary")
        steps = {}
        for m in active:
            if m.stopped is not None:
                continue
            if line_search:
                step = m.t * m.direction
                size = _rms(step)
                if size > _MAX_STEP:
                    step = step * (_MAX_STEP / size)
            else:
                # plain ascent: a fixed learning rate on the raw gradient, set once per start so that
                # its first step moves the tokens by eta R (root mean square)
                if not bool(torch.isfinite(m.G).all()) or _rms(m.G) == 0:
                    m.stopped = "stationary"
                    continue
                if m.lr is None:
                    m.lr = m.eta / _rms(m.G)
                step = m.lr * m.G
            steps[id(m)] = step
        active = [m for m in active if m.stopped is None]
        if active:
            trials = [problem.project(m.Y + steps[id(m)]) for m in active]
            for m, Y, (v, aux) in zip(active, trials, problem.evaluate([m.full(Y) for m, Y in zip(active, trials)])):
                if not line_search:  # plain ascent: every step is taken (one that fails ends the start)
                    if aux is None:
                        m.stopped = "overflow"
                        continue
                    m.Y, m.value, m.aux, m.G, m.steps = Y, v, aux, None, m.steps + 1
                    if v > m.best[0]:
                        m.best = (v, Y, aux)
                elif v > m.value:  # never accept a decrease of the certified value
                    if not m.memory and not m.kick:
                        m.eta = min(2.0 * m.eta * m.t, _MAX_STEP)
                    m.pending = None if m.kick else (Y - m.Y, m.pg)
                    m.Y, m.value, m.aux, m.G, m.steps = Y, v, aux, None, m.steps + 1
                    m.best = (v, m.full(Y), aux)
                elif m.kick:
                    m.direction = None  # the next iteration kicks again, or stops as stationary
                else:
                    m.t /= 4.0
                    if _rms(m.t * m.direction) < _MIN_STEP:
                        if m.memory:  # the quasi-Newton direction failed: fall back on the gradient
                            m.memory = []
                            m.direction, m.t = m.eta * m.pg / _rms(m.pg), 1.0
                        else:
                            m.stop("stalled")
                m.history.append(m.value)
                # crawling along a ridge (where the top singular value is multiple, sigma is not
                # differentiable and the ascent zigzags): stop rather than spend the budget there
                if line_search and m.stopped is None and len(m.history) > _WINDOW and \
                        m.value - m.history[-_WINDOW - 1] <= _PROGRESS * m.value:
                    m.stop("stalled")
        it += 1
        last_cost = problem.products - before
        # successive halving: at 1/4 and 1/2 of the budget the worse half of the starts stops (never
        # fewer than ``keep`` go on), so that most of the budget goes to the best ones
        while keep is not None and halvings < 2 and problem.products >= budget / 2 ** (2 - halvings):
            halvings += 1
            ranked = sorted((m for m in members if m.stopped is None), key=lambda m: -m.best[0])
            for m in ranked[max(keep, (len(ranked) + 1) // 2):]:
                m.stopped = "pruned"
        trace.append(TracePoint(it, problem.products, time.perf_counter() - t0, best(),
                                sum(m.stopped is None for m in members)))
    return members, tuple(trace), stopped


def _int_seed(seed):
    return 0 if seed is None else int(seed.initial_seed()) if isinstance(seed, torch.Generator) else int(seed)


def _check_common(R, budget, max_steps, gtol, tol, seed, batch_size):
    R = check_radius(R, "R")
    if R == 0:
        raise ValueError("R: expected a positive radius (B_0 holds one input, there is nothing to search)")
    budget = check_positive_int(budget, "budget")
    max_steps = check_positive_int(max_steps, "max_steps", minimum=0)
    gtol = check_positive_float(gtol, "gtol", allow_zero=True)
    tol = check_positive_float(tol, "tol")
    check_seed(seed)
    if batch_size is not None:
        batch_size = check_positive_int(batch_size, "batch_size")
    return R, budget, max_steps, gtol, tol, batch_size


def _result(problem, members, trace, stopped, method, upper, t0, options):
    top = max(members, key=lambda m: m.best[0])
    value, Y, aux = top.best
    inp, est, split = problem.certify(Y, aux)
    starts = tuple(StartRecord(m.name, m.initial, m.best[0], m.steps, m.stopped) for m in members)
    return WorstCaseResult(input=inp, estimate=est, upper=upper, R=problem.R, n=problem.n, start=top.name,
                           starts=starts, trace=trace, products=problem.products,
                           seconds=time.perf_counter() - t0, stopped=stopped, method=method,
                           search_value=value, split=split, options=options)


def _named_starts(starts, kind):
    if not isinstance(starts, (list, tuple)) or not starts:
        raise ValueError(f"starts: expected a non-empty list of (name, {kind}) pairs")
    out = []
    for k, s in enumerate(starts):
        if isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], str):
            out.append(s)
        else:
            out.append((f"given-{k}", s))
    return out


# ---------------------------------------------------------------------- entry points
def worst_case_sequence(f, R, n, *, starts=None, random=8, clusters=4, structured=True, budget=20000, max_steps=200,
                        keep=4, gtol=1e-4, step=0.05, tol=1e-6, seed=0, batch_size=None,
                        d=None) -> WorstCaseResult:
    """Search sequences X in B_R^n maximizing Lip_X(f): a certified bracket on Lip(f on B_R^n).

    Parameters
    ----------
    f : anything :func:`meanfield.as_operator` accepts
        Single or multi-head attention (masked, with biases), L2 attention, a Hugging Face layer
        (:class:`meanfield.hf.HFAttention`), ``torch.nn.MultiheadAttention``, a bare callable (then
        ``d`` is required and only random starts are built).
    R : float > 0
        Radius of the ball B_R that holds every token (closed ball, Euclidean norm).
    n : int
        Number of tokens.
    starts : list, optional
        Tensors of shape (n, d), or pairs (a name, such a tensor).
        Starts to use instead of :func:`sequence_starts` (each is projected onto B_R^n first).
    random, clusters, structured : the starts of :func:`sequence_starts` (random tokens on the
        sphere of radius R; clustered random tokens; witnesses, hubs and the zero-plus-spread
        configuration). Tokens that coincide in a start move together until that tied ascent
        stops, then separately.
    budget : int
        Jacobian products to spend (each J u and J^T w on one sequence counts one, a gradient pass
        two). The search stops when the next iteration, at the cost of the last one, would exceed it.
    max_steps : int
        Iterations (each: gradients where needed, one trial step per active start).
    keep : successive halving: when 1/4 and 1/2 of the budget are spent, the worse half of the
        starts still ascending stops (``"pruned"``), never leaving fewer than ``keep``
        (``keep=None``: no pruning).
    gtol : stationarity test, ||projected gradient|| <= gtol * sigma in coordinates X / R, i.e. no
        first-order gain above a fraction gtol for moves of the tokens of size R.
    step : initial step: tokens move by ``step * R`` (root mean square over tokens) along the
        gradient; doubled after an accepted step (up to R / 2), divided by 4 after a rejected one.
    tol, seed : of :func:`meanfield.local_lipschitz` for every certified value.
    batch_size : starts per batched Lanczos run (default: all; lower it to bound memory).
    d : token dimension, for operators that do not fix it.

    Returns
    -------
    WorstCaseResult
        ``lower`` (certified, at ``input``) <= Lip(f on B_R^n) <= ``upper.value``, their ``ratio``,
        the ``starts`` with their initial and final values, the ``trace``, ``products``, ``seconds``
        and ``stopped``.

    Notes
    -----
    The ascent (docs/math.md section 4): the gradient of sigma at the certified pair is
    <u, dJ v> (:func:`meanfield.sigma_gradient.sigma_gradient`); a trial X' = P(X + t G / rms(G)),
    with P the per-token radial projection ``x -> x min(1, R / |x|)``, is accepted only if its certified
    value exceeds the current one, so a start never ends below where it began and the result is at
    least every start's certified value. Any input of the ball gives a lower bound, whatever the
    convergence. The upper bound is :func:`meanfield.bounds.operator_upper` (section 5).

    Examples
    --------
    >>> import torch
    >>> from meanfield import SelfAttention, worst_case_sequence
    >>> A = torch.tensor([[1.0, 0.3], [0.0, -0.5]], dtype=torch.float64)
    >>> res = worst_case_sequence(SelfAttention(A, torch.eye(2, dtype=torch.float64)), R=2.0, n=4,
    ...                           random=2, budget=1000)
    >>> res.lower >= res.start_record("prop3.4-max").initial, res.lower <= res.upper.value
    (True, True)
    """
    op = as_operator(f)
    n = check_positive_int(n, "n")
    R, budget, max_steps, gtol, tol, batch_size = _check_common(R, budget, max_steps, gtol, tol, seed, batch_size)
    step = check_positive_float(step, "step")
    d = _dims(op, d)
    if keep is not None:
        keep = check_positive_int(keep, "keep")
    t0 = time.perf_counter()
    if starts is None:
        named = sequence_starts(op, R, n, random=random, clusters=clusters, structured=structured, seed=seed, d=d)
    else:
        named = [(name, _check_start(op, X, n, d, f"starts[{k}]"))
                 for k, (name, X) in enumerate(_named_starts(starts, "tensor"))]
    if not named:
        raise ValueError("random: no start to search from (random=0 and no structured start for this operator)")
    problem = _Sequences(op, R, n, d, tol=tol, seed=seed, batch_size=batch_size)
    members, trace, stopped = _ascend(problem, [(nm, X / R) for nm, X in named], budget=budget,
                                      max_steps=max_steps, gtol=gtol, eta=step, line_search=True, keep=keep, t0=t0,
                                      seed=_int_seed(seed))
    options = dict(budget=budget, max_steps=max_steps, keep=keep, gtol=gtol, step=step,
                   tol=tol, seed=seed, random=random, clusters=clusters, structured=structured)
    return _result(problem, members, trace, stopped, "projected ascent", operator_upper(op, R, n), t0, options)


def _check_start(op, X, n, d, name):
    X = op.check_points(X, name) if op.d_in is not None else torch.as_tensor(X)
    if X.shape != (n, d):
        raise ValueError(f"{name}: expected a sequence of shape ({n}, {d}), got {tuple(X.shape)}")
    if not bool(torch.isfinite(X).all()):
        raise ValueError(f"{name}: contains NaN or infinite entries")
    return X.detach()


def plain_gradient_ascent(f, R, n, *, random=8, budget=20000, max_steps=200, step=0.05, tol=1e-6, seed=0,
                          batch_size=None, d=None) -> WorstCaseResult:
    """The baseline: plain projected gradient ascent on Lip_X(f) from random starts.

    What the paper reports as giving poor results on a non-convex landscape (Section 5.2): from
    ``random`` sequences of tokens uniform on the sphere of radius R, fixed steps of ``step * R``
    (root mean square over tokens) along the gradient of the local constant, each projected onto
    B_R^n and taken whether the value rises or falls (no line search, no structured starts, no
    pruning). The same gradient, certified values, product accounting and budget as
    :func:`worst_case_sequence`, so the two compare at equal cost; the best iterate seen is
    returned. Parameters as there.

    Examples
    --------
    >>> import torch
    >>> from meanfield import SelfAttention, plain_gradient_ascent
    >>> A = torch.tensor([[1.0, 0.3], [0.0, -0.5]], dtype=torch.float64)
    >>> res = plain_gradient_ascent(SelfAttention(A, torch.eye(2, dtype=torch.float64)), R=2.0, n=4,
    ...                             random=2, budget=2000)
    >>> res.method, res.lower <= res.upper.value
    ('plain gradient ascent', True)
    """
    op = as_operator(f)
    n = check_positive_int(n, "n")
    R, budget, max_steps, _, tol, batch_size = _check_common(R, budget, max_steps, 0.0, tol, seed, batch_size)
    step = check_positive_float(step, "step")
    random = check_positive_int(random, "random")
    d = _dims(op, d)
    t0 = time.perf_counter()
    named = sequence_starts(op, R, n, random=random, clusters=0, structured=False, seed=seed, d=d)
    problem = _Sequences(op, R, n, d, tol=tol, seed=seed, batch_size=batch_size)
    members, trace, stopped = _ascend(problem, [(nm, X / R) for nm, X in named], budget=budget,
                                      max_steps=max_steps, gtol=0.0, eta=step, line_search=False, keep=None, t0=t0,
                                      seed=_int_seed(seed))
    options = dict(budget=budget, max_steps=max_steps, step=step, tol=tol, seed=seed, random=random)
    return _result(problem, members, trace, stopped, "plain gradient ascent", operator_upper(op, R, n), t0,
                   options)


def worst_case_measure(f, R, atoms, *, positions=None, split=True, starts=None, random=8, structured=True,
                       budget=20000, max_steps=200, keep=4, gtol=1e-4, step=0.05, tol=1e-6,
                       seed=0, d=None) -> WorstCaseResult:
    """Search measures with ``atoms`` atoms in B_R maximizing the local W2 constant of F.

    The W2 question (docs/math.md sections 4.5 and 4.7): the atoms move in B_R, the weights move on
    the simplex (as logits: a = softmax(z)), positions stay fixed (masked operators; default i/atoms),
    and with ``split=True`` atoms may split, which by section 4.7 raises the local constant to

        max( Lip_mu(F), max_i ||Q_i||_2 ),   Q_i = d/dx Gamma_mu(x) at x_i (keys fixed),

    whatever the fractions (:mod:`meanfield.splitting`). The search ascends that value (the
    gradient of a query norm is <u, dQ v> like that of sigma). When a query norm wins at the end,
    the returned ``input`` is the measure with that atom split in two halves and its constant is
    certified on that representation by :func:`meanfield.local_lipschitz` (so the closed form is
    checked on every such result: compare ``search_value`` with ``lower``).

    ``lower`` bounds the W2 Lipschitz constant of F on measures supported in B_R (conditional W2
    when masked) from below; ``upper`` is Theorem 3.5 / 4.4 (Lemma 3.8 over heads), from
    :func:`meanfield.bounds.operator_upper` with n = None. Starts: :func:`measure_starts`, or
    ``starts`` (measures or (name, measure) pairs with ``atoms`` atoms and the same positions).
    Other parameters as :func:`worst_case_sequence`; measures are searched one start at a time.
    Masses are kept above e^{-1388} times the largest (float64; the span the weighted Jacobian of
    Lemma C.5 can be formed with), starts included.

    Examples
    --------
    >>> import torch
    >>> from meanfield import SelfAttention, worst_case_measure
    >>> A = torch.tensor([[1.0, 0.3], [0.0, -0.5]], dtype=torch.float64)
    >>> res = worst_case_measure(SelfAttention(A, torch.eye(2, dtype=torch.float64)), R=2.0, atoms=3,
    ...                          random=1, budget=2000)
    >>> res.lower <= res.upper.value
    True
    """
    op = as_operator(f)
    if op.points_only:
        raise TypeError(f"f: {op!r} is points-only (a bare callable); it cannot weigh atoms, so the measure "
                        "question needs a meanfield operator or a Hugging Face layer")
    atoms = check_positive_int(atoms, "atoms")
    R, budget, max_steps, gtol, tol, _ = _check_common(R, budget, max_steps, gtol, tol, seed, None)
    step = check_positive_float(step, "step")
    split = check_bool(split, "split")
    if keep is not None:
        keep = check_positive_int(keep, "keep")
    d = _dims(op, d)
    dtype, device = _dtype_device(op)
    pos = _positions(op, positions, atoms, dtype)
    pos = None if pos is None else pos.to(device)
    t0 = time.perf_counter()
    if starts is None:
        named = measure_starts(op, R, atoms, positions=None if pos is None else pos.cpu(), random=random,
                               structured=structured, seed=seed, d=d)
    else:
        named = [(name, _check_measure_start(op, mu, atoms, pos, f"starts[{k}]"))
                 for k, (name, mu) in enumerate(_named_starts(starts, "Measure"))]
    if not named:
        raise ValueError("random: no start to search from (random=0 and no structured start for this operator)")
    problem = _Measures(op, R, atoms, d, pos, split, tol=tol, seed=seed, batch_size=None)
    states = [(nm, torch.cat([mu.points / R, mu.log_weights[:, None]], dim=-1)) for nm, mu in named]
    members, trace, stopped = _ascend(problem, states, budget=budget, max_steps=max_steps, gtol=gtol, eta=step,
                                      line_search=True, keep=keep, t0=t0,
                                      seed=_int_seed(seed))
    options = dict(budget=budget, max_steps=max_steps, keep=keep, gtol=gtol, step=step,
                   tol=tol, seed=seed, random=random, structured=structured, split=split)
    return _result(problem, members, trace, stopped, "projected ascent", operator_upper(op, R, None), t0,
                   options)


def _check_measure_start(op, mu, atoms, pos, name):
    mu = op.check_measure(mu, name)
    if mu.n != atoms:
        raise ValueError(f"{name}: expected {atoms} atoms, got {mu.n}")
    if not bool(torch.isfinite(mu.log_weights).all()):
        raise ValueError(f"{name}: has atoms of zero mass (drop them or give them a small mass)")
    if pos is not None and not torch.equal(mu.positions, pos):
        raise ValueError(f"{name}: its positions differ from ``positions`` (the search keeps positions fixed)")
    return mu.detach()
