"""A run's log and report: metrics.jsonl, the printed lines (the start line, one per logged step, the evals), the
progress bar, the trackers, attempts.jsonl, and the summary. Each transform and model feature formats its own
fragment of the step line (``lab.measure.figures.Figures.line``, gathered by ``lab.parallel.step_line``)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from lab import parallel
from lab.data import PreparedData
from lab.measure import accounting
from lab.measure.hardware import duration as _duration
from lab.training.admission import ESTIMATE_MFU, Estimate
from lab.measure.device import Peak, Precision, remeasure_low_peak, threads
from lab.parallel import Strategy, World
from lab.runtime.config import RunConfig
from lab.runtime.files import (append_line, dumps, fsync_file, fsync_folder, loads_line, open_append, read_lines,
                               write_atomic)
from lab.training import expect, trackers
from lab.training.steps import Start, StepPlan

if TYPE_CHECKING:
    from lab.training.train import Outcome

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
            with open_append(self.path) as f:
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
        return [rec for line in read_lines(self.path)
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
        rec = loads_line(line)
    except ValueError:
        return None
    step = rec.get("step") if isinstance(rec, dict) else None
    return rec if isinstance(step, int) and not isinstance(step, bool) else None


def format_step(rec: dict, total_steps: int, eta_s: float) -> str:
    grad = "skipped (non-finite)" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
    return (f"step {rec['step']:>5}/{total_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | grad {grad} | "
            f"{rec['tokens_per_s']:,.0f} tok/s | mfu {100 * rec['mfu']:.2f}% | "
            f"comm {1e3 * rec['comm_time_s']:.0f} ms | mem {rec['mem_peak_bytes'] / 2**20:,.0f} MiB | "
            f"eta {_duration(eta_s)}" + parallel.step_line(rec))


def start_line(cfg: RunConfig, world: World, plan: StepPlan, precision: Precision, peak: Peak, start: Start,
               estimate: Estimate | None, strategy: str) -> str:
    """The run's first line, about 160 characters: the model, the strategy and its layout, the steps, the device and
    policy, the MFU denominator and the estimate. summary.json holds the rest (FLOPs per token, micro-steps, the
    peak's source in full), ``python -m lab peak`` the CPU peaks."""
    counts, m = accounting.param_counts(cfg.model), cfg.model
    mup = " under μP (untied head)" if m.parametrization == "mup" and not m.tie_embeddings else ""
    moe = (f" ({counts.active:,} active: mixture of {m.moe_experts} experts (top {m.moe_top_k}, granularity "
           f"{m.moe_granularity}{f', {m.moe_shared_experts} shared' if m.moe_shared_experts else ''}))"
           if m.moe_experts else "")
    line = (f"model: {m.arch}{mup}, {counts.total:,} params{moe} | strategy {strategy} × {world.world_size} | "
            f"{plan.total_steps} steps of {cfg.train.batch_tokens:,} tokens | device {world.device}, {precision.short}"
            f"{f', {threads()}' if world.device.type == 'cpu' else ''} | peak {peak.flops:.3g} FLOP/s ({peak.label})")
    if estimate is not None:
        remaining = estimate.seconds * (1 - start.step / plan.total_steps)
        line += f" | about {_duration(remaining)} at {ESTIMATE_MFU:.0%} MFU"
    return line + (f" | resumed at step {start.step}" if start.step else "")


def checked_peak(peak: Peak, world: World, log: RunLog) -> Peak:
    """The peak to go on with once a step's MFU passed 100 %, said in one warning: a measured CPU peak measured again
    (rank 0) and the higher figure taken; else the same one. A figure measured again and found no higher did not
    read low for the load, whatever the load was when it was taken."""
    remeasured = remeasure_low_peak(peak) if world.is_main else None
    if remeasured is not None:
        log.say(f"warning: MFU above 100%: the peak ({peak.flops:.3g} FLOP/s, {peak.label}) read low; measured "
                f"again: {remeasured.flops:.3g} FLOP/s, used from here on")
        return remeasured
    measured = peak.measured is not None
    again = " (measured again, no higher: not the load; the run outpaces the benchmark)" if measured else ""
    log.say(f"warning: MFU above 100%: the peak ({peak.flops:.3g} FLOP/s, {peak.label}) reads low{again}; set "
            f"train.peak_flops to this device's peak")
    return peak


def log_eval(log: RunLog, step: int, total_steps: int, batch_tokens: int, eval_loss: float,
             watcher: expect.Watcher | None) -> None:
    """The eval record and line; with train.expect, the law's expected loss beside it (and its one warning)."""
    fields, line, off_track = watcher.eval_fields(step, eval_loss) if watcher is not None else ({}, "", None)
    log.record({"step": step, "tokens": step * batch_tokens, "eval_loss": eval_loss} | fields)
    log.say(f"step {step:>5}/{total_steps} | eval loss {eval_loss:.4f}{line}")
    if off_track:
        log.say(f"warning: {off_track}")


def summarise(cfg: RunConfig, world: World, plan: StepPlan, strategy: Strategy, data: PreparedData,
              data_dir: Path, peak: Peak, outcome: Outcome, wall_time_s: float) -> dict:
    counts, fpt = accounting.param_counts(cfg.model), accounting.flops_per_token(cfg.model)
    tokens = outcome.end_step * cfg.train.batch_tokens
    return {
        "status": outcome.status, "params": counts.total, "params_non_embedding": counts.non_embedding,
        "params_active": counts.active, "moe_experts": cfg.model.moe_experts, "moe_top_k": cfg.model.moe_top_k,
        "moe_granularity": cfg.model.moe_granularity,
        "flops_per_token": fpt, "tokens": tokens, "flops": fpt * tokens, "steps": outcome.end_step,
        "total_steps": plan.total_steps, "micro_steps": plan.accum_steps, "skipped_steps": outcome.skipped_steps,
        "final_train_loss": sum(outcome.recent_losses) / len(outcome.recent_losses) if outcome.recent_losses else None,
        "final_eval_loss": outcome.eval_loss, "unigram_entropy_nats": data.meta.get("unigram_entropy_nats"),
        **({"expect": outcome.expect} if outcome.expect else {}),
        "strategy": cfg.parallel.strategy, "world_size": world.world_size, "device": str(world.device),
        "precision": strategy.precision.name, **strategy.precision_record(),
        "peak_flops": peak.flops * world.world_size, "peak_flops_per_device": peak.flops,
        "peak_flops_source": peak.source, "wall_time_s": wall_time_s, "data_dir": str(data_dir),
        **({"signal": signal.Signals(outcome.signal).name} if outcome.signal else {}),
        **strategy.accounts.meters(),
        "peak_bytes": outcome.peak_bytes,
        "peak_bytes_theory": strategy.accounts.run_peak_bytes_theory(cfg.model),
    }
