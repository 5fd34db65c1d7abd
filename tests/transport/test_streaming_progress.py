"""The streaming Sinkhorn's progress lines: over-relaxed updates and the first updates at the final eps raise the
marginal error for a while (0.54 -> 3.05 -> 0.64 -> 15 -> 0.30 in one solve of 3000 atoms at reg 1e-2), so a line
read alone could suggest divergence; a line above the lowest error reached says what that was."""

import logging

from particles import progress
from transport import streaming_sinkhorn


def test_a_line_above_the_lowest_error_says_the_lowest(monkeypatch, caplog):
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)
    p = streaming_sinkhorn.Progress("streaming Sinkhorn, 3 x 3 atoms", 100, 1e-7)
    with caplog.at_level(logging.INFO, logger="transport"):
        p(1)
        for it, err in enumerate([1.0, 0.5, 3.0, 0.4], start=2):
            p(it, err)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "streaming Sinkhorn, 3 x 3 atoms: 1 of at most 100 updates, annealing, 0 s"
    assert "marginal L1 error 1 (tol 1e-07)," in lines[1]
    assert "marginal L1 error 0.5 (tol 1e-07)," in lines[2]
    assert "marginal L1 error 3 (tol 1e-07; lowest so far 0.5)," in lines[3]
    assert "marginal L1 error 0.4 (tol 1e-07)," in lines[4]
