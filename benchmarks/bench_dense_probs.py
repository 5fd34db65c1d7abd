"""The dense attention path's probabilities: ``meanfield.kernels.attention_probs`` (torch's softmax, one
kernel, with rows that see no key set to zeros) against the formula it replaced on 2026-11-26 (the max-shifted
exponentials spelled out, about ten kernels), side by side in one run; and the whole dense call,
``attend(method="dense")``, which since then runs the plain softmax first and attention_probs's guard only
when the output is not finite (its output check included). The cost of a small call is what a GPU
call at N = 1e3 pays in launches; on CPU it is the per-op overhead.

    python benchmarks/bench_dense_probs.py [--sizes 8 64 1000] [--repeats 7] [--threads 1]

Candidates interleaved, medians reported; prints markdown and writes ``benchmarks/dense_probs.md``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meanfield.kernels import attend, attention_probs  # noqa: E402


def spelled_out(q, k, log_weights=None, q_pos=None, k_pos=None):
    """The previous formula (the baseline)."""
    scores = q @ k.transpose(-1, -2)
    if log_weights is not None:
        scores = scores + log_weights.unsqueeze(-2)
    if q_pos is not None:
        scores = scores.masked_fill(~(k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)), float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(scores - m)
    z = e.sum(dim=-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 1000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "dense_probs.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for n in a.sizes:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(n, 3, generator=g, dtype=torch.float64) for _ in range(3))
        lw = torch.log_softmax(torch.randn(n, generator=g, dtype=torch.float64), 0)
        pos = torch.arange(n, dtype=torch.float64)
        for mask, args in (("plain", (None, None, None)), ("weighted, causal", (lw, pos, pos))):
            qkv = (q, k, v)
            fns = {"attention_probs": lambda f=attention_probs, t=qkv, a=args: f(t[0], t[1], *a) @ t[2],
                   "spelled out (baseline)": lambda f=spelled_out, t=qkv, a=args: f(t[0], t[1], *a) @ t[2],
                   "attend, dense": lambda t=qkv, a=args: attend(*t, *a, method="dense")}
            diff = float((fns["attention_probs"]() - fns["spelled out (baseline)"]()).abs().max())
            same = bool(torch.equal(fns["attend, dense"](), fns["attention_probs"]()))
            calls = max(1, 20_000 // n)
            times = {name: [] for name in fns}
            for r in range(a.repeats):
                for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fns[name]()
                    times[name].append((time.perf_counter() - t0) / calls)
            new, old, call = (statistics.median(times[name]) for name in fns)
            rows.append(f"| {n} | {mask} | {new * 1e6:.1f} us | {old * 1e6:.1f} us | {old / new:.2f}x | {diff:.1e} | "
                        f"{call * 1e6:.1f} us | {same} |")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    text = "\n".join([
        "# Dense attention probabilities: torch's softmax vs the spelled-out formula", "",
        f"`python benchmarks/bench_dense_probs.py --sizes {' '.join(map(str, a.sizes))} --repeats {a.repeats} "
        f"--threads {a.threads}`; float64, d = 3, P @ v per call, {a.threads} thread(s) on CPU; load before: "
        f"`{load}`.", "",
        "P @ v by attention_probs and by the spelled-out formula, and a whole `attend(method=\"dense\")` call "
        "(checks and output check included; 'equal': bit for bit equal to attention_probs @ v).", "",
        "| N | mask | attention_probs | spelled out | speed-up | max difference | attend, dense | equal |",
        "|---|---|---|---|---|---|---|---|",
        *rows, ""])
    print(text)
    a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
