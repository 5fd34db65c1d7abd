"""The Triton kernels of the attention kernel (forward, JVP, VJP), run in Triton's interpreter on CPU,
against the dense kernel (``attention_probs(...) @ v``, its log-sum-exp, and torch's autograd / torch.func
derivatives of it) in float64: weighted (zero-weight atoms), arbitrary positions (a query that sees no
key), sequences' causal masks, batch dimensions, a key tensor shared across the batch, radii up to 100.

Skipped where Triton is not installed (``pip install 'smooth-attention[gpu]'``, Linux): the CPU build of
torch does not bring it.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported: set it before (on CPU nothing else runs Triton)
_IMPORTED_BEFORE = "triton" in sys.modules
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="Triton is not installed (the 'gpu' extra); its kernels are tested in "
                                     "its interpreter on CPU")

from meanfield import kernels  # noqa: E402
from meanfield import streamed_attention as streaming  # noqa: E402
from meanfield.kernels import attend, attention_probs  # noqa: E402

DT = torch.float64
TOL = 1e-10


@pytest.fixture(scope="module")
def ta():
    """meanfield.triton_attention, its kernels running in Triton's interpreter on CPU tensors."""
    import meanfield.triton_attention as mod

    if not mod._INTERPRETED:
        pytest.skip(f"triton was imported before TRITON_INTERPRET=1 was set (imported before this module: "
                    f"{_IMPORTED_BEFORE}); run this file alone")
    return mod


def _close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


def _problem(seed, B=2, m=23, n=37, e=3, c=5, weighted=True, positions="other", shared_k=False, dtype=DT):
    """3-D kernel inputs. ``positions``: None, "other" (random; the first query before every key: an empty
    row) or "causal" (a sequence; m = n). Log-weights with two zero-weight atoms."""
    g = torch.Generator().manual_seed(seed)
    if positions == "causal":
        m = n
    q = torch.randn(B, m, e, generator=g, dtype=dtype)
    k = torch.randn(1 if shared_k else B, n, e, generator=g, dtype=dtype).expand(B, n, e)
    v = torch.randn(B, n, c, generator=g, dtype=dtype)
    lw = qp = kp = None
    if weighted:
        lw = torch.log_softmax(torch.randn(B, n, generator=g, dtype=dtype), -1)
        lw[:, [j for j in (2, 5) if j < n]] = -math.inf
    if positions == "other":
        qp = torch.rand(B, m, generator=g, dtype=dtype)
        kp = torch.rand(B, n, generator=g, dtype=dtype).clamp(min=0.05)
        qp[:, 0], qp[:, -1] = 0.0, 1.0  # before every key (an empty row), after every key
    elif positions == "causal":
        qp = kp = (torch.arange(1, n + 1, dtype=dtype) / n).expand(B, n)
    return q, k, v, lw, qp, kp


def _dense(q, k, v, lw, qp, kp):
    """(out, L) of the dense kernel: the independent truth."""
    s = q @ k.transpose(-1, -2)
    if lw is not None:
        s = s + lw.unsqueeze(-2)
    if qp is not None:
        s = s.masked_fill(kp.unsqueeze(-2) > qp.unsqueeze(-1), -math.inf)
    return attention_probs(q, k, lw, qp, kp) @ v, torch.logsumexp(s, -1)


CASES = [
    dict(weighted=False, positions=None),
    dict(weighted=True, positions=None),
    dict(weighted=False, positions="other"),
    dict(weighted=True, positions="other"),
    dict(weighted=True, positions="causal"),
    dict(weighted=False, positions="causal", n=50),
    dict(weighted=True, positions=None, e=20, c=17, shared_k=True),
    dict(weighted=True, positions="other", B=1, m=2, n=4),
]


def _ids(case):
    return ",".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_and_log_sum_exp_match_dense(ta, case):
    q, k, v, lw, qp, kp = _problem(1, **case)
    out, lse = ta.forward(q, k, v, lw, qp, kp, case["positions"] == "causal")
    ref_out, ref_lse = _dense(q, k, v, lw, qp, kp)
    _close(out, ref_out)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and torch.all(lse[empty] < 0)
    _close(lse[~empty], ref_lse[~empty])
    if case["positions"] == "other":
        assert empty[:, 0].all() and torch.all(out[:, 0] == 0)  # the query before every key


def test_causal_flag_equals_the_positions_of_the_sequence(ta):
    """The index mask with skipped blocks (causal=True) and the same mask read from positions agree."""
    q, k, v, lw, qp, kp = _problem(2, n=45, positions="causal")
    lw[:, :4] = -math.inf  # the first queries see only zero-mass keys: empty rows
    a = ta.forward(q, k, v, lw, qp, kp, True)
    b = ta.forward(q, k, v, lw, qp, kp, False)
    _close(a[0], b[0])
    assert torch.equal(torch.isinf(a[1]), torch.isinf(b[1])) and torch.isinf(a[1][:, :4]).all()
    _close(a[0], _dense(q, k, v, lw, qp, kp)[0])


def test_radius_100_stays_finite_and_agrees(ta, c=5):
    # (c: v's features; test_triton_small_heads.py runs this with 3, the small heads' kernels)
    q, k, v, lw, qp, kp = _problem(3, positions="other", c=c)
    q = 100 * q / q.norm(dim=-1, keepdim=True)
    k = 100 * k / k.norm(dim=-1, keepdim=True)
    assert (q @ k.transpose(-1, -2)).abs().max() > 5e3
    out, lse = ta.forward(q, k, v, lw, qp, kp, False)
    _close(out, _dense(q, k, v, lw, qp, kp)[0])
    live = torch.isfinite(lse)
    tans = [torch.randn_like(t) for t in (q, k, v, lw)]
    d_out, d_lse = ta.jvp(q, k, v, lw, qp, kp, False, out, lse, *tans)
    assert torch.isfinite(d_out).all() and torch.isfinite(d_lse[live]).all()
    grads = ta.backward(q, k, v, lw, qp, kp, False, out, lse, torch.randn_like(out), None, (True,) * 4)
    assert all(torch.isfinite(gr).all() for gr in grads)


def test_float32_agrees_with_float64_dense(ta):
    args = _problem(4, positions="other", dtype=torch.float32)
    out, _ = ta.forward(*args, False)
    assert out.dtype == torch.float32
    ref = _dense(*[None if a is None else a.double() for a in args])[0]
    _close(out.double(), ref, tol=1e-5)


#: relative error allowed to float32 sums over many blocks (float32 rounding: 6e-8); the gradients of q and
#: k also carry the rounding of D_i = <dO_i, out_i>, computed outside the kernels (measured in this test:
#: 7e-8 forward, 2.2e-7 JVP, 1.6e-7 dv, 6e-7 dq, 7.7e-7 dk; with plain sums 6.8e-7, 2.6e-6, 4.0e-7, 9.4e-7,
#: 1.3e-6)
LONG_TOL = 3e-7
LONG_TOL_DS = 1e-6


def _long_float32(m, n, seed=21):
    """float32 inputs with many key (or query) blocks, and their float64 copies."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(max(m, n), 3, generator=g, dtype=torch.float64)
    A = torch.randn(3, 3, generator=g, dtype=torch.float64) / math.sqrt(3)
    q, k, v = (X[:m] @ A.T)[None], X[None, :n], (X[:n] @ A)[None]
    args32 = [t.float() for t in (q, k, v)] + [None, None, None]
    return args32, [None if t is None else t.double() for t in args32]


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


def test_float32_sums_over_many_blocks_keep_one_blocks_error(ta, monkeypatch):
    """Each pass sums its blocks' products with compensation (``_add``): over 750 key blocks (and 750 query
    blocks for dk, dv) the float32 error stays at a few units of float32 rounding (6e-8), where plain
    ``+=`` lost 1e-6 here (in the interpreter's 16 x 16 tiles) and 1.9e-4 at N = 1e5 on an H200. The heads
    (3 features) would take the small heads' kernels: this test is about this module's own
    (tests/meanfield/test_triton_small_heads.py has the other's)."""
    from meanfield import accelerator_paths

    monkeypatch.setattr(accelerator_paths, "SMALL_HEAD_FEATURES", None)
    tol = LONG_TOL
    args, ref_args = _long_float32(16, 12_000)
    out, lse = ta.forward(*args, False)
    ref_out, ref_lse = _dense(*ref_args)
    assert _rel(out, ref_out) <= tol
    g = torch.Generator().manual_seed(22)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in ref_args[:3])
    t_out = torch.func.jvp(lambda a, b, c: _dense(a, b, c, None, None, None)[0], tuple(ref_args[:3]),
                           (tq, tk, tv))[1]
    d_out, _ = ta.jvp(*args, False, out, lse, tq.float(), tk.float(), tv.float(), None)
    # the tangent adds the float32 rounding of the tangent scores and of exp (numpy 2.4's float32 exp, 1.5 ulp, in
    # the interpreter): 7.2e-7 compensated, 2.6e-6 with plain += (measured with _add replaced), so the bound of dq
    assert _rel(d_out, t_out) <= LONG_TOL_DS
    g_out = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
    prim = [t.clone().requires_grad_(True) for t in ref_args[:3]]
    ref_dq = torch.autograd.grad((_dense(*prim, None, None, None)[0] * g_out).sum(), prim[0])[0]
    dq = ta.backward(*args, False, out, lse, g_out.float(), None, (True, False, False, False))[0]
    assert _rel(dq, ref_dq) <= LONG_TOL_DS
    # dk and dv sum over query blocks
    args, ref_args = _long_float32(12_000, 16)
    out, lse = ta.forward(*args, False)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    prim = [t.clone().requires_grad_(True) for t in ref_args[:3]]
    ref_dk, ref_dv = torch.autograd.grad((_dense(*prim, None, None, None)[0] * g_out).sum(), prim[1:])
    _, dk, dv, _ = ta.backward(*args, False, out, lse, g_out.float(), None, (False, True, True, False))
    assert _rel(dk, ref_dk) <= LONG_TOL_DS and _rel(dv, ref_dv) <= tol


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")   # the interpreter's numpy, by design
def test_a_float32_sum_that_overflows_stays_infinite(ta):
    """Compensation must not turn an overflow into NaN: a carry that overflowed is dropped, so sums past the
    float32 range stay +inf (the output check then reports them), as plain sums did."""
    q, k = torch.zeros(1, 16, 3), torch.zeros(1, 64, 3)
    v = torch.full((1, 64, 2), 3e38)
    out, _ = ta.forward(q, k, v, None, None, None, False)
    assert torch.equal(out, torch.full_like(out, math.inf))


# bfloat16 is left out: Triton's interpreter computes on numpy arrays, which have no bfloat16 (it returns
# garbage for a plain bfloat16 load and store); on a GPU it takes the float16 code path
@pytest.mark.parametrize("dtype", [torch.float16])
def test_half_types_agree_with_float64_dense_to_their_precision(ta, dtype):
    args = _problem(12, positions="causal", n=40)
    half = [None if a is None else a.to(dtype) for a in args]
    out, lse = ta.forward(*half, True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = _dense(*[None if a is None else a.double() for a in half])
    _close(out.double(), ref_out, tol=2e-2)
    live = torch.isfinite(ref_lse)
    _close(lse[live].double(), ref_lse[live], tol=1e-2)
    g_out = torch.randn(out.shape, dtype=torch.float64)
    dq = ta.backward(*half, True, out, lse, g_out.to(dtype), None, (True, False, False, False))[0]
    qd = half[0].double().requires_grad_(True)
    ref = torch.autograd.grad((_dense(qd, *[None if a is None else a.double() for a in half[1:]])[0] * g_out).sum(),
                              qd)[0]
    _close(dq.double(), ref, tol=5e-2)


@pytest.mark.parametrize("positions", ["other", "causal"])
def test_half_points_with_float32_positions(ta, positions):
    """Measures of float16 points keep their positions in float32 (particles.measure.position_dtype: i/n
    collide in half precision): the kernel compares them as given, against float64 dense on the same values."""
    args = _problem(13, positions=positions, n=40)
    half = [None if a is None else a.to(torch.float16) for a in args[:4]] + [a.float() for a in args[4:]]
    assert half[4].dtype == torch.float32 and half[0].dtype == torch.float16
    out, _ = ta.forward(*half, positions == "causal")
    ref_out, _ = _dense(*[a.double() for a in half[:4]], *half[4:])
    _close(out.double(), ref_out, tol=2e-2)


def _dense_fn(qp, kp):
    return lambda q, k, v, lw: _dense(q, k, v, lw, qp, kp)


# every tangent at once on each mask; each tangent alone (the kernel's flags) on the weighted ones
JVP_CASES = [(case, "all") for case in CASES[:6]] + [
    (case, which) for case in (CASES[3], CASES[4]) for which in ("q", "k", "v", "lw")]


@pytest.mark.parametrize("case, which", JVP_CASES, ids=[f"{_ids(c)}-{w}" for c, w in JVP_CASES])
def test_jvp_matches_dense_forward_mode(ta, case, which):
    q, k, v, lw, qp, kp = _problem(5, **case)
    names = ["q", "k", "v"] + (["lw"] if lw is not None else [])
    prim = (q, k, v, lw)[:len(names)]
    g = torch.Generator().manual_seed(6)
    tans = [torch.randn(t.shape, generator=g, dtype=DT) if which in ("all", name) else None
            for t, name in zip(prim, names)]
    f = lambda *p: _dense(*p[:3], p[3] if len(p) > 3 else None, qp, kp)
    (_, ref_lse), (t_out, t_lse) = torch.func.jvp(
        f, prim, tuple(torch.zeros_like(p) if t is None else t for p, t in zip(prim, tans)))
    causal = case["positions"] == "causal"
    out, lse = ta.forward(q, k, v, lw, qp, kp, causal)
    d_out, d_lse = ta.jvp(q, k, v, lw, qp, kp, causal, out, lse, *(tans + [None] * (4 - len(tans))))
    _close(d_out, t_out)
    live = torch.isfinite(ref_lse)
    _close(d_lse[live], t_lse[live])


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("with_lse", [False, True])
def test_vjp_matches_dense_reverse_mode(ta, case, with_lse):
    q, k, v, lw, qp, kp = _problem(7, **case)
    causal = case["positions"] == "causal"
    prim = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    lw_r = None if lw is None else lw.detach().clone().requires_grad_(True)
    ref_out, ref_lse = _dense(*prim, lw_r, qp, kp)
    g = torch.Generator().manual_seed(8)
    g_out = torch.randn(ref_out.shape, generator=g, dtype=DT)
    g_lse = torch.randn(ref_lse.shape, generator=g, dtype=DT) if with_lse else None
    live = torch.isfinite(ref_lse)
    total = (ref_out * g_out).sum()
    if with_lse:
        total = total + (ref_lse[live] * g_lse[live]).sum()
    wrt = prim + ([lw_r] if lw_r is not None else [])
    ref = torch.autograd.grad(total, wrt)
    out, lse = ta.forward(q, k, v, lw, qp, kp, causal)
    got = ta.backward(q, k, v, lw, qp, kp, causal, out, lse, g_out, g_lse, (True,) * 4)
    for a, b in zip(got, ref):
        if b is not None and b is ref[-1] and lw is not None:
            finite = torch.isfinite(lw)  # the dense gradient at log a = -inf is 0 * inf bookkeeping
            _close(a[finite], b[finite])
        else:
            _close(a, b)
    if lw is None:
        assert got[3] is None


def test_vjp_computes_only_what_is_needed(ta, e=3, c=5):
    q, k, v, lw, qp, kp = _problem(9, e=e, c=c)
    out, lse = ta.forward(q, k, v, lw, qp, kp, False)
    g_out = torch.randn_like(out)
    full = ta.backward(q, k, v, lw, qp, kp, False, out, lse, g_out, None, (True,) * 4)
    for i in range(4):
        need = tuple(j == i for j in range(4))
        part = ta.backward(q, k, v, lw, qp, kp, False, out, lse, g_out, None, need)
        assert all((p is None) == (j != i) for j, p in enumerate(part))
        assert torch.equal(part[i], full[i])


@pytest.mark.parametrize("positions", ["other", "causal"])
def test_batches_above_the_grid_limit_run_in_chunks(ta, monkeypatch, positions):
    """CUDA takes at most 65535 programs on a grid's second axis (the batch here): larger batches run in chunks
    of at most GRID_Y_MAX entries (here lowered to 2, over 5 entries, with keys shared across the batch),
    forward, JVP and VJP equal to the dense truth, and every launch within the limit."""
    q, k, v, lw, qp, kp = _problem(11, B=5, m=9, n=11, shared_k=True, positions=positions)
    causal = positions == "causal"
    launches = []
    real = ta._forward_kernel
    monkeypatch.setattr(ta, "GRID_Y_MAX", 2)

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid[1])
            return real[grid]

    monkeypatch.setattr(ta, "_forward_kernel", Spy())
    out, lse = ta.forward(q, k, v, lw, qp, kp, causal)
    assert launches == [2, 2, 1]
    ref_out, ref_lse = _dense(q, k, v, lw, qp, kp)
    _close(out, ref_out)
    live = torch.isfinite(ref_lse)
    _close(lse[live], ref_lse[live])
    g = torch.Generator().manual_seed(12)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=DT) for t in (q, k, v))
    d_out, _ = ta.jvp(q, k, v, lw, qp, kp, causal, out, lse, tq, tk, tv, None)
    _, t_ref = torch.func.jvp(lambda a, b, c: _dense(a, b, c, lw, qp, kp)[0], (q, k.contiguous(), v), (tq, tk, tv))
    _close(d_out, t_ref)
    g_out = torch.randn(out.shape, generator=g, dtype=DT)
    prim = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = torch.autograd.grad((_dense(*prim, lw, qp, kp)[0] * g_out).sum(), prim)
    got = ta.backward(q, k, v, lw, qp, kp, causal, out, lse, g_out, None, (True, True, True, False))
    for a, b in zip(got[:3], ref):
        _close(a, b)
    assert got[3] is None


# ---------------------------------------------------------------- through the streamed kernel


@pytest.fixture
def triton_engine(ta, monkeypatch):
    """Every streamed call takes the Triton engine (what it does on CUDA)."""
    resolve = streaming._resolve_engine
    monkeypatch.setattr(streaming, "_resolve_engine", lambda engine, q, v: resolve("triton", q, v))
    calls = {"forward": 0, "jvp": 0, "backward": 0}
    for name in calls:
        fn = getattr(ta, name)
        monkeypatch.setattr(ta, name, lambda *a, _fn=fn, _name=name: calls.__setitem__(_name, calls[_name] + 1)
                            or _fn(*a))
    return calls


@pytest.mark.parametrize("positions", [None, "sequence", "other"])
def test_autograd_forward_ad_and_double_backward_through_the_triton_engine(triton_engine, positions):
    """Reverse mode, forward mode and reverse-over-reverse products (what local_lipschitz uses) of
    self-attention in the Triton engine equal the dense kernel's."""
    from torch.autograd import forward_ad

    g = torch.Generator().manual_seed(10)
    n, d = 29, 3
    X = torch.randn(2, n, d, generator=g, dtype=DT)
    A, V = torch.randn(d, d, generator=g, dtype=DT), torch.randn(d, d, generator=g, dtype=DT)
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0)
    lw[3] = -math.inf
    pos = torch.arange(1, n + 1, dtype=DT) / n if positions == "sequence" else None
    qpos = kpos = pos
    if positions == "other":
        qpos, kpos = torch.rand(n, generator=g, dtype=DT), torch.rand(n, generator=g, dtype=DT)

    def f(method):
        return lambda Z: attend(Z @ A.T, Z, Z @ V.T, lw, qpos, kpos, method=method)

    U, W = torch.randn_like(X), torch.randn_like(X)
    Xs = X.clone().requires_grad_(True)
    ys = f("stream")(Xs)
    _close(ys, f("dense")(X))
    assert triton_engine["forward"] >= 1
    (gs,) = torch.autograd.grad((ys * W).sum(), Xs, create_graph=True)
    assert triton_engine["backward"] >= 1
    ref_vjp = torch.func.vjp(f("dense"), X)[1](W)[0]
    _close(gs, ref_vjp)
    ref_jvp = torch.func.jvp(f("dense"), (X,), (U,))[1]
    # J u as the derivative of <J^T w, u> in w: the reverse-over-reverse product
    w0 = torch.zeros_like(X, requires_grad=True)
    (g0,) = torch.autograd.grad(f("stream")(Xs), Xs, w0, create_graph=True)
    (ju,) = torch.autograd.grad(g0, w0, U)
    _close(ju, ref_jvp)
    with forward_ad.dual_level():
        t = forward_ad.unpack_dual(f("stream")(forward_ad.make_dual(X, U))).tangent
    _close(t, ref_jvp)
    assert triton_engine["jvp"] >= 2


def test_local_lipschitz_certificate_through_the_triton_engine(triton_engine):
    """The certified mean-field Lipschitz constant of self-attention on a weighted measure, computed with
    the Triton engine, equals the one computed with the dense kernel (both certified to tol)."""
    from meanfield import SelfAttention, local_lipschitz
    from particles import Measure

    g = torch.Generator().manual_seed(11)
    n, d = 24, 3
    X = torch.randn(n, d, generator=g, dtype=DT)
    w = torch.rand(n, generator=g, dtype=DT) + 0.1
    A, V = torch.randn(d, d, generator=g, dtype=DT), torch.randn(d, d, generator=g, dtype=DT)
    mu = Measure(X, w / w.sum())
    op = SelfAttention(A, V)
    with kernels.use("dense"):
        ref = local_lipschitz(op, mu, tol=1e-8)
    with kernels.use("stream"):
        got = local_lipschitz(op, mu, tol=1e-8)
    assert triton_engine["jvp"] + triton_engine["backward"] > 0
    assert abs(got.value - ref.value) <= 1e-7 * ref.value
    assert got.converged and ref.converged


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("positions", [None, "sequence", "other"])
def test_forward_mode_over_a_backward_pass_through_the_triton_engine(triton_engine, positions, create_graph):
    """Forward-over-reverse (forward_ad around a gradient, as a Hessian-vector product): the Triton kernels work
    on raw pointers and carry no tangent (the gradient's tangent came back None, or wrong beside other terms),
    so such a backward takes the functional tiles; equal to the dense kernel."""
    from torch.autograd import forward_ad

    g = torch.Generator().manual_seed(15)
    n = 13
    q, k, v = (torch.randn(2, n, 3, generator=g, dtype=DT) for _ in range(3))
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0)
    lw[3] = -math.inf
    qp = kp = torch.arange(n, dtype=DT) if positions == "sequence" else None
    if positions == "other":
        qp, kp = torch.rand(n, generator=g, dtype=DT), torch.rand(n, generator=g, dtype=DT)
    tans = [torch.randn(t.shape, generator=g, dtype=DT) for t in (q, k, v)]
    got = {}
    for method in ("stream", "dense"):
        with forward_ad.dual_level():
            x = [forward_ad.make_dual(t.clone(), d).requires_grad_(True) for t, d in zip((q, k, v), tans)]
            out = attend(*x, lw, qp, kp, method=method)
            grads = torch.autograd.grad(out.sin().sum() + (x[0] ** 2).sum(), x, create_graph=create_graph)
            got[method] = [forward_ad.unpack_dual(t).tangent for t in grads]
    assert triton_engine["forward"] >= 1
    for a, b in zip(got["stream"], got["dense"]):
        assert a is not None
        _close(a, b)


def test_a_kernel_that_does_not_compile_falls_back_to_the_tiles_once_with_a_warning(triton_engine, ta, monkeypatch):
    """On a GPU where a kernel does not compile (Triton's compile-time or resource errors), the call is
    computed by the tile loops (same result), the first time with a RuntimeWarning, then silently;
    errors of the computation itself propagate."""
    from triton.runtime.errors import OutOfResources

    from particles import device

    monkeypatch.setattr(device, "_FAILED", {})
    calls = []

    def no_compile(*a):
        calls.append(1)
        raise OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(ta, "forward", no_compile)
    q, k, v, lw, qp, kp = _problem(13, B=1, positions="other")
    with pytest.warns(RuntimeWarning, match="does not compile"):
        out = streaming.stream_attend(q, k, v, lw, qp, kp)
    _close(out, _dense(q, k, v, lw, qp, kp)[0])
    out = streaming.stream_attend(q, k, v, lw, qp, kp)  # no second warning, no second attempt
    assert len(calls) == 1
    monkeypatch.setattr(ta, "forward", lambda *a: 1 / 0)
    monkeypatch.setattr(device, "_FAILED", {})
    with pytest.raises(ZeroDivisionError):
        streaming.stream_attend(q, k, v, lw, qp, kp)


def test_a_compile_failure_turns_off_only_the_kernel_specialized_for_that_mask(triton_engine, ta, monkeypatch):
    """The kernels are compiled per mask (log-weights; none, causal, arbitrary positions): one that does not
    compile for arbitrary positions leaves the unmasked and unweighted kernel of the same widths on."""
    from triton.runtime.errors import OutOfResources

    from particles import device

    monkeypatch.setattr(device, "_FAILED", {})
    real = ta.forward.__wrapped__ if hasattr(ta.forward, "__wrapped__") else ta.forward
    ran = []

    def picky(q, k, v, lw, qp, kp, causal):
        if qp is not None:
            raise OutOfResources(300_000, 232_448, "shared memory")
        ran.append(1)
        return real(q, k, v, lw, qp, kp, causal)

    monkeypatch.setattr(ta, "forward", picky)
    q, k, v, lw, qp, kp = _problem(14, B=1, positions="other")
    with pytest.warns(RuntimeWarning, match="does not compile"):
        streaming.stream_attend(q, k, v, lw, qp, kp)
    out = streaming.stream_attend(q, k, v)
    assert ran == [1]
    _close(out, _dense(q, k, v, None, None, None)[0])


def test_the_fallback_warning_names_the_cause_of_a_compile_error(triton_engine, ta, monkeypatch):
    """Triton's CompilationError quotes the kernel's source and chains the reason: the warning carries the
    reason (Triton 3.6 refused tl.dot with K = 8 in float32 on an H200, and a 300-character excerpt of the
    source said nothing of it)."""
    from triton.errors import TritonError

    from particles import device

    class FakeCompilationError(TritonError):
        pass

    def no_compile(*a):
        try:
            raise ValueError("Input shapes should have M >= 1, N >= 1 and K >= 16")
        except ValueError as cause:
            raise FakeCompilationError("at 27:12:\n    s = _scores(q, kT, ...)\n        ^" + " " * 400) from cause

    monkeypatch.setattr(device, "_FAILED", {})
    monkeypatch.setattr(ta, "forward", no_compile)
    q, k, v, lw, qp, kp = _problem(14, B=1, positions="other")
    with pytest.warns(RuntimeWarning, match=r"ValueError: Input shapes should have .* K >= 16"):
        out = streaming.stream_attend(q, k, v, lw, qp, kp)
    _close(out, _dense(q, k, v, lw, qp, kp)[0])
