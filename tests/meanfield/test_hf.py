"""The Hugging Face adapter (meanfield.hf) on tiny random GPT-2 / BERT: captured inputs, the wrapped
layers (attention alone and the whole block), masks and parameters, checked against the model's own
forward pass and against an independent re-implementation written here from the raw module weights
(per head with tests/reference.py's naive_attention; dense-Jacobian top singular values)."""

from __future__ import annotations

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


def block_reimplementation(model, layer, masked):
    """The whole attention block from raw weights: BERT LayerNorm(X + attention(X)) with the block's
    LayerNorm written out (mean, biased variance, eps, affine); GPT-2 X + attention(ln_1(X))."""
    f = reimplementation(model, layer, masked)
    if model.config.model_type == "gpt2":
        ln = model.h[layer].ln_1
    else:
        ln = model.encoder.layer[layer].attention.output.LayerNorm
    w, b, eps = ln.weight.detach(), ln.bias.detach(), ln.eps

    def norm(Z):
        mu = Z.mean(-1, keepdim=True)
        var = ((Z - mu) ** 2).mean(-1, keepdim=True)
        return (Z - mu) / torch.sqrt(var + eps) * w + b

    if model.config.model_type == "gpt2":
        return lambda X: X + f(norm(X))
    return lambda X: norm(X + f(X))


@pytest.mark.parametrize("kind,dec", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_block_map_against_reimplementation(models, kind, dec, masked):
    """HFAttention(block=True): output and certified constant against the block written from raw weights
    (dense-Jacobian top singular value), on real-text inputs."""
    from meanfield import local_lipschitz

    model = models[(kind, dec)]
    X = mhf.capture_attention_inputs(model, _ids(model, 7), [1], block=True)[1]
    op = mhf.HFAttention.from_model(model, 1, masked=masked, block=True)
    ref = block_reimplementation(model, 1, masked)
    torch.testing.assert_close(op.sequence(X), ref(X), rtol=0, atol=1e-10)
    est = local_lipschitz(op, X, method="lanczos", tol=1e-8)
    assert est.value == pytest.approx(dense_lipschitz(ref, X), rel=1e-6)


@pytest.mark.parametrize("kind,dec", CASES)
def test_block_inputs_are_what_the_block_maps(models, kind, dec):
    """capture_attention_inputs(block=True) records what the whole attention block receives: the block map at
    it is the model's own hidden state after the block (GPT-2: what ln_2 receives; BERT: what the feed-forward
    part receives), the truth read by hooks written here. For GPT-2 that input is the residual stream, whose
    ln_1 is the attention's input (fed to the block map instead, ln_1 would be applied twice)."""
    model = models[(kind, dec)]
    after, handles = {}, []
    for i in range(mhf.num_layers(model)):
        nxt = model.h[i].ln_2 if kind == "gpt2" else model.encoder.layer[i].intermediate
        handles.append(nxt.register_forward_pre_hook(lambda m, a, i=i: after.__setitem__(i, a[0][0].detach())))
    try:
        xs, masks = mhf.capture_attention_inputs(model, _ids(model), block=True, with_mask=True)
    finally:
        for h in handles:
            h.remove()
    inner = mhf.capture_attention_inputs(model, _ids(model))
    assert sorted(xs) == sorted(after) == list(range(mhf.num_layers(model)))
    for i, X in xs.items():
        torch.testing.assert_close(mhf.attention_function(model, i, block=True)(X), after[i], rtol=0, atol=1e-12)
        if kind == "gpt2":
            torch.testing.assert_close(model.h[i].ln_1(X).detach(), inner[i], rtol=0, atol=1e-12)
            assert (X - inner[i]).abs().max() > 0.1
            assert torch.equal(masks[i], mhf.causal_mask(N))
        else:
            assert torch.equal(X, inner[i])


@pytest.mark.parametrize("kind,dec", CASES)
def test_layer_inputs_are_both_captures_in_one_forward_pass(models, kind, dec):
    """capture_layer_inputs returns what capture_attention_inputs returns without and with block=True (the truth:
    those two calls), running the model once, where real_models ran GPT-2 twice per sequence."""
    model = models[(kind, dec)]
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        xs, blocks = mhf.capture_layer_inputs(model, _ids(model), [1])
    finally:
        handle.remove()
    assert len(calls) == 1
    inner = mhf.capture_attention_inputs(model, _ids(model), [1])
    outer = mhf.capture_attention_inputs(model, _ids(model), [1], block=True)
    assert list(xs) == list(blocks) == [1]
    for i in (1,):
        assert torch.equal(xs[i], inner[i]) and torch.equal(blocks[i], outer[i])
        assert torch.equal(xs[i], blocks[i]) == (kind == "bert")


def test_gpt2_with_float32_scores_runs_in_float64(one_thread):
    """reorder_and_upcast_attn=True computes the scores in float32, and transformers raises a dtype error on that
    path in float64. The hooks and the operator run it with float64 scores: the same map as the layer without
    the flag (the truth: transformers' standard path, and the re-implementation from raw weights), the flags
    restored afterwards; in float32 the module's own path is kept, and its constant is certified."""
    from meanfield import local_lipschitz

    up = hf.random_model("gpt2", size="tiny", seed=3, reorder_and_upcast_attn=True)
    plain = hf.random_model("gpt2", size="tiny", seed=3)
    ids = _ids(up)
    with pytest.raises(RuntimeError, match="upcasting"):   # the premise: transformers' own float64 forward
        up(input_ids=ids)
    X = mhf.capture_attention_inputs(up, ids, [1])[1]
    torch.testing.assert_close(X, mhf.capture_attention_inputs(plain, ids, [1])[1], rtol=0, atol=0)
    for block in (False, True):
        torch.testing.assert_close(mhf.attention_function(up, 1, block=block)(X),
                                   mhf.attention_function(plain, 1, block=block)(X), rtol=0, atol=0)
    torch.testing.assert_close(mhf.attention_function(up, 1)(X), reimplementation(up, 1, True)(X), rtol=0, atol=1e-12)
    assert all(blk.attn.reorder_and_upcast_attn for blk in up.h)
    up32 = hf.random_model("gpt2", size="tiny", seed=3, reorder_and_upcast_attn=True, dtype=torch.float32)
    X32 = X.float()
    with torch.no_grad():
        own = up32.h[1].attn(X32[None], attention_mask=mhf.causal_mask(N, torch.float32))[0][0]
    torch.testing.assert_close(mhf.attention_function(up32, 1)(X32), own, rtol=0, atol=0)
    est = local_lipschitz(mhf.HFAttention.from_model(up32, 1), X32)   # certified with the float64 twin
    assert est.converged and est.value == pytest.approx(dense_lipschitz(reimplementation(up, 1, True), X),
                                                        rel=1e-3)


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


def test_bad_arguments(models):
    model = models[("bert", False)]
    with pytest.raises(ValueError, match="layer"):
        mhf.attention_function(model, 5)
    with pytest.raises(ValueError, match="input_ids"):
        mhf.capture_attention_inputs(model, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="model"):
        mhf.model_kind(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("which, match", [
    ("gpt2 model", r"a whole GPT2Model is a model .*HFAttention.from_model\(model, layer\)"),
    ("bert model", r"a whole BertModel is a model"),
    ("gpt2 block", r"a GPT-2 block \(GPT2Block\).*as_operator\(block.attn\).*block=True"),
    ("bert layer", r"a BERT layer \(BertLayer\).*as_operator\(layer.attention\)"),
    ("gpt2 stack", r"ModuleList is a stack of 2 layers"),
    ("bert encoder", r"BertEncoder is a stack of 2 layers"),
])
def test_models_and_blocks_are_refused_with_what_to_pass_instead(models, which, match):
    from meanfield import as_operator, local_lipschitz

    gpt2, bert = models[("gpt2", False)], models[("bert", False)]
    module = {"gpt2 model": gpt2, "bert model": bert, "gpt2 block": gpt2.h[0], "bert layer": bert.encoder.layer[0],
              "gpt2 stack": gpt2.h, "bert encoder": bert.encoder}[which]
    with pytest.raises(TypeError, match="^f: " + match):
        as_operator(module)
    with pytest.raises(TypeError, match=match):
        local_lipschitz(module, torch.randn(4, 32, dtype=torch.float64))
    # what the message says to pass works: the layer's attention as the model computes it
    layer = gpt2.h[0].attn if which == "gpt2 block" else bert.encoder.layer[0].attention
    assert as_operator(layer).d_in == 32


def test_multihead_attention_with_other_key_dimensions_is_refused():
    from meanfield import as_operator

    cross = torch.nn.MultiheadAttention(8, 2, kdim=4, vdim=4, batch_first=True).double().eval()
    with pytest.raises(ValueError, match="module: kdim = 4, vdim = 4 differ from embed_dim = 8"):
        as_operator(cross)
    same = torch.nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    X = torch.randn(5, 8, dtype=torch.float64)
    assert torch.allclose(as_operator(same).sequence(X), same(X[None], X[None], X[None])[0][0], atol=1e-12)


def test_capture_checks_the_token_ids(models):
    model = models[("gpt2", False)]   # vocabulary 512, 128 positions
    with pytest.raises(ValueError, match=r"input_ids: ids must lie in \[0, 512\).*\[1, 9999\]"):
        mhf.capture_attention_inputs(model, torch.tensor([[1, 2, 9999]]))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 512\).*\[-1, 2\]"):
        mhf.capture_attention_inputs(model, torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="input_ids: 200 tokens; the model takes 1 to 128"):
        mhf.capture_attention_inputs(model, torch.zeros(1, 200, dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids: expected integer token ids.*float32"):
        mhf.capture_attention_inputs(model, torch.zeros(1, 3))
    with pytest.raises(TypeError, match="input_ids: expected integer token ids.*bool"):
        mhf.capture_attention_inputs(model, torch.zeros(1, 3, dtype=torch.bool))
    ids = torch.tensor([[0, 511, 5]])   # the extremes of the vocabulary are valid
    X = mhf.capture_attention_inputs(model, ids, [0])[0]
    emb = model.wte(ids[0]) + model.wpe(torch.arange(3))
    assert torch.allclose(X, model.h[0].ln_1(emb), atol=1e-12)


# ---------------------------------------------------------------- review: blind queries, live weights, own mask
@pytest.mark.parametrize("kind,dec", CASES)
def test_a_query_that_sees_no_key_gives_zero_heads(models, kind, dec):
    """A query before every key, or whose only visible key has weight 0, sees nothing: its heads give zero
    (docs/math.md section 2), so the layer returns its output bias, read from the raw weights; the finite mask
    of the module alone made it the average of every key, later ones included."""
    from particles import Measure

    model = models[(kind, dec)]
    _, _, b_O, _ = _raw_heads(model, 0)
    op = mhf.HFAttention.from_model(model, 0, masked=True)
    g = torch.Generator().manual_seed(4)
    Y = torch.randn(3, 32, generator=g, dtype=torch.float64)
    x = torch.randn(2, 32, generator=g, dtype=torch.float64)
    mu = Measure(Y, [0.0, 0.5, 0.5], positions=[0.2, 0.5, 1.0])
    far = Measure(torch.cat([Y[:2], 10 * Y[2:]]), [0.0, 0.5, 0.5], positions=[0.2, 0.5, 1.0])
    s = torch.tensor([0.1, 0.3], dtype=torch.float64)
    for m in (mu, far):   # the key at position 1.0 changes nothing
        out = op.velocity(m, x, positions=s)
        torch.testing.assert_close(out, b_O.expand(2, -1), rtol=0, atol=1e-15)
    # a query that sees a key still attends to it: one visible key of weight 1/2, so its value, through W_O
    heads, W_O, b_O, _ = _raw_heads(model, 0)
    one = op.velocity(mu, x[:1], positions=torch.tensor([0.6], dtype=torch.float64))
    values = torch.cat([V @ Y[1] + bv for _Q, _K, V, _bq, _bk, bv in heads])
    torch.testing.assert_close(one[0], W_O @ values + b_O, rtol=1e-10, atol=1e-12)


def test_torch_multihead_attention_blind_query_gives_its_output_bias():
    from meanfield import as_operator
    from particles import Measure

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    torch.nn.init.normal_(mha.out_proj.bias)
    op = as_operator(mha, masked=True)
    mu = Measure(torch.randn(3, 8, dtype=torch.float64), positions=[0.5, 0.6, 1.0])
    out = op.velocity(mu, torch.randn(1, 8, dtype=torch.float64), positions=torch.tensor([0.1], dtype=torch.float64))
    torch.testing.assert_close(out[0], mha.out_proj.bias.detach(), rtol=0, atol=0)


def test_weights_replaced_after_wrapping_are_used(models):
    """An ablation replaces a parameter after the operator was built: the operator computes with it (the
    module's own causal forward pass is the truth)."""
    import copy

    model = copy.deepcopy(models[("gpt2", False)])
    op = mhf.HFAttention.from_model(model, 0)
    X = torch.randn(6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    before = op.sequence(X)
    attn = model.h[0].attn
    attn.c_proj.weight = torch.nn.Parameter(torch.zeros_like(attn.c_proj.weight))
    truth = attn(X[None], attention_mask=mhf.causal_mask(6))[0][0]
    assert torch.equal(truth, attn.c_proj.bias.detach().expand(6, -1))
    torch.testing.assert_close(op.sequence(X), truth, rtol=0, atol=1e-15)
    assert (before - truth).abs().max() > 1e-3
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    from meanfield import as_operator

    top = as_operator(tm)
    tm.out_proj.weight = torch.nn.Parameter(torch.zeros_like(tm.out_proj.weight))
    Z = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(top.sequence(Z), tm(Z[None], Z[None], Z[None])[0][0], rtol=0, atol=1e-15)


@pytest.mark.parametrize("kind,dec", CASES)
def test_a_module_given_alone_keeps_its_models_mask(models, kind, dec):
    """GPT-2's attention is causal, BERT's too in a decoder: wrapped alone, it computes what the layer does in
    its model (the model's own attention function), without being told."""
    from meanfield import as_operator

    model = models[(kind, dec)]
    module = mhf.attention_module(model, 0)
    op = as_operator(module)
    assert op.masked == (kind == "gpt2" or dec)
    X = mhf.capture_attention_inputs(model, _ids(model), [0])[0]
    torch.testing.assert_close(op.sequence(X), mhf.attention_function(model, 0)(X), rtol=0, atol=0)
    assert as_operator(module, masked=False).masked is False


def test_bert_cross_attention_is_refused():
    from transformers import BertConfig, BertModel

    from meanfield import as_operator

    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                     is_decoder=True, add_cross_attention=True)
    model = BertModel(cfg).double().eval()
    cross = model.encoder.layer[0].crossattention
    for module in (cross, cross.self):
        with pytest.raises(ValueError, match="module: BertCrossAttention is cross-attention"):
            as_operator(module)


def test_the_dtype_advice_of_an_adapter_works_when_followed(models):
    """The error for a float32 input to a float64 layer suggests converting the operator (HFAttention.to): doing
    so gives the layer's own float32 forward pass, as converting the wrapped module does (adapters read the
    module's parameters at every call)."""
    import copy

    model = copy.deepcopy(models[("gpt2", False)])
    op = mhf.HFAttention.from_model(model, 0)
    X = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    with pytest.raises(TypeError, match=r"or the operator \(op.to\(dtype=torch.float32\)\)"):
        op.sequence(X)
    converted = op.to(dtype=torch.float32)
    model.to(torch.float32)
    attn = model.h[0].attn
    truth = attn(X[None], attention_mask=mhf.causal_mask(5, torch.float32))[0][0]
    assert op.dtype == torch.float32
    torch.testing.assert_close(op.sequence(X), truth, rtol=0, atol=0)
    torch.testing.assert_close(converted.sequence(X), truth, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_float32_layer_converts_and_its_constant_is_certified_against_float64(kind):
    """HFAttention.to(dtype=...) computes with the shared module's parameters converted at every call: equal to a
    float64 copy of the model. A float32 layer's certified constant is checked with it in float64: at R = 300 the
    float32 certificate alone said error 1.1e-7 where the value was 8.7e-6 from the dense float64 Jacobian's top
    singular value (the truth here, of a float64 copy of the same weights)."""
    import copy

    from meanfield import local_lipschitz

    model = hf.random_model(kind, size="tiny", dtype=torch.float32, seed=1)
    op = mhf.HFAttention.from_model(model, 0)
    ref = mhf.HFAttention.from_model(copy.deepcopy(model).double(), 0)
    d = op.d_in
    X = torch.randn(12, d, generator=torch.Generator().manual_seed(1))
    X = 300.0 * X / X.norm(dim=1, keepdim=True)
    wide = op.to(dtype=torch.float64)
    assert wide.dtype == torch.float64 and op.dtype == torch.float32 and wide.module is op.module
    torch.testing.assert_close(wide.sequence(X.double()), ref.sequence(X.double()), rtol=0, atol=0)
    J = torch.autograd.functional.jacobian(ref.sequence, X.double()).reshape(-1, X.numel())
    truth = float(torch.linalg.matrix_norm(J, ord=2))
    est = local_lipschitz(op, X, tol=1e-6)
    assert est.converged and est.value <= truth * (1 + 1e-12) and truth - est.value <= est.error



@pytest.mark.parametrize("kind, decoder", [("gpt2", False), ("bert", False), ("bert", True)])
def test_capture_attention_outputs_is_the_attention_map_of_the_models_own_pass(kind, decoder):
    """capture_attention_outputs records what each layer's attention alone gave inside the model's pass (its own
    mask); truth: the layer rewritten from raw weights (reimplementation) on the captured input, with the mask the
    model is built with (causal for GPT-2 and a BERT decoder); without the mask it differs."""
    model = hf.random_model(kind, size="tiny", seed=0, is_decoder=decoder)
    ids = _ids(model, 9)
    xs = mhf.capture_attention_inputs(model, ids)
    ys = mhf.capture_attention_outputs(model, ids)
    causal = kind == "gpt2" or decoder
    assert sorted(ys) == list(range(mhf.num_layers(model)))
    for i, Y in ys.items():
        assert Y.shape == xs[i].shape
        assert torch.allclose(Y, reimplementation(model, i, causal)(xs[i]), rtol=0, atol=1e-12)
        if causal:
            assert not torch.allclose(Y, reimplementation(model, i, False)(xs[i]), rtol=0, atol=1e-6)
    assert sorted(mhf.capture_attention_outputs(model, ids, [1])) == [1]
    with pytest.raises(ValueError, match="input_ids"):
        mhf.capture_attention_outputs(model, ids[0])


def test_a_bert_attention_as_operator_is_the_attention_alone_and_says_so(models):
    """A new user's review: as_operator(BertAttention) is W_O concat_h f^h + b, not BertAttention(X) (which adds the
    residual and the LayerNorm): the operator equals output.dense(self(X)) and differs from module(X); its repr
    names the map, and block=True is the module's own map."""
    from meanfield import as_operator

    model = models[("bert", False)]
    layer = model.encoder.layer[0].attention
    X = mhf.capture_attention_inputs(model, _ids(model, 7), [0])[0]
    op = as_operator(layer)
    alone = layer.output.dense(layer.self(X[None])[0])[0]
    torch.testing.assert_close(op.sequence(X), alone, rtol=0, atol=1e-12)
    assert (op.sequence(X) - layer(X[None])[0][0]).abs().max() > 1e-3
    assert "attention alone" in repr(op) and "block=False" in repr(op)
    whole = mhf.HFAttention(layer, block=True)
    torch.testing.assert_close(whole.sequence(X), layer(X[None])[0][0], rtol=0, atol=1e-12)
    assert "whole block" in repr(whole)
