"""The training loop: it asks the registry for a strategy and from then on calls only its interface; what the run's
parts report (a transform's traffic, a model feature's figures) reaches the log through ``Strategy.take_record`` and
``lab.parallel.step_line``, named nowhere here.

A run writes its directory: ``config.json`` (resolved config), ``metrics.jsonl`` (one record per
logged step, plus eval records), ``summary.json`` (final figures and status), ``tokenizer/`` and
``checkpoints/step-N/``. The data position is the step number (the sampler is a pure function of
seed and step), so resuming needs no data state. The step plan and the config's checks are ``steps``, the log, the
lines and the summary ``runlog``, the admission ``lab.measure.admission``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from lab import parallel
from lab.data import BatchSampler, PreparedData, eval_batches
from lab.measure import accounting, memory
from lab.measure.admission import Estimate
from lab.measure.device import Peak, Precision, peak_flops, peak_memory_bytes, precision_of, setup_device, synchronize
from lab.model import GPT
from lab.parallel import Strategy, World
from lab.parallel.comm import loopback_tx_bytes
from lab.runtime import chaos, checkpoint
from lab.runtime.config import ConfigError, RunConfig
from lab.runtime.files import save_json
from lab.training import expect, schedule
from lab.training.optim import adamw_factory, param_groups
from lab.training.runlog import RunLog, checked_peak, format_step, log_eval, start_line, summarise
from lab.training.steps import (StepPlan, checkpoint_interval, checkpoint_steps, loop_settings, seed_step, step_plan,
                                step_seed, validate)


class TrainingDiverged(RuntimeError):
    """The loss or the weights became NaN or infinite; the last good checkpoint is kept."""



# ---------------------------------------------------------------- one step


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over ranks and micro-batches
    grad_norm: float  # global, before clipping; NaN or inf when the step was skipped
    stepped: bool  # False: a non-finite gradient, weights left as they were
    stop_requested: bool  # some rank was asked to stop (SIGINT or SIGTERM)


def train_step(strategy: Strategy, world: World, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
               accum_steps: int, lr: float, max_norm: float,
               stop_requested: Callable[[], bool] = lambda: False) -> StepResult:
    """Forward and backward every micro-batch (gradients synced on the last), clip, then step or skip.

    ``stop_requested`` is asked after the backward, so that a stop asked for during the step ends it: the ranks
    agree on it in the loss's all-reduce.

    A non-finite loss raises TrainingDiverged before the weights change; a non-finite gradient with
    a finite loss leaves the weights as they are (the caller decides whether to go on).
    """
    loss_sum = torch.zeros((), device=world.device)
    for micro, (x, y) in enumerate(micro_batches):
        x, y = x.to(world.device), y.to(world.device)
        with memory.phase("forward"):
            loss = strategy.forward(x, y, sync=micro == accum_steps - 1)
        with memory.phase("backward"):
            strategy.backward(loss / accum_steps)
        loss_sum += loss.detach() / accum_steps
    with memory.phase("step"):
        return _finish_step(strategy, world, loss_sum, lr, max_norm, stop_requested)


def _finish_step(strategy: Strategy, world: World, loss_sum: torch.Tensor, lr: float, max_norm: float,
                 stop_requested: Callable[[], bool]) -> StepResult:
    norm = strategy.clip_grad_norm(max_norm).item()
    stop = torch.tensor(float(stop_requested()), device=world.device)
    summed = world.sum(torch.stack([loss_sum.float(), stop]))
    loss_value = (summed[0] / world.world_size).item()
    if not math.isfinite(loss_value):
        raise TrainingDiverged(f"loss is {loss_value}")
    stepped = math.isfinite(norm)
    strategy.step(lr) if stepped else strategy.skip_step()
    return StepResult(loss_value, norm, stepped, summed[1].item() > 0)


@torch.no_grad()
def evaluate(strategy: Strategy, world: World, data: PreparedData, cfg: RunConfig) -> float:
    """Mean held-out loss. Data-parallel replica r evaluates batches r, r + N, ... (every rank of a
    replica the same ones, each counting them in both sums alike); every rank runs as many forwards
    (a sharded model needs them all), and the per-batch sums are added in one fixed order, so the
    result does not depend on the world size."""
    batches = list(eval_batches(data.eval, cfg.model.block_size, cfg.train.eval_tokens, cfg.train.micro_batch))
    sums = torch.zeros(len(batches), 2, dtype=torch.float64)
    replica, replicas = parallel.data_replica(cfg.parallel, world.rank, world.world_size)
    for first in range(0, len(batches), replicas):
        i = first + replica
        x, y = batches[min(i, len(batches) - 1)]
        loss = strategy.eval_loss(x.to(world.device), y.to(world.device)).item()
        if i < len(batches):
            sums[i] = torch.tensor([loss * len(x), len(x)], dtype=torch.float64)
    sums = world.sum(sums.to(world.device)).cpu()
    return (sums[:, 0].sum() / sums[:, 1].sum()).item()


# ---------------------------------------------------------------- the run


@dataclass
class Start:
    """Where a run (re)starts: its step, and the figures the steps before it left in their checkpoint."""

    step: int = 0
    wall_time_s: float = 0.0
    recent_losses: list[float] = dataclasses.field(default_factory=list)
    skipped_steps: int = 0
    eval_loss: float | None = None


T = TypeVar("T")


def decided_on_main(world: World, decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0, its value handed to every rank; a ConfigError there is raised on every rank."""
    def attempt() -> tuple[bool, object]:
        try:
            return True, decide()
        except ConfigError as e:
            return False, str(e)

    ok, value = world.broadcast_from_main(attempt)
    if not ok:
        raise ConfigError(value)
    return value


def build_strategy(cfg: RunConfig, world: World, precision: Precision) -> Strategy:
    """The run's strategy, built from the model factory (the strategy applies the split, checkpointing,
    compilation and sharding), the weight-decay rule and AdamW."""
    strategy = parallel.create(cfg.parallel, world, precision, loop_settings(cfg, step_plan(cfg, world.world_size)))
    strategy.build(functools.partial(GPT, cfg.model, seed=cfg.train.seed),
                   lambda model: param_groups(model, cfg.train.weight_decay),
                   adamw_factory(cfg.train, world.device))
    return strategy


def restore(strategy: Strategy, run_dir: Path, world: World, cfg: RunConfig, plan: StepPlan) -> Start:
    """Load the newest readable checkpoint into the strategy, whatever strategy and world size wrote it.

    Rank 0 picks the checkpoint and hands its name to every rank (on a shared filesystem with caching, ranks on
    other nodes may see another newest one); every rank then checks that it reads the same metadata.
    """
    folder = decided_on_main(world, lambda: checkpoint.latest_readable(run_dir))  # its refusal too, on every rank
    if folder is None:
        raise ConfigError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
    world.check_same(checkpoint.digest(folder), f"checkpoint {folder.name} (its metadata as each rank reads it)")
    meta = checkpoint.load(folder, world.rank, world.world_size, strategy.checkpoint_state())
    strategy.after_load()
    strategy.load_precision_state(meta)
    complete = meta["step"] >= plan.total_steps  # killed before its summary: resuming only writes it
    if cfg.train.stop_after and cfg.train.stop_after <= meta["step"] and not complete:
        raise ConfigError(f"train.stop_after ({cfg.train.stop_after}) is not beyond the checkpoint's step "
                          f"({meta['step']})")
    return Start(meta["step"], meta["wall_time_s"], list(meta.get("recent_losses", [])),
                 int(meta.get("skipped_steps", 0)), meta.get("eval_loss"))


def train(cfg: RunConfig, data_dir: Path, run_dir: Path, world: World, resume: bool = False,
          stop_signal: Callable[[], int] = lambda: 0, estimate: Estimate | None = None, restarts: int = 0) -> dict:
    """Train ``cfg`` on prepared data; write the run directory (rank 0); return the summary.

    ``stop_signal`` returns the number of a signal asking this rank to stop (0: none); the run then
    stops at the end of the step every rank is in, saves a checkpoint and reports ``interrupted``.
    ``restarts`` (how often torchrun restarted the group) is recorded in the summary.
    """
    started = time.perf_counter()
    plan = validate(cfg, world.world_size)
    data = PreparedData.load(data_dir)
    setup_device(world.device)
    precision = precision_of(cfg.train, world.device)
    peak = peak_flops(world.device, precision, cfg.train.peak_flops)
    with memory.Meter(world.device, track_tensors=cfg.train.memory_meter).running():
        strategy = build_strategy(cfg, world, precision)
        start = restore(strategy, run_dir, world, cfg, plan) if resume else Start()
        log = RunLog(run_dir, world.is_main, keep_until_step=start.step, total_steps=plan.total_steps)
        if world.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.clean_stale_temporaries(run_dir)
            save_json(run_dir / "config.json", cfg.to_dict())
            data.tokenizer.save(run_dir / "tokenizer")
            log.say(start_line(cfg, world, plan, precision, peak, start, estimate, strategy.describe()))
            log.open_trackers(cfg, run_dir, resumed_at=start.step)
            log.attempt("start", start.step, restarts=restarts, sweep_attempt=os.environ.get("LAB_SWEEP_ATTEMPT"))
        try:
            outcome = run_steps(cfg, world, plan, strategy, data, run_dir, log, start, started, peak, stop_signal)
            summary = summarise(cfg, world, plan, strategy, data, data_dir, outcome.peak, outcome,
                                start.wall_time_s + time.perf_counter() - started)
            summary |= {"resumed_from_step": start.step, "restarts": restarts}
            if world.is_main:
                log.sync()
                save_json(run_dir / "summary.json", summary)
                log.attempt("end", outcome.end_step, status=summary["status"])
                chaos.point("summary-written")
                log.summary(summary)
            return summary
        finally:
            log.close()


@dataclass
class Outcome:
    end_step: int
    status: str  # completed, stopped (stop_after) or interrupted
    signal: int
    recent_losses: list[float]
    eval_loss: float | None
    skipped_steps: int
    peak_bytes: dict[str, int]  # per phase and the RSS: the most any step reached
    peak: Peak  # the MFU denominator at the end (a CPU peak that read low is measured again)
    expect: dict | None = None  # with train.expect: the run against the law (lab.training.expect.Watcher.summary)


def run_steps(cfg: RunConfig, world: World, plan: StepPlan, strategy: Strategy, data: PreparedData,
              run_dir: Path, log: RunLog, start: Start, started: float, peak: Peak,
              stop_signal: Callable[[], int]) -> Outcome:
    t = cfg.train
    sampler = BatchSampler(data.train, cfg.model.block_size, t.seed)
    end_step = min(plan.total_steps, t.stop_after) if t.stop_after else plan.total_steps
    end_step = max(end_step, start.step)  # a complete run resumed at its last step
    every, pinned = checkpoint_interval(cfg, plan.total_steps), checkpoint_steps(cfg, plan.total_steps)
    replica, _ = parallel.data_replica(cfg.parallel, world.rank, world.world_size)
    fpt = accounting.flops_per_token(cfg.model)
    recent: list[float] = start.recent_losses
    eval_loss, skipped, loop_start, warned = start.eval_loss, start.skipped_steps, time.perf_counter(), False
    most_peaks: dict[str, int] = {}
    watcher = expect.for_run(cfg, plan.total_steps, log.evals())

    def save(step: int) -> None:
        if not strategy.params_finite():
            raise TrainingDiverged(f"weights are not finite after step {step}; not saved")
        meta = {"tokens": step * t.batch_tokens, "wall_time_s": start.wall_time_s + time.perf_counter() - started,
                "strategy": cfg.parallel.strategy, "recent_losses": recent, "skipped_steps": skipped,
                "eval_loss": eval_loss} | strategy.precision_state()
        with log.checkpointing(step):
            checkpoint.save(run_dir, step, world.rank, world.world_size, strategy.checkpoint_state(), meta,
                            t.keep_checkpoints, pinned)

    for step in range(start.step, end_step):
        t0 = time.perf_counter()
        seed_step(step_seed(t.seed, replica, step), world.device)
        lr = schedule.learning_rate(step, plan.total_steps, t)
        batches = (sampler.batch(step, plan.global_sequences, *plan.micro_range(replica, micro))
                   for micro in range(plan.accum_steps))
        try:
            result = train_step(strategy, world, batches, plan.accum_steps, lr, t.grad_clip,
                                lambda: stop_signal() != 0)
        except TrainingDiverged as e:
            last = checkpoint.latest(run_dir)
            raise TrainingDiverged(f"{e} at step {step + 1}; stopped "
                                   f"(last good checkpoint: {last or 'none'})") from None
        synchronize(world.device)
        step_time, sent = time.perf_counter() - t0, loopback_tx_bytes()
        meters, done = strategy.take_step_meters(), step + 1
        peaks = memory.take_step_peaks()
        most_peaks = {k: max(v, most_peaks.get(k, 0)) for k, v in peaks.items()}
        log.bar.update()
        if not result.stepped:
            skipped += 1
            if t.nonfinite == "stop":
                raise TrainingDiverged(f"gradient norm is {result.grad_norm} at step {done} (train.nonfinite stop); "
                                       f"stopped (last good checkpoint: {checkpoint.latest(run_dir) or 'none'})")
        recent = (recent + [result.loss])[-t.log_every:]

        if done % t.log_every == 0 or done == end_step or done == start.step + 1 or not result.stepped:
            tokens_per_s = t.batch_tokens / step_time
            rec = {"step": done, "tokens": done * t.batch_tokens, "loss": result.loss, "lr": lr,
                   "grad_norm": result.grad_norm if result.stepped else None, "skipped_steps": skipped,
                   "step_time_s": step_time, "comm_time_s": meters.comm_wait_s,
                   "compute_time_s": max(0.0, step_time - meters.comm_wait_s), "tokens_per_s": tokens_per_s,
                   "mfu": fpt * tokens_per_s / (peak.flops * world.world_size),
                   "mem_peak_bytes": memory.run_peak(peak_memory_bytes(world.device)), "peak_bytes": peaks,
                   "machine_loopback_tx_bytes": sent}
            rec |= meters.layout | strategy.take_record()
            log.record(rec)
            eta = (time.perf_counter() - loop_start) / (done - start.step) * (end_step - done)
            log.say(format_step(rec, plan.total_steps, eta))
            if rec["mfu"] > 1 and not warned:
                warned, peak = True, checked_peak(peak, world, log)
        if (t.eval_every and done % t.eval_every == 0) or done == plan.total_steps:
            eval_loss = evaluate(strategy, world, data, cfg)
            log_eval(log, done, plan.total_steps, t.batch_tokens, eval_loss, watcher)
        if result.stop_requested and done < end_step:  # at the last step the run simply ends
            save(done)
            return Outcome(done, "interrupted", stop_signal() or signal.SIGTERM, recent, eval_loss, skipped, most_peaks,
                           peak, None if watcher is None else watcher.summary())
        if (every and done % every == 0) or done == end_step or done in pinned:
            save(done)
    status = "completed" if end_step == plan.total_steps else "stopped"
    return Outcome(end_step, status, 0, recent, eval_loss, skipped, most_peaks, peak,
                   None if watcher is None else watcher.summary())
