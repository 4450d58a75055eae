"""The local executor: runs one after another, or several at once, as child processes.

Runs are child processes of the driver. On Linux each gets SIGTERM when the driver dies (even by
SIGKILL), so it checkpoints and stops; elsewhere it finishes on its own, and a restarted driver
waits for its lock before running it again. Ctrl-C or SIGTERM to the driver stops the runs the
same way; each saves a checkpoint and is recorded as interrupted (a later ``run`` resumes it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import IO

from lab.runtime import chaos
from lab.runtime.processes import die_with_parent

from sweeps.executors.attempt import Attempt, Events, environment, open_lock, outcome, run_command, try_lock


def usable_cores() -> int:
    """The cores the driver (and so its runs) may use: its CPU affinity."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LocalExecutor:
    """Up to ``parallel`` runs at once, each process with ``threads`` threads (default: its share of the cores),
    never more threads in all than cores: a run waits until its processes' threads fit beside those running
    (one run alone may take them all). Oversubscribed OpenMP threads make every run wait on the others'."""

    name = "local"

    def __init__(self, parallel: int = 1, threads: int = 0, poll_s: float = 0.2, cores: int | None = None):
        self.parallel = parallel
        self.poll_s = poll_s
        self.threads = threads
        self.cores = cores or usable_cores()

    def _threads(self, attempt: Attempt) -> int:
        processes = attempt.run.launch.world_size
        fair = max(1, self.cores // (self.parallel * processes))
        return min(self.threads or fair, max(1, self.cores // processes))

    def _fits(self, attempt: Attempt, busy: int) -> bool:
        """Whether ``attempt``'s threads fit in the cores beside ``busy`` threads already running."""
        return busy == 0 or busy + attempt.run.launch.world_size * self._threads(attempt) <= self.cores

    def run(self, attempts: list[Attempt], events: Events) -> None:
        """Run every attempt, the longest (by the plan's estimate) first, so that runs done side by side end
        together; return when all have ended (re-raises KeyboardInterrupt after stopping them)."""
        queue = deque(sorted(attempts, key=lambda a: -a.run.est_seconds))
        with_driver = functools.partial(die_with_parent, signal.SIGTERM, os.getpid())  # in each child, before exec
        active: dict[subprocess.Popen, tuple[Attempt, IO[bytes], IO[bytes], float]] = {}
        try:
            while queue or active:
                while queue and len(active) < self.parallel and self._fits(queue[0], sum(
                        a.run.launch.world_size * self._threads(a) for a, *_ in active.values())):
                    attempt = queue.popleft()
                    if not events.start(attempt):
                        continue
                    lock = open_lock(attempt.lock)
                    if not try_lock(lock):
                        print(f"waiting for an earlier attempt of '{attempt.run.name}' to stop", file=sys.stderr)
                        try_lock(lock, wait=True)
                    if not events.start(attempt):  # the earlier attempt may have finished it
                        lock.close()
                        continue
                    events.submitting(attempt, attempt.log.stem)  # counted before it starts
                    chaos.point("submit-record")
                    log, since = open(attempt.log, "ab"), time.time()
                    proc = subprocess.Popen(run_command(attempt), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT,
                                            env=environment(self._threads(attempt), attempt.number),
                                            pass_fds=(lock.fileno(),), preexec_fn=with_driver)
                    active[proc] = (attempt, log, lock, since)
                    events.started(attempt, str(proc.pid))
                for proc in [p for p in active if p.poll() is not None]:
                    self._finish(proc, active.pop(proc), events)
                events.tick()
                time.sleep(self.poll_s)
        except KeyboardInterrupt:
            for proc in active:
                proc.send_signal(signal.SIGTERM)  # the run writes a checkpoint and stops
            for proc, entry in active.items():
                proc.wait()
                self._finish(proc, entry, events)
            raise

    @staticmethod
    def _finish(proc: subprocess.Popen, entry: tuple[Attempt, IO[bytes], IO[bytes], float], events: Events) -> None:
        attempt, log, lock, since = entry
        log.close()
        lock.close()
        events.finished(attempt, outcome(attempt, f"exit code {proc.returncode}", since=since))


def stop(pid: int, lock: Path) -> bool:
    """SIGTERM the attempt running as ``pid`` if it is still alive (it holds the run's lock); True if signalled."""
    with open_lock(lock) as held:
        if try_lock(held):
            return False  # nothing alive holds the lock: the process is gone (its pid may be reused)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        return True
    return False
