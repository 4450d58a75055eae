"""Context parallelism by hand: each sequence's tokens split over the ``cp`` ranks, attention as a ring.

``parallel.cp N`` cuts every sequence of the micro-batch into N shards along the tokens: a rank runs every layer on
its own tokens, and only attention needs the others'. Each rank keeps its queries and passes key/value blocks
around the ring of its cp group (point-to-point sends to the next rank, receives from the previous one, N − 1 of
each per layer), attending to each block as it arrives; the partial outputs merge by the log-sum-exp rescaling of
online softmax (Liu et al. 2023, ring attention; the flash-attention merge). The backward runs the ring again: the
key/value blocks travel with the gradients accumulated for them, and a last hop takes each block's gradients home.
Each block's attention is torch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, which takes the merged output and log-sum-exp: the global softmax); grouped-query attention sends the
key/value heads only and expands them for the product.

Causal masking with load balancing (``parallel.cp_split zigzag``, the split of Llama 3 and torchtitan): the sequence
is cut into 2N chunks and rank r holds chunks r and 2N − 1 − r, so every rank scores as many query-key pairs; a
chunk attends fully to earlier chunks, causally to itself, not at all to later ones. ``contiguous`` gives rank r the
r-th of N chunks (the last rank then does N times the first one's work): kept to measure against. ``cp_impl
allgather`` is the reference: every rank gathers all keys and values (an all-gather per layer, its gradients
reduce-scattered back) and attends with a mask of the global positions; it needs the whole sequence's keys and
values on every rank.

The model declares what the split needs in its plan (``lab.model.plan.ContextPlan``): the attention modules whose
``attend`` this sets, and the attribute that holds the global positions of the tokens the model runs (learned
positions and RoPE index them). The loss of a shard is the mean over its tokens; every shard has as many, so the
mean over the data axis (dp × cp: the strategy averages the gradients over it, and the loop the logged loss) is the
sequence's. The meters: key/value bytes each rank sent (measured from the tensors sent) beside theory, and the
query-key pairs each rank scored (counted from the blocks it ran), whose largest over their mean is 1 when balanced.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.model.plan import ContextPlan, ParallelPlan
from lab.parallel.axes import AxisMeters, Transform
from lab.parallel.comm import Pausable, naming_axis
from lab.parallel.layout import LoopSettings, Mesh, World
from lab.runtime.config import ConfigError, ParallelConfig

SPLITS = ("zigzag", "contiguous")
IMPLEMENTATIONS = ("ring", "allgather")
_on_cp = naming_axis("cp")  # a failed send or receive names the axis: a rank of the ring died or did not answer
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def chunks(length: int, rank: int, n: int, split: str) -> list[tuple[int, int]]:
    """The chunks of a sequence of ``length`` tokens that rank ``rank`` of ``n`` holds, as (chunk index, chunk size):
    two of 2n (zigzag: r and 2n − 1 − r) or one of n (contiguous: r)."""
    if split == "zigzag":
        size = length // (2 * n)
        return [(rank, size), (2 * n - 1 - rank, size)]
    return [(rank, length // n)]


def token_indices(length: int, rank: int, n: int, split: str) -> torch.Tensor:
    """The global positions of the tokens rank ``rank`` holds, in the order it holds them."""
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c, size in chunks(length, rank, n, split)])


class ContextParallel(Pausable, Transform):
    """This rank's shard of every sequence, the ring that brings it the others' keys and values, and its meters."""

    name = "cp"

    @classmethod
    def on(cls, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings, saved: object) -> ContextParallel | None:
        return cls(mesh.cp, cfg, loop) if mesh.cp.world_size > 1 else None

    def __init__(self, axis: World, cfg: ParallelConfig, loop: LoopSettings):
        self.axis, self.rank, self.n = axis, axis.rank, axis.world_size
        self.split_name, self.implementation, self.loop = cfg.cp_split, cfg.cp_impl, loop
        self.checkpointing = cfg.activation_checkpointing
        self.model: nn.Module | None = None
        self.plan: ContextPlan | None = None
        self.sent_bytes = 0  # key/value blocks and their gradients sent since the last take
        self.pairs = 0  # query-key pairs scored since the last take
        self.wait_s = 0.0
        self.last: dict[str, object] = {}

    def describe(self, layout: str) -> str:
        how = "ring attention" if self.implementation == "ring" else "all-gather attention"
        return f"{layout} (cp {self.n}, {self.split_name} split, {how})"

    def split(self, model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
        if plan.context is None:
            raise ConfigError(f"parallel.cp > 1: the model ({type(model).__name__}) declares no context plan")
        self.model, self.plan = model, plan.context
        attend = self._ring if self.implementation == "ring" else self._gathered
        for name in plan.context.attention:
            model.get_submodule(name).attend = attend
        return plan

    def running(self, strategy: object, model: nn.Module) -> nn.Module:
        return _Sharded(self, model)

    def token_share(self) -> float:
        return 1 / self.n

    def micro_batch_parts(self) -> World:
        """A micro-batch's gradient is the sum of its shards' (each weighted by its share of the tokens)."""
        return self.axis

    # ------------------------------------------------------------ the shard

    def indices(self, length: int, device: torch.device) -> torch.Tensor:
        return token_indices(length, self.rank, self.n, self.split_name).to(device)

    @contextlib.contextmanager
    def positioned(self, positions: torch.Tensor) -> Iterator[None]:
        """The model runs the tokens at ``positions`` inside."""
        setattr(self.model, self.plan.positions, positions)
        try:
            yield
        finally:
            setattr(self.model, self.plan.positions, None)

    @_on_cp
    def gather_logits(self, logits: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's logits of its tokens, put back in the sequence's order (inference: sampling, comparisons)."""
        parts = [torch.empty_like(logits) for _ in range(self.n)]
        dist.all_gather(parts, logits.contiguous(), group=self.axis.group)
        whole = logits.new_empty((logits.shape[0], length, *logits.shape[2:]))
        for rank, part in enumerate(parts):
            whole[:, token_indices(length, rank, self.n, self.split_name).to(logits.device)] = part
        return whole

    # ------------------------------------------------------------ ring attention

    def _local(self, length: int) -> list[tuple[int, slice]]:
        """This rank's chunks as (chunk index, slice of its tokens)."""
        out, at = [], 0
        for c, size in chunks(length * self.n, self.rank, self.n, self.split_name):
            out.append((c, slice(at, at + size)))
            at += size
        return out

    def _blocks(self, length: int, source: int) -> list[tuple[slice, slice, bool]]:
        """The (query slice, key slice, causal) pairs this rank scores against rank ``source``'s keys: a chunk attends
        to earlier chunks fully and to itself causally."""
        theirs = []
        at = 0
        for c, size in chunks(length * self.n, source, self.n, self.split_name):
            theirs.append((c, slice(at, at + size)))
            at += size
        return [(qs, ks, qc == kc) for qc, qs in self._local(length) for kc, ks in theirs if kc <= qc]

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self, scale)

    def _gathered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """The reference: every rank's keys and values gathered (in sequence order), attended with a causal mask of
        the global positions."""
        length = q.shape[2]
        kv = _GatherKV.apply(torch.stack([k, v]), self)
        keys = torch.cat([token_indices(length * self.n, r, self.n, self.split_name) for r in range(self.n)])
        order = torch.argsort(keys).to(q.device)
        k, v = kv[0][:, :, order], kv[1][:, :, order]
        mine = self.indices(length * self.n, q.device)
        mask = torch.arange(length * self.n, device=q.device)[None, :] <= mine[:, None]
        if not self._paused:
            self.pairs += int(mask.sum()) * q.shape[0] * q.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])

    @_on_cp
    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` to the next rank of the ring; what the previous one sent, in a buffer like it."""
        received = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send.contiguous(), self.axis.global_rank((self.rank + 1) % self.n),
                          self.axis.group),
               dist.P2POp(dist.irecv, received, self.axis.global_rank((self.rank - 1) % self.n), self.axis.group)]
        started = time.perf_counter()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if not self._paused:
            self.sent_bytes += send.numel() * send.element_size()
            self.wait_s += time.perf_counter() - started
        return received

    def count(self, pairs: int) -> None:
        if not self._paused:
            self.pairs += pairs

    # ------------------------------------------------------------ meters

    def theory_bytes(self, tokens: int, layers: int, kv_values: int, bytes_per_value: int | None = None) -> float:
        """Key/value bytes one rank sends per optimizer step: per layer and micro-step, (cp − 1) blocks of
        b · s/cp · 2 · kv_heads · head_dim (``kv_values`` per token) forward (once more under activation
        checkpointing's recomputation), and backward the blocks again (cp − 1) with their gradients (cp: the last hop
        takes them home); the reference all-gathers each block forward and reduce-scatters its gradient backward,
        (cp − 1) blocks each."""
        block = tokens // self.n * kv_values * (bytes_per_value or self.values.itemsize)
        forwards = 1 if self.checkpointing == "none" else 2
        per_layer = (forwards * (self.n - 1) + 2 * self.n - 1) * block if self.implementation == "ring" else \
            (forwards + 1) * (self.n - 1) * block
        return self.loop.accum_steps * layers * per_layer

    @_on_cp
    def take_meters(self) -> AxisMeters:
        """The bytes sent and the pairs scored since the last take; every rank's pairs, gathered (the balance)."""
        mine = torch.tensor([float(self.pairs)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.n)]
        dist.all_gather(every, mine, group=self.axis.group)
        pairs = [float(t.item()) for t in every]
        mean = sum(pairs) / self.n
        theory = self.theory_bytes(self.loop.micro_batch * self.plan.length, self.plan_layers(), self.plan.kv_values())
        self.last = {"cp_kv_bytes": self.sent_bytes, "cp_kv_bytes_theory": theory, "cp_pairs": pairs,
                     "cp_work_max_over_mean": max(pairs) / mean if mean else 0.0}
        wait, self.wait_s, self.sent_bytes, self.pairs = self.wait_s, 0.0, 0, 0
        return AxisMeters(wait, dict(self.last))

    def plan_layers(self) -> int:
        """Attention layers this rank holds (a pipeline stage holds some)."""
        return sum(1 for name in self.plan.attention if _held(self.model, name))

    def meters(self) -> dict[str, object]:
        return {f"{key}_per_step" if "bytes" in key else key: value for key, value in self.last.items()}


def _held(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


class _Sharded(nn.Module):
    """What the forward calls under context parallelism: this rank's tokens of every sequence, at their positions;
    without targets (inference), the logits of the whole sequence."""

    def __init__(self, cp: ContextParallel, inner: nn.Module):
        super().__init__()
        self.cp = cp
        self.inner = inner  # a child, so that eval() and train() reach it

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        length = x.shape[1]
        mine = self.cp.indices(length, x.device)
        with self.cp.positioned(mine):
            out = self.inner(x[:, mine], None if y is None else y[:, mine])
        return out if y is not None else self.cp.gather_logits(out, length)


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for their query heads (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient of expanded key/value heads summed back to the heads themselves."""
    if grad.shape[1] == kv_heads:
        return grad
    b, h, t, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, t, d).sum(dim=2)


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries, merged by their log-sum-exps (online softmax; a log-sum-exp of −inf
    is no attention yet)."""
    merged = torch.logaddexp(lse, part_lse)
    return (out * (lse - merged).exp().unsqueeze(-1) + part * (part_lse - merged).exp().unsqueeze(-1)), merged


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys and values, the blocks passed around the ring."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                scale: float | None) -> torch.Tensor:
        length, heads, n = q.shape[2], q.shape[1], cp.n
        out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(n):
            source = (cp.rank - step) % n
            ahead = cp.exchange(kv) if step < n - 1 else None  # the next block, while this one is scored
            keys, values = _expand(kv[0], heads), _expand(kv[1], heads)
            for qs, ks, causal in cp._blocks(length, source):
                part, part_lse = _flash(q[:, :, qs], keys[:, :, ks], values[:, :, ks], 0.0, causal, scale=scale)
                out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], part, part_lse)
                rows, cols = qs.stop - qs.start, ks.stop - ks.start
                cp.count(q.shape[0] * heads * (rows * (rows + 1) // 2 if causal else rows * cols))
            if ahead is not None:
                kv = ahead
        ctx.cp, ctx.scale = cp, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        cp, scale = ctx.cp, ctx.scale
        q, k, v, out, lse = ctx.saved_tensors
        length, heads, kv_heads, n = q.shape[2], q.shape[1], k.shape[1], cp.n
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(n):
            source = (cp.rank - step) % n
            keys, values = _expand(kv[0], heads), _expand(kv[1], heads)
            dk, dv = torch.zeros_like(keys), torch.zeros_like(values)
            for qs, ks, causal in cp._blocks(length, source):
                gq, gk, gv = _flash_backward(grad_out[:, :, qs], q[:, :, qs], keys[:, :, ks], values[:, :, ks],
                                             out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), 0.0, causal,
                                             scale=scale)
                dq[:, :, qs] += gq
                dk[:, :, ks] += gk
                dv[:, :, ks] += gv
            dkv += torch.stack([_fold(dk, kv_heads), _fold(dv, kv_heads)])
            if step < n - 1:  # the block and the gradients gathered for it go on round the ring
                moved = cp.exchange(torch.cat([kv, dkv]))
                kv, dkv = moved[:2], moved[2:]
        own = cp.exchange(dkv)  # the last hop: each block's gradients home
        return dq, own[0], own[1], None, None


class _GatherKV(torch.autograd.Function):
    """Every rank's stacked keys and values, in rank order along the tokens; the backward reduce-scatters their
    gradients back to their ranks."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        parts = [torch.empty_like(kv) for _ in range(cp.n)]
        dist.all_gather(parts, kv.contiguous(), group=cp.axis.group)
        if not cp._paused:
            cp.sent_bytes += (cp.n - 1) * kv.numel() * kv.element_size()
        return torch.cat(parts, dim=3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        cp = ctx.cp
        parts = [p.contiguous() for p in grad.chunk(cp.n, dim=3)]
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=cp.axis.group)
        if not cp._paused:
            cp.sent_bytes += (cp.n - 1) * mine.numel() * mine.element_size()
        return mine, None


