"""Cooldowns as end points (Hägele et al. 2024): one WSD stable phase per size, short cooldowns branched from it.

With ``[sweep] cooldowns = { fraction = F }`` the sweep's runs that differ only in their length (one size's
IsoFLOP points at several budgets: same shape, seed, learning rate and batch) share one **parent**; ``at = [a,
...]`` adds end points at those fractions of each such family's longest one's tokens (points at C of their own,
for approach 3 and the envelope; approach 2 groups them with a budget only where their C is within its
tolerance). The
parent trains the stable phase once, as a complete run of the WSD schedule with no decay, up to the longest
branch's decay start, and keeps a checkpoint (``train.checkpoint_steps``) at each branch's decay start. Each
**branch** is one of the sweep's end points, unchanged in N, D and C: it starts from the parent's checkpoint at
step K = S - round(F S) (S its own steps), weights, AdamW state and step together, and trains the decay over
its last F steps to the floor. The data order and dropout are functions of the seed and step, so a branch
computes what a single run of its schedule trained straight through computes (a test checks its losses step
by step).

The schedule of every branch and its parent agree before the branch point because they share the warmup in
steps: W = round(warmup × S_shortest), the shortest branch's own (a longer run's own warmup, a fraction of
its steps, could end after the shortest one's decay starts); each run's ``train.warmup`` is W / S. A size
with one end point is a plain run of the same schedule (its warmup is its own, as W would be).

FLOPs: a branch's ``flops`` (its summary's, the registry's and the export's) is its end point's, F_tok × D, as
a separate run would spend: the C at which approach 1 and 3 place it. What it spends itself is
``flops_spent`` = F_tok × (D - K × batch); the parent spends F_tok × K_longest × batch. Parents live in
``SWEEP/parent/runs/`` (role ``parent``), out of the analysis' grid; a branch's registry row and export row
name its parent and its branch step (``status`` shows them). A branch's ``wall_time_s`` and curve include its
parent's steps up to the branch, as its checkpoint carries them.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from lab.runtime.config import RunConfig
from lab.runtime.files import fsync_folder, fsync_tree, loads_line, read_json, read_lines, save_json, write_atomic

from sweeps.driver import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNFINISHED, execute, run_dir
from sweeps.executors.attempt import Executor
from sweeps.runs import PlannedRun, option_text
from sweeps.registry import Registry, Row

FOLDER = "parent"  # inside the sweep folder: the parents' run directories, under runs/
LENGTH_OPTIONS = ("--train.tokens", "--train.eval_every")  # what may differ between the branches of one parent


def _with(args: tuple[str, ...], **train: object) -> tuple[str, ...]:
    """``args`` with ``--train.KEY VALUE`` set for each of ``train``, in the planner's (sorted) order."""
    options = dict(zip(args[::2], args[1::2])) | {f"--train.{k}": option_text(v) for k, v in train.items()}
    return tuple(item for key in sorted(options) for item in (key, options[key]))


def _family(run: PlannedRun) -> str:
    """What a run's branches share: everything but its length, and how it is launched."""
    kept = [pair for pair in zip(run.args[::2], run.args[1::2]) if pair[0] not in LENGTH_OPTIONS]
    return repr((kept, run.launch, run.role))


def _more_end_points(family: list[PlannedRun], at: tuple[float, ...], evals: int) -> list[PlannedRun]:
    """End points at fractions ``at`` of the family's longest one's tokens (whole batches), beside its own; each
    named after the longest with ``-atA`` and placed at its own C (its ``budget``)."""
    longest = max(family, key=lambda r: r.tokens)
    known, more = {r.tokens for r in family}, []
    for fraction in at:
        tokens = longest.batch_tokens * round(fraction * longest.tokens / longest.batch_tokens)
        if tokens < longest.batch_tokens or tokens in known:
            continue
        known.add(tokens)
        steps = {"eval_every": max(1, tokens // longest.batch_tokens // evals)} if evals else {}
        more.append(dataclasses.replace(
            longest, name=f"{longest.name}-at{fraction:g}", tokens=tokens, budget=longest.flops_per_token * tokens,
            args=_with(longest.args, tokens=tokens, **steps),
            est_seconds=longest.est_seconds * tokens / longest.tokens))
    return more


def branch(runs: list[PlannedRun], fraction: float, warmup: float, at: tuple[float, ...] = (), evals: int = 0
           ) -> tuple[list[PlannedRun], list[str]]:
    """The sweep's runs as parents (first) and branches, and one refusal line per family that cannot branch.

    ``fraction``: the cooldown's share of each end point's steps; ``warmup``: [base.train]'s warmup fraction;
    ``at``: more end points per family, as fractions of its longest one's tokens (``evals``: [sweep] evals, for
    theirs). Runs of other roles than ``sweep`` are kept as they are; the extra end points follow the runs.
    """
    families: dict[str, list[PlannedRun]] = {}
    for run in runs:
        if run.role == "sweep":
            families.setdefault(_family(run), []).append(run)
    added = [run for family in families.values() for run in _more_end_points(family, at, evals)]
    for run in added:
        families[_family(run)].append(run)
    runs = runs + added
    parents, replaced, refused = [], {}, []
    for family in families.values():
        family.sort(key=lambda r: r.tokens)
        steps = [r.tokens // r.batch_tokens for r in family]
        warmup_steps = round(warmup * steps[0])
        starts = [s - round(fraction * s) for s in steps]
        if len(family) == 1:
            replaced[family[0].name] = dataclasses.replace(family[0], args=_with(family[0].args, decay=fraction))
            continue
        if starts[0] < max(1, warmup_steps):
            refused.append(f"cooldowns: {family[0].name} ({steps[0]} steps) would branch at step {starts[0]}, before "
                           f"the end of its warmup ({warmup_steps} steps)")
            continue
        longest = family[-1]
        parent = dataclasses.replace(
            longest, name=f"{longest.name}-stable", role=FOLDER, tokens=starts[-1] * longest.batch_tokens,
            args=_with(longest.args, tokens=starts[-1] * longest.batch_tokens, warmup=warmup_steps / starts[-1],
                       decay=0.0, checkpoint_steps=",".join(map(str, sorted(set(starts))))),
            est_seconds=longest.est_seconds * starts[-1] / steps[-1])
        parents.append(parent)
        for run, total, start in zip(family, steps, starts):
            replaced[run.name] = dataclasses.replace(
                run, args=_with(run.args, warmup=warmup_steps / total, decay=fraction), parent=parent.name,
                branch_step=start, est_seconds=run.est_seconds * (total - start) / total)
    return parents + [replaced.get(r.name, r) for r in runs], refused


def savings(runs: list[PlannedRun]) -> str:
    """One line: parents, branches and the FLOPs the plan spends against its end points as separate runs."""
    ends = sum(r.flops for r in runs if r.role == "sweep")
    spent = sum(r.flops_spent for r in runs if r.role in ("sweep", FOLDER))
    parents = sum(r.role == FOLDER for r in runs)
    branches = sum(r.parent is not None for r in runs)
    return (f"cooldowns: {parents} stable phase(s), {branches} branch(es): the plan spends {spent:.3g} FLOPs "
            f"against {ends:.3g} for its end points as separate runs ({1 - spent / ends:.1%} saved; computed from "
            f"the plan)")


def describe(runs: list[PlannedRun]) -> list[str]:
    """One line per parent: its steps, and each branch with the step it starts from."""
    lines = []
    for parent in (r for r in runs if r.role == FOLDER):
        children = [f"{r.name} @ {r.branch_step}" for r in runs if r.parent == parent.name]
        lines.append(f"{parent.name}: {parent.tokens // parent.batch_tokens} stable steps → {', '.join(children)}")
    return lines


def run_dirs(folder: Path, runs: list[PlannedRun]) -> Callable[[str], Path]:
    """Run name → run directory: a parent's under ``FOLDER/runs/``, every other one where the driver puts it."""
    parents = {r.name for r in runs if r.role == FOLDER}
    return lambda name: folder / FOLDER / "runs" / name if name in parents else run_dir(folder, name)


def seed(branch_row: Row, parent_row: Row) -> str | None:
    """Start a branch's run directory from its parent's checkpoint at the branch step; an error line if it cannot.

    The checkpoint is copied (the parent keeps its own), with the parent's metrics up to that step (the branch's
    curve starts where the parent's is) and the parent's config with the branch's options on top (what its
    resume checks against). The checkpoint goes into place last: a branch that holds one is seeded, and is
    never seeded again (a restarted branch resumes from its own newest checkpoint).
    """
    from lab.runtime import checkpoint  # torch: imported by the branches that need it, not by every sweeps command

    target, step = branch_row.run_dir, branch_row.plan.branch_step
    if checkpoint.latest(target) is not None:
        return None
    source = parent_row.run_dir / "checkpoints" / f"step-{step:06d}"
    if not (source / checkpoint.META).is_file():
        return f"parent {parent_row.name} has no checkpoint at step {step} ({source})"
    tree = read_json(parent_row.run_dir / "config.json")
    args = branch_row.plan.args
    for option, value in zip(args[::2], args[1::2]):
        section, key = option.removeprefix("--").split(".", 1)
        tree.setdefault(section, {})[key] = value
    (target / "checkpoints").mkdir(parents=True, exist_ok=True)
    save_json(target / "config.json", RunConfig.from_dict(tree).to_dict())
    metrics = parent_row.run_dir / "metrics.jsonl"
    kept = [line for line in (read_lines(metrics) if metrics.exists() else []) if _step(line) <= step]
    write_atomic(target / "metrics.jsonl", "".join(line + "\n" for line in kept))
    final = target / "checkpoints" / source.name
    tmp = final.with_name(final.name + ".tmp")  # a torn copy is removed when the run starts
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    fsync_tree(tmp)
    tmp.replace(final)
    fsync_folder(final.parent)
    fsync_folder(target)
    return None


def _step(line: str) -> float:
    """The step of a metrics line (a torn or blank line: infinity, so it is dropped)."""
    try:
        return float(loads_line(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def execute_branched(folder: Path, registry: Registry, runs: list[PlannedRun], executor: Executor,
                     progress: bool = True) -> int:
    """Run the parents and the runs without one, then seed and run each branch whose parent is done.

    A branch whose parent is not done waits (it stays planned; running the sweep again runs it once its parent
    is done); one whose parent lacks its checkpoint is recorded as failed with the reason.
    """
    code = execute(folder, registry, [r.name for r in runs if r.parent is None], executor, progress)
    branches = [r for r in runs if r.parent is not None]
    if code == EXIT_INTERRUPTED or not branches:
        return code
    ready, waiting = [], []
    for run in branches:
        row, parent = registry.get(run.name), registry.get(run.parent)
        if row.status not in ("done", "cancelled") and (parent is None or parent.status != "done"):
            waiting.append(run.name)
            continue
        problem = seed(row, parent) if row.status not in ("done", "cancelled") else None
        if problem:
            registry.set_status(run.name, "failed", error=problem, unless=("cancelled",))
            print(f"failed    {run.name}  {problem}", file=sys.stderr)
            continue
        ready.append(run.name)
    if waiting:
        print(f"{len(waiting)} branch(es) wait for a parent that is not done ({waiting[0]}, ...); run the sweep "
              f"again to go on", file=sys.stderr)
    branch_code = execute(folder, registry, ready, executor, progress) if ready else EXIT_OK
    if branch_code == EXIT_INTERRUPTED:
        return branch_code
    done = all(registry.get(r.name).status == "done" for r in runs)
    return EXIT_OK if done else EXIT_UNFINISHED
