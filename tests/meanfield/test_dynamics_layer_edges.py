"""simulate with a list of layers and output times on the layer boundaries: the float64 boundaries and the times
rounded to their dtype (float32 1/3 = 0.33333334, float64 linspace's 0.30000000000000004) are one time, so no
sliver piece is stepped (fixed steps) or handed to torchdiffeq as a repeated time (adaptive)."""

from __future__ import annotations

import pytest
import torch
import torchdiffeq

from meanfield import SelfAttention, simulate
from particles import Measure
from tests.reference import naive_attention

pytestmark = pytest.mark.usefixtures("one_thread")   # a few particles: BLAS threads would only spin


def _layers(L, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(0.5 * torch.randn(2, 2, generator=g, dtype=torch.float64).to(dtype),
             0.5 * torch.randn(2, 2, generator=g, dtype=torch.float64).to(dtype)) for _ in range(L)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_euler_one_step_per_layer_on_the_boundaries_is_L_residual_layers(dtype):
    L = 10
    AV = _layers(L, dtype)
    X = torch.randn(6, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    tr = simulate([SelfAttention(A, V) for A, V in AV], Measure(X), torch.linspace(0, 1, L + 1, dtype=dtype),
                  method="euler", options={"steps": 1})
    # one step per layer, one evaluation per step: nothing spent on slivers between a time and its boundary
    assert tr.steps == L and tr.nfev == L
    # the residual layers written out: x <- x + (1/L) V softmax(<A x_i, x_j>) x_j, kept at every layer
    Y, tol = X.clone(), (1e-13 if dtype == torch.float64 else 1e-5)
    assert torch.allclose(tr.points[0], Y, atol=tol, rtol=0)
    for k, (A, V) in enumerate(AV, start=1):
        Y = Y + (1.0 / L) * naive_attention(Y, A, V)
        assert torch.allclose(tr.points[k], Y, atol=tol, rtol=0), k


def _closed_form_uniform_layers(X, Vs, T):
    """A = 0: softmax weights 1/N, so x_i' = V xbar and xbar' = V xbar. Over a layer of length h with value V:
    xbar -> exp(hV) xbar and x_i -> x_i + (exp(hV) - I) xbar; the points at the end of every layer."""
    h = T / len(Vs)
    Y, out = X.clone(), [X.clone()]
    for V in Vs:
        xbar = Y.mean(dim=0)
        Y = Y + (torch.linalg.matrix_exp(h * V) - torch.eye(V.shape[0], dtype=V.dtype)) @ xbar
        out.append(Y.clone())
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adaptive_solver_with_float32_times_on_the_layer_boundaries(dtype):
    """Three layers, times [0, 1/3, 2/3, 1] in float32 used to stop with 't must be strictly increasing' labelled
    as non-convergence; now the points at the boundaries are the closed form's."""
    Vs = [V.double() for _, V in _layers(3, torch.float64, seed=4)]
    X = torch.randn(5, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    truth = _closed_form_uniform_layers(X, Vs, 1.0)
    ops = [SelfAttention(torch.zeros(2, 2, dtype=dtype), V.to(dtype)) for V in Vs]
    # float32: the default tolerances; float64: tight ones, to compare at 1e-8
    kw, tol = ({}, 1e-5) if dtype == torch.float32 else ({"rtol": 1e-10, "atol": 1e-12}, 1e-8)
    tr = simulate(ops, Measure(X.to(dtype)), torch.tensor([0.0, 1 / 3, 2 / 3, 1.0], dtype=dtype), method="dopri5",
                  **kw)
    assert tr.points.shape == (4, 5, 2)
    assert torch.allclose(tr.points.double(), truth, atol=tol, rtol=0)
    # the same points with output times inside the layers as well (the boundary pieces split, not repeated)
    tr = simulate(ops, Measure(X.to(dtype)), torch.tensor([0.0, 0.2, 1 / 3, 0.5, 2 / 3, 1.0], dtype=dtype),
                  method="dopri5", **kw)
    assert torch.allclose(tr.points[[0, 2, 4, 5]].double(), truth, atol=tol, rtol=0)


def test_an_input_assertion_of_torchdiffeq_is_not_called_non_convergence(monkeypatch):
    """Only torchdiffeq's step-count, step-underflow and non-finite-state assertions mean 'did not converge'."""
    op = SelfAttention(torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    mu = Measure(torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64))

    def refuses(*args, **kwargs):
        raise AssertionError("t must be strictly increasing or decreasing")

    monkeypatch.setattr(torchdiffeq, "odeint", refuses)
    with pytest.raises(AssertionError, match="strictly increasing") as exc:
        simulate(op, mu, [0.0, 1.0], method="dopri5")
    assert "did not converge" not in str(exc.value)

    def gives_up(*args, **kwargs):
        raise AssertionError("max_num_steps exceeded (2>=2)")

    monkeypatch.setattr(torchdiffeq, "odeint", gives_up)
    with pytest.raises(RuntimeError, match="did not converge"):
        simulate(op, mu, [0.0, 1.0], method="dopri5")


def test_a_time_goes_only_to_its_own_nearest_edge():
    """Snapping is bounded by the layer spacing and picks the nearest edge: a span far from 0 in float32, or a
    coarse dtype with many layers, leaves a time on an edge (or between edges) where it is."""
    from meanfield.integrators import snap_to_edges

    edges = [1e6 + k / 10 for k in range(1, 10)]
    assert snap_to_edges([1e6, 1e6 + 0.5, 1e6 + 1], edges, torch.float32) == [1e6, 1e6 + 0.5, 1e6 + 1]
    for dtype, L in ((torch.bfloat16, 40), (torch.float16, 400)):
        edges = [k / L for k in range(1, L)]
        assert snap_to_edges([0.0, 0.5, 1.0], edges, dtype) == [0.0, 0.5, 1.0]
    # float32 1/3 goes onto the float64 edge 1/3, and the nearest of two candidates wins
    third, two = (float(torch.tensor(x, dtype=torch.float32)) for x in (1 / 3, 2 / 3))
    assert third != 1 / 3 and two != 2 / 3
    assert snap_to_edges([0.0, third, two, 1.0], [1 / 3, 2 / 3], torch.float32) == [0.0, 1 / 3, 2 / 3, 1.0]
    assert snap_to_edges([0.0, 0.5 - 2e-8, 0.5 + 1e-8, 1.0], [0.5], torch.float32) == [0.0, 0.5 - 2e-8, 0.5, 1.0]


def test_the_half_point_of_a_span_far_from_zero_is_the_closed_form():
    """float32 on [1e6, 1e6 + 1] with 10 layers (A = 0): the point reported at 1e6 + 0.5 is the state there."""
    Vs = [V.double() for _, V in _layers(10, torch.float64, seed=6)]
    X = torch.randn(5, 2, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    truth = _closed_form_uniform_layers(X, Vs, 1.0)
    ops = [SelfAttention(torch.zeros(2, 2), V.float()) for V in Vs]
    times = torch.tensor([1e6, 1e6 + 0.5, 1e6 + 1], dtype=torch.float32)
    tr = simulate(ops, Measure(X.float()), times, method="rk4", options={"steps": 20})
    assert torch.allclose(tr.points[1].double(), truth[5], atol=1e-4, rtol=0)
    assert torch.allclose(tr.points[2].double(), truth[10], atol=1e-4, rtol=0)


def test_boundaries_that_the_dtype_cannot_tell_apart_are_a_clear_error():
    """float32 on [1e6, 1e6 + 1] with 20 layers: the layers are 0.05 long, finer than float32's 0.06 there; the
    adaptive solver would get a repeated time (torchdiffeq's bare assertion): a ValueError names the dtype."""
    ops = [SelfAttention(torch.zeros(2, 2), torch.eye(2)) for _ in range(20)]
    X = torch.randn(4, 2, generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="not distinct in torch.float32"):
        simulate(ops, Measure(X), torch.tensor([1e6, 1e6 + 1], dtype=torch.float32), method="dopri5")
