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

__all__ = ["linked_components", "first_occurrence", "cells_resolve", "grid_cells", "unit_scale", "edge_budget", "NORMS",
           "SAMPLE", "EDGE_BYTES", "CANDIDATE_BYTES", "FEW_EDGES", "FEW_EDGES_PER_POINT", "COLLAPSED", "CHUNK",
           "SMALL_GROUP", "CELL_MARGIN"]

#: the norms taken, Euclidean and max-norm
NORMS = (2.0, math.inf)
#: points whose neighbours estimate the number of edges before they are counted exactly
SAMPLE = 256
#: edges listed without looking at the cells (at most this many, or :data:`FEW_EDGES_PER_POINT` a point)
FEW_EDGES = 2**22
#: edges a point listed without looking at the cells (or :data:`FEW_EDGES` in all)
FEW_EDGES_PER_POINT = 16
#: a cloud with more edges than that is linked by cells where its cells hold this many points on average
#: (a few tight clusters), by its edges (while they fit the memory limit) where they hold fewer
COLLAPSED = 32
#: bytes per candidate pair of cells (the (pairs, 2) int64 array, its masks and the small pairs' indices)
CANDIDATE_BYTES = 48
#: pairs of cells whose distances are formed at once (fewer for larger groups and widths, the chunk holding
#: about CHUNK x 64 coordinates)
CHUNK = 2**16
#: groups of at most this many points are linked pair by pair at once (their points' distances), larger ones by
#: nearest-neighbour queries
SMALL_GROUP = 8
#: bytes per listed edge (the (pairs, 2) int64 array, the COO matrix's data, row and col, and
#: connected_components' symmetric CSR copy)
EDGE_BYTES = 64


#: The relative margin by which the cells' side is shrunk below r / sqrt(d) in the Euclidean norm, or r in the
#: max-norm. The rounding of r / sqrt(d) and of a point's cell index, (x - min) / side, let two points of one cell lie
#: an ulp farther apart than r (a review's cases, in 6 dimensions and on a lattice spaced r). The margin covers that
#: rounding while the coordinates' extent is below 2^30 sides; nearer their resolution (:func:`cells_resolve`, 2^52)
#: a cell may still link points a few units of the coordinates' last place beyond r
CELL_MARGIN = 2.0**-20


def _cell_side(r: float, d: int, p: float) -> float:
    """The side of cubic cells whose points are all within r of each other in the p-norm (strictly: a cell is
    half-open), shrunk by :data:`CELL_MARGIN` against rounding."""
    return (r / math.sqrt(d) if p == 2.0 else r) * (1 - CELL_MARGIN)


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

    * the list of edges where they are few (a sample of :data:`SAMPLE` points estimates them: at most
      :data:`FEW_EDGES` or :data:`FEW_EDGES_PER_POINT` a point), or where they fit the memory limit
      (:func:`edge_budget`) and the cells hold fewer than :data:`COLLAPSED` points on average (the pairs are then
      counted exactly first), and where
      ``r`` is below the resolution of the coordinates (:func:`cells_resolve`: only nearly coinciding points
      are linked), then checked against the memory limit (MemoryLimitError, naming ``what``);
    * coarse cells otherwise (a collapsed cloud: all pairs of 10^5 tokens in one cluster are 5e9 edges). Cells
      of side r / sqrt(d) (Euclidean) or r (max-norm) make groups connected inside (every two points of a cell
      are linked); two groups are joined when their closest pair is within r, asked only for groups whose means
      lie within r plus both groups' radii about their means (triangle inequality): pairs of groups of at most
      :data:`SMALL_GROUP` points from all their points' distances at once, the others first from a few points
      of each (the mean's nearest, the extremes along each axis) at once, then, where those left the two groups
      apart, by one ball query per point of the smaller group, skipped once the two are joined (union-find).
      Memory O(N) plus the candidate pairs of groups (checked against the memory limit); time grows with the
      pairs that involve a larger group where such groups are many."""
    p = float(p)
    if p not in NORMS:
        raise ValueError(f"p: expected 2 (Euclidean) or inf (max-norm), got {p}")
    r = float(r)
    if not r >= 0:
        raise ValueError(f"r: expected a non-negative distance, got {r}")
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"X: expected an (N, d) array of points, got shape {X.shape}")
    if not np.isfinite(X).all():
        raise ValueError("X: contains NaN or infinite coordinates")
    m, d = X.shape
    if m <= 1 or r == math.inf:
        return np.zeros(m, dtype=np.int64)
    # the squared distances the k-d tree compares with r^2 stay in range for clouds of size 1e-160 or 1e160 (they
    # underflowed to 0, linking every pair)
    r_given = r
    X, r = unit_scale(X, r)
    from scipy.spatial import cKDTree

    tree = cKDTree(X)
    side = _cell_side(r, d, p)
    resolved = cells_resolve(X, side)
    budget = edge_budget(m)
    group = None
    listed = True
    if resolved and m > SAMPLE:
        sample = cKDTree(X[np.random.default_rng(0).choice(m, SAMPLE, replace=False)])
        estimate = (sample.count_neighbors(tree, r, p=p) - SAMPLE) * (m / SAMPLE) / 2
        if estimate > max(FEW_EDGES, FEW_EDGES_PER_POINT * m):
            # many edges: the cells where the cloud collapses (many points a cell, few groups: a few tight
            # clusters), the edges while they fit the memory otherwise (a few points a cell: the cells' candidate
            # pairs of groups would outnumber the edges)
            group = _cells(X, side)
            listed = m < COLLAPSED * (int(group.max()) + 1) and estimate <= budget
    if listed:
        pairs = (int(tree.count_neighbors(tree, r, p=p)) - m) // 2
        if not resolved or pairs <= budget:
            return _edge_components(tree, m, r, p, pairs, what, shown=r_given)
    return _cell_components(X, r, p, side, what, group)


def unit_scale(X: np.ndarray, r: float) -> tuple[np.ndarray, float]:
    """``X`` and the distance ``r`` scaled by one power of two (exact) that brings the largest coordinate into
    [1/2, 1): squared distances of clouds of size 1e-160 or 1e160 then stay in range, and every comparison of a
    distance with ``r`` comes out as unscaled. An all-zero ``X`` is returned as it is."""
    if not np.any(X):
        return X, r
    e = math.frexp(float(np.abs(X).max()))[1]
    return np.ldexp(X, -e), math.ldexp(r, -e)


def first_occurrence(labels: np.ndarray) -> np.ndarray:
    """``labels`` (N,) renumbered 0..k-1 in the order of each label's first atom (a group's atoms keep one number)."""
    _, first, inv = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty_like(first)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inv.reshape(-1)]


def _edge_components(tree, m: int, r: float, p: float, pairs: int, what: str, shown=None) -> np.ndarray:
    """Components from the list of the ``pairs`` edges, checked against the memory limit first (``shown``: the
    distance as the caller gave it, before :func:`linked_components` scaled the points, for the message)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    from .validation import check_allocation

    shown = r if shown is None else shown
    check_allocation(EDGE_BYTES * pairs, f"{what}: {pairs} pairs of atoms within {shown:g} of {m} atoms",
                     f"use a smaller {'atol' if 'atol' in what else 'distance'} (atoms closer than it are linked)")
    edges = tree.query_pairs(r=r, p=p, output_type="ndarray")
    graph = coo_matrix((np.ones(len(edges)), (edges[:, 0], edges[:, 1])), shape=(m, m)) if len(edges) \
        else coo_matrix((m, m))
    return connected_components(graph, directed=False)[1].astype(np.int64)


def edge_budget(m: int) -> int:
    """The most edges :func:`linked_components` lists for m points: what the memory limit holds
    (:func:`particles.validation.memory_limit`, :data:`EDGE_BYTES` each). Listing is the faster way wherever it
    fits (a few points per cell in d = 3, or every point alone in its cell in d = 64, make the cells' candidate
    pairs of groups many more than the edges)."""
    from .validation import memory_limit

    return memory_limit() // EDGE_BYTES


def _small_pairs_linked(X, order, group, bounds, counts, a, b, r, p) -> np.ndarray:
    """For pairs (a_i, b_i) of groups of at most :data:`SMALL_GROUP` points: whether some point of a_i lies within
    r of some point of b_i (<= r, squared distances against r^2 in the Euclidean norm), in chunks of pairs."""
    k, S = len(counts), SMALL_GROUP
    table = np.full((k, S), -1, dtype=np.int64)   # the points of each small group, padded with -1
    g_sorted = group[order]
    rank = np.arange(len(order)) - bounds[g_sorted]
    keep = counts[g_sorted] <= S
    table[g_sorted[keep], rank[keep]] = order[keep]
    return _pairs_linked(X, table, a, b, r, p)


def _representatives(X, group, k, spread) -> np.ndarray:
    """(k, R) points of each group: the one nearest its mean (least ``spread``), then those of the smallest and the
    largest coordinate along each axis, up to R = :data:`SMALL_GROUP` (2 d + 1 in d <= 3)."""
    m, d = X.shape
    idx = np.arange(m)

    def least(values):   # per group, the first point where ``values`` is least
        best = np.full(k, np.inf)
        np.minimum.at(best, group, values)
        hit = values == best[group]
        out = np.full(k, m, dtype=np.int64)
        np.minimum.at(out, group[hit], idx[hit])
        return out

    columns = [least(spread)]
    for j in range(d):
        if len(columns) + 2 > SMALL_GROUP:
            break
        columns += [least(X[:, j]), least(-X[:, j])]
    return np.stack(columns, 1)


def _pairs_linked(X, table, a, b, r, p) -> np.ndarray:
    """Whether some point of ``table[a_i]`` lies within r of some point of ``table[b_i]`` (rows of point indices,
    -1 for none; <= r, squared distances against r^2 in the Euclidean norm), in chunks of pairs."""
    S, d = table.shape[1], X.shape[1]
    near = np.zeros(len(a), dtype=bool)
    step = max(1, CHUNK * 64 // (S * S * max(d, 1)))
    for s in range(0, len(a), step):
        ia, ib = table[a[s:s + step]], table[b[s:s + step]]
        diff = X[ia][:, :, None, :] - X[ib][:, None, :, :]
        dist = (diff * diff).sum(-1) if p == 2.0 else np.abs(diff).max(-1)
        valid = (ia[:, :, None] >= 0) & (ib[:, None, :] >= 0)
        near[s:s + step] = (valid & (dist <= (r * r if p == 2.0 else r))).any(axis=(1, 2))
    return near


def grid_cells(X: np.ndarray, side: float) -> tuple[np.ndarray, np.ndarray]:
    """(cell, first): the cell of each point (N,), numbered 0..k-1, in cubes of ``side`` from the smallest
    coordinates, and one point of each cell (k,), its first. Check :func:`cells_resolve` first: where ``side`` is
    below the coordinates' resolution, the cells are not cubes of that side."""
    if not len(X):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    keys = np.floor((X - X.min(0)) / side).astype(np.int64)
    span = keys.max(0) + 1
    if math.prod(int(s) for s in span) < 2**62:
        # one integer a cell, the first axis the most significant: the same (lexicographic) numbering as the rows'
        # unique, whose row sort took 3 s of 1e6 points in d = 3 where this takes 0.1 s
        flat = np.zeros(len(keys), dtype=np.int64)
        for j in range(X.shape[1]):
            flat = flat * span[j] + keys[:, j]
        _, first, cell = np.unique(flat, return_index=True, return_inverse=True)
    else:
        _, first, cell = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    return cell.reshape(-1), first


def _cells(X: np.ndarray, side: float) -> np.ndarray:
    """The cell of each point (N,), numbered 0..k-1 (:func:`grid_cells`)."""
    return grid_cells(X, side)[0]


def _cell_components(X: np.ndarray, r: float, p: float, side: float, what: str, group=None) -> np.ndarray:
    """:func:`linked_components` by coarse cells (``group``: the points' cells, when known). Distances are compared
    with r as the edge list compares them (scipy's cKDTree: squared distances <= r^2 in the Euclidean norm)."""
    from .validation import check_allocation

    m, d = X.shape
    group = _cells(X, side) if group is None else group
    k = int(group.max()) + 1
    if k == 1:
        return group
    from scipy.spatial import cKDTree

    order = np.argsort(group, kind="stable")
    counts = np.bincount(group, minlength=k)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    members = lambda g: order[bounds[g]:bounds[g + 1]]
    centers = np.stack([np.bincount(group, weights=X[:, j], minlength=k) for j in range(d)], 1) / counts[:, None]
    # each group's radius about its mean (below r, the cell's diameter): two groups can hold a pair within r only
    # if their means lie within r + both radii (triangle inequality)
    offset = X - centers[group]
    spread = np.sqrt((offset * offset).sum(1)) if p == 2.0 else np.abs(offset).max(1)
    rad = np.zeros(k)
    np.maximum.at(rad, group, spread)
    reach = r + 2 * float(rad.max())
    ctree = cKDTree(centers)
    count = (int(ctree.count_neighbors(ctree, reach, p=p)) - k) // 2
    check_allocation(CANDIDATE_BYTES * count, f"{what}: {count} candidate pairs of {k} cells of {m} atoms",
                     "use a smaller distance, or raise the memory limit")
    candidates = ctree.query_pairs(r=reach, p=p, output_type="ndarray").reshape(-1, 2)
    keep = np.ones(len(candidates), dtype=bool)
    for s in range(0, len(candidates), CHUNK):
        ca, cb = candidates[s:s + CHUNK, 0], candidates[s:s + CHUNK, 1]
        diff = centers[ca] - centers[cb]
        gap = np.sqrt((diff * diff).sum(1)) if p == 2.0 else np.abs(diff).max(1)
        keep[s:s + CHUNK] = gap <= (r + rad[ca] + rad[cb]) * (1 + 1e-12)   # loose by rounding: an exact test follows
    candidates = candidates[keep]
    # pairs of small groups (at most SMALL_GROUP points each: a sparse or moderately dense cloud, most groups) are
    # decided at once, from all their points' distances, and joined as components of the group graph; a pair with
    # a larger group by nearest-neighbour queries, skipped once the two are joined (union-find)
    small = (counts[candidates[:, 0]] <= SMALL_GROUP) & (counts[candidates[:, 1]] <= SMALL_GROUP)
    a, b = candidates[small, 0], candidates[small, 1]
    near = _small_pairs_linked(X, order, group, bounds, counts, a, b, r, p)
    # a pair with a larger group is first tried on a few points of each (its mean's nearest, its extremes along
    # each axis): a link found there is a link (1e6 uniform points, 64 a cell: 9 in 10 of the 1e6 such pairs); the
    # pairs whose groups that leaves apart are decided exactly below
    large = candidates[~small]
    if len(large):
        reps = _representatives(X, group, k, spread)
        linked = _pairs_linked(X, reps, large[:, 0], large[:, 1], r, p)
        a, b = np.concatenate([a[near], large[linked, 0]]), np.concatenate([b[near], large[linked, 1]])
        large = large[~linked]
    else:
        a, b = a[near], b[near]
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    comp = connected_components(coo_matrix((np.ones(len(a)), (a, b)), shape=(k, k)), directed=False)[1]
    root = np.full(int(comp.max()) + 1, k)
    np.minimum.at(root, comp, np.arange(k))
    parent = root[comp]

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    trees = {}
    for i, j in large[parent[large[:, 0]] != parent[large[:, 1]]].tolist():
        ri, rj = find(i), find(j)
        if ri == rj:
            continue
        fewer, more = (i, j) if counts[i] <= counts[j] else (j, i)
        if more not in trees:
            trees[more] = cKDTree(X[members(more)])
        # scipy's ball query compares as its edge list does (squared distances against r^2); its nearest-neighbour
        # query's bound is strict, and one step above r let a pair at r^2 plus an ulp through (a review's case)
        if trees[more].query_ball_point(X[members(fewer)], r, p=p, return_length=True).any():
            parent[ri] = rj
    while True:   # every group to its root (pointer jumping)
        up = parent[parent]
        if np.array_equal(up, parent):
            break
        parent = up
    return parent[group]
