"""Measured time and peak memory of each study: one source for ``meanfield --help`` and the README.

The figures live in ``studies/data/costs.json``, written by ``benchmarks/bench_memory.py --write``
(each study alone in a fresh process: wall time, CPU time and peak resident memory, with the
command, the date, the machine and its load average). Nothing here estimates: a study that was not
measured at a level is shown as "not measured". ``tests/test_readme.py`` checks that the README's
table is :func:`markdown_table` of this file, so the two cannot drift apart.
"""

from __future__ import annotations

import json
from pathlib import Path

from particles.files import atomic_write

PATH = Path(__file__).resolve().parent / "data" / "costs.json"
LEVELS = ("quick", "full")

__all__ = ["PATH", "LEVELS", "load", "markdown_table", "help_text", "record", "minutes", "recorded_verdict"]


def load(path: Path | str = PATH) -> dict:
    """The measurements: ``{"machine": str, "levels": {level: {"commands", "date", "studies":
    {name: {"wall_s", "cpu_s", "peak_gib", "status", "load", "verdicts", "date"}}}}}`` (``load``: the
    1-minute load average before the measuring run; ``verdicts``: each claim's verdict in that run, in the
    study's order, and the run's ``date``); an empty skeleton when the file is missing."""
    p = Path(path)
    if not p.is_file():
        return {"machine": "", "levels": {}}
    return json.loads(p.read_text(encoding="utf-8"))


def minutes(seconds: float) -> str:
    """A duration as people say it: "40 s" below 90 s, else "6.9 min"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


#: the row of the whole report in one process (``bench_memory.py --whole``)
WHOLE = "(whole job)"


def _cell(entry: dict | None) -> str:
    if not entry:
        return "not measured"
    if entry.get("status", "ok") != "ok":
        status = str(entry["status"])
        return status if status.startswith("failed") else f"failed ({status})"
    return f"{minutes(entry['wall_s'])}, {entry['peak_gib']:.1f} GiB"


def _cells(data: dict, name: str) -> list[str]:
    """The study's cell at each level, in LEVELS order."""
    return [_cell(data["levels"].get(level, {}).get("studies", {}).get(name)) for level in LEVELS]


def _names(data: dict) -> list[str]:
    seen: list[str] = []
    for level in LEVELS:
        for name in data["levels"].get(level, {}).get("studies", {}):
            if name not in seen:
                seen.append(name)
    # the report's order (STUDY_MODULES), then any other study measured, then the whole job
    from .contract import STUDY_MODULES

    order = {m.rsplit(".", 1)[1]: i for i, m in enumerate(STUDY_MODULES)}
    studies = sorted((n for n in seen if n != WHOLE), key=lambda n: (order.get(n, len(order)), seen.index(n)))
    return studies + ([WHOLE] if WHOLE in seen else [])


def markdown_table(data: dict | None = None) -> str:
    """The README's table: wall time and peak resident memory per study, quick and full."""
    data = load() if data is None else data
    lines = ["| study | `--quick` | full grids |", "|---|---|---|"]
    for name in _names(data):
        cells = _cells(data, name)
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    notes = []
    for level in LEVELS:
        meta = data["levels"].get(level)
        if meta:
            loads = sorted({e["load"] for e in meta["studies"].values() if "load" in e})
            avg = loads[0] if len(loads) == 1 else f"{loads[0]} to {loads[-1]}" if loads else "unknown"
            commands = " and ".join(f"`{c}`" for c in meta["commands"])
            notes.append(f"{level}: {commands}, {_dates(meta)}, load average {avg}")
    if data.get("machine"):
        notes.insert(0, f"machine: {data['machine']}")
    return "\n".join(lines) + ("\n\n" + "; ".join(notes) + "." if notes else "")


def _dates(meta: dict) -> str:
    """When a level's rows were measured: one date, or the most common one and the others by study
    ("2026-11-27 but kernel_paths (2026-11-28)"); the run's own date where a row records none."""
    by: dict[str, list[str]] = {}
    for name, e in meta["studies"].items():
        if name != WHOLE:
            by.setdefault(e.get("date") or meta["date"], []).append(name)
    if len(by) <= 1:
        return next(iter(by), meta["date"])
    common = max(by, key=lambda d: len(by[d]))
    rest = [f"{', '.join(names)} ({d})" for d, names in sorted(by.items()) if d != common]
    return f"{common} but " + " and ".join(rest)


def help_text(data: dict | None = None) -> str:
    """Plain-text form of the table for ``--help`` (time, peak memory; measured, with the machine)."""
    data = load() if data is None else data
    names = _names(data)
    if not names:
        return ""
    width = max(len(n) for n in names) + 2
    rows = [f"  {'study':<{width}}{'--quick':<22}full grids"]
    for name in names:
        cells = _cells(data, name)
        rows.append(f"  {name:<{width}}{cells[0]:<22}{cells[1]}")
    where = f" on {data['machine']}" if data.get("machine") else ""
    return f"measured time and peak memory (each study alone{where}):\n" + "\n".join(rows)


def record(level: str, rows: list[dict], *, command: str, date: str, load_average: str, machine: str,
           path: Path | str = PATH) -> dict:
    """Store one measurement run (``rows`` as printed by benchmarks/bench_memory.py) at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    data = load(path)
    data["machine"] = machine
    studies = {}
    for r in rows:
        if "hwm_kib" not in r:
            studies[r["name"]] = {"status": r.get("status", "failed")}
            continue
        peak = max(r["hwm_kib"], r.get("children_maxrss_kib", 0)) / 2**20
        studies[r["name"]] = {"wall_s": round(r["wall"], 1), "cpu_s": round(r["cpu"], 1),
                              "peak_gib": round(peak, 2), "status": r["status"], "load": load_average}
        if r.get("verdicts") is not None:
            studies[r["name"]]["verdicts"] = list(r["verdicts"])
            studies[r["name"]]["date"] = date
    before = data["levels"].get(level, {})
    # a run that re-measures every study recorded before supersedes the commands of earlier runs
    earlier = [] if set(before.get("studies", {})) <= set(studies) else before.get("commands", [])
    commands = [c for c in earlier if c != command] + [command]
    data["levels"][level] = {"commands": commands, "date": date,
                             "studies": {**before.get("studies", {}), **studies}}
    atomic_write(Path(path), json.dumps(data, indent=1) + "\n")
    return data


def recorded_verdict(name: str, index: int, level: str = "full", path: Path | str = PATH) -> tuple[str, str] | None:
    """(verdict, date) of claim ``index`` (1-based) of study ``name`` in the measuring run recorded at
    ``level``, or None when that run recorded no verdicts (or fewer claims)."""
    entry = load(path).get("levels", {}).get(level, {}).get("studies", {}).get(name) or {}
    verdicts = entry.get("verdicts") or []
    if not 1 <= index <= len(verdicts):
        return None
    return verdicts[index - 1], entry.get("date", "date not recorded")
