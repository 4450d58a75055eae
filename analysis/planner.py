"""Plan a training run from a fit: budget -> compute-optimal N and D, predicted loss, wall-clock time.

A budget is FLOPs, or GPU-hours on a named GPU at an assumed MFU, converted with
C = GPU-hours * 3600 * peak * MFU. N and D come from approach 3 of a fit.json
(N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b); the wall-clock time is C / (n_gpus * peak * MFU)
from ``lab.accounting``. When the fit's bootstrap samples (bootstrap.csv beside fit.json) are
there, every number gets an interval.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.bootstrap import interval
from analysis.parametric import compute_optimal
from analysis.table import InputError
from lab.accounting import gpu_peak_flops, training_seconds

BOOTSTRAP_COLUMNS = ("E", "A", "B", "alpha", "beta")


@dataclass
class Plan:
    """A compute-optimal plan for one budget."""

    flops: float
    gpu: str
    n_gpus: int
    mfu: float
    dtype: str
    params: float
    tokens: float
    tokens_per_param: float
    loss: float
    seconds: float
    gpu_hours: float
    extrapolation: float  # flops / largest compute in the fitted data
    ci: dict[str, list[float] | None] | None
    isoflop_params: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def theta_of(params: dict) -> np.ndarray:
    """(log A, log B, log E, alpha, beta) from a dict with E, A, B, alpha, beta."""
    return np.array([math.log(params["A"]), math.log(params["B"]), math.log(params["E"]),
                     params["alpha"], params["beta"]])


def load_fit(path: str | Path) -> tuple[dict, np.ndarray | None]:
    """fit.json and, if present beside it, the bootstrap thetas from bootstrap.csv."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read fit {path}: {' '.join(str(exc).split())}") from exc
    a3 = doc.get("approach3") if isinstance(doc, dict) else None
    if not isinstance(a3, dict) or any(not isinstance(a3.get(k), (int, float)) for k in BOOTSTRAP_COLUMNS):
        raise InputError(f"{path}: not a fit.json with approach3 E, A, B, alpha, beta")
    samples = None
    boot = path.parent / "bootstrap.csv"
    if boot.is_file():
        frame = pd.read_csv(boot)
        if all(c in frame.columns for c in BOOTSTRAP_COLUMNS):
            samples = np.stack([theta_of(row) for row in frame[list(BOOTSTRAP_COLUMNS)].to_dict("records")])
    return doc, samples


def plan(fit: dict, gpu: str, n_gpus: int, mfu: float, flops: float | None = None,
         gpu_hours: float | None = None, dtype: str = "bf16", samples: np.ndarray | None = None,
         level: float = 0.95) -> Plan:
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
    try:
        peak = gpu_peak_flops(gpu, dtype)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    if flops is None:
        flops = gpu_hours * 3600.0 * peak * mfu
    a3 = fit["approach3"]
    if not (a3["alpha"] > 0 and a3["beta"] > 0):
        raise InputError("the fit has no compute-optimal allocation (alpha or beta is not positive)")
    n, d, loss = (float(v[0, 0]) for v in compute_optimal(theta_of(a3), [flops]))
    seconds = training_seconds(flops, gpu, n_gpus, mfu, dtype)
    ci = None
    if samples is not None:
        ns, ds, ls = (v[:, 0] for v in compute_optimal(samples, [flops]))
        ci = {"params": interval(ns, level), "tokens": interval(ds, level), "loss": interval(ls, level),
              "tokens_per_param": interval(ds / ns, level)}
    iso = fit.get("isoflop") or {}
    iso_params = (iso["k_N"] * flops ** iso["a"]) if iso.get("a") is not None and iso.get("k_N") else None
    data_max = (fit.get("data") or {}).get("flops", [None, None])[1]
    return Plan(flops=flops, gpu=gpu, n_gpus=n_gpus, mfu=mfu, dtype=dtype, params=n, tokens=d,
                tokens_per_param=d / n, loss=loss, seconds=seconds, gpu_hours=seconds * n_gpus / 3600.0,
                extrapolation=flops / data_max if data_max else math.nan, ci=ci, isoflop_params=iso_params)


def describe(p: Plan) -> str:
    """A plan as a few lines of text."""
    def with_ci(key: str, value: float) -> str:
        ci = (p.ci or {}).get(key)
        return f"{value:.4g}" + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else "")

    lines = [
        f"budget      {p.flops:.4g} FLOPs = {p.gpu_hours:.4g} GPU-hours on {p.n_gpus} x {p.gpu} "
        f"({p.dtype}) at MFU {p.mfu:g}",
        f"wall-clock  {p.seconds:.4g} s = {p.seconds / 3600:.4g} h = {p.seconds / 86400:.4g} days",
        f"N_opt       {with_ci('params', p.params)} parameters",
        f"D_opt       {with_ci('tokens', p.tokens)} tokens "
        f"({with_ci('tokens_per_param', p.tokens_per_param)} per parameter)",
        f"loss        {with_ci('loss', p.loss)} (predicted by approach 3)",
    ]
    if p.isoflop_params is not None:
        lines.append(f"IsoFLOP     N_opt {p.isoflop_params:.4g} (approach 2, for comparison)")
    if math.isfinite(p.extrapolation) and p.extrapolation > 100:
        lines.append(f"warning     the budget is {p.extrapolation:.3g}x the largest compute in the fitted data")
    return "\n".join(lines)
