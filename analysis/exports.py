"""The report's numbers as data: ``tables.csv`` (one tidy table) and ``tables.tex`` (LaTeX tabulars), from fit.json.

Every row of tables.csv is one value: the table it belongs to, the row (an approach, a published law, a
budget, a Huber delta), the quantity, its value and, where the bootstrap gives one, its interval.
tables.tex holds the same tables as ``tabular`` environments (booktabs rules), one per table, for a paper.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis.compare import APPROACHES, TITLES
from lab.measure.laws import FORMS
from analysis.published import LAWS

LAW_KEYS = ("a", "b", "k_N", "k_D")
CAPTIONS = {
    "parameters": "Approach 3: L(N, D) in its form's parameters",
    "allocation": "N_opt = k_N C^a, D_opt = k_D C^b per approach",
    "predictions": "Compute-optimal allocation at the prediction budgets",
    "published": "Published laws",
    "huber_delta": "Approach 3 refitted at each Huber delta",
    "holdout": "Hold-out: predicted against actual loss per held-out run",
}


def _row(table: str, row: str, quantity: str, value: float | None, ci: list | None = None) -> dict:
    lo, hi = (ci or (None, None))[:2]
    return {"table": table, "row": row, "quantity": quantity, "value": value, "ci_low": lo, "ci_high": hi}


def tidy(doc: dict) -> pd.DataFrame:
    """Every number of the report's tables, one per row (see the module docstring)."""
    rows = []
    a3 = doc["approach3"]
    ci = a3.get("ci") or {}
    names = FORMS[a3.get("form", "chinchilla")].names
    rows += [_row("parameters", "approach 3", k, a3.get(k), ci.get(k)) for k in (*names, "a", "b", "G")]
    for key in APPROACHES:
        section = doc[key]
        if section.get("skipped") or section.get("a") is None:
            continue
        law_ci = section.get("ci") or {}
        rows += [_row("allocation", TITLES[key], k, section.get(k), law_ci.get(k)) for k in LAW_KEYS]
    for p in doc["predictions"]:
        for key in APPROACHES:
            entry = p.get(key)
            if entry is None:
                continue
            entry_ci = entry.get("ci") or {}
            name = f"{TITLES[key]} at C = {p['flops']:.4g}"
            rows += [_row("predictions", name, q, entry.get(q), entry_ci.get(q)) for q in ("params", "tokens", "loss")
                     if entry.get(q) is not None]
    for law in LAWS:
        values = {**law.as_dict(), "a": law.a, "R_D*": law.r_d_star, "R_N*": law.r_n_star}
        rows += [_row("published", law.name, k, v) for k, v in values.items() if v is not None]
    for r in doc.get("delta_sensitivity") or []:
        rows += [_row("huber_delta", f"delta = {r['huber_delta']:g}", k, r[k])
                 for k in (*names, "a")]
    hold = doc.get("holdout") or {}
    if not hold.get("skipped", True):
        for r in hold["approach3"]["runs"]:
            rows += [_row("holdout", r["run_id"], q, r[q]) for q in ("loss", "predicted")]
    return pd.DataFrame(rows, columns=["table", "row", "quantity", "value", "ci_low", "ci_high"])


def _cell(value: float | None, lo: float | None, hi: float | None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "--"
    text = f"{value:.4g}"
    return text + (f" [{lo:.4g}, {hi:.4g}]" if lo is not None and hi is not None and not pd.isna(lo) else "")


def latex(frame: pd.DataFrame) -> str:
    """One booktabs tabular per table of ``tidy``: rows by quantities, intervals in brackets."""
    parts = []
    for name, caption in CAPTIONS.items():
        part = frame[frame["table"] == name]
        if part.empty:
            continue
        cells = part.assign(cell=[_cell(v, lo, hi) for v, lo, hi in zip(part["value"], part["ci_low"],
                                                                          part["ci_high"])])
        # a row named twice (two runs of one id, a table appended to itself) gets its own line: "id (2)"
        seen = cells.groupby(["row", "quantity"], sort=False).cumcount()
        cells["row"] = [row if n == 0 else f"{row} ({n + 1})" for row, n in zip(cells["row"], seen)]
        wide = cells.pivot(index="row", columns="quantity", values="cell").fillna("--")
        wide = wide.loc[list(dict.fromkeys(cells["row"])), list(dict.fromkeys(part["quantity"]))]
        wide.index.name, wide.columns.name = None, None
        body = wide.to_latex(escape=True, column_format="l" + "r" * len(wide.columns))
        parts.append(f"% {caption}\n{body}")
    return "\n".join(parts)
