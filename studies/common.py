"""Helpers several studies share: seeded random matrices and log-log fits with confidence intervals."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["random_A", "random_V", "fit_loglog", "fit_groups", "to_device"]


def random_A(d: int, seed: int) -> torch.Tensor:
    """A d x d Gaussian matrix / sqrt(d) from a seed (float64, CPU), the same on every machine."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)


def random_V(d: int, seed: int) -> torch.Tensor:
    """The value matrix paired with :func:`random_A`: Gaussian / sqrt(d) from ``seed + 101`` (float64, CPU)."""
    g = torch.Generator().manual_seed(int(seed) + 101)
    return torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)


def to_device(device, *tensors):
    """The tensors moved to ``device`` (None: left where they are). Random draws happen on the CPU
    first, so a seed gives the same numbers on every device."""
    if device is None:
        return tensors if len(tensors) != 1 else tensors[0]
    moved = tuple(t.to(device) for t in tensors)
    return moved if len(moved) != 1 else moved[0]


def fit_loglog(x, y, level: float = 0.95) -> dict:
    """Least-squares fit log y = a + b log x; slope b with its Student-t confidence interval."""
    from scipy import stats

    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    if lx.size < 3:
        raise ValueError(f"x: need at least 3 points to fit a slope with a confidence interval, got {lx.size}")
    res = stats.linregress(lx, ly)
    t = stats.t.ppf(0.5 + level / 2, lx.size - 2)
    return {"slope": float(res.slope), "lo": float(res.slope - t * res.stderr),
            "hi": float(res.slope + t * res.stderr), "intercept": float(res.intercept),
            "stderr": float(res.stderr), "level": level, "points": int(lx.size)}


def fit_groups(rows, keys, x: str, y: str, min_points: int = 3, min_x=0) -> list[dict]:
    """:func:`fit_loglog` of ``y`` against ``x`` for each group of rows with equal ``keys``
    (rows with ``x >= min_x``; groups with at least ``min_points`` distinct x), in first-seen order."""
    groups: dict = {}
    for r in (r for r in rows if r[x] >= min_x):
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    fits = []
    for key, sel in groups.items():
        if len({r[x] for r in sel}) >= min_points:
            fits.append({**dict(zip(keys, key)), **fit_loglog([r[x] for r in sel], [r[y] for r in sel])})
    return fits
