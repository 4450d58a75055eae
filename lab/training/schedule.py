"""Learning-rate schedules whose length is the run's step count (set by its token budget)."""

from __future__ import annotations

import math

from lab.runtime.config import ConfigError, TrainConfig, did_you_mean

SCHEDULES = ("cosine", "wsd", "constant")


def validate(cfg: TrainConfig) -> None:
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"train.schedule must be one of {', '.join(SCHEDULES)}, got '{cfg.schedule}'"
                          f"{did_you_mean(cfg.schedule, SCHEDULES)}")
    decay = cfg.decay if cfg.schedule == "wsd" else 0
    if not 0 <= cfg.warmup < 1 or not 0 <= cfg.decay <= 1 or cfg.warmup + decay > 1:
        raise ConfigError("train.warmup and train.decay must be fractions of the run that add up to at most 1")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.lr <= 0:
        raise ConfigError(f"train.lr must be positive, got {cfg.lr}")


def learning_rate(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """LR for 0-based ``step`` of ``total_steps``: linear warmup, then cosine decay, WSD or constant.

    WSD (warmup-stable-decay) holds the peak, then decays linearly to the floor over the last
    ``decay`` fraction of steps.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = round(cfg.warmup * total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay_steps = round(cfg.decay * total_steps)
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return peak
        return peak + (floor - peak) * (step - decay_start + 1) / decay_steps
    progress = (step - warmup + 1) / max(1, total_steps - warmup)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
