"""Fixes of a user review: torch MultiheadAttention in training mode without dropout, the streaming
solver's max_iter under on_failure="warn", the function named by transport messages, the streaming
gradient with debias=False, the advice of a missed tol, progress of long solves, numpy scalars in
archive metadata."""

from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import pytest
import torch

import transport
from meanfield import as_operator, local_lipschitz
from particles import Measure, load_measure, progress, save_measure
from particles.io import read_header
from particles.validation import ConvergenceError
from transport import solve, symmetric_potential, w2

F64 = torch.float64


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ---------------------------------------------------------------------- 1. nn.MultiheadAttention in train mode
def test_multihead_attention_in_train_mode_without_dropout_is_accepted_and_is_the_eval_map():
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(8, 2).double()   # dropout = 0.0, training = True
    X = randn(4, 8)
    got = local_lipschitz(m, X).value
    op = as_operator(m)
    out_train = op.sequence(X)
    m.eval()
    # the same map (torch may take its fused path in eval mode: equal to rounding)
    torch.testing.assert_close(out_train, as_operator(m).sequence(X), rtol=1e-13, atol=1e-14)
    assert got == pytest.approx(local_lipschitz(m, X).value, rel=1e-12)


def test_multihead_attention_with_dropout_in_train_mode_is_refused_naming_dropout():
    m = torch.nn.MultiheadAttention(8, 2, dropout=0.1).double()
    with pytest.raises(ValueError, match=r"module: is in training mode with dropout = 0\.1.*module\.eval\(\)"):
        as_operator(m)
    # wrapped in eval mode, then put back in training mode: refused when evaluated (the mode is read at every call)
    op = as_operator(m.eval())
    op.sequence(randn(4, 8))
    m.train()
    with pytest.raises(ValueError, match="training mode with dropout"):
        op.sequence(randn(4, 8))


def test_multihead_attention_kdim_is_reported_before_the_training_mode():
    m = torch.nn.MultiheadAttention(8, 2, dropout=0.1, kdim=4, vdim=4).double()   # training, dropout > 0
    with pytest.raises(ValueError, match="module: kdim = 4, vdim = 4 differ from embed_dim = 8"):
        as_operator(m)


# ---------------------------------------------------------------------- 2. streaming max_iter below the annealing
@pytest.fixture
def far_pair():
    # squared diameter / reg ~ 3e3: 6 annealing levels at scaling 0.5
    return Measure(randn(40, 3, seed=1)), Measure(randn(40, 3, seed=2) + 1.0)


def _levels(mu, nu, reg):
    """Levels above reg of the annealing at scaling 0.5 (the clouds are centred, not rescaled: k = 0)."""
    both = torch.cat([mu.points, nu.points])
    e, count = float(((both.max(0).values - both.min(0).values) ** 2).sum()), 0
    while e > reg:
        e, count = e * 0.25, count + 1
    return count


@pytest.mark.timeout(60)
def test_streaming_max_iter_below_the_annealing_warns_and_returns_a_result_within_max_iter(far_pair):
    mu, nu = far_pair
    need = _levels(mu, nu, 0.01) + 1
    assert need > 5
    with pytest.warns(RuntimeWarning) as record:
        res = solve(mu, nu, "streaming", reg=0.01, max_iter=5, on_failure="warn")
    assert not res.converged and res.iterations <= 5 and np.isfinite(float(res.value))
    msg = str(record[0].message)
    assert msg.startswith("solve (streaming): did not converge")
    assert "max_iter = 5" in msg and f"the smallest max_iter that runs it is {need}" in msg
    # the same through w2, debias=False and max_iter = 1 (no annealing level at all)
    with pytest.warns(RuntimeWarning, match="w2 \\(streaming\\): did not converge.*max_iter = 1"):
        value = w2(mu, nu, "streaming", reg=0.01, max_iter=1, debias=False, on_failure="warn")
    assert np.isfinite(value)


@pytest.mark.timeout(60)
def test_streaming_max_iter_below_the_annealing_raises_naming_the_smallest_max_iter(far_pair):
    mu, nu = far_pair
    need = _levels(mu, nu, 0.01) + 1
    with pytest.raises(ValueError, match=f"max_iter = {need - 1} levels.*the smallest max_iter that runs it is "
                                         f"{need}.*on_failure='warn'"):
        solve(mu, nu, "streaming", reg=0.01, max_iter=need - 1)
    # that value is accepted: the annealing runs whole, and the solve fails only on tol
    with pytest.raises(ConvergenceError, match="did not converge in"):
        solve(mu, nu, "streaming", reg=0.01, max_iter=need)


@pytest.mark.timeout(60)
def test_symmetric_potential_max_iter_below_the_annealing_warns(far_pair):
    mu = far_pair[0]
    with pytest.warns(RuntimeWarning, match="symmetric_potential: did not converge.*max_iter = 2"):
        f, err, it = symmetric_potential(mu, 1e-3, max_iter=2, on_failure="warn")
    assert it <= 2 and torch.isfinite(f).all()


# ---------------------------------------------------------------------- 3. messages name the function called
@pytest.mark.timeout(60)
def test_failures_name_the_function_called(far_pair):
    mu, nu = far_pair
    for method in ("streaming", "sinkhorn"):
        with pytest.warns(RuntimeWarning, match=f"^solve \\({method}\\): did not converge"):
            solve(mu, nu, method, reg=0.01, max_iter=20, on_failure="warn")
        with pytest.raises(ConvergenceError, match=f"^w2 \\({method}\\): did not converge"):
            w2(mu, nu, method, reg=0.01, max_iter=20)
    with pytest.raises(transport.MemoryLimitError, match="solve \\(sinkhorn\\) between 40 and 40 atoms"):
        solve(mu, nu, "sinkhorn", reg=0.01, memory_limit=1000)


# ---------------------------------------------------------------------- 4. streaming gradients with debias=False
def test_streaming_debias_false_with_grad_says_what_works_and_the_docstring_says_so():
    X = randn(10, 2).requires_grad_()
    with pytest.raises(ValueError, match="debias: .*use debias=True.*method='sinkhorn'"):
        w2(Measure(X), Measure(randn(10, 2, seed=1)), "streaming", reg=0.5, debias=False)
    assert "whatever the options" not in w2.__doc__
    assert 'method="streaming"' in w2.__doc__ and "debias=False" in w2.__doc__
    # what the message offers works
    for method, debias in (("streaming", True), ("sinkhorn", False)):
        value = w2(Measure(X), Measure(randn(10, 2, seed=1)), method, reg=0.5, debias=debias)
        (grad,) = torch.autograd.grad(value, X)
        assert torch.isfinite(grad).all()


# ---------------------------------------------------------------------- 5. advice on tol; progress of long solves
def test_a_missed_tol_suggests_loosening_it_with_the_value_used():
    mu, nu = Measure(randn(30, 2, seed=1)), Measure(randn(30, 2, seed=2) + 1)
    with pytest.raises(ConvergenceError, match=r"Increase max_iter \(it was 30\) or reg, or loosen tol \(it was "
                                               r"1e-07\)"):
        w2(mu, nu, "sinkhorn", reg=0.05, max_iter=30)
    with pytest.raises(ConvergenceError, match=r"loosen tol"):
        symmetric_potential(mu, 1e-3, max_iter=2, scaling=0, tol=1e-13)


@pytest.mark.timeout(120)
def test_dense_sinkhorn_logs_progress_and_its_rounds_are_one_uninterrupted_run(monkeypatch, caplog):
    import ot

    X = randn(30, 2, seed=1).requires_grad_()
    nu = Measure(randn(30, 2, seed=2) + 1)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = solve(Measure(X), nu, "sinkhorn", reg=0.05, debias=False, max_iter=95, on_failure="warn")
        return res, torch.autograd.grad(res.value, X)[0]

    whole, grad_whole = run()
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)   # a round of 10 iterations, and a line, each time
    calls = []
    real = ot.sinkhorn
    monkeypatch.setattr(ot, "sinkhorn", lambda *a, **k: calls.append(k["numItermax"]) or real(*a, **k))
    with caplog.at_level(logging.INFO, logger="transport"):
        rounds, grad_rounds = run()
    assert calls == [10] * 9 + [5]
    lines = [r.getMessage() for r in caplog.records if r.name == "transport.sinkhorn"]
    assert len(lines) == 9 and lines[0].startswith("solve (sinkhorn), 30 x 30 atoms: 10 of at most 95 iterations")
    assert rounds.iterations == whole.iterations == 95 and rounds.error == whole.error
    assert torch.equal(rounds.value, whole.value)
    # the same gradient, but summed over one node of -C / reg per round: equal to rounding
    torch.testing.assert_close(grad_rounds, grad_whole, rtol=1e-12, atol=1e-15)
    assert all(torch.equal(p, q) for p, q in zip(rounds.potentials, whole.potentials))


@pytest.mark.timeout(60)
def test_streaming_sinkhorn_logs_progress_of_long_solves_only(monkeypatch, caplog, far_pair):
    with caplog.at_level(logging.INFO, logger="transport"):   # a short solve says nothing
        solve(*far_pair, "streaming", reg=0.05, tol=1e-4)
        solve(*far_pair, "sinkhorn", reg=0.05, tol=1e-4)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="transport"):
        solve(*far_pair, "streaming", reg=0.05, tol=1e-4)
    lines = [r.getMessage() for r in caplog.records if r.name == "transport.streaming_sinkhorn"]
    assert any(line.startswith("streaming Sinkhorn, 40 x 40 atoms: ") and "marginal L1 error" in line
               for line in lines)
    assert any(line.startswith("streaming Sinkhorn, self problem of 40 atoms: ") for line in lines)


# ---------------------------------------------------------------------- 6. numpy scalars in metadata
def test_metadata_accepts_numpy_scalars_as_python_numbers(tmp_path):
    mu = Measure(randn(3, 2))
    meta = {"R": np.float64(2.0), "n": np.int64(3), "f": np.float32(0.1), "u": np.uint8(7), "b": np.bool_(True),
            "nested": [np.int32(-1), {"h": np.float16(0.5)}]}
    save_measure(mu, tmp_path / "m.npz", metadata=meta)
    got = read_header(tmp_path / "m.npz")["metadata"]
    assert got == {"R": 2.0, "n": 3, "f": float(np.float32(0.1)), "u": 7, "b": True, "nested": [-1, {"h": 0.5}]}
    assert type(got["n"]) is int and type(got["b"]) is bool and type(got["f"]) is float
    assert torch.equal(load_measure(tmp_path / "m.npz").points, mu.points)


@pytest.mark.parametrize("value", [np.complex128(1j), np.datetime64("2020-01-01"), np.array([1.0]),
                                   torch.tensor(1.0)])
def test_metadata_still_refuses_what_does_not_round_trip(tmp_path, value):
    with pytest.raises(TypeError, match=f"metadata: must be JSON-serializable.*{type(value).__name__}.*; convert "
                                        "other values first"):
        save_measure(Measure(randn(3, 2)), tmp_path / "m.npz", metadata={"x": value})


def test_streaming_refuses_weights_that_require_grad():
    """The streaming path's gradient is the envelope formula in the points: weights that require grad got no
    gradient, silently. They are refused by name; the dense Sinkhorn differentiates them (its gradient against
    central finite differences)."""
    import torch

    from particles import Measure
    from transport import w2

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, generator=g, dtype=torch.float64)
    y = torch.randn(9, 2, generator=g, dtype=torch.float64)
    z = torch.zeros(12, dtype=torch.float64, requires_grad=True)
    mu = lambda z: Measure(x, log_weights=torch.log_softmax(z, 0))
    with pytest.raises(ValueError, match=r"^mu, nu: weights that require grad"):
        w2(mu(z), Measure(y), "streaming", reg=0.5)
    value = w2(mu(z), Measure(y), "sinkhorn", reg=0.5, debias=True, tol=1e-12)
    (grad,) = torch.autograd.grad(value, z)
    e, h = torch.zeros(12, dtype=torch.float64), 1e-5
    e[3] = h
    fd = (w2(mu(z.detach() + e), Measure(y), "sinkhorn", reg=0.5, debias=True, tol=1e-12)
          - w2(mu(z.detach() - e), Measure(y), "sinkhorn", reg=0.5, debias=True, tol=1e-12)) / (2 * h)
    assert float(grad[3]) == pytest.approx(float(fd), rel=1e-5, abs=1e-9)


def test_graph_inputs_that_would_lose_their_gradient_are_refused():
    """symmetric_potential and Measure.two_dirac computed without the inputs' graph: a gradient through them was
    silently missing (a gradient review). Both refuse such inputs by name; detached inputs work as before."""
    import torch

    from particles import Measure
    from transport import symmetric_potential

    x = torch.randn(20, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"^mu: points or weights that require grad"):
        symmetric_potential(Measure(x.clone().requires_grad_(True)), 0.5)
    f, err, _ = symmetric_potential(Measure(x), 0.5)
    assert f.shape == (20,) and err <= 1e-6
    lp = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"^log_p: a tensor that requires grad"):
        Measure.two_dirac(torch.zeros(2), torch.ones(2), log_p=lp)
    two = Measure.two_dirac(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), log_p=-1.0)
    assert float(two.weights[0]) == pytest.approx(math.exp(-1.0), rel=1e-15)
