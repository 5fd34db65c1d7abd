"""transport: w2 (exact, 1-D, POT Sinkhorn, streaming, auto) and conditional_w2 (issue 2, issue 7).

Truths: scipy.optimize.linear_sum_assignment (uniform equal-size clouds), closed forms (Diracs,
translations, sorted 1-D formula, Bures distance of Gaussians, ||X - Y|| / sqrt(n) for
sequences), POT's dense log-domain Sinkhorn for the streaming solver, finite differences for
gradients, metric axioms (hypothesis) and inequalities (entropic plan cost >= W2^2, W2c >= W2).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

import transport.api
from particles import Measure
from transport import SinkhornConvergenceWarning, conditional_w2, sinkhorn_streaming, w2

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small matrices: intra-op threads only add synchronization cost (and the CI machine is shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rand(n, d, seed=0, scale=1.0):
    return scale * torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rand_weights(n, seed=0):
    w = torch.rand(n, generator=torch.Generator().manual_seed(seed + 100), dtype=F64) + 0.05
    return w / w.sum()


def assignment_w2(X, Y):
    C = ((X.numpy()[:, None, :] - Y.numpy()[None, :, :]) ** 2).sum(-1)
    r, c = linear_sum_assignment(C)
    return math.sqrt(C[r, c].mean())


# ---------------------------------------------------------------- exact W2
@pytest.mark.parametrize("d,seed", [(2, 0), (3, 1), (5, 2)])
def test_exact_equals_assignment_cost(d, seed):
    X, Y = rand(40, d, seed), rand(40, d, seed + 10) + 0.5
    assert w2(Measure(X), Measure(Y)) == pytest.approx(assignment_w2(X, Y), rel=1e-12)


def test_diracs_and_translations():
    x, y = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64), torch.tensor([[-1.0, 0.5, 3.0]], dtype=F64)
    assert w2(Measure(x), Measure(y)) == pytest.approx(float((x - y).norm()), rel=1e-14)
    mu = Measure(rand(12, 3), rand_weights(12))
    t = torch.tensor([3.0, -1.0, 0.25], dtype=F64)
    nu = mu.pushforward(lambda p: p + t)
    assert w2(mu, nu, squared=True) == pytest.approx(float(t @ t), rel=1e-12)
    assert w2(mu, mu) == pytest.approx(0.0, abs=1e-7)


def test_one_dimensional_sorted_formula():
    x, y = rand(50, 1, 3), rand(50, 1, 4) * 2 + 1
    sorted_value = math.sqrt(float(((x.sort(0)[0] - y.sort(0)[0]) ** 2).mean()))
    assert w2(Measure(x), Measure(y)) == pytest.approx(sorted_value, rel=1e-13)
    # weighted, unequal sizes: the 1-D path (quantiles) against POT's LP on a numpy cost matrix
    import ot
    a, b = rand_weights(7, 1), rand_weights(11, 2)
    x, y = rand(7, 1, 5), rand(11, 1, 6)
    M = (x.numpy() - y.numpy().T) ** 2
    truth = math.sqrt(ot.emd2(a.numpy(), b.numpy(), M))
    value, plan = w2(Measure(x, a), Measure(y, b), return_plan=True)
    assert value == pytest.approx(truth, rel=1e-12)
    assert torch.allclose(plan.sum(1), a, atol=1e-14) and torch.allclose(plan.sum(0), b, atol=1e-14)
    assert float((plan * torch.as_tensor(M)).sum()) == pytest.approx(truth ** 2, rel=1e-12)


def test_gaussian_samples_approach_bures_distance():
    m1, m2 = np.array([0.0, 0.0]), np.array([2.0, -1.0])
    S1, S2 = np.array([[1.0, 0.3], [0.3, 0.5]]), np.array([[2.0, -0.4], [-0.4, 1.0]])
    r1 = scipy.linalg.sqrtm(S1).real
    bures2 = float(((m1 - m2) ** 2).sum() + np.trace(S1 + S2 - 2 * scipy.linalg.sqrtm(r1 @ S2 @ r1).real))
    n = 600
    mu = Measure.gaussian(n, m1, S1, seed=1)
    nu = Measure.gaussian(n, m2, S2, seed=2)
    est = w2(mu, nu, squared=True)
    # Sampling error of W2^2 in d = 2: the mean term fluctuates by ~2|m1 - m2| sqrt(tr S / n) ~ 0.3,
    # the empirical-vs-true bias is O(log n / n) ~ 0.02; 0.6 is over 3 standard deviations.
    assert abs(est - bures2) < 0.6
    # and the transport plan part is accurate once means are matched exactly (sampling of the mean removed)
    mu_c = mu.pushforward(lambda p: p - p.mean(0) + torch.as_tensor(m1))
    nu_c = nu.pushforward(lambda p: p - p.mean(0) + torch.as_tensor(m2))
    assert abs(w2(mu_c, nu_c, squared=True) - bures2) < 0.25


def test_plan_is_a_coupling_of_optimal_cost():
    mu, nu = Measure(rand(9, 2), rand_weights(9)), Measure(rand(6, 2, 1), rand_weights(6, 3))
    value, plan = w2(mu, nu, return_plan=True)
    C = ((mu.points[:, None] - nu.points[None]) ** 2).sum(-1)
    assert torch.allclose(plan.sum(1), mu.weights, atol=1e-12)
    assert torch.allclose(plan.sum(0), nu.weights, atol=1e-12)
    assert bool((plan >= 0).all()) and float((plan * C).sum()) == pytest.approx(value ** 2, rel=1e-12)


def test_split_invariance():
    mu, nu = Measure(rand(8, 3), rand_weights(8)), Measure(rand(5, 3, 1))
    sp = mu.split(3, 0.25).split(0, 0.5)
    assert w2(mu, sp) == pytest.approx(0.0, abs=1e-7)
    assert w2(sp, nu) == pytest.approx(w2(mu, nu), rel=1e-12)
    assert w2(sp.merge(), nu) == pytest.approx(w2(mu, nu), rel=1e-12)


# ---------------------------------------------------------------- entropic
def test_entropic_converges_to_exact_and_plan_cost_bounds_it():
    mu, nu = Measure(rand(15, 2, 7), rand_weights(15)), Measure(rand(12, 2, 8) + 1.0, rand_weights(12, 5))
    exact = w2(mu, nu, squared=True)
    gaps_deb, gaps_cost = [], []
    for reg in (1.0, 0.1, 0.02):
        deb = w2(mu, nu, "streaming", reg=reg, squared=True, max_iter=20_000, strict=True)
        cost = w2(mu, nu, "sinkhorn", reg=reg, debias=False, squared=True, max_iter=20_000, strict=True)
        stream = w2(mu, nu, "streaming", reg=reg, debias=False, squared=True, max_iter=20_000, strict=True)
        # <pi_eps, C> is the cost of a coupling: never below the optimum
        assert cost >= exact - 1e-9 and stream >= exact - 1e-9
        gaps_deb.append(abs(deb - exact))
        gaps_cost.append(cost - exact)
    assert gaps_cost[0] > gaps_cost[1] > gaps_cost[2] and gaps_cost[2] < 1e-2 * exact
    assert gaps_deb[2] < gaps_deb[0] and gaps_deb[2] < 1e-2 * exact


@pytest.mark.parametrize("debias", [True, False])
@pytest.mark.parametrize("reg", [0.5, 0.2])
def test_streaming_equals_pot_sinkhorn(debias, reg):
    # scale 0.4: diameter^2 / reg stays moderate, so POT's plain (non-annealed) Sinkhorn converges
    mu = Measure(rand(30, 3, 1, scale=0.4), rand_weights(30))
    nu = Measure(rand(23, 3, 2, scale=0.4) + 0.2, rand_weights(23, 4))
    kw = dict(reg=reg, debias=debias, squared=True, tol=1e-12, max_iter=20_000, strict=True)
    pot = w2(mu, nu, "sinkhorn", **kw)
    stream = w2(mu, nu, "streaming", **kw)
    small_blocks = w2(mu, nu, "streaming", chunk_elements=50, **kw)
    no_scaling = w2(mu, nu, "streaming", scaling=None, **kw)
    assert stream == pytest.approx(pot, abs=1e-10)
    assert small_blocks == pytest.approx(pot, abs=1e-10)
    assert no_scaling == pytest.approx(pot, abs=1e-10)


def test_streaming_float32_and_result_object():
    mu, nu = Measure(rand(80, 3, 1)), Measure(rand(60, 3, 2) + 0.5)
    ref = sinkhorn_streaming(mu, nu, 0.2)
    assert ref.converged and ref.error <= 1e-7 and ref.iterations > 0
    assert ref.f.shape == (80,) and ref.g.shape == (60,)
    r32 = sinkhorn_streaming(mu.to(dtype=torch.float32), nu.to(dtype=torch.float32), 0.2)
    assert r32.value.dtype == torch.float32 and r32.converged
    assert float(r32.value) == pytest.approx(float(ref.value), rel=1e-4)
    # debiased divergence of a measure with itself is zero
    # (reg comparable to the spacing of the atoms: far below it plain Sinkhorn slows to a crawl)
    assert float(sinkhorn_streaming(mu, mu, 1.0).value) == pytest.approx(0.0, abs=1e-6)


def test_zero_mass_atoms_are_ignored_by_entropic_solvers():
    X, Y = rand(6, 2), rand(5, 2, 1)
    w = torch.tensor([0.2, 0.0, 0.3, 0.1, 0.4, 0.0], dtype=F64)
    far = X.clone()
    far[1] = 1e3
    for method in ("sinkhorn", "streaming"):
        a = w2(Measure(X, w), Measure(Y), method, reg=0.5, strict=True)
        b = w2(Measure(far, w), Measure(Y), method, reg=0.5, strict=True)
        assert math.isfinite(a) and a == pytest.approx(b, rel=1e-10)
    _, plan = w2(Measure(X, w), Measure(Y), "sinkhorn", reg=0.5, return_plan=True)
    assert plan.shape == (6, 5) and float(plan[1].abs().sum()) == 0.0


def test_nonconvergence_is_reported():
    mu, nu = Measure(rand(20, 2)), Measure(rand(20, 2, 1))
    for method in ("sinkhorn", "streaming"):
        with pytest.warns(SinkhornConvergenceWarning, match="marginal L1 error"):
            w2(mu, nu, method, reg=1e-3, max_iter=3)
        with pytest.raises(RuntimeError, match="did not converge in"):
            w2(mu, nu, method, reg=1e-3, max_iter=3, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w2(mu, nu, "streaming", reg=0.5)  # converges: no warning


def test_auto_chooses_by_size(monkeypatch):
    mu, nu = Measure(rand(30, 2)), Measure(rand(30, 2, 1) + 1.0)
    exact = w2(mu, nu)
    assert w2(mu, nu, "auto") == exact
    monkeypatch.setattr(transport.api, "AUTO_EXACT_MAX_PAIRS", 100)
    approx = w2(mu, nu, "auto", reg=1.0, strict=True)
    assert approx != exact and approx == pytest.approx(exact, rel=0.1)
    assert approx == w2(mu, nu, "streaming", reg=1.0)
    # d = 1 stays exact at any size
    x, y = rand(30, 1), rand(30, 1, 1)
    assert w2(Measure(x), Measure(y), "auto") == w2(Measure(x), Measure(y))


# ---------------------------------------------------------------- gradients
def _fd_check(fn, X, h=1e-5, tol=1e-6):
    X = X.clone().requires_grad_()
    val = fn(X)
    assert isinstance(val, torch.Tensor) and val.dim() == 0
    (g,) = torch.autograd.grad(val, X)
    fd = torch.zeros_like(X)
    for idx in np.ndindex(*X.shape):
        E = torch.zeros_like(X)
        E[idx] = h
        fd[idx] = (float(fn((X + E).detach())) - float(fn((X - E).detach()))) / (2 * h)
    assert torch.allclose(g, fd, atol=tol, rtol=tol), (g, fd)


def test_gradients_match_finite_differences():
    Y = rand(6, 2, 1) + 0.5
    b = rand_weights(6, 2)
    a = rand_weights(3, 3)
    X = rand(3, 2, 4)
    _fd_check(lambda Z: w2(Measure(Z, a), Measure(Y, b), squared=True), X)
    _fd_check(lambda Z: w2(Measure(Z, a), Measure(Y, b)), X)
    _fd_check(lambda Z: w2(Measure(Z[:, :1], a), Measure(Y[:, :1], b), squared=True), X)
    _fd_check(lambda Z: w2(Measure(Z, a), Measure(Y, b), "sinkhorn", reg=1.0, squared=True, tol=1e-12,
                           strict=True), X, tol=1e-5)
    _fd_check(lambda Z: w2(Measure(Z, a), Measure(Y, b), "streaming", reg=0.3, squared=True, tol=1e-13,
                           strict=True), X, tol=1e-6)
    # the streaming gradient also flows into both arguments at once
    Yg = Y.clone().requires_grad_()
    Xg = X.clone().requires_grad_()
    val = w2(Measure(Xg, a), Measure(Yg, b), "streaming", reg=0.3, squared=True, tol=1e-13)
    gx, gy = torch.autograd.grad(val, [Xg, Yg])
    # translation invariance: the gradient of a translation is zero, so sum gx + sum gy = 0
    assert torch.allclose(gx.sum(0) + gy.sum(0), torch.zeros(2, dtype=F64), atol=1e-10)


# ---------------------------------------------------------------- metric properties (hypothesis)
coords = st.floats(-3, 3, allow_nan=False, width=64)


def cloud(n_max=5, d=2):
    return st.integers(1, n_max).flatmap(
        lambda n: st.tuples(st.lists(st.lists(coords, min_size=d, max_size=d), min_size=n, max_size=n),
                            st.lists(st.floats(0.05, 1.0), min_size=n, max_size=n)))


def as_measure(c):
    return Measure(np.array(c[0]), np.array(c[1]), normalize=True)


@settings(max_examples=25, deadline=None)
@given(cloud(), cloud(), cloud())
def test_metric_axioms(a, b, c):
    mu, nu, xi = as_measure(a), as_measure(b), as_measure(c)
    assert w2(mu, nu) == pytest.approx(w2(nu, mu), rel=1e-9, abs=1e-9)
    assert w2(mu, xi) <= w2(mu, nu) + w2(nu, xi) + 1e-9


@settings(max_examples=25, deadline=None)
@given(cloud(), cloud(), st.floats(0, 2 * math.pi), st.tuples(coords, coords))
def test_rigid_motion_invariance(a, b, angle, shift):
    mu, nu = as_measure(a), as_measure(b)
    R = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]], dtype=F64)
    t = torch.tensor(shift, dtype=F64)
    move = lambda p: p @ R.T + t
    assert w2(mu.pushforward(move), nu.pushforward(move)) == pytest.approx(w2(mu, nu), rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------- conditional W2
def test_conditional_w2_of_sequences():
    X, Y = rand(17, 3), rand(17, 3, 1)
    truth = float((X - Y).norm()) / math.sqrt(17)
    assert conditional_w2(Measure.sequence(X), Measure.sequence(Y)) == pytest.approx(truth, rel=1e-13)
    # ... and its gradient is the closed form 2 (X - Y) / n of the squared value
    Xg = X.clone().requires_grad_()
    val = conditional_w2(Measure.sequence(Xg), Measure.sequence(Y), squared=True)
    (g,) = torch.autograd.grad(val, Xg)
    assert torch.allclose(g, 2 * (X - Y) / 17, atol=1e-14)


def _grouped(seed, groups=(0.25, 0.5, 1.0), per=3, d=2, shift=0.0):
    pos = torch.tensor([p for p in groups for _ in range(per)], dtype=F64)
    return Measure(rand(len(pos), d, seed) + shift, positions=pos)


def test_conditional_w2_decomposes_over_positions_and_bounds_w2():
    mu, nu = _grouped(0), _grouped(1, shift=0.7)
    # truth: the sum over positions of the slice-wise assignment costs (equal-size uniform slices)
    total = 0.0
    for s in (0.25, 0.5, 1.0):
        total += assignment_w2(mu.at_position(s).points, nu.at_position(s).points) ** 2 / 3
    wc = conditional_w2(mu, nu)
    assert wc == pytest.approx(math.sqrt(total), rel=1e-12)
    # W2c >= W2 on [0, 1] x R^d (positions as a coordinate) >= W2 of the R^d parts
    joint = lambda m: Measure(torch.cat([m.positions[:, None], m.points], 1), m.weights)
    wj = w2(joint(mu), joint(nu))
    assert wc >= wj - 1e-12 and wj >= w2(mu, nu) - 1e-12
    # the plan never moves mass across positions and is a coupling
    _, plan = conditional_w2(mu, nu, return_plan=True)
    cross = mu.positions[:, None] != nu.positions[None, :]
    assert float(plan[cross].abs().sum()) == 0.0
    assert torch.allclose(plan.sum(1), mu.weights, atol=1e-14) and torch.allclose(plan.sum(0), nu.weights)


def test_conditional_w2_single_position_is_w2():
    X, Y = rand(7, 2), rand(5, 2, 1)
    a, b = rand_weights(7), rand_weights(5, 1)
    mu = Measure(X, a, positions=torch.full((7,), 0.3, dtype=F64))
    nu = Measure(Y, b, positions=torch.full((5,), 0.3, dtype=F64))
    assert conditional_w2(mu, nu) == pytest.approx(w2(Measure(X, a), Measure(Y, b)), rel=1e-12)


def test_conditional_w2_is_infinite_when_marginals_differ():
    X = rand(4, 2)
    mu = Measure(X, positions=[0.25, 0.5, 0.75, 1.0])
    assert conditional_w2(mu, Measure(X, positions=[0.25, 0.5, 0.75, 0.9])) == math.inf
    assert conditional_w2(mu, Measure(X, [0.3, 0.2, 0.25, 0.25], positions=[0.25, 0.5, 0.75, 1.0])) == math.inf
    assert conditional_w2(mu, Measure(X[:3], positions=[0.25, 0.5, 0.75])) == math.inf
    assert conditional_w2(mu, mu, return_plan=True)[0] == 0.0
    # within the documented tolerances positions and masses compare equal
    near = Measure(X + 1, positions=[0.25 + 1e-12, 0.5, 0.75, 1.0])
    assert conditional_w2(mu, near) == pytest.approx(math.sqrt(2.0), rel=1e-12)
    assert conditional_w2(mu, Measure(X, positions=[0.25, 0.5, 0.75, 0.9]), atol=0.12) < math.inf


def test_conditional_w2_split_invariance_and_zero_mass():
    mu, nu = _grouped(2), _grouped(3)
    ref = conditional_w2(mu, nu)
    assert conditional_w2(mu.split(4, 0.2), nu) == pytest.approx(ref, rel=1e-12)
    assert conditional_w2(mu, mu.split(0)) == pytest.approx(0.0, abs=1e-7)
    # an atom of zero mass at a position nobody else has does not change the marginal
    w = torch.cat([mu.weights, mu.weights.new_zeros(1)])
    extra = Measure(torch.cat([mu.points, rand(1, 2, 9)]), w, torch.cat([mu.positions, mu.positions.new_tensor([0.9])]))
    assert conditional_w2(extra, nu) == pytest.approx(ref, rel=1e-12)


# ---------------------------------------------------------------- bad input
def test_bad_arguments():
    mu = Measure(rand(3, 2))
    with pytest.raises(TypeError, match="nu: expected a particles.Measure"):
        w2(mu, np.zeros((3, 2)))
    with pytest.raises(TypeError, match="mu: expected a particles.Measure"):
        conditional_w2(torch.zeros(3, 2), mu)
    with pytest.raises(ValueError, match="nu: dimension 3 differs from mu's dimension 2"):
        w2(mu, Measure(rand(3, 3)))
    with pytest.raises(ValueError, match="nu: dtype torch.float32 differs"):
        w2(mu, mu.to(dtype=torch.float32))
    with pytest.raises(ValueError, match="method: expected one of"):
        w2(mu, mu, "emd")
    with pytest.raises(ValueError, match="reg: method='sinkhorn' needs"):
        w2(mu, mu, "sinkhorn")
    with pytest.raises(ValueError, match="reg: expected a finite positive number"):
        w2(mu, mu, "streaming", reg=-1.0)
    with pytest.raises(ValueError, match="return_plan: the streaming method"):
        w2(mu, mu, "streaming", reg=0.1, return_plan=True)
    with pytest.raises(ValueError, match="max_iter"):
        w2(mu, mu, "sinkhorn", reg=0.1, max_iter=0)
    with pytest.raises(TypeError, match="unexpected options"):
        w2(mu, mu, "exact", scaling=0.5)
    with pytest.raises(ValueError, match="scaling"):
        w2(mu, mu, "streaming", reg=0.1, scaling=2.0)
    with pytest.raises(ValueError, match="mu: conditional W2 needs a masked measure"):
        conditional_w2(mu, Measure.sequence(rand(3, 2)))
    with pytest.raises(ValueError, match="debias: gradients of the streaming path"):
        w2(Measure(rand(3, 2).requires_grad_()), mu, "streaming", reg=0.1, debias=False)


def test_large_radius_stays_finite():
    mu, nu = Measure.sphere(40, 3, radius=100.0, seed=0), Measure.sphere(30, 3, radius=100.0, seed=1)
    for method, kw in (("exact", {}), ("sinkhorn", dict(reg=2000.0)), ("streaming", dict(reg=2000.0))):
        v = w2(mu, nu, method, strict=method != "exact", **kw)
        assert math.isfinite(v) and 0 < v < 200
