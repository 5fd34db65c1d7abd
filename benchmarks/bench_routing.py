"""What ``auto`` spends deciding a path, without a GPU: :func:`meanfield.kernels.choose` on an accelerator's tensors
(meta tensors, with Triton taken to run there and a 40 GiB device budget, as the tests of the accelerator branch
do), against the same call on CPU tensors (the CPU's measured map), per call, on one thread.

    python benchmarks/bench_routing.py [--sizes 1000 10000 36000] [--repeats 15]

The accelerator's routing runs on the host before the kernels launch, so on a GPU it adds to every small call
(N = 1e3: naive dense attention takes 37-73 us on an H200). Inputs: d = 3 and d = 64 heads in float32, unweighted
and weighted (Gaussian rows over sqrt(d), log-weights of uniform weights: the CPU reads them where it weighs the
series); no positions (reading them is a host sync on a device, which meta tensors cannot stand for). Medians of the
calling thread's CPU time per call over interleaved repeats. Prints markdown.
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
from particles import device  # noqa: E402


def per_call(fn, target=0.05):
    """The calling thread's CPU seconds per call of ``fn`` over a loop of about ``target`` seconds."""
    fn()
    loops, t0 = 0, time.thread_time()
    while time.thread_time() - t0 < target:
        fn()
        loops += 1
    return (time.thread_time() - t0) / loops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 36_000])
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    device.triton_runs = lambda device_type: device_type != "cpu"
    device.memory_budget = lambda dev, limit=None, need=None: 40 * 2**30
    print("| N | d | weights | path (accelerator) | accelerator | path (CPU) | CPU | accelerator / CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for n in a.sizes:
        for d in (3, 64):
            for weighted in (False, True):
                cases = {}
                g = torch.Generator().manual_seed(0)
                real = [torch.randn(n, d, generator=g) / d ** 0.5 for _ in range(3)]
                real.append(torch.rand(n, generator=g).log())
                for where in ("meta", "cpu"):
                    args = [t.to(where) for t in real[:3 + weighted]]
                    cases[where] = (kernels.choose(*args), lambda args=args: kernels.choose(*args))
                times = {w: [] for w in cases}
                for r in range(a.repeats):
                    for w in (cases if r % 2 == 0 else reversed(list(cases))):
                        times[w].append(per_call(cases[w][1]))
                acc, cpu = (statistics.median(times[w]) * 1e6 for w in ("meta", "cpu"))
                print(f"| {n} | {d} | {'yes' if weighted else 'no'} | {cases['meta'][0]} | {acc:.1f} us | "
                      f"{cases['cpu'][0]} | {cpu:.1f} us | {acc / cpu:.2f} |", flush=True)


if __name__ == "__main__":
    main()
