r"""The transport problem between two measures for the cost \|x - y\|^2, in normalized units.

Every solver works on centred clouds scaled by a power of two, so that squared distances neither
overflow nor underflow the dtype: W2 is translation invariant and 1-homogeneous,
W2(s mu, s nu) = s W2(mu, nu), and scaling by 2^k is exact in floating point. Clouds of moderate
size (the usual case) are only centred: their results are bit-for-bit those of the unscaled problem.
"""

from __future__ import annotations

import copy
import math

import torch

from particles import Measure

from .options import TOL, UNIT_ROUNDOFF

#: Squared distances (d of them summed) stay far from the dtype's limits while the centred
#: coordinates lie in [2^SMALL, 2^BIG]; outside, the clouds are rescaled by a power of two.
_EXPONENT_RANGE = {dt: (math.frexp(torch.finfo(dt).tiny)[1] // 2 + 16, math.frexp(torch.finfo(dt).max)[1] // 2 - 16)
                   for dt in TOL}


def pot():
    """POT's ``ot`` module, imported where exact W2 or the dense Sinkhorn needs it (a dependency of the package;
    an image without it, such as a GPU machine's, still runs the streamed solvers and everything else)."""
    try:
        import ot
    except ImportError as exc:   # pragma: no cover - installed with the package
        raise ImportError("w2: exact W2 and the dense Sinkhorn need POT (pip install pot); method='streaming' runs "
                          "without it") from exc
    return ot


def check_pair(mu, nu) -> None:
    """Both arguments are Measures of one floating dtype (float32 or float64), dimension and device."""
    for name, m in (("mu", mu), ("nu", nu)):
        if not isinstance(m, Measure):
            raise TypeError(f"{name}: expected a particles.Measure, got {type(m).__name__} "
                            "(wrap arrays with Measure(points, weights))")
        if m.dtype not in TOL:
            raise TypeError(f"{name}: transport works in float32 or float64, got {m.dtype} "
                            f"(convert with {name}.to(dtype=torch.float64))")
    if mu.dim != nu.dim:
        raise ValueError(f"nu: dimension {nu.dim} differs from mu's dimension {mu.dim}")
    if mu.dtype != nu.dtype:
        raise TypeError(f"nu: dtype {nu.dtype} differs from mu's {mu.dtype} (convert with nu.to(dtype=...))")
    if mu.device != nu.device:
        raise ValueError(f"nu: device {nu.device} differs from mu's {mu.device} (move with nu.to(device=...))")


def same_atoms(x: torch.Tensor, la: torch.Tensor, y: torch.Tensor, lb: torch.Tensor):
    """Where (y, lb) holds the atoms of (x, la) in some order (exact equality of points and log-weights): the
    index of x's atom for each of y's (y = x[match], lb = la[match]), else None. On the tensors' device: one sort
    of the first coordinates rejects most unequal measures; the full test sorts lexicographically by coordinates
    and log-weight (d + 1 stable sorts, O(N log N))."""
    if x.shape != y.shape or la.shape != lb.shape or x.dim() != 2 or x.shape[0] == 0:
        return None
    x, la, y, lb = x.detach(), la.detach(), y.detach(), lb.detach()
    if not torch.equal(torch.sort(x[:, 0]).values, torch.sort(y[:, 0]).values):
        return None

    def order(p, lw):
        idx = torch.sort(lw, stable=True).indices   # the last key first: stable sorts build the lexicographic order
        for j in range(p.shape[1] - 1, -1, -1):
            idx = idx[torch.sort(p[idx, j], stable=True).indices]
        return idx

    ox, oy = order(x, la), order(y, lb)
    if not (torch.equal(x[ox], y[oy]) and torch.equal(la[ox], lb[oy])):
        return None
    match = torch.empty_like(oy)
    match[oy] = ox
    return match


def ldexp(t: torch.Tensor, k: int) -> torch.Tensor:
    """t * 2^k, exactly (steps of at most 2^60, so that no factor is subnormal in float32)."""
    while k:
        step = max(-60, min(60, k))
        t = t * 2.0 ** step
        k -= step
    return t


def _abs_max(*tensors: torch.Tensor) -> float:
    return max(float(t.detach().abs().max()) for t in tensors)


def normalize(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, b: torch.Tensor) -> tuple:
    r"""Centred clouds (x - c) / 2^k, (y - c) / 2^k and k, with c the mean of the two means.

    Centring removes most of the cancellation of \|x\|^2 + \|y\|^2 - 2<x, y> (relative error ~ machine
    epsilon times the squared diameter instead of times the largest \|x\|^2). k = 0 unless the centred
    coordinates leave [2^SMALL, 2^BIG], half the dtype's exponent range less a margin of 16 (so that
    squared distances, d of them summed, stay far from the dtype's limits). Keeps the autograd graph of x, y.
    """
    lo, hi = _EXPONENT_RANGE[x.dtype]
    k = 0
    big = _abs_max(x, y)
    if big > 2.0 ** hi:  # scale first: the centring itself would overflow
        k = math.frexp(big)[1]
        x, y = ldexp(x, -k), ldexp(y, -k)
    c = (0.5 * (a @ x + b @ y)).detach()
    x, y = x - c, y - c
    spread = _abs_max(x, y)
    if spread > 2.0 ** hi or 0.0 < spread < 2.0 ** lo:
        k2 = math.frexp(spread)[1]
        x, y, k = ldexp(x, -k2), ldexp(y, -k2), k + k2
    return x, y, k


def log_weights(m: Measure, dtype: torch.dtype) -> torch.Tensor:
    """The measure's log-weights in ``dtype``, normalized there: from its weights where they are normal
    numbers (float32's log(1/50) is rounded by 6e-8, enough to be seen in a marginal error of 1e-5),
    from its log-weights where the weights underflow; float32 weights summing to 1 within float32's
    rounding are renormalized to sum to 1 in float64."""
    if dtype == m.dtype:
        return m.log_weights
    normal = m.weights >= torch.finfo(m.dtype).tiny
    from_weights = torch.log(torch.where(normal, m.weights, torch.ones_like(m.weights)).to(dtype))
    lw = torch.where(normal, from_weights, m.log_weights.to(dtype))
    return lw - torch.logsumexp(lw, 0)


#: float32 weights whose sum (in float64) is further than this from 1 are renormalized for a solve (uniform
#: float32 weights 1/n round by at most 6e-8 in their sum)
MASS_DEFECT = 1e-7


def _mass_defect(m: Measure) -> float:
    return abs(float(m.weights.detach().to(torch.float64).sum()) - 1.0)


def needs_grad(*measures: Measure) -> bool:
    return any(m.points.requires_grad or m.weights.requires_grad for m in measures)


class Problem:
    r"""W2 between ``mu`` and ``nu`` (cost \|x - y\|^2), held in normalized units.

    ``x``, ``y``: the centred points divided by 2^``k`` (with the autograd graph of the measures'
    points); ``a``, ``b`` and ``log_a``, ``log_b``: the weights; a squared distance of the problem is
    4^k times one of the normalized clouds. ``dtype``: the precision these tensors are held in (the
    measures' own, ``input_dtype``, unless :meth:`to` changed it). Holds no solver state and no option.
    ``caller``: the function the user called ("w2", "solve", ...), which the solvers' messages name.
    """

    caller = "w2"

    def __init__(self, mu: Measure, nu: Measure):
        check_pair(mu, nu)
        self.mu, self.nu = mu, nu
        self.a, self.b = mu.weights, nu.weights
        self.log_a, self.log_b = mu.log_weights, nu.log_weights
        if mu.dtype == torch.float32 and max(_mass_defect(mu), _mass_defect(nu)) > MASS_DEFECT:
            # a float32 measure's weights sum to 1 within 1e-5 (what Measure accepts): renormalized in float64,
            # or the two marginals' masses differ by up to 2e-5 and no plan meets tol = 1e-5. Weights summing to
            # 1 within float32's rounding are used as given
            self.log_a, self.log_b = (log_weights(m, torch.float64).to(torch.float32) for m in (mu, nu))
            self.a, self.b = self.log_a.exp(), self.log_b.exp()
        self.x, self.y, self.k = normalize(mu.points, self.a, nu.points, self.b)
        self.grad = needs_grad(mu, nu)
        self.dtype = mu.dtype

    def plain_points(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The points as given when no rescaling is needed (k = 0), else the normalized ones.

        For the closed forms that difference points directly (d = 1 quantiles, one-atom slices):
        they then round exactly as the formula written on the user's points.
        """
        if self.k == 0:
            return self.mu.points.to(self.dtype), self.nu.points.to(self.dtype)
        return self.x, self.y

    def to(self, dtype: torch.dtype) -> Problem:
        """The same problem held in ``dtype``, with the same scale 2^k (so that eps and potentials carry over).

        The clouds are centred anew from the measures' points in ``dtype``: float32 points centred in
        float32 are rounded by ~6e-8 of their size, as much as the distances of close clouds can afford.
        The autograd graph of the points and weights is kept.
        """
        if dtype == self.dtype:
            return self
        out = copy.copy(self)
        out.log_a, out.log_b = log_weights(self.mu, dtype), log_weights(self.nu, dtype)
        out.a, out.b = out.log_a.exp(), out.log_b.exp()
        # the scale 2^k suits the narrower dtype, hence the wider one; scaling by it is exact
        x, y = ldexp(self.mu.points.to(dtype), -self.k), ldexp(self.nu.points.to(dtype), -self.k)
        c = (0.5 * (out.a @ x + out.b @ y)).detach()
        out.x, out.y = x - c, y - c
        out.dtype = dtype
        return out

    def precision(self, reg: float, tol: float) -> torch.dtype:
        """The dtype an entropic solve at ``reg`` works in to certify the marginal error ``tol``: the
        measures' own, or float64 where float32 cannot resolve the plan.

        The plan pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps) is formed from costs and potentials of
        magnitude up to the squared diameter D2 of the clouds, each held to about u D2 in a dtype of unit
        roundoff u: the exponents carry an absolute error of order u D2 / eps, and the plan's masses a
        relative one of that order. A dtype can certify an L1 marginal error ``tol`` only where
        u D2 / eps <= tol. float32 (u = 6e-8) at its default tol = 1e-5 resolves D2 / eps up to about 170
        (a blur sqrt(reg) above 8% of the diameter); beyond, float32 iterates judge their marginals with
        their own rounding and can report a wrong value as converged (cost / eps ~ 1e7 gave a value 15%
        below W2 with error 0), so the solve runs in float64. float64 (u = 1.1e-16) resolves D2 / eps up
        to ~1e9 at tol = 1e-7; it is kept whatever the ratio (there is no wider dtype).

        Large reg has the opposite limit: the solvers hold a potential f as the log-scaling log a + f / eps, so f is
        known to about ``u eps (1 + max abs(log a))``, and the value, made of potentials, carries that error; a dtype
        is used only where it stays below tol D2. float32 at tol = 1e-5 resolves eps / D2 up to about 30 with
        uniform weights on 100 atoms, beyond which the solve runs in float64; where float64 does not resolve it
        either (eps / D2 above about 1e8 at tol = 1e-7), a ValueError names reg (the review's translate at
        eps / D2 = 1e12 was off by 0.4-1.2%, at 1e20 it came out 0, converged).
        """
        if self.input_dtype not in (torch.float32, torch.float64):
            return self.input_dtype
        try:
            eps = math.ldexp(reg, -2 * self.k)
        except OverflowError:
            return self.input_dtype
        D2 = self.squared_diameter()
        # large reg: the solvers hold a potential f as the log-scaling log a + f / eps, to about u eps |log a|, and
        # the value is made of such potentials: beyond tol D2 that resolution is the value's error (a review:
        # reg / D2 = 1e12 in float64 put 0.4-1.2% on a translate's W2, 1e20 gave 0; float32 erred 2e-4 at 1e2)
        logs = torch.cat([self.log_a[self.log_a > -math.inf], self.log_b[self.log_b > -math.inf]]).detach()
        spread = 1.0 + float(logs.abs().max()) if logs.numel() else 1.0

        def potentials_resolved(dtype):   # large reg
            return UNIT_ROUNDOFF[dtype] * eps * spread <= tol * D2

        def resolves(dtype):   # the plan's exponents (small reg) and the potentials
            return eps > 0 and UNIT_ROUNDOFF[dtype] * D2 <= tol * eps and potentials_resolved(dtype)

        if D2 == 0.0 or resolves(self.input_dtype):
            return self.input_dtype
        if self.input_dtype == torch.float32 and resolves(torch.float64):
            return torch.float64
        if not potentials_resolved(torch.float64):
            raise ValueError(
                f"reg: reg = {reg:.3g} is {eps / D2:.3g} times the clouds' squared diameter: the potentials, held as "
                "log-scalings log a + f / reg, resolve f only to about "
                f"{UNIT_ROUNDOFF[torch.float64] * eps * spread:.2g} (in normalized units), above tol x squared "
                f"diameter = {tol * D2:.2g}, and the value would be that "
                "rounding; use a smaller reg (entropic OT at reg >> squared diameter is about the mean squared "
                "distance under the independent coupling)")
        return torch.float64

    n = property(lambda self: self.mu.n)
    m = property(lambda self: self.nu.n)
    dim = property(lambda self: self.mu.dim)
    input_dtype = property(lambda self: self.mu.dtype)
    device = property(lambda self: self.mu.device)

    def support_points(self) -> torch.Tensor:
        """The atoms of positive mass of both measures (a zero-weight atom changes neither), normalized units."""
        return torch.cat([self.x.detach()[self.log_a > -math.inf], self.y.detach()[self.log_b > -math.inf]])

    def squared_diameter(self) -> float:
        """Squared diagonal of the box holding both supports (atoms of positive mass), normalized units."""
        both = self.support_points()
        return float(((both.max(0).values - both.min(0).values) ** 2).sum())

    def eps(self, reg: float) -> float:
        """The entropic regularization in normalized units, reg / 4^k, checked to be representable.

        exp(-C / eps) is formed in the problem's ``dtype`` (after :meth:`precision`, float64 for float32
        measures that float32 cannot resolve): C / eps must stay well inside its range.
        """
        try:
            eps = math.ldexp(reg, -2 * self.k)  # underflows to 0.0, or overflows (tiny clouds)
        except OverflowError:
            eps = math.inf
        # normalized squared distances are at most ~diam2 (one unit of 4^k when the points coincide)
        diam2 = max(self.squared_diameter(), 1.0) if self.squared_diameter() > 0 else 1.0
        limit = torch.finfo(self.dtype).max / 2 ** 10
        if eps > 0 and diam2 / eps < limit and eps < limit:
            return eps
        try:
            ratio = f"{math.ldexp(reg / diam2, -2 * self.k):.3g}"
        except OverflowError:
            ratio = "> 1e308"
        ratio = "< 1e-308" if ratio == "0" else ratio
        side = "below" if not (eps > 0 and diam2 / eps < limit) else "above"
        if side == "below":
            what = "use a larger reg" + (", float64" if self.dtype == torch.float32 else "") + " or method='exact'"
        else:
            what = "use a smaller reg"
        raise ValueError(f"reg: reg / squared diameter ({ratio}) is {side} what exp(-|x - y|^2 / reg) resolves in "
                         f"{self.dtype} (reg = {reg:.3g}, coordinates up to ~2^{self.k}); {what}")

    def reg(self, eps: float) -> float:
        """eps (normalized units) back in squared-distance units."""
        try:
            return math.ldexp(eps, 2 * self.k)
        except OverflowError:
            return math.inf


#: :func:`sq_dists` recomputes from the differences every entry below this fraction of \|x_i\|^2 + \|y_j\|^2.
#: The matrix product's rounding (about (d + 2) u (\|x_i\|^2 + \|y_j\|^2)) is then at most (d + 2) u / 2^-10 of
#: the entries it keeps, 7e-12 relative in float64 at d = 64.
CANCELLATION = 2.0 ** -10
#: Pairs recomputed at once (their differences take d times as many numbers).
RECOMPUTE_CHUNK = 2 ** 16


def sq_dists(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r"""Dense matrix \|x_i - y_j\|^2 (N, M), differentiable, never negative, accurate for close points.

    \|x\|^2 + \|y\|^2 - 2<x, y> (one matrix product) loses the distance of close points to cancellation:
    a relative error of about u (R / delta)^2 for points of norm R at distance delta (u the unit
    roundoff: 1e-4 at delta = 1e-6 R in float64, 1.6% at delta = 1e-3 R in float32). The entries where
    that cancellation is severe (below :data:`CANCELLATION` times \|x_i\|^2 + \|y_j\|^2: pairs much closer
    to each other than to the origin, usually a few per row) are recomputed from the differences
    x_i - y_j, so that every entry is within a few roundings of its value, at the cost of the product.
    """
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    scale = xx[:, None] + yy[None, :]
    C = torch.addmm(scale, x, y.T, alpha=-2.0)
    i, j = torch.nonzero(C.detach() < CANCELLATION * scale.detach(), as_tuple=True)
    if i.numel():
        exact = torch.cat([((x[i[s:s + RECOMPUTE_CHUNK]] - y[j[s:s + RECOMPUTE_CHUNK]]) ** 2).sum(1)
                           for s in range(0, i.numel(), RECOMPUTE_CHUNK)])
        C = C.index_put((i, j), exact)
    return C.clamp_min(0.0)


def sqrt0(v: torch.Tensor) -> torch.Tensor:
    """sqrt(max(v, 0)) with gradient 0 at 0 (the subgradient of W2 at mu = nu), never NaN."""
    pos = v > 0
    return torch.where(pos, torch.where(pos, v, torch.ones_like(v)).sqrt(), torch.zeros_like(v))


def to_units(value_sq: torch.Tensor, k: int, grad: bool):
    """(W2, W2^2) in the problem's units from a normalized squared value.

    Floats, or 0-d tensors with the autograd graph when ``grad``. A value beyond the floating range
    raises OverflowError (W2) or is ``math.inf`` (W2^2, which overflows first: see ``squared``).
    """
    value_sq = value_sq.clamp_min(0.0)  # entropic estimates may dip below zero by the tolerance
    if grad:
        root = ldexp(sqrt0(value_sq), k)
        square = ldexp(value_sq, 2 * k)
        if not bool(torch.isfinite(root)):
            raise OverflowError(f"W2 = {math.sqrt(float(value_sq))} * 2^{k} exceeds the range of {root.dtype}")
        return root, (square if bool(torch.isfinite(square)) else math.inf)
    v = float(value_sq.detach())
    try:
        # torch's sqrt in the tensor's dtype, as the values have always been computed (math.sqrt may differ
        # in the last bit, which would change every table written from them)
        root = math.ldexp(float(sqrt0(value_sq.detach())), k)
    except OverflowError:
        raise OverflowError(f"W2 = {math.sqrt(v)} * 2^{k} exceeds the float range") from None
    try:
        square = math.ldexp(v, 2 * k)
    except OverflowError:
        square = math.inf
    return root, square
