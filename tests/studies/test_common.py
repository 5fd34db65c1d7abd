"""The helpers of studies/common.py in the cases the studies' runs never reach (the fits themselves
are in test_fit_loglog.py). Truths: torch's own notion of where a tensor lives (the "meta" device,
shapes without data, stands for an accelerator) and exact power laws, whose least-squares slope is
exact and whose confidence interval has zero width."""

from __future__ import annotations

import torch

from studies.common import slope_claim, to_device


def test_to_device_moves_every_tensor_and_returns_one_tensor_for_one():
    a, b = torch.ones(2), torch.zeros(3)
    assert to_device(None, a) is a
    same = to_device(None, a, b)
    assert isinstance(same, tuple) and len(same) == 2 and same[0] is a and same[1] is b
    one = to_device("meta", a)
    assert isinstance(one, torch.Tensor) and one.device.type == "meta" and one.shape == a.shape
    moved = to_device("meta", a, b)
    assert isinstance(moved, tuple) and [t.device.type for t in moved] == ["meta", "meta"]
    assert [t.shape for t in moved] == [a.shape, b.shape]


def test_slope_claim_places_the_exponent_between_one_half_and_the_curves():
    """An exact sqrt(n) law agrees whatever the curve's exponent (1/2 is the theorem's); an exponent between 1/2
    and the curve's agrees, and one more than SLOPE_TOL = 0.02 outside [min, max] of the two does not; the
    witness's own slope is reported, not compared."""
    from studies.common import SLOPE_TOL

    ns = [4, 16, 64]
    root = [2.0, 4.0, 8.0]   # sqrt(n), exactly representable
    claim, fit, pred = slope_claim(ns, root, root, [n**0.58 for n in ns], "an exact law")
    assert fit["slope"] == pred["slope"] == 0.5 and claim.agrees and SLOPE_TOL == 0.02
    for e, agrees in ((0.54, True), (0.599, True), (0.481, True), (0.601, False), (0.479, False)):
        c, _, _ = slope_claim(ns, [n**e for n in ns], [n**0.7 for n in ns], [n**0.58 for n in ns], "a law")
        assert c.agrees is agrees, e
        assert "the witness's exact constant: 0.7000" in c.measured


def test_mean_std_by_n_groups_rows_by_n():
    from studies.common import mean_std_by_n

    rows = [{"n": 8, "x": 1.0}, {"n": 4, "x": 2.0}, {"n": 8, "x": 3.0}, {"n": 8, "x": 5.0}]
    out = mean_std_by_n(rows, ("x",))
    assert [r["n"] for r in out] == [4, 8] and [r["samples"] for r in out] == [1, 3]
    assert out[0]["x_mean"] == 2.0 and out[0]["x_std"] == 0.0
    assert out[1]["x_mean"] == 3.0 and out[1]["x_std"] == 2.0   # sample std of (1, 3, 5)
