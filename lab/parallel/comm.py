"""Collectives that count what each rank sends and time what it waits for.

Strategies call these instead of ``torch.distributed`` directly, so every byte they move is
counted by kind (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``) with the ring
convention of ``lab.measure.accounting.ring_elements_sent`` (an all-reduce of n elements sends
2(N − 1)/N·n per rank). A blocking call counts its whole duration as waiting; an asynchronous one
counts only the time spent in ``wait``. ``take`` returns the totals since the last call and resets
them: the loop takes them once per optimizer step.

gloo's reduce-scatter is an all-reduce underneath: it sends 2(N − 1)/N of the input per rank, as
much as an all-reduce, from a full copy of it (measured on the loopback interface: see
benchmarks/memory/README.md); its all-gather receives into a full-size buffer of its own and
copies that into the output (a hidden copy of every gathered unit, in the resident set, not in the
lab's tensor meter). On gloo the lab does both itself, between the caller's tensors. An all-gather
is point-to-point messages: this rank's shard to every other rank, theirs received straight into
their places in the output. A reduce-scatter is an all-to-all that sends chunk j of the input to
rank j and receives the N − 1 other copies of this rank's chunk (the first and the last rank send
themselves nothing; one in the middle, whose other chunks do not lie end to end, sends itself its
own), summed with its own, in rank order, when the work is waited for; on two ranks the other
rank's chunk is received straight into the output, where that is not a view into the input, and
summed there (no receive buffer). Both send the (N − 1)/N of the ring formula. (gloo's
point-to-point works say they are complete only once waited for; the all-to-all's says so when
done, so a finished reduce-scatter's buffers are freed early.)
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from lab.measure.accounting import COLLECTIVES, ring_elements_sent

# torch 2.13 renamed the flat collectives; older releases (the project supports torch >= 2.6) have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_GATHER_TAG = 1  # the all-gather's point-to-point messages (they match in the order they are posted)
LOOPBACK = Path("/sys/class/net/lo/statistics/tx_bytes")


def loopback_tx_bytes() -> int | None:
    """Bytes sent on this host's loopback interface since boot (what gloo ranks on one host send each other, and
    any other process's loopback traffic); None where the counter cannot be read."""
    try:
        return int(LOOPBACK.read_text())
    except (OSError, ValueError):
        return None


class AxisFailed(RuntimeError):
    """A collective on a named axis failed: a rank of that axis died or did not answer within the group's timeout."""

    def __init__(self, axis: str, cause: BaseException):
        super().__init__(f"a rank on the {axis} axis died or did not answer ({str(cause).strip().splitlines()[0]})")
        self.axis = axis


def naming_axis(axis: str | None) -> Callable[[Callable], Callable]:
    """A decorator: the function's communication failures raise AxisFailed naming ``axis`` (a method's: the
    axis its object names, ``self.axis``, when ``axis`` is None; nothing is renamed where that is None too)."""
    def decorate(communicate: Callable) -> Callable:
        @functools.wraps(communicate)
        def call(*args, **kwargs):
            try:
                return communicate(*args, **kwargs)
            except RuntimeError as e:
                name = axis if axis is not None else getattr(args[0], "axis", None)
                if name is None or isinstance(e, AxisFailed):
                    raise
                raise AxisFailed(name, e) from e
        return call
    return decorate


_names_axis = naming_axis(None)  # a Comm method: the axis the Comm is named after


@dataclass
class CommTotals:
    """Bytes sent by kind, and seconds spent waiting on communication."""

    bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0.0))
    wait_s: float = 0.0


class Pausable:
    """What it counts, evaluation (inside ``paused``) leaves alone."""

    _paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing inside is counted (held-out evaluation is not a training step's traffic)."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before


class Comm(Pausable):
    def __init__(self, world_size: int, group: dist.ProcessGroup | None = None, axis: str | None = None):
        self.world_size, self.group, self.axis = world_size, group, axis  # axis: named in a failure (AxisFailed)
        self._totals = CommTotals()

    @property
    def rank(self) -> int:
        """This rank's place in the group."""
        return dist.get_rank(self.group) if self.world_size > 1 else 0

    # ------------------------------------------------------------ bookkeeping

    def _count(self, kind: str, tensor: torch.Tensor, world_size: int | None = None) -> None:
        if not self._paused:
            self._totals.bytes[kind] += (ring_elements_sent(kind, tensor.numel(), world_size or self.world_size)
                                         * tensor.element_size())

    @contextlib.contextmanager
    def counting_torch(self) -> Iterator[None]:
        """Count the flat collectives that torch's own strategies (FSDP2) call through ``torch.distributed``, each by
        the size of the group it runs over (entered again inside: counted once).

        Blocking calls are timed as waiting; an asynchronous call's wait happens inside torch, unseen.
        """
        if getattr(dist, "_lab_counting", None) is not None:
            yield
            return
        names = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                 "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}
        originals = {name: getattr(dist, name) for group in names.values() for name in group if hasattr(dist, name)}

        def counted(kind: str, name: str):
            def call(output: torch.Tensor, input: torch.Tensor, *args, async_op: bool = False, **kwargs):
                group = kwargs.get("group", args[1] if len(args) > 1 else None)
                self._count(kind, output if kind == "all_gather" else input, dist.get_world_size(group))
                return self._run(lambda: originals[name](output, input, *args, async_op=async_op, **kwargs), async_op)
            return call

        for kind, group in names.items():
            for name in group:
                if name in originals:
                    setattr(dist, name, counted(kind, name))
        dist._lab_counting = self
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
            dist._lab_counting = None

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

    @_names_axis
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

    @_names_axis
    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, dtype: torch.dtype | None = None
                   ) -> dist.Work | CastBack | None:
        """Reduce ``tensor`` over ranks (a sum unless ``op`` says otherwise), in place; in ``dtype`` when given (a copy
        of it in that dtype is reduced and copied back, on ``wait`` when asynchronous)."""
        if dtype is not None and dtype != tensor.dtype:
            wire = tensor.to(dtype)
            back = CastBack(self.all_reduce(wire, async_op, op), wire, tensor, async_op)
            return back if async_op else None
        self._count("all_reduce", tensor)
        return self._run(lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op), async_op)

    def _by_hand(self) -> bool:
        """Whether the all-gather and the reduce-scatter are the lab's own (gloo with other ranks: see the module
        docstring)."""
        return self.world_size > 1 and dist.get_backend(self.group) == "gloo"

    @_names_axis
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                       dtype: torch.dtype | None = None) -> dist.Work | SummedOnWait | CastBack | None:
        """Sum ``input`` (every rank's shards, concatenated) over ranks; this rank's shard lands in ``output``
        (it may be a view into ``input``). On gloo: an all-to-all, summed on ``wait`` (see the module docstring). In
        ``dtype`` when given, as ``all_reduce``."""
        if dtype is not None and dtype != input.dtype:
            wire = output.new_empty(output.shape, dtype=dtype)
            back = CastBack(self.reduce_scatter(wire, input.to(dtype), async_op), wire, output, async_op)
            return back if async_op else None
        self._count("reduce_scatter", input)
        if not self._by_hand():
            return self._run(lambda: _reduce_scatter_flat(output, input, group=self.group, async_op=async_op),
                             async_op)
        me, n, chunks = dist.get_rank(self.group), self.world_size, input.view(self.world_size, -1)
        if me in (0, n - 1):  # the other ranks' chunks lie end to end: send only them
            sent = input[chunks.shape[1]:] if me == 0 else input[:-chunks.shape[1]]
            splits = [0 if j == me else chunks.shape[1] for j in range(n)]
            apart = output.untyped_storage().data_ptr() != input.untyped_storage().data_ptr()
            # two ranks: the other's chunk lands in the output itself, the sum is then made in place
            received = output.view(1, -1) if n == 2 and apart else input.new_empty(n - 1, chunks.shape[1])
            parts = [*received[:me], chunks[me], *received[me:]]
        else:  # a rank in the middle sends itself its own chunk too
            sent, splits = input, [chunks.shape[1]] * n
            received = input.new_empty(n, chunks.shape[1])
            parts = list(received)
        exchange = dist.all_to_all_single(received.view(-1), sent, splits, splits, group=self.group, async_op=True)
        work = SummedOnWait(exchange, parts, output)
        if async_op:
            return work
        with self.waiting():
            work.wait()
        return None

    @_names_axis
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                   ) -> dist.Work | Exchange | None:
        """Concatenate every rank's ``input`` into ``output`` (1-D), in rank order; ``input`` may be a view into it."""
        self._count("all_gather", output)
        if not self._by_hand():
            return self._run(lambda: _all_gather_flat(output, input, group=self.group, async_op=async_op), async_op)
        me, chunks = dist.get_rank(self.group), output.view(self.world_size, -1)
        chunks[me].copy_(input)
        ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        peers = [j for j in range(self.world_size) if j != me]
        exchange = Exchange([dist.isend(input, ranks[j], group=self.group, tag=_GATHER_TAG) for j in peers]
                            + [dist.irecv(chunks[j], ranks[j], group=self.group, tag=_GATHER_TAG) for j in peers])
        if async_op:
            return exchange
        with self.waiting():
            exchange.wait()
        return None

    @_names_axis
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> dist.Work | None:
        """Copy rank ``src``'s ``tensor`` (``src`` within this group) to every rank, in place."""
        self._count("broadcast", tensor)
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        return self._run(lambda: dist.broadcast(tensor, src=root, group=self.group, async_op=async_op), async_op)


class Exchange:
    """Point-to-point works waited for together, as one collective's work."""

    def __init__(self, works: list[dist.Work]):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        return True


class CastBack:
    """A collective run on a copy in another dtype (``wire``): once it is done, the result is copied into ``out``
    (at once for a blocking one, else on ``wait``)."""

    def __init__(self, work: dist.Work | SummedOnWait | None, wire: torch.Tensor, out: torch.Tensor,
                 async_op: bool):
        self.work, self.wire, self.out = work, wire, out
        if not async_op:
            self.wait()

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.wire is not None:
            self.out.copy_(self.wire)
            self.wire = None
        return True


class SummedOnWait:
    """A reduce-scatter's all-to-all; ``wait`` then sums the N copies of this rank's chunk (``parts``, in rank order:
    the one this rank holds and the ones received) into ``output``."""

    def __init__(self, work: dist.Work, parts: list[torch.Tensor], output: torch.Tensor):
        self.work, self.parts, self.output = work, parts, output

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        self.work.wait()
        if self.parts:
            parts, out = self.parts, self.output
            # ((c0 + c1) + c2) + ...: the output may be this rank's own chunk, read only by the first addition
            parts = [p.clone() if i > 1 and p.data_ptr() == out.data_ptr() else p for i, p in enumerate(parts)]
            torch.add(parts[0], parts[1], out=out)
            for p in parts[2:]:
                out.add_(p)
            self.parts = []
        return True


def buckets(sizes: list[int], cap: int, kinds: list[object] | None = None) -> list[list[int]]:
    """Consecutive indices of ``sizes`` (bytes, in the order gradients arrive) packed greedily into buckets of at
    most ``cap`` bytes (a larger one alone); with ``kinds``, a bucket holds one kind (reduced over one group)."""
    out: list[list[int]] = [[]]
    held = 0
    for i, size in enumerate(sizes):
        if out[-1] and (held + size > cap or (kinds is not None and kinds[i] != kinds[out[-1][0]])):
            out.append([])
            held = 0
        out[-1].append(i)
        held += size
    return [b for b in out if b]


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


def backend_for(device: torch.device) -> str:
    """The process group's backends: gloo on a CPU; on a GPU NCCL for CUDA tensors and gloo for the few small
    CPU tensors some collectives carry (flags, meters)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def join_group_of_one(device: torch.device) -> None:
    """A process group holding this process alone (an in-process store, no port), so that a strategy written
    for N ranks runs as a world of one, started by plain python or by torchrun with one process."""
    dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
