"""Approach 2 (IsoFLOP profiles): the loss-minimising N per compute budget, then power laws.

Runs are grouped into budgets: sorted by C, a run joins the current group while its C is within
a relative tolerance of the group's first (smallest) C, i.e. |ln C - ln C_first| <= ln(1 + tol).
Per budget with at least three distinct N, the minimum is taken two ways: the lowest run, and
the vertex of a least-squares parabola of loss in log N. A budget whose lowest run has the
smallest or largest N of the budget has its minimum at the edge of the sampled range: such
minima are flagged and, by default, left out of the power laws N_opt = k_N C^a and
D_opt = k_D C^b (D_opt = C/(6 N_opt) for the vertex, the run's own tokens for the lowest run).

Everything is computed for a matrix of run weights (resamples x runs), so the bootstrap and the
full-data fit (one row of ones) share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_RUNS_PER_BUDGET = 3
METHODS = ("vertex", "lowest")


def group_budgets(flops: np.ndarray, tol: float) -> np.ndarray:
    """Budget label of each run (0 = smallest budget), grouping C within relative ``tol``."""
    if tol < 0:
        raise ValueError("budget tolerance must be >= 0")
    log_c = np.log(np.asarray(flops, float))
    order = np.argsort(log_c, kind="stable")
    labels = np.empty(len(log_c), int)
    group, anchor = -1, -np.inf
    for i in order:
        if log_c[i] - anchor > np.log1p(tol):
            group, anchor = group + 1, log_c[i]
        labels[i] = group
    return labels


@dataclass
class PowerLaws:
    """N_opt = k_N C^a and D_opt = k_D C^b, one value per row (resample) of each array."""

    a: np.ndarray
    k_n: np.ndarray
    b: np.ndarray
    k_d: np.ndarray
    n_budgets: np.ndarray  # budgets used per row

    def row(self, i: int = 0) -> dict[str, float]:
        return {"a": float(self.a[i]), "b": float(self.b[i]), "k_N": float(self.k_n[i]),
                "k_D": float(self.k_d[i]), "n_budgets": int(self.n_budgets[i])}


def fit_power_law(log_c: np.ndarray, log_y: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares slope and exp(intercept) of log_y on log_c over masked columns, per row.

    log_c (G,), log_y and mask (B, G); rows with fewer than two distinct budgets give NaN.
    """
    m = mask.astype(float)
    count = m.sum(axis=1)
    with np.errstate(all="ignore"):
        xm = (m * log_c).sum(axis=1) / count
        ym = (m * np.where(mask, log_y, 0.0)).sum(axis=1) / count
        dx = log_c[None, :] - xm[:, None]
        sxx = (m * dx * dx).sum(axis=1)
        sxy = (m * dx * np.where(mask, log_y - ym[:, None], 0.0)).sum(axis=1)
        ok = (count >= 2) & (sxx > 1e-12 * np.maximum(1.0, count))
        slope = np.where(ok, sxy / sxx, np.nan)
        k = np.where(ok, np.exp(ym - slope * xm), np.nan)
    return slope, k


@dataclass
class BudgetMinima:
    """Per-budget minima for each row of a weight matrix; arrays are (B, G)."""

    flops: np.ndarray  # (G,) geometric mean C of each budget
    n_distinct: np.ndarray  # distinct N among the runs drawn
    lowest_row: np.ndarray  # index into the run table of the lowest run
    edge: np.ndarray  # lowest run at the smallest or largest N drawn
    vertex_log_n: np.ndarray
    vertex_loss: np.ndarray
    vertex_ok: np.ndarray  # parabola opens upwards (and >= 3 distinct N)
    vertex_inside: np.ndarray  # vertex within the sampled N range
    coeffs: np.ndarray  # (B, G, 3): loss = c0 + c1 u + c2 u^2, u = log N - centre
    centre: np.ndarray  # (G,)

    def usable(self, method: str, include_edge: bool) -> np.ndarray:
        """Budgets whose minimum (by ``method``) enters the power law."""
        ok = self.n_distinct >= MIN_RUNS_PER_BUDGET
        if not include_edge:
            ok &= ~self.edge
        if method == "vertex":
            ok &= self.vertex_ok & (self.vertex_inside | include_edge)
        return ok

    def power_laws(self, method: str, include_edge: bool, n: np.ndarray, d: np.ndarray) -> PowerLaws:
        mask = self.usable(method, include_edge)
        log_c = np.log(self.flops)
        if method == "vertex":
            log_n = self.vertex_log_n
            log_d = np.log(self.flops / 6.0)[None, :] - log_n
        else:
            log_n, log_d = np.log(n)[self.lowest_row], np.log(d)[self.lowest_row]
        log_n, log_d = np.where(mask, log_n, 0.0), np.where(mask, log_d, 0.0)
        a, k_n = fit_power_law(log_c, log_n, mask)
        b, k_d = fit_power_law(log_c, log_d, mask)
        return PowerLaws(a=a, k_n=k_n, b=b, k_d=k_d, n_budgets=mask.sum(axis=1))


def budget_minima(n: np.ndarray, loss: np.ndarray, flops: np.ndarray, labels: np.ndarray,
                  weights: np.ndarray) -> BudgetMinima:
    """Lowest-run and parabola-vertex minima of every budget, for each row of ``weights`` (B, runs)."""
    weights = np.atleast_2d(np.asarray(weights, float))
    n_groups = int(labels.max()) + 1
    shape = (len(weights), n_groups)
    out = BudgetMinima(
        flops=np.array([np.exp(np.log(flops[labels == g]).mean()) for g in range(n_groups)]),
        n_distinct=np.zeros(shape, int), lowest_row=np.zeros(shape, int), edge=np.zeros(shape, bool),
        vertex_log_n=np.full(shape, np.nan), vertex_loss=np.full(shape, np.nan),
        vertex_ok=np.zeros(shape, bool), vertex_inside=np.zeros(shape, bool),
        coeffs=np.full(shape + (3,), np.nan), centre=np.zeros(n_groups))
    log_n = np.log(n)
    for g in range(n_groups):
        rows = np.flatnonzero(labels == g)
        x, ls, w = log_n[rows], loss[rows], weights[:, rows]
        present = w > 0
        distinct, inverse = np.unique(x, return_inverse=True)
        drawn = np.zeros((len(w), len(distinct)), bool)
        for j, k in enumerate(inverse):
            drawn[:, k] |= present[:, j]
        out.n_distinct[:, g] = drawn.sum(axis=1)
        j_low = np.argmin(np.where(present, ls, np.inf), axis=1)
        out.lowest_row[:, g] = rows[j_low]
        x_min = np.where(present, x, np.inf).min(axis=1)
        x_max = np.where(present, x, -np.inf).max(axis=1)
        out.edge[:, g] = (x[j_low] <= x_min) | (x[j_low] >= x_max)
        centre = float(x.mean())
        out.centre[g] = centre
        u = x - centre
        powers = u[None, :] ** np.arange(5)[:, None]  # (5, m)
        s = w @ powers.T  # (B, 5): sum w u^k
        t = (w * ls) @ powers[:3].T  # (B, 3): sum w L u^k
        gram = np.stack([s[:, 0:3], s[:, 1:4], s[:, 2:5]], axis=1)
        fit_ok = out.n_distinct[:, g] >= 3
        gram[~fit_ok] = np.eye(3)
        coef = np.linalg.solve(gram, t[:, :, None])[:, :, 0]
        coef[~fit_ok] = np.nan
        out.coeffs[:, g] = coef
        c0, c1, c2 = coef.T
        ok = fit_ok & (c2 > 0)
        with np.errstate(all="ignore"):
            vertex_u = np.where(ok, -c1 / (2 * c2), np.nan)
            out.vertex_loss[:, g] = np.where(ok, c0 - c1 * c1 / (4 * c2), np.nan)
        out.vertex_ok[:, g] = ok
        out.vertex_log_n[:, g] = vertex_u + centre
        out.vertex_inside[:, g] = ok & (vertex_u + centre >= x_min) & (vertex_u + centre <= x_max)
    return out
