"""The PyTorch implementations the hand-rolled strategies are measured against: DDP and FSDP2.

``torch_ddp`` is ``torch.nn.parallel.DistributedDataParallel`` with its default reducer, buckets of
``parallel.bucket_mb``, and a communication hook that does what its default hook does (divide by
the world size, all-reduce asynchronously) through the lab's counted collectives, so its bytes are
counted like everyone else's (in the policy's ``reduce_dtype``: a copy in it where the weights' dtype is another).
DDP waits for its buckets inside the backward, so the time exposed
to communication is estimated as the time from the last bucket's launch (the end of the
backward's compute) to the last bucket's completion. Under mixed precision DDP holds 16-bit weights and the
optimizer their fp32 masters, as ``ddp``'s (``lab.parallel.precision``). (No ``from __future__ import annotations``
here: DDP checks the hook's annotations as objects.)
"""

import contextlib
import dataclasses
import functools
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from lab.measure.placement import Costs
from lab.parallel.base import ParamGroup, Strategy
from lab.parallel.data.ddp import broadcast_from_rank0
from lab.parallel.holding import Piece
from lab.parallel.layout import World
from lab.runtime import compat


class TorchDDP(Strategy):
    name = "torch_ddp"
    options = Strategy.options | {"bucket_mb"}

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        device_ids = [self.data.device.index] if self.data.device.type == "cuda" else None
        # weights averaged over other ranks than the data axis (``comm_of``) are synced by hand
        self._apart = [(name, p) for name, p in module.named_parameters() if self.world_of(name) is not self.data]
        if self._apart:
            compat.ddp_ignore(module, [name for name, _ in self._apart])
            broadcast_from_rank0(self, module)
        ddp = DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=self.cfg.bucket_mb,
                                      process_group=self.data.group, **compat.ddp_without_buffer_sync())
        ddp.register_comm_hook(state=None, hook=self._all_reduce)
        self._launched = self._done = 0.0
        self._ddp, self._readied = ddp, False
        return ddp

    def _all_reduce(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer().div_(self.data.world_size)
        wire = tensor.to(self.precision.reduce_dtype)
        self._launched = time.perf_counter()
        work = self.comm.all_reduce(wire, async_op=True)

        def finished(fut: torch.futures.Future) -> torch.Tensor:
            self._done = time.perf_counter()
            return tensor.copy_(wire) if wire is not tensor else fut.value()[0]

        return work.get_future().then(finished)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        self._ddp.require_backward_grad_sync = sync  # what DistributedDataParallel.no_sync toggles
        return super().forward(x, y, sync=sync)

    def autograd_context(self) -> contextlib.AbstractContextManager:
        """Where a transform calls the model's methods in place of DDP's forward, the reducer is readied for the
        step's last backward here, as DDP's forward would have."""
        bypassed = any(t.entry_points() for t in self.transforms)
        if self.syncing and bypassed and not self._readied:  # once, for the step's last backward
            compat.ddp_expect_backward(self._ddp)
            self._readied = True
        return contextlib.nullcontext()

    def finish_backward(self, sync: bool) -> None:
        if not sync:
            return
        self._readied = False
        self.comm.add_wait(max(0.0, self._done - self._launched))
        for name, p in self._apart:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm_of(name).all_reduce(p.grad, dtype=self.precision.reduce_dtype)
            p.grad.div_(self.data.world_size)


class FSDP(Strategy):
    """PyTorch FSDP2: ``fully_shard`` on every unit of the model's plan and at the root, the reference for the
    ZeRO stages.

    Built on the meta device and materialised shard by shard from the plan's ``initial_value``. Under mixed precision
    its ``MixedPrecisionPolicy``: the fp32 shards at rest are the masters, gathered as ``param_dtype`` for each unit's
    forward and backward, the gradients reduce-scattered in ``reduce_dtype`` and kept as fp32 shards.
    ``parallel.reshard_after_forward`` (``reshards``) true frees each block's gathered weights after its forward and
    its backward (ZeRO-3-like); false keeps them until the step's last backward (ZeRO-2-like traffic, more memory).
    ``parallel.offload optimizer`` applies ``CPUOffloadPolicy``: sharded weights, gradients and
    optimizer states live on the host. Gradient sync on the last accumulation micro-step only
    (``set_requires_gradient_sync``). Traffic is counted by wrapping the collectives FSDP calls.
    """

    name = "fsdp"
    options = Strategy.options | {"offload", "reshard_after_forward"}
    shards = "weights"
    builds_on_meta = True
    keeps_own_masters = True  # its fp32 shards are the masters (``MixedPrecisionPolicy``)
    costs = Costs("zero3", "zero3", fp32_states=True)  # fp32 shards at rest under any policy

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        mesh = self.data.device_mesh or init_device_mesh(self.data.device.type, (self.data.world_size,))
        offload = self.cfg.offload == "optimizer"
        policy = CPUOffloadPolicy(pin_memory=self.data.device.type == "cuda") if offload else OffloadPolicy()
        mixed = MixedPrecisionPolicy(self.precision.param_dtype, self.precision.reduce_dtype) \
            if self.precision.mixed else MixedPrecisionPolicy()
        shard = functools.partial(fully_shard, reshard_after_forward=self.reshards, offload_policy=policy,
                                  mp_policy=mixed)
        # every module fully_shard was applied to, whether it keeps its gathered weights from its forward to its
        # backward, the root last
        self.shards: list[tuple[str, World, bool]] = []
        for name, world in self._held_apart(module):  # sharded over their own ranks, averaged over the data axis
            sub = module.get_submodule(name)
            shard(sub, mesh=world.device_mesh)
            sub.set_gradient_divide_factor(self.data.world_size)
            # summed, then divided: gloo has no pre-scaled sum (on one rank FSDP only divides, and would twice)
            sub.set_force_sum_reduction_for_comms(world.world_size > 1)
            self.shards.append((name, world, not self.reshards))
        for name in self.plan.units:
            shard(module.get_submodule(name), mesh=mesh)
            self.shards.append((name, self.data, not self.reshards))
        shard(module, mesh=mesh)
        self.shards.append(("", self.data, not self.reshards))
        for transform in self.transforms:  # methods a transform calls in place of the forward gather too
            for method in transform.entry_points():
                register_fsdp_forward_method(module, method)
        module.to_empty(device=torch.device("cpu") if offload else self.data.device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                full = self.plan.initial_value(name).to(mesh.device_type)
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
            for name, b in module.named_buffers():
                b.copy_(self.plan.initial_value(name))
        self.costs = self._placed(module)
        return module

    def gradient_leaves(self) -> list[tuple[str, torch.Tensor]]:
        """The unsharded parameters FSDP computes with and autograd reaches (not its shards): made by one gather of
        each sharded module, freed at once, and kept by FSDP for every later gather."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        leaves = []
        for name, _, _ in self.shards:
            sub = self.module.get_submodule(name) if name else self.module
            sub.unshard()
            group = sub._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group is not None else []:
                if param.sharded_param.requires_grad:
                    leaves.append((names[id(param.sharded_param)], param._unsharded_param))
            sub.reshard()
        return leaves

    def _placed(self, module: nn.Module) -> Costs:
        """The record of its placement: each module ``fully_shard`` was applied to as FSDP sends it (each parameter's
        first dimension padded to a multiple of its group's size), reduce-scattered once a step and gathered as FSDP2
        gathers it: resharding, for every forward and backward (M of each a micro-step where a transform runs M
        microbatches; once a forward where it keeps them for its backward), else once a step."""
        seen: set[int] = set()
        synced: dict[int, int] = {}
        gathers = []
        for name, world, kept in self.shards:
            n = world.world_size
            params = [p for p in (module.get_submodule(name) if name else module).parameters()
                      if p.requires_grad and id(p) not in seen]
            seen |= {id(p) for p in params}
            elements = sum(-(-p.shape[0] // n) * n * (p.numel() // p.shape[0]) for p in params)
            synced[n] = synced.get(n, 0) + elements
            times = self.loop.accum_steps * self.microbatches * (1 if kept else 2) if self.reshards else 1
            gathers.append((times, elements, n))
        return dataclasses.replace(self.costs, traffic="zero3" if self.reshards else "zero2",
                                   synced=tuple(synced.items()), gathers=tuple(gathers))

    def _held_apart(self, module: nn.Module) -> list[tuple[str, World]]:
        """The largest submodules with a forward whose weights all average over other ranks than the data axis (a
        transform's), with those ranks."""
        found: list[tuple[str, World]] = []
        for name, sub in module.named_modules():
            if type(sub).forward is nn.Module.forward:  # a container (ModuleList): its children are sharded
                continue
            worlds = {id(w): w for w in (self.world_of(f"{name}.{n}" if name else n)
                                         for n, _ in sub.named_parameters())}
            if len(worlds) == 1 and next(iter(worlds.values())) is not self.data and \
                    not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, next(iter(worlds.values()))))
        return found

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """Kept gathered for the backward (``reshards`` false), the weights a forward without one gathered (an
        evaluation) are freed after it: the shards at rest are what the norm, checkpoints and exports read."""
        self.module.set_requires_gradient_sync(sync)
        with self.comm.counting_torch():
            loss = super().forward(x, y, sync=sync)
        if not self.reshards and not torch.is_grad_enabled():
            for name, _, _ in self.shards:
                (self.module.get_submodule(name) if name else self.module).reshard()
        return loss

    def autograd_context(self) -> contextlib.AbstractContextManager:
        """A transform may run several backwards per micro-step: gradients reduce-scatter on the last of them
        (``syncing``) only."""
        self.module.set_requires_gradient_sync(self.syncing)
        if not self.reshards:  # gathered weights kept until the step's last backward
            self.module.set_reshard_after_backward(self.syncing)
        return self.comm.counting_torch()

    def _start(self, name: str, param: nn.Parameter) -> int:
        """Where this rank's rows of ``param`` start in the flattened parameter (FSDP shards dim 0 as torch.chunk
        does, over ``world_of(name)``)."""
        world = self.world_of(name)
        rows, n = param.shape[0], world.world_size
        return min(world.rank * -(-rows // n), rows) * (param.numel() // rows)

    def holding(self) -> list[Piece]:
        """Each parameter's rows on this rank (the DTensors' local parts): weights, gradients and moments."""
        out = []
        for name, p in self.module.named_parameters():
            moments = self.optimizer.state.get(p) or None
            if moments is not None:
                moments = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in moments.items()}
            grad = None if p.grad is None else p.grad.to_local().reshape(-1)
            out.append(Piece(name, p.numel(), self._start(name, p), p.detach().to_local().view(-1), grad, moments,
                             sharded=True, shape=tuple(p.shape)))
        return out
