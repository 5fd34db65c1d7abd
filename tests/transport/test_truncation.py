"""Kernel truncation of the streaming Sinkhorn (transport/truncation.py): Z-order blocks, the skipping bound,
the truncated half-step, and whole solves that use it.

Truths: the exponents (f_i + g_j - |x_i - y_j|^2) / eps + log b_j computed densely (every skipped tile must
lie below the threshold); scipy's log-sum-exp over the kept columns; the untruncated solver and the dense
float64 marginals of the returned plan (the reported error must bound them).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from particles import Measure
from tests.transport.helpers import plan_marginal_error
from transport import solve, tiles, truncation

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _cloud(n, d, seed, scale=1.0, shift=0.0):
    return scale * torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64) + shift


def _exponents(x, y, log_b, f, g, eps):
    C = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    return (f[:, None] + g[None, :] - C) / eps + log_b[None, :]


def test_morton_order_is_a_permutation_whose_blocks_are_compact():
    x = _cloud(4096, 3, 0)
    perm = truncation.morton_order(x)
    assert torch.equal(torch.sort(perm).values, torch.arange(4096))
    volume = lambda b: float(((b.hi - b.lo).prod(1)).mean())
    z = volume(truncation.Blocks(x[perm], 64))
    shuffled = volume(truncation.Blocks(x, 64))
    # random blocks span nearly the whole cube; Z-order ones a few times the 64 / 4096 an ideal cube of 64 points takes
    assert z < 4 * 64 / 4096 and z < shuffled / 10


@pytest.mark.parametrize("threshold", [3.0, 12.0])
def test_every_skipped_tile_lies_below_the_threshold_and_each_row_block_keeps_one(threshold):
    n, m, eps = 300, 260, 0.01
    x, y = _cloud(n, 2, 1), _cloud(m, 2, 2, shift=0.05)
    x, y = x[truncation.morton_order(x)], y[truncation.morton_order(y)]
    log_b = torch.log_softmax(torch.randn(m, generator=torch.Generator().manual_seed(3), dtype=F64), 0)
    f = 0.05 * torch.randn(n, generator=torch.Generator().manual_seed(4), dtype=F64)
    g = 0.05 * torch.randn(m, generator=torch.Generator().manual_seed(5), dtype=F64)
    rows, cols = truncation.Blocks(x, 16), truncation.Blocks(y, 32)
    ptr, kept = truncation.kept_tiles(rows, cols, rows.max(f), cols.max(g + eps * log_b), eps, threshold)
    E = _exponents(x, y, log_b, f, g, eps)
    skipped_any = False
    for r in range(rows.count):
        mine = set(kept[ptr[r]:ptr[r + 1]].tolist())
        assert mine, "a row block kept no tile"
        for t in range(cols.count):
            if t not in mine:
                skipped_any = True
                block = E[r * 16:(r + 1) * 16, t * 32:(t + 1) * 32]
                assert float(block.max()) < -threshold
    assert skipped_any


def test_truncated_update_sums_exactly_the_kept_columns_and_nearly_the_whole_row():
    n, m, eps = 200, 180, 0.005
    x, y = _cloud(n, 2, 6, scale=4.0), _cloud(m, 2, 7, scale=4.0, shift=0.05)
    x, y = x[truncation.morton_order(x)], y[truncation.morton_order(y)]
    log_a, log_b = torch.full((n,), -math.log(n), dtype=F64), torch.full((m,), -math.log(m), dtype=F64)
    # potentials near the solution: a few dense Sinkhorn steps
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    f, g = torch.zeros(n, dtype=F64), torch.zeros(m, dtype=F64)
    for _ in range(30):
        f = f + tiles.update(x, xx, y, yy, log_b, f, g, eps, 2**18)
        g = g + tiles.update(y, yy, x, xx, log_a, g, f, eps, 2**18)
    rows, cols = truncation.Blocks(x, 16), truncation.Blocks(y, 16)
    threshold = truncation.tau(m, 1e-4)
    delta, fraction = truncation.truncated_update(x, xx, y, yy, log_b, f, g, eps, rows, cols, threshold)
    ptr, kept = truncation.kept_tiles(rows, cols, rows.max(f), cols.max(g + eps * log_b), eps, threshold)
    E = _exponents(x, y, log_b, f, g, eps).numpy()
    truth = np.empty(n)
    for r in range(rows.count):
        idx = np.concatenate([np.arange(t * 16, min(m, (t + 1) * 16)) for t in kept[ptr[r]:ptr[r + 1]].tolist()])
        truth[r * 16:(r + 1) * 16] = -eps * logsumexp(E[r * 16:(r + 1) * 16][:, idx], axis=1)
    np.testing.assert_allclose(delta.numpy(), truth, rtol=0, atol=1e-13)
    assert fraction < 0.7   # some tiles skipped (the threshold test above says which)
    full = tiles.update(x, xx, y, yy, log_b, f, g, eps, 2**18)
    # the skipped terms sum to at most m e^-tau = 1e-6 (tau = log m + log(100 / tol)), so the kept sum S' and the
    # whole one S satisfy log S - log S' <= 1e-6 / S', S' = exp(-delta / eps)
    assert bool((full <= delta + 1e-15).all())   # fewer terms: a larger delta (up to rounding)
    assert bool(((delta - full) <= eps * 1.01e-6 * torch.exp(delta / eps)).all())


@pytest.fixture
def truncated(monkeypatch):
    """Truncation at small sizes: blocks of 16 and every problem size; spies on the truncated passes."""
    monkeypatch.setattr(truncation, "MIN_ENTRIES", 0)
    monkeypatch.setattr(truncation, "CPU_ROWS", 16)
    monkeypatch.setattr(truncation, "TILE", 16)
    seen = []
    update = truncation.truncated_update

    def spy(*a, **k):
        out = update(*a, **k)
        seen.append(out[1])
        return out

    monkeypatch.setattr(truncation, "truncated_update", spy)
    return seen


@pytest.mark.parametrize("debias", [False, True])
def test_a_truncated_solve_matches_the_dense_one_and_certifies_the_whole_plan(truncated, monkeypatch, debias):
    # spread clouds at a small blur: a sixth of the entries matter
    mu, nu = Measure(_cloud(700, 2, 8, scale=4.0)), Measure(_cloud(650, 2, 9, scale=4.0, shift=0.1))
    reg = 0.005
    got = solve(mu, nu, "streaming", reg=reg, debias=debias, tol=1e-6)
    assert truncated and max(truncated) < truncation.MAX_FRACTION   # truncation ran and stayed on
    assert got.converged and got.error <= 1e-6
    if not debias:
        assert plan_marginal_error(mu, nu, *got.potentials, reg) <= got.error * (1 + 1e-9) + 1e-14
    monkeypatch.setattr(truncation, "ENABLED", False)
    dense = solve(mu, nu, "streaming", reg=reg, debias=debias, tol=1e-6)
    assert got.value_squared == pytest.approx(dense.value_squared, rel=1e-6)
    np.testing.assert_allclose(got.potentials[0].numpy(), dense.potentials[0].numpy(), rtol=0, atol=2e-8)


def test_truncation_turns_itself_off_where_it_would_compute_most_entries(truncated):
    # a blur as wide as the cloud: every tile matters
    mu, nu = Measure(_cloud(300, 3, 10)), Measure(_cloud(300, 3, 11, shift=0.1))
    res = solve(mu, nu, "streaming", reg=1.0, debias=False, tol=1e-8)
    assert res.converged
    assert len(truncated) == 1 and truncated[0] > truncation.MAX_FRACTION   # one truncated pass, then dense


def test_truncation_applies_to_large_low_dimensional_problems_only(monkeypatch):
    assert truncation.applies(10**5, 10**5, 3)
    assert not truncation.applies(10**5, 10**5, truncation.MAX_DIM + 1)
    assert not truncation.applies(1000, 1000, 3)
    # on CUDA from 4x the entries (an H200 solved N = 1e4 faster untruncated, 2e4 level, 1e5 slower)
    assert truncation.applies(10**4, 10**4, 3) and truncation.applies(10**4, 10**4, 3, torch.device("cpu"))
    assert not truncation.applies(10**4, 10**4, 3, "cuda") and not truncation.applies(10**4, 10**4, 3, "cuda:1")
    assert truncation.applies(2 * 10**4, 2 * 10**4, 3, torch.device("cuda", 0))
    assert not truncation.applies(10**4, 10**4, 3, 0) and truncation.applies(10**4, 10**4, 3, None)   # 0: cuda:0
    big = truncation.MIN_ENTRIES * truncation.CUDA_FACTOR
    assert truncation.applies(big, 1, 3, "cuda") and not truncation.applies(big - 1, 1, 3, "cuda")
    monkeypatch.setattr(truncation, "ENABLED", False)
    assert not truncation.applies(10**5, 10**5, 3)


def test_the_stopping_test_is_dense_in_both_marginals_even_with_a_loose_threshold(truncated, monkeypatch):
    """With tau lowered by 12 the truncated passes leave out visible mass; the last step of g before a stop is
    redone dense, so the reported error still bounds the dense marginals (it once left out the columns'
    share). Found by an independent review."""
    monkeypatch.setattr(truncation, "MAX_FRACTION", 1.01)
    tau = truncation.tau
    monkeypatch.setattr(truncation, "tau", lambda m, tol: tau(m, tol) - 12)
    gg = torch.Generator().manual_seed(1)
    x = torch.rand(700, 1, generator=gg, dtype=F64)
    y = torch.rand(50, 1, generator=gg, dtype=F64) * 0.8 + 0.1
    mu, nu = Measure(x), Measure(y)
    for tol in (1e-4, 1.47e-4, 2.61e-4):
        res = solve(mu, nu, "streaming", reg=1e-3, debias=False, tol=tol, max_iter=3000)
        assert res.converged and truncated
        assert plan_marginal_error(mu, nu, *res.potentials, 1e-3) <= res.error * (1 + 1e-9) + 1e-14
