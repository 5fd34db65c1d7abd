"""Real BERT / GPT-2 attention layers (meanfield.hf and studies.models), checked against the model itself and
against an independent re-implementation written here from the raw weights (tests/reference.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from meanfield import hf as mhf
from studies import models as hf
from tests.reference import naive_attention

CASES = [("gpt2", False), ("bert", False), ("bert", True)]  # (kind, is_decoder)
N = 9


pytestmark = pytest.mark.usefixtures("one_thread")  # small problems: threads only contend


@pytest.fixture(scope="module")
def models(one_thread):
    return {(k, dec): hf.random_model(k, size="tiny", is_decoder=dec, seed=3) for k, dec in CASES}


def _ids(model, n=N):
    return hf.encode(hf.HashTokenizer(model.config.vocab_size), hf.default_corpus(), n)


def _raw_heads(model, layer):
    """Q_h, K_h, V_h, biases, W_O, output bias read straight from the module weights (no library code)."""
    if model.config.model_type == "gpt2":
        attn = model.h[layer].attn
        d, H = model.config.n_embd, model.config.n_head
        W, b = attn.c_attn.weight, attn.c_attn.bias          # Conv1D: y = x W + b, W (d, 3d)
        Wq, Wk, Wv = W[:, :d].T, W[:, d:2 * d].T, W[:, 2 * d:].T
        bq, bk, bv = b[:d], b[d:2 * d], b[2 * d:]
        W_O, b_O = attn.c_proj.weight.T, attn.c_proj.bias
    else:
        sa = model.encoder.layer[layer].attention.self
        d, H = model.config.hidden_size, model.config.num_attention_heads
        Wq, Wk, Wv = sa.query.weight, sa.key.weight, sa.value.weight
        bq, bk, bv = sa.query.bias, sa.key.bias, sa.value.bias
        dense = model.encoder.layer[layer].attention.output.dense
        W_O, b_O = dense.weight, dense.bias
    k = d // H
    sl = [slice(h * k, (h + 1) * k) for h in range(H)]
    heads = [(Wq[s].detach(), Wk[s].detach(), Wv[s].detach(), bq[s].detach(), bk[s].detach(), bv[s].detach())
             for s in sl]
    return heads, W_O.detach(), b_O.detach(), k


def dense_lipschitz(f, X):
    """Top singular value of the dense Jacobian (tests/reference.py's definition, vectorized autograd)."""
    J = torch.autograd.functional.jacobian(f, X, vectorize=True).reshape(-1, X.numel())
    return float(torch.linalg.matrix_norm(J, ord=2))


def reimplementation(model, layer, masked):
    """The layer rewritten from docs/math.md section 1 with tests/reference.py naive_attention per head:
    <Q x_i + b_Q, K x_j + b_K>/sqrt(k) = <A x_i, x_j> + <c, x_j> + (terms constant in j),
    A = K^T Q / sqrt(k), c = K^T b_Q / sqrt(k); values V x_j + b_V; then W_O and the output bias."""
    heads, W_O, b_O, k = _raw_heads(model, layer)

    def f(X):
        outs = []
        for Q, K, V, bq, _bk, bv in heads:
            A = K.T @ Q / k ** 0.5
            outs.append(naive_attention(X, A, V, masked=masked, b_Q=K.T @ bq / k ** 0.5) + bv)
        return torch.cat(outs, -1) @ W_O.T + b_O
    return f


@pytest.mark.parametrize("kind,dec", CASES)
def test_wrapped_layer_is_what_the_model_computes(models, kind, dec):
    """Hooks capture the real attention input; the wrapped function with the explicit mask gives
    the module's own output inside the full forward pass, and the explicit mask equals the one
    the model passes to the module (None for a BERT encoder)."""
    model = models[(kind, dec)]
    outs, handles = {}, []
    for i in range(mhf.num_layers(model)):
        core = mhf._attention_core(model, i)
        handles.append(core.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0][0].detach())))
    try:
        xs, masks = mhf.capture_attention_inputs(model, _ids(model), with_mask=True)
    finally:
        for h in handles:
            h.remove()
    for i, X in xs.items():
        ref = outs[i] if kind == "gpt2" else model.encoder.layer[i].attention.output.dense(outs[i])
        torch.testing.assert_close(mhf.attention_function(model, i)(X), ref, rtol=0, atol=1e-12)
        if mhf.is_causal(model):
            assert torch.equal(masks[i], mhf.causal_mask(N))
        else:
            assert masks[i] is None
    # GPT-2's attention input is ln_1 of the residual stream (independent path: hidden_states)
    if kind == "gpt2":
        with torch.no_grad():
            hs = model(input_ids=_ids(model), output_hidden_states=True).hidden_states
        torch.testing.assert_close(xs[1], model.h[1].ln_1(hs[1])[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind,dec", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_independent_reimplementation_and_local_constant(models, kind, dec, masked):
    """Output and local Lipschitz constant of the wrapped HF layer (masked and unmasked) against
    the independent re-implementation: outputs to 1e-10, and the library's Lanczos estimate through
    the HF module against the re-implementation's dense-Jacobian top singular value to 1e-6 relative."""
    model = models[(kind, dec)]
    X = mhf.capture_attention_inputs(model, _ids(model, 7), [1])[1]
    f_hf = mhf.attention_function(model, 1, masked=masked)
    f_ref = reimplementation(model, 1, masked)
    torch.testing.assert_close(f_hf(X), f_ref(X), rtol=0, atol=1e-10)
    truth = dense_lipschitz(f_ref, X)
    from meanfield import local_lipschitz

    est = local_lipschitz(f_hf, X, method="lanczos", tol=1e-8)
    assert est.value == pytest.approx(truth, rel=1e-6)


@pytest.mark.parametrize("kind,dec", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_parameter_round_trip_through_meanfield(models, kind, dec, masked):
    """extract_layer -> meanfield.MultiHeadAttention rebuilds the module's output to 1e-6 (float64),
    on real-text inputs and on random inputs of radius 10."""
    model = models[(kind, dec)]
    X = mhf.capture_attention_inputs(model, _ids(model), [0])[0]
    g = torch.Generator().manual_seed(0)
    Y = torch.randn(2, N, X.shape[-1], generator=g, dtype=torch.float64)
    Y = 10 * Y / Y.norm(dim=-1, keepdim=True)
    p = mhf.extract_layer(model, 0)
    mha = p.to_meanfield(masked=masked)
    f = mhf.attention_function(model, 0, masked=masked)
    for Z in (X, Y[0], Y[1]):
        torch.testing.assert_close(mha.sequence(Z), f(Z), rtol=0, atol=1e-6)
    assert p.masked == mhf.is_causal(model)
    heads, W_O, _, k = _raw_heads(model, 0)
    Q, K = heads[2][0], heads[2][1]
    torch.testing.assert_close(p.A(2), K.T @ Q / k ** 0.5, rtol=0, atol=1e-14)
    torch.testing.assert_close(p.W_O_block(2), W_O[:, 2 * k:3 * k], rtol=0, atol=0)


@pytest.mark.parametrize("kind,dec", CASES)
def test_causal_mask_really_applied(models, kind, dec):
    """Perturbing the last token leaves earlier outputs unchanged exactly when the mask is causal;
    an unmasked layer (BERT encoder, or GPT-2 with masked=False) does change them."""
    model = models[(kind, dec)]
    X = mhf.capture_attention_inputs(model, _ids(model), [0])[0]
    Xp = X.clone()
    Xp[-1] += 0.5
    for masked in (False, True):
        f = mhf.attention_function(model, 0, masked=masked)
        diff = (f(X)[:-1] - f(Xp)[:-1]).abs().max()
        assert (diff == 0) if masked else (diff > 1e-6)
    assert mhf.attention_function(model, 0).masked == (kind == "gpt2" or dec)


def test_batched_input_matches_loop(models):
    model = models[("gpt2", False)]
    f = mhf.attention_function(model, 0)
    X = torch.randn(3, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(f(X), torch.stack([f(x) for x in X]), rtol=0, atol=1e-13)


def test_hash_tokenizer_is_deterministic():
    tok = hf.HashTokenizer(1000)
    text = "Heaps are arrays, for which a[k] <= a[2*k+1]."
    ids = tok.encode(text)
    words = ["heaps", "are", "arrays", ",", "for", "which", "a", "[", "k", "]", "<", "=", "a", "[", "2", "*", "k",
             "+", "1", "]", "."]
    expect = [1 + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") % 999 for w in words]
    assert ids == expect and tok.encode(text) == ids
    assert all(1 <= i < 1000 for i in ids)
    code = ("from studies.models import HashTokenizer; "
            f"print(HashTokenizer(1000).encode({text!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == str(ids)  # another process, another str-hash seed: same ids
    assert tok("a b", return_tensors="pt")["input_ids"].shape == (1, 2)
    with pytest.raises(ValueError, match="vocab_size"):
        hf.HashTokenizer(1)
    with pytest.raises(ValueError, match="n: the text has 2 tokens"):
        hf.encode(tok, "two words", 3)


def test_default_corpus_is_fixed_english_prose():
    text = hf.default_corpus()
    assert text == hf.default_corpus()
    words = text.lower().split()
    assert len(words) > 1500
    common = sum(w in {"the", "of", "and", "to", "a", "is", "in", "that", "it", "be"} for w in words)
    assert common / len(words) > 0.15  # English prose: about a quarter of words are these
    # first paragraph of the first source, as Python ships it
    import heapq
    first = " ".join(heapq.__about__.split("\n\n")[2].split())
    assert text.startswith(first)
    assert "The strange invariant above is meant to be an efficient memory representation for a tournament." in text
    assert ">>>" not in text
    assert hf.read_text() == text
    assert hf.read_text("hello world") == "hello world"
    with pytest.raises(ValueError, match="text: is empty"):
        hf.read_text("  ")
    with pytest.raises(ValueError, match="path"):
        hf.read_text(path="/nonexistent/file.txt")


def test_offline_hub_name_fails_fast_and_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    with pytest.raises(hf.ModelNotAvailableError, match="'gpt2' is not in the local Hugging Face cache"):
        hf.load_model("gpt2")
    with pytest.raises(hf.ModelNotAvailableError, match="no checkpoint directory"):
        hf.load_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(hf.ModelNotAvailableError, match="has no config.json"):
        hf.load_model(tmp_path / "empty")


def test_local_checkpoint_round_trip(models, tmp_path):
    """save_pretrained (safetensors) -> load_model: same weights, eager attention, float64, eval."""
    model = models[("gpt2", False)]
    model.save_pretrained(tmp_path / "ckpt")
    loaded = hf.load_model(tmp_path / "ckpt")
    assert loaded.config._attn_implementation == "eager" and not loaded.training
    X = mhf.capture_attention_inputs(model, _ids(model), [1])[1]
    torch.testing.assert_close(mhf.attention_function(loaded, 1)(X), mhf.attention_function(model, 1)(X),
                               rtol=0, atol=0)
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises(hf.ModelNotAvailableError, match="no weights"):
        hf.load_model(tmp_path / "ckpt")


def test_bad_arguments(models):
    model = models[("bert", False)]
    with pytest.raises(ValueError, match="layer"):
        mhf.attention_function(model, 5)
    with pytest.raises(ValueError, match="kind"):
        hf.random_model("llama", size="tiny")
    with pytest.raises(ValueError, match="is_decoder"):
        hf.random_model("gpt2", size="tiny", is_decoder=True)
    with pytest.raises(ValueError, match="input_ids"):
        mhf.capture_attention_inputs(model, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="model"):
        mhf.model_kind(torch.nn.Linear(2, 2))
