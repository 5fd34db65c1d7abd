"""Weighted particle clouds: the probability measures attention acts on (docs/math.md section 2).

A :class:`Measure` is ``mu = sum_j a_j delta_{x_j}`` with points ``x_j`` in R^d and weights
``a_j >= 0`` summing to one. For masked (causal) attention every atom also carries a position
``s_j`` in [0, 1] (a measure on [0, 1] x R^d, Definition 2.6 of Castin et al. 2024).

Weights are kept together with their logarithms: the witnesses of Proposition 3.6 carry masses
like ``exp(-2 gamma R^2)`` that underflow in float64 for large R, so such measures can be built
from ``log_weights`` directly and the attention operators only ever read ``log_weights``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from .ball import into_ball
from .validation import (
    as_tensor,
    check_allocation,
    check_bool,
    check_device,
    check_log_weight_floor,
    check_ndim,
    check_positive_float,
    check_positive_int,
    check_radius,
    make_generator,
    resolve_dtype,
    to_arguments,
    unshared,
    weight_tolerance,
)

__all__ = ["Measure", "position_dtype", "held_positions"]

#: point dtypes too coarse for positions: float16 rounds i/n and (i+1)/n to one value from n = 2049 on, bfloat16
#: from n = 257, so a token would see its successor through the causal mask
_HALF = (torch.float16, torch.bfloat16)


def position_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype positions are kept in for points of ``dtype``: float32 for half precisions (where i/n of a
    sequence of a few hundred tokens collide), the points' own otherwise. Positions are only ever compared."""
    return torch.float32 if dtype in _HALF else dtype


def held_positions(pos: torch.Tensor, dtype: torch.dtype, name: str = "positions", device=None) -> torch.Tensor:
    """Positions ``pos`` in ``dtype`` (on ``device``); a ValueError naming ``name`` where the conversion rounds two
    distinct positions to one value. Positions are only ever compared, so rounding is harmless while it keeps
    their order, and changes the causal mask where it ties them (the later atom then sees the earlier one:
    0.5 + 1e-9 and 0.5 in float32). One sort, only when the dtype narrows."""
    pos = pos.to(device=device)          # on the target device first: the check compares both there
    out = pos.to(dtype=dtype)
    if out.dtype == pos.dtype or out.numel() < 2 or not pos.is_floating_point() \
            or torch.finfo(out.dtype).eps <= torch.finfo(pos.dtype).eps:
        return out
    src = pos.detach().reshape(-1)
    order = torch.argsort(src)
    s, c = src[order], out.detach().reshape(-1)[order]
    tied = (s[1:] > s[:-1]) & (c[1:] == c[:-1])
    if bool(tied.any()):
        i = int(torch.nonzero(tied)[0, 0])
        raise ValueError(f"{name}: {dtype} rounds {int(tied.sum())} pair(s) of distinct positions to one value "
                         f"(e.g. {float(s[i]):.17g} and {float(s[i + 1]):.17g}), which changes the causal mask; "
                         f"keep them in {pos.dtype} (points of that dtype) or give positions further apart")
    return out


def _accumulator(device: torch.device) -> torch.dtype:
    """The dtype of sums of masses whatever the measure's: float64, float32 on a device without it (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _held(lw: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """Log-weights ``lw`` in ``dtype``; a ValueError naming ``name`` where a positive mass would become zero."""
    out = lw.to(dtype)
    lost = int(((out == -math.inf) & (lw > -math.inf)).sum())
    if lost:
        raise ValueError(f"{name}: {lost} atom(s) of positive mass have log-weights below what {dtype} holds "
                         f"(smallest {float(lw[lw > -math.inf].min()):.4g}); use a wider dtype or drop those atoms")
    return out


class Measure:
    """An immutable weighted particle cloud, optionally with positions in [0, 1].

    The constructor copies the arrays and tensors it is given where it would otherwise share their memory, so a
    measure built from ``X`` does not change when ``X`` is later modified in place (``X += dt * v`` in a loop);
    tensors that require grad are copied with ``clone``, so gradients still reach them. The accessors
    (``points``, ``weights``, ...) return the measure's own tensors, without a copy: modifying those in place
    modifies the measure (and breaks the agreement of ``weights`` with ``log_weights``); build a new measure
    instead (``with_points``, ``pushforward``).

    Parameters
    ----------
    points : tensor or array ``(N, d)``
        Atom locations. Float tensors keep their dtype (and autograd graph); numpy data and
        integers become float64 unless ``dtype`` is given.
    weights : ``(N,)`` or None
        Non-negative masses summing to one (None: uniform). ``normalize=True`` divides by the sum.
    positions : ``(N,)`` or None
        Positions s_j in [0, 1] for masked attention (None: an unmasked measure). They enter attention
        only through the comparisons s_j <= s_i, so operators are piecewise constant in them: their
        derivative is zero wherever no two positions tie, and autograd reports positions that require
        grad as unused (``allow_unused=True`` gives None); a pushforward carries them through unchanged
        (docs/math.md section 2.4).
    log_weights : ``(N,)`` or None
        Alternative to ``weights`` for masses that underflow (entries may be ``-inf``).
    normalize : bool
        False (the default): weights (or log-weights) must already sum to one, within the dtype's tolerance, else a
        ValueError. True: they are divided by their sum (log-weights shifted by its logarithm).
    dtype : torch.dtype, str or None
        Floating dtype of the points (weights and log-weights follow it; positions take :func:`position_dtype` of
        it). None keeps a float tensor's dtype and gives float64 to numpy data and integers.
    device : torch.device, str or None
        Where the measure lives (None: where the points are; numpy data on the CPU).
    """

    __slots__ = ("_points", "_weights", "_log_weights", "_positions")

    def __init__(self, points, weights=None, positions=None, *, log_weights=None,
                 normalize: bool = False, dtype=None, device=None):
        dtype = resolve_dtype(dtype)
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype: a measure needs a floating-point dtype, got {dtype}")
        normalize = check_bool(normalize, "normalize")
        pts = as_tensor(points, "points", dtype=dtype, device=device)
        check_ndim(pts, "points", 2, "an (N, d) array of atoms")
        n, d = pts.shape
        if n == 0:
            raise ValueError("points: a measure needs at least one atom (got N = 0)")
        if d == 0:
            raise ValueError("points: atoms need at least one coordinate (got d = 0)")
        tol = weight_tolerance(pts.dtype, weights if log_weights is None else log_weights)
        if weights is not None and log_weights is not None:
            raise ValueError("weights, log_weights: give at most one of them")
        if log_weights is not None:
            # in the precision given (a log-weight of -7e4 is a positive mass that float16 cannot hold)
            lw = as_tensor(log_weights, "log_weights", device=pts.device, finite=False)
            check_ndim(lw, "log_weights", 1, "a vector")
            if lw.shape[0] != n:
                raise ValueError(f"log_weights: expected {n} entries (one per atom), got {lw.shape[0]}")
            if torch.isnan(lw).any() or (lw == math.inf).any():
                raise ValueError("log_weights: contains NaN or +inf")
            lw = lw.to(torch.promote_types(lw.dtype, pts.dtype))
            total = torch.logsumexp(lw.detach(), 0)
            if not torch.isfinite(total):
                raise ValueError("log_weights: every weight is zero")
            if normalize:
                lw = lw - torch.logsumexp(lw, 0)
            elif abs(float(total)) > tol:
                raise ValueError(f"log_weights: weights sum to exp({float(total):.3g}), not 1 "
                                 "(pass normalize=True to rescale)")
            elif abs(float(total)) > weight_tolerance(pts.dtype):
                # accepted at the looser tolerance of their own, lower precision: renormalized, so that the
                # measure's log-weights sum to one in the points' precision (a saved measure is checked at it)
                lw = lw - torch.logsumexp(lw, 0)
            lw = _held(lw, pts.dtype, "log_weights")
            check_log_weight_floor(lw.detach())
            w = torch.exp(lw)
        else:
            if weights is None:
                w = torch.full((n,), 1.0 / n, dtype=pts.dtype, device=pts.device)
                lw = torch.log(w)
            else:
                # in the precision given, or the points' where higher: a mass of 1e-8 is zero in float16, its
                # log (-18.4) is not
                w = as_tensor(weights, "weights", device=pts.device)
                check_ndim(w, "weights", 1, "a vector")
                if w.shape[0] != n:
                    raise ValueError(f"weights: expected {n} entries (one per atom), got {w.shape[0]}")
                if (w.detach() < 0).any():
                    raise ValueError(f"weights: must be non-negative (min is {float(w.min()):.3g})")
                lower = torch.finfo(w.dtype).eps > torch.finfo(pts.dtype).eps
                w = w.to(torch.promote_types(w.dtype, pts.dtype))
                total = float(w.detach().sum())
                if total <= 0:
                    raise ValueError("weights: every weight is zero")
                if normalize:
                    if not math.isfinite(total):
                        # by the largest first: the sum of large raw counts overflows (6e4 + 6e4 in float16)
                        w = w / w.detach().max()
                    w = w / w.sum()
                elif abs(total - 1.0) > tol:
                    raise ValueError(f"weights: must sum to 1, got {total!r} (pass normalize=True to rescale)")
                elif lower or abs(total - 1.0) > weight_tolerance(pts.dtype):
                    # weights of a lower precision than the points (a torch tensor, or a numpy array, which
                    # as_tensor widened), accepted in their own precision: the measure's own weights sum to one in
                    # the points' precision (a saved measure is checked at it)
                    w = w / w.sum()
                lw = _held(torch.log(w), pts.dtype, "weights")
                w = w.to(pts.dtype)
        pos = None
        if positions is not None:
            pos = as_tensor(positions, "positions", device=pts.device)
            check_ndim(pos, "positions", 1, "a vector")
            pos = held_positions(pos, position_dtype(pts.dtype))
            if pos.shape[0] != n:
                raise ValueError(f"positions: expected {n} entries (one per atom), got {pos.shape[0]}")
            if (pos < 0).any() or (pos > 1).any():
                raise ValueError("positions: must lie in [0, 1] "
                                 f"(got range [{float(pos.min()):.3g}, {float(pos.max()):.3g}])")
        # the measure's own copies of what the caller keeps (its arrays stay the caller's to change in place)
        pts, w, lw = unshared(pts, points), unshared(w, weights), unshared(lw, log_weights)
        pos = None if pos is None else unshared(pos, positions)
        self._points, self._weights, self._log_weights, self._positions = pts, w, lw, pos

    # ------------------------------------------------------------------ accessors
    @property
    def points(self) -> torch.Tensor:
        """Atom locations, shape (N, d)."""
        return self._points

    @property
    def weights(self) -> torch.Tensor:
        """Masses a_j, shape (N,), summing to one."""
        return self._weights

    @property
    def log_weights(self) -> torch.Tensor:
        """log a_j (``-inf`` for empty atoms); what the softmax of attention adds to scores."""
        return self._log_weights

    @property
    def positions(self) -> torch.Tensor | None:
        """Positions s_j in [0, 1] (masked measures), or None."""
        return self._positions

    @property
    def masked(self) -> bool:
        return self._positions is not None

    @property
    def n(self) -> int:
        return self._points.shape[0]

    @property
    def dim(self) -> int:
        return self._points.shape[1]

    @property
    def device(self) -> torch.device:
        return self._points.device

    @property
    def dtype(self) -> torch.dtype:
        return self._points.dtype

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        kind = "masked " if self.masked else ""
        return f"Measure({kind}n={self.n}, dim={self.dim}, dtype={self.dtype}, device={self.device})"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def empirical(cls, X, **kw) -> Measure:
        """The empirical measure m(X) = (1/n) sum_i delta_{x_i} of a sequence X (n, d)."""
        return cls(X, **kw)

    @classmethod
    def sequence(cls, X, **kw) -> Measure:
        """A sequence as a masked measure: uniform weights 1/n, positions s_i = i/n, i = 1..n."""
        pts = as_tensor(X, "X", dtype=kw.pop("dtype", None), device=kw.pop("device", None))
        check_ndim(pts, "X", 2, "an (n, d) sequence")
        n = pts.shape[0]
        pos = torch.arange(1, n + 1, dtype=position_dtype(pts.dtype), device=pts.device) / max(n, 1)
        return cls(pts, positions=pos, **kw)

    @classmethod
    def diracs(cls, points, weights, positions=None, **kw) -> Measure:
        """sum_j a_j delta_{x_j} with explicit weights (normalize=True to rescale)."""
        return cls(points, weights, positions, **kw)

    @classmethod
    def two_dirac(cls, x0, x1, p=None, *, log_p=None, **kw) -> Measure:
        """p delta_{x0} + (1 - p) delta_{x1}: the family of Proposition 3.6.

        ``log_p`` gives the small mass in log form, so that p = exp(-2 gamma R^2) survives at
        large R where it underflows in float64.
        """
        if (p is None) == (log_p is None):
            raise ValueError("p, log_p: give exactly one of them")
        for name, t in (("p", p), ("log_p", log_p)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # read as a number below: a gradient in it would be silently missing
                raise ValueError(f"{name}: a tensor that requires grad; two_dirac takes the mass as a number. To "
                                 "differentiate in it, build Measure(torch.stack([x0, x1]), log_weights=...) from "
                                 "the log-masses")
        x0 = as_tensor(x0, "x0", dtype=kw.get("dtype"))
        x1 = as_tensor(x1, "x1", dtype=kw.get("dtype"))
        for name, x in (("x0", x0), ("x1", x1)):
            check_ndim(x, name, 1, "a vector, one atom")
        if x0.shape != x1.shape:
            raise ValueError(f"x0, x1: expected two vectors of the same length, got {x0.shape[0]} and {x1.shape[0]}")
        if log_p is None:
            p = float(p)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"p: expected a mass in [0, 1], got {p}")
            log_p = math.log(p) if p > 0 else -math.inf
        log_p = float(log_p)
        if math.isnan(log_p) or log_p > 0:
            raise ValueError(f"log_p: expected a log-mass <= 0, got {log_p}")
        # log(1 - p) = log(-expm1(log p)): exact near p = 1 (log1p(-exp(log_p)) lost it, and failed at -1e-17)
        log_q = math.log(-math.expm1(log_p)) if log_p < 0 else -math.inf
        # the wider of the two dtypes (float32 x0 and float64 x1: float64), so that neither atom is rounded
        dt = torch.promote_types(x0.dtype, x1.dtype)
        pts = torch.stack([x0.to(dt), x1.to(dt)])
        return cls(pts, log_weights=torch.tensor([log_p, log_q], dtype=pts.dtype), **kw)

    @classmethod
    def sphere(cls, n: int, dim: int, radius: float = 1.0, *, seed=None, dtype=None, device=None,
               positions: bool = False) -> Measure:
        """n i.i.d. uniform atoms on the sphere of radius R in R^d (uniform weights).

        ``positions=True`` gives them positions i/n (a sequence for masked attention). A seed fixes the samples of
        one dtype: float32 and float64 draws of the same seed differ (torch's samplers).
        """
        positions = check_bool(positions, "positions")
        X = _sample_sphere(n, dim, radius, seed, dtype, device)
        return cls.sequence(X) if positions else cls(X)

    @classmethod
    def ball(cls, n: int, dim: int, radius: float = 1.0, *, seed=None, dtype=None, device=None,
             positions: bool = False) -> Measure:
        """n i.i.d. uniform atoms in the closed ball B_R of R^d (uniform weights).

        A seed fixes the samples of one dtype: float32 and float64 draws of the same seed differ (torch's samplers).
        """
        positions = check_bool(positions, "positions")
        check_positive_int(n, "n")
        g = make_generator(seed)
        U = _sample_sphere(n, dim, 1.0, g, dtype, device)
        r = torch.rand(n, 1, generator=g, dtype=U.dtype).to(U.device) ** (1.0 / dim)
        R = check_radius(radius, "radius")
        X = into_ball(R * r * U, R)
        return cls.sequence(X) if positions else cls(X)

    @classmethod
    def gaussian(cls, n: int, mean, cov=None, *, seed=None, dtype=None, device=None,
                 positions: bool = False) -> Measure:
        """n i.i.d. samples of N(mean, cov) (cov None: identity).

        ``dtype`` None: that of ``mean`` when it is a tensor (``torch.zeros(3)`` is float32), float64 for a list or
        a numpy array. A seed fixes the samples of one dtype: float32 and float64 draws of the same seed differ
        (torch's samplers).
        """
        positions = check_bool(positions, "positions")
        device = check_device(device)
        check_positive_int(n, "n")
        m = as_tensor(mean, "mean", dtype=_measure_dtype(dtype))
        check_ndim(m, "mean", 1, "a vector")
        d = m.shape[0]
        C = torch.eye(d, dtype=m.dtype) if cov is None else as_tensor(cov, "cov", dtype=m.dtype)
        if C.shape != (d, d):
            raise ValueError(f"cov: expected shape ({d}, {d}), got {tuple(C.shape)}")
        if not torch.allclose(C, C.T, atol=1e-10 * (1 + float(C.abs().max()))):
            raise ValueError("cov: must be symmetric")
        evals, evecs = torch.linalg.eigh(C)
        if float(evals.min()) < -1e-10 * (1 + float(evals.abs().max())):
            raise ValueError("cov: must be positive semi-definite")
        L = evecs * evals.clamp(min=0).sqrt()
        _check_sample_memory(n, d, m.dtype, "Measure.gaussian")
        g = make_generator(seed)
        Z = torch.randn(n, d, generator=g, dtype=m.dtype)
        X = (m + Z @ L.T).to(device or "cpu")
        return cls.sequence(X) if positions else cls(X)

    # ------------------------------------------------------------------ operations
    def to(self, device=None, dtype=None) -> Measure:
        """The same measure on another device and/or dtype (positions in :func:`position_dtype` of it). A
        dtype that cannot hold the measure is refused: points that overflow it, or positive masses whose
        log-weights underflow it."""
        device, dtype = to_arguments(device, dtype)
        dtype = resolve_dtype(dtype)
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype: a measure needs a floating-point dtype, got {dtype}")
        device = check_device(device)
        kw = dict(device=device, dtype=dtype)
        pts = self._points.to(**kw)
        if dtype is not None and dtype != self.dtype and not bool(torch.isfinite(pts.detach()).all()):
            big = float(self._points.detach().abs().max())
            raise ValueError(f"dtype: {dtype} cannot hold this measure's points (largest |entry| {big:.4g} "
                             "overflows it)")
        lw = self._log_weights.to(device=device)
        lw = lw if dtype is None else _held(lw, dtype, "dtype")
        pos = None
        if self._positions is not None:
            pos = self._positions.to(device=device) if dtype is None else \
                held_positions(self._positions, position_dtype(dtype), "dtype", device=device)
        return Measure._trusted(pts, self._weights.to(**kw), lw, pos)

    def detach(self) -> Measure:
        pos = None if self._positions is None else self._positions.detach()
        return Measure._trusted(self._points.detach(), self._weights.detach(),
                                self._log_weights.detach(), pos)

    def unmasked(self) -> Measure:
        """The same atoms and weights without positions: the measure's law on R^d (what :func:`transport.w2`
        compares; itself when it has no positions)."""
        if self._positions is None:
            return self
        return Measure._trusted(self._points, self._weights, self._log_weights, None)

    def pushforward(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Measure:
        """T_# mu = sum_j a_j delta_{T(x_j)}: ``fn`` maps the (N, d) points to (N, d') points.

        Weights and positions are kept (masked attention never moves positions).
        """
        if not callable(fn):
            raise TypeError(f"fn: expected a function of the (N, d) points, got {type(fn).__name__}")
        out = fn(self._points)
        if not isinstance(out, torch.Tensor):
            # numpy results come back in the measure's own dtype, not float64
            out = as_tensor(out, "fn(points)", dtype=self.dtype, device=self.device)
        if out.dim() != 2 or out.shape[0] != self.n or out.shape[1] == 0:
            raise ValueError(f"fn: must map ({self.n}, d) points to ({self.n}, d') points with d' >= 1, "
                             f"got shape {tuple(out.shape)}")
        if out.dtype != self.dtype:
            # the weights and log-weights are the measure's: points of another dtype would make a measure that
            # the constructor refuses (integers) or whose weights no operator of the points' dtype takes
            raise TypeError(f"fn: returned {out.dtype} points for a measure of {self.dtype}; return points of the "
                            f"measure's dtype (convert the measure first with mu.to(dtype=...))")
        if not bool(torch.isfinite(out.detach()).all()):
            raise ValueError("fn: produced NaN or infinite points")
        return Measure._trusted(out, self._weights, self._log_weights, self._positions)

    def with_points(self, points) -> Measure:
        """The same weights and positions carried by other points of the same count. A tensor of another
        floating dtype is refused (converting it would round it or widen it silently); arrays and lists take the
        measure's dtype."""
        if isinstance(points, torch.Tensor) and points.is_floating_point() and points.dtype != self.dtype:
            raise TypeError(f"points: {points.dtype} points for a measure of {self.dtype}; convert them with "
                            f".to({self.dtype}) or the measure with mu.to(dtype=...)")
        pts = as_tensor(points, "points", dtype=self.dtype, device=self.device)
        if pts.dim() != 2 or pts.shape[0] != self.n or pts.shape[1] == 0:
            raise ValueError(f"points: expected ({self.n}, d) with d >= 1, got {tuple(pts.shape)}")
        return Measure._trusted(unshared(pts, points), self._weights, self._log_weights, self._positions)

    def split(self, i: int, fraction: float = 0.5) -> Measure:
        """Split atom i of mass a into (x_i, t a) and (x_i, (1 - t) a), t = ``fraction``.

        The result is the same measure (W2 distance zero); its representation has one more atom
        that the mass-splitting study lets move apart (docs/math.md section 4). The new atom is
        inserted right after atom i and has the same position.
        """
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"i: expected an atom index, got {type(i).__name__}")
        if not -self.n <= i < self.n:
            raise ValueError(f"i: atom index {i} out of range for {self.n} atoms")
        i = int(i) % self.n
        t = check_positive_float(fraction, "fraction", allow_zero=True, allow_inf=True)
        if not 0.0 < t < 1.0:
            raise ValueError(f"fraction: expected a number in (0, 1), got {fraction}")
        idx = torch.cat([torch.arange(i + 1), torch.tensor([i]), torch.arange(i + 1, self.n)]).to(self.device)
        lw = self._log_weights[idx].clone()
        lw[i] = lw[i] + math.log(t)
        lw[i + 1] = lw[i + 1] + math.log1p(-t)
        # the other atoms keep their weights as they are (exp of their log-weights differs from them by the
        # dtype's rounding: 1.4% in bfloat16); the two halves from the weight, in float64
        w = self._weights[idx].clone()
        a = self._weights[i].to(_accumulator(self.device))
        w[i], w[i + 1] = (a * t).to(w.dtype), (a * (1.0 - t)).to(w.dtype)
        pos = None if self._positions is None else self._positions[idx]
        return Measure._trusted(self._points[idx], w, lw, pos)

    def merge(self, atol: float = 0.0) -> Measure:
        """Merge atoms that coincide (points within ``atol`` in max-norm, same position).

        Each group becomes one atom of summed weight at the weight-averaged location, at its atoms'
        common position (atoms at different positions never merge, whatever ``atol``): duplicated
        atoms and one atom of the summed weight are the same measure (docs/math.md section 2).
        Groups are the connected components of the "within atol" relation, found in memory O(N)
        (:func:`particles.linkage.linked_components`: a collapsed cloud is not a list of N^2 / 2 pairs);
        order follows the first atom of each group.
        """
        atol = check_positive_float(atol, "atol", allow_zero=True, allow_inf=True)
        # numpy has no bfloat16: its points are widened to float32 (exactly) for the grouping
        X = self._points.detach().cpu()
        X = (X.float() if X.dtype == torch.bfloat16 else X).numpy()
        if self._positions is not None:
            # atoms at different positions never merge: the position's rank as one more coordinate, ranks
            # spaced by more than atol in the max-norm (a merged atom keeps its atoms' common position)
            _, rank = np.unique(self._positions.detach().cpu().numpy(), return_inverse=True)
            rank = rank.reshape(-1).astype(np.float64)
            # ranks 2 atol apart: farther than atol (they never link), two cells of linked_components apart
            spacing = 2.0 * atol if atol > 0 else 1.0
            if math.isfinite(spacing * max(1.0, float(rank.max()))):
                labels = _group_labels(np.concatenate([X.astype(np.float64), rank[:, None] * spacing], axis=1), atol)
            else:   # atol too large to space the ranks (every finite pair of points is within it): atoms of one
                # position and one component of all the points merge
                labels = _group_labels(np.concatenate([rank[:, None], _group_labels(X, atol)[:, None]], axis=1),
                                       0.0)
        else:
            labels = _group_labels(X, atol)
        k = int(labels.max()) + 1
        if k == self.n:
            return self
        lab = torch.as_tensor(labels, device=self.device)
        # the sums in float64 (float32 where the device has no float64), whatever the measure's dtype: a group of
        # 10^4 atoms summed in bfloat16 kept 3% of its mass (a review), and in float32 drifted by 250 ulp
        acc = _accumulator(self.device)
        lw_in = self._log_weights.to(acc)
        lw = torch.full((k,), -math.inf, dtype=acc, device=self.device).scatter_reduce(0, lab, lw_in, reduce="amax")
        # log-sum-exp per group, stable for tiny masses; a group of atoms of zero mass only shifted by 0 (exp(-inf -
        # -inf) is NaN, and the renormalization below spread it to every atom: a review)
        lw = torch.where(torch.isfinite(lw), lw, torch.zeros_like(lw))
        sums = torch.zeros(k, dtype=acc, device=self.device).index_add(0, lab, torch.exp(lw_in - lw[lab]))
        new_lw = lw + torch.log(sums)
        # weights of the averaging inside each group, relative to the group's mass
        rel = torch.exp(lw_in - new_lw[lab])
        rel = torch.where(torch.isfinite(new_lw[lab]), rel, torch.zeros_like(rel))
        counts = torch.zeros(k, dtype=acc, device=self.device).index_add(0, lab, torch.ones_like(rel))
        empty = ~torch.isfinite(new_lw)
        rel = torch.where(empty[lab], 1.0 / counts[lab], rel)
        # the weighted mean as the group's first atom plus the mean of the offsets from it: a group of copies of
        # one point keeps that point exactly (a mean of copies in floating point moved it by an ulp)
        first = torch.full((k,), self.n, dtype=torch.long, device=self.device).scatter_reduce(
            0, lab, torch.arange(self.n, device=self.device), reduce="amin")
        base = self._points.to(acc)[first]
        offsets = torch.zeros(k, self.dim, dtype=acc, device=self.device).index_add(
            0, lab, rel[:, None] * (self._points.to(acc) - base[lab]))
        pts = (base + offsets).to(self.dtype)
        pos = None
        if self._positions is not None:
            pos = self._positions.new_zeros(k).scatter(0, lab, self._positions)
        # the log-weights renormalized in the working precision before the cast: the masses sum to 1 to the dtype
        new_lw = new_lw - torch.logsumexp(new_lw, 0)
        return Measure._trusted(pts, torch.exp(new_lw).to(self.dtype), new_lw.to(self.dtype), pos)

    # ------------------------------------------------------------------ statistics
    def radius(self) -> float:
        """``max |x_j|`` over atoms of positive mass: the R of B_R containing the support."""
        support = self._log_weights > -math.inf
        return float(self._points.detach()[support].norm(dim=1).max())

    def mean(self) -> torch.Tensor:
        """sum_j a_j x_j."""
        return self._weights @ self._points

    def covariance(self) -> torch.Tensor:
        """sum_j a_j (x_j - m)(x_j - m)^T."""
        C = self._points - self.mean()
        return (C * self._weights[:, None]).T @ C

    def position_marginal(self, atol: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """First marginal of a masked measure: sorted distinct positions and their masses.

        Positions closer than ``atol`` count as one (their first value is reported).
        """
        positions, mass, _ = self.position_groups(atol, "position_marginal")
        return positions, mass

    def position_groups(self, atol: float = 0.0, what: str = "position_groups"):
        """(positions, masses, labels): :meth:`position_marginal` and, for every atom, the index of its group.

        Positions are sorted and grouped by chaining gaps of at most ``atol`` (a chain can span more than
        ``atol``: positions 0, 0.1, 0.2 are one group at atol 0.11); each group is reported by its first
        position. ``labels[j]`` is atom j's group, whatever the distance of its position to that first one.
        """
        pos = self._require_positions(what)
        atol = check_positive_float(atol, "atol", allow_zero=True, allow_inf=True)
        order = torch.argsort(pos)
        p, w = pos[order], self._weights[order]
        gap = torch.diff(p) > atol
        group = torch.cat([torch.zeros(1, dtype=torch.long, device=p.device), torch.cumsum(gap.long(), 0)])
        k = int(group[-1]) + 1
        # summed in float64 (a million float32 weights at one position summed in float32 are off by 1e-4, above
        # the tolerance conditional_w2 compares masses with), then rounded once to the measure's dtype
        mass = torch.zeros(k, dtype=torch.float64, device=self.device).index_add(0, group, w.to(torch.float64))
        mass = mass.to(self.dtype)
        first = torch.cat([torch.ones(1, dtype=torch.bool, device=p.device), gap])
        labels = torch.empty_like(group)
        labels[order] = group
        return p[first], mass, labels

    def at_position(self, s: float, atol: float = 1e-12) -> Measure:
        """The normalized slice mu_s: atoms with ``|s_j - s| <= atol``, renormalized (Definition 4.1)."""
        pos = self._require_positions("at_position")
        keep = (pos - float(s)).abs() <= atol
        return self._subset(keep, f"at_position: no atom at position {s}")

    def up_to(self, s: float) -> Measure:
        """The causal prefix: atoms with s_j <= s, renormalized (what masked attention sees at s)."""
        pos = self._require_positions("up_to")
        return self._subset(pos <= float(s), f"up_to: no atom at or before position {s}")

    # ------------------------------------------------------------------ internals
    @classmethod
    def _trusted(cls, points, weights, log_weights, positions) -> Measure:
        """Build without validation from tensors that are already consistent."""
        obj = cls.__new__(cls)
        obj._points, obj._weights, obj._log_weights, obj._positions = points, weights, log_weights, positions
        return obj

    def _require_positions(self, what: str) -> torch.Tensor:
        if self._positions is None:
            raise ValueError(f"{what}: this measure has no positions (build it with positions=... or "
                             "Measure.sequence)")
        return self._positions

    def _subset(self, keep: torch.Tensor, message: str) -> Measure:
        if not bool(keep.any()):
            raise ValueError(message)
        lw = self._log_weights[keep]
        if not torch.isfinite(torch.logsumexp(lw, 0)):
            raise ValueError(message + " with positive mass")
        lw = lw - torch.logsumexp(lw, 0)
        pos = None if self._positions is None else self._positions[keep]
        return Measure._trusted(self._points[keep], torch.exp(lw), lw, pos)


def _check_sample_memory(n: int, dim: int, dtype, what: str) -> None:
    """n samples of dimension dim: the Gaussian draws and the scaled copy, before they are allocated."""
    size = torch.empty(0, dtype=resolve_dtype(dtype) or torch.float64).element_size()
    check_allocation(2 * n * dim * size, f"{what}: {n} atoms in dimension {dim}", "lower n")


def _measure_dtype(dtype) -> torch.dtype | None:
    """A dtype given to a sampler: a floating one (TypeError naming ``dtype`` otherwise), or None."""
    dtype = resolve_dtype(dtype)
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype: a measure needs a floating-point dtype, got {dtype}")
    return dtype


def _sample_sphere(n, dim, radius, seed, dtype, device) -> torch.Tensor:
    device = check_device(device)
    check_positive_int(n, "n")
    check_positive_int(dim, "dim")
    R = check_radius(radius, "radius")
    _check_sample_memory(n, dim, dtype, "Measure.sphere / Measure.ball")
    g = make_generator(seed)
    Z = torch.randn(n, dim, generator=g, dtype=_measure_dtype(dtype) or torch.float64)
    norms = Z.norm(dim=1, keepdim=True)
    norms = torch.where(norms > 0, norms, torch.ones_like(norms))
    return into_ball(R * Z / norms, R).to(device or "cpu")   # computed norms <= R, as B_R promises


def _group_labels(X: np.ndarray, atol: float) -> np.ndarray:
    """Connected components of {i ~ j : max|X_i - X_j| <= atol}, labelled by first occurrence: exact duplicates
    for atol = 0, :func:`particles.linkage.linked_components` otherwise (memory O(N): every atom of a collapsed
    cloud within atol of every other is one group, not a list of N^2 / 2 pairs), and the list of pairs within atol
    where atol is below the resolution of the coordinates (only nearly coinciding atoms are linked: few pairs)."""
    from .linkage import first_occurrence, linked_components

    if atol == 0.0:
        groups = np.unique(X, axis=0, return_inverse=True)[1].reshape(-1)
    else:
        groups = linked_components(X, atol, p=math.inf, what=f"Measure.merge(atol={atol:g})")
    # groups numbered by their first atom, so that the original order is kept
    return first_occurrence(groups)
