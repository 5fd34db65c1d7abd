"""The figure checks: check_figure finds what a reader stumbles on (a log axis with one labelled tick, a
legend over the data, two legends on top of each other), and finalize (run by io.save_figure on every
figure) repairs the first two."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest

from studies import plotting as P
from studies.io import save_figure


def _labels(axis):
    lo, hi = sorted(axis.get_view_interval())
    k = 1 if axis.axis_name == "y" else 0
    return [t.get_text() for t in axis.get_ticklabels(which="both")
            if t.get_visible() and t.get_text().strip() and lo <= t.get_position()[k] <= hi]


@pytest.mark.parametrize("lo, hi", [(4.0, 64.0), (0.3, 0.9), (1.6, 2.4), (0.08955, 0.08958)])
def test_short_log_axes_get_two_labelled_ticks(lo, hi):
    fig, ax = P.figure()
    x = np.geomspace(lo, hi, 7)
    P.measured(ax, x, x, "y = x")
    P.finish(ax, "x", "y", logx=True, logy=True, legend=False)
    fig.canvas.draw()
    before = P.check_figure(fig)
    P.finalize(fig)
    fig.canvas.draw()
    assert len(_labels(ax.xaxis)) >= 2 and len(_labels(ax.yaxis)) >= 2, (_labels(ax.xaxis), _labels(ax.yaxis))
    assert P.check_figure(fig) == []
    if lo == 4.0:  # 4..64 spans one decade tick only: matplotlib labels it alone
        assert any("labelled tick" in p for p in before)
    plt.close(fig)


def test_wide_log_axes_keep_their_decades():
    fig, ax = P.figure()
    x = np.geomspace(1, 1e6, 7)
    P.measured(ax, x, x, "y = x")
    P.finish(ax, "x", "y", logx=True, logy=True, legend=False)
    P.finalize(fig)
    assert all("10^" in t or t.startswith("$") for t in _labels(ax.xaxis))
    plt.close(fig)


def test_a_curve_between_decade_labels_gets_a_label_where_it_lies():
    """The masked study's panel: constants of 2 to 3 under a bound of 35 to 140, so matplotlib's only
    labels are 10 and 100, a factor 3 or more above every measured value."""
    fig, ax = P.figure()
    n = np.array([4, 8, 16, 32, 64])
    P.measured(ax, n, [2.0, 2.3, 2.2, 2.6, 2.9], "measured")
    P.theory(ax, n, 35 * np.sqrt(n / 4), "bound")
    P.finish(ax, "n", "constant", logx=True, logy=True, legend=False)
    fig.canvas.draw()
    assert any("no labelled tick on the log y axis" in p and "[2, 2.9]" in p for p in P.check_figure(fig))
    P.finalize(fig)
    fig.canvas.draw()
    assert P.check_figure(fig) == []
    lo, hi = sorted(ax.get_ylim())
    labelled = [t.get_position()[1] for t in ax.yaxis.get_ticklabels() if t.get_text().strip()
                and lo <= t.get_position()[1] <= hi]
    assert any(1.0 <= t <= 5.8 for t in labelled), labelled      # within a factor 2 of [2, 2.9]
    assert any(30 <= t <= 300 for t in labelled), labelled       # and the bound keeps its labels
    plt.close(fig)


def test_a_legend_over_the_data_is_found_and_moved_off_it():
    fig, ax = P.figure()
    x = np.linspace(0, 1, 50)
    for k in range(6):  # curves everywhere: no free corner inside the axes
        P.measured(ax, x, np.sin(6 * x + k) + 0.3 * k, f"curve {k}", marker="")
    ax.legend(loc="upper left")
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    assert "the legend covers plotted data" in " ".join(P.check_figure(fig))
    P.finalize(fig)
    assert P.check_figure(fig) == []
    leg = ax.get_legend()
    assert leg.get_window_extent().x0 >= ax.get_window_extent().x1  # now right of the axes
    plt.close(fig)


def test_a_legend_over_a_band_or_a_map_counts_as_covering_data():
    fig, axes = P.figure(ncols=2)
    x = np.linspace(0, 1, 20)
    P.band(axes[0], x, np.zeros_like(x), np.ones_like(x), label="band")
    axes[0].legend(loc="center")
    P.heatmap(axes[1], [0, 1], [0, 1], [[1, 2], [3, 4]], xlabel="a", ylabel="b", cbar_label="c", fig=fig)
    axes[1].plot([0.5], [0.5], "k*", label="a point")
    axes[1].legend(loc="upper right")
    problems = P.check_figure(fig)
    assert sum("legend covers" in p for p in problems) == 2
    plt.close(fig)


def test_overlapping_legends_are_reported():
    fig, axes = P.figure(ncols=2)
    for ax in axes:
        ax.plot([0, 1], [0, 1], label="a long label " * 4)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower left")
    fig.legend(*axes[1].get_legend_handles_labels(), loc="outside lower left")
    assert "two legends overlap" in P.check_figure(fig)
    plt.close(fig)


def test_save_figure_finalizes(tmp_path):
    fig, ax = P.figure()
    x = np.geomspace(4, 64, 5)
    P.measured(ax, x, x, "y")
    P.finish(ax, "x", "y", logx=True, logy=True)
    seen = {}
    original = P.finalize

    def spy(f):
        original(f)
        seen["problems"] = P.check_figure(f)

    P.finalize = spy
    try:
        save_figure(fig, tmp_path / "f.png")
    finally:
        P.finalize = original
    assert seen["problems"] == [] and (tmp_path / "f.png").stat().st_size > 1000


def test_heatmap_sequential_scale_starts_where_asked():
    fig, ax = P.figure()
    mesh = P.heatmap(ax, [0, 1], [0, 1], [[1.0, 1.0], [1.0, 1.02]], xlabel="a", ylabel="b", cbar_label="ratio",
                     vmin=1.0, fig=fig)
    assert mesh.norm.vmin == 1.0 and mesh.get_cmap().name == "viridis"
    plt.close(fig)


def test_a_count_axis_labels_the_powers_of_two_as_whole_numbers(tmp_path):
    """sphere_clusters.png's middle panel: cluster counts from 32 down to 1 on a log axis were labelled 1 and 10
    only (decades pass the two-label rule), so a reader could not tell 32 from 20. A count axis labels 1, 2, 4,
    ..., 32 as whole numbers, and finalize (save_figure) keeps them."""
    fig, ax = P.figure()
    t = np.arange(8.0)
    P.measured(ax, t, [32, 32, 30, 15, 5, 1, 1, 1], "clusters")
    P.finish(ax, "t", "number of clusters", legend=False)
    P.count_axis(ax)
    save_figure(fig, tmp_path / "counts.png")
    assert {"1", "2", "4", "8", "16", "32"} <= set(_labels(ax.yaxis)), _labels(ax.yaxis)
    assert ax.get_yscale() == "log" and P.check_figure(fig) == []
    with pytest.raises(ValueError, match="^which: expected 'x' or 'y'"):
        P.count_axis(ax, "z")
    plt.close(fig)
    # counts that stay at 1 were labelled 0.25 and 0.5; counts between 2 and 3 had one label (a review)
    for counts in ([1, 1, 1], [2, 3, 2]):
        fig, ax = P.figure()
        P.measured(ax, np.arange(3.0), counts, "clusters")
        P.finish(ax, "t", "number of clusters", legend=False)
        P.count_axis(ax)
        save_figure(fig, tmp_path / "few.png")
        labels = _labels(ax.yaxis)
        assert len(labels) >= 2 and all(t.isdigit() for t in labels), (counts, labels)
        assert P.check_figure(fig) == [], counts
        plt.close(fig)
