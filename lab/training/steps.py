"""The step plan and its checks: how the token budget becomes steps and a global batch micro-batches per rank, where a
run (re)starts (``Start``), every check of a run's config that needs neither data nor hardware (``validate``), when
checkpoints are written, and the seed of each step's random stream."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from lab import parallel
from lab.model import validate as validate_model
from lab.parallel import LoopSettings
from lab.runtime.config import NONFINITE, ConfigError, RunConfig, TrainConfig, did_you_mean
from lab.training import expect, schedule, trackers


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


def step_plan(cfg: RunConfig, world_size: int) -> StepPlan:
    """The plan for ``world_size`` processes (of which the data-parallel replicas split each batch)."""
    plan = split_batch(cfg, world_size)
    check_batch(cfg, plan, world_size)
    return plan


def split_batch(cfg: RunConfig, world_size: int) -> StepPlan:
    """The plan, its accumulation steps rounded down (at least 1) where the batch does not divide (``check_batch``)."""
    t, T = cfg.train, cfg.model.block_size
    check_counts(t)
    _, replicas = parallel.data_replica(cfg.parallel, 0, world_size)
    return StepPlan(global_sequences=t.batch_tokens // T,
                    accum_steps=max(1, t.batch_tokens // (t.micro_batch * T * replicas)),
                    total_steps=math.ceil(t.tokens / t.batch_tokens), micro_batch=t.micro_batch, world_size=replicas)


def check_counts(t: TrainConfig) -> None:
    """Raise ConfigError (one line) for a count of tokens, sequences or steps that is not positive."""
    for name in ("tokens", "batch_tokens", "micro_batch", "log_every", "eval_tokens"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")


def check_batch(cfg: RunConfig, plan: StepPlan, world_size: int) -> None:
    """Raise ConfigError (one line) when the global batch is not a whole number of micro-batches on every replica,
    naming the option that fixes it: the largest smaller micro-batch that divides, else the batch."""
    batch, micro, T, replicas = cfg.train.batch_tokens, plan.micro_batch, cfg.model.block_size, plan.world_size
    if batch % (micro * T * replicas) == 0:
        return
    label = "ranks" if replicas == world_size else "data-parallel replicas"
    largest = min(micro - 1, batch // (T * replicas))  # a larger micro-batch than the batch never divides it
    fits = [m for m in range(largest, 0, -1) if batch % (m * T * replicas) == 0]
    fix = (f"set --train.micro_batch {fits[0]}" if fits else
           f"set --train.batch_tokens to a multiple of {T * replicas} (block_size × {label})")
    raise ConfigError(f"train.batch_tokens ({batch}) is not a multiple of train.micro_batch × model.block_size × "
                      f"{label} ({micro} × {T} × {replicas} = {micro * T * replicas}): {fix}")


def validate(cfg: RunConfig, world_size: int) -> StepPlan:
    """Every check that needs neither data nor hardware: raises ConfigError with one line.

    The degrees, the model's split and the [parallel] section are checked before the batch: a batch that does not
    divide is often the consequence of a strategy, degree or world size that is itself the mistake, and that one is
    named.
    """
    validate_model(cfg.model)
    schedule.validate(cfg.train)
    plan = split_batch(cfg, world_size)  # the counts, and the degrees against the world size
    parallel.validate_model(cfg.parallel, cfg.model)
    parallel.validate(cfg.parallel, world_size, loop_settings(cfg, plan))
    check_batch(cfg, plan, world_size)
    checkpoint_steps(cfg, plan.total_steps)
    trackers.validate(cfg.log)
    if cfg.train.memory_meter and cfg.train.compile:
        raise ConfigError("train.memory_meter cannot run with train.compile (dynamo does not trace the meter's "
                          "dispatch mode); set one of them false")
    if cfg.train.nonfinite not in NONFINITE:
        raise ConfigError(f"train.nonfinite must be one of {', '.join(NONFINITE)}, got '{cfg.train.nonfinite}'"
                          f"{did_you_mean(cfg.train.nonfinite, NONFINITE)}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg.train, name) < 1:
            raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(cfg.train, name)}")
    for name in ("stop_after", "checkpoint_every", "eval_every", "keep_checkpoints", "seed", "grad_clip",
                 "memory_budget", "weight_decay", "peak_flops"):
        if (getattr(cfg.train, name) or 0) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(cfg.train, name)}")
    if cfg.train.expect:  # a law that cannot be read is refused before any work
        try:
            expect.read_law(cfg.train.expect)
        except expect.LawError as e:
            raise ConfigError(f"train.expect: {e}") from None
    return plan


def loop_settings(cfg: RunConfig, plan: StepPlan) -> LoopSettings:
    """What the loop will do that a strategy may need to know before it builds."""
    return LoopSettings(micro_batch=plan.micro_batch, accum_steps=plan.accum_steps, grad_clip=cfg.train.grad_clip,
                        compile=cfg.train.compile)



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

