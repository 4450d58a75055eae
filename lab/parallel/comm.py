"""Collectives that count what each rank sends and time what it waits for.

Strategies call these instead of ``torch.distributed`` directly, so every byte they move is
counted by kind (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``) with the ring
convention of ``lab.accounting.ring_elements_sent`` (an all-reduce of n elements sends
2(N − 1)/N·n per rank). A blocking call counts its whole duration as waiting; an asynchronous one
counts only the time spent in ``wait``. ``take`` returns the totals since the last call and resets
them: the loop takes them once per optimizer step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lab.accounting import COLLECTIVES, ring_elements_sent


@dataclass
class CommTotals:
    """Bytes sent by kind, and seconds spent waiting on communication."""

    bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0.0))
    wait_s: float = 0.0


class Comm:
    def __init__(self, world_size: int, group: dist.ProcessGroup | None = None):
        self.world_size, self.group = world_size, group
        self._totals = CommTotals()

    # ------------------------------------------------------------ bookkeeping

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        self._totals.bytes[kind] += ring_elements_sent(kind, tensor.numel(), self.world_size) * tensor.element_size()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time spent inside as time waiting on communication."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._totals.wait_s += time.perf_counter() - t0

    def add_wait(self, seconds: float) -> None:
        self._totals.wait_s += seconds

    def wait(self, work: dist.Work) -> None:
        with self.waiting():
            work.wait()

    def take(self) -> CommTotals:
        """The totals since the last ``take``; counting starts again from zero."""
        totals, self._totals = self._totals, CommTotals()
        return totals

    def _run(self, call, async_op: bool) -> dist.Work | None:
        if async_op:
            return call()
        with self.waiting():
            call()
        return None

    # ------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Sum ``tensor`` over ranks, in place."""
        self._count("all_reduce", tensor)
        return self._run(lambda: dist.all_reduce(tensor, group=self.group, async_op=async_op), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                       ) -> dist.Work | None:
        """Sum ``input`` (every rank's shards, concatenated) over ranks; this rank's shard lands in ``output``."""
        self._count("reduce_scatter", input)
        return self._run(lambda: dist.reduce_scatter_tensor(output, input, group=self.group, async_op=async_op),
                         async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Concatenate every rank's ``input`` into ``output``, in rank order."""
        self._count("all_gather", output)
        return self._run(lambda: dist.all_gather_into_tensor(output, input, group=self.group, async_op=async_op),
                         async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> dist.Work | None:
        """Copy rank ``src``'s ``tensor`` to every rank, in place."""
        self._count("broadcast", tensor)
        return self._run(lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=async_op), async_op)
