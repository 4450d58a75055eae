"""Pipeline parallelism by hand: the model's blocks in stages on the mesh's ``pp`` axis, point-to-point between them.

``parallel.pp P`` cuts the model along its plan (``lab.model.plan.PipelinePlan``): the blocks into P runs of
consecutive blocks balanced by parameters (``lab.measure.accounting.stage_units``, the split's one statement), the
embedding on the first stage, the final norm, head and loss on the last. Each rank builds the whole model and keeps
its stage's modules, under the model's own names (the others become None), so the initial weights are ``single``'s
and a checkpoint stores the same entries whatever the layout. A tied embedding is one weight held by the first stage
and the last: after the step's backward each sends the other its gradient and adds the one it receives (a + b on
one, b + a on the other: the same bits), so both take the same update; the gradient norm counts it once. A sharding
strategy lays such a weight out alone (``held_apart``), so both stages hold the same part of it and sum those after
the reduce-scatter.

Each micro-step of the loop is cut into ``parallel.pp_microbatches`` M microbatches, run by a schedule of
forwards (F) and backwards (B) on every stage (``schedule``):

- ``gpipe``: every microbatch's forward, then every backward (Huang et al. 2019); a stage holds M microbatches'
  activations at its peak;
- ``1f1b``: stage s runs P − s − 1 forwards (warm-up), then one forward and one backward in turn, then the
  remaining backwards (Narayanan et al. 2021, PipeDream-Flush); a stage holds at most P − s;
- ``interleaved``: the blocks in P · V virtual stages (``parallel.pp_virtual`` V), rank r holding r, r + P, ...;
  1F1B over them in Megatron-LM's order (``interleaved``): the bubble shrinks V-fold.

``parallel.pp_impl torch`` runs the same stages through ``torch.distributed.pipelining`` (``TorchPipeline``): the
reference.

Activations go forward and their gradients backward by ``isend`` / ``irecv`` over the pp group (sends are
asynchronous and waited for at the end of the micro-step, receives block: the time spent blocked is the
pipeline's wait, the bubble included). Each microbatch's loss is scaled by 1/(M · accumulation steps) before its
backward, as the loop scales a micro-step's: the step accumulates the gradient of the same batch as without
pipelining. The loop's ``forward`` therefore runs the whole schedule, backwards included, and returns the
micro-step's loss (the mean over microbatches, sent from the last stage to every stage, so the loop's average
over ranks is the loss); the loop's ``backward`` of it only checks that it seeds the gradient the schedule
assumed (``_Ran``), and then the data-parallel strategy syncs the gradients as it always does. Its hooks see one
backward per microbatch: the strategy's ``syncing`` is true only during each (virtual) stage's last backward of
a synced micro-step.

Under tensor parallelism (hand-rolled, without sequence parallelism) the tensor split is applied to the whole model
first and each stage keeps its part: a stage boundary's hidden state is whole on every rank of the tensor group, and
the pp group of a rank joins the ranks of the other stages with its tensor coordinate (a tied embedding's shard
goes to the rank holding the same vocabulary rows).

A checkpoint's entries are the model's whatever the layout; the first stage alone hands over a tied weight
(``TiedReplicas``) and, after a load, sends it to the last.

Against ``single`` the split changes no operation: with one microbatch per micro-step the losses and weights are
the same bits (the tied weight's two gradients are added once either way). With M microbatches the batch's mean
loss is a mean of M means, and the gradients are summed over microbatches before the micro-steps: last-bit
differences, as accumulation has.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.measure import accounting
from lab.model.plan import ParallelPlan, PipelinePlan
from lab.parallel.axes import AxisMeters, Replicas, Transform
from lab.parallel.comm import naming_axis
from lab.parallel.layout import LoopSettings, Mesh, World
from lab.runtime.config import ConfigError, ParallelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved")
IMPLEMENTATIONS = ("lab", "torch")
_FORWARD_TAG, _BACKWARD_TAG = 1, 2  # activations go to the next stage, their gradients to the previous one
_on_pp = naming_axis("pp")  # a failed send or receive names the axis: a stage died or did not answer


def microbatches(cfg: ParallelConfig) -> int:
    """The microbatches a micro-step is cut into (default: one per stage)."""
    return cfg.pp_microbatches if cfg.pp_microbatches is not None else cfg.pp


def schedule(name: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """The order stage ``stage`` of ``stages`` runs the forwards ("F", i) and backwards ("B", i) of ``m``
    microbatches in (backwards in microbatch order, as accumulation adds them)."""
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def interleaved(stage: int, stages: int, m: int, virtual: int) -> list[tuple[str, int, int]]:
    """The order stage ``stage`` of ``stages`` runs the forwards ("F", v, i) and backwards ("B", v, i) of its
    ``virtual`` stages v (global stage ``stage + v · stages``) on ``m`` microbatches (a multiple of ``stages``), as
    Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): microbatches in groups of ``stages`` go through virtual
    stage 0, then 1, ... (backwards from the last virtual stage); a warm-up of 2 (stages − stage − 1) + (virtual − 1)
    · stages forwards (one virtual stage: stages − stage − 1, as 1F1B), then one forward and one backward in turn."""
    total = m * virtual

    def op(kind: str, k: int) -> tuple[str, int, int]:
        v = k // stages % virtual
        return kind, (v if kind == "F" else virtual - 1 - v), k // (stages * virtual) * stages + k % stages

    warm = min(stages - stage - 1 if virtual == 1 else 2 * (stages - stage - 1) + (virtual - 1) * stages, total)
    order = [op("F", k) for k in range(warm)]
    for k in range(total - warm):
        order += [op("F", warm + k), op("B", k)]
    return order + [op("B", k) for k in range(total - warm, total)]


class TiedReplicas(Replicas):
    """A weight the first stage and the last both hold (a tied embedding): the first hands it over."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    @property
    def is_first(self) -> bool:
        return self.pipeline.first

    def share(self, tensor: torch.Tensor) -> None:
        self.pipeline.hand_over(tensor)


class Pipeline(Transform):
    """This rank's stage, its schedule, and the point-to-point traffic between stages."""

    name = "pp"
    line_place = 20

    @classmethod
    def on(cls, mesh: Mesh, cfg: ParallelConfig, loop: LoopSettings, saved: object) -> Pipeline | None:
        """The pipeline transform of ``cfg`` (``parallel.pp_impl``'s) on the mesh's pp axis."""
        if mesh.pp.world_size == 1:
            return None
        return (TorchPipeline if cfg.pp_impl == "torch" else Pipeline)(mesh.pp, cfg, loop.accum_steps)

    def __init__(self, axis: World, cfg: ParallelConfig, accum_steps: int):
        self.axis, self.stage, self.n = axis, axis.rank, axis.world_size
        self.first, self.last = self.stage == 0, self.stage == self.n - 1
        self.schedule_name, self.m, self.accum_steps = cfg.pp_schedule, microbatches(cfg), accum_steps
        self.virtual = cfg.pp_virtual  # stages per rank: this rank holds stages stage, stage + n, ...
        self.plan: PipelinePlan | None = None
        self.runs: list[range] = []  # the blocks of each (virtual) stage
        self.stage_params: list[int] = []
        self.tied: list[str] = []  # parameters held by the first stage and the last
        self._tied = TiedReplicas(self)
        self.wait_s = self.window_s = 0.0  # blocked on other stages; inside the schedule (since the last take)
        self.totals = torch.zeros(self.n, 2, dtype=torch.float64)  # per stage: seconds waited, seconds scheduled
        self.sent_bytes = self.sent_bytes_theory = 0  # activations and their gradients sent (since the last take)
        # activation bytes saved for microbatches whose backward has not run yet: their peak in the schedule, measured
        # (the saved-tensor hooks' bytes of each microbatch's forward) and in theory (the most forwards the schedule
        # has outstanding, times this rank's mean bytes per microbatch), since the last take and over the run
        self.in_flight = self.in_flight_theory = 0.0
        self.in_flight_run = torch.zeros(self.n, 2, dtype=torch.float64)
        # the idle fraction of a flushed schedule: (n − 1) idle slots of a virtual stage's time beside m · V of work
        self.theory = (self.n - 1) / (self.virtual * self.m + self.n - 1)
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def describe(self, layout: str) -> str:
        last = len(self.runs) - 1
        stages = "; ".join(f"stage {s}{f' (rank {s % self.n})' if self.virtual > 1 else ''}: "
                           f"{'embedding + ' if s == 0 else ''}"
                           f"{f'blocks {r.start}-{r.stop - 1}' if len(r) > 1 else f'block {r.start}'}"
                           f"{' + head' if s == last else ''} ({p:,} params)"
                           for s, (r, p) in enumerate(zip(self.runs, self.stage_params)))
        schedule_name = f"interleaved × {self.virtual}" if self.schedule_name == "interleaved" else self.schedule_name
        return f"{layout} (pp {self.n}, {schedule_name}, {self.m} microbatches: {stages})"

    def _stages(self) -> list[int]:
        """The (virtual) stages this rank holds."""
        return [self.stage + v * self.n for v in range(self.virtual)]

    # ------------------------------------------------------------ building

    def split(self, model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
        if plan.pipeline is None:
            raise ConfigError(f"parallel.pp > 1: the model ({type(model).__name__}) declares no pipeline plan")
        self._cut(model, plan.pipeline)
        held = {plan.pipeline.units[i] for s in self._stages() for i in self.runs[s]}
        return dataclasses.replace(plan, units=[unit for unit in plan.units if unit in held])

    def _cut(self, model: nn.Module, plan: PipelinePlan) -> None:
        """Choose the stages' blocks and drop from ``model`` every module this stage does not run."""
        def params(names: list[str]) -> dict[int, nn.Parameter]:
            return {id(p): p for name in names for p in model.get_submodule(name).parameters()}

        self.plan = plan
        self.runs = accounting.stage_units([sum(p.numel() for p in params([u]).values()) for u in plan.units],
                                           self.n * self.virtual)
        first, last = params(plan.first), params(plan.last)
        self.tied = [name for name, p in model.named_parameters() if id(p) in first and id(p) in last]
        self.stage_params = [sum(p.numel() for p in params([plan.units[i] for i in run]).values())
                             + (sum(p.numel() for p in first.values()) if s == 0 else 0)
                             + (sum(p.numel() for p in last.values()) if s == len(self.runs) - 1 else 0)
                             for s, run in enumerate(self.runs)]
        keep = {plan.units[i] for s in self._stages() for i in self.runs[s]}
        keep |= set(plan.first) if self.first else set()
        keep |= set(plan.last) if self.last else set()
        for name in [*plan.units, *plan.first, *plan.last]:
            if name not in keep:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, None)

    def running(self, strategy: object, model: nn.Module) -> nn.Module:
        return _Staged(self, strategy, model)

    def entry_points(self) -> list[str]:
        return [self.plan.stage]

    def microbatches(self) -> int:
        return self.m

    # ------------------------------------------------------------ point to point

    @_on_pp
    def _send(self, tensor: torch.Tensor, stage: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self.sent_bytes += tensor.numel() * tensor.element_size()  # what goes on the wire, as sent
        work = dist.isend(tensor, dst=self.axis.global_rank(stage), group=self.axis.group, tag=tag)
        self._sends.append((work, tensor))  # kept alive until sent

    @_on_pp
    def _receive(self, like: tuple[tuple[int, ...], torch.dtype], stage: int, tag: int) -> torch.Tensor:
        shape, dtype = like
        buffer = torch.empty(shape, dtype=dtype, device=self.axis.device)
        started = time.perf_counter()
        dist.irecv(buffer, src=self.axis.global_rank(stage), group=self.axis.group, tag=tag).wait()
        self.wait_s += time.perf_counter() - started
        return buffer

    @_on_pp
    def _finish_sends(self) -> None:
        started = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        self.wait_s += time.perf_counter() - started

    @_on_pp
    def _share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The sum of every stage's part of the loss (the last stage's, and the others' auxiliary losses: zeros when
        they have none, so the sum is the last stage's bits), on every stage."""
        started = time.perf_counter()
        dist.all_reduce(loss, group=self.axis.group)
        self.wait_s += time.perf_counter() - started
        return loss

    # ------------------------------------------------------------ one micro-step

    def _stage_forward(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, hidden: torch.Tensor | None,
                       stage: int) -> torch.Tensor:
        """(Virtual) stage ``stage``'s part of the forward: from the tokens ``x`` (the first) or the received
        ``hidden``, to the loss against ``y`` (the last) or the hidden state to send on."""
        return getattr(module, self.plan.stage)(x if stage == 0 else hidden, y, self.runs[stage], stage == 0,
                                                stage == len(self.runs) - 1)

    def _hidden(self, module: nn.Module, x: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        return (*x.shape, self.plan.width), self.values

    def _order(self) -> list[tuple[str, int, int]]:
        """This rank's schedule as (kind, virtual stage, microbatch)."""
        if self.schedule_name == "interleaved":
            return interleaved(self.stage, self.n, self.m, self.virtual)
        return [(kind, 0, i) for kind, i in schedule(self.schedule_name, self.stage, self.n, self.m)]

    def train(self, strategy: object, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the micro-step (x, y) in M microbatches by the schedule; its mean loss on every
        stage, whose backward the loop still calls (``_Ran``). Activations go to the next rank (the last rank's to
        the first, between virtual stages), their gradients to the previous one."""
        started = time.perf_counter()
        module, sync = strategy.module, strategy.syncing
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        last, before, after = len(self.runs) - 1, (self.stage - 1) % self.n, (self.stage + 1) % self.n
        shape, dtype = self._hidden(module, x)  # theory: b · s · h per boundary a rank's stages have, each direction
        self.sent_bytes_theory += (2 * self.virtual - self.first - self.last) * math.prod(shape) * dtype.itemsize
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        extras: dict[tuple[int, int], torch.Tensor | None] = {}  # a stage's auxiliary losses, added to its backward
        losses = []  # the last stage's losses and the other stages' auxiliary ones, per microbatch
        order = self._order()
        final = {v: k for k, (kind, v, _) in enumerate(order) if kind == "B"}  # each virtual stage's last backward
        saved: dict[tuple[int, int], int] = {}  # bytes each microbatch's forward saved, until its backward
        in_flight = 0
        for k, (kind, v, i) in enumerate(order):
            stage = self.stage + v * self.n
            if kind == "F":
                hidden = None
                if stage > 0:
                    hidden = self._receive(self._hidden(module, xs[i]), before, _FORWARD_TAG)
                    inputs[v, i] = hidden.requires_grad_()
                counted = strategy.saved.fresh()
                out = self._stage_forward(module, xs[i], ys[i], hidden, stage)
                extra = extras[v, i] = self._aux_loss(module, stage)
                saved[v, i] = strategy.saved.current - counted
                in_flight = max(in_flight, sum(saved.values()))
                if stage == last:
                    out = out if extra is None else out + extra
                    losses.append(out.detach())
                else:
                    self._send(out, after, _FORWARD_TAG)
                    if extra is not None:
                        losses.append(extra.detach())
                outputs[v, i] = out
                continue
            strategy.syncing = sync and k == final[v]  # the data-parallel hooks sync on a stage's last backward
            saved.pop((v, i))
            out, extra = outputs.pop((v, i)), extras.pop((v, i))
            if stage == last:
                strategy.autograd(strategy.scaled(out / (self.m * self.accum_steps)))
            else:
                grad = self._receive((tuple(out.shape), out.dtype), after, _BACKWARD_TAG)
                if extra is None:
                    strategy.autograd(out, grad)
                else:
                    strategy.autograd([out, strategy.scaled(extra / (self.m * self.accum_steps))], [grad, None])
            if stage > 0:
                self._send(inputs.pop((v, i)).grad, before, _BACKWARD_TAG)
        strategy.syncing = sync
        self._finish_sends()
        self.in_flight = max(self.in_flight, in_flight)
        per_forward = strategy.saved.current / (len(xs) * self.virtual)  # this rank's mean, over its stages
        self.in_flight_theory = max(self.in_flight_theory, outstanding(order) * per_forward)
        loss = torch.stack(losses).sum() / self.m if losses else torch.zeros((), device=self.axis.device)
        seed = strategy.scaled(torch.ones((), device=loss.device) / self.accum_steps).item()
        loss = self._share_loss(loss)
        self.window_s += time.perf_counter() - started
        return _Ran.apply(torch.zeros((), requires_grad=True), loss, seed)

    def _aux_loss(self, module: nn.Module, stage: int) -> torch.Tensor | None:
        """The auxiliary losses (a mixture of experts' balance losses) of the blocks stage ``stage`` just ran."""
        return getattr(module, self.plan.aux_loss)(self.runs[stage]) if self.plan.aux_loss else None

    @torch.no_grad()
    def evaluate(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of (x, y) through the stages in one piece (as ``single`` computes it), on every stage (its waits
        are not a training step's)."""
        training_wait_s, training_sent = self.wait_s, self.sent_bytes
        out = None
        for stage in self._stages():
            hidden = None if stage == 0 else self._receive(self._hidden(module, x), (self.stage - 1) % self.n,
                                                           _FORWARD_TAG)
            out = self._stage_forward(module, x, y, hidden, stage)
            if stage != len(self.runs) - 1:
                self._send(out, (self.stage + 1) % self.n, _FORWARD_TAG)
        self._finish_sends()
        loss = self._share_loss(out.float() if self.last else torch.zeros((), device=self.axis.device))
        self.wait_s, self.sent_bytes = training_wait_s, training_sent
        return loss

    # ------------------------------------------------------------ what follows from the stages

    def replicas(self, name: str) -> TiedReplicas | None:
        return self._tied if name in self.tied else None

    def held_apart(self) -> set[str]:
        return set(self.tied)

    @_on_pp
    @torch.no_grad()
    def complete_gradients(self, grad_of: Callable[[str], torch.Tensor]) -> None:
        """A weight the first and the last stage hold gets the sum of both stages' gradients (its parts here: the same
        on both, laid out alike), a + b on one, b + a on the other: the same bits."""
        if not (self.tied and (self.first or self.last)):
            return
        peer = self.axis.global_rank(self.n - 1 if self.first else 0)
        for name in self.tied:
            mine = grad_of(name)
            theirs = torch.empty_like(mine)
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, self.axis.group),
                                                dist.P2POp(dist.irecv, theirs, peer, self.axis.group)]):
                work.wait()
            mine.add_(theirs)

    @_on_pp
    def take_meters(self) -> AxisMeters:
        """Seconds this rank waited on the other stages since the last call (every stage calls it: the stages' figures
        are gathered), per stage the fraction of the schedule's time it waited (the bubble, and the transfers),
        beside the theory (p − 1)/(m + p − 1), and the bytes this rank sent to its neighbours (activations forward,
        their gradients backward; evaluation's not counted) beside b · s · h per boundary and direction."""
        mine = torch.tensor([self.wait_s, self.window_s, self.in_flight, self.in_flight_theory], dtype=torch.float64)
        sent = {"pp_sent_bytes": self.sent_bytes, "pp_sent_bytes_theory": self.sent_bytes_theory}
        wait, self.wait_s, self.window_s, self.sent_bytes, self.sent_bytes_theory = self.wait_s, 0.0, 0.0, 0, 0
        self.in_flight = self.in_flight_theory = 0.0
        stages = [torch.zeros_like(mine) for _ in range(self.n)]
        dist.all_gather(stages, mine, group=self.axis.group)
        step = torch.stack(stages)
        self.totals += step[:, :2]
        self.in_flight_run = torch.maximum(self.in_flight_run, step[:, 2:])
        return AxisMeters(wait, {"pp_wait_s": step[:, 0].tolist(), "pp_bubble": _fractions(step),
                                 "pp_bubble_theory": self.theory, **sent, **_in_flight(step[:, 2:])})

    def meters(self) -> dict[str, object]:
        return {"pp_bubble": _fractions(self.totals), "pp_bubble_theory": self.theory,
                **_in_flight(self.in_flight_run)}

    @staticmethod
    def line(rec: dict) -> str:
        """The measured bubble per stage beside its theory, the bytes sent and held in flight."""
        if "pp_bubble" not in rec:
            return ""
        stages = " ".join(f"{100 * b:.0f}%" for b in rec["pp_bubble"])
        held = " ".join(f"{b / 2**10:,.0f}" for b in rec.get("pp_in_flight_bytes", []))
        theory = " ".join(f"{b / 2**10:,.0f}" for b in rec.get("pp_in_flight_bytes_theory", []))
        return (f" | bubble {stages} by stage (theory {100 * rec['pp_bubble_theory']:.0f}%) | p2p "
                f"{rec['pp_sent_bytes'] / 2**10:,.0f} KiB (theory {rec['pp_sent_bytes_theory'] / 2**10:,.0f})"
                + (f" | activations in flight {held} KiB by stage (theory {theory})" if held else ""))

    @_on_pp
    @torch.no_grad()
    def hand_over(self, view: torch.Tensor) -> None:
        """The first stage's ``view`` (what it loaded of a tied weight) into the last stage's."""
        if self.first:
            dist.send(view.contiguous(), dst=self.axis.global_rank(self.n - 1), group=self.axis.group)
        elif view.numel():
            received = torch.empty(view.shape, dtype=view.dtype, device=view.device)
            dist.recv(received, src=self.axis.global_rank(0), group=self.axis.group)
            view.copy_(received)


class TorchPipeline(Pipeline):
    """The same stages run by ``torch.distributed.pipelining`` (``PipelineStage`` and ``ScheduleGPipe``,
    ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``): the reference the hand-rolled schedules are compared with. Its
    sends and receives happen inside the schedule's step, so neither the wait nor the bytes are metered; evaluation
    runs the lab's forward through the stages."""

    def __init__(self, axis: World, cfg: ParallelConfig, accum_steps: int):
        super().__init__(axis, cfg, accum_steps)
        self._runner = None  # the torch schedule, built at the first step (the stages' module exists then)

    def describe(self, layout: str) -> str:
        return super().describe(layout).replace(f"(pp {self.n}, ", f"(pp {self.n} torch.distributed.pipelining, ")

    def _build(self, module: nn.Module) -> object:
        from torch.distributed import pipelining

        stages = [pipelining.PipelineStage(_TorchStage(self, module, s), s, len(self.runs), self.axis.device,
                                           group=self.axis.group) for s in self._stages()]

        def loss(hidden: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the head, then as the loop scales it
            return getattr(module, self.plan.head)(hidden, y) / (self.m * self.accum_steps)

        if self.schedule_name == "interleaved":
            return pipelining.ScheduleInterleaved1F1B(stages, self.m, loss_fn=loss, scale_grads=False)
        schedule_class = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[self.schedule_name]
        return schedule_class(stages[0], self.m, loss_fn=loss, scale_grads=False)

    @_on_pp
    def train(self, strategy: object, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        if self._runner is None:
            self._runner = self._build(strategy.module)
        losses: list[torch.Tensor] = []
        self._runner.step(*([x] if self.first else []), target=y if self.last else None, losses=losses)
        loss = (torch.stack(losses).sum().detach() * self.accum_steps if self.last
                else torch.zeros((), device=self.axis.device))
        seed = strategy.scaled(torch.ones((), device=loss.device) / self.accum_steps).item()
        loss = self._share_loss(loss)
        self.window_s += time.perf_counter() - started
        return _Ran.apply(torch.zeros((), requires_grad=True), loss, seed)

    def take_meters(self) -> AxisMeters:
        self.window_s = self.wait_s = 0.0
        return AxisMeters()

    def meters(self) -> dict[str, object]:
        return {"pp_bubble_theory": self.theory}


class _TorchStage(nn.Module):
    """Virtual stage ``stage`` of the rank's model as torch's ``PipelineStage`` takes it: tokens (the first) or a
    hidden state in, the hidden state after its blocks out (the last stage's head runs in the schedule's loss)."""

    def __init__(self, pipeline: Pipeline, model: nn.Module, stage: int):
        super().__init__()
        self.pipeline, self.stage, self.model = pipeline, stage, model

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        plan = self.pipeline.plan
        if self.stage == 0:
            h = getattr(self.model, plan.embed)(h)
        return getattr(self.model, plan.run)(h, self.pipeline.runs[self.stage])


def outstanding(order: list[tuple[str, int, int]]) -> int:
    """The most forwards a schedule runs ahead of their backwards: GPipe's m, 1F1B's min(p − stage, m)."""
    ahead = most = 0
    for kind, *_ in order:
        ahead += 1 if kind == "F" else -1
        most = max(most, ahead)
    return most


def _in_flight(per_stage: torch.Tensor) -> dict[str, list[float]]:
    """Per stage, the activation bytes held at once for microbatches awaiting their backward, measured and theory."""
    return {"pp_in_flight_bytes": per_stage[:, 0].tolist(), "pp_in_flight_bytes_theory": per_stage[:, 1].tolist()}


def _fractions(waits: torch.Tensor) -> list[float]:
    """Seconds waited over seconds scheduled, per row of [waited, scheduled] (0 where nothing was scheduled)."""
    return (waits[:, 0] / waits[:, 1].clamp_min(1e-12)).tolist()


class _Staged(nn.Module):
    """What a pipelined strategy's forward calls: the schedule in training, the stages in one piece without
    gradients (evaluation)."""

    def __init__(self, pipeline: Pipeline, strategy: object, model: nn.Module):
        super().__init__()
        self.pipeline, self.strategy = pipeline, strategy
        self.inner = model  # a child, so that eval() and train() reach it

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.pipeline.evaluate(self.strategy.module, x, y)
        return self.pipeline.train(self.strategy, x, y)


class _Ran(torch.autograd.Function):
    """A micro-step's loss whose backward the schedule has run: its own backward only checks that the loop seeds
    the gradient the schedule scaled the microbatches' losses by."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, loss: torch.Tensor, seed: float) -> torch.Tensor:
        ctx.seed = seed
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        if not abs(grad.item() - ctx.seed) <= 1e-6 * abs(ctx.seed):
            raise RuntimeError(f"the pipeline scaled its losses by {ctx.seed:g} but the loop's backward seeds "
                               f"{grad.item():g}: it must call backward(loss / accum_steps) once per forward")
        return None, None, None
