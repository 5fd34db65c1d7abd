"""The parameter record (meanfield/parameters.py): every operator declares what it is made of, and the
theory reads only that. A new operator defined here (nothing in meanfield knows its class) gets its
bounds, a worst-case bracket and the rescaled dynamics from ``evaluate`` + ``parameters`` alone.
Truths: the record rebuilds the operator's map (checked against the operator itself and against
attention written out in tests/reference.py), the bounds equal the formulas written out by hand, and
the bracket's lower bound is a dense Jacobian's singular value at the input it returns."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import (
    IsotropicAttention,
    L2SelfAttention,
    MultiHeadAttention,
    SearchOptions,
    SelfAttention,
    as_operator,
    bounds,
    simulate,
    worst_case_sequence,
)
from meanfield.kernels import attend
from meanfield.operator import AttentionOperator
from meanfield.parameters import Head, Parameters
from meanfield.upper import operator_upper
from particles import Measure
from tests.reference import dense_lipschitz, lemma38_upper, naive_attention, thm33_upper

pytestmark = pytest.mark.usefixtures("one_thread")
f64 = torch.float64


def rand(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


class TwoHeads(AttentionOperator):
    """A user's own operator: two dot-product heads with query biases, averaged (W_O = [I, I] / 2).
    Written here with the kernel only; meanfield knows nothing of this class."""

    def __init__(self, Q, K, V, b_Q, masked=False):
        self.Q, self.K, self.V, self.b_Q, self.masked = Q, K, V, b_Q, masked

    d_in = property(lambda self: self.Q.shape[-1])
    d_out = property(lambda self: self.V.shape[-2])
    dtype = property(lambda self: self.Q.dtype)
    device = property(lambda self: self.Q.device)

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        outs = []
        for h in range(2):
            q = (x @ self.Q[h].T + self.b_Q[h]) / math.sqrt(self.Q.shape[1])
            k, v = keys @ self.K[h].T, keys @ self.V[h].T
            outs.append(attend(q, k, v, log_weights, x_positions, key_positions))
        return (outs[0] + outs[1]) / 2

    def parameters(self, d=None):
        s = 1 / math.sqrt(self.Q.shape[1])
        heads = tuple(Head(self.Q[h], self.K[h], self.V[h], key_bias=s * self.K[h].T @ self.b_Q[h], scale=s)
                      for h in range(2))
        eye = torch.eye(self.d_out, dtype=f64)
        return Parameters(heads, torch.cat([eye, eye], 1) / 2, masked=self.masked)


def two_heads(masked=False, d=3):
    return TwoHeads(rand(2, 2, d, seed=1), rand(2, 2, d, seed=2), rand(2, d, d, seed=3, scale=0.5),
                    rand(2, 2, seed=4), masked)


@pytest.mark.parametrize("masked", [False, True])
def test_a_new_operator_gets_bounds_a_bracket_and_dynamics(masked):
    op = two_heads(masked)
    p = op.parameters()
    # the record rebuilds the map (a MultiHeadAttention of its heads: the key bias is exactly the query bias)
    X = rand(6, 3, seed=5)
    assert torch.allclose(MultiHeadAttention.from_parameters(p).sequence(X), op.sequence(X), atol=1e-12)
    # bounds: Lemma 3.8 over the heads' Theorem 3.3 / 3.5 (4.3) bounds, key bias absorbed, written out here
    R, n = 1.5, 6
    up = operator_upper(op, R, n)
    per = []
    for h in p.heads:
        A, R2, _ = bounds.absorb_key_bias(h.A.numpy(), h.key_bias.numpy(), R)
        V = np.pad(h.V.numpy(), ((0, 0), (0, 1)))
        # masked: Theorem 4.3 alone (Theorem 4.4's stated mean-field bound fails, docs/math.md 5.2)
        mf = math.inf if masked else math.exp(bounds.mean_field_upper(A, V, R2, log=True))
        per.append(min(thm33_upper(A, V, R2, n), mf))
    assert up.known and abs(up.value - lemma38_upper(per, p.W_O.numpy())) <= 1e-10 * up.value
    # a worst-case bracket: the lower bound is a singular value of the dense Jacobian at its input
    res = worst_case_sequence(op, R, 4, budget=600, options=SearchOptions(random=2, max_steps=10))
    assert res.upper.known and res.lower <= res.upper.value
    assert any(s.name.startswith("prop3.4") for s in res.starts)   # structured starts from the record
    truth = dense_lipschitz(op.sequence, res.input)
    assert res.lower <= truth * (1 + 1e-9) and truth - res.lower <= res.error + 1e-9 * truth
    # the dynamics run it (on measures, with weights and positions)
    mu = Measure(rand(5, 3, seed=6), positions=torch.linspace(0.2, 1, 5, dtype=f64) if masked else None)
    traj = simulate(op, mu, [0.0, 0.5], options={"steps": 5})
    assert traj.final.n == 5 and bool(torch.isfinite(traj.final.points).all())


def test_records_of_the_framework_operators_rebuild_their_maps():
    X = rand(7, 3, seed=9)
    A, V = rand(3, 3, seed=1), rand(3, 3, seed=2)
    single = SelfAttention(A, V, key_bias=rand(3, seed=3), value_bias=rand(3, seed=4))
    qkv = SelfAttention.from_qkv(rand(2, 3, seed=5), rand(2, 3, seed=6), V, b_Q=rand(2, seed=7), b_V=rand(3, seed=8))
    mha = MultiHeadAttention([single, qkv], rand(3, 6, seed=10), bias=rand(3, seed=11))
    for op in (single, qkv, mha):
        p = op.parameters()
        assert p.kind == "dot" and p.caveat is None
        assert torch.allclose(MultiHeadAttention.from_parameters(p).sequence(X), op.sequence(X), atol=1e-12)
    # A of the record is the operator's score matrix; naive attention with it gives the single head
    assert torch.allclose(single.parameters().A(0), A)
    plain = SelfAttention(A, V)
    rebuilt = MultiHeadAttention.from_parameters(plain.parameters())
    assert torch.allclose(naive_attention(X, A, V), rebuilt.sequence(X), atol=1e-12)
    # L2 heads: A = 2 scale Q^T Q, values through scale Q^T Q (Kim et al.)
    WQ, WV = rand(2, 3, 2, seed=12), rand(2, 3, 2, seed=13)
    l2 = L2SelfAttention(WQ, WV, rand(4, 3, seed=14))
    p = l2.parameters()
    assert p.kind == "l2" and p.num_heads == 2
    for h in range(2):
        assert torch.allclose(p.heads[h].A, 2 * WQ[h] @ WQ[h].T / math.sqrt(2))
    # the sphere models: A = beta I, V = I in the dimension asked; USA carries a caveat
    sa = IsotropicAttention(2.0).parameters(4)
    assert torch.equal(sa.A(0), 2.0 * torch.eye(4, dtype=f64)) and torch.equal(sa.heads[0].V, torch.eye(4, dtype=f64))
    assert IsotropicAttention(2.0, "USA").parameters(4).caveat
    with pytest.raises(ValueError, match="d"):
        IsotropicAttention(2.0).parameters()


def test_operators_without_parameters_are_said_to_be_unbounded():
    callable_op = as_operator(lambda Y: Y * 2.0)
    assert callable_op.parameters() is None
    up = operator_upper(callable_op, 1.0, 4)
    assert not up.known and "does not declare its parameters" in up.source
    assert not operator_upper(IsotropicAttention(1.0, "USA"), 1.0, 4, d=3).known
    assert "every dimension" in operator_upper(IsotropicAttention(1.0), 1.0, 4).source
    sa = operator_upper(IsotropicAttention(1.5), 1.0, 4, d=3)
    assert sa.known and abs(sa.value - operator_upper(SelfAttention(1.5 * np.eye(3), np.eye(3)), 1.0, 4).value) \
        <= 1e-12 * sa.value


def test_the_rescaled_dynamics_read_the_value_matrix_from_the_record():
    V = rand(3, 3, seed=2, scale=0.3)
    op = SelfAttention(rand(3, 3, seed=1), V)
    mu = Measure(rand(6, 3, seed=3))
    by_record = simulate(op, mu, [0.0, 0.5], rescale=True, options={"steps": 5})
    by_matrix = simulate(op, mu, [0.0, 0.5], rescale=V, options={"steps": 5})
    assert torch.equal(by_record.final.points, by_matrix.final.points)
    with pytest.raises(ValueError, match="rescale"):
        simulate(two_heads(), mu, [0.0, 0.5], rescale=True, options={"steps": 5})


def test_hugging_face_parameters_keep_the_old_stacked_fields_with_a_warning():
    pytest.importorskip("transformers")
    from meanfield import HFAttention
    from meanfield.hf import extract_layer
    from studies import models

    model = models.random_model("bert", size="tiny", seed=1)
    op = HFAttention.from_model(model, 0)
    p = op.parameters()
    raw = extract_layer(model, 0)
    X = rand(5, op.d_in, seed=1)
    assert torch.allclose(MultiHeadAttention.from_parameters(p).sequence(X), op.sequence(X), atol=1e-10)
    with pytest.warns(DeprecationWarning, match=r"p.heads\[h\].Q"):
        Q = p.Q
    assert torch.equal(Q, raw.Q)
    with pytest.warns(DeprecationWarning, match=r"MultiHeadAttention.from_parameters"):
        old = p.to_meanfield()
    assert torch.allclose(old.sequence(X), op.sequence(X), atol=1e-10)
    block = HFAttention.from_model(model, 0, block=True)
    assert "block" in block.parameters().caveat and not operator_upper(block, 1.0, 4).known
