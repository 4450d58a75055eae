"""The fit's checks of the runs and of approach 3: budgets that do not form, outliers, noiseless data, an
envelope point at the edge of its budget, and the law's sensitivity to the Huber delta."""

from __future__ import annotations

import numpy as np

from analysis import akima, identify
from analysis.budgets import Budgets
from analysis.forms import fit_weights
from analysis.isoflop import MIN_SIDE, BudgetMinima
from analysis.parametric import ParametricFit, fit_weighted, params_from_theta, predict_loss, rmse_log_loss
from analysis.table import RunTable
from lab.measure.laws import CHINCHILLA, Form

# A run is an outlier when its log-loss residual from approach 3 lies more than OUTLIER_Z robust standard
# deviations (1.4826 x the median absolute deviation) from the median residual: Iglewicz and Hoaglin's cut-off
# for modified z-scores. The scale is floored at OUTLIER_SCALE_FLOOR so that noiseless data flag nothing.
OUTLIER_Z = 3.5
OUTLIER_SCALE_FLOOR = 1e-4
# RMSE of log loss below which the data are called noiseless: no measured loss is reproducible to 1e-6.
NOISELESS_RMSE = 1e-6
# Huber deltas of the sensitivity table (the fit's own delta is added).
DELTA_GRID = (1e-4, 1e-3, 1e-2, 1e-1)


def budget_warnings(budgets: Budgets, minima: BudgetMinima | None, n_runs: int,
                     method: str) -> list[tuple[str, str]]:
    out = []
    if budgets.continuous:
        out.append(("budgets_continuous", "C does not cluster into compute budgets (fewer than half of the "
                    f"{n_runs} runs share a budget with two others): no IsoFLOP profiles are formed"))
    elif budgets.wide:
        chains = ", ".join(f"{w['n_runs']} runs from C = {w['flops'][0]:.3g} to {w['flops'][1]:.3g}"
                           for w in budgets.wide[:5]) + (" ..." if len(budgets.wide) > 5 else "")
        out.append(("budget_wide", f"{len(budgets.wide)} chain(s) of runs whose C are each within "
                    f"{budgets.tol:.0%} of a neighbour but span more than {budgets.tol:.0%} in all ({chains}): "
                    "not one budget, so they stay out of approach 2 (raise --budget-tol if they are)"))
    wide = [f"{f:.3g} ({s:.1%})" for f, s in zip(budgets.flops, budgets.spread) if s > budgets.tol]
    if wide:
        out.append(("budget_wide", f"budget(s) whose C spread more than {budgets.tol:.0%}: {', '.join(wide)}"))
    if minima is not None and method == "akima":
        edge = [f"{budgets.flops[g]:.3g}" for g in np.flatnonzero(~minima.usable(method)[0])]
        if edge:
            out.append(("isoflop_edge", f"IsoFLOP: {len(edge)} budget(s) whose spline has its minimum at the "
                        f"smallest or largest size (or that have under {akima.MIN_SIZES} sizes), so their minimum "
                        f"was not sampled; left out: C = {', '.join(edge)}"))
    elif minima is not None:
        edge = [f"{budgets.flops[g]:.3g}" for g in np.flatnonzero(minima.edge[0])]
        if edge:
            out.append(("isoflop_edge", f"IsoFLOP: {len(edge)} budget(s) have their lowest run at the smallest or "
                        f"largest size, so their minimum was not sampled; left out: C = {', '.join(edge)}"))
        one_sided = [f"{budgets.flops[g]:.3g}" for g in np.flatnonzero(~minima.edge[0] & ~minima.sided[0])]
        if one_sided:
            out.append(("isoflop_one_sided", f"IsoFLOP: {len(one_sided)} budget(s) have fewer than {MIN_SIDE} sizes "
                        f"on one side of their lowest run, too few to locate the minimum; left out: "
                        f"C = {', '.join(one_sided)}"))
    return out


def edge_check(points: list[dict], n: np.ndarray, labels: np.ndarray) -> identify.Check:
    """Approach 1 on budgets: a frontier run at the smallest or largest size of its budget is no sampled minimum."""
    edge = [p for p in points if labels[p["row"]] >= 0
            and p["params"] in (n[labels == labels[p["row"]]].min(), n[labels == labels[p["row"]]].max())]
    shown = ", ".join(f"{p['params']:.3g} at C = {p['flops']:.3g}" for p in edge[:5])
    return identify.Check("edges", not edge, f"{len(edge)} of {len(points)} envelope point(s) are the smallest or "
                          "largest size of their budget, so the minimum there was not sampled"
                          + (f" (N = {shown})" if edge else ""))


def find_outliers(table: RunTable, theta: np.ndarray, form: Form = CHINCHILLA) -> dict:
    """Runs whose log-loss residual from ``theta`` is more than OUTLIER_Z robust standard deviations from the median.

    With seed replicates (``RunTable.experiments``) the unit is the experiment: its runs' residuals are averaged
    before the median and scale are taken, and its runs are flagged together. A seed off its replicates is the
    seed noise the replicates measure (the fit's first line reports it), not a point off the law; in a design whose
    short runs are noisier, per-run residuals would flag their unlucky seeds and leave the law's misfit unjudged.
    """
    predicted = predict_loss(theta, table.n, table.d, form)
    resid = np.log(table.loss) - np.log(predicted)
    groups = np.arange(len(resid)) if table.experiments is None else table.experiments
    _, which = np.unique(groups, return_inverse=True)
    means = np.bincount(which, resid) / np.bincount(which)
    centre = float(np.median(means))
    scale = max(1.4826 * float(np.median(np.abs(means - centre))), OUTLIER_SCALE_FLOOR)
    z = ((means - centre) / scale)[which]
    ids = table.runs["run_id"].to_numpy()
    flagged = np.flatnonzero(np.abs(z) > OUTLIER_Z)
    flagged = flagged[np.argsort(-np.abs(z[flagged]), kind="stable")]
    return {"threshold_z": OUTLIER_Z, "median_log_residual": centre, "robust_scale": scale,
            "replicates_averaged": bool(len(means) < len(resid)),
            "runs": [{"run_id": str(ids[i]), "params": float(table.n[i]), "tokens": float(table.d[i]),
                      "loss": float(table.loss[i]), "predicted": float(predicted[i]),
                      "residual": float(table.loss[i] - predicted[i]), "z": float(z[i])} for i in flagged]}


def outliers_warning(outliers: dict) -> str:
    """The warning that names ``find_outliers``'s runs and how to leave them out."""
    shown = ", ".join(f"{o['run_id']} ({o['residual']:+.3g} nats, z = {o['z']:+.1f})" for o in outliers["runs"][:5])
    averaged = " (seed replicates averaged)" if outliers["replicates_averaged"] else ""
    return (f"{len(outliers['runs'])} run(s) lie more than {OUTLIER_Z:g} robust standard deviations from approach "
            f"3's law{averaged}: {shown}{' ...' if len(outliers['runs']) > 5 else ''}; "
            "drop them with --exclude RUN_ID (or a condition) or --drop-highest-loss K")


def noise_check(table: RunTable, theta: np.ndarray, form: Form) -> str | None:
    """A warning when the law fits every run to rounding precision (noiseless or derived data), else None."""
    rmse = rmse_log_loss(theta, table.n, table.d, table.loss, form)
    if rmse >= NOISELESS_RMSE:
        return None
    return (f"NOISELESS DATA: approach 3 fits all {len(table.loss)} runs to an RMSE of {rmse:.2g} in log loss (below "
            f"{NOISELESS_RMSE:g}), so the losses were computed from a law, not measured; bootstrap intervals of "
            "(near) zero width then measure rounding, not uncertainty")


def delta_sensitivity(table: RunTable, parametric: ParametricFit, delta: float) -> list[dict]:
    """Approach 3 refitted at each Huber delta of DELTA_GRID (and ``delta``), from the fit's optimum."""
    rows, form = [], parametric.form
    for value in sorted(set(DELTA_GRID) | {delta}):
        if value == delta:
            theta, converged = parametric.theta, parametric.converged
        else:
            thetas, ok = fit_weighted(parametric.theta, table.n, table.d, table.loss, fit_weights(table), value,
                                      form)
            theta, converged = thetas[0], bool(ok[0])
        params = params_from_theta(theta, table.flops_k, form)
        rows.append({"huber_delta": value, "fitted": value == delta, "converged": converged,
                     **{k: params[k] for k in (*form.names, "a", "b")}})
    return rows
