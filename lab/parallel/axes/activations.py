"""Activation checkpointing for every strategy, and the meter of what autograd saves for backward.

``parallel.activation_checkpointing``:

- ``none``: autograd keeps what each op saves;
- ``full``: each of the plan's units (a transformer's blocks) keeps only its input and recomputes its
  forward during the backward (non-reentrant ``torch.utils.checkpoint``), and so does the plan's
  head (final norm, head and loss: the logits are often the largest activation of all);
- ``selective``: inside each unit the outputs of the expensive ops (matmuls and attention) are
  kept and the cheap ones (norms, activations, element-wise ops) recomputed, with torch's
  selective checkpoint policy.

Each unit is replaced, through the plan, by an instance of a checkpointed subclass of its own class holding the same
parameters, hooks and attributes (``lab.parallel.axes.replace_module``), so parameter names and module hooks stay as
they were: a sharding strategy that gathers a unit's weights around its forward sees the same module. The head is a
method of the model: under ``full`` the model becomes an instance of a subclass of its own class whose head method
runs checkpointed (as ``fully_shard`` makes a module it shards an instance of a subclass).

``SavedBytes`` counts, with saved-tensor hooks, the bytes autograd keeps for the backward of one
micro-step: every saved tensor that is not a parameter (distinct storages once), plus under
checkpointing the block inputs kept for the recomputation and, under ``selective``, the op
outputs the policy keeps. That is the activation memory a micro-step holds at the end of its
forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lab.runtime import compat
from lab.model.plan import ParallelPlan
from lab.parallel.axes import Transform, replace_module

if TYPE_CHECKING:
    from lab.parallel.layout import LoopSettings, Mesh
    from lab.runtime.config import ParallelConfig

MODES = ("none", "full", "selective")

# Kept under selective checkpointing: their recomputation is what costs.
EXPENSIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def _keep_expensive(meter: SavedBytes, ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    if op not in EXPENSIVE:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not getattr(ctx, "is_recompute", True):  # what the forward keeps
        for t in compat.tree_leaves(getattr(ctx, "op_output", ())):
            if isinstance(t, torch.Tensor):
                meter.add(t)
    return CheckpointPolicy.MUST_SAVE


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for one without a plain storage (a DTensor's, a freed one)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


class SavedBytes:
    """Bytes saved for backward in the micro-steps run under ``counting``; ``take`` returns the largest."""

    def __init__(self) -> None:
        self._current = self._largest = 0
        self._seen: set[int] = set()

    def add(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is not None and storage[0] not in self._seen:
            self._seen.add(storage[0])
            self._current += storage[1]

    @contextmanager
    def counting(self, module: nn.Module) -> Iterator[None]:
        """Count what the forward inside saves (parameters excluded, each storage once)."""
        self._current, self._seen = 0, set()
        # A parameter is saved as itself or as a view of it (``weight.t()``); its storage may be one gathered
        # mid-forward, so parameters are told by identity, which sharding keeps, not by storage.
        params = {id(p) for p in module.parameters()}

        @torch.compiler.disable  # bookkeeping: dynamo would guard on every tensor's identity and recompile
        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in params and (t._base is None or id(t._base) not in params):
                self.add(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._largest = max(self._largest, self._current)

    @property
    def current(self) -> int:
        """Bytes counted so far in the current ``counting`` context."""
        return self._current

    def fresh(self) -> int:
        """Start a forward of its own inside the context (a pipeline's microbatch): storages it saves count even
        where the allocator reuses the address of one an earlier forward saved and its backward freed; returns
        ``current``."""
        self._seen = set()
        return self._current

    def take(self) -> int:
        largest, self._largest = self._largest, 0
        return largest


class Checkpointing(Transform):
    """Activation checkpointing of the plan's units (``parallel.activation_checkpointing``)."""

    name = "ac"

    @classmethod
    def on(cls, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings, saved: SavedBytes) -> Checkpointing | None:
        mode = cfg.activation_checkpointing
        return cls(mode, saved) if mode != "none" else None

    def __init__(self, mode: str, meter: SavedBytes):
        self.mode, self.meter = mode, meter

    def split(self, model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
        apply(model, plan, self.mode, self.meter)
        return plan


def apply(model: nn.Module, plan: ParallelPlan, mode: str, meter: SavedBytes) -> None:
    """Wrap each of the plan's units (and under ``full`` its head) for ``mode`` (see the module docstring)."""
    if mode == "none":
        return
    context_fn = (functools.partial(create_selective_checkpoint_contexts, functools.partial(_keep_expensive, meter))
                  if mode == "selective" else None)
    for name in plan.units:
        replace_module(model, name, checkpointed(type(model.get_submodule(name))), checkpoint_meter=meter,
                       checkpoint_context=context_fn)
    if mode == "full" and plan.head is not None:
        model.__class__ = checkpointed_head(type(model), plan.head)
        model.checkpoint_meter = meter


class Checkpointed(nn.Module):
    """What a checkpointed unit adds to its class: its own forward, under ``torch.utils.checkpoint``."""

    checkpoint_meter: SavedBytes
    checkpoint_context: Callable | None

    def forward(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        return _checkpointed(super().forward, self.checkpoint_meter, self.checkpoint_context, x, *args)


_CHECKPOINTED: dict[type[nn.Module], type[nn.Module]] = {}


def checkpointed(kind: type[nn.Module]) -> type[nn.Module]:
    """``kind`` whose forward runs under activation checkpointing: one subclass per class, made once."""
    if kind not in _CHECKPOINTED:
        _CHECKPOINTED[kind] = type(f"Checkpointed{kind.__name__}", (Checkpointed, kind), {})
    return _CHECKPOINTED[kind]


_HEADS: dict[tuple[type[nn.Module], str], type[nn.Module]] = {}


def checkpointed_head(kind: type[nn.Module], head: str) -> type[nn.Module]:
    """``kind`` whose method ``head`` runs under activation checkpointing: one subclass per class and head, made once."""
    if (kind, head) not in _HEADS:
        def run(self: nn.Module, x: torch.Tensor, *args: object) -> torch.Tensor:
            return _checkpointed(getattr(super(subclass, self), head), self.checkpoint_meter, None, x, *args)

        subclass = type(f"CheckpointedHead{kind.__name__}", (kind,), {head: run})
        _HEADS[(kind, head)] = subclass
    return _HEADS[(kind, head)]


def _checkpointed(forward: Callable[..., torch.Tensor], meter: SavedBytes, context_fn: Callable | None,
                  x: torch.Tensor, *args: object) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return forward(x, *args)
    meter.add(x)  # kept for the recomputation
    if context_fn is None:
        return checkpoint(forward, x, *args, use_reentrant=False)
    return checkpoint(forward, x, *args, use_reentrant=False, context_fn=context_fn)
