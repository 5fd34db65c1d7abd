"""Connected components of the "within r" graph of a point cloud, in O(N) memory.

Two atoms are linked when ``|x_i - x_j|_p <= r``; the components of that graph are what
:meth:`particles.Measure.merge` merges (max-norm, ``r = atol``) and what
:func:`meanfield.clustering.cluster_labels` calls single-linkage clusters (Euclidean, ``r = tol``). Listing
the graph's edges costs memory quadratic in a collapsed cloud (every pair of 10^5 tokens in one cluster:
5e9 pairs); :func:`linked_components` finds the same components without listing them.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["linked_components", "cells_resolve", "edge_budget", "NORMS", "SAMPLE", "EDGE_BYTES"]

#: the norms taken, Euclidean and max-norm
NORMS = (2.0, math.inf)
#: points whose neighbours estimate the number of edges before they are counted exactly
SAMPLE = 256
#: bytes per listed edge (the (pairs, 2) int64 array, the COO matrix's data, row and col, and
#: connected_components' symmetric CSR copy)
EDGE_BYTES = 64


def _cell_side(r: float, d: int, p: float) -> float:
    """The side of cubic cells whose points are all within r of each other in the p-norm (strictly: a cell is
    half-open)."""
    return r / math.sqrt(d) if p == 2.0 else r


def cells_resolve(X: np.ndarray, side: float) -> bool:
    """Whether cells of ``side`` index the points of X exactly in int64 and in float64 arithmetic: the extent of X
    is below 2^52 cells (a smaller ``side`` is below the resolution of the coordinates, and the cell of a point
    would be decided by rounding)."""
    if not len(X):
        return True
    extent = float((X.max(0) - X.min(0)).max())
    return side > 0 and math.isfinite(extent / side) and extent / side < 2.0**52


def linked_components(X: np.ndarray, r: float, *, p: float = 2.0, what: str = "linked_components") -> np.ndarray:
    """Component labels (N,) (integers, not ordered) of the graph linking points of X (N, d) at p-norm distance
    <= r, in one of two ways that give the same components:

    * the list of edges, where it is short: at most :func:`edge_budget` pairs and within the memory limit
      (:func:`particles.validation.memory_limit`; a sparse cloud: the pairs are
      counted first, exactly, once a sample of :data:`SAMPLE` points says their number is small), and where
      ``r`` is below the resolution of the coordinates (:func:`cells_resolve`: only nearly coinciding points
      are linked), then checked against the memory limit (MemoryLimitError, naming ``what``);
    * coarse cells otherwise (a collapsed cloud: all pairs of 10^5 tokens in one cluster are 5e9 edges). Cells
      of side r / sqrt(d) (Euclidean) or r (max-norm) make groups connected inside (every two points of a cell
      are linked); two groups are joined when their closest pair is within r, asked only for groups whose means
      lie within 3 r (each point of a group is within r of its mean) and that are not already joined
      (union-find), by one nearest-neighbour query per point of the smaller group. Memory O(N) plus the
      candidate pairs of groups; time grows with those pairs where the groups are small and many (a cloud of a
      few points per cell and more than :func:`edge_budget` edges)."""
    p = float(p)
    if p not in NORMS:
        raise ValueError(f"p: expected 2 (Euclidean) or inf (max-norm), got {p}")
    X = np.asarray(X, dtype=np.float64)
    m, d = X.shape
    if m <= 1 or r == math.inf:
        return np.zeros(m, dtype=np.int64)
    from scipy.spatial import cKDTree

    from .validation import memory_limit

    tree = cKDTree(X)
    side = _cell_side(r, d, p)
    resolved = cells_resolve(X, side)
    budget = min(edge_budget(m), memory_limit() // EDGE_BYTES)
    if resolved and m > SAMPLE:
        sample = cKDTree(X[np.random.default_rng(0).choice(m, SAMPLE, replace=False)])
        estimate = (sample.count_neighbors(tree, r, p=p) - SAMPLE) * (m / SAMPLE) / 2
        listed = estimate <= budget
    else:
        listed = True
    if listed:
        pairs = (int(tree.count_neighbors(tree, r, p=p)) - m) // 2
        if not resolved or pairs <= budget:
            return _edge_components(tree, m, r, p, pairs, what)
    return _cell_components(X, r, p, side)


def _edge_components(tree, m: int, r: float, p: float, pairs: int, what: str) -> np.ndarray:
    """Components from the list of the ``pairs`` edges, checked against the memory limit first."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    from .validation import check_allocation

    check_allocation(EDGE_BYTES * pairs, f"{what}: {pairs} pairs of atoms within {r:g} of {m} atoms",
                     f"use a smaller {'atol' if 'atol' in what else 'distance'} (atoms closer than it are linked)")
    edges = tree.query_pairs(r=r, p=p, output_type="ndarray")
    graph = coo_matrix((np.ones(len(edges)), (edges[:, 0], edges[:, 1])), shape=(m, m)) if len(edges) \
        else coo_matrix((m, m))
    return connected_components(graph, directed=False)[1].astype(np.int64)


def edge_budget(m: int) -> int:
    """The most edges :func:`linked_components` lists for m points: 16 per point, at least 2^22 (256 MiB of
    :data:`EDGE_BYTES`)."""
    return max(2**22, 16 * m)


def _cell_components(X: np.ndarray, r: float, p: float, side: float) -> np.ndarray:
    """:func:`linked_components` by coarse cells."""
    m, d = X.shape
    keys = np.floor((X - X.min(0)) / side).astype(np.int64)
    _, group = np.unique(keys, axis=0, return_inverse=True)
    group = group.reshape(-1)
    k = int(group.max()) + 1
    if k == 1:
        return group
    from scipy.spatial import cKDTree

    order = np.argsort(group, kind="stable")
    counts = np.bincount(group, minlength=k)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    members = lambda g: order[bounds[g]:bounds[g + 1]]
    centers = np.stack([np.bincount(group, weights=X[:, j], minlength=k) for j in range(d)], 1) / counts[:, None]
    candidates = cKDTree(centers).query_pairs(r=3 * r, p=p, output_type="ndarray")
    parent = np.arange(k)

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # pairs of single points are decided at once (a sparse cloud: most groups); a group pair with a larger group
    # by nearest-neighbour queries, skipped once the two are joined
    single = (counts[candidates[:, 0]] == 1) & (counts[candidates[:, 1]] == 1) if len(candidates) else \
        np.zeros(0, dtype=bool)
    a, b = candidates[single, 0], candidates[single, 1]
    gap = np.linalg.norm(centers[a] - centers[b], ord=p, axis=1) if len(a) else np.zeros(0)
    near = gap <= r * (1 + 1e-12)
    for i, j in zip(a[near].tolist(), b[near].tolist()):
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[ri] = rj
    trees = {}
    for i, j in candidates[~single].tolist():
        ri, rj = find(i), find(j)
        if ri == rj:
            continue
        small, large = (i, j) if counts[i] <= counts[j] else (j, i)
        if large not in trees:
            trees[large] = cKDTree(X[members(large)])
        dist, _ = trees[large].query(X[members(small)], k=1, p=p, distance_upper_bound=r * (1 + 1e-12))
        if np.isfinite(dist).any():
            parent[ri] = rj
    while True:   # every group to its root (pointer jumping)
        up = parent[parent]
        if np.array_equal(up, parent):
            break
        parent = up
    return parent[group]
