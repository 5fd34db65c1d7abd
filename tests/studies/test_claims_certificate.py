"""The worst_case study's certificate checks can fail: worst_case-3 (the found input re-verified by a dense
Jacobian, its certified lower bound one-sided; and the certificates with macroscopic bars: certified values never
above the dense top singular value, every error bar holding a dense singular value) holds on the code as written
and fails, in memory, for two single wrong lines no other claim catches:
the certificate of :func:`meanfield.krylov._rayleigh` halved, and ``WorstCaseResult.lower`` reported as
value + error (a "lower bound" above the value)."""

from __future__ import annotations

import pytest

from meanfield import krylov
from meanfield.worst_case import WorstCaseResult
from studies.contract import SHORT_MAX
from studies.experiments import worst_case as wc


def _halved(monkeypatch):
    real = krylov._rayleigh

    def half(p, u):
        v, rho, err, z = real(p, u)
        return v, rho, 0.5 * err, z

    monkeypatch.setattr(krylov, "_rayleigh", half)


def _lower_plus_error(monkeypatch):
    monkeypatch.setattr(WorstCaseResult, "lower", property(lambda self: self.estimate.value + self.estimate.error))


# a found input whose dense constant equals its certified value: the part of worst_case-3 the certificates join
ROW = {"case": "min", "masked": False, "n": 4, "R": 1.0, "dense": 2.0, "lower": 2.0, "lower_error": 1e-6,
       "radius_max": 1.0}


def _check(certs):
    return wc.dense_claim([ROW], certs)


def _claim(seed=0):
    return _check(wc.certificate_rows(3, wc.grid("quick")["Rs"], seed))


@pytest.fixture(scope="module")
def right():
    rows = wc.certificate_rows(3, wc.grid("quick")["Rs"], 0)
    return rows, _check(rows)


def test_certificate_claim_holds_with_bars_that_are_macroscopic_and_nearly_tight(right):
    rows, claim = right
    assert claim.agrees, claim.measured
    assert len(claim.short) <= SHORT_MAX and len(claim.short_measured) <= SHORT_MAX
    searches = [r for r in rows if r["kind"] == "search"]
    assert searches and all(r["method"] == "lanczos" and r["n"] * 3 > 32 for r in searches)
    assert max(r["error"] / r["dense_top"] for r in searches) > 1e-6   # a bar far above rounding
    tight = max(r["tightness"] for r in rows)
    assert 0.6 < tight <= 1   # some bar is within a factor 1.7 of the distance it bounds: halving it misses
    assert all(r["value"] <= r["dense_top"] * (1 + 1e-12) for r in rows)


def test_certificate_claim_fails_for_a_halved_certificate(monkeypatch):
    _halved(monkeypatch)
    claim = _claim()
    assert not claim.agrees
    c = wc.certificate_check(wc.certificate_rows(3, wc.grid("quick")["Rs"], 0))
    assert c["miss"] and not c["above"]


def test_certificate_claim_fails_for_a_lower_bound_above_the_value(monkeypatch):
    _lower_plus_error(monkeypatch)
    claim = _claim()
    assert not claim.agrees
    c = wc.certificate_check(wc.certificate_rows(3, wc.grid("quick")["Rs"], 0))
    assert c["above"] and not c["miss"] and all(r["kind"] == "search" for r in c["above"])


def test_certificate_claim_fails_without_power(right):
    rows, _ = right
    # bars twice as wide still hold every singular value, but no longer tell a halved bar from the right one
    wide = [{**r, "error": 2 * r["error"], "tightness": r["nearest"] / (2 * r["error"] + 1e-12 * r["dense_top"])}
            for r in rows]
    assert not _check(wide).agrees
    # no search with a bar above rounding: a lower bound reported above the value would go unseen
    assert not _check([r for r in rows if r["kind"] != "search"]).agrees
    assert not _check([]).agrees


def test_dense_claim_is_one_sided():
    """worst_case-3: a certified lower bound above the dense constant fails even inside its error bar."""
    row = ROW
    assert wc.dense_claim([row]).agrees
    assert wc.dense_claim([{**row, "lower": 2.0 - 5e-7}]).agrees            # below, within the bar
    assert wc.dense_claim([{**row, "lower": 2.0 * (1 + 1e-13)}]).agrees    # rounding
    claim = wc.dense_claim([{**row, "lower": 2.0 + 5e-7}])                 # above, within the bar
    assert not claim.agrees and "1 above the dense constant" in claim.measured


def test_the_study_passes_its_certificates_to_worst_case_3():
    """The certificate check sits in worst_case-3 (no claim renumbered, none added)."""
    import inspect

    src = inspect.getsource(wc._run)
    claims = src[src.index("claims = ["):src.index("_figure(", src.index("claims = ["))]
    assert "dense_claim(rows, certs)" in claims and claims.count("_claim(") == 5
