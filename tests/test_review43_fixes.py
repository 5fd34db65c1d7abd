"""Fixes of a new user's review (2026-11-28): the transport module's examples converge on the README's measures and
a solve that missed tol after thousands of iterations names reg first; count_clusters takes its keywords by name
(a wrong one is refused by count_clusters itself); 0-d tensors where a number is taken (R = X.norm(dim=1).max()),
refused when they require grad."""

from __future__ import annotations

import re

import pytest
import torch

import transport
from meanfield import SelfAttention, bounds, local_lipschitz, simulate
from meanfield.clustering import cluster_centers, count_clusters
from particles import Measure
from particles.validation import ConvergenceError
from transport import solve, w2

F64 = torch.float64


@pytest.mark.timeout(120)
def test_the_transport_docstrings_calls_converge_on_the_readmes_spheres():
    # transport/__init__.py's examples, on the README's measures: every call it shows runs, converged
    mu, nu = Measure.sphere(64, 3, radius=2.0, seed=0), Measure.sphere(64, 3, radius=2.0, seed=1)
    reg = float(re.search(r'w2\(mu, nu, "sinkhorn", reg=([0-9.e-]+)\)', transport.__doc__).group(1))
    assert f'w2(mu, nu, "streaming", reg={reg:g})' in transport.__doc__
    exact = w2(mu, nu)
    for method in ("sinkhorn", "streaming"):
        value = w2(mu, nu, method, reg=reg)   # raises ConvergenceError where it misses tol
        assert abs(value - exact) < 0.05 * exact   # debiased: close to W2 at this reg
    assert solve(mu, nu, "sinkhorn", reg=reg).converged


@pytest.mark.timeout(120)
def test_a_tol_missed_after_thousands_of_iterations_names_reg_first():
    mu, nu = Measure.sphere(64, 3, radius=2.0, seed=0), Measure.sphere(64, 3, radius=2.0, seed=1)
    with pytest.raises(ConvergenceError, match=r"Raise reg \(it was 0\.01; .*after 1500 iterations, more \(max_iter, "
                                               r"it was 1500\) help slowly"):
        w2(mu, nu, "sinkhorn", reg=1e-2, max_iter=1500)
    # few iterations: max_iter first, as before
    with pytest.raises(ConvergenceError, match=r"Increase max_iter \(it was 20\) or reg"):
        w2(mu, nu, "sinkhorn", reg=1e-2, max_iter=20)


def test_count_clusters_refuses_an_unknown_keyword_itself():
    X = torch.tensor([[0.0, 0.0], [0.0, 1e-4], [1.0, 0.0]], dtype=F64)
    assert count_clusters(X, 0.1) == 2 and count_clusters(X, tol=0.1, exact_limit=1) == 2
    with pytest.raises(TypeError, match=r"count_clusters\(\) got an unexpected keyword argument 'distance'"):
        count_clusters(X, distance=0.1)
    with pytest.raises(TypeError, match=r"cluster_centers\(\) got an unexpected keyword argument 'distance'"):
        cluster_centers(X, distance=0.1)
    traj = simulate(SelfAttention(torch.eye(2, dtype=F64), torch.eye(2, dtype=F64)), Measure(X), times=[0, 1])
    assert list(count_clusters(traj, tol=0.1, exact_limit=1)) == [2, 2]


def test_zero_dimensional_tensors_count_as_the_numbers_they_hold():
    g = torch.Generator().manual_seed(0)
    A, V = torch.randn(3, 3, generator=g, dtype=F64), torch.randn(3, 3, generator=g, dtype=F64)
    X = torch.randn(4, 3, generator=g, dtype=F64)
    R = X.norm(dim=1).max()
    assert bounds.sqrt_n_upper(A, V, R=R, n=torch.tensor(4)) == bounds.sqrt_n_upper(A, V, R=float(R), n=4)
    est = local_lipschitz(SelfAttention(A, V), X, tol=torch.tensor(1e-8))
    assert est.converged and est.error <= 1e-8 * est.value
    # a gradient would be lost: refused, naming the argument
    with pytest.raises(TypeError, match=r"^R: a tensor that carries a derivative \(it requires grad"):
        bounds.sqrt_n_upper(A, V, R=R.clone().requires_grad_(), n=4)
    # not a scalar: refused as before
    with pytest.raises(TypeError, match=r"^R: expected a real number, got Tensor"):
        bounds.sqrt_n_upper(A, V, R=R.reshape(1), n=4)
    with pytest.raises(TypeError, match=r"^n: expected"):
        bounds.sqrt_n_upper(A, V, R=R, n=torch.tensor(True))


# ---------------------------------------------------------------------- a second review, of the fixes above
def test_a_zero_dimensional_tensor_with_a_derivative_of_any_kind_is_refused_not_made_a_float():
    import torch.autograd.forward_ad as fwAD

    from particles import into_ball
    from particles.validation import check_positive_int, check_radius

    X = torch.tensor([[3.0, 0.0], [0.0, 1.0]], dtype=F64)
    T = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=F64)
    with fwAD.dual_level():   # a forward-mode tangent: R carries dR = 0.5, which a float would drop
        Xd = fwAD.make_dual(X, T)
        with pytest.raises(TypeError, match=r"^R: a tensor that carries a derivative"):
            into_ball(Xd, 0.5 * Xd.norm(dim=1).max())
    with pytest.raises(TypeError, match=r"^R: a tensor that carries a derivative"):   # traced by torch.func
        torch.func.vmap(lambda x: into_ball(x, x.norm()))(X)
    with pytest.raises(TypeError, match=r"^R: a tensor on the meta device"):
        check_radius(torch.tensor(2.0, device="meta"), "R")
    with pytest.raises(TypeError, match=r"^n: expected an integer, got a torch.float32 tensor 4.0"):
        check_positive_int(torch.tensor(4.0), "n")
    assert into_ball(X, X.norm(dim=1).max().detach()).shape == X.shape   # detached: the number it holds


def test_the_witness_functions_take_a_zero_dimensional_n_as_the_others_do():
    from meanfield import adversarial

    A = torch.tensor([[1.0, 0.2], [0.0, 0.5]], dtype=F64)
    for fn in (adversarial.sqrt_n_measure, adversarial.sqrt_n_witness_constant):
        a, b = fn(A, 1.0, torch.tensor(5)), fn(A, 1.0, 5)
        if isinstance(a, Measure):
            assert torch.equal(a.points, b.points) and torch.equal(a.log_weights, b.log_weights)
        else:
            assert a == b


def test_limit_set_refuses_an_unknown_keyword_itself():
    from meanfield.clustering import limit_set

    X = torch.tensor([[0.0, 0.0], [0.0, 1e-4], [1.0, 0.0]], dtype=F64)
    assert len(limit_set(X, 0.1, exact_limit=1).centers) == 2
    with pytest.raises(TypeError, match=r"limit_set\(\) got an unexpected keyword argument 'distance'"):
        limit_set(X, distance=0.1)


def test_the_streaming_self_potentials_advice_continues_its_sentence():
    from transport import symmetric_potential

    mu = Measure.sphere(64, 3, radius=2.0, seed=0)
    with pytest.raises(ConvergenceError, match=r"tol 1e-13\); increase max_iter \(it was 2\) or reg"):
        symmetric_potential(mu, 1e-3, max_iter=2, scaling=0, tol=1e-13)
