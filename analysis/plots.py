"""Figures of a fit as PNG (200 dpi), and SVG or PDF on request (matplotlib, Agg backend).

Budgets are coloured on one logarithmic colour scale with a colour bar rather than one legend
entry each, so the figures stay legible with any number of budgets. Run markers shrink and fade
as runs grow in number (``_point_style``: opaque up to a few hundred, faint dots at 20,000, drawn
as an image inside SVG and PDF), so the fitted lines stay visible; legends sit below the axes,
off the data, and bootstrap bands have legend entries of their own. Log axes carry labelled ticks
inside the data range however narrow it is (``LogRangeLocator``), as plain text: matplotlib's
default mathtext labels cost more time than everything else drawn here. Published laws are drawn
only where their units compare (``analysis.published.comparable``); otherwise a note lists them.
"""

from __future__ import annotations

import io
import signal
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.collections import LineCollection, PathCollection  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from analysis import akima  # noqa: E402
from analysis.compare import TITLES  # noqa: E402
from analysis.downstream import task_error  # noqa: E402
from analysis.fit_result import FitResult  # noqa: E402
from analysis.isoflop import PowerLaws  # noqa: E402
from analysis.parametric import compute_optimal, predict_loss  # noqa: E402
from analysis.allocate import form_of  # noqa: E402
from analysis.published import LAWS, PublishedLaw, comparable, listed_note  # noqa: E402
from analysis.synthetic import law_loss, law_optimum  # noqa: E402
from lab.runtime.scores import PREFIX as TASK_PREFIX  # noqa: E402

# (file stem, caption) of every figure, in report order.
FIGURES = (
    ("isoflop", "IsoFLOP profiles: loss against N per budget, the parabola fitted in each budget's window "
                "around its lowest run, its vertex and the lowest run"),
    ("allocation", "Compute-optimal N and D against C for every approach, with bootstrap bands; the published "
                   "laws of Hoffmann et al. (2022) and Besiroglu et al. (2024) are drawn only for runs on their data "
                   "set, and listed in a note otherwise"),
    ("frontier", "Loss against compute: the runs, approach 1's points and the compute-optimal frontier of approach "
                 "3 (published laws only for runs on their data set)"),
    ("contours", "L(N, D) from approach 3, with its efficient frontier and the runs (published laws' frontiers "
                 "only for runs on their data set)"),
    ("residuals", "Residuals of approach 3 in loss (nats per token): observed minus predicted"),
)
# Drawn only for sweep folders, whose runs carry their training curves.
DOWNSTREAM_FIGURE = ("downstream", "Downstream tasks: score against loss, the fitted link (Gadre et al. 2024) with "
                                   "its band, and the predicted score at each budget's compute-optimal loss")
CURVES_FIGURE = ("curves", "Training curves: loss against tokens and against FLOPs, coloured by model size N")
_DPI = 200  # PNG resolution: sharp when printed or zoomed
# Fixed margins: a layout engine would measure every tick label once more, doubling the drawing time.
# The figures that may carry a note on published laws leave room for it under the x label.
_MARGINS = {"default": {"left": 0.1, "right": 0.97, "bottom": 0.11, "top": 0.93},
            "isoflop": {"left": 0.1, "right": 1.0, "bottom": 0.25, "top": 0.94},
            "contours": {"left": 0.13, "right": 0.97, "bottom": 0.25, "top": 0.95},
            "frontier": {"left": 0.1, "right": 1.0, "bottom": 0.27, "top": 0.94},
            "allocation": {"left": 0.07, "right": 0.98, "bottom": 0.27, "top": 0.93, "wspace": 0.2},
            "residuals": {"left": 0.08, "right": 1.04, "bottom": 0.12, "top": 0.9, "wspace": 0.05},
            "curves": {"left": 0.08, "right": 1.04, "bottom": 0.12, "top": 0.9, "wspace": 0.12}}
_COLORS = {"envelope": "C2", "isoflop": "C1", "approach3": "C0"}
_STYLES = {"envelope": ":", "isoflop": "--", "approach3": "-"}
# Approach 2's dashed line is drawn wider and above approach 3's, which it often follows closely.
_WIDTHS = {"envelope": 1.6, "isoflop": 2.2, "approach3": 1.4}
_ORDER = {"envelope": 3, "isoflop": 4, "approach3": 2}
_PUBLISHED_STYLES = (("grey", (0, (5, 2))), ("black", (0, (1, 2))))


def short_number(value: float, _position: object = None) -> str:
    """A tick label: 1.6, 2, 500, 2.5e4, 1e21 (three significant figures, no '+' or leading zeros)."""
    text = f"{value:.3g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


class LogRangeLocator(ticker.Locator):
    """Major ticks of a log axis, labelled inside any data range: decades over more than three of them,
    1-2-5 steps over one to three, 1-2-3-5 steps within one, and round linear steps (1.6, 1.8, 2, ...)
    over less than a factor 3, where linear steps are still close to even on the log scale."""

    def __call__(self) -> np.ndarray:
        return self.tick_values(*self.axis.get_view_interval())

    def tick_values(self, vmin: float, vmax: float) -> np.ndarray:
        lo, hi = sorted((vmin, vmax))
        if not (lo > 0 and np.isfinite(hi)):
            return ticker.LogLocator().tick_values(vmin, vmax)
        decades = np.log10(hi / lo)
        if decades > 3:
            ticks = ticker.LogLocator(numticks=12).tick_values(lo, hi)
        elif decades > 1:
            ticks = ticker.LogLocator(subs=(1.0, 2.0, 5.0), numticks=30).tick_values(lo, hi)
        elif hi / lo > 3:
            ticks = ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0), numticks=30).tick_values(lo, hi)
        else:
            ticks = ticker.MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
        return ticks[ticks > 0]


def _log_ticks(axis: Any) -> None:
    """LogRangeLocator with plain-text labels on one log axis; unlabelled minor ticks."""
    axis.set_major_locator(LogRangeLocator())
    axis.set_major_formatter(ticker.FuncFormatter(short_number))
    axis.set_minor_locator(ticker.LogLocator(subs=(2.0, 3.0, 5.0)))
    axis.set_minor_formatter(ticker.NullFormatter())


def _plain_log(ax: plt.Axes, axes: str = "xy") -> None:
    """Labelled ticks inside the data range on the log axes named."""
    for name in axes:
        _log_ticks(ax.xaxis if name == "x" else ax.yaxis)


def _point_style(count: int) -> dict[str, Any]:
    """Marker size and opacity for ``count`` runs: opaque up to about 300, fainter and smaller beyond, so that
    lines stay visible at 20,000; rasterised inside vector files when there are many."""
    crowd = max(1.0, count / 300.0)
    return {"s": max(2.0, 14.0 / np.sqrt(crowd)), "alpha": max(0.08, 1.0 / crowd), "lw": 0,
            "rasterized": count > 2000}


def _legend_below(ax: Any, ncol: int = 2, handles: Any = None, labels: Any = None) -> None:
    """The legend under the axes (below the x label), so it never covers data; opaque entries."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    legend = ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=ncol,
                       frameon=False)
    for handle in legend.legend_handles:
        if isinstance(handle, PathCollection):  # run markers, however faint on the axes, are plain in the legend
            handle.set_alpha(1.0)
            handle.set_sizes([16.0])


def _published(result: FitResult) -> tuple[list[PublishedLaw], list[PublishedLaw]]:
    """Published laws to draw (their data set is the table's) and to list in a note instead."""
    dataset = result.table.dataset
    drawn = [law for law in LAWS if comparable(law, dataset)]
    return drawn, [law for law in LAWS if law not in drawn]


def _published_note(fig: plt.Figure, result: FitResult) -> None:
    """A line at the bottom of the figure listing the published laws that are not drawn."""
    listed = _published(result)[1]
    if listed:
        fig.text(0.01, 0.01, listed_note(listed, result.table.dataset), fontsize=6.5, color="dimgrey", wrap=True,
                 va="bottom")


def _colorbar(fig: plt.Figure, mappable: Any, ax: Any, label: str) -> None:
    """A colour bar of ``mappable``'s colours at full opacity, however faint its markers are drawn."""
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=mappable.norm, cmap=mappable.cmap), ax=ax, label=label)
    _log_ticks(bar.ax.yaxis)


def _figure(stem: str, *grid: int, **kwargs: Any) -> tuple[plt.Figure, Any]:
    """A figure with its fixed margins set before any colour bar takes its share."""
    fig, axes = plt.subplots(*grid, **kwargs)
    fig.subplots_adjust(**_MARGINS.get(stem, _MARGINS["default"]))
    return fig, axes


def _band(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = 50.0 * (1.0 - level)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # columns where every resample failed
        return np.nanpercentile(samples, tail, axis=0), np.nanpercentile(samples, 100.0 - tail, axis=0)


def _flops_range(result: FitResult) -> np.ndarray:
    top = max([result.flops_max] + [p["flops"] for p in result.predictions])
    return np.geomspace(result.table.c.min() / 1.5, top * 1.5, 120)


def _flops_norm(result: FitResult) -> LogNorm:
    c = result.table.c
    return LogNorm(vmin=c.min(), vmax=max(c.max(), c.min() * 1.01))


def plot_isoflop(result: FitResult) -> plt.Figure:
    t, b, m = result.table, result.budgets, result.minima
    norm, cmap = _flops_norm(result), plt.cm.viridis
    fig, ax = _figure("isoflop", figsize=(7.5, 5.6))
    outside = b.labels < 0
    dots = _point_style(len(t.n))
    spline = result.config.isoflop_minimum == "akima"
    if outside.any():
        colours = dict(c=t.c[outside], cmap=cmap, norm=norm) if b.continuous else dict(color="lightgrey")
        ax.scatter(t.n[outside], t.loss[outside], **colours, **dots,
                   label=None if b.continuous else "runs in no budget")
    for g in range(b.count):
        rows = np.flatnonzero(b.labels == g)
        color = cmap(norm(b.flops[g]))
        ax.scatter(t.n[rows], t.loss[rows], color=color, **dots)
        if spline:
            replicates = None if t.experiments is None else t.experiments[rows]
            sizes, lowest = akima.profile(np.log(t.n[rows]), t.loss[rows], replicates)
            if len(sizes) >= akima.MIN_SIZES:
                u, log_loss = akima.curve(sizes, lowest)
                ax.plot(np.exp(u), np.exp(log_loss[:, 0]), color=color, lw=1.4, zorder=3)
            if np.isfinite(m.spline_log_n[0, g]):
                ax.plot(np.exp(m.spline_log_n[0, g]), m.spline_loss[0, g], marker="*", ms=10, color=color,
                        mec="black", mew=0.5, ls="none", zorder=4)
        elif m.vertex_ok[0, g]:
            u = np.linspace(-m.half_width[0, g], m.half_width[0, g], 40)
            c0, c1, c2 = m.coeffs[0, g]
            ax.plot(np.exp(u + m.centre[0, g]), c0 + c1 * u + c2 * u * u, color=color, lw=1.4, zorder=3)
            ax.plot(np.exp(m.vertex_log_n[0, g]), m.vertex_loss[0, g], marker="*", ms=10, color=color,
                    mec="black", mew=0.5, ls="none", zorder=4)
        low = m.lowest_row[0, g]
        bad = not m.usable(result.config.isoflop_minimum)[0, g]
        ax.plot(t.n[low], t.loss[low], marker="x" if bad else "s", ms=8, mfc="none",
                mec="red" if bad else "black", ls="none", zorder=4)
    _colorbar(fig, plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax, "compute C (FLOPs)")
    if b.count:
        ax.plot([], [], marker="*", color="grey", mec="black", ls="none",
                label="minimum of the Akima spline" if spline else "vertex in its window")
        ax.plot([], [], marker="s", mfc="none", mec="black", ls="none", label="lowest run")
        ax.plot([], [], marker="x", mec="red", ls="none", label="minimum not located" + (
            " (at an end of the sizes)" if spline else " (edge, one-sided or outside its window)"))
    title = (f"{b.count} IsoFLOP budget(s)" if not b.continuous else
             "No IsoFLOP budgets: C is continuous (runs coloured by C)")
    ax.set(xscale="log", xlabel="parameters N", ylabel="loss (nats per token)", title=title)
    _plain_log(ax, "x")
    _legend_below(ax, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def _law_line(ax: plt.Axes, law: PowerLaws, samples: PowerLaws | None, flops: np.ndarray, which: int,
              level: float, band: bool, **style: Any) -> None:
    ax.plot(flops, law.at(flops)[which][0], **style)
    if samples is not None and band:
        lo, hi = _band(samples.at(flops)[which], level)
        ax.fill_between(flops, lo, hi, color=style.get("color"), alpha=0.15, lw=0, zorder=1,
                        label=f"{style['label']}: {level:.0%} bootstrap band")


def plot_allocation(result: FitResult) -> plt.Figure:
    flops = _flops_range(result)
    level = result.config.ci_level
    fig, axes = _figure("allocation", 1, 2, figsize=(11, 5.4))
    for which, ax in enumerate(axes):
        for key, app in result.approaches.items():
            if app.law is None:
                continue
            ok = app.identification.identified
            _law_line(ax, app.law, app.samples, flops, which, level, band=ok, color=_COLORS[key],
                      ls=_STYLES[key] if ok else (0, (1, 3)), lw=_WIDTHS[key] if ok else 1.0, zorder=_ORDER[key],
                      label=TITLES[key] + ("" if ok else " (not identified)"))
        for law, (color, style) in zip(_published(result)[0], _PUBLISHED_STYLES):
            ax.plot(flops, law_optimum(flops, law.as_dict())[which], color=color, ls=style, lw=0.9,
                    label=f"published: {law.name}")
        m = result.minima
        if m is not None and result.approaches["isoflop"].skipped is None:
            used = m.usable(result.config.isoflop_minimum)[0]
            pts_n = np.exp(m.log_n(result.config.isoflop_minimum, result.table.n)[0])
            pts = pts_n if which == 0 else m.flops / (result.table.flops_k * pts_n)
            ax.scatter(m.flops[used], pts[used], color="C1", zorder=5, s=20, label="IsoFLOP minima")
        for p in result.predictions:
            a3 = p["approach3"]
            if a3 is not None:
                ax.plot(p["flops"], a3["params"] if which == 0 else a3["tokens"], marker="D", color="C3",
                        ls="none", ms=4, zorder=6)
        ax.axvspan(result.flops_max, flops[-1], color="grey", alpha=0.08, lw=0)
        ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)",
               ylabel="N_opt (parameters)" if which == 0 else "D_opt (tokens)",
               title=("N_opt" if which == 0 else "D_opt") + "(C); shaded: beyond the data")
        _plain_log(ax)
        ax.grid(alpha=0.3)
    axes[0].plot([], [], marker="D", color="C3", ls="none", label="predictions (approach 3)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 0.045), ncol=3, frameon=False)
    _published_note(fig, result)
    return fig


def plot_frontier(result: FitResult) -> plt.Figure:
    t = result.table
    flops = _flops_range(result)
    fig, ax = _figure("frontier", figsize=(7.5, 5.6))
    for curve in t.curves[:400]:
        ax.plot(curve.flops, curve.loss, color="grey", lw=0.5, alpha=0.4)
    points = ax.scatter(t.c, t.loss, c=t.n, norm=LogNorm(), cmap="viridis", zorder=2, label="runs",
                        **_point_style(len(t.c)))
    _colorbar(fig, points, ax, "parameters N")
    k = t.flops_k
    ident = result.approaches["approach3"].identification.identified
    _, _, loss = compute_optimal(result.parametric.theta, flops, k, result.parametric.form)
    ax.plot(flops, loss[0], color="C3", ls="-" if ident else ":", lw=1.6, zorder=4,
            label="approach 3: L(N_opt(C), D_opt(C))" + ("" if ident else " (not identified)"))
    if result.thetas is not None and ident:
        level = result.config.ci_level
        lo, hi = _band(compute_optimal(result.thetas, flops, k, result.parametric.form)[2], level)
        ax.fill_between(flops, lo, hi, color="C3", alpha=0.2, lw=0, zorder=3,
                        label=f"approach 3: {level:.0%} bootstrap band")
    for law, (color, style) in zip(_published(result)[0], _PUBLISHED_STYLES):
        n_opt, d_opt = law_optimum(flops, law.as_dict())
        ax.plot(flops, law_loss(n_opt, d_opt, law.as_dict()), color=color, ls=style, lw=0.9,
                label=f"published: {law.name}")
    env = result.approaches["envelope"]
    if env.skipped is None:
        pts = result.envelope.points()
        source = "training curves" if result.config.envelope == "curves" else "final losses"
        ax.plot([p["flops"] for p in pts], [p["loss"] for p in pts], color="black", lw=1.2, ls="--", zorder=5,
                label=f"envelope (approach 1, {source})")
    ax.axvspan(result.flops_max, flops[-1], color="grey", alpha=0.08, lw=0)
    ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="loss (nats per token)",
           title="Loss-compute frontier")
    _plain_log(ax)
    _legend_below(ax, ncol=2)
    ax.grid(alpha=0.3)
    _published_note(fig, result)
    return fig


def plot_contours(result: FitResult) -> plt.Figure:
    t = result.table
    n_grid = np.geomspace(t.n.min() / 3, t.n.max() * 3, 80)
    d_grid = np.geomspace(t.d.min() / 3, t.d.max() * 3, 80)
    nn, dd = np.meshgrid(n_grid, d_grid)
    loss = predict_loss(result.parametric.theta, nn.ravel(), dd.ravel(), result.parametric.form).reshape(nn.shape)
    fig, ax = _figure("contours", figsize=(7, 6.2))
    levels = np.unique(np.quantile(loss[np.isfinite(loss)], np.linspace(0.02, 0.9, 12)))
    if len(levels) > 1:
        cs = ax.contour(nn, dd, loss, levels=levels, cmap="magma", linewidths=1.0, zorder=3)
        ax.clabel(cs, fontsize=8, fmt="%.3g")
    flops = np.geomspace(t.flops_k * n_grid[0] * d_grid[0], t.flops_k * n_grid[-1] * d_grid[-1], 120)
    n_opt, d_opt, _ = compute_optimal(result.parametric.theta, flops, t.flops_k, result.parametric.form)
    ax.plot(n_opt[0], d_opt[0], color="C0", lw=2, zorder=4, label="efficient frontier (N_opt, D_opt)")
    for law, (color, style) in zip(_published(result)[0], _PUBLISHED_STYLES):
        ax.plot(*law_optimum(flops, law.as_dict()), color=color, ls=style, lw=0.9, label=f"published: {law.name}")
    ax.scatter(t.n, t.d, color="black", zorder=2, label="runs", **_point_style(len(t.n)))
    ax.set(xscale="log", yscale="log", xlim=(n_grid[0], n_grid[-1]), ylim=(d_grid[0], d_grid[-1]),
           xlabel="parameters N", ylabel="tokens D",
           title="L(N, D) contours (approach 3" + ("" if result.approaches["approach3"].identification.identified
                                                   else ", NOT identified") + ")")
    _plain_log(ax)
    _legend_below(ax, ncol=2)
    _published_note(fig, result)
    return fig


def plot_residuals(result: FitResult) -> plt.Figure:
    t = result.table
    resid = t.loss - predict_loss(result.parametric.theta, t.n, t.d, result.parametric.form)
    norm = _flops_norm(result)
    fig, axes = _figure("residuals", 1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in zip(axes, (t.c, t.n), ("compute C (FLOPs)", "parameters N")):
        points = ax.scatter(x, resid, c=t.c, cmap="viridis", norm=norm, **_point_style(len(x)))
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel=label)
        _plain_log(ax, "x")
        ax.grid(alpha=0.3)
    _colorbar(fig, points, axes, "compute C (FLOPs)")
    axes[0].set_ylabel("observed - predicted loss (nats)")
    fig.suptitle(f"Approach 3 residuals: RMSE {np.sqrt(np.mean(resid ** 2)):.3g} nats, "
                 f"largest {np.max(np.abs(resid)):.3g}")
    return fig


def plot_curves(result: FitResult) -> plt.Figure:
    """Every training curve against tokens and against FLOPs, coloured by N on a log scale."""
    curves = result.table.curves
    norm = LogNorm(vmin=min(c.params for c in curves), vmax=max(max(c.params for c in curves),
                                                                  min(c.params for c in curves) * 1.01))
    fig, axes = _figure("curves", 1, 2, figsize=(11, 4.2), sharey=True)
    alpha = max(0.1, min(1.0, 30.0 / len(curves)))
    colors = plt.cm.viridis(norm([c.params for c in curves]))
    for ax, field, label in zip(axes, ("tokens", "flops"), ("tokens seen", "compute spent C (FLOPs)")):
        lines = [np.column_stack([getattr(c, field), c.loss]) for c in curves]
        ax.add_collection(LineCollection(lines, colors=colors, linewidths=0.9, alpha=alpha,
                                         rasterized=len(curves) > 500))
        ax.set(xscale="log", yscale="log", xlabel=label)
        ax.set_xlim(min(ln[:, 0].min() for ln in lines), max(ln[:, 0].max() for ln in lines))
        ax.set_ylim(min(ln[:, 1].min() for ln in lines) * 0.98, max(ln[:, 1].max() for ln in lines) * 1.02)
        _plain_log(ax)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{result.table.curve_loss or 'train'} loss (nats per token)")
    _colorbar(fig, plt.cm.ScalarMappable(norm=norm, cmap="viridis"), axes, "parameters N")
    fig.suptitle(f"Training curves of {len(curves)} runs")
    return fig


COMPARE_FIGURES = (
    ("compare_allocation", "N_opt and D_opt against C: each fit's law (the one it plans with) with its bootstrap band"),
    ("compare_frontier", "Loss against compute: each fit's approach-3 frontier L(N_opt(C), D_opt(C)), and the runs "
                         "of inputs fitted here"),
)


def _compare_flops(entries: list[Any]) -> np.ndarray:
    lo = min(e.flops_range[0] for e in entries)
    hi = max(e.flops_range[1] for e in entries)
    return np.geomspace(lo / 1.5, hi * 10.0, 120)


def plot_compare_allocation(entries: list[Any]) -> plt.Figure:
    """Each fit's N_opt(C) and D_opt(C) overlaid, one colour per fit (``fits.FitEntry``)."""
    flops = _compare_flops(entries)
    fig, axes = _figure("allocation", 1, 2, figsize=(11, 5.4))
    for i, entry in enumerate(entries):
        key = entry.law_key
        if key is None:
            continue
        alloc, level = entry.allocations[key], entry.doc["config"]["ci_level"]
        for which, ax in enumerate(axes):
            _law_line(ax, alloc.law, alloc.samples, flops, which, level, band=True, color=f"C{i}",
                      ls=("-", "--", "-.", ":")[i % 4], lw=1.8, zorder=3 + i,
                      label=f"{entry.label}: {TITLES[key]}, a = {alloc.law.a[0]:.3g}")
            ax.axvspan(*entry.flops_range, color=f"C{i}", alpha=0.05, lw=0)
    for which, ax in enumerate(axes):
        ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)",
               ylabel="N_opt (parameters)" if which == 0 else "D_opt (tokens)",
               title=("N_opt" if which == 0 else "D_opt") + "(C); tinted: each fit's data")
        _plain_log(ax)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 0.02), ncol=2, frameon=False)
    return fig


def plot_compare_frontier(entries: list[Any]) -> plt.Figure:
    """Each fit's approach-3 loss frontier overlaid, with the runs of inputs fitted here."""
    flops = _compare_flops(entries)
    fig, ax = _figure("frontier", figsize=(7.5, 5.6))
    for i, entry in enumerate(entries):
        if entry.runs is not None:
            ax.scatter(entry.runs["flops"], entry.runs["loss"], color=f"C{i}", zorder=2,
                       label=f"{entry.label}: runs", **_point_style(len(entry.runs)))
        k = entry.doc["approach3"]["fit"]["flops_k"]
        ident = entry.doc["approach3"]["identification"]["identified"]
        _, _, loss = compute_optimal(entry.theta, flops, k, form_of(entry.doc))
        ax.plot(flops, loss[0], color=f"C{i}", ls=("-", "--", "-.")[i % 3] if ident else ":", lw=1.8, zorder=3 + i,
                label=f"{entry.label}: approach 3 frontier" + ("" if ident else " (not identified)"))
    ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="loss (nats per token)",
           title="Loss-compute frontiers compared")
    _plain_log(ax)
    _legend_below(ax, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def _encode(fig: plt.Figure, formats: tuple[str, ...]) -> dict[str, bytes]:
    """``fig`` in each of ``formats`` (PNG at ``_DPI``), as bytes by format; the figure is closed."""
    out = {}
    for fmt in formats:
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=_DPI)
        out[fmt] = buffer.getvalue()
    plt.close(fig)
    return out


def _with_png(formats: tuple[str, ...]) -> tuple[str, ...]:
    return ("png",) + tuple(f for f in formats if f != "png")


def save_figure(fig: plt.Figure, out_dir: Path, stem: str, formats: tuple[str, ...] = ("png",)) -> bytes:
    """Write ``fig`` as ``<stem>.<format>`` for PNG and each of ``formats``; returns the PNG bytes."""
    images = _encode(fig, _with_png(formats))
    for fmt, data in images.items():
        (Path(out_dir) / f"{stem}.{fmt}").write_bytes(data)
    return images["png"]


def plot_downstream(result: FitResult) -> plt.Figure:
    """Each task's score against loss: the runs, the fitted link with its band, and the predicted scores."""
    tasks = [d for d in result.downstream if not d["skipped"]]
    fig, axes = _figure("downstream", 1, len(tasks), figsize=(5.0 * len(tasks), 4.0), squeeze=False)
    level = result.config.ci_level
    for ax, d in zip(axes[0], tasks):
        score = pd.to_numeric(result.table.runs[TASK_PREFIX + d["task"]], errors="coerce").to_numpy(float)
        losses = [result.table.loss, [p["loss"] for p in d["predictions"]]]
        grid = np.linspace(min(np.nanmin(x) for x in losses if len(x)), max(np.nanmax(x) for x in losses if len(x)),
                           200)
        ax.scatter(result.table.loss, score, s=18, color="0.3", label="runs")
        ax.plot(grid, 1 - task_error(d["theta"], grid), color="C0", label="fit: ε − k·exp(−γL)")
        lo, hi = _band(1 - task_error(d["thetas"], grid), level)
        ax.fill_between(grid, lo, hi, color="C0", alpha=0.2, lw=0)
        for p in d["predictions"]:
            ax.errorbar(p["loss"], p["score"], yerr=[[p["score"] - p["ci"][0]], [p["ci"][1] - p["score"]]],
                        fmt="*", color="C3", ms=10)
        ax.plot([], [], "*", color="C3", label="at the compute-optimal loss")
        ax.set(xlabel="loss (nats/token)", ylabel=f"{d['task']} score", title=d["task"])
        ax.invert_xaxis()
        _legend_below(ax, ncol=1)
    return fig


_MAKERS = {"isoflop": plot_isoflop, "allocation": plot_allocation, "frontier": plot_frontier,
           "contours": plot_contours, "residuals": plot_residuals, "curves": plot_curves, "downstream": plot_downstream}


def render(result: FitResult, stem: str, formats: tuple[str, ...] = ("png",)) -> dict[str, bytes]:
    """One figure in each of ``formats`` (PNG at ``_DPI``), as bytes by format."""
    return _encode(_MAKERS[stem](result), formats)


_RESULT: FitResult | None = None
_FORMATS: tuple[str, ...] = ("png",)


def _init_worker(result: FitResult, formats: tuple[str, ...]) -> None:
    global _RESULT, _FORMATS
    _RESULT, _FORMATS = result, formats
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles interrupts


def _render_in_worker(stem: str) -> dict[str, bytes]:
    return render(_RESULT, stem, _FORMATS)


def make_plots(result: FitResult, out_dir: Path, workers: int = 1, formats: tuple[str, ...] = ("png",)
               ) -> dict[str, bytes]:
    """Write every figure as ``<stem>.<format>`` into out_dir for each of ``formats`` (PNG always, for the
    reports), drawing over ``workers`` processes; returns the PNG bytes by stem."""
    formats = _with_png(formats)
    stems = [stem for stem, _ in FIGURES] + (["curves"] if result.table.curves else []) + \
        (["downstream"] if any(not d["skipped"] for d in result.downstream) else [])
    if workers > 1:
        with ProcessPoolExecutor(max_workers=min(workers, len(stems)), initializer=_init_worker,
                                 initargs=(result, formats)) as pool:
            images = dict(zip(stems, pool.map(_render_in_worker, stems)))
    else:
        images = {stem: render(result, stem, formats) for stem in stems}
    for stem, by_format in images.items():
        for fmt, data in by_format.items():
            (Path(out_dir) / f"{stem}.{fmt}").write_bytes(data)
    return {stem: by_format["png"] for stem, by_format in images.items()}
