"""What a SLURM job runs (through submitit): one attempt of a run, under the run's lock."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sweeps.executors.attempt import environment, error_line, open_lock, try_lock


class RunFailed(RuntimeError):
    """The run exited non-zero; the message is its error line, so SLURM and submitit show the failure."""


def run_attempt(command: list[str], threads: int, cwd: str, log: str, lock: str, number: int = 1) -> int:
    """Run attempt ``number``'s ``command`` (``threads`` per process) with its output appended to ``log`` while
    holding ``lock``; raise RunFailed unless it exits 0."""
    with open_lock(Path(lock)) as held:
        try_lock(held, wait=True)  # waits if another attempt of this run is still alive
        with open(log, "ab") as out:
            code = subprocess.call(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   env=environment(threads, number), cwd=cwd)
    if code != 0:
        raise RunFailed(error_line(Path(log)) or f"exit code {code}")
    return code
