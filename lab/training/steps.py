"""The step plan: how the token budget becomes steps and a global batch micro-batches per rank (made, with every check
of a run's configuration, by ``lab.training.plan``), where a run (re)starts (``Start``), when checkpoints are written,
and the seed of each step's random stream."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from lab.parallel import LoopSettings
from lab.runtime.config import ConfigError, RunConfig


@dataclass(frozen=True)
class StepPlan:
    """How the token budget becomes steps, and a global batch becomes micro-batches per rank."""

    global_sequences: int
    accum_steps: int
    total_steps: int
    micro_batch: int
    world_size: int  # data-parallel replicas: the ranks that read different sequences

    def micro_range(self, rank: int, micro: int) -> tuple[int, int]:
        """Which sequences of the step's global batch this rank reads in micro-step ``micro``."""
        lo = rank * (self.global_sequences // self.world_size) + micro * self.micro_batch
        return lo, lo + self.micro_batch


@dataclass
class Start:
    """Where a run (re)starts: its step, and the figures the steps before it left in their checkpoint."""

    step: int = 0
    wall_time_s: float = 0.0
    recent_losses: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    eval_loss: float | None = None


def loop_settings(cfg: RunConfig, plan: StepPlan) -> LoopSettings:
    """What the loop will do that a strategy may need to know before it builds."""
    return LoopSettings(micro_batch=plan.micro_batch, accum_steps=plan.accum_steps, grad_clip=cfg.train.grad_clip,
                        compile=cfg.train.compile, noise_scale=cfg.train.noise_scale, optimizer=cfg.train.optimizer)


def checkpoint_steps(cfg: RunConfig, total_steps: int) -> frozenset[int]:
    """``train.checkpoint_steps`` as steps (each in 1..total_steps): saved beside the interval's and never pruned."""
    text, steps = cfg.train.checkpoint_steps.strip(), set()
    for item in text.split(",") if text else []:
        item = item.strip()
        if not item.isdigit() or not 1 <= int(item) <= total_steps:
            raise ConfigError(f"train.checkpoint_steps must be comma-separated steps in 1..{total_steps}, got "
                              f"{item!r}")
        steps.add(int(item))
    return frozenset(steps)


def checkpoint_interval(cfg: RunConfig, total_steps: int) -> int:
    """Steps between checkpoints: the configured value, or about ten per run when unset (0: only at the end)."""
    every = cfg.train.checkpoint_every
    return max(1, math.ceil(total_steps / 10)) if every is None else every


def step_seed(seed: int, rank: int, step: int) -> int:
    """The seed of a rank's random stream (dropout masks) in one step: distinct per rank and step, and a
    function of them only, so a resumed run draws what an uninterrupted one would, at any world size."""
    return int.from_bytes(hashlib.sha256(f"{seed}/rank{rank}/step{step}".encode()).digest()[:4], "little")


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a step draws from: the CPU one, and the device's own on an accelerator.

    ``torch.manual_seed`` would also queue seeds for every lazily initialised backend (CUDA, XPU, MTIA)
    with a captured stack each, about 0.8 ms per step: a tenth of a tiny model's step on a CPU.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)

