"""Shared checks and small helpers of the transport functions (no solver logic here)."""

from __future__ import annotations

import math
import warnings

import torch

from particles import Measure


class SinkhornConvergenceWarning(UserWarning):
    """Sinkhorn stopped at ``max_iter`` with a marginal error above ``tol`` (the value is approximate)."""


def check_pair(mu, nu) -> None:
    """Both arguments are Measures of the same dimension, dtype and device."""
    for name, m in (("mu", mu), ("nu", nu)):
        if not isinstance(m, Measure):
            raise TypeError(f"{name}: expected a particles.Measure, got {type(m).__name__} "
                            "(wrap arrays with Measure(points, weights))")
    if mu.dim != nu.dim:
        raise ValueError(f"nu: dimension {nu.dim} differs from mu's dimension {mu.dim}")
    if mu.dtype != nu.dtype:
        raise ValueError(f"nu: dtype {nu.dtype} differs from mu's {mu.dtype} (convert with nu.to(dtype=...))")
    if mu.device != nu.device:
        raise ValueError(f"nu: device {nu.device} differs from mu's {mu.device} (move with nu.to(device=...))")


def check_reg(reg, method: str) -> float:
    if reg is None:
        raise ValueError(f"reg: method={method!r} needs an entropic regularization reg > 0 "
                         "(in units of squared distance)")
    if isinstance(reg, bool) or not isinstance(reg, (int, float)):
        raise TypeError(f"reg: expected a positive number, got {type(reg).__name__}")
    reg = float(reg)
    if not (reg > 0 and math.isfinite(reg)):
        raise ValueError(f"reg: expected a finite positive number, got {reg}")
    return reg


def check_tol_iter(tol, max_iter) -> tuple[float, int]:
    tol = float(tol)
    if not tol > 0:
        raise ValueError(f"tol: expected a positive marginal tolerance, got {tol}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter: expected a positive integer, got {max_iter!r}")
    return tol, max_iter


def needs_grad(*measures: Measure) -> bool:
    return any(m.points.requires_grad or m.weights.requires_grad for m in measures)


def common_shift(mu: Measure, nu: Measure) -> torch.Tensor:
    """A translation applied to both clouds before forming |x|^2 + |y|^2 - 2<x, y>.

    Costs are translation invariant; centring removes most of the cancellation of the expanded
    form (relative error ~ machine epsilon times |x|^2 instead of times the largest |x|^2).
    """
    return (0.5 * (mu.mean() + nu.mean())).detach()


def sq_dists(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Dense matrix |x_i - y_j|^2 (N, M), differentiable, never negative."""
    xx = (x * x).sum(1)
    yy = (y * y).sum(1)
    return (xx[:, None] + yy[None, :] - 2.0 * x @ y.T).clamp_min(0.0)


def finish(value_sq: torch.Tensor, squared: bool, grad: bool):
    """W2 (or W2^2 when ``squared``) as a float, or a 0-d tensor carrying the autograd graph."""
    value_sq = value_sq.clamp_min(0.0)  # entropic estimates may dip below zero by the tolerance
    out = value_sq if squared else value_sq.sqrt()
    return out if grad else float(out.detach())


def report_nonconvergence(err: float, tol: float, iters: int, strict: bool, what: str) -> None:
    msg = (f"{what}: did not converge in {iters} iterations (marginal L1 error {err:.3g} > tol {tol:.3g}); "
           "the value is approximate. Increase max_iter or reg.")
    if strict:
        raise RuntimeError(msg)
    warnings.warn(msg, SinkhornConvergenceWarning, stacklevel=3)
