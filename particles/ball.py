"""The closed ball B_R of R^d, where the theory's tokens live (Theorems 3.3 and 3.5 bound attention on B_R^n
and on measures supported in B_R).

Points built as ``R * u`` with ``|u| = 1`` have a computed norm of ``R (1 + eps)`` about half the time: a
worst-case input or a witness that claims to lie in B_R should pass ``X.norm(dim=-1) <= R`` exactly, as a
user checks it. :func:`into_ball` makes that true.
"""

from __future__ import annotations

import torch

from .validation import check_radius

__all__ = ["into_ball"]

#: shrink steps, each by 4 units in the last place; one is enough in practice (the norm's own rounding is
#: a few units), the bound only keeps the loop finite
_STEPS = 16


def into_ball(X: torch.Tensor, R: float) -> torch.Tensor:
    """``X`` (..., d) with every row in the closed ball of radius ``R``, as its computed norm sees it.

    Rows whose norm exceeds R are scaled onto the sphere (the radial projection ``x -> x min(1, R / |x|)``),
    then every row whose computed norm is still above R is shrunk by 4 units in the last place (one representable
    value in float16 and bfloat16) until
    ``X.norm(dim=-1) <= R`` holds in X's dtype, and below float64 also in float64 (the norm of the numbers X
    holds, which a float64 re-certification of a float32 input computes: 50.0000024 at R = 50 in float32
    before); other rows are returned unchanged, bit for bit. Identical
    rows stay identical. Differentiable (``torch.where``); one host sync per step on an accelerator.
    """
    R = check_radius(R, "R")
    if not isinstance(X, torch.Tensor) or not X.is_floating_point():
        raise TypeError(f"X: expected a floating-point tensor, got {type(X).__name__}")
    norm = X.norm(dim=-1, keepdim=True)
    out = torch.where(norm > R, X * (R / torch.where(norm > R, norm, torch.ones_like(norm))), X)
    shrink = 1.0 - 4.0 * torch.finfo(X.dtype).eps
    wide = X.dtype != torch.float64
    # 16-bit floats step down one representable value at a time (4 units of bfloat16 are 3%)
    half = X.dtype in (torch.float16, torch.bfloat16)
    # the float64 check where the device has float64 (MPS has none: on the CPU there)
    exact = "cpu" if X.device.type == "mps" else X.device
    for _ in range(_STEPS):
        over = out.norm(dim=-1, keepdim=True) > R
        if wide:   # and the exact norm of the numbers held (float64's): a float64 check of them sees it
            wide_norm = out.detach().to(exact, torch.float64).norm(dim=-1, keepdim=True)
            over = over | (wide_norm > R).to(over.device)
        if not bool(over.any()):
            return out
        if half:   # the value one step towards 0 in every coordinate; the derivative of the identity
            held = out.detach()
            out = torch.where(over, out + (torch.nextafter(held, torch.zeros_like(held)) - held), out)
        else:
            out = torch.where(over, out * shrink, out)
    raise FloatingPointError(f"X: rows still outside the ball of radius {R:g} after {_STEPS} shrink steps "
                             "(non-finite entries?)")
