"""The critical-batch analysis's inputs and outputs: the evaluation points of a batch sweep's run folders (or a table
of them), and critical_batch.json, points.csv, the report and the figures (``python -m analysis critical-batch``).

A sweep folder's ``critical_batch.json`` (written by ``python -m sweeps run``, ``sweeps.critical_batch.MANIFEST``)
names each run's part (grid or held-out) and each part's targets; runs it does not name are the grid's. Each run
folder gives its size (summary.json), batch, rate and seed (config.json), and its held-out losses and, where the run
measured it, its gradient noise scale (metrics.jsonl: ``eval_loss`` and ``noise_scale`` records by step).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.critical_batch import FACTOR, GRID, HELD_OUT, POINT_COLUMNS, ZHANG_OVERHEAD, CriticalBatchError
from analysis.fit_result import json_ready
from analysis.table import step_records
from lab.runtime.files import read_json, write_atomic

MANIFEST = "critical_batch.json"
TABLE_SUFFIXES = (".csv", ".parquet")


def _run_points(run_dir: Path, part: str) -> list[dict] | None:
    """One finished run's evaluation and noise-scale records as points; None for a run that has not completed (its
    curve may stop short of a target it would reach)."""
    try:
        train = read_json(run_dir / "config.json")["train"]
        summary = read_json(run_dir / "summary.json")
        params = summary["params"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CriticalBatchError(f"{run_dir}: not a run folder (config.json, summary.json): "
                                 f"{' '.join(str(exc).split())}") from None
    if summary.get("status") != "completed":
        return None
    fixed = {"run_id": run_dir.name, "part": part, "params": float(params),
             "batch_tokens": float(train["batch_tokens"]), "lr": float(train["lr"]), "seed": int(train.get("seed", 0))}
    points: dict[int, dict[str, float]] = {}
    for rec in step_records(run_dir / "metrics.jsonl"):
        row = points.setdefault(rec["step"], {"eval_loss": math.nan, "noise_scale": math.nan})
        for key in ("eval_loss", "noise_scale"):
            value = rec.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
                row[key] = float(value)  # a resumed run logs a step again: the last record counts
    return [{**fixed, "step": step, **row} for step, row in sorted(points.items())
            if math.isfinite(row["eval_loss"]) or math.isfinite(row["noise_scale"])]


def _folder_points(folder: Path) -> tuple[pd.DataFrame, dict[str, list[float]], list[str]]:
    manifest = read_json(folder / MANIFEST) if (folder / MANIFEST).is_file() else {}
    parts = manifest.get("runs", {})
    runs = sorted(p.parent for p in folder.rglob("summary.json")
                  if p.parent.parent.name == "runs" and p.parent.parent.parent.name not in ("search", "verify"))
    if not runs:
        raise CriticalBatchError(f"no run folders (runs/NAME/summary.json) in {folder}")
    read = {run.name: _run_points(run, parts.get(run.name, GRID)) for run in runs}
    rows = [row for points in read.values() if points is not None for row in points]
    unfinished = sorted(name for name, points in read.items() if points is None)
    unfinished += sorted(set(parts) - set(read))
    notes = [f"left out {len(unfinished)} run(s) of the design that have not completed: "
             f"{', '.join(unfinished[:4])}{', ...' if len(unfinished) > 4 else ''}"] if unfinished else []
    targets = {GRID: list(manifest.get("targets", [])), HELD_OUT: list(manifest.get("held_out_targets", []))}
    return pd.DataFrame(rows, columns=POINT_COLUMNS), targets, notes


def load_points(path: str | Path) -> tuple[pd.DataFrame, dict[str, list[float]], list[str]]:
    """The evaluation points of a batch sweep (a sweep folder, or a points table as this analysis writes it), the
    targets its manifest names (none from a table) and notes (runs of the design left out, unfinished)."""
    path = Path(path)
    if path.is_dir():
        return _folder_points(path)
    if not path.is_file() or path.suffix.lower() not in TABLE_SUFFIXES:
        raise CriticalBatchError(f"{path}: not a sweep folder or a .csv/.parquet table of points")
    try:
        table = pd.read_csv(path) if path.suffix.lower() == ".csv" else pd.read_parquet(path)
    except (OSError, ValueError) as exc:
        raise CriticalBatchError(f"cannot read {path}: {' '.join(str(exc).split())}") from None
    for column, value in {"part": GRID, "seed": 0, "noise_scale": math.nan}.items():
        if column not in table.columns:
            table[column] = value
    return table, {GRID: [], HELD_OUT: []}, []


# ---------------------------------------------------------------- what it prints and writes


def _span(value: float | None, ci: list[float] | None, fmt: str = ".3g") -> str:
    if value is None:
        return "-"
    return f"{value:{fmt}}" + (f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]" if ci else "")


def describe(doc: dict) -> list[str]:
    """The terminal's lines: B_crit per size and target, the laws, the prediction against the measurement."""
    level = f"{100 * doc['level']:.0f} %"
    lines = [f"critical batch per size and target (tokens; {level} intervals from {doc['resamples']} resamples of "
             f"the frontier's residuals):"]
    for f in doc["frontiers"]:
        noise = "not measured" if f["noise_scale"] is None else f"{f['noise_scale']:.3g}"
        lines.append(f"  {f['part']:<8} N {f['params']:>8,.0f}  L {f['target']:<5g} B_crit "
                     f"{_span(f['b_crit'], f['b_crit_ci'])}  S_min {_span(f['s_min'], f['s_min_ci'])}  E_min "
                     f"{_span(f['e_min'], f['e_min_ci'])}  Zhang {_span(f['zhang_batch'], f['zhang_ci'])}  "
                     f"noise scale {noise}")
    loss = doc["laws"]["loss"]
    lines.append(f"law: B_crit(L) = {_span(loss['B_star'], loss['B_star_ci'], '.4g')} tokens x L^(-1/alpha_B), "
                 f"alpha_B = {_span(loss['alpha_B'], loss['alpha_B_ci'], '.3g')} ({loss['n']} frontiers, L "
                 f"{loss['losses'][0]:g}-{loss['losses'][1]:g}, RMSE of log B_crit {loss['rmse_log']:.3g})")
    if "tokens_size" in doc["laws"]:
        z = doc["laws"]["tokens_size"]
        lines.append(f"law: {z['form']}: " + ", ".join(f"{c} = {_span(z['values'][c], z['ci'][c], '.3g')}"
                                                       for c in z["columns"]))
    for p in doc["prediction"]:
        verdict = "within" if p["within"] else "NOT within"
        lines.append(f"held out N {p['params']:,.0f} at L {p['target']:g}: predicted "
                     f"{_span(p['predicted'], p['predicted_ci'])}, measured {_span(p['measured'], p['measured_ci'])}: "
                     f"ratio {p['ratio']:.3g}, {verdict} a factor {FACTOR:g}")
    return lines + [f"warning: {w}" for w in doc["warnings"]]


def markdown(doc: dict, source: str) -> str:
    """report.md: the method in a paragraph, each frontier, the laws, the prediction, the warnings."""
    lines = [f"# The critical batch of {source}", "",
             "Steps S to each target are read from each run's held-out loss curve (made non-increasing by isotonic "
             "regression, interpolated linearly in log steps between the evaluations around the target), tokens "
             "E = B S; each batch at the rate that reached the target in the fewest steps. Per size and target the "
             "hyperbola S = S_min + E_min / B, i.e. (S/S_min - 1)(E/E_min - 1) = 1 (McCandlish et al. 2018), is "
             "fitted on log S; B_crit = E_min / S_min. Intervals: a bootstrap of the fit's residuals (the runs have "
             f"one seed each), {doc['resamples']} resamples, {100 * doc['level']:.0f} %. Zhang et al. (2024)'s "
             f"critical batch: where the tokens first exceed the fewest measured by {100 * ZHANG_OVERHEAD:.0f} %.",
             "", "| part | N | target L | B_crit (tokens) | S_min | E_min | Zhang's batch | noise scale | batches |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for f in doc["frontiers"]:
        noise = "not measured" if f["noise_scale"] is None else f"{f['noise_scale']:.3g}"
        batches = ", ".join(f"{p['batch']:g} (lr {p['lr']:.3g}{', edge' if p['lr_at_edge'] else ''})"
                            for p in f["points"])
        lines.append(f"| {f['part']} | {f['params']:,.0f} | {f['target']:g} | {_span(f['b_crit'], f['b_crit_ci'])} | "
                     f"{_span(f['s_min'], f['s_min_ci'])} | {_span(f['e_min'], f['e_min_ci'])} | "
                     f"{_span(f['zhang_batch'], f['zhang_ci'])} | {noise} | {batches} |")
    lines += ["", "## Laws", ""] + [f"- {line[5:]}" for line in describe(doc) if line.startswith("law: ")]
    if doc["prediction"]:
        lines += ["", "## Predicted, then measured", "",
                  f"| N | target L | predicted B_crit | measured B_crit | measured / predicted | within {FACTOR:g}x |",
                  "|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {p['params']:,.0f} | {p['target']:g} | {_span(p['predicted'], p['predicted_ci'])} | "
                  f"{_span(p['measured'], p['measured_ci'])} | {p['ratio']:.3g} | {'yes' if p['within'] else 'no'} |"
                  for p in doc["prediction"]]
    lines += ["", "![the frontiers](frontier.png)", "", "![B_crit against the loss](bcrit.png)", ""]
    if doc["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in doc["warnings"]] + [""]
    return "\n".join(lines)


def _frontier_figure(doc: dict):
    """S against E per size (a panel each), each target's points and fitted hyperbola, B_crit starred on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({(f["part"], f["params"]) for f in doc["frontiers"]}, key=lambda k: (k[0] != GRID, k[1]))
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4.6), squeeze=False)
    targets = sorted({f["target"] for f in doc["frontiers"]}, reverse=True)
    colours = dict(zip(targets, plt.cm.viridis(np.linspace(0, 0.9, len(targets)))))
    for ax, (part, params) in zip(axes[0], sizes):
        for f in (f for f in doc["frontiers"] if (f["part"], f["params"]) == (part, params)):
            colour = colours[f["target"]]
            batch = np.array([p["batch"] for p in f["points"]])
            ax.scatter([p["tokens"] for p in f["points"]], [p["steps"] for p in f["points"]], color=colour, s=18)
            line = np.geomspace(batch.min() / 4, batch.max() * 4, 60)
            b = f["b_crit"]
            ax.plot(f["e_min"] * (1 + line / b), f["s_min"] * (1 + b / line), color=colour, lw=1,
                    label=f"L = {f['target']:g}: B_crit {b:.3g}")
            ax.scatter([2 * f["e_min"]], [2 * f["s_min"]], marker="*", s=90, color=colour, edgecolor="black", lw=0.5)
        ax.set(xscale="log", yscale="log", xlabel="tokens E to the target", ylabel="steps S to the target",
               title=f"{part}: N = {params:,.0f}")
        ax.legend(fontsize=7)
    fig.suptitle("(S/S_min - 1)(E/E_min - 1) = 1 per target; * at B_crit (2 S_min, 2 E_min)", fontsize=9)
    fig.tight_layout()
    return fig


def _bcrit_figure(doc: dict):
    """B_crit against the target loss: the grid's with intervals, the law with its band, the held-out measured and
    predicted, Zhang's batch and the noise scale where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    law = doc["laws"]["loss"]
    every = [f["target"] for f in doc["frontiers"]]
    grid = np.geomspace(min(every) * 0.98, max(every) * 1.02, 50)
    theta, samples = np.array(law["theta"]), np.array(law["samples"])
    design = np.column_stack([np.ones_like(grid), np.log(grid)])
    ax.plot(grid, np.exp(design @ theta), color="C0", label=f"law: {law['B_star']:.3g} L^-{1 / law['alpha_B']:.3g}")
    if len(samples):
        lo, hi = np.percentile(np.exp(samples @ design.T), [2.5, 97.5], axis=0)
        ax.fill_between(grid, lo, hi, color="C0", alpha=0.15, lw=0)
    sizes = sorted({(f["part"], f["params"]) for f in doc["frontiers"]})
    for i, (part, params) in enumerate(sizes):
        mine = [f for f in doc["frontiers"] if (f["part"], f["params"]) == (part, params)]
        x = np.array([f["target"] for f in mine])
        y = np.array([f["b_crit"] for f in mine])
        err = np.array([[y_ - (f["b_crit_ci"] or [y_, y_])[0], (f["b_crit_ci"] or [y_, y_])[1] - y_]
                        for y_, f in zip(y, mine)]).T
        marker = "o" if part == GRID else "s"
        ax.errorbar(x, y, yerr=err, fmt=marker, color=f"C{i + 1}", capsize=2, label=f"{part} N = {params:,.0f}")
        zhang = [(f["target"], f["zhang_batch"]) for f in mine if f["zhang_batch"] is not None]
        if zhang:
            ax.scatter(*zip(*zhang), marker=marker, facecolor="none", edgecolor=f"C{i + 1}", s=30)
        noise = [(f["target"], f["noise_scale"]) for f in mine if f["noise_scale"] is not None]
        if noise:
            ax.scatter(*zip(*noise), marker="x", color=f"C{i + 1}", s=30)
    if doc["prediction"]:
        ax.scatter([p["target"] for p in doc["prediction"]], [p["predicted"] for p in doc["prediction"]],
                   marker="D", facecolor="none", edgecolor="black", s=40, label="predicted (held out)")
    ax.set(xscale="log", yscale="log", xlabel="target loss L (nats per token)", ylabel="critical batch (tokens)",
           title="B_crit against the loss (hollow: Zhang et al.'s 20 % batch; x: noise scale)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write(out: Path, doc: dict, points: pd.DataFrame, source: str) -> list[str]:
    """points.csv, the figures, report.md and critical_batch.json (last) into ``out``, each file atomically."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "points.csv", points.to_csv(index=False))
    for name, maker in (("frontier.png", _frontier_figure), ("bcrit.png", _bcrit_figure)):
        buffer = io.BytesIO()
        figure = maker(doc)
        figure.savefig(buffer, format="png", dpi=150)
        figure.clf()
        write_atomic(out / name, buffer.getvalue())
    write_atomic(out / "report.md", markdown(doc, source))
    write_atomic(out / "critical_batch.json", json.dumps(json_ready(doc), indent=2, allow_nan=False) + "\n")
    return ["points.csv", "frontier.png", "bcrit.png", "report.md", "critical_batch.json"]
