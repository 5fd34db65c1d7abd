"""Attention operators against independent naive implementations (tests/reference.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import L2SelfAttention, MultiHeadAttention, SelfAttention
from particles import Measure
from tests.reference import naive_attention, naive_l2, naive_qkv

f64 = torch.float64


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=f64)


@pytest.mark.parametrize("masked", [False, True])
def test_self_attention_matches_naive_batched(masked):
    A, V, X = rand(4, 4, seed=1), rand(3, 4, seed=2), rand(2, 3, 6, 4, seed=3)
    op = SelfAttention(A, V, masked=masked)
    out = op.sequence(X)
    assert out.shape == (2, 3, 6, 3)
    torch.testing.assert_close(out, naive_attention(X, A, V, masked=masked), rtol=1e-12, atol=1e-12)
    assert op.d_in == 4 and op.d_out == 3 and op.masked is masked and op.dtype == f64
    torch.testing.assert_close(op.A, A)


def test_numpy_parameters_and_float32():
    A, V, X = rand(3, 3, seed=1), rand(3, 3, seed=2), rand(5, 3, seed=3)
    op = SelfAttention(A.numpy(), V.numpy())
    torch.testing.assert_close(op.sequence(X.numpy()), naive_attention(X, A, V))
    op32 = op.to(dtype=torch.float32)
    assert op32.dtype == torch.float32
    torch.testing.assert_close(op32.sequence(X.float()), naive_attention(X, A, V).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_from_qkv_biases(masked):
    d, k = 5, 3
    Q, K, V, X = rand(k, d, seed=1), rand(k, d, seed=2), rand(4, d, seed=3), rand(7, d, seed=4)
    bQ, bK, bV = rand(k, seed=5), rand(k, seed=6), rand(4, seed=7)
    full = SelfAttention.from_qkv(Q, K, V, bQ, bK, bV, masked=masked)
    expected = naive_qkv(X, Q, K, V, bQ, bK, bV, masked)
    torch.testing.assert_close(full.sequence(X), expected, rtol=1e-12, atol=1e-12)
    # b_K has no effect: the naive formula with and without it agree, and so does the operator
    no_bK = naive_qkv(X, Q, K, V, bQ, 0 * bK, bV, masked)
    torch.testing.assert_close(no_bK, expected, rtol=1e-12, atol=1e-12)
    # b_Q does have an effect, equal to the key term of tests/reference.py
    no_bQ = naive_qkv(X, Q, K, V, 0 * bQ, bK, bV, masked)
    assert (no_bQ - expected).abs().max() > 1e-3
    A = K.T @ Q / math.sqrt(k)
    ref = naive_attention(X, A, V, masked=masked, b_Q=K.T @ bQ / math.sqrt(k)) + bV
    torch.testing.assert_close(full.sequence(X), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(full.A, A)


def test_custom_scale():
    Q, K, V, X = rand(2, 3, seed=1), rand(2, 3, seed=2), rand(3, 3, seed=3), rand(4, 3, seed=4)
    op = SelfAttention.from_qkv(Q, K, V, scale=0.3)
    torch.testing.assert_close(op.sequence(X), naive_attention(X, 0.3 * K.T @ Q, V))


@pytest.mark.parametrize("masked", [False, True])
def test_measure_pushforward_of_empirical_is_empirical_of_f(masked):
    A, V, X = rand(3, 3, seed=1), rand(3, 3, seed=2), rand(6, 3, seed=3)
    op = SelfAttention(A, V, masked=masked)
    mu = Measure.sequence(X) if masked else Measure.empirical(X)
    out = op(mu)
    assert isinstance(out, Measure)
    torch.testing.assert_close(out.points, naive_attention(X, A, V, masked=masked))
    torch.testing.assert_close(out.weights, mu.weights)
    if masked:
        torch.testing.assert_close(out.positions, mu.positions)


def test_weighted_measure_and_velocity():
    A, V, X = rand(3, 3, seed=1), rand(3, 3, seed=2), rand(5, 3, seed=3)
    w = torch.tensor([0.1, 0.4, 0.2, 0.05, 0.25], dtype=f64)
    mu = Measure(X, w)
    op = SelfAttention(A, V)
    torch.testing.assert_close(op(mu).points, naive_attention(X, A, V, log_weights=w.log()))
    x = rand(2, 4, 3, seed=9)
    vel = op.velocity(mu, x)
    assert vel.shape == (2, 4, 3)
    P = torch.softmax(x @ A.T @ X.T + w.log(), -1)
    torch.testing.assert_close(vel, P @ X @ V.T)


def test_masked_velocity_uses_positions():
    A, V, X = rand(3, 3, seed=1), rand(3, 3, seed=2), rand(5, 3, seed=3)
    op = SelfAttention(A, V, masked=True)
    mu = Measure.sequence(X)
    vel = op.velocity(mu, X, positions=mu.positions)
    torch.testing.assert_close(vel, naive_attention(X, A, V, masked=True))
    with pytest.raises(ValueError, match="positions"):
        op.velocity(mu, X)


def test_duplicated_tokens_equal_merged_measure():
    n = 7
    A, V, y, z = rand(3, 3, seed=1), rand(3, 3, seed=2), rand(3, seed=3), rand(3, seed=4)
    X = torch.stack([y] + [z] * (n - 1))
    op = SelfAttention(A, V)
    two = Measure(torch.stack([y, z]), torch.tensor([1 / n, (n - 1) / n], dtype=f64))
    merged = op(two).points
    seq = op.sequence(X)
    torch.testing.assert_close(seq[0], merged[0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(seq[1:], merged[1].expand(n - 1, 3), rtol=1e-13, atol=1e-13)


def _masked_operator(kind, d):
    """A masked single head, multi-head layer or L2 layer on R^d."""
    if kind == "single":
        return SelfAttention(rand(d, d, seed=1), rand(d, d, seed=2), masked=True)
    if kind == "mha":
        return MultiHeadAttention([SelfAttention(rand(d, d, seed=s), rand(2, d, seed=s + 9), masked=True)
                                   for s in range(2)], rand(d, 4, seed=5))
    return L2SelfAttention(rand(2, d, 2, seed=1), rand(2, d, 2, seed=2), masked=True)


@pytest.mark.parametrize("op_kind", ["single", "mha", "l2"])
def test_positions_act_only_through_their_order(op_kind):
    """docs/math.md 2.4: F^m is piecewise constant in the positions. An order-preserving move of them (ties kept)
    changes no output; autograd reports them unused for the output points and gives the identity for the output
    positions (carried through); moving one position past another does change the output."""
    d = 3
    op = _masked_operator(op_kind, d)
    X = rand(6, d, seed=3).requires_grad_()
    s = torch.tensor([0.1, 0.3, 0.3, 0.5, 0.8, 0.9], dtype=f64, requires_grad=True)
    w = torch.tensor([0.1, 0.2, 0.15, 0.25, 0.1, 0.2], dtype=f64)
    out = op(Measure(X, w, s))
    moved = op(Measure(X.detach(), w, torch.tensor([0.0, 0.2, 0.2, 0.55, 0.6, 1.0], dtype=f64)))
    torch.testing.assert_close(moved.points, out.points.detach(), rtol=0, atol=1e-15)
    gx, gs = torch.autograd.grad(out.points.square().sum(), [X, s], allow_unused=True)
    assert gs is None and torch.isfinite(gx).all() and gx.abs().max() > 0
    assert torch.equal(out.positions, s.detach())     # carried through (the measure holds its own copy of s)
    (ident,) = torch.autograd.grad(out.positions @ torch.arange(6.0, dtype=f64), [s])
    torch.testing.assert_close(ident, torch.arange(6.0, dtype=f64))
    swapped = op(Measure(X.detach(), w, torch.tensor([0.1, 0.3, 0.3, 0.95, 0.8, 0.9], dtype=f64)))
    assert (swapped.points - out.points.detach()).abs().max() > 1e-6


@pytest.mark.parametrize("op_kind", ["single", "mha", "l2"])
def test_masked_output_does_not_depend_on_later_tokens(op_kind):
    d, n = 4, 6
    op = _masked_operator(op_kind, d)
    X = rand(n, d, seed=3)
    base = op.sequence(X)
    for i in range(n - 1):
        Y = X.clone()
        Y[i + 1:] += rand(n - i - 1, d, seed=10 + i)
        out = op.sequence(Y)
        torch.testing.assert_close(out[: i + 1], base[: i + 1], rtol=0, atol=1e-14)
        assert (out[i + 1:] - base[i + 1:]).abs().max() > 1e-6


@pytest.mark.parametrize("masked", [False, True])
def test_multihead_with_biases_matches_naive(masked):
    d, k, H = 6, 2, 3
    parts = [(rand(k, d, seed=10 * h + 1), rand(k, d, seed=10 * h + 2), rand(k, d, seed=10 * h + 3),
              rand(k, seed=10 * h + 4), rand(k, seed=10 * h + 5), rand(k, seed=10 * h + 6)) for h in range(H)]
    W_O, b = rand(d, H * k, seed=99), rand(d, seed=98)
    op = MultiHeadAttention([SelfAttention.from_qkv(*p, masked=masked) for p in parts], W_O, b)
    X = rand(2, 5, d, seed=7)
    expected = torch.cat([torch.stack([naive_qkv(x, *p, masked=masked) for x in X]) for p in parts], -1) @ W_O.T + b
    torch.testing.assert_close(op.sequence(X), expected, rtol=1e-12, atol=1e-12)
    assert op._stack is not None


def test_multihead_heads_of_different_shapes():
    d = 4
    heads = [SelfAttention(rand(d, d, seed=1), rand(3, d, seed=2)),
             SelfAttention.from_qkv(rand(2, d, seed=3), rand(2, d, seed=4), rand(1, d, seed=5))]
    W_O = rand(5, 4, seed=6)
    op = MultiHeadAttention(heads, W_O)
    assert op._stack is None
    X = rand(5, d, seed=7)
    expected = torch.cat([naive_attention(X, h.A, h.V) for h in heads], -1) @ W_O.T
    torch.testing.assert_close(op.sequence(X), expected)
    mu = Measure(X, torch.softmax(rand(5, seed=8), 0))
    torch.testing.assert_close(op(mu).points, torch.cat([h(mu).points for h in heads], -1) @ W_O.T)


@pytest.mark.parametrize("masked", [False, True])
def test_l2_attention_matches_kim_formula(masked):
    D, H, k = 6, 2, 3
    WQ, WV, WO = rand(H, D, k, seed=1), rand(H, D, k, seed=2), rand(H * k, D, seed=3)
    op = L2SelfAttention(WQ, WV, WO, masked=masked)
    X = rand(3, 5, D, seed=4)
    expected = torch.stack([naive_l2(x, WQ, WV, WO, masked) for x in X])
    torch.testing.assert_close(op.sequence(X), expected, rtol=1e-11, atol=1e-11)
    mu = Measure.sequence(X[0]) if masked else Measure.empirical(X[0])
    torch.testing.assert_close(op(mu).points, expected[0], rtol=1e-11, atol=1e-11)


def test_adversarial_radius_100_is_finite():
    """Proposition 3.4's witness X = (R u, R u/2, ..., R u/2) at R = 100: gamma R^2 ~ 1e4."""
    d, n, R = 3, 20, 100.0
    A = torch.diag(torch.tensor([2.0, 0.5, -0.3], dtype=f64))
    u = torch.tensor([1.0, 0.0, 0.0], dtype=f64)
    X = torch.stack([R * u] + [R * u / 2] * (n - 1))
    for masked in (False, True):
        op = SelfAttention(A, torch.eye(d, dtype=f64), masked=masked)
        out = op.sequence(X)
        assert torch.isfinite(out).all()
        # query R u/2 scores R^2 u^T A u / 2 on the first token vs R^2/4 on the others: all mass on token 0
        if not masked:
            torch.testing.assert_close(out[1:], (R * u).expand(n - 1, d))
    mu = Measure.two_dirac(R * u, R * u / 2, log_p=-2 * 0.25 * R**2)
    assert torch.isfinite(SelfAttention(A, torch.eye(d, dtype=f64))(mu).points).all()


def test_bad_inputs_name_the_argument():
    A, V = rand(3, 3, seed=1), rand(2, 3, seed=2)
    with pytest.raises(ValueError, match="A"):
        SelfAttention(rand(3, 2), V)
    with pytest.raises(ValueError, match="V"):
        SelfAttention(A, rand(2, 4))
    with pytest.raises(TypeError, match="masked"):
        SelfAttention(A, V, masked="yes")
    with pytest.raises(ValueError, match="A"):
        SelfAttention(np.array([[np.nan, 0, 0]] * 3), V)
    op = SelfAttention(A, V)
    with pytest.raises(ValueError, match="X"):
        op.sequence(rand(5, 4))
    with pytest.raises(TypeError, match="X"):
        op.sequence(Measure(rand(5, 3)))
    with pytest.raises(TypeError, match="mu"):
        op(rand(5, 3))
    with pytest.raises(ValueError, match="mu"):
        op(Measure(rand(5, 4)))
    with pytest.raises(TypeError, match="X"):
        op.sequence(rand(5, 3).float())
    with pytest.raises(ValueError, match="mu"):
        SelfAttention(A, V, masked=True)(Measure(rand(5, 3)))
    with pytest.raises(ValueError, match="key_bias"):
        SelfAttention(A, V, key_bias=rand(4))
    with pytest.raises(ValueError, match="b_Q"):
        SelfAttention.from_qkv(rand(2, 3), rand(2, 3), V, b_Q=rand(3))
    with pytest.raises(ValueError, match="K"):
        SelfAttention.from_qkv(rand(2, 3), rand(3, 3), V)
    with pytest.raises(TypeError, match="heads"):
        MultiHeadAttention(op, rand(3, 2))
    with pytest.raises(ValueError, match="heads\\[1\\]"):
        MultiHeadAttention([op, SelfAttention(A, V, masked=True)], rand(3, 4))
    with pytest.raises(ValueError, match="W_O"):
        MultiHeadAttention([op, op], rand(3, 3))
    with pytest.raises(ValueError, match="W_V"):
        L2SelfAttention(rand(2, 4, 2), rand(3, 4, 2))


def test_multihead_from_matrices_equals_multihead_from_heads():
    """The two construction forms build the same map (checked against the heads summed through W_O by
    hand), and the natural wrong guesses get a message that shows the right form."""
    g = np.random.default_rng(3)
    A1, A2, V1, V2 = g.standard_normal((4, 3, 3))
    W = g.standard_normal((3, 6))
    X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for masked in (False, True):
        heads = [SelfAttention(A1, V1, masked=masked), SelfAttention(A2, V2, masked=masked)]
        by_hand = torch.cat([h.sequence(X) for h in heads], -1) @ torch.as_tensor(W).T
        for op in (MultiHeadAttention(heads, W), MultiHeadAttention(heads, W_O=W),
                   MultiHeadAttention([A1, A2], [V1, V2], W_O=W, masked=masked)):
            assert op.masked == masked
            assert torch.allclose(op.sequence(X), by_hand, atol=1e-13)
    with pytest.raises(TypeError, match=r"MultiHeadAttention\(\[A1, A2, \.\.\.\], \[V1, V2, \.\.\.\], W_O=\.\.\."):
        MultiHeadAttention([A1, A2], W_O=W)
    with pytest.raises(ValueError, match="one value matrix per head"):
        MultiHeadAttention([A1, A2], [V1], W_O=W)
    with pytest.raises(TypeError, match="W_O"):
        MultiHeadAttention([A1, A2], [V1, V2])
    with pytest.raises(TypeError, match="heads: expected a list"):
        MultiHeadAttention(A1, W)
    with pytest.raises(TypeError, match="W_O: given twice"):
        MultiHeadAttention([SelfAttention(A1, V1)], W[:, :3], W_O=W[:, :3])


# ---------------------------------------------------------------- review: far tokens, bad arguments
@pytest.mark.parametrize("masked", [False, True])
def test_l2_attention_in_float32_far_from_the_origin(masked):
    """Six tokens within 0.5 of a point at radius R = 1e3 and 1e4: the scores -|q_i - q_j|^2 are small, but
    2<q_i, q_j> - |q_j|^2 holds terms of size R^2 that cancel (float32 lost the weights at 1e4). Truth:
    tests/reference.py's difference form in float64; float32 must stay within a few 1e-3 of the outputs'
    spread, as the difference form in float32 does."""
    g = torch.Generator().manual_seed(0)
    WQ = torch.randn(1, 4, 4, generator=g, dtype=torch.float64)
    WV = torch.randn(1, 4, 4, generator=g, dtype=torch.float64)
    op = L2SelfAttention(WQ.float(), WV.float(), masked=masked)
    for R in (1e3, 1e4):
        c = torch.randn(4, generator=g, dtype=torch.float64)
        X = R * c / c.norm() + 0.5 * torch.randn(6, 4, generator=g, dtype=torch.float64)
        X32 = X.float()
        truth = naive_l2(X32.double(), WQ.float().double(), WV.float().double(), torch.eye(4, dtype=torch.float64),
                         masked)
        spread = (truth - truth.mean(0)).abs().max()
        assert float((op.sequence(X32).double() - truth).abs().max() / spread) < 5e-3, R


def test_bad_arguments_of_the_operators_are_named():
    A = [torch.eye(2, dtype=torch.float64)] * 2
    for bad in ("False", "no", 1):
        with pytest.raises(TypeError, match="masked: expected True or False"):
            MultiHeadAttention(A, A, W_O=torch.eye(4, 2, dtype=torch.float64), masked=bad)
    with pytest.raises(ValueError, match="W_Q: expected at least one head"):
        L2SelfAttention(np.ones((3, 0)), np.ones((3, 2)))
    op = SelfAttention(torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64), masked=True)
    mu = Measure.sequence(torch.randn(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"positions: must lie in \[0, 1\]"):
        op.velocity(mu, torch.zeros(2, 2, dtype=torch.float64), positions=torch.tensor([-1.0, 2.0]).double())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", ["dense", "stream"])
def test_masked_l2_attention_never_reads_a_later_token(dtype, method):
    """Moving the second half of a sequence (by 2, and by 1e4) changes none of the first half's outputs, bit for
    bit: the scores' centre must not depend on later keys (the keys' mean did, through rounding)."""
    from meanfield import kernels

    g = torch.Generator().manual_seed(7)
    WQ, WV = torch.randn(2, 3, 2, generator=g, dtype=dtype), torch.randn(2, 3, 2, generator=g, dtype=dtype)
    op = L2SelfAttention(WQ, WV, masked=True)
    X = torch.randn(40, 3, generator=g, dtype=dtype)
    with kernels.use(method):
        base = op.sequence(X)
        for shift in (2.0, 1e4):
            Y = X.clone()
            Y[20:] += shift
            assert torch.equal(op.sequence(Y)[:20], base[:20]), shift


def test_from_qkv_scale_is_a_real_number():
    """scale="0.5" and scale=True were taken by float(); a tensor's graph was dropped. Each is refused by name."""
    Q, K, V = rand(2, 3, seed=1), rand(2, 3, seed=2), rand(3, 3, seed=3)
    for bad in ("0.5", True, torch.tensor(0.5, requires_grad=True)):
        with pytest.raises(TypeError, match="scale: expected a real number"):
            SelfAttention.from_qkv(Q, K, V, scale=bad)
    a = SelfAttention.from_qkv(Q, K, V, scale=np.float64(0.5))
    b = SelfAttention.from_qkv(Q, K, V, scale=0.5)
    torch.testing.assert_close(a.sequence(rand(4, 3, seed=4)), b.sequence(rand(4, 3, seed=4)))


@pytest.mark.parametrize("masked", [False, True])
def test_l2_attention_ignores_keys_of_zero_mass(masked):
    """An atom of zero mass is not in the measure: L2 attention's centring point c (an exact reformulation of
    -|q - k|^2 that only moves rounding) took it into the keys' mean, and one at |x| = 1e6 changed the outputs
    by 4e-5. Masked, a zero-mass atom at the first position was the centre. Now the outputs equal those without
    the atom to rounding (the formula: test_l2_attention_matches_kim_formula)."""
    X = rand(4, 3, seed=1)
    op = L2SelfAttention(rand(3, 2, seed=2), rand(3, 2, seed=3), masked=masked)
    far = torch.full((1, 3), 1e6, dtype=f64)
    pos = torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=f64)
    ref = Measure(X, positions=pos if masked else None)
    with_far = Measure(torch.cat([far, X]), [0.0, 0.25, 0.25, 0.25, 0.25],
                       positions=torch.cat([torch.tensor([0.1], dtype=f64), pos]) if masked else None)
    torch.testing.assert_close(op(with_far).points[1:], op(ref).points, rtol=1e-13, atol=1e-13)
