"""What one fit produced (``FitResult``) and its JSON document, fit.json (``FitResult.to_dict``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from analysis.bootstrap import Resamples, interval
from analysis.budgets import Budgets
from analysis.compare import Allocation
from analysis.envelope import Envelope, Frontier
from analysis.fit_config import RUNTIME, FitConfig
from analysis.identify import Identification
from analysis.isoflop import METHODS, MIN_SIDE, BudgetMinima, PowerLaws
from analysis.parametric import ParametricFit, named_samples, predict_loss, rmse_log_loss, start_grid
from analysis.table import RunTable

SCHEMA_VERSION = 2


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
                       for k, v in asdict(self.config).items() if k not in RUNTIME},
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
                           "rmse_log_loss": rmse_log_loss(p.theta, t.n, t.d, t.loss, form),
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
