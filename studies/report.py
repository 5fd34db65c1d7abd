"""The one-command reproduction report: run the registered studies, write one folder per run::

    runs/<name>/
        config.json     every parameter: the run context, each study's grid, versions, device
        summary.json    per study: status, seconds, claims (kind, verdict), figures, tables, its own summary
        report.md       a summary (counts; each claim not reproduced, inconclusive or violated in one line,
                        with the next step), the claims table (short forms), then each study's section:
                        every claim in full (theory, measured, detail, what would make it fail), figures
        <study>/        the study's CSV tables, PNG figures and result.json

The run folder is locked for the whole run (a second run on it is refused with
:class:`studies.sweep.FolderBusy`), and every file is written atomically. ``summary.json`` and
``report.md`` are rewritten as each study finishes, so a run that is killed or hangs in one study
leaves the others aggregated. A study that raises is reported as failed (with its error and
traceback) and the others still run; a full disk or a read-only folder stops the run with
:class:`studies.io.OutputError`. An interrupted run (Ctrl-C, or SIGTERM through the command line)
writes when and during which study it stopped, and the command that resumes it (the study's folder says
that its files are partial: ``result.json`` with status "interrupted", and ``INTERRUPTED.txt``); running the same
command again into the same folder reuses every study that finished there with the same code and
settings (:func:`study_fingerprint`) and resumes the stored grid points of the others
(``--no-resume`` recomputes everything). Study folders that an earlier run left in the folder and that
are not part of this run (another ``--only``) are kept and listed as such (:func:`not_in_run`), never
mixed into the report. :func:`reproduce` returns the summary; ``summary["ok"]`` says
whether every study ran and every theorem claim holds (empirical claims that are not reproduced
are findings, not failures).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata as _md
import json
import logging
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from . import costs
from .context import RunContext
from .contract import EMPIRICAL, THEOREM, StudyResult, import_errors, registry, shorten
from .grid import code_fingerprint
from .io import OutputError, is_output_error, output_error, probe_output, write_json, write_text
from .preflight import check_run
from .sweep.files import FolderLock
from .sweep.progress import format_seconds

__all__ = ["reproduce", "run_study", "write_report", "environment", "default_run_dir", "summarize", "summary_line",
           "study_fingerprint", "resume_command", "attention_lines", "claims_table", "readme_excerpt", "not_in_run",
           "not_in_run_line"]

log = logging.getLogger(__name__)

_PACKAGES = ["smooth-attention", "torch", "numpy", "scipy", "pot", "matplotlib", "transformers", "dask",
             "distributed", "torchdiffeq", "tqdm", "pandas"]
_VERDICTS = ("holds", "violated", "reproduced", "not reproduced", "inconclusive")


def _versions(packages) -> dict:
    """Installed version of each package (None where it is not installed)."""
    versions = {}
    for pkg in packages:
        if pkg == "smooth-attention":  # this tree's version, also when it runs uninstalled (PYTHONPATH)
            from particles._version import distribution_version

            versions[pkg] = distribution_version()
            continue
        try:
            versions[pkg] = _md.version(pkg)
        except _md.PackageNotFoundError:
            versions[pkg] = None
    return versions


def environment() -> dict:
    """Versions of Python, the packages the studies use, and the compute devices present."""
    versions = _versions(_PACKAGES)
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


# packages whose version can change a study's numbers (a study reused from an earlier run must match them)
_NUMERIC_PACKAGES = ("torch", "numpy", "scipy", "pot", "transformers")


def study_fingerprint(name: str, ctx: RunContext) -> str:
    """Short hash of everything a study's results depend on: the framework's code
    (:func:`studies.grid.code_fingerprint`), the study's grid at the run's level, the seed, the device,
    the run inputs the study reads (models, checkpoints, the text file's bytes: ``register(reads=...)``) and the
    versions of the numeric packages. A study that finished in the run folder with the same fingerprint is reused
    on resume."""
    study = registry()[name]
    text = None
    if ctx.text is not None and "text" in study.reads:
        try:
            text = hashlib.sha256(Path(ctx.text).read_bytes()).hexdigest()
        except OSError:
            text = str(ctx.text)
    versions = _versions(_NUMERIC_PACKAGES)
    key = {"code": code_fingerprint(), "study": name, "level": ctx.level, "seed": ctx.seed, "device": ctx.device,
           "grid": study.grid(ctx.level) if study.grid is not None else None,
           "models": list(ctx.models) if "models" in study.reads else None,
           "checkpoints": list(ctx.checkpoints) if "checkpoints" in study.reads else None, "text": text,
           "versions": versions}
    blob = json.dumps(key, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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
    entry = {"name": name, "title": study.title, "fingerprint": study_fingerprint(name, ctx),
             "finished": None}
    # until the study returns, its folder says that it is running (a run killed here leaves that), and the marker
    # of an earlier interrupted run goes: the files written from now on are this run's
    (sdir / INTERRUPTED_MARKER).unlink(missing_ok=True)
    write_json({**entry, "status": "running", "started": _now()}, sdir / "result.json")
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
    except BaseException as exc:   # Ctrl-C, SIGTERM: the tables written so far must not pass for the study's
        _mark_interrupted(sdir, entry, exc, time.perf_counter() - t0)
        raise
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    entry["finished"] = _now()
    write_json(entry, sdir / "result.json")
    return entry


#: the file an interrupted study leaves in its folder, next to the tables and figures it had written
INTERRUPTED_MARKER = "INTERRUPTED.txt"


def _signal_name(exc: BaseException) -> str:
    return getattr(exc, "signal_name", None) or ("SIGINT" if isinstance(exc, KeyboardInterrupt)
                                                 else type(exc).__name__)


def _mark_interrupted(sdir: Path, entry: dict, exc: BaseException, seconds: float) -> None:
    """Say in the study's folder that it stopped before it finished: ``result.json`` with status "interrupted"
    (never reused: only status "ok" is) and :data:`INTERRUPTED_MARKER`, for a person listing the folder. A study
    that finishes later in this folder removes the marker. Best effort: a folder that cannot be written does not
    hide the interruption behind an OutputError."""
    at, sig = _now(), _signal_name(exc)
    note = (f"This study was interrupted ({sig}) at {at}, {format_seconds(seconds)} after it started, "
            "before it finished. The tables and figures in this folder are partial, or left by an earlier run: "
            "do not read them as the study's results. Resuming the run (the command in the run's report.md) "
            "runs the study again here.")
    try:
        write_json({**entry, "status": "interrupted", "interrupted": at, "signal": sig,
                    "seconds": round(seconds, 2), "note": note, "claims": [], "figures": [], "tables": []},
                   sdir / "result.json")
        write_text(note + "\n", sdir / INTERRUPTED_MARKER)
    except Exception as err:   # noqa: BLE001 - the interruption is what the caller must see
        log.warning("could not mark %s as interrupted: %s", sdir, err)


def _now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def _reusable(ctx: RunContext, name: str) -> dict | None:
    """The entry of ``name`` from an earlier run in the same folder, when it finished (status ok) with the
    same :func:`study_fingerprint` and every figure and table it lists is still there; else None."""
    path = ctx.out / name / "result.json"
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("status") != "ok" or entry.get("name") != name:
        return None
    if entry.get("fingerprint") != study_fingerprint(name, ctx):
        return None
    if not all((ctx.out / name / f).is_file() for f in [*entry.get("figures", []), *entry.get("tables", [])]):
        return None
    return {**entry, "reused": True}


def reproduce(ctx: RunContext, *, only: list[str] | None = None, scheduler_option: str = "--scheduler") -> dict:
    """Run the studies (all, or ``only``) with the run context ``ctx``; write config.json, then
    summary.json and report.md after each study. Returns the final summary (:func:`summarize`).

    Before the first study, :func:`studies.preflight.check_run` checks every option, file and service the
    run names (a :class:`studies.preflight.UsageError` at the first problem), then the output folder is
    probed (:class:`studies.io.OutputError` when it cannot be written). ``scheduler_option``: how the
    scheduler address in ``ctx.sweep`` was given, named by the checks' messages (the command line passes
    ``$DASK_SCHEDULER_ADDRESS`` when it came from there).

    With ``ctx.sweep["resume"]`` (the default), a study that already finished in ``ctx.out`` with the
    same code and settings (:func:`study_fingerprint`) is reused instead of run again. A
    ``KeyboardInterrupt`` (Ctrl-C) is re-raised after summary.json and report.md say when and
    during which study the run stopped, and how to resume it (:func:`resume_command`)."""
    if not isinstance(ctx, RunContext):
        raise TypeError(f"ctx: expected a studies.context.RunContext, got {type(ctx).__name__}")
    studies = registry()
    names = list(studies)
    if only:
        unknown = [n for n in only if n not in studies]
        if unknown:
            raise ValueError(f"only: unknown study name(s) {unknown}; registered: {', '.join(studies)}")
        names = [n for n in names if n in only]
    # every option, file and service the run names, before the first study
    check_run(ctx, names, scheduler_option=scheduler_option)
    resume = bool(ctx.sweep.get("resume", True))
    out = probe_output(ctx.out)
    lock = FolderLock(out, what="meanfield run", argument="out").acquire()
    try:
        config = {**ctx.to_config(), "studies": names,
                  "grids": {n: studies[n].grid(ctx.level) for n in names if studies[n].grid is not None},
                  "started": _now(), **environment()}
        write_json(config, out / "config.json")
        broken = [] if only else [
            {"name": mod.rsplit(".", 1)[-1], "title": mod, "status": "failed", "seconds": 0.0,
             "error": f"module {mod} failed to import: {err}", "traceback": err, "claims": [], "figures": [],
             "tables": []} for mod, err in import_errors().items()]
        # study folders an earlier run into the same folder left, which this run neither includes nor changes
        others = not_in_run(ctx, [*names, *(b["name"] for b in broken)])
        entries: list[dict] = []
        for k, name in enumerate(names, 1):
            _write_aggregate(out, entries + broken, config, names[k - 1:], running=name, others=others)
            entry = _reusable(ctx, name) if resume else None
            if entry is not None:
                entries.append(entry)
                log.info("[%d/%d] %s: reused (finished here at %s with the same code and settings; --no-resume "
                         "runs it again); %s", k, len(names), name, entry.get("finished") or "an earlier run",
                         _entry_line(entry))
                continue
            log.info("[%d/%d] %s: %s", k, len(names), name, studies[name].title)
            try:
                entry = run_study(name, ctx)
            except BaseException as exc:
                if not isinstance(exc, OutputError):   # interrupted: what finished stays aggregated
                    stop = {"at": _now(), "during": name, "done": k - 1, "of": len(names),
                            "signal": _signal_name(exc), "resume": resume_command(config)}
                    _write_aggregate(out, entries + broken, config, names[k - 1:], running=None, interrupted=stop,
                                     others=others)
                    exc.run_stop = stop   # what the command line prints: this run's stop, not a file's
                raise
            entries.append(entry)
            log.info("[%d/%d] %s: %s", k, len(names), name, _entry_line(entry))
        summary = _write_aggregate(out, entries + broken, config, [], running=None, others=others)
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


def _write_aggregate(out: Path, entries: list[dict], config: dict, pending: list[str], running,
                     interrupted: dict | None = None, others=()) -> dict:
    summary = summarize(entries, config, pending=pending, running=running, interrupted=interrupted,
                        not_in_run=others)
    write_json(summary, out / "summary.json")
    write_report(out, summary, config)
    return summary


def not_in_run(ctx: RunContext, names) -> list[dict]:
    """The study folders in ``ctx.out`` that are not part of a run of the studies ``names``: left there by an
    earlier run into the same folder (other ``--only``, or a study since renamed). The run neither includes
    nor changes them, and deletes nothing: the report lists them, so that they are not mistaken for this
    run's results. A study folder is a subfolder named after a registered study, or holding a result.json.

    One dict per folder, sorted by name: ``name``; ``status`` (``ok``, ``failed`` or ``interrupted`` from its
    result.json, None when it has none or says "running": a run stopped during it, killed); ``finished`` (when it
    finished or was interrupted, or None); ``same_settings`` (whether
    it finished with this run's code and settings, :func:`study_fingerprint`, so that adding it to the run
    would reuse it; None for a folder that is not a registered study's)."""
    studies = registry()
    try:
        folders = sorted(p for p in ctx.out.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    except OSError:
        return []
    found = []
    for folder in folders:
        name, result = folder.name, folder / "result.json"
        if name in names or (name not in studies and not result.is_file()):
            continue
        try:
            old = json.loads(result.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = None
        old = old if isinstance(old, dict) else {}
        status = old.get("status") if old.get("status") in ("ok", "failed", "interrupted") else None
        same = None
        if name in studies:
            same = status == "ok" and old.get("fingerprint") == study_fingerprint(name, ctx)
        found.append({"name": name, "status": status,
                      "finished": old.get("interrupted" if status == "interrupted" else "finished") if status else None,
                      "same_settings": same})
    return found


def summarize(entries: list[dict], config: dict, *, pending=(), running=None, interrupted=None,
              not_in_run=()) -> dict:
    """The run's summary from the study entries: failed studies, claims by verdict, overall status.

    ``ok``: every study ran (none pending) and no theorem claim is violated. ``not_reproduced`` and
    ``inconclusive`` list empirical claims: findings, they do not change ``ok``. ``interrupted``
    (None when the run was not): when (``at``), during which study, how many studies were done of how
    many, the signal, and the command that resumes the run (``resume``). ``not_in_run``: the study folders
    of the run folder that are not part of the run (:func:`not_in_run`), listed as such by the report.
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
        "interrupted": interrupted,
        "reused": [e["name"] for e in entries if e.get("reused")],
        "violated_claims": by["violated"],
        "not_reproduced": by["not reproduced"],
        "inconclusive": by["inconclusive"],
        "n_claims": len(pairs),
        "verdicts": {v: len(by[v]) for v in _VERDICTS},
        "kinds": {k: sum(1 for _, c in pairs if c["kind"] == k) for k in (THEOREM, EMPIRICAL)},
        "seed": config["seed"], "quick": config["quick"], "grid": config["grid"],
        "studies": {e["name"]: e for e in entries},
        "not_in_run": [dict(e) for e in not_in_run],
    }


def summary_line(summary: dict) -> str:
    """One line: theorem claims that hold, empirical verdicts, failed studies."""
    v = summary["verdicts"]
    return (f"theorem claims: {v['holds']} hold, {v['violated']} violated; empirical claims: {v['reproduced']} "
            f"reproduced, {v['not reproduced']} not reproduced, {v['inconclusive']} inconclusive; "
            f"failed studies: {', '.join(summary['failed']) or 'none'}")


# ---------------------------------------------------------------------------- commands for the reader
def _command_words(config: dict) -> list[str]:
    cmd = config.get("command")
    words = [str(w) for w in cmd] if isinstance(cmd, (list, tuple)) else []
    if words and (words[0].endswith(("meanfield", "cli.py")) or Path(words[0]).parts[-2:] == ("studies",
                                                                                             "__main__.py")):
        words[0] = "meanfield"  # the console script's full path is machine-specific (python -m studies too)
    sweep = config.get("sweep") or {}
    if sweep.get("backend") == "inprocess" or (sweep.get("backend") == "auto" and sweep.get("scheduler") is None):
        # the tasks ran in this process: --workers was not used, and a command that kept it printed a note on
        # every rerun (studies.sweep.options)
        words = _drop_option(words, "--workers")
    return words


def _drop_option(words: list[str], option: str, nargs: str = "1") -> list[str]:
    """``words`` without ``option`` and its value(s) (``nargs``: "0", "1" or "+"), in both the
    ``--opt value`` and the ``--opt=value`` spellings."""
    out, skip, many = [], 0, False
    for w in words:
        if many:
            if w.startswith("-"):
                many = False
            else:
                continue
        if skip:
            skip -= 1
            continue
        if w == option:
            if nargs == "1":
                skip = 1
            elif nargs == "+":
                many = True
            continue
        if w.startswith(option + "="):
            continue
        out.append(w)
    return out


def resume_command(config: dict) -> str:
    """The command that resumes the run of ``config``: the same command into the same folder (an
    explicit ``--out``), with resuming on (``--no-resume`` dropped)."""
    words = _command_words(config)
    if len(words) < 2 or words[0] != "meanfield":
        only = config.get("studies") or []
        words = ["meanfield", "reproduce", *(["--quick"] if config.get("grid") == "quick" else []),
                 *(["--only", *only] if only else [])]
        if config.get("seed"):
            words += ["--seed", str(config["seed"])]
    words = _drop_option(_drop_option(words, "--out"), "--no-resume", "0")
    return shlex.join([*words, "--out", str(config.get("out_dir", "."))])


def study_command(config: dict, name: str, level: str = "full") -> str:
    """The command that runs study ``name`` alone at ``level`` with the run's other options, into
    ``runs/<name>-<level>``."""
    words = _command_words(config)
    rest = words[2:] if len(words) >= 2 and words[0] == "meanfield" else []
    for opt, nargs in (("--quick", "0"), ("--tiny", "0"), ("--only", "+"), ("--out", "1"), ("-q", "0"),
                       ("--quiet", "0"), ("-v", "0"), ("--verbose", "0")):
        rest = _drop_option(rest, opt, nargs)
    if not rest and config.get("seed"):
        rest = ["--seed", str(config["seed"])]
    flag = {"quick": ["--quick"], "full": []}.get(level, [])
    return shlex.join(["meanfield", name, *flag, *rest, "--out", f"runs/{name}-{level}"])


def _measured_cost(name: str, level: str = "full") -> str:
    entry = costs.load().get("levels", {}).get(level, {}).get("studies", {}).get(name)
    if not entry or "wall_s" not in entry:
        return "time not measured"
    return f"{costs.minutes(entry['wall_s'])} measured, studies/data/costs.json"


def _next_step(name: str, verdict: str, config: dict, code=lambda s: s, index: int | None = None) -> str:
    """What a reader does about claim ``index`` of study ``name`` with ``verdict`` (not reproduced,
    inconclusive, violated); at the quick level, what the recorded full-grid run found for it
    (:func:`studies.costs.recorded_verdict`) decides whether running the full grid can change anything."""
    if verdict == "violated":
        return (f"a bug in the code, in the paper or in a derivation of docs/math.md: read the `{name}` section "
                "below and report it with config.json and the study's folder")
    full = config.get("grid") == "full"
    if full:
        if verdict == "inconclusive":
            return f"the full grid cannot decide: the `{name}` section below says what evidence is missing"
        return f"a finding on the full grid: the `{name}` section below and docs/studies/{name}.md discuss it"
    command = f"{code(study_command(config, name))} ({_measured_cost(name)})"
    known = None if index is None else costs.recorded_verdict(name, index)
    if known is not None and known[0] == "not reproduced":
        return (f"a finding: the full grid did not reproduce it either (recorded {known[1]}, studies/data/"
                f"costs.json); the `{name}` section below and docs/studies/{name}.md discuss it; to re-check: "
                f"{command}")
    if known is not None:
        return f"the full grid found it {known[0]} (recorded {known[1]}); to check: {command}"
    if verdict == "inconclusive":
        return f"run the full grid, which has more samples: {command}"
    return f"check it on the full grid: {command}"


def attention_lines(summary: dict, config: dict, *, markdown: bool = True) -> list[str]:
    """One line per claim a reader must act on (violated, not reproduced, inconclusive) and per failed
    study: id, short claim, the short measurement as the reason, the next step."""
    code = (lambda s: f"`{s}`") if markdown else (lambda s: s)
    lines = []
    for verdict in ("violated", "not reproduced", "inconclusive"):
        for name, e in summary["studies"].items():
            for k, c in enumerate(e.get("claims", []), 1):
                if c["verdict"] != verdict:
                    continue
                head = f"**{verdict}**" if markdown else verdict.upper()
                lines.append(f"{head} {code(_claim_id(name, k))}: {_short(c)}. Measured: {_short_measured(c)}. "
                             f"Next: {_next_step(name, verdict, config, code, k)}.")
    for name in summary["failed"]:
        e = summary["studies"][name]
        head = "**study failed**" if markdown else "STUDY FAILED"
        lines.append(f"{head} {code(name)}: {shorten(e.get('error', ''), 120)}. Next: its traceback is in the "
                     f"`{name}` section below; the run's own command, with the same --out, runs it again and keeps "
                     f"the grid points that finished; or run it alone with "
                     f"{code(study_command(config, name, config['grid']))}.")
    return lines


def readme_excerpt(run_dir: Path | str) -> str:
    """The top of a finished run's report as the README shows it: the summary line, one line per claim
    to act on, the claims table (read from the run folder's summary.json and config.json)."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    # summary.json's keys are sorted: the run's order is config.json's list of studies
    order = [n for n in config.get("studies", []) if n in summary["studies"]]
    order += [n for n in summary["studies"] if n not in order]
    summary["studies"] = {n: summary["studies"][n] for n in order}
    n_ok = sum(1 for e in summary["studies"].values() if e["status"] == "ok")
    lines = [f"**{n_ok} of {len(summary['studies'])} studies ran; {summary_line(summary)}.**", ""]
    lines += [f"- {t}" for t in attention_lines(summary, config)] + [""]
    lines += ["Each id leads to the claim in full (theory, measurement, tolerance, what would make it fail) in its "
              "study's section of `report.md`.", "", claims_table(summary)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- report.md
def _claim_id(study: str, k: int) -> str:
    return f"{study}-{k}"


def _short(c: dict) -> str:
    return c.get("short") or shorten(c["claim"])


def _short_measured(c: dict) -> str:
    return c.get("short_measured") or shorten(c["measured"], first_clause=True)


def _verdict_cell(c: dict) -> str:
    return f"**{c['verdict']}**" if c["verdict"] in ("violated", "not reproduced") else c["verdict"]


def claims_table(summary: dict) -> str:
    """The claims table of report.md (and of the README): one row per claim with its id (its full
    statement is in the study's section under the same id), short claim, kind, verdict and short
    measurement. No cell needs a Markdown escape."""
    lines = ["| id | claim | kind | verdict | measured |", "|---|---|---|---|---|"]
    for name, e in summary["studies"].items():
        if e["status"] != "ok":
            lines.append(f"| {name} | study failed | | **failed** | {shorten(e.get('error', ''))} |")
            continue
        for k, c in enumerate(e.get("claims", []), 1):
            lines.append(f"| {_claim_id(name, k)} | {_short(c)} | {c['kind']} | {_verdict_cell(c)} | "
                         f"{_short_measured(c)} |")
    return "\n".join(lines)


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _summary_section(summary: dict, config: dict) -> list[str]:
    n_ok = sum(1 for e in summary["studies"].values() if e["status"] == "ok")
    total = len(summary["studies"]) + len(summary["pending"]) + (1 if summary["running"] else 0)
    lines = ["## Summary", ""]
    stop = summary.get("interrupted")
    if stop:
        lines += [f"**Interrupted** ({stop['signal']}) at {stop['at']} during `{stop['during']}`, after {stop['done']} "
                  f"of {stop['of']} studies. Resume with `{stop['resume']}`: it reuses the studies that finished here "
                  "(same code and settings) and the stored grid points of the interrupted one. The folder "
                  f"`{stop['during']}/` holds what that study had written when it stopped (partial; its "
                  f"{INTERRUPTED_MARKER} says so).", ""]
    elif summary["running"] or summary["pending"]:
        lines += [f"Not finished yet: {', '.join(filter(None, [summary['running'], *summary['pending']]))} "
                  "(this report is rewritten as each study finishes).", ""]
    reused = summary.get("reused") or []
    lines += [f"**{n_ok} of {total} studies ran; {summary_line(summary)}.**"
              + (f" Reused from an earlier run in this folder (same code and settings): {', '.join(reused)}."
                 if reused else ""), ""]
    todo = attention_lines(summary, config)
    if todo:
        lines += [f"- {t}" for t in todo] + [""]
    lines += _not_in_run_lines(summary)
    lines += ["Theorem claims are mathematical statements: a violation is a bug (exit code 1). Empirical claims "
              "are observations the paper reports: *not reproduced* is a finding, not a failure of the run.", ""]
    return lines


def _left_over(entry: dict) -> str:
    """What a study folder not part of the run holds, for the reader."""
    if entry.get("status") is None:
        return "an unfinished study (no finished result.json: a run stopped during it)"
    when = f" at {entry['finished']}" if entry.get("finished") else ""
    if entry["status"] == "interrupted":
        return f"a study interrupted{when} (its files are partial)"
    if entry.get("status") != "ok":
        return f"a study that failed{when}"
    if entry.get("same_settings") is None:
        return f"finished{when}; not a study of this version"
    if entry["same_settings"]:
        return f"finished{when} with this run's code and settings (adding it to `--only` reuses it)"
    return f"finished{when} with other code or settings (seed, grid, models, versions)"


def _not_in_run_lines(summary: dict) -> list[str]:
    others = summary.get("not_in_run") or []
    if not others:
        return []
    lines = ["**Not part of this report**: this folder also holds study folders left from an earlier run, which "
             "this run neither includes nor changes (nothing was deleted; their numbers are not in the counts, "
             "claims or sections of this report):", ""]
    lines += [f"- `{e['name']}/`: {_left_over(e)}." for e in others]
    return lines + [""]


def not_in_run_line(summary: dict, out) -> str | None:
    """One line for the terminal about the study folders of ``out`` that are not part of the run, or None."""
    others = summary.get("not_in_run") or []
    if not others:
        return None
    folders = ", ".join(f"{e['name']}/" for e in others)
    return (f"note: {out} also holds {folders} from an earlier run: not part of this report (kept; report.md "
            "lists them)")


def write_report(out: Path, summary: dict, config: dict) -> Path:
    """report.md: the summary (counts, then every claim to act on in one line with the next step), the
    claims table in short form, then each study with every claim in full, its figures and tables."""
    out = Path(out)
    lines = ["# How smooth is attention? Reproduction report", ""]
    pk = config.get("packages", {})
    lines += [f"Seed {config['seed']}, grids: {config['grid']}, Python {config['python']}, torch {config['torch']} "
              f"({config['device']}), smooth-attention {pk.get('smooth-attention')}. "
              "Every parameter is in `config.json`; the figures' data are in the CSV files next to them, and each "
              "study's summary numbers in its `result.json`.", ""]
    words = _command_words(config)
    if words:
        lines += [f"Command: `{shlex.join(words)}`", ""]
    lines += _summary_section(summary, config)
    lines += ["## Claims", "", "Each id leads to the claim in full (theory, measurement, tolerance, what would make "
              "it fail) in its study's section below.", "", claims_table(summary), ""]
    n_fig = 0
    for name, e in summary["studies"].items():
        lines += [f"## {e.get('title') or name} (`{name}`)", ""]
        when = f", reused from the run that finished it at {e.get('finished')}" if e.get("reused") else ""
        lines.append(f"Status: {e['status']}, {e['seconds']} s{when}.")
        lines.append("")
        if e["status"] != "ok":
            lines += ["```", e.get("traceback", e.get("error", "")).rstrip(), "```", ""]
            continue
        if e.get("notes"):
            lines += [e["notes"].strip(), ""]
        for k, c in enumerate(e.get("claims", []), 1):
            detail = _one_line(c.get("detail", "")).rstrip(".")
            detail = f" {detail[:1].upper()}{detail[1:]}." if detail else ""
            lines.append(f"- **{_claim_id(name, k)}** *{_one_line(c['claim'])}* ({c['kind']}, {c['verdict']}). "
                         f"Theory: {_one_line(c['theory'])}. Measured: {_one_line(c['measured'])}.{detail} "
                         f"Fails if {_one_line(c['fails_if']).rstrip('.')}.")
        if e.get("claims"):
            lines.append("")
        captions = e.get("captions") or {}
        for fig in e.get("figures", []):
            if (out / name / fig).exists():
                n_fig += 1
                caption = _one_line(captions.get(fig, "")).strip()
                lines += [f"![Figure {n_fig}: {name}/{fig}]({name}/{fig})", "",
                          f"*Figure {n_fig} (`{name}/{fig}`).*" + (f" {caption}" if caption else ""), ""]
        tables = [t for t in e.get("tables", []) if (out / name / t).exists()]
        if tables:
            lines += ["Data: " + ", ".join(f"[{t}]({name}/{t})" for t in tables), ""]
    return write_text("\n".join(lines).rstrip() + "\n", out / "report.md")
