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


# ---------------------------------------------------------------- one call with no steps of its own (a kernel pass)
@pytest.fixture
def fresh_sample(monkeypatch):
    monkeypatch.setattr(th, "_SAMPLE", [-float("inf"), 1])


@pytest.mark.parametrize("others, expected", [(0, 4), (1, 3), (3, 1), (7, 1)])
def test_one_call_takes_the_free_cores_and_restores_torch(four_cores, fresh_sample, others, expected):
    four_cores["others"] = others
    with th.one_call(1.0):
        assert torch.get_num_threads() == expected
    assert torch.get_num_threads() == 4


def test_one_call_follows_the_rules_of_the_policy(four_cores, fresh_sample):
    with th.one_call(th.SMALL_STEP / 2):
        assert torch.get_num_threads() == 1          # small: one thread
    th.set_threads(2)
    with th.one_call(1.0):
        assert torch.get_num_threads() == 2          # the override wins
    th.set_threads(None)
    torch.set_num_threads(3)
    with th.one_call(1.0):
        assert torch.get_num_threads() == 3          # torch's setting is an upper bound


def test_one_call_inside_an_entry_point_leaves_the_threads_to_it(four_cores, fresh_sample):
    four_cores["others"] = 3
    with th.ThreadPolicy(step_seconds=1.0) as p:
        assert th.active_policy() is p and torch.get_num_threads() == 1
        four_cores["others"] = 0
        with th.one_call(1.0):
            assert torch.get_num_threads() == 1      # the entry point decided (and re-checks on its ticks)
    assert th.active_policy() is None


def test_consecutive_calls_share_one_sample_of_the_load(four_cores, fresh_sample, monkeypatch):
    """A sample of /proc costs about a millisecond: a loop of passes of a few ms takes one per RECHECK seconds."""
    calls = []
    monkeypatch.setattr(th, "free_cores", lambda: calls.append(1) or 2)
    monkeypatch.setattr(th, "RECHECK", 3600.0)
    for _ in range(5):
        with th.one_call(1.0):
            assert torch.get_num_threads() == 2
    assert len(calls) == 1
    monkeypatch.setattr(th, "RECHECK", 0.0)
    with th.one_call(1.0):
        pass
    assert len(calls) == 2


def test_a_large_kernel_pass_takes_its_threads_from_the_free_cores(four_cores, fresh_sample, monkeypatch):
    """A direct attend (op(mu), op.sequence(X)) ran on torch's threads whatever the load: on 2 cores with one other
    job, a forward pass and VJP at N = 8000 took 2.0-3.6 s on 2 threads against 0.73 s on one (a load review)."""
    from meanfield import flash_cpu, kernel_inputs, kernels

    seen = []
    forward, backward = flash_cpu.forward, flash_cpu.backward
    monkeypatch.setattr(flash_cpu, "forward", lambda *a: seen.append(("forward", torch.get_num_threads()))
                        or forward(*a))
    monkeypatch.setattr(flash_cpu, "backward", lambda *a: seen.append(("VJP", torch.get_num_threads()))
                        or backward(*a))
    monkeypatch.setattr(kernel_inputs, "POLICY_ENTRIES", 1)
    monkeypatch.setattr(kernel_inputs, "SECONDS_PER_SCORE", 1.0)   # a pass of minutes, at 64 tokens
    X = torch.randn(64, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    four_cores["others"] = 3
    kernels.attend(X, X, X, method="stream").sum().backward()
    assert seen == [("forward", 1), ("VJP", 1)] and torch.get_num_threads() == 4
    seen.clear()
    four_cores["others"] = 1
    monkeypatch.setattr(th, "_SAMPLE", [-float("inf"), 1])
    kernels.attend(X, X, X, method="stream").sum().backward()
    assert seen == [("forward", 3), ("VJP", 3)]
    seen.clear()
    monkeypatch.setattr(kernel_inputs, "POLICY_ENTRIES", 2**20)   # small passes keep torch's setting
    kernels.attend(X, X, X, method="stream").sum().backward()
    assert seen == [("forward", 4), ("VJP", 4)]


@pytest.mark.parametrize("method", ["streaming", "sinkhorn"])
def test_a_transport_solve_moves_to_fewer_threads_when_the_machine_gets_busy(four_cores, monkeypatch, method):
    """transport.solve chose its threads at entry and never again: its docstring's "re-checked while the call runs"
    held for the Lipschitz, dynamics and worst-case entry points only (a load review)."""
    import transport
    from particles import Measure
    from transport import api, sinkhorn, streaming_sinkhorn

    monkeypatch.setattr(th, "RECHECK", 0.0)
    monkeypatch.setattr(api, "SECONDS_PER_ENTRY", 1.0)   # steps of seconds: the free-core rule applies
    monkeypatch.setattr(sinkhorn, "FIRST_ROUND", 10)      # POT's rounds of 10 iterations: ticks between them
    from particles import progress

    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 1e-9)   # (rounds are sized to last one period)
    seen = []
    module, name = (streaming_sinkhorn, "update") if method == "streaming" else (sinkhorn, "pot")
    original = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        if len(seen) == 3:
            four_cores["others"] = 3
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    g = torch.Generator().manual_seed(0)
    mu = Measure(torch.randn(60, 2, dtype=torch.float64, generator=g))
    nu = Measure(torch.randn(60, 2, dtype=torch.float64, generator=g) + 1.0)
    result = transport.solve(mu, nu, method, reg=0.2, debias=False)
    assert result.converged and len(seen) > 4
    assert seen[0] == 4 and seen[-1] == 1, seen
    assert torch.get_num_threads() == 4


def test_overlapping_calls_in_two_threads_restore_torchs_setting(four_cores, fresh_sample):
    """Each call restored the count it found: a call that started inside another's (another Python thread) left
    torch at the other's choice for good (4 -> 2 threads after both ended, a review of the change)."""
    import threading

    four_cores["others"] = 2
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with th.one_call(1.0):
            seen["first"] = torch.get_num_threads()
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def second():
        a_in.wait(5)
        with th.one_call(1.0):
            seen["second"] = torch.get_num_threads()
            b_in.set()
            a_out.wait(5)
            seen["after first ended"] = torch.get_num_threads()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"first": 2, "second": 2, "after first ended": 2}
    assert torch.get_num_threads() == 4 and th._RUNNING["count"] == 0


def test_a_policy_that_fails_to_start_leaves_nothing_behind(four_cores, monkeypatch):
    """A malformed $SMOOTH_ATTENTION_THREADS made ThreadPolicy's entry raise with the policy still registered as
    active: one_call then did nothing in that context for good."""
    monkeypatch.setenv(th.ENV, "many")
    with pytest.raises(ValueError, match=th.ENV):
        with th.ThreadPolicy(step_seconds=1.0):
            pass
    assert th.active_policy() is None and torch.get_num_threads() == 4
