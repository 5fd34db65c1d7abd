"""No estimator certifies a wrong value: scans over the radius, float32 and float64, on the witnesses
of Propositions 3.4 and 3.6, where every method either agrees with an independent float64 dense
Jacobian or raises; never a silent 0, NaN or an uncertified value marked converged."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from meanfield import SelfAttention, adversarial, local_lipschitz
from meanfield.lipschitz import ConvergenceError
from particles import Measure
from particles.validation import MemoryLimitError
from tests.reference import dense_lipschitz, dense_lipschitz_logweights, naive_attention

pytestmark = pytest.mark.usefixtures("one_thread")
f32, f64 = torch.float32, torch.float64
METHODS = ["lanczos", "power", "dense"]
RADII = [0.5, 2.0, 8.0, 13.0, 16.0, 20.0, 25.0, 40.0, 53.0, 60.0, 75.0, 100.0]
A_MIN = np.diag([0.3, -1.0, 0.2])   # Proposition 3.4's other eigen-case: -lambda_min wins
GAMMA = {"lambda_max": 1 / 8, "lambda_min": 1.0}  # gamma = max(lambda_max / 8, -lambda_min), by hand


def _outcome(op, X, method, dtype):
    tol = 1e-4 if dtype == f32 else 1e-9
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a flagged estimate is checked by the caller
            return local_lipschitz(op, X, method=method, tol=tol, max_iter=400, on_failure="warn")
    except (OverflowError, ValueError) as exc:  # refused: the constant or the weights leave the range
        assert not isinstance(exc, ConvergenceError)
        return exc


def _check(est, truth, dtype):
    if isinstance(est, Exception):
        return "raised"
    assert math.isfinite(est.value) and math.isfinite(est.error)
    if not est.converged:
        return "flagged"
    # converged: the float64 truth lies in the certified interval (up to the float32 evaluation's rounding)
    slack = 2e-5 if dtype == f32 else 1e-12
    assert est.value > 0
    assert est.value <= truth * (1 + slack), (est.value, truth)
    assert est.value + est.error >= truth * (1 - slack), (est.value, est.error, truth)
    assert abs(est.value - truth) <= max(est.error, slack * truth) + slack * truth
    return "agrees"


@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", ["lambda_max", "lambda_min"])
def test_two_dirac_radius_scan(case, method, dtype):
    A = np.eye(3) if case == "lambda_max" else A_MIN
    A64 = torch.as_tensor(A, dtype=f64)
    op = SelfAttention(A64.to(dtype), torch.eye(3, dtype=dtype))
    outcomes = []
    for R in RADII:
        mu = adversarial.two_dirac(A, R, dtype=dtype)
        X64, lw64 = mu.points.to(f64), mu.log_weights.to(f64)
        f = lambda Y, lw=lw64: naive_attention(Y, A64, torch.eye(3, dtype=f64), log_weights=lw)
        truth = dense_lipschitz_logweights(f, X64, lw64)
        outcomes.append(_check(_outcome(op, mu, method, dtype), truth, dtype))
    # the range that must be computed: float64 up to gamma R^2 = 200 (Lip ~ 7e88 for A = I, R = 40,
    # whose fourth power overflows), float32 up to gamma R^2 = 21 (Lip ~ 1.7e10 for A = I, R = 13)
    reach = 200.0 if dtype == f64 else 21.2
    inside = [o for R, o in zip(RADII, outcomes) if GAMMA[case] * R * R <= reach]
    if method == "power":
        # the power iteration may stall on the flat spectra of small radii (flagged, honestly), but
        # at the largest radius in range, where the bug certified 0.0, it must agree
        assert set(inside) <= {"agrees", "flagged"} and inside[-1] == "agrees", outcomes
    else:
        assert all(o == "agrees" for o in inside), outcomes


@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("A", [np.eye(3), A_MIN], ids=["lambda_max", "lambda_min"])
def test_sqrt_n_witness_radius_scan(A, masked, dtype):
    A64 = torch.as_tensor(A, dtype=f64)
    op = SelfAttention(A64.to(dtype), torch.eye(3, dtype=dtype), masked=masked)
    for R in RADII:
        X = adversarial.sqrt_n_sequence(A, R, 9, dtype=dtype)
        truth = dense_lipschitz(lambda Y: naive_attention(Y, A64, torch.eye(3, dtype=f64), masked=masked),
                                X.to(f64))
        for method in METHODS:
            # the power iteration may stall on this flat spectrum: flagged (not converged) is an honest answer
            allowed = ("agrees", "flagged") if method == "power" else ("agrees",)
            assert _check(_outcome(op, X, method, dtype), truth, dtype) in allowed, (R, method)


def test_overflowing_constant_raises_instead_of_zero():
    """The issue's reproducers: float32 at R = 13 and float64 at R = 40 used to certify 0.0."""
    op = SelfAttention(torch.eye(3, dtype=f32), torch.eye(3, dtype=f32))
    est = local_lipschitz(op, adversarial.two_dirac(np.eye(3), 13.0, dtype=f32), method="power", tol=1e-5)
    assert est.converged and abs(est.value / 1.653195e10 - 1) < 1e-5
    est = local_lipschitz(SelfAttention(np.eye(3), np.eye(3)), adversarial.two_dirac(np.eye(3), 40.0),
                          method="power")
    assert est.converged and abs(est.value / 7.262104e88 - 1) < 1e-6
    # beyond the range: a clear refusal naming the cause
    with pytest.raises(ValueError, match="weights of this measure span"):
        local_lipschitz(SelfAttention(np.eye(3), np.eye(3)), adversarial.two_dirac(np.eye(3), 100.0))


def test_zero_jacobian_is_exactly_zero_and_underflow_raises():
    X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=f64)
    zero = SelfAttention(np.eye(3), np.zeros((3, 3)))
    for method in METHODS:
        est = local_lipschitz(zero, X, method=method)
        assert est.value == 0.0 and est.converged
    # mixed precision: the float32 twin of a zero Jacobian stands aside and float64 says it is zero
    est = local_lipschitz(zero, X, mixed=True)
    assert est.value == 0.0 and est.converged
    # a Jacobian below the dtype's range: in float32, V = 1e-45 (the smallest subnormal) makes J u
    # round to 0 although J is not zero, and V = 1e-40 leaves it a few bits of precision
    for v in (1e-45, 1e-40):
        tiny = SelfAttention(torch.eye(3, dtype=f32), v * torch.eye(3, dtype=f32))
        for method in METHODS:
            with pytest.raises(OverflowError, match="too small for torch.float32 to certify"):
                local_lipschitz(tiny, X.to(f32), method=method)
    # the same operator in float64 is well inside the range: its constant is V's scale times that of V = I
    unit = local_lipschitz(SelfAttention(np.eye(3), np.eye(3)), X, tol=1e-10).value
    est = local_lipschitz(SelfAttention(np.eye(3), 1e-40 * np.eye(3)), X, tol=1e-10)
    assert abs(est.value / (1e-40 * unit) - 1) < 1e-9


def test_memory_guards_refuse_before_allocating():
    op = SelfAttention(np.eye(64), np.eye(64))
    X = torch.zeros(2000, 64, dtype=f64)
    with pytest.raises(MemoryLimitError, match="lanczos") as info:
        local_lipschitz(op, X, method="dense")
    assert "GiB" in str(info.value) and isinstance(info.value, MemoryError)
    with pytest.raises(MemoryLimitError, match="max_iter"):
        local_lipschitz(op, X, method="lanczos", max_iter=300, memory_limit="100M")
    with pytest.raises(ValueError, match="memory_limit"):
        local_lipschitz(op, X[:4], memory_limit="lots")


def test_krylov_basis_grows_with_the_iterations():
    """The basis is allocated as it grows: a solve that stops early never holds max_iter vectors."""
    op = SelfAttention(np.eye(3), np.eye(3))
    X = torch.randn(6, 3, generator=torch.Generator().manual_seed(1), dtype=f64)
    est = local_lipschitz(op, X, max_iter=300, memory_limit=300 * 18 * 8)  # the full basis would fit exactly
    assert est.converged and est.iterations < 18
    with pytest.raises(MemoryLimitError):
        local_lipschitz(op, X, max_iter=300, memory_limit=18 * 8 * 10)
    assert Measure.empirical(X).n == 6
