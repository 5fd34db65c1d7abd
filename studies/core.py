"""The contract every study follows, and the small I/O helpers they share.

A study is a function ``fn(out_dir, *, quick, seed) -> StudyResult`` registered with
:func:`register`. It writes its tidy tables (CSV) and figures (PNG) into ``out_dir`` (its own
folder inside the run folder) and returns the claims it checked: one row per claim of the paper
with the theory, the measured value and whether they agree. The report (``studies.report``)
collects every registered study; the command line exposes each as a subcommand.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Claim", "StudyResult", "Study", "register", "registry", "write_csv", "read_csv",
           "write_json", "save_figure", "STUDY_MODULES"]

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


def registry() -> dict[str, Study]:
    """Every registered study, imported from STUDY_MODULES, in report order."""
    for mod in STUDY_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:  # a study module not written yet: skip it, loudly elsewhere
            if exc.name != mod:
                raise
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (kv[1].order, kv[0])))


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
