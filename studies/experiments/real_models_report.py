"""Figures and markdown tables of the real-model study (:mod:`studies.experiments.real_models`).

One figure and one table per experiment of the paper: real text against n (Section 5.1, both maps),
the fitted exponents, Proposition 3.4's witness on the real layer (Section 5.2), gamma R^2 per layer
and head (Appendix C.5, Figure 2), token radius against position and length (Appendix E.2).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
from scipy import stats

from .. import plotting as P
from ..io import save_figure

log = logging.getLogger("studies.experiments.real_models")

__all__ = ["plot_all", "notes"]

#: the growth rate on real text the sources state: n^(1/4) (the paper's Section 5.3, about its Figure 1: "close
#: to n^(1/4)", smaller than the worst case sqrt(n); the authors' slides: "growth in C n^(1/4) for real data").
#: Neither gives a fitted exponent (docs/studies/real_models.md, "What the sources say").
PAPER_EXPONENT = 0.25
#: "n << exp(2 gamma R^2)" read as exp(2 gamma R^2) >= REGIME_MARGIN n (the witnesses' regime: REGIME_FACTOR)
REGIME_MARGIN = 1000
MAP_STYLE = {"attention": dict(color=P.COLORS[0], marker="o", name="attention alone"),
             "block": dict(color=P.COLORS[1], marker="s", name="whole block (LayerNorm(X + attention))")}


def _models(rows):
    return list(dict.fromkeys(r["model"] for r in rows))


def _modes(rows, model):
    return list(dict.fromkeys(r["mode"] for r in rows if r["model"] == model))


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label.lower()).strip("_")


def _log_ticks(ax, axis: str = "both"):
    """Plain numbers on log axes (1, 2, 5 steps), also when a range spans less than a decade."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def fmt(v, _):
        return f"{v:g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.0e}"
    for which in ("x", "y") if axis == "both" else (axis,):
        a = getattr(ax, f"{which}axis")
        if getattr(ax, f"get_{which}scale")() != "log":
            continue
        lo, hi = getattr(ax, f"get_{which}lim")()
        subs = (1.0,) if hi / lo > 200 else (1.0, 2.0, 5.0)
        decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
        if sum(lo <= s * 10.0 ** e <= hi for e in decades for s in subs) < 3:
            subs = tuple(float(k) for k in range(1, 10))   # a short range: label every integer step
        a.set_major_locator(LogLocator(base=10, subs=subs))
        a.set_major_formatter(FuncFormatter(fmt))
        a.set_minor_formatter(NullFormatter())


def _pow2_ticks(ax, ns):
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    ax.xaxis.set_major_locator(FixedLocator(sorted(set(ns))))
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


# ---------------------------------------------------------------------- figures
def plot_real_text(out_dir: Path, lip, fits, model: str) -> str:
    """Section 5.1: Lip against n for every layer (columns) and mode (rows), both maps; every sequence
    as a faint point, the mean over sequences with its spread (min-max bar), the fitted power law."""
    rows = [r for r in lip if r["model"] == model and r["converged"]]
    modes = _modes(rows, model)
    layers = sorted({r["layer"] for r in rows})
    fig, axes = P.figure(ncols=len(layers), nrows=len(modes), width=2.6 * len(layers) + 0.6,
                         height=2.7 * len(modes) + 0.8)
    axes = np.atleast_1d(axes).reshape(len(modes), len(layers))
    ns = sorted({r["n"] for r in rows})
    for a, mode in enumerate(modes):
        for b, layer in enumerate(layers):
            ax = axes[a, b]
            title = [f"{mode}, layer {layer}"]
            for m, st in MAP_STYLE.items():
                sel = [r for r in rows if r["mode"] == mode and r["layer"] == layer and r["map"] == m]
                if not sel:
                    continue
                x = np.array([r["n"] for r in sel], float)
                y = np.array([r["lip"] for r in sel])
                jitter = 1.04 if m == "block" else 1 / 1.04     # the two maps side by side at each n
                ax.scatter(x * jitter, y, s=12, color=st["color"], alpha=0.45, lw=0, marker=st["marker"])
                xs = sorted(set(x))
                mean = np.array([y[x == v].mean() for v in xs])
                lo = np.array([y[x == v].min() for v in xs])
                hi = np.array([y[x == v].max() for v in xs])
                ax.errorbar(np.array(xs) * jitter, mean, yerr=[mean - lo, hi - mean], color=st["color"],
                            marker=st["marker"], ms=4, lw=1.2, capsize=2, label=st["name"])
                f = next((f for f in fits if f["model"] == model and f["mode"] == mode and f["layer"] == layer
                          and f["map"] == m), None)
                if f:
                    nn = np.array([min(xs), max(xs)], float)
                    ax.plot(nn, np.exp(f["intercept"]) * nn ** f["slope"], color=st["color"], ls="--", lw=0.9)
                    title.append(f"{m}: n^{f['slope']:.2f}")
            P.finish(ax, "sequence length n" if a == len(modes) - 1 else "",
                     "Lip_X on real text" if b == 0 else "", logx=True, logy=True, legend=False)
            ax.set_title("\n".join([title[0], ", ".join(title[1:])]), fontsize=8)
            _pow2_ticks(ax, ns)
            _log_ticks(ax, "y")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    per_n = max((sum(1 for r in rows if r["n"] == n and r["mode"] == modes[0] and r["layer"] == layers[0]
                     and r["map"] == "attention") for n in ns), default=0)
    points = ("faint points: every sequence, here the bar ends" if per_n <= 2 else "faint points: every sequence")
    fig.legend(handles, labels, loc="outside lower center", ncol=3,
               fontsize=8, title=f"{model}: mean over sequences (bars: min-max; {points}; dashed: fitted power law)",
               title_fontsize=8)
    name = f"real_text_{_slug(model)}.png"
    save_figure(fig, out_dir / name)
    return name


def family_wise_half_width(fit: dict, layers: int, level: float = 0.95) -> float:
    """Half-width of a paired-exponent fit's interval at the family-wise ``level`` over ``layers`` layers
    (Bonferroni: each layer at 1 - (1 - level) / layers), the interval the block claims decide with and the
    figure draws (t quantile on the fit's ``points`` - 2 degrees of freedom, times its ``stderr``)."""
    q = 1 - (1 - level) / 2 / max(layers, 1)
    return float(stats.t.ppf(q, fit["points"] - 2) * fit["stderr"])


def plot_exponents(out_dir: Path, fits, map_fits=()) -> str:
    """Fitted exponents with 95% CIs per layer: both maps, every mode, each model its panel; below, per model,
    the paired exponent of Lip(block) / Lip(attention) (the claim that tells the two maps apart: the maps'
    own CIs may overlap where the paired one, free of the sequences' common variation, excludes 0)."""
    models = _models(fits)
    paired = [m for m in models if any(f["model"] == m for f in map_fits)]
    rows = 2 if paired else 1
    fig, axes = P.figure(ncols=len(models), nrows=rows, width=4.6 * len(models) + 1.5, height=3.8 * rows)
    axes = np.array(np.atleast_1d(axes), dtype=object).reshape(rows, len(models))
    for ax, model in zip(axes[1] if rows == 2 else (), models):
        sel = [f for f in map_fits if f["model"] == model]
        modes = list(dict.fromkeys(f["mode"] for f in sel))
        for k, mode in enumerate(modes):
            fs = sorted((f for f in sel if f["mode"] == mode), key=lambda f: f["layer"])
            x = np.array([f["layer"] for f in fs]) + (k - (len(modes) - 1) / 2) * 0.25
            y = np.array([f["slope"] for f in fs])
            err = [y - np.array([f["lo"] for f in fs]), np.array([f["hi"] for f in fs]) - y]
            # thin bars: the family-wise interval over the layers (Bonferroni), the one the claim decides with;
            # thick bars inside: each layer's own 95% CI
            half = np.array([family_wise_half_width(f, len(fs)) for f in fs])
            ax.errorbar(x, y, yerr=half, ls="none", marker="D", ms=5, capsize=3, elinewidth=0.9, color="C2",
                        mfc="white" if mode == "decoder" else "C2", label=f"{mode}: block / attention")
            ax.errorbar(x, y, yerr=err, ls="none", marker="none", elinewidth=3, alpha=0.45, color="C2")
        ax.axhline(0, color="k", lw=1, ls="--", label="0: the maps grow alike")
        ax.set_xticks(sorted({f["layer"] for f in sel}))
        n_layers = len({f["layer"] for f in sel})
        P.finish(ax, "layer", "exponent of Lip(block) / Lip(attention)",
                 f"{model}: paired exponent; thick bars: 95% CI per layer,\nthin: family-wise 95% over the "
                 f"{n_layers} layers (decides; off 0 = told apart)", legend=False)
        ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    for ax, model in zip(axes[0], models):
        sel = [f for f in fits if f["model"] == model]
        keys = list(dict.fromkeys((f["mode"], f["map"]) for f in sel))
        layers = sorted({f["layer"] for f in sel})
        width = 0.7 / max(len(keys), 1)
        for k, (mode, m) in enumerate(keys):
            fs = sorted((f for f in sel if f["mode"] == mode and f["map"] == m), key=lambda f: f["layer"])
            x = np.array([f["layer"] for f in fs]) + (k - (len(keys) - 1) / 2) * width
            y = np.array([f["slope"] for f in fs])
            err = [y - np.array([f["lo"] for f in fs]), np.array([f["hi"] for f in fs]) - y]
            st = MAP_STYLE[m]
            ax.errorbar(x, y, yerr=err, ls="none", marker=st["marker"], ms=5, capsize=3,
                        color=st["color"], mfc="white" if mode == "decoder" else st["color"],
                        label=f"{mode}, {'attention' if m == 'attention' else 'block'}")
        ax.axhline(0.5, color="k", ls="--", lw=1, label="0.5: worst case sqrt(n) (Thm 3.3)")
        ax.axhline(PAPER_EXPONENT, color="gray", ls=":", lw=1.2, label="1/4: the paper's rate on real text")
        ax.axhline(0, color="gray", lw=0.6)
        ax.set_xticks(layers)
        P.finish(ax, "layer", "exponent of Lip vs n (95% CI)", model, legend=False)
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    save_figure(fig, out_dir / "exponents.png")
    return "exponents.png"


def plot_adversarial(out_dir: Path, adv, model: str) -> str:
    """Section 5.2: the real layer at Proposition 3.4's witness of its head of largest gamma (real mean
    radius), the head alone with V = I, the proposition's lower bound, and sqrt(n) for reference."""
    rows = [r for r in adv if r["model"] == model]
    modes = _modes(rows, model)
    layers = sorted({r["layer"] for r in rows})
    fig, axes = P.figure(ncols=len(layers), nrows=len(modes), width=2.6 * len(layers) + 0.6,
                         height=2.7 * len(modes) + 0.9)
    axes = np.atleast_1d(axes).reshape(len(modes), len(layers))
    for a, mode in enumerate(modes):
        for b, layer in enumerate(layers):
            ax = axes[a, b]
            here = [r for r in rows if r["mode"] == mode and r["layer"] == layer]
            which = "real" if any(r["radius"] == "real" for r in here) else "scaled"
            for h in sorted({r["head"] for r in here if r["head_rank"] > 0}):
                sel = sorted((r for r in here if r["head"] == h and r["radius"] == which), key=lambda r: r["n"])
                ax.plot([r["n"] for r in sel], [r["lip_layer"] for r in sel], color="gray", lw=0.5, alpha=0.6,
                        label="real layer, other heads' witnesses")
            top = sorted((r for r in here if r["head_rank"] == 0 and r["radius"] == which), key=lambda r: r["n"])
            if not top:
                ax.set_visible(False)
                continue
            n = np.array([r["n"] for r in top], float)
            P.measured(ax, n, [r["lip_layer"] for r in top], "real layer (V, W_O, biases, all heads)",
                       color=P.COLORS[3])
            P.measured(ax, n, [r["lip_head"] for r in top], "head alone, V = I", color=P.COLORS[2], marker="^",
                       ls="--", ms=3)
            P.theory(ax, n, [r["lower"] for r in top], "Prop 3.4 lower bound (V = I)", color="k", kind="lower")
            ref = top[-1]["lip_layer"] * np.sqrt(n / n[-1])
            ax.plot(n, ref, color=P.COLORS[3], ls=(0, (1, 3)), lw=1, label="sqrt(n) through the last point")
            P.finish(ax, "sequence length n" if a == len(modes) - 1 else "", "Lip at the witness" if b == 0 else "",
                     logx=True, logy=True, legend=False)
            t = top[0]
            ax.set_title(f"{mode}, layer {layer}, head {t['head']}\nR = {t['R']:.3g} ({which}), "
                         f"gamma R^2 = {t['gamma_R2']:.3g}", fontsize=8)
            _pow2_ticks(ax, [v for v in n if v in (2, 8, 32, 128, 512)] or n)
            _log_ticks(ax, "y")
    handles, labels = {}, []
    for ax in axes.flat:
        for hd, lb in zip(*ax.get_legend_handles_labels()):
            if lb not in handles:
                handles[lb] = hd
                labels.append(lb)
    fig.legend([handles[k] for k in labels], labels, loc="outside lower center", ncol=3, fontsize=8,
               title=f"{model}: Proposition 3.4's witness of each layer's head of largest gamma", title_fontsize=8)
    name = f"adversarial_{_slug(model)}.png"
    save_figure(fig, out_dir / name)
    return name


def plot_gamma(out_dir: Path, gamma) -> str:
    """Appendix C.5 / Figure 2: gamma_h R^2 per layer and head (log colour scale), values written in."""
    from matplotlib.colors import LogNorm

    keys = list(dict.fromkeys((r["model"], r["mode"]) for r in gamma))
    heads = sorted({r["head"] for r in gamma})
    fig, axes = P.figure(ncols=len(keys), width=max(4.2, 0.5 * len(heads) + 1.8) * len(keys),
                         height=max(3.0, 0.45 * len({r['layer'] for r in gamma}) + 1.6))
    axes = list(np.atleast_1d(axes))
    for ax, (model, mode) in zip(axes, keys):
        sel = [r for r in gamma if r["model"] == model and r["mode"] == mode]
        layers = sorted({r["layer"] for r in sel})
        Z = np.full((len(layers), len(heads)), np.nan)
        for r in sel:
            Z[layers.index(r["layer"]), heads.index(r["head"])] = r["gamma_R2"]
        pos = Z[np.isfinite(Z) & (Z > 0)]
        norm = LogNorm(vmin=pos.min(), vmax=max(pos.max(), pos.min() * 1.01)) if pos.size else None
        mesh = ax.pcolormesh(heads, layers, np.where(Z > 0, Z, np.nan), shading="nearest", norm=norm,
                             cmap="viridis")
        cb = fig.colorbar(mesh, ax=ax)
        cb.set_label("gamma_h R^2")
        if len(heads) * len(layers) <= 160:
            mid = math.sqrt(pos.min() * pos.max()) if pos.size else 0
            for i, layer in enumerate(layers):
                for j, h in enumerate(heads):
                    if np.isfinite(Z[i, j]):
                        # whole numbers from 10 on ("120", not "1.2e+02"): three characters fit a cell at 8 pt
                        label = f"{Z[i, j]:.0f}" if Z[i, j] >= 10 else f"{Z[i, j]:.2g}"
                        ax.text(h, layer, label, ha="center", va="center", fontsize=8,
                                color="white" if Z[i, j] < mid else "black")
        ax.set_xticks(heads)
        ax.set_yticks(layers)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.grid(False)
        ax.set_title(f"{model} {mode}: gamma_h R^2, R = mean radius of the layer's inputs", fontsize=9)
    save_figure(fig, out_dir / "gamma_R2.png")
    return "gamma_R2.png"


def plot_radius(out_dir: Path, radius, lip) -> str:
    """Appendix E.2: token radius against position (mean over the longest sequences, bars = 10-90% of the tokens
    of each octave of positions)
    and mean radius of a sequence against its length (mean over sequences, bars = min-max)."""
    keys = list(dict.fromkeys((r["model"], r["mode"]) for r in radius))
    fig, axes = P.figure(ncols=2, nrows=len(keys), width=12, height=3.2 * len(keys) + 0.3)
    axes = np.atleast_1d(axes).reshape(len(keys), 2)
    for a, (model, mode) in enumerate(keys):
        rad = [r for r in radius if r["model"] == model and r["mode"] == mode]
        layers = sorted({r["layer"] for r in rad})
        ax = axes[a, 0]
        for c, layer in enumerate(layers):
            sel = sorted((r for r in rad if r["layer"] == layer), key=lambda r: r["position"])
            pos = np.array([r["position"] for r in sel])
            m = np.array([r["radius_mean"] for r in sel])
            # octaves of positions (1, 2, 3-4, 5-8, ...): the mean radius there, band = spread over its tokens
            edges = [1, 2, *[2 ** k + 1 for k in range(1, int(math.log2(max(pos[-1], 2))) + 1)], pos[-1] + 1]
            edges = sorted(set(e for e in edges if e <= pos[-1] + 1))
            centre, mean, lo, hi = [], [], [], []
            for e0, e1 in zip(edges[:-1], edges[1:]):
                v = m[(pos >= e0) & (pos < e1)]
                if v.size:
                    centre.append(math.sqrt(e0 * (e1 - 1)))
                    mean.append(v.mean())
                    lo.append(np.percentile(v, 10))
                    hi.append(np.percentile(v, 90))
            # the 10-90% spread as bars, each layer's shifted a little along the (log) axis: six overlapping
            # bands hid one another
            shift = 1.06 ** (c - (len(layers) - 1) / 2)
            x = np.array(centre) * shift
            mean, lo, hi = np.array(mean), np.array(lo), np.array(hi)
            ax.errorbar(x, mean, yerr=[mean - lo, hi - mean], color=P.COLORS[c % 10], marker="o", ms=3, lw=1.2,
                        elinewidth=0.8, capsize=1.5, label=f"layer {layer}")
        seqs = rad[0]["sequences"] if rad else 0
        P.finish(ax, "token position i (octaves 1, 2, 3-4, 5-8, ...)", "mean |x_i| at the attention input",
                 f"{model} {mode}: radius by position\n({seqs} sequences of {rad[0]['n'] if rad else 0} tokens; "
                 "bars: 10-90% per octave)", logx=True, legend=False)
        _log_ticks(ax, "x")
        ax = axes[a, 1]
        seq = [r for r in lip if r["model"] == model and r["mode"] == mode and r["map"] == "attention"]
        for c, layer in enumerate(layers):
            sel = [r for r in seq if r["layer"] == layer]
            ns = sorted({r["n"] for r in sel})
            vals = [np.array([r["r_mean"] for r in sel if r["n"] == n]) for n in ns]
            mean = np.array([v.mean() for v in vals])
            ax.errorbar(ns, mean, yerr=[mean - [v.min() for v in vals], [v.max() for v in vals] - mean],
                        color=P.COLORS[c % 10], marker="o", ms=3, lw=1, capsize=2, label=f"layer {layer}")
        P.finish(ax, "sequence length n", "mean |x_i| of a sequence",
                 f"{model} {mode}: mean radius vs length\n(bars: min-max over sequences)",
                 logx=True, legend=False)
        if seq:
            _pow2_ticks(ax, [r["n"] for r in seq])
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    save_figure(fig, out_dir / "radius.png")
    return "radius.png"


def _caption_real_text(model: str) -> str:
    return (f"{model} on real text: the certified local constant Lip_X of the attention alone (blue) and of the "
            "whole block LayerNorm(X + attention(X)) (orange) against the sequence length n, one panel per layer "
            "and mode (top row encoder, bottom row causal decoder, where the mode was measured); points are means "
            "over sequences, bars their range, dashed lines the fitted power laws whose exponents the panel titles "
            "give. The real-text claims read these exponents: a trained layer's should lie in (0, 0.5), below "
            "Theorem 3.3's worst case sqrt(n); the paper saw about n^(1/4). A panel whose points are flat and then "
            "jump (a length past the model's training length) is no power law, whatever its fitted exponent.")


def _caption_adversarial(model: str) -> str:
    return (f"{model} at Proposition 3.4's witness (the adversarial sequence built for each layer's head of "
            "largest gamma, at the radius of the layer's real inputs): the real layer with all its heads, V, W_O "
            "and biases (red) against the head alone with V = I (green) and the proposition's lower bound (black "
            "dotted line, under the green curve), which the green curve must meet; the red dotted line is sqrt(n) "
            "through the last point. The "
            "witness claims ask whether the real layer too grows like sqrt(n) there: where the red curve bends "
            "away from the dotted line, it does not.")


CAPTION_EXPONENTS = (
    "Top: each layer's fitted real-text exponent with its 95% interval (filled markers encoder, open decoder; "
    "circles the attention alone, squares the block), against 0.5 (Theorem 3.3's worst case) and 1/4 (the "
    "paper's rate on real text); the real-text claims need every interval inside (0, 0.5). Bottom: the paired "
    "exponent of Lip(block) / Lip(attention), fitted over the same sequences, per layer. The block claims decide "
    "with the thin bars (a family-wise 95% level over the layers, Bonferroni): a thin bar off 0 tells the two "
    "maps apart at that layer; the thick bars, each layer's own 95% interval, may leave 0 by chance at one "
    "layer in several.")

CAPTION_GAMMA = (
    "gamma_h R^2 of every head (columns) of every layer (rows), one heatmap per mode (encoder left, decoder right), R "
    "the mean radius of the layer's real inputs and gamma_h = max(lambda_max / 8, -lambda_min) of the head's "
    "query-key matrix A_h (Proposition 3.4). The sqrt(n) regime of Proposition 3.4 holds while n << exp(2 gamma "
    "R^2): the gamma claims take the largest 2 gamma_h "
    "R^2 of each layer, and the report's paragraph on this figure counts the heads where it is small.")

CAPTION_RADIUS = (
    "Left: the mean radius |x_i| of the attention's inputs by token position, over octaves of positions (1, 2, "
    "3-4, 5-8, ...), bars 10-90% of the tokens there, each layer's bars shifted a little to the right of the "
    "previous one's. Right: the mean radius of a sequence against its length (bars: range over sequences). "
    "The paper's Appendix E.2 takes R from these radii; a radius that grew with n would add to the growth of "
    "the constants in the real-text figure, so read the right panels' trends beside its exponents.")


def plot_all(out_dir: Path, tables: dict, fits: list, adv_fits: list, map_fits=()) -> dict[str, str]:
    """Every figure of the study; returns their file names, each with its caption (the report prints it)."""
    out_dir = Path(out_dir)
    lip, adv = tables["lipschitz"], tables["adversarial"]
    jobs = [(f"real text, {m}", lambda m=m: plot_real_text(out_dir, lip, fits, m), _caption_real_text(m))
            for m in _models(lip)]
    if fits:
        jobs.append(("exponents", lambda: plot_exponents(out_dir, fits, map_fits), CAPTION_EXPONENTS))
    jobs += [(f"adversarial inputs, {m}", lambda m=m: plot_adversarial(out_dir, adv, m), _caption_adversarial(m))
             for m in _models(adv)]
    if tables["gamma"]:
        jobs.append(("gamma of every head", lambda: plot_gamma(out_dir, tables["gamma"]), CAPTION_GAMMA))
    if tables["radius"]:
        jobs.append(("radii of the inputs", lambda: plot_radius(out_dir, tables["radius"], lip), CAPTION_RADIUS))
    figs = {}
    for k, (what, draw, caption) in enumerate(jobs):   # a few seconds each: one line per figure
        log.info("real_models: figure %d of %d (%s)", k + 1, len(jobs), what)
        figs[draw()] = caption
    return figs


# ---------------------------------------------------------------------- tables
def _ci(f) -> str:
    return f"{f['slope']:.2f} [{f['lo']:.2f}, {f['hi']:.2f}]" if f else "n/a"


def _table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def notes(measured, failed, why, corpus, g, tables, fits, adv_fits, map_fits=()) -> str:
    """The study's markdown section: models, then one table per experiment (the figures follow).
    ``map_fits``: per layer, the paired exponent of Lip(block) / Lip(attention)."""
    lines = [f"**Models measured** ({why}):", ""]
    lines += _table(["model", "mode", "weights", "provenance", "d, heads", "layers", "maps", "tokenizer"],
                    [[m["model"], m["mode"], "**trained**" if m["trained"] else "random init (not evidence about "
                      "trained models)", m["provenance"] + (f", version {m['package_version']}, sha256 "
                                                            f"{m['archive_sha256'][:12]}" if "package_version" in m
                                                            else ""),
                      f"{m['d']}, {m['heads']}", str(m["layers"]), m["dtype"], m["tokenizer"]] for m in measured])
    if failed:
        lines += ["**Failed models** (the others' results are kept):", ""]
        lines += [f"- {f['model']}: `{f['error']}`" for f in failed] + [""]
    lines += [f"Text: {corpus['source']} ({corpus['characters']} characters, sha256 {corpus['sha256'][:12]}), "
              f"tokenized once without special tokens and cut into {g['reps']} non-overlapping sequences per length "
              f"n in {g['ns']} (Section 5.1). Constants certified (Lanczos residual) to "
              f"{'1e-3' if g['dtype'] == 'float32' else '1e-6'} relative; maps in {g['dtype']} (the certificate is "
              f"about the map the {g['dtype']} model computes); Proposition 3.4's head checks in float64 (1e-6). "
              "*Attention* is the paper's map W_O concat_h f_h + bias; *block* is the whole "
              "Hugging Face attention block (BERT: LayerNorm(X + attention(X)); GPT-2: X + attention(ln_1(X))).",
              ""]
    lip = tables["lipschitz"]
    for model in _models(fits):
        sel = [f for f in fits if f["model"] == model]
        modes = list(dict.fromkeys(f["mode"] for f in sel))
        lines += [f"*Real-text exponents, {model}* (log-log fit of Lip against n over every sequence, 95% CI; "
                  "worst case 0.5; the paper's rate on real text n^(1/4)); *block - attention* is the exponent of "
                  "Lip(block) / Lip(attention), paired over the same sequences:", ""]
        rows = []
        for layer in sorted({f["layer"] for f in sel}):
            cells = []
            for mode in modes:
                for m in ("attention", "block"):
                    f = next((f for f in sel if f["layer"] == layer and f["mode"] == mode and f["map"] == m), None)
                    cells.append(_ci(f))
                cells.append(_ci(next((f for f in map_fits if f["model"] == model and f["mode"] == mode
                                       and f["layer"] == layer), None)))
            rows.append([layer, *cells])
        lines += _table(["layer", *[f"{mode} {m}" for mode in modes for m in ("attention", "block",
                                                                           "block - attention")]], rows)
    adv = tables["adversarial"]
    tail = {(f["model"], f["mode"], f["layer"], f["head"], f["radius"]): f for f in adv_fits if f["range"] == "tail"}
    full = {(f["model"], f["mode"], f["layer"], f["head"], f["radius"]): f for f in adv_fits if f["range"] == "all"}
    if adv:
        lines += ["*Proposition 3.4's witness on the real layer* (head of largest gamma; exponent of the real layer "
                  "over n >= n_max/8 and over n >= 4, Proposition 3.4's curve over the same top n; constants at "
                  "n_max):", ""]
        rows = []
        for r in sorted((r for r in adv if r["head_rank"] == 0 and r["n"] == max(x["n"] for x in adv)),
                        key=lambda r: (r["model"], r["mode"], r["layer"], r["radius"])):
            k = (r["model"], r["mode"], r["layer"], r["head"], r["radius"])
            rows.append([r["model"], r["mode"], r["layer"], r["head"], f"{r['R']:.3g} ({r['radius']})",
                         f"{r['gamma_R2']:.3g}", _ci(tail.get(k)),
                         f"{tail[k]['predicted_slope']:.3f}" if k in tail else "n/a",
                         tail[k].get("verdict", "") if k in tail else "n/a", _ci(full.get(k)),
                         f"{r['lip_layer']:.4g}", f"{r['lip_head']:.4g}", f"{r['lower']:.4g}",
                         f"{r['layer_upper'] / r['lip_layer']:.3g}"])
        lines += _table(["model", "mode", "layer", "head", "R", "gamma R^2", "exponent (top n)", "Prop 3.4 slope",
                         "verdict", "exponent (n >= 4)", "Lip layer", "Lip head (V=I)", "Prop 3.4 lower",
                         "Lemma 3.8 bound / Lip"], rows)
        lines += ["*Verdict*: agree when the exponent's 95% CI lies within 0.05 of Proposition 3.4's slope, disagree "
                  "when it lies entirely further away, inconclusive when it straddles (too wide to decide).", ""]
        n_top = max(x["n"] for x in adv)
        top = [r for r in adv if r["head_rank"] == 0 and r["n"] == n_top]
        if top and max((n_top - 1) * math.exp(-2 * r["gamma_R2"]) for r in top) < 1e-9:
            g2 = min(2 * r["gamma_R2"] for r in top)
            lines += [f"The *Prop 3.4 lower* column is sqrt(n_max - 1) = sqrt({n_top - 1}) = "
                      f"{math.sqrt(n_top - 1):.4g} in every row: the bound is sqrt(n - 1) / (1 + (n - 1) "
                      f"e^(-2 gamma R^2)), and with 2 gamma R^2 >= {g2:.3g} the second factor is 1 to within "
                      "1e-9, so the bound no longer depends on the head. Where *Lip head (V=I)* equals it, the "
                      "witness attains the bound (case 'min', docs/math.md section 5.3).", ""]
        others = [f for f in adv_fits if f["range"] == "tail" and f["head_rank"] > 0]
        if others:
            s = np.array([f["slope"] for f in others])
            lines += [f"Every other head's witness on its real layer ({len(others)} fits over the top n): exponent "
                      f"median {np.median(s):.3f}, range [{s.min():.3f}, {s.max():.3f}].", ""]
    gam = tables["gamma"]
    if gam:
        lines += ["*gamma_h R^2 per layer* (Appendix C.5; R = mean radius of the layer's real inputs):", ""]
        rows = []
        for (model, mode) in dict.fromkeys((r["model"], r["mode"]) for r in gam):
            for layer in sorted({r["layer"] for r in gam if r["model"] == model and r["mode"] == mode}):
                sel = [r for r in gam if r["model"] == model and r["mode"] == mode and r["layer"] == layer]
                v = np.array([r["gamma_R2"] for r in sel])
                top = max(sel, key=lambda r: r["gamma_R2"])
                rows.append([model, mode, layer, f"{sel[0]['R_mean']:.3g}", f"{v.min():.3g}", f"{np.median(v):.3g}",
                             f"{v.max():.3g} (head {top['head']})", f"{2 * v.max():.3g}"])
        lines += _table(["model", "mode", "layer", "R", "min", "median", "max", "2 gamma R^2 (max)"], rows)
        for (model, mode) in dict.fromkeys((r["model"], r["mode"]) for r in gam):
            sel = [r for r in gam if r["model"] == model and r["mode"] == mode]
            v = np.array([r["gamma_R2"] for r in sel])
            seen = [r["n"] for r in tables["lipschitz"] + tables["adversarial"]
                    if r["model"] == model and r["mode"] == mode]
            regime = ""
            if seen:
                n_max = max(seen)
                # n << exp(2 gamma R^2), read as exp(2 gamma R^2) >= n_max (and with the witnesses' margin, 1000 n_max)
                short = sorted((r for r in sel if 2 * r["gamma_R2"] < math.log(n_max)), key=lambda r: r["gamma_R2"])
                margin = sum(2 * r["gamma_R2"] < math.log(REGIME_MARGIN * n_max) for r in sel)
                where = ", ".join(f"L{r['layer']} head {r['head']} ({r['gamma_R2']:.3g})" for r in short[:3])
                regime = (f" exp(2 gamma_h R^2) is below the largest length n = {n_max} at {len(short)} of {len(sel)} "
                          f"heads{': ' + where if short else ''}, and below {REGIME_MARGIN} n at {margin}: at those "
                          "heads n << exp(2 gamma R^2) does not hold at every length (the witness claims use each "
                          "layer's head of largest gamma)." if margin else
                          f" exp(2 gamma_h R^2) >= {REGIME_MARGIN} n at every head for every length n <= {n_max}.")
            lines += [f"{model} {mode}: gamma_h R^2 over every head and layer has median {np.median(v):.3g} and "
                      f"maximum {v.max():.3g} (2 gamma_h R^2: {2 * np.median(v):.3g} and {2 * v.max():.3g}); the paper "
                      "reports gamma R^2 of order 10^2 to 10^3 for the pretrained BERT-base (Section 3 after "
                      "Proposition 3.4, Appendix C.5 Figure 2)." + regime, ""]
    if tables["radius"]:
        lines += ["*Token radius* (Appendix E.2): mean |x_i| of a sequence at the smallest and largest length "
                  "(mean over sequences), and at the first and last position of the longest sequences:", ""]
        rows = []
        for (model, mode) in dict.fromkeys((r["model"], r["mode"]) for r in tables["radius"]):
            for layer in sorted({r["layer"] for r in tables["radius"] if r["model"] == model}):
                seq = [r for r in lip if r["model"] == model and r["mode"] == mode and r["layer"] == layer
                       and r["map"] == "attention"]
                if not seq:
                    continue
                ns = sorted({r["n"] for r in seq})
                at = {n: np.mean([r["r_mean"] for r in seq if r["n"] == n]) for n in (ns[0], ns[-1])}
                pos = sorted((r for r in tables["radius"] if r["model"] == model and r["mode"] == mode
                              and r["layer"] == layer), key=lambda r: r["position"])
                rows.append([model, mode, layer, f"{at[ns[0]]:.3g} (n = {ns[0]})", f"{at[ns[-1]]:.3g} (n = {ns[-1]})",
                             f"{pos[0]['radius_mean']:.3g}", f"{pos[-1]['radius_mean']:.3g}"])
        lines += _table(["model", "mode", "layer", "radius, short sequences", "radius, long sequences",
                         "position 1", "last position"], rows)
    not_conv = sum(not r["converged"] for r in lip) + sum(not r["layer_converged"] for r in adv)
    if not_conv:
        lines += [f"{not_conv} estimates did not reach the tolerance (flagged in the CSV files, left out of the "
                  "fits).", ""]
    return "\n".join(lines)
