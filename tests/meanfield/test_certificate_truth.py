"""What a certified number promises, checked against the dense Jacobian at the returned input.

* ``local_lipschitz``: an estimate reported converged has ``error <= tol * value``, its certificate
  recomputed from the dense Jacobian at the returned vector says the same, and the dense top
  singular value lies in [value, value + error]; one reported not converged says so (a warning) and
  misses ``tol``. Checked at every iteration cap up to convergence, at several tolerances, on
  operators and inputs where Lanczos needs several steps: a certificate accepted at any constant
  factor above ``tol`` is caught at the cap where the true error lies between the two.
* ``WorstCaseResult.lower`` is the Rayleigh value at the returned input: at most the dense top
  singular value (a Rayleigh quotient never exceeds it) and within the Kato-Temple window below it,
  far tighter than the error bar, so the lower end of the bracket cannot move by the error bar.

Truths: attention written out from its formulas (tests/reference.py), its dense Jacobian by autograd,
torch's SVD of it, and two inequalities on Rayleigh quotients of the symmetric B = J^T J with a unit
vector u, theta = u.Bu and residual r = ||B u - theta u||: theta <= lambda_1 (Courant-Fischer) and,
when theta > lambda_2, lambda_1 - theta <= r^2 / (theta - lambda_2) (Kato-Temple).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from meanfield import SearchOptions, SelfAttention, krylov, local_lipschitz, worst_case_measure, worst_case_sequence
from particles import Measure
from tests.reference import dense_jacobian, dense_jacobian_logweights, naive_attention

pytestmark = pytest.mark.usefixtures("one_thread")
f64 = torch.float64
#: relative rounding allowed between a float64 quantity of the library and its dense recomputation
ROUND = 1e-11
#: the same for a value against torch's SVD of a small (<= 48 x 48) dense matrix
ROUND_SVD = 1e-13


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def on_sphere(n, d, R, seed):
    X = rand(n, d, seed=seed)
    return R * X / X.norm(dim=1, keepdim=True)


def certificate(J, u):
    """The certificate of the unit vector u for the matrix J, from the dense matrix: value v = |J u|,
    residual r = ||J^T J u - v^2 u|| and the error bound min(r / v, sqrt r) on the distance from v to
    a singular value of J (docs/math.md section 4.4)."""
    u = u.reshape(-1)
    Ju = J @ u
    v = float(Ju.norm())
    r = float((J.T @ Ju - v**2 * u).norm())
    return v, r, min(r / v, math.sqrt(r))


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])
def test_certificate_from_a_known_image_is_the_dense_certificate(scale):
    """The certificate of a unit u computed from its image B u = J^T J u (no product; the Lanczos
    path that keeps the images) is the dense one: value |J u|, normalized residual r / v, error
    min(r / v, sqrt r), and some singular value of J lies within the error of the value (the bound
    the certificate states). Checked where every singular value is below 1, around 1 and above 1,
    for a random u (large residual) and a near-singular vector (small residual); a u in the null
    space of J has value, residual and error 0, not NaN."""
    from meanfield.krylov import _rayleigh_from_image

    J = scale * rand(7, 5, seed=11)
    sigmas = torch.linalg.svdvals(J)
    top = torch.linalg.svd(J).Vh[0]
    for u in (rand(5, seed=12), top + 0.1 * rand(5, seed=13)):
        u = u / u.norm()
        v, rho, err, _ = _rayleigh_from_image(u[None], (J.T @ (J @ u))[None])
        v_d, r_d, err_d = certificate(J, u)
        assert float(v) == pytest.approx(v_d, rel=ROUND) and float(rho) == pytest.approx(r_d / v_d, rel=1e-10)
        assert float(err) == pytest.approx(err_d, rel=1e-10)
        assert float((sigmas - float(v)).abs().min()) <= float(err) * (1 + ROUND)
    J0 = torch.cat([J[:, :4], torch.zeros(7, 1, dtype=f64)], 1)
    e = torch.zeros(5, dtype=f64)
    e[4] = 1.0
    v, rho, err, z = _rayleigh_from_image(e[None], (J0.T @ (J0 @ e))[None])
    assert float(v) == float(rho) == float(err) == 0.0 and bool(torch.isfinite(z).all())


def _case(name):
    """(operator, input, dense matrix whose top singular value is the constant) of a named case. The
    spectra are not trivially separated (top singular values within 20 to 40 % of each other), so
    Lanczos needs 5 to 10 steps for tol 1e-2 to 1e-6."""
    if name == "sequence":
        n, d, R, seed = 32, 4, 1.5, 0
    elif name == "masked":
        n, d, R, seed = 48, 6, 1.0, 1
    else:
        n, d, R, seed = 40, 5, 1.2, 2
    A, V = rand(d, d, seed=seed + 10) / math.sqrt(d), rand(d, d, seed=seed + 20) / math.sqrt(d)
    X = on_sphere(n, d, R, seed)
    if name == "measure":
        mu = Measure(X, torch.softmax(rand(n, seed=seed + 30), 0))
        J = dense_jacobian_logweights(lambda Y: naive_attention(Y, A, V, log_weights=mu.log_weights), X,
                                      mu.log_weights)
        return SelfAttention(A, V), mu, J
    masked = name == "masked"
    return SelfAttention(A, V, masked=masked), X, dense_jacobian(lambda Y: naive_attention(Y, A, V, masked=masked), X)


def _estimate(op, X, **kw):
    """local_lipschitz with on_failure="warn": the estimate and whether it warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = local_lipschitz(op, X, on_failure="warn", **kw)
    warned = any(issubclass(w.category, RuntimeWarning) and "did not reach" in str(w.message) for w in caught)
    return est, warned


def _check_certified(est, J, tol, sigma):
    """The promises of one estimate, against the dense matrix J with top singular value sigma."""
    assert est.value <= sigma * (1 + ROUND)                     # a Rayleigh value never exceeds sigma
    # converged means: error <= tol * value, in the library's numbers and in the dense recomputation
    assert est.converged == (est.error <= tol * est.value)
    if est.converged or est.method == "lanczos":  # see test_power_unconverged_vector_is_the_certified_one
        v, _, err = certificate(J, est.vector)
        assert abs(est.value - v) <= ROUND * v                  # value = |J u| at the returned vector
        assert abs(est.error - err) <= 1e-6 * err + ROUND * v   # the error bound is that of u, recomputed
    if est.converged:
        assert err <= tol * v * (1 + 1e-6) + ROUND * v
        assert sigma - est.value <= est.error + ROUND * sigma  # sigma in [value, value + error]
        assert (sigma - est.value) / sigma <= tol


@pytest.mark.parametrize("method", ["lanczos", "power"])
@pytest.mark.parametrize("name", ["sequence", "masked", "measure"])
def test_converged_means_within_tol_of_the_dense_singular_value(name, method):
    """At tol 1e-2, 1e-4, 1e-6 (power: 1e-2, 1e-4) and at every iteration cap up to the one that
    converges (power: the last six), the estimate keeps the promises of :func:`_check_certified`, and
    warns exactly when it is not converged. The caps just below convergence leave a true error a few
    times tol: an acceptance test loosened by a constant factor reports them converged, and fails."""
    op, X, J = _case(name)
    sigma = float(torch.linalg.matrix_norm(J, ord=2))
    tols = (1e-2, 1e-4, 1e-6) if method == "lanczos" else (1e-2, 1e-4)
    for tol in tols:
        full, warned = _estimate(op, X, method=method, tol=tol)
        assert full.converged and not warned
        m = full.iterations
        assert m >= 3, "the case is too easy: Lanczos must need several steps for the caps below to matter"
        # (power: its iterations include the check's POWER_CHECK_STEPS Lanczos steps after convergence)
        caps = range(1, m + 1) if method == "lanczos" else range(max(1, m - 5 - krylov.POWER_CHECK_STEPS), m + 1)
        missed = 0
        for cap in caps:
            est, warned = _estimate(op, X, method=method, tol=tol, max_iter=cap)
            assert warned == (not est.converged), (tol, cap)
            _check_certified(est, J, tol, sigma)
            missed += not est.converged
        assert missed >= 1   # some cap stops short of tol: the loop above did test the acceptance


@pytest.mark.parametrize("name", ["sequence", "masked", "measure"])
def test_acceptance_threshold_is_tol_itself(name):
    """At each iteration cap, the Ritz vector's relative error e (from the dense Jacobian) is measured
    once; with tol 5 % below e the estimate must not be converged, with tol 5 % above it must be (the
    same Krylov space: the cap stops both runs). An acceptance loosened or tightened by any factor
    beyond 1.05 fails one of the two."""
    op, X, J = _case(name)
    sigma = float(torch.linalg.matrix_norm(J, ord=2))
    for cap in range(2, 8):
        probe, _ = _estimate(op, X, tol=1e-14, max_iter=cap)   # an unreachable tol: the cap stops the run
        v, _, err = certificate(J, probe.vector)
        e = err / v
        for factor, expected in ((1 / 1.05, False), (1.05, True)):
            est, warned = _estimate(op, X, tol=e * factor, max_iter=cap)
            assert est.converged == expected and warned != expected, (cap, factor)
            _check_certified(est, J, e * factor, sigma)


def test_power_unconverged_vector_is_the_certified_one():
    """An estimate that did not converge still certifies its vector: value = |J u| at the returned u."""
    op, X, J = _case("sequence")
    est, warned = _estimate(op, X, method="power", tol=1e-12, max_iter=3)
    assert warned and not est.converged
    v, _, err = certificate(J, est.vector)
    assert abs(est.value - v) <= ROUND * v and abs(est.error - err) <= 1e-6 * err + ROUND * v


def test_power_keeps_its_best_certificate():
    """Power iteration returns the iterate with the best certificate so far, not the last one: stopped
    at max_iter = 1, 2, ..., 8 (the same iterates each time, from the same seed), the relative error
    never grows with the budget, and each returned error is the dense certificate of the returned
    vector. On this input (two heads) the certified error of the iterates themselves grows at the
    4th to 6th iteration, so returning the last iterate breaks the first property."""
    from tests.meanfield.test_lipschitz import make_op

    op = make_op("mha", masked=False)
    X = rand(6, 4, seed=7) * 1.5
    J = dense_jacobian(op.sequence, X)
    previous = math.inf
    for k in range(1, 9):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            est = local_lipschitz(op, X, method="power", tol=1e-12, max_iter=k, on_failure="warn")
        v, _, err = certificate(J, est.vector)
        assert abs(est.value - v) <= ROUND * v and abs(est.error - err) <= 1e-6 * err + ROUND * v
        assert est.error / est.value <= previous * (1 + ROUND), k
        previous = est.error / est.value


@pytest.mark.parametrize("tol", [1e-2, 1e-3])
def test_worst_case_lower_is_the_rayleigh_value_at_the_input(tol, monkeypatch):
    """``lower`` of the sequence search: at most the dense top singular value at ``input`` (up to
    rounding) and above it by at most the Kato-Temple window r^2 / (theta - lambda_2), which is far
    below the error bar: the lower end of the bracket is the value, not the value plus its error. (Lanczos's
    minimum of 8 vectors certifies these small problems to rounding, leaving no error bar to tell the two
    apart: the minimum is lifted here, as a loose tol on a larger problem would leave a wide bar.)"""
    monkeypatch.setattr(krylov, "LANCZOS_MIN_STEPS", 0)
    d, n, R = 3, 16, 2.0    # n d > 32: the search certifies with Lanczos (below, with the dense SVD)
    A, V = rand(d, d, seed=3) / math.sqrt(d), rand(d, d, seed=4) / math.sqrt(d)
    res = worst_case_sequence(SelfAttention(A, V), R=R, n=n, budget=1500,
                              options=SearchOptions(random=2, clusters=0, max_steps=20, tol=tol, seed=0))
    assert bool((res.input.norm(dim=1) <= R * (1 + 1e-12)).all())
    J = dense_jacobian(lambda Y: naive_attention(Y, A, V), res.input)
    _check_bracket_lower(res, J)


def test_worst_case_measure_lower_is_the_rayleigh_value_at_the_input(monkeypatch):
    """The same for the measure search (weighted Jacobian of Lemma C.5 at the returned measure)."""
    monkeypatch.setattr(krylov, "LANCZOS_MIN_STEPS", 0)
    d, R = 3, 2.0
    A, V = rand(d, d, seed=5) / math.sqrt(d), rand(d, d, seed=6) / math.sqrt(d)
    # 12 atoms in dimension 3: Lanczos, not the dense SVD; no split (a split input is certified at 1e-10)
    res = worst_case_measure(SelfAttention(A, V), R=R, atoms=12, budget=1500, split=False,
                             options=SearchOptions(random=1, max_steps=10, tol=1e-3, seed=0))
    mu = res.input
    J = dense_jacobian_logweights(lambda Y: naive_attention(Y, A, V, log_weights=mu.log_weights), mu.points,
                                  mu.log_weights)
    _check_bracket_lower(res, J)


def _check_bracket_lower(res, J):
    S = torch.linalg.svdvals(J)
    sigma, sigma2 = float(S[0]), float(S[1])
    v, r, _ = certificate(J, res.estimate.vector)
    lower = res.lower
    assert res.error > 100 * ROUND_SVD * sigma, "the error bar must exceed rounding for this test to tell lower apart"
    assert lower <= sigma * (1 + ROUND_SVD)                                  # Courant-Fischer
    assert v**2 > sigma2**2, "Kato-Temple needs the Rayleigh value above the second eigenvalue"
    window = r**2 / (v**2 - sigma2**2)                                       # Kato-Temple, on eigenvalues of J^T J
    assert sigma**2 - lower**2 <= window + ROUND_SVD * sigma**2
    assert window < 0.01 * (2 * sigma * res.error)   # the window is much tighter than the error bar
    assert res.upper.value >= lower


@pytest.mark.parametrize("method", ["lanczos", "power", "dense"])
def test_float32_converged_means_within_error_of_the_float64_constant(method):
    """A float32 input is certified against the map itself, not against its float32 rounding: at radii 50 and 100,
    where float32 products err by 1e-4 to 3e-3 relative (scores of order R^2), a converged estimate's value lies
    in [truth - error, truth] and error <= tol * value, with truth the top singular value of the dense float64
    Jacobian (written-out attention, autograd, SVD) of the very same float32 numbers. An estimate that misses
    says so (ConvergenceError). The float32 certificates alone once reported 0.3% errors as 4e-6."""
    reported = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        d, n = 4, 8
        R = (50.0, 100.0, 60.0)[seed % 3]
        A = torch.randn(d, d, generator=g, dtype=f64).float()
        V = torch.randn(d, d, generator=g, dtype=f64).float()
        X = torch.randn(n, d, generator=g, dtype=f64)
        X = (R * X / X.norm(dim=1, keepdim=True)).float()
        J = dense_jacobian(lambda Y, A=A, V=V: naive_attention(Y, A.double(), V.double()), X.double())
        truth = float(torch.linalg.matrix_norm(J, ord=2))
        for tol in (1e-3, 1e-4):
            try:
                est = local_lipschitz(SelfAttention(A, V, dtype=torch.float32), X, method=method, tol=tol)
            except Exception as exc:   # noqa: BLE001 (only ConvergenceError is allowed, checked below)
                assert type(exc).__name__ == "ConvergenceError", exc
                continue
            reported += 1
            assert est.converged and est.error <= tol * est.value
            assert est.value <= truth * (1 + 1e-12), (seed, tol, est.value, truth)
            assert truth - est.value <= est.error * (1 + 1e-9) + 1e-12 * truth, (seed, tol, est.value, est.error, truth)
            # the value is |J u| at the returned vector (float64 steps move it: it is returned moved)
            u = est.vector.double().reshape(-1)
            assert float((J @ (u / u.norm())).norm()) == pytest.approx(est.value, rel=1e-10), (seed, tol)
    assert reported >= 10


def test_float32_estimate_moved_by_float64_steps_returns_the_vector_it_certifies(monkeypatch):
    """Where the float32 vector misses tol in float64, float64 power steps move it; the estimate returned the
    float32 solve's vector with the moved vector's value and residual (|J vector| 2e-6 from the value, outside
    its error 3.7e-7). Now value, error and residual are those of the returned vector: checked against the dense
    float64 Jacobian of the same float32 numbers (d = 8, n = 24, R = 60, tol = 1e-5, where the steps run)."""
    d, n = 8, 24
    g = torch.Generator().manual_seed(7)
    A = torch.randn(d, d, generator=g) / math.sqrt(d)
    V = torch.randn(d, d, generator=g) / math.sqrt(d)
    X = torch.randn(n, d, generator=g)
    X = 60.0 * X / X.norm(dim=1, keepdim=True)
    op = SelfAttention(A, V, dtype=torch.float32)
    from meanfield.jacobian import Jacobian

    counts = {torch.float32: 0, torch.float64: 0}
    raw = Jacobian._raw_J
    monkeypatch.setattr(Jacobian, "_raw_J", lambda p, u: counts.__setitem__(u.dtype, counts[u.dtype] + 1)
                        or raw(p, u))
    local_lipschitz(op, X, tol=1e-3)
    plain = counts[torch.float64]
    est = local_lipschitz(op, X, tol=1e-5)
    # float64 steps ran: more float64 products than the tol = 1e-3 run's one certificate
    assert plain == 1 and est.converged and counts[torch.float64] - plain > 1
    J = dense_jacobian(lambda Y: naive_attention(Y, A.double(), V.double()), X.double())
    u = est.vector.double().reshape(-1)
    u = u / u.norm()
    assert float((J @ u).norm()) == pytest.approx(est.value, rel=1e-12)
    residual = float((J.T @ (J @ u) - est.value**2 * u).norm())
    assert residual == pytest.approx(est.residual, rel=1e-6)
    truth = float(torch.linalg.matrix_norm(J, ord=2))
    assert est.value <= truth * (1 + 1e-12) and truth - est.value <= est.error


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_dense_method_and_weighted_float16_measures(dtype):
    """method='dense' on a half-precision layer raised torch's NotImplementedError (no SVD in the half types), and
    a float16 measure with unequal weights was refused (a headroom of e^12 is more than float16's whole range,
    e^11). Both now give a certified constant: within its error of the dense float64 Jacobian's top singular value
    of the same numbers, the vector in the input's dtype."""
    g = torch.Generator().manual_seed(0)
    A, V = torch.randn(3, 3, generator=g, dtype=f64), torch.randn(3, 3, generator=g, dtype=f64)
    op = SelfAttention(A.to(dtype), V.to(dtype), dtype=dtype)
    X = torch.randn(6, 3, generator=g, dtype=f64).to(dtype)
    J = dense_jacobian(lambda Y: naive_attention(Y, A.to(dtype).double(), V.to(dtype).double()), X.double())
    truth = float(torch.linalg.matrix_norm(J, ord=2))
    est = local_lipschitz(op, X, method="dense")
    assert est.converged and est.vector.dtype == dtype and abs(est.value - truth) <= est.error
    w = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=f64)
    mu = Measure(torch.randn(5, 3, generator=g, dtype=f64), w).to(dtype=dtype)
    la = mu.log_weights.double()
    Jw = dense_jacobian_logweights(lambda Y: naive_attention(Y, A.to(dtype).double(), V.to(dtype).double(),
                                                             log_weights=la), mu.points.double(), la)
    truth_w = float(torch.linalg.matrix_norm(Jw, ord=2))
    est_w = local_lipschitz(op, mu)
    assert est_w.converged and abs(est_w.value - truth_w) <= est_w.error


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_bfloat16_input_finds_the_top_of_the_spectrum(method):
    """A bfloat16 Lanczos (and power iteration) certified the second singular value, 27.8, of a Jacobian whose top
    one is 93.9 (the float64 check then certified that second pair: its residual is small). Half-precision inputs
    are solved with float64 products of the same numbers: the value lies within its error of the top singular
    value of the dense float64 Jacobian, and the vector comes back in bfloat16."""
    d, n = 4, 8
    g = torch.Generator().manual_seed(2)
    A = (torch.randn(d, d, generator=g, dtype=f64) / math.sqrt(d)).to(torch.bfloat16)
    V = torch.randn(d, d, generator=g, dtype=f64).to(torch.bfloat16)
    X = torch.randn(n, d, generator=g, dtype=f64)
    X = (10.0 * X / X.norm(dim=1, keepdim=True)).to(torch.bfloat16)
    J = dense_jacobian(lambda Y: naive_attention(Y, A.double(), V.double()), X.double())
    truth = float(torch.linalg.matrix_norm(J, ord=2))
    est = local_lipschitz(SelfAttention(A, V, dtype=torch.bfloat16), X, method=method)
    assert est.converged and est.vector.dtype == torch.bfloat16
    assert est.value <= truth * (1 + 1e-12) and truth - est.value <= est.error
