"""The discrete-versus-mean-field and dynamics studies at the sizes a GPU reaches (N = 10^4 to 10^6).

Not a study of its own: :mod:`studies.experiments.discrete_vs_meanfield` and
:mod:`studies.experiments.dynamics` call it when the run has an accelerator (``--device cuda``); on
the CPU :func:`grid` is None and their grids are what they always were.

* **Local constants of N-sample measures** (Lemma 3.2's object, sampled): the certified local constant
  of F at the empirical measure of N i.i.d. points uniform on the disc of the discrete-versus-mean-field
  study, for N up to 10^6, several independent samples per N. As N grows the constants should
  concentrate (the variance over samples falling with N, by its log-log slope fitted on every N) and settle
  (the means at the two largest N agreeing within their standard errors), the picture of the CPU grid
  (N <= 2048) carried three decades further.
* **Clustering of N tokens on the sphere** (Geshkovski et al., SA model, beta = 1, d = 3) from uniform
  starts. The uniform measure is an equilibrium of the mean-field flow, so N tokens leave it only through
  their sampling fluctuations: the order parameter |mean of the tokens| starts at about N^(-1/2), and a
  linear instability takes a time proportional to (1/2) log N to bring it to order one. Measured: the time
  it reaches 0.5, for each N and start, and the clusters left at the final time. On the CPU (N = 100 to
  3000, two starts each) this escape time rose by 0.71 per unit of log N (95% CI [0.47, 0.96]); the GPU
  sizes carry it over three more decades.

Everything here runs on the CPU too (the tests run it at small N); only the sizes are for a GPU. The local constants
from :data:`SERIES_FROM` points are certified through the series engine (``local_lipschitz(attention="series")``,
:mod:`meanfield.series_jacobian`: O(N) per Jacobian product; 10^5 points in about 45 s on 2 CPU cores); the clustering
runs take it too (:mod:`meanfield.series_attention`: the tokens' scores are bounded by beta = 1, so
``simulate``'s ``auto`` evaluates the field in O(N) from about 3800 tokens in float64): on 2 CPU cores 10^5 tokens
run to T = 30 in under 7 minutes (benchmarks/README.md, "The series engine").
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from .. import plotting as P
from ..common import (
    fit_loglog,
    mean_std_by_n,
    seeded_attention,
    to_device,
    uniform_ball,
    uniform_sphere,
    variance_trend,
)
from ..contract import EMPIRICAL, Claim

__all__ = ["grid", "lipschitz_task", "cluster_task", "lipschitz_claims", "cluster_claims", "lipschitz_figure",
           "cluster_figure"]

D = torch.float64
BETA = 1.0


def grid(level: str, device: str) -> dict | None:
    """Sizes of the at-scale part for a level on a device: None on the CPU (the CPU grids stay as they are).

    ``Ns``: sample sizes of the local constants, ``reps`` samples each; ``cluster_Ns``: token counts of the
    sphere dynamics (``cluster_reps`` starts each), run to ``T`` with RK4 steps of ``step``, the spread
    recorded every ``dt``."""
    if device == "cpu":
        return None
    if level == "tiny":
        return {"Ns": [10_000, 20_000, 40_000], "reps": 3, "cluster_Ns": [1_000, 3_000, 10_000], "cluster_reps": 2,
                "T": 30.0, "step": 0.25, "dt": 0.5}
    if level == "quick":
        return {"Ns": [10_000, 30_000, 100_000], "reps": 5, "cluster_Ns": [1_000, 10_000, 100_000],
                "cluster_reps": 2, "T": 30.0, "step": 0.25, "dt": 0.5}
    return {"Ns": [10_000, 30_000, 100_000, 300_000, 1_000_000], "reps": 3,
            "cluster_Ns": [1_000, 10_000, 100_000, 1_000_000], "cluster_reps": 2, "T": 30.0, "step": 0.25, "dt": 0.5}


# ---------------------------------------------------------------------------- local constants of samples
#: sample sizes from which the local constants run through the series (meanfield.series_jacobian: O(N) per
#: product instead of O(N^2), the same certificate plus a proved truncation term of some 1e-14): on 2 CPU cores at
#: N = 1e4 it took half the default path's time (10.5 s against 21 s), at 1e5 91 s
SERIES_FROM = 5000


def lipschitz_task(n: int, radius: float, seed: int, rep: int, *, device=None, attention: str = "auto") -> dict:
    """Certified local constant (W2 sense) of the discrete-versus-mean-field operator at the empirical measure
    of n i.i.d. points uniform on its disc of ``radius`` (float64, Lanczos at tol 1e-6), with its cost.
    ``attention``: "auto" (the series from :data:`SERIES_FROM` points where its radius allows, else the default
    path), "series" or "exact". Picklable task."""
    from meanfield import local_lipschitz, series_jacobian
    from particles import Measure

    if attention not in ("auto", "series", "exact"):
        raise ValueError(f"attention: expected 'auto', 'series' or 'exact', got {attention!r}")
    att = seeded_attention(2, seed, device)
    X = to_device(device, uniform_ball(int(n), 2, radius, seed * 100003 + 7 * int(n) + rep + 1))
    if attention == "auto":
        attention = "exact"
        if n >= SERIES_FROM:
            try:
                series_jacobian.degree(att, X[None])
                attention = "series"
            except ValueError:
                pass
    t0 = time.perf_counter()
    est = local_lipschitz(att, Measure(X), method="lanczos", tol=1e-6, on_failure="warn",
                          attention=attention)
    return {"lip": float(est.value), "lip_error": float(est.error), "converged": bool(est.converged),
            "products": int(est.applications), "seconds": time.perf_counter() - t0, "attention": attention}


def lipschitz_claims(rows: list[dict]) -> tuple[list[Claim], list[dict]]:
    """Concentration (the log-log slope of the variance over samples against N, fitted on every N:
    ``studies.common.variance_trend``, as discrete_vs_meanfield-3/4 on the CPU grid) and settling (the means
    of the two largest N agree within three standard errors or 1%) of the local constants of N-sample
    measures; a non-converged estimate makes both fail. Returns the claims and the per-N statistics."""
    ns = sorted({r["n"] for r in rows})
    stats = mean_std_by_n(rows, ("lip",))
    bad = [r for r in rows if not r["converged"]]
    first, last = stats[0], stats[-1]
    t = variance_trend(stats, "lip")
    shrinks = False if bad else t["verdict"]
    claims = [
        Claim(f"local constants of N-sample measures concentrate up to N = {ns[-1]:g}",
              "the spread over samples shrinks as N grows",
              f"variance over samples against N: log-log slope {t['slope']:.2f} [{t['lo']:.2f}, {t['hi']:.2f}] "
              f"(95% CI; a central limit rate: -1), from {len(ns)} N; std {first['lip_std']:.3g} at N = "
              f"{ns[0]:g} -> {last['lip_std']:.3g} at N = {ns[-1]:g} ({first['samples']} and {last['samples']} "
              f"samples){'; ' + str(len(bad)) + ' estimate(s) did not converge' if bad else ''}", shrinks,
              "the log-log slope of the variance over samples against N, fitted on every N (weighted least squares "
              "on log s^2, Gaussian-sample weights, the interval widened by sqrt(chi^2 / dof) where the groups "
              "scatter more than that; at least three N of two samples): reproduced if its 95% CI lies "
              "below 0, not reproduced if above or an estimate did not converge, inconclusive otherwise; certified "
              "estimates (Lanczos, tol 1e-6, float64)", kind=EMPIRICAL,
              fails_if="the 95% CI of the log-log slope of the variance over samples against N lies above 0 (the "
                       "spread grows with N), or some estimate did not converge",
              short=f"local constants concentrate up to N = {ns[-1]:g}",
              short_measured=f"variance slope {t['slope']:.2f} [{t['lo']:.2f}, {t['hi']:.2f}] (95% CI, < 0)")]
    if len(stats) >= 2:
        prev = stats[-2]
        step = abs(last["lip_mean"] - prev["lip_mean"])
        se = math.sqrt(last["lip_std"] ** 2 / last["samples"] + prev["lip_std"] ** 2 / prev["samples"])
        allowed = max(3.0 * se, 0.01 * last["lip_mean"])
        settled = bool(step <= allowed and not bad)
        measured = (f"mean {prev['lip_mean']:.4g} at N = {prev['n']:g}, {last['lip_mean']:.4g} at N = {last['n']:g}: "
                    f"change {step:.2g}, allowed {allowed:.2g}")
    else:
        settled, measured = None, "one sample size: nothing to compare"
    claims.append(Claim(f"the mean local constant has settled at N = {ns[-1]:g}",
                        "the means at the two largest N agree",
                        measured, settled, "allowed: three standard errors of the difference, or 1% of the mean if "
                                           "larger", kind=EMPIRICAL,
                        fails_if="the means at the two largest N differ by more than three standard errors and 1% "
                                 "(a constant that still drifts with N), or some estimate did not converge",
                        short=f"the mean local constant has settled at N = {ns[-1]:g}",
                        short_measured=f"change {measured.split('change ')[-1]}" if len(stats) >= 2 else measured))
    return claims, stats


def lipschitz_figure(ax, stats: list[dict], small: list[dict] | None = None) -> None:
    """Mean +- std of the local constants over N, the CPU grid's points (``small``: its summary rows) first."""
    if small:
        nn = np.array([s["n"] for s in small], float)
        m = np.array([s["lip_mean"] for s in small])
        sd = np.array([s["lip_std"] for s in small])
        P.measured(ax, nn, m, f"N <= {nn.max():g}, the study's grid (mean, shaded ± 1 std over samples)",
                   color=P.COLORS[1])
        P.band(ax, nn, m - sd, m + sd, color=P.COLORS[1])
    nn = np.array([s["n"] for s in stats], float)
    m = np.array([s["lip_mean"] for s in stats])
    sd = np.array([s["lip_std"] for s in stats])
    P.measured(ax, nn, m, "at scale (mean, shaded ± 1 std over samples)", color=P.COLORS[0])
    P.band(ax, nn, m - sd, m + sd, color=P.COLORS[0])
    P.finish(ax, "sample size N", "local constant at mu_N (W2 sense)", "local constants of N-sample measures",
             logx=True)


# ---------------------------------------------------------------------------- clustering of N tokens
#: the order parameter |mean of the tokens| (about N^(-1/2) at a uniform start, 1 for one cluster) whose
#: crossing times the escape from the uniform start
ORDER_LEVEL = 0.5
#: single-linkage distance of the final cluster count (absolute, as in the dynamics study)
CLUSTER_TOL = 1e-3


def spread(X: torch.Tensor) -> float:
    """The largest distance of a token on the unit sphere to the normalized mean direction (2 for
    uniform tokens, 0 for one cluster); O(N). Tokens whose mean is 0 (an exactly symmetric start) have no mean
    direction: their spread is the largest distance to any unit vector, 2 at most, and is returned as 2."""
    m = X.mean(dim=0)
    norm = float(m.norm())
    if norm == 0.0:
        return 2.0
    return float((X - m / norm).norm(dim=1).max())


def cluster_task(n: int, T: float, step: float, dt: float, seed: int, rep: int = 0, *, device=None) -> dict:
    """n tokens uniform on the unit sphere of R^3 under the SA model (beta = 1), RK4 steps of ``step`` with
    retraction, to time T, in segments of ``dt`` (memory O(N): only the current tokens are kept). Records
    every ``dt`` the order parameter |mean of the tokens| and the spread (:func:`spread`); ``t_escape`` is
    the first time the order parameter reaches :data:`ORDER_LEVEL` (log-linear interpolation between
    records; NaN if never), and ``clusters_T`` the number of clusters at T (single linkage at
    :data:`CLUSTER_TOL`). Picklable task."""
    from meanfield import IsotropicAttention, simulate
    from meanfield.clustering import count_clusters
    from particles import Measure

    X = to_device(device, uniform_sphere(int(n), 3, seed * 7919 + 104729 * rep + int(n)))
    op = IsotropicAttention(BETA, "SA")
    times, spreads, order = [0.0], [spread(X)], [float(X.mean(dim=0).norm())]
    t0 = time.perf_counter()
    k_total = int(round(float(T) / float(dt)))
    for k in range(k_total):
        span = torch.tensor([k * dt, (k + 1) * dt], dtype=D)
        X = simulate(op, Measure(X), span, geometry="sphere", options={"step": float(step)}).final.points
        times.append((k + 1) * dt)
        spreads.append(spread(X))
        order.append(float(X.mean(dim=0).norm()))
    seconds = time.perf_counter() - t0
    return {"t_escape": _crossing(times, order, ORDER_LEVEL), "clusters_T": int(count_clusters(X, CLUSTER_TOL)),
            "times": times, "order": order, "spreads": spreads, "drift": float((X.norm(dim=1) - 1).abs().max()),
            "seconds": seconds}


def _crossing(times, values, level) -> float:
    """The first time ``values`` (non-negative) pass ``level``, either way, interpolated in log (linearly from
    0); NaN if never."""
    for k in range(1, len(values)):
        if min(values[k - 1], values[k]) < level <= max(values[k - 1], values[k]) and values[k] != values[k - 1]:
            if min(values[k - 1], values[k]) <= 0.0:   # an exactly symmetric start: 0 has no log, interpolate linearly
                a, b, x = values[k - 1], values[k], level
            else:
                a, b, x = math.log(values[k - 1]), math.log(values[k]), math.log(level)
            return times[k - 1] + (x - a) / (b - a) * (times[k] - times[k - 1])
    return math.nan


def cluster_claims(rows: list[dict], T: float) -> list[Claim]:
    """Collapse to one cluster at every N, and the escape time growing like log N."""
    rows = sorted(rows, key=lambda r: (r["n"], r.get("rep", 0)))
    ns = sorted({r["n"] for r in rows})
    final = {n: max(r["clusters_T"] for r in rows if r["n"] == n) for n in ns}
    escaped = all(math.isfinite(r["t_escape"]) for r in rows)
    claims = [Claim(f"N tokens on the sphere (SA, beta = 1, d = 3) collapse to one cluster, N up to {ns[-1]:g}",
                    f"one cluster at T = {T:g} for every N and start",
                    "; ".join(f"N = {n:g}: {final[n]} cluster" + ("s" if final[n] != 1 else "") for n in ns),
                    bool(all(c == 1 for c in final.values()) and all(r["drift"] < 1e-10 for r in rows)),
                    f"single linkage at {CLUSTER_TOL:g}; RK4 with retraction; uniform starts", kind=EMPIRICAL,
                    fails_if="for some N and start more than one cluster remains at T, or a token leaves the sphere "
                             "by 1e-10 or more",
                    short=f"N tokens on the sphere collapse to one cluster, N up to {ns[-1]:g}",
                    short_measured="clusters at T: " + ", ".join(str(final[n]) for n in ns))]
    from meanfield.isotropic import uniform_growth_rate

    slope = 1.0 / (2.0 * uniform_growth_rate(BETA, "SA", d=3))   # log(N^(1/2)) / lambda_1 (docs/math.md 6.6)
    if escaped and len(ns) >= 3:
        fit = fit_loglog([r["n"] for r in rows], [math.exp(r["t_escape"]) for r in rows])   # t against log N
        ok = fit["lo"] > 0 and fit["lo"] <= slope <= fit["hi"]
        c = fit["intercept"]
        measured = (f"t_escape = {fit['slope']:.3g} log N {'+' if c >= 0 else '-'} {abs(c):.3g}, slope's 95% CI "
                    f"[{fit['lo']:.3g}, {fit['hi']:.3g}] ({len(rows)} runs), against 1 / (2 lambda_1) = {slope:.3g}")
        short_measured = (f"slope {fit['slope']:.3g} [{fit['lo']:.3g}, {fit['hi']:.3g}] per unit of log N "
                          f"(predicted {slope:.3g})")
    else:
        ok, measured = False, "not every run escaped by T (or fewer than 3 sizes): no fit"
        short_measured = "no fit: a run did not escape by T"
    claims.append(Claim("the escape from the uniform start takes longer as N grows, like log N / (2 lambda_1) (the "
                        "tokens leave the equilibrium through their N^(-1/2) sampling fluctuations, amplified at the "
                        "rate lambda_1 of the linearization)",
                        f"t_escape = a log N + c with a > 0 and a = 1 / (2 lambda_1) = {slope:.3g} within the fit's "
                        f"95% CI (t_escape: |mean of the tokens| reaches {ORDER_LEVEL:g}; lambda_1 of SA at beta = "
                        f"{BETA:g}, docs/math.md section 6.6)",
                        measured, ok, "least squares over every run; |mean| is the order parameter of the first "
                                      "(degree-1) mode, about N^(-1/2) at the start. On 2 CPU cores (N = 300 to "
                                      "10^4, three starts each) the slope was 0.85 (0.79 from N = 1000)",
                        kind=EMPIRICAL,
                        fails_if="the 95% CI of the slope of t_escape against log N reaches 0 or below, or does not "
                                 f"contain 1 / (2 lambda_1) = {slope:.3g} (a rate off by a factor 2; the CI of a few "
                                 "runs per N does not tell SA's rate from USA's, 15% apart: dynamics-11 does), or some "
                                 "run did not escape by T",
                        short="the escape from the uniform start grows like log N / (2 lambda_1)",
                        short_measured=short_measured))
    return claims


def cluster_figure(ax, rows: list[dict]) -> None:
    """The order parameter |mean of the tokens| over time for each N (log y), one curve per run."""
    ns = sorted({r["n"] for r in rows})
    for r in rows:
        i = ns.index(r["n"])
        first = r is next(q for q in rows if q["n"] == r["n"])
        P.measured(ax, r["times"], r["order"], f"N = {r['n']:g}" if first else None,
                   color=P.COLORS[i % len(P.COLORS)], marker="")
    ax.axhline(ORDER_LEVEL, color="gray", lw=0.8, ls=":", label=f"escape: |mean| = {ORDER_LEVEL:g}")
    P.finish(ax, "time t", "|mean of the tokens| (order parameter)", "SA on the sphere, beta = 1, d = 3, uniform "
             "starts", logy=True)
