"""The reproduction report: folder layout, config.json, report.md, claim kinds and verdicts, failure
isolation, a report written as each study finishes, determinism, and the grid runner."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from studies import contract
from studies.context import RunContext
from studies.contract import Claim, StudyResult, register
from studies.grid import run_grid
from studies.io import save_figure, write_csv
from studies.report import claims_table, readme_excerpt, reproduce


@pytest.fixture()
def fake_studies():
    """Three throw-away studies: one that writes a table and a figure, one that raises, one that
    checks what the report holds while it runs (after the first two finished)."""
    seen = {}

    @register("zz_fake_ok", "A fake study", order=1000)
    def ok(out_dir, ctx):
        import matplotlib.pyplot as plt

        x = np.random.default_rng(ctx.seed).normal(size=5)
        write_csv([{"i": i, "x": float(v)} for i, v in enumerate(x)], out_dir / "data.csv")
        fig, ax = plt.subplots()
        ax.plot(x)
        ax.set_xlabel("i")
        ax.set_ylabel("x")
        save_figure(fig, out_dir / "fig.png")
        claims = [Claim("x is finite", "finite", "finite", True, kind="theorem", fails_if="x is not finite"),
                  Claim("a | pipe", "b", "c", False, "detail", kind="theorem", fails_if="never"),
                  Claim("an observation", "o", "p", False, kind="empirical", fails_if="q"),
                  Claim("undecided", "o", "p", None, kind="empirical", fails_if="r")]
        return StudyResult("zz_fake_ok", "A fake study", claims, ["fig.png", "missing.png"], ["data.csv"],
                           {"mean": float(x.mean()), "inf": float("inf")}, "Some notes.",
                           captions={"fig.png": "Five normal draws x against i.", "missing.png": "Never drawn."})

    @register("zz_fake_fail", "A failing study", order=1001)
    def fail(out_dir, ctx):
        raise RuntimeError("boom from the fake study")

    @register("zz_fake_peek", "Looks at the report while it runs", order=1002)
    def peek(out_dir, ctx):
        seen["summary"] = json.loads((ctx.out / "summary.json").read_text())
        seen["report"] = (ctx.out / "report.md").read_text()
        return StudyResult("zz_fake_peek", "peek")

    yield ["zz_fake_ok", "zz_fake_fail", "zz_fake_peek"], seen
    for name in ("zz_fake_ok", "zz_fake_fail", "zz_fake_peek"):
        contract.unregister(name)


def test_report_folder_config_and_markdown(tmp_path, fake_studies):
    names, seen = fake_studies
    summary = reproduce(RunContext(tmp_path, level="quick", seed=3), only=names)
    assert summary["failed"] == ["zz_fake_fail"] and not summary["ok"] and summary["complete"]
    assert summary["violated_claims"] == [["zz_fake_ok", "a | pipe"]]
    assert summary["not_reproduced"] == [["zz_fake_ok", "an observation"]]
    assert summary["inconclusive"] == [["zz_fake_ok", "undecided"]]
    assert summary["verdicts"] == {"holds": 1, "violated": 1, "reproduced": 0, "not reproduced": 1,
                                   "inconclusive": 1}
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("seed", "quick", "grid", "studies", "python", "torch", "device", "packages", "command", "sweep"):
        assert key in config, key
    assert config["seed"] == 3 and config["quick"] is True and config["studies"] == names
    for pkg in ("torch", "numpy", "scipy", "pot", "matplotlib"):
        assert config["packages"][pkg], pkg
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["studies"]["zz_fake_fail"]["status"] == "failed"
    assert "boom from the fake study" in on_disk["studies"]["zz_fake_fail"]["error"]
    claims = on_disk["studies"]["zz_fake_ok"]["claims"]
    assert [(c["kind"], c["verdict"], c["fails_if"]) for c in claims] == [
        ("theorem", "holds", "x is not finite"), ("theorem", "violated", "never"),
        ("empirical", "not reproduced", "q"), ("empirical", "inconclusive", "r")]
    assert on_disk["studies"]["zz_fake_ok"]["summary"]["inf"] == "inf"   # strict JSON: no Infinity token

    md = (tmp_path / "report.md").read_text()
    assert "| id | claim | kind | verdict | measured |" in md
    # every figure that exists is shown; a declared figure that is absent is not linked
    pngs = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png"))
    assert pngs == ["zz_fake_ok/fig.png"]
    for p in pngs:
        assert f"]({p})" in md
    assert "missing.png" not in md and "Never drawn" not in md
    # the figure is numbered, and its caption (the study's words) is printed under it
    assert "![Figure 1: zz_fake_ok/fig.png](zz_fake_ok/fig.png)\n\n*Figure 1 (`zz_fake_ok/fig.png`).* Five normal " \
           "draws x against i.\n" in md
    assert "zz_fake_ok/data.csv" in md
    # the failing study is in the table and its traceback in its section; no cell needs an escape
    assert re.search(r"\| zz_fake_fail \| study failed \|.*\| \*\*failed\*\* \|.*boom from the fake study", md)
    assert "RuntimeError" in md and "\\|" not in md
    assert "| zz_fake_ok-2 | a / pipe | theorem | **violated** | c |" in md
    assert "| zz_fake_ok-3 | an observation | empirical | **not reproduced** | p |" in md
    assert "| zz_fake_ok-4 | undecided | empirical | inconclusive | p |" in md
    # the long texts are in the study's section, under the claim's id
    assert "- **zz_fake_ok-2** *a | pipe* (theorem, violated). Theory: b. Measured: c. Detail. Fails if never." in md
    assert "Fails if x is not finite." in md
    assert "theorem claims: 1 hold, 1 violated; empirical claims: 0 reproduced, 1 not reproduced" in md
    # the summary comes before the table, one line per claim to act on, with the next step
    top = md[:md.index("## Claims")]
    assert "**violated** `zz_fake_ok-2`: a / pipe. Measured: c. Next: a bug" in top
    assert "**not reproduced** `zz_fake_ok-3`: an observation. Measured: p. Next: check it on the full grid: " \
           "`meanfield zz_fake_ok --seed 3 --out runs/zz_fake_ok-full`" in top
    assert "**inconclusive** `zz_fake_ok-4`: undecided. Measured: p. Next: run the full grid" in top
    assert "**study failed** `zz_fake_fail`: RuntimeError: boom from the fake study." in top
    assert "the run's own command, with the same --out, runs it again and keeps the grid points that finished" in top
    # the README's copy: the same summary lines and table, read back from the run folder
    excerpt = readme_excerpt(tmp_path)
    assert excerpt.endswith(claims_table(summary)) and claims_table(summary) in md
    assert [line for line in excerpt.splitlines() if line.startswith("- **")] == \
        [line for line in top.splitlines() if line.startswith("- **")]

    # while the third study ran, the first two were already aggregated on disk
    assert set(seen["summary"]["studies"]) == {"zz_fake_ok", "zz_fake_fail"}
    assert seen["summary"]["running"] == "zz_fake_peek" and not seen["summary"]["complete"]
    assert "Not finished yet: zz_fake_peek" in seen["report"]
    assert "Not finished yet" not in md


def test_next_step_says_what_the_recorded_full_grid_found(monkeypatch):
    """At the quick level a claim the full grid did not reproduce either is a finding, not a reason to wait 14
    minutes; one the full grid reproduced says so; without a record the step is to run it."""
    from studies import report

    config = {"grid": "quick", "seed": 0}
    found = {("rm", 5): ("not reproduced", "2026-11-26"), ("rm", 4): ("reproduced", "2026-11-26")}
    monkeypatch.setattr(report.costs, "recorded_verdict", lambda name, k: found.get((name, k)))
    assert report._next_step("rm", "not reproduced", config, index=5).startswith(
        "a finding: the full grid did not reproduce it either (recorded 2026-11-26")
    assert report._next_step("rm", "inconclusive", config, index=4).startswith(
        "the full grid found it reproduced (recorded 2026-11-26); to check: meanfield rm")
    assert report._next_step("rm", "inconclusive", config, index=3).startswith("run the full grid")
    assert report._next_step("rm", "not reproduced", config, index=3).startswith("check it on the full grid")
    assert report._next_step("rm", "not reproduced", {"grid": "full", "seed": 0}, index=5).startswith(
        "a finding on the full grid")


def test_claims_say_their_kind_and_how_they_fail():
    with pytest.raises(TypeError):
        Claim("c", "t", "m", True, "d", "theorem")    # kind and fails_if are keywords
    with pytest.raises(ValueError, match="fails_if"):
        Claim("c", "t", "m", True, kind="theorem")
    with pytest.raises(ValueError, match="kind"):
        Claim("c", "t", "m", True, kind="conjecture", fails_if="f")
    with pytest.raises(ValueError, match="agrees"):
        Claim("c", "t", "m", None, kind="theorem", fails_if="f")
    assert Claim("c", "t", "m", np.bool_(True), kind="empirical", fails_if="f").verdict == "reproduced"


def test_claims_carry_short_forms_for_the_table():
    with pytest.raises(ValueError, match="short: at most"):
        Claim("c", "t", "m", True, fails_if="f", short="x" * (contract.SHORT_MAX + 1))
    # the measured cell's numbers come from the run: a long one (a wrong implementation's peak of 3.1623e+07 at
    # n = 1e+09 made mean_field's peak claim raise, and the study failed with every verdict lost) is cut, never raised
    assert Claim("c", "t", "m", True, fails_if="f", short_measured="a | b").short_measured == "a / b"
    wide = Claim("c", "t", "m", False, fails_if="f", short_measured="peak 3.1623e+07 at n = 1e+09 " * 4)
    assert len(wide.short_measured) <= contract.SHORT_MAX and wide.short_measured.endswith("…")
    assert wide.verdict == "violated"
    with pytest.raises(TypeError, match="short"):
        Claim("c", "t", "m", True, fails_if="f", short=3)
    c = Claim("c", "t", "m", True, fails_if="f", short="s", short_measured="sm")
    assert (c.to_dict()["short"], c.to_dict()["short_measured"]) == ("s", "sm")
    # without them: the long texts, asides in parentheses dropped, the first clause of the measurement,
    # norms as a character that needs no escape, cut at a word with an ellipsis
    long = Claim("Theorem 3.7: Lip_(RX) -> ||V|| sqrt(max multiplicity) (Castin et al. 2024), random direction",
                 "t", "3.08959 at R = 46.5 (docs/math.md section 5); more details; and more", True, fails_if="f")
    assert long.short == "Theorem 3.7: Lip_(RX) -> ‖V‖ sqrt(max multiplicity), random direction"
    assert long.short_measured == "3.08959 at R = 46.5"
    math_kept = Claim("Lip <= ||W_O|| (sum_h bound_h^2)^{1/2} (Lemma 3.8, biases absorbed)", "t",
                      "5 of 6 layers with 95% CI inside (0, 0.5); mean 0.25", True, fails_if="f")
    assert math_kept.short == "Lip <= ‖W_O‖ (sum_h bound_h^2)^{1/2}"
    assert math_kept.short_measured == "5 of 6 layers with 95% CI inside (0, 0.5)"
    cut = contract.shorten("word " * 30)
    assert cut.endswith("word…") and len(cut) <= contract.SHORT_MAX


def test_same_seed_same_tables(tmp_path):
    a = reproduce(RunContext(tmp_path / "a", level="tiny", seed=1), only=["large_radius"])
    b = reproduce(RunContext(tmp_path / "b", level="tiny", seed=1), only=["large_radius"])
    assert a["studies"]["large_radius"]["status"] == "ok"
    tables = sorted(p.name for p in (tmp_path / "a" / "large_radius").glob("*.csv"))
    assert tables
    for name in tables:
        assert (tmp_path / "a" / "large_radius" / name).read_bytes() == \
            (tmp_path / "b" / "large_radius" / name).read_bytes(), name
    assert a["studies"]["large_radius"]["claims"] == b["studies"]["large_radius"]["claims"]


def test_unknown_study_name_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="only: unknown study"):
        reproduce(RunContext(tmp_path), only=["no_such_study"])
    with pytest.raises(TypeError, match="ctx"):
        reproduce(tmp_path)


def test_run_context_checks_its_fields(tmp_path):
    ctx = RunContext(str(tmp_path), level="quick", seed=np.int64(4))
    assert ctx.out == tmp_path and ctx.seed == 4 and ctx.quick and ctx.with_(level="full").quick is False
    for bad, err in [({"level": "huge"}, "level"), ({"device": "tpu"}, "device"), ({"sweep": {"nope": 1}}, "sweep"),
                     ({"verbosity": 3}, "verbosity")]:
        with pytest.raises(ValueError, match=err):
            RunContext(tmp_path, **bad)
    with pytest.raises(TypeError, match="seed"):
        RunContext(tmp_path, seed=1.5)
    with pytest.raises(TypeError, match="checkpoints"):
        RunContext(tmp_path, checkpoints="/one/path")
    env = RunContext.from_environment(tmp_path, {"SMOOTH_ATTENTION_CHECKPOINTS": "a:b", "SMOOTH_ATTENTION_TEXT": ""})
    assert env.checkpoints == ("a", "b") and env.text is None


def test_studies_read_no_environment():
    """No study module reads the environment or keeps run settings in module state."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "studies" / "experiments"
    for f in root.glob("*.py"):
        text = f.read_text()
        assert "os.environ" not in text and "getenv" not in text, f.name


def test_run_grid_rows_in_grid_order_and_failures_raise(tmp_path):
    rows = run_grid(_square, [{"x": 3}, {"x": 2}], tmp_path, "sq")
    assert [(r["x"], r["y"]) for r in rows] == [(3, 9), (2, 4)]
    with pytest.raises(RuntimeError, match="1 of 2 grid points failed") as err:
        run_grid(_square_or_fail, [{"x": 1}, {"x": -1}], tmp_path, "sq_fail")
    # the task's own traceback, where the report showed only run_grid's (a sweeps review), and how to resume
    text = str(err.value)
    assert "in _square_or_fail" in text and "failures.json" in text and "resumes from them" in text


def test_run_grid_names_every_failed_point(tmp_path):
    with pytest.raises(RuntimeError, match="7 of 8 grid points failed") as err:
        run_grid(_square_or_fail, [{"x": 1}] + [{"x": -k} for k in range(1, 8)], tmp_path, "many")
    assert "{'x': -5}" in str(err.value) and "and 2 more" in str(err.value)


def test_run_grid_passes_the_device_outside_the_rows(tmp_path):
    rows = run_grid(_where, [{"x": 1}], tmp_path, "dev", device="cpu")
    assert rows == [{"x": 1, "on": "cpu"}]


def _where(x, device=None):
    return {"on": device}


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
    from studies import grid as grid_module

    grid = [{"x": 1}, {"x": 2}]
    CALLS.clear()
    assert run_grid(counted_task, grid, tmp_path, "g") == [{"x": 1, "y": 2}, {"x": 2, "y": 4}]
    assert CALLS == [1, 2]
    run_grid(counted_task, grid, tmp_path, "g")          # same code: resumed, nothing recomputed
    assert CALLS == [1, 2]
    monkeypatch.setattr(grid_module, "code_fingerprint", lambda: "another-version")
    assert run_grid(counted_task, grid, tmp_path, "g") == [{"x": 1, "y": 2}, {"x": 2, "y": 4}]
    assert CALLS == [1, 2, 1, 2]                              # other code: every task recomputed


def test_run_grid_takes_the_lock_before_emptying_a_folder(tmp_path, monkeypatch):
    """Records of another code version are removed only by the holder of the sweep's lock: a
    second process working in the folder keeps them (and the call is refused)."""
    import fcntl

    from studies import grid as grid_module

    run_grid(counted_task, [{"x": 1}], tmp_path, "g")
    records = sorted((tmp_path / "_sweep_g" / "records").iterdir())
    monkeypatch.setattr(grid_module, "code_fingerprint", lambda: "another-version")
    with open(tmp_path / "_sweep_g" / ".lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="in use"):
            run_grid(counted_task, [{"x": 1}], tmp_path, "g")
        assert sorted((tmp_path / "_sweep_g" / "records").iterdir()) == records


def test_code_fingerprint_tracks_the_source():
    import hashlib
    from pathlib import Path

    from studies.grid import code_fingerprint

    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in ("particles", "transport", "meanfield", "studies"):
        for f in sorted((root / pkg).rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
            h.update(f"{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    assert code_fingerprint() == h.hexdigest()[:12]
    assert (root / "studies" / "sweep" / "runner.py").exists()   # subpackages are part of it


def test_a_missing_study_module_is_reported_not_skipped(monkeypatch):
    monkeypatch.setattr(contract, "STUDY_MODULES", [*contract.STUDY_MODULES, "studies.experiments.no_such_study"])
    contract.registry()
    assert "No module named" in contract.import_errors()["studies.experiments.no_such_study"]
    monkeypatch.undo()
    contract.registry()
    assert "studies.experiments.no_such_study" not in contract.import_errors()


def test_the_report_order_is_said_once_in_study_modules():
    """The framework's studies run in the order of STUDY_MODULES (no second number to keep in step), the
    package docstring lists them in that order, and a study registered from elsewhere comes after them."""
    import studies.experiments as experiments

    names = [m.rsplit(".", 1)[1] for m in contract.STUDY_MODULES]
    builtin = [n for n in contract.registry() if n in names]
    assert builtin == names
    listed = [line.split()[0] for line in experiments.__doc__.splitlines()[2:] if line.strip()]
    assert listed == names

    def run(out_dir, ctx):
        raise AssertionError("not run")

    register("zz_user_study", "a user's study")(run)
    try:
        assert list(contract.registry())[-1] == "zz_user_study"
    finally:
        contract.unregister("zz_user_study")
    with pytest.raises(TypeError, match="order"):
        register("zz_bad", "bad order", order="first")


def test_the_report_names_this_trees_version_also_when_it_runs_uninstalled(monkeypatch):
    """A source tree on PYTHONPATH (a lent GPU machine, where nothing is installed) reported
    'smooth-attention None': the version comes from the tree's pyproject.toml then."""
    import importlib.metadata as md

    from studies import report

    real = md.version
    try:  # the version the build backend read from pyproject.toml at install time (pip install -e .)
        expected = real("smooth-attention")
    except md.PackageNotFoundError:
        pytest.skip("smooth-attention is not installed: no independent reading of its version here")
    real_distribution = md.distribution

    def no_distribution(name):
        if name == "smooth-attention":
            raise md.PackageNotFoundError(name)
        return real_distribution(name)

    monkeypatch.setattr(md, "distribution", no_distribution)
    assert report._versions(["smooth-attention", "torch"]) == {"smooth-attention": expected,
                                                                "torch": real("torch")}


@pytest.fixture()
def two_studies():
    """Two quick throw-away studies whose folders hold a result.json; ``runs`` counts their runs."""
    runs = []

    def make(name):
        def run(out_dir, ctx):
            runs.append(name)
            write_csv([{"seed": ctx.seed}], out_dir / "t.csv")
            return StudyResult(name, name, [Claim("c", "t", "m", True, kind="theorem", fails_if="never")],
                               tables=["t.csv"])
        return run

    for k, name in enumerate(("zz_left_a", "zz_left_b")):
        register(name, name, order=2000 + k)(make(name))
    yield runs
    for name in ("zz_left_a", "zz_left_b"):
        contract.unregister(name)


def test_study_folders_of_an_earlier_run_are_listed_as_not_part_of_the_report(tmp_path, two_studies):
    """An --out folder reused with another --only (and seed): the earlier run's study folder stays (nothing is
    deleted) and the report, summary.json and the terminal say it is not part of this run; resuming the same run
    is unchanged (reused, nothing listed)."""
    from studies.report import not_in_run_line

    out = tmp_path / "r"
    first = reproduce(RunContext(out, level="tiny", seed=0, progress=False), only=["zz_left_a", "zz_left_b"])
    assert first["not_in_run"] == [] and "Not part of this report" not in (out / "report.md").read_text()
    again = reproduce(RunContext(out, level="tiny", seed=0, progress=False), only=["zz_left_a", "zz_left_b"])
    assert again["reused"] == ["zz_left_a", "zz_left_b"] and again["not_in_run"] == []   # resumption as before
    assert two_studies == ["zz_left_a", "zz_left_b"]

    other = reproduce(RunContext(out, level="tiny", seed=3, progress=False), only=["zz_left_a"])
    assert two_studies[2:] == ["zz_left_a"] and list(other["studies"]) == ["zz_left_a"]
    assert (out / "zz_left_b" / "result.json").is_file()   # kept
    finished = json.loads((out / "zz_left_b" / "result.json").read_text())["finished"]
    assert other["not_in_run"] == [{"name": "zz_left_b", "status": "ok", "finished": finished,
                                    "same_settings": False}]
    assert json.loads((out / "summary.json").read_text())["not_in_run"] == other["not_in_run"]
    report = (out / "report.md").read_text()
    assert "**Not part of this report**" in report
    assert f"- `zz_left_b/`: finished at {finished} with other code or settings" in report
    assert "## zz_left_b" not in report
    assert not_in_run_line(other, out) == (f"note: {out} also holds zz_left_b/ from an earlier run: not part of "
                                           "this report (kept; report.md lists them)")
    # with the earlier seed again, the left folder matches this run's settings: adding it to --only reuses it
    same = reproduce(RunContext(out, level="tiny", seed=0, progress=False), only=["zz_left_a"])
    assert same["not_in_run"][0]["same_settings"] is True
    assert "with this run's code and settings (adding it to `--only` reuses it)" in (out / "report.md").read_text()


def test_a_figure_without_a_caption_is_refused():
    """The report prints each figure's caption under it: a study that lists a figure without one, or a caption
    for a figure it does not list, is a ValueError naming the argument and the figure."""
    with pytest.raises(ValueError, match=r"captions: zz's figures \['b.png'\] have no caption"):
        StudyResult("zz", "t", figures=["a.png", "b.png"], captions={"a.png": "A.", "b.png": "  "})
    with pytest.raises(ValueError, match=r"captions: \['c.png'\] are not among zz's figures"):
        StudyResult("zz", "t", figures=["a.png"], captions={"a.png": "A.", "c.png": "C."})
    with pytest.raises(TypeError, match="captions: expected a dict"):
        StudyResult("zz", "t", figures=["a.png"], captions=["A."])
    assert StudyResult("zz", "t", figures=["a.png"], captions={"a.png": "A."}).to_dict()["captions"] == {"a.png": "A."}
