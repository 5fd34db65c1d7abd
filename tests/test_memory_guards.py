"""Dense computations check their allocation against the memory limit before allocating.

Each is called at the size the bad-input campaign used (far above the default 8 GiB limit, so without
the guard the call allocates tens of GiB or fails inside torch / numpy / scipy), and must refuse at once
with a MemoryLimitError that names the size (compared with the size written out here) and what to change.
Below the limit the same call returns the value an independent computation gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from particles import Measure
from particles.validation import MEMORY_LIMIT_ENV, MemoryLimitError


def _gib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB"


def test_measure_sphere_of_10_to_the_10_atoms():
    with pytest.raises(MemoryLimitError, match=rf"10000000000 atoms in dimension 3: needs about "
                                               rf"{_gib(2 * 10**10 * 3 * 8)}.*lower n"):
        Measure.sphere(10**10, 3)
    with pytest.raises(MemoryLimitError, match="lower n"):
        Measure.ball(10**10, 3)
    with pytest.raises(MemoryLimitError, match="Measure.gaussian: 10000000000 atoms"):
        Measure.gaussian(10**10, np.zeros(3))
    mu = Measure.sphere(100, 3, radius=2.0, seed=0)
    assert torch.allclose(mu.points.norm(dim=1), torch.full((100,), 2.0, dtype=torch.float64))


def test_merge_of_50000_atoms_in_a_small_box():
    """5e4 atoms in a 1e-3 box, atol = 1e-3: every pair is within atol (1.25e9 pairs)."""
    X = np.random.default_rng(0).random((50_000, 2)) * 1e-3
    pairs = 50_000 * 49_999 // 2
    with pytest.raises(MemoryLimitError, match=rf"Measure.merge\(atol=0.001\): {pairs} pairs of atoms.*"
                                               r"use a smaller atol"):
        Measure(X).merge(atol=1e-3)


def test_merge_below_the_limit_groups_like_a_brute_force_union(monkeypatch):
    """Chains of atoms closer than atol merge into one (connected components), compared with a union-find
    over all pairs written here; the guard's pair count is exact (a limit of 64 bytes per pair passes)."""
    rng = np.random.default_rng(1)
    X = rng.random((200, 2))
    atol = 0.04
    parent = list(range(200))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i
    close = [(i, j) for i in range(200) for j in range(i + 1, 200) if np.abs(X[i] - X[j]).max() <= atol]
    for i, j in close:
        parent[find(i)] = find(j)
    groups = len({find(i) for i in range(200)})
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(64 * len(close)))
    assert Measure(X).merge(atol=atol).n == groups
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(64 * len(close) - 1))
    with pytest.raises(MemoryLimitError, match=f"{len(close)} pairs"):
        Measure(X).merge(atol=atol)


def test_argmax_indices_and_score_gap_at_100000_tokens(monkeypatch):
    from meanfield import bounds

    A = np.diag([1.0, 0.5, 0.25])
    X = np.random.default_rng(0).standard_normal((10**5, 3))
    for f in (bounds.argmax_indices, bounds.score_gap, lambda a, x: bounds.large_radius_limit(a, np.eye(3), x)):
        with pytest.raises(MemoryLimitError, match=rf"the \(100000, 100000\) score matrix of X: needs about "
                                                   rf"{_gib(3 * 8 * 10**10)}.*fewer tokens"):
            f(A, X)
    x = X[:50]
    scores = x @ A.T @ x.T
    assert (bounds.argmax_indices(A, x) == scores.argmax(axis=1)).all()


def test_simulate_with_10_to_the_7_output_times():
    from meanfield import SelfAttention, simulate

    att = SelfAttention(0.5 * np.eye(2), np.eye(2))
    times = np.linspace(0.0, 1.0, 10**7)
    with pytest.raises(MemoryLimitError, match=r"simulate: the particles \(8 x 2\) at 10000000 requested times.*"
                                               "fewer output times"):
        simulate(att, Measure.sphere(8, 2, seed=0), times, method="euler", options={"steps": 1})
    # a few output times: the trajectory at t = 1 is the same as when asked for alone
    mu = Measure.sphere(8, 2, seed=0)
    many = simulate(att, mu, np.linspace(0.0, 1.0, 11), method="rk4", options={"steps": 10})
    one = simulate(att, mu, [0.0, 1.0], method="rk4", options={"steps": 100})
    assert torch.allclose(many.final.points, one.final.points, rtol=1e-12, atol=1e-12)


def test_the_worst_case_search_names_its_own_options_when_memory_runs_short(monkeypatch):
    """Its MemoryLimitError used to suggest max_iter, which the search does not take: now it names batch_size,
    and with batch_size=1 the same search fits and brackets (lower <= upper, a theorem)."""
    import inspect

    from meanfield import SearchOptions, SelfAttention, worst_case_sequence

    att = SelfAttention(0.5 * np.eye(3), np.eye(3))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1M")
    with pytest.raises(MemoryLimitError, match="worst-case search certifying .* lower batch_size") as exc:
        worst_case_sequence(att, 1.0, 40, budget=200)
    assert "max_iter" not in str(exc.value) and "max_iter" not in inspect.signature(worst_case_sequence).parameters
    res = worst_case_sequence(att, 1.0, 40, budget=200, options=SearchOptions(batch_size=1))
    assert 0 < res.lower <= res.upper.value
