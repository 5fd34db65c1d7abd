"""The streamed kernel's CUDA fused engine (meanfield.efficient_cuda) tested on CPU: torch's memory-efficient
kernel is replaced by a dense stand-in that implements its operators' contract (layout (B, rows, heads,
width), width a multiple of 8, L with rows padded to 32 and read back in that layout, mask code 1 = causal
from the top-left) and checks that contract on every call. Against the dense kernel in float64: forward,
L, VJP (q, k, v, log-weights), forward-mode JVP and double backward through an autograd graph, unmasked,
weighted, causal and causal weighted, with rows that see no key of positive weight; a refusal of the kernel
falls back to the streamed engines with one warning. The real kernel runs in tests/test_cuda.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.autograd import forward_ad

from meanfield import attention_tiles as tiles
from meanfield import efficient_cuda as efficient
from meanfield import streamed_attention as streaming

DT = torch.float64
CALLS = []


def _check_layout(*tensors):
    for t in tensors:
        assert t.dim() == 4 and t.shape[2] == 1 and t.stride(-1) == 1 and t.is_contiguous()
        assert t.shape[-1] % 8 == 0
        if t.data_ptr() % 16:   # the kernel's own check (torch's CHECK_ALIGNED_PTR): a refusal
            raise RuntimeError("Expected tensor pointer to be aligned to 16 bytes")


def _check_bias(bias, Q, K, mask_type):
    if bias is None:
        return 0
    # (B, heads, rows, keys), the last dimension contiguous, rows broadcast (stride 0: O(N) memory), finite
    assert bias.shape == (Q.shape[0], 1, Q.shape[1], K.shape[1]) and bias.stride(-1) == 1
    assert bias.stride(-2) == 0 or bias.shape[-2] == 1
    assert not (torch.isnan(bias) | (bias == math.inf)).any() and mask_type == 0   # -inf: a weight 0
    # the kernel's own checks (torch's check_supported): the query's dtype, a batch stride of 16 bytes
    if bias.dtype != Q.dtype:
        raise RuntimeError("invalid dtype for bias - should match query's dtype")
    if Q.shape[0] > 1 and bias.stride(0) % (16 // Q.element_size()) != 0:
        raise RuntimeError(f"attn_bias is not correctly aligned (strideB). attn_bias.stride(0) = {bias.stride(0)}")
    CALLS.append("bias")
    return bias[:, 0]


def fake_forward(Q, K, V, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, compute_lse, *, scale):
    _check_layout(Q, K, V)
    assert cu_q is None and dropout_p == 0.0 and compute_lse and scale == 1.0
    assert mask_type in (0, 1)
    CALLS.append("forward")
    s = Q[:, :, 0] @ K[:, :, 0].transpose(-1, -2) + _check_bias(bias, Q, K, mask_type)
    if mask_type == 1:
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(s.double(), -1)
    out = (torch.softmax(s.double(), -1) @ V[:, :, 0].double()).to(Q.dtype)
    m = s.shape[-2]
    # the kernel's L is float32; float64 here keeps the comparison at 1e-12
    lse_dtype = torch.float64 if Q.dtype == DT else torch.float32
    lse_pad = torch.full((s.shape[0], 1, 32 * -(-m // 32)), 123.0, dtype=lse_dtype)
    lse_pad[:, 0, :m] = lse
    seed = offset = torch.empty((), dtype=torch.long)
    return out.unsqueeze(2), lse_pad, seed, offset, m, s.shape[-1]


def fake_backward(G, Q, K, V, bias, O, cu_q, cu_k, max_q, max_k, L, dropout_p, seed, offset, mask_type, bias_grad,
                  *, scale):
    _check_layout(G, Q, K, V, O)
    assert not bias_grad and dropout_p == 0.0 and scale == 1.0
    assert L.dtype == (DT if Q.dtype == DT else torch.float32) and L.dim() == 3
    assert L.shape[-1] % 32 == 0 and L.stride(0) % 8 == 0
    assert (max_q, max_k) == (Q.shape[1], K.shape[1])
    CALLS.append("backward")
    q, k, v, g, o = (t[:, :, 0].double() for t in (Q, K, V, G, O))
    s = q @ k.transpose(-1, -2) + _check_bias(bias, Q, K, mask_type)
    if mask_type == 1:
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - L[:, 0, :q.shape[1], None].to(s.dtype))
    ds = p * (g @ v.transpose(-1, -2) - (g * o).sum(-1, keepdim=True))
    dq, dk, dv = (t.to(Q.dtype) for t in (ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g))
    return dq.unsqueeze(2), dk.unsqueeze(2), dv.unsqueeze(2), None


@pytest.fixture
def fake_kernel(monkeypatch):
    monkeypatch.setattr(efficient, "FORWARD", fake_forward)
    monkeypatch.setattr(efficient, "BACKWARD", fake_backward)
    monkeypatch.setattr(efficient, "runs", lambda device_type, dtype: True)
    monkeypatch.setattr(efficient, "_REFUSED", {})
    CALLS.clear()
    return CALLS


def _problem(seed, B=2, m=37, e=3, c=5, weighted=True, dead=False):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, m, e, generator=g, dtype=DT), torch.randn(B, m, e, generator=g, dtype=DT)
    v = torch.randn(B, m, c, generator=g, dtype=DT)
    lw = torch.randn(B, m, generator=g, dtype=DT) if weighted else None
    if dead:
        lw[0, :4] = -math.inf       # the first rows of batch 0 see no key of positive weight (causal)
        lw[1, :] = -math.inf        # batch 1 has no key of positive weight at all
    return q, k, v, lw


def _dense(q, k, v, lw, causal):
    s = q @ k.transpose(-1, -2)
    if lw is not None:
        s = s + lw[:, None, :]
    if causal:
        m = s.shape[-1]
        s = s.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), -math.inf)
    L = torch.logsumexp(s, -1)
    live = torch.isfinite(L)
    p = torch.where(live[..., None], torch.exp(s - torch.where(live, L, 0)[..., None]), 0)
    return p @ v, L


def _plan(m, causal, B=2):
    seq = torch.arange(m, dtype=DT).expand(B, m)
    qp, kp = (seq, seq) if causal else (None, None)
    return tiles.tile_plan(qp, kp, m, m, 16, 16, engine="tiles", fused=True), qp, kp


CASES = [(w, c, d) for w in (False, True) for c in (False, True) for d in (False, True) if w or not d]


@pytest.mark.parametrize("weighted,causal,dead", CASES)
def test_forward_vjp_and_jvp_match_dense(fake_kernel, weighted, causal, dead):
    q, k, v, lw = _problem(3, weighted=weighted, dead=dead)
    m = q.shape[1]
    plan, qp, kp = _plan(m, causal)
    prim = [t.clone().requires_grad_(True) for t in (q, k, v)] + ([lw.clone().requires_grad_(True)] if weighted
                                                                   else [None])
    out, L = streaming.StreamAttention.apply(*prim, qp, kp, plan)
    ref_out, ref_L = _dense(*prim, causal)
    assert "forward" in fake_kernel
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.equal(torch.isinf(L), torch.isinf(ref_L))
    assert torch.allclose(L[torch.isfinite(L)], ref_L[torch.isfinite(ref_L)], atol=1e-12)
    if dead:
        assert (out[1] == 0).all() and torch.isinf(L[1]).all()
        assert causal == bool((out[0, :4] == 0).all()) == bool(torch.isinf(L[0, :4]).all())
    g = torch.randn_like(out)
    wrt = [t for t in prim if t is not None]
    got = torch.autograd.grad(out, wrt, g)
    assert "backward" in fake_kernel
    want = torch.autograd.grad(ref_out, wrt, g)
    for name, a, b in zip("qkvw", got, want):
        b = torch.where(torch.isfinite(b), b, torch.zeros_like(b))
        assert torch.allclose(a, b, atol=1e-11), name
    # forward mode and double backward use the kernel's out and L with the streamed engines
    tans = [torch.randn_like(t) for t in (q, k, v)]
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(p, t) for p, t in zip((q, k, v), tans)]
        t_out = forward_ad.unpack_dual(streaming.StreamAttention.apply(*duals, lw, qp, kp, plan)[0]).tangent
    ref = torch.func.jvp(lambda a, b, c: _dense(a, b, c, lw, causal)[0], (q, k, v), tuple(tans))[1]
    assert torch.allclose(t_out, torch.nan_to_num(ref, nan=0.0), atol=1e-11)
    x = q.clone().requires_grad_(True)
    o = streaming.StreamAttention.apply(x, k, v, lw, qp, kp, plan)[0]
    (gx,) = torch.autograd.grad((o * g).sum(), x, create_graph=True)
    (hx,) = torch.autograd.grad((gx * tans[0]).sum(), x)
    x2 = q.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad((_dense(x2, k, v, lw, causal)[0] * g).sum(), x2, create_graph=True)
    (hr,) = torch.autograd.grad((gr * tans[0]).sum(), x2)
    # the dense reference gives nan where a row sees no key (0 * inf); the kernels give its value, 0
    assert torch.allclose(hx, torch.nan_to_num(hr, nan=0.0), atol=1e-10)


def test_outputs_that_need_no_copy_are_still_new_tensors(fake_kernel):
    """One batch entry and a width the kernel needs no padding for: the kernel's out and L slice to
    contiguous views of its outputs, which an autograd function must not return (forward-mode AD failed
    with an internal assert on an H200)."""
    q, k, v, _ = _problem(4, B=1, e=8, c=8, weighted=False)
    plan, qp, kp = _plan(q.shape[1], True, B=1)
    tans = [torch.randn_like(t) for t in (q, k, v)]
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(p, t) for p, t in zip((q, k, v), tans)]
        out, L = streaming.StreamAttention.apply(*duals, None, qp, kp, plan)
        t_out = forward_ad.unpack_dual(out).tangent
    assert out._base is None and L._base is None
    ref = torch.func.jvp(lambda a, b, c: _dense(a, b, c, None, True)[0], (q, k, v), tuple(tans))[1]
    assert torch.allclose(t_out, ref, atol=1e-11)


@pytest.mark.parametrize("grad_lw", [False, True])
def test_wide_heads_take_log_weights_as_a_bias_row_unless_their_gradient_is_needed(fake_kernel, grad_lw):
    """e = 8: the extra coordinate would make the width 16, so log-weights enter as a broadcast bias row (a
    head of 64 would otherwise go to the kernel built for 128); their gradient, when needed, still comes
    from the extra coordinate. Rows of a batch entry with no key of positive weight give 0."""
    q, k, v, lw = _problem(12, e=8, c=8, dead=True)
    plan, qp, kp = _plan(q.shape[1], False)
    prim = [t.clone().requires_grad_(True) for t in (q, k, v)] + [lw.clone().requires_grad_(grad_lw)]
    out, _ = streaming.StreamAttention.apply(*prim, qp, kp, plan)
    assert fake_kernel == ["forward", "bias"]
    ref, _ = _dense(*prim, False)
    assert torch.allclose(out, ref, atol=1e-12)
    wrt = [t for t in prim if t.requires_grad]
    g = torch.randn_like(out)
    got, want = torch.autograd.grad(out, wrt, g), torch.autograd.grad(ref, wrt, g)
    assert fake_kernel[2:] == ["backward"] + ([] if grad_lw else ["bias"])
    for a, b in zip(got, want):
        assert torch.allclose(a, torch.nan_to_num(b, nan=0.0), atol=1e-11)


def test_a_cotangent_on_L_takes_the_streamed_engine(fake_kernel):
    q, k, v, lw = _problem(5)
    plan, qp, kp = _plan(q.shape[1], False)
    x = q.clone().requires_grad_(True)
    out, L = streaming.StreamAttention.apply(x, k, v, lw, qp, kp, plan)
    fake_kernel.clear()
    (got,) = torch.autograd.grad(L.sum() + out.sum(), x)
    assert "backward" not in fake_kernel
    x2 = q.clone().requires_grad_(True)
    ro, rL = _dense(x2, k, v, lw, False)
    (want,) = torch.autograd.grad(rL.sum() + ro.sum(), x2)
    assert torch.allclose(got, want, atol=1e-11)


def test_arbitrary_positions_and_forced_engines_never_reach_the_kernel(fake_kernel):
    q, k, v, lw = _problem(6)
    m = q.shape[1]
    pos = torch.rand(2, m, dtype=DT, generator=torch.Generator().manual_seed(1))
    plan = tiles.tile_plan(pos, pos.flip(-1), m, m, 16, 16, engine="tiles", fused=True)
    streaming.StreamAttention.apply(q, k, v, lw, pos, pos.flip(-1), plan)
    forced = tiles.tile_plan(None, None, m, m, 16, 16, engine="tiles", fused=False)
    streaming.StreamAttention.apply(q, k, v, lw, None, None, forced)
    assert fake_kernel == []


def test_only_cuda_and_its_fused_dtypes_run_the_kernel():
    assert not efficient.runs("cpu", torch.float32)
    assert not efficient.runs("cuda", torch.float64)
    assert efficient.runs("cuda", torch.float32) == (efficient.FORWARD is not None and efficient.BACKWARD is not None)


def test_stream_attend_marks_only_device_chosen_engines_as_fused(monkeypatch):
    seen = []
    real = tiles.tile_plan
    monkeypatch.setattr(tiles, "tile_plan", lambda *a, **kw: seen.append(a) or real(*a, **kw))
    q = torch.randn(1, 9, 3, dtype=DT)
    streaming.stream_attend(q, q, q)
    assert seen[-1][-1] is False   # CPU: its own flash kernel, never this one


def test_a_refusal_warns_once_and_falls_back(fake_kernel, monkeypatch):
    def refuse(*a, **kw):
        fake_kernel.append("refused")
        raise RuntimeError("attn_bias is not correctly aligned")

    monkeypatch.setattr(efficient, "FORWARD", refuse)
    q, k, v, lw = _problem(8)
    plan, qp, kp = _plan(q.shape[1], True)
    with pytest.warns(RuntimeWarning, match="refused the call"):
        out, _ = streaming.StreamAttention.apply(q, k, v, lw, qp, kp, plan)
    assert torch.allclose(out, _dense(q, k, v, lw, True)[0], atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streaming.StreamAttention.apply(q, k, v, lw, qp, kp, plan)
    assert fake_kernel.count("refused") == 1


def test_out_of_memory_is_not_a_refusal(fake_kernel, monkeypatch):
    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(efficient, "FORWARD", oom)
    q, k, v, lw = _problem(9)
    plan, qp, kp = _plan(q.shape[1], False)
    with pytest.raises(torch.OutOfMemoryError):
        streaming.StreamAttention.apply(q, k, v, lw, qp, kp, plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e", [3, 64])
def test_batched_weighted_calls_in_the_kernels_dtypes_are_taken(fake_kernel, dtype, e):
    """B = 2 entries of n = 37 keys (a batch stride the kernel would refuse for a bias row of n entries) with
    log-weights, in float32 and the half types (L float32): the kernel takes every call (no refusal), and the
    forward pass and VJP agree with the dense kernel to the dtype's precision."""
    q, k, v, lw = _problem(13, e=e, c=e)
    q, k, v, lw = (t.to(dtype) for t in (q, k, v, lw))
    plan, qp, kp = _plan(q.shape[1], False)
    prim = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, L = streaming.StreamAttention.apply(*prim, lw, qp, kp, plan)
        grads = torch.autograd.grad(out, prim, torch.ones_like(out))
    assert efficient._REFUSED == {} and "backward" in fake_kernel
    assert ("bias" in fake_kernel) == (e == 64 or dtype == torch.float16)   # float16: never the coordinate
    assert out.dtype == dtype and L.dtype == torch.float32
    p64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref, ref_L = _dense(*p64, lw.double(), False)
    ref_g = torch.autograd.grad(ref, p64, torch.ones_like(ref))
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert (out.double() - ref).abs().max() <= tol * max(1.0, ref.abs().max())
    assert (L.double() - ref_L).abs().max() <= tol * max(1.0, ref_L.abs().max())
    for a, b in zip(grads, ref_g):
        assert (a.double() - b).abs().max() <= 4 * tol * max(1.0, b.abs().max())


def test_a_refusal_is_remembered_by_the_kind_of_call(fake_kernel, monkeypatch):
    """A refused weighted batched call sends later calls of that kind to the streamed engines, and only them:
    an unweighted call of the same widths still takes the kernel."""
    real = efficient.FORWARD

    def picky(Q, K, V, bias, *a, **kw):
        if bias is not None or Q.shape[-1] == 72:   # pretend that this GPU refuses every weighted call
            raise RuntimeError("no kernel for these inputs")
        return real(Q, K, V, bias, *a, **kw)

    monkeypatch.setattr(efficient, "FORWARD", picky)
    q, k, v, lw = _problem(14, e=64, c=64)
    plan, qp, kp = _plan(q.shape[1], False)
    with pytest.warns(RuntimeWarning, match="refused"):
        out, _ = streaming.StreamAttention.apply(q, k, v, lw, qp, kp, plan)
    assert torch.allclose(out, _dense(q, k, v, lw, False)[0], atol=1e-12)
    fake_kernel.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streaming.StreamAttention.apply(q, k, v, None, qp, kp, plan)
        streaming.StreamAttention.apply(q, k, v, lw, qp, kp, plan)
    assert fake_kernel == ["forward"]    # the unweighted call only


def test_a_vjp_refused_by_the_kernel_keeps_the_engine_chosen_by_device(fake_kernel, monkeypatch):
    """After a refusal the VJP of a wide head chosen by device goes to the tile loops, as it would without the
    kernel (Triton's VJP is slower there: meanfield.accelerator_paths.triton_vjp), not to Triton."""
    def refuse(*a, **kw):
        raise RuntimeError("not supported on this GPU")

    monkeypatch.setattr(efficient, "BACKWARD", refuse)
    monkeypatch.setattr(streaming, "_triton", lambda: (_ for _ in ()).throw(AssertionError("Triton VJP")))
    real = tiles.backward_tiles
    calls = []
    monkeypatch.setattr(tiles, "backward_tiles", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, _ = _problem(15, e=64, c=64, weighted=False)
    plan = tiles.Plan(16, 16, engine="triton", fused=True)
    out, lse = efficient.forward(q, k, v, None, False)
    with pytest.warns(RuntimeWarning, match="refused"):
        streaming._fast_backward(q, k, v, None, None, None, out, lse, torch.ones_like(out), None, plan,
                                 (True, True, True, False))
    assert calls == [1]


def test_errors_of_the_computation_are_not_refusals(fake_kernel, monkeypatch):
    """Out of memory and CUDA errors raised by the operator propagate; so do errors of the module's own code
    (here a cotangent of the wrong shape), which are not the kernel refusing."""
    q, k, v, lw = _problem(16)
    plan, qp, kp = _plan(q.shape[1], False)
    for exc in (torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("CUDA error: an illegal memory access")):
        def fail(*a, exc=exc, **kw):
            raise exc

        monkeypatch.setattr(efficient, "FORWARD", fail)
        with pytest.raises(type(exc)):
            streaming.StreamAttention.apply(q, k, v, lw, qp, kp, plan)
    monkeypatch.setattr(efficient, "FORWARD", fake_forward)
    out, lse = efficient.forward(q, k, v, lw, False)
    with pytest.raises(RuntimeError) as info:
        efficient.backward(q, k, v, lw, out, lse, torch.ones(2, 3, 5, dtype=DT), False, (True, True, True, True))
    assert not isinstance(info.value, efficient.Refused)
    assert efficient._REFUSED == {}


def test_the_kernel_takes_batches_its_grid_allows_and_nonempty_problems():
    assert efficient.takes(1, 1, 1) and efficient.takes(efficient.MAX_BATCH, 10, 10)
    assert not efficient.takes(efficient.MAX_BATCH + 1, 10, 10)
    assert not efficient.takes(2, 0, 10) and not efficient.takes(2, 10, 0) and not efficient.takes(0, 10, 10)


def test_the_tile_loops_fold_on_accelerators_in_float32_and_float64_only():
    assert streaming.fold_for("cuda", torch.float32) and streaming.fold_for("cuda", torch.float64)
    assert not streaming.fold_for("cuda", torch.bfloat16) and not streaming.fold_for("cuda", torch.float16)
    assert not streaming.fold_for("cpu", torch.float32)


@pytest.mark.parametrize("e", [3, 8, 64])
def test_float16_keys_of_weight_zero_stay_unseen_at_radius_100(fake_kernel, e):
    """float16's most negative number / 4 is -16376, within reach of scores at radius 100: a key of weight 0 with
    a score 2e4 above a live key's must still get no weight. The bias row keeps -inf; the causal mask and
    gradients of the weights (which would need the extra coordinate) go to the streamed engines."""
    q = torch.zeros(1, 2, e, dtype=torch.float16)
    k = torch.zeros(1, 2, e, dtype=torch.float16)
    v = torch.zeros(1, 2, e, dtype=torch.float16)
    q[..., 0], k[0, 0, 0], k[0, 1, 0] = 100.0, 100.0, -100.0
    v[0, 1, 0] = 1.0     # the answer: v of key 1, the only key of positive weight
    lw = torch.tensor([[-math.inf, 0.0]], dtype=torch.float16)
    plan, qp, kp = _plan(2, False, B=1)
    out, L = streaming.StreamAttention.apply(q, k, v, lw, qp, kp, plan)
    assert "bias" in fake_kernel
    assert out[0, :, 0].tolist() == [1.0, 1.0] and L[0].tolist() == [-10000.0, -10000.0]
    # a batch entry whose keys all have weight 0, scores of 4e4: zero output and finite zero gradients
    q2 = torch.full((1, 3, e), 0.0, dtype=torch.float16)
    q2[..., 0] = 200.0
    prim = [q2.clone().requires_grad_(True), q2.clone().requires_grad_(True),
            torch.randn(1, 3, e).half().requires_grad_(True)]
    dead = torch.full((1, 3), -math.inf, dtype=torch.float16)
    out2, L2 = streaming.StreamAttention.apply(*prim, dead, None, None, _plan(3, False, B=1)[0])
    assert (out2 == 0).all() and torch.isinf(L2).all()
    grads = torch.autograd.grad(out2, prim, torch.ones_like(out2))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    # the causal mask and the weights' gradient in float16: two coordinates (flash_cpu.weight_coordinates), a key
    # of weight 0 scoring about -1.7e7 in the kernel's float32 accumulators; the same answer, and d(log a)
    fake_kernel.clear()
    seq = torch.arange(2, dtype=torch.float16)[None]
    causal = tiles.tile_plan(seq, seq, 2, 2, 16, 16, engine="tiles", fused=True)
    out3, _ = streaming.StreamAttention.apply(q, k, v, lw, seq, seq, causal)
    assert fake_kernel == ["forward"] and out3[0, :, 0].tolist() == [0.0, 1.0]   # row 0 sees only key 0 (dead)
    w = torch.tensor([[-math.inf, 0.0, -1.0]], dtype=torch.float16)
    q3, k3, v3 = (torch.cat([t, t[:, 1:]], 1) for t in (q, k, v))
    lwr = w.clone().requires_grad_(True)
    out4 = streaming.StreamAttention.apply(q3, k3, v3, lwr, None, None, _plan(3, False, B=1)[0])[0]
    (dlw,) = torch.autograd.grad(out4, lwr, torch.ones_like(out4))
    assert fake_kernel[-1] == "backward"   # the coordinates, not the bias row (the stand-in logs "bias" after it)
    w64 = w.double().requires_grad_(True)
    ref = _dense(q3.double(), k3.double(), v3.double(), w64, False)[0]
    (dref,) = torch.autograd.grad(ref, w64, torch.ones_like(ref))
    assert torch.allclose(out4.double(), ref, atol=2e-3) and torch.allclose(dlw.double(), dref, atol=2e-3)


def test_float16_weight_coordinates_keep_a_key_of_weight_zero_far_below_every_score():
    """flash_cpu.weight_coordinates: <q', k'> = <q, k> + log a for keys of positive weight; a key of weight 0 scores
    below -1e7 (float16's finfo.min / 4 = -16376 would not do at radius 100); other dtypes: one column."""
    from meanfield.flash_cpu import weight_coordinates

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 3, generator=g) * 50, torch.randn(4, 3, generator=g) * 50
    lw = torch.tensor([-math.inf, -2.0, 0.0, -65000.0])
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q2, k2 = weight_coordinates(q.to(dtype), k.to(dtype), lw.to(dtype))
        assert q2.shape[-1] == 3 + (2 if dtype == torch.float16 else 1)
        s = q2.float() @ k2.float().T                      # the fused kernels accumulate in float32
        ref = q.to(dtype).float() @ k.to(dtype).float().T + lw.to(dtype).float()
        assert torch.allclose(s[:, 1:], ref[:, 1:], rtol=1e-6, atol=1e-2)
        assert (s[:, 0] < -1e7).all() and (s[:, 0] < s[:, 1:].min() - 1e6).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_double_backward_of_half_heads_after_the_kernels_forward_pass(fake_kernel, dtype):
    """The kernel's L is float32 for the half types: the differentiable tiles (double backward) and the JVP
    compute P in the scores' dtype and agree with the dense kernel to the dtype's precision."""
    q, k, v, lw = (t.to(dtype) for t in _problem(17, e=8, c=8))
    plan, qp, kp = _plan(q.shape[1], False)
    x = q.clone().requires_grad_(True)
    out, L = streaming.StreamAttention.apply(x, k, v, lw, qp, kp, plan)
    assert "forward" in fake_kernel and L.dtype == torch.float32
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    t = torch.randn(q.shape, generator=gen).to(dtype)
    # a cotangent on L too (a loss that uses the row log-sum-exp)
    (gx,) = torch.autograd.grad((out * g).sum() + L.sum() / 8, x, create_graph=True)
    (hx,) = torch.autograd.grad((gx * t).sum(), x)
    x64 = q.double().requires_grad_(True)
    ref, ref_L = _dense(x64, k.double(), v.double(), lw.double(), False)
    (gr,) = torch.autograd.grad((ref * g.double()).sum() + ref_L.sum() / 8, x64, create_graph=True)
    (hr,) = torch.autograd.grad((gr * t.double()).sum(), x64)
    # bfloat16 keeps 8 bits: a second derivative through it is good to about 1e-1 (float16: 1e-2); a wrong
    # formula or a dropped term is off by the size of the result
    tol = 1.5e-1 if dtype == torch.bfloat16 else 2e-2
    err = (hx.double() - hr).abs().max() / max(1.0, hr.abs().max())
    assert hx.dtype == dtype and err <= tol, err


def test_the_kernels_backward_reads_a_float32_L_after_its_forward_pass_was_refused(fake_kernel, monkeypatch):
    """A refused forward pass leaves L in the half type (the tile loops); the kernel's backward, taken since,
    must still read float32 (it reads L as float32 whatever its dtype): the stand-in checks it."""
    def refuse(*a, **kw):
        raise RuntimeError("no kernel")

    real = efficient.FORWARD
    monkeypatch.setattr(efficient, "FORWARD", refuse)
    q, k, v, _ = (t.to(torch.float16) if t is not None else None for t in _problem(18, e=40, c=40, weighted=False))
    plan, qp, kp = _plan(q.shape[1], False)
    x = q.clone().requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="refused"):
        out, L = streaming.StreamAttention.apply(x, k, v, None, qp, kp, plan)
    monkeypatch.setattr(efficient, "FORWARD", real)
    torch.autograd.grad(out, x, torch.ones_like(out))
    assert "backward" in fake_kernel


def test_a_refused_bias_row_backward_leaves_the_coordinate_backward_on(fake_kernel, monkeypatch):
    """The VJP with the log-weights' gradient takes the coordinate layout, without it the bias row (wide heads):
    a refusal of one is remembered apart from the other."""
    real = efficient.BACKWARD

    def no_bias(G, Q, K, V, bias, *a, **kw):
        if bias is not None:
            raise RuntimeError("no kernel with a bias here")
        return real(G, Q, K, V, bias, *a, **kw)

    monkeypatch.setattr(efficient, "BACKWARD", no_bias)
    q, k, v, lw = _problem(19, e=64, c=64)
    plan, qp, kp = _plan(q.shape[1], False)
    x = q.clone().requires_grad_(True)
    out = streaming.StreamAttention.apply(x, k, v, lw, qp, kp, plan)[0]
    with pytest.warns(RuntimeWarning, match="refused"):
        torch.autograd.grad(out, x, torch.ones_like(out))
    fake_kernel.clear()
    w = lw.clone().requires_grad_(True)
    out = streaming.StreamAttention.apply(x, k, v, w, qp, kp, plan)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gx, gw = torch.autograd.grad(out, (x, w), torch.ones_like(out))
    assert fake_kernel[-1] == "backward"   # the kernel, in the coordinate layout
    x64, w64 = q.double().requires_grad_(True), lw.double().requires_grad_(True)
    ref = _dense(x64, k, v, w64, False)[0]
    rx, rw = torch.autograd.grad(ref, (x64, w64), torch.ones_like(ref))
    assert torch.allclose(gx, rx, atol=1e-11) and torch.allclose(gw, torch.nan_to_num(rw, nan=0.0), atol=1e-11)


def test_operands_not_aligned_to_16_bytes_are_copied_not_refused(fake_kernel):
    """A query that is a view 4 bytes into a larger buffer (width 8: no padding copy) would be refused by the
    kernel, and the refusal would turn it off for every later call of that kind: it is copied to an aligned
    buffer instead. The result equals the dense kernel's, nothing is remembered as refused."""
    g = torch.Generator().manual_seed(21)
    buf = torch.randn(1 + 2 * 16 * 8, generator=g, dtype=torch.float32)
    q = buf[1:].view(2, 16, 8)
    assert q.data_ptr() % 16 != 0 and q.is_contiguous()
    k, v = torch.randn(2, 16, 8, generator=g), torch.randn(2, 16, 8, generator=g)
    plan, _, _ = _plan(16, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = streaming._forward(q, k, v, None, None, None, plan)[0]
    assert "forward" in fake_kernel and not efficient._REFUSED
    ref = _dense(q.double(), k.double(), v.double(), None, False)[0]
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("engine", ["kernel", "cpu"])
def test_gradients_recorded_with_create_graph_can_be_updated_in_place(fake_kernel, monkeypatch, engine):
    """Gradients from grad(..., create_graph=True) through the streamed kernel are tensors of their own (the
    engines' dk and d log a are views of one buffer): clipping them in place and differentiating again works,
    with the values of the dense kernel."""
    if engine == "cpu":
        monkeypatch.setattr(efficient, "runs", lambda device_type, dtype: False)
    q, k, v, lw = _problem(22)
    grads = {}
    for method in ("stream", "dense"):
        x, w = q.clone().requires_grad_(True), lw.clone().requires_grad_(True)
        plan, _, _ = _plan(q.shape[1], False)
        if method == "stream":
            out = streaming.StreamAttention.apply(x, k, v, w, None, None, plan)[0]
        else:
            out = _dense(x, k, v, w, False)[0]
        gx, gw = torch.autograd.grad((out ** 2).sum(), (x, w), create_graph=True)
        gx.mul_(0.5)
        gw.clamp_(-1, 1)
        grads[method] = (gx.detach().clone(), gw.detach().clone()) + torch.autograd.grad((gx ** 2).sum() + gw.sum(),
                                                                                         (x, w))
    assert "backward" in fake_kernel or engine == "cpu"
    for a, b in zip(grads["stream"], grads["dense"]):
        assert (a - b).abs().max() <= 1e-9 * max(1.0, b.abs().max())


@pytest.mark.parametrize("create_graph", [False, True])
def test_forward_mode_over_a_backward_pass_takes_the_functional_tiles_not_the_kernel(fake_kernel, create_graph):
    """Forward-over-reverse through the kernel's graph: its backward has no forward-mode derivative (torch's op
    raises NotImplementedError, which counted as a refusal and turned the kernel off for the process), so such
    a backward takes the functional tiles: equal to dense, nothing refused."""
    q, k, v, lw = _problem(23)
    plan, qp, kp = _plan(q.shape[1], True)
    g = torch.Generator().manual_seed(24)
    tans = [torch.randn(t.shape, generator=g, dtype=DT) for t in (q, k, v)]
    got = {}
    for name in ("stream", "dense"):
        with forward_ad.dual_level():
            x = [forward_ad.make_dual(t.clone(), d).requires_grad_(True) for t, d in zip((q, k, v), tans)]
            out = (streaming.StreamAttention.apply(*x, lw, qp, kp, plan)[0] if name == "stream"
                   else _dense(*x, lw, True)[0])
            grads = torch.autograd.grad(out.sin().sum(), x, create_graph=create_graph)
            got[name] = [forward_ad.unpack_dual(t).tangent for t in grads]
    assert "forward" in fake_kernel and "backward" not in fake_kernel and not efficient._REFUSED
    for a, b in zip(got["stream"], got["dense"]):
        assert (a - b).abs().max() <= 1e-9 * max(1.0, b.abs().max())
