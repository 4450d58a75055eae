"""The training loop: one step (``train_step``), the held-out loss (``evaluate``) and the steps of a run
(``run_steps``: logging, evaluation, checkpoints, the non-finite policy and a stop asked for). It calls only the
strategy's interface; what the run's parts report (a transform's traffic, a model feature's figures) reaches the log
through ``Strategy.take_record`` and ``lab.parallel.step_line``, named nowhere here.

The data position is the step number (the sampler is a pure function of seed and step), so resuming needs no data
state. Setting a run up, restoring it and ending it are ``lifecycle``, the step plan and the config's checks
``steps``, the log, the lines and the summary ``runlog``, the admission ``lab.training.admission``.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from lab.data import BatchSampler, PreparedData, eval_batches
from lab.measure import accounting, memory
from lab.measure.device import Peak, peak_memory_bytes, synchronize
from lab.parallel import RunEngine, World
from lab.parallel.comm import loopback_tx_bytes
from lab.runtime import checkpoint
from lab.training import expect, schedule
from lab.training.runlog import RunLog, checked_peak, format_step, log_eval
from lab.training.plan import RunPlan
from lab.training.steps import Start, checkpoint_interval, checkpoint_steps, seed_step, step_seed


class TrainingDiverged(RuntimeError):
    """The loss or the weights became NaN or infinite; the last good checkpoint is kept."""



# ---------------------------------------------------------------- one step


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over ranks and micro-batches
    grad_norm: float  # global, before clipping; NaN or inf when the step was skipped
    stepped: bool  # False: a non-finite gradient, weights left as they were
    stop_requested: bool  # some rank was asked to stop (SIGINT or SIGTERM)


def train_step(strategy: RunEngine, world: World, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
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


def _finish_step(strategy: RunEngine, world: World, loss_sum: torch.Tensor, lr: float, max_norm: float,
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
def evaluate(strategy: RunEngine, world: World, data: PreparedData, run: RunPlan) -> float:
    """Mean held-out loss. Data-parallel replica r evaluates batches r, r + N, ... (every rank of a
    replica the same ones, each counting them in both sums alike); every rank runs as many forwards
    (a sharded model needs them all), and the per-batch sums are added in one fixed order, so the
    result does not depend on the world size."""
    cfg = run.cfg
    batches = list(eval_batches(data.eval, cfg.model.block_size, cfg.train.eval_tokens, cfg.train.micro_batch))
    sums = torch.zeros(len(batches), 2, dtype=torch.float64)
    replica, replicas = run.layout.data_replica(world.rank)
    for first in range(0, len(batches), replicas):
        i = first + replica
        x, y = batches[min(i, len(batches) - 1)]
        loss = strategy.eval_loss(x.to(world.device), y.to(world.device)).item()
        if i < len(batches):
            sums[i] = torch.tensor([loss * len(x), len(x)], dtype=torch.float64)
    sums = world.sum(sums.to(world.device)).cpu()
    return (sums[:, 0].sum() / sums[:, 1].sum()).item()


# ---------------------------------------------------------------- the steps


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


def run_steps(run: RunPlan, world: World, strategy: RunEngine, data: PreparedData, run_dir: Path, log: RunLog,
              start: Start, started: float, peak: Peak, stop_signal: Callable[[], int]) -> Outcome:
    cfg, plan = run.cfg, run.steps
    t = cfg.train
    sampler = BatchSampler(data.train, cfg.model.block_size, t.seed)
    end_step = min(plan.total_steps, t.stop_after) if t.stop_after else plan.total_steps
    end_step = max(end_step, start.step)  # a complete run resumed at its last step
    every, pinned = checkpoint_interval(cfg, plan.total_steps), checkpoint_steps(cfg, plan.total_steps)
    replica, _ = run.layout.data_replica(world.rank)
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
                "eval_loss": eval_loss} | strategy.checkpoint_meta()
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
            eval_loss = evaluate(strategy, world, data, run)
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
