"""A context one process cannot hold, split over cp ranks: the memory check's verdicts and the peaks measured.

    python benchmarks/context/bench_context.py [--context 8192] [--budget-mib 48] [--steps 3]

A tiny model (2 layers, width 64, 4 heads, the bytes tokenizer on the built-in corpus) at a context of --context
tokens, one sequence per micro-step. First the start-of-run memory check under ``--train.memory_budget``: one process
is refused in one line, cp 4 admitted (``python -m lab train`` itself, nothing trained). Then it trains --steps steps
under cp 1, 2 and 4 (``--nproc-per-node``, ``ddp``, the ring with the balanced split) with every tensor allocation
tracked (``train.memory_meter``): per cp, rank 0's peak bytes of the backward (the activations' peak: the states of a
model this size are small beside them) against ``accounting.activation_peak_bytes`` plus the measured model states,
the key/value bytes the ring sent per step against theory, the attention work's largest over its mean, and the step
time. Writes ``context.md`` and ``context.json`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.measure import accounting
from lab.runtime.config import ModelConfig
from lab.runtime.files import write_atomic

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def lab_train(run_dir: Path, context: int, steps: int, ranks: int, extra: list[str]) -> subprocess.CompletedProcess:
    cp = ["--strategy", "ddp", "--parallel.cp", str(ranks)] if ranks > 1 else []
    argv = [sys.executable, "-m", "lab", "train", "--nproc-per-node", str(ranks), *cp,
            "--model.n_layer", "2", "--model.n_head", "4", "--model.d_model", "64", "--model.block_size", str(context),
            "--data.tokenizer", "bytes", "--train.micro_batch", "1", "--train.batch_tokens", str(context),
            "--train.tokens", str(context * steps), "--train.eval_every", "0", "--train.log_every", "1",
            "--train.checkpoint_every", "0", "--train.warmup", "0", "--run-dir", str(run_dir), *extra]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=3600)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--budget-mib", type=float, default=48.0, help="the memory budget of the check (MiB)")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    shape = ModelConfig(n_layer=2, n_head=4, d_model=64, block_size=args.context, vocab_size=256)
    budget = ["--train.memory_budget", str(args.budget_mib / 1024)]
    out: dict[str, object] = {"context": args.context, "budget_mib": args.budget_mib, "load_start": os.getloadavg()[0],
                              "date": time.strftime("%Y-%m-%d"), "checks": {}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (1, 4):  # the check alone: a run that would need more than the budget ends before any work
            done = lab_train(Path(tmp) / f"check-{ranks}", args.context, args.steps, ranks,
                             [*budget, "--train.stop_after", "1"])
            lines = done.stderr.strip().splitlines()
            out["checks"][ranks] = {"exit": done.returncode,
                                    "line": next((line for line in lines if line.startswith("error:")), "admitted")}
            print(f"cp {ranks} under {args.budget_mib:g} MiB: exit {done.returncode}: {out['checks'][ranks]['line']}",
                  flush=True)
        for ranks in (1, 2, 4):
            run = Path(tmp) / f"cp{ranks}"
            started = time.perf_counter()
            done = lab_train(run, args.context, args.steps, ranks, ["--train.memory_meter", "true"])
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            summary = json.loads((run / "summary.json").read_text())
            states = summary["model_state_bytes"]["total"]
            last = [r for r in records if "peak_bytes" in r][-1]
            theory = accounting.activation_peak_bytes(shape, 1, 4, cp=ranks) + states
            row = {"cp": ranks, "backward_peak": last["peak_bytes"]["backward"], "theory": theory, "states": states,
                   "step_s": last["step_time_s"], "wall_s": time.perf_counter() - started,
                   "kv_bytes": last.get("cp_kv_bytes"), "kv_bytes_theory": last.get("cp_kv_bytes_theory"),
                   "work_max_over_mean": last.get("cp_work_max_over_mean")}
            out["runs"].append(row)
            print(row, flush=True)
    out["load_end"] = os.getloadavg()[0]
    base = out["runs"][0]["backward_peak"]
    lines = [f"`python benchmarks/context/bench_context.py --context {args.context} --budget-mib {args.budget_mib:g} "
             f"--steps {args.steps}` on {out['date']}, {os.cpu_count()} cores, load {out['load_start']:.1f} at the "
             f"start and {out['load_end']:.1f} at the end.", "",
             f"The memory check under `--train.memory_budget` {args.budget_mib:g} MiB:", ""]
    lines += [f"- {'one process' if ranks == 1 else f'cp {ranks}'}: exit {c['exit']}, `{c['line']}`"
              for ranks, c in out["checks"].items()]
    lines += ["", "| cp | backward peak per rank (measured) | theory | measured / cp 1 | kv bytes per step | theory | "
              "work max / mean | step s |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["runs"]:
        kv = "-" if r["kv_bytes"] is None else f"{r['kv_bytes']:,}"
        kv_theory = "-" if r["kv_bytes_theory"] is None else f"{r['kv_bytes_theory']:,.0f}"
        work = "-" if r["work_max_over_mean"] is None else f"{r['work_max_over_mean']:.3f}"
        lines.append(f"| {r['cp']} | {r['backward_peak'] / 2**20:,.1f} MiB | {r['theory'] / 2**20:,.1f} MiB | "
                     f"{r['backward_peak'] / base:.3f} | {kv} | {kv_theory} | {work} | {r['step_s']:.2f} |")
    write_atomic(HERE / "context.md", "\n".join(lines) + "\n")
    write_atomic(HERE / "context.json", json.dumps(out, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
