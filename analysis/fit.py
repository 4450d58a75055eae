"""Run every approach on a table of runs and collect the results (``FitResult``, what fit.json holds).

``fit_runs`` is a pure function of the runs and a ``FitConfig`` (``analysis.fit_config``). It groups the runs
into compute budgets (``budgets``), chooses approach 3's form and runs the hold-out (``forms``, ``holdout``), fits
approach 3 (``parametric``), approach 2 (``isoflop``, when there are budgets) and approach 1 (``envelope``: the
frontier of final losses, or the envelope of training curves with ``envelope="curves"``), refits all of them on
the same bootstrap resamples, checks the runs and whether each law is identified (``fit_checks``, ``identify``),
compares them and picks the one to plan with (``compare``), predicts N_opt, D_opt and loss at the requested
budgets and gathers warnings. Seed replicates (``RunTable.experiments``) count once each: averaged where an
approach takes one loss per size, weighted 1/k in approach 3 (``RunTable.replicate_weights``) and averaged in the
outlier check. An approach that the design cannot identify, even on approach 3's losses without noise, gets a
design note instead of a warning.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from analysis import akima, identify
from analysis.allocate import Unidentified
from analysis.bootstrap import Problem, Resamples, bootstrap, canonical_order, interval
from analysis.budgets import Budgets, group_budgets
from analysis.compare import TITLES, disagreements, parametric_allocation, preferred
from analysis.downstream import fit_task, predict_score
from analysis.envelope import Envelope, Frontier, build_envelope, build_frontier
from analysis.fit_checks import (budget_warnings, delta_sensitivity, edge_check, find_outliers, noise_check,
                                 outliers_warning)
from analysis.fit_config import FitConfig
from analysis.fit_result import Approach, FitResult
from analysis.forms import choose_form, form_holdouts, forms_table
from analysis.holdout import holdout_bias, holdout_check
from analysis.isoflop import METHODS, MIN_SIDE, PowerLaws, budget_minima
from analysis.other_laws import fit_data_constrained, fit_kaplan
from analysis.parametric import (ParametricFit, compute_optimal, fit_parametric, gauss_newton_condition,
                                 named_samples, predict_loss, rmse_log_loss)
from analysis.table import InputError, RunTable
from lab.measure.laws import CHINCHILLA
from lab.runtime.scores import PREFIX as TASK_PREFIX

class TooFewRuns(Unidentified):
    """Too few budgets for approach 2 and no other approach identified, before any bootstrap: what there is and what
    would be enough."""

    def __init__(self, n_runs: int, n_budgets: int, method: str) -> None:
        sizes = akima.MIN_SIZES if method == "akima" else 2 * MIN_SIDE + 1
        super().__init__(f"no approach can be identified from {n_runs} runs at {n_budgets} budget(s), so the fit "
                         f"stopped before its bootstrap\nenough: {identify.MIN_POINTS} or more budgets, each with "
                         f"{sizes} or more sizes around its lowest loss (approach 2); --bootstrap 0 writes this fit's "
                         "report anyway")


# What would identify an approach that the design cannot (``Identification.by_design``).
DESIGN_REMEDY = {"envelope": "; more sizes per budget, or training curves whose every point is an end point "
                             "(cooldowns, --envelope curves), would"}


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
    warnings += budget_warnings(budgets, minima, len(n), config.isoflop_minimum)

    refits, refits_skip = form_holdouts(table, budgets, config)
    form, form_choice = choose_form(table, budgets, config, refits, refits_skip)
    parametric = fit_parametric(n, d, loss, n_starts=config.n_starts, delta=config.huber_delta, form=form,
                                weights=table.replicate_weights)
    forms = forms_table(table, parametric, refits, refits_skip, config)
    condition = gauss_newton_condition(parametric.theta, n, d, form)
    outliers = find_outliers(table, parametric.theta, form)
    if outliers["runs"]:
        warnings.append(("outliers", outliers_warning(outliers)))
    noise = noise_check(table, parametric.theta, form)
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

    if config.stop_unidentified and config.n_bootstrap > 0 and budgets.count < identify.MIN_POINTS:
        bare = _approaches(table, config, budgets, parametric, condition, None, isoflop_laws, iso_skip, env_law,
                           env_skip, envelope)
        if not any(app.identification.identified for app in bare.values()):  # intervals only add checks
            raise TooFewRuns(len(n), budgets.count, config.isoflop_minimum)
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
        holdout = holdout_check(table, budgets, minima, config, form, refits.get(form.name))
        if holdout["skipped"]:
            warnings.append(("holdout_skipped", f"hold-out check skipped: {holdout['reason']}"))
        elif (bias := holdout_bias(holdout)) is not None:
            warnings.append(("holdout_bias", bias))

    sensitivity = delta_sensitivity(table, parametric, config.huber_delta) if config.delta_sensitivity else []
    other = None
    if config.law != "chinchilla":
        rmse = rmse_log_loss(parametric.theta, n, d, loss, form)
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
            ident.checks.append(edge_check(points, table.n, budgets.labels))
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
