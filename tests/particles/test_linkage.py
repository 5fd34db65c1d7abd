"""particles.linkage: grid_cells against a grouping written out here (a dictionary of cube indices), and the
cells' components against those of the full edge list."""

from __future__ import annotations

import math

import numpy as np
import pytest

from particles import linkage
from particles.linkage import cells_resolve, grid_cells


@pytest.mark.parametrize("d", [1, 2, 3, 40])   # 40: more cells than one int64 numbers (the rows' unique)
def test_grid_cells_group_points_by_cube_and_name_each_cells_first_point(d):
    rng = np.random.default_rng(d)
    X = np.concatenate([rng.normal(size=(300, d)), rng.normal(size=(5, d)) * 1e-3 + 2.0])   # one tight clump
    side = 0.37
    assert cells_resolve(X, side)
    cell, first = grid_cells(X, side)
    lo = X.min(0)
    cubes: dict = {}
    for i, x in enumerate(X):
        cubes.setdefault(tuple(int(c) for c in np.floor((x - lo) / side)), []).append(i)
    assert cell.shape == (len(X),) and first.shape == (len(cubes),)
    assert sorted(set(cell.tolist())) == list(range(len(cubes)))
    for members in cubes.values():
        assert len(set(cell[members].tolist())) == 1            # one cube, one cell
        c = int(cell[members[0]])
        assert first[c] == members[0]                            # the first point of that cube
        assert np.all(np.linalg.norm(X[members] - X[first[c]], axis=1) <= side * math.sqrt(d) * (1 + 1e-12))


def test_a_pair_at_exactly_tol_is_linked_the_same_way_on_every_clustering_path():
    """(-0.1, 0.5) and (0.3, 0.8): the distance rounds to 0.5 and its square to 0.25 + 1 ulp. The exact path of
    cluster_labels (scipy linkage on rounded distances) linked the pair at tol 0.5 while linked_components (squared
    distances, as a k-d tree compares them) did not (found by an independent review): both now compare squares,
    at any scale (a power of two keeps the squares of 1e-160 in range)."""
    from meanfield.clustering import cluster_labels
    from particles.linkage import linked_components

    X = np.array([[-0.1, 0.5], [0.3, 0.8]])
    assert float(np.linalg.norm(X[0] - X[1])) == 0.5 and float(((X[0] - X[1]) ** 2).sum()) > 0.25
    for scale in (2.0**-530, 1.0, 2.0**530):
        exact = cluster_labels(X * scale, 0.5 * scale)
        assert exact.tolist() == [0, 1]
        assert len(set(linked_components(X * scale, 0.5 * scale).tolist())) == 2
    line = np.array([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
    for scale in (1e-160, 1.0, 1e160):
        assert cluster_labels(line * scale, 1.5 * scale).tolist() == [0, 0, 1]


def test_a_refused_edge_list_names_the_distance_as_given(monkeypatch):
    """The points are scaled by a power of two inside linked_components; the memory error still names the distance
    the caller gave (it said 6.8e-24 for 0.001; found by an independent review)."""
    from particles import validation
    from particles.linkage import linked_components

    monkeypatch.setenv(validation.MEMORY_LIMIT_ENV, "1M")
    X = np.zeros((3000, 1))
    X[0, 0] = 1e20
    with pytest.raises(validation.MemoryLimitError, match=r"pairs of atoms within 0\.001 of 3000 atoms"):
        linked_components(X, 1e-3)


@pytest.mark.parametrize("representatives", ["all", "the mean's nearest only"])
def test_cells_of_many_points_give_the_edge_lists_components(monkeypatch, representatives):
    """Pairs of cells holding more than SMALL_GROUP points are tried first on a few points of each (their means'
    nearest and their extremes along each axis), then decided exactly by nearest-neighbour queries where those
    left them apart. Against the components of the full edge list (scipy) on clouds of dense blobs, with every
    representative and with the mean's nearest alone (so the exact queries decide many more pairs)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    monkeypatch.setattr(linkage, "edge_budget", lambda m: 0)   # the cells, whatever the edges
    if representatives != "all":
        full = linkage._representatives
        monkeypatch.setattr(linkage, "_representatives", lambda *a: full(*a)[:, :1])
    rng = np.random.default_rng(7)
    for trial in range(8):
        d = (2, 3)[trial % 2]
        centres = rng.random((12, d)) * 3
        X = centres[rng.integers(0, 12, 2500)] + rng.normal(size=(2500, d)) * rng.choice([0.02, 0.05, 0.1])
        r = float(rng.uniform(0.1, 0.3))
        for p in (2.0, np.inf):
            side = linkage._cell_side(linkage.unit_scale(X, r)[1], d, p)
            cells = linkage.grid_cells(linkage.unit_scale(X, r)[0], side)[0]
            assert np.bincount(cells).max() > linkage.SMALL_GROUP   # pairs of larger groups are exercised
            pairs = cKDTree(X).query_pairs(r=r, p=p, output_type="ndarray")
            want = connected_components(coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])),
                                                   shape=(len(X), len(X))), directed=False)[1]
            got = linkage.linked_components(X, r, p=p)
            assert len(set(zip(got.tolist(), want.tolist()))) == len(set(got.tolist())) == len(set(want.tolist())), \
                (trial, p)


def test_cells_link_no_pair_beyond_r_by_rounding():
    """A review's cases, against the edge list: a cell of side r / sqrt(d) rounded up held two points r plus an ulp
    apart in d = 6; a lattice spaced r, whose cell indices (x - min) / side rounded, merged two atoms r + 2.8e-17
    apart; and the exact queries between larger cells took a squared distance one ulp above r^2 (their bound was a
    step above r, and squared). The cells now shrink by CELL_MARGIN, and the queries compare as the edge list."""
    import torch
    from scipy.spatial import cKDTree

    from particles import Measure

    d, r, x = 6, 0.8788644226541458, 0.358794898098065
    rng = np.random.default_rng(0)
    X = np.vstack([np.full((4000, d), 20.0) + 1e-3 * rng.standard_normal((4000, d)), np.zeros(d), np.full(d, x)])
    assert ((X[-1] - X[-2]) ** 2).sum() > r * r
    lab = linkage.linked_components(X, r)
    assert lab[-1] != lab[-2]
    r, off = 0.09625722686001567, 0.6678894055713512
    X = (np.arange(60.0) * r + off)[:, None]
    Y = np.vstack([X, np.full((15000, 1), X[-1, 0] + 10)])
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    pairs = cKDTree(X).query_pairs(r, p=np.inf, output_type="ndarray")   # the lattice's gaps round either side of r
    groups = connected_components(coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(60, 60)))[0]
    assert 0 < len(pairs) < 59
    assert Measure(torch.tensor(Y)).merge(atol=r).points.shape[0] == groups + 1   # and the far block of 15000 copies
    # two clusters of 16 in d = 3 bridged by one pair at squared distance nextafter(1) = r^2 plus an ulp
    rng = np.random.default_rng(0)
    while True:
        u = rng.standard_normal(3)
        u /= np.linalg.norm(u)
        a = rng.uniform(-1, 1, 3) * 0.25
        b = a + u
        if ((a - b) ** 2).sum() == np.nextafter(1.0, 2.0):
            break

    def perp(s):
        w = rng.standard_normal(3)
        w -= (w @ u) * u
        return s * w / np.linalg.norm(w)

    A = np.array([a] + [a - u * rng.uniform(0, 2e-3) + perp(0.05) for _ in range(15)])
    B = np.array([b] + [b + u * rng.uniform(0, 2e-3) + perp(0.05) for _ in range(15)])
    Y = np.vstack([A, B, np.full((4000, 3), 50.0) + 1e-4 * rng.standard_normal((4000, 3))])   # the blob: cells
    assert not any((i < 16) != (j < 16) for i, j in cKDTree(Y[:32]).query_pairs(1.0))
    lab = linkage.linked_components(Y, 1.0)
    assert lab[0] != lab[16] and len(set(lab[:16].tolist())) == 1 and len(set(lab[16:32].tolist())) == 1


def test_grid_cells_of_no_points():
    cell, first = grid_cells(np.zeros((0, 2)), 1.0)
    assert cell.shape == (0,) and first.shape == (0,) and cell.dtype == first.dtype == np.int64
