"""The thread policy (particles/threads.py) against one thread and torch's default, idle and busy.

Each workload runs under three settings, interleaved (A, B, C, B, C, A, ...) and timed by wall clock:

* ``policy``: the framework's choice (``set_threads(None)``);
* ``1 thread``: ``set_threads(1)``;
* ``torch default``: ``set_threads(<torch's default thread count>)``;

first on the machine as it is ("idle" when nothing else runs), then with ``--busy K`` extra
processes spinning on the cores (``while True: pass``), the situation of a shared workstation.
The ratios it prints are the issue's targets: on a busy machine policy / 1 thread must stay below
2; where threads help on an idle machine, policy / torch default must stay below 1.1.

    python benchmarks/bench_threads.py                  # idle, then busy with as many spinners as cores
    python benchmarks/bench_threads.py --quick --busy 2 # smaller workloads
    python benchmarks/bench_threads.py --write          # also writes benchmarks/threads.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import particles.threads as th  # noqa: E402
from meanfield import MultiHeadAttention, SelfAttention, kernels, local_lipschitz, simulate  # noqa: E402
from particles import Measure  # noqa: E402

DEFAULT = torch.get_num_threads()


def load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


def gpt2_layer(dtype, d=768, H=12, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: (0.02 * torch.randn(*s, generator=g, dtype=torch.float64)).to(dtype)
    heads = [SelfAttention.from_qkv(w(k, d), w(k, d), w(k, d)) for _ in range(H)]
    return MultiHeadAttention(heads, w(d, H * k))


def workloads(quick: bool):
    """(name, callable) pairs: certified constants of small and large operators, Sinkhorn, dynamics."""
    from transport import solve

    small = SelfAttention(np.eye(3) * 0.5, np.eye(3))
    X512 = Measure.sphere(512, 3, 2.0, seed=0).points
    layer32 = gpt2_layer(torch.float32)
    Xl = torch.randn(64 if quick else 128, 768, generator=torch.Generator().manual_seed(1))
    N = 1500 if quick else 4000
    mu, nu = Measure.sphere(N, 3, 1.0, seed=1), Measure.sphere(N, 3, 1.0, seed=2)
    cloud = Measure.sphere(2000 if quick else 8000, 3, 1.0, seed=3)
    op3 = SelfAttention(np.eye(3), np.eye(3))
    n = 4000 if quick else 8000
    Xa = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    Aa = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 0.5

    def attend_and_vjp():   # one pass and its VJP, called directly (no entry point around them)
        Y = Xa.clone().requires_grad_()
        kernels.attend(Y @ Aa.T, Y, Y).sum().backward()

    return [
        ("local_lipschitz, SelfAttention n=512 d=3 (small products)", lambda: local_lipschitz(small, X512)),
        (f"local_lipschitz, GPT-2-sized layer float32, n={Xl.shape[0]}", lambda: local_lipschitz(layer32, Xl)),
        (f"transport.solve streaming, N={N} d=3, reg=0.1", lambda: solve(mu, nu, method="streaming", reg=0.1)),
        (f"simulate rk4, N={cloud.n} d=3, 5 steps", lambda: simulate(op3, cloud, [0.0, 0.5], options={"steps": 5})),
        (f"attend forward + VJP, N={n} d=3 float64 (a direct call)", attend_and_vjp),
    ]


def spinners(k: int):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def measure(fn, repeats: int) -> dict:
    settings = {"policy": None, "1 thread": 1, "torch default": DEFAULT}
    names = list(settings)
    times = {n: [] for n in names}
    th.set_threads(None)
    fn()  # warm-up (first-call costs out of the figures)
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            th.set_threads(settings[name])
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    th.set_threads(None)
    return {n: statistics.median(v) for n, v in times.items()}


def table(rows, title: str, busy: int) -> str:
    out = [f"### {title}", "", f"load: `{load()}`; torch default threads: {DEFAULT}"
           + (f"; {busy} spinning processes started by the benchmark" if busy else ""), "",
           "| workload | policy | 1 thread | torch default | policy / 1 thread | policy / default |",
           "|---|---|---|---|---|---|"]
    for name, t in rows:
        out.append(f"| {name} | {t['policy']:.3f} s | {t['1 thread']:.3f} s | {t['torch default']:.3f} s | "
                   f"{t['policy'] / t['1 thread']:.2f} | {t['policy'] / t['torch default']:.2f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes for the busy part")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="+", metavar="WORD", help="only the workloads whose name holds one of these")
    ap.add_argument("--skip-idle", action="store_true", help="leave out the machine-as-it-is part")
    ap.add_argument("--skip-busy", action="store_true", help="leave out the part with spinning processes")
    ap.add_argument("--write", action="store_true", help="write benchmarks/threads.md")
    ap.add_argument("--append", action="store_true", help="with --write: add the tables to benchmarks/threads.md")
    args = ap.parse_args(argv)
    work = workloads(args.quick)
    if args.only:
        work = [(name, fn) for name, fn in work if any(w in name for w in args.only)]
    sections = []
    if not args.skip_idle:
        rows = [(name, measure(fn, args.repeats)) for name, fn in work]
        one_min = os.getloadavg()[0]
        sections.append(table(rows, "As the machine is: " + ("idle" if one_min < 0.5 else
                                                            f"other jobs running (load {one_min:.1f})"), 0))
        print(sections[-1], "\n", flush=True)
    if not args.skip_busy:
        procs = spinners(args.busy)
        try:
            time.sleep(1.0)
            rows = [(name, measure(fn, args.repeats)) for name, fn in work]
        finally:
            for p in procs:
                p.kill()
        sections.append(table(rows, f"Busy: {args.busy} other processes spinning", args.busy))
        print(sections[-1], flush=True)
    if args.write:
        cmd = "python benchmarks/bench_threads.py " + " ".join(argv if argv is not None else sys.argv[1:])
        head = ["# Thread policy", "", f"Command: `{cmd.strip()}`; {torch.__version__}, "
                f"{os.cpu_count()} cores.", ""]
        out = ROOT / "benchmarks" / "threads.md"
        text = "\n".join(head) + "\n\n".join(sections) + "\n"
        if args.append and out.exists():
            text = out.read_text() + "\n" + f"Command: `{cmd.strip()}`\n\n" + "\n\n".join(sections) + "\n"
        out.write_text(text)


if __name__ == "__main__":
    main()
