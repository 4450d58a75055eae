"""Run a function on N real ranks on this machine: processes joined in a gloo group on a free port of 127.0.0.1.

``run_ranks(fn, n, *args)`` starts ``n`` fresh processes (forked from a fork server that imported
torch and the lab once, so later groups start in a fraction of a second), each with one thread (as
torchrun gives), initialises the process group with a short collective timeout (so a mismatched
collective fails in seconds instead of hanging), calls ``fn(world, *args)`` and returns every rank's
result in rank order. A rank that raises makes the call raise ``RankFailed`` with that rank's
traceback; a rank that dies or a call that outlives ``deadline_s`` is killed and reported. ``fn``
and its arguments must be picklable (a module-level function). The equivalence check and the
strategy benchmark use it; the tests keep such worlds alive between checks (``tests/pool.py``).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lab.parallel.layout import World
from lab.runtime.loopback import listen_on_loopback


class RankFailed(RuntimeError):
    """A rank raised, died or timed out; the message carries its error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_world(rank: int, world_size: int, port: int, timeout_s: float) -> World:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    listen_on_loopback()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return World(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))


def call_reporting(rank: int, fn: Callable[..., Any], world: World, args: tuple) -> tuple[int, bool, Any]:
    try:  # plain pickle: tensors travel by value, not as shared memory that dies with this process
        return rank, True, pickle.dumps(fn(world, *args))
    except BaseException as e:  # reported to the parent, never swallowed
        return rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, results: mp.Queue,
               fn: Callable[..., Any], args: tuple) -> None:
    try:
        world = join_world(rank, world_size, port, timeout_s)
        results.put(call_reporting(rank, fn, world, args))
    except BaseException as e:
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Imported once by the fork server; every rank forked from it starts with them loaded (importing
# torch and the optimizer's lazy torch._dynamo costs several seconds per fresh process).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "lab.training.lifecycle", "lab.parallel"]


def fork_context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def collect(procs: list, results: mp.Queue, deadline_s: float) -> list[Any]:
    """Every rank's result in rank order, or ``RankFailed`` for the first rank that raised, died or overran."""
    world_size = len(procs)
    got: dict[int, Any] = {}
    failures: list[str] = []
    end = time.monotonic() + deadline_s
    while len(got) + len(failures) < world_size:
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > end:
                failures.append(f"ranks {sorted(set(range(world_size)) - set(got))} still running after "
                                f"{deadline_s:.0f} s")
                break
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
            if dead and results.empty():
                failures.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                break
            continue
        if ok:
            got[rank] = pickle.loads(value)
        else:
            failures.append(f"rank {rank}: {value}")
    if failures:
        raise RankFailed(failures[0])
    return [got[r] for r in range(world_size)]


def stop(procs: list, grace_s: float = 10) -> None:
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 30.0,
              deadline_s: float = 300.0) -> list[Any]:
    """``fn(world, *args)`` on ``world_size`` fresh gloo ranks; each rank's return value, in rank order."""
    ctx = fork_context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, timeout_s, results, fn, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return collect(procs, results, deadline_s)
    finally:
        stop(procs)
