"""large_radius-4 (Theorem 4.5 along the masked hub directions) tells the masked limit from the unmasked one.

The hub-first direction (every token attends to token 0) and the quick grid's random direction have the same
largest argmax multiplicity masked and unmasked, so a masked limit computed with the unmasked argmax
(``argmax_indices(..., masked=False)`` inside ``bounds.large_radius_limit``) passed every claim. The hub-last
direction (``large_radius_configuration`` with ``hub = n - 1``: the tokens before the hub cannot see it when
masked) has masked multiplicity 1 or n - 1 against n unmasked: the claim must hold on the library and fail with
that mutant, and must fail when the case has lost its difference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meanfield import bounds
from studies.common import random_A, random_V
from studies.context import RunContext
from studies.experiments import large_radius as lr
from studies.io import read_csv


def _by_hand(A, V, X, masked):
    """Theorem 3.7 / 4.5 (docs/math.md section 5.5) written out: m_i = argmax_j <A x_i, x_j> over all j
    (unmasked) or j <= i (masked); the limit is ||V||_2 sqrt(max_j #{i : m_i = j})."""
    A, V, X = (np.asarray(t, dtype=np.float64) for t in (A, V, X))
    n = X.shape[0]
    m = []
    for i in range(n):
        scores = [float((A @ X[i]) @ X[j]) for j in range(i + 1 if masked else n)]
        m.append(int(np.argmax(scores)))
    counts = [m.count(j) for j in range(n)]
    return m, float(np.linalg.norm(V, 2)) * math.sqrt(max(counts))


@pytest.mark.parametrize("level", ["tiny", "quick", "full"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hub_last_masked_limit_differs_from_the_unmasked_one(level, seed):
    g = lr.grid(level)
    n, d = g["n"], g["d"]
    A, V = random_A(d, seed), random_V(d, seed)
    X = lr.direction("hub_last", n, d, seed)
    m_u, lim_u = _by_hand(A, V, X, masked=False)
    m_m, lim_m = _by_hand(A, V, X, masked=True)
    v = float(np.linalg.norm(V.numpy(), 2))
    assert m_u == [n - 1] * n and lim_u == pytest.approx(v * math.sqrt(n), rel=1e-14)   # the hub, last
    # the others are t_k w (t_k increasing), the hub w: with q = <A w, w> > 0 the largest visible t_j is the
    # token itself (multiplicity 1); with q < 0 the smallest visible is token 0 (multiplicity n - 1)
    w = X[-1].numpy()
    q = float(w @ A.numpy() @ w)
    if q > 0:
        assert m_m == list(range(n)) and lim_m == pytest.approx(v, rel=1e-14)
    else:
        assert m_m == [0] * (n - 1) + [n - 1] and lim_m == pytest.approx(v * math.sqrt(n - 1), rel=1e-14)
    assert abs(lim_m - lim_u) > 0.01 * lim_u
    assert bounds.large_radius_limit(A, V, X, masked=True) == pytest.approx(lim_m, rel=1e-14)
    assert bounds.large_radius_limit(A, V, X, masked=False) == pytest.approx(lim_u, rel=1e-14)
    assert lr.multiplicities(A, X) == (round((lim_m / v) ** 2), n)


def _unmasked_argmax_limit(orig):
    """The mutant: Theorem 4.5's limit computed with the unmasked argmax."""
    def wrong(A, V, X, *, masked=False, rtol=1e-9):
        return orig(A, V, X, masked=False, rtol=rtol)
    return wrong


def _claims(tmp_path, level):
    ctx = RunContext(tmp_path, level=level, seed=0, sweep={"backend": "inprocess", "resume": False})
    return lr.large_radius(tmp_path / "large_radius", ctx).claims


@pytest.mark.parametrize("level", ["tiny", "quick"])
def test_masked_hub_claim_holds_and_catches_the_unmasked_argmax(tmp_path, monkeypatch, level):
    claims = _claims(tmp_path / "ok", level)
    assert len(claims) == 5
    claim = claims[3]   # large_radius-4
    assert claim.short.startswith("Thm 4.5") and "hub last" in claim.short
    assert claim.agrees is True, claim.measured
    assert all(c.agrees for c in claims)

    monkeypatch.setattr(bounds, "large_radius_limit", _unmasked_argmax_limit(bounds.large_radius_limit))
    bad = _claims(tmp_path / "mutant", level)
    assert bad[3].agrees is False, bad[3].measured


def test_masked_hub_claim_fails_when_the_multiplicities_coincide():
    row = {"limit": 2.0, "lip": 2.0, "rel_gap": 0.0, "R": 10.0, "score_gap": 1.0, "v_norm_sqrt_n": 2.0, "n": 4,
           "jacobian_deviation": 0.0}
    assert lr.masked_hub_claim([row], [row], (1, 4)).agrees is True
    assert lr.masked_hub_claim([row], [row], (4, 4)).agrees is False        # the case lost its difference
    assert lr.masked_hub_claim([row], [{**row, "rel_gap": 2e-6}], (1, 4)).agrees is False
    assert lr.masked_hub_claim([{**row, "rel_gap": 2e-6}], [row], (1, 4)).agrees is False
    assert lr.masked_hub_claim([row], [{**row, "jacobian_deviation": 2e-6}], (1, 4)).agrees is False


def test_hub_last_rows_reach_their_masked_limit(tmp_path):
    """The study's hub-last curve, at its largest R, against a dense Jacobian check of the limit."""
    _claims(tmp_path, "tiny")
    rows = [r for r in read_csv(tmp_path / "large_radius" / "lipschitz_vs_R.csv") if r["kind"] == "hub_last"]
    assert rows and all(r["masked"] for r in rows)
    last = rows[-1]
    A, V = random_A(last["d"], 0), random_V(last["d"], 0)
    X = lr.direction("hub_last", last["n"], last["d"], 0)
    _, lim = _by_hand(A, V, X, masked=True)
    assert last["limit"] == pytest.approx(lim, rel=1e-12)
    assert abs(last["lip"] - lim) <= 1e-6 * lim
    assert torch.is_tensor(X) and X.shape == (last["n"], last["d"])


@pytest.mark.parametrize("level", ["tiny", "quick"])
def test_the_limit_claims_catch_attention_with_the_transposed_matrix(tmp_path, monkeypatch, level):
    """Theorems 3.7 / 4.5 state the Jacobian's limit, E -> (V e_(m_i))_i; its norm depends on the largest argmax
    multiplicity alone, which at seed 0 is the same for A and A^T, so attention computed with A^T (scores
    <A^T x_i, x_j>) passed large_radius-1 (a mutation review). The claims now also compare the dense Jacobian
    with the limit map entry by entry: they must hold on the library and fail with that mutant."""
    import meanfield

    claims = _claims(tmp_path / "ok", level)
    assert all(c.agrees for c in claims), [c.measured for c in claims if not c.agrees]
    real = meanfield.SelfAttention

    class Transposed(real):
        def __init__(self, A, V, **kw):
            super().__init__(torch.as_tensor(A).T.contiguous(), V, **kw)

    monkeypatch.setattr(meanfield, "SelfAttention", Transposed)
    bad = _claims(tmp_path / "mutant", level)
    assert bad[0].agrees is False and "Jacobian" in bad[0].measured, bad[0].measured   # large_radius-1
    assert bad[2].agrees is False, bad[2].measured                                     # large_radius-3 (masked)
