"""Command line: ``python -m analysis fit RESULTS --out DIR``, ``python -m analysis compare FIT_OR_SWEEP ... --out
DIR``, ``python -m analysis predict FIT_JSON --params N --tokens D``, ``python -m analysis plan FIT_JSON``, and
``curves``, ``routed``, ``watch`` and ``critical-batch``.

Exit codes: 0 done; 2 bad input, one line ``error: ...`` on stderr before any work; 3 the data
identify no law (``fit`` still writes its report, which says why; ``plan`` refuses); 130
interrupted. ``fit`` writes its outputs whole or not at all (``analysis.outputs``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pandas as pd

from analysis.allocate import Unidentified, allocations, batch_plan, describe, load_batch_law, load_fit, plan
from analysis.compare import APPROACHES
from analysis.fit import fit_runs, fit_without_outliers
from analysis.fit_config import ENVELOPE_SOURCES, FORM_CHOICES, FitConfig
from analysis.fit_result import json_ready
from analysis.isoflop import METHODS
from analysis.other_laws import LAWS
from analysis.outputs import (STAGING_PREFIX, bootstrap_frame, refuse_foreign_out, stopping_on_signals, summary_lines,
                              write_outputs)
from analysis.robust import HUBER_DELTA
from analysis.table import (
    DUPLICATE_ALIASES,
    DUPLICATE_POLICIES,
    PARAMS_COUNTS,
    InputError,
    RunTable,
    load_runs,
    parse_column_map,
)
from lab.runtime.config import ConfigError, Parser
from lab.runtime.files import UnreadableFile, write_atomic

EXIT_USAGE = 2
FIGURE_FORMATS = ("png", "svg", "pdf")
EXIT_UNIDENTIFIED = 3
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m analysis", description="Scaling-law fits, reports and run planning.")
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
    f.add_argument("--duplicates", choices=DUPLICATE_POLICIES + tuple(DUPLICATE_ALIASES), default="keep",
                   help="runs with the same N and D: keep each as its own point, warning with their spread (default), "
                        "average each group into one run (mean; 'aggregate' is its old name) or refuse the table")
    f.add_argument("--exclude", action="append", default=[], metavar="RUN_ID_OR_CONDITION",
                   help="leave out the run with this id, or the runs matching a pandas condition on the columns "
                        "(e.g. \"loss > 4\" or \"params < 1e7\"); repeatable; the report lists what was dropped")
    f.add_argument("--drop-highest-loss", type=int, default=0, metavar="K",
                   help="leave out the K runs with the highest loss (after --exclude)")
    f.add_argument("--drop-outliers", action="store_true",
                   help="fit again without the runs the fit flags as outliers (robust residuals from approach 3); "
                        "the report lists them with the runs left out")
    f.add_argument("--side-runs", action="store_true",
                   help="also fit the rows a table's role column marks as a sweep's search or verify runs "
                        "(left out by default, as they are from a sweep folder)")
    f.add_argument("--law", choices=LAWS, default="chinchilla",
                   help="also fit Kaplan et al.'s form or Muennighoff et al.'s data-constrained law (needs a "
                        "unique_tokens column) beside approach 3 (default: Chinchilla's form only)")
    f.add_argument("--form", choices=FORM_CHOICES, default="auto",
                   help="approach 3's form of L(N, D): Chinchilla's E + A/N^alpha + B/D^beta, kaplan-e (Kaplan et "
                        "al.'s with an irreducible E), shared (Gadre et al.'s E + A/N^alpha + B/D^alpha), or auto "
                        "(default): the one that predicts the hold-out's runs best when refitted without them "
                        "(Chinchilla's without a hold-out, or shared from five runs); every form is reported")
    f.add_argument("--huber-delta", type=float, default=HUBER_DELTA,
                   help=f"approach 3's Huber threshold on log-loss residuals (default {HUBER_DELTA:g}, as in "
                        "Hoffmann et al.)")
    f.add_argument("--budget-tol", type=float, default=0.05, help="relative spread of C within one budget")
    f.add_argument("--isoflop-minimum", choices=METHODS, default=FitConfig.isoflop_minimum,
                   help="per-budget minimum for the IsoFLOP power laws: akima (Porian et al. 2024: the minimum of "
                        "an Akima spline through every size), vertex (a parabola in a window symmetric about the "
                        "lowest run) or lowest (the lowest run); default: %(default)s")
    f.add_argument("--envelope", choices=ENVELOPE_SOURCES, default="final",
                   help="approach 1's points: final losses only (default), or every point of the training curves, "
                        "valid only when each logged point is an end point (not for single cosine schedules)")
    f.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (0: none)")
    f.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    f.add_argument("--ci", type=float, default=0.95, help="interval level")
    f.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="processes for the bootstrap (default: the CPUs available)")
    f.add_argument("--starts", type=int, default=8, help="starts of the fit from the best grid points")
    f.add_argument("--no-holdout", action="store_true", help="skip the hold-out check")
    held = f.add_mutually_exclusive_group()
    held.add_argument("--holdout-budgets", type=int, default=1, metavar="K",
                      help="the hold-out check keeps back the K largest budgets (default 1)")
    held.add_argument("--holdout-above", type=float, default=None, metavar="FLOPS",
                      help="the hold-out check keeps back every run with C above FLOPS")
    f.add_argument("--format", default="png", type=_formats, metavar="FORMATS",
                   help=f"figure formats, comma-separated, of {', '.join(FIGURE_FORMATS)} (default png; the PNG, "
                        "200 dpi, is always written for the reports)")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")

    c = sub.add_parser("compare", help="overlay the allocation and frontier of several fits or sweeps, with a "
                                       "side-by-side parameter table")
    c.add_argument("inputs", nargs="+", metavar="FIT_OR_SWEEP",
                   help="a fit.json (or a folder holding one), or a sweep folder or table to fit with the defaults")
    c.add_argument("--out", required=True, help="output folder (created if missing)")
    c.add_argument("--label", action="append", default=[], help="a name per input, in order (default: folder names)")
    c.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for inputs fitted here")
    c.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes for the bootstrap")
    c.add_argument("--format", default="png", type=_formats, metavar="FORMATS",
                   help=f"figure formats, comma-separated, of {', '.join(FIGURE_FORMATS)} (the PNG is always written)")

    q = sub.add_parser("predict", help="approach 3's loss at given (N, D) pairs, with bootstrap intervals")
    q.add_argument("fit_json", help="fit.json written by 'fit' (bootstrap.csv beside it gives the intervals)")
    q.add_argument("--params", type=float, nargs="+", default=[], metavar="N", help="parameter counts")
    q.add_argument("--tokens", type=float, nargs="+", default=[], metavar="D", help="token counts, one per N")
    q.add_argument("--csv", help="a CSV of pairs (columns params, tokens) instead of --params/--tokens")
    q.add_argument("--json", action="store_true", help="print the predictions as JSON")

    k = sub.add_parser("curves", help="fit the loss-curve law with the learning-rate schedule (Tissue et al. 2024) "
                                      "to runs' loss curves, and predict curves")
    k.add_argument("inputs", nargs="+", metavar="SWEEP_OR_RUN", help="sweep folders or run folders")
    k.add_argument("--out", required=True, help="output folder (created if missing)")
    k.add_argument("--loss", choices=("eval", "train"), default="eval",
                   help="the curve's points: held-out loss (default; needs train.eval_every) or the training loss")
    k.add_argument("--hold-out", default=None, metavar="CONDITION",
                   help="leave out the runs matching a pandas condition on run_id, params, flops, steps, schedule, "
                        "lr (e.g. \"flops > 1.5e12\" or \"schedule == 'wsd'\") and predict their curves")
    k.add_argument("--predict", action="append", default=[], metavar="N,SCHEDULE,STEPS,LR",
                   help="a curve to predict (repeatable), e.g. 1e5,wsd,4000,8e-3")
    _resampling_options(k, "bootstrap resamples of whole runs (0: none)")

    r = sub.add_parser("routed", help="fit the routed models' law (one A per routing configuration, dense among "
                                      "them) and say which configuration, size and tokens each budget should use")
    r.add_argument("results", help="sweep folder, or a .csv/.parquet/.json/.jsonl table (one row per run)")
    r.add_argument("--out", required=True, help="output folder for routed.json and routed.png (created if missing)")
    r.add_argument("--predict", type=float, nargs="+", default=[], metavar="FLOPS",
                   help="budgets to plan (default: 1x, 10x, 100x the data's largest C)")
    _resampling_options(r, "bootstrap resamples of runs within configurations")

    w = sub.add_parser("watch", help="a run folder (in progress or finished) against a law: expected loss, interval "
                                     "and deviation at each eval, a warning once it is off track, a plot")
    w.add_argument("run", help="run folder (config.json, summary.json, metrics.jsonl with eval records)")
    w.add_argument("--law", required=True, help="curves.json (python -m analysis curves) or fit.json")
    w.add_argument("--out", default=None, help="folder for watch.png (default: the run folder)")

    _critical_batch_parser(sub)

    p = sub.add_parser("plan", help="compute-optimal N, D, loss and time for a budget, from a fit.json")
    p.add_argument("fit_json", help="fit.json written by 'fit'")
    p.add_argument("--gpu", required=True, help="GPU name, e.g. H100")
    p.add_argument("--n-gpus", type=int, required=True)
    p.add_argument("--mfu", type=float, required=True, help="assumed model-FLOPs utilisation, 0-1")
    p.add_argument("--dtype", default="bf16")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--gpu-hours", type=float, help="budget in GPU-hours, all GPUs together")
    budget.add_argument("--flops", type=float, help="budget in training FLOPs")
    p.add_argument("--approach", choices=("auto",) + APPROACHES, default="auto",
                   help="law to plan from (default: the first identified of approach3, isoflop, envelope)")
    _batch_plan_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _critical_batch_parser(sub: argparse._SubParsersAction) -> None:
    """``critical-batch``'s options."""
    b = sub.add_parser("critical-batch", help="steps and tokens to target losses at each batch of a batch sweep, the "
                                              "critical batch per target with intervals, its laws, and the held-out "
                                              "prediction against the measurement")
    b.add_argument("results", help="a batch sweep's folder ([critical_batch] of a sweep file) or a points table "
                                   "(.csv/.parquet, as the points.csv this writes)")
    b.add_argument("--out", required=True, help="output folder (created if missing)")
    b.add_argument("--targets", type=float, nargs="+", default=[], metavar="LOSS",
                   help="the grid's target losses (default: the sweep folder's critical_batch.json)")
    b.add_argument("--held-out-targets", type=float, nargs="+", default=[], metavar="LOSS",
                   help="the held-out runs' target losses (default: the sweep folder's critical_batch.json)")
    _resampling_options(b, "bootstrap resamples of each frontier's residuals (0: none)")


def _batch_plan_options(p: argparse.ArgumentParser) -> None:
    """``plan``'s options for the critical batch."""
    p.add_argument("--critical-batch", metavar="JSON", help="critical_batch.json of 'critical-batch': the critical "
                                                             "batch at the planned loss and the data-parallel width it "
                                                             "allows")
    p.add_argument("--per-gpu-batch", type=float, default=16384, metavar="TOKENS",
                   help="tokens per GPU per step for --critical-batch (default: 16384, 8 sequences of 2048)")
    p.add_argument("--target-loss", type=float, metavar="LOSS",
                   help="the loss --critical-batch reads the critical batch at (default: the plan's predicted loss)")


def _resampling_options(parser: argparse.ArgumentParser, bootstrap_help: str) -> None:
    """--bootstrap, --seed and --ci (``_resampling`` checks them)."""
    parser.add_argument("--bootstrap", type=int, default=200, help=bootstrap_help)
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--ci", type=float, default=0.95, help="interval level")


def _formats(text: str) -> tuple[str, ...]:
    """``png,svg`` -> ("png", "svg"); an unknown format is a usage error."""
    items = tuple(dict.fromkeys(f.strip().lower() for f in text.split(",") if f.strip()))
    bad = [f for f in items if f not in FIGURE_FORMATS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown figure format(s) {', '.join(bad) or repr(text)}; "
                                         f"use {', '.join(FIGURE_FORMATS)}")
    return items


def _out_folder(path: str | Path) -> Path:
    """``--out`` as a folder to write into (created later, when there is something to write)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder")
    return out


def _resampling(args: argparse.Namespace) -> None:
    """``--bootstrap`` and ``--ci``, checked."""
    if args.bootstrap < 0 or not 0 < args.ci < 1:
        raise InputError("--bootstrap must be >= 0 and --ci in (0, 1)")


def _publish(out: Path, lines: list[str], figure, figure_name: str, doc: dict | None = None, json_name: str = "",
             written: tuple[str, ...] = ()) -> None:
    """Write the figure as a 150-dpi PNG and the document as JSON into ``out``, each file atomically; print
    ``lines`` and what was written (``written``: files the command wrote there before)."""
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=150)
    write_atomic(out / figure_name, buffer.getvalue())
    if doc is not None:
        write_atomic(out / json_name, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    print("\n".join(lines))
    print(f"wrote {', '.join(n for n in (json_name, figure_name, *written) if n)} to {out}")


def _fit(args: argparse.Namespace) -> int:
    out = _out_folder(args.out)
    refuse_foreign_out(out)  # before the fit: it replaces out as a whole
    config = FitConfig(budget_tol=args.budget_tol, isoflop_minimum=args.isoflop_minimum, n_bootstrap=args.bootstrap,
                       seed=args.seed, ci_level=args.ci, workers=args.workers, n_starts=args.starts,
                       predict=tuple(args.predict), holdout=not args.no_holdout, progress=not args.no_progress,
                       form=args.form, stop_unidentified=True,
                       envelope=args.envelope, huber_delta=args.huber_delta, holdout_budgets=args.holdout_budgets,
                       holdout_above=args.holdout_above, law=args.law)
    config.validate()

    def load(flagged: tuple[str, ...]) -> RunTable:
        return load_runs(args.results, parse_column_map(args.column), args.params_count, args.duplicates,
                         exclude=[*args.exclude, *flagged], drop_highest_loss=args.drop_highest_loss,
                         side_runs=args.side_runs)

    table = load(())
    if table.side_runs:
        print(table.side_runs)
    if args.drop_outliers:
        result, flagged = fit_without_outliers(load, config)
        if flagged:
            print(f"dropped the {len(flagged)} run(s) the first fit flagged as outliers: {', '.join(flagged)}")
    else:
        result = fit_runs(table, config)
    doc = result.to_dict()
    names = write_outputs(result, doc, out, args.format)
    print("\n".join(summary_lines(doc)))
    for code, message in result.warnings:
        print(f"warning [{code}]: {message}")
    for message in result.design_notes:
        print(f"note [design]: {message}")
    print(f"wrote {', '.join(sorted(names))} to {out}")
    if result.preferred is None:
        print(f"error: {result.why}; {out / 'report.html'} says why", file=sys.stderr)
        return EXIT_UNIDENTIFIED
    return 0


def _compare(args: argparse.Namespace) -> int:
    from analysis import compare_fits
    from analysis.plots import COMPARE_FIGURES, plot_compare_allocation, plot_compare_frontier, save_figure
    from analysis.report import render_html, render_markdown

    paths = [Path(p) for p in args.inputs]
    if len(paths) < 2:
        raise InputError(f"compare needs at least 2 inputs, got {len(paths)}")
    if args.label and len(args.label) != len(paths):
        raise InputError(f"--label given {len(args.label)} time(s) for {len(paths)} inputs")
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise InputError(f"no such file or directory: {', '.join(missing)}")
    out = _out_folder(args.out)
    labels = args.label or compare_fits.labels_for(paths)
    config = FitConfig(n_bootstrap=args.bootstrap, workers=args.workers, progress=False, delta_sensitivity=False,
                       form="auto")
    config.validate()
    entries = []
    for label, path in zip(labels, paths):
        found = compare_fits.fit_json_path(path)
        if found is not None:
            entries.append(compare_fits.entry_from_fit(label, found))
            continue
        result = fit_runs(load_runs(path), config)
        doc = result.to_dict()
        samples = bootstrap_frame(result) if result.thetas is not None else None
        entries.append(compare_fits.FitEntry(label, doc, allocations(doc, samples), result.table.runs))
    table = compare_fits.parameter_table(entries)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=out))
    try:
        images = {stem: save_figure(maker(entries), staging, stem, args.format)
                  for (stem, _), maker in zip(COMPARE_FIGURES, (plot_compare_allocation, plot_compare_frontier))}
        table.to_csv(staging / "compare.csv", index_label="quantity")
        blocks = compare_fits.blocks(table, [str(p) for p in paths], COMPARE_FIGURES)
        (staging / "compare.md").write_text(render_markdown(blocks))
        (staging / "compare.html").write_text(render_html(blocks, images))
        names = sorted(p.name for p in staging.iterdir())
        for name in names:
            (staging / name).replace(out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(table.to_string())
    print(f"wrote {', '.join(names)} to {out}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from analysis.predict import describe as describe_predictions
    from analysis.predict import load_law, read_pairs

    if args.csv and (args.params or args.tokens):
        raise InputError("give --csv or --params/--tokens, not both")
    if not args.csv and not (args.params and args.tokens):
        raise InputError("give --params N ... --tokens D ... (one D per N) or --csv FILE")
    if not args.csv and len(args.params) != len(args.tokens):
        raise InputError(f"{len(args.params)} --params value(s) for {len(args.tokens)} --tokens value(s): give pairs")
    n, d = read_pairs(args.csv) if args.csv else (args.params, args.tokens)
    law = load_law(args.fit_json)
    table = law.predict(n, d)
    if args.json:
        print(json.dumps([{k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
                          for row in table.to_dict(orient="records")], indent=2))
    else:
        print("\n".join(describe_predictions(law, table)))
    return 0


def _curves(args: argparse.Namespace) -> int:
    from analysis import curves as law

    out = _out_folder(args.out)
    _resampling(args)
    requests = [law.Request.parse(text) for text in args.predict]
    curves, facts = law.load_curves(args.inputs, args.loss)
    held = law.held_out(facts, args.hold_out)
    fitted = [c for c, h in zip(curves, held) if not h]
    kept = [c for c, h in zip(curves, held) if h]
    fit = law.fit_curves(fitted, args.bootstrap, args.seed, args.ci, args.loss)
    problems = law.identification(fit, fitted)
    doc = {"inputs": [str(p) for p in args.inputs], "loss": args.loss,
           "fit": {**fit.to_dict(), "identified": not problems, "problems": problems},
           "runs": facts.assign(held_out=held).to_dict(orient="records"),
           "holdout": law.holdout(fit, kept) if kept else None, "predictions": []}
    out.mkdir(parents=True, exist_ok=True)
    for r in requests:
        steps, loss, lo, hi = fit.predict(r.params, r.lr_array())
        stem = f"predicted-{r.params:.3g}-{r.schedule}-{r.steps}-{r.lr:.3g}"
        frame = pd.DataFrame({"step": steps, "lr": r.lr_array(), "loss": loss, "lo": lo, "hi": hi})
        write_atomic(out / f"{stem}.csv", frame.to_csv(index=False))
        doc["predictions"].append({"params": r.params, "schedule": r.schedule, "steps": r.steps, "lr": r.lr,
                                   "final_loss": float(loss[-1]), "final_ci": [float(lo[-1]), float(hi[-1])],
                                   "csv": f"{stem}.csv"})
    doc = json_ready(doc)
    _publish(out, law.describe(doc), law.figure(fit, fitted, kept), "curves_fit.png", doc, "curves.json",
             tuple(p["csv"] for p in doc["predictions"]))
    return 0


def _routed(args: argparse.Namespace) -> int:
    from analysis import routed

    out = _out_folder(args.out)
    _resampling(args)
    runs = load_runs(args.results).runs
    defaults = {"moe_experts": 0, "moe_top_k": 1, "moe_granularity": 1}
    runs = runs.assign(**{k: runs[k].fillna(v) if k in runs else v for k, v in defaults.items()})
    runs = runs.assign(params_active=runs["params_active"].fillna(runs["params"]) if "params_active" in runs
                       else runs["params"])
    if "flops_per_token" not in runs:
        runs = runs.assign(flops_per_token=runs["flops"] / runs["tokens"])
    try:
        fit = routed.fit_routed(runs, args.bootstrap, args.seed, args.ci)
    except routed.RoutedError as e:
        raise InputError(str(e)) from None
    largest = float(runs["flops"].max())
    budgets = args.predict or [largest, 10 * largest, 100 * largest]
    doc = json_ready(routed.to_dict(fit, routed.plan_budgets(fit, budgets)))
    _publish(out, routed.describe(doc), routed.figure(fit, runs, budgets), "routed.png", doc, "routed.json")
    return 0


def _watch(args: argparse.Namespace) -> int:
    from analysis.watch import figure, watch_run

    run = Path(args.run)
    out = _out_folder(args.out or run)
    w, lines = watch_run(run, args.law)
    if not w.history:
        raise InputError(f"{run}: no eval records after warm-up yet (train.eval_every sets how often a run logs them)")
    _publish(out, lines, figure(w, f"{run.name} against {Path(args.law).name}"), "watch.png")
    return 0


def _critical_batch(args: argparse.Namespace) -> int:
    from analysis.critical_batch import GRID, HELD_OUT, analyse
    from analysis.critical_batch_report import describe as describe_batches
    from analysis.critical_batch_report import load_points, write

    out = _out_folder(args.out)
    _resampling(args)
    points, targets, notes = load_points(args.results)
    for part, given in ((GRID, args.targets), (HELD_OUT, args.held_out_targets)):
        if given:
            targets[part] = sorted(given, reverse=True)
    doc = json_ready(analyse(points, targets, args.bootstrap, args.seed, args.ci))
    doc["warnings"] = notes + doc["warnings"]
    names = write(out, doc, points, str(args.results))
    print("\n".join(describe_batches(doc)))
    print(f"wrote {', '.join(names)} to {out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    doc, samples = load_fit(args.fit_json)
    batch_law = load_batch_law(args.critical_batch) if args.critical_batch else None
    result = plan(doc, args.gpu, args.n_gpus, args.mfu, flops=args.flops, gpu_hours=args.gpu_hours,
                  dtype=args.dtype, samples=samples, level=(doc.get("config") or {}).get("ci_level", 0.95),
                  approach=args.approach)
    if batch_law is not None:
        result.batch = batch_plan(batch_law, args.target_loss or result.loss, args.n_gpus, args.per_gpu_batch)
    print(json.dumps(result.to_dict(), indent=2) if args.json else describe(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    with stopping_on_signals() as published:
        try:
            return {"fit": _fit, "compare": _compare, "predict": _predict, "curves": _curves, "watch": _watch,
                    "plan": _plan, "routed": _routed, "critical-batch": _critical_batch}[args.command](args)
        except Unidentified as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_UNIDENTIFIED
        except (InputError, UnreadableFile, ConfigError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print(f"error: interrupted after writing the outputs to {published[0]}" if published
                  else "error: interrupted; earlier outputs are untouched", file=sys.stderr)
            return EXIT_INTERRUPTED
