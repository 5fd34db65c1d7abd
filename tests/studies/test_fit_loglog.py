"""The log-log fits behind every empirical claim (studies.common.fit_loglog, fit_groups).

Truths: ordinary least squares written out with numpy (normal equations, residual variance on n - 2
degrees of freedom), Student-t quantiles in closed form (1, 2 and 4 degrees of freedom) or from
printed tables (3 and 5), and the defining property of a confidence interval: over repeated noisy
data, the 95% interval contains the true slope 95% of the time, also at 3 and 4 points."""

from __future__ import annotations

import math

import numpy as np
import pytest

from studies.common import fit_groups, fit_loglog

#: two-sided 95% Student-t quantiles t_{0.975, df} from printed tables, for the degrees of freedom with
#: no short closed form
T_TABLE_975 = {3: 3.182446305284263, 5: 2.570581835636314}


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with df degrees of freedom: closed forms for df = 1 (Cauchy), 2 and
    4, the table above (p = 0.975) otherwise."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    if df == 4:
        a = 4 * p * (1 - p)
        q = math.cos(math.acos(math.sqrt(a)) / 3) / math.sqrt(a)
        return math.copysign(2 * math.sqrt(q - 1), p - 0.5)
    assert p == 0.975, "only the 97.5% quantile is tabulated here"
    return T_TABLE_975[df]


def ols_interval(x, y, level):
    """Slope, intercept, standard error and the Student-t interval of the OLS fit log y = a + b log x."""
    lx, ly = np.log(x), np.log(y)
    n = lx.size
    D = np.column_stack([np.ones(n), lx])
    (a, b), *_ = np.linalg.lstsq(D, ly, rcond=None)
    resid = ly - D @ np.array([a, b])
    s2 = resid @ resid / (n - 2)
    se = math.sqrt(s2 / ((lx - lx.mean()) ** 2).sum())
    t = t_quantile(0.5 + level / 2, n - 2)
    return b, a, se, b - t * se, b + t * se


def noisy(points, slope, seed, sigma=0.3):
    rng = np.random.default_rng(seed)
    x = np.geomspace(4, 64, points)
    return x, np.exp(0.7 + slope * np.log(x) + sigma * rng.standard_normal(points))


def test_quantiles_of_the_reference():
    # the closed forms reproduce the tabulated 97.5% quantiles for 1, 2 and 4 degrees of freedom
    for df, table in ((1, 12.706204736174698), (2, 4.302652729749464), (4, 2.7764451051977934)):
        assert t_quantile(0.975, df) == pytest.approx(table, rel=1e-12)


@pytest.mark.parametrize("points, level", [(p, 0.95) for p in (3, 4, 5, 6, 7)]
                         + [(p, level) for level in (0.9, 0.5) for p in (3, 4, 6)])
def test_interval_is_the_student_t_interval_of_ordinary_least_squares(points, level):
    """At the few points of a quick grid, the interval is the OLS slope +- t_{(1+level)/2, n-2} times its
    standard error (a normal quantile would make it 1.3 to 6.5 times too narrow at 95%)."""
    x, y = noisy(points, 0.5, seed=points)
    fit = fit_loglog(x, y, level=level)
    b, a, se, lo, hi = ols_interval(x, y, level)
    assert fit["slope"] == pytest.approx(b, rel=1e-10) and fit["intercept"] == pytest.approx(a, rel=1e-10)
    assert fit["stderr"] == pytest.approx(se, rel=1e-10)
    assert fit["lo"] == pytest.approx(lo, rel=1e-10, abs=1e-12) and fit["hi"] == pytest.approx(hi, rel=1e-10)
    assert fit["points"] == points and fit["level"] == level


@pytest.mark.parametrize("which", ["x", "y"])
def test_float32_measurements_are_fitted_in_float64(which):
    """Measurements handed over as float32 arrays (a float32 run) are fitted in float64: the result is
    the float64 OLS fit of the same numbers, not one with logarithms rounded to float32 (which moves
    the slope by about 1e-7)."""
    x, y = noisy(5, 0.5, seed=3)
    x32, y32 = x.astype(np.float32), y.astype(np.float32)
    xs, ys = (x32, y) if which == "x" else (x, y32)
    fit = fit_loglog(xs, ys)
    b, a, se, lo, hi = ols_interval(np.asarray(xs, np.float64), np.asarray(ys, np.float64), 0.95)
    assert fit["slope"] == pytest.approx(b, rel=1e-10) and fit["intercept"] == pytest.approx(a, rel=1e-10)
    assert fit["lo"] == pytest.approx(lo, rel=1e-10) and fit["hi"] == pytest.approx(hi, rel=1e-10)


@pytest.mark.parametrize("points", [3, 4])
def test_95_percent_interval_covers_the_true_slope_95_percent_of_the_time(points):
    """Gaussian noise on log y, 1500 draws: the fraction of intervals that contain the true slope is
    0.95 up to Monte Carlo error (standard deviation 0.0056; accepted within 0.925..0.975). A normal
    quantile covers 0.70 (3 points) or 0.81 (4 points)."""
    slope = 0.5
    covered = 0
    draws = 1500
    for seed in range(draws):
        fit = fit_loglog(*noisy(points, slope, seed=10_000 + seed))
        covered += fit["lo"] <= slope <= fit["hi"]
    assert 0.925 <= covered / draws <= 0.975


def test_exact_power_law_has_a_zero_width_interval():
    x = np.array([2.0, 4.0, 8.0, 16.0])
    fit = fit_loglog(x, 3.0 * x**0.5)
    assert fit["slope"] == pytest.approx(0.5, rel=1e-12) and fit["intercept"] == pytest.approx(math.log(3.0))
    assert fit["hi"] - fit["lo"] <= 1e-12


def test_too_few_points_is_an_error_naming_x():
    with pytest.raises(ValueError, match="x: need at least 3 points"):
        fit_loglog([1.0, 2.0], [1.0, 2.0])


def test_fit_groups_fits_each_group_on_its_own_rows():
    x, y1 = noisy(5, 0.5, seed=1)
    _, y2 = noisy(4, 1.0, seed=2)
    rows = ([{"g": "a", "n": xi, "lip": yi} for xi, yi in zip(x, y1)]
            + [{"g": "b", "n": xi, "lip": yi} for xi, yi in zip(x[:4], y2)]
            + [{"g": "c", "n": 4.0, "lip": 1.0}, {"g": "c", "n": 8.0, "lip": 2.0}]   # 2 points: no fit
            + [{"g": "d", "n": xi, "lip": yi} for xi, yi in zip([0.25, 0.5, 2.0], [1.0, 1.5, 2.5])])  # x < 1 kept
    fits = fit_groups(rows, ["g"], "n", "lip")
    assert [f["g"] for f in fits] == ["a", "b", "d"]
    for f, (xs, ys) in zip(fits, [(x, y1), (x[:4], y2), (np.array([0.25, 0.5, 2.0]), np.array([1.0, 1.5, 2.5]))]):
        b, a, se, lo, hi = ols_interval(xs, ys, 0.95)
        assert f["slope"] == pytest.approx(b, rel=1e-10) and f["lo"] == pytest.approx(lo, rel=1e-10)
        assert f["hi"] == pytest.approx(hi, rel=1e-10) and f["points"] == len(xs)
