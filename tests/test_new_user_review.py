"""Fixes of a new user's review (2026-11-29): an unmasked operator says that it does not read a masked measure's
positions (as transport.w2 does), an operator's upper bound reads as a number, the README's sweep snippets run."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from meanfield import SelfAttention, lipschitz_ratio, local_lipschitz, operator_upper
from particles import Measure

F64 = torch.float64


def _masked_measures():
    A = np.random.default_rng(0).standard_normal((3, 3)) / 2
    s = Measure.sphere(12, 3, 1.5, seed=0, positions=True)
    t = Measure.sphere(12, 3, 1.5, seed=1, positions=True)
    return A, s, t


@pytest.mark.parametrize("call", ["pushforward", "local_lipschitz", "lipschitz_ratio"])
def test_an_unmasked_operator_warns_that_positions_are_not_read(call):
    """The positions of a masked measure change nothing for an unmasked operator (its result is that of the
    measure without them): a UserWarning names the argument, the operator and the two ways out."""
    A, s, t = _masked_measures()
    att = SelfAttention(A, np.eye(3))
    run = {"pushforward": lambda m, n: att(m).points,
           "local_lipschitz": lambda m, n: torch.tensor(local_lipschitz(att, m).value),
           "lipschitz_ratio": lambda m, n: torch.tensor(lipschitz_ratio(att, m, n))}[call]
    with pytest.warns(UserWarning, match=r"positions are not read: SelfAttention is unmasked .* \w+\.unmasked\(\) .*"
                                         r"masked=True"):
        got = run(s, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # dropped on purpose: silent, and the same number
        plain = run(s.unmasked(), t.unmasked())
    torch.testing.assert_close(got, plain, rtol=0, atol=0)


def test_a_masked_operator_reads_positions_without_a_warning():
    """The warning is about unmasked operators only: a masked one uses the positions, and its result differs
    from that of the measure with its atoms in another order of positions."""
    A, s, _ = _masked_measures()
    att = SelfAttention(A, np.eye(3), masked=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = att(s).points
    reversed_positions = Measure(s.points, s.weights, positions=1.0 - s.positions)
    assert float((att(reversed_positions).points - out).abs().max()) > 1e-3


def test_upper_bound_reads_as_a_number():
    """float(bound) is its value, as float(estimate) is a LipschitzEstimate's; the repr leads with the value (the
    log of Theorem 3.3's bound sqrt(3) ||V|| sqrt(||A||^2 R^4 (4n + 1) + n), computed here from the formula)."""
    A, V, R, n = np.eye(3), 2 * np.eye(3), 2.0, 8
    bound = operator_upper(SelfAttention(A, V), R=R, n=n)
    expected = math.sqrt(3) * 2 * math.sqrt(R ** 4 * (4 * n + 1) + n)
    assert float(bound) == pytest.approx(expected, rel=1e-12)
    assert repr(bound).startswith(f"UpperBound(value={expected:.6g}, log_value={math.log(expected):.6g}, "
                                  "source='Theorem 3.3'")
    none = operator_upper(SelfAttention(A, V, masked=True), R=R)   # masked on measures: no bound known
    assert float(none) == math.inf and "value=inf" in repr(none)


def test_the_sweep_page_first_example_runs(tmp_path, monkeypatch):
    """docs/sweeps.md's first block defines a task that runs (it was `...`, so every task failed with a NameError,
    which a sweep records as failures rather than raising); its sweep, in-process here, finishes every task."""
    from pathlib import Path

    from studies.sweep import run_sweep
    text = (Path(__file__).resolve().parents[1] / "docs" / "sweeps.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    ns = {"__name__": "docs_sweeps"}   # not __main__: the block's own sweep stays for the reader's script
    exec(compile(block, "docs/sweeps.md", "exec"), ns)
    monkeypatch.chdir(tmp_path)
    res = run_sweep(ns["lipschitz_task"], {"n": [4, 8], "R": [1.0], "seed": [0]}, "runs/lip", backend="inprocess",
                    progress=False)
    assert res.ok and [r["n"] for r in res.rows] == [4, 8]
    assert all(r["lip"] > 0 and r["error"] >= 0 for r in res.rows)


def test_a_ratio_given_tensors_says_to_wrap_them_as_measures():
    """A new user's review (afternoon of 2026-11-29): lipschitz_ratio(op, X, Y) with tensors said 'use
    op.sequence(X) for tensors', advice for an evaluation, not for a ratio of W2 distances."""
    X = torch.randn(5, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    op = SelfAttention(torch.eye(2, dtype=F64), torch.eye(2, dtype=F64))
    with pytest.raises(TypeError, match=r"mu: expected a particles.Measure.*Measure.empirical\(X\)"):
        lipschitz_ratio(op, X, X + 0.1)
    with pytest.raises(TypeError, match=r"nu: expected a particles.Measure.*Measure.empirical\(X\)"):
        lipschitz_ratio(op, Measure.empirical(X), X + 0.1)
    assert lipschitz_ratio(op, Measure.empirical(X), Measure.empirical(X + 0.1)) > 0
