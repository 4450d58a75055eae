"""Worlds of gloo ranks kept alive for the whole test session: ``run_pooled(fn, n, *args)`` runs
``fn(world, *args)`` on this process's world of ``n`` ranks (``lab.commands.ranks`` starts them), so that
many checks share one group and what a rank imports or initialises lazily is paid once. Each call
starts from the state a fresh rank has (random state, threads, grad mode, environment); a world that
failed is replaced by a fresh one at its next call. Tests that break a group on purpose (a rank that
dies, a collective nobody joins) use ``run_ranks``, which starts a fresh world.
"""

from __future__ import annotations

import atexit
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lab.commands.ranks import call_reporting, collect, fork_context, free_port, join_world, stop


def _pooled_rank_main(rank: int, world_size: int, port: int, timeout_s: float, tasks: mp.Queue,
                      results: mp.Queue) -> None:
    """Join the group once, then run each task from ``tasks`` (None ends the loop) from a fresh rank's state."""
    try:
        world = join_world(rank, world_size, port, timeout_s)
    except BaseException as e:
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    rng, environ = torch.random.get_rng_state(), dict(os.environ)
    while (task := tasks.get()) is not None:
        fn, args = task
        torch.random.set_rng_state(rng)
        torch.set_num_threads(1)
        torch.set_grad_enabled(True)
        os.environ.clear()
        os.environ.update(environ)
        results.put(call_reporting(rank, fn, world, args))
    dist.destroy_process_group()


class RankPool:
    """A world of ``world_size`` gloo ranks that stays up between calls of ``run``."""

    def __init__(self, world_size: int, timeout_s: float = 30.0):
        ctx = fork_context()
        self.world_size = world_size
        self.results: mp.Queue = ctx.Queue()
        self.tasks: list[mp.Queue] = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_pooled_rank_main, args=(r, world_size, port, timeout_s, self.tasks[r],
                                                                  self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, deadline_s: float = 300.0) -> list[Any]:
        """``fn(world, *args)`` on every rank; each rank's return value, in rank order."""
        for q in self.tasks:
            q.put((fn, args))
        return collect(self.procs, self.results, deadline_s)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for p, q in zip(self.procs, self.tasks):
            if p.is_alive():
                q.put(None)
        stop(self.procs, grace_s=5)

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
        stop(self.procs)


_POOLS: dict[int, RankPool] = {}


def run_pooled(fn: Callable[..., Any], world_size: int, *args: Any, deadline_s: float = 300.0) -> list[Any]:
    """``run_ranks`` on this process's kept-alive world of ``world_size`` ranks (rebuilt after a failure)."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, *args, deadline_s=deadline_s)
    except BaseException:  # a failed call can leave collectives half done: never reuse that group
        _POOLS.pop(world_size).kill()
        raise


@atexit.register
def close_pools() -> None:
    """End every kept-alive world (also run at interpreter exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close()
