"""Figures of a fit, each saved as PNG and SVG (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from analysis.fit import FitResult  # noqa: E402
from analysis.isoflop import PowerLaws  # noqa: E402
from analysis.parametric import compute_optimal, predict_loss  # noqa: E402

# (file stem, caption) of every figure, in report order.
FIGURES = (
    ("isoflop", "IsoFLOP profiles: loss against N per budget, parabolas in log N and the chosen minima"),
    ("allocation", "Compute-optimal N and D against C: fits, bootstrap bands and their extrapolation"),
    ("frontier", "Loss against compute: the runs and the predicted compute-optimal frontier"),
    ("contours", "L(N, D) from approach 3, with the efficient frontier and the runs"),
    ("residuals", "Residuals of approach 3: log observed minus log predicted loss"),
)


def _band(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = 50.0 * (1.0 - level)
    with np.errstate(all="ignore"):
        return np.nanpercentile(samples, tail, axis=0), np.nanpercentile(samples, 100.0 - tail, axis=0)


def _flops_range(result: FitResult) -> np.ndarray:
    top = max([result.flops_max] + [p["flops"] for p in result.predictions])
    return np.geomspace(result.table.c.min() / 1.5, top * 1.5, 200)


def _save(fig: plt.Figure, out_dir: Path, stem: str) -> None:
    for ext in ("png", "svg"):
        fig.savefig(out_dir / f"{stem}.{ext}", dpi=110 if ext == "png" else None)
    plt.close(fig)


def _budget_colors(result: FitResult) -> np.ndarray:
    return plt.cm.viridis(np.linspace(0.0, 0.9, len(result.minima.flops)))


def plot_isoflop(result: FitResult) -> plt.Figure:
    t, m = result.table, result.minima
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for g, color in enumerate(_budget_colors(result)):
        rows = np.flatnonzero(result.labels == g)
        ax.scatter(t.n[rows], t.loss[rows], color=color, s=18, label=f"C = {m.flops[g]:.2g}")
        if m.vertex_ok[0, g]:
            u = np.linspace(np.log(t.n[rows]).min(), np.log(t.n[rows]).max(), 60) - m.centre[g]
            c0, c1, c2 = m.coeffs[0, g]
            ax.plot(np.exp(u + m.centre[g]), c0 + c1 * u + c2 * u * u, color=color, lw=1)
            ax.plot(np.exp(m.vertex_log_n[0, g]), m.vertex_loss[0, g], marker="*", ms=11, color=color,
                    mec="black", mew=0.6, ls="none")
        low = m.lowest_row[0, g]
        edge = m.edge[0, g] and m.n_distinct[0, g] >= 3
        ax.plot(t.n[low], t.loss[low], marker="x" if edge else "s", ms=9, mfc="none",
                mec="red" if edge else "black", ls="none")
    ax.plot([], [], marker="*", color="grey", mec="black", ls="none", label="parabola vertex")
    ax.plot([], [], marker="s", mfc="none", mec="black", ls="none", label="lowest run")
    ax.plot([], [], marker="x", mec="red", ls="none", label="edge minimum")
    ax.set(xscale="log", xlabel="parameters N", ylabel="loss",
           title="IsoFLOP profiles" + (" (IsoFLOP fit skipped)" if result.isoflop_skipped else ""))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def _law_line(ax: plt.Axes, laws: PowerLaws, samples: PowerLaws | None, flops: np.ndarray, which: str,
              level: float, **style: Any) -> None:
    k, e = (laws.k_n, laws.a) if which == "N" else (laws.k_d, laws.b)
    ax.plot(flops, k[0] * flops ** e[0], **style)
    if samples is not None:
        sk, se = (samples.k_n, samples.a) if which == "N" else (samples.k_d, samples.b)
        lo, hi = _band(sk[:, None] * flops[None, :] ** se[:, None], level)
        ax.fill_between(flops, lo, hi, color=style.get("color"), alpha=0.15, lw=0)


def plot_allocation(result: FitResult) -> plt.Figure:
    flops = _flops_range(result)
    level = result.config.ci_level
    n3, d3, _ = compute_optimal(result.parametric.theta, flops)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    method = result.config.isoflop_minimum
    m = result.minima
    for ax, which, curve in zip(axes, ("N", "D"), (n3[0], d3[0])):
        ax.plot(flops, curve, color="C0", label="approach 3 (parametric)")
        if result.thetas is not None:
            n_s, d_s, _ = compute_optimal(result.thetas, flops)
            lo, hi = _band(n_s if which == "N" else d_s, level)
            ax.fill_between(flops, lo, hi, color="C0", alpha=0.2, lw=0, label=f"{level:.0%} bootstrap band")
        if not result.isoflop_skipped:
            _law_line(ax, result.isoflop[method], result.isoflop_samples.get(method), flops, which, level,
                      color="C1", ls="--", label=f"approach 2 (IsoFLOP, {method})")
            used = m.usable(method, result.config.include_edge)[0]
            if method == "vertex":
                pts_n = np.exp(m.vertex_log_n[0])
            else:
                pts_n = result.table.n[m.lowest_row[0]]
            pts = pts_n if which == "N" else m.flops / (6.0 * pts_n)
            ax.scatter(m.flops[used], pts[used], color="C1", zorder=3, s=22, label="IsoFLOP minima")
        if result.envelope_skipped is None and result.envelope_law is not None:
            _law_line(ax, result.envelope_law, result.envelope_samples, flops, which, level,
                      color="C2", ls=":", label="approach 1 (envelope)")
        for p in result.predictions:
            ax.plot(p["flops"], p["params"] if which == "N" else p["tokens"], marker="D", color="C3",
                    ls="none", ms=5)
        ax.axvspan(result.flops_max, flops[-1], color="grey", alpha=0.08, lw=0)
        ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)",
               ylabel="N_opt (parameters)" if which == "N" else "D_opt (tokens)",
               title=f"{which}_opt(C); shaded: beyond the data")
        ax.grid(alpha=0.3)
    axes[0].plot([], [], marker="D", color="C3", ls="none", label="predictions")
    axes[0].legend(fontsize=7)
    return fig


def plot_frontier(result: FitResult) -> plt.Figure:
    t = result.table
    flops = _flops_range(result)
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for curve in t.curves:
        ax.plot(curve.flops, curve.loss, color="grey", lw=0.5, alpha=0.4)
    points = ax.scatter(t.c, t.loss, c=t.n, norm=LogNorm(), cmap="viridis", s=16, zorder=3)
    fig.colorbar(points, ax=ax, label="parameters N")
    _, _, loss = compute_optimal(result.parametric.theta, flops)
    ax.plot(flops, loss[0], color="C3", label="approach 3: L(N_opt(C), D_opt(C))")
    if result.thetas is not None:
        lo, hi = _band(compute_optimal(result.thetas, flops)[2], result.config.ci_level)
        ax.fill_between(flops, lo, hi, color="C3", alpha=0.2, lw=0, label="bootstrap band")
    if result.envelope is not None:
        env = result.envelope
        best, valid = env.winners(np.ones((1, len(t.runs))))
        ax.plot(env.grid[valid[0]], env.loss[best[0], np.arange(len(env.grid))][valid[0]], color="black",
                lw=1.2, ls="--", label="lowest training curve (envelope)")
    ax.axvspan(result.flops_max, flops[-1], color="grey", alpha=0.08, lw=0)
    ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="loss", title="Loss-compute frontier")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def plot_contours(result: FitResult) -> plt.Figure:
    t = result.table
    n_grid = np.geomspace(t.n.min() / 3, t.n.max() * 3, 120)
    d_grid = np.geomspace(t.d.min() / 3, t.d.max() * 3, 120)
    nn, dd = np.meshgrid(n_grid, d_grid)
    loss = predict_loss(result.parametric.theta, nn.ravel(), dd.ravel()).reshape(nn.shape)
    fig, ax = plt.subplots(figsize=(7, 5.2))
    levels = np.quantile(loss, np.linspace(0.02, 0.9, 14))
    cs = ax.contour(nn, dd, loss, levels=np.unique(levels), cmap="magma", linewidths=0.8)
    ax.clabel(cs, fontsize=6, fmt="%.3g")
    flops = np.geomspace(6 * n_grid[0] * d_grid[0], 6 * n_grid[-1] * d_grid[-1], 200)
    n_opt, d_opt, _ = compute_optimal(result.parametric.theta, flops)
    ax.plot(n_opt[0], d_opt[0], color="C0", lw=2, label="efficient frontier (N_opt, D_opt)")
    for c in result.minima.flops:
        ax.plot(n_grid, c / (6 * n_grid), color="grey", lw=0.6, ls=":")
    ax.scatter(t.n, t.d, s=10, color="black", zorder=3, label="runs")
    ax.plot([], [], color="grey", lw=0.6, ls=":", label="C = 6ND of each budget")
    ax.set(xscale="log", yscale="log", xlim=(n_grid[0], n_grid[-1]), ylim=(d_grid[0], d_grid[-1]),
           xlabel="parameters N", ylabel="tokens D", title="L(N, D) contours (approach 3)")
    ax.legend(fontsize=7, loc="upper right")
    return fig


def plot_residuals(result: FitResult) -> plt.Figure:
    t = result.table
    resid = np.log(t.loss) - np.log(predict_loss(result.parametric.theta, t.n, t.d))
    colors = _budget_colors(result)[result.labels]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in zip(axes, (t.c, t.n), ("compute C (FLOPs)", "parameters N")):
        ax.scatter(x, resid, c=colors, s=16)
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel=label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("log L observed - log L predicted")
    fig.suptitle(f"Approach 3 residuals (RMS {np.sqrt(np.mean(resid ** 2)):.3g})")
    return fig


def make_plots(result: FitResult, out_dir: Path) -> list[str]:
    """Write every figure as ``<stem>.png`` and ``<stem>.svg`` into out_dir; returns the stems."""
    makers = {"isoflop": plot_isoflop, "allocation": plot_allocation, "frontier": plot_frontier,
              "contours": plot_contours, "residuals": plot_residuals}
    for stem, _ in FIGURES:
        fig = makers[stem](result)
        fig.tight_layout()
        _save(fig, Path(out_dir), stem)
    return [stem for stem, _ in FIGURES]
