"""Throughput benchmark: tokens/s and MFU of a model's training step (forward, backward, AdamW).

Synthetic tokens, so it needs no data. On CPU the MFU denominator is a measured fp32 matmul peak
of this machine; on CUDA it is the data-sheet dense bf16 peak (``lab.accounting``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from lab import accounting
from lab.config import ConfigError, resolve
from lab.device import Precision, peak_flops, peak_memory_bytes, setup_device, synchronize
from lab.files import save_json
from lab.model import GPT
from lab.optim import param_groups


def bench_case(preset: str, vocab: int, micro_batch: int, steps: int, warmup: int, device: torch.device,
               bf16: bool, compile: bool) -> dict:
    cfg = resolve({"model": {"preset": preset, "vocab_size": vocab}}).model
    precision = Precision(device.type, bf16)
    with torch.device(device):
        model = GPT(cfg)
    if compile:
        model.compile()
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in g.names], "weight_decay": g.weight_decay}
              for g in param_groups(model, 0.1)]
    opt = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (micro_batch, cfg.block_size), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        t0 = time.perf_counter()
        with precision.autocast():
            loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_time, best = sorted(times)[len(times) // 2], min(times)
    tokens_per_s = micro_batch * cfg.block_size / step_time
    fpt = accounting.flops_per_token(cfg)
    peak = peak_flops(device, precision).flops
    return {"model": preset, "params": accounting.param_counts(cfg).total, "dtype": "bf16" if bf16 else "fp32",
            "compile": compile, "micro_batch": micro_batch, "seq_len": cfg.block_size, "step_time_s": step_time,
            "best_step_time_s": best, "tokens_per_s": tokens_per_s,
            "best_tokens_per_s": micro_batch * cfg.block_size / best, "model_flops_per_s": fpt * tokens_per_s, "peak_flops": peak,
            "mfu": fpt * tokens_per_s / peak, "mem_peak_bytes": peak_memory_bytes(device)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/bench.py", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per case (median and best reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.steps <= 0 or args.warmup < 0:
        print("error: --steps must be positive and --warmup >= 0", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        setup_device(device)
        cases = [("gpt2-124m", 50304, 16, True, False), ("gpt2-124m", 50304, 16, True, True)]
        where = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        cases = [("tiny", 4096, 16, False, False), ("tiny-modern", 4096, 16, False, False)]
        where = f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {where} | torch {torch.__version__} | median (and best) of {args.steps} steps after "
          f"{args.warmup} warm-up steps; peak in TFLOP/s")
    print(f"{'model':<12} {'params':>12} {'dtype':>5} {'compile':>7} {'batch×T':>9} {'step ms':>8} "
          f"{'tok/s':>10} {'TFLOP/s':>8} {'peak':>8} {'MFU':>6} {'best tok/s':>11} {'best MFU':>8}")
    results = []
    for preset, vocab, mb, bf16, comp in cases:
        try:
            r = bench_case(preset, vocab, mb, args.steps, args.warmup, device, bf16, comp)
        except ConfigError as e:
            print(f"error: {e}")
            return 2
        results.append(r)
        print(f"{preset:<12} {r['params']:>12,} {r['dtype']:>5} {str(comp):>7} {mb}×{r['seq_len']:<5} "
              f"{1e3 * r['step_time_s']:>8.1f} {r['tokens_per_s']:>10,.0f} {r['model_flops_per_s'] / 1e12:>8.3f} "
              f"{r['peak_flops'] / 1e12:>8.2f} {100 * r['mfu']:>5.1f}% {r['best_tokens_per_s']:>11,.0f} "
              f"{100 * r['mfu'] * r['best_tokens_per_s'] / r['tokens_per_s']:>7.1f}%")
    if args.json:
        save_json(args.json, {"device": where, "torch": torch.__version__, "results": results})
    return 0
