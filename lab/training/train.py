"""The training loop. It asks the registry for a strategy and from then on calls only its interface.

A run writes its directory: ``config.json`` (resolved config), ``metrics.jsonl`` (one record per
logged step, plus eval records), ``summary.json`` (final figures and status), ``tokenizer/`` and
``checkpoints/step-N/``. The data position is the step number (the sampler is a pure function of
seed and step), so resuming needs no data state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from tqdm import tqdm

from lab.measure import accounting, memory
from lab.measure.accounting import duration as _duration

from lab.runtime import chaos, checkpoint

from lab import parallel

from lab.training import expect, schedule, trackers
from lab.runtime.config import NONFINITE, ConfigError, RunConfig, TrainConfig, did_you_mean
from lab.runtime.files import append_line, dumps, fsync_file, fsync_folder, read_lines, save_json, write_atomic
from lab.data import BatchSampler, PreparedData, eval_batches
from lab.measure.device import (Peak, Precision, peak_flops, peak_memory_bytes, precision_of, remeasure_low_peak,
                                setup_device, synchronize, threads)
from lab.model import GPT, router_meters
from lab.model import validate as validate_model
from lab.training.optim import adamw_factory, param_groups
from lab.parallel import LoopSettings, Strategy, World
from lab.parallel.comm import loopback_tx_bytes

ESTIMATE_MFU = 0.3  # the utilisation the start line's duration estimate assumes
MAX_DAYS = 365  # a run that would take longer than this even at 100 % MFU is refused


class TrainingDiverged(RuntimeError):
    """The loss or the weights became NaN or infinite; the last good checkpoint is kept."""


# ---------------------------------------------------------------- the plan and its checks


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
    fits = [m for m in range(micro - 1, 0, -1) if batch % (m * T * replicas) == 0]
    fix = (f"set --train.micro_batch {fits[0]}" if fits else
           f"set --train.batch_tokens to a multiple of {T * replicas} (block_size × {label})")
    raise ConfigError(f"train.batch_tokens ({batch}) is not a multiple of train.micro_batch × model.block_size × "
                      f"{label} ({micro} × {T} × {replicas} = {micro * T * replicas}): {fix}")


def validate(cfg: RunConfig, world_size: int) -> StepPlan:
    """Every check that needs neither data nor hardware: raises ConfigError with one line.

    The degrees, the model's split and the [parallel] section are checked before the batch: a batch that does not divide is
    often the consequence of a strategy, degree or world size that is itself the mistake, and that one is named.
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


@dataclass(frozen=True)
class Estimate:
    """What the run needs, estimated from ``lab.measure.accounting`` before it starts."""

    memory_bytes: float  # model states + activations, per process
    available_bytes: float  # what this process may use
    seconds: float  # at ESTIMATE_MFU


def check_resources(cfg: RunConfig, world: World, precision: Precision, peak: Peak, vocab_size: int,
                    available_bytes: float, local_world_size: int = 1) -> Estimate:
    """Refuse a run whose states and activations cannot fit, or that could not finish within MAX_DAYS.

    Memory: what one process holds under the layout (``Layout.share``: its model states in the widths of the run's
    precision policy (``Accounts.state_widths``), and
    ``Layout.activation_bytes``, one micro-batch's activations with a fused attention kernel: a lower bound);
    processes on one CPU host share its available memory. Time: the run's FLOPs over the peak of all its devices.
    """
    shape = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab_size)
    strategy_cls = parallel.strategy_class(cfg.parallel.strategy)
    layout = parallel.Layout.of(cfg.parallel, world.world_size, strategy_cls)
    accounts = strategy_cls.accounting
    states = layout.share(shape, accounts.state_row(strategy_cls, cfg.parallel), accounts.state_widths(precision)
                          ).states.total
    activations = layout.activation_bytes(shape, cfg.train.micro_batch, precision.activation_bytes,
                                          sequence_parallel=cfg.parallel.sequence_parallel)
    share = available_bytes / (local_world_size if world.device.type == "cpu" else 1)
    if states + activations > share:
        raise ConfigError(f"this run needs about {_size(states + activations)} per process ({_size(states)} model "
                          f"states + {_size(activations)} activations of micro_batch {cfg.train.micro_batch} × "
                          f"block_size {shape.block_size}) but {_size(share)} is available; lower train.micro_batch or "
                          f"the model's size, or split them over more ranks (parallel.cp splits every sequence, "
                          f"parallel.tp and pp the model)")
    flops = accounting.flops_per_token(shape) * step_plan(cfg, world.world_size).total_steps * cfg.train.batch_tokens
    fastest = flops / (peak.flops * world.world_size)
    if fastest > MAX_DAYS * 86_400:
        raise ConfigError(f"train.tokens {cfg.train.tokens:.3g} needs {flops:.3g} FLOPs: at least "
                          f"{fastest / 86_400 / 365:.3g} years on {world.world_size} × {peak.flops:.3g} FLOP/s even at "
                          f"100% MFU (the limit is {MAX_DAYS} days)")
    return Estimate(states + activations, share, fastest / ESTIMATE_MFU)


def _size(n: float) -> str:
    """Bytes in GiB, three significant digits (a tiny run's shows too)."""
    return f"{n / 2**30:,.3g} GiB"


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


# ---------------------------------------------------------------- the run directory


ATTEMPTS = "attempts.jsonl"  # in the run directory: each attempt's start, checkpoints and end (RunLog.attempt)


class RunLog:
    """metrics.jsonl plus one printed line per logged step (rank 0 only), a progress bar on a terminal, the run's
    trackers (``lab.training.trackers``; opened by ``open_trackers``) and its record of attempts (``attempt``)."""

    def __init__(self, run_dir: Path, enabled: bool, keep_until_step: int, total_steps: int):
        self.run_dir, self.path, self.enabled = run_dir, run_dir / "metrics.jsonl", enabled
        self.trackers: trackers.Trackers | None = None
        if enabled and self.path.exists():
            kept = [line for line in read_lines(self.path)
                    if (rec := _parse_record(line)) is not None and rec["step"] <= keep_until_step]
            write_atomic(self.path, "".join(line + "\n" for line in kept))
        # The bar (stderr) only when the lines (stdout) go to the terminal too: piped (| tee), they would arrive
        # behind the pipe and land on the bar's line, after Ctrl-C as well, where the bar cannot clear them.
        self.bar = tqdm(total=total_steps, initial=keep_until_step, unit="step", dynamic_ncols=True, leave=False,
                        disable=not (enabled and sys.stderr.isatty() and sys.stdout.isatty()))

    def open_trackers(self, cfg: RunConfig, run_dir: Path, resumed_at: int) -> None:
        if self.enabled and trackers.names(cfg.log):
            self.trackers = trackers.Trackers(cfg.log, run_dir, cfg.to_dict(), resumed_at)

    def record(self, rec: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(dumps(rec) + "\n")
            if self.trackers:
                self.trackers.record(rec)

    def summary(self, summary: dict) -> None:
        if self.trackers:
            self.trackers.summary(summary)

    def sync(self) -> None:
        """Make the records so far durable: before a checkpoint or the summary that they precede is written (a
        resumed run keeps the records up to its checkpoint and logs the later steps again)."""
        if self.enabled and self.path.exists():
            fsync_file(self.path)
            fsync_folder(self.run_dir)

    @contextlib.contextmanager
    def checkpointing(self, step: int) -> Iterator[None]:
        """Around the save of the checkpoint of ``step``: the records of the steps it covers are made durable before
        it is written, and it is recorded in attempts.jsonl once sealed."""
        self.sync()
        yield
        self.attempt("checkpoint", step)

    def attempt(self, event: str, step: int, **details: object) -> None:
        """Append to attempts.jsonl, durably, that this attempt started at ``step`` ("start"), sealed the checkpoint
        of ``step`` ("checkpoint") or wrote its summary there ("end"): the run's own account of its attempts, in
        which a run trained twice shows even when its losses are equal."""
        if self.enabled:
            append_line(self.run_dir / ATTEMPTS, dumps({"event": event, "step": step, "pid": os.getpid(),
                                                        "time": time.time(), **details}))

    def evals(self) -> list[dict]:
        """The eval records in metrics.jsonl (rank 0): a resumed run's, those its earlier segments kept."""
        if not (self.enabled and self.path.exists()):
            return []
        return [rec for line in self.path.read_text().splitlines()
                if (rec := _parse_record(line)) is not None and "eval_loss" in rec]

    def say(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text) if not self.bar.disable else print(text, flush=True)

    def close(self) -> None:
        self.bar.close()
        if self.trackers:
            self.trackers.close()


def _parse_record(line: str) -> dict | None:
    """A metrics record, or None for a blank or torn line (a run killed mid-write) or any line that is not a record
    with a whole step number (a hand-edited one)."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = rec.get("step") if isinstance(rec, dict) else None
    return rec if isinstance(step, int) and not isinstance(step, bool) else None


def format_step(rec: dict, total_steps: int, eta_s: float) -> str:
    grad = "skipped (non-finite)" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
    return (f"step {rec['step']:>5}/{total_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | grad {grad} | "
            f"{rec['tokens_per_s']:,.0f} tok/s | mfu {100 * rec['mfu']:.2f}% | "
            f"comm {1e3 * rec['comm_time_s']:.0f} ms | mem {rec['mem_peak_bytes'] / 2**20:,.0f} MiB | "
            f"eta {_duration(eta_s)}" + (f" | loss scale {rec['loss_scale']:g}" if "loss_scale" in rec else "")
            + _bubble(rec) + _router(rec) + _exchanges(rec))


def _exchanges(rec: dict) -> str:
    """Expert parallelism's all-to-all bytes beside their theory, for the step line (empty without it)."""
    if "ep_a2a_bytes" not in rec:
        return ""
    return (f" | a2a {rec['ep_a2a_bytes'] / 2**10:,.0f} KiB (theory at balanced routing "
            f"{rec['ep_a2a_bytes_theory'] / 2**10:,.0f})")


def _router(rec: dict) -> str:
    """A mixture of experts' router figures, for the step line (empty for a dense model)."""
    if "moe_load_max_over_mean" not in rec:
        return ""
    per_expert = rec["moe_tokens_per_expert"]
    return (f" | moe load max/mean {rec['moe_load_max_over_mean']:.2f}, tokens/expert {min(per_expert):,}-"
            f"{max(per_expert):,}, dropped {rec['moe_dropped_tokens']:,}, "
            f"router entropy {rec['moe_router_entropy']:.3f}")


def _bubble(rec: dict) -> str:
    """A pipeline's measured bubble per stage beside its theory, for the step line (empty without a pipeline)."""
    if "pp_bubble" not in rec:
        return ""
    stages = " ".join(f"{100 * b:.0f}%" for b in rec["pp_bubble"])
    held = " ".join(f"{b / 2**10:,.0f}" for b in rec.get("pp_in_flight_bytes", []))
    theory = " ".join(f"{b / 2**10:,.0f}" for b in rec.get("pp_in_flight_bytes_theory", []))
    return (f" | bubble {stages} by stage (theory {100 * rec['pp_bubble_theory']:.0f}%) | p2p "
            f"{rec['pp_sent_bytes'] / 2**10:,.0f} KiB (theory {rec['pp_sent_bytes_theory'] / 2**10:,.0f})"
            + (f" | activations in flight {held} KiB by stage (theory {theory})" if held else ""))


def moe_record(strategy: Strategy, world: World, top_k: int) -> dict[str, float]:
    """The router's figures since the last record, summed over every rank (``lab.model.gpt.router_meters``);
    empty for a dense model. Every rank calls it at the same steps (an all-reduce)."""
    take = getattr(strategy.module, "take_router_counts", None)
    counts = take() if take is not None else None
    return {} if counts is None else router_meters(strategy.sum_token_figures(counts).cpu(), top_k)


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


def start_line(cfg: RunConfig, world: World, plan: StepPlan, precision: Precision, peak: Peak, start: Start,
               estimate: Estimate | None, strategy: str) -> str:
    counts, t, m = accounting.param_counts(cfg.model), cfg.train, cfg.model
    moe = (f", mixture of {m.moe_experts} experts (top {m.moe_top_k}, granularity {m.moe_granularity}"
           f"{f', {m.moe_shared_experts} shared' if m.moe_shared_experts else ''}): {counts.active:,} active"
           if m.moe_experts else "")
    line = (f"model: {cfg.model.arch}, {counts.total:,} params ({counts.non_embedding:,} non-embedding{moe}), "
            f"{accounting.flops_per_token(cfg.model) / 1e6:.2f} MFLOP/token{' (active path)' if moe else ''} | "
            f"strategy {strategy} × "
            f"{world.world_size} | {plan.total_steps} steps of {t.batch_tokens:,} tokens ({plan.accum_steps} "
            f"micro-step{'s' if plan.accum_steps > 1 else ''} per step) | device {world.device}, {precision.name}"
            f"{f', {threads()}' if world.device.type == 'cpu' else ''} | "
            f"MFU against {peak.flops:.3g} FLOP/s per device ({peak.source})")
    if cfg.model.parametrization == "mup" and not cfg.model.tie_embeddings:
        line += " | μP with an untied head (the default under μP; --model.tie_embeddings true ties it)"
    if estimate is not None:
        remaining = estimate.seconds * (1 - start.step / plan.total_steps)
        line += f" | about {_duration(remaining)} at {ESTIMATE_MFU:.0%} MFU"
    return line + (f" | resumed at step {start.step}" if start.step else "")


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
    router: dict | None = None  # a mixture of experts: the last record's router figures (moe_record)


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
    router: dict = {}  # the last record's router figures (a mixture of experts)
    eval_loss, skipped, loop_start, warned = start.eval_loss, start.skipped_steps, time.perf_counter(), False
    most_peaks: dict[str, int] = {}
    watcher = expectation(cfg, plan.total_steps, log.evals()) if t.expect else None

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
            router = moe_record(strategy, world, cfg.model.moe_top_k)
            rec |= meters.layout | router | strategy.precision_record()
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
                           peak, None if watcher is None else watcher.summary(), router)
        if (every and done % every == 0) or done == end_step or done in pinned:
            save(done)
    status = "completed" if end_step == plan.total_steps else "stopped"
    return Outcome(end_step, status, 0, recent, eval_loss, skipped, most_peaks, peak,
                   None if watcher is None else watcher.summary(), router)


def checked_peak(peak: Peak, world: World, log: RunLog) -> Peak:
    """The peak to go on with once a step's MFU passed 100 %: measured again where it may be (rank 0 with a
    measured CPU peak), else the same one, with a warning."""
    remeasured = remeasure_low_peak(peak) if world.is_main else None
    if remeasured is not None:
        log.say(f"MFU above 100%: the peak ({peak.flops:.3g} FLOP/s, {peak.source}) read low; measured "
                f"again: {remeasured.flops:.3g} FLOP/s ({remeasured.source}), used from here on")
        return remeasured
    log.say(f"warning: MFU above 100%: the peak ({peak.flops:.3g} FLOP/s, {peak.source}) reads low, "
            f"probably measured while other work ran; measure it again on a quiet machine with "
            f"python -m lab peak --remeasure, or set train.peak_flops")
    return peak


def log_eval(log: RunLog, step: int, total_steps: int, batch_tokens: int, eval_loss: float,
             watcher: expect.Watcher | None) -> None:
    """The eval record and line; with train.expect, the law's expected loss beside it (and its one warning)."""
    rec, line, off_track = {"step": step, "tokens": step * batch_tokens, "eval_loss": eval_loss}, "", None
    if watcher is not None:
        expected, off_track = watcher.observe(step, eval_loss)
        rec |= {"expected_loss": expected.expected, "expected_interval": [expected.lo, expected.hi],
                "deviation": expected.deviation} | ({"warning": off_track} if off_track else {})
        line = f" | {expected.line()}"
    log.record(rec)
    log.say(f"step {step:>5}/{total_steps} | eval loss {eval_loss:.4f}{line}")
    if off_track:
        log.say(f"warning: {off_track}")


def expectation(cfg: RunConfig, total_steps: int, earlier: list[dict]) -> expect.Watcher:
    """train.expect's watcher: the run's N and its schedule's rate at every step under the law; a resumed run's
    watcher has seen its ``earlier`` eval records, so it warns once over the whole run."""
    lr = [schedule.learning_rate(s, total_steps, cfg.train) for s in range(total_steps)]
    try:
        watcher = expect.watcher(cfg.train.expect, accounting.param_counts(cfg.model).total, lr,
                                 cfg.train.batch_tokens, cfg.train.lr)
    except expect.LawError as e:
        raise ConfigError(f"train.expect: {e}") from None
    for rec in earlier:
        watcher.observe(rec["step"], rec["eval_loss"])  # a warning among them was given when its segment ran
    return watcher


def summarise(cfg: RunConfig, world: World, plan: StepPlan, strategy: Strategy, data: PreparedData,
              data_dir: Path, peak: Peak, outcome: Outcome, wall_time_s: float) -> dict:
    counts, fpt = accounting.param_counts(cfg.model), accounting.flops_per_token(cfg.model)
    tokens = outcome.end_step * cfg.train.batch_tokens
    return {
        "status": outcome.status, "params": counts.total, "params_non_embedding": counts.non_embedding,
        "params_active": counts.active, "moe_experts": cfg.model.moe_experts, "moe_top_k": cfg.model.moe_top_k,
        "moe_granularity": cfg.model.moe_granularity,
        "flops_per_token": fpt, "tokens": tokens, "flops": fpt * tokens, "steps": outcome.end_step,
        "total_steps": plan.total_steps, "skipped_steps": outcome.skipped_steps,
        "final_train_loss": sum(outcome.recent_losses) / len(outcome.recent_losses) if outcome.recent_losses else None,
        "final_eval_loss": outcome.eval_loss, "unigram_entropy_nats": data.meta.get("unigram_entropy_nats"),
        **({"expect": outcome.expect} if outcome.expect else {}),
        **({"moe_last_step": outcome.router} if outcome.router else {}),
        "strategy": cfg.parallel.strategy, "world_size": world.world_size, "device": str(world.device),
        "precision": strategy.precision.name, **strategy.precision_record(),
        "peak_flops": peak.flops * world.world_size, "peak_flops_per_device": peak.flops,
        "peak_flops_source": peak.source, "wall_time_s": wall_time_s, "data_dir": str(data_dir),
        **({"signal": signal.Signals(outcome.signal).name} if outcome.signal else {}),
        **strategy.accounts.meters(),
        "peak_bytes": outcome.peak_bytes,
        "peak_bytes_theory": strategy.accounts.peak_bytes_theory(parallel.Layout.of(cfg.parallel, world.world_size)
            .activation_bytes(cfg.model, cfg.train.micro_batch, strategy.precision.activation_bytes,
                              sequence_parallel=cfg.parallel.sequence_parallel,
                              checkpointing=cfg.parallel.activation_checkpointing == "full"),
            accounting.autocast_weight_bytes(cfg.model, cfg.parallel.tp) if strategy.precision.autocasts else 0.0),
    }
