"""Study 6: discrete vs mean-field (Lemma 3.2 and convergence in n).

* Lemma 3.2: the local constant of F at the uniform measure m(X) (W2 sense among n-atom measures,
  Lemma C.5) equals Lip_X(f) of the sequence, for random X; and that W2 sense itself, at measures of unequal
  weights (where a wrong weighting of the Jacobian would show), against exact W2 ratios of moved measures.
* n i.i.d. samples of a fixed measure mu (uniform on the disc of radius r in d = 2; compact
  support matters: for a Gaussian the sample's largest atoms drift outwards as n grows and the
  local constant, which sees single atoms, grows with them): as n grows the
  empirical measure approaches mu in W2 (measured against an independent large reference sample)
  and the local constants and Lipschitz ratios W2(F mu_n, F T#mu_n) / W2(mu_n, T#mu_n) (T a fixed
  smooth displacement) concentrate: their spread over independent samples shrinks (the log-log slope of
  the variance against n, fitted on every n: ``studies.common.variance_trend``; the mean-field values
  themselves are not computed).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from .. import plotting as P
from ..common import fit_loglog, mean_std_by_n, seeded_attention, to_device, uniform_ball, variance_trend
from ..contract import EMPIRICAL, THEOREM, Claim, StudyResult, register
from ..grid import run_grid
from ..io import save_figure, write_csv
from . import at_scale

__all__ = ["discrete_vs_meanfield", "lemma_3_2_task", "w2_sense_task", "sample_task", "displacement", "grid"]

RADIUS = 1.5


def displacement(X: torch.Tensor, eps: float = 0.1) -> torch.Tensor:
    """T(x) = x + eps (sin x_2, cos x_1, ...): a fixed smooth map (the 'nu = T # mu' of the ratios)."""
    return X + eps * torch.sin(X.flip(-1) + 0.3)


def lemma_3_2_task(n: int, d: int, R: float, seed: int, rep: int, *, device=None) -> dict:
    from meanfield import local_lipschitz
    from particles import Measure

    att = seeded_attention(d, seed, device)
    g = torch.Generator().manual_seed(int(seed) * 1000 + 31 * n + rep)
    X = to_device(device, R * torch.randn(n, d, generator=g, dtype=torch.float64) / math.sqrt(d))
    seq = local_lipschitz(att, X, method="lanczos", tol=1e-10)
    mea = local_lipschitz(att, Measure.empirical(X), method="lanczos", tol=1e-10)
    return {"lip_sequence": float(seq.value), "lip_measure": float(mea.value),
            "error": float(seq.error) + float(mea.error),
            "rel_diff": abs(float(seq.value) - float(mea.value)) / float(seq.value)}


#: the W2 displacement (relative to the radius) along which the W2 ratio approximates the local constant; the ratio's
#: error is first order in it (1e-6 left 2e-7 to 5e-6 relative on the study's measures)
W2_STEP = 1e-6
#: tolerance of the W2-sense check: the ratio along the top direction within this (relative) of the constant, and
#: no ratio along a random direction above the constant by more than it
W2_TOL = 1e-4


def w2_sense_task(n: int, d: int, R: float, seed: int, rep: int, *, device=None) -> dict:
    """The W2 sense of the local constant (Lemma C.5) at a measure of unequal weights, against W2 itself: the
    constant, the ratio W2(F mu', F mu) / W2(mu', mu) for mu' = mu moved by W2_STEP R along the constant's top
    direction (atom j by u_j / sqrt(a_j)), and the largest such ratio over random directions (exact W2, POT).
    At equal weights the weighting is invisible (Lemma 3.2's check alone cannot see a wrong one)."""
    from meanfield import lipschitz_ratio, local_lipschitz
    from particles import Measure

    att = seeded_attention(d, seed, device)
    g = torch.Generator().manual_seed(int(seed) * 1000 + 31 * n + rep + 500_000)
    X = R * torch.randn(n, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.05
    w = w / w.sum()
    mu = Measure(to_device(device, X), to_device(device, w))
    est = local_lipschitz(att, mu, method="lanczos", tol=1e-10)

    def ratio(u):   # u: (n, d) displacement of the atoms, scaled to W2 = W2_STEP R
        u = u / float((w[:, None] * u ** 2).sum().sqrt())
        return float(lipschitz_ratio(att, mu, Measure(to_device(device, X + W2_STEP * R * u), mu.weights)))

    top = ratio(est.vector.detach().cpu().reshape(n, d) / w.sqrt()[:, None])
    rnd = max(ratio(torch.randn(n, d, generator=g, dtype=torch.float64)) for _ in range(8))
    lip = float(est.value)
    return {"lip": lip, "ratio_top": top, "ratio_random_max": rnd, "top_rel_diff": abs(top - lip) / lip,
            "random_excess": max(0.0, rnd / lip - 1.0)}


def sample_task(n: int, d: int, seed: int, rep: int, n_ref: int, *, device=None) -> dict:
    """Local constant, Lipschitz ratio and W2 to a reference sample for one sample of size n."""
    from meanfield import lipschitz_ratio, local_lipschitz
    from particles import Measure
    from transport import w2

    att = seeded_attention(d, seed, device)
    X = to_device(device, uniform_ball(n, d, RADIUS, seed * 100003 + 7 * n + rep + 1))
    # the reference sample, independent of every sample
    ref = Measure(to_device(device, uniform_ball(n_ref, d, RADIUS, seed * 100003 + 999_999_937)))
    mu = Measure(X)
    return {"lip": float(local_lipschitz(att, mu, method="lanczos", tol=1e-8).value),
            "ratio": float(lipschitz_ratio(att, mu, mu.pushforward(displacement))),
            "w2_to_reference": float(w2(mu, ref))}


def grid(level: str) -> dict:
    """Sizes: sequence lengths and repetitions of the Lemma 3.2 check; sample sizes, samples per size and
    the size of the reference sample of the convergence study."""
    if level == "tiny":
        return {"ns_lemma": [3, 5], "reps_lemma": 1, "ns": [8, 16, 32, 64], "reps": 3, "n_ref": 256}
    if level == "quick":
        return {"ns_lemma": [4, 8, 16, 32], "reps_lemma": 2, "ns": [16, 32, 64, 128, 256], "reps": 5, "n_ref": 768}
    return {"ns_lemma": [4, 8, 16, 32, 64, 128], "reps_lemma": 4, "ns": [16, 32, 64, 128, 256, 512, 1024, 2048],
            "reps": 12, "n_ref": 3000}


def _concentration_claim(what: str, key: str, trend: dict, spread: dict, ns: list, reps: int) -> Claim:
    """discrete_vs_meanfield-3/4: the spread of ``what`` over samples shrinks with n
    (``studies.common.variance_trend``)."""
    t, (first, last) = trend[key], spread[key]
    return Claim(f"{what} of samples concentrate as n grows", "spread over samples shrinks",
                 f"variance over samples against n: log-log slope {t['slope']:.2f} [{t['lo']:.2f}, {t['hi']:.2f}] "
                 f"(95% CI; a central limit rate: -1), from {len(ns)} n with {reps} samples each; std {first:.3g} "
                 f"at n = {ns[0]} -> {last:.3g} at n = {ns[-1]}"
                 + (f"; the groups scatter {t['dispersion']:.2g} times as much as Gaussian samples allow, so the "
                    f"interval is {math.sqrt(t['dispersion']):.2g} times the Gaussian model's"
                    if t.get("dispersion", 1.0) > 1 else ""), t["verdict"],
                 "the log-log slope of the variance over samples against n, fitted on every n (weighted least "
                 "squares on log s^2, Gaussian-sample weights; the interval widened by sqrt(chi^2 / dof) where the "
                 "groups scatter more than Gaussian samples allow): reproduced if its 95% CI lies below 0, not "
                 "reproduced if above, inconclusive otherwise", kind=EMPIRICAL,
                 fails_if="the 95% CI of the log-log slope of the variance over samples against n lies above 0 (the "
                          "spread grows with n)",
                 short=f"{what} of samples concentrate as n grows",
                 short_measured=f"variance slope {t['slope']:.2f} [{t['lo']:.2f}, {t['hi']:.2f}] (95% CI, < 0)")


#: what each figure shows (the report prints it under the figure)
CAPTIONS = {
    "convergence_in_n.png": (
        "Left: the local constant at the empirical measure mu_n of n samples of the uniform measure on a disc, and "
        "the Lipschitz ratio W2(F mu_n, F T#mu_n) / W2(mu_n, T#mu_n), against n (mean, band +- 1 std over samples). "
        "Middle: W2 from mu_n to an independent reference sample, with its fitted slope and the n^(-1/2) rate. "
        "Right: the variances over samples that the concentration claims fit, with the fitted slopes (their 95% "
        "intervals, widened where the groups scatter more than Gaussian samples would, in the legend), beside the "
        "1/n rate; a "
        "concentration claim is inconclusive while its interval holds 0."),
    "at_scale.png": (
        "The local constants of N-sample measures at the accelerator's sizes (blue; mean, band +- 1 std over "
        "samples) continuing the study's own grid (orange); the at-scale claims expect the mean to settle as N "
        "grows (the discrete constants approaching the mean-field one) and the spread to shrink."),
}


@register("discrete_vs_meanfield", "Discrete vs mean-field: Lemma 3.2 and convergence in n", grid=grid)
def discrete_vs_meanfield(out_dir: Path, ctx) -> StudyResult:
    """Lemma 3.2 (uniform measure = sequence) and convergence of constants and ratios for i.i.d. samples."""
    out_dir = Path(out_dir)
    seed = ctx.seed
    g = grid(ctx.level)
    ns_lemma, reps_lemma, ns, reps, n_ref = (g[k] for k in ("ns_lemma", "reps_lemma", "ns", "reps", "n_ref"))
    d = 2
    rows_l = run_grid(lemma_3_2_task, [{"n": n, "d": 3, "R": 2.0, "seed": seed, "rep": r}
                                       for n in ns_lemma for r in range(reps_lemma)], out_dir, "lemma_3_2", ctx,
                      device=ctx.device)
    write_csv(rows_l, out_dir / "lemma_3_2.csv")
    rows_w = run_grid(w2_sense_task, [{"n": n, "d": 3, "R": 2.0, "seed": seed, "rep": r}
                                      for n in ns_lemma[:3] for r in range(reps_lemma)], out_dir, "w2_sense", ctx,
                      device=ctx.device)
    write_csv(rows_w, out_dir / "w2_sense.csv")
    w_top = max(r["top_rel_diff"] for r in rows_w)
    w_rnd = max(r["random_excess"] for r in rows_w)
    rows = run_grid(sample_task, [{"n": n, "d": d, "seed": seed, "rep": r, "n_ref": n_ref}
                                  for n in ns for r in range(reps)], out_dir, "samples", ctx, device=ctx.device)
    write_csv(rows, out_dir / "samples.csv")

    worst = max(rows_l, key=lambda r: r["rel_diff"])
    stats = mean_std_by_n(rows, ("lip", "ratio", "w2_to_reference"))
    write_csv(stats, out_dir / "samples_summary.csv")
    w2fit = fit_loglog(ns, [s["w2_to_reference_mean"] for s in stats])
    spread = {k: (stats[0][f"{k}_std"], stats[-1][f"{k}_std"]) for k in ("lip", "ratio")}
    trend = {k: variance_trend(stats, k) for k in ("lip", "ratio")}

    fig, axes = P.figure(ncols=3, width=15.5, height=4.6)
    ax = axes[0]
    nn = np.array(ns, float)
    for i, (key, label) in enumerate((("lip", "local constant at mu_n"), ("ratio", "ratio W2(F mu, F T#mu)/W2"))):
        m = np.array([s[f"{key}_mean"] for s in stats])
        sd = np.array([s[f"{key}_std"] for s in stats])
        P.measured(ax, nn, m, label + " (mean)", color=P.COLORS[i])
        P.band(ax, nn, m - sd, m + sd, color=P.COLORS[i], label="± 1 std over samples")
    P.finish(ax, "sample size n", "Lipschitz constant / ratio", f"{reps} samples per n, uniform on a disc "
             f"(r = {RADIUS})", logx=True, legend=False)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower left", ncol=1)
    ax = axes[1]
    m = np.array([s["w2_to_reference_mean"] for s in stats])
    sd = np.array([s["w2_to_reference_std"] for s in stats])
    P.measured(ax, nn, m, "W2(mu_n, reference) (mean)")
    P.band(ax, nn, m - sd, m + sd, color=P.COLORS[0], label="± 1 std over samples")
    P.theory(ax, nn, np.exp(w2fit["intercept"]) * nn ** w2fit["slope"], f"fit: slope {w2fit['slope']:.2f}",
             color="gray", kind="limit")
    P.theory(ax, nn, m[0] * (nn / nn[0]) ** -0.5, "n^(-1/2) reference", color="k", kind="lower")
    P.finish(ax, "sample size n", "W2 to a reference sample", f"reference: {n_ref} independent samples",
             logx=True, logy=True, legend=False)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=1)
    # (c) what discrete_vs_meanfield-3/4 fit: the variance over samples against n, with the fitted slope and its CI
    ax = axes[2]
    for i, (key, label) in enumerate((("lip", "local constants"), ("ratio", "Lipschitz ratios"))):
        var = np.array([s[f"{key}_std"] ** 2 for s in stats])
        P.measured(ax, nn, var, f"{label}: variance over samples", color=P.COLORS[i])
        t = trend[key]
        if math.isfinite(t["slope"]):
            x0, y0 = t["centre"]
            P.theory(ax, nn, np.exp(y0 + t["slope"] * (np.log(nn) - x0)),
                     f"{label}: fitted slope {t['slope']:.2f} [{t['lo']:.2f}, {t['hi']:.2f}]", color=P.COLORS[i],
                     kind="limit")
    P.theory(ax, nn, stats[0]["lip_std"] ** 2 * nn[0] / nn, "1/n (central limit rate)",
             color="k", kind="lower")
    P.finish(ax, "sample size n", "variance over samples", "the spread the concentration claims fit\n"
             "(95% CIs of the slope; inconclusive when they hold 0)", logx=True, logy=True, legend=False)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower right", ncol=1)
    save_figure(fig, out_dir / "convergence_in_n.png")

    claims = [
        Claim("Lemma 3.2: Lip of F at m(X) (W2 sense) equals Lip_X(f)", "relative difference 0",
              f"max relative difference {worst['rel_diff']:.1e} over {len(rows_l)} random sequences; the W2 sense "
              f"at {len(rows_w)} measures of unequal weights: the W2 ratio along the top direction within "
              f"{w_top:.1e} of the constant, ratios along 8 random directions at most {w_rnd:.1e} above it",
              all(r["rel_diff"] <= 1e-7 for r in rows_l) and w_top <= W2_TOL and w_rnd <= W2_TOL,
              f"tolerance 1e-7 (Lanczos, tol 1e-10); the W2 sense (Lemma C.5's weighted Jacobian) against exact "
              f"W2 ratios of measures moved by {W2_STEP:g} R, tolerance {W2_TOL:g} (the ratio's error is first "
              "order in the step)", kind=THEOREM,
              fails_if="for some sequence the two constants differ by more than 1e-7 (relative), or at a measure of "
                       f"unequal weights the W2 ratio along the constant's top direction differs from it, or a ratio "
                       f"along a random direction exceeds it, by more than {W2_TOL:g} (relative): a weighting of the "
                       "Jacobian other than Lemma C.5's, invisible at equal weights",
              short="Lemma 3.2: Lip of F at m(X) (W2 sense) = Lip_X(f)",
              short_measured=f"max relative difference {worst['rel_diff']:.1e} ({len(rows_l)} sequences); W2 "
                             f"ratios within {max(w_top, w_rnd):.0e}"),
        Claim("the empirical measure converges to mu in W2", "W2(mu_n, reference) decreasing in n",
              f"log-log slope {w2fit['slope']:.3f} [{w2fit['lo']:.3f}, {w2fit['hi']:.3f}]", w2fit["hi"] < 0,
              "agrees if the 95% CI of the slope is negative (d = 2: rate n^(-1/2) up to logs, floored by the "
              "reference sample's own error)", kind=EMPIRICAL,
              fails_if="the 95% CI of the log-log slope of W2(mu_n, reference) against n reaches 0 or above",
              short="the empirical measure converges to mu in W2",
              short_measured=f"slope {w2fit['slope']:.3f} [{w2fit['lo']:.3f}, {w2fit['hi']:.3f}] (95% CI, < 0)"),
        _concentration_claim("local constants", "lip", trend, spread, ns, reps),
        _concentration_claim("Lipschitz ratios", "ratio", trend, spread, ns, reps),
    ]
    notes = (f"mu = uniform on the disc of radius {RADIUS}; A and V are 2x2 Gaussian matrices / sqrt(2) (seed {seed}); "
             "T(x) = x + 0.1 sin(x reversed + 0.3). The local constant at mu_n is the W2-sense constant among "
             f"n-atom measures (Lemma C.5). Means and standard deviations over {reps} independent samples.")
    figures, tables = ["convergence_in_n.png"], ["lemma_3_2.csv", "w2_sense.csv", "samples.csv",
                                                 "samples_summary.csv"]
    summary = {"lemma_3_2_max_rel_diff": worst["rel_diff"], "w2_slope": w2fit, "final": stats[-1]}
    scale = at_scale.grid(ctx.level, ctx.device)
    if scale is None:
        notes += (" With --device cuda the study also measures the local constants of samples of 10^4 to 10^6 "
                  "points (studies.experiments.at_scale); not on this device.")
    else:
        points = [{"n": n, "radius": RADIUS, "seed": seed, "rep": r} for n in scale["Ns"] for r in range(scale["reps"])]
        rows_s = run_grid(at_scale.lipschitz_task, points, out_dir, "at_scale", ctx, device=ctx.device)
        write_csv(rows_s, out_dir / "at_scale.csv")
        claims_s, stats_s = at_scale.lipschitz_claims(rows_s)
        claims += claims_s
        fig, ax = P.figure(width=7.5)
        at_scale.lipschitz_figure(ax, stats_s, stats)
        save_figure(fig, out_dir / "at_scale.png")
        figures.append("at_scale.png")
        tables.append("at_scale.csv")
        summary["at_scale"] = stats_s
        # config.json records grid(level); this part's sizes also depend on the device
        summary["at_scale_grid"] = scale
    return StudyResult("discrete_vs_meanfield", "Discrete vs mean-field", claims, figures, tables, summary, notes,
                       captions={f: CAPTIONS[f] for f in figures})
