"""Exact W2 (network simplex, d = 1 sorted formula) and the result object of ``transport.solve``.

Truths: the assignment problem and the transport LP solved by scipy (tests/reference.py), closed
forms (Diracs, translations, the sorted formula in d = 1, the Bures distance of Gaussians), LP
duality for the potentials, finite differences for gradients, metric axioms (hypothesis).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import ot
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from particles import Measure
from tests.reference import w2_assignment, w2_lp
from tests.transport.helpers import fd_check, rand, rand_weights
from transport import TransportResult, solve, w2

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("d,seed", [(2, 0), (3, 1), (5, 2)])
def test_exact_equals_assignment_cost(d, seed):
    X, Y = rand(40, d, seed), rand(40, d, seed + 10) + 0.5
    assert w2(Measure(X), Measure(Y)) == pytest.approx(w2_assignment(X, Y), rel=1e-12)


@pytest.mark.parametrize("d", [1, 2, 4])
def test_exact_equals_lp_weighted_unequal_sizes(d):
    X, Y = rand(9, d, 3), rand(13, d, 4) * 0.5 + 1.0
    a, b = rand_weights(9, 1), rand_weights(13, 2)
    assert w2(Measure(X, a), Measure(Y, b)) == pytest.approx(w2_lp(X, a, Y, b), rel=1e-9)


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
    # weighted, unequal sizes: the 1-D path (quantiles) against the transport LP (scipy)
    a, b = rand_weights(7, 1), rand_weights(11, 2)
    x, y = rand(7, 1, 5), rand(11, 1, 6)
    truth = w2_lp(x, a, y, b)
    res = solve(Measure(x, a), Measure(y, b), return_plan=True)
    value, plan = res.value, res.plan
    assert value == pytest.approx(truth, rel=1e-9)
    assert torch.allclose(plan.sum(1), a, atol=1e-14) and torch.allclose(plan.sum(0), b, atol=1e-14)
    M = (x - y.T) ** 2
    assert float((plan * M).sum()) == pytest.approx(truth ** 2, rel=1e-9)


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
    res = solve(mu, nu, return_plan=True)
    value, plan = res.value, res.plan
    with pytest.warns(DeprecationWarning, match=r"transport.solve"):   # w2's old spelling still works
        old_value, old_plan = w2(mu, nu, return_plan=True)
    assert old_value == value and torch.equal(old_plan, plan) and w2(mu, nu) == value
    C = ((mu.points[:, None] - nu.points[None]) ** 2).sum(-1)
    assert torch.allclose(plan.sum(1), mu.weights, atol=1e-12)
    assert torch.allclose(plan.sum(0), nu.weights, atol=1e-12)
    assert bool((plan >= 0).all()) and float((plan * C).sum()) == pytest.approx(value ** 2, rel=1e-12)


def test_result_object_and_kantorovich_potentials():
    X, Y = rand(9, 3, 7), rand(6, 3, 8) + 1.0
    a, b = rand_weights(9, 4), rand_weights(6, 5)
    res = solve(Measure(X, a), Measure(Y, b), return_plan=True)
    assert isinstance(res, TransportResult) and res.method == "exact" and res.converged and res.error == 0.0
    assert res.reg is None and res.tol is None and res.iterations is None
    truth = w2_lp(X, a, Y, b)
    assert res.value == pytest.approx(truth, rel=1e-9) and float(res) == res.value
    assert res.value_squared == pytest.approx(truth ** 2, rel=1e-9)
    # LP duality: f_i + g_j <= C_ij everywhere, with equality where the plan has mass, and
    # <a, f> + <b, g> = W2^2 (strong duality)
    f, g = res.potentials
    C = ((X[:, None] - Y[None]) ** 2).sum(-1)
    slack = C - f[:, None] - g[None, :]
    assert float(slack.min()) >= -1e-10
    assert float(slack[res.plan > 1e-12].abs().max()) <= 1e-10
    assert float(a @ f + b @ g) == pytest.approx(truth ** 2, rel=1e-9)
    # without return_plan no N x M plan is kept; d = 1 has no potentials
    assert solve(Measure(X, a), Measure(Y, b)).plan is None
    assert solve(Measure(X[:, :1]), Measure(Y[:, :1])).potentials is None


def test_split_invariance():
    mu, nu = Measure(rand(8, 3), rand_weights(8)), Measure(rand(5, 3, 1))
    sp = mu.split(3, 0.25).split(0, 0.5)
    assert w2(mu, sp) == pytest.approx(0.0, abs=1e-7)
    assert w2(sp, nu) == pytest.approx(w2(mu, nu), rel=1e-12)
    assert w2(sp.merge(), nu) == pytest.approx(w2(mu, nu), rel=1e-12)


def test_float32_against_lp():
    X, Y = rand(15, 3, 1), rand(12, 3, 2) + 0.3
    a, b = rand_weights(15, 3), rand_weights(12, 4)
    v = w2(Measure(X, a, dtype=torch.float32), Measure(Y, b, dtype=torch.float32))
    assert v == pytest.approx(w2_lp(X, a, Y, b), rel=1e-5)


# ---------------------------------------------------------------- gradients
def test_gradients_match_finite_differences():
    Y, b = rand(6, 2, 1) + 0.5, rand_weights(6, 2)
    a, X = rand_weights(3, 3), rand(3, 2, 4)
    fd_check(lambda Z: w2(Measure(Z, a), Measure(Y, b), squared=True), X)
    fd_check(lambda Z: w2(Measure(Z, a), Measure(Y, b)), X)
    fd_check(lambda Z: w2(Measure(Z[:, :1], a), Measure(Y[:, :1], b), squared=True), X)


def test_gradient_at_equal_measures_is_zero_not_nan():
    """W2 is not differentiable at mu = nu; the subgradient 0 is returned (sqrt's derivative would be NaN)."""
    X = rand(5, 2).requires_grad_()
    val = w2(Measure(X), Measure(X.detach().clone()))
    (g,) = torch.autograd.grad(val, X)
    assert float(val.detach()) == 0.0 and bool(torch.isfinite(g).all()) and float(g.abs().max()) == 0.0


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
    # squared values near 0 carry rounding of ~1e-16, their roots ~1e-8: compare squares there
    assert w2(mu, nu, squared=True) == pytest.approx(w2(nu, mu, squared=True), rel=1e-9, abs=1e-12)
    assert w2(mu, xi) <= w2(mu, nu) + w2(nu, xi) + 1e-7


@settings(max_examples=25, deadline=None)
@given(cloud(), cloud())
def test_value_is_the_lp_optimum(a, b):
    mu, nu = as_measure(a), as_measure(b)
    truth = w2_lp(mu.points, mu.weights, nu.points, nu.weights)
    assert w2(mu, nu) == pytest.approx(truth, rel=1e-7, abs=1e-7)


@settings(max_examples=25, deadline=None)
@given(cloud(), cloud(), st.floats(0, 2 * math.pi), st.tuples(coords, coords))
def test_rigid_motion_invariance(a, b, angle, shift):
    mu, nu = as_measure(a), as_measure(b)
    R = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]], dtype=F64)
    t = torch.tensor(shift, dtype=F64)
    move = lambda p: p @ R.T + t
    moved = w2(mu.pushforward(move), nu.pushforward(move), squared=True)
    assert moved == pytest.approx(w2(mu, nu, squared=True), rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------- POT's verdict, and warnings of other origins
def test_foreign_warning_inside_pot_is_not_a_simplex_failure(monkeypatch):
    """A UserWarning raised inside ``ot.emd2`` by something else (as POT's JAX backend warns about float64
    when JAX for CUDA is installed) passes through, re-emitted where it was raised, and the value is the
    LP optimum: only POT's ``log["result_code"]`` says whether the simplex failed."""
    import ot.lp._network_simplex as simplex

    real = simplex.get_backend

    def warning_backend(*args):
        warnings.warn("Explicitly requested dtype float64 requested in zeros is not available (JAX)", UserWarning,
                      stacklevel=1)
        return real(*args)

    monkeypatch.setattr(simplex, "get_backend", warning_backend)
    X, Y = rand(9, 3, 7), rand(6, 3, 8) + 1.0
    a, b = rand_weights(9, 4), rand_weights(6, 5)
    with pytest.warns(UserWarning, match="float64 requested in zeros") as record:
        value = w2(Measure(X, a), Measure(Y, b))
    assert value == pytest.approx(w2_lp(X, a, Y, b), rel=1e-9)
    # the same warnings as POT's own call emits, from the same place
    with warnings.catch_warnings(record=True) as direct:
        warnings.simplefilter("always")
        ot.emd2(a, b, torch.cdist(X, Y) ** 2)
    assert [(str(w.message), w.filename, w.lineno) for w in record] == [
        (str(w.message), w.filename, w.lineno) for w in direct] and record[0].filename == __file__
    # a warning the caller's filters turn into errors still is one, after POT returned
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(UserWarning, match="float64 requested"):
            w2(Measure(X, a), Measure(Y, b))


def test_simplex_failure_is_still_reported(monkeypatch):
    """numItermax too small: POT's verdict (result_code 3, MAX_ITER_REACHED) is an error, and POT's own
    warning about it is not repeated; a foreign warning during the same call still passes through."""
    import ot.lp._network_simplex as simplex

    import transport.exact

    X, Y = rand(30, 2, 1), rand(30, 2, 2) + 0.5
    monkeypatch.setattr(transport.exact, "EMD_MAX_ITER", 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="network simplex did not find an optimal plan \\(result_code 3\\)"
                           ": numItermax reached"):
            w2(Measure(X), Measure(Y))
    assert not caught
    real = simplex.get_backend

    def foreign(*args):
        warnings.warn("foreign", UserWarning, stacklevel=1)
        return real(*args)

    monkeypatch.setattr(simplex, "get_backend", foreign)
    with pytest.warns(UserWarning, match="^foreign$"):
        with pytest.raises(RuntimeError, match="result_code 3"):
            w2(Measure(X), Measure(Y))
    monkeypatch.setattr(transport.exact, "EMD_MAX_ITER", 50_000_000)
    monkeypatch.setattr(simplex, "get_backend", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a finished simplex emits nothing of its own
        assert w2(Measure(X), Measure(Y)) == pytest.approx(w2_assignment(X, Y), rel=1e-12)


# ---------------------------------------------------------------- the result's repr
def test_result_repr_is_a_summary():
    """repr shows the scalars and the shapes and dtypes of plan and potentials, never their entries."""
    X, Y = rand(300, 3, 7), rand(200, 3, 8) + 1.0
    res = solve(Measure(X), Measure(Y), return_plan=True)
    text = repr(res)
    assert "tensor([" not in text and len(text) < 400, text
    assert text.startswith(f"TransportResult(value={res.value:.10g}, method='exact', converged=True, error=0, "
                           "iterations=None")
    assert "plan=tensor(shape=(300, 200), dtype=torch.float64)" in text
    assert ("potentials=(tensor(shape=(300,), dtype=torch.float64), tensor(shape=(200,), dtype=torch.float64))"
            in text)
    ent = solve(Measure(X[:, :2].requires_grad_()), Measure(Y[:, :2]), "streaming", reg=0.5)
    text = repr(ent)
    assert "tensor([" not in text and "grad_fn=" in text and "reg=0.5, debias=True, tol=1e-07" in text
    assert f"iterations={ent.iterations}" in text and "plan=None" in text and str(ent) == text


def test_debug_logging_of_an_exact_solve(caplog):
    """With the transport logger at DEBUG (meanfield's -v), an exact solve logs its value: the log line formatted
    a float value as a tensor and crashed every exact W2 under verbose logging."""
    import logging

    mu = Measure(torch.tensor([[0.0], [1.0]], dtype=torch.float64))
    nu = Measure(torch.tensor([[0.5], [2.0]], dtype=torch.float64))
    with caplog.at_level(logging.DEBUG, logger="transport"):
        res = solve(mu, nu, "exact")
    assert res.value_squared == pytest.approx(0.5 * 0.25 + 0.5 * 1.0)   # sorted pairs: (0, 0.5), (1, 2)
    assert any("value" in r.getMessage() and "exact" in r.getMessage() for r in caplog.records)



def test_exact_w2_of_small_clouds_is_scale_invariant():
    """W2(s mu, s nu) = s W2(mu, nu): POT's network simplex tests optimality with an absolute tolerance, and on
    the costs of clouds of size 1e-6 to 1e-148 (squared distances of 1e-12 and below) it returned a plan that was
    not optimal (W2 off by 5-20%, potentials all zero, so a zero gradient in the weights). Truth: the LP of
    tests/reference.py (scipy) at s = 1; for conditional W2 the same LP slice by slice (three positions, each
    slice of mass 1/3). The potentials scale as s^2."""
    from transport import conditional_w2

    g = torch.Generator().manual_seed(4)
    X, Y = torch.randn(9, 3, generator=g, dtype=torch.float64), torch.randn(9, 3, generator=g, dtype=torch.float64)
    a, b = rand_weights(9, seed=1), rand_weights(9, seed=2)
    truth = w2_lp(X, a, Y, b)
    pos = torch.tensor([0.1] * 3 + [0.5] * 3 + [0.9] * 3, dtype=torch.float64)
    sl = [slice(0, 3), slice(3, 6), slice(6, 9)]
    truth_c = math.sqrt(sum(w2_lp(X[i], torch.full((3,), 1 / 3, dtype=torch.float64), Y[i],
                                  torch.full((3,), 1 / 3, dtype=torch.float64)) ** 2 for i in sl) / 3)
    for s in (1.0, 1e-6, 1e-8, 1e-12, 1e-100):
        res = solve(Measure(s * X, a), Measure(s * Y, b), method="exact")
        assert float(res.value) / s == pytest.approx(truth, rel=1e-12), s
        f, gpot = res.potentials
        assert float(a @ f + b @ gpot) / s**2 == pytest.approx(truth**2, rel=1e-10), s
        wc = conditional_w2(Measure(s * X, positions=pos), Measure(s * Y, positions=pos))
        assert float(wc) / s == pytest.approx(truth_c, rel=1e-12), s


@pytest.mark.parametrize("far", [1e6, 1e8])
def test_far_atom_of_zero_or_negligible_mass_leaves_w2_unchanged(far):
    """A review: an atom of zero weight 1e8 away doubled exact W2 (2.19 against 1.105), 1e6 away raised it by 1.2%:
    its squared distance of 3e16 set the costs' scale, and the others fell below the simplex's absolute
    tolerance. Truth: the LP (scipy HiGHS) between the atoms that carry mass. The plan gives the far atom nothing,
    and the potentials stay dual-feasible on every atom (their sum with the weights is W2^2)."""
    X, Y = rand(30, 3, 40), rand(25, 3, 41) * 1.2 + 0.3
    a, b = torch.full((30,), 1 / 30, dtype=F64), torch.full((25,), 1 / 25, dtype=F64)
    truth = w2_lp(X, a, Y, b)
    Xz = torch.cat([X, torch.full((1, 3), far, dtype=F64)])
    zero = Measure(Xz, torch.cat([a, torch.zeros(1, dtype=F64)]))
    res = solve(zero, Measure(Y), "exact", return_plan=True)
    assert res.value == pytest.approx(truth, rel=1e-12)
    assert res.plan.shape == (31, 25) and float(res.plan[-1].abs().max()) == 0.0
    f, g = res.potentials
    C = ((Xz[:, None] - Y[None]) ** 2).sum(-1)
    scale = C + f.abs()[:, None] + g.abs()[None, :]   # the roundings of the far row's terms (3e16) count
    assert float((C - f[:, None] - g[None, :] + 1e-12 * scale).min()) >= -1e-10
    assert float(a @ f[:30] + b @ g) == pytest.approx(truth ** 2, rel=1e-9)
    # a positive mass of e^-700 (1e-304): its share of W2^2 is 1e-304 x 3e16
    lw = torch.cat([torch.log(a), torch.tensor([-700.0], dtype=F64)])
    assert w2(Measure(Xz, log_weights=lw), Measure(Y)) == pytest.approx(truth, rel=1e-12)
    # the same atoms in one position slice of conditional W2
    from transport import conditional_w2

    got = conditional_w2(Measure(Xz, torch.cat([a, torch.zeros(1, dtype=F64)]), positions=torch.zeros(31, dtype=F64)),
                         Measure(Y, positions=torch.zeros(25, dtype=F64)))
    assert float(got) == pytest.approx(truth, rel=1e-12)


def test_costs_beyond_float64_resolution_are_reported_not_returned():
    """Two clusters 1e7 apart: the within-cluster costs (about 1) lie 14 orders of magnitude below the cross ones,
    and the network simplex's plan cost 10% above the assignment problem's (a review: 0.4% at 1e7 before the cost
    reduction, 10% after it). The dual bound exposes it: a RuntimeError, never a wrong W2. At 1e5 apart the value is
    the assignment problem's. Truth: scipy's linear_sum_assignment on costs from differences."""
    from scipy.optimize import linear_sum_assignment

    rng = np.random.default_rng(0)
    for sep, ok in ((1e5, True), (1e7, False)):
        X = np.vstack([rng.standard_normal((20, 3)), rng.standard_normal((20, 3)) + sep])
        Y = np.vstack([rng.standard_normal((20, 3)), rng.standard_normal((20, 3)) + sep])
        C = ((X[:, None] - Y[None]) ** 2).sum(-1)
        r, c = linear_sum_assignment(C)
        truth = math.sqrt(C[r, c].mean())
        if ok:
            assert w2(Measure(X), Measure(Y)) == pytest.approx(truth, rel=1e-9)
        else:
            with pytest.raises(RuntimeError, match="cannot be certified optimal to float64's resolution"):
                w2(Measure(X), Measure(Y))


def test_far_clusters_never_return_an_uncertified_value():
    """Two clusters of 5 points per measure, 1e7 and 2e7 apart (a new user's review): the dual bound's own rounding
    was 8% of W2^2 there, so the check let plans 0.7% to 6.2% above the optimum through with converged=True. Now a
    value is returned only where the bound certifies it; otherwise RuntimeError. Truth: the assignment problem on
    each cluster alone (scipy's linear_sum_assignment), the cross-cluster costs being 1e14 larger."""
    from scipy.optimize import linear_sum_assignment

    def lsa(A, B):
        C = ((A[:, None] - B[None]) ** 2).sum(-1)
        r, c = linear_sum_assignment(C)
        return C[r, c].sum()

    rng = np.random.default_rng(7)
    returned = 0
    for sep in (1e7, 2e7):
        for _ in range(15):
            A1, A2, B1, B2 = (rng.standard_normal((5, 2)) for _ in range(4))
            shift = np.array([sep, 0.0])
            truth = math.sqrt((lsa(A1, B1) + lsa(A2, B2)) / 10)
            try:
                value = w2(Measure(np.vstack([A1, A2 + shift])), Measure(np.vstack([B1, B2 + shift])))
            except RuntimeError as exc:
                assert "cannot be certified" in str(exc)
                continue
            returned += 1
            assert value == pytest.approx(truth, rel=1e-6)
    assert returned > 0   # some far problems are still solved and certified


def test_measures_equal_to_rounding_are_not_refused():
    """The dual check must not refuse what it cannot resolve: the pushforward of a measure with one atom split in two
    against that of the measure (equal measures; their images differ by rounding, W2 of 7e-9 in the example
    examples/measure_pushforward.py, where the check raised). Truth: the identity coupling of the split atom's two
    images with the original's bounds W2 by the images' own differences, here at most 1e-7."""
    from meanfield import SelfAttention

    g = torch.Generator().manual_seed(0)
    X = torch.tensor([[-2.0, 0.0], [1.5, 1.5], [1.0, -2.0]], dtype=F64)[torch.arange(90) % 3]
    X = X + 0.45 * torch.randn(90, 2, generator=g, dtype=F64)
    mu = Measure(X, 0.5 + torch.rand(90, generator=g, dtype=F64), normalize=True)
    theta = 0.6
    A = 0.8 * torch.tensor([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]], dtype=F64)
    att = SelfAttention(A, torch.eye(2, dtype=F64))
    got = w2(att(mu.split(0, 0.3)), att(mu), "exact")
    assert 0.0 <= got <= 1e-7
