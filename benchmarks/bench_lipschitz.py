"""Certified local Lipschitz constant of a GPT-2-sized layer: local_lipschitz vs scipy's ARPACK (eigsh).

    python benchmarks/bench_lipschitz.py [--quick] [--repeats R] [--cpu-time] [--with-power] [--sizes 64,512]
                                         [--skip-batched] [--skip-compare] [--device cpu|cuda]

Layer: multi-head attention, d = 768, 12 heads of size 64, weights N(0, 0.02^2) as in GPT-2's
initialization, output projection W_O (768 x 768) scaled the same way; tokens x_i ~ N(0, I)
(what a LayerNorm outputs). float64 input; every certificate in float64.

Side by side in one process, repeats interleaved (method A, B, C, A, B, C, ...), medians reported:

* ``eigsh (torch.func)``: ``scipy.sparse.linalg.eigsh(k=1, which="LA", tol=1e-6)`` on the
  LinearOperator u -> J^T J u, the products written the standard way (``torch.func.jvp`` then
  ``torch.func.vjp``, float64): what a user of scipy would run on this operator;
* ``eigsh (rr products)``: the same ARPACK run on the framework's own float64 products
  (reverse-over-reverse J u on a recorded graph, J^T w by a backward pass), to separate the Krylov
  scheme from the products;
* ``lanczos float64``: ``local_lipschitz(op, X, tol=1e-6, mixed=False)``;
* ``lanczos (default)``: ``local_lipschitz(op, X, tol=1e-6)`` (float32 products in a first phase,
  float64 certificate);
* ``power`` (with --with-power): the certified power iteration.

"equal certified accuracy": every row reports the float64 certificate of its returned vector
(relative error bound min(r/sigma, sqrt r)/sigma of docs/math.md section 4.4, computed after the
timing for eigsh) and the distance to a reference (Lanczos at tol 1e-12, float64). Ratios are
time(eigsh torch.func) / time(method).

Batched: 10 sequences in one call against 10 calls (lanczos default), at n = 4, 16 and 64, with the
time of one J^T J product at b = 1 and b = 10 (when it grows 10x, products are compute-bound and
batching cannot help).

Shared or loaded machine: ``--cpu-time`` pins torch (and OpenBLAS) to one thread and measures the
calling thread's CPU time, which other processes do not inflate; the machine's load average
(``uptime``) is printed with every table.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--cpu-time" in sys.argv:  # before numpy/scipy load OpenBLAS
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"

import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.sparse.linalg import LinearOperator, eigsh  # noqa: E402

from meanfield import MultiHeadAttention, SelfAttention, local_lipschitz  # noqa: E402
from meanfield.jacobian import Jacobian  # noqa: E402

D, H, K = 768, 12, 64
TOL = 1e-6
CLOCK = time.perf_counter


def gpt2_layer(seed, device, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: (0.02 * torch.randn(*s, generator=g, dtype=dtype)).to(device)
    heads = [SelfAttention.from_qkv(w(K, D), w(K, D), w(K, D)) for _ in range(H)]
    return MultiHeadAttention(heads, w(D, H * K))


def load():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def certificate(op, X, u):
    """float64 certificate of a unit vector u: (value |J u|, relative error bound), products by torch.func."""
    fn = op.sequence
    u = u / u.norm()
    Ju = torch.func.jvp(fn, (X,), (u,))[1]
    s = Ju.norm()
    z = torch.func.vjp(fn, X)[1](Ju / s)[0]
    rho = float((z - s * u).norm())
    s = float(s)
    return s, min(rho, (rho * s) ** 0.5) / s


def eigsh_run(op, X, products):
    """ARPACK on u -> J^T J u; returns (value, unit vector, J^T J products)."""
    fn = op.sequence
    if products == "torch.func":
        _, vjp_fn = torch.func.vjp(fn, X)
        apply = lambda u: vjp_fn(torch.func.jvp(fn, (X,), (u,))[1])[0]
    else:
        p = Jacobian(lambda Y: op.points_map(Y), X.unsqueeze(0))
        apply = lambda u: p._jt(p._jvp(u.unsqueeze(0)))[0]
    count = [0]

    def matvec(v):
        count[0] += 1
        u = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)).reshape(X.shape).to(X.device)
        return apply(u).reshape(-1).cpu().numpy()

    L = LinearOperator((X.numel(), X.numel()), matvec=matvec, dtype=np.float64)
    v0 = np.random.default_rng(0).standard_normal(X.numel())
    vals, vecs = eigsh(L, k=1, which="LA", tol=TOL, v0=v0)
    u = torch.from_numpy(vecs[:, 0]).reshape(X.shape).to(X.device)
    return float(np.sqrt(max(vals[0], 0.0))), u, count[0]


def compare(op, ns, repeats, device, with_power):
    print(f"\n## Certified Lipschitz constant, GPT-2-sized layer (d = {D}, {H} heads), float64, tol {TOL:g}\n")
    print(f"load before: `{load()}`\n")
    print("| n | method | time (s, median) | eigsh(torch.func) / this | J^T J products | certified rel. error "
          "| rel. distance to reference |")
    print("|---|---|---|---|---|---|---|")
    for n in ns:
        X = torch.randn(n, D, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(device)
        ref = local_lipschitz(op, X, tol=1e-12, mixed=False).value
        methods = {
            "eigsh (torch.func)": lambda X=X: eigsh_run(op, X, "torch.func"),
            "eigsh (rr products)": lambda X=X: eigsh_run(op, X, "rr"),
            "lanczos float64": lambda X=X: local_lipschitz(op, X, tol=TOL, mixed=False),
            "lanczos (default)": lambda X=X: local_lipschitz(op, X, tol=TOL),
        }
        if with_power:
            methods["power"] = lambda X=X: local_lipschitz(op, X, method="power", tol=TOL, max_iter=5000,
                                                           on_failure="warn")
        times = {k: [] for k in methods}
        results = {}
        if n == ns[0]:  # one untimed pass: first-call costs (imports, allocator, functorch) out of the figures
            for run in methods.values():
                run()
        for _ in range(repeats):
            for name, run in methods.items():
                sync(device)
                t0 = CLOCK()
                results[name] = run()
                sync(device)
                times[name].append(CLOCK() - t0)
        base = statistics.median(times["eigsh (torch.func)"])
        for name in methods:
            r = results[name]
            if isinstance(r, tuple):
                value, rel = certificate(op, X, r[1])
                products = r[2]
            else:
                value, rel, products = r.value, r.error / r.value, r.applications / 2
            t = statistics.median(times[name])
            print(f"| {n} | {name} | {t:.3f} | {base / t:.2f}x | {products:g} | {rel:.1e} | "
                  f"{abs(value - ref) / ref:.1e} |", flush=True)
    print(f"\nload after: `{load()}`")


def product_time(op, Xb, repeats):
    p = Jacobian(lambda Y: op.points_map(Y), Xb)
    u = torch.randn_like(Xb)
    p._jt(p._jvp(u))
    ts = []
    for _ in range(repeats):
        t0 = CLOCK()
        p._jt(p._jvp(u))
        ts.append(CLOCK() - t0)
    return statistics.median(ts)


def batched(op, ns, b, repeats, device):
    print(f"\n## Batched evaluation: {b} sequences in one call vs {b} calls (lanczos default, tol {TOL:g})\n")
    print(f"load before: `{load()}`\n")
    print("| n | one call (s) | separate calls (s) | throughput ratio | J^T J product b=1 (ms) | "
          f"b={b} (ms) | product time ratio b={b}/b=1 | max rel. difference |")
    print("|---|---|---|---|---|---|---|---|")
    for n in ns:
        Xb = torch.randn(b, n, D, generator=torch.Generator().manual_seed(100 + n), dtype=torch.float64).to(device)
        t_one, t_sep = [], []
        local_lipschitz(op, Xb, tol=TOL)  # untimed: first-call costs out of the figures
        local_lipschitz(op, Xb[0], tol=TOL)
        for _ in range(repeats):
            t0 = CLOCK()
            batch = local_lipschitz(op, Xb, tol=TOL)
            t_one.append(CLOCK() - t0)
            t0 = CLOCK()
            singles = [local_lipschitz(op, Xb[i], tol=TOL) for i in range(b)]
            t_sep.append(CLOCK() - t0)
        worst = max(abs(a.value - s.value) / s.value for a, s in zip(batch, singles))
        p1, pb = product_time(op, Xb[:1], 5), product_time(op, Xb, 5)
        one, sep = statistics.median(t_one), statistics.median(t_sep)
        print(f"| {n} | {one:.2f} | {sep:.2f} | {sep / one:.2f}x | {p1 * 1e3:.1f} | {pb * 1e3:.1f} | "
              f"{pb / p1:.1f} | {worst:.1e} |", flush=True)
    print(f"\nload after: `{load()}`")


def main():
    global CLOCK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n = 64, 128; batched at n = 16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true",
                    help="one thread, CPU time of the calling thread (robust to other processes)")
    ap.add_argument("--with-power", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", help="comma-separated n for the eigsh comparison (default 64,128,256,512)")
    ap.add_argument("--skip-batched", action="store_true")
    ap.add_argument("--skip-compare", action="store_true")
    a = ap.parse_args()
    if a.cpu_time:
        torch.set_num_threads(1)
        CLOCK = time.thread_time
    device = torch.device(a.device)
    print(f"# bench_lipschitz {' '.join(sys.argv[1:])}\n")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores visible, "
          f"device {device}, clock {'thread CPU time' if a.cpu_time else 'wall'}, repeats {a.repeats} (medians)")
    op = gpt2_layer(0, device)
    sizes = [int(n) for n in a.sizes.split(",")] if a.sizes else ([64, 128] if a.quick else [64, 128, 256, 512])
    if not a.skip_compare:
        compare(op, sizes, a.repeats, device, a.with_power)
    if not a.skip_batched:
        batched(op, [4, 16] if a.quick else [4, 16, 64], 10, 1 if a.quick else a.repeats, device)


if __name__ == "__main__":
    main()
