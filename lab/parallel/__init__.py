"""Parallelism strategies behind one interface (``base.Strategy``), chosen by name (``--strategy``)."""

from __future__ import annotations

from lab.config import ConfigError, ParallelConfig
from lab.device import Precision
from lab.parallel.base import (
    ModelFactory,
    OptimizerFactory,
    ParamGroup,
    ParamGroupRule,
    Strategy,
    World,
    changed_options,
)
from lab.parallel.ddp import BucketedDDP, NaiveDDP
from lab.parallel.single import Single
from lab.parallel.torch_ref import TorchDDP

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Single, NaiveDDP, BucketedDDP, TorchDDP)}


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy '{name}' (known: {', '.join(STRATEGIES)})")
    return STRATEGIES[name]


def validate(cfg: ParallelConfig, world_size: int) -> type[Strategy]:
    """Check the [parallel] section for ``world_size`` processes; return the strategy's class."""
    cls = strategy_class(cfg.strategy)
    if not cfg.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {cfg.timeout_s}")
    if not cfg.bucket_mb > 0:
        raise ConfigError(f"parallel.bucket_mb must be positive, got {cfg.bucket_mb}")
    for option in changed_options(cfg):
        if option not in cls.options:
            users = [name for name, c in STRATEGIES.items() if option in c.options]
            raise ConfigError(f"parallel.{option} has no effect under strategy '{cls.name}' "
                              f"(it applies to: {', '.join(users) or 'no strategy'})")
    cls.validate(cfg, world_size)
    return cls


def create(cfg: ParallelConfig, world: World, precision: Precision) -> Strategy:
    return validate(cfg, world.world_size)(world, cfg, precision)


__all__ = ["STRATEGIES", "ModelFactory", "OptimizerFactory", "ParamGroup", "ParamGroupRule", "Strategy", "World",
           "create", "strategy_class", "validate"]
