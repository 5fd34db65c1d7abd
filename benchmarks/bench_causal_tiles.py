"""The streamed kernel's tile loops under a sequence's causal mask, in the layout they take on an accelerator
(row blocks against all keys: one key block per row block), with each row block's key range stopped at its
last row (what runs) against the whole key range (the baseline, the loops as they were before 2026-11-26),
side by side in one run.

    python benchmarks/bench_causal_tiles.py [--n 4096] [--d 64] [--repeats 5] [--device cpu|cuda]

On a GPU this is the path of the derivatives with heads wider than the Triton kernels take (d = 64: VJP
3.4x and JVP 5.1x SDPA's backward time at N = 1e5 on an H200 with the whole key range, benchmarks/gpu.md).
Candidates are interleaved (A, B, A, B, ...), medians reported; prints markdown and writes
``benchmarks/causal_tiles.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.autograd import forward_ad

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meanfield import attention_tiles  # noqa: E402
from meanfield import streamed_attention as streaming  # noqa: E402

TRIMMED = attention_tiles._keys


def whole_range(plan, block, i1):
    return block


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--block-rows", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "causal_tiles.md")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.n, a.d, generator=g).div_(a.d ** 0.5).to(device) for _ in range(3))
    pos = torch.arange(a.n, dtype=torch.float32, device=device)
    bs = (a.block_rows, a.n)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forward():
        return streaming.stream_attend(q, k, v, None, pos, pos, block_size=bs, engine="tiles")

    def vjp():
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = streaming.stream_attend(qq, kk, vv, None, pos, pos, block_size=bs, engine="tiles")
        return torch.autograd.grad(out, (qq, kk, vv), torch.ones_like(out))

    def jvp():
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(t, torch.ones_like(t)) for t in (q, k, v)]
            out = streaming.stream_attend(*duals, None, pos, pos, block_size=bs, engine="tiles")
            return forward_ad.unpack_dual(out).tangent

    rows = []
    for name, fn in (("forward", forward), ("VJP (dq, dk, dv)", vjp), ("JVP (all tangents)", jvp)):
        times = {"key range stopped at the diagonal": [], "whole key range (baseline)": []}
        impl = {"key range stopped at the diagonal": TRIMMED, "whole key range (baseline)": whole_range}
        outs = {}
        for label in times:  # warm-up, and the two must agree
            attention_tiles._keys = impl[label]
            outs[label] = fn()
        ref, got = outs["whole key range (baseline)"], outs["key range stopped at the diagonal"]
        ref, got = (ref if isinstance(ref, tuple) else (ref,)), (got if isinstance(got, tuple) else (got,))
        err = max(float((x - y).abs().max()) / max(1.0, float(y.abs().max())) for x, y in zip(got, ref))
        for r in range(a.repeats):
            for label in (list(times) if r % 2 == 0 else list(times)[::-1]):
                attention_tiles._keys = impl[label]
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[label].append(time.perf_counter() - t0)
        attention_tiles._keys = TRIMMED
        new, old = (statistics.median(times[k]) for k in times)
        rows.append(f"| {name} | {new * 1e3:.1f} ms | {old * 1e3:.1f} ms | {old / new:.2f}x | {err:.1e} |")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines = ["# Causal tile loops: key range stopped at the diagonal vs the whole key range", "",
             f"`python benchmarks/bench_causal_tiles.py --n {a.n} --d {a.d} --repeats {a.repeats} "
             f"--device {a.device}`; "
             f"N = {a.n}, d = {a.d}, float32, row blocks of {a.block_rows} against all keys (the accelerators' "
             f"layout), {torch.get_num_threads()} threads on {a.device}; load before: `{load}`.", "",
             "| pass | stopped at the diagonal | whole key range | speed-up | max relative difference |",
             "|---|---|---|---|---|", *rows, ""]
    text = "\n".join(lines)
    print(text)
    a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
