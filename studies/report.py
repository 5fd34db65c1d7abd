"""The one-command reproduction report: run the registered studies, write one folder per run.

    runs/<name>/
        config.json     every parameter: seed, quick, studies, versions, python, torch, device
        summary.json    per study: status, seconds, claims, figures, tables, its own summary
        report.md       every figure and one table: study, claim, theory, measured, agrees
        <study>/        the study's CSV tables and PNG figures

A study that raises is reported as failed (with its error and traceback) and the others still
run; :func:`reproduce` returns the summary and ``summary["ok"]`` says whether everything ran and
every claim agreed.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from .core import Claim, StudyResult, code_fingerprint, grid_level, import_errors, registry, sweep_settings, write_json

__all__ = ["reproduce", "run_study", "write_report", "environment", "default_run_dir"]

_PACKAGES = ["smooth-attention", "torch", "numpy", "scipy", "pot", "matplotlib", "transformers", "dask",
             "distributed", "torchdiffeq", "tqdm", "pandas"]


def environment() -> dict:
    """Versions of Python, the packages the studies use, and the compute device."""
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
        "device": "cuda" if torch.cuda.is_available() else "cpu",
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


def run_study(name: str, out_dir: Path, *, quick: bool, seed: int) -> dict:
    """Run one registered study into ``out_dir/name``; never raises for the study's own errors."""
    studies = registry()
    if name not in studies:
        raise ValueError(f"name: no study called {name!r}; registered: {', '.join(studies)}")
    study = studies[name]
    sdir = Path(out_dir) / name
    sdir.mkdir(parents=True, exist_ok=True)
    _seed_everything(seed)
    t0 = time.perf_counter()
    entry = {"name": name, "title": study.title}
    try:
        res = study.fn(sdir, quick=quick, seed=seed)
        if not isinstance(res, StudyResult):
            raise TypeError(f"study {name!r} returned {type(res).__name__}, expected StudyResult")
        entry.update(res.to_dict())
        entry["status"] = "ok"
    except Exception as exc:  # a failing study is reported, the run goes on
        entry.update({"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(), "claims": [], "figures": [], "tables": []})
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    write_json(entry, sdir / "result.json")
    return entry


def reproduce(out_dir: Path | str | None = None, *, quick: bool = False, seed: int = 0,
              only: list[str] | None = None, progress: bool = True, argv: list[str] | None = None) -> dict:
    """Run the studies (all, or ``only``) and write config.json, summary.json and report.md."""
    out = Path(out_dir) if out_dir is not None else default_run_dir()
    out.mkdir(parents=True, exist_ok=True)
    studies = registry()
    names = list(studies)
    if only:
        unknown = [n for n in only if n not in studies]
        if unknown:
            raise ValueError(f"only: unknown study name(s) {unknown}; registered: {', '.join(studies)}")
        names = [n for n in names if n in only]
    config = {
        "seed": seed, "quick": quick, "grid": grid_level(quick), "studies": names,
        "out_dir": str(out), "command": argv if argv is not None else sys.argv,
        "sweep": sweep_settings(), "started": _dt.datetime.now().isoformat(timespec="seconds"),
        **environment(),
    }
    write_json(config, out / "config.json")

    entries = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(names), desc="studies", unit="study", file=sys.stderr)
    for name in names:
        if bar is not None:
            bar.set_postfix_str(name)
        entry = run_study(name, out, quick=quick, seed=seed)
        entries.append(entry)
        if bar is not None:
            bar.update(1)
            if entry["status"] != "ok":
                bar.write(f"study {name} failed: {entry['error']}")
    if bar is not None:
        bar.close()
    if not only:
        for mod, err in import_errors().items():
            entries.append({"name": mod.rsplit(".", 1)[-1], "title": mod, "status": "failed", "seconds": 0.0,
                            "error": f"module {mod} failed to import: {err}", "traceback": err,
                            "claims": [], "figures": [], "tables": []})
    summary = _summarize(entries, config)
    write_json(summary, out / "summary.json")
    write_report(out, summary, config)
    return summary


def _summarize(entries: list[dict], config: dict) -> dict:
    failed = [e["name"] for e in entries if e["status"] != "ok"]
    disagree = [(e["name"], c["claim"]) for e in entries for c in e.get("claims", []) if not c["agrees"]]
    return {
        "ok": not failed and not disagree,
        "failed": failed,
        "disagreeing_claims": disagree,
        "n_claims": sum(len(e.get("claims", [])) for e in entries),
        "seed": config["seed"], "quick": config["quick"],
        "studies": {e["name"]: e for e in entries},
    }


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


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
    lines += [f"**{n_ok} of {len(summary['studies'])} studies ran; "
              f"{summary['n_claims'] - len(summary['disagreeing_claims'])} of {summary['n_claims']} claims agree.**",
              ""]
    if summary["failed"]:
        lines += [f"Failed studies: {', '.join(summary['failed'])} (errors below).", ""]
    lines += ["## Claims", "", "| study | claim | theory | measured | agrees |", "|---|---|---|---|---|"]
    for name, e in summary["studies"].items():
        if e["status"] != "ok":
            lines.append(f"| {name} | study failed | | {_cell(e['error'])} | **failed** |")
            continue
        for c in e.get("claims", []):
            mark = "yes" if c["agrees"] else "**no**"
            lines.append(f"| {name} | {_cell(c['claim'])} | {_cell(c['theory'])} | {_cell(c['measured'])} | {mark} |")
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
            if c.get("detail"):
                lines.append(f"- *{_cell(c['claim'])}*: {c['detail']}")
        if any(c.get("detail") for c in e.get("claims", [])):
            lines.append("")
        for fig in e.get("figures", []):
            if (out / name / fig).exists():
                lines += [f"![{name}: {fig}]({name}/{fig})", ""]
        tables = [t for t in e.get("tables", []) if (out / name / t).exists()]
        if tables:
            lines += ["Data: " + ", ".join(f"[{t}]({name}/{t})" for t in tables), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def claims_table(claims: list[Claim]) -> str:
    """A markdown table of claims (for notebooks and the README)."""
    rows = ["| claim | theory | measured | agrees |", "|---|---|---|---|"]
    rows += [f"| {_cell(c.claim)} | {_cell(c.theory)} | {_cell(c.measured)} | {'yes' if c.agrees else 'no'} |"
             for c in claims]
    return "\n".join(rows)
