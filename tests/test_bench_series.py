"""benchmarks/bench_series.py runs (tiny sizes): its table names the series' plan, times both candidates and
reports errors at the machine epsilon, and its --clusters mode runs the dynamics study's at-scale task."""

from __future__ import annotations

from tests.test_bench_gpu import _load


def _bench():
    return _load("bench_series")


def test_table_rows_time_both_paths_and_errors_are_small(capsys):
    assert _bench().main(["--sizes", "64", "300", "--dtypes", "float64", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| float64")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3].startswith("18, 1330, ")            # the plan at r about 1 in float64
        assert "(dense)" in cells[5] or "(fused)" in cells[5]
        assert float(cells[7]) < 1e-13 and float(cells[8]) < 1e-13


def test_clusters_mode_runs_the_at_scale_task(capsys, monkeypatch):
    from meanfield import kernels, series_attention

    # at 300 tokens the series takes the run only with its threshold and cost model set aside
    monkeypatch.setattr(kernels, "SERIES_THRESHOLD", 2**10)
    monkeypatch.setattr(series_attention, "COST_RATIO", 100.0)
    assert _bench().main(["--clusters", "300", "--T", "1"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3e+02")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "series x16"    # 4 RK4 steps of 0.25, 4 evaluations each
    assert float(cells[6]) < 1e-12          # drift off the sphere


def test_lipschitz_mode_certifies_both_ways_and_they_agree(capsys):
    assert _bench().main(["--lipschitz", "200", "400"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2e+02") or
            line.startswith("| 4e+02")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert "not converged" not in cells[1] and "not converged" not in cells[4]
        assert float(cells[8]) <= 1.0     # the two values within the sum of their certified errors


def test_layouts_mode_times_both_layouts_and_they_agree(capsys):
    assert _bench().main(["--layouts", "300", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| disc") or line.startswith("| sphere")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[4].endswith("x") and float(cells[5]) < 1e-13   # the two layouts' kernel sums agree
    lips = [line for line in out if line.startswith("| now") or line.startswith("| before")]
    assert len(lips) == 2
    values = {line.split("|")[2].strip() for line in lips}
    assert len(values) == 1     # the same certified value, error and products


def test_crossover_mode_times_both_paths_and_names_what_auto_takes(capsys):
    assert _bench().main(["--crossover", "120", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| the study") or
            line.startswith("| sphere")]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[5] == "exact"          # 120 points: far below auto's floor
        assert cells[8].endswith("x")
    # the certificate's degrees at r = max |q| max |k - k0|: about 4.4 on the disc, ||A|| on the sphere
    assert [row.split("|")[4].strip() for row in rows][1:] == ["18", "21", "25"]
