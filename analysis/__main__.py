"""Command line: ``python -m analysis fit RESULTS --out DIR``, ``python -m analysis compare FIT_OR_SWEEP ... --out
DIR`` and ``python -m analysis plan FIT_JSON``.

Exit codes: 0 done; 2 bad input, one line ``error: ...`` on stderr before any work; 3 the data
identify no law (``fit`` still writes its report, which says why; ``plan`` refuses); 130
interrupted. ``fit`` writes every output into a staging folder ``.fit-staging-<pid>-*`` inside DIR
and only then renames each file into place (fit.json last), so an earlier fit in DIR is never
lost or left half-written; SIGINT, SIGTERM and SIGHUP remove the staging folder, and a later
``fit`` removes any left by a process that no longer exists (killed with SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

# The fits work on short vectors, where BLAS threads only add overhead and contend for the cores;
# this must be set before numpy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pandas as pd  # noqa: E402

from analysis.compare import APPROACHES, TITLES, disagreement_note  # noqa: E402
from analysis.fit import ENVELOPE_SOURCES, FORM_CHOICES, FitConfig, FitResult, fit_runs  # noqa: E402
from analysis.forms import FORMS  # noqa: E402
from analysis.laws import LAWS, law_line  # noqa: E402
from analysis.parametric import HUBER_DELTA, named_samples  # noqa: E402
from analysis.planner import (  # noqa: E402
    LAW_COLUMNS,
    Unidentified,
    allocations,
    describe,
    load_fit,
    plan,
)
from analysis.table import (  # noqa: E402
    DUPLICATE_ALIASES,
    DUPLICATE_POLICIES,
    PARAMS_COUNTS,
    InputError,
    load_runs,
    parse_column_map,
)
from lab.runtime.files import process_alive  # noqa: E402

EXIT_USAGE = 2
FIGURE_FORMATS = ("png", "svg", "pdf")
EXIT_UNIDENTIFIED = 3
EXIT_INTERRUPTED = 130
STAGING_PREFIX = ".fit-staging-"


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
    f.add_argument("--duplicates", choices=DUPLICATE_POLICIES + tuple(DUPLICATE_ALIASES), default="keep",
                   help="runs with the same N and D: keep each as its own point, warning with their spread (default), "
                        "average each group into one run (mean; 'aggregate' is its old name) or refuse the table")
    f.add_argument("--exclude", action="append", default=[], metavar="RUN_ID_OR_CONDITION",
                   help="leave out the run with this id, or the runs matching a pandas condition on the columns "
                        "(e.g. \"loss > 4\" or \"params < 1e7\"); repeatable; the report lists what was dropped")
    f.add_argument("--drop-highest-loss", type=int, default=0, metavar="K",
                   help="leave out the K runs with the highest loss (after --exclude)")
    f.add_argument("--law", choices=LAWS, default="chinchilla",
                   help="also fit Kaplan et al.'s form or Muennighoff et al.'s data-constrained law (needs a "
                        "unique_tokens column) beside approach 3 (default: Chinchilla's form only)")
    f.add_argument("--form", choices=FORM_CHOICES, default="auto",
                   help="approach 3's form of L(N, D): Chinchilla's E + A/N^alpha + B/D^beta, kaplan-e (Kaplan et "
                        "al.'s with an irreducible E), or auto (default): the one that predicts the hold-out's runs "
                        "better when refitted without them (Chinchilla's without a hold-out)")
    f.add_argument("--huber-delta", type=float, default=HUBER_DELTA,
                   help=f"approach 3's Huber threshold on log-loss residuals (default {HUBER_DELTA:g}, as in "
                        "Hoffmann et al.)")
    f.add_argument("--budget-tol", type=float, default=0.05, help="relative spread of C within one budget")
    f.add_argument("--isoflop-minimum", choices=("vertex", "lowest"), default="vertex",
                   help="per-budget minimum for the IsoFLOP power laws (default: windowed parabola vertex)")
    f.add_argument("--envelope", choices=ENVELOPE_SOURCES, default="final",
                   help="approach 1's points: final losses only (default), or every point of the training curves, "
                        "valid only when each logged point is an end point (not for single cosine schedules)")
    f.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (0: none)")
    f.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    f.add_argument("--ci", type=float, default=0.95, help="interval level")
    f.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="processes for the bootstrap (default: the CPUs available)")
    f.add_argument("--starts", type=int, default=8, help="L-BFGS starts from the best grid points")
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
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _formats(text: str) -> tuple[str, ...]:
    """``png,svg`` -> ("png", "svg"); an unknown format is a usage error."""
    items = tuple(dict.fromkeys(f.strip().lower() for f in text.split(",") if f.strip()))
    bad = [f for f in items if f not in FIGURE_FORMATS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown figure format(s) {', '.join(bad) or repr(text)}; "
                                         f"use {', '.join(FIGURE_FORMATS)}")
    return items


def bootstrap_frame(result: FitResult) -> pd.DataFrame:
    """One row per resample: approach 3's parameters and every other approach's power law."""
    form = result.parametric.form
    samples = named_samples(result.thetas, form=form)
    columns = {k: samples[k] for k in form.names}
    for key in APPROACHES[:2]:
        law = result.approaches[key].samples
        if law is not None:
            columns.update({f"{key}_{c}": v for c, v in zip(LAW_COLUMNS, (law.a, law.k_n, law.b, law.k_d))})
    return pd.DataFrame(columns)


def remove_stale_staging(out: Path) -> None:
    """Remove staging folders whose process is gone (or that carry no process id)."""
    for path in out.glob(STAGING_PREFIX + "*"):
        match = re.match(re.escape(STAGING_PREFIX) + r"(\d+)-", path.name)
        if match and process_alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)


def write_outputs(result: FitResult, doc: dict, out: Path, formats: tuple[str, ...] = ("png",)) -> list[str]:
    """Write all outputs (``doc`` is result.to_dict(); figures in ``formats``) to a staging folder in ``out``,
    then rename them into place, fit.json last."""
    from analysis.exports import latex, tidy
    from analysis.plots import make_plots  # matplotlib only when there is something to draw
    from analysis.report import build_blocks, render_html, render_markdown

    out.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=out))
    try:
        (staging / "fit.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        if result.thetas is not None:
            bootstrap_frame(result).to_csv(staging / "bootstrap.csv", index=False)
        images = make_plots(result, staging, result.config.workers, formats)
        tables = tidy(doc)
        tables.to_csv(staging / "tables.csv", index=False)
        (staging / "tables.tex").write_text(latex(tables))
        blocks = build_blocks(doc)
        (staging / "report.md").write_text(render_markdown(blocks))
        (staging / "report.html").write_text(render_html(blocks, images))
        names = sorted((p.name for p in staging.iterdir()), key=lambda name: (name == "fit.json", name))
        _HOLD.append(True)  # the renames happen all or not at all
        try:
            if _SIGNALS:  # a signal whose KeyboardInterrupt was swallowed (see _interrupt): publish nothing
                raise KeyboardInterrupt(_SIGNALS[0])
            for name in names:
                (staging / name).replace(out / name)
            _PUBLISHED.append(str(out))
        finally:
            _HOLD.clear()
        if _SIGNALS:  # one that came during the renames
            raise KeyboardInterrupt(_SIGNALS[0])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return names


def summary_lines(doc: dict) -> list[str]:
    """What `analysis fit` prints: the runs, each approach's allocation exponent, the law, what the plan uses."""
    b = doc["data"]["budgets"]
    lines = [f"fitted {doc['data']['n_runs']} runs ("
             + ("continuous C, no IsoFLOP budgets)" if b["mode"] == "continuous" else f"{len(b['groups'])} budgets)")]
    for key in APPROACHES:
        section = doc[key]
        if section.get("skipped"):
            lines.append(f"{TITLES[key]}: skipped: {section['reason']}")
            continue
        a_ci = (section.get("ci") or {}).get("a")
        state = "identified" if section["identification"]["identified"] else "NOT identified"
        extra = (f" {section['form']} form, L = {section['formula'][4:]}: "
                 + " ".join(f"{name}={section[name]:.4g}" for name in FORMS[section['form']].names)
                 if key == "approach3" else "")
        if key == "envelope":
            extra = (" from training curves (--envelope curves)" if section["points_from"] == "curves"
                     else " from final losses (end points only)")
        a = "-" if section["a"] is None else f"{section['a']:.4g}"
        lines.append(f"{TITLES[key]}: a={a}" + (f" [{a_ci[0]:.4g}, {a_ci[1]:.4g}]" if a_ci else "")
                     + f"{extra} ({state})")
    if doc["law"]:
        lines.append(law_line(doc["law"]))
    comp = doc["comparison"]
    if comp["preferred"]:
        lines.append(f"plan uses {TITLES[comp['preferred']]}: {comp['why']}"
                     + disagreement_note(comp["preferred"], comp["disagreements"]))
    return lines


def _fit(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder")
    config = FitConfig(budget_tol=args.budget_tol, isoflop_minimum=args.isoflop_minimum, n_bootstrap=args.bootstrap,
                       seed=args.seed, ci_level=args.ci, workers=args.workers, n_starts=args.starts,
                       predict=tuple(args.predict), holdout=not args.no_holdout, progress=not args.no_progress,
                       form=args.form,
                       envelope=args.envelope, huber_delta=args.huber_delta, holdout_budgets=args.holdout_budgets,
                       holdout_above=args.holdout_above, law=args.law)
    config.validate()
    table = load_runs(args.results, parse_column_map(args.column), args.params_count, args.duplicates,
                      exclude=args.exclude, drop_highest_loss=args.drop_highest_loss)
    result = fit_runs(table, config)
    doc = result.to_dict()
    names = write_outputs(result, doc, out, args.format)
    print("\n".join(summary_lines(doc)))
    for code, message in result.warnings:
        print(f"warning [{code}]: {message}")
    print(f"wrote {', '.join(sorted(names))} to {out}")
    if result.preferred is None:
        print(f"error: {result.why}; {out / 'report.html'} says why", file=sys.stderr)
        return EXIT_UNIDENTIFIED
    return 0


def _compare(args: argparse.Namespace) -> int:
    from analysis import fits
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
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder")
    labels = args.label or fits.labels_for(paths)
    config = FitConfig(n_bootstrap=args.bootstrap, workers=args.workers, progress=False, delta_sensitivity=False,
                       form="auto")
    config.validate()
    entries = []
    for label, path in zip(labels, paths):
        found = fits.fit_json_path(path)
        if found is not None:
            entries.append(fits.entry_from_fit(label, found))
            continue
        result = fit_runs(load_runs(path), config)
        doc = result.to_dict()
        samples = bootstrap_frame(result) if result.thetas is not None else None
        entries.append(fits.FitEntry(label, doc, allocations(doc, samples), result.table.runs))
    table = fits.parameter_table(entries)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=out))
    try:
        images = {stem: save_figure(maker(entries), staging, stem, args.format)
                  for (stem, _), maker in zip(COMPARE_FIGURES, (plot_compare_allocation, plot_compare_frontier))}
        table.to_csv(staging / "compare.csv", index_label="quantity")
        blocks = fits.blocks(table, [str(p) for p in paths], COMPARE_FIGURES)
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


def _plan(args: argparse.Namespace) -> int:
    doc, samples = load_fit(args.fit_json)
    result = plan(doc, args.gpu, args.n_gpus, args.mfu, flops=args.flops, gpu_hours=args.gpu_hours,
                  dtype=args.dtype, samples=samples, level=(doc.get("config") or {}).get("ci_level", 0.95),
                  approach=args.approach)
    print(json.dumps(result.to_dict(), indent=2) if args.json else describe(result))
    return 0


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SIGNALS: list[str] = []
_PUBLISHED: list[str] = []  # output folders this process has finished writing
# Non-empty while outputs are renamed into place. A signal mask would not do: it is per thread, and with
# any other thread alive (a pool's, a library's) the process's signal is taken there and the handler runs.
_HOLD: list[bool] = []


def _interrupt(signum: int, frame: object) -> None:
    """Stop on SIGINT, SIGTERM or SIGHUP. The KeyboardInterrupt raised here is lost when the signal
    lands in code whose exceptions Python ignores (the at-fork hooks run while a process pool
    starts), so the signal is also recorded and checked before any output is published. During the
    renames (``_HOLD``) it is only recorded: ``write_outputs`` raises it after the last one."""
    _SIGNALS.append(signal.Signals(signum).name)
    if not _HOLD:
        raise KeyboardInterrupt(_SIGNALS[-1])


def _unraisable(info: sys.UnraisableHookArgs) -> None:
    if not (isinstance(info.exc_value, KeyboardInterrupt) and _SIGNALS):  # else: re-raised before publishing
        sys.__unraisablehook__(info)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    _SIGNALS.clear()
    _PUBLISHED.clear()
    previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    try:
        return {"fit": _fit, "compare": _compare, "plan": _plan}[args.command](args)
    except Unidentified as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNIDENTIFIED
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"error: interrupted after writing the outputs to {_PUBLISHED[0]}" if _PUBLISHED
              else "error: interrupted; earlier outputs are untouched", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = previous_hook


if __name__ == "__main__":
    sys.exit(main())
