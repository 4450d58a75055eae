"""The IsoFLOP exponent a on published sweeps: the lab's estimators against the authors' 95 % intervals.

Run: ``.venv/bin/python benchmarks/published-isoflop/bench_published_isoflop.py [--cs336 isoflops_curves.json]
[--out FILE]`` (the output is in benchmarks/published-isoflop/README.md).

Porian et al. (2024)'s 15 setups (``tests/analysis/data/porian2024-*.csv``: each budget's sizes and losses as
their released analysis read them off the training curves, with their a and 95 % interval). For each setup,
``python -m analysis fit``'s approach 2 with each per-budget minimum (``--isoflop-minimum``: the default and the
others; intervals from the fit's own bootstrap of runs, 1,000 resamples), and their whole procedure as
``analysis.akima.exponent`` reproduces it (seed-noise draws, weighted fit; numpy seed 42 as their notebook).
With ``--cs336``, the IsoFLOP runs of Stanford CS336's 2024 assignment 3 (data/isoflops_curves.json of
stanford-cs336/spring2024-assignment3-scaling; not shipped: no licence), which publish no interval.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import akima
from analysis.bootstrap import CHUNK, Problem, canonical_order, interval
from analysis.budgets import group_budgets
from analysis.fit import FitConfig
from analysis.isoflop import METHODS, budget_minima
from analysis.table import load_runs

DATA = Path(__file__).resolve().parents[2] / "tests" / "analysis" / "data"
ESTIMATORS = (FitConfig.isoflop_minimum,) + tuple(m for m in METHODS if m != FitConfig.isoflop_minimum)


def porian() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Their setups (a and interval) and the runs of each: setup, flops, params, tokens (C = 6 N D), loss."""
    setups = pd.read_csv(DATA / "porian2024-setups.csv")
    runs = pd.read_csv(DATA / "porian2024-isoflop.csv")
    return setups, runs.assign(tokens=runs["flops"] / (6 * runs["params"]))


def lab_fits(runs: pd.DataFrame, folder: Path) -> dict[str, dict]:
    """Approach 2 of ``python -m analysis fit`` on ``runs`` with each per-budget minimum: a, its interval, budgets.

    The same budgets, C = k N D and resamples (runs drawn within budgets, seed 0, canonical order) as ``fit_runs``;
    approach 3, which the full fit also bootstraps and which these rows do not need, is skipped.
    """
    path = folder / "runs.csv"
    runs.assign(run_id=[f"r{i}" for i in range(len(runs))])[["run_id", "params", "tokens", "flops", "loss"]].to_csv(
        path, index=False)
    table, config = load_runs(path), FitConfig()
    n, d, c, loss = table.n, table.d, table.c, table.loss
    budgets = group_budgets(c, config.budget_tol, n)
    problem = Problem(theta0=np.zeros(0), n=n, d=d, loss=loss, labels=budgets.labels, budget_flops=budgets.flops,
                      flops_k=table.flops_k, envelope=None, seed=config.seed, order=canonical_order(c, n, d, loss))
    count = config.n_bootstrap
    weights = np.concatenate([np.ones((1, len(n)))] + [problem.weights(j, min(CHUNK, count - lo))
                                                       for j, lo in enumerate(range(0, count, CHUNK))])
    minima = budget_minima(n, loss, budgets.labels, budgets.flops, weights)
    out = {}
    for method in ESTIMATORS:
        laws = minima.power_laws(method, n, d, table.flops_k)
        out[method] = {"a": float(laws.a[0]), "ci": interval(laws.a[1:], config.ci_level),
                       "budgets": int(laws.n_points[0])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cs336", type=Path, help="the CS336 assignment's data/isoflops_curves.json")
    parser.add_argument("--out", type=Path, help="also write the tables as Markdown here")
    args = parser.parse_args()
    setups, runs = porian()
    head = ["setup", "their a [95 %]"] + [f"lab `{m}`{' (default)' if m == ESTIMATORS[0] else ''}"
                                         for m in ESTIMATORS] + ["their procedure, reproduced"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    errors: dict[str, list[float]] = {m: [] for m in ESTIMATORS + ("reproduced",)}
    inside = dict.fromkeys(errors, 0)
    with tempfile.TemporaryDirectory() as tmp:
        for s in setups.itertuples():
            mine = runs[runs["setup"] == s.id]
            cells = [f"{s.id}. {s.label}, {s.dataset} ({s.loss_kind} loss)", f"{s.a:.3f} [{s.a_lo:.3f}, {s.a_hi:.3f}]"]
            found = lab_fits(mine, Path(tmp))
            flops, log_n, loss = mine["flops"].to_numpy(), np.log(mine["params"].to_numpy()), mine["loss"].to_numpy()
            theirs = akima.exponent(flops, log_n, loss, s.noise, seed=42)
            found["reproduced"] = {"a": theirs.a, "ci": list(theirs.interval),
                                   "budgets": sum(b.usable for b in theirs.budgets)}
            for key, f in found.items():
                ok = s.a_lo <= f["a"] <= s.a_hi
                errors[key].append(f["a"] - s.a)
                inside[key] += ok
                ci = f"[{f['ci'][0]:.3f}, {f['ci'][1]:.3f}]" if f["ci"] else "[-]"
                cells.append(f"{f['a']:.3f} {ci}, {f['budgets']} budgets{'' if ok else ' **outside**'}")
            lines.append("| " + " | ".join(cells) + " |")
    summary = ["", f"Inside the authors' 95 % interval, of {len(setups)} setups (error: a minus theirs):", ""]
    summary += [f"- `{key}`: {inside[key]}, mean error {np.mean(errors[key]):+.4f}, largest |error| "
                f"{np.max(np.abs(errors[key])):.4f}" for key in errors]
    if args.cs336:
        summary += ["", cs336(args.cs336)]
    text = "\n".join(lines + summary) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


def cs336(path: Path) -> str:
    """a by each per-budget minimum on CS336's IsoFLOP runs (C = 6 N D)."""
    runs = pd.DataFrame(json.loads(path.read_text())).rename(
        columns={"parameters": "params", "compute_budget": "flops", "final_loss": "loss"})
    runs = runs.assign(tokens=runs["flops"] / (6 * runs["params"]))
    with tempfile.TemporaryDirectory() as tmp:
        found = lab_fits(runs, Path(tmp))
    return (f"CS336 (2024) assignment 3, {len(runs)} runs at {runs['flops'].nunique()} budgets, no published "
            "interval: " + "; ".join(f"`{m}` a = {f['a']:.3f} [{f['ci'][0]:.3f}, {f['ci'][1]:.3f}] from {f['budgets']} "
                                     "budgets" for m, f in found.items()))


if __name__ == "__main__":
    main()
