"""Lanczos vs power iteration vs dense for the local Lipschitz constant of a GPT-2-sized layer.

    python benchmarks/bench_lipschitz.py [--quick] [--device cpu|cuda]

Layer: multi-head attention, d = 768, 12 heads of size 64, weights N(0, 0.02^2) as in GPT-2's
initialization, output projection W_O (768 x 768) scaled the same way; tokens x_i ~ N(0, I)
(what a LayerNorm outputs, |x_i| ~ sqrt(768)). float64.

Reported per sequence length n:
* reference: Lanczos at tol 1e-12 (checked against the dense Jacobian at n = 4 without --quick);
* lanczos and power at tol = 1e-6 (certified stop: residual bound on the relative error);
* power (oracle): the first power iteration whose value is within 1e-6 of the reference,
  i.e. the best any stopping rule could do (the paper's rule stops on the change of the value);
* applications (J u and J^T w products), wall time, reached relative error.
Batched: 10 sequences in one call vs 10 calls (Lanczos, tol 1e-6).
"""

from __future__ import annotations

import argparse
import time

import torch

from meanfield import MultiHeadAttention, SelfAttention, local_lipschitz
from meanfield.lipschitz import _Problem, _random_start

D, H, K = 768, 12, 64


def gpt2_layer(seed, device, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: (0.02 * torch.randn(*s, generator=g, dtype=dtype)).to(device)
    heads = [SelfAttention.from_qkv(w(K, D), w(K, D), w(K, D)) for _ in range(H)]
    return MultiHeadAttention(heads, w(D, H * K))


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def power_oracle(op, X, ref, rtol, max_iter):
    """Power iteration on J^T J, stopped as soon as |value - ref| <= rtol * ref (needs ref)."""
    pos = None
    p = _Problem(lambda Y: op._forward(Y, None, pos), X.unsqueeze(0))
    u = _random_start(p.X.shape, p.X, 0)
    t = time.perf_counter()
    for it in range(1, max_iter + 1):
        w = p.J(u)
        value = float(w.norm())
        if abs(value - ref) <= rtol * ref:
            return it, p.applications, time.perf_counter() - t, abs(value - ref) / ref
        z = p.JT(w)
        u = z / z.norm()
    return None, p.applications, time.perf_counter() - t, abs(value - ref) / ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    ns = [16, 64] if args.quick else [16, 64, 128, 256]
    rtol = 1e-6
    op = gpt2_layer(0, device)
    torch.manual_seed(0)

    print(f"GPT-2-sized layer: d = {D}, {H} heads, float64, device {device}; target relative accuracy {rtol:g}\n")
    if not args.quick:
        # dense ground truth on a small sequence validates the reference estimator (slow: 3072 VJPs)
        Xs = torch.randn(4, D, dtype=torch.float64, device=device)
        dense, t_dense = timed(lambda: local_lipschitz(op, Xs, method="dense"))
        lz, _ = timed(lambda: local_lipschitz(op, Xs, tol=1e-12))
        print(f"check n = 4: dense {dense.value:.12g} ({t_dense:.2f} s), lanczos(1e-12) {lz.value:.12g}, "
              f"relative difference {abs(lz.value - dense.value) / dense.value:.1e}\n")

    print("| n | reference Lip | method | applications | time (s) | relative error | "
          "apps vs power-oracle | time vs power-oracle |")
    print("|---|---|---|---|---|---|---|---|")
    for n in ns:
        X = torch.randn(n, D, dtype=torch.float64, device=device)
        ref = local_lipschitz(op, X, tol=1e-12).value
        rows = []
        lz, t_lz = timed(lambda X=X: local_lipschitz(op, X, tol=rtol))
        rows.append(("lanczos (tol 1e-6)", lz.applications, t_lz, abs(lz.value - ref) / ref))
        pw, t_pw = timed(lambda X=X: local_lipschitz(op, X, method="power", tol=rtol, max_iter=3000,
                                                     on_failure="warn"))
        rows.append(("power (tol 1e-6, certified)", pw.applications, t_pw, abs(pw.value - ref) / ref))
        it, apps, t_or, err = power_oracle(op, X, ref, rtol, 3000)
        rows.append(("power (oracle stop)", apps, t_or, err))
        for name, a, t, e in rows:
            print(f"| {n} | {ref:.8g} | {name} | {a} | {t:.3f} | {e:.1e} | {apps / a:.1f}x | {t_or / t:.1f}x |")

    # batched throughput
    n, b = (16 if args.quick else 64), 10
    Xb = torch.randn(b, n, D, dtype=torch.float64, device=device)
    batch, t_batch = timed(lambda: local_lipschitz(op, Xb, tol=rtol))
    singles, t_single = timed(lambda: [local_lipschitz(op, Xb[i], tol=rtol) for i in range(b)])
    worst = max(abs(a.value - s.value) / s.value for a, s in zip(batch, singles))
    print(f"\nBatched, {b} sequences of n = {n}: one call {t_batch:.2f} s, {b} calls {t_single:.2f} s, "
          f"throughput ratio {t_single / t_batch:.1f}x (max relative difference {worst:.1e})")


if __name__ == "__main__":
    main()
