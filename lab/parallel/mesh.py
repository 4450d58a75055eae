"""The device mesh: the world's ranks on named axes, built once; each transform takes its axis.

A world of ``pp × dp × tp`` ranks. Tensor-parallel groups are ``tp`` consecutive ranks (on a cluster they
share a node: the heaviest traffic); the data-parallel groups run across them, and the pipeline stages,
whose traffic is the lightest (one activation per microbatch boundary), are the outermost. Rank ``r`` sits
at pipeline coordinate ``r // (dp·tp)``, data coordinate ``r // tp % dp`` and tensor coordinate ``r % tp``.
Each axis is a ``World`` of its own (its rank, size and process group), so a data-parallel strategy written
for the whole world runs unchanged over its axis. With ``tp`` and ``pp`` 1 the data axis is the world itself
and the others worlds of one: no group is created; an axis of one is a world of one whenever another is
split. A context axis joins ``AXES`` in its place in the order.

Expert parallelism (``parallel.ep``) is carved out of the data axis, as DeepSpeed-MoE and torchtitan do: its
groups (``ep``) are ``ep`` consecutive data-parallel ranks, which split a mixture of experts' experts and still read
their own data; ``edp`` joins the ranks at the same place of every group (they hold the same experts: their
gradients are averaged over it). Without it ``ep`` is a world of one and ``edp`` the data axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lab.runtime import compat
from lab.runtime.config import ConfigError, ParallelConfig

AXES = ("pp", "dp", "tp")  # outermost first: stages and data replicas span nodes, the tensor axis stays in one


@dataclass(frozen=True)
class World:
    """Where this process sits: rank, world size and device; on one axis of a mesh (``lab.parallel.mesh``),
    its rank and size on that axis and the axis's process group (None: the default group, every rank)."""

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


def check_degree(cfg: ParallelConfig, world_size: int) -> None:
    """Raise ConfigError (one line) when ``parallel.tp`` and ``parallel.pp`` cannot split ``world_size`` processes."""
    for axis in ("tp", "pp"):
        if getattr(cfg, axis) < 1:
            raise ConfigError(f"parallel.{axis} must be at least 1, got {getattr(cfg, axis)}")
    if world_size % cfg.tp:
        raise ConfigError(f"parallel.tp ({cfg.tp}) must divide the world size ({world_size})")
    if world_size % (cfg.tp * cfg.pp):
        raise ConfigError(f"parallel.tp × parallel.pp ({cfg.tp} × {cfg.pp}) must divide the world size ({world_size})")
    if cfg.ep < 1:
        raise ConfigError(f"parallel.ep must be at least 1, got {cfg.ep}")
    if world_size // (cfg.tp * cfg.pp) % cfg.ep:
        raise ConfigError(f"parallel.ep ({cfg.ep}) must divide the data-parallel ranks "
                          f"({world_size // (cfg.tp * cfg.pp)} = world size / (tp · pp))")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")


def data_size(cfg: ParallelConfig, world_size: int) -> int:
    """How many data-parallel replicas ``world_size`` processes make (each reads its own slice of a batch)."""
    check_degree(cfg, world_size)
    return world_size // (cfg.tp * cfg.pp)


def data_rank(cfg: ParallelConfig, rank: int, world_size: int) -> int:
    """Which data-parallel replica global rank ``rank`` belongs to (its ranks read the same sequences)."""
    return rank // cfg.tp % data_size(cfg, world_size)


@dataclass(frozen=True)
class Mesh:
    """The world and this rank's place on each named axis (``AXES``)."""

    world: World
    axes: dict[str, World]

    def axis(self, name: str) -> World:
        return self.axes[name]

    @property
    def dp(self) -> World:
        """The data-parallel axis: the data-parallel strategy's world."""
        return self.axes["dp"]

    @property
    def tp(self) -> World:
        """The tensor-parallel axis (a world of one without tensor parallelism)."""
        return self.axes["tp"]

    @property
    def pp(self) -> World:
        """The pipeline axis (a world of one without pipeline parallelism)."""
        return self.axes["pp"]

    @property
    def ep(self) -> World:
        """The expert-parallel group (a world of one without expert parallelism)."""
        return self.axes["ep"]

    @property
    def edp(self) -> World:
        """The ranks holding the same experts as this one (the data axis without expert parallelism)."""
        return self.axes["edp"]


def build(world: World, cfg: ParallelConfig) -> Mesh:
    """The mesh of ``world`` for ``cfg``'s degrees (collective when an axis besides dp is split: every rank calls
    it). Every axis's group gets ``parallel.timeout_s``, not torch's 30 minutes: a dead rank fails fast."""
    alone = World(rank=0, world_size=1, local_rank=world.local_rank, device=world.device)
    if cfg.tp == 1 and cfg.pp == 1:
        return Mesh(world, {"dp": world, "tp": alone, "pp": alone, **expert_axes(world, cfg.ep)})
    sizes = {"pp": cfg.pp, "dp": data_size(cfg, world.world_size), "tp": cfg.tp}
    names = tuple(a for a in AXES if a == "dp" or sizes[a] > 1)  # the data axis is a group even when of one
    mesh = init_device_mesh(world.device.type, tuple(sizes[a] for a in names), mesh_dim_names=names)

    def axis(name: str) -> World:
        sub = mesh[name]
        compat.inherit_timeout(sub.get_group())
        return dataclasses.replace(world, rank=sub.get_local_rank(), world_size=sub.size(), group=sub.get_group(),
                                   device_mesh=sub)

    axes = {name: axis(name) if name in names else alone for name in AXES}
    return Mesh(world, axes | expert_axes(axes["dp"], cfg.ep))


def expert_axes(data: World, ep: int) -> dict[str, World]:
    """The ``ep`` and ``edp`` axes carved out of the data axis ``data`` (the whole world: ``parallel.ep`` > 1 runs
    without tp and pp; collective when ``ep`` > 1)."""
    if ep == 1:
        return {"ep": World(rank=0, world_size=1, local_rank=data.local_rank, device=data.device), "edp": data}
    assert data.group is None, "expert parallelism is carved out of a data axis that is the whole world"
    n = data.world_size
    groups = {"ep": [list(range(g, g + ep)) for g in range(0, n, ep)],
              "edp": [list(range(j, n, ep)) for j in range(ep)]}
    out = {}
    for name, rank_lists in groups.items():
        for ranks in rank_lists:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if data.rank in ranks:
                compat.inherit_timeout(group)
                out[name] = dataclasses.replace(data, rank=ranks.index(data.rank), world_size=len(ranks), group=group,
                                                device_mesh=None)
    return out
