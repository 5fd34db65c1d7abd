"""Benchmark: cost of one RK4 step of ``meanfield.simulate`` against one attention evaluation.

    python benchmarks/bench_dynamics.py [--quick] [--sizes 1000 3000 ...] [--threads 1]

For N particles in d = 3 (a SelfAttention with random A, V), it times, in the same run:

* ``attention``: one velocity evaluation Gamma_mu(x_i) for all particles (``op.velocity(mu, X)``);
* ``rk4 step``: one step of ``simulate(op, mu, [0, h], method="rk4", options={"steps": 1})`` (4 evaluations);
* ``torchdiffeq rk4``: the same step through ``torchdiffeq.odeint(method="rk4")`` on the same field;
* ``loop``: the straightforward reference, one RK4 step with a Python loop over particles
  (Gamma(x_i) = softmax_j(<A x_i, x_j> + log a_j) V x_j one query at a time), small N only.

and prints ratios (rk4 step / attention: the target is about 4, i.e. no overhead beyond the four
stages; loop / rk4 step: the speed-up of the vectorized solver). Medians of a few repeats.
Large N goes through the streaming kernel (meanfield.kernels.attend dispatches automatically).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meanfield import SelfAttention, simulate  # noqa: E402
from particles import Measure  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _loop_rk4(A, V, X, lw, h):
    def field(Y):
        out = torch.empty_like(Y)
        for i in range(Y.shape[0]):
            p = torch.softmax(Y @ (A @ Y[i]) + lw, dim=0)
            out[i] = V @ (p @ Y)
        return out

    k1 = field(X)
    k2 = field(X + h / 2 * k1)
    k3 = field(X + h / 2 * k2)
    k4 = field(X + h * k3)
    return X + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def _one_size(op, A, V, X, h, repeats, loop_max) -> dict:
    from torchdiffeq import odeint

    n = X.shape[0]
    mu = Measure(X)
    t_att = _median_time(lambda: op.velocity(mu, X), repeats)
    t_rk4 = _median_time(lambda: simulate(op, mu, [0.0, h], method="rk4", options={"steps": 1}), repeats)
    grid = torch.tensor([0.0, h], dtype=torch.float64)
    t_tde = _median_time(lambda: odeint(lambda t, Y: op.velocity(mu.with_points(Y), Y), X, grid, method="rk4",
                                        options={"step_size": h}), repeats)
    row = {"N": n, "attention_s": t_att, "rk4_step_s": t_rk4, "torchdiffeq_rk4_s": t_tde}
    if n <= loop_max:
        row["loop_s"] = _median_time(lambda: _loop_rk4(A, V, X, mu.log_weights, h), 1)
        # same numbers as the reference loop: the benchmark compares like with like
        ref = _loop_rk4(A, V, X, mu.log_weights, h)
        ours = simulate(op, mu, [0.0, h], method="rk4", options={"steps": 1}).final.points
        assert torch.allclose(ours, ref, atol=1e-12), "the RK4 step differs from the reference loop"
    return row


def run(sizes, d: int, repeats: int, loop_max: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    A = 0.5 * torch.randn(d, d, generator=g, dtype=torch.float64)
    V = 0.5 * torch.randn(d, d, generator=g, dtype=torch.float64)
    op = SelfAttention(A, V)
    h = 0.05
    rows = []
    for n in sizes:
        rows.append(_one_size(op, A, V, torch.randn(n, d, generator=g, dtype=torch.float64), h, repeats, loop_max))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 1e3, 3e3, 1e4 (under ~2 minutes)")
    ap.add_argument("--sizes", type=int, nargs="*", help="particle counts (default: 1e3 .. 1e5)")
    ap.add_argument("--dim", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--loop-max", type=int, default=3000, help="largest N for the Python-loop reference")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes or ([1000, 3000, 10000] if args.quick else [1000, 3000, 10000, 30000, 100000])
    repeats = args.repeats or (3 if args.quick else 3)
    rows = run(sizes, args.dim, repeats, args.loop_max)
    print(f"token dynamics, d = {args.dim}, float64, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"median of {repeats}")
    print()
    print("| N | attention (s) | RK4 step (s) | RK4 / attention | torchdiffeq rk4 / ours | Python loop / ours |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        loop = f"{r['loop_s'] / r['rk4_step_s']:.2g}x" if "loop_s" in r else "-"
        print(f"| {r['N']} | {r['attention_s']:.3g} | {r['rk4_step_s']:.3g} | "
              f"{r['rk4_step_s'] / r['attention_s']:.2f} | {r['torchdiffeq_rk4_s'] / r['rk4_step_s']:.2f} | {loop} |")


if __name__ == "__main__":
    main()
