"""Predicted forms the studies test their claims against, each compared with dense Jacobians of the
written-out attention of tests/reference.py: the constant of Proposition 3.4's witness, the
correction factor 1 + 1/(gamma R^2) of Proposition 3.6, and the closed form of mass splitting
(docs/math.md sections 4.7, 5.3, 5.4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import adversarial, bounds
from tests.reference import dense_lipschitz, dense_lipschitz_logweights, naive_attention

f64 = torch.float64


def _gamma_case(A):  # docs/math.md section 5.3, written out
    ev = np.linalg.eigvals(np.asarray(A))
    lam = ev.real[np.abs(ev.imag) < 1e-10]
    t_max, t_min = max(lam.max() / 8, 0.0), max(-lam.min(), 0.0)
    return (t_max, "max") if t_max >= t_min else (t_min, "min")


MATRICES = {
    "max": torch.diag(torch.tensor([1.6, 0.5, -0.1], dtype=f64)),       # lambda_max / 8 = 0.2 > 0.1
    "min": torch.tensor([[0.3, 0.4], [0.0, -1.0]], dtype=f64),            # non-symmetric, gamma = 1
    # strongly non-normal (|A^T u - lambda u| = 4.9 |lambda|), as trained heads are
    "min, non-normal": torch.tensor([[-1.0, 0.0, 0.0], [12.0, 0.2, 0.0], [0.0, 3.0, 0.1]], dtype=f64),
    "max, non-normal": torch.tensor([[2.4, 5.0, 0.0, 0.0], [0.0, 0.3, 0.0, 0.0], [-3.0, 0.0, -0.1, 1.0],
                                     [0.0, 2.0, 0.0, 0.2]], dtype=f64),
}


def _dense_singular_values(A, X):
    from tests.reference import dense_jacobian
    I = torch.eye(A.shape[0], dtype=f64)
    return np.linalg.svd(dense_jacobian(lambda Y: naive_attention(Y, A, I), X), compute_uv=False)


@pytest.mark.parametrize("name", list(MATRICES))
@pytest.mark.parametrize("regime", [3.0, 30.0, 1e3, 1e5, 1e14])
def test_witness_constant_matches_dense_jacobian(name, regime):
    """The closed form is exact: the top two singular values of the witness's Jacobian equal those of
    the dense Jacobian of the written-out attention to rounding, in both cases, for normal and strongly
    non-normal A, from n = 1 to far past the transition (exp(2 gamma R^2) = regime)."""
    A = MATRICES[name]
    g, c = _gamma_case(A)
    assert c == name.split(",")[0]
    R = math.sqrt(math.log(regime) / (2 * g))
    for n in (1, 2, 3, 8, 33, 100):
        X = adversarial.sqrt_n_sequence(A, R, n)
        truth = _dense_singular_values(A, X)
        sv = adversarial.sqrt_n_witness_singular_values(A, R, n)
        assert sv[0] == pytest.approx(truth[0], rel=1e-12), (n, sv, truth[:3])
        assert adversarial.sqrt_n_witness_constant(A, R, n) == sv[0]
        # the distinct values: each is in the dense spectrum, and each nonzero dense value is one of them
        assert np.all(np.diff(sv) < 0)
        scale = truth[0]
        assert all(np.min(np.abs(truth - v)) <= 1e-10 * scale for v in sv), (n, sv, truth)
        assert all(np.min(np.abs(sv - t)) <= 1e-10 * scale for t in truth if t > 1e-10 * scale), (n, sv, truth)
        if n > 1:  # Proposition 3.4's bound is below, by the factor formed without its formula
            low = math.sqrt(n - 1) / (1 + (n - 1) * math.exp(-2 * g * R * R))
            assert low <= sv[0] * (1 + 1e-12)
            assert adversarial.sqrt_n_witness_factor(A, R, n) == pytest.approx(sv[0] / low, rel=1e-12)


@pytest.mark.parametrize("name", list(MATRICES))
def test_witness_measure_constant_matches_dense_weighted_jacobian(name):
    """of="measure": the two-atom measure (1/n, (n-1)/n) at real n up to 1e12, in the W2 sense."""
    from meanfield import SelfAttention, local_lipschitz

    A = MATRICES[name]
    g, _ = _gamma_case(A)
    att = SelfAttention(A, torch.eye(A.shape[0], dtype=f64))
    for R in (0.7, math.sqrt(math.log(1e4) / (2 * g))):
        for n in (1.5, 2.0, 7.3, 64.0, 1e4, 1e12):
            truth = float(local_lipschitz(att, adversarial.sqrt_n_measure(A, R, n), method="dense").value)
            assert adversarial.sqrt_n_witness_constant(A, R, n, of="measure") == pytest.approx(truth, rel=1e-11)


def test_witness_constant_reduces_to_the_simple_form_for_a_normal_A():
    """For a normal A deep in the sqrt(n) regime the closed form is sqrt(n - 1) b c (case "min"),
    c = 1 + 2 gamma R^2 (1 - b), to relative order 2 q (1 + gamma R^2)^2 (docs/math.md section 5.3); a
    non-normal A is not (its copies' queries move along A^T u)."""
    A = torch.diag(torch.tensor([0.3, -1.0, 0.1], dtype=f64))
    q = 1e-6
    R = math.sqrt(-math.log(q) / 2)
    for n in (2, 9, 65):
        b = 1 / (1 + (n - 1) * q)
        simple = math.sqrt(n - 1) * b * (1 + 2 * R * R * (1 - b))
        assert adversarial.sqrt_n_witness_constant(A, R, n) == pytest.approx(simple, rel=2 * q * (1 + R * R) ** 2)
    B = MATRICES["min, non-normal"]
    R = math.sqrt(math.log(30.0) / 2)
    b = 1 / (1 + 7 / 30)
    simple = math.sqrt(7) * b * (1 + 2 * R * R * (1 - b))
    assert adversarial.sqrt_n_witness_constant(B, R, 8) > 1.2 * simple


def test_witness_constant_from_factors_and_records():
    """A factored head (gamma_info_factored carries A^T u without forming A) gives the same closed form;
    a record without A^T u, a bad ``of`` and a fractional number of tokens are refused by name."""
    g = torch.Generator().manual_seed(3)
    Q, K = torch.randn(4, 9, generator=g, dtype=f64), torch.randn(4, 9, generator=g, dtype=f64)
    A = 0.5 * K.T @ Q
    info = bounds.gamma_info_factored(Q, K, 0.5)
    assert info.transpose_image == pytest.approx(A.numpy().T @ info.eigenvector, rel=1e-12, abs=1e-12)
    for n in (2, 5, 40):
        X = adversarial.sqrt_n_sequence_from_info(info, 1.5, n)
        truth = _dense_singular_values(A, X)[0]
        assert adversarial.sqrt_n_witness_constant(info, 1.5, n) == pytest.approx(truth, rel=1e-11)
    import dataclasses
    with pytest.raises(ValueError, match="A: .*transpose_image"):
        adversarial.sqrt_n_witness_constant(dataclasses.replace(info, transpose_image=None), 1.5, 4)
    with pytest.raises(ValueError, match="of"):
        adversarial.sqrt_n_witness_constant(info, 1.5, 4, of="tokens")
    with pytest.raises(ValueError, match="n: .*of='measure'"):
        adversarial.sqrt_n_witness_constant(info, 1.5, 7.3)
    with pytest.raises(ValueError, match="n: .*digits"):
        adversarial.sqrt_n_witness_constant(info, 1.5, 10**400)


def test_witness_constant_is_finite_at_large_radii():
    A = MATRICES["min, non-normal"]
    for R in (10.0, 100.0):
        for n in (2, 1000):
            for of in ("sequence", "measure"):
                sv = adversarial.sqrt_n_witness_singular_values(A, R, n, of=of)
                assert np.isfinite(sv).all() and sv[0] == pytest.approx(math.sqrt(n - 1), rel=1e-9)


def test_witness_constant_differs_from_the_bound_by_the_predicted_factor():
    """Case "max" at n = 2: the first token's own move adds 1 under the root, so the witness sits
    sqrt(2) above Proposition 3.4's bound (docs/math.md section 5.3), which a form without it misses."""
    A = MATRICES["max"]
    g, _ = _gamma_case(A)
    R = math.sqrt(math.log(1e6) / (2 * g))
    low = 1 / (1 + 1e-6)
    assert adversarial.sqrt_n_witness_constant(A, R, 2) / low == pytest.approx(math.sqrt(2), rel=1e-4)


@pytest.mark.parametrize("A, R, expected", [(torch.eye(2, dtype=f64), 10.0, 1.08),
                                            (torch.eye(2, dtype=f64), 20.0, 1.02),
                                            (torch.diag(torch.tensor([0.3, -1.0], dtype=f64)), 4.0, 1.0625)])
def test_two_dirac_ratio_is_the_measured_correction(A, R, expected):
    """docs/math.md section 5.4's table: the dense weighted constant of the two-Dirac witness over
    (gamma/2) R^2 exp(gamma R^2) equals 1 + 1/(gamma R^2) to the digits given there."""
    g, _ = _gamma_case(A)
    assert bounds.two_dirac_ratio(A, R) == pytest.approx(1 + 1 / (g * R * R), rel=1e-15)
    assert bounds.two_dirac_ratio(A, R) == pytest.approx(expected, abs=1e-5)
    mu = adversarial.two_dirac(A, R)
    I = torch.eye(A.shape[0], dtype=f64)
    lw = mu.log_weights
    log_lip = math.log(dense_lipschitz_logweights(lambda Y: naive_attention(Y, A, I, log_weights=lw), mu.points, lw))
    ratio = math.exp(log_lip - (math.log(g / 2) + 2 * math.log(R) + g * R * R))
    assert ratio == pytest.approx(bounds.two_dirac_ratio(A, R), rel=10 * math.exp(-2 * g * R * R) + 1e-9)


def _weighted_lip(A, V, X, w, positions=None):
    f = lambda Y: naive_attention(Y, A, V, masked=positions is not None, log_weights=w.log(), positions=positions)
    return dense_lipschitz(f, X, weights=w)


@pytest.mark.parametrize("masked", [False, True])
def test_query_term_norms_against_written_out_covariance(masked):
    g = torch.Generator().manual_seed(3)
    A, V = torch.randn(3, 3, generator=g, dtype=f64), torch.randn(2, 3, generator=g, dtype=f64)
    X = torch.randn(5, 3, generator=g, dtype=f64)
    w = torch.rand(5, generator=g, dtype=f64) + 0.2
    w = w / w.sum()
    pos = torch.tensor([0.2, 0.2, 0.5, 0.9, 0.9], dtype=f64) if masked else None
    got = bounds.query_term_norms(A, V, X, w.log(), positions=pos)
    for i in range(5):
        vis = torch.ones(5, dtype=torch.bool) if pos is None else pos <= pos[i]
        s = (A @ X[i]) @ X[vis].T + w[vis].log()
        p = torch.softmax(s, 0)
        mean = p @ X[vis]
        cov = sum(p[k] * torch.outer(X[vis][k] - mean, X[vis][k] - mean) for k in range(int(vis.sum())))
        assert got[i] == pytest.approx(float(torch.linalg.matrix_norm(V @ cov @ A, 2)), rel=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_split_constant_is_the_dense_constant_of_the_split_measure(masked):
    """docs/math.md section 4.7: Lip(split) = max(Lip(unsplit), max over split atoms of ||V Sigma A||),
    whatever the fractions, on random small configurations including ones where splitting helps."""
    helped = 0
    # seeds 0..19, and three of the first 200 where splitting increases the constant (found by a search)
    for seed in [*range(20), 14, 42, 155] if masked else [*range(20), 4, 122, 155]:
        rng = np.random.default_rng(seed)
        d, N = int(rng.integers(1, 3)), int(rng.integers(2, 5))
        A = torch.tensor(rng.normal(size=(d, d)) * 1.5, dtype=f64)
        V = torch.tensor(rng.normal(size=(d, d)), dtype=f64)
        X = torch.tensor(rng.normal(size=(N, d)) * 1.5, dtype=f64)
        w = torch.tensor(rng.dirichlet(np.ones(N)), dtype=f64)
        pos = torch.tensor(np.sort(rng.choice([0.25, 0.5, 1.0], size=N)), dtype=f64) if masked else None
        base = _weighted_lip(A, V, X, w, pos)
        qn = bounds.query_term_norms(A, V, X, w.log(), positions=pos)
        # the atom with the largest query term: where splitting can help, if anywhere
        i, t = int(np.argmax(qn)), float(rng.uniform(0.1, 0.9))
        Xs = torch.cat([X, X[i:i + 1]])
        ws = torch.cat([w, w[i:i + 1] * (1 - t)])
        ws[i] = w[i] * t
        ps = None if pos is None else torch.cat([pos, pos[i:i + 1]])
        truth = _weighted_lip(A, V, Xs, ws, ps)
        assert bounds.split_constant(base, qn, [i]) == pytest.approx(truth, rel=1e-9), seed
        helped += truth > base * (1 + 1e-6)
    assert helped >= 1  # the family includes configurations where splitting increases the constant


def test_split_constant_refuses_bad_input():
    with pytest.raises(ValueError, match="lip_unsplit"):
        bounds.split_constant(-1.0, [1.0], [0])
    with pytest.raises(ValueError, match="split"):
        bounds.split_constant(1.0, [1.0, 2.0], [5])
    assert bounds.split_constant(1.0, [3.0, 2.0], []) == 1.0
    with pytest.raises(ValueError, match="n"):
        adversarial.sqrt_n_witness_constant(torch.eye(3, dtype=f64), 1.0, 0.5)
