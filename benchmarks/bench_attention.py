"""Streaming vs dense attention: agreement, throughput, peak memory, FLOP rate, a certified Lipschitz constant.

    python benchmarks/bench_attention.py [--quick] [--skip-memory] [--skip-lipschitz]

Prints markdown tables. Every performance figure is a ratio against a baseline measured in the same
run (dense attention, or a large matrix product for the machine's own FLOP rate). Peak memory is the
peak RSS of a fresh subprocess (VmHWM, else resource.getrusage), minus that subprocess's RSS before the call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

from meanfield.kernels import attend

DT = torch.float64


def best_time(fn, repeat=3):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def self_attention(method, A, V, lw, pos, block=None):
    return lambda X: attend(X @ A.T, X, X @ V.T, lw, pos, pos, method=method, block_size=block)


def setup(n, d, masked, seed=0, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=dtype)
    A = torch.randn(d, d, generator=g, dtype=dtype) / d
    V = torch.randn(d, d, generator=g, dtype=dtype) / math.sqrt(d)
    lw = torch.log_softmax(torch.randn(n, generator=g, dtype=dtype), 0)
    pos = torch.arange(1, n + 1, dtype=dtype) / n if masked else None
    return X, A, V, lw, pos


def ops(f, X):
    U, W = torch.randn_like(X), torch.randn_like(X)
    return {
        "forward": lambda: f(X),
        "jvp": lambda: torch.func.jvp(f, (X,), (U,))[1],
        "vjp": lambda: torch.func.vjp(f, X)[1](W)[0],
    }


def agreement(sizes):
    print("\n## Streaming vs dense: max |difference| (float64, weighted, block 256)\n")
    print("| n | d | masked | forward | JVP | VJP |")
    print("|---|---|---|---|---|---|")
    for n, d in sizes:
        for masked in (False, True):
            X, A, V, lw, pos = setup(n, d, masked)
            res = {}
            for method in ("dense", "stream"):
                torch.manual_seed(1)
                f = self_attention(method, A, V, lw, pos, 256)
                res[method] = {k: fn() for k, fn in ops(f, X).items()}
            errs = [(res["stream"][k] - res["dense"][k]).abs().max().item() for k in ("forward", "jvp", "vjp")]
            print(f"| {n} | {d} | {masked} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")


def throughput(sizes, repeat):
    print("\n## Throughput: time(dense) / time(stream), best of", repeat, "(> 1: streaming faster)\n")
    print("| n | d | masked | forward | JVP | VJP | dense forward (s) |")
    print("|---|---|---|---|---|---|---|")
    for n, d in sizes:
        for masked in (False, True):
            X, A, V, lw, pos = setup(n, d, masked)
            times = {}
            for method in ("dense", "stream"):
                f = self_attention(method, A, V, lw, pos)
                times[method] = {k: best_time(fn, repeat) for k, fn in ops(f, X).items()}
            ratios = [times["dense"][k] / times["stream"][k] for k in ("forward", "jvp", "vjp")]
            print(f"| {n} | {d} | {masked} | " + " | ".join(f"{r:.2f}" for r in ratios)
                  + f" | {times['dense']['forward']:.3f} |")


def block_sweep(n, d, repeat):
    print(f"\n## Block size (n = {n}, d = {d}, unmasked forward): time relative to block 512\n")
    X, A, V, lw, _ = setup(n, d, False)
    times = {b: best_time(lambda b=b: self_attention("stream", A, V, lw, None, b)(X), repeat)
             for b in (128, 256, 512, 1024, 2048)}
    print("| block | " + " | ".join(str(b) for b in times) + " |")
    print("|---|" + "---|" * len(times))
    print("| time / time(512) | " + " | ".join(f"{t / times[512]:.2f}" for t in times.values()) + " |")


_MEM_CHILD = r"""
import json, math, resource, sys, time, torch
from meanfield.kernels import attend
n, d, backward = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
torch.manual_seed(0)
X = torch.randn(n, d, dtype=torch.float64)
lw = torch.full((n,), -math.log(n), dtype=torch.float64)
pos = torch.arange(1, n + 1, dtype=torch.float64) / n
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
out = attend(Xr, Xr, Xr, lw, pos, pos)  # auto dispatch: streams at this size
if backward:
    (g,) = torch.autograd.grad(out.square().sum(), Xr)
    assert torch.isfinite(g).all()
assert torch.isfinite(out).all()
peak = peak_kib()
print(json.dumps({"base_kib": base, "peak_kib": peak, "seconds": time.perf_counter() - t0}))
"""


def memory(cases):
    print("\n## Peak memory of one masked, weighted self-attention call (subprocess, auto dispatch)\n")
    print("| n | d | pass | peak RSS (MiB) | increase over start (MiB) | dense score matrix alone (GiB) | time (s) |")
    print("|---|---|---|---|---|---|---|")
    for n, d, backward in cases:
        r = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(n), str(d), "1" if backward else "0"],
                           capture_output=True, text=True, check=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        dense_gib = n * n * 8 / 2**30
        print(f"| {n} | {d} | {'forward + VJP' if backward else 'forward'} | {res['peak_kib'] / 1024:.0f} | "
              f"{(res['peak_kib'] - res['base_kib']) / 1024:.0f} | {dense_gib:.0f} | {res['seconds']:.1f} |")


def flop_rate(n, d, repeat):
    print(f"\n## Forward FLOP rate vs the machine's matrix product (n = {n}, d = {d}, unmasked, unweighted)\n")
    print("Attention forward counted as 4 n^2 d flops (Q K^T and P V); the exponentials are not counted.\n")
    print("| dtype | matmul GFLOP/s | stream GFLOP/s | fraction | tile: QK^T | exp+max | PV | total / tiles |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float64, torch.float32):
        _flop_row(n, d, dtype, repeat)


def _flop_row(n, d, dtype, repeat):
    g = torch.Generator().manual_seed(0)
    big = 4096
    M1, M2 = (torch.randn(big, big, generator=g, dtype=dtype) for _ in range(2))
    mm_rate = 2 * big**3 / best_time(lambda: M1 @ M2, repeat) / 1e9
    X = torch.randn(n, d, generator=g, dtype=dtype) / d**0.5
    t_att = best_time(lambda: attend(X, X, X, method="stream"), repeat)
    att_rate = 4 * n * n * d / t_att / 1e9
    # where the time goes: the ops of one 512 x 512 tile, timed back to back (robust to load drift)
    b = 512
    q, k, v = X[:b], X[:b], X[:b]
    s = q @ k.T
    p = torch.exp(s - s.amax(-1, keepdim=True))
    t_qk = best_time(lambda: q @ k.T, 5)
    t_exp = best_time(lambda: torch.exp(s - s.amax(-1, keepdim=True)), 5)
    t_pv = best_time(lambda: p @ v, 5)
    t_tile = t_qk + t_exp + t_pv
    loop = t_att / ((n / b) ** 2 * t_tile)  # > 1: time outside these three ops (bookkeeping, Python)
    print(f"| {str(dtype).split('.')[-1]} | {mm_rate:.1f} | {att_rate:.1f} | {att_rate / mm_rate:.2f} | "
          + " | ".join(f"{x / t_tile:.2f}" for x in (t_qk, t_exp, t_pv)) + f" | {loop:.2f} |")


def lipschitz(n, d, tol):
    from meanfield import SelfAttention, local_lipschitz

    print(f"\n## Certified local Lipschitz constant, n = {n} tokens, d = {d} (Lanczos, tol = {tol:g})\n")
    print("| masked | value | error bound | iterations | time (s) | kernel path |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, d, generator=g, dtype=DT)
    X = X / X.norm(dim=-1, keepdim=True)  # tokens on the unit sphere (LayerNorm-like)
    A = torch.randn(d, d, generator=g, dtype=DT) / d**0.5
    V = torch.randn(d, d, generator=g, dtype=DT) / d**0.5
    for masked in (False, True):
        att = SelfAttention(A, V, masked=masked)
        t0 = time.perf_counter()
        est = local_lipschitz(att, X, method="lanczos", tol=tol)
        dt = time.perf_counter() - t0
        path = "stream" if n * n > 2**22 else "dense"
        print(f"| {masked} | {est.value:.8g} | {est.error:.2e} | {est.iterations} | {dt:.1f} | {path} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, under ~3 minutes")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-lipschitz", action="store_true")
    a = ap.parse_args()
    print(f"# bench_attention {'--quick' if a.quick else ''}\n")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cores visible; shared machine: ratios only.")
    if a.quick:
        agreement([(1000, 3), (700, 64)])
        throughput([(1024, 3), (2048, 3), (2048, 64)], 3)
        block_sweep(4096, 3, 2)
        flop_rate(4096, 64, 2)
        if not a.skip_memory:
            memory([(20_000, 3, False)])
        if not a.skip_lipschitz:
            lipschitz(1024, 64, 1e-6)
    else:
        agreement([(2000, 3), (2000, 64)])
        throughput([(1024, 3), (2048, 3), (4096, 3), (2048, 64), (4096, 64)], 3)
        block_sweep(8192, 3, 3)
        flop_rate(10_000, 64, 3)
        if not a.skip_memory:
            memory([(50_000, 3, True), (200_000, 3, False)])
        if not a.skip_lipschitz:
            lipschitz(4096, 64, 1e-6)


if __name__ == "__main__":
    main()
