"""Approach 2 (IsoFLOP profiles): the loss-minimising N of each budget, then power laws.

Each budget's minimum is taken two ways: its lowest run, and the vertex of a least-squares
parabola of loss in log N fitted in a window around the lowest run. Loss is quadratic in log N
only near the minimum (along C = kND it is E + P N^-alpha + Q N^beta), so a parabola through a
whole lopsided profile, with more sizes on one side of the minimum than the other, is pulled
towards the long side, and one through a wide profile misses the minimum too. The window is
therefore symmetric about the lowest run, as wide as the nearer end of the sampled sizes allows but
at most a decade of N either way (``MAX_HALF_WIDTH``), widened only to hold ``MIN_SIDE`` sizes on
each side; a vertex outside its window is rejected. On synthetic lopsided profiles this cuts the
vertex error from up to 0.058 to under 0.006 decades of N (tests/analysis/test_analysis_isoflop.py,
benchmarks/analysis/bench_isoflop_window.py and its figures in benchmarks/analysis/README.md).

A budget is usable when its lowest run has at least ``MIN_SIDE`` distinct sizes on each side: a
lowest run at the smallest or largest size is at the edge (not a minimum), and with one size on a
side the minimum is not located. Unusable budgets stay out of the power laws N_opt = k_N C^a and
D_opt = k_D C^b (least squares in log space; D_opt = C/(k N_opt) for the vertex, with k from the
table's C = kND, and the run's own tokens for the lowest run).

A third minimum, ``akima`` (``analysis.akima``), is Porian et al. (2024)'s: the argmin of Akima's spline of log
loss through every size, usable wherever it lies inside the sampled sizes (no side counts, no window).

Everything is computed for a matrix of run weights (resamples x runs), so the bootstrap and the
full-data fit (one row of ones) share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis import akima

MIN_SIDE = 2
MAX_HALF_WIDTH = np.log(10.0)  # a decade of N either side of the lowest run, at most
METHODS = ("vertex", "lowest", "akima")


@dataclass
class PowerLaws:
    """N_opt = k_N C^a and D_opt = k_D C^b, one value per row (resample) of each array."""

    a: np.ndarray
    k_n: np.ndarray
    b: np.ndarray
    k_d: np.ndarray
    n_points: np.ndarray  # budgets (or envelope points) used per row

    def row(self, i: int = 0) -> dict[str, float]:
        return {"a": float(self.a[i]), "b": float(self.b[i]), "k_N": float(self.k_n[i]),
                "k_D": float(self.k_d[i]), "n_points": int(self.n_points[i])}

    def at(self, flops: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """N_opt and D_opt of every row at ``flops``: arrays (rows, len(flops))."""
        log_c = np.log(np.atleast_1d(np.asarray(flops, float)))[None, :]
        with np.errstate(all="ignore"):
            return (np.exp(np.log(self.k_n)[:, None] + self.a[:, None] * log_c),
                    np.exp(np.log(self.k_d)[:, None] + self.b[:, None] * log_c))

    @staticmethod
    def concat(parts: list[PowerLaws]) -> PowerLaws:
        return PowerLaws(*(np.concatenate([getattr(p, f) for p in parts])
                           for f in ("a", "k_n", "b", "k_d", "n_points")))


def fit_power_law(log_c: np.ndarray, log_y: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares slope and exp(intercept) of log_y on log_c over masked columns, per row.

    log_c (G,) or (B, G), log_y and mask (B, G); rows with fewer than two distinct C give NaN.
    """
    m = mask.astype(float)
    log_c = np.broadcast_to(log_c, mask.shape)
    count = m.sum(axis=1)
    with np.errstate(all="ignore"):
        xm = (m * np.where(mask, log_c, 0.0)).sum(axis=1) / count
        ym = (m * np.where(mask, log_y, 0.0)).sum(axis=1) / count
        dx = np.where(mask, log_c - xm[:, None], 0.0)
        sxx = (dx * dx).sum(axis=1)
        sxy = (dx * np.where(mask, log_y - ym[:, None], 0.0)).sum(axis=1)
        ok = (count >= 2) & (sxx > 1e-12 * np.maximum(1.0, count))
        slope = np.where(ok, sxy / sxx, np.nan)
        k = np.where(ok, np.exp(ym - slope * xm), np.nan)
    return slope, k


@dataclass
class BudgetMinima:
    """Per-budget minima for each row of a weight matrix; arrays are (B, G)."""

    flops: np.ndarray  # (G,) C of each budget
    n_distinct: np.ndarray  # distinct N among the runs drawn
    lowest_row: np.ndarray  # index into the run table of the lowest run
    left: np.ndarray  # distinct N drawn below the lowest run's N
    right: np.ndarray  # ... and above it
    centre: np.ndarray  # log N of the lowest run: the window's centre
    half_width: np.ndarray  # window half-width in log N
    in_window: np.ndarray  # runs in the window
    coeffs: np.ndarray  # (B, G, 3): loss = c0 + c1 u + c2 u^2, u = log N - centre
    vertex_log_n: np.ndarray
    vertex_loss: np.ndarray
    vertex_ok: np.ndarray  # parabola opens upwards and its vertex lies in the window
    spline_log_n: np.ndarray  # the Akima spline's minimum (NaN at an end of the sampled sizes)
    spline_loss: np.ndarray

    @property
    def edge(self) -> np.ndarray:
        """Lowest run at the smallest or largest N drawn."""
        return (self.left == 0) | (self.right == 0)

    @property
    def sided(self) -> np.ndarray:
        """At least MIN_SIDE sizes on each side of the lowest run."""
        return (self.left >= MIN_SIDE) & (self.right >= MIN_SIDE)

    def usable(self, method: str) -> np.ndarray:
        """Budgets whose minimum (by ``method``) enters the power law."""
        if method == "akima":
            return np.isfinite(self.spline_log_n)
        return self.sided & self.vertex_ok if method == "vertex" else self.sided

    def log_n(self, method: str, n: np.ndarray) -> np.ndarray:
        """log N of every budget's minimum by ``method`` (NaN or meaningless where not usable)."""
        if method == "lowest":
            return np.log(n)[self.lowest_row]
        return self.vertex_log_n if method == "vertex" else self.spline_log_n

    def power_laws(self, method: str, n: np.ndarray, d: np.ndarray, flops_k: float) -> PowerLaws:
        mask = self.usable(method)
        log_c = np.log(self.flops)
        if method == "lowest":
            log_n, log_d = np.log(n)[self.lowest_row], np.log(d)[self.lowest_row]
        else:
            log_n = self.log_n(method, n)
            log_d = np.log(self.flops / flops_k)[None, :] - log_n
        a, k_n = fit_power_law(log_c, log_n, mask)
        b, k_d = fit_power_law(log_c, log_d, mask)
        return PowerLaws(a=a, k_n=k_n, b=b, k_d=k_d, n_points=mask.sum(axis=1))


def _nth_drawn(cum: np.ndarray, drawn: np.ndarray, p: np.ndarray, side: int) -> np.ndarray:
    """Index of the MIN_SIDE-th drawn size below (side -1) or above (+1) index p, per row; -1 if none."""
    idx = np.arange(cum.shape[1])[None, :]
    here = np.take_along_axis(cum, p[:, None], axis=1)
    count = (here - cum) if side < 0 else (cum - here)  # at a drawn size: its rank counted from p
    hit = drawn & (side * (idx - p[:, None]) > 0) & (count == MIN_SIDE)
    return np.where(hit.any(axis=1), np.argmax(hit, axis=1), -1)


def _moments(w: np.ndarray, u: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: sum w u^k for k = 0..4 and sum w L u^k for k = 0..2 (the normal equations of the parabola)."""
    moments, rhs = np.empty((len(w), 5)), np.empty((len(w), 3))
    term, term_loss = w.copy(), w * loss
    for k in range(5):
        moments[:, k] = term.sum(axis=1)
        if k < 3:
            rhs[:, k] = term_loss.sum(axis=1)
            term_loss *= u
        term *= u
    return moments, rhs


def budget_minima(n: np.ndarray, loss: np.ndarray, labels: np.ndarray, flops: np.ndarray,
                  weights: np.ndarray, experiments: np.ndarray | None = None) -> BudgetMinima:
    """Lowest-run, windowed-vertex and spline minima of every budget (labels >= 0, C ``flops``) per weight row
    (``experiments``: which runs are seed replicates of one experiment, for the spline; ``RunTable.experiments``)."""
    weights = np.atleast_2d(np.asarray(weights, float))
    n_groups = len(flops)
    shape = (len(weights), n_groups)
    spline_log_n, spline_loss = akima.budget_minima(n, loss, labels, n_groups, weights, experiments)
    out = BudgetMinima(
        flops=np.asarray(flops, float), n_distinct=np.zeros(shape, int), lowest_row=np.zeros(shape, int),
        left=np.zeros(shape, int), right=np.zeros(shape, int), centre=np.full(shape, np.nan),
        half_width=np.full(shape, np.nan), in_window=np.zeros(shape, int), coeffs=np.full(shape + (3,), np.nan),
        vertex_log_n=np.full(shape, np.nan), vertex_loss=np.full(shape, np.nan), vertex_ok=np.zeros(shape, bool),
        spline_log_n=spline_log_n, spline_loss=spline_loss)
    log_n = np.log(n)
    for g in range(n_groups):
        rows = np.flatnonzero(labels == g)
        rows = rows[np.argsort(log_n[rows], kind="stable")]
        x, ls, w = log_n[rows], loss[rows], weights[:, rows]
        sizes, starts, inverse = np.unique(x, return_index=True, return_inverse=True)
        present = w > 0
        drawn = np.logical_or.reduceat(present, starts, axis=1)  # (B, K) sizes drawn
        cum = np.cumsum(drawn, axis=1)
        out.n_distinct[:, g] = cum[:, -1]
        j_low = np.argmin(np.where(present, ls, np.inf), axis=1)
        out.lowest_row[:, g] = rows[j_low]
        p = inverse[j_low]
        below = np.take_along_axis(cum, p[:, None], axis=1)[:, 0]
        out.left[:, g] = below - 1
        out.right[:, g] = cum[:, -1] - below
        centre = x[j_low]
        lo_size = sizes[np.argmax(drawn, axis=1)]
        hi_size = sizes[len(sizes) - 1 - np.argmax(drawn[:, ::-1], axis=1)]
        k_left, k_right = _nth_drawn(cum, drawn, p, -1), _nth_drawn(cum, drawn, p, +1)
        half = np.maximum.reduce([np.minimum.reduce([centre - lo_size, hi_size - centre,
                                                      np.full(len(centre), MAX_HALF_WIDTH)]),
                                  np.where(k_left >= 0, centre - sizes[k_left], 0.0),
                                  np.where(k_right >= 0, sizes[k_right] - centre, 0.0)])
        u = x[None, :] - centre[:, None]
        inside = present & (np.abs(u) <= half[:, None] * (1 + 1e-9) + 1e-12)
        moments, rhs = _moments(np.where(inside, w, 0.0), u, ls)
        gram = np.stack([moments[:, 0:3], moments[:, 1:4], moments[:, 2:5]], axis=1)
        fit_ok = (out.left[:, g] >= MIN_SIDE) & (out.right[:, g] >= MIN_SIDE)
        gram[~fit_ok] = np.eye(3)
        coef = np.linalg.solve(gram, rhs[:, :, None])[:, :, 0]
        coef[~fit_ok] = np.nan
        c0, c1, c2 = coef.T
        with np.errstate(all="ignore"):
            vertex_u = -c1 / (2 * c2)
            ok = fit_ok & (c2 > 0) & (np.abs(vertex_u) <= half)
            out.vertex_loss[:, g] = np.where(ok, c0 - c1 * c1 / (4 * c2), np.nan)
            out.vertex_log_n[:, g] = np.where(ok, centre + vertex_u, np.nan)
        out.vertex_ok[:, g] = ok
        out.coeffs[:, g] = coef
        out.centre[:, g], out.half_width[:, g] = centre, half
        out.in_window[:, g] = inside.sum(axis=1)
    return out
