"""Defects found by an independent review of the operators (2026-11-27), each against an independent truth.

1. USA isotropic attention: a query that sees no key of positive weight has output 0, and its derivatives were
   NaN (logsumexp of an all -inf row); local_lipschitz then blamed an overflow.
2. Positions narrowed to the points' dtype (float64 -> float32) could tie two distinct positions, changing the
   causal mask silently; they are refused now, by Measure, Measure.to and op.velocity.
3. A float64 numpy parameter next to a float32 tensor parameter was rounded silently (a float32 tensor next to
   float64 was refused).
4. An integer tensor given to a float32 operator was refused with a message about float64; it takes the
   operator's dtype, as a list of integers does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.autograd.functional import jacobian

from meanfield import MultiHeadAttention, SelfAttention, local_lipschitz
from meanfield.isotropic import IsotropicAttention
from particles import Measure

F64 = torch.float64


def _dead_row_measure():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4, 3, generator=g, dtype=F64)
    w = torch.tensor([0.0, 0.5, 0.25, 0.25], dtype=F64)      # atom 0: zero weight, the only key up to its position
    pos = torch.tensor([0.1, 0.5, 0.7, 0.9], dtype=F64)
    return X, w, pos


@pytest.mark.parametrize("normalization", ["SA", "USA"])
def test_isotropic_dead_row_has_finite_derivatives_equal_to_finite_differences(normalization):
    X, w, pos = _dead_row_measure()
    op = IsotropicAttention(0.5, normalization, masked=True)
    lw = torch.log(w)
    f = lambda Y: op.points_map(Y, lw, pos)
    assert torch.equal(f(X)[0], torch.zeros(3, dtype=F64))
    J = jacobian(f, X).reshape(12, 12)
    assert torch.isfinite(J).all()
    assert torch.equal(J[:3], torch.zeros(3, 12, dtype=F64))   # row 0 is 0 near X: its derivative is 0
    # central finite differences, an independent truth for every entry
    h = 1e-6
    fd = torch.stack([(f(X + h * e.reshape(4, 3)) - f(X - h * e.reshape(4, 3))).reshape(-1) / (2 * h)
                      for e in torch.eye(12, dtype=F64)], 1)
    assert torch.allclose(J, fd, atol=1e-7, rtol=1e-6)
    # forward mode agrees, and local_lipschitz returns the top singular value of the W2 Jacobian: on the support
    # (atoms of positive weight), rows scaled by sqrt(w_i) and columns by 1 / sqrt(w_j) (docs/math.md section 4)
    _, jvp = torch.func.jvp(f, (X,), (torch.ones_like(X),))
    assert torch.allclose(jvp.reshape(-1), J @ torch.ones(12, dtype=F64), atol=1e-12)
    est = local_lipschitz(op, Measure(X, w, positions=pos))
    keep = (w > 0).repeat_interleave(3)
    s = w.sqrt().repeat_interleave(3)[keep]
    dense = torch.linalg.matrix_norm(s[:, None] * J[keep][:, keep] / s[None, :], 2)
    assert est.converged and est.value == pytest.approx(float(dense), rel=1e-7)


def test_positions_that_float32_would_tie_are_refused():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(2, 3, generator=g)
    pos = torch.tensor([0.5 + 1e-9, 0.5], dtype=F64)        # atom 1 strictly before atom 0
    with pytest.raises(ValueError, match="positions: torch.float32 rounds 1 pair"):
        Measure(X, positions=pos)
    mu64 = Measure(X.double(), positions=pos)
    with pytest.raises(ValueError, match="dtype: torch.float32 rounds 1 pair"):
        mu64.to(dtype=torch.float32)
    op = SelfAttention(torch.eye(3), torch.eye(3), masked=True)
    mu = Measure(X, positions=torch.tensor([0.25, 0.5]))
    with pytest.raises(ValueError, match="positions: torch.float32 rounds"):
        op.velocity(mu, torch.stack([X[0], X[0]]), positions=torch.tensor([0.5 + 5e-10, 0.5], dtype=F64))
    # narrowing that keeps every pair apart (or ties only equal positions) is accepted, exactly as rounded
    ok = torch.tensor([0.5, 0.25], dtype=F64)
    assert torch.equal(Measure(X, positions=ok).positions, ok.float())
    tied = torch.tensor([0.5, 0.5], dtype=F64)
    assert torch.equal(Measure(X, positions=tied).positions, tied.float())
    # a tie that float32 makes is the mask of the float64 measure changed: the float64 outputs differ
    out64 = SelfAttention(torch.eye(3, dtype=F64), torch.eye(3, dtype=F64), masked=True)(mu64).points
    assert torch.allclose(out64[1], X[1].double())               # atom 1 sees only itself


def test_float_numpy_parameters_keep_the_operators_dtype_or_are_refused():
    V64 = np.eye(3)
    V64[2, 2] = 1 + 1e-9
    with pytest.raises(TypeError, match=r"V: dtype torch.float64 differs from A's torch.float32.*astype\(np.float32\)"):
        SelfAttention(torch.eye(3), V64)
    with pytest.raises(TypeError, match="key_bias: dtype torch.float64"):
        SelfAttention(torch.eye(3), torch.eye(3), key_bias=np.full(3, 0.1))
    att = SelfAttention(torch.eye(3), torch.eye(3))
    with pytest.raises(TypeError, match="W_O: dtype torch.float64 differs from the heads'"):
        MultiHeadAttention([att], W_O=np.eye(3))
    # lists and integer arrays carry no precision: they take the operator's dtype; dtype= converts everything
    assert SelfAttention(torch.eye(3), [[1, 0, 0], [0, 1, 0], [0, 0, 1]]).V.dtype == torch.float32
    assert SelfAttention(torch.eye(3), np.eye(3, dtype=np.int64)).V.dtype == torch.float32
    assert float(SelfAttention(torch.eye(3), V64, dtype=F64).V[2, 2]) == 1 + 1e-9
    assert SelfAttention(np.eye(3), V64).V.dtype == F64


def test_an_integer_tensor_takes_the_operators_dtype_as_a_list_does():
    att32 = SelfAttention(torch.eye(3), torch.eye(3))
    ints = torch.tensor([[1, 2, 3], [0, 1, 0]])
    out = att32.sequence(ints)
    assert out.dtype == torch.float32
    assert torch.equal(out, att32.sequence([[1, 2, 3], [0, 1, 0]]))
    with pytest.raises(TypeError, match="bool"):
        att32.sequence(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="X: dtype torch.float64 differs from the operator's torch.float32"):
        att32.sequence(torch.ones(2, 3, dtype=F64))


def test_float32_numpy_parameters_make_a_float64_operator_as_before():
    """A narrower numpy array converts exactly: all-float32 numpy parameters give a float64 operator (numpy input
    makes float64 operators), as they did before the dtype check of float numpy parameters."""
    A32, V32 = np.eye(3, dtype=np.float32), np.full((3, 3), 0.1, dtype=np.float32)
    att = SelfAttention(A32, V32, key_bias=np.zeros(3, dtype=np.float32))
    assert att.dtype == F64 and torch.equal(att.V, torch.from_numpy(V32).double())
    assert SelfAttention.from_qkv(A32, A32, V32).dtype == F64


def test_usa_positions_with_batch_dimensions_the_points_lack():
    """Positions (b, n) over points (n, d): each batch entry equals the call with its own positions."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=g, dtype=F64)
    qp, kp = torch.rand(2, 5, generator=g, dtype=F64), torch.rand(2, 5, generator=g, dtype=F64)
    op = IsotropicAttention(0.5, "USA", masked=True)
    out = op.evaluate(x, x, None, qp, kp)
    assert out.shape == (2, 5, 3)
    for b in range(2):
        assert torch.allclose(out[b], op.evaluate(x, x, None, qp[b], kp[b]), rtol=1e-14, atol=1e-14)
