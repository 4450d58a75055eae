"""Plan a training run from a fit: budget -> compute-optimal N and D, predicted loss, wall-clock time.

A budget is FLOPs, or GPU-hours on a named GPU at an assumed MFU, converted with
C = GPU-hours * 3600 * peak * MFU; the wall-clock time is C / (n_gpus * peak * MFU) from
``lab.measure.accounting``. N and D come from one approach of a fit.json: the one named with
``approach``, or by default the first identified one in ``compare.PREFERENCE``. Every approach
with a law is shown beside it, and when the fit's bootstrap samples (bootstrap.csv beside
fit.json) are there, every number gets an interval and approaches whose N_opt differ beyond their
paired interval are flagged. A law the data do not identify is never planned from: ``plan``
raises :class:`Unidentified` instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.bootstrap import interval
from analysis.compare import (
    APPROACHES,
    TITLES,
    Allocation,
    disagreement_note,
    disagreements,
    parametric_allocation,
    preferred,
)
from lab.measure.laws import CHINCHILLA, FORMS, Form
from analysis.isoflop import PowerLaws
from analysis.parametric import compute_optimal
from analysis.table import InputError
from lab.measure.hardware import gpu_peak_flops, training_seconds

SCHEMA_VERSION = 2
LAW_COLUMNS = ("a", "k_N", "b", "k_D")


class Unidentified(InputError):
    """The fit has no law the data identify (or not the one asked for)."""


def form_of(fit: dict) -> Form:
    """Approach 3's form in a fit.json document (Chinchilla's in documents from before forms)."""
    name = fit["approach3"].get("form", CHINCHILLA.name)
    if name not in FORMS:
        raise InputError(f"fit.json: unknown approach 3 form '{name}' (known: {', '.join(FORMS)})")
    return FORMS[name]


def theta_of(fit: dict) -> np.ndarray:
    """Approach 3's theta from a fit.json document's named parameters; InputError (one line) when one is missing or
    null (a hand-edited fit.json: a law without it predicts nothing)."""
    form, section = form_of(fit), fit["approach3"]
    absent = [name for name in form.names
              if isinstance(section.get(name), bool) or not isinstance(section.get(name), (int, float))]
    if absent:
        raise InputError(f"fit.json: approach3.{absent[0]} is missing or null, so its {form.name} law predicts "
                         f"nothing; refit with 'python -m analysis fit'")
    return form.theta_of(section)[0]


def bootstrap_columns(key: str, form: Form) -> list[str]:
    """Columns of bootstrap.csv holding one approach's resamples."""
    return list(form.names) if key == "approach3" else [f"{key}_{c}" for c in LAW_COLUMNS]


@dataclass
class Plan:
    """A compute-optimal plan for one budget."""

    flops: float
    gpu: str
    n_gpus: int
    mfu: float
    dtype: str
    approach: str  # fit.json key of the approach planned from
    why: str
    params: float
    tokens: float
    tokens_per_param: float
    loss: float | None  # approach 3's prediction, when approach 3 is the one planned from
    seconds: float
    gpu_hours: float
    extrapolation: float  # flops / largest compute in the fitted data
    ci: dict[str, list[float] | None] | None
    approaches: dict[str, dict]  # every approach with a law at this budget: params, tokens, ci, identified
    disagreements: list[dict]
    batch: "BatchPlan | None" = None  # with a critical-batch law: the batch and data-parallel width it allows

    def to_dict(self) -> dict:
        return asdict(self)


def load_fit(path: str | Path) -> tuple[dict, pd.DataFrame | None]:
    """fit.json and, if present beside it, its bootstrap resamples (bootstrap.csv)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise InputError(f"cannot read fit {path}: {' '.join(str(exc).split())}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("approach3"), dict):
        raise InputError(f"{path}: not a fit.json written by 'python -m analysis fit'")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise InputError(f"{path}: fit.json schema {doc.get('schema_version')} has no identification checks; "
                         f"refit with this version (schema {SCHEMA_VERSION})")
    check_fit_doc(doc, path)
    boot = path.parent / "bootstrap.csv"
    return doc, (pd.read_csv(boot) if boot.is_file() else None)


FIT_SECTIONS = ("config", "data", *APPROACHES, "comparison")  # what planning and comparing read
FIT_NUMBERS = {*LAW_COLUMNS, *(name for form in FORMS.values() for name in form.names), "G"}


def check_fit_doc(doc: dict, path: Path) -> None:
    """InputError (one line) unless the sections that planning and comparing read are objects and the laws'
    numbers are finite numbers or null (a hand-edited fit.json: a missing key, a string, an overflow)."""
    for key in FIT_SECTIONS:
        if not isinstance(doc.get(key), dict):
            raise InputError(f"{path}: '{key}' is missing or not an object; refit with 'python -m analysis fit'")
    for key in (*APPROACHES, "law"):
        section = doc.get(key) or {}
        if not isinstance(section, dict):
            raise InputError(f"{path}: '{key}' is not an object; refit with 'python -m analysis fit'")
        for name, value in section.items():
            if name in FIT_NUMBERS and value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not math.isfinite(value) or abs(value) > 1e300):
                raise InputError(f"{path}: {key}.{name} must be a finite number or null, got {value!r}")


def _law_of(section: dict) -> PowerLaws | None:
    if section.get("a") is None or section.get("k_N") is None:
        return None
    return PowerLaws(*(np.array([section[k]], float) for k in LAW_COLUMNS), n_points=np.zeros(1, int))


def allocations(fit: dict, samples: pd.DataFrame | None) -> dict[str, Allocation]:
    """Each approach of a fit.json with a law, with its resamples from bootstrap.csv."""
    out, form = {}, form_of(fit)
    for key in APPROACHES:
        section = fit.get(key) or {}
        ident = section.get("identification") or {"identified": False, "reasons": ["no identification in fit.json"]}
        boot = None
        columns = bootstrap_columns(key, form)
        if samples is not None and all(c in samples.columns for c in columns):
            if key == "approach3":
                boot = parametric_allocation(form.theta_of(samples), fit["approach3"]["fit"]["flops_k"], form)
            else:
                values = samples[columns].to_numpy(float)
                boot = PowerLaws(*values.T, n_points=np.zeros(len(values), int))
        law = _law_of(section)
        if law is not None and np.isfinite(law.a[0]):
            out[key] = Allocation(key, law, boot, bool(ident["identified"]), list(ident["reasons"]))
    return out


def plan(fit: dict, gpu: str, n_gpus: int, mfu: float, flops: float | None = None,
         gpu_hours: float | None = None, dtype: str = "bf16", samples: pd.DataFrame | None = None,
         level: float = 0.95, approach: str = "auto") -> Plan:
    """Compute-optimal plan for ``flops`` or ``gpu_hours`` (exactly one) from a fit.json document."""
    if (flops is None) == (gpu_hours is None):
        raise InputError("give exactly one budget: --flops or --gpu-hours")
    budget = flops if flops is not None else gpu_hours
    if not (math.isfinite(budget) and budget > 0):
        raise InputError(f"the budget must be a positive number, got {budget}")
    if n_gpus < 1:
        raise InputError(f"--n-gpus must be >= 1, got {n_gpus}")
    if not 0 < mfu <= 1:
        raise InputError(f"--mfu must be in (0, 1], got {mfu}")
    if approach != "auto" and approach not in APPROACHES:
        raise InputError(f"--approach must be auto or one of {', '.join(APPROACHES)}")
    try:
        peak = gpu_peak_flops(gpu, dtype)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    if flops is None:
        flops = gpu_hours * 3600.0 * peak * mfu
    laws = allocations(fit, samples)
    if approach == "auto":
        key, why = preferred({k: (k in laws and laws[k].identified,
                                  ((fit.get(k) or {}).get("identification") or {}).get("reasons", []))
                              for k in APPROACHES})
        if key is None:
            raise Unidentified(f"refusing to plan: {why}")
    else:
        key, why = approach, "chosen with --approach"
        if key not in laws or not laws[key].identified:
            reasons = ", ".join(laws[key].reasons) if key in laws else "it has no law in this fit"
            raise Unidentified(f"refusing to plan from {TITLES[key]}: it is not identified ({reasons})")
    side = {k: {**a.at(flops, level), "identified": a.identified, "reasons": a.reasons} for k, a in laws.items()}
    chosen = side[key]
    ci = dict(chosen["ci"]) if chosen["ci"] else None
    loss = None
    if key == "approach3":
        form, k = form_of(fit), fit["approach3"]["fit"]["flops_k"]
        loss = float(compute_optimal(theta_of(fit), flops, k, form)[2][0, 0])
        if ci is not None and samples is not None:
            ns, ds, ls = (v[:, 0] for v in compute_optimal(form.theta_of(samples), flops, k, form))
            ci.update(loss=interval(ls, level), tokens_per_param=interval(ds / ns, level))
    seconds = training_seconds(flops, gpu, n_gpus, mfu, dtype)
    data_max = (fit.get("data") or {}).get("flops", [None, None])[1]
    return Plan(flops=flops, gpu=gpu, n_gpus=n_gpus, mfu=mfu, dtype=dtype, approach=key, why=why,
                params=chosen["params"], tokens=chosen["tokens"], tokens_per_param=chosen["tokens"] / chosen["params"],
                loss=loss, seconds=seconds, gpu_hours=seconds * n_gpus / 3600.0,
                extrapolation=flops / data_max if data_max else math.nan, ci=ci, approaches=side,
                disagreements=disagreements(laws, flops, level))


@dataclass
class BatchPlan:
    """The critical batch at the planned loss and what data parallelism buys around it (McCandlish et al.'s
    frontier: S = S_min (1 + B_crit / B) steps, E = E_min (1 + B / B_crit) tokens)."""

    loss: float
    b_crit: float
    ci: list[float] | None
    fitted_losses: list[float]  # the law's range of target losses
    per_gpu_batch: float
    width: int  # the most GPUs whose batch stays at or below B_crit (near-linear: at most twice E_min's tokens)
    widths: list[dict]  # per width: batch, steps / S_min, tokens / E_min, time against one GPU
    n_gpus: int


def load_batch_law(path: str | Path) -> dict:
    """The B_crit(L) law of a critical_batch.json (``python -m analysis critical-batch``)."""
    try:
        doc = json.loads(Path(path).read_bytes().decode("utf-8"))
        law = doc["laws"]["loss"]
        if len(law["theta"]) != 2 or not all(isinstance(v, (int, float)) for v in law["theta"]):
            raise ValueError("laws.loss.theta is not two numbers")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--critical-batch {path}: not a critical_batch.json written by 'python -m analysis "
                         f"critical-batch' ({' '.join(str(exc).split())})") from None
    return {**law, "level": doc.get("level", 0.95)}


def batch_plan(law: dict, loss: float | None, n_gpus: int, per_gpu_batch: float) -> BatchPlan:
    """The critical batch at ``loss`` and the trade of steps against tokens at widths around it and at ``n_gpus``."""
    from analysis.critical_batch import at_loss, trade

    if loss is None:
        raise InputError("--critical-batch needs a loss: the plan predicts none (approach 3 is not used); give "
                         "--target-loss")
    if not (math.isfinite(per_gpu_batch) and per_gpu_batch > 0):
        raise InputError(f"--per-gpu-batch must be a positive number of tokens, got {per_gpu_batch}")
    b_crit, ci = at_loss(law, loss)
    width = int(b_crit // per_gpu_batch)
    one = trade(b_crit, per_gpu_batch)[0]
    rows = []
    for w in sorted({1, max(1, width // 4), max(1, width // 2), max(1, width), 2 * max(1, width),
                     8 * max(1, width), n_gpus}):
        steps, tokens = trade(b_crit, w * per_gpu_batch)
        rows.append({"gpus": w, "batch": w * per_gpu_batch, "steps": steps, "tokens": tokens, "time": steps / one})
    return BatchPlan(loss, b_crit, ci, list(law["losses"]), per_gpu_batch, width, rows, n_gpus)


def _describe_batch(b: BatchPlan) -> list[str]:
    inside = b.fitted_losses[0] <= b.loss <= b.fitted_losses[1]
    where = "inside" if inside else "OUTSIDE (extrapolated)"
    ci = f" [{b.ci[0]:.3g}, {b.ci[1]:.3g}]" if b.ci else ""
    lines = [f"critical    B_crit {b.b_crit:.3g}{ci} tokens at loss {b.loss:.4g} (law fitted at L "
             f"{b.fitted_losses[0]:g}-{b.fitted_losses[1]:g}: {where})",
             f"data par.   at {b.per_gpu_batch:,.0f} tokens per GPU, up to {b.width} GPU(s) keep the batch at or below "
             f"B_crit (near-linear: at most twice the fewest tokens; beyond, time falls slower than cost rises)"
             + ("; one GPU's batch already exceeds it" if b.width == 0 else ""),
             "  GPUs       batch  steps/S_min  tokens/E_min  time vs 1 GPU"]
    for r in b.widths:
        mark = "  <- the plan" if r["gpus"] == b.n_gpus else ""
        lines.append(f"  {r['gpus']:>4} {r['batch']:>11,.0f} {r['steps']:>12.3g} {r['tokens']:>13.3g} "
                     f"{r['time']:>14.3g}{mark}")
    return lines


def describe(p: Plan) -> str:
    """A plan as a few lines of text."""
    def with_ci(value: float, ci: list | None) -> str:
        return f"{value:.4g}" + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else "")

    ci = p.ci or {}
    lines = [
        f"budget      {p.flops:.4g} FLOPs = {p.gpu_hours:.4g} GPU-hours on {p.n_gpus} x {p.gpu} "
        f"({p.dtype}) at MFU {p.mfu:g}",
        f"wall-clock  {p.seconds:.4g} s = {p.seconds / 3600:.4g} h = {p.seconds / 86400:.4g} days",
        f"law         {TITLES[p.approach]}: {p.why}{disagreement_note(p.approach, p.disagreements)}",
        f"N_opt       {with_ci(p.params, ci.get('params'))} parameters",
        f"D_opt       {with_ci(p.tokens, ci.get('tokens'))} tokens "
        f"({with_ci(p.tokens_per_param, ci.get('tokens_per_param'))} per parameter)",
        f"loss        {with_ci(p.loss, ci.get('loss'))} (approach 3)" if p.loss is not None
        else "loss        not predicted: approach 3 is not identified",
        "approaches side by side (N_opt, D_opt):",
    ]
    for key in APPROACHES:
        if key in p.approaches:
            a = p.approaches[key]
            c = a["ci"] or {}
            mark = "used" if key == p.approach else ("identified" if a["identified"] else
                                                     "NOT identified: " + "; ".join(a["reasons"]))
            lines.append(f"  {TITLES[key]:<24} N {with_ci(a['params'], c.get('params'))}  "
                         f"D {with_ci(a['tokens'], c.get('tokens'))}  ({mark})")
    for x in p.disagreements:
        lines.append(f"WARNING     APPROACHES DISAGREE: {x['message']}")
    if math.isfinite(p.extrapolation) and p.extrapolation > 100:
        lines.append(f"warning     the budget is {p.extrapolation:.3g}x the largest compute in the fitted data")
    if p.batch is not None:
        lines += _describe_batch(p.batch)
    return "\n".join(lines)
