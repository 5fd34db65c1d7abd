"""An API review across the four packages (a researcher scripting experiments): what it found inconsistent, fixed.
Each test failed on the code before (checked by stashing the changed sources)."""

import numpy as np
import pytest
import torch

from meanfield import (
    L2SelfAttention,
    MultiHeadAttention,
    SelfAttention,
    as_operator,
    clustering,
    local_lipschitz,
    simulate,
)
from meanfield.splitting import split_lipschitz
from particles import Measure
from particles.validation import ConvergenceError


def _op(d=2, seed=0, masked=False):
    g = np.random.default_rng(seed)
    return SelfAttention(g.standard_normal((d, d)) * 0.7, g.standard_normal((d, d)), masked=masked)


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_a_generator_seeds_every_method(method):
    """check_seed let a torch.Generator through (its error even suggests one), and Lanczos and power iteration
    then failed on `seed + 1` with a TypeError that named no argument."""
    op, mu = _op(), Measure.sphere(6, 2, seed=0)
    g = torch.Generator().manual_seed(1)
    a = local_lipschitz(op, mu, method, seed=g)
    b = local_lipschitz(op, mu, method, seed=torch.Generator().manual_seed(1))
    assert a.converged and a.value == b.value
    dense = local_lipschitz(op, mu, "dense").value
    assert a.value == pytest.approx(dense, rel=1e-5)
    assert not torch.equal(g.get_state(), torch.Generator().manual_seed(1).get_state())   # advanced


def test_simulate_says_it_did_not_converge_as_the_estimators_do():
    """An adaptive solver out of its step budget raised a plain RuntimeError: `except ConvergenceError` missed it."""
    op, mu = _op(), Measure.sphere(8, 2, 1.0, seed=0)
    with pytest.raises(ConvergenceError, match="did not converge"):
        simulate(op, mu, [0, 5], "dopri5", options={"max_steps": 2})


def test_split_lipschitz_passes_the_estimators_budget_and_says_when_it_missed_tol():
    """split_lipschitz took tol and seed only, and kept an unconverged estimate without a word."""
    op, mu = _op(d=3), Measure.sphere(12, 3, 1.0, seed=0)
    with pytest.raises(ConvergenceError):
        split_lipschitz(op, mu, max_iter=2, on_failure="raise")
    with pytest.warns(RuntimeWarning):
        s = split_lipschitz(op, mu, max_iter=2)
    assert not s.unsplit.converged
    dense = split_lipschitz(op, mu, method="dense")
    assert dense.unsplit.value == pytest.approx(local_lipschitz(op, mu, "dense").value, rel=1e-12)


def test_a_tensor_of_tokens_is_a_causal_sequence_for_a_masked_simulation():
    """local_lipschitz read a tensor through a masked operator as Measure.sequence(X); simulate refused it."""
    op = _op(masked=True)
    X = torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = simulate(op, X, [0, 1])
    b = simulate(op, Measure.sequence(X), [0, 1])
    assert torch.equal(a.points, b.points)
    assert torch.equal(a[0].positions, Measure.sequence(X).positions)
    # every layer masked, or the tensor stays the empirical measure (a masked layer then asks for positions)
    with pytest.raises(ValueError, match="Measure.sequence"):
        simulate([op, _op()], X, [0, 1])


def test_splitting_says_to_wrap_tensors_as_measures():
    with pytest.raises(TypeError, match=r"Measure\.empirical\(X\)"):
        split_lipschitz(_op(), torch.randn(4, 2, dtype=torch.float64))


def test_to_takes_a_dtype_in_the_first_place_as_torch_does():
    """op.to(torch.float32) leaked torch's 'invalid combination of arguments'; Measure.to(torch.float32) refused."""
    g = np.random.default_rng(0)
    ops = [_op(), MultiHeadAttention([_op(), _op(seed=1)], W_O=np.eye(2, 4)), L2SelfAttention(g.standard_normal((2, 2)),
                                                                             g.standard_normal((2, 2))),
           as_operator(torch.nn.MultiheadAttention(4, 2).double())]
    for op in ops:
        assert op.to(torch.float32).dtype == torch.float32, op
    mu = Measure.sphere(4, 2, seed=0)
    assert mu.to(torch.float32).dtype == torch.float32
    assert torch.equal(mu.to(torch.float32).points, mu.points.float())
    with pytest.raises(TypeError, match="dtype: given twice"):
        mu.to(torch.float32, dtype=torch.float64)
    head = _op().parameters().heads[0]
    assert head.to(torch.float32).A.dtype == torch.float32


def test_a_module_of_another_dtype_names_the_input():
    """A float32 nn.Module given float64 points failed inside torch's matmul (numpy input is float64 by default)."""
    lin = torch.nn.Linear(2, 2)
    X = np.random.default_rng(0).standard_normal((4, 2))
    for given in (X, torch.tensor(X), X.tolist()):
        with pytest.raises(TypeError, match=r"X: dtype torch.float64 differs from the parameters of Linear "
                                            r"\(torch.float32\); convert the input .*X\.astype\(np\.float32\)"):
            local_lipschitz(lin, given)
    # what the error suggests runs; the constant of a linear map is its spectral norm
    W = float(torch.linalg.matrix_norm(lin.weight.detach(), ord=2))
    assert local_lipschitz(lin, X.astype(np.float32)).value == pytest.approx(W, rel=1e-3)
    op = as_operator(lin)
    lin.double()   # converted after wrapping: the operator calls the module as it is now
    assert local_lipschitz(op, X).value == pytest.approx(W, rel=1e-6)


def test_a_module_that_casts_to_its_input_takes_any_float_dtype():
    """A review of the first fix: pinning a wrapped module's dtype at wrap time refused such modules."""
    class Cast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W = torch.nn.Parameter(torch.tensor([[2.0, 0.0], [0.0, 0.5]]))

        def forward(self, x):
            return x @ self.W.to(x.dtype)

    X = np.random.default_rng(0).standard_normal((4, 2))
    assert local_lipschitz(Cast(), X).value == pytest.approx(2.0, rel=1e-9)


def test_w2_to_reference_names_what_it_needs():
    mu = Measure.sphere(3, 2, seed=0)
    traj = simulate(_op(), mu, [0, 1])
    with pytest.raises(TypeError, match="reference: expected a Trajectory"):
        clustering.w2_to_reference(traj, mu)
