"""Attention kernels side by side: dense, fused (SDPA), streamed and auto, by regime.

    python benchmarks/bench_attention.py [--quick] [--repeats R] [--cpu-time] [--skip-memory] [--skip-lipschitz]

Prints markdown tables; every performance figure is a ratio against the other paths measured in the
same run, repeats interleaved (dense, fused, stream, auto, dense, ...), medians reported:

* agreement of every path with dense (forward, JVP, VJP; load-independent);
* forward regime map: N = 1e2 .. 1e5 (quick: .. 1e4), d = 3 and 64, masks none / causal (sequence
  positions) / weighted (log-weights) / arbitrary positions; time of each path, auto / best;
* derivatives: JVP (forward-mode AD) and VJP (reverse mode), plain autograd and torch.func;
* the streamed kernel against the hardware: forward FLOP rate against a large matrix product at
  d = 64, and each pass of the streamed kernel (its fused-kernel engine and its Python tile loop)
  against the fused kernel's forward and VJP;
* peak memory of auto calls in fresh subprocesses; a certified Lipschitz constant at n = 4096.

Dense runs only while its score matrices fit (3 N^2 entries under 2 GiB). Shared machine:
``--cpu-time`` pins torch to one thread and measures the calling thread's CPU time (robust to other
processes); the machine's load (``uptime``) is printed next to every table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from torch.autograd import forward_ad as fwAD

from meanfield import flash_cpu
from meanfield.kernels import attend, choose

DT = torch.float64
CLOCK = time.perf_counter
DENSE_BYTES = 2 * 2**30


def load():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


def interleaved(fns, repeats, warmup=True):
    """Median time per call of each callable. Repeats are interleaved across callables, in an order
    rotated at every repeat (no callable always follows the same one); calls shorter than 10 ms are
    looped so that each sample lasts about 10 ms."""
    loops = {k: 1 for k in fns}
    if warmup:
        for k, f in fns.items():
            t0 = CLOCK()
            f()
            loops[k] = max(1, min(1000, int(0.01 / max(CLOCK() - t0, 1e-6))))
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t0 = CLOCK()
            for _ in range(loops[k]):
                fns[k]()
            times[k].append((CLOCK() - t0) / loops[k])
    return {k: statistics.median(v) for k, v in times.items()}


def setup(n, d, mask, seed=0, dtype=DT):
    """Self-attention inputs q = X A^T, k = X, v = X V^T with the given mask kind."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=dtype)
    A = torch.randn(d, d, generator=g, dtype=dtype) / d
    V = torch.randn(d, d, generator=g, dtype=dtype) / math.sqrt(d)
    lw = pos = None
    if mask in ("weighted", "weighted causal"):
        lw = torch.log_softmax(torch.randn(n, generator=g, dtype=dtype), 0)
    if mask in ("causal", "weighted causal"):
        pos = torch.arange(1, n + 1, dtype=dtype) / n
    if mask == "arbitrary":
        pos = torch.rand(n, generator=g, dtype=dtype)
    return X, A, V, lw, pos


def fn(method, A, V, lw, pos):
    return lambda X: attend(X @ A.T, X, X @ V.T, lw, pos, pos, method=method)


def dense_fits(n, dtype=DT):
    return 3 * n * n * torch.finfo(dtype).bits // 8 <= DENSE_BYTES


def fwad_jvp(f, X, U):
    with fwAD.dual_level():
        return fwAD.unpack_dual(f(fwAD.make_dual(X, U))).tangent


def autograd_vjp(f, X, W):
    Xr = X.detach().requires_grad_(True)
    return torch.autograd.grad(f(Xr), Xr, W)[0]


# ---------------------------------------------------------------------- agreement
def agreement(n, dims):
    print(f"\n## Agreement with dense: max |difference| (float64, n = {n})\n")
    print("| d | mask | fused fwd | stream fwd | auto fwd | stream JVP (forward AD) | stream JVP (torch.func) | "
          "stream VJP (autograd) | stream VJP (torch.func) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in dims:
        for mask in ("none", "causal", "weighted", "weighted causal", "arbitrary"):
            X, A, V, lw, pos = setup(n, d, mask)
            U, W = torch.randn_like(X), torch.randn_like(X)
            ref = fn("dense", A, V, lw, pos)
            r_f, r_j, r_v = ref(X), torch.func.jvp(ref, (X,), (U,))[1], torch.func.vjp(ref, X)[1](W)[0]
            s = fn("stream", A, V, lw, pos)
            cells = [fn("fused", A, V, lw, pos)(X) - r_f, s(X) - r_f, fn("auto", A, V, lw, pos)(X) - r_f,
                     fwad_jvp(s, X, U) - r_j, torch.func.jvp(s, (X,), (U,))[1] - r_j,
                     autograd_vjp(s, X, W) - r_v, torch.func.vjp(s, X)[1](W)[0] - r_v]
            print(f"| {d} | {mask} | " + " | ".join(f"{float(c.abs().max()):.1e}" for c in cells) + " |")


# ---------------------------------------------------------------------- regime map
def regime_map(sizes, dims, masks, repeats):
    print("\n## Forward passes: time by path, auto / best (< 1.1 is the target)\n")
    print(f"load before: `{load()}`\n")
    print("| N | d | mask | dense (s) | fused (s) | stream (s) | auto (s) | auto picks | best | auto / best |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for n in sizes:
        for d in dims:
            for mask in masks:
                worst = max(worst, _regime_row(n, d, mask, repeats))
    print(f"\nworst auto / best: {worst:.2f}; load after: `{load()}`")


def _regime_row(n, d, mask, repeats):
    X, A, V, lw, pos = setup(n, d, mask)
    q, k, v = X @ A.T, X, X @ V.T
    paths = ["dense", "fused", "stream", "auto"]
    if not dense_fits(n):
        paths.remove("dense")
        if mask == "arbitrary":
            paths.remove("fused")  # needs an (N, N) boolean mask
    fns = {m: (lambda m=m: attend(q, k, v, lw, pos, pos, method=m)) for m in paths}
    t = interleaved(fns, repeats if n <= 10_000 else 1, warmup=n <= 10_000)
    best = min((t[p], p) for p in t if p != "auto")
    ratio = t["auto"] / best[0]
    cells = " | ".join(f"{t[p]:.4g}" if p in t else "n/a" for p in ("dense", "fused", "stream"))
    print(f"| {n} | {d} | {mask} | {cells} | {t['auto']:.4g} | {choose(q, k, v, lw, pos, pos)} | {best[1]} | "
          f"{ratio:.2f} |", flush=True)
    return ratio


def derivative_map(sizes, dims, repeats):
    print("\n## Derivatives: time by path (JVP by forward-mode AD, VJP by autograd; torch.func for comparison)\n")
    print(f"load before: `{load()}`\n")
    print("| N | d | mask | pass | dense (s) | fused (s) | stream (s) | auto (s) | stream under torch.func (s) | "
          "auto / best |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for d in dims:
            for mask in ("none", "causal"):
                for kind in ("JVP", "VJP"):
                    _derivative_row(n, d, mask, kind, repeats)
    print(f"\nload after: `{load()}`")


def _derivative_row(n, d, mask, kind, repeats):
    X, A, V, lw, pos = setup(n, d, mask)
    U = torch.randn_like(X)
    fns = {}
    for m in ("dense", "fused", "stream", "auto"):
        if (m == "dense" and not dense_fits(n)) or (m == "fused" and kind == "JVP"):
            continue  # fused: no forward-mode derivative on CPU
        f = fn(m, A, V, lw, pos)
        fns[m] = (lambda f=f: fwad_jvp(f, X, U)) if kind == "JVP" else (lambda f=f: autograd_vjp(f, X, U))
    s = fn("stream", A, V, lw, pos)
    fns["func"] = ((lambda: torch.func.jvp(s, (X,), (U,))[1]) if kind == "JVP"
                   else (lambda: torch.func.vjp(s, X)[1](U)[0]))
    t = interleaved(fns, repeats if n <= 10_000 else 1, warmup=n <= 10_000)
    best = min(t[p] for p in t if p in ("dense", "fused", "stream"))
    cells = " | ".join(f"{t[p]:.4g}" if p in t else "n/a" for p in ("dense", "fused", "stream"))
    print(f"| {n} | {d} | {mask} | {kind} | {cells} | {t['auto']:.4g} | {t['func']:.4g} | {t['auto'] / best:.2f} |",
          flush=True)


# ---------------------------------------------------------------------- streamed kernel vs hardware
def hardware(n, repeats):
    print(f"\n## The streamed kernel against the hardware (N = {n}, unmasked, unweighted)\n")
    print(f"load before: `{load()}`\n")
    print("Forward counted as 4 N^2 d flops (Q K^T and P V; exponentials not counted). Large GEMM: 4096^3.\n")
    print("| dtype | d | GEMM GFLOP/s | stream fwd GFLOP/s | fraction of GEMM | fused fwd (s) | stream fwd (s) | "
          "tile-loop fwd (s) | stream JVP (s) | fused VJP (s) | stream VJP (s) | tile-loop VJP (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(0)
        M1, M2 = (torch.randn(4096, 4096, generator=g, dtype=dtype) for _ in range(2))
        for d in (3, 64):
            _hardware_row(n, d, dtype, M1, M2, g, repeats)
    print(f"\nload after: `{load()}`")


def _hardware_row(n, d, dtype, M1, M2, g, repeats):
    X = torch.randn(n, d, generator=g, dtype=dtype) / d**0.25
    U = torch.randn_like(X)
    stream = lambda Y: attend(Y, Y, Y, method="stream")
    fused = lambda Y: attend(Y, Y, Y, method="fused")
    fns = {
        "gemm": lambda: M1 @ M2,
        "fused": lambda: fused(X),
        "stream": lambda: stream(X),
        "tiles": _without_flash(lambda: stream(X)),
        "jvp": lambda: fwad_jvp(stream, X, U),
        "fused vjp": lambda: autograd_vjp(fused, X, U),
        "vjp": lambda: autograd_vjp(stream, X, U),
        "tiles vjp": _without_flash(lambda: autograd_vjp(stream, X, U)),
    }
    t = interleaved(fns, repeats)
    gemm = 2 * M1.shape[0] ** 3 / t["gemm"] / 1e9
    rate = 4 * n * n * d / t["stream"] / 1e9
    cells = " | ".join(f"{t[k]:.4g}" for k in ("fused", "stream", "tiles", "jvp", "fused vjp", "vjp", "tiles vjp"))
    print(f"| {str(dtype)[6:]} | {d} | {gemm:.1f} | {rate:.1f} | {rate / gemm:.2f} | {cells} |", flush=True)


def _without_flash(f):
    """Run f with the streamed kernel's fused-kernel engine disabled (its Python tile loop only)."""
    def run():
        saved = flash_cpu.FORWARD, flash_cpu.BACKWARD
        flash_cpu.FORWARD = flash_cpu.BACKWARD = None
        try:
            return f()
        finally:
            flash_cpu.FORWARD, flash_cpu.BACKWARD = saved
    return run


# ---------------------------------------------------------------------- memory
_MEM_CHILD = r"""
import json, math, resource, sys, time, torch
from meanfield.kernels import attend, choose
n, d, backward, masked = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
torch.manual_seed(0)
X = torch.randn(n, d, dtype=torch.float64)
lw = torch.full((n,), -math.log(n), dtype=torch.float64)
pos = torch.arange(1, n + 1, dtype=torch.float64) / n if masked else None
def peak_kib():
    # VmHWM belongs to this process image; ru_maxrss would carry over the parent's peak across exec
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
base = peak_kib()
t0 = time.perf_counter()
Xr = X.clone().requires_grad_(backward)
path = choose(Xr, Xr, Xr, lw, pos, pos)
out = attend(Xr, Xr, Xr, lw, pos, pos)  # auto dispatch
if backward:
    (g,) = torch.autograd.grad(out.square().sum(), Xr)
    assert torch.isfinite(g).all()
assert torch.isfinite(out).all()
peak = peak_kib()
print(json.dumps({"base_kib": base, "peak_kib": peak, "seconds": time.perf_counter() - t0, "path": path}))
"""


def memory(cases):
    print("\n## Peak memory of one weighted self-attention call (fresh subprocess, auto dispatch)\n")
    print(f"load before: `{load()}`\n")
    print("| N | d | mask | pass | path | peak RSS (MiB) | increase over start (MiB) | dense scores alone (GiB) | "
          "time (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, d, backward, masked in cases:
        r = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(n), str(d), "1" if backward else "0",
                            "1" if masked else "0"], capture_output=True, text=True, check=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"| {n} | {d} | {'causal' if masked else 'none'} | {'forward + VJP' if backward else 'forward'} | "
              f"{res['path']} | {res['peak_kib'] / 1024:.0f} | {(res['peak_kib'] - res['base_kib']) / 1024:.0f} | "
              f"{n * n * 8 / 2**30:.0f} | {res['seconds']:.1f} |", flush=True)


def lipschitz(n, d, tol):
    from meanfield import SelfAttention, local_lipschitz

    print(f"\n## Certified local Lipschitz constant, n = {n} tokens, d = {d} (Lanczos, tol = {tol:g})\n")
    print(f"load before: `{load()}`\n")
    print("| masked | value | error bound | iterations | time (s) |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, d, generator=g, dtype=DT)
    X = X / X.norm(dim=-1, keepdim=True)  # tokens on the unit sphere (LayerNorm-like)
    A = torch.randn(d, d, generator=g, dtype=DT) / d**0.5
    V = torch.randn(d, d, generator=g, dtype=DT) / d**0.5
    for masked in (False, True):
        att = SelfAttention(A, V, masked=masked)
        t0 = CLOCK()
        est = local_lipschitz(att, X, method="lanczos", tol=tol)
        dt = CLOCK() - t0
        print(f"| {masked} | {est.value:.8g} | {est.error:.2e} | {est.iterations} | {dt:.1f} |")


def main():
    global CLOCK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N up to 1e4, fewer cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true",
                    help="one thread, CPU time of the calling thread (robust to other processes)")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-lipschitz", action="store_true")
    a = ap.parse_args()
    if a.cpu_time:
        torch.set_num_threads(1)
        CLOCK = time.thread_time
    print(f"# bench_attention {' '.join(sys.argv[1:])}\n")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"torch threads, {os.cpu_count()} cores visible, clock {'thread CPU time' if a.cpu_time else 'wall'}, "
          f"repeats {a.repeats} (medians; 1 above N = 1e4)")
    masks = ("none", "causal", "weighted", "arbitrary")
    if a.quick:
        agreement(600, (3, 64))
        regime_map([100, 300, 1000, 3000, 10_000], (3, 64), masks, a.repeats)
        derivative_map([100, 1000, 4000], (3, 64), a.repeats)
        hardware(4096, a.repeats)
        if not a.skip_memory:
            memory([(20_000, 3, True, True), (50_000, 3, False, True)])
        if not a.skip_lipschitz:
            lipschitz(1024, 64, 1e-6)
    else:
        agreement(2000, (3, 64))
        regime_map([100, 300, 1000, 3000, 10_000, 30_000, 100_000], (3, 64), masks + ("weighted causal",),
                   a.repeats)
        derivative_map([100, 300, 1000, 3000, 10_000], (3, 64), a.repeats)
        hardware(10_000, a.repeats)
        if not a.skip_memory:
            memory([(50_000, 3, True, True), (200_000, 3, False, True), (100_000, 64, False, False)])
        if not a.skip_lipschitz:
            lipschitz(4096, 64, 1e-6)


if __name__ == "__main__":
    main()
