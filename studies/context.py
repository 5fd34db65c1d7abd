"""The run context: everything a study may read about the run, built once and passed as an argument.

The command line builds it from its flags and the environment (:func:`RunContext.from_environment`
reads ``$SMOOTH_ATTENTION_CHECKPOINTS``, ``$SMOOTH_ATTENTION_TEXT`` and ``$SMOOTH_ATTENTION_CACHE``); from
Python, build it
directly::

    from studies.context import RunContext
    from studies.report import reproduce
    reproduce(RunContext("runs/quick", level="quick", seed=0))

Studies read nothing else: no environment variable, no module-level setting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from particles.validation import check_bool

__all__ = ["RunContext", "LEVELS", "CHECKPOINTS_ENV", "TEXT_ENV", "CACHE_ENV", "QUIET", "NORMAL", "VERBOSE"]

LEVELS = ("tiny", "quick", "full")   # tiny: test-size grids; quick: reproduce --quick; full: the paper's sizes
CHECKPOINTS_ENV = "SMOOTH_ATTENTION_CHECKPOINTS"
TEXT_ENV = "SMOOTH_ATTENTION_TEXT"
CACHE_ENV = "SMOOTH_ATTENTION_CACHE"   # where studies.pretrained extracts packaged weights
QUIET, NORMAL, VERBOSE = -1, 0, 1
DEVICES = ("cpu", "cuda")
SWEEP_KEYS = ("backend", "n_workers", "scheduler", "resume", "retries")


@dataclass(frozen=True)
class RunContext:
    """Parameters of one run, shared by every study of it.

    Parameters
    ----------
    out : pathlib.Path
        The run folder (each study writes into ``out/<study>``).
    level : ``"tiny"``, ``"quick"`` or ``"full"``
        Grid sizes: test size, ``--quick``, or the paper's.
    seed : int
        Random seed; runs are deterministic for a seed.
    sweep : dict
        Options of :func:`studies.sweep.run_sweep` for the studies' grids (``backend``, ``n_workers``,
        ``scheduler``, ``resume``, ``retries``); unset keys take :func:`studies.grid.run_grid`'s defaults.
    device : ``"cpu"`` or ``"cuda"``
        Where studies create their tensors and models.
    checkpoints : tuple of str
        Pretrained checkpoints (local folders or hub names) the real-model study measures besides its models.
    models : tuple of str
        The real-model study's own models (``studies.experiments.real_models.MODEL_KEYS``: ``minilm``,
        ``minilm-random``, ``gpt2-random``, ``bert-random``); empty: the trained MiniLM when the
        ``pretrained`` extra is installed, else random-init GPT-2 and BERT (the report says which and why).
    cache : pathlib.Path or None
        Where packaged pretrained weights are extracted (:mod:`studies.pretrained`); None: the default,
        ``$XDG_CACHE_HOME/smooth-attention`` or ``~/.cache/smooth-attention``.
    text : pathlib.Path or None
        A UTF-8 text file replacing the real-model study's default corpus.
    verbosity : int
        -1 quiet (errors only), 0 normal (progress), 1 verbose (debug messages too).
    progress : bool
        Show progress (bars on a terminal, plain lines otherwise); off when quiet.
    argv : tuple of str
        The command that started the run (recorded in config.json and report.md).
    """

    out: Path
    level: str = "full"
    seed: int = 0
    sweep: Mapping = field(default_factory=dict)
    device: str = "cpu"
    checkpoints: tuple = ()
    models: tuple = ()
    cache: Path | None = None
    text: Path | None = None
    verbosity: int = NORMAL
    progress: bool = True
    argv: tuple = ()

    def __post_init__(self):
        if not isinstance(self.out, (str, os.PathLike)):
            raise TypeError(f"out: expected a folder path, got {type(self.out).__name__}")
        object.__setattr__(self, "out", Path(self.out))
        if self.level not in LEVELS:
            raise ValueError(f"level: expected one of {LEVELS}, got {self.level!r}")
        if isinstance(self.seed, bool) or not hasattr(self.seed, "__index__"):
            raise TypeError(f"seed: expected an integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        if not isinstance(self.sweep, Mapping):
            raise TypeError(f"sweep: expected a mapping of run_sweep options, got {type(self.sweep).__name__}")
        unknown = sorted(set(self.sweep) - set(SWEEP_KEYS))
        if unknown:
            raise ValueError(f"sweep: unknown option(s) {unknown}; expected some of {SWEEP_KEYS}")
        object.__setattr__(self, "sweep", dict(self.sweep))
        if self.device not in DEVICES:
            raise ValueError(f"device: expected one of {DEVICES}, got {self.device!r}")
        if isinstance(self.checkpoints, (str, os.PathLike)):
            raise TypeError("checkpoints: expected a sequence of folders, got a single path")
        object.__setattr__(self, "checkpoints", tuple(str(c) for c in self.checkpoints))
        if isinstance(self.models, str):
            raise TypeError("models: expected a sequence of model names, got a single string")
        object.__setattr__(self, "models", tuple(str(m) for m in self.models))
        if self.cache is not None:
            if not isinstance(self.cache, (str, os.PathLike)):
                raise TypeError(f"cache: expected a folder path, got {type(self.cache).__name__}")
            object.__setattr__(self, "cache", Path(self.cache).expanduser())
        if self.text is not None:
            object.__setattr__(self, "text", Path(self.text))
        object.__setattr__(self, "progress", check_bool(self.progress, "progress"))
        if self.verbosity not in (QUIET, NORMAL, VERBOSE):
            raise ValueError(f"verbosity: expected -1 (quiet), 0 or 1 (verbose), got {self.verbosity!r}")
        object.__setattr__(self, "argv", tuple(str(a) for a in self.argv))

    # ------------------------------------------------------------------ derived
    @property
    def quick(self) -> bool:
        """Whether the grids are smaller than the paper's (quick or tiny)."""
        return self.level != "full"

    @property
    def show_progress(self) -> bool:
        return self.progress and self.verbosity > QUIET

    def with_(self, **changes) -> RunContext:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def progress_bar(self, total: int, desc: str, unit: str = "step"):
        """A :class:`studies.sweep.Progress` for a long loop of a study (silent when quiet)."""
        from .sweep.progress import Progress

        return Progress(total, desc, unit=unit, enabled=self.show_progress)

    def to_config(self) -> dict:
        """The context as it is recorded in config.json."""
        sweep = {k: (v if v is None or isinstance(v, (str, int, float, bool)) else repr(v))
                 for k, v in self.sweep.items()}
        return {"out_dir": str(self.out), "grid": self.level, "quick": self.quick, "seed": self.seed,
                "sweep": sweep, "device": self.device, "checkpoints": list(self.checkpoints),
                "models": list(self.models), "cache": None if self.cache is None else str(self.cache),
                "text": None if self.text is None else str(self.text), "verbosity": self.verbosity,
                "command": list(self.argv)}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_environment(cls, out, environ: Mapping | None = None, **fields) -> RunContext:
        """A context whose real-model inputs default to the environment: ``$SMOOTH_ATTENTION_CHECKPOINTS``
        (folders separated by ``os.pathsep``), ``$SMOOTH_ATTENTION_TEXT`` (a text file) and
        ``$SMOOTH_ATTENTION_CACHE`` (the cache of packaged weights). Fields given explicitly win over the
        environment."""
        environ = os.environ if environ is None else environ
        if "checkpoints" not in fields:
            fields["checkpoints"] = tuple(filter(None, environ.get(CHECKPOINTS_ENV, "").split(os.pathsep)))
        if "text" not in fields:
            fields["text"] = environ.get(TEXT_ENV) or None
        if "cache" not in fields:
            fields["cache"] = environ.get(CACHE_ENV) or None
        return cls(out, **fields)
