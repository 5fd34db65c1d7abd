"""Where the tasks of a sweep run: in-process, a local process pool, or a Dask cluster.

Each backend offers submit / wait / outcome / running / close over futures; the loop in
:mod:`studies.sweep.runner` drives them alike. Every task runs through :func:`run_task`, which turns the
task's own exceptions into data (type, message, traceback) so that one failing task never stops a
sweep, and infrastructure failures (a dead pool worker, Dask's KilledWorker) into the same form.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping

from .files import canonical_json, normalize

__all__ = ["run_task", "make_backend", "local_cluster"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- the task, on a worker
def run_task(fn, params: dict, threads: int | None) -> dict:
    """Run one task and return its outcome; never raises on the task's own errors."""
    torch = sys.modules.get("torch")   # only if fn's module uses it: importing torch costs seconds
    if threads is not None and torch is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # one thread per worker: workers x threads must fit the cores
    t0 = time.perf_counter()
    where = {"host": socket.gethostname(), "pid": os.getpid()}
    try:
        result = fn(**params)
        if not isinstance(result, Mapping):
            raise TypeError(f"fn must return a dict of results, returned {type(result).__name__}")
        result = normalize(result, "result")
        # equal as values (3 and 3.0) or as the records store them, canonical JSON (an echoed NaN)
        clash = sorted(k for k in set(result) & set(params)
                       if result[k] != params[k] and canonical_json(result[k]) != canonical_json(params[k]))
        if clash:   # echoing a parameter is fine; contradicting it would make the row ambiguous
            raise ValueError(f"fn returned keys that are also parameters, with other values: {clash}; rename them")
        return {"status": "ok", "result": result, "elapsed_s": time.perf_counter() - t0, **where}
    except Exception as exc:  # every task error is data for the report; KeyboardInterrupt still stops
        return {"status": "failed", "error": _error_dict(exc), "elapsed_s": time.perf_counter() - t0, **where}


def _error_dict(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def _worker_init(parent: tuple[int, str | None] | None = None) -> None:
    # Read by torch, numpy's BLAS and OpenMP when first loaded in this worker; run_task pins torch
    # again in case the fork server preloaded it.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    if parent is not None:
        threading.Thread(target=_exit_with, args=parent, name="sweep-parent-watch", daemon=True).start()


#: how often a pool worker checks that the process that started the sweep is alive (seconds)
PARENT_POLL = 1.0


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of Linux's /proc/PID/stat after the command name (state first, start time 20th), or None where
    /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat, field 22), which tells a process from a
    later one given the same pid; None where /proc does not say."""
    fields = _proc_stat(pid)
    return None if fields is None else fields[19]


def _alive(pid: int, started: str | None) -> bool:
    """Whether the process ``pid`` started at ``started`` runs: gone, a zombie (killed, not reaped yet: its /proc
    entry stays) or another process given the same pid are not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # a process of another user holds the pid now
        return False
    fields = _proc_stat(pid)
    if fields is None:
        return True       # no /proc here: the pid exists
    return fields[0] != "Z" and (started is None or fields[19] == started)


def _exit_with(pid: int, started: str | None) -> None:
    """A worker's watch of the process that started the sweep: the worker exits once that process is gone. The
    pool's workers are children of the fork server, not of that process, and a SIGKILL leaves it no chance to
    stop them: without this they finished their queued tasks, whose results no one reads, and then waited idle
    forever (a review found them alive after the driver's kill -9)."""
    while _alive(pid, started):
        time.sleep(PARENT_POLL)
    os._exit(1)


# ---------------------------------------------------------------------- backends
class _InProcess:
    name = "inprocess"

    def __init__(self, fn):
        self.fn = fn

    def submit(self, params):
        import concurrent.futures as cf

        fut = cf.Future()
        fut.set_result(run_task(self.fn, params, None))
        return fut

    def window(self) -> int:
        return 1

    def wait(self, futures, timeout):
        return [f for f in futures if f.done()]

    def outcome(self, fut) -> dict:
        return fut.result()

    def running(self, inflight: int) -> int:
        return inflight

    def close(self, cancel: bool) -> None:
        pass


def _is_main_test(test) -> bool:
    """Whether an ``if`` test is ``__name__ == "__main__"`` (either way round)."""
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(t, ast.Name) and t.id == "__name__" for t in sides)
            and any(isinstance(t, ast.Constant) and t.value == "__main__" for t in sides))


def unguarded_line(source: str, line: int) -> bool:
    """Whether ``line`` of a script's ``source`` lies outside every ``if __name__ == "__main__":`` block (its body;
    an ``else`` branch is what the workers run). Unparsable source counts as guarded (nothing is claimed)."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and \
                node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
            return False
    return True


def _check_main_guard() -> None:
    """A process pool started from the top level of a script without ``if __name__ == "__main__":`` fails every
    task: its workers (forkserver, spawn) import the script, which runs its top-level code again (the sweep, and
    whatever else is there: a folder removed, a file written) and dies in Python's bootstrapping check; the
    parent saw only dead workers. Refused here, before any worker starts, with what to write. Interactive
    sessions, ``python -c`` and calls inside functions of an imported module are not concerned."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return
    try:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
    except (OSError, UnicodeDecodeError):
        return
    if unguarded_line(source, frame.f_lineno):
        raise RuntimeError(
            f"backend: 'processes' starts workers that import the script {path}, and line {frame.f_lineno} runs the "
            "sweep at its top level: every worker would run it again (with the script's other top-level code) and "
            "die. Put the call under `if __name__ == \"__main__\":` (docs/sweeps.md), or use backend='inprocess'")


class _Pool:
    """concurrent.futures process pool; a pool broken by a dying worker is rebuilt."""

    name = "processes"

    def __init__(self, fn, n_workers: int):
        import multiprocessing as mp

        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise TypeError(f"fn: backend='processes' needs a picklable top-level function ({exc})") from None
        _check_main_guard()
        # fork would copy the parent's torch thread pools and locks; forkserver/spawn start clean.
        if "forkserver" in mp.get_all_start_methods():
            self.ctx = mp.get_context("forkserver")
            module = getattr(getattr(fn, "func", fn), "__module__", None)   # functools.partial: its function
            if module and module != "__main__":
                # The fork server imports fn's module (and torch with it) once; every worker, and
                # every replacement of a dead one, is then a cheap fork instead of a fresh import.
                # No effect once this process's fork server runs; failed imports are ignored.
                self.ctx.set_forkserver_preload(["__main__", module])
        else:
            self.ctx = mp.get_context("spawn")
        self.fn, self.n_workers, self.pool, self._pool_of = fn, n_workers, None, {}

    def _ensure(self):
        if self.pool is None:
            import concurrent.futures as cf

            self.pool = cf.ProcessPoolExecutor(self.n_workers, mp_context=self.ctx, initializer=_worker_init,
                                               initargs=((os.getpid(), _start_time(os.getpid())),))
        return self.pool

    def submit(self, params):
        from concurrent.futures.process import BrokenProcessPool

        try:
            fut = self._ensure().submit(run_task, self.fn, params, 1)
        except BrokenProcessPool:   # broke since the last completed future was seen: start afresh
            self._discard(self.pool)
            fut = self._ensure().submit(run_task, self.fn, params, 1)
        self._pool_of[fut] = self.pool
        return fut

    def _discard(self, pool) -> None:
        if pool is not None and pool is self.pool:
            pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    def window(self) -> int:
        return 2 * self.n_workers

    def wait(self, futures, timeout):
        import concurrent.futures as cf

        return cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED).done

    def outcome(self, fut) -> dict:
        from concurrent.futures.process import BrokenProcessPool

        pool = self._pool_of.pop(fut, None)
        try:
            return fut.result()
        except BrokenProcessPool as exc:
            self._discard(pool)   # only if no replacement was started yet
            return {"status": "failed", "error": {
                "type": "WorkerDied", "traceback": "",
                "message": f"a pool worker died (killed, out of memory, crashed) with this task in flight: {exc}"}}
        except Exception as exc:  # e.g. results that fail to unpickle
            return {"status": "failed", "error": _error_dict(exc)}

    def running(self, inflight: int) -> int:
        return min(inflight, self.n_workers)

    def close(self, cancel: bool) -> None:
        if self.pool is not None:
            # an interrupted sweep (cancel) also stops the tasks running: shutdown(cancel_futures) drops only those
            # not started, and the interpreter's exit then waited for the running ones (minutes, after the
            # KeyboardInterrupt of a notebook or of a SIGINT sent to this process alone)
            workers = list((getattr(self.pool, "_processes", None) or {}).values()) if cancel else []
            self.pool.shutdown(wait=not cancel, cancel_futures=cancel)
            for proc in workers:
                if proc.is_alive():
                    proc.terminate()
            for proc in workers:
                proc.join(timeout=5)
            self.pool = None


class _Dask:
    """A dask.distributed client; tasks on a lost worker are rescheduled by Dask itself."""

    name = "dask"

    def __init__(self, fn, n_workers: int, scheduler, name: str):
        try:
            import distributed
        except ImportError:
            raise ImportError("backend='dask' needs dask.distributed: pip install 'dask[distributed]'") from None
        self.distributed, self.fn, self.prefix = distributed, fn, name.replace(" ", "_")[:40]
        self._own_client, self._cluster, self.threads = False, None, None
        if isinstance(scheduler, distributed.Client):
            self.client = scheduler
            log.info("sweep %s: Dask client given by the caller, scheduler %s", name, _address(self.client))
        elif scheduler is None:
            (self._cluster, security), started = shared_local_cluster(n_workers)
            self.client = distributed.Client(self._cluster, security=security)
            self._own_client, self.threads = True, 1
            log.info("sweep %s: %s local Dask cluster of %d worker(s), scheduler %s (%s; see docs/sweeps.md)",
                     name, "started a" if started else "the", n_workers, _address(self.client),
                     "mutual TLS with temporary credentials, no dashboard" if security is not None else
                     "WITHOUT authentication: any local user can connect; pip install cryptography")
        elif isinstance(scheduler, str) or hasattr(scheduler, "scheduler_address"):
            self.client, self._own_client = distributed.Client(scheduler), True   # address or cluster object
            log.info("sweep %s: Dask scheduler %s", name, _address(self.client))
        else:
            raise TypeError("scheduler: expected an address 'tcp://host:port', a distributed.Client or a cluster "
                            f"object with a scheduler_address, got {type(scheduler).__name__}")
        self._running, self._polled = 0, 0.0
        self._deaths: dict = {}

    def submit(self, params):
        key = f"{self.prefix}-{os.urandom(6).hex()}"
        return self.client.submit(run_task, self.fn, params, self.threads, key=key, pure=False)

    def window(self) -> int:
        return 100_000   # the scheduler queues and balances; adaptive clusters scale on queued work

    def wait(self, futures, timeout):
        try:
            done = self.distributed.wait(futures, timeout=timeout, return_when="FIRST_COMPLETED").done
        except TimeoutError:
            return []
        if done:
            # Dask reruns the task of a worker that died by itself; the scheduler counts those deaths
            # per task ("suspicious"). Read them while the futures still hold their tasks.
            try:
                self._deaths.update(self.client.run_on_scheduler(_worker_deaths, keys=[f.key for f in done]))
            except Exception as exc:  # an old scheduler or a lost connection: attempts stay a lower bound
                log.debug("could not read worker deaths from the scheduler: %s", exc)
        return done

    def outcome(self, fut) -> dict:
        deaths = int(self._deaths.pop(fut.key, 0) or 0)
        try:
            out = fut.result()
        except Exception as exc:  # KilledWorker after allowed-failures worker deaths, a lost scheduler, ...
            out = {"status": "failed", "error": _error_dict(exc)}
        if deaths:
            out = {**out, "worker_deaths": deaths}
        return out

    def running(self, inflight: int) -> int:
        now = time.monotonic()
        if now - self._polled > 1.0:   # one scheduler round trip per second at most
            self._polled = now
            try:
                self._running = sum(len(v) for v in self.client.processing().values())
            except Exception:
                self._running = inflight
        return min(self._running, inflight)

    def close(self, cancel: bool) -> None:
        if self._own_client:
            self.client.close()
            if cancel and self._cluster is not None:
                # an interrupted sweep: its tasks may still run on the shared cluster's workers, so that cluster
                # goes with it (the next sweep starts a fresh one); the process's other clusters stay
                close_local_clusters(self._cluster)


#: the local Dask clusters of backend="dask" without a scheduler, by number of workers: one per process, shared
#: by its sweeps (a report's grids are a dozen sweeps; a cluster each cost seconds of start-up and shut-down and
#: printed the nannies' warnings every time), closed when the process exits (:func:`close_local_clusters`)
_LOCAL_CLUSTERS: dict[int, tuple] = {}
_CLUSTERS_LOCK = threading.Lock()


def shared_local_cluster(n_workers: int) -> tuple[tuple, bool]:
    """((cluster, security), started): this process's :func:`local_cluster` of ``n_workers`` workers, started on
    the first call (``started`` True) and reused while it runs. Its workers keep what tasks loaded (a model, a
    cache) from one sweep to the next, as long as the process runs. Thread-safe: two sweeps that start together
    get one cluster."""
    with _CLUSTERS_LOCK:
        found = _LOCAL_CLUSTERS.get(n_workers)
        if found is not None and str(getattr(found[0], "status", "")).endswith("running"):
            return found, False
        if not _LOCAL_CLUSTERS:
            import atexit

            atexit.unregister(close_local_clusters)
            atexit.register(close_local_clusters)
        _LOCAL_CLUSTERS[n_workers] = local_cluster(n_workers)
        return _LOCAL_CLUSTERS[n_workers], True


def close_local_clusters(cluster=None) -> None:
    """Close the local Dask clusters this process's sweeps started (at exit, or to free their workers sooner); only
    ``cluster`` when it is given."""
    with _CLUSTERS_LOCK:
        chosen = [k for k, (c, _) in _LOCAL_CLUSTERS.items() if cluster is None or c is cluster]
        closing = [_LOCAL_CLUSTERS.pop(k)[0] for k in chosen]
    for c in closing:
        try:
            c.close()
        except Exception as exc:  # noqa: BLE001 - a cluster already gone at exit
            log.debug("closing a local Dask cluster: %s", exc)


def local_cluster(n_workers: int):
    """(cluster, security): the ``LocalCluster`` of ``backend="dask"`` without a scheduler, binding as little
    as its worker processes allow.

    * Every listener is on 127.0.0.1 (the scheduler, one nanny and one worker per process: worker processes
      reach the scheduler over TCP, so an in-process ``inproc://`` transport cannot serve them).
    * With ``cryptography`` installed (the ``distributed`` extra), every connection is mutual TLS with
      credentials made for this cluster and kept in memory (``Security.temporary()``): a local client
      without them (another user, another process of yours) cannot connect, so it can neither submit code
      nor read results. Without ``cryptography`` a warning says that the cluster is open to local users.
    * No HTTP server answers: ``dashboard_address=None`` alone does not turn it off (the scheduler always
      starts one, on 8787 by default, with the health, metrics, info and API routes); its routes are
      emptied and the scheduler's server is stopped once the cluster is up. The workers' own HTTP servers
      stay, on random ports of 127.0.0.1, without any route (every request gets 404).
    """
    import dask
    import distributed

    try:
        from distributed.security import Security

        security = Security.temporary()
    except ImportError:
        security = None
        log.warning("cryptography is not installed: the local Dask cluster runs without TLS, and any local user "
                    "can connect to its scheduler and run code as you (pip install cryptography)")
    no_routes = {"distributed.scheduler.http.routes": [], "distributed.worker.http.routes": []}
    with dask.config.set(no_routes):   # read when the scheduler and the nannies are created, just below
        cluster = distributed.LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1", security=security,
            dashboard_address=None, scheduler_kwargs={"dashboard": False, "dashboard_address": "127.0.0.1:0"},
            # each nanny's own configuration, which it gives every worker it starts: a copy, since the nanny's
            # (merged one level deep) shares the nested dicts that leaving this block restores, and a worker
            # started again after its process died then served /health and the other default routes
            config=copy.deepcopy(dask.config.config))
    try:
        cluster.sync(_stop_http, cluster.scheduler)
    except Exception as exc:  # noqa: BLE001 - an internal of distributed: without it the server has no route
        log.debug("could not stop the local scheduler's HTTP server (it serves no route): %s", exc)
    return cluster, security


async def _stop_http(scheduler) -> None:
    scheduler.http_server.stop()


def _address(client) -> str:
    try:
        return str(client.scheduler.address)
    except Exception:  # noqa: BLE001 - only for a log line
        return "?"


def _worker_deaths(dask_scheduler, keys) -> dict:
    """Run on the scheduler: how many workers died while running each task (TaskState.suspicious)."""
    out = {}
    for k in keys:
        ts = dask_scheduler.tasks.get(k)
        if ts is not None:
            out[k] = int(getattr(ts, "suspicious", 0))
    return out


def make_backend(backend: str, fn, n_workers: int, scheduler, name: str):
    if backend == "inprocess":
        return _InProcess(fn)
    if backend == "processes":
        return _Pool(fn, n_workers)
    return _Dask(fn, n_workers, scheduler, name)

