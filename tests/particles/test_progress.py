"""particles.progress.long_call: the lines of one long call with no iteration of its own (a fused kernel of minutes)."""

import logging
import threading
import time

import pytest

from particles import progress

log = logging.getLogger("tests.progress")


@pytest.fixture
def fast_period(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.02)


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_a_long_call_logs_while_it_runs_and_when_it_ends(fast_period, caplog):
    with caplog.at_level(logging.INFO, logger=log.name):
        with progress.long_call(log, "attention of 9 queries"):
            time.sleep(0.2)
    lines = _messages(caplog)
    assert len(lines) >= 3, lines
    assert all(line.startswith("attention of 9 queries: ") for line in lines)
    assert "running for 0 s" in lines[0] and "done" not in lines[0]
    assert lines[-1].startswith("attention of 9 queries: done in 0.")


def _watchers():
    return [t for t in threading.enumerate() if t.name == "particles-progress"]


def test_a_short_call_says_nothing_and_one_thread_watches_every_call(caplog):
    """One watcher for the process: a thread started per call cost 0.15-0.35 ms (a review of the change)."""
    with caplog.at_level(logging.INFO, logger=log.name):
        for _ in range(50):
            with progress.long_call(log, "attention"):
                pass
    assert _messages(caplog) == [] and len(_watchers()) == 1


def test_the_share_done_and_its_stage_are_reported(fast_period, caplog):
    with caplog.at_level(logging.INFO, logger=log.name):
        with progress.long_call(log, "attention"):
            progress.advance(1, 4, "JVP")
            time.sleep(0.1)
    assert "; JVP 25% done" in _messages(caplog)[0]
    progress.advance(1, 2)   # outside a watched call: nothing to report to, no error


def test_a_call_inside_a_watched_one_adds_no_lines(fast_period, caplog):
    with caplog.at_level(logging.INFO, logger=log.name):
        with progress.long_call(log, "outer"):
            with progress.long_call(log, "inner"):
                time.sleep(0.1)
    lines = _messages(caplog)
    assert lines and all(line.startswith("outer: ") for line in lines)


def test_nothing_is_registered_where_the_logger_is_quiet(fast_period, caplog):
    with caplog.at_level(logging.WARNING, logger=log.name):
        with progress.long_call(log, "attention"):
            assert progress._WATCHER.calls == {}
            time.sleep(0.05)
    assert _messages(caplog) == []


def test_two_calls_in_two_threads_each_have_their_lines(fast_period, caplog):
    def run(name):
        with progress.long_call(log, name):
            time.sleep(0.15)

    with caplog.at_level(logging.INFO, logger=log.name):
        threads = [threading.Thread(target=run, args=(name,)) for name in ("first", "second")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    lines = _messages(caplog)
    for name in ("first", "second"):
        mine = [line for line in lines if line.startswith(name + ": ")]
        assert "running for" in mine[0] and mine[-1].startswith(f"{name}: done in"), lines
    assert progress._WATCHER.calls == {}


def test_a_call_runs_without_lines_where_no_thread_can_start(fast_period, caplog, monkeypatch):
    monkeypatch.setattr(progress, "_WATCHER", progress._Watcher())

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with caplog.at_level(logging.INFO, logger=log.name):
        with progress.long_call(log, "attention"):
            time.sleep(0.05)
    assert _messages(caplog) == [] and progress._WATCHER.calls == {}


def test_the_lines_stop_when_the_call_raises(fast_period, caplog):
    with caplog.at_level(logging.INFO, logger=log.name), pytest.raises(RuntimeError, match="boom"):
        with progress.long_call(log, "attention"):
            time.sleep(0.05)
            raise RuntimeError("boom")
    assert progress._WATCHER.calls == {}
    assert _messages(caplog)[-1].startswith("attention: stopped by RuntimeError after 0.")
