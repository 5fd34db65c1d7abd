"""An interrupted run (Ctrl-C, SIGTERM): the report says that it was interrupted, when, during which
study and after how many, and gives the command that resumes it; that command reuses the studies that
finished with the same code and settings and runs the rest; the exit code is 128 + the signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from studies import contract
from studies import report as report_module
from studies.cli import EXIT_INTERRUPTED, main
from studies.context import RunContext
from studies.contract import Claim, StudyResult, register
from studies.io import write_csv
from studies.report import reproduce

REPO = Path(__file__).resolve().parents[2]
CALLS: list[str] = []


@pytest.fixture()
def two_studies():
    """zz_a finishes; zz_b is interrupted the first time it runs (``STATE["interrupt"]``)."""
    state = {"interrupt": True}
    CALLS.clear()

    @register("zz_a", "first", order=1000)
    def first(out_dir, ctx):
        CALLS.append("zz_a")
        write_csv([{"x": 1}], out_dir / "a.csv")
        return StudyResult("zz_a", "first", [Claim("ok", "t", "m", True, fails_if="f")], tables=["a.csv"])

    @register("zz_b", "second", order=1001)
    def second(out_dir, ctx):
        CALLS.append("zz_b")
        write_csv([{"y": 1}], out_dir / "b.csv")   # a first table, written before the interruption
        if state["interrupt"]:
            raise KeyboardInterrupt   # what Ctrl-C does in the middle of a study
        write_csv([{"y": 1}, {"y": 2}], out_dir / "b.csv")
        return StudyResult("zz_b", "second", [Claim("also ok", "t", "m", True, fails_if="f")], tables=["b.csv"])

    yield state
    contract.unregister("zz_a")
    contract.unregister("zz_b")


def test_an_interrupted_run_says_when_where_and_how_to_resume(tmp_path, two_studies):
    argv = ("/somewhere/bin/meanfield", "reproduce", "--only", "zz_a", "zz_b", "--no-resume")
    before = time.strftime("%Y-%m-%dT%H:%M")
    with pytest.raises(KeyboardInterrupt):
        reproduce(RunContext(tmp_path, argv=argv), only=["zz_a", "zz_b"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["studies"]) == ["zz_a"] and summary["pending"] == ["zz_b"] and not summary["ok"]
    stop = summary["interrupted"]
    assert (stop["during"], stop["done"], stop["of"], stop["signal"]) == ("zz_b", 1, 2, "SIGINT")
    assert stop["at"] >= before   # ISO times compare as strings
    # the same command into the same folder, resuming (the run's --no-resume is dropped)
    assert stop["resume"] == f"meanfield reproduce --only zz_a zz_b --out {tmp_path}"
    md = (tmp_path / "report.md").read_text()
    summary_part = md[:md.index("## Claims")]
    assert (f"**Interrupted** (SIGINT) at {stop['at']} during `zz_b`, after 1 of 2 studies. Resume with "
            f"`meanfield reproduce --only zz_a zz_b --out {tmp_path}`") in summary_part
    assert "Not finished yet" not in md
    assert "| zz_a-1 | ok | theorem | holds | m |" in md


def test_the_resume_command_reuses_finished_studies_of_the_same_code_and_settings(tmp_path, two_studies,
                                                                                   monkeypatch):
    with pytest.raises(KeyboardInterrupt):
        reproduce(RunContext(tmp_path), only=["zz_a", "zz_b"])
    assert CALLS == ["zz_a", "zz_b"]
    two_studies["interrupt"] = False
    summary = reproduce(RunContext(tmp_path), only=["zz_a", "zz_b"])
    assert CALLS == ["zz_a", "zz_b", "zz_b"]            # zz_a was reused, not run again
    assert summary["ok"] and summary["interrupted"] is None and summary["reused"] == ["zz_a"]
    assert summary["studies"]["zz_a"]["claims"][0]["verdict"] == "holds"
    md = (tmp_path / "report.md").read_text()
    assert "Reused from an earlier run in this folder (same code and settings): zz_a." in md
    assert "Interrupted" not in md
    # --no-resume runs everything again; so does another seed (another fingerprint), and other code
    reproduce(RunContext(tmp_path, sweep={"resume": False}), only=["zz_a", "zz_b"])
    assert CALLS[3:] == ["zz_a", "zz_b"]
    reproduce(RunContext(tmp_path, seed=1), only=["zz_a", "zz_b"])
    assert CALLS[5:] == ["zz_a", "zz_b"]
    monkeypatch.setattr(report_module, "code_fingerprint", lambda: "other-code")
    reproduce(RunContext(tmp_path, seed=1), only=["zz_a", "zz_b"])
    assert CALLS[7:] == ["zz_a", "zz_b"]
    monkeypatch.undo()
    reproduce(RunContext(tmp_path, seed=1), only=["zz_a", "zz_b"])   # the records are of the other code
    assert CALLS[9:] == ["zz_a", "zz_b"]
    reproduce(RunContext(tmp_path, seed=1), only=["zz_a", "zz_b"])
    assert CALLS[11:] == []
    (tmp_path / "zz_a" / "a.csv").unlink()                             # a study whose table is gone runs again
    reproduce(RunContext(tmp_path, seed=1), only=["zz_a", "zz_b"])
    assert CALLS[11:] == ["zz_a"]


def test_the_command_line_exits_130_and_prints_the_resume_command(tmp_path, two_studies, capsys):
    code = main(["reproduce", "--only", "zz_a", "zz_b", "--out", str(tmp_path), "--no-progress"])
    assert code == EXIT_INTERRUPTED == 130
    err = capsys.readouterr().err
    assert "interrupted during zz_b (1 of 2 studies done)" in err
    assert f"Resume with: meanfield reproduce --only zz_a zz_b --no-progress --out {tmp_path}" in err
    two_studies["interrupt"] = False
    assert main(["reproduce", "--only", "zz_a", "zz_b", "--no-progress", "--out", str(tmp_path)]) == 0
    assert CALLS == ["zz_a", "zz_b", "zz_b"]


_CHILD = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal, even if the parent ignores it
    from studies import cli
    from studies.contract import Claim, StudyResult, register
    out = Path(sys.argv[1])

    @register("zz_quick", "finishes", order=5000)
    def quick(out_dir, ctx):
        return StudyResult("zz_quick", "finishes", [Claim("ok", "t", "m", True, fails_if="f")])

    @register("zz_slow", "waits for the signal", order=5001)
    def slow(out_dir, ctx):
        (out / "started").write_text("yes")
        time.sleep(120)
        return StudyResult("zz_slow", "never")

    sys.exit(cli.main(["reproduce", "--only", "zz_quick", "zz_slow", "--out", str(out), "--no-progress"]))
""")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_real_signal_in_the_middle_of_a_study(tmp_path, sig, code):
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(out)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (out / "started").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the child never reached the slow study"
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    name = signal.Signals(sig).name
    assert "interrupted during zz_slow (1 of 2 studies done)" in err and "Traceback" not in err
    stop = json.loads((out / "summary.json").read_text())["interrupted"]
    assert (stop["during"], stop["done"], stop["of"], stop["signal"]) == ("zz_slow", 1, 2, name)
    md = (out / "report.md").read_text()
    assert f"**Interrupted** ({name}) at {stop['at']} during `zz_slow`, after 1 of 2 studies" in md
    assert f"meanfield reproduce --only zz_quick zz_slow --no-progress --out {out}" in md


@pytest.mark.parametrize("age", [60, 0])
def test_an_interruption_before_this_run_wrote_anything_does_not_report_the_last_run(tmp_path, two_studies,
                                                                                      capsys, monkeypatch, age):
    """A run interrupted during its checks (before it writes a summary) printed the study and resume command of
    the previous run found in the folder's summary.json; then only a summary whose file time was within a second of
    this run's start was read, so a run right after the last one (age 0) still printed that run's. Now the line
    comes from this run's interruption itself, whatever the file times."""
    import os

    from studies import report

    assert main(["reproduce", "--only", "zz_a", "zz_b", "--out", str(tmp_path), "--no-progress"]) == 130
    capsys.readouterr()
    if age:
        old = (tmp_path / "summary.json").stat().st_mtime - age
        os.utime(tmp_path / "summary.json", (old, old))   # written by the run before

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "check_run", interrupted)
    assert main(["reproduce", "--only", "zz_a", "--out", str(tmp_path), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "zz_b" not in err and "interrupted; the studies that finished are in" in err


def test_the_interrupted_study_folder_says_its_tables_are_partial(tmp_path, two_studies):
    """An interrupted study's folder held the tables it had written and, from an earlier finished run, a result.json
    with status ok: nothing there said that the tables were partial. Now result.json says "interrupted" (never
    reused) and INTERRUPTED.txt explains; a study that finishes there later removes the marker."""
    two_studies["interrupt"] = False
    reproduce(RunContext(tmp_path), only=["zz_a", "zz_b"])          # a finished run: zz_b/result.json is ok
    assert json.loads((tmp_path / "zz_b" / "result.json").read_text())["status"] == "ok"
    two_studies["interrupt"] = True
    with pytest.raises(KeyboardInterrupt):
        reproduce(RunContext(tmp_path, seed=7), only=["zz_a", "zz_b"])   # other settings: zz_b runs again
    sdir = tmp_path / "zz_b"
    result = json.loads((sdir / "result.json").read_text())
    assert result["status"] == "interrupted" and result["signal"] == "SIGINT" and result["tables"] == []
    assert result["fingerprint"] == report_module.study_fingerprint("zz_b", RunContext(tmp_path, seed=7))
    marker = (sdir / report_module.INTERRUPTED_MARKER).read_text()
    assert "interrupted (SIGINT)" in marker and "partial" in marker
    assert (sdir / "b.csv").read_text().count("\n") == 2     # the partial table is there, and said to be
    md = (tmp_path / "report.md").read_text()
    marker_name = report_module.INTERRUPTED_MARKER
    assert f"`zz_b/` holds what that study had written when it stopped (partial; its {marker_name}" in md
    # the same settings again: zz_b is not reused (not "ok"), it runs, and its folder is whole again
    two_studies["interrupt"] = False
    CALLS.clear()
    summary = reproduce(RunContext(tmp_path, seed=7), only=["zz_a", "zz_b"])
    assert CALLS == ["zz_b"] and summary["ok"]
    assert not (sdir / report_module.INTERRUPTED_MARKER).exists()
    assert json.loads((sdir / "result.json").read_text())["status"] == "ok"


def test_a_study_killed_midway_leaves_a_running_record_not_the_last_finished_one(tmp_path, two_studies,
                                                                               monkeypatch):
    """A run killed (SIGKILL: no handler runs) inside a study left the study's result.json of an earlier finished
    run, status ok, beside the new partial tables; the folder now says "running" from the study's start."""
    two_studies["interrupt"] = False
    reproduce(RunContext(tmp_path), only=["zz_b"])
    seen = {}

    def killed(out_dir, ctx):   # what the folder holds while the study runs, where a SIGKILL would leave it
        seen.update(json.loads((out_dir / "result.json").read_text()))
        raise KeyboardInterrupt

    monkeypatch.setattr(contract.registry()["zz_b"], "run", killed)
    with pytest.raises(KeyboardInterrupt):
        reproduce(RunContext(tmp_path, seed=3), only=["zz_b"])
    assert seen["status"] == "running" and seen["finished"] is None and "started" in seen
    # as a folder that is not part of a later run
    left = {e["name"]: e for e in report_module.not_in_run(RunContext(tmp_path), ["zz_a"])}
    assert left["zz_b"]["status"] == "interrupted" and left["zz_b"]["same_settings"] is False
    assert "interrupted" in report_module._left_over(left["zz_b"])
