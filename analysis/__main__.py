"""Command line: ``python -m analysis fit RESULTS --out DIR`` and ``python -m analysis plan FIT_JSON``.

Bad input ends the command before any work with one line ``error: ...`` on stderr and exit code
2. ``fit`` writes every output into a staging folder inside DIR and only then renames each file
into place, so an earlier fit in DIR is never lost or left half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# The fits work on short vectors, where BLAS threads only add overhead and contend for the cores;
# this must be set before numpy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pandas as pd  # noqa: E402

from analysis.fit import FitConfig, FitResult, fit_runs  # noqa: E402
from analysis.parametric import named_samples  # noqa: E402
from analysis.planner import BOOTSTRAP_COLUMNS, describe, load_fit, plan  # noqa: E402
from analysis.table import PARAMS_COUNTS, InputError, load_runs, parse_column_map  # noqa: E402

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m analysis", description="Scaling-law fits, reports and run planning.")
    sub = parser.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fit", help="fit scaling laws to a sweep folder or a table of runs")
    f.add_argument("results", help="sweep folder, or a .csv/.parquet/.json/.jsonl table (one row per run)")
    f.add_argument("--out", required=True, help="output folder (created if missing)")
    f.add_argument("--predict", type=float, nargs="+", default=[], metavar="FLOPS",
                   help="budgets to predict N_opt, D_opt and loss for (default: 1x, 10x, 100x the data's largest C)")
    f.add_argument("--column", action="append", default=[], metavar="NAME=COLUMN",
                   help="map a table column to params, params_non_embedding, tokens, flops, loss or run_id")
    f.add_argument("--params-count", choices=PARAMS_COUNTS, default=None,
                   help="parameter count used as N when both are present (default: total)")
    f.add_argument("--budget-tol", type=float, default=0.05, help="relative tolerance on C for IsoFLOP budgets")
    f.add_argument("--include-edge-minima", action="store_true", help="keep edge minima in the IsoFLOP fit")
    f.add_argument("--isoflop-minimum", choices=("vertex", "lowest"), default="vertex",
                   help="per-budget minimum for the IsoFLOP power laws (default: parabola vertex)")
    f.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (0: none)")
    f.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    f.add_argument("--ci", type=float, default=0.95, help="interval level")
    f.add_argument("--workers", type=int, default=1, help="processes for the parametric bootstrap")
    f.add_argument("--starts", type=int, default=8, help="L-BFGS starts from the best grid points")
    f.add_argument("--no-holdout", action="store_true", help="skip the hold-out check")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("plan", help="compute-optimal N, D, loss and time for a budget, from a fit.json")
    p.add_argument("fit_json", help="fit.json written by 'fit'")
    p.add_argument("--gpu", required=True, help="GPU name, e.g. H100")
    p.add_argument("--n-gpus", type=int, required=True)
    p.add_argument("--mfu", type=float, required=True, help="assumed model-FLOPs utilisation, 0-1")
    p.add_argument("--dtype", default="bf16")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--gpu-hours", type=float, help="budget in GPU-hours, all GPUs together")
    budget.add_argument("--flops", type=float, help="budget in training FLOPs")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _write_outputs(result: FitResult, out: Path) -> list[str]:
    """Write all outputs to a staging folder in ``out``, then rename them into place."""
    from analysis.plots import make_plots  # matplotlib only when there is something to draw
    from analysis.report import build_blocks, render_html, render_markdown

    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fit-staging-", dir=out))
    try:
        doc = result.to_dict()
        (staging / "fit.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        if result.thetas is not None:
            samples = named_samples(result.thetas)
            pd.DataFrame({k: samples[k] for k in BOOTSTRAP_COLUMNS}).to_csv(staging / "bootstrap.csv", index=False)
        make_plots(result, staging)
        blocks = build_blocks(doc)
        (staging / "report.md").write_text(render_markdown(blocks))
        (staging / "report.html").write_text(render_html(blocks))
        names = sorted(p.name for p in staging.iterdir())
        for name in names:
            (staging / name).replace(out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return names


def _fit(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder")
    config = FitConfig(budget_tol=args.budget_tol, include_edge=args.include_edge_minima,
                       isoflop_minimum=args.isoflop_minimum, n_bootstrap=args.bootstrap, seed=args.seed,
                       ci_level=args.ci, workers=args.workers, n_starts=args.starts, predict=tuple(args.predict),
                       holdout=not args.no_holdout, progress=not args.no_progress)
    config.validate()
    table = load_runs(args.results, parse_column_map(args.column), args.params_count)
    result = fit_runs(table, config)
    names = _write_outputs(result, out)
    p = result.parametric.params
    print(f"fitted {len(table.runs)} runs: approach 3 a={p['a']:.4g} b={p['b']:.4g} "
          f"(E={p['E']:.4g} A={p['A']:.4g} B={p['B']:.4g} alpha={p['alpha']:.4g} beta={p['beta']:.4g})")
    for code, message in result.warnings:
        print(f"warning [{code}]: {message}")
    print(f"wrote {', '.join(names)} to {out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    doc, samples = load_fit(args.fit_json)
    result = plan(doc, args.gpu, args.n_gpus, args.mfu, flops=args.flops, gpu_hours=args.gpu_hours,
                  dtype=args.dtype, samples=samples, level=(doc.get("config") or {}).get("ci_level", 0.95))
    print(json.dumps(result.to_dict(), indent=2) if args.json else describe(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return _fit(args) if args.command == "fit" else _plan(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
