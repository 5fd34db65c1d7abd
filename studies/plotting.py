"""One figure style for every study: labelled axes, log scales for power laws, theory in the plot.

Matplotlib runs on the Agg backend (no display needed). Measured data are drawn as markers
joined by thin lines, theory curves as dashed lines (upper bounds) or dotted lines (lower
bounds and asymptotics), so a reader tells them apart in every figure of the report.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["figure", "measured", "theory", "finish", "COLORS", "heatmap"]

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


def theory(ax, x, y, label: str, color=None, kind: str = "upper", **kw):
    """A theory curve: dashed for upper bounds, dotted for lower bounds / asymptotics."""
    ls = {"upper": "--", "lower": ":", "limit": "-."}.get(kind, "--")
    kw.setdefault("lw", 1.5)
    return ax.plot(np.asarray(x, float), np.asarray(y, float), ls=ls, color=color, label=label, **kw)


def finish(ax, xlabel: str, ylabel: str, title: str = "", *, logx: bool = False, logy: bool = False,
           legend: bool = True):
    """Label the axes (always), set log scales where the claim is a power law, add the legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    from matplotlib.ticker import NullFormatter

    # minor tick labels of short log ranges overlap: label decades only
    if logx:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    return ax


def heatmap(ax, x: Sequence[float], y: Sequence[float], Z, *, xlabel: str, ylabel: str, cbar_label: str,
            title: str = "", center: float | None = None, fig=None):
    """A map of Z[i, j] at (x[j], y[i]), diverging colours around ``center`` when given."""
    Z = np.asarray(Z, float)
    kw = {}
    if center is not None:
        # a floor on the colour range: values within 1% of the centre read as "no effect"
        span = max(float(np.nanmax(np.abs(Z - center))), 0.01 * max(abs(center), 1.0))
        kw = {"cmap": "RdBu_r", "vmin": center - span, "vmax": center + span}
    mesh = ax.pcolormesh(np.asarray(x, float), np.asarray(y, float), Z, shading="nearest", **kw)
    cb = (fig or ax.figure).colorbar(mesh, ax=ax)
    cb.set_label(cbar_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(False)
    if title:
        ax.set_title(title)
    return mesh
