"""Sweeps: run a grid of independent tasks in-process, on a process pool or on a Dask cluster.

One entry point::

    from studies.sweep import run_sweep
    res = run_sweep(fn, {"n": [8, 16, 32], "seed": [0, 1]}, "runs/sqrt_n")
    res.rows          # one dict per task, params merged with fn's results, in grid order
    res.to_csv("table.csv")

``fn(**params) -> dict`` is a picklable top-level function. Every finished task is stored at once
as a checksummed record, written atomically and keyed by the task's parameters and the sweep name
(:mod:`studies.sweep.store`), so a sweep killed at any moment (SIGKILL, a lost node, Ctrl-C)
resumes where it stopped: ``resume=True`` (the default) skips what is done, redoes what is missing
or corrupt, and the table is the same as an uninterrupted run's. A task that raises is retried
``retries`` times, then reported with its error (type, message, traceback) in
:attr:`SweepResult.failures <studies.sweep.SweepResult.failures>` and on disk, without stopping the others.

Backends: ``"inprocess"`` (default), ``"processes"`` (a local pool of ``n_workers`` processes
started with forkserver/spawn, one torch thread each) and ``"dask"``: a ``dask.distributed``
cluster given by ``scheduler`` (an address ``"tcp://host:8786"``, a ``distributed.Client``, or a
cluster object such as dask-jobqueue's ``SLURMCluster``), or with no scheduler a
``LocalCluster(n_workers, threads_per_worker=1, processes=True)`` started for the sweep.
Giving ``scheduler`` implies ``backend="dask"``. See docs/sweeps.md.

This subpackage stands alone: it imports nothing from the rest of :mod:`studies`.
"""

from __future__ import annotations

import collections
import difflib
import inspect
import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .backends import make_backend
from .files import atomic_write, normalize, write_csv
from .progress import Progress
from .store import SweepStore, task_key

__all__ = ["run_sweep", "load_sweep", "expand_grid", "check_options", "SweepResult", "TaskFailure", "BACKENDS"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "inprocess", "processes", "dask")


# ---------------------------------------------------------------------- results
@dataclass
class TaskFailure:
    """A task that raised on every attempt (or whose worker died every time)."""

    key: str
    params: dict
    attempts: int
    error_type: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"{self.params}: {self.error_type}: {self.message} (after {self.attempts} attempt(s))"


@dataclass
class SweepResult:
    """The outcome of a sweep, read back from its verified records.

    ``rows``: params merged with results, one per finished task, in grid order (independent of
    completion order). ``failures``: tasks that failed after their retries. ``missing``: params of
    tasks with no valid record (not run yet, or a corrupt record found by :func:`load_sweep`).
    Counters describe the call that produced the result: ``n_resumed`` tasks were already done,
    ``n_run`` attempts were executed now (retries included), ``n_corrupt`` records failed
    verification (and were redone by :func:`run_sweep`). ``grid_known`` is False where :func:`load_sweep` found
    sweep.json damaged and rebuilt the grid from the records: tasks that never finished are then unknown, and
    the sweep is not ``ok`` (run :func:`run_sweep` with the grid to know and finish it).
    """

    name: str
    out_dir: Path
    grid: list[dict]
    rows: list[dict]
    failures: list[TaskFailure] = field(default_factory=list)
    missing: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list, repr=False)   # full records (timings, host, attempts)
    n_resumed: int = 0
    n_run: int = 0
    n_corrupt: int = 0
    backend: str = ""
    elapsed_s: float = 0.0
    grid_known: bool = True

    @property
    def ok(self) -> bool:
        """Whether every task of the grid finished; False where the grid itself is unknown (``grid_known``)."""
        return self.grid_known and not self.failures and not self.missing

    def raise_for_failures(self) -> SweepResult:
        """Raise a RuntimeError listing failed and missing tasks; return self when all finished."""
        if self.ok:
            return self
        lines = [str(f) for f in self.failures[:10]] + [f"{p}: not run" for p in self.missing[:10]]
        unknown = ("" if self.grid_known else
                   f" (the grid is unknown: sweep.json was damaged and rebuilt from the {len(self.grid)} tasks that "
                   "left a record; tasks that never finished are not listed: run run_sweep with the grid)")
        raise RuntimeError(f"sweep {self.name!r}: {len(self.failures)} failed and {len(self.missing)} missing "
                           f"of {len(self.grid)} tasks{unknown}:\n  " + "\n  ".join(lines))

    def to_csv(self, path=None) -> Path:
        """Write ``rows`` as CSV (default ``out_dir/results.csv``), atomically."""
        path = Path(path) if path is not None else self.out_dir / "results.csv"
        return write_csv(self.rows, path)

    def to_pandas(self):
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("to_pandas needs pandas (pip install 'smooth-attention[distributed]'); "
                              "to_csv needs nothing") from None

        return pd.DataFrame(self.rows)

    def to_parquet(self, path=None) -> Path:
        """Write ``rows`` as Parquet (default ``out_dir/results.parquet``); needs pyarrow."""
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ImportError("to_parquet needs pyarrow (pip install pyarrow); to_csv needs nothing") from None
        path = Path(path) if path is not None else self.out_dir / "results.parquet"
        self.to_pandas().to_parquet(path, index=False)
        return path

    def __repr__(self) -> str:
        return (f"SweepResult(name={self.name!r}, tasks={len(self.grid)}, done={len(self.rows)}, "
                f"failed={len(self.failures)}, missing={len(self.missing)}, out_dir={str(self.out_dir)!r})")


# ---------------------------------------------------------------------- grid
def expand_grid(grid) -> list[dict]:
    """The list of parameter dicts of a grid, normalized to plain JSON values.

    A dict of lists is the Cartesian product in nested-loop order: the first key varies slowest,
    the last fastest (``{"a": [1, 2], "b": [3, 4]}`` -> a1b3, a1b4, a2b3, a2b4). A list of dicts
    is kept as given. Tuples become lists and numpy/torch scalars Python numbers, because each
    task's parameters are what a JSON record round-trips; fn receives exactly those values.
    """
    if isinstance(grid, Mapping):
        keys = list(grid)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"grid: parameter names must be strings, got {k!r}")
            if isinstance(grid[k], (str, bytes)) or not isinstance(grid[k], Sequence):
                raise TypeError(f"grid[{k!r}]: expected a list of values, got {type(grid[k]).__name__}")
        tasks = [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]
    elif isinstance(grid, Sequence) and not isinstance(grid, (str, bytes)):
        tasks = list(grid)
        for i, p in enumerate(tasks):
            if not isinstance(p, Mapping):
                raise TypeError(f"grid[{i}]: expected a dict of parameters, got {type(p).__name__}")
    else:
        raise TypeError(f"grid: expected a list of parameter dicts or a dict of lists, got {type(grid).__name__}")
    tasks = [normalize(p, f"grid[{i}]") for i, p in enumerate(tasks)]
    seen: dict[str, int] = {}
    for i, p in enumerate(tasks):
        k = task_key("", p)
        if k in seen:
            raise ValueError(f"grid[{i}]: same parameters as grid[{seen[k]}] ({p}); every task must be distinct")
        seen[k] = i
    return tasks


# ---------------------------------------------------------------------- the runner
def _validate(fn, backend, n_workers, retries, scheduler):
    if not callable(fn):
        raise TypeError(f"fn: expected a callable fn(**params) -> dict, got {type(fn).__name__}")
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "dask" if scheduler is not None else "inprocess"
    if scheduler is not None and backend != "dask":
        raise ValueError(f"scheduler: given with backend={backend!r}; a scheduler means backend='dask'")
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
        raise ValueError(f"n_workers: expected an integer >= 1, got {n_workers!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries: expected an integer >= 0, got {retries!r}")
    return backend


def _signature(fn):
    """``inspect.signature(fn)``, or None where none can be read (some builtins and C extensions)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _check_params(fn, tasks: list[dict], from_mapping: bool = False) -> None:
    """Each task's parameter names fit ``fn``'s signature (``fn(**params)`` would not raise a TypeError for
    them): a typo in a grid is refused at once instead of failing every task ``1 + retries`` times. Checked
    once per distinct set of names; skipped when ``fn`` has no readable signature. ``functools.partial``
    objects are read through (their bound keywords may be given again), ``**kwargs`` accepts any name."""
    sig = _signature(fn)
    if sig is None:
        return
    seen = set()
    for i, params in enumerate(tasks):
        names = tuple(params)
        if names in seen:
            continue
        seen.add(names)
        try:
            sig.bind(**params)
        except TypeError as exc:
            raise TypeError(f"{'grid' if from_mapping else f'grid[{i}]'}: parameters do not fit fn "
                            f"{_fn_name(fn)}{sig}: {_mismatch(sig, params) or exc}") from None


def _fn_name(fn) -> str:
    inner = getattr(fn, "func", None)   # functools.partial
    return getattr(fn, "__qualname__", None) or (f"partial({getattr(inner, '__qualname__', '?')})" if inner
                                                 else type(fn).__name__)


def _mismatch(sig: inspect.Signature, params: Mapping) -> str:
    """The names of ``params`` that ``sig`` does not take, and the arguments it needs that they lack."""
    P = inspect.Parameter
    by_keyword = [p.name for p in sig.parameters.values() if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    any_keyword = any(p.kind is P.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [] if any_keyword else [k for k in params if k not in by_keyword]
    missing = [p.name for p in sig.parameters.values() if p.default is P.empty and p.name not in params
               and p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    positional = [p.name for p in sig.parameters.values() if p.kind is P.POSITIONAL_ONLY]
    parts = []
    for k in unknown:
        if k in positional:
            parts.append(f"{k!r} is positional-only (fn(**params) cannot pass it)")
            continue
        close = difflib.get_close_matches(k, [n for n in by_keyword if n not in params], n=1)
        parts.append(f"no argument {k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if missing:
        parts.append(f"missing {', '.join(map(repr, missing))}")
    return "; ".join(parts)


def check_options(backend, n_workers, retries, scheduler) -> str:
    """The backend a sweep with these options runs on ("inprocess", "processes" or "dask"), after checking
    them as :func:`run_sweep` does (a ValueError naming the option otherwise)."""
    return _validate(lambda: None, backend, n_workers, retries, scheduler)


def run_sweep(fn: Callable[..., Mapping], grid, out_dir, *, backend: str = "auto", n_workers: int = 2,
              scheduler=None, resume: bool = True, retries: int = 2, progress: bool = True,
              name: str | None = None, label: str | None = None, overwrite: bool = False) -> SweepResult:
    """Run ``fn(**params)`` for every task of ``grid``; store each result as it finishes.

    ``grid``: a list of parameter dicts, or a dict of lists expanded as a product (first key
    slowest, see :func:`expand_grid`). ``out_dir``: the sweep's folder (one sweep per folder).
    ``backend``: ``"auto"`` (in-process, or Dask when ``scheduler`` is given), ``"inprocess"``,
    ``"processes"`` (``n_workers`` local processes), ``"dask"`` (``scheduler``, or a
    ``LocalCluster`` of ``n_workers``). ``resume``: skip tasks with a valid record; ``False``
    deletes the folder's records first. ``retries``: extra attempts for a failing task (a task
    whose worker dies counts an attempt too, also when Dask reruns it by itself). ``name``: part
    of every task key (default ``module.qualname`` of fn); renaming a sweep therefore starts it
    afresh. ``progress``: a bar on a terminal, plain periodic lines otherwise
    (:class:`~studies.sweep.progress.Progress`), named ``label`` (default ``name``).
    ``overwrite``: a folder that holds another sweep is emptied (under the lock) instead of refused.

    Returns a :class:`SweepResult`; also writes ``results.csv`` and ``failures.json``. Failures do
    not raise: check ``result.ok`` or call ``result.raise_for_failures()``.
    """
    from particles.validation import check_bool

    backend = _validate(fn, backend, n_workers, retries, scheduler)
    resume, progress, overwrite = (check_bool(v, k) for k, v in
                                   (("resume", resume), ("progress", progress), ("overwrite", overwrite)))
    if name is None:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty string, got {name!r}")
    if label is not None and not isinstance(label, str):
        raise TypeError(f"label: expected a string, got {type(label).__name__}")
    tasks = expand_grid(grid)
    if not tasks:
        empty = [k for k, v in grid.items() if not len(v)] if isinstance(grid, Mapping) else []
        raise ValueError("grid: no task to run (" + (f"no values for {', '.join(map(repr, empty))}" if empty else
                                                     "an empty list of parameter dicts") + ")")
    _check_params(fn, tasks, isinstance(grid, Mapping))
    keys = [task_key(name, p) for p in tasks]
    store = SweepStore(out_dir)
    t_start = time.perf_counter()
    try:
        store.lock()
    except OSError as exc:   # a read-only file system, a folder without write permission, a path through a file
        raise OSError(exc.errno, f"out_dir: cannot write the sweep's folder {store.root}: "
                                 f"{exc.strerror or exc}") from exc
    try:
        manifest = store.read_manifest()
        if manifest is not None and manifest.get("name") != name:
            if not overwrite:
                raise ValueError(f"name: {store.root} holds sweep {manifest.get('name')!r}, not {name!r}; "
                                 "use another out_dir (or the same name)")
            log.info("%s held sweep %r: emptied for %r", store.root, manifest.get("name"), name)
            store.reset()
        store.write_manifest(name, tasks)
        store.remove_temporaries()
        if not resume:
            store.clear()
        found, bad = store.load(name, tasks, move_corrupt=True)
        if bad:
            log.warning("sweep %s: %d stored record(s) failed verification (a write cut short, or changed on "
                        "disk); moved to %s, their tasks run again", name, len(bad), store.corrupt)
        done = {k for k, r in found.items() if r["status"] == "ok"}
        todo = [i for i, k in enumerate(keys) if k not in done]
        # the backend first: one that refuses the function (not picklable, no __main__ guard) does so before any
        # progress line is printed
        runner = make_backend(backend, fn, n_workers, scheduler, name) if todo else None
        bar = Progress(len(tasks), label or name, unit="task", initial=len(done), enabled=bool(progress) and bool(todo))
        finished = False
        try:
            n_run = _execute(runner, tasks, keys, todo, store, name, retries, bar)
            finished = True
        finally:
            failed = bar.postfix.get("failed", 0)
            bar.close(interrupted=not finished,
                      note=f"results in {store.root}" + (f" (failures.json: {failed} failed)" if failed else ""))
        result = _collect(store, name, tasks)
        result.n_resumed, result.n_run, result.n_corrupt = len(done), n_run, len(bad)
        result.backend, result.elapsed_s = backend, time.perf_counter() - t_start
        result.to_csv()
        failures = normalize([f.__dict__ for f in result.failures], "failures")
        atomic_write(store.root / "failures.json", json.dumps(failures, indent=1) + "\n")
        return result
    finally:
        store.unlock()


def _execute(runner, tasks, keys, todo, store, name, retries, bar: Progress) -> int:
    if not todo:
        return 0
    pending = collections.deque(todo)
    # tasks in flight when a pool worker died: a broken pool fails them all, and only one may have killed it.
    # They are not charged an attempt for it; they run again one at a time, alone in the pool, where a death is
    # the task's own (charged, and retried as any failure)
    suspects: collections.deque = collections.deque()
    attempts = dict.fromkeys(todo, 0)
    free = dict.fromkeys(todo, 0)      # runs ended by a pool death in company: not counted against retries
    inflight: dict = {}
    alone: set = set()
    n_failed = n_run = 0
    finished = False
    try:
        while pending or suspects or inflight:
            if suspects:
                if not inflight:
                    i = suspects.popleft()
                    attempts[i] += 1
                    fut = runner.submit(tasks[i])
                    inflight[fut] = i
                    alone.add(fut)
            else:
                while pending and len(inflight) < runner.window():
                    i = pending.popleft()
                    attempts[i] += 1
                    if runner.name == "inprocess":
                        # the task runs inside submit: the status the ticker shows meanwhile says one runs
                        bar.set_postfix(done=bar.n, running=1, failed=n_failed)
                    inflight[runner.submit(tasks[i])] = i
            for fut in runner.wait(list(inflight), timeout=0.5):
                i = inflight.pop(fut)
                out = runner.outcome(fut)
                n_run += 1
                attempts[i] += out.get("worker_deaths", 0)   # runs Dask restarted after a worker died
                died = out["status"] != "ok" and out.get("error", {}).get("type") == "WorkerDied"
                if died and fut not in alone:
                    free[i] += 1
                    suspects.append(i)
                    continue
                alone.discard(fut)
                if out["status"] != "ok" and attempts[i] - free[i] <= retries:
                    if died:
                        suspects.append(i)   # its own death: retried alone again
                        continue
                    pending.append(i)   # to the back: a transient failure gets time to clear
                    continue
                payload = {"key": keys[i], "name": name, "params": tasks[i], "attempts": attempts[i],
                           "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **out}
                store.write(keys[i], payload)
                if out["status"] == "ok":
                    # the status with the count it prints (a line printed here showed the previous done=)
                    bar.update(1, done=bar.n + 1, running=runner.running(len(inflight)), failed=n_failed)
                    log.debug("%s: %s done in %.2f s (pid %s)", name, tasks[i], out.get("elapsed_s", float("nan")),
                              out.get("pid"))
                else:
                    n_failed += 1
                    log.debug("%s: task %s failed after %d attempt(s): %s", name, tasks[i], attempts[i],
                              out.get("error", {}).get("message"))
            bar.set_postfix(done=bar.n, running=runner.running(len(inflight)), failed=n_failed)
        finished = True
    finally:
        if not finished:
            for fut in inflight:
                fut.cancel()
        runner.close(cancel=not finished)
    return n_run


def _collect(store: SweepStore, name: str, tasks: list[dict], *, grid_known: bool = True,
             corrupt: int = 0) -> SweepResult:
    found, bad = store.load(name, tasks)
    rows, failures, missing, records = [], [], [], []
    for p in tasks:
        rec = found.get(task_key(name, p))
        if rec is None:
            missing.append(p)
            continue
        records.append(rec)
        if rec["status"] == "ok":
            rows.append({**p, **rec["result"]})
        else:
            err = rec.get("error") or {}
            failures.append(TaskFailure(rec["key"], p, rec.get("attempts", 0), err.get("type", "?"),
                                        err.get("message", ""), err.get("traceback", "")))
    return SweepResult(name, store.root, tasks, rows, failures, missing, records, n_corrupt=len(bad) + corrupt,
                       grid_known=grid_known)


def load_sweep(out_dir) -> SweepResult:
    """Read a sweep folder as it is on disk (finished, interrupted or running): verified records only.

    Rows come in the grid order of the manifest; tasks without a valid record (never run, or a
    corrupt record, counted in ``n_corrupt``) are listed in ``missing``. Nothing is written. A
    manifest that does not parse is rebuilt from the records (rows then in the order the tasks
    finished; see :meth:`SweepStore.rebuild_manifest`): the result then says ``grid_known=False`` and is not
    ``ok``, and its ``n_corrupt`` counts the records that failed verification.
    """
    store = SweepStore(out_dir)
    manifest = store.read_manifest()
    if manifest is None:
        raise ValueError(f"out_dir: {store.root} has no sweep.json and no record; not a sweep folder")
    rebuilt = bool(manifest.get("rebuilt"))
    return _collect(store, manifest["name"], manifest["grid"], grid_known=not rebuilt,
                    corrupt=int(manifest.get("corrupt", 0)) if rebuilt else 0)
