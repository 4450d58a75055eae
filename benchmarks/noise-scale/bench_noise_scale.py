"""What measuring the gradient noise scale costs a step (train.noise_scale, lab/parallel/noise.py).

Run: ``.venv/bin/python benchmarks/noise-scale/bench_noise_scale.py`` from the repository root (about 3 minutes on
2 cores).

For each model and layout, one process group builds the engine twice, with the meter and without, and times
alternating blocks of steps of each (so that load on a shared machine falls on both alike): the median step time of
each, and their ratio paired by block (each block's median with the meter over the one without, taken seconds apart)
as the median over blocks with a 95 % bootstrap interval (``lab.commands.bench.paired_ratio``). Random token batches, fp32, CPU, every step 4 micro-batches of the
model's micro-batch (single accumulates 4; 2 ranks accumulate 2 each). The machine's 1-minute load average is
printed before each case. Prints a Markdown table.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from lab.commands.bench import paired_ratio
from lab.commands.equivalence import Setup, batch, loop_settings, precision
from lab.commands.ranks import run_ranks
from lab.model import GPT
from lab.parallel import Layout, World, parse_spec
from lab.runtime.config import ModelConfig, TrainConfig
from lab.training.optim import adamw_factory, param_groups
from lab.training.plan import create
from lab.training.steps import StepPlan
from lab.training.train import train_step

MODELS = {  # (model, sequences per micro-batch)
    "demo (gpt2, 4 × 128, 256 tokens)": (ModelConfig(n_layer=4, n_head=4, d_model=128, block_size=256,
                                                     vocab_size=4096), 4),
    "sweep family (modern, 1 × 32, 128 tokens)": (ModelConfig(arch="modern", n_layer=1, n_head=4, d_model=32,
                                                              block_size=128, vocab_size=257, tie_embeddings=False,
                                                              d_ff=88), 4),
}
LAYOUTS = (("single", 1), ("ddp", 2), ("zero2", 2), ("fsdp", 2))
MICRO_BATCHES, BLOCKS, STEPS_PER_BLOCK = 4, 10, 5


def _time(world: World, spec: str, model: ModelConfig, micro_batch: int) -> dict[str, float]:
    torch.set_num_threads(1)  # two ranks on two cores; single alike
    parallel = parse_spec(spec)
    replicas = Layout.of(parallel, world.world_size).dp
    replica = world.rank
    accum = MICRO_BATCHES // replicas
    engines = {}
    for noise in (False, True):
        setup = Setup(accum=accum, micro_batch=micro_batch, noise_scale=noise, model=model)
        engine = create(parallel, world, precision(setup), loop_settings(setup))
        engine.build(lambda: GPT(model, seed=1), lambda m: param_groups(m, 0.1),
                     adamw_factory(TrainConfig(), world.device))
        engines[noise] = (engine, setup)
    plan = StepPlan(global_sequences=micro_batch * MICRO_BATCHES, accum_steps=accum, total_steps=10_000,
                    micro_batch=micro_batch, world_size=replicas)
    times: dict[bool, list[list[float]]] = {False: [], True: []}
    step = 0
    for block in range(BLOCKS + 1):  # the first block of each warms up and is not counted
        for noise in (False, True):
            engine, setup = engines[noise]
            times[noise].append([])
            for _ in range(STEPS_PER_BLOCK):
                x, y = batch(setup, step, plan.global_sequences)
                micro = [(x[lo:hi], y[lo:hi]) for lo, hi in (plan.micro_range(replica, m) for m in range(accum))]
                world.sum(torch.zeros(1))  # the ranks start each step together
                t0 = time.perf_counter()
                train_step(engine, world, micro, accum, 1e-3, 1.0)
                engine.take_step_meters()
                times[noise][-1].append(time.perf_counter() - t0)
                step += 1
    off, on = ([statistics.median(b) for b in times[noise][1:]] for noise in (False, True))
    ratio = paired_ratio([1 / t for t in off], [1 / t for t in on])  # the on/off step-time ratio by block
    return {"off": statistics.median(off), "on": statistics.median(on), "ratio": ratio}


def main() -> None:
    print("| model | layout | ranks | step, meter off (ms) | step, meter on (ms) | on / off, paired by block [95 % "
          "interval] | load |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (model, micro_batch) in MODELS.items():
        for spec, ranks in LAYOUTS:
            load = os.getloadavg()[0]
            got = run_ranks(_time, ranks, spec, model, micro_batch, deadline_s=600)[0]
            median, low, high = got["ratio"]
            print(f"| {name} | {spec} | {ranks} | {got['off'] * 1e3:.1f} | {got['on'] * 1e3:.1f} | "
                  f"{median:.3f} [{low:.3f}, {high:.3f}] | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
