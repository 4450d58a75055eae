"""The hold-out check: approach 3 (and approach 2's N_opt) refitted without the runs of the largest budgets,
then held to those runs."""

from __future__ import annotations

import numpy as np

from analysis.budgets import Budgets
from analysis.fit_config import FitConfig
from analysis.isoflop import BudgetMinima, budget_minima
from analysis.parametric import ParametricFit, compute_optimal, fit_parametric, predict_loss
from analysis.table import MIN_RUNS, RunTable
from lab.measure.laws import CHINCHILLA, Form

HOLDOUT_BIAS = 0.01  # mean signed relative error of the held-out losses beyond which the fit warns
HOLDOUT_FRACTION = 0.2  # with continuous budgets, the runs with the largest C that the hold-out keeps back


def _held_out(table: RunTable, budgets: Budgets, config: FitConfig) -> tuple[np.ndarray, str]:
    """Runs the hold-out keeps back, and a description: those above --holdout-above, else the largest
    --holdout-budgets budgets, else (continuous C) the top fifth of C."""
    c = table.c
    if config.holdout_above is not None:
        return c > config.holdout_above, f"the runs with C above {config.holdout_above:.3g}"
    k = config.holdout_budgets
    if budgets.count >= 2:
        first = max(budgets.count - k, 0)
        held = budgets.labels >= first
        if k == 1:
            return held, f"the largest budget (C = {budgets.flops[-1]:.3g})"
        return held, f"the {budgets.count - first} largest budgets (C = {budgets.flops[first]:.3g} and above)"
    return c >= np.quantile(c, 1.0 - HOLDOUT_FRACTION), f"the {HOLDOUT_FRACTION:.0%} of runs with the largest C"


def holdout_skip(table: RunTable, budgets: Budgets, config: FitConfig) -> tuple[np.ndarray, str, str | None]:
    """The held-out runs, their description, and why the hold-out cannot run (None when it can)."""
    n, d = table.n, table.d
    held, what = _held_out(table, budgets, config)
    train = ~held
    if not held.any():
        return held, what, f"no run to hold out ({what})"
    if train.sum() < MIN_RUNS or len(np.unique(n[train])) < 2 or len(np.unique(d[train])) < 2:
        return held, what, f"fewer than {MIN_RUNS} runs (or too few distinct N, D) outside {what}"
    return held, what, None


def holdout_parametric(table: RunTable, held: np.ndarray, what: str, config: FitConfig, form: Form
                        ) -> tuple[ParametricFit, dict]:
    """Approach 3 in ``form`` refitted without the ``held`` runs (described by ``what``), and its errors on them."""
    n, d, c, loss = table.n, table.d, table.c, table.loss
    train = ~held
    weights = table.replicate_weights
    fit = fit_parametric(n[train], d[train], loss[train], n_starts=config.n_starts, delta=config.huber_delta,
                         form=form, weights=None if weights is None else weights[train])
    predicted = predict_loss(fit.theta, n[held], d[held], form)
    err = predicted - loss[held]
    runs = [{"run_id": str(r), "params": float(nn), "tokens": float(dd), "flops": float(cc), "loss": float(obs),
             "predicted": float(p), "error": float(p - obs), "rel_error": float((p - obs) / obs)}
            for r, nn, dd, cc, obs, p in zip(table.runs["run_id"][held], n[held], d[held], c[held], loss[held],
                                             predicted)]
    return fit, {"form": form.name, "held_out": what, "mean_abs_error": float(np.mean(np.abs(err))),
                 "mean_rel_error": float(np.mean(np.abs(err) / loss[held])),
                 "max_rel_error": float(np.max(np.abs(err) / loss[held])),
                 "bias": float(np.mean(err / loss[held])),
                 "too_high": int(np.sum(err > 0)),
                 "converged": fit.converged, "runs": runs}


def holdout_check(table: RunTable, budgets: Budgets, minima: BudgetMinima | None, config: FitConfig,
             form: Form = CHINCHILLA, refit: tuple[ParametricFit, dict] | None = None) -> dict:
    """Refit without the runs ``_held_out`` names (or take ``refit``, ``form_holdouts``'s), then predict each."""
    n, d, c, loss = table.n, table.d, table.c, table.loss
    held, what, skip = holdout_skip(table, budgets, config)
    if skip is not None:
        return {"skipped": True, "reason": skip}
    train = ~held
    fit, errors = refit or holdout_parametric(table, held, what, config, form)
    out = {"skipped": False, "held_out": what, "budget_flops": float(np.exp(np.log(c[held]).mean())),
           "n_train": int(train.sum()), "n_holdout": int(held.sum()), "approach3": errors, "isoflop": None}
    method = config.isoflop_minimum
    top = budgets.count - 1
    if (minima is None or budgets.count < 3 or not minima.usable(method)[0, top]
            or not held[budgets.labels == top].all()):
        return out
    budget = float(budgets.flops[top])
    observed = float(np.exp(minima.log_n(method, n)[0, top]))
    train_minima = budget_minima(n, loss, budgets.labels, budgets.flops, train.astype(float)[None], table.experiments)
    law = train_minima.power_laws(method, n, d, table.flops_k)
    if law.n_points[0] >= 2:
        pred = float(law.at(budget)[0][0, 0])
        n_opt3 = float(compute_optimal(fit.theta, budget, table.flops_k, form)[0][0, 0])
        out["isoflop"] = {"params_opt_predicted": pred, "params_opt_observed": observed,
                          "rel_error": abs(pred - observed) / observed}
        out["approach3"].update(params_opt_predicted=n_opt3, params_opt_rel_error=abs(n_opt3 - observed) / observed)
    return out


def holdout_bias(holdout: dict) -> str | None:
    """A warning when approach 3, refitted without the held-out runs, misses their losses one way on average by
    more than HOLDOUT_BIAS: its extrapolated losses are then likely off the same way."""
    a3 = holdout["approach3"]
    if abs(a3["bias"]) <= HOLDOUT_BIAS:
        return None
    way = "high" if a3["bias"] > 0 else "low"
    return (f"hold-out: approach 3 refitted without {holdout['held_out']} predicts its {holdout['n_holdout']} runs' "
            f"losses {abs(a3['bias']):.1%} too {way} on average ({a3['too_high']} of {holdout['n_holdout']} too high): "
            f"losses extrapolated beyond the data are likely too {way} as well")
