"""Step time and measured bubble against microbatches, per pipeline schedule, on 4 gloo ranks (issue 33).

Run: ``.venv/bin/python benchmarks/pipeline/bench_pipeline.py [--steps N] [--stages P]
[--out benchmarks/pipeline/pipeline]`` from the repository root (about a minute on 2 cores).

A GPT of 8 blocks (width 64, block size 64, vocabulary 256, fp32, tied head) in P stages (default 4;
``single:pp=P``: every rank a stage, no data parallelism), each micro-step of M sequences cut into M microbatches of
one sequence, for M in 4, 8, 16, under each schedule: ``gpipe``, ``1f1b`` and ``interleaved`` with 2 virtual stages
per rank, run by the lab's hand-rolled schedules and by ``torch.distributed.pipelining`` (``--parallel.pp_impl
torch``). Per case it trains one step to warm up, then ``--steps`` steps through the loop's own ``train_step``, and
records the median step time and (hand-rolled only: torch's sends and receives happen inside its step) the measured
bubble: the fraction of the schedule's time each stage spent blocked on a receive or an unfinished send, averaged
over stages and steps, beside the theory (p − 1)/(V · M + p − 1). The machine's 1-minute load average is recorded
before each case. Writes OUT.json, OUT.md (a Markdown table) and OUT.png (bubble vs M, one line per schedule, theory
dashed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from lab.commands.equivalence import Setup, batch
from lab.commands.ranks import run_ranks
from lab.measure.device import Precision
from lab.model import GPT
from lab.parallel import LoopSettings, World, create, parse_spec
from lab.runtime.config import ModelConfig, TrainConfig
from lab.runtime.files import write_atomic
from lab.training.optim import adamw_factory, param_groups
from lab.training.train import train_step

MODEL = ModelConfig(n_layer=8, n_head=2, d_model=64, block_size=64, vocab_size=256)
SCHEDULES = {"gpipe": "pp_schedule=gpipe", "1f1b": "pp_schedule=1f1b",
             "interleaved (V 2)": "pp_schedule=interleaved,pp_virtual=2"}
MICROBATCHES = (4, 8, 16)
IMPLS = ("lab", "torch")


def theory(schedule: str, m: int, stages: int) -> float:
    virtual = 2 if schedule.startswith("interleaved") else 1
    return (stages - 1) / (virtual * m + stages - 1)


def _case(world: World, spec: str, m: int, steps: int) -> dict:
    """Warm-up step, then ``steps`` timed steps under ``spec``: step seconds and the measured bubble per stage."""
    setup = Setup(model=MODEL)
    loop = LoopSettings(micro_batch=m, accum_steps=1, grad_clip=1.0)
    strategy = create(parse_spec(spec), world, Precision("cpu"), loop)
    strategy.build(lambda: GPT(MODEL, seed=setup.seed), lambda model: param_groups(model, 0.1),
                   adamw_factory(TrainConfig(), world.device))
    seconds, bubbles = [], []
    for step in range(steps + 1):
        x, y = batch(setup, step, m)
        start = time.perf_counter()
        train_step(strategy, world, [(x, y)], 1, 1e-3, 1.0)
        layout = strategy.take_step_meters().layout
        if step:  # the first step warms up
            seconds.append(time.perf_counter() - start)
            if "pp_bubble" in layout:
                bubbles.append(statistics.fmean(layout["pp_bubble"]))
    return {"step_s": statistics.median(seconds), "bubble": statistics.fmean(bubbles) if bubbles else None}


def _all_cases(world: World, steps: int) -> list[dict]:
    rows = []
    for impl in IMPLS:
        for schedule, options in SCHEDULES.items():
            for m in MICROBATCHES:
                load = os.getloadavg()[0]
                spec = f"single:pp={world.world_size},{options},pp_microbatches={m},pp_impl={impl}"
                rows.append({"impl": impl, "schedule": schedule, "m": m, "load_avg": load,
                             "theory": theory(schedule, m, world.world_size), **_case(world, spec, m, steps)})
    return rows


def plot(rows: list[dict], stages: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, schedule in enumerate(SCHEDULES):
        mine = [r for r in rows if r["impl"] == "lab" and r["schedule"] == schedule]
        color = f"C{i}"
        ax.plot([r["m"] for r in mine], [r["bubble"] for r in mine], "o-", color=color, label=f"{schedule} measured")
        ax.plot([r["m"] for r in mine], [r["theory"] for r in mine], "--", color=color, label=f"{schedule} theory")
    ax.set_xscale("log", base=2)
    ax.set_xticks(MICROBATCHES, [str(m) for m in MICROBATCHES])
    ax.set_xlabel("microbatches M")
    ax.set_ylabel("bubble (fraction of the step, mean over stages)")
    ax.set_title(f"pp {stages} on gloo CPU ranks: measured vs (p-1)/(V·M+p-1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict]) -> str:
    lines = ["| impl | schedule | M | load avg before | step s (median) | bubble measured | theory |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        bubble = "not metered" if r["bubble"] is None else f"{100 * r['bubble']:.1f} %"
        lines.append(f"| {r['impl']} | {r['schedule']} | {r['m']} | {r['load_avg']:.2f} | {r['step_s']:.3f} | "
                     f"{bubble} | {100 * r['theory']:.1f} % |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per case (default: 4)")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages, one gloo rank each (default: 4)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/pipeline/pipeline"),
                        help="OUT.json, OUT.md, OUT.png")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = run_ranks(_all_cases, args.stages, args.steps, timeout_s=120, deadline_s=3600)[0]
    header = (f"{os.cpu_count()} cores; {started}; GPT of 8 blocks, width 64, block size 64, vocabulary 256 "
              f"({sum(p.numel() for p in GPT(MODEL).parameters()):,} parameters), fp32; pp {args.stages} on "
              f"{args.stages} gloo ranks, microbatches of one sequence; {args.steps} timed steps per case after one "
              f"warm-up")
    text = f"{header}\n\n{table(rows)}\n"
    print(text)
    write_atomic(args.out.with_suffix(".json"), json.dumps({"setup": header, "rows": rows}, indent=1))
    write_atomic(args.out.with_suffix(".md"), text)
    plot(rows, args.stages, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
