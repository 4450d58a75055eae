"""Processes that end with their parent: a rank with its torchrun agent, a run with its sweep's driver.

A rank whose agent died would otherwise live on, its parent gone, retrying for ``parallel.timeout_s`` to reach the
agent's store or its dead peers, and holding its accelerator all that time. Linux delivers a signal to a process
when its parent ends (``PR_SET_PDEATHSIG``); a parent that ended before the child asked for it is caught by
comparing the child's parent with the one it was started by (``LAB_AGENT_PID``, set by the lab's launchers).
Elsewhere nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

AGENT_PID = "LAB_AGENT_PID"  # the torchrun agent's process id, in its ranks' environment (lab.runtime.loopback)
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def die_with_parent(sig: int, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends; if ``parent`` (the process that started
    this one) has ended already, send it now. Safe between fork and exec."""
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, sig)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def rank_dies_with_agent() -> None:
    """Under torchrun: SIGKILL this rank when its agent dies (it holds no state a checkpoint lacks: the run resumes
    from its last checkpoint)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        agent = os.environ.get(AGENT_PID)
        die_with_parent(signal.SIGKILL, int(agent) if agent else None)
