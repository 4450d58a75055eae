"""What only a CUDA GPU shows, in one command (``make bench-gpu``; under 10 minutes on one H100).

- Throughput, MFU and the allocator's peak of GPT-2 124M under bf16 autocast (fp32 weights) and under the bf16
  mixed policy (bf16 weights, fp32 masters: ``train.precision mixed``), eager and compiled
  (``lab.commands.bench.bench_case``: synthetic tokens, fused AdamW, the data-sheet dense bf16 peak as the MFU
  denominator).
- The lab's own command line under torchrun on the GPU, per strategy (``ddp``, ``zero3``) and policy, at a realistic
  batch (8 sequences of 1,024 tokens a step, issue 19's 85M model): NCCL collectives, the CUDA allocator's peak bytes
  per phase (forward, backward, step) beside theory, the bytes each collective sent, and the median step time; then
  zero3's step time over ddp's under each policy.

Results go to ``--out`` (a JSON file and a Markdown table beside it), the device named in both. Without
a CUDA GPU it says so in one line and exits 2: CI never needs one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from lab.commands.bench import bench_case, memory_run
from lab.runtime.config import print_error
from lab.measure.device import Precision, describe, setup_device
from lab.runtime.files import save_json, write_atomic

STRATEGIES = ("ddp", "zero3")
POLICIES = {"autocast": [], "mixed": ["--train.precision", "mixed"]}
# issue 19's model at a realistic batch: 8 sequences of 1,024 tokens, 12 steps
CUDA_RUN = ["--train.device", "cuda", "--train.dtype", "bf16", "--model.block_size", "1024", "--train.micro_batch",
            "8", "--train.batch_tokens", "8192", "--train.tokens", str(12 * 8192), "--train.eval_tokens", "8192"]


def strategy_runs(run_options: list[str], backend: str) -> tuple[dict[str, dict], dict[str, float]]:
    """Each strategy under each policy, through the lab's command line under torchrun with ``run_options`` (one
    process); the runs by "strategy policy", and zero3's median step time over ddp's under each policy."""
    runs, ratios = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy, options in POLICIES.items():
            for strategy in STRATEGIES:
                name = f"{strategy} {policy}"
                runs[name] = memory_run(strategy, 1, Path(tmp) / f"{strategy}-{policy}", [*run_options, *options])
                print(f"{name} under torchrun ({backend}): {1e3 * runs[name]['step_time_s']:.1f} ms/step, peak "
                      f"bytes {runs[name]['peak_bytes']}", flush=True)
            ratios[policy] = runs[f"zero3 {policy}"]["step_time_s"] / runs[f"ddp {policy}"]["step_time_s"]
            print(f"zero3 / ddp step time under {policy}: {ratios[policy]:.3f}x", flush=True)
    return runs, ratios


def measure(steps: int, warmup: int) -> dict:
    """Every figure of the module docstring, on CUDA device 0."""
    device = torch.device("cuda", 0)
    setup_device(device)
    where = describe(device)
    print(f"device: {where} | torch {torch.__version__}", flush=True)
    throughput = []
    for policy in POLICIES:
        for compiled in (False, True):
            precision = Precision(device.type, "bf16", mixed=policy == "mixed")
            row = bench_case("gpt2-124m", 50304, 16, steps, warmup, device, precision, compile=compiled)
            print(f"gpt2-124m bf16 {policy} compile={compiled}: {row['tokens_per_s']:,.0f} tokens/s, MFU "
                  f"{100 * row['mfu']:.1f} %, allocator peak {row['mem_peak_bytes'] / 2**30:.2f} GiB", flush=True)
            throughput.append(row)
    runs, ratios = strategy_runs(CUDA_RUN, "NCCL")
    return {"device": where, "torch": torch.__version__, "throughput": throughput, "runs": runs,
            "zero3_over_ddp_step_time": ratios}


def markdown(results: dict) -> str:
    lines = [f"# GPU benchmark: {results['device']}", "", f"torch {results['torch']}", "",
             "| model | policy | compile | tokens/s | MFU | allocator peak (GiB) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dtype']} {r['policy']} | {r['compile']} | {r['tokens_per_s']:,.0f} | "
              f"{100 * r['mfu']:.1f} % | {r['mem_peak_bytes'] / 2**30:.2f} |" for r in results["throughput"]]
    lines += ["", "| strategy (torchrun, NCCL) | step ms (median) | allocator peak MiB forward / backward / step: "
              "measured vs theory |", "|---|---|---|"]
    mib = 2**20
    for name, r in results["runs"].items():
        measured, theory = r["peak_bytes"], r["peak_bytes_theory"]
        phases = " / ".join(f"{measured[p] / mib:,.0f} vs {theory[p] / mib:,.0f} ({measured[p] / theory[p] - 1:+.0%})"
                            for p in theory)
        lines.append(f"| {name} | {1e3 * r['step_time_s']:.1f} | {phases} |")
    lines += [""] + [f"zero3 / ddp step time under {policy}: {ratio:.3f}x"
                     for policy, ratio in results["zero3_over_ddp_step_time"].items()] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m lab bench-gpu") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default="benchmarks/gpu/results.json", help="the JSON file (a .md table beside it)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per throughput case")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print_error("bench-gpu needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False)")
        return 2
    results = measure(args.steps, args.warmup)
    out = Path(args.out)
    save_json(out, results)
    write_atomic(out.with_suffix(".md"), markdown(results))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
