"""particles.Measure: constructors, operations, statistics and input validation.

Truths: numpy (np.average, np.cov), closed forms (sphere radius, positions i/n), the transport LP
(scipy) for split invariance, exact error messages for bad inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from particles import Measure
from tests.reference import w2_lp
from transport import conditional_w2

F64 = torch.float64


def rand(n, d, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rand_weights(n, seed=0):
    w = torch.rand(n, generator=torch.Generator().manual_seed(seed + 100), dtype=F64) + 0.1
    return w / w.sum()


def emd_w2sq(mu, nu):
    """Independent W2^2: the transport linear program solved by scipy (tests/reference.py), no POT."""
    return w2_lp(mu.points.detach(), mu.weights.detach(), nu.points.detach(), nu.weights.detach()) ** 2


# ---------------------------------------------------------------- constructors
def test_default_measure_is_uniform_float64_unmasked():
    X = rand(5, 3)
    mu = Measure(X)
    assert mu.n == 5 and mu.dim == 3 and len(mu) == 5
    assert mu.dtype == F64 and mu.device.type == "cpu" and not mu.masked and mu.positions is None
    assert torch.allclose(mu.weights, torch.full((5,), 0.2, dtype=F64))
    assert torch.allclose(mu.log_weights, torch.full((5,), math.log(0.2), dtype=F64))
    assert torch.equal(mu.points, X)


def test_numpy_and_integer_input_become_float64():
    mu = Measure(np.arange(6).reshape(3, 2))
    assert mu.dtype == F64 and torch.equal(mu.points, torch.arange(6, dtype=F64).reshape(3, 2))
    assert Measure(np.ones((2, 2), dtype=np.float32)).dtype == F64


def test_empirical_and_sequence():
    X = rand(4, 2)
    e = Measure.empirical(X)
    assert not e.masked and torch.allclose(e.weights, torch.full((4,), 0.25, dtype=F64))
    s = Measure.sequence(X)
    assert s.masked
    assert torch.allclose(s.positions, torch.tensor([0.25, 0.5, 0.75, 1.0], dtype=F64))
    assert torch.allclose(s.weights, torch.full((4,), 0.25, dtype=F64))


def test_diracs_with_weights_and_normalize():
    X = rand(3, 2)
    mu = Measure.diracs(X, [0.2, 0.3, 0.5])
    assert torch.allclose(mu.weights, torch.tensor([0.2, 0.3, 0.5], dtype=F64))
    nu = Measure.diracs(X, [2.0, 3.0, 5.0], normalize=True)
    assert torch.allclose(nu.weights, mu.weights)


def test_two_dirac_keeps_underflowing_mass_in_log_form():
    u = torch.tensor([1.0, 0.0], dtype=F64)
    mu = Measure.two_dirac(u, u / 2, p=0.25)
    assert torch.allclose(mu.weights, torch.tensor([0.25, 0.75], dtype=F64))
    big = Measure.two_dirac(u, u / 2, log_p=-2000.0)
    assert float(big.weights[0]) == 0.0  # exp(-2000) underflows ...
    assert float(big.log_weights[0]) == -2000.0  # ... but the log-mass survives exactly
    assert float(big.log_weights[1]) == pytest.approx(0.0, abs=1e-300)
    with pytest.raises(ValueError, match="p, log_p"):
        Measure.two_dirac(u, u, p=0.5, log_p=-1.0)
    with pytest.raises(ValueError, match="p: expected a mass"):
        Measure.two_dirac(u, u, p=1.5)
    with pytest.raises(ValueError, match="log_p"):
        Measure.two_dirac(u, u, log_p=0.5)
    with pytest.raises(ValueError, match="x0, x1"):
        Measure.two_dirac(u, torch.zeros(3, dtype=F64), p=0.5)


def test_sphere_ball_gaussian_samples():
    s = Measure.sphere(200, 4, radius=3.0, seed=1)
    assert torch.allclose(s.points.norm(dim=1), torch.full((200,), 3.0, dtype=F64))
    b = Measure.ball(500, 3, radius=2.0, seed=1)
    r = b.points.norm(dim=1)
    assert float(r.max()) <= 2.0 + 1e-12
    # uniform in a ball: P(|x| <= R/2) = 1/8 in d = 3; 500 samples, 5 standard deviations
    frac = float((r <= 1.0).double().mean())
    assert abs(frac - 0.125) < 5 * math.sqrt(0.125 * 0.875 / 500)
    assert torch.equal(Measure.sphere(10, 3, seed=7).points, Measure.sphere(10, 3, seed=7).points)
    assert Measure.sphere(5, 2, positions=True).masked and Measure.ball(5, 2, positions=True).masked
    cov = np.array([[2.0, 0.5], [0.5, 1.0]])
    n = 20000
    g = Measure.gaussian(n, [1.0, -2.0], cov, seed=3)
    # standard errors sqrt(var / n) (mean) and ~ sqrt(2 var^2 / n) (covariance); 6 sigma margins
    assert np.allclose(g.mean().numpy(), [1.0, -2.0], atol=6 * math.sqrt(2.0 / n))
    assert np.allclose(g.covariance().numpy(), cov, atol=6 * math.sqrt(2 * 4.0 / n))
    with pytest.raises(ValueError, match="cov: must be symmetric"):
        Measure.gaussian(3, [0.0, 0.0], [[1.0, 0.5], [0.0, 1.0]])
    with pytest.raises(ValueError, match="cov: must be positive semi-definite"):
        Measure.gaussian(3, [0.0, 0.0], [[1.0, 0.0], [0.0, -1.0]])
    with pytest.raises(ValueError, match=r"cov: expected shape \(2, 2\)"):
        Measure.gaussian(3, [0.0, 0.0], np.eye(3))
    with pytest.raises(ValueError, match="radius"):
        Measure.sphere(3, 2, radius=-1.0)
    with pytest.raises(ValueError, match="n: expected an integer >= 1"):
        Measure.ball(0, 2)


# ---------------------------------------------------------------- dtype and device
def test_float32_on_request_and_to():
    X = rand(4, 3)
    mu = Measure(X, dtype=torch.float32)
    assert mu.dtype == torch.float32 and mu.weights.dtype == torch.float32
    assert Measure(X.float()).dtype == torch.float32  # float tensors keep their dtype
    assert Measure.sequence(X, dtype="float32").positions.dtype == torch.float32
    assert Measure.sphere(3, 2, dtype=torch.float32).dtype == torch.float32
    nu = Measure.sequence(X).to(dtype=torch.float32)
    assert nu.dtype == nu.weights.dtype == nu.log_weights.dtype == nu.positions.dtype == torch.float32
    back = nu.to(device="cpu", dtype="float64")
    assert back.dtype == F64 and torch.allclose(back.points, X, atol=1e-6)
    with pytest.raises(TypeError, match="dtype: a measure needs a floating-point dtype"):
        mu.to(dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype: a measure needs a floating-point dtype"):
        Measure(X, dtype=torch.int32)
    with pytest.raises(TypeError, match="dtype: unknown dtype name"):
        Measure(X, dtype="float99")


# ---------------------------------------------------------------- operations
def test_pushforward_keeps_weights_and_positions():
    mu = Measure(rand(5, 2), rand_weights(5), positions=torch.linspace(0, 1, 5, dtype=F64))
    A = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 1.0]], dtype=F64)
    nu = mu.pushforward(lambda x: x @ A)
    assert nu.dim == 3 and torch.allclose(nu.points, mu.points @ A)
    assert torch.equal(nu.weights, mu.weights) and torch.equal(nu.positions, mu.positions)
    # numpy results keep the measure's dtype
    m32 = mu.to(dtype=torch.float32)
    assert m32.pushforward(lambda x: x.numpy() * 2).dtype == torch.float32
    with pytest.raises(ValueError, match="fn: must map"):
        mu.pushforward(lambda x: x[:3])
    with pytest.raises(ValueError, match="fn: produced NaN"):
        mu.pushforward(lambda x: x / 0.0)


def test_pushforward_is_differentiable():
    X = rand(4, 2).requires_grad_()
    nu = Measure(X).pushforward(lambda x: 3 * x)
    nu.mean().sum().backward()
    assert torch.allclose(X.grad, torch.full((4, 2), 0.75, dtype=F64))


@pytest.mark.parametrize("masked", [False, True])
def test_split_merge_roundtrip_and_zero_distance(masked):
    X = rand(6, 3)
    w = rand_weights(6)
    pos = torch.tensor([0.1, 0.1, 0.4, 0.5, 0.5, 1.0], dtype=F64) if masked else None
    mu = Measure(X, w, pos)
    sp = mu.split(2, 0.3)
    assert sp.n == 7
    assert torch.equal(sp.points[2], sp.points[3]) and torch.equal(sp.points[3:], X[2:])
    assert float(sp.weights[2]) == pytest.approx(0.3 * float(w[2]), rel=1e-14)
    assert float(sp.weights[3]) == pytest.approx(0.7 * float(w[2]), rel=1e-14)
    assert float(sp.weights.sum()) == pytest.approx(1.0, abs=1e-14)
    if masked:
        assert float(sp.positions[3]) == float(pos[2])
    back = sp.merge()
    assert back.n == 6
    assert torch.allclose(back.points, X, atol=0) and torch.allclose(back.weights, w, rtol=1e-14)
    if masked:
        assert torch.equal(back.positions, pos)
    assert emd_w2sq(mu, sp) == pytest.approx(0.0, abs=1e-14)
    # negative index counts from the end
    assert torch.equal(mu.split(-1).points[-1], X[-1])


def test_merge_with_tolerance_and_positions():
    X = torch.tensor([[0.0, 0.0], [1e-4, 0.0], [5.0, 5.0], [0.0, 0.0]], dtype=F64)
    w = torch.tensor([0.1, 0.3, 0.2, 0.4], dtype=F64)
    m = Measure(X, w).merge(atol=1e-3)
    assert m.n == 2
    assert torch.allclose(m.weights, torch.tensor([0.8, 0.2], dtype=F64))
    # weight-averaged location of the merged group: (0.3 * 1e-4) / 0.8
    assert torch.allclose(m.points[0], torch.tensor([0.3e-4 / 0.8, 0.0], dtype=F64))
    # equal points at different positions stay apart
    mp = Measure(X, w, positions=[0.2, 0.2, 0.5, 0.9]).merge(atol=1e-3)
    assert mp.n == 3 and torch.allclose(mp.positions, torch.tensor([0.2, 0.5, 0.9], dtype=F64))
    with pytest.raises(ValueError, match="atol"):
        Measure(X, w).merge(atol=-1.0)


@pytest.mark.parametrize("atol", [0.0, 0.1, 1.0, 1e305, math.inf])
def test_merge_never_joins_atoms_at_different_positions(atol):
    """Positions closer than atol are still different positions: merging them once averaged the positions (0.2
    and 0.25 became 0.225, a position neither atom had, and the conditional W2 to the original was inf). Same
    point, positions 0.2 and 0.25: kept apart; two atoms within atol at one position: merged, at that position."""
    X = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.05, 1.0], [3.0, 3.0]], dtype=F64)
    w = torch.tensor([0.25, 0.25, 0.2, 0.2, 0.1], dtype=F64)
    mu = Measure(X, w, positions=[0.2, 0.25, 1.0, 1.0, 0.2])
    m = mu.merge(atol)
    joined = atol >= 0.05
    assert m.n == (4 if joined else 5) - (atol >= 3.0)
    expected = [0.2, 0.25, 1.0] + ([] if joined else [1.0]) + ([] if atol >= 3.0 else [0.2])
    assert m.positions.tolist() == expected
    for s in (0.2, 0.25, 1.0):   # each position keeps its mass
        assert float(m.weights[m.positions == s].sum()) == pytest.approx(float(w[mu.positions == s].sum()), rel=1e-14)
    if joined and atol < 3.0:
        assert conditional_w2(mu, m) == pytest.approx(math.sqrt(0.4 * 0.025**2), rel=1e-9)


def test_split_bad_arguments():
    mu = Measure(rand(3, 2))
    with pytest.raises(ValueError, match="i: atom index 3 out of range"):
        mu.split(3)
    with pytest.raises(TypeError, match="i: expected an atom index"):
        mu.split(1.0)
    for t in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            mu.split(0, t)


def test_with_points():
    mu = Measure.sequence(rand(3, 2))
    nu = mu.with_points(rand(3, 4, seed=1))
    assert nu.dim == 4 and torch.equal(nu.positions, mu.positions)
    with pytest.raises(ValueError, match="points: expected"):
        mu.with_points(rand(2, 2))
    with pytest.raises(ValueError, match="NaN or infinite"):
        mu.with_points(torch.full((3, 2), float("nan"), dtype=F64))


# ---------------------------------------------------------------- statistics
def test_radius_mean_covariance_against_numpy():
    X = rand(7, 3, seed=4)
    w = rand_weights(7, seed=4)
    mu = Measure(X, w)
    Xn, wn = X.numpy(), w.numpy()
    assert mu.radius() == pytest.approx(np.linalg.norm(Xn, axis=1).max(), rel=1e-14)
    assert np.allclose(mu.mean().numpy(), np.average(Xn, axis=0, weights=wn), rtol=1e-13)
    assert np.allclose(mu.covariance().numpy(), np.cov(Xn.T, aweights=wn, bias=True), rtol=1e-12)
    # atoms of zero mass are not in the support
    far = Measure(torch.cat([X, torch.full((1, 3), 100.0, dtype=F64)]), torch.cat([w, w.new_zeros(1)]))
    assert far.radius() == pytest.approx(mu.radius())


def test_position_marginal_slices_and_prefix():
    X = rand(5, 2)
    w = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=F64)
    pos = torch.tensor([0.5, 0.2, 0.5, 1.0, 0.2], dtype=F64)
    mu = Measure(X, w, pos)
    s, m = mu.position_marginal()
    assert torch.allclose(s, torch.tensor([0.2, 0.5, 1.0], dtype=F64))
    assert torch.allclose(m, torch.tensor([0.45, 0.4, 0.15], dtype=F64))
    s2, m2 = Measure(X, w, pos + torch.tensor([0, 0, 1e-10, 0, 0], dtype=F64)).position_marginal(atol=1e-8)
    assert s2.shape == (3,) and torch.allclose(m2, m)
    sl = mu.at_position(0.5)
    assert sl.n == 2 and torch.allclose(sl.points, X[[0, 2]])
    assert torch.allclose(sl.weights, torch.tensor([0.25, 0.75], dtype=F64))
    pre = mu.up_to(0.5)
    assert pre.n == 4 and torch.allclose(pre.weights, w[[0, 1, 2, 4]] / 0.85)
    with pytest.raises(ValueError, match="at_position: no atom at position 0.3"):
        mu.at_position(0.3)
    with pytest.raises(ValueError, match="up_to: no atom at or before position 0.1"):
        mu.up_to(0.1)
    with pytest.raises(ValueError, match="position_marginal: this measure has no positions"):
        Measure(X).position_marginal()
    with pytest.raises(ValueError, match="atol"):
        mu.position_marginal(atol=-1.0)


# ---------------------------------------------------------------- validation
BAD = [
    (dict(points=[[0.0, float("nan")]]), ValueError, "points: contains 1 NaN or infinite entry"),
    (dict(points=[[0.0, float("inf")], [1.0, 2.0]]), ValueError, "points: contains 1 NaN"),
    (dict(points=[1.0, 2.0]), ValueError, r"points: expected an \(N, d\) array of atoms \(2-D\)"),
    (dict(points=np.zeros((0, 2))), ValueError, "points: a measure needs at least one atom"),
    (dict(points=np.zeros((2, 0))), ValueError, "points: atoms need at least one coordinate"),
    (dict(points="abc"), TypeError, "points: expected a torch tensor or numpy array"),
    (dict(points=np.array([["a"]])), TypeError, "points: expected real numbers"),
    (dict(points=[[1.0], [2.0]], weights=[1.5, -0.5]), ValueError, "weights: must be non-negative"),
    (dict(points=[[1.0], [2.0]], weights=[0.3, 0.3]), ValueError, "weights: must sum to 1, got 0.6"),
    (dict(points=[[1.0], [2.0]], weights=[0.0, 0.0], normalize=True), ValueError, "weights: every weight is zero"),
    (dict(points=[[1.0], [2.0]], weights=[0.5, 0.2, 0.3]), ValueError, "weights: expected 2 entries"),
    (dict(points=[[1.0], [2.0]], weights=[[0.5, 0.5]]), ValueError, "weights: expected a vector"),
    (dict(points=[[1.0], [2.0]], weights=[0.5, float("nan")]), ValueError, "weights: contains 1 NaN"),
    (dict(points=[[1.0], [2.0]], positions=[0.5, 1.5]), ValueError, r"positions: must lie in \[0, 1\]"),
    (dict(points=[[1.0], [2.0]], positions=[-0.1, 0.5]), ValueError, r"positions: must lie in \[0, 1\]"),
    (dict(points=[[1.0], [2.0]], positions=[0.5]), ValueError, "positions: expected 2 entries"),
    (dict(points=[[1.0], [2.0]], positions=[0.5, float("nan")]), ValueError, "positions: contains 1 NaN"),
    (dict(points=[[1.0], [2.0]], log_weights=[0.0, 0.0]), ValueError, "log_weights: weights sum to exp"),
    (dict(points=[[1.0], [2.0]], log_weights=[float("nan"), 0.0]), ValueError, "log_weights: contains NaN"),
    (dict(points=[[1.0], [2.0]], log_weights=[-math.inf, -math.inf], normalize=True), ValueError,
     "log_weights: every weight is zero"),
    (dict(points=[[1.0], [2.0]], weights=[0.5, 0.5], log_weights=[0.0, -1.0]), ValueError,
     "weights, log_weights: give at most one"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD)
def test_bad_input_is_rejected_with_a_named_message(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        Measure(**kwargs)


def test_normalize_is_an_explicit_opt_in():
    mu = Measure([[1.0], [2.0]], weights=[0.3, 0.3], normalize=True)
    assert torch.allclose(mu.weights, torch.tensor([0.5, 0.5], dtype=F64))
    lw = Measure([[1.0], [2.0]], log_weights=[0.0, 0.0], normalize=True)
    assert torch.allclose(lw.weights, torch.tensor([0.5, 0.5], dtype=F64))
    # float32 weights get the looser float32 tolerance, float64 the strict one
    Measure([[1.0], [2.0]], weights=[0.5, 0.5 + 1e-7], dtype=torch.float32)
    with pytest.raises(ValueError, match="weights: must sum to 1"):
        Measure([[1.0], [2.0]], weights=[0.5, 0.5 + 1e-7])


def test_no_overflow_at_large_radius():
    mu = Measure.sphere(50, 3, radius=100.0, seed=0)
    assert mu.radius() == pytest.approx(100.0)
    assert bool(torch.isfinite(mu.covariance()).all())
    assert bool(torch.isfinite(mu.split(0, 1e-300).log_weights).all())


def test_boolean_points_are_refused_not_coerced():
    X = np.random.default_rng(0).normal(size=(4, 3))
    with pytest.raises(TypeError, match="points: .*booleans"):
        Measure(X > 0)
    with pytest.raises(TypeError, match="points: .*bool tensor"):
        Measure(torch.as_tensor(X) > 0)
    with pytest.raises(TypeError, match="weights"):
        Measure(X, np.array([True, False, False, False]))


def test_float32_weights_with_float64_points_are_judged_in_their_own_precision():
    w = torch.full((10,), 0.1, dtype=torch.float32)   # 0.1f = 0.100000001490116...
    assert abs(float(w.double().sum()) - 1) > 1e-9     # off in float64, exact to float32's precision
    X = torch.randn(10, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mu = Measure(X, w)
    assert mu.weights.dtype == torch.float64
    assert abs(float(mu.weights.sum()) - 1) <= 1e-12
    assert torch.allclose(mu.weights, w.double(), rtol=1e-6)
    # an honest error in float32 is still an error
    with pytest.raises(ValueError, match="weights: must sum to 1"):
        Measure(X, w * 1.001)


# ---------------------------------------------------------------- half precisions (review)
@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 300), (torch.float16, 3000)])
def test_half_precision_sequences_keep_their_positions_apart(dtype, n):
    """i/n and (i+1)/n round to one value in bfloat16 from n = 257 (float16: 2049): a token would see its
    successor. Positions of half-precision points are kept in float32, where they stay distinct and exact
    to float32 rounding of i/n."""
    from meanfield.operator import sequence_positions

    X = torch.zeros(n, 2, dtype=dtype)
    truth = torch.arange(1, n + 1, dtype=F64) / n
    for pos in (Measure.sequence(X).positions, sequence_positions(n, X),
                Measure(X, positions=truth).positions, Measure.sequence(X.double()).to(dtype=dtype).positions):
        assert pos.dtype == torch.float32
        assert bool((pos[1:] > pos[:-1]).all())
        assert torch.allclose(pos.double(), truth, rtol=1e-7, atol=0)


def test_causal_mask_in_half_precision_hides_exactly_the_future():
    from meanfield.hf import causal_mask

    for dtype, n in [(torch.bfloat16, 257), (torch.bfloat16, 1024), (torch.float16, 3000)]:
        visible = causal_mask(n, dtype)[0, 0] == 0
        assert torch.equal(visible, torch.ones(n, n, dtype=torch.bool).tril()), (dtype, n)


def test_masked_attention_in_bfloat16_never_reads_a_later_token():
    """Editing the last token changes no earlier output (the causal mask's defining property), bit for bit."""
    from meanfield import SelfAttention

    n, d = 300, 4
    g = torch.Generator().manual_seed(5)
    A, V = torch.randn(d, d, generator=g, dtype=F64), torch.randn(d, d, generator=g, dtype=F64)
    op = SelfAttention(A, V, masked=True).to(dtype=torch.bfloat16)
    X = torch.randn(n, d, generator=g, dtype=F64).to(torch.bfloat16)
    Y = X.clone()
    Y[-1] = 10.0
    for method in ("dense", "stream"):
        from meanfield import kernels

        with kernels.use(method):
            a, b = op.sequence(X), op.sequence(Y)
        assert torch.equal(a[:-1], b[:-1]), method


def test_to_refuses_a_dtype_that_cannot_hold_the_measure():
    X = torch.tensor([[1e5, 0.5], [0.0, 0.5]], dtype=F64)
    with pytest.raises(ValueError, match="dtype: torch.float16 cannot hold this measure's points"):
        Measure(X).to(dtype=torch.float16)
    small = Measure(torch.zeros(2, 1, dtype=F64), log_weights=torch.tensor([-7e4, 0.0], dtype=F64), normalize=True)
    with pytest.raises(ValueError, match="dtype: 1 atom"):
        small.to(dtype=torch.float16)
    ok = Measure(torch.zeros(2, 1, dtype=F64), log_weights=torch.tensor([-7e3, 0.0], dtype=F64), normalize=True)
    assert float(ok.to(dtype=torch.float16).log_weights[0]) == pytest.approx(-7e3, rel=1e-3)


def test_masses_are_judged_before_the_points_precision_rounds_them():
    # a mass of 1e-8 is zero in float16, its log (-18.42) is not: the atom stays in the support
    X = torch.tensor([[50.0], [0.0]], dtype=torch.float16)
    mu = Measure(X, [1e-8, 1 - 1e-8])
    assert float(mu.log_weights[0]) == pytest.approx(math.log(1e-8), abs=0.02)
    assert mu.radius() == 50.0
    # log-weights below float16's range are refused, not turned into zero masses
    with pytest.raises(ValueError, match="log_weights: 1 atom"):
        Measure(X, log_weights=[-7e4, 0.0])
    # raw counts whose sum overflows the dtype: normalized by the largest first
    for dtype, w in [(torch.float16, [6e4, 6e4]), (F64, [1e308, 1e308])]:
        mu = Measure(torch.zeros(2, 1, dtype=dtype), torch.tensor(w, dtype=dtype), normalize=True)
        assert mu.weights.tolist() == [0.5, 0.5]
    # float16 weights for float64 points are judged in float16's precision (1/3 each sums to 0.99976 there)
    w16 = torch.full((3,), 1 / 3, dtype=torch.float16)
    mu = Measure(torch.zeros(3, 1, dtype=F64), w16)
    assert abs(float(mu.weights.sum()) - 1) <= 1e-12


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_cuda_without_cuda_is_a_named_error():
    with pytest.raises(ValueError, match="device: 'cuda' was asked for"):
        Measure(torch.zeros(2, 1), device="cuda")
    with pytest.raises(ValueError, match="device: 'cuda' was asked for"):
        Measure(torch.zeros(2, 1)).to("cuda")


def test_two_dirac_small_mass_in_log_form_near_one():
    """q = 1 - p from log p: log q = log(-expm1(log p)) exactly, also where p is within 1e-17 of 1."""
    for log_p in (-1e-10, -1e-17, -0.5):
        mu = Measure.two_dirac([0.0], [1.0], log_p=log_p)
        truth = math.log(-math.expm1(log_p))   # closed form, float64
        assert float(mu.log_weights[1]) == pytest.approx(truth, rel=1e-15)
        assert float(mu.log_weights[0]) == log_p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_in_half_precision(dtype):
    """Duplicated atoms merge into one of the summed weight in half precision too (bfloat16 crashed in numpy),
    positions kept."""
    X = torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 0.5]], dtype=dtype)
    mu = Measure(X, positions=torch.tensor([0.5, 0.5, 1.0]))
    m = mu.merge()
    assert m.n == 2 and m.dtype == dtype
    assert torch.equal(m.points, X[1:]) and m.positions.tolist() == [0.5, 1.0]
    assert m.weights.float().tolist() == pytest.approx([2 / 3, 1 / 3], rel=1e-2)


def test_measure_review_fixes_of_dtypes():
    """Samplers given a non-floating dtype, and pushforward / with_points that would change the measure's dtype,
    are refused by name (they failed inside torch, or made a measure of float32 points and float64 weights that
    no operator takes, or rounded float64 points into a float32 measure silently)."""
    for make in (lambda dt: Measure.sphere(4, 3, dtype=dt), lambda dt: Measure.ball(4, 3, dtype=dt),
                 lambda dt: Measure.gaussian(4, [0.0, 0.0], dtype=dt)):
        for dt in (torch.int32, torch.int64, "bool"):
            with pytest.raises(TypeError, match="dtype: a measure needs a floating-point dtype"):
                make(dt)
    mu = Measure(rand(5, 3))
    with pytest.raises(TypeError, match="fn: returned torch.int64 points for a measure of torch.float64"):
        mu.pushforward(lambda p: p.round().long())
    with pytest.raises(TypeError, match="fn: returned torch.float32 points"):
        mu.pushforward(lambda p: p.float())
    assert mu.pushforward(lambda p: 2 * p).dtype == F64
    mu32 = mu.to(dtype=torch.float32)
    with pytest.raises(TypeError, match="points: torch.float64 points for a measure of torch.float32"):
        mu32.with_points(rand(5, 3))
    assert mu32.with_points(rand(5, 3).numpy()).points.dtype == torch.float32


def test_seeds_outside_32_bits_are_refused_by_name():
    """torch's CPU generator keeps a seed's low 32 bits: seed 2**32 drew what 0 draws, -1 what 2**32 - 1 draws, and
    2**64 failed with 'Overflow when unpacking long long' (found by an independent review). Seeds in [0, 2**32)
    draw as before, each its own stream."""
    from particles import Measure

    assert not torch.equal(Measure.sphere(3, 2, seed=0).points, Measure.sphere(3, 2, seed=1).points)
    assert torch.equal(Measure.sphere(3, 2, seed=2**32 - 1).points, Measure.sphere(3, 2, seed=2**32 - 1).points)
    for bad in (2**32, -1, 2**64):
        with pytest.raises(ValueError, match=r"seed: expected an integer in \[0, 2\*\*32\)"):
            Measure.sphere(3, 2, seed=bad)
    from meanfield import SelfAttention, local_lipschitz

    op = SelfAttention(torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    X = torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    est = local_lipschitz(op, X, method="lanczos", seed=2**32 - 1)   # its second stream wraps to 0, not an error
    assert est.converged
