"""Conditional W2 of masked measures on [0, 1] x R^d (Definition 4.1, docs/math.md section 3)."""

from __future__ import annotations

import math

import torch

from particles import Measure
from particles.validation import check_allocation, check_bool, check_positive_float, weight_tolerance

from .exact import EMD_BYTES_PER_PAIR, emd_squared
from .options import check_memory_limit
from .problem import check_pair, log_weights, needs_grad, normalize, to_units

#: Default tolerance on positions in float64 (two positions closer than this are the same position); positions
#: held in float32 (float32 and half-precision measures) take 4 of their epsilons (5e-7): one rounding of i/n
#: made two copies of a sequence's positions differ by 6e-8, and W2c infinite
POSITION_ATOL = 1e-9
#: Default tolerance on the masses of the position marginals of float64 measures; float32 measures take their
#: weights' tolerance (:func:`particles.validation.weight_tolerance`, 1e-5): a split atom's masses summed in
#: float32 differ from the unsplit mass by a rounding, which made W2c(mu, mu.split(...)) infinite
MASS_ATOL = 1e-9


def _default_tolerances(mu: Measure, atol, mass_atol) -> tuple:
    """(group, match, mass): the gap that joins positions of one measure, the distance within which the two
    marginals' positions count as the same, the tolerance on their masses. Without ``atol``, a measure's positions
    are grouped only where equal (as the causal mask sees them: positions a float32 mask keeps apart, 3e-7 near
    0.01, or i/n for n above 2e6, were merged by a default gap of 5e-7), and the marginals matched within the
    default tolerance (the roundings of i/n computed two ways)."""
    group = match = atol
    if atol is None:
        group, match = 0.0, max(POSITION_ATOL, 4 * torch.finfo(mu.positions.dtype).eps)   # float64: POSITION_ATOL
    if mass_atol is None:
        mass_atol = max(MASS_ATOL, weight_tolerance(mu.dtype))
    return group, match, mass_atol


def conditional_w2(mu: Measure, nu: Measure, *, atol=None, mass_atol=None, squared=False,
                   return_plan=False, memory_limit=None):
    """W2c(mu, nu)^2 = sum over distinct positions s of m(s) W2(mu_s, nu_s)^2 (Definition 4.1).

    Each slice (the renormalized atoms of mu and nu at one position s) is solved exactly (POT's
    network simplex; one-atom slices in closed form), so no mass ever crosses positions. For two
    sequences with positions i/n, W2c is the Frobenius norm of X - Y divided by sqrt(n). Computed in
    float64 whatever the dtype, the costs of close pairs from their differences, as exact W2 is
    (see :func:`transport.solve`).

    Parameters
    ----------
    mu, nu : :class:`particles.Measure`
        Masked measures (every atom with a position), of the same dimension, dtype (float32 or float64)
        and device.
    atol : float or None
        Positions closer than ``atol`` (>= 0) count as one position (the marginal of ``mu`` groups them,
        chaining gaps <= atol); the two marginals must have the same positions within ``atol``, a group counting
        as its first (smallest) position: ``mu`` at 0, 0.1, 0.2 (one chain at atol 0.11, at 0) against ``nu`` at
        0.2 is infinite, though both cover 0.2 (each measure is grouped on its own: a joint grouping would chain
        ``mu`` at 0, 0.1 with ``nu`` at 0.05, 0.15 into one position at atol 0.06, where each is two). None: each
        measure's atoms are grouped by equal positions only (the positions the causal mask tells apart are apart
        here too), and the two marginals' positions must agree within :data:`POSITION_ATOL` for float64
        positions, 4 epsilons of float32 (5e-7) for float32 ones (i/n computed in two ways differs by a rounding).
    mass_atol : float or None
        ... and the same masses within ``mass_atol`` (>= 0); None: :data:`MASS_ATOL` in float64, the
        weights' tolerance of the measures' dtype otherwise (1e-5 in float32). Otherwise the value is ``math.inf``: no
        coupling keeps every position. ``mass_atol`` compares the masses of positions both measures occupy: a
        position that holds mass (however little) in one measure and none in the other gives ``math.inf``.
        Where the masses at a position differ (within ``mass_atol``), each measure's slice is renormalized by
        its own mass and the slice counts with the mean of the two masses, so that W2c(mu, nu) = W2c(nu, mu).
    squared : bool
        Return W2c^2.
    return_plan : bool
        Also return the block-diagonal (N, M) coupling (None when the value is infinite).
    memory_limit : int or str
        Bytes (or "16G") one slice's network simplex, or the plan, may take (see :func:`transport.solve`).

    Returns
    -------
    float
        Or a 0-d tensor carrying the autograd graph when points require grad.
    """
    check_pair(mu, nu)
    for name, m in (("mu", mu), ("nu", nu)):
        if not m.masked:
            raise ValueError(f"{name}: conditional W2 needs a masked measure with positions "
                             "(build it with positions=... or Measure.sequence)")
    if atol is not None:
        atol = check_positive_float(atol, "atol", allow_zero=True, allow_inf=True)
    group, atol, mass_atol = _default_tolerances(mu, atol, mass_atol)
    mass_atol = check_positive_float(mass_atol, "mass_atol", allow_zero=True, allow_inf=True)
    squared = check_bool(squared, "squared")
    return_plan = check_bool(return_plan, "return_plan")
    limit = check_memory_limit(memory_limit)
    if return_plan:
        check_allocation(mu.n * nu.n * mu.points.element_size(), f"the plan of conditional_w2 between {mu.n} "
                         f"and {nu.n} atoms", "ask for the value only (return_plan=False)", limit)
    grad = needs_grad(mu, nu)
    s_mu, m_mu, g_mu = mu.position_groups(group, "conditional_w2")
    s_nu, m_nu, g_nu = nu.position_groups(group, "conditional_w2")
    # marginals are compared on atoms of positive mass only: zero-mass atoms carry no position law
    keep_mu, keep_nu = m_mu > 0, m_nu > 0
    s_mu, m_mu = s_mu[keep_mu], m_mu[keep_mu]
    s_nu, m_nu = s_nu[keep_nu], m_nu[keep_nu]
    if (s_mu.shape != s_nu.shape or bool(((s_mu - s_nu).abs() > atol).any())
            or bool(((m_mu - m_nu).detach().abs() > mass_atol).any())):
        return (math.inf, None) if return_plan else math.inf
    # in float64 whatever the dtype: the slices' network simplex works in float64, and a float32 cost
    # matrix (or centring) would lose the distances of close clouds
    x, y, k = normalize(mu.points.to(torch.float64), mu.weights.to(torch.float64),
                        nu.points.to(torch.float64), nu.weights.to(torch.float64))
    if k == 0:  # no rescaling needed: difference the points as given (see Problem.plain_points)
        x, y = mu.points.to(torch.float64), nu.points.to(torch.float64)
    n_pos = s_mu.shape[0]
    # each atom's group: its own measure's group (the i-th groups of both measures are the same position
    # within atol); an atom of a group of zero mass, the nearest kept group (it carries no mass)
    gx = _groups(g_mu, keep_mu, s_mu, mu.positions)
    gy = _groups(g_nu, keep_nu, s_mu, nu.positions)
    # each slice renormalized by its own measure's mass at s (mass_atol lets the two differ), weighted by the
    # mean of the two masses: a symmetric W2c, equal to Definition 4.1's where the marginals agree
    mx, my = m_mu.to(torch.float64), m_nu.to(torch.float64)
    m64 = 0.5 * (mx + my)
    lx = log_weights(mu, torch.float64) - torch.log(mx)[gx]
    ly = log_weights(nu, torch.float64) - torch.log(my)[gy]
    plan = torch.zeros(mu.n, nu.n, dtype=mu.dtype, device=mu.device) if return_plan else None
    count_x = torch.bincount(gx, minlength=n_pos)
    count_y = torch.bincount(gy, minlength=n_pos)
    single = (count_x == 1) & (count_y == 1)
    total = x.new_zeros(())
    if bool(single.any()):
        # one atom on each side at a position: the only coupling moves it to the other, vectorized
        ix = torch.nonzero(single[gx])[:, 0]
        iy = torch.nonzero(single[gy])[:, 0]
        ix, iy = ix[torch.argsort(gx[ix])], iy[torch.argsort(gy[iy])]
        total = total + (m64[gx[ix]] * ((x[ix] - y[iy]) ** 2).sum(1)).sum()
        if plan is not None:
            plan[ix, iy] = m64[gx[ix]].to(mu.dtype)
    slices = torch.nonzero(~single)[:, 0]
    if slices.numel():
        # every slice is solved exactly (network simplex): refuse the largest before any work, with what the
        # caller of conditional_w2 can change (emd_squared's own message names methods conditional_w2 lacks)
        pairs = count_x[slices] * count_y[slices]
        big = int(slices[torch.argmax(pairs)])
        n_big, m_big = int(count_x[big]), int(count_y[big])
        check_allocation(EMD_BYTES_PER_PAIR * n_big * m_big,
                         f"conditional_w2: the exact transport of the slice at position {float(s_mu[big]):.6g} "
                         f"({n_big} atoms of mu, {m_big} of nu; {n_pos} positions)",
                         "conditional W2 solves every slice exactly (there is no streaming or approximate "
                         "method for it): put fewer atoms at each position, or raise the memory limit where "
                         "the machine has the memory", limit)
    # the atoms of each slice, by one stable sort of the groups (in increasing index within a slice, as
    # torch.nonzero(gx == s) gives them): O(N log N) for all slices, instead of a scan of all atoms per slice
    order_x, order_y = torch.argsort(gx, stable=True), torch.argsort(gy, stable=True)
    start_x = (torch.cumsum(count_x, 0) - count_x).tolist()
    start_y = (torch.cumsum(count_y, 0) - count_y).tolist()
    cx, cy = count_x.tolist(), count_y.tolist()
    for s in slices.tolist():
        ix = order_x[start_x[s]:start_x[s] + cx[s]]
        iy = order_y[start_y[s]:start_y[s] + cy[s]]
        a, b = lx[ix].exp(), ly[iy].exp()
        # centred on the slice, as for any exact solve (see transport.problem.normalize)
        c = (0.5 * (a @ x[ix] + b @ y[iy])).detach()
        value, p, _ = emd_squared(x[ix] - c, a, y[iy] - c, b, return_plan=return_plan, memory_limit=limit)
        total = total + m64[s] * value
        if plan is not None:
            plan[ix[:, None], iy[None, :]] = (m64[s] * p.detach()).to(mu.dtype)
    value, value_sq = to_units(total.to(mu.dtype) if grad else total, k, grad)
    if squared and not isinstance(value_sq, torch.Tensor) and math.isinf(value_sq):
        raise OverflowError(f"squared: W2c^2 = ({float(value):.6g})^2 exceeds the float range; "
                            "ask for W2c (squared=False)")
    out = value_sq if squared else value
    return (out, plan) if return_plan else out


def _groups(labels: torch.Tensor, keep: torch.Tensor, kept_positions: torch.Tensor, positions: torch.Tensor):
    """Each atom's index among the kept (positive-mass) groups: its group's, or for an atom of a dropped group
    the nearest kept position's."""
    index = torch.cumsum(keep.long(), 0) - 1
    out = index[labels]
    dropped = ~keep[labels]
    if bool(dropped.any()):
        out = torch.where(dropped, _nearest(kept_positions, positions), out)
    return out


def _nearest(grid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``grid`` for each value."""
    v = values.detach().contiguous()
    hi = torch.searchsorted(grid.contiguous(), v).clamp(max=grid.shape[0] - 1)
    lo = (hi - 1).clamp(min=0)
    return torch.where((v - grid[lo]).abs() <= (grid[hi] - v).abs(), lo, hi)
