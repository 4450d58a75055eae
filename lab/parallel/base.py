"""The interface every parallelism strategy implements; the training loop sees only this."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.config import ConfigError

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass(frozen=True)
class World:
    """Where this process sits: rank, world size and device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Strategy:
    """How a model is placed, how its gradients are synchronised and how the optimizer steps.

    Subclasses override what they change; the defaults are plain single-process training.
    Lifecycle: ``wrap`` the model, ``make_optimizer``, then per step: forward/backward inside
    ``sync_gradients(last_micro_step)``, ``clip_grad_norm``, ``step``.
    """

    name = "base"
    max_world_size: int | None = None

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        if cls.max_world_size is not None and world_size > cls.max_world_size:
            raise ConfigError(f"strategy '{cls.name}' runs on at most {cls.max_world_size} process(es), "
                              f"got world size {world_size}")

    def __init__(self, world: World):
        self.check_world_size(world.world_size)
        self.world = world
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        """Place the model on the device (and broadcast or shard it); returns the model to call."""
        self.model = model.to(self.world.device)
        return self.model

    def make_optimizer(self, factory: OptimizerFactory, param_groups: list[dict]) -> torch.optim.Optimizer:
        self.optimizer = factory(param_groups)
        return self.optimizer

    @contextlib.contextmanager
    def sync_gradients(self, enabled: bool) -> Iterator[None]:
        """Context for one micro-step's forward and backward; ``enabled`` on the last one."""
        yield

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm before clipping (clipping skipped when max_norm is 0)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over ranks (the loss everyone logs)."""
        if self.world.world_size == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world.world_size

    def state_dict(self) -> dict:
        """What a checkpoint needs from this rank: model and optimizer states."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
