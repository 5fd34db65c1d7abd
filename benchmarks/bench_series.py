"""The series engine (meanfield.series_attention) against the path auto took before it, on the sphere models' tokens.

    python benchmarks/bench_series.py [--sizes 1e3 1e4 1e5] [--dtypes float32 float64] [--betas 1]
                                      [--device cpu|cuda] [--repeats 3] [--cap 60] [--threads T]
    python benchmarks/bench_series.py --clusters 1e5 1e6 [--device cuda] [--T 30]
    python benchmarks/bench_series.py --lipschitz 1e4 1e5 [--device cuda] [--cap 600]

Inputs: N tokens uniform on the unit sphere of R^3, q = beta x, k = v = x (isotropic attention, the SA model of
Geshkovski et al.), uniform weights. Candidates, each timed in the same process (median of ``--repeats`` calls after
a warm-up, wall time, synchronized on CUDA): ``attend(method="series")`` and ``auto`` with the series set aside (the
path auto took before the series: fused, streamed or dense). A baseline predicted (N^2 from the previous size) to
take more than ``--cap`` seconds is not run. Errors: the largest ||out_i - exact_i|| over 256 random queries,
against float64 dense attention of those queries on every key (computed here, independently of both paths).
Prints a markdown table.

``--clusters N ...``: instead, the dynamics study's at-scale run (studies.experiments.at_scale.cluster_task: N tokens
uniform on the sphere under the SA flow, beta = 1, RK4 steps of 0.25 with retraction to time T, float64), one per N,
each with its wall time, escape time, clusters at T and drift off the sphere; ``simulate``'s ``auto`` takes the
series there.

``--lipschitz N ...``: the discrete-versus-mean-field study's at-scale local constants
(studies.experiments.at_scale.lipschitz_task: the certified W2 constant of SelfAttention at the empirical measure
of N points uniform on the disc of radius 1.5, d = 2, float64, Lanczos at tol 1e-6), through the series
(``local_lipschitz(attention="series")``) and through the exact path in the same process, the exact one only where
its time predicted (N^2 from the previous size) stays within ``--cap``; each with its value, certified error,
products and wall time, and the distance of the two values against the sum of their errors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meanfield import kernels  # noqa: E402
from meanfield import series_attention as series  # noqa: E402


def tokens(n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return (x / x.norm(dim=1, keepdim=True)).to(device=device, dtype=dtype)


def exact_rows(q, k, v, rows):
    """float64 dense attention of the queries ``rows`` on every key (blocks of keys: O(N) memory)."""
    q, k, v = q[rows].double(), k.double(), v.double()
    s = q @ k.T
    p = torch.softmax(s, dim=-1)
    return p @ v


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats):
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def without_series():
    """auto as it was before the series (its thresholds set out of reach)."""
    class Ctx:
        def __enter__(self):
            self.saved = kernels.SERIES_THRESHOLD, kernels.SERIES_THRESHOLD_ACCELERATOR
            kernels.SERIES_THRESHOLD = kernels.SERIES_THRESHOLD_ACCELERATOR = 2**62

        def __exit__(self, *exc):
            kernels.SERIES_THRESHOLD, kernels.SERIES_THRESHOLD_ACCELERATOR = self.saved
    return Ctx()


def fmt(t):
    return "n/a" if t is None else f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def row(n, dtype, beta, device, args, g, previous):
    """One table row, and (n, baseline seconds) for the next size's prediction."""
    x = tokens(n, dtype, device)
    q = beta * x
    rows = torch.randperm(n, generator=g)[:256].to(device)
    truth = exact_rows(q, x, x, rows)
    plan = series.plan(q, x)
    desc = "none" if plan is None else f"{plan.degree}, {plan.features}, {plan.radius:.3g}, {plan.bound:.2g}"
    t_s = err_s = None
    if plan is not None:
        t_s, out = timed(lambda: kernels.attend(q, x, x, method="series"), device, args.repeats)
        err_s = float((out[rows].double() - truth).norm(dim=-1).max())
    predicted = None if previous is None else previous[1] * (n / previous[0]) ** 2
    t_b = err_b = path = None
    if predicted is None or predicted <= args.cap:
        with without_series(), kernels.record_paths() as paths:
            t_b, out = timed(lambda: kernels.attend(q, x, x), device, 1 if n >= 10**6 else args.repeats)
        path = paths[-1]
        err_b = float((out[rows].double() - truth).norm(dim=-1).max())
        previous = (n, t_b)
    ratio = "n/a" if t_s is None or t_b is None else f"{t_b / t_s:.3g}x"
    before = fmt(t_b) + (f" ({path})" if path else f" (predicted {predicted:.3g} s)")
    es = "n/a" if err_s is None else f"{err_s:.2g}"
    eb = "n/a" if err_b is None else f"{err_b:.2g}"
    return (f"| {str(dtype).replace('torch.', '')} | {beta:g} | {n:.0e} | {desc} | {fmt(t_s)} | {before} | {ratio} | "
            f"{es} | {eb} |"), previous


def clusters(args, device):
    from studies.experiments import at_scale

    print("| N | T | wall time | paths | t_escape | clusters at T | drift off the sphere |")
    print("|---|---|---|---|---|---|---|")
    for n in [int(s) for s in args.clusters]:
        t = time.perf_counter()
        with kernels.record_paths() as paths:
            r = at_scale.cluster_task(n, args.T, 0.25, 0.5, 0, device=str(device))
        sync(device)
        seconds = time.perf_counter() - t
        used = ", ".join(f"{p} x{paths.count(p)}" for p in sorted(set(paths)))
        print(f"| {n:.0e} | {args.T:g} | {fmt(seconds)} | {used} | {r['t_escape']:.3g} | {r['clusters_T']} | "
              f"{r['drift']:.2g} |", flush=True)
    return 0


def lipschitz(args, device):
    from studies.experiments import at_scale

    print("| N | series: value, error | products | wall time | exact path: value, error | products | wall time | "
          "exact / series | distance / (sum of errors) |")
    print("|---|---|---|---|---|---|---|---|---|")
    previous = None
    for n in [int(s) for s in args.lipschitz]:
        rs = at_scale.lipschitz_task(n, 1.5, 0, 0, device=str(device), attention="series")
        sync(device)
        predicted = None if previous is None else previous[1] * (n / previous[0]) ** 2
        re = None
        if predicted is None or predicted <= args.cap:
            re = at_scale.lipschitz_task(n, 1.5, 0, 0, device=str(device), attention="exact")
            sync(device)
            previous = (n, re["seconds"])
        mark = "" if rs["converged"] else " (not converged)"
        cells = [f"{n:.0e}", f"{rs['lip']:.12g} ± {rs['lip_error']:.2g}{mark}", str(rs["products"]), fmt(rs["seconds"])]
        if re is None:
            cells += [f"not run (predicted {fmt(predicted)})", "", "", "", ""]
        else:
            cells += [f"{re['lip']:.12g} ± {re['lip_error']:.2g}", str(re["products"]), fmt(re["seconds"]),
                      f"{re['seconds'] / rs['seconds']:.2f}x",
                      f"{abs(rs['lip'] - re['lip']) / (rs['lip_error'] + re['lip_error']):.2g}"]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e3, 1e4, 1e5])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument("--betas", nargs="+", type=float, default=[1.0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap", type=float, default=60.0, help="skip a baseline predicted to take longer (seconds)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clusters", nargs="+", type=float, default=None, help="run the at-scale clustering instead")
    ap.add_argument("--T", type=float, default=30.0, help="final time of --clusters")
    ap.add_argument("--lipschitz", nargs="+", type=float, default=None,
                    help="time the at-scale local constants through the series and the exact path instead")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    what = ("the disc of radius 1.5 in d = 2, the discrete-versus-mean-field operator (seed 0)" if args.lipschitz else
            "sphere tokens in d = 3, q = beta x, k = v = x")
    print(f"{name}; torch {torch.__version__}; {what}\n")
    if args.clusters:
        return clusters(args, device)
    if args.lipschitz:
        return lipschitz(args, device)
    print("| dtype | beta | N | plan (K, M, r, bound) | series | auto before (its path) | before / series | "
          "error, series | error, before |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    for dtype in [getattr(torch, d) for d in args.dtypes]:
        for beta in args.betas:
            previous = None
            for n in [int(s) for s in args.sizes]:
                line, previous = row(n, dtype, beta, device, args, g, previous)
                print(line, flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
