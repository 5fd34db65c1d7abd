"""Sweeps: resumable after SIGKILL, corrupt records (and a corrupt manifest) redone or rebuilt,
failures reported, a lost Dask worker survived and counted, same table whatever the backend.

Truths: the table of an uninterrupted run (a separate process), direct calls of the task
function in grid order, explicit nested loops for the grid order, per-task execution logs
written by the tasks themselves.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from studies.sweep import add_sweep_arguments, expand_grid, load_sweep, run_sweep, sweep_options
from studies.sweep.store import RECORD_FORMAT, read_record, task_key

REPO = Path(__file__).resolve().parents[2]
CALLS: list[dict] = []       # in-process tasks log their calls here
FLAKY: dict[int, int] = {}


# ---------------------------------------------------------------------- task functions (top level: picklable)
def square(a, b=0):
    CALLS.append({"a": a, "b": b})
    return {"y": a * a + b}


def raises_on(a, bad):
    CALLS.append({"a": a})
    if a == bad:
        raise ValueError(f"a={a} is the bad one")
    return {"y": 2 * a}


def flaky(a):
    FLAKY[a] = FLAKY.get(a, 0) + 1
    if FLAKY[a] == 1:
        raise RuntimeError("transient")
    return {"y": a}


def seeded_norm(n, seed):
    X = np.random.default_rng(seed).standard_normal((n, 3))
    return {"norm": float(np.linalg.norm(X, 2)), "first": X[0].tolist()}


def die_once(i, marker):
    # Kill the worker process itself the first time task 3 runs: the pool breaks under it.
    if i == 3 and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
    return {"y": i + 1}


def one_kills_its_worker(i):
    # task 0 kills its worker every time, after the others have started beside it
    time.sleep(0.3)
    if i == 0:
        os._exit(1)
    time.sleep(0.3)
    return {"ok": i}


def echo_nan(x):
    return {"x": x, "y": 1.0}


def echo_as_float(n):
    return {"n": float(n), "y": 1.0}


def slow_marked(i, marker_dir):
    pid = os.getpid()
    Path(marker_dir, f"start-{i}-{pid}").touch()
    time.sleep(1.0)
    Path(marker_dir, f"end-{i}-{pid}").touch()
    return {"y": 3 * i, "pid": pid}


@pytest.fixture(autouse=True)
def _clear_logs():
    CALLS.clear()
    FLAKY.clear()
    yield
    # a dask sweep's local cluster lives as long as the process (shared by its sweeps): each test starts from none,
    # since two clusters at once on 2 cores starved a client's start (its IO loop not up within 10 s)
    from studies.sweep import backends

    backends.close_local_clusters()


def _records(out: Path) -> list[Path]:
    return sorted((out / "records").glob("*.rec"))


# ---------------------------------------------------------------------- SIGKILL, then resume
SCRIPT = textwrap.dedent("""
    import os, sys, time
    from studies.sweep import run_sweep

    def task(a, seed):
        time.sleep(float(os.environ.get("TASK_SLEEP", "0")))
        with open(os.environ["TASK_LOG"], "a") as fh:   # one line per execution
            fh.write(f"{a},{seed}\\n")
        return {"y": a * a + seed, "z": a / 7}

    if __name__ == "__main__":
        res = run_sweep(task, {"a": list(range(6)), "seed": [0, 1]}, sys.argv[1], backend=sys.argv[2],
                        n_workers=2, progress=False, name="killtest")
        print("DONE", len(res.rows), res.n_resumed, res.n_run)
""")


def _run_script(script, out, backend, log, sleep, **popen):
    env = dict(os.environ, TASK_LOG=str(log), TASK_SLEEP=str(sleep), PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(script), str(out), backend], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


ORPHAN_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from studies.sweep import run_sweep

    def task(i, folder):
        open(os.path.join(folder, f"pid-{os.getpid()}"), "w").close()
        time.sleep(2.0)
        return {"x": i}

    if __name__ == "__main__":
        import orphan_script
        run_sweep(orphan_script.task, [{"i": i, "folder": sys.argv[2]} for i in range(20)], sys.argv[1],
                  backend="processes", n_workers=2, progress=False)
""")


def test_pool_workers_exit_when_the_driver_is_killed(tmp_path):
    """kill -9 of the process that runs a sweep (the driver alone, not its process group): its pool workers,
    children of the fork server, finished their queued tasks and then stayed alive forever (a review found them
    idle 1.5 minutes later); each now watches the driver and exits within about a second of its death."""
    (tmp_path / "orphan_script.py").write_text(ORPHAN_SCRIPT)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "orphan_script.py"), str(tmp_path / "out"), str(pids)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no two workers started in 60 s"
        time.sleep(0.05)
    workers = [int(p.name.split("-")[1]) for p in pids.iterdir()]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as fh:      # reaped by no one yet: a zombie is gone
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"

    deadline = time.monotonic() + 15
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if alive(p)], "pool workers outlived the killed driver"


@pytest.mark.parametrize("backend", ["inprocess", "processes"])
def test_sigkill_midway_then_resume_gives_the_uninterrupted_table(tmp_path, backend):
    script = tmp_path / "sweep_script.py"
    script.write_text(SCRIPT)
    ref = _run_script(script, tmp_path / "ref", backend="inprocess", log=tmp_path / "ref.log", sleep=0)
    assert ref.wait(60) == 0, ref.stderr.read()

    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = _run_script(script, out, backend, log, sleep=0.15, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(_records(out)) < 3:
        assert proc.poll() is None, "the sweep finished before it could be killed: " + proc.stderr.read()
        assert time.monotonic() < deadline, "no record appeared in 60 s"
        time.sleep(0.01)
    if backend == "inprocess":
        os.kill(proc.pid, signal.SIGKILL)
    else:  # the driver and its pool workers, as a batch system kills a job
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    at_kill = {p.name for p in _records(out)}
    assert 3 <= len(at_kill) < 12, "killed midway: some but not all records"
    runs_before = log.read_text().splitlines()

    partial = load_sweep(out)   # what is on disk is readable and consistent
    assert len(partial.rows) == len(at_kill) and len(partial.missing) == 12 - len(at_kill)

    res = _run_script(script, out, backend, log, sleep=0)
    stdout, stderr = res.communicate(timeout=60)
    assert res.returncode == 0, stderr
    assert stdout.split() == ["DONE", "12", str(len(at_kill)), str(12 - len(at_kill))]

    done, want = load_sweep(out), load_sweep(tmp_path / "ref")
    assert done.rows == want.rows and done.ok
    assert (out / "results.csv").read_text() == (tmp_path / "ref" / "results.csv").read_text()
    recs = _records(out)
    assert len(recs) == 12 and len({read_record(p)["key"] for p in recs}) == 12   # none lost, none duplicated
    assert not list((out / "records").glob(".*.tmp"))
    # Tasks whose record existed at the kill ran exactly once in total; the rest were not redone twice.
    runs = log.read_text().splitlines()
    assert len(runs) == len(runs_before) + 12 - len(at_kill)
    keys_at_kill = {Path(n).stem for n in at_kill}
    for line in set(runs):
        a, seed = map(int, line.split(","))
        if task_key("killtest", {"a": a, "seed": seed}) in keys_at_kill:
            assert runs.count(line) == 1, line


# ---------------------------------------------------------------------- corrupt records
def test_corrupt_or_partial_records_are_detected_and_redone_never_read(tmp_path, caplog):
    out = tmp_path / "s"
    grid = [{"a": a, "b": 1} for a in range(6)]
    first = run_sweep(square, grid, out, progress=False)
    assert first.ok and [r["y"] for r in first.rows] == [a * a + 1 for a in range(6)]
    key = [task_key(first.name, p) for p in grid]
    path = [out / "records" / f"{k}.rec" for k in key]

    raw = path[0].read_bytes()
    path[0].write_bytes(raw[: len(raw) // 2])                        # truncated
    path[1].write_bytes(path[1].read_bytes().replace(b'"y":2', b'"y":9'))   # same length, bad checksum
    assert b'"y":9' in path[1].read_bytes()
    path[2].write_bytes(path[5].read_bytes())                        # valid record of another task
    path[3].write_bytes(b"garbage\n")
    (out / "records" / f".{key[4]}.rec.123.abcd.tmp").write_bytes(b"{half a rec")   # killed writer

    seen = load_sweep(out)
    assert seen.n_corrupt == 4
    assert seen.missing == grid[:4] and seen.rows == first.rows[4:]
    assert all(r["y"] != 9 for r in seen.rows)

    CALLS.clear()
    with caplog.at_level(logging.WARNING, logger="studies.sweep.runner"):
        again = run_sweep(square, grid, out, progress=False)
    # said, not only counted (they were moved aside silently)
    assert any("4 stored record(s) failed verification" in r.getMessage() for r in caplog.records)
    assert again.n_corrupt == 4 and again.n_resumed == 2 and again.n_run == 4
    assert CALLS == grid[:4]                      # exactly the bad ones were run again
    assert again.rows == first.rows and again.ok
    assert len(list((out / "corrupt").iterdir())) == 4   # kept aside for inspection
    assert not list((out / "records").glob(".*.tmp"))


def test_a_corrupt_manifest_is_rebuilt_from_the_records(tmp_path, caplog):
    out = tmp_path / "s"
    grid = [{"a": a, "b": 0} for a in range(4)]
    first = run_sweep(square, grid, out, progress=False)
    (out / "sweep.json").write_text('{"format": "smooth-attention-sweep/1", "name": ')   # a torn hand edit
    seen = load_sweep(out)   # readers rebuild it in memory (rows in the order the tasks finished)
    # the grid is then unknown (a task that never finished left no record): not ok, and said when raised
    assert sorted(seen.rows, key=lambda r: r["a"]) == first.rows and not seen.grid_known and not seen.ok
    with pytest.raises(RuntimeError, match="the grid is unknown: sweep.json was damaged"):
        seen.raise_for_failures()
    assert "rebuilt from 4 verified record(s)" in caplog.text
    assert (out / "sweep.json").read_text().endswith('"name": ')   # a reader writes nothing
    CALLS.clear()
    again = run_sweep(square, grid, out, progress=False)
    assert again.ok and again.n_resumed == 4 and again.n_run == 0 and CALLS == []
    assert again.rows == first.rows
    assert json.loads((out / "sweep.json").read_text())["grid"] == grid   # rewritten from the call
    (out / "sweep.json").write_text("[]")   # valid JSON, not a manifest: rebuilt too
    assert run_sweep(square, grid, out, progress=False).n_run == 0


def test_a_corrupt_manifest_of_another_sweep_is_still_refused(tmp_path):
    out = tmp_path / "s"
    run_sweep(square, [{"a": 1}], out, progress=False, name="one")
    (out / "sweep.json").write_text("garbage")
    with pytest.raises(ValueError, match="holds sweep 'one'"):
        run_sweep(square, [{"a": 1}], out, progress=False, name="two")
    assert run_sweep(square, [{"a": 1}], out, progress=False, name="two", overwrite=True).ok


def _forge(path: Path, body: bytes) -> None:
    header = {"format": RECORD_FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    path.write_bytes(json.dumps(header).encode() + b"\n" + body + b"\n")


@pytest.mark.parametrize("depth", [100, 200_000])
def test_deeply_nested_json_with_a_valid_checksum_is_a_corrupt_record(tmp_path, depth):
    out = tmp_path / "s"
    grid = [{"a": 1, "b": 0}, {"a": 2, "b": 0}]
    first = run_sweep(square, grid, out, progress=False)
    key = task_key(first.name, grid[0])
    body = (b'{"key":"' + key.encode() + b'","name":"' + first.name.encode() + b'","params":{"a":1,"b":0},'
            b'"result":{"y":' + b"[" * depth + b"]" * depth + b'},"status":"ok"}')
    _forge(out / "records" / f"{key}.rec", body)
    seen = load_sweep(out)                       # no RecursionError escapes
    assert seen.n_corrupt == 1 and seen.missing == grid[:1] and seen.rows == first.rows[1:]
    CALLS.clear()
    again = run_sweep(square, grid, out, progress=False)
    assert again.n_corrupt == 1 and CALLS == [grid[0]] and again.rows == first.rows
    assert len(list((out / "corrupt").iterdir())) == 1
    (out / "sweep.json").write_text("{" * depth)   # a manifest nested too deeply is rebuilt as well
    rebuilt = load_sweep(out)
    assert sorted(rebuilt.rows, key=lambda r: r["a"]) == first.rows and not rebuilt.grid_known


# ---------------------------------------------------------------------- failures and retries
@pytest.mark.parametrize("backend", ["inprocess", "processes"])
def test_a_raising_task_is_retried_then_reported_and_the_others_finish(tmp_path, backend):
    grid = {"a": [0, 1, 2, 3], "bad": [2]}
    res = run_sweep(raises_on, grid, tmp_path / "s", backend=backend, retries=2, progress=False)
    assert [r["a"] for r in res.rows] == [0, 1, 3] and [r["y"] for r in res.rows] == [0, 2, 6]
    assert not res.ok and len(res.failures) == 1
    f = res.failures[0]
    assert f.params == {"a": 2, "bad": 2} and f.attempts == 3
    assert f.error_type == "ValueError" and f.message == "a=2 is the bad one"
    assert "raise ValueError" in f.traceback and "raises_on" in f.traceback
    if backend == "inprocess":
        assert sorted(c["a"] for c in CALLS) == [0, 1, 2, 2, 2, 3]
    on_disk = load_sweep(tmp_path / "s")
    assert on_disk.failures == res.failures and on_disk.rows == res.rows
    assert json.loads((tmp_path / "s" / "failures.json").read_text())[0]["attempts"] == 3
    with pytest.raises(RuntimeError, match="1 failed"):
        res.raise_for_failures()


def test_retries_zero_and_a_transient_failure(tmp_path):
    res = run_sweep(raises_on, {"a": [1, 5], "bad": [5]}, tmp_path / "a", retries=0, progress=False)
    assert res.failures[0].attempts == 1 and len(CALLS) == 2
    res = run_sweep(flaky, {"a": [1, 2]}, tmp_path / "b", retries=1, progress=False)
    assert res.ok and [r["y"] for r in res.rows] == [1, 2]
    assert [r["attempts"] for r in res.records] == [2, 2]


def test_bad_results_are_task_failures(tmp_path):
    def not_a_dict(a):
        return a

    def clashing(a):
        return {"a": a + 1}

    def unstorable(a):
        return {"obj": object()}

    for fn, kind, text in [(not_a_dict, "TypeError", "dict"), (clashing, "ValueError", "also parameters"),
                           (unstorable, "TypeError", "result['obj']")]:
        res = run_sweep(fn, [{"a": 1}], tmp_path / fn.__name__, retries=0, progress=False)
        assert res.failures[0].error_type == kind and text in res.failures[0].message
    echo = run_sweep(lambda a: {"a": a, "y": 1}, [{"a": 1}], tmp_path / "echo", progress=False)
    assert echo.rows == [{"a": 1, "y": 1}]   # echoing a parameter unchanged is allowed


def test_a_pool_worker_that_dies_is_replaced_and_its_task_retried(tmp_path):
    marker = str(tmp_path / "died")
    res = run_sweep(die_once, {"i": list(range(6)), "marker": [marker]}, tmp_path / "s", backend="processes",
                    retries=2, progress=False)
    assert os.path.exists(marker), "the worker was not killed"
    assert res.ok and [r["y"] for r in res.rows] == [1, 2, 3, 4, 5, 6]
    assert res.records[3]["attempts"] == 2


@pytest.mark.parametrize("retries", [0, 1])
def test_a_worker_death_is_charged_to_its_own_task_only(tmp_path, retries):
    """A dying worker breaks the pool and fails every task in flight; one task killed it. The others were recorded
    failed (retries=0) or failed for good when their retry ran beside the killer's (retries=1). Now they run again
    alone, uncharged, and only the killer fails, after 1 + retries runs of its own (attempts counts every run)."""
    res = run_sweep(one_kills_its_worker, {"i": list(range(4))}, tmp_path / "s", backend="processes", n_workers=2,
                    retries=retries, progress=False)
    assert [r["i"] for r in res.rows] == [1, 2, 3]
    assert [(f.params["i"], f.error_type) for f in res.failures] == [(0, "WorkerDied")]
    assert res.failures[0].attempts >= 1 + retries


def test_a_nan_parameter_counts_as_done_and_may_be_echoed(tmp_path):
    """NaN != NaN: a task with a NaN parameter never counted as done (it ran again at every resume, its record moved
    to corrupt/), and a task echoing it was refused as contradicting its parameter. Compared as canonical JSON."""
    grid = {"x": [1.0, float("nan"), float("inf")]}
    first = run_sweep(echo_nan, grid, tmp_path / "s", progress=False)
    assert first.ok and first.n_run == 3 and not first.missing
    again = run_sweep(echo_nan, grid, tmp_path / "s", progress=False)
    assert again.ok and again.n_run == 0 and again.n_corrupt == 0 and not again.missing
    assert len(load_sweep(tmp_path / "s").rows) == 3
    # an echo equal as a value but written differently (3 and 3.0) is no contradiction either
    assert run_sweep(echo_as_float, {"n": [3]}, tmp_path / "f", progress=False).ok


# ---------------------------------------------------------------------- Dask
def test_two_sweeps_of_one_process_share_one_local_cluster(tmp_path, caplog):
    """A report's dozen grids started and stopped a LocalCluster each (85 s against 19 s in-process for two studies,
    with the nannies' warnings each time, a sweeps review): one cluster per process now, reused while it runs."""
    pytest.importorskip("distributed")
    from studies.sweep import backends

    backends.close_local_clusters()
    caplog.set_level(logging.INFO, logger="studies.sweep")
    a = run_sweep(echo_nan, {"x": [1, 2]}, tmp_path / "a", backend="dask", n_workers=1, progress=False)
    cluster = backends._LOCAL_CLUSTERS[1][0]
    b = run_sweep(echo_nan, {"x": [3]}, tmp_path / "b", backend="dask", n_workers=1, progress=False)
    assert a.ok and b.ok and backends._LOCAL_CLUSTERS[1][0] is cluster
    assert caplog.text.count("started a local Dask cluster") == 1 and "the local Dask cluster of 1" in caplog.text
    backends.close_local_clusters()
    assert not backends._LOCAL_CLUSTERS and str(cluster.status).endswith("closed")


def test_closing_one_shared_cluster_leaves_the_others_and_a_zombie_driver_is_dead(monkeypatch):
    """An interrupted sweep closes its own shared cluster, not the process's others (it closed them all); and the
    pool workers' watch counts a driver killed but not yet reaped (a zombie, its /proc entry still there) as gone."""
    from studies.sweep import backends

    class Fake:
        status = "Status.running"
        closed = False

        def close(self):
            self.closed = True

    a, b = Fake(), Fake()
    monkeypatch.setattr(backends, "_LOCAL_CLUSTERS", {1: (a, None), 2: (b, None)})
    backends.close_local_clusters(a)
    assert a.closed and not b.closed and list(backends._LOCAL_CLUSTERS) == [2]
    backends.close_local_clusters()
    assert b.closed and not backends._LOCAL_CLUSTERS

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while backends._alive(pid, backends._start_time(pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(f"/proc/{pid}/stat") as fh:          # exited, not reaped: a zombie
            assert fh.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert not backends._alive(pid, None)
    finally:
        os.waitpid(pid, 0)
    assert backends._alive(os.getpid(), backends._start_time(os.getpid()))


def test_localcluster_survives_a_killed_worker(tmp_path, caplog):
    pytest.importorskip("distributed")
    from studies.sweep import backends

    backends.close_local_clusters()   # this test's sweep starts its own
    caplog.set_level(logging.INFO, logger="studies.sweep")
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    grid = {"i": list(range(6)), "marker_dir": [str(marker_dir)]}
    box = {}
    # run_sweep starts its own LocalCluster(2 workers, 1 thread, processes); retries=0: the
    # rescheduling below is Dask's own, not the runner's.
    th = threading.Thread(target=lambda: box.update(res=run_sweep(
        slow_marked, grid, tmp_path / "s", backend="dask", n_workers=2, retries=0, progress=False)))
    th.start()
    victim, deadline = None, time.monotonic() + 90
    while victim is None:
        assert time.monotonic() < deadline, "no task started on a worker in 90 s"
        assert th.is_alive(), "the sweep ended before a worker could be killed"
        for m in marker_dir.glob("start-*"):
            _, i, pid = m.name.split("-")
            if not (marker_dir / f"end-{i}-{pid}").exists():   # task i is running in worker pid
                victim = (int(i), int(pid))
                break
        time.sleep(0.01)
    os.kill(victim[1], signal.SIGKILL)
    th.join(120)
    assert not th.is_alive(), "the sweep did not finish after the worker was killed"
    res = box["res"]
    assert res.ok and res.backend == "dask" and [r["y"] for r in res.rows] == [3 * i for i in range(6)]
    assert not (marker_dir / f"end-{victim[0]}-{victim[1]}").exists()   # the kill interrupted that task...
    assert res.rows[victim[0]]["pid"] != victim[1]                        # ...which Dask ran again elsewhere
    assert len(_records(tmp_path / "s")) == 6
    # the rerun is counted: two attempts for the killed task; a task that only waited in the dead
    # worker's queue (Dask sends a worker up to 2 tasks per thread) is rescheduled and counted too
    assert res.records[victim[0]]["attempts"] == 2 and res.records[victim[0]]["worker_deaths"] == 1
    attempts = [r["attempts"] for r in res.records]
    assert set(attempts) <= {1, 2} and attempts.count(2) <= 2
    # the worker started again after the kill serves no HTTP route either (it read the routes from a configuration
    # already restored, and answered /health, until the nannies got a copy of their own)
    import urllib.error
    import urllib.request

    pytest.importorskip("psutil")
    for who, _, port in _listeners():
        try:
            status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError:
            status = None
        assert status in (None, 404), (who, port, status)
    # never silent, and over mutual TLS when cryptography is installed (test_local_cluster_binds_only_*)
    assert "started a local Dask cluster of 2 worker(s), scheduler t" in caplog.text
    try:
        import cryptography  # noqa: F401
        assert "scheduler tls://127.0.0.1:" in caplog.text and "mutual TLS" in caplog.text
    except ImportError:
        assert "WITHOUT authentication" in caplog.text


def _listeners():
    """(process, ip, port) of every listening socket of this process and its children."""
    import psutil

    me = psutil.Process()
    return [("main" if p.pid == me.pid else "worker", c.laddr.ip, c.laddr.port)
            for p in [me, *me.children(recursive=True)] for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_local_cluster_binds_only_localhost_tls_and_no_http_server(tmp_path):
    """The LocalCluster of backend='dask' (studies.sweep.backends.local_cluster): every listener on 127.0.0.1; the
    main process listens only for the scheduler and one nanny per worker, all TLS (no HTTP server: Dask's
    dashboard_address=None alone leaves one on 8787); a client without this cluster's credentials (plain TCP,
    or TLS with other credentials) cannot connect, so it can neither run code nor read results; the sweep's
    own client runs tasks."""
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("cryptography")
    import urllib.error
    import urllib.request

    from distributed.security import Security

    from studies.sweep.backends import local_cluster

    before = {port for who, _, port in _listeners() if who == "main"}
    cluster, security = local_cluster(2)
    try:
        with distributed.Client(cluster, security=security) as client:
            assert client.submit(seeded_norm, n=3, seed=1).result() == seeded_norm(n=3, seed=1)
            address = client.scheduler.address
            assert address.startswith("tls://127.0.0.1:")
            found = _listeners()
            assert found and all(ip == "127.0.0.1" for _, ip, _ in found), found
            main_ports = {port for who, _, port in found if who == "main"} - before
            assert len(main_ports) == 1 + 2, found            # the scheduler and two nannies, nothing else
            for who, _, port in found:                        # no HTTP answer anywhere but 404s
                try:
                    status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
                except urllib.error.HTTPError as exc:
                    status = exc.code
                except OSError:
                    status = None                             # a TLS listener drops plain HTTP
                assert status in (None, 404), (who, port, status)
            for outsider in (Security(), Security.temporary()):
                with pytest.raises((OSError, TypeError)):
                    distributed.Client(address, security=outsider, timeout=5)
    finally:
        cluster.close()


@pytest.mark.slow
def test_dask_scheduler_as_address_client_or_cluster_object(tmp_path):
    distributed = pytest.importorskip("distributed")
    grid = {"n": [3, 4], "seed": [0, 1]}
    truth = [{**p, **seeded_norm(**p)} for p in expand_grid(grid)]
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cl:
        with distributed.Client(cl) as client:
            for i, sched in enumerate([cl.scheduler_address, client, cl]):
                res = run_sweep(seeded_norm, grid, tmp_path / str(i), scheduler=sched, progress=False)
                assert res.backend == "dask" and res.rows == truth
            assert client.status == "running"   # a client given by the user is left open


def test_same_grid_and_seed_same_table_on_every_backend(tmp_path):
    grid = {"n": [3, 5], "seed": [0, 1, 2]}
    truth = [{**p, **seeded_norm(**p)} for p in expand_grid(grid)]
    tables = {}
    for backend in ["inprocess", "processes"]:   # dask: test_localcluster_survives_a_killed_worker
        res = run_sweep(seeded_norm, grid, tmp_path / backend, backend=backend, n_workers=2, progress=False)
        assert res.rows == truth, backend
        tables[backend] = (tmp_path / backend / "results.csv").read_text()
    again = run_sweep(seeded_norm, grid, tmp_path / "again", progress=False)
    assert again.rows == truth
    assert len(set(tables.values())) == 1


# ---------------------------------------------------------------------- grid, store, options
def test_grid_order_is_nested_loops_and_values_are_normalized():
    grid = {"a": [1, 2], "b": ["x", "y", "z"], "c": [(1, 2)]}
    want = [{"a": a, "b": b, "c": [1, 2]} for a in [1, 2] for b in ["x", "y", "z"]]
    assert expand_grid(grid) == want
    assert expand_grid([{"n": np.int64(3), "r": np.float64(0.5)}]) == [{"n": 3, "r": 0.5}]
    assert type(expand_grid([{"n": np.int64(3)}])[0]["n"]) is int
    with pytest.raises(ValueError, match=r"grid\[2\].*grid\[0\]"):
        expand_grid([{"a": 1, "b": 2}, {"a": 2}, {"b": 2, "a": 1}])
    with pytest.raises(TypeError, match=r"grid\[0\]\['f'\]"):
        expand_grid([{"f": object()}])
    with pytest.raises(TypeError, match=r"grid\['a'\]"):
        expand_grid({"a": 3})
    with pytest.raises(TypeError, match="grid"):
        expand_grid("abc")


def test_task_key_is_stable_and_order_independent():
    assert task_key("s", {"a": 1, "b": [1, 2]}) == task_key("s", {"b": [1, 2], "a": 1})
    assert task_key("s", {"a": 1}) != task_key("t", {"a": 1}) != task_key("s", {"a": 1.0})
    # Pinned: a key must not change between versions or machines, or resumed sweeps would rerun.
    import hashlib
    text = '{"name":"s","params":{"a":1,"b":[1,2]}}'
    assert task_key("s", {"a": 1, "b": [1, 2]}) == hashlib.sha256(text.encode()).hexdigest()[:24]


def test_resume_false_recomputes_and_nonfinite_results_roundtrip(tmp_path):
    import torch  # here only: workers that import this module should not pay for torch

    def inf_task(a):
        CALLS.append(a)
        return {"v": float("inf") if a else float("-inf"), "t": torch.tensor([a, 2.0])}

    run_sweep(inf_task, {"a": [0, 1]}, tmp_path, progress=False)
    res = run_sweep(inf_task, {"a": [0, 1]}, tmp_path, progress=False)
    assert res.n_run == 0 and CALLS == [0, 1]
    res = run_sweep(inf_task, {"a": [0, 1]}, tmp_path, resume=False, progress=False)
    assert res.n_run == 2 and CALLS == [0, 1, 0, 1]
    assert load_sweep(tmp_path).rows == [{"a": 0, "v": float("-inf"), "t": [0.0, 2.0]},
                                         {"a": 1, "v": float("inf"), "t": [1.0, 2.0]}]


def test_extending_a_grid_runs_only_the_new_tasks(tmp_path):
    run_sweep(square, {"a": [1, 2]}, tmp_path, progress=False)
    res = run_sweep(square, {"a": [0, 1, 2, 3]}, tmp_path, progress=False)
    assert CALLS == [{"a": 1, "b": 0}, {"a": 2, "b": 0}, {"a": 0, "b": 0}, {"a": 3, "b": 0}]
    assert [r["a"] for r in res.rows] == [0, 1, 2, 3] and res.n_resumed == 2


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="backend"):
        run_sweep(square, [{"a": 1}], tmp_path, backend="threads")
    with pytest.raises(ValueError, match="n_workers"):
        run_sweep(square, [{"a": 1}], tmp_path, n_workers=0)
    with pytest.raises(ValueError, match="retries"):
        run_sweep(square, [{"a": 1}], tmp_path, retries=-1)
    with pytest.raises(ValueError, match="scheduler"):
        run_sweep(square, [{"a": 1}], tmp_path, backend="processes", scheduler="tcp://127.0.0.1:1")
    with pytest.raises(TypeError, match="fn"):
        run_sweep(3, [{"a": 1}], tmp_path)
    with pytest.raises(TypeError, match="fn"):
        run_sweep(lambda a: {}, [{"a": 1}], tmp_path / "l", backend="processes")
    run_sweep(square, [{"a": 1}], tmp_path / "named", name="one", progress=False)
    with pytest.raises(ValueError, match="name"):
        run_sweep(square, [{"a": 1}], tmp_path / "named", name="two")
    with pytest.raises(ValueError, match="out_dir"):
        load_sweep(tmp_path / "nothing")


def kw_task(a, **extra):
    return {"y": a, "extra": sorted(extra)}


def test_grid_names_that_do_not_fit_fn_are_refused_before_any_task_runs(tmp_path):
    """A typo in a grid raises at once, naming the grid and the parameter (not 1 + retries failing runs of every
    task and a result with ok=False); partial objects, **kwargs and callables without a signature still run."""
    import functools

    with pytest.raises(TypeError, match=r"^grid: parameters do not fit fn square\(a, b=0\): no argument 'aa' "
                                        r"\(did you mean 'a'\?\); missing 'a'$"):
        run_sweep(square, {"aa": [1, 2]}, tmp_path / "typo", progress=False)
    with pytest.raises(TypeError, match=r"^grid\[1\]: parameters do not fit fn square\(a, b=0\): no argument 'c'$"):
        run_sweep(square, [{"a": 1}, {"a": 2, "c": 3}], tmp_path / "extra", progress=False)
    with pytest.raises(TypeError, match=r"missing 'bad'$"):
        run_sweep(raises_on, {"a": [1]}, tmp_path / "missing", progress=False)
    with pytest.raises(TypeError, match=r"no argument 'a'$"):   # a is bound by the partial already
        run_sweep(functools.partial(square, 1), {"a": [2]}, tmp_path / "bound", progress=False)
    assert CALLS == [] and not any((tmp_path / d).exists() for d in ("typo", "extra", "missing", "bound"))
    # what fn(**params) accepts runs: a partial's keywords given again, **kwargs, no readable signature
    part = functools.partial(raises_on, bad=2)
    assert run_sweep(part, {"a": [1], "bad": [5]}, tmp_path / "p", progress=False, name="p").rows == \
        [{"a": 1, "bad": 5, "y": 2}]
    assert run_sweep(kw_task, {"a": [1], "z": [0]}, tmp_path / "k", progress=False).rows == \
        [{"a": 1, "z": 0, "y": 1, "extra": ["z"]}]
    assert run_sweep(dict, {"a": [1]}, tmp_path / "d", progress=False, name="d").rows == [{"a": 1}]


def test_an_empty_grid_and_an_unwritable_folder_are_errors_naming_the_argument(tmp_path, monkeypatch):
    """An empty grid returned ok with 0 tasks and a results.csv of one empty line; a read-only folder raised a bare
    OSError on its lock file (a sweeps review)."""
    for grid, what in (({"a": []}, "no values for 'a'"), ({"a": [1], "b": []}, "no values for 'b'"),
                       ([], "an empty list of parameter dicts")):
        with pytest.raises(ValueError, match=f"^grid: no task to run \\({what}\\)$"):
            run_sweep(square, grid, tmp_path / "e", progress=False)
    from studies.sweep import store as store_module

    def read_only(self):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(store_module.SweepStore, "lock", read_only)
    with pytest.raises(OSError, match="^.*out_dir: cannot write the sweep's folder .*: Read-only file system"):
        run_sweep(square, {"a": [1]}, tmp_path / "ro", progress=False)
    assert CALLS == []


def test_an_out_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "f").write_text("not a folder")
    with pytest.raises(ValueError, match=r"^out_dir: .*/f is an existing file, not a folder; give a folder path$"):
        run_sweep(square, {"a": [1]}, tmp_path / "f", progress=False)
    with pytest.raises(ValueError, match=r"^out_dir: .*/f/sub cannot be created: .*/f is a file, not a folder"):
        run_sweep(square, {"a": [1]}, tmp_path / "f" / "sub", progress=False)
    assert CALLS == [] and (tmp_path / "f").read_text() == "not a folder"


def test_a_folder_in_use_is_refused(tmp_path):
    run_sweep(square, [{"a": 1}], tmp_path, progress=False)
    with open(tmp_path / ".lock", "a+") as fh:   # another runner holding the folder
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="in use"):
            run_sweep(square, [{"a": 1}], tmp_path, progress=False)
    assert run_sweep(square, [{"a": 1}], tmp_path, progress=False).ok   # released with its holder


def test_progress_off_a_terminal_is_plain_lines_with_the_full_name(tmp_path, capsys):
    name = "a/very/long/sweep/name/that/is/longer/than/thirty/characters"
    run_sweep(raises_on, {"a": [0, 1, 2], "bad": [1]}, tmp_path, retries=0, progress=True, name="x", label=name)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"{name}: 0/3 tasks", f"{name}: 2/3 tasks in {err.split(' in ')[1].split(',')[0]}, "
                                                      f"done=2 running=0 failed=1; results in {tmp_path} "
                                                      "(failures.json: 1 failed)"]
    assert "\r" not in err and "\x1b" not in err


def test_a_progress_line_shows_the_status_of_its_own_count(tmp_path, capsys, monkeypatch):
    """A line printed on a task's completion showed the status before it (39/48 tasks, done=38), and the in-process
    backend said running=0 while its task ran (a sweeps review)."""
    import time

    from studies.sweep import progress as progress_module

    monkeypatch.setattr(progress_module, "TICK_SECONDS", 0.02)
    real = progress_module.Progress.__init__
    monkeypatch.setattr(progress_module.Progress, "__init__",
                        lambda self, *a, **k: real(self, *a, **{**k, "interval": 0.1}))

    def slow(a):
        time.sleep(0.25)
        return {"y": a}

    run_sweep(slow, {"a": [0, 1, 2, 3]}, tmp_path, backend="inprocess", progress=True, name="s", label="s")
    lines = capsys.readouterr().err.splitlines()
    for line in lines[1:-1]:
        count = int(line.split(": ")[1].split("/")[0])
        assert f"done={count} " in line, line
    assert any("running=1" in line and "no task finished for" in line for line in lines), lines


def test_a_step_longer_than_the_interval_shows_signs_of_life(capsys, monkeypatch):
    """Lines came only when a step finished: one certified constant of a million atoms (minutes) left a log silent
    for its whole duration. A ticker now says how long the current step has run, stops when the bar closes, and
    ends with a bar that is never closed."""
    import gc
    import threading
    import time

    from studies.sweep import Progress
    from studies.sweep import progress as progress_module

    monkeypatch.setattr(progress_module, "TICK_SECONDS", 0.02)
    bar = Progress(2, "slow", unit="task", interval=0.1)
    time.sleep(0.45)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    ticks = [line for line in lines if "no task finished for" in line]
    assert lines[0] == "slow: 0/2 tasks" and 2 <= len(ticks) <= 5 and lines[-1].startswith("slow: 0/2 tasks in ")
    assert all(t.startswith("slow: 0/2 tasks (0%), ") for t in ticks)
    time.sleep(0.2)
    assert capsys.readouterr().err == ""           # closed: the ticker said nothing more
    tickers = lambda: [t for t in threading.enumerate() if t.name.startswith("progress ticker (forgotten")]
    forgotten = Progress(2, "forgotten", unit="task", interval=0.05)
    assert len(tickers()) == 1
    del forgotten
    gc.collect()
    time.sleep(0.2)
    assert tickers() == []                           # a Progress never closed does not leave its thread behind


def test_log_lines_on_a_terminal_go_between_the_bars():
    """On a terminal the ticker redraws a bar every second, and a log line printed next came after the bar on the
    same line; the command line's handler now writes through tqdm.write (bars cleared, line, bars drawn again)."""
    import io
    import logging

    from studies.sweep import Progress
    from studies.sweep.progress import BarAwareHandler

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    handler = BarAwareHandler(term)
    log = logging.getLogger("studies.test_bar_aware")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        bar = Progress(3, "study/grid", unit="task", file=term)
        bar._tick()                     # what the ticker does every second
        log.info("streaming Sinkhorn: 200 of at most 5000 updates")
        bar.close()
    finally:
        log.removeHandler(handler)
    text = term.getvalue()
    line = next(seg for seg in text.replace("\r", "\n").split("\n") if "Sinkhorn" in seg)
    assert line == "streaming Sinkhorn: 200 of at most 5000 updates"   # alone on its line, no bar before it
    plain = io.StringIO()
    logging.makeLogRecord({})
    BarAwareHandler(plain).emit(logging.makeLogRecord({"msg": "x", "levelno": logging.INFO}))
    assert plain.getvalue() == "x\n"


def test_progress_lines_are_periodic(capsys):
    from studies.sweep import Progress

    bar = Progress(4, "loop", unit="step", interval=0.0)
    for _ in range(3):
        bar.update(1, now="x")
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "loop: 0/4 steps" and lines[1].startswith("loop: 1/4 steps (25%), now=x, ")
    assert "left" in lines[1] and lines[-1].startswith("loop: 3/4 steps in ")
    assert len(lines) == 5
    silent = Progress(4, "quiet", enabled=False)
    silent.update(4)
    silent.close()
    assert capsys.readouterr().err == ""
    # an interrupted sweep's last line says so (3/4 in 2 s read as a finished run)
    cut = Progress(4, "cut", unit="task", interval=1e9)
    cut.update(3)
    cut.close(interrupted=True)
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("cut: 3/4 tasks in ") and ", interrupted" in last


def test_tables_on_disk(tmp_path):
    from studies.io import read_csv

    res = run_sweep(square, {"a": [1, 2], "b": [5]}, tmp_path / "s", progress=False)
    assert read_csv(tmp_path / "s" / "results.csv") == res.rows
    assert res.to_pandas()["y"].tolist() == [6, 9]
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pyarrow"):
            res.to_parquet(tmp_path / "t.parquet")
    else:
        import pandas as pd
        assert pd.read_parquet(res.to_parquet(tmp_path / "t.parquet"))["y"].tolist() == [6, 9]


def test_command_line_options(tmp_path, monkeypatch):
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tcp://10.1.2.3:8786")
    p = add_sweep_arguments(argparse.ArgumentParser())
    opts = sweep_options(p.parse_args([]))
    assert opts == {"backend": "auto", "n_workers": 2, "scheduler": "tcp://10.1.2.3:8786", "resume": True,
                    "retries": 2, "progress": True}
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS")
    p = add_sweep_arguments(argparse.ArgumentParser())
    opts = sweep_options(p.parse_args(["--backend", "inprocess", "--workers", "3", "--no-resume", "--retries", "1",
                                       "--no-progress"]))
    assert opts == {"backend": "inprocess", "n_workers": 3, "scheduler": None, "resume": False, "retries": 1,
                    "progress": False}
    assert run_sweep(square, {"a": [4]}, tmp_path, **opts).rows == [{"a": 4, "y": 16}]


def test_an_explicit_local_backend_wins_over_the_scheduler_variable(tmp_path, caplog):
    """$DASK_SCHEDULER_ADDRESS set by a job environment: --backend inprocess or processes runs locally and the log
    says the variable is ignored; auto and dask adopt it (logged); --scheduler wins over it; an empty --scheduler
    is refused (not read as 'none')."""
    from studies.sweep import scheduler_from_environment

    env = {"DASK_SCHEDULER_ADDRESS": "tcp://10.1.2.3:8786"}
    p = add_sweep_arguments(argparse.ArgumentParser())
    caplog.set_level(logging.INFO, logger="studies.sweep")
    for backend in ("inprocess", "processes"):
        caplog.clear()
        args = p.parse_args(["--backend", backend])
        opts = sweep_options(args, env)
        assert opts["backend"] == backend and opts["scheduler"] is None
        assert scheduler_from_environment(args, env) is None
        assert f"--backend {backend}: running on this machine; $DASK_SCHEDULER_ADDRESS=tcp://10.1.2.3:8786 is " \
               "ignored" in caplog.text
    assert run_sweep(square, {"a": [3]}, tmp_path, **sweep_options(p.parse_args(["--backend", "processes",
                                                                                 "--no-progress"]), env)).ok
    for argv in ([], ["--backend", "dask"]):
        caplog.clear()
        args = p.parse_args(argv)
        assert sweep_options(args, env)["scheduler"] == "tcp://10.1.2.3:8786"
        assert scheduler_from_environment(args, env) == "tcp://10.1.2.3:8786"
        assert "using the Dask scheduler tcp://10.1.2.3:8786 from $DASK_SCHEDULER_ADDRESS" in caplog.text
    args = p.parse_args(["--scheduler", "tcp://10.9.9.9:1"])
    assert sweep_options(args, env)["scheduler"] == "tcp://10.9.9.9:1" and scheduler_from_environment(args, env) is None
    with pytest.raises(SystemExit):
        p.parse_args(["--scheduler", " "])


def test_the_sweep_subpackage_imports_nothing_from_the_rest_of_studies():
    """studies.sweep stands alone (no cycle with the studies that use it): its modules import only
    each other, the standard library and third-party packages."""
    import ast

    root = REPO / "studies" / "sweep"
    for f in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                assert node.level == 1 or not mod.startswith("studies") or mod.startswith("studies.sweep"), \
                    (f.name, mod)
                assert node.level <= 1, (f.name, mod)   # "from .." would leave the subpackage
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("studies") for a in node.names), f.name
    code = ("import sys; import studies.sweep; "
            "print(sorted(m for m in sys.modules if m.startswith('studies') and not m.startswith('studies.sweep')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "['studies']", res.stderr


@pytest.mark.parametrize("line, unguarded", [(2, True), (4, False), (6, True), (8, False), (10, True)])
def test_main_guard_found_in_the_script(line, unguarded):
    """Which lines of a script a process pool's workers would run again on import: those outside the body of
    `if __name__ == "__main__":` (either way round); the else branch is what they run."""
    from studies.sweep.backends import unguarded_line

    source = textwrap.dedent('''\
        import os
        run_sweep(f, grid)
        if __name__ == "__main__":
            run_sweep(f, grid)
        else:
            run_sweep(f, grid)
        if "__main__" == __name__:
            run_sweep(f, grid)
        def g():
            run_sweep(f, grid)
        ''')
    assert unguarded_line(source, line) is unguarded


def test_processes_backend_from_an_unguarded_script_is_refused_before_any_worker(tmp_path):
    """A script that runs a 'processes' sweep at its top level: every worker imported it again (re-running its
    top-level code) and died, and each task was reported as a dead worker. It is now refused before a worker
    starts, saying what to write; the same script with the guard runs its tasks."""
    (tmp_path / "tasks_mod.py").write_text("def square(x):\n    return {'y': x * x}\n")
    body = (f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nfrom tasks_mod import square\n"
            "from studies.sweep import run_sweep\nprint('top level ran', flush=True)\n")
    call = "run_sweep(square, {{'x': [1, 2]}}, {out!r}, backend='processes', n_workers=1)\n"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    bad = tmp_path / "unguarded.py"
    bad.write_text(body + call.format(out=str(tmp_path / "a")))
    run = subprocess.run([sys.executable, str(bad)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode != 0 and run.stdout.count("top level ran") == 1
    assert "line 6 runs the sweep at its top level" in run.stderr and 'if __name__ == "__main__":' in run.stderr
    good = tmp_path / "guarded.py"
    good.write_text(body + "if __name__ == '__main__':\n    " + call.format(out=str(tmp_path / "b")))
    run = subprocess.run([sys.executable, str(good)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(r["y"] for r in load_sweep(tmp_path / "b").rows) == [1, 4]


def test_a_damaged_manifest_of_an_unfinished_sweep_does_not_read_as_finished(tmp_path):
    """4 of 8 tasks finished, one record corrupt, sweep.json damaged: load_sweep rebuilt the grid from the 3 good
    records and said tasks=3, missing=0, ok=True, n_corrupt=0. It now says the grid is unknown (not ok) and counts
    the corrupt record."""
    out = tmp_path / "s"
    grid = [{"a": a, "b": 0} for a in range(8)]
    run_sweep(square, grid[:4], out, progress=False, name="half")
    victim = sorted((out / "records").glob("*.rec"))[0]
    victim.write_bytes(victim.read_bytes()[:-7] + b"garbage")
    (out / "sweep.json").write_text("{bad")
    seen = load_sweep(out)
    assert len(seen.rows) == 3 and seen.n_corrupt == 1 and not seen.grid_known and not seen.ok
    finished = run_sweep(square, grid, out, progress=False, name="half")   # the grid given: known, finished
    assert finished.ok and finished.grid_known and len(finished.rows) == 8


def test_a_function_the_process_backend_refuses_prints_no_progress_first(tmp_path, capsys):
    """A lambda cannot go to worker processes: the TypeError names fn, and no '0/1 tasks' progress line came
    before it (the bar was opened before the backend refused the function)."""
    with pytest.raises(TypeError, match="fn: backend='processes' needs a picklable top-level function"):
        run_sweep(lambda a: {"y": a}, [{"a": 1}], tmp_path / "s", backend="processes", progress=True)
    captured = capsys.readouterr()
    assert "tasks" not in captured.out + captured.err


def _ordered_task(n):
    return {"lip": float(n), "error": 0.5, "converged": True}


def test_rows_give_the_parameters_then_the_results_columns_sorted_by_name(tmp_path):
    # records are canonical JSON, so that a sweep resumed from records of any release gives the uninterrupted run's
    # table: the grid's parameters first, then the task's keys sorted by name (docs/sweeps.md), fresh and read back
    res = run_sweep(_ordered_task, {"n": [1, 2]}, tmp_path / "s", backend="inprocess", progress=False)
    assert [list(r) for r in res.rows] == [["n", "converged", "error", "lip"]] * 2
    assert [list(r) for r in load_sweep(tmp_path / "s").rows] == [["n", "converged", "error", "lip"]] * 2
    assert (tmp_path / "s" / "results.csv").read_text().splitlines()[0] == "n,converged,error,lip"


def sleeps_long(i):
    time.sleep(60)
    return {"i": i}


def test_an_interrupted_process_sweep_stops_its_running_tasks(tmp_path):
    """A KeyboardInterrupt in run_sweep (a notebook's interrupt, SIGINT sent to this process alone) shut the pool
    down without its running tasks: the interrupt came at once, but the interpreter's exit then waited for
    them (81-126 s in a review). Now the running workers are terminated: none is alive after the interrupt."""
    import signal
    import threading

    from studies.sweep import backends

    seen = []
    close = backends._Pool.close

    def spy(self, cancel):
        seen.extend((getattr(self.pool, "_processes", None) or {}).values())
        return close(self, cancel)

    timer = threading.Timer(4.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.perf_counter()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(backends._Pool, "close", spy)
            with pytest.raises(KeyboardInterrupt):
                run_sweep(sleeps_long, {"i": [1, 2, 3, 4]}, tmp_path / "s", backend="processes", n_workers=2,
                          progress=False)
    finally:
        timer.cancel()
    assert time.perf_counter() - t0 < 30
    assert seen and not any(p.is_alive() for p in seen)


def test_read_csv_gives_back_numbers_and_keeps_strings_that_only_look_like_them(tmp_path):
    """read_csv turned the string "007" into 7 and "1.50" into 1.5 (a new user's review): a field is a number only
    where it is the text write_csv writes for one (Python's repr)."""
    from studies.io import read_csv, write_csv

    row = {"a": 1, "b": 0.1, "c": "007", "d": math.nan, "e": True, "f": "1.50", "g": 1e-5, "h": math.inf,
           "i": 12345678901234567890, "j": "nan-ish"}
    write_csv([row], tmp_path / "t.csv")
    back = read_csv(tmp_path / "t.csv")[0]
    assert back["c"] == "007" and back["f"] == "1.50" and back["j"] == "nan-ish" and back["e"] is True
    assert math.isnan(back["d"]) and back["h"] == math.inf
    assert {k: back[k] for k in "abgi"} == {k: row[k] for k in "abgi"}
    assert type(back["a"]) is int and type(back["i"]) is int
