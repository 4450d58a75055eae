"""Ask a fit's law directly: approach 3's loss at any (N, D), with its bootstrap interval.

``load_law`` reads a fit.json (and the bootstrap.csv beside it, when written); ``Law.predict`` gives the loss at
each (N, D) pair from the fitted parameters, and the percentile interval of the same prediction from every
bootstrap resample's parameters. A point whose tokens per parameter lie more than ``FAR`` times beyond the range
of the fit's runs is predicted and flagged (over-trained above it, under-trained below), as is one whose N lies
that far beyond the runs' sizes: the law was fitted where neither happened. ``python -m analysis predict`` prints
the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.bootstrap import interval
from lab.measure.laws import Form
from analysis.parametric import predict_loss
from analysis.allocate import form_of, load_fit, theta_of
from analysis.table import InputError

FAR = 4.0  # a ratio (or size) more than this factor beyond the fit's runs is flagged


@dataclass
class Law:
    """Approach 3's law of one fit: its form, parameters, resamples and the runs' ranges."""

    form: Form
    theta: np.ndarray
    thetas: np.ndarray | None  # (B, P) bootstrap resamples; None when the fit had no bootstrap
    level: float
    tokens_per_param: tuple[float, float]  # the fit's runs' range
    params: tuple[float, float]
    source: str

    def predict(self, params: np.ndarray | list[float], tokens: np.ndarray | list[float]) -> pd.DataFrame:
        """One row per (N, D) pair: the loss, its interval (NaN without resamples) and a flag ('' when inside)."""
        n, d = np.atleast_1d(np.asarray(params, float)), np.atleast_1d(np.asarray(tokens, float))
        if n.shape != d.shape:
            raise InputError(f"{len(n)} parameter count(s) for {len(d)} token count(s): give them in pairs")
        if not (np.all(np.isfinite(n) & (n > 0)) and np.all(np.isfinite(d) & (d > 0))):
            raise InputError("parameter and token counts must be positive numbers")
        loss = predict_loss(self.theta, n, d, self.form)
        lo = hi = np.full(len(n), np.nan)
        if self.thetas is not None:
            samples = predict_loss(self.thetas, n, d, self.form)
            bounds = np.array([interval(samples[:, j], self.level) or [np.nan, np.nan] for j in range(len(n))])
            lo, hi = bounds[:, 0], bounds[:, 1]
        return pd.DataFrame({"params": n, "tokens": d, "tokens_per_param": d / n, "loss": loss, "lo": lo, "hi": hi,
                             "flag": [self._flag(nn, dd) for nn, dd in zip(n, d)]})

    def _flag(self, n: float, d: float) -> str:
        (r_lo, r_hi), (n_lo, n_hi), ratio = self.tokens_per_param, self.params, d / n
        flags = []
        if ratio > FAR * r_hi:
            flags.append(f"over-trained: {ratio:.3g} tokens/param, the runs' most is {r_hi:.3g}")
        elif ratio < r_lo / FAR:
            flags.append(f"under-trained: {ratio:.3g} tokens/param, the runs' least is {r_lo:.3g}")
        if n > FAR * n_hi or n < n_lo / FAR:
            flags.append(f"N = {n:.3g} beyond the runs' sizes ({n_lo:.3g} to {n_hi:.3g})")
        return "; ".join(flags)


def load_law(path: str | Path) -> Law:
    """The law of a fit.json (bootstrap.csv beside it gives the resamples)."""
    doc, samples = load_fit(path)
    form = form_of(doc)
    thetas = None
    if samples is not None:
        missing = [name for name in form.names if name not in samples.columns]
        if missing:
            raise InputError(f"{Path(path).parent / 'bootstrap.csv'}: no column(s) {', '.join(missing)} of the "
                             f"{form.name} form")
        thetas = form.theta_of(samples)
    data = doc["data"]
    return Law(form=form, theta=theta_of(doc), thetas=thetas, level=(doc.get("config") or {}).get("ci_level", 0.95),
               tokens_per_param=tuple(data["tokens_per_param"]), params=tuple(data["params"]), source=str(path))


def read_pairs(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) pairs from a CSV with columns params and tokens."""
    try:
        frame = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {' '.join(str(exc).split())}") from exc
    missing = [c for c in ("params", "tokens") if c not in frame.columns]
    if missing:
        raise InputError(f"{path}: no column(s) {', '.join(missing)} (need params and tokens)")
    values = frame[["params", "tokens"]].apply(pd.to_numeric, errors="coerce").to_numpy(float)
    if len(values) == 0 or not np.all(np.isfinite(values)):
        raise InputError(f"{path}: params and tokens must be numbers on every row (and at least one row)")
    return values[:, 0], values[:, 1]


def describe(law: Law, table: pd.DataFrame) -> list[str]:
    """The predictions as lines for the terminal."""
    level = f"{law.level:.0%}"
    head = (f"approach 3 ({law.form.name} form, L = {law.form.formula}) from {law.source}; "
            + (f"{level} bootstrap intervals over {len(law.thetas)} resamples" if law.thetas is not None
               else "no bootstrap.csv beside it: no intervals"))
    lines = [head]
    for row in table.itertuples():
        ci = "" if not np.isfinite(row.lo) else f" [{row.lo:.4f}, {row.hi:.4f}]"
        lines.append(f"N = {row.params:.4g}, D = {row.tokens:.4g} ({row.tokens_per_param:.3g} tokens/param): "
                     f"loss {row.loss:.4f}{ci}" + (f"  FLAGGED {row.flag}" if row.flag else ""))
    return lines
