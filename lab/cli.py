"""Command-line front ends for training and sampling (``launch/run.py``, ``launch/sample.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lab import checkpoint
from lab.config import ConfigError, RunConfig, build_parser, config_from_args, save_json
from lab.data import check_source, load_tokenizer, prepare
from lab.model import GPT
from lab.parallel import World
from lab.train import TrainingDiverged, resolve_device, train, validate

# Options that may change between the segments of one resumed run.
RESUMABLE_CHANGES = {"train.stop_after", "train.log_every", "train.checkpoint_every", "train.keep_checkpoints"}


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


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
    directory that already holds a run.
    """
    has_checkpoint = checkpoint.latest(run_dir) is not None
    if mode == "latest" and not has_checkpoint:
        raise ConfigError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
    if mode == "never" and ((run_dir / "config.json").exists() or has_checkpoint):
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it (--resume auto also "
                          f"restarts one stopped before its first checkpoint) or choose another --run-dir")
    return has_checkpoint and mode != "never"


def check_resume_config(run_dir: Path, cfg: RunConfig) -> None:
    old = _flatten(json.loads((run_dir / "config.json").read_text()))
    new = _flatten(cfg.to_dict())
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES)
    if changed:
        raise ConfigError(f"--resume with a different config ({', '.join(changed)}); only "
                          f"{', '.join(sorted(RESUMABLE_CHANGES))} may change")


def resolve_vocab(cfg: RunConfig, tokenizer_vocab: int) -> None:
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer_vocab
    elif cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                          f"({tokenizer_vocab})")


def _world_from_env(device_name: str) -> World:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return World(rank=rank, world_size=world_size, local_rank=local_rank,
                 device=resolve_device(device_name, local_rank))


def run_main(argv: list[str] | None = None) -> int:
    """Train one run. Exit codes: 0 done, 1 diverged, 2 bad input."""
    parser = build_parser("launch/run.py", "Train a GPT on prepared text and write a run directory.")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        cfg = config_from_args(args)
        world = _world_from_env(cfg.train.device)
        validate(cfg, world.world_size)
        check_source(cfg.data)
        resume = check_run_dir(run_dir, resume_mode(args.resume))
    except ConfigError as e:
        return _error(str(e))

    if world.world_size > 1:
        dist.init_process_group(backend="nccl" if world.device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=cfg.parallel.timeout_s))
    try:
        if world.is_main:
            data_dir = prepare(cfg.data, progress=True)
        if world.world_size > 1:
            dist.barrier()
        if not world.is_main:
            data_dir = prepare(cfg.data, progress=False)
        resolve_vocab(cfg, load_tokenizer(data_dir / "tokenizer").vocab_size)
        if resume:
            check_resume_config(run_dir, cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        summary = train(cfg, data_dir, run_dir, world, resume=resume)
    except ConfigError as e:
        return _error(str(e))
    except TrainingDiverged as e:
        if world.is_main:
            save_json(run_dir / "summary.json", {"status": "diverged", "error": str(e),
                                                 "strategy": cfg.parallel.strategy, "world_size": world.world_size})
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

    if world.is_main:
        entropy = summary["unigram_entropy_nats"]
        print(f"done ({summary['status']}): {summary['steps']} steps, {summary['tokens']:,} tokens, "
              f"{summary['flops']:.3g} FLOPs in {summary['wall_time_s']:.1f} s")
        if summary["final_eval_loss"] is not None:
            print(f"held-out loss {summary['final_eval_loss']:.4f} nats/token vs unigram entropy of the corpus "
                  f"{entropy:.4f} nats/token")
        print(f"run directory: {run_dir}")
    return 0


def sample_main(argv: list[str] | None = None) -> int:
    """Generate text from a run's newest (or a given) checkpoint."""
    p = argparse.ArgumentParser(prog="launch/sample.py", description="Sample text from a trained run.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run-dir", required=True, help="a run directory written by launch/run.py")
    p.add_argument("--checkpoint", help="a checkpoints/step-N folder (default: the newest)")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").is_file():
        return _error(f"{run_dir} is not a run directory (no config.json)")
    folder = Path(args.checkpoint) if args.checkpoint else checkpoint.latest(run_dir)
    if folder is None or not (folder / "rank-0.pt").is_file():
        return _error(f"no checkpoint found in {run_dir}")
    if args.tokens <= 0 or args.num_samples <= 0 or args.temperature < 0:
        return _error("--tokens and --num-samples must be positive and --temperature >= 0")
    if not args.prompt:
        return _error("--prompt must not be empty")

    cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    tokenizer = load_tokenizer(run_dir / "tokenizer")
    model = GPT(cfg.model)
    state = torch.load(folder / "rank-0.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    model.eval()
    prompt = torch.tensor([tokenizer.encode(args.prompt)] * args.num_samples, dtype=torch.long)
    generator = torch.Generator().manual_seed(args.seed)
    out = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k or None,
                         generator=generator)
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(tokenizer.decode(row))
    return 0
