"""Bad inputs to the attention kernel: each is an error naming the argument, before any torch error, and
a non-finite output (NaN inputs, overflowing scores) is an error instead of a silent NaN."""

from __future__ import annotations

import math

import pytest
import torch

from meanfield import kernels
from particles.validation import MEMORY_LIMIT_ENV, MemoryLimitError


def _qkv(m=4, n=5, e=3, c=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, e, generator=g, dtype=dtype), torch.randn(n, e, generator=g, dtype=dtype),
            torch.randn(n, c, generator=g, dtype=dtype))


def _reference(q, k, v):
    """softmax(q k^T) v written out with exp and a sum (no log-sum-exp trick: small, moderate inputs)."""
    e = torch.exp(q @ k.T)
    return (e / e.sum(dim=1, keepdim=True)) @ v


@pytest.mark.parametrize("dtype, name", [(torch.int64, "int64"), (torch.bool, "bool"), (torch.complex64, "complex64")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_floating_tensors_are_a_type_error_naming_the_argument(dtype, name, which):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = (args[which] > 0).to(dtype) if dtype == torch.bool else args[which].to(dtype)
    with pytest.raises(TypeError, match=rf"^{which}: expected a floating tensor .* got torch.{name}"):
        kernels.attend(args["q"], args["k"], args["v"])


def test_zero_keys_lists_and_bad_blocks_are_named():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^k: no keys \(shape \(0, 3\)\)"):
        kernels.attend(q, k[:0], v[:0])
    with pytest.raises(TypeError, match="^q_pos: expected a torch tensor, got list"):
        kernels.attend(q, k, v, None, [0.5] * 4, [0.5] * 5)
    with pytest.raises(TypeError, match="^log_weights: expected a torch tensor, got list"):
        kernels.attend(q, k, v, [0.0] * 5)
    with pytest.raises(TypeError, match="^v: expected a torch tensor, got list"):
        kernels.attend(q, k, v.tolist())
    for bad in (2.5, "64", (8, 2.0), (8,), True):
        with pytest.raises(TypeError, match="^block_size: expected a positive int or a pair"):
            kernels.attend(q, k, v, method="stream", block_size=bad)
    with pytest.raises(ValueError, match="^block_size: expected positive tile edges"):
        kernels.attend(q, k, v, method="stream", block_size=0)
    with pytest.raises(TypeError, match="^block_size"):
        with kernels.use("stream", block_size=2.5):
            pass


def test_batch_dimensions_that_do_not_broadcast_are_named():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    k = torch.randn(3, 5, 3, generator=g, dtype=torch.float64)
    v = torch.randn(3, 5, 2, generator=g, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"batch dimensions do not broadcast \(q \(2,\), k \(3,\), v \(3,\)\)"):
        kernels.attend(q, k, v)
    # batch shapes that do broadcast still give the reference, batch member by batch member
    out = kernels.attend(q[:1], k, v)
    for b in range(3):
        assert torch.allclose(out[b], _reference(q[0], k[b], v[b]), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", ["dense", "stream", "fused", "auto"])
def test_nan_inputs_and_overflowing_scores_raise_instead_of_returning_nan(method):
    q, k, v = _qkv()
    assert torch.allclose(kernels.attend(q, k, v, method=method), _reference(q, k, v), rtol=1e-10, atol=1e-12)
    bad = q.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="^q: contains NaN or infinite entries"):
        kernels.attend(bad, k, v, method=method)
    lw = torch.zeros(5, dtype=torch.float64)
    lw[2] = float("nan")
    with pytest.raises(FloatingPointError, match="^log_weights: contains NaN or \\+inf"):
        kernels.attend(q, k, v, lw, method=method)
    with pytest.raises(FloatingPointError, match="the scores <q_i, k_j> .*overflow torch.float64"):
        kernels.attend(q * 1e200, k * 1e200, v, method=method)
    with pytest.raises(FloatingPointError, match="overflow torch.float32.*use float64"):
        kernels.attend(q.float() * 1e20, k.float() * 1e20, v.float(), method=method)


def test_zero_weights_and_fully_masked_rows_are_still_finite():
    """-inf log-weights (atoms of mass zero) and a query before every key (a row of zeros) are valid: the
    finiteness check must not refuse them."""
    q, k, v = _qkv()
    lw = torch.log(torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64))
    out = kernels.attend(q, k, v, lw)
    assert torch.allclose(out, _reference(q, k[1:3], v[1:3]), rtol=1e-12, atol=1e-14)
    q_pos = torch.tensor([0.0, 0.5, 0.5, 1.0], dtype=torch.float64)
    k_pos = torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0], dtype=torch.float64)
    out = kernels.attend(q, k, v, None, q_pos, k_pos)
    assert torch.equal(out[0], torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(out[1], _reference(q[1:2], k[:2], v[:2])[0], rtol=1e-12)


def test_derivatives_through_the_check():
    """Inside torch.func transforms the output check is skipped (no data-dependent control flow), outside
    it autograd still flows: the Jacobian matches a finite difference."""
    q, k, v = _qkv()
    J = torch.func.jacrev(lambda x: kernels.attend(x, k, v, method="dense"))(q)
    eps = 1e-6
    dq = torch.zeros_like(q)
    dq[1, 2] = eps
    fd = (kernels.attend(q + dq, k, v) - kernels.attend(q - dq, k, v)) / (2 * eps)
    assert torch.allclose(J[..., 1, 2], fd, rtol=1e-6, atol=1e-9)


def test_the_dense_path_checks_its_memory_before_allocating(monkeypatch):
    """N = 1e5 queries and keys: 1e10 score entries, 4 matrices of float32 and 4 bytes of masks an entry
    (186 GiB, the peak measured with derivatives: tests/test_memory_guards.py). Refused at once with the size and
    the method to use instead, by method='dense' and by kernels.use('dense')."""
    x = torch.zeros(10**5, 2)
    expected = f"needs about {10**10 * (4 * 4 + 4) / 2**30:.1f} GiB"
    with pytest.raises(MemoryLimitError, match=rf"attend\(method='dense'\): 10000000000 score entries.*{expected}.*"
                                               "method='stream'"):
        kernels.attend(x, x, x, method="dense")
    with kernels.use("dense"), pytest.raises(MemoryLimitError, match="method='stream'"):
        kernels.attend(x, x, x)
    # at the limit the same path computes, one byte below it refuses ((4 * 8 + 4) m n bytes, above the 1 MiB
    # that is always allowed)
    q, k, v = _qkv(m=256, n=256)
    assert 36 * 256 * 256 > kernels.DENSE_ALWAYS_ALLOWED
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(36 * 256 * 256))
    assert torch.allclose(kernels.attend(q, k, v, method="dense"), _reference(q, k, v), rtol=1e-12, atol=1e-14)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(36 * 256 * 256 - 1))
    with pytest.raises(MemoryLimitError):
        kernels.attend(q, k, v, method="dense")
    assert torch.allclose(kernels.attend(q, k, v, method="stream"), _reference(q, k, v), rtol=1e-12, atol=1e-14)


def test_finite_outputs_whose_sum_overflows_are_returned():
    """The check sums the output first; values near the dtype's maximum (finite, but their sum is not) must still
    be returned, equal to the reference computed on the unscaled values. (The streamed path's running sums
    overflow there: it raises instead of returning inf.)"""
    q, k, v = _qkv()
    big = torch.full_like(v, 1e308) + v.abs()
    with pytest.raises(FloatingPointError, match="sums of the values v"):
        kernels.attend(q, k, big, method="stream")
    out = kernels.attend(q, k, big, method="dense")
    assert bool(torch.isfinite(out).all()) and not torch.isfinite(out.sum())
    assert torch.allclose(out / 1e308, _reference(q, k, big / 1e308), rtol=1e-12)


@pytest.mark.parametrize("path", ["dense", "rows"])
def test_rows_without_keys_are_zeros_without_computing_every_row_again(monkeypatch, path):
    """Random positions leave a query before every key of positive weight about half of the time. Those rows
    (and only those) are zeros, decided from the positions and weights: batches, zero weights, keys after
    every query, through the dense and the rows paths; a NaN position is an error naming it."""
    calls = []
    guarded = kernels.attention_probs
    monkeypatch.setattr(kernels, "attention_probs", lambda *a: calls.append(1) or guarded(*a))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 3, generator=g, dtype=torch.float64) for n in (30, 40, 40))
    qp, kp = torch.rand(2, 30, generator=g, dtype=torch.float64), torch.rand(2, 40, generator=g, dtype=torch.float64)
    w = torch.rand(2, 40, generator=g, dtype=torch.float64)
    w[0, kp[0].argmin()] = 0.0   # the first key of batch 0 has no weight: it makes no row alive
    lw = torch.log(w)
    qp[:, :3] = kp.amin(-1, keepdim=True) - 0.01     # three queries before every key
    qp[1, 3] = kp[1].amin()                            # ... and one that sees exactly the first key
    run = (lambda *a: kernels.attend(*a, method="dense")) if path == "dense" else \
        (lambda *a: kernels.rows_attend(*a, rows=7))
    # the truth, written out: softmax over the visible keys of positive weight, zeros where there are none
    s = (q @ k.transpose(-1, -2) + lw.unsqueeze(-2)).masked_fill(kp.unsqueeze(-2) > qp.unsqueeze(-1), -math.inf)
    seen = torch.isfinite(s)
    expected = torch.where(seen, torch.exp(s - s.amax(-1, keepdim=True)), 0.0)
    expected = (expected / expected.sum(-1, keepdim=True)).nan_to_num(0.0) @ v
    dead = ~seen.any(-1)
    assert dead[:, :3].all() and not dead[1, 3] and dead.sum() == 6   # the 0-weight first key counts for nothing
    step = 30 if path == "dense" else 7   # the rows path: the guarded formula on the same blocks of queries

    def by_guarded(q, k, v, lw, qp, kp):
        return torch.cat([guarded(q[:, i:i + step], k, lw, qp[:, i:i + step], kp) @ v for i in range(0, 30, step)], 1)

    for args in ((q, k, v, lw, qp, kp), (q, k, v, None, qp, kp)):
        out = run(*args)
        assert calls == [] and torch.equal(out, by_guarded(*args))
    out = run(q, k, v, lw, qp, kp)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-15) and torch.equal(out[dead], torch.zeros(6, 3).double())
    qp_nan = qp.clone()
    qp_nan[0, 5] = math.nan                              # a query no mask can place: an error naming q_pos
    with pytest.raises(FloatingPointError, match=r"^q_pos: contains NaN"):
        run(q, k, v, lw, qp_nan, kp)


def test_rows_without_keys_found_in_the_dtype_the_positions_compare_in():
    """Integer key positions above 2^24 against float64 query positions (timestamps, say): the first key of
    positive weight is found in float64, as the mask compares them, not rounded to float32; the query on that key
    sees it. Expected output written out: the query at the first key sees it alone."""
    kp = torch.tensor([2**24 + 3, 2**30])
    qp = torch.tensor([2.0**24 + 3, 0.0, 2.0**24 + 3], dtype=torch.float64)
    q, k = torch.zeros(3, 1, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64)
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    lw = torch.zeros(2, dtype=torch.float64)
    expected = torch.tensor([[1.0, 2.0], [0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    for run in (lambda *a: kernels.attend(*a, method="dense"), lambda *a: kernels.attend(*a),
                lambda *a: kernels.rows_attend(*a, rows=2)):
        assert torch.equal(run(q, k, v, lw, qp, kp), expected)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_bad_value_is_reported_even_when_no_row_sees_a_key(bad):
    """Rows that see no key are 0 @ v in the guarded formula: a NaN or infinite value makes them NaN there, so
    it is reported by name, not hidden by the rows set to zero."""
    q, k, v = _qkv()
    v = v.clone()
    v[1, 0] = bad
    lw = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=torch.float64))
    kp = torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0], dtype=torch.float64)
    q_pos = torch.tensor([0.0, 0.1, 0.1, 0.15], dtype=torch.float64)   # every query before every key
    for args in ((q, k, v, lw, q_pos, kp), (q, k, v, torch.full_like(lw, -math.inf), None, None)):
        for run in (lambda *a: kernels.attend(*a, method="dense"), lambda *a: kernels.rows_attend(*a, rows=3)):
            with pytest.raises(FloatingPointError, match="^v: contains NaN or infinite"):
                run(*args)


def test_the_dense_path_guards_rows_without_keys_only_when_the_output_says_so(monkeypatch):
    """With weights or positions the dense path runs the plain softmax (as naive attention) and takes
    attention_probs's guarded formula only when the output is not finite, i.e. when a row sees no key of
    positive weight: the results equal the guarded formula bit for bit either way, the rows without keys are
    zeros, and their gradients are finite (zeros) rather than NaN."""
    calls = []
    guarded = kernels.attention_probs
    monkeypatch.setattr(kernels, "attention_probs", lambda *a: calls.append(1) or guarded(*a))
    q, k, v = _qkv()
    lw = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=torch.float64))
    kp = torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0], dtype=torch.float64)
    for q_pos in (None, torch.tensor([0.3, 0.5, 0.7, 1.0], dtype=torch.float64)):
        pos = (q_pos, None if q_pos is None else kp)
        out = kernels.attend(q, k, v, lw, *pos, method="dense")
        assert torch.equal(out, guarded(q, k, lw, *pos) @ v) and calls == []
    # a query before every key: the guarded formula, once
    q_pos = torch.tensor([0.0, 0.5, 0.7, 1.0], dtype=torch.float64)
    qg = q.clone().requires_grad_(True)
    out = kernels.attend(qg, k, v, lw, q_pos, kp, method="dense")
    assert len(calls) == 1 and torch.equal(out[0], torch.zeros(2, dtype=torch.float64))
    assert torch.equal(out.detach(), guarded(q, k, lw, q_pos, kp) @ v)
    out.sum().backward()
    assert torch.isfinite(qg.grad).all() and torch.equal(qg.grad[0], torch.zeros(3, dtype=torch.float64))
    # without gradients the rows without keys are set to zero, found from the positions and weights alone
    out = kernels.attend(q, k, v, lw, q_pos, kp, method="dense")
    assert len(calls) == 1 and torch.equal(out, guarded(q, k, lw, q_pos, kp) @ v)
    # every weight zero: every row is empty
    out = kernels.attend(q, k, v, torch.full((5,), -math.inf, dtype=torch.float64), method="dense")
    assert len(calls) == 1 and torch.equal(out, torch.zeros(4, 2, dtype=torch.float64))
    # a NaN input is still reported by name
    with pytest.raises(FloatingPointError, match="^k: contains NaN"):
        kernels.attend(q, k.clone().fill_(math.nan), v, lw, method="dense")


@pytest.mark.parametrize("method", ["dense", "stream", "fused", "auto"])
def test_log_weights_the_kernels_clamp_differently_are_refused_and_equal_ones_run(method):
    """The fused and streamed kernels clamp log-weights at finfo.min / 4, their stand-in for a zero mass. Causal
    rows whose visible keys all sit below it lost their differences: keys of log-weights -1e308 and -5e307 (the
    second carries all of row 1's mass) got equal weights there, while the dense path gave the softmax (row 1:
    -0.549 there against -1.290 dense, first coordinate, on this test's inputs before). Such weights are refused
    on every path, naming the argument. Equal ones (Hugging Face fills masks with finfo.min, an earlier change
    refused them too) lose nothing and run, equal on
    every path to naive attention written here (softmax of s_ij + log a_j over the visible keys; rows 0 and 1
    see only those keys, where the scores are below float64's resolution beside -1.8e308: their average, as in
    Hugging Face's eager attention)."""
    q, k, v = _qkv(m=4, n=4)
    pos = torch.arange(4, dtype=torch.float64) / 4
    lw = torch.tensor([-1e308, -5e307, 0.0, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^log_weights: 2 atom\(s\) of positive mass have log-weights below"):
        kernels.attend(q, k, v, lw, pos, pos, method=method)
    beside_zero = torch.tensor([-1e308, -math.inf, 0.0, 0.0], dtype=torch.float64)   # tied with a zero mass
    with pytest.raises(ValueError, match=r"^log_weights: 1 atom\(s\) of positive mass have log-weights below"):
        kernels.attend(q, k, v, beside_zero, pos, pos, method=method)
    masked = torch.tensor([torch.finfo(torch.float64).min] * 2 + [0.0, 0.0], dtype=torch.float64)
    out = kernels.attend(q, k, v, masked, pos, pos, method=method)
    truth = torch.stack([torch.softmax(q[i] @ k[:i + 1].T + masked[:i + 1], 0) @ v[:i + 1] for i in range(4)])
    assert torch.allclose(truth[1], v[:2].mean(0), rtol=1e-14)   # the premise: s is lost beside -1.8e308
    assert torch.allclose(out, truth, rtol=1e-12, atol=1e-14)
    q_pos = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    k_pos = torch.tensor([0.0, 0.05, 0.6, 0.8], dtype=torch.float64)
    ok = torch.tensor([-math.inf, -1e300, 0.0, 0.0], dtype=torch.float64)
    out = kernels.attend(q[:3], k, v, ok, q_pos, k_pos, method=method)
    assert torch.allclose(out[0], v[1], rtol=1e-14)   # query 0 sees a zero mass and a mass of exp(-1e300)
    visible = (k_pos <= q_pos[2]) & (ok > -math.inf)
    scores = q[2] @ k[visible].T + ok[visible]
    assert torch.allclose(out[2], torch.softmax(scores, 0) @ v[visible], rtol=1e-12, atol=1e-14)


def test_the_log_weight_floor_is_not_read_inside_vmap():
    """vmap cannot branch on data: a batch of weighted calls through torch.func.vmap runs (and agrees with the
    loop)."""
    q, k, v = _qkv(m=3, n=4)
    lws = torch.log_softmax(torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), 1)
    out = torch.func.vmap(lambda lw: kernels.attend(q, k, v, lw, method="dense"))(lws)
    for b in range(5):
        assert torch.allclose(out[b], kernels.attend(q, k, v, lws[b], method="dense"), rtol=1e-13)


def test_a_nan_position_is_never_silent_when_checks_are_deferred():
    """Inside output_checks_deferred (simulate's mode: the caller checks what it computes for finiteness) a NaN
    position must leave a NaN in the output. The streamed kernel returned zeros for every row (its tiles skip the key
    ranges a block's positions cannot see; a NaN makes every comparison false): now NaN everywhere. The dense path
    gives the query's row NaN (and drops a key at a NaN position, as documented in kernels._plain_first). Outside the
    mode both name the argument. (A review of 2026-11-29: small heads on an accelerator now stream from 2^21 score
    entries, where the row blocks gave a NaN row.)"""
    from particles.validation import output_checks_deferred

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(7, 3, generator=g, dtype=torch.float64) for _ in range(3))
    q_pos, k_pos = torch.rand(7, generator=g, dtype=torch.float64), torch.rand(7, generator=g, dtype=torch.float64)
    nan_q, nan_k = q_pos.clone(), k_pos.clone()
    nan_q[5] = nan_k[2] = math.nan
    for qp, kp, name in ((nan_q, k_pos, "q_pos"), (q_pos, nan_k, "k_pos")):
        for method in ("stream", "dense"):
            with pytest.raises(FloatingPointError, match=f"^{name}: contains NaN"):
                kernels.attend(q, k, v, None, qp, kp, method=method)
        with output_checks_deferred():
            out = kernels.attend(q, k, v, None, qp, kp, method="stream")
            assert bool(torch.isnan(out).all()), name
            assert bool(torch.isnan(kernels.stream_checked(q, k, v, None, qp, kp)[0]).all()), name
    with output_checks_deferred():
        dense = kernels.attend(q, k, v, None, nan_q, k_pos, method="dense")
        assert bool(torch.isnan(dense[5]).all())
        fine = kernels.attend(q, k, v, None, q_pos, k_pos, method="stream")   # finite positions: untouched
    torch.testing.assert_close(fine, kernels.attend(q, k, v, None, q_pos, k_pos, method="dense"), rtol=1e-13,
                               atol=1e-14)
    # positions with a batch dimension, a NaN in entry 1: the tiles' key ranges are planned over every entry at once,
    # so entry 0 came back as zeros too (not its dense output): NaN in every entry
    both = torch.stack([q_pos, nan_q])
    from meanfield.streamed_attention import stream_attend

    assert not torch.allclose(stream_attend(q, k, v, None, both, both)[0],
                              kernels.attend(q, k, v, None, q_pos, q_pos, method="dense"))
    with output_checks_deferred():
        assert bool(torch.isnan(kernels.attend(q, k, v, None, both, both, method="stream")).all())
