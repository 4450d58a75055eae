"""Parallelism strategies behind one interface, chosen by name (``--strategy``)."""

from __future__ import annotations

from lab.config import ConfigError
from lab.parallel.base import OptimizerFactory, Strategy, World
from lab.parallel.single import Single

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Single,)}


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy '{name}' (known: {', '.join(sorted(STRATEGIES))})")
    return STRATEGIES[name]


def create(name: str, world: World) -> Strategy:
    return strategy_class(name)(world)


__all__ = ["STRATEGIES", "OptimizerFactory", "Strategy", "World", "create", "strategy_class"]
