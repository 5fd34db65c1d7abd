"""numpy scalars are accepted wherever particles takes a Python number, with the same results."""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_log_weight_clamp_matters_against_the_values_it_merges(dtype):
    """Whether the kernels' clamp of log-weights at zero_mass_log_weight changes a result, against its definition
    written out on Python numbers: among the values below the floor (zero masses, -inf, included) two differ, so a
    positive mass is tied with another or with a zero mass. Random arrays mixing -inf, NaN, +inf, ordinary values and
    repeated or distinct tiny ones, in a (batch, n) shape too."""
    from particles.validation import log_weight_clamp_matters, zero_mass_log_weight

    low = zero_mass_log_weight(dtype)
    rng = np.random.default_rng(3)
    pool = [-math.inf, math.nan, math.inf, 0.0, -3.0, 2.0 * low, 4.0 * low, 1.5 * low]
    pool = [float(torch.tensor(x, dtype=dtype)) for x in pool]   # as the dtype holds them
    seen = set()
    for _ in range(400):
        shape = (int(rng.integers(1, 7)),) if rng.random() < 0.7 else (2, int(rng.integers(1, 4)))
        values = rng.choice(pool, size=shape)
        below = {x for x in values.ravel().tolist() if x < low}   # NaN and +inf compare False
        truth = len(below) > 1
        got = log_weight_clamp_matters(torch.tensor(values, dtype=dtype))
        assert got.dim() == 0 and bool(got) == truth, (values, dtype)
        seen.add(truth)
    assert seen == {True, False}
    for empty in (torch.zeros(0), torch.zeros(2, 0, dtype=torch.float64)):   # raised in amin before
        got = log_weight_clamp_matters(empty)
        assert got.dim() == 0 and not bool(got)
    assert log_weight_clamp_matters(torch.zeros(3, dtype=torch.float16)) is None
    assert log_weight_clamp_matters(torch.zeros(3, dtype=torch.int64)) is None
