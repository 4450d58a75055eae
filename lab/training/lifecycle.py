"""A run's lifecycle, from its config to its exit code: the checks before any process group (``preflight``), the run
directory (a new name, its lock, whether to resume, a resumed run's config), the process group, the data, the stop
signals (``run``), then the run itself (``train``): its engine built (``build_engine``), a checkpoint restored
(``restore``), its log opened, the loop (``lab.training.train.run_steps``), its summary; what each way of ending
means (``run``; the exit codes are in ``lab.commands.cli``'s docstring) and the teardown. ``lab.commands.cli``
parses the command line and launches ranks.

A run writes its directory: ``config.json`` (resolved config), ``metrics.jsonl`` (one record per logged step, plus
eval records), ``summary.json`` (final figures and status), ``attempts.jsonl``, ``tokenizer/`` and
``checkpoints/step-N/``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import IO, TypeVar

import torch.distributed as dist

from lab import parallel
from lab.data import PreparedData, check_source, load_tokenizer, prepare
from lab.data.tokenizer import BytesTokenizer
from lab.measure import memory
from lab.training.admission import Estimate, check_resources
from lab.measure.device import (available_memory_bytes, peak_flops, peak_warnings, precision_of, resolve_device,
                                setup_device)
from lab.model import GPT
from lab.parallel import RunEngine, World, backend_for, join_group_of_one
from lab.parallel.comm import AxisFailed
from lab.runtime import chaos, checkpoint
from lab.runtime.config import ConfigError, RunConfig, print_error
from lab.runtime.files import (LockHeld, LockUnusable, check_plain_files, dumps, probe_writable, read_json,
                               refuse_foreign_folder, save_json, take_lock)
from lab.runtime.loopback import LOOPBACK_HOSTS, listen_on_loopback
from lab.training.optim import optimizer_factory, param_groups
from lab.training.runlog import RunLog, start_line, summarise
from lab.training.plan import RunPlan, plan_run
from lab.training.steps import Start, StepPlan
from lab.training.train import TrainingDiverged, run_steps

# What may change between the segments of one resumed run: how it runs (strategy, world size through
# the accumulation, micro-batch, precision, logging), never what it is (model, data, schedule, optimizer).
RESUMABLE_CHANGES = {"train.stop_after", "train.log_every", "train.checkpoint_every", "train.keep_checkpoints",
                     "train.checkpoint_steps",
                     "train.eval_every", "train.eval_tokens", "train.micro_batch", "train.device", "train.dtype",
                     "train.compile", "train.peak_flops", "train.nonfinite", "train.expect", "data.cache_dir"}


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def resume_mode(requested: str | None) -> str:
    """The --resume mode: as given, else ``auto`` when torchrun restarts a failed group, else ``never``."""
    if requested is not None:
        return requested
    return "auto" if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 else "never"


def check_run_dir(run_dir: Path, mode: str) -> bool:
    """Whether to resume from ``run_dir``'s newest checkpoint; refuse what ``mode`` does not allow.

    ``latest`` needs a complete checkpoint; ``auto`` resumes from one when there is one and otherwise
    starts afresh (a run stopped before its first checkpoint has nothing to lose); ``never`` refuses a
    directory that already holds a run: one that took a step (a checkpoint, metrics or a summary). What a
    run that failed before its first step left (its config.json and tokenizer) is written again. A run whose
    summary says completed is not resumed (``refuse_completed``); one killed after its last checkpoint but
    before its summary is (resuming at the last step only writes the summary).
    """
    probe_writable(run_dir, "--run-dir")
    check_own_run_dir(run_dir)
    if mode != "never":
        refuse_completed(run_dir)  # with or without its checkpoints (freed for disk space)
    has_checkpoint = checkpoint.latest(run_dir) is not None
    if mode == "latest" and not has_checkpoint:
        raise ConfigError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
    took_a_step = has_checkpoint or (run_dir / "metrics.jsonl").exists() or (run_dir / "summary.json").exists()
    if mode == "never" and took_a_step:
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it (--resume auto also "
                          f"restarts one stopped before its first checkpoint) or choose another --run-dir")
    return has_checkpoint and mode != "never"


def refuse_completed(run_dir: Path) -> None:
    """ConfigError when ``run_dir``'s summary says the run completed (one killed before its summary is resumed)."""
    if (summary := _read_json(run_dir / "summary.json")).get("status") == "completed":
        raise ConfigError(f"--resume: the run in {run_dir} is already complete ({summary.get('steps')} steps)")


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; empty when the file is missing, unreadable or holds anything else."""
    try:
        value = read_json(path)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


RUN_LOCK = ".lock"  # in the run directory: held by rank 0 for the whole run
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "attempts.jsonl")  # read and appended to


def check_own_run_dir(run_dir: Path) -> None:
    """ConfigError (one line) for a folder the lab did not write (one that holds something but no lock or
    checkpoints: the user's own config.json is never overwritten) or a run file that is a link, a FIFO or a folder
    (never followed, read or appended to)."""
    refuse_foreign_folder(run_dir, (RUN_LOCK, "checkpoints"), "--run-dir")
    check_plain_files(run_dir, RUN_FILES)


def lock_run_dir(run_dir: Path) -> IO[bytes]:
    """Hold the run directory's lock (rank 0, for the whole run); ConfigError (one line) while another run holds
    it. Only the folder and the lock file are created; nothing else is touched."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return take_lock(run_dir / RUN_LOCK)
    except LockHeld as e:
        raise ConfigError(f"{run_dir} is in use by another run (pid {e.holder}); wait for it to end or choose "
                          f"another --run-dir") from None
    except LockUnusable as e:
        raise ConfigError(str(e)) from None


def default_run_dir(root: Path = Path("runs")) -> Path:
    """A new folder name under ``root``: the start time, plus torchrun's run id so that a restarted
    group finds its own run again (every rank computes the same name from the shared run id)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        tag = hashlib.sha256(run_id.encode()).hexdigest()[:8]
        earlier = sorted(root.glob(f"*-{tag}"))
        return earlier[-1] if earlier else root / f"{time.strftime('%Y%m%d-%H%M%S')}-{tag}"
    name = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        candidate = root / (name if n == 1 else f"{name}-{n}")
        if not candidate.exists():
            return candidate
    raise ConfigError(f"no free run directory name under {root}; pass --run-dir")


def check_resume_config(run_dir: Path, cfg: RunConfig) -> None:
    old = _flatten(config_tree(run_dir, "--resume: "))
    new, default = _flatten(cfg.to_dict()), _flatten(RunConfig().to_dict())
    # an option added since the run was written (absent from its config.json) held its default then
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k, default.get(k)) != new.get(k)
                     and k not in RESUMABLE_CHANGES and not k.startswith(("parallel.", "log.")))
    if changed:
        raise ConfigError(f"--resume cannot change {', '.join(changed)} (the model, data, tokenizer and schedule "
                          f"of a run are fixed; the strategy, world size, micro-batch and precision may change)")


def resolve_vocab(cfg: RunConfig, tokenizer_vocab: int) -> None:
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer_vocab
    elif cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                          f"({tokenizer_vocab})")


def config_tree(run_dir: Path, prefix: str = "") -> dict:
    """A run's config.json as read (sections of options); ConfigError (one line) when it is unreadable or holds
    anything else."""
    try:
        tree = read_json(run_dir / "config.json")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{prefix}{run_dir / 'config.json'} is unreadable ({e})") from None
    if not isinstance(tree, dict) or not all(isinstance(v, dict) for v in tree.values()):
        raise ConfigError(f"{prefix}{run_dir / 'config.json'} is not a run's config (a JSON object of sections)")
    return tree


def shared_store_warning() -> str | None:
    """A warning when torchrun may restart the group while it shares its rendezvous store with the workers:
    the restarted workers then fail to meet (pytorch/pytorch#135712)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and \
            os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        return ("warning: torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment: "
                "a restarted group fails to meet (pytorch/pytorch#135712)")
    return None


def world_from_env(device_name: str) -> World:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return World(rank=rank, world_size=world_size, local_rank=local_rank,
                 device=resolve_device(device_name, local_rank))


class StopSignals:
    """SIGINT and SIGTERM ask the loop to stop at the end of the step in progress; a second SIGINT stops at once."""

    def __init__(self) -> None:
        self.received = 0

    def __enter__(self) -> StopSignals:
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signum

    def __call__(self) -> int:
        return self.received


def preflight(cfg: RunConfig, run_dir: Path | None, resume: str | None,
              ranks: int | None = None) -> tuple[World, str, Estimate]:
    """Every check that can run before the process group and the data: ConfigError on bad input. Returns this
    process's world, the resume mode (``resume_mode``) and the run's estimate. ``ranks``: check for that many
    processes on this machine (before starting them) instead of torchrun's variables."""
    if ranks is None:
        world = world_from_env(cfg.train.device)
    else:
        world = World(rank=0, world_size=ranks, local_rank=0, device=resolve_device(cfg.train.device, 0))
    vocab = cfg.data.vocab_size if cfg.data.tokenizer == "bpe" else BytesTokenizer().vocab_size
    precision = precision_of(cfg.train, world.device)
    layout = plan_run(cfg, world.world_size, precision, vocab).layout
    check_source(cfg.data)
    mode = resume_mode(resume)
    if run_dir is not None:
        check_run_dir(run_dir, mode)
    budget = cfg.train.memory_budget * 2**30
    estimate = check_resources(cfg, layout, world, precision, peak_flops(world.device, precision, cfg.train.peak_flops),
                               vocab, budget or available_memory_bytes(world.device),
                               1 if budget else ranks or int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size)))
    return world, mode, estimate


# ---------------------------------------------------------------- the run


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


def build_engine(plan: RunPlan, world: World) -> RunEngine:
    """The run's engine on its resolved layout, built from the model factory (the transforms split it, the strategy
    places it), the weight-decay rule and the optimizer (AdamW, or Muon with AdamW)."""
    cfg = plan.cfg
    engine = parallel.create(cfg.parallel, plan.layout, world, plan.precision, plan.loop)
    engine.build(functools.partial(GPT, cfg.model, seed=cfg.train.seed),
                 lambda model: param_groups(model, cfg.train.weight_decay, cfg.train.optimizer == "muon"),
                 optimizer_factory(cfg.train, world.device))
    return engine


def restore(strategy: RunEngine, run_dir: Path, world: World, cfg: RunConfig, plan: StepPlan) -> Start:
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
    strategy.load_checkpoint_meta(meta)
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
    started, data = time.perf_counter(), PreparedData.load(data_dir)
    setup_device(world.device)
    precision = precision_of(cfg.train, world.device)
    run = plan_run(cfg, world.world_size, precision, data.tokenizer.vocab_size)
    peak = peak_flops(world.device, precision, cfg.train.peak_flops)
    with memory.Meter(world.device, track_tensors=cfg.train.memory_meter).running():
        strategy = build_engine(run, world)
        start = restore(strategy, run_dir, world, cfg, run.steps) if resume else Start()
        log = RunLog(run_dir, world.is_main, keep_until_step=start.step, total_steps=run.steps.total_steps)
        if world.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.clean_stale_temporaries(run_dir)
            save_json(run_dir / "config.json", cfg.to_dict())
            data.tokenizer.save(run_dir / "tokenizer")
            line = start_line(cfg, world, run.steps, precision, peak, start, estimate, strategy.describe())
            log.say("\n".join([line, *peak_warnings(peak, precision)]))  # a busy machine's peak, slow 16-bit matmuls
            log.open_trackers(cfg, run_dir, resumed_at=start.step)
            log.attempt("start", start.step, restarts=restarts, sweep_attempt=os.environ.get("LAB_SWEEP_ATTEMPT"))
        try:
            outcome = run_steps(run, world, strategy, data, run_dir, log, start, started, peak, stop_signal)
            summary = summarise(cfg, world, run.steps, strategy, data, data_dir, outcome.peak, outcome,
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


def run(cfg: RunConfig, world: World, run_dir: Path | None, mode: str, estimate: Estimate) -> int:
    """Train a run that passed ``preflight``, from the process group to its teardown; return the exit code. Without
    ``run_dir`` the run gets a new folder (``default_run_dir``), named in its first and last lines."""
    named = run_dir is not None  # on the command line
    if world.is_main and (warning := shared_store_warning()):
        print(warning, file=sys.stderr, flush=True)
    if not join_group(cfg, world):
        return 1
    held: list[IO[bytes]] = []  # rank 0's lock on the run directory, released when this returns

    def claim() -> bool:
        held.append(lock_run_dir(run_dir))
        return check_run_dir(run_dir, mode)

    try:
        run_dir = run_dir or world.broadcast_from_main(default_run_dir)
        world.check_same(hashlib.sha256(dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest(), "the config")
        resume = decided_on_main(world, claim)  # one view of the folder, however each node's cache sees it
        # The first process of each node prepares the data (no disk is assumed shared between nodes);
        # the others find it ready (preparing is atomic and safe to race).
        if world.local_rank == 0:
            data_dir = prepare(cfg.data, progress=world.is_main)
        if world.world_size > 1:
            dist.barrier()
        if world.local_rank != 0:
            data_dir = prepare(cfg.data, progress=False)
        resolve_vocab(cfg, load_tokenizer(data_dir / "tokenizer").vocab_size)
        if resume:
            check_resume_config(run_dir, cfg)
        if world.is_main and not named:
            print(f"run directory: {run_dir}", flush=True)
        with StopSignals() as stop:
            summary = train(cfg, data_dir, run_dir, world, resume=resume, stop_signal=stop, estimate=estimate,
                            restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ConfigError as e:
        print_error(str(e))
        return 2
    except TrainingDiverged as e:
        if world.is_main:
            save_json(run_dir / "summary.json", {"status": "diverged", "error": str(e),
                                                 "strategy": cfg.parallel.strategy, "world_size": world.world_size})
            print(f"error: {e}", file=sys.stderr)  # every rank sees the same loss and norm
        return 1
    except checkpoint.CheckpointWriteError as e:
        if world.is_main:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        if world.world_size == 1:
            raise  # one process: a bug, with its traceback
        return collective_failed(e, cfg, world, run_dir)
    except KeyboardInterrupt:
        print("error: interrupted (a second Ctrl-C stops without a checkpoint; the last one is kept)", file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for lock in held:
            lock.close()

    return ended(summary, world, run_dir, named)


def join_group(cfg: RunConfig, world: World) -> bool:
    """Start the process group of a run of several ranks (False, said in one line: the ranks did not meet), or a
    group of one for a multi-rank strategy run alone (plain python, or torchrun with 1)."""
    if world.world_size > 1:
        if os.environ.get("MASTER_ADDR") in LOOPBACK_HOSTS:
            listen_on_loopback()  # rank 0 hosts the store when torchrun does not share its own
        try:
            dist.init_process_group(backend=backend_for(world.device),
                                    timeout=timedelta(seconds=cfg.parallel.timeout_s))
        except RuntimeError as e:  # torch.distributed.DistError and its kinds derive from it
            print(f"error: the {world.world_size} processes did not meet within parallel.timeout_s "
                  f"({cfg.parallel.timeout_s:g} s), is a rank missing? ({_first_line(e)})", file=sys.stderr)
            return False
    elif cfg.parallel.strategy != "single" and not dist.is_initialized():
        join_group_of_one(world.device)
    return True


def collective_failed(e: RuntimeError, cfg: RunConfig, world: World, run_dir: Path) -> int:
    """Exit code 1 for a rank of several whose run failed (a peer died or timed out, or the ranks diverged): the
    traceback in the run's logs, one line naming the axis where it is known."""
    log = run_dir / "logs" / f"rank-{world.rank}-error.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(traceback.format_exc())
    failed = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, AxisFailed)), None)
    if failed:
        print(f"error: rank {world.rank}: a rank on the {failed.axis} axis died or did not answer within "
              f"parallel.timeout_s ({cfg.parallel.timeout_s:g} s) ({_first_line(failed.__cause__ or failed)}); "
              f"the last checkpoint is kept; traceback in {log}", file=sys.stderr)
        return 1
    print(f"error: rank {world.rank}: a collective failed or timed out after parallel.timeout_s "
          f"({cfg.parallel.timeout_s:g} s), a rank died or the ranks diverged ({_first_line(e)}); the last "
          f"checkpoint is kept; traceback in {log}", file=sys.stderr)
    return 1


def ended(summary: dict, world: World, run_dir: Path, named: bool) -> int:
    """The exit code of a run that returned its summary, and its last lines (rank 0): how to resume an interrupted
    one (``named``: its run directory was on the command line), or what a finished one did."""
    if summary["status"] == "interrupted":
        if world.is_main:
            print(f"interrupted by {summary['signal']} after step {summary['steps']} of {summary['total_steps']}; "
                  f"checkpoint saved; resume with the same command plus "
                  f"{'--resume' if named else f'--run-dir {run_dir} --resume'}", flush=True)
        return 128 + signal.Signals[summary["signal"]].value
    if world.is_main:
        entropy = summary["unigram_entropy_nats"]
        print(f"done ({summary['status']}): {summary['steps']} steps, {summary['tokens']:,} tokens, "
              f"{summary['flops']:.3g} FLOPs in {summary['wall_time_s']:.1f} s")
        if summary["final_eval_loss"] is not None:
            print(f"held-out loss {summary['final_eval_loss']:.4f} nats/token vs unigram entropy of the corpus "
                  f"{entropy:.4f} nats/token")
        print(f"run directory: {run_dir}")
    return 0
