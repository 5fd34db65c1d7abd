r"""Coarse-to-fine eps-scaling of the streaming Sinkhorn: the first annealing levels on cluster centres.

The eps-scaling levels of :mod:`transport.streaming_sinkhorn` (one update of each potential per level, from
the squared diameter of the clouds down to reg) only prepare the potentials that the iterations at reg
start from. At the large eps of the first levels a point and its neighbours are indistinguishable, so
those levels run on clouds of cluster centres instead of the points: the points in Z-order
(:func:`transport.truncation.morton_order`) cut into blocks of :data:`CLUSTER` consecutive points, each
block replaced by its weighted mean carrying the block's mass. A level runs coarse while its blur sqrt(e)
is at least :data:`SCALE` times the clusters' radius (the root mean square distance of a point to its
block's centre, weighted, the larger of both sides); at the first finer level the coarse potentials are
extended to every point by one soft c-transform against the other side's centres::

    f_i = -e log sum_J b_J exp((g_J - |x_i - y_J|^2) / e)

(N x M / CLUSTER entries), and the remaining levels run on the points. This is the multiscale scheme of
GeomLoss's ``multiscale`` backend and of Schmitzer (2019) [Sch19] (docs/math.md section 3.2), with Morton
blocks as clusters.

Nothing here enters a reported error: the iterations at reg, their stopping test and the float64 check of
a float32 solve run on the points whatever the potentials they start from, so a poor start costs
iterations, never accuracy. What it saves is the annealing's passes over the N x M entries: at the GPU
goal's problem (blur 0.05, the unit cube) 14 of a debiased solve's 102 passes at N = 1e4 and 2e4, and, where
the passes at reg are truncated to a quarter (N = 1e6), a predicted third of its work (benchmarks/transport.md,
"Coarse annealing").
"""

from __future__ import annotations

import math

import torch

from . import truncation
from .tiles import softmin, update

__all__ = ["ENABLED", "CLUSTER", "SCALE", "CUDA_FACTOR", "applies", "clusters", "coarse_levels", "start_pair",
           "start_symmetric"]

#: Run the first annealing levels on cluster centres at all (benchmarks turn it off to time the previous
#: behaviour beside it)
ENABLED = True
#: points per cluster (consecutive points in Z-order)
CLUSTER = 64
#: a level runs on the centres while its blur sqrt(e) is at least this many cluster radii
SCALE = 1.0


#: the gate on CUDA is this many times truncation.MIN_ENTRIES (measured on an H200, benchmarks/gpu.md, the
#: fine annealing took 117 ms against 142 at N = M = 2e4, 76.4 against 75.9 at 1e4, 1.14 s against 0.88 at 1e5)
CUDA_FACTOR = 8


def applies(n: int, m: int, d: int, device=None) -> bool:
    """Whether the annealing of an n x m problem in dimension d on ``device`` starts on cluster centres: where
    the points are sorted in Z-order for truncation anyway (:func:`transport.truncation.applies`' sizes and
    dimensions; on CUDA from :data:`CUDA_FACTOR` times its smallest size) and each side has at least two
    clusters."""
    return ENABLED and truncation.large_enough(n, m, d, device, CUDA_FACTOR) and min(n, m) >= 2 * CLUSTER


def clusters(x: torch.Tensor, log_a: torch.Tensor, size: int = CLUSTER):
    """(centres (K, d), log masses (K,), radius) of the blocks of ``size`` consecutive rows of ``x`` (points
    in Z-order, log-weights ``log_a``, all finite): each centre is its block's weighted mean, each mass the
    block's total, and the radius ``sqrt(sum_i a_i |x_i - c(i)|^2 / sum_i a_i)`` over all points."""
    n, d = x.shape
    count = -(-n // size)
    pad = count * size - n
    xp = torch.cat([x, x.new_zeros(pad, d)]) if pad else x
    lp = torch.cat([log_a, log_a.new_full((pad,), -math.inf)]) if pad else log_a
    xb, lb = xp.view(count, size, d), lp.view(count, size)
    log_mass = torch.logsumexp(lb, 1)
    p = (lb - log_mass[:, None]).exp()                      # weights within each block, summing to 1
    centres = (p[..., None] * xb).sum(1)
    spread = (p * ((xb - centres[:, None]) ** 2).sum(-1)).sum(1)
    share = (log_mass - torch.logsumexp(log_mass, 0)).exp()
    return centres, log_mass, float((share * spread).sum().clamp_min(0.0).sqrt())


def coarse_levels(levels, radius: float) -> int:
    """How many of the leading annealing ``levels`` (decreasing eps) run on centres of this radius."""
    count = 0
    for e in levels:
        if math.sqrt(e) < SCALE * radius:
            break
        count += 1
    return count


def start_pair(x, y, log_a, log_b, levels, chunk):
    """Potentials (f, g) on the points after the leading annealing ``levels`` that run coarse, and how many
    did; (None, None, 0) where none does. ``levels`` are the annealing levels only (not the final eps)."""
    xc, lac, rx = clusters(x, log_a)
    yc, lbc, ry = clusters(y, log_b)
    count = coarse_levels(levels, max(rx, ry))
    if count == 0:
        return None, None, 0
    xxc, yyc = (xc * xc).sum(1), (yc * yc).sum(1)
    fc, gc = xc.new_zeros(xc.shape[0]), yc.new_zeros(yc.shape[0])
    for e in levels[:count]:
        fc = fc + update(xc, xxc, yc, yyc, lbc, fc, gc, e, chunk)
        gc = gc + update(yc, yyc, xc, xxc, lac, gc, fc, e, chunk)
    e = levels[count - 1]
    f = softmin(x, (x * x).sum(1), yc, yyc, lbc, gc, e, chunk)
    g = softmin(y, (y * y).sum(1), xc, xxc, lac, fc, e, chunk)
    return f, g, count


def start_symmetric(x, log_a, levels, chunk):
    """The symmetric problem's potential on the points after the leading annealing ``levels`` that run
    coarse (the averaged update f <- (f + T(f)) / 2 on the centres), and how many did; (None, 0) where none
    does."""
    xc, lac, r = clusters(x, log_a)
    count = coarse_levels(levels, r)
    if count == 0:
        return None, 0
    xxc = (xc * xc).sum(1)
    fc = xc.new_zeros(xc.shape[0])
    for e in levels[:count]:
        fc = fc + 0.5 * update(xc, xxc, xc, xxc, lac, fc, fc, e, chunk)
    return softmin(x, (x * x).sum(1), xc, xxc, lac, fc, levels[count - 1], chunk), count
