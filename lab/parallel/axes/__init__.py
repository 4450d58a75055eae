"""The transforms of a layout, as one protocol in one ordered list.

``transforms`` lists what a layout applies to the model, in the order it applies them: tensor (``tensor.py``) →
context (``context.py``) → expert (``experts.py``) → pipeline cut (``pipeline.py``) → activation checkpointing
(``activations.py``) → compile;
the data-parallel strategy's placement (``lab.parallel.data``) comes last and loops over the list. An axis of one
rank, or a feature that is off, is absent from the list.

A transform rewrites the model as it is built (``split``) and tells the strategy what follows from that, each method
defaulting to "nothing": the start line (``describe``), what the forward calls (``running``: a pipeline's schedule),
the context of the autograd pass (``autograd``), the ranks a parameter's gradient is averaged over when they are not
the strategy's (``data_group``: an expert's), the parts of a gradient this rank adds to the global norm
(``counted``), the gradients it completes after the data-parallel sync (``complete_gradients``: a weight two stages
hold), what a checkpoint stores of a parameter (``whole_region``) and which ranks hold the same values
(``replicas``), its step's cost (``take_meters``), what it reports (``lab.measure.figures.Figures``: its summary
fields, ``meters``, and its fragment of the step line, ``line``, at its ``line_place``) and what evaluation must not
count (``paused``). Whether a layout applies it, and how it is made, is its own (``on``).

A new axis implements these methods in one file and adds one entry to ``kinds``, the one ordered list of transforms:
``transforms`` makes those a layout asks for from it, and the step line shows the fragments of all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn

from lab.measure.figures import Figures
from lab.model.plan import ParallelPlan
from lab.runtime.checkpoint import Blocks, Held, Pieces
from lab.runtime.config import ParallelConfig

if TYPE_CHECKING:
    from lab.parallel.axes.activations import SavedBytes
    from lab.parallel.layout import LoopSettings, Mesh, World


@dataclass
class AxisMeters:
    """What one transform's traffic cost in the last step: seconds waited, and the figures it adds to the step's
    record."""

    wait_s: float = 0.0
    record: dict[str, object] = field(default_factory=dict)


class Replicas:
    """Ranks that hold the same values of a parameter: the first hands them to checkpoints, exports and the global
    norm; after a load it gives them to the others (``share``)."""

    @property
    def is_first(self) -> bool:
        raise NotImplementedError

    def share(self, tensor: torch.Tensor) -> None:
        """The first's ``tensor`` on every other one (in place)."""
        raise NotImplementedError


class Transform(Figures):
    """One step of a layout; every method's default adds nothing (see the module docstring)."""

    name: ClassVar[str]
    # the dtype of the hidden states between blocks, which its transfers and their theory move: the weights' (fp32,
    # or the 16-bit compute dtype under mixed precision), set by ``transforms``
    values: torch.dtype = torch.float32

    @classmethod
    def on(cls, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings, saved: SavedBytes) -> Transform | None:
        """This transform as ``cfg`` asks for it on ``mesh`` (``saved``: the meter of activation bytes saved for the
        backward); None where the layout does not apply it (an axis of one rank, a feature that is off)."""
        raise NotImplementedError

    def describe(self, layout: str) -> str:
        return layout

    def split(self, model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
        """Rewrite the built model (on any device, meta included) in place, as its ``plan`` allows; return the plan of
        the rewritten model."""
        return plan

    def local_name(self, name: str) -> str:
        """``name`` as ranks of the data axis that hold different parts of the model compare their layouts."""
        return name

    def running(self, strategy: object, model: nn.Module) -> nn.Module:
        """What the strategy's forward calls, given what the later transforms made it call (the first transform's is
        the outermost: it sees the step's batch first)."""
        return model

    def microbatches(self) -> int:
        """How many forwards and backwards of the model's units one micro-step of the loop runs."""
        return 1

    def token_share(self) -> float:
        """The fraction of each sequence's tokens this rank runs."""
        return 1.0

    def entry_points(self) -> list[str]:
        """The model's methods this transform calls in place of its forward (a strategy that hooks the forward hooks
        these too)."""
        return []

    def autograd(self) -> contextlib.AbstractContextManager:
        """The context the autograd pass of a loss runs in."""
        return contextlib.nullcontext()

    def data_group(self, name: str) -> World | None:
        """The ranks parameter ``name``'s gradient is averaged over when not the strategy's own (None: its own)."""
        return None

    def counted(self, name: str, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The parts of ``ranges`` (of this rank's flattened ``name``) whose gradient this rank adds to the global
        norm: each element of every parameter is counted on one rank of the world."""
        return ranges

    def complete_gradients(self, grad_of: Callable[[str], torch.Tensor]) -> None:
        """Finish gradients the data-parallel sync leaves partial (``grad_of(name)``: this rank's part, to change in
        place)."""

    def held_apart(self) -> set[str]:
        """Parameters whose gradients ``complete_gradients`` touches: a sharding strategy lays each out alone, the same
        on every rank that holds it."""
        return set()

    def micro_batch_parts(self) -> World | None:
        """The ranks of this axis whose gradients of one micro-batch add up to its gradient (each runs a share of its
        tokens, ``token_share``); None where each rank's is whole."""
        return None

    def mixed_gradients(self) -> set[str]:
        """Parameters whose gradient in one backward adds parts of other ranks' micro-batches (an expert's weights
        fed other ranks' tokens): read per use through ``tap_uses``."""
        return set()

    def tap_uses(self, tap: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Have each use of a weight ``mixed_gradients`` names go through ``tap(name, weight)``."""

    def whole_region(self, name: str, lo: int, view: torch.Tensor, numel: int) -> Held | Pieces | Blocks | None:
        """Where elements [lo, lo + len(view)) of this rank's flattened ``name`` (``numel`` elements) sit in the whole
        parameter, counting only what this rank hands over (None: this transform does not reshape it)."""
        return None

    def held_region(self, name: str, lo: int, view: torch.Tensor, numel: int) -> Held | Pieces | Blocks | None:
        """As ``whole_region``, every element this rank holds, those other ranks also hold and hand over included."""
        return self.whole_region(name, lo, view, numel)

    def whole_shape(self, name: str) -> tuple[int, ...] | None:
        """The whole parameter's shape, where this rank holds a part of ``name`` cut by this transform."""
        return None

    def replicas(self, name: str) -> Replicas | None:
        """The ranks of this axis holding the same values of ``name`` as this one (None: no other)."""
        return None

    def after_load(self, name: str, lo: int, view: torch.Tensor) -> None:
        """What follows a load of this rank's elements [lo, lo + len(view)) of ``name`` beyond sharing replicas."""

    def sees_own_tokens(self) -> bool:
        """Whether this rank's per-token figures (a router's counts) are its own, not another rank's copy."""
        return True

    def take_meters(self) -> AxisMeters:
        """This step's figures (once per step: every rank calls it)."""
        return AxisMeters()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Traffic inside is not counted (held-out evaluation)."""
        yield


def replace_module(model: nn.Module, name: str, kind: type[nn.Module], **attributes: object) -> nn.Module:
    """Put in the place of module ``name`` of ``model`` an instance of ``kind`` (a subclass of its class) that holds
    the same parameters, buffers, hooks and attributes, and ``attributes`` besides; return it. A transform changes
    what a module of the model's plan runs this way, under the module's own name (its parameters keep theirs)."""
    old = model.get_submodule(name)
    new = kind.__new__(kind)
    new.__dict__.update(old.__dict__)
    for key, value in attributes.items():
        setattr(new, key, value)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
    return new


class GroupReplicas(Replicas):
    """Every rank of an axis holds the same values."""

    def __init__(self, axis: World):
        self.axis = axis

    @property
    def is_first(self) -> bool:
        return self.axis.rank == 0

    def share(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        if self.axis.world_size > 1:
            dist.broadcast(tensor, src=self.axis.global_rank(0), group=self.axis.group)


class Compile(Transform):
    """``torch.compile`` of the split, checkpointed model (traced at its first forward)."""

    name = "compile"

    @classmethod
    def on(cls, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings, saved: SavedBytes) -> Compile | None:
        return cls() if loop.compile else None

    def split(self, model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
        model.compile()
        return plan


def kinds() -> tuple[type[Transform], ...]:
    """Every transform a layout can apply, in the order they apply: the one list (``transforms`` makes from it those
    a layout asks for; ``lab.parallel.step_line`` shows the fragments of all of them)."""
    from lab.parallel.axes import activations, context, experts, pipeline, tensor

    return (tensor.TensorParallel, context.ContextParallel, experts.ExpertParallel, pipeline.Pipeline,
            activations.Checkpointing, Compile)


def transforms(mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings, saved: SavedBytes,
               values: torch.dtype = torch.float32) -> list[Transform]:
    """The transforms ``cfg`` asks for on ``mesh``, in the order they apply (the data-parallel placement follows);
    ``values``: the hidden states' dtype (``Transform.values``)."""
    out = [transform for kind in kinds() if (transform := kind.on(mesh, cfg, loop, saved)) is not None]
    for transform in out:
        transform.values = values
    return out
