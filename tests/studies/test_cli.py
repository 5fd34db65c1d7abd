"""The ``meanfield`` command line: --help, --version, list, a study subcommand on its tiny grid, the
run context it builds, and one exit code per outcome (usage, I/O, busy folder, failed study)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studies import cli, contract
from studies.cli import EXIT_BUSY, EXIT_CODES, EXIT_OUTPUT, EXIT_STUDY_FAILED, EXIT_USAGE, build_parser, main
from studies.context import CHECKPOINTS_ENV, TEXT_ENV
from studies.io import read_csv

REPO = Path(__file__).resolve().parents[2]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "studies.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)


def test_help_and_version_from_a_fresh_process():
    res = _cli("--help")
    assert res.returncode == 0, res.stderr
    for word in ("reproduce", "list", "sqrt_n", "mean_field", "l2_attention", "--version", "exit codes"):
        assert word in res.stdout, word
    for code in EXIT_CODES:   # every exit code is documented in --help
        assert f"\n  {code:<4d}" in res.stdout, code
    res = _cli("--version")
    assert res.returncode == 0 and res.stdout.startswith("meanfield ")
    assert res.stdout.split()[1][0].isdigit()


def test_exit_codes_are_distinct():
    assert len(set(EXIT_CODES)) == len(EXIT_CODES) == 8
    assert EXIT_USAGE not in (0, 1, 2) and EXIT_OUTPUT not in (0, 1, 2, EXIT_USAGE)


def test_reproduce_help_lists_the_options():
    help_text = build_parser()._subparsers._group_actions[0].choices["reproduce"].format_help()
    for opt in ("--quick", "--out", "--seed", "--only", "--device", "--checkpoint", "--text", "--quiet",
                "--verbose", "--backend"):
        assert opt in help_text, opt
    assert "--tiny" not in help_text  # test-size grids stay hidden


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("sqrt_n", "mean_field", "large_radius", "masked", "mass_splitting", "discrete_vs_meanfield",
                 "l2_attention", "dynamics", "real_models", "worst_case"):
        assert name in out


def test_study_subcommand_tiny(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["large_radius", "--tiny", "--out", str(out), "--seed", "2", "--no-progress"])
    assert code == 0, capsys.readouterr()
    stdout = capsys.readouterr().out
    assert "report.md" in stdout and "5 hold, 0 violated" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["seed"] == 2 and config["studies"] == ["large_radius"] and config["grid"] == "tiny"
    assert config["device"] == "cpu" and config["grids"]["large_radius"] == {"d": 3, "n": 5, "n_R": 6}
    rows = read_csv(out / "large_radius" / "lipschitz_vs_R.csv")
    assert rows and all(r["seed"] == 2 for r in rows)
    # the limit of Theorem 3.7 is reached on every curve of the table (not only that files exist)
    for kind in ("random", "hub"):
        for masked in (False, True):
            last = [r for r in rows if r["kind"] == kind and r["masked"] == masked][-1]
            assert abs(last["lip"] - last["limit"]) <= 1e-6 * last["limit"]
    assert (out / "large_radius" / "lipschitz_vs_R.png").exists()
    assert "large_radius/lipschitz_vs_R.png" in (out / "report.md").read_text()


def test_context_reads_flags_then_environment(tmp_path):
    parser = build_parser()
    env = {CHECKPOINTS_ENV: f"/a{os.pathsep}/b", TEXT_ENV: "/t.txt", "DASK_SCHEDULER_ADDRESS": "tcp://1.2.3.4:8786"}
    args = parser.parse_args(["reproduce", "--quick", "--out", str(tmp_path), "--seed", "3", "-q"])
    ctx = cli.context_from_args(args, ["meanfield"], env)
    assert (ctx.level, ctx.seed, ctx.out, ctx.verbosity) == ("quick", 3, tmp_path, -1)
    assert ctx.checkpoints == ("/a", "/b") and str(ctx.text) == "/t.txt"
    assert ctx.sweep["scheduler"] == "tcp://1.2.3.4:8786" and not ctx.show_progress
    args = parser.parse_args(["sqrt_n", "--checkpoint", "/c", "--text", "/u.txt", "--out", str(tmp_path),
                              "--scheduler", "tcp://5.6.7.8:1"])
    ctx = cli.context_from_args(args, ["meanfield"], env)
    assert ctx.checkpoints == ("/c",) and str(ctx.text) == "/u.txt" and ctx.level == "full"
    assert ctx.sweep["scheduler"] == "tcp://5.6.7.8:1"


def test_unknown_only_name_and_bad_values_exit_with_the_usage_code(capsys):
    for argv in (["reproduce", "--only", "nope"], ["reproduce", "--device", "tpu"], ["sqrt_n", "--seed", "x"],
                 ["sqrt_n", "--workers", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == EXIT_USAGE, argv
    assert "unknown study" in capsys.readouterr().err


def test_out_is_a_file_or_text_missing_one_line_and_usage_code(tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    assert main(["large_radius", "--tiny", "--out", str(f)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is an existing file" in err and "Traceback" not in err
    assert f.read_text() == "not a folder"
    # a path through a file: a usage error naming --out too (it exited 74, "cannot write the run's files")
    assert main(["large_radius", "--tiny", "--out", str(f / "sub")]) == EXIT_USAGE
    assert "--out: " in capsys.readouterr().err
    assert main(["real_models", "--tiny", "--out", str(tmp_path / "r"), "--text", str(tmp_path / "none.txt")]) \
        == EXIT_USAGE
    assert "--text: no text file" in capsys.readouterr().err


def test_cuda_without_a_device_is_a_usage_error(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["large_radius", "--tiny", "--device", "cuda", "--out", str(tmp_path / "r")]) == EXIT_USAGE
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_unwritable_output_folder_has_its_own_code_and_no_partial_file(tmp_path, capsys):
    under_a_file = tmp_path / "a_file"
    under_a_file.write_text("x")
    # a folder that cannot be created (a path through a file): a usage error naming --out, found before any study
    # (it was an I/O error, 74; the help lists a file given as --out among the usage errors), not a traceback
    assert main(["large_radius", "--tiny", "--out", str(under_a_file / "sub")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out: " in err and "is a file, not a folder" in err and "Traceback" not in err


@pytest.mark.parametrize("code, text", [(errno.ENOSPC, "No space left on device"),
                                        (errno.EROFS, "Read-only file system")])
def test_disk_full_mid_run_gives_the_output_code_and_leaves_no_truncated_file(tmp_path, capsys, monkeypatch, code,
                                                                              text):
    """A full disk or a file system turned read-only while the run writes (after the study ran):
    exit code 74, one line, and every file on disk is complete (the previous version or none),
    never a 0-byte or partial JSON."""
    from studies.sweep import files

    real_fsync = os.fsync
    state = {"armed": False}

    def fsync(fd):
        if state["armed"]:
            raise OSError(code, text)
        return real_fsync(fd)

    def study(out_dir, ctx):
        state["armed"] = True   # the disk is full from now on
        return contract.StudyResult("zz_full", "fills the disk")

    contract.register("zz_full", "fills the disk", order=3000)(study)
    monkeypatch.setattr(files.os, "fsync", fsync)
    try:
        got = main(["reproduce", "--only", "zz_full", "--out", str(tmp_path), "--quiet"])
    finally:
        contract.unregister("zz_full")
    assert got == EXIT_OUTPUT
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err and err.count("\n") == 1
    for p in tmp_path.rglob("*"):
        if p.is_file() and p.suffix in (".json", ".md"):
            text = p.read_text()
            assert text, p
            if p.suffix == ".json":
                json.loads(text)
    assert not list(tmp_path.rglob("*.tmp"))
    # the study's finished record could not be written: its folder still says that it was running
    assert json.loads((tmp_path / "zz_full" / "result.json").read_text())["status"] == "running"


def test_a_second_run_on_the_same_folder_is_refused(tmp_path, capsys):
    with open(tmp_path / ".lock", "a+") as fh:   # another meanfield run holding the folder
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        fh.write("4242")
        fh.flush()
        assert main(["large_radius", "--tiny", "--out", str(tmp_path), "--no-progress"]) == EXIT_BUSY
    err = capsys.readouterr().err
    assert "in use by another running meanfield run (pid 4242)" in err and err.count("\n") == 1
    assert f"--out: {tmp_path} is in use" in err   # the option the user typed, not the API's argument
    assert not (tmp_path / "config.json").exists()


def test_an_explicit_local_backend_wins_over_the_scheduler_variable(tmp_path):
    parser = build_parser()
    env = {"DASK_SCHEDULER_ADDRESS": "tcp://1.2.3.4:8786"}
    for backend in ("processes", "inprocess"):
        args = parser.parse_args(["reproduce", "--backend", backend, "--out", str(tmp_path)])
        ctx = cli.context_from_args(args, ["meanfield"], env)
        assert ctx.sweep["backend"] == backend and ctx.sweep["scheduler"] is None
    args = parser.parse_args(["reproduce", "--backend", "dask", "--out", str(tmp_path)])
    assert cli.context_from_args(args, ["meanfield"], env).sweep["scheduler"] == "tcp://1.2.3.4:8786"


def test_a_reused_out_folder_says_which_study_folders_are_not_part_of_the_run(tmp_path, capsys):
    def make(name):
        def run(out_dir, ctx):
            return contract.StudyResult(name, name, [contract.Claim("c", "t", "m", True, kind="theorem",
                                                                    fails_if="never")])
        return run

    for k, name in enumerate(("zz_cli_a", "zz_cli_b")):
        contract.register(name, name, order=2000 + k)(make(name))
    try:
        out = tmp_path / "r"
        assert main(["reproduce", "--only", "zz_cli_a", "zz_cli_b", "--out", str(out), "--no-progress", "-q"]) == 0
        assert "note:" not in capsys.readouterr().out
        assert main(["reproduce", "--only", "zz_cli_a", "--seed", "3", "--out", str(out), "--no-progress", "-q"]) == 0
    finally:
        for name in ("zz_cli_a", "zz_cli_b"):
            contract.unregister(name)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (f"  note: {out} also holds zz_cli_b/ from an earlier run: not part of this report (kept; "
                         "report.md lists them)")
    assert (out / "zz_cli_b" / "result.json").is_file() and "`zz_cli_b/`" in (out / "report.md").read_text()


def test_failing_study_gives_exit_code_2(tmp_path):
    @contract.register("zz_cli_fail", "fails", order=2000)
    def fail(out_dir, ctx):
        raise ValueError("broken on purpose")

    try:
        code = main(["reproduce", "--only", "zz_cli_fail", "--out", str(tmp_path), "--no-progress"])
    finally:
        contract.unregister("zz_cli_fail")
    assert code == EXIT_STUDY_FAILED
    assert "broken on purpose" in (tmp_path / "report.md").read_text()


def test_violated_theorem_gives_1_but_an_unreproduced_observation_gives_0(tmp_path, capsys):
    def make(kind, agrees):
        def run(out_dir, ctx):
            c = contract.Claim("c", "t", "m", agrees, kind=kind, fails_if="it is false")
            return contract.StudyResult("zz_claim", "claims", [c])
        return run

    for kind, agrees, code in [("theorem", False, 1), ("empirical", False, 0), ("empirical", None, 0),
                               ("theorem", True, 0)]:
        contract.register("zz_claim", "claims", order=2000)(make(kind, agrees))
        try:
            got = main(["reproduce", "--only", "zz_claim", "--out", str(tmp_path / f"{kind}{agrees}"),
                        "--no-progress"])
        finally:
            contract.unregister("zz_claim")
        assert got == code, (kind, agrees)
    out = capsys.readouterr().out
    assert "1 not reproduced" in out and "1 inconclusive" in out and "1 violated" in out


def test_progress_on_a_pipe_is_plain_lines_and_quiet_prints_none(tmp_path):
    """Redirected output (CI, SLURM) gets plain lines, never carriage returns or cursor codes."""
    res = _cli("large_radius", "--tiny", "--out", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stderr and "\x1b[" not in res.stderr
    assert "[1/1] large_radius" in res.stderr and "large_radius/large_radius: 0/24 tasks" in res.stderr
    assert "@" not in res.stderr   # no code fingerprint in the names users read
    res = _cli("large_radius", "--tiny", "--out", str(tmp_path / "b"), "--quiet")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "5 hold" in res.stdout


def test_a_finished_run_leaves_no_pid_in_its_lock_files(tmp_path):
    """The lock files stay (removing them could let two later writers lock different files) but a finished run
    empties them: a reader of the folder finds no pid of a process that no longer runs."""
    assert main(["large_radius", "--tiny", "--out", str(tmp_path), "--no-progress", "--quiet"]) == 0
    locks = list(tmp_path.rglob(".lock"))
    assert locks and all(p.read_text() == "" for p in locks), [(p, p.read_text()) for p in locks]


def test_folder_busy_survives_pickling():
    """A process pool re-raises its workers' exceptions in the parent by pickling them."""
    import pickle

    from studies.sweep import FolderBusy

    exc = pickle.loads(pickle.dumps(FolderBusy("--out", "runs/x is in use by another running sweep")))
    assert isinstance(exc, FolderBusy) and (exc.argument, exc.detail) == ("--out", "runs/x is in use by another "
                                                                          "running sweep")
    assert str(exc) == "--out: runs/x is in use by another running sweep"


def test_python_m_studies_runs_the_processes_backend_and_resumes_as_meanfield(tmp_path):
    """`python -m studies` ran main() at import, so the 'processes' backend's workers (which import the script
    again) refused it and every study failed (exit 2); and the report's command and resume line kept the
    machine's path to studies/__main__.py, which the resume line then dropped, with --backend and --workers."""
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "studies", "reproduce", "--tiny", "--only", "l2_attention",
                          "--backend", "processes", "--workers", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    from studies.report import resume_command

    config = json.loads((out / "config.json").read_text())
    assert config["command"][0].endswith("__main__.py")
    assert resume_command(config) == (f"meanfield reproduce --tiny --only l2_attention --backend processes "
                                      f"--workers 2 --out {out}")
    # in-process, --workers was not used: the commands for the reader drop it (a note on every rerun otherwise)
    inproc = {**config, "command": [*config["command"][:-6], "--backend", "inprocess", "--workers", "2", "--out",
                                    str(out)], "sweep": {**config["sweep"], "backend": "inprocess"}}
    assert resume_command(inproc) == f"meanfield reproduce --tiny --only l2_attention --backend inprocess --out {out}"


def test_a_folder_of_other_files_named_like_a_runs_is_refused_and_kept(tmp_path, capsys):
    """--out at a folder holding a report.md (or summary.json, config.json) that no run wrote: a run replaced
    the user's notes. Now a usage error (exit 64) that names the files; they are untouched. A folder with other
    files only, and one a run wrote, still run."""
    notes = tmp_path / "mydocs"
    notes.mkdir()
    (notes / "report.md").write_text("my notes")
    assert main(["l2_attention", "--tiny", "--out", str(notes), "--no-progress"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--out:" in err and "holds report.md but no run of meanfield" in err
    assert (notes / "report.md").read_text() == "my notes" and not (notes / "config.json").exists()
    (notes / "config.json").write_text('{"not": "a run"}')
    assert main(["l2_attention", "--tiny", "--out", str(notes), "--no-progress"]) == EXIT_USAGE
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.csv").write_text("x\n1\n")
    assert main(["l2_attention", "--tiny", "--out", str(other), "--no-progress"]) == 0
    assert main(["l2_attention", "--tiny", "--out", str(other), "--no-progress"]) == 0   # a run's own folder


def test_workers_without_worker_processes_get_a_note(tmp_path, capsys):
    """--workers 8 with the default --backend auto (no scheduler) ran every task in this process, silently."""
    assert main(["l2_attention", "--tiny", "--workers", "3", "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    assert "note: --workers 3 is not used: --backend auto runs the tasks in this process" in capsys.readouterr().err
    assert main(["l2_attention", "--tiny", "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert "--workers" not in capsys.readouterr().err


def test_errors_found_after_parsing_print_the_commands_usage(capsys):
    """--workers 0 printed `usage: meanfield [-h] [--version] COMMAND ...`, the top-level line, where argparse's
    own errors print the command's."""
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "--workers", "0", "--out", "unused"])
    assert exc.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: meanfield reproduce") and "--workers: expected at least 1 worker" in err
