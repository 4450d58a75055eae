"""The curve law held to the seed noise (issue 51), one command on a sweep folder:

    python -m analysis.curve_check SWEEP_FOLDER [--out DIR]

Fits the loss-curve law (``analysis.curves``) to the eval curves of the sweep's runs (FOLDER/runs) below its largest
budget, predicts the largest budget's curves and the verify runs' (FOLDER/verify/runs, 4x beyond), and sets each
curve's mean relative error beside the sweep's seed noise: the median, over pairs of runs that differ only in their
seed (same N, budget, schedule, steps and rate), of the mean relative gap between their curves. Met when the largest
budget's median error is within max(1 %, 1.5 x the seed noise), each of its curves within 2.5 %, and each verify
curve within 3 %.

The law's domain is the sizes it was fitted on: a held-out run larger (or smaller) than every fitted run is an
extrapolation in N, which the command warns about and marks; its error still counts. With --out, check.json and
check.png (every curve against the law, held-out ones dashed) are written there. Exit 0 when met, 1 when not, 2 on
bad input.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import curves as law
from analysis.table import InputError
from lab.runtime.files import write_atomic

FLOOR = 0.01  # the median held-out error may always be this large ...
NOISE_MULTIPLE = 1.5  # ... or this multiple of the seed noise
EACH = 0.025  # every curve of the largest budget
VERIFY_EACH = 0.03  # every verify curve
PAIR_KEYS = ("params", "flops", "schedule", "steps", "lr")
BUDGET_TOL = 0.05  # runs within this of the largest C are the largest budget's


def seed_gaps(curves: list[law.Curve], facts: pd.DataFrame) -> list[dict]:
    """Each pair of runs that differ only in their seed, with the mean relative gap of their shared points."""
    out = []
    for _, group in facts.groupby(list(PAIR_KEYS)):
        rows = list(group.index)
        for i, first in enumerate(rows):
            for second in rows[i + 1:]:
                a, b = curves[first], curves[second]
                steps, ia, ib = np.intersect1d(a.steps, b.steps, return_indices=True)
                if len(steps):
                    gap = np.abs(a.loss[ia] - b.loss[ib]) / (0.5 * (a.loss[ia] + b.loss[ib]))
                    out.append({"runs": [a.run_id, b.run_id], "params": a.params, "gap": float(np.mean(gap))})
    return out


def check(folder: Path) -> tuple[dict, law.CurveFit, list[law.Curve], list[law.Curve]]:
    """The fit, the held-out errors, the seed noise and the verdict of a sweep folder; also the fit and the curves
    fitted and held out (for the figure)."""
    if not (folder / "runs").is_dir():
        raise InputError(f"{folder}: not a sweep folder (no runs/ in it)")
    curves, facts = law.load_curves([folder / "runs"])
    flops = facts["flops"].to_numpy(float)
    top = flops >= flops.max() / (1 + BUDGET_TOL)
    if top.all():
        raise InputError(f"{folder}: every run is at the largest budget; the law needs smaller ones to be fitted on")
    fitted = [c for c, t in zip(curves, top) if not t]
    held = [c for c, t in zip(curves, top) if t]
    finished = folder / "verify" / "runs"
    verify = law.load_curves([finished])[0] if any(finished.rglob("summary.json")) else []  # none yet: none
    fit = law.fit_curves(fitted, n_bootstrap=0)
    lo, hi = min(c.params for c in fitted), max(c.params for c in fitted)
    gaps = seed_gaps(curves, facts)
    noise = float(np.median([g["gap"] for g in gaps])) if gaps else None
    bound = max(FLOOR, NOISE_MULTIPLE * noise) if noise is not None else FLOOR
    rows = []
    for role, group, each in (("largest budget", held, EACH), ("verify", verify, VERIFY_EACH)):
        for h in law.holdout(fit, group):
            rows.append({**h, "role": role, "within": h["mean_rel_error"] <= each, "each_bound": each,
                         "in_domain": bool(lo <= h["params"] <= hi)})
    top_errors = [r["mean_rel_error"] for r in rows if r["role"] == "largest budget"]
    median = float(np.median(top_errors))
    doc = {"folder": str(folder), "fit": {**fit.to_dict(), "problems": law.identification(fit, fitted)},
           "domain": [lo, hi], "fitted_runs": len(fitted), "largest_budget": float(np.median(flops[top])),
           "seed_pairs": gaps, "seed_noise": noise, "bound": bound, "median_error": median, "held_out": rows,
           "met": bool(median <= bound and all(r["within"] for r in rows))}
    return doc, fit, fitted, held + verify


def describe(doc: dict) -> list[str]:
    """What the command prints: the seed noise, each held-out curve's error beside its bound, warnings, verdict."""
    lo, hi = doc["domain"]
    noise = doc["seed_noise"]
    gaps = [g["gap"] for g in doc["seed_pairs"]]
    lines = [f"fitted the curve law to {doc['fitted_runs']} runs below C = {doc['largest_budget']:.3g} (N "
             f"{lo:.3g} to {hi:.3g}): RMSE of log loss {doc['fit']['rmse_log_loss']:.3g}",
             (f"seed noise: median {noise:.2%} over {len(gaps)} pairs of runs that differ only in seed (largest "
              f"{max(gaps):.2%})" if gaps else "seed noise: no pairs of runs that differ only in seed; the bound is "
              f"{FLOOR:.0%}"),
             f"{'run':<28} {'role':<15} {'N':>9} {'error':>7} {'bias':>7} {'bound':>6}  domain"]
    for r in doc["held_out"]:
        lines.append(f"{r['run_id']:<28} {r['role']:<15} {r['params']:>9.3g} {r['mean_rel_error']:>7.2%} "
                     f"{r['bias']:>+7.2%} {r['each_bound']:>6.1%}  {'in' if r['in_domain'] else 'OUTSIDE'}"
                     f"{'' if r['within'] else '  (beyond its bound)'}")
    outside = [r["run_id"] for r in doc["held_out"] if not r["in_domain"]]
    if outside:
        lines.append(f"warning [extrapolation]: {len(outside)} held-out run(s) lie outside the sizes the law was "
                     f"fitted on ({lo:.3g} to {hi:.3g} parameters): {', '.join(outside)}; their curves extrapolate "
                     "its size term")
    for problem in doc["fit"]["problems"]:
        lines.append(f"warning [unidentified]: {problem}")
    lines.append(f"largest budget: median error {doc['median_error']:.2%} against max({FLOOR:.0%}, "
                 f"{NOISE_MULTIPLE:g} x seed noise) = {doc['bound']:.2%}; each within {EACH:.1%}; verify runs each "
                 f"within {VERIFY_EACH:.0%}: {'met' if doc['met'] else 'NOT met'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.curve_check", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a sweep folder (python -m sweeps run): runs/, verify/runs/")
    parser.add_argument("--out", type=Path, help="write check.json and check.png here")
    args = parser.parse_args(argv)
    try:
        if args.out is not None and args.out.exists() and not args.out.is_dir():
            raise InputError(f"--out {args.out} exists and is not a folder")
        doc, fit, fitted, held = check(args.folder)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(describe(doc)))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        law.figure(fit, fitted, held).savefig(buffer, format="png", dpi=150)
        write_atomic(args.out / "check.png", buffer.getvalue())
        doc["fit"].pop("resamples")
        write_atomic(args.out / "check.json", json.dumps(doc, indent=2) + "\n")
        print(f"wrote check.json, check.png to {args.out}")
    return 0 if doc["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
