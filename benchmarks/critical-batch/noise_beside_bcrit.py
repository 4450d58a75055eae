"""The gradient noise scale measured beside the batch sweep's critical batch (issue 58).

Run: ``.venv/bin/python benchmarks/critical-batch/noise_beside_bcrit.py SWEEP_FOLDER --out FOLDER`` from the
repository root, after ``python -m analysis critical-batch SWEEP_FOLDER --out SWEEP_FOLDER/critical-batch`` (a few
minutes on 2 cores).

The batch sweep's runs train at one micro-batch a step (their batch whole), where the noise meter has no small batch
to set against the step's. For each size this trains again the sweep's run at ``BATCH`` tokens at the rate its
frontier chose at the middle target, in micro-batches of ``MICRO`` sequences (the same step, accumulated: the same
training up to regrouped sums) with ``train.noise_scale true``, into its own folder beside the sweep's. It reads the
smoothed noise scale B_simple at the step the run reaches each target (``analysis.critical_batch.crossings``, as the
report reads a run's) and prints it beside that size's B_crit at the target, and their ratio (McCandlish et al.:
B_crit ≈ B_simple up to a small factor).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from analysis.critical_batch import GRID, crossings
from analysis.critical_batch_report import load_points

BATCH = 2048  # tokens a step: 4 micro-batches of MICRO sequences of 128 tokens
MICRO = 4


def chosen_runs(sweep: Path, doc: dict) -> list[tuple[str, list[str]]]:
    """Per size: the sweep's run at ``BATCH`` tokens at the rate its frontier took at the middle target, and its
    launch/run.py options."""
    plans = {name: json.loads(plan) for name, plan in
             sqlite3.connect(sweep / "sweep.db").execute("select name, plan from runs")}
    out = []
    for params in sorted({f["params"] for f in doc["frontiers"]}):
        frontiers = [f for f in doc["frontiers"] if f["params"] == params]
        middle = frontiers[len(frontiers) // 2]
        lr = next(p["lr"] for p in middle["points"] if p["batch"] == BATCH)
        name, plan = next((n, p) for n, p in plans.items() if p["params"] == params
                          and p["batch_tokens"] == BATCH and abs(p["lr"] - lr) <= 1e-9 * lr)
        out.append((name, list(plan["args"])))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", type=Path, help="the batch sweep's folder")
    p.add_argument("--out", type=Path, required=True, help="a new folder for the runs with the meter")
    args = p.parse_args()
    doc = json.loads((args.sweep / "critical-batch" / "critical_batch.json").read_text())
    for name, options in chosen_runs(args.sweep, doc):
        run_dir = args.out / "runs" / name
        if not (run_dir / "summary.json").is_file():
            options += ["--train.micro_batch", str(MICRO), "--train.noise_scale", "true", "--run-dir", str(run_dir)]
            subprocess.run([sys.executable, "launch/run.py", *options], check=True, stdout=subprocess.DEVNULL)
    points, _, _ = load_points(args.out)
    targets = sorted({t for part in doc["targets"].values() for t in part}, reverse=True)
    found = crossings(points, {GRID: targets})
    print("| N | L | B_crit (tokens) [95 %] | B_simple at the step it is reached (tokens) | B_crit / B_simple |")
    print("|---:|---:|---:|---:|---:|")
    for f in doc["frontiers"]:
        row = found[(found["params"] == f["params"]) & (found["target"] == f["target"])]
        noise = float(row["noise_scale"].iloc[0]) if len(row) else float("nan")
        low, high = f["b_crit_ci"]
        print(f"| {f['params']:,.0f} | {f['target']:g} | {f['b_crit']:,.0f} [{low:,.0f}, {high:,.0f}] | "
              f"{noise:,.0f} | {f['b_crit'] / noise:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
