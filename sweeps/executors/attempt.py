"""What every executor shares: one attempt of a run, its command line, its lock and its outcome.

A run is started as ``python launch/run.py OPTIONS --run-dir DIR --resume auto`` (one process) or
under ``torchrun --standalone --nproc_per_node=K`` (several; through ``lab.runtime.loopback``, so its stores
listen on 127.0.0.1 only): a first attempt starts afresh, a later
one continues from the run's newest checkpoint. Each attempt writes
its output to ``SWEEP/logs/NAME/attempt-K.log``. While a single-node attempt is alive it holds an
exclusive lock on ``SWEEP/logs/NAME/run.lock``, so a restarted driver never starts a second copy
of a run that an earlier driver left running. The outcome is read from the run directory: ``summary.json``
with status ``completed`` means done; one with status ``interrupted`` written by this attempt (the run
stopped at a signal and saved a checkpoint) means interrupted, as does an ``error: interrupted`` line;
anything else is a failure, explained by the last ``error: ...`` line of the attempt's output.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from lab.runtime import files
from lab.runtime.files import read_json

from sweeps.runs import PlannedRun

REPO = Path(__file__).resolve().parents[2]
RUN_PY = REPO / "launch" / "run.py"


@dataclass(frozen=True)
class Attempt:
    """One try at a run. ``job`` is set when following a job an earlier driver submitted; ``submitting`` when an
    earlier driver recorded a SLURM submission (by its job name) and stopped before it recorded the job id."""

    run: PlannedRun
    run_dir: Path
    log: Path
    lock: Path
    job: str | None = None
    submitting: str | None = None
    number: int = 1  # the attempt's number (its log is attempt-NUMBER.log), in the run's environment


@dataclass(frozen=True)
class Outcome:
    status: str  # done, failed, interrupted or cancelled
    error: str | None = None
    summary: dict | None = None


class ExecutorError(RuntimeError):
    """An executor cannot go on (e.g. sbatch refused a job); the message is one line."""


class Events(Protocol):
    """How an executor reports to the driver (which records everything in the registry)."""

    def start(self, attempt: Attempt) -> bool:
        """Whether to start ``attempt`` now (False: it was cancelled or finished meanwhile)."""

    def submitting(self, attempt: Attempt, marker: str) -> None:
        """``attempt`` is about to be started, or submitted to SLURM under ``marker`` (recorded before ``sbatch``): it
        is counted now, so that a driver killed in between leaves its attempt on record."""

    def started(self, attempt: Attempt, job: str) -> None:
        """``attempt`` is running as ``job`` (a process id or a SLURM job id)."""

    def finished(self, attempt: Attempt, outcome: Outcome) -> None:
        """``attempt`` ended."""

    def tick(self) -> None:
        """Called every poll while attempts run (the driver refreshes its progress display)."""


class Executor(Protocol):
    name: str  # recorded with each job: "local" or "slurm"

    def run(self, attempts: list[Attempt], events: Events) -> None:
        """Run every attempt, reporting to ``events``; return when all have ended."""


def run_command(attempt: Attempt) -> list[str]:
    """A single-node command: the run itself for one process (no launcher to start and wait on), else
    torchrun with a private rendezvous and the run's process count."""
    nproc = attempt.run.launch.nproc
    launcher = ["-m", "lab.runtime.loopback", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    # a cooldown branch must start from the checkpoint it was seeded with, never afresh
    return [sys.executable, *launcher, str(RUN_PY), *attempt.run.args, "--run-dir", str(attempt.run_dir),
            "--resume", "latest" if attempt.run.parent else "auto"]


def environment(threads: int, number: int) -> dict[str, str]:
    """The driver's environment with the threads per process set (torchrun would otherwise pick 1) and the attempt's
    number (which the run records in its attempts.jsonl)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "LAB_SWEEP_ATTEMPT": str(number)}


def open_lock(path: Path) -> IO[bytes]:
    """The run's lock file, opened (``lab.runtime.files.open_lock``); ExecutorError (one line) if it cannot be one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return files.open_lock(path)
    except files.LockUnusable as e:
        raise ExecutorError(str(e)) from None


def try_lock(lock: IO[bytes], wait: bool = False) -> bool:
    """Take the run's lock if no live attempt holds it (with ``wait``, once it is free); ExecutorError (one line)
    where the file system refuses locks."""
    try:
        return files.lock(lock, wait)
    except files.LockUnusable as e:
        raise ExecutorError(str(e)) from None


def read_summary(run_dir: Path) -> dict | None:
    try:
        summary = read_json(run_dir / "summary.json")
    except (OSError, ValueError):  # not written yet, torn by a kill, or not a summary at all
        return None
    return summary if isinstance(summary, dict) else None


def error_line(*logs: Path) -> str | None:
    """The last ``error: ...`` line in the first of ``logs`` that holds one."""
    for log in logs:
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        found = next((line.strip() for line in reversed(lines) if line.startswith("error: ")), None)
        if found:
            return found
    return None


def outcome(attempt: Attempt, failure: str, more_logs: list[Path] | tuple[Path, ...] = (),
            since: float | None = None) -> Outcome:
    """Done if the run directory holds a completed summary; interrupted if the attempt printed
    ``error: interrupted ...`` or printed no error line and left an interrupted summary (written after
    ``since``, the attempt's start, when known); else failed, with the error line the attempt printed (in
    its log, else in ``more_logs``), or ``failure`` (e.g. the exit code) when it printed none."""
    summary = read_summary(attempt.run_dir)
    if summary is not None and summary.get("status") == "completed":
        return Outcome("done", summary=summary)
    line = error_line(attempt.log, *more_logs)
    if line is not None and line.startswith("error: interrupted"):
        return Outcome("interrupted", error=line)
    if line is None and summary is not None and summary.get("status") == "interrupted" \
            and (since is None or (attempt.run_dir / "summary.json").stat().st_mtime >= since):
        return Outcome("interrupted", error=f"interrupted by {summary.get('signal', 'a signal')} after step "
                                            f"{summary.get('steps')} of {summary.get('total_steps')}")
    return Outcome("failed", error=line or f"{failure} (no error line; see {attempt.log})")
