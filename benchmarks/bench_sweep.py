"""Sweep scheduling overhead: the same grid of 200 Lipschitz tasks in-process, on a 2-process pool
and on a 2-worker Dask LocalCluster.

    python benchmarks/bench_sweep.py [--quick]

Each task draws a random A (scaled so that ||A|| = 1), a sequence X of n tokens in the ball of
radius R, and computes the local Lipschitz constant of SelfAttention(A, I) at X with
``meanfield.local_lipschitz`` (Lanczos, certified). Two grids:

* ``noop``: 200 tasks that return at once; wall time per task is pure scheduling + storage
  overhead (atomic, fsynced record per task), as a ratio to in-process (not run on the per-sweep
  LocalCluster, whose start-up would dominate).
* ``lipschitz``: the 200 real tasks; speed-up over in-process, and the scheduling overhead per
  task ``(wall * workers - time spent inside fn) / tasks`` (worker-seconds not spent computing:
  start-up, serialization, scheduling, storing records), as a ratio to in-process.

Pool and LocalCluster rows include starting the workers (and their first torch call); the
"client already up" row runs on a LocalCluster started and warmed beforehand: scheduling alone.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from studies.sweep import run_sweep  # noqa: E402


def noop(n, R, seed):
    return {"ok": 1}


def lipschitz_task(n, R, seed, d=4):
    """Local Lipschitz constant of SelfAttention(A, I) at a random sequence of radius R."""
    import torch

    g = torch.Generator().manual_seed(seed)
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    A = A / torch.linalg.matrix_norm(A, ord=2)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    X = R * X / X.norm(dim=1).max()
    try:
        from meanfield import SelfAttention, local_lipschitz
    except ImportError:  # before meanfield.lipschitz existed: dense Jacobian, top singular value
        def f(Y):
            return torch.softmax((Y @ A.T) @ Y.T, dim=-1) @ Y

        J = torch.autograd.functional.jacobian(f, X).reshape(n * d, n * d)
        return {"lip": float(torch.linalg.matrix_norm(J, ord=2)), "error": 0.0, "iterations": 0}
    est = local_lipschitz(SelfAttention(A, torch.eye(d, dtype=torch.float64)), X, tol=1e-8)
    return {"lip": est.value, "error": est.error, "iterations": est.iterations}


def grid(quick: bool) -> dict:
    ns = [4, 8, 12, 16] if quick else [8, 16, 32, 64]
    return {"n": ns, "R": [0.5, 1.0, 2.0, 4.0, 8.0], "seed": list(range(10))}   # 4 x 5 x 10 = 200


def timed(fn, g, out, **kw):
    t0 = time.perf_counter()
    res = run_sweep(fn, g, out, resume=False, progress=False, name=fn.__name__, **kw)
    wall = time.perf_counter() - t0
    res.raise_for_failures()
    return wall, res


def compute_s(res) -> float:
    """Seconds spent inside fn, summed over tasks (measured by the worker around the call)."""
    return sum(r["elapsed_s"] for r in res.records)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sequences (n <= 16), same 200 tasks")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)   # workers get one thread each; the in-process baseline too
    lipschitz_task(8, 1.0, 0)  # first torch.func call in this process, outside the timings
    g = grid(args.quick)
    n_tasks = 200
    rows, tables = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        configs = [("in-process", 1, {"backend": "inprocess"}),
                   ("process pool, 2 workers (started per sweep)", 2, {"backend": "processes", "n_workers": 2}),
                   ("dask LocalCluster, 2 workers (started per sweep)", 2, {"backend": "dask", "n_workers": 2})]
        for label, workers, kw in configs:
            # A LocalCluster per noop sweep would time cluster start-up twice; its noop row is the one below.
            t_noop = timed(noop, g, tmp / f"noop-{label}", **kw)[0] if kw["backend"] != "dask" else None
            t_lip, res = timed(lipschitz_task, g, tmp / f"lip-{label}", **kw)
            rows.append((label, workers, t_noop, t_lip, compute_s(res)))
            tables[label] = res.rows
        # the sweep's local cluster outlives it (shared by a process's sweeps since 2026-11-29): closed here, untimed,
        # so that its idle workers do not sit beside the warm cluster below
        from studies.sweep.backends import close_local_clusters

        close_local_clusters()
        import distributed

        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                      dashboard_address=None) as cl, distributed.Client(cl) as client:
            client.run(lipschitz_task, 8, 1.0, 0)   # warm the workers: scheduling alone is measured
            t_noop, _ = timed(noop, g, tmp / "noop-up", scheduler=client)
            t_lip, res = timed(lipschitz_task, g, tmp / "lip-up", scheduler=client)
            rows.append(("dask, client already up, 2 warm workers", 2, t_noop, t_lip, compute_s(res)))
            tables["up"] = res.rows
    same = all(t == tables["in-process"] for t in tables.values())
    base_noop = rows[0][2] / n_tasks
    base_lip, base_over = rows[0][3], (rows[0][3] - rows[0][4]) / n_tasks
    print(f"{n_tasks} tasks per sweep; sizes n in {g['n']}, d = 4; identical tables on every backend: {same}\n")
    print("| backend | noop ms/task | noop ratio | Lipschitz wall s | speed-up | compute s (sum in fn) "
          "| overhead ms/task | overhead ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for label, workers, t_noop, t_lip, t_fn in rows:
        over = (t_lip * workers - t_fn) / n_tasks   # worker-seconds per task not spent inside fn
        noop_cols = "- | -" if t_noop is None else f"{1e3 * t_noop / n_tasks:.2f} | {t_noop / n_tasks / base_noop:.1f}"
        print(f"| {label} | {noop_cols} | {t_lip:.1f} | {base_lip / t_lip:.2f} | {t_fn:.1f} | {1e3 * over:.1f} "
              f"| {over / base_over:.1f} |")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
