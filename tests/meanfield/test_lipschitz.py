"""Local Lipschitz estimators against the dense Jacobian of tests/reference.py and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import L2SelfAttention, MultiHeadAttention, SelfAttention, lipschitz_ratio, local_lipschitz
from meanfield.lipschitz import ConvergenceError, LipschitzEstimate
from particles import Measure
from tests.reference import dense_lipschitz, naive_attention, w2_assignment

f64 = torch.float64
METHODS = ["lanczos", "power", "dense"]
KW = dict(tol=1e-11, max_iter=20000)


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=f64)


def make_op(kind, masked, d=4):
    if kind == "single":
        return SelfAttention(rand(d, d, seed=1), rand(3, d, seed=2), masked=masked)
    if kind == "mha":
        heads = [SelfAttention.from_qkv(rand(2, d, seed=10 * h + 1), rand(2, d, seed=10 * h + 2),
                                        rand(2, d, seed=10 * h + 3), b_Q=rand(2, seed=10 * h + 4),
                                        b_K=rand(2, seed=10 * h + 5), b_V=rand(2, seed=10 * h + 6), masked=masked)
                 for h in range(2)]
        return MultiHeadAttention(heads, rand(d, 4, seed=50), rand(d, seed=51))
    return L2SelfAttention(rand(2, d, 2, seed=1), rand(2, d, 2, seed=2), rand(4, d, seed=3), masked=masked)


def rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kind", ["single", "mha", "l2"])
def test_estimators_match_dense_jacobian(kind, masked, method):
    op = make_op(kind, masked)
    X = rand(6, 4, seed=7, scale=1.5)
    truth = dense_lipschitz(op.sequence, X)
    est = local_lipschitz(op, X, method=method, **KW)
    assert isinstance(est, LipschitzEstimate) and est.method == method and est.converged
    assert rel(est.value, truth) <= 1e-8
    # certificate: value is a lower bound, value + error an upper bound of the true constant
    assert est.value <= truth * (1 + 1e-12) and est.value + est.error >= truth * (1 - 1e-12)
    assert est.vector.shape == X.shape
    assert abs(float(est.vector.norm()) - 1) < 1e-10
    # the returned direction attains the constant: |J u| = value
    Ju = torch.func.jvp(op.sequence, (X,), (est.vector,))[1]
    assert rel(float(Ju.norm()), truth) <= 1e-8


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("masked", [False, True])
def test_weighted_measure_matches_weighted_dense_jacobian(masked, method):
    op = make_op("single", masked)
    X = rand(5, 4, seed=3)
    w = torch.tensor([0.05, 0.3, 0.1, 0.4, 0.15], dtype=f64)
    pos = torch.tensor([0.1, 0.1, 0.5, 0.7, 1.0], dtype=f64)
    mu = Measure(X, w, positions=pos if masked else None)
    points_map = lambda Y: naive_attention(Y, op.A, op.V, masked=masked, log_weights=w.log(), positions=pos)
    truth = dense_lipschitz(points_map, X, weights=w)
    est = local_lipschitz(op, mu, method=method, **KW)
    assert rel(est.value, truth) <= 1e-8
    # weights matter: the Euclidean constant at the same points is different
    assert rel(dense_lipschitz(points_map, X), truth) > 1e-3


@pytest.mark.parametrize("kind", ["single", "mha", "l2"])
def test_uniform_measure_equals_sequence(kind):
    for masked in (False, True):
        op = make_op(kind, masked)
        X = rand(6, 4, seed=11)
        mu = Measure.sequence(X) if masked else Measure.empirical(X)
        a = local_lipschitz(op, X, tol=1e-11)
        b = local_lipschitz(op, mu, tol=1e-11)
        assert rel(b.value, a.value) <= 1e-9


def _query_term(A, V, y, z, n):
    """||V Sigma(z) A||_2: the covariance of the attention distribution of the query z over the
    two-atom measure (1/n) delta_y + ((n-1)/n) delta_z, through A and V (docs/math.md section 4.7)."""
    pts = torch.stack([y, z])
    logits = pts @ (A @ z) + torch.log(torch.tensor([1 / n, (n - 1) / n], dtype=f64))
    P = torch.softmax(logits, 0)
    m = P @ pts
    C = (pts - m).T @ ((pts - m) * P[:, None])
    return float(torch.linalg.matrix_norm(V @ C @ A, ord=2))


@pytest.mark.parametrize("seed", range(6))
def test_duplicated_tokens_versus_two_atom_measure(seed):
    """n-1 copies of one token vs the measure (1/n) delta_y + ((n-1)/n) delta_z (docs/math.md 2.3, 4.7):
    same outputs; the sequence's constant is max(two-atom W2 constant, ||V Sigma(z) A||), since the
    copies may move apart (mass splitting). Truth: dense Jacobians of the naive attention."""
    n, d = 5, 2
    A, V = rand(d, d, seed=10 + seed, scale=1.5), rand(d, d, seed=20 + seed)
    y, z = rand(d, seed=30 + seed, scale=2.0), rand(d, seed=40 + seed)
    X = torch.stack([y] + [z] * (n - 1))
    w = torch.tensor([1 / n, (n - 1) / n], dtype=f64)
    seq = dense_lipschitz(lambda Y: naive_attention(Y, A, V), X)
    two = dense_lipschitz(lambda Y: naive_attention(Y, A, V, log_weights=w.log()), torch.stack([y, z]), weights=w)
    assert rel(seq, max(two, _query_term(A, V, y, z, n))) <= 1e-9
    op = SelfAttention(A, V)
    assert rel(local_lipschitz(op, X, tol=1e-11).value, seq) <= 1e-9
    assert rel(local_lipschitz(op, Measure(torch.stack([y, z]), w), tol=1e-11).value, two) <= 1e-9


def test_copies_can_have_a_larger_constant_than_the_two_atom_measure():
    """A case where moving the copies apart helps: d = 1, A = -0.5612, V = -0.8676."""
    A, V = torch.tensor([[-0.5612]], dtype=f64), torch.tensor([[-0.8676]], dtype=f64)
    y, z, n = torch.tensor([9.198], dtype=f64), torch.tensor([-0.232], dtype=f64), 4
    X = torch.stack([y] + [z] * (n - 1))
    w = torch.tensor([1 / n, (n - 1) / n], dtype=f64)
    op = SelfAttention(A, V)
    seq = local_lipschitz(op, X, tol=1e-11).value
    two = local_lipschitz(op, Measure(torch.stack([y, z]), w), tol=1e-11).value
    assert seq > two * (1 + 1e-3)
    assert rel(seq, _query_term(A, V, y, z, n)) <= 1e-9


def test_batched_equals_one_by_one():
    op = make_op("mha", masked=True)
    X = rand(4, 6, 4, seed=5)
    for method in METHODS:
        batch = local_lipschitz(op, X, method=method, **KW)
        # one kind of object whatever the rank: a batched estimate, indexable like the list it replaces
        assert isinstance(batch, LipschitzEstimate) and batch.batched and len(batch) == 4
        assert batch.value.shape == (4,) and batch.vector.shape == X.shape and bool(batch.converged.all())
        assert [e.value for e in batch] == batch.value.tolist()
        for i in range(4):
            assert torch.equal(batch[i].vector, batch.vector[i]) and batch[i].error == float(batch.error[i])
            single = local_lipschitz(op, X[i], method=method, **KW)
            assert rel(batch[i].value, single.value) <= 1e-9
            assert rel(batch[i].value, dense_lipschitz(op.sequence, X[i])) <= 1e-8
    # an arbitrary callable is looped over the batch
    loop = local_lipschitz(lambda Y: op.sequence(Y), X, tol=1e-11)
    assert [round(e.value, 8) for e in loop] == [round(e.value, 8) for e in local_lipschitz(op, X, tol=1e-11)]


def test_arbitrary_callable_like_a_hugging_face_module():
    Wq, Wk, Wv = rand(4, 4, seed=1), rand(4, 4, seed=2), rand(4, 4, seed=3)
    module = lambda Y: torch.softmax((Y @ Wq.T) @ (Y @ Wk.T).T / 2, -1) @ (Y @ Wv.T)
    X = rand(5, 4, seed=4)
    truth = dense_lipschitz(module, X)
    for method in METHODS:
        assert rel(local_lipschitz(module, X, method=method, **KW).value, truth) <= 1e-8


@pytest.mark.parametrize("method", METHODS)
def test_constant_in_the_binade_of_the_first_product(method):
    """The solvers work on J / c with c the power of two just above |J u0| (u0 the random start).
    When every singular value lies in one binade, [0.5, 1) here, the constant is below c and the scaled
    top singular value below 1: each method still returns it. Truth: the map Y -> Y M^T is linear,
    its Jacobian is I_n (x) M, and its constant is the top singular value of M (0.95)."""
    Q1, _ = torch.linalg.qr(rand(5, 5, seed=31))
    Q2, _ = torch.linalg.qr(rand(5, 5, seed=32))
    M = Q1 @ torch.diag(torch.tensor([0.95, 0.8, 0.7, 0.6, 0.55], dtype=f64)) @ Q2.T
    est = local_lipschitz(lambda Y: Y @ M.T, rand(4, 5, seed=33), method=method, tol=1e-10, max_iter=2000)
    assert est.converged and abs(est.value - 0.95) <= 1e-9


def test_power_uses_the_tangent_not_the_primal():
    """The pitfall of docs/math.md section 4: jvp(...)[0] is f(X), not J u."""
    op = make_op("single", masked=False)
    X = rand(6, 4, seed=7, scale=1.5)
    truth = dense_lipschitz(op.sequence, X)
    u = rand(6, 4, seed=8)
    primal, tangent = torch.func.jvp(op.sequence, (X,), (u,))
    # on this input f(X) is far from proportional to J u, so the pitfall is detectable
    cos = float((primal * tangent).sum() / (primal.norm() * tangent.norm()))
    assert abs(cos) < 0.99
    wrong = u
    for _ in range(200):
        w = torch.func.jvp(op.sequence, (X,), (wrong,))[0]
        _, vjp_fn = torch.func.vjp(op.sequence, X)
        z = vjp_fn(w)[0]
        wrong = z / z.norm()
    wrong_value = float(torch.func.jvp(op.sequence, (X,), (wrong,))[0].norm())
    assert rel(wrong_value, truth) > 1e-2
    assert rel(local_lipschitz(op, X, method="power", **KW).value, truth) <= 1e-8


def sqrt_n_witness(R, n):
    """Proposition 3.4, case lambda_max/8 >= -lambda_min: X = (R u, R u/2, ..., R u/2), A u = lambda_max u."""
    A = torch.diag(torch.tensor([1.0, 0.3, -0.1], dtype=f64))
    u = torch.tensor([1.0, 0.0, 0.0], dtype=f64)
    return A, torch.stack([R * u] + [R * u / 2] * (n - 1)), 1.0 / 8


@pytest.mark.parametrize("masked", [False, True])
def test_adversarial_radius_100_gives_finite_constants(masked):
    n, R = 12, 100.0
    A, X, gamma = sqrt_n_witness(R, n)
    op = SelfAttention(A, torch.eye(3, dtype=f64), masked=masked)
    for method in ("lanczos", "dense"):
        est = local_lipschitz(op, X, method=method, tol=1e-10)
        assert math.isfinite(est.value) and math.isfinite(est.error) and est.value > 0
    if not masked:
        # Proposition 3.4: Lip >= sqrt(n-1) / (1 + (n-1) exp(-2 gamma R^2)) at the witness
        assert est.value >= math.sqrt(n - 1) / (1 + (n - 1) * math.exp(-2 * gamma * R**2)) * (1 - 1e-9)


def test_moderate_radius_witness_lower_bound_and_weights_far_apart():
    n, R = 30, 4.0
    A, X, gamma = sqrt_n_witness(R, n)
    op = SelfAttention(A, torch.eye(3, dtype=f64))
    lower = math.sqrt(n - 1) / (1 + (n - 1) * math.exp(-2 * gamma * R**2))
    est = local_lipschitz(op, X, tol=1e-10)
    assert est.value >= lower * (1 - 1e-9)
    assert rel(est.value, dense_lipschitz(op.sequence, X)) <= 1e-8
    # two-atom measure with a tiny mass exp(-2 gamma R^2) (Proposition 3.6 family) stays finite
    two = Measure.two_dirac(X[0], X[1], log_p=-2 * gamma * 10.0**2 * 4)
    est2 = local_lipschitz(op, two, tol=1e-10)
    assert math.isfinite(est2.value)


def test_non_convergence_is_reported():
    op = make_op("single", masked=False, d=6)
    X = rand(10, 6, seed=2, scale=2.0)
    with pytest.raises(ConvergenceError, match="did not reach") as info:
        local_lipschitz(op, X, method="power", tol=1e-12, max_iter=2)
    assert isinstance(info.value.estimate, LipschitzEstimate) and not info.value.estimate.converged
    with pytest.warns(RuntimeWarning, match="did not reach"):
        est = local_lipschitz(op, X, method="lanczos", tol=1e-12, max_iter=2, on_failure="warn")
    assert not est.converged and est.error > 1e-12 * est.value


@pytest.mark.parametrize("max_iter", [1, 2, 5])
def test_power_iteration_uses_exactly_its_budget_when_it_does_not_converge(max_iter):
    """Power iteration stopped by ``max_iter`` ran ``max_iter`` iterations of two products each (J u
    and J^T w; the first J u also sets the scale), and reports that count (meanfield.krylov)."""
    with pytest.warns(RuntimeWarning, match=f"did not reach tol=1e-12 in {max_iter} iterations"):
        est = local_lipschitz(make_op("single", masked=False), rand(6, 4, seed=7, scale=1.5), method="power",
                              tol=1e-12, max_iter=max_iter, on_failure="warn")
    assert not est.converged
    assert est.iterations == max_iter and est.applications == 2 * max_iter


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_the_seed_fixes_the_random_start(method):
    """The same seed gives bit for bit the same estimate; another seed starts elsewhere (the certified
    values agree within tol; the singular vectors, converged to about the square root of tol, do not agree
    bit for bit)."""
    op, X = make_op("single", masked=False), rand(6, 4, seed=7, scale=1.5)
    a, b, c = (local_lipschitz(op, X, method=method, tol=1e-8, seed=s) for s in (0, 0, 1))
    assert a.value == b.value and a.error == b.error and torch.equal(a.vector, b.vector)
    assert not torch.equal(a.vector, c.vector) and abs(a.value - c.value) <= 2e-8 * a.value


def test_power_iteration_declares_a_plateau_after_patience_iterations():
    """Two top singular values 1e-7 apart (0.95 and 0.95 (1 - 1e-7)), the rest far below: after the
    small components die out (a factor (0.3 / 0.95)^2 per iteration), each iteration shrinks the error
    by (1 - 1e-7)^2, far from the 1% gain the solver asks for in PATIENCE iterations. Power iteration
    stops there, says it stalled, and returns a value between the two top singular values; it
    neither runs on to max_iter nor declares the plateau before PATIENCE iterations without gain."""
    from meanfield.krylov import PATIENCE

    Q1, _ = torch.linalg.qr(rand(5, 5, seed=31))
    Q2, _ = torch.linalg.qr(rand(5, 5, seed=32))
    M = Q1 @ torch.diag(torch.tensor([0.95, 0.95 * (1 - 1e-7), 0.3, 0.2, 0.1], dtype=f64)) @ Q2.T
    with pytest.warns(RuntimeWarning, match="stalled"):
        est = local_lipschitz(lambda Y: Y @ M.T, rand(4, 5, seed=33), method="power", tol=1e-10, max_iter=1000,
                              on_failure="warn")
    assert est.stalled and not est.converged and PATIENCE < est.iterations < 1000
    assert 0.95 * (1 - 2e-7) <= est.value <= 0.95 * (1 + 1e-12)


def test_power_iteration_on_a_batch_whose_size_is_not_the_dimension():
    """A batch of 3 sequences in dimension 4: each member's constant is its dense Jacobian's."""
    op = make_op("single", masked=False)
    X = rand(3, 6, 4, seed=5)
    batch = local_lipschitz(op, X, method="power", tol=1e-10, max_iter=20000)
    assert bool(batch.converged.all())
    for i in range(3):
        assert rel(batch[i].value, dense_lipschitz(op.sequence, X[i])) <= 1e-8


def test_bad_inputs_name_the_argument():
    op = make_op("single", masked=True)
    X = rand(5, 4)
    with pytest.raises(ValueError, match="method"):
        local_lipschitz(op, X, method="arnoldi")
    with pytest.raises(ValueError, match="tol"):
        local_lipschitz(op, X, tol=0)
    with pytest.raises(ValueError, match="on_failure"):
        local_lipschitz(op, X, on_failure="ignore")
    with pytest.raises(ValueError, match="max_iter"):
        local_lipschitz(op, X, max_iter=0)
    with pytest.raises(TypeError, match="f"):
        local_lipschitz(42, X)
    with pytest.raises(ValueError, match="X"):
        local_lipschitz(op, rand(5, 3))
    with pytest.raises(ValueError, match="X"):
        local_lipschitz(op, rand(2, 2, 5, 4))
    with pytest.raises(ValueError, match="positions"):
        local_lipschitz(op, Measure(X))
    with pytest.raises(TypeError, match="f"):
        local_lipschitz(lambda Y: Y.detach().numpy(), X)
    with pytest.raises(TypeError, match="f: expected an attention operator"):
        lipschitz_ratio(42, Measure(X), Measure(X))


def test_lipschitz_ratio_unmasked_and_masked():
    op = make_op("single", masked=False)
    X, Y = rand(6, 4, seed=1), rand(6, 4, seed=2)
    expected = w2_assignment(op.sequence(X), op.sequence(Y)) / w2_assignment(X, Y)
    assert rel(lipschitz_ratio(op, Measure(X), Measure(Y)), expected) <= 1e-8
    # masked: conditional W2 of two sequences is ||X - Y|| / sqrt(n)
    opm = make_op("single", masked=True)
    expected = float((opm.sequence(X) - opm.sequence(Y)).norm() / (X - Y).norm())
    assert rel(lipschitz_ratio(opm, Measure.sequence(X), Measure.sequence(Y)), expected) <= 1e-8
    # locally the ratio tends to at most the local constant, and reaches it along the top direction
    est = local_lipschitz(opm, Measure.sequence(X), tol=1e-11)
    r = lipschitz_ratio(opm, Measure.sequence(X), Measure.sequence(X + 1e-6 * est.vector))
    assert rel(r, est.value) <= 1e-4 and r <= est.value * (1 + 1e-4)
    with pytest.raises(ValueError, match="W2"):
        lipschitz_ratio(op, Measure(X), Measure(X))


def test_lipschitz_ratio_takes_the_transport_method_and_its_options():
    """Both distances by the method given (the exact network simplex was the only one: dense, N M costs). Truth:
    the assignment problem's W2 of the uniform clouds and of their images; the debiased Sinkhorn distance at a
    blur (0.3) well below the clouds' displacement (2) is within 1% of it."""
    op = make_op("single", masked=False, d=2)
    X, Y = rand(40, 2, seed=11), rand(40, 2, seed=12) + 1.5
    expected = w2_assignment(op.sequence(X), op.sequence(Y)) / w2_assignment(X, Y)
    assert rel(lipschitz_ratio(op, Measure(X), Measure(Y)), expected) <= 1e-8
    streamed = lipschitz_ratio(op, Measure(X), Measure(Y), method="streaming", reg=0.1)
    assert rel(streamed, expected) <= 0.01 and rel(streamed, expected) > 1e-8   # another distance, close to W2
    with pytest.raises(TypeError, match="reg"):
        lipschitz_ratio(op, Measure(X), Measure(Y), method="exact", reg=0.1)   # w2's own refusal, naming it
    with pytest.raises(TypeError, match="method: expected a transport method name"):
        lipschitz_ratio(op, Measure(X), Measure(Y), method=None)
    for name in ("squared", "return_plan"):   # w2 takes them: the ratio of squares, or a tuple, came back
        with pytest.raises(TypeError, match=f"{name}: lipschitz_ratio is a ratio of W2 distances"):
            lipschitz_ratio(op, Measure(X), Measure(Y), **{name: True})
    opm = make_op("single", masked=True, d=2)
    mu, nu = Measure.sequence(X[:6]), Measure.sequence(Y[:6])
    assert lipschitz_ratio(opm, mu, nu, atol=0.0) == lipschitz_ratio(opm, mu, nu)
    with pytest.raises(ValueError, match="method: a masked operator's ratio takes conditional W2"):
        lipschitz_ratio(opm, mu, nu, method="streaming", reg=0.1)
    with pytest.raises(TypeError, match="reg: not an option of conditional_w2"):
        lipschitz_ratio(opm, mu, nu, reg=0.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lipschitz_ratio_of_a_half_precision_operator(dtype):
    """Transport works in float32 or float64: the half operator's measures are widened (exactly) for the
    distances, and the ratio is the one of the half outputs (truth: conditional W2 of sequences, |X - Y|_F /
    sqrt(n), on the same half values in float64)."""
    opm = make_op("single", masked=True).to(dtype=dtype)
    mu, nu = Measure.sequence(rand(6, 4, seed=1).to(dtype)), Measure.sequence(rand(6, 4, seed=2).to(dtype))
    fx, fy = opm(mu).points.double(), opm(nu).points.double()
    expected = float((fx - fy).norm() / (mu.points.double() - nu.points.double()).norm())
    assert rel(lipschitz_ratio(opm, mu, nu), expected) <= 1e-6


def test_numpy_input_is_accepted():
    op = make_op("single", masked=False)
    X = rand(5, 4, seed=1)
    assert rel(local_lipschitz(op, X.numpy(), tol=1e-11).value, dense_lipschitz(op.sequence, X)) <= 1e-8
    assert np.isfinite(float(local_lipschitz(op, X)))
