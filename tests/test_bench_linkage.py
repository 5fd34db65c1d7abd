"""benchmarks/bench_linkage.py runs (tiny sizes): both candidates give the same partition and are timed."""

from __future__ import annotations

from tests.test_bench_gpu import _load


def test_both_candidates_run_and_agree(capsys):
    assert _load("bench_linkage").main(["--sizes", "3000", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| uniform") or
            line.startswith("| 300")]
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3].endswith(" s") and cells[4].endswith(" s") and cells[5].endswith("x")
    assert [row.split("|")[3].strip() for row in rows][:2] == ["1", "1"]   # the uniform clouds are connected
