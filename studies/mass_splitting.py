"""Study 5: mass splitting (earlier version of the paper; MATH.md section 4).

Splitting an atom (x, a) into (x, t a) and (x, (1 - t) a) leaves the measure unchanged, but the
two halves may then move apart: the weighted-Jacobian constant (Lemma C.5) of the split
representation is at least the unsplit one (moving both halves together is the unsplit
perturbation, with the same W2 norm) and can exceed it. The true W2 local constant is at least
the sup over splittings. This study maps ratio = Lip(split) / Lip(unsplit) over

* d = 1: two atoms x_0 (split, weight 1/2) on a grid of positions and x_1 = 1 (weight 1/2), with
  split fractions t in (0, 1), A = a (scalar), V = 1;
* d = 2: x_0 = (1, 0) (split at t = 1/2, weight 1/2) and x_1 on a grid of the plane, A random.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import plotting as P
from .core import Claim, StudyResult, grid_level, register, run_grid, save_figure, write_csv
from .sqrt_n import random_A

__all__ = ["mass_splitting", "split_ratio_task"]


def split_ratio_task(d: int, x0: list, x1: list, t: float, a_scale: float, seed: int) -> dict:
    """Lip of the split representation / Lip of the unsplit measure (dense, W2 sense of Lemma C.5)."""
    from meanfield import SelfAttention, local_lipschitz
    from particles import Measure

    A = a_scale * (torch.eye(1, dtype=torch.float64) if d == 1 else random_A(d, seed))
    att = SelfAttention(A, torch.eye(d, dtype=torch.float64))
    mu = Measure(torch.tensor([x0, x1], dtype=torch.float64), torch.tensor([0.5, 0.5], dtype=torch.float64))
    base = float(local_lipschitz(att, mu, method="dense").value)
    split = float(local_lipschitz(att, mu.split(0, t), method="dense").value)
    return {"lip_unsplit": base, "lip_split": split, "ratio": split / base}


def _grids(level: str):
    if level == "tiny":
        return 5, [0.25, 0.5], 4
    if level == "quick":
        return 25, [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95], 15
    return 61, list(np.round(np.linspace(0.025, 0.975, 39), 4)), 41


@register("mass_splitting", "Mass splitting: split vs unsplit weighted constants", order=50)
def mass_splitting(out_dir: Path, *, quick: bool, seed: int) -> StudyResult:
    """Ratio of split to unsplit weighted constants over atom positions and split fractions (d = 1, 2)."""
    out_dir = Path(out_dir)
    n_pos, ts, n_2d = _grids(grid_level(quick))
    a_scale = 2.0
    xs = [float(v) for v in np.round(np.linspace(-2.0, 2.0, n_pos), 6)]
    grid1 = [{"d": 1, "x0": [x], "x1": [1.0], "t": float(t), "a_scale": a_scale, "seed": seed}
             for t in ts for x in xs if abs(x - 1.0) > 1e-9]
    rows1 = run_grid(split_ratio_task, grid1, out_dir, "split_1d")
    g2 = [float(v) for v in np.round(np.linspace(-2.0, 2.0, n_2d), 6)]
    grid2 = [{"d": 2, "x0": [1.0, 0.0], "x1": [u, v], "t": 0.5, "a_scale": 1.0, "seed": seed}
             for v in g2 for u in g2 if (u, v) != (1.0, 0.0)]
    rows2 = run_grid(split_ratio_task, grid2, out_dir, "split_2d")
    flat1 = [{"x0": r["x0"][0], **{k: v for k, v in r.items() if k not in ("x0", "x1")}} for r in rows1]
    flat2 = [{"x1_0": r["x1"][0], "x1_1": r["x1"][1], **{k: v for k, v in r.items() if k not in ("x0", "x1")}}
             for r in rows2]
    write_csv(flat1, out_dir / "split_ratio_1d.csv")
    write_csv(flat2, out_dir / "split_ratio_2d.csv")

    fig, axes = P.figure(ncols=2, width=11)
    xs1 = sorted({r["x0"] for r in flat1})
    Z1 = np.array([[next(r["ratio"] for r in flat1 if r["t"] == t and r["x0"] == x) for x in xs1] for t in ts])
    P.heatmap(axes[0], xs1, ts, Z1, xlabel="position x_0 of the split atom (x_1 = 1)", ylabel="split fraction t",
              cbar_label="Lip(split) / Lip(unsplit)", title=f"d = 1, A = {a_scale:g}, V = 1", center=1.0, fig=fig)
    Z2 = np.full((len(g2), len(g2)), np.nan)
    for r in flat2:
        Z2[g2.index(r["x1_1"]), g2.index(r["x1_0"])] = r["ratio"]
    P.heatmap(axes[1], g2, g2, Z2, xlabel="x_1, first coordinate", ylabel="x_1, second coordinate",
              cbar_label="Lip(split) / Lip(unsplit)", title="d = 2, x_0 = (1, 0) split at t = 1/2", center=1.0,
              fig=fig)
    axes[1].plot([1.0], [0.0], "k*", ms=10, label="split atom x_0")
    axes[1].legend(loc="upper left")
    save_figure(fig, out_dir / "split_ratio_maps.png")

    allr = [r["ratio"] for r in flat1 + flat2]
    below = [v for v in allr if v < 1 - 1e-9]
    increased = [v for v in allr if v > 1 + 1e-6]
    best = max(flat1 + flat2, key=lambda r: r["ratio"])
    claims = [
        Claim("splitting never decreases the weighted constant (it contains the unsplit perturbations)",
              "ratio >= 1", f"min ratio {min(allr):.6f}; {len(below)} of {len(allr)} below 1", not below,
              "tolerance 1e-9"),
        Claim("splitting can increase the weighted constant (MATH.md 4: the W2 constant is at least the sup)",
              "ratio > 1 somewhere", f"max ratio {max(allr):.4f}; increased at {len(increased)} of {len(allr)} "
              "grid points", bool(increased), "increase counted when ratio > 1 + 1e-6"),
    ]
    notes = (f"Largest ratio {best['ratio']:.4f} at d = {best['d']}, t = {best['t']}. Red: splitting increases the "
             "constant; white: it does not. Constants are dense weighted-Jacobian values (Lemma C.5).")
    return StudyResult("mass_splitting", "Mass splitting", claims, ["split_ratio_maps.png"],
                       ["split_ratio_1d.csv", "split_ratio_2d.csv"],
                       {"max_ratio": max(allr), "min_ratio": min(allr),
                        "fraction_increased": len(increased) / len(allr)}, notes)

