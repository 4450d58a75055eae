"""Command line: ``python -m sweeps {plan,run,status,retry,cancel,export}``.

Bad input ends a command before any work with one ``error: ...`` line per problem on stderr and
exit code 2. ``run`` and ``retry`` exit 0 when every run of the sweep is done, 1 when some failed, were
interrupted or were cancelled, 130 when the driver was interrupted (what finished is recorded; running
the sweep again resumes). ``plan``, ``run`` and ``retry`` take the sweep file's ``[slurm]`` keys (and
``plan`` and ``run`` its ``[launch]`` keys) as options, checked like the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from sweeps import cooldowns, critical_batch, progress, runs as planner, spec as specs
from sweeps.driver import attempt_for, driver_lock, execute, job_parts, submitting_kind
from sweeps.executors.attempt import Executor
from sweeps.registry import DB_NAME, Registry, RegistryError, Row
from sweeps.verify import HELD_OUT_FACTOR, VerifyError
from lab.runtime.config import Parser, RunConfig, UsageExit
from lab.runtime.files import refuse_foreign_folder, write_atomic

EXIT_BAD_INPUT = 2
SWEEP_COPY = "sweep.toml"
RETRIED = ("failed", "interrupted", "cancelled")  # what retry takes


class UsageError(ValueError):
    """Bad input found by the command line itself."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m sweeps", description="Plan, run and follow IsoFLOP sweeps.")
    sub = parser.add_subparsers(dest="command", required=True)
    folder_help = "the sweep's folder (default: [sweep] folder of the file, else runs/sweeps/NAME)"

    p = sub.add_parser("plan", help="print the runs a sweep file asks for (nothing is run)")
    p.add_argument("file", help="sweep file (TOML)")
    p.add_argument("--folder", help=folder_help)
    _override_options(p, launch=True)

    p = sub.add_parser("run", help="run the sweep: skip finished runs, resume unfinished ones")
    p.add_argument("file", help="sweep file (TOML)")
    p.add_argument("--folder", help=folder_help)
    _executor_options(p, launch=True)

    p = sub.add_parser("verify", help="fit the finished sweep, train the predicted compute-optimal model and its "
                                      "neighbours at a held-out budget, and compare")
    p.add_argument("sweep", help="sweep file or sweep folder")
    p.add_argument("--folder", help=folder_help)
    p.add_argument("--budget", type=float, required=True, metavar="FLOPS",
                   help=f"the held-out budget C (at least {HELD_OUT_FACTOR:g}x the largest swept one is a real test)")
    p.add_argument("--exclude", action="append", default=[], metavar="RUN_ID_OR_CONDITION",
                   help="leave runs out of the fit, as 'python -m analysis fit --exclude' (repeatable)")
    p.add_argument("--drop-highest-loss", type=int, default=0, metavar="K",
                   help="leave the K runs with the highest loss out of the fit")
    p.add_argument("--drop-outliers", action="store_true",
                   help="fit again without the runs the fit flags as outliers (robust residuals from approach 3)")
    p.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="bootstrap resamples of the fit, as 'python -m analysis fit --bootstrap' (default: 1000)")
    _executor_options(p, launch=False)

    for name, text in (("status", "print the sweep's runs and progress"),
                       ("retry", "run failed, interrupted or cancelled runs again (all, or the named ones)"),
                       ("cancel", "cancel unfinished runs (all, or the named ones), stopping their jobs"),
                       ("export", "write the finished runs as a CSV or Parquet table for the analysis")):
        p = sub.add_parser(name, help=text)
        p.add_argument("sweep", help="sweep file or sweep folder")
        p.add_argument("--folder", help=folder_help)
        if name in ("retry", "cancel"):
            p.add_argument("names", nargs="*", metavar="NAME", help="run names")
        if name == "retry":
            _executor_options(p, launch=False)
        if name == "export":
            p.add_argument("--out", help="output table: .csv or .parquet (default: FOLDER-runs.csv beside the "
                                         "sweep's folder)")
            p.add_argument("--with", dest="roles", action="append", default=[], choices=("search", "verify"),
                           help="also the search's or verify's runs (column 'role'); the sweep's own by default")
    return parser


# Command-line overrides of the sweep file: (key, type, help), as --key-with-dashes.
LAUNCH_OPTIONS = (("strategy", str, "strategy of every run"), ("nproc", int, "processes per node"),
                  ("nodes", int, "nodes per run (> 1: SLURM only)"), ("cpus_per_proc", int, "CPUs per process"),
                  ("gpus_per_proc", int, "GPUs per process"), ("mem_gb", float, "memory per node in GB"),
                  ("time_min", int, "time limit per run in minutes"))
SLURM_OPTIONS = (("partition", str, "SLURM partition"), ("account", str, "account charged"),
                 ("qos", str, "quality of service"), ("constraint", str, "node features, e.g. h100"),
                 ("array_parallelism", int, "array tasks running at once"))


def _executor_options(p: argparse.ArgumentParser, launch: bool) -> None:
    p.add_argument("--executor", choices=("local", "slurm"), help="where runs go (default: local, or the "
                                                                  "executor the sweep last ran on)")
    p.add_argument("--parallel", type=int, help="local executor: runs at once (default: [local] parallel)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _override_options(p, launch)


def _override_options(p: argparse.ArgumentParser, launch: bool) -> None:
    """--partition, --nproc, ...: the sweep file's [slurm] and (with ``launch``) [launch] keys."""
    groups = [("SLURM settings (over the file's [slurm])", SLURM_OPTIONS)]
    if launch:
        groups.insert(0, ("launch settings of every run (over the file's [launch], [[launch.by_size]] and shapes)",
                          LAUNCH_OPTIONS))
    for title, options in groups:
        group = p.add_argument_group(title)
        for key, kind, text in options:
            group.add_argument(specs.option_name(key), dest=key, type=kind, help=text,
                               metavar={str: "NAME", int: "N", float: "X"}[kind])


def _overrides(args: argparse.Namespace, options: tuple) -> dict:
    return {key: getattr(args, key) for key, _, _ in options if getattr(args, key, None) is not None}


def _load(args: argparse.Namespace) -> specs.Sweep:
    """The sweep file with the command line's launch and SLURM settings on top."""
    sweep = specs.load(args.file, folder=args.folder)
    return specs.with_overrides(sweep, _overrides(args, LAUNCH_OPTIONS), _overrides(args, SLURM_OPTIONS))


# ---------------------------------------------------------------- helpers


def _locate(args: argparse.Namespace) -> tuple[Path, specs.Sweep | None]:
    """The sweep folder named by a sweep file or a folder, and the sweep (from the file, or the folder's copy)."""
    path = Path(args.sweep)
    if path.is_dir():
        folder = Path(args.folder or path).absolute()
        copy = folder / SWEEP_COPY
        return folder, specs.load(copy, folder=folder) if copy.is_file() else None
    if path.is_file():
        sweep = specs.load(path, folder=args.folder)
        return sweep.folder, sweep
    raise UsageError(f"no such sweep file or folder: {path}")


def _executor(args: argparse.Namespace, sweep: specs.Sweep, registry: Registry | None) -> Executor:
    """The executor asked for, else the one the sweep last ran on, else local."""
    kind = args.executor or (registry.meta("executor") if registry else None) or "local"
    if args.parallel is not None and args.parallel < 1:
        raise UsageError(f"--parallel must be >= 1, got {args.parallel}")
    if kind == "local":
        from sweeps.executors.local import LocalExecutor

        return LocalExecutor(parallel=args.parallel or sweep.parallel, threads=sweep.threads)
    try:
        from sweeps.executors.slurm import SlurmExecutor

        return SlurmExecutor(sweep.folder / "slurm", sweep.name, sweep.slurm, cwd=Path.cwd())
    except ImportError:
        raise UsageError("the slurm executor needs submitit: pip install -e '.[slurm]'") from None
    except RuntimeError as e:  # no SLURM tools here
        remembered = "" if args.executor else "; this sweep last ran on slurm: --executor local runs it here"
        raise UsageError(f"the slurm executor needs a SLURM cluster ({e}){remembered}") from None


def _check_fits(executor: Executor, runs: list[planner.PlannedRun]) -> None:
    """The local executor runs on this machine only."""
    multi = next((r for r in runs if r.launch.nodes > 1), None)
    if executor.name == "local" and multi is not None:
        raise UsageError(f"run '{multi.name}' asks for {multi.launch.nodes} nodes; use --executor slurm")


# ---------------------------------------------------------------- commands


def _planned(sweep: specs.Sweep, tuned: planner.Tuned | None = None) -> planner.Plan:
    """The sweep's plan; with ``[sweep] cooldowns``, its end points as branches of one stable phase per size."""
    result = planner.plan(sweep, tuned)
    if sweep.cooldowns is not None:
        warmup = RunConfig.from_dict({"train": sweep.base.get("train", {})}).train.warmup
        result.runs, refused = cooldowns.branch(result.runs, sweep.cooldowns.fraction, warmup, sweep.cooldowns.at,
                                                sweep.evals)
        result.refused += refused
    if sweep.critical_batch is not None:
        batch_runs, refused = critical_batch.runs(sweep)
        result.runs += batch_runs
        result.refused += refused
    return result


def _plan(args: argparse.Namespace) -> int:
    sweep = _load(args)
    print(f"sweep {sweep.name} → {sweep.folder}")
    tuned = None
    if sweep.search is not None:
        from sweeps import search  # numpy, matplotlib: only with a search

        known = Registry.open(sweep.folder) if (sweep.folder / DB_NAME).exists() else None
        found = search.finished(sweep, known)
        lr_runs = search.lr_runs(sweep)[0]
        lr_law = found.lr.rule if found else sweep.lr
        batch_runs = search.batch_runs(sweep, lr_law)[0] if sweep.search.batch_tokens else []
        print("search (run first):")
        print(planner.table(lr_runs + batch_runs, sweep.count, sweep.parallel))
        if found is not None:
            tuned = found.tuned
            print("\n".join(f"search: {line}" for line in search.describe(found)))
        else:
            print("search: not run yet; the sweep's learning rates and batches below are [rules]'s, its laws will "
                  "replace them")
        for line in search.refusals(sweep):
            print(f"error: {line}", file=sys.stderr)
        print("sweep:")
    result = _planned(sweep, tuned)
    print(planner.table(result.runs, sweep.count, sweep.parallel))
    for line in result.priors + result.moved:
        print(f"centre: {line}")
    if sweep.cooldowns is not None:
        print("\n".join(cooldowns.describe(result.runs) + [cooldowns.savings(result.runs)]))
    if sweep.critical_batch is not None:
        print("\n".join(f"critical batch: {line}" for line in critical_batch.describe(sweep)))
    _warn(result)
    for line in result.refused:
        print(f"error: {line}", file=sys.stderr)
    refused = result.refused + (search.refusals(sweep) if sweep.search is not None else [])
    return EXIT_BAD_INPUT if refused else 0


def _warn(result: planner.Plan) -> None:
    for line in result.warnings:
        print(f"warning: {line}", file=sys.stderr)


def _refuse(lines: list[str]) -> int:
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    sweep = _load(args)
    result = _planned(sweep)
    search = None
    if sweep.search is not None:
        from sweeps import search  # numpy, matplotlib: only with a search

        result.refused += search.refusals(sweep)
    if result.refused:
        return _refuse(result.refused)
    _warn(result)
    # the executor is checked before the lock, which creates the folder: a refusal leaves nothing behind
    refuse_foreign_folder(sweep.folder, (DB_NAME,), "the sweep folder", ignore=(".driver.lock",))
    known = Registry.open(sweep.folder) if (sweep.folder / DB_NAME).exists() else None
    executor = _executor(args, sweep, known)
    _check_fits(executor, result.runs)
    with driver_lock(sweep.folder):
        registry = known or Registry.open(sweep.folder, create=True)
        registry.set_meta("executor", executor.name)
        write_atomic(sweep.folder / SWEEP_COPY, sweep.source)
        if search is not None:
            found = search.run(sweep, registry, executor, not args.no_progress)
            if isinstance(found, int):
                return found
            print("\n".join(f"search: {line}" for line in search.describe(found)))
            for line in found.warnings:
                print(f"warning: search: {line}", file=sys.stderr)
            result = _planned(sweep, found.tuned)
            if result.refused:
                return _refuse(result.refused)
        if sweep.critical_batch is not None:
            critical_batch.write_manifest(sweep.folder, sweep)
        registry.sync(result.runs, cooldowns.run_dirs(sweep.folder, result.runs))
        return cooldowns.execute_branched(sweep.folder, registry, result.runs, executor, not args.no_progress)


def _retry(args: argparse.Namespace) -> int:
    folder, sweep = _locate(args)
    if sweep is None:
        raise UsageError(f"{folder} has no {SWEEP_COPY}; retry with the sweep file")
    sweep = specs.with_overrides(sweep, {}, _overrides(args, SLURM_OPTIONS))
    with driver_lock(folder):
        registry = Registry.open(folder)
        rows = _select(registry, args.names, default=RETRIED)
        wrong = [r for r in rows if r.status not in RETRIED]
        if wrong:
            raise UsageError(f"run '{wrong[0].name}' is {wrong[0].status}; retry takes failed, interrupted or "
                             f"cancelled runs")
        if not rows:
            print("nothing to retry: no failed, interrupted or cancelled runs")
            return 0
        executor = _executor(args, sweep, registry)
        _check_fits(executor, [r.plan for r in rows])
        for row in rows:
            registry.set_status(row.name, "planned")
        registry.set_meta("executor", executor.name)
        return execute(folder, registry, [r.name for r in rows], executor, not args.no_progress)


def _cancel(args: argparse.Namespace) -> int:
    folder, _ = _locate(args)
    registry = Registry.open(folder)
    rows = _select(registry, args.names, default=("planned", "running", "failed", "interrupted"))
    for row in rows:
        if row.status in ("done", "cancelled"):
            print(f"{row.name}: already {row.status}")
            continue
        registry.set_status(row.name, "cancelled", error="cancelled")
        kind, job = job_parts(row.job)
        if row.status == "running" and kind == submitting_kind("slurm"):  # a submission the driver did not see end
            from sweeps.executors.slurm import find_submitted

            kind, job = "slurm", find_submitted(job)
        stopped = ""
        if row.status == "running" and kind == "slurm" and job:
            from sweeps.executors.slurm import cancel

            cancel(folder / "slurm", job)
            stopped = f" (scancel {job})"
        elif row.status == "running" and kind == "local":
            from sweeps.executors.local import stop

            if stop(int(job), attempt_for(folder, row, follow=True).lock):
                stopped = f" (SIGTERM to process {job})"
        print(f"{row.name}: cancelled{stopped}")
    return 0


def _select(registry: Registry, names: list[str], default: tuple[str, ...]) -> list[Row]:
    """The named rows (all must exist), or every row whose status is in ``default``."""
    if not names:
        return [r for r in registry.rows() if r.status in default]
    rows = []
    for name in names:
        row = registry.get(name)
        if row is None:
            raise UsageError(f"no run named {name!r} in this sweep")
        rows.append(row)
    return rows


def _export(args: argparse.Namespace) -> int:
    from sweeps import export  # pandas: only here

    folder, _ = _locate(args)
    out = Path(args.out) if args.out else folder.with_name(f"{folder.name}-runs.csv")
    if out.suffix.lower() not in export.FORMATS:
        raise UsageError(f"--out must end in .csv or .parquet, got '{out.name}'")
    table = export.results(Registry.open(folder).rows(), ("sweep", *args.roles))
    if table.empty:
        raise UsageError(f"no finished runs in {folder} yet")
    export.write(table, out)
    print(f"wrote {len(table)} runs to {out}")
    return 0


def _status(args: argparse.Namespace) -> int:
    folder, _ = _locate(args)
    rows = Registry.open(folder).rows()
    print(f"sweep folder {folder}")
    width = max([24] + [len(r.name) for r in rows])
    head = f"{'run':<{width}} {'status':<11} {'N':>10} {'D':>11} {'C':>9} {'loss':>7} {'tries':>5}  job / progress"
    print(head)
    print("-" * len(head))
    for r in rows:
        p = r.plan
        loss = (r.summary or {}).get("final_eval_loss")
        detail = (r.job or "") + (f"  ← {p.parent} @ step {p.branch_step}" if p.parent else "")
        if r.status == "running":
            detail += f"  {progress.describe(p, r.run_dir)}"
        print(f"{r.name:<{width}} {r.status:<11} {p.params:>10,} {p.tokens:>11,} {p.flops:>9.3g} "
              f"{'' if loss is None else f'{loss:.4f}':>7} {r.attempts:>5}  {detail}")
        if r.error and r.status in RETRIED:
            print(f"{'':<{width + 2}}{r.error}")
    counts = {s: sum(r.status == s for r in rows) for s in ("done", "running", "planned", "failed", "interrupted",
                                                            "cancelled")}
    print(" | ".join(f"{s} {n}" for s, n in counts.items()))
    print(tqdm.format_meter(counts["done"], len(rows), 0, ncols=72, prefix="done",
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}"))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from sweeps import verify  # numpy, and the analysis when it runs

    folder, sweep = _locate(args)
    if sweep is None:
        raise UsageError(f"{folder} has no {SWEEP_COPY}; verify with the sweep file")
    sweep = specs.with_overrides(sweep, {}, _overrides(args, SLURM_OPTIONS))
    request = verify.Request(args.budget, tuple(args.exclude), args.drop_highest_loss, args.drop_outliers,
                             args.bootstrap, not args.no_progress)
    verify.check(request)
    registry = Registry.open(folder)
    verify.check_sweep(registry, request.budget)
    return verify.verify(folder, sweep, registry, _executor(args, sweep, registry), request)


COMMANDS = {"plan": _plan, "run": _run, "status": _status, "retry": _retry, "cancel": _cancel, "export": _export,
            "verify": _verify}


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageExit as e:  # the parser's, its line printed
        return int(e.code)
    except (UsageError, VerifyError, specs.SpecError, RegistryError) as e:
        return _refuse(str(e).splitlines())
    except OSError as e:  # a full disk or quota: what is recorded stays, the sweep resumes when run again
        print(f"error: {e.filename or 'the sweep folder'} could not be written ({e.strerror or e}); free space and "
              f"run the sweep again", file=sys.stderr)
        return 1
