"""The attention kernel: dense path against the independent naive reference, streaming path
against the dense path (forward, JVP, VJP, second order, torch.func), memory O(N), dispatch."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meanfield import kernels
from meanfield.kernels import attend, use
from meanfield.streaming import fused_attend, stream_attend
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
