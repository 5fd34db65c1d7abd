"""Dense computations check their allocation against the memory limit before allocating.

Each is called at the size the bad-input campaign used (far above the default 8 GiB limit, so without
the guard the call allocates tens of GiB or fails inside torch / numpy / scipy), and must refuse at once
with a MemoryLimitError that names the size (compared with the size written out here) and what to change.
Below the limit the same call returns the value an independent computation gives."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_merge_of_50000_atoms_in_two_small_boxes_lists_no_pairs(monkeypatch):
    """5e4 atoms in two 1e-3 boxes, atol = 1e-3: every pair inside a box is within atol (6.2e8 pairs, 40 GB as a
    list, which merge once refused). Under a 64 MiB limit it gives the two boxes' atoms, each of its box's mass at
    its box's weighted mean (particles.linkage: no pair is listed)."""
    rng = np.random.default_rng(0)
    X = rng.random((50_000, 2)) * 1e-3
    X[::2] += 5.0
    w = rng.random(50_000)
    w /= w.sum()
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(64 * 2**20))
    m = Measure(X, w).merge(atol=1e-3)
    assert m.n == 2
    for box, j in ((0, 0), (1, 1)):   # the first atom is in the far box: it comes first
        part = slice(0, None, 2) if box == 0 else slice(1, None, 2)
        torch.testing.assert_close(m.weights[j], torch.tensor(w[part].sum(), dtype=torch.float64), rtol=1e-12, atol=0)
        mean = (w[part, None] * X[part]).sum(0) / w[part].sum()
        torch.testing.assert_close(m.points[j], torch.as_tensor(mean), rtol=1e-12, atol=1e-15)


def test_merge_below_the_limit_groups_like_a_brute_force_union(monkeypatch):
    """Chains of atoms closer than atol merge into one (connected components), compared with a union-find
    over all pairs written here: by the list of pairs where it fits the limit (exactly, 64 bytes a pair), and by
    the coarse cells of particles.linkage where it does not."""
    import particles.linkage

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
    roots = [find(i) for i in range(200)]
    for route in ("edges", "cells"):
        if route == "edges":   # the limit holds the pairs exactly
            monkeypatch.setenv(MEMORY_LIMIT_ENV, str(64 * len(close)))
        else:
            monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
            monkeypatch.setattr(particles.linkage, "edge_budget", lambda m: 0)
        m = Measure(X).merge(atol=atol)
        assert m.n == groups
        # each merged atom is its group's mean (uniform weights), groups in order of their first atom
        firsts = sorted({r: i for i, r in reversed(list(enumerate(roots)))}.values())
        for j, i in enumerate(firsts):
            members = [t for t in range(200) if roots[t] == roots[i]]
            np.testing.assert_allclose(m.points[j].numpy(), X[members].mean(0), rtol=1e-12)


def test_merge_below_the_resolution_of_the_coordinates_lists_its_pairs_under_the_guard(monkeypatch):
    """An atol below the resolution of the coordinates (1e-17 across an extent of 1: cells cannot index it) links
    only nearly coinciding atoms, listed as pairs under the memory guard: 200 atoms 1e-20 apart near 0 (19900
    pairs) and one at 1."""
    X = np.concatenate([np.arange(200.0)[:, None] * 1e-20, [[1.0]]])
    pairs = 200 * 199 // 2
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(64 * pairs))
    m = Measure(X).merge(atol=1e-17)
    assert m.n == 2 and m.weights[0] == pytest.approx(200 / 201, rel=1e-14)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(64 * pairs - 1))
    with pytest.raises(MemoryLimitError, match=rf"Measure.merge\(atol=1e-17\): {pairs} pairs of atoms.*"
                                               r"use a smaller atol"):
        Measure(X).merge(atol=1e-17)


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


def test_cluster_labels_of_a_collapsed_cloud_list_no_pairs(monkeypatch):
    """1.2e4 tokens in three tight clusters (spread 3e-3), above the exact limit (grid representatives linked at
    tol = 1e-2): millions of pairs within tol, far above a 32 MiB limit as a list; under it the labels are the
    three clusters, in order of first occurrence."""
    from meanfield.clustering import cluster_labels

    rng = np.random.default_rng(3)
    which = rng.integers(0, 3, 12_000)
    X = np.eye(3)[which] * 5.0 + 3e-3 * rng.standard_normal((12_000, 3))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(32 * 2**20))
    labels = cluster_labels(X, tol=1e-2)
    _, first = np.unique(which, return_index=True)
    order = np.argsort(np.argsort(first))
    np.testing.assert_array_equal(labels, order[which])


def test_linked_components_refuse_the_cells_candidate_pairs_above_the_limit(monkeypatch):
    """Where neither the list of edges nor the cells' candidate pairs fit the memory limit (3000 points in d = 64,
    each alone in its cell, every pair a candidate), the cells path refuses before listing them: it once took
    13 GiB there."""
    import particles.linkage
    from particles.linkage import linked_components

    X = np.random.default_rng(5).standard_normal((3000, 64))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(32 * 2**20))
    monkeypatch.setattr(particles.linkage, "edge_budget", lambda m: 0)
    with pytest.raises(MemoryLimitError, match=r"merge-like: \d+ candidate pairs of 3000 cells of 3000 atoms"):
        linked_components(X, 20.0, what="merge-like")


def test_a_collapsed_cloud_that_would_fit_as_edges_is_still_linked_by_cells(monkeypatch):
    """16000 atoms in two clusters of spread 1e-3, atol 0.05: 6.4e7 pairs, which fit the default 8 GiB as a list
    (3.7 GB and 11 s when they were listed), where the cells take 0.3 s. The edge list is not formed (a stub that
    raises stands in for it); the two clusters merge into their weighted means."""
    import particles.linkage

    def refuse(*args, **kwargs):
        raise AssertionError("the edges of a collapsed cloud were listed")

    monkeypatch.setattr(particles.linkage, "_edge_components", refuse)
    rng = np.random.default_rng(0)
    X = 1e-3 * rng.random((16_000, 3))
    X[::2] += 1.0
    m = Measure(X).merge(atol=0.05)
    assert m.n == 2
    torch.testing.assert_close(m.points[0], torch.as_tensor(X[::2].mean(0)), rtol=1e-12, atol=1e-15)


_DENSE_PEAK = r"""
import math, resource, sys, torch
from meanfield.kernels import attend
n = 4096   # 64 MiB score matrices: mmapped and unmapped when freed, so peak RSS is the live tensors' peak
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(n, 3, generator=g, requires_grad=True) for _ in range(3))
lw = torch.log_softmax(torch.randn(n, generator=g), 0)
qp, kp = torch.rand(n, generator=g), torch.rand(n, generator=g)
qp[:10] = -1.0   # queries that see no key: the plain pass, then the guarded one
small = [t[:8].detach().requires_grad_(True) for t in (q, k, v)]
attend(*small, lw[:8], qp[:8], kp[:8], method="dense").sum().backward()   # warm-up
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = attend(q, k, v, lw, qp, kp, method="dense")
out.backward(torch.ones_like(out))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / (n * n * 4))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB (Linux)")
def test_dense_path_peak_within_what_its_guard_and_the_path_choice_count():
    """Review 46 F2: forward and backward of the dense path with weights, positions and queries that see no key
    peaked at 5.0 float32 score matrices (the plain pass's graph kept alive during the guarded one) where the
    path choice counted 4 and the memory guard 3. Measured in a fresh process (peak resident memory)."""
    from meanfield import accelerator_paths as ap

    run = subprocess.run([sys.executable, "-c", _DENSE_PEAK], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    peak = float(run.stdout.split()[-1])   # in float32 score matrices
    assert peak <= 4.5   # 5.0 with the plain pass alive
    assert peak * 4 <= ap.dense_bytes(1, 4)
