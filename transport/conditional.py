"""Conditional W2 of masked measures on [0, 1] x R^d (Definition 4.1, MATH.md section 3)."""

from __future__ import annotations

import math

import torch

from particles import Measure

from ._common import check_pair, finish, needs_grad

#: Default tolerance on positions (two positions closer than this are the same position).
POSITION_ATOL = 1e-9
#: Default tolerance on the masses of the position marginals.
MASS_ATOL = 1e-9


def conditional_w2(mu: Measure, nu: Measure, *, atol: float = POSITION_ATOL, mass_atol: float = MASS_ATOL,
                   squared: bool = False, return_plan: bool = False):
    """W2c(mu, nu)^2 = sum over distinct positions s of m(s) W2(mu_s, nu_s)^2 (Definition 4.1).

    Both measures must be masked (carry positions). Their position marginals m are compared:
    positions closer than ``atol`` count as one position (the marginal of ``mu`` groups them,
    chaining gaps <= atol), and the two marginals must have the same positions within ``atol``
    and the same masses within ``mass_atol``; otherwise the value is ``math.inf`` (no coupling
    keeps every position). Each slice mu_s, nu_s (renormalized atoms at s) is solved exactly
    (POT network simplex; one-atom slices in closed form), so no mass ever crosses positions.

    For two sequences with positions i/n, W2c = ||X - Y|| / sqrt(n). Returns a float (0-d tensor
    if points require grad), W2c^2 when ``squared``, and with ``return_plan`` the block-diagonal
    (N, M) coupling (None when the value is infinite).
    """
    from .exact import w2_squared_exact

    check_pair(mu, nu)
    for name, m in (("mu", mu), ("nu", nu)):
        if not m.masked:
            raise ValueError(f"{name}: conditional W2 needs a masked measure with positions "
                             "(build it with positions=... or Measure.sequence)")
    atol, mass_atol = float(atol), float(mass_atol)
    if not (atol >= 0 and mass_atol >= 0):
        raise ValueError(f"atol, mass_atol: expected non-negative tolerances, got {atol}, {mass_atol}")
    grad = needs_grad(mu, nu)
    s_mu, m_mu = mu.position_marginal(atol)
    s_nu, m_nu = nu.position_marginal(atol)
    # marginals are compared on atoms of positive mass only: zero-mass atoms carry no position law
    s_mu, m_mu = s_mu[m_mu > 0], m_mu[m_mu > 0]
    s_nu, m_nu = s_nu[m_nu > 0], m_nu[m_nu > 0]
    if (s_mu.shape != s_nu.shape or bool(((s_mu - s_nu).abs() > atol).any())
            or bool(((m_mu - m_nu).detach().abs() > mass_atol).any())):
        return (math.inf, None) if return_plan else math.inf
    k = s_mu.shape[0]
    # each atom's group: the nearest marginal position (atoms of zero mass included)
    gx = _nearest(s_mu, mu.positions)
    gy = _nearest(s_mu, nu.positions)
    lx = mu.log_weights - torch.log(m_mu)[gx]
    ly = nu.log_weights - torch.log(m_mu)[gy]
    plan = torch.zeros(mu.n, nu.n, dtype=mu.dtype, device=mu.device) if return_plan else None
    count_x = torch.bincount(gx, minlength=k)
    count_y = torch.bincount(gy, minlength=k)
    single = (count_x == 1) & (count_y == 1)
    total = mu.points.new_zeros(())
    if bool(single.any()):
        # one atom on each side at a position: the only coupling moves it to the other, vectorized
        ix = torch.nonzero(single[gx])[:, 0]
        iy = torch.nonzero(single[gy])[:, 0]
        ix, iy = ix[torch.argsort(gx[ix])], iy[torch.argsort(gy[iy])]
        total = total + (m_mu[gx[ix]] * ((mu.points[ix] - nu.points[iy]) ** 2).sum(1)).sum()
        if plan is not None:
            plan[ix, iy] = m_mu[gx[ix]].detach()
    for s in torch.nonzero(~single)[:, 0].tolist():
        ix = torch.nonzero(gx == s)[:, 0]
        iy = torch.nonzero(gy == s)[:, 0]
        a = Measure._trusted(mu.points[ix], lx[ix].exp(), lx[ix], None)
        b = Measure._trusted(nu.points[iy], ly[iy].exp(), ly[iy], None)
        value, p = w2_squared_exact(a, b, return_plan)
        total = total + m_mu[s] * value
        if plan is not None:
            plan[ix[:, None], iy[None, :]] = m_mu[s].detach() * p.detach()
    out = finish(total, squared, grad)
    return (out, plan) if return_plan else out


def _nearest(grid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``grid`` for each value."""
    v = values.detach().contiguous()
    hi = torch.searchsorted(grid.contiguous(), v).clamp(max=grid.shape[0] - 1)
    lo = (hi - 1).clamp(min=0)
    return torch.where((v - grid[lo]).abs() <= (grid[hi] - v).abs(), lo, hi)
