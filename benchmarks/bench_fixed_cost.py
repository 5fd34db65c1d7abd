"""What an attention call costs besides its arithmetic, on small inputs: meanfield.kernels.attend (auto, its output
checked), the same call inside particles.validation.output_checks_deferred (simulate's fixed steps), and the
guarded formula that deferred calls took before (attention_probs's guard of rows that see no key), against naive
dense attention (torch: scores, mask, softmax, product; no checks), per call; and the dense path with checks
deferred against the guarded formula it took before (same path, the columns "before / now").

    python benchmarks/bench_fixed_cost.py [--sizes 8 64 256] [--repeats 21] [--device cpu|cuda]
    python benchmarks/bench_fixed_cost.py --ops [--sizes 1000]

``--ops`` counts instead the operations each candidate dispatches per call (torch's dispatcher, views and the
detaching of tensors left out; ``_local_scalar_dense`` is the host sync of reading a number): on a GPU each of the
others is a kernel launch, most of a small call's cost there (N = 1e3), and the count is the same on any device.

Self-attention inputs q = X A^T, k = X, v = X V^T in float32, d = 3, unweighted, weighted, a sequence's causal
mask and arbitrary positions (half the queries then see no key). Each candidate runs a loop of calls (enough for
about 0.1 s), repeats interleaved in alternating order; medians of the calling thread's CPU time per call on the
CPU (other jobs inflate it less than wall time), wall time synchronized after each loop on CUDA. Prints markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu import attention_inputs, naive  # noqa: E402

from meanfield import kernels  # noqa: E402
from particles.validation import output_checks_deferred  # noqa: E402

MASKS = ("none", "weighted", "causal", "positions")


def candidates(args):
    def checked():
        return kernels.attend(*args)

    def deferred():
        with output_checks_deferred():
            return kernels.attend(*args)

    def dense_deferred():
        with output_checks_deferred():
            return kernels.attend(*args, method="dense")

    def guarded():
        # the same deferred dense call as it was: _plain_first's branch for deferred checks skipped (it runs only
        # where no derivatives are needed), so the guarded formula (attention_probs) computes every row
        real = kernels.needs_derivatives
        kernels.needs_derivatives = lambda *a: True
        try:
            with output_checks_deferred():
                return kernels.attend(*args, method="dense")
        finally:
            kernels.needs_derivatives = real

    return {"ours (auto)": checked, "ours, checks deferred": deferred, "dense, deferred": dense_deferred,
            "dense, deferred, guarded formula (before)": guarded, "naive dense": lambda: naive(*args)}


#: operations that launch nothing on a device: views, detaching, scalars wrapped for an operation
_NO_LAUNCH = {"transpose", "t", "permute", "unsqueeze", "view", "expand", "detach", "alias", "slice", "select",
              "as_strided", "scalar_tensor", "promote_types", "_reshape_alias", "reshape"}


def count_ops(fn):
    """The operations ``fn()`` dispatches that launch a kernel on a device (:data:`_NO_LAUNCH` left out), in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in _NO_LAUNCH:
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    fn()
    with Count() as c:
        fn()
    return c.ops


def print_ops(sizes, device):
    """Per call: ``auto`` here, the dense path checked and with checks deferred (what ``auto`` takes on a GPU up to
    2^21 score entries, N = 1e3 included), naive dense; and the dense path's checked operations."""
    print("| N | mask | auto's path here | ours (auto) | dense path | dense path, checks deferred | naive dense "
          "| dense path, its operations |")
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for mask in MASKS:
            args = attention_inputs(n, 3, mask, device)
            fns = candidates(args)
            fns["dense"] = lambda args=args: kernels.attend(*args, method="dense")
            ops = {name: count_ops(fns[name]) for name in ("ours (auto)", "dense", "dense, deferred", "naive dense")}
            print(f"| {n} | {mask} | {kernels.choose(*args)} | {len(ops['ours (auto)'])} | {len(ops['dense'])} | "
                  f"{len(ops['dense, deferred'])} | {len(ops['naive dense'])} | {', '.join(ops['dense'])} |",
                  flush=True)


def measure(fns, device, repeats):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    for fn in fns.values():   # warm-up; the loop length: about 0.1 s of naive dense
        fn()
    sync()
    t0 = clock()
    fns["naive dense"]()
    sync()
    loop = max(10, min(20_000, int(0.1 / max(clock() - t0, 1e-6))))
    times = {name: [] for name in fns}
    for r in range(repeats):
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            sync()
            t0 = clock()
            for _ in range(loop):
                fn()
            sync()
            times[name].append((clock() - t0) / loop)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ops", action="store_true", help="count the operations of a call instead of timing it")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if a.ops:
        print_ops(a.sizes, device)
        return 0
    if device.type == "cpu":
        torch.set_num_threads(1)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"# Fixed cost of an attention call ({device.type}, torch {torch.__version__}, load {' '.join(load)})\n")
    print("| N | mask | auto's path | ours (auto) | checks deferred | naive dense | naive / ours "
          "| naive / deferred | dense path, deferred | the same, guarded formula (before) | before / now |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in a.sizes:
        for mask in MASKS:
            args = attention_inputs(n, 3, mask, device)
            fns = candidates(args)
            got = {name: fn() for name, fn in fns.items() if name != "naive dense"}
            ref = got["dense, deferred, guarded formula (before)"]
            for name, out in got.items():
                if not torch.allclose(out, ref, rtol=1e-5, atol=1e-6):
                    raise SystemExit(f"{name} differs from the guarded formula at N = {n}, {mask}")
            t = measure(fns, device, a.repeats)
            us = {k: f"{v * 1e6:.1f} us" for k, v in t.items()}
            before = t["dense, deferred, guarded formula (before)"]
            print(f"| {n} | {mask} | {kernels.choose(*args)} | {us['ours (auto)']} | {us['ours, checks deferred']} "
                  f"| {us['naive dense']} | {t['naive dense'] / t['ours (auto)']:.2f} "
                  f"| {t['naive dense'] / t['ours, checks deferred']:.2f} | {us['dense, deferred']} "
                  f"| {us['dense, deferred, guarded formula (before)']} | {before / t['dense, deferred']:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
