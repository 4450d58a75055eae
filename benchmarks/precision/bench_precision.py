"""What the precision policies cost and what they change, on this machine's CPU.

    python benchmarks/precision/bench_precision.py [--seeds 1337,7,42,2024] [--strategies ddp,zero1,zero2,zero3,fsdp]

1. The demo (``configs/demo.toml``: the tiny GPT on the State of the Union corpus, 98 steps, one process) under fp32,
   bf16 autocast and the bf16 mixed policy (fp16 is left out: this CPU has no fast fp16 matmul), for each seed: the
   final held-out loss, the final train loss, tokens/s and the peak resident set; the bf16 mixed policy's held-out
   loss against fp32's of the same seed (the acceptance bound is 1 %), beside fp32's own spread between seeds.
2. Each data-parallel strategy on 2 gloo ranks for a few steps of the demo's shape under fp32 and the bf16 mixed
   policy: rank 0's model-state bytes (measured from its tensors) and bytes sent per step, each beside its theory,
   and the median step time.

Writes ``precision.json`` and ``precision.md`` beside this file, with the date and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.runtime.files import write_atomic

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
POLICIES = {"fp32": ["--train.dtype", "fp32"], "bf16 autocast": ["--train.dtype", "bf16"],
            "bf16 mixed": ["--train.dtype", "bf16", "--train.precision", "mixed"]}


def lab_train(run_dir: Path, extra: list[str], ranks: int = 1) -> dict:
    """``python -m lab train`` of the demo config with ``extra`` options; its summary and step records."""
    argv = [sys.executable, "-m", "lab", "train", "--config", "configs/demo.toml", "--run-dir", str(run_dir),
            "--train.checkpoint_every", "0", *(["--nproc-per-node", str(ranks)] if ranks > 1 else []), *extra]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "steps": [r for r in records if "loss" in r]}


def demo(tmp: Path, seeds: list[int]) -> list[dict]:
    rows = []
    for seed in seeds:
        for name, options in POLICIES.items():
            ran = lab_train(tmp / f"demo-{name.replace(' ', '-')}-{seed}", [*options, "--train.seed", str(seed)])
            s = ran["summary"]
            rows.append({"policy": name, "seed": seed, "final_eval_loss": s["final_eval_loss"],
                         "final_train_loss": s["final_train_loss"], "skipped_steps": s["skipped_steps"],
                         "loss_scale": s.get("loss_scale"), "wall_time_s": s["wall_time_s"],
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ran["steps"][1:]),
                         "mem_peak_bytes": max(r["mem_peak_bytes"] for r in ran["steps"])})
            print(f"demo {name} seed {seed}: held-out {s['final_eval_loss']:.4f}", flush=True)
    return rows


def strategies(tmp: Path, names: list[str], steps: int) -> list[dict]:
    rows = []
    tokens = ["--train.tokens", str(4096 * steps), "--train.eval_tokens", "4096", "--train.micro_batch", "8"]
    for strategy in names:
        for name in ("fp32", "bf16 mixed"):
            ran = lab_train(tmp / f"{strategy}-{name.replace(' ', '-')}", [*POLICIES[name], *tokens,
                                                                            "--strategy", strategy], ranks=2)
            s = ran["summary"]
            rows.append({"strategy": strategy, "policy": name, "params": s["params"],
                         "state_bytes": s["model_state_bytes"], "state_bytes_theory": s["model_state_bytes_theory"],
                         "comm_bytes": s["comm_bytes_per_step"], "comm_bytes_theory": s["comm_bytes_per_step_theory"],
                         "step_time_s": statistics.median(r["step_time_s"] for r in ran["steps"][1:])})
            print(f"{strategy} {name}: {sum(s['comm_bytes_per_step'].values()):,.0f} B/step", flush=True)
    return rows


def markdown(out: dict) -> str:
    lines = [f"# Precision policies on {out['machine']}", "",
             f"{out['date']}; load average {out['load_start']:.2f} at the start, {out['load_end']:.2f} at the end "
             f"(2 cores shared with other work: times are only indicative above a load of 3).", "",
             "## The demo (configs/demo.toml, one process)", "",
             "| policy | seed | held-out loss | vs fp32 (same seed) | train loss | skipped | tokens/s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|"]
    fp32 = {r["seed"]: r["final_eval_loss"] for r in out["demo"] if r["policy"] == "fp32"}
    for r in out["demo"]:
        lines.append(f"| {r['policy']} | {r['seed']} | {r['final_eval_loss']:.4f} | "
                     f"{r['final_eval_loss'] / fp32[r['seed']] - 1:+.2%} | {r['final_train_loss']:.4f} | "
                     f"{r['skipped_steps']} | {r['tokens_per_s']:,.0f} | {r['mem_peak_bytes'] / 2**20:,.0f} |")
    if len(fp32) > 1:
        values = list(fp32.values())
        lines += ["", f"fp32's own spread between seeds: {max(values) / min(values) - 1:.2%} of the held-out loss."]
    lines += ["", "## Two gloo ranks, rank 0 (bytes measured / theory)", "",
              "| strategy | policy | weights | gradients | optimizer | sent per step | step ms |",
              "|---|---|---|---|---|---|---|"]
    for r in out["strategies"]:
        held, theory = r["state_bytes"], r["state_bytes_theory"]
        cells = [f"{held[k]:,.0f} / {theory[k]:,.0f}" for k in ("params", "grads", "optimizer")]
        sent = f"{sum(r['comm_bytes'].values()):,.0f} / {sum(r['comm_bytes_theory'].values()):,.0f}"
        lines.append(f"| {r['strategy']} | {r['policy']} | {' | '.join(cells)} | {sent} | "
                     f"{1e3 * r['step_time_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1337,7,42,2024", help="comma-separated seeds of the demo runs")
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp")
    p.add_argument("--steps", type=int, default=10, help="steps of each two-rank run")
    args = p.parse_args(argv)
    from lab.measure.device import cpu_name

    out: dict[str, object] = {"machine": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "load_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        out["strategies"] = strategies(Path(tmp), args.strategies.split(","), args.steps)
        write_atomic(HERE / "precision.json", json.dumps(out, indent=1))  # kept if the demo runs fail
        out["demo"] = demo(Path(tmp), [int(s) for s in args.seeds.split(",")])
    out["load_end"] = os.getloadavg()[0]
    write_atomic(HERE / "precision.json", json.dumps(out, indent=1))
    write_atomic(HERE / "precision.md", markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
