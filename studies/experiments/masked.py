"""Study 4: masked mean-field attention (Definition 2.6, Theorem 4.4; Theorems 3.3 / 4.3).

Masked measures live on [0, 1] x R^d and are compared with the conditional Wasserstein distance
W2c (Definition 4.1), finite only between measures with the same position marginal.

* Lipschitz ratios W2c(F^m mu, F^m nu) / W2c(mu, nu) (``meanfield.lipschitz_ratio``) for random
  pairs: nu is mu with every atom moved by eps (a random direction), mu a weighted measure whose
  atoms share a few positions (several atoms per position) or a sequence (positions i/n). Each
  ratio is compared with the bound of Theorem 4.4, ||V|| (1 + 3||A|| R^2) exp(2||A|| R^2), R the
  largest radius of both measures; as eps -> 0 it approaches the local constant from below.
* Masked and unmasked local constants of the same random sequences, both below Theorem 3.3 / 4.3.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from .. import plotting as P
from ..common import random_A, random_V, to_device
from ..contract import THEOREM, Claim, StudyResult, register
from ..grid import run_grid
from ..io import save_figure, write_csv

__all__ = ["masked", "ratio_task", "masked_vs_unmasked_task", "random_masked_pair", "grid"]


def random_masked_pair(kind: str, n: int, d: int, R: float, eps: float, seed: int):
    """(mu, nu): a random masked measure in B_R and the same atoms moved by eps (same positions)."""
    from particles import Measure

    g = torch.Generator().manual_seed(int(seed))
    Z = torch.randn(n, d, generator=g, dtype=torch.float64)
    X = R * torch.rand(n, 1, generator=g, dtype=torch.float64) ** (1 / d) * Z / Z.norm(dim=1, keepdim=True)
    U = torch.randn(n, d, generator=g, dtype=torch.float64)
    Y = X + eps * U / U.norm() * math.sqrt(n)
    if kind == "sequence":
        return Measure.sequence(X), Measure.sequence(Y)
    if kind == "weighted":
        k = max(2, n // 3)  # a few distinct positions, several atoms each
        pos = (torch.randint(1, k + 1, (n,), generator=g) / k).to(torch.float64)
        w = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
        w = w / w.sum()
        return Measure(X, w, pos), Measure(Y, w, pos)
    raise ValueError(f"kind: expected 'sequence' or 'weighted', got {kind!r}")


def ratio_task(kind: str, n: int, d: int, R: float, eps: float, seed: int, rep: int, *, device=None) -> dict:
    """One Lipschitz ratio of masked attention between a random pair, with the bound and local constant."""
    from meanfield import SelfAttention, bounds, lipschitz_ratio, local_lipschitz
    from transport import conditional_w2

    A = random_A(d, seed)
    V = random_V(d, seed)
    mu, nu = random_masked_pair(kind, n, d, R, eps, seed * 1000 + rep)
    if device is not None:
        mu, nu = mu.to(device=device), nu.to(device=device)
    att = SelfAttention(*to_device(device, A, V), masked=True)
    r_max = max(mu.radius(), nu.radius())
    ratio = float(lipschitz_ratio(att, mu, nu))
    local = float(local_lipschitz(att, mu, method="lanczos", tol=1e-8).value)
    return {"ratio": ratio, "w2c": float(conditional_w2(mu, nu)), "local": local, "radius": r_max,
            "log_bound": float(bounds.mean_field_upper(A, V, r_max, log=True))}


def masked_vs_unmasked_task(n: int, d: int, R: float, seed: int, rep: int, *, device=None) -> dict:
    """Masked and unmasked local constants of one random sequence on the sphere of radius R."""
    from meanfield import SelfAttention, bounds, local_lipschitz

    A = random_A(d, seed)
    V = random_V(d, seed)
    g = torch.Generator().manual_seed(int(seed) * 1000 + 17 * n + rep)
    Z = torch.randn(n, d, generator=g, dtype=torch.float64)
    X = R * Z / Z.norm(dim=1, keepdim=True)
    Ad, Vd, Xd = to_device(device, A, V, X)
    lm = local_lipschitz(SelfAttention(Ad, Vd, masked=True), Xd, method="lanczos", tol=1e-8)
    lu = local_lipschitz(SelfAttention(Ad, Vd, masked=False), Xd, method="lanczos", tol=1e-8)
    return {"lip_masked": float(lm.value), "lip_unmasked": float(lu.value),
            "upper": float(bounds.sqrt_n_upper(A, V, R, n))}


def grid(level: str) -> dict:
    """Sizes: dimension d, atoms n of the ratio pairs, perturbation sizes eps, pairs per eps and kind,
    sequence lengths ns of the masked-vs-unmasked comparison and sequences per length."""
    if level == "tiny":
        return {"d": 3, "n": 6, "epss": [1.0, 1e-3], "reps": 2, "ns": [4, 8], "reps_n": 1}
    if level == "quick":
        return {"d": 3, "n": 12, "epss": [1.0, 0.1, 1e-2, 1e-3, 1e-4], "reps": 3, "ns": [4, 8, 16, 32, 64],
                "reps_n": 2}
    return {"d": 4, "n": 24, "epss": list(np.geomspace(1.0, 1e-5, 11)), "reps": 8,
            "ns": [4, 8, 16, 32, 64, 128, 256], "reps_n": 8}


@register("masked", "Masked mean-field attention: Definition 2.6 and Theorem 4.4", order=40, grid=grid)
def masked(out_dir: Path, ctx) -> StudyResult:
    """Conditional-W2 Lipschitz ratios of random masked pairs vs Theorem 4.4; masked vs unmasked constants."""
    out_dir = Path(out_dir)
    seed = ctx.seed
    g = grid(ctx.level)
    d, n, epss, reps, ns, reps_n = (g[k] for k in ("d", "n", "epss", "reps", "ns", "reps_n"))
    R = 1.5
    points = [{"kind": k, "n": n, "d": d, "R": R, "eps": float(e), "seed": seed, "rep": r}
              for k in ("sequence", "weighted") for e in epss for r in range(reps)]
    rows = run_grid(ratio_task, points, out_dir, "masked_ratios", ctx, device=ctx.device)
    write_csv(rows, out_dir / "ratios.csv")
    grid2 = [{"n": m, "d": d, "R": R, "seed": seed, "rep": r} for m in ns for r in range(reps_n)]
    rows2 = run_grid(masked_vs_unmasked_task, grid2, out_dir, "masked_vs_unmasked", ctx, device=ctx.device)
    write_csv(rows2, out_dir / "masked_vs_unmasked.csv")

    viol = [r for r in rows if math.log(r["ratio"]) > r["log_bound"] + 1e-12]
    small = [r for r in rows if r["eps"] == min(epss)]
    over_local = [r for r in small if r["ratio"] > r["local"] * (1 + 1e-3)]
    viol2 = [r for r in rows2 if max(r["lip_masked"], r["lip_unmasked"]) > r["upper"] * (1 + 1e-12)]
    frac_masked_smaller = float(np.mean([r["lip_masked"] <= r["lip_unmasked"] for r in rows2]))

    fig, axes = P.figure(ncols=2)
    ax = axes[0]
    for i, kind in enumerate(("sequence", "weighted")):
        sel = [r for r in rows if r["kind"] == kind]
        ax.scatter([r["eps"] for r in sel], [r["ratio"] / r["local"] for r in sel], s=12, color=P.COLORS[i],
                   label=f"{kind}: ratio / local constant at mu")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    P.finish(ax, "perturbation size eps (W2c scale)", "W2c ratio / local constant",
             "masked Lipschitz ratios, random pairs", logx=True)
    ax = axes[1]
    nn = sorted({r["n"] for r in rows2})
    for i, key in enumerate(("lip_masked", "lip_unmasked")):
        P.measured(ax, nn, [np.mean([r[key] for r in rows2 if r["n"] == m]) for m in nn],
                   key.replace("lip_", "") + " (mean)", color=P.COLORS[i + 2])
    P.theory(ax, nn, [next(r["upper"] for r in rows2 if r["n"] == m) for m in nn], "Thm 3.3 / 4.3 bound", color="k")
    P.finish(ax, "sequence length n", "local Lipschitz constant", f"same random inputs, R={R}, d={d}",
             logx=True, logy=True)
    save_figure(fig, out_dir / "masked.png")

    log_gap = min(r["log_bound"] - math.log(r["ratio"]) for r in rows)
    claims = [
        Claim("Theorem 4.4: W2c(F mu, F nu) <= bound * W2c(mu, nu) for masked measures",
              "ratio <= ||V||(1+3||A||R^2) e^{2||A||R^2}",
              f"{len(viol)} violations of {len(rows)}; smallest log(bound / ratio) = {log_gap:.3g}", not viol,
              f"{reps} random pairs per eps and kind, R = {R}", kind=THEOREM,
              fails_if="some pair's W2c ratio exceeds the bound (log ratio above log bound by more than 1e-12)"),
        Claim("ratios approach the local constant from below as eps -> 0", "ratio <= local constant",
              f"{len(over_local)} of {len(small)} pairs above it at eps = {min(epss):g}", not over_local,
              "tolerance 1e-3 (second-order terms in eps)", kind=THEOREM,
              fails_if="at the smallest eps some ratio exceeds the local constant at mu by more than 0.1%"),
        Claim("masked and unmasked constants both obey Theorem 3.3 / 4.3", "Lip <= sqrt(3)||V||(...)^(1/2)",
              f"{len(viol2)} violations of {2 * len(rows2)}; masked <= unmasked in {frac_masked_smaller:.0%} of inputs",
              not viol2, kind=THEOREM, fails_if="a masked or unmasked constant exceeds the Theorem 3.3 / 4.3 bound"),
    ]
    notes = ("Pairs: nu moves every atom of mu by a random displacement of W2c size about eps, positions kept "
             "(so W2c is finite). 'weighted' measures have random weights and several atoms per position; "
             "'sequence' uses positions i/n.")
    return StudyResult("masked", "Masked mean-field attention", claims, ["masked.png"],
                       ["ratios.csv", "masked_vs_unmasked.csv"],
                       {"violations": len(viol), "fraction_masked_smaller": frac_masked_smaller}, notes)
