"""The real_models study end to end on tiny random GPT-2 / BERT, its numbers recomputed from
independent truths: dense Jacobians of the layer re-implemented from raw weights (naive attention
of tests/reference.py), full eigen-decompositions for gamma, the bounds of meanfield.bounds on the
explicitly augmented matrices, numpy least-squares fits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from meanfield import hf as mhf
from studies import models as hf
from studies.context import RunContext
from studies.experiments import real_models as rm
from studies.io import read_csv
from tests.reference import naive_attention
from tests.studies.test_hf_models import dense_lipschitz, reimplementation

pytestmark = pytest.mark.usefixtures("one_thread")  # small problems: threads only contend


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("real_models")
    res = rm.real_models(out, RunContext(out.parent, level="tiny", seed=0, progress=False))
    models = {k: hf.random_model(k, size="tiny", seed=0) for k in ("gpt2", "bert")}
    return out, res, models


def _chunk(model, n, rep=0):
    ids = hf.encode(hf.HashTokenizer(model.config.vocab_size), hf.default_corpus())[0]
    return ids[rep * n:(rep + 1) * n][None]


def test_claims_figures_and_provenance(run):
    out, res, _ = run
    assert [c.agrees for c in res.claims] == [True] * 4, [(c.claim, c.measured) for c in res.claims]
    # the real-text exponent is the paper's observation; the rest are theorems
    assert [c.kind for c in res.claims] == ["theorem", "theorem", "empirical", "theorem"]
    assert all(c.fails_if for c in res.claims)
    for fig in res.figures:
        assert (out / fig).stat().st_size > 10_000
    info = json.loads((out / "models.json").read_text())
    assert [m["model"] for m in info["models"]] == ["gpt2", "bert"]
    assert all(m["provenance"].startswith("random init") for m in info["models"])
    assert "random init" in res.notes and "HashTokenizer" in res.notes


def test_lipschitz_rows_against_dense_jacobian_of_reimplementation(run):
    out, _, models = run
    rows = read_csv(out / "lipschitz.csv")
    assert {(r["model"], r["masked"], r["model_mask"]) for r in rows} == {
        ("gpt2", True, True), ("gpt2", False, False), ("bert", False, True), ("bert", True, False)}
    for r in rows:
        assert r["lip"] - r["lip_error"] <= r["upper"]
        if r["n"] != 8:
            continue
        model = models[r["model"]]
        X = mhf.capture_attention_inputs(model, _chunk(model, r["n"], r["rep"]), [r["layer"]])[r["layer"]]
        truth = dense_lipschitz(reimplementation(model, r["layer"], r["masked"]), X)
        assert abs(r["lip"] - truth) <= r["lip_error"] + 1e-9 * truth
        assert r["lip"] <= truth * (1 + 1e-9)  # a Rayleigh quotient never exceeds the top singular value
        assert r["r_mean"] == pytest.approx(float(X.norm(dim=1).mean()), rel=1e-12)


def test_upper_bound_against_meanfield_bounds_on_augmented_heads(run):
    from meanfield import bounds

    out, _, models = run
    rows = [r for r in read_csv(out / "lipschitz.csv") if r["n"] == 16 and r["rep"] == 0]
    for r in rows[:4]:
        p = mhf.extract_layer(models[r["model"]], r["layer"])
        d = p.Q.shape[-1]
        heads = []
        for h in range(p.num_heads):
            A = torch.zeros(d + 1, d + 1, dtype=torch.float64)   # <A' x'_i, x'_j> with x' = (x, 1)
            A[:d, :d] = p.A(h)
            A[:d, d] = p.scale * p.K[h].T @ p.b_Q[h]
            V = torch.cat([p.V[h], p.b_V[h][:, None]], 1)
            heads.append(bounds.sqrt_n_upper(A, V, math.sqrt(r["r_max"] ** 2 + 1), r["n"]))
        assert r["upper"] == pytest.approx(bounds.multihead_upper(heads, p.W_O), rel=1e-9)


def test_gamma_rows_against_full_eigendecomposition(run):
    from meanfield import bounds

    out, _, models = run
    rows = read_csv(out / "gamma.csv")
    assert len(rows) == 2 * 2 * 4  # models x layers x heads
    for r in rows:
        A = mhf.extract_layer(models[r["model"]], r["layer"]).A(r["head"])
        info = bounds.gamma_info(A)
        assert r["gamma"] == pytest.approx(info.gamma, rel=1e-8, abs=1e-14)
        if info.gamma > 1e-12:  # no real nonzero eigenvalue: gamma = 0 up to rounding, either case
            assert r["case"] == info.case
        assert r["gamma_R2"] == pytest.approx(r["gamma"] * r["R_mean"] ** 2, rel=1e-12)


def test_adversarial_rows_against_witness_and_dense_jacobian(run):
    from meanfield import adversarial, bounds

    out, _, models = run
    rows = read_csv(out / "adversarial.csv")
    assert {r["radius"] for r in rows} == {"real", "scaled"}  # tiny random heads: gamma R^2 small at real radius
    for r in rows:
        n, R = r["n"], r["R"]
        assert r["lower"] == pytest.approx(math.sqrt(n - 1) / (1 + (n - 1) * math.exp(-2 * r["gamma"] * R * R)),
                                           rel=1e-12)
        assert r["lip_head"] + r["lip_head_error"] >= r["lower"] * (1 - 1e-9)  # Proposition 3.4
        assert r["lip_layer"] - r["lip_layer_error"] <= r["layer_upper"]
        if n not in (4, 16):
            continue
        model = models[r["model"]]
        p = mhf.extract_layer(model, r["layer"])
        A = p.A(r["head"])
        info = bounds.gamma_info_factored(p.Q[r["head"]], p.K[r["head"]], p.scale)
        X = adversarial.sqrt_n_sequence_from_info(info, R, n)
        Xref = adversarial.sqrt_n_sequence(A, R, n)  # the library's witness, from a full eigen-decomposition
        sign = 1.0 if float((X * Xref).sum()) > 0 else -1.0
        torch.testing.assert_close(X, sign * Xref, rtol=0, atol=1e-8 * R)
        I = torch.eye(A.shape[0], dtype=torch.float64)
        truth = dense_lipschitz(lambda Z, A=A, I=I: naive_attention(Z, A, I), Xref)
        assert r["lip_head"] == pytest.approx(truth, rel=1e-6)
        truth = dense_lipschitz(reimplementation(model, r["layer"], mhf.is_causal(model)), X)
        assert r["lip_layer"] == pytest.approx(truth, rel=1e-6)


def test_fits_and_radius_tables(run):
    out, _, models = run
    rows = read_csv(out / "lipschitz.csv")
    for f in read_csv(out / "fits.csv"):
        sel = [r for r in rows if r["model"] == f["model"] and r["layer"] == f["layer"] and r["masked"] == f["masked"]]
        slope = np.polyfit(np.log([r["n"] for r in sel]), np.log([r["lip"] for r in sel]), 1)[0]
        assert f["slope"] == pytest.approx(slope, rel=1e-9, abs=1e-12)
        assert f["lo"] <= f["slope"] <= f["hi"]
    rad = read_csv(out / "radius.csv")
    for name, model in models.items():
        n = max(r["position"] for r in rad if r["model"] == name) + 1
        X = mhf.capture_attention_inputs(model, _chunk(model, n), [1])[1]
        got = [r["radius"] for r in sorted((r for r in rad if r["model"] == name and r["layer"] == 1),
                                           key=lambda r: r["position"])]
        np.testing.assert_allclose(got, X.norm(dim=1).numpy(), rtol=1e-12)


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


def test_local_checkpoint_with_its_own_tokenizer(tmp_path):
    """A checkpoint named in the run context (--checkpoint, $SMOOTH_ATTENTION_CHECKPOINTS) joins the
    study with its own tokenizer (here a word-level tokenizer saved with transformers), labelled as
    pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ck = tmp_path / "my-gpt2"
    hf.random_model("gpt2", size="tiny", seed=5).save_pretrained(ck)
    words = sorted(set(hf.default_corpus().lower().split()))[:500]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(ck)
    ctx = RunContext(tmp_path, level="tiny", checkpoints=[str(ck)])
    label, model, tok, provenance = list(rm._models(rm.grid("tiny"), ctx))[-1]
    assert label == "gpt2:my-gpt2" and provenance.startswith("pretrained") and not isinstance(tok, hf.HashTokenizer)
    text = hf.default_corpus()
    res = rm.analyze_model(label, model, tok, text, layers=[1], ns=[4, 8, 16], reps=1, adv_ns=[4])
    r = next(r for r in res["lipschitz"] if r["n"] == 8 and r["model_mask"])
    ids = torch.tensor([tok(text)["input_ids"][:8]])
    X = mhf.capture_attention_inputs(model, ids, [1])[1]
    truth = dense_lipschitz(reimplementation(model, 1, True), X)
    assert abs(r["lip"] - truth) <= r["lip_error"] + 1e-9 * truth
