"""Data parallelism by hand: every rank holds the whole model and averages gradients with all-reduce.

- ``ddp_naive``: after the backward, one blocking all-reduce per parameter. The baseline.
- ``ddp``: gradients live in flat buckets of ``parallel.bucket_mb``, ordered as the backward produces
  them. A post-accumulate-grad hook copies each parameter's first gradient of a step into its
  slice of the bucket and makes ``.grad`` that slice (later micro-steps accumulate into it in
  place), then counts the parameter in; the moment a bucket is full its all-reduce is launched
  asynchronously, so communication overlaps the rest of the backward. Buckets are launched
  strictly in order, the same on every rank; those the hooks did not complete (a parameter unused
  in this step, whose slice is zeroed) are launched when the backward returns, and all are waited
  for before the backward call returns. Nothing is sent on the non-final micro-steps of an
  accumulation. The first synced backward records the order gradients arrive in; after that step
  the buckets are rebuilt in rank 0's recorded order.

``ddp_naive`` divides the summed gradient by the world size; ``ddp`` scales the loss by 1/N before
its backward instead, which saves a pass over the gradients. Both start from rank 0's weights
(broadcast at build). With two ranks a sum of two numbers does not depend on the order, and
halving (of the loss or of the sum) is exact, so both reproduce one process that accumulates the
same micro-batches bit for bit.

Under mixed precision (``lab.parallel.precision``) the weights and gradients are 16-bit, cast once per step from the
fp32 masters the optimizer updates, and the gradients are reduced in the policy's ``reduce_dtype`` (a copy in that
dtype where it is not theirs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.measure.placement import Costs
from lab.parallel.base import ParamGroup, Strategy
from lab.parallel.comm import Comm, InOrder, buckets


def broadcast_from_rank0(strategy: Strategy, module: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (one-time traffic, before the first step); a parameter
    averaged over other ranks than the data axis (``comm_of``), the first rank's of those."""
    with torch.no_grad():
        for name, tensor in module.named_parameters():
            comm = strategy.comm_of(name)
            with comm.paused():
                comm.broadcast(tensor.data, src=0)
        with strategy.comm.paused():
            for tensor in module.buffers():
                strategy.comm.broadcast(tensor.data, src=0)


class NaiveDDP(Strategy):
    name = "ddp_naive"

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        broadcast_from_rank0(self, module)
        return module

    def finish_backward(self, sync: bool) -> None:
        if not sync:
            return
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm_of(name).all_reduce(p.grad, dtype=self.precision.reduce_dtype)
            p.grad.div_(self.data.world_size)


@dataclass
class Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor  # the flat gradients; each parameter's .grad becomes a view into it
    comm: Comm  # the group it is all-reduced over (every parameter's ``comm_of``)


class BucketedDDP(Strategy):
    name = "ddp"
    options = Strategy.options | {"bucket_mb", "overlap"}
    costs = Costs(grads_at_rest=True)  # flat buckets live between steps
    divides_loss = True  # the loss is divided by N before its backward: the all-reduced sum is then the mean

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        broadcast_from_rank0(self, module)
        self._name_of = {id(p): name for name, p in module.named_parameters()}
        self._make_buckets(list(reversed(self.trainable)))  # backward roughly reverses registration
        self._arrivals: list[nn.Parameter] | None = []  # recorded in the first synced backward
        for p in self.trainable:
            p.register_post_accumulate_grad_hook(self._on_gradient)
        return module

    def _make_buckets(self, order: list[nn.Parameter]) -> None:
        groups = [[order[i] for i in bucket]
                  for bucket in buckets([p.numel() * p.element_size() for p in order], self.cfg.bucket_mb * 2**20,
                                        [id(self.comm_of(self._name_of[id(p)])) for p in order])]
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, int] = {}
        self._slice_of: dict[nn.Parameter, torch.Tensor] = {}
        for params in groups:
            bucket = Bucket(params, torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                                device=params[0].device), self.comm_of(self._name_of[id(params[0])]))
            offset = 0
            for p in params:
                self._slice_of[p] = bucket.buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                self._bucket_of[p] = len(self.buckets)
            self.buckets.append(bucket)
        self._launches = InOrder([len(b.params) for b in self.buckets], self._launch)

    def _launch(self, i: int) -> dist.Work:
        for p in self.buckets[i].params:
            if p.grad is None:  # unused in every micro-step of this step: its slice still holds the last step's
                self._slice_of[p].zero_()
                p.grad = self._slice_of[p]
        bucket = self.buckets[i]
        return bucket.comm.all_reduce(bucket.buffer, async_op=True, dtype=self.precision.reduce_dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        if sync:
            self._launches.start()
        return super().forward(x, y, sync=sync)

    def _on_gradient(self, p: nn.Parameter) -> None:
        place = self._slice_of[p]
        if p.grad.data_ptr() != place.data_ptr():  # the step's first gradient: into the bucket
            place.copy_(p.grad)
            p.grad = place
        if not self.syncing:
            return
        if self._arrivals is not None:
            self._arrivals.append(p)
        self._launches.arrived(self._bucket_of[p], eager=self.cfg.overlap)

    def finish_backward(self, sync: bool) -> None:
        for work in self._launches.finish() if sync else ():
            self.comm.wait(work)

    def step(self, lr: float) -> None:
        super().step(lr)
        if self._arrivals is not None:
            self._rebuild_in_arrival_order()

    def _rebuild_in_arrival_order(self) -> None:
        """Rebuild the buckets in the order rank 0 saw gradients arrive (once, after the first step)."""
        index = {p: i for i, p in enumerate(self.trainable)}
        seen = [index[p] for p in dict.fromkeys(self._arrivals)]
        order = torch.tensor(seen + [i for i in range(len(index)) if i not in set(seen)], dtype=torch.int64,
                             device=self.trainable[0].device)
        self.comm.broadcast(order, src=0)
        self._arrivals = None
        params = self.trainable
        self._make_buckets([params[i] for i in order.tolist()])
