"""benchmarks/bench_gpu.py: without CUDA it says so and exits cleanly; ``--cpu-smoke`` runs every section
and row at tiny sizes on CPU (the script's code paths, not its figures) and writes the markdown page."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name="bench_gpu"):
    """A script of benchmarks/ as a module (``name``: its file name without .py)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
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
        assert f"## {section}" in text   # (the small section has no rows without Triton's interpreter: next test)
    for row in ("attention forward, d = 3, auto", "VJP (backward), d = 64", "JVP (forward + tangent), d = 64",
                "Sinkhorn, d = 3", "simulate, rk4, 10 steps", "certified Lipschitz, GPT-2-sized layer",
                "certified mean-field Lipschitz"):
        assert row in text
    assert "torch " + torch.__version__ in text
    assert (tmp_path / "gpu.json").exists()


@pytest.mark.slow
def test_the_small_section_times_both_kernel_families_in_the_interpreter(tmp_path):
    """``--sections small`` with Triton's interpreter (the CPU's stand-in for a GPU): a forward, JVP and VJP row per
    mask and size, each timing the small-head kernels, the matrix-product kernels and SDPA (no SDPA with arbitrary
    positions), with errors against float64 at the float32 level."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "gpu.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--cpu-smoke", "--sections",
                          "small", "--out", str(out)], capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu.json").read_text())["sections"]["small"]["rows"]
    whats = {(r[0], r[1]) for r in rows}
    for mask in ("none", "positions", "causal", "weighted"):
        for what in ("forward", "JVP", "VJP"):
            assert (f"{what}, d = 3, {mask}, Triton kernels", 24) in whats
    for what, _, res, ours, _peers in rows:
        assert ours == "small-head kernels"
        assert isinstance(res["small-head kernels"], float) and isinstance(res["matrix-product kernels"], float)
        assert isinstance(res.get("SDPA padded", res.get("SDPA backward")), float) == ("positions" not in what)
        for kind in ("small-head kernels", "matrix-product kernels"):
            assert res["info"][f"{kind} rel. error"] < 1e-5, (what, res)


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


def test_a_primed_candidate_skips_its_warm_up_only_at_big_n_and_only_after_priming():
    """Bench.prime runs a row's warm-up calls only (nothing timed, no history kept); at N >= BIG_N the primed
    candidate's first call is then a timed one (one call per repeat instead of one more), elsewhere and
    unprimed the warm-up runs."""
    bench = _load()
    b = bench.Bench(torch.device("cpu"), repeats=2, cap=100.0, smoke=True)
    calls = []
    fns = {"ours": lambda: calls.append("ours"), "peer": lambda: calls.append("peer")}

    def row(n):
        return b.time(fns, n, "ctx")

    # priming: a warm-up and one timed call each, the time kept for extrapolation only (no history)
    assert b.prime(row, 10) is None and sorted(calls) == ["ours", "ours", "peer", "peer"] and not b.history
    assert set(b.primed) == {("ctx", "ours"), ("ctx", "peer")}
    calls.clear()
    res = row(bench.BIG_N)
    assert sorted(calls) == ["ours", "ours", "peer", "peer"] and all(isinstance(res[k], float) for k in fns)
    calls.clear()
    row(bench.BIG_N - 1)          # below BIG_N: warm-up again
    assert len(calls) == 6
    calls.clear()
    b.time(fns, bench.BIG_N, "other")   # never primed in this context: warm-up
    assert len(calls) == 6


def test_sizes_runs_only_those_rows_and_keeps_the_sections_other_rows(tmp_path, monkeypatch):
    """--sizes replaces a section's rows at those N and keeps its rows at other N (with their date)."""
    bench = _load()
    out = tmp_path / "gpu.md"
    store = tmp_path / "gpu.json"
    seen = []

    def section(b, quick):
        for n in bench.pick([10, 20, 30], quick):
            seen.append(n)
            yield ("row", n, {"ours": float(n)}, "ours", [])

    monkeypatch.setitem(bench.RUNNERS, "fixed", section)
    assert bench.main(["--cpu-smoke", "--sections", "fixed", "--out", str(out)]) == 0
    assert seen == [10, 20, 30]
    seen.clear()

    def section2(b, quick):
        for n in bench.pick([10, 20, 30], quick):
            seen.append(n)
            yield ("row", n, {"ours": 2.0 * n}, "ours", [])

    monkeypatch.setitem(bench.RUNNERS, "fixed", section2)
    assert bench.main(["--cpu-smoke", "--sections", "fixed", "--sizes", "20", "--out", str(out)]) == 0
    assert seen == [20]
    import json

    rows = json.loads(store.read_text())["sections"]["fixed"]["rows"]
    assert [(int(r[1]), r[2]["ours"]) for r in rows] == [(10, 10.0), (20, 40.0), (30, 30.0)]   # in place
    assert all("measured" in r[2]["info"] for r in rows)

    def section3(b, quick):   # a later run with fewer rows (a deadline, --quick, --dims) deletes none
        yield ("row", 30, {"ours": 3.0}, "ours", [])

    monkeypatch.setitem(bench.RUNNERS, "fixed", section3)
    assert bench.main(["--cpu-smoke", "--sections", "fixed", "--out", str(out)]) == 0
    rows = json.loads(store.read_text())["sections"]["fixed"]["rows"]
    assert [(int(r[1]), r[2]["ours"]) for r in rows] == [(10, 10.0), (20, 40.0), (30, 3.0)]
    text = out.read_text()
    assert "--sizes 20" in text and text.count("| row |") == 3


def test_masks_runs_only_those_masks_and_keeps_the_other_rows(tmp_path, monkeypatch):
    """--masks positions re-runs the rows with arbitrary positions of the attention sections (a lent device's
    minutes go to the rows still missing) and keeps the section's rows of the other masks."""
    bench = _load()
    out = tmp_path / "gpu.md"
    store = tmp_path / "gpu.json"
    seen = []
    monkeypatch.setattr(bench, "MASKS", list(bench.MASKS))

    def section(b, quick):
        for mask in bench.masks():
            seen.append(mask)
            yield (f"row {mask}", 10, {"ours": float(len(seen))}, "ours", [])

    monkeypatch.setitem(bench.RUNNERS, "grid", section)
    assert bench.main(["--cpu-smoke", "--sections", "grid", "--out", str(out)]) == 0
    assert seen == ["none", "weighted", "causal", "positions"]
    seen.clear()
    assert bench.main(["--cpu-smoke", "--sections", "grid", "--masks", "positions", "causal", "--out", str(out)]) == 0
    assert seen == ["causal", "positions"]   # the section's order, not the command line's
    import json

    rows = json.loads(store.read_text())["sections"]["grid"]["rows"]
    assert [(r[0], r[2]["ours"]) for r in rows] == [("row none", 1.0), ("row weighted", 2.0), ("row causal", 1.0),
                                                     ("row positions", 2.0)]
    assert bench.masks(("positions", "none", "causal")) == ["positions", "causal"]
    with pytest.raises(SystemExit):
        bench.main(["--cpu-smoke", "--sections", "grid", "--masks", "sequence", "--out", str(out)])


def test_rows_measured_together_are_all_kept_when_the_deadline_passes(tmp_path, monkeypatch):
    """The VJP and JVP rows come out of one measurement: a deadline reached after it keeps both."""
    bench = _load()
    out = tmp_path / "gpu.md"

    def section(b, quick):
        bench.time.sleep(0.3)
        yield [("VJP", 10, {"ours": 1.0}, "ours", []), ("JVP", 10, {"ours": 2.0}, "ours", [])]
        yield ("never", 10, {"ours": 3.0}, "ours", [])

    monkeypatch.setitem(bench.RUNNERS, "fixed", section)
    assert bench.main(["--cpu-smoke", "--sections", "fixed", "--deadline", "0.1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| VJP |" in text and "| JVP |" in text and "| never |" not in text and "deadline was reached" in text


def test_the_lipschitz_row_at_a_larger_n_is_skipped_when_its_extrapolation_exceeds_the_time_left(monkeypatch):
    """A certified Lipschitz call of minutes starts only if the N^2 extrapolation from the last size fits
    --deadline; the rows say what they cost, split by precision."""
    bench = _load()
    b = bench.Bench(torch.device("cpu"), repeats=1, cap=100.0, smoke=False)
    ran = []

    class Est:
        value, error, converged, applications = 1.0, 1e-7, True, 10

    def measure(b_, n, device, **kw):
        ran.append(n)
        return 2.0, Est(), {"float64 products": [4, 1.5]}

    monkeypatch.setattr(bench, "lipschitz_measure", measure)
    monkeypatch.setattr(bench, "SIZES", [10**5, 3 * 10**5, 10**6])
    b.deadline = bench.time.monotonic() + 100   # 1e5 -> 3e5: 18 s predicted, fits; 3e5 -> 1e6: 22 s, fits
    rows = list(bench.section_lipschitz(b, quick=False))
    # an untimed call at 1e4 first (CUDA's start and compilation), then the timed sizes
    assert ran == [10**4, 10**5, 3 * 10**5, 10**6] and rows[0][2]["info"]["float64 products"] == "4 in 1.50 s"
    ran.clear()
    b.deadline = bench.time.monotonic() + 25    # 18 s predicted for 3e5 > 25 - 10 s left
    rows = list(bench.section_lipschitz(b, quick=False))
    assert ran == [10**4, 10**5] and [str(r[2]["ours (GPU)"])[:7] for r in rows[1:]] == ["skipped", "skipped"]

    def failing(b_, n, device, **kw):   # a failed call reports its error, not "out of memory"
        return None, "error: RuntimeError: boom", {}

    monkeypatch.setattr(bench, "lipschitz_measure", failing)
    monkeypatch.setattr(bench, "SIZES", [10**5])
    b.deadline = None
    rows = list(bench.section_lipschitz(b, quick=False))
    assert rows[0][2]["ours (GPU)"] == "error: RuntimeError: boom"


def test_a_lipschitz_call_stops_between_products_when_the_next_would_not_fit_and_says_how_far_it_got(monkeypatch):
    """On the GPU the call at N = 1e6 ran past its step's limit and was killed, leaving no row: it now stops once the
    time left is under 1.5 times the longest product so far (+ 2 s), its row holding the products made, and the
    Jacobian's methods are restored. Real solves at a tiny size on CPU; a fake clock makes the timed call's first
    product take 30 s and the others 10 s (graph recordings none), against 100 s left at its start: a stop after 4
    products, at 60 s, with 40 s left (predicting from the last product alone would have gone on to 90 s)."""
    import types

    from meanfield import jacobian

    bench = _load()
    now = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: now[0], monotonic=lambda: now[0]))
    real = jacobian.Jacobian._product

    first = [False]

    def ten_seconds(self, *a, **kw):
        now[0] += 30.0 if first[0] else 10.0
        first[0] = False
        return real(self, *a, **kw)

    monkeypatch.setattr(jacobian.Jacobian, "_product", ten_seconds)
    b = bench.Bench(torch.device("cpu"), repeats=1, cap=None, smoke=True)
    until = [math.inf]
    b.left = lambda: until[0] - now[0]
    calls = []
    measure = bench.lipschitz_measure

    def timed_call_gets_100_s(b_, n, device, **kw):   # the untimed warm-up call has all the time it wants
        if "stop" in kw:
            until[0], first[0] = now[0] + 100.0, True
        calls.append(n)
        return measure(b_, n, device, **kw)

    monkeypatch.setattr(bench, "lipschitz_measure", timed_call_gets_100_s)
    rows = list(bench.section_lipschitz(b, quick=False))
    stopped = rows[-1][2]
    assert stopped["ours (GPU)"].startswith("stopped after 60 s"), stopped
    assert stopped["info"]["float64 products"].startswith("4 in 60.0")
    assert jacobian.Jacobian._product is ten_seconds    # product_clock put back what it wrapped
    until[0] = math.inf                                   # all the time wanted: the call finishes
    monkeypatch.setattr(bench, "lipschitz_measure", measure)
    done = list(bench.section_lipschitz(b, quick=False))[-1][2]
    assert isinstance(done["ours (GPU)"], float) and done["info"]["converged"]
    assert done["info"]["float64 products"].startswith(f"{done['info']['products']} in")


def test_a_primed_candidate_at_big_n_starts_only_if_its_extrapolation_fits_the_time_left():
    """At N >= BIG_N a primed candidate runs without a warm-up call, and only if its warm-up time at the priming
    N, scaled as N^2, fits the time left before --deadline (a call killed by the session's timeout loses the
    row); a candidate over --cap at the priming N stays skipped."""
    bench = _load()
    b = bench.Bench(torch.device("cpu"), repeats=1, cap=100.0, smoke=True)
    ran = []
    fns = {"quick": lambda: ran.append("quick"), "slow": lambda: ran.append("slow")}
    small = bench.BIG_N // 10
    b.prime(lambda: b.time(fns, small, "ctx"))
    b.primed[("ctx", "slow")] = (small, 1.0)      # 1 s a tenth of the way: 100 s predicted at BIG_N
    b.too_slow.add(("ctx", "capped"))
    b.deadline = bench.time.monotonic() + 50
    ran.clear()
    res = b.time({**fns, "capped": lambda: ran.append("capped")}, bench.BIG_N, "ctx")
    assert ran == ["quick"] and isinstance(res["quick"], float)
    assert str(res["slow"]).startswith("skipped (about") and "s left" in res["slow"]
    assert res["capped"] == "skipped (over cap at smaller N)"
