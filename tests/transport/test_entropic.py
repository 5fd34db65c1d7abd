"""Entropic W2: dense (POT) and streaming Sinkhorn, the Sinkhorn divergence, eps-scaling, "auto".

Truths: an independent numpy log-domain Sinkhorn (tests/reference.py ``entropic_ot``,
``sinkhorn_divergence``), the transport LP (``w2_lp``) as reg -> 0, closed forms (Diracs: every
coupling is the product), inequalities (<pi_eps, C> >= W2^2), finite differences for gradients.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import transport.api
from particles import Measure
from particles.validation import ConvergenceError
from tests.reference import entropic_ot, sinkhorn_divergence, w2_lp
from tests.transport.helpers import fd_check, rand, rand_weights
from transport import TransportResult, solve, symmetric_potential, w2

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    X, Y = rand(14, 2, 1), rand(11, 2, 2) * 0.8 + 0.6
    a, b = rand_weights(14, 1), rand_weights(11, 2)
    return X, a, Y, b


@pytest.mark.parametrize("method", ["sinkhorn", "streaming"])
@pytest.mark.parametrize("reg", [1.0, 0.1])
def test_values_match_independent_sinkhorn(pair, method, reg):
    X, a, Y, b = pair
    mu, nu = Measure(X, a), Measure(Y, b)
    kw = dict(reg=reg, squared=True, tol=1e-11, max_iter=100_000)
    assert w2(mu, nu, method, **kw) == pytest.approx(sinkhorn_divergence(X, a, Y, b, reg), abs=1e-9)
    plan_cost = entropic_ot(X, a, Y, b, reg)[1]
    assert w2(mu, nu, method, debias=False, **kw) == pytest.approx(plan_cost, abs=1e-9)


@pytest.mark.parametrize("method", ["sinkhorn", "streaming"])
def test_potentials_and_plan_of_the_entropic_problem(pair, method):
    X, a, Y, b = pair
    reg = 0.3
    ot_eps, _, f_ref, g_ref = entropic_ot(X, a, Y, b, reg)
    res = solve(Measure(X, a), Measure(Y, b), method, reg=reg, tol=1e-11, max_iter=100_000,
                return_plan=method == "sinkhorn")
    f, g = res.potentials
    # potentials are defined up to f + c, g - c: compare the dual value and the shift-free differences
    assert float(a @ f + b @ g) == pytest.approx(ot_eps, abs=1e-9)
    assert np.allclose((f - f[0]).numpy(), f_ref - f_ref[0], atol=1e-8)
    assert np.allclose((g - g[0]).numpy(), g_ref - g_ref[0], atol=1e-8)
    assert res.converged and res.error <= 1e-11 and res.iterations > 0 and res.reg == reg
    if method == "sinkhorn":
        C = ((X[:, None] - Y[None]) ** 2).sum(-1)
        plan = a[:, None] * b[None, :] * torch.exp((f[:, None] + g[None, :] - C) / reg)
        assert torch.allclose(res.plan, plan, atol=1e-12)


def test_diracs_closed_form():
    """Between two Diracs the only coupling is the product: OT_eps = |x - y|^2, S_eps = |x - y|^2."""
    x, y = [[0.5, -1.0, 2.0]], [[1.5, 1.0, 0.0]]
    d2 = 1.0 + 4.0 + 4.0
    for method in ("sinkhorn", "streaming"):
        for debias in (True, False):
            assert w2(Measure(x), Measure(y), method, reg=0.7, debias=debias, squared=True) == \
                pytest.approx(d2, rel=1e-12)


def test_entropic_converges_to_exact_and_plan_cost_bounds_it():
    X, Y = rand(15, 2, 7), rand(12, 2, 8) + 1.0
    a, b = rand_weights(15), rand_weights(12, 5)
    mu, nu = Measure(X, a), Measure(Y, b)
    exact = w2_lp(X, a, Y, b) ** 2
    gaps_deb, gaps_cost = [], []
    for reg in (1.0, 0.1, 0.02):
        deb = w2(mu, nu, "streaming", reg=reg, squared=True, max_iter=20_000)
        cost = w2(mu, nu, "sinkhorn", reg=reg, debias=False, squared=True, max_iter=20_000)
        stream = w2(mu, nu, "streaming", reg=reg, debias=False, squared=True, max_iter=20_000)
        # <pi_eps, C> is the cost of a coupling: never below the optimum
        assert cost >= exact - 1e-9 and stream >= exact - 1e-9
        gaps_deb.append(abs(deb - exact))
        gaps_cost.append(cost - exact)
    assert gaps_cost[0] > gaps_cost[1] > gaps_cost[2] and gaps_cost[2] < 1e-2 * exact
    assert gaps_deb[2] < gaps_deb[0] and gaps_deb[2] < 1e-2 * exact


@pytest.mark.parametrize("debias", [True, False])
def test_streaming_options_do_not_change_the_value(pair, debias):
    X, a, Y, b = pair
    mu, nu = Measure(X, a), Measure(Y, b)
    kw = dict(reg=0.3, debias=debias, squared=True, tol=1e-12, max_iter=20_000)
    truth = sinkhorn_divergence(X, a, Y, b, 0.3) if debias else entropic_ot(X, a, Y, b, 0.3)[1]
    for extra in ({}, dict(chunk_elements=7), dict(scaling=0), dict(scaling=0.9)):
        assert w2(mu, nu, "streaming", **kw, **extra) == pytest.approx(truth, abs=1e-10), extra


def test_streaming_float32():
    X, Y = rand(80, 3, 1), rand(60, 3, 2) + 0.5
    truth = sinkhorn_divergence(X, np.full(80, 1 / 80), Y, np.full(60, 1 / 60), 0.2)
    r32 = solve(Measure(X, dtype=torch.float32), Measure(Y, dtype=torch.float32), "streaming", reg=0.2)
    assert r32.converged and r32.tol == 1e-5 and isinstance(r32.value, float)
    assert r32.value_squared == pytest.approx(truth, rel=1e-4)


def test_symmetric_potential_is_the_self_transport_potential():
    X, a = rand(12, 2, 3), rand_weights(12, 3)
    f, err, it = symmetric_potential(Measure(X, a), 0.5, tol=1e-12)
    ot_self, _, f_ref, _ = entropic_ot(X, a, X, a, 0.5)
    assert err <= 1e-12 and it > 0
    assert np.allclose(f.numpy(), f_ref, atol=1e-9)
    assert float(2 * a @ f) == pytest.approx(ot_self, abs=1e-9)
    # non-convergence follows the one failure convention
    with pytest.raises(ConvergenceError, match="symmetric_potential: did not converge") as info:
        symmetric_potential(Measure(X, a), 1e-3, max_iter=2, scaling=0)
    assert len(info.value.estimate) == 3
    with pytest.warns(RuntimeWarning, match="did not converge"):
        symmetric_potential(Measure(X, a), 1e-3, max_iter=2, scaling=0, on_failure="warn")


def test_zero_mass_atoms_are_ignored_by_entropic_solvers():
    X, Y = rand(6, 2), rand(5, 2, 1)
    w = torch.tensor([0.2, 0.0, 0.3, 0.1, 0.4, 0.0], dtype=F64)
    far = X.clone()
    far[1] = 1e3
    truth = sinkhorn_divergence(X.numpy(), w.numpy(), Y.numpy(), np.full(5, 0.2), 0.5)
    for method in ("sinkhorn", "streaming"):
        a = w2(Measure(X, w), Measure(Y), method, reg=0.5, squared=True, tol=1e-11, max_iter=50_000)
        b = w2(Measure(far, w), Measure(Y), method, reg=0.5, squared=True, tol=1e-11, max_iter=50_000)
        assert a == pytest.approx(truth, abs=1e-9) and b == pytest.approx(truth, abs=1e-9)
        # potentials exist on every atom (soft c-transform on the massless ones), finite
        f, _ = solve(Measure(far, w), Measure(Y), method, reg=0.5).potentials
        assert f.shape == (6,) and bool(torch.isfinite(f).all())
    plan = solve(Measure(X, w), Measure(Y), "sinkhorn", reg=0.5, return_plan=True).plan
    assert plan.shape == (6, 5) and float(plan[1].abs().sum()) == 0.0


def test_nonconvergence_follows_on_failure():
    mu, nu = Measure(rand(20, 2)), Measure(rand(20, 2, 1))
    for method in ("sinkhorn", "streaming"):
        with pytest.raises(ConvergenceError, match="did not converge in") as info:
            w2(mu, nu, method, reg=1e-3, max_iter=3, **({"scaling": 0} if method == "streaming" else {}))
        assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
        est = info.value.estimate
        assert isinstance(est, TransportResult) and not est.converged and est.error > est.tol
        assert est.method == method and math.isfinite(est.value)
        with pytest.warns(RuntimeWarning, match="marginal L1 error") as rec:
            res = solve(mu, nu, method, reg=1e-3, max_iter=3, on_failure="warn",
                        **({"scaling": 0} if method == "streaming" else {}))
        assert not res.converged and rec[0].filename == __file__  # the warning points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w2(mu, nu, "streaming", reg=0.5)  # converges: no warning


def test_auto_chooses_by_size(monkeypatch):
    mu, nu = Measure(rand(30, 2)), Measure(rand(30, 2, 1) + 1.0)
    exact = w2(mu, nu)
    assert w2(mu, nu, "auto") == exact and solve(mu, nu, "auto").method == "exact"
    monkeypatch.setattr(transport.api, "AUTO_EXACT_MAX_PAIRS", 100)
    res = solve(mu, nu, "auto", reg=1.0)
    assert res.method == "streaming" and res.reg == 1.0
    assert res.value != exact and res.value == pytest.approx(exact, rel=0.1)
    assert res.value == w2(mu, nu, "streaming", reg=1.0)
    # without reg: (AUTO_BLUR * diameter)^2, reported in the result
    with warnings.catch_warnings():  # a blur of 5% is far below the spacing of 30 atoms: slow to converge
        warnings.simplefilter("ignore")
        auto = solve(mu, nu, "auto", on_failure="warn")
    both = torch.cat([mu.points, nu.points])
    diameter = float(both.max() - both.min()) * math.sqrt(2)
    assert auto.reg == pytest.approx((transport.api.AUTO_BLUR * diameter) ** 2, rel=1e-12)
    assert auto.value == pytest.approx(exact, rel=0.05)
    # d = 1 stays exact at any size
    x, y = rand(30, 1), rand(30, 1, 1)
    assert w2(Measure(x), Measure(y), "auto") == w2(Measure(x), Measure(y))


def test_auto_reg_ignores_atoms_of_zero_mass(monkeypatch):
    """A zero-weight atom changes neither measure, so not auto's reg either (it came from a box over every atom:
    an empty atom far away took the reg from 0.007 to 5e5 and the value 12% off)."""
    monkeypatch.setattr(transport.api, "AUTO_EXACT_MAX_PAIRS", 100)
    x, y = rand(40, 2), rand(30, 2, 1) + 0.2
    mu, nu = Measure(x), Measure(y)
    far = Measure(torch.cat([x, torch.full((1, 2), 1e4, dtype=x.dtype)]),
                  torch.cat([torch.full((40,), 1 / 40, dtype=x.dtype), torch.zeros(1, dtype=x.dtype)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = solve(mu, nu, "auto", on_failure="warn"), solve(far, nu, "auto", on_failure="warn")
    assert b.reg == pytest.approx(a.reg, rel=1e-12) and b.value == pytest.approx(a.value, rel=1e-9)


# ---------------------------------------------------------------- gradients
def test_gradients_match_finite_differences():
    Y, b = rand(6, 2, 1) + 0.5, rand_weights(6, 2)
    a, X = rand_weights(3, 3), rand(3, 2, 4)
    fd_check(lambda Z: w2(Measure(Z, a), Measure(Y, b), "sinkhorn", reg=1.0, squared=True, tol=1e-12), X, tol=1e-5)
    fd_check(lambda Z: w2(Measure(Z, a), Measure(Y, b), "streaming", reg=0.3, squared=True, tol=1e-13), X)
    # the streaming gradient also flows into both arguments at once
    Yg, Xg = Y.clone().requires_grad_(), X.clone().requires_grad_()
    val = w2(Measure(Xg, a), Measure(Yg, b), "streaming", reg=0.3, squared=True, tol=1e-13)
    gx, gy = torch.autograd.grad(val, [Xg, Yg])
    # translation invariance: the gradient of a translation is zero, so sum gx + sum gy = 0
    assert torch.allclose(gx.sum(0) + gy.sum(0), torch.zeros(2, dtype=F64), atol=1e-10)


def test_large_radius_stays_finite():
    mu, nu = Measure.sphere(40, 3, radius=100.0, seed=0), Measure.sphere(30, 3, radius=100.0, seed=1)
    exact = w2_lp(mu.points, mu.weights, nu.points, nu.weights)
    assert w2(mu, nu) == pytest.approx(exact, rel=1e-9)
    for method in ("sinkhorn", "streaming"):
        v = w2(mu, nu, method, reg=2000.0, debias=False)
        assert math.isfinite(v) and exact <= v < 200


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_measure_against_itself_converges_at_small_reg(dtype):
    """OT_eps(mu, mu) at reg 1e-3 (squared diameter / reg = 2000): alternating Sinkhorn steps crawl there
    (5000 updates did not reach tol); the pair is the self problem, solved by its averaged update. Truths: the
    plan's marginals summed densely in float64, S_eps(mu, mu) = 0, and <pi, C> from an independent numpy
    log-domain Sinkhorn."""
    from tests.transport.helpers import plan_marginal_error

    X = torch.rand(200, 2, generator=torch.Generator().manual_seed(0), dtype=F64).to(dtype)
    mu = Measure(X)
    res = solve(mu, mu, "streaming", reg=1e-3)
    assert res.converged and res.value == 0.0
    plain = solve(mu, mu, "streaming", reg=1e-3, debias=False)
    assert plain.converged
    f, g = plain.potentials
    assert plan_marginal_error(mu, mu, f, g, 1e-3) <= plain.error <= (1e-7 if dtype == F64 else 1e-5)
    if dtype == F64:
        a = mu.weights
        assert plain.value_squared == pytest.approx(entropic_ot(X, a, X, a, 1e-3, tol=1e-10)[1], rel=1e-6)


def test_dense_sinkhorn_drops_atoms_whose_mass_underflows():
    """Atoms of finite log-weight whose mass underflows the dtype (log a = -800 in float64, -200 in float32; the
    witnesses of Proposition 3.6 are built so) made 0 * log 0 = NaN in the dense solver's KL term, reported as
    'reg too small'. They are dropped like zero-mass atoms: the value equals that of the measure without them
    (an independent numpy Sinkhorn divergence) and the streaming solver's."""
    X, Y = rand(6, 2), rand(5, 2, 1)
    for dtype, low in ((F64, -800.0), (torch.float32, -200.0)):
        lw = torch.log(torch.tensor([0.2, 1.0, 0.3, 0.1, 0.4, 1.0], dtype=F64))
        lw[[1, 5]] = low
        lw = lw - torch.logsumexp(lw, 0)
        kept = [0, 2, 3, 4]
        w = torch.exp(lw[kept])
        truth = sinkhorn_divergence(X[kept].numpy(), (w / w.sum()).numpy(), Y.numpy(), np.full(5, 0.2), 0.5)
        mu = Measure(X.to(dtype), log_weights=lw.to(dtype))
        for method in ("sinkhorn", "streaming"):
            value = w2(mu, Measure(Y.to(dtype)), method, reg=0.5, squared=True, tol=1e-8 if dtype == F64 else 1e-5)
            assert value == pytest.approx(truth, rel=1e-6 if dtype == F64 else 1e-4), (dtype, method)


def test_float32_weights_within_the_accepted_sum_converge():
    """Measure accepts float32 weights summing to 1 within 1e-5; used as given, the two marginals' masses differed
    by up to 2e-5 and no plan could meet tol = 1e-5 (every iteration ran, then 'increase max_iter or reg'). They
    are renormalized in float64: the solves converge to the value of the exactly normalized measures."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(30, 2, generator=g), torch.rand(40, 2, generator=g)
    a, b = torch.full((30,), 1 / 30) * (1 + 8e-6), torch.full((40,), 1 / 40) * (1 - 8e-6)
    for method in ("sinkhorn", "streaming"):
        res = solve(Measure(x, a), Measure(y, b), method, reg=0.1)
        ref = solve(Measure(x, a, normalize=True), Measure(y, b, normalize=True), method, reg=0.1)
        assert res.converged and res.value == pytest.approx(ref.value, rel=1e-5)


def test_dense_sinkhorn_of_a_measure_against_itself_at_small_reg():
    """solve(mu, mu, 'sinkhorn', reg=1e-3) ran 10000 alternating updates and failed (the streaming solver saw the
    self problem); the pair is now started from the self problem's fixed point. Truths: S_eps(mu, mu) = 0 and
    <pi, C> of an independent numpy log-domain Sinkhorn."""
    X = torch.rand(300, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    mu = Measure(X)
    res = solve(mu, mu, "sinkhorn", reg=1e-3)
    assert res.converged and res.value == 0.0
    plain = solve(mu, mu, "sinkhorn", reg=1e-3, debias=False)
    a = mu.weights
    assert plain.converged
    assert plain.value_squared == pytest.approx(entropic_ot(X, a, X, a, 1e-3, tol=1e-10)[1], rel=1e-6)
    # the same measure with its atoms in another order (and unequal weights) is recognised too
    w = torch.rand(300, generator=torch.Generator().manual_seed(1), dtype=F64) + 0.5
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(2))
    mu_w = Measure(X, w, normalize=True)
    shuffled = Measure(X[perm], mu_w.weights[perm])
    res = solve(mu_w, shuffled, "sinkhorn", reg=1e-3)
    assert res.converged and abs(res.value) <= 1e-6


def test_streaming_sinkhorn_of_a_measure_against_its_atoms_in_another_order():
    """The streaming solver recognised mu = nu only with the atoms in the same order; in another order the pair
    ran alternating steps, which crawl at small reg (200 uniform points at reg 1e-3: more than 5000 updates).
    Now any order is the self problem: truths S_eps(mu, mu) = 0, and the potentials of the unshuffled solve,
    permuted."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(200, 2, generator=g, dtype=F64)
    w = torch.rand(200, generator=g, dtype=F64) + 0.5
    mu = Measure(X, w, normalize=True)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(2))
    shuffled = Measure(X[perm], mu.weights[perm])
    res = solve(mu, shuffled, "streaming", reg=1e-3, max_iter=300)
    assert res.converged and abs(res.value) <= 1e-6
    same = solve(mu, mu, "streaming", reg=1e-3, max_iter=300)
    assert torch.allclose(res.potentials[0], same.potentials[0], atol=1e-12)
    assert torch.allclose(res.potentials[1], same.potentials[1][perm], atol=1e-12)
    plain = solve(mu, shuffled, "streaming", reg=1e-3, max_iter=300, debias=False)
    ref = solve(mu, mu, "streaming", reg=1e-3, max_iter=300, debias=False)
    assert plain.converged and plain.value_squared == pytest.approx(ref.value_squared, rel=1e-12)


def test_same_atoms_finds_the_permutation_or_none():
    """transport.problem.same_atoms against the permutation that built y: y = x[match]; any difference in one
    coordinate or one log-weight, or another size, gives None; ties (duplicated atoms) still match."""
    from transport.problem import same_atoms

    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 3, generator=g, dtype=F64)
    x[10] = x[3]                                   # a duplicated atom
    la = torch.log_softmax(torch.randn(50, generator=g, dtype=F64), 0)
    la[10] = la[3]
    perm = torch.randperm(50, generator=g)
    y, lb = x[perm], la[perm]
    match = same_atoms(x, la, y, lb)
    assert match is not None and torch.equal(x[match], y) and torch.equal(la[match], lb)
    y2 = y.clone()
    y2[7, 2] += 1e-15
    assert same_atoms(x, la, y2, lb) is None
    lb2 = lb.clone()
    lb2[[0, 1]] = lb2[[1, 0]]
    assert lb[0] != lb[1] and same_atoms(x, la, y, lb2) is None
    assert same_atoms(x, la, y[:-1], lb[:-1]) is None
    # same first coordinates, the other coordinates swapped between two atoms
    z = x.clone()
    z[[0, 1], 1:] = z[[1, 0], 1:]
    assert not torch.equal(x[0, 1:], x[1, 1:]) and same_atoms(x, la, z, la) is None


@pytest.mark.parametrize("dtype, tol, reg, t", [(F64, 1e-5, 1000.0, 1e-5), (torch.float32, None, 1000.0, 1e-5),
                                                (torch.float32, None, 0.1, 1e-6), (torch.float32, None, 1e-2, 1e-6)])
def test_the_sinkhorn_divergence_of_a_small_translate_is_its_closed_form(dtype, tol, reg, t):
    """S_eps(mu, mu + t) = |t|^2 exactly: the cost's cross term -2 <x - y, t> integrates to 0 under any coupling of
    mu with itself. The streamed value came out 153 times too large (reg 1000, tol 1e-5) and 0 (float32, reg 0.1,
    t = 1e-6), converged: its self terms stopped near their marginal tolerance, off by about eps times it, far
    above S_eps (transport.streaming_sinkhorn._finish_symmetric), and the float32 measures' float64 solve kept
    float32's tolerance (also where Problem.precision had moved the float32 measures to float64 from the start, at
    reg 1e-2: 0). The dense solver agreed with the closed form."""
    X = np.random.default_rng(7).random((30, 2))
    mu = Measure(torch.tensor(X, dtype=dtype))
    nu = mu.pushforward(lambda z: z + torch.tensor([t, 0.0], dtype=dtype))
    truth = float(((nu.points.double() - mu.points.double()) ** 2).sum(1).mean())   # |t|^2 of the rounded points
    for method in ("streaming", "sinkhorn"):
        r = solve(mu, nu, method, reg=reg, tol=tol)
        assert r.converged and r.error <= r.tol
        assert r.value_squared == pytest.approx(truth, rel=1e-2), method


def test_the_self_term_is_accurate_far_below_its_marginal_tolerance():
    """At reg far above the squared diameter the averaged symmetric update contracts by about 1/2 per step and
    stopped with 2 <a, f> off by 1.5e-8 (of a squared diameter about 20) at tol 1e-5; two alternating steps from it
    contract by the plan's second eigenvalue. Truth: alternating log-domain Sinkhorn in numpy on (X, a) and a
    copy of it (tests/reference.py), run to a marginal error of 1e-13."""
    X, a = rand(20, 2, 5), rand_weights(20, 5)
    for reg in (1000.0, 30.0):
        truth = entropic_ot(X.numpy(), a.numpy(), X.numpy().copy(), a.numpy(), reg, tol=1e-13)[0]
        f, err, it = symmetric_potential(Measure(X, a), reg, tol=1e-5)
        assert err <= 1e-5
        assert abs(float(2 * a @ f) - truth) <= 1e-11 * (1 + abs(truth)), reg
        # and never above it: 2 <a, f> is the dual objective at a pair whose columns are exact
        assert float(2 * a @ f) <= truth + 1e-12 * abs(truth)


def test_a_divergence_within_the_rounding_of_its_terms_says_so():
    """At reg = 1000 (500 squared diameters) a cloud against its translate by 1e-6 has S_eps = |t|^2 = 1e-12, below
    the rounding of the soft-mins (about u eps = 1e-13): the dense solver gave 0.83 to 1.43 times it, converged, and
    said nothing. Now a RuntimeWarning says that the value is unresolved wherever it is below 100 such roundings;
    no warning where it is resolved (the same translate at reg 0.1, or t = 1e-5 at reg 1000) or exactly 0 (the same
    atoms). Truth: the closed form |t|^2."""
    X = np.random.default_rng(7).random((30, 2))
    mu = Measure(torch.tensor(X))
    for t, reg, unresolved in ((1e-6, 1000.0, True), (1e-6, 100.0, True), (1e-6, 0.1, False), (1e-5, 1000.0, False),
                               (0.0, 1000.0, False)):
        nu = mu.pushforward(lambda z, t=t: z + torch.tensor([t, 0.0], dtype=F64))
        truth = t * t
        for method in ("sinkhorn", "streaming"):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                r = solve(mu, nu, method, reg=reg)
            said = [w for w in seen if "is below 100 roundings of its terms" in str(w.message)]
            assert r.converged and bool(said) == unresolved, (t, reg, method)
            if not said:   # a value the solver does not flag is right
                assert r.value_squared == pytest.approx(truth, rel=5e-3, abs=1e-300), (t, reg, method)
