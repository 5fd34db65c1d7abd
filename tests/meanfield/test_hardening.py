"""Hostile inputs to the public API of particles and meanfield: a test per known reproducer, then a
property-based campaign. Every call either returns a correct, finite value, or raises a ValueError /
TypeError that names the argument (or a documented ArithmeticError: FloatingPointError when
arithmetic leaves the dtype's range, OverflowError from the Lipschitz estimators); never a hang, a
silent NaN, or an error from inside torch."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meanfield import L2SelfAttention, MultiHeadAttention, SelfAttention, adversarial, bounds, local_lipschitz, simulate
from meanfield.kernels import attend
from particles import Measure
from tests.reference import prop34_lower, thm33_upper

pytestmark = pytest.mark.usefixtures("one_thread")
f64 = torch.float64
A3 = np.diag([1.0, 0.3, -0.1])


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


# ---------------------------------------------------------------------- reproducers
def test_integer_dtypes_are_refused():
    with pytest.raises(TypeError, match="dtype: expected a floating dtype"):
        SelfAttention(0.5 * np.eye(3), np.eye(3), dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype: expected a floating dtype"):
        L2SelfAttention(np.ones((3, 2)), np.ones((3, 2)), dtype="int64")
    with pytest.raises(TypeError, match="dtype"):
        SelfAttention.from_qkv(np.eye(2, 3), np.eye(2, 3), np.eye(3), dtype=torch.int32)


def test_options_that_do_not_apply_are_errors():
    op = SelfAttention(np.eye(3), np.eye(3))
    mu = Measure(rand(4, 3))
    for name, kw in (("rtol", {"rtol": -1}), ("rtol", {"rtol": 1e-6}), ("atol", {"atol": 1e-6}),
                     ("options", {"options": {"first_step": 0.1}})):
        with pytest.raises(ValueError, match=name):
            simulate(op, mu, 1.0, method="rk4", **kw)
    with pytest.raises(ValueError, match="rtol"):
        simulate(op, mu, 1.0, method="dopri5", rtol=-1)
    with pytest.raises(ValueError, match=r"options: \['steps'\] only for the fixed-step methods"):
        simulate(op, mu, 1.0, method="dopri5", options={"steps": 3})


def test_simulate_blow_up_is_a_floating_point_error_with_the_time():
    X = rand(6, 3, seed=1)
    op = SelfAttention(50 * np.eye(3), 50 * np.eye(3))
    with pytest.raises(FloatingPointError, match=r"at t = "):
        simulate(op, Measure(10 * X), 1000.0, method="euler", options={"steps": 100})


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="tol"):
        bounds.gamma_info(np.eye(3), tol=float("nan"))
    with pytest.raises(ValueError, match="X: an empty sequence"):
        SelfAttention(np.eye(3), np.eye(3)).sequence(np.zeros((0, 3)))
    with pytest.raises(ValueError, match="q, k"):
        attend(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="v: expected one value per key"):
        attend(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="log_weights"):
        attend(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
    op = SelfAttention(np.eye(3), np.eye(3))
    with pytest.raises(TypeError, match="seed"):
        local_lipschitz(op, rand(4, 3), seed="abc")
    with pytest.raises(TypeError, match="tol"):
        local_lipschitz(op, rand(4, 3), tol="abc")


def test_numpy_scalars_are_accepted():
    op = SelfAttention(np.eye(3), np.eye(3))
    X = rand(5, 3, seed=2)
    a = local_lipschitz(op, X, tol=np.float32(1e-6), max_iter=np.int64(50), seed=np.int64(0))
    b = local_lipschitz(op, X, tol=1e-6, max_iter=50, seed=0)
    assert a.value == b.value
    assert bounds.sqrt_n_upper(A3, np.eye(3), np.float32(2.0), np.int64(8)) == pytest.approx(
        thm33_upper(A3, np.eye(3), 2.0, 8), rel=1e-12)


def test_bounds_with_lengths_beyond_the_float_range():
    # sqrt(n - 1) / (1 + (n - 1) e^{-2 gamma R^2}) ~ e^{2 gamma R^2} / sqrt(n - 1) for huge n; gamma = 1/8 here
    assert bounds.sqrt_n_lower(A3, 1.0, 10**400) == pytest.approx(math.exp(0.25) * 1e-200, rel=1e-12)
    assert bounds.sqrt_n_lower(A3, 1.0, 10**6) == pytest.approx(prop34_lower(1 / 8, 1.0, 10**6), rel=1e-12)
    # Theorem 3.3's bound ~ sqrt(3) ||V|| (4 ||A||^2 R^4 + 1)^(1/2) sqrt(n) for huge n (||A|| = 1, R = 2)
    assert bounds.sqrt_n_upper(A3, np.eye(3), 2.0, 10**400) == pytest.approx(math.sqrt(3 * 65) * 1e200, rel=1e-9)
    with pytest.warns(bounds.BoundOverflowWarning, match="sqrt_n_upper"):
        assert math.isinf(bounds.sqrt_n_upper(A3, np.eye(3), 2.0, 10**700))   # the number itself exceeds float64


# ---------------------------------------------------------------------- the campaign
BAD_MATRICES = st.sampled_from([
    "nan", "inf", "bool", "str", "none", "complex", "1d", "3d", "empty", "wrong", "objects", "huge",
])


def _bad(kind, shape=(3, 3)):
    return {
        "nan": np.full(shape, np.nan), "inf": np.full(shape, np.inf), "bool": np.ones(shape, dtype=bool),
        "str": "abc", "none": None, "complex": np.ones(shape) * 1j, "1d": np.ones(3), "3d": np.ones((2, 3, 3)),
        "empty": np.zeros((0, 3)), "wrong": np.ones((2, 5)), "objects": np.array([object()] * 3, dtype=object),
        "huge": np.full(shape, 1e308),
    }[kind]


def _clean(fn):
    """fn() either returns finite numbers or raises a clean error; returns the error (or None). The only
    warnings allowed are the estimators' own report of a missed tolerance (on_failure="warn")."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
        for w in caught:
            assert issubclass(w.category, RuntimeWarning) and str(w.message).startswith("local_lipschitz"), w
    except (ValueError, TypeError, ArithmeticError) as exc:
        assert type(exc).__module__ in ("builtins", "particles.validation", "meanfield.lipschitz") or \
            isinstance(exc, (ValueError, TypeError, ArithmeticError))
        # the error comes from the framework, not from deep inside torch/numpy
        tb = exc.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        origin = tb.tb_frame.f_code.co_filename
        assert "/torch/" not in origin and "/numpy/" not in origin and "/ot/" not in origin, (exc, origin)
        return exc
    leaves = out if isinstance(out, (tuple, list)) else [out]
    for v in leaves:
        if isinstance(v, torch.Tensor):
            assert bool(torch.isfinite(v).all())
        elif isinstance(v, float):
            assert not math.isnan(v)
        elif isinstance(v, Measure):
            assert bool(torch.isfinite(v.points).all())
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=BAD_MATRICES, which=st.sampled_from(["A", "V"]))
@pytest.mark.timeout(120)
def test_operators_refuse_bad_parameters(kind, which):
    args = {"A": np.eye(3), "V": np.eye(3)}
    args[which] = _bad(kind)
    err = _clean(lambda: SelfAttention(args["A"], args["V"]).sequence(rand(4, 3)))
    if kind != "huge":   # a huge matrix is a valid parameter; its overflow is an ArithmeticError
        assert err is not None and which in str(err), err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=BAD_MATRICES)
@pytest.mark.timeout(120)
def test_measures_refuse_bad_points(kind):
    err = _clean(lambda: Measure(_bad(kind, (4, 3))))
    if kind not in ("huge", "wrong", "1d"):
        assert err is not None and "points" in str(err), err


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tol=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.booleans(),
                     st.integers(-5, 5), st.none()),
       max_iter=st.one_of(st.integers(-3, 40), st.floats(allow_nan=True), st.text(max_size=2), st.none()),
       method=st.sampled_from(["lanczos", "power", "dense", "arnoldi", 3]))
@pytest.mark.timeout(120)
def test_local_lipschitz_options(tol, max_iter, method):
    op = SelfAttention(A3, np.eye(3))
    X = rand(5, 3, seed=3)
    err = _clean(lambda: local_lipschitz(op, X, method=method, tol=tol, max_iter=max_iter, on_failure="warn"))
    if err is not None:
        assert any(name in str(err) for name in ("tol", "max_iter", "method")), err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(R=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2), st.booleans()),
       n=st.one_of(st.integers(-3, 10**30), st.floats(allow_nan=True), st.text(max_size=2), st.booleans()))
@pytest.mark.timeout(120)
def test_bounds_and_witnesses_on_arbitrary_radii_and_lengths(R, n):
    for fn in (lambda: bounds.sqrt_n_lower(A3, R, n), lambda: bounds.sqrt_n_upper(A3, np.eye(3), R, n),
               lambda: bounds.mean_field_upper(A3, np.eye(3), R, log=True)):
        err = _clean(fn)
        if err is not None:
            assert any(name in str(err) for name in ("R", "n")), err
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 64:
        err = _clean(lambda: adversarial.sqrt_n_sequence(A3, R, n))
        if err is None:
            X = adversarial.sqrt_n_sequence(A3, R, n)
            assert float(X.norm(dim=1).max()) <= float(R) * (1 + 1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scale=st.sampled_from([1e-300, 1e-30, 1.0, 1e3, 1e30, 1e150, 1e300]),
       masked=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]))
@pytest.mark.timeout(120)
def test_operators_at_every_magnitude(scale, masked, dtype):
    """Tokens of any magnitude: a finite output or a FloatingPointError, never NaN."""
    heads = [SelfAttention(np.eye(3), np.eye(3), masked=masked, dtype=dtype) for _ in range(2)]
    ops = [heads[0], MultiHeadAttention(heads, torch.ones(3, 6, dtype=dtype) / 6),
           L2SelfAttention(np.eye(3)[:, :2], np.eye(3)[:, :2], masked=masked, dtype=dtype)]
    X = (rand(5, 3, seed=4) * scale).to(dtype)
    for op in ops:
        if not bool(torch.isfinite(X).all()):
            continue
        _clean(lambda op=op: op.sequence(X))
        mu = Measure.sequence(X) if masked else Measure(X)
        _clean(lambda op=op, mu=mu: op(mu))
        if scale <= 1e3:
            _clean(lambda op=op: local_lipschitz(op, X, on_failure="warn"))
