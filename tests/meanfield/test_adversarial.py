"""Witnesses of meanfield.adversarial: their geometry (closed forms), the lower bounds they attain
(dense Jacobian of tests/reference.py and the library), and the growth rates the paper states."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import SelfAttention, adversarial, bounds, local_lipschitz
from particles import Measure
from tests.reference import dense_lipschitz, naive_attention

F64 = torch.float64


def rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=F64)


# ---------------------------------------------------------------------------- Proposition 3.4
@pytest.mark.parametrize("A,case,u", [
    (np.diag([8.0, -0.5, 1.0]), "max", [1, 0, 0]),   # lambda_max / 8 = 1 >= 0.5
    (np.diag([4.0, -1.0, 2.0]), "min", [0, 1, 0]),   # 0.5 < 1 = -lambda_min
    (np.diag([-3.0, -1.0, -2.0]), "min", [1, 0, 0]),  # no positive eigenvalue
])
def test_sqrt_n_sequence_closed_form(A, case, u):
    R, n = 2.0, 5
    X, info = adversarial.sqrt_n_sequence(A, R, n, return_info=True)
    assert X.dtype == F64 and X.shape == (n, 3) and info.case == case
    u = torch.tensor(u, dtype=F64)
    first, rest = (R * u, R * u / 2) if case == "max" else (-R * u, R * u)
    assert torch.equal(X[0], first) and torch.equal(X[1:], rest.expand(n - 1, 3))
    assert info.bound == bounds.sqrt_n_lower(A, R, n)


def test_sqrt_n_sequence_general_matrix_eigenvector():
    A = rand(3, 3, seed=3)  # odd dimension: a real eigenvalue exists
    X, info = adversarial.sqrt_n_sequence(A, 1.5, 4, return_info=True)
    u = torch.as_tensor(info.eigenvector)
    assert torch.allclose(torch.as_tensor(A) @ u, info.eigenvalue * u, atol=1e-10)
    assert float(u.norm()) == pytest.approx(1.0) and float(X.norm(dim=1).max()) == pytest.approx(1.5)
    assert adversarial.sqrt_n_sequence(A, 1.5, 4, dtype="float32").dtype == torch.float32


@pytest.mark.parametrize("masked", [False, True])
def test_witness_reaches_lower_bound_with_library(masked):
    """Lip at the witness (library operator + estimator) >= Proposition 3.4, up to R = 100."""
    I = torch.eye(3, dtype=F64)
    for seed, R, n in [(0, 1.0, 6), (1, 3.0, 25), (2, 100.0, 10)]:
        A = rand(3, 3, seed=seed)
        X = adversarial.sqrt_n_sequence(A, R, n)
        est = local_lipschitz(SelfAttention(A, I, masked=masked), X)
        assert math.isfinite(est.value)
        assert est.value >= bounds.sqrt_n_lower(A, R, n) * (1 - 1e-6)


def test_sequence_of_copies_equals_two_atom_measure():
    """n-1 copies of one token act like the 2-atom measure (1/n, (n-1)/n), constants included
    (docs/math.md section 2)."""
    A, I = -torch.eye(3, dtype=F64), torch.eye(3, dtype=F64)
    for n in (2, 7, 30):
        X = adversarial.sqrt_n_sequence(A, 2.0, n)
        mu = Measure(X[:2], weights=torch.tensor([1 / n, 1 - 1 / n], dtype=F64))
        L_seq = dense_lipschitz(lambda Y: naive_attention(Y, A, I), X)
        assert local_lipschitz(SelfAttention(A, I), mu, method="dense").value == pytest.approx(L_seq, rel=1e-9)
        assert SelfAttention(A, I)(mu).points[1] == pytest.approx(naive_attention(X, A, I)[1], abs=1e-12)


# ---------------------------------------------------------------------------- Proposition 3.6
def test_two_dirac_measure_survives_underflow():
    A = -np.eye(3)  # gamma = 1, case "min"
    for R in (1.0, 30.0, 100.0):
        mu, info = adversarial.two_dirac(A, R, return_info=True)
        assert info.case == "min" and info.gamma == 1.0
        assert float(mu.log_weights[0]) == pytest.approx(-2.0 * R * R)  # p = exp(-2 gamma R^2), kept in log form
        assert float(mu.weights.sum()) == pytest.approx(1.0)
        u = torch.as_tensor(info.eigenvector)
        assert torch.allclose(mu.points, torch.stack([-R * u, R * u]))
        out = SelfAttention(A, np.eye(3))(mu).points
        assert torch.isfinite(out).all()
    assert info.bound == math.inf and bounds.two_dirac_lower(A, 100.0, log=True) == pytest.approx(
        math.log(0.5) + 2 * math.log(100.0) + 1e4)
    mu = adversarial.two_dirac(np.eye(2), 4.0, positions=True)
    assert mu.masked and mu.points[1].tolist() == pytest.approx([2.0, 0.0])


def test_two_dirac_masked_equals_unmasked_when_atoms_share_a_position():
    A, I = rand(3, 3, seed=8), torch.eye(3, dtype=F64)
    mu, mu_m = adversarial.two_dirac(A, 3.0), adversarial.two_dirac(A, 3.0, positions=True)
    a = local_lipschitz(SelfAttention(A, I), mu, method="dense").value
    b = local_lipschitz(SelfAttention(A, I, masked=True), mu_m, method="dense").value
    assert a == pytest.approx(b, rel=1e-10)


# ---------------------------------------------------------------------------- large radius hub
@pytest.mark.parametrize("A", [
    np.diag([1.0, 0.5, -0.2]),                       # <A w, w> > 0 possible
    -np.eye(3) - 0.1 * np.ones((3, 3)),              # negative definite
    np.array([[0, 1, 2], [-1, 0, 3], [-2, -3, 0.0]]),  # skew-symmetric: <A x, x> = 0
    None,                                            # random
])
@pytest.mark.parametrize("masked", [False, True])
def test_large_radius_configuration_has_one_hub(A, masked):
    A = rand(3, 3, seed=2).numpy() if A is None else A
    for n, hub in [(1, 0), (5, 0), (40, 0 if masked else 7)]:
        X = adversarial.large_radius_configuration(A, n=n, R=2.0, masked=masked, hub=hub)
        assert X.shape == (n, 3) and float(X.norm(dim=1).max()) == pytest.approx(2.0)
        S = X.numpy() @ A.T @ X.numpy().T
        if masked:
            S = np.where(np.tril(np.ones((n, n), dtype=bool)), S, -np.inf)
        assert (S.argmax(axis=1) == hub).all()  # computed here, independently of bounds.argmax_indices
        top2 = -np.sort(-S, axis=1)[:, :2] if n > 1 else None
        if n > 1:
            rows = np.isfinite(top2[:, 1])
            assert (top2[rows, 0] - top2[rows, 1] > 1e-6).all()


def test_large_radius_configuration_errors():
    with pytest.raises(ValueError, match="hub:"):
        adversarial.large_radius_configuration(np.eye(2), n=4, masked=True, hub=2)
    with pytest.raises(ValueError, match="hub:"):
        adversarial.large_radius_configuration(np.eye(2), n=4, hub=4)
    with pytest.raises(ValueError, match="A:"):
        adversarial.large_radius_configuration(np.zeros((2, 2)), n=4)
    with pytest.raises(ValueError, match="R:"):
        adversarial.large_radius_configuration(np.eye(2), n=4, R=0.0)


# ---------------------------------------------------------------------------- Appendix C.7
def test_zero_plus_spread_geometry():
    X = adversarial.zero_plus_spread(3.0, 7, 4)
    assert X.shape == (7, 4) and torch.equal(X[0], torch.zeros(4, dtype=F64))
    assert X[1:].norm(dim=1) == pytest.approx(torch.full((6,), 3.0, dtype=F64))
    assert X[1:].sum(0).abs().max() < 1e-12  # evenly spread: centred
    Xs = adversarial.zero_plus_spread(3.0, 7, 4, seed=1)
    assert Xs[1:].norm(dim=1) == pytest.approx(torch.full((6,), 3.0, dtype=F64))
    assert torch.equal(Xs, adversarial.zero_plus_spread(3.0, 7, 4, seed=1))
    assert adversarial.zero_plus_spread(2.0, 3, 1)[:, 0].tolist() == [0.0, 2.0, -2.0]


@pytest.mark.parametrize("seed", [None, 4])
def test_zero_plus_spread_grows_like_R_squared(seed):
    """Kim et al. / Appendix C.7: Lip at the zero-plus-spread configuration grows like R^2."""
    d, n = 3, 6
    A, V = rand(d, d, seed=5), rand(d, d, seed=6)
    radii = np.array([8.0, 16.0, 32.0, 64.0])
    L = np.array([dense_lipschitz(lambda Y: naive_attention(Y, A, V), adversarial.zero_plus_spread(R, n, d, seed=seed))
                  for R in radii])
    slope = np.polyfit(np.log(radii), np.log(L), 1)[0]
    assert abs(slope - 2.0) < 0.1, (slope, L)
    # the origin's softmax row is uniform, so its diagonal Jacobian block has the closed form
    # d f_0 / d x_0 = V (Cov A + I/n), Cov = X^T (I/n - 11^T/n^2) X, a lower bound on Lip growing like R^2
    for R, Lr in zip(radii, L):
        X = adversarial.zero_plus_spread(R, n, d, seed=seed)
        C = X.T @ (torch.eye(n, dtype=F64) / n - torch.ones(n, n, dtype=F64) / n**2) @ X
        assert Lr >= float(torch.linalg.matrix_norm(V @ (C @ A + torch.eye(d, dtype=F64) / n), ord=2)) * (1 - 1e-9)


# ---------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("call,exc,match", [
    (lambda: adversarial.sqrt_n_sequence(np.array([[0.0, -1.0], [1.0, 0.0]]), 1.0, 3), ValueError,
     "A: has no real eigenvalue"),
    (lambda: adversarial.two_dirac(np.array([[0.0, -1.0], [1.0, 0.0]]), 1.0), ValueError, "A: has no real"),
    (lambda: adversarial.two_dirac(np.zeros((2, 2)), 1.0), ValueError, "A: gamma"),
    (lambda: adversarial.sqrt_n_sequence(np.eye(2), -1.0, 3), ValueError, "R:"),
    (lambda: adversarial.sqrt_n_sequence(np.eye(2), 1.0, 0), ValueError, "n:"),
    (lambda: adversarial.sqrt_n_sequence(np.ones((2, 3)), 1.0, 3), ValueError, "A:"),
    (lambda: adversarial.sqrt_n_sequence(np.eye(2), 1.0, 3, return_info=1), TypeError, "return_info:"),
    (lambda: adversarial.sqrt_n_sequence(np.eye(2), 1.0, 3, dtype=torch.int64), TypeError, "dtype:"),
    (lambda: adversarial.zero_plus_spread(1.0, 1, 2), ValueError, "n:"),
    (lambda: adversarial.zero_plus_spread(1.0, 3, 0), ValueError, "d:"),
    (lambda: adversarial.large_radius_configuration(np.eye(2), n=3, masked="yes"), TypeError, "masked:"),
])
def test_bad_inputs_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------------------- every configuration in B_R
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_witnesses_and_configurations_are_in_the_ball_exactly(dtype):
    """The module's promise, checked as a user checks it: torch's computed norm of every token <= R, over random
    matrices and radii where R u rounds outside about half the time."""
    worst = 0.0
    for seed in range(40):
        A = rand(3, 3, seed=seed)
        R = float(0.5 + 3.0 * torch.rand(1, generator=torch.Generator().manual_seed(100 + seed)))
        sets = [adversarial.sqrt_n_sequence(A, R, 7, dtype=dtype),
                adversarial.large_radius_configuration(A, n=6, R=R, dtype=dtype),
                adversarial.zero_plus_spread(R, 6, 3, seed=seed, dtype=dtype),
                adversarial.zero_plus_spread(R, 6, 3, dtype=dtype),
                adversarial.two_dirac(A, R, dtype=dtype).points]
        for X in sets:
            assert X.dtype == dtype
            worst = max(worst, float((X.norm(dim=1) / R).max()))
            assert bool((X.norm(dim=1) <= R).all())
    assert worst >= 1 - 1e-6   # the witnesses do reach the sphere


# ---------------------------------------------------------------------------- review: silent inputs
def test_zero_plus_spread_seed_is_an_integer_or_a_generator():
    """A float seed was truncated (1.5 gave seed 1) and a string failed in int() without naming seed.
    Truth: torch's own draw from a generator seeded by hand."""
    with pytest.raises(TypeError, match="seed"):
        adversarial.zero_plus_spread(1.0, 3, 2, seed=1.5)
    with pytest.raises(TypeError, match="seed"):
        adversarial.zero_plus_spread(1.0, 3, 2, seed="a")
    with pytest.raises(TypeError, match="seed"):
        adversarial.zero_plus_spread(1.0, 3, 2, seed=True)
    Z = torch.randn(4, 3, generator=torch.Generator().manual_seed(7), dtype=F64)
    truth = torch.cat([torch.zeros(1, 3, dtype=F64), 2.0 * Z / Z.norm(dim=1, keepdim=True)])
    for seed in (7, np.int64(7), torch.Generator().manual_seed(7)):
        torch.testing.assert_close(adversarial.zero_plus_spread(2.0, 5, 3, seed=seed), truth, rtol=0, atol=1e-15)


def test_sqrt_n_measure_takes_n_beyond_the_float_range():
    """The docstring promises any real n > 1, 'up to 10^15 and beyond': a Python integer beyond float range
    (10**400) raised OverflowError. Truth: log-weights -log n = -400 log 10 and log(1 - 10^-400) = -0 in
    float64, on the two tokens of the n = 2 witness."""
    A = np.diag([2.0, -0.5])
    mu = adversarial.sqrt_n_measure(A, 1.5, 10**400)
    assert mu.log_weights.tolist() == pytest.approx([-400 * math.log(10), 0.0], rel=1e-15, abs=0)
    torch.testing.assert_close(mu.points, adversarial.sqrt_n_sequence(A, 1.5, 2), rtol=0, atol=0)
    # inside the float range the exact-integer and the float paths agree
    for n in (7, 10**20):
        a, b = adversarial.sqrt_n_measure(A, 1.5, n), adversarial.sqrt_n_measure(A, 1.5, float(n))
        torch.testing.assert_close(a.log_weights, b.log_weights, rtol=1e-15, atol=0)
        assert a.log_weights.tolist() == pytest.approx([-math.log(n), math.log1p(-1 / n)], rel=1e-15)
    for bad in (1, 1.0, math.inf, math.nan, -3, True, "5"):
        with pytest.raises(ValueError, match="n:"):
            adversarial.sqrt_n_measure(A, 1.5, bad)


def test_large_radius_configuration_takes_n_and_R_by_keyword():
    """It took (A, n, R) where every other builder and bound takes (A, R, n): (A, 2, 8) built 2 tokens at radius 8
    without a word (an API review). Positional sizes are refused; the keywords build what they say."""
    A = np.random.default_rng(0).standard_normal((3, 3)) / 2
    with pytest.raises(TypeError):
        adversarial.large_radius_configuration(A, 2, 8)
    X = adversarial.large_radius_configuration(A, R=2.0, n=8)
    assert X.shape == (8, 3)
    assert torch.isclose(X.norm(dim=1).max(), torch.tensor(2.0, dtype=X.dtype))
