"""The layout of a run: every axis's degree, checked in one place, and the one device mesh that places the ranks.

A world of ``pp × dp × cp × tp`` ranks. Tensor-parallel groups are ``tp`` consecutive ranks (on a cluster they
share a node: the heaviest traffic); context-parallel groups run across them, then the data-parallel replicas,
and the pipeline stages, whose traffic is the lightest (one activation per microbatch boundary), are the
outermost. Rank ``r`` sits at tensor coordinate ``r % tp``, context ``r // tp % cp``, data ``r // (tp·cp) % dp``
and pipeline ``r // (tp·cp·dp)``.

Expert parallelism is carved out of the data axis, as DeepSpeed-MoE and torchtitan do: its groups (``ep``) are
``ep`` consecutive data-parallel ranks, which split a mixture of experts' experts and still read their own data;
``edp`` joins the ranks at the same place of every group (they hold the same experts). The mesh's dimensions are
``pp, edp, ep, cp, tp`` (those of one rank are left out); the data axis ``dp`` is ``edp × ep`` flattened, and the
data-parallel strategy runs over ``data`` = ``dp × cp`` (every rank that holds the same weights and computes a
different part of the gradient), the experts' gradients over ``expert_data`` = ``edp × cp``. Each axis is a
``World`` of its own (its rank, size and process group), so a strategy written for the whole world runs unchanged
over its axis; with every axis but dp of one rank, dp is the world itself and no group is created.

A run's layout is built once, from degrees ``lab.training.plan`` has checked (with every refusal of a run's
configuration), and the mesh carries it. ``share`` is what one rank holds of a model (parameters, model-state and
activation bytes), which the run's memory check, ``lab plan`` and the accounting read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lab.measure import accounting
from lab.runtime import compat
from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig

AXES = ("pp", "dp", "cp", "tp")  # outermost first: stages and data replicas span nodes, the tensor axis stays in one
MESH_DIMS = ("pp", "edp", "ep", "cp", "tp")  # the device mesh's dimensions (dp = edp × ep)
# the [parallel] options of the layout, which every strategy runs with (one that owns the step refuses the axes)
OPTIONS = frozenset({"activation_checkpointing", "tp", "tp_impl", "sequence_parallel", "pp", "pp_schedule",
                     "pp_microbatches", "pp_virtual", "pp_impl", "ep", "cp", "cp_split", "cp_impl"})


@dataclass(frozen=True)
class LoopSettings:
    """What the loop decides that a strategy may need before it builds (an engine's config takes them)."""

    micro_batch: int  # sequences per rank per micro-step
    accum_steps: int  # micro-steps per optimizer step
    grad_clip: float  # the max_norm clip_grad_norm is called with (0: off)
    compile: bool = False  # the strategy compiles the model it builds (train.compile)
    noise_scale: bool = False  # the engine measures the gradient noise scale (train.noise_scale)
    optimizer: str = "adamw"  # adamw, or muon: matrices stepped whole (train.optimizer)


@dataclass(frozen=True)
class World:
    """Where this process sits: rank, world size and device; on one axis of a mesh, its rank and size on that axis
    and the axis's process group (None: the default group, every rank)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    device_mesh: Any = None  # the axis as a one-dimensional torch DeviceMesh (FSDP2 takes one), when on a mesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def global_rank(self, rank: int) -> int:
        """The global rank of this world's rank ``rank`` (what torch.distributed's ``src`` arguments take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor of the loop's own figures over ranks (bookkeeping, not counted as strategy traffic)."""
        if self.world_size == 1:
            return values
        values = values.detach().clone()
        dist.all_reduce(values, group=self.group)
        return values

    def broadcast_from_main(self, make: Callable[[], Any]) -> Any:
        """``make()`` evaluated on rank 0 and handed to every rank (a picklable value)."""
        if self.world_size == 1:
            return make()
        box = [make() if self.is_main else None]
        dist.broadcast_object_list(box, src=self.global_rank(0), group=self.group)
        return box[0]

    def check_same(self, value: str, what: str) -> None:
        """Raise ConfigError on every rank when ranks disagree on ``value`` (a digest of ``what``)."""
        if self.world_size == 1:
            return
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise ConfigError(f"{what} differs between ranks: rank {differ[0]} has {values[differ[0]][:12]}, "
                              f"rank 0 has {values[0][:12]}")


_MESHES: dict[tuple, Mesh] = {}  # by default group, rank, device and degrees


def alone(world: World) -> World:
    """A world of this process alone (an axis of one rank)."""
    return World(rank=0, world_size=1, local_rank=world.local_rank, device=world.device)


@dataclass(frozen=True)
class Mesh:
    """The world and this rank's place on each named axis: ``pp``, ``dp``, ``cp``, ``tp``, ``ep``, ``edp``, the
    strategy's ``data`` (dp × cp) and ``expert_data`` (edp × cp), and ``stage`` (every rank of this rank's pipeline
    stage: dp × cp × tp); ``layout``, the record it places."""

    world: World
    axes: dict[str, World]
    layout: Layout | None = None

    def __getattr__(self, name: str) -> World:
        axes = self.__dict__.get("axes", {})
        if name in axes:
            return axes[name]
        raise AttributeError(name)


# ---------------------------------------------------------------- the record


@dataclass(frozen=True)
class Layout:
    """The degree of every axis of a run on ``world_size`` ranks, checked (``of``)."""

    world_size: int
    pp: int = 1
    dp: int = 1  # data-parallel replicas: ranks that read different sequences
    cp: int = 1
    tp: int = 1
    ep: int = 1  # carved out of dp
    shards: str = "nothing"  # what the data-parallel strategy shards over dp: nothing, optimizer, gradients, weights

    @classmethod
    def of(cls, cfg: ParallelConfig, world_size: int, strategy: type | None = None) -> Layout:
        """The layout ``cfg`` asks for on ``world_size`` ranks, its degrees checked (``lab.training.plan``)."""
        dp = world_size // (cfg.tp * cfg.pp * cfg.cp)
        shards = getattr(strategy, "shards", "nothing") if strategy is not None else "nothing"
        return cls(world_size, pp=cfg.pp, dp=dp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, shards=shards)

    @property
    def axes(self) -> dict[str, int]:
        """The degree of each axis split over more than one rank (the data axis always)."""
        return {name: degree for name, degree in self.degrees().items() if degree > 1 or name == "dp"}

    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp, "ep": self.ep}

    # ------------------------------------------------------------ where a rank sits

    def coordinates(self, rank: int) -> dict[str, int]:
        """Global rank ``rank``'s place on each axis (``ep`` and ``edp`` inside ``dp``)."""
        tp, cp = rank % self.tp, rank // self.tp % self.cp
        dp, pp = rank // (self.tp * self.cp) % self.dp, rank // (self.tp * self.cp * self.dp)
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": dp % self.ep, "edp": dp // self.ep}

    def data_replica(self, rank: int) -> tuple[int, int]:
        """(which, how many): the data-parallel replica global rank ``rank`` belongs to, among how many. The ranks of
        a replica read the same sequences (and draw the same dropout masks)."""
        return self.coordinates(rank)["dp"], self.dp

    def mesh(self, world: World) -> Mesh:
        """Every axis of ``world`` as a ``World`` (collective when an axis besides dp is split: every rank calls it).
        Each group gets ``parallel.timeout_s``, not torch's 30 minutes: a dead rank fails fast. A process group made
        once serves every later strategy of the same layout in this process group (each group holds threads)."""
        sizes = {"pp": self.pp, "edp": self.dp // self.ep, "ep": self.ep, "cp": self.cp, "tp": self.tp}
        one = alone(world)
        if all(sizes[d] == 1 for d in ("pp", "ep", "cp", "tp")):
            return Mesh(world, {"pp": one, "dp": world, "cp": one, "tp": one, "ep": one, "edp": world, "data": world,
                                "expert_data": world, "stage": world}, self)
        key = (dist.group.WORLD, world.rank, world.device, tuple(sizes.values()))  # the group held: no id reused
        if key not in _MESHES:
            _MESHES[key] = self._build_mesh(world, sizes, one)
        return dataclasses.replace(_MESHES[key], layout=self)

    def _build_mesh(self, world: World, sizes: dict[str, int], one: World) -> Mesh:
        from torch.distributed.device_mesh import init_device_mesh

        # the data axis is a group even of one rank (a strategy's collectives over None would span the world)
        dims = tuple(d for d in MESH_DIMS if sizes[d] > 1 or d == "edp")
        device_mesh = init_device_mesh(world.device.type, tuple(sizes[d] for d in dims), mesh_dim_names=dims)

        def axis(*names: str) -> World:
            split = tuple(n for n in names if sizes[n] > 1)
            if not split and "edp" not in names:
                return one
            names = split or ("edp",)
            if len(names) > 1 and math.prod(sizes[n] for n in names) == world.world_size:
                return world
            sub = device_mesh[names]._flatten("_".join(names)) if len(names) > 1 else device_mesh[names[0]]
            compat.inherit_timeout(sub.get_group())
            return dataclasses.replace(world, rank=sub.get_local_rank(), world_size=sub.size(), group=sub.get_group(),
                                       device_mesh=sub)

        return Mesh(world, {"pp": axis("pp"), "dp": axis("edp", "ep"), "cp": axis("cp"), "tp": axis("tp"),
                            "ep": axis("ep"), "edp": axis("edp"), "data": axis("edp", "ep", "cp"),
                            "expert_data": axis("edp", "cp"), "stage": axis("edp", "ep", "cp", "tp")})

    # ------------------------------------------------------------ what one rank holds, in theory

    def share(self, model: ModelConfig, row: str, precision: str = "fp32") -> RankShare:
        """What one rank of the fullest pipeline stage holds of ``model`` under this layout
        (``accounting.rank_params``: its stage's blocks and the embedding or the head, split tp ways; 1 / ep of the
        routed experts) and their model-state bytes under the ZeRO ``row`` (``accounting.model_state_bytes``) over
        the strategy's ranks (dp × cp; the experts over the edp × cp of them that hold the same ones)."""
        params, experts = accounting.rank_params(model, self.tp, self.pp, self.ep)
        n = self.dp * self.cp
        states = accounting.model_state_bytes(params - experts, row, n, precision)
        if experts:
            split = accounting.model_state_bytes(experts, row, n // self.ep, precision)
            states = accounting.StateBytes(states.params + split.params, states.grads + split.grads,
                                           states.optimizer + split.optimizer, states.offload)
        return RankShare(params=params, expert_params=experts, states=states)

    def activation_bytes(self, model: ModelConfig, micro_batch: int, bytes_per_value: int,
                         sequence_parallel: bool = False, checkpointing: bool = False) -> float:
        """One micro-batch's activations of every layer on one rank (``accounting.activation_bytes``: split tp ways
        inside attention and the MLP; with sequence parallelism also the norms' inputs; cp-fold less, a shard of the
        tokens). Under a pipeline a stage holds about that much: L / pp layers each for the pp microbatches 1F1B's
        first stage keeps in flight."""
        return accounting.activation_bytes(model, micro_batch, bytes_per_value, checkpointing=checkpointing,
                                           tp=self.tp, sequence_parallel=sequence_parallel, cp=self.cp)


@dataclass(frozen=True)
class RankShare:
    """What one rank holds, in theory."""

    params: float
    expert_params: float  # of which routed experts
    states: accounting.StateBytes
