"""W2 solvers side by side: exact (POT emd), dense POT Sinkhorn, streaming Sinkhorn (ours), POT's
lazy Sinkhorn and GeomLoss's tensorized backend, on uniform clouds in [0, 1]^3 (d = 3).

    python benchmarks/bench_transport.py [--quick]
    python benchmarks/bench_transport.py --versus [--sizes 10000 30000] [--dims 3 64] [--repeats 2]
    python benchmarks/bench_transport.py --precision [--sizes 1000 3000] [--repeats 3]
    python benchmarks/bench_transport.py --relaxation [--sizes 2000 5000] [--clouds cube gauss] [--repeats 2]
    python benchmarks/bench_transport.py --truncation --sizes 100000 1000000 [--threads 2]
    python benchmarks/bench_transport.py --multiscale [--sizes 10000 20000] [--clouds cube gauss] [--repeats 1]

``--multiscale``: the streaming solver at the GPU goal's problem (blur 0.05, debiased, tol 1e-3, d = 3, float32
clouds) with its first annealing levels on cluster centres (transport/multiscale.py, the default) against all
levels on the points, in one process, interleaved: CPU time and the work in passes over the N x N entries
(dense soft-min passes, the exact soft-min of fallback rows and of the coarse start's extension, truncated
passes at their kept fraction; the coarse levels' own passes, about 1/64^2 of a dense one each, apart).

``--relaxation``: the streaming solver at a small blur (reg = 2 x 0.05^2, GeomLoss's blur 0.05, the setting
of the GPU goal in benchmarks/gpu.md), debiased, tol 1e-3, d = 3, float32 clouds (solved in float64, which
the blur requires): the previous solver (plain Sinkhorn steps, exponentials of underflowing terms as they
come) against over-relaxed steps alone, the exponent floor alone and both (the default), in one process,
interleaved; soft-min passes counted, values and certified errors side by side.

``--precision``: what the float32 certificate and the float64 exact cost cost, side by side in one process
(interleaved repeats, fastest CPU time of each): the streaming solver on float32 clouds that float32
resolves (certified in float64, the default) against the same solve without the certificate (the previous
path, float32's own marginal error trusted) and against float64 clouds; exact W2 of float32 clouds (cost
matrix in float64, close pairs recomputed from their differences) against the previous float32 cost matrix
|x|^2 + |y|^2 - 2<x, y>; and the cost matrix alone, transport.problem.sq_dists against the plain expansion.

``--versus``: the streaming Sinkhorn against GeomLoss (tensorized, and its KeOps ``online`` backend)
and against the previous streaming path (max-shifted log-sum-exp on every block), debiased (S_eps)
and not, at d = 3 and d = 64 (reg = 0.05 d / 3: the same blur relative to the typical distance),
with each value's relative error against a reference solved by the streaming solver to tol = 1e-11
(its agreement with POT and an independent numpy Sinkhorn is tested in tests/transport). Cases
are interleaved over repeats; the table reports each case's fastest repeat, wall-clock and CPU time.

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


def _versus_data(n, d):
    import torch
    X = torch.rand(n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    Y = torch.rand(n, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.1
    return X, Y


def run_versus(method: str, n: int, d: int, debias: bool, param: float, threads: int) -> dict:
    """One case of ``--versus``: time, CPU time, peak extra memory and the value(s).

    debias=False: ours reports <pi_eps, C> (and OT_eps = <a, f> + <b, g> from its potentials), GeomLoss
    OT_eps (its debias=False value): each is compared with the reference of the same quantity.
    ``param``: our tol, or GeomLoss's eps-scaling ratio.
    """
    import torch

    from particles import Measure
    from transport import solve

    torch.set_num_threads(threads)
    X, Y = _versus_data(n, d)
    reg = REG * d / 3
    if method.startswith("geomloss"):
        from geomloss import SamplesLoss
        backend = method.split("_", 1)[1]
        loss = SamplesLoss("sinkhorn", p=2, blur=(reg / 2) ** 0.5, scaling=param, debias=debias, backend=backend)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t, c = time.perf_counter(), time.process_time()
    info = {}
    if method.startswith("geomloss"):
        # GeomLoss's p = 2 cost is |x - y|^2 / 2 and eps = blur^2: our reg is 2 blur^2 and its value half ours
        value = 2.0 * float(loss(X, Y))
        info["ot_eps" if not debias else "s_eps"] = value
    else:
        if method == "streaming_lse":  # the previous path: the max-shifted soft-min on every half-step
            import transport.streaming_sinkhorn as st
            st.update = lambda x, xx, y, yy, lb, f, g, e, ch: st.softmin(x, xx, y, yy, lb, g, e, ch) - f
        r = solve(Measure(X), Measure(Y), "streaming", reg=reg, debias=debias, tol=param, max_iter=100_000)
        value = r.value_squared
        info = dict(iterations=r.iterations, error=r.error)
        if debias:
            info["s_eps"] = value
        else:
            info["cost"] = value
            f, g = r.potentials
            info["ot_eps"] = float(f.mean() + g.mean())
    elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(method=method, n=n, d=d, debias=debias, param=param, seconds=elapsed, cpu=cpu, value=value,
                peak_mib=(peak - base) / 1024, **info)


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


def spawn_versus(case, threads, timeout):
    method, n, d, debias, param = case
    cmd = [sys.executable, __file__, "--versus-case", method, str(n), str(d), str(int(debias)), repr(param),
           "--threads", str(threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return dict(seconds=float("inf"), cpu=float("inf"), value=float("nan"), peak_mib=float("nan"),
                    note=f"> {timeout} s")
    except subprocess.CalledProcessError as exc:
        return dict(seconds=float("nan"), cpu=float("nan"), value=float("nan"), peak_mib=float("nan"),
                    note=(exc.stderr.strip().splitlines() or ["failed"])[-1][:60])


#: GeomLoss's tensorized backend holds several N x N matrices: run it up to this N.
TENSORIZED_MAX_N = 10_000


def versus(args):
    import os
    has_geomloss = True
    try:
        import geomloss  # noqa: F401
        import pykeops  # noqa: F401
    except ImportError:
        has_geomloss = False
    has_geomloss = has_geomloss and not args.no_geomloss
    print(f"uptime before: {os.getloadavg()} (load average 1/5/15 min, {os.cpu_count()} CPUs); "
          f"threads = {args.threads}, float64, reg = {REG} d / 3\n")
    for n in args.sizes:
        for d in args.dims:
            for debias in map(bool, args.debias):
                cases = [("streaming", n, d, debias, args.ref_tol)]  # the reference, run once
                timed = [("streaming", n, d, debias, 1e-5)]
                if not args.no_lse:
                    timed += [("streaming_lse", n, d, debias, 1e-5)]
                timed += [("streaming", n, d, debias, tol) for tol in args.tols]
                if has_geomloss:
                    timed += [("geomloss_online", n, d, debias, s) for s in args.scalings]
                    if n <= TENSORIZED_MAX_N and not args.no_tensorized:
                        timed += [("geomloss_tensorized", n, d, debias, args.scalings[0])]
                results = {case: [] for case in timed}
                ref = spawn_versus(cases[0], args.threads, args.timeout)
                for _ in range(args.repeats):
                    for case in timed:
                        results[case].append(spawn_versus(case, args.threads, args.timeout))
                key = "s_eps" if debias else "ot_eps"
                _print_versus(n, d, debias, ref, results, key, os.getloadavg())


def _print_versus(n, d, debias, ref, results, key, load):
    what = "S_eps" if debias else "<pi, C> (ours) / OT_eps (GeomLoss)"
    print(f"N = {n}, d = {d}, debias = {debias} ({what}); reference {key} = {ref.get(key, float('nan')):.12g}, "
          f"<pi, C> = {ref.get('cost', float('nan')):.12g} ({ref.get('seconds', float('nan')):.3g} s); "
          f"load after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("| method | tol / scaling | best wall (s) | its CPU (s) | all walls (s) | peak extra MiB | rel. error "
          "| OT_eps rel. error | iterations | wall / CPU vs streaming tol 1e-5 | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ours = min(r["seconds"] for r in results[("streaming", n, d, debias, 1e-5)])
    ours_cpu = min(r["cpu"] for r in results[("streaming", n, d, debias, 1e-5)])
    for (method, _, _, _, param), runs in results.items():
        best = min(runs, key=lambda r: r["seconds"])
        q = key if method.startswith("geomloss") or debias else "cost"
        rq = ref.get(q, float("nan"))
        err = abs(best.get(q, float("nan")) - rq) / abs(rq)
        walls = " / ".join(f"{r['seconds']:.3g}" for r in runs)
        # debias=False: ours reports <pi, C>; its OT_eps (from the potentials) is GeomLoss's quantity
        err_ot = abs(best.get("ot_eps", float("nan")) - ref.get("ot_eps", float("nan"))) / abs(ref.get("ot_eps", 1.0))
        ot_col = "" if debias else f"{err_ot:.2g}"
        print(f"| {method} | {param:g} | {best['seconds']:.3g} | {best['cpu']:.3g} | {walls} | "
              f"{best['peak_mib']:.0f} | {err:.2g} | {ot_col} | {best.get('iterations', '')} | "
              f"{best['seconds'] / ours:.2f}x / {best['cpu'] / ours_cpu:.2f}x | {best.get('note', '')} |", flush=True)
    for runs in results.values():
        print("<!-- " + " ".join(json.dumps(r) for r in runs) + " -->")
    print()


def _cpu(fn, repeats):
    """Fastest CPU time (one thread) of ``repeats`` calls, and the last value."""
    best, out = float("inf"), None
    for _ in range(repeats):
        c = time.process_time()
        out = fn()
        best = min(best, time.process_time() - c)
    return best, out


def _uncertified_pair(x, y, la, lb, eps, opts, wide, cost=False):
    """The previous streaming path: float32's own marginal error trusted (no float64 certificate)."""
    import transport.streaming_sinkhorn as st
    f, g, err, it = st._solve_pair(x, y, la, lb, eps, opts["tol"], opts["max_iter"], opts["scaling"],
                                   opts["chunk_elements"])
    return f, g, err, it, None


def _uncertified_self(x, la, eps, opts, wide):
    import transport.streaming_sinkhorn as st
    return st._solve_symmetric(x, la, eps, opts["tol"], opts["max_iter"], opts["scaling"], opts["chunk_elements"])


def _streaming(mu, nu, debias, certified=True):
    from unittest import mock

    import transport.streaming_sinkhorn as st
    from transport import solve
    if certified:
        return solve(mu, nu, "streaming", reg=REG, debias=debias)
    with mock.patch.object(st, "_certified_pair", _uncertified_pair), \
            mock.patch.object(st, "_certified_self", _uncertified_self):
        return solve(mu, nu, "streaming", reg=REG, debias=debias)


def _expansion(x, y):
    """The previous cost matrix: |x|^2 + |y|^2 - 2<x, y>, one matrix product."""
    xx, yy = (x * x).sum(1), (y * y).sum(1)
    return (xx[:, None] + yy[None, :] - 2.0 * x @ y.T).clamp_min(0.0)


def _exact_previous(x, y):
    """The previous exact path on float32 clouds: centred, the cost matrix in float32 by expansion."""
    import ot
    import torch
    a = torch.full((x.shape[0],), 1.0 / x.shape[0], dtype=x.dtype)
    c = 0.5 * (x.mean(0) + y.mean(0))
    return float(ot.emd2(a, a, _expansion(x - c, y - c), numItermax=50_000_000))


def precision(args):
    """The overhead of the float32 certificate and of float64 exact costs (see the module docstring)."""
    import os
    from functools import partial

    import torch

    from particles import Measure
    from transport import w2
    from transport.problem import sq_dists

    torch.set_num_threads(args.threads)
    print(f"uptime before: {os.getloadavg()} (load average 1/5/15 min, {os.cpu_count()} CPUs); "
          f"threads = {args.threads}, reg = {REG}, d = 3, uniform clouds in [0,1]^3 (second shifted by 0.1), "
          f"fastest CPU time of {args.repeats} interleaved repeats\n")
    print("| N | case | CPU (s) | vs first of its group | value | error | iterations | precision |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        X64, Y64 = _data(n, 0), _data(n, 1) + 0.1
        mu32, nu32 = Measure(X64, dtype=torch.float32), Measure(Y64, dtype=torch.float32)
        mu64, nu64 = Measure(mu32.points.double()), Measure(nu32.points.double())
        for debias in (False, True):
            _print_precision(n, {
                f"streaming float32, debias={debias}, previous (float32's own error)":
                    partial(_streaming, mu32, nu32, debias, certified=False),
                f"streaming float32, debias={debias}, certified in float64 (default)":
                    partial(_streaming, mu32, nu32, debias),
                f"streaming float64, debias={debias}": partial(_streaming, mu64, nu64, debias)}, args.repeats)
        _print_precision(n, {
            "exact float32, previous (float32 cost by expansion)": partial(_exact_previous, mu32.points, nu32.points),
            "exact float32, float64 cost, close pairs from differences (default)": partial(w2, mu32, nu32,
                                                                                           squared=True)},
            args.repeats)
        for d in (3, 64):
            x, y = _versus_data(n, d)
            c = 0.5 * (x.mean(0) + y.mean(0))  # centred, as the solvers hold them
            x, y = x - c, y - c
            _print_precision(n, {
                f"cost matrix only, float64, d = {d}, expansion (previous)": partial(_expansion, x, y),
                f"cost matrix only, float64, d = {d}, close pairs from differences (default)": partial(sq_dists, x, y)},
                args.repeats)
    print(f"\nuptime after: {os.getloadavg()}")


def _print_precision(n, cases, repeats):
    """One group of cases, timed interleaved; ratios against the group's first case."""
    runs = {name: (float("inf"), None) for name in cases}
    for _ in range(repeats):  # interleaved: a change of load hits every case of the group alike
        for name, fn in cases.items():
            t, out = _cpu(fn, 1)
            runs[name] = (min(runs[name][0], t), out)
    base = next(iter(runs.values()))[0]
    for name, (t, out) in runs.items():
        value = getattr(out, "value_squared", out if isinstance(out, float) else None)
        value = f"{value:.10g}" if isinstance(value, float) else ""
        error = getattr(out, "error", None)
        print(f"| {n} | {name} | {t:.3g} | {t / base:.3f}x | {value} | {'' if error is None else f'{error:.2g}'} | "
              f"{getattr(out, 'iterations', '') or ''} | {getattr(out, 'precision', '') or ''} |", flush=True)


def _relaxed(mu, nu, omega, clamp):
    """The streaming solve at the small blur of --relaxation, with ``omega`` and the exponent floor on or off;
    returns (result, soft-min passes)."""
    from unittest import mock

    import transport.streaming_sinkhorn as st
    import transport.tiles as tiles
    from transport import solve

    passes = [0]
    update = st.update

    def counted(*a, **k):
        passes[0] += 1
        return update(*a, **k)

    with mock.patch.object(tiles, "CLAMP_UNDERFLOW", clamp), mock.patch.object(st, "update", counted):
        res = solve(mu, nu, "streaming", reg=2 * 0.05**2, debias=True, tol=1e-3, overrelaxation=omega)
    return res, passes[0]


def relaxation(args):
    """Over-relaxation and the exponent floor against the previous streaming solver (module docstring)."""
    import os
    from functools import partial

    import torch

    from particles import Measure

    torch.set_num_threads(args.threads)
    print(f"uptime before: {os.getloadavg()} (load average 1/5/15 min, {os.cpu_count()} CPUs); "
          f"threads = {args.threads}, reg = 2 x 0.05^2 (blur 0.05), debias, tol 1e-3, d = 3, clouds: cube = uniform "
          f"in [0,1]^3 and its translate by 0.1, gauss = N(0, I) and N(1, I / 4); "
          f"fastest CPU time of {args.repeats} interleaved repeats\n")
    print("| N, clouds | case | CPU (s) | vs previous | soft-min passes | value S_eps | error | precision |")
    print("|---|---|---|---|---|---|---|---|")
    for n, kind in ((n, kind) for kind in args.clouds for n in args.sizes):
        if kind == "cube":
            X, Y = _data(n, 0), _data(n, 1) + 0.1
        else:   # Gaussian clouds: N(0, I) against N(1, I / 4), a wider spread relative to the blur
            g = torch.Generator().manual_seed(0)
            X = torch.randn(n, 3, generator=g, dtype=torch.float64)
            Y = 0.5 * torch.randn(n, 3, generator=g, dtype=torch.float64) + 1.0
        mu, nu = Measure(X, dtype=torch.float32), Measure(Y, dtype=torch.float32)
        cases = {"previous: plain steps, no exponent floor": partial(_relaxed, mu, nu, 1.0, False),
                 "over-relaxed steps (auto), no floor": partial(_relaxed, mu, nu, "auto", False),
                 "plain steps, exponent floor": partial(_relaxed, mu, nu, 1.0, True),
                 "over-relaxed (auto) and floor (default)": partial(_relaxed, mu, nu, "auto", True)}
        runs = {name: (float("inf"), None) for name in cases}
        for _ in range(args.repeats):
            for name, fn in cases.items():
                t, out = _cpu(fn, 1)
                runs[name] = (min(runs[name][0], t), out)
        base = next(iter(runs.values()))[0]
        for name, (t, (res, passes)) in runs.items():
            print(f"| {n}, {kind} | {name} | {t:.3g} | {base / t:.2f}x | {passes} | {res.value_squared:.10g} | "
                  f"{res.error:.2g} | {res.precision} |", flush=True)
    print(f"\nuptime after: {os.getloadavg()}")


def truncation_fraction(args):
    """The fraction of the N x N entries a truncated pass computes at the last eps of the GPU goal's problem
    (blur 0.05, uniform cube against its translate by 0.1, tol 1e-3), with the row blocks of the Triton kernel
    (64 and 128 rows) and tiles of transport.truncation.TILE columns. The potentials at N points are those of a
    solve at 10^4 points, carried to the N points by one soft c-transform each (entropic potentials are smooth:
    the N-point ones differ from these by the sampling error): what the bounds would skip, computed on a CPU."""
    import math

    import torch

    from particles import Measure
    from transport import solve, truncation
    from transport.tiles import softmin

    torch.set_num_threads(args.threads)
    reg, tol, n0 = 2 * 0.05**2, 1e-3, 10_000
    truncation.ENABLED = False
    x0, y0 = _data(n0, 0), _data(n0, 1) + 0.1
    res = solve(Measure(x0), Measure(y0), "streaming", reg=reg, debias=False, tol=tol)
    f0, g0 = res.potentials
    lw0 = torch.full((n0,), -math.log(n0), dtype=torch.float64)
    print(f"potentials from a solve at N = {n0} (error {res.error:.2g}); reg = {reg}, tol = {tol}, tiles of "
          f"{truncation.TILE} columns\n")
    print("| N | rows per block | tau | fraction of the entries computed, x side | y side |")
    print("|---|---|---|---|---|")
    for n in args.sizes:
        x, y = _data(n, 2), _data(n, 3) + 0.1
        x, y = x[truncation.morton_order(x)], y[truncation.morton_order(y)]
        xx, yy = (x * x).sum(1), (y * y).sum(1)
        f = softmin(x, xx, y0, (y0 * y0).sum(1), lw0, g0, reg, 2**22)   # the c-transforms of the n0-point potentials
        g = softmin(y, yy, x0, (x0 * x0).sum(1), lw0, f0, reg, 2**22)
        lw = torch.full((n,), -math.log(n), dtype=torch.float64)
        threshold = truncation.tau(n, tol)
        for rows in (64, 128):
            fracs = []
            for (p, q, fp, gq) in ((x, y, f, g), (y, x, g, f)):
                rb, cb = truncation.Blocks(p, rows), truncation.Blocks(q, truncation.TILE)
                ptr, kept = truncation.kept_tiles(rb, cb, rb.max(fp), cb.max(gq + reg * lw), reg, threshold)
                fracs.append(kept.numel() / (rb.count * cb.count))
            print(f"| {n} | {rows} | {threshold:.1f} | {fracs[0]:.3f} | {fracs[1]:.3f} |", flush=True)
    truncation.ENABLED = True
    # a whole solve on the CPU, truncated and not, where truncation stays on at a CPU's sizes: spread 2-D clouds
    g = torch.Generator().manual_seed(5)
    X = 4.0 * torch.rand(6000, 2, generator=g, dtype=torch.float64)
    Y = 4.0 * torch.rand(5000, 2, generator=g, dtype=torch.float64) + 0.1
    mu, nu = Measure(X), Measure(Y)

    def run(on):
        truncation.ENABLED = on
        try:
            return solve(mu, nu, "streaming", reg=0.005, debias=True, tol=1e-4)
        finally:
            truncation.ENABLED = True

    print("\nA whole solve on this CPU: 6000 x 5000 points uniform in [0, 4]^2 (the second shifted by 0.1), reg 0.005, "
          f"debiased, tol 1e-4, float64, {args.threads} threads, fastest CPU time of {args.repeats} interleaved "
          "repeats\n")
    print("| case | CPU (s) | vs untruncated | value S_eps | error | updates |")
    print("|---|---|---|---|---|---|")
    runs = {"untruncated": (math.inf, None), f"truncated ({truncation.CPU_ROWS}-row blocks, default)": (math.inf, None)}
    for _ in range(args.repeats):
        for name in runs:
            t, out = _cpu(lambda name=name: run(name != "untruncated"), 1)
            runs[name] = (min(runs[name][0], t), out)
    base = runs["untruncated"][0]
    for name, (t, res) in runs.items():
        print(f"| {name} | {t:.3g} | {base / t:.2f}x | {res.value_squared:.10g} | {res.error:.2g} | {res.iterations} |")


def _counted_solve(mu, nu, coarse: bool):
    """A debiased solve at blur 0.05 with the annealing on cluster centres or not, and its work in passes over
    the N x M entries by kind (module docstring)."""
    from unittest import mock

    from transport import multiscale, solve, tiles, truncation

    n, m = mu.n, nu.n
    work = {}

    def add(kind, entries):
        work[kind] = work.get(kind, 0.0) + entries / (n * m)

    row_sums, softmin, truncated = tiles.row_sums, tiles.softmin, truncation._tiles

    def big(a, b):
        return "passes over the points" if min(a, b) >= min(n, m) // 2 else "coarse levels"

    def rs(A, B, c):
        add(big(A.shape[0], B.shape[1]), A.shape[0] * B.shape[1])
        return row_sums(A, B, c)

    def sm(x, xx, y, yy, *a):
        add("exact soft-min (fallback rows, coarse start's extension)" if min(x.shape[0], y.shape[0]) >= 64
            else "coarse levels", x.shape[0] * y.shape[0])
        return softmin(x, xx, y, yy, *a)

    def tt(A, B, ptr, kept, rows, cols, eps):
        add("truncated passes (kept fraction)", kept.numel() * cols.size * rows.size)
        return truncated(A, B, ptr, kept, rows, cols, eps)

    import transport.streaming_sinkhorn as st
    with mock.patch.object(tiles, "row_sums", rs), mock.patch.object(tiles, "softmin", sm), \
            mock.patch.object(st, "softmin", sm), mock.patch.object(multiscale, "softmin", sm), \
            mock.patch.object(truncation, "_tiles", tt), mock.patch.object(multiscale, "ENABLED", coarse):
        res = solve(mu, nu, "streaming", reg=2 * 0.05**2, debias=True, tol=1e-3)
    return res, work


def multiscale_annealing(args):
    """The annealing on cluster centres against all levels on the points (module docstring)."""
    import os

    import torch

    from particles import Measure

    torch.set_num_threads(args.threads)
    print(f"uptime before: {os.getloadavg()} (load average 1/5/15 min, {os.cpu_count()} CPUs); threads = "
          f"{args.threads}, reg = 2 x 0.05^2 (blur 0.05), debias, tol 1e-3, d = 3, float32 clouds: cube = uniform "
          f"in [0,1]^3 and its translate by 0.1, gauss = N(0, I) and N(1, I / 4); fastest CPU time of "
          f"{args.repeats} interleaved repeats; work in passes over the N x N entries\n")
    print("| N, clouds | case | CPU (s) | vs all levels on the points | work (passes) | of which | value S_eps | "
          "error | pair updates |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, kind in ((n, kind) for kind in args.clouds for n in args.sizes):
        if kind == "cube":
            X, Y = _data(n, 0), _data(n, 1) + 0.1
        else:
            g = torch.Generator().manual_seed(0)
            X = torch.randn(n, 3, generator=g, dtype=torch.float64)
            Y = 0.5 * torch.randn(n, 3, generator=g, dtype=torch.float64) + 1.0
        mu, nu = Measure(X, dtype=torch.float32), Measure(Y, dtype=torch.float32)
        cases = {"all levels on the points (previous)": False, "first levels on cluster centres (default)": True}
        runs = {name: (float("inf"), None) for name in cases}
        for _ in range(args.repeats):
            for name, coarse in cases.items():
                t, out = _cpu(lambda mu=mu, nu=nu, coarse=coarse: _counted_solve(mu, nu, coarse), 1)
                runs[name] = (min(runs[name][0], t), out)
        base = next(iter(runs.values()))[0]
        for name, (t, (res, work)) in runs.items():
            total = sum(v for k, v in work.items() if k != "coarse levels")
            parts = "; ".join(f"{k} {v:.3g}" for k, v in sorted(work.items()))
            print(f"| {n}, {kind} | {name} | {t:.3g} | {base / t:.2f}x | {total:.1f} | {parts} | "
                  f"{res.value_squared:.10g} | {res.error:.2g} | {res.iterations} |", flush=True)
    print(f"\nuptime after: {os.getloadavg()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--case", nargs=2)
    ap.add_argument("--versus", action="store_true")
    ap.add_argument("--versus-case", nargs=5)
    ap.add_argument("--precision", action="store_true", help="overhead of the float32 certificate, float64 costs")
    ap.add_argument("--relaxation", action="store_true", help="over-relaxation and the exponent floor vs previous")
    ap.add_argument("--truncation", action="store_true", help="fraction a truncated pass computes at --sizes")
    ap.add_argument("--multiscale", action="store_true", help="the annealing on cluster centres vs on the points")
    ap.add_argument("--clouds", nargs="+", default=["cube", "gauss"], choices=["cube", "gauss"],
                    help="--relaxation's and --multiscale's data")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000])
    ap.add_argument("--dims", type=int, nargs="+", default=[3, 64])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--scalings", type=float, nargs="+", default=[0.5, 0.9],
                    help="GeomLoss eps-scaling ratios (its default 0.5; 0.9 for accuracy closer to ours)")
    ap.add_argument("--debias", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--tols", type=float, nargs="*", default=[1e-4, 1e-3], help="our looser tolerances")
    ap.add_argument("--ref-tol", type=float, default=1e-11, help="tolerance of the reference solve")
    ap.add_argument("--no-lse", action="store_true", help="skip the previous streaming path")
    ap.add_argument("--no-tensorized", action="store_true", help="skip GeomLoss's tensorized backend")
    ap.add_argument("--no-geomloss", action="store_true", help="only the streaming solver")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=None)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.threads)))
        return
    if args.versus_case:
        m, n, d, debias, param = args.versus_case
        print(json.dumps(run_versus(m, int(n), int(d), debias == "1", float(param), args.threads)))
        return
    if args.versus:
        args.timeout = args.timeout or 1800
        versus(args)
        return
    if args.truncation:
        truncation_fraction(args)
        return
    if args.multiscale:
        multiscale_annealing(args)
        return
    if args.relaxation:
        if args.sizes == [10_000]:
            args.sizes = [2000, 5000]
        relaxation(args)
        return
    if args.precision:
        if args.sizes == [10_000]:  # the --versus default
            args.sizes = [1000, 3000]
        args.repeats = max(args.repeats, 3)
        precision(args)
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
