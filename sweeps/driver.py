"""The driver: records the plan in the registry, hands the unfinished runs to an executor and records
each outcome as it comes, with a progress bar that names the runs in flight and their steps.

The sweep folder holds ``sweep.db`` (the registry), ``sweep.toml`` (the sweep file as last run),
``runs/NAME/`` (one run directory per run), ``logs/NAME/`` (each attempt's output and the run's
lock) and, with SLURM, ``slurm/`` (submitit's files). One driver at a time per sweep: a second is
refused while the first holds ``.driver.lock``.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from lab.runtime.files import LockHeld, LockUnusable, take_lock
from lab.runtime.progress import Lines, progress as progress_bar

from sweeps.executors.attempt import Attempt, Executor, ExecutorError, Outcome, read_summary
from sweeps.progress import last_step, total_steps
from sweeps.registry import Registry, RegistryError, Row

EXIT_OK, EXIT_UNFINISHED, EXIT_INTERRUPTED = 0, 1, 130


def job_text(kind: str, job: str) -> str:
    """A registry row's job: ``KIND:JOB``, as ``local:PID``, ``slurm:ID`` or ``slurm-submitting:NAME``."""
    return f"{kind}:{job}"


def job_parts(text: str | None) -> tuple[str, str]:
    """(kind, job) of a row's job (``job_text``); empty strings for none."""
    kind, _, job = (text or "").partition(":")
    return kind, job


def submitting_kind(kind: str) -> str:
    """The job kind of a row between its attempt's record and its start under the executor ``kind`` (for SLURM:
    while its submission is under way, with the job's name and no id yet)."""
    return f"{kind}-submitting"


SUBMITTING = job_text(submitting_kind("slurm"), "")  # how a row's job starts while its SLURM submission runs


def run_dir(folder: Path, name: str) -> Path:
    return folder / "runs" / name


def attempt_for(folder: Path, row: Row, follow: bool) -> Attempt:
    """The next attempt of ``row``, or with ``follow`` the one its recorded job is running (or the recorded
    submission an earlier driver may have made)."""
    logs = folder / "logs" / row.name
    number = max(1, row.attempts) if follow else row.attempts + 1
    job = job_parts(row.job)[1] if follow and row.job else None
    pending = job if job and row.job.startswith(SUBMITTING) else None
    return Attempt(run=row.plan, run_dir=row.run_dir, log=logs / f"attempt-{number}.log", lock=logs / "run.lock",
                   job=None if pending else job, submitting=pending, number=number)


@contextlib.contextmanager
def driver_lock(folder: Path) -> Iterator[None]:
    """Hold the sweep's driver lock; RegistryError if another driver holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        lock = take_lock(folder / ".driver.lock")
    except LockHeld as e:
        raise RegistryError(f"another driver is running this sweep (pid {e.holder})") from None
    except LockUnusable as e:
        raise RegistryError(str(e)) from None
    with lock:
        yield


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class Recorder:
    """The executor's events, written to the registry and shown on the progress bar (whose postfix names
    each run in flight with its step and steps, refreshed every ``refresh_s``)."""

    def __init__(self, registry: Registry, executor_name: str, bar: tqdm | Lines, refresh_s: float = 1.0):
        self.registry, self.kind, self.bar = registry, executor_name, bar
        self.running: dict[str, Attempt] = {}
        self.counted: set[str] = set()  # runs whose attempt was counted when its submission was recorded
        self.refresh_s, self.shown_at = refresh_s, 0.0

    def in_flight(self) -> str:
        """``NAME STEP/STEPS`` of every run in flight, in start order."""
        return ", ".join(f"{name} {last_step(a.run_dir)}/{total_steps(a.run)}" for name, a in self.running.items())

    def tick(self) -> None:
        if self.bar.disable or time.monotonic() - self.shown_at < self.refresh_s:
            return
        self.shown_at = time.monotonic()
        self.bar.set_postfix_str(self.in_flight())

    def start(self, attempt: Attempt) -> bool:
        row = self.registry.get(attempt.run.name)
        if row is None or row.status in ("done", "cancelled"):  # finished or cancelled meanwhile
            self.bar.update(1)
            return False
        summary = read_summary(attempt.run_dir)
        if summary is not None and summary.get("status") == "completed":  # finished after a driver stopped
            self.finished(attempt, Outcome("done", summary=summary))
            return False
        return True

    def submitting(self, attempt: Attempt, marker: str) -> None:
        """Count the attempt and record its submission's marker, in one transaction, before anything is submitted
        (or started)."""
        self.registry.set_status(attempt.run.name, "running", job=job_text(submitting_kind(self.kind), marker),
                                 new_attempt=attempt.submitting is None, unless=("cancelled", "done"))
        self.counted.add(attempt.run.name)

    def started(self, attempt: Attempt, job: str) -> None:
        counted = attempt.run.name in self.counted or attempt.submitting is not None
        self.registry.set_status(attempt.run.name, "running", job=job_text(self.kind, job), new_attempt=not counted,
                                 unless=("cancelled", "done"))
        self.running[attempt.run.name] = attempt
        self.shown_at = 0.0  # show it now
        self.tick()

    def finished(self, attempt: Attempt, outcome: Outcome) -> None:
        name = attempt.run.name
        self.running.pop(name, None)
        self.shown_at = 0.0
        # a completed run counts whatever happened meanwhile; any other ending does not undo a cancel
        changed = self.registry.set_status(name, outcome.status, error=outcome.error, summary=outcome.summary,
                                           unless=() if outcome.status == "done" else ("cancelled",))
        status = outcome.status if changed else "cancelled"
        if status == "done":
            s = outcome.summary or {}
            loss = s.get("final_eval_loss")
            detail = f"loss {loss:.4f}" if loss is not None else "no eval loss"
            detail += f", {s.get('wall_time_s', 0):.0f} s"
        else:
            detail = outcome.error or ""
        self.bar.write(f"{status:<9} {name}  {detail}")
        self.bar.update(1)
        self.tick()


def execute(folder: Path, registry: Registry, names: list[str], executor: Executor, progress: bool = True) -> int:
    """Run the named rows that are not done or cancelled; the exit code says whether all are done."""
    rows = [registry.get(n) for n in names]
    todo = [r for r in rows if r.status not in ("done", "cancelled")]
    bar = progress_bar(len(rows), "runs", "run", progress, initial=len(rows) - len(todo))
    events = Recorder(registry, executor.name, bar)
    # SLURM jobs outlive a driver: follow the ones an earlier driver left running
    attempts = [attempt_for(folder, r, follow=executor.name == "slurm" and r.status == "running"
                            and job_parts(r.job)[0] in ("slurm", submitting_kind("slurm"))) for r in todo]
    for attempt in attempts:
        attempt.log.parent.mkdir(parents=True, exist_ok=True)
    if todo:  # the first line comes when a run ends, minutes later: say now that they started
        bar.write(f"running {len(todo)} of {len(rows)} runs ({executor.name}); a line as each ends, logs in "
                  f"{folder / 'logs'}")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        executor.run(attempts, events)
    except KeyboardInterrupt:
        bar.write("interrupted: what finished is recorded; run the sweep again to resume")
        return EXIT_INTERRUPTED
    except ExecutorError as e:
        bar.write(f"error: {e}")
        return EXIT_UNFINISHED
    finally:
        signal.signal(signal.SIGTERM, previous)
        bar.close()
    statuses = [registry.get(n).status for n in names]
    return EXIT_OK if all(s == "done" for s in statuses) else EXIT_UNFINISHED
