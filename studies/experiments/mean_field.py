"""Study 2: the mean-field regime (Theorem 3.5, Proposition 3.6) and the transition from sqrt(n).

(a) The two-Dirac witness of Proposition 3.6, p delta_{Ru} + (1 - p) delta_{Ru/2} with
    p = exp(-2 gamma R^2) (``meanfield.adversarial.two_dirac``), has a W2-sense local constant
    (Lemma C.5: || D^{1/2} J D^{-1/2} ||_2 with the log-weights held fixed) that grows like
    (gamma/2) R^2 exp(gamma R^2), below the mean-field bound ||V|| (1 + 3||A|| R^2) exp(2||A|| R^2).

(b) For fixed R, the witness sequence of Proposition 3.4 with n tokens (n - 1 copies of one token)
    is the two-atom measure with weights (1/n, (n - 1)/n) (docs/math.md section 2), so its constant
    is computed with two particles for n up to 10^15: it grows like sqrt(n) while
    n << exp(2 gamma R^2), peaks a few times beyond it and decays. The equality of the two
    computations is checked on the sequences themselves for small n.

The claims test predicted forms, not windows: the two-Dirac ratio against 1 + 1/(gamma R^2)
(``meanfield.bounds.two_dirac_ratio``, docs/math.md sections 5.4 and 7.5), the growth exponent and
the peak against the witness's predicted constant (``meanfield.adversarial.sqrt_n_witness_constant``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from meanfield import bounds

from .. import plotting as P
from ..common import WITNESS_FLOOR, random_A, slope_claim, to_device, witness_tolerance
from ..contract import EMPIRICAL, THEOREM, Claim, StudyResult, register
from ..grid import run_grid
from ..io import save_figure, write_csv

__all__ = ["mean_field", "two_dirac_task", "transition_task", "grid", "prop36_claim", "peak_claim", "exponents"]


def two_dirac_task(R: float, d: int, seed: int, *, device=None) -> dict:
    """W2-sense constant of the Proposition 3.6 witness at radius R (V = I), with the theory."""
    from meanfield import SelfAttention, adversarial, local_lipschitz

    A = random_A(d, seed)
    V = torch.eye(d, dtype=torch.float64)
    mu = adversarial.two_dirac(A, R)
    if device is not None:
        mu = mu.to(device=device)
    est = local_lipschitz(SelfAttention(*to_device(device, A, V)), mu, method="dense")
    log_lip = math.log(est.value)
    log_asym = bounds.two_dirac_lower(A, R, log=True)
    log_up = bounds.mean_field_upper(A, V, R, log=True)
    return {"lip": float(est.value), "log_lip": log_lip, "log_asymptotic": float(log_asym),
            "log_upper": float(log_up), "ratio_to_asymptotic": math.exp(log_lip - log_asym),
            "log_p": float(mu.log_weights.min()), "ratio_predicted": float(bounds.two_dirac_ratio(A, R))}


def transition_task(log10_n: float, R: float, d: int, seed: int, check_sequence: bool = False, *,
                    device=None) -> dict:
    """Constant of the n-token witness computed as a 2-atom measure (1/n, (n - 1)/n), V = I.

    ``check_sequence`` (small n only) also computes the constant of the n-token sequence itself, and the query
    term ||V Sigma A|| of the atom that the sequence holds n - 1 copies of (bounds.query_term_norms, numpy): the
    sequence is that measure with the atom split (docs/math.md sections 2.3 and 4.7).
    """
    from meanfield import SelfAttention, adversarial, local_lipschitz

    A = random_A(d, seed)
    V = torch.eye(d, dtype=torch.float64)
    n = 10.0 ** log10_n
    n_int = int(round(n))
    mu = adversarial.sqrt_n_measure(A, R, n)
    if device is not None:
        mu = mu.to(device=device)
    att = SelfAttention(*to_device(device, A, V))
    lip = float(local_lipschitz(att, mu, method="dense").value)
    # Proposition 3.4's formula at the same n as the constant (docs/math.md section 7.3: evaluating it at
    # round(n) made the two-atom constant at n = 5.6 look 4% below it); Theorem 3.3 is a statement about
    # sequences, so its bound is tabulated at integer n only
    integer = abs(n - n_int) <= 1e-6 and n < 2**62
    row = {"n": n, "lip": lip, "lower": float(bounds.sqrt_n_lower_from_gamma(bounds.gamma(A), R, n)),
           "upper_sqrt_n": float(bounds.sqrt_n_upper(A, V, R, n_int)) if integer else math.nan,
           "log_upper_mean_field": float(bounds.mean_field_upper(A, V, R, log=True)),
           "witness_predicted": float(adversarial.sqrt_n_witness_constant(A, R, n, of="measure")),
           "lip_sequence": math.nan, "query_term": math.nan}
    if check_sequence:
        X = to_device(device, adversarial.sqrt_n_sequence(A, R, n_int))
        row["lip_sequence"] = float(local_lipschitz(att, X, method="dense").value)
        # the repeated token's atom: the heavier one (at n = 2 neither repeats, and the sequence is the measure)
        heavy = int(mu.log_weights.argmax())
        row["query_term"] = (float(bounds.query_term_norms(A, V, mu.points.cpu(), mu.log_weights.cpu())[heavy])
                             if n_int >= 3 else 0.0)
    return row


def grid(level: str) -> dict:
    """Sizes: dimension d, radii of the two-Dirac witness, log10 of the lengths of the transition
    curve, and the lengths at which the n-token sequence itself is also measured."""
    if level == "tiny":
        return {"d": 3, "Rs": [2.0, 5.0, 8.0], "log10_ns": [0.5, 1, 1.5, 2, 2.5, 3, 4, 6, 6.5, 8],
                "check_ns": [2, 3, 5]}
    if level == "quick":
        return {"d": 3, "Rs": list(np.linspace(1.0, 8.0, 8)), "log10_ns": list(np.arange(0.5, 15.01, 0.5)),
                "check_ns": [2, 3, 5, 9, 17, 33]}
    return {"d": 5, "Rs": list(np.linspace(1.0, 10.0, 19)), "log10_ns": list(np.arange(0.25, 18.01, 0.25)),
            "check_ns": [2, 3, 5, 9, 17, 33, 65, 129]}


def prop36_claim(rows: list[dict], gamma: float) -> Claim:
    """Proposition 3.6 with its correction: at every R with gamma R^2 >= 2 the measured ratio of the
    two-Dirac constant to (gamma/2) R^2 e^{gamma R^2} equals ``ratio_predicted`` = 1 + 1/(gamma R^2)
    within :func:`studies.common.witness_tolerance` (terms of relative order e^{-2 gamma R^2})."""
    sel = [r for r in rows if gamma * r["R"] ** 2 >= 2.0]
    if not sel:
        raise ValueError(f"rows: no radius with gamma R^2 >= 2 (gamma = {gamma:.4g}); the grid cannot test the claim")
    devs = [(abs(r["ratio_to_asymptotic"] / r["ratio_predicted"] - 1), witness_tolerance(gamma, r["R"]), r)
            for r in sel]
    bad = [r for dev, tol, r in devs if dev > tol]
    last = sel[-1]
    return Claim(
        "Proposition 3.6: two-Dirac constant ~ (gamma/2) R^2 exp(gamma R^2), with the ratio 1 + 1/(gamma R^2) "
        "(docs/math.md sections 5.4, 7.5)",
        f"ratio = 1 + 1/(gamma R^2): {last['ratio_predicted']:.5f} at R = {last['R']:.3g}",
        f"ratio {last['ratio_to_asymptotic']:.5f} at R = {last['R']:.3g} (relative deviation {devs[-1][0]:.1e}, "
        f"tolerance {devs[-1][1]:.1e}); {len(bad)} of {len(sel)} radii with gamma R^2 >= 2 outside the tolerance",
        not bad,
        "checked at every R with gamma R^2 >= 2; tolerance 2 e^(-2 gamma R^2) (1 + gamma R^2)^2, the order of the "
        "terms the prediction neglects; the ratio tends to 1 like 1/(gamma R^2)", kind=THEOREM,
        fails_if="at some R with gamma R^2 >= 2 the measured ratio differs from 1 + 1/(gamma R^2) by more than the "
                 "tolerance (a ratio near 1, i.e. without the 1/(gamma R^2) term, fails at the largest R)",
        short="Prop 3.6: Lip / ((gamma/2) R^2 e^(gamma R^2)) = 1 + 1/(gamma R^2)",
        short_measured=f"{len(bad)} of {len(sel)} radii outside the tolerance; at R = {last['R']:.3g}: deviation "
                       f"{devs[-1][0]:.1e}")


#: how far from exp(2 gamma R^2) the peak of the witness's constant may lie and still be "near" it: a decade
PEAK_DECADES = 1.0


def _local_slopes(curve: list[dict], n_max: float) -> list[float]:
    """Log-log slopes of the measured constant between consecutive grid points with 10 <= n <= n_max."""
    pts = sorted((r["n"], r["lip"]) for r in curve if 10 <= r["n"] <= n_max and r["lip"] > 0)
    return [math.log(b[1] / a[1]) / math.log(b[0] / a[0]) for a, b in zip(pts, pts[1:])]


def closed_form_claim(curve: list[dict]) -> Claim:
    """The two-Dirac witness's certified constant equals its closed form at every length of the transition curve
    (the top singular value of a 4 x 4 block, ``adversarial.sqrt_n_witness_constant``; the constant a dense SVD).
    The peak claim checks the same equality at the peak only, as an empirical claim; a constant 1% too large left
    every theorem claim of the study holding (a mutation review): the identity is a theorem's."""
    dev = [abs(r["lip"] / r["witness_predicted"] - 1) for r in curve]
    worst = max(range(len(curve)), key=dev.__getitem__)
    return Claim(
        "the two-Dirac witness's constant equals its closed form at every length n of the transition curve",
        "Lip = the top singular value of the witness's 4 x 4 block in closed form (docs/math.md section 5.3)",
        f"largest relative deviation {dev[worst]:.1e} (n = {curve[worst]['n']:.3g}) over {len(curve)} lengths from "
        f"{curve[0]['n']:.3g} to {curve[-1]['n']:.3g}", dev[worst] <= WITNESS_FLOOR,
        f"tolerance {WITNESS_FLOOR:.0e}: the closed form is exact, the constant a dense SVD of a 2-atom Jacobian",
        kind=THEOREM,
        fails_if=f"at some length the constant differs from the closed form by more than {WITNESS_FLOOR:.0e} "
                 "(relative): a constant, a weighting or a witness off by any factor",
        short="the witness's constant = its closed form at every n of the curve",
        short_measured=f"largest deviation {dev[worst]:.0e} over {len(curve)} lengths")


def peak_claim(curve: list[dict], n_star: float, log_upper: float, gamma: float, R: float) -> Claim:
    """The transition: the witness curve peaks within :data:`PEAK_DECADES` of n* = exp(2 gamma R^2), at the grid
    point where its predicted constant peaks and with the predicted value, and stays below the mean-field bound.
    The local slopes before the peak are reported: the growth is sqrt(n) only while n << n*, and steepens on the
    way to the peak (the lower bound of Proposition 3.4 saturates there, the constant does not)."""
    peak = max(curve, key=lambda r: r["lip"])
    pred = max(curve, key=lambda r: r["witness_predicted"])
    dev = abs(peak["lip"] / peak["witness_predicted"] - 1)
    tol = WITNESS_FLOOR   # the measure's closed form is exact and the constant dense
    decades = math.log10(peak["n"] / n_star)
    near = abs(decades) <= PEAK_DECADES
    ok = peak["n"] == pred["n"] and dev <= tol and math.log(peak["lip"]) <= log_upper and near
    slopes = _local_slopes(curve, peak["n"])
    rise = (f"; local log-log slopes from {slopes[0]:.2f} (n near 10) to {max(slopes):.2f} just before the peak: "
            "sqrt(n) while n << exp(2 gamma R^2), steeper on the way to the peak") if slopes else ""
    return Claim(
        "the sqrt(n) growth stops near n = exp(2 gamma R^2): the witness curve peaks within a decade of it, where its "
        "predicted constant does, then decays; the sup over n stays finite",
        f"peak at n = {pred['n']:.3g} ({pred['n'] / n_star:.2g} exp(2 gamma R^2)), value "
        f"{pred['witness_predicted']:.5g}; sup <= mean-field bound",
        f"peak {peak['lip']:.5g} at n = {peak['n']:.3g} ({peak['n'] / n_star:.2g} exp(2 gamma R^2); relative "
        f"deviation from the prediction {dev:.1e}); mean-field bound e^{log_upper:.4g}{rise}", ok,
        f"on the grid of the curve; near: within {PEAK_DECADES:g} decade of exp(2 gamma R^2); tolerance {tol:.1e} "
        "on the value (the witness's closed form is exact, the constant a dense SVD); past the peak the family "
        "tends to one Dirac (constant ||V|| = 1)", kind=EMPIRICAL,
        fails_if=f"the peak lies more than {PEAK_DECADES:g} decade from exp(2 gamma R^2), at another grid point than "
                 "the predicted one, its value differs from the prediction by more than the tolerance, or it exceeds "
                 "the mean-field bound",
        short="the sqrt(n) growth stops near n = exp(2 gamma R^2): peak, then decay",
        short_measured=f"peak {peak['lip']:.5g} at n = {peak['n'] / n_star:.2g} exp(2 gamma R^2) (predicted; "
                       f"deviation {dev:.0e})")


#: what each figure shows (the report prints it under the figure)
CAPTIONS = {
    "two_dirac_vs_R.png": (
        "Left: the constant of the two-Dirac measure over Proposition 3.6's asymptotic value (gamma/2) R^2 "
        "e^(gamma R^2), against the radius R, beside the predicted 1 + 1/(gamma R^2); the grey band marks the radii "
        "the claim checks (gamma R^2 >= 2). Right: the exponents log(constant) / R^2 of the two-Dirac witness and of "
        "Theorem 3.5's bound. The witness's tends to gamma as R grows, slowly (its prefactor (gamma/2) R^2 adds about "
        "log(gamma R^2 / 2) / R^2), "
        "so over these radii it stays above the gamma line; the bound's tends to 2||A||. The bound is loose by about "
        "e^((2||A|| - gamma) R^2), a gap the paper leaves open."),
    "transition_vs_n.png": (
        "The witness's local constant against n at a fixed large radius, as a 2-atom measure (1/n, (n-1)/n) (blue "
        "markers) and as an n-token sequence (red crosses), equal here (the query term of the split atom stays "
        "below the measure's constant, docs/math.md section 4.7) and on their closed form (black). The "
        "peak claim "
        "expects sqrt(n) growth while n << exp(2 gamma R^2) (vertical line), then a peak within a decade of it "
        "and a decay. The green curve, the largest "
        "constant over lengths up to n, saturates at the peak; Proposition 3.4's lower bound (grey dotted line) stays "
        "below, Theorem 3.3's sqrt(n) bound (brown, at integer n from 10, leaving the axes above n = 10^4) above, and "
        "Theorem 3.5's mean-field bound is off the scale."),
}


@register("mean_field", "The mean-field regime: Theorem 3.5 and Proposition 3.6", grid=grid)
def mean_field(out_dir: Path, ctx) -> StudyResult:
    """Two-Dirac constant vs R; constant vs n from sqrt(n) growth to saturation (2-atom measures)."""
    out_dir = Path(out_dir)
    seed = ctx.seed
    g = grid(ctx.level)
    d, Rs, log10_ns, check_ns = g["d"], g["Rs"], g["log10_ns"], g["check_ns"]
    A = random_A(d, seed)
    gam = bounds.gamma(A)
    a_norm = bounds.spectral_norm(A, "A")

    # ---------------------------------------------------------------- (a) two Diracs vs R
    rows_a = run_grid(two_dirac_task, [{"R": float(R), "d": d, "seed": seed} for R in Rs], out_dir, "two_dirac",
                      ctx, device=ctx.device)
    write_csv(rows_a, out_dir / "two_dirac_vs_R.csv")
    viol_a = [r for r in rows_a if r["log_lip"] > r["log_upper"] + 1e-9]
    last = rows_a[-1]

    # ---------------------------------------------------------------- (b) transition in n
    # R fixed so that exp(2 gamma R^2) = 10^6: growth up to ~10^5, saturation after ~10^7
    R_t = bounds.sqrt_n_regime_radius(gam, 1e6)
    grid_b = [{"log10_n": float(x), "R": R_t, "d": d, "seed": seed} for x in log10_ns]
    grid_b += [{"log10_n": math.log10(n), "R": R_t, "d": d, "seed": seed, "check_sequence": True} for n in check_ns]
    rows_b = run_grid(transition_task, grid_b, out_dir, "transition", ctx, device=ctx.device)
    write_csv(rows_b, out_dir / "transition_vs_n.csv")
    checks = [r for r in rows_b if not math.isnan(r["lip_sequence"])]
    # docs/math.md section 4.7: the sequence is the 2-atom measure with its repeated atom split, so its constant is
    # max(the measure's constant, that atom's query term)
    seq_err = max(abs(max(r["lip"], r["query_term"]) - r["lip_sequence"]) / r["lip_sequence"] for r in checks)
    query_share = max(r["query_term"] / r["lip"] for r in checks)
    curve = sorted([r for r in rows_b if math.isnan(r["lip_sequence"])], key=lambda r: r["n"])
    # Proposition 3.4 is about sequences of n tokens: it applies where the 2-atom measure (1/n, (n-1)/n) is
    # one, i.e. at integer n (n = 10^k on the curve, and the sequence checks); Theorem 3.5 holds for every measure
    integer = [r for r in rows_b if r["n"] >= 2 and abs(r["n"] - round(r["n"])) <= 1e-6]
    low_viol = [r for r in integer if r["lip"] < r["lower"] * (1 - 1e-9)]
    other = [r for r in rows_b if r not in integer and r["n"] > 1]
    min_other = min((r["lip"] / r["lower"] for r in other), default=math.nan)
    up_viol = [r for r in rows_b if math.log(r["lip"]) > r["log_upper_mean_field"] + 1e-9]
    n_star = bounds.sqrt_n_regime_length(gam, R_t)
    growth = [r for r in curve if 10 * (1 - 1e-9) <= r["n"] <= 1e-3 * n_star * (1 + 1e-9)]
    running = np.maximum.accumulate([r["lip"] for r in curve])
    peak = max(curve, key=lambda r: r["lip"])

    _figures(out_dir, rows_a, curve, checks, running, n_star, R_t, d, gam, a_norm)

    log_gap = last["log_upper"] - last["log_lip"]
    # the bound compared is Theorem 3.5's formula (V = I), written out here: it is e^(hundreds) above every
    # constant, so a wrong exponent would pass the comparison alone
    formula_dev = max(abs(r["log_upper"] - (math.log1p(3 * a_norm * r["R"] ** 2) + 2 * a_norm * r["R"] ** 2))
                      / max(1.0, abs(r["log_upper"])) for r in rows_a)
    claims = [
        Claim("two-Dirac constant <= mean-field bound of Theorem 3.5, every R",
              "log Lip <= log bound", f"{len(viol_a)} violations of {len(rows_a)}; at R = {last['R']:.3g}: "
              f"log Lip = {last['log_lip']:.4g} <= {last['log_upper']:.4g}; the bound evaluated is the theorem's "
              f"formula within {formula_dev:.1e}", not viol_a and formula_dev <= 1e-12,
              f"tightness: not attained; the two-Dirac witness is the family closest to it, and its constant grows "
              f"like e^(gamma R^2) against the bound's e^(2 ||A|| R^2) (gamma = {gam:.3g}, "
              f"2 ||A|| = {2 * a_norm:.3g}): "
              f"log(bound / Lip) = {log_gap:.4g} at R = {last['R']:.3g}, the gap in the exponent that the paper "
              "leaves open", kind=THEOREM,
              fails_if="at some R the log of the constant exceeds the log of the bound by more than 1e-9, or the "
                       "bound the library evaluates differs from ||V|| (1 + 3 ||A|| R^2) exp(2 ||A|| R^2), written out "
                       "in the study, by more than 1e-12 (relative, in logs)",
              short="two-Dirac constant <= Theorem 3.5's mean-field bound, every R",
              short_measured=f"{len(viol_a)} of {len(rows_a)} above; log(bound / Lip) = {log_gap:.4g} at R = "
                             f"{last['R']:.3g}"),
        prop36_claim(rows_a, gam),
        Claim("n-token witness = 2-atom measure (1/n, (n-1)/n) with its repeated atom split: Lip = max(the "
              "measure's constant, ||V Sigma A|| of that atom) (docs/math.md sections 2.3 and 4.7)",
              "equal constants", f"max relative difference {seq_err:.2e} over n = {check_ns}; the query term is at "
              f"most {query_share:.3g} of the measure's constant, so here the sequence's constant is the "
              "measure's", seq_err <= 1e-8,
              "tolerance 1e-8 (dense Jacobians, float64; the query term written out in numpy)", kind=THEOREM,
              fails_if="the sequence's constant differs from max(two-atom measure's constant, the repeated atom's "
                       "query term) by more than 1e-8 (relative)",
              short="n-token witness = 2-atom measure (1/n, (n-1)/n), its repeated atom split",
              short_measured=f"max relative difference {seq_err:.1e}; query term <= {query_share:.2g} x"),
        Claim("Lip >= Proposition 3.4 lower bound (integer n) and <= Theorem 3.5 bound (every n) up to n = 10^"
              + f"{log10_ns[-1]:g}",
              "lower <= Lip <= upper", f"{len(low_viol)} violations of the lower bound at {len(integer)} integer n; "
              f"{len(up_viol)} of the upper bound at {len(rows_b)} n",
              not low_viol and not up_viol,
              "Proposition 3.4 is a statement about sequences of n tokens, so it is checked where the 2-atom "
              "measure (1/n, (n-1)/n) is one (integer n). Its formula is evaluated at the same n as the constant "
              f"(also at the other n, where it is not a theorem: smallest Lip / formula {min_other:.4g})",
              kind=THEOREM,
              fails_if="the constant is below Proposition 3.4 at an integer n, or above Theorem 3.5 at any n",
              short=f"Prop 3.4 <= Lip <= Thm 3.5 up to n = 10^{log10_ns[-1]:g}",
              short_measured=f"{len(low_viol)} of {len(integer)} below the lower, {len(up_viol)} of {len(rows_b)} "
                             "above the upper bound"),
    ]
    fit = fit_pred = None
    if len(growth) >= 3:
        slope, fit, fit_pred = slope_claim([r["n"] for r in growth], [r["lip"] for r in growth],
                                           [r["witness_predicted"] for r in growth], [r["lower"] for r in growth],
                                           "the witness's constant")
        claims.append(slope)
    claims.append(peak_claim(curve, n_star, curve[0]["log_upper_mean_field"], gam, R_t))
    claims.append(closed_form_claim(curve))
    notes = (f"A is a {d}x{d} Gaussian matrix / sqrt(d) (seed {seed}), ||A|| = {a_norm:.3g}, gamma = {gam:.4g}. "
             f"Transition at R = {R_t:.3f} (exp(2 gamma R^2) = 1e6); the constant peaks at {peak['lip']:.4g} for "
             f"n = {peak['n']:.3g}. Local constants are dense-Jacobian values (2 atoms), in the W2 sense of Lemma C.5 "
             "with the tiny weights carried as log-weights. The 'lower' column is Proposition 3.4's formula at the "
             "same n as the constant, integer or not (earlier versions evaluated it at round(n)); the Theorem 3.3 "
             "column is filled at integer n only.")
    return StudyResult("mean_field", "The mean-field regime", claims, list(CAPTIONS),
                       ["two_dirac_vs_R.csv", "two_dirac_exponents.csv", "transition_vs_n.csv"],
                       {"gamma": gam, "R_transition": R_t, "ratio_at_largest_R": last["ratio_to_asymptotic"],
                        "ratio_predicted_at_largest_R": last["ratio_predicted"],
                        "sequence_vs_measure_max_rel_diff": seq_err, "fit": fit, "fit_predicted": fit_pred,
                        "peak_n": peak["n"], "peak_lip": peak["lip"]},
                       notes, captions=CAPTIONS)


def exponents(rows_a: list[dict], gam: float) -> dict:
    """The constants c of e^(c R^2) of the two-Dirac witness and of Theorem 3.5's bound: least-squares
    slopes of log(constant) against R^2 over the radii where Proposition 3.6 is checked (gamma R^2 >= 2;
    the three largest radii when fewer qualify), next to their limits gamma and 2 ||A||."""
    sel = [r for r in rows_a if gam * r["R"] ** 2 >= 2.0]
    if len(sel) < 3:
        sel = sorted(rows_a, key=lambda r: r["R"])[-3:]
    R2 = np.array([r["R"] ** 2 for r in sel])
    out = {}
    for key, col in (("witness", "log_lip"), ("bound", "log_upper")):
        slope = float(np.polyfit(R2, np.array([r[col] for r in sel]), 1)[0])
        out[key] = {"slope": slope, "R_min": float(min(r["R"] for r in sel)), "R_max": float(max(r["R"] for r in sel)),
                    "points": len(sel)}
    return out


def _figures(out_dir, rows_a, curve, checks, running, n_star, R_t, d, gam, a_norm) -> None:
    fig, axes = P.figure(ncols=2, width=11.0, height=5.0)
    ax = axes[0]
    R_arr = np.array([r["R"] for r in rows_a])
    P.measured(ax, R_arr, [r["ratio_to_asymptotic"] for r in rows_a], "measured: Lip / ((gamma/2) R^2 e^(gamma R^2))")
    P.theory(ax, R_arr, [r["ratio_predicted"] for r in rows_a], "predicted: 1 + 1/(gamma R^2)", color="k",
             kind="limit")
    tested = [r for r in rows_a if gam * r["R"] ** 2 >= 2.0]
    if tested:
        ax.axvspan(tested[0]["R"], R_arr[-1], color="0.85", alpha=0.5, lw=0, label="claim checked (gamma R^2 >= 2)")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":", label="Prop 3.6: ratio -> 1")
    P.finish(ax, "radius R", "ratio to Prop 3.6's asymptotic value", f"two Diracs, d={d}, gamma={gam:.3g}, V=I",
             logy=True, legend=False)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower left", ncol=1)
    ax = axes[1]
    ex = exponents(rows_a, gam)
    P.measured(ax, R_arr, [r["log_lip"] / r["R"] ** 2 for r in rows_a], "two-Dirac witness: log(Lip) / R^2")
    P.theory(ax, R_arr, [r["log_upper"] / r["R"] ** 2 for r in rows_a], "Thm 3.5 bound: log(bound) / R^2", color="k")
    ax.axhline(gam, color=P.COLORS[0], lw=0.8, ls=":", label=f"gamma = {gam:.3g} (the witness's exponent as R -> inf)")
    ax.axhline(2 * a_norm, color="k", lw=0.8, ls=":", label=f"2 ||A|| = {2 * a_norm:.3g} (the bound's)")
    w, b = ex["witness"], ex["bound"]
    P.finish(ax, "radius R", "exponent: log(constant) / R^2",
             f"exponents in e^(c R^2), fitted over R = {w['R_min']:g}..{w['R_max']:g}: witness c = {w['slope']:.3g}\n"
             f"(above gamma: its R^2 prefactor, log/R^2 -> 0 as R -> inf), bound c = {b['slope']:.3g}\n"
             f"(a factor {b['slope'] / w['slope']:.0f}; {b['slope'] / gam:.0f} against gamma; the paper leaves "
             "this gap open)",
             logy=True, legend=False)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower right", ncol=1)
    save_figure(fig, out_dir / "two_dirac_vs_R.png")
    limits = {"witness": ("gamma", gam), "bound": ("2 ||A||", 2 * a_norm)}
    write_csv([{"curve": k, "fitted_exponent": v["slope"], "R_min": v["R_min"], "R_max": v["R_max"],
                "points": v["points"], "limit": limits[k][0], "limit_value": limits[k][1]} for k, v in ex.items()],
              out_dir / "two_dirac_exponents.csv")

    fig, ax = P.figure(width=8.5)
    nn = np.array([r["n"] for r in curve])
    P.measured(ax, nn, [r["lip"] for r in curve], "witness as 2-atom measure (1/n, (n-1)/n)", ms=3)
    P.measured(ax, [r["n"] for r in checks], [r["lip_sequence"] for r in checks], "witness as n-token sequence",
               color=P.COLORS[3], marker="x", ls="none")
    P.theory(ax, nn, [r["witness_predicted"] for r in curve], "the witness's constant in closed form",
             color="k", kind="limit", lw=1.0)
    P.theory(ax, nn, running, "max over lengths <= n (saturates)", color=P.COLORS[2], kind="limit")
    P.theory(ax, nn, [r["lower"] for r in curve], "lower bound, Prop 3.4", color="gray", kind="lower")
    log10_mf = curve[0]["log_upper_mean_field"] / math.log(10)
    ax.plot([], [], "k--", label=f"mean-field bound, Thm 3.5: 10^{log10_mf:.0f} (off scale)")
    fin = [r for r in curve if not math.isnan(r["upper_sqrt_n"])]
    P.theory(ax, [r["n"] for r in fin], [r["upper_sqrt_n"] for r in fin], "sqrt(n) bound, Thm 3.3 (integer n)",
             color="tab:brown")
    ax.axvline(n_star, color="gray", lw=0.8, ls="-.", label="n = exp(2 gamma R^2)")
    ax.set_ylim(0.3 * min(r["lip"] for r in curve), 30 * max(r["lip"] for r in curve))
    P.finish(ax, "sequence length n", "local Lipschitz constant", f"transition at R = {R_t:.2f}, d={d}, V=I",
             logx=True, logy=True, legend_loc="outside")
    save_figure(fig, out_dir / "transition_vs_n.png")
