"""Conventions users know: a dtype mismatch is an error that says how to convert (and following its
advice works), and numpy scalars are accepted wherever a Python number is (same results)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import (
    L2SelfAttention,
    MultiHeadAttention,
    SelfAttention,
    adversarial,
    bounds,
    clustering,
    lipschitz_ratio,
    local_lipschitz,
    simulate,
)
from meanfield.dynamics import residual_layers
from meanfield.isotropic import IsotropicAttention
from particles import Measure
from tests.reference import naive_attention, prop34_lower, thm33_upper

A = torch.tensor([[0.6, 0.2], [-0.3, 0.4]], dtype=torch.float64)
V = torch.tensor([[1.0, 0.5], [0.0, 0.8]], dtype=torch.float64)


# ---------------------------------------------------------------------- dtype mismatches
def test_float32_tensor_into_float64_operator_says_how_to_convert():
    att = SelfAttention(A, V)
    X = torch.randn(5, 2, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match=r"X: dtype torch.float32 differs from the operator's torch.float64; "
                                        r"convert the input \(X.to\(torch.float64\)\) or the operator "
                                        r"\(op.to\(dtype=torch.float32\)\)"):
        att.sequence(X)
    # both pieces of advice work, and give attention as written out from its formula
    truth = naive_attention(X.double(), A, V)
    torch.testing.assert_close(att.sequence(X.to(torch.float64)), truth, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(att.to(dtype=torch.float32).sequence(X), truth.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entry", ["sequence", "velocity", "local_lipschitz"])
def test_float_numpy_array_of_another_dtype_is_refused_like_a_tensor(entry):
    """A float64 numpy array given to a float32 operator was converted to float32 silently (its precision lost)
    where the same values as a tensor are refused: a float numpy array must have the operator's dtype, and the
    advice works; lists and integer arrays, which carry no float dtype, take the operator's."""
    att32 = SelfAttention(A, V, dtype=torch.float32)
    mu = Measure.sphere(4, 2, seed=0, dtype=torch.float32)
    X = np.random.default_rng(0).normal(size=(5, 2))
    run = {"sequence": att32.sequence, "velocity": lambda x: att32.velocity(mu, x),
           "local_lipschitz": lambda x: local_lipschitz(att32, x)}[entry]
    with pytest.raises(TypeError, match=r"X: numpy dtype float64 differs from the operator's torch.float32; "
                                        r"convert the input \(X.astype\(np.float32\)\) or the operator "
                                        r"\(op.to\(dtype=torch.float64\)\)" if entry != "velocity" else
                       r"x: numpy dtype float64 differs from the operator's torch.float32; convert the input "
                       r"\(x.astype\(np.float32\)\)"):
        run(X)
    with pytest.raises(TypeError, match=r"numpy dtype float32 differs from the operator's torch.float64"):
        SelfAttention(A, V).sequence(X.astype(np.float32))
    got = run(X.astype(np.float32))
    want = run(torch.from_numpy(X.astype(np.float32)))
    if entry == "local_lipschitz":
        got, want = got.value, want.value
    assert got == pytest.approx(want) if entry == "local_lipschitz" else torch.equal(got, want)
    if entry == "sequence":
        torch.testing.assert_close(att32.sequence(X.tolist()), att32.sequence(torch.tensor(X.tolist())))
        Xi = np.arange(10).reshape(5, 2) % 3
        assert torch.equal(att32.sequence(Xi), att32.sequence(torch.from_numpy(Xi).float()))


@pytest.mark.parametrize("call", ["pushforward", "velocity", "local_lipschitz", "lipschitz_ratio", "simulate"])
def test_float32_measure_into_float64_operator_names_the_fix(call):
    att = SelfAttention(A, V)
    mu = Measure.sphere(4, 2, seed=0, dtype=torch.float32)
    nu = Measure.sphere(4, 2, seed=1, dtype=torch.float32)
    run = {"pushforward": lambda: att(mu), "velocity": lambda: att.velocity(mu, mu.points),
           "local_lipschitz": lambda: local_lipschitz(att, mu),
           "lipschitz_ratio": lambda: lipschitz_ratio(att, mu, nu),
           "simulate": lambda: simulate(att, mu, [0.0, 1.0], options={"steps": 2})}[call]
    with pytest.raises(TypeError, match=r"dtype torch.float32 differs from the operator's torch.float64; convert "
                                        r"the measure \(\w+.to\(dtype=torch.float64\)\) or the operator"):
        run()


def test_parameters_of_different_float_dtypes_are_refused_not_silently_converted():
    with pytest.raises(TypeError, match=r"V: dtype torch.float64 differs from A's torch.float32; convert it "
                                        r"\(V.to\(torch.float32\)\) or pass dtype="):
        SelfAttention(A.float(), V)
    with pytest.raises(TypeError, match="value_bias: dtype torch.float32 differs from A's torch.float64"):
        SelfAttention(A, V, value_bias=torch.zeros(2, dtype=torch.float32))
    with pytest.raises(TypeError, match="K: dtype torch.float64 differs from Q's torch.float32"):
        SelfAttention.from_qkv(A.float(), A, V.float())
    with pytest.raises(TypeError, match="W_V: dtype torch.float32 differs from W_Q's torch.float64"):
        L2SelfAttention(A, V.float())
    heads = [SelfAttention(A, V), SelfAttention(A, V)]
    with pytest.raises(TypeError, match="W_O: dtype torch.float32 differs from the heads' torch.float64"):
        MultiHeadAttention(heads, torch.eye(2, 4, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"heads\[1\]: dtype torch.float32 differs from heads\[0\]'s torch.float64; "
                                        r"convert the heads to one dtype \(heads\[1\].to\(dtype=torch.float64\)\)"):
        MultiHeadAttention([SelfAttention(A, V), SelfAttention(A.float(), V.float())], torch.eye(2, 4))
    # dtype= converts every parameter on request; lists and integer arrays follow the operator's dtype, float numpy
    # arrays carry theirs as tensors do (float64 values next to float32 parameters are refused, not rounded)
    X = torch.randn(3, 2, dtype=torch.float64)
    att = SelfAttention(A.float(), V, dtype=torch.float64)
    torch.testing.assert_close(att.sequence(X), naive_attention(X, A.float().double(), V), rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match=r"V: dtype torch.float64 differs from A's torch.float32; convert it "
                                        r"\(V.astype\(np.float32\)\)"):
        SelfAttention(A.float(), V.numpy())
    assert SelfAttention(A.float(), V.numpy().astype(np.float32)).dtype == torch.float32
    assert SelfAttention(A.float(), V.tolist()).dtype == torch.float32
    assert MultiHeadAttention(heads, np.eye(2, 4)).dtype == torch.float64


# ---------------------------------------------------------------------- numpy scalars
def test_numpy_scalars_in_operators_and_estimators_give_the_python_results():
    X = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    att = SelfAttention.from_qkv(A, V, V, scale=np.float32(0.5))
    ref = SelfAttention.from_qkv(A, V, V, scale=float(np.float32(0.5)))
    torch.testing.assert_close(att.sequence(X), ref.sequence(X), rtol=0, atol=0)
    est = local_lipschitz(ref, X, tol=np.float32(1e-8), max_iter=np.int64(200), seed=np.int64(3))
    same = local_lipschitz(ref, X, tol=1e-8, max_iter=200, seed=3)
    assert est.value == same.value and est.iterations == same.iterations
    est = local_lipschitz(ref, X, method="power", tol=np.float64(1e-7), max_iter=np.int32(5000))
    assert est.converged
    assert IsotropicAttention(np.float32(2.0), "SA").beta == 2.0


def test_numpy_scalars_in_simulate():
    mu = Measure.sphere(5, 2, seed=0)
    att = SelfAttention(A, V)
    ref = simulate(att, mu, [0.0, 0.5, 1.0], options={"steps": 3})
    for kw in (dict(times=np.array([0.0, 0.5, 1.0], dtype=np.float32), options={"steps": np.int64(3)}),
               dict(times=[np.float64(0.0), np.float32(0.5), np.int64(1)], options={"step": np.float64(0.5 / 3)})):
        out = simulate(att, mu, **kw)
        torch.testing.assert_close(out.points, ref.points, rtol=1e-12, atol=1e-12)
    assert torch.equal(simulate(att, mu, np.float32(1.0), options={"steps": np.int64(6)}).points[-1],
                       simulate(att, mu, 1.0, options={"steps": 6}).points[-1])
    ada = simulate(att, mu, [0.0, 1.0], method="dopri5", rtol=np.float32(1e-6), atol=np.float32(1e-8),
                   options={"max_steps": np.int64(1000)})
    torch.testing.assert_close(ada.points[-1], ref.points[-1], rtol=1e-4, atol=1e-4)
    sa = simulate(IsotropicAttention(np.float32(1.0), "SA"), Measure.sphere(4, 3, seed=0), [0.0, 1.0],
                  geometry="sphere", options={"steps": 2})
    assert sa.points.shape == (2, 4, 3)
    torch.testing.assert_close(residual_layers(att, mu.points, np.int64(3), T=np.float32(1.0)),
                               residual_layers(att, mu.points, 3, T=1.0), rtol=0, atol=0)


def test_numpy_scalars_in_bounds_and_witnesses():
    A = torch.tensor([[0.6, 0.2], [0.2, 0.4]], dtype=torch.float64)  # real eigenvalues: Proposition 3.4 applies
    # the bounds against the paper's formulas typed in by hand
    assert bounds.sqrt_n_upper(A, V, np.float32(2.0), np.int64(10)) == pytest.approx(thm33_upper(A, V, 2.0, 10))
    gamma = bounds.gamma_info(A).gamma
    assert bounds.sqrt_n_lower(A, np.float64(1.5), np.int32(7)) == pytest.approx(prop34_lower(gamma, 1.5, 7))
    assert math.isfinite(bounds.mean_field_upper(A, V, np.float32(2.0)))
    assert bounds.two_dirac_lower(A, np.float32(2.0)) == bounds.two_dirac_lower(A, 2.0)
    assert bounds.multihead_upper([np.float32(1.0), np.float64(2.0)], np.eye(2)) == pytest.approx(math.sqrt(5))
    torch.testing.assert_close(adversarial.sqrt_n_sequence(A, np.float32(2.0), np.int64(5)),
                               adversarial.sqrt_n_sequence(A, 2.0, 5), rtol=0, atol=0)
    torch.testing.assert_close(
        adversarial.large_radius_configuration(A, n=np.int64(4), R=np.float32(2.0), hub=np.int64(1)),
        adversarial.large_radius_configuration(A, n=4, R=2.0, hub=1), rtol=0, atol=0)
    spread = adversarial.zero_plus_spread(np.float32(2.0), np.int64(4), np.int64(2), seed=np.int64(0))
    torch.testing.assert_close(spread, adversarial.zero_plus_spread(2.0, 4, 2, seed=0), rtol=0, atol=0)
    assert adversarial.two_dirac(A, np.float32(2.0)).n == 2


def test_numpy_scalars_in_clustering():
    X = np.array([[0.0, 0.0], [1e-4, 0.0], [1.0, 1.0]])
    assert clustering.count_clusters(X, np.float32(0.1)) == clustering.count_clusters(X, 0.1) == 2
    assert clustering.interaction_energy(X, np.float32(1.0)) == pytest.approx(clustering.interaction_energy(X, 1.0))


def test_numpy_integer_layer_of_a_hugging_face_model():
    transformers = pytest.importorskip("transformers")
    from meanfield import hf

    config = transformers.BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=16, vocab_size=20)
    model = transformers.BertModel(config).eval()
    assert hf.extract_layer(model, np.int64(1)).layer == 1
    assert hf.HFAttention.from_model(model, np.int32(-1)).d_in == 8
