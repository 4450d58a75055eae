"""Named points where a chaos harness (benchmarks/chaos/harness.py) stops a process; nothing happens unless
``LAB_CHAOS_POINT`` is set, and then only at the pass it names.

With ``LAB_CHAOS_POINT=NAME:N`` and ``LAB_CHAOS_DIR=FOLDER`` in the environment of a sweep's driver (its torchrun
agents and ranks inherit both), the N-th pass through point NAME, counted over every process of the sweep, writes
its process id to ``FOLDER/stopped`` and stops its process (SIGSTOP). The harness then kills that process, its
parent, the driver or every process of the sweep, and continues what it spared. The points:

- ``checkpoint-write``: a rank wrote its part of a checkpoint, which is not yet sealed (no meta.json, not renamed);
- ``summary-written``: rank 0 wrote a run's summary.json, which no driver has recorded yet;
- ``registry-transaction``: the driver is inside a registry transaction, before its commit;
- ``submit-record``: the driver recorded an attempt as starting and has not started (or submitted) it yet.
"""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path

POINTS = ("checkpoint-write", "summary-written", "registry-transaction", "submit-record")
_AIM = os.environ.get("LAB_CHAOS_POINT", "")  # read once: the check at each point is a comparison of strings


def point(name: str) -> None:
    """Pass the point ``name`` (one of POINTS): stop here when the harness aims at this pass. ``LAB_CHAOS_POINT=*:0``
    counts the passes through every point (in ``FOLDER/passes-NAME``, a byte each) and stops at none."""
    if _AIM and _AIM.partition(":")[0] in (name, "*"):
        _arrive(name)


def _arrive(name: str) -> None:
    """Count this pass (a byte appended under a lock, shared by every process) and stop if it is the aimed one."""
    folder = Path(os.environ["LAB_CHAOS_DIR"])
    with open(folder / f"passes-{name}", "ab") as passes:
        fcntl.flock(passes, fcntl.LOCK_EX)
        passes.write(b".")
        passes.flush()
        aimed = os.fstat(passes.fileno()).st_size == int(_AIM.partition(":")[2])
        if aimed:
            (folder / "stopped.tmp").write_text(f"{os.getpid()}\n")
            (folder / "stopped.tmp").replace(folder / "stopped")
    if aimed:
        os.kill(os.getpid(), signal.SIGSTOP)
