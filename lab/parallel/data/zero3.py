"""ZeRO stage 3 by hand: the weights sharded at rest too, gathered unit by unit around each forward and backward.

The layout and the sync are the stages' shared machinery (``lab.parallel.data.zero``, whose docstring describes
all three stages); this module adds what stage 3 does beside them: the meta-device build that fills only this rank's
chunks, the gather pool, and the hooks that gather, prefetch and free each piece of the model's units.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn as nn

from lab.measure import memory
from lab.measure.placement import Costs
from lab.model.plan import segments
from lab.parallel.base import ParamGroup
from lab.parallel.data.zero import Unit, Zero, registrations
from lab.parallel.layout import World
from lab.runtime import compat


class Zero3(Zero):
    """Stage 3: see the module docstring; units are half blocks and a root unit for the rest."""

    name, stage = "zero3", 3
    costs = Costs("zero3", "zero3")
    options = Zero.options - {"bucket_mb"} | {"overlap", "reshard_after_forward"}
    compiles = False
    shards = "weights"
    builds_on_meta = True  # nothing is allocated until each rank fills its own chunks (``wrap``)

    def _initial_value(self, name: str) -> torch.Tensor:
        """The plan's initial value of ``name`` on this rank's device, added to the digest of the initial values of
        the ranks that hold the same ones (``world_of``)."""
        value = self.plan.initial_value(name).detach().to(self.data.device)
        world = self.world_of(name)
        digest = self._initial.setdefault(id(world.group), (world, hashlib.sha256()))[1]
        digest.update(name.encode())
        digest.update(value.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        return value

    def _unit_names(self, module: nn.Module, trainable: list[str]) -> list[list[str]]:
        """The pieces of the plan's units (``lab.model.plan.segments``), each one unit per data-parallel group (an
        transform may name another), then the root units: the rest (and any parameter two pieces share, as
        a tied weight), and each parameter a transform completes after the sync alone; in the order gradients
        complete."""
        canonical = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        pieces = []
        for names in segments(module, self.plan):
            mods = [module.get_submodule(n) for n in names]
            pieces.append((mods, list(dict.fromkeys(id(p) for m in mods for p in m.parameters() if p.requires_grad))))
        holders = Counter(i for _, ids in pieces for i in ids)
        self._segments: list[tuple[list[nn.Module], list[list[str]]]] = []
        for mods, ids in pieces:
            by_group: dict[int, list[str]] = {}
            for name in (canonical[i] for i in ids if holders[i] == 1):
                by_group.setdefault(id(self.comm_of(name)), []).append(name)
            if by_group:  # frozen throughout: no unit
                self._segments.append((mods, list(by_group.values())))
        in_pieces = {n for _, units in self._segments for names in units for n in names}
        apart = self.held_apart()
        rest = [n for n in trainable if n not in in_pieces and n not in apart]
        self._root_names = ([rest] if rest else []) + [[n] for n in trainable if n in apart]
        return [names for _, units in reversed(self._segments) for names in units] + self._root_names

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        """Fill buffers and frozen parameters whole, then this rank's chunks (``_place``); a digest of every initial
        value is compared across ranks."""
        self._initial: dict[int, tuple[World, object]] = {}
        for name, _ in list(module.named_buffers()):  # assigned, not .data: a meta tensor's cannot take a real one
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, self._initial_value(name))
        for name, p in list(module.named_parameters()):
            if not p.requires_grad:  # frozen: whole on every rank
                owner, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner), attr, nn.Parameter(self._initial_value(name), requires_grad=False))
        module = super().wrap(module, groups)
        for world, digest in self._initial.values():
            world.check_same(digest.hexdigest(), "the initial weights (the plan's initial_value)")
        unit_of = {name: unit for unit in self.units for name in unit.names}
        self._roots = [unit_of[names[0]] for names in self._root_names]
        self.forward_order = [[unit_of[names[0]] for names in units] for _, units in self._segments]
        sizes = [sum(u.padded for u in segment) for segment in self.forward_order]
        self.pool_budget = self.root_size() + max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))
        self.costs = dataclasses.replace(self.costs, gathers=self._gathers(), pool=self.pool_budget)
        self._spares: dict[int, list[torch.Tensor]] = {}  # idle pool buffers by their number of elements
        self._pooled = 0  # elements in pool buffers, idle or lent
        for (modules, _), segment in zip(self._segments, self.forward_order, strict=True):
            modules[0].register_forward_pre_hook(lambda mod, args, seg=segment: self._before_forward(seg, args))
            modules[-1].register_forward_hook(lambda mod, args, out, seg=segment: self._after_forward(seg, out))
        return module

    def _gathers(self) -> tuple[tuple[float, int, int], ...]:
        """(times a step, elements, group size) of each unit's all-gathers: resharding, each piece of the model's units
        twice a micro-step (M of each where a transform runs M microbatches), the root units once, less what one
        backward finds still gathered from its forward (with one microbatch, the root and the last piece); kept
        gathered, once a step."""
        pieces = {id(u) for segment in self.forward_order for u in segment}
        last = {id(u) for u in self.forward_order[-1]} if self.forward_order else set()
        out = []
        for u in self.units:
            if not self.reshards:
                times = 1
            elif self.microbatches > 1:
                times = self.loop.accum_steps * (2 * self.microbatches if id(u) in pieces else 1)
            else:
                times = self.loop.accum_steps * (1 if id(u) not in pieces or id(u) in last else 2)
            out.append((times, u.padded, u.comm.world_size))
        return tuple(out)

    def root_size(self) -> int:
        """Elements of the root units (gathered for the whole forward and backward)."""
        return sum(u.padded for u in self._roots)

    def _place(self, unit: Unit) -> None:
        """Fill this rank's chunk from the model's own init. The unit's weights are views of one flat buffer whose
        storage is empty at rest (it borrows a pool buffer's memory while gathered: ``_lend``)."""
        r, module = unit.rank, self.module
        shard = torch.zeros(unit.chunk, device=self.data.device)
        unit.flat = torch.empty(unit.padded, dtype=self.precision.param_dtype, device=self.data.device)
        holders = registrations(module)
        for i, (name, offset, shape) in enumerate(zip(unit.names, unit.offsets, unit.shapes, strict=True)):
            size = math.prod(shape)
            a, b = unit.in_chunk(r, offset, size)
            value = self._initial_value(name).flatten()
            if a < b:
                start = a + r * unit.chunk - offset
                shard[a:b] = value[start:start + b - a]
            param = nn.Parameter(torch.empty(0, device=self.data.device))
            # .data keeps the parameter's own version counter: gathering into flat does not look like an
            # in-place change of the weights autograd saved
            param.data = unit.flat[offset:offset + size].view(shape)
            for holder, attr in holders[name]:  # every module it is registered in (a tied weight: several)
                setattr(holder, attr, param)
            unit.params[i] = param
        self._keep_master(unit, shard)
        unit.shard = shard.to(self.precision.param_dtype)
        memory.tag(unit.shard, "params")
        unit.flat.untyped_storage().resize_(0)
        memory.tag(unit.flat, "params")

    # ------------------------------------------------------------ gather and free

    def _start_gather(self, unit: Unit, async_op: bool) -> None:
        self._lend(unit)
        unit.gathering = unit.comm.all_gather(unit.flat, unit.shard, async_op=async_op)
        unit.gathered = True

    def _gather(self, units: list[Unit]) -> None:
        """The units' weights, now: waits for their prefetch, or gathers them."""
        for unit in units:
            if not unit.gathered:
                self._start_gather(unit, async_op=False)
            if unit.gathering is not None:
                unit.comm.wait(unit.gathering)
                unit.gathering = None

    def _prefetch(self, units: list[Unit]) -> None:
        """Launch the units' all-gathers asynchronously (they overlap the compute until ``_gather`` waits)."""
        for unit in units:
            if not unit.gathered:
                self._start_gather(unit, async_op=True)

    def _free(self, units: list[Unit]) -> None:
        """Release the gathered weights: the storage goes back to the allocator (saved views of it stay valid
        and see the weights again once the unit is gathered for its backward)."""
        for unit in units:
            if not unit.gathered:
                continue
            if unit.gathering is not None:
                unit.comm.wait(unit.gathering)
                unit.gathering = None
            self._take_back(unit)
            unit.gathered = False

    def _lend(self, unit: Unit) -> None:
        """Give flat's storage memory for the whole unit: an idle pool buffer's of its size (its pages stay mapped
        between gathers, so gathering into them does not fault them in again), else a new pool buffer if the pool,
        rid of idle buffers of other sizes, has room for it within ``pool_budget``, else fresh memory. The storage
        swaps data pointers with the buffer, so the views autograd saved see the weights wherever they lie."""
        spares = self._spares.setdefault(unit.padded, [])
        if compat.SWAPS_STORAGE and not spares:
            for size, idle in self._spares.items():
                while idle and self._pooled + unit.padded > self.pool_budget:
                    idle.pop()
                    self._pooled -= size
            if self._pooled + unit.padded <= self.pool_budget:
                spares.append(torch.empty(unit.padded, dtype=unit.shard.dtype, device=self.data.device))
                memory.tag(spares[-1], "params")
                self._pooled += unit.padded
        if spares:
            unit.lent = spares.pop()
            compat.swap_storage(unit.flat.untyped_storage(), unit.lent.untyped_storage())
        else:
            unit.flat.untyped_storage().resize_(unit.padded * unit.shard.element_size())

    def _take_back(self, unit: Unit) -> None:
        """flat's storage gives its memory back: to the pool buffer it came from, or to the allocator."""
        if unit.lent is None:
            unit.flat.untyped_storage().resize_(0)
            return
        compat.swap_storage(unit.flat.untyped_storage(), unit.lent.untyped_storage())
        self._spares[unit.padded].append(unit.lent)
        unit.lent = None

    def _next(self, segment: list[Unit], step: int) -> list[Unit]:
        """The units of the piece ``step`` places after ``segment`` in the forward order (none past either end)."""
        i = self.forward_order.index(segment) + step
        return self.forward_order[i] if 0 <= i < len(self.forward_order) else []

    def _before_forward(self, segment: list[Unit], args: tuple) -> tuple | None:
        self._gather(segment)
        if compat.in_backward():  # a recomputation inside the backward
            return None
        self._prefetch(self._next(segment, +1))
        if self.reshards and self.microbatches > 1 and torch.is_grad_enabled() and args[0].requires_grad:
            # several backwards a micro-step: each frees the piece once its gradient passed the piece's input
            return (_AfterBackward.apply(args[0], lambda: self._free(segment)), *args[1:])
        return None

    def _after_forward(self, segment: list[Unit], out: torch.Tensor) -> None:
        if compat.in_backward():  # a recomputation inside the backward: keep them
            return
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad: (self._before_backward(segment), grad)[1])
            if not self.reshards:  # kept until the step's last backward
                return
            if self.microbatches == 1 and segment is self.forward_order[-1]:  # the backward starts with it: kept
                return
        self._free(segment)

    def _before_backward(self, segment: list[Unit]) -> None:
        self._gather(segment)
        self._prefetch(self._next(segment, -1))

    def _unit_done(self, unit: Unit) -> None:
        if unit not in self._roots and self.reshards and self.microbatches == 1:  # the roots stay for the micro-step
            self._free([unit])

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        self._gather(self._roots)
        self._prefetch(self.forward_order[0] if self.forward_order else [])
        loss = super().forward(x, y, sync=sync)
        if not (torch.is_grad_enabled() and loss.requires_grad):  # else kept for the backward, which starts with it
            self._free(self._roots)
        return loss

    def finish_backward(self, sync: bool) -> None:
        super().finish_backward(sync)
        if self.reshards or sync:  # units with a parameter unused in this micro-step are still gathered
            self._free(self.units)


class _AfterBackward(torch.autograd.Function):
    """Identity forward; once the gradient reaches this input, ``then()`` (a piece's weights are no longer needed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, then: Callable[[], None]) -> torch.Tensor:
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.then()
        return grad, None
