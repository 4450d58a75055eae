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

from lab.runtime.config import ConfigError

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


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # torchrun's, read by world_from_env


def check_rank_environment() -> None:
    """ConfigError (one line) for rank variables no launcher sets: one that is not a whole number, a rank without
    its world size or outside it, or a LAB_AGENT_PID that is not this process's parent (left in a shell from an
    earlier launch, or its agent has ended): checked before the run starts, which would otherwise train as a lone
    rank of a group that never forms, or be killed without a word (``rank_dies_with_agent``)."""
    values = {}
    for name in (*RANK_VARIABLES, AGENT_PID):
        text = os.environ.get(name)
        if text is not None and not (text.isascii() and text.isdigit()):
            raise ConfigError(f"the environment variable {name}={text[:40]!r} must be a whole number (torchrun sets "
                              f"it; unset it to run one process)")
        values[name] = None if text is None else int(text)
    if values["RANK"] and values["WORLD_SIZE"] is None:
        raise ConfigError(f"RANK={values['RANK']} is set without WORLD_SIZE; torchrun sets both (unset RANK to run "
                          f"one process)")
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if values[size] is not None and not (values[size] >= 1 and (values[rank] or 0) < values[size]):
            raise ConfigError(f"{rank}={values[rank] or 0} is not a rank of {size}={values[size]}")
    agent = values[AGENT_PID]
    if "TORCHELASTIC_RUN_ID" in os.environ and agent is not None and agent != os.getppid():
        raise ConfigError(f"{AGENT_PID}={agent} is not this rank's parent (pid {os.getppid()}): its launcher has "
                          f"ended, or the variable was left from an earlier launch (unset it)")


def rank_dies_with_agent() -> None:
    """Under torchrun: SIGKILL this rank when its agent dies (it holds no state a checkpoint lacks: the run resumes
    from its last checkpoint)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        agent = os.environ.get(AGENT_PID)
        die_with_parent(signal.SIGKILL, int(agent) if agent else None)
