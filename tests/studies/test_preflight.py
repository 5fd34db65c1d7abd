"""The command line checks every option, file, folder and service before the first study starts.

A throw-away study registered to run FIRST records whether it ran: for each bad option the run must end
with the README's exit code (64 for usage, 74 for an output folder that cannot be written), one line on
stderr naming the option, the first study never started, and no run folder created."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from studies import contract, pretrained
from studies.cli import EXIT_OK, EXIT_OUTPUT, EXIT_USAGE, main

transformers = pytest.importorskip("transformers")


@pytest.fixture
def first_study():
    """A study ordered before every other; ``ran`` lists the runs that reached it."""
    ran = []

    def run(out_dir, ctx):
        ran.append(ctx)
        return contract.StudyResult("zz_first", "runs first")

    contract.register("zz_first", "runs first", order=-1)(run)
    yield ran
    contract.unregister("zz_first")


def _refused(argv, capsys, code=EXIT_USAGE):
    got = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert got == code, (argv, err)
    assert len(err) == 1 and err[0].startswith("meanfield: ") and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A tiny GPT-2 saved with save_pretrained, and a word-level tokenizer beside it."""
    from studies.models import random_model
    from tests.studies.test_models import _word_tokenizer

    folder = tmp_path_factory.mktemp("ckpt") / "my-gpt2"
    random_model("gpt2", size="tiny", seed=5).save_pretrained(folder)
    _word_tokenizer(folder)
    return folder


def test_a_missing_checkpoint_folder_is_refused_before_the_first_study(tmp_path, capsys, first_study, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    for missing in (str(tmp_path / "nope"), "./fx/missing", "a/b/c"):
        line = _refused(["reproduce", "--only", "zz_first", "real_models", "--tiny", "--checkpoint", missing,
                         "--out", str(out)], capsys)
        assert line == f"meanfield: --checkpoint {missing}: no checkpoint directory at {str(Path(missing))!r}"
    assert first_study == [] and not out.exists()


def test_a_hub_name_unreachable_offline_is_a_usage_error_not_a_note(tmp_path, capsys, first_study, monkeypatch):
    """``fx/missing`` is no folder here and has the form of a hub name; offline and absent from the local cache,
    it is refused up front, naming it and saying why (the study used to run and exit 0 with a note)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))   # an empty local cache
    line = _refused(["real_models", "--tiny", "--checkpoint", "fx/missing", "--out", str(tmp_path / "r")], capsys)
    assert line.startswith("meanfield: --checkpoint fx/missing: ") and "hub is not reachable (offline)" in line
    monkeypatch.setenv("SMOOTH_ATTENTION_CHECKPOINTS", "fx/missing")   # the same through the environment
    line = _refused(["reproduce", "--only", "zz_first", "real_models", "--tiny", "--out", str(tmp_path / "r")],
                    capsys)
    assert "fx/missing" in line and first_study == [] and not (tmp_path / "r").exists()


def _copy(folder, tmp_path, name):
    import shutil

    shutil.copytree(folder, tmp_path / name)
    return tmp_path / name


def _drop_tensors(folder, part):
    """Rewrite the folder's weights without the tensors whose names contain ``part`` (a complete file)."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in state.items() if part not in k}, folder / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("damage, words", [
    (lambda c: (c / "config.json").unlink(), "has no config.json"),
    (lambda c: (c / "config.json").write_text("[" * 100_000), "not a readable JSON file"),
    (lambda c: (c / "config.json").write_text(json.dumps({"model_type": "llama"})), "model_type 'llama'"),
    (lambda c: (c / "tokenizer.json").unlink() or (c / "vocab.txt").unlink(missing_ok=True), "no tokenizer files"),
    (lambda c: (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()[:1000]), "is truncated"),
    (lambda c: _drop_tensors(c, "h.0.attn."), "tensor(s) its config.json needs (h.0.attn.c_attn.bias"),
])
def test_a_damaged_checkpoint_is_refused_before_the_first_study(good_checkpoint, tmp_path, capsys, first_study,
                                                                 damage, words):
    copy = _copy(good_checkpoint, tmp_path, "c")
    damage(copy)
    line = _refused(["reproduce", "--only", "zz_first", "real_models", "--tiny", "--checkpoint", str(copy),
                     "--out", str(tmp_path / "r")], capsys)
    assert line.startswith(f"meanfield: --checkpoint {copy}: ") and words in line, line
    assert first_study == [] and not (tmp_path / "r").exists()


def test_a_good_checkpoint_passes_the_checks_and_the_run_starts(good_checkpoint, tmp_path, capsys, first_study):
    from studies import preflight
    from studies.context import RunContext

    ctx = RunContext(tmp_path / "r", level="tiny", checkpoints=[str(good_checkpoint)], progress=False)
    preflight.check_run(ctx, ["real_models"])   # no error
    assert main(["reproduce", "--only", "zz_first", "--checkpoint", str(good_checkpoint), "--out",
                 str(tmp_path / "r"), "--no-progress"]) == EXIT_OK
    assert len(first_study) == 1


def test_text_model_and_memory_limit_are_checked_up_front(tmp_path, capsys, first_study, monkeypatch):
    (tmp_path / "latin1.txt").write_bytes("na\xefve".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("\n \n")
    run = ["reproduce", "--only", "zz_first", "real_models", "--tiny", "--out", str(tmp_path / "r")]
    assert "--text: " in _refused(run + ["--text", str(tmp_path / "latin1.txt")], capsys)
    assert "is empty" in _refused(run + ["--text", str(tmp_path / "blank.txt")], capsys)
    monkeypatch.setenv("SMOOTH_ATTENTION_MEMORY_LIMIT", "lots")
    line = _refused(["reproduce", "--only", "zz_first", "--out", str(tmp_path / "r")], capsys)
    assert line.startswith("meanfield: $SMOOTH_ATTENTION_MEMORY_LIMIT: ") and "'lots'" in line
    monkeypatch.delenv("SMOOTH_ATTENTION_MEMORY_LIMIT")
    monkeypatch.setattr(pretrained, "is_installed", lambda spec=None: False)
    line = _refused(run + ["--model", "minilm"], capsys)
    assert line.startswith("meanfield: --model minilm: the pretrained extra is not installed")
    assert first_study == [] and not (tmp_path / "r").exists()


@pytest.mark.skipif(not pretrained.is_installed(pretrained.MINILM), reason="the pretrained extra is not installed")
def test_an_unwritable_cache_is_refused_before_the_first_study(tmp_path, capsys, first_study):
    (tmp_path / "afile").write_text("x")
    line = _refused(["reproduce", "--only", "zz_first", "real_models", "--model", "minilm", "--cache",
                     str(tmp_path / "afile" / "sub"), "--out", str(tmp_path / "r")], capsys)
    assert line.startswith("meanfield: --cache: cannot extract") and "afile" in line
    assert first_study == [] and not (tmp_path / "r").exists()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there now
    return port


def test_an_unreachable_scheduler_is_refused_once_up_front(tmp_path, capsys, first_study, monkeypatch):
    pytest.importorskip("distributed")
    address = f"tcp://127.0.0.1:{_closed_port()}"
    line = _refused(["reproduce", "--only", "zz_first", "large_radius", "--tiny", "--scheduler", address, "--out",
                     str(tmp_path / "r")], capsys)
    assert line.startswith(f"meanfield: --scheduler: no Dask scheduler answers at {address}")
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", address)
    assert address in _refused(["reproduce", "--only", "zz_first", "--out", str(tmp_path / "r"), "-q"], capsys)
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS")
    line = _refused(["reproduce", "--only", "zz_first", "--backend", "processes", "--scheduler", address, "--out",
                     str(tmp_path / "r")], capsys)
    assert "a scheduler means backend='dask'" in line
    assert first_study == [] and not (tmp_path / "r").exists()


def test_a_port_that_answers_without_being_a_scheduler_is_refused_up_front(tmp_path, capsys, first_study,
                                                                           monkeypatch):
    """The dashboard's port (8787, HTTP) for the scheduler's (8786): the socket check passed, and every study then
    failed after its own 30 s (exit 2 after minutes). Dask's handshake now tells them apart before the first
    study; a real scheduler (a LocalCluster) passes."""
    import http.server
    import threading

    distributed = pytest.importorskip("distributed")
    from studies import preflight

    monkeypatch.setattr(preflight, "SCHEDULER_TIMEOUT", 1.0)
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"tcp://127.0.0.1:{server.server_address[1]}"
        line = _refused(["reproduce", "--only", "zz_first", "--scheduler", address, "--out", str(tmp_path / "r")],
                        capsys)
        assert line.startswith(f"meanfield: --scheduler: {address} accepts connections but no Dask scheduler "
                               "answered there")
        assert first_study == [] and not (tmp_path / "r").exists()
    finally:
        server.shutdown()
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cl:
        preflight._check_reachable(cl.scheduler_address, "--scheduler")


def test_the_scheduler_variable_is_named_and_an_explicit_local_backend_wins(tmp_path, capsys, first_study,
                                                                            monkeypatch):
    """$DASK_SCHEDULER_ADDRESS (not --scheduler, which the user did not give) is what the errors name, also with
    -q; --backend processes or inprocess runs locally despite it."""
    pytest.importorskip("distributed")
    address = f"tcp://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", address)
    line = _refused(["reproduce", "--only", "zz_first", "--out", str(tmp_path / "r"), "-q"], capsys)
    assert line == (f"meanfield: $DASK_SCHEDULER_ADDRESS: no Dask scheduler answers at {address} (Connection "
                    "refused); start it, or unset $DASK_SCHEDULER_ADDRESS, or pass --backend processes (or "
                    "inprocess), to run locally")
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "garbage")
    line = _refused(["reproduce", "--only", "zz_first", "--out", str(tmp_path / "r"), "-q"], capsys)
    assert line.startswith("meanfield: $DASK_SCHEDULER_ADDRESS: 'garbage' is not a scheduler address") and \
        "--scheduler" not in line
    assert first_study == [] and not (tmp_path / "r").exists()
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", address)
    for k, backend in enumerate(("processes", "inprocess")):
        assert main(["reproduce", "--only", "zz_first", "--backend", backend, "-q", "--out",
                     str(tmp_path / f"ok{k}")]) == EXIT_OK
        assert first_study[-1].sweep["backend"] == backend and first_study[-1].sweep["scheduler"] is None
    # given on the command line, the same address is --scheduler's
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS")
    line = _refused(["reproduce", "--only", "zz_first", "--scheduler", address, "--out", str(tmp_path / "r")], capsys)
    assert line.startswith(f"meanfield: --scheduler: no Dask scheduler answers at {address}")


def test_the_threads_variable_is_checked_before_the_first_study(tmp_path, capsys, first_study, monkeypatch):
    """$SMOOTH_ATTENTION_THREADS is read in every task: a bad value is a usage error up front (64, naming the
    variable), not every task of every study failing and exit 2; --threads wins over it."""
    from studies import preflight

    for value in ("abc", "0", "-2", "1.5"):
        monkeypatch.setenv("SMOOTH_ATTENTION_THREADS", value)
        line = _refused(["reproduce", "--only", "zz_first", "large_radius", "--tiny", "--out", str(tmp_path / "r")],
                        capsys)
        assert line.startswith("meanfield: $SMOOTH_ATTENTION_THREADS: expected a positive integer or 'auto', got ")
        assert value in line
        with pytest.raises(preflight.UsageError, match=r"^\$SMOOTH_ATTENTION_THREADS: "):
            preflight.check_threads({"SMOOTH_ATTENTION_THREADS": value})
    assert first_study == [] and not (tmp_path / "r").exists()
    for value in ("3", " auto ", ""):
        preflight.check_threads({"SMOOTH_ATTENTION_THREADS": value})
    monkeypatch.setenv("SMOOTH_ATTENTION_THREADS", "abc")
    assert main(["reproduce", "--only", "zz_first", "--threads", "1", "-q", "--out", str(tmp_path / "ok")]) == EXIT_OK
    assert len(first_study) == 1 and os.environ["SMOOTH_ATTENTION_THREADS"] == "abc"   # restored after the run


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_folder_that_cannot_be_created_is_the_output_code(tmp_path, capsys, first_study):
    """/proc/x cannot be created (a virtual file system): exit 74 with one line, not a traceback and 1 (the
    code of a violated theorem)."""
    line = _refused(["reproduce", "--only", "zz_first", "--out", "/proc/smooth-attention-x"], capsys, EXIT_OUTPUT)
    assert line == "meanfield: cannot write the run's files: /proc/smooth-attention-x: No such file or directory"
    assert first_study == []


def test_a_full_disk_inside_a_study_names_the_file_once(tmp_path, capsys):
    """A study whose own write fails with ENOSPC (an OSError without a file name): exit 74, the message names
    the study's folder and the reason once, with no '[Errno 28]' (twice, before)."""
    def study(out_dir, ctx):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    contract.register("zz_nospace", "fills the disk", order=3001)(study)
    try:
        line = _refused(["reproduce", "--only", "zz_nospace", "--out", str(tmp_path), "--quiet"], capsys, EXIT_OUTPUT)
    finally:
        contract.unregister("zz_nospace")
    assert line == f"meanfield: cannot write the run's files: {tmp_path / 'zz_nospace'}: No space left on device"


def test_bad_options_cost_seconds_not_a_study(tmp_path):
    """The whole refusal of a missing checkpoint in a fresh process: exit 64 (the real-model study would take
    minutes before reaching it)."""
    import subprocess

    res = subprocess.run([sys.executable, "-m", "studies.cli", "reproduce", "--quick", "--checkpoint",
                          str(tmp_path / "none"), "--out", str(tmp_path / "r")], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == EXIT_USAGE and res.stderr.strip().count("\n") == 0, res.stderr
    assert not (tmp_path / "r").exists()
