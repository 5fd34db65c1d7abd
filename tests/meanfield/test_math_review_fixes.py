"""Fixes of an independent mathematical review: each test compares the framework with a truth written here
(float64 dense Jacobians from torch.autograd.functional.jacobian and their top singular values, closed forms,
finite differences), and each failed before its fix.

1. operator_upper on L2 heads reads the record's scale (and refuses an L2 key bias);
2. IsotropicAttention("USA") on a sequence carries the 1/n of uniform weights (docs/math.md section 6.3);
3. mass splitting (query Jacobians, their gradient, the worst-case search for measures) works on operators
   without forward-mode derivatives (torch's fused attention kernels: nn.MultiheadAttention, BERT on SDPA);
4. bad input (atom indices, singular-vector shapes, Parameters / Head records) is an error naming the argument;
5. a query that sees no key of positive weight gets no value bias (docs/math.md section 2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.autograd.functional import jacobian

from meanfield import L2SelfAttention, MultiHeadAttention, SelfAttention, as_operator, local_lipschitz, operator_upper
from meanfield.isotropic import IsotropicAttention
from meanfield.operator import AttentionOperator
from meanfield.parameters import Head, Parameters
from meanfield.sigma_gradient import sigma_gradient
from meanfield.splitting import query_jacobians, query_term_gradient, split_lipschitz, split_measure
from particles import Measure

f64 = torch.float64


def rand(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, dtype=f64, generator=torch.Generator().manual_seed(seed))


def top_sv(J) -> float:
    return float(torch.linalg.matrix_norm(J, ord=2))


def dense_lip(fn, X) -> float:
    """Top singular value of the dense Jacobian of fn: (n, d) -> (n, d_out) at X (Frobenius norms)."""
    J = jacobian(fn, X)
    return top_sv(J.reshape(fn(X).numel(), X.numel()))


def dense_weighted_lip(fn, Y, log_weights) -> float:
    """Lemma C.5: the W2 local constant at the measure (Y, a) is the top singular value of D^{1/2} J D^{-1/2},
    J the Jacobian of fn: (N, d) -> (N, d_out) with the weights held fixed, D = diag(a) per token."""
    J = jacobian(fn, Y)                                     # (N, d_out, N, d)
    a = torch.exp(log_weights)
    M = a.sqrt()[:, None, None, None] * J / a.sqrt()[None, None, :, None]
    return top_sv(M.reshape(fn(Y).numel(), Y.numel()))


# ====================================================================== 1. L2 heads: the record's scale
class ScaledL2(AttentionOperator):
    """A custom operator consistent with its record: one L2 head, scores -s |Q x - Q y|^2, values V (s Q^T Q) y
    (meanfield.parameters), evaluated through a written-out softmax."""

    masked = False
    dtype = f64
    device = torch.device("cpu")

    def __init__(self, Q, V, s, key_bias=None):
        self.Q, self.V, self.s, self.c = Q, V, s, key_bias

    d_in = property(lambda self: self.Q.shape[1])
    d_out = property(lambda self: self.V.shape[0])

    def parameters(self, d=None):
        return Parameters((Head(self.Q, self.Q, self.V, self.c, None, self.s, "l2"),))

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        return l2_map(x, keys, self.Q, self.V, self.s, self.c, log_weights)


def l2_map(x, keys, Q, V, s, c=None, log_weights=None):
    qx, qy = x @ Q.T, keys @ Q.T
    S = -s * ((qx[:, None, :] - qy[None, :, :]) ** 2).sum(-1)
    if c is not None:
        S = S + keys @ c
    if log_weights is not None:
        S = S + log_weights
    return torch.softmax(S, dim=-1) @ (keys @ (s * Q.T @ Q) @ V.T)


@pytest.mark.parametrize("s", [1.0, 0.2, 3.0])
def test_l2_upper_uses_the_record_scale_and_is_attained_at_one_token(s):
    """At N = 1 the softmax is 1 and the map is x -> V (s Q^T Q) x: with Q = q I and V = I (k = d = 4) its constant
    is s q^2 exactly (dense Jacobian), and Kim et al.'s corrected bound is attained there. Before the fix the bound
    assumed s = 1/sqrt(k): 2.0 instead of 4.0 at s = 1, q = 2 (below the truth)."""
    k, q = 4, 2.0
    op = ScaledL2(q * torch.eye(k, dtype=f64), torch.eye(k, dtype=f64), s)
    X1 = rand(1, k, seed=0)
    truth = dense_lip(lambda Y: l2_map(Y, Y, op.Q, op.V, s), X1)
    assert truth == pytest.approx(s * q * q, rel=1e-12)
    assert float(local_lipschitz(op, X1, method="dense").value) == pytest.approx(truth, rel=1e-10)
    b = operator_upper(op, R=1.0, n=1)
    assert b.known and b.value == pytest.approx(truth, rel=1e-10)


def test_deprecated_l2_bound_of_an_operator_reads_the_record_scale():
    """bounds.l2_attention_upper(op, N=...) (the deprecated spelling) read Q^T as Kim et al.'s W_Q whatever the
    record's scale: 2.0 for the constant 4.0 of the head at N = 1 (scale 1, Q = 2 I, k = 4); it now gives
    operator_upper's bound, attained there, and refuses a key bias."""
    from meanfield.bounds import l2_attention_upper

    k, q = 4, 2.0
    op = ScaledL2(q * torch.eye(k, dtype=f64), torch.eye(k, dtype=f64), 1.0)
    truth = dense_lip(lambda Y: l2_map(Y, Y, op.Q, op.V, 1.0), rand(1, k, seed=0))
    with pytest.warns(DeprecationWarning):
        assert l2_attention_upper(op, N=1) == pytest.approx(truth, rel=1e-10)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="W_Q: L2 head 0 has a key bias"):
        l2_attention_upper(ScaledL2(op.Q, op.V, 1.0, key_bias=torch.ones(k, dtype=f64)), N=1)


@pytest.mark.parametrize("s", [0.05, 1.0, 4.0])
def test_l2_upper_is_above_dense_constants_at_any_scale(s):
    """Random heads (k = 2 rows, d = 3), scales far from 1/sqrt(k): the bound is never below the dense constant
    of the written-out map on random sequences of 3 tokens; for scales below 1/sqrt(k) the old bound was too
    large, for scales above it too small (checked on the largest constant here)."""
    Q, V = rand(2, 3, seed=1), rand(3, 3, seed=2)
    op = ScaledL2(Q, V, s)
    b = operator_upper(op, R=1.0, n=3)
    lips = [dense_lip(lambda Y: l2_map(Y, Y, Q, V, s), rand(3, 3, seed=10 + t, scale=2.0)) for t in range(8)]
    assert b.known and max(lips) <= b.value * (1 + 1e-12)
    # the map with scale s is Kim et al.'s with W_Q = sqrt(s sqrt(k)) Q^T: the bound of L2SelfAttention of those weights
    twin = L2SelfAttention(math.sqrt(s * math.sqrt(2)) * Q.T, V.T)
    X = rand(3, 3, seed=5)
    assert torch.allclose(twin.sequence(X), l2_map(X, X, Q, V, s), rtol=1e-12, atol=1e-13)
    assert b.value == pytest.approx(operator_upper(twin, R=1.0, n=3).value, rel=1e-12)


def test_l2_upper_unchanged_for_l2_self_attention():
    """L2SelfAttention's record has s = 1/sqrt(k): the bound is that of bounds.l2_attention_upper on its weights."""
    from meanfield.bounds import l2_attention_upper

    WQ, WV, WO = rand(2, 4, 2, seed=3), rand(2, 4, 3, seed=4), rand(6, 4, seed=5)
    op = L2SelfAttention(WQ, WV, WO)
    want = l2_attention_upper(list(WQ.numpy()), list(WV.numpy()), WO.numpy(), N=5)
    assert operator_upper(op, R=1.0, n=5).value == pytest.approx(want, rel=1e-12)


def test_l2_key_bias_is_refused_by_the_bound():
    """A key bias c adds <c, y> to the scores, which Kim et al.'s bound does not cover: the constant of the biased
    map exceeds the bound of the same head without it, so operator_upper says it knows none (it used to ignore c
    and return that bound)."""
    Q, V = 0.5 * torch.eye(2, dtype=f64), torch.eye(2, dtype=f64)
    c = torch.tensor([40.0, 0.0], dtype=f64)
    s = 1.0 / math.sqrt(2)
    plain = operator_upper(ScaledL2(Q, V, s), R=1.0, n=2)
    X = torch.tensor([[0.0, 0.3], [0.02, -0.3]], dtype=f64)
    truth = dense_lip(lambda Y: l2_map(Y, Y, Q, V, s, c), X)
    assert truth > plain.value                                    # ignoring c would not bound the map
    b = operator_upper(ScaledL2(Q, V, s, key_bias=c), R=1.0, n=2)
    assert not b.known and "key bias" in b.source


# ====================================================================== 2. USA on sequences: 1/n
@pytest.mark.parametrize("masked", [False, True])
def test_usa_sequence_is_the_field_of_uniform_weights(masked):
    """docs/math.md section 6.3: Gamma(x_i) = sum_j (1/n) e^{beta <x_i, x_j>} x_j (masked: j <= i), the map of the
    empirical measure (F(m(X)) = m(f(X))); its local constant is the dense one of that closed form, and the
    measure's (Lemma 3.2). The sequence map used to omit the 1/n (n times too large)."""
    beta, n = 0.7, 5
    X = rand(n, 3, seed=6)

    def usa(Y):
        E = torch.exp(beta * Y @ Y.T)
        if masked:
            E = torch.tril(E)
        return E @ Y / Y.shape[0]

    op = IsotropicAttention(beta, "USA", masked=masked)
    assert torch.allclose(op.sequence(X), usa(X), rtol=1e-12, atol=1e-13)
    mu = Measure.sequence(X) if masked else Measure(X)
    assert torch.allclose(op(mu).points, usa(X), rtol=1e-12, atol=1e-13)
    truth = dense_lip(usa, X)
    est = local_lipschitz(op, X, method="dense")
    assert float(est.value) == pytest.approx(truth, rel=1e-10)
    assert float(sigma_gradient(op, X, est.vector).sigma) == pytest.approx(truth, rel=1e-8)
    # batches: each sequence its own 1/n
    Xb = torch.stack([X, rand(n, 3, seed=7)])
    assert torch.allclose(op.sequence(Xb)[1], usa(Xb[1]), rtol=1e-12, atol=1e-13)


# ====================================================================== 3. splitting without forward mode
def mha_field(m, x, keys, log_weights, q_pos=None, k_pos=None):
    """nn.MultiheadAttention written out: Gamma(x) = W_O concat_h softmax(scale q_h . k_h + log a) v_h + b_O."""
    E, H = m.embed_dim, m.num_heads
    k = E // H
    W, b = m.in_proj_weight.detach(), m.in_proj_bias.detach()
    q, kk, v = x @ W[:E].T + b[:E], keys @ W[E:2 * E].T + b[E:2 * E], keys @ W[2 * E:].T + b[2 * E:]
    outs = []
    for h in range(H):
        r = slice(h * k, (h + 1) * k)
        S = q[:, r] @ kk[:, r].T / math.sqrt(k) + log_weights
        if q_pos is not None:
            S = S.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        outs.append(torch.softmax(S, -1) @ v[:, r])
    return torch.cat(outs, -1) @ m.out_proj.weight.detach().T + m.out_proj.bias.detach()


def make_mha(E=4, H=2, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, dtype=f64).eval()
    with torch.no_grad():
        m.in_proj_bias.normal_()
        m.out_proj.bias.normal_()
    return m


def query_truth(field, mu, pos):
    """Q_i = d/dx Gamma_mu(x) at x_i (keys, weights, positions fixed), by dense Jacobians."""
    X, lw = mu.points, mu.log_weights
    out = []
    for i in range(mu.n):
        qp = None if pos is None else pos[i:i + 1]
        out.append(jacobian(lambda x, qp=qp: field(x[None], X, lw, qp, pos)[0], X[i]))
    return torch.stack(out)


@pytest.mark.parametrize("masked", [False, True])
def test_splitting_on_torch_multihead_attention(masked):
    """nn.MultiheadAttention runs torch's fused CPU kernel, which has no forward mode (NotImplementedError before the
    fix): the query Jacobians equal the dense ones of the written-out layer, and split_lipschitz equals the dense
    weighted constant (Lemma C.5) of the measure with every atom split (docs/math.md section 4.7)."""
    m = make_mha(seed=1)
    op = as_operator(m, masked=masked)
    N = 4
    pos = torch.tensor([0.2, 0.2, 0.5, 0.9], dtype=f64) if masked else None
    mu = Measure(rand(N, 4, seed=8, scale=1.5), torch.softmax(rand(N, seed=9), 0), positions=pos)
    field = lambda x, keys, lw, qp=None, kp=None: mha_field(m, x, keys, lw, qp, kp)
    Q = query_jacobians(op, mu)
    assert torch.allclose(Q, query_truth(field, mu, pos), rtol=1e-9, atol=1e-11)
    s = split_lipschitz(op, mu, tol=1e-12)
    sp = split_measure(mu, range(N))
    truth = dense_weighted_lip(lambda Y: field(Y, Y, sp.log_weights, sp.positions, sp.positions), sp.points,
                               sp.log_weights)
    assert s.value == pytest.approx(truth, rel=1e-8)


def test_query_term_gradient_on_torch_multihead_attention():
    """||Q_atom||_2 and its gradient in the points and the logits of the weights, against central finite
    differences of the dense query Jacobian of the written-out layer."""
    m = make_mha(seed=2)
    op = as_operator(m)
    N, atom = 3, 1
    X, z = rand(N, 4, seed=10), rand(N, seed=11)

    def norm(Y, logits):
        lw = logits - torch.logsumexp(logits, 0)
        return top_sv(jacobian(lambda x: mha_field(m, x[None], Y, lw)[0], Y[atom]))

    value, gX, gz = query_term_gradient(op, Measure(X, log_weights=z - torch.logsumexp(z, 0)), atom)
    assert value == pytest.approx(norm(X, z), rel=1e-10)
    h = 1e-6
    for t in range(3):
        E, e = rand(N, 4, seed=20 + t), rand(N, seed=30 + t)
        fd = (norm(X + h * E, z + h * e) - norm(X - h * E, z - h * e)) / (2 * h)
        assert float((gX * E).sum() + (gz * e).sum()) == pytest.approx(fd, rel=1e-5, abs=1e-7)


def test_splitting_on_bert_with_sdpa():
    """A Hugging Face BertSelfAttention on SDPA (no forward mode on CPU): the query Jacobians equal the dense ones
    of the written-out layer (concatenated heads, scale 1/sqrt(head size))."""
    pytest.importorskip("transformers")
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    torch.manual_seed(3)
    cfg = BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=16, attn_implementation="sdpa")
    layer = BertSelfAttention(cfg).double().eval()
    op = as_operator(layer)
    N = 4
    mu = Measure(rand(N, 8, seed=12), torch.softmax(rand(N, seed=13), 0))

    def field(x, keys, lw, qp=None, kp=None):
        q, k, v = layer.query(x), layer.key(keys), layer.value(keys)
        outs = []
        for h in range(2):
            r = slice(4 * h, 4 * h + 4)
            outs.append(torch.softmax(q[:, r] @ k[:, r].T / 2.0 + lw, -1) @ v[:, r])
        return torch.cat(outs, -1)

    with torch.no_grad():
        assert torch.allclose(op(mu).points, field(mu.points, mu.points, mu.log_weights), rtol=1e-10, atol=1e-12)
    Q = query_jacobians(op, mu)
    assert torch.allclose(Q, query_truth(field, mu, None), rtol=1e-9, atol=1e-11)
    s = split_lipschitz(op, mu, tol=1e-12)
    assert s.value >= float(torch.linalg.matrix_norm(Q, ord=2).max()) * (1 - 1e-12)


def test_worst_case_measure_on_torch_multihead_attention():
    """The search for measures splits atoms by default; on nn.MultiheadAttention it crashed on the query
    derivative. Its certified value is the dense weighted constant of the returned measure."""
    from meanfield.worst_case import worst_case_measure

    m = make_mha(seed=4)
    r = worst_case_measure(as_operator(m), R=1.0, atoms=3, budget=200)
    mu = r.input
    truth = dense_weighted_lip(lambda Y: mha_field(m, Y, Y, mu.log_weights), mu.points, mu.log_weights)
    assert r.lower == pytest.approx(truth, rel=1e-6)
    assert float(mu.points.norm(dim=-1).max()) <= 1.0 + 1e-9


# ====================================================================== 4. bad input
def small_measure():
    return Measure(rand(3, 2, seed=14), torch.tensor([0.2, 0.3, 0.5], dtype=f64))


@pytest.mark.parametrize("atom, error", [(7, IndexError), (3, IndexError), (-1, IndexError), (1.9, TypeError),
                                         (True, TypeError), ("1", TypeError)])
def test_split_measure_refuses_bad_atoms(atom, error):
    """An atom index is an integer in [0, n): 7 used to wrap to atom 1, 1.9 and True were taken for atom 1."""
    with pytest.raises(error, match="atoms"):
        split_measure(small_measure(), [atom])


def test_split_measure_splits_the_named_atoms():
    sp = split_measure(small_measure(), [np.int64(0), torch.tensor(2)])
    assert torch.allclose(sp.weights, torch.tensor([0.1, 0.1, 0.3, 0.25, 0.25], dtype=f64))


@pytest.mark.parametrize("atom, error", [(5, IndexError), (-1, IndexError), (1.9, TypeError), (False, TypeError)])
def test_query_term_gradient_refuses_bad_atoms(atom, error):
    op = SelfAttention(rand(2, 2, seed=15), rand(2, 2, seed=16))
    with pytest.raises(error, match="atom"):
        query_term_gradient(op, small_measure(), atom)


def test_sigma_gradient_refuses_a_vector_of_another_shape():
    """A transposed (d, n) vector has the n d entries of the points: it used to be read row by row as another
    direction, giving a sigma far from the estimate's (0.39 for 2.37)."""
    op = SelfAttention(rand(2, 2, seed=17), rand(2, 2, seed=18))
    X = rand(3, 2, seed=19)
    est = local_lipschitz(op, X, method="dense")
    assert float(sigma_gradient(op, X, est.vector).sigma) == pytest.approx(dense_lip(op.sequence, X), rel=1e-10)
    for bad in (est.vector.T.contiguous(), est.vector.reshape(-1), est.vector[None]):
        with pytest.raises(ValueError, match="vector"):
            sigma_gradient(op, X, bad)
    mu = small_measure()
    with pytest.raises(ValueError, match="vector"):
        sigma_gradient(op, mu, local_lipschitz(op, mu).vector.T.contiguous())


I3, I4 = torch.eye(3, dtype=f64), torch.eye(4, dtype=f64)


@pytest.mark.parametrize("build, name", [
    (lambda: Head(I3, 2 * I3, I3, kind="l2"), "K"),
    (lambda: Head(I3, I3, I3, key_bias=torch.ones(5, dtype=f64)), "key_bias"),
    (lambda: Head(I3, I3, I3, value_bias=torch.ones(7, dtype=f64)), "value_bias"),
    (lambda: Head(I3, I3, I3, key_bias=torch.ones(3, 1, dtype=f64)), "key_bias"),
    (lambda: Head(torch.full((3, 3), float("nan"), dtype=f64), I3, I3), "Q"),
    (lambda: Head(I3, I3, torch.full((3, 3), float("inf"), dtype=f64)), "V"),
    (lambda: Head(I3, I3, I3, value_bias=torch.tensor([0.0, float("nan"), 0.0], dtype=f64)), "value_bias"),
    (lambda: Head(I3, I3, I3, scale=True), "scale"),
    (lambda: Parameters((Head(I3, I3, I3), Head(I4, I4, I4))), "heads"),
    (lambda: Parameters((Head(I3, I3, I3),), bias=torch.ones(9, dtype=f64)), "bias"),
    (lambda: Parameters((Head(I3, I3, I3),), W_O=I3, bias=torch.ones(4, dtype=f64)), "bias"),
    (lambda: Parameters((Head(I3, I3, I3),), W_O=torch.full((3, 3), float("nan"), dtype=f64)), "W_O"),
    (lambda: Parameters((Head(I3, I3, I3),), masked="yes"), "masked"),
    (lambda: Parameters((Head(I3, I3, I3),), masked=1), "masked"),
    (lambda: Parameters((I3,)), "heads"),
])
def test_parameter_records_refuse_bad_fields(build, name):
    """Each of these was accepted; operator_upper then bounded a record of heads of dimensions 3 and 4."""
    with pytest.raises((ValueError, TypeError), match=name):
        build()


def test_parameter_records_accept_consistent_fields():
    h = Head(I3, I3, rand(2, 3, seed=20), key_bias=torch.ones(3, dtype=f64), value_bias=torch.ones(2, dtype=f64),
             scale=0.5)
    p = Parameters((h, h), W_O=rand(3, 4, seed=21), bias=torch.zeros(3, dtype=f64), masked=np.bool_(True))
    assert p.masked is True and p.dim == 3
    q = rand(2, 3, seed=22)
    assert Head(q, q.clone(), I3, kind="l2").kind == "l2"


# ====================================================================== 5. blind queries: no value bias
def test_blind_query_gets_the_output_bias_only():
    """A query before every key sees nothing: its heads are zero (docs/math.md section 2), so the layer gives its
    output bias. nn.MultiheadAttention (its adapter) and MultiHeadAttention.from_parameters of the same record
    agree on it (the latter used to add W_O b_V), and on the queries that see keys they equal the written-out
    layer."""
    m = make_mha(seed=5)
    op = as_operator(m, masked=True)
    twin = MultiHeadAttention.from_parameters(op.parameters(), masked=True)
    pos = torch.tensor([0.5, 0.6, 0.7], dtype=f64)
    mu = Measure(rand(3, 4, seed=23), torch.ones(3, dtype=f64) / 3, pos)
    x = rand(3, 4, seed=24)
    qp = torch.tensor([0.1, 0.55, 0.8], dtype=f64)          # the first blind, the others see 1 and 3 keys
    bias = m.out_proj.bias.detach()
    want = mha_field(m, x[1:], mu.points, mu.log_weights, qp[1:], pos)
    for f in (op, twin):
        v = f.velocity(mu, x, positions=qp)
        assert torch.allclose(v[0], bias, rtol=0, atol=1e-14)
        assert torch.allclose(v[1:], want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("heads", [1, 2])
def test_blind_query_has_no_value_bias_in_self_attention(heads):
    """SelfAttention with a value bias (and the stacked multi-head path): a query that sees no key of positive
    weight (before every key, or after only keys of mass zero) is zero, a seen one gets sum_j P_ij V x_j + b_V."""
    d = 3
    A, V, bV = rand(d, d, seed=25), rand(d, d, seed=26), rand(d, seed=27)
    sa = SelfAttention(A, V, masked=True, value_bias=bV)
    op = sa if heads == 1 else MultiHeadAttention([sa, sa], torch.cat([I3, I3], 1) / 2)
    pos = torch.tensor([0.2, 0.4, 0.9], dtype=f64)
    mu = Measure(rand(3, d, seed=28), torch.tensor([0.0, 0.5, 0.5], dtype=f64), pos)
    x = rand(3, d, seed=29)
    qp = torch.tensor([0.1, 0.3, 0.95], dtype=f64)          # before every key; after the mass-0 key only; sees all
    v = op.velocity(mu, x, positions=qp)
    assert torch.equal(v[:2], torch.zeros(2, d, dtype=f64))
    P = torch.softmax(mu.points @ A @ x[2] + torch.log(mu.weights), 0)
    assert torch.allclose(v[2], P @ mu.points @ V.T + bV, rtol=1e-12, atol=1e-13)


class _SoftmaxWithoutForwardMode(torch.autograd.Function):
    """softmax with a (twice differentiable) backward and no forward-mode rule."""

    @staticmethod
    def forward(s):
        return torch.softmax(s, dim=-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return p * (g - (g * p).sum(-1, keepdim=True))


class NoForwardAttention(AttentionOperator):
    """Single-head attention softmax(<A x, y> + log a) V y through a softmax without forward mode."""

    masked = False
    dtype = f64
    device = torch.device("cpu")

    def __init__(self, A, V):
        self.A, self.V = A, V

    d_in = property(lambda self: self.A.shape[0])
    d_out = property(lambda self: self.V.shape[0])

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        S = x @ self.A.T @ keys.transpose(-1, -2)
        if log_weights is not None:
            S = S + log_weights
        return _SoftmaxWithoutForwardMode.apply(S) @ (keys @ self.V.T)


def test_splitting_falls_back_to_reverse_over_reverse():
    """An operator with no forward-mode rule at all (not only torch's fused kernel): the query Jacobians and the
    gradient of ||Q_atom|| come from the shared reverse-over-reverse fallback; Q_i = V Sigma_mu(x_i) A."""
    A, V = rand(2, 2, seed=40), rand(2, 2, seed=41)
    op = NoForwardAttention(A, V)
    X, w = rand(3, 2, seed=42), torch.softmax(rand(3, seed=43), 0)
    mu = Measure(X, w / w.sum())
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.func.jvp(lambda q: op.evaluate(q, X, w.log()), (X,), (X,))
    Q = query_jacobians(op, mu)
    for i in range(3):
        P = torch.softmax(X @ A @ X[i] + w.log(), 0)
        m = P @ X
        assert torch.allclose(Q[i], V @ ((X - m).T @ ((X - m) * P[:, None])) @ A, rtol=1e-10, atol=1e-12)
    twin = SelfAttention(A, V)
    value, gX, gz = query_term_gradient(op, mu, 2)
    value2, gX2, gz2 = query_term_gradient(twin, mu, 2)
    assert value == pytest.approx(value2, rel=1e-12)
    assert torch.allclose(gX, gX2, rtol=1e-9, atol=1e-12) and torch.allclose(gz, gz2, rtol=1e-9, atol=1e-12)


def test_interaction_energy_and_usa_row_sums_in_blocks_of_bounded_size(monkeypatch):
    """interaction_energy built the N x N matrix (80 GB at N = 1e5 in float64) and the USA field's row log-sums
    took 2048 rows against every key (16 GB for 4096 queries against 1e6 keys); both now work in blocks of a
    bounded number of entries. Shrunk here to a few hundred entries, they equal the formulas written out in
    float64 (several blocks, a trajectory's leading axis included)."""
    from meanfield import clustering, isotropic
    from particles import Measure

    g = torch.Generator().manual_seed(4)
    X = torch.randn(37, 3, generator=g, dtype=f64)
    w = torch.rand(37, generator=g, dtype=f64) + 0.1
    a = (w / w.sum()).numpy()
    beta = 0.7
    G = X.numpy() @ X.numpy().T
    truth = float((a[:, None] * a[None, :] * np.exp(beta * G)).sum() / (2 * beta))
    traj = torch.stack([X, 0.5 * X])
    truth_t = [truth, float((a[:, None] * a[None, :] * np.exp(beta * 0.25 * G)).sum() / (2 * beta))]
    monkeypatch.setattr(clustering, "ENERGY_BLOCK", 100)
    assert clustering.interaction_energy(Measure(X, w / w.sum()), beta) == pytest.approx(truth, rel=1e-13)
    assert np.allclose(clustering.interaction_energy(traj, beta, weights=w), truth_t, rtol=1e-13)
    monkeypatch.setattr(isotropic, "LSE_BLOCK", 200)
    lse = isotropic._row_logsumexp(beta * X, X, torch.log(w / w.sum()), None, None)
    want = np.log((a[None, :] * np.exp(beta * G)).sum(1))
    assert np.allclose(lse.numpy(), want, rtol=1e-13, atol=1e-13)
    usa = IsotropicAttention(beta, "USA")
    mu = Measure(X, w / w.sum())
    field = (a[None, :] * np.exp(beta * G)) @ X.numpy()   # USA: sum_j a_j e^{beta <x_i, x_j>} x_j
    assert np.allclose(usa(mu).points.numpy(), field, rtol=1e-12, atol=1e-12)


def test_long_lipschitz_estimates_log_their_progress(monkeypatch, caplog):
    """local_lipschitz said nothing until it returned (at N = 1e5 on CPU a product takes about a minute, and a
    run gave no sign of life for hours): with the progress period at 0 s every Lanczos step and power iteration
    logs at INFO, and the estimate is unchanged (the dense Jacobian's top singular value)."""
    import logging

    from particles import progress

    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)
    X = rand(6, 3, seed=2)
    att = SelfAttention(rand(3, 3, seed=3), rand(3, 3, seed=4))
    truth = dense_lip(att.sequence, X)
    for method in ("lanczos", "power"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="meanfield.krylov"):
            est = local_lipschitz(att, X, method=method, tol=1e-8)
        lines = [r.getMessage() for r in caplog.records if r.name == "meanfield.krylov"]
        # a step of the budget, or (since the progress review) a certificate with the dtype of its products
        assert lines and all(f"local_lipschitz ({method}" in m and ("of at most" in m or "certified with products in"
                                                                    in m) for m in lines), lines
        assert est.value == pytest.approx(truth, rel=1e-7)


@pytest.mark.parametrize("route", ["edges", "cells"])
def test_linked_components_without_the_edge_list_equal_the_edge_list_ones(route, monkeypatch):
    """The large-N clustering listed every pair of grid representatives within r (3.9 GB for 1e5 tokens of a partly
    collapsed cloud); above a budget of edges it now links coarse cells by nearest-neighbour queries
    (particles.linkage, which Measure.merge shares in the max-norm). Either route's partition equals the connected
    components of the full edge list (scipy), on random clouds of several scales and dimensions."""
    import particles.linkage

    if route == "cells":   # no edge is listed
        monkeypatch.setattr(particles.linkage, "edge_budget", lambda m: 0)
    import numpy as np
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    from particles.linkage import linked_components

    rng = np.random.default_rng(0)
    for trial in range(24):
        d = (1, 2, 3, 5)[trial % 4]
        m = int(rng.integers(2, 600))
        X = rng.normal(size=(m, d)) * rng.choice([0.05, 1.0, 3.0], size=(m, 1)) + rng.integers(0, 3, size=(m, 1))
        r = float(rng.uniform(0.05, 0.6))
        pairs = cKDTree(X).query_pairs(r=r, output_type="ndarray")
        graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(m, m))
        want = connected_components(graph, directed=False)[1]
        for p in (2.0, np.inf):
            if p == np.inf:
                pairs = cKDTree(X).query_pairs(r=r, p=np.inf, output_type="ndarray")
                graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(m, m))
                want = connected_components(graph, directed=False)[1]
            got = linked_components(X, r, p=p)
            # the same partition: a bijection between the labels
            assert len(set(zip(got.tolist(), want.tolist()))) == len(set(got.tolist())) == len(set(want.tolist()))
    # on lattices spaced exactly r, where a distance equals r (linked: <= r); the cells once took r (1 + 1e-12)
    for d, r, p in ((1, 0.1, np.inf), (2, 0.1, np.inf), (2, 0.25, 2.0), (3, 0.5, 2.0)):
        X = np.stack(np.meshgrid(*[np.arange(4.0)] * d, indexing="ij"), -1).reshape(-1, d) * r
        X[::3] += 1e-9   # every third point a hair off the lattice
        pairs = cKDTree(X).query_pairs(r=r, p=p, output_type="ndarray")
        m = len(X)
        graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(m, m))
        want = connected_components(graph, directed=False)[1]
        got = linked_components(X, r, p=p)
        assert len(set(zip(got.tolist(), want.tolist()))) == len(set(got.tolist())) == len(set(want.tolist()))
        # two points one float step farther apart than r: not linked, whichever route (alone and with a blob)
        far = np.zeros((2, d))
        far[1, 0] = np.nextafter(r, 1.0)
        blob = 10.0 + 1e-3 * np.random.default_rng(d).random((50, d))
        for Y in (far, np.concatenate([far, blob])):
            labels = linked_components(Y, r, p=p)
            assert labels[0] != labels[1], (d, r, p, route)
