"""Mean-field attention on a weighted measure: the pushforward F(mu) = (Gamma_mu)_# mu, layer after layer.

A weighted particle cloud mu_0 (three Gaussian blobs of masses 0.6, 0.3, 0.1, each atom with its own
weight) goes through L layers of the same self-attention, mu_{l+1} = F(mu_l) (docs/math.md section
2). The weights travel with the atoms; attention reads them as additive log-weights in its softmax,
so a heavy atom pulls harder than a light one. The figure shows the measures and the exact W2
distance (POT's network simplex) between consecutive layers and from the start. Two measure-level
facts are checked on the way: splitting an atom in two (the same measure, written with one more
atom) changes neither F(mu) nor any W2, and the same measure with shuffled atoms gives the same
result.

    python examples/measure_pushforward.py [--out DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from meanfield import SelfAttention  # noqa: E402
from particles import Measure  # noqa: E402
from transport import w2  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("SMOOTH_ATTENTION_EXAMPLES_OUT", "examples_output"),
                        help="folder for the figure (default: $SMOOTH_ATTENTION_EXAMPLES_OUT or examples_output)")
    parser.add_argument("--tiny", action="store_true",
                        default=os.environ.get("SMOOTH_ATTENTION_EXAMPLES_TINY", "") not in ("", "0"),
                        help="small sizes, for CI (also $SMOOTH_ATTENTION_EXAMPLES_TINY=1)")
    return parser.parse_args(argv)


def blobs(n: int, seed: int = 0) -> Measure:
    """Three Gaussian blobs of masses 0.6 / 0.3 / 0.1, with random per-atom weights inside each."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[-2.0, 0.0], [1.5, 1.5], [1.0, -2.0]], dtype=torch.float64)
    mass = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    label = torch.arange(n) % 3
    X = centers[label] + 0.45 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    w = (0.5 + torch.rand(n, generator=g, dtype=torch.float64))
    for k in range(3):  # each blob carries its mass, whatever its number of atoms
        w[label == k] *= mass[k] / w[label == k].sum()
    return Measure(X, w, normalize=True)


def main(argv=None) -> Path:
    args = parse_args(argv)
    n, layers = (90, 3) if args.tiny else (900, 6)
    torch.manual_seed(0)

    theta = 0.6  # A is a scaled rotation: scores <A x_i, x_j> mix the two coordinates
    A = 0.8 * torch.tensor([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]],
                           dtype=torch.float64)
    att = SelfAttention(A, torch.eye(2, dtype=torch.float64))

    measures = [blobs(n)]
    for _ in range(layers):
        measures.append(att(measures[-1]))
    step = [w2(measures[k], measures[k + 1]) for k in range(layers)]
    total = [w2(measures[0], measures[k]) for k in range(layers + 1)]

    # measure-level facts: a split atom or a permutation is the same measure, with the same image
    mu = measures[0]
    split = mu.split(0, 0.3)
    perm = torch.randperm(mu.n)
    shuffled = Measure(mu.points[perm], mu.weights[perm])
    gap_split = w2(att(split), att(mu))
    gap_perm = w2(att(shuffled), att(mu))
    print(f"W2(F(split mu), F(mu)) = {gap_split:.1e}; W2(F(shuffled mu), F(mu)) = {gap_perm:.1e}")
    for k in range(layers):
        since_start = f", W2(mu_0, mu_{k + 1}) = {total[k + 1]:.4f}" if k else ""   # layer 1: the same distance
        print(f"layer {k + 1}: W2(mu_{k}, mu_{k + 1}) = {step[k]:.4f}{since_start}")

    shown = [0, 1, layers]
    fig, grid = plt.subplots(2, 2, figsize=(9.5, 8.6))
    axes = grid.ravel()
    label = torch.arange(n) % 3  # blob of each atom (atoms keep their identity through the layers)
    palette = ["tab:blue", "tab:orange", "tab:green"]
    for ax, k in zip(axes, shown):
        m = measures[k]
        for j, name in enumerate(("mass 0.6", "mass 0.3", "mass 0.1")):
            sel = label == j
            ax.scatter(m.points[sel, 0], m.points[sel, 1], s=20 * n * m.weights[sel], color=palette[j],
                       alpha=0.6, edgecolors="none", label=name)
        ax.set_title(f"$\\mu_{{{k}}}$" + (" (input)" if k == 0 else f" (layer {k})"))
        ax.set_xlabel("$x_1$")
        ax.set_ylabel("$x_2$")
        ax.set_xlim(-4.2, 3.5)
        ax.set_ylim(-3.8, 3.5)
        ax.set_aspect("equal")
        ax.grid(alpha=0.25)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, markerscale=1.5, frameon=False,
               title="atoms of the three blobs of $\\mu_0$ (marker area proportional to the weight)")

    bx = axes[-1]
    ls = list(range(1, layers + 1))
    bx.plot(ls, step, "o-", label=r"$W_2(\mu_{l-1}, \mu_l)$: one layer")
    bx.plot(ls, total[1:], "s--", label=r"$W_2(\mu_0, \mu_l)$: from the input")
    bx.set_xlabel("layer $l$")
    bx.set_ylabel("exact $W_2$")
    bx.set_xticks(ls)
    bx.set_ylim(0, 1.35 * max(total))
    bx.grid(alpha=0.3)
    bx.legend(loc="upper left", fontsize=9)
    bx.set_title(f"N = {n} atoms, $\\mu_{{l+1}} = F(\\mu_l)$")
    fig.suptitle("Mean-field self-attention on a weighted measure\n(one atom split in two gives the same "
                 f"image: $W_2$ gap {gap_split:.0e}, rounding)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "measure_pushforward.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
