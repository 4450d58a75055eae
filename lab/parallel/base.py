"""The interface every parallelism strategy implements; the training loop sees only this.

A strategy owns everything that differs between backends; the loop owns the schedule, the data
and the run directory. The loop's side, in order::

    strategy = parallel.create(cfg.parallel, world, precision, loop)   # [parallel] validated up front
    strategy.build(model_factory, param_group_rule, optimizer_factory)
    for each step:
        for each micro-batch:
            loss = strategy.forward(x, y, sync=last_micro_batch)   # under the strategy's autocast
            strategy.backward(loss / accumulation_steps)           # gradients synced on the last only
        norm = strategy.clip_grad_norm(max_norm)                    # global over ranks and shards
        strategy.step(lr) if norm is finite else strategy.skip_step()
        meters = strategy.take_step_meters()      # bytes sent, seconds waited, activation bytes saved
    strategy.eval_loss(x, y); strategy.checkpoint_state() (+ after_load()); strategy.full_state_dict()
    strategy.accounts.meters()                                      # model-state and comm bytes vs theory

- ``build`` makes the model from a factory (called under a ``torch.device`` context, so a
  sharded strategy can build on ``meta`` and fill only its shard from the model's
  ``initial_value(name)``; the others build in place, and the model's own init gives every
  strategy the weights ``single`` gets), decides parameter groups by name with the rule *before*
  any wrapping or flattening, applies activation checkpointing (``parallel.activation_checkpointing``,
  for every strategy) and builds the optimizer it needs from the factory.
- A trainable parameter that gets no gradient in a step (unused in the forward) counts as having
  a zero gradient under every strategy, so a flat-sharded optimizer and a per-tensor one apply the
  same update (moments and weight decay go on).
- ``checkpoint_state`` hands the checkpoint (``lab.runtime.checkpoint``) live views of this rank's range of
  every flattened weight and AdamW moment, whatever the sharding: saving reads them, loading
  writes them (then ``after_load`` restores what derives from them).
- ``full_state_dict`` returns the whole model's weights under the model's own names, on the CPU,
  on rank 0 (an empty dict elsewhere), whatever the sharding.

What each rank holds is one record, ``holding()``: per parameter a ``Piece`` (which range of the flattened
weight, its gradient and its AdamW moments). The gradient norm and clipping, the finiteness check, the checkpoint
state, and the parameter and weight-byte counts are written once, here, against it; a strategy says only what it
holds.

A new data-parallel strategy overrides what differs from plain replicated training, at most: ``make_module`` and
``wrap`` (placement), ``forward`` and ``backward`` (gradient sync; ``scaled`` when it scales the loss before the
autograd pass), ``step`` and ``zero_grad``, ``holding`` (when it shards), ``restore_derived`` and
``gathered_state_dict`` (when weights derive from shards); and it names the ``accounting`` it is measured against
(``lab.parallel.accounts``). The README shows one in full. Under ``parallel.pp`` the pipeline (``lab.parallel.
pipeline``) runs the schedule inside ``forward``; a strategy says it supports that with ``pipeline_parallel``.
Under ``parallel.ep`` (``lab.parallel.experts``) a strategy that says ``expert_parallel`` reduces each gradient over
``comm_of(p)``: the experts' over the ranks holding the same experts.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.runtime.checkpoint import CheckpointState, Held, overlap
from lab.runtime.config import ConfigError, ParallelConfig
from lab.measure.device import Precision
from lab.model.plan import ParallelPlan, plan_of
from lab.parallel import activations, experts, pipeline, tensor
from lab.parallel.accounts import Accounts
from lab.parallel.comm import Comm
from lab.parallel.mesh import Mesh


def backend_for(device: torch.device) -> str:
    """The process group's backends: gloo on a CPU; on a GPU NCCL for CUDA tensors and gloo for the few small
    CPU tensors some collectives carry (flags, meters)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def join_group_of_one(device: torch.device) -> None:
    """A process group holding this process alone (an in-process store, no port), so that a strategy written
    for N ranks runs as a world of one, started by plain python or by torchrun with one process."""
    dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)


@dataclass(frozen=True)
class LoopSettings:
    """What the loop decides that a strategy may need before it builds (an engine's config takes them)."""

    micro_batch: int  # sequences per rank per micro-step
    accum_steps: int  # micro-steps per optimizer step
    grad_clip: float  # the max_norm clip_grad_norm is called with (0: off)
    compile: bool = False  # the strategy compiles the model it builds (train.compile)


@dataclass(frozen=True)
class ParamGroup:
    """Parameters, by name in the unwrapped model, that share optimizer settings."""

    names: tuple[str, ...]
    weight_decay: float
    lr_scale: float = 1.0  # the group's learning rate is the schedule's times this (μP's per-layer rates)

    def options(self) -> dict[str, float]:
        """The torch optimizer group's settings besides its tensors (``lr_scale`` rides along for ``set_lr``)."""
        return {"weight_decay": self.weight_decay, "lr_scale": self.lr_scale}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to the schedule's ``lr`` times the group's ``lr_scale``."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


ModelFactory = Callable[[], nn.Module]  # builds on the current default device (its plan: lab.model.plan)
ParamGroupRule = Callable[[nn.Module], list[ParamGroup]]
OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass(frozen=True)
class StepMeters:
    """What one optimizer step cost beyond compute."""

    comm_bytes: dict[str, float]  # sent by this rank, by collective
    comm_wait_s: float  # time the step waited on communication
    activation_saved_bytes: int  # the most any micro-step kept for its backward
    layout: dict[str, object] = dataclasses.field(default_factory=dict)  # the layout's own figures (a pipeline's)


def materialize_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state for parameters that have none yet, as torch does at the first step, so a
    checkpoint can be loaded into a fresh optimizer (zeros: the loaded values replace them)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            on_device = group.get("fused") or group.get("capturable")
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


@dataclass(frozen=True)
class Piece:
    """What this rank holds of one parameter: elements [lo, lo + len(weight)) of the flattened weight of ``numel``
    elements (under tensor parallelism, of this rank's shard), the same elements of its gradient, and the AdamW
    state whose tensors hold them from element ``moments_lo`` on. ``sharded``: the ranks of the data axis hold
    different ranges (every rank then hands over its range, possibly empty); else every one holds it whole."""

    name: str
    numel: int
    lo: int
    weight: torch.Tensor
    grad: torch.Tensor | None = None
    moments: dict | None = None
    moments_lo: int = 0
    sharded: bool = False

    def checkpoint_entries(self, state: CheckpointState) -> None:
        """Add the weight and, where it has them (a sharded piece: always, possibly empty), its AdamW moments and
        step, as the checkpoint's live views."""
        state[f"model/{self.name}"] = self._entry(self.weight)
        if self.moments is None and not self.sharded:
            return
        hi = self.moments_lo + self.weight.numel()
        for key in ("exp_avg", "exp_avg_sq"):
            view = self.moments[key].view(-1)[self.moments_lo:hi] if self.moments is not None else torch.empty(0)
            state[f"optim/{self.name}/{key}"] = self._entry(view)
        if self.moments is not None:
            state[f"optim/{self.name}/step"] = self.moments["step"]

    def _entry(self, view: torch.Tensor) -> Held | torch.Tensor:
        return Held(self.numel, self.lo if view.numel() else 0, view) if self.sharded else view


def layout_digest(module: nn.Module, rename: Callable[[str], str] = str) -> str:
    """A digest of the parameter names (as ``rename`` gives them), shapes and dtypes: equal on ranks that hold the
    same model."""
    layout = "\n".join(f"{rename(n)}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
                        for n, p in module.named_parameters())
    return hashlib.sha256(layout.encode()).hexdigest()


class Strategy:
    """Plain one-process training; subclasses change placement, gradient sync and the optimizer step."""

    name: ClassVar[str] = "base"
    # [parallel] options it reads, beyond strategy and timeout_s (activation checkpointing: every strategy)
    options: ClassVar[frozenset[str]] = frozenset({"activation_checkpointing", "tp", "tp_impl", "sequence_parallel",
                                                   "pp", "pp_schedule", "pp_microbatches", "pp_virtual",
                                                   "pp_impl", "ep"})
    accounting: ClassVar[type[Accounts]] = Accounts  # what it costs, measured and in theory (lab.parallel.accounts)
    offload_modes: ClassVar[tuple[str, ...]] = ("none", "optimizer")  # values of parallel.offload it accepts
    min_world_size: ClassVar[int] = 1
    max_world_size: ClassVar[int | None] = None
    compiles: ClassVar[bool] = True  # whether it can train a torch.compile'd model (train.compile)
    tensor_parallel: ClassVar[bool] = True  # whether it runs over the data axis of a mesh with parallel.tp > 1
    shards_gradients: ClassVar[bool] = False  # whether the data axis's ranks hold different parts of the gradient
    pipeline_parallel: ClassVar[bool] = False  # whether it runs over the data axis of a mesh with parallel.pp > 1
    expert_parallel: ClassVar[bool] = False  # whether it reduces each gradient over comm_of(p) (parallel.ep > 1)

    @classmethod
    def validate(cls, cfg: ParallelConfig, world_size: int, loop: LoopSettings) -> None:
        """Raise ConfigError (one line) when this strategy cannot run ``cfg`` on ``world_size`` processes
        under the loop's ``loop`` settings."""
        if world_size < cls.min_world_size:
            raise ConfigError(f"strategy '{cls.name}' needs at least {cls.min_world_size} processes, got "
                              f"world size {world_size} (start it with torchrun --nproc_per_node=N)")
        if cls.max_world_size is not None and world_size > cls.max_world_size:
            raise ConfigError(f"strategy '{cls.name}' runs on at most {cls.max_world_size} process(es), "
                              f"got world size {world_size}")
        if loop.compile and not cls.compiles:
            raise ConfigError(f"train.compile is not supported under strategy '{cls.name}' (dynamo cannot trace "
                              f"parameters sharded at rest); set train.compile false or choose another strategy")

    def __init__(self, mesh: Mesh, cfg: ParallelConfig, precision: Precision, loop: LoopSettings):
        self.validate(cfg, mesh.dp.world_size, loop)
        self.world, self.cfg, self.precision, self.loop = mesh.dp, cfg, precision, loop  # the strategy's axis: dp
        self.everyone = mesh.world  # every rank of the run
        self.tensor = tensor.on_axis(mesh.tp, cfg)  # the tensor-parallel transform, applied to the model it builds
        self.pipeline = pipeline.on_axis(mesh.pp, cfg, loop.accum_steps)  # the stages, and the schedule that runs them
        self.experts = experts.on_axis(mesh, cfg, loop)  # a mixture of experts' experts split over the ep axis
        self.comm = Comm(self.world.world_size, self.world.group, axis="dp")  # a failure names the axis
        self._after_load: list[Callable[[], None]] = []  # what the tensor-parallel group does after a load
        self.saved = activations.SavedBytes()
        self.module: nn.Module | None = None  # the model, under its own parameter names
        self.plan: ParallelPlan | None = None  # what the model declares of itself (lab.model.plan)
        self.model: nn.Module | None = None  # what forward calls (the module, or a wrapper around it)
        self.optimizer: torch.optim.Optimizer | None = None
        self.syncing = True  # whether this micro-step's backward synchronises gradients (forward sets it)
        self.accounts = self.accounting(self)

    def describe(self) -> str:
        """The strategy as the run's start line names it (with its tensor-parallel and pipeline layouts)."""
        return self.experts.describe(self.pipeline.describe(self.tensor.describe(self.name, self.world.world_size)))

    # ------------------------------------------------------------ building

    def build(self, model_factory: ModelFactory, param_group_rule: ParamGroupRule,
              optimizer_factory: OptimizerFactory) -> None:
        """Make the model and apply the transforms in their order: the tensor-parallel split and the pipeline
        stage (as it is built), activation checkpointing, compilation (``loop.compile``), then this strategy's
        data-parallel placement (``wrap``), run by the pipeline's schedule; the optimizer goes over groups decided
        before any wrapping."""
        model_factory = self.experts.splitting(self.pipeline.splitting(self.tensor.splitting(model_factory)))
        module = self.make_module(model_factory)
        self.plan = plan_of(module, model_factory)
        groups = param_group_rule(module)
        self.world.check_same(layout_digest(module, self.experts.layout_name), "the model (parameter names and shapes)")
        activations.apply(module, self.plan, self.cfg.activation_checkpointing, self.saved)
        if self.loop.compile:  # traced at the first forward: the split, checkpointed model
            module.compile()
        self.module = module
        self.model = self.pipeline.running(self, self.wrap(module, groups))
        self.optimizer = optimizer_factory(self.optimizer_groups(groups))

    def make_module(self, model_factory: ModelFactory) -> nn.Module:
        """Build the model with its initial weights on this rank's device."""
        with torch.device(self.world.device):
            return model_factory()

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        """Prepare the built module for training on this rank; returns what forward calls."""
        return module

    def optimizer_groups(self, groups: list[ParamGroup]) -> list[dict]:
        """torch optimizer groups: each ParamGroup's tensors as this strategy holds them."""
        params = dict(self.module.named_parameters())
        return [{"params": [params[n] for n in g.names], **g.options()} for g in groups if g.names]

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def comm_of(self, p: nn.Parameter) -> Comm:
        """The group ``p``'s gradient is averaged over: the data axis, or for an expert split by ``parallel.ep`` the
        ranks holding that expert."""
        return self.experts.comm if self.experts.holds(p) else self.comm

    # ------------------------------------------------------------ one step

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """The loss of one micro-batch; ``sync`` says this micro-step's backward synchronises gradients."""
        self.syncing = sync
        with self.precision.autocast(), self.saved.counting(self.module):
            return self.model(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of ``loss``; a data-parallel strategy syncs them here (its autograd pass: ``tensor.backward``)."""
        self.tensor.backward(self.scaled(loss))

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What the autograd pass of ``loss`` starts from (a pipeline's last stage scales each microbatch's so)."""
        return loss

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping; clip to ``max_norm`` when it is positive.

        Each rank adds the squares of the gradient it holds (``holding``) over the ranges it counts: the tensor-
        parallel transform's ``norm_ranges`` (a weight every rank of its group holds whole, or a replicated part,
        counted once); then they are summed over the data axis where it shards the gradients (a replicated
        strategy's averaged gradient is whole on every rank: no communication; with experts split by ``parallel.ep``,
        over the expert group, a weight every rank holds counted once: ``experts.counts``), over the tensor-parallel
        group and over the pipeline's stages (a weight two stages hold, once: ``pipeline.counts``, after its gradients
        are summed between them).
        """
        if not self.shards_gradients:  # a sharding strategy sums them before its reduce-scatter
            self.pipeline.reduce_tied(self.module)
        squares = torch.zeros((), dtype=torch.float32, device=self.world.device)
        for piece in self.holding():
            if piece.grad is None or (self.shards_gradients and not piece.sharded and not self.world.is_main) \
                    or not self.pipeline.counts(piece.name) \
                    or not (self.shards_gradients or self.experts.counts(piece.name)):
                continue
            held = (piece.lo, piece.lo + piece.grad.numel())
            for counted in self.tensor.norm_ranges(piece.name, piece.numel):
                lo, hi = overlap(counted, held)
                if lo < hi:  # a reduction: no temporary the size of the range
                    part = piece.grad[lo - piece.lo:hi - piece.lo]
                    squares += torch.linalg.vector_norm(part, dtype=torch.float32).square().to(squares.device)
        # sharded: every element is held by one rank of the data axis (an expert's by one of its ranks per group)
        squares = self.world.sum(squares) if self.shards_gradients else self.experts.sum_squares(squares)
        norm = self.pipeline.sum_squares(self.tensor.sum_squares(squares)).sqrt()
        if max_norm > 0:
            params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def step(self, lr: float) -> None:
        """Apply the optimizer at learning rate ``lr`` and clear the gradients."""
        for p in self.trainable:
            if p.grad is None:  # unused in this step: a zero gradient, as under flat sharding
                p.grad = torch.zeros_like(p)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.accounts.measure_once()
        self.zero_grad()

    def skip_step(self) -> None:
        """Leave the weights as they are (a non-finite gradient) and clear the gradients."""
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def take_step_meters(self) -> StepMeters:
        """Bytes sent over the data axis, seconds waited (on every axis) and activation bytes saved since the last
        call (once per step); the tensor-parallel group's bytes are kept apart (``meters``)."""
        comm = self.comm.take()
        pipeline_wait_s, layout = self.pipeline.take_meters()
        expert_bytes, expert_wait_s, expert_layout = self.experts.take_meters()
        sent = {kind: n + expert_bytes.get(kind, 0.0) for kind, n in comm.bytes.items()}
        meters = StepMeters(sent, comm.wait_s + self.tensor.take_wait_s() + pipeline_wait_s + expert_wait_s,
                            self.saved.take(), layout | expert_layout)
        self.accounts.record(meters)
        return meters

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of a held-out batch, in eval mode, without gradients (every rank must call it alike)."""
        self.model.eval()
        try:
            with self.precision.autocast(), self.comm.paused(), self.tensor.comm.paused(), self.experts.paused():
                return self.model(x, y)
        finally:
            self.model.train()

    def holding(self) -> list[Piece]:
        """What this rank holds of every parameter (frozen ones included; a tied weight once), in a fixed order:
        replicated, each whole."""
        return [Piece(name, p.numel(), 0, p.detach().view(-1), None if p.grad is None else p.grad.view(-1),
                      self.optimizer.state.get(p) or None) for name, p in self.module.named_parameters()]

    @torch.no_grad()
    def params_finite(self) -> bool:
        """Whether every weight on every rank is finite (checked before a checkpoint is written)."""
        bad = torch.tensor([float(any(not torch.isfinite(piece.weight).all() for piece in self.holding()))])
        return self.everyone.sum(bad).item() == 0

    # ------------------------------------------------------------ state

    def checkpoint_state(self) -> CheckpointState:
        """Every weight and AdamW moment as ranges of the whole flattened tensors (``held_state`` through the
        tensor-parallel transform)."""
        state, self._after_load = self.tensor.checkpoint_state(self.held_state(), self.world)
        state, handed_over = self.pipeline.checkpoint_state(state)
        self._after_load = handed_over + self._after_load  # the stages' first: what they hand over is then whole
        return state

    @torch.no_grad()
    def after_load(self) -> None:
        """What one rank loaded for others goes to them first (not a training step's traffic); then what derives
        from the loaded weights (``restore_derived``)."""
        with self.tensor.comm.paused():
            for step in self._after_load:
                step()
        self.restore_derived()

    def held_state(self) -> CheckpointState:
        """Every weight and AdamW moment, flattened, as this rank holds it (``holding``)."""
        self.materialize_states()
        state: CheckpointState = {}
        for piece in self.holding():
            piece.checkpoint_entries(state)
        return state

    def materialize_states(self) -> None:
        """AdamW's states before the first step (zeros), so that a checkpoint loads into them."""
        materialize_adam_state(self.optimizer)

    def restore_derived(self) -> None:
        """Restore what derives from the loaded weights (nothing when the strategy holds them whole)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on the CPU under the model's names, on global rank 0 (empty elsewhere)."""
        shards = self.experts.gather(self.gathered_state_dict(), self.module)
        return self.pipeline.full_state_dict(self.tensor.full_state_dict(shards) if self.world.is_main else {},
                                             self.world.is_main)

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights as this tensor-parallel rank holds them, on the CPU, on the data axis's first rank."""
        if not self.world.is_main:
            return {}
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}


def changed_options(cfg: ParallelConfig) -> list[str]:
    """The [parallel] options set to something other than their default (strategy and timeout aside)."""
    default = ParallelConfig()
    return [f.name for f in dataclasses.fields(cfg) if f.name not in ("strategy", "timeout_s")
            and getattr(cfg, f.name) != getattr(default, f.name)]
