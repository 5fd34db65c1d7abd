"""The series engine (meanfield.series_attention) against the path auto took before it, on the sphere models' tokens.

    python benchmarks/bench_series.py [--sizes 1e3 1e4 1e5] [--dtypes float32 float64] [--betas 1]
                                      [--device cpu|cuda] [--repeats 3] [--cap 60] [--threads T]
    python benchmarks/bench_series.py --clusters 1e5 1e6 [--device cuda] [--T 30]
    python benchmarks/bench_series.py --lipschitz 1e4 1e5 [--device cuda] [--cap 600]
    python benchmarks/bench_series.py --layouts 1e4 1e5 [--device cuda] [--repeats 5]
    python benchmarks/bench_series.py --crossover 1e3 2e3 3e3 4e3 6e3 [--repeats 2]

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

``--layouts N ...``: one kernel sum (``series_attention.kernel_sum``, the core of every series call and of each of
its derivatives) in the two at-scale shapes (the disc: d = 2, degree 36, 3 value columns; sphere tokens: d = 3,
degree 18, 4 columns), float64, against the products as written before 2026-11-28's third session (P w on the keys'
side, P^T S on the queries', reading the (M, rows) features across their rows; :func:`previous_kernel_sums`, kept
here as the baseline), interleaved in one process; then one at-scale local constant
(``lipschitz_task(attention="series")``) at the smallest N with each.

``--crossover N ...``: where ``local_lipschitz``'s auto should start taking the series
(:data:`meanfield.series_jacobian.SERIES_THRESHOLD` and its cost model): the certified W2 constant (Lanczos, tol 1e-6,
float64) through the series and the exact path, alternating, the better of ``--repeats`` calls each after one warm-up
call, on the study's disc (d = 2) and on sphere tokens in d = 3 with ``||A|| = 0.9, 1.3, 2`` (r = ||A||), each row with
the cost model's ratio (``series_jacobian.product_cost`` over the exact path's) and what auto takes. The two values
must agree within their certified errors (an AssertionError otherwise).
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


def previous_powers(y, K, out):
    """series_attention._powers' in-place branch as it was before 2026-11-28's third session: each product's
    multiplier read from y with its stride of e."""
    e, rows = y.shape[-1], y.shape[-2]
    yt = y.transpose(-1, -2).unsqueeze(-2)
    out = out[..., :series.feature_count(e, K), :rows]
    counts = [1] * e
    out[..., 0, :] = 1
    start, end = 0, 1
    for _ in range(K):
        at = end
        for j in range(e):
            torch.mul(out[..., start:start + counts[j], :], yt[..., j, :, :], out=out[..., at:at + counts[j], :])
            at += counts[j]
        start, end = end, at
        counts = [sum(counts[:j + 1]) for j in range(e)]
    return out


def previous_kernel_sums(x, y, sums):
    """series_attention._kernel_sums as it was before 2026-11-28's third session (the baseline of ``--layouts``):
    the same features and blocks, the products read the (M, rows) features across their rows (P w, P^T S), the
    features built by :func:`previous_powers`."""
    import math

    lead, (m, e), n = x.shape[:-2], x.shape[-2:], y.shape[-2]
    outs = [x.new_zeros(*lead, m, w.shape[-1]) for w, _ in sums]
    live = [i for i, (w, K) in enumerate(sums) if K >= 0 and w.shape[-1] > 0]
    if not live or m == 0 or n == 0:
        return outs
    with torch.no_grad():
        top = max(sums[i][1] for i in live)
        M, batch = series.feature_count(e, top), math.prod(lead)
        sizes = {i: series.feature_count(e, sums[i][1]) for i in live}
        S = {}
        step_y, step_x = series._block_rows(n, batch, M, y), series._block_rows(m, batch, M, x)
        buffer = torch.empty(*lead, M, max(step_y, step_x), dtype=x.dtype, device=x.device)
        for j in range(0, n, step_y):
            P = previous_powers(y[..., j:j + step_y, :], top, buffer)
            for i in live:
                part = P[..., :sizes[i], :] @ sums[i][0][..., j:j + step_y, :]
                S[i] = part if i not in S else S[i] + part
        scale = series._inverse_factorials(e, top, x.device, x.dtype).unsqueeze(-1)
        blocks = []
        for i in live:
            Si = S[i] * scale[:sizes[i]]
            if sizes[i] < M:
                Si = torch.cat([Si, Si.new_zeros(*Si.shape[:-2], M - sizes[i], Si.shape[-1])], dim=-2)
            blocks.append(Si)
        S_all = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)
        parts = [previous_powers(x[..., i:i + step_x, :], top, buffer).transpose(-1, -2) @ S_all
                 for i in range(0, m, step_x)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
        at = 0
        for i in live:
            c = sums[i][0].shape[-1]
            outs[i] = out[..., at:at + c]
            at += c
        return outs


def layouts(args, device):
    """--layouts: the kernel sum's products as written now against :func:`previous_kernel_sums`, interleaved."""
    from studies.experiments import at_scale

    current = series._kernel_sums
    print("| shape | N | now | before | before / now | max relative difference |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, e, K, c in (("disc: d = 2, degree 36, 3 columns", 2, 36, 3),
                          ("sphere: d = 3, degree 18, 4 columns", 3, 18, 4)):
        for n in [int(s) for s in args.layouts]:
            x = (torch.rand(n, e, generator=g, dtype=torch.float64) - 0.5).to(device)
            y = (torch.rand(n, e, generator=g, dtype=torch.float64) - 0.5).to(device)
            w = torch.rand(n, c, generator=g, dtype=torch.float64).to(device)
            times = {"now": [], "before": []}
            outs = {}
            for _ in range(args.repeats + 1):   # the first round a warm-up, not kept
                for label, fn in (("now", current), ("before", previous_kernel_sums)):
                    sync(device)
                    t = time.perf_counter()
                    outs[label] = fn(x, y, [(w, K)])[0]
                    sync(device)
                    times[label].append(time.perf_counter() - t)
            now, before = (statistics.median(times[k][1:]) for k in ("now", "before"))
            diff = float(((outs["now"] - outs["before"]).norm(dim=-1) / outs["before"].norm(dim=-1)).max())
            print(f"| {name} | {n:.0e} | {fmt(now)} | {fmt(before)} | {before / now:.2f}x | {diff:.1g} |", flush=True)
    n = int(args.layouts[0])
    warm = min(2000, n)
    print(f"\nlipschitz_task(attention='series') at N = {n:.0e} (the disc), after one untimed call at N = {warm}; "
          f"the two layouts alternated, each {args.repeats} times (median):\n")
    print("| layout | value, error | products | wall time |")
    print("|---|---|---|---|")
    at_scale.lipschitz_task(warm, 1.5, 0, 0, device=str(device), attention="series")
    runs = {"now": [], "before": []}
    for _ in range(args.repeats):
        for label, fn in (("before", previous_kernel_sums), ("now", current)):
            series._kernel_sums = fn
            try:
                runs[label].append(at_scale.lipschitz_task(n, 1.5, 0, 0, device=str(device), attention="series"))
            finally:
                series._kernel_sums = current
            sync(device)
    for label in ("now", "before"):
        r = runs[label][0]
        seconds = statistics.median(x["seconds"] for x in runs[label])
        print(f"| {label} | {r['lip']:.12g} ± {r['lip_error']:.2g} | {r['products']} | {fmt(seconds)} |", flush=True)
    return 0


def clusters(args, device):
    from studies.experiments import at_scale

    print("| N | T | wall time | paths | t_escape | clusters at T | drift off the sphere |")
    print("|---|---|---|---|---|---|---|")
    previous = None
    for n in [int(s) for s in args.clusters]:
        # each evaluation is O(N) on the series path: a size whose time, the previous one's scaled by N, exceeds
        # --cap is skipped (a row says so), so that a step bounded by a timeout ends with the rows it could run
        predicted = None if previous is None else previous[1] * n / previous[0]
        if predicted is not None and predicted > args.cap:
            print(f"| {n:.0e} | {args.T:g} | skipped: predicted {fmt(predicted)} > --cap {args.cap:g} s | | | | |",
                  flush=True)
            continue
        t = time.perf_counter()
        with kernels.record_paths() as paths:
            r = at_scale.cluster_task(n, args.T, 0.25, 0.5, 0, device=str(device))
        sync(device)
        seconds = time.perf_counter() - t
        used = ", ".join(f"{p} x{paths.count(p)}" for p in sorted(set(paths)))
        print(f"| {n:.0e} | {args.T:g} | {fmt(seconds)} | {used} | {r['t_escape']:.3g} | {r['clusters_T']} | "
              f"{r['drift']:.2g} |", flush=True)
        previous = (n, seconds)
    return 0


def lipschitz(args, device):
    from studies.experiments import at_scale

    # untimed, small: CUDA's start-up and the compilation of the kernels both paths take (float64 Triton kernels
    # on a GPU: seconds) would otherwise be timed in the first row, and scale the prediction that skips the others
    for attention in ("series", "exact"):
        at_scale.lipschitz_task(2000, 1.5, 0, 0, device=str(device), attention=attention)
    sync(device)
    print("| N | series: value, error | products | wall time | exact path: value, error | products | wall time | "
          "exact / series | distance / (sum of errors) |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
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


def crossover_cases(n):
    """(name, op, X) of ``--crossover`` at n points: the study's disc, then sphere tokens for three ||A||."""
    from meanfield import SelfAttention
    from studies.experiments.at_scale import seeded_attention, uniform_ball

    yield "the study's disc, d = 2", seeded_attention(2, 0, None), uniform_ball(n, 2, 1.5, 7 * n + 1)
    x = tokens(n, torch.float64, "cpu")
    A = torch.randn(3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    V = torch.randn(3, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for scale in (0.9, 1.3, 2.0):
        yield (f"sphere tokens, d = 3, ‖A‖ = {scale:g}", SelfAttention(A / torch.linalg.matrix_norm(A, 2) * scale, V),
               x)


def crossover(args, device):
    from meanfield import local_lipschitz
    from meanfield import series_jacobian as sj
    from particles import Measure

    def call(op, X, attention):
        t0 = time.perf_counter()
        est = local_lipschitz(op, Measure(X), method="lanczos", tol=1e-6, on_failure="warn", attention=attention)
        sync(device)
        return time.perf_counter() - t0, est

    sizes = [int(s) for s in args.crossover]
    _, op, X = next(crossover_cases(min(sizes)))
    for attention in ("series", "exact"):   # warm-up
        call(op, X.to(device), attention)
    print("| case | N | r | degree | cost ratio | auto takes | series | exact | exact / series | products |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for name, op, X in crossover_cases(n):
            op, X = op.to(device), X.to(device)
            e, c = op._Qf.shape[0], op._V.shape[0]
            K = sj.degree(op, X[None])
            ratio = sj.product_cost(1, n, e, c, K) / (sj.DENSE_PASSES * series.dense_cost(n * n, e, c))
            r = float(sj._quantities(op, X[None], None)[0].max())
            ts, te = [], []
            for _ in range(max(1, args.repeats)):
                t, es = call(op, X, "series")
                ts.append(t)
                t, ee = call(op, X, "exact")
                te.append(t)
            assert abs(es.value - ee.value) <= es.error + ee.error, (name, n, es.value, ee.value)
            takes = "series" if sj.preferred(op, X[None]) else "exact"
            print(f"| {name} | {n} | {r:.2f} | {K} | {ratio:.3f} | {takes} | {fmt(min(ts))} | {fmt(min(te))} | "
                  f"{min(te) / min(ts):.2f}x | {es.applications} / {ee.applications} |", flush=True)
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
    ap.add_argument("--layouts", nargs="+", type=float, default=None,
                    help="time the kernel sum's products against their previous layout instead")
    ap.add_argument("--crossover", nargs="+", type=float, default=None,
                    help="time the certified local constant through the series and the exact path near auto's floor")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_series: --device cuda, but this torch sees no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    what = ("the disc of radius 1.5 in d = 2, the discrete-versus-mean-field operator (seed 0)" if args.lipschitz else
            "points uniform in the unit square (cube), centred; float64" if args.layouts else
            "the certified W2 constant, series against exact, float64" if args.crossover else
            "sphere tokens in d = 3, q = beta x, k = v = x")
    print(f"{name}; torch {torch.__version__}; {what}\n")
    if args.clusters:
        return clusters(args, device)
    if args.lipschitz:
        return lipschitz(args, device)
    if args.layouts:
        return layouts(args, device)
    if args.crossover:
        return crossover(args, device)
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
