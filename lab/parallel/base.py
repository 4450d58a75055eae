"""The interface every parallelism strategy implements; the training loop sees only this.

A strategy owns everything that differs between backends; the loop owns the schedule, the data
and the run directory. The loop's side, in order::

    strategy = parallel.create(cfg.parallel, world, precision, loop)   # [parallel] validated up front
    strategy.build(model_factory, param_group_rule, optimizer_factory)
    for each step:
        for each micro-batch:
            loss = strategy.forward(x, y, sync=last_micro_batch)   # under the policy's autocast, if any
            strategy.backward(loss / accumulation_steps)           # gradients synced on the last only
        norm = strategy.clip_grad_norm(max_norm)                    # global over ranks and shards (fp16: unscaled)
        strategy.step(lr) if norm is finite else strategy.skip_step()
        meters = strategy.take_step_meters()      # bytes sent, seconds waited, activation bytes saved
    strategy.eval_loss(x, y); strategy.checkpoint_state() (+ after_load()); strategy.full_state_dict()
    strategy.accounts.meters()                                      # model-state and comm bytes vs theory

A strategy is a data-parallel placement over the layout's data axis (``lab.parallel.layout``) that loops
over the layout's transforms (``lab.parallel.axes``), in their order, for everything the axes change: building
(each transform's ``split``, then ``wrap``, then each one's ``running``), the start line, the autograd pass, the
global gradient norm, meters, evaluation, checkpoint state and export. It never names an axis.

- ``build`` makes the model from a factory under a device (``meta`` for a strategy that fills only its shards from
  the plan's ``initial_value(name)``; the others build in place, and the model's own init gives every strategy the
  weights ``single`` gets), applies the transforms, decides parameter groups by name with the rule *before* any
  wrapping or flattening, places the model (``wrap``) and builds the optimizer it needs from the factory.
- A trainable parameter that gets no gradient in a step (unused in the forward) counts as having a zero gradient
  under every strategy, so a flat-sharded optimizer and a per-tensor one apply the same update.
- ``full_state_dict`` returns the whole model's weights under the model's own names, on the CPU, on global rank 0
  (an empty dict elsewhere), whatever the layout.
- The precision policy (``lab.measure.device.Precision``): under ``train.precision mixed`` the weights the model
  computes with are 16-bit and the optimizer updates fp32 masters (``lab.parallel.precision``): a strategy that holds
  the weights whole keeps one per weight (``keep_masters``, before ``wrap``); after the sync the optimizer takes
  fp32 copies of the gradients (``optimizer_gradients``), clipping acts on them, and the step casts the weights back
  from the masters. Checkpoints and exports hand over the masters. fp16 scales the loss (``scaled``), unscales in
  ``clip_grad_norm`` and sets the next scale from the norm.

What each rank holds is one record, ``holding()``: per parameter a ``Piece`` (which range of the flattened local
weight, its gradient and AdamW moments; whether the data axis shards it). With the transforms' answers (which ranks
of their axes hold the same values: ``replicas``; where a local part sits in the whole parameter:
``whole_region``), the gradient norm, the finiteness check, the checkpoint state, the export and the parameter and
weight-byte counts are written once, here: a part that several ranks hold is handed over, counted and exported by
the first of them alone, and given back to the others after a load.

A new data-parallel strategy overrides what differs from plain replicated training, at most: ``wrap``
(placement), ``forward`` and ``backward`` (gradient sync; ``scaled`` when it scales the loss before the autograd
pass), ``step`` and ``zero_grad``, ``holding`` (when it shards) and ``restore_derived`` (when weights derive from
shards), ``keep_masters`` and ``optimizer_gradients`` (when it keeps its own fp32 masters); and it names the
``accounting`` it is measured against (``lab.parallel.accounts``). Its gradient sync
averages each parameter over ``comm_of(name)`` (the data axis, or the ranks a transform names for it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.measure.device import Precision
from lab.measure.figures import Figures
from lab.model.plan import ParallelPlan, plan_of
from lab.parallel import axes
from lab.parallel.accounts import Accounts
from lab.parallel.axes import GroupReplicas, Replicas, Transform
from lab.parallel.axes.activations import SavedBytes
from lab.parallel.comm import Comm
from lab.parallel.layout import LoopSettings, Mesh, World
from lab.parallel.precision import LossScaler, Masters
from lab.runtime.checkpoint import Blocks, CheckpointState, Held, Pieces
from lab.runtime.config import ConfigError, ParallelConfig


def backend_for(device: torch.device) -> str:
    """The process group's backends: gloo on a CPU; on a GPU NCCL for CUDA tensors and gloo for the few small
    CPU tensors some collectives carry (flags, meters)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def join_group_of_one(device: torch.device) -> None:
    """A process group holding this process alone (an in-process store, no port), so that a strategy written
    for N ranks runs as a world of one, started by plain python or by torchrun with one process."""
    dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)


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

    comm_bytes: dict[str, float]  # sent by this rank over the data axis, by collective
    comm_wait_s: float  # time the step waited on communication (every axis)
    activation_saved_bytes: int  # the most any micro-step kept for its backward
    layout: dict[str, object] = dataclasses.field(default_factory=dict)  # the transforms' own figures


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
    """What this rank holds of one parameter: elements [lo, lo + len(weight)) of the flattened local weight of
    ``numel`` elements and ``shape`` (where a transform splits it, this rank's part), the same elements of its gradient,
    and the AdamW state whose tensors hold them from element ``moments_lo`` on; under mixed precision ``master``, the
    fp32 master weight of the same elements (what checkpoints and exports hand over: the weight is its 16-bit cast).
    ``sharded``: the ranks of the data axis hold different ranges (every rank then hands over its range, possibly
    empty); else ``replicas`` are the data-parallel ranks holding it whole too."""

    name: str
    numel: int
    lo: int
    weight: torch.Tensor
    grad: torch.Tensor | None = None
    moments: dict | None = None
    moments_lo: int = 0
    sharded: bool = False
    shape: tuple[int, ...] = ()
    replicas: Replicas | None = None
    master: torch.Tensor | None = None

    @property
    def value(self) -> torch.Tensor:
        """The weight at full precision: the master where there is one."""
        return self.weight if self.master is None else self.master

    def views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight (its master, if any) and, where it has them (a sharded piece: always, possibly empty), its AdamW
        moments, flat."""
        yield f"model/{self.name}", self.value
        if self.moments is None and not self.sharded:
            return
        hi = self.moments_lo + self.weight.numel()
        for key in ("exp_avg", "exp_avg_sq"):
            view = self.moments[key].view(-1)[self.moments_lo:hi] if self.moments is not None else torch.empty(0)
            yield f"optim/{self.name}/{key}", view


def layout_digest(module: nn.Module, rename: Callable[[str], str] = str) -> str:
    """A digest of the parameter names (as ``rename`` gives them), shapes and dtypes: equal on ranks that hold the
    same model."""
    layout = "\n".join(f"{rename(n)}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
                       for n, p in module.named_parameters())
    return hashlib.sha256(layout.encode()).hexdigest()


class Strategy:
    """Plain replicated training: every rank holds the whole model (what ``single`` runs)."""

    name: ClassVar[str]
    # [parallel] options it reads, beyond strategy, timeout_s and the layout's (``lab.parallel.layout.OPTIONS``)
    options: ClassVar[frozenset[str]] = frozenset()
    accounting: ClassVar[type[Accounts]] = Accounts  # what it costs, measured and in theory (lab.parallel.accounts)
    offload_modes: ClassVar[tuple[str, ...]] = ("none", "optimizer")  # values of parallel.offload it accepts
    min_world_size: ClassVar[int] = 1
    max_world_size: ClassVar[int | None] = None
    compiles: ClassVar[bool] = True  # whether it can train a torch.compile'd model (train.compile)
    shards: ClassVar[str] = "nothing"  # what the data axis's ranks hold parts of: optimizer, gradients, weights
    shards_gradients: ClassVar[bool] = False  # whether the data axis's ranks hold different parts of the gradient
    builds_on_meta: ClassVar[bool] = False  # whether it builds the model on the meta device and fills its shards
    owns_step: ClassVar[str | None] = None  # why it runs with no other axis (an engine that owns the whole step)

    @classmethod
    def validate(cls, cfg: ParallelConfig, world_size: int, loop: LoopSettings) -> None:
        """Raise ConfigError (one line) when this strategy cannot run ``cfg`` on ``world_size`` processes
        under the loop's ``loop`` settings."""
        if world_size < cls.min_world_size:
            raise ConfigError(f"strategy '{cls.name}' needs at least {cls.min_world_size} processes, got "
                              f"world size {world_size} (start it with torchrun --nproc_per_node=N)")
        if cls.max_world_size is not None and world_size > cls.max_world_size:
            raise ConfigError(f"strategy '{cls.name}' runs on at most {cls.max_world_size} process(es), "
                              f"got world size {world_size}: choose a data-parallel --strategy (ddp, zero1, zero2, "
                              f"zero3, fsdp) or run fewer processes")
        if loop.compile and not cls.compiles:
            raise ConfigError(f"train.compile is not supported under strategy '{cls.name}' (dynamo cannot trace "
                              f"parameters sharded at rest); set train.compile false or choose another strategy")

    @classmethod
    def validate_precision(cls, precision: Precision) -> None:
        """Raise ConfigError (one line) when this strategy cannot run ``precision`` (every one can, here)."""

    def __init__(self, mesh: Mesh, cfg: ParallelConfig, precision: Precision, loop: LoopSettings):
        self.validate(cfg, mesh.data.world_size, loop)
        self.mesh, self.cfg, self.precision, self.loop = mesh, cfg, precision, loop
        self.world = mesh.data  # the strategy's axis
        self.everyone = mesh.world  # every rank of the run
        self.comm = Comm(self.world.world_size, self.world.group, axis="dp")  # a failure names the axis
        self.saved = SavedBytes()
        self.transforms: list[Transform] = axes.transforms(mesh, cfg, loop, self.saved, precision.param_dtype)
        self._comms: dict[int, tuple[World, Comm]] = {}  # a transform's data group (by its process group's id)
        self._after_load: list[Callable[[], None]] = []
        self._model_figures: list[Figures] | None = None  # the model's own, once it is built (``figures``)
        self.module: nn.Module | None = None  # the model, under its own parameter names
        self.plan: ParallelPlan | None = None  # what the model declares of itself, after the transforms
        self.model: nn.Module | None = None  # what forward calls (the module, or a wrapper around it)
        self.optimizer: torch.optim.Optimizer | None = None
        self.syncing = True  # whether this micro-step's backward synchronises gradients (forward sets it)
        self.master_weights: Masters | None = None  # mixed precision: the fp32 masters of the weights it holds whole
        self.scaler = LossScaler(precision.loss_scale, precision.loss_scale_window) if precision.scales_loss else None
        self.accounts = self.accounting(self)

    @property
    def microbatches(self) -> int:
        """Forwards and backwards of the model's units per micro-step (``Transform.microbatches``)."""
        return math.prod(t.microbatches() for t in self.transforms)

    @property
    def token_share(self) -> float:
        """The fraction of each sequence's tokens this rank runs (``Transform.token_share``)."""
        return math.prod(t.token_share() for t in self.transforms)

    @property
    def reshards(self) -> bool:
        """Whether gathered weights are freed after each forward and backward (``parallel.reshard_after_forward``;
        by default yes, but not where a transform runs several microbatches a micro-step, each of which would gather
        them again)."""
        setting = self.cfg.reshard_after_forward
        return self.microbatches == 1 if setting is None else setting

    def describe(self) -> str:
        """The strategy as the run's start line names it, with each transform's part of the layout."""
        return functools.reduce(lambda text, t: t.describe(text), self.transforms, self.name)

    # ------------------------------------------------------------ building

    def build(self, model_factory: ModelFactory, param_group_rule: ParamGroupRule,
              optimizer_factory: OptimizerFactory) -> None:
        """Make the model, apply the transforms in their order, place it (``wrap``) and let each transform wrap what
        the forward calls; the optimizer goes over groups decided before any wrapping."""
        with torch.device("meta" if self.builds_on_meta else self.world.device):
            module = model_factory()
            plan = plan_of(module, model_factory)
            for transform in self.transforms:
                plan = transform.split(module, plan)
        self.module, self.plan = module, plan
        groups = param_group_rule(module)
        self.world.check_same(layout_digest(module, self.local_name), "the model (parameter names and shapes)")
        if self.precision.mixed:
            self.keep_masters(module)
        model = self.wrap(module, groups)
        for transform in reversed(self.transforms):  # the first transform's wrapper outermost
            model = transform.running(self, model)
        self.model = model
        self.optimizer = optimizer_factory(self.optimizer_groups(groups))

    def local_name(self, name: str) -> str:
        """``name`` as ranks of the data axis that hold different parts of the model compare their layouts."""
        return functools.reduce(lambda n, t: t.local_name(n), self.transforms, name)

    def keep_masters(self, module: nn.Module) -> None:
        """Mixed precision, before ``wrap``: fp32 masters of the trainable weights (the first data-parallel rank's
        values), which become the optimizer's, and the weights cast to ``param_dtype`` (``lab.parallel.precision``).
        A strategy that shards the weights keeps its own."""
        self.master_weights = Masters(module, self.precision.param_dtype, self._share_first)

    def _share_first(self, name: str, tensor: torch.Tensor) -> None:
        comm = self.comm_of(name)
        if comm.world_size > 1:
            with comm.paused():
                comm.broadcast(tensor, src=0)

    def wrap(self, module: nn.Module, groups: list[ParamGroup]) -> nn.Module:
        """Prepare the built module for training on this rank; returns what forward calls."""
        return module

    def optimizer_groups(self, groups: list[ParamGroup]) -> list[dict]:
        """torch optimizer groups: each ParamGroup's tensors as this strategy holds them (their masters, if any)."""
        params, masters = dict(self.module.named_parameters()), self._masters_by_id()
        return [{"params": [masters.get(id(params[n]), params[n]) for n in g.names], **g.options()}
                for g in groups if g.names]

    def _masters_by_id(self) -> dict[int, torch.Tensor]:
        """The fp32 master of each weight it holds whole, by the weight's id (none without mixed precision)."""
        return {} if self.master_weights is None else self.master_weights.of

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def world_of(self, name: str) -> World:
        """The ranks parameter ``name``'s gradient is averaged over: the data axis, or those a transform names (an
        transform names for it)."""
        return self._data_group(name)[0]

    def comm_of(self, name: str) -> Comm:
        """The collectives over ``world_of(name)``."""
        return self._data_group(name)[1]

    def _data_group(self, name: str) -> tuple[World, Comm]:
        for transform in self.transforms:
            world = transform.data_group(name)
            if world is not None:
                key = id(world.group)
                if key not in self._comms:
                    self._comms[key] = (world, Comm(world.world_size, world.group, axis=transform.name))
                return self._comms[key]
        return self.world, self.comm

    @property
    def comms(self) -> list[Comm]:
        """Every data-parallel group's collectives: the data axis's first."""
        return [self.comm] + [comm for _, comm in self._comms.values()]

    # ------------------------------------------------------------ one step

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """The loss of one micro-batch; ``sync`` says this micro-step's backward synchronises gradients."""
        self.syncing = sync
        with self.precision.autocast(), self.saved.counting(self.module):
            return self.model(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of ``loss``; on a synced micro-step the data-parallel strategy syncs them (``sync_gradients``)
        and the transforms finish what that leaves partial (a weight two ranks of another axis hold): complete when it
        returns."""
        self.autograd(self.scaled(loss))
        if self.syncing:
            self.sync_gradients()
            self.complete_gradients()
            self.optimizer_gradients()

    def sync_gradients(self) -> None:
        """Average the accumulated gradients over the data axis (nothing on one rank)."""

    def optimizer_gradients(self) -> None:
        """Give the optimizer the synced, completed gradients (mixed precision: the masters' fp32 copies of them)."""
        if self.master_weights is not None:
            self.master_weights.take_gradients()

    def complete_gradients(self) -> None:
        """Each transform's finish of the synced gradients, on this rank's parts of them."""
        if not any(t.held_apart() for t in self.transforms):
            return
        pieces = {piece.name: piece for piece in self.holding()}

        def grad_of(name: str) -> torch.Tensor:
            piece = pieces[name]
            if piece.grad is not None:
                return piece.grad
            p = self.module.get_parameter(name)  # no gradient reached it: a zero one
            p.grad = torch.zeros_like(p)
            return p.grad.view(-1)

        for transform in self.transforms:
            transform.complete_gradients(grad_of)

    def autograd(self, loss: torch.Tensor | list[torch.Tensor],
                 grad: torch.Tensor | list[torch.Tensor | None] | None = None) -> None:
        """The autograd pass of ``loss`` (seeded with ``grad``; or of several at once), in the contexts the transforms
        need."""
        with contextlib.ExitStack() as stack:
            for transform in self.transforms:
                stack.enter_context(transform.autograd())
            torch.autograd.backward(loss, grad)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What the autograd pass of ``loss`` starts from: fp16's loss scale times it (a transform that runs
        microbatches scales each one's so; a strategy that divides the loss by its ranks calls this on the quotient)."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def precision_record(self) -> dict[str, float]:
        """fp16's loss scale now, for the step's record and the summary (nothing when the loss is not scaled)."""
        return {} if self.scaler is None else self.scaler.record()

    def precision_state(self) -> dict[str, dict]:
        """What a checkpoint's metadata keeps of the precision policy: fp16's loss scale and its clean steps."""
        return {} if self.scaler is None else {"loss_scale": self.scaler.state_dict()}

    def load_precision_state(self, meta: dict) -> None:
        """Go on with the loss scale a checkpoint's metadata kept (one written without it leaves the initial one)."""
        if self.scaler is not None and "loss_scale" in meta:
            self.scaler.load_state_dict(meta["loss_scale"])

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping; clip to ``max_norm`` when it is positive.

        Each rank adds the squares of the gradient it holds (``holding``) where it is the first of the ranks holding
        the same values (``_handed_over``), over the parts each transform lets it count (a split weight's
        replicated rows once); one sum over every rank of the run gives the norm. Under fp16 the gradients are
        divided by the loss scale first, and the norm (non-finite on every rank if any gradient is) sets the next
        step's scale (``LossScaler.observe``). Clipping and unscaling act on the optimizer's gradients (the masters',
        under mixed precision).
        """
        squares = torch.zeros((), dtype=torch.float32, device=self.world.device)
        for piece in self.holding():
            if piece.grad is None or not self._handed_over(piece):
                continue
            ranges = [(piece.lo, piece.lo + piece.grad.numel())]
            for transform in self.transforms:
                ranges = transform.counted(piece.name, ranges)
            for lo, hi in ranges:  # a reduction: no temporary the size of the range
                part = piece.grad[lo - piece.lo:hi - piece.lo]
                squares += torch.linalg.vector_norm(part, dtype=torch.float32).square().to(squares.device)
        norm = self.everyone.sum(squares).sqrt()
        by_mesh: dict[int, list[torch.Tensor]] = {}  # DTensors of different meshes (FSDP over two groups) apart
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
        if self.scaler is not None:
            norm = norm / self.scaler.scale
            for params in by_mesh.values():
                torch._foreach_mul_([p.grad for p in params], 1 / self.scaler.scale)
            self.scaler.observe(bool(torch.isfinite(norm)))
        if max_norm > 0:
            for params in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def step(self, lr: float) -> None:
        """Apply the optimizer at learning rate ``lr`` (to the masters, which the weights then follow) and clear the
        gradients."""
        for p in self.trainable if self.master_weights is None else ():
            if p.grad is None:  # unused in this step: a zero gradient, as under flat sharding
                p.grad = torch.zeros_like(p)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        if self.master_weights is not None:
            self.master_weights.write_back()
        self.accounts.measure_once()
        self.zero_grad()

    def skip_step(self) -> None:
        """Leave the weights as they are (a non-finite gradient) and clear the gradients."""
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p, _ in self.master_weights.pairs if self.master_weights is not None else ():
            p.grad = None

    def take_step_meters(self) -> StepMeters:
        """Bytes sent over the data-parallel groups and seconds waited (on every axis) since the last call (once per
        step), the transforms' figures and the activation bytes saved."""
        sent: dict[str, float] = {}
        wait_s, layout = 0.0, {}
        for comm in self.comms:
            totals = comm.take()
            wait_s += totals.wait_s
            sent = {kind: sent.get(kind, 0.0) + n for kind, n in totals.bytes.items()}
        for transform in self.transforms:
            taken = transform.take_meters()
            wait_s += taken.wait_s
            layout |= taken.record
        meters = StepMeters(sent, wait_s, self.saved.take(), layout)
        self.accounts.record(meters)
        return meters

    def figures(self) -> list[Figures]:
        """Every part of the run that reports on it (``lab.measure.figures``): the transforms, the model's own (its
        ``figures``, where it has them: a mixture's router; once it is built) and fp16's loss scaler."""
        if self._model_figures is None and self.module is not None:
            own = getattr(self.module, "figures", None)
            self._model_figures = own(self.sum_token_figures) if own is not None else []
        return [*self.transforms, *(self._model_figures or []), *([self.scaler] if self.scaler is not None else [])]

    def take_record(self) -> dict[str, object]:
        """Every part's fields of a logged step's record since the last one (every rank calls it at the same
        steps)."""
        return {k: v for part in self.figures() for k, v in part.record().items()}

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of a held-out batch, in eval mode, without gradients (every rank must call it alike)."""
        self.model.eval()
        try:
            with self.precision.autocast(), self.uncounted():
                return self.model(x, y)
        finally:
            self.model.train()

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """No traffic inside is a training step's (every group's and transform's meters paused)."""
        with contextlib.ExitStack() as stack:
            for comm in self.comms:
                stack.enter_context(comm.paused())
            for transform in self.transforms:
                stack.enter_context(transform.paused())
            yield

    def holding(self) -> list[Piece]:
        """What this rank holds of every parameter (frozen ones included; a tied weight once), in a fixed order:
        replicated, each whole."""
        masters = self._masters_by_id()
        out = []
        for name, p in self.module.named_parameters():
            master = masters.get(id(p))
            out.append(Piece(name, p.numel(), 0, p.detach().view(-1), None if p.grad is None else p.grad.view(-1),
                             self.optimizer.state.get(p if master is None else master) or None, shape=tuple(p.shape),
                             replicas=GroupReplicas(self.world_of(name)),
                             master=None if master is None else master.view(-1)))
        return out

    def _replicas(self, piece: Piece) -> list[Replicas]:
        """Every group of ranks that holds the same values of ``piece`` as this rank."""
        found = [piece.replicas] if piece.replicas is not None and not piece.sharded else []
        return found + [r for t in self.transforms if (r := t.replicas(piece.name)) is not None]

    def _handed_over(self, piece: Piece) -> bool:
        """Whether this rank is the first of every group holding the same values of ``piece``."""
        return all(r.is_first for r in self._replicas(piece))

    def sum_token_figures(self, figures: torch.Tensor) -> torch.Tensor:
        """Per-token figures (a router's counts) summed over every rank of the run, each token once (a rank whose
        tokens another rank also runs adds nothing)."""
        if not all(t.sees_own_tokens() for t in self.transforms):
            figures = torch.zeros_like(figures)
        return self.everyone.sum(figures)

    @torch.no_grad()
    def params_finite(self) -> bool:
        """Whether every weight on every rank is finite (checked before a checkpoint is written)."""
        bad = torch.tensor([float(any(not torch.isfinite(piece.weight).all() for piece in self.holding()))])
        return self.everyone.sum(bad).item() == 0

    # ------------------------------------------------------------ state

    def _region(self, piece: Piece, lo: int, view: torch.Tensor) -> Held | Pieces | Blocks | torch.Tensor:
        """Where a part of ``piece`` (elements [lo, lo + len(view)) of the flattened local weight, or one of its
        moments) sits in the whole parameter, as this rank hands it over: a plain tensor when it is the whole
        parameter."""
        handed = view if self._handed_over(piece) else view[:0]
        for transform in self.transforms:
            region = transform.whole_region(piece.name, lo, handed, piece.numel)
            if region is not None:
                return region
        if not piece.sharded:
            return view
        return Held(piece.numel, lo if handed.numel() else 0, handed)

    def checkpoint_state(self) -> CheckpointState:
        """Every weight and AdamW moment as the parts of the whole flattened (or 2-D) tensors this rank hands over;
        an entry another rank holds a part of, named here with an empty part (the checkpoint builds each with a
        collective of every rank); ``after_load`` then gives each loaded part to the ranks holding the same."""
        self.materialize_states()
        state: CheckpointState = {}
        after: dict[str, Callable[[], None]] = {}
        for piece in self.holding():
            replicas = self._replicas(piece)
            for key, view in piece.views():
                lo = piece.lo if view.numel() else 0
                state[key] = self._region(piece, lo, view)
                if not isinstance(state[key], torch.Tensor):
                    after[key] = functools.partial(self._share_loaded, piece.name, replicas, lo, view)
            if piece.moments is not None:
                state[f"optim/{piece.name}/step"] = piece.moments["step"]
        state = self._named_everywhere(state)
        self._after_load = [after[key] for key in state if key in after]
        return state

    def held_state(self) -> CheckpointState:
        """Every weight and AdamW moment, flattened, as this rank holds it (``holding``): the views
        ``checkpoint_state`` places in the whole tensors."""
        self.materialize_states()
        state: CheckpointState = {}
        for piece in self.holding():
            for key, view in piece.views():
                state[key] = Held(piece.numel, piece.lo if view.numel() else 0, view) if piece.sharded else view
            if piece.moments is not None:
                state[f"optim/{piece.name}/step"] = piece.moments["step"]
        return state

    def _share_loaded(self, name: str, replicas: list[Replicas], lo: int, view: torch.Tensor) -> None:
        for group in replicas:
            group.share(view)
        for transform in self.transforms:
            transform.after_load(name, lo, view)

    def _named_everywhere(self, state: CheckpointState) -> CheckpointState:
        """``state`` in one order on every rank, with an empty part of each entry another rank holds a part of that
        this one lacks (a whole tensor is no collective: left to its holders)."""
        if self.everyone.world_size == 1 or not self.transforms:  # every rank holds the same entries
            return state
        kinds: list[dict[str, tuple] | None] = [None] * self.everyone.world_size
        dist.all_gather_object(kinds, {key: _kind(value) for key, value in state.items()})
        out: CheckpointState = {}
        for key, kind in {k: v for rank in kinds for k, v in rank.items()}.items():  # in rank order
            if key in state:
                out[key] = state[key]
            elif kind[0] != "whole":
                out[key] = Held(kind[1], 0, torch.empty(0)) if kind[0] == "flat" else Blocks(kind[1], [])
        return out

    @torch.no_grad()
    def after_load(self) -> None:
        """What one rank loaded for others goes to them first (not a training step's traffic); then what derives
        from the loaded weights (``restore_derived``)."""
        with self.uncounted():
            for step in self._after_load:
                step()
        self.restore_derived()

    def materialize_states(self) -> None:
        """AdamW's states before the first step (zeros), so that a checkpoint loads into them."""
        materialize_adam_state(self.optimizer)

    def restore_derived(self) -> None:
        """Restore what derives from the loaded weights (the 16-bit weights from their loaded masters; nothing when
        the strategy holds them whole at full precision)."""
        if self.master_weights is not None:
            self.master_weights.write_back()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on the CPU under the model's names, on global rank 0 (empty elsewhere): every
        rank sends the parts it hands over (``_region``), rank 0 puts them together."""
        parts = []
        for piece in self.holding():
            region = self._region(piece, piece.lo if piece.weight.numel() else 0, piece.value)
            if isinstance(region, torch.Tensor) and not self._handed_over(piece):
                continue  # a whole weight: its first holder sends it
            parts.append((piece.name, self.whole_shape(piece), _on_host(region)))
        buffers = {name: b.detach().cpu().clone() for name, b in self.module.state_dict().items()
                   if name not in dict(self.module.named_parameters(remove_duplicate=False))}
        first: dict[int, str] = {}
        aliases = {n: first.setdefault(id(p), n) for n, p in self.module.named_parameters(remove_duplicate=False)}
        mine = (parts, buffers, aliases)
        if self.everyone.world_size == 1:
            everything = [mine]
        else:
            everything = [None] * self.everyone.world_size if self.everyone.is_main else None
            dist.gather_object(mine, everything, dst=0)
        if not self.everyone.is_main:
            return {}
        return _assemble(everything, [name for name, _ in self.module.state_dict().items()])

    def whole_shape(self, piece: Piece) -> tuple[int, ...]:
        """The shape of the whole parameter ``piece`` is (part of)."""
        for transform in self.transforms:
            shape = transform.whole_shape(piece.name)
            if shape is not None:
                return shape
        return piece.shape


def _kind(value: Held | Pieces | Blocks | torch.Tensor) -> tuple:
    """What a rank tells the others of a checkpoint entry: whole, or parts of a flat tensor (its elements) or of a
    2-D one (its shape)."""
    if isinstance(value, torch.Tensor):
        return ("whole",)
    return ("blocks", value.shape) if isinstance(value, Blocks) else ("flat", value.numel)


def _on_host(region: Held | Pieces | Blocks | torch.Tensor) -> Held | Pieces | Blocks | torch.Tensor:
    """A copy of ``region``'s tensors on the CPU."""
    if isinstance(region, torch.Tensor):
        return region.detach().cpu().clone()
    if isinstance(region, Held):
        return Held(region.numel, region.lo, region.view.detach().cpu().clone())
    if isinstance(region, Pieces):
        return Pieces(region.numel, [(lo, v.detach().cpu().clone()) for lo, v in region.pieces])
    return Blocks(region.shape, [(r, c, v.detach().cpu().clone()) for r, c, v in region.blocks])


def _tensors(region: Held | Pieces | Blocks) -> list[torch.Tensor]:
    if isinstance(region, Held):
        return [region.view]
    return [v for _, v in region.pieces] if isinstance(region, Pieces) else [v for _, _, v in region.blocks]


def _assemble(everything: list, order: list[str]) -> dict[str, torch.Tensor]:
    """Whole weights from every rank's (parts, buffers, aliases), under the model's names: rank 0's module order
    first, then any other name in rank order."""
    whole: dict[str, torch.Tensor] = {}
    for parts, _, _ in everything:
        for name, shape, region in parts:
            if isinstance(region, torch.Tensor):
                whole.setdefault(name, region.view(shape))
                continue
            tensors = [t for t in _tensors(region) if t.numel()]
            if not tensors:
                continue
            target = whole.setdefault(name, torch.zeros(shape, dtype=tensors[0].dtype))
            if isinstance(region, Blocks):
                for row, column, rect in region.blocks:
                    target[row:row + rect.shape[0], column:column + rect.shape[1]] = rect
            else:
                flat = target.view(-1)
                for lo, view in region.pieces if isinstance(region, Pieces) else [(region.lo, region.view)]:
                    flat[lo:lo + view.numel()] = view
    for _, buffers, aliases in everything:
        for name, value in buffers.items():
            whole.setdefault(name, value)
        for alias, first in aliases.items():
            if alias not in whole and first in whole:
                whole[alias] = whole[first].clone()
    out = {name: whole[name] for name in order if name in whole}
    return out | {name: value for name, value in whole.items() if name not in out}


def changed_options(cfg: ParallelConfig) -> list[str]:
    """The [parallel] options set to something other than their default (strategy and timeout aside)."""
    default = ParallelConfig()
    return [f.name for f in dataclasses.fields(cfg) if f.name not in ("strategy", "timeout_s")
            and getattr(cfg, f.name) != getattr(default, f.name)]
