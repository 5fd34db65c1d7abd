"""Over-relaxed steps of the streaming Sinkhorn (transport/overrelaxation.py) and the exponent floor of its tiles.

Truths: Young's theory of successive over-relaxation, checked on a linear iteration whose spectral radius numpy
computes (the rule's formula is that theory); the independent numpy Sinkhorn of tests/reference.py for values;
the marginals of the plan that the returned potentials define, summed densely in numpy, for the certificate
(the reported error must bound them whatever the relaxation did).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from particles import Measure
from particles.validation import ConvergenceError
from tests.reference import entropic_ot
from tests.transport.helpers import plan_marginal_error
from transport import solve, tiles
from transport.overrelaxation import GUARD, OMEGA_MAX, WINDOW, Relaxation, young_omega

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- the rule against SOR theory
def _sor_radius(B, omega):
    """Spectral radius of SOR on the 2-cyclic system [[I, -B], [-B^T, I]] (Jacobi matrix [[0, B], [B^T, 0]])."""
    n, m = B.shape
    D = np.eye(n + m)
    L = np.zeros((n + m, n + m))
    U = np.zeros((n + m, n + m))
    U[:n, n:] = B
    L[n:, :n] = B.T
    M = np.linalg.solve(D - omega * L, (1 - omega) * D + omega * U)
    return float(np.abs(np.linalg.eigvals(M)).max())


def _cyclic(mu, seed=0):
    rng = np.random.default_rng(seed)
    B = rng.standard_normal((5, 4))
    return mu * B / np.linalg.svd(B, compute_uv=False)[0]   # Jacobi spectral radius mu


@pytest.mark.parametrize("mu", [0.8, 0.95, 0.99])
def test_young_omega_recovers_the_optimal_factor_from_a_rate_at_any_smaller_factor(mu):
    B = _cyclic(mu)
    best = 2.0 / (1.0 + math.sqrt(1.0 - mu * mu))   # Young's optimum for Jacobi radius mu
    # plain Gauss-Seidel (omega = 1) contracts by mu^2, as plain Sinkhorn's rate rho
    assert _sor_radius(B, 1.0) == pytest.approx(mu * mu, rel=1e-9)
    for omega in (1.0, 1.1, 0.5 * (1.0 + best)):
        assert young_omega(_sor_radius(B, omega), omega) == pytest.approx(best, rel=1e-6)
    # and that factor is the best one: its rate omega - 1, below the rates on either side of it
    at = _sor_radius(B, best)
    assert at == pytest.approx(best - 1.0, abs=5e-3)
    assert at < min(_sor_radius(B, best - 0.05), _sor_radius(B, min(1.999, best + 0.05)))


def test_young_omega_refuses_rates_and_factors_out_of_range():
    for rate, omega in ((0.0, 1.0), (1.0, 1.0), (0.5, 2.0), (0.5, 0.9), (math.nan, 1.0)):
        with pytest.raises(ValueError, match="rate, omega"):
            young_omega(rate, omega)


def test_adaptive_rule_reads_the_rate_of_plain_steps_then_guards_against_growth():
    rho = 0.97
    relax = Relaxation("auto")
    factors = [relax.observe(0.3 * rho ** k) for k in range(WINDOW + 1)]
    assert factors[:WINDOW] == [1.0] * WINDOW
    assert factors[-1] == pytest.approx(2.0 / (1.0 + math.sqrt(1.0 - rho)), rel=1e-9)
    omega = factors[-1]
    # a growing error (GUARD times the best seen) halves the excess over 1
    assert relax.observe(0.3 * rho ** WINDOW * GUARD * 1.01) == pytest.approx(1.0 + (omega - 1.0) / 2.0)
    # a rate close to 1 asks for a factor close to 2: capped
    slow = Relaxation("auto")
    for k in range(WINDOW + 1):
        w = slow.observe(0.999999 ** k)
    assert w == OMEGA_MAX
    # non-finite errors change nothing; a fixed factor stays fixed
    assert Relaxation("auto").observe(math.nan) == 1.0
    fixed = Relaxation(1.6)
    assert [fixed.observe(e) for e in (1.0, 0.5, 100.0, 1e-9)] == [1.6] * 4


# ---------------------------------------------------------------------- the solver
def _pair(n=120):
    g = torch.Generator().manual_seed(3)
    x = torch.rand(n, 3, generator=g, dtype=F64)
    y = torch.rand(n, 3, generator=g, dtype=F64) + 0.1
    return Measure(x), Measure(y)


REG = 2 * 0.05 ** 2   # GeomLoss's blur 0.05 on the unit cube: plain Sinkhorn crawls here


@pytest.mark.parametrize("omega", ["auto", 1.0, 1.5, 1.9])
def test_the_reported_error_certifies_the_plan_whatever_the_factor(omega):
    mu, nu = _pair()
    res = solve(mu, nu, "streaming", reg=REG, debias=False, tol=1e-3, overrelaxation=omega)
    assert res.converged and res.error <= 1e-3
    assert plan_marginal_error(mu, nu, *res.potentials, REG) <= res.error * (1 + 1e-9) + 1e-13
    # a budget too small to converge: says so, and the error it reports still bounds the plan's
    with pytest.warns(RuntimeWarning, match="did not converge"):
        short = solve(mu, nu, "streaming", reg=REG, debias=False, tol=1e-9, max_iter=25, overrelaxation=omega,
                      on_failure="warn")
    assert not short.converged and short.iterations <= 25
    assert plan_marginal_error(mu, nu, *short.potentials, REG) <= short.error * (1 + 1e-9) + 1e-13


def test_relaxed_values_match_an_independent_sinkhorn_with_fewer_passes():
    mu, nu = _pair()
    a = mu.weights.numpy()
    _, cost, _, _ = entropic_ot(mu.points.numpy(), a, nu.points.numpy(), a, REG, tol=1e-11)
    runs = {w: solve(mu, nu, "streaming", reg=REG, debias=False, tol=1e-9, overrelaxation=w) for w in ("auto", 1.0)}
    for res in runs.values():
        assert res.converged
        assert res.value_squared == pytest.approx(cost, rel=1e-7)
    # the point of it: at this blur plain Sinkhorn takes over twice the updates
    assert runs["auto"].iterations * 2 < runs[1.0].iterations


def test_relaxed_debiased_float32_solve_matches_the_plain_one():
    mu, nu = _pair(200)
    mu32, nu32 = mu.to(dtype=torch.float32), nu.to(dtype=torch.float32)
    vals = [solve(mu32, nu32, "streaming", reg=REG, tol=1e-5, overrelaxation=w).value_squared for w in ("auto", 1.0)]
    assert vals[0] == pytest.approx(vals[1], rel=1e-4)


@pytest.mark.parametrize("bad, error, match", [
    (2.0, ValueError, r"overrelaxation: expected 'auto' or a factor in \[1, 2\)"),
    (0.9, ValueError, "overrelaxation"),
    ("fast", ValueError, "overrelaxation"),
    (True, TypeError, "overrelaxation"),
    (math.nan, ValueError, "overrelaxation"),
])
def test_bad_factors_are_refused_naming_the_option(bad, error, match):
    mu, nu = _pair(10)
    with pytest.raises(error, match=match):
        solve(mu, nu, "streaming", reg=REG, overrelaxation=bad)


@pytest.mark.parametrize("method", ["exact", "sinkhorn"])
def test_the_option_does_not_apply_to_other_methods(method):
    mu, nu = _pair(10)
    with pytest.raises(TypeError, match="overrelaxation: does not apply"):
        solve(mu, nu, method, **({"reg": REG} if method == "sinkhorn" else {}), overrelaxation=1.5)


def test_nonconvergence_is_raised_with_relaxation():
    mu, nu = _pair(50)
    with pytest.raises(ConvergenceError, match="did not converge"):
        solve(mu, nu, "streaming", reg=REG, tol=1e-12, max_iter=30)


# ---------------------------------------------------------------------- the exponent floor
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_exponent_floor_keeps_terms_normal_and_sums_exact(dtype):
    fi = torch.finfo(dtype)
    floor = tiles.exp_floor(dtype)
    assert float(torch.exp(torch.tensor(floor, dtype=dtype))) >= fi.tiny   # a normal number: the fast path
    # rows of terms far below the floor (e^-1e4) beside terms of order one: sums unchanged to the dtype's precision
    m = 300
    exps = torch.full((3, m), -1e4, dtype=dtype)
    exps[0, :7] = torch.linspace(-2.0, 1.0, 7, dtype=dtype)
    exps[1, 0] = 0.0
    A = torch.cat([torch.eye(3, dtype=dtype)], 1)
    S = tiles.row_sums(A, exps, 2 ** 18)
    truth = torch.logsumexp(exps.double(), 1).exp()
    torch.testing.assert_close(S[:2].double(), truth[:2], rtol=4 * fi.eps, atol=0)
    safe = tiles.safe(S, m)
    assert bool(safe[:2].all()) and not bool(safe[2])   # the all-underflow row goes to the fallback


def test_a_float32_solve_continued_in_float64_certifies_the_columns_too():
    """A float32 solve whose float64 check misses tol continues in float64 from its potentials, which end with a
    step of f: the continuation's first error must count the columns (it once stopped at once on the rows'
    error alone, reporting 1.1e-4 for a plan at 1.0e-3). Found by an independent review."""
    import transport.streaming_sinkhorn as st

    gg = torch.Generator().manual_seed(201)
    x, y = torch.rand(200, 1, generator=gg), torch.rand(9, 1, generator=gg) + 0.2   # float32, n != m, d = 1
    D2 = float((torch.cat([x, y]).max() - torch.cat([x, y]).min()) ** 2)
    tol = 1e-3
    reg = 6e-8 * D2 / (tol * 0.6)   # float32 resolves the plan, barely: its check misses tol
    calls = []
    solve_pair = st._solve_pair
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(st, "_solve_pair", lambda *a, **k: calls.append(k.get("start") is not None) or solve_pair(*a, **k))
        mu, nu = Measure(x), Measure(y)
        res = solve(mu, nu, "streaming", reg=reg, debias=False, tol=tol, on_failure="warn")
    assert calls == [False, True] and res.precision == torch.float64   # the continuation ran
    dense = plan_marginal_error(mu.to(dtype=torch.float64), nu.to(dtype=torch.float64), *res.potentials, reg)
    assert dense <= res.error * (1 + 1e-6) + 1e-12


def test_relaxation_ignores_a_window_whose_ratio_underflows():
    relax = Relaxation("auto")
    for err in (1e10, 1e9, 1e8, 1e7, 1e-315):
        assert 1.0 <= relax.observe(err) < 2.0
