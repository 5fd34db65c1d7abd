"""What a worst-case search takes and returns (:mod:`meanfield.worst_case`): its options (:class:`SearchOptions`), one
record per start (:class:`StartRecord`) and the certified bracket with its trace (:class:`WorstCaseResult`)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

from particles import Measure
from particles.validation import check_bool, check_positive_float, check_positive_int, check_seed

from .lipschitz import LipschitzEstimate
from .upper import UpperBound

__all__ = ["SearchOptions", "StartRecord", "WorstCaseResult"]


@dataclass(frozen=True)
class SearchOptions:
    """How the worst-case search spends its budget: one object for every entry point.

    Starts (:func:`meanfield.starts.sequence_starts`, :func:`~meanfield.starts.measure_starts`):

    random : int
        Random inputs (tokens uniform on the sphere of radius R).
    clusters : int
        Clustered random sequences (a few tokens and n - 1 or n - 2 copies of another).
    structured : bool
        Proposition 3.4's witness in both eigen-cases, the hub configurations and the zero-plus-spread
        configuration of every head (the two-Dirac witness too for measures).
    ladder : bool
        Where the ascent stopped on its own tests with half the budget or more left, a second ascent within the
        budget from the structured starts built again at the radii below R where the scores spread by 16, 4 and
        1 (:func:`meanfield.starts.ladder_sequence_starts`): at a large radius the softmaxes of the starts at R
        saturate and their ascent stops at once (Lip(f on B_R^n) >= Lip(f on B_r^n) for r < R). Only then: as
        extra starts from the beginning they shared the budget of a 12-head search, 42% lower.

    Ascent (:mod:`meanfield.ascent`):

    max_steps : int
        Iterations (each: gradients where needed, one trial step per active start).
    keep : int or None
        Successive halving: when 1/4 and 1/2 of the budget are spent, the worse half of the starts
        still ascending stops (``"pruned"``), never leaving fewer than ``keep``; and whenever the budget
        left cannot pay one more iteration of every start still ascending, the worst of them are pruned
        until it can (so many starts on a small budget still ascend from the best ones). Starts are ranked
        by their best value so far, so a start that rises late can be pruned before it does. None: no
        pruning (all the starts still ascending go on, or all stop on the budget).
    gtol : float
        Stationarity test, ||projected gradient|| <= gtol * sigma in coordinates X / R, i.e. no
        first-order gain above a fraction gtol for moves of the tokens of size R.
    step : float
        Initial step: tokens move by ``step * R`` (root mean square over tokens) along the gradient;
        doubled after an accepted step (up to R / 2), divided by 4 after a rejected one. For the plain
        ascent: the fixed step.

    Certified values (:func:`meanfield.local_lipschitz`):

    tol : float or None
        Relative accuracy of every certified value (None: :data:`meanfield.lipschitz.TOL` for the
        operator's dtype).
    seed : int
        Seed of the random starts and of the estimators' random vectors.
    batch_size : int or None
        Starts per batched Lanczos run (sequences; None: all; lower it to bound memory).
    """

    random: int = 8
    clusters: int = 4
    structured: bool = True
    ladder: bool = True
    max_steps: int = 200
    keep: int | None = 4
    gtol: float = 1e-4
    step: float = 0.05
    tol: float | None = None
    seed: int = 0
    batch_size: int | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("random", check_positive_int(self.random, "random", minimum=0))
        set_("clusters", check_positive_int(self.clusters, "clusters", minimum=0))
        set_("structured", check_bool(self.structured, "structured"))
        set_("ladder", check_bool(self.ladder, "ladder"))
        set_("max_steps", check_positive_int(self.max_steps, "max_steps", minimum=0))
        if self.keep is not None:
            set_("keep", check_positive_int(self.keep, "keep"))
        set_("gtol", check_positive_float(self.gtol, "gtol", allow_zero=True))
        set_("step", check_positive_float(self.step, "step"))
        if self.tol is not None:
            set_("tol", check_positive_float(self.tol, "tol"))
        check_seed(self.seed)
        if self.batch_size is not None:
            set_("batch_size", check_positive_int(self.batch_size, "batch_size"))

    def replace(self, **changes) -> SearchOptions:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(SearchOptions))


def _options(options, legacy: dict, entry: str) -> SearchOptions:
    """The SearchOptions of a call: ``options`` (an object, a dict of its fields or None), with the
    search options given as keywords (the spelling before SearchOptions) merged in, with a warning."""
    unknown = sorted(set(legacy) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"{entry}() got unexpected keyword argument(s) {unknown}")
    if options is None:
        opts = SearchOptions()
    elif isinstance(options, SearchOptions):
        opts = options
    elif isinstance(options, dict):
        bad = sorted(set(options) - set(_OPTION_NAMES))
        if bad:
            raise TypeError(f"options: unknown search option(s) {bad}; the options are {list(_OPTION_NAMES)}")
        opts = SearchOptions(**options)
    else:
        raise TypeError(f"options: expected a SearchOptions, a dict of its fields or None, got "
                        f"{type(options).__name__}")
    if legacy:
        warnings.warn(f"{entry}({', '.join(f'{k}=...' for k in legacy)}): pass the search options as "
                      f"options=SearchOptions({', '.join(f'{k}=...' for k in legacy)}); the keywords will be "
                      "removed in the next release", DeprecationWarning, stacklevel=3)
        opts = opts.replace(**legacy)
    return opts


@dataclass(frozen=True)
class StartRecord:
    """One start of the search: its ``name``, the certified value at the start (``initial``, after
    projection onto the ball) and at its last accepted iterate (``final``), accepted ``steps``, and
    why it stopped: ``"stationary"`` (projected-gradient test), ``"stalled"`` (no increase found
    down to the smallest step, or a relative gain below 1e-6 over 20 iterations: the ascent crawls,
    typically along a ridge where the top singular value is multiple), ``"budget"``,
    ``"max_steps"``, ``"pruned"`` (dropped to spend the budget on better starts) or ``"overflow"``
    (the constant or its gradient left the dtype's range there; failed trials are only rejected)."""

    name: str
    initial: float
    final: float
    steps: int
    stopped: str


@dataclass(frozen=True)
class WorstCaseResult:
    """A certified bracket on the Lipschitz constant of an attention operator on a ball.

    Attributes
    ----------
    input : tensor ``(n, d)`` or :class:`~particles.Measure`
        The best input found; every token (atom) lies in B_R up to rounding. For a measure whose
        constant is raised by splitting, the representation with the split atom (section 4.7).
    estimate : LipschitzEstimate
        Its certified local constant (:func:`meanfield.local_lipschitz`): ``lower`` = its value is a
        certified lower bound on Lip(f on B_R^n) (measures: on the W2 constant of F on P(B_R)).
    upper : UpperBound
        The best upper bound the framework knows (:func:`meanfield.upper.operator_upper`).
    R : float
        The radius.
    n : int
        The number of tokens (atoms for measures).
    start : str
        Name of the start the best input was reached from.
    starts : tuple
        One :class:`StartRecord` per start.
    trace : tuple
        One :class:`~meanfield.ascent.TracePoint` per iteration.
    products : int
        Jacobian products spent (each J u and each J^T w on one sequence counts one; a gradient pass
        counts :data:`~meanfield.worst_case.GRADIENT_PRODUCTS`), the starts' certified values included, and for
        :func:`~meanfield.worst_case_measure` the certificate of a split representation, computed once after the
        search (it can take ``products`` past the budget by that one certificate).
    start_products : int
        Of ``products``, those that certified the starts before the first step. They are spent whatever
        the budget (a lower bound needs at least one certified value), so ``products`` exceeds a budget
        smaller than them; the ascent then makes no step (``stopped == "budget"``).
    seconds : float
        Wall time.
    stopped : str
        ``"budget"`` (products ran out with starts still ascending), ``"max_steps"``, or
        ``"converged"`` (every start stopped on the stationarity test, stalled, or was pruned).
    method : str
        ``"projected ascent"`` or ``"plain gradient ascent"``.
    search_value : float
        The value the search maximized at ``input`` (for split measures the closed form
        of section 4.7, otherwise ``estimate.value``).
    split : bool
        Whether ``input`` is a split representation.
    """

    input: object
    estimate: LipschitzEstimate
    upper: UpperBound
    R: float
    n: int
    start: str
    starts: tuple
    trace: tuple
    products: int
    seconds: float
    stopped: str
    method: str
    search_value: float
    split: bool = False
    options: dict = field(default_factory=dict)   # the budget and the SearchOptions fields of the call
    start_products: int = 0

    @property
    def lower(self) -> float:
        """Certified lower bound on the Lipschitz constant on the ball (the estimate's value)."""
        return self.estimate.value

    @property
    def error(self) -> float:
        """The estimate's error bound (docs/math.md section 4.4)."""
        return self.estimate.error

    @property
    def log_ratio(self) -> float | None:
        """log(lower / upper), or None when no upper bound is known."""
        if not self.upper.known:
            return None
        if self.lower == 0:
            return -math.inf
        return math.log(self.lower) - self.upper.log_value

    @property
    def ratio(self) -> float | None:
        """lower / upper (at most 1 when both are right), or None when no upper bound is known."""
        lr = self.log_ratio
        return None if lr is None else math.exp(lr) if lr > -745 else 0.0

    @property
    def converged(self) -> bool:
        """Whether the search stopped on its own tests rather than on its budget or step cap."""
        return self.stopped == "converged"

    def start_record(self, name: str) -> StartRecord:
        """The record of the start called ``name``."""
        for s in self.starts:
            if s.name == name:
                return s
        raise KeyError(f"name: no start called {name!r} (starts: {[s.name for s in self.starts]})")

    def _upper_text(self) -> str:
        if not self.upper.known:
            return "unknown"
        if self.upper.value < math.inf:
            return f"{self.upper.value:.6g}"
        return f"exp({self.upper.log_value:.6g})"

    def __repr__(self) -> str:
        # the full record (inputs, starts, trace) is in the attributes; the repr is the bracket
        return (f"WorstCaseResult(lower={self.lower:.6g} +/- {self.error:.2g}, upper={self._upper_text()}, "
                f"R={self.R:g}, n={self.n}, start={self.start!r}, products={self.products}, stopped={self.stopped!r})")

    def summary(self) -> str:
        """One paragraph: the bracket, the ratio, where it came from, what it cost."""
        up = self._upper_text()
        if self.ratio is None:
            ratio = ""
        elif self.ratio > 0:
            ratio = f", ratio {self.ratio:.3g}"
        else:
            ratio = f", ratio exp({self.log_ratio:.6g})"
        what = "atoms" if isinstance(self.input, Measure) else "tokens"
        return (f"{self.method}, n = {self.n} {what}, R = {self.R:g}: {self.lower:.6g} (+/- {self.error:.2g}) "
                f"<= Lip <= {up} [{self.upper.source}]{ratio}; best from start {self.start!r}; "
                f"{self.products} Jacobian products, {self.seconds:.2f} s, stopped: {self.stopped}")
