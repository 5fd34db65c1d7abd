"""One debiased streaming Sinkhorn solve on CUDA, timed once: goal 5 of the GPU work at N = 1e6.

    python benchmarks/bench_sinkhorn_once.py            # N = 1e6 (about a minute on an H200)
    python benchmarks/bench_sinkhorn_once.py 100000 1000000

The problem of ``bench_gpu.py --sections sinkhorn`` (``bench_gpu.sinkhorn_problem``: uniform clouds in the
unit cube and shifted by 0.1, d = 3, float32, blur 0.05, i.e. reg = 2 blur^2 in squared-distance units, tol
1e-3, debiased), where timing every
candidate three times at 1e6 would take a lent GPU's whole quarter hour: one synchronized call of the default
solver, with what it reports (converged, the marginal error measured in float64, iterations) and torch's
peak allocation (O(N)). The figures go to benchmarks/gpu.md's Sinkhorn section by hand, said so there.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu import SINKHORN_TOL, sinkhorn_problem  # noqa: E402

from particles import Measure  # noqa: E402
from transport import multiscale, solve, truncation  # noqa: E402


def main(argv=None):
    sizes = [int(float(a)) for a in (sys.argv[1:] if argv is None else argv)] or [10**6]
    if not torch.cuda.is_available():
        print("bench_sinkhorn_once: no CUDA device here: nothing measured")
        return 0
    for n in sizes:
        X, Y, reg = sinkhorn_problem(n, "cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        r = solve(Measure(X), Measure(Y), "streaming", reg=reg, debias=True, tol=SINKHORN_TOL, on_failure="warn")
        value = float(r.value_squared)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(f"N = {n}: {dt:.2f} s, S_eps = {value:.6g}, converged = {r.converged}, marginal error {r.error:.3g}, "
              f"iterations {r.iterations}, peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB "
              f"(truncation {truncation.ENABLED}, coarse annealing {multiscale.ENABLED})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
