"""The sphere models' velocity fields side by side: ``IsotropicAttention("USA").evaluate`` (the unnormalized field,
which needs the rows' log-sums beside the softmax average) against ``IsotropicAttention("SA").evaluate`` (the
average alone), and against the way USA computed it before 2026-11-29 (the average from ``attend``, the log-sums
from a dense pass: ``meanfield.isotropic._row_logsumexp``), per mask.

    python benchmarks/bench_sphere_fields.py [--sizes 300 1000 3000] [--repeats 7] [--threads 1]

Tokens uniform on the sphere, d = 3, float64, beta = 1; masks: none, weights (uniform draws), a sequence's causal
mask, arbitrary positions (queries and keys at independent uniform positions: on the CPU ``auto`` takes the fused
kernel with an explicit mask from 2^16 to 2^22 score entries, where USA's one pass runs the streamed kernel).
Repeats interleaved, medians of wall time per call. Prints markdown.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meanfield import IsotropicAttention, kernels  # noqa: E402
from meanfield.isotropic import _row_logsumexp  # noqa: E402

MASKS = ("none", "weighted", "causal", "positions")


def inputs(n, mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    lw = torch.rand(n, generator=g, dtype=torch.float64).log() if mask == "weighted" else None
    if mask == "causal":
        qp = kp = torch.arange(n, dtype=torch.float64) / n
    elif mask == "positions":
        qp, kp = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    else:
        qp = kp = None
    return x, lw, qp, kp


def fields(sa, usa, x, lw, qp, kp):
    """The three candidates on one input: SA, USA, and USA as it was computed before (the average from ``attend``,
    then a dense pass of the rows' log-sums)."""
    def before():
        out = kernels.attend(x, x, x, lw, qp, kp)
        lse = _row_logsumexp(x, x, lw, qp, kp)
        if lw is None:
            lse = lse - math.log(x.shape[-2])
        return out * torch.exp(lse).unsqueeze(-1)

    return {"SA": lambda: sa.evaluate(x, x, lw, qp, kp), "USA": lambda: usa.evaluate(x, x, lw, qp, kp),
            "before": before}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[300, 1000, 3000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sa, usa = IsotropicAttention(1.0, "SA"), IsotropicAttention(1.0, "USA")
    print(f"sphere fields, d = 3, float64, torch {torch.__version__}, {a.threads} thread(s); median of {a.repeats}\n")
    print("| N | mask | SA's path | SA | USA | USA before | USA / SA | before / USA |")
    print("|---|---|---|---|---|---|---|---|")
    for n in a.sizes:
        for mask in MASKS:
            x, lw, qp, kp = inputs(n, mask)
            fns = fields(sa, usa, x, lw, qp, kp)
            err = (fns["USA"]() - fns["before"]()).abs().max().item()
            if not err <= 1e-10:
                raise SystemExit(f"USA differs from the way it was computed before by {err:.3g} at N = {n}, {mask}")
            loops = max(1, int(0.05 / max(1e-6, _once(fns["SA"]))))
            times = {k: [] for k in fns}
            for r in range(a.repeats):
                for k in (list(fns) if r % 2 == 0 else list(reversed(list(fns)))):
                    t0 = time.perf_counter()
                    for _ in range(loops):
                        fns[k]()
                    times[k].append((time.perf_counter() - t0) / loops)
            t = {k: statistics.median(v) for k, v in times.items()}
            print(f"| {n} | {mask} | {kernels.choose(x, x, x, lw, qp, kp)} | {t['SA'] * 1e3:.2f} ms | "
                  f"{t['USA'] * 1e3:.2f} ms | {t['before'] * 1e3:.2f} ms | {t['USA'] / t['SA']:.2f} | "
                  f"{t['before'] / t['USA']:.2f} |", flush=True)
    return 0


def _once(fn):
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
