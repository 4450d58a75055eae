"""Expert parallelism on 4 gloo ranks: step time and all-to-all bytes against E and ep (issue 36).

Run: ``.venv/bin/python benchmarks/experts/bench_experts.py`` from the repository root (about a minute on 2 cores).

Each case trains a small MoE GPT (2 layers, d 64, block 64, top 2, 4 sequences per rank, fp32, dropless) under
``ddp`` on 4 ranks with ``parallel.ep`` 1, 2 or 4, for 6 steps, and prints the median time of steps 2-6 and one
rank's all-to-all bytes per step, measured (counted from the tensors handed to ``all_to_all_single``) beside the
formula at balanced routing (``lab.measure.accounting.expert_all_to_all_bytes``), and the gradient all-reduce's
bytes per step. The machine's 1-minute load average before each case is printed beside it: 4 ranks on 2 cores
share them, and other work slows every case alike.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from lab.commands.equivalence import Setup, batch
from lab.commands.ranks import run_ranks
from lab.measure.device import Precision
from lab.model import GPT
from lab.parallel import LoopSettings, World, create, parse_spec
from lab.runtime.config import ModelConfig, TrainConfig
from lab.training.optim import adamw_factory, param_groups
from lab.training.steps import StepPlan
from lab.training.train import train_step

MODEL = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=64, vocab_size=256, moe_top_k=2)
RANKS, MICRO, STEPS = 4, 4, 6


def case(world: World, experts: int, ep: int) -> dict:
    torch.set_num_threads(1)
    model = dataclasses.replace(MODEL, moe_experts=experts)
    loop = LoopSettings(micro_batch=MICRO, accum_steps=1, grad_clip=1.0)
    strategy = create(parse_spec(f"ddp:ep={ep}"), world, Precision("cpu"), loop)
    strategy.build(lambda: GPT(model, seed=0), lambda m: param_groups(m, 0.1),
                   adamw_factory(TrainConfig(), world.device))
    plan = StepPlan(MICRO * world.world_size, 1, STEPS, MICRO, world.world_size)
    times, sent, synced = [], [], []
    for step in range(STEPS):
        x, y = batch(Setup(model=model), step, plan.global_sequences)
        lo, hi = plan.micro_range(world.rank, 0)
        t0 = time.perf_counter()
        train_step(strategy, world, [(x[lo:hi], y[lo:hi])], 1, 1e-3, 1.0)
        times.append(time.perf_counter() - t0)
        meters = strategy.take_step_meters()
        sent.append(meters.layout.get("ep_a2a_bytes", 0.0))
        synced.append(meters.comm_bytes["all_reduce"])
    return {"step_s": statistics.median(times[1:]), "a2a": sent[-1],
            "a2a_theory": strategy.accounts.meters().get("ep_a2a_bytes_per_step_theory", 0.0), "all_reduce": synced[-1]}


def main() -> None:
    print(f"{os.cpu_count()} cores, {RANKS} gloo ranks; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| E | ep | load before | median step s | a2a KiB/step (rank 0) | theory (balanced) | all-reduce KiB/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for experts in (4, 8, 16):
        for ep in (1, 2, 4):
            load = os.getloadavg()[0]
            r = run_ranks(case, RANKS, experts, ep)[0]
            print(f"| {experts} | {ep} | {load:.2f} | {r['step_s']:.3f} | {r['a2a'] / 2**10:,.1f} | "
                  f"{r['a2a_theory'] / 2**10:,.1f} | {r['all_reduce'] / 2**10:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
