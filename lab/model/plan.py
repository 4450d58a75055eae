"""What a model tells the parallel transforms about itself: its plan, declared beside the model.

The transforms never name a model's attributes. They read a ``ParallelPlan``:

- ``units``: the repeated modules, in the order they run (a transformer's blocks). Activation
  checkpointing recomputes each, FSDP shards each, ZeRO-3 gathers each in pieces (``segments``).
- ``head``: the name of the model's method that maps the last hidden state to the loss (final norm,
  head, loss); ``full`` activation checkpointing recomputes it too.
- ``initial_value(name, shape)``: a parameter's or buffer's initial value, computed alone, so that a
  sharded transform can build on the meta device and fill only its shard.
- ``tensor``: how the model splits across a tensor-parallel group (``TensorPlan``); None when it
  cannot.
- ``pipeline``: how the model runs as a pipeline of stages (``PipelinePlan``); None when it cannot.
- ``experts``: its mixtures of experts, which expert parallelism splits (``ExpertPlan``); None for a dense model.
- ``context``: how it runs a shard of each sequence's tokens (``ContextPlan``); None when it cannot.

A model declares its plan with a ``parallel_plan()`` method; any other ``nn.Module`` gets
``default_plan``: its children that hold parameters are the units (those sharing a parameter with
another child stay with the root), no head, and initial values read from the module as built (or, built
on the meta device, from a copy built on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

InitialValue = Callable[..., torch.Tensor]  # (name, shape=None) -> the whole initial value, on the host


@dataclass(frozen=True)
class ColumnSplit:
    """A linear layer whose output features split across the group: each of ``blocks`` (consecutive extents of
    the rows, as a fused QKV's query, key and value rows) evenly. ``parts`` (per block; by default every row is
    one) are what a block cannot be cut inside (attention heads): a block with fewer parts than ranks is
    replicated, each part held by n / parts consecutive ranks (GQA's key/value heads)."""

    blocks: tuple[int, ...]
    parts: tuple[int, ...] = ()

    def shared(self, n: int) -> tuple[int, ...]:
        """Per block, how many of n ranks hold each part (empty: one each)."""
        parts = self.parts or self.blocks
        return tuple(max(n // p, 1) for p in parts) if any(p < n for p in parts) else ()


@dataclass(frozen=True)
class TensorPlan:
    """How the model splits across a tensor-parallel group of n ranks (Megatron-LM's layout).

    Column-parallel linears take the whole input and give their share of the features; row-parallel ones
    take that share and give partial sums. The embedding and the head split by vocabulary rows; the loss
    is computed from each rank's share of the logits (the ``loss`` module, which takes the final norm's output and
    the head's weight, is replaced). Under sequence parallelism the ``sequence_norms`` and the ``positions`` run on
    this rank's tokens. Each split module is replaced by one of its own class's tensor-parallel kind, under its own
    name, holding this rank's shard.
    """

    column: dict[str, ColumnSplit]  # module name -> its split
    row: list[str]  # module names
    embedding: str  # the token embedding (vocabulary rows)
    loss: str  # the module mapping (final norm's output, head weight, targets) to the logits or the loss
    head_weight: str  # the output head's weight (the embedding's when tied)
    final_norm: str
    sequence_norms: list[str]
    positions: str | None  # learned positions, looked up by position index
    vocab_size: int  # the logits kept (the rest are padding rows)
    logit_divisor: float  # the head's output is divided by it (μP: the width ratio m)
    split_heads: Callable[[int], None]  # tell the model's attention it now holds 1/n of its heads
    config: Any = None  # the model's configuration, for the communication formulas in ``lab.measure.accounting``


@dataclass(frozen=True)
class PipelinePlan:
    """How the model runs as a pipeline: ``embed`` on the first stage, then the ``units`` in order (a consecutive
    run of them on each stage), then ``head`` on the last. The three are names of the model's methods: ``embed``
    maps tokens to the hidden state [b, t, ``width``], ``run`` takes it through the units with the given indices,
    ``head`` maps it and the targets to the loss; ``stage`` (tokens or a hidden state, targets, unit indices, whether
    it is the first stage, whether the last) runs a stage's part of the three in one call, what a stage runs in place
    of the forward. ``first`` and ``last`` name the modules ``embed`` and ``head``
    use; a parameter of both (a tied embedding) lives on the first stage and the last. ``aux_loss``, when set, names
    the method that gives the auxiliary losses the units with the given indices left in their last training forward
    (a mixture of experts' balance losses; None when there are none), which each stage adds to the loss."""

    embed: str
    run: str
    head: str
    stage: str
    units: list[str]
    first: list[str]
    last: list[str]
    width: int
    aux_loss: str | None = None


@dataclass(frozen=True)
class ContextPlan:
    """How the model runs a shard of each sequence's tokens (context parallelism): ``attention`` names the modules
    whose ``attend`` attribute, when set, replaces their attention core (a callable of the queries, keys and values
    [b, heads, tokens, head_dim] and the score scale, to the outputs); ``positions`` the model's attribute holding the
    global positions of the tokens it runs (None: 0, 1, ...), which its learned positions and rotary tables index;
    ``length`` the sequence's tokens; ``kv_values`` the key and value values per token one attention layer holds now
    (after a tensor-parallel split: its share)."""

    attention: list[str]
    positions: str
    length: int
    kv_values: Callable[[], int]


@dataclass(frozen=True)
class ExpertPlan:
    """The model's mixture-of-experts layers (module names): each holds ``count`` experts as ``<layer>.experts.<i>``
    and runs them through its ``exchange`` attribute when that is set: a callable from the rows each expert gets
    (a list of ``count`` tensors) to their outputs, which expert parallelism sets (``lab.parallel.axes.experts``).
    ``config``: the model's configuration, for the all-to-all formula in ``lab.measure.accounting``."""

    layers: list[str]
    count: int
    config: Any = None


@dataclass(frozen=True)
class ParallelPlan:
    units: list[str]
    initial_value: InitialValue
    head: str | None = None
    tensor: TensorPlan | None = None
    pipeline: PipelinePlan | None = None
    experts: ExpertPlan | None = None
    context: ContextPlan | None = None


def plan_of(module: nn.Module, factory: Callable[[], nn.Module]) -> ParallelPlan:
    """The module's own plan, or the default one (``factory`` built ``module``: a module with no plan built on
    the meta device takes its initial values from a copy the factory builds on the host)."""
    declared = getattr(module, "parallel_plan", None)
    if callable(declared):
        return declared()
    on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    return default_plan(module, host_initial_value(factory) if on_meta else _own_values(module))


def default_plan(module: nn.Module, initial_value: InitialValue) -> ParallelPlan:
    """Units: the children holding parameters that no other child shares."""
    owners: dict[int, set[str]] = {}
    for child_name, child in module.named_children():
        for p in child.parameters():
            owners.setdefault(id(p), set()).add(child_name)
    shared = {child for names in owners.values() if len(names) > 1 for child in names}
    units = [name for name, child in module.named_children()
             if name not in shared and any(True for _ in child.parameters())]
    return ParallelPlan(units=units, initial_value=initial_value)


def _own_values(module: nn.Module) -> InitialValue:
    """The module's values as they are now, by name."""
    values = {name: t.detach() for name, t in [*module.named_parameters(), *module.named_buffers()]}
    return lambda name, shape=None: values[name].cpu().clone()


def host_initial_value(factory: Callable[[], nn.Module]) -> InitialValue:
    """The values of one copy ``factory`` builds on the host."""
    with torch.device("cpu"):
        return _own_values(factory())


def segments(module: nn.Module, plan: ParallelPlan) -> list[list[str]]:
    """The plan's units cut into pieces ZeRO-3 gathers one at a time, as module names in the order they run:
    each unit's children that hold parameters, cut after every child that holds a matrix (a transformer block's
    ``[norm1, attn]`` and ``[norm2, mlp]``); a unit with no such children is one piece."""
    out: list[list[str]] = []
    for unit_name in plan.units:
        unit = module.get_submodule(unit_name)
        children = [(f"{unit_name}.{n}", c) for n, c in unit.named_children() if any(True for _ in c.parameters())]
        if not children:
            out.append([unit_name])
            continue
        current: list[str] = []
        for name, child in children:
            current.append(name)
            if any(p.dim() >= 2 for p in child.parameters()):
                out.append(current)
                current = []
        if current:
            out.append(current)
    return out
