"""Approach 3's forms of L(N, D): each refitted without the hold-out's runs, the one chosen (``--form auto``) and
every form fitted side by side, as rows and as text."""

from __future__ import annotations

import numpy as np

from analysis.budgets import Budgets
from analysis.fit_config import FitConfig
from analysis.holdout import holdout_parametric, holdout_skip
from analysis.parametric import ParametricFit, fit_parametric, fit_weighted, params_from_theta, rmse_log_loss
from analysis.table import InputError, RunTable
from lab.measure.laws import CHINCHILLA, FORMS, SHARED, Form


def form_holdouts(table: RunTable, budgets: Budgets, config: FitConfig
                  ) -> tuple[dict[str, tuple[ParametricFit, dict]], str | None]:
    """Every form refitted without the hold-out's runs and its errors on them (``holdout_parametric``), by form
    name; empty, with the reason, when the hold-out is disabled (``--no-holdout``) or cannot run."""
    if not config.holdout:
        return {}, "the hold-out is disabled (--no-holdout)"
    held, what, skip = holdout_skip(table, budgets, config)
    if skip is not None:
        return {}, skip
    train = int((~held).sum())
    return {name: holdout_parametric(table, held, what, config, form) for name, form in FORMS.items()
            if fittable(form, train)}, None


def fittable(form: Form, n_runs: int) -> bool:
    """Whether ``n_runs`` runs can fit ``form``: more runs than its parameters."""
    return n_runs > form.size


def choose_form(table: RunTable, budgets: Budgets, config: FitConfig,
                refits: dict[str, tuple[ParametricFit, dict]] | None = None, skip: str | None = None
                ) -> tuple[Form, dict | None]:
    """Approach 3's form: the one named, or with ``auto`` the one whose refit without the hold-out's runs predicts
    their losses with the smallest mean relative error (the earlier in FORMS on a tie; Chinchilla's without a
    hold-out). ``refits`` and ``skip`` are ``form_holdouts``'s, computed here when not given."""
    if config.form != "auto":
        form = FORMS[config.form]
        if not fittable(form, len(table.n)):
            raise InputError(f"--form {form.name} has {form.size} parameters and needs more runs than that, got "
                             f"{len(table.n)}; --form auto or shared fits from {SHARED.size + 1}")
        return form, None
    if refits is None:
        refits, skip = form_holdouts(table, budgets, config)
    if not refits:
        form = CHINCHILLA if fittable(CHINCHILLA, len(table.n)) else SHARED
        extra = "" if form is CHINCHILLA else f"; {len(table.n)} runs are too few for Chinchilla's five parameters"
        return form, {"chosen": form.name, "why": f"no hold-out to choose by: {skip}{extra}", "holdout": {}}
    errors = {name: refit[1] for name, refit in refits.items()}
    best = min(errors, key=lambda name: errors[name]["mean_rel_error"])  # FORMS lists Chinchilla's first
    summary = {name: {k: e[k] for k in ("mean_rel_error", "bias", "too_high", "converged")}
               for name, e in errors.items()}
    shown = ", ".join(f"{name} {e['mean_rel_error']:.2%}" for name, e in errors.items())
    what = errors[best]["held_out"]
    choice = {"chosen": best, "holdout": summary, "held_out": what,
              "why": f"the smallest mean relative error on {what}, refitted without it: {shown}"}
    return FORMS[best], choice


def forms_table(table: RunTable, chosen: ParametricFit, refits: dict[str, tuple[ParametricFit, dict]],
                skip: str | None, config: FitConfig) -> list[dict]:
    """Every form fitted to all runs, side by side: its parameters, allocation exponent a, in-sample RMSE of log
    loss and hold-out errors (None, with ``skip``, without a hold-out); the chosen one marked. A form with a hold-out
    refit starts from its optimum, one without from the grid, as approach 3 does."""
    n, d, loss, k = table.n, table.d, table.loss, table.flops_k
    rows = []
    for name, form in FORMS.items():
        if not fittable(form, len(n)):
            rows.append({"form": name, "formula": f"L = {form.formula}", "chosen": False, "n_params": form.size,
                         "skipped": f"needs more than {form.size} runs"})
            continue
        if form is chosen.form:
            theta, converged = chosen.theta, chosen.converged
        elif name in refits:  # from its hold-out refit's optimum, which lies close: one start, no grid
            thetas, ok = fit_weighted(refits[name][0].theta, n, d, loss, fit_weights(table), config.huber_delta, form)
            theta, converged = thetas[0], bool(ok[0])
        else:
            fit = fit_parametric(n, d, loss, n_starts=config.n_starts, delta=config.huber_delta, form=form,
                                 weights=table.replicate_weights)
            theta, converged = fit.theta, fit.converged
        params = params_from_theta(theta, k, form)
        rmse = rmse_log_loss(theta, n, d, loss, form)
        errors = refits[name][1] if name in refits else None
        rows.append({"form": name, "formula": f"L = {form.formula}", "chosen": form is chosen.form,
                     "n_params": form.size, "skipped": None, "params": {key: params[key] for key in form.names},
                     "a": params["a"],
                     "converged": converged, "rmse_log_loss": rmse,
                     "holdout": None if errors is None else {key: errors[key] for key in
                                                             ("mean_rel_error", "max_rel_error", "bias", "converged")},
                     "holdout_skipped": skip if errors is None else None})
    return rows


def forms_cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``forms_table``'s rows as a header and rows of text, for the terminal and the report (chosen marked *)."""
    header = ["form", "L", "parameters", "a", "RMSE log loss", "hold-out mean rel. error", "hold-out bias"]
    cells = []
    for row in rows:
        if row["skipped"]:
            cells.append([row["form"], row["formula"][4:], f"not fitted: {row['skipped']}", "-", "-", "-", "-"])
            continue
        held = row["holdout"]
        params = ", ".join(f"{k}={v:.4g}" for k, v in row["params"].items() if v is not None)
        cells.append([row["form"] + (" *" if row["chosen"] else ""), row["formula"][4:],
                      params + ("" if row["converged"] else " (NOT converged)"),
                      "-" if row["a"] is None else f"{row['a']:.4g}", f"{row['rmse_log_loss']:.3g}",
                      "-" if held is None else f"{held['mean_rel_error']:.2%}",
                      "-" if held is None else f"{held['bias']:+.2%}"])
    return header, cells


def fit_weights(table: RunTable) -> np.ndarray:
    """One row of approach 3's weights for ``fit_weighted``: every run's ``replicate_weights``, or ones."""
    weights = table.replicate_weights
    return np.ones((1, len(table.n))) if weights is None else weights[None, :]
