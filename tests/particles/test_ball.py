"""particles.into_ball: every row's computed norm <= R, exactly, in the row's own dtype (the truth is torch's
own norm, which is what a user's check computes); rows inside are untouched, identical rows stay identical."""

from __future__ import annotations

import pytest
import torch

from particles import into_ball


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("R", [1e-3, 1.0, 3.0, 100.0])
def test_rows_on_the_sphere_are_put_inside_exactly(dtype, R):
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(4000, 5, generator=g, dtype=dtype)
    X = R * Z / Z.norm(dim=1, keepdim=True)
    assert bool((X.norm(dim=1) > R).any())      # the problem is real: R u is often a rounding outside
    Y = into_ball(X, R)
    assert bool((Y.norm(dim=1) <= R).all())
    # moved by a few units in the last place at most
    assert float((Y - X).abs().max()) <= 16 * torch.finfo(dtype).eps * R


def test_rows_inside_are_unchanged_and_outside_rows_are_projected_radially():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(200, 3, generator=g, dtype=torch.float64)
    Y = into_ball(X, 1.0)
    inside = X.norm(dim=1) <= 1.0
    assert torch.equal(Y[inside], X[inside])
    out = ~inside
    direction = X[out] / X[out].norm(dim=1, keepdim=True)
    torch.testing.assert_close(Y[out], direction, rtol=0, atol=1e-14)
    assert bool((Y.norm(dim=1) <= 1.0).all())


def test_identical_rows_stay_identical_and_batches_work():
    u = torch.tensor([0.6, 0.8, 0.0], dtype=torch.float64) * (1 + 1e-15)
    X = torch.stack([3 * u] * 5).expand(2, 5, 3)
    Y = into_ball(X, 3.0)
    assert Y.shape == (2, 5, 3) and bool((Y == Y[0, 0]).all()) and bool((Y.norm(dim=-1) <= 3.0).all())


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="X"):
        into_ball(torch.ones(2, 2, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="R"):
        into_ball(torch.ones(2, 2), -1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampled_spheres_and_balls_are_in_the_closed_ball(dtype):
    from particles import Measure

    for R in (1.0, 3.0, 7.3):
        for mu in (Measure.sphere(3000, 3, R, seed=0, dtype=dtype), Measure.ball(3000, 3, R, seed=0, dtype=dtype)):
            assert bool((mu.points.norm(dim=1) <= R).all())
    assert float(Measure.sphere(3000, 3, 7.3, seed=0, dtype=dtype).points.norm(dim=1).min()) >= 7.3 * (1 - 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [1.0, 20.0, 50.0])
def test_low_precision_rows_are_inside_in_float64_too(dtype, R):
    """A float32 row whose float32 norm is R can hold numbers whose exact norm is above it (50.0000024 at R = 50,
    a review): a float64 re-certification of that input is of a point outside the ball. The truth: the norm
    of the same numbers computed in float64 (exact for them to about 1e-16), <= R as well."""
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(4000, 3, generator=g, dtype=torch.float64)
    X = (R * Z / Z.norm(dim=1, keepdim=True)).to(dtype)
    Y = into_ball(X, R)
    assert bool((Y.norm(dim=1) <= R).all())
    assert bool((Y.to(torch.float64).norm(dim=1) <= R).all())
    # moved by a few units in the last place at most: in norm too (4 units of bfloat16 pulled rows in by 3%)
    assert float((Y.double() - X.double()).abs().max()) <= 4 * torch.finfo(dtype).eps * R
    steps = 2 if dtype == torch.bfloat16 else 8   # a representable value at a time; float32 4 units a step
    assert float(Y.double().norm(dim=1).min()) >= R * (1 - steps * torch.finfo(dtype).eps)
