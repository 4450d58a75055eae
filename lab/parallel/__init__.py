"""Parallelism: a layout (``layout.py``: every axis's degree, the mesh) and a strategy chosen by name (``--strategy``)
that places the model over the data axis and loops over the layout's transforms (``axes/``).

    layout.py, comm.py          the ground: degrees, the mesh, counted collectives (refusals: lab.training.plan)
    axes/                       tensor, experts, pipeline, activation checkpointing: the transforms, in one list
    base.py                     a data-parallel strategy: places, syncs gradients, steps
    holding.py                  what each rank holds: the global norm, checkpoint state and export, written once
    precision.py                mixed precision's fp32 masters and fp16's loss scale (docs/precision.md)
    meters.py, accounts.py      what the steps cost, measured and in theory (lab.measure.placement: the record)
    noise.py                    the gradient noise scale, from each micro-batch's gradient (train.noise_scale)
    owners.py                   Muon's orthogonalizations spread over the data axis, one owner rank a matrix
    engine.py                   parallelize() and the engine the loop drives: the parts above, in reading order
    data/                       the data-parallel strategies: single, ddp, zero, torch's; DeepSpeed's own engine
"""

from __future__ import annotations

from lab.measure.device import Precision
from lab.measure.figures import Figures
from lab.model import GPT
from lab.parallel import axes
from lab.parallel.axes import activations, experts
from lab.parallel.base import ModelFactory, OptimizerFactory, ParamGroup, ParamGroupRule, Strategy
from lab.parallel.comm import backend_for, join_group_of_one
from lab.parallel.data.ddp import BucketedDDP, NaiveDDP
from lab.parallel.data.deepspeed import DeepSpeed
from lab.parallel.data.single import Single
from lab.parallel.data.torch_ref import FSDP, TorchDDP
from lab.parallel.data.zero import Zero1, Zero2
from lab.parallel.data.zero3 import Zero3
from lab.parallel.engine import Engine
from lab.parallel.layout import Layout, LoopSettings, World
from lab.parallel.noise import GradientNoise
from lab.parallel.owners import Owners
from lab.parallel.precision import LossScaler
from lab.runtime.config import ConfigError, ParallelConfig, did_you_mean

RunEngine = Engine | DeepSpeed  # what a run's loop drives: the lab's engine, or DeepSpeed's
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


def parse_spec(text: str) -> ParallelConfig:
    """A strategy and its options written ``name[:key=value,...]`` (``zero2:offload=optimizer``), validated."""
    from lab.runtime.config import resolve

    name, _, rest = text.partition(":")
    pairs = [kv.split("=", 1) for kv in rest.split(",") if kv]
    if any(len(p) != 2 for p in pairs):
        raise ConfigError(f"'{text}': options are written name:key=value,key=value")
    return resolve({"parallel": {"strategy": name, **dict(pairs)}}).parallel


def create(cfg: ParallelConfig, layout: Layout, world: World, precision: Precision,
           loop: LoopSettings) -> RunEngine:
    """The engine of the strategy ``cfg`` names on ``layout`` (checked: ``lab.training.plan``), constructed, not yet
    built, on the layout's mesh (collective when an axis besides dp is split: every rank calls it)."""
    cls, mesh = STRATEGIES[cfg.strategy], layout.mesh(world)
    return DeepSpeed(mesh, cfg, precision, loop) if cls is DeepSpeed else Engine(cls, mesh, cfg, precision, loop)


def line_parts() -> list[type[Figures]]:
    """Every part a run can have that reports on it, in the step line's order (each part's ``line_place``): fp16's loss
    scaler, the transforms' one list (``axes.kinds``), the model's features (``GPT.FIGURES``), the noise scale and
    Muon's orthogonalizations."""
    return sorted((LossScaler, *axes.kinds(), *GPT.FIGURES, GradientNoise, Owners), key=lambda part: part.line_place)


def step_line(rec: dict) -> str:
    """The step line's fragments for the figures in ``rec``, each part's own (empty for a part absent from it)."""
    return "".join(part.line(rec) for part in line_parts())


__all__ = ["STRATEGIES", "Engine", "Layout", "LoopSettings", "ModelFactory", "OptimizerFactory", "ParamGroup",
           "ParamGroupRule", "RunEngine", "Strategy", "World", "activations", "axes", "backend_for", "create",
           "experts", "join_group_of_one", "parse_spec", "register", "step_line", "strategy_class"]
