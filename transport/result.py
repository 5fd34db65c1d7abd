"""The output of a transport solve, and how a solve that missed its tolerance is reported."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from particles.validation import ConvergenceError


@dataclass(frozen=True)
class TransportResult:
    r"""What :func:`transport.solve` computed.

    Attributes
    ----------
    value : float or 0-d :class:`~torch.Tensor`
        The W2 estimate, sqrt of ``value_squared``: W2 ("exact"), sqrt(S_eps) (entropic with
        ``debias=True``) or sqrt(<pi_eps, C>) (``debias=False``). A 0-d tensor carrying the autograd
        graph when the measures' points or weights require grad (``method="streaming"`` with
        ``debias=False`` refuses points that require grad), else a float.
    value_squared : float or 0-d :class:`~torch.Tensor`
        Its square, in squared-distance units; ``math.inf`` when it exceeds the floating range
        (clouds beyond ~1e154 in float64) although ``value`` does not.
    method : str
        The method that ran: "exact", "sinkhorn" or "streaming" ("auto" says which it chose).
    plan : tensor ``(N, M)`` or None
        The optimal (or entropic) coupling, when asked for with ``return_plan=True``.
    potentials : ``(f, g)``, tensors ``(N,)`` and ``(M,)``, or None
        Dual potentials in squared-distance units, in the dtype ``precision``. Exact (d > 1):
        Kantorovich potentials of the network simplex, f_i + g_j <= \|x_i - y_j\|^2 with equality on
        the plan's support. Entropic: the potentials of OT_eps(mu, nu),
        pi_ij = a_i b_j exp((f_i + g_j - \|x_i - y_j\|^2) / reg) (on atoms of zero mass, the soft
        c-transform). None for the d = 1 sorted formula, or when squared distances exceed the dtype's
        range.
    error : float
        L1 error of the plan's marginals when the solver stopped (0.0 for exact methods); with
        ``debias=True`` the largest of the three problems'. Never measured with a rounding that cannot
        resolve the plan: a float32 solve's error is measured again in float64, from the potentials
        returned (the float32 iterates' own measure shares their rounding).
    converged : bool
        error <= tol (always True for exact methods).
    iterations : int or None
        Sinkhorn updates of the (mu, nu) problem, eps-scaling levels included; None for exact methods.
    precision : torch.dtype or None
        The dtype the solver computed in, and that of ``plan`` and ``potentials``: the measures' own, or
        float64 where float32 cannot resolve the problem (the network simplex of "exact" in d > 1,
        always; an entropic solve where float32's rounding of the exponents, about 6e-8 squared
        diameter / reg, exceeds ``tol``, or whose certificate in float64 missed ``tol``).
    reg : float or None
        The ``reg`` option the solve used (None where it does not apply), and likewise:
    debias : bool or None
    tol : float or None
    max_iter : int or None
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
    precision: torch.dtype | None = None

    def __float__(self) -> float:
        return float(self.value)

    def __repr__(self) -> str:
        """One line of scalars and the shapes and dtypes of the tensors, never their entries."""
        value = self.value
        if isinstance(value, torch.Tensor):
            value = f"{float(value.detach()):.10g} (tensor, grad_fn={type(value.grad_fn).__name__})"
        else:
            value = f"{value:.10g}"
        fields = [f"value={value}", f"method={self.method!r}", f"converged={self.converged}",
                  f"error={self.error:.3g}", f"iterations={self.iterations}"]
        fields += [f"{name}={getattr(self, name)!r}" for name in ("reg", "debias", "tol")
                   if getattr(self, name) is not None]
        fields.append(f"plan={_summary(self.plan)}")
        pots = None if self.potentials is None else "(" + ", ".join(_summary(p) for p in self.potentials) + ")"
        fields.append(f"potentials={pots}")
        fields.append(f"precision={self.precision}")
        return "TransportResult(" + ", ".join(fields) + ")"


def _summary(t: torch.Tensor | None) -> str:
    """A tensor as its shape, dtype and device, e.g. ``tensor(shape=(3, 4), dtype=torch.float64)``."""
    if t is None:
        return "None"
    where = "" if t.device.type == "cpu" else f", device={t.device}"
    return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}{where})"


def worst_error(*errors: float) -> float:
    """The largest error, NaN if any is NaN (Python's max would drop a NaN depending on its place)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


#: The iterations after which a missed tol is blamed on reg rather than on max_iter. Sinkhorn's iterations grow
#: about like the squared diameter / reg, and where thousands did not reach tol, more help slowly (the README's
#: 64-point spheres at reg = 1e-2 kept 2e-4 of marginal error after 1e4 iterations, 2e-5 after 1e5).
SLOW_AFTER = 1000


def failure_advice(iterations: int, max_iter, tol, reg, *, sentence: bool = True) -> str:
    """What to change after a missed tol: max_iter first when few iterations ran, reg first after
    :data:`SLOW_AFTER` (where more iterations help slowly). ``sentence``: capitalized with a full stop (else a
    clause that continues a message)."""
    loosen = f"loosen tol (it was {tol:.3g}) if that error is accurate enough"
    if iterations < SLOW_AFTER or reg is None:
        text = f"increase max_iter (it was {max_iter}) or reg, or {loosen}"
    else:
        text = (f"raise reg (it was {reg:.3g}; the iterations grow about like the squared diameter / reg) or "
                f"{loosen}; after {iterations} iterations, more (max_iter, it was {max_iter}) help slowly")
    return text[0].upper() + text[1:] + "." if sentence else text


def report_failure(result: TransportResult, on_failure: str, stacklevel: int, caller: str = "w2",
                   hint: str | None = None) -> None:
    """Raise ConvergenceError (carrying ``result``) or warn, when the solve missed ``tol``.

    ``caller`` names the function the user called (``"solve"``, ``"w2"``); ``hint``, when given, says what to
    change instead of the generic advice (e.g. an annealing that ``max_iter`` cut short)."""
    err = result.error
    what = "diverged (non-finite marginal error)" if not math.isfinite(err) else f"marginal L1 error {err:.3g}"
    advice = hint or failure_advice(result.iterations, result.max_iter, result.tol, result.reg)
    msg = (f"{caller} ({result.method}): did not converge in {result.iterations} iterations ({what} > tol "
           f"{result.tol:.3g}); the value is approximate. {advice}")
    if on_failure == "raise":
        raise ConvergenceError(msg, result)
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)
