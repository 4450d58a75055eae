"""Expert parallelism by hand: a mixture of experts' experts split across the mesh's ``ep`` axis, tokens sent to
them and back by all-to-all.

``parallel.ep P`` carves groups of P consecutive data-parallel ranks out of the data axis (``lab.parallel.layout``,
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
sums the other weights' gradients over the whole data axis and the experts' over the ranks holding the same experts
(``data_group``: the mesh's ``expert_data``), divided by the data axis's size in both cases: the mean over every
rank's micro-batch, as without expert parallelism. Under tensor parallelism the experts are not split: every rank
of a tensor-parallel group routes the same tokens and runs its experts on them whole (exchanging with the ranks of
its expert group at its own tensor coordinate); under a pipeline each stage's layers exchange on their own.

Bytes sent by the exchanges are counted from the tensors handed to ``all_to_all_single`` (rows for other ranks
only), forward, backward and activation checkpointing's recomputation alike, and set beside
``lab.measure.accounting.expert_all_to_all_bytes`` (theory, at balanced routing).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.measure import accounting
from lab.model.plan import ExpertPlan, ParallelPlan
from lab.parallel.axes import AxisMeters, Transform
from lab.parallel.comm import Pausable, naming_axis
from lab.parallel.layout import LoopSettings, Mesh, World
from lab.runtime.config import ConfigError, ParallelConfig

_on_ep = naming_axis("ep")  # a failed exchange names the axis: a rank of the group died or did not answer


class ExpertParallel(Pausable, Transform):
    """This rank's experts, the exchanges that feed them, and their meters."""

    name = "ep"
    line_place = 40

    @classmethod
    def on(cls, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings, saved: object) -> ExpertParallel | None:
        return cls(mesh, cfg, loop) if mesh.ep.world_size > 1 else None

    def __init__(self, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings):
        self.axis, self.holders = mesh.ep, mesh.expert_data
        self.rank, self.n = mesh.ep.rank, mesh.ep.world_size
        self.checkpointing, self.loop = cfg.activation_checkpointing, loop
        self.plan: ExpertPlan | None = None
        self.model: nn.Module | None = None
        self.local = range(0)  # this rank's experts
        self._renamed: dict[str, str] = {}  # "<layer>.experts.<e>." -> "<layer>.experts.<local index>."
        self.sent_bytes = 0.0  # since the last take
        self.last_sent_bytes = 0.0  # the last step's
        self.wait_s = 0.0

    def describe(self, layout: str) -> str:
        count = self.plan.count if self.plan else 0
        return f"{layout} (ep {self.n}: experts {self.local.start}-{self.local.stop - 1} of {count} on this rank)"

    # ------------------------------------------------------------ building

    def split(self, model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
        if plan.experts is None:
            raise ConfigError(f"parallel.ep > 1: the model ({type(model).__name__}) declares no mixture of experts")
        if plan.experts.count % self.n:
            raise ConfigError(f"parallel.ep ({self.n}) must divide the experts per layer ({plan.experts.count})")
        self._split(model, plan.experts)
        self.model = model  # a later transform may drop some of its layers (a pipeline stage runs its own)
        return plan

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
            moe.exchange = functools.partial(self._exchange, moe.experts)

    def holds(self, name: str) -> bool:
        """Whether parameter ``name`` is one of this rank's experts' weights."""
        return self._expert_prefix(name) in self._renamed

    def data_group(self, name: str) -> World | None:
        """An expert's gradient is averaged over the ranks holding the same experts."""
        return self.holders if self.holds(name) else None

    def mixed_gradients(self) -> set[str]:
        """This rank's experts' weights: a backward adds the gradients of every source rank's rows."""
        return {name for name, _ in self.model.named_parameters() if self.holds(name)}

    def tap_uses(self, tap: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Each source rank's rows run through tapped weights (``Experts.tap``), so each use is read apart."""
        for layer in self.plan.layers:
            prefix = f"{layer}.experts."
            self.model.get_submodule(layer).experts.tap = lambda name, weight, p=prefix: tap(p + name, weight)

    def _expert_prefix(self, name: str) -> str | None:
        layer, sep, rest = name.partition(".experts.")
        return f"{layer}.experts.{rest.split('.', 1)[0]}." if sep else None

    def local_name(self, name: str) -> str:
        prefix = self._expert_prefix(name)
        return name if prefix not in self._renamed else self._renamed[prefix] + name[len(prefix):]

    # ------------------------------------------------------------ the exchanges

    def _exchange(self, experts: nn.Module, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each expert's rows (this rank's tokens, one tensor per expert of the layer) to the ranks holding the
        experts, through them (``experts``, in one call: each source rank's rows apart), and back: each expert's
        outputs, in the order its rows came."""
        per = len(self.local)
        counts = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=rows[0].device)
        arriving = self.all_to_all(counts, [per] * self.n, [per] * self.n).tolist()  # [source, local expert]
        sent = counts.view(self.n, per).sum(dim=1).tolist()
        received = [sum(arriving[s * per:(s + 1) * per]) for s in range(self.n)]
        inputs = _Exchange.apply(torch.cat(rows), sent, received, self).split(arriving)
        outputs = experts([(self.local[j], inputs[s * per + j]) for s in range(self.n) for j in range(per)])
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

    # ------------------------------------------------------------ meters and export

    def theory_bytes(self) -> float:
        """Bytes one rank's exchanges send per optimizer step in theory (balanced routing, rows of ``values``)."""
        cfg = self.plan.config
        tokens = self.loop.micro_batch * cfg.block_size
        forwards = 1 if self.checkpointing == "none" else 2  # the recomputation exchanges again
        return self.loop.accum_steps * accounting.expert_all_to_all_bytes(cfg, tokens, self.n, forwards,
                                                                          self.values.itemsize, self.layers_run())

    def layers_run(self) -> int:
        """The mixture layers this rank runs: those still in the model once every transform split it."""
        def present(name: str) -> bool:
            try:
                return self.model.get_submodule(name) is not None
            except AttributeError:
                return False

        return sum(present(layer) for layer in self.plan.layers)

    def take_meters(self) -> AxisMeters:
        wait_s, self.wait_s = self.wait_s, 0.0
        self.last_sent_bytes, self.sent_bytes = self.sent_bytes, 0.0
        return AxisMeters(wait_s, {"ep_a2a_bytes": self.last_sent_bytes, "ep_a2a_bytes_theory": self.theory_bytes()})

    def meters(self) -> dict[str, object]:
        return {"ep_a2a_bytes_per_step": self.last_sent_bytes, "ep_a2a_bytes_per_step_theory": self.theory_bytes()}

    @staticmethod
    def line(rec: dict) -> str:
        """The all-to-all bytes beside their theory."""
        if "ep_a2a_bytes" not in rec:
            return ""
        return (f" | a2a {rec['ep_a2a_bytes'] / 2**10:,.0f} KiB (theory at balanced routing "
                f"{rec['ep_a2a_bytes_theory'] / 2**10:,.0f})")


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
