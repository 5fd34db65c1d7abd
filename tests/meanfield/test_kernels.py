"""The attention kernel: dense path against the independent naive reference, streaming path
against the dense path (forward, JVP, VJP, second order, torch.func), memory O(N), dispatch."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meanfield import kernels
from meanfield import streamed_attention as streaming
from meanfield.kernels import attend, use
from meanfield.streamed_attention import fused_attend, stream_attend
from tests.reference import dense_jacobian, dense_lipschitz, naive_attention

DT = torch.float64
TOL = 1e-10


def _close(a, b, tol=TOL):
    assert a.shape == b.shape
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


def _problem(seed, m=23, n=31, e=4, c=3, batch=(), weighted=True, masked=True, empty=True):
    """Random kernel inputs; ``empty`` adds zero-weight atoms and a query that sees no key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, m, e, generator=g, dtype=DT)
    k = torch.randn(n, e, generator=g, dtype=DT)
    v = torch.randn(*batch, n, c, generator=g, dtype=DT)
    lw = qp = kp = None
    if weighted:
        lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0)
        if empty:
            lw[[2, 5]] = -math.inf
    if masked:
        qp = torch.rand(*batch, m, generator=g, dtype=DT)
        kp = torch.rand(n, generator=g, dtype=DT).clamp(min=0.05)
        if empty:
            qp[..., 0] = 0.0  # before every key: a row with no visible key
    return q, k, v, lw, qp, kp


CASES = [
    dict(weighted=False, masked=False),
    dict(weighted=True, masked=False),
    dict(weighted=False, masked=True),
    dict(weighted=True, masked=True),
    dict(weighted=True, masked=True, batch=(2,)),
    dict(weighted=True, masked=False, batch=(2, 1)),
]
BLOCKS = [5, (4, 7), 64]


# ---------------------------------------------------------------- dense path: independent truth


@pytest.mark.parametrize("masked", [False, True])
def test_dense_self_attention_matches_naive_reference(masked):
    g = torch.Generator().manual_seed(0)
    n, d = 17, 3
    X, A, V = (torch.randn(*s, generator=g, dtype=DT) for s in [(n, d), (d, d), (d, d)])
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0)
    pos = torch.arange(1, n + 1, dtype=DT) / n
    qp, kp = (pos, pos) if masked else (None, None)
    _close(attend(X @ A.T, X, X @ V.T, lw, qp, kp), naive_attention(X, A, V, masked=masked, log_weights=lw))


def test_small_inputs_take_the_plain_dense_path_bit_for_bit():
    q, k, v, lw, qp, kp = _problem(1)
    expected = kernels.attention_probs(q, k, lw, qp, kp) @ v
    assert torch.equal(attend(q, k, v, lw, qp, kp), expected)
    X = torch.randn(5, 2, dtype=DT, requires_grad=True)
    y = attend(X, X, X)
    assert y.grad_fn is not None and "StreamAttention" not in type(y.grad_fn).__name__


def test_empty_rows_are_zero_on_both_paths():
    q, k, v, lw, qp, kp = _problem(2)
    for method in ["dense", "stream"]:
        out = attend(q, k, v, lw, qp, kp, method=method, block_size=4)
        assert torch.all(out[..., 0, :] == 0)
    _, lse = stream_attend(q, k, v, lw, qp, kp, block_size=4, return_lse=True)
    assert lse[..., 0].item() == -math.inf


# ---------------------------------------------------------------- streaming forward


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", BLOCKS)
def test_stream_forward_matches_dense(case, block):
    args = _problem(3, **case)
    _close(attend(*args, method="stream", block_size=block), attend(*args, method="dense"))


def test_stream_log_sum_exp_matches_torch_logsumexp():
    q, k, v, lw, qp, kp = _problem(4)
    s = (q @ k.T + lw).masked_fill(kp[None, :] > qp[:, None], -math.inf)
    _, lse = stream_attend(q, k, v, lw, qp, kp, block_size=(3, 8), return_lse=True)
    ref = torch.logsumexp(s, -1)
    empty = torch.isinf(ref)
    assert empty[0] and torch.equal(torch.isinf(lse), empty)
    _close(lse[~empty], ref[~empty])


def test_all_queries_of_a_block_masked_gives_zeros_and_zero_gradient():
    q, k, v, lw, qp, kp = _problem(5, masked=True, weighted=False, empty=False)
    qp = qp.clone()
    qp[:6] = 0.0
    kp = kp.clamp(min=0.01)
    q.requires_grad_(True)
    out = stream_attend(q, k, v, None, qp, kp, block_size=6)
    assert torch.all(out[:6] == 0)
    (g,) = torch.autograd.grad(out.sum(), q)
    assert torch.all(g[:6] == 0)
    _close(out, attend(q, k, v, None, qp, kp, method="dense"))


def test_large_scores_stay_finite_and_agree():
    g = torch.Generator().manual_seed(6)
    n, d = 40, 3
    X = torch.randn(n, d, generator=g, dtype=DT)
    X = 100 * X / X.norm(dim=-1, keepdim=True)  # radius 100: scores ~ 1e4
    pos = torch.arange(1, n + 1, dtype=DT) / n
    assert (X @ X.T).abs().max() > 5e3
    for qp in (None, pos):
        kp = None if qp is None else pos
        dense = attend(X, X, X, None, qp, kp, method="dense")
        _close(attend(X, X, X, None, qp, kp, method="stream", block_size=7), dense)
        _, t = torch.func.jvp(
            lambda Z, qp=qp, kp=kp: attend(Z, Z, Z, None, qp, kp, method="stream", block_size=7), (X,), (X,)
        )
        assert torch.isfinite(t).all()


def test_float32_within_its_precision():
    args = _problem(7, batch=(2,))
    args32 = [None if a is None else a.float() for a in args]
    out = attend(*args32, method="stream", block_size=6)
    assert out.dtype == torch.float32
    _close(out.double(), attend(*args, method="dense"), tol=1e-5)


# ---------------------------------------------------------------- derivatives


def _self_attention(method, A, V, lw, pos, block=(5, 6)):
    return lambda X: attend(X @ A.T, X, X @ V.T, lw, pos, pos, method=method, block_size=block)


def _sa_setup(seed, n=19, d=3, batch=(), masked=True):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(*batch, n, d, generator=g, dtype=DT)
    A, V = torch.randn(d, d, generator=g, dtype=DT), torch.randn(d, d, generator=g, dtype=DT)
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0)
    lw[3] = -math.inf
    pos = torch.arange(1, n + 1, dtype=DT) / n if masked else None
    U, W = torch.randn_like(X), torch.randn_like(X)
    return X, A, V, lw, pos, U, W


@pytest.mark.parametrize("masked", [False, True])
def test_stream_jacobian_matches_reference_jacobian_and_lipschitz(masked):
    X, A, V, lw, pos, _, _ = _sa_setup(8, masked=masked)
    f = _self_attention("stream", A, V, lw, pos, block=(7, 10))
    ref = lambda Z: naive_attention(Z, A, V, masked=masked, log_weights=lw)  # noqa: E731
    _close(dense_jacobian(f, X), dense_jacobian(ref, X))
    assert abs(dense_lipschitz(f, X) - dense_lipschitz(ref, X)) <= TOL * dense_lipschitz(ref, X)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_func_jvp_vjp_grad_match_dense(masked, batch):
    X, A, V, lw, pos, U, W = _sa_setup(9, batch=batch, masked=masked)
    fs, fd = _self_attention("stream", A, V, lw, pos), _self_attention("dense", A, V, lw, pos)
    ys, ts = torch.func.jvp(fs, (X,), (U,))
    yd, td = torch.func.jvp(fd, (X,), (U,))
    _close(ys, yd)
    _close(ts, td)
    _close(torch.func.vjp(fs, X)[1](W)[0], torch.func.vjp(fd, X)[1](W)[0])
    Xs = X.clone().requires_grad_(True)
    (gs,) = torch.autograd.grad((fs(Xs) * W).sum(), Xs)
    _close(gs, torch.func.vjp(fd, X)[1](W)[0])


def test_derivatives_in_every_kernel_argument():
    q, k, v, lw, qp, kp = _problem(10, batch=(2,))
    prim = (q, k, v, lw)
    tans = tuple(torch.randn_like(t).nan_to_num(0.0) for t in prim)

    def f(method):
        return lambda q, k, v, lw: attend(q, k, v, lw, qp, kp, method=method, block_size=(4, 9))

    _close(torch.func.jvp(f("stream"), prim, tans)[1], torch.func.jvp(f("dense"), prim, tans)[1])
    w = torch.randn(2, 23, 3, dtype=DT)
    for a, b in zip(torch.func.vjp(f("stream"), *prim)[1](w), torch.func.vjp(f("dense"), *prim)[1](w)):
        _close(a, b)
    for jac in (torch.func.jacrev, torch.func.jacfwd):
        for a, b in zip(jac(f("stream"), argnums=(0, 1, 2))(*prim), jac(f("dense"), argnums=(0, 1, 2))(*prim)):
            _close(a, b)


def test_vmap_over_batched_positions():
    q, k, v, lw, _, _ = _problem(11, batch=(3,), masked=False)
    P = torch.rand(3, 31, dtype=DT)

    def f(method):
        return torch.vmap(lambda q, v, p: attend(q, k, v, lw, p[:23], p, method=method, block_size=5))(q, v, P)

    _close(f("stream"), f("dense"))


@pytest.mark.parametrize("masked", [False, True])
def test_second_order_matches_dense(masked):
    X, A, V, lw, pos, U, W = _sa_setup(12, masked=masked)
    results = {}
    for method in ("dense", "stream"):
        f = _self_attention(method, A, V, lw, pos)
        Xr = X.clone().requires_grad_(True)
        (g,) = torch.autograd.grad((f(Xr) * W).sum(), Xr, create_graph=True)
        (hvp,) = torch.autograd.grad((g * U).sum(), Xr)
        fwd_rev = torch.func.jvp(lambda Z, f=f: torch.func.vjp(f, Z)[1](W)[0], (X,), (U,))[1]
        rev_fwd = torch.func.grad(lambda Z, f=f: (torch.func.jvp(f, (Z,), (U,))[1] * W).sum())(X)
        results[method] = (hvp, fwd_rev, rev_fwd)
    for a, b in zip(results["stream"], results["dense"]):
        _close(a, b)
    # the three second-order routes are the same bilinear form W^T D^2f [U, .]
    _close(results["dense"][1], results["dense"][0])
    _close(results["dense"][2], results["dense"][0])


# ---------------------------------------------------------------- memory O(N)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("masked", [False, True])
def test_stream_forward_backward_jvp_never_build_an_n_by_n_tensor(masked):
    n, d, block = 1024, 3, 128
    g = torch.Generator().manual_seed(13)
    X = torch.randn(n, d, generator=g, dtype=DT)
    lw = torch.full((n,), -math.log(n), dtype=DT)
    pos = torch.arange(1, n + 1, dtype=DT) / n if masked else None
    f = _self_attention("stream", torch.eye(d, dtype=DT), torch.eye(d, dtype=DT), lw, pos, block)
    with _LargestTensor() as probe:
        Xr = X.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(f(Xr).sum(), Xr)
        _, t = torch.func.jvp(f, (X,), (X,))
    assert torch.isfinite(gx).all() and torch.isfinite(t).all()
    assert probe.largest <= block * block, probe.largest  # one tile, far below n^2 = 1.05e6
    with _LargestTensor() as probe_dense:
        _self_attention("dense", torch.eye(d, dtype=DT), torch.eye(d, dtype=DT), lw, pos)(X)
    assert probe_dense.largest >= n * n  # the probe does see an (n, n) matrix when one is built


def test_auto_dispatch_streams_above_threshold():
    q, k, v, lw, qp, kp = _problem(14)
    with use(block_size=4, threshold=100), _LargestTensor() as probe:
        out = attend(q, k, v, lw, qp, kp)
    assert probe.largest < 23 * 31
    _close(out, attend(q, k, v, lw, qp, kp, method="dense"))
    with use(threshold=10**6), _LargestTensor() as probe:
        attend(q, k, v, lw, qp, kp)
    assert probe.largest >= 23 * 31
    assert kernels._DEFAULTS.get()[0] == "auto"


def test_use_context_sets_method_and_block_and_explicit_wins():
    q, k, v, lw, qp, kp = _problem(15)
    with use("stream", block_size=4), _LargestTensor() as probe:
        out = attend(q, k, v, lw, qp, kp)
        with use("dense"):
            assert torch.equal(attend(q, k, v, lw, qp, kp), kernels.attention_probs(q, k, lw, qp, kp) @ v)
        dense = attend(q, k, v, lw, qp, kp, method="dense")
    assert probe.largest >= 23 * 31  # the explicit dense call
    _close(out, dense)


# ---------------------------------------------------------------- fused (SDPA) path, math on CPU


@pytest.mark.parametrize("case", CASES)
def test_fused_sdpa_path_matches_dense(case):
    args = _problem(16, **case)
    _close(fused_attend(*args), attend(*args, method="dense"))
    _close(attend(*args, method="fused"), attend(*args, method="dense"))


@pytest.mark.parametrize("causal", [False, True])
def test_fused_sdpa_runs_batches_above_the_grid_limit_in_chunks(monkeypatch, causal):
    """CUDA's fused kernels take at most 65535 batch entries or heads (grid axes): larger batches go to SDPA in
    chunks of FUSED_BATCH_MAX entries (lowered to 2 here, over batches of 3 x 2), every chunk within it, with
    keys and log-weights shared across the batch; equal to the dense kernel."""
    q, k, v, lw, qp, kp = _problem(40, m=9, n=9, batch=(3, 2), masked=not causal)
    if causal:
        qp = kp = torch.arange(9, dtype=DT)
    monkeypatch.setattr(streaming, "FUSED_BATCH_MAX", 2)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda Q, *a, **kw: seen.append(Q.shape[0] * Q.shape[1]) or real(Q, *a, **kw))
    _close(fused_attend(q, k, v, lw, qp, kp), attend(q, k, v, lw, qp, kp, method="dense"))
    assert seen == [2, 2, 2]


@pytest.mark.parametrize("method", ["dense", "stream", "fused", "auto"])
def test_keys_shared_by_a_batch_of_queries_are_one_query_set_never_expanded(monkeypatch, method):
    """A batch of queries against one set of keys, values and weights (no positions) is computed as one set of
    b x m queries: the streamed and fused paths never see the keys expanded over the batch (which their kernels
    copied b times); values, gradients in q, k, v, log a and the JVP equal the dense kernel's per batch entry,
    the output shaped by broadcasting (keys with leading 1s)."""
    g = torch.Generator().manual_seed(41)
    q = torch.randn(3, 2, 5, 4, generator=g, dtype=DT, requires_grad=True)
    k = torch.randn(1, 1, 1, 7, 4, generator=g, dtype=DT, requires_grad=True)
    v = torch.randn(7, 3, generator=g, dtype=DT, requires_grad=True)
    lw = torch.log_softmax(torch.randn(7, generator=g, dtype=DT), 0)
    lw[2] = -math.inf
    lw.requires_grad_(True)
    seen = []
    for name in ("stream_attend", "fused_attend"):
        real = getattr(streaming, name)
        monkeypatch.setattr(streaming, name, lambda *a, real=real, **kw: seen.append(a[1].shape) or real(*a, **kw))
    out = attend(q, k, v, lw, method=method)
    assert out.shape == (1, 3, 2, 5, 3)
    if method == "stream":   # stream_attend called directly folds the batch the same way
        _close(stream_attend(q, k, v, lw), out)
    assert all(shape == (7, 4) for shape in seen) and (method in ("dense", "auto") or seen)
    ref = torch.stack([torch.stack([kernels.attention_probs(q[i, j], k[0, 0, 0], lw) @ v for j in range(2)])
                       for i in range(3)])
    _close(out[0], ref)
    w = torch.randn(out.shape, generator=g, dtype=DT)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, lw))
    want = torch.autograd.grad((ref * w[0]).sum(), (q, k, v, lw))
    for a, b in zip(got, want):
        _close(a[torch.isfinite(b)], b[torch.isfinite(b)])
    if method == "fused":
        return   # SDPA's CPU kernel has no forward-mode derivative
    tangents = [torch.randn(t.shape, generator=g, dtype=DT) for t in (q, k, v)]
    _, t_out = torch.func.jvp(lambda a, b, c: attend(a, b, c, lw.detach(), method=method),
                              (q.detach(), k.detach(), v.detach()), tuple(tangents))
    _, t_ref = torch.func.jvp(lambda a, b, c: attend(a, b.expand(3, 2, 7, 4), c, lw.detach(), method="dense"),
                              (q.detach(), k.detach()[0, 0, 0], v.detach()),
                              (tangents[0], tangents[1][0, 0, 0], tangents[2]))
    _close(t_out[0], t_ref)


@pytest.mark.parametrize("kind", ["none", "weighted", "positions", "sequence"])
def test_double_backward_of_a_function_of_the_output_matches_dense(kind):
    """The second derivative of a function of the output (a gradient penalty: |d/dq |out|^2|^2), whose first
    backward gets a cotangent computed from the output itself: through the streamed kernel as through the dense
    one, in q, k, v and log a, and against central finite differences. The streamed backward node followed the
    cotangent's dependence on the output twice (its JVP and the functional tiles) and doubled that part."""
    if kind == "sequence":
        q, k, v, lw, qp, kp = _sequence_problem(42, n=11, batch=(2,))
    else:
        q, k, v, lw, qp, kp = _problem(42, m=9, n=11, batch=(2,), weighted=kind != "none",
                                       masked=kind == "positions")

    def penalty(method, q_, k_, v_, lw_, create=True):
        out = attend(q_, k_, v_, lw_, qp, kp, method=method)
        (gq,) = torch.autograd.grad((out ** 2).sum(), (q_,), create_graph=create)
        return (gq ** 2).sum()

    grads = {}
    for method in ("stream", "dense"):
        prim = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        w = None if lw is None else lw.detach().clone().requires_grad_(True)
        wrt = prim + ([] if w is None else [w])
        grads[method] = torch.autograd.grad(penalty(method, *prim, w), wrt)
    assert not any(t.requires_grad for t in grads["stream"])   # no graph kept without create_graph
    for a, b in zip(grads["stream"], grads["dense"]):
        finite = torch.isfinite(b)
        _close(a[finite], b[finite])
    eps, E = 1e-6, torch.zeros_like(q)
    E[1, 3, 2] = 1.0
    f = lambda x: float(penalty("dense", x.requires_grad_(True), k, v, lw, create=False))
    fd = (f(q + eps * E) - f(q - eps * E)) / (2 * eps)
    assert abs(float(grads["stream"][0][1, 3, 2]) - fd) <= 1e-6 * max(1.0, abs(fd))


def _derivative_problem(kind):
    if kind == "sequence":
        return _sequence_problem(43, n=9, batch=(2,))
    return _problem(43, m=7, n=9, batch=(2,), weighted=kind != "none", masked=kind == "positions")


@pytest.mark.parametrize("engine", [None, "tiles"])
@pytest.mark.parametrize("kind", ["none", "weighted", "positions", "sequence"])
def test_third_derivative_through_gradients_of_functions_of_the_output_matches_dense(kind, engine):
    """Third order: h = d/dq sum sin(out), then d<h, U>/d(q, k, v, log a) with create_graph, then its inner
    product with W differentiated once more; the streamed kernel (CPU default and tile engines) as the dense one.
    Each order's cotangent depends on the output, which the backward node must keep attached."""
    q, k, v, lw, qp, kp = _derivative_problem(kind)
    g = torch.Generator().manual_seed(44)
    U, T = torch.randn(q.shape, generator=g, dtype=DT), torch.randn(q.shape, generator=g, dtype=DT)
    run = {"stream": lambda *a: stream_attend(*a, engine=engine), "dense": lambda *a: attend(*a, method="dense")}
    got = {}
    for name, f in run.items():
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        w = None if lw is None else lw.detach().clone().requires_grad_(True)
        wrt = x + ([] if w is None else [w])
        (h,) = torch.autograd.grad(f(*x, w, qp, kp).sin().sum(), (x[0],), create_graph=True)
        second = torch.autograd.grad((h * U).sum(), wrt, create_graph=True)
        got[name] = torch.autograd.grad((second[0] * T).sum(), wrt, allow_unused=True)
    for a, b in zip(got["stream"], got["dense"]):
        assert (a is None) == (b is None)
        if b is not None:
            finite = torch.isfinite(b)
            _close(a[finite], b[finite])


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("engine", [None, "tiles"])
@pytest.mark.parametrize("kind", ["none", "weighted", "positions", "sequence"])
def test_forward_mode_over_a_backward_pass_matches_dense(kind, engine, create_graph):
    """Forward-over-reverse (torch.autograd.forward_ad around torch.autograd.grad): the tangent of the gradient
    equals the dense kernel's. The fused CPU kernels have no forward-mode derivative and would drop or refuse the
    tangent; such a backward takes the functional tiles."""
    from torch.autograd import forward_ad

    q, k, v, lw, qp, kp = _derivative_problem(kind)
    g = torch.Generator().manual_seed(45)
    G = torch.randn(*q.shape[:-1], v.shape[-1], generator=g, dtype=DT)
    tans = [torch.randn(t.shape, generator=g, dtype=DT) for t in (q, k, v)]
    run = {"stream": lambda *a: stream_attend(*a, engine=engine), "dense": lambda *a: attend(*a, method="dense")}
    got = {}
    for name, f in run.items():
        with forward_ad.dual_level():
            x = [forward_ad.make_dual(t.detach().clone(), d).requires_grad_(True) for t, d in zip((q, k, v), tans)]
            out = f(*x, lw, qp, kp)
            grads = torch.autograd.grad((out * G).sum() + (out ** 2).sum(), x, create_graph=create_graph)
            got[name] = [forward_ad.unpack_dual(t).tangent for t in grads]
    for a, b in zip(got["stream"], got["dense"]):
        assert a is not None
        _close(a, b)


def test_vectorized_jacobians_and_batched_cotangents_match_dense():
    """torch.autograd.functional's vectorize=True (reverse and forward mode) and grad(..., is_grads_batched=True)
    hand the backward legacy batched tensors, which the in-place tile loops cannot take: the functional tiles."""
    from torch.autograd.functional import hessian, jacobian

    q, k, v, lw, qp, kp = _derivative_problem("positions")
    f = {m: (lambda x, m=m: attend(x, k, v, lw, qp, kp, method=m).sin().sum()) for m in ("stream", "dense")}
    J = {m: (lambda x, m=m: attend(x, k, v, lw, qp, kp, method=m)) for m in ("stream", "dense")}
    x = q[0].clone()
    _close(jacobian(J["stream"], x, vectorize=True), jacobian(J["dense"], x))
    _close(jacobian(J["stream"], x, vectorize=True, strategy="forward-mode"), jacobian(J["dense"], x))
    _close(hessian(f["stream"], x, vectorize=True), hessian(f["dense"], x))
    xs = q.detach().clone().requires_grad_(True)
    outs = {m: attend(xs, k, v, lw, qp, kp, method=m) for m in ("stream", "dense")}
    cot = torch.randn(3, *outs["dense"].shape, generator=torch.Generator().manual_seed(46), dtype=DT)
    got, want = (torch.autograd.grad(outs[m], xs, cot, is_grads_batched=True, retain_graph=True)[0]
                 for m in ("stream", "dense"))
    _close(got, want)


def test_the_same_tensor_as_queries_keys_and_values_has_the_dense_double_backward():
    """StreamAttention.apply(x, x, x): each argument's partial derivative goes to its own slot (before, the total
    derivative was returned for each, so counted three times)."""
    from meanfield import attention_tiles as tiles

    x0 = torch.randn(1, 6, 3, generator=torch.Generator().manual_seed(47), dtype=DT)
    plan = tiles.tile_plan(None, None, 6, 6, 4, 4)
    got = {}
    for name in ("stream", "dense"):
        x = x0.clone().requires_grad_(True)
        out = streaming.StreamAttention.apply(x, x, x, None, None, None, plan)[0] if name == "stream" else \
            attend(x, x, x, method="dense")
        (gx,) = torch.autograd.grad((out ** 2).sum(), (x,), create_graph=True)
        got[name] = torch.autograd.grad((gx ** 2).sum(), (x,))[0]
    _close(got["stream"], got["dense"])


# ---------------------------------------------------------------- bad input


def test_bad_input_is_rejected_with_the_argument_named():
    q, k, v, lw, qp, kp = _problem(17)
    with pytest.raises(ValueError, match="method"):
        attend(q, k, v, method="fast")
    with pytest.raises(ValueError, match="block_size"):
        attend(q, k, v, method="stream", block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        use("stream", block_size=(2, 0)).__enter__()
    with pytest.raises(ValueError, match="threshold"):
        use(threshold=-1).__enter__()
    with pytest.raises(ValueError, match="k_pos"):
        attend(q, k, v, q_pos=qp, method="stream")
    with pytest.raises(ValueError, match="log_weights"):
        attend(q, k, v, lw[:-1], method="stream")
    with pytest.raises(ValueError, match="v"):
        attend(q, k, v[:-1], method="stream")
    with pytest.raises(ValueError, match="k"):
        attend(q, k[:, :2], v, method="stream")
    with pytest.raises(TypeError, match="q"):
        stream_attend(q.numpy(), k, v)


# ---------------------------------------------------------------- engines of the streamed kernel, auto by regime


class _Ops(TorchDispatchMode):
    """Records the names of the aten ops that run."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


FLASH_FWD = "_scaled_dot_product_flash_attention_for_cpu"
FLASH_BWD = FLASH_FWD + "_backward"


def _sequence_problem(seed, n=37, e=4, c=3, batch=(), lw_kind="finite", dtype=DT):
    """Kernel inputs with the positions of a sequence (the causal mask) and log-weights of a kind."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, n, e, generator=g, dtype=dtype)
    k = torch.randn(*batch, n, e, generator=g, dtype=dtype)
    v = torch.randn(*batch, n, c, generator=g, dtype=dtype)
    lw = None
    if lw_kind != "none":
        lw = torch.log_softmax(torch.randn(n, generator=g, dtype=dtype), 0)
        if lw_kind == "prefix":   # the first queries see only zero-mass keys: empty rows
            lw[:4] = -math.inf
        if lw_kind == "holes":
            lw[[2, 9, 10]] = -math.inf
    pos = torch.arange(1, n + 1, dtype=dtype) / n
    return q, k, v, lw, pos, pos


SEQ_CASES = [dict(lw_kind="none"), dict(lw_kind="finite"), dict(lw_kind="prefix", batch=(2,)),
             dict(lw_kind="holes", batch=(2, 3), e=3, c=5), dict(lw_kind="finite", e=6, c=2)]


@pytest.mark.parametrize("case", SEQ_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_fused_kernel_engine_forward_and_lse_match_dense(case, masked):
    """On CPU the streamed forward runs in torch's flash kernel for unmasked and sequence-masked inputs;
    out and L agree with the dense kernel and torch.logsumexp, empty rows give 0 and -inf."""
    q, k, v, lw, qp, kp = _sequence_problem(20, **case)
    qp, kp = (qp, kp) if masked else (None, None)
    with _Ops() as ops:
        out, lse = stream_attend(q, k, v, lw, qp, kp, return_lse=True)
    assert FLASH_FWD in ops.names
    dense = attend(q, k, v, lw, qp, kp, method="dense")
    _close(out, dense)
    s = q @ k.transpose(-1, -2) + (0 if lw is None else lw)
    if masked:
        s = s.masked_fill(kp[None, :] > qp[:, None], -math.inf)
    ref = torch.logsumexp(s, -1)
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), empty) and torch.all(out[empty] == 0)
    _close(lse[~empty], ref[~empty])
    if case["lw_kind"] == "prefix" and masked:
        assert empty[..., :4].all() and not empty[..., 4:].any()


@pytest.mark.parametrize("case", SEQ_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_fast_vjp_uses_the_fused_backward_and_matches_dense(case, masked):
    """A first-order backward runs in the flash kernel's backward (the log-weights' gradient through
    the extra key coordinate), also under create_graph, where the backward is a node of its own whose
    derivatives (in the cotangent: the streamed JVP; in the inputs: the functional tiles) give exact
    second-order products. Everything agrees with the dense kernel's autograd."""
    q, k, v, lw, qp, kp = _sequence_problem(21, **case)
    qp, kp = (qp, kp) if masked else (None, None)
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(*q.shape[:-1], v.shape[-1], dtype=DT, generator=gen)
    inputs = [t for t in (q, k, v, lw) if t is not None]
    R = [torch.randn(t.shape, dtype=DT, generator=gen) for t in inputs]

    def grads(method, create_graph=False):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        w = W.clone().requires_grad_(create_graph)
        lw_ = leaves[3] if lw is not None else None
        out = attend(leaves[0], leaves[1], leaves[2], lw_, qp, kp, method=method)
        first = torch.autograd.grad((out * w).sum(), leaves, create_graph=create_graph)
        if not create_graph:
            return first, None
        # second order: in the inputs (a Hessian-vector product) and in the cotangent (J r)
        form = sum((g.nan_to_num(0.0) * r).sum() for g, r in zip(first, R))
        return first, torch.autograd.grad(form, leaves + [w], allow_unused=True)

    clean = lambda ts: [None if t is None else t.nan_to_num(0.0) for t in ts]  # zero-mass keys: nan in dense
    dense, dense2 = grads("dense", create_graph=True)
    with _Ops() as ops:
        fast, _ = grads("stream")
    assert FLASH_BWD in ops.names
    with _Ops() as ops:
        graph, second = grads("stream", create_graph=True)
    assert FLASH_BWD in ops.names
    for a, ref in zip(list(fast) + list(graph) + clean(second), clean(dense) * 2 + clean(dense2)):
        if ref is None:
            assert a is None or torch.all(a == 0)
        else:
            _close(a, ref)


@pytest.mark.parametrize("masked", ["none", "sequence", "arbitrary"])
def test_forward_ad_takes_the_in_place_jvp_and_matches_dense(masked, monkeypatch):
    """torch.autograd.forward_ad reaches the in-place tile JVP; torch.func.jvp the differentiable one;
    both equal the dense kernel's forward-mode derivative."""
    from torch.autograd import forward_ad

    from meanfield import attention_tiles

    if masked == "arbitrary":
        q, k, v, lw, qp, kp = _problem(22, m=40, n=40, empty=False)
    else:
        q, k, v, lw, qp, kp = _sequence_problem(22, n=40)
        qp, kp = (qp, kp) if masked == "sequence" else (None, None)
    tans = [torch.randn_like(t) for t in (q, k, v, lw)]
    calls = []
    jvp_tiles = attention_tiles.jvp_tiles
    monkeypatch.setattr(attention_tiles, "jvp_tiles", lambda *a, **kw: calls.append(1) or jvp_tiles(*a, **kw))
    f = lambda method: (lambda q, k, v, lw: attend(q, k, v, lw, qp, kp, method=method, block_size=(16, 12)))
    ref = torch.func.jvp(f("dense"), (q, k, v, lw), tuple(tans))[1]
    func = torch.func.jvp(f("stream"), (q, k, v, lw), tuple(tans))[1]
    assert not calls
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(p, t) for p, t in zip((q, k, v, lw), tans)]
        fwd = forward_ad.unpack_dual(f("stream")(*duals)).tangent
    assert calls
    _close(func, ref)
    _close(fwd, ref)




FOLD_CASES = [("arbitrary", c) for c in CASES] + [("sequence", c) for c in SEQ_CASES]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_integer_positions_give_the_tile_plan_of_float_positions(dtype):
    """The streamed kernel's mask layout from integer positions (a sequence's causal mask: skipped tiles and the
    causal flag that sends it to the fused kernels; arbitrary positions: the tiles to visit) equals the one from
    the same positions as floats; before, padding the last block with +-inf failed on integers and every tile
    was visited and masked."""
    from meanfield import attention_tiles as tiles

    seq = torch.arange(3, 40).expand(2, -1)
    g = torch.Generator().manual_seed(3)
    qp, kp = torch.randint(0, 50, (2, 37), generator=g), torch.randint(0, 50, (2, 37), generator=g)
    for a, b in ((seq, seq), (qp, kp)):
        got = tiles.tile_plan(a.to(dtype), b.to(dtype), 37, 37, 8, 6, engine="tiles")
        want = tiles.tile_plan(a.double(), b.double(), 37, 37, 8, 6, engine="tiles")
        assert got == want and got.tiles is not None
    assert tiles.tile_plan(seq.to(dtype), seq.to(dtype), 37, 37, 8, 6).causal


@pytest.mark.parametrize("kind,case", FOLD_CASES)
@pytest.mark.parametrize("block", [(5, 7), (8, None)])
def test_folded_tile_loops_match_dense(kind, case, block):
    """The accelerators' regrouped tile loops (``fold``: s - L, ds with d(log a) and the row sums each as one
    product) against the dense kernel's forward-mode and reverse-mode derivatives in every argument, with
    cotangents on out and L, rows that see no key, zero weights and a causal sequence."""
    from meanfield import attention_tiles as tiles

    if kind == "arbitrary":
        q, k, v, lw, qp, kp = _problem(41, **case)
    else:
        q, k, v, lw, qp, kp = _sequence_problem(41, **case)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q3, k3, v3 = (t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:]).clone() for t in (q, k, v))
    B, m, n = q3.shape[0], q3.shape[1], k3.shape[1]
    flat = lambda t: None if t is None else t.expand(*batch, t.shape[-1]).reshape(B, -1).clone()
    lw3, qp3, kp3 = flat(lw), flat(qp), flat(kp)
    plan = tiles.tile_plan(qp3, kp3, m, n, block[0], block[1] or n, engine="tiles")
    out, lse = tiles.forward_tiles(q3, k3, v3, lw3, qp3, kp3, plan)
    g = torch.Generator().manual_seed(5)
    tans = [torch.randn(t.shape, generator=g, dtype=DT) for t in (q3, k3, v3)]
    tlw = None if lw3 is None else torch.randn(lw3.shape, generator=g, dtype=DT)

    def dense(a, b, c, w):
        s = a @ b.transpose(-1, -2) + (0 if w is None else w[:, None, :])
        if qp3 is not None:
            s = s.masked_fill(kp3[:, None, :] > qp3[:, :, None], -math.inf)
        L = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isfinite(L), L, 0)[..., None])
        return torch.where(torch.isfinite(L)[..., None], p @ c, 0), torch.where(torch.isfinite(L), L, 0)

    prim = (q3, k3, v3) + (() if lw3 is None else (lw3,))
    ref_out, ref_L = torch.func.jvp(lambda *a: dense(*a, *([None] if lw3 is None else [])), prim,
                                    tuple(tans) + (() if tlw is None else (tlw,)))[1]
    for fold in (True, False):
        d_out, d_L = tiles.jvp_tiles(q3, k3, v3, lw3, qp3, kp3, out, lse, *tans, tlw, plan, fold=fold)
        live = torch.isfinite(lse)
        _close(d_out, torch.nan_to_num(ref_out))
        _close(torch.where(live, d_L, 0), torch.where(live, torch.nan_to_num(ref_L), 0))
    g_out, g_L = torch.randn(out.shape, generator=g, dtype=DT), torch.randn(lse.shape, generator=g, dtype=DT)
    g_L = torch.where(torch.isfinite(lse), g_L, 0)
    _, vjp = torch.func.vjp(lambda *a: dense(*a, *([None] if lw3 is None else [])), *prim)
    ref = vjp((g_out, g_L))
    need = (True, True, True, lw3 is not None)
    for fold in (True, False):
        got = tiles.backward_tiles(q3, k3, v3, lw3, qp3, kp3, out, lse, g_out, g_L, plan, need, fold=fold)
        for a, b in zip(got, ref):
            _close(a, torch.nan_to_num(torch.where(torch.isfinite(b), b, 0)))


def test_tile_loops_without_the_fused_kernel_match_dense(monkeypatch):
    """The Python tile loops (what runs on other devices, or for arbitrary masks) on the cases the flash
    kernel would otherwise take: forward, fast VJP, fast JVP against the dense kernel."""
    from torch.autograd import forward_ad

    from meanfield import flash_cpu

    monkeypatch.setattr(flash_cpu, "FORWARD", None)
    monkeypatch.setattr(flash_cpu, "BACKWARD", None)
    for case in SEQ_CASES:
        q, k, v, lw, qp, kp = _sequence_problem(23, **case)
        with _Ops() as ops:
            out = attend(q, k, v, lw, qp, kp, method="stream", block_size=(8, 16))
        assert FLASH_FWD not in ops.names
        _close(out, attend(q, k, v, lw, qp, kp, method="dense"))
        qr = q.clone().requires_grad_(True)
        W = torch.randn_like(out)
        (gs,) = torch.autograd.grad((attend(qr, k, v, lw, qp, kp, method="stream", block_size=(8, 16)) * W).sum(), qr)
        (gd,) = torch.autograd.grad((attend(qr, k, v, lw, qp, kp, method="dense") * W).sum(), qr)
        _close(gs, gd)
        tq = torch.randn_like(q)
        with forward_ad.dual_level():
            t = forward_ad.unpack_dual(attend(forward_ad.make_dual(q, tq), k, v, lw, qp, kp, method="stream",
                                              block_size=(8, 16))).tangent
        dense = lambda z, k=k, v=v, lw=lw, qp=qp, kp=kp: attend(z, k, v, lw, qp, kp, method="dense")
        _close(t, torch.func.jvp(dense, (q,), (tq,))[1])


@pytest.mark.parametrize("case", SEQ_CASES)
def test_causal_tile_loops_with_row_blocks_against_all_keys_stop_at_the_diagonal(case, monkeypatch):
    """The accelerators' layout (row blocks against all keys: one key block) under a sequence's causal mask:
    forward, VJP (every input) and JVP equal the dense kernel's, and each row block scores only the keys up
    to its last row, about half of the n^2 entries (the keys beyond are masked for every one of its rows)."""
    from meanfield import attention_tiles

    q, k, v, lw, qp, kp = _sequence_problem(29, **case)
    n, bq = q.shape[-2], 8
    entries = []
    real_score_tile = attention_tiles.score_tile

    def counting(qa, kT, lwT, qpa, kp_, j0, j1, mask, out=None):
        entries.append(qa.shape[-2] * (j1 - j0))
        return real_score_tile(qa, kT, lwT, qpa, kp_, j0, j1, mask, out)

    monkeypatch.setattr(attention_tiles, "score_tile", counting)
    run = lambda *a: stream_attend(*a, block_size=(bq, n), engine="tiles")
    _close(run(q, k, v, lw, qp, kp), attend(q, k, v, lw, qp, kp, method="dense"))
    # the row block [i0, i1) scores the keys [0, i1): sum over blocks of (i1 - i0) * i1, about n^2 / 2
    assert sum(entries) == sum((min(i0 + bq, n) - i0) * min(i0 + bq, n) for i0 in range(0, n, bq))
    assert sum(entries) < 0.65 * n * n
    prims = [t.clone().requires_grad_(True) for t in (q, k, v)]
    prims.append(None if lw is None else lw.clone().requires_grad_(True))
    W = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((run(*prims[:3], prims[3], qp, kp) * W).sum(), [p for p in prims if p is not None])
    ref = torch.autograd.grad((attend(*prims[:3], prims[3], qp, kp, method="dense") * W).sum(),
                              [p for p in prims if p is not None])
    for a, b in zip(got, ref):
        _close(a, b)
    from torch.autograd import forward_ad

    tq = torch.randn_like(q)
    with forward_ad.dual_level():
        t = forward_ad.unpack_dual(run(forward_ad.make_dual(q, tq), k, v, lw, qp, kp)).tangent
    dense = lambda z: attend(z, k, v, lw, qp, kp, method="dense")
    _close(t, torch.func.jvp(dense, (q,), (tq,))[1])


@pytest.mark.parametrize("block_size", [(8, None), (4, 2), (2, 4), (3, 5)])
def test_causal_tile_loops_with_a_batch_of_sequences_at_other_offsets(block_size):
    """A batch of sequences whose positions differ by an offset per entry (each a causal mask): the plan's
    block extremes are taken over the whole batch, so it can visit key blocks wholly above a row block's
    diagonal, which the trimmed key range makes empty. Forward, VJP and JVP against the dense kernel."""
    from torch.autograd import forward_ad

    g = torch.Generator().manual_seed(41)
    B, n = 3, 19
    q, k = torch.randn(B, n, 4, generator=g, dtype=DT), torch.randn(B, n, 4, generator=g, dtype=DT)
    v = torch.randn(B, n, 2, generator=g, dtype=DT)
    pos = torch.arange(n, dtype=DT) + torch.tensor([[0.0], [7.0], [-3.5]], dtype=DT)
    bs = (block_size[0], n if block_size[1] is None else block_size[1])
    run = lambda a, b, c: stream_attend(a, b, c, None, pos, pos, block_size=bs, engine="tiles")
    dense = lambda a, b, c: attend(a, b, c, None, pos, pos, method="dense")
    _close(run(q, k, v), dense(q, k, v))
    prims = [t.clone().requires_grad_(True) for t in (q, k, v)]
    W = torch.randn(B, n, 2, generator=g, dtype=DT)
    got = torch.autograd.grad((run(*prims) * W).sum(), prims)
    for a, b in zip(got, torch.autograd.grad((dense(*prims) * W).sum(), prims)):
        _close(a, b)
    tans = [torch.randn_like(t) for t in (q, k, v)]
    with forward_ad.dual_level():
        t = forward_ad.unpack_dual(run(*[forward_ad.make_dual(p, d) for p, d in zip((q, k, v), tans)])).tangent
    _close(t, torch.func.jvp(dense, (q, k, v), tuple(tans))[1])


def test_sequence_mask_recognises_only_the_causal_mask_of_a_sequence():
    from meanfield.streamed_attention import sequence_mask

    pos = torch.arange(1, 9, dtype=DT) / 8
    assert sequence_mask(pos, pos) and sequence_mask(pos.expand(2, 8), pos)
    ties = torch.tensor([0.1, 0.2, 0.2, 0.5], dtype=DT)
    assert not sequence_mask(ties, ties)                         # ties: a block-causal mask
    assert not sequence_mask(pos, pos.flip(0))                   # different query positions
    assert not sequence_mask(None, None) and not sequence_mask(pos, pos[:-1])


def test_auto_dispatch_by_regime_and_results_equal_dense():
    """kernels.choose: dense while small; fused for forward passes without positions or with a
    sequence's causal mask, and for arbitrary masks while their explicit mask is small; streamed for
    larger arbitrary masks and wherever derivatives are needed (above the threshold of the derivative
    regime); use(threshold=) overrides every regime."""
    from meanfield.kernels import FUSED_THRESHOLD, STREAM_THRESHOLD, TRANSFORM_STREAM_THRESHOLD, choose

    n = 300                              # 9e4 score entries: above FUSED_ and STREAM_THRESHOLD
    assert FUSED_THRESHOLD < n * n and STREAM_THRESHOLD < n * n < 2 * TRANSFORM_STREAM_THRESHOLD
    q, k, v, lw, pos, _ = _sequence_problem(24, n=n)
    arbitrary = torch.rand(n, dtype=DT, generator=torch.Generator().manual_seed(2))
    small = (q[:50], k[:50], v[:50], lw[:50])
    assert choose(*small) == "dense" and choose(*small, pos[:50], pos[:50]) == "dense"
    assert choose(q, k, v) == "fused" and choose(q, k, v, lw) == "fused"
    assert choose(q, k, v, lw, pos, pos) == "fused"
    assert choose(q, k, v, lw, arbitrary, arbitrary) == "fused"      # an explicit mask of 9e4 bytes
    big = torch.zeros(2100, 4, dtype=DT)
    ties = torch.arange(2100, dtype=DT) // 2                              # 4.4e6 entries: streamed
    assert choose(big, big, big, None, ties, ties) == "stream"
    assert choose(q.requires_grad_(True), k, v) == "stream"
    with torch.no_grad():
        assert choose(q, k, v) == "fused"
    q = q.detach()
    seen = []
    torch.func.jvp(lambda z: seen.append(choose(z, k, v)) or z, (q,), (q,))
    torch.func.jvp(lambda z: seen.append(choose(z[:200], k[:200], v[:200])) or z, (q,), (q,))
    assert seen == ["stream", "dense"]   # 9e4 > TRANSFORM_STREAM_THRESHOLD > 4e4
    with use(threshold=10**6):
        assert choose(q, k, v) == "dense" and choose(q, k, v, lw, arbitrary, arbitrary) == "dense"
    with use(threshold=0):
        assert choose(q, k, v) == "fused" and choose(q, k, v, lw, arbitrary, arbitrary) == "stream"
    for args in [(q, k, v), (q, k, v, lw), (q, k, v, lw, pos, pos), (q, k, v, lw, arbitrary, arbitrary)]:
        _close(attend(*args), attend(*args, method="dense"))


@pytest.mark.parametrize("lw_kind", ["none", "finite", "prefix"])
def test_fused_path_is_linear_in_memory_for_sequences_and_weights(lw_kind):
    """The fused path never materializes an (m, n) mask for log-weights or a sequence's causal mask
    (is_causal, a broadcast mask row); with arbitrary positions it does (documented)."""
    n = 400
    q, k, v, lw, pos, _ = _sequence_problem(25, n=n, lw_kind=lw_kind)
    for qp in (None, pos):
        with _LargestTensor() as probe:
            out = fused_attend(q, k, v, lw, qp, qp)
        assert probe.largest < n * n / 10, probe.largest
        _close(out, attend(q, k, v, lw, qp, qp, method="dense"))
    arbitrary = torch.rand(n, dtype=DT, generator=torch.Generator().manual_seed(3))
    with _LargestTensor() as probe:
        fused_attend(q, k, v, lw, arbitrary, arbitrary)
    assert probe.largest >= n * n


def test_every_row_empty_gives_zeros_and_zero_gradients():
    q, k, v, _, pos, _ = _sequence_problem(26, n=30)
    lw = torch.full((30,), -math.inf, dtype=DT)
    for method in ("dense", "fused", "stream"):
        for qp in (None, pos):
            qr = q.clone().requires_grad_(True)
            out = attend(qr, k, v, lw, qp, qp, method=method)
            assert torch.all(out == 0)
            if method != "fused":
                (g,) = torch.autograd.grad(out.sum(), qr)
                assert torch.all(g.nan_to_num(0.0) == 0)


def test_mixed_dtypes_name_the_arguments_and_the_fix():
    q = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"q, k, v: .*float32.*\.to\(dtype\)"):
        kernels.attend(q, q.float(), q)
    with pytest.raises(TypeError, match="log_weights: expected dtype torch.float64"):
        kernels.attend(q, q, q, torch.zeros(4, dtype=torch.float32))


def test_use_accepts_numpy_integers():
    import numpy as np

    q = torch.randn(6, 3, dtype=torch.float64)
    want = kernels.attend(q, q, q, method="dense")
    with kernels.use("stream", block_size=np.int64(2), threshold=np.int32(0)):
        got = kernels.attend(q, q, q)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-13)
    with pytest.raises(ValueError, match="threshold"):
        with kernels.use(threshold=np.float64(1.0)):
            pass


def test_output_checks_deferred_skips_the_finiteness_check_only_inside_and_simulate_still_stops():
    """Inside particles.validation.output_checks_deferred the kernel returns a non-finite output instead of
    raising (its caller checks); outside, and after an exception inside, the check is back. simulate defers
    the checks of its velocity evaluations and still stops with a FloatingPointError at a blow-up."""
    from meanfield import SelfAttention, simulate
    from particles import Measure
    from particles.validation import output_checks_are_deferred, output_checks_deferred

    q = torch.tensor([[1e308, 0.0]], dtype=DT)
    k = torch.tensor([[1e308, 0.0], [0.0, 1.0]], dtype=DT)
    v = torch.tensor([[1.0], [2.0]], dtype=DT)
    with pytest.raises(FloatingPointError):
        attend(q, k, v, method="dense")
    with output_checks_deferred():
        assert output_checks_are_deferred()
        out = attend(q, k, v, method="dense")
    assert not bool(torch.isfinite(out).all()) and not output_checks_are_deferred()
    with pytest.raises(RuntimeError, match="inside"):
        with output_checks_deferred():
            raise RuntimeError("inside")
    assert not output_checks_are_deferred()
    with pytest.raises(FloatingPointError):
        attend(q, k, v, method="dense")
    op = SelfAttention(50 * torch.eye(3, dtype=DT), 50 * torch.eye(3, dtype=DT))
    X = 10 * torch.randn(6, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    with pytest.raises(FloatingPointError, match=r"left the floating-point range at t = "):
        simulate(op, Measure(X), 1000.0, method="rk4", options={"steps": 100})
    pytest.importorskip("torchdiffeq")
    # adaptive solvers keep the checks (a NaN velocity would shrink their steps to an underflow instead)
    with pytest.raises(FloatingPointError, match=r"left the floating-point range at t = "):
        simulate(op, Measure(X), 10.0, method="dopri5")


@pytest.mark.slow
def test_an_adaptive_solver_stops_at_a_blow_up_with_a_floating_point_error():
    """bosh3, whose error estimate, fed a NaN velocity, shrank its steps to an underflow (RuntimeError) when
    the output checks were deferred for every method (20 s: many small steps before the blow-up)."""
    pytest.importorskip("torchdiffeq")
    from meanfield import SelfAttention, simulate
    from particles import Measure

    op = SelfAttention(50 * torch.eye(3, dtype=DT), 50 * torch.eye(3, dtype=DT))
    X = 10 * torch.randn(6, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    with pytest.raises(FloatingPointError, match=r"left the floating-point range at t = "):
        simulate(op, Measure(X), 10.0, method="bosh3")


@pytest.mark.parametrize("weighted", [False, True])
def test_scores_that_all_overflow_to_minus_inf_are_reported_with_or_without_weights(weighted):
    """A row whose scores all overflow to -inf is an overflow (FloatingPointError from attend), not a row
    that sees no key: only the mask and the weights decide those (zeros). Both dense paths agree."""
    from meanfield.kernels import attention_probs

    q = torch.tensor([[1e20, 0.0], [1.0, 0.0]], dtype=torch.float32)
    k = torch.tensor([[-1e20, 0.0], [-2e20, 0.0]], dtype=torch.float32)
    v = torch.tensor([[1.0], [2.0]], dtype=torch.float32)
    lw = torch.log(torch.tensor([0.5, 0.5])) if weighted else None
    assert torch.isnan(attention_probs(q, k, lw)[0]).all()
    with pytest.raises(FloatingPointError, match="not finite"):
        attend(q, k, v, lw, method="dense")
    # a row that sees only zero-weight keys, or none at all, is zeros (and so are its derivatives)
    qq = torch.randn(3, 2, dtype=DT, requires_grad=True)
    kk = torch.randn(4, 2, dtype=DT)
    lw2 = torch.tensor([-math.inf, -math.inf, 0.0, 0.0], dtype=DT)
    qp, kp = torch.tensor([-1.0, 1.0, 3.0], dtype=DT), torch.arange(4, dtype=DT)
    P = attention_probs(qq, kk, lw2, qp, kp)
    assert torch.equal(P[:2], torch.zeros(2, 4, dtype=DT))
    assert torch.allclose(P[2].sum(), torch.tensor(1.0, dtype=DT))
    (g,) = torch.autograd.grad(P.sum() + (P * torch.arange(12.0, dtype=DT).reshape(3, 4)).sum(), qq)
    assert torch.isfinite(g).all() and torch.equal(g[:2], torch.zeros(2, 2, dtype=DT))


@pytest.mark.parametrize("method", ["dense", "stream", "fused", "auto"])
def test_a_batch_without_queries_gives_an_empty_output_on_every_path(method):
    """No queries (m = 0) in a batch of two: an empty (2, 0, c) output and zero gradients, as the dense path."""
    q = torch.randn(2, 0, 3, dtype=DT, requires_grad=True)
    k = torch.randn(2, 5, 3, dtype=DT, requires_grad=True)
    v = torch.randn(2, 5, 4, dtype=DT)
    out = attend(q, k, v, method=method)
    assert out.shape == (2, 0, 4)
    gq, gk = torch.autograd.grad(out.sum(), (q, k), allow_unused=True)
    assert gk is None or torch.equal(gk, torch.zeros_like(k))
    assert gq is None or gq.shape == q.shape


def test_record_paths_sees_the_path_each_call_ran():
    """kernels.record_paths lists the path every attend call ran, in order, as the outputs show: the dense path's
    output is the written-out formula's; a batch with shared keys (one inner call) is recorded once; calls outside
    the context, or in an inner context, are not recorded in the outer list."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(300, 3, generator=g, dtype=torch.float64)
    small = q[:5]
    with kernels.record_paths() as ran:
        out = kernels.attend(small, small, small)
        kernels.attend(q, q, q)                                   # above the fused threshold, no derivatives
        kernels.attend(q.clone().requires_grad_(True), q, q)      # derivatives: streamed
        kernels.attend(q, q, q, method="stream")
        kernels.attend(torch.stack([small, small]), small, small)   # shared keys: one call
        with kernels.record_paths() as inner:
            kernels.attend(small, small, small, method="fused")
    kernels.attend(small, small, small)
    assert ran == ["dense", "fused", "stream", "stream", "dense"] and inner == ["fused"]
    torch.testing.assert_close(out, torch.softmax(small @ small.T, -1) @ small, rtol=1e-13, atol=1e-13)


class _Syncs(TorchDispatchMode):
    """Counts the aten ops that run and the host syncs among them (a tensor read into Python: float(), bool(),
    .item() dispatch ``_local_scalar_dense``): on a GPU each sync waits for every queued kernel."""

    def __init__(self):
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.syncs += func.overloadpacket.__name__ == "_local_scalar_dense"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["none", "weighted", "sequence", "random positions"])
def test_dense_path_reads_the_device_once_or_twice(case):
    """The dense path's output check is one sum read once (one host sync), also where queries have positions of
    their own (random positions: about half of them see no key), whose rows are set at once (they were found by a
    first check and set and checked with a second sync). The result equals the probabilities of attention_probs
    times v. (With random positions the check took 40 aten ops, 3 isfinite and 2 logical reductions among them;
    the host cost of a small call on a GPU is about one launch per op.)"""
    n = 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 3, generator=g, dtype=DT) for _ in range(3))
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0) if case == "weighted" else None
    qp = kp = None
    if case == "sequence":
        qp = kp = torch.arange(1, n + 1, dtype=DT) / n
    elif case == "random positions":
        qp, kp = torch.rand(n, generator=g, dtype=DT), torch.rand(n, generator=g, dtype=DT)
    with _Syncs() as count:
        out = attend(q, k, v, lw, qp, kp, method="dense")
    assert count.syncs == 1, count.syncs
    assert count.ops <= 30, count.ops
    _close(out, kernels.attention_probs(q, k, lw, qp, kp) @ v)


def _reference_rows(q, k, v, lw, qp, kp):
    """Row by row from the definition (independent of the kernels): P_ij = exp(s_ij) / sum over the visible keys
    of positive weight, 0 for the others; out_i = sum_j P_ij v_j over all keys (a row that sees no key is
    sum_j 0 * v_j: zeros, NaN in a column where v holds a NaN or an infinity)."""
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                  *(t.shape[:-1] for t in (lw, qp, kp) if t is not None))
    flat = lambda t, tail: t.expand(*lead, *t.shape[t.dim() - tail:]).reshape(-1, *t.shape[t.dim() - tail:])
    Q, K, Vv = flat(q, 2), flat(k, 2), flat(v, 2)
    LW = None if lw is None else flat(lw, 1)
    QP, KP = (None, None) if qp is None else (flat(qp, 1), flat(kp, 1))
    out = torch.empty(Q.shape[0], Q.shape[1], Vv.shape[-1], dtype=q.dtype)
    for b in range(Q.shape[0]):
        for i in range(Q.shape[1]):
            keep = torch.ones(K.shape[1], dtype=torch.bool)
            if LW is not None:
                keep &= LW[b] != -math.inf
            if QP is not None:
                keep &= KP[b] <= QP[b, i]
            p = torch.zeros(K.shape[1], dtype=q.dtype)
            if keep.any():
                s = K[b][keep] @ Q[b, i] + (0 if LW is None else LW[b][keep])
                p[keep] = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
            out[b, i] = (p[:, None] * Vv[b]).sum(0)
    return out.reshape(*lead, Q.shape[1], Vv.shape[-1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("method", ["dense", "auto"])
@pytest.mark.parametrize("empty", [True, False], ids=["rows-that-see-no-key", "every-row-sees-a-key"])
def test_deferred_checks_give_the_checked_output_with_rows_that_see_no_key(case, method, empty):
    """Inside output_checks_deferred (simulate's fixed steps) a forward pass takes the plain softmax and sets the
    rows that see no key of positive weight from O(m + n) reductions, instead of attention_probs's guarded formula:
    the same numbers as outside (where the output check decides) and as the row-by-row definition."""
    from particles.validation import output_checks_deferred

    q, k, v, lw, qp, kp = _problem(7, **case, empty=empty)
    if not empty and qp is not None:
        qp = qp.clamp(min=float(kp.min()))     # every query sees a key
    want = _reference_rows(q, k, v, lw, qp, kp)
    checked = attend(q, k, v, lw, qp, kp, method=method)
    with output_checks_deferred():
        deferred = attend(q, k, v, lw, qp, kp, method=method)
    _close(deferred, want)
    _close(checked, want)


def test_deferred_checks_keep_nan_columns_of_rows_that_see_no_key():
    """A row that sees no key is 0 @ v: an infinite value (of a key nobody sees) makes its column NaN there, with
    the check deferred, as in the guarded formula (and in every other row: 0 * inf), while every other column
    stays what the definition gives."""
    from particles.validation import output_checks_deferred

    q, k, v, lw, qp, kp = _problem(8, weighted=True, masked=True)
    v, kp = v.clone(), kp.clone()
    late = int(torch.argmax(kp))
    kp[late] = 2.0                       # after every query: visible to none
    v[late, 1] = math.inf
    want = _reference_rows(q, k, v, lw, qp, kp)
    dead = (_reference_rows(q, k, torch.ones_like(v), lw, qp, kp) == 0).all(-1)
    assert dead.any() and (~dead).any()
    for method in ("dense", "auto"):
        with output_checks_deferred():
            got = attend(q, k, v, lw, qp, kp, method=method)
        assert torch.isnan(got[:, 1]).all() and torch.isnan(want[:, 1]).all()
        assert torch.all(got[dead][:, [0, 2]] == 0)
        _close(got[:, [0, 2]], want[:, [0, 2]])


def test_every_weight_zero_makes_every_row_dead_even_a_query_at_infinity():
    """All weights zero and a query at +inf: the guarded formula gives 0 on every row; with checks deferred the rows
    that see no key were decided by positions only and the +inf query's row came back NaN (found by an independent
    review)."""
    from particles.validation import output_checks_deferred

    q, k, v, _, _, kp = _problem(9, weighted=True, masked=True)
    lw = torch.full((k.shape[0],), -math.inf, dtype=DT)
    qp = torch.full((q.shape[0],), math.inf, dtype=DT)
    with output_checks_deferred():
        out = attend(q, k, v, lw, qp, kp, method="dense")
    assert torch.all(out == 0)
    assert torch.all(kernels.attention_probs(q, k, lw, qp, kp) == 0)


def test_the_memory_limit_reads_the_default_at_every_call(monkeypatch):
    """The variable's text is parsed once, and DEFAULT_MEMORY_LIMIT read at every call: a program that raises it after
    a first call gets the new value (the cached parse had kept 8 GiB; found by an independent review)."""
    from particles import validation

    monkeypatch.delenv(validation.MEMORY_LIMIT_ENV, raising=False)
    assert validation.memory_limit() == validation.DEFAULT_MEMORY_LIMIT
    monkeypatch.setattr(validation, "DEFAULT_MEMORY_LIMIT", 32 * 2**30)
    assert validation.memory_limit() == 32 * 2**30
    monkeypatch.setenv(validation.MEMORY_LIMIT_ENV, "1M")
    assert validation.memory_limit() == 2**20


def test_a_deferred_pass_reads_its_sum_only_where_that_is_cheaper_than_setting_the_rows_that_see_no_key():
    """Inside output_checks_deferred, a forward pass on an accelerator reads one sum (a host sync) only for a call
    bound by its launches whose queries see their own keys: measured on an H200 at N = 1e3, the sum read took 210 us
    against 311 us for the reductions that set the rows. Meta tensors stand in for an accelerator: a pass that reads
    a sum from them fails, one that does not returns an output of the right shape."""
    from particles.validation import output_checks_deferred

    def meta_problem(n, positions):
        q, k, v = (torch.empty(n, 3, device="meta") for _ in range(3))
        lw = torch.empty(n, device="meta")
        qp = kp = None
        if positions == "shared":
            qp = kp = torch.empty(n, device="meta")
        elif positions == "own":
            qp, kp = torch.empty(n, device="meta"), torch.empty(n, device="meta")
        return q, k, v, lw, qp, kp

    edge = math.isqrt(kernels.SUM_FIRST_ENTRIES)      # edge^2 entries at most the limit, (edge + 1)^2 above
    for n, positions, reads in [(64, None, True), (64, "shared", True), (64, "own", False), (edge, None, True),
                                (edge + 1, None, False), (edge + 1, "shared", False), (edge + 1, "own", False)]:
        args = meta_problem(n, positions)
        assert kernels._sum_first(*args[:2], *args[4:]) is reads, (n, positions)
        with output_checks_deferred():
            if reads:
                with pytest.raises(RuntimeError, match="meta"):    # the sum read (.item() of a meta tensor)
                    attend(*args, method="dense")
            else:
                assert attend(*args, method="dense").shape == (n, 3)
    # a batch on the keys alone counts: 1000 x 64 x 64 entries are above the limit, 2 x 64 x 64 below
    q = torch.empty(64, 3, device="meta")
    assert not kernels._sum_first(q, torch.empty(1000, 64, 3, device="meta"), None, None)
    assert kernels._sum_first(torch.empty(2, 64, 3, device="meta"), q, None, None)
    # the CPU reads the sum whatever the size and positions (no host sync there)
    q = torch.zeros(4, 3)
    assert kernels._sum_first(q, q, torch.zeros(4), torch.zeros(4))
