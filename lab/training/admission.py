"""Admission: what a run needs (memory per process, time at an assumed MFU), estimated from ``accounting`` and the
layout before any work, and the refusal of a run that cannot fit or could not finish."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab import parallel
from lab.measure import accounting
from lab.measure.device import Peak, Precision
from lab.runtime.config import ConfigError, RunConfig

ESTIMATE_MFU = 0.3  # the utilisation the start line's duration estimate assumes
MAX_DAYS = 365  # a run that would take longer than this even at 100 % MFU is refused


@dataclass(frozen=True)
class Estimate:
    """What the run needs, estimated from ``lab.measure.accounting`` before it starts."""

    memory_bytes: float  # model states + activations, per process
    available_bytes: float  # what this process may use
    seconds: float  # at ESTIMATE_MFU


def check_resources(cfg: RunConfig, layout: parallel.Layout, world: parallel.World, precision: Precision, peak: Peak,
                    vocab_size: int, available_bytes: float, local_world_size: int = 1) -> Estimate:
    """Refuse a run whose states and activations cannot fit, or that could not finish within MAX_DAYS.

    Memory: what one process holds under the run's ``layout`` (``Layout.share``: its model states in the widths of
    the run's precision policy (``Costs``, a strategy's record of its placement), and ``Layout.activation_bytes``, one micro-batch's
    activations with a fused attention kernel: a lower bound);
    processes on one CPU host share its available memory. Time: the run's FLOPs over the peak of all its devices.
    """
    shape = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab_size)
    costs = parallel.strategy_class(cfg.parallel.strategy).costs
    widths = "fp32" if costs.fp32_states else precision.state_widths
    states = layout.share(shape, costs.states.format(zero_stage=cfg.parallel.zero_stage), widths).states.total
    activations = layout.activation_bytes(shape, cfg.train.micro_batch, precision.activation_bytes,
                                          sequence_parallel=cfg.parallel.sequence_parallel)
    share = available_bytes / (local_world_size if world.device.type == "cpu" else 1)
    if states + activations > share:
        raise ConfigError(f"this run needs about {_size(states + activations)} per process ({_size(states)} model "
                          f"states + {_size(activations)} activations of micro_batch {cfg.train.micro_batch} × "
                          f"block_size {shape.block_size}) but {_size(share)} is available; lower train.micro_batch or "
                          f"the model's size, or split them over more ranks (parallel.cp splits every sequence, "
                          f"parallel.tp and pp the model)")
    total_steps = math.ceil(cfg.train.tokens / cfg.train.batch_tokens)  # the step plan's (checked before)
    flops = accounting.flops_per_token(shape) * total_steps * cfg.train.batch_tokens
    fastest = flops / (peak.flops * world.world_size)
    if fastest > MAX_DAYS * 86_400:
        raise ConfigError(f"train.tokens {cfg.train.tokens:.3g} needs {flops:.3g} FLOPs: at least "
                          f"{fastest / 86_400 / 365:.3g} years on {world.world_size} × {peak.flops:.3g} FLOP/s even at "
                          f"100% MFU (the limit is {MAX_DAYS} days)")
    return Estimate(states + activations, share, fastest / ESTIMATE_MFU)


def _size(n: float) -> str:
    """Bytes in GiB, three significant digits (a tiny run's shows too)."""
    return f"{n / 2**30:,.3g} GiB"

