"""The thread policy (particles/threads.py): overrides, the small-step rule, the free-core rule, and
torch's setting restored. The machine's load is simulated by replacing the sampler of other
processes' running threads, so that the decisions are tested whatever the test machine is doing."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import particles.threads as th
from meanfield import SelfAttention, local_lipschitz


@pytest.fixture
def four_cores(monkeypatch):
    """A 4-core machine on which torch would use 4 threads; others' running threads set per test."""
    entry = torch.get_num_threads()
    monkeypatch.setattr(th, "_cores", lambda: 4)
    monkeypatch.delenv(th.ENV, raising=False)
    th.set_threads(None)
    torch.set_num_threads(4)
    load = {"others": 0.0}
    monkeypatch.setattr(th, "_running_elsewhere", lambda: load["others"])
    yield load
    th.set_threads(None)
    torch.set_num_threads(entry)


def test_small_steps_stay_on_one_thread(four_cores):
    with th.ThreadPolicy(step_seconds=th.SMALL_STEP / 2) as p:
        assert p.threads == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 4   # restored


@pytest.mark.parametrize("others, expected", [(0, 4), (1, 3), (3, 1), (7, 1)])
def test_large_steps_take_the_free_cores(four_cores, others, expected):
    four_cores["others"] = others
    with th.ThreadPolicy(step_seconds=1.0) as p:
        assert p.threads == expected == torch.get_num_threads()


def test_torch_setting_is_an_upper_bound(four_cores):
    torch.set_num_threads(2)
    with th.ThreadPolicy(step_seconds=1.0) as p:
        assert p.threads == 2
    assert torch.get_num_threads() == 2


def test_a_machine_that_becomes_busy_moves_the_call_to_fewer_threads(four_cores, monkeypatch):
    monkeypatch.setattr(th, "RECHECK", 0.0)
    with th.ThreadPolicy() as p:
        assert p.threads == 1            # probing on one thread
        p.observe(1.0)
        assert p.threads == 4
        four_cores["others"] = 3
        p.tick()
        assert p.threads == 1
        four_cores["others"] = 0
        p.tick()
        assert p.threads == 4


def test_overrides_win(four_cores, monkeypatch):
    monkeypatch.setenv(th.ENV, "3")
    with th.ThreadPolicy(step_seconds=1e-6) as p:
        assert p.threads == 3
    th.set_threads(2)
    with th.ThreadPolicy(step_seconds=10.0) as p:
        p.observe(10.0)
        assert p.threads == 2
    th.set_threads("auto")
    monkeypatch.setenv(th.ENV, "auto")
    with th.ThreadPolicy(step_seconds=1e-6) as p:
        assert p.threads == 1


@pytest.mark.parametrize("bad", ["lots", "0", "-2", "2.5"])
def test_a_bad_environment_variable_is_named(four_cores, monkeypatch, bad):
    monkeypatch.setenv(th.ENV, bad)
    with pytest.raises(ValueError, match=th.ENV):
        th.requested_threads()


@pytest.mark.parametrize("bad, error", [(0, ValueError), (True, TypeError), (2.0, TypeError), ("x", ValueError)])
def test_set_threads_refuses_bad_values(bad, error):
    with pytest.raises(error, match="threads"):
        th.set_threads(bad)


def test_free_cores_reads_this_machine():
    n = th.free_cores()
    assert 1 <= n <= th._cores()


def test_local_lipschitz_gives_the_same_value_on_any_thread_count(four_cores):
    """The policy changes how the work is spread, never the numbers (beyond reduction order)."""
    op = SelfAttention(np.eye(3) * 0.5, np.eye(3))
    X = torch.randn(64, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    values = []
    for n in (1, 2, None):
        th.set_threads(n)
        values.append(local_lipschitz(op, X, tol=1e-10).value)
        assert torch.get_num_threads() == 4
    assert max(values) - min(values) <= 1e-12 * values[0]


def test_using_threads_sets_and_restores_the_override_and_the_environment(monkeypatch):
    from particles.threads import ENV, requested_threads, using_threads

    monkeypatch.setenv(ENV, "3")
    with using_threads(1, environment=True) as n:
        assert n == 1 and requested_threads() == 1 and os.environ[ENV] == "1"
        with th.ThreadPolicy() as policy:
            assert policy.threads == 1 and torch.get_num_threads() == 1
    assert requested_threads() == 3 and os.environ[ENV] == "3"
    with pytest.raises(ValueError, match="threads"):
        with using_threads(0):
            pass
    assert requested_threads() == 3
