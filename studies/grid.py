"""A study's grid through the sweep runner: resumable, parallel or on a cluster, never stale."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path

from .context import RunContext
from .sweep import run_sweep

__all__ = ["run_grid", "code_fingerprint"]

_PACKAGES = ("particles", "transport", "meanfield", "studies")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Short hash of the framework's source (every .py file of particles, transport, meanfield, studies).

    Sweep records are keyed by it, so re-running into an existing folder after the code changed
    recomputes every task instead of resuming from results of the old code.
    """
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for pkg in _PACKAGES:
        for f in sorted((root / pkg).rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
            h.update(f"{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def run_grid(fn: Callable[..., Mapping], grid: list[dict], out_dir: Path, name: str,
             ctx: RunContext | None = None, *, device: str | None = None) -> list[dict]:
    """Evaluate ``fn(**params)`` on every grid point; rows are params merged with results, in grid order.

    Runs through :func:`studies.sweep.run_sweep` with the run's sweep options (``ctx.sweep``:
    resumable, on a process pool or a Dask cluster), storing records under ``out_dir/_sweep_<name>``,
    keyed by the parameters, the code (:func:`code_fingerprint`) and the device, so that ``--resume``
    never reuses results of another version or device. ``device`` (when not None) is passed to
    every call as ``fn(**params, device=device)`` and stays out of the rows. ``fn`` must be a
    picklable top-level function. A failed grid point raises (with its error): a study's claims
    are never computed on a silently incomplete table.
    """
    grid = [dict(g) for g in grid]
    if not grid:
        return []   # a study's part with no point at this level or device: nothing to run (run_sweep refuses it)
    opts = {"backend": "inprocess", "resume": True, "retries": 0, "progress": False}
    if ctx is not None:
        opts.update(ctx.sweep)
        opts["progress"] = ctx.show_progress
    task = fn if device is None else functools.partial(fn, device=device)
    # records of another code version (or device) are never resumed: the sweep's name carries both, and
    # run_grid owns its _sweep_ folders, so one left by other code is emptied (under the sweep's lock)
    sweep_name = f"{name}@{code_fingerprint()}" + ("" if device in (None, "cpu") else f"@{device}")
    out_dir = Path(out_dir)
    res = run_sweep(task, grid, out_dir / f"_sweep_{name}", name=sweep_name, label=f"{out_dir.name}/{name}",
                    overwrite=True, **opts)
    if res.failures or res.missing:
        failed = [str(f) for f in res.failures] + [f"{p}: not run" for p in res.missing]
        shown = "\n  ".join(failed[:5]) + (f"\n  ... and {len(failed) - 5} more" if len(failed) > 5 else "")
        # the task's own traceback (the one raised here is only run_grid's): that of the first failure
        tb = res.failures[0].traceback.rstrip() if res.failures and res.failures[0].traceback else ""
        raise RuntimeError(
            f"{name}: {len(failed)} of {len(grid)} grid points failed:\n  {shown}\n"
            + (f"The first failure's own traceback:\n{tb}\n" if tb else "")
            + f"Every failure with its traceback: {res.out_dir / 'failures.json'}. The {len(res.rows)} points that "
              "finished are stored: the same command with the same --out resumes from them.")
    return [dict(r) for r in res.rows]
