"""studies.costs: the one file of measured time and memory that --help and the README show."""

from __future__ import annotations

import json

import pytest

from studies import costs


def _row(name, wall, kib, status="ok"):
    return {"name": name, "hwm_kib": kib, "children_maxrss_kib": 0, "wall": wall, "cpu": wall / 2, "status": status}


def test_record_then_render(tmp_path):
    path = tmp_path / "data" / "costs.json"
    costs.record("quick", [_row("sqrt_n", 12.3, 2**20), _row("(whole job)", 95.0, 3 * 2**20)], command="cmd a",
                 date="2026-01-01", load_average="0.5", machine="2 x CPU", path=path)
    costs.record("full", [_row("sqrt_n", 600.0, 2**21)], command="cmd b", date="2026-01-02", load_average="1.0",
                 machine="2 x CPU", path=path)
    data = costs.load(path)
    assert data["levels"]["quick"]["studies"]["sqrt_n"] == {"wall_s": 12.3, "cpu_s": 6.2, "peak_gib": 1.0,
                                                            "status": "ok", "load": "0.5"}
    table = costs.markdown_table(data)
    lines = table.splitlines()
    assert lines[2] == "| sqrt_n | 12 s, 1.0 GiB | 10.0 min, 2.0 GiB |"
    assert lines[3] == "| (whole job) | 1.6 min, 3.0 GiB | not measured |"   # the whole job comes last
    assert "`cmd a`" in table and "`cmd b`" in table and "2 x CPU" in table
    text = costs.help_text(data)
    assert "sqrt_n" in text and "12 s, 1.0 GiB" in text and "10.0 min, 2.0 GiB" in text
    # re-measuring one study keeps the others and the list of commands
    costs.record("quick", [_row("sqrt_n", 20.0, 2**20, status="failed: boom")], command="cmd c", date="2026-01-03",
                 load_average="2.0", machine="2 x CPU", path=path)
    data = json.loads(path.read_text())
    assert data["levels"]["quick"]["commands"] == ["cmd a", "cmd c"]
    assert "(whole job)" in data["levels"]["quick"]["studies"]
    assert "| sqrt_n | failed: boom |" in costs.markdown_table(data)
    # re-measuring every study recorded supersedes the earlier commands
    costs.record("quick", [_row("sqrt_n", 11.0, 2**20), _row("(whole job)", 90.0, 3 * 2**20)], command="cmd d",
                 date="2026-01-04", load_average="0.1", machine="2 x CPU", path=path)
    assert json.loads(path.read_text())["levels"]["quick"]["commands"] == ["cmd d"]
    with pytest.raises(ValueError, match="level"):
        costs.record("huge", [], command="", date="", load_average="", machine="", path=path)


def test_missing_file_is_empty_and_help_has_no_table(tmp_path):
    data = costs.load(tmp_path / "none.json")
    assert data == {"machine": "", "levels": {}}
    assert costs.help_text(data) == ""


def test_the_shipped_file_covers_every_registered_study():
    from studies.contract import registry

    data = costs.load()
    measured = set(data["levels"].get("quick", {}).get("studies", {}))
    missing = set(registry()) - measured
    assert not missing, f"studies/data/costs.json has no quick-level figures for {sorted(missing)}: run " \
                        "python benchmarks/bench_memory.py --write --whole"


def test_verdicts_are_recorded_with_their_date_and_read_back(tmp_path):
    path = tmp_path / "costs.json"
    row = {**_row("real_models", 800.0, 2**20), "verdicts": ["holds", "not reproduced", "reproduced"]}
    costs.record("full", [row, _row("sqrt_n", 8.0, 2**20)], command="cmd", date="2026-11-26", load_average="1.0",
                 machine="2 x CPU", path=path)
    assert costs.recorded_verdict("real_models", 2, path=path) == ("not reproduced", "2026-11-26")
    assert costs.recorded_verdict("real_models", 3, path=path) == ("reproduced", "2026-11-26")
    assert costs.recorded_verdict("real_models", 4, path=path) is None        # fewer claims recorded
    assert costs.recorded_verdict("sqrt_n", 1, path=path) is None             # a run without verdicts
    assert costs.recorded_verdict("real_models", 2, level="quick", path=path) is None


def test_the_table_says_which_rows_were_measured_on_another_day():
    """A level whose rows come from runs on several days says so, study by study (the README's footnote gave the
    last run's date only, so rows measured a day apart read as measured together)."""
    row = {"wall_s": 3.0, "cpu_s": 3.0, "peak_gib": 0.4, "status": "ok", "load": "1.0"}
    data = {"machine": "m", "levels": {"quick": {"commands": ["c"], "date": "2026-11-28", "studies": {
        "sqrt_n": {**row, "date": "2026-11-27"}, "masked": {**row, "date": "2026-11-27"},
        "kernel_paths": {**row, "date": "2026-11-28"}, "(whole job)": {**row}}}}}
    assert "quick: `c`, 2026-11-27 but kernel_paths (2026-11-28), load average 1.0." in costs.markdown_table(data)
    for e in data["levels"]["quick"]["studies"].values():
        e["date"] = "2026-11-29"
    assert "quick: `c`, 2026-11-29, load average 1.0." in costs.markdown_table(data)
