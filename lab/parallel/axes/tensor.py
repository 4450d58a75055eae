"""Tensor and sequence parallelism by hand (Megatron-LM style), a step applied to the built model.

``parallel.tp N`` splits each transformer block across the N ranks of a tensor-parallel group
(Shoeybi et al. 2019), rewriting the model ``lab.model`` built in place, under its own parameter
names (each now holding this rank's shard):

- **column-parallel** (output features split): the fused QKV (each rank its share of the query
  heads and of the key/value heads: GQA's kv heads split with them, or, when there are fewer than N,
  replicated: each rank holds the one its query heads use, and the gradients of a replica are summed
  over the ranks holding it, ``_SumOverReplicas``), the MLP's up projection (and
  the gate of SwiGLU, split alike so ``chunk(2)`` still finds gate and up). The input passes through
  **f** (identity forward, all-reduce of the gradient backward);
- **row-parallel** (input features split): the attention output and the MLP's down projection;
  their partial outputs pass through **g** (all-reduce forward, identity backward), the bias added
  after it. Per block that is two all-reduces of b·s·h forward and two backward;
- **vocabulary-parallel** embedding (each rank its rows of the table; ids outside them give zeros;
  the partial embeddings summed by g) and output head (tied or not, the same rows), and a
  **cross-entropy** computed from each rank's slice of the logits with three small all-reduces
  (max, sum of exponentials, target logit) per token: the full logits never exist on a rank.
  Only ``model.output`` without targets (sampling) gathers them.

``parallel.sequence_parallel true`` (Korthikanti et al. 2022) keeps the residual stream split along
the sequence between the blocks' matmuls: norms, dropout and residual adds run on 1/N of the tokens;
f becomes an all-gather along the sequence (its backward a reduce-scatter) and g a reduce-scatter
(its backward an all-gather), the same bytes as the all-reduces they replace. The weights that act
on sequence shards (norms, learned positions, the row-parallel biases) see only this rank's tokens:
they pass through f themselves, so their gradient is summed over the group in the backward.

Every weight not split is whole on every rank and gets the same gradient there (sequence parallel:
after f's sum); the global gradient norm counts it once (on the group's first rank) and adds the
split ones over the group. Weights and their initial values: ``initial_value(name)`` returns this
rank's shard of the whole model's initial value, so a strategy that builds on the meta device fills
exactly the shard that slicing ``single``'s weights gives. Checkpoints store whole logical tensors (a shard
cut along the rows as ranges of the flattened weight, ``Pieces``; one cut along the columns, a row-parallel
layer's, as a rectangle of the 2-D weight, ``Blocks``), so any layout loads them.

Sums over the group add the ranks' partial products in another order than one process's matmul, so
losses match ``single`` to about 1e-6 relative, not bit for bit. Dropout draws the data-parallel
replica's masks on every rank of a group (the loop seeds by replica): replicated activations stay
equal across the group; a head shard's attention dropout shares that stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lab.measure import accounting

from lab.runtime.checkpoint import Blocks, Pieces, overlap, row_blocks
from lab.runtime.config import ConfigError, ParallelConfig
from lab.model.plan import ParallelPlan, TensorPlan
from lab.parallel.axes import AxisMeters, GroupReplicas, Transform, replace_module
from lab.parallel.comm import Comm
from lab.parallel.layout import LoopSettings, Mesh, World


IMPLEMENTATIONS = ("lab", "torch")


@dataclass(frozen=True)
class Split:
    """How one weight is cut across the group: along ``dim``, each of ``blocks`` (consecutive extents of that
    dimension, as a fused QKV's query, key and value rows) into equal parts; rank r holds part r of each, or
    (``shared``, per block: k consecutive ranks hold the same part, as GQA's key/value heads when there are
    fewer than N) part r // k, a replica: the first of its k ranks hands it over to checkpoints and exports."""

    shape: tuple[int, ...]  # the whole weight's
    dim: int
    blocks: tuple[int, ...]
    shared: tuple[int, ...] = ()  # per block, how many ranks hold each part (empty: one each)

    def sharing(self, block: int) -> int:
        return self.shared[block] if self.shared else 1

    def segments(self, rank: int, n: int) -> list[tuple[int, int, int]]:
        """(start in the shard, start in the whole weight, length) along ``dim``, block by block."""
        out, local, start = [], 0, 0
        for b, size in enumerate(self.blocks):
            k = self.sharing(b)
            part = size * k // n
            out.append((local, start + rank // k * part, part))
            local, start = local + part, start + size
        return out

    def replicas(self, rank: int, n: int) -> list[tuple[int, int, int, int]]:
        """The replicated blocks of a dim-0 split in the flattened shard: (start, length, which part, how many
        parts), each part held by the consecutive ranks that share it."""
        inner = math.prod(self.shape[1:])
        return [(local * inner, size * inner, rank // self.sharing(b), n // self.sharing(b))
                for b, (local, _, size) in enumerate(self.segments(rank, n)) if self.sharing(b) > 1]

    def take(self, whole: torch.Tensor, rank: int, n: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``whole`` (a copy; on the meta device, a meta tensor)."""
        return torch.cat([whole.narrow(self.dim, g, size) for _, g, size in self.segments(rank, n)], dim=self.dim)

    def checkpoint_pieces(self, rank: int, n: int, lo: int, view: torch.Tensor, every: bool = False) -> Pieces | Blocks:
        """Where elements [lo, lo + len(view)) of the flattened shard sit in the whole weight, counting only what this
        rank hands over (``every``: its replicated blocks too): cut along rows, ranges of the flattened whole weight
        (one per block); cut along columns, rectangles of the 2-D whole weight (one per row range of the shard, at
        most three), where its flattened rows would be one range per row and DCP's cost grows with the pieces."""
        segments = [s for b, s in enumerate(self.segments(rank, n)) if every or rank % self.sharing(b) == 0]
        if self.dim == 1:
            blocks = []
            for row, column, rect in row_blocks(sum(size for _, _, size in self.segments(rank, n)), lo, view):
                for local, start, size in segments:
                    a, b = overlap((local, local + size), (column, column + rect.shape[1]))
                    if a < b:
                        blocks.append((row, start + a - local, rect[:, a - column:b - column]))
            return Blocks(self.shape, blocks)
        hi, inner, out = lo + view.numel(), math.prod(self.shape[1:]), []
        for local, start, size in segments:
            a, b = overlap((local * inner, (local + size) * inner), (lo, hi))
            if a < b:
                out.append((start * inner + a - local * inner, view[a - lo:b - lo]))
        return Pieces(math.prod(self.shape), out)


# ---------------------------------------------------------------- the conjugate operators


def _conjugate(name: str, doc: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function of one activation that calls ``forward(tp, x)`` forward and ``backward(tp, grad)``
    backward on the group ``tp``."""

    class Operator(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
            ctx.tp = tp
            return forward(tp, x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return backward(ctx.tp, grad), None

    Operator.__name__ = Operator.__qualname__ = name
    Operator.__doc__ = doc
    return Operator


_CopyToGroup = _conjugate("CopyToGroup", "f: identity forward; the gradient summed over the group backward (an input "
                          "every rank uses whole).", lambda tp, x: x.view_as(x), lambda tp, g: tp.all_reduce(g))
_ReduceFromGroup = _conjugate("ReduceFromGroup", "g: partial outputs summed over the group forward; identity "
                              "backward.", lambda tp, x: tp.all_reduce(x), lambda tp, g: g)
_GatherSequence = _conjugate("GatherSequence", "f under sequence parallelism: the sequence shards gathered forward; "
                             "the gradient reduce-scattered backward.", lambda tp, x: tp.gather_sequence(x),
                             lambda tp, g: tp.reduce_scatter_sequence(g))
_ReduceScatterSequence = _conjugate("ReduceScatterSequence", "g under sequence parallelism: partial outputs summed "
                                    "and split along the sequence forward; gathered backward.",
                                    lambda tp, x: tp.reduce_scatter_sequence(x), lambda tp, g: tp.gather_sequence(g))


def _eager(fn: Callable) -> Callable:
    """``fn`` run eagerly under torch.compile, a graph break. ``torch.compiler.disable`` is applied only when
    compiling: applied at import it would load dynamo (about a second) into every run, compiled or not."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)
    return call


class _SumOverReplicas(torch.autograd.Function):
    """A weight with replicated parts (GQA's key/value rows held by several ranks): identity forward; backward,
    each part's gradient summed over the ranks that hold it (each has only its query heads' share)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, split: Split, tp: TensorParallel) -> torch.Tensor:
        ctx.split, ctx.tp = split, tp
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.tp.sum_replicas(ctx.split, 0, grad.view(-1), everyone=True)
        return grad, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from each rank's columns of the logits [tokens, V/N] (columns past the vocabulary
    masked): the row max, the sum of exponentials and the target's logit are all-reduced, nothing else."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, first: int, tp: TensorParallel) -> torch.Tensor:
        top = logits.max(dim=-1).values
        tp.all_reduce_(top, dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        tp.all_reduce_(total)
        local = targets - first
        mine = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~mine, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        tp.all_reduce_(target)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, mine)
        return (total.log() - target).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        return grad_logits.mul_(grad / softmax.shape[0]), None, None, None


# ---------------------------------------------------------------- the split modules
# Each replaces a module of the model, through its plan, under the module's own name (``replace_module``): an instance
# of a subclass of the module's class (a linear layer is still an ``nn.Linear``) holding the same parameters, now
# this rank's shard.


class ColumnParallelLinear(nn.Linear):
    """Its share of the output features: the input through f; replicated rows' gradients summed over their ranks."""

    tp: TensorParallel
    weight_split: Split
    bias_split: Split | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.weight_split.shared:  # replicated rows: their gradients summed over their ranks
            weight = _SumOverReplicas.apply(weight, self.weight_split, self.tp)
            bias = bias if bias is None else _SumOverReplicas.apply(bias, self.bias_split, self.tp)
        return F.linear(self.tp.enter(x), weight, bias)


class RowParallelLinear(nn.Linear):
    """Its share of the input features: the partial output through g, the bias added after it."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.leave(F.linear(x, self.weight))
        return out if self.bias is None else out + self.tp.on_shards(self.bias)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the table, from vocabulary row ``first``; other ids give zeros; summed over the group
    (sequence parallel: and split)."""

    tp: TensorParallel
    first: int

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.first) | (idx >= self.first + self.weight.shape[0])
        rows = F.embedding((idx - self.first).masked_fill(outside, 0), self.weight)
        return self.tp.leave(rows.masked_fill(outside.unsqueeze(-1), 0.0))


class SequenceParallelPositions(nn.Embedding):
    """Sequence parallel: the learned positions of this rank's tokens."""

    tp: TensorParallel

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        size = positions.shape[0] // self.tp.n
        return F.embedding(positions.narrow(0, self.tp.rank * size, size), self.tp.on_shards(self.weight))


class SequenceParallelLayerNorm(nn.LayerNorm):
    """Sequence parallel: the norm of this rank's tokens, its weights' gradients summed over the group."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.tp.on_shards(self.weight), self.tp.on_shards(self.bias),
                            self.eps)


class SequenceParallelRMSNorm(nn.RMSNorm):
    """Sequence parallel: the norm of this rank's tokens, its weight's gradient summed over the group."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.tp.on_shards(self.weight), self.eps)


class VocabParallelLoss(nn.Module):
    """The loss from each rank's rows of the head (vocabulary rows from ``first``; padding rows excluded from the
    softmax), or (no targets) the logits gathered whole."""

    def __init__(self, tp: TensorParallel, first: int, vocab_size: int, divisor: float):
        super().__init__()
        self.tp, self.first, self.vocab_size, self.divisor = tp, first, vocab_size, divisor

    def forward(self, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        logits = F.linear(self.tp.enter(x), weight)
        if self.divisor != 1:
            logits = logits / self.divisor
        real = min(max(self.vocab_size - self.first, 0), logits.shape[-1])  # this rank's rows within the vocabulary
        if real < logits.shape[-1]:  # padding rows: never a target, excluded from the softmax
            padding = torch.arange(real, logits.shape[-1], device=logits.device)
            logits = logits.float().index_fill(-1, padding, float("-inf"))
        if targets is None:
            whole = logits.new_empty((self.tp.n, *logits.shape))
            self.tp.comm.all_gather(whole.view(-1), logits.contiguous().view(-1))
            return torch.cat(whole.unbind(0), dim=-1)[..., :self.vocab_size]
        return _VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), targets.flatten(), self.first, self.tp)


# ---------------------------------------------------------------- the step


class TensorParallel(Transform):
    """The tensor-parallel group of this rank, the rewrite of the model, and what follows from it."""

    name = "tp"
    implementation = "lab"

    @classmethod
    def on(cls, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings, saved: object) -> TensorParallel | None:
        """The tensor-parallel transform of ``cfg`` (``parallel.tp_impl``'s) on the mesh's tp axis."""
        if mesh.tp.world_size == 1:
            return None
        from lab.parallel.axes.tensor_torch import TorchTensorParallel

        kind = TorchTensorParallel if cfg.tp_impl == "torch" else TensorParallel
        return kind(mesh.tp, cfg.sequence_parallel, loop, mesh.data.world_size)

    def __init__(self, world: World, sequence_parallel: bool, loop: LoopSettings | None = None,
                 data_ranks: int = 1):
        self.world, self.n, self.rank = world, world.world_size, world.rank
        self.data_ranks = data_ranks  # the data-parallel strategy's ranks beside each of this group's
        self.sequence_parallel, self.loop = sequence_parallel, loop
        self.comm = Comm(self.n, self.world.group, axis="tp")  # a failure names the axis
        self.splits: dict[str, Split] = {}  # parameter name → how it is cut
        self.plan: TensorPlan | None = None
        self.model: nn.Module | None = None
        self.backwards = 1  # per micro-step (a pipeline's microbatches: set by ``running``)
        self.token_share_of_rank = 1.0  # of each sequence's tokens (a context-parallel shard's: set by ``running``)
        self._last_bytes = dict.fromkeys(accounting.COLLECTIVES, 0.0)
        self._whole = GroupReplicas(self.world)

    def describe(self, layout: str) -> str:
        sequence = ", sequence parallel" if self.sequence_parallel else ""
        return f"{layout} (tp {self.n}{sequence} × dp {self.data_ranks})"

    def split(self, model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
        if plan.tensor is None:
            raise ConfigError(f"parallel.tp > 1: the model ({type(model).__name__}) declares no tensor plan")
        self.plan, self.model = plan.tensor, model
        self.parallelize(model, plan)
        return dataclasses.replace(plan, initial_value=functools.partial(self._initial_value, plan.initial_value))

    # ------------------------------------------------------------ collectives (counted on the group's Comm)
    # Under torch.compile they run eagerly (``_eager``: dynamo breaks the graph there instead of tracing the
    # bookkeeping and recompiling for every tensor it guards on).

    @_eager
    def all_reduce_(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        self.comm.all_reduce(x, op=op)
        return x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_(x.clone(memory_format=torch.contiguous_format))

    @_eager
    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T/N, ...] shards → [B, T, ...], rank r's shard at tokens [r·T/N, (r+1)·T/N)."""
        shard = x.transpose(0, 1).contiguous()
        whole = shard.new_empty((self.n * shard.shape[0], *shard.shape[1:]))
        self.comm.all_gather(whole.view(-1), shard.view(-1))
        return whole.transpose(0, 1)

    @_eager
    def reduce_scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] partial sums → this rank's tokens of their sum, [B, T/N, ...]."""
        whole = x.transpose(0, 1).contiguous()
        shard = whole.new_empty((whole.shape[0] // self.n, *whole.shape[1:]))
        self.comm.reduce_scatter(shard.view(-1), whole.view(-1))
        return shard.transpose(0, 1)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input of a column-parallel layer: f (or the sequence all-gather)."""
        return (_GatherSequence if self.sequence_parallel else _CopyToGroup).apply(x, self)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """The partial output of a row-parallel layer: g (or the sequence reduce-scatter)."""
        return (_ReduceScatterSequence if self.sequence_parallel else _ReduceFromGroup).apply(x, self)

    def on_shards(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        """A whole weight applied to this rank's tokens only (sequence parallel): its gradient summed over the group."""
        return _CopyToGroup.apply(weight, self) if self.sequence_parallel and weight is not None else weight

    def first_replica(self, parts: int) -> bool:
        """Whether this rank is the first of those holding its part when a weight has ``parts`` distinct parts."""
        return self.rank % (self.n // parts) == 0

    def sum_replicas(self, split: Split, lo: int, view: torch.Tensor, everyone: bool) -> None:
        """Sum, in place, each replicated part of ``view`` (elements [lo, lo + len(view)) of this rank's flattened
        shard) over the ranks holding it: every one's (gradients) or the first's alone (values after a load, which
        only the first reads). One all-reduce over the group per part, each part in its own slot, the others zero;
        every rank of the group calls it with the same range."""
        hi = lo + view.numel()
        for start, length, part, parts in split.replicas(self.rank, self.n):
            a, b = overlap((start, start + length), (lo, hi))
            if a >= b:
                continue
            piece = view[a - lo:b - lo]
            slots = piece.new_zeros((parts, b - a))
            if everyone or self.first_replica(parts):
                slots[part] = piece
            self.all_reduce_(slots)
            piece.copy_(slots[part])

    # ------------------------------------------------------------ the rewrite

    def parallelize(self, model: nn.Module, plan: ParallelPlan) -> nn.Module:
        """Split ``model`` (on any device, meta included) across the group, in place, as its plan says: each split
        module replaced by its tensor-parallel kind (``replace_module``), holding this rank's shard."""
        tensor = plan.tensor
        for name, column in tensor.column.items():
            self._shard(model, name, 0, column.blocks, column.shared(self.n))
            replace_module(model, name, ColumnParallelLinear, tp=self, weight_split=self.splits[f"{name}.weight"],
                    bias_split=self.splits.get(f"{name}.bias"))
        for name in tensor.row:
            self._shard(model, name, 1, (model.get_submodule(name).in_features,))
            replace_module(model, name, RowParallelLinear, tp=self)
        tensor.split_heads(self.n)
        rows = model.get_submodule(tensor.embedding).weight.shape[0]
        self._shard(model, tensor.embedding, 0, (rows,))
        first = self.rank * rows // self.n
        replace_module(model, tensor.embedding, VocabParallelEmbedding, tp=self, first=first)
        head_owner = tensor.head_weight.rpartition(".")[0]
        if head_owner != tensor.embedding:
            self._shard(model, head_owner, 0, (rows,))
        if self.sequence_parallel:
            for name in tensor.sequence_norms:
                norm = model.get_submodule(name)
                replace_module(model, name, SequenceParallelRMSNorm if isinstance(norm, nn.RMSNorm)
                        else SequenceParallelLayerNorm, tp=self)
            if tensor.positions is not None:
                replace_module(model, tensor.positions, SequenceParallelPositions, tp=self)
        parent, _, child = tensor.loss.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                VocabParallelLoss(self, first, tensor.vocab_size, tensor.logit_divisor))
        return model

    def _shard(self, model: nn.Module, name: str, dim: int, blocks: tuple[int, ...], shared: tuple[int, ...] = ()
               ) -> nn.Module:
        """Replace the weight (and the bias of a column-parallel layer) of module ``name`` with this rank's shard."""
        module = model.get_submodule(name)
        for attr in ("weight", "bias"):
            param = getattr(module, attr, None)
            if param is None or (attr == "bias" and dim != 0):
                continue
            split = Split(tuple(param.shape), dim, blocks, shared)
            shard = split.take(param.detach(), self.rank, self.n)
            setattr(module, attr, nn.Parameter(shard, requires_grad=param.requires_grad))
            self.splits[f"{name}.{attr}"] = split
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        return module

    def _initial_value(self, whole: Callable[..., torch.Tensor], name: str) -> torch.Tensor:
        split = self.splits.get(name)
        return whole(name) if split is None else split.take(whole(name, split.shape), self.rank, self.n)

    # ------------------------------------------------------------ what follows from the split

    def counted(self, name: str, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """A split weight's elements but the replicated parts of which this rank is not the first holder (a weight
        the split leaves whole is counted by the group's first rank: ``replicas``)."""
        split = self.splits.get(name)
        if split is None or not split.shared or not ranges:
            return ranges
        kept, at = [], 0
        for start, length, _, parts in split.replicas(self.rank, self.n):
            if not self.first_replica(parts):
                kept.append((at, start))
                at = start + length
        kept.append((at, max(b for _, b in ranges)))
        return [(lo, hi) for a, b in ranges for k_lo, k_hi in kept for lo, hi in [overlap((a, b), (k_lo, k_hi))]
                if lo < hi]

    def running(self, strategy: object, model: nn.Module) -> nn.Module:
        self.backwards, self.token_share_of_rank = strategy.microbatches, strategy.token_share
        return model

    def sees_own_tokens(self) -> bool:
        """Every rank of the group runs the same tokens (without sequence parallelism): the first counts them."""
        return self.rank == 0 or self.sequence_parallel

    def replicas(self, name: str) -> GroupReplicas | None:
        """Every rank of the group holds a weight the split leaves whole."""
        return self._whole if name not in self.splits else None

    def whole_region(self, name: str, lo: int, view: torch.Tensor, numel: int) -> Pieces | Blocks | None:
        split = self.splits.get(name)
        return None if split is None else split.checkpoint_pieces(self.rank, self.n, lo, view)

    def held_region(self, name: str, lo: int, view: torch.Tensor, numel: int) -> Pieces | Blocks | None:
        split = self.splits.get(name)
        return None if split is None else split.checkpoint_pieces(self.rank, self.n, lo, view, every=True)

    def whole_shape(self, name: str) -> tuple[int, ...] | None:
        split = self.splits.get(name)
        return None if split is None else split.shape

    def after_load(self, name: str, lo: int, view: torch.Tensor) -> None:
        """A replicated part of a split weight (GQA's key/value rows), loaded by its first holder, to the others."""
        split = self.splits.get(name)
        if split is not None and split.shared:
            self.sum_replicas(split, lo, view, everyone=False)

    def take_meters(self) -> AxisMeters:
        """Seconds this step waited on the group's collectives; keeps the step's bytes for ``meters``."""
        taken = self.comm.take()
        self._last_bytes = taken.bytes
        return AxisMeters(taken.wait_s)

    def meters(self) -> dict[str, object]:
        """The group's bytes of the last step, and the bytes this rank sends per optimizer step over the group, by
        collective, in theory (ring convention) for the layers it holds (``held_layers``)."""
        theory = accounting.tensor_parallel_comm_bytes(self.plan.config, self.loop.micro_batch, self.loop.accum_steps,
                                                       self.n, self.sequence_parallel, self.values.itemsize,
                                                       layers=self.held_layers())
        return {"tp_comm_bytes_per_step": dict(self._last_bytes), "tp_comm_bytes_per_step_theory": theory}

    def held_layers(self) -> accounting.TensorLayers:
        """What this rank holds of the split: where a later transform dropped layers (a pipeline stage), the column-
        and row-parallel ones left, whether it runs the embedding (it holds it, and not merely as the head of the last
        stage of several) and the head (it holds the final norm)."""
        def held(name: str) -> bool:
            try:
                return self.model.get_submodule(name) is not None
            except AttributeError:
                return False

        column = [name for name in self.plan.column if held(name)]
        row = [name for name in self.plan.row if held(name)]
        head = held(self.plan.final_norm)
        tied_head = self.plan.head_weight.rpartition(".")[0] == self.plan.embedding
        staged = len(column) < len(self.plan.column)
        embeds = held(self.plan.embedding) and not (head and tied_head and staged)
        attention = sum(1 for name in column if self.splits[f"{name}.weight"].shared)
        return accounting.TensorLayers(len(column), len(row), attention, embeds, head, self.backwards,
                                       self.token_share_of_rank)

    def paused(self) -> contextlib.AbstractContextManager:
        return self.comm.paused()
