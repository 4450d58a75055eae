"""Benchmarks that print figures: one process's training throughput, and strategies side by side.

    python launch/bench.py                          # tokens/s and MFU of the default models (CPU or CUDA)
    python launch/bench.py --strategies ddp_naive,ddp,torch_ddp --nproc 2 --out benchmarks/strategies/parallel
    python launch/bench.py --strategies single,single:activation_checkpointing=full --nproc 1 --preset tiny
    python launch/bench.py --measure-peak           # this CPU's matmul peak, measured again and cached
    python launch/bench.py --memory ddp,zero1,zero2,zero3 --nproc 2 --out benchmarks/memory/memory

Throughput: forward, backward and fused AdamW on synthetic tokens, as the lab's ``single`` strategy runs them under
a precision policy; the MFU denominator comes from ``lab.measure.device`` (a measured matmul peak on a CPU, the
data-sheet dense peak on a GPU).

Strategies: every strategy trains the same model on the same random batches on ``--nproc`` gloo
ranks, through the loop's ``train_step``; rounds interleave the strategies (a few steps of each,
again and again; round r starts at the (r mod k)-th of the k strategies, so each takes every place
in the order equally often) so that a noisy shared machine slows them alike. Per strategy: the
median step time, tokens/s, CPU time and minor page faults (rank 0's process, every thread: on a
shared machine the work a step costs, whatever else runs) over all timed steps; the ratio to
``torch_ddp``'s tokens/s, paired by round (each round's ratio compares steps taken seconds apart, so slow drifts of the
machine cancel), as the median over rounds with a 95 % bootstrap interval; the time a step waited on
communication (exposed); the bytes sent per step against theory; the model-state bytes per rank
against theory; and the activation bytes a micro-step saved for its backward. ``single`` runs on
rank 0 alone, the one-process baseline. ``--out`` writes a Markdown table, a JSON file and a PNG
plot.

Memory (``--memory``): each strategy trains issue 19's configuration (85M parameters, 5 steps) with
the lab's own command line under torchrun, one run after the other. Per run: the peak RSS of its
largest process as the kernel counts it (``wait4``'s ru_maxrss over the torchrun tree, nothing the
lab reports; the run ends with a checkpoint), rank 0's own high-water mark after the last step
(before that checkpoint), the run's ``peak_bytes`` per phase (measured by allocation, ``lab.measure.memory``)
beside ``peak_bytes_theory``, the median step time of the steps after the first, and the bytes sent
on the loopback interface while those steps ran (the counter rank 0 reads at the end of every step,
``machine_loopback_tx_bytes`` in its records: from the end of the first step to the end of the last) beside
the formula (every rank sends ``comm_bytes_per_step_theory``), with the interface's background rate
measured just before the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lab.measure import accounting
from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, resolve
from lab.measure.device import (
    Precision,
    cpu_name,
    describe,
    peak_flops,
    peak_memory_bytes,
    peak_main,
    setup_device,
    synchronize,
)
from lab.runtime.files import save_json, write_atomic
from lab.model import GPT
from lab.training.optim import adamw_factory, optimizer_factory, param_groups
from lab.parallel import LoopSettings, RunEngine, World, parse_spec
from lab.parallel.comm import loopback_tx_bytes
from lab.commands.ranks import RankFailed, run_ranks
from lab.training.plan import check_layout, create
from lab.training.train import train_step

# ---------------------------------------------------------------- one process: throughput


def bench_case(preset: str, vocab: int, micro_batch: int, steps: int, warmup: int, device: torch.device,
               precision: Precision, compile: bool) -> dict:
    """One model's training steps in this process under the lab's ``single`` strategy and ``precision`` (autocast
    over fp32 weights, or mixed: 16-bit weights beside fp32 masters): step time, tokens/s, MFU and this case's memory
    peak."""
    cfg = resolve({"model": {"preset": preset, "vocab_size": vocab}}).model
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # this case's peak, not the largest since the process started
    strategy = create(ParallelConfig(), World(rank=0, world_size=1, local_rank=0, device=device), precision,
                      LoopSettings(micro_batch=micro_batch, accum_steps=1, grad_clip=0.0, compile=compile))
    strategy.build(lambda: GPT(cfg), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), device))
    x = torch.randint(0, vocab, (micro_batch, cfg.block_size), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        t0 = time.perf_counter()
        strategy.backward(strategy.forward(x, x, sync=True))
        strategy.step(1e-4)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_time, best = statistics.median(times), min(times)
    tokens_per_s = micro_batch * cfg.block_size / step_time
    fpt = accounting.flops_per_token(cfg)
    peak = peak_flops(device, precision).flops
    return {"model": preset, "params": accounting.param_counts(cfg).total, "dtype": precision.dtype,
            "policy": "mixed" if precision.mixed else "autocast",
            "compile": compile, "micro_batch": micro_batch, "seq_len": cfg.block_size, "step_time_s": step_time,
            "best_step_time_s": best, "tokens_per_s": tokens_per_s,
            "best_tokens_per_s": micro_batch * cfg.block_size / best, "model_flops_per_s": fpt * tokens_per_s,
            "peak_flops": peak, "mfu": fpt * tokens_per_s / peak, "mem_peak_bytes": peak_memory_bytes(device)}


def throughput(steps: int, warmup: int, out: str | None) -> int:
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        setup_device(device)
        cases = [("gpt2-124m", 50304, 16, True, False), ("gpt2-124m", 50304, 16, True, True)]
    else:
        device = torch.device("cpu")
        cases = [("tiny", 4096, 16, False, False), ("tiny-modern", 4096, 16, False, False)]
    where = describe(device)
    print(f"device: {where} | torch {torch.__version__} | median (and best) of {steps} steps after "
          f"{warmup} warm-up steps; peak in TFLOP/s")
    print(f"{'model':<12} {'params':>12} {'dtype':>5} {'compile':>7} {'batch×T':>9} {'step ms':>8} "
          f"{'tok/s':>10} {'TFLOP/s':>8} {'peak':>8} {'MFU':>6} {'best tok/s':>11} {'best MFU':>8}")
    results = []
    for preset, vocab, mb, bf16, comp in cases:
        r = bench_case(preset, vocab, mb, steps, warmup, device, Precision(device.type, "bf16" if bf16 else "fp32"),
                       comp)
        results.append(r)
        print(f"{preset:<12} {r['params']:>12,} {r['dtype']:>5} {str(comp):>7} {mb}×{r['seq_len']:<5} "
              f"{1e3 * r['step_time_s']:>8.1f} {r['tokens_per_s']:>10,.0f} {r['model_flops_per_s'] / 1e12:>8.3f} "
              f"{r['peak_flops'] / 1e12:>8.2f} {100 * r['mfu']:>5.1f}% {r['best_tokens_per_s']:>11,.0f} "
              f"{100 * r['mfu'] * r['best_tokens_per_s'] / r['tokens_per_s']:>7.1f}%")
    if out:
        save_json(out, {"device": where, "torch": torch.__version__, "results": results})
    return 0


# ---------------------------------------------------------------- several ranks: strategies side by side

BENCH_MODEL = ModelConfig(n_layer=4, n_head=4, d_model=256, block_size=128, vocab_size=4096)


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table: a strategy and its [parallel] options, written ``name[:key=value,...]``, and
    ``+muon`` after them for Muon on the hidden matrices (else AdamW)."""

    label: str
    parallel: ParallelConfig
    optimizer: str = "adamw"

    @classmethod
    def parse(cls, text: str) -> Case:
        spec, plus, optimizer = text.partition("+")
        if plus and optimizer != "muon":
            raise ValueError(f"'{text}': the only optimizer a case names is +muon")
        return cls(text, parse_spec(spec), optimizer if plus else "adamw")


def model_fields(text: str) -> dict[str, int]:
    """``name=value,...`` of integer ModelConfig fields (argparse reports a ValueError as a bad argument)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = dict(item.split("=", 1) for item in text.split(",") if item)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown model field(s): {', '.join(unknown)}")
    return {name: int(value) for name, value in fields.items()}


def bench_loop(micro_batch: int, optimizer: str = "adamw") -> LoopSettings:
    """The loop every row runs: one micro-batch per step, clipping at 1."""
    return LoopSettings(micro_batch, accum_steps=1, grad_clip=1.0, optimizer=optimizer)


def _alone(case: Case, world: World) -> World:
    """``single`` runs on rank 0 alone (the others wait): the one-process baseline; with ``parallel.tp`` > 1 (the
    tensor-parallel group is the world) on every rank."""
    return World(0, 1, 0, world.device) if _one_process(case.parallel) else world


def _one_process(parallel: ParallelConfig) -> bool:
    return parallel.strategy == "single" and parallel.tp == 1


def _bench_strategies(world: World, cases: list[Case], shape: ModelConfig, micro_batch: int, steps: int,
                      rounds: int, warmup: int) -> list[dict]:
    precision, loop = Precision("cpu"), bench_loop(micro_batch)
    setup_device(world.device)  # as a run sets it up (on the CPU: freed blocks go back to the kernel)
    built = []
    for case in cases:
        w = _alone(case, world)
        if w.world_size == 1 and not world.is_main:
            built.append(None)
            continue
        s = create(case.parallel, w, precision, bench_loop(micro_batch, case.optimizer))
        muon = case.optimizer == "muon"
        s.build(lambda: GPT(shape, seed=0), lambda m: param_groups(m, 0.1, muon),
                optimizer_factory(TrainConfig(optimizer=case.optimizer), w.device))
        built.append(s)
    def replica_batch(s: RunEngine, case: Case) -> torch.Tensor:  # this rank's micro-batch: its replica's
        g = torch.Generator().manual_seed(s.mesh.layout.data_replica(_alone(case, world).rank)[0])
        return torch.randint(0, shape.vocab_size, (micro_batch, shape.block_size + 1), generator=g)

    times: dict[str, list[list[float]]] = {c.label: [[] for _ in range(rounds)] for c in cases}
    waits = {c.label: [] for c in cases}
    cpus = {c.label: [] for c in cases}
    page_faults = {c.label: [] for c in cases}
    muon_s = {c.label: [] for c in cases}  # Muon's orthogonalizations and their exchanges, per step
    pairs = list(zip(cases, built, strict=True))
    for r in range(-1, rounds):  # round -1 warms up
        first = max(r, 0) % len(pairs)
        for case, s in pairs[first:] + pairs[:first]:
            if s is None:  # single, on another rank
                dist.barrier()
                continue
            x = replica_batch(s, case)
            for _ in range(warmup if r < 0 else steps):
                t0, (cpu0, faults0) = time.perf_counter(), process_usage()
                train_step(s, _alone(case, world), [(x[:, :-1], x[:, 1:])], loop.accum_steps, 1e-4, loop.grad_clip)
                elapsed, (cpu, faults), meters = time.perf_counter() - t0, process_usage(), s.take_step_meters()
                if r >= 0:
                    times[case.label][r].append(elapsed)
                    waits[case.label].append(meters.comm_wait_s)
                    cpus[case.label].append(cpu - cpu0)
                    page_faults[case.label].append(faults - faults0)
                    muon_s[case.label].append(s.take_record().get("muon_s", 0.0))
            if _alone(case, world).world_size == 1 and world.world_size > 1:
                dist.barrier()
            if world.is_main and r >= 0:
                so_far = statistics.median(chain.from_iterable(times[case.label]))
                print(f"  round {r + 1}/{rounds}: {case.label:<24} {1e3 * so_far:8.1f} "
                      f"ms/step so far", flush=True)
    rows = []
    for case, s in zip(cases, built, strict=True):
        if s is None:
            continue
        step = statistics.median(chain.from_iterable(times[case.label]))
        tokens_per_step = micro_batch * shape.block_size * s.mesh.layout.dp
        rows.append({"label": case.label, "strategy": case.parallel.strategy, "step_time_s": step,
                     "tokens_per_s": tokens_per_step / step, "exposed_comm_s": statistics.median(waits[case.label]),
                     "cpu_time_s": statistics.median(cpus[case.label]),
                     "minor_faults": statistics.median(page_faults[case.label]),
                     "muon_s": statistics.median(muon_s[case.label]),
                     "round_tokens_per_s": [tokens_per_step / statistics.median(ts) for ts in times[case.label]],
                     **s.accounts.meters()})
    return rows


def process_usage() -> tuple[float, int]:
    """CPU seconds this process has used, every thread (the communication backend's included), user and system; and
    its minor page faults (first touches of fresh memory, each a trip into the kernel)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def paired_ratio(case: list[float], reference: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """Median over rounds of ``case[r] / reference[r]`` (tokens/s of one round each), with a 95 %
    percentile-bootstrap interval of that median (rounds resampled with replacement, fixed seed)."""
    ratios = np.array(case) / np.array(reference)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(ratios, size=(resamples, len(ratios))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(ratios)), float(low), float(high)


def add_ratios(rows: list[dict], reference: str = "torch_ddp") -> None:
    """Give every row ``vs_reference``: its paired tokens/s ratio to the ``reference`` row (absent: no ratios)."""
    ref = next((r for r in rows if r["label"] == reference), None)
    if ref is None:
        return
    for r in rows:
        median, low, high = paired_ratio(r["round_tokens_per_s"], ref["round_tokens_per_s"])
        r["vs_reference"] = {"reference": reference, "median": median, "ci95": [low, high]}


def add_muon_ratios(rows: list[dict]) -> None:
    """Give every ``+muon`` row ``vs_adamw``: its step time over the same case's under AdamW (a row without the
    suffix), paired by round, with a 95 % interval; and ``muon_share``, Muon's part of its step."""
    by_label = {r["label"]: r for r in rows}
    for r in rows:
        adamw = by_label.get(r["label"].removesuffix("+muon")) if r["label"].endswith("+muon") else None
        if adamw is not None:
            median, low, high = paired_ratio(adamw["round_tokens_per_s"], r["round_tokens_per_s"])
            r["vs_adamw"] = {"median": median, "ci95": [low, high]}
            r["muon_share"] = r["muon_s"] / r["step_time_s"]


def plot_strategies(rows: list[dict], path: Path) -> None:
    """Step time, model-state bytes per rank (measured bars, theory ticks) and saved activations, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y = list(range(len(rows)))
    fig, (time_ax, state_ax, act_ax) = plt.subplots(1, 3, figsize=(15, 0.45 * len(rows) + 2.4), sharey=True)
    time_ax.barh(y, [1e3 * r["step_time_s"] for r in rows], color="#4c78a8", label="step")
    time_ax.barh(y, [1e3 * r["exposed_comm_s"] for r in rows], color="#e45756", label="waiting on communication")
    time_ax.set_xlabel("step time, ms (median)")
    left = [0.0] * len(rows)
    for kind, color in (("params", "#72b7b2"), ("grads", "#f58518"), ("optimizer", "#54a24b")):
        values = [r["model_state_bytes"][kind] / 2**20 for r in rows]
        state_ax.barh(y, values, left=left, color=color, label=kind)
        left = [a + v for a, v in zip(left, values, strict=True)]
    state_ax.scatter([r["model_state_bytes_theory"]["total"] / 2**20 for r in rows], y, marker="|", s=300,
                     color="black", label="theory (ZeRO formulas)")
    state_ax.set_xlabel("model states per rank, MiB")
    act_ax.barh(y, [r["activation_saved_bytes"] / 2**20 for r in rows], color="#b279a2")
    act_ax.set_xlabel("activations saved for backward per micro-step, MiB")
    handles, labels = zip(*[hl for ax in (time_ax, state_ax) for hl in zip(*ax.get_legend_handles_labels())])
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    time_ax.set_yticks(y, [r["label"] for r in rows])
    time_ax.invert_yaxis()
    fig.tight_layout(rect=(0, 0.6 / (0.45 * len(rows) + 2.4), 1, 1))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def format_strategies(rows: list[dict]) -> str:
    lines = ["| strategy | step ms | CPU ms/step, rank 0 | tokens/s | vs torch_ddp (tokens/s): paired median "
             "[95 % interval] | exposed comm ms | comm MB/step: counted / theory "
             "| model states MB/rank: measured / theory | saved activations MB | page faults/step, rank 0 "
             "| pipeline: bubble by stage (theory) · activations in flight MB by stage (theory) "
             "| Muon: step time / AdamW's, paired [95 % interval] · its share of the step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:  # bytes over both axes of the mesh (tensor-parallel ones where parallel.tp > 1)
        counted = sum(r["comm_bytes_per_step"].values()) + sum(r.get("tp_comm_bytes_per_step", {}).values())
        theory = (sum(r["comm_bytes_per_step_theory"].values())
                  + sum(r.get("tp_comm_bytes_per_step_theory", {}).values()))
        vs = r.get("vs_reference")
        ratio = f"{vs['median']:.3f}× [{vs['ci95'][0]:.3f}, {vs['ci95'][1]:.3f}]" if vs else "-"
        lines.append(f"| {r['label']} | {1e3 * r['step_time_s']:.1f} | {1e3 * r['cpu_time_s']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {ratio} | "
                     f"{1e3 * r['exposed_comm_s']:.1f} | {counted / 1e6:.3f} / {theory / 1e6:.3f} | "
                     f"{r['model_state_bytes']['total'] / 1e6:.2f} / "
                     f"{r['model_state_bytes_theory']['total'] / 1e6:.2f} | "
                     f"{r['activation_saved_bytes'] / 1e6:.1f} | {r['minor_faults']:,.0f} | {_pipeline_cell(r)} | "
                     f"{_muon_cell(r)} |")
    return "\n".join(lines)


def _muon_cell(row: dict) -> str:
    """A Muon row's step time over its AdamW row's and the orthogonalizations' share of the step; else '-'."""
    vs = row.get("vs_adamw")
    if vs is None:
        return "-"
    return f"{vs['median']:.3f}× [{vs['ci95'][0]:.3f}, {vs['ci95'][1]:.3f}] · {row['muon_share']:.1%}"


def _pipeline_cell(row: dict) -> str:
    """A pipelined row's measured bubble and activations in flight per stage, each beside its theory; else '-'."""
    if "pp_bubble" not in row:
        return "-"
    bubble = "/".join(f"{100 * b:.0f}%" for b in row["pp_bubble"])
    held = "/".join(f"{b / 1e6:.2f}" for b in row["pp_in_flight_bytes"])
    theory = "/".join(f"{b / 1e6:.2f}" for b in row["pp_in_flight_bytes_theory"])
    return f"{bubble} ({100 * row['pp_bubble_theory']:.0f}%) · {held} ({theory})"


def strategies(args: argparse.Namespace) -> int:
    try:
        text = args.strategies.strip()
        cases = [Case.parse(t) for t in (text.split() if any(c.isspace() for c in text) else text.split(",")) if t]
        for case in cases:
            check_layout(case.parallel, 1 if _one_process(case.parallel) else args.nproc,
                         bench_loop(args.micro_batch, case.optimizer))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shape = (resolve({"model": {"preset": args.preset, "vocab_size": BENCH_MODEL.vocab_size}}).model if args.preset
             else dataclasses.replace(BENCH_MODEL, d_model=args.d_model, **args.model))
    params = accounting.param_counts(shape).total
    load = os.getloadavg()[0]
    header = (f"{args.nproc} gloo ranks on {cpu_name()} ({os.cpu_count()} cores), 1 thread each | torch "
              f"{torch.__version__} | model d={shape.d_model} L={shape.n_layer} T={shape.block_size} "
              f"V={shape.vocab_size} ({params:,} params), fp32, micro-batch {args.micro_batch} per rank | median of "
              f"{args.rounds} rounds × {args.steps} steps, strategies interleaved, order rotated each round | "
              f"load average at start {load:.2f}")
    print(header, flush=True)
    try:
        rows = run_ranks(_bench_strategies, args.nproc, cases, shape, args.micro_batch, args.steps, args.rounds,
                         args.warmup, deadline_s=3600)[0]
    except RankFailed as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    add_ratios(rows)
    add_muon_ratios(rows)
    table = format_strategies(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        write_atomic(out.with_suffix(".md"), f"# Strategies side by side\n\n{stamp}: `python launch/bench.py "
                                             f"{' '.join(sys.argv[1:])}`\n\n{header}\n\n{table}\n")
        save_json(out.with_suffix(".json"), {"header": header, "date": stamp, "rows": rows})
        plot_strategies(rows, out.with_suffix(".png"))
    return 0


# ---------------------------------------------------------------- separate runs: memory at the peak

# issue 19's configuration: 85M parameters, micro-batch 1 of 64 bytes per rank, 5 steps; one checkpoint, at the end
MEMORY_RUN = ("--model.n_layer", "12", "--model.d_model", "768", "--model.n_head", "12", "--model.block_size", "64",
              "--data.tokenizer", "bytes", "--train.micro_batch", "1", "--train.batch_tokens", "128",
              "--train.tokens", "640", "--train.log_every", "1", "--train.eval_tokens", "128",
              "--train.checkpoint_every", "0", "--train.memory_meter", "true")
RUN_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "run.py"
BACKGROUND_S = 2.0  # the loopback's own traffic (other processes) is read this long before each run


def _step_records(path: Path) -> list[dict]:
    """The step records of a run's metrics.jsonl."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [record for record in map(json.loads, lines) if "loss" in record]


def memory_run(strategy: str, nproc: int, run_dir: Path, extra: list[str]) -> dict:
    """Train under torchrun with the lab's command line; the kernel's peak RSS of the largest process, the loopback
    bytes of the timed steps (all but the first: the counter rank 0 read at the end of the first step and of the
    last), and the run's own figures (see the module docstring)."""
    before = loopback_tx_bytes()
    time.sleep(BACKGROUND_S)
    after = loopback_tx_bytes()
    argv = [sys.executable, "-m", "lab.runtime.loopback", "--standalone", f"--nproc_per_node={nproc}",
            str(RUN_SCRIPT), "--strategy", strategy, *MEMORY_RUN, *extra, "--run-dir", str(run_dir)]
    with open(run_dir.with_name(run_dir.name + ".log"), "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    records = _step_records(run_dir / "metrics.jsonl")
    if proc.returncode != 0 or len(records) < 2:
        lines = Path(log.name).read_text().strip().splitlines()
        cause = [line for line in lines if "Error" in line or line.startswith("error:")][-1:] or lines[-1:]
        raise RuntimeError(f"{strategy}: the run exited with {proc.returncode} after {len(records)} step(s): {cause}")
    summary = json.loads((run_dir / "summary.json").read_text())
    sent = [r["machine_loopback_tx_bytes"] for r in (records[0], records[-1])]
    timed = records[1:]
    loopback = None if None in (before, after, *sent) else {
        "bytes_per_step": (sent[1] - sent[0]) / len(timed), "seconds": sum(r["step_time_s"] for r in timed),
        "background_bytes_per_s": (after - before) / BACKGROUND_S,
        "formula_bytes_per_step": nproc * sum(summary["comm_bytes_per_step_theory"].values())}
    return {"strategy": strategy, "rss_peak_bytes": usage.ru_maxrss * 1024,
            "rss_steps_bytes": records[-1]["peak_bytes"]["rss"],  # rank 0's VmHWM after the last step
            "peak_bytes": summary["peak_bytes"], "peak_bytes_theory": summary["peak_bytes_theory"],
            "step_time_s": statistics.median(r["step_time_s"] for r in timed), "loopback": loopback,
            "comm_bytes_per_step": summary["comm_bytes_per_step"],
            "model_state_bytes": summary["model_state_bytes"], "params": summary["params"]}


def format_memory(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["strategy"] == "ddp"), rows[0])
    mib = 2**20
    lines = [f"| strategy | peak RSS MiB, largest rank (vs {ref['strategy']}) | RSS MiB after the steps, rank 0 "
             f"(vs {ref['strategy']}) | peak bytes MiB forward / backward / "
             f"step: measured vs theory | step s, median (vs {ref['strategy']}) | loopback MB/step: measured / "
             f"formula (background MB/s) |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        measured, theory, lo = r["peak_bytes"], r["peak_bytes_theory"], r["loopback"]
        phases = " / ".join(f"{measured[p] / mib:,.0f} vs {theory[p] / mib:,.0f} ({measured[p] / theory[p] - 1:+.0%})"
                            for p in ("forward", "backward", "step"))
        sent = "-" if lo is None else (f"{lo['bytes_per_step'] / 1e6:,.1f} / {lo['formula_bytes_per_step'] / 1e6:,.1f} "
                                       f"({lo['background_bytes_per_s'] / 1e6:.2f})")
        lines.append(f"| {r['strategy']} | {r['rss_peak_bytes'] / mib:,.0f} "
                     f"({r['rss_peak_bytes'] / ref['rss_peak_bytes']:.2f}×) | {r['rss_steps_bytes'] / mib:,.0f} "
                     f"({r['rss_steps_bytes'] / ref['rss_steps_bytes']:.2f}×) | {phases} | {r['step_time_s']:.2f} "
                     f"({r['step_time_s'] / ref['step_time_s']:.2f}×) | {sent} |")
    return "\n".join(lines)


def memory(args: argparse.Namespace) -> int:
    strategies = [t for t in args.memory.split(",") if t]
    try:
        for name in strategies:
            check_layout(ParallelConfig(strategy=name), args.nproc, bench_loop(1))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    header = (f"{args.nproc} gloo ranks under torchrun on {cpu_name()} ({os.cpu_count()} cores), no GPU | torch "
              f"{torch.__version__} | `launch/run.py {' '.join(MEMORY_RUN + tuple(args.run_args.split()))}` | "
              f"load average at start {os.getloadavg()[0]:.2f}")
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as runs:
        for name in strategies:
            try:
                rows.append(memory_run(name, args.nproc, Path(runs) / name, args.run_args.split()))
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(f"  {name}: peak RSS {rows[-1]['rss_peak_bytes'] / 2**20:,.0f} MiB", flush=True)
    table = format_memory(rows)
    print(table)
    if args.out:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        write_atomic(Path(args.out).with_suffix(".md"), f"# Memory at the peak\n\n{stamp}: `python launch/bench.py "
                                                        f"{' '.join(sys.argv[1:])}`\n\n{header}\n\n{table}\n")
        save_json(Path(args.out).with_suffix(".json"), {"header": header, "date": stamp, "rows": rows})
    return 0


def main(argv: list[str] | None = None, prog: str = "launch/bench.py") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per case (per round with --strategies)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--strategies", help="compare these strategies, e.g. ddp_naive,ddp,torch_ddp or "
                                        "ddp:bucket_mb=1 (name[:option=value,...]); space-separated when a spec "
                                        "has several options ('zero3 deepspeed:zero_stage=3,offload=optimizer'); "
                                        "+muon after a spec: Muon on the hidden matrices (zero2+muon)")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks for --strategies")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds for --strategies")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step for --strategies")
    p.add_argument("--d-model", type=int, default=BENCH_MODEL.d_model, help="width of the --strategies model")
    p.add_argument("--preset", help="a model preset for --strategies instead (tiny is the demo model), vocab 4096")
    p.add_argument("--model", type=model_fields, default={}, help="--strategies model fields, e.g. n_layer=12,"
                                                                  "n_head=12,block_size=64,vocab_size=256")
    p.add_argument("--out", help="write the results here (JSON; with --strategies also Markdown)")
    p.add_argument("--memory", help="train issue 19's 85M configuration under torchrun once per strategy, e.g. "
                                     "ddp,zero2,zero3: peak RSS, peak bytes against theory, step time, loopback bytes")
    p.add_argument("--run-args", default="", help="with --memory: more launch/run.py options (they override)")
    p.add_argument("--measure-peak", action="store_true", help="measure this CPU's matmul peak again (10 s per dtype; "
                                                               "do it on a quiet machine) and keep the best figure")
    args = p.parse_args(argv)
    if args.measure_peak:
        return peak_main(["--remeasure"])
    if args.steps <= 0 or args.warmup < 0 or args.nproc < 1 or args.rounds < 1 or args.micro_batch < 1:
        print("error: --steps, --nproc, --rounds and --micro-batch must be positive and --warmup >= 0",
              file=sys.stderr)
        return 2
    if args.memory:
        return memory(args)
    if args.strategies:
        return strategies(args)
    return throughput(args.steps, args.warmup, args.out)


if __name__ == "__main__":
    sys.exit(main())
