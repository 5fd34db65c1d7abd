"""A measure owns its data: arrays the caller keeps changing do not change it (a new user's review), and bad
inputs of the constructor, samplers and loaders are errors naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from particles import Measure, load_measure, save_measure
from transport import w2


def test_a_measure_built_in_a_loop_keeps_each_state():
    # the classic particle loop: one measure per time, the array then moved in place
    Y = np.random.default_rng(0).standard_normal((5, 2))
    start = Y.mean(axis=0).copy()
    hist = []
    for _ in range(3):
        hist.append(Measure(Y))
        Y += 1.0
    for k, mu in enumerate(hist):
        np.testing.assert_allclose(mu.mean().numpy(), start + k, rtol=0, atol=1e-14)


@pytest.mark.parametrize("how", ["numpy", "torch"])
def test_weights_changed_in_place_after_the_measure_leave_it_consistent(how):
    X = np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    w = np.array([0.5, 0.3, 0.2])
    s = np.array([0.1, 0.5, 0.9])
    if how == "torch":
        X, w, s = (torch.tensor(a, dtype=torch.float64) for a in (X, w, s))
    mu = Measure(X, w, s)
    nu = Measure(X.copy() if how == "numpy" else X.clone(), w.copy() if how == "numpy" else w.clone())
    w[0], X[0, 0], s[0] = 0.9, 7.0, 0.95
    assert mu.weights.tolist() == [0.5, 0.3, 0.2]
    torch.testing.assert_close(mu.log_weights.exp(), mu.weights, rtol=1e-15, atol=0)
    assert mu.points[0].tolist() == [1.0, 1.0] and mu.positions[0].item() == pytest.approx(0.1)
    assert float(w2(mu.unmasked(), nu)) == pytest.approx(0.0, abs=1e-7)    # POT's sum check passes


def test_log_weights_and_with_points_are_copied_too():
    lw = torch.log(torch.tensor([0.25, 0.75], dtype=torch.float64))
    mu = Measure(torch.zeros(2, 1, dtype=torch.float64), log_weights=lw)
    lw[0] = 0.0
    assert mu.log_weights[0].item() == pytest.approx(np.log(0.25))
    Z = np.ones((2, 1))
    nu = mu.with_points(Z)
    Z[:] = 3.0
    assert nu.points.tolist() == [[1.0], [1.0]]


def test_a_copy_keeps_the_gradient_flowing_to_the_callers_tensor():
    X = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    mu = Measure(X)
    assert mu.points is not X
    (mu.points ** 2).sum().backward()
    torch.testing.assert_close(X.grad, 2 * X.detach())


def test_a_reversed_numpy_view_is_taken():
    X = np.arange(12.0).reshape(4, 3)
    mu = Measure(X[::-1], np.array([0.1, 0.2, 0.3, 0.4])[::-1])
    assert mu.points[0].tolist() == [9.0, 10.0, 11.0] and mu.weights[0].item() == pytest.approx(0.4)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="points: expected a rectangular"):
        Measure([[1.0, 2.0], [3.0]])
    with pytest.raises(TypeError, match="fn: expected a function"):
        Measure(torch.zeros(2, 2)).pushforward(3)
    with pytest.raises(ValueError, match="x0: expected a vector"):
        Measure.two_dirac([[0.0, 0.0]], [[1.0, 1.0]], 0.5)
    with pytest.raises(ValueError, match="x0, x1: expected two vectors of the same length, got 2 and 3"):
        Measure.two_dirac([0.0, 0.0], [1.0, 1.0, 1.0], 0.5)
    for make in (lambda: Measure(torch.zeros(3, 2), device="meta"), lambda: Measure.sphere(4, 3, device="meta")):
        with pytest.raises(ValueError, match="device: the meta device"):
            make()
    with pytest.raises(ValueError, match="points: a tensor on the meta device"):
        Measure(torch.zeros(3, 2, device="meta"))


@pytest.mark.parametrize("make", [lambda d: Measure.sphere(4, 3, device=d), lambda d: Measure.ball(4, 3, device=d),
                                  lambda d: Measure.gaussian(4, [0.0, 0.0], device=d)])
def test_samplers_check_their_device(make):
    with pytest.raises(TypeError, match="device: expected a torch device"):
        make("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda' was asked for"):
            make("cuda")


def test_two_dirac_takes_the_wider_dtype_of_its_atoms():
    x1 = torch.tensor([1 + 1e-12, 0.0], dtype=torch.float64)
    mu = Measure.two_dirac(torch.zeros(2, dtype=torch.float32), x1, 0.5)
    assert mu.dtype == torch.float64 and mu.points[1, 0].item() == 1 + 1e-12


def test_loading_a_folder_or_onto_meta_says_so(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a folder"):
        load_measure(tmp_path)
    path = save_measure(Measure.sphere(3, 2, seed=0), tmp_path / "mu.npz")
    with pytest.raises(ValueError, match="device: the meta device"):
        load_measure(path, device="meta")


def test_a_header_of_bytes_is_named_as_the_header(tmp_path):
    import particles.io as pio
    from particles.io import FileFormatError

    path = save_measure(Measure.sphere(3, 2, seed=0), tmp_path / "mu.npz")
    arrays = dict(np.load(path))
    arrays[pio._HEADER] = np.bytes_(b"abc")
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(FileFormatError, match="the 'header' entry is not a JSON text"):
        load_measure(tmp_path / "bad.npz")


def test_bfloat16_measures_from_numpy_arrays():
    """A tensor in a dtype numpy has no counterpart of cannot share a numpy array's memory: the check of that raised
    numpy's TypeError for bfloat16 (a review of the copying change)."""
    X, w = np.random.default_rng(0).random((4, 2)), np.full(4, 0.25)
    for mu in (Measure(X, dtype=torch.bfloat16), Measure(torch.tensor(X).bfloat16(), w),
               Measure(torch.tensor(X).bfloat16(), log_weights=np.log(w))):
        assert mu.dtype == torch.bfloat16 and mu.n == 4
    assert Measure(X, dtype=torch.bfloat16).with_points(X).dtype == torch.bfloat16
