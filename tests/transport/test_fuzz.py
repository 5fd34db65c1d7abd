"""Fuzzing transport's public API with malformed and extreme inputs (hypothesis).

Property of every call of ``w2``, ``solve``, ``conditional_w2`` and ``symmetric_potential``: it either
returns a correct value, or raises a ValueError or TypeError whose message names the argument at
fault (an OverflowError only for W2^2 beyond the float range, naming ``squared``), raised by the
framework's own code, never from inside torch, POT or numpy. Never NaN, never a hang: each test runs
under a timeout, and max_iter stays small.

"Correct" is checked against independent truths: exact values against the transport LP (scipy, after
dividing the clouds by a power of two: W2 is 1-homogeneous), sequences' conditional W2 against
||X - Y|| / sqrt(n), entropic plan costs against the bound <pi_eps, C> >= W2^2.
"""

from __future__ import annotations

import inspect
import math
import os
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from particles import Measure
from particles.validation import ConvergenceError, MemoryLimitError
from tests.reference import w2_lp
from transport import TransportResult, conditional_w2, solve, symmetric_potential, w2

# method="thread": a hang inside a C call (or a hang that hypothesis would re-run while shrinking) still ends
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(180, method="thread")]

#: examples per fuzz test; a longer campaign: TRANSPORT_FUZZ_EXAMPLES=2000 python -m pytest tests/transport/test_fuzz.py
FUZZ = settings(max_examples=int(os.environ.get("TRANSPORT_FUZZ_EXAMPLES", "100")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

SCALES = {torch.float64: [1.0, 1e-3, 1e3, 1e-150, 1e150, 1e-300, 1e300],
          torch.float32: [1.0, 1e-3, 1e3, 1e-15, 1e15, 1e30]}


# ---------------------------------------------------------------- strategies
@st.composite
def clouds(draw, n=None, d=None, dtype=None, positions=False):
    """(points, weights, positions) of a valid measure: any size, scale and dtype, zero weights allowed."""
    n = n or draw(st.integers(1, 5))
    d = d or draw(st.integers(1, 3))
    dtype = dtype or draw(st.sampled_from([torch.float64, torch.float32]))
    scale = draw(st.sampled_from(SCALES[dtype]))
    base = np.array(draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=n * d, max_size=n * d)))
    pts = torch.tensor(base.reshape(n, d) * scale, dtype=dtype)
    w = np.array(draw(st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0]), min_size=n, max_size=n)))
    w[draw(st.integers(0, n - 1))] = 1.0  # at least one atom of positive mass
    pos = None
    if positions:
        pos = np.array(draw(st.lists(st.sampled_from([0.25, 0.5, 1.0]), min_size=n, max_size=n)))
    return pts, w / w.sum(), pos


def as_measure(cloud):
    pts, w, pos = cloud
    return Measure(pts, torch.as_tensor(w, dtype=pts.dtype), None if pos is None else torch.as_tensor(pos))


JUNK = [math.nan, math.inf, -math.inf, -1.0, 0, True, "abc", "0.1", [0.1], None, torch.tensor(0.5),
        np.float32(1e-6), np.int64(50), 1e308, 5e-324, 10 ** 400, object()]

OPTIONS = {
    "reg": [0.05, 1.0, 100.0, np.float32(0.5), 1e-300, 1e300],
    "debias": [True, False, np.bool_(True), 1, "yes"],
    "tol": [1e-3, 1e-9, np.float32(1e-6)],
    "max_iter": [1, 5, 200, np.int64(50), 2.0],
    "scaling": [0, 0.5, 0.9, np.float64(0.5), 1.0],
    "chunk_elements": [1, 7, 2 ** 18, np.int32(100), 10 ** 13],
    "squared": [True, False, np.bool_(False), "yes", 0],
    "return_plan": [True, False],
    "on_failure": ["raise", "warn", "ignore", None],
    "memory_limit": [None, "1K", "1G", 10 ** 9, "lots", -5, True],
    "foo": [1],
}


@st.composite
def options(draw, allowed):
    out = {}
    for name in allowed:
        if draw(st.integers(0, 3)) == 0:
            # max_iter = 10**400 is a valid request for a computation without end (an unreachable tol then
            # iterates for ever, as asked): the fuzz keeps max_iter small so that no example is a hang by request
            junk = [j for j in JUNK if not (name == "max_iter" and isinstance(j, int) and j > 10 ** 6)]
            out[name] = draw(st.sampled_from(OPTIONS[name] + junk)) if draw(st.booleans()) \
                else draw(st.sampled_from(OPTIONS[name]))
    return out


@st.composite
def pairs(draw, positions=False):
    """Two measures, usually compatible; sometimes mismatched in dimension or dtype, or not measures."""
    a = draw(clouds(positions=positions))
    kind = draw(st.sampled_from(["same"] * 6 + ["dim", "dtype", "object"]))
    if kind == "object":
        return as_measure(a), draw(st.sampled_from([None, a[0], a[0].numpy(), "mu", 3.0, [[0.0]]]))
    d = a[0].shape[1] + (1 if kind == "dim" else 0)
    dtype = a[0].dtype
    if kind == "dtype":
        dtype = torch.float32 if dtype == torch.float64 else torch.float64
    b = draw(clouds(d=d, dtype=dtype, positions=positions))
    return as_measure(a), as_measure(b)


# ---------------------------------------------------------------- the property
def _params(fn):
    return set(inspect.signature(fn).parameters)


def call(fn, *args, **kwargs):
    """Run ``fn``; return its output, or None after checking the exception against the property."""
    try:
        return fn(*args, **kwargs)
    except (TypeError, ValueError, OverflowError) as exc:
        msg = str(exc)
        frames = [f for f in inspect.getinnerframes(exc.__traceback__)]
        origin = frames[-1].filename
        assert "site-packages" not in origin and "/torch/" not in origin, f"raised inside a library: {origin}: {msg}"
        head = msg.split(":", 1)[0]
        if isinstance(exc, OverflowError):
            assert head == "squared", msg
        elif isinstance(exc, ConvergenceError):
            assert "did not converge" in msg and "max_iter" in msg, msg
        elif isinstance(exc, MemoryLimitError):
            assert "memory_limit" in msg, msg
        elif (m := re.search(r"unexpected keyword argument '(\w+)'", msg)):
            assert m.group(1) in kwargs, msg
        else:
            assert head in _params(fn), f"the error does not name an argument of {fn.__name__}: {msg}"
        return None


def _exact_truth(mu, nu):
    """W2 by the transport LP on the clouds divided by a power of two (W2 is 1-homogeneous)."""
    big = max(float(mu.points.abs().max()), float(nu.points.abs().max()), 1e-300)
    k = math.frexp(big)[1]
    X, Y = mu.points.double() * 2.0 ** -k, nu.points.double() * 2.0 ** -k
    return math.ldexp(w2_lp(X, mu.weights.double(), Y, nu.weights.double()), k)


def _check_value(mu, nu, method, kwargs, value, squared):
    assert isinstance(value, float) and math.isfinite(value) and value >= 0, value
    if method in ("exact", "auto") and kwargs.get("memory_limit") is None:
        truth = _exact_truth(mu, nu)
        got = math.sqrt(value) if squared else value
        rel = 1e-4 if mu.dtype == torch.float32 else 1e-7
        # sqrt amplifies the rounding of W2^2 near 0: compare within a hair of the clouds' size too
        size = max(float(mu.points.abs().max()), float(nu.points.abs().max()))
        assert got == pytest.approx(truth, rel=rel, abs=size * (3e-3 if mu.dtype == torch.float32 else 1e-7))


@FUZZ
@given(st.data())
def test_w2_fuzz(data):
    mu, nu = data.draw(pairs())
    method = data.draw(st.sampled_from(["exact", "sinkhorn", "streaming", "auto", "emd", None, 3]))
    kwargs = data.draw(options(list(OPTIONS)))
    if method in ("sinkhorn", "streaming") and data.draw(st.booleans()):
        kwargs.setdefault("reg", 1.0)
    kwargs.setdefault("on_failure", "warn")
    if method in ("sinkhorn", "streaming", "auto"):
        kwargs.setdefault("max_iter", 300)
    with _quiet():
        out = call(w2, mu, nu, method, **kwargs)
    if out is None:
        return
    if kwargs.get("return_plan") is True:
        out, plan = out
        assert plan is None or bool(torch.isfinite(plan).all())
    _check_value(mu, nu, method, kwargs, out, kwargs.get("squared") in (True, np.bool_(True)))


@FUZZ
@given(st.data())
def test_solve_fuzz(data):
    mu, nu = data.draw(pairs())
    method = data.draw(st.sampled_from(["exact", "sinkhorn", "streaming", "auto"]))
    kwargs = data.draw(options([k for k in OPTIONS if k != "squared"]))
    if method in ("sinkhorn", "streaming"):
        kwargs.setdefault("reg", data.draw(st.sampled_from([0.1, 1.0, 10.0])))
    kwargs.setdefault("on_failure", "warn")
    if method != "exact":
        kwargs.setdefault("max_iter", 300)
    with _quiet():
        res = call(solve, mu, nu, method, **kwargs)
    if res is None:
        return
    assert isinstance(res, TransportResult) and res.method in ("exact", "sinkhorn", "streaming")
    _check_value(mu, nu, res.method, kwargs, res.value, False)
    assert math.isnan(res.error) is False and (res.converged or res.error > res.tol)
    if res.potentials is not None:
        assert all(bool(torch.isfinite(p).all()) for p in res.potentials)
    if res.method != "exact" and res.converged and not res.debias:
        # <pi_eps, C> is the cost of a coupling (up to its marginal error): not below W2^2
        truth = _exact_truth(mu, nu)
        size = max(float(mu.points.abs().max()), float(nu.points.abs().max()))
        slack = (1e-3 if mu.dtype == torch.float32 else 1e-6) * truth ** 2 + 4 * res.tol * (2 * size) ** 2 * mu.dim
        if math.isfinite(res.value_squared):
            assert res.value_squared >= truth ** 2 - slack


@FUZZ
@given(st.data())
def test_conditional_w2_fuzz(data):
    kind = data.draw(st.sampled_from(["sequences", "random", "unmasked"]))
    if kind == "sequences":
        n = data.draw(st.integers(1, 5))
        a = data.draw(clouds(n=n))
        b = data.draw(clouds(n=n, d=a[0].shape[1], dtype=a[0].dtype))
        mu, nu = Measure.sequence(a[0]), Measure.sequence(b[0])
    else:
        mu, nu = data.draw(pairs(positions=kind == "random"))
    kwargs = data.draw(options(["squared", "return_plan", "memory_limit", "foo"]))
    for name in ("atol", "mass_atol"):
        if data.draw(st.integers(0, 3)) == 0:
            kwargs[name] = data.draw(st.sampled_from([0.0, 1e-9, 0.3, np.float32(1e-6)] + JUNK))
    out = call(conditional_w2, mu, nu, **kwargs)
    if out is None:
        return
    if kwargs.get("return_plan") is True:
        out, _ = out
    assert isinstance(out, float) and not math.isnan(out) and out >= 0
    separate = kwargs.get("atol", 0.0) < 1.0 / mu.n  # else positions i/n merge into fewer slices
    if kind == "sequences" and separate and math.isfinite(out) and kwargs.get("squared") is not True:
        X, Y = mu.points.double(), nu.points.double()
        big = max(float(X.abs().max()), float(Y.abs().max()), 1e-300)
        k = math.frexp(big)[1]
        truth = math.ldexp(float((X * 2.0 ** -k - Y * 2.0 ** -k).norm()) / math.sqrt(mu.n), k)
        rel = 1e-5 if mu.dtype == torch.float32 else 1e-12
        assert out == pytest.approx(truth, rel=rel, abs=big * rel)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_symmetric_potential_fuzz(data):
    mu = as_measure(data.draw(clouds()))
    reg = data.draw(st.sampled_from([0.1, 1.0, 1e-300, 1e300] + JUNK))
    kwargs = data.draw(options(["tol", "max_iter", "scaling", "chunk_elements", "memory_limit", "foo"]))
    kwargs["on_failure"] = "warn"
    with _quiet():
        out = call(symmetric_potential, mu, reg, **kwargs)
    if out is not None:
        f, err, it = out
        assert f.shape == (mu.n,) and bool(torch.isfinite(f).all()) and not math.isnan(err) and it >= 0


class _quiet:
    """Non-convergence warnings are expected (on_failure="warn"), w2's deprecated return_plan spelling warns by
    design (tests/transport/test_exact.py asserts it), and so does a Sinkhorn divergence within 100 roundings of its
    terms (a pair of equal or nearly equal clouds, which the fuzz draws: tests/transport/test_entropic.py asserts
    that warning); any other warning surfaces."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.filterwarnings("ignore", message=".*did not converge", category=RuntimeWarning)
        warnings.filterwarnings("ignore", message=r"w2\(\.\.\., return_plan=True\)", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*the Sinkhorn divergence .* is below 100 roundings",
                                category=RuntimeWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
