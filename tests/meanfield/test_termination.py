"""Every call of the Lipschitz estimators returns, within its budget, and says whether it converged.

Fuzzed over dtypes, radii up to 100, tolerances down to 1e-17, degenerate inputs (identical tokens,
one token, zero weights), masked and unmasked operators, and small Hugging Face layers in both
dtypes. Each example runs under a wall-clock alarm (a call that never returns fails the test with
the example) and its products are counted against the budget the solvers document. Outcomes
allowed: a converged estimate within its error of the dense Jacobian's top singular value (an
independent truth), a ConvergenceError / warning carrying a non-converged estimate that says why,
a ValueError for a tolerance below the dtype's machine epsilon, or an OverflowError for a constant
beyond the dtype's range.
"""

from __future__ import annotations

import contextlib
import math
import signal
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meanfield import L2SelfAttention, MultiHeadAttention, SelfAttention, adversarial, local_lipschitz
from meanfield.lipschitz import MAX_ITER, TOL, ConvergenceError, LipschitzEstimate
from particles import Measure
from tests.reference import dense_jacobian, dense_lipschitz

pytestmark = pytest.mark.usefixtures("one_thread")
f32, f64 = torch.float32, torch.float64
#: seconds an example may take before it counts as a call that never returns (examples take milliseconds)
WALL = 60


@contextlib.contextmanager
def wall_clock(seconds, what):
    def expired(signum, frame):
        raise TimeoutError(f"{what}: no answer after {seconds} s (a call that never returns)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def product_budget(method, max_iter, size, mixed):
    """Products a run may use (meanfield.krylov's documented bound), plus the range calibration."""
    if method == "power":
        return 2 * max_iter + 2
    if method == "dense":
        return size
    m = min(max_iter, size)
    return 4 * m + 4 + (2 * m + 24 if mixed else 0)


def _operator(kind, d, masked, dtype):
    g = np.random.default_rng(7)
    A = g.standard_normal((d, d)) / math.sqrt(d)
    if kind == "single":
        return SelfAttention(A, np.eye(d), masked=masked, dtype=dtype)
    if kind == "mha":
        heads = [SelfAttention(A, np.eye(d), masked=masked, dtype=dtype),
                 SelfAttention(A.T, g.standard_normal((d, d)) / d, masked=masked, dtype=dtype)]
        return MultiHeadAttention(heads, torch.as_tensor(g.standard_normal((d, 2 * d)) / (2 * d), dtype=heads[0].dtype))
    return L2SelfAttention(A[:, :2], np.eye(d)[:, :2], masked=masked, dtype=dtype)


def _input(kind, n, d, R, masked, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        X = torch.randn(n, d, generator=g, dtype=f64)
        return R * X / X.norm(dim=1).max()
    if kind == "identical":
        x = torch.randn(d, generator=g, dtype=f64)
        return (R * x / x.norm()).expand(n, d).clone()
    if kind == "one token":
        x = torch.randn(1, d, generator=g, dtype=f64)
        return R * x / x.norm()
    if kind == "large radius":
        return adversarial.large_radius_configuration(np.eye(d), n=n, R=R, masked=masked, dtype=f64)
    if kind == "zero weights":
        X = torch.randn(n, d, generator=g, dtype=f64)
        w = torch.rand(n, generator=g, dtype=f64)
        w[: n // 2] = 0.0   # half the atoms carry no mass (at least one keeps some)
        pos = torch.arange(1, n + 1, dtype=f64) / n if masked else None
        return Measure(R * X / X.norm(dim=1).max(), w / w.sum(), positions=pos)
    if kind == "two dirac":
        return adversarial.two_dirac(np.eye(d), R, positions=masked)
    raise AssertionError(kind)


def _check_outcome(call, method, max_iter, size, mixed, dtype, tol):
    """Run ``call`` and check what it returned or raised; returns the estimate (or None)."""
    eps = torch.finfo(dtype).eps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est = call()
        except ValueError as exc:
            if isinstance(exc, ConvergenceError):
                est = exc.estimate
                assert "stalled" in str(exc) or "did not reach" in str(exc), exc
                assert not est.converged
            else:
                # the ValueErrors allowed: a tolerance below the machine epsilon, or masses whose ratio is
                # beyond the dtype's range (the Lemma C.5 weighting cannot be formed)
                below_eps = tol is not None and tol < eps and "tol" in str(exc) and "epsilon" in str(exc)
                assert below_eps or str(exc).startswith("X: the weights of this measure span"), exc
                return None
        except OverflowError as exc:
            assert "range" in str(exc), exc
            return None
    if not est.converged and not any("local_lipschitz" in str(w.message) for w in caught):
        # on_failure="warn": a non-converged estimate is never returned silently
        assert False, f"non-converged estimate returned without a warning: {est}"
    assert est.applications <= product_budget(method, max_iter, size, mixed), (est.applications, est)
    assert math.isfinite(est.value) and est.value >= 0 and est.error >= 0
    if est.converged:
        assert est.error <= (TOL[dtype] if tol is None else tol) * est.value or est.value == 0
    return est


def _fuzz(dtype, R, tol, method, kind, op_kind, masked, mixed, n, d, seed):
    if kind == "two dirac":
        n = 2
    op = _operator(op_kind, d, masked, dtype)
    X = _input(kind, n, d, R, masked, dtype, seed)
    if isinstance(X, Measure):
        X = X.to(dtype=dtype)
        size = X.points.numel()
    else:
        X = X.to(dtype)
        size = X.numel()
    max_iter = MAX_ITER[method]
    what = f"local_lipschitz({op_kind}, {kind}, R={R}, {dtype}, tol={tol}, {method}, mixed={mixed})"
    with wall_clock(WALL, what):
        est = _check_outcome(
            lambda: local_lipschitz(op, X, method=method, tol=tol, mixed=mixed if method == "lanczos" else None,
                                    on_failure="warn"),
            method, max_iter, size, mixed is not False and dtype == f64, dtype, tol)
    if est is not None and est.converged and isinstance(X, torch.Tensor) and size <= 32 and dtype == f64:
        # the certificate is a true statement: value within error (and rounding) of a singular value
        # (not always the top one: nearly degenerate tops exist at large radii), never above the top
        S = torch.linalg.svdvals(dense_jacobian(op.sequence, X))
        assert est.value <= float(S[0]) * (1 + 1e-9) + 1e-300
        assert float((S - est.value).abs().min()) <= est.error + 1e-9 * float(S[0])


CASES = dict(dtype=st.sampled_from([f32, f64]),
             R=st.sampled_from([0.1, 1.0, 10.0, 30.0, 100.0]),
             tol=st.sampled_from([None, 1e-17, 1e-15, 1e-12, 1e-9, 1e-7, 1e-6, 1e-4, 1e-2]),
             method=st.sampled_from(["lanczos", "lanczos", "power", "dense"]),
             kind=st.sampled_from(["random", "identical", "one token", "large radius", "zero weights", "two dirac"]),
             op_kind=st.sampled_from(["single", "mha", "l2"]),
             masked=st.booleans(), mixed=st.sampled_from([None, True, False]), seed=st.integers(0, 3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**CASES, n=st.integers(1, 8), d=st.integers(2, 4))
def test_every_call_returns_within_its_budget(dtype, R, tol, method, kind, op_kind, masked, mixed, n, d, seed):
    _fuzz(dtype, R, tol, method, kind, op_kind, masked, mixed, n, d, seed)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**CASES, n=st.integers(1, 40), d=st.integers(2, 8))
def test_every_call_returns_within_its_budget_wide(dtype, R, tol, method, kind, op_kind, masked, mixed, n, d, seed):
    _fuzz(dtype, R, tol, method, kind, op_kind, masked, mixed, n, d, seed)


@pytest.mark.parametrize("tol", [1e-17, 1e-15, 1e-13, 1e-10])
@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_reported_reproducers_return(tol, method):
    """The cases that never returned: float64 at tolerances down to 1e-17 on 64 x 8, and float32 at
    the old default tolerance on Proposition 3.7's large-radius configuration."""
    op = SelfAttention(np.eye(8) * 0.3, np.eye(8))
    X = torch.randn(64, 8, generator=torch.Generator().manual_seed(0), dtype=f64)
    with wall_clock(WALL, f"float64 64 x 8 at tol={tol}, {method}"):
        _check_outcome(lambda: local_lipschitz(op, X, tol=tol, method=method, on_failure="warn"), method,
                       MAX_ITER[method], X.numel(), method == "lanczos", f64, tol)
    op32 = SelfAttention(torch.eye(3), torch.eye(3))
    X32 = adversarial.large_radius_configuration(np.eye(3), n=8, R=10.0, dtype=f32)
    with wall_clock(WALL, f"float32 large radius at tol=1e-6, {method}"):
        est = _check_outcome(lambda: local_lipschitz(op32, X32, tol=1e-6, method=method, on_failure="warn"),
                             method, MAX_ITER[method], X32.numel(), False, f32, 1e-6)
    assert est is not None


def test_a_stalled_certificate_names_its_floor():
    """float32 cannot certify 1e-6 on this input: the error says where the certificate stalled, the
    estimate it carries is a true lower bound, and the default float32 tolerance succeeds."""
    op = SelfAttention(torch.eye(3), torch.eye(3))
    X = adversarial.large_radius_configuration(np.eye(3), n=8, R=10.0, dtype=f32)
    with pytest.raises(ConvergenceError, match=r"stalled at relative error .* use tol >= ") as info:
        local_lipschitz(op, X, tol=1e-6)
    est = info.value.estimate
    assert isinstance(est, LipschitzEstimate) and est.stalled and not est.converged
    truth = dense_lipschitz(SelfAttention(np.eye(3), np.eye(3)).sequence, X.double())
    assert est.value <= truth * (1 + 1e-5)
    default = local_lipschitz(op, X)
    assert default.converged and abs(default.value - truth) <= default.error + 1e-5 * truth


def test_tolerance_below_the_machine_epsilon_is_refused_up_front():
    op = SelfAttention(np.eye(3), np.eye(3))
    X = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=f64)
    with pytest.raises(ValueError, match=r"tol: 1e-17 is below what torch.float64 can certify.*2.22e-16"):
        local_lipschitz(op, X, tol=1e-17)
    with pytest.raises(ValueError, match=r"tol: 1e-08 is below what torch.float32 can certify.*1.19e-07"):
        local_lipschitz(op.to(dtype=f32), X.float(), tol=1e-8)


def test_default_tolerance_follows_the_dtype():
    op = SelfAttention(np.eye(3) * 0.7, np.eye(3))
    X = torch.randn(6, 3, generator=torch.Generator().manual_seed(2), dtype=f64)
    e64 = local_lipschitz(op, X)
    e32 = local_lipschitz(op.to(dtype=f32), X.float())
    assert e64.error <= TOL[f64] * e64.value and e32.error <= TOL[f32] * e32.value
    assert TOL[f64] < TOL[f32]


@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hugging_face_layers_return_in_both_dtypes(kind, dtype):
    """Real (tiny, randomly initialized) GPT-2 / BERT attention layers at the default tolerance and at
    ones the dtype cannot reach: an answer or a named failure, within the budget and the wall clock."""
    pytest.importorskip("transformers")
    from meanfield import HFAttention
    from studies import models

    model = models.random_model(kind, size="tiny", seed=1, dtype=dtype)
    op = HFAttention.from_model(model, 0)
    X = torch.randn(12, op.d_in, generator=torch.Generator().manual_seed(0), dtype=dtype)
    for tol in (None, 10 * torch.finfo(dtype).eps, 1e-17):
        with wall_clock(WALL, f"{kind} layer, {dtype}, tol={tol}"):
            est = _check_outcome(lambda tol=tol: local_lipschitz(op, X, tol=tol, on_failure="warn"),
                                 "lanczos", MAX_ITER["lanczos"], X.numel(), dtype == f64, dtype, tol)
        if tol is None:
            assert est is not None and est.converged


def test_a_function_that_is_not_finite_at_x_is_a_floating_point_error():
    """Non-finite outputs at X are an arithmetic failure of that input (FloatingPointError, as the
    operators' own maps report overflowing scores), which the worst-case search rejects and goes on."""
    f = lambda Y: Y / (Y.sum() - Y.sum())   # inf everywhere
    with pytest.raises(FloatingPointError, match="f: produced NaN or infinite outputs at X"):
        local_lipschitz(f, torch.ones(3, 2, dtype=f64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lanczos_in_half_precision_converges_to_the_dense_constant(dtype):
    """float16 / bfloat16 products: Lanczos at the dtype's default tolerance converges to the dense Jacobian's top
    singular value (of the same rounded inputs) within its error. A residual of 1e3 epsilons counted as a Krylov
    breakdown, which in half precision is every step: each restarted from a random direction and the run stalled
    with the value 60% low."""
    g = torch.Generator().manual_seed(6)
    A, V = (torch.randn(3, 3, generator=g) / 3**0.5 for _ in range(2))
    A, V, X = A.to(dtype), V.to(dtype), torch.randn(6, 3, generator=g).to(dtype)
    est = local_lipschitz(SelfAttention(A, V), X)
    truth = dense_lipschitz(SelfAttention(A.double(), V.double()).sequence, X.double())
    assert est.converged and abs(est.value - truth) <= est.error + 4 * torch.finfo(dtype).eps * truth


def test_a_float32_phase_beyond_float32s_range_hands_over_to_float64():
    """mixed precision: a float64 input whose products overflow float32 (V = 1e39 V0) is computed in float64, as
    with mixed=False, instead of failing on the float32 twin's overflow."""
    g = torch.Generator().manual_seed(7)
    X = torch.randn(512, 8, generator=g, dtype=f64)
    A, V = torch.randn(8, 8, generator=g, dtype=f64) / 8, 1e39 * torch.randn(8, 8, generator=g, dtype=f64) / 8**0.5
    op = SelfAttention(A, V)
    plain = local_lipschitz(op, X, mixed=False)
    mixed = local_lipschitz(op, X)
    assert plain.converged and mixed.converged
    assert abs(mixed.value - plain.value) <= mixed.error + plain.error


def test_power_iteration_stopped_by_close_singular_values_says_so():
    """Power iteration stops when its certified error gains nothing for PATIENCE iterations. Far above any
    rounding floor that means close top singular values (slow, not limited by rounding): the error says so and
    points to lanczos, which certifies the same input."""
    V = torch.diag(torch.tensor([1.0, 1.0 - 1e-4, 0.5], dtype=f64))
    X = torch.randn(6, 3, generator=torch.Generator().manual_seed(8), dtype=f64)
    op = SelfAttention(torch.zeros(3, 3, dtype=f64), V)
    with pytest.raises(ConvergenceError, match="close") as info:
        local_lipschitz(op, X, method="power", max_iter=400)
    assert "rounding" not in str(info.value).split("far above")[0]
    truth = dense_lipschitz(op.sequence, X)
    est = local_lipschitz(op, X)
    assert est.converged and abs(est.value - truth) <= est.error + 1e-12


def test_power_iteration_stalled_below_the_rounding_threshold_still_names_close_singular_values():
    """Below sqrt(ROUNDING_FLOOR eps) a power stall can still be slow convergence on close singular values (an L2
    layer at R = 10 stalls at 2.5e-7 after 64 of 5000 iterations, where Lanczos certifies 5e-14 on the same
    input): the message names both causes and lanczos, and no longer blames rounding alone."""
    rng = np.random.default_rng(26)
    op = L2SelfAttention(rng.standard_normal((2, 8, 4)), rng.standard_normal((2, 8, 4)))
    X = torch.tensor(rng.standard_normal((32, 8)))
    X = 10.0 * X / X.norm(dim=1, keepdim=True)
    with pytest.raises(ConvergenceError, match="close") as info:
        local_lipschitz(op, X, method="power", tol=1e-12)
    rel = info.value.estimate.error / info.value.estimate.value
    assert rel < math.sqrt(1e4 * torch.finfo(f64).eps) and "lanczos" in str(info.value)
    lz = local_lipschitz(op, X, tol=1e-12)
    assert lz.converged and lz.error / lz.value < rel / 100
