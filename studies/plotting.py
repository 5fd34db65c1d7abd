"""One figure style for every study: labelled axes, log scales for power laws, theory in the plot.

Matplotlib runs on the Agg backend (no display needed). Measured data are drawn as markers
joined by thin lines (:func:`measured`), their spread over repetitions as a shaded band
(:func:`band`), theory curves as dashed lines (upper bounds) or dotted lines (lower bounds and
asymptotics) (:func:`theory`), so a reader tells them apart in every figure of the report.

Every figure passes through :func:`finalize` before it is written (:func:`studies.io.save_figure`
calls it): a log axis spanning too few decades, or with a curve that lies far from every decade
label, gets labelled ticks at 1-2-5 (or finer) instead, and a legend that covers plotted data
moves outside the axes. :func:`check_figure` lists what a reader would still stumble on (an axis
with fewer than two labelled ticks, a log axis with no label near a curve, a legend over data);
the tests run it on every figure of the studies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402

__all__ = ["figure", "measured", "theory", "band", "finish", "figure_legend", "COLORS", "heatmap", "finalize",
           "check_figure"]

COLORS = plt.get_cmap("tab10").colors

_RC = {
    "figure.figsize": (6.0, 4.2),
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "font.size": 10,
    "axes.titlesize": 10,
    "savefig.facecolor": "white",
}


def figure(ncols: int = 1, nrows: int = 1, width: float | None = None, height: float | None = None):
    """A new figure with the report's style; returns (fig, axes) (axes flattened when several)."""
    with plt.rc_context(_RC):
        fig, axes = plt.subplots(nrows, ncols, figsize=(width or 5.2 * ncols, height or 4.0 * nrows),
                                 squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.spines["top"].set_visible(False)
        ax.spines["right"].set_visible(False)
    flat = list(axes.flat)
    return fig, (flat[0] if len(flat) == 1 else flat)


def measured(ax, x, y, label: str, color=None, marker: str = "o", **kw):
    """Measured values: markers joined by a thin solid line."""
    kw.setdefault("ms", 4)
    kw.setdefault("lw", 1.2)
    return ax.plot(np.asarray(x, float), np.asarray(y, float), marker=marker, color=color, label=label, **kw)


def band(ax, x, lo, hi, color=None, label: str | None = None, **kw):
    """The spread of repeated measurements (min to max, or mean +- one standard deviation) around a
    measured curve, as a shaded band; say which in ``label`` or in the axis title."""
    kw.setdefault("alpha", 0.2)
    kw.setdefault("lw", 0)
    return ax.fill_between(np.asarray(x, float), np.asarray(lo, float), np.asarray(hi, float), color=color,
                           label=label, **kw)


def theory(ax, x, y, label: str, color=None, kind: str = "upper", **kw):
    """A theory curve: dashed for upper bounds, dotted for lower bounds / asymptotics."""
    ls = {"upper": "--", "lower": ":", "limit": "-."}.get(kind, "--")
    kw.setdefault("lw", 1.5)
    return ax.plot(np.asarray(x, float), np.asarray(y, float), ls=ls, color=color, label=label, **kw)


def finish(ax, xlabel: str, ylabel: str, title: str = "", *, logx: bool = False, logy: bool = False,
           legend: bool = True, legend_loc: str = "best"):
    """Label the axes (always), set log scales where the claim is a power law, add the legend.

    ``legend_loc="outside"`` puts the legend to the right of the axes, off the data; otherwise
    :func:`finalize` moves it there if it covers data where matplotlib placed it.
    """
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    # minor tick labels of log ranges overlap; finalize() labels 1-2-5 ticks where decades are too few
    if logx:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    if legend and ax.get_legend_handles_labels()[0]:
        if legend_loc == "outside":
            _legend_outside(ax)
        else:
            ax.legend(loc=legend_loc)
    return ax


def count_axis(ax, which: str = "y"):
    """A log axis of counts (clusters, tokens): labelled at the powers of two as whole numbers (1, 2, 4, ..., 32),
    where decades left a count axis from 1 to 32 with the labels 1 and 10 only. :func:`finalize` keeps it."""
    if which not in ("x", "y"):
        raise ValueError(f"which: expected 'x' or 'y', got {which!r}")
    axis = ax.yaxis if which == "y" else ax.xaxis
    (ax.set_yscale if which == "y" else ax.set_xscale)("log", base=2)
    axis.set_major_locator(ticker.LogLocator(base=2, subs=(1.0,)))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.0f}" if v >= 1 else ""))   # no 0.5 clusters
    axis.set_minor_locator(ticker.NullLocator())
    axis.set_minor_formatter(ticker.NullFormatter())
    axis._meanfield_counts = True
    return ax


def _widen_count_axis(ax, which: str, lo: float, hi: float) -> None:
    """A count axis (:func:`count_axis`) shows two powers of two at least, 1 and 2 the lowest (counts that stay
    at 1, or between 2 and 3, left one label)."""
    if not (lo > 0 and hi >= lo and math.isfinite(hi)):
        return
    inside = math.floor(math.log2(hi) + 1e-9) - math.ceil(math.log2(lo) - 1e-9) + 1   # powers of two in the view
    if inside >= 2:
        return
    a = 2.0 ** max(0, math.floor(math.log2(lo) + 1e-9))
    b = max(2.0 ** math.ceil(math.log2(hi) - 1e-9), 2 * a)
    (ax.set_xlim if which == "x" else ax.set_ylim)(min(lo, a / 1.15), max(hi, b * 1.15))


def figure_legend(fig, axes, ncol: int = 3):
    """One legend for several panels that plot the same kinds of curves, below the figure (entries
    with the same label are shown once)."""
    seen: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    return fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncol=ncol)


def heatmap(ax, x: Sequence[float], y: Sequence[float], Z, *, xlabel: str, ylabel: str, cbar_label: str,
            title: str = "", center: float | None = None, vmin: float | None = None, vmax: float | None = None,
            cmap: str | None = None, fig=None):
    """A map of Z[i, j] at (x[j], y[i]).

    ``center``: diverging colours around it (for signed effects). ``vmin``/``vmax``/``cmap``: a
    sequential scale, for quantities bounded on one side (a ratio >= 1 starts at 1).
    """
    Z = np.asarray(Z, float)
    kw = {}
    if center is not None:
        # a floor on the colour range: values within 1% of the centre read as "no effect"
        span = max(float(np.nanmax(np.abs(Z - center))), 0.01 * max(abs(center), 1.0))
        kw = {"cmap": cmap or "RdBu_r", "vmin": center - span, "vmax": center + span}
    else:
        kw = {"cmap": cmap or "viridis", "vmin": vmin, "vmax": vmax}
    mesh = ax.pcolormesh(np.asarray(x, float), np.asarray(y, float), Z, shading="nearest", **kw)
    cb = (fig or ax.figure).colorbar(mesh, ax=ax)
    cb.set_label(cbar_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(False)
    if title:
        ax.set_title(title)
    return mesh


# ---------------------------------------------------------------------------- finishing a figure
def _is_colorbar(ax) -> bool:
    return getattr(ax, "_colorbar", None) is not None


def _tick_text(v: float) -> str:
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e4:
        return f"{v:.4g}"
    e = math.floor(math.log10(abs(v)))
    m = v / 10**e
    return f"$10^{{{e}}}$" if abs(m - 1) < 1e-9 else f"${m:.3g}\\times10^{{{e}}}$"


def _log_ticks(lo: float, hi: float, subs) -> list[float]:
    k_lo, k_hi = math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1
    return [m * 10.0**k for k in range(k_lo, k_hi + 1) for m in subs if lo <= m * 10.0**k <= hi]


def _unlabelled_data(ticks: Sequence[float], groups: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The data ranges (of a log axis) with no labelled tick within a factor NEAR of them."""
    return [(a, b) for a, b in groups if not any(a / _NEAR <= t <= b * _NEAR for t in ticks)]


_NEAR = 2.0   # a label more than a factor 2 away from a curve leaves the reader guessing its values


def _fix_log_axis(axis, lo: float, hi: float, groups: Sequence[tuple[float, float]] = ()) -> None:
    """Give a log axis at least two labelled ticks, and a labelled tick near every plotted curve
    (within a factor 2 of its range, ``groups``): decades when they do both, else the 1-2-5 (then
    1..9) multiples of powers of ten inside the range, else evenly spaced values."""
    if not (lo > 0 and hi > lo and math.isfinite(hi)):
        return
    decades = _log_ticks(lo, hi, (1,))
    if len(decades) >= 2 and not _unlabelled_data(decades, groups):
        return
    ticks = []
    for subs in ((1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = _log_ticks(lo, hi, subs)
        if len(ticks) >= 2 and not _unlabelled_data(ticks, groups):
            break
    if len(ticks) < 2:
        ticks = [t for t in ticker.MaxNLocator(nbins=3, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi) if lo <= t <= hi]
    if len(ticks) < 2:
        ticks = [lo, hi]
    axis.set_major_locator(ticker.FixedLocator(ticks))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _tick_text(v)))
    axis.set_minor_formatter(ticker.NullFormatter())


def _data_ranges(ax, which: str) -> list[tuple[float, float]]:
    """For each line, scatter and band of ``ax``: the range of its positive values along the ``which``
    axis inside the view (data coordinates; lines drawn in axes coordinates span the view)."""
    k = 0 if which == "x" else 1
    lo, hi = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    to_data = ax.transData.inverted()
    arrays = []
    for line in ax.get_lines():
        if line.get_visible() and len(line.get_xydata()):
            arrays.append(to_data.transform(line.get_transform().transform(np.asarray(line.get_xydata(), float))))
    for coll in ax.collections:
        if not coll.get_visible():
            continue
        if isinstance(coll, matplotlib.collections.PathCollection):
            offs = np.asarray(coll.get_offsets(), float)
            if offs.size:
                arrays.append(to_data.transform(coll.get_offset_transform().transform(offs)))
        elif isinstance(coll, matplotlib.collections.PolyCollection):
            for path in coll.get_paths():
                if len(path.vertices):
                    arrays.append(to_data.transform(coll.get_transform().transform(path.vertices)))
    ranges = []
    for xy in arrays:
        v = xy[:, k]
        v = v[np.isfinite(v) & (v > 0) & (v >= lo * (1 - 1e-9)) & (v <= hi * (1 + 1e-9))]
        if v.size:
            ranges.append((float(v.min()), float(v.max())))
    return ranges


def _legend_outside(ax):
    handles, labels = ax.get_legend_handles_labels()
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    return ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _inside(bbox, pts: np.ndarray) -> np.ndarray:
    return (pts[:, 0] > bbox.x0) & (pts[:, 0] < bbox.x1) & (pts[:, 1] > bbox.y0) & (pts[:, 1] < bbox.y1)


def _data_points(ax) -> list[np.ndarray]:
    """Display coordinates of what is plotted in ``ax``: points along every line (segments
    subdivided), scatter markers; filled areas and images are returned as artists to test."""
    out = []
    for line in ax.get_lines():
        if not line.get_visible():
            continue
        xy = np.asarray(line.get_xydata(), float)
        xy = xy[np.isfinite(xy).all(axis=1)]
        if xy.size == 0:
            continue
        pts = line.get_transform().transform(xy)
        if len(pts) > 1 and line.get_linestyle() not in ("None", "none", "", " "):
            t = np.linspace(0.0, 1.0, 25)[:, None]
            pts = np.concatenate([a + t * (b - a) for a, b in zip(pts[:-1], pts[1:])])
        out.append(pts)
    for coll in ax.collections:
        if not coll.get_visible() or not isinstance(coll, matplotlib.collections.PathCollection):
            continue
        offs = np.asarray(coll.get_offsets(), float)
        if offs.size:
            out.append(coll.get_offset_transform().transform(offs))
    return out


def _legend_overlaps(ax, leg) -> bool:
    """Whether the legend's box covers a plotted point, line, band or image of ``ax``."""
    box = leg.get_window_extent()
    axbox = ax.get_window_extent()
    if box.x1 <= axbox.x0 or box.x0 >= axbox.x1 or box.y1 <= axbox.y0 or box.y0 >= axbox.y1:
        return False  # outside the axes
    if ax.images or any(isinstance(c, matplotlib.collections.QuadMesh) for c in ax.collections):
        return True  # a map fills the axes: any legend inside covers it
    if any(_inside(box, p).any() for p in _data_points(ax)):
        return True
    gx, gy = np.meshgrid(np.linspace(box.x0, box.x1, 7), np.linspace(box.y0, box.y1, 5))
    grid = np.column_stack([gx.ravel(), gy.ravel()])
    for coll in ax.collections:
        if isinstance(coll, matplotlib.collections.PolyCollection) and coll.get_visible():
            for path in coll.get_paths():
                if path.contains_points(grid, transform=coll.get_transform()).any():
                    return True
    return False


def finalize(fig) -> None:
    """Make a figure readable before it is saved: at least two labelled ticks on every log axis, and
    legends moved off the data (to the right of their axes). Idempotent."""
    fig.canvas.draw()
    for ax in fig.axes:
        if not ax.get_visible() or not ax.axison or _is_colorbar(ax) or ax.name != "rectilinear":
            continue
        for which, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            if (ax.get_xscale() if which == "x" else ax.get_yscale()) != "log":
                continue
            lim = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
            if getattr(axis, "_meanfield_counts", False):
                _widen_count_axis(ax, which, *lim)
            else:
                _fix_log_axis(axis, *lim, _data_ranges(ax, which))
    fig.canvas.draw()
    moved = False
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is not None and leg.get_visible() and _legend_overlaps(ax, leg):
            _legend_outside(ax)
            moved = True
    if moved:
        fig.canvas.draw()


def _labelled(axis, ax, which: str) -> list[float]:
    """Positions of the visible, labelled ticks of ``axis`` inside its view."""
    lo, hi = sorted(axis.get_view_interval())
    where = []
    for t in axis.get_ticklabels(which="both"):
        if not t.get_visible() or not t.get_text().strip():
            continue
        pos = t.get_position()[0 if which == "x" else 1]
        if lo - 1e-12 * abs(lo) <= pos <= hi + 1e-12 * abs(hi):
            where.append(pos)
    return where


def check_figure(fig) -> list[str]:
    """What would make a reader stumble: every visible axis (the long one of a colour bar) with fewer
    than two labelled ticks, a log axis with no labelled tick within a factor 2 of a plotted curve,
    every legend that covers plotted data, legends that overlap each other.
    An empty list when none."""
    fig.canvas.draw()
    problems = []
    for k, ax in enumerate(fig.axes):
        if not ax.get_visible() or not ax.axison or ax.name != "rectilinear":
            continue
        name = ax.get_title() or ax.get_label() or f"axes {k}"
        axes_to_check = [("x", ax.xaxis), ("y", ax.yaxis)]
        if _is_colorbar(ax):
            long = "y" if ax._colorbar.orientation == "vertical" else "x"
            axes_to_check = [(w, a) for w, a in axes_to_check if w == long]
        for which, axis in axes_to_check:
            if not axis.get_visible():
                continue
            ticks = _labelled(axis, ax, which)
            if len(ticks) < 2:
                problems.append(f"{name!r}: {which} axis has {len(ticks)} labelled tick(s)")
            if axis.get_scale() == "log" and not _is_colorbar(ax):
                for a, b in _unlabelled_data(ticks, _data_ranges(ax, which)):
                    problems.append(f"{name!r}: no labelled tick on the log {which} axis within a factor "
                                    f"{_NEAR:g} of data in [{a:.3g}, {b:.3g}]")
        leg = ax.get_legend()
        if leg is not None and leg.get_visible() and _legend_overlaps(ax, leg):
            problems.append(f"{name!r}: the legend covers plotted data")
        for leg in fig.legends:
            if leg.get_visible() and _legend_overlaps(ax, leg):
                problems.append(f"{name!r}: the figure's legend covers plotted data")
    boxes = [leg.get_window_extent() for leg in fig.legends if leg.get_visible()]
    boxes += [ax.get_legend().get_window_extent() for ax in fig.axes
              if ax.get_legend() is not None and ax.get_legend().get_visible()]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1:
                problems.append("two legends overlap")
    return problems
