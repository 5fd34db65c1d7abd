"""Entry points of meanfield.bounds / meanfield.adversarial that take what a caller already has
(gamma, norms, factored heads), against the paper's formulas typed in tests/reference.py, full
eigen-decompositions, explicitly augmented matrices, dense Jacobians and explicit sequences."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import adversarial, bounds
from tests.reference import (
    dense_lipschitz,
    dense_lipschitz_logweights,
    lemma38_upper,
    naive_attention,
    prop34_lower,
    prop36_asymptotic_log,
    thm33_upper,
)

f64 = torch.float64


def _A(d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, d, generator=g, dtype=f64) / math.sqrt(d)


@pytest.mark.parametrize("gamma, R, n", [(0.3, 2.0, 5), (1.2, 0.5, 1), (0.01, 10.0, 1000), (2.0, 3.0, 7.5)])
def test_sqrt_n_lower_from_gamma_is_proposition_3_4(gamma, R, n):
    assert bounds.sqrt_n_lower_from_gamma(gamma, R, n) == pytest.approx(prop34_lower(gamma, R, n), rel=1e-15)


def test_sqrt_n_lower_from_gamma_agrees_with_the_matrix_form_and_reaches_huge_n():
    A = _A(5, 1)
    g = bounds.gamma(A)
    for n in (2, 17, 10**6):
        assert bounds.sqrt_n_lower_from_gamma(g, 1.5, n) == bounds.sqrt_n_lower(A, 1.5, n)
    assert bounds.sqrt_n_lower_from_gamma(g, 1.5, 1e300) == pytest.approx(prop34_lower(g, 1.5, 1e300), rel=1e-12)
    for bad, err in [((-1.0, 1.0, 2), ValueError), ((math.nan, 1.0, 2), ValueError), (("a", 1.0, 2), TypeError),
                     ((1.0, 1.0, 0.5), ValueError), ((1.0, -1.0, 2), ValueError), ((True, 1.0, 2), TypeError)]:
        with pytest.raises(err):
            bounds.sqrt_n_lower_from_gamma(*bad)
    assert bounds.sqrt_n_lower_from_gamma(np.float32(0.5), np.float64(1.0), np.int64(4)) > 0


def test_two_dirac_lower_from_gamma_is_proposition_3_6():
    for gamma, R in [(0.5, 3.0), (1.0, 20.0), (0.02, 100.0)]:
        assert bounds.two_dirac_lower_from_gamma(gamma, R, log=True) == pytest.approx(
            prop36_asymptotic_log(gamma, R), rel=1e-14)
    A = _A(3, 0)
    assert bounds.two_dirac_lower_from_gamma(bounds.gamma(A), 4.0) == bounds.two_dirac_lower(A, 4.0)
    assert bounds.two_dirac_lower_from_gamma(0.0, 4.0, log=True) == -math.inf
    assert bounds.two_dirac_lower_from_gamma(1.0, 20.0) == pytest.approx(math.exp(prop36_asymptotic_log(1.0, 20.0)),
                                                                         rel=1e-12)
    with pytest.warns(bounds.BoundOverflowWarning, match="two_dirac_lower_from_gamma: the bound is exp.*log=True"):
        assert prop36_asymptotic_log(1.0, 100.0) > 710 and bounds.two_dirac_lower_from_gamma(1.0, 100.0) == math.inf


def test_regime_radius_and_length_invert_each_other():
    for gamma, n in [(0.3, 1e3), (1.7, 128 * 1000.0), (0.01, 1e6)]:
        R = bounds.sqrt_n_regime_radius(gamma, n)
        assert math.exp(2 * gamma * R * R) == pytest.approx(n, rel=1e-12)
        assert bounds.sqrt_n_regime_length(gamma, R) == pytest.approx(n, rel=1e-12)
    with pytest.raises(ValueError, match="gamma"):
        bounds.sqrt_n_regime_radius(0.0, 10.0)
    assert bounds.sqrt_n_regime_length(1.0, 100.0) == math.inf


@pytest.mark.parametrize("seed", range(8))
def test_gamma_info_factored_against_the_full_matrix(seed):
    g = torch.Generator().manual_seed(seed)
    k, d = (3, 7) if seed % 2 else (4, 4)
    Q = torch.randn(k, d, generator=g, dtype=f64) * (-1) ** seed
    K = torch.randn(k, d, generator=g, dtype=f64)
    scale = 0.5
    A = scale * K.T @ Q
    info, ref = bounds.gamma_info_factored(Q, K, scale), bounds.gamma_info(A)
    assert info.gamma == pytest.approx(ref.gamma, rel=1e-9, abs=1e-13)
    if ref.gamma > 1e-12:
        assert info.case == ref.case
        u = torch.as_tensor(info.eigenvector)
        assert float(u.norm()) == pytest.approx(1.0)
        torch.testing.assert_close(A @ u, info.eigenvalue * u, rtol=0, atol=1e-9 * (1 + abs(info.eigenvalue)))
        # the witness from the factored head is the library's witness from the full matrix (up to sign)
        X = adversarial.sqrt_n_sequence_from_info(info, 1.3, 6)
        Xref = adversarial.sqrt_n_sequence(A, 1.3, 6)
        sign = 1.0 if float((X * Xref).sum()) > 0 else -1.0
        torch.testing.assert_close(X, sign * Xref, rtol=0, atol=1e-9)
        # and it attains Proposition 3.4 (dense Jacobian of the naive attention, V = I)
        lip = dense_lipschitz(lambda Y: naive_attention(Y, A, torch.eye(d, dtype=f64)), X)
        assert lip >= prop34_lower(info.gamma, 1.3, 6) * (1 - 1e-9)
    with pytest.raises(ValueError, match="Q, K"):
        bounds.gamma_info_factored(Q, K[:, :-1])


def test_gamma_zero_gives_no_witness():
    Q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=f64)
    K = torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]], dtype=f64)   # A = K^T Q skew: no real nonzero eigenvalue
    info = bounds.gamma_info_factored(Q, K)
    assert info.gamma == 0.0 and info.eigenvector is None
    with pytest.raises(ValueError, match="no witness"):
        adversarial.sqrt_n_sequence_from_info(info, 1.0, 3)
    with pytest.raises(TypeError, match="info"):
        adversarial.sqrt_n_sequence_from_info({"gamma": 1.0}, 1.0, 3)


def test_augmented_norms_and_the_biased_layer_bound():
    """Against the explicitly augmented matrices A' = [[A, c], [0, 0]], V' = [V, b_V] and Lemma 3.8 with
    Theorem 3.3 per head on the ball of radius sqrt(R^2 + 1), all typed in tests/reference.py."""
    g = torch.Generator().manual_seed(3)
    H, k, d = 3, 2, 5
    Q, K, V = (torch.randn(H, k, d, generator=g, dtype=f64) for _ in range(3))
    b_Q, b_V = torch.randn(H, k, generator=g, dtype=f64), torch.randn(H, k, generator=g, dtype=f64)
    W_O = torch.randn(d, H * k, generator=g, dtype=f64)
    scale = 1 / math.sqrt(k)
    a, v = bounds.augmented_head_norms(Q, K, V, b_Q, b_V, scale)
    R, n = 2.5, 9
    heads = []
    for h in range(H):
        A_aug = torch.zeros(d + 1, d + 1, dtype=f64)
        A_aug[:d, :d] = scale * K[h].T @ Q[h]
        A_aug[:d, d] = scale * K[h].T @ b_Q[h]
        V_aug = torch.cat([V[h], b_V[h][:, None]], 1)
        assert a[h] == pytest.approx(float(torch.linalg.matrix_norm(A_aug, 2)), rel=1e-10)
        assert v[h] == pytest.approx(float(torch.linalg.matrix_norm(V_aug, 2)), rel=1e-12)
        heads.append(thm33_upper(A_aug, V_aug, math.sqrt(R * R + 1), n))
    w = float(torch.linalg.matrix_norm(W_O, 2))
    assert bounds.biased_multihead_upper(a, v, w, R, n) == pytest.approx(lemma38_upper(heads, W_O), rel=1e-12)
    a0, v0 = bounds.augmented_head_norms(Q[0], K[0], V[0], scale=scale)   # one head, no biases
    assert a0[0] == pytest.approx(scale * float(torch.linalg.matrix_norm(K[0].T @ Q[0], 2)), rel=1e-10)
    with pytest.raises(ValueError, match="a_norms"):
        bounds.biased_multihead_upper([1.0], [1.0, 2.0], 1.0, R, n)


def test_the_biased_bound_holds_on_a_layer_with_biases():
    """The bound is above the dense-Jacobian constant of a multi-head layer with biases."""
    g = torch.Generator().manual_seed(5)
    H, k, d, n = 2, 2, 3, 6
    Q, K, V = (torch.randn(H, k, d, generator=g, dtype=f64) for _ in range(3))
    b_Q, b_K, b_V = (torch.randn(H, k, generator=g, dtype=f64) for _ in range(3))
    W_O = torch.randn(d, H * k, generator=g, dtype=f64)
    X = torch.randn(n, d, generator=g, dtype=f64)

    def layer(Y):
        outs = []
        for h in range(H):
            S = (Y @ Q[h].T + b_Q[h]) @ (Y @ K[h].T + b_K[h]).T / math.sqrt(k)
            outs.append(torch.softmax(S, -1) @ (Y @ V[h].T + b_V[h]))
        return torch.cat(outs, -1) @ W_O.T

    a, v = bounds.augmented_head_norms(Q, K, V, b_Q, b_V, 1 / math.sqrt(k))
    upper = bounds.biased_multihead_upper(a, v, float(torch.linalg.matrix_norm(W_O, 2)), float(X.norm(dim=1).max()), n)
    assert dense_lipschitz(layer, X) <= upper


def test_score_gap_and_large_radius_sup():
    A = _A(4, 2)
    g = torch.Generator().manual_seed(2)
    X = torch.randn(6, 4, generator=g, dtype=f64)
    S = (X @ A.T @ X.T).numpy()
    top2 = np.sort(S, axis=1)[:, -2:]
    assert bounds.score_gap(A, X) == pytest.approx(float((top2[:, 1] - top2[:, 0]).min()), rel=1e-12)
    Sm = np.where(np.tril(np.ones((6, 6), bool)), S, -np.inf)
    gaps = [np.diff(np.sort(r[np.isfinite(r)])[-2:])[0] for r in Sm[1:]]   # row 0 sees one key only
    assert bounds.score_gap(A, X, masked=True) == pytest.approx(float(min(gaps)), rel=1e-12)
    assert bounds.score_gap(A, X[:1]) == math.inf
    V = _A(4, 9)
    assert bounds.large_radius_sup(V, 9) == pytest.approx(3 * np.linalg.svd(V.numpy(), compute_uv=False)[0], rel=1e-12)
    Xh = adversarial.large_radius_configuration(A, n=5, R=1.0)
    assert bounds.large_radius_limit(A, V, Xh) == pytest.approx(bounds.large_radius_sup(V, 5), rel=1e-12)


def test_sqrt_n_measure_is_the_sequence_as_a_two_atom_measure():
    """Its W2-sense constant (dense Jacobian with log-weights) equals the n-token sequence's constant."""
    A = _A(3, 0)
    I = torch.eye(3, dtype=f64)
    R = 1.7
    for n in (2, 5, 9):
        mu = adversarial.sqrt_n_measure(A, R, n)
        assert torch.allclose(mu.weights, torch.tensor([1 / n, 1 - 1 / n], dtype=f64), rtol=1e-14)
        X = adversarial.sqrt_n_sequence(A, R, n)
        torch.testing.assert_close(mu.points, X[:2])
        seq = dense_lipschitz(lambda Y: naive_attention(Y, A, I), X)
        lw = mu.log_weights
        two = dense_lipschitz_logweights(lambda Y, lw=lw: naive_attention(Y, A, I, log_weights=lw), mu.points, lw)
        assert two == pytest.approx(seq, rel=1e-10)
    assert adversarial.sqrt_n_measure(A, R, 1e15).log_weights[0] == pytest.approx(-math.log(1e15), rel=1e-15)
    for bad in (1, 0.5, math.inf, "3"):
        with pytest.raises(ValueError, match="n"):
            adversarial.sqrt_n_measure(A, R, bad)
