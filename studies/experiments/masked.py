"""Study 4: masked mean-field attention (Definition 2.6; Theorem 4.4 as stated; Theorems 3.3 / 4.3).

Masked measures live on [0, 1] x R^d and are compared with the conditional Wasserstein distance
W2c (Definition 4.1), finite only between measures with the same position marginal.

* **Theorem 4.4 as stated fails.** The paper states for the masked map the bound of Theorem 3.5,
  ||V|| (1 + 3||A|| R^2) exp(2||A|| R^2). At A = 0 the masked map is the running mean,
  f^m(X)_i = V (1/i) sum_{j<=i} x_j, whose constant on sequences of length n is ||C_n|| ||V|| (C_n the
  Cesaro matrix, :func:`meanfield.bounds.cesaro_norm`), above ||V|| for every n >= 2 and tending to 2 ||V||
  (Hardy's inequality): the local constants of random sequences, certified, are compared with that closed
  form (a theorem: a wrong mask fails it) and with the stated bound (a finding about the paper).
* Lipschitz ratios W2c(F^m mu, F^m nu) / W2c(mu, nu) (``meanfield.lipschitz_ratio``) for random
  pairs: nu is mu with every atom moved by eps (a random direction), mu a weighted measure whose
  atoms share a few positions (several atoms per position) or a sequence (positions i/n), compared with
  the stated bound, R the largest radius of both measures; as eps -> 0 each ratio approaches the local
  constant from below.
* Masked and unmasked local constants of the same random sequences, both below Theorem 3.3 / 4.3.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from .. import plotting as P
from ..common import ball_points, random_A, random_V, to_device
from ..contract import EMPIRICAL, THEOREM, Claim, StudyResult, register
from ..grid import run_grid
from ..io import save_figure, write_csv

__all__ = ["masked", "ratio_task", "top_direction_task", "masked_vs_unmasked_task", "running_mean_task",
           "conditional_w2_rows", "conditional_w2_claim",
           "random_masked_pair", "grid", "top_direction_claim", "running_mean_claims"]


def random_masked_pair(kind: str, n: int, d: int, R: float, eps: float, seed: int):
    """(mu, nu): a random masked measure in B_R and the same atoms moved by eps (same positions)."""
    from particles import Measure

    g = torch.Generator().manual_seed(int(seed))
    X = ball_points(n, d, R, g)
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


def running_mean_task(n: int, d: int, R: float, seed: int, rep: int, *, device=None) -> dict:
    """Masked attention with A = 0 (the running mean): certified local constants of a random sequence in B_R,
    Euclidean and on its masked measure (conditional W2), against the closed form ||C_n|| ||V|| and the stated
    Theorem 4.4 bound ||V|| (1 + 3||A|| R^2) exp(2||A|| R^2) = ||V||."""
    from meanfield import SelfAttention, bounds, local_lipschitz
    from particles import Measure

    V = random_V(d, seed)
    A = torch.zeros(d, d, dtype=torch.float64)
    g = torch.Generator().manual_seed(int(seed) * 1000 + 31 * n + rep)
    X = ball_points(n, d, R, g)
    Ad, Vd, Xd = to_device(device, A, V, X)
    att = SelfAttention(Ad, Vd, masked=True)
    seq = local_lipschitz(att, Xd, method="lanczos", tol=1e-10)
    mea = local_lipschitz(att, Measure.sequence(Xd), method="lanczos", tol=1e-10)
    nv = float(torch.linalg.matrix_norm(V, 2))
    return {"lip_sequence": float(seq.value), "error_sequence": float(seq.error),
            "lip_measure": float(mea.value), "error_measure": float(mea.error),
            "closed_form": bounds.cesaro_norm(n) * nv, "v_norm": nv,
            "stated_bound": float(bounds.mean_field_upper(A, V, R))}


def theorem_33_formula_deviation(rows: list[dict], d: int, seed: int) -> float:
    """The largest relative deviation of the rows' Theorem 3.3 / 4.3 bound (``upper``, from
    :func:`meanfield.bounds.sqrt_n_upper`) from the theorems' formula written out here,
    sqrt(3) ||V|| (||A||^2 R^4 (4n + 1) + n)^(1/2), with the study's A and V."""
    norm_A = float(np.linalg.norm(random_A(d, seed).numpy(), 2))
    norm_V = float(np.linalg.norm(random_V(d, seed).numpy(), 2))
    return max(abs(r["upper"] / (math.sqrt(3.0) * norm_V * math.sqrt(norm_A ** 2 * r["R"] ** 4 * (4 * r["n"] + 1)
                                                                      + r["n"])) - 1.0) for r in rows)


def conditional_w2_rows(ns, d: int, R: float, seed: int, reps: int) -> list[dict]:
    """Conditional W2 (Definition 4.1) against its closed forms, with plain W2 beside it: two random sequences of n
    tokens in B_R (one atom per position: W2c = ||X - Y||_F / sqrt(n), while plain W2 may pair tokens across
    positions) and a swap (mu = 1/2 delta_(1/4, x) + 1/2 delta_(3/4, y), nu the same points at swapped positions:
    W2c = |x - y|, plain W2 = 0)."""
    from particles import Measure
    from transport import conditional_w2, w2

    rows = []
    for n in ns:
        for rep in range(reps):
            g = torch.Generator().manual_seed(int(seed) * 1000 + 53 * n + rep)
            X, Y = ball_points(n, d, R, g), ball_points(n, d, R, g)
            mu, nu = Measure.sequence(X), Measure.sequence(Y)
            rows.append({"case": "sequences", "n": n, "rep": rep, "w2c": float(conditional_w2(mu, nu)),
                         "closed_form": float((X - Y).norm() / math.sqrt(n)),
                         "w2": float(w2(Measure(X), Measure(Y)))})
    g = torch.Generator().manual_seed(int(seed) * 1000 + 7)
    x, y = torch.randn(2, d, generator=g, dtype=torch.float64)
    pos = torch.tensor([0.25, 0.75], dtype=torch.float64)
    mu, nu = Measure(torch.stack([x, y]), positions=pos), Measure(torch.stack([y, x]), positions=pos)
    rows.append({"case": "swap", "n": 2, "rep": 0, "w2c": float(conditional_w2(mu, nu)),
                 "closed_form": float((x - y).norm()), "w2": float(w2(Measure(mu.points), Measure(nu.points)))})
    return rows


def definition_26_deviation(d: int, seed: int, R: float = 1.5, n: int = 12, cases: int = 4) -> float:
    """Largest relative deviation of F^m(mu) (the masked operator's pushforward) from Definition 2.6 written out
    here in numpy, on weighted measures whose positions come in no order and repeat: atom i goes to
    sum_{j: s_j <= s_i} softmax_j(<A x_i, x_j> + log a_j) V x_j, with its position and weight unchanged. The other
    masked claims look at sequences (equal weights, sorted positions) or compare two computations of the same map:
    a softmax without the log-weights, or a causal mask taken on the atoms' order instead of their positions,
    changed none of them (a review)."""
    from meanfield import SelfAttention
    from particles import Measure

    A, V = random_A(d, seed + 7), random_V(d, seed + 7)
    g = torch.Generator().manual_seed(int(seed) + 2606)
    worst = 0.0
    for _ in range(cases):
        X = ball_points(n, d, R, g)
        a = torch.rand(n, generator=g, dtype=torch.float64) + 0.05
        a = a / a.sum()
        s = torch.randint(0, 5, (n,), generator=g).double() / 4   # 5 positions, repeated, in no order
        out = SelfAttention(A, V, masked=True)(Measure(X, a, positions=s))
        Xn, an, sn, An, Vn = (t.numpy() for t in (X, a, s, A, V))
        want = np.empty_like(Xn)
        for i in range(n):
            seen = sn <= sn[i]
            logits = Xn[seen] @ (An @ Xn[i]) + np.log(an[seen])
            w = np.exp(logits - logits.max())
            want[i] = (w / w.sum()) @ Xn[seen] @ Vn.T
        dev = float(np.abs(out.points.numpy() - want).max() / np.abs(want).max())
        same = torch.equal(out.positions, s) and bool(torch.allclose(out.weights, a, rtol=0, atol=1e-15))
        worst = max(worst, dev if same else math.inf)
    return worst


def definition_26_claim(dev: float) -> Claim:
    return Claim("F^m on weighted measures with positions in any order is Definition 2.6",
                 "atom i goes to sum over s_j <= s_i of softmax(<A x_i, x_j> + log a_j) V x_j; positions and weights "
                 "unchanged", f"largest relative deviation from Definition 2.6 written out in numpy {dev:.1e}, on 4 "
                 "weighted measures of 12 atoms at 5 repeated positions in random order", dev <= 1e-12,
                 "float64; the operator's pushforward against the definition computed atom by atom", kind=THEOREM,
                 fails_if="the deviation exceeds 1e-12 (relative), or a position or weight changes: a softmax without "
                          "the log-weights, or a causal mask on the atoms' order instead of their positions",
                 short="F^m of weighted measures, unsorted positions, is Definition 2.6",
                 short_measured=f"deviation {dev:.1e} (allowed 1e-12)")


def conditional_w2_claim(rows: list[dict]) -> Claim:
    """conditional_w2 equals its closed forms (1e-12), on pairs where plain W2 is smaller (so that a W2c that
    forgot the positions, which every ratio near eps -> 0 would agree with, fails here)."""
    dev = max(abs(r["w2c"] / r["closed_form"] - 1.0) for r in rows)
    apart = [r for r in rows if r["w2"] < r["w2c"] * (1 - 1e-6)]
    ok = dev <= 1e-12 and bool(apart)
    return Claim(
        "conditional W2 (Definition 4.1) is the closed form on sequences, ||X - Y||_F / sqrt(n) (one atom per "
        "position), and on a swap of two atoms' positions |x - y|, where plain W2 is smaller (0 on the swap)",
        "W2c = ||X - Y||_F / sqrt(n); W2c(swap) = |x - y|",
        f"largest relative deviation {dev:.1e} over {len(rows)} pairs; plain W2 below W2c on {len(apart)} of them "
        f"(swap: W2 = {rows[-1]['w2']:.1e}, W2c = {rows[-1]['w2c']:.4g})", ok,
        "exact transport per position (transport.conditional_w2) against the closed forms written out here; the "
        "Lipschitz ratios of masked-3/4 meet W2c only near eps -> 0, where it equals plain W2 (the identity "
        "coupling), so this claim is what tells them apart", kind=THEOREM,
        fails_if="some pair's W2c differs from its closed form by more than 1e-12 (relative), or no pair has plain "
                 "W2 below W2c (the check would not distinguish them)",
        short="conditional W2 = its closed forms (sequences; a swap that W2 misses)",
        short_measured=f"largest deviation {dev:.1e}; W2 < W2c on {len(apart)} of {len(rows)} pairs")


def running_mean_claims(rows: list[dict]) -> list[Claim]:
    """The closed form of the masked constant at A = 0 (a theorem), and Theorem 4.4's stated bound against it
    (the paper's statement, checked: a finding)."""
    def deviation(r):   # relative, beyond the certified error bars
        return max(abs(r["lip_sequence"] - r["closed_form"]) - r["error_sequence"],
                   abs(r["lip_measure"] - r["closed_form"]) - r["error_measure"]) / r["closed_form"]

    off = max(deviation(r) for r in rows)
    bad = [r for r in rows if deviation(r) > 1e-8]
    above = [r for r in rows if r["lip_measure"] - r["error_measure"] > r["stated_bound"] * (1 + 1e-12)]
    top = max(rows, key=lambda r: r["lip_measure"] / r["stated_bound"])
    ns = sorted({r["n"] for r in rows})
    return [
        Claim("masked attention with A = 0 is the running mean: its local constant is ||C_n|| ||V|| (Cesaro matrix "
              "C_n, increasing to 2 by Hardy's inequality), Euclidean and in the conditional W2 (docs/math.md 5.2)",
              "Lip = ||C_n|| ||V||",
              f"largest relative deviation beyond the certified error bars {max(off, 0.0):.1e} over {len(rows)} "
              f"random sequences, n = {ns[0]}..{ns[-1]}", off <= 1e-8,
              "certified Lanczos constants (tol 1e-10) against the norm of the n x n Cesaro matrix (numpy); "
              "tolerance 1e-8 relative beyond the error bars", kind=THEOREM,
              fails_if="a certified constant differs from ||C_n|| ||V|| by more than its error bar and 1e-8 relative "
                       "(an unmasked kernel gives ||V||, a mask off by one position another matrix)",
              short="A = 0: masked constant = norm of C_n x norm of V (the running mean)",
              short_measured=f"largest deviation {max(off, 0.0):.1e}; {len(bad)} of {len(rows)} off"),
        Claim("the paper's Theorem 4.4 as stated: the bound of Theorem 3.5, ||V|| (1 + 3||A|| R^2) e^{2||A|| R^2}, "
              "holds for masked measures in the conditional W2",
              "Lip(F^m) <= ||V||(1+3||A||R^2) e^{2||A||R^2}",
              f"{len(above)} of {len(rows)} running-mean sequences (A = 0) above it, certified, at "
              f"{len({r['n'] for r in above})} of {len(ns)} lengths n (at A = 0 the constant depends on n alone: the "
              f"sequences of one length repeat it); largest constant / bound = "
              f"{top['lip_measure'] / top['stated_bound']:.4f} at n = {top['n']} (closed form "
              f"{top['closed_form'] / top['v_norm']:.4f}; 2 as n grows)", not above,
              "a finding about the paper's statement, not a check of this code: at A = 0 the stated bound is ||V||, "
              "and the masked map is the running mean, whose constant exceeds ||V|| for every n >= 2 (Hardy's "
              "inequality: up to 2 ||V||). The framework gives no bound for masked measures "
              "(meanfield.operator_upper: unknown) and bounds masked sequences by Theorem 4.3", kind=EMPIRICAL,
              fails_if="any certified masked constant (its value less its error bar) exceeds the stated bound; it "
                       "would be reproduced if every constant stayed below",
              short="Thm 4.4 as stated (Thm 3.5's bound, masked measures)",
              short_measured=f"above at {len({r['n'] for r in above})} of {len(ns)} lengths n; max Lip / bound "
                             f"{top['lip_measure'] / top['stated_bound']:.3f} at A = 0"),
    ]


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


#: what masked.png shows (the report prints it under the figure)
CAPTION = (
    "Left: masked Lipschitz ratios in the conditional W2 (W2c) over the local constant at mu, against the size "
    "eps of the perturbation, for sequences and weighted measures: along the top singular direction they tend "
    "to 1 as eps -> 0, along random directions they stay below it (at small eps the weighted measures' triangles "
    "cover the sequences'). Middle: the masked (green) and unmasked (red) constants of the same random sequences "
    "(mean of 3, band min to max) under the bound of Theorem 3.3 / 4.3. Right: with A = 0, masked "
    "attention is the running mean, and its certified constant over ||V|| equals the norm of the Cesaro matrix "
    "C_n (closed form); it exceeds 1, the value that Theorem 4.4 as stated allows there (a finding about the "
    "statement), and stays below Hardy's limit 2.")


@register("masked", "Masked mean-field attention: Definition 2.6, Theorem 4.4 as stated", grid=grid)
def masked(out_dir: Path, ctx) -> StudyResult:
    """The running mean (A = 0) against Theorem 4.4's stated bound; conditional-W2 Lipschitz ratios of random masked
    pairs; masked vs unmasked constants."""
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
    grid3 = [{"n": m, "d": d, "R": R, "seed": seed, "rep": r} for m in ns for r in range(reps_n)]
    rows3 = run_grid(running_mean_task, grid3, out_dir, "masked_running_mean", ctx, device=ctx.device)
    write_csv(rows3, out_dir / "running_mean.csv")

    viol = [r for r in rows if math.log(r["ratio"]) > r["log_bound"] + 1e-12]
    small = [r for r in rows if r["eps"] == min(epss)]
    over_local = [r for r in small if r["ratio"] > r["local"] * (1 + 1e-3)]
    top_small = max(abs(r["deviation"]) for r in rows_top if r["eps"] == min(epss))
    viol2 = [r for r in rows2 if max(r["lip_masked"], r["lip_unmasked"]) > r["upper"] * (1 + 1e-12)]
    frac_masked_smaller = float(np.mean([r["lip_masked"] <= r["lip_unmasked"] for r in rows2]))
    top2 = max(rows2, key=lambda r: max(r["lip_masked"], r["lip_unmasked"]) / r["upper"])
    formula_dev2 = theorem_33_formula_deviation(rows2, d, seed)

    fig, axes = P.figure(ncols=3, width=16.0, height=4.8)
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
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2)
    ax = axes[2]
    nn3 = sorted({r["n"] for r in rows3})
    P.measured(ax, nn3, [np.mean([r["lip_measure"] / r["v_norm"] for r in rows3 if r["n"] == m]) for m in nn3],
               "certified constant / ||V|| (W2c)", color=P.COLORS[4])
    P.theory(ax, nn3, [next(r["closed_form"] / r["v_norm"] for r in rows3 if r["n"] == m) for m in nn3],
             "||C_n|| (running mean, closed form)", color="k", kind="limit")
    ax.axhline(1.0, color=P.COLORS[1], lw=1.2, ls="--", label="Thm 4.4 as stated: 1")
    ax.axhline(2.0, color="0.5", lw=0.8, ls=":", label="Hardy's limit 2")
    P.finish(ax, "sequence length n", "Lipschitz constant / ||V||", "A = 0: masked attention is the running mean",
             logx=True, legend=False)
    ax.set_ylim(0.8, 2.1)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower right", ncol=2)
    save_figure(fig, out_dir / "masked.png")

    log_gap = min(r["log_bound"] - math.log(r["ratio"]) for r in rows)
    rows4 = conditional_w2_rows(ns, d, R, seed, reps_n)
    write_csv(rows4, out_dir / "conditional_w2.csv")
    claims = [
        *running_mean_claims(rows3),
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
              f"unmasked in {frac_masked_smaller:.0%} of inputs; the bound evaluated is the theorems' formula within "
              f"{formula_dev2:.1e}", not viol2 and formula_dev2 <= 1e-12,
              "random sequences on the sphere of radius R; every constant is far below the bound (the sqrt(n) study "
              "reports its slack at the witness of Proposition 3.4), so the bound evaluated is also compared with "
              "the formula written out in this study from the norms (1e-12): a bound off by a constant factor, or "
              "in n, would pass the comparison alone", kind=THEOREM,
              fails_if="a masked or unmasked constant exceeds the Theorem 3.3 / 4.3 bound, or the bound evaluated "
                       "differs from sqrt(3) ||V|| (||A||^2 R^4 (4n + 1) + n)^(1/2) by more than 1e-12 (relative)",
              short="masked and unmasked constants both obey Thm 3.3 / 4.3",
              short_measured=f"max Lip / bound {max(top2['lip_masked'], top2['lip_unmasked']) / top2['upper']:.3g}; "
                             f"{len(viol2)} of {2 * len(rows2)} above"),
        conditional_w2_claim(rows4),
        definition_26_claim(definition_26_deviation(d, seed)),
    ]
    notes = ("Pairs: nu moves every atom of mu by a random displacement of W2c size about eps, positions kept "
             "(so W2c is finite), or, for the top-direction pairs, by exactly eps along the direction of maximal "
             "change of the local constant. 'weighted' measures have random weights and several atoms per position; "
             "'sequence' uses positions i/n.")
    notes += (f" Random pairs at R = {R} against the stated Theorem 4.4 bound: {len(viol)} of {len(rows)} above, "
              f"smallest log(bound / ratio) {log_gap:.3g} (the bound is far from these pairs; it fails where "
              "||A|| R^2 is small, as the running-mean sequences show).")
    return StudyResult("masked", "Masked mean-field attention", claims, ["masked.png"],
                       ["ratios.csv", "ratios_top_direction.csv", "masked_vs_unmasked.csv", "running_mean.csv",
                        "conditional_w2.csv"],
                       {"stated_bound_violations_random_pairs": len(viol),
                        "fraction_masked_smaller": frac_masked_smaller,
                        "top_direction_deviation": top_small}, notes, captions={"masked.png": CAPTION})
