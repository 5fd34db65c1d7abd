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
* the best **upper** bound the framework knows (:func:`meanfield.upper.operator_upper`);
* their ratio, the search trace, the Jacobian products spent, the wall time, and why it stopped.

Three rooms: the starts (:mod:`meanfield.starts`: witnesses, hubs, random configurations), the
ascent (:mod:`meanfield.ascent`: a certified projected L-BFGS ascent knowing nothing of attention)
and, here, the problems it ascends (sigma(X) = Lip_X(f) with the gradient of the top singular value
from :mod:`meanfield.sigma_gradient`, d sigma = <u, dJ v>, per-token radial projection onto the ball;
for measures also the weights and mass splitting) and the entry points :func:`worst_case_sequence`,
:func:`worst_case_measure` and :func:`plain_gradient_ascent` (the baseline the paper reports as giving poor
results: fixed steps from random starts). Their search options are one :class:`SearchOptions` object, and
they return a :class:`WorstCaseResult` (both in :mod:`meanfield.worst_case_records`).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from particles import Measure, into_ball
from particles.threads import ThreadPolicy
from particles.validation import (
    MemoryLimitError,
    check_bool,
    check_positive_int,
    check_radius,
)

from . import krylov
from .adapters import as_operator
from .ascent import TracePoint, ascend, check_some_start_left, warn_lost_starts
from .lipschitz import ConvergenceError, default_tol, local_lipschitz
from .sigma_gradient import sigma_gradient
from .splitting import query_jacobians, query_term_gradient, split_measure
from .starts import (
    _dims,
    _dtype_device,
    _positions,
    ladder_measure_starts,
    ladder_sequence_starts,
    measure_starts,
    sequence_starts,
)
from .upper import operator_upper
from .worst_case_records import SearchOptions, StartRecord, WorstCaseResult, _options

__all__ = ["SearchOptions", "StartRecord", "TracePoint", "WorstCaseResult", "measure_starts",
           "plain_gradient_ascent", "sequence_starts", "worst_case_measure", "worst_case_sequence"]

#: Jacobian products a gradient pass is counted as (one JVP, one VJP through it)
GRADIENT_PRODUCTS = 2


# ---------------------------------------------------------------------- problems
class _Problem:
    """States Y in normalized coordinates: X / R (rows in the unit ball), plus for measures a last
    column of log-weights. ``evaluate`` gives certified values, ``gradient`` d sigma / dY."""

    def __init__(self, op, R, tol, seed, batch_size):
        self.op, self.R, self.tol, self.seed, self.batch_size = op, R, tol, seed, batch_size
        self.products = 0
        self.start_products = 0   # of products, those that certified the starts (set by the ascent)
        self.policy = None   # the search's ThreadPolicy (set by the entry points)
        self._timed = False

    def points(self, Y):
        """The tokens of state(s) Y: R times its first columns, in B_R as computed (:func:`particles.into_ball`),
        so that every input evaluated, and the one returned, passes ``norm <= R`` exactly."""
        return into_ball(Y[..., : self.dx] * self.R, self.R)

    def evaluate(self, Ys):
        """[(value, aux)] per state (:meth:`_evaluate`), under the search's thread policy: the first
        evaluation's time per Jacobian product decides the threads, later ones re-check the load."""
        t, before = time.perf_counter(), self.products
        out = self._evaluate(Ys)
        if self.policy is not None:
            if not self._timed and self.products > before:
                self._timed = True
                self.policy.observe((time.perf_counter() - t) / (self.products - before))
            else:
                self.policy.tick()
        return out

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
        # only lower bounds matter here (any Rayleigh quotient is one): Lanczos's check of the top singular value
        # would spend the search's budget
        with krylov.lower_bounds_only():
            return local_lipschitz(op, X, method=method, tol=tol, seed=seed)
    except ConvergenceError as err:  # the value is still a Rayleigh quotient: a certified lower bound
        return err.estimate
    except MemoryLimitError as err:   # its advice names local_lipschitz's options, which the search does not take
        size = str(err).split("); ", 1)[0] + ")"
        batch = X.points.shape[0] if isinstance(X, Measure) else X.shape[0]
        raise MemoryLimitError(f"the worst-case search certifying {1 if isinstance(X, Measure) else batch} "
                               f"input(s) at once ({method}) {size.split(': ', 1)[-1]}; lower batch_size (starts "
                               "certified per Lanczos run: SearchOptions(batch_size=...) of worst_case_sequence and "
                               "plain_gradient_ascent), or n / atoms, or raise the limit") from err


class _Sequences(_Problem):
    tied = True

    def __init__(self, op, R, n, d, **kw):
        super().__init__(op, R, **kw)
        self.n, self.dx = n, d

    def _evaluate(self, Ys):
        """[(value, aux)] for a list of states: one batched Lanczos run per chunk; (-inf, None) for a
        state where the evaluation fails (then the batch is evaluated one by one)."""
        out = []
        size = self.batch_size or len(Ys)
        for i in range(0, len(Ys), size):
            chunk = self.points(torch.stack(Ys[i:i + size]))
            try:
                ests = _lipschitz(self.op, chunk, self.tol, self.seed)
            except _FAILURES:
                if chunk.shape[0] == 1:
                    out.append((-math.inf, None))
                else:
                    out += [r for Y in Ys[i:i + size] for r in self._evaluate([Y])]
                continue
            if self.op.points_only or ests.method == "dense":
                # one solver run per sequence (its products summed), or the dense Jacobians' columns
                self.products += ests.applications
            else:  # one count per batched product: b products on single sequences
                self.products += ests.applications * len(ests)
            out += [(e.value, e) for e in ests]
        return out

    def gradient(self, Ys, auxs):
        """d sigma / dY per state (None where it fails)."""
        grads = []
        size = self.batch_size or len(Ys)
        for i in range(0, len(Ys), size):
            X = self.points(torch.stack(Ys[i:i + size]))
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
        return self.points(Y), aux, False


class _Measures(_Problem):
    tied = False

    def __init__(self, op, R, atoms, d, positions, split, **kw):
        super().__init__(op, R, **kw)
        self.n, self.dx, self.positions, self.split = atoms, d, positions, split

    def measure(self, Y):
        return Measure._trusted(self.points(Y), torch.exp(Y[:, -1]), Y[:, -1], self.positions)

    def _evaluate(self, Ys):
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


def _int_seed(seed):
    return 0 if seed is None else int(seed.initial_seed()) if isinstance(seed, torch.Generator) else int(seed)


def _check_common(R, budget, dtype=None):
    R = check_radius(R, "R")
    if R == 0:
        raise ValueError("R: expected a positive radius (B_0 holds one input, there is nothing to search)")
    # the largest radius a search takes: the square root of the dtype's largest number, less 0.1% for rounding
    # (1.3e154 in float64, 1.8e19 in float32, 256 in float16), where the squared norm of a token at the radius (a sum
    # of squares at most R^2) stays in range. Beyond, the ball's projection saw infinite norms and put every start
    # at the origin, where the lower bound then came from (a review, at R = 1e160)
    dtype = dtype or torch.float64
    top = 0.999 * math.sqrt(torch.finfo(dtype).max)
    if R > top:
        raise ValueError(f"R: {R:g} is above {top:.3g}, where the squared norms of tokens at the radius overflow "
                         f"{str(dtype).replace('torch.', '')} and the search cannot keep them in the ball")
    return R, check_positive_int(budget, "budget")


def _tol(opts: SearchOptions, op) -> float:
    return opts.tol if opts.tol is not None else default_tol(op.dtype or torch.float64)


def _record(opts: SearchOptions, budget: int, *names) -> dict:
    """The options a result records: the budget and the named SearchOptions fields."""
    return {"budget": budget, **{k: getattr(opts, k) for k in names}}


def _ascend_then_ladder(problem, states, rungs, budget, opts, t0):
    """The projected ascent from ``states``; then, where it stopped on its own tests ("converged") with half the
    budget or more left, a second one from the ladder's starts (``rungs()``,
    :func:`meanfield.starts.ladder_sequence_starts`) within the same budget: at a large radius every start at R
    saturates and the first ascent stops at once. Returns (members of both, one trace, why the last ascent
    stopped). Starts whose constant overflows are named in one warning for both ascents (an OverflowError where
    every start of the first does)."""
    run = lambda s, alone: ascend(problem, s, budget=budget, max_steps=opts.max_steps, gtol=opts.gtol, eta=opts.step,
                                  line_search=True, keep=opts.keep, t0=t0, seed=_int_seed(opts.seed), alone=alone)
    members, trace, stopped = run(states, rungs is None)
    if rungs is None:
        return members, trace, stopped
    check_some_start_left(members)
    more = rungs() if stopped == "converged" and problem.products <= budget / 2 else None
    if not more:
        warn_lost_starts(members)
        return members, trace, stopped
    spent, before = problem.start_products, problem.products
    extra, trace2, stopped = run(more, False)
    warn_lost_starts(members + extra)
    problem.start_products = spent + (problem.start_products - before)   # both ascents' starts
    best = max(m.best[0] for m in members)
    trace = type(trace)([*trace, *(dataclasses.replace(p, iteration=p.iteration + len(trace), best=max(best, p.best))
                                   for p in trace2)])
    return members + extra, trace, stopped


def _result(problem, members, trace, stopped, method, upper, t0, options):
    top = max(members, key=lambda m: m.best[0])
    value, Y, aux = top.best
    inp, est, split = problem.certify(Y, aux)
    starts = tuple(StartRecord(m.name, m.initial, m.best[0], m.steps, m.stopped) for m in members)
    return WorstCaseResult(input=inp, estimate=est, upper=upper, R=problem.R, n=problem.n, start=top.name,
                           starts=starts, trace=trace, products=problem.products,
                           seconds=time.perf_counter() - t0, stopped=stopped, method=method,
                           search_value=value, split=split, options=options,
                           start_products=problem.start_products)


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
def worst_case_sequence(f, R, n, *, budget=20000, starts=None, options=None, d=None, **deprecated) -> WorstCaseResult:
    """Search sequences X in B_R^n maximizing Lip_X(f): a certified bracket on Lip(f on B_R^n).

    Parameters
    ----------
    f : anything :func:`meanfield.as_operator` accepts
        Single or multi-head attention (masked, with biases), L2 attention, a Hugging Face layer
        (:class:`meanfield.hf.HFAttention`), ``torch.nn.MultiheadAttention``, a bare callable (then
        ``d`` is required and only random starts are built).
    R : float
        Radius (> 0) of the ball B_R that holds every token (closed ball, Euclidean norm).
    n : int
        Number of tokens.
    budget : int
        Jacobian products to spend (each J u and J^T w on one sequence counts one, a gradient pass
        two). No step runs unless its cost, predicted from the largest cost per input seen so far
        (:mod:`meanfield.ascent`), fits in what is left. The starts' certified values come first and
        count in it, whatever it is (the result's ``start_products``): a budget below them buys no
        ascent step.
    starts : list or None
        Tensors of shape (n, d), or pairs (a name, such a tensor), to use instead of
        :func:`~meanfield.starts.sequence_starts` (each is projected onto B_R^n first). To carry an input
        found at a shorter length m to n, give ``sequence_starts(f, R, n) + [("longer", longer_start(X_m, n))]``
        (:func:`meanfield.starts.longer_start`): the search then never ends below X_m's constant.
    options : :class:`SearchOptions` (or a dict of its fields), optional
        The starts built, the ascent's rules, the certificates' tolerance and seed. Tokens that
        coincide in a start move together until that tied ascent stops, then separately.
    d : int or None
        Token dimension, for operators that do not fix it.

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
    convergence. The upper bound is :func:`meanfield.upper.operator_upper` (section 5). The search
    options given as keywords (``random=2``, ...) still work, with a DeprecationWarning.

    Examples
    --------
    >>> import torch
    >>> from meanfield import SelfAttention, SearchOptions, worst_case_sequence
    >>> A = torch.tensor([[1.0, 0.3], [0.0, -0.5]], dtype=torch.float64)
    >>> res = worst_case_sequence(SelfAttention(A, torch.eye(2, dtype=torch.float64)), R=2.0, n=4,
    ...                           budget=1000, options=SearchOptions(random=2))
    >>> res.lower >= res.start_record("prop3.4-max").initial, res.lower <= res.upper.value
    (True, True)
    """
    opts = _options(options, deprecated, "worst_case_sequence")
    op = as_operator(f)
    n = check_positive_int(n, "n")
    R, budget = _check_common(R, budget, op.dtype)
    d = _dims(op, d)
    t0 = time.perf_counter()
    if starts is None:
        named = sequence_starts(op, R, n, random=opts.random, clusters=opts.clusters, structured=opts.structured,
                                seed=opts.seed, d=d)
    else:
        named = [(name, _check_start(op, X, n, d, f"starts[{k}]"))
                 for k, (name, X) in enumerate(_named_starts(starts, "tensor"))]
    if not named:
        raise ValueError("random: no start to search from (random=0 and no structured start for this operator)")
    problem = _Sequences(op, R, n, d, tol=_tol(opts, op), seed=opts.seed, batch_size=opts.batch_size)
    with ThreadPolicy() as policy:
        problem.policy = policy
        states = lambda starts: [(nm, X / R) for nm, X in starts]   # the ascent's state: tokens in units of R
        rungs = (lambda: states(ladder_sequence_starts(op, R, n, d=d))) if opts.ladder else None
        members, trace, stopped = _ascend_then_ladder(problem, states(named), rungs, budget, opts, t0)
        options = _record(opts, budget, "max_steps", "keep", "gtol", "step", "tol", "seed", "random", "clusters",
                          "structured", "ladder")
        return _result(problem, members, trace, stopped, "projected ascent", operator_upper(op, R, n, d=d), t0,
                       options)


def _check_start(op, X, n, d, name):
    X = op.check_points(X, name) if op.d_in is not None else torch.as_tensor(X)
    if X.shape != (n, d):
        raise ValueError(f"{name}: expected a sequence of shape ({n}, {d}), got {tuple(X.shape)}")
    if not bool(torch.isfinite(X).all()):
        raise ValueError(f"{name}: contains NaN or infinite entries")
    return X.detach()


def plain_gradient_ascent(f, R, n, *, budget=20000, options=None, d=None, **deprecated) -> WorstCaseResult:
    """The baseline: plain projected gradient ascent on Lip_X(f) from random starts.

    What the paper reports as giving poor results on a non-convex landscape (Section 5.2): from
    ``options.random`` sequences of tokens uniform on the sphere of radius R, fixed steps of
    ``options.step * R`` (root mean square over tokens) along the gradient of the local constant,
    each projected onto B_R^n and taken whether the value rises or falls (no line search, no
    structured starts, no pruning). The same gradient, certified values, product accounting and
    budget as :func:`worst_case_sequence`, so the two compare at equal cost; the best iterate seen
    is returned. Parameters as there (``random`` must be at least 1).

    Examples
    --------
    >>> import torch
    >>> from meanfield import SelfAttention, SearchOptions, plain_gradient_ascent
    >>> A = torch.tensor([[1.0, 0.3], [0.0, -0.5]], dtype=torch.float64)
    >>> res = plain_gradient_ascent(SelfAttention(A, torch.eye(2, dtype=torch.float64)), R=2.0, n=4,
    ...                             budget=2000, options=SearchOptions(random=2))
    >>> res.method, res.lower <= res.upper.value
    ('plain gradient ascent', True)
    """
    opts = _options(options, deprecated, "plain_gradient_ascent")
    op = as_operator(f)
    n = check_positive_int(n, "n")
    R, budget = _check_common(R, budget, op.dtype)
    check_positive_int(opts.random, "random")
    d = _dims(op, d)
    t0 = time.perf_counter()
    named = sequence_starts(op, R, n, random=opts.random, clusters=0, structured=False, seed=opts.seed, d=d)
    problem = _Sequences(op, R, n, d, tol=_tol(opts, op), seed=opts.seed, batch_size=opts.batch_size)
    with ThreadPolicy() as policy:
        problem.policy = policy
        members, trace, stopped = ascend(problem, [(nm, X / R) for nm, X in named], budget=budget,
                                         max_steps=opts.max_steps, gtol=0.0, eta=opts.step, line_search=False,
                                         keep=None, t0=t0, seed=_int_seed(opts.seed))
        options = _record(opts, budget, "max_steps", "step", "tol", "seed", "random")
        return _result(problem, members, trace, stopped, "plain gradient ascent", operator_upper(op, R, n, d=d), t0,
                       options)


def worst_case_measure(f, R, atoms, *, positions=None, split=True, budget=20000, starts=None, options=None, d=None,
                       **deprecated) -> WorstCaseResult:
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
    when masked) from below; ``upper`` is Theorem 3.5 (Lemma 3.8 over heads), from
    :func:`meanfield.upper.operator_upper` with n = None (unknown, inf, for masked operators: Theorem 4.4's
    stated bound fails, docs/math.md section 5.2). Starts:
    :func:`~meanfield.starts.measure_starts`, or ``starts`` (measures or (name, measure) pairs with
    ``atoms`` atoms and the same positions). ``budget``, ``options`` and ``d`` as in
    :func:`worst_case_sequence` (``clusters`` and ``batch_size`` do not apply: measures are searched
    one start at a time). Masses are kept above e^{-1388} times the largest (float64; the span the
    weighted Jacobian of Lemma C.5 can be formed with), starts included.

    Examples
    --------
    >>> import torch
    >>> from meanfield import SelfAttention, SearchOptions, worst_case_measure
    >>> A = torch.tensor([[1.0, 0.3], [0.0, -0.5]], dtype=torch.float64)
    >>> res = worst_case_measure(SelfAttention(A, torch.eye(2, dtype=torch.float64)), R=2.0, atoms=3,
    ...                          budget=2000, options=SearchOptions(random=1))
    >>> res.lower <= res.upper.value
    True
    """
    opts = _options(options, deprecated, "worst_case_measure")
    op = as_operator(f)
    if op.points_only:
        raise TypeError(f"f: {op!r} is points-only (a bare callable); it cannot weigh atoms, so the measure "
                        "question needs a meanfield operator or a Hugging Face layer")
    atoms = check_positive_int(atoms, "atoms")
    R, budget = _check_common(R, budget, op.dtype)
    split = check_bool(split, "split")
    d = _dims(op, d)
    dtype, device = _dtype_device(op)
    pos = _positions(op, positions, atoms, dtype)
    pos = None if pos is None else pos.to(device)
    t0 = time.perf_counter()
    if starts is None:
        named = measure_starts(op, R, atoms, positions=None if pos is None else pos.cpu(), random=opts.random,
                               structured=opts.structured, seed=opts.seed, d=d)
    else:
        named = [(name, _check_measure_start(op, mu, atoms, pos, f"starts[{k}]"))
                 for k, (name, mu) in enumerate(_named_starts(starts, "Measure"))]
    if not named:
        raise ValueError("random: no start to search from (random=0 and no structured start for this operator)")
    problem = _Measures(op, R, atoms, d, pos, split, tol=_tol(opts, op), seed=opts.seed, batch_size=None)
    # the ascent's state of a measure: its points in units of R beside its log-weights
    states = lambda starts: [(nm, torch.cat([mu.points / R, mu.log_weights[:, None]], dim=-1)) for nm, mu in starts]
    with ThreadPolicy() as policy:
        problem.policy = policy
        rungs = (lambda: states(ladder_measure_starts(op, R, atoms, positions=None if pos is None else pos.cpu(),
                                                      d=d))) if opts.ladder else None
        members, trace, stopped = _ascend_then_ladder(problem, states(named), rungs, budget, opts, t0)
        options = _record(opts, budget, "max_steps", "keep", "gtol", "step", "tol", "seed", "random", "structured",
                          "ladder")
        options["split"] = split
        return _result(problem, members, trace, stopped, "projected ascent", operator_upper(op, R, None, d=d), t0,
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
