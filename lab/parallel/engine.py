"""The lab's engine: what the training loop drives, the same for every layout.

It puts the parts together in reading order, and each part keeps one job:

    parallelize(module, plan, transforms)   the transforms split the model, in the layout's order (``axes.kinds``)
    strategy                                places the model over the data axis, syncs its gradients, steps
    precision                               fp32 masters and fp16's loss scale (``lab.parallel.precision``)
    holding                                 the global norm, checkpoint state and export, from what each rank holds
    meters, accounts                        what the steps cost, measured and in theory
    noise                                   the gradient noise scale, from each micro-batch's gradient (optional)

The loop's side, in order::

    engine.build(model_factory, param_group_rule, optimizer_factory)
    for each step:
        for each micro-batch:
            loss = engine.forward(x, y, sync=last_micro_batch)   # under the policy's autocast, if any
            engine.backward(loss / accumulation_steps)           # gradients synced on the last only
        norm = engine.clip_grad_norm(max_norm)                   # global over ranks and shards (fp16: unscaled)
        engine.step(lr) if norm is finite else engine.skip_step()
        meters = engine.take_step_meters()
    engine.eval_loss(x, y); engine.checkpoint_state() (+ after_load()); engine.full_state_dict()

``build`` makes the model from a factory under a device (``meta`` for a strategy that fills only its shards from the
plan's ``initial_value(name)``; the others build in place, and the model's own init gives every strategy the weights
``single`` gets), decides parameter groups by name *before* any wrapping or flattening, and checks that the ranks of
the data axis built the same model. A trainable parameter that gets no gradient in a step counts as a zero gradient
under every strategy. ``full_state_dict`` returns the whole model's weights under the model's own names, on the CPU,
on global rank 0 (an empty dict elsewhere), whatever the layout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from lab.measure.device import Precision
from lab.model.plan import ParallelPlan, plan_of
from lab.parallel import axes, holding
from lab.parallel.accounts import Accounts
from lab.parallel.axes import Transform
from lab.parallel.axes.activations import SavedBytes
from lab.parallel.base import ModelFactory, OptimizerFactory, ParamGroupRule, Strategy
from lab.parallel.layout import LoopSettings, Mesh
from lab.parallel.meters import RunMeters, StepMeters
from lab.parallel.noise import GradientNoise
from lab.parallel.precision import LossScaler, PrecisionStep
from lab.runtime.checkpoint import CheckpointState
from lab.runtime.config import ParallelConfig


def parallelize(module: nn.Module, plan: ParallelPlan, transforms: Sequence[Transform]) -> ParallelPlan:
    """Apply the layout's transforms to the built model, in their order (``axes.kinds``); each rewrites it as the
    plan it declares allows and returns the plan of the rewritten model. The data-parallel placement follows
    (``Strategy.wrap``)."""
    for transform in transforms:
        plan = transform.split(module, plan)
    return plan


def layout_digest(module: nn.Module, rename: Callable[[str], str] = str) -> str:
    """A digest of the parameter names (as ``rename`` gives them), shapes and dtypes: equal on ranks that hold the
    same model."""
    layout = "\n".join(f"{rename(n)}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
                       for n, p in module.named_parameters())
    return hashlib.sha256(layout.encode()).hexdigest()


class Engine:
    """A strategy of class ``strategy`` over the data axis of ``mesh``, with the transforms ``cfg`` asks for."""

    def __init__(self, strategy: type[Strategy], mesh: Mesh, cfg: ParallelConfig, precision: Precision,
                 loop: LoopSettings):
        self.name, self.mesh, self.cfg, self.precision, self.loop = strategy.name, mesh, cfg, precision, loop
        self.everyone = mesh.world  # every rank of the run
        self.saved = SavedBytes()
        self.transforms: list[Transform] = axes.transforms(mesh, cfg, loop, self.saved, precision.param_dtype)
        self.strategy = strategy(mesh, cfg, precision, loop, self.transforms)
        scaler = LossScaler(precision.loss_scale, precision.loss_scale_window) if precision.scales_loss else None
        self.precision_step = PrecisionStep(precision.param_dtype, scaler)
        self.accounts = Accounts(self.strategy)
        micro_batches = round(self.strategy.data.world_size * self.token_share) * loop.accum_steps  # every rank's
        self.noise = GradientNoise(self.transforms, micro_batches, self.microbatches > 1) if loop.noise_scale else None
        self.meters = RunMeters(self.strategy.comms, self.transforms, self.saved, self.everyone,
                                [part for part in (scaler, self.noise) if part is not None], self.accounts.record)
        self.accounts.parts = self.meters.figures
        self._after_load: list[Callable[[], None]] = []

    @property
    def module(self) -> nn.Module:
        """The model under its own parameter names."""
        return self.strategy.module

    @property
    def microbatches(self) -> int:
        """Forwards and backwards of the model's units per micro-step (``Transform.microbatches``)."""
        return self.strategy.microbatches

    @property
    def token_share(self) -> float:
        """The fraction of each sequence's tokens this rank runs (``Transform.token_share``)."""
        return math.prod(t.token_share() for t in self.transforms)

    @property
    def syncing(self) -> bool:
        """Whether the running backward synchronises gradients (a transform that runs several
        backwards a micro-step sets it for each)."""
        return self.strategy.syncing

    @syncing.setter
    def syncing(self, value: bool) -> None:
        self.strategy.syncing = value

    def describe(self) -> str:
        """The strategy as the run's start line names it, with each transform's part of the layout."""
        return functools.reduce(lambda text, t: t.describe(text), self.transforms, self.name)

    def build(self, model_factory: ModelFactory, param_group_rule: ParamGroupRule,
              optimizer_factory: OptimizerFactory) -> None:
        """Make the model, apply the transforms (``parallelize``), place it (``Strategy.wrap``) and let each transform
        wrap what the forward calls; the optimizer goes over groups decided before any wrapping."""
        s = self.strategy
        with torch.device("meta" if s.builds_on_meta else s.data.device):
            module = model_factory()
            s.plan = parallelize(module, plan_of(module, model_factory), self.transforms)
        s.module = module
        groups = param_group_rule(module)
        rename = functools.partial(functools.reduce, lambda n, t: t.local_name(n), self.transforms)
        s.data.check_same(layout_digest(module, rename), "the model (parameter names and shapes)")
        if self.precision.mixed and not s.keeps_own_masters:
            s.masters = self.precision_step.keep_masters(module, self._share_first)
        model = s.wrap(module, groups)
        for transform in reversed(self.transforms):  # the first transform's wrapper outermost
            model = transform.running(self, model)
        s.model = model
        s.optimizer = optimizer_factory(s.optimizer_groups(groups))
        matrices = [n for g in groups if g.muon for n in g.names]
        orthogonalizer = s.orthogonalizer(s.optimizer, matrices)
        if orthogonalizer is not None:  # Muon's: it reports what its orthogonalizations cost
            self.meters.own.append(orthogonalizer)
            self.accounts.one_moment = set(matrices)
        self.meters.watch_model(module)
        if self.noise is not None:
            self.noise.watch(s.gradient_leaves())

    def _share_first(self, name: str, tensor: torch.Tensor) -> None:
        comm = self.strategy.comm_of(name)
        if comm.world_size > 1:
            with comm.paused():
                comm.broadcast(tensor, src=0)

    # ------------------------------------------------------------ one step

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """The loss of one micro-batch; ``sync`` says this micro-step's backward synchronises gradients."""
        self.syncing = sync
        if self.noise is not None:
            self.noise.micro_tokens = x.numel()
        with self.precision.autocast(), self.saved.counting(self.module):
            return self.strategy.forward(x, y, sync=sync)

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of ``loss``; on a synced micro-step the strategy syncs them and the transforms finish what that
        leaves partial (a weight two ranks of another axis hold): complete when it returns."""
        self.autograd(self.scaled(loss))
        if self.noise is not None:  # every backward of the micro-step has run; nothing is synced yet
            self.noise.end_micro_step(self._unscaling())
        sync = self.syncing
        self.strategy.finish_backward(sync)
        if sync:
            if any(t.held_apart() for t in self.transforms):
                holding.complete_gradients(self.strategy.holding(), self.transforms, self.module)
            self.strategy.optimizer_gradients()
            self.precision_step.take_gradients()

    def autograd(self, loss: torch.Tensor | list[torch.Tensor],
                 grad: torch.Tensor | list[torch.Tensor | None] | None = None) -> None:
        """The autograd pass of ``loss`` (seeded with ``grad``; or of several at once), in the contexts the transforms
        and the strategy need."""
        with contextlib.ExitStack() as stack:
            for transform in self.transforms:
                stack.enter_context(transform.autograd())
            stack.enter_context(self.strategy.autograd_context())
            torch.autograd.backward(loss, grad)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What the autograd pass of ``loss`` starts from: divided by the data axis's ranks where the strategy's sum is
        then the mean, times fp16's loss scale (a transform that runs microbatches scales each one's so)."""
        if self.strategy.divides_loss:
            loss = loss / self.strategy.data.world_size
        return self.precision_step.scaled(loss)

    def _unscaling(self) -> float:
        """What turns a backward's gradients into the gradient of its micro-batch's mean loss (``scaled`` and the
        loop's division by the accumulation steps undone; a share of the tokens weighted by its share)."""
        ranks = self.strategy.data.world_size if self.strategy.divides_loss else 1
        scale = self.precision_step.scaler.scale if self.precision_step.scaler is not None else 1.0
        return self.loop.accum_steps * ranks * self.token_share / scale

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping (``holding.gradient_squares`` summed over every rank); clip to
        ``max_norm`` when it is positive. Under fp16 the gradients and the norm are unscaled first, and the norm's
        finiteness sets the next scale. Clipping and unscaling act on the optimizer's gradients (the masters')."""
        squares = holding.gradient_squares(self.strategy.holding(), self.transforms, self.strategy.data.device)
        if self.noise is not None:  # the micro-batches' squares ride along in the same all-reduce
            squares, small = self.everyone.sum(torch.stack([squares, self.noise.take_squares(squares.device)]))
        else:
            squares = self.everyone.sum(squares)
        norm = squares.sqrt()
        by_mesh: dict[int, list[torch.Tensor]] = {}  # DTensors of different meshes (FSDP over two groups) apart
        for group in self.strategy.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
        norm = self.precision_step.unscale(norm, [[p.grad for p in params] for params in by_mesh.values()])
        if max_norm > 0:
            for params in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        if self.noise is not None:
            self.noise.end_step(small.item(), norm.item())
        return norm

    def step(self, lr: float) -> None:
        """Apply the optimizer at learning rate ``lr`` (to the masters, which the weights then follow) and clear the
        gradients."""
        self.strategy.step(lr)
        self.precision_step.write_back()
        self.strategy.restore_derived()
        self.accounts.measure_once()
        self.skip_step()

    def skip_step(self) -> None:
        """Leave the weights as they are (a non-finite gradient) and clear the gradients."""
        self.strategy.zero_grad()
        self.precision_step.zero_grad()

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of a held-out batch, in eval mode, without gradients (every rank must call it alike)."""
        model = self.strategy.model
        model.eval()
        try:
            with self.precision.autocast(), self.meters.uncounted():
                return self.strategy.forward(x, y, sync=False)
        finally:
            model.train()

    def take_step_meters(self) -> StepMeters:
        """This step's meters (once per step)."""
        return self.meters.take_step()

    def take_record(self) -> dict[str, object]:
        """Every reporting part's fields of a logged step's record (``RunMeters.take_record``)."""
        return self.meters.take_record()

    # ------------------------------------------------------------ state

    def params_finite(self) -> bool:
        """Whether every weight on every rank is finite (checked before a checkpoint is written)."""
        return holding.all_finite(self.strategy.holding(), self.everyone)

    def checkpoint_state(self) -> CheckpointState:
        """Every weight and AdamW moment as the parts this rank hands over (``holding.checkpoint_state``)."""
        holding.materialize_adam_state(self.strategy.optimizer)
        state, self._after_load = holding.checkpoint_state(self.strategy.holding(), self.transforms, self.everyone)
        return state

    @torch.no_grad()
    def after_load(self) -> None:
        """What one rank loaded for others goes to them first, then what derives from the loaded weights (neither is
        a training step's traffic)."""
        with self.meters.uncounted():
            for share in self._after_load:
                share()
            self.precision_step.write_back()
            self.strategy.restore_derived()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on the CPU under the model's names, on global rank 0 (empty elsewhere)."""
        return holding.full_state_dict(self.strategy.holding(), self.transforms, self.module, self.everyone)

    def precision_record(self) -> dict[str, float]:
        return self.precision_step.record()

    def checkpoint_meta(self) -> dict[str, dict]:
        """What a checkpoint's metadata keeps of the engine besides the weights: fp16's loss scale, the noise scale's
        averages."""
        return self.precision_step.state() | ({} if self.noise is None else {"noise_scale": self.noise.state_dict()})

    def load_checkpoint_meta(self, meta: dict) -> None:
        """Go on from what ``checkpoint_meta`` kept (a checkpoint written without a part leaves that part as it is)."""
        self.precision_step.load_state(meta)
        if self.noise is not None and "noise_scale" in meta:
            self.noise.load_state_dict(meta["noise_scale"])
