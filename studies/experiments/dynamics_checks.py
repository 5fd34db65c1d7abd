"""The dynamics study's checks of its own instruments against independent computations.

The clustering claims of :mod:`studies.experiments.dynamics` hold for a wide family of flows: a first-order
integrator, a transposed value matrix or a W2 squared by mistake left every one of them holding (a review by
mutation). These two checks compare the instruments themselves with computations that share no code with them:

* :func:`integrator_rows`: ``meanfield.simulate`` (RK4, Euclidean and on the sphere with its retraction) against
  scipy's DOP853 at a tolerance of 1e-13 on the velocity field written out here in numpy: the characteristics
  x_i' = sum_j softmax_j(<A x_i, x_j> + log a_j) V x_j of the continuity equation (docs/math.md section 6), and on
  the sphere the tangent projection of sum_j a_j e^{beta <x_i, x_j>} x_j, normalized by its sum (SA) or not (USA),
  masked to j before i for the causal model. Each case runs at three steps, each half the one before: a
  fourth-order method divides its error by 2^4 = 16 per halving.
* :func:`assignment_w2`: W2 between two uniform clouds as an assignment problem (scipy's linear_sum_assignment on
  the atoms repeated to a common count, by Birkhoff's theorem the optimal plan of equal uniform masses is a
  permutation), against ``meanfield.clustering.w2_to_reference`` (POT's exact solver).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..contract import THEOREM, Claim

__all__ = ["integrator_rows", "integrator_claim", "assignment_w2", "w2_claim", "ORDER_RANGE", "ORDER_FLOOR",
           "W2_TOL"]

#: the error ratio per halving of the step that a fourth-order method shows (16), with room for the
#: higher-order terms at these steps (15.0 to 17.9 measured); a second-order method gives about 4, Euler 2
ORDER_RANGE = (12.0, 20.0)
#: the largest error allowed at the finest step (relative to the largest coordinate): 3e-9 to 4e-9 at seed 0, at
#: most 3e-6 over seeds 0 to 199 (the Euclidean case's random A and V set it); a field other than the formula's
#: leaves an error of order 1, which the ratios (near 1) catch as well
ORDER_FLOOR = 1e-4
#: relative agreement of two exact W2 solvers (POT's network simplex and scipy's assignment)
W2_TOL = 1e-9

# case -> (geometry, final time, the three steps)
_CASES = {
    "Euclidean, A and V random (not symmetric), weighted": ("euclidean", 1.0, (0.1, 0.05, 0.025)),
    "sphere SA, weighted": ("sphere", 2.0, (0.1, 0.05, 0.025)),
    "sphere USA, weighted": ("sphere", 2.0, (0.1, 0.05, 0.025)),
    "sphere SA, causal (positions i/n), weighted": ("sphere", 2.0, (0.1, 0.05, 0.025)),
}
_N = 16


def _numpy_field(case: str, x: np.ndarray, A, V, log_a: np.ndarray) -> np.ndarray:
    """The velocity of every particle, written out in numpy from the formulas (log-sum-exp softmax)."""
    n = x.shape[0]
    if case.startswith("Euclidean"):
        s = (x @ A.T) @ x.T + log_a[None, :]
        s = s - s.max(axis=1, keepdims=True)
        p = np.exp(s)
        return (p / p.sum(axis=1, keepdims=True)) @ (x @ V.T)
    s = x @ x.T + log_a[None, :]                                   # beta = 1
    if "causal" in case:
        s = np.where(np.arange(n)[None, :] <= np.arange(n)[:, None], s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    p = p / p.sum(axis=1, keepdims=True) if "USA" not in case else p * np.exp(m)
    G = p @ x
    return G - (G * x).sum(axis=1, keepdims=True) * x              # |x_i| = 1 along the exact flow


def _start(case: str, seed: int):
    g = torch.Generator().manual_seed(int(seed) * 7919 + 101 + len(case))
    d = 2 if case.startswith("Euclidean") else 3
    X = torch.randn(_N, d, generator=g, dtype=torch.float64)
    if d == 3:
        X = X / X.norm(dim=1, keepdim=True)
    a = torch.softmax(torch.randn(_N, generator=g, dtype=torch.float64), 0)
    A = 0.5 * torch.randn(d, d, generator=g, dtype=torch.float64)
    V = 0.5 * torch.randn(d, d, generator=g, dtype=torch.float64)
    return X, a, A, V


def integrator_rows(seed: int) -> list[dict]:
    """For each case: simulate's error at T against scipy's DOP853 (rtol = atol = 1e-13) on the numpy field, at
    three steps, and the ratios of consecutive errors."""
    from scipy.integrate import solve_ivp

    from meanfield import IsotropicAttention, SelfAttention, simulate
    from particles import Measure

    rows = []
    for case, (geometry, T, steps) in _CASES.items():
        X, a, A, V = _start(case, seed)
        An, Vn, log_a = A.numpy(), V.numpy(), a.log().numpy()
        shape = tuple(X.shape)

        def rhs(t, y, case=case, An=An, Vn=Vn, log_a=log_a, shape=shape):
            return _numpy_field(case, y.reshape(shape), An, Vn, log_a).ravel()

        ref = solve_ivp(rhs, (0.0, T), X.numpy().ravel(), method="DOP853", rtol=1e-13, atol=1e-13).y[:, -1]
        ref = ref.reshape(shape)
        if geometry == "euclidean":
            op, mu = SelfAttention(A, V), Measure(X, a)
        else:
            op = IsotropicAttention(1.0, "USA" if "USA" in case else "SA", masked="causal" in case)
            mu = Measure(X, a, positions=torch.arange(1, _N + 1, dtype=torch.float64) / _N) if "causal" in case \
                else Measure(X, a)
        errs = []
        for h in steps:
            tr = simulate(op, mu, [0.0, T], geometry=geometry, options={"steps": round(T / h)})
            errs.append(float(np.abs(tr.final.points.numpy() - ref).max() / np.abs(ref).max()))
        rows.append({"case": case, "T": T, "steps": list(steps), "errors": errs,
                     "ratios": [errs[i] / errs[i + 1] if errs[i + 1] > 0 else math.inf for i in range(len(errs) - 1)]})
    return rows


def integrator_claim(rows: list[dict]) -> Claim:
    """simulate's RK4 converges to the flow of the numpy field at fourth order: every error ratio per halving of
    the step in :data:`ORDER_RANGE`, every finest error at most :data:`ORDER_FLOOR`."""
    lo, hi = ORDER_RANGE
    bad = [r for r in rows if not (all(lo <= q <= hi for q in r["ratios"]) and r["errors"][-1] <= ORDER_FLOOR)]
    ratios = [q for r in rows for q in r["ratios"]]
    finest = max(r["errors"][-1] for r in rows)
    return Claim(
        "simulate integrates the characteristics of the continuity equation at fourth order (RK4): x_i' = "
        "Gamma_mu(x_i), Euclidean and on the sphere (SA, USA, causal), against scipy's DOP853 on the field written "
        "out in numpy",
        f"error ratio per halving of the step in [{lo:g}, {hi:g}] (2^4 = 16); error at the finest step <= "
        f"{ORDER_FLOOR:g}",
        f"{len(bad)} of {len(rows)} cases off; ratios {min(ratios):.1f} to {max(ratios):.1f}; errors at the finest "
        f"step up to {finest:.1e} (" + "; ".join(f"{r['case']}: {r['errors'][0]:.1e} -> {r['errors'][-1]:.1e}"
                                                  for r in rows) + ")",
        not bad,
        f"{_N} weighted particles; final time 1 (Euclidean, d = 2, A and V 0.5 x Gaussian) or 2 (sphere, d = 3, beta "
        "= 1); steps 0.1, 0.05, 0.025; the reference solve_ivp(method='DOP853', rtol=1e-13, atol=1e-13) on a numpy "
        "log-sum-exp softmax field that shares no code with meanfield; errors relative to the largest coordinate",
        kind=THEOREM,
        fails_if=f"some case's error ratio per halving of the step lies outside [{lo:g}, {hi:g}] (Euler gives 2, a "
                 f"second-order method 4) or its error at the finest step exceeds {ORDER_FLOOR:g} (a field other "
                 "than the formula's: a transposed V, a dropped weight or mask)",
        short="simulate's RK4 is fourth order (Euclidean, sphere, causal)",
        short_measured=f"{len(bad)} of {len(rows)} cases off; ratios {min(ratios):.1f}-{max(ratios):.1f}; finest "
                       f"error {finest:.0e}")


def assignment_w2(X: torch.Tensor, Y: torch.Tensor) -> float:
    """W2 between the uniform measures on the rows of X (n) and Y (m), m a multiple of n or n of m, as an
    assignment problem: the smaller cloud's atoms repeated to the larger count, then
    sqrt(mean squared cost of the optimal permutation) (scipy.optimize.linear_sum_assignment)."""
    from scipy.optimize import linear_sum_assignment

    x, y = X.detach().cpu().numpy(), Y.detach().cpu().numpy()
    if x.shape[0] > y.shape[0]:
        x, y = y, x
    if y.shape[0] % x.shape[0]:
        raise ValueError(f"X, Y: {X.shape[0]} and {Y.shape[0]} atoms; one count must divide the other")
    x = np.repeat(x, y.shape[0] // x.shape[0], axis=0)
    C = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    r, c = linear_sum_assignment(C)
    return float(math.sqrt(C[r, c].mean()))


def w2_claim(rows: list[dict]) -> Claim:
    """The W2 of the mean-field check (``w2_to_reference``) equals the assignment problem's at t = 0 and T, on the
    rows that carry both (``w2_check_0`` / ``w2_check_T``, the function's value against the check's reference, the
    study's own reference up to 1024 particles, and ``w2_0_assignment`` / ``w2_T_assignment``)."""
    sel = [r for r in rows if "w2_0_assignment" in r]
    devs = [abs(r[f"w2_check_{t}"] / r[f"w2_{t}_assignment"] - 1) for r in sel for t in ("0", "T")]
    worst = max(devs, default=math.nan)
    return Claim(
        "the mean-field check's W2 is the exact W2: w2_to_reference against an assignment problem at t = 0 and T",
        f"relative deviation <= {W2_TOL:g}",
        f"largest relative deviation {worst:.1e} over {len(devs)} values (n = "
        f"{', '.join(str(r['n']) for r in sel)} against the reference)",
        bool(sel) and worst <= W2_TOL,
        "scipy.optimize.linear_sum_assignment on the sample's atoms repeated to the reference's count (uniform "
        "masses: an optimal plan is a permutation), its root mean squared cost; the first sample of the two "
        "smallest n, against the study's reference up to 1024 particles, else one of 1024 particles simulated for "
        "the check (the assignment is cubic in its size)", kind=THEOREM,
        fails_if=f"a W2 of the mean-field check differs from the assignment problem's by more than {W2_TOL:g} "
                 "(relative): a squared W2, another cost or an entropic value in its place",
        short="the mean-field check's W2 is the assignment problem's",
        short_measured=f"largest deviation {worst:.0e} ({len(devs)} values)")
