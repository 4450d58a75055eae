"""Expert parallelism by hand: a mixture of experts' experts split across the mesh's ``ep`` axis, tokens sent to
them and back by all-to-all.

``parallel.ep P`` carves groups of P consecutive data-parallel ranks out of the data axis (``lab.parallel.mesh``,
as DeepSpeed-MoE and torchtitan do). Rank j of a group holds experts j·E/P … (j+1)·E/P − 1 of each of the model's
MoE layers (its plan's ``ExpertPlan``), under the model's own names (the others become None), so initial weights
and checkpoint entries are ``single``'s; every rank still reads its own micro-batch and holds the rest of the
model whole. In each MoE layer's forward a rank routes its own tokens as before (router, top-k, capacity), then:

1. sends every expert's row count to the rank holding it (``all_to_all_single`` of E integers: the variable split
   sizes of the next exchange, known to both sides before it);
2. sends the rows, grouped by expert (``all_to_all_single`` with those splits);
3. runs each of its experts on each source rank's rows apart: the rows ``single`` gives that expert in that
   rank's micro-batch, through the same matmuls, so the outputs are the same bits;
4. sends the outputs back by the reverse exchange; the source weights them by their gates and sums them.

Both row exchanges are an autograd Function (``_Exchange``) whose backward is the reverse exchange of the
gradients. An expert's weight gradient is then the sum over its group's micro-batches; the data-parallel strategy
sums the other weights' gradients over the whole data axis and the experts' over ``edp`` (the ranks holding the
same experts), divided by the data axis's size in both cases: the mean over every rank's micro-batch, as without
expert parallelism. The global gradient norm counts a weight every rank holds once (the group's rank 0) and sums
the squares over the group.

Bytes sent by the exchanges are counted from the tensors handed to ``all_to_all_single`` (rows for other ranks
only), forward, backward and activation checkpointing's recomputation alike, and set beside
``lab.measure.accounting.expert_all_to_all_bytes`` (theory, at balanced routing).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.measure import accounting
from lab.model.plan import ExpertPlan, plan_of
from lab.parallel.comm import Comm, naming_axis
from lab.parallel.mesh import Mesh
from lab.runtime.config import ConfigError, ParallelConfig

if TYPE_CHECKING:
    from lab.parallel.base import LoopSettings

_on_ep = naming_axis("ep")  # a failed exchange names the axis: a rank of the group died or did not answer


def check(cfg: ParallelConfig, strategy: type, compile: bool) -> None:
    """Raise ConfigError (one line) when ``parallel.ep`` cannot run under ``strategy`` (a Strategy class)."""
    if cfg.ep == 1:
        return
    if cfg.tp > 1 or cfg.pp > 1:
        raise ConfigError("parallel.ep > 1 does not run with parallel.tp or parallel.pp > 1 yet: expert groups are "
                          "carved out of a data axis that is the whole world")
    if not strategy.expert_parallel:
        raise ConfigError(f"strategy '{strategy.name}' does not run with parallel.ep > 1 yet: it syncs or shards "
                          f"every gradient over one group, where experts are averaged over the ranks holding them; "
                          f"choose ddp_naive, ddp, zero1 or zero2")
    if compile:
        raise ConfigError("train.compile with parallel.ep > 1 is not supported yet: the exchanges' split sizes are "
                          "read on the host mid-forward; set train.compile false")


def on_axis(mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings) -> Unsplit:
    """The expert-parallel transform on the mesh's ``ep`` axis: the identity on an axis of one."""
    return Unsplit() if mesh.ep.world_size == 1 else ExpertParallel(mesh, cfg, loop)


class Unsplit:
    """Every expert on every rank. What the strategies ask of the transform (``ExpertParallel`` answers for split
    experts): ``comm`` reduces the experts' gradients (here the data axis's own ``Comm`` does)."""

    comm: Comm | None = None

    def describe(self, layout: str) -> str:
        return layout

    def splitting(self, model_factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        return model_factory

    def holds(self, p: nn.Parameter) -> bool:
        """Whether ``p`` is an expert's weight this transform split off (reduced over ``edp``, not the data axis)."""
        return False

    def counts(self, name: str) -> bool:
        """Whether this rank adds parameter ``name``'s gradient to the global norm."""
        return True

    def sum_squares(self, squares: torch.Tensor) -> torch.Tensor:
        return squares

    def layout_name(self, name: str) -> str:
        """``name`` as ranks that hold different experts compare their layouts (an expert by its local index)."""
        return name

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Exchanges and reductions inside are not counted (held-out evaluation)."""
        yield

    def take_meters(self) -> tuple[dict[str, float], float, dict[str, object]]:
        """Bytes the experts' gradient reductions sent, seconds waited on the group, and the step's exchange figures
        since the last call."""
        return {}, 0.0, {}

    def meters(self) -> dict[str, object]:
        """The run's expert-parallel figures (for the summary)."""
        return {}

    def gather(self, weights: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
        """``weights`` (the data axis's rank 0's) with every expert's, from the ranks of its group holding them."""
        return weights

    def expert_elements(self, params: list[nn.Parameter]) -> int:
        return sum(p.numel() for p in params if self.holds(p))


class ExpertParallel(Unsplit):
    """This rank's experts, the exchanges that feed them, and their meters."""

    def __init__(self, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings):
        self.axis, self.edp = mesh.ep, mesh.edp
        self.rank, self.n = mesh.ep.rank, mesh.ep.world_size
        self.comm = Comm(self.edp.world_size, self.edp.group, axis="ep")  # the experts' gradients, over edp
        self.checkpointing, self.loop = cfg.activation_checkpointing, loop
        self.plan: ExpertPlan | None = None
        self.local = range(0)  # this rank's experts
        self.params: set[int] = set()  # ids of this rank's expert weights
        self._renamed: dict[str, str] = {}  # "<layer>.experts.<e>." -> "<layer>.experts.<local index>."
        self._paused = False
        self.sent_bytes = 0.0  # since the last take
        self.last_sent_bytes = 0.0  # the last step's
        self.wait_s = 0.0

    def describe(self, layout: str) -> str:
        count = self.plan.count if self.plan else 0
        return f"{layout} (ep {self.n}: experts {self.local.start}-{self.local.stop - 1} of {count} on this rank)"

    # ------------------------------------------------------------ building

    def splitting(self, model_factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        def split() -> nn.Module:
            model = model_factory()
            plan = plan_of(model, model_factory).experts
            if plan is None:
                raise ConfigError(f"parallel.ep > 1: the model ({type(model).__name__}) declares no mixture of experts")
            if plan.count % self.n:
                raise ConfigError(f"parallel.ep ({self.n}) must divide the experts per layer ({plan.count})")
            self._split(model, plan)
            return model
        return split

    def _split(self, model: nn.Module, plan: ExpertPlan) -> None:
        self.plan = plan
        per = plan.count // self.n
        self.local = range(self.rank * per, (self.rank + 1) * per)
        for layer in plan.layers:
            moe = model.get_submodule(layer)
            for e in range(plan.count):
                if e not in self.local:
                    moe.experts[e] = None
                else:
                    self._renamed[f"{layer}.experts.{e}."] = f"{layer}.experts.{e - self.local.start}."
                    self.params |= {id(p) for p in moe.experts[e].parameters()}
            moe.exchange = functools.partial(self._exchange, [moe.experts[e] for e in self.local])

    def holds(self, p: nn.Parameter) -> bool:
        return id(p) in self.params

    def _expert_prefix(self, name: str) -> str | None:
        layer, sep, rest = name.partition(".experts.")
        return f"{layer}.experts.{rest.split('.', 1)[0]}." if sep else None

    def counts(self, name: str) -> bool:
        return self.rank == 0 or self._expert_prefix(name) in self._renamed

    def sum_squares(self, squares: torch.Tensor) -> torch.Tensor:
        return self.axis.sum(squares)

    def layout_name(self, name: str) -> str:
        prefix = self._expert_prefix(name)
        return name if prefix not in self._renamed else self._renamed[prefix] + name[len(prefix):]

    # ------------------------------------------------------------ the exchanges

    def _exchange(self, experts: list[nn.Module], rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each expert's rows (this rank's tokens, one tensor per expert of the layer) to the ranks holding the
        experts, through them, and back: each expert's outputs, in the order its rows came."""
        per = len(experts)
        counts = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=rows[0].device)
        arriving = self.all_to_all(counts, [per] * self.n, [per] * self.n).tolist()  # [source, local expert]
        sent = counts.view(self.n, per).sum(dim=1).tolist()
        received = [sum(arriving[s * per:(s + 1) * per]) for s in range(self.n)]
        inputs = _Exchange.apply(torch.cat(rows), sent, received, self).split(arriving)
        outputs = [experts[j](inputs[s * per + j]) for s in range(self.n) for j in range(per)]
        back = _Exchange.apply(torch.cat(outputs), received, sent, self)
        return list(back.split(counts.tolist()))

    @_on_ep
    def all_to_all(self, rows: torch.Tensor, sent: list[int], received: list[int]) -> torch.Tensor:
        """``rows`` cut by ``sent`` (rows per rank of the group) to those ranks; what arrives, ``received`` rows from
        each, in rank order. Counts the bytes sent to other ranks."""
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        if not self._paused:
            self.sent_bytes += (sum(sent) - sent[self.rank]) * math.prod(rows.shape[1:]) * rows.element_size()
        t0 = time.perf_counter()
        dist.all_to_all_single(out, rows, received, sent, group=self.axis.group)
        if not self._paused:
            self.wait_s += time.perf_counter() - t0
        return out

    @contextmanager
    def paused(self) -> Iterator[None]:
        before, self._paused = self._paused, True
        try:
            with self.comm.paused():
                yield
        finally:
            self._paused = before

    # ------------------------------------------------------------ meters and export

    def theory_bytes(self) -> float:
        """Bytes one rank's exchanges send per optimizer step in theory (balanced routing, fp32 rows)."""
        cfg = self.plan.config
        tokens = self.loop.micro_batch * cfg.block_size
        forwards = 1 if self.checkpointing == "none" else 2  # the recomputation exchanges again
        return self.loop.accum_steps * accounting.expert_all_to_all_bytes(cfg, tokens, self.n, forwards)

    def take_meters(self) -> tuple[dict[str, float], float, dict[str, object]]:
        totals = self.comm.take()
        wait_s, self.wait_s = totals.wait_s + self.wait_s, 0.0
        self.last_sent_bytes, self.sent_bytes = self.sent_bytes, 0.0
        return totals.bytes, wait_s, {"ep_a2a_bytes": self.last_sent_bytes, "ep_a2a_bytes_theory": self.theory_bytes()}

    def meters(self) -> dict[str, object]:
        return {"ep_a2a_bytes_per_step": self.last_sent_bytes, "ep_a2a_bytes_per_step_theory": self.theory_bytes()}

    def gather(self, weights: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
        if self.edp.rank != 0:  # another group holds the same experts: the first group's are gathered
            return weights
        mine = {name: p.detach().cpu().clone() for name, p in module.named_parameters() if self.holds(p)}
        parts: list[dict] | None = [{} for _ in range(self.n)] if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=self.axis.global_rank(0), group=self.axis.group)
        return {k: v for part in parts for k, v in part.items()} | weights if self.rank == 0 else weights


class _Exchange(torch.autograd.Function):
    """Rows to the ranks of the expert group (``sent`` to each) and ``received`` from each; the backward sends the
    gradients back the reverse way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, sent: list[int], received: list[int],
                transform: ExpertParallel) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.transform = sent, received, transform
        return transform.all_to_all(rows.contiguous(), sent, received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.transform.all_to_all(grad.contiguous(), ctx.received, ctx.sent), None, None, None
