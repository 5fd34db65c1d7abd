"""Conditional W2 with many small slices: per-slice grouping in O(N log N), and its memory-limit message.

Truth: the sum over positions of the slice masses times the exact W2^2 of each slice (an assignment,
scipy's linear_sum_assignment, for equal-size uniform slices).
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from particles import Measure
from particles.validation import MemoryLimitError
from transport import conditional_w2

F64 = torch.float64
conditional_module = importlib.import_module("transport.conditional")

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_sq(x: np.ndarray, y: np.ndarray, pos: np.ndarray) -> float:
    """sum_s m(s) W2(mu_s, nu_s)^2 for uniform measures whose slices have equal sizes in x and y."""
    total = 0.0
    for s in np.unique(pos):
        idx = np.nonzero(pos == s)[0]
        cost = ((x[idx][:, None, :] - y[idx][None, :, :]) ** 2).sum(-1)
        r, c = linear_sum_assignment(cost)
        total += len(idx) / len(pos) * cost[r, c].mean()
    return total


def _case(sizes, d, seed):
    """Uniform measures with ``sizes[k]`` atoms at position k, the atoms shuffled (slices interleaved)."""
    g = np.random.default_rng(seed)
    pos = np.repeat((np.arange(len(sizes)) + 1) / len(sizes), sizes)
    g.shuffle(pos)
    x, y = g.standard_normal((len(pos), d)), g.standard_normal((len(pos), d))
    return x, y, pos


def test_many_slices_of_mixed_sizes_match_per_slice_assignments():
    g = np.random.default_rng(1)
    sizes = g.integers(1, 6, size=300)   # singletons (closed form) and slices of 2..5 atoms (simplex)
    x, y, pos = _case(sizes, 3, 2)
    mu = Measure(torch.tensor(x, dtype=F64), positions=torch.tensor(pos, dtype=F64))
    nu = Measure(torch.tensor(y, dtype=F64), positions=torch.tensor(pos, dtype=F64))
    truth = _reference_sq(x, y, pos)
    value, plan = conditional_w2(mu, nu, squared=True, return_plan=True)
    assert value == pytest.approx(truth, rel=1e-12)
    # the plan stays within positions and has the measures' marginals
    p = plan.numpy()
    assert not p[pos[:, None] != pos[None, :]].any()
    np.testing.assert_allclose(p.sum(1), 1 / len(pos), rtol=1e-12)
    np.testing.assert_allclose(p.sum(0), 1 / len(pos), rtol=1e-12)
    assert float((p * ((x[:, None] - y[None]) ** 2).sum(-1)).sum()) == pytest.approx(truth, rel=1e-12)


@pytest.mark.timeout(300)
def test_two_atoms_per_position_at_n_20000():
    # the former per-slice scan of all N atoms took N^2 time here (~9 s at N = 20000, hours at 1e6)
    n = 20_000
    x, y, pos = _case(np.full(n // 2, 2), 2, 3)
    mu = Measure(torch.tensor(x, dtype=F64), positions=torch.tensor(pos, dtype=F64))
    nu = Measure(torch.tensor(y, dtype=F64), positions=torch.tensor(pos, dtype=F64))
    # two atoms a, b against c, d: the better of the two permutations (the assignment of a 2 x 2 slice)
    order = np.argsort(pos, kind="stable")
    xs, ys = x[order].reshape(-1, 2, 2), y[order].reshape(-1, 2, 2)
    keep = ((xs - ys) ** 2).sum((1, 2))
    swap = ((xs - ys[:, ::-1]) ** 2).sum((1, 2))
    truth = float(np.minimum(keep, swap).sum() / n)
    assert conditional_w2(mu, nu, squared=True) == pytest.approx(truth, rel=1e-12)


class _CountingTorch:
    """The torch module, counting the elements that ``torch.nonzero`` scans."""

    def __init__(self):
        self.scanned = 0

    def nonzero(self, t, *args, **kwargs):
        self.scanned += t.numel()
        return torch.nonzero(t, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


def test_slice_grouping_scans_the_atoms_a_bounded_number_of_times(monkeypatch):
    # not timed: the scans of conditional_w2 add up to O(N), not N per slice
    n = 2_000
    x, y, pos = _case(np.full(n // 2, 2), 2, 4)
    mu = Measure(torch.tensor(x, dtype=F64), positions=torch.tensor(pos, dtype=F64))
    nu = Measure(torch.tensor(y, dtype=F64), positions=torch.tensor(pos, dtype=F64))
    counting = _CountingTorch()
    monkeypatch.setattr(conditional_module, "torch", counting)
    conditional_w2(mu, nu)
    assert counting.scanned <= 10 * n


def test_memory_message_of_a_big_slice_names_what_conditional_w2_can_change():
    x, y, pos = _case([3, 200, 5], 2, 5)
    mu = Measure(torch.tensor(x, dtype=F64), positions=torch.tensor(pos, dtype=F64))
    nu = Measure(torch.tensor(y, dtype=F64), positions=torch.tensor(pos, dtype=F64))
    with pytest.raises(MemoryLimitError) as info:
        conditional_w2(mu, nu, memory_limit=100_000)
    msg = str(info.value)
    assert msg.startswith("conditional_w2: ")
    assert "200 atoms of mu, 200 of nu" in msg
    assert "position 0.666667" in msg
    assert "fewer atoms at each position" in msg
    assert "memory_limit=" in msg and "SMOOTH_ATTENTION_MEMORY_LIMIT" in msg
    assert "method=" not in msg   # conditional_w2 takes no method
    # ... and under a limit that fits the biggest slice, the value is the per-slice reference
    value = conditional_w2(mu, nu, squared=True, memory_limit=6 * 8 * 200 * 200)
    assert value == pytest.approx(_reference_sq(x, y, pos), rel=1e-12)
    assert math.isfinite(value)
