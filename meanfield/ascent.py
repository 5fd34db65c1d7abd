"""A certified projected ascent: maximize a certified value over inputs in a ball (docs/math.md 4).

The optimizer of the worst-case search, knowing nothing of attention. A *problem* gives, for
states Y (tensors), certified values and gradients:

* ``project(Y)``: the state moved into the feasible set;
* ``projected_gradient(Y, G)``: the gradient with the outward part at the boundary removed;
* ``evaluate(Ys)`` -> [(value, aux)] (value -inf and aux None where the evaluation fails);
* ``gradient(Ys, auxs)`` -> [G or None];
* ``products``: the cost spent so far; ``tied``: whether coinciding rows of a state move together.

:func:`ascend` records on the problem ``start_products``, the cost of certifying the starts.

:func:`ascend` runs every start in lock-step: L-BFGS directions built from the projected gradients
(the gradient itself where no curvature is usable), a step rule that never accepts a decrease of
the certified value (backtracking: a rejected trial shrinks the step), rows that coincide in a start
moving together until that tied ascent stops, a few random kicks to leave a stationary point (kept
only if they raise the value), and successive halving that gives most of the budget to the best
starts. ``line_search=False`` is the plain ascent: fixed steps along the raw gradient.

The budget: the starts' certified values are spent whatever it is (``start_products``); after them
no work runs unless its predicted cost fits in what is left. An iteration has up to three pieces
(the gradients, the gradients of starts that just untied, the trial evaluations); before each, the
products it and the trials after it will cost are predicted from the largest cost per state seen so
far: for an evaluation, from the starts' certification on; for a gradient, once one has been
measured, and until then as one evaluation (a gradient differentiates the value an evaluation
certified). When the prediction does not fit: with pruning (``keep``) the worst active starts are
pruned until it does, so that the budget left goes to the best starts, and the search stops with
``"budget"`` when not even the best one fits; without pruning it stops with ``"budget"`` at once. So
``products <= max(budget, start_products)`` as long as no evaluation costs more per state than all
before it and a gradient costs at most two evaluations (both exact for :mod:`meanfield.worst_case`
with dense evaluations, whose cost is fixed; a Lanczos run that needs more iterations than every
earlier one can exceed the prediction by the difference).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch

__all__ = ["TracePoint", "ascend", "check_some_start_left", "warn_lost_starts"]


@dataclass(frozen=True)
class TracePoint:
    """The search after one iteration: ``products`` and ``seconds`` spent so far, ``best`` value so
    far, and the number of starts still ``active``."""

    iteration: int
    products: int
    seconds: float
    best: float
    active: int



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


class _Costs:
    """The largest cost per state seen so far of an evaluation and of a gradient (module docstring)."""

    def __init__(self):
        self.evaluate = self.gradient = None

    def observe(self, kind, spent, states):
        if states > 0:
            per = spent / states
            setattr(self, kind, per if getattr(self, kind) is None else max(getattr(self, kind), per))

    def predict(self, gradients, evaluations):
        """Products that ``gradients`` gradients and ``evaluations`` evaluations are expected to cost."""
        e = self.evaluate or 0.0
        g = self.gradient if self.gradient is not None else e
        return gradients * g + evaluations * e


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of a warning from the function calling this one that names the first frame outside the
    meanfield package (the searches reach :func:`ascend` through one or two frames of their own)."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _tie(Y):
    """(distinct rows, token -> row) when some rows coincide exactly, else (Y, None)."""
    rows, inverse = torch.unique(Y, dim=0, return_inverse=True)
    return (Y, None) if rows.shape[0] == Y.shape[0] else (rows, inverse)


def check_some_start_left(members) -> None:
    """OverflowError where the local constant overflows the dtype's range at every start (no start to go on from)."""
    if all(m.stopped == "overflow" for m in members):
        fix = "use float64 or a smaller radius" if members[0].Y.dtype != torch.float64 else "use a smaller radius"
        raise OverflowError("R: the local constant (or the weighted Jacobian) overflows the dtype's range at every "
                            f"start; {fix}")


def warn_lost_starts(members) -> None:
    """The RuntimeWarning naming the starts whose local constant overflowed the dtype's range (``stopped ==
    "overflow"``), once for a whole search (its ascents' members together), at the caller outside the package."""
    lost = [m.name for m in members if m.stopped == "overflow"]
    if not lost:
        return
    # the search goes on from the others, whose constants may be far below those lost (a review: at R = 1e160
    # every start at the radius overflowed and the lower bound came from tokens at the origin, silently)
    fix = "float64 or a smaller radius" if members[0].Y.dtype != torch.float64 else "a smaller radius"
    warnings.warn(f"R: the local constant overflows the dtype's range at {len(lost)} of {len(members)} starts "
                  f"({', '.join(lost[:4])}{', ...' if len(lost) > 4 else ''}); the search went on from the others, "
                  f"and its lower bound is theirs: use {fix}", RuntimeWarning, stacklevel=_outside_stacklevel())


def ascend(problem, starts, *, budget, max_steps, gtol, eta, line_search, keep, t0, seed, alone=True):
    """Ascend from ``starts`` [(name, Y)] until the budget, ``max_steps`` or every start stops (module
    docstring). Returns (members, trace, stopped): one member per start (``name``, ``initial``,
    ``best`` = (value, Y, aux), ``steps``, ``stopped``), one :class:`TracePoint` per iteration, and
    ``"budget"``, ``"max_steps"`` or ``"converged"``. ``alone``: an OverflowError where every start overflows
    and the warning of :func:`warn_lost_starts` where some do; False for an ascent that a search runs after
    another (its caller warns once for both, and keeps the first one's result where every new start overflows)."""
    Ys = [problem.project(Y) for _, Y in starts]
    evals = problem.evaluate(Ys)
    problem.start_products = problem.products   # spent whatever the budget: every start certified once
    cost = _Costs()
    cost.observe("evaluate", problem.start_products, sum(aux is not None for _, aux in evals))
    members = []
    for (name, _), Y, (v, aux) in zip(starts, Ys, evals):
        # tokens that coincide in a start (the witnesses' copies, clustered starts) first move together:
        # at exact copies sigma has a kink (the copies may split, docs/math.md section 4.7), which slows
        # a free ascent down; the tie is released when the tied ascent stops
        rows, tie = _tie(Y) if (line_search and problem.tied) else (Y, None)
        members.append(_Member(name, rows, v, aux, eta, tie))
        if aux is None:  # the constant at this start is beyond the dtype's range
            members[-1].stopped = "overflow"
    if alone:
        check_some_start_left(members)
        warn_lost_starts(members)
    trace = []
    best = lambda: max(m.best[0] for m in members)
    stopped = "converged"
    it, halvings = 0, 0
    rng = torch.Generator().manual_seed(seed)

    def out_of_budget(active):
        """Whether the gradients the ``active`` starts still need and then one trial per start would exceed the
        budget. With pruning (``keep``), the worst active starts are first pruned until the rest fits: the budget
        left goes to the best starts. Only when not even the best one fits (or without pruning, when they do not
        all fit) does every active start stop on the budget."""
        ranked = sorted(active, key=lambda m: -m.best[0]) if keep is not None else list(active)
        fits = lambda k: problem.products + cost.predict(sum(m.G is None for m in ranked[:k]), k) <= budget
        k = len(ranked)
        while k > 0 and not fits(k):
            k = k - 1 if keep is not None else 0
        if k == 0:
            for m in active:
                m.stopped = "budget"
            return True
        for m in ranked[k:]:
            m.stopped = "pruned"
        return False

    while True:
        active = [m for m in members if m.stopped is None]
        if not active:
            break
        if it >= max_steps:
            for m in active:
                m.stopped = "max_steps"
            stopped = "max_steps"
            break
        if out_of_budget(active):
            stopped = "budget"
            break
        active = [m for m in active if m.stopped is None]
        need = [m for m in active if m.G is None]
        if need:
            before = problem.products
            grads = problem.gradient([m.full(m.Y) for m in need], [m.aux for m in need])
            cost.observe("gradient", problem.products - before, sum(G is not None for G in grads))
            for m, G in zip(need, grads):
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
        if active and out_of_budget(active):
            stopped = "budget"
            break
        active = [m for m in active if m.stopped is None]
        need = [m for m in active if m.G is None]   # untied starts: their gradient in the full space
        if need:
            before = problem.products
            grads = problem.gradient([m.Y for m in need], [m.aux for m in need])
            cost.observe("gradient", problem.products - before, sum(G is not None for G in grads))
            for m, G in zip(need, grads):
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
        if active and out_of_budget(active):
            stopped = "budget"
            break
        active = [m for m in active if m.stopped is None]
        if active:
            trials = [problem.project(m.Y + steps[id(m)]) for m in active]
            before = problem.products
            results = problem.evaluate([m.full(Y) for m, Y in zip(active, trials)])
            cost.observe("evaluate", problem.products - before, sum(aux is not None for _, aux in results))
            for m, Y, (v, aux) in zip(active, trials, results):
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
