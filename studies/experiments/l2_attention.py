"""Study 7: dot-product vs L2 attention (Kim, Papamakarios & Mnih, ICML 2021).

Dot-product attention is not globally Lipschitz: with one token at 0 and the others spread at
radius R (``meanfield.adversarial.zero_plus_spread``, Appendix C.7) its local constant grows
like R^2. L2 attention (tied queries and keys, ``meanfield.L2SelfAttention``) is Lipschitz: its
constants stay bounded in R and below Kim et al.'s Theorem 3.2 bound
(``meanfield.bounds.l2_attention_upper``, which grows like sqrt(N) log N). Both layers share the
same W_Q (dot-product: A = W_Q W_Q^T / sqrt(k), V = I).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from particles import Measure

from .. import plotting as P
from ..common import fit_loglog, to_device
from ..contract import THEOREM, Claim, StudyResult, register
from ..grid import run_grid
from ..io import save_figure, write_csv

__all__ = ["l2_attention", "l2_task", "weights", "grid"]


def weights(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_Q (d, d), W_V (d, d)) Gaussian / sqrt(d), from a seed."""
    g = torch.Generator().manual_seed(int(seed) + 555)
    W_Q = torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    W_V = torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    return W_Q, W_V


def l2_task(kind: str, R: float, n: int, d: int, seed: int, rep: int = 0, *, device=None) -> dict:
    """Local constants of dot-product and L2 attention at one input, and Kim's bound for N = n."""
    from meanfield import L2SelfAttention, SelfAttention, adversarial, bounds, local_lipschitz

    W_Q, W_V = weights(d, seed)
    if kind == "spread":
        X = adversarial.zero_plus_spread(R, n, d, seed=seed * 1000 + rep)
    elif kind == "random":
        X = Measure.sphere(n, d, R, seed=int(seed) * 1000 + 13 * n + rep).points
    else:
        raise ValueError(f"kind: expected 'spread' or 'random', got {kind!r}")
    k = W_Q.shape[1]
    dot = SelfAttention(*to_device(device, W_Q @ W_Q.T / math.sqrt(k), torch.eye(d, dtype=torch.float64)))
    l2 = L2SelfAttention(*to_device(device, W_Q, W_V))
    X = to_device(device, X)
    ld = local_lipschitz(dot, X, method="lanczos", tol=1e-8)
    ll = local_lipschitz(l2, X, method="lanczos", tol=1e-8)
    return {"lip_dot": float(ld.value), "lip_l2": float(ll.value), "lip_l2_error": float(ll.error),
            "kim_bound": float(bounds.l2_attention_upper(W_Q, W_V, torch.eye(d, dtype=torch.float64), n))}


def grid(level: str) -> dict:
    """Sizes: dimension d, radii and tokens of the R scan, lengths and repetitions of the n scan."""
    if level == "tiny":
        return {"d": 3, "Rs": list(np.geomspace(1, 32, 6)), "n_R": 6, "ns": [2, 4, 8], "reps": 1}
    if level == "quick":
        return {"d": 4, "Rs": list(np.geomspace(0.25, 64, 13)), "n_R": 12, "ns": [2, 4, 8, 16, 32, 64, 128], "reps": 3}
    return {"d": 8, "Rs": list(np.geomspace(0.25, 100, 18)), "n_R": 24, "ns": [2, 4, 8, 16, 32, 64, 128, 256, 512],
            "reps": 6}


@register("l2_attention", "Dot-product vs L2 attention (Kim et al. 2021)", order=70, grid=grid)
def l2_attention(out_dir: Path, ctx) -> StudyResult:
    """Constants vs R (quadratic for dot-product, bounded for L2) and vs n against Kim's bound."""
    out_dir = Path(out_dir)
    seed = ctx.seed
    g = grid(ctx.level)
    d, Rs, n_R, ns, reps = (g[k] for k in ("d", "Rs", "n_R", "ns", "reps"))
    rows_R = run_grid(l2_task, [{"kind": "spread", "R": float(R), "n": n_R, "d": d, "seed": seed} for R in Rs],
                      out_dir, "l2_vs_R", ctx, device=ctx.device)
    write_csv(rows_R, out_dir / "lipschitz_vs_R.csv")
    rows_n = run_grid(l2_task, [{"kind": kind, "R": 2.0, "n": n, "d": d, "seed": seed, "rep": r}
                                for kind in ("random", "spread") for n in ns for r in range(reps)
                                if not (kind == "spread" and n < 2)], out_dir, "l2_vs_n", ctx, device=ctx.device)
    write_csv(rows_n, out_dir / "lipschitz_vs_n.csv")

    big = [r for r in rows_R if r["R"] >= 7.99]  # the other rows' softmax has saturated: the R^2 regime
    fit = fit_loglog([r["R"] for r in big], [r["lip_dot"] for r in big])
    c_last, c_prev = (r["lip_dot"] / r["R"] ** 2 for r in (rows_R[-1], rows_R[-2]))
    quad_change = abs(c_last / c_prev - 1)
    allrows = rows_R + rows_n
    viol = [r for r in allrows if r["lip_l2"] - r["lip_l2_error"] > r["kim_bound"] * (1 + 1e-12)]
    l2_max = max(r["lip_l2"] for r in rows_R)
    bound_R = rows_R[0]["kim_bound"]

    fig, axes = P.figure(ncols=2)
    ax = axes[0]
    RR = np.array([r["R"] for r in rows_R])
    P.measured(ax, RR, [r["lip_dot"] for r in rows_R], "dot-product attention")
    P.measured(ax, RR, [r["lip_l2"] for r in rows_R], "L2 attention (tied W_Q)", color=P.COLORS[1])
    P.theory(ax, RR, c_last * RR**2, f"{c_last:.3g} R^2", color=P.COLORS[0], kind="limit")
    P.theory(ax, RR, [bound_R] * len(RR), f"Kim et al. Thm 3.2 bound (N={n_R})", color="k")
    P.finish(ax, "radius R", "local Lipschitz constant", f"one token at 0, {n_R - 1} at radius R, d={d}",
             logx=True, logy=True)
    ax = axes[1]
    for i, kind in enumerate(("random", "spread")):
        sel = [r for r in rows_n if r["kind"] == kind]
        nn = sorted({r["n"] for r in sel})
        P.measured(ax, nn, [max(r["lip_l2"] for r in sel if r["n"] == m) for m in nn], f"L2, {kind} inputs (max)",
                   color=P.COLORS[i + 1])
    nn = sorted({r["n"] for r in rows_n})
    P.theory(ax, nn, [next(r["kim_bound"] for r in rows_n if r["n"] == m) for m in nn],
             "Kim et al. Thm 3.2 (2-norm)", color="k")
    P.finish(ax, "sequence length n", "local Lipschitz constant of L2 attention", f"R = 2, d={d}",
             logx=True, logy=True)
    save_figure(fig, out_dir / "dot_vs_l2.png")

    claims = [
        Claim("dot-product attention is not globally Lipschitz: Lip grows like R^2 (zero plus spread)",
              "Lip / R^2 -> constant > 0",
              f"Lip / R^2 = {c_prev:.4g} -> {c_last:.4g} at R = {rows_R[-2]['R']:.3g}, {rows_R[-1]['R']:.3g} "
              f"(change {quad_change:.1%}); log-log slope {fit['slope']:.2f} [{fit['lo']:.2f}, {fit['hi']:.2f}] "
              f"for R >= {big[0]['R']:.3g}", quad_change <= 0.05,
              "agrees if Lip / R^2 changes by at most 5% between the two largest radii; the slope fit includes "
              "the pre-asymptotic range where other rows' softmax is not yet saturated", kind=THEOREM,
              fails_if="Lip / R^2 changes by more than 5% between the two largest radii"),
        Claim("L2 attention stays bounded in R", f"<= Kim bound {bound_R:.4g}",
              f"max over R = {l2_max:.4g} (dot-product reaches {max(r['lip_dot'] for r in rows_R):.4g})",
              l2_max <= bound_R, kind=THEOREM, fails_if="the L2 constant exceeds Kim et al.'s bound at some radius"),
        Claim("Kim et al. Theorem 3.2 (2-norm form as corrected in meanfield.bounds) is never below L2 constants",
              "Lip <= bound", f"{len(viol)} violations of {len(allrows)}; max Lip/bound = "
              f"{max(r['lip_l2'] / r['kim_bound'] for r in allrows):.3g}", not viol,
              "the form recalled in the paper's notes is false (docs/math.md section 5); "
              "meanfield.bounds.l2_attention_upper documents the fourth-power correction", kind=THEOREM,
              fails_if="a certified L2 constant minus its error bar exceeds the bound"),
    ]
    notes = (f"W_Q, W_V are {d}x{d} Gaussian / sqrt(d) (seed {seed}); the dot-product layer uses A = W_Q W_Q^T / "
             "sqrt(k) and V = I, the L2 layer the same W_Q (tied queries and keys) and W_V, W_O = I.")
    return StudyResult("l2_attention", "Dot-product vs L2 attention", claims, ["dot_vs_l2.png"],
                       ["lipschitz_vs_R.csv", "lipschitz_vs_n.csv"],
                       {"dot_slope": fit, "l2_max_over_R": l2_max, "kim_bound_R": bound_R}, notes)
