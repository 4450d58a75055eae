"""Parallelism strategies behind one interface (``base.Strategy``), chosen by name (``--strategy``)."""

from __future__ import annotations

from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, did_you_mean
from lab.runtime import compat
from lab.measure.device import Precision
from lab.model import validate_split
from lab.parallel import activations, experts, mesh, pipeline, tensor
from lab.parallel.base import (
    LoopSettings,
    ModelFactory,
    OptimizerFactory,
    ParamGroup,
    ParamGroupRule,
    Strategy,
    changed_options,
    backend_for,
    join_group_of_one,
)
from lab.parallel.mesh import World
from lab.parallel.ddp import BucketedDDP, NaiveDDP
from lab.parallel.deepspeed import DeepSpeed
from lab.parallel.single import Single
from lab.parallel.torch_ref import FSDP, TorchDDP
from lab.parallel.zero import Zero1, Zero2, Zero3

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Single, NaiveDDP, BucketedDDP, TorchDDP, Zero1,
                                                                   Zero2, Zero3, FSDP, DeepSpeed)}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` a strategy ``--strategy cls.name`` chooses (the built-in ones are in ``STRATEGIES``)."""
    STRATEGIES[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy '{name}' (known: {', '.join(STRATEGIES)}){did_you_mean(name, STRATEGIES)}")
    return STRATEGIES[name]


def validate(cfg: ParallelConfig, world_size: int, loop: LoopSettings) -> type[Strategy]:
    """Check the [parallel] section for ``world_size`` processes under the loop's ``loop`` settings (the
    strategy runs over the data-parallel ranks: ``world_size / (parallel.tp · parallel.pp)``); return the
    strategy's class."""
    compat.check()
    cls = strategy_class(cfg.strategy)
    replicas = mesh.data_size(cfg, world_size)
    if cfg.tp > 1 and not cls.tensor_parallel:
        raise ConfigError(f"strategy '{cls.name}' does not run with parallel.tp > 1 (its engine takes the whole "
                          f"world); choose ddp, torch_ddp, zero1-3 or fsdp")
    pipeline.check(cfg, cls, loop.micro_batch, loop.compile)
    experts.check(cfg, cls, loop.compile)
    if cfg.tp_impl not in tensor.IMPLEMENTATIONS:
        raise ConfigError(f"parallel.tp_impl must be one of {', '.join(tensor.IMPLEMENTATIONS)}, got '{cfg.tp_impl}'"
                          f"{did_you_mean(cfg.tp_impl, tensor.IMPLEMENTATIONS)}")
    if cfg.tp_impl == "torch" and cfg.tp == 1:
        raise ConfigError("parallel.tp_impl torch (the DTensor reference) needs parallel.tp > 1")
    if not cfg.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {cfg.timeout_s}")
    if not cfg.bucket_mb > 0:
        raise ConfigError(f"parallel.bucket_mb must be positive, got {cfg.bucket_mb}")
    for option, allowed in (("activation_checkpointing", activations.MODES), ("offload", cls.offload_modes)):
        if (value := getattr(cfg, option)) not in allowed:
            raise ConfigError(f"parallel.{option} must be one of {', '.join(allowed)}, got '{value}'"
                              f"{did_you_mean(value, allowed)}")
    for option in changed_options(cfg):
        if option not in cls.options:
            users = [name for name, c in STRATEGIES.items() if option in c.options]
            raise ConfigError(f"parallel.{option} has no effect under strategy '{cls.name}' "
                              f"(it applies to: {', '.join(users) or 'no strategy'})")
    cls.validate(cfg, replicas, loop)
    return cls


def parse_spec(text: str) -> ParallelConfig:
    """A strategy and its options written ``name[:key=value,...]`` (``zero2:offload=optimizer``), validated."""
    from lab.runtime.config import resolve

    name, _, rest = text.partition(":")
    pairs = [kv.split("=", 1) for kv in rest.split(",") if kv]
    if any(len(p) != 2 for p in pairs):
        raise ConfigError(f"'{text}': options are written name:key=value,key=value")
    return resolve({"parallel": {"strategy": name, **dict(pairs)}}).parallel


def create(cfg: ParallelConfig, world: World, precision: Precision, loop: LoopSettings) -> Strategy:
    """The strategy ``cfg`` names, validated and constructed (not yet built) on the world's mesh (collective when
    ``parallel.tp`` or ``parallel.pp`` > 1: every rank calls it): it runs over the data axis, its tensor-parallel
    transform over the tensor axis, its pipeline over the pp axis."""
    cls = validate(cfg, world.world_size, loop)
    return cls(mesh.build(world, cfg), cfg, precision, loop)


def validate_model(cfg: ParallelConfig, model: ModelConfig) -> None:
    """Raise ConfigError (one line) when the model's layers cannot be split as ``cfg`` asks."""
    validate_split(model, cfg)


def data_replica(cfg: ParallelConfig, rank: int, world_size: int) -> tuple[int, int]:
    """(which, how many): the data-parallel replica global rank ``rank`` belongs to, among how many. The ranks of
    a replica read the same sequences (and draw the same dropout masks)."""
    return mesh.data_rank(cfg, rank, world_size), mesh.data_size(cfg, world_size)


__all__ = ["STRATEGIES", "LoopSettings", "ModelFactory", "OptimizerFactory", "ParamGroup", "ParamGroupRule", "Strategy",
           "World", "backend_for", "create", "data_replica", "join_group_of_one", "parse_spec", "register",
           "strategy_class", "validate", "validate_model"]
