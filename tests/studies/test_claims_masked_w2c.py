"""masked-6: conditional W2 against its closed forms, on pairs where plain W2 is smaller. A second mutation review
found that a conditional_w2 forgetting the positions (plain W2) passed every claim: the masked ratios meet W2c only
near eps -> 0, where the identity coupling makes both equal."""

from __future__ import annotations

import math

import torch

import transport
from particles import Measure
from studies.experiments.masked import conditional_w2_claim, conditional_w2_rows


def test_closed_forms_written_out_hold():
    rows = conditional_w2_rows([4, 16], 3, 1.5, 0, 2)
    assert conditional_w2_claim(rows).agrees
    X = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    Y = X.flip(0)
    # independent of the rows: one atom per position, each compared with the atom at its own position
    want = math.sqrt(sum(float((X[i] - Y[i]).pow(2).sum()) for i in range(5)) / 5)
    assert abs(float(transport.conditional_w2(Measure.sequence(X), Measure.sequence(Y))) / want - 1) < 1e-13


def test_fails_when_conditional_w2_forgets_the_positions(monkeypatch):
    plain = lambda mu, nu, **k: transport.w2(Measure(mu.points, mu.weights), Measure(nu.points, nu.weights))
    monkeypatch.setattr(transport, "conditional_w2", plain)
    assert not conditional_w2_claim(conditional_w2_rows([4, 16], 3, 1.5, 0, 2)).agrees


def test_fails_when_slices_are_not_weighted_by_their_mass(monkeypatch):
    real = transport.conditional_w2
    monkeypatch.setattr(transport, "conditional_w2", lambda mu, nu, **k: real(mu, nu, **k) * math.sqrt(mu.n))
    assert not conditional_w2_claim(conditional_w2_rows([4, 16], 3, 1.5, 0, 2)).agrees
