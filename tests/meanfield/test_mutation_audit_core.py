"""Tests added by a hand-applied mutation audit of the mathematical core (docs/mutation.md, "Hand-applied
mutants"). Each one compares the library with an independent truth written out here in numpy (or a dense
Jacobian from torch.autograd.functional.jacobian and numpy's SVD), and each kills a mutant that survived the
default suite:

* queries that are not the keys (``op.velocity(mu, x)`` at points other than the atoms, and the query
  derivative of meanfield.splitting, which moves the queries alone): a key bias computed from the queries, an
  L2 head's values computed from the queries, or a multi-head layer's keys projected from the wrong side agree
  with the truth whenever the queries are the keys, as in every sequence and measure map;
* the value map of an L2 head (``Head.value_map``, read by the dynamics' rescaling), without its scale;
* ``Parameters.W_O_block`` for heads of different value sizes;
* the query norms of ``split_lipschitz`` (spectral norms, not Frobenius);
* the gradient of sigma in the logits of the weights for a field that is not a softmax average (USA): the
  logits' normalization a = softmax(z) dropped.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import IsotropicAttention, L2SelfAttention, MultiHeadAttention, SelfAttention, local_lipschitz
from meanfield.parameters import Head, Parameters
from meanfield.sigma_gradient import sigma_gradient
from meanfield.splitting import query_jacobians, split_lipschitz
from particles import Measure

f64 = torch.float64


def rnd(*shape, seed, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def softmax_rows(S):
    S = S - S.max(axis=1, keepdims=True)
    E = np.exp(S)
    return E / E.sum(axis=1, keepdims=True)


def dot_head_np(x, y, a, Q, K, V, b_Q=None, b_V=None):
    """softmax_j(<Q x_i + b_Q, K y_j> / sqrt(k) + log a_j) (V y_j + b_V), written out."""
    k = Q.shape[0]
    q = x @ Q.T + (0 if b_Q is None else b_Q)
    S = q @ (y @ K.T).T / math.sqrt(k) + np.log(a)[None, :]
    vals = y @ V.T + (0 if b_V is None else b_V)
    return softmax_rows(S) @ vals


def l2_np(x, y, a, WQ, WV, WO):
    """Kim et al.'s L2 attention at queries x against weighted keys y (rows are tokens), written out."""
    outs = []
    for h in range(WQ.shape[0]):
        k = WQ.shape[2]
        qx, qy = x @ WQ[h], y @ WQ[h]
        D2 = ((qx[:, None, :] - qy[None, :, :]) ** 2).sum(-1)
        P = softmax_rows(-D2 / math.sqrt(k) + np.log(a)[None, :])
        Ah = WQ[h] @ WQ[h].T / math.sqrt(k)
        outs.append(P @ y @ Ah @ WV[h])
    return np.concatenate(outs, axis=1) @ WO


# ------------------------------------------------------------------ queries that are not the keys
def _measure(n, d, seed):
    Y = rnd(n, d, seed=seed)
    a = np.random.default_rng(seed + 1).uniform(0.2, 1.0, n)
    a /= a.sum()
    return Y, a, Measure(torch.tensor(Y), torch.tensor(a))


@pytest.mark.parametrize("m", [3, 5])   # m = n: the same shapes as the keys, so a mix-up is a wrong value
def test_velocity_with_a_key_bias_at_queries_that_are_not_the_atoms(m):
    d, k, n = 3, 2, 5
    Q, K, V = rnd(k, d, seed=1), rnd(k, d, seed=2), rnd(4, d, seed=3)
    bQ, bV = rnd(k, seed=4), rnd(4, seed=5)
    op = SelfAttention.from_qkv(Q, K, V, b_Q=bQ, b_V=bV)
    Y, a, mu = _measure(n, d, 6)
    x = rnd(m, d, seed=8)
    got = op.velocity(mu, torch.tensor(x)).numpy()
    np.testing.assert_allclose(got, dot_head_np(x, Y, a, Q, K, V, bQ, bV), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m", [3, 5])
def test_multihead_velocity_at_queries_that_are_not_the_atoms(m):
    d, k, n, H = 3, 2, 5, 2
    heads = [(rnd(k, d, seed=10 + h), rnd(k, d, seed=20 + h), rnd(2, d, seed=30 + h), rnd(k, seed=40 + h),
              rnd(2, seed=50 + h)) for h in range(H)]
    W_O, b = rnd(4, 2 * H, seed=60), rnd(4, seed=61)
    op = MultiHeadAttention([SelfAttention.from_qkv(Q, K, V, b_Q=bQ, b_V=bV) for Q, K, V, bQ, bV in heads], W_O, b)
    Y, a, mu = _measure(n, d, 62)
    x = rnd(m, d, seed=64)
    truth = np.concatenate([dot_head_np(x, Y, a, *h) for h in heads], axis=1) @ W_O.T + b
    np.testing.assert_allclose(op.velocity(mu, torch.tensor(x)).numpy(), truth, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m", [3, 5])
def test_l2_velocity_at_queries_that_are_not_the_atoms(m):
    H, D, k, kv, n = 2, 3, 2, 2, 5
    WQ, WV, WO = rnd(H, D, k, seed=70), rnd(H, D, kv, seed=71), rnd(H * kv, 3, seed=72)
    op = L2SelfAttention(WQ, WV, WO)
    Y, a, mu = _measure(n, D, 73)
    x = rnd(m, D, seed=75)
    np.testing.assert_allclose(op.velocity(mu, torch.tensor(x)).numpy(), l2_np(x, Y, a, WQ, WV, WO),
                               rtol=1e-11, atol=1e-12)


def test_query_jacobians_move_the_query_alone():
    """Q_i = d/dx Gamma_mu(x) at x_i, keys held fixed: the dense Jacobian of x -> (written-out velocity)."""
    d, k, n = 3, 2, 4
    Q, K, V = rnd(k, d, seed=80), rnd(k, d, seed=81), rnd(3, d, seed=82)
    bQ = rnd(k, seed=83)
    Y, a, mu = _measure(n, d, 84)
    Yt, lat = torch.tensor(Y), torch.tensor(np.log(a))
    Qt, Kt, Vt, bt = map(torch.tensor, (Q, K, V, bQ))

    def gamma(x):   # one query against the fixed weighted keys, in torch for autograd
        s = (Qt @ x + bt) @ (Yt @ Kt.T).T / math.sqrt(k) + lat
        return torch.softmax(s, 0) @ (Yt @ Vt.T)

    for op in (SelfAttention.from_qkv(Q, K, V, b_Q=bQ),
               L2SelfAttention(rnd(1, d, 2, seed=85), rnd(1, d, 3, seed=86))):
        Qi = query_jacobians(op, mu).numpy()
        for i in range(n):
            if isinstance(op, SelfAttention):
                truth = torch.autograd.functional.jacobian(gamma, Yt[i]).numpy()
            else:
                WQ, WV = op.W_Q[0].numpy(), op.W_V[0].numpy()
                WQt, AVt = torch.tensor(WQ), torch.tensor(WQ @ WQ.T / math.sqrt(2) @ WV)

                def fn(x, WQt=WQt, AVt=AVt):
                    s = -(((x @ WQt)[None, :] - Yt @ WQt) ** 2).sum(-1) / math.sqrt(2) + lat
                    return torch.softmax(s, 0) @ (Yt @ AVt)
                truth = torch.autograd.functional.jacobian(fn, Yt[i]).numpy()
            np.testing.assert_allclose(Qi[i], truth, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ records
def test_l2_value_map_is_the_map_from_a_key_to_its_value():
    """Head.value_map of an L2 head is W_V^T (W_Q W_Q^T / sqrt(k)): with one key, every query's head output is
    value_map @ y (the softmax is 1)."""
    H, D, k, kv = 2, 3, 2, 2
    WQ, WV = rnd(H, D, k, seed=90), rnd(H, D, kv, seed=91)
    op = L2SelfAttention(WQ, WV)
    p = op.parameters()
    y = rnd(1, D, seed=92)
    for h in range(H):
        truth = WV[h].T @ (WQ[h] @ WQ[h].T / math.sqrt(k))
        np.testing.assert_allclose(p.heads[h].value_map.numpy(), truth, rtol=1e-13, atol=1e-14)
    single = op.evaluate(torch.tensor(rnd(2, D, seed=93)), torch.tensor(y)).numpy()
    maps = np.concatenate([(p.heads[h].value_map.numpy() @ y[0]) for h in range(H)])
    np.testing.assert_allclose(single, np.stack([maps, maps]), rtol=1e-12, atol=1e-13)


def test_W_O_block_for_heads_of_different_value_sizes():
    d = 3
    sizes = [1, 3, 2]
    heads = tuple(Head(torch.tensor(rnd(2, d, seed=100 + h)), torch.tensor(rnd(2, d, seed=110 + h)),
                       torch.tensor(rnd(s, d, seed=120 + h))) for h, s in enumerate(sizes))
    W_O = torch.tensor(rnd(4, sum(sizes), seed=130))
    p = Parameters(heads, W_O)
    edges = np.concatenate([[0], np.cumsum(sizes)])
    for h in range(len(sizes)):
        np.testing.assert_array_equal(p.W_O_block(h).numpy(), W_O.numpy()[:, edges[h]:edges[h + 1]])
    eye = Parameters(heads).W_O_block(1).numpy()
    np.testing.assert_array_equal(eye, np.eye(sum(sizes))[:, 1:4])


# ------------------------------------------------------------------ splitting
def test_split_query_norms_are_spectral_norms_of_the_dense_query_jacobian():
    d, n = 3, 6
    A, V = rnd(d, d, seed=140, scale=0.5), rnd(d, d, seed=141)
    Y, a, mu = _measure(n, d, 142)
    Yt, lat, At, Vt = torch.tensor(Y), torch.tensor(np.log(a)), torch.tensor(A), torch.tensor(V)

    def gamma(x):
        return torch.softmax(Yt @ (At @ x) + lat, 0) @ (Yt @ Vt.T)

    truth = np.array([np.linalg.norm(torch.autograd.functional.jacobian(gamma, Yt[i]).numpy(), 2)
                      for i in range(n)])
    # the test is only meaningful where the Frobenius norm differs
    frob = np.array([np.linalg.norm(torch.autograd.functional.jacobian(gamma, Yt[i]).numpy()) for i in range(n)])
    assert (frob > truth * (1 + 1e-4)).all()
    s = split_lipschitz(SelfAttention(A, V), mu, tol=1e-10)
    np.testing.assert_allclose(s.query_norms.numpy(), truth, rtol=1e-10)
    assert s.atom == int(truth.argmax())
    assert s.value == pytest.approx(max(s.unsplit.value, truth.max()), rel=1e-12)


# ------------------------------------------------------------------ sigma gradient in the logits
def _usa_sigma(X, z, beta):
    """Top singular value of D^{1/2} J D^{-1/2} (Lemma C.5) for the USA field, a = softmax(z), written out."""
    a = torch.softmax(z, 0)

    def field(Y):
        return (a[None, :] * torch.exp(beta * Y @ Y.T)) @ Y

    n, d = X.shape
    J = torch.autograd.functional.jacobian(field, X).reshape(n * d, n * d).numpy()
    s = np.repeat(np.sqrt(a.numpy()), d)
    return np.linalg.svd(s[:, None] * J / s[None, :], compute_uv=False)[0]


def test_sigma_gradient_in_the_logits_of_a_field_that_is_not_a_softmax_average():
    """USA is not invariant under a common shift of the log-weights: the gradient in the logits z (a =
    softmax(z)) must be the derivative of sigma(softmax(z)), which sums to zero (an added constant changes
    nothing); the gradient in the log-weights themselves does not."""
    beta, n, d = 0.7, 4, 2
    X = torch.tensor(rnd(n, d, seed=150, scale=0.8))
    z = torch.tensor(rnd(n, seed=151))
    lw = z - torch.logsumexp(z, 0)
    op = IsotropicAttention(beta, "USA")
    mu = Measure(X, log_weights=lw)
    est = local_lipschitz(op, mu, tol=1e-12)
    assert est.value == pytest.approx(_usa_sigma(X, z, beta), rel=1e-9)
    g = sigma_gradient(op, mu, est.vector)
    assert abs(float(g.log_weights.sum())) <= 1e-9 * float(g.log_weights.abs().max())
    h = 1e-6
    for k in range(3):
        e = torch.tensor(rnd(n, seed=160 + k))
        fd = (_usa_sigma(X, z + h * e, beta) - _usa_sigma(X, z - h * e, beta)) / (2 * h)
        assert float(g.log_weights @ e) == pytest.approx(fd, rel=1e-6, abs=1e-8)


def _usa_query_norm(X, z, beta, i):
    """||d/dx Gamma_mu(x)||_2 at x = x_i, keys held fixed, for the USA field with a = softmax(z), written out."""
    a = torch.softmax(z, 0)
    J = torch.autograd.functional.jacobian(lambda x: (a * torch.exp(beta * X @ x)) @ X, X[i]).numpy()
    return np.linalg.norm(J, 2)


def test_query_term_gradient_in_the_logits_of_the_usa_field():
    from meanfield.splitting import query_term_gradient

    beta, n, d, atom = 0.7, 4, 2, 1
    X = torch.tensor(rnd(n, d, seed=170, scale=0.8))
    z = torch.tensor(rnd(n, seed=171))
    mu = Measure(X, log_weights=z - torch.logsumexp(z, 0))
    value, gX, gz = query_term_gradient(IsotropicAttention(beta, "USA"), mu, atom)
    assert value == pytest.approx(_usa_query_norm(X, z, beta, atom), rel=1e-12)
    assert abs(float(gz.sum())) <= 1e-9 * float(gz.abs().max())
    h = 1e-6
    for k in range(3):
        e, E = torch.tensor(rnd(n, seed=180 + k)), torch.tensor(rnd(n, d, seed=190 + k))
        fd = (_usa_query_norm(X + h * E, z + h * e, beta, atom)
              - _usa_query_norm(X - h * E, z - h * e, beta, atom)) / (2 * h)
        assert float((gX * E).sum() + gz @ e) == pytest.approx(fd, rel=1e-6, abs=1e-8)


@pytest.mark.parametrize("masked", [False, True])
def test_isotropic_record_rebuilds_its_map(masked):
    """IsotropicAttention(beta, "SA").parameters(d) is the head A = beta I, V = I: the operator rebuilt from the
    record and the operator itself both equal softmax(beta X X^T) X written out (causal: j <= i)."""
    from meanfield import operator_upper

    beta, n, d = 0.7, 5, 3
    X = rnd(n, d, seed=200)
    S = beta * X @ X.T
    if masked:
        S = np.where(np.tril(np.ones((n, n), dtype=bool)), S, -np.inf)
    truth = softmax_rows(S) @ X
    op = IsotropicAttention(beta, "SA", masked=masked)
    rebuilt = MultiHeadAttention.from_parameters(op.parameters(d))
    np.testing.assert_allclose(rebuilt.sequence(torch.tensor(X)).numpy(), truth, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(op.sequence(torch.tensor(X)).numpy(), truth, rtol=1e-12, atol=1e-13)
    same = SelfAttention(beta * np.eye(d), np.eye(d), masked=masked)
    assert operator_upper(op, R=1.5, n=n, d=d).value == pytest.approx(operator_upper(same, R=1.5, n=n).value,
                                                                        rel=1e-12)
