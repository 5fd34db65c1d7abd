"""The lines of one long kernel pass (meanfield.kernel_inputs.watched): a forward pass, VJP or JVP over 1e5 tokens is
one call of minutes on CPU, which said nothing while it ran (attend at N = 4e4, d = 3: a JVP of 5.6 s)."""

import logging
import time

import pytest
import torch
from torch.autograd import forward_ad as fwAD

from meanfield import attention_tiles, flash_cpu, kernel_inputs, kernels
from particles import progress

LOGGER = "meanfield.kernels"


@pytest.fixture
def watched_always(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.02)
    monkeypatch.setattr(kernel_inputs, "WATCHED_ENTRIES", 0)


def _slow(monkeypatch, module, name):
    """Make module.name take 0.15 s longer: a pass long enough for the watcher's period, whatever the machine."""
    original = getattr(module, name)
    if original is None:
        pytest.skip(f"{module.__name__}.{name} is not available in this torch build")

    def slow(*args, **kwargs):
        time.sleep(0.15)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, slow)


def _inputs(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=g)
    return X, torch.randn(3, 3, generator=g) * 0.5


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


def test_a_long_forward_pass_says_what_it_is_while_it_runs(watched_always, monkeypatch, caplog):
    _slow(monkeypatch, flash_cpu, "forward")
    X, A = _inputs()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = kernels.attend(X @ A.T, X, X, method="stream")
    lines = _lines(caplog)
    what = "attention of 300 queries x 300 keys, head size 3, float32 on cpu: "
    assert len(lines) >= 2 and all(line.startswith(what) for line in lines), lines
    assert "running for" in lines[0] and "done in" in lines[-1]
    torch.testing.assert_close(out, kernels.attend(X @ A.T, X, X, method="dense"))


def test_a_long_vjp_says_what_it_is(watched_always, monkeypatch, caplog):
    _slow(monkeypatch, flash_cpu, "backward")
    X, A = _inputs()
    Xg = X.clone().requires_grad_()
    out = kernels.attend(Xg @ A.T, Xg, Xg, method="stream")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out.sum().backward()
    lines = _lines(caplog)
    assert lines and all(line.startswith("VJP of 300 queries x 300 keys, head size 3") for line in lines), lines


def test_the_tile_loops_report_their_share_of_query_blocks(watched_always, monkeypatch, caplog):
    """The JVP's tile loop says how far it is; its shares climb to the last block, then the call ends."""
    seen = []
    monkeypatch.setattr(attention_tiles, "advance", lambda done, total, stage: seen.append((stage, done, total)))
    X, A = _inputs(n=200)
    with fwAD.dual_level():
        Xd = fwAD.make_dual(X, torch.randn_like(X))
        kernels.attend(Xd @ A.T, Xd, Xd, method="stream", block_size=64)
    jvp = [(done, total) for stage, done, total in seen if stage == "JVP"]
    assert jvp == [(a, 4) for a in range(4)]


def test_the_share_reaches_the_lines(watched_always, monkeypatch, caplog):
    original = attention_tiles.advance

    def slow_advance(done, total, stage):
        original(done, total, stage)
        time.sleep(0.03)

    monkeypatch.setattr(attention_tiles, "advance", slow_advance)
    X, A = _inputs(n=200)
    with caplog.at_level(logging.INFO, logger=LOGGER), fwAD.dual_level():
        Xd = fwAD.make_dual(X, torch.randn_like(X))
        kernels.attend(Xd @ A.T, Xd, Xd, method="stream", block_size=32)
    assert any("; JVP " in line and "% done" in line for line in _lines(caplog)), _lines(caplog)


def test_small_passes_start_no_watcher(monkeypatch, caplog):
    """Below WATCHED_ENTRIES (2^20 scores) nothing is registered: the fixed cost of small calls stays as it was."""
    def refuse(*args, **kwargs):
        raise AssertionError("long_call started for a small pass")

    monkeypatch.setattr(kernel_inputs, "long_call", refuse)
    monkeypatch.setattr(kernel_inputs, "one_call", refuse)
    X, A = _inputs()
    Xg = X.clone().requires_grad_()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        kernels.attend(Xg @ A.T, Xg, Xg, method="stream").sum().backward()
        kernels.attend(X @ A.T, X, X)
    monkeypatch.setattr(kernel_inputs, "WATCHED_ENTRIES", 0)
    monkeypatch.setattr(kernel_inputs, "POLICY_ENTRIES", 0)
    with caplog.at_level(logging.INFO, logger=LOGGER), pytest.raises(AssertionError, match="long_call started"):
        kernels.attend(X @ A.T, X, X)


def test_passes_off_the_cpu_are_neither_watched_nor_given_threads(watched_always, monkeypatch):
    """An accelerator's pass returns once queued: its time is spent at the next sync, not inside the pass."""
    import contextlib

    def refuse(*args, **kwargs):
        raise AssertionError("started for a pass off the CPU")

    monkeypatch.setattr(kernel_inputs, "long_call", refuse)
    monkeypatch.setattr(kernel_inputs, "one_call", refuse)
    monkeypatch.setattr(kernel_inputs, "POLICY_ENTRIES", 0)
    q = torch.empty(4096, 3, device="meta")
    assert isinstance(kernel_inputs.watched("attention", q, q), contextlib.nullcontext)
    with pytest.raises(AssertionError, match="started for a pass"):
        kernel_inputs.watched("attention", torch.empty(8, 3), torch.empty(8, 3)).__enter__()
