"""The reproduction report: folder layout, config.json, report.md, failure isolation, determinism."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from studies import core
from studies.core import Claim, StudyResult, register, save_figure, write_csv
from studies.report import reproduce


@pytest.fixture()
def fake_studies():
    """Two throw-away studies: one that writes a table and a figure, one that raises."""

    @register("zz_fake_ok", "A fake study", order=1000)
    def ok(out_dir, *, quick, seed):
        import matplotlib.pyplot as plt

        x = np.random.default_rng(seed).normal(size=5)
        write_csv([{"i": i, "x": float(v)} for i, v in enumerate(x)], out_dir / "data.csv")
        fig, ax = plt.subplots()
        ax.plot(x)
        ax.set_xlabel("i")
        ax.set_ylabel("x")
        save_figure(fig, out_dir / "fig.png")
        return StudyResult("zz_fake_ok", "A fake study", [Claim("x is finite", "finite", "finite", True),
                                                          Claim("a | pipe", "b", "c", False, "detail")],
                           ["fig.png", "missing.png"], ["data.csv"], {"mean": float(x.mean())}, "Some notes.")

    @register("zz_fake_fail", "A failing study", order=1001)
    def fail(out_dir, *, quick, seed):
        raise RuntimeError("boom from the fake study")

    yield ["zz_fake_ok", "zz_fake_fail"]
    for name in ("zz_fake_ok", "zz_fake_fail"):
        core._REGISTRY.pop(name, None)


def test_report_folder_config_and_markdown(tmp_path, fake_studies):
    summary = reproduce(tmp_path, quick=True, seed=3, only=fake_studies, progress=False)
    assert summary["failed"] == ["zz_fake_fail"] and not summary["ok"]
    assert summary["disagreeing_claims"] == [["zz_fake_ok", "a | pipe"]] or \
        summary["disagreeing_claims"] == [("zz_fake_ok", "a | pipe")]
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("seed", "quick", "grid", "studies", "python", "torch", "device", "packages", "command", "sweep"):
        assert key in config, key
    assert config["seed"] == 3 and config["quick"] is True and config["studies"] == fake_studies
    for pkg in ("torch", "numpy", "scipy", "pot", "matplotlib"):
        assert config["packages"][pkg], pkg
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["studies"]["zz_fake_fail"]["status"] == "failed"
    assert "boom from the fake study" in on_disk["studies"]["zz_fake_fail"]["error"]

    md = (tmp_path / "report.md").read_text()
    assert "| study | claim | theory | measured | agrees |" in md
    # every figure that exists is shown; a declared figure that is absent is not linked
    pngs = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png"))
    assert pngs == ["zz_fake_ok/fig.png"]
    for p in pngs:
        assert f"]({p})" in md
    assert "missing.png" not in md
    assert "zz_fake_ok/data.csv" in md
    # the failing study is in the table and its traceback in its section; pipes are escaped
    assert re.search(r"\| zz_fake_fail \| study failed \|.*boom from the fake study.*\| \*\*failed\*\* \|", md)
    assert "RuntimeError" in md
    assert "a \\| pipe" in md
    assert "1 of 2 claims agree" in md


def test_same_seed_same_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("MEANFIELD_TINY", "1")
    a = reproduce(tmp_path / "a", quick=True, seed=1, only=["large_radius"], progress=False)
    b = reproduce(tmp_path / "b", quick=True, seed=1, only=["large_radius"], progress=False)
    assert a["studies"]["large_radius"]["status"] == "ok"
    tables = sorted(p.name for p in (tmp_path / "a" / "large_radius").glob("*.csv"))
    assert tables
    for name in tables:
        assert (tmp_path / "a" / "large_radius" / name).read_bytes() == \
            (tmp_path / "b" / "large_radius" / name).read_bytes(), name
    assert a["studies"]["large_radius"]["claims"] == b["studies"]["large_radius"]["claims"]


def test_unknown_study_name_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="only: unknown study"):
        reproduce(tmp_path, only=["no_such_study"], progress=False)


def test_grid_level(monkeypatch):
    monkeypatch.delenv("MEANFIELD_TINY", raising=False)
    assert core.grid_level(True) == "quick" and core.grid_level(False) == "full"
    monkeypatch.setenv("MEANFIELD_TINY", "1")
    assert core.grid_level(False) == "tiny"


def test_run_grid_rows_in_grid_order_and_failures_raise(tmp_path):
    rows = core.run_grid(_square, [{"x": 3}, {"x": 2}], tmp_path, "sq")
    assert [(r["x"], r["y"]) for r in rows] == [(3, 9), (2, 4)]
    with pytest.raises(RuntimeError, match="1 of 2 grid points failed"):
        core.run_grid(_square_or_fail, [{"x": 1}, {"x": -1}], tmp_path, "sq_fail")


def _square(x):
    return {"y": x * x}


def _square_or_fail(x):
    if x < 0:
        raise ValueError("x: negative")
    return {"y": x * x}


CALLS: list[int] = []


def counted_task(x):
    CALLS.append(x)
    return {"y": 2 * x}


def test_run_grid_resumes_only_results_of_the_same_code(tmp_path, monkeypatch):
    from studies import core

    grid = [{"x": 1}, {"x": 2}]
    CALLS.clear()
    assert core.run_grid(counted_task, grid, tmp_path, "g") == [{"x": 1, "y": 2}, {"x": 2, "y": 4}]
    assert CALLS == [1, 2]
    core.run_grid(counted_task, grid, tmp_path, "g")          # same code: resumed, nothing recomputed
    assert CALLS == [1, 2]
    monkeypatch.setattr(core, "code_fingerprint", lambda: "another-version")
    assert core.run_grid(counted_task, grid, tmp_path, "g") == [{"x": 1, "y": 2}, {"x": 2, "y": 4}]
    assert CALLS == [1, 2, 1, 2]                              # other code: every task recomputed


def test_code_fingerprint_tracks_the_source():
    import hashlib
    from pathlib import Path

    from studies.core import code_fingerprint

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in ("particles", "transport", "meanfield", "studies"):
        for f in sorted((root / pkg).glob("*.py")):
            h.update(f"{pkg}/{f.name}\0".encode())
            h.update(f.read_bytes())
    assert code_fingerprint() == h.hexdigest()[:12]


def test_a_missing_study_module_is_reported_not_skipped(monkeypatch):
    from studies import core

    monkeypatch.setattr(core, "STUDY_MODULES", [*core.STUDY_MODULES, "studies.no_such_study"])
    core.registry()
    assert "No module named 'studies.no_such_study'" in core.import_errors()["studies.no_such_study"]
    monkeypatch.undo()
    core.registry()
    assert "studies.no_such_study" not in core.import_errors()
