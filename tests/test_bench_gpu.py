"""benchmarks/bench_gpu.py: without CUDA it says so and exits cleanly; ``--cpu-smoke`` runs every section
and row at tiny sizes on CPU (the script's code paths, not its figures) and writes the markdown page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_it_says_so_and_measures_nothing(monkeypatch, capsys, tmp_path):
    bench = _load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.md"
    assert bench.main(["--out", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.slow
def test_cpu_smoke_runs_every_row_and_writes_the_page(tmp_path):
    bench = _load()
    out = tmp_path / "gpu.md"
    assert bench.main(["--cpu-smoke", "--out", str(out)]) == 0
    text = out.read_text()
    for section in bench.SECTIONS:
        assert f"## {section}" in text
    for row in ("attention forward, d = 3, auto", "VJP (backward), d = 64", "JVP (forward + tangent), d = 64",
                "Sinkhorn, d = 3", "simulate, rk4, 10 steps", "certified Lipschitz, GPT-2-sized layer",
                "certified mean-field Lipschitz"):
        assert row in text
    assert "torch " + torch.__version__ in text
    assert (tmp_path / "gpu.json").exists()


def test_a_candidate_is_skipped_only_when_its_extrapolation_exceeds_the_margin_times_the_cap():
    """The N^2 extrapolation from the last timed N skips a candidate beyond PREDICTION_MARGIN x --cap; a
    failing candidate is reported as an error and the others are still timed."""
    bench = _load()
    b = bench.Bench(torch.device("cpu"), repeats=1, cap=1.0, smoke=True)
    b.history[("ctx", "slow")] = (1000, 0.1)
    ran = []
    fns = {"slow": lambda: ran.append("slow"), "broken": lambda: 1 / 0, "fine": lambda: ran.append("fine")}
    res = b.time(fns, n=10_000, context="ctx")   # 0.1 s x 100 = 10 s > 4 x 1 s
    assert str(res["slow"]).startswith("skipped (about 10 s predicted") and "slow" not in ran
    assert str(res["broken"]).startswith("error: ZeroDivisionError") and isinstance(res["fine"], float)
    res = b.time(fns, n=3000, context="ctx")     # 0.1 s x 9 = 0.9 s: run
    assert isinstance(res["slow"], float) and "slow" in ran
