"""Parallelism: a layout (``layout.py``: every axis's degree, the mesh) and a strategy chosen by name (``--strategy``)
that places the model over the data axis and loops over the layout's transforms (``axes/``).

    layout.py, comm.py          the ground: degrees, refusals, the mesh, counted collectives
    axes/                       tensor, experts, pipeline, activation checkpointing: the transforms, in one list
    base.py                     a data-parallel strategy: places, syncs gradients, steps
    holding.py                  what each rank holds: the global norm, checkpoint state and export, written once
    precision.py                mixed precision's fp32 masters and fp16's loss scale (docs/precision.md)
    meters.py, accounts.py      what the steps cost, measured and in theory
    engine.py                   parallelize() and the engine the loop drives: the parts above, in reading order
    data/                       the data-parallel strategies: single, ddp, zero, torch's; DeepSpeed's own engine
"""

from __future__ import annotations

import dataclasses

from lab.measure.device import Precision
from lab.measure.figures import Figures
from lab.model import GPT
from lab.parallel import axes
from lab.parallel.axes import activations, context, experts, pipeline, tensor
from lab.parallel.base import ModelFactory, OptimizerFactory, ParamGroup, ParamGroupRule, Strategy
from lab.parallel.comm import backend_for, join_group_of_one
from lab.parallel.data.ddp import BucketedDDP, NaiveDDP
from lab.parallel.data.deepspeed import DeepSpeed
from lab.parallel.data.single import Single
from lab.parallel.data.torch_ref import FSDP, TorchDDP
from lab.parallel.data.zero import Zero1, Zero2, Zero3
from lab.parallel.engine import Engine
from lab.parallel.layout import OPTIONS as layout_options
from lab.parallel.layout import Layout, LoopSettings, World, refuse_model
from lab.parallel.precision import LossScaler
from lab.runtime import compat
from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, did_you_mean

STRATEGIES: dict[str, type[Strategy] | type[DeepSpeed]] = {
    cls.name: cls for cls in (Single, NaiveDDP, BucketedDDP, TorchDDP, Zero1, Zero2, Zero3, FSDP, DeepSpeed)}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` a strategy ``--strategy cls.name`` chooses (the built-in ones are in ``STRATEGIES``)."""
    STRATEGIES[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy '{name}' (known: {', '.join(STRATEGIES)}){did_you_mean(name, STRATEGIES)}")
    return STRATEGIES[name]


def validate(cfg: ParallelConfig, world_size: int, loop: LoopSettings) -> type[Strategy]:
    """Check the [parallel] section for ``world_size`` processes under the loop's ``loop`` settings: the layout's
    degrees and refusals (``Layout.of``), each axis's own options, then the strategy's; return the strategy's class."""
    compat.check()
    cls = strategy_class(cfg.strategy)
    layout = Layout.of(cfg, world_size, cls, loop)
    if cfg.tp_impl not in tensor.IMPLEMENTATIONS:
        raise ConfigError(f"parallel.tp_impl must be one of {', '.join(tensor.IMPLEMENTATIONS)}, got '{cfg.tp_impl}'"
                          f"{did_you_mean(cfg.tp_impl, tensor.IMPLEMENTATIONS)}")
    if cfg.tp_impl == "torch" and cfg.tp == 1:
        raise ConfigError("parallel.tp_impl torch (the DTensor reference) needs parallel.tp > 1")
    pipeline.check_options(cfg, loop.micro_batch)
    context.check_options(cfg)
    if not cfg.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {cfg.timeout_s}")
    if not cfg.bucket_mb > 0:
        raise ConfigError(f"parallel.bucket_mb must be positive, got {cfg.bucket_mb}")
    for option, allowed in (("activation_checkpointing", activations.MODES), ("offload", cls.offload_modes)):
        if (value := getattr(cfg, option)) not in allowed:
            raise ConfigError(f"parallel.{option} must be one of {', '.join(allowed)}, got '{value}'"
                              f"{did_you_mean(value, allowed)}")
    for option in changed_options(cfg):
        if option not in cls.options | layout_options:
            users = [name for name, c in STRATEGIES.items() if option in c.options]
            raise ConfigError(f"parallel.{option} has no effect under strategy '{cls.name}' "
                              f"(it applies to: {', '.join(users) or 'no strategy'})")
    world = layout.dp * layout.cp
    if world < cls.min_world_size:
        raise ConfigError(f"strategy '{cls.name}' needs at least {cls.min_world_size} processes, got "
                          f"world size {world} (start it with torchrun --nproc_per_node=N)")
    if cls.max_world_size is not None and world > cls.max_world_size:
        raise ConfigError(f"strategy '{cls.name}' runs on at most {cls.max_world_size} process(es), "
                          f"got world size {world}: choose a data-parallel --strategy (ddp, zero1, zero2, "
                          f"zero3, fsdp) or run fewer processes")
    if loop.compile and not cls.compiles:
        raise ConfigError(f"train.compile is not supported under strategy '{cls.name}' (dynamo cannot trace "
                          f"parameters sharded at rest); set train.compile false or choose another strategy")
    if cls is DeepSpeed:
        DeepSpeed.check(cfg, world, loop)
    return cls


def parse_spec(text: str) -> ParallelConfig:
    """A strategy and its options written ``name[:key=value,...]`` (``zero2:offload=optimizer``), validated."""
    from lab.runtime.config import resolve

    name, _, rest = text.partition(":")
    pairs = [kv.split("=", 1) for kv in rest.split(",") if kv]
    if any(len(p) != 2 for p in pairs):
        raise ConfigError(f"'{text}': options are written name:key=value,key=value")
    return resolve({"parallel": {"strategy": name, **dict(pairs)}}).parallel


def validate_precision(cfg: ParallelConfig, precision: Precision) -> None:
    """Raise ConfigError (one line) when the strategy cannot run the precision policy."""
    cls = strategy_class(cfg.strategy)
    if precision.scales_loss and cls is DeepSpeed:
        raise ConfigError(f"strategy '{cls.name}' does not run train.dtype fp16: {DeepSpeed.runs_fp16}")


def create(cfg: ParallelConfig, world: World, precision: Precision, loop: LoopSettings) -> Engine | DeepSpeed:
    """The engine of the strategy ``cfg`` names, validated and constructed (not yet built) on the layout's mesh
    (collective when an axis besides dp is split: every rank calls it)."""
    cls = validate(cfg, world.world_size, loop)
    validate_precision(cfg, precision)
    mesh = Layout.of(cfg, world.world_size, cls, loop).mesh(world)
    return DeepSpeed(mesh, cfg, precision, loop) if cls is DeepSpeed else Engine(cls, mesh, cfg, precision, loop)


def changed_options(cfg: ParallelConfig) -> list[str]:
    """The [parallel] options set to something other than their default (strategy and timeout aside)."""
    default = ParallelConfig()
    return [f.name for f in dataclasses.fields(cfg) if f.name not in ("strategy", "timeout_s")
            and getattr(cfg, f.name) != getattr(default, f.name)]


def validate_model(cfg: ParallelConfig, model: ModelConfig) -> None:
    """Raise ConfigError (one line) when the model's layers cannot be split as ``cfg`` asks."""
    refuse_model(cfg, model)
    context.check_options(cfg, model.block_size)


def line_parts() -> list[type[Figures]]:
    """Every part a run can have that reports on it, in the step line's order (each part's ``line_place``): fp16's loss
    scaler, the transforms' one list (``axes.kinds``) and the model's features (``GPT.FIGURES``)."""
    return sorted((LossScaler, *axes.kinds(), *GPT.FIGURES), key=lambda part: part.line_place)


def step_line(rec: dict) -> str:
    """The step line's fragments for the figures in ``rec``, each part's own (empty for a part absent from it)."""
    return "".join(part.line(rec) for part in line_parts())


def data_replica(cfg: ParallelConfig, rank: int, world_size: int) -> tuple[int, int]:
    """(which, how many): the data-parallel replica global rank ``rank`` belongs to, among how many. The ranks of
    a replica read the same sequences (and draw the same dropout masks)."""
    return Layout.of(cfg, world_size).data_replica(rank)


__all__ = ["STRATEGIES", "Engine", "Layout", "LoopSettings", "ModelFactory", "OptimizerFactory", "ParamGroup",
           "ParamGroupRule",
           "Strategy", "World", "axes", "backend_for", "create", "data_replica", "experts", "join_group_of_one",
           "parse_spec", "register", "step_line", "strategy_class", "validate", "validate_model", "validate_precision"]
