"""The tiled soft-min of the streaming Sinkhorn (transport/tiles.py): one exponential per entry without the
max-shift where the potentials are close, the max-shifted log-sum-exp on the rows where they are not.

Truths: the soft c-transform T(g)_i = -eps log sum_j b_j exp((g_j - |x_i - y_j|^2) / eps) evaluated densely
in numpy with scipy's ``logsumexp`` (float64), and the independent numpy log-domain Sinkhorn of
tests/reference.py for whole solves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from particles import Measure
from tests.reference import entropic_ot
from transport import solve, tiles, w2

F64, F32 = torch.float64, torch.float32

pytestmark = pytest.mark.usefixtures("one_thread")


def _cloud(n, d, seed, shift=0.0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64) + shift


def _dense_transform(x, y, log_b, g, eps):
    X, Y = x.double().numpy(), y.double().numpy()
    C = ((X[:, None, :] - Y[None, :, :]) ** 2).sum(-1)
    return -eps * logsumexp(log_b.double().numpy()[None, :] + (g.double().numpy()[None, :] - C) / eps, axis=1)


@pytest.mark.parametrize("chunk", [2 ** 18, 7])  # whole rows per tile; tiles of a part of a row
def test_update_is_the_soft_c_transform_with_rows_outside_the_safe_range(chunk):
    n, m, eps = 40, 23, 0.3
    x, y = _cloud(n, 3, 0), _cloud(m, 3, 1, 0.5)
    log_b = torch.log_softmax(_cloud(m, 1, 2)[:, 0], 0)
    g = _cloud(m, 1, 3)[:, 0]
    truth = _dense_transform(x, y, log_b, g, eps)
    # f close to T(g) on most rows; rows 0-2 pushed to where exp overflows (S = e^800), underflows
    # (S = e^-800) or is far below the dtype's range (S = e^-1e5): only the fallback can serve them
    f = torch.from_numpy(truth) + eps * torch.linspace(-2.0, 2.0, n, dtype=F64)
    f[0] += 800 * eps
    f[1] -= 800 * eps
    f[2] -= 1e5 * eps
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    S = tiles.row_sums(tiles.factors(x, xx, f, eps), tiles.cofactors(y, yy, g, log_b, eps), chunk)
    safe = tiles.safe(S, m)
    assert not bool(safe[:3].any()) and bool(safe[3:].all())
    delta = tiles.update(x, xx, y, yy, log_b, f, g, eps, chunk)
    assert bool(torch.isfinite(delta).all())
    np.testing.assert_allclose((f + delta).numpy(), truth, rtol=0, atol=1e-12)


def test_update_float32_falls_back_where_float32_overflows():
    n, m, eps = 30, 20, 0.5
    x, y = _cloud(n, 2, 4), _cloud(m, 2, 5, 0.3)
    log_b = torch.full((m,), -float(np.log(m)), dtype=F64)
    g = torch.zeros(m, dtype=F64)
    truth = _dense_transform(x, y, log_b, g, eps)
    f = torch.from_numpy(truth).clone()
    f[::3] += 100 * eps  # S = e^100 > float32's max
    f[1::3] -= 100 * eps  # S = e^-100: every term below float32's smallest normal number
    x32, y32, f32, g32, lb32 = x.float(), y.float(), f.float(), g.float(), log_b.float()
    delta = tiles.update(x32, (x32 * x32).sum(1), y32, (y32 * y32).sum(1), lb32, f32, g32, eps, 2 ** 18)
    assert delta.dtype == F32 and bool(torch.isfinite(delta).all())
    np.testing.assert_allclose((f32 + delta).double().numpy(), truth, rtol=0, atol=2e-5)


def test_solve_starting_deep_in_the_fallback_range(monkeypatch):
    """Clouds 40 apart at reg 0.5: from f = g = 0 every term exp(-|x - y|^2 / eps) underflows, so the first
    half-steps go through the fallback on every row; the solve still reaches the independent truth."""
    calls = []
    exact = tiles.softmin

    def counting(x, *args):
        calls.append(x.shape[0])
        return exact(x, *args)

    monkeypatch.setattr(tiles, "softmin", counting)
    X, Y = _cloud(12, 2, 6), _cloud(9, 2, 7, 40.0)
    a, b = np.full(12, 1 / 12), np.full(9, 1 / 9)
    res = solve(Measure(X), Measure(Y), "streaming", reg=0.5, scaling=0, debias=False, tol=1e-12, max_iter=10_000)
    assert calls and calls[0] == 12  # the first half-step: the fallback on all rows
    assert res.value_squared == pytest.approx(entropic_ot(X, a, Y, b, 0.5)[1], rel=1e-10)


@pytest.mark.parametrize("chunk", [2 ** 18, 100, 7])
def test_wide_factors_and_split_rows(chunk):
    """d = 10 (factors wider than 8 columns: tiles of at least 64 rows, parts of rows when chunk is small)."""
    n, m, eps = 70, 90, 2.0
    x, y = _cloud(n, 10, 8), _cloud(m, 10, 9, 0.2)
    log_b = torch.log_softmax(_cloud(m, 1, 10)[:, 0], 0)
    g = _cloud(m, 1, 11)[:, 0]
    truth = _dense_transform(x, y, log_b, g, eps)
    f = torch.from_numpy(truth) + 0.5 * eps
    delta = tiles.update(x, (x * x).sum(1), y, (y * y).sum(1), log_b, f, g, eps, chunk)
    np.testing.assert_allclose((f + delta).numpy(), truth, rtol=0, atol=1e-11)


@pytest.mark.parametrize("chunk", [2 ** 18, 7])
def test_gradient_and_cost_over_split_tiles_match_the_dense_solver(chunk):
    """The streamed backward (envelope theorem) and <pi, C>, tile by tile, against POT's dense log-domain
    Sinkhorn differentiated by autograd (method "sinkhorn")."""
    X, Y = _cloud(9, 3, 12), _cloud(7, 3, 13, 0.5)
    kw = dict(reg=0.4, squared=True, tol=1e-12, max_iter=100_000)
    grads, costs = [], []
    for method, extra in (("streaming", dict(chunk_elements=chunk)), ("sinkhorn", {})):
        Xg, Yg = X.clone().requires_grad_(), Y.clone().requires_grad_()
        w2(Measure(Xg), Measure(Yg), method, **kw, **extra).backward()
        grads.append((Xg.grad, Yg.grad))
        costs.append(w2(Measure(X), Measure(Y), method, debias=False, **kw, **extra))
    for ours, dense in zip(*grads):
        np.testing.assert_allclose(ours.numpy(), dense.numpy(), rtol=0, atol=1e-9)
    assert costs[0] == pytest.approx(costs[1], rel=1e-10)
