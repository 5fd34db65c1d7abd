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


def test_slope_claim_on_an_exact_power_law():
    """A measured law that is exactly the predicted one agrees: its 95% interval has zero width and
    is closed, [0.5, 0.5] contains 0.5. A prediction off by 0.01 in the exponent does not."""
    ns = [4, 16, 64]
    lips = [2.0, 4.0, 8.0]   # sqrt(n), exactly representable
    claim, fit, pred = slope_claim(ns, lips, lips, "an exact law")
    assert fit["lo"] == fit["slope"] == fit["hi"] == pred["slope"] == 0.5
    assert claim.agrees
    off, _, pred_off = slope_claim(ns, lips, [n**0.51 for n in ns], "an exact law")
    assert abs(pred_off["slope"] - 0.51) < 1e-12 and not off.agrees


def test_slope_claim_names_its_context_only_when_given():
    """The prediction's text carries the caller's context after a semicolon, and nothing when there is none."""
    ns, lips = [4, 16, 64], [2.0, 4.0, 8.0]
    bare, _, _ = slope_claim(ns, lips, lips, "an exact law")
    told, _, _ = slope_claim(ns, lips, lips, "an exact law", context="Prop 3.4's curve: 0.5000")
    assert bare.theory.endswith("0.5 as n -> inf)")
    assert told.theory == bare.theory[:-1] + "; Prop 3.4's curve: 0.5000)"


def test_mean_std_by_n_groups_rows_by_n():
    from studies.common import mean_std_by_n

    rows = [{"n": 8, "x": 1.0}, {"n": 4, "x": 2.0}, {"n": 8, "x": 3.0}, {"n": 8, "x": 5.0}]
    out = mean_std_by_n(rows, ("x",))
    assert [r["n"] for r in out] == [4, 8] and [r["samples"] for r in out] == [1, 3]
    assert out[0]["x_mean"] == 2.0 and out[0]["x_std"] == 0.0
    assert out[1]["x_mean"] == 3.0 and out[1]["x_std"] == 2.0   # sample std of (1, 3, 5)
