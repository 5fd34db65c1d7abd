"""Which convention ``reg`` follows, checked against the libraries users know.

* POT: ``reg`` is POT's epsilon on the squared-distance matrix. Our streaming solver (which shares no
  code with POT) gives the value of ``ot.sinkhorn2(a, b, M, reg)`` with M = ``ot.dist(X, Y)``.
* GeomLoss: ``SamplesLoss("sinkhorn", p=2, blur=b)`` uses the cost |x - y|^2 / 2 and eps = b^2, so it
  solves our problem at reg = 2 b^2 and reports half our S_eps. GeomLoss runs a fixed eps-scaling
  schedule without a convergence test: its value tends to ours as its ``scaling`` -> 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from particles import Measure
from transport import w2

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g, dtype=F64)
    Y = torch.randn(30, 3, generator=g, dtype=F64) * 0.7 + 0.5
    a = torch.rand(40, generator=g, dtype=F64) + 0.1
    b = torch.rand(30, generator=g, dtype=F64) + 0.1
    return X, a / a.sum(), Y, b / b.sum()


@pytest.mark.parametrize("reg", [1.0, 0.1])
def test_reg_is_pots_epsilon_on_squared_distances(reg):
    ot = pytest.importorskip("ot")
    X, a, Y, b = _data()
    M = ot.dist(X.numpy(), Y.numpy())  # squared Euclidean by default
    pot = float(ot.sinkhorn2(a.numpy(), b.numpy(), M, reg, method="sinkhorn_log", stopThr=1e-13, numItermax=100_000))
    ours = w2(Measure(X, a), Measure(Y, b), "streaming", reg=reg, debias=False, squared=True, tol=1e-12,
              max_iter=100_000)
    assert ours == pytest.approx(pot, rel=1e-9)


def _geomloss_gaps(reg, scalings):
    geomloss = pytest.importorskip("geomloss")
    X, a, Y, b = _data()
    ours = w2(Measure(X, a), Measure(Y, b), "sinkhorn", reg=reg, squared=True, tol=1e-12, max_iter=100_000)

    def gap(blur, scaling):
        loss = geomloss.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=scaling, debias=True, backend="tensorized")
        return abs(2.0 * float(loss(a, X, b, Y)) - ours) / ours

    return [gap(math.sqrt(reg / 2), s) for s in scalings], gap(math.sqrt(reg), scalings[-1])


@pytest.mark.parametrize("reg", [1.0, 0.1])
def test_geomloss_blur_squared_is_half_reg(reg):
    gaps, other = _geomloss_gaps(reg, (0.9, 0.99))
    # GeomLoss's schedule error shrinks ~30x per decade of 1 - scaling (measured at reg = 1: 7.9e-4 at
    # 0.9, 2.5e-5 at 0.99): its limit is our value ...
    assert gaps[0] > 10 * gaps[1] and gaps[1] < 2e-3
    # ... while the other reading, blur = sqrt(reg), is another problem (5% to 15% away)
    assert other > 0.03


@pytest.mark.slow
@pytest.mark.parametrize("reg", [1.0, 0.1])
def test_geomloss_blur_convention_to_high_accuracy(reg):
    gaps, other = _geomloss_gaps(reg, (0.999, 0.9999))
    # measured: 3.1e-7 and 3.6e-9 relative at reg = 1, 3.4e-6 and 3.5e-8 at reg = 0.1
    assert gaps[0] > 10 * gaps[1] and gaps[1] < 1e-7 and other > 0.03
