"""The streaming Sinkhorn's GPU path, run on CPU: the Triton soft-min (in Triton's interpreter) against
scipy's log-sum-exp of the dense exponents and the dense soft c-transform, including potentials far
outside the range where the CPU path needs its fallback; a whole solve through it against the numpy
log-domain Sinkhorn of tests.reference; the device-sized tiles of the tiled routines.

The kernel tests are skipped where Triton is not installed (the 'gpu' extra, Linux).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

_IMPORTED_BEFORE = "triton" in sys.modules
os.environ["TRITON_INTERPRET"] = "1"  # read by Triton when it is first imported

from particles import Measure  # noqa: E402
from tests.reference import entropic_ot  # noqa: E402
from transport import DEFAULTS, tiles, w2  # noqa: E402
from transport.options import DEFAULT_CHUNK_ELEMENTS  # noqa: E402

F64, F32 = torch.float64, torch.float32


def _cloud(n, d, seed, shift=0.0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64) + shift


@pytest.fixture(scope="module")
def ts():
    pytest.importorskip("triton", reason="Triton is not installed (the 'gpu' extra); the soft-min kernel is "
                                         "tested in its interpreter on CPU")
    import transport.triton_softmin as mod

    if not mod._INTERPRETED:
        pytest.skip(f"triton was imported before TRITON_INTERPRET=1 was set (imported before this module: "
                    f"{_IMPORTED_BEFORE}); run this file alone")
    return mod


@pytest.fixture
def fused(ts, monkeypatch):
    """Every half-step takes the Triton kernel (what it does on CUDA)."""
    calls = []
    lse = ts.lse_rows
    monkeypatch.setattr(tiles, "_fused", lambda x: True)
    monkeypatch.setattr(ts, "lse_rows", lambda A, B: calls.append(A.shape) or lse(A, B))
    return calls


@pytest.mark.parametrize("K", [5, 16, 17, 66])   # padded to 8, 16, 32, 128 columns
@pytest.mark.parametrize("dtype", [F64, F32])
def test_lse_rows_is_the_log_sum_exp_of_the_product(ts, K, dtype):
    g = torch.Generator().manual_seed(K)
    A = torch.randn(37, K, generator=g, dtype=F64)
    B = torch.randn(K, 51, generator=g, dtype=F64)
    A[0] *= 300.0   # exponents of +-1e4 on one row: the max shift keeps it finite and exact
    truth = logsumexp((A @ B).numpy(), axis=1)
    got = ts.lse_rows(A.to(dtype), B.to(dtype))
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    tol = 1e-12 if dtype == F64 else 2e-6
    np.testing.assert_allclose(got.double().numpy(), truth, rtol=tol, atol=tol)


def test_update_through_the_kernel_is_the_soft_c_transform_for_any_potentials(fused):
    """The rows the CPU path must recompute (S = e^800, e^-800, e^-1e5) come out exact from the kernel."""
    n, m, eps = 40, 23, 0.3
    x, y = _cloud(n, 3, 0), _cloud(m, 3, 1, 0.5)
    log_b = torch.log_softmax(_cloud(m, 1, 2)[:, 0], 0)
    g = _cloud(m, 1, 3)[:, 0]
    X, Y = x.numpy(), y.numpy()
    C = ((X[:, None, :] - Y[None, :, :]) ** 2).sum(-1)
    truth = -eps * logsumexp(log_b.numpy()[None, :] + (g.numpy()[None, :] - C) / eps, axis=1)
    f = torch.from_numpy(truth) + eps * torch.linspace(-2.0, 2.0, n, dtype=F64)
    f[0] += 800 * eps
    f[1] -= 800 * eps
    f[2] -= 1e5 * eps
    delta = tiles.update(x, (x * x).sum(1), y, (y * y).sum(1), log_b, f, g, eps, 2**18)
    assert fused and bool(torch.isfinite(delta).all())
    np.testing.assert_allclose((f + delta).numpy(), truth, rtol=0, atol=1e-12)


@pytest.mark.parametrize("debias", [True, False])
def test_a_solve_through_the_kernel_matches_the_numpy_sinkhorn(fused, debias):
    """S_eps (debiased) and OT_eps's <pi, C> through the Triton half-steps equal the independent numpy
    log-domain Sinkhorn; weighted clouds with an atom of zero mass, d = 3."""
    X, Y = _cloud(30, 3, 4), _cloud(26, 3, 5, 0.4)
    a = torch.rand(30, generator=torch.Generator().manual_seed(6), dtype=F64) + 0.1
    b = torch.rand(26, generator=torch.Generator().manual_seed(7), dtype=F64) + 0.1
    b[3] = 0.0
    a, b = a / a.sum(), b / b.sum()
    reg = 1.0  # a few dozen half-steps: the interpreter runs each tile in Python
    got = w2(Measure(X, a), Measure(Y, b), "streaming", reg=reg, squared=True, debias=debias, tol=1e-10,
             max_iter=20_000)
    assert fused
    ot_xy, cost_xy = entropic_ot(X, a, Y, b, reg)[:2]
    if debias:
        truth = ot_xy - 0.5 * entropic_ot(X, a, X, a, reg)[0] - 0.5 * entropic_ot(Y, b, Y, b, reg)[0]
    else:
        truth = cost_xy
    assert got == pytest.approx(truth, rel=1e-8, abs=1e-10)


def test_the_gradient_through_the_kernel_matches_the_cpu_path(fused, monkeypatch):
    X, Y = _cloud(12, 3, 8), _cloud(9, 3, 9, 0.5)
    grads = []  # reg = 1: a few dozen half-steps
    for use_kernel in (True, False):
        monkeypatch.setattr(tiles, "_fused", lambda x, _on=use_kernel: _on)
        Xg = X.clone().requires_grad_()
        w2(Measure(Xg), Measure(Y), "streaming", reg=1.0, squared=True, tol=1e-12, max_iter=100_000).backward()
        grads.append(Xg.grad)
    assert fused
    np.testing.assert_allclose(grads[0].numpy(), grads[1].numpy(), rtol=0, atol=1e-10)


def test_a_soft_min_that_does_not_compile_falls_back_to_the_tiles(ts, monkeypatch):
    from triton.runtime.errors import OutOfResources

    from particles import device

    monkeypatch.setattr(device, "_FAILED", {})
    monkeypatch.setattr(tiles, "_fused", lambda x: True)

    def no_compile(A, B):
        raise OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(ts, "lse_rows", no_compile)
    X, Y = _cloud(20, 3, 10), _cloud(15, 3, 11, 0.3)
    with pytest.warns(RuntimeWarning, match="does not compile"):
        got = w2(Measure(X), Measure(Y), "streaming", reg=1.0, squared=True, tol=1e-10, max_iter=20_000)
    a, b = torch.full((20,), 1 / 20, dtype=F64), torch.full((15,), 1 / 15, dtype=F64)
    ot = lambda P, p, Q, r: entropic_ot(P, p, Q, r, 1.0)[0]
    truth = ot(X, a, Y, b) - 0.5 * ot(X, a, X, a) - 0.5 * ot(Y, b, Y, b)
    assert got == pytest.approx(truth, rel=1e-8, abs=1e-10)


# ---------------------------------------------------------------- tiles sized by the device


def test_device_chunk(monkeypatch):
    assert DEFAULTS["streaming"]["chunk_elements"] == DEFAULT_CHUNK_ELEMENTS
    chunk = lambda given, device: tiles.device_chunk(given, DEFAULT_CHUNK_ELEMENTS, device, 4, 3)  # float32, 3 bufs
    assert chunk(DEFAULT_CHUNK_ELEMENTS, "cpu") == DEFAULT_CHUNK_ELEMENTS  # the CPU keeps the cache-sized default
    monkeypatch.setattr(tiles, "memory_budget", lambda device, limit=None: 12 * 2**30)
    # a GPU with 12 GiB to spare: a quarter of it over 3 float32 buffers, capped at 2^28 entries
    assert chunk(DEFAULT_CHUNK_ELEMENTS, "cuda") == tiles.DEVICE_MAX_CHUNK
    monkeypatch.setattr(tiles, "memory_budget", lambda device, limit=None: 2**30)
    assert chunk(DEFAULT_CHUNK_ELEMENTS, "cuda") == 2**28 // 12
    assert chunk(1000, "cuda") == 1000  # a chunk the caller chose is kept
    monkeypatch.setattr(tiles, "memory_budget", lambda device, limit=None: 2**10)
    assert chunk(DEFAULT_CHUNK_ELEMENTS, "cuda") == DEFAULT_CHUNK_ELEMENTS  # never below the default


@pytest.mark.parametrize("near", [True, False])
def test_the_float64_certificate_through_the_kernel_sums_the_plan(fused, monkeypatch, near):
    """plan_check's row and column sums as two kernel launches equal the dense float64 marginals of the plan
    pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps), near the optimum and far from it (sums of e^+-40)."""
    import transport.streaming_sinkhorn as st

    n, m, eps = 33, 21, 0.2
    x, y = _cloud(n, 3, 12), _cloud(m, 3, 13, 0.3)
    a = torch.rand(n, generator=torch.Generator().manual_seed(14), dtype=F64) + 0.1
    b = torch.rand(m, generator=torch.Generator().manual_seed(15), dtype=F64) + 0.1
    la, lb = (a / a.sum()).log(), (b / b.sum()).log()
    _, _, f, g = entropic_ot(x.numpy(), la.exp().numpy(), y.numpy(), lb.exp().numpy(), eps, tol=1e-6)
    f, g = torch.from_numpy(f), torch.from_numpy(g)
    if not near:
        f = f + eps * torch.linspace(-40.0, 40.0, n, dtype=F64)
    got, cost = st.plan_check(x.float(), y.float(), la.float(), lb.float(), f.float(), g.float(), eps, 2**18)
    assert cost is None and len(fused) == 2    # two launches: rows, then columns
    monkeypatch.setattr(tiles, "_fused", lambda x: False)
    tiled, _ = st.plan_check(x.float(), y.float(), la.float(), lb.float(), f.float(), g.float(), eps, 2**18)
    # the float32 inputs, widened, are the data: the dense truth from the same widened values
    xs, ys, las, lbs, fs, gs = (t.float().double() for t in (x, y, la, lb, f, g))
    C = ((xs[:, None, :] - ys[None, :, :]) ** 2).sum(-1)
    P = (las[:, None] + lbs[None, :] + (fs[:, None] + gs[None, :] - C) / eps).exp()
    truth = float((P.sum(1) - las.exp()).abs().sum() + (P.sum(0) - lbs.exp()).abs().sum())
    assert got == pytest.approx(truth, rel=1e-9) and tiled == pytest.approx(truth, rel=1e-9)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_the_truncated_kernel_sums_exactly_the_kept_tiles(ts, dtype):
    """lse_rows_blocks over a CSR list of column tiles (two Triton column blocks each, a ragged last tile, a row
    block with one tile) equals scipy's log-sum-exp of the dense exponents over exactly those columns."""
    bm, bn = ts.row_block(dtype, 5)
    tile = 2 * bn
    g = torch.Generator().manual_seed(20)
    n, m = 3 * bm + 5, 5 * tile - 7
    A = torch.randn(n, 5, generator=g, dtype=F64)
    B = torch.randn(5, m, generator=g, dtype=F64)
    A[1] *= 200.0   # exponents of +-1e3: max-shifted
    kept = [[0, 4], [2], [1, 3, 4], [0, 1, 2, 3, 4]]
    ptr = torch.tensor([0] + list(np.cumsum([len(k) for k in kept])), dtype=torch.int32)
    tiles_ = torch.tensor([t for k in kept for t in k], dtype=torch.int32)
    got = ts.lse_rows_blocks(A.to(dtype), B.to(dtype), ptr, tiles_, tile)
    E = (A @ B).numpy()
    truth = np.empty(n)
    for r, k in enumerate(kept):
        idx = np.concatenate([np.arange(t * tile, min(m, (t + 1) * tile)) for t in k])
        truth[r * bm:(r + 1) * bm] = logsumexp(E[r * bm:(r + 1) * bm][:, idx], axis=1)
    tol = 1e-12 if dtype == F64 else 2e-6
    np.testing.assert_allclose(got.double().numpy(), truth, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="tile, ptr"):
        ts.lse_rows_blocks(A, B, ptr, tiles_, bn + 1)


def test_a_truncated_solve_through_the_kernels_matches_the_numpy_sinkhorn(fused, monkeypatch):
    """Truncated and dense half-steps through the Triton kernels (interpreted), blocks of the kernel's rows:
    the value equals the independent numpy log-domain Sinkhorn's."""
    from transport import truncation

    monkeypatch.setattr(truncation, "MIN_ENTRIES", 0)
    monkeypatch.setattr(truncation, "TILE", 16)
    monkeypatch.setattr(truncation, "MAX_FRACTION", 1.01)   # on for the whole solve (few tiles at this size)
    seen = []
    update = truncation.truncated_update
    monkeypatch.setattr(truncation, "truncated_update", lambda *a, **k: seen.append(1) or update(*a, **k))
    g = torch.Generator().manual_seed(21)
    X = 4.0 * torch.rand(64, 2, generator=g, dtype=F64)
    Y = 4.0 * torch.rand(48, 2, generator=g, dtype=F64) + 0.1
    reg = 0.1
    got = w2(Measure(X), Measure(Y), "streaming", reg=reg, squared=True, debias=False, tol=1e-8)
    a, b = torch.full((64,), 1 / 64, dtype=F64), torch.full((48,), 1 / 48, dtype=F64)
    assert len(seen) > 3 and fused   # truncation stayed on
    assert got == pytest.approx(entropic_ot(X, a, Y, b, reg)[1], rel=1e-7)
