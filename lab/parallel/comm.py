"""Collectives that count what each rank sends and time what it waits for.

Strategies call these instead of ``torch.distributed`` directly, so every byte they move is
counted by kind (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``) with the ring
convention of ``lab.accounting.ring_elements_sent`` (an all-reduce of n elements sends
2(N − 1)/N·n per rank). A blocking call counts its whole duration as waiting; an asynchronous one
counts only the time spent in ``wait``. ``take`` returns the totals since the last call and resets
them: the loop takes them once per optimizer step.

gloo's reduce-scatter is an all-reduce underneath: it sends 2(N − 1)/N of the input per rank, as
much as an all-reduce, from a full copy of it (measured on the loopback interface: see
benchmarks/results-memory.md). On gloo the lab reduce-scatters with an all-to-all instead (chunk j
to rank j) and sums the N chunks it receives, in rank order, when the work is waited for: the
(N − 1)/N of the ring formula.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lab.accounting import COLLECTIVES, ring_elements_sent

# torch 2.13 renamed the flat collectives; older releases (the project supports torch >= 2.6) have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommTotals:
    """Bytes sent by kind, and seconds spent waiting on communication."""

    bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0.0))
    wait_s: float = 0.0


class Comm:
    def __init__(self, world_size: int, group: dist.ProcessGroup | None = None):
        self.world_size, self.group = world_size, group
        self._totals = CommTotals()
        self._paused = False

    # ------------------------------------------------------------ bookkeeping

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        if not self._paused:
            self._totals.bytes[kind] += (ring_elements_sent(kind, tensor.numel(), self.world_size)
                                         * tensor.element_size())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside are not counted (held-out evaluation is not a training step's traffic)."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    @contextlib.contextmanager
    def counting_torch(self) -> Iterator[None]:
        """Count the flat collectives that torch's own strategies (FSDP2) call through ``torch.distributed``.

        Blocking calls are timed as waiting; an asynchronous call's wait happens inside torch, unseen.
        """
        names = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                 "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}
        originals = {name: getattr(dist, name) for group in names.values() for name in group if hasattr(dist, name)}

        def counted(kind: str, name: str):
            def call(output: torch.Tensor, input: torch.Tensor, *args, async_op: bool = False, **kwargs):
                self._count(kind, output if kind == "all_gather" else input)
                return self._run(lambda: originals[name](output, input, *args, async_op=async_op, **kwargs), async_op)
            return call

        for kind, group in names.items():
            for name in group:
                if name in originals:
                    setattr(dist, name, counted(kind, name))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time spent inside as time waiting on communication."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if not self._paused:
                self._totals.wait_s += time.perf_counter() - t0

    def add_wait(self, seconds: float) -> None:
        self._totals.wait_s += seconds

    def add_sent(self, kind: str, nbytes: float) -> None:
        """Count bytes a backend's own collectives sent (DeepSpeed's, read from its comms logger)."""
        if not self._paused:
            self._totals.bytes[kind] += nbytes

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

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work | None:
        """Reduce ``tensor`` over ranks (a sum unless ``op`` says otherwise), in place."""
        self._count("all_reduce", tensor)
        return self._run(lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                       ) -> dist.Work | SummedOnWait | None:
        """Sum ``input`` (every rank's shards, concatenated) over ranks; this rank's shard lands in ``output``
        (it may be a view into ``input``). On gloo: an all-to-all, summed on ``wait`` (see the module docstring)."""
        self._count("reduce_scatter", input)
        if dist.get_backend(self.group) != "gloo" or self.world_size == 1:
            return self._run(lambda: _reduce_scatter_flat(output, input, group=self.group, async_op=async_op),
                             async_op)
        received = torch.empty_like(input)
        work = SummedOnWait(dist.all_to_all_single(received, input, group=self.group, async_op=True), received,
                            output)
        if async_op:
            return work
        with self.waiting():
            work.wait()
        return None

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Concatenate every rank's ``input`` into ``output``, in rank order."""
        self._count("all_gather", output)
        return self._run(lambda: _all_gather_flat(output, input, group=self.group, async_op=async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> dist.Work | None:
        """Copy rank ``src``'s ``tensor`` (``src`` within this group) to every rank, in place."""
        self._count("broadcast", tensor)
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        return self._run(lambda: dist.broadcast(tensor, src=root, group=self.group, async_op=async_op), async_op)


class SummedOnWait:
    """An all-to-all's work whose ``wait`` then sums the N chunks received into ``output`` (a reduce-scatter)."""

    def __init__(self, work: dist.Work, received: torch.Tensor, output: torch.Tensor):
        self.work, self.received, self.output = work, received, output

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        self.work.wait()
        if self.received is not None:
            torch.sum(self.received.view(-1, self.output.numel()), dim=0, out=self.output)
            self.received = None
        return True


class InOrder:
    """Asynchronous collectives over groups of parameters (buckets, units), launched in a fixed order.

    Each group waits for a known number of gradients; a group is launched once it and every group
    before it are complete, so every rank issues the same collectives in the same order whatever
    order its hooks fire in. ``launch(i)`` issues group i's collective and returns its work handle;
    ``finish()`` launches what is left (groups with a parameter unused in this step) and returns
    the handles in order (None where ``launch`` keeps its handles itself).
    """

    def __init__(self, sizes: list[int], launch: Callable[[int], dist.Work | None]):
        self.sizes, self.launch = sizes, launch
        self.start()

    def start(self) -> None:
        """A new synced backward: every group waits for all its gradients again."""
        self.pending, self.works, self.next = list(self.sizes), [], 0

    def arrived(self, group: int, eager: bool = True) -> bool:
        """One gradient of ``group`` is in; launch what is ready when ``eager``. True when ``group`` is complete."""
        self.pending[group] -= 1
        if eager:
            self._launch(everything=False)
        return self.pending[group] == 0

    def finish(self) -> list[dist.Work | None]:
        """Launch what is left; the handles in order, let go of here (a handle keeps its tensors alive)."""
        self._launch(everything=True)
        works, self.works = self.works, []
        return works

    def _launch(self, everything: bool) -> None:
        while self.next < len(self.sizes) and (everything or self.pending[self.next] == 0):
            self.works.append(self.launch(self.next))
            self.next += 1
