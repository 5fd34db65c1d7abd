"""Findings of a review of the standard "every call returns, says whether it converged, and names bad input"
(2026-11-29): each test fails on the code before its fix."""

import numpy as np
import pytest
import torch

from meanfield import SelfAttention, local_lipschitz
from meanfield.splitting import split_lipschitz, split_measure
from particles import Measure


def _op_and_measure(masked=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    A, V = (torch.randn(3, 3, generator=g, dtype=dtype) for _ in range(2))
    X = torch.randn(5, 3, generator=g, dtype=dtype)
    mu = Measure.sequence(X) if masked else Measure(X, torch.tensor([.1, .2, .3, .15, .25], dtype=dtype))
    return SelfAttention(A, V, masked=masked), mu, A, V


@pytest.mark.parametrize("masked", [False, True])
def test_split_lipschitz_takes_the_estimate_of_its_operator_at_mu(masked):
    op, mu, _, _ = _op_and_measure(masked)
    given = split_lipschitz(op, mu, estimate=local_lipschitz(op, mu))
    # the independent truth: the split representation's certified constant (section 4.7), its value a lower bound
    truth = local_lipschitz(op, split_measure(mu, range(mu.n))).value
    assert given.value == pytest.approx(split_lipschitz(op, mu).value, rel=1e-12)
    assert given.value <= truth * (1 + 1e-9)


def test_split_lipschitz_refuses_an_estimate_of_another_input_or_operator():
    op, mu, A, V = _op_and_measure()
    other_measure = local_lipschitz(SelfAttention(3 * np.eye(2), 40 * np.eye(2)),
                                    Measure(torch.randn(9, 2, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"estimate: its vector has shape \(9, 2\) where mu's points have \(5, 3\)"):
        split_lipschitz(op, mu, estimate=other_measure)
    # same shape, another operator: 217 was returned as the lower bound of a constant of about 5
    other_operator = local_lipschitz(SelfAttention(2 * A, V), mu)
    with pytest.raises(ValueError, match=r"estimate: its value .* is not \|J u\| = .* of f at mu"):
        split_lipschitz(op, mu, estimate=other_operator)
    with pytest.raises(TypeError, match=r"estimate: expected the LipschitzEstimate .* got float"):
        split_lipschitz(op, mu, estimate=3.0)
    batch = local_lipschitz(op, torch.stack([mu.points, mu.points + 1]))
    with pytest.raises(ValueError, match=r"estimate: holds a batch of 2 estimates"):
        split_lipschitz(op, mu, estimate=batch)


def test_split_lipschitz_accepts_a_float32_estimate_certified_in_float64():
    op, mu, _, _ = _op_and_measure(masked=True, dtype=torch.float32)
    est = local_lipschitz(op, mu)
    assert split_lipschitz(op, mu, estimate=est).value == pytest.approx(split_lipschitz(op, mu).value, rel=1e-6)


def test_lipschitz_ratio_says_when_its_displacement_is_a_few_roundings():
    from meanfield import lipschitz_ratio

    g = torch.Generator().manual_seed(0)
    att = SelfAttention(torch.randn(3, 3, generator=g, dtype=torch.float64),
                        torch.randn(3, 3, generator=g, dtype=torch.float64))
    mu = Measure.sphere(20, 3, 2.0, seed=0)
    D = torch.randn(20, 3, generator=g, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"lipschitz_ratio: W2\(mu, nu\) = .* roundings of the points' scale"):
        noisy = lipschitz_ratio(att, mu, Measure(mu.points + 1e-16 * D, mu.weights))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settled = lipschitz_ratio(att, mu, Measure(mu.points + 1e-7 * D, mu.weights))
        near = lipschitz_ratio(att, mu, Measure(mu.points + 1e-6 * D, mu.weights))
    assert settled == pytest.approx(near, rel=1e-5)   # the ratio above the threshold: settled to its limit
    assert abs(noisy - settled) > 0.1 * settled          # what the warning is about: rounding noise


@pytest.mark.parametrize("method", ["sinkhorn", "streaming"])
def test_a_tolerance_below_the_marginals_rounding_names_tol(method):
    from transport import solve
    from transport.options import TOL_FLOOR

    mu, nu = Measure.sphere(30, 3, 1, seed=0), Measure.sphere(40, 3, 1, seed=1)
    for tol in (1e-300, 1e-16):   # 1e-300 was blamed on reg; 1e-16 ran every iteration to a floor of 6e-16
        with pytest.raises(ValueError, match=r"tol: .* is below 1e-14, about 90 unit roundoffs of float64"):
            solve(mu, nu, method, reg=0.1, tol=tol)
    # the floor is reachable: both solvers certify it on these clouds
    assert solve(mu, nu, method, reg=0.1, tol=TOL_FLOOR).converged


# ---------------------------------------------------------------------- clusters (a review of clustering and linkage)
def test_cluster_counts_take_tol_zero_on_both_paths_and_check_exact_limit():
    from scipy.sparse.csgraph import connected_components

    from meanfield.clustering import cluster_labels, count_clusters
    from particles.linkage import first_occurrence

    g = np.random.default_rng(0)
    X = np.repeat(g.integers(0, 4, size=(40, 2)).astype(float), 2, axis=0)   # duplicates of 16 lattice points
    D = ((X[:, None] - X[None]) ** 2).sum(-1)
    truth = first_occurrence(connected_components(D == 0, directed=False)[1])
    # tol = 0 was refused by cluster_labels while linked_components (its large-N path) took it
    assert (cluster_labels(X, 0.0) == truth).all() and (cluster_labels(X, 0.0, exact_limit=0) == truth).all()
    for bad, error in (("x", TypeError), (None, TypeError), (2.5, TypeError), (-5, ValueError)):
        with pytest.raises(error, match="exact_limit"):   # '<=' not supported ..., or taken silently
            count_clusters(X, 0.5, exact_limit=bad)
