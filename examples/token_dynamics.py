"""Token dynamics of one attention layer: tokens as particles, and their clustering.

A residual stack of the same layer, x <- x + (1/L) Gamma_mu(x), is the Euler scheme of the particle
system x_i' = Gamma_{mu(t)}(x_i) (docs/math.md section 6). With V = I the tokens spread out like
exp(tV) x, so one looks at the rescaled tokens y = exp(-tV) x (``simulate(..., rescale=True)``):
Geshkovski, Letrouit, Polyanskiy and Rigollet (2023) prove that for V = I they converge to the
vertices of a convex polytope. The figure shows the rescaled trajectories, the number of clusters
over time (single linkage at distance ``tol``), and how tightly the tokens sit in their final
clusters (largest distance from a token to its cluster's center, on a log axis).

    python examples/token_dynamics.py [--out DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from meanfield import SelfAttention, simulate  # noqa: E402
from meanfield.clustering import cluster_centers, count_clusters, limit_set  # noqa: E402
from particles import Measure  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("SMOOTH_ATTENTION_EXAMPLES_OUT", "examples_output"),
                        help="folder for the figure (default: $SMOOTH_ATTENTION_EXAMPLES_OUT or examples_output)")
    parser.add_argument("--tiny", action="store_true",
                        default=os.environ.get("SMOOTH_ATTENTION_EXAMPLES_TINY", "") not in ("", "0"),
                        help="small sizes, for CI (also $SMOOTH_ATTENTION_EXAMPLES_TINY=1)")
    return parser.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    n, T, frames = (16, 6.0, 30) if args.tiny else (48, 12.0, 120)
    tol = 1e-2
    A = torch.tensor([[1.0, 0.3], [0.3, 0.6]], dtype=torch.float64)  # positive definite scores
    layer = SelfAttention(A, torch.eye(2, dtype=torch.float64))
    X0 = torch.randn(n, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    times = torch.linspace(0.0, T, frames + 1, dtype=torch.float64)
    traj = simulate(layer, Measure(X0), times, method="dopri5", rescale=True, rtol=1e-8, atol=1e-10)
    counts = count_clusters(traj, tol)
    final = limit_set(traj.final, tol)
    centers, _, labels = cluster_centers(traj.final, tol)
    Y = traj.points.numpy()
    spread = np.linalg.norm(Y - centers[labels][None], axis=2).max(axis=1)
    print(f"{n} tokens -> {final.n_clusters} clusters at t = {T:g}; every center a vertex of their hull: "
          f"{final.all_vertices}; largest distance to a center {spread[-1]:.1e}")

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(14, 4.5), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    for i in range(n):
        ax.plot(Y[:, i, 0], Y[:, i, 1], color="0.6", lw=0.7, zorder=1)
    ax.scatter(Y[0, :, 0], Y[0, :, 1], s=14, color="0.35", zorder=2, label="tokens at t = 0")
    vertices = final.centers[final.is_vertex]
    if len(vertices) > 2:  # the polytope, its vertices in angular order
        angle = np.arctan2(*(vertices - vertices.mean(0)).T[::-1])
        ring = vertices[np.r_[np.argsort(angle), np.argsort(angle)[:1]]]
        ax.plot(ring[:, 0], ring[:, 1], "-", color="tab:red", lw=1, alpha=0.6, zorder=2,
                label="convex hull of the clusters")
    ax.scatter(centers[:, 0], centers[:, 1], s=90, marker="*", color="tab:red", zorder=3,
               label=f"{final.n_clusters} clusters at t = {T:g}")
    ax.set_aspect("equal", adjustable="datalim")
    ax.set_xlabel("$y_1$")
    ax.set_ylabel("$y_2$")
    ax.set_title("rescaled tokens $y = e^{-tV} x$ ($V = I$)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False, fontsize=9)
    ax.grid(alpha=0.25)

    t = times.numpy()
    bx.step(t, counts, where="post", color="tab:blue")
    bx.set_xlabel("time $t$ (depth)")
    bx.set_ylabel(f"number of clusters (single linkage, tol = {tol:g})")
    bx.set_ylim(0, n + 2)
    bx.grid(alpha=0.3)
    bx.set_title(f"{n} tokens merge into {final.n_clusters} clusters")

    cx.semilogy(t, spread, color="tab:green")
    cx.set_xlabel("time $t$ (depth)")
    cx.set_ylabel("largest distance to the final cluster center")
    cx.grid(alpha=0.3, which="both")
    cx.set_title("the clusters shrink to points")
    fig.tight_layout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "token_dynamics.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
