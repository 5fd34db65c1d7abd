"""What a study is: its grid, its run, the claims it checks, the figures and tables it writes.

A study is a module of :mod:`studies.experiments` that registers one function with
:func:`register`::

    def grid(level: str) -> dict: ...            # the sizes of the run for "tiny", "quick", "full"

    def task(n, R, seed, device=None) -> dict:    # one grid point, picklable (run by the sweep runner)
        ...

    @register("sqrt_n", "The sqrt(n) regime", grid=grid)
    def sqrt_n(out_dir: Path, ctx: RunContext) -> StudyResult:
        rows = run_grid(task, points, out_dir, "sqrt_n", ctx)  # tables (CSV) through the sweep runner
        ...                                                   # figures (PNG) into out_dir
        return StudyResult("sqrt_n", title, claims, figures, tables, summary, notes,
                           captions={"lipschitz_vs_n.png": "what it shows, how to read it"})

The run function gets its own folder inside the run folder and the run's
:class:`~studies.context.RunContext` (level, seed, device, ...); it reads nothing else (no
environment variables, no module state). It returns the :class:`Claim` objects it checked, and
the figures it wrote, each with a caption (what it shows, how to read it, which claims it bears on):
the report prints the caption under the figure, and a figure without one is a ValueError.

Claims come in two kinds (``kind``):

* ``"theorem"``: a mathematical statement (a theorem, a proposition, a lemma, an identity). A
  violation means the code or the paper is wrong; the run exits with code 1. Verdict ``holds`` or
  ``violated``.
* ``"empirical"``: an observation the paper reports about experiments (growth rates on real text,
  concentration of samples). Verdict ``reproduced``, ``not reproduced`` (a finding, reported as
  such; the run does not fail) or ``inconclusive`` (the evidence cannot decide; ``agrees=None``).

Every claim also says what would make it fail (``fails_if``), and carries a short form for the
report's claims table (``short``: the claim in a few words; ``short_measured``: the number that
decides it); the long texts go to the study's section below the table. A claim built without them
gets :func:`shorten` of its long texts.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .io import to_json

__all__ = ["Claim", "StudyResult", "Study", "register", "registry", "import_errors", "STUDY_MODULES",
           "THEOREM", "EMPIRICAL", "VERDICTS", "SHORT_MAX", "shorten"]

THEOREM, EMPIRICAL = "theorem", "empirical"
VERDICTS = {THEOREM: ("holds", "violated"), EMPIRICAL: ("reproduced", "not reproduced", "inconclusive")}

SHORT_MAX = 72   # characters of a short form: a claims-table cell that reads on one line
_REFERENCE = re.compile(r"\s+\((?:Sections?|docs/|Appendix|Lemma|Theorem|Proposition|stated|[A-Z][A-Za-z-]+ et al)"
                        r"(?:[^()]|\([^()]*\))*\)")


def shorten(text: str, limit: int = SHORT_MAX, *, first_clause: bool = False) -> str:
    """A table cell from a long text: references in parentheses dropped (``(Section 5.2)``,
    ``(docs/math.md section 4)``, ``(Geshkovski et al. 2023)``; never mathematics such as ``sqrt(n)``
    or ``(0, 0.5)``), optionally only the part before the first ``"; "``, cut at a word boundary with an
    ellipsis when still longer than ``limit``, with no ``|`` (a Markdown table would need it escaped)."""
    t = " ".join(str(text).split())
    if first_clause:
        t = t.split("; ")[0]
    t = _REFERENCE.sub("", t).strip() or t
    t = t.replace("||", "‖").replace("|", "/")
    if len(t) > limit:
        cut = t[:limit - 1].rsplit(" ", 1)[0].rstrip(",;:")
        t = cut + "…"
    return t


#: Modules that define studies, in report order, the one place that order is said (a study registered from
#: elsewhere, a user's, comes after them unless it gives ``order``). Each registers its study on import.
STUDY_MODULES = [
    "studies.experiments.sqrt_n",
    "studies.experiments.mean_field",
    "studies.experiments.large_radius",
    "studies.experiments.masked",
    "studies.experiments.mass_splitting",
    "studies.experiments.discrete_vs_meanfield",
    "studies.experiments.kernel_paths",
    "studies.experiments.l2_attention",
    "studies.experiments.dynamics",
    "studies.experiments.real_models",
    "studies.experiments.worst_case",
]


@dataclass
class Claim:
    """One row of the report's claims table.

    ``agrees`` is whether the measurement agrees with the claim within the stated tolerance;
    ``None`` (empirical claims only) when the evidence cannot decide.
    """

    claim: str                      # what the paper states, in words ("Lip grows like sqrt(n)")
    theory: str                     # the predicted value or inequality ("slope 0.5", "<= 3.2e4")
    measured: str                   # what the run measured ("slope 0.49 [0.47, 0.51]")
    agrees: bool | None             # see above
    detail: str = ""                # tolerance used, caveats
    kind: str = field(default=THEOREM, kw_only=True)   # "theorem" or "empirical"
    fails_if: str = field(default="", kw_only=True)    # the result that would make the claim fail
    short: str = field(default="", kw_only=True)       # the claim in a few words (the claims table)
    short_measured: str = field(default="", kw_only=True)  # the deciding number in a few words (idem)

    def __post_init__(self):
        if self.kind not in VERDICTS:
            raise ValueError(f"kind: expected 'theorem' or 'empirical', got {self.kind!r}")
        if self.agrees is not None:
            self.agrees = bool(self.agrees)
        elif self.kind == THEOREM:
            raise ValueError(f"agrees: a theorem claim holds or is violated, None is for empirical claims "
                             f"({self.claim!r})")
        if not isinstance(self.fails_if, str) or not self.fails_if.strip():
            raise ValueError(f"fails_if: say what result would make the claim fail ({self.claim!r})")
        for name, long in (("short", self.claim), ("short_measured", self.measured)):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{name}: expected a string, got {type(value).__name__}")
            if len(value) > SHORT_MAX or "|" in value or "\n" in value:
                if name == "short_measured":
                    # its numbers come from the run: a wrong implementation's (a peak of 3.1623e+07 at n = 1e+09)
                    # made it longer, and the study failed with every verdict lost; the cell is cut instead
                    setattr(self, name, shorten(value))
                    continue
                raise ValueError(f"{name}: at most {SHORT_MAX} characters on one line, without '|' (a table cell); "
                                 f"got {value!r}")
            if not value.strip():
                setattr(self, name, shorten(long, first_clause=name == "short_measured"))

    @property
    def verdict(self) -> str:
        """``holds``/``violated`` (theorem) or ``reproduced``/``not reproduced``/``inconclusive``."""
        if self.kind == THEOREM:
            return "holds" if self.agrees else "violated"
        return "inconclusive" if self.agrees is None else "reproduced" if self.agrees else "not reproduced"

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


@dataclass
class StudyResult:
    name: str
    title: str
    claims: list[Claim] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)   # paths relative to the study folder
    tables: list[str] = field(default_factory=list)    # idem
    summary: dict = field(default_factory=dict)        # JSON-serializable numbers
    notes: str = ""                                     # markdown paragraph for the report
    captions: dict = field(default_factory=dict)       # figure -> caption: what it shows, how to read it

    def __post_init__(self):
        """Every figure carries a caption (the report prints it under the figure), and every caption a figure."""
        if not isinstance(self.captions, dict):
            raise TypeError(f"captions: expected a dict of figure -> caption, got {type(self.captions).__name__}")
        missing = [f for f in self.figures if not str(self.captions.get(f, "")).strip()]
        if missing:
            raise ValueError(f"captions: {self.name}'s figures {missing} have no caption (a figure's caption says "
                             "what it shows and how to read it: captions={figure: text})")
        unknown = sorted(set(self.captions) - set(self.figures))
        if unknown:
            raise ValueError(f"captions: {unknown} are not among {self.name}'s figures {list(self.figures)}")

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "title", "figures", "tables", "summary", "notes", "captions")}
        d["claims"] = [c.to_dict() for c in self.claims]
        return to_json(d, "result")


@dataclass
class Study:
    """A registered study: ``run(out_dir, ctx) -> StudyResult``, its sizes per level ``grid(level)``, and
    ``check(ctx)``, which raises a ValueError naming the option when the run context cannot serve the study
    (run by :func:`studies.preflight.check_run` before the first study of a run starts)."""

    name: str
    title: str
    run: Callable
    order: int
    description: str
    grid: Callable[[str], dict] | None = None
    check: Callable | None = None
    reads: tuple = ()


#: the run options a study may read besides the level, seed and device (``register(reads=...)``)
RUN_INPUTS = ("models", "checkpoints", "text")

_REGISTRY: dict[str, Study] = {}
_IMPORT_ERRORS: dict[str, str] = {}


def readers(run_input: str) -> list[str]:
    """The registered studies that read ``run_input``, one of :data:`RUN_INPUTS` (``register(reads=...)``)."""
    if run_input not in RUN_INPUTS:
        raise ValueError(f"run_input: expected one of {RUN_INPUTS}, got {run_input!r}")
    return [name for name, study in registry().items() if run_input in study.reads]


def register(name: str, title: str, order: int | None = None, *, grid: Callable[[str], dict] | None = None,
             check: Callable | None = None, reads: tuple = ()) -> Callable:
    """Decorator registering ``run(out_dir, ctx) -> StudyResult`` as study ``name``.

    Its place in the report: the position of its module in :data:`STUDY_MODULES` for the framework's
    studies; after them, in the order of registration, for any other (or ``order``: studies sort by it,
    the framework's taking 10, 20, ...).

    ``grid(level)`` gives the study's sizes for a level (recorded in the run's config.json). ``check(ctx)``
    checks what the study reads from the run context (files, models, the cache) before any study of the run
    starts, raising a ValueError whose message starts with the option to change (``--checkpoint: ...``).
    ``reads``: the run inputs of ``RUN_INPUTS`` the study reads (``--model``, ``--checkpoint``, ``--text``):
    only those enter its fingerprint (a study that reads none is reused on resume whatever they are).
    The first line of the function's docstring describes the study on the command line.
    """

    if order is not None and (isinstance(order, bool) or not isinstance(order, int)):
        raise TypeError(f"order: expected an integer or None, got {type(order).__name__} {order!r}")
    unknown = [r for r in reads if r not in RUN_INPUTS]
    if isinstance(reads, str) or unknown:
        raise ValueError(f"reads: expected a tuple of some of {RUN_INPUTS}, got {reads!r}")

    def deco(fn: Callable) -> Callable:
        if name in _REGISTRY and _REGISTRY[name].run is not fn:
            raise ValueError(f"name: a study called {name!r} is already registered")
        place = order
        if place is None:
            module = getattr(fn, "__module__", None)
            place = (10 * (STUDY_MODULES.index(module) + 1) if module in STUDY_MODULES
                     else 10 * (len(STUDY_MODULES) + 1) + len(_REGISTRY))
        _REGISTRY[name] = Study(name, title, fn, place, (fn.__doc__ or "").strip().split("\n")[0], grid, check,
                                tuple(reads))
        return fn

    return deco


def unregister(name: str) -> None:
    """Remove a study from the registry (throw-away studies of tests and notebooks)."""
    _REGISTRY.pop(name, None)


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
