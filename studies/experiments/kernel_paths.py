"""Study: the attention kernel's fused, streamed and series paths compute the dense kernel's map and Jacobian.

Every operator computes through :func:`meanfield.kernels.attend`, whose ``method="auto"`` picks a
dense, fused, streamed or series path by size, mask, scores and whether derivatives are needed
(:func:`meanfield.kernels.choose`). The other studies run at sizes where most calls stay dense, so a
mistake in the fused or streamed path (a mask entry, the log-weights, the online softmax's
rescaling, the analytic JVP / VJP) would change none of their numbers. This study measures the same
quantities at sizes where ``auto`` takes each of those paths, once by that path and once by the
dense path (``kernels.use("dense")``, the plain log-sum-exp softmax and autograd: the ground truth):

* forward passes (the pushforward F(mu) or the sequence map f(X)): the fused path on a weighted
  measure (log-weights as a mask row), on a causal sequence (``is_causal``), on a weighted causal
  sequence of atoms (log-weights as an extra key coordinate) and on a masked measure with arbitrary
  positions (an explicit boolean mask); the streamed path on a masked measure above the fused
  path's mask range (the online softmax over 9 x 9 tiles, Python tiles); the series path
  (:mod:`meanfield.series_attention`) on weighted tokens of the unit sphere under isotropic attention
  (beta = 1: bounded scores, above :data:`~meanfield.kernels.SERIES_THRESHOLD` score entries);
* derivatives (an input requires grad, so ``auto`` streams above :data:`~meanfield.kernels.STREAM_THRESHOLD`
  score entries): the Jacobian product J u (forward-mode AD: the streamed analytic JVP), J^T w
  (the streamed VJP) and the certified local constant (Lemma C.5, Lanczos with reverse-over-reverse
  products) on a weighted measure, a weighted causal sequence of atoms and a masked measure with
  arbitrary positions, each with two key tiles so that the online softmax rescales;
* the certified constant through the series (``local_lipschitz(attention="series")``, :mod:`meanfield.series_jacobian`)
  on weighted tokens of the unit sphere, with the series' own J u and J^T w, against the dense path.

The sizes are set by the kernel's thresholds, not by the level: they are the same at every level.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import plotting as P
from ..common import random_A, random_V, to_device
from ..contract import THEOREM, Claim, StudyResult, register
from ..grid import run_grid
from ..io import save_figure, write_csv

__all__ = ["kernel_paths", "case_task", "CASES", "grid", "forward_claim", "derivative_claim",
           "series_certificate_claim", "formula_claim", "written_out", "TOL", "FORMULA_TOL"]

#: relative tolerance of the agreement: two float64 evaluations of one map that sum in another order
#: differ by about 1e-15 relative; one wrong mask entry, log-weight or rescaling moves them by far more
TOL = 1e-10
#: the Lanczos tolerance of the certified constants compared (relative), and its iteration cap: the
#: dense path converges in about 12 iterations here; a wrong JVP or VJP (J^T not the transpose of J) stops
#: at the cap, not converged, instead of running Lanczos' default 300
LIP_TOL, LIP_MAX_ITER = 1e-10, 60

# name -> (what, size, operator masked, positions: None | "sequence" | "random", weighted, derivatives,
#          the path auto takes on CPU in float64)
CASES = {
    "weighted measure": ("F(mu), unmasked, random weights", 300, False, None, True, False, "fused"),
    "causal sequence": ("f^m(X), causal mask of a sequence", 300, True, "sequence", False, False, "fused"),
    "weighted causal atoms": ("F^m(mu), atoms at positions i/n, random weights", 300, True, "sequence", True, False,
                              "fused"),
    "masked measure": ("F^m(mu), random positions and weights", 300, True, "random", True, False, "fused"),
    "masked measure, large": ("F^m(mu), random positions and weights (above the fused path's mask range)", 2100,
                              True, "random", True, False, "stream"),
    "sphere tokens": ("F(mu), isotropic attention (beta = 1) on weighted tokens of the unit sphere", 8200, False, None,
                      True, False, "series"),
    "d weighted measure": ("J, J^T and Lip at mu, unmasked, random weights", 300, False, None, True, True, "stream"),
    "d weighted causal atoms": ("J, J^T and Lip at mu, atoms at positions i/n, random weights", 300, True,
                                "sequence", True, True, "stream"),
    "d masked measure": ("J, J^T and Lip at mu, random positions and weights", 300, True, "random", True, True,
                         "stream"),
    "d sphere tokens, series": ("J, J^T and Lip at mu through the series (local_lipschitz(attention='series')), "
                                "weighted tokens of the unit sphere", 600, False, None, True, True, "series"),
}
D = 3
RADIUS = 1.5


def _inputs(case: str, seed: int, device=None):
    """(operator, X, log-weights or None, positions or None) of a case; float64, drawn on the CPU."""
    from meanfield import IsotropicAttention, SelfAttention

    _, n, masked, positions, weighted, _, _ = CASES[case]
    g = torch.Generator().manual_seed(int(seed) * 1009 + n)
    X = RADIUS * torch.randn(n, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    lw = None
    if weighted:
        w = torch.rand(n, generator=g, dtype=torch.float64) + 0.05
        lw = (w / w.sum()).log()
    pos = None
    if positions == "random":
        pos = torch.rand(n, generator=g, dtype=torch.float64)
    elif positions == "sequence":
        pos = torch.arange(1, n + 1, dtype=torch.float64) / n
    if case == "sphere tokens":
        X = X / X.norm(dim=1, keepdim=True)
        att = IsotropicAttention(1.0)
    elif case == "d sphere tokens, series":
        X = X / X.norm(dim=1, keepdim=True)
        att = SelfAttention(*to_device(device, random_A(D, seed), random_V(D, seed)))
    else:
        att = SelfAttention(*to_device(device, 1.5 * random_A(D, seed), random_V(D, seed)), masked=masked)
    return att, to_device(device, X), None if lw is None else to_device(device, lw), \
        None if pos is None else to_device(device, pos)


def _map(att, lw, pos, sequence: bool):
    """Y -> the pushforward's points (a measure with the case's weights and positions), or f(Y)."""
    from particles import Measure

    if sequence:
        return att.sequence
    return lambda Y: att(Measure(Y, log_weights=lw, positions=pos)).points


def _paths_run(paths: list[str]) -> str:
    """The paths :func:`meanfield.kernels.record_paths` saw, as one label: the path when every call took it,
    else the paths joined by "+" (a case whose calls split between paths is not a test of one path)."""
    kinds = sorted(set(paths))
    return kinds[0] if len(kinds) == 1 else ("+".join(kinds) if kinds else "none")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


#: relative agreement of the dense kernel with attention written out in numpy: two float64 evaluations of one
#: formula in another order (measured: 6e-16 to 4e-15 at n <= 2100, 9e-15 for the 8200 sphere tokens); a
#: transposed V, a mask reversed or the weights dropped move them by far more
FORMULA_TOL = 1e-13


def written_out(case: str, seed: int) -> np.ndarray:
    """The case's forward pass written out in numpy, sharing no code with ``meanfield``: out_i = sum_j P_ij V x_j,
    P_ij = softmax_j(<A x_i, x_j> + log a_j) over the keys j the query i sees (s_j <= s_i when masked), by
    log-sum-exp in blocks of 1024 queries (A = beta I, V = I for the isotropic case)."""
    att, X, lw, pos = _inputs(case, seed)
    x = X.numpy()
    n, d = x.shape
    if case == "sphere tokens":
        A, V = att.beta * np.eye(d), np.eye(d)
    else:
        A, V = att.A.detach().cpu().numpy(), att.V.detach().cpu().numpy()
    la = np.full(n, -math.log(n)) if lw is None else lw.numpy()
    s = None if pos is None else pos.numpy()
    out = np.empty((n, V.shape[0]))
    vals = x @ V.T
    for i in range(0, n, 1024):
        S = (x[i:i + 1024] @ A.T) @ x.T + la[None, :]
        if CASES[case][2]:                                   # masked: key j visible to query i iff s_j <= s_i
            S = np.where(s[None, :] <= s[i:i + 1024, None], S, -np.inf)
        S = S - S.max(axis=1, keepdims=True)
        P = np.exp(S)
        out[i:i + 1024] = (P / P.sum(axis=1, keepdims=True)) @ vals
    return out


def case_task(case: str, seed: int, lipschitz: bool = True, *, device=None) -> dict:
    """One case measured by the path ``auto`` takes and by the dense path: relative deviations of the
    outputs (forward cases), or of J u (by forward-mode AD and by reverse-over-reverse, the product
    :func:`meanfield.local_lipschitz` uses), J^T w and, with ``lipschitz``, the certified constants
    (derivative cases)."""
    from meanfield import forward_mode, kernels, local_lipschitz, series_attention, series_jacobian
    from particles import Measure

    if case not in CASES:
        raise ValueError(f"case: expected one of {list(CASES)}, got {case!r}")
    what, n, masked, positions, weighted, derivatives, expected = CASES[case]
    att, X, lw, pos = _inputs(case, seed, device)
    sequence = positions == "sequence" and not weighted
    fn = _map(att, lw, pos, sequence)
    row = {"case": case, "what": what, "n": n, "entries": n * n,
           "expected_path": expected if X.device.type == "cpu" else "not dense"}
    if not derivatives:
        with torch.no_grad():
            with kernels.record_paths() as ran:
                got = fn(X)
            with kernels.use("dense"):
                if case in _FORWARD["series"]:
                    # the dense kernel on blocks of 1024 queries against every key (the same map, a sixth of the
                    # memory of one (8200, 8200) pass: the quick job's peak)
                    ref = torch.cat([att.evaluate(X[i:i + 1024], X, lw) for i in range(0, n, 1024)])
                else:
                    ref = fn(X)
        formula = torch.from_numpy(written_out(case, seed))
        return {**row, "path": _paths_run(ran), "calls": len(ran), "deviation": _rel(got, ref),
                "deviation_formula": _rel(ref.cpu(), formula)}
    g = torch.Generator().manual_seed(int(seed) + 17)
    u = torch.randn(n, D, generator=g, dtype=torch.float64).to(X.device)
    w = torch.randn(n, D, generator=g, dtype=torch.float64).to(X.device)

    series = expected == "series"
    K = series_jacobian.degree(att, X[None], lw) if series else None

    def lip(attention):
        with warnings.catch_warnings():   # a certificate that misses its tolerance is reported in the row
            warnings.simplefilter("ignore", RuntimeWarning)
            return local_lipschitz(att, Measure(X, log_weights=lw, positions=pos), tol=LIP_TOL,
                                   max_iter=LIP_MAX_ITER, on_failure="warn", attention=attention)

    def products(attention="exact"):
        """J u (forward mode and reverse-over-reverse), J^T w and the certified constant, by the path auto takes or,
        with ``attention="series"``, by the series at the certificate's degree (:mod:`meanfield.series_jacobian`)."""
        with contextlib.ExitStack() as stack:
            if attention == "series":
                stack.enter_context(kernels.use("series"))
                stack.enter_context(series_attention.pinned(K))
            Ju, Ju_rr, JTw = _products()
        return Ju, Ju_rr, JTw, (lip(attention) if lipschitz else None)

    def _products():
        forward_mode.ready()
        with torch.autograd.forward_ad.dual_level():
            Ju = torch.autograd.forward_ad.unpack_dual(fn(torch.autograd.forward_ad.make_dual(X, u))).tangent
        Xr = X.detach().requires_grad_(True)
        with torch.enable_grad():
            out = fn(Xr)
            JTw = torch.autograd.grad(out, Xr, w, retain_graph=True)[0]
            # J u as d<J^T v, u>/dv: the backward of the backward (the streamed JVP inside the VJP's node)
            v = torch.zeros_like(out, requires_grad=True)
            g_v = torch.autograd.grad(out, Xr, v, create_graph=True)[0]
            Ju_rr = torch.autograd.grad(g_v, v, u)[0]
        return Ju.detach(), Ju_rr, JTw

    with kernels.record_paths() as ran:
        Ju, Ju_rr, JTw, est = products("series" if series else "exact")
    row.update(path=_paths_run(ran), calls=len(ran))
    with kernels.use("dense"):
        Ju_d, Ju_rr_d, JTw_d, est_d = products()
    row.update(deviation_jvp=max(_rel(Ju, Ju_d), _rel(Ju_rr, Ju_d), _rel(Ju_rr_d, Ju_d)),
               deviation_vjp=_rel(JTw, JTw_d))
    if est is not None:
        row.update(lip=est.value, lip_dense=est_d.value, lip_error=est.error + est_d.error,
                   deviation_lip=abs(est.value - est_d.value) / est_d.value,
                   lip_allowed=(est.error + est_d.error) / est_d.value + TOL,
                   converged=est.converged and est_d.converged)
    return {**row, "deviation": max(row["deviation_jvp"], row["deviation_vjp"], row.get("deviation_lip", 0.0))}


def grid(level: str) -> dict:
    """The cases (the same at every level: their sizes are set by the kernel's thresholds)."""
    return {"cases": list(CASES), "d": D}


def _path_ok(r: dict) -> bool:
    return r["path"] != "dense" if r["expected_path"] == "not dense" else r["path"] == r["expected_path"]


def _cases_text(rows) -> str:
    return "; ".join(f"{r['case']} (n = {r['n']}, {r['path']}): {r['deviation']:.1e}" for r in rows)


def forward_claim(rows: list[dict], path: str) -> Claim:
    """The forward passes of the cases that ``auto`` runs on ``path`` ("fused", "stream" or "series") equal the dense
    kernel's to :data:`TOL` (relative), and ``auto`` takes that path at these sizes."""
    sel = [r for r in rows if r["case"] in _FORWARD[path]]
    wrong_path = [r for r in sel if not _path_ok(r)]
    off = [r for r in sel if not r["deviation"] <= TOL]
    where = {"fused": "torch's scaled_dot_product_attention: log-weights as a mask row or an extra key coordinate, "
                      "is_causal, an explicit boolean mask",
             "stream": "tiles with an online softmax (running max and sum rescaled tile by tile), masks per tile",
             "series": "the exponential of the centred scores as a truncated series of monomial features, its "
                       "truncation proved below the machine epsilon"}[path]
    return Claim(
        f"the {'streamed' if path == 'stream' else path} path of the attention kernel computes the dense kernel's map "
        f"(forward passes at sizes where auto takes it: {where})",
        f"max |out - out_dense| / max |out_dense| <= {TOL:g}",
        (f"{len(off)} of {len(sel)} cases off; " if sel else "no case; ") + _cases_text(sel)
        + (f"; auto took another path: {', '.join(r['case'] + ' -> ' + r['path'] for r in wrong_path)}"
           if wrong_path else ""),
        bool(sel) and not off and not wrong_path,
        "float64; the same operator and input evaluated under kernels.use('dense') (materialized scores, plain "
        "log-sum-exp softmax); the path is the one the calls ran (meanfield.kernels.record_paths)", kind=THEOREM,
        fails_if=f"some case's output differs from the dense kernel's by more than {TOL:g} (relative), or auto does "
                 f"not take the {path} path at the case's size (the claim would not test it)",
        short=f"the {'streamed' if path == 'stream' else path} attention kernel computes the dense kernel's map",
        short_measured=(f"{len(off)} of {len(sel)} cases off; largest deviation "
                        f"{max(r['deviation'] for r in sel):.1e}" if sel else "no case")
                       + ("; auto took another path" if wrong_path else ""))


_FORWARD = {"fused": ("weighted measure", "causal sequence", "weighted causal atoms", "masked measure"),
            "stream": ("masked measure, large",), "series": ("sphere tokens",)}


_DERIVATIVES = {"stream": ("d weighted measure", "d weighted causal atoms", "d masked measure"),
                "series": ("d sphere tokens, series",)}


def derivative_claim(rows: list[dict]) -> Claim:
    """J u, J^T w and the certified constant on the streamed path equal the dense path's."""
    sel = [r for r in rows if r["case"] in _DERIVATIVES["stream"]]
    wrong_path = [r for r in sel if not _path_ok(r)]
    off = [r for r in sel if not (r["deviation_jvp"] <= TOL and r["deviation_vjp"] <= TOL
                                  and ("lip" not in r or (r["converged"] and r["deviation_lip"] <= r["lip_allowed"])))]
    return Claim(
        "the streamed path's derivatives are those of the dense kernel: its analytic JVP, its VJP and the certified "
        "local constant built on them (Lemma C.5, Lanczos), at sizes where auto streams",
        f"relative deviation of J u and J^T w <= {TOL:g}; |Lip - Lip_dense| <= both error bars + {TOL:g} Lip",
        (f"{len(off)} of {len(sel)} cases off; " if sel else "no case; ")
        + "; ".join(f"{r['case'][2:]} (n = {r['n']}, {r['path']}): J u {r['deviation_jvp']:.1e}, J^T w "
                    f"{r['deviation_vjp']:.1e}" + (f", Lip {r['lip']:.10g} vs {r['lip_dense']:.10g}" if "lip" in r
                                                   else "") for r in sel)
        + (f"; auto took another path: {', '.join(r['case'] + ' -> ' + r['path'] for r in wrong_path)}"
           if wrong_path else ""),
        bool(sel) and not off and not wrong_path,
        "float64; J u by forward-mode AD (the streamed JVP) and by reverse-over-reverse (the streamed JVP inside the "
        "VJP's node, as local_lipschitz computes it), J^T w by a backward pass (the streamed VJP: torch's "
        "fused flash backward where the mask allows, Python tiles otherwise), Lip by Lanczos with reverse-over-reverse "
        f"products (tolerance {LIP_TOL:g}); the dense reference under kernels.use('dense')", kind=THEOREM,
        fails_if=f"J u or J^T w differs from the dense path's by more than {TOL:g} (relative), the two certified "
                 "constants differ by more than their error bars (or one misses its tolerance), or auto does not "
                 "stream at the case's size",
        short="streamed kernel: J u, J^T w and certified Lip equal the dense kernel's",
        short_measured=(f"{len(off)} of {len(sel)} cases off; J u, J^T w within "
                        f"{max(max(r['deviation_jvp'], r['deviation_vjp']) for r in sel):.1e}" if sel else "no case")
                       + ("; auto took another path" if wrong_path else ""))


def series_certificate_claim(rows: list[dict]) -> Claim:
    """The certified constant through the series (``local_lipschitz(attention="series")``: the series' Jacobian
    certified, carried to the exact one by Weyl's inequality and the proved truncation bound) agrees with the dense
    path's, and the series' J u and J^T w are the dense kernel's."""
    sel = [r for r in rows if r["case"] in _DERIVATIVES["series"]]
    wrong_path = [r for r in sel if not _path_ok(r)]
    off = [r for r in sel if not (r["deviation_jvp"] <= TOL and r["deviation_vjp"] <= TOL
                                  and ("lip" not in r or (r["converged"] and r["deviation_lip"] <= r["lip_allowed"])))]
    return Claim(
        "the certified local constant through the series is the exact one: the series' Jacobian certified by Lanczos "
        "and carried to the exact Jacobian by Weyl's inequality with the proved truncation bound (docs/math.md 4.8)",
        f"relative deviation of the series' J u and J^T w <= {TOL:g}; |Lip_series - Lip_dense| <= both error bars "
        f"+ {TOL:g} Lip",
        (f"{len(off)} of {len(sel)} cases off; " if sel else "no case; ")
        + "; ".join(f"{r['case'][2:]} (n = {r['n']}, {r['path']}): J u {r['deviation_jvp']:.1e}, J^T w "
                    f"{r['deviation_vjp']:.1e}" + (f", Lip {r['lip']:.12g} vs {r['lip_dense']:.12g} (error bars "
                                                   f"{r['lip_error']:.1e})" if "lip" in r else "") for r in sel)
        + (f"; the calls took another path: {', '.join(r['case'] + ' -> ' + r['path'] for r in wrong_path)}"
           if wrong_path else ""),
        bool(sel) and not off and not wrong_path,
        "float64; weighted tokens of the unit sphere, SelfAttention with a random A and V; J u by forward-mode AD and "
        "by reverse-over-reverse and J^T w by a backward pass through the series at the certificate's degree "
        f"(meanfield.series_attention.kernel_sum's own derivatives); Lip by Lanczos (tolerance {LIP_TOL:g}) with "
        "attention='series' against the dense path (kernels.use('dense'))", kind=THEOREM,
        fails_if=f"the series' J u or J^T w differs from the dense kernel's by more than {TOL:g} (relative), the two "
                 "certified constants differ by more than their error bars (or one misses its tolerance), or the "
                 "calls did not run the series",
        short="the certified constant through the series is the exact one",
        short_measured=(f"{len(off)} of {len(sel)} cases off"
                        + (f"; Lip {sel[0]['lip']:.10g} vs {sel[0]['lip_dense']:.10g}" if sel and "lip" in sel[0]
                           else "") if sel else "no case") + ("; the calls took another path" if wrong_path else ""))


def formula_claim(rows: list[dict]) -> Claim:
    """The reference itself: the dense kernel's forward pass of every forward case equals attention written out in
    numpy (:func:`written_out`) to :data:`FORMULA_TOL`. Every other claim of the study compares a path with the
    dense kernel of the same operator, so a mistake shared by every path (a transposed V, a reversed mask, the
    weights dropped in the operator) passed them all (a review by mutation)."""
    sel = [r for r in rows if "deviation_formula" in r]
    off = [r for r in sel if not r["deviation_formula"] <= FORMULA_TOL]
    worst = max((r["deviation_formula"] for r in sel), default=math.nan)
    return Claim(
        "the dense kernel, every path's reference, is attention as written: out_i = sum_j softmax_j(<A x_i, x_j> + "
        "log a_j, j visible to i) V x_j, computed again in numpy",
        f"max |out_dense - out_numpy| / max |out_numpy| <= {FORMULA_TOL:g}",
        (f"{len(off)} of {len(sel)} cases off; " if sel else "no case; ")
        + "; ".join(f"{r['case']} (n = {r['n']}): {r['deviation_formula']:.1e}" for r in sel),
        bool(sel) and not off,
        "float64; numpy's log-sum-exp softmax on the case's own points, weights, positions, A and V (A = I, V = I "
        "for the isotropic tokens), in blocks of 1024 queries; shares no code with meanfield", kind=THEOREM,
        fails_if=f"the dense kernel's output of some forward case differs from the numpy formula by more than "
                 f"{FORMULA_TOL:g} (relative): a transposed V or A, a mask in the wrong direction, dropped weights",
        short="the dense kernel, every path's reference, is attention as written",
        short_measured=f"{len(off)} of {len(sel)} cases off; largest deviation {worst:.0e}")


#: what deviations.png shows (the report prints it under the figure)
CAPTION = (
    "Each quantity (the output, the Jacobian products J u and J^T w, the certified Lipschitz constant) computed "
    "by the path under test (colour: the path that auto chose, or the series where it was asked for) and by the "
    "dense kernel, as a relative deviation on a log axis (an exact 0 drawn at 1e-18). Every bar must end left of "
    "the dashed line at 1e-10; the certified constants' own tolerance, their error bars plus 1e-10, is looser "
    "still and not drawn.")


@register("kernel_paths", "The attention kernel's fused, streamed and series paths against the dense kernel",
          grid=grid)
def kernel_paths(out_dir: Path, ctx) -> StudyResult:
    """Forward passes, JVP, VJP and certified constants by the fused / streamed / series paths against the dense
    kernel."""
    out_dir = Path(out_dir)
    rows = run_grid(case_task, [{"case": c, "seed": ctx.seed} for c in grid(ctx.level)["cases"]], out_dir,
                    "kernel_paths", ctx, device=ctx.device)
    write_csv(rows, out_dir / "kernel_paths.csv")
    claims = [forward_claim(rows, "fused"), forward_claim(rows, "stream"), derivative_claim(rows),
              forward_claim(rows, "series"), series_certificate_claim(rows), formula_claim(rows)]

    fig, ax = P.figure(width=10.0, height=4.4)
    labels, vals, colors = [], [], []
    for r in rows:
        for key, name in (("deviation", "output"), ("deviation_jvp", "J u"), ("deviation_vjp", "J^T w"),
                          ("deviation_lip", "Lip")):
            if key in r and (key != "deviation" or "deviation_jvp" not in r):
                labels.append(f"{r['case'].removeprefix('d ')} (n = {r['n']}): {name}")
                vals.append(max(r[key], 1e-18))
                colors.append(P.COLORS[{"fused": 0, "stream": 1, "series": 2}.get(r["path"], 3)])
    from matplotlib.patches import Patch

    y = np.arange(len(vals))
    ax.barh(y, vals, color=colors)
    line = ax.axvline(TOL, color="k", ls="--", lw=1.2)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    P.finish(ax, "relative deviation from the dense kernel (0 drawn at 1e-18)", "",
             f"each quantity by the path under test and by the dense kernel (float64, seed {ctx.seed})", logx=True,
             legend=False)
    ax.set_xlim(3e-19, 1e-8)
    ax.legend([Patch(color=P.COLORS[0]), Patch(color=P.COLORS[1]), Patch(color=P.COLORS[2]), line],
              ["auto took the fused path", "auto took the streamed path",
               "the series path (auto's for the output;\nattention='series' for the certificate)",
               f"tolerance {TOL:g} (Lip: the error bars + {TOL:g})"], loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save_figure(fig, out_dir / "deviations.png")
    notes = (f"d = {D}; A = 1.5 x a {D}x{D} Gaussian / sqrt({D}) and V Gaussian / sqrt({D}) (seed {ctx.seed}); "
             f"points Gaussian with scale {RADIUS} / sqrt({D}); weights uniform on [0.05, 1.05], normalized. "
             f"auto's thresholds (meanfield.kernels): fused forward passes above 2^14 score entries, streamed "
             f"derivatives above 2^15, masked forward passes fused with an explicit mask up to 2^22 entries and "
             f"streamed above; the streamed tiles are 256 x 256, so n = 300 gives two key tiles and n = 2100 nine. "
             f"The sphere tokens: the same points normalized, isotropic attention with beta = 1 (A = V = I), "
             f"n = 8200 (above the series' 2^22 score entries and its cost model's cut, about 3800 tokens in "
             f"float64). The series' certificate: the same normalized points (n = 600) under SelfAttention with A "
             f"and V as above but A not scaled by 1.5.")
    summary = {r["case"]: {k: v for k, v in r.items() if k != "case"} for r in rows}
    return StudyResult("kernel_paths", "The attention kernel's fused, streamed and series paths against the dense "
                       "kernel",
                       claims, ["deviations.png"], ["kernel_paths.csv"], summary, notes,
                       captions={"deviations.png": CAPTION})
