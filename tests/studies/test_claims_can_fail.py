"""Each key claim of the synthetic studies fails on a plausible wrong input: the claim checks of the
studies are fed measurements computed here from dense Jacobians of the written-out attention of
tests/reference.py (the claim holds), then the same measurements with one thing wrong (a slope of 0.6,
a bound off by a factor 2, Proposition 3.6's ratio without its 1/(gamma R^2) term, a split constant
that depends on the fraction, ...), on which the claim must fail."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import bounds
from studies.common import slope_claim, witness_columns, witness_tolerance
from studies.experiments.dynamics import meanfield_claim, range_relative_clusters
from studies.experiments.l2_attention import kim_attained_claim, quadratic_claim
from studies.experiments.large_radius import sup_claim
from studies.experiments.masked import running_mean_claims, top_direction_claim
from studies.experiments.mass_splitting import closed_form_claim
from studies.experiments.mean_field import peak_claim, prop36_claim
from studies.experiments.sqrt_n import witness_claim
from tests.reference import dense_lipschitz, dense_lipschitz_logweights, naive_attention, prop34_lower

f64 = torch.float64
A_MIN = torch.tensor([[0.3, 0.4], [0.0, -1.0]], dtype=f64)   # gamma = 1, case "min"
I2 = torch.eye(2, dtype=f64)


def _witness(R, n):  # Proposition 3.4's witness written out: (-R u, R u, ..., R u), A u = -u
    u = torch.tensor([-0.4, 1.3], dtype=f64)  # (A + I) u = 0
    u = u / u.norm()
    return torch.cat([-R * u[None], (R * u)[None].expand(n - 1, -1)])


def _witness_rows(R, ns, A=A_MIN):
    """Measured rows of the sqrt_n study: dense constants at the witness and the bound (both written out
    here), the witness's columns from the library (its closed form, checked against dense Jacobians in
    tests/meanfield/test_predicted_forms.py)."""
    from meanfield import adversarial

    info = bounds.gamma_info(A)
    I = torch.eye(A.shape[0], dtype=f64)
    rows = []
    for n in ns:
        lip = dense_lipschitz(lambda Y: naive_attention(Y, A, I), adversarial.sqrt_n_sequence(A, R, n))
        rows.append({"n": n, "lip": lip, "lower": prop34_lower(info.gamma, R, n), **witness_columns(A, R, n)})
    return rows


def _simple_factor(g, R, n):   # the leading-order form of the witness's factor for a normal A, case "min"
    b = 1 / (1 + (n - 1) * math.exp(-2 * g * R * R))
    return 1 + 2 * g * R * R * (1 - b)


@pytest.fixture(scope="module")
def witness_rows():
    R = math.sqrt(math.log(1e4) / 2)            # exp(2 gamma R^2) = 1e4
    return R, _witness_rows(R, [4, 8, 16, 32, 64])


def test_sqrt_n_exponent_claim_fails_on_a_wrong_slope(witness_rows):
    R, rows = witness_rows
    ns = [r["n"] for r in rows]
    lips = [r["lip"] for r in rows]
    pred = [r["witness_predicted"] for r in rows]
    curve = [r["lower"] for r in rows]       # Prop 3.4's curve, written out here (prop34_lower)
    claim, fit, fit_pred = slope_claim(ns, lips, pred, curve, "the witness")
    assert claim.agrees and abs(fit["slope"] - fit_pred["slope"]) < 1e-9
    assert fit["slope"] > 0.52                # the asymptote 0.5 alone would have been the wrong reference here
    wrong = [r["lip"] * (r["n"] / ns[0]) ** 0.1 for r in rows]          # slope about 0.6
    assert not slope_claim(ns, wrong, pred, curve, "the witness")[0].agrees
    flat = [r["lip"] * (ns[0] / r["n"]) ** 0.12 for r in rows]          # flattening to about 0.44
    assert not slope_claim(ns, flat, pred, curve, "the witness")[0].agrees


def test_prop34_witness_claim_fails_when_the_bound_is_off_by_a_factor(witness_rows):
    R, rows = witness_rows
    assert witness_claim(rows, 1.0, R, "min").agrees
    for factor in (0.5, 2 ** -0.5):  # a bound too small by 2 or sqrt(2) still passes "Lip >= bound"
        wrong = [{**r, "lower": factor * r["lower"]} for r in rows]
        assert all(r["lip"] >= r["lower"] for r in wrong)
        assert not witness_claim(wrong, 1.0, R, "min").agrees
    # a witness whose constant is off (e.g. its first token at R u / 2) fails too, by 1.05 or by 1.001
    assert not witness_claim([{**r, "lip": 1.05 * r["lip"]} for r in rows], 1.0, R, "min").agrees
    assert not witness_claim([{**r, "lower": r["lower"] / 1.001} for r in rows], 1.0, R, "min").agrees


def test_prop34_witness_claim_tells_the_exact_factor_from_the_normal_form():
    """A strongly non-normal A (A^T u far from lambda u, as in trained heads): the simple factor
    1 + 2 gamma R^2 (1 - b), right for a normal A, is off near the transition and the claim says so;
    the closed form that counts A^T u is not."""
    A = torch.tensor([[-1.0, 0.0, 0.0], [12.0, 0.2, 0.0], [0.0, 3.0, 0.1]], dtype=f64)
    info = bounds.gamma_info(A)
    assert info.case == "min" and np.linalg.norm(info.transpose_image - info.eigenvalue * info.eigenvector) > 4
    R = math.sqrt(math.log(200) / (2 * info.gamma))          # exp(2 gamma R^2) = 200: n = 2..64 near the transition
    rows = _witness_rows(R, [2, 4, 8, 16, 32, 64], A)
    assert witness_claim(rows, info.gamma, R, "min").agrees
    simple = [{**r, "witness_factor": _simple_factor(info.gamma, R, r["n"])} for r in rows]
    assert max(abs(r["lip"] / r["lower"] / r["witness_factor"] - 1) for r in simple) > 0.05
    assert not witness_claim(simple, info.gamma, R, "min").agrees


def test_prop36_ratio_claim_fails_without_the_correction_term():
    A = torch.diag(torch.tensor([0.3, -1.0], dtype=f64))   # gamma = 1, case "min"
    u = torch.tensor([0.0, 1.0], dtype=f64)
    rows = []
    for R in (1.5, 2.0, 2.5):
        lw = torch.tensor([-2 * R * R, math.log1p(-math.exp(-2 * R * R))], dtype=f64)
        X = torch.stack([-R * u, R * u])
        lip = dense_lipschitz_logweights(lambda Y, lw=lw: naive_attention(Y, A, I2, log_weights=lw), X, lw)
        asym = 0.5 * R * R * math.exp(R * R)
        rows.append({"R": R, "ratio_to_asymptotic": lip / asym, "ratio_predicted": 1 + 1 / (R * R)})
    assert prop36_claim(rows, 1.0).agrees
    assert not prop36_claim([{**r, "ratio_to_asymptotic": 1.0} for r in rows], 1.0).agrees  # "ratio -> 1" only
    assert not prop36_claim([{**r, "ratio_to_asymptotic": 1.08 * r["ratio_to_asymptotic"]} for r in rows],
                            1.0).agrees  # inside the old window [0.8, 1.5], yet wrong
    assert not prop36_claim([{**r, "ratio_predicted": 1.0} for r in rows], 1.0).agrees
    with pytest.raises(ValueError, match="gamma R"):
        prop36_claim([{**r, "R": 0.5} for r in rows], 1.0)


def test_sup_claim_fails_when_the_bound_is_off_by_a_factor():
    """||V|| sqrt(n) is attained at the hub direction: a bound twice too large misses it, half as large
    is exceeded."""
    rows = [{"kind": "hub", "masked": m, "R": R, "limit": 2.0, "lip": 2.0 * (1 + 1e-9 / R), "v_norm_sqrt_n": 2.0}
            for m in (False, True) for R in (1.0, 10.0)]
    rows += [{"kind": "random", "masked": False, "R": 10.0, "limit": 1.2, "lip": 1.2, "v_norm_sqrt_n": 2.0}]
    assert sup_claim(rows).agrees
    for factor in (2.0, 0.5):
        assert not sup_claim([{**r, "v_norm_sqrt_n": factor * r["v_norm_sqrt_n"]} for r in rows]).agrees


def test_kim_claim_fails_for_the_recalled_form_and_a_doubled_bound():
    """W_Q = 2I, W_V = W_O = I, D = k = 2, N = 1 (docs/math.md section 5.8): the map x -> x W_Q W_Q^T / sqrt(k)
    has norm 4/sqrt(2); the fourth-power form gives 4/sqrt(2), the recalled one 2/sqrt(2)."""
    WQ = 2 * I2
    x = torch.tensor([[0.6, 0.8]], dtype=f64)
    lip = dense_lipschitz(lambda Y: Y @ (WQ @ WQ.T / math.sqrt(2)), x)
    assert lip == pytest.approx(4 / math.sqrt(2), rel=1e-12)
    study = {"which": "study", "lip_l2": 0.3, "linear_map_norm": 0.3, "kim_bound": 0.7}
    ident = {"which": "scaled identity", "lip_l2": lip, "linear_map_norm": 4 / math.sqrt(2)}
    assert kim_attained_claim([{**ident, "kim_bound": 4 / math.sqrt(2)}, study]).agrees
    for bound in (2 * 4 / math.sqrt(2), 2 / math.sqrt(2)):   # doubled, and the recalled form
        assert not kim_attained_claim([{**ident, "kim_bound": bound}, study]).agrees


def test_quadratic_claim_fails_for_another_limit():
    """Lip / R^2 must tend to the origin's query term; a constant twice as large (or growing like R^3) fails."""
    rows = [{"R": 64.0, "n": 12, "lip_dot": 366.81, "query_origin": 366.73}]
    assert quadratic_claim(rows).agrees
    assert not quadratic_claim([{**rows[0], "lip_dot": 2 * 366.81}]).agrees
    assert not quadratic_claim([{**rows[0], "lip_dot": 366.81 * 64 / 10}]).agrees


def test_closed_form_claim_fails_when_the_split_constant_depends_on_t():
    from meanfield import bounds

    g = torch.Generator().manual_seed(5)
    A, V = 2 * torch.randn(2, 2, generator=g, dtype=f64), torch.randn(2, 2, generator=g, dtype=f64)
    X = torch.randn(3, 2, generator=g, dtype=f64)
    w = torch.tensor([0.3, 0.5, 0.2], dtype=f64)
    base = dense_lipschitz(lambda Y: naive_attention(Y, A, V, log_weights=w.log()), X, weights=w)
    rows = []
    for t in (0.2, 0.5, 0.8):
        Xs, ws = torch.cat([X, X[1:2]]), torch.cat([w, w[1:2] * (1 - t)])
        ws[1] = w[1] * t
        split = dense_lipschitz(lambda Y, ws=ws: naive_attention(Y, A, V, log_weights=ws.log()), Xs, weights=ws)
        query = float(bounds.query_term_norms(A, V, X, w.log())[1])
        rows.append({"t": t, "lip_unsplit": base, "lip_split": split, "query_term": query,
                     "closed_form": max(base, query)})
    assert closed_form_claim(rows).agrees
    assert not closed_form_claim([{**r, "lip_split": r["lip_split"] * (1 + 0.01 * r["t"])} for r in rows]).agrees
    # "splitting never changes the constant" (closed form = unsplit) fails where the query term is larger
    helped = [{**r, "query_term": 1.5 * r["lip_unsplit"], "closed_form": 1.5 * r["lip_unsplit"]} for r in rows]
    assert not closed_form_claim(helped).agrees


def test_top_direction_claim_fails_for_a_wrong_local_constant():
    rows = [{"kind": "sequence", "rep": 0, "eps": e, "deviation": 0.6 * e} for e in (1e-2, 1e-3, 1e-4)]
    assert top_direction_claim(rows).agrees
    assert not top_direction_claim([{**r, "deviation": 0.5 + r["deviation"]} for r in rows]).agrees  # Lip x 2/3
    assert not top_direction_claim([{**r, "deviation": 0.3 * math.sqrt(r["eps"])} for r in rows]).agrees


def test_running_mean_claims_fail_for_an_unmasked_kernel_and_would_reproduce_a_true_theorem_4_4():
    """The closed form ||C_n|| ||V|| at A = 0: measured by the dense Jacobian of the masked kernel written out
    (tests/reference.py), it holds; an unmasked kernel (constant ||V||) or a mask off by one position fails it.
    The finding about Theorem 4.4's stated bound (||V|| at A = 0) is 'not reproduced' on the true constants and
    would be 'reproduced' in a world where the constants stayed below it."""
    from meanfield import bounds

    V = torch.tensor([[0.7, 0.2], [0.0, 1.1]], dtype=f64)
    nv = float(torch.linalg.matrix_norm(V, 2))
    rows, shifted = [], []
    for n in (2, 5, 12):
        X = torch.randn(n, 2, generator=torch.Generator().manual_seed(n), dtype=f64)
        lip = dense_lipschitz(lambda Y: naive_attention(Y, torch.zeros(2, 2, dtype=f64), V, masked=True), X)
        row = {"n": n, "lip_sequence": lip, "error_sequence": 1e-12, "lip_measure": lip, "error_measure": 1e-12,
               "closed_form": bounds.cesaro_norm(n) * nv, "v_norm": nv, "stated_bound": nv}
        rows.append(row)
        C = np.tril(np.ones((n, n)), -1) / np.maximum(np.arange(n), 1)[:, None]   # keys strictly before
        C[0, 0] = 1.0
        shifted.append(np.linalg.norm(C, 2) * nv)
    exact, stated = running_mean_claims(rows)
    assert exact.agrees and not stated.agrees
    unmasked = [{**r, "lip_sequence": r["v_norm"], "lip_measure": r["v_norm"]} for r in rows]
    assert not running_mean_claims(unmasked)[0].agrees and running_mean_claims(unmasked)[1].agrees
    off_by_one = [{**r, "lip_sequence": c, "lip_measure": c} for r, c in zip(rows, shifted)]
    assert not running_mean_claims(off_by_one)[0].agrees
    # one row off of three is counted as one (the count compared the largest deviation, so it said 3 of 3)
    one_off = [rows[0], {**rows[1], "lip_measure": 1.01 * rows[1]["lip_measure"]}, rows[2]]
    assert running_mean_claims(one_off)[0].short_measured.endswith("; 1 of 3 off")


def test_peak_claim_fails_at_another_grid_point():
    R, g = 3.0, 1.0
    ns = 10.0 ** np.arange(1, 9.01, 0.5)
    q = math.exp(-2 * g * R * R)

    def form(n):
        b = 1 / (1 + (n - 1) * q)
        return math.sqrt(n - 1) * b * (1 + 2 * g * R * R * (1 - b))
    curve = [{"n": n, "lip": form(n), "witness_predicted": form(n)} for n in ns]
    n_star = math.exp(2 * g * R * R)
    assert peak_claim(curve, n_star, 100.0, g, R).agrees
    shifted = [{**r, "lip": form(r["n"] / 10)} for r in curve]   # peaks a decade later
    assert not peak_claim(shifted, n_star, 100.0, g, R).agrees
    assert not peak_claim(curve, n_star, 1.0, g, R).agrees          # above the mean-field bound
    # a peak as predicted, but far from exp(2 gamma R^2) (a transition scale off by a factor 100): not "near"
    assert not peak_claim(curve, 100 * n_star, 100.0, g, R).agrees
    assert peak_claim(curve, 5 * n_star, 100.0, g, R).agrees


def test_meanfield_claim_verdicts():
    rng = np.random.default_rng(0)
    ns = [16, 32, 64, 128, 256]

    def rows(rate_T, noise):
        return [{"n": n, "rep": r, "w2_0": n ** -0.5 * math.exp(0.05 * rng.normal()),
                 "w2_T": 2 * n ** rate_T * math.exp(noise * rng.normal())} for n in ns for r in range(3)]
    cfg = {"n_ref": 1024, "reps": 3}
    assert meanfield_claim(rows(-0.5, 0.05), cfg).verdict == "reproduced"
    assert meanfield_claim(rows(0.2, 0.05), cfg).verdict == "not reproduced"       # W2 at T grows with n
    assert meanfield_claim(rows(-0.1, 0.05), cfg).verdict == "not reproduced"      # slower than at t = 0
    assert meanfield_claim(rows(-0.5, 2.0), cfg).verdict == "inconclusive"     # too noisy to decide


def test_witness_tolerance_is_the_order_of_the_neglected_terms():
    assert witness_tolerance(1.0, 3.0) == pytest.approx(2 * math.exp(-18) * 100)
    assert witness_tolerance(1.0, 100.0) == 1e-9


# ---------------------------------------------------------------------- the kernel's fused and streamed paths
def _mutant(monkeypatch, module, name, old, new):
    """Replace ``module.name`` by the same function with one mistake (``old`` -> ``new`` in its source),
    compiled in the module's namespace, so that every caller in the module runs the mistake."""
    import inspect
    import textwrap

    src = textwrap.dedent(inspect.getsource(getattr(module, name)))
    assert src.count(old) == 1, f"{name}: the line to mutate ({old!r}) is not in its source once"
    scope: dict = {}
    exec(compile(src.replace(old, new), f"<mutant of {module.__name__}.{name}>", "exec"), module.__dict__, scope)
    monkeypatch.setattr(module, name, scope[name])


def _kernel_claims(cases, lipschitz=False):
    """The four kernel-path claims on some cases (the certified constants only on request: a wrong JVP makes
    Lanczos run to its iteration cap, and the products alone already decide)."""
    from studies.experiments import kernel_paths as kp

    rows = [kp.case_task(c, 0, lipschitz) for c in cases]
    return {"fused": kp.forward_claim(rows, "fused"), "stream": kp.forward_claim(rows, "stream"),
            "derivatives": kp.derivative_claim(rows), "series": kp.forward_claim(rows, "series"),
            "series certificate": kp.series_certificate_claim(rows)}


_FWD_FUSED = ["weighted measure", "causal sequence", "weighted causal atoms", "masked measure"]
_FWD_STREAM = ["masked measure, large"]
_FWD_SERIES = ["sphere tokens"]
_D_SERIES = ["d sphere tokens, series"]


def test_kernel_path_claims_hold_on_the_kernel_as_written():
    claims = _kernel_claims(_FWD_FUSED + _FWD_STREAM + _FWD_SERIES + _D_SERIES
                            + ["d weighted measure", "d masked measure", "d weighted causal atoms"])
    assert all(c.agrees for c in claims.values()), {k: c.measured for k, c in claims.items()}


def test_kernel_path_claims_fail_when_the_operator_never_runs_the_path(monkeypatch):
    """An operator whose calls all went to the dense path agrees with the dense reference trivially; the study read
    the path from kernels.choose on rebuilt inputs, so every claim held (a review found it). The path is now what
    the calls ran."""
    import meanfield.attention as attention_module
    import meanfield.isotropic as isotropic_module
    from meanfield import kernels

    real = kernels.attend
    for module in (attention_module, isotropic_module):
        monkeypatch.setattr(module, "attend", lambda *a, **k: real(*a, **{**k, "method": "dense"}))
    claims = _kernel_claims(["weighted measure", "masked measure, large", "d weighted measure", "sphere tokens"]
                            + _D_SERIES)
    assert not any(c.agrees for c in claims.values()), {k: c.measured for k, c in claims.items()}
    assert all("took another path" in c.short_measured for c in claims.values())


# (module.function of the streamed kernel, line as written, the mistake, cases that must see it, claim that must fail)
_KERNEL_MISTAKES = {
    "tile mask includes the diagonal's neighbours": (
        "attention_tiles.score_tile", "kp[:, None, j0:j1] > qpa", "kp[:, None, j0:j1] >= qpa",
        _FWD_STREAM, "stream"),
    "tile mask in the streamed derivatives": (
        "attention_tiles.score_tile", "kp[:, None, j0:j1] > qpa", "kp[:, None, j0:j1] >= qpa",
        ["d masked measure"], "derivatives"),
    "tiles drop the log-weights": (
        "attention_tiles.score_tile", "s += lwT[:, :, j0:j1]", "s += 0 * lwT[:, :, j0:j1]", _FWD_STREAM, "stream"),
    "online softmax does not rescale the accumulated values": (
        "attention_tiles.forward_tiles", "acc = torch.baddbmm(acc.mul_(alpha), p, v[:, j0:j1])",
        "acc = torch.baddbmm(acc, p, v[:, j0:j1])", _FWD_STREAM, "stream"),
    "online softmax does not rescale the running sum": (
        "attention_tiles.forward_tiles", "run_sum.mul_(alpha).add_(", "run_sum.add_(",
        ["d masked measure"], "derivatives"),
    "JVP without the mean term": (
        "attention_tiles.jvp_tiles", "d_ext.sub_(d_lse.unsqueeze(-1) * out)", "d_ext",
        ["d weighted measure"], "derivatives"),
    "VJP tiles without the row term": (
        "attention_tiles.backward_tiles", "torch.bmm(go, vT[:, :, j0:j1]).sub_(delta[:, i0:i1])",
        "torch.bmm(go, vT[:, :, j0:j1])", ["d masked measure"], "derivatives"),
    "flash path drops the log-weights": (
        "flash_cpu.layout", "mask = lw[:, None, None, :]", "mask = None", ["d weighted measure"], "derivatives"),
    "fused path drops the log-weights": (
        "streamed_attention.fused_attend", "mask = lw.unsqueeze(-2)", "mask = None", ["weighted measure"], "fused"),
    "fused path forgets the causal mask": (
        "streamed_attention.fused_attend", "is_causal=causal", "is_causal=False",
        ["causal sequence", "weighted causal atoms"], "fused"),
    "series at half the degree": (
        "series_attention._series", "num = kernel_sum(q / scale, ks, wv, K)",
        "num = kernel_sum(q / scale, ks, wv, K // 2)", _FWD_SERIES, "series"),
    "series drops the log-weights": (
        "series_attention._series", "* a.unsqueeze(-1)", "* 1", _FWD_SERIES, "series"),
    "series without the factorials": (
        "series_attention._kernel_sums", "scale = _inverse_factorials(e, top, x.device, x.dtype)",
        "scale = 1 + 0 * _inverse_factorials(e, top, x.device, x.dtype)", _FWD_SERIES, "series"),
    "series tangent with the key tangent's products transposed": (
        "series_attention._KernelSum", "values.append(_outer(dy, w))", "values.append(_outer(w, dy))", _D_SERIES,
        "series certificate"),
    "series tangent without the query term": (
        "series_attention._KernelSum", "values.append(_outer(y, w))", "values.append(0 * _outer(y, w))", _D_SERIES,
        "series certificate"),
    "series backward with the query side's products transposed": (
        "series_attention._KernelSum", "H = kernel_sums(x, y, [(_outer(y, w), K - 1)])",
        "H = kernel_sums(x, y, [(_outer(w, y), K - 1)])", _D_SERIES, "series certificate"),
    "series backward with the sides of w's gradient exchanged": (
        "series_attention._KernelSum", "res = kernel_sums(y, x, sums)", "res = kernel_sums(x, y, sums)",
        _D_SERIES, "series certificate"),
}


@pytest.mark.parametrize("mistake", list(_KERNEL_MISTAKES))
def test_kernel_path_claims_fail_on_a_wrong_kernel(monkeypatch, mistake):
    """One mistake in the fused or streamed path (a mask, a log-weight, the online softmax's rescaling, the
    JVP, the VJP) flips the claim of the path it is on, at the study's own sizes."""
    import importlib

    where, old, new, cases, claim = _KERNEL_MISTAKES[mistake]
    module, name = where.split(".")
    _mutant(monkeypatch, importlib.import_module(f"meanfield.{module}"), name, old, new)
    assert not _kernel_claims(cases)[claim].agrees


def test_kernel_path_claims_fail_when_auto_takes_another_path(monkeypatch):
    """Thresholds moved so that auto stays dense: the claims would test nothing, and say so by failing."""
    from meanfield import kernels

    monkeypatch.setattr(kernels, "FUSED_THRESHOLD", 2**20)
    monkeypatch.setattr(kernels, "STREAM_THRESHOLD", 2**20)
    monkeypatch.setattr(kernels, "SERIES_THRESHOLD", 2**30)
    claims = _kernel_claims(["weighted measure", "d weighted measure", "sphere tokens"])
    assert not claims["fused"].agrees and not claims["derivatives"].agrees and not claims["series"].agrees
    assert "auto took another path" in claims["fused"].measured


# ------------------------------------------------------------- real layers (studies.experiments.real_models)
def _head_rows(R, ns, gamma=1.0):
    """The real_models study's rows of Proposition 3.4's head check, from dense Jacobians of A_MIN's witness."""
    return [{"n": r["n"], "lip_head": r["lip"], "lip_head_error": 0.0, "head_converged": True, "lower": r["lower"],
             "witness_factor": r["witness_factor"], "witness_cluster": r["witness_cluster"], "gamma": gamma, "R": R,
             "gamma_R2": gamma * R * R} for r in _witness_rows(R, ns)]


@pytest.mark.parametrize("R", [math.sqrt(math.log(1e4) / 2), 4.0])   # exp(2 gamma R^2) = 1e4, and 2 gamma R^2 = 32
def test_real_head_witness_claim_fails_for_a_wrong_bound_or_witness(R):
    from studies.experiments.real_models import head_witness_claim

    rows = _head_rows(R, [2, 4, 8, 16, 32, 64])
    claim = head_witness_claim(rows)
    assert claim.agrees, claim.measured
    for factor in (0.5, 2 ** -0.5):   # a bound too small by 2 or sqrt(2): "Lip >= bound" still holds
        wrong = [{**r, "lower": factor * r["lower"]} for r in rows]
        assert all(r["lip_head"] >= r["lower"] for r in wrong)
        assert not head_witness_claim(wrong).agrees
    assert not head_witness_claim([{**r, "lip_head": 1.05 * r["lip_head"]} for r in rows]).agrees
    assert not head_witness_claim([{**r, "lower": 1.01 * r["lip_head"]} for r in rows]).agrees   # bound violated
    if R == 4.0:   # deep in the regime: the lower bound is sqrt(n - 1) and attained; the claim says why
        assert "Lip / lower = 1 because 2 gamma R^2 >= 32" in claim.measured


def test_lemma38_claim_fails_exactly_beyond_its_reported_slack():
    """A tiny random BERT layer: the certified constant is the dense Jacobian's top singular value of the layer
    rewritten from raw weights, the bound the study's. The claim holds, reports the slack bound / Lip, and fails
    for a bound smaller than the constant, i.e. wrong by more than the slack (and only then)."""
    from meanfield import hf as mhf
    from studies import models as hf
    from studies.experiments.real_models import LayerBound, lemma38_claim, lemma38_equality
    from tests.meanfield.test_hf import dense_lipschitz as dense_layer
    from tests.meanfield.test_hf import reimplementation

    model = hf.random_model("bert", size="tiny", seed=2)
    ids = hf.encode(hf.HashTokenizer(model.config.vocab_size), hf.default_corpus(), 8)
    X = mhf.capture_attention_inputs(model, ids, [1])[1]
    lip = dense_layer(reimplementation(model, 1, False), X)
    bound = LayerBound(mhf.extract_layer(model, 1))(float(X.norm(dim=1).max()), 8)
    row = {"model": "M", "mode": "encoder", "layer": 1, "map": "attention", "n": 8, "lip": lip, "lip_error": 0.0,
           "upper": bound, "upper_t1": 1.5 * bound}
    tight = lemma38_equality(mhf.extract_layer(model, 1), 0, X.double(), False)
    tables = {"lipschitz": [row], "adversarial": [], "lemma38_tight": [tight]}
    claim = lemma38_claim(tables)
    slack = bound / lip
    assert claim.agrees and f"slack (bound / Lip) >= {slack:.3g}" in claim.measured and slack > 1
    assert lemma38_claim({**tables, "lipschitz": [{**row, "upper": bound / (0.99 * slack)}]}).agrees
    assert not lemma38_claim({**tables, "lipschitz": [{**row, "upper": bound / (1.01 * slack)}]}).agrees
    assert not lemma38_claim({**tables, "lemma38_tight": []}).agrees   # the equality case not measured


def _raw_head_lipschitz(model, layer, head, X):
    """The top singular value of the dense Jacobian of head ``head`` of a BERT layer without its biases,
    rewritten from the raw weights: softmax(X Q^T K X^T / sqrt(k)) X V^T."""
    from tests.meanfield.test_hf import dense_lipschitz

    att = model.encoder.layer[layer].attention.self
    k = att.attention_head_size
    rows = slice(head * k, (head + 1) * k)
    Q, K, V = (w.weight.detach().double()[rows] for w in (att.query, att.key, att.value))
    return dense_lipschitz(lambda Y: torch.softmax(Y @ Q.T @ K @ Y.T / k ** 0.5, dim=-1) @ Y @ V.T, X)


@pytest.mark.parametrize("combine", ["root-sum-square", "max", "sum"])
def test_lemma38_equality_case_catches_how_the_heads_are_combined(monkeypatch, combine):
    """Lemma 3.8's slack on trained layers (10^2 and more) hides how the heads are combined; its equality case
    does not: H copies of a head summed have the constant H Lip(f^h) (here H times the dense Jacobian's top
    singular value of the head rewritten from raw weights), which the lemma's root-sum-square attains and a
    maximum (sqrt(H) Lip) or a sum (H^1.5 Lip) of the heads misses by sqrt(H)."""
    import math

    from meanfield import bounds
    from meanfield import hf as mhf
    from studies import models as hf
    from studies.experiments.real_models import lemma38_claim, lemma38_equality

    model = hf.random_model("bert", size="tiny", seed=3)
    ids = hf.encode(hf.HashTokenizer(model.config.vocab_size), hf.default_corpus(), 8)
    X = mhf.capture_attention_inputs(model, ids, [0])[0].double()
    p = mhf.extract_layer(model, 0)
    truth = p.num_heads * _raw_head_lipschitz(model, 0, 1, X)
    right = bounds.multihead_upper
    wrong = {"max": lambda lips, W: right([max(lips)], W), "sum": lambda lips, W: right([sum(lips)], W)}
    if combine in wrong:
        monkeypatch.setattr(bounds, "multihead_upper", wrong[combine])
    row = {"model": "M", "mode": "encoder", "layer": 0, **lemma38_equality(p, 1, X, False)}
    assert row["converged"] and row["lip_mh"] == pytest.approx(truth, rel=1e-6)
    assert row["lip_head"] == pytest.approx(truth / p.num_heads, rel=1e-6)
    factor = {"root-sum-square": 1.0, "max": 1 / math.sqrt(p.num_heads), "sum": math.sqrt(p.num_heads)}[combine]
    assert row["bound"] == pytest.approx(factor * truth, rel=1e-6)
    claim = lemma38_claim({"lipschitz": [], "adversarial": [], "lemma38_tight": [row]})
    assert claim.agrees is (combine == "root-sum-square")


@pytest.mark.parametrize("mistake", ["no weighting", "inverted weighting"])
def test_w2_sense_check_of_lemma_32_fails_for_a_wrong_weighting(monkeypatch, mistake):
    """discrete_vs_meanfield-1 also checks the W2 sense at unequal weights against exact W2 ratios: the
    Euclidean Jacobian (no weighting) or D^-1/2 J D^1/2 (inverted) pass Lemma 3.2's equal-weight check (their
    scalings are 1 there) but fail this one; Lemma C.5's weighting passes."""
    import meanfield.jacobian as J
    from studies.experiments.discrete_vs_meanfield import W2_TOL, lemma_3_2_task, w2_sense_task

    def worst(fn):
        rows = [fn(n, 3, 2.0, 0, 0) for n in (4, 8)]
        return max(max(r["top_rel_diff"], r["random_excess"]) for r in rows), max(
            lemma_3_2_task(n, 3, 2.0, 0, 0)["rel_diff"] for n in (4, 8))

    right, lemma = worst(w2_sense_task)
    assert right <= W2_TOL and lemma <= 1e-7
    orig = J._scalings
    ones = lambda lw, dt: (torch.ones_like(lw, dtype=dt)[:, None], torch.ones_like(lw, dtype=dt)[:, None])  # noqa: E731
    monkeypatch.setattr(J, "_scalings", ones if mistake == "no weighting" else
                        (lambda lw, dt: tuple(reversed(orig(lw, dt)))))
    wrong, lemma = worst(w2_sense_task)
    assert lemma <= 1e-7          # invisible at equal weights
    assert wrong > 10 * W2_TOL    # seen by W2


def test_variance_trend_finds_the_simulated_rate_and_needs_every_n():
    """discrete_vs_meanfield-3/4: the slope of log variance against log n over every n. Truth: Gaussian samples with
    a chosen variance law. Its 95% interval covers the simulated slope about 95% of the time (300 draws: 90-99%),
    a variance falling as 1/n is found shrinking most of the time with 5 n of 5 samples, a constant one almost never
    (either way), a growing one is found growing; and one group with a small spread, which decided the test of
    the two extreme n, moves the fit only by its weight."""
    from studies.common import variance_trend

    rng = np.random.default_rng(0)
    ns = [16, 32, 64, 128, 256]

    def draw(power, reps=5):
        return [{"n": n, "samples": reps, "x_std": float(np.std(rng.standard_normal(reps) * n ** (power / 2),
                                                                  ddof=1))} for n in ns]

    fits = {p: [variance_trend(draw(p), "x") for _ in range(300)] for p in (-1.0, 0.0, 1.0)}
    cover = np.mean([f["lo"] <= -1.0 <= f["hi"] for f in fits[-1.0]])
    assert 0.90 <= cover <= 0.99
    assert np.mean([f["verdict"] is True for f in fits[-1.0]]) > 0.5
    assert np.mean([f["verdict"] is not None for f in fits[0.0]]) < 0.1
    assert np.mean([f["verdict"] is False for f in fits[1.0]]) > 0.5
    assert abs(np.mean([f["slope"] for f in fits[0.0]])) < 0.1   # unbiased (the log s^2 bias removed)
    flat = [{"n": n, "samples": 5, "x_std": 1.0} for n in ns]
    assert variance_trend(flat, "x")["verdict"] is None
    assert variance_trend(flat[:-1] + [{**flat[-1], "x_std": 0.35}], "x")["verdict"] is None   # F-test: shrinks
    assert variance_trend(flat[:2], "x")["verdict"] is None and math.isnan(variance_trend(flat[:2], "x")["slope"])


def test_variance_trend_widens_its_interval_where_the_groups_scatter_more_than_gaussian_samples():
    """The quick grid's local constants (5 samples at n = 16 ... 256): standard deviations 0.158, 0.247, 0.046,
    0.126, 0.057 scatter about the fitted line more than Gaussian samples allow (chi^2 = 7.8 on 3 degrees of
    freedom). The Gaussian-model interval [-1.50, -0.06] called the spread shrinking; widened by sqrt(chi^2 / 3) it
    straddles 0. Truth: the weighted fit and chi^2 written out here with numpy (np.polyfit with weights)."""
    from scipy import special

    from studies.common import variance_trend

    ns, sd = [16, 32, 64, 128, 256], [0.158, 0.247, 0.046, 0.126, 0.057]
    stats = [{"n": n, "samples": 5, "x_std": s} for n, s in zip(ns, sd)]
    k = 4.0
    y = np.log(np.square(sd)) - (special.digamma(k / 2) + np.log(2 / k))
    var = special.polygamma(1, k / 2)                         # the variance of log s^2 for Gaussian samples
    (b, a), cov = np.polyfit(np.log(ns), y, 1, w=np.full(5, 1 / math.sqrt(var)), cov="unscaled")
    chi2 = float(np.sum((y - a - b * np.log(ns)) ** 2) / var)
    model_half = 1.959964 * math.sqrt(cov[0, 0])
    assert (b - model_half, b + model_half) == pytest.approx((-1.50, -0.06), abs=0.01)   # shrinking, before
    assert chi2 == pytest.approx(7.8, abs=0.1)
    t = variance_trend(stats, "x")
    assert t["slope"] == pytest.approx(b, rel=1e-12) and t["dispersion"] == pytest.approx(chi2 / 3, rel=1e-9)
    half = model_half * math.sqrt(chi2 / 3)
    assert (t["lo"], t["hi"]) == pytest.approx((b - half, b + half), rel=1e-6)
    assert t["verdict"] is None
    # the figure's line passes through the points' centre (equal weights: plain means of log n and log s^2)
    assert t["centre"] == pytest.approx((np.log(ns).mean(), np.log(np.square(sd)).mean()), rel=1e-12)
    # groups exactly on a line: the model's own interval, not narrowed
    on_line = [{"n": n, "samples": 5, "x_std": float(np.exp(0.5 * (bias - math.log(n))))}
               for n, bias in zip(ns, [special.digamma(2) + math.log(0.5)] * 5)]
    exact = variance_trend(on_line, "x")
    assert exact["dispersion"] == 1.0 and exact["slope"] == pytest.approx(-1.0, abs=1e-12)
    assert exact["hi"] - exact["lo"] == pytest.approx(2 * 1.959964 * math.sqrt(cov[0, 0]), rel=1e-5)


@pytest.mark.parametrize("wrong, study, index", [("sqrt_n_upper", "sqrt_n", 0), ("mean_field_upper", "mean_field", 0),
                                                  ("sqrt_n_upper", "masked", 4)])
def test_upper_bound_claims_fail_for_a_wrong_formula(tmp_path, monkeypatch, wrong, study, index):
    """sqrt_n-1, mean_field-1 and masked-5 compare constants far below their bounds (0.09, e^-238 and 0.07 of
    them), so a bound too large by sqrt 2 passed the comparison (mutation reviews found it); the claims also check
    the bound against the theorem's formula written out in the study."""
    from studies.context import RunContext
    from studies.report import reproduce

    orig = getattr(bounds, wrong)
    if wrong == "sqrt_n_upper":
        monkeypatch.setattr(bounds, wrong, lambda *a, **k: math.sqrt(2) * orig(*a, **k))
    else:
        monkeypatch.setattr(bounds, wrong, lambda *a, log=False, **k: (orig(*a, log=True, **k) + math.log(2)) if log
                            else 2 * orig(*a, **k))
    out = reproduce(RunContext(tmp_path, level="tiny", seed=0, sweep={"backend": "inprocess", "resume": False}),
                    only=[study])
    claim = out["studies"][study]["claims"][index]
    assert claim["verdict"] == "violated", claim


def test_l2_tied_check_fails_for_untied_keys(monkeypatch):
    """l2_attention-2 also checks that the layer is tied L2 attention: keys through W_Q^T (W_K != W_Q, Kim et
    al.'s non-Lipschitz case) stayed far below the bound on the study's inputs (a mutation review); the written-out
    comparison sees them."""
    import meanfield
    from studies.experiments.l2_attention import grid, tied_formula_deviation

    d = grid("quick")["d"]
    assert tied_formula_deviation(d, 0) <= 1e-12

    class Untied:
        def __init__(self, W_Q, W_V):
            self.W_Q, self.W_V = W_Q, W_V

        def sequence(self, X):
            k = self.W_Q.shape[1]
            q, kk = X @ self.W_Q, X @ self.W_Q.T   # keys through W_Q^T (the study's W_Q is square, d x d)
            S = -((q[:, None] - kk[None]) ** 2).sum(-1) / math.sqrt(k)
            return torch.softmax(S, -1) @ X @ (self.W_Q @ self.W_Q.T / math.sqrt(k)) @ self.W_V

    monkeypatch.setattr(meanfield, "L2SelfAttention", Untied)
    assert tied_formula_deviation(d, 0) > 1e-3


@pytest.mark.parametrize("level", ["tiny", "quick"])
def test_the_sqrt_n_exponent_claim_holds_at_the_witness_in_case_max(level):
    """In case "max" the witness's exact constant drifts away from Prop 3.4's curve (slope 0.505 against the curve's
    0.580 on the tiny grid at seed 0: a claim comparing with the curve alone was violated, exit 1; found by an
    independent review): it lies between 1/2 and the curve's slope, and the claim holds, for 20 seeds."""
    from meanfield import bounds
    from studies.common import random_A
    from studies.experiments.sqrt_n import grid

    g = grid(level)
    ns = [n for n in g["ns"] if n >= 4]
    cases = set()
    for seed in range(20):
        A = random_A(g["d"], seed)
        info = bounds.gamma_info(A)
        R = bounds.sqrt_n_regime_radius(info.gamma, 1000.0 * max(g["ns"]))
        pred = [witness_columns(info, R, n)["witness_predicted"] for n in ns]
        curve = [prop34_lower(info.gamma, R, n) for n in ns]
        assert slope_claim(ns, pred, pred, curve, "the witness")[0].agrees, seed
        cases.add(info.case)
    assert cases == {"min", "max"}


def test_range_relative_cluster_count_sees_a_growing_coordinate_cluster():
    """dynamics-3's count: a coordinate that grows like e^(t/2) and collapses onto 2 values counts 2 (an absolute
    tolerance counted every token apart, so "does not cluster" could not fail); one that grows without merging keeps
    every token apart; the count is that of single linkage on the coordinate over its range."""
    t = torch.linspace(0, 10, 6, dtype=torch.float64)
    start = torch.linspace(-1, 1, 12, dtype=torch.float64)
    side = torch.sign(start)
    # onto +-e^(t/2): neighbours of a group 2.2 apart at T, 0.0074 of the range
    merging = (start[None] * torch.exp(-t[:, None] / 4) + side[None]) * torch.exp(t[:, None] / 2)
    spread = start[None] * torch.exp(t[:, None] / 2)
    from meanfield.clustering import count_clusters

    assert [int(c) for c in count_clusters(merging[..., None], 1e-2)][-1] == 12   # absolute: never clusters
    assert range_relative_clusters(merging[..., None], 1e-2)[-1] == 2
    assert range_relative_clusters(spread[..., None], 1e-2) == [12] * 6
    assert range_relative_clusters(spread[..., None], 0.1) == [1] * 6   # neighbours 1/11 of the range apart
    # a collapsed frame (span 0) is one cluster, at any size of its values (1e10 overflowed: a ValueError)
    for value in (1.0, 1e10, 1e300):
        assert range_relative_clusters(torch.full((2, 5, 1), value, dtype=torch.float64), 1e-2) == [1, 1]


def test_the_energy_rate_tells_the_sphere_models_apart(monkeypatch):
    """dynamics-4/-5 (a review: USA computed as SA, or the weights dropped, passed every claim of the study):
    the rate dE/dt at a weighted start must equal sum_i a_i |P G_i|^2 / Z_i (SA) or without Z_i (USA). Truth: the
    identity of Geshkovski et al.'s energy, computed in numpy by _energy_rate; both models pass it, and a USA run
    through SA's field, or a field without the weights, does not."""
    import meanfield
    from studies.common import uniform_sphere
    from studies.experiments import dynamics as dyn

    X = uniform_sphere(16, 3, 4)
    for model in ("SA", "USA"):
        rate, identity = dyn._energy_rate(X, 0, model)
        assert abs(rate / identity - 1) < 1e-3, model
    real = meanfield.IsotropicAttention
    monkeypatch.setattr(meanfield, "IsotropicAttention", lambda beta, model: real(beta, "SA"))
    rate, identity = dyn._energy_rate(X, 0, "USA")
    assert abs(rate / identity - 1) > 0.05
    monkeypatch.setattr(meanfield, "IsotropicAttention", real)
    from particles import Measure

    monkeypatch.setattr("particles.Measure", lambda X, a=None, **k: Measure(X))   # the weights dropped
    rate, identity = dyn._energy_rate(X, 0, "USA")
    assert abs(rate / identity - 1) > 0.05


@pytest.mark.parametrize("mutation", ["N for sqrt(N)", "phi^-1(N-1) as N-1", "3 times the bound for N > 1"])
def test_kim_bound_claim_fails_for_a_wrong_dependence_on_n(tmp_path, monkeypatch, mutation):
    """l2_attention-3 compared constants far below Kim et al.'s bound (Lip / bound 0.23) and -4 checks it at N = 1
    only, where the N factor is 1: each of these wrong bounds left every claim holding (a mutation review). The
    claim now also checks the bound against the formula written out in the study at every N."""
    from studies.context import RunContext
    from studies.report import reproduce

    orig = bounds.l2_attention_upper
    if mutation == "N for sqrt(N)":
        wrong = lambda W_Q, W_V=None, W_O=None, N=None, **k: orig(W_Q, W_V, W_O, N, **k) * math.sqrt(N)
    elif mutation == "phi^-1(N-1) as N-1":
        from meanfield.bounds import l2_attention as l2_bounds

        monkeypatch.setattr(l2_bounds, "lambert_phi_inverse", lambda x: x)   # where l2_attention_upper reads it
        wrong = orig
    else:
        wrong = lambda W_Q, W_V=None, W_O=None, N=None, **k: orig(W_Q, W_V, W_O, N, **k) * (3 if N > 1 else 1)
    monkeypatch.setattr(bounds, "l2_attention_upper", wrong)
    out = reproduce(RunContext(tmp_path, level="tiny", seed=0, sweep={"backend": "inprocess", "resume": False}),
                    only=["l2_attention"])
    claim = out["studies"]["l2_attention"]["claims"][2]
    assert claim["verdict"] == "violated" and "written out in the study" in claim["measured"], claim


@pytest.mark.parametrize("mutation", ["softmax without the log-weights", "mask on the atoms' order"])
def test_definition_26_claim_fails_for_weights_or_positions_ignored(monkeypatch, mutation):
    """The masked claims looked at sequences (equal weights, sorted positions) or compared two computations of one
    map: a softmax without the log-weights, or a causal mask on the order of the atoms instead of their positions,
    changed none of them (a mutation review). masked-7 compares F^m of weighted measures with repeated positions
    in no order with Definition 2.6 written out in numpy."""
    from meanfield.operator import AttentionOperator
    from studies.experiments.masked import definition_26_claim, definition_26_deviation, grid

    d = grid("quick")["d"]
    assert definition_26_claim(definition_26_deviation(d, 0)).agrees
    orig = AttentionOperator.points_map
    if mutation == "softmax without the log-weights":
        wrong = lambda self, X, log_weights=None, positions=None: orig(self, X, None, positions)
    else:
        def wrong(self, X, log_weights=None, positions=None):
            order = None if positions is None else torch.arange(X.shape[-2], dtype=positions.dtype) / X.shape[-2]
            return orig(self, X, log_weights, order)
    monkeypatch.setattr(AttentionOperator, "points_map", wrong)
    assert not definition_26_claim(definition_26_deviation(d, 0)).agrees


def test_a_constant_one_percent_too_large_violates_a_mean_field_theorem_claim(tmp_path, monkeypatch):
    """Every local constant 1% too large turned only mean_field-6, an empirical claim, red (the run exited 0; a
    mutation review): its exact value check is now a theorem claim of its own, mean_field-7, at every length."""
    import dataclasses

    import meanfield
    from studies.context import RunContext
    from studies.report import reproduce

    orig = meanfield.local_lipschitz
    monkeypatch.setattr(meanfield, "local_lipschitz",
                        lambda *a, **k: dataclasses.replace(est := orig(*a, **k), value=1.01 * est.value))
    out = reproduce(RunContext(tmp_path, level="tiny", seed=0, sweep={"backend": "inprocess", "resume": False}),
                    only=["mean_field"])
    claims = out["studies"]["mean_field"]["claims"]
    seven = claims[6]
    assert seven["kind"] == "theorem" and seven["verdict"] == "violated", seven
    assert "closed form" in seven["claim"]


def test_the_integrator_claim_sees_a_first_order_method_and_a_transposed_V(monkeypatch):
    """dynamics-8 (a mutation review: Euler in place of RK4, or V transposed, left every claim of the dynamics study
    holding): simulate against scipy's DOP853 on the field written out in numpy. Truth: the order of RK4 (errors
    divided by 16 per halving of the step) and the formula of the field; both mutations are violations."""
    import meanfield.integrators as integ
    from meanfield.attention import SelfAttention
    from studies.experiments import dynamics_checks as dc

    rows = dc.integrator_rows(0)
    assert dc.integrator_claim(rows).agrees, rows
    assert all(14 < q < 18 for r in rows for q in r["ratios"])
    # the seed whose random A and V gave the largest finest-step error of seeds 0 to 199 (3e-6; a floor of 1e-6
    # called a correct integrator violated there)
    assert dc.integrator_claim(dc.integrator_rows(152)).agrees
    monkeypatch.setitem(integ.FIXED, "rk4", integ.euler_step)
    euler = dc.integrator_rows(0)
    assert not dc.integrator_claim(euler).agrees and all(1.5 < q < 2.5 for r in euler for q in r["ratios"])
    monkeypatch.undo()
    real = SelfAttention._qkv

    def transposed(self, xq, xk, log_weights):
        q, k, v, lw = real(self, xq, xk, log_weights)
        return q, k, xk @ self._V, lw

    monkeypatch.setattr(SelfAttention, "_qkv", transposed)
    wrong = dc.integrator_rows(0)
    claim = dc.integrator_claim(wrong)
    assert not claim.agrees and claim.measured.startswith("1 of 4 cases off"), claim.measured


def test_the_w2_claim_sees_a_squared_w2():
    """dynamics-9: assignment_w2 against a closed form (one cloud a translate of the other by b: W2 = |b|, the
    identity plan), and the claim fails for rows whose W2 is squared (the mean-field claim alone did not)."""
    from studies.experiments import dynamics_checks as dc

    g = torch.Generator().manual_seed(0)
    X = torch.randn(8, 2, generator=g, dtype=torch.float64)
    b = torch.tensor([0.3, -0.4], dtype=torch.float64)
    assert dc.assignment_w2(X, X + b) == pytest.approx(0.5, rel=1e-14)
    # 2 atoms against 4: the 2-atom cloud's atoms each twice, W2^2 the mean of the matched squared distances
    Y = torch.tensor([[0.0, 0.0], [0.0, 1.0], [5.0, 0.0], [5.0, 1.0]], dtype=torch.float64)
    assert dc.assignment_w2(torch.tensor([[0.0, 0.5], [5.0, 0.5]], dtype=torch.float64), Y) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one count must divide the other"):
        dc.assignment_w2(X[:3], X)
    rows = [{"n": 16, "w2_check_0": 0.3, "w2_check_T": 0.2, "w2_0_assignment": 0.3, "w2_T_assignment": 0.2}]
    assert dc.w2_claim(rows).agrees
    rows[0].update(w2_check_0=0.09, w2_check_T=0.04)
    assert not dc.w2_claim(rows).agrees
    assert not dc.w2_claim([{"n": 16, "w2_0": 0.3, "w2_T": 0.2}]).agrees    # nothing checked: fails


def test_kernel_paths_formula_claim_sees_a_transposed_V_that_every_path_shares(monkeypatch):
    """kernel_paths-6 (a mutation review: V transposed in the operator, or a sequence's positions reversed, changed
    no claim of the study, whose paths all share the operator): the dense kernel against attention written out in
    numpy. Truth: the formula, and tests/reference.py's naive attention for written_out itself."""
    from meanfield.attention import SelfAttention
    from studies.experiments import kernel_paths as kp
    from tests.reference import naive_attention

    att, X, lw, pos = kp._inputs("causal sequence", 0)
    ref = naive_attention(X, att.A, att.V, masked=True)
    assert float((torch.from_numpy(kp.written_out("causal sequence", 0)) - ref).abs().max()) < 1e-14
    cases = ("weighted measure", "causal sequence")
    rows = [{"case": c, "seed": 0, **kp.case_task(c, 0)} for c in cases]
    assert kp.formula_claim(rows).agrees
    real = SelfAttention._qkv

    def transposed(self, xq, xk, log_weights):
        q, k, v, lw = real(self, xq, xk, log_weights)
        return q, k, xk @ self._V, lw

    monkeypatch.setattr(SelfAttention, "_qkv", transposed)
    wrong = [{"case": c, "seed": 0, **kp.case_task(c, 0)} for c in cases]
    claim = kp.formula_claim(wrong)
    assert not claim.agrees and claim.short_measured.startswith("2 of 2 cases off")
    assert kp.forward_claim(wrong, "fused").agrees        # the paths still agree with each other


def test_the_other_eigen_case_witness_claim_catches_an_error_of_that_case_alone(tmp_path, monkeypatch):
    """sqrt_n-6 (a review of the study pages: the page promised both eigen-cases of Proposition 3.4, the study took
    one matrix): the witness of the matrix of the other case must equal its closed form. A closed-form factor off by
    1.001 in that case alone leaves sqrt_n-3 holding and fails sqrt_n-6."""
    from meanfield import adversarial, bounds
    from studies.common import random_A
    from studies.context import RunContext
    from studies.report import reproduce

    other = "max" if bounds.gamma_info(random_A(3, 0)).case == "min" else "min"   # the tiny level's d = 3
    real = adversarial.sqrt_n_witness_factor

    def wrong(A, R, n):
        return real(A, R, n) * (1.001 if bounds.gamma_info(A).case == other else 1.0)

    ctx = lambda sub: RunContext(tmp_path / sub, level="tiny", seed=0, sweep={"backend": "inprocess",   # noqa: E731
                                                                              "resume": False})
    ok = reproduce(ctx("ok"), only=["sqrt_n"])["studies"]["sqrt_n"]["claims"]
    assert len(ok) == 6 and all(c["verdict"] == "holds" for c in ok), [c["measured"] for c in ok]
    assert f"case {other}" in ok[5]["short"]
    monkeypatch.setattr(adversarial, "sqrt_n_witness_factor", wrong)
    bad = reproduce(ctx("bad"), only=["sqrt_n"])["studies"]["sqrt_n"]["claims"]
    assert bad[2]["verdict"] == "holds" and bad[5]["verdict"] == "violated", (bad[2]["measured"], bad[5]["measured"])


def test_uniform_growth_rate_against_closed_forms():
    """lambda_1 of docs/math.md section 6.6 by quadrature, against forms derived apart: d = 3 (t uniform on [-1, 1]),
    d = 2 (the modified Bessel functions: E[e^(beta cos) sin^2] = I_1(beta) / beta, E[e^(beta cos)] = I_0(beta)) and
    the limit (d - 1) / d at beta = 0."""
    from scipy.special import iv

    from meanfield.isotropic import uniform_growth_rate

    for b in (0.3, 1.0, 3.0, 20.0):
        assert uniform_growth_rate(b, "SA") == pytest.approx(2 * (b / math.tanh(b) - 1) / b**2, rel=1e-10)
        assert uniform_growth_rate(b, "USA") == pytest.approx(2 * (b * math.cosh(b) - math.sinh(b)) / b**3, rel=1e-10)
        assert uniform_growth_rate(b, "SA", d=2) == pytest.approx(iv(1, b) / (b * iv(0, b)), rel=1e-10)
        assert uniform_growth_rate(b, "USA", d=2) == pytest.approx(iv(1, b) / b, rel=1e-10)
    for d in (2, 3, 5, 10):
        for model in ("SA", "USA"):
            assert uniform_growth_rate(0.0, model, d=d) == pytest.approx((d - 1) / d, rel=1e-12)
    # large beta, where one quadrature over [0, pi] missed the narrow peak (a review: -46% at 1e6, silently)
    from scipy.special import ive

    for b in (1e4, 1e5, 1e6, 1e8):
        assert uniform_growth_rate(b, "SA") == pytest.approx(2 * (b / math.tanh(b) - 1) / b**2, rel=1e-10)
        assert uniform_growth_rate(b, "SA", d=2) == pytest.approx(ive(1, b) / (b * ive(0, b)), rel=1e-10)
    with pytest.raises(ValueError, match="normalization"):
        uniform_growth_rate(1.0, "softmax")
    with pytest.raises(ValueError, match="d: expected an integer >= 2"):
        uniform_growth_rate(1.0, d=1)


def test_the_linear_instability_claim_holds_and_fails_for_the_other_normalization(monkeypatch):
    """dynamics-11: SA's tokens run with USA's field (and the reverse) leave the uniform state at the other model's
    rate, 15-18% away: the claim fails. The study's own runs at the tiny grid hold it."""
    import meanfield
    from studies.experiments import sphere_instability as si

    rows = si.rate_rows(300, 3, seed=0)
    assert si.rate_claim(rows).agrees
    real = meanfield.IsotropicAttention
    monkeypatch.setattr(meanfield, "IsotropicAttention",
                        lambda beta, model="SA", masked=False: real(beta, "USA" if model == "SA" else "SA", masked))
    swapped = si.rate_rows(300, 3, seed=0)
    assert not si.rate_claim(swapped).agrees
    sa = [r for r in swapped if r["model"] == "SA"]   # run with USA's field, against SA's lambda_1
    assert np.mean([r["rate"] for r in sa]) / sa[0]["predicted"] - 1 > 0.1
