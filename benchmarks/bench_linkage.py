"""particles.linkage.linked_components (the clustering of tokens and Measure.merge) on dense clouds, against the
code before 2026-11-28's fourth session in the same process.

    python benchmarks/bench_linkage.py [--sizes 1e5 1e6] [--repeats 2]

Clouds (float64, seed 0): points uniform in the unit cube of R^3 with r such that a cell (side r / sqrt(3)) holds
64 points on average, the same in the square of R^2 with 40 points a cell, and 300 Gaussian blobs of width 0.05 in
[0, 10]^3 at r = 0.02. Each is linked by cells (a cloud with that many edges: 1e3 to 1e4 a point).

Candidates, interleaved, the better of ``--repeats`` calls each:

* ``now``: :func:`particles.linkage.linked_components`;
* ``before``: the same with the two changes undone: the pairs of cells holding more than
  :data:`~particles.linkage.SMALL_GROUP` points are decided one by one in Python (their representatives find no
  link: :func:`no_representatives`), and the cells are numbered by numpy's unique over rows
  (:func:`previous_grid_cells`, kept here as the baseline).

Both must give the same partition (an AssertionError otherwise). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from particles import linkage  # noqa: E402


def previous_grid_cells(X, side):
    """grid_cells as it was: numpy's unique over the rows of integer cube indices (a row sort)."""
    keys = np.floor((X - X.min(0)) / side).astype(np.int64)
    _, first, cell = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    return cell.reshape(-1), first


def no_representatives(X, group, k, spread):  # noqa: ARG001 - the signature of linkage._representatives
    """No point of any group (a column of -1): every pair of larger groups goes to the one-by-one queries."""
    return np.full((k, 1), -1, dtype=np.int64)


@contextlib.contextmanager
def before():
    saved = linkage.grid_cells, linkage._representatives
    linkage.grid_cells, linkage._representatives = previous_grid_cells, no_representatives
    try:
        yield
    finally:
        linkage.grid_cells, linkage._representatives = saved


def clouds(n, rng):
    yield "uniform cube, d = 3, 64 a cell", rng.random((n, 3)), (64 / n) ** (1 / 3) * math.sqrt(3)
    yield "uniform square, d = 2, 40 a cell", rng.random((n, 2)), (40 / n) ** (1 / 2) * math.sqrt(2)
    centres = rng.random((300, 3)) * 10
    yield "300 blobs, d = 3", centres[rng.integers(0, 300, n)] + 0.05 * rng.normal(size=(n, 3)), 0.02


def same_partition(a, b):
    return len(set(zip(a.tolist(), b.tolist()))) == len(set(a.tolist())) == len(set(b.tolist()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e5, 1e6])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    X = rng.random((2000, 3))
    for ctx in (before(), contextlib.nullcontext()):   # warm-up: scipy's imports
        with ctx:
            linkage.linked_components(X, 0.2)
    print("| cloud | N | components | now | before | before / now |")
    print("|---|---|---|---|---|---|")
    for n in [int(s) for s in args.sizes]:
        for name, X, r in clouds(n, rng):
            times = {"now": [], "before": []}
            labels = {}
            for _ in range(max(1, args.repeats)):
                for label in ("now", "before"):
                    with before() if label == "before" else contextlib.nullcontext():
                        t0 = time.perf_counter()
                        labels[label] = linkage.linked_components(X, r)
                        times[label].append(time.perf_counter() - t0)
            assert same_partition(labels["now"], labels["before"]), name
            t_now, t_before = min(times["now"]), min(times["before"])
            print(f"| {name} | {n:.0e} | {len(np.unique(labels['now']))} | {t_now:.3g} s | {t_before:.3g} s | "
                  f"{t_before / t_now:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
