"""ZeRO by hand: optimizer states (stage 1), then gradients (2), then parameters (3) sharded over ranks.

The layout is shared by the three stages. Trainable parameters are grouped into **units**; a unit's
parameters are laid end to end (the weight-decay group first), padded to a multiple of the world
size N, and rank r owns chunk r. The optimizer works on views of this rank's chunks, split where
the parameter group changes, so weight decay is decided by name before anything is flattened.
Frozen parameters and buffers stay whole on every rank (stages 1-2 broadcast them from rank 0
with the trainable weights, so every rank starts from the same values).

- ``zero1``: units are buckets of ``parallel.bucket_mb`` in backward order. Every rank keeps the
  whole weights and whole gradients (each ``.grad`` a view into its unit's flat buffer). After the
  backward each unit is reduce-scattered in place: this rank's chunk of the flat gradient becomes
  the average. The optimizer updates this rank's chunk of the weights; an all-gather per unit
  brings every rank the updated weights. Adam's states exist for 1/N of the model.
- ``zero2``: as zero1, but gradients are not kept whole. A post-accumulate-grad hook adds each
  gradient into its unit's flat buffer and drops it; the moment a unit is complete its
  reduce-scatter is launched asynchronously into the unit's gradient shard (overlapping the rest
  of the backward), and the unit's whole gradient is freed as soon as it completes: at most one
  reduce-scatter is left in flight while the next unit fills. Units are launched in order, the
  same on every rank.
- ``zero3``: also the weights are sharded at rest. The model is built on the meta device and each
  rank fills only its chunks from the model's ``initial_value`` (a digest of every initial value
  is compared across ranks): the whole model never exists on a rank. A unit's weights are views
  of one flat buffer whose storage holds no memory at rest, so the tensors autograd saves
  (``weight.t()``) hold none and at most one gathered copy of a unit exists. Gathered, the storage
  borrows the memory of a resident pool buffer of its size (data pointers swapped in and back
  out), so a gather writes into pages already mapped instead of fresh ones. The pool holds at most
  what is gathered at once: the root unit and the two largest neighbours in the forward order.
  Each piece of a unit of the model's plan is a unit (``lab.model.plan.segments``; in the GPT each
  half block: the attention with the norm before it, the MLP with its own): gathered (all-gather)
  just before its forward, while the next unit's all-gather is launched asynchronously (prefetch),
  freed right after; gathered again when the gradient reaches its output (the unit before it
  prefetched), its gradients reduce-scattered and its weights freed once they are all in. Half
  blocks rather than blocks: what is in flight at the backward's peak (the unit at work, the
  prefetched one, the gradient buffer filling and the one being reduce-scattered) is about half as
  large (the 85M model's peak resident set: 1,140 -> 1,106 MiB). The rest of the model (embeddings,
  final norm, head), and any weight two pieces share (a tied one), is one root unit, gathered for
  the forward (a model with no such weight has none). The backward starts where the forward ends:
  the root unit and the last block unit stay gathered into it (their pool buffers would lie idle
  meanwhile) instead of being freed and
  gathered again. The optimizer updates the shards in place, so no all-gather follows the step.
  Where a transform runs several forwards and backwards a micro-step (a stage's microbatches,
  ``Strategy.microbatches``), each piece is freed after each forward and once its gradient has passed
  its input in each backward (``_AfterBackward``): 2M gathers a micro-step. With
  ``parallel.reshard_after_forward`` false (the default then) every unit stays gathered from its first use to the
  step's last backward: one gather a step.

Every unit holds the parameters of one data-parallel group (``comm_of``): its ranks share it (a
transform may average some parameters over other ranks than the data axis). A parameter a transform
completes after the sync (``held_apart``: summed between two ranks of another axis) is a unit alone,
laid out alike wherever it is held, so the two ranks add the same shard.

On the non-final micro-steps of an accumulation nothing is sent: gradients accumulate whole in
the units' flat buffers (zero2 and zero3 then hold a whole gradient until the last micro-step).

``parallel.offload optimizer`` moves the update to the host: an fp32 master copy of this rank's
chunks and Adam's moments live in host memory, the averaged gradient chunk is copied there, the
optimizer runs there, and the result is copied back (ZeRO-Offload). On a machine without an
accelerator it runs for correctness; the meters place these bytes on the host.

Under mixed precision (``train.precision mixed``) the weights (the flat units, the shards and what is gathered)
and the gradients are 16-bit, as the ZeRO paper's rows count them: each rank keeps the fp32 master of its chunks
beside Adam's moments (the master the offload keeps, on the device unless offloaded), the optimizer updates it
from an fp32 copy of the averaged gradient chunk, and the chunk's 16-bit weights are cast from it. So the
reduce-scatters run in the policy's ``reduce_dtype`` and the all-gathers (after the step in stages 1-2, of each
unit in stage 3) move 16-bit weights: half of fp32's bytes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.measure import memory
from lab.measure.placement import Costs

from lab.runtime.checkpoint import overlap
from lab.parallel.axes import GroupReplicas
from lab.parallel.base import ParamGroup, Strategy
from lab.parallel.holding import MOMENTUM, Piece
from lab.parallel.comm import Comm, Exchange, InOrder, SummedOnWait, buckets
from lab.parallel.data.ddp import broadcast_from_rank0

HOST = torch.device("cpu")


@dataclass
class Unit:
    """Trainable parameters sharded together; rank r owns elements [r·chunk, (r+1)·chunk) of the flat layout."""

    names: list[str]
    params: list[nn.Parameter]
    shapes: list[torch.Size]
    groups: list[int]  # optimizer group of each parameter (decay group first)
    offsets: list[int]
    numel: int
    chunk: int  # elements per rank
    padded: int  # chunk × world size
    shard: torch.Tensor | None = None  # this rank's chunk of the weights (a view into flat for stages 1-2)
    flat: torch.Tensor | None = None  # all the weights: stages 1-2 always, stage 3 while gathered
    flat_grad: torch.Tensor | None = None  # all the gradients, accumulated until reduce-scattered
    written: list[bool] = field(default_factory=list)  # stages 2-3: which parameters' slices of flat_grad hold one
    grad_shard: torch.Tensor | None = None  # this rank's chunk of the averaged gradient
    master: torch.Tensor | None = None  # offload or mixed precision: the shard's fp32 master (offloaded: on the host)
    gathered: bool = False  # stage 3: flat's storage holds the weights (or an all-gather into it is under way)
    gathering: dist.Work | Exchange | None = None  # stage 3: the prefetch's all-gather, until waited
    lent: torch.Tensor | None = None  # stage 3: the pool's buffer whose memory flat's storage holds while gathered
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (group, lo, hi) within the chunk
    rank: int = 0  # this rank's place among those sharing the unit (the data axis, or a transform's: ``comm_of``)
    comm: Comm | None = None  # their collectives

    def in_chunk(self, rank: int, offset: int, size: int) -> tuple[int, int]:
        """Which elements of rank ``rank``'s chunk hold those of the parameter laid at ``offset`` (``size`` long), as
        a range of the chunk (empty: none)."""
        start = rank * self.chunk
        lo, hi = overlap((offset, offset + size), (start, start + self.chunk))
        return lo - start, hi - start


def make_unit(names: list[str], params: dict[str, nn.Parameter], group_of: dict[str, int], rank: int,
              world_size: int) -> Unit:
    names = sorted(names, key=lambda n: group_of[n])  # stable: decay group first, then the rest
    shapes = [params[n].shape for n in names]
    sizes = [math.prod(s) for s in shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    numel = sum(sizes)
    chunk = -(-numel // world_size)
    unit = Unit(names, [params[n] for n in names], shapes, [group_of[n] for n in names], offsets, numel, chunk,
                chunk * world_size, rank=rank)
    for name, offset, size in zip(names, offsets, sizes, strict=True):
        a, b = unit.in_chunk(rank, offset, size)
        if a < b:
            g = group_of[name]
            if unit.pieces and unit.pieces[-1][0] == g and unit.pieces[-1][2] == a:
                unit.pieces[-1] = (g, unit.pieces[-1][1], b)
            else:
                unit.pieces.append((g, a, b))
    return unit


def registrations(module: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Each parameter, under its first name, and every (module, attribute) that holds it (a tied weight: several)."""
    first: dict[int, str] = {}
    out: dict[str, list[tuple[nn.Module, str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        out.setdefault(first.setdefault(id(p), name), []).append((module.get_submodule(owner), attr))
    return out


class Zero(Strategy):
    """The machinery the three stages share; ``stage`` picks what is sharded."""

    stage = 0
    options = Strategy.options | {"bucket_mb", "offload"}
    keeps_own_masters = True  # the units keep the masters of this rank's chunks (``_keep_master``)
    divides_loss = True  # the reduce-scattered sum is then the average, without a pass over the shards

    def held_apart(self) -> set[str]:
        """Parameters the transforms complete after the sync (a weight two ranks of another axis hold)."""
        return {name for transform in self.transforms for name in transform.held_apart()}

    @property
    def offloaded(self) -> bool:
        return self.cfg.offload == "optimizer"

    # ------------------------------------------------------------ layout

    def _unit_names(self, module: nn.Module, trainable: list[str]) -> list[list[str]]:
        """Buckets of ``bucket_mb`` in backward order (reverse registration), each over one data-parallel group (an
        transform may name another); a parameter a transform completes after the sync (``held_apart``) is a unit
        alone, laid out alike on every rank that holds it. Stage 3 overrides."""
        params, apart = dict(module.named_parameters()), self.held_apart()
        order = [n for n in reversed(trainable) if n not in apart]
        sizes = [params[name].numel() * params[name].element_size() for name in order]
        kinds = [id(self.comm_of(name)) for name in order]
        return [[order[i] for i in bucket] for bucket in buckets(sizes, self.cfg.bucket_mb * 2**20, kinds)] + \
            [[name] for name in trainable if name in apart]

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        group_of = {n: i for i, g in enumerate(groups) for n in g.names}
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        missing = [n for n in trainable if n not in group_of]
        if missing:
            raise ValueError(f"trainable parameters in no optimizer group: {', '.join(missing)}")
        if self.stage < 3:  # every rank starts from rank 0's weights, frozen ones and buffers included
            broadcast_from_rank0(self, module)
        params = dict(module.named_parameters())
        self.units = []
        for names in self._unit_names(module, trainable):
            comm = self.comm_of(names[0])
            self.units.append(make_unit(names, params, group_of, comm.rank, comm.world_size))
            self.units[-1].comm = comm
        for unit in self.units:
            self._place(unit)
        self._unit_of = {id(p): (k, i) for k, u in enumerate(self.units) for i, p in enumerate(u.params)}
        self._launches = InOrder([len(u.params) for u in self.units], self._reduce_scatter)
        self._in_flight: deque[tuple[Unit, dist.Work | SummedOnWait]] = deque()  # launched, not yet settled
        self._spare: torch.Tensor | None = None  # the last settled unit's gradient buffer
        if self.stage >= 2:
            for unit in self.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(self._on_gradient)
        synced: dict[int, int] = {}
        for u in self.units:  # each unit as the flat layout sends it: rounded up to a multiple of its group's size
            synced[u.comm.world_size] = synced.get(u.comm.world_size, 0) + u.padded
        self.costs = Costs(self.name, self.name, tuple(synced.items()), offloaded=self.offloaded,
                           grads_at_rest=self.stage == 1, accumulates_whole=self.stage > 1,
                           units=tuple(u.padded for u in self.units), chunks=tuple(u.chunk for u in self.units))
        return module

    def _keep_master(self, unit: Unit, chunk: torch.Tensor) -> None:
        """The fp32 master of this rank's ``chunk`` of the unit, where the update needs one apart from the weights: on
        the host when offloaded, on the device under mixed precision."""
        if self.offloaded or self.precision.mixed:
            unit.master = chunk.detach().to(HOST if self.offloaded else self.data.device, torch.float32, copy=True)
            memory.tag(unit.master, "optimizer")

    def _place(self, unit: Unit) -> None:
        """Stages 1-2: the unit's weights move into one flat buffer of the policy's ``param_dtype`` (the parameters
        become views of it), after this rank's chunk of them gave its master."""
        whole = torch.zeros(unit.padded, dtype=unit.params[0].dtype, device=self.data.device)
        for p, offset in zip(unit.params, unit.offsets, strict=True):
            whole[offset:offset + p.numel()].copy_(p.detach().flatten())
        r = unit.rank
        self._keep_master(unit, whole[r * unit.chunk:(r + 1) * unit.chunk])
        unit.flat = whole.to(self.precision.param_dtype)
        memory.tag(unit.flat, "params")
        for p, offset in zip(unit.params, unit.offsets, strict=True):
            p.data = unit.flat[offset:offset + p.numel()].view(p.shape)
        unit.shard = unit.flat[r * unit.chunk:(r + 1) * unit.chunk]
        if self.stage == 1:
            unit.flat_grad = torch.zeros_like(unit.flat)
            for p, offset in zip(unit.params, unit.offsets, strict=True):
                p.grad = unit.flat_grad[offset:offset + p.numel()].view(p.shape)

    def optimizer_groups(self, groups: list[ParamGroup]) -> list[dict]:
        """Each group's tensors: views of this rank's chunks (of the host master copy when offloaded)."""
        self._muon_groups = {i for i, g in enumerate(groups) if g.muon}  # their moment is Muon's
        self.optimizer_pieces: list[tuple[Unit, int, int, torch.Tensor]] = []
        per_group: list[list[torch.Tensor]] = [[] for _ in groups]
        for unit in self.units:
            weights = unit.master if unit.master is not None else unit.shard
            for g, lo, hi in unit.pieces:
                piece = weights[lo:hi]
                self.optimizer_pieces.append((unit, lo, hi, piece))
                per_group[g].append(piece)
        return [{"params": ps, **g.options()} for g, ps in zip(groups, per_group, strict=True) if ps]

    # ------------------------------------------------------------ gradients

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        if sync:
            self._launches.start()
        self._missing = [len(u.params) for u in self.units]  # gradients each unit still waits for
        return super().forward(x, y, sync=sync)

    def _on_gradient(self, p: nn.Parameter) -> None:
        """Stages 2-3: move a finished gradient into its unit's flat buffer; launch full units in order."""
        k, i = self._unit_of[id(p)]
        unit = self.units[k]
        if unit.flat_grad is None:
            unit.flat_grad = self._gradient_buffer(unit, p.dtype)
        memory.tag(p.grad, "grads")
        place = unit.flat_grad[unit.offsets[i]:unit.offsets[i] + p.numel()]
        if unit.written[i]:  # a later micro-step of an accumulation
            place.add_(p.grad.flatten())
        else:  # the buffer's first gradient for this parameter: copied, so the buffer needs no zeroing
            place.copy_(p.grad.flatten())
            unit.written[i] = True
        p.grad = None
        self._missing[k] -= 1
        if self._missing[k] == 0:
            self._unit_done(unit)
        if self.syncing:
            self._launches.arrived(k, eager=self.cfg.overlap)
            self._settle(in_flight=1)

    def _gradient_buffer(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for a unit's whole gradient, its padding zeroed (each parameter's slice is written by its first
        gradient, or zeroed at the reduce-scatter if none came): the one the last settled reduce-scatter left if it
        is of this size (stages 2-3), or a new one. Reused, its pages are not faulted in again (a new buffer of 1 MiB
        or more is a fresh mapping: see ``lab.measure.memory``); it stands in for the one just freed, so the peak
        does not grow."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == unit.padded and spare.dtype == dtype:
            buffer = spare
        else:
            buffer = torch.empty(unit.padded, dtype=dtype, device=self.data.device)
        buffer[unit.numel:].zero_()
        unit.written = [False] * len(unit.params)
        memory.tag(buffer, "grads")
        return buffer

    def _unit_done(self, unit: Unit) -> None:
        """All of a unit's gradients of this micro-step are in (stage 3 frees its weights here)."""

    def _reduce_scatter(self, k: int) -> None:
        """Launch unit k's reduce-scatter: in place for stage 1 (this rank's chunk of the whole gradient buffer),
        into the unit's own gradient shard for stages 2-3 (the whole gradient is freed once it completes). Its
        handle is kept only until settled: a handle keeps the backend's copy of the input alive."""
        unit = self.units[k]
        r = unit.rank
        if unit.flat_grad is None:  # no parameter of the unit was used in this step
            unit.flat_grad = self._gradient_buffer(unit, unit.shard.dtype)
        for i in [i for i, written in enumerate(unit.written) if not written]:  # unused in this step: a zero gradient
            unit.flat_grad[unit.offsets[i]:unit.offsets[i] + unit.params[i].numel()].zero_()
        if self.stage == 1:
            unit.grad_shard = unit.flat_grad[r * unit.chunk:(r + 1) * unit.chunk]
        else:
            unit.grad_shard = torch.empty(unit.chunk, dtype=unit.flat_grad.dtype, device=self.data.device)
            memory.tag(unit.grad_shard, "grads")
        self._in_flight.append((unit, unit.comm.reduce_scatter(unit.grad_shard, unit.flat_grad, async_op=True,
                                                               dtype=self.precision.reduce_dtype)))
        self._settle(in_flight=1)  # also when the backward's end launches many at once (stage 1)

    def _settle(self, in_flight: int) -> None:
        """Finish the reduce-scatters that are done, and wait for the oldest until at most ``in_flight`` remain:
        (stages 2-3) each finished unit's whole gradient is freed, the buffer kept for the next unit's gradient (one
        buffer, until the backward ends)."""
        while self._in_flight and (len(self._in_flight) > in_flight or self._in_flight[0][1].is_completed()):
            unit, work = self._in_flight.popleft()
            unit.comm.wait(work)
            if self.stage > 1:
                self._spare = unit.flat_grad
                unit.flat_grad = None

    def finish_backward(self, sync: bool) -> None:
        """Synced: launch what the backward's hooks left (stage 1: everything) and wait for every reduce-scatter."""
        if not sync:
            return
        self._launches.finish()
        self._settle(in_flight=0)
        self._spare = None

    def optimizer_gradients(self) -> None:
        """The optimizer's pieces take their gradients from the averaged shards: views, or copies where the piece is a
        master elsewhere or of another dtype (offloaded, mixed precision)."""
        for unit, lo, hi, piece in self.optimizer_pieces:
            grad = unit.grad_shard[lo:hi]
            same = grad.device == piece.device and grad.dtype == piece.dtype
            piece.grad = grad if same else grad.to(piece.device, piece.dtype)

    # ------------------------------------------------------------ the step

    def zero_grad(self) -> None:
        for _, _, _, piece in self.optimizer_pieces:
            piece.grad = None
        for unit in self.units:
            unit.grad_shard = None
            if self.stage == 1:
                unit.flat_grad.zero_()
            else:
                unit.flat_grad = None

    # ------------------------------------------------------------ state and meters

    def holding(self) -> list[Piece]:
        """Each trainable parameter's range in this rank's chunks (weights from the shard, gradients from the
        averaged shard, moments from the optimizer's piece that holds it); frozen parameters whole. An empty range is
        an empty view of the shard, so the shard's bytes count even when all of this rank's chunk is padding. Where
        the update keeps masters, each piece names its range of them."""
        starts = {id(unit): [lo for u, lo, _, _ in self.optimizer_pieces if u is unit] for unit in self.units}
        piece_at = {(id(unit), lo): piece for unit, lo, _, piece in self.optimizer_pieces}
        out = []
        for unit in self.units:
            for name, offset, shape, g in zip(unit.names, unit.offsets, unit.shapes, unit.groups, strict=True):
                size = math.prod(shape)
                a, b = unit.in_chunk(unit.rank, offset, size)
                master = unit.master
                keys = MOMENTUM if g in self._muon_groups else Piece.moment_keys
                if a >= b:  # empty views: the shards' bytes still count
                    grad = None if unit.grad_shard is None else unit.grad_shard[:0]
                    out.append(Piece(name, size, 0, unit.shard[:0], grad, sharded=True, shape=tuple(shape),
                                     master=None if master is None else master[:0], moment_keys=keys))
                    continue
                first = max(lo for lo in starts[id(unit)] if lo <= a)  # the optimizer's piece that holds it
                grad = None if unit.grad_shard is None else unit.grad_shard[a:b]
                moments = self.optimizer.state.get(piece_at[(id(unit), first)]) or None
                out.append(Piece(name, size, a + unit.rank * unit.chunk - offset, unit.shard[a:b], grad, moments,
                                 a - first, sharded=True, shape=tuple(shape),
                                 master=None if master is None else master[a:b], moment_keys=keys))
        return out + [Piece(name, p.numel(), 0, p.detach().view(-1), shape=tuple(p.shape),
                            replicas=GroupReplicas(self.data)) for name, p in self.module.named_parameters()
                      if not p.requires_grad]

    @torch.no_grad()
    def restore_derived(self) -> None:
        """The shards follow the updated or loaded masters, if any (the weights the model computes with are cast from
        them), and (stages 1-2) every rank's updated chunk goes into every rank's flat weights, in place."""
        for unit in self.units:
            if unit.master is not None:
                unit.shard.copy_(unit.master)
            if self.stage < 3:
                unit.comm.all_gather(unit.flat, unit.shard)


class Zero1(Zero):
    name, stage = "zero1", 1
    shards = "optimizer"
    costs = Costs("zero1", "zero1")  # before ``wrap`` lays the units out


class Zero2(Zero):
    name, stage = "zero2", 2
    options = Zero.options | {"overlap"}
    shards = "gradients"
    costs = Costs("zero2", "zero2")
