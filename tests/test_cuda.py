"""The CUDA path against independent references computed on the CPU in float64.

Skipped where CUDA is not available (CI has no GPU); run on a machine with one:
``python -m pytest tests/test_cuda.py -q``. What it checks, each against the dense kernel (the (m, n)
probability matrix times v, and torch.func derivatives of it) in float64 on the CPU:

* every forward path ``attend`` can take on CUDA (auto, dense, fused, stream with each engine), d = 3
  and 64, unweighted, weighted, a sequence's causal mask and arbitrary positions, float32 and float64;
* the VJP and the JVP of the streamed kernel (both engines);
* ``auto`` at N = 1e5 in d = 3 (the issue's out-of-memory case): the output on sampled rows, and that its
  peak memory stays O(N);
* the streaming Sinkhorn, the certified Lipschitz constant on a measure and ``simulate`` against the
  same calls on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from meanfield import SelfAttention, local_lipschitz, simulate  # noqa: E402
from meanfield import streamed_attention as streaming  # noqa: E402
from meanfield.kernels import attend, choose  # noqa: E402
from particles import Measure  # noqa: E402
from transport import solve  # noqa: E402

CUDA = torch.device("cuda")
MASKS = ("none", "weighted", "causal", "positions")
#: relative error allowed (to the largest entry of the reference), by dtype
TOL = {torch.float32: 5e-5, torch.float64: 1e-10}


def _triton_runs():
    from particles.device import triton_runs

    return triton_runs("cuda")


def _inputs(n, d, mask, seed=0, m=None):
    """float64 CPU inputs (q, k, v, log-weights, q positions, k positions); radii of order sqrt(d)."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    A = torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    V = torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    q, k, v = X[:m] @ A.T, X, X @ V.T
    lw = qp = kp = None
    if mask == "weighted":
        w = torch.rand(n, generator=g, dtype=torch.float64)
        w[:3] = 0.0  # atoms of zero weight
        lw = torch.log(w / w.sum())
    if mask == "causal":
        qp, kp = torch.arange(m, dtype=torch.float64), torch.arange(n, dtype=torch.float64)
    if mask == "positions":
        qp = torch.rand(m, generator=g, dtype=torch.float64)
        kp = torch.rand(n, generator=g, dtype=torch.float64)
        qp[0] = -1.0  # a query that sees no key: its output is 0
    return q, k, v, lw, qp, kp


def _to(args, dtype, device=CUDA):
    return tuple(None if t is None else t.to(device=device, dtype=dtype) for t in args)


def _reference(q, k, v, lw, qp, kp):
    """The attention output written out in float64, independently of the framework: scores, the mask (a key
    after the query, or of weight zero, is not seen), max-shifted exponentials normalised per row; a row
    that sees no key is 0."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.T
    seen = torch.ones_like(s, dtype=torch.bool)
    if lw is not None:
        s = s + lw.double()
        seen &= torch.isfinite(lw)[None, :]
    if qp is not None:
        seen &= kp.double()[None, :] <= qp.double()[:, None]
    s = torch.where(seen, s, torch.full_like(s, -math.inf))
    top = s.max(dim=1, keepdim=True).values
    w = torch.where(seen, torch.exp(s - torch.where(torch.isfinite(top), top, 0.0)), 0.0)
    z = w.sum(dim=1, keepdim=True)
    return (w / torch.where(z > 0, z, 1.0)) @ v


def _close(got, ref, dtype, what):
    got = got.detach().to("cpu", torch.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert torch.isfinite(got).all(), what
    err = (got - ref).abs().max().item() / max(1.0, ref.abs().max().item())
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:g}"


def _methods(d, dtype):
    out = [("auto", {}), ("dense", {}), ("stream", {}), ("rows", {"rows": 257})]
    if dtype != torch.float64:
        out.append(("fused", {}))
    if _triton_runs():
        # forced at d = 64 too: three-pass TF32 products there (meanfield.triton_attention._precision)
        out.append(("triton", {"engine": "triton"}))
    out.append(("tiles", {"engine": "tiles"}))
    return out


def _call(name, kw, args):
    q, k, v, lw, qp, kp = args
    if name in ("triton", "tiles"):
        return streaming.stream_attend(q, k, v, lw, qp, kp, **kw)
    if name == "rows":
        from meanfield.kernels import rows_attend

        return rows_attend(q, k, v, lw, qp, kp, **kw)
    return attend(q, k, v, lw, qp, kp, method=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("d", [3, 64])
def test_forward_every_path(d, mask, dtype):
    args = _inputs(1500, d, mask, seed=d)
    ref = _reference(*args)
    for name, kw in _methods(d, dtype):
        if name == "fused" and mask == "positions":
            continue  # SDPA takes no arbitrary positions (auto streams them)
        _close(_call(name, kw, _to(args, dtype)), ref, dtype, f"{name}, d={d}, {mask}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("d", [3, 64])
def test_derivatives_of_the_streamed_kernel(d, mask, dtype):
    """VJP (autograd) and JVP (forward-mode) of auto and each engine against torch.func on the dense kernel."""
    n = 700
    args = _inputs(n, d, mask, seed=10 + d)
    q, k, v, lw, qp, kp = args
    g = torch.Generator().manual_seed(3)
    cot = torch.randn(n, d, generator=g, dtype=torch.float64)
    tans = tuple(torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    dense = lambda a, b, c: _reference(a, b, c, lw, qp, kp)
    _, vjp_fn = torch.func.vjp(dense, q, k, v)
    ref_vjp = vjp_fn(cot)
    ref_jvp = torch.func.jvp(dense, (q, k, v), tans)[1]
    scale = max(1.0, max(r.abs().max().item() for r in ref_vjp))
    for name, kw in [m for m in _methods(d, dtype) if m[0] not in ("dense", "fused", "rows")]:
        dq, dk, dv, dlw, dqp, dkp = _to(args, dtype)
        prim = [t.requires_grad_(True) for t in (dq, dk, dv)]
        out = _call(name, kw, (*prim, dlw, dqp, dkp))
        grads = torch.autograd.grad(out, prim, cot.to(CUDA, dtype))
        for gr, r, what in zip(grads, ref_vjp, "qkv"):
            got = gr.to("cpu", torch.float64)
            err = (got - r).abs().max().item() / scale
            assert err <= 4 * TOL[dtype], f"VJP d{what}, {name}, d={d}, {mask}: {err:.3g}"
        with torch.autograd.forward_ad.dual_level():
            duals = [torch.autograd.forward_ad.make_dual(p.detach(), t.to(CUDA, dtype)) for p, t in zip(prim, tans)]
            tangent = torch.autograd.forward_ad.unpack_dual(_call(name, kw, (*duals, dlw, dqp, dkp))).tangent
        err = (tangent.to("cpu", torch.float64) - ref_jvp).abs().max().item() / max(1.0, ref_jvp.abs().max().item())
        assert err <= 4 * TOL[dtype], f"JVP, {name}, d={d}, {mask}: {err:.3g}"


@pytest.mark.parametrize("mask", MASKS)
def test_auto_at_1e5_tokens_in_d3_is_right_and_o_n(mask):
    """The issue's first row: 1e5 tokens in d = 3 (the score matrix would be 37 GiB in float32)."""
    n = 100_000
    args = _inputs(n, 3, mask, seed=5)
    dev = _to(args, torch.float32)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = attend(*dev)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # O(N): 168 float32 numbers per token at most (64 MiB at N = 1e5; the fused kernels and the Triton
    # engine took 1.5-16 MiB on an H200); the dense scores would be 37 GiB
    bound = 168 * 4 * n
    assert peak <= bound, f"auto at N = 1e5 ({mask}) took {peak / 2**20:.1f} MiB above its inputs"
    print(f"auto at N = 1e5, {mask}: path {choose(*dev)}, peak {peak / 2**20:.1f} MiB above the inputs")
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:200]
    # the reference: float64 on the inputs as the GPU sees them (float32-rounded positions decide the mask)
    q, k, v, lw, qp, kp = (None if t is None else t.to(torch.float32).double() for t in args)
    ref = _reference(q[rows], k, v, lw, None if qp is None else qp[rows], kp)
    got = out[rows.to(CUDA)].double().cpu()
    scale = max(1.0, ref.abs().max().item())
    err = (got - ref).abs().max().item() / scale
    # plain float32 dense arithmetic on the same rows (cuBLAS products, torch's softmax; not the framework's
    # code), for scale: the O(N) path must be as accurate as it, or within TOL
    dq, dk, dv, dlw, dqp, dkp = dev
    s32 = dq[rows.to(CUDA)] @ dk.T
    if dlw is not None:
        s32 = s32 + dlw
    if dqp is not None:
        s32 = s32.masked_fill(dkp[None, :] > dqp[rows.to(CUDA)][:, None], -math.inf)
    dense32 = torch.softmax(s32, dim=1).nan_to_num(0.0) @ dv
    err32 = (dense32.double().cpu() - ref).abs().max().item() / scale
    print(f"  relative error {err:.2e} (float32 dense on the same rows: {err32:.2e})")
    assert torch.isfinite(got).all()
    assert err <= max(TOL[torch.float32], 4 * err32), f"auto at 1e5, {mask}: relative error {err:.3g}"


def test_auto_takes_the_small_head_kernels_above_the_dense_path():
    """Small heads (d = 3, float32) stream in the small-head Triton kernels from the end of the dense path on, every
    mask (accelerator_paths.SMALL_HEADS_FIRST: 2.6-9x faster than SDPA and the row blocks on an H200), where Triton
    runs; the outputs of that path are checked by test_forward_every_path (N = 1500) and the test at 1e5 above. Up to
    N = 36000, below kernels.SERIES_THRESHOLD_SMALL_HEADS: the series is not considered."""
    from meanfield import accelerator_paths

    if not _triton_runs():
        pytest.skip("Triton does not run here")
    assert accelerator_paths.SMALL_HEADS_FIRST
    for n in (1500, 10_000, 36_000):
        for mask in MASKS:
            dev = _to(_inputs(n, 3, mask, seed=2), torch.float32)
            assert choose(*dev) == "stream", (n, mask)
        assert choose(*_to(_inputs(n, 4, "none", seed=2), torch.float32)) != "stream"   # four features: not small


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_streaming_sinkhorn_cuda_matches_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(1500, 3, generator=g, dtype=torch.float64)
    Y = torch.rand(1200, 3, generator=g, dtype=torch.float64) + 0.1
    opts = dict(reg=0.01, debias=True, tol=1e-6 if dtype == torch.float64 else 1e-4)
    cpu = solve(Measure(X), Measure(Y), "streaming", **opts)
    gpu = solve(Measure(X.to(CUDA, dtype)), Measure(Y.to(CUDA, dtype)), "streaming", **opts)
    assert cpu.converged and gpu.converged
    rel = abs(float(gpu.value) - float(cpu.value)) / float(cpu.value)
    assert rel <= (1e-8 if dtype == torch.float64 else 1e-3), rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_truncated_streaming_sinkhorn_cuda_matches_cpu(dtype, monkeypatch):
    """Kernel truncation at every size (the Triton kernel over kept tiles on CUDA, torch tiles on CPU): spread
    clouds at a small blur, where it skips most tiles, give the untruncated CPU value, and the certified error."""
    from transport import truncation

    g = torch.Generator().manual_seed(5)
    X = 4.0 * torch.rand(6000, 2, generator=g, dtype=torch.float64)
    Y = 4.0 * torch.rand(5000, 2, generator=g, dtype=torch.float64) + 0.1
    opts = dict(reg=0.005, debias=True, tol=1e-6 if dtype == torch.float64 else 1e-4)
    monkeypatch.setattr(truncation, "ENABLED", False)
    cpu = solve(Measure(X), Measure(Y), "streaming", **opts)
    monkeypatch.setattr(truncation, "ENABLED", True)
    monkeypatch.setattr(truncation, "MIN_ENTRIES", 0)
    seen = []
    update = truncation.truncated_update
    monkeypatch.setattr(truncation, "truncated_update", lambda *a, **k: (lambda r: seen.append(r[1]) or r)(
        update(*a, **k)))
    gpu = solve(Measure(X.to(CUDA, dtype)), Measure(Y.to(CUDA, dtype)), "streaming", **opts)
    print(f"  truncated passes: {len(seen)}, fraction of the entries {min(seen):.3f}-{max(seen):.3f}")
    assert seen and max(seen) < truncation.MAX_FRACTION
    assert cpu.converged and gpu.converged
    rel = abs(float(gpu.value) - float(cpu.value)) / float(cpu.value)
    assert rel <= (1e-8 if dtype == torch.float64 else 1e-3), rel


def test_certified_lipschitz_on_a_measure_cuda_matches_cpu():
    g = torch.Generator().manual_seed(2)
    n, d = 2000, 3
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    V = torch.randn(d, d, generator=g, dtype=torch.float64)
    est = {}
    for dev in ("cpu", "cuda"):
        mu = Measure(X.to(dev), (w / w.sum()).to(dev))
        est[dev] = local_lipschitz(SelfAttention(A.to(dev), V.to(dev)), mu, tol=1e-8)
        assert est[dev].converged
    assert abs(est["cuda"].value - est["cpu"].value) <= 1e-7 * est["cpu"].value


def test_simulate_cuda_matches_cpu():
    g = torch.Generator().manual_seed(4)
    n, d = 3000, 3
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    A = torch.randn(d, d, generator=g, dtype=torch.float64) / d
    V = torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    fin = {}
    for dev in ("cpu", "cuda"):
        op = SelfAttention(A.to(dev), V.to(dev))
        fin[dev] = simulate(op, Measure(X.to(dev)), [0.0, 1.0], method="rk4", options={"steps": 10}).final
    err = (fin["cuda"].points.cpu() - fin["cpu"].points).abs().max().item()
    assert err <= 1e-10, err


@pytest.mark.parametrize("mask", ("none", "weighted", "causal"))
@pytest.mark.parametrize("d", [3, 64])
def test_the_fused_engine_gives_the_row_log_sum_exp(d, mask):
    """stream_attend's L (what its JVP and VJP recompute P from) from torch's memory-efficient kernel, in
    float32, against log sum_j exp(s_ij) in float64 (natural log, rows that see no key -inf)."""
    from meanfield import efficient_cuda

    if not efficient_cuda.runs("cuda", torch.float32):
        pytest.skip("this torch has no memory-efficient attention operators")
    args = _inputs(3000, d, mask, seed=31)
    q, k, v, lw, qp, kp = args
    s = q @ k.T + (0 if lw is None else lw)
    if qp is not None:
        s = s.masked_fill(kp[None, :] > qp[:, None], -math.inf)
    ref = torch.logsumexp(s, 1)
    _, L = streaming.stream_attend(*_to(args, torch.float32), return_lse=True)
    L = L.double().cpu()
    assert torch.equal(torch.isinf(L), torch.isinf(ref))
    fin = torch.isfinite(ref)
    err = (L[fin] - ref[fin]).abs().max().item() / max(1.0, ref[fin].abs().max().item())
    assert err <= TOL[torch.float32], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("d", [3, 64])
def test_the_fused_engine_with_a_batch_of_weighted_measures(d, dtype):
    """Two measures of n = 501 atoms (a batch whose log-weight rows the kernel needs aligned) in float32 and the
    half types, through stream_attend with gradients: out, L and the VJP against float64 on the CPU, to the
    dtype's precision, with no refusal of the memory-efficient kernel (the autouse fixture)."""
    g = torch.Generator().manual_seed(41)
    n = 501
    X = torch.randn(2, n, d, generator=g, dtype=torch.float64)
    lw = torch.log_softmax(torch.randn(2, n, generator=g, dtype=torch.float64), -1)
    lw[:, :5] = -math.inf
    cot = torch.randn(2, n, d, generator=g, dtype=torch.float64)
    prim = [t.to(CUDA, dtype).requires_grad_(True) for t in (X / 2, X, X)]
    out, L = streaming.stream_attend(*prim, lw.to(CUDA, dtype), return_lse=True)
    grads = torch.autograd.grad(out, prim, cot.to(CUDA, dtype))
    ref_p = [t.detach().double().cpu().requires_grad_(True) for t in prim]
    s = ref_p[0] @ ref_p[1].transpose(-1, -2) + lw.to(dtype).double()[:, None, :]
    ref = torch.softmax(s, -1) @ ref_p[2]
    ref_g = torch.autograd.grad(ref, ref_p, cot.to(dtype).double())
    tol = {torch.float32: TOL[torch.float32], torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    scale = lambda t: max(1.0, t.abs().max().item())
    assert (out.double().cpu() - ref).abs().max().item() <= tol * scale(ref)
    ref_L = torch.logsumexp(s, -1)
    assert (L.double().cpu() - ref_L).abs().max().item() <= tol * scale(ref_L)
    for a, b in zip(grads, ref_g):
        assert (a.double().cpu() - b).abs().max().item() <= 4 * tol * scale(b)


@pytest.fixture(autouse=True)
def _no_triton_kernel_fell_back():
    """After each test: no Triton kernel fell back to torch because it did not compile on this GPU, and
    torch's memory-efficient kernel refused no call of the streamed kernel's fused engine (the fallbacks
    keep results right, as the tests check, but not fast); reported by the test that hit it."""
    from meanfield import efficient_cuda
    from particles import device

    before, refused = dict(device._FAILED), dict(efficient_cuda._REFUSED)
    yield
    new = {k: v for k, v in device._FAILED.items() if k not in before}
    assert not new, f"Triton kernels fell back to torch: {new}"
    new = {k: v for k, v in efficient_cuda._REFUSED.items() if k not in refused}
    assert not new, f"the memory-efficient kernel refused: {new}"


@pytest.mark.parametrize("n", [1000, 10_000, 100_000])
@pytest.mark.parametrize("bad", ["q", "q_pos", "k_pos"])
def test_auto_on_cuda_names_a_nan_input_on_every_path(n, bad):
    """auto's paths on CUDA (dense at 1e3, the small-head kernels at 1e4 and 1e5 in d = 3) report a NaN query or a NaN
    position by name, as on the CPU, instead of returning a zero or NaN row silently (the fused branch returned
    SDPA's output unchecked)."""
    q, k, v, lw, qp, kp = _to(_inputs(n, 3, "positions", seed=7), torch.float32)
    if bad == "q":
        q = q.clone()
        q[n // 2, 0] = math.nan
    else:
        t = (qp if bad == "q_pos" else kp).clone()
        t[n // 3] = math.nan
        qp, kp = (t, kp) if bad == "q_pos" else (qp, t)
    with pytest.raises(FloatingPointError, match=rf"^{bad}: contains NaN"):
        attend(q, k, v, lw, qp, kp)
    if bad != "q":
        return
    # unmasked (the fused path at 1e4 and 1e5 before the small-head kernels): the query is named too
    with pytest.raises(FloatingPointError, match=r"^q: contains NaN"):
        attend(q, k, v)


def test_measure_to_cuda_float32_checks_its_positions_on_the_device():
    """Measure.to(device, dtype) moves the positions before checking that the narrower dtype keeps them apart
    (the check compared a CPU and a CUDA tensor); a tie that float32 would make is still refused."""
    from particles import Measure

    X = torch.randn(3, 2, dtype=torch.float64)
    mu = Measure(X, positions=torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    moved = mu.to(device="cuda", dtype=torch.float32)
    assert moved.positions.device.type == "cuda" and moved.positions.dtype == torch.float32
    tied = Measure(X, positions=torch.tensor([0.5 + 1e-9, 0.5, 0.9], dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype: torch.float32 rounds 1 pair"):
        tied.to(device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_series_on_cuda_against_float64_dense_rows_and_tf32_left_as_it_was(dtype):
    # the sphere models' tokens at N = 4e4 (1.6e9 score entries): auto takes the series on CUDA; 256 rows against
    # float64 dense on the CPU. With TF32 switched on by the caller, float32 runs its products in float64 (the
    # switch read, never set)
    from meanfield import kernels
    from meanfield.kernels import record_paths

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40_000, 3, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    rows = torch.randperm(40_000, generator=g)[:256]
    truth = torch.softmax(x[rows] @ x.T, dim=-1) @ x
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        xc = x.to(CUDA, dtype)
        with record_paths() as paths:
            out = attend(xc, xc, xc)
        assert paths == ["series"] and kernels.choose(xc, xc, xc) == "series"
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    err = float((out[rows.to(CUDA)].double().cpu() - truth).abs().max())
    assert err <= {torch.float32: 2e-6, torch.float64: 1e-13}[dtype], err


def test_certified_local_constant_through_the_series_on_cuda():
    # the at-scale study's measure at N = 2e4 (float64): the series' certificate on CUDA against the same on the CPU
    # and against the exact path's on CUDA; O(N) memory on the device (no N x N allocation)
    from meanfield import local_lipschitz
    from studies.common import seeded_attention, uniform_ball

    X = uniform_ball(20_000, 2, 1.5, 11)
    cpu = local_lipschitz(seeded_attention(2, 0), Measure(X), attention="series")
    torch.cuda.reset_peak_memory_stats()
    gpu = local_lipschitz(seeded_attention(2, 0, CUDA), Measure(X.to(CUDA)), attention="series")
    peak = torch.cuda.max_memory_allocated()
    exact = local_lipschitz(seeded_attention(2, 0, CUDA), Measure(X.to(CUDA)))
    assert gpu.converged and cpu.converged and exact.converged
    assert abs(gpu.value - cpu.value) <= gpu.error + cpu.error
    assert abs(gpu.value - exact.value) <= gpu.error + exact.error
    assert peak < 20_000 ** 2 * 8 / 4, peak
