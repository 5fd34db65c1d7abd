"""The one-command reproduction report: run the registered studies, write one folder per run.

    runs/<name>/
        config.json     every parameter: the run context, each study's grid, versions, device
        summary.json    per study: status, seconds, claims (kind, verdict), figures, tables, its own summary
        report.md       the claims table (study, claim, kind, theory, measured, verdict), then every figure
        <study>/        the study's CSV tables, PNG figures and result.json

The run folder is locked for the whole run (a second run on it is refused with
:class:`studies.sweep.FolderBusy`), and every file is written atomically. ``summary.json`` and
``report.md`` are rewritten as each study finishes, so a run that is killed or hangs in one study
leaves the others aggregated. A study that raises is reported as failed (with its error and
traceback) and the others still run; a full disk or a read-only folder stops the run with
:class:`studies.io.OutputError`. :func:`reproduce` returns the summary; ``summary["ok"]`` says
whether every study ran and every theorem claim holds (empirical claims that are not reproduced
are findings, not failures).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import logging
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from .context import RunContext
from .contract import EMPIRICAL, THEOREM, StudyResult, import_errors, registry
from .grid import code_fingerprint
from .io import OutputError, is_output_error, output_error, probe_output, write_json, write_text
from .preflight import check_run
from .sweep.files import FolderLock
from .sweep.progress import format_seconds

__all__ = ["reproduce", "run_study", "write_report", "environment", "default_run_dir", "summarize"]

log = logging.getLogger(__name__)

_PACKAGES = ["smooth-attention", "torch", "numpy", "scipy", "pot", "matplotlib", "transformers", "dask",
             "distributed", "torchdiffeq", "tqdm", "pandas"]
_VERDICTS = ("holds", "violated", "reproduced", "not reproduced", "inconclusive")


def environment() -> dict:
    """Versions of Python, the packages the studies use, and the compute devices present."""
    versions = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = _md.version(pkg)
        except _md.PackageNotFoundError:
            versions[pkg] = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "packages": versions,
        "code_fingerprint": code_fingerprint(),
    }


def default_run_dir(root: Path | str = "runs") -> Path:
    return Path(root) / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def run_study(name: str, ctx: RunContext) -> dict:
    """Run one registered study into ``ctx.out/name``; never raises for the study's own errors.

    A failure to write the run's files (:func:`studies.io.is_output_error`) is not the study's: it
    is raised as :class:`studies.io.OutputError`.
    """
    studies = registry()
    if name not in studies:
        raise ValueError(f"name: no study called {name!r}; registered: {', '.join(studies)}")
    study = studies[name]
    sdir = ctx.out / name
    probe_output(sdir)
    _seed_everything(ctx.seed)
    t0 = time.perf_counter()
    entry = {"name": name, "title": study.title}
    try:
        res = study.run(sdir, ctx)
        if not isinstance(res, StudyResult):
            raise TypeError(f"study {name!r} returned {type(res).__name__}, expected StudyResult")
        entry.update(res.to_dict())
        entry["status"] = "ok"
    except Exception as exc:  # a failing study is reported, the run goes on
        if is_output_error(exc):
            raise output_error(exc, sdir) from exc
        entry.update({"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(), "claims": [], "figures": [], "tables": []})
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    write_json(entry, sdir / "result.json")
    return entry


def reproduce(ctx: RunContext, *, only: list[str] | None = None) -> dict:
    """Run the studies (all, or ``only``) with the run context ``ctx``; write config.json, then
    summary.json and report.md after each study. Returns the final summary (:func:`summarize`).

    Before the first study, :func:`studies.preflight.check_run` checks every option, file and service the
    run names (a :class:`studies.preflight.UsageError` at the first problem), then the output folder is
    probed (:class:`studies.io.OutputError` when it cannot be written)."""
    if not isinstance(ctx, RunContext):
        raise TypeError(f"ctx: expected a studies.context.RunContext, got {type(ctx).__name__}")
    studies = registry()
    names = list(studies)
    if only:
        unknown = [n for n in only if n not in studies]
        if unknown:
            raise ValueError(f"only: unknown study name(s) {unknown}; registered: {', '.join(studies)}")
        names = [n for n in names if n in only]
    check_run(ctx, names)   # every option, file and service the run names, before the first study
    out = probe_output(ctx.out)
    lock = FolderLock(out, what="meanfield run", argument="out").acquire()
    try:
        config = {**ctx.to_config(), "studies": names,
                  "grids": {n: studies[n].grid(ctx.level) for n in names if studies[n].grid is not None},
                  "started": _dt.datetime.now().isoformat(timespec="seconds"), **environment()}
        write_json(config, out / "config.json")
        broken = [] if only else [
            {"name": mod.rsplit(".", 1)[-1], "title": mod, "status": "failed", "seconds": 0.0,
             "error": f"module {mod} failed to import: {err}", "traceback": err, "claims": [], "figures": [],
             "tables": []} for mod, err in import_errors().items()]
        entries: list[dict] = []
        for k, name in enumerate(names, 1):
            _write_aggregate(out, entries + broken, config, names[k - 1:], running=name)
            log.info("[%d/%d] %s: %s", k, len(names), name, studies[name].title)
            try:
                entry = run_study(name, ctx)
            except BaseException as exc:
                if not isinstance(exc, OutputError):   # interrupted: what finished stays aggregated
                    _write_aggregate(out, entries + broken, config, names[k - 1:], running=None)
                raise
            entries.append(entry)
            log.info("[%d/%d] %s: %s", k, len(names), name, _entry_line(entry))
        summary = _write_aggregate(out, entries + broken, config, [], running=None)
        return summary
    finally:
        lock.release()


def _entry_line(entry: dict) -> str:
    if entry["status"] != "ok":
        return f"FAILED after {format_seconds(entry['seconds'])}: {entry['error']}"
    counts = _counts(entry.get("claims", []))
    said = ", ".join(f"{v} {'hold' if k == 'holds' and v != 1 else k}" for k, v in counts.items() if v)
    return f"done in {format_seconds(entry['seconds'])}; claims: {said or 'none'}"


def _counts(claims) -> dict:
    counts = dict.fromkeys(_VERDICTS, 0)
    for c in claims:
        counts[c["verdict"]] += 1
    return counts


def _write_aggregate(out: Path, entries: list[dict], config: dict, pending: list[str], running) -> dict:
    summary = summarize(entries, config, pending=pending, running=running)
    write_json(summary, out / "summary.json")
    write_report(out, summary, config)
    return summary


def summarize(entries: list[dict], config: dict, *, pending=(), running=None) -> dict:
    """The run's summary from the study entries: failed studies, claims by verdict, overall status.

    ``ok``: every study ran (none pending) and no theorem claim is violated. ``not_reproduced`` and
    ``inconclusive`` list empirical claims: findings, they do not change ``ok``.
    """
    pairs = [(e["name"], c) for e in entries for c in e.get("claims", [])]
    failed = [e["name"] for e in entries if e["status"] != "ok"]
    by = {v: [[n, c["claim"]] for n, c in pairs if c["verdict"] == v] for v in _VERDICTS}
    return {
        "ok": not failed and not by["violated"] and not pending,
        "complete": not pending,
        "failed": failed,
        "running": running,
        "pending": [p for p in pending if p != running],
        "violated_claims": by["violated"],
        "not_reproduced": by["not reproduced"],
        "inconclusive": by["inconclusive"],
        "n_claims": len(pairs),
        "verdicts": {v: len(by[v]) for v in _VERDICTS},
        "kinds": {k: sum(1 for _, c in pairs if c["kind"] == k) for k in (THEOREM, EMPIRICAL)},
        "seed": config["seed"], "quick": config["quick"], "grid": config["grid"],
        "studies": {e["name"]: e for e in entries},
    }


def summary_line(summary: dict) -> str:
    """One line: theorem claims that hold, empirical verdicts, failed studies."""
    v = summary["verdicts"]
    return (f"theorem claims: {v['holds']} hold, {v['violated']} violated; empirical claims: {v['reproduced']} "
            f"reproduced, {v['not reproduced']} not reproduced, {v['inconclusive']} inconclusive; "
            f"failed studies: {', '.join(summary['failed']) or 'none'}")


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _verdict_cell(c: dict) -> str:
    return f"**{c['verdict']}**" if c["verdict"] in ("violated", "not reproduced") else c["verdict"]


def write_report(out: Path, summary: dict, config: dict) -> Path:
    """report.md: the claims table first, then each study with its figures, tables and notes."""
    out = Path(out)
    lines = ["# How smooth is attention? Reproduction report", ""]
    pk = config.get("packages", {})
    lines += [f"Seed {config['seed']}, grids: {config['grid']}, Python {config['python']}, torch {config['torch']} "
              f"({config['device']}), smooth-attention {pk.get('smooth-attention')}. "
              "Every parameter is in `config.json`; every number in the CSV files next to the figures.", ""]
    cmd = config.get("command")
    if isinstance(cmd, (list, tuple)) and cmd:
        words = [str(w) for w in cmd]
        if words[0].endswith("meanfield"):  # the console script's full path is machine-specific
            words[0] = "meanfield"
        lines += [f"Command: `{' '.join(words)}`", ""]
    n_ok = sum(1 for e in summary["studies"].values() if e["status"] == "ok")
    total = len(summary["studies"]) + len(summary["pending"]) + (1 if summary["running"] else 0)
    lines += [f"**{n_ok} of {total} studies ran; {summary_line(summary)}.**", ""]
    if summary["running"] or summary["pending"]:
        lines += [f"Not finished yet: {', '.join(filter(None, [summary['running'], *summary['pending']]))} "
                  "(this report is rewritten as each study finishes).", ""]
    if summary["failed"]:
        lines += [f"Failed studies: {', '.join(summary['failed'])} (errors below).", ""]
    lines += ["Theorem claims are mathematical statements: a violation is a bug (exit code 1). Empirical claims "
              "are observations the paper reports: *not reproduced* is a finding, not a failure of the run.", ""]
    lines += ["## Claims", "", "| study | claim | kind | theory | measured | verdict |", "|---|---|---|---|---|---|"]
    for name, e in summary["studies"].items():
        if e["status"] != "ok":
            lines.append(f"| {name} | study failed | | | {_cell(e['error'])} | **failed** |")
            continue
        for c in e.get("claims", []):
            lines.append(f"| {name} | {_cell(c['claim'])} | {c['kind']} | {_cell(c['theory'])} | "
                         f"{_cell(c['measured'])} | {_verdict_cell(c)} |")
    lines.append("")
    for name, e in summary["studies"].items():
        lines += [f"## {e.get('title') or name} (`{name}`)", ""]
        lines.append(f"Status: {e['status']}, {e['seconds']} s.")
        lines.append("")
        if e["status"] != "ok":
            lines += ["```", e.get("traceback", e.get("error", "")).rstrip(), "```", ""]
            continue
        if e.get("notes"):
            lines += [e["notes"].strip(), ""]
        for c in e.get("claims", []):
            detail = f" {c['detail']}." if c.get("detail") else ""
            lines.append(f"- *{_cell(c['claim'])}* ({c['kind']}, {c['verdict']}).{detail} Fails if {c['fails_if']}.")
        if e.get("claims"):
            lines.append("")
        for fig in e.get("figures", []):
            if (out / name / fig).exists():
                lines += [f"![{name}: {fig}]({name}/{fig})", ""]
        tables = [t for t in e.get("tables", []) if (out / name / t).exists()]
        if tables:
            lines += ["Data: " + ", ".join(f"[{t}]({name}/{t})" for t in tables), ""]
    return write_text("\n".join(lines).rstrip() + "\n", out / "report.md")
