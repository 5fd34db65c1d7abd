"""particles.linkage.grid_cells against a grouping written out here (a dictionary of cube indices)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from particles.linkage import cells_resolve, grid_cells


@pytest.mark.parametrize("d", [1, 2, 3])
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
