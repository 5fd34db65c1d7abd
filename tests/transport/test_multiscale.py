"""Coarse-to-fine annealing of the streaming Sinkhorn (transport/multiscale.py): the clusters, which levels run
on them, and whole solves that start from them.

Truths: block means, masses and spreads computed point by point in numpy; the soft c-transform summed densely
in numpy float64; the solver without the coarse start (the same value within tol) and the dense float64
marginals of the returned plan (the reported error must bound them whatever the start); the count of passes
over the points (the coarse levels must not touch them).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from particles import Measure
from tests.transport.helpers import plan_marginal_error
from transport import multiscale, solve, streaming_sinkhorn, truncation

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _cloud(n, d, seed, scale=1.0, shift=0.0):
    return scale * torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64) + shift


def test_clusters_are_the_blocks_weighted_means_masses_and_spread():
    n, size = 203, 16                       # a last block of 11 points
    x = _cloud(n, 3, 0)
    log_a = torch.log_softmax(torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=F64), 0)
    centres, log_mass, radius = multiscale.clusters(x, log_a, size)
    X, a = x.numpy(), log_a.exp().numpy()
    assert centres.shape == (13, 3) and log_mass.shape == (13,)
    spread = 0.0
    for b in range(13):
        s = slice(b * size, min(n, (b + 1) * size))
        mass = a[s].sum()
        centre = (a[s, None] * X[s]).sum(0) / mass
        np.testing.assert_allclose(centres[b].numpy(), centre, rtol=1e-12, atol=1e-14)
        assert float(log_mass[b]) == pytest.approx(math.log(mass), rel=1e-12)
        spread += (a[s] * ((X[s] - centre) ** 2).sum(1)).sum()
    assert radius == pytest.approx(math.sqrt(spread / a.sum()), rel=1e-12)


def test_levels_run_coarse_while_their_blur_is_at_least_scale_radii(monkeypatch):
    monkeypatch.setattr(multiscale, "SCALE", 2.0)
    levels = [4.0, 1.0, 0.25, 0.0625, 0.015625]
    assert multiscale.coarse_levels(levels, 0.25) == 3       # sqrt(e) >= 0.5: 2, 1, 0.5
    assert multiscale.coarse_levels(levels, 1.1) == 0
    assert multiscale.coarse_levels(levels, 0.0) == 5
    assert multiscale.applies(10**5, 10**5, 3) and not multiscale.applies(10**5, 10**5, truncation.MAX_DIM + 1)
    assert not multiscale.applies(1000, 1000, 3)
    # on CUDA from 8x truncation's smallest size (an H200 solved N = 2e4 faster with the fine annealing)
    assert multiscale.applies(2 * 10**4, 2 * 10**4, 3) and not multiscale.applies(2 * 10**4, 2 * 10**4, 3, "cuda")
    big = truncation.MIN_ENTRIES * multiscale.CUDA_FACTOR
    assert multiscale.applies(big // 256, 256, 3, "cuda") and not multiscale.applies(big // 256 - 1, 256, 3, "cuda")
    assert multiscale.applies(10**5, 10**5, 3, torch.device("cuda"))
    monkeypatch.setattr(multiscale, "ENABLED", False)
    assert not multiscale.applies(10**5, 10**5, 3)


def test_the_coarse_start_is_the_soft_c_transform_of_the_coarse_potentials(monkeypatch):
    """start_pair's potentials on the points: f_i = -e log sum_J b_J exp((g_J - |x_i - y_J|^2) / e) over the
    other side's centres, with the centres' own potentials after the coarse levels (recomputed here in numpy
    from the same updates)."""
    monkeypatch.setattr(multiscale, "SCALE", 1.0)
    x, y = _cloud(256, 2, 2), _cloud(192, 2, 3, shift=0.2)
    log_a, log_b = torch.full((256,), -math.log(256), dtype=F64), torch.full((192,), -math.log(192), dtype=F64)
    levels = [2.0, 0.5, 0.125, 0.03125]
    f, g, count = multiscale.start_pair(x, y, log_a, log_b, levels, 10**6)
    xc, lac, rx = multiscale.clusters(x, log_a)
    yc, lbc, ry = multiscale.clusters(y, log_b)
    assert count == multiscale.coarse_levels(levels, max(rx, ry)) and 0 < count < len(levels)
    Xc, Yc, la, lb = xc.numpy(), yc.numpy(), lac.numpy(), lbc.numpy()
    C = ((Xc[:, None] - Yc[None]) ** 2).sum(-1)
    fc, gc = np.zeros(len(Xc)), np.zeros(len(Yc))
    for e in levels[:count]:
        fc = -e * logsumexp(lb[None] + (gc[None] - C) / e, axis=1)
        gc = -e * logsumexp(la[:, None] + (fc[:, None] - C) / e, axis=0)
    e = levels[count - 1]
    X, Y = x.numpy(), y.numpy()
    want_f = -e * logsumexp(lb[None] + (gc[None] - ((X[:, None] - Yc[None]) ** 2).sum(-1)) / e, axis=1)
    want_g = -e * logsumexp(la[None] + (fc[None] - ((Y[:, None] - Xc[None]) ** 2).sum(-1)) / e, axis=1)
    np.testing.assert_allclose(f.numpy(), want_f, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g.numpy(), want_g, rtol=1e-10, atol=1e-12)


@pytest.fixture
def coarse(monkeypatch):
    """The coarse start at small sizes (every problem size, clusters of 16), truncation off; counts the passes
    of the solver's own updates over the points."""
    monkeypatch.setattr(truncation, "MIN_ENTRIES", 0)
    monkeypatch.setattr(truncation, "ENABLED", False)
    monkeypatch.setattr(multiscale, "CLUSTER", 16)
    monkeypatch.setattr(multiscale, "SCALE", 1.0)
    passes = {"points": 0, "coarse": []}
    update = streaming_sinkhorn.update

    def spy(x, xx, y, yy, *a):
        passes["points"] += 1
        return update(x, xx, y, yy, *a)

    monkeypatch.setattr(streaming_sinkhorn, "update", spy)
    for name in ("start_pair", "start_symmetric"):
        real = getattr(multiscale, name)

        def counted(*a, real=real):
            out = real(*a)
            passes["coarse"].append(out[-1])
            return out

        monkeypatch.setattr(multiscale, name, counted)
    return passes


@pytest.mark.parametrize("debias", [False, True])
def test_a_solve_from_the_coarse_start_matches_the_fine_one_and_certifies_the_whole_plan(coarse, monkeypatch,
                                                                                         debias):
    # spread clouds (diameter 4 against a blur of 0.07): several annealing levels run coarse
    mu, nu = Measure(_cloud(500, 2, 8, scale=4.0)), Measure(_cloud(450, 2, 9, scale=4.0, shift=0.1))
    reg, tol = 0.005, 1e-6
    got = solve(mu, nu, "streaming", reg=reg, debias=debias, tol=tol)
    assert got.converged and got.error <= tol
    assert len(coarse["coarse"]) == (3 if debias else 1) and min(coarse["coarse"]) >= 3
    if not debias:
        assert plan_marginal_error(mu, nu, *got.potentials, reg) <= got.error * (1 + 1e-9) + 1e-14
    with_coarse = coarse["points"]
    monkeypatch.setattr(multiscale, "ENABLED", False)
    coarse["points"] = 0
    fine = solve(mu, nu, "streaming", reg=reg, debias=debias, tol=tol)
    assert got.value_squared == pytest.approx(fine.value_squared, rel=1e-5)
    # the coarse levels never touch the points: the annealing's passes are gone (the iterations at reg may differ)
    levels = len(streaming_sinkhorn._schedule(mu.points, nu.points, reg, 0.5, 5000)) - 1
    assert coarse["coarse"][0] <= levels
    assert with_coarse < coarse["points"]


def test_a_float32_solve_from_the_coarse_start_is_still_certified_in_float64(coarse):
    mu, nu = Measure(_cloud(400, 3, 12).float()), Measure(_cloud(380, 3, 13, shift=0.2).float())
    got = solve(mu, nu, "streaming", reg=0.01, debias=False, tol=1e-3)
    assert got.converged and coarse["coarse"] and coarse["coarse"][0] >= 1
    # the returned float32 potentials are the certified ones rounded: (|f| + |g|) / reg < 100, so each plan entry
    # moves by at most 100 x 2^-24 relative, the two marginals' L1 error by at most 2 x 6e-6
    assert got.error <= 1e-3 and plan_marginal_error(mu, nu, *got.potentials, 0.01) <= got.error + 1.2e-5
