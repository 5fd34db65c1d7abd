"""The kernel_paths study end to end: it runs, its claims hold, auto takes the paths the cases are meant for,
its figure is readable, and its reference (the dense path) is itself the written-out attention of
tests/reference.py, so that "agrees with the dense path" means "agrees with the attention's definition".
That the claims fail on a wrong kernel is in tests/studies/test_claims_can_fail.py."""

from __future__ import annotations

import pytest
import torch

from studies import plotting
from studies.context import RunContext
from studies.experiments import kernel_paths as kp
from studies.io import read_csv
from studies.report import reproduce
from tests.reference import naive_attention


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel_paths")
    problems = []
    original = plotting.finalize

    def finalize_and_check(fig):
        original(fig)
        problems.extend(plotting.check_figure(fig))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plotting, "finalize", finalize_and_check)
        summary = reproduce(RunContext(out, level="tiny", seed=0, progress=False), only=["kernel_paths"])
    return out / "kernel_paths", summary["studies"]["kernel_paths"], problems


def test_study_runs_its_claims_hold_and_auto_takes_each_path(run):
    out, res, problems = run
    assert res["status"] == "ok", res.get("traceback")
    assert [c["verdict"] for c in res["claims"]] == ["holds"] * 6
    assert all(c["kind"] == "theorem" and c["fails_if"] for c in res["claims"])
    rows = {r["case"]: r for r in read_csv(out / "kernel_paths.csv")}
    assert set(rows) == set(kp.CASES)
    for case, r in rows.items():
        assert r["path"] == kp.CASES[case][-1] == r["expected_path"], case
        assert r["deviation"] <= kp.TOL
    for case in ("d weighted measure", "d weighted causal atoms", "d masked measure", "d sphere tokens, series"):
        r = rows[case]
        assert r["converged"] and abs(r["lip"] - r["lip_dense"]) <= r["lip_error"] + kp.TOL * r["lip"]
    # n = 300 streams in two key tiles of 256 (the online softmax rescales), n = 2100 in nine
    assert rows["d masked measure"]["n"] > 256 and rows["masked measure, large"]["n"] > 8 * 256
    assert (out / "deviations.png").stat().st_size > 10_000 and problems == []


@pytest.mark.parametrize("case", ["masked measure", "weighted causal atoms", "weighted measure"])
def test_the_dense_reference_is_the_written_out_attention(case):
    """The dense path the claims compare with against tests/reference.py's naive attention (positions and
    log-weights in the scores). Its derivatives are plain autograd of the same expression, and its certified
    constants are checked against dense Jacobians in tests/meanfield."""
    from meanfield import kernels
    from particles import Measure

    att, X, lw, pos = kp._inputs(case, 0)
    masked = kp.CASES[case][2]
    ref = naive_attention(X, att.A, att.V, masked=masked, log_weights=lw, positions=pos)
    with kernels.use("dense"):
        got = att(Measure(X, log_weights=lw, positions=pos)).points
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_case_task_rejects_an_unknown_case():
    with pytest.raises(ValueError, match="case: expected one of"):
        kp.case_task("no such case", 0)
