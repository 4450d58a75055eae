"""A data-parallel strategy: it places the model over the data axis, syncs its gradients and steps its optimizer.

Everything else a run needs is the engine's (``lab.parallel.engine``), which calls these methods in one order::

    wrap(module, groups) -> model; optimizer_groups(groups)            # once, after the transforms split the model
    each micro-step: forward(x, y, sync) under autograd_context(); finish_backward(sync)
    after the synced backward: optimizer_gradients()
    step(lr); restore_derived(); zero_grad()                           # or zero_grad() alone: a skipped step

and reads what this rank holds from ``holding`` (``lab.parallel.holding``: the global norm, checkpoints and the export
are written once over that record). A new strategy overrides what differs from plain replicated training, and no
more: ``wrap`` (placement), ``forward`` and ``finish_backward`` (gradient sync), ``step`` and ``zero_grad``,
``holding`` (when it shards) and ``restore_derived`` (when weights derive from shards). Its gradient sync averages
each parameter over ``comm_of(name)``: the data axis, or the ranks a transform names for it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from lab.measure.device import Precision
from lab.measure.placement import Costs
from lab.model.plan import ParallelPlan
from lab.parallel.axes import GroupReplicas, Transform
from lab.parallel.comm import Comm
from lab.parallel.holding import Piece
from lab.parallel.layout import LoopSettings, Mesh, World
from lab.measure.figures import Figures
from lab.parallel import owners
from lab.parallel.precision import Masters
from lab.runtime.config import ParallelConfig


@dataclass(frozen=True)
class ParamGroup:
    """Parameters, by name in the unwrapped model, that share optimizer settings."""

    names: tuple[str, ...]
    weight_decay: float
    lr_scale: float = 1.0  # the group's learning rate is the schedule's times this (μP's per-layer rates)
    muon: bool = False  # matrices Muon steps (``lab.training.muon``), each needed whole

    def options(self) -> dict[str, float | bool]:
        """The torch optimizer group's settings besides its tensors (``lr_scale`` rides along for ``set_lr``)."""
        return {"weight_decay": self.weight_decay, "lr_scale": self.lr_scale} | ({"muon": True} if self.muon else {})


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to the schedule's ``lr`` times the group's ``lr_scale``."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


ModelFactory = Callable[[], nn.Module]  # builds on the current default device (its plan: lab.model.plan)
ParamGroupRule = Callable[[nn.Module], list[ParamGroup]]
OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


class Strategy:
    """Plain replicated training: every rank holds the whole model (what ``single`` runs)."""

    name: ClassVar[str]
    # [parallel] options it reads, beyond strategy, timeout_s and the layout's (``lab.parallel.layout.OPTIONS``)
    options: ClassVar[frozenset[str]] = frozenset({"muon_redundant"})
    costs: Costs = Costs()  # how it places the model, for the cost formulas (``wrap`` fills in what it laid out)
    offload_modes: ClassVar[tuple[str, ...]] = ("none", "optimizer")  # values of parallel.offload it accepts
    min_world_size: ClassVar[int] = 1
    max_world_size: ClassVar[int | None] = None
    compiles: ClassVar[bool] = True  # whether it can train a torch.compile'd model (train.compile)
    shards: ClassVar[str] = "nothing"  # what the data axis's ranks hold parts of: optimizer, gradients, weights
    builds_on_meta: ClassVar[bool] = False  # whether it builds the model on the meta device and fills its shards
    keeps_own_masters: ClassVar[bool] = False  # mixed precision: its shards hold the fp32 masters (not the engine's)
    divides_loss: ClassVar[bool] = False  # the loss is divided by the data axis's ranks before its backward
    owns_step: ClassVar[str | None] = None  # why it runs with no other axis (an engine that owns the whole step)

    def __init__(self, mesh: Mesh, cfg: ParallelConfig, precision: Precision, loop: LoopSettings,
                 transforms: Sequence[Transform]):
        self.mesh, self.cfg, self.precision, self.loop = mesh, cfg, precision, loop
        self.transforms = transforms  # read for the ranks each parameter's gradient averages over (``comm_of``)
        self.data = mesh.data  # the data axis: the ranks it places over
        self.comm = Comm(self.data.world_size, self.data.group, axis="dp")  # a failure names the axis
        self._groups: dict[int, tuple[World, Comm]] = {}  # a transform's data group, by its process group's id
        self.microbatches = math.prod(t.microbatches() for t in transforms)  # unit forwards per micro-step
        # whether gathered weights are freed after each forward and backward (parallel.reshard_after_forward; by
        # default yes, but not where a transform runs several microbatches a micro-step, each gathering them again)
        setting = cfg.reshard_after_forward
        self.reshards = self.microbatches == 1 if setting is None else setting
        self.module: nn.Module | None = None  # the model, under its own parameter names (set by the engine)
        self.plan: ParallelPlan | None = None  # what the model declares of itself, after the transforms
        self.model: nn.Module | None = None  # what forward calls (the placed module, or a transform's wrapper)
        self.optimizer: torch.optim.Optimizer | None = None
        self.masters: Masters | None = None  # the engine's fp32 masters of the weights it holds whole
        self.syncing = True  # whether this micro-step's backward synchronises gradients

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    # ------------------------------------------------------------ placement

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        """Place the built module on this rank for training; returns what forward calls."""
        return module

    def optimizer_groups(self, groups: list[ParamGroup]) -> list[dict]:
        """torch optimizer groups: each ParamGroup's tensors as this strategy holds them (their masters, if any)."""
        params = dict(self.module.named_parameters())
        masters = {} if self.masters is None else self.masters.of
        return [{"params": [masters.get(id(params[n]), params[n]) for n in g.names], **g.options()}
                for g in groups if g.names]

    def gradient_leaves(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors autograd accumulates this rank's gradients into, under the model's names (what a gradient hook
        watches): the trainable parameters."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def orthogonalizer(self, optimizer: torch.optim.Optimizer, matrices: list[str]) -> Figures | None:
        """Where a Muon optimizer (one with an ``orthogonalizer``) orthogonalizes the ``matrices`` it steps: each on
        one owner rank of the ranks that share it (``world_of``), from whole matrices they hold alike, or brought
        together from the pieces they hold (``lab.parallel.owners``). None for another optimizer."""
        return owners.distribute(optimizer, matrices, self.world_of, self.shards == "nothing", self.cfg.muon_redundant,
                                 self.holding(), self.transforms, self.mesh.stage)

    def comm_of(self, name: str) -> Comm:
        """The collectives over the ranks parameter ``name``'s gradient is averaged over (``world_of``)."""
        return self._group(name)[1]

    def world_of(self, name: str) -> World:
        """The ranks parameter ``name``'s gradient is averaged over: the data axis, or those a transform names for it
        (a mixture's routed weights)."""
        return self._group(name)[0]

    def _group(self, name: str) -> tuple[World, Comm]:
        for transform in self.transforms:
            world = transform.data_group(name)
            if world is not None:
                key = id(world.group)
                if key not in self._groups:
                    self._groups[key] = (world, Comm(world.world_size, world.group, axis=transform.name))
                return self._groups[key]
        return self.data, self.comm

    def comms(self) -> list[Comm]:
        """Every data-parallel group's collectives: the data axis's first."""
        return [self.comm] + [comm for _, comm in self._groups.values()]

    # ------------------------------------------------------------ one step

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """The loss of one micro-batch; ``sync`` says this micro-step's backward synchronises gradients."""
        return self.model(x, y)

    def autograd_context(self) -> contextlib.AbstractContextManager:
        """The context each autograd pass runs in (``syncing`` says whether it is a stage's last of the step)."""
        return contextlib.nullcontext()

    def finish_backward(self, sync: bool) -> None:
        """After a micro-step's backward; on the synced one, average the accumulated gradients over the data axis."""

    def optimizer_gradients(self) -> None:
        """Give the optimizer's own tensors the synced, completed gradients (a strategy whose optimizer steps other
        tensors than the model's: its shards)."""

    def step(self, lr: float) -> None:
        """Apply the optimizer at learning rate ``lr``; a parameter unused in this step has a zero gradient, as under
        flat sharding."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------ what this rank holds

    def holding(self) -> list[Piece]:
        """What this rank holds of every parameter (frozen ones included; a tied weight once), in a fixed order:
        replicated, each whole."""
        masters = {} if self.masters is None else self.masters.of
        out = []
        for name, p in self.module.named_parameters():
            master = masters.get(id(p))
            out.append(Piece(name, p.numel(), 0, p.detach().view(-1), None if p.grad is None else p.grad.view(-1),
                             self.optimizer.state.get(p if master is None else master) or None, shape=tuple(p.shape),
                             replicas=GroupReplicas(self.world_of(name)),
                             master=None if master is None else master.view(-1)))
        return out

    def restore_derived(self) -> None:
        """Restore what derives from the updated or loaded weights (nothing when it holds them whole)."""
