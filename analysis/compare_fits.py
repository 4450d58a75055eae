"""Several fits side by side (``python -m analysis compare``): inputs, the parameter table and its outputs.

Each input is a fit (a fit.json, or a folder holding one, with bootstrap.csv beside it when written)
or runs to fit now (a sweep folder or a table, fitted with the defaults). A fit read from fit.json
carries its laws and resamples but not its runs; runs fitted here carry both, so the frontier
figure shows their points too. ``plots.plot_compare_allocation`` and ``plots.plot_compare_frontier``
draw the overlays.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.compare import APPROACHES, PREFERENCE, TITLES, Allocation
from lab.measure.laws import CHINCHILLA, FORMS
from analysis.allocate import allocations, load_fit, theta_of

ALLOCATION_EXPONENTS = ("a", "b")


@dataclass
class FitEntry:
    """One input of a comparison: its label, fit.json document, allocations and (when fitted here) runs."""

    label: str
    doc: dict
    allocations: dict[str, Allocation]
    runs: pd.DataFrame | None  # columns flops, loss, params; None for a fit read from fit.json

    @property
    def law_key(self) -> str | None:
        """The approach the fit plans with, else the first with a law."""
        preferred = self.doc["comparison"]["preferred"]
        return preferred or next((k for k in PREFERENCE if k in self.allocations), None)

    @property
    def theta(self) -> np.ndarray:
        return theta_of(self.doc)

    @property
    def form(self) -> str:
        """Approach 3's form (a fit.json written before forms existed fitted Chinchilla's)."""
        return self.doc["approach3"].get("form") or CHINCHILLA.name

    @property
    def flops_range(self) -> tuple[float, float]:
        lo, hi = self.doc["data"]["flops"]
        return float(lo), float(hi)


def fit_json_path(path: Path) -> Path | None:
    """The fit.json that ``path`` names (the file, or one inside the folder), else None (runs to fit)."""
    if path.is_file() and path.suffix == ".json" and path.name == "fit.json":
        return path
    if path.is_dir() and (path / "fit.json").is_file():
        return path / "fit.json"
    return None


def entry_from_fit(label: str, path: Path) -> FitEntry:
    doc, samples = load_fit(path)
    return FitEntry(label, doc, allocations(doc, samples), None)


def labels_for(paths: list[Path]) -> list[str]:
    """Short distinct labels: each input's folder or file name, numbered where names repeat."""
    names = [(p.parent.name if p.name == "fit.json" else p.stem if p.is_file() else p.name) or str(p) for p in paths]
    return [f"{n} ({i + 1})" if names.count(n) > 1 else n for i, n in enumerate(names)]


def parameter_table(entries: list[FitEntry]) -> pd.DataFrame:
    """Quantities (rows) by fit (columns): runs, approach 3's form and each fit's own parameters of it with
    intervals ("not in its form" where a fit's form reports no such parameter; the shared form's beta is its
    alpha), each approach's a, the law planned
    with and its N_opt at the largest C of all inputs."""
    flops = max(e.flops_range[1] for e in entries)
    rows: dict[str, list[str]] = {"runs": [str(e.doc["data"]["n_runs"]) for e in entries],
                                  "approach 3: form": [e.form for e in entries]}
    names = dict.fromkeys(q for e in entries for q in (*FORMS[e.form].names, *ALLOCATION_EXPONENTS))
    for q in names:
        rows[f"approach 3: {q}"] = [_with_ci(e.doc["approach3"].get(q), (e.doc["approach3"].get("ci") or {}).get(q))
                                    if q in e.doc["approach3"] or q in ALLOCATION_EXPONENTS else "not in its form"
                                    for e in entries]
    for key in APPROACHES[:2]:
        rows[f"{TITLES[key]}: a"] = [_with_ci(e.doc[key].get("a"), (e.doc[key].get("ci") or {}).get("a"))
                                     if not e.doc[key].get("skipped") else "not run" for e in entries]
    rows["law planned with"] = [TITLES[e.doc["comparison"]["preferred"]] if e.doc["comparison"]["preferred"]
                                else "none identified" for e in entries]
    cells = []
    for e in entries:
        key = e.law_key
        if key is None:
            cells.append("-")
            continue
        at = e.allocations[key].at(flops, e.doc["config"]["ci_level"])
        cells.append(_with_ci(at["params"], (at["ci"] or {}).get("params")))
    rows[f"N_opt at C = {flops:.3g}"] = cells
    return pd.DataFrame(rows, index=[e.label for e in entries]).T


def _with_ci(value: float | None, ci: list | None) -> str:
    if value is None or not np.isfinite(value):
        return "-"
    return f"{value:.4g}" + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else "")


def blocks(table: pd.DataFrame, sources: list[str], figures: tuple[tuple[str, str], ...]) -> list[tuple]:
    """The comparison as report blocks (``report.render_markdown`` and ``render_html`` render them)."""
    inputs = [f"{label}: `{source}`" for label, source in zip(table.columns, sources)]
    rows = [[name] + list(row) for name, row in table.iterrows()]
    return ([("h", 1, "Fits compared"), ("ul", inputs), ("table", ["quantity"] + list(table.columns), rows)]
            + [("img", stem, caption) for stem, caption in figures])
