"""The output of a transport solve, and how a solve that missed its tolerance is reported."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from particles.validation import ConvergenceError


@dataclass(frozen=True)
class TransportResult:
    """What :func:`transport.solve` computed.

    Attributes
    ----------
    value : float or 0-d tensor
        The W2 estimate, sqrt of ``value_squared``: W2 ("exact"), sqrt(S_eps) (entropic with
        ``debias=True``) or sqrt(<pi_eps, C>) (``debias=False``). A 0-d tensor carrying the autograd
        graph when the measures' points or weights require grad, else a float.
    value_squared : float or 0-d tensor
        Its square, in squared-distance units; ``math.inf`` when it exceeds the floating range
        (clouds beyond ~1e154 in float64) although ``value`` does not.
    method : str
        The method that ran: "exact", "sinkhorn" or "streaming" ("auto" says which it chose).
    plan : tensor (N, M) or None
        The optimal (or entropic) coupling, when asked for with ``return_plan=True``.
    potentials : (f, g) of tensors (N,), (M,), or None
        Dual potentials in squared-distance units. Exact (d > 1): Kantorovich potentials of the
        network simplex, f_i + g_j <= |x_i - y_j|^2 with equality on the plan's support. Entropic:
        the potentials of OT_eps(mu, nu), pi_ij = a_i b_j exp((f_i + g_j - |x_i - y_j|^2) / reg)
        (on atoms of zero mass, the soft c-transform). None for the d = 1 sorted formula, or when
        squared distances exceed the dtype's range.
    error : float
        L1 error of the plan's marginals when the solver stopped (0.0 for exact methods).
    converged : bool
        error <= tol (always True for exact methods).
    iterations : int or None
        Sinkhorn updates of the (mu, nu) problem, eps-scaling levels included; None for exact methods.
    reg, debias, tol, max_iter : the options the solve used (None where they do not apply).
    """

    value: float | torch.Tensor
    value_squared: float | torch.Tensor
    method: str
    plan: torch.Tensor | None = None
    potentials: tuple[torch.Tensor, torch.Tensor] | None = None
    error: float = 0.0
    converged: bool = True
    iterations: int | None = None
    reg: float | None = None
    debias: bool | None = None
    tol: float | None = None
    max_iter: int | None = None

    def __float__(self) -> float:
        return float(self.value)


def worst_error(*errors: float) -> float:
    """The largest error, NaN if any is NaN (Python's max would drop a NaN depending on its place)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def report_failure(result: TransportResult, on_failure: str, stacklevel: int) -> None:
    """Raise ConvergenceError (carrying ``result``) or warn, when the solve missed ``tol``."""
    err = result.error
    what = "diverged (non-finite marginal error)" if not math.isfinite(err) else f"marginal L1 error {err:.3g}"
    msg = (f"w2 ({result.method}): did not converge in {result.iterations} iterations ({what} > tol "
           f"{result.tol:.3g}); the value is approximate. Increase max_iter or reg.")
    if on_failure == "raise":
        raise ConvergenceError(msg, result)
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)
