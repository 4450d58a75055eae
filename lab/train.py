"""The training loop. It asks the registry for a strategy and from then on calls only its interface.

A run writes its directory: ``config.json`` (resolved config), ``metrics.jsonl`` (one record per
logged step, plus eval records), ``summary.json`` (final figures and status), ``tokenizer/`` and
``checkpoints/step-N/``. The data position is the step number (the sampler is a pure function of
seed and step), so resuming needs no data state.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lab import accounting, checkpoint, parallel, schedule
from lab.config import ConfigError, RunConfig, save_json
from lab.data import BatchSampler, PreparedData, eval_batches
from lab.model import GPT
from lab.parallel import World


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass(frozen=True)
class StepPlan:
    """How the token budget becomes steps, and a global batch becomes micro-batches per rank."""

    global_sequences: int
    accum_steps: int
    total_steps: int


def step_plan(cfg: RunConfig, world_size: int) -> StepPlan:
    t, T = cfg.train, cfg.model.block_size
    for name in ("tokens", "batch_tokens", "micro_batch", "log_every", "eval_tokens"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")
    per_micro = t.micro_batch * T * world_size
    if t.batch_tokens % per_micro:
        raise ConfigError(f"train.batch_tokens ({t.batch_tokens}) must be a multiple of micro_batch × block_size × "
                          f"world_size ({t.micro_batch} × {T} × {world_size} = {per_micro})")
    return StepPlan(global_sequences=t.batch_tokens // T, accum_steps=t.batch_tokens // per_micro,
                    total_steps=math.ceil(t.tokens / t.batch_tokens))


def validate(cfg: RunConfig, world_size: int) -> StepPlan:
    """Every check that needs no data: raises ConfigError with one line."""
    from lab.model import validate as validate_model

    validate_model(cfg.model)
    schedule.validate(cfg.train)
    parallel.strategy_class(cfg.parallel.strategy).check_world_size(world_size)
    if cfg.train.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got '{cfg.train.device}'")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but no CUDA device is available")
    if cfg.train.dtype not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.dtype must be auto, fp32 or bf16, got '{cfg.train.dtype}'")
    for name in ("stop_after", "checkpoint_every", "eval_every", "keep_checkpoints"):
        if (getattr(cfg.train, name) or 0) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(cfg.train, name)}")
    return step_plan(cfg, world_size)


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# ---------------------------------------------------------------- measurement

_CPU_PEAK: dict[torch.dtype, float] = {}


def measured_matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 3) -> float:
    """Best FLOP/s of an n³ matmul on this CPU: the honest MFU denominator where no data sheet applies."""
    if dtype not in _CPU_PEAK:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(repeats))
        _CPU_PEAK[dtype] = 2 * n ** 3 / best
    return _CPU_PEAK[dtype]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peak_flops(cfg: RunConfig, device: torch.device, dtype: torch.dtype) -> float:
    if cfg.train.peak_flops > 0:
        return cfg.train.peak_flops
    if device.type == "cuda":
        kind = "bf16" if dtype == torch.bfloat16 else "tf32"
        return accounting.gpu_peak_flops(torch.cuda.get_device_name(device), kind)
    return measured_matmul_peak(dtype)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the run directory


class RunLog:
    """metrics.jsonl plus one printed line per logged step (rank 0 only)."""

    def __init__(self, run_dir: Path, enabled: bool, keep_until_step: int | None):
        self.path, self.enabled = run_dir / "metrics.jsonl", enabled
        if enabled and keep_until_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if (rec := _parse_record(line)) is not None and rec["step"] <= keep_until_step]
            tmp = self.path.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)

    def record(self, rec: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def say(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)


def _parse_record(line: str) -> dict | None:
    """A metrics record, or None for a blank or torn line (a run killed mid-write)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) and "step" in rec else None


def checkpoint_interval(cfg: RunConfig, total_steps: int) -> int:
    """Steps between checkpoints: the configured value, or about ten per run when unset (0: only at the end)."""
    every = cfg.train.checkpoint_every
    return max(1, math.ceil(total_steps / 10)) if every is None else every


def format_step(rec: dict, total_steps: int) -> str:
    return (f"step {rec['step']:>5}/{total_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
            f"grad {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | mfu {100 * rec['mfu']:.2f}% | "
            f"mem {rec['mem_peak_bytes'] / 2**20:,.0f} MiB")


# ---------------------------------------------------------------- the loop


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; not norms or biases."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_factory(cfg: RunConfig, device: torch.device):
    def make(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), eps=1e-8,
                                 fused=device.type in ("cuda", "cpu"))
    return make


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: PreparedData, cfg: RunConfig, device: torch.device, autocast) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in eval_batches(data.eval, cfg.model.block_size, cfg.train.eval_tokens, cfg.train.micro_batch):
        with autocast():
            loss = model(x.to(device), y.to(device))
        total, count = total + loss.item() * len(x), count + len(x)
    model.train()
    return total / count


def train(cfg: RunConfig, data_dir: Path, run_dir: Path, world: World, resume: bool = False) -> dict:
    """Train ``cfg`` on prepared data; write the run directory (rank 0); return the summary."""
    started = time.perf_counter()
    plan = validate(cfg, world.world_size)
    data = PreparedData.load(data_dir)
    device, t = world.device, cfg.train
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = torch.bfloat16 if t.dtype == "bf16" or (t.dtype == "auto" and device.type == "cuda") else torch.float32
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if dtype == torch.bfloat16 \
        else contextlib.nullcontext

    torch.manual_seed(t.seed)
    model = GPT(cfg.model)
    if t.compile:
        model.compile()
    strategy = parallel.create(cfg.parallel.strategy, world)
    model = strategy.wrap(model)
    strategy.make_optimizer(adamw_factory(cfg, device), param_groups(model, t.weight_decay))
    counts = accounting.param_counts(cfg.model)
    flops_per_token = accounting.flops_per_token(cfg.model)
    peak = peak_flops(cfg, device, dtype) * world.world_size

    start_step, earlier_wall_time = 0, 0.0
    if resume:
        folder = checkpoint.latest(run_dir)
        if folder is None:
            raise ConfigError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        state, meta = checkpoint.load(folder, world.rank, world.world_size)
        strategy.load_state_dict(state)
        start_step, earlier_wall_time = meta["step"], meta["wall_time_s"]
        if start_step >= plan.total_steps:
            raise ConfigError(f"--resume: the run in {run_dir} is already complete ({start_step} steps)")
        if t.stop_after and t.stop_after <= start_step:
            raise ConfigError(f"train.stop_after ({t.stop_after}) is not beyond the checkpoint's step ({start_step})")
    log = RunLog(run_dir, world.is_main, keep_until_step=start_step)
    if world.is_main:
        save_json(run_dir / "config.json", cfg.to_dict())
        data.tokenizer.save(run_dir / "tokenizer")
        log.say(f"model: {cfg.model.arch}, {counts.total:,} params ({counts.non_embedding:,} non-embedding), "
                f"{flops_per_token / 1e6:.2f} MFLOP/token | strategy {cfg.parallel.strategy} × {world.world_size} | "
                f"{plan.total_steps} steps of {t.batch_tokens:,} tokens "
                f"({plan.accum_steps} micro-step{'s' if plan.accum_steps > 1 else ''} per step) | "
                f"device {device}, {str(dtype).removeprefix('torch.')}"
                + (f" | resumed at step {start_step}" if resume else ""))

    sampler = BatchSampler(data.train, cfg.model.block_size, t.seed)
    end_step = min(plan.total_steps, t.stop_after) if t.stop_after else plan.total_steps
    per_rank = plan.global_sequences // world.world_size
    checkpoint_every = checkpoint_interval(cfg, plan.total_steps)
    recent: list[float] = []
    eval_loss = None

    def save_checkpoint(step: int) -> None:
        meta = {"tokens": step * t.batch_tokens, "wall_time_s": earlier_wall_time + time.perf_counter() - started}
        checkpoint.save(run_dir, step, world.rank, world.world_size, strategy.state_dict(), meta,
                        t.keep_checkpoints)

    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        lr = schedule.learning_rate(step, plan.total_steps, t)
        for group in strategy.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro in range(plan.accum_steps):
            lo = world.rank * per_rank + micro * t.micro_batch
            x, y = sampler.batch(step, plan.global_sequences, lo, lo + t.micro_batch)
            with strategy.sync_gradients(micro == plan.accum_steps - 1):
                with autocast():
                    loss = model(x.to(device), y.to(device)) / plan.accum_steps
                loss.backward()
            loss_sum += loss.detach()
        loss_value = strategy.mean_across_ranks(loss_sum).item()
        if not math.isfinite(loss_value):
            last = checkpoint.latest(run_dir)
            raise TrainingDiverged(f"loss is {loss_value} at step {step + 1}; stopped "
                                   f"(last good checkpoint: {last if last else 'none'})")
        grad_norm = strategy.clip_grad_norm(t.grad_clip).item()
        strategy.step()
        synchronize(device)
        step_time = time.perf_counter() - t0
        done = step + 1
        recent = (recent + [loss_value])[-t.log_every:]

        if done % t.log_every == 0 or done == end_step or done == start_step + 1:
            tokens_per_s = t.batch_tokens / step_time
            rec = {"step": done, "tokens": done * t.batch_tokens, "loss": loss_value, "lr": lr,
                   "grad_norm": grad_norm, "step_time_s": step_time, "tokens_per_s": tokens_per_s,
                   "mfu": flops_per_token * tokens_per_s / peak, "mem_peak_bytes": peak_memory_bytes(device)}
            log.record(rec)
            log.say(format_step(rec, plan.total_steps))
        if (t.eval_every and done % t.eval_every == 0) or done == plan.total_steps:
            eval_loss = evaluate(model, data, cfg, device, autocast)
            log.record({"step": done, "tokens": done * t.batch_tokens, "eval_loss": eval_loss})
            log.say(f"step {done:>5}/{plan.total_steps} | eval loss {eval_loss:.4f}")
        if (checkpoint_every and done % checkpoint_every == 0) or done == end_step:
            save_checkpoint(done)

    tokens = end_step * t.batch_tokens
    summary = {
        "status": "completed" if end_step == plan.total_steps else "stopped",
        "params": counts.total, "params_non_embedding": counts.non_embedding,
        "flops_per_token": flops_per_token, "tokens": tokens, "flops": flops_per_token * tokens,
        "steps": end_step, "final_train_loss": sum(recent) / len(recent) if recent else None,
        "final_eval_loss": eval_loss, "unigram_entropy_nats": data.meta.get("unigram_entropy_nats"),
        "strategy": cfg.parallel.strategy, "world_size": world.world_size, "device": str(device),
        "peak_flops": peak, "wall_time_s": earlier_wall_time + time.perf_counter() - started, "data_dir": str(data_dir),
    }
    if world.is_main:
        save_json(run_dir / "summary.json", summary)
    return summary
