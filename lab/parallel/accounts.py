"""What a placement costs, kept apart from how it runs: bytes measured on this rank, and the theory they are set
against.

The engine makes one ``Accounts`` over its strategy and tells it two things while it runs: the first optimizer step is
over (``measure_once``: model states exist from then on) and a step's meters were taken (``record``). The rest is read
when asked:

- measured: ``state_bytes`` (the storages behind what this rank holds: ``Strategy.holding``'s weights, gradients,
  optimizer states and masters, and gradients the update copied to another device), the bytes the last step sent
  (counted by ``lab.parallel.comm`` from the tensors sent), the most bytes a micro-step kept for its backward;
- theory (``lab.measure.placement``): from the record the strategy filled as it placed the model
  (``strategy.costs``), model-state bytes by the ZeRO formulas in the widths of the run's precision policy, bytes
  sent per step by the ring formulas (gradients in the policy's ``reduce_dtype``, gathered weights in its
  ``param_dtype``), and the peak bytes of each phase.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from lab.measure import accounting, placement
from lab.measure.figures import Figures
from lab.runtime.config import ModelConfig

if TYPE_CHECKING:
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
    """A placement's costs, measured on this rank and in theory. ``measure``: how this rank's model states are
    measured where ``holding`` does not reach them (DeepSpeed's engine's own buffers)."""

    def __init__(self, strategy: Strategy, measure: Callable[[], accounting.StateBytes] | None = None):
        self.strategy = strategy
        self.measure = measure or self.state_bytes
        self.measured: accounting.StateBytes | None = None  # at the end of the first step
        self.last_comm_bytes = dict.fromkeys(accounting.COLLECTIVES, 0.0)
        self.most_saved = 0
        self.parts: Callable[[], list[Figures]] = list  # every part that reports on the run (set by the engine)
        self.one_moment: set[str] = set()  # matrices whose optimizer keeps one moment, Muon's (set by the engine)

    def measure_once(self) -> None:
        """Measure the model states at the end of the first step (states exist; gradients until they are cleared)."""
        if self.measured is None:
            self.measured = self.measure()

    def record(self, meters: StepMeters) -> None:
        self.last_comm_bytes = dict(meters.comm_bytes)
        self.most_saved = max(self.most_saved, meters.activation_saved_bytes)

    # ------------------------------------------------------------ measured

    def state_bytes(self) -> accounting.StateBytes:
        """Bytes of the storages behind the weights, gradients, optimizer states and masters this rank holds now
        (``Strategy.holding``; buffers excluded), and the gradients an offloaded update copied to the host."""
        s = self.strategy
        pieces = s.holding()
        copied = [p.grad for group in s.optimizer.param_groups for p in group["params"]
                  if p.grad is not None and p.grad.device != s.data.device]
        moments = [v for p in pieces if p.moments for v in p.moments.values() if isinstance(v, torch.Tensor)]
        masters = [p.master for p in pieces if p.master is not None]
        return accounting.StateBytes(params=storage_bytes(p.weight for p in pieces),
                                     grads=storage_bytes([p.grad for p in pieces if p.grad is not None] + copied),
                                     optimizer=storage_bytes(moments + masters), offload=s.costs.offloaded)

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

    def synced(self) -> dict[int, int]:
        """Elements each gradient sync moves, by data-parallel group size: as the placement lays them out
        (``Costs.synced``), or every trainable one."""
        s = self.strategy
        if s.costs.synced is not None:
            return dict(s.costs.synced)
        out: dict[int, int] = {}
        for name, p in s.module.named_parameters():
            if p.requires_grad:
                n = s.world_of(name).world_size
                out[n] = out.get(n, 0) + p.numel()
        return out

    def costs(self) -> placement.Costs:
        """The placement's record, with the elements of the engine's fp32 masters (mixed precision)."""
        masters = self.strategy.masters
        return self.strategy.costs if masters is None else \
            dataclasses.replace(self.strategy.costs, masters=sum(m.numel() for m in masters.tensors))

    def theory_states(self) -> accounting.StateBytes:
        """Model-state bytes per rank from the ZeRO formulas, each data-parallel group's parameters sharded over its
        ranks (an expert's over those holding it)."""
        return placement.placed_state_bytes(self.costs(), self.param_counts(), self.strategy.precision.state_widths,
                                            self.one_moment_counts())

    def one_moment_counts(self) -> dict[int, int]:
        """Elements of the matrices whose optimizer keeps one moment (``one_moment``: Muon's), by data-parallel group
        size, as the formulas take them: whole, sharded by them. A sharding layout cuts its chunks across matrices
        without regard to the groups, so a rank's share of them is what it holds (times the group's size), not the
        even share."""
        out: dict[int, int] = {}
        for piece in self.strategy.holding():
            if piece.name in self.one_moment:
                n = self.strategy.world_of(piece.name).world_size
                out[n] = out.get(n, 0) + (piece.weight.numel() * n if piece.sharded else piece.numel)
        return out

    def theory_comm(self) -> dict[str, float]:
        """Bytes this rank sends per step in theory, each data-parallel group's over its ranks."""
        precision = self.strategy.precision
        return placement.placed_comm_bytes(self.costs(), self.synced(), precision.reduce_dtype.itemsize,
                                           precision.param_dtype.itemsize)

    def peak_bytes_theory(self, activations: float, cast_weights: float = 0.0) -> dict[str, float]:
        """Per phase, the most bytes this rank holds in theory (``placement.placed_peak_bytes``) with ``activations``
        (one micro-batch's, ``lab.measure.accounting.activation_bytes``) and autocast's copies of the weights
        (``cast_weights``, ``accounting.autocast_weight_bytes``)."""
        s = self.strategy
        return placement.placed_peak_bytes(self.costs(), self.theory_states(), s.loop.accum_steps, s.precision.mixed,
                                           s.precision.param_dtype.itemsize, activations, cast_weights)

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
            "model_state_bytes": (self.measured or self.measure()).as_dict(),
            "model_state_bytes_theory": self.theory_states().as_dict(),
            "comm_bytes_per_step": dict(self.last_comm_bytes),
            "comm_bytes_per_step_theory": self.theory_comm(),
            "activation_saved_bytes": self.most_saved,
            **{k: v for part in self.parts() for k, v in part.meters().items()},
        }
