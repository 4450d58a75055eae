"""The PyTorch implementations the hand-rolled strategies are measured against.

``torch_ddp`` is ``torch.nn.parallel.DistributedDataParallel`` with its default reducer, buckets of
``parallel.bucket_mb``, and a communication hook that does what its default hook does (divide by
the world size, all-reduce asynchronously) through the lab's counted collectives, so its bytes are
counted like everyone else's. DDP waits for its buckets inside the backward, so the time exposed
to communication is estimated as the time from the last bucket's launch (the end of the
backward's compute) to the last bucket's completion. (No ``from __future__ import annotations``
here: DDP checks the hook's annotations as objects.)
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from lab.parallel.base import Strategy


class TorchDDP(Strategy):
    name = "torch_ddp"
    options = frozenset({"bucket_mb"})

    def wrap(self, module: nn.Module) -> nn.Module:
        device_ids = [self.world.device.index] if self.world.device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=self.cfg.bucket_mb,
                                      forward_sync_buffers=False)
        ddp.register_comm_hook(state=None, hook=self._all_reduce)
        self._launched = self._done = 0.0
        return ddp

    def _all_reduce(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer().div_(self.world.world_size)
        self._launched = time.perf_counter()
        work = self.comm.all_reduce(tensor, async_op=True)

        def finished(fut: torch.futures.Future) -> torch.Tensor:
            self._done = time.perf_counter()
            return fut.value()[0]

        return work.get_future().then(finished)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        self.model.require_backward_grad_sync = sync  # what DistributedDataParallel.no_sync toggles
        return super().forward(x, y, sync=sync)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._sync:
            self.comm.add_wait(max(0.0, self._done - self._launched))
