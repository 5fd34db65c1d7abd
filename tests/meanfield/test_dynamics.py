"""Token dynamics: simulate, its variants, and the clustering diagnostics.

Truths: a direct loop of residual layers written with tests.reference.naive_attention, a tight
torchdiffeq dopri5 solution (an independent integrator), the closed-form rescaled field
V sum_j P_ij (y_j - y_i), scipy ConvexHull / Delaunay, and the energy formula written out here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.spatial import ConvexHull, Delaunay

from meanfield import MultiHeadAttention, SelfAttention, simulate
from meanfield.clustering import (
    cluster_labels,
    count_clusters,
    hull_vertices,
    interaction_energy,
    limit_set,
    w2_to_reference,
)
from meanfield.dynamics import Trajectory, residual_layers
from meanfield.isotropic import IsotropicAttention
from particles import Measure
from tests.reference import naive_attention

D = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    """These systems have a few particles: BLAS threads only spin on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=D)


def _op(d=2, seed=0, scale=0.5, masked=False):
    return SelfAttention(_rand(d, d, seed=seed, scale=scale), _rand(d, d, seed=seed + 1, scale=scale), masked=masked)


def _weighted(n=6, d=2, seed=3):
    w = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=D) + 0.2
    return Measure(_rand(n, d, seed=seed), w / w.sum())


# ------------------------------------------------------------------ conservation and representation
def test_weights_and_positions_are_conserved_masked():
    X = _rand(7, 2, seed=5)
    w = torch.linspace(1, 2, 7, dtype=D)
    mu = Measure(X, w / w.sum(), positions=torch.arange(1, 8, dtype=D) / 7)
    traj = simulate(_op(masked=True), mu, [0.0, 0.5, 1.0], options={"steps": 10})
    assert isinstance(traj, Trajectory) and len(traj) == 3
    assert traj.points.shape == (3, 7, 2)
    for m in traj:
        assert torch.equal(m.weights, mu.weights) and torch.equal(m.positions, mu.positions)
        assert abs(float(m.weights.sum()) - 1.0) < 1e-14
    assert torch.equal(traj[0].points, X)
    assert not torch.allclose(traj.final.points, X)  # particles did move


def test_split_measure_follows_the_same_dynamics():
    mu = _weighted()
    op = _op(seed=2, scale=0.8)
    times = [0.0, 0.7, 1.5]
    a = simulate(op, mu, times, method="rk4", options={"steps": 20})
    b = simulate(op, mu.split(2, 0.3), times, method="rk4", options={"steps": 20})
    keep = [0, 1, 2, 4, 5, 6]  # atom 3 of the split measure is the second half of atom 2
    assert torch.allclose(b.points[:, keep], a.points, atol=1e-12, rtol=0)
    assert torch.allclose(b.points[:, 3], b.points[:, 2], atol=1e-13, rtol=0)
    assert float(b.weights[2] + b.weights[3]) == pytest.approx(float(a.weights[2]), abs=1e-15)


# ------------------------------------------------------------------ orders of convergence
def test_residual_layers_converge_first_order_to_the_ode():
    X = _rand(6, 2, seed=11)
    A, V = _rand(2, 2, seed=12, scale=0.7), _rand(2, 2, seed=13, scale=0.7)
    op = SelfAttention(A, V)
    ref = simulate(op, Measure(X), [0.0, 1.0], method="dopri5", rtol=1e-12, atol=1e-14).final.points

    def layers(L):  # the Transformer itself: L residual layers, written with the naive reference
        Y = X.clone()
        for _ in range(L):
            Y = Y + naive_attention(Y, A, V) / L
        return Y

    errs = []
    for L in (8, 16, 32, 64):
        Y = layers(L)
        assert torch.allclose(residual_layers(op, X, L), Y, atol=1e-13, rtol=0)
        errs.append(float((Y - ref).norm()))
    ratios = [errs[i] / errs[i + 1] for i in range(3)]
    assert all(1.8 < r < 2.2 for r in ratios), ratios


def test_rk4_is_fourth_order():
    X = _rand(5, 3, seed=21)
    op = _op(d=3, seed=22, scale=0.6)
    ref = simulate(op, Measure(X), [0.0, 2.0], method="dopri5", rtol=1e-13, atol=1e-15).final.points
    errs = [float((simulate(op, Measure(X), [0.0, 2.0], options={"steps": s}).final.points - ref).norm())
            for s in (8, 16, 32)]
    ratios = [errs[0] / errs[1], errs[1] / errs[2]]
    assert all(12 < r < 20 for r in ratios), (errs, ratios)


def test_requested_times_only_and_step_vs_steps():
    X = _rand(4, 2, seed=31)
    op = _op(seed=32)
    a = simulate(op, Measure(X), [0.0, 0.25, 1.0], options={"step": 0.05})
    assert a.points.shape[0] == 3 and a.steps == 20
    b = simulate(op, Measure(X), [0.0, 1.0], options={"steps": 20})
    assert torch.allclose(a.final.points, b.final.points, atol=1e-14, rtol=0)


# ------------------------------------------------------------------ rescaled tokens, clusters
def test_rescaled_field_matches_closed_form_and_unscaled_matches_plain():
    X = _rand(6, 2, seed=41)
    A, V = _rand(2, 2, seed=42, scale=0.5), _rand(2, 2, seed=43, scale=0.5)
    op = SelfAttention(A, V)
    tr = simulate(op, Measure(X), [0.0, 0.5, 1.0], method="dopri5", rescale=True, rtol=1e-11, atol=1e-13)
    plain = simulate(op, Measure(X), [0.0, 0.5, 1.0], method="dopri5", rtol=1e-11, atol=1e-13)
    assert torch.allclose(tr.unscaled().points, plain.points, atol=1e-8, rtol=0)
    # y' = sum_j P_ij V (y_j - y_i), P from scores of x = e^{tV} y: compare with a finite difference
    t, h = 0.5, 1e-4
    fine = simulate(op, Measure(X), [0.0, t - h, t + h], method="dopri5", rescale=True, rtol=1e-13, atol=1e-15)
    y = simulate(op, Measure(X), [0.0, t], method="dopri5", rescale=True, rtol=1e-13, atol=1e-15).final.points
    x = y @ torch.linalg.matrix_exp(t * V).T
    P = torch.softmax(x @ A.T @ x.T, dim=1)
    closed = (P @ y - y) @ V.T
    assert torch.allclose((fine.points[2] - fine.points[1]) / (2 * h), closed, atol=1e-6, rtol=0)


def test_v_identity_rescaled_particles_end_on_polytope_vertices():
    X = _rand(12, 2, seed=51)
    I = torch.eye(2, dtype=D)
    tr = simulate(SelfAttention(I, I), Measure(X), [0.0, 2.0, 5.0], method="dopri5", rescale=True,
                  rtol=1e-9, atol=1e-11)
    Y = tr.final.points.numpy()
    ls = limit_set(Y, tol=0.05)
    assert 2 <= ls.n_clusters < 12 and ls.spread < 0.02
    # independent truth: scipy's hull of the cluster centers has every center as a vertex
    assert len(ConvexHull(ls.centers).vertices) == ls.n_clusters if ls.n_clusters >= 3 else True
    assert ls.all_vertices
    # every particle is near a hull vertex, and the hull only shrinks: limits lie in the initial hull
    verts = ls.centers[ConvexHull(ls.centers).vertices] if ls.n_clusters >= 3 else ls.centers
    assert np.linalg.norm(Y[:, None] - verts[None], axis=2).min(1).max() < 0.02
    assert (Delaunay(X.numpy()).find_simplex(Y, tol=1e-9) >= 0).all()
    clusters = count_clusters(tr, 0.05)
    assert clusters[0] == 12 and list(clusters) == sorted(clusters, reverse=True)


# ------------------------------------------------------------------ sphere models
@pytest.mark.parametrize("model", ["SA", "USA"])
def test_sphere_models_keep_norms_and_increase_energy(model):
    X = _rand(10, 3, seed=61)
    X = X / X.norm(dim=1, keepdim=True)
    beta = 2.0
    times = torch.linspace(0, 4, 21, dtype=D)
    tr = simulate(IsotropicAttention(beta, model), Measure(X), times, geometry="sphere", options={"step": 0.05})
    assert torch.allclose(tr.points.norm(dim=2), torch.ones(21, 10, dtype=D), atol=1e-13)
    # energy written out: (1 / (2 beta n^2)) sum_ij exp(beta <x_i, x_j>)
    E = [float(torch.exp(beta * P @ P.T).sum() / (2 * beta * 100)) for P in tr.points]
    assert np.allclose(interaction_energy(tr, beta), E, rtol=1e-12)
    assert all(b >= a - 1e-12 for a, b in zip(E, E[1:])) and E[-1] > E[0]
    # the same dynamics with an explicit operator: SA is attention with A = beta I, V = I, projected
    if model == "SA":
        op = SelfAttention(beta * torch.eye(3, dtype=D), torch.eye(3, dtype=D))
        tr2 = simulate(op, Measure(X), times, geometry="sphere", options={"step": 0.05})
        assert torch.allclose(tr2.points, tr.points, atol=1e-12)


def test_usa_field_is_gradient_of_energy_over_weights():
    mu = _weighted(n=5, d=3, seed=71)
    beta = 1.5
    X = mu.points.clone().requires_grad_(True)
    E = (torch.exp(beta * X @ X.T) * mu.weights[:, None] * mu.weights[None, :]).sum() / (2 * beta)
    (g,) = torch.autograd.grad(E, X)
    v = IsotropicAttention(beta, "USA").velocity(mu, mu.points)
    assert torch.allclose(v, g / mu.weights[:, None], atol=1e-12)


def test_sphere_d3_collapses_to_one_cluster():
    mu = Measure.sphere(16, 3, seed=3)
    tr = simulate(IsotropicAttention(1.0, "SA"), mu, [0.0, 30.0], geometry="sphere", options={"step": 0.25})
    assert count_clusters(tr.final, 1e-3) == 1


# ------------------------------------------------------------------ causal, layers, multi-head
def test_masked_dynamics_are_causal():
    X = _rand(8, 2, seed=81)
    op = _op(seed=82, scale=0.8, masked=True)
    a = simulate(op, Measure.sequence(X), [0.0, 1.0, 2.0], options={"steps": 10})
    Y = X.clone()
    Y[5:] += _rand(3, 2, seed=83, scale=3.0)  # change every token after the 5th
    b = simulate(op, Measure.sequence(Y), [0.0, 1.0, 2.0], options={"steps": 10})
    assert torch.equal(a.points[:, :5], b.points[:, :5])
    assert not torch.allclose(a.points[:, 5:], b.points[:, 5:])
    # token 1 sees only itself: x_1' = V x_1, so x_1(t) = exp(tV) x_1(0)
    assert torch.allclose(a.points[2, 0], torch.linalg.matrix_exp(2.0 * op.V) @ X[0], atol=1e-6)


def test_layers_list_equals_composition_and_callable():
    X = _rand(5, 2, seed=91)
    op1, op2 = _op(seed=92), _op(seed=94)
    both = simulate([op1, op2], Measure(X), [0.0, 1.0, 2.0], options={"steps": 16})
    first = simulate(op1, Measure(X), [0.0, 1.0], options={"steps": 16}).final
    second = simulate(op2, first, [1.0, 2.0], options={"steps": 16}).final
    assert torch.allclose(both.final.points, second.points, atol=1e-14, rtol=0)
    # smooth time dependence through a callable: RK4 converges at fourth order to dopri5
    A, V = op1.A, op1.V
    smooth = lambda t: SelfAttention(A * math.cos(t), V * (1 + 0.5 * t))
    ref = simulate(smooth, Measure(X), [0.0, 2.0], method="dopri5", rtol=1e-13, atol=1e-15).final.points
    e1, e2 = (float((simulate(smooth, Measure(X), [0.0, 2.0], options={"steps": s}).final.points - ref).norm())
              for s in (16, 32))
    assert 12 < e1 / e2 < 20
    ad = simulate([op1, op2], Measure(X), [0.0, 2.0], method="dopri5", rtol=1e-11, atol=1e-13)
    rk = simulate([op1, op2], Measure(X), [0.0, 2.0], options={"steps": 200})
    assert torch.allclose(ad.final.points, rk.final.points, atol=1e-8)


def test_multihead_euler_step_is_one_residual_layer():
    X = _rand(6, 4, seed=101)
    heads = [SelfAttention(_rand(4, 4, seed=102 + h, scale=0.5), _rand(2, 4, seed=110 + h)) for h in range(2)]
    W_O = _rand(4, 4, seed=120, scale=0.5)
    mh = MultiHeadAttention(heads, W_O)
    one = simulate(mh, Measure(X), [0.0, 0.1], method="euler", options={"steps": 1}).final.points
    ref = X + 0.1 * torch.cat([naive_attention(X, h.A, h.V) for h in heads], dim=1) @ W_O.T
    assert torch.allclose(one, ref, atol=1e-13)


def test_float32_is_kept():
    X = _rand(5, 2, seed=131).float()
    op = SelfAttention(torch.eye(2), torch.eye(2))
    tr = simulate(op, Measure(X), [0.0, 1.0], options={"steps": 5})
    assert tr.points.dtype == torch.float32


# ------------------------------------------------------------------ errors
def test_bad_inputs_are_reported():
    mu = Measure(_rand(4, 2))
    op = _op()
    with pytest.raises(ValueError, match="times"):
        simulate(op, mu, [0.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="geometry"):
        simulate(op, mu, [0.0, 1.0], geometry="torus")
    with pytest.raises(TypeError, match="unexpected keyword"):
        simulate(op, mu, [0.0, 1.0], spherre=True)
    with pytest.raises(ValueError, match=r"options: \['first_step'\] do not apply to the fixed-step"):
        simulate(op, mu, [0.0, 1.0], options={"first_step": 0.1})
    with pytest.raises(ValueError, match="options: first_step = -1.0; expected a positive finite step"):
        simulate(op, mu, [0.0, 1.0], method="dopri5", options={"first_step": -1.0})
    with pytest.raises(ValueError, match="options"):
        simulate(op, mu, [0.0, 1.0], method="dopri5", options={"steps": 10})
    with pytest.raises(ValueError, match="rescale"):
        simulate(op, mu, [0.0, 1.0], rescale=torch.eye(3, dtype=D))
    # a number or a numpy boolean is neither True/False nor V (it failed as a 0-d matrix, or on "booleans")
    for odd in (1, 0, 1.0, np.True_, np.False_):
        with pytest.raises(TypeError, match=r"rescale: expected True, False or a \(2, 2\) matrix V"):
            simulate(op, mu, [0.0, 1.0], rescale=odd)
    with pytest.raises(TypeError, match="op"):
        simulate(42, mu, [0.0, 1.0])
    with pytest.raises(ValueError, match="method"):
        simulate(op, mu, [0.0, 1.0], method="leapfrog")
    with pytest.raises(ValueError, match="rtol"):
        simulate(op, mu, [0.0, 1.0], method="dopri5", rtol=-1.0)
    with pytest.raises(ValueError, match="step"):
        simulate(op, mu, [0.0, 1.0], options={"step": 0.0})
    with pytest.raises(ValueError, match="d_out"):
        simulate(SelfAttention(torch.eye(2, dtype=D), torch.ones(3, 2, dtype=D)), mu, [0.0, 1.0])
    with pytest.raises(RuntimeError, match="did not converge"):
        simulate(op, mu, [0.0, 10.0], method="dopri5", options={"max_steps": 2})


# ------------------------------------------------------------------ clustering diagnostics
def test_cluster_labels_exact_and_large_n_path_agree():
    rng = np.random.default_rng(0)
    centers = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 3.0]])
    X = np.concatenate([c + 0.01 * rng.standard_normal((50, 2)) for c in centers])
    lab = cluster_labels(X, 0.3)
    assert lab.max() + 1 == 4 and (lab == np.repeat(np.arange(4), 50)).all()
    assert (cluster_labels(X, 0.3, exact_limit=10) == lab).all()
    # single linkage chains: points 0.9 apart on a line form one cluster at tol 1, many at tol 0.8
    line = np.arange(10.0)[:, None] * np.array([[0.9, 0.0]])
    assert count_clusters(line, 1.0) == 1 and count_clusters(line, 0.8) == 10
    for tol in (0.5, 0.85, 0.95):   # both paths exact
        assert count_clusters(line, tol, exact_limit=1) == count_clusters(line, tol) == (1 if tol > 0.9 else 10)
    with pytest.warns(DeprecationWarning, match="slack is ignored"):
        assert count_clusters(line, 0.85, slack=0.1) == 10


def test_count_clusters_above_the_exact_limit_is_single_linkage():
    """Truth: connected components of the graph of pairs within tol from scipy's k-d tree. 20000 points uniform
    on the sphere at 1e-3 of the scale, where the grid-representative approximation counted 3% too few (and 45%
    too few at 10^6 points), and clusters that chain."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    rng = np.random.default_rng(0)
    x = rng.standard_normal((20000, 3))
    for X in (x / np.linalg.norm(x, axis=1, keepdims=True),
              np.concatenate([c + 0.004 * rng.standard_normal((3000, 3)) for c in np.eye(3)])):
        tol = 0.01
        pairs = cKDTree(X).query_pairs(tol, output_type="ndarray")
        k = connected_components(coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])),
                                            shape=(len(X), len(X))), directed=False)[0]
        assert count_clusters(X, tol) == k


def test_hull_vertices_of_square_with_interior_points():
    sq = np.array([[0, 0], [1, 0], [1, 1], [0, 1], [0.5, 0.5], [0.2, 0.7], [0.5, 0.0]], dtype=float)
    assert list(hull_vertices(sq)) == [0, 1, 2, 3]
    assert list(hull_vertices(np.array([[0.0, 0], [1, 1], [2, 2]]))) == [0, 2]  # collinear


def test_w2_to_reference_matches_assignment():
    pytest.importorskip("transport")
    import transport

    if not hasattr(transport, "w2"):
        pytest.skip("transport.w2 not landed yet")
    from scipy.optimize import linear_sum_assignment

    op = _op(seed=141)
    a = simulate(op, Measure(_rand(8, 2, seed=142)), [0.0, 0.5], options={"steps": 5})
    b = simulate(op, Measure(_rand(8, 2, seed=143)), [0.0, 0.5], options={"steps": 5})
    got = w2_to_reference(a, b)
    for k in range(2):
        C = torch.cdist(a.points[k], b.points[k]).numpy() ** 2
        r, c = linear_sum_assignment(C)
        assert got[k] == pytest.approx(math.sqrt(C[r, c].mean()), rel=1e-9)


def test_clustering_has_a_scale_free_default_tolerance():
    """tol=None clusters at 1e-3 of the configuration's scale (here the bounding box's diagonal, larger than
    any norm): two tight groups 1e4 apart are 2 clusters at that scale, and the same picture scaled by 1e-6
    too; one point is one cluster."""
    g = torch.Generator().manual_seed(0)
    base = torch.cat([torch.randn(20, 3, generator=g, dtype=torch.float64) * 1e-4,
                      1e4 + torch.randn(20, 3, generator=g, dtype=torch.float64) * 1e-4])
    for scale in (1.0, 1e-6):
        X = base * scale
        diag = float((X.max(0).values - X.min(0).values).norm())
        assert count_clusters(X) == 2 == count_clusters(X, 1e-3 * diag)
        assert count_clusters(X, 1e-9 * diag) == 40
    assert count_clusters(torch.zeros(1, 3, dtype=torch.float64)) == 1
    assert count_clusters(torch.zeros(5, 3, dtype=torch.float64)) == 1
    with pytest.raises(TypeError, match="tol"):
        count_clusters(base, True)
    with pytest.raises(ValueError, match="tol"):
        count_clusters(base, -1.0)
    with pytest.raises(ValueError, match="points: expected at least one point"):
        count_clusters(torch.zeros(0, 3, dtype=torch.float64))


def test_fixed_steps_follow_each_requested_interval():
    """steps=k takes k steps in every interval between requested times, whatever their lengths, and
    step=h at most h: counted independently from the times given (the interval of each piece is found
    by bisection, so thousands of output times stay cheap)."""
    op = SelfAttention(np.eye(2) * 0.5, np.eye(2))
    mu = Measure(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64))
    times = [0.0, 0.01, 0.5, 0.51, 2.0]
    assert simulate(op, mu, times, method="euler", options={"steps": 3}).steps == 3 * (len(times) - 1)
    h = 0.1
    expected = sum(max(1, math.ceil((b - a) / h - 1e-9)) for a, b in zip(times[:-1], times[1:]))
    assert simulate(op, mu, times, method="euler", options={"step": h}).steps == expected
    many = np.linspace(0.0, 1.0, 2001).tolist()
    assert simulate(op, mu, many, method="euler", options={"steps": 1}).steps == 2000


def test_the_previous_keywords_of_simulate_still_work_with_a_warning():
    """step / steps / max_steps moved into options, sphere into geometry, sphere="SA" with beta into
    op=IsotropicAttention(beta, "SA"): the old spellings give the same trajectories, with a warning."""
    X = _rand(6, 3, seed=5)
    X = X / X.norm(dim=1, keepdim=True)
    mu, op = Measure(X), _op(d=3, seed=6)
    cases = [(dict(steps=4), dict(options={"steps": 4}), op),
             (dict(step=0.1), dict(options={"step": 0.1}), op),
             (dict(sphere=True, steps=3), dict(geometry="sphere", options={"steps": 3}), op),
             (dict(sphere="SA", beta=2.0, steps=3), dict(geometry="sphere", options={"steps": 3}),
              IsotropicAttention(2.0, "SA"))]
    for old, new, new_op in cases:
        with pytest.warns(DeprecationWarning, match="go into options"):
            a = simulate(None if "beta" in old else op, mu, [0.0, 0.5], **old)
        b = simulate(new_op, mu, [0.0, 0.5], **new)
        assert torch.equal(a.points, b.points) and a.geometry == b.geometry
    with pytest.warns(DeprecationWarning, match="IsotropicAttention"):
        from meanfield import SphereAttention

        old_op = SphereAttention(1.5, "USA")
    assert isinstance(old_op, IsotropicAttention)


def test_an_adaptive_solvers_unknown_option_is_refused_by_name():
    """A misspelt option of an adaptive solver (torchdiffeq only warns, then ignores it: the intended step cap
    was lost) is a ValueError naming it and listing the solver's options; a known one is passed on."""
    X = torch.randn(5, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    op = SelfAttention(np.eye(3) / 3, np.eye(3))
    with pytest.raises(ValueError, match=r"max_stpes.*dopri5.*first_step"):
        simulate(op, Measure(X), [0.0, 1.0], method="dopri5", options={"max_stpes": 10})
    traj = simulate(op, Measure(X), [0.0, 1.0], method="dopri5", options={"first_step": 0.1})
    assert torch.isfinite(traj.final.points).all()


def test_default_tolerance_sees_a_collapsed_cluster():
    """Tokens on the unit sphere collapsed to within 1e-12 of one point (SA dynamics run to t = 40 reach
    8e-15) are one cluster under the default tolerance, as under an absolute 1e-3; relative to the frame's own
    diagonal they were 64. Two such clusters far apart stay two."""
    g = torch.Generator().manual_seed(1)
    c = torch.randn(3, generator=g, dtype=torch.float64)
    c = c / c.norm()
    X = c + 1e-12 * torch.randn(64, 3, generator=g, dtype=torch.float64)
    X = X / X.norm(dim=1, keepdim=True)
    assert count_clusters(X) == 1 == count_clusters(X, 1e-3)
    assert limit_set(X).n_clusters == 1
    assert count_clusters(torch.cat([X, -X])) == 2
    frames = torch.stack([X, torch.cat([X[:32], -X[32:]])])
    assert count_clusters(frames).tolist() == [1, 2]


def test_fixed_steps_are_counted_before_the_first_one(monkeypatch):
    """A step of 1e-12 over [0, 1] is 1e12 steps: refused before any step (it ran for days), naming step and the
    budget; the budget is an option, and a plan within it runs exactly that many steps (nfev = 4 per RK4 step)."""
    from meanfield import integrators

    taken = []
    rk4 = integrators.FIXED["rk4"]
    monkeypatch.setitem(integrators.FIXED, "rk4", lambda *a: taken.append(1) or rk4(*a))
    mu, op = Measure(_rand(4, 2)), _op()
    with pytest.raises(ValueError, match=r"step: 1e\+12 steps over \[0, 1\] exceed max_steps = 1000000"):
        simulate(op, mu, [0.0, 1.0], options={"step": 1e-12})
    with pytest.raises(ValueError, match=r"steps: 1e\+15 steps .* exceed max_steps"):
        simulate(op, mu, [0.0, 1.0], options={"steps": 10**15})
    with pytest.raises(ValueError, match=r"the default 100 steps: 100 steps .* exceed max_steps = 50"):
        simulate(op, mu, [0.0, 1.0], options={"max_steps": 50})
    assert not taken   # refused before any step, not after
    tr = simulate(op, mu, [0.0, 1.0], options={"steps": 50, "max_steps": 50})
    assert tr.steps == 50 == len(taken) and tr.nfev == 200
    with pytest.raises(TypeError, match="step: expected a positive real number"):
        simulate(op, mu, [0.0, 1.0], options={"step": torch.tensor(0.1)})


def test_interaction_energy_in_log_form_where_it_overflows():
    """At radius 30 and beta = 1, log E = 900 - log 2 - ... is beyond float64's exp: log=True gives it (truth:
    scipy's logsumexp of the written-out sum), the plain value is an OverflowError instead of inf; weights
    that are all zero, or given for a Measure that has its own, are named errors."""
    from scipy.special import logsumexp

    g = torch.Generator().manual_seed(3)
    X = torch.randn(6, 3, generator=g, dtype=torch.float64)
    X = 30 * X / X.norm(dim=1, keepdim=True)
    G = (X @ X.T).numpy()
    truth = logsumexp(G - 2 * math.log(6)) - math.log(2.0)
    assert interaction_energy(X, 1.0, log=True) == pytest.approx(truth, rel=1e-14)
    with pytest.raises(OverflowError, match="log=True"):
        interaction_energy(X, 1.0)
    small = X / 30
    assert interaction_energy(small, 1.0) == pytest.approx(math.exp(interaction_energy(small, 1.0, log=True)))
    with pytest.raises(ValueError, match="weights: every weight is zero"):
        interaction_energy(small, 1.0, weights=torch.zeros(6, dtype=torch.float64))
    with pytest.raises(ValueError, match="weights: Measure carries its own weights"):
        interaction_energy(Measure(small), 1.0, weights=torch.ones(6, dtype=torch.float64))


def test_count_clusters_of_a_measure_counts_its_support():
    """An atom of zero mass is not in the measure: it neither makes a cluster of its own nor links two."""
    from meanfield.clustering import count_clusters

    X = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.5, 0.0]], dtype=torch.float64)
    assert count_clusters(Measure(X[:2], [0.5, 0.5]), 0.6) == 2
    assert count_clusters(Measure(X, [0.5, 0.5, 0.0]), 0.6) == 2   # the empty middle atom links nothing
    assert count_clusters(X, 0.6) == 1                               # as points, it does
    assert count_clusters(Measure(torch.tensor([[0.0, 0.0], [9.0, 9.0]], dtype=torch.float64), [1.0, 0.0])) == 1


def test_cluster_labels_at_a_tol_below_the_resolution_of_the_coordinates():
    """Above the exact limit the labels came from a grid of side about tol / 35, and a tol of 1e-17 across an extent
    of 1 overflowed its int64 cell indices (then it was refused). The exact path links only coinciding points
    there: every distinct point its own cluster, duplicates together."""
    from meanfield.clustering import cluster_labels

    X = np.random.default_rng(0).random((5000, 3))
    X[4999] = X[0]
    lab = cluster_labels(X, 1e-17)
    assert lab.max() + 1 == 4999 and lab[4999] == lab[0]


def test_count_clusters_of_a_trajectory_counts_its_support_frame_by_frame():
    """count_clusters(trajectory) agrees with count_clusters of each of its frames (Measures): the empty atom that
    a frame leaves out was counted over time."""
    from meanfield.clustering import count_clusters

    X = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.5, 0.0]], dtype=torch.float64)
    mu = Measure(X, [0.5, 0.5, 0.0])
    traj = simulate(SelfAttention(torch.zeros(2, 2, dtype=torch.float64), 0.1 * torch.eye(2, dtype=torch.float64)),
                    mu, torch.linspace(0.0, 0.1, 3, dtype=torch.float64))
    counts = count_clusters(traj, 0.6)
    assert counts.tolist() == [count_clusters(traj[k], 0.6) for k in range(len(traj))] == [2, 2, 2]


def test_interaction_energy_names_a_malformed_input():
    """A vector raised IndexError, an empty cloud a 'math domain error', and zero coordinates returned 0.5; each is
    now the ValueError of the other clustering functions."""
    from meanfield.clustering import interaction_energy

    for bad in (np.ones(3), np.zeros((0, 2)), np.zeros((3, 0))):
        with pytest.raises(ValueError, match="x: expected an \\(N, d\\) array"):
            interaction_energy(bad, 1.0)
    X = np.random.default_rng(0).standard_normal((5, 2))
    direct = sum(math.exp(X[i] @ X[j]) for i in range(5) for j in range(5)) / (2 * 25)
    assert interaction_energy(X, 1.0) == pytest.approx(direct, rel=1e-13)


@pytest.mark.parametrize("method", ["dopri5", "bosh3"])
def test_an_adaptive_solvers_max_steps_bounds_each_layer_whatever_its_output_times(method):
    """max_steps counts a layer's steps, not each output interval's (torchdiffeq's max_num_steps restarts at every
    requested time: 201 output times ran about 181 steps under max_steps = 20; found by an independent review).
    Truth: torchdiffeq's own count on the same layer with two times, where its interval is the layer: the layer
    needs K steps, so max_steps = K passes with 201 output times too and K - 1 is refused either way."""
    pytest.importorskip("torchdiffeq")
    from torchdiffeq._impl.odeint import SOLVERS

    from meanfield import SelfAttention, simulate

    def _evaluations_per_step(m):   # torchdiffeq's tableau: the stages after the first (the previous step's last)
        return len(SOLVERS[m].tableau.alpha)

    g = torch.Generator().manual_seed(0)
    X = 2 * torch.randn(8, 2, generator=g, dtype=torch.float64)
    op = SelfAttention(torch.randn(2, 2, generator=g, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    kw = dict(method=method, rtol=1e-10, atol=1e-12)
    two = simulate(op, X, [0.0, 1.0], **kw)
    steps = (two.nfev - 2) // _evaluations_per_step(method)
    assert two.nfev == 2 + steps * _evaluations_per_step(method) and steps > 5
    many = torch.linspace(0, 1, 201, dtype=torch.float64)
    full = simulate(op, X, many, **kw, options={"max_steps": steps})
    assert full.nfev == two.nfev and torch.allclose(full.final.points, two.final.points, rtol=0, atol=1e-12)
    for times in ([0.0, 1.0], many):
        with pytest.raises(RuntimeError, match=r"did not converge on \[0, 1\].*max_steps"):
            simulate(op, X, times, **kw, options={"max_steps": steps - 1})
    if method != "dopri5":
        return
    # jumps (jump_t) cost one more evaluation each, not a step: the same budget still holds (evaluations were counted,
    # which refused this run)
    jumps = torch.linspace(0.05, 0.95, 15, dtype=torch.float64)
    ref = simulate(op, X, [0.0, 1.0], **kw, options={"jump_t": jumps, "max_steps": 10**6})
    def passes(m):
        try:
            simulate(op, X, [0.0, 1.0], **kw, options={"jump_t": jumps, "max_steps": m})
            return True
        except RuntimeError:
            return False

    lo, k = 0, 2 * steps + 64   # the fewest steps torchdiffeq accepts with two times (its count is then per layer)
    assert passes(k)
    while k - lo > 1:
        mid = (lo + k) // 2
        lo, k = (lo, mid) if passes(mid) else (mid, k)
    out = simulate(op, X, many, **kw, options={"jump_t": jumps, "max_steps": k})
    assert torch.allclose(out.final.points, ref.final.points, rtol=0, atol=1e-12)


def test_times_that_float32_merges_are_named_with_the_dtype():
    """Strictly increasing times that the measure's float32 rounds to one value are named, with the dtype and what
    to do (they were cast first and reported as 'not strictly increasing'; found by an independent review); the
    same times run in float64, and decreasing times keep their message."""
    from meanfield import SelfAttention, simulate

    X = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    op = SelfAttention(torch.eye(2), torch.eye(2))
    for times in ([1000.0, 1000.00001], [0.0, 0.1, 0.10000000001, 1.0]):
        with pytest.raises(ValueError, match=r"times: .* are not distinct in torch.float32 .*simulate in float64"):
            simulate(op, X, times, method="rk4")
        op64 = SelfAttention(torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
        assert simulate(op64, X.double(), times, method="rk4").times.tolist() == times
    with pytest.raises(ValueError, match="times: must be strictly increasing"):
        simulate(op, X, [0.0, 1.0, 0.5], method="rk4")


def test_adaptive_tolerances_and_step_limits_are_checked():
    """A review: rtol = atol = 1e-16 ran to max_steps (minutes on 5 tokens), rtol = 1e-300 ended in 'the particles
    left the floating-point range at t = nan', max_step = 0 in 'did not converge', and min_step = -1 was taken
    silently. Each is now an error naming the argument; the limits that make sense still run."""
    mu = Measure(_rand(4, 2))
    op = _op()
    for rtol in (1e-16, 1e-300):
        with pytest.raises(ValueError, match="rtol: .* below float64's unit roundoff"):
            simulate(op, mu, [0.0, 1.0], method="dopri5", rtol=rtol, atol=1e-16)
    for opts, match in (({"max_step": 0.0}, "max_step = 0.0; expected a step > 0"),
                        ({"max_step": float("nan")}, "max_step = nan"),
                        ({"min_step": -1.0}, "min_step = -1.0; expected a finite step >= 0"),
                        ({"min_step": 0.5, "max_step": 0.1}, "min_step = 0.5 exceeds max_step = 0.1")):
        with pytest.raises(ValueError, match=f"options: {match}"):
            simulate(op, mu, [0.0, 1.0], method="dopri5", options=opts)
    ref = simulate(op, mu, [0.0, 1.0], method="dopri5", rtol=1e-12, atol=1e-14).points[-1]
    for opts in ({"max_step": float("inf")}, {"max_step": 0.05}, {"min_step": 0.0}):
        out = simulate(op, mu, [0.0, 1.0], method="dopri5", options=opts).points[-1]
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-8)
    # float32 tokens with an rtol their rounding cannot meet: the budget's message says so
    with pytest.raises(RuntimeError, match="below the machine epsilon of the torch.float32 tokens"):
        simulate(SelfAttention(torch.eye(2) * 0.5, torch.eye(2)), Measure(_rand(4, 2).float()), [0.0, 1.0],
                 method="dopri5", rtol=1e-13, atol=1e-15, options={"max_steps": 200})


def _sphere_reference(X0, a, beta, model, T, positions=None):
    """The sphere flow x_i' = P_{x_i} Gamma(x_i), P_x v = v - <v, x> x / |x|^2, solved by scipy's DOP853 at rtol
    1e-12 on a numpy field written here (Geshkovski et al.; docs/math.md section 6): SA's Gamma is the softmax
    average of the x_j with weights a_j e^{beta <x_i, x_j>}, USA's the unnormalized sum; with positions only the
    x_j with s_j <= s_i."""
    from scipy.integrate import solve_ivp

    n, d = X0.shape
    seen = np.ones((n, n), bool) if positions is None else positions[None, :] <= positions[:, None]

    def field(_, y):
        X = y.reshape(n, d)
        S = beta * X @ X.T
        S = np.where(seen, S, -np.inf)
        W = a[None, :] * np.exp(S - S.max(axis=1, keepdims=True))
        G = W @ X
        G = G / W.sum(axis=1, keepdims=True) if model == "SA" else G * np.exp(S.max(axis=1, keepdims=True))
        G = G - (G * X).sum(axis=1, keepdims=True) * X / (X * X).sum(axis=1, keepdims=True)
        return G.reshape(-1)

    sol = solve_ivp(field, (0.0, T), X0.reshape(-1), method="DOP853", rtol=1e-12, atol=1e-12)
    return sol.y[:, -1].reshape(n, d)


@pytest.mark.parametrize("model", ["SA", "USA"])
@pytest.mark.parametrize("masked", [False, True])
def test_sphere_flow_against_an_independent_ode_solve(model, masked):
    """simulate on the sphere (rk4 and dopri5), weighted, points on spheres of radii 0.7 to 1.6, against
    _sphere_reference. A review dropped the projection (the field left unprojected, the points renormalized
    after each step): a consistent scheme for another flow, 0.02-0.3 away here, which every test passed (they
    checked norms, energies and collapse, all kept)."""
    from meanfield.isotropic import IsotropicAttention

    g = np.random.default_rng(3 + masked)
    n, d, beta, T = 8, 3, 1.5, 2.0
    Z = g.standard_normal((n, d))
    X0 = Z / np.linalg.norm(Z, axis=1, keepdims=True) * g.uniform(0.7, 1.6, (n, 1))
    a = g.uniform(0.5, 1.5, n)
    a /= a.sum()
    pos = np.sort(g.uniform(0, 1, n)) if masked else None
    truth = _sphere_reference(X0, a, beta, model, T, pos)
    mu = Measure(torch.tensor(X0), torch.tensor(a), positions=None if pos is None else torch.tensor(pos))
    op = IsotropicAttention(beta, model, masked=masked)
    for method, kw, tol in (("rk4", {"options": {"step": 0.01}}, 1e-8),
                            ("dopri5", {"rtol": 1e-11, "atol": 1e-12}, 1e-8)):
        got = simulate(op, mu, [0.0, T], geometry="sphere", method=method, **kw).points[-1].numpy()
        assert np.abs(got - truth).max() < tol, (method, np.abs(got - truth).max())
    assert np.abs(truth - X0).max() > 0.1   # the tokens moved


def test_long_simulations_say_where_they_are(monkeypatch, caplog):
    """Progress lines at INFO (particles.progress.Heartbeat, every PROGRESS_SECONDS; 0 here): simulate printed
    nothing for 30 s at N = 2000 (400 RK4 steps) or 75 s of a stiff adaptive solve."""
    import logging

    from meanfield.isotropic import IsotropicAttention
    from particles import progress

    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)
    mu = Measure(torch.randn(20, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    with caplog.at_level(logging.INFO, logger="meanfield.dynamics"):
        simulate(IsotropicAttention(1.0, "SA"), mu, [0.0, 1.0], geometry="sphere", options={"steps": 5})
        fixed = [r.getMessage() for r in caplog.records]
        caplog.clear()
        simulate(IsotropicAttention(1.0, "SA"), mu, [0.0, 1.0], geometry="sphere", method="dopri5")
        adaptive = [r.getMessage() for r in caplog.records]
    assert "simulate (rk4): t = 0.2 of [0, 1], step 1 of 5" in fixed[0] and len(fixed) == 5
    assert adaptive and adaptive[0].startswith("simulate (dopri5): t = 0 of the layer [0, 1]")


@pytest.mark.parametrize("mask", ["none", "weighted", "causal", "positions"])
def test_the_unnormalized_field_takes_one_pass_of_the_streamed_kernel(mask):
    """USA's field sum_j a_j e^{beta <x_i, x_j>} x_j over the visible keys (a_j = 1/n without weights), where auto
    takes the fused or streamed kernel: the average and its row log-sums come from one pass of the streamed kernel
    (before: the fused pass and a second, dense one for the log-sums, about 3x SA's cost), equal to the field
    written out here in float64; its gradient equal to the written-out field's, under use("stream")."""
    from meanfield import kernels
    from meanfield.kernels import record_paths

    g = torch.Generator().manual_seed(5)
    n, beta = 300, 1.3
    X = torch.nn.functional.normalize(torch.randn(n, 3, generator=g, dtype=torch.float64), dim=1)
    lw = pos = kpos = None
    if mask == "weighted":
        w = torch.rand(n, generator=g, dtype=torch.float64)
        w[::7] = 0.0
        lw = torch.log(w / w.sum())
    if mask == "causal":
        pos = kpos = torch.arange(n, dtype=torch.float64) / n
    if mask == "positions":
        pos, kpos = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
        pos[0] = -1.0   # a query that sees no key: a zero field

    def written_out(x):
        a = torch.full((n,), 1.0 / n, dtype=torch.float64) if lw is None else torch.exp(lw)
        W = torch.exp(beta * x @ X.T) * a
        if pos is not None:
            W = W * (kpos[None, :] <= pos[:, None])
        return W @ X

    op = IsotropicAttention(beta, "USA", masked=pos is not None)
    with record_paths() as paths:
        got = op.evaluate(X, X, lw, pos, kpos)
    assert paths == ["stream"], paths
    torch.testing.assert_close(got, written_out(X), rtol=1e-12, atol=1e-13)
    if mask == "positions":
        assert torch.equal(got[0], torch.zeros(3, dtype=torch.float64))
    x = X.clone().requires_grad_(True)
    cot = torch.randn(n, 3, generator=g, dtype=torch.float64)
    with kernels.use("stream"), record_paths() as paths:
        (grad,) = torch.autograd.grad(op.evaluate(x, X, lw, pos, kpos), x, cot)
    assert paths == ["stream"]
    (ref,) = torch.autograd.grad(written_out(x), x, cot)
    torch.testing.assert_close(grad, ref, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_unnormalized_field_keeps_the_half_types(dtype):
    """The streamed kernel gives a half type's row log-sums in float32: USA's field came back in float32 and
    simulate's second stage refused the measure's half-type weights (a review of 2026-11-29). The field stays in the
    points' dtype, close to float64's (bfloat16 / float16 rounding of the field's entries), and simulate runs."""
    X = torch.nn.functional.normalize(torch.randn(1000, 3, generator=torch.Generator().manual_seed(1)), dim=1)
    op = IsotropicAttention(1.0, "USA")
    got = op.evaluate(X.to(dtype), X.to(dtype))
    assert got.dtype == dtype
    x64 = X.to(dtype).double()
    truth = (torch.exp(x64 @ x64.T) / 1000) @ x64
    assert (got.double() - truth).abs().max() <= 2e-2 * truth.abs().max()
    out = simulate(op, Measure(X.to(dtype)), [0.0, 0.1], method="euler", geometry="sphere", options={"steps": 2})
    assert out.points.dtype == dtype and bool(torch.isfinite(out.points.float()).all())
