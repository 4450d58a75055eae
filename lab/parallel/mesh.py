"""The device mesh: a world of ``dp × tp`` ranks as two axes.

Tensor-parallel groups are ``tp`` consecutive ranks (on a cluster they share a node: the heaviest
traffic); the data-parallel groups run across them. Rank ``r`` sits at data coordinate ``r // tp``
and tensor coordinate ``r % tp``. Each axis is a ``World`` of its own (its rank, size and process
group), so a data-parallel strategy written for the whole world runs unchanged over its axis.
With ``tp`` 1 the data axis is the world itself: no group is created and nothing changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

from lab.runtime.config import ConfigError, ParallelConfig
from lab.parallel.base import World


def check_degree(cfg: ParallelConfig, world_size: int) -> None:
    """Raise ConfigError (one line) when ``parallel.tp`` cannot split ``world_size`` processes."""
    if cfg.tp < 1:
        raise ConfigError(f"parallel.tp must be at least 1, got {cfg.tp}")
    if world_size % cfg.tp:
        raise ConfigError(f"parallel.tp ({cfg.tp}) must divide the world size ({world_size})")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")


def data_size(cfg: ParallelConfig, world_size: int) -> int:
    """How many data-parallel replicas ``world_size`` processes make (each reads its own slice of a batch)."""
    check_degree(cfg, world_size)
    return world_size // cfg.tp


def data_rank(cfg: ParallelConfig, rank: int) -> int:
    """Which data-parallel replica global rank ``rank`` belongs to (its ranks read the same sequences)."""
    return rank // cfg.tp


@dataclass(frozen=True)
class Mesh:
    """This rank's place on both axes, and the world they split."""

    world: World
    data: World  # the data-parallel axis: the strategy's world
    tensor: World  # the tensor-parallel axis


def build(world: World, tp: int) -> Mesh:
    """The mesh of ``world`` with tensor-parallel degree ``tp`` (collective when ``tp`` > 1: every rank calls it)."""
    if tp == 1:
        alone = World(rank=0, world_size=1, local_rank=world.local_rank, device=world.device)
        return Mesh(world, world, alone)
    mesh = init_device_mesh(world.device.type, (world.world_size // tp, tp), mesh_dim_names=("dp", "tp"))

    def axis(name: str) -> World:
        sub = mesh[name]
        return dataclasses.replace(world, rank=sub.get_local_rank(), world_size=sub.size(), group=sub.get_group(),
                                   device_mesh=sub)

    return Mesh(world, axis("dp"), axis("tp"))
