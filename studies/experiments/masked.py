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

__all__ = ["masked", "ratio_task", "top_direction_task", "masked_vs_unmasked_task", "random_masked_pair", "grid",
           "top_direction_claim"]


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


def top_direction_task(kind: str, n: int, d: int, R: float, eps: float, seed: int, rep: int, *, device=None) -> dict:
    """The W2c ratio between mu (the random measure of :func:`ratio_task`) and mu moved by eps along the
    direction of maximal change of its local constant (the top singular vector, point perturbation
    u / sqrt(a), docs/math.md section 4.5): it tends to the local constant as eps -> 0."""
    from meanfield import SelfAttention, lipschitz_ratio, local_lipschitz
    from particles import Measure

    A = random_A(d, seed)
    V = random_V(d, seed)
    mu, _ = random_masked_pair(kind, n, d, R, eps, seed * 1000 + rep)
    att = SelfAttention(A, V, masked=True)
    est = local_lipschitz(att, mu, method="lanczos", tol=1e-10)
    w = mu.weights
    move = est.vector.to(torch.float64) / w.sqrt()[:, None]
    move = move / torch.sqrt((w[:, None] * move**2).sum())   # W2c size 1 (positions kept)
    nu = Measure(mu.points + eps * move, w, mu.positions)
    if device is not None:
        mu, nu, att = mu.to(device=device), nu.to(device=device), SelfAttention(*to_device(device, A, V), masked=True)
    ratio = float(lipschitz_ratio(att, mu, nu))
    return {"ratio": ratio, "local": float(est.value), "local_error": float(est.error),
            "deviation": ratio / float(est.value) - 1.0}


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
        return {"d": 3, "n": 6, "epss": [1.0, 1e-2, 1e-3], "reps": 2, "ns": [4, 8, 16], "reps_n": 2}
    if level == "quick":
        return {"d": 3, "n": 12, "epss": [1.0, 0.1, 1e-2, 1e-3, 1e-4], "reps": 3, "ns": [4, 8, 16, 32, 64],
                "reps_n": 3}
    return {"d": 4, "n": 24, "epss": list(np.geomspace(1.0, 1e-5, 11)), "reps": 8,
            "ns": [4, 8, 16, 32, 64, 128, 256], "reps_n": 8}


def top_direction_claim(rows: list[dict]) -> Claim:
    """Along the top singular direction the W2c ratio reaches the local constant: the relative deviation
    at the smallest eps is at most twice what first-order convergence from the next eps predicts
    (|dev(eps_min)| <= 2 (eps_min / eps_next) |dev(eps_next)|), for every measure."""
    epss = sorted({r["eps"] for r in rows})
    e0, e1 = epss[0], epss[1]
    bad, worst = [], 0.0
    for key in sorted({(r["kind"], r["rep"]) for r in rows}):
        sel = {r["eps"]: r for r in rows if (r["kind"], r["rep"]) == key}
        d0, d1 = abs(sel[e0]["deviation"]), abs(sel[e1]["deviation"])
        worst = max(worst, d0)
        if d0 > 2.0 * (e0 / e1) * d1 + 1e-9:
            bad.append(key)
    n_mu = len({(r["kind"], r["rep"]) for r in rows})
    return Claim(
        "the local constant (W2c sense) is the limit of Lipschitz ratios along its top singular direction",
        "|ratio / Lip - 1| -> 0 linearly in eps",
        f"largest |ratio / Lip - 1| = {worst:.1e} at eps = {e0:g}; {len(bad)} of {n_mu} measures converge slower "
        "than linearly", not bad,
        f"direction u / sqrt(a) of the top singular vector u; tolerance: twice the first-order prediction from "
        f"eps = {e1:g}, plus 1e-9", kind=THEOREM,
        fails_if="for some measure the ratio along the top direction does not approach the local constant linearly "
                 "in eps (a local constant or a W2c off by any factor fails)",
        short="the local constant (W2c) = limit of ratios along its top direction",
        short_measured=f"largest deviation {worst:.1e} at eps = {e0:g}; {len(bad)} of {n_mu} slower than linear")


@register("masked", "Masked mean-field attention: Definition 2.6 and Theorem 4.4", grid=grid)
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
    rows_top = run_grid(top_direction_task, points, out_dir, "masked_top_direction", ctx, device=ctx.device)
    write_csv(rows_top, out_dir / "ratios_top_direction.csv")
    grid2 = [{"n": m, "d": d, "R": R, "seed": seed, "rep": r} for m in ns for r in range(reps_n)]
    rows2 = run_grid(masked_vs_unmasked_task, grid2, out_dir, "masked_vs_unmasked", ctx, device=ctx.device)
    write_csv(rows2, out_dir / "masked_vs_unmasked.csv")

    viol = [r for r in rows if math.log(r["ratio"]) > r["log_bound"] + 1e-12]
    small = [r for r in rows if r["eps"] == min(epss)]
    over_local = [r for r in small if r["ratio"] > r["local"] * (1 + 1e-3)]
    top_small = max(abs(r["deviation"]) for r in rows_top if r["eps"] == min(epss))
    viol2 = [r for r in rows2 if max(r["lip_masked"], r["lip_unmasked"]) > r["upper"] * (1 + 1e-12)]
    frac_masked_smaller = float(np.mean([r["lip_masked"] <= r["lip_unmasked"] for r in rows2]))
    top2 = max(rows2, key=lambda r: max(r["lip_masked"], r["lip_unmasked"]) / r["upper"])

    fig, axes = P.figure(ncols=2, width=11.0, height=4.6)
    ax = axes[0]
    for i, kind in enumerate(("sequence", "weighted")):
        sel = [r for r in rows if r["kind"] == kind]
        ax.scatter([r["eps"] for r in sel], [r["ratio"] / r["local"] for r in sel], s=12, color=P.COLORS[i],
                   label=f"{kind}, random direction")
        sel = [r for r in rows_top if r["kind"] == kind]
        ax.scatter([r["eps"] for r in sel], [r["ratio"] / r["local"] for r in sel], s=22, color=P.COLORS[i],
                   marker="^", label=f"{kind}, top singular direction")
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="local constant at mu")
    P.finish(ax, "perturbation size eps (W2c scale)", "W2c ratio / local constant at mu",
             "masked Lipschitz ratios", logx=True, legend=False)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower left", ncol=2)
    ax = axes[1]
    nn = sorted({r["n"] for r in rows2})
    for i, key in enumerate(("lip_masked", "lip_unmasked")):
        vals = [[r[key] for r in rows2 if r["n"] == m] for m in nn]
        P.measured(ax, nn, [np.mean(v) for v in vals], key.replace("lip_", "") + f" (mean of {reps_n})",
                   color=P.COLORS[i + 2])
        if reps_n > 1:
            P.band(ax, nn, [min(v) for v in vals], [max(v) for v in vals], color=P.COLORS[i + 2])
    P.theory(ax, nn, [next(r["upper"] for r in rows2 if r["n"] == m) for m in nn], "Thm 3.3 / 4.3 bound", color="k")
    P.finish(ax, "sequence length n", "local Lipschitz constant", f"same random sequences (band: min to max), R={R}, "
             f"d={d}", logx=True, logy=True, legend=False)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower right", ncol=2)
    save_figure(fig, out_dir / "masked.png")

    log_gap = min(r["log_bound"] - math.log(r["ratio"]) for r in rows)
    claims = [
        Claim("Theorem 4.4: W2c(F mu, F nu) <= bound * W2c(mu, nu) for masked measures",
              "ratio <= ||V||(1+3||A||R^2) e^{2||A||R^2}",
              f"{len(viol)} violations of {len(rows)}; smallest log(bound / ratio) = {log_gap:.3g}", not viol,
              f"{reps} random pairs per eps and kind, R = {R}. Tightness: far from attained here (e^{log_gap:.3g}); "
              "no masked measure is known to attain it, and the closest family (the two-Dirac witness of "
              "Proposition 3.6, see the mean-field study) matches it only up to the constant in the exponent",
              kind=THEOREM,
              fails_if="some pair's W2c ratio exceeds the bound (log ratio above log bound by more than 1e-12)",
              short="Thm 4.4: W2c(F mu, F nu) <= bound * W2c(mu, nu), masked measures",
              short_measured=f"{len(viol)} of {len(rows)} above; smallest log(bound / ratio) {log_gap:.3g}"),
        top_direction_claim(rows_top),
        Claim("random-direction ratios stay below the local constant as eps -> 0", "ratio <= local constant",
              f"{len(over_local)} of {len(small)} pairs above it at eps = {min(epss):g}; ratio / local constant in "
              f"[{min(r['ratio'] / r['local'] for r in small):.3f}, {max(r['ratio'] / r['local'] for r in small):.3f}]",
              not over_local,
              f"tolerance 1e-3: second-order terms in eps, which along the top direction reach {top_small:.1e} at "
              f"this eps", kind=THEOREM,
              fails_if="at the smallest eps some ratio exceeds the local constant at mu by more than 0.1%",
              short="random-direction ratios stay below the local constant as eps -> 0",
              short_measured=f"{len(over_local)} of {len(small)} above at eps = {min(epss):g}"),
        Claim("masked and unmasked constants both obey Theorem 3.3 / 4.3", "Lip <= sqrt(3)||V||(...)^(1/2)",
              f"{len(viol2)} violations of {2 * len(rows2)}; largest Lip / bound = "
              f"{max(top2['lip_masked'], top2['lip_unmasked']) / top2['upper']:.3g} (n = {top2['n']}); masked <= "
              f"unmasked in {frac_masked_smaller:.0%} of inputs", not viol2,
              "random sequences on the sphere of radius R; the sqrt(n) study reports this bound's slack at the "
              "witness of Proposition 3.4", kind=THEOREM,
              fails_if="a masked or unmasked constant exceeds the Theorem 3.3 / 4.3 bound",
              short="masked and unmasked constants both obey Thm 3.3 / 4.3",
              short_measured=f"max Lip / bound {max(top2['lip_masked'], top2['lip_unmasked']) / top2['upper']:.3g}; "
                             f"{len(viol2)} of {2 * len(rows2)} above"),
    ]
    notes = ("Pairs: nu moves every atom of mu by a random displacement of W2c size about eps, positions kept "
             "(so W2c is finite), or, for the top-direction pairs, by exactly eps along the direction of maximal "
             "change of the local constant. 'weighted' measures have random weights and several atoms per position; "
             "'sequence' uses positions i/n.")
    return StudyResult("masked", "Masked mean-field attention", claims, ["masked.png"],
                       ["ratios.csv", "ratios_top_direction.csv", "masked_vs_unmasked.csv"],
                       {"violations": len(viol), "fraction_masked_smaller": frac_masked_smaller,
                        "top_direction_deviation": top_small}, notes)
