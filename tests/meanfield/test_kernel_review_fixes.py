"""Fixes of an independent review of the attention kernel, each against a float64 truth written out here:

    out_i = sum_j softmax_j(<q_i, k_j> + log a_j, masked where s_j > t_i) v_j,

rows that see no key of positive weight giving 0, derivatives by torch.autograd on that formula.

* inputs whose last dimension is not stored contiguously (transposed, sliced, expanded features, a Fortran
  ordered array) on the CPU streamed path, whose fused flash kernel read them as if it were;
* float16 / bfloat16 on the CPU tile loops: sums carried across key tiles in float32, so that the error does not
  grow with the number of keys (forward, JVP, VJP);
* NaN positions, which the mask took silently (a zero row, a dropped key): an error naming the argument;
* ``torch.func.vmap``: the dense path's memory guard and auto's choice count the vmapped batch;
* the Triton VJP's D_i = <dO_i, out_i> in float32 for float16 (in its interpreter on CPU).
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

from meanfield import kernels
from meanfield.streamed_attention import stream_attend
from particles.validation import MEMORY_LIMIT_ENV, MemoryLimitError

F64 = torch.float64

# Triton reads TRITON_INTERPRET when it is first imported (here possibly by torch itself, whose torch.func
# transforms of autograd functions import torch._dynamo, which imports Triton): set it before, for the test of
# the Triton VJP in its interpreter, as tests/meanfield/test_kernels_triton.py does; not on a machine with CUDA,
# whose GPU tests of the same session run the compiled kernels
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _truth(q, k, v, lw=None, qp=None, kp=None):
    """The float64 attention formula (module docstring), differentiable by autograd in q, k, v and lw."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    s = q @ k.transpose(-1, -2)
    allowed = torch.ones(s.shape, dtype=torch.bool)
    if lw is not None:
        lw = lw.to(F64)
        s = s + lw.unsqueeze(-2)
        allowed = allowed & (lw != -math.inf).unsqueeze(-2)
    if qp is not None:
        allowed = allowed & (kp.unsqueeze(-2) <= qp.unsqueeze(-1))
    dead = ~allowed.any(-1, keepdim=True)
    s = torch.where(allowed & ~dead, s, torch.tensor(-math.inf, dtype=F64))
    s = torch.where(dead, torch.zeros_like(s), s)
    s = s - s.amax(-1, keepdim=True).detach()       # log-sum-exp: exp of non-positive numbers only
    e = torch.exp(s)
    p = e / e.sum(-1, keepdim=True)
    return torch.where(dead, torch.zeros_like(p), p) @ v


def _rel(a, b):
    """max |a - b| relative to max(1, max |b|)."""
    a, b = a.to(F64), b.to(F64)
    return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()


# ---------------------------------------------------------------------- 1. the last dimension not contiguous
def _transposed(t):
    """The same values, stored column by column: stride(-1) = rows."""
    return t.t().contiguous().t()


def _sliced(t):
    """The same values, every second entry of a wider row: stride(-1) = 2."""
    return torch.stack([t, torch.full_like(t, 7.0)], -1).flatten(-2)[..., ::2]


LAYOUTS = {"transposed": _transposed, "sliced": _sliced}
MASKS = ["none", "causal", "weighted", "weighted causal"]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stream_with_rows_not_contiguous_matches_the_formula(layout, mask, dtype):
    """q, k, v (and the cotangent) whose features are not consecutive in memory: the streamed path (on CPU torch's
    fused flash kernel where the mask allows) gives the formula's output and gradients in q, k, v and log a."""
    g = torch.Generator().manual_seed(1)
    # (with log a as a coordinate, q and k are rebuilt in the kernel's width e + 1: v of that width reaches the
    # kernel as given)
    n, e, c = 300, 3, 4 if mask == "weighted causal" else 2
    base = [torch.randn(n, w, generator=g, dtype=dtype) for w in (e, e, c)]
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=dtype), -1) if "weighted" in mask else None
    pos = torch.arange(n, dtype=dtype) / n if "causal" in mask else None
    leaves = [LAYOUTS[layout](t).requires_grad_(True) for t in base]
    assert all(t.stride(-1) != 1 for t in leaves)
    lw_leaf = None if lw is None else lw.clone().requires_grad_(True)
    out = stream_attend(*leaves, lw_leaf, pos, pos)
    ref_leaves = [t.detach().to(F64).requires_grad_(True) for t in base]
    ref_lw = None if lw is None else lw.detach().to(F64).requires_grad_(True)
    ref = _truth(*ref_leaves, ref_lw, pos, pos)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert _rel(out, ref) <= tol
    cot = LAYOUTS[layout](torch.randn(n, c, generator=g, dtype=F64))
    wrt = leaves + ([lw_leaf] if lw is not None else [])
    got = torch.autograd.grad(out, wrt, cot.to(dtype))
    want = torch.autograd.grad(ref, ref_leaves + ([ref_lw] if lw is not None else []), cot)
    for name, a, b in zip(["q", "k", "v", "log_weights"], got, want):
        assert _rel(a, b) <= 10 * tol, name


def test_attend_with_expanded_features_matches_the_formula():
    """A feature dimension expanded from one column (stride 0), through attend's streamed path and auto with
    derivatives (which streams at this size)."""
    g = torch.Generator().manual_seed(2)
    n = 300
    col = torch.randn(n, 1, generator=g, dtype=F64).requires_grad_(True)
    X = col.expand(n, 3)
    assert X.stride(-1) == 0
    ref_col = col.detach().clone().requires_grad_(True)
    ref = _truth(ref_col.expand(n, 3), ref_col.expand(n, 3), ref_col.expand(n, 3))
    assert _rel(kernels.attend(X.detach(), X.detach(), X.detach(), method="stream"), ref) <= 1e-12
    assert kernels.choose(X, X, X) == "stream"
    out = kernels.attend(X, X, X)
    assert _rel(out, ref) <= 1e-12
    (grad,) = torch.autograd.grad(out.sum(), col)
    (want,) = torch.autograd.grad(ref.sum(), ref_col)
    assert _rel(grad, want) <= 1e-11


def test_self_attention_on_a_fortran_ordered_measure_matches_the_formula():
    """Points from a Fortran-ordered numpy array (the transpose of a (d, n) array): the operator's output and
    its gradient in the points, streamed, equal the formula's at q = X A^T, k = X, v = X V^T."""
    from meanfield import SelfAttention
    from particles import Measure

    rng = np.random.default_rng(3)
    n, d = 300, 3
    P = np.asfortranarray(rng.standard_normal((n, d)))
    A, V = (torch.as_tensor(M) for M in rng.standard_normal((2, d, d)) / 2)
    op = SelfAttention(A, V)
    X = Measure(torch.as_tensor(P)).points
    assert X.stride(-1) != 1
    X = X.detach().requires_grad_(True)
    with kernels.use("stream"):
        out = op.sequence(X)
    Xr = torch.as_tensor(np.ascontiguousarray(P)).requires_grad_(True)
    ref = _truth(Xr @ A.T, Xr, Xr @ V.T)
    assert _rel(out, ref) <= 1e-12
    cot = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    (got,) = torch.autograd.grad(out, X, cot)
    (want,) = torch.autograd.grad(ref, Xr, cot)
    assert _rel(got, want) <= 1e-11


# ---------------------------------------------------------------------- 2. half types on the CPU tile loops
HALF_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _half_problem(dtype, n=16384, m=4):
    g = torch.Generator().manual_seed(5)
    q = (0.1 * torch.randn(m, 3, generator=g)).to(dtype)
    k = torch.randn(n, 3, generator=g).to(dtype)
    v = (torch.rand(n, 2, generator=g) + 1).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_stream_forward_keeps_the_dense_paths_accuracy_over_many_key_tiles(dtype):
    """128 key tiles: the streamed output's error against the formula (on the same half inputs) stays that of the
    dense path, one rounding of the output, instead of growing with each tile's rounded sums."""
    q, k, v = _half_problem(dtype)
    ref = _truth(q, k, v)
    dense = _rel(kernels.attend(q, k, v, method="dense"), ref)
    out = kernels.attend(q, k, v, method="stream", block_size=128)
    assert out.dtype == dtype
    assert _rel(out, ref) <= 2 * dense + HALF_EPS[dtype] / 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_stream_vjp_and_jvp_stay_at_the_dtypes_precision_over_many_key_tiles(dtype):
    """The streamed VJP (torch.autograd.grad) and JVP (torch.autograd.forward_ad) in the tile loops, and their
    differentiable form (torch.func.vjp / jvp), at 128 key tiles: within a few roundings of the dtype of the
    derivatives of the formula at the same half inputs."""
    q, k, v = _half_problem(dtype)
    g = torch.Generator().manual_seed(6)
    cot = torch.randn(q.shape[0], v.shape[-1], generator=g, dtype=F64)
    tq = torch.randn(q.shape, generator=g, dtype=F64)
    tk = torch.randn(k.shape, generator=g, dtype=F64)
    ref_in = [t.to(F64).requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(_truth(*ref_in), ref_in, cot)
    _, want_t = torch.func.jvp(lambda a, b: _truth(a, b, v), (q.to(F64), k.to(F64)), (tq, tk))
    tol = 4 * HALF_EPS[dtype]
    f = lambda a, b, c: kernels.attend(a, b, c, method="stream", block_size=128)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    got = torch.autograd.grad(f(*leaves), leaves, cot.to(dtype))
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == dtype and _rel(a, b) <= tol, (name, _rel(a, b))
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        t_out = fwAD.unpack_dual(f(fwAD.make_dual(q, tq.to(dtype)), fwAD.make_dual(k, tk.to(dtype)), v)).tangent
    assert _rel(t_out, want_t) <= tol

    _, pullback = torch.func.vjp(f, q, k, v)
    for name, a, b in zip("qkv", pullback(cot.to(dtype)), want):
        assert _rel(a, b) <= tol, ("func", name, _rel(a, b))
    _, t_func = torch.func.jvp(lambda a, b: f(a, b, v), (q, k), (tq.to(dtype), tk.to(dtype)))
    assert _rel(t_func, want_t) <= tol


# ---------------------------------------------------------------------- 3. NaN positions
def _masked_problem(n=40):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, 3, generator=g, dtype=F64) for _ in range(3))
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=F64), -1)
    pos = torch.arange(n, dtype=F64) / n
    return q, k, v, lw, pos


PATHS = {
    "dense": lambda *a: kernels.attend(*a, method="dense"),
    "stream": lambda *a: kernels.attend(*a, method="stream", block_size=16),
    "fused": lambda *a: kernels.attend(*a, method="fused"),
    "auto": lambda *a: kernels.attend(*a),
    "auto above the thresholds": lambda *a: _auto_large(*a),
    "rows": lambda *a: kernels.rows_attend(*a, rows=16),
}


def _auto_large(*args):
    with kernels.use(threshold=0):   # auto leaves the dense path
        return kernels.attend(*args)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("which", ["q_pos", "k_pos"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_nan_position_is_an_error_naming_it_on_every_path(path, which, weighted, grad):
    """A NaN position, which the mask s_j > t_i took as 'not visible' (a zero row, a dropped key), is a
    FloatingPointError naming q_pos or k_pos; infinite positions stay allowed and give the formula's output."""
    q, k, v, lw, pos = _masked_problem()
    lw = lw if weighted else None
    if grad:
        q = q.clone().requires_grad_(True)
    qp, kp = pos.clone(), pos.clone()
    (qp if which == "q_pos" else kp)[5] = math.nan
    with pytest.raises(FloatingPointError, match=rf"^{which}: contains NaN"):
        PATHS[path](q, k, v, lw, qp, kp)
    # a query at +inf sees every key, a key at -inf is seen by every query; a query at -inf sees none
    qp, kp = pos.clone(), pos.clone()
    qp[3], kp[7], qp[9] = math.inf, -math.inf, -math.inf
    assert _rel(PATHS[path](q, k, v, lw, qp, kp), _truth(q.detach(), k, v, lw, qp, kp)) <= 1e-12


# ---------------------------------------------------------------------- 4. torch.func.vmap sees the whole batch
def test_under_vmap_the_dense_memory_guard_counts_the_vmapped_batch(monkeypatch):
    """(64, 256, 3) inputs: the dense scores take 3 x 64 x 256 x 256 x 8 bytes = 96 MiB whether the batch is a
    dimension or vmapped; above a 4 MiB limit both calls are refused, with the vmapped one counting 64 x 256 x 256
    entries. Below the limit the vmapped result is the formula's."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 256, 3, generator=g, dtype=F64)
    dense = lambda t: kernels.attend(t, t, t, method="dense")
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "4MiB")
    with pytest.raises(MemoryLimitError, match="4194304 score entries"):
        dense(x)
    with pytest.raises(MemoryLimitError, match="4194304 score entries"):
        torch.func.vmap(dense)(x)
    # nested vmaps (8 x 8 samples) and an input not vmapped (in_dims=None) count the same
    with pytest.raises(MemoryLimitError, match="4194304 score entries"):
        torch.func.vmap(torch.func.vmap(dense))(x.reshape(8, 8, 256, 3))
    k = x[0]
    with pytest.raises(MemoryLimitError, match="4194304 score entries"):
        torch.func.vmap(lambda t, s: kernels.attend(t, s, s, method="dense"), in_dims=(0, None))(x, k)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1GiB")
    assert _rel(torch.func.vmap(dense)(x[:4]), _truth(x[:4], x[:4], x[:4])) <= 1e-12


def test_under_vmap_auto_weighs_the_whole_batch():
    """Auto's thresholds count all batch entries: a vmapped batch of 64 x 256 x 256 score entries (inside a
    transform, above TRANSFORM_STREAM_THRESHOLD) streams, as 64 one-sample calls of 256 x 256 would not; one
    sample alone stays dense. The vmapped output is the formula's."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 256, 3, generator=g, dtype=F64) / 4
    paths = []

    def f(t):
        paths.append(kernels.choose(t, t, t))
        return kernels.attend(t, t, t)

    out = torch.func.vmap(f)(x)
    assert paths == ["stream"]
    assert _rel(out, _truth(x, x, x)) <= 1e-12
    paths.clear()
    torch.func.vmap(f)(x[:1])
    assert paths == ["dense"]


# ---------------------------------------------------------------------- 5. the Triton VJP's D_i in float16
def _interpreted_triton():
    """meanfield.triton_attention with Triton in its interpreter on CPU tensors (TRITON_INTERPRET=1, set at the
    top of this module), or a skip."""
    pytest.importorskip("triton", reason="Triton is not installed (the 'gpu' extra)")
    import meanfield.triton_attention as ta

    if not ta._INTERPRETED:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set (or runs compiled on a GPU here)")
    return ta


def test_triton_vjp_in_float16_keeps_row_sums_that_overflow_float16():
    """D_i = <dO_i, out_i> with dO = 2000 and out about 10 over 4 features is 8e4, above float16's largest
    number (65504) while every factor, and the derivatives, are finite: the VJP in float16 (Triton interpreter)
    equals the formula's gradients at the same inputs to float16 precision."""
    ta = _interpreted_triton()
    g = torch.Generator().manual_seed(10)
    B, m, n, e, c = 1, 8, 20, 3, 4
    q = (0.3 * torch.randn(B, m, e, generator=g)).half()
    k = (0.3 * torch.randn(B, n, e, generator=g)).half()
    v = (10 + torch.randn(B, n, c, generator=g)).half()
    out, lse = ta.forward(q, k, v, None, None, None, False)
    g_out = torch.full((B, m, c), 2000.0, dtype=torch.float16)
    got = ta.backward(q, k, v, None, None, None, False, out, lse, g_out, None, (True, True, True, False))
    ref_in = [t.to(F64).requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(_truth(*ref_in), ref_in, g_out.to(F64))
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) <= 2e-2, (name, _rel(a, b))


@pytest.mark.parametrize("dead", ["all", "some"])
def test_double_backward_of_the_streamed_path_where_queries_see_no_key(dead):
    """Review 46 F3: reverse-over-reverse through method="stream" raised "element 0 of tensors does not require
    grad" when every tile was skipped (no query sees a key); the second derivatives are the dense path's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 3, generator=g, dtype=torch.float64) for _ in range(3))
    kp = torch.linspace(0.2, 1.0, 6, dtype=torch.float64)
    qp = torch.zeros(6, dtype=torch.float64) if dead == "all" else torch.linspace(0.0, 1.0, 6, dtype=torch.float64)
    got = {}
    for method in ("dense", "stream"):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = (stream_attend(*x, None, qp, kp, block_size=2) if method == "stream"
               else kernels.attend(*x, None, qp, kp, method="dense"))
        first = torch.autograd.grad(out, x, torch.ones_like(out) + out.detach(), create_graph=True)
        second = torch.autograd.grad(sum((f * f).sum() for f in first), x, allow_unused=True)
        got[method] = [torch.zeros_like(t) if s is None else s for s, t in zip(second, x)]
    for a, b in zip(got["stream"], got["dense"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_tf32_on_a_cuda_device_is_warned_about_once(monkeypatch):
    """Review 46 F5: with TF32 switched on process-wide, the dense, row, tile and SDPA paths compute the scores with
    a relative error of about 5e-4 (an error of 5 in the exponent at radius 100); the framework never sets the
    switch, so it warns, once. (No GPU here: the check itself, on a stand-in for a CUDA tensor.)"""
    import types
    import warnings

    cuda = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    monkeypatch.setattr(kernels, "_TF32_WARNED", [])
    monkeypatch.setattr(kernels, "tf32_on", lambda t: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels._warn_tf32(cuda)   # TF32 off: silent
    monkeypatch.setattr(kernels, "tf32_on", lambda t: t.device.type == "cuda")
    with pytest.warns(RuntimeWarning, match="TF32.*fp32_precision = 'ieee'"):
        kernels._warn_tf32(cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels._warn_tf32(cuda)   # once per process


def test_weighted_dense_scores_under_autocast_keep_the_log_weights_in_float32():
    """Review of 2026-11-30: the weighted scores as one addmm (the log-weights its bias) ran, under torch.autocast, in
    the half type, bias included: uniform weights of log -1e5 overflowed float16 (NaN probabilities, an error naming
    the scores), and -300 lost most digits in bfloat16 (an error of 0.5). Under autocast the scores are the product
    and a float32 sum, as before: against float64 to the half type's rounding of the product (8 ulps of 1)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 3, generator=g), torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
    for dtype, shift in ((torch.float16, -1e5), (torch.bfloat16, -300.0)):
        lw = torch.randn(8, generator=g) + shift
        scores = (q.to(dtype) @ k.to(dtype).T).double() + lw.double()   # autocast's product, then the exact sum
        truth = torch.softmax(scores, -1)
        with torch.autocast("cpu", dtype=dtype):
            probs = kernels.attention_probs(q, k, lw)
            out = kernels.attend(q, k, v, lw, method="dense")
        tol = 8 * torch.finfo(dtype).eps
        assert probs.dtype == torch.float32 and torch.isfinite(probs).all()
        assert (probs.double() - truth).abs().max() < tol, dtype
        assert (out.double() - truth @ v.double()).abs().max() < tol * v.abs().max(), dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_weighted_dense_rows_of_a_batch_equal_those_of_its_members(dtype):
    """Review of 2026-11-30: one sequence's weighted scores as one addmm (one rounding) differed by an ulp or two in
    the half types from a batch's product and sum (two), so a batch and its members disagreed (0.016 in bfloat16).
    The half types keep the product and the sum everywhere: bitwise equal."""
    g = torch.Generator().manual_seed(1)
    Q = torch.randn(2, 6, 3, generator=g).to(dtype)
    k, v = torch.randn(8, 3, generator=g).to(dtype), torch.randn(8, 2, generator=g).to(dtype)
    lw = (torch.rand(8, generator=g).log()).to(dtype)
    batched = kernels.attend(Q, k.expand(2, 8, 3), v.expand(2, 8, 2), lw.expand(2, 8), method="dense")
    for b in range(2):
        assert torch.equal(kernels.attend(Q[b], k, v, lw, method="dense"), batched[b])
        assert torch.equal(kernels.attention_probs(Q[b], k, lw),
                           kernels.attention_probs(Q, k.expand(2, 8, 3), lw.expand(2, 8))[b])
