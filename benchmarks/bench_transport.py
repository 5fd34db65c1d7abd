"""W2 solvers side by side: exact (POT emd), dense POT Sinkhorn, streaming Sinkhorn (ours), POT's
lazy Sinkhorn and GeomLoss's tensorized backend, on uniform clouds in [0, 1]^3 (d = 3).

    python benchmarks/bench_transport.py [--quick]

Each case runs in its own subprocess; peak memory is that process's ru_maxrss minus the RSS of a
process that only did the imports (so it is the solver's own footprint). Entropic cases solve the
same problem (reg = eps, squared-distance units) to the same L1 marginal error where the solver
exposes it; times are wall-clock on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

REG = 0.05  # blur ~0.22 on the unit cube
TOL = 1e-5  # L1 marginal error every entropic solver is run to


def _data(n, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, generator=g, dtype=torch.float64)


def run_case(method: str, n: int, threads: int) -> dict:
    import numpy as np
    import ot
    import torch

    from particles import Measure
    from transport import solve, w2

    torch.set_num_threads(threads)
    X, Y = _data(n, 0), _data(n, 1) + 0.1
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    info = {}
    if method == "noop":
        value = 0.0
    elif method == "exact":
        value = w2(Measure(X), Measure(Y), squared=True)
    elif method == "pot_dense":
        value = w2(Measure(X), Measure(Y), "sinkhorn", reg=REG, debias=False, squared=True, tol=TOL)
    elif method == "streaming":
        r = solve(Measure(X), Measure(Y), "streaming", reg=REG, debias=False, tol=TOL)
        value, info = r.value_squared, dict(iterations=r.iterations, error=r.error)
    elif method == "streaming_debiased":
        r = solve(Measure(X), Measure(Y), "streaming", reg=REG, debias=True, tol=TOL)
        value, info = r.value_squared, dict(iterations=r.iterations, error=r.error)
    elif method == "pot_lazy":
        a = np.full(n, 1.0 / n)
        value, log = ot.bregman.empirical_sinkhorn2(X.numpy(), Y.numpy(), REG, a=a, b=a, isLazy=True,
                                                    batchSize=1000, numIterMax=20000, stopThr=TOL / n ** 0.5,
                                                    log=True, warn=False)
        value = float(np.asarray(value).sum())
        info = dict(iterations=int(log.get("niter", -1)))
    elif method == "geomloss":
        from geomloss import SamplesLoss
        # GeomLoss's p = 2 cost is |x - y|^2 / 2 with eps = blur^2: our reg is 2 blur^2, and its value S_eps / 2
        loss = SamplesLoss("sinkhorn", p=2, blur=(REG / 2) ** 0.5, scaling=0.5, debias=True, backend="tensorized")
        value = 2.0 * float(loss(X, Y))
    else:
        raise ValueError(method)
    elapsed = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(method=method, n=n, seconds=elapsed, value=value, peak_mib=(peak - base) / 1024, **info)


def spawn(method, n, threads, timeout):
    cmd = [sys.executable, __file__, "--case", method, str(n), "--threads", str(threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return dict(method=method, n=n, seconds=float("inf"), value=float("nan"), peak_mib=float("nan"),
                    note=f"> {timeout} s")
    except subprocess.CalledProcessError as exc:
        return dict(method=method, n=n, seconds=float("nan"), value=float("nan"), peak_mib=float("nan"),
                    note=exc.stderr.strip().splitlines()[-1][:60])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--case", nargs=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=None)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.threads)))
        return
    try:
        import geomloss  # noqa: F401
        has_geomloss = True
    except ImportError:
        has_geomloss = False
    if args.quick:
        plan = {1000: ["exact", "pot_dense", "streaming", "streaming_debiased", "pot_lazy", "geomloss"],
                3000: ["streaming", "geomloss"]}
        timeout = args.timeout or 40
    else:
        plan = {1000: ["exact", "pot_dense", "streaming", "streaming_debiased", "pot_lazy", "geomloss"],
                3000: ["exact", "pot_dense", "streaming", "streaming_debiased", "pot_lazy", "geomloss"],
                10000: ["pot_dense", "streaming", "streaming_debiased", "pot_lazy", "geomloss"],
                100000: ["streaming", "pot_lazy"]}
        timeout = args.timeout or 1800
    print(f"reg = {REG}, d = 3, threads = {args.threads}, uniform clouds in [0,1]^3 (second shifted by 0.1)\n")
    print("| N | method | time (s) | peak extra memory (MiB) | value (W2^2 or S_eps) | iterations | note |")
    print("|---|---|---|---|---|---|---|")
    for n, methods in plan.items():
        for m in methods:
            if m == "geomloss" and not has_geomloss:
                continue
            r = spawn(m, n, args.threads, timeout)
            print(f"| {n} | {m} | {r['seconds']:.3g} | {r['peak_mib']:.0f} | {r['value']:.8g} | "
                  f"{r.get('iterations', '')} | {r.get('note', '')} |", flush=True)


if __name__ == "__main__":
    main()
