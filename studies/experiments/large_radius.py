"""Study 3: large radius (Theorems 3.7 / 4.5).

For a direction X (n, d) where every row has a unique m_i = argmax_j <A x_i, x_j> (argmax over
j <= i when masked), Lip_{RX}(f) -> ||V||_2 sqrt(max_j #{i : m_i = j}) as R -> infinity,
exponentially fast (the softmax concentrates like exp(-gap R^2), gap the smallest score margin).
The constant is computed along R for random directions (and one where every token attends to the
same token, reaching ||V|| sqrt(n)), masked and unmasked, against the limit of
``meanfield.bounds.large_radius_limit``. A third masked direction, ``hub_last`` (the unmasked hub
placed last, where the tokens before it cannot see it), has masked and unmasked multiplicities that
differ (1 or n - 1 against n): the other masked directions have the same limit masked and unmasked,
so only this one tells Theorem 4.5's limit from Theorem 3.7's. ||V|| sqrt(n) bounds the limit, not
the constant at finite R: on the way the constant of a random direction rises well above it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from meanfield import bounds

from .. import plotting as P
from ..common import random_A, random_V, to_device
from ..contract import THEOREM, Claim, StudyResult, register
from ..grid import run_grid
from ..io import save_figure, write_csv

__all__ = ["large_radius", "direction", "large_radius_task", "grid", "multiplicities", "masked_hub_claim", "sup_claim"]


#: the largest radius of a curve
R_CAP = 100.0
#: exp(-gap R^2) at the largest radius: e^-DECAY, where the limit is reached to float64 accuracy
DECAY = 40.0
#: a random direction is drawn again (at most this many times) until its score gap reaches DECAY / R_CAP^2, so
#: that exp(-gap R^2) <= e^-DECAY is reached at R <= R_CAP: a direction with a smaller gap has not converged
#: at R = 100 (gap 7e-4: e^-7), and comparing its constant there with the limit tests nothing of the theorems
MAX_DRAWS = 64


def direction(kind: str, n: int, d: int, seed: int, masked: bool = False) -> torch.Tensor:
    """A direction X (n, d) with max row norm 1: ``random`` (rows uniform on the unit sphere; the first of
    :data:`MAX_DRAWS` draws whose score gap for ``random_A(d, seed)`` is at least DECAY / R_CAP^2, so that its
    limit is reached within R <= R_CAP), ``hub`` (every token attends to token 0:
    ``meanfield.adversarial.large_radius_configuration``, whose limit is ||V|| sqrt(n)) or ``hub_last``
    (that construction with the hub last, ``hub = n - 1``: unmasked every token attends to it, masked
    the tokens before it cannot, so the masked multiplicity is 1 or n - 1, not n; ``masked`` is unused)."""
    return _direction(kind, n, d, seed, masked)[0]


def _direction(kind, n, d, seed, masked):
    """(X, draws): the direction and how many random draws it took (1 for the hub)."""
    if kind == "random":
        A, best = random_A(d, seed), 0.0
        for draw in range(MAX_DRAWS):
            # the first draw is the one of earlier versions (same generator seed)
            g = torch.Generator().manual_seed(int(seed) * 7 + n + 1_000_003 * draw)
            Z = torch.randn(n, d, generator=g, dtype=torch.float64)
            X = Z / Z.norm(dim=1, keepdim=True)
            gap = bounds.score_gap(A, X, masked=masked)
            if gap >= DECAY / R_CAP**2:
                return X, draw + 1
            best = max(best, gap)
        raise RuntimeError(f"large_radius: no random direction of {MAX_DRAWS} draws (n = {n}, d = {d}, seed = {seed}) "
                           f"has a score gap of {DECAY / R_CAP**2:g} (the largest: {best:.3g}), so none reaches "
                           f"its limit within R <= {R_CAP:g}; use another seed or fewer tokens")
    if kind == "hub":
        from meanfield import adversarial

        return adversarial.large_radius_configuration(random_A(d, seed), n=n, masked=masked), 1
    if kind == "hub_last":
        from meanfield import adversarial

        return adversarial.large_radius_configuration(random_A(d, seed), n=n, masked=False, hub=n - 1), 1
    raise ValueError(f"kind: expected 'random', 'hub' or 'hub_last', got {kind!r}")


def limit_jacobian(V, m: np.ndarray, d: int) -> np.ndarray:
    """The limit of D_(RX) f of Theorems 3.7 / 4.5 as an (n d_out) x (n d) matrix: E -> (V e_(m_i))_i, block (i, j)
    equal to V where j = m_i and 0 elsewhere (``m`` from ``bounds.argmax_indices``, numpy)."""
    V = np.asarray(V, dtype=float)
    n, d_out = len(m), V.shape[0]
    J = np.zeros((n * d_out, n * d))
    for i, j in enumerate(m):
        J[i * d_out:(i + 1) * d_out, j * d:(j + 1) * d] = V
    return J


def large_radius_task(kind: str, masked: bool, R: float, n: int, d: int, seed: int, *, device=None) -> dict:
    from meanfield import SelfAttention, local_lipschitz

    A = random_A(d, seed)
    V = random_V(d, seed)
    X = direction(kind, n, d, seed, masked)
    op = SelfAttention(*to_device(device, A, V), masked=masked)
    est = local_lipschitz(op, to_device(device, R * X), method="lanczos", tol=1e-10)
    limit = float(bounds.large_radius_limit(A, V, X, masked=masked))
    # the theorems' statement itself: D_(RX) f -> the map E -> (V e_(m_i))_i, entry by entry (a dense Jacobian of
    # the operator against the argmax read from the scores in numpy): it tells A from A^T, which the limit's norm,
    # a function of the largest multiplicity alone, may not
    J = torch.autograd.functional.jacobian(op.sequence, to_device(device, R * X)).reshape(n * d, n * d)
    J_lim = limit_jacobian(V, bounds.argmax_indices(A, X, masked=masked), d)
    jac_dev = float(np.abs(J.detach().cpu().numpy() - J_lim).max() / np.abs(J_lim).max())
    return {"lip": float(est.value), "lip_error": float(est.error), "limit": limit,
            "rel_gap": abs(float(est.value) - limit) / limit, "score_gap": bounds.score_gap(A, X, masked=masked),
            "v_norm_sqrt_n": bounds.large_radius_sup(V, n), "jacobian_deviation": jac_dev}


def grid(level: str) -> dict:
    """Sizes: dimension d, tokens n, radii per curve."""
    if level == "tiny":
        return {"d": 3, "n": 5, "n_R": 6}
    if level == "quick":
        return {"d": 4, "n": 12, "n_R": 14}
    return {"d": 6, "n": 32, "n_R": 30}


def multiplicities(A, X) -> tuple[int, int]:
    """(masked, unmasked) largest argmax multiplicity max_j #{i : m_i = j} of direction X, from the
    scores (``bounds.argmax_indices``), not from ``bounds.large_radius_limit``."""
    return tuple(int(np.bincount(bounds.argmax_indices(A, X, masked=m)).max()) for m in (True, False))


def masked_hub_claim(hub: list[dict], late: list[dict], mult: tuple[int, int]) -> Claim:
    """Theorem 4.5 along the masked hub directions: the hub first (token 0, the same limit as unmasked)
    and the hub last (``hub_last``), whose masked multiplicity ``mult[0]`` differs from the unmasked
    ``mult[1]``: a masked limit computed with the unmasked argmax would miss the constant there by
    sqrt(mult[1] / mult[0]). Fails too when the two multiplicities coincide (the case would be lost)."""
    a, b = hub[-1], late[-1]
    mm, mu = mult
    jac = max(a["jacobian_deviation"], b["jacobian_deviation"])
    ok = a["rel_gap"] <= 1e-6 and b["rel_gap"] <= 1e-6 and jac <= 1e-6 and mm != mu
    return Claim(
        "Theorem 4.5: D_(RX) f -> (V e_(m_i))_i and Lip_(RX) -> ||V|| sqrt(max multiplicity), hub direction (hub "
        "first) and hub-last direction "
        f"(masked multiplicity {mm}, unmasked {mu})",
        f"{a['limit']:.6g} (hub first), {b['limit']:.6g} (hub last; unmasked formula "
        f"{b['v_norm_sqrt_n'] * math.sqrt(mu / b['n']):.6g})",
        f"{a['lip']:.6g} at R = {a['R']:.3g} (relative gap {a['rel_gap']:.1e}); {b['lip']:.6g} at R = {b['R']:.3g} "
        f"(relative gap {b['rel_gap']:.1e}); Jacobians off the limit maps by {jac:.1e}",
        ok, f"tolerance 1e-6 at R where exp(-gap R^2) <= e^-40; score gaps {a['score_gap']:.3g}, "
            f"{b['score_gap']:.3g}; hub last: meanfield.adversarial.large_radius_configuration with hub = n - 1 "
            "(masked, the tokens before it cannot see it)", kind=THEOREM,
        fails_if="at the largest R (exp(-gap R^2) <= e^-40) the constant of either masked hub direction differs "
                 "from the limit by more than 1e-6 (relative), or its Jacobian from the limit map (entry by entry, "
                 "1e-6 of the largest), or the hub-last direction's masked and unmasked "
                 "multiplicities coincide (no masked case would then tell Theorem 4.5's limit from Theorem 3.7's)",
        short="Thm 4.5: Lip -> ‖V‖ sqrt(max mult.) as R grows, hub first and hub last",
        short_measured=f"relative gaps {a['rel_gap']:.1e}, {b['rel_gap']:.1e}; hub last: mult {mm} (unmasked {mu})")


def sup_claim(rows: list[dict]) -> Claim:
    """The limit is at most ||V|| sqrt(n) for every direction measured (random, hub, hub last), and the hub
    direction attains it: a bound off by a constant factor would fail one side or the other."""
    over = [r for r in rows if r["limit"] > r["v_norm_sqrt_n"] * (1 + 1e-12)]
    hub = [r for r in rows if r["kind"] == "hub"]
    hub_dev = max(abs(r["limit"] / r["v_norm_sqrt_n"] - 1) for r in hub)
    hub_lip = max(abs(r["lip"] / r["v_norm_sqrt_n"] - 1) for r in hub if r["R"] == max(x["R"] for x in hub
                                                                                       if x["masked"] == r["masked"]))
    rnd = max((r["limit"] / r["v_norm_sqrt_n"] for r in rows if r["kind"] == "random"), default=math.nan)
    return Claim("the limit is at most ||V|| sqrt(n), and the hub direction attains it",
                 "limit / (||V|| sqrt(n)) <= 1, = 1 at the hub",
                 f"{len(over)} of {len(rows)} limits above it; hub: limit / (||V|| sqrt(n)) - 1 = {hub_dev:.1e}, "
                 f"constant at the largest R within {hub_lip:.1e}; random directions: {rnd:.4g}",
                 not over and hub_dev <= 1e-12 and hub_lip <= 1e-6,
                 "hub: meanfield.adversarial.large_radius_configuration (every token attends to token 0); "
                 "tolerance 1e-12 on the limit, 1e-6 on the constant (as for Theorems 3.7 / 4.5)", kind=THEOREM,
                 fails_if="some direction's limit exceeds ||V|| sqrt(n), or at the hub direction the limit or the "
                          "constant at the largest R differs from ||V|| sqrt(n) (the sup would not be attained)",
                 short="the limit is at most ‖V‖ sqrt(n), attained in the hub direction",
                 short_measured=f"{len(over)} of {len(rows)} above; hub: limit / (‖V‖ sqrt(n)) - 1 = {hub_dev:.0e}")


#: what lipschitz_vs_R.png shows (the report prints it under the figure)
CAPTION = (
    "The local constant at R X against the radius R, unmasked (left) and masked (right), for a random direction X "
    "(blue), the hub direction where every token attends to token 0 (orange) and, masked, the same with the hub "
    "last (green). Each curve must settle on its limit ||V|| sqrt(max multiplicity) of Theorem 3.7 / 4.5 "
    "(dash-dotted, its colour) at large R. The hub's limit is ||V|| sqrt(n), the largest of all (dashed black), so "
    "the orange limit line lies on the black one. The random direction's bump above every limit at intermediate "
    "R shows that the limit is not a bound at finite R.")


@register("large_radius", "Large radius: Theorems 3.7 and 4.5", grid=grid)
def large_radius(out_dir: Path, ctx) -> StudyResult:
    """Local constant vs R converging to ||V|| sqrt(max multiplicity), masked and unmasked."""
    out_dir = Path(out_dir)
    seed = ctx.seed
    g = grid(ctx.level)
    d, n, n_R = g["d"], g["n"], g["n_R"]
    A = random_A(d, seed)
    curves = [(k, m) for k in ("random", "hub") for m in (False, True)]
    points = []
    r_max, draws = {}, {}
    for kind, masked in curves:
        X, draws[(kind, masked)] = _direction(kind, n, d, seed, masked)
        gap = bounds.score_gap(A, X, masked=masked)
        # exp(-gap R^2) = e^{-40} at the largest R: the limit is reached to float64 accuracy (the hub's gap, not
        # drawn, can be smaller: its claim then fails, as it would for a wrong configuration)
        r_max[(kind, masked)] = min(R_CAP, math.sqrt(DECAY / max(gap, 1e-12)))
        for R in np.geomspace(0.25, r_max[(kind, masked)], n_R):
            points.append({"kind": kind, "masked": masked, "R": float(R), "n": n, "d": d, "seed": seed})
    rows = run_grid(large_radius_task, points, out_dir, "large_radius", ctx, device=ctx.device)
    # the hub last, masked: its own sweep (the grid above keeps its points)
    X_late = direction("hub_last", n, d, seed)
    mult_late = multiplicities(A, X_late)
    r_max[("hub_last", True)] = min(R_CAP, math.sqrt(DECAY / max(bounds.score_gap(A, X_late, masked=True), 1e-12)))
    late = run_grid(large_radius_task, [{"kind": "hub_last", "masked": True, "R": float(R), "n": n, "d": d,
                                         "seed": seed} for R in np.geomspace(0.25, r_max[("hub_last", True)], n_R)],
                    out_dir, "large_radius_hub_last", ctx, device=ctx.device)
    write_csv(rows + late, out_dir / "lipschitz_vs_R.csv")

    fig, axes = P.figure(ncols=2, width=10.5, height=4.8)
    claims = []
    for ax, masked in zip(axes, (False, True)):
        for i, kind in enumerate(("random", "hub")):
            sel = [r for r in rows if r["kind"] == kind and r["masked"] == masked]
            name = "hub direction (the hub first)" if kind == "hub" else f"{kind} direction"
            P.measured(ax, [r["R"] for r in sel], [r["lip"] for r in sel], name, color=P.COLORS[i])
            P.theory(ax, [sel[0]["R"], sel[-1]["R"]], [sel[0]["limit"]] * 2,
                     "its limit ||V|| sqrt(max multiplicity)", color=P.COLORS[i], kind="limit")
            end = sel[-1]
            if masked and kind == "hub":
                claims.append(masked_hub_claim(sel, late, mult_late))
                continue
            claims.append(Claim(
                f"Theorem {'4.5' if masked else '3.7'}: D_(RX) f -> (V e_(m_i))_i and Lip_(RX) -> ||V|| sqrt(max "
                f"multiplicity), {kind} direction",
                f"{end['limit']:.6g}; the Jacobian equal to the limit map",
                f"{end['lip']:.6g} at R = {end['R']:.3g} (relative gap {end['rel_gap']:.1e}); Jacobian off the limit "
                f"map by {end['jacobian_deviation']:.1e} of ||V||'s largest entry",
                end["rel_gap"] <= 1e-6 and end["jacobian_deviation"] <= 1e-6,
                f"tolerance 1e-6 at R where exp(-gap R^2) <= e^-40; score gap {end['score_gap']:.3g}; the Jacobian is "
                "a dense one of the operator (autograd), the limit map built from the argmax of the scores in numpy",
                kind=THEOREM,
                fails_if="at the largest R (exp(-gap R^2) <= e^-40) the constant differs from the limit by more "
                         "than 1e-6 (relative), or an entry of the Jacobian differs from the limit map's by more "
                         "than 1e-6 of its largest (a map whose argmax is not that of <A x_i, x_j>: A^T for A)",
                short=f"Thm {'4.5' if masked else '3.7'}: Lip -> ‖V‖ sqrt(max multiplicity) as R grows, {kind} "
                      "direction",
                short_measured=f"relative gap {end['rel_gap']:.1e}, Jacobian {end['jacobian_deviation']:.1e} at R = "
                               f"{end['R']:.3g}"))
        if masked:
            P.measured(ax, [r["R"] for r in late], [r["lip"] for r in late], "hub-last direction",
                       color=P.COLORS[2])
            P.theory(ax, [late[0]["R"], late[-1]["R"]], [late[0]["limit"]] * 2,
                     "its limit ||V|| sqrt(max multiplicity)", color=P.COLORS[2], kind="limit")
        ax.axhline(rows[0]["v_norm_sqrt_n"], color="k", lw=0.8, ls="--",
                   label="||V|| sqrt(n): the largest limit (R -> inf), not a bound at finite R")
        P.finish(ax, "radius R", "local Lipschitz constant at R X", f"{'masked' if masked else 'unmasked'}, n={n}, "
                 f"d={d}", logx=True, logy=True, legend=False)
    P.figure_legend(fig, axes, ncol=3)
    save_figure(fig, out_dir / "lipschitz_vs_R.png")
    claims.append(sup_claim(rows + late))   # every direction measured, the hub-last one included
    notes = (f"A and V are {d}x{d} Gaussian matrices / sqrt(d) (seed {seed}); {n} tokens with unit-norm rows; "
             "'hub' is meanfield.adversarial.large_radius_configuration: every token attends to token 0; "
             f"'hub_last' (masked only) is that construction with the hub last, masked multiplicity {mult_late[0]} "
             f"against {mult_late[1]} unmasked. The "
             f"largest R of each curve is sqrt({DECAY:g} / gap) (capped at {R_CAP:g}) with gap the smallest top-two "
             f"score margin; a random direction is the first draw whose gap reaches {DECAY / R_CAP**2:g}, so that "
             f"its limit is reached within R <= {R_CAP:g} (draws: "
             + ", ".join(f"{'masked' if m else 'unmasked'} {k}" for (kind, m), k in draws.items() if kind == "random")
             + ").")
    return StudyResult("large_radius", "Large radius", claims, ["lipschitz_vs_R.png"], ["lipschitz_vs_R.csv"],
                       {"r_max": {f"{k}-{'masked' if m else 'unmasked'}": v for (k, m), v in r_max.items()}}, notes,
                       captions={"lipschitz_vs_R.png": CAPTION})
