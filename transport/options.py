"""The one table of methods' options and defaults, and the checks of every option.

Each method accepts the options listed for it in :data:`DEFAULTS` and nothing else: an option
that does not apply to the chosen method is an error, never ignored. ``None`` for an option
means "the method's default". Tolerances depend on the precision only, through :data:`TOL`.
"""

from __future__ import annotations

import torch

from particles.validation import check_bool, check_positive_float, check_positive_int
from particles.validation import memory_limit as resolve_memory_limit

#: Default marginal tolerance (L1 error of the plan's marginals) by dtype, what the precision reaches.
TOL = {torch.float64: 1e-7, torch.float32: 1e-5}

#: Unit roundoff by dtype (half the machine epsilon), the relative error of one rounding.
UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24}

#: Elements of the largest (rows x M) block the streaming solver holds at once. 2^18 is 2 MiB in float64,
#: cache-sized (2.3x faster than 32 MiB blocks at N = 4000 on one CPU thread, benchmarks/transport.md).
DEFAULT_CHUNK_ELEMENTS = 2 ** 18

#: Marks an option without a default, which the caller must give (``reg`` of the entropic methods).
REQUIRED = "required"
#: Marks a tolerance taken from :data:`TOL` by the measures' dtype.
BY_DTYPE = "by dtype"
#: The adaptive over-relaxation factor of the streaming solver (:mod:`transport.overrelaxation`).
ADAPTIVE = "auto"

#: Options of each method and their defaults ("auto" takes those of the method it may choose,
#: "streaming", and its own rule for ``reg``; see :func:`transport.solve`).
DEFAULTS: dict[str, dict[str, object]] = {
    "exact": {},
    "sinkhorn": {"reg": REQUIRED, "debias": True, "tol": BY_DTYPE, "max_iter": 10_000},
    "streaming": {"reg": REQUIRED, "debias": True, "tol": BY_DTYPE, "max_iter": 5_000, "scaling": 0.5,
                  "overrelaxation": ADAPTIVE, "chunk_elements": DEFAULT_CHUNK_ELEMENTS},
    "auto": {"reg": "(AUTO_BLUR * diameter)^2", "debias": True, "tol": BY_DTYPE, "max_iter": 5_000,
             "scaling": 0.5, "overrelaxation": ADAPTIVE, "chunk_elements": DEFAULT_CHUNK_ELEMENTS},
}

METHODS = tuple(DEFAULTS)


def check_method(method) -> str:
    if not isinstance(method, str) or method not in DEFAULTS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    return method


def resolve(method: str, given: dict, dtype: torch.dtype) -> dict:
    """The options of ``method``: those ``given`` (not None), checked, completed by the defaults.

    An option given for a method it does not apply to is a TypeError naming it. ``reg`` stays None
    when it is REQUIRED and missing (the caller decides: "auto" has its rule, the others refuse).
    """
    table = DEFAULTS[method]
    for name, value in given.items():
        if value is not None and name not in table:
            users = [m for m, opts in DEFAULTS.items() if name in opts]
            applies = f"it applies to {', '.join(map(repr, users))}" if users else "no method takes it"
            raise TypeError(f"{name}: does not apply to method={method!r} ({applies})")
    out = {}
    for name, default in table.items():
        value = given.get(name)
        if value is None:
            if default == BY_DTYPE:
                value = TOL[dtype]
            elif default == ADAPTIVE:
                value = ADAPTIVE
            else:
                value = None if isinstance(default, str) else default
        out[name] = None if value is None else _CHECKS[name](value, name)
    return out


# ---------------------------------------------------------------------- checks of single values
def check_memory_limit(value) -> int:
    """The memory limit in bytes (:func:`particles.validation.memory_limit`), every failure naming memory_limit."""
    try:
        return resolve_memory_limit(value)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        raise ValueError(f"memory_limit: expected a size in bytes below 1e308, got {value!r}") from None


def _check_scaling(value, name: str) -> float:
    # 0 jumps straight to reg (no annealing); 1 would never decrease eps
    out = check_positive_float(value, name, allow_zero=True)
    if not out < 1.0:
        raise ValueError(f"{name}: expected an eps-scaling ratio in [0, 1) (0: no annealing), got {out}")
    return out


def _check_overrelaxation(value, name: str):
    # "auto": adapted to the convergence rate; a factor omega in [1, 2): 1 is plain Sinkhorn, 2 never converges
    if isinstance(value, str):
        if value != ADAPTIVE:
            raise ValueError(f"{name}: expected {ADAPTIVE!r} or a factor in [1, 2), got {value!r}")
        return value
    out = check_positive_float(value, name)
    if not 1.0 <= out < 2.0:
        raise ValueError(f"{name}: expected {ADAPTIVE!r} or a factor in [1, 2) (1: plain Sinkhorn), got {out}")
    return out


#: The smallest marginal tolerance a solve accepts, about 90 unit roundoffs of float64. A plan's marginals, summed in
#: float64, carry a rounding of a few roundoffs (a review's tol = 1e-16 ran all its iterations to a floor of 6e-16,
#: and a tol of 1e-300 was blamed on reg); float32 measures are solved in float64 at such tolerances.
TOL_FLOOR = 1e-14


def _check_tol(value, name):
    out = check_positive_float(value, name)
    if out < TOL_FLOOR:
        raise ValueError(f"{name}: {out:g} is below {TOL_FLOOR:g}, about 90 unit roundoffs of float64, where the "
                         "rounding of the plan's marginals (a few roundoffs) would decide whether a solve converged; "
                         f"use a tolerance of at least {TOL_FLOOR:g} (float64's default is {TOL[torch.float64]:g})")
    if out >= 2.0:
        # sum_i |pi 1 - a|_i + sum_j |pi^T 1 - b|_j of a plan of mass 1 is at most 2 (every plan "converges")
        raise ValueError(f"{name}: {out:g} is not below 2, the largest L1 marginal error of a plan of mass one "
                         "(any plan would meet it); use a tolerance such as 1e-5")
    return out


_CHECKS = {
    "reg": check_positive_float,
    "debias": check_bool,
    "tol": _check_tol,
    "max_iter": check_positive_int,
    "scaling": _check_scaling,
    "overrelaxation": _check_overrelaxation,
    "chunk_elements": check_positive_int,
}
