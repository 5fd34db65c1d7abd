"""The contract every study follows, and the small I/O helpers they share.

A study is a function ``fn(out_dir, *, quick, seed) -> StudyResult`` registered with
:func:`register`. It writes its tidy tables (CSV) and figures (PNG) into ``out_dir`` (its own
folder inside the run folder) and returns the claims it checked: one row per claim of the paper
with the theory, the measured value and whether they agree. The report (``studies.report``)
collects every registered study; the command line exposes each as a subcommand.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Claim", "StudyResult", "Study", "register", "registry", "write_csv", "read_csv",
           "write_json", "save_figure", "STUDY_MODULES", "import_errors", "grid_level", "run_grid", "sweep_settings"]

# Modules that define studies, in report order. Each registers its studies on import.
STUDY_MODULES = [
    "studies.sqrt_n",
    "studies.mean_field",
    "studies.large_radius",
    "studies.masked",
    "studies.mass_splitting",
    "studies.discrete_vs_meanfield",
    "studies.l2_attention",
    "studies.dynamics",
    "studies.real_models",
]


@dataclass
class Claim:
    """One row of the report's claims table."""

    claim: str            # what the paper states, in words ("Lip grows like sqrt(n)")
    theory: str           # the predicted value or inequality ("slope 0.5", "<= 3.2e4")
    measured: str         # what the run measured ("slope 0.49 [0.47, 0.51]")
    agrees: bool          # whether the measurement agrees with the claim, within stated tolerance
    detail: str = ""      # tolerance used, caveats


@dataclass
class StudyResult:
    name: str
    title: str
    claims: list[Claim] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)   # paths relative to the study folder
    tables: list[str] = field(default_factory=list)    # idem
    summary: dict = field(default_factory=dict)        # JSON-serializable numbers
    notes: str = ""                                     # markdown paragraph for the report

    def to_dict(self) -> dict:
        return _jsonable(asdict(self))


@dataclass
class Study:
    name: str
    title: str
    fn: Callable[..., StudyResult]
    order: int
    description: str


_REGISTRY: dict[str, Study] = {}


def register(name: str, title: str, order: int = 100) -> Callable:
    """Decorator registering ``fn(out_dir, *, quick, seed) -> StudyResult`` as study ``name``."""

    def deco(fn: Callable[..., StudyResult]) -> Callable[..., StudyResult]:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"name: a study called {name!r} is already registered")
        _REGISTRY[name] = Study(name, title, fn, order, (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return deco


_IMPORT_ERRORS: dict[str, str] = {}


def registry() -> dict[str, Study]:
    """Every registered study, imported from STUDY_MODULES, in report order.

    A study module that fails to import (or is missing) is recorded in :func:`import_errors`
    (the report lists it as failed) instead of taking every study down.
    """
    _IMPORT_ERRORS.clear()
    for mod in STUDY_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 - reported, never hidden
            _IMPORT_ERRORS[mod] = f"{type(exc).__name__}: {exc}"
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (kv[1].order, kv[0])))


def import_errors() -> dict[str, str]:
    """Study modules of STUDY_MODULES that failed to import: module -> error."""
    return dict(_IMPORT_ERRORS)


# ---------------------------------------------------------------------- I/O helpers
def _jsonable(obj):
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # JSON has no inf/nan; keep them readable instead of invalid
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "tolist"):
        return _jsonable(obj.tolist())
    return str(obj)


def write_json(obj, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(obj), indent=2, sort_keys=True) + "\n")
    return path


def write_csv(rows: Iterable[Mapping], path: Path) -> Path:
    """Write a tidy table (one dict per row; the union of keys as columns, first-seen order)."""
    rows = [dict(_jsonable(r)) for r in rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return path


def read_csv(path: Path) -> list[dict]:
    """Read a table written by :func:`write_csv`, converting numeric fields back to numbers."""
    def conv(v: str):
        for t in (int, float):
            try:
                return t(v)
            except ValueError:
                pass
        return {"True": True, "False": False, "": None}.get(v, v)

    with Path(path).open(newline="") as fh:
        return [{k: conv(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG and close it (figures are never left open)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- grids
# Test-size grids: the hidden ``--tiny`` flag of the command line (or MEANFIELD_TINY=1) asks every
# study for its smallest grid, so that tests run each study end to end in seconds.
TINY_ENV = "MEANFIELD_TINY"

# Options for studies.sweep.run_sweep set by the command line (--backend, --workers, ...);
# studies read them through run_grid, so their signature stays fn(out_dir, *, quick, seed).
_SWEEP_SETTINGS: dict = {}


def grid_level(quick: bool) -> str:
    """``"tiny"`` (tests), ``"quick"`` (reproduce --quick) or ``"full"``."""
    if os.environ.get(TINY_ENV, "").strip() not in ("", "0"):
        return "tiny"
    return "quick" if quick else "full"


def sweep_settings(**options) -> dict:
    """Set (with keywords) or read the run_sweep options used by :func:`run_grid`."""
    if options:
        _SWEEP_SETTINGS.clear()
        _SWEEP_SETTINGS.update({k: v for k, v in options.items() if v is not None})
    return dict(_SWEEP_SETTINGS)


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Short hash of the framework's source (particles, transport, meanfield, studies).

    Sweep records are keyed by it, so re-running into an existing folder after the code changed
    recomputes every task instead of resuming from results of the old code.
    """
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for pkg in ("particles", "transport", "meanfield", "studies"):
        for f in sorted((root / pkg).glob("*.py")):
            h.update(f"{pkg}/{f.name}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def run_grid(fn: Callable[..., Mapping], grid: list[dict], out_dir: Path, name: str) -> list[dict]:
    """Evaluate ``fn(**params)`` on every grid point; rows are params merged with results, grid order.

    Runs through the sweep runner (``studies.sweep.run_sweep``: resumable, parallel or on a Dask
    cluster with the command line's ``--backend``), storing records under ``out_dir/_sweep_<name>``,
    keyed by the parameters and :func:`code_fingerprint` (``--resume`` never reuses another version's results).
    ``fn`` must be a picklable top-level function. A failed grid point raises (with its error):
    a study's claims are never computed on a silently incomplete table.
    """
    from studies.sweep import run_sweep  # not at module level: studies.sweep imports this module
    from studies.sweep_store import SweepStore

    grid = [dict(g) for g in grid]
    opts = {"backend": "inprocess", "progress": False, "resume": True, "retries": 0}
    opts.update(_SWEEP_SETTINGS)
    # records of another code version are never resumed: the sweep's name carries the code fingerprint, and
    # this function owns its _sweep_ folders, so one left by other code is discarded rather than refused
    sweep_dir, sweep_name = Path(out_dir) / f"_sweep_{name}", f"{name}@{code_fingerprint()}"
    old = SweepStore(sweep_dir).read_manifest() if sweep_dir.exists() else None
    if old is not None and old.get("name") != sweep_name:
        shutil.rmtree(sweep_dir)
    res = run_sweep(fn, grid, sweep_dir, name=sweep_name, **opts)
    failures = list(getattr(res, "failures", []) or [])
    if failures:
        first = failures[0]
        raise RuntimeError(f"{name}: {len(failures)} of {len(grid)} grid points failed; first: {first}")
    return [dict(r) for r in res.rows]
