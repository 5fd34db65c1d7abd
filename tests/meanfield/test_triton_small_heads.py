"""The small-head Triton kernels (meanfield.triton_small_heads: q, k and v of at most 4 features, FMAs instead of
matrix products), run in Triton's interpreter on CPU, against the dense kernel in float64: forward and
log-sum-exp, JVP (every tangent, and each alone), VJP (every gradient, with and without a cotangent on L, and
each alone), on every mask (none, log-weights with zero-weight atoms, arbitrary positions with a query that
sees no key, a sequence's causal mask), head sizes 1 to 3 (4 on request) with q and v of different sizes, batches, keys
shared across the batch, radius 100, float32 sums over many blocks and float16 inputs. Also: which calls
take them (the features and the dtype, :func:`meanfield.accelerator_paths.small_heads`). On a GPU they run in
float32 and the half types; float64 here as well (``float64_too``), which checks their arithmetic to 1e-10.

Skipped where Triton is not installed, as tests/meanfield/test_kernels_triton.py (whose helpers these are).
"""

from __future__ import annotations

import math

import pytest
import torch

from meanfield import accelerator_paths
from tests.meanfield import test_kernels_triton as base  # sets TRITON_INTERPRET=1 (or skips without Triton)
from tests.meanfield.test_kernels_triton import CASES, DT, _close, _dense, _long_float32, _problem, _rel


@pytest.fixture(scope="module")
def ta():
    """meanfield.triton_attention, its kernels running in Triton's interpreter on CPU tensors."""
    import meanfield.triton_attention as mod

    if not mod._INTERPRETED:
        pytest.skip(f"triton was imported before TRITON_INTERPRET=1 was set (before {base.__name__}); run this file "
                    "alone")
    return mod


#: the dtypes the small kernels take on a GPU
GPU_DTYPES = accelerator_paths.SMALL_HEAD_DTYPES
#: (e, c): q / k features and v features, all within the small kernels
HEADS = [(3, 3), (1, 3), (3, 2), (2, 1)]
#: every mask with the particles' d = 3, the other head sizes on the weighted masks with positions
SMALL_CASES = [dict(case, e=3, c=3) for case in CASES if "e" not in case] + [
    dict(CASES[3], e=e, c=c) for e, c in HEADS[1:]] + [dict(CASES[4], e=e, c=c) for e, c in HEADS[1:]]


def _ids(case):
    return ",".join(f"{k}={v}" for k, v in case.items())


@pytest.fixture(autouse=True)
def float64_too(monkeypatch):
    """The small kernels also take float64 here (on a GPU float64 keeps the matrix-product kernels: their source is
    dtype-generic, so float64 checks their arithmetic to 1e-10; the float32 tests below check what a GPU runs)."""
    monkeypatch.setattr(accelerator_paths, "SMALL_HEAD_DTYPES", accelerator_paths.SMALL_HEAD_DTYPES + (torch.float64,))


@pytest.fixture
def spy(ta, monkeypatch):
    """The names of the small-head kernels launched (a kernel of meanfield.triton_attention's own adds nothing)."""
    from meanfield import triton_small_heads as small

    launched = []
    for name, real in list(small.KERNELS.items()):
        class Spy:
            def __getitem__(self, grid, _real=real, _name=name):
                launched.append(_name)
                return _real[grid]

        monkeypatch.setitem(small.KERNELS, name, Spy())
    return launched


def test_which_heads_take_the_small_kernels(monkeypatch):
    monkeypatch.setattr(accelerator_paths, "SMALL_HEAD_DTYPES", GPU_DTYPES)   # without the module's float64
    small = accelerator_paths.small_heads
    assert small(3, 3) and small(1, 3) and small(3, 1) and small(2, 2, torch.float16) and small(3, 3, torch.bfloat16)
    assert not small(3, 4) and not small(4, 3) and not small(3, 5)
    assert not small(0, 3)   # no features: the general kernels (and their checks)
    assert not small(3, 3, torch.float64)   # float64 products of 4 columns run on tensor cores
    monkeypatch.setattr(accelerator_paths, "SMALL_HEAD_FEATURES", 6)   # above what the kernels unroll: capped
    assert small(4, 4) and not small(5, 3) and not small(3, 6)
    monkeypatch.setattr(accelerator_paths, "SMALL_HEAD_FEATURES", None)
    assert not small(3, 3)


@pytest.mark.parametrize("case", SMALL_CASES, ids=_ids)
def test_forward_and_log_sum_exp_match_dense(ta, spy, case):
    base.test_forward_and_log_sum_exp_match_dense(ta, case)
    assert spy == ["forward"]


def test_a_head_of_four_features_takes_the_general_kernels(ta, spy):
    q, k, v, lw, qp, kp = _problem(32, e=3, c=4)
    out, _ = ta.forward(q, k, v, lw, qp, kp, False)
    assert spy == []
    _close(out, _dense(q, k, v, lw, qp, kp)[0])


@pytest.mark.parametrize("e, c", [(4, 4), (1, 4), (4, 2)])
def test_the_kernels_take_four_features(ta, spy, monkeypatch, e, c):
    """MAX_FEATURES: the kernels unroll up to 4 features (the default limit is 3: with 4 two passes spill registers)."""
    monkeypatch.setattr(accelerator_paths, "SMALL_HEAD_FEATURES", 4)
    q, k, v, lw, qp, kp = _problem(44, e=e, c=c, positions="other")
    out, lse = ta.forward(q, k, v, lw, qp, kp, False)
    _close(out, _dense(q, k, v, lw, qp, kp)[0])
    g = torch.Generator().manual_seed(45)
    prim = (q, k, v, lw)
    tans = tuple(torch.randn(t.shape, generator=g, dtype=DT) for t in prim)
    (_, ref_lse), (t_out, t_lse) = torch.func.jvp(lambda *p: _dense(*p, qp, kp), prim, tans)
    d_out, d_lse = ta.jvp(q, k, v, lw, qp, kp, False, out, lse, *tans)
    _close(d_out, t_out)
    live = torch.isfinite(ref_lse)
    _close(d_lse[live], t_lse[live])
    g_out = torch.randn(out.shape, generator=g, dtype=DT)
    req = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = torch.autograd.grad((_dense(*req, lw, qp, kp)[0] * g_out).sum(), req)
    got = ta.backward(q, k, v, lw, qp, kp, False, out, lse, g_out, None, (True, True, True, False))
    for a, b in zip(got[:3], ref):
        _close(a, b)
    assert spy == ["forward", "jvp", "backward_q", "backward_kv"]


@pytest.mark.parametrize("case", SMALL_CASES[:6], ids=_ids)
def test_float32_agrees_with_float64_dense(ta, spy, case):
    """What a GPU runs (float32): forward, JVP and VJP against float64 dense on the same float32 values."""
    args = _problem(46, **case)
    causal = case["positions"] == "causal"
    f32 = [None if a is None else a.float() for a in args]
    ref_args = [None if a is None else a.double() for a in f32]
    out, lse = ta.forward(*f32, causal)
    assert out.dtype == torch.float32
    ref_out, ref_lse = _dense(*ref_args)
    _close(out.double(), ref_out, tol=1e-5)
    n_in = 4 if f32[3] is not None else 3
    g = torch.Generator().manual_seed(47)
    tans = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in ref_args[:n_in]]
    t_out = torch.func.jvp(lambda *p: _dense(*p, *([None] * (4 - n_in)), *ref_args[4:])[0], tuple(ref_args[:n_in]),
                           tuple(tans))[1]
    d_out, _ = ta.jvp(*f32, causal, out, lse, *[t.float() for t in tans], *([None] * (4 - n_in)))
    _close(d_out.double(), t_out, tol=1e-5)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    req = [t.clone().requires_grad_(True) for t in ref_args[:3]]
    ref = torch.autograd.grad((_dense(*req, *ref_args[3:])[0] * g_out).sum(), req)
    got = ta.backward(*f32, causal, out, lse, g_out.float(), None, (True, True, True, False))
    for a, b in zip(got[:3], ref):
        _close(a.double(), b, tol=1e-5)
    assert spy == ["forward", "jvp", "backward_q", "backward_kv"]


JVP_CASES = [(case, "all") for case in SMALL_CASES[:6]] + [
    (case, which) for case in (SMALL_CASES[3], SMALL_CASES[4], SMALL_CASES[-1]) for which in ("q", "k", "v", "lw")]


@pytest.mark.parametrize("case, which", JVP_CASES, ids=[f"{_ids(c)}-{w}" for c, w in JVP_CASES])
def test_jvp_matches_dense_forward_mode(ta, spy, case, which):
    base.test_jvp_matches_dense_forward_mode(ta, case, which)
    assert spy == ["forward", "jvp"]


@pytest.mark.parametrize("case", SMALL_CASES, ids=_ids)
@pytest.mark.parametrize("with_lse", [False, True])
def test_vjp_matches_dense_reverse_mode(ta, spy, case, with_lse):
    base.test_vjp_matches_dense_reverse_mode(ta, case, with_lse)
    assert spy == ["forward", "backward_q", "backward_kv"]


@pytest.mark.parametrize("positions", [None, "other"])
def test_strided_features_and_rows(ta, spy, positions):
    """Inputs that are views (a feature stride of 2, rows of a transposed tensor), tangents and the cotangent too:
    every load goes through its strides (the kernels read no contiguous copy)."""
    g = torch.Generator().manual_seed(48)
    q0, k0, v0, lw, qp, kp = _problem(48, e=3, c=3, positions=positions)
    wide = lambda t: torch.randn(*t.shape[:-1], 2 * t.shape[-1], generator=g, dtype=DT)[..., ::2]
    rows_t = lambda t: torch.randn(t.shape[0], t.shape[2], t.shape[1], generator=g, dtype=DT).transpose(1, 2)
    q, k, v = wide(q0), rows_t(k0), wide(v0)
    assert q.stride(-1) == 2 and k.stride(-2) == 1 and v.stride(-1) == 2
    out, lse = ta.forward(q, k, v, lw, qp, kp, False)
    ref_out, ref_lse = _dense(q, k, v, lw, qp, kp)
    _close(out, ref_out)
    tans = (wide(q0), rows_t(k0), wide(v0))
    t_out = torch.func.jvp(lambda a, b, c: _dense(a, b, c, lw, qp, kp)[0], (q, k, v), tans)[1]
    _close(ta.jvp(q, k, v, lw, qp, kp, False, out, lse, *tans, None)[0], t_out)
    g_out = wide(out)
    req = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = torch.autograd.grad((_dense(*req, lw, qp, kp)[0] * g_out).sum(), req)
    for a, b in zip(ta.backward(q, k, v, lw, qp, kp, False, out, lse, g_out, None, (True, True, True, False)), ref):
        _close(a, b)
    assert spy == ["forward", "jvp", "backward_q", "backward_kv"]


def test_vjp_computes_only_what_is_needed(ta, spy):
    base.test_vjp_computes_only_what_is_needed(ta, e=2, c=3)
    assert set(spy) == {"forward", "backward_q", "backward_kv"}


def test_causal_flag_equals_the_positions_of_the_sequence(ta):
    q, k, v, lw, qp, kp = _problem(38, n=45, positions="causal", c=3)
    lw[:, :4] = -math.inf  # the first queries see only zero-mass keys: empty rows
    a = ta.forward(q, k, v, lw, qp, kp, True)
    b = ta.forward(q, k, v, lw, qp, kp, False)
    _close(a[0], b[0])
    assert torch.equal(torch.isinf(a[1]), torch.isinf(b[1])) and torch.isinf(a[1][:, :4]).all()
    _close(a[0], _dense(q, k, v, lw, qp, kp)[0])
    g_out = torch.randn_like(a[0])
    for x, y in zip(ta.backward(q, k, v, lw, qp, kp, True, *a, g_out, None, (True,) * 4),
                    ta.backward(q, k, v, lw, qp, kp, False, *b, g_out, None, (True,) * 4)):
        _close(x[torch.isfinite(y)], y[torch.isfinite(y)])


def test_radius_100_stays_finite_and_agrees(ta, spy):
    base.test_radius_100_stays_finite_and_agrees(ta, c=3)
    assert spy == ["forward", "jvp", "backward_q", "backward_kv"]


@pytest.mark.parametrize("positions", ["other", "causal"])
def test_batches_above_the_grid_limit_run_in_chunks(ta, spy, monkeypatch, positions):
    q, k, v, lw, qp, kp = _problem(40, B=5, m=9, n=11, shared_k=True, positions=positions, c=2)
    causal = positions == "causal"
    monkeypatch.setattr(ta, "GRID_Y_MAX", 2)
    out, lse = ta.forward(q, k, v, lw, qp, kp, causal)
    assert spy == ["forward"] * 3
    _close(out, _dense(q, k, v, lw, qp, kp)[0])
    g = torch.Generator().manual_seed(41)
    g_out = torch.randn(out.shape, generator=g, dtype=DT)
    prim = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = torch.autograd.grad((_dense(*prim, lw, qp, kp)[0] * g_out).sum(), prim)
    got = ta.backward(q, k, v, lw, qp, kp, causal, out, lse, g_out, None, (True, True, True, False))
    for a, b in zip(got[:3], ref):
        _close(a, b)


#: relative errors allowed to float32 sums over 250 blocks (float32 rounding: 6e-8). Measured in this test: forward
#: 1.7e-7, JVP 5.2e-7, dq 4.5e-7, dk 9.8e-7, dv 3.4e-7; with plain sums across blocks (``_add`` replaced by ``+``)
#: 9.4e-7, 3.5e-6, 7.6e-6, 1.0e-6 and 4.4e-7: the sums over key blocks (forward, JVP, dq) fail without compensation;
#: dk and dv, summed over query blocks, are dominated by the rounding of each term (and of D_i for dk) here: the
#: key-side test below builds an input that tells compensated and plain sums apart
LONG_TOL = {"forward": 3e-7, "jvp": 1e-6, "dq": 1.5e-6, "dk": 2e-6, "dv": 1e-6}


def test_float32_forward_sums_over_many_blocks_keep_one_blocks_error(ta, spy):
    """The forward pass's compensated sums over 250 key blocks of 16 (the interpreter's tiles) in float32: each block
    is summed along a thread, then added across blocks with ``_add`` (every pass: the next test, marked slow)."""
    args, ref_args = _long_float32(16, 4000)
    out, _ = ta.forward(*args, False)
    assert spy == ["forward"]
    assert _rel(out, _dense(*ref_args)[0]) <= LONG_TOL["forward"]


@pytest.mark.slow
def test_float32_sums_over_many_blocks_keep_one_blocks_error(ta, spy):
    """Compensated sums over 250 blocks of 16 (the interpreter's tiles) in float32, in every pass: each block is summed
    along a thread, then added across blocks with ``_add``."""
    args, ref_args = _long_float32(16, 4000)
    out, lse = ta.forward(*args, False)
    assert spy == ["forward"]
    ref_out, _ = _dense(*ref_args)
    assert _rel(out, ref_out) <= LONG_TOL["forward"]
    g = torch.Generator().manual_seed(42)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in ref_args[:3])
    t_out = torch.func.jvp(lambda a, b, c: _dense(a, b, c, None, None, None)[0], tuple(ref_args[:3]),
                           (tq, tk, tv))[1]
    d_out, _ = ta.jvp(*args, False, out, lse, tq.float(), tk.float(), tv.float(), None)
    assert _rel(d_out, t_out) <= LONG_TOL["jvp"]
    g_out = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
    prim = [t.clone().requires_grad_(True) for t in ref_args[:3]]
    ref_dq = torch.autograd.grad((_dense(*prim, None, None, None)[0] * g_out).sum(), prim[0])[0]
    dq = ta.backward(*args, False, out, lse, g_out.float(), None, (True, False, False, False))[0]
    assert _rel(dq, ref_dq) <= LONG_TOL["dq"]
    args, ref_args = _long_float32(4000, 16)
    out, lse = ta.forward(*args, False)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    prim = [t.clone().requires_grad_(True) for t in ref_args[:3]]
    ref_dk, ref_dv = torch.autograd.grad((_dense(*prim, None, None, None)[0] * g_out).sum(), prim[1:])
    _, dk, dv, _ = ta.backward(*args, False, out, lse, g_out.float(), None, (False, True, True, False))
    assert _rel(dk, ref_dk) <= LONG_TOL["dk"] and _rel(dv, ref_dv) <= LONG_TOL["dv"]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")   # the interpreter's numpy, by design
def test_a_float32_sum_that_overflows_stays_infinite_in_the_matrix_product_kernels_too(ta, monkeypatch):
    """test_kernels_triton.py's test (3 and 2 features: the small kernels), with the other family."""
    monkeypatch.setattr(accelerator_paths, "SMALL_HEAD_FEATURES", None)
    base.test_a_float32_sum_that_overflows_stays_infinite(ta)


def test_float16_inputs_are_computed_in_float32(ta, spy):
    """Half-precision inputs are read into float32 (the accumulator), so only their own rounding and the output's
    remain: closer to float64 dense than the general kernels' half-precision products (2e-2 allowed there)."""
    args = _problem(43, positions="causal", n=40, c=3)
    half = [None if a is None else a.to(torch.float16) for a in args]
    out, lse = ta.forward(*half, True)
    assert spy == ["forward"] and out.dtype == torch.float16 and lse.dtype == torch.float32
    ref_out, ref_lse = _dense(*[None if a is None else a.double() for a in half])
    _close(out.double(), ref_out, tol=2e-3)
    live = torch.isfinite(ref_lse)
    _close(lse[live].double(), ref_lse[live], tol=1e-5)
    g_out = torch.randn(out.shape, dtype=torch.float64)
    dq = ta.backward(*half, True, out, lse, g_out.to(torch.float16), None, (True, False, False, False))[0]
    qd = half[0].double().requires_grad_(True)
    ref = torch.autograd.grad((_dense(qd, *[None if a is None else a.double() for a in half[1:]])[0] * g_out).sum(),
                              qd)[0]
    _close(dq.double(), ref, tol=5e-3)


# ---------------------------------------------------------------- through the streamed kernel and local_lipschitz
@pytest.fixture
def triton_engine(ta, monkeypatch):
    """Every streamed call takes the Triton engine (what it does on CUDA), as in test_kernels_triton.py."""
    resolve = base.streaming._resolve_engine
    monkeypatch.setattr(base.streaming, "_resolve_engine", lambda engine, q, v: resolve("triton", q, v))
    calls = {"forward": 0, "jvp": 0, "backward": 0}
    for name in calls:
        fn = getattr(ta, name)
        monkeypatch.setattr(ta, name, lambda *a, _fn=fn, _name=name: calls.__setitem__(_name, calls[_name] + 1)
                            or _fn(*a))
    return calls


@pytest.mark.parametrize("positions", [None, "sequence", "other"])
def test_autograd_forward_ad_and_double_backward_through_the_small_kernels(triton_engine, spy, positions):
    """Reverse mode, forward mode and reverse-over-reverse products of self-attention in d = 3 (what local_lipschitz
    uses) through the Triton engine, here in its small-head kernels, equal the dense kernel's."""
    base.test_autograd_forward_ad_and_double_backward_through_the_triton_engine(triton_engine, positions)
    assert {"forward", "jvp", "backward_q", "backward_kv"} <= set(spy)


def test_local_lipschitz_certificate_through_the_small_kernels(triton_engine, spy):
    base.test_local_lipschitz_certificate_through_the_triton_engine(triton_engine)
    assert "jvp" in spy or "backward_q" in spy


def _key_side_sums(ta, n_queries=1024):
    """(dk, dv, dlw) of the key-side pass and their float64 truths on an input whose sums over query blocks lose
    visibly without compensation: 16 keys at 0 (every score 0, P = 1/16), values +-1 alternating (out = 0 and
    D_i = 0 exactly), q = 1, and a cotangent of 1e4 on the first query block and 3e-4 on the 63 others (the
    interpreter's blocks of 16). Every gradient of key j is then +-(1/16 or 3/16) (16e4 + 1008 * 3e-4) per feature:
    each later block adds 3e-4 or 9e-4, below half a float32 ulp of the running sum (1e4: 4.9e-4; 3e4: 9.8e-4), so
    plain sums return the first block's alone, 1.9e-6 off; compensated sums keep them (measured: 2e-9 to 3.5e-8)."""
    q = torch.ones(1, n_queries, 3)
    k = torch.zeros(1, 16, 3)
    v = torch.tensor([1.0, -1.0]).repeat(8)[None, :, None].expand(1, 16, 3).contiguous()
    lw = torch.zeros(1, 16)
    g_out = torch.full((1, n_queries, 3), 3e-4)
    g_out[:, :16] = 1e4
    out = torch.zeros(1, n_queries, 3)   # the forward pass's, so D_i = 0 exactly: the sums are the only rounding
    lse = torch.full((1, n_queries), math.log(16.0))
    _, dk, dv, dlw = ta.backward(q, k, v, lw, None, None, False, out, lse, g_out, None, (False, True, True, True))
    prim = [t.double().requires_grad_(True) for t in (k, v, lw)]
    ref = torch.autograd.grad((_dense(q.double(), *prim, None, None)[0] * g_out.double()).sum(), prim)
    return [_rel(a, b) for a, b in zip((dk, dv, dlw), ref)]


@pytest.mark.parametrize("family", ["small heads", "matrix products"])
def test_the_key_side_pass_compensates_its_sums_over_query_blocks(ta, spy, monkeypatch, family):
    """dk, dv and d(log-weights) sum over 64 query blocks in float32 with compensation (``_add``). On random inputs
    the rounding of each term hides the difference (LONG_TOL above), so this input is built where plain sums lose
    1.9e-6 and compensated ones keep one block's error; the same input with ``_add`` replaced by plain sums must
    fail, so the test can tell them apart."""
    from meanfield import triton_small_heads as small
    from tests.meanfield.triton_plain_add import plain_add  # Triton, imported once TRITON_INTERPRET=1 is set

    if family == "matrix products":
        monkeypatch.setattr(accelerator_paths, "SMALL_HEAD_FEATURES", None)
    errors = _key_side_sums(ta)
    assert max(errors) <= 2e-7, errors
    assert ("backward_kv" in spy) == (family == "small heads")
    monkeypatch.setattr(small if family == "small heads" else ta, "_add", plain_add)
    plain = _key_side_sums(ta)
    assert min(plain) >= 1e-6, plain
