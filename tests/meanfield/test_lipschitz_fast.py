"""The fast paths of local_lipschitz keep its guarantees: float32 products with a float64 certificate
(mixed precision), Jacobian products by reverse-over-reverse or forward mode, certificates from kept
images B q. Truth: the dense Jacobian of tests/reference.py, and the certificate recomputed from it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import meanfield.jacobian as jacobian
from meanfield import SelfAttention, adversarial, kernels, local_lipschitz
from meanfield.jacobian import Jacobian
from meanfield.lipschitz import ConvergenceError
from particles import Measure
from tests.meanfield.test_lipschitz import make_op, rand, rel
from tests.reference import dense_jacobian, dense_lipschitz, dense_lipschitz_logweights, naive_attention

pytestmark = pytest.mark.usefixtures("one_thread")
f32, f64 = torch.float32, torch.float64


class _Float32Products:
    """Counts the Jacobian products computed in float32."""

    def __init__(self, monkeypatch):
        self.count = 0
        raw = Jacobian._raw_J

        def spy(p, u):
            self.count += u.dtype == f32
            return raw(p, u)

        monkeypatch.setattr(Jacobian, "_raw_J", spy)


def _independent_certificate(op, X, u):
    """value |J u| and the error bound min(r / v, sqrt r) from the dense float64 Jacobian."""
    J = dense_jacobian(op.sequence, X)
    u = u.reshape(-1)
    Ju = J @ u
    v = float(Ju.norm())
    r = float((J.T @ Ju - v**2 * u).norm())
    return v, min(r / v, math.sqrt(r)), float(torch.linalg.matrix_norm(J, ord=2))


@pytest.mark.parametrize("tol", [1e-6, 1e-11])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kind", ["single", "mha", "l2"])
def test_mixed_precision_certificate_is_a_float64_statement(kind, masked, tol, monkeypatch):
    """mixed=True runs float32 products, and what it returns is certified in float64: the value and
    error agree with the certificate recomputed from the dense float64 Jacobian, the top singular value
    lies in [value, value + error], and error <= tol * value."""
    spy = _Float32Products(monkeypatch)
    op = make_op(kind, masked)
    X = rand(6, 4, seed=7, scale=1.5)
    est = local_lipschitz(op, X, tol=tol, mixed=True, max_iter=2000)
    assert spy.count > 0
    v, err, truth = _independent_certificate(op, X, est.vector)
    assert est.converged and est.error <= tol * est.value
    assert rel(est.value, v) <= 1e-12
    assert est.error >= 0.5 * err - 1e-15 * v   # never more optimistic than the float64 residual allows
    assert est.value <= truth * (1 + 1e-12) and est.value + est.error >= truth * (1 - 1e-12)


def test_mixed_precision_on_batches_and_measures(monkeypatch):
    spy = _Float32Products(monkeypatch)
    op = make_op("mha", masked=True)
    X = rand(3, 6, 4, seed=9)
    batch = local_lipschitz(op, X, tol=1e-10, mixed=True, max_iter=2000)
    for i, est in enumerate(batch):
        assert est.converged and rel(est.value, dense_lipschitz(op.sequence, X[i])) <= 1e-8
    w = torch.softmax(rand(6, seed=3), 0)
    mu = Measure(X[0], w, positions=torch.arange(1, 7, dtype=f64) / 6)
    est = local_lipschitz(op, mu, tol=1e-10, mixed=True, max_iter=2000)
    truth = dense_lipschitz(lambda Y: op.points_map(Y, mu.log_weights, mu.positions), X[0], weights=w)
    assert est.converged and rel(est.value, truth) <= 1e-8
    assert spy.count > 0


@pytest.mark.parametrize("weighted", [False, True])
def test_mixed_precision_at_a_float32_tolerance_leaves_float64_one_certificate(weighted, monkeypatch):
    """At tol = 1e-4, far above float32's rounding, the float32 phase (its basis, its products, with
    the measure's weights) finds the top singular vector and float64 only certifies it: one J u in
    float64 (the certificate's), no float64 Lanczos vector. A float32 twin that drops the weights, or
    no float32 phase at all, leaves float64 to run its own Lanczos (five or more products here). The
    value is still the dense float64 Jacobian's top singular value within tol."""
    counts = {f32: 0, f64: 0}
    raw = Jacobian._raw_J

    def spy(p, u):
        counts[u.dtype] += 1
        return raw(p, u)

    monkeypatch.setattr(Jacobian, "_raw_J", spy)
    op = make_op("mha", masked=True)
    X = rand(6, 4, seed=9)
    if weighted:
        w = torch.softmax(2 * rand(6, seed=3), 0)
        mu = Measure(X, w, positions=torch.arange(1, 7, dtype=f64) / 6)
        est = local_lipschitz(op, mu, tol=1e-4, mixed=True, max_iter=2000)
        truth = dense_lipschitz(lambda Y: op.points_map(Y, mu.log_weights, mu.positions), X, weights=w)
    else:
        est = local_lipschitz(op, X, tol=1e-4, mixed=True, max_iter=2000)
        truth = dense_lipschitz(op.sequence, X)
    assert est.converged and est.value <= truth * (1 + 1e-12) and rel(est.value, truth) <= 1e-4
    assert counts[f32] >= 3 and counts[f64] == 1, counts


def test_float32_outside_its_range_hands_over_to_float64(monkeypatch):
    """A constant beyond float32's range (two Diracs at R = 40, Lip ~ 7e88) or weights whose scalings
    leave it (a mass of 1e-75): float32 cannot stand in, float64 computes the certified value."""
    spy = _Float32Products(monkeypatch)
    op = SelfAttention(np.eye(3), np.eye(3))
    two = adversarial.two_dirac(np.eye(3), 40.0)
    f = lambda Y: naive_attention(Y, torch.eye(3, dtype=f64), torch.eye(3, dtype=f64), log_weights=two.log_weights)
    truth = dense_lipschitz_logweights(f, two.points, two.log_weights)
    est = local_lipschitz(op, two, tol=1e-10, mixed=True)
    assert truth > 1e88 and est.converged and rel(est.value, truth) <= 1e-9
    X = rand(3, 3, seed=5, scale=2.0)
    w = torch.tensor([0.5, 1e-75, 0.5], dtype=f64)
    mu = Measure(X, w, normalize=True)
    est = local_lipschitz(op, mu, tol=1e-10, mixed=True)
    truth = dense_lipschitz_logweights(lambda Y: naive_attention(Y, torch.eye(3, dtype=f64), torch.eye(3, dtype=f64),
                                                                 log_weights=mu.log_weights), X, mu.log_weights)
    assert est.converged and rel(est.value, truth) <= 1e-8
    assert spy.count <= 2   # at most the float32 trial products that revealed the range problem


def test_mixed_precision_that_runs_out_of_iterations_is_not_converged():
    """When max_iter ends the run before the float64 certificate meets tol, the estimate says so."""
    op = make_op("single", masked=False, d=6)
    X = rand(10, 6, seed=2, scale=2.0)
    with pytest.raises(ConvergenceError) as info:
        local_lipschitz(op, X, tol=1e-13, mixed=True, max_iter=3)
    est = info.value.estimate
    assert not est.converged and est.error > 1e-13 * est.value
    v, err, _ = _independent_certificate(op, X, est.vector)
    assert rel(est.value, v) <= 1e-12 and est.error >= 0.5 * err


@pytest.mark.parametrize("budget", [None, 0])
def test_products_by_reverse_over_reverse_and_forward_mode_agree(budget, monkeypatch):
    """J u by reverse-over-reverse on the recorded graph (default) or, above the graph budget, by
    forward-mode AD; both are J u (not f(X)), and the estimates agree with the dense Jacobian."""
    if budget is not None:
        monkeypatch.setattr(jacobian, "RR_BUDGET", budget)
    op = make_op("mha", masked=True)
    X = rand(6, 4, seed=7, scale=1.5)
    p = Jacobian(lambda Y: op.points_map(Y, None, torch.arange(1, 7, dtype=f64) / 6), X.unsqueeze(0))
    u = rand(1, 6, 4, seed=8)
    J = dense_jacobian(op.sequence, X)
    Ju = p._jvp(u)
    assert p._MODES[p.mode] == ("forward" if budget == 0 else "rr")
    assert torch.allclose(Ju.reshape(-1), J @ u.reshape(-1), rtol=1e-12, atol=1e-13)
    assert torch.allclose(p._jt(Ju).reshape(-1), J.T @ (J @ u.reshape(-1)), rtol=1e-12, atol=1e-13)
    est = local_lipschitz(op, X, tol=1e-11)
    assert rel(est.value, dense_lipschitz(op.sequence, X)) <= 1e-8


@pytest.mark.parametrize("budget", ["linear", 0])
def test_streamed_operator_products_record_linear_memory(budget, monkeypatch):
    """With the streamed kernel, the graph of w -> J^T w saves O(n) bytes (the backward is one node
    whose derivative in the cotangent is the streamed JVP): a budget of 64 n d doubles, below one
    (n, n) score matrix, is enough for reverse-over-reverse; with no budget J u runs in forward
    mode. Same certified constant as the dense kernel either way."""
    g = torch.Generator().manual_seed(4)
    n, d = 300, 3
    monkeypatch.setattr(jacobian, "RR_BUDGET", 64 * n * d * 8 if budget == "linear" else 0)
    assert jacobian.RR_BUDGET < n * n * 8
    X = torch.randn(n, d, generator=g, dtype=f64)
    op = SelfAttention(torch.randn(d, d, generator=g, dtype=f64), torch.randn(d, d, generator=g, dtype=f64),
                       masked=True)
    pos = torch.arange(1, n + 1, dtype=f64) / n
    with kernels.use("stream", block_size=64):
        est = local_lipschitz(op, X, tol=1e-9, mixed=False)
        p = Jacobian(lambda Y: op.points_map(Y, None, pos), X.unsqueeze(0))
        p._jvp(torch.randn_like(p.X))
    assert p._MODES[p.mode] == ("rr" if budget == "linear" else "forward")
    with kernels.use("dense"):
        ref = local_lipschitz(op, X, tol=1e-9, mixed=False)
    assert rel(est.value, ref.value) <= 1e-7


def test_auto_mixed_only_for_large_float64_problems(monkeypatch):
    spy = _Float32Products(monkeypatch)
    op = make_op("single", masked=False)
    local_lipschitz(op, rand(6, 4, seed=1), tol=1e-8)                 # 24 entries < MIXED_MIN_SIZE
    assert spy.count == 0
    op64 = SelfAttention(np.eye(64) / 8, np.eye(64) / 8)
    X = rand(80, 64, seed=2)                                           # 5120 entries >= MIXED_MIN_SIZE
    est = local_lipschitz(op64, X, tol=1e-6)
    assert spy.count > 0 and est.converged
    spy.count = 0
    local_lipschitz(op64, X, tol=1e-6, mixed=False)
    assert spy.count == 0
    with pytest.raises(TypeError, match="mixed"):
        local_lipschitz(op64, X, mixed="yes")


def test_fused_sdpa_layers_take_reverse_over_reverse_on_the_math_backend():
    """torch's fused SDPA kernels have neither forward-mode AD nor a double backward on CPU: J u comes
    from reverse-over-reverse on a graph recorded with the math backend (no recomputation of f), and
    the estimate agrees with the dense Jacobian of the same layer on its math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from meanfield import as_operator

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).to(f64).eval()
    op = as_operator(mha)
    X = rand(6, 8, seed=3)
    p = Jacobian(lambda Y: op.points_map(Y), X.unsqueeze(0))
    u = rand(1, 6, 8, seed=4)
    Ju = p._jvp(u)
    assert p._MODES[p.mode] == "rr-math"
    with sdpa_kernel([SDPBackend.MATH]):
        J = dense_jacobian(op.sequence, X)
    assert torch.allclose(Ju.reshape(-1), J @ u.reshape(-1), rtol=1e-12, atol=1e-13)
    est = local_lipschitz(op, X, tol=1e-10)
    assert rel(est.value, float(torch.linalg.matrix_norm(J, ord=2))) <= 1e-8
