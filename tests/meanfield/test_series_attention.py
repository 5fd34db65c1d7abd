"""The series engine (meanfield/series_attention.py) against independent truths: the exact exponential tail in
exact rational arithmetic, the multinomial identity in closed form, float64 dense attention written out here, and
autograd of the dense formula; then auto's choice of it."""

from __future__ import annotations

import functools
import itertools
import math
from fractions import Fraction

import pytest
import torch

from meanfield import IsotropicAttention, kernels, simulate
from meanfield import series_attention as series
from meanfield.kernels import attend, record_paths
from particles import Measure

DT = torch.float64


def truth(q, k, v, lw=None):
    """softmax(q k^T + log a) v in float64, written out (rows of zero weights: 0, as attention_probs)."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2)
    if lw is not None:
        s = s + lw.double().unsqueeze(-2)
    top = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(top), top, 0))
    z = e.sum(dim=-1, keepdim=True)
    return torch.where(z > 0, (e @ v) / torch.where(z > 0, z, 1), 0)


def sphere(n, e, seed, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, e, generator=g, dtype=DT)
    return (x / x.norm(dim=1, keepdim=True)).to(dtype)


def exact_tail(r: Fraction, K: int, terms: int = 200) -> Fraction:
    """sum_{p > K} r^p / p! in rational arithmetic (the terms left out are below 1e-300 for r <= 3)."""
    total, term = Fraction(0), Fraction(1)
    for p in range(1, K + terms):
        term = term * r / p
        if p > K:
            total += term
    return total


@pytest.mark.parametrize("r", [0.1, 0.5, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("K", [0, 1, 3, 8, 15, 25])
def test_tail_bound_is_above_the_exact_tail_and_within_a_factor_two(r, K):
    exact = float(exact_tail(Fraction(r), K))
    bound = series.tail_bound(r, K)
    assert bound >= exact * (1 - 1e-12)
    if r < (K + 2) / 2:   # the geometric factor 1 / (1 - r / (K + 2)) is at most 2 there
        assert bound <= 2 * exact * (1 + 1e-12)


def test_tail_bound_edges():
    assert series.tail_bound(0.0, 0) == 0.0 and series.error_bound(0.0, 0) == 0.0
    assert series.tail_bound(5.0, 3) == math.inf and series.error_bound(5.0, 3) == math.inf
    with pytest.raises(ValueError, match="r:"):
        series.tail_bound(-1.0, 3)


@pytest.mark.parametrize("e", [1, 2, 3, 4])
@pytest.mark.parametrize("K", [0, 1, 2, 5, 9])
def test_features_reproduce_the_truncated_exponential(e, K):
    g = torch.Generator().manual_seed(10 * e + K)
    x, y = torch.randn(7, e, generator=g, dtype=DT), torch.randn(7, e, generator=g, dtype=DT)
    phi_x, phi_y = series.features(x, K), series.features(y, K)
    assert phi_x.shape == (7, series.feature_count(e, K)) == (7, math.comb(K + e, e))
    s = (x * y).sum(dim=1)
    closed = sum(s**p / math.factorial(p) for p in range(K + 1))
    torch.testing.assert_close((phi_x * phi_y).sum(dim=1), closed, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("e", [1, 2, 3, 5])
def test_exponents_are_every_monomial_of_degree_at_most_k_once(e):
    K = 6
    got = series._exponents(e, K)
    want = {a for a in itertools.product(range(K + 1), repeat=e) if sum(a) <= K}
    assert len(got) == len(set(got)) == len(want) == series.feature_count(e, K)
    assert set(got) == want
    # the features are these monomials, in this order
    y = torch.tensor([[1.3, -0.7, 0.4, 2.1, -1.1][:e]], dtype=DT)
    powers = series._powers(y, K)[..., 0]
    direct = torch.tensor([math.prod(float(y[0, i]) ** a[i] for i in range(e)) for a in got], dtype=DT)
    torch.testing.assert_close(powers, direct, rtol=1e-14, atol=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("K", [0, 2, 5, 9, 14])
def test_error_is_within_the_proved_bound_at_every_degree(seed, K):
    g = torch.Generator().manual_seed(seed)
    n, e = 40, 3
    beta = [0.3, 1.0, 1.5, 2.0][seed]
    x = sphere(n, e, seed)
    q, k = beta * x, x + 0.2 * torch.randn(n, e, generator=g, dtype=DT)
    v = torch.randn(n, 2, generator=g, dtype=DT)
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0)
    lw[::5] = -math.inf
    r = series._radius(q, k, lw)[0]
    # r as the module defines it, checked from its definition: max |q| max |k_j - c| over the keys of positive weight
    live = lw != -math.inf
    lo, hi = k[live].amin(0), k[live].amax(0)
    assert r == pytest.approx(float(q.norm(dim=1).max() * (k[live] - (lo + hi) / 2).norm(dim=1).max()), rel=1e-14)
    out = series.series_attend(q, k, v, lw, degree=K)
    err = float((out - truth(q, k, v, lw)).norm(dim=-1).max() / v.norm(dim=-1).max())
    bound = series.error_bound(r, K)
    assert err <= bound + 1e-13, (err, bound)
    if 1e-6 < bound < 1:
        # not vacuous: the series does truncate (a wrong degree, or the exact exponential, would be far below)
        assert err > bound * 1e-5, (err, bound)


def test_plan_picks_the_smallest_degree_that_meets_tol():
    x = sphere(50, 3, 0)
    for tol in (1e-3, 1e-8, 1e-15):
        p = series.plan(x, x, tol=tol)
        assert p.bound <= tol < series.error_bound(p.radius, p.degree - 1)
        assert p.features == math.comb(p.degree + 3, 3)
    assert series.plan(5.0 * x, x) is None   # r = 5 > MAX_RADIUS
    assert series.plan(x, x, max_features=100) is None
    with pytest.raises(ValueError, match="tol"):
        series.plan(x, x, tol=0.0)


@pytest.mark.parametrize("e", [1, 2, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_series_matches_float64_attention_at_the_machine_epsilon(e, weighted):
    n = 300
    x = sphere(n, e, e)
    g = torch.Generator().manual_seed(e)
    v = torch.randn(n, 3, generator=g, dtype=DT)
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0) if weighted else None
    out = attend(1.3 * x, x, v, lw, method="series")
    assert float((out - truth(1.3 * x, x, v, lw)).abs().max()) < 1e-14 * float(v.abs().max()) * 10


def test_batches_broadcast_and_keys_of_zero_weight_far_away_change_nothing():
    g = torch.Generator().manual_seed(3)
    q = 0.8 * torch.stack([sphere(20, 3, 1), sphere(20, 3, 2)])         # (2, 20, 3)
    k = sphere(30, 3, 3)                                                  # shared
    v = torch.randn(2, 30, 2, generator=g, dtype=DT)
    lw = torch.log_softmax(torch.randn(2, 30, generator=g, dtype=DT), -1)
    lw[1, 4] = -math.inf
    k_far = k.clone().expand(2, 30, 3).clone()
    k_far[1, 4] = 1e6     # a key of zero weight: far outside the others, left out of r, its features never formed
    out = series.series_attend(q, k_far, v, lw)
    torch.testing.assert_close(out, truth(q, k.expand(2, 30, 3), v, lw), rtol=0, atol=1e-14)
    assert series._radius(q, k_far, lw)[0] < 2


def test_rows_of_zero_weights_are_zero_as_attention_probs():
    x = sphere(10, 3, 0)
    v = torch.randn(10, 2, dtype=DT)
    lw = torch.full((10,), -math.inf, dtype=DT)
    out = series.series_attend(x, x, v, lw)
    torch.testing.assert_close(out, kernels.attention_probs(x, x, lw) @ v)
    assert bool((out == 0).all())


def test_degenerate_radius_zero_is_the_weighted_mean():
    k = torch.ones(6, 3, dtype=DT)
    q = sphere(4, 3, 0)
    v = torch.randn(6, 2, dtype=DT)
    lw = torch.log_softmax(torch.randn(6, dtype=DT), 0)
    p = series.plan(q, k, lw)
    assert p.degree == 0 and p.radius == 0.0
    torch.testing.assert_close(series.series_attend(q, k, v, lw), (lw.exp() @ v).expand(4, 2), rtol=1e-14, atol=0)
    torch.testing.assert_close(series.series_attend(torch.zeros(4, 3, dtype=DT), sphere(6, 3, 1), v),
                               v.mean(0).expand(4, 2), rtol=1e-14, atol=1e-15)


def test_float32_and_float16_are_as_accurate_as_their_dense_kernel():
    x64 = sphere(2000, 3, 5)
    ref = truth(x64, x64, x64)
    x = x64.float()
    s32 = (attend(x, x, x, method="series").double() - ref).abs().max()
    d32 = (attend(x, x, x, method="dense").double() - ref).abs().max()
    assert float(s32) <= 4 * float(d32) + 1e-7
    h = x64.half()
    s16 = attend(h, h, h, method="series")
    assert s16.dtype == torch.float16
    assert float((s16.double() - ref).abs().max()) < 2e-3


def test_derivatives_are_those_of_the_dense_map():
    x = sphere(25, 3, 7).requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(25, 3, generator=g, dtype=DT)

    def f(method):
        def run(y):
            return attend(1.2 * y, y, y, method=method)
        return run

    (gs,) = torch.autograd.grad((f("series")(x) * w).sum(), x)
    (gd,) = torch.autograd.grad((f("dense")(x) * w).sum(), x)
    torch.testing.assert_close(gs, gd, rtol=0, atol=1e-13)
    u = torch.randn(25, 3, generator=g, dtype=DT)
    ts = torch.func.jvp(f("series"), (x.detach(),), (u,))[1]
    td = torch.func.jvp(f("dense"), (x.detach(),), (u,))[1]
    torch.testing.assert_close(ts, td, rtol=0, atol=1e-13)


def test_bad_inputs_name_their_argument():
    x = sphere(8, 3, 0)
    bad = x.clone()
    bad[2, 1] = math.nan
    with pytest.raises(FloatingPointError, match="q:"):
        attend(bad, x, x, method="series")
    with pytest.raises(FloatingPointError, match="k:"):
        attend(x, bad, x, method="series")
    with pytest.raises(FloatingPointError, match="v:"):
        attend(x, x, bad, method="series")
    with pytest.raises(ValueError, match="method: 'series' takes no positions"):
        attend(x, x, x, None, torch.arange(8.0, dtype=DT), torch.arange(8.0, dtype=DT), method="series")
    with pytest.raises(ValueError, match="series: no degree"):
        attend(10 * x, x, x, method="series")
    with pytest.raises(ValueError, match="degree:"):
        series.series_attend(x, x, x, degree=-1)
    assert attend(x[:0], x, x, method="series").shape == (0, 3)


@pytest.fixture
def low_threshold(monkeypatch):
    """Small calls take the series: its threshold and cost model set aside (at N = 400 the dense pass is cheaper)."""
    monkeypatch.setattr(kernels, "SERIES_THRESHOLD", 2**12)
    monkeypatch.setattr(series, "COST_RATIO", 100.0)


def test_auto_takes_the_series_for_large_forward_passes_of_bounded_scores(low_threshold):
    x = sphere(400, 3, 0)
    with record_paths() as paths:
        out = attend(x, x, x)
    assert paths == ["series"] and kernels.choose(x, x, x) == "series"
    torch.testing.assert_close(out, truth(x, x, x), rtol=0, atol=1e-14)
    lw = torch.log_softmax(torch.randn(400, dtype=DT), 0)
    assert kernels.choose(x, x, x, lw) == "series"


def test_auto_leaves_the_series_where_it_does_not_apply(low_threshold):
    x = sphere(400, 3, 0)
    pos = torch.arange(400.0, dtype=DT)
    assert kernels.choose(x, x, x, None, pos, pos) != "series"             # positions
    assert kernels.choose(8 * x, x, x) != "series"                          # r = 8: beyond MAX_RADIUS
    assert kernels.choose(x[:50], x[:50], x[:50]) != "series"              # below the threshold
    wide = torch.randn(400, 16, dtype=DT) / 4
    assert kernels.choose(wide, wide, wide) != "series"                     # a wide head
    y = x.clone().requires_grad_(True)
    with record_paths() as paths:
        attend(y, y, y)
    assert "series" not in paths                                            # derivatives
    with kernels.use(threshold=10**6):
        assert kernels.choose(x, x, x) != "series"                          # use(threshold=) keeps it dense


def test_auto_uses_the_cost_model(low_threshold, monkeypatch):
    x = sphere(400, 3, 0)
    monkeypatch.setattr(series, "COST_RATIO", 1e-3)
    assert kernels.choose(x, x, x) != "series"


def test_simulate_on_the_sphere_takes_the_series_and_matches_the_dense_flow(low_threshold):
    mu = Measure(sphere(300, 3, 11))
    op = IsotropicAttention(1.0, "SA")
    times = torch.tensor([0.0, 0.5], dtype=DT)
    with record_paths() as paths:
        fast = simulate(op, mu, times, geometry="sphere", options={"step": 0.125}).final.points
    assert set(paths) == {"series"}
    with kernels.use("dense"):
        slow = simulate(op, mu, times, geometry="sphere", options={"step": 0.125}).final.points
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-13)


def test_keys_far_from_the_origin_are_centred():
    # softmax does not see a constant added to a row's scores: keys around (4, -3, 5) have the r of keys around 0
    x = sphere(60, 3, 4)
    k = x + torch.tensor([4.0, -3.0, 5.0], dtype=DT)
    v = torch.randn(60, 2, generator=torch.Generator().manual_seed(4), dtype=DT)
    assert series.plan(x, k).radius < 1.5   # (uncentred: max |q| max |k| = 7.7)
    torch.testing.assert_close(attend(x, k, v, method="series"), truth(x, k, v), rtol=0, atol=1e-14)


def test_row_log_sums_are_those_of_the_exact_scores():
    g = torch.Generator().manual_seed(8)
    q = 1.4 * sphere(30, 3, 8)
    k = sphere(40, 3, 9) + torch.tensor([2.0, 0.0, -1.0], dtype=DT)
    v = torch.randn(40, 2, generator=g, dtype=DT)
    lw = torch.log_softmax(torch.randn(40, generator=g, dtype=DT), 0) + 3.0
    lw[::4] = -math.inf
    out, L = series.series_attend(q, k, v, lw, lse=True)
    torch.testing.assert_close(L, torch.logsumexp(q @ k.T + lw, dim=-1), rtol=0, atol=1e-14)
    torch.testing.assert_close(out, truth(q, k, v, lw), rtol=0, atol=1e-14)
    _, L0 = series.series_attend(q, k, v, torch.full((40,), -math.inf, dtype=DT), lse=True)
    assert bool(torch.isneginf(L0).all())
    _, L1 = series.series_attend(q, k, v, lse=True)
    torch.testing.assert_close(L1, torch.logsumexp(q @ k.T, dim=-1), rtol=0, atol=1e-14)


def test_the_unnormalized_sphere_model_takes_the_series_with_its_row_sums(low_threshold):
    mu = Measure(sphere(300, 3, 12), log_weights=torch.log_softmax(torch.randn(300, dtype=DT), 0))
    op = IsotropicAttention(1.5, "USA")
    with record_paths() as paths:
        fast = op.velocity(mu, mu.points)
    assert paths == ["series"]
    with kernels.use("dense"), record_paths() as paths:
        slow = op.velocity(mu, mu.points)
    assert paths == ["dense"]
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-14)
    x = mu.points
    direct = (torch.exp(1.5 * x @ x.T + mu.log_weights) @ x)   # the USA field written out
    torch.testing.assert_close(op.evaluate(x, x, mu.log_weights), direct, rtol=0, atol=1e-13)


# ---------------------------------------------------------------- a review's findings (2026-11-28)
def test_derivatives_at_tiny_radii_are_the_dense_ones():
    # degree 0 at r = 0 does not depend on q or k: with derivatives asked, one degree more
    k = 0.5 * torch.randn(6, 3, generator=torch.Generator().manual_seed(1), dtype=DT)
    v = torch.randn(6, 2, generator=torch.Generator().manual_seed(2), dtype=DT)
    for scale in (0.0, 1e-9, 1e-4):
        q = (scale * sphere(4, 3, 3)).requires_grad_(True)
        (gs,) = torch.autograd.grad(attend(q, k, v, method="series")[:, 0].sum(), q)
        (gd,) = torch.autograd.grad(attend(q, k, v, method="dense")[:, 0].sum(), q)
        torch.testing.assert_close(gs, gd, rtol=0, atol=1e-14)
        u = torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=DT)
        ts = torch.func.jvp(functools.partial(attend, k=k, v=v, method="series"), (q.detach(),), (u,))[1]
        td = torch.func.jvp(functools.partial(attend, k=k, v=v, method="dense"), (q.detach(),), (u,))[1]
        torch.testing.assert_close(ts, td, rtol=0, atol=1e-14)


def test_a_call_under_inference_mode_leaves_later_gradients_working():
    x = sphere(9, 2, 5)   # (e = 2: a cache entry of its own)
    with torch.inference_mode():
        attend(x, x, x, method="series")
    v = x.clone().requires_grad_(True)
    (gs,) = torch.autograd.grad(attend(x, x, v, method="series").sum(), v)
    (gd,) = torch.autograd.grad(attend(x, x, v, method="dense").sum(), v)
    torch.testing.assert_close(gs, gd, rtol=0, atol=1e-14)


def test_tf32_is_read_never_set(monkeypatch):
    import types

    from meanfield.kernel_inputs import tf32_on

    cuda = types.SimpleNamespace(device=torch.device("cuda"))
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        assert tf32_on(cuda) is False
        matmul.fp32_precision = "tf32"
        assert tf32_on(cuda) is True and matmul.fp32_precision == "tf32"
        assert tf32_on(types.SimpleNamespace(device=torch.device("cpu"))) is False
    finally:
        matmul.fp32_precision = before


def test_a_float32_call_with_tf32_on_runs_in_float64(monkeypatch):
    x = sphere(50, 3, 6, torch.float32)
    seen = []
    real = series._series
    monkeypatch.setattr(series, "_series", lambda q, *a: seen.append(q.dtype) or real(q, *a))
    monkeypatch.setattr(series, "tf32_on", lambda t: True)
    out = series.series_attend(x, x, x)
    assert out.dtype == torch.float32 and seen == [torch.float64]
    assert series.plan(x, x).degree == 11   # planned at float32's epsilon, not float64's


def test_choose_agrees_with_the_path_run_for_keys_shared_by_a_batch(low_threshold, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = 0.2 * torch.randn(4, 100, 2, generator=g, dtype=DT)
    k, v = 0.2 * torch.randn(30, 2, generator=g, dtype=DT), torch.randn(30, 1, generator=g, dtype=DT)
    for ratio in (0.5, 0.98, 2.0, 100.0):
        monkeypatch.setattr(series, "COST_RATIO", ratio)
        monkeypatch.setattr(kernels, "SERIES_THRESHOLD", 0)
        with record_paths() as paths:
            attend(q, k, v)
        assert paths == [kernels.choose(q, k, v)], ratio


def test_the_radius_is_per_batch_member_and_members_of_zero_weight_do_not_count():
    g = torch.Generator().manual_seed(7)
    q = torch.stack([10 * sphere(5, 3, 1), 0.01 * sphere(5, 3, 2)])
    k = torch.stack([0.01 * torch.randn(8, 3, generator=g, dtype=DT), 10 * torch.randn(8, 3, generator=g, dtype=DT)])
    v = torch.randn(2, 8, 2, generator=g, dtype=DT)
    r = series.plan(q, k).radius
    assert r < 1.0    # each member's own product (the global max |q| x max |k - c| is about 300)
    torch.testing.assert_close(series.series_attend(q, k, v), truth(q, k, v), rtol=0, atol=1e-13)
    lw = torch.zeros(2, 8, dtype=DT)
    lw[1] = -math.inf
    k2 = torch.stack([sphere(8, 3, 3), sphere(8, 3, 4) + 50.0])   # the dead member's keys far away
    q2 = sphere(5, 3, 5).expand(2, 5, 3)
    assert series.plan(q2, k2, lw).radius < 2.0
    torch.testing.assert_close(series.series_attend(q2, k2, v, lw), truth(q2, k2, v, lw), rtol=0, atol=1e-14)


def test_errors_of_the_review():
    x = sphere(8, 3, 0)
    with pytest.raises(NotImplementedError, match="vmap"):
        torch.func.vmap(lambda y: attend(y, y, y, method="series"))(x.expand(2, 8, 3))
    wide = sphere(8, 5, 0)   # r about 1: degree 18 in 5 variables is 33649 features
    with pytest.raises(ValueError, match="needs more than max_features"):
        attend(wide, wide, wide, method="series")
    import numpy as np

    torch.testing.assert_close(series.series_attend(x, x, x, degree=np.int64(20)), truth(x, x, x), rtol=0, atol=1e-14)
    lw = torch.zeros(8, dtype=DT)
    lw[3] = -math.inf
    bad = x.clone()
    bad[3, 0] = math.nan   # a NaN key of zero weight: NaN for the dense kernel too
    with pytest.raises(FloatingPointError, match="k:"):
        attend(x, bad, x, lw, method="series")
    with pytest.raises(FloatingPointError, match="k:"):
        attend(x, bad, x, lw, method="dense")
    with pytest.raises(TypeError, match="q, k, v"):
        series.series_attend(x, x.float(), x)
    with pytest.raises(TypeError, match="log_weights"):
        series.series_attend(x, x, x, torch.zeros(8, dtype=torch.int64))


def test_half_types_run_the_degree_auto_costs(monkeypatch):
    h = sphere(40, 3, 1, torch.float16)
    seen = []
    real = series._series
    monkeypatch.setattr(series, "_series", lambda q, k, v, lw, K, *a: seen.append(K) or real(q, k, v, lw, K, *a))
    series.series_attend(h, h, h)
    assert seen == [series.plan(h, h).degree] and seen[0] < series.plan(h.float(), h.float()).degree
