"""What each rank holds, and everything read from that record, written once for every layout.

A strategy says what this rank holds of every parameter (``Strategy.holding``): per parameter a ``Piece``, a range of
the flattened local weight with its gradient, AdamW moments and fp32 master. The transforms say which ranks of their
axes hold the same values (``replicas``) and where a local part sits in the whole parameter (``whole_region``). From
the two, the functions here compute the global gradient norm, the finiteness check, the checkpoint state and the
export: a part that several ranks hold is counted, handed over and exported by the first of them alone, and given
back to the others after a load.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.parallel.axes import Replicas, Transform
from lab.parallel.layout import World
from lab.runtime.checkpoint import Blocks, CheckpointState, Held, Pieces

Region = Held | Pieces | Blocks | torch.Tensor


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
    moment_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")  # where it has no moments: its optimizer's (Muon's:
    # momentum_buffer), named empty so that every rank names the same entries

    @property
    def value(self) -> torch.Tensor:
        """The weight at full precision: the master where there is one."""
        return self.weight if self.master is None else self.master

    def views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight (its master, if any) and, where it has them (a sharded piece: always, possibly empty), its
        optimizer's moments (AdamW's two, Muon's momentum), flat."""
        yield f"model/{self.name}", self.value
        if self.moments is None and not self.sharded:
            return
        hi = self.moments_lo + self.weight.numel()
        keys = self.moment_keys if self.moments is None else [k for k in MOMENTS if k in self.moments]
        for key in keys:
            view = self.moments[key].view(-1)[self.moments_lo:hi] if self.moments is not None else torch.empty(0)
            yield f"optim/{self.name}/{key}", view


MOMENTUM = ("momentum_buffer",)  # Muon's moment (``Piece.moment_keys``)
MOMENTS = ("exp_avg", "exp_avg_sq", *MOMENTUM)  # every optimizer's, in the order checkpoints name them


def materialize_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state for parameters that have none yet, as torch does at the first step (AdamW's
    moments, or Muon's momentum in a Muon group), so a checkpoint can be loaded into a fresh optimizer (zeros: the
    loaded values replace them)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            if group.get("muon"):
                optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
                continue
            on_device = group.get("fused") or group.get("capturable")
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def replicas_of(piece: Piece, transforms: Sequence[Transform]) -> list[Replicas]:
    """Every group of ranks that holds the same values of ``piece`` as this rank."""
    found = [piece.replicas] if piece.replicas is not None and not piece.sharded else []
    return found + [r for t in transforms if (r := t.replicas(piece.name)) is not None]


def handed_over(piece: Piece, transforms: Sequence[Transform]) -> bool:
    """Whether this rank is the first of every group holding the same values of ``piece``."""
    return all(r.is_first for r in replicas_of(piece, transforms))


def gradient_squares(pieces: list[Piece], transforms: Sequence[Transform], device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global gradient norm: the squares of the gradient it holds where it is the first
    of the ranks holding the same values, over the parts each transform lets it count (a split weight's replicated rows
    once). Summed over every rank of the run, the squared norm."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for piece in pieces:
        if piece.grad is not None and handed_over(piece, transforms):
            add_counted_squares(squares, piece.name, piece.grad, piece.lo, transforms)
    return squares


def add_counted_squares(squares: torch.Tensor, name: str, grad: torch.Tensor, lo: int,
                        transforms: Sequence[Transform]) -> None:
    """Add to ``squares`` (fp32, in place) the squares of the parts of ``grad`` (elements [lo, lo + len(grad)) of this
    rank's flattened ``name``) each transform lets this rank count."""
    ranges = [(lo, lo + grad.numel())]
    for transform in transforms:
        ranges = transform.counted(name, ranges)
    for a, b in ranges:  # a reduction: no temporary the size of the range
        squares += torch.linalg.vector_norm(grad[a - lo:b - lo], dtype=torch.float32).square().to(squares.device)


def first_of_axes(name: str, transforms: Sequence[Transform]) -> bool:
    """Whether this rank is the first of the ranks of every other axis than the data axis that hold the same values of
    ``name``."""
    return all(r.is_first for t in transforms if (r := t.replicas(name)) is not None)


@torch.no_grad()
def all_finite(pieces: list[Piece], everyone: World) -> bool:
    """Whether every weight on every rank is finite (checked before a checkpoint is written)."""
    bad = torch.tensor([float(any(not torch.isfinite(piece.weight).all() for piece in pieces))])
    return everyone.sum(bad).item() == 0


def complete_gradients(pieces: list[Piece], transforms: Sequence[Transform], module: nn.Module) -> None:
    """Each transform's finish of the synced gradients (a weight two ranks of another axis hold), on this rank's
    parts of them; a parameter no gradient reached gets a zero one."""
    by_name = {piece.name: piece for piece in pieces}

    def grad_of(name: str) -> torch.Tensor:
        piece = by_name[name]
        if piece.grad is not None:
            return piece.grad
        p = module.get_parameter(name)
        p.grad = torch.zeros_like(p)
        return p.grad.view(-1)

    for transform in transforms:
        transform.complete_gradients(grad_of)


def whole_shape(piece: Piece, transforms: Sequence[Transform]) -> tuple[int, ...]:
    """The shape of the whole parameter ``piece`` is (part of)."""
    for transform in transforms:
        shape = transform.whole_shape(piece.name)
        if shape is not None:
            return shape
    return piece.shape


def region(piece: Piece, lo: int, view: torch.Tensor, transforms: Sequence[Transform]) -> Region:
    """Where a part of ``piece`` (elements [lo, lo + len(view)) of the flattened local weight, or one of its moments)
    sits in the whole parameter, as this rank hands it over: a plain tensor when it is the whole parameter."""
    handed = view if handed_over(piece, transforms) else view[:0]
    for transform in transforms:
        found = transform.whole_region(piece.name, lo, handed, piece.numel)
        if found is not None:
            return found
    if not piece.sharded:
        return view
    return Held(piece.numel, lo if handed.numel() else 0, handed)


def checkpoint_state(pieces: list[Piece], transforms: Sequence[Transform],
                     everyone: World) -> tuple[CheckpointState, list[Callable[[], None]]]:
    """Every weight and optimizer moment as the parts of the whole flattened (or 2-D) tensors this rank hands over; an entry
    another rank holds a part of, named here with an empty part (the checkpoint builds each with a collective of every
    rank). With it, what gives each loaded part to the ranks holding the same, to run after a load."""
    state: CheckpointState = {}
    after: dict[str, Callable[[], None]] = {}
    for piece in pieces:
        replicas = replicas_of(piece, transforms)
        for key, view in piece.views():
            lo = piece.lo if view.numel() else 0
            state[key] = region(piece, lo, view, transforms)
            if not isinstance(state[key], torch.Tensor):
                after[key] = functools.partial(_share_loaded, piece.name, replicas, lo, view, transforms)
        if piece.moments is not None and "step" in piece.moments:  # AdamW's counter (Muon keeps none)
            state[f"optim/{piece.name}/step"] = piece.moments["step"]
    state = _named_everywhere(state, everyone, bool(transforms))
    return state, [after[key] for key in state if key in after]


def _share_loaded(name: str, replicas: list[Replicas], lo: int, view: torch.Tensor,
                  transforms: Sequence[Transform]) -> None:
    for group in replicas:
        group.share(view)
    for transform in transforms:
        transform.after_load(name, lo, view)


def _named_everywhere(state: CheckpointState, everyone: World, split: bool) -> CheckpointState:
    """``state`` in one order on every rank, with an empty part of each entry another rank holds a part of that this
    one lacks (a whole tensor is no collective: left to its holders). Without a transform every rank holds the same
    entries."""
    if everyone.world_size == 1 or not split:
        return state
    kinds: list[dict[str, tuple] | None] = [None] * everyone.world_size
    dist.all_gather_object(kinds, {key: _kind(value) for key, value in state.items()})
    out: CheckpointState = {}
    for key, kind in {k: v for rank in kinds for k, v in rank.items()}.items():  # in rank order
        if key in state:
            out[key] = state[key]
        elif kind[0] != "whole":
            out[key] = Held(kind[1], 0, torch.empty(0)) if kind[0] == "flat" else Blocks(kind[1], [])
    return out


@torch.no_grad()
def full_state_dict(pieces: list[Piece], transforms: Sequence[Transform], module: nn.Module,
                    everyone: World) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU under the model's names, on global rank 0 (empty elsewhere): every rank
    sends the parts it hands over (``region``), rank 0 puts them together."""
    parts = []
    for piece in pieces:
        found = region(piece, piece.lo if piece.weight.numel() else 0, piece.value, transforms)
        if isinstance(found, torch.Tensor) and not handed_over(piece, transforms):
            continue  # a whole weight: its first holder sends it
        parts.append((piece.name, whole_shape(piece, transforms), _on_host(found)))
    named = dict(module.named_parameters(remove_duplicate=False))
    buffers = {name: b.detach().cpu().clone() for name, b in module.state_dict().items() if name not in named}
    first: dict[int, str] = {}
    aliases = {n: first.setdefault(id(p), n) for n, p in named.items()}
    mine = (parts, buffers, aliases)
    if everyone.world_size == 1:
        everything = [mine]
    else:
        everything = [None] * everyone.world_size if everyone.is_main else None
        dist.gather_object(mine, everything, dst=0)
    if not everyone.is_main:
        return {}
    return _assemble(everything, list(module.state_dict()))


def _kind(value: Region) -> tuple:
    """What a rank tells the others of a checkpoint entry: whole, or parts of a flat tensor (its elements) or of a
    2-D one (its shape)."""
    if isinstance(value, torch.Tensor):
        return ("whole",)
    return ("blocks", value.shape) if isinstance(value, Blocks) else ("flat", value.numel)


def _on_host(found: Region) -> Region:
    """A copy of ``found``'s tensors on the CPU."""
    if isinstance(found, torch.Tensor):
        return found.detach().cpu().clone()
    if isinstance(found, Held):
        return Held(found.numel, found.lo, found.view.detach().cpu().clone())
    if isinstance(found, Pieces):
        return Pieces(found.numel, [(lo, v.detach().cpu().clone()) for lo, v in found.pieces])
    return Blocks(found.shape, [(r, c, v.detach().cpu().clone()) for r, c, v in found.blocks])


def _tensors(found: Held | Pieces | Blocks) -> list[torch.Tensor]:
    if isinstance(found, Held):
        return [found.view]
    return [v for _, v in found.pieces] if isinstance(found, Pieces) else [v for _, _, v in found.blocks]


def _assemble(everything: list, order: list[str]) -> dict[str, torch.Tensor]:
    """Whole weights from every rank's (parts, buffers, aliases), under the model's names: rank 0's module order
    first, then any other name in rank order."""
    whole: dict[str, torch.Tensor] = {}
    for parts, _, _ in everything:
        for name, shape, found in parts:
            if isinstance(found, torch.Tensor):
                whole.setdefault(name, found.view(shape))
                continue
            tensors = [t for t in _tensors(found) if t.numel()]
            if not tensors:
                continue
            target = whole.setdefault(name, torch.zeros(shape, dtype=tensors[0].dtype))
            if isinstance(found, Blocks):
                for row, column, rect in found.blocks:
                    target[row:row + rect.shape[0], column:column + rect.shape[1]] = rect
            else:
                flat = target.view(-1)
                for lo, view in found.pieces if isinstance(found, Pieces) else [(found.lo, found.view)]:
                    flat[lo:lo + view.numel()] = view
    for _, buffers, aliases in everything:
        for name, value in buffers.items():
            whole.setdefault(name, value)
        for alias, first in aliases.items():
            if alias not in whole and first in whole:
                whole[alias] = whole[first].clone()
    out = {name: whole[name] for name in order if name in whole}
    return out | {name: value for name, value in whole.items() if name not in out}
