"""numpy scalars are accepted wherever particles takes a Python number, with the same results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from particles import Measure


def test_constructors_take_numpy_scalars():
    for make in (Measure.sphere, Measure.ball):
        a = make(np.int64(5), np.int32(3), radius=np.float32(2.0), seed=np.int64(0))
        b = make(5, 3, radius=float(np.float32(2.0)), seed=0)
        assert torch.equal(a.points, b.points)
    a = Measure.gaussian(np.int64(4), np.zeros(2), seed=np.int32(1))
    assert torch.equal(a.points, Measure.gaussian(4, np.zeros(2), seed=1).points)
    two = Measure.two_dirac([0.0, 1.0], [1.0, 0.0], np.float32(0.25))
    assert float(two.weights[0]) == 0.25
    two = Measure.two_dirac([0.0, 1.0], [1.0, 0.0], log_p=np.float64(-3.0))
    assert float(two.log_weights[0]) == -3.0
    assert Measure.sphere(3, 2, seed=0).to(dtype=np.float32).dtype == torch.float32


def test_operations_take_numpy_scalars():
    mu = Measure.sequence(torch.tensor([[0.0, 0.0], [0.0, 1e-9], [1.0, 1.0], [2.0, 0.0]], dtype=torch.float64))
    s = mu.split(np.int64(2), np.float32(0.25))
    torch.testing.assert_close(s.weights, torch.tensor([0.25, 0.25, 0.0625, 0.1875, 0.25], dtype=torch.float64))
    assert Measure(mu.points).merge(np.float32(1e-6)).n == 3
    assert mu.at_position(np.float64(0.5)).n == 1
    assert mu.up_to(np.float32(0.5)).n == 2
    pos, mass = mu.position_marginal(np.float32(0.1))
    assert pos.tolist() == [0.25, 0.5, 0.75, 1.0] and mass.tolist() == [0.25] * 4
    pos, mass = mu.position_marginal(np.float32(0.3))  # gaps of 0.25 chain every position into one
    assert pos.tolist() == [0.25] and mass.tolist() == [1.0]


def test_memory_sizes_beyond_the_float_range_are_a_clear_error():
    from particles.validation import parse_bytes

    with pytest.raises(ValueError, match="memory_limit: expected a positive size"):
        parse_bytes(10**400)
    assert parse_bytes("2G") == 2 * 2**30 and parse_bytes(np.int64(4096)) == 4096
