"""meanfield.clustering.count_clusters above its scipy limit (4000 points), exact since 2026-11-29, against the grid
approximation it replaced (kept here as the baseline), in the same process.

    python benchmarks/bench_clusters.py [--repeats 2]

Clouds (float64, seed 0) on the unit sphere of R^3, tol = 1e-3 of the cloud's scale (count_clusters' default):
10^5 and 10^6 points uniform, 10^6 points in three tight clusters (radius 1e-4) and 10^6 collapsed (radius 1e-6).

Candidates, the better of ``--repeats`` calls each:

* ``exact``: :func:`meanfield.clustering.count_clusters` (:func:`particles.linkage.linked_components`);
* ``grid``: the previous path: points grouped in grid cells of diameter slack * tol / 2 (slack = 0.1), single
  linkage on one representative per cell at tol * (1 + slack) (:func:`grid_count`); its clusters lie between
  the exact ones at tol and at 1.1 tol, so it may count fewer.

Prints a markdown table: the counts, the times and their ratio.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meanfield.clustering import count_clusters  # noqa: E402
from particles.linkage import first_occurrence, grid_cells, linked_components  # noqa: E402


def grid_count(X: np.ndarray, tol: float, slack: float = 0.1) -> int:
    """The approximation count_clusters used above 4000 points until 2026-11-29 (the baseline)."""
    side = slack * tol / (2 * math.sqrt(X.shape[1]))
    cell_of, first = grid_cells(X, side)
    return int(first_occurrence(linked_components(X[first], tol * (1 + slack))[cell_of]).max()) + 1


def clouds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def sphere(n):
        x = rng.standard_normal((n, 3))
        return x / np.linalg.norm(x, axis=1, keepdims=True)
    return {"1e5 uniform": sphere(100_000), "1e6 uniform": sphere(1_000_000),
            "1e6 three clusters": np.concatenate([c + 1e-4 * sphere(333_334) for c in np.eye(3)]),
            "1e6 collapsed": np.array([[0.0, 0.0, 1.0]]) + 1e-6 * sphere(1_000_000)}


def best(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print("| cloud | exact count | grid count | exact | grid | exact / grid |")
    print("|---|---|---|---|---|---|")
    for name, X in clouds().items():
        tol = 1e-3 * max(float(np.linalg.norm(X.max(0) - X.min(0))), float(np.linalg.norm(X, axis=1).max()))
        k, t = best(lambda X=X, tol=tol: count_clusters(X, tol), args.repeats)
        g, tg = best(lambda X=X, tol=tol: grid_count(X, tol), args.repeats)
        print(f"| {name} | {k} | {g} | {t:.2f} s | {tg:.2f} s | {t / tg:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
