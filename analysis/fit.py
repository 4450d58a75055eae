"""Run every approach on a table of runs and collect the results (what fit.json holds).

``fit_runs`` is a pure function of the runs and a :class:`FitConfig`. It groups the runs into
compute budgets (``budgets``), fits approach 3 (``parametric``), approach 2 (``isoflop``, when there
are budgets) and approach 1 (``envelope``: the frontier of final losses, or the envelope of training
curves with ``envelope="curves"``), refits all of them on the same bootstrap resamples, checks whether each law is
identified (``identify``), compares them and picks the one to plan with (``compare``), predicts
N_opt, D_opt and loss at the requested budgets, runs a hold-out check and gathers warnings. Seed replicates
(``RunTable.experiments``) count once each: averaged where an approach takes one loss per size, weighted 1/k in
approach 3 (``RunTable.replicate_weights``) and averaged in the outlier check. An approach that the design cannot
identify, even on approach 3's losses without noise, gets a design note instead of a warning.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from analysis import akima, identify
from analysis.bootstrap import Problem, Resamples, bootstrap, canonical_order, interval
from analysis.budgets import Budgets, group_budgets
from analysis.compare import TITLES, Allocation, disagreements, parametric_allocation, preferred
from analysis.downstream import fit_task, predict_score
from analysis.envelope import Envelope, Frontier, build_envelope, build_frontier
from lab.measure.laws import CHINCHILLA, FORMS, SHARED, Form
from analysis.identify import Identification
from analysis.isoflop import METHODS, MIN_SIDE, BudgetMinima, PowerLaws, budget_minima
from analysis.other_laws import LAWS, fit_data_constrained, fit_kaplan
from analysis.parametric import (
    ParametricFit,
    compute_optimal,
    fit_parametric,
    fit_weighted,
    gauss_newton_condition,
    named_samples,
    params_from_theta,
    predict_loss,
    start_grid,
)
from analysis.robust import HUBER_DELTA
from analysis.table import MIN_RUNS, InputError, RunTable
from lab.runtime.scores import PREFIX as TASK_PREFIX

SCHEMA_VERSION = 2
FORM_CHOICES = ("auto", *FORMS)
HOLDOUT_BIAS = 0.01  # mean signed relative error of the held-out losses beyond which the fit warns
HOLDOUT_FRACTION = 0.2  # with continuous budgets, the runs with the largest C that the hold-out keeps back
# A run is an outlier when its log-loss residual from approach 3 lies more than OUTLIER_Z robust standard
# deviations (1.4826 x the median absolute deviation) from the median residual: Iglewicz and Hoaglin's cut-off
# for modified z-scores. The scale is floored at OUTLIER_SCALE_FLOOR so that noiseless data flag nothing.
OUTLIER_Z = 3.5
OUTLIER_SCALE_FLOOR = 1e-4
# RMSE of log loss below which the data are called noiseless: no measured loss is reproducible to 1e-6.
NOISELESS_RMSE = 1e-6
# What would identify an approach that the design cannot (``Identification.by_design``).
DESIGN_REMEDY = {"envelope": "; more sizes per budget, or training curves whose every point is an end point "
                             "(cooldowns, --envelope curves), would"}
# Huber deltas of the sensitivity table (the fit's own delta is added).
DELTA_GRID = (1e-4, 1e-3, 1e-2, 1e-1)
# What approach 1 takes its points from: end points only (final losses), or every point of the training curves,
# valid only when each logged point is an end point (see analysis.envelope).
ENVELOPE_SOURCES = ("final", "curves")


@dataclass
class FitConfig:
    """Options of a fit; the defaults follow the issue and Hoffmann et al."""

    budget_tol: float = 0.05  # relative spread of C within one budget
    isoflop_minimum: str = "akima"  # which per-budget minimum the IsoFLOP power laws use (analysis.isoflop)
    n_bootstrap: int = 1000
    seed: int = 0
    ci_level: float = 0.95
    workers: int = 1  # processes for the bootstrap
    n_starts: int = 8  # engine runs from the best grid points
    predict: tuple[float, ...] = ()  # FLOP budgets; empty: 1x, 10x and 100x the largest C in the data
    holdout: bool = True
    extrapolation_warn: float = 100.0  # warn when a prediction exceeds this multiple of the data's C
    envelope: str = "final"  # approach 1's points: one of ENVELOPE_SOURCES
    huber_delta: float = HUBER_DELTA  # approach 3's Huber threshold on log-loss residuals
    holdout_budgets: int = 1  # the hold-out keeps back this many of the largest budgets ...
    holdout_above: float | None = None  # ... or, when set, every run with C above this
    delta_sensitivity: bool = True  # refit approach 3 at each of DELTA_GRID for the report
    law: str = "chinchilla"  # a form of L(N, D) fitted beside approach 3 (analysis.other_laws), or only approach 3
    form: str = "chinchilla"  # approach 3's form (lab.measure.laws), or "auto": chosen by the hold-out
    progress: bool = field(default=True, compare=False)

    def validate(self) -> None:
        """Raise InputError for an option that cannot work."""
        checks = [
            (self.budget_tol >= 0, f"budget tolerance must be >= 0, got {self.budget_tol}"),
            (self.isoflop_minimum in METHODS, f"IsoFLOP minimum must be one of {', '.join(METHODS)}"),
            (self.n_bootstrap >= 0, f"bootstrap count must be >= 0, got {self.n_bootstrap}"),
            (0 < self.ci_level < 1, f"interval level must be in (0, 1), got {self.ci_level}"),
            (self.workers >= 1, f"workers must be >= 1, got {self.workers}"),
            (self.n_starts >= 1, f"starts must be >= 1, got {self.n_starts}"),
            (all(math.isfinite(c) and c > 0 for c in self.predict), "--predict budgets must be positive FLOPs"),
            (self.envelope in ENVELOPE_SOURCES, f"envelope source must be one of {', '.join(ENVELOPE_SOURCES)}"),
            (math.isfinite(self.huber_delta) and self.huber_delta > 0,
             f"--huber-delta must be a positive number, got {self.huber_delta}"),
            (self.holdout_budgets >= 1, f"--holdout-budgets must be >= 1, got {self.holdout_budgets}"),
            (self.law in LAWS, f"--law must be one of {', '.join(LAWS)}, got '{self.law}'"),
            (self.form in FORM_CHOICES, f"--form must be one of {', '.join(FORM_CHOICES)}, got '{self.form}'"),
            (self.holdout_above is None or (math.isfinite(self.holdout_above) and self.holdout_above > 0),
             f"--holdout-above must be positive FLOPs, got {self.holdout_above}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)


@dataclass
class Approach:
    """One approach's allocation law, its resamples and whether the data identify it."""

    key: str
    skipped: str | None  # why the approach was not run
    law: PowerLaws | None
    samples: PowerLaws | None
    identification: Identification

    def allocation(self) -> Allocation | None:
        if self.law is None:
            return None
        return Allocation(self.key, self.law, self.samples, self.identification.identified,
                          self.identification.reasons)


@dataclass
class FitResult:
    """Everything one fit produced; ``to_dict`` gives fit.json, plots and reports read the rest."""

    table: RunTable
    config: FitConfig
    budgets: Budgets
    parametric: ParametricFit
    condition: float
    resamples: Resamples | None
    minima: BudgetMinima | None  # full data, one row; None without budgets
    isoflop_laws: dict[str, PowerLaws]  # full-data law per minimum method
    envelope: Envelope | Frontier | None
    approaches: dict[str, Approach]
    preferred: str | None
    why: str
    disagreements: list[dict]
    predictions: list[dict]
    holdout: dict
    warnings: list[tuple[str, str]]
    outliers: dict = field(default_factory=dict)
    noiseless: bool = False
    delta_sensitivity: list[dict] = field(default_factory=list)
    law: dict | None = None  # the --law form fitted beside approach 3 (analysis.other_laws), when not chinchilla
    form_choice: dict | None = None  # with --form auto: each form's hold-out error and the choice
    forms: list[dict] = field(default_factory=list)  # every form fitted side by side (``forms_table``)
    downstream: list[dict] = field(default_factory=list)  # per task column: the loss -> error link, predictions
    design_notes: list[str] = field(default_factory=list)  # approaches the design cannot identify (not warnings)

    @property
    def flops_max(self) -> float:
        return float(self.table.c.max())

    @property
    def thetas(self) -> np.ndarray | None:
        return None if self.resamples is None else self.resamples.thetas

    def to_dict(self) -> dict:
        """The fit.json document (NaN and infinities become null)."""
        return json_ready({
            "schema_version": SCHEMA_VERSION,
            "source": self.table.source,
            "params_count": self.table.params_count,
            "loss": {"source": self.table.loss_source, "unit": "nats per token",
                     "note": "cross-entropy taken as nats per token, the unit of the published laws"},
            "notes": self.table.notes,
            "config": {k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in asdict(self.config).items() if k != "progress"},
            "data": self._data(),
            "approach3": self._approach3(),
            "isoflop": self._isoflop(),
            "envelope": self._envelope(),
            "comparison": {"preferred": self.preferred, "why": self.why, "disagreements": self.disagreements},
            "predictions": self.predictions,
            "holdout": self.holdout,
            "outliers": self.outliers,
            "dropped": self.table.dropped,
            "noiseless": self.noiseless,
            "delta_sensitivity": self.delta_sensitivity,
            "law": self.law,
            "downstream": [{k: v for k, v in d.items() if k not in ("theta", "thetas")} for d in self.downstream],
            "warnings": [{"code": c, "message": m} for c, m in self.warnings],
            "design_notes": self.design_notes,
        })

    def _data(self) -> dict:
        t, b = self.table, self.budgets
        ratio = t.d / t.n
        return {
            "n_runs": len(t.runs), "n_curves": len(t.curves), "curve_loss": t.curve_loss, "dataset": t.dataset,
            "params": [t.n.min(), t.n.max()], "tokens": [t.d.min(), t.d.max()], "flops": [t.c.min(), t.c.max()],
            "loss": [t.loss.min(), t.loss.max()], "tokens_per_param": [ratio.min(), ratio.max()],
            "flops_per_param_token": {"k": t.flops_k, "derived": t.flops_derived, "outliers": t.flops_outliers},
            "duplicates": t.duplicates, "duplicate_policy": t.duplicate_policy,
            "budgets": {"mode": "continuous" if b.continuous else "discrete", "tolerance": b.tol,
                        "single": b.single, "unassigned": int(np.sum(b.labels < 0)), "wide": b.wide,
                        "groups": [{"flops": float(f), "n_runs": int(np.sum(b.labels == g)), "spread": float(s)}
                                   for g, (f, s) in enumerate(zip(b.flops, b.spread))]},
        }

    def _ci(self, samples: dict[str, np.ndarray]) -> dict:
        level = self.config.ci_level
        return {"level": level, **{k: interval(v, level) for k, v in samples.items()}}

    def _approach3(self) -> dict:
        p, t, k, form = self.parametric, self.table, self.table.flops_k, self.parametric.form
        out: dict = {"form": form.name, "formula": f"L = {form.formula}", "form_choice": self.form_choice,
                     "forms": self.forms,
                     **p.params_at(k)}
        predicted = predict_loss(p.theta, t.n, t.d, form)
        out["fit"] = {
            "method": f"Huber (delta={self.config.huber_delta:g}) on log-space residuals via log-sum-exp, summed; "
                      f"least squares (trust-region reflective) from the {p.n_starts} best of "
                      f"{len(start_grid(form))} grid points",
            "huber_delta": self.config.huber_delta, "objective": p.objective, "converged": p.converged,
            "message": p.message, "evaluations": p.n_evaluations, "n_starts": p.n_starts,
            "starts_agreeing": p.starts_agreeing, "optimum_inside_grid": p.optimum_inside_grid,
            "best_start": dict(zip(form.theta_names, p.best_start)),
            "condition_number": self.condition, "flops_k": k,
        }
        resid = t.loss - predicted
        out["goodness"] = {"huber_objective": p.objective, "rmse_loss": float(np.sqrt(np.mean(resid ** 2))),
                           "rmse_log_loss": float(np.sqrt(np.mean(np.log(t.loss / predicted) ** 2))),
                           "max_abs_residual": float(np.max(np.abs(resid))), "n_runs": len(resid)}
        out["ci"], out["covariance"] = None, None
        if self.resamples is not None:
            thetas = self.resamples.thetas
            out["ci"] = self._ci(named_samples(thetas, k, form))
            out["bootstrap"] = {"resamples": len(thetas), "seed": self.config.seed,
                                "converged": int(self.resamples.converged.sum()),
                                "refit": "one least-squares fit per resample from the full-data optimum"}
            good = thetas[np.all(np.isfinite(thetas), axis=1)]
            if len(good) > 5:
                cov = np.cov(good, rowvar=False)
                std = np.sqrt(np.diag(cov))
                with np.errstate(all="ignore"):
                    out["covariance"] = {"names": list(form.theta_names), "std": std, "matrix": cov,
                                         "correlation": cov / np.outer(std, std)}
        out["identification"] = self.approaches["approach3"].identification.to_dict()
        return out

    def _law(self, law: PowerLaws | None, samples: PowerLaws | None) -> dict | None:
        if law is None:
            return None
        out: dict = law.row()
        out["ci"] = None if samples is None else self._ci(
            {"a": samples.a, "b": samples.b, "k_N": samples.k_n, "k_D": samples.k_d})
        return out

    def _isoflop(self) -> dict:
        app, method = self.approaches["isoflop"], self.config.isoflop_minimum
        fits = {}
        if app.skipped is None:
            boot = self.resamples.isoflop if self.resamples is not None else {}
            fits = {m: self._law(self.isoflop_laws[m], boot.get(m)) for m in METHODS}
        primary = fits.get(method) or {}
        return {"skipped": app.skipped is not None, "reason": app.skipped, "minimum": method,
                **{k: primary.get(k) for k in ("a", "b", "k_N", "k_D", "ci")},
                "identification": app.identification.to_dict(), "fits": fits, "minima": self._minima()}

    def _minima(self) -> list[dict]:
        m, t, b = self.minima, self.table, self.budgets
        if m is None:
            return []
        out = []
        for g, flops in enumerate(b.flops):
            rows = np.flatnonzero(b.labels == g)
            low = int(m.lowest_row[0, g])
            vertex = None
            if m.vertex_ok[0, g]:
                n_v = float(np.exp(m.vertex_log_n[0, g]))
                vertex = {"params": n_v, "tokens": float(flops / (t.flops_k * n_v)), "loss": float(m.vertex_loss[0, g])}
            spline = None
            if np.isfinite(m.spline_log_n[0, g]):
                n_s = float(np.exp(m.spline_log_n[0, g]))
                spline = {"params": n_s, "tokens": float(flops / (t.flops_k * n_s)), "loss": float(m.spline_loss[0, g])}
            centre, half = m.centre[0, g], m.half_width[0, g]
            out.append({
                "flops": float(flops), "n_runs": len(rows), "spread": float(b.spread[g]),
                "n_distinct_params": int(m.n_distinct[0, g]),
                "params_range": [float(t.n[rows].min()), float(t.n[rows].max())],
                "lowest": {"run_id": str(t.runs["run_id"].iloc[low]), "params": float(t.n[low]),
                           "tokens": float(t.d[low]), "loss": float(t.loss[low])},
                "sizes_below": int(m.left[0, g]), "sizes_above": int(m.right[0, g]),
                "window": {"params": [float(np.exp(centre - half)), float(np.exp(centre + half))],
                           "n_runs": int(m.in_window[0, g])},
                "vertex": vertex, "spline": spline, "status": _status(m, g),
                "used": {k: bool(m.usable(k)[0, g]) for k in METHODS},
            })
        return out

    def _envelope(self) -> dict:
        app = self.approaches["envelope"]
        out = {"skipped": app.skipped is not None, "reason": app.skipped,
               "identification": app.identification.to_dict()}
        if app.skipped is not None:
            return out
        if isinstance(self.envelope, Envelope):
            source = (f"training curves ({self.table.curve_loss} loss), every logged point taken as an end point "
                      "(--envelope curves)")
        elif self.budgets.continuous:
            source = "final losses, end points only (frontier of runs with the lowest loss so far in C)"
        else:
            source = ("final losses, end points only (per budget the lowest run, where it beats every smaller "
                      "budget)")
        points = self.envelope.points()
        for p in points:
            p["run_id"] = str(self.table.runs["run_id"].iloc[p.pop("row")])
        return {**out, "source": source, "points_from": self.config.envelope, "n_curves": len(self.table.curves),
                **self._law(app.law, app.samples), "points": points}


def _edge_check(points: list[dict], n: np.ndarray, labels: np.ndarray) -> identify.Check:
    """Approach 1 on budgets: a frontier run at the smallest or largest size of its budget is no sampled minimum."""
    edge = [p for p in points if labels[p["row"]] >= 0
            and p["params"] in (n[labels == labels[p["row"]]].min(), n[labels == labels[p["row"]]].max())]
    shown = ", ".join(f"{p['params']:.3g} at C = {p['flops']:.3g}" for p in edge[:5])
    return identify.Check("edges", not edge, f"{len(edge)} of {len(points)} envelope point(s) are the smallest or "
                          "largest size of their budget, so the minimum there was not sampled"
                          + (f" (N = {shown})" if edge else ""))


def _status(m: BudgetMinima, g: int) -> str:
    if m.left[0, g] == 0 or m.right[0, g] == 0:
        return "edge: the lowest run is the smallest or largest size"
    if not m.sided[0, g]:
        return f"one-sided: fewer than {MIN_SIDE} sizes on one side of the lowest run"
    if not m.vertex_ok[0, g]:
        return "vertex outside its window (profile too flat or noisy)"
    return "ok"


def json_ready(obj: Any) -> Any:
    """JSON-ready copy: numpy scalars to Python, non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def _predict(flops: float, result: dict, config: FitConfig, flops_max: float, flops_k: float) -> dict:
    """Every approach's allocation at ``flops``, and approach 3's loss there."""
    level = config.ci_level
    out: dict = {"flops": flops, "extrapolation": flops / flops_max}
    for key, app in result["approaches"].items():
        alloc = app.allocation()
        out[key] = None if alloc is None else {**alloc.at(flops, level), "identified": alloc.identified}
    a3 = out["approach3"]
    if a3 is None:  # alpha or beta not positive: no compute-optimal allocation
        return out
    n, d, loss = (float(v[0, 0]) for v in compute_optimal(result["theta"], flops, flops_k, result["form"]))
    a3.update(loss=loss, tokens_per_param=d / n)
    if result["thetas"] is not None:
        ns, ds, ls = (v[:, 0] for v in compute_optimal(result["thetas"], flops, flops_k, result["form"]))
        a3["ci"].update(loss=interval(ls, level), tokens_per_param=interval(ds / ns, level))
    return out


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


def _holdout_skip(table: RunTable, budgets: Budgets, config: FitConfig) -> tuple[np.ndarray, str, str | None]:
    """The held-out runs, their description, and why the hold-out cannot run (None when it can)."""
    n, d = table.n, table.d
    held, what = _held_out(table, budgets, config)
    train = ~held
    if not held.any():
        return held, what, f"no run to hold out ({what})"
    if train.sum() < MIN_RUNS or len(np.unique(n[train])) < 2 or len(np.unique(d[train])) < 2:
        return held, what, f"fewer than {MIN_RUNS} runs (or too few distinct N, D) outside {what}"
    return held, what, None


def _holdout_parametric(table: RunTable, held: np.ndarray, what: str, config: FitConfig, form: Form
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


def form_holdouts(table: RunTable, budgets: Budgets, config: FitConfig
                  ) -> tuple[dict[str, tuple[ParametricFit, dict]], str | None]:
    """Every form refitted without the hold-out's runs and its errors on them (``_holdout_parametric``), by form
    name; empty, with the reason, when the hold-out is disabled (``--no-holdout``) or cannot run."""
    if not config.holdout:
        return {}, "the hold-out is disabled (--no-holdout)"
    held, what, skip = _holdout_skip(table, budgets, config)
    if skip is not None:
        return {}, skip
    train = int((~held).sum())
    return {name: _holdout_parametric(table, held, what, config, form) for name, form in FORMS.items()
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
            thetas, ok = fit_weighted(refits[name][0].theta, n, d, loss, _fit_weights(table), config.huber_delta, form)
            theta, converged = thetas[0], bool(ok[0])
        else:
            fit = fit_parametric(n, d, loss, n_starts=config.n_starts, delta=config.huber_delta, form=form,
                                 weights=table.replicate_weights)
            theta, converged = fit.theta, fit.converged
        params = params_from_theta(theta, k, form)
        rmse = float(np.sqrt(np.mean((np.log(loss) - np.log(predict_loss(theta, n, d, form))) ** 2)))
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


def _holdout(table: RunTable, budgets: Budgets, minima: BudgetMinima | None, config: FitConfig,
             form: Form = CHINCHILLA, refit: tuple[ParametricFit, dict] | None = None) -> dict:
    """Refit without the runs ``_held_out`` names (or take ``refit``, ``form_holdouts``'s), then predict each."""
    n, d, c, loss = table.n, table.d, table.c, table.loss
    held, what, skip = _holdout_skip(table, budgets, config)
    if skip is not None:
        return {"skipped": True, "reason": skip}
    train = ~held
    fit, errors = refit or _holdout_parametric(table, held, what, config, form)
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


def _holdout_bias(holdout: dict) -> str | None:
    """A warning when approach 3, refitted without the held-out runs, misses their losses one way on average by
    more than HOLDOUT_BIAS: its extrapolated losses are then likely off the same way."""
    a3 = holdout["approach3"]
    if abs(a3["bias"]) <= HOLDOUT_BIAS:
        return None
    way = "high" if a3["bias"] > 0 else "low"
    return (f"hold-out: approach 3 refitted without {holdout['held_out']} predicts its {holdout['n_holdout']} runs' "
            f"losses {abs(a3['bias']):.1%} too {way} on average ({a3['too_high']} of {holdout['n_holdout']} too high): "
            f"losses extrapolated beyond the data are likely too {way} as well")


def _budget_warnings(budgets: Budgets, minima: BudgetMinima | None, n_runs: int,
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


def fit_without_outliers(load: Callable[[tuple[str, ...]], RunTable], config: FitConfig
                         ) -> tuple[FitResult, tuple[str, ...]]:
    """Fit the table ``load(())`` gives; if the fit flags outliers (``find_outliers``), fit ``load(flagged)``, the
    table without them, instead. (The result, the runs left out.)"""
    result = fit_runs(load(()), config)
    flagged = tuple(o["run_id"] for o in result.outliers.get("runs", []))
    if not flagged:
        return result, ()
    table = load(flagged)
    for run in table.dropped:
        if run["run_id"] in flagged:
            run["reason"] = "an outlier of the fit of every run (--drop-outliers)"
    return fit_runs(table, config), flagged


def fit_runs(table: RunTable, config: FitConfig | None = None) -> FitResult:
    """Fit all approaches to ``table`` with bootstrap intervals; see the module docstring."""
    config = config or FitConfig()
    config.validate()
    unique = _unique_tokens(table) if config.law == "data-constrained" else None
    if config.envelope == "curves" and len(table.curves) < 2:
        raise InputError("--envelope curves needs the training curves (metrics.jsonl) of at least 2 runs; "
                         f"the input has {len(table.curves)}")
    warnings = list(table.warnings)
    if unique is None and "unique_tokens" in table.runs.columns:
        warnings.append(("unique_tokens", "the table gives each run's unique tokens: --law data-constrained fits "
                         "Muennighoff et al.'s law, in which repeated data count less, beside approach 3"))
    n, d, c, loss, k = table.n, table.d, table.c, table.loss, table.flops_k
    level = config.ci_level

    budgets = group_budgets(c, config.budget_tol, n)
    minima = (budget_minima(n, loss, budgets.labels, budgets.flops, np.ones((1, len(n))), table.experiments)
              if budgets.count else None)
    warnings += _budget_warnings(budgets, minima, len(n), config.isoflop_minimum)

    refits, refits_skip = form_holdouts(table, budgets, config)
    form, form_choice = choose_form(table, budgets, config, refits, refits_skip)
    parametric = fit_parametric(n, d, loss, n_starts=config.n_starts, delta=config.huber_delta, form=form,
                                weights=table.replicate_weights)
    forms = forms_table(table, parametric, refits, refits_skip, config)
    condition = gauss_newton_condition(parametric.theta, n, d, form)
    outliers = find_outliers(table, parametric.theta, form)
    if outliers["runs"]:
        shown = ", ".join(f"{o['run_id']} ({o['residual']:+.3g} nats, z = {o['z']:+.1f})" for o in outliers["runs"][:5])
        averaged = " (seed replicates averaged)" if outliers["replicates_averaged"] else ""
        warnings.append(("outliers", f"{len(outliers['runs'])} run(s) lie more than {OUTLIER_Z:g} robust standard "
                         f"deviations from approach 3's law{averaged}: {shown}"
                         f"{' ...' if len(outliers['runs']) > 5 else ''}; "
                         "drop them with --exclude RUN_ID (or a condition) or --drop-highest-loss K"))
    noise = _noise_check(table, parametric.theta, form)
    if noise is not None:
        warnings.append(("noiseless", noise))
    if 2 * parametric.starts_agreeing < parametric.n_starts:  # near-zero objectives are compared absolutely
        warnings.append(("start_grid", f"approach 3: only {parametric.starts_agreeing} of {parametric.n_starts} "
                         "starts reached the best objective: the objective has other optima"))

    single = "every run is at one compute budget; a power law in C needs several"
    iso_skip = (single if budgets.single else
                "C does not cluster into compute budgets (continuous budgets)" if budgets.continuous else None)
    isoflop_laws = {}
    if iso_skip is None:
        isoflop_laws = {m: minima.power_laws(m, n, d, k) for m in METHODS}
        usable = int(isoflop_laws[config.isoflop_minimum].n_points[0])
        if usable < 2:
            iso_skip = f"{usable} budget(s) with a located minimum; the power law needs 2"
    envelope, env_skip = None, single if budgets.single else None
    noiseless: Frontier | None = None  # approach 1 on approach 3's losses: what the design alone identifies
    if env_skip is None:
        if config.envelope == "curves":
            envelope = build_envelope(table.curves)
        else:
            in_budget = budgets.labels >= 0
            budget_c = np.where(in_budget, budgets.flops[np.maximum(budgets.labels, 0)] if budgets.count else c, c)
            envelope = build_frontier(c, n, d, loss, budget_c, table.experiments)
            noiseless = build_frontier(c, n, d, predict_loss(parametric.theta, n, d, form), budget_c,
                                       table.experiments)
    env_law = None
    if envelope is not None and env_skip is None:
        env_law = envelope.power_laws(np.ones((1, len(n))))
        if not np.isfinite(env_law.a[0]):
            env_skip = "one run is lowest at every FLOP count; no power law to fit"

    resamples = None
    if config.n_bootstrap > 0:
        problem = Problem(theta0=parametric.theta, n=n, d=d, loss=loss, labels=budgets.labels,
                          budget_flops=budgets.flops if iso_skip is None else np.zeros(0), flops_k=k,
                          envelope=envelope if env_skip is None else None, seed=config.seed,
                          huber_delta=config.huber_delta, form=form, order=canonical_order(c, n, d, loss),
                          experiments=table.experiments, fit_weights=table.replicate_weights,
                          noiseless_envelope=noiseless if env_skip is None else None)
        resamples = bootstrap(problem, config.n_bootstrap, config.workers, config.progress)
        failed = int((~resamples.converged).sum())
        if failed > 0.05 * len(resamples.converged):
            warnings.append(("bootstrap_convergence", f"approach 3: {failed} of {len(resamples.converged)} bootstrap "
                             "refits did not converge"))

    approaches = _approaches(table, config, budgets, parametric, condition, resamples, isoflop_laws, iso_skip,
                             env_law, env_skip, envelope)
    design_notes = []
    for key, app in approaches.items():
        if app.skipped is not None:
            warnings.append((f"{key}_skipped", f"{TITLES[key]} skipped: {app.skipped}"))
        elif app.identification.by_design:
            design_notes.append(f"{TITLES[key]} cannot be identified by this design, whatever the runs' noise: "
                                + "; ".join(app.identification.reasons) + DESIGN_REMEDY.get(key, ""))
        elif not app.identification.identified:
            warnings.append(("unidentified", f"{TITLES[key]} is not identified by the data: "
                             + "; ".join(app.identification.reasons)))

    allocations = {key: a for key, app in approaches.items() if (a := app.allocation()) is not None}
    choice, why = preferred({key: (key in allocations and app.identification.identified, app.identification.reasons)
                             for key, app in approaches.items()})
    flops_max = float(c.max())
    budgets_c = config.predict or tuple(m * flops_max for m in (1.0, 10.0, 100.0))
    parts = {"approaches": approaches, "theta": parametric.theta, "form": form,
             "thetas": None if resamples is None else resamples.thetas}
    predictions = [_predict(float(f), parts, config, flops_max, k) for f in budgets_c]
    disagree = [x for f in budgets_c for x in disagreements(allocations, float(f), level)]
    for x in disagree:
        warnings.append(("approaches_disagree", "APPROACHES DISAGREE: " + x["message"]))
    far = [f"{p['flops']:.3g}" for p in predictions if p["extrapolation"] > config.extrapolation_warn]
    if far:
        warnings.append(("extrapolation", f"prediction(s) at C = {', '.join(far)} extrapolate more than "
                         f"{config.extrapolation_warn:g}x beyond the largest compute in the data ({flops_max:.3g})"))

    holdout = {"skipped": True, "reason": "disabled"}
    if config.holdout:
        holdout = _holdout(table, budgets, minima, config, form, refits.get(form.name))
        if holdout["skipped"]:
            warnings.append(("holdout_skipped", f"hold-out check skipped: {holdout['reason']}"))
        elif (bias := _holdout_bias(holdout)) is not None:
            warnings.append(("holdout_bias", bias))

    sensitivity = delta_sensitivity(table, parametric, config.huber_delta) if config.delta_sensitivity else []
    other = None
    if config.law != "chinchilla":
        rmse = float(np.sqrt(np.mean((np.log(loss) - np.log(predict_loss(parametric.theta, n, d, form))) ** 2)))
        start = parametric.theta if form is CHINCHILLA else fit_parametric(
            n, d, loss, n_starts=config.n_starts, delta=config.huber_delta).theta  # it extends Chinchilla's form
        other = (fit_kaplan(n, d, loss, rmse, config.huber_delta) if config.law == "kaplan" else
                 fit_data_constrained(n, d, unique, loss, start, rmse, config.huber_delta))
        if not other["converged"]:
            warnings.append(("law_convergence", f"the {config.law} law's fit did not converge"))
    downstream = downstream_fits(table, predictions, config)
    return FitResult(table=table, config=config, budgets=budgets, parametric=parametric, condition=condition,
                     resamples=resamples, minima=minima, isoflop_laws=isoflop_laws, envelope=envelope,
                     approaches=approaches, preferred=choice, why=why, disagreements=disagree,
                     predictions=predictions, holdout=holdout, warnings=warnings, outliers=outliers,
                     noiseless=noise is not None, delta_sensitivity=sensitivity, law=other,
                     form_choice=form_choice, forms=forms, downstream=downstream, design_notes=design_notes)


def downstream_fits(table: RunTable, predictions: list[dict], config: FitConfig) -> list[dict]:
    """For each ``task_NAME`` column, the loss -> task error link (analysis.downstream) and the task's score at
    each prediction budget's compute-optimal loss (approach 3's)."""
    out = []
    for column in [str(c) for c in table.runs.columns if str(c).startswith(TASK_PREFIX)]:
        scores = pd.to_numeric(table.runs[column], errors="coerce").to_numpy(float)
        fit = fit_task(table.loss, scores, config.ci_level, min(config.n_bootstrap, 200), config.seed)
        entry = {"task": column.removeprefix(TASK_PREFIX), **fit, "predictions": []}
        for p in predictions if not fit["skipped"] else []:
            a3 = p.get("approach3") or {}
            if a3.get("loss") is not None:
                entry["predictions"].append({"flops": p["flops"], **predict_score(
                    fit, a3["loss"], (a3.get("ci") or {}).get("loss"), config.ci_level)})
        out.append(entry)
    return out


def _unique_tokens(table: RunTable) -> np.ndarray:
    """Each run's unique tokens, for the data-constrained law; InputError when the table has none."""
    if "unique_tokens" not in table.runs.columns:
        raise InputError("--law data-constrained needs each run's unique tokens: a 'unique_tokens' column (map "
                         "another with --column unique_tokens=NAME)")
    values = pd.to_numeric(table.runs["unique_tokens"], errors="coerce").to_numpy(float)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        raise InputError(f"column 'unique_tokens' has {int(bad.sum())} missing, non-numeric or non-positive value(s)")
    return values


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


def _noise_check(table: RunTable, theta: np.ndarray, form: Form) -> str | None:
    """A warning when the law fits every run to rounding precision (noiseless or derived data), else None."""
    rmse = float(np.sqrt(np.mean((np.log(table.loss) - np.log(predict_loss(theta, table.n, table.d, form))) ** 2)))
    if rmse >= NOISELESS_RMSE:
        return None
    return (f"NOISELESS DATA: approach 3 fits all {len(table.loss)} runs to an RMSE of {rmse:.2g} in log loss (below "
            f"{NOISELESS_RMSE:g}), so the losses were computed from a law, not measured; bootstrap intervals of "
            "(near) zero width then measure rounding, not uncertainty")


def _fit_weights(table: RunTable) -> np.ndarray:
    """One row of approach 3's weights for ``fit_weighted``: every run's ``replicate_weights``, or ones."""
    weights = table.replicate_weights
    return np.ones((1, len(table.n))) if weights is None else weights[None, :]


def delta_sensitivity(table: RunTable, parametric: ParametricFit, delta: float) -> list[dict]:
    """Approach 3 refitted at each Huber delta of DELTA_GRID (and ``delta``), from the fit's optimum."""
    rows, form = [], parametric.form
    for value in sorted(set(DELTA_GRID) | {delta}):
        if value == delta:
            theta, converged = parametric.theta, parametric.converged
        else:
            thetas, ok = fit_weighted(parametric.theta, table.n, table.d, table.loss, _fit_weights(table), value,
                                      form)
            theta, converged = thetas[0], bool(ok[0])
        params = params_from_theta(theta, table.flops_k, form)
        rows.append({"huber_delta": value, "fitted": value == delta, "converged": converged,
                     **{k: params[k] for k in (*form.names, "a", "b")}})
    return rows


def _approaches(table: RunTable, config: FitConfig, budgets: Budgets, parametric: ParametricFit, condition: float,
                resamples: Resamples | None, isoflop_laws: dict[str, PowerLaws], iso_skip: str | None,
                env_law: PowerLaws | None, env_skip: str | None, envelope: Envelope | Frontier | None
                ) -> dict[str, Approach]:
    """Each approach's law, resamples and identification."""
    level, k = config.ci_level, table.flops_k
    out: dict[str, Approach] = {}

    if env_skip is None:
        samples = None if resamples is None else resamples.envelope
        points = envelope.points()
        sizes = len({p["params"] for p in points})
        noiseless = None if resamples is None or resamples.noiseless_envelope is None else \
            interval(resamples.noiseless_envelope.a, level)
        ident = identify.power_law(env_law.row(), sizes, "distinct sizes on the envelope",
                                   None if samples is None else interval(samples.a, level), level, noiseless)
        if isinstance(envelope, Frontier) and budgets.count:
            ident.checks.append(_edge_check(points, table.n, budgets.labels))
        out["envelope"] = Approach("envelope", None, env_law, samples, ident)
    else:
        out["envelope"] = Approach("envelope", env_skip, None, None, identify.refused(env_skip))

    if iso_skip is None:
        law = isoflop_laws[config.isoflop_minimum]
        samples = None if resamples is None else resamples.isoflop[config.isoflop_minimum]
        ident = identify.power_law(law.row(), int(law.n_points[0]), "budgets with a located minimum",
                                   None if samples is None else interval(samples.a, level), level)
        out["isoflop"] = Approach("isoflop", None, law, samples, ident)
    else:
        out["isoflop"] = Approach("isoflop", iso_skip, None, None, identify.refused(iso_skip))

    ci = boot_ok = None
    samples = None
    if resamples is not None:
        ci = {key: interval(v, level) for key, v in named_samples(resamples.thetas, k, parametric.form).items()}
        boot_ok = float(resamples.converged.mean())
        samples = parametric_allocation(resamples.thetas, k, parametric.form)
    ident = identify.parametric(parametric.params_at(k), parametric.converged, condition,
                                len(np.unique(table.n)), len(np.unique(table.d)), float(table.loss.min()),
                                budgets.single, ci, boot_ok, level, parametric.form.exponents)
    law = parametric_allocation(parametric.theta, k, parametric.form)
    out["approach3"] = Approach("approach3", None, law if np.isfinite(law.a[0]) else None, samples, ident)
    return out
