"""Seconds per checkpoint under tensor parallelism against zero2, the same model on the same 2 ranks (issue 37).

Run: ``.venv/bin/python benchmarks/checkpoint/bench_checkpoint.py [--saves N]`` from the repository root (about a
minute on 2 idle cores).

For each layout (``zero2`` over 2 ranks; ``zero2:tp=2``, tp 2 × dp 1) it builds the demo's model (configs/demo.toml:
the tiny preset, vocabulary 4,096) on 2 gloo ranks, takes one training step (so the AdamW moments exist), then
saves N checkpoints (``lab.runtime.checkpoint.save``, what the loop calls) and loads the last one back; it prints
the median seconds per save, the load's seconds, and how many pieces DCP stored (every rank's ranges or rectangles,
summed over the entries): the cost of a save grows with them. The machine's 1-minute load average is printed
before each layout. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from lab.commands.equivalence import Setup, batch, loop_settings
from lab.commands.ranks import run_ranks
from lab.measure.device import Precision
from lab.model import GPT
from lab.parallel import World, create, parse_spec
from lab.runtime import checkpoint
from lab.runtime.config import PRESETS, ModelConfig, TrainConfig
from lab.training.optim import adamw_factory, param_groups
from lab.training.train import train_step

MODEL = ModelConfig(**PRESETS["tiny"], vocab_size=4096)  # configs/demo.toml's
LAYOUTS = ("zero2", "zero2:tp=2")


def _time_checkpoints(world: World, spec: str, run_dir: Path, saves: int) -> tuple[list[float], float]:
    """One step under ``spec``, then ``saves`` checkpoints and one load: seconds of each save, and of the load."""
    setup = Setup(model=MODEL)
    strategy = create(parse_spec(spec), world, Precision("cpu"), loop_settings(setup))
    strategy.build(lambda: GPT(MODEL, seed=setup.seed), lambda m: param_groups(m, 0.1),
                   adamw_factory(TrainConfig(), world.device))
    x, y = batch(setup, 0, 2)
    train_step(strategy, world, [(x, y)], 1, setup.lr, 0.0)
    seconds = []
    for step in range(1, saves + 1):
        start = time.perf_counter()
        checkpoint.save(run_dir, step, world.rank, world.world_size, strategy.checkpoint_state(), {}, keep=1)
        seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    checkpoint.load(checkpoint.latest(run_dir), world.rank, world.world_size, strategy.checkpoint_state())
    strategy.after_load()
    return seconds, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=5, help="checkpoints saved per layout (default: 5)")
    saves = parser.parse_args().saves
    params = sum(p.numel() for p in GPT(MODEL).parameters())
    print(f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; model: tiny preset, "
          f"vocabulary 4,096, {params / 1e6:.2f}M parameters; 2 gloo ranks; {saves} saves per layout")
    print("| layout | load avg before | s per save (median) | min-max | s to load | pieces stored |\n"
          "|---|---:|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in LAYOUTS:
            load_avg, run_dir = os.getloadavg()[0], Path(tmp) / spec.replace(":", "-")
            seconds, load_s = run_ranks(_time_checkpoints, 2, spec, run_dir, saves, timeout_s=600, deadline_s=1800)[0]
            stored = checkpoint.read_dcp_metadata(checkpoint.latest(run_dir)).state_dict_metadata
            pieces = sum(len(md.chunks) for md in stored.values() if hasattr(md, "chunks"))
            print(f"| {spec} | {load_avg:.2f} | {statistics.median(seconds):.3f} | "
                  f"{min(seconds):.3f}-{max(seconds):.3f} | {load_s:.3f} | {pieces} |", flush=True)


if __name__ == "__main__":
    main()
