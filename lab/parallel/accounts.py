"""What a strategy costs, kept apart from how it runs: bytes measured on this rank, and the theory they are set
against.

Each strategy names its ``Accounts`` class (``Strategy.accounting``); the strategy makes one at construction
(``strategy.accounts``) and tells it two things while it runs: the first optimizer step is over
(``measure_once``: model states exist from then on) and a step's meters were taken (``record``). The rest is
read from the strategy's own tensors when asked:

- measured: ``state_bytes`` (the storages behind this rank's weights, gradients and optimizer states, from the
  tensors themselves), the bytes the last step sent (counted by ``lab.parallel.comm`` from the tensors sent), the
  most bytes a micro-step kept for its backward;
- theory (``lab.measure.accounting``): model-state bytes by the ZeRO formulas, in the widths of the run's precision
  policy (``state_widths``: fp32's 4-byte weights and gradients and two 4-byte AdamW moments, or mixed precision's
  2-byte weights and gradients and 12 bytes of fp32 master and moments), bytes sent per step by the ring formulas
  (gradients in the policy's ``reduce_dtype``, gathered weights in its ``param_dtype``), and the peak bytes of each
  phase.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

import torch

from lab.measure import accounting
from lab.measure.figures import Figures
from lab.runtime.config import ModelConfig, ParallelConfig

if TYPE_CHECKING:
    from lab.measure.device import Precision
    from lab.parallel.base import Strategy
    from lab.parallel.meters import StepMeters


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views into one buffer count once; a DTensor's local part)."""
    sizes = {}
    for t in tensors:
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


class Accounts:
    """A replicated strategy's accounts: DDP's rows of ``lab.measure.accounting``."""

    grads_at_rest: ClassVar[bool] = False  # whether gradient buffers live between steps (flat buckets)

    @classmethod
    def state_row(cls, strategy: type[Strategy], cfg: ParallelConfig) -> str:
        """The ``lab.measure.accounting.model_state_bytes`` row the model states of ``strategy`` under ``cfg`` follow
        (known before anything is built: the run's memory check reads it)."""
        return "ddp"

    @classmethod
    def state_widths(cls, precision: Precision) -> str:
        """The ``lab.measure.accounting.model_state_bytes`` precision its states follow under ``precision``: the ZeRO
        paper's mixed widths where the weights and gradients are 16-bit beside fp32 masters."""
        return precision.state_widths

    def comm_row(self) -> str | None:
        """The ``lab.measure.accounting.comm_bytes_per_step`` row of its traffic (None: nothing sent)."""
        return "ddp"

    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        self.state_layout = self.state_row(type(strategy), strategy.cfg)
        self.comm_layout = self.comm_row()
        self.measured: accounting.StateBytes | None = None  # at the end of the first step
        self.last_comm_bytes = dict.fromkeys(accounting.COLLECTIVES, 0.0)
        self.most_saved = 0
        self.parts: Callable[[], list[Figures]] = list  # every part that reports on the run (set by the engine)

    def measure_once(self) -> None:
        """Measure the model states at the end of the first step (states exist; gradients until they are cleared)."""
        if self.measured is None:
            self.measured = self.state_bytes()

    def record(self, meters: StepMeters) -> None:
        self.last_comm_bytes = dict(meters.comm_bytes)
        self.most_saved = max(self.most_saved, meters.activation_saved_bytes)

    # ------------------------------------------------------------ measured

    def state_bytes(self) -> accounting.StateBytes:
        """Bytes of the storages behind the weights, gradients and optimizer states this rank holds now
        (``Strategy.holding``, and the copies it keeps on the host: ``host_copies``; buffers excluded)."""
        pieces = self.strategy.holding()
        host_grads, host_masters = self.host_copies()
        moments = [v for p in pieces if p.moments for v in p.moments.values() if isinstance(v, torch.Tensor)]
        masters = [p.master for p in pieces if p.master is not None]  # mixed precision's fp32 weights
        return accounting.StateBytes(params=storage_bytes(p.weight for p in pieces),
                                     grads=storage_bytes([p.grad for p in pieces if p.grad is not None] + host_grads),
                                     optimizer=storage_bytes(moments + host_masters + masters), offload=self.offloaded)

    def host_copies(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Gradients and fp32 master weights copied to the host for an offloaded update (none)."""
        return [], []

    # ------------------------------------------------------------ theory

    def param_counts(self) -> dict[int, int]:
        """Ψ by data-parallel group (its size): the model's parameters (a tied weight once, frozen ones included) as
        this rank holds them before the data axis shards them (under tensor parallelism its shards; under expert
        parallelism its experts, over the ranks holding the same ones)."""
        out: dict[int, int] = {}
        for piece in self.strategy.holding():
            n = self.strategy.world_of(piece.name).world_size
            out[n] = out.get(n, 0) + piece.numel
        return out

    def param_count(self) -> int:
        """Ψ: every parameter this rank's data-parallel groups hold between them."""
        return sum(self.param_counts().values())

    def comm_elements(self) -> dict[int, int]:
        """Ψ for the communication formula by data-parallel group (its size): the elements each gradient sync moves
        (every trainable one)."""
        out: dict[int, int] = {}
        for name, p in self.strategy.module.named_parameters():
            if p.requires_grad:
                n = self.strategy.world_of(name).world_size
                out[n] = out.get(n, 0) + p.numel()
        return out

    @property
    def world_size(self) -> int:
        return self.strategy.data.world_size

    offloaded: ClassVar[bool] = False  # whether its theory places the optimizer states on the host

    def theory_states(self) -> accounting.StateBytes:
        """Model-state bytes per rank from the ZeRO formulas (``lab.measure.accounting.model_state_bytes``), each
        data-parallel group's parameters sharded over its ranks (an expert's over those holding it)."""
        widths = self.state_widths(self.strategy.precision)
        parts = [accounting.model_state_bytes(count, self.state_layout, n, widths, self.offloaded)
                 for n, count in self.param_counts().items()]
        return accounting.StateBytes(sum(p.params for p in parts), sum(p.grads for p in parts),
                                     sum(p.optimizer for p in parts), self.offloaded)

    def theory_comm(self) -> dict[str, float]:
        """Bytes this rank sends per step in theory (``lab.measure.accounting.comm_bytes_per_step``), each data-parallel
        group's over its ranks."""
        theory = dict.fromkeys(accounting.COLLECTIVES, 0.0)
        if self.comm_layout is None:
            return theory
        precision = self.strategy.precision
        for n, count in self.comm_elements().items():
            for kind, sent in accounting.comm_bytes_per_step(count, self.comm_layout, n,
                                                             precision.reduce_dtype.itemsize,
                                                             precision.param_dtype.itemsize).items():
                theory[kind] += sent
        return theory

    def theory_in_flight(self, states: accounting.StateBytes) -> tuple[float, float, float]:
        """(gathered weights in flight, gradient bytes held in the forward, and in the backward) in theory."""
        between = states.grads if self.grads_at_rest or self.strategy.loop.accum_steps > 1 else 0.0
        return 0.0, between, states.grads

    def theory_step_temporaries(self) -> float:
        """Bytes the clipping and the optimizer step allocate for a while, in theory: none (foreach and fused), but
        the masters' fp32 gradients under mixed precision."""
        masters = self.strategy.masters
        return 0.0 if masters is None else 4.0 * sum(m.numel() for m in masters.tensors)

    def peak_bytes_theory(self, activations: float, cast_weights: float = 0.0) -> dict[str, float]:
        """Per phase, the most bytes this rank holds in theory: its weights and optimizer states, the gradients
        held in that phase (buckets in flight included), the gathered weights in flight, and ``activations``
        (one micro-batch's, from ``lab.measure.accounting.activation_bytes``); the forward also holds the bf16
        copies autocast made of the weights (``cast_weights``, ``accounting.autocast_weight_bytes``); the step holds
        the states and its temporaries."""
        states = self.theory_states()
        gathered, grads_forward, grads_backward = self.theory_in_flight(states)
        held = states.params + states.optimizer
        return {"forward": held + grads_forward + gathered + activations + cast_weights,
                "backward": held + grads_backward + gathered + activations,
                "step": held + states.grads + self.theory_step_temporaries()}

    def run_peak_bytes_theory(self, shape: ModelConfig) -> dict[str, float]:
        """``peak_bytes_theory`` of a run training a model of ``shape``: one micro-batch's activations under the
        layout, and the copies autocast makes of the weights."""
        s = self.strategy
        activations = s.mesh.layout.activation_bytes(
            shape, s.loop.micro_batch, s.precision.activation_bytes, sequence_parallel=s.cfg.sequence_parallel,
            checkpointing=s.cfg.activation_checkpointing == "full")
        cast = accounting.autocast_weight_bytes(shape, s.cfg.tp) if s.precision.autocasts else 0.0
        return self.peak_bytes_theory(activations, cast)

    def meters(self) -> dict[str, dict[str, float]]:
        """Model-state bytes (measured at the first step, and theory), comm bytes per step (last step, and theory),
        the most activation bytes a micro-step saved for its backward, and every reporting part's own figures
        (``parts``)."""
        return {
            "model_state_bytes": (self.measured or self.state_bytes()).as_dict(),
            "model_state_bytes_theory": self.theory_states().as_dict(),
            "comm_bytes_per_step": dict(self.last_comm_bytes),
            "comm_bytes_per_step_theory": self.theory_comm(),
            "activation_saved_bytes": self.most_saved,
            **{k: v for part in self.parts() for k, v in part.meters().items()},
        }


class Local(Accounts):
    """One process: nothing sent."""

    def comm_row(self) -> str | None:
        return None


class Bucketed(Accounts):
    """Flat gradient buckets that live between steps."""

    grads_at_rest = True


class Zero(Accounts):
    """The hand-rolled ZeRO stages (``lab.parallel.data.zero``): the flat units' layout."""

    @classmethod
    def state_row(cls, strategy: type[Strategy], cfg: ParallelConfig) -> str:
        return f"zero{strategy.stage}"

    def comm_row(self) -> str | None:
        return self.state_layout

    @property
    def grads_at_rest(self) -> bool:
        return self.strategy.stage == 1

    @property
    def offloaded(self) -> bool:
        return self.strategy.offloaded

    def host_copies(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Offloaded: the averaged gradient's pieces copied to the host (on an accelerator) and the fp32 masters."""
        s = self.strategy
        on_host = s.offloaded and s.data.device.type != "cpu"
        grads = [piece.grad for *_, piece in s.optimizer_pieces
                 if on_host and piece.grad is not None and piece.grad.device.type == "cpu"]
        return grads, [u.master for u in s.units if u.master is not None]

    def comm_elements(self) -> dict[int, int]:
        """Ψ as the flat layout sends it: each unit rounded up to a multiple of its group's size."""
        out: dict[int, int] = {}
        for u in self.strategy.units:
            out[u.comm.world_size] = out.get(u.comm.world_size, 0) + u.padded
        return out

    @property
    def width(self) -> int:
        return self.strategy.units[0].shard.element_size()

    def theory_in_flight(self, states: accounting.StateBytes) -> tuple[float, float, float]:
        """Two units in flight in the backward (one filling, one reduce-scattering; or what two reduce-scatters
        receive) beside the gradients held: stage 1 the whole gradient; stages 2-3 this rank's shard, or under
        accumulation every unit's whole gradient, kept until the last micro-step."""
        units = self.strategy.units
        two_units = self.width * sum(sorted(u.padded for u in units)[-2:])
        if self.strategy.stage == 1:
            _, at_rest, whole = super().theory_in_flight(states)
            return 0.0, at_rest, whole + two_units
        if self.strategy.loop.accum_steps > 1:
            whole = self.width * sum(u.padded for u in units)
            return 0.0, whole, whole + two_units
        return 0.0, 0.0, states.grads + two_units

    def theory_step_temporaries(self) -> float:
        """The optimizer's temporaries: one of a unit's chunks (the clipping's norms are reductions: none); under mixed
        precision also the fp32 copies of this rank's averaged gradient chunks."""
        units = self.strategy.units
        copies = 4.0 * sum(u.chunk for u in units) if self.strategy.precision.mixed else 0.0
        return 4.0 * max(u.chunk for u in units) + copies


class Zero3(Zero):
    """Stage 3 adds the gather pool and the weights gathered twice a micro-step."""

    def theory_comm(self) -> dict[str, float]:
        """The weights are gathered again and again (``Strategy.reshards``): each piece of the model's units twice per
        forward and backward (M of each per micro-step under a pipeline), the root units once a micro-step, less
        what one backward finds still gathered from its forward (without a pipeline, the root and the last piece);
        or, kept gathered, every unit once a step."""
        s = self.strategy
        theory = super().theory_comm()
        pieces = {id(u) for segment in s.forward_order for u in segment}
        last = {id(u) for u in s.forward_order[-1]} if s.forward_order else set()
        elements: dict[int, float] = {}
        for u in s.units:
            if not s.reshards:
                times = 1 / s.loop.accum_steps  # once a step
            elif s.microbatches > 1:
                times = 2 * s.microbatches if id(u) in pieces else 1
            else:
                times = 1 if id(u) not in pieces or id(u) in last else 2
            n = u.comm.world_size
            elements[n] = elements.get(n, 0.0) + times * u.padded
        theory["all_gather"] = s.loop.accum_steps * self.width * sum(
            accounting.ring_elements_sent("all_gather", count, n) for n, count in elements.items())
        return theory

    def pool_bytes(self) -> float:
        """The gather pool once full: the root unit and the two largest neighbours in the forward order."""
        return self.strategy.pool_budget * self.width

    def theory_in_flight(self, states: accounting.StateBytes) -> tuple[float, float, float]:
        """The root unit, the unit at work and the next one (prefetched) gathered at once: the pool full."""
        _, grads_forward, grads_backward = super().theory_in_flight(states)
        return self.pool_bytes(), grads_forward, grads_backward

    def peak_bytes_theory(self, activations: float, cast_weights: float = 0.0) -> dict[str, float]:
        """The pool's buffers stay allocated through the optimizer step too."""
        theory = super().peak_bytes_theory(activations, cast_weights)
        return theory | {"step": theory["step"] + self.pool_bytes()}


class FSDP(Accounts):
    """torch's FSDP2: parameters sharded by rows, the traffic of ZeRO-3 (or of ZeRO-2 when it keeps the gathered
    weights from the forward to the backward)."""

    @classmethod
    def state_row(cls, strategy: type[Strategy], cfg: ParallelConfig) -> str:
        return "zero3"

    @classmethod
    def state_widths(cls, precision: Precision) -> str:
        """fp32 shards of weights and gradients at rest under any policy (``MixedPrecisionPolicy`` casts each gather
        and upcasts the reduced gradient)."""
        return "fp32"

    def comm_row(self) -> str | None:
        return "zero3" if self.strategy.reshards else "zero2"

    def _sharded(self) -> list[tuple[int, int, bool]]:
        """(elements as FSDP sends them: each parameter's first dimension padded to a multiple of its group's size,
        the group's size, whether it keeps its gathered weights from its forward to its backward) of every module
        ``fully_shard`` was applied to."""
        s, out, seen = self.strategy, [], set()
        for name, world, kept in s.shards:
            module, n = s.module.get_submodule(name) if name else s.module, world.world_size
            params = [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
            seen |= {id(p) for p in params}
            out.append((sum(-(-p.shape[0] // n) * n * (p.numel() // p.shape[0]) for p in params), n, kept))
        return out

    def comm_elements(self) -> dict[int, int]:
        """Ψ as FSDP sends it, by group size."""
        out: dict[int, int] = {}
        for elements, n, _ in self._sharded():
            out[n] = out.get(n, 0) + elements
        return out

    def theory_comm(self) -> dict[str, float]:
        """The reduce-scatter once a step; the all-gathers as FSDP2 runs them: reshards (``Strategy.reshards``), each
        module gathered for every forward and backward (M of each a micro-step under a pipeline), or once per forward
        where it keeps them until its backward (an expert); else every module once a step."""
        s = self.strategy
        theory = super().theory_comm()
        steps, m = s.loop.accum_steps, s.microbatches
        theory["all_gather"] = s.precision.param_dtype.itemsize * sum(
            (steps * m * (1 if kept else 2) if s.reshards else 1) * accounting.ring_elements_sent("all_gather", e, n)
            for e, n, kept in self._sharded())
        return theory


class DeepSpeed(Accounts):
    """DeepSpeed's engine: its own tensors, its stage's rows."""

    @classmethod
    def state_row(cls, strategy: type[Strategy], cfg: ParallelConfig) -> str:
        return f"zero{cfg.zero_stage}"

    def comm_row(self) -> str | None:
        return self.state_layout

    @property
    def offloaded(self) -> bool:
        return self.strategy.cfg.offload != "none"

    def state_bytes(self) -> accounting.StateBytes:
        """Weights the model computes with, the gradients at the boundary (measured when the norm is taken), and the
        masters plus Adam's moments (a master partition that is the weights themselves, as in stage 3 without
        offload, counts once)."""
        s = self.strategy
        opt = s.optimizer
        weights = list(opt.fp16_partitioned_groups_flat if s.stage == 3 else opt.bit16_groups_flat)
        stored = {t.untyped_storage().data_ptr() for t in weights}
        moments = [v for m in s.master_partitions for v in opt.optimizer.state.get(m, {}).values()
                   if torch.is_tensor(v)]
        masters = [m for m in s.master_partitions if m.untyped_storage().data_ptr() not in stored]
        return accounting.StateBytes(params=storage_bytes(weights), grads=s.grad_bytes or 0,
                                     optimizer=storage_bytes(moments + masters), offload=s.cfg.offload != "none")

    def comm_elements(self) -> dict[int, int]:
        return {self.world_size: sum(getattr(p, "ds_numel", p.numel()) for p in self.strategy.trainable)}
