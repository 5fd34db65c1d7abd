"""--seed and --out are checked where the command line is read: a seed 0 <= S < 2**32 (what numpy's seeding takes)
and a non-empty folder, anything else a usage error (exit 64) naming the option, before any study starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from studies.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
EX_USAGE = 64   # sysexits.h, the CLI's documented usage-error status


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**64), "1.5", "abc"])
def test_seed_out_of_range_is_a_usage_error_naming_it(tmp_path, capsys, seed):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["mass_splitting", "--tiny", "--seed", seed, "--out", str(out)])
    assert exc.value.code == EX_USAGE
    err = capsys.readouterr().err
    assert "argument --seed: expected an integer" in err
    assert not out.exists()   # refused before the run folder is made


def test_seed_errors_from_a_fresh_process(tmp_path):
    for seed in ("-1", str(2**64)):
        res = subprocess.run([sys.executable, "-m", "studies.cli", "reproduce", "--tiny", "--seed", seed, "--out",
                              str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert res.returncode == EX_USAGE, res.stderr
        assert "--seed" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_valid_seeds_still_parse(seed):
    args = build_parser().parse_args(["reproduce", "--seed", str(seed)])
    assert args.seed == seed and type(args.seed) is int
    assert build_parser().parse_args(["mass_splitting"]).seed == 0


def test_help_states_the_seed_range():
    help_text = build_parser()._subparsers._group_actions[0].choices["reproduce"].format_help()
    assert "0 <= S < 2**32" in " ".join(help_text.split())


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_the_bracket_command_checks_its_seed_the_same_way(capsys, seed):
    with pytest.raises(SystemExit) as exc:
        main(["bracket", "--seed", seed])
    assert exc.value.code == EX_USAGE
    assert "argument --seed: expected an integer" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["mass_splitting", "--tiny"], ["bracket"]])
def test_an_empty_out_folder_is_a_usage_error(tmp_path, capsys, monkeypatch, command):
    """--out "" would be the current folder: refused, and nothing is written there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([*command, "--out", ""])
    assert exc.value.code == EX_USAGE
    assert "argument --out: expected a folder path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []



def test_a_checkpoint_for_a_run_that_reads_none_is_said_to_be_unused(tmp_path, capsys, monkeypatch):
    """Only real_models reads --checkpoint: a run without it says so on stderr instead of ignoring it silently."""
    from studies import cli

    monkeypatch.setattr(cli, "_run", lambda ctx, names: 0)   # the parsing, not the study
    assert main(["mass_splitting", "--tiny", "--checkpoint", str(tmp_path / "c"), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "--checkpoint is read only by real_models" in err and "(mass_splitting)" in err
    assert main(["reproduce", "--only", "real_models", "--checkpoint", str(tmp_path / "c")]) == 0
    assert main(["mass_splitting", "--tiny", "--out", str(tmp_path / "r")]) == 0
    assert "--checkpoint" not in capsys.readouterr().err


@pytest.mark.parametrize("option,value,says", [("--workers", "0", "--workers: expected at least 1 worker, got 0"),
                                               ("--workers", "-2", "--workers: expected at least 1 worker, got -2"),
                                               ("--retries", "-1", "--retries: expected 0 or more retries, got -1")])
def test_workers_and_retries_are_named_apart(tmp_path, capsys, option, value, says):
    with pytest.raises(SystemExit) as exc:
        main(["mass_splitting", "--tiny", option, value, "--out", str(tmp_path / "run")])
    assert exc.value.code == EX_USAGE
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("command", [["list"], ["mass_splitting", "--tiny", "-q"]])
def test_a_reader_that_closes_the_pipe_leaves_the_exit_status_the_runs(tmp_path, command):
    """`meanfield ... | head -0`: the final lines met a closed pipe, and the BrokenPipeError exited 1, the status of
    a violated theorem claim. The run's own status (0) is kept, with no traceback."""
    if command[0] != "list":
        command = [*command, "--out", str(tmp_path / "run")]
    proc = subprocess.Popen([sys.executable, "-m", "studies.cli", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()   # before the process writes anything: its writes meet a pipe without reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_a_checkpoint_that_is_no_folder_is_a_usage_error_in_every_run(tmp_path, capsys, monkeypatch):
    """The README's promise: a --checkpoint that is not a checkpoint folder is a usage error before the first study,
    also in a run whose studies do not read it (it exited 0 and wrote the path into config.json; found by an
    independent review). The study is never started."""
    from studies import report

    started = []
    monkeypatch.setattr(report, "run_study", lambda name, ctx: started.append(name))
    code = main(["reproduce", "--quick", "--only", "large_radius", "--checkpoint", str(tmp_path / "none"),
                 "--out", str(tmp_path / "run"), "-q"])
    assert code == EX_USAGE and started == []
    assert f"--checkpoint {tmp_path / 'none'}: no checkpoint directory" in capsys.readouterr().err


def test_a_study_is_fingerprinted_by_the_run_inputs_it_reads_only():
    """A study that reads no model, checkpoint or text keeps its fingerprint when they change (resume reused it
    only with the same --model, --checkpoint and --text: large_radius reran when --checkpoint was dropped);
    real_models's changes with each, worst_case's with the text only."""
    from pathlib import Path

    from studies.context import RunContext
    from studies.report import study_fingerprint

    base = RunContext(out=Path("/tmp/x"), level="quick")
    others = [RunContext(out=Path("/tmp/x"), level="quick", models=("gpt2-random",)),
              RunContext(out=Path("/tmp/x"), level="quick", checkpoints=("/some/dir",))]
    text = RunContext(out=Path("/tmp/x"), level="quick", text=Path(__file__))
    for ctx in [*others, text]:
        assert study_fingerprint("large_radius", ctx) == study_fingerprint("large_radius", base)
        assert study_fingerprint("real_models", ctx) != study_fingerprint("real_models", base)
    assert study_fingerprint("worst_case", text) != study_fingerprint("worst_case", base)
    assert all(study_fingerprint("worst_case", ctx) == study_fingerprint("worst_case", base) for ctx in others)
