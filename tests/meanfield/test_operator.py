"""The operator protocol and as_operator: every attention acts on sequences and measures.

Truths: multi-head attention re-implemented in this file from a layer's own tensors (weights read
straight from the modules, sharing no code with meanfield.hf), dense weighted Jacobians
(tests/reference.py), the transport LP (scipy), and scipy's ODE solver for token dynamics.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

from meanfield import (
    AttentionOperator,
    CallableOperator,
    SelfAttention,
    as_operator,
    lipschitz_ratio,
    local_lipschitz,
    simulate,
)
from meanfield.hf import HFAttention
from particles import Measure
from tests.reference import dense_lipschitz, w2_lp

transformers = pytest.importorskip("transformers", reason="the models extra (transformers) is not installed")

pytestmark = pytest.mark.usefixtures("one_thread")
f64 = torch.float64


def rand(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


# ---------------------------------------------------------------------- tiny real layers
def tiny_bert(is_decoder=False):
    cfg = transformers.BertConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16,
                                  vocab_size=50, max_position_embeddings=32, is_decoder=is_decoder)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False).to(f64).eval()
    att = model.encoder.layer[0].attention
    with torch.no_grad():  # initialization is nearly uniform attention: make the scores matter
        att.self.query.weight.mul_(25.0)
        att.self.key.weight.mul_(25.0)
        att.self.query.bias.normal_(0, 0.3)
        att.output.dense.weight.mul_(10.0)
        att.self.value.weight.mul_(10.0)
    return model


def tiny_gpt2():
    cfg = transformers.GPT2Config(n_embd=8, n_head=2, n_layer=1, vocab_size=50, n_positions=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    model = transformers.GPT2Model(cfg).to(f64).eval()
    with torch.no_grad():
        model.h[0].attn.c_attn.weight.mul_(25.0)
        model.h[0].attn.c_proj.weight.mul_(10.0)
    return model


def heads_attention(x, keys, Wq, bq, Wk, bk, Wv, bv, Wo, bo, H, lw=None, x_pos=None, k_pos=None):
    """sum_j softmax_j(<q_i, k_j> / sqrt(k) + log a_j) v_j per head, concatenated, times W_O: written out."""
    d = Wq.shape[0]
    k = d // H
    q, kk, v = x @ Wq.T + bq, keys @ Wk.T + bk, keys @ Wv.T + bv
    outs = []
    for h in range(H):
        sl = slice(h * k, (h + 1) * k)
        S = q[:, sl] @ kk[:, sl].T / math.sqrt(k)
        if lw is not None:
            S = S + lw[None, :]
        if x_pos is not None:
            S = S.masked_fill(k_pos[None, :] > x_pos[:, None], -math.inf)
        outs.append(torch.softmax(S, -1) @ v[:, sl])
    return torch.cat(outs, -1) @ Wo.T + bo


def bert_reference(att, H):
    s, o = att.self, att.output.dense
    W = (s.query.weight, s.query.bias, s.key.weight, s.key.bias, s.value.weight, s.value.bias, o.weight, o.bias)
    return lambda x, keys, **kw: heads_attention(x, keys, *W, H, **kw)


def gpt2_reference(attn, H):
    d = attn.embed_dim
    W, b = attn.c_attn.weight.T, attn.c_attn.bias  # Conv1D stores (in, out)
    Wt = (W[:d], b[:d], W[d:2 * d], b[d:2 * d], W[2 * d:], b[2 * d:], attn.c_proj.weight.T, attn.c_proj.bias)
    return lambda x, keys, **kw: heads_attention(x, keys, *Wt, H, **kw)


def weighted_masked_measure(n=5, d=8, seed=3):
    X = rand(n, d, seed=seed)
    w = torch.tensor([0.05, 0.3, 0.1, 0.4, 0.15], dtype=f64)[:n]
    w = w / w.sum()
    pos = torch.tensor([0.1, 0.1, 0.5, 0.7, 1.0], dtype=f64)[:n]   # two atoms share a position
    return X, w, pos


# ---------------------------------------------------------------------- Hugging Face layers
@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_hf_layer_outputs_match_a_reimplementation_on_weighted_masked_measures(kind):
    model = tiny_bert() if kind == "bert" else tiny_gpt2()
    ref = (bert_reference(model.encoder.layer[0].attention, 2) if kind == "bert"
           else gpt2_reference(model.h[0].attn, 2))
    X, w, pos = weighted_masked_measure()
    for masked in (False, True):
        op = HFAttention.from_model(model, 0, masked=masked)
        assert isinstance(op, AttentionOperator) and op.masked == masked
        mu = Measure(X, w, positions=pos if masked else None)
        kw = dict(lw=w.log(), x_pos=pos, k_pos=pos) if masked else dict(lw=w.log())
        assert torch.allclose(op(mu).points, ref(X, X, **kw), atol=1e-12, rtol=1e-10)
        # sequences: uniform weights, positions i/n
        seq_kw = dict(x_pos=torch.arange(5.0, dtype=f64), k_pos=torch.arange(5.0, dtype=f64)) if masked else {}
        assert torch.allclose(op.sequence(X), ref(X, X, **seq_kw), atol=1e-12, rtol=1e-10)
        # the velocity field at other points, against the same measure
        Z, zpos = rand(3, 8, seed=9), torch.tensor([0.05, 0.6, 1.0], dtype=f64)
        vel = op.velocity(mu, Z, positions=zpos) if masked else op.velocity(mu, Z)
        zkw = dict(lw=w.log(), x_pos=zpos, k_pos=pos) if masked else dict(lw=w.log())
        # a query at 0.05 sees no key: HF's finite mask value makes its row uniform, not NaN
        rows = slice(1, 3) if masked else slice(0, 3)
        assert torch.allclose(vel[rows], ref(Z, X, **zkw)[rows], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_hf_layer_w2_constant_on_weighted_masked_measure_matches_dense_weighted_jacobian(kind):
    model = tiny_bert() if kind == "bert" else tiny_gpt2()
    ref = (bert_reference(model.encoder.layer[0].attention, 2) if kind == "bert"
           else gpt2_reference(model.h[0].attn, 2))
    X, w, pos = weighted_masked_measure()
    op = HFAttention.from_model(model, 0, masked=True)
    truth = dense_lipschitz(lambda Y: ref(Y, Y, lw=w.log(), x_pos=pos, k_pos=pos), X, weights=w)
    for method in ("lanczos", "dense"):
        est = local_lipschitz(op, Measure(X, w, positions=pos), method=method, tol=1e-10)
        assert abs(est.value - truth) <= 1e-8 * truth, (method, est.value, truth)
    # weights matter: the uniform measure at the same points has another constant
    unif = dense_lipschitz(lambda Y: ref(Y, Y, x_pos=pos, k_pos=pos), X, weights=torch.full((5,), 0.2, dtype=f64))
    assert abs(unif - truth) > 1e-3 * truth


def test_hf_block_map_is_layernorm_of_the_residual():
    model = tiny_bert()
    att = model.encoder.layer[0].attention
    ref = bert_reference(att, 2)
    X = rand(6, 8, seed=4)
    op = HFAttention.from_model(model, 0, block=True)
    assert torch.allclose(op.sequence(X), att.output.LayerNorm(X + ref(X, X)), atol=1e-12)
    assert torch.allclose(op.sequence(X), att(X.unsqueeze(0))[0][0], atol=1e-12)   # what the model computes
    g = tiny_gpt2()
    blk = g.h[0]
    opg = HFAttention.from_model(g, 0, block=True, masked=False)
    Y = blk.ln_1(X)
    assert torch.allclose(opg.sequence(X), X + gpt2_reference(blk.attn, 2)(Y, Y), atol=1e-12)


def test_hf_layer_token_dynamics_match_a_plain_ode_solve():
    model = tiny_bert()
    ref = bert_reference(model.encoder.layer[0].attention, 2)
    X, w, pos = weighted_masked_measure()
    X = 0.3 * X
    op = HFAttention.from_model(model, 0, masked=True)
    traj = simulate(op, Measure(X, w, positions=pos), [0.0, 0.5, 1.0], method="rk4", options={"steps": 200})

    def rhs(t, y):
        Y = torch.as_tensor(y, dtype=f64).reshape(5, 8)
        return ref(Y, Y, lw=w.log(), x_pos=pos, k_pos=pos).detach().numpy().ravel()

    sol = solve_ivp(rhs, (0.0, 1.0), X.numpy().ravel(), t_eval=[0.5, 1.0], rtol=1e-11, atol=1e-12, method="DOP853")
    for k in (1, 2):
        assert np.allclose(traj.points[k].numpy().ravel(), sol.y[:, k - 1], atol=1e-8)
    assert float((traj.points[-1] - X).norm()) > 0.1   # the tokens really moved


def test_hf_layer_lipschitz_ratio_against_lp_w2():
    model = tiny_bert()
    ref = bert_reference(model.encoder.layer[0].attention, 2)
    X, w, _ = weighted_masked_measure()
    Y = X + 0.3 * rand(5, 8, seed=11)
    v = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=f64)
    op = as_operator(model.encoder.layer[0].attention)
    assert isinstance(op, HFAttention) and not op.masked
    FX, FY = ref(X, X, lw=w.log()), ref(Y, Y, lw=v.log())
    expected = w2_lp(FX, w, FY, v) / w2_lp(X, w, Y, v)
    assert lipschitz_ratio(op, Measure(X, w), Measure(Y, v)) == pytest.approx(expected, rel=1e-7)


def test_hf_module_in_training_mode_is_refused():
    model = tiny_bert().train()
    op = HFAttention.from_model(model, 0)
    with pytest.raises(ValueError, match=r"training mode with dropout p = 0\.1"):
        op.sequence(rand(4, 8))


@pytest.mark.parametrize("block", [False, True])
def test_hf_module_in_training_mode_without_dropout_is_the_eval_map(block):
    """Training mode with every dropout at 0 is a deterministic map (as torch's MultiheadAttention adapter already
    took it): accepted, and equal to the module in eval mode; a dropout of p > 0 anywhere in the block is refused."""
    model = tiny_bert()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    X = rand(4, 8)
    want = HFAttention.from_model(model, 0, block=block).sequence(X)
    model.train()
    got = HFAttention.from_model(model, 0, block=block).sequence(X)
    assert torch.equal(got, want)
    model.encoder.layer[0].attention.output.dropout.p = 0.2
    with pytest.raises(ValueError, match=r"training mode with dropout p = 0\.2"):
        HFAttention.from_model(model, 0, block=block).sequence(X)


# ---------------------------------------------------------------------- torch.nn.MultiheadAttention
def test_torch_multihead_attention_without_forward_mode_ad():
    """Fused SDPA has no forward-mode derivative on CPU: the Krylov estimators still run (J u by
    reverse-over-reverse), and agree with the dense Jacobian of a re-implementation."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).to(f64).eval()
    with torch.no_grad():
        mha.in_proj_weight.mul_(4.0)
    d = 8
    W, b = mha.in_proj_weight, mha.in_proj_bias
    Wt = (W[:d], b[:d], W[d:2 * d], b[d:2 * d], W[2 * d:], b[2 * d:], mha.out_proj.weight, mha.out_proj.bias)
    ref = lambda x, keys, **kw: heads_attention(x, keys, *Wt, 2, **kw)
    X, w, pos = weighted_masked_measure()
    with pytest.raises(NotImplementedError):   # the premise: forward-mode AD is unavailable here
        torch.func.jvp(lambda Y: mha(Y, Y, Y, need_weights=False)[0], (X[None],), (X[None],))
    op = as_operator(mha)
    truth = dense_lipschitz(lambda Y: ref(Y, Y), X)
    for method in ("lanczos", "power", "dense"):
        est = local_lipschitz(op, X, method=method, tol=1e-10, max_iter=3000)
        assert abs(est.value - truth) <= 1e-8 * truth
    # measures: weights in the mask
    opm = as_operator(mha, masked=True)
    truth = dense_lipschitz(lambda Y: ref(Y, Y, lw=w.log(), x_pos=pos, k_pos=pos), X, weights=w)
    est = local_lipschitz(opm, Measure(X, w, positions=pos), tol=1e-10)
    assert abs(est.value - truth) <= 1e-8 * truth


def test_reverse_over_reverse_when_a_function_has_no_forward_mode():
    """A custom autograd.Function with a backward but no jvp: J u comes from the gradient of
    <J^T w, u> in w, and the Krylov estimators agree with the dense Jacobian."""

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(X):
            return torch.softmax(X @ X.T, -1) @ X

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (X,) = ctx.saved_tensors
            with torch.enable_grad():   # a differentiable backward: double backward works
                Xd = X.detach().requires_grad_(True)
                out = torch.softmax(Xd @ Xd.T, -1) @ Xd
                return torch.autograd.grad(out, Xd, g, create_graph=True)[0]

    X = rand(6, 3, seed=5)
    with pytest.raises(NotImplementedError):   # the premise
        torch.func.jvp(Attention.apply, (X,), (X,))
    truth = dense_lipschitz(lambda Y: torch.softmax(Y @ Y.T, -1) @ Y, X)
    for method in ("lanczos", "power"):
        est = local_lipschitz(Attention.apply, X, method=method, tol=1e-10, max_iter=5000)
        assert abs(est.value - truth) <= 1e-8 * truth


# ---------------------------------------------------------------------- bare callables
def test_bare_callable_is_points_only_and_refuses_weights():
    att = SelfAttention(rand(4, 4, seed=1), rand(4, 4, seed=2))
    f = lambda Y: att.sequence(Y)
    op = as_operator(f)
    assert isinstance(op, CallableOperator) and op.points_only
    X = rand(5, 4, seed=3)
    w = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=f64)
    with pytest.raises(ValueError, match="weights"):
        local_lipschitz(f, Measure(X, w))
    with pytest.raises(ValueError, match="positions"):
        local_lipschitz(f, Measure.sequence(X))
    with pytest.raises(ValueError, match="weights"):
        lipschitz_ratio(f, Measure(X, w), Measure(X + 0.1, w))
    with pytest.raises(TypeError, match="points-only"):
        simulate(f, Measure(X), 1.0)
    with pytest.raises(TypeError, match="points-only"):
        simulate(as_operator(f), Measure(X), 1.0)
    # a uniform, unpositioned measure is a sequence: the callable's constant is the operator's
    a = local_lipschitz(f, Measure(X), tol=1e-11).value
    assert a == pytest.approx(local_lipschitz(att, Measure(X), tol=1e-11).value, rel=1e-9)
    assert a == pytest.approx(dense_lipschitz(att.sequence, X), rel=1e-9)
    assert torch.allclose(op(Measure(X)).points, att.sequence(X))


def test_as_operator_returns_operators_and_checks_masked():
    att = SelfAttention(np.eye(3), np.eye(3), masked=True)
    assert as_operator(att) is att
    with pytest.raises(ValueError, match="masked"):
        as_operator(att, masked=False)
    with pytest.raises(TypeError, match="f: expected"):
        as_operator(42)


def test_operator_errors_name_the_fix():
    att = SelfAttention(np.eye(3), np.eye(3))
    with pytest.raises(TypeError, match=r"X.to\(torch.float64\)|op.to\(dtype=torch.float32\)"):
        att.sequence(torch.zeros(4, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match="X: an empty sequence"):
        att.sequence(np.zeros((0, 3)))
    with pytest.raises(FloatingPointError, match="overflow"):
        SelfAttention(1e308 * np.eye(3), np.eye(3)).sequence(10 * rand(4, 3, seed=0))
    with pytest.raises(TypeError, match="dtype: expected a floating dtype"):
        SelfAttention(0.5 * np.eye(3), np.eye(3), dtype=torch.int64)


def test_every_operator_takes_the_protocol_argument_names():
    """evaluate is called by keyword by users writing their own code: one set of names everywhere."""
    import inspect

    from meanfield import adapters, attention, hf, isotropic, operator

    want = list(inspect.signature(operator.AttentionOperator.evaluate).parameters)
    classes = [c for m in (adapters, attention, hf, isotropic, operator) for c in vars(m).values()
               if isinstance(c, type) and issubclass(c, operator.AttentionOperator) and "evaluate" in vars(c)]
    assert len(classes) >= 6
    for cls in classes:
        assert list(inspect.signature(cls.evaluate).parameters) == want, cls.__name__
