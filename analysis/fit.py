"""Run every approach on a table of runs and collect the results (what fit.json holds).

``fit_runs`` is a pure function of the runs and a :class:`FitConfig`: it fits approach 3
(parametric), approach 2 (IsoFLOP) and approach 1 (envelope, when training curves exist),
bootstraps all three over the same resamples, predicts the compute-optimal allocation at the
requested budgets, runs the hold-out check on the largest budget and gathers warnings.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from analysis.bootstrap import bootstrap_parametric, draw_weights, interval
from analysis.envelope import Envelope, build_envelope
from analysis.isoflop import METHODS, MIN_RUNS_PER_BUDGET, BudgetMinima, PowerLaws, budget_minima, group_budgets
from analysis.parametric import (
    GRID_AXES,
    HUBER_DELTA,
    ParametricFit,
    compute_optimal,
    fit_parametric,
    named_samples,
    predict_loss,
)
from analysis.table import MIN_RUNS, InputError, RunTable

SCHEMA_VERSION = 1


@dataclass
class FitConfig:
    """Options of a fit; the defaults follow the issue and Hoffmann et al."""

    budget_tol: float = 0.05  # relative tolerance on C when grouping runs into budgets
    include_edge: bool = False  # let edge minima into the IsoFLOP power laws
    isoflop_minimum: str = "vertex"  # which per-budget minimum the IsoFLOP power laws use
    n_bootstrap: int = 1000
    seed: int = 0
    ci_level: float = 0.95
    workers: int = 1  # processes for the parametric bootstrap
    n_starts: int = 8  # L-BFGS runs from the best grid points
    predict: tuple[float, ...] = ()  # FLOP budgets; empty: 1x, 10x and 100x the largest C in the data
    holdout: bool = True
    extrapolation_warn: float = 100.0  # warn when a prediction exceeds this multiple of the data's C
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
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)


@dataclass
class FitResult:
    """Everything one fit produced; ``to_dict`` gives fit.json, plots and reports read the rest."""

    table: RunTable
    config: FitConfig
    labels: np.ndarray  # budget of each run
    parametric: ParametricFit
    thetas: np.ndarray | None  # bootstrap thetas (B, 5)
    theta_converged: np.ndarray | None
    minima: BudgetMinima
    isoflop: dict[str, PowerLaws]  # full-data power laws by minimum method
    isoflop_samples: dict[str, PowerLaws]  # bootstrap power laws by method
    isoflop_skipped: str | None
    envelope: Envelope | None
    envelope_law: PowerLaws | None
    envelope_samples: PowerLaws | None
    envelope_skipped: str | None
    predictions: list[dict]
    holdout: dict
    warnings: list[tuple[str, str]]

    @property
    def flops_max(self) -> float:
        return float(self.table.c.max())

    def to_dict(self) -> dict:
        """The fit.json document (NaN and infinities become null)."""
        return _clean({
            "schema_version": SCHEMA_VERSION,
            "source": self.table.source,
            "params_count": self.table.params_count,
            "loss_source": self.table.loss_source,
            "notes": self.table.notes,
            "config": {k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in asdict(self.config).items() if k != "progress"},
            "data": self._data(),
            "approach3": self._approach3(),
            "isoflop": self._isoflop(),
            "envelope": self._envelope(),
            "predictions": self.predictions,
            "holdout": self.holdout,
            "warnings": [{"code": c, "message": m} for c, m in self.warnings],
        })

    def _data(self) -> dict:
        t = self.table
        ratio = t.d / t.n
        budgets = [{"flops": float(f), "n_runs": int(np.sum(self.labels == g))}
                   for g, f in enumerate(self.minima.flops)]
        return {"n_runs": len(t.runs), "n_curves": len(t.curves), "curve_loss": t.curve_loss,
                "params": [t.n.min(), t.n.max()], "tokens": [t.d.min(), t.d.max()],
                "flops": [t.c.min(), t.c.max()], "loss": [t.loss.min(), t.loss.max()],
                "tokens_per_param": [ratio.min(), ratio.max()], "budgets": budgets}

    def _approach3(self) -> dict:
        p = self.parametric
        out: dict = dict(p.params)
        out["fit"] = {
            "method": "Huber (delta=1e-3) on log-space residuals via log-sum-exp, summed; L-BFGS from "
                      f"the {p.n_starts} best of {np.prod([len(a) for a in GRID_AXES])} grid points",
            "huber_delta": HUBER_DELTA, "objective": p.objective, "converged": p.converged,
            "message": p.message, "iterations": p.n_iter, "n_starts": p.n_starts,
            "starts_agreeing": p.starts_agreeing,
            "best_start": dict(zip(("a", "b", "e", "alpha", "beta"), p.best_start)),
            "best_start_on_grid_edge": p.best_start_on_edge, "optimum_inside_grid": p.optimum_inside_grid,
        }
        out["ci"] = None
        if self.thetas is not None:
            samples = named_samples(self.thetas)
            out["ci"] = {"level": self.config.ci_level,
                         **{k: interval(v, self.config.ci_level) for k, v in samples.items()}}
            out["bootstrap"] = {"resamples": len(self.thetas), "seed": self.config.seed,
                                "converged": int(self.theta_converged.sum()),
                                "refit": "one L-BFGS per resample from the full-data optimum"}
        return out

    def _laws(self, law: PowerLaws, samples: PowerLaws | None) -> dict:
        out: dict = law.row()
        out["ci"] = None if samples is None else {
            "level": self.config.ci_level, "a": interval(samples.a, self.config.ci_level),
            "b": interval(samples.b, self.config.ci_level), "k_N": interval(samples.k_n, self.config.ci_level),
            "k_D": interval(samples.k_d, self.config.ci_level)}
        return out

    def _isoflop(self) -> dict:
        m, t, method = self.minima, self.table, self.config.isoflop_minimum
        usable = {k: m.usable(k, self.config.include_edge)[0] for k in METHODS}
        minima = []
        for g, flops in enumerate(m.flops):
            rows = np.flatnonzero(self.labels == g)
            low = int(m.lowest_row[0, g])
            enough = m.n_distinct[0, g] >= MIN_RUNS_PER_BUDGET
            vertex = None
            if m.vertex_ok[0, g]:
                n_v = float(np.exp(m.vertex_log_n[0, g]))
                vertex = {"params": n_v, "tokens": float(flops / (6 * n_v)), "loss": float(m.vertex_loss[0, g]),
                          "inside_sampled_range": bool(m.vertex_inside[0, g])}
            minima.append({
                "flops": float(flops), "n_runs": len(rows), "n_distinct_params": int(m.n_distinct[0, g]),
                "params_range": [float(t.n[rows].min()), float(t.n[rows].max())],
                "lowest": {"run_id": str(t.runs["run_id"].iloc[low]), "params": float(t.n[low]),
                           "tokens": float(t.d[low]), "loss": float(t.loss[low])},
                "vertex": vertex, "edge": bool(enough and m.edge[0, g]),
                "used": {k: bool(usable[k][g]) for k in METHODS},
                "note": None if enough else f"fewer than {MIN_RUNS_PER_BUDGET} distinct N: not used",
            })
        fits = {k: self._laws(self.isoflop[k], self.isoflop_samples.get(k)) if self.isoflop[k].n_budgets[0] >= 2
                else None for k in METHODS}
        primary = fits[method] or {}
        return {"skipped": self.isoflop_skipped is not None, "reason": self.isoflop_skipped,
                "minimum": method, "a": primary.get("a"), "b": primary.get("b"), "k_N": primary.get("k_N"),
                "k_D": primary.get("k_D"), "ci": primary.get("ci"), "budget_tolerance": self.config.budget_tol,
                "include_edge": self.config.include_edge, "fits": fits, "minima": minima}

    def _envelope(self) -> dict:
        if self.envelope_law is None or self.envelope_skipped is not None:
            return {"skipped": True, "reason": self.envelope_skipped}
        env = self.envelope
        best, valid = env.winners(np.ones((1, len(self.table.runs))))
        points = [{"flops": float(c), "params": float(env.params[j]),
                   "tokens": float(c * env.tokens_per_flop[j]), "loss": float(env.loss[j, k]),
                   "run_id": str(self.table.runs["run_id"].iloc[env.rows[j]])}
                  for k, (c, j, ok) in enumerate(zip(env.grid, best[0], valid[0])) if ok]
        return {"skipped": False, "reason": None, "loss": self.table.curve_loss,
                "n_curves": len(env.rows), **self._laws(self.envelope_law, self.envelope_samples), "points": points}


def _clean(obj: Any) -> Any:
    """JSON-ready copy: numpy scalars to Python, non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def _law_at(laws: PowerLaws, flops: float) -> tuple[np.ndarray, np.ndarray]:
    return laws.k_n * flops ** laws.a, laws.k_d * flops ** laws.b


def _predict(result_parts: dict, flops: float, config: FitConfig, flops_max: float) -> dict:
    theta, thetas = result_parts["theta"], result_parts["thetas"]
    n, d, loss = (v[0, 0] for v in compute_optimal(theta, [flops]))
    out = {"flops": flops, "params": n, "tokens": d, "loss": loss, "tokens_per_param": d / n,
           "extrapolation": flops / flops_max, "ci": None}
    if thetas is not None:
        ns, ds, ls = (v[:, 0] for v in compute_optimal(thetas, [flops]))
        out["ci"] = {"params": interval(ns, config.ci_level), "tokens": interval(ds, config.ci_level),
                     "loss": interval(ls, config.ci_level), "tokens_per_param": interval(ds / ns, config.ci_level)}
    for name in ("isoflop", "envelope"):
        law, samples = result_parts[name], result_parts[f"{name}_samples"]
        if law is None:
            out[name] = None
            continue
        n_l, d_l = _law_at(law, flops)
        entry = {"params": n_l[0], "tokens": d_l[0], "ci": None}
        if samples is not None:
            ns, ds = _law_at(samples, flops)
            entry["ci"] = {"params": interval(ns, config.ci_level), "tokens": interval(ds, config.ci_level)}
        out[name] = entry
    return out


def _holdout(table: RunTable, labels: np.ndarray, minima: BudgetMinima, config: FitConfig) -> dict:
    """Fit on all budgets but the largest, predict the largest budget's runs."""
    top = int(labels.max())
    held = labels == top
    train = ~held
    n, d, c, loss = table.n, table.d, table.c, table.loss
    if train.sum() < MIN_RUNS or len(np.unique(n[train])) < 2 or len(np.unique(d[train])) < 2:
        return {"skipped": True, "reason": f"fewer than {MIN_RUNS} runs (or too few distinct N, D) "
                                           "outside the largest budget"}
    budget = float(minima.flops[top])
    fit = fit_parametric(n[train], d[train], loss[train], n_starts=config.n_starts)
    predicted = predict_loss(fit.theta, n[held], d[held])
    err = predicted - loss[held]
    runs = [{"run_id": str(r), "params": float(nn), "tokens": float(dd), "loss": float(obs), "predicted": float(p)}
            for r, nn, dd, obs, p in zip(table.runs["run_id"][held], n[held], d[held], loss[held], predicted)]
    n_opt3 = float(compute_optimal(fit.theta, [budget])[0][0, 0])
    out = {"skipped": False, "budget_flops": budget, "n_train": int(train.sum()), "n_holdout": int(held.sum()),
           "approach3": {"mean_abs_error": float(np.mean(np.abs(err))),
                         "mean_rel_error": float(np.mean(np.abs(err) / loss[held])),
                         "max_rel_error": float(np.max(np.abs(err) / loss[held])),
                         "params_opt_predicted": n_opt3, "converged": fit.converged, "runs": runs},
           "isoflop": None}
    method = config.isoflop_minimum
    observed_ok = minima.usable(method, config.include_edge)[0, top]
    train_minima = budget_minima(n, loss, c, labels, train.astype(float)[None])
    law = train_minima.power_laws(method, config.include_edge, n, d)
    if observed_ok and law.n_budgets[0] >= 2:
        observed = (float(np.exp(minima.vertex_log_n[0, top])) if method == "vertex"
                    else float(n[minima.lowest_row[0, top]]))
        pred = float(_law_at(law, budget)[0][0])
        out["isoflop"] = {"params_opt_predicted": pred, "params_opt_observed": observed,
                          "rel_error": abs(pred - observed) / observed}
        out["approach3"]["params_opt_rel_error"] = abs(n_opt3 - observed) / observed
    return out


def fit_runs(table: RunTable, config: FitConfig | None = None) -> FitResult:
    """Fit all approaches to ``table`` with bootstrap intervals; see the module docstring."""
    config = config or FitConfig()
    config.validate()
    warnings = list(table.warnings)
    n, d, c, loss = table.n, table.d, table.c, table.loss
    ones = np.ones((1, len(n)))

    parametric = fit_parametric(n, d, loss, n_starts=config.n_starts)
    if not parametric.converged:
        warnings.append(("no_convergence", f"approach 3: L-BFGS did not converge ({parametric.message})"))
    if parametric.best_start_on_edge:
        inside = "inside" if parametric.optimum_inside_grid else "OUTSIDE"
        warnings.append(("grid_edge_start", "approach 3: the best L-BFGS start lay on the edge of the start "
                         f"grid; the optimum it reached is {inside} the grid and "
                         f"{parametric.starts_agreeing} of {parametric.n_starts} starts reached it"))
    if not (parametric.theta[3] > 0 and parametric.theta[4] > 0):
        warnings.append(("no_allocation", "approach 3: alpha or beta is not positive, so there is no "
                         "compute-optimal allocation; predictions are empty"))

    labels = group_budgets(c, config.budget_tol)
    minima = budget_minima(n, loss, c, labels, ones)
    isoflop = {k: minima.power_laws(k, config.include_edge, n, d) for k in METHODS}
    enough = minima.n_distinct[0] >= MIN_RUNS_PER_BUDGET
    edges = [f"{minima.flops[g]:.3g}" for g in np.flatnonzero(enough & minima.edge[0])]
    if edges:
        fate = "included" if config.include_edge else "excluded"
        warnings.append(("edge_minimum", f"IsoFLOP: {len(edges)} budget(s) have their lowest run at the edge of "
                         f"the sampled N range ({fate}): C = {', '.join(edges)}"))
    isoflop_skipped = None
    n_used = int(isoflop[config.isoflop_minimum].n_budgets[0])
    if n_used < 2:
        isoflop_skipped = (f"no budget has {MIN_RUNS_PER_BUDGET} or more runs with distinct N" if not enough.any()
                           else f"only {n_used} budget(s) with a usable minimum; the power law needs 2")
        warnings.append(("isoflop_skipped", f"IsoFLOP approach skipped: {isoflop_skipped}"))

    envelope = envelope_law = None
    envelope_skipped = "no training curves (metrics.jsonl) in the input"
    if len(table.curves) >= 2:
        envelope = build_envelope(table.curves)
        envelope_law = envelope.power_laws(ones)
        winners = np.unique(envelope.params[envelope.winners(ones)[0][0]])
        envelope_skipped = None
        if len(winners) < 2 or not np.isfinite(envelope_law.a[0]):
            envelope_skipped = "one run is lowest at every FLOP count; no power law to fit"
            warnings.append(("envelope_skipped", f"envelope approach skipped: {envelope_skipped}"))

    thetas = converged = None
    isoflop_samples: dict[str, PowerLaws] = {}
    envelope_samples = None
    if config.n_bootstrap > 0:
        weights = draw_weights(len(n), config.n_bootstrap, config.seed)
        thetas, converged = bootstrap_parametric(parametric.theta, n, d, loss, weights, config.workers,
                                                 config.progress)
        failed = int((~converged).sum())
        if failed > 0.05 * len(converged):
            warnings.append(("bootstrap_convergence", f"approach 3: {failed} of {len(converged)} bootstrap refits "
                             "did not converge"))
        if isoflop_skipped is None:
            boot_minima = budget_minima(n, loss, c, labels, weights)
            isoflop_samples = {k: boot_minima.power_laws(k, config.include_edge, n, d) for k in METHODS}
        if envelope_skipped is None:
            envelope_samples = envelope.power_laws(weights)

    flops_max = float(c.max())
    budgets = config.predict or tuple(m * flops_max for m in (1.0, 10.0, 100.0))
    parts = {"theta": parametric.theta, "thetas": thetas,
             "isoflop": None if isoflop_skipped else isoflop[config.isoflop_minimum],
             "isoflop_samples": isoflop_samples.get(config.isoflop_minimum),
             "envelope": None if envelope_skipped else envelope_law, "envelope_samples": envelope_samples}
    predictions = [_predict(parts, float(f), config, flops_max) for f in budgets]
    far = [f"{p['flops']:.3g}" for p in predictions if p["extrapolation"] > config.extrapolation_warn]
    if far:
        warnings.append(("extrapolation", f"prediction(s) at C = {', '.join(far)} extrapolate more than "
                         f"{config.extrapolation_warn:g}x beyond the largest compute in the data ({flops_max:.3g})"))

    holdout = {"skipped": True, "reason": "disabled"}
    if config.holdout:
        holdout = _holdout(table, labels, minima, config)
        if holdout["skipped"]:
            warnings.append(("holdout_skipped", f"hold-out check skipped: {holdout['reason']}"))

    return FitResult(table=table, config=config, labels=labels, parametric=parametric, thetas=thetas,
                     theta_converged=converged, minima=minima, isoflop=isoflop, isoflop_samples=isoflop_samples,
                     isoflop_skipped=isoflop_skipped, envelope=envelope, envelope_law=envelope_law,
                     envelope_samples=envelope_samples, envelope_skipped=envelope_skipped,
                     predictions=predictions, holdout=holdout, warnings=warnings)
