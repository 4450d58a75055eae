"""Plan a training run on paper: time from compute, memory from model states and activations.

    python launch/plan.py time --params 70e9 --tokens 15e12 --gpu H100 --n-gpus 1024 --mfu 0.5
    python launch/plan.py memory --gpu H100 --n-gpus 8 [--micro-batch 8 --seq-len 2048 --d-model 8192 --n-head 64]
    python launch/plan.py mesh --preset llama3-70b --n-gpus 1024 --compare 8x16
    python launch/plan.py peaks
    python launch/plan.py model --preset small-modern --vocab 4096 --moe-experts 8 --moe-top-k 2 [--tokens 1e9]

All arithmetic is ``lab.measure.accounting``; this module parses, checks and prints. Units: GB = 1e9 bytes,
B = 1e9 parameters, T = 1e12 tokens. Bad input prints one ``error: ...`` line and exits with 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from lab.measure import accounting, fits, hardware, layouts
from lab.runtime.config import ModelConfig, Parser, UsageExit


class PlanError(Exception):
    """Input the planner cannot use; the message is one line."""


# ---------------------------------------------------------------- argument types


def _number(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got '{text}'")
    return x


def _positive(text: str) -> float:
    x = _number(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return x


def _count(text: str) -> int:
    x = _positive(text)
    if x != int(x):
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text}")
    return int(x)


def _fraction(text: str) -> float:
    x = _number(text)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return x


def _share(text: str) -> float:
    x = _number(text)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return x


def _tp_by_pp(text: str) -> tuple[int, int]:
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected TPxPP such as 8x16, got '{text}'")
    return _count(parts[0]), _count(parts[1])


def _gpu(text: str) -> str:
    try:
        return hardware.gpu_model(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---------------------------------------------------------------- formatting


def _si(x: float, units: Sequence[tuple[float, str]]) -> str:
    """``x`` with the largest unit it reaches, two decimals (``_si(7e10, _COUNT)`` → '70.00 B')."""
    for scale, unit in units:
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}".rstrip()
    return f"{x:g}"


_COUNT = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"), (1.0, ""))


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Aligned columns: the first ``left`` columns flush left, the others (numbers) flush right."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


# ---------------------------------------------------------------- subcommands


def _time(args: argparse.Namespace) -> str:
    flops = accounting.training_flops(args.params, args.tokens)
    peak = hardware.gpu_peak_flops(args.gpu)
    seconds = hardware.training_seconds(flops, args.gpu, args.n_gpus, args.mfu)
    achieved = args.n_gpus * peak * args.mfu
    rows = [
        ["model", f"{_si(args.params, _COUNT)} params"],
        ["data", f"{_si(args.tokens, _COUNT)} tokens"],
        ["compute", f"6·N·D = {flops:.3e} FLOPs"],
        ["hardware", f"{args.n_gpus} × {args.gpu} at {peak / 1e12:g} TFLOP/s dense bf16 peak"],
        ["throughput", f"{args.mfu:.1%} MFU → {achieved:.3e} FLOP/s"],
        ["GPU-hours", f"{args.n_gpus * seconds / 3600:,.0f}"],
        ["wall clock", _wall_clock(seconds)],
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


_SHAPE = ("micro_batch", "seq_len", "d_model", "n_head")


def _shape(args: argparse.Namespace) -> ModelConfig | None:
    """The width/batch shape from the command line, or None when none of it was given."""
    given = [name for name in _SHAPE if getattr(args, name) is not None]
    if not given:
        return None
    if len(given) < len(_SHAPE):
        raise PlanError("a shape needs --micro-batch, --seq-len, --d-model and --n-head together")
    if args.d_model % args.n_head:
        raise PlanError(f"--n-head ({args.n_head}) must divide --d-model ({args.d_model})")
    return ModelConfig(arch=args.arch, n_layer=1, n_head=args.n_head, d_model=args.d_model,
                       block_size=args.seq_len, vocab_size=args.vocab)


def _memory(args: argparse.Namespace) -> str:
    memory = args.memory_gb * 1e9 if args.memory_gb else hardware.gpu_memory_bytes(args.gpu)
    shape = _shape(args)
    lines = [f"model states per GPU on {args.n_gpus} × {args.gpu} ({_gb(memory)} each, "
             f"{args.usable:.0%} usable); GB = 1e9 bytes, B = 1e9 params, Ψ = params"]
    header = ["strategy", "precision", "GPU B/param"]
    if args.offload:
        header.append("host B/param")
    header += ["comm/step", "largest model"]
    if shape is not None:
        one, two = (accounting.activation_bytes(replace(shape, n_layer=n), args.micro_batch,
                                                checkpointing=args.checkpointing, flash=not args.naive_attention)
                    for n in (1, 2))
        fixed = "logits and one recomputed layer" if args.checkpointing else "logits"
        lines.append(f"activations ({'naive' if args.naive_attention else 'flash'} attention, "
                     f"{'full checkpointing' if args.checkpointing else 'no checkpointing'}): "
                     f"micro-batch {args.micro_batch} × {args.seq_len} tokens, {args.arch} d_model {args.d_model}, "
                     f"{args.n_head} heads, vocab {args.vocab}: {_gb(two - one)} per layer + {_gb(2 * one - two)} "
                     f"({fixed})")
        header += ["layers", "params", "GB/GPU"]
    rows = []
    for strategy in accounting.STRATEGIES:
        for precision in args.precision or accounting.PRECISIONS:
            per_param = accounting.model_state_bytes(1.0, strategy, args.n_gpus, precision, args.offload,
                                                     args.muon_share)
            row = [strategy, precision, f"{per_param.gpu:.4g}"]
            if args.offload:
                row.append(f"{per_param.cpu:.4g}")
            row.append(f"{accounting.comm_elements_per_step(1.0, strategy, args.n_gpus):.4g}Ψ")
            row.append(_si(fits.largest_model(memory, args.n_gpus, strategy, precision, args.usable,
                                                    args.offload, args.muon_share), _COUNT))
            if shape is not None:
                fit = fits.largest_depth(shape, args.micro_batch, memory, args.n_gpus, strategy, precision,
                                               args.usable, args.offload, checkpointing=args.checkpointing,
                                               flash=not args.naive_attention, one_moment=args.muon_share)
                row += ["-", "-", "-"] if fit is None else [
                    str(fit.n_layer), _si(fit.params, _COUNT), f"{fit.gpu_bytes / 1e9:.2f}"]
            rows.append(row)
    lines.append(_table(header, rows, left=2))
    lines.append("mixed: 2 B weights + 2 B grads + 12 B fp32 master/moments (Rajbhandari et al. 2019), what a run "
                 "with --train.precision mixed holds (ddp, zero1-3; fsdp keeps fp32 shards: its fp32 row); fp32: 4 + 4 "
                 "+ 8, --train.precision autocast (bf16 autocast adds 16-bit copies of the weights in the forward); "
                 "comm/step: elements each rank sends per step in a ring (2 B each under mixed), Ψ = params")
    if args.muon_share:
        lines.append(f"optimizer: Muon on {args.muon_share:.0%} of Ψ (one fp32 moment, 4 B fewer each), AdamW on the "
                     "rest (docs/optimizers.md)")
    if shape is not None:
        lines.append("layers: deepest model at this width whose states + activations fit; '-': not even one layer")
    return "\n".join(lines)


def _mesh_shape(args: argparse.Namespace) -> ModelConfig:
    from lab.runtime.config import ConfigError, resolve

    try:
        cfg = resolve({"model": {"preset": args.preset, **({"vocab_size": args.vocab} if args.vocab else {})}}).model
    except ConfigError as e:
        raise PlanError(str(e)) from None
    if cfg.vocab_size is None:
        raise PlanError(f"preset '{args.preset}' names no vocabulary; give --vocab")
    return replace(cfg, block_size=args.seq_len or cfg.block_size)


def _cluster(args: argparse.Namespace) -> layouts.Cluster:
    memory = (args.memory_gb * 1e9 if args.memory_gb else hardware.gpu_memory_bytes(args.gpu)) * args.usable
    return layouts.Cluster(args.gpu, args.n_gpus, args.gpus_per_node, memory, args.intra_gbps * 1e9,
                           args.inter_gbps * 1e9, args.mfu)


def _layout_row(r: layouts.LayoutCost, cp: bool) -> list[str]:
    return [r.name, r.stage, str(r.microbatches), _gb(r.states), _gb(r.activations), _gb(r.memory),
            "yes" if r.fits else "no", *(f"{t:.3f}" for t in r.terms(cp).values()), f"{r.step_s:.3f}"]


def _versus(other: layouts.LayoutCost, choice: layouts.LayoutCost) -> str:
    """How ``other`` differs from the choice: memory, and each term of the step that moves by 1 % of it or more."""
    moved = [f"{name} {theirs - ours:+.3f} s" for (name, theirs), ours in zip(other.terms().items(),
                                                                             choice.terms().values())
             if abs(theirs - ours) >= 0.01 * choice.step_s]
    return (f"{other.name}, {other.stage}: {other.step_s:.3f} s per step against {choice.step_s:.3f} s "
            f"({other.step_s / choice.step_s - 1:+.0%}: {', '.join(moved) or 'no term moves by 1 %'}); "
            f"{_gb(other.memory)} per GPU against {_gb(choice.memory)}"
            f"{'' if other.fits else ' (does not fit)'}" + (
                f"; {other.microbatches} micro-batches per replica, so a bubble of (p − 1)/m = "
                f"{(other.pp - 1) / other.microbatches:.1%} of the compute" if other.pp > 1 else ""))


def _mesh(args: argparse.Namespace) -> str:
    """Every tp × cp × pp × dp layout and data-parallel stage for the model on ``--n-gpus``, with memory per GPU and a
    step's time by cause (``lab.measure.layouts``); the choice is the fastest layout that fits."""
    cfg = _mesh_shape(args)
    cluster = _cluster(args)
    rows, refused = layouts.layouts(cfg, args.micro_batch, args.batch_tokens, cluster, args.checkpointing, args.max_cp)
    context = ""
    if not any(r.fits for r in rows) and args.max_cp == 1:  # the sequence itself may be what does not fit
        rows, refused = layouts.layouts(cfg, args.micro_batch, args.batch_tokens, cluster, args.checkpointing,
                                        cluster.gpus_per_node)
        context = ("nothing fits without splitting the sequence: context parallelism (cp, the ring within a node) "
                   "priced too")
    with_cp = any(r.cp > 1 for r in rows)
    params = accounting.param_counts(cfg).total
    rows.sort(key=lambda r: (not r.fits, r.step_s))
    shown = rows if args.show == 0 else rows[:args.show]
    lines = [f"{args.preset}: {params / 1e9:,.2f}B params, {cfg.n_layer} layers; steps of {args.batch_tokens:,.0f} "
             f"tokens in micro-batches of {args.micro_batch} × {cfg.block_size}; {args.n_gpus} × {args.gpu} "
             f"({_gb(cluster.memory)} usable each, {args.gpus_per_node} per node) at {args.mfu:.0%} MFU, "
             f"{args.intra_gbps:g} GB/s within a node and {args.inter_gbps:g} GB/s between nodes; bf16 with fp32 "
             f"master weights (16 B/param), 1F1B, tp with sequence parallelism. Seconds per step by cause, on paper "
             f"(lab/measure/layouts.py); 'dp exposed' is the data-parallel traffic the backward does not hide",
             *([context] if context else []),
             _table(["layout", "stage", "m", "states", "activations", "total", "fits", "compute", "bubble", "tp",
                     *(["cp"] if with_cp else []), "pp", "dp exposed", "step s"],
                    [_layout_row(r, with_cp) for r in shown], left=2)]
    if len(shown) < len(rows):
        lines.append(f"... and {len(rows) - len(shown)} slower or not fitting (--show 0 lists all)")
    lines += [f"not possible: {r}" for r in refused]
    choice = layouts.choose(rows)
    if choice is None:
        raise PlanError(f"no layout of {args.n_gpus} × {args.gpu} holds {args.preset} at micro-batch "
                        f"{args.micro_batch}; lower --micro-batch, add --checkpointing or more GPUs")
    options = " ".join(f"--parallel.{axis} {n}" for axis, n in (("tp", choice.tp), ("cp", choice.cp),
                                                                  ("pp", choice.pp)) if n > 1)
    lines.append(f"choice: {choice.name}, {choice.stage} ({options + ' ' if options else ''}--strategy "
                 f"{choice.stage}): the fastest layout that fits, {choice.step_s:.3f} s per step, "
                 f"{_gb(choice.memory)} per GPU")
    same_tp_pp = [r for r in rows if (r.tp, r.pp) == (choice.tp, choice.pp) and r.stage != choice.stage]
    simpler = [r for r in rows if r.fits and (r.tp, r.pp) != (choice.tp, choice.pp) and r.tp <= choice.tp
               and r.pp <= choice.pp]
    why = [f"  beside {_versus(min(simpler, key=lambda r: r.step_s), choice)}"] if simpler else []
    if (choice.tp, choice.pp) != (1, 1) and not any(r.fits for r in rows if r.tp < choice.tp or r.pp < choice.pp):
        why.append("  no layout with less tensor or pipeline parallelism fits")
    if same_tp_pp and not any(r.fits for r in same_tp_pp if accounting.STRATEGIES.index(r.stage)
                              < accounting.STRATEGIES.index(choice.stage)):
        why.append(f"  no lower data-parallel stage fits at {choice.name}")
    if args.compare:
        tp, pp = args.compare
        named = [r for r in rows if (r.tp, r.pp) == (tp, pp)]
        if not named:
            raise PlanError(f"--compare tp {tp} × pp {pp} is not a layout of {args.preset} on {args.n_gpus} GPUs")
        why.append(f"  compared: {_versus(min(named, key=lambda r: (not r.fits, r.step_s)), choice)}")
    if args.critical_batch:
        ratio = args.batch_tokens / args.critical_batch
        why.append(f"critical batch {args.critical_batch:,.0f} tokens: a step of {args.batch_tokens:,.0f} is "
                   f"{ratio:.3g} B_crit, so a loss takes {1 + 1 / ratio:.3g} x the fewest steps and {1 + ratio:.3g} x "
                   f"the fewest tokens (McCandlish et al. 2018; "
                   + ("near-linear: within twice the fewest tokens)" if ratio <= 1 else
                      "beyond it more GPUs buy less time than they cost)"))
    return "\n".join(lines + why)


def _model(args: argparse.Namespace) -> str:
    """A preset's parameters, total and active, and FLOPs per token on the active path; with --tokens, the
    training FLOPs and time at the MFU given (MFU on active FLOPs)."""
    cfg = replace(_mesh_shape(args), moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                  moe_granularity=args.moe_granularity, moe_shared_experts=args.moe_shared_experts)
    problem = accounting.moe_shape_problem(cfg)
    if problem is not None:
        raise PlanError(problem)
    counts, fpt = accounting.param_counts(cfg), accounting.flops_per_token(cfg)
    every = fpt + 6.0 * counts.inactive
    rows = [["params (total)", f"{counts.total:,}"], ["params (active per token)", f"{counts.active:,}"],
            ["non-embedding (total)", f"{counts.non_embedding:,}"],
            ["FLOPs per token (active path, router included)", f"{fpt:.4g}"]]
    if cfg.moe_experts:
        rows += [["FLOPs per token if every expert ran", f"{every:.4g}"],
                 ["experts", f"{cfg.moe_experts} routed (top {cfg.moe_top_k}) of width "
                             f"{accounting.expert_width(cfg)}, {cfg.moe_shared_experts} shared"]]
    if args.tokens:
        flops = fpt * args.tokens
        seconds = hardware.training_seconds(flops, args.gpu, args.n_gpus, args.mfu)
        rows += [["training FLOPs (active)", f"{flops:.4g}"],
                 [f"wall clock on {args.n_gpus} × {args.gpu} at {args.mfu:.0%} MFU (active FLOPs)",
                  _wall_clock(seconds)]]
    return f"{args.preset}, {cfg.block_size} tokens of context\n" + _table(["", "value"], rows, left=2)


def _wall_clock(seconds: float) -> str:
    return f"{seconds:,.0f} s = {seconds / 3600:,.1f} hours = {seconds / 86_400:,.1f} days"


def _peaks(args: argparse.Namespace) -> str:
    dtypes = list(next(iter(hardware.GPU_PEAK_FLOPS.values())))
    rows = [[gpu, *(f"{table[d] / 1e12:g}" for d in dtypes), f"{hardware.GPU_MEMORY_BYTES[gpu] / 1e9:g}"]
            for gpu, table in hardware.GPU_PEAK_FLOPS.items()]
    return ("dense tensor-core peaks in TFLOP/s (not the 2:4-sparsity figures), SXM parts; memory in GB = 1e9 bytes\n"
            + _table(["gpu", *dtypes, "memory GB"], rows))


# ---------------------------------------------------------------- command line


# One assumption for every subcommand: the CUDA context, the allocator's fragmentation and NCCL's buffers take
# about a tenth of a GPU's memory.
USABLE = 0.9
USABLE_HELP = (f"fraction of each GPU's memory to plan with (default: {USABLE:g}: the CUDA context, allocator "
               f"fragmentation and communication buffers take the rest)")


def build_parser(prog: str = "plan") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description="Training time and memory on paper (see lab.measure.accounting).")
    sub = p.add_subparsers(dest="command", required=True, metavar="{time,memory,mesh,model,peaks}")

    t = sub.add_parser("time", help="training FLOPs, GPU-hours and wall-clock days")
    t.add_argument("--params", type=_positive, required=True, help="parameters N (e.g. 70e9)")
    t.add_argument("--tokens", type=_positive, required=True, help="training tokens D (e.g. 15e12)")
    t.add_argument("--gpu", type=_gpu, default="H100", help="A100, H100 or H200 (default: H100)")
    t.add_argument("--n-gpus", type=_count, default=1, help="number of GPUs (default: 1)")
    t.add_argument("--mfu", type=_fraction, default=0.5, help="model-FLOPs utilisation in (0, 1] (default: 0.5)")
    t.set_defaults(run=_time)

    m = sub.add_parser("memory", help="largest model per ZeRO strategy and precision")
    m.add_argument("--gpu", type=_gpu, default="H100", help="A100, H100 or H200 (default: H100)")
    m.add_argument("--n-gpus", type=_count, default=1, help="data-parallel GPUs N_d (default: 1)")
    m.add_argument("--memory-gb", type=_positive, help="memory per GPU in GB (default: the GPU's)")
    m.add_argument("--usable", type=_fraction, default=USABLE, help=USABLE_HELP)
    m.add_argument("--offload", action="store_true", help="optimizer states on the host (ZeRO-Offload)")
    m.add_argument("--muon-share", type=_share, default=0.0,
                   help="the share of the parameters Muon steps (train.optimizer muon: the hidden matrices), each "
                        "with one fp32 moment instead of AdamW's two (default: 0, AdamW alone)")
    m.add_argument("--precision", choices=accounting.PRECISIONS, action="append",
                   help="only this precision's rows: mixed (--train.precision mixed) or fp32 (--train.precision "
                        "autocast); default: both")
    m.add_argument("--micro-batch", type=_count, help="sequences per GPU per micro-step")
    m.add_argument("--seq-len", type=_count, help="tokens per sequence")
    m.add_argument("--d-model", type=_count, help="residual width")
    m.add_argument("--n-head", type=_count, help="attention heads")
    m.add_argument("--vocab", type=_count, default=50257, help="vocabulary size (default: 50257)")
    m.add_argument("--arch", choices=("gpt2", "modern"), default="gpt2", help="parameter layout (default: gpt2)")
    m.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    m.add_argument("--naive-attention", action="store_true", help="store the s×s attention matrices (no flash)")
    m.set_defaults(run=_memory)

    g = sub.add_parser("mesh", help="choose tp × cp × pp × dp and the data-parallel stage for a model (and say why)")
    g.add_argument("--preset", required=True, help="a model preset (lab.runtime.config.PRESETS), e.g. llama3-70b")
    g.add_argument("--vocab", type=_count, help="vocabulary size (default: the preset's)")
    g.add_argument("--seq-len", type=_count, help="tokens per sequence (default: the preset's block size)")
    g.add_argument("--micro-batch", type=_count, default=1, help="sequences per replica per micro-step (default: 1)")
    g.add_argument("--batch-tokens", type=_positive, default=2**22,
                   help="tokens per optimizer step, all replicas (default: 4,194,304)")
    g.add_argument("--gpu", type=_gpu, default="H100", help="A100, H100 or H200 (default: H100)")
    g.add_argument("--n-gpus", type=_count, default=8, help="GPUs in all (default: 8)")
    g.add_argument("--gpus-per-node", type=_count, default=8, help="GPUs per node: tp stays within one (default: 8)")
    g.add_argument("--memory-gb", type=_positive, help="memory per GPU in GB (default: the GPU's)")
    g.add_argument("--usable", type=_fraction, default=USABLE, help=USABLE_HELP)
    g.add_argument("--mfu", type=_fraction, default=0.5, help="the compute's share of the peak (default: 0.5)")
    g.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    g.add_argument("--max-cp", type=_count, default=1,
                   help="price context parallelism up to this degree (default: 1, and up to a node's GPUs when nothing "
                        "fits without it)")
    g.add_argument("--intra-gbps", type=_positive, default=450.0,
                   help="GB/s one GPU sends within a node (default: 450, NVLink 4 one way)")
    g.add_argument("--inter-gbps", type=_positive, default=50.0,
                   help="GB/s one GPU sends to other nodes (default: 50, 400 Gb/s InfiniBand)")
    g.add_argument("--compare", type=_tp_by_pp, metavar="TPxPP",
                   help="also price this layout beside the choice, e.g. 8x16 (Llama 3 405B's tp 8 × pp 16)")
    g.add_argument("--show", type=int, default=20, help="rows listed, fastest first (0: all; default: 20)")
    g.add_argument("--critical-batch", type=_positive, metavar="TOKENS",
                   help="the critical batch at the run's loss (python -m analysis plan --critical-batch): the steps "
                        "and tokens --batch-tokens costs against the fewest")
    g.set_defaults(run=_mesh)

    o = sub.add_parser("model", help="a model's total and active parameters and FLOPs per token (mixtures of experts)")
    o.add_argument("--preset", required=True, help="a model preset (lab.runtime.config.PRESETS), e.g. small-modern")
    o.add_argument("--vocab", type=_count, help="vocabulary size (default: the preset's)")
    o.add_argument("--seq-len", type=_count, help="tokens per sequence (default: the preset's block size)")
    o.add_argument("--moe-experts", type=int, default=0, help="routed experts per MLP (default: 0, dense)")
    o.add_argument("--moe-top-k", type=int, default=1, help="experts per token (default: 1)")
    o.add_argument("--moe-granularity", type=int, default=1, help="expert width d_ff / G (default: 1)")
    o.add_argument("--moe-shared-experts", type=int, default=0, help="always-on experts (default: 0)")
    o.add_argument("--tokens", type=_positive, help="training tokens D: also the FLOPs and the time")
    o.add_argument("--gpu", type=_gpu, default="H100", help="A100, H100 or H200 (default: H100)")
    o.add_argument("--n-gpus", type=_count, default=1, help="number of GPUs (default: 1)")
    o.add_argument("--mfu", type=_fraction, default=0.5, help="MFU on active FLOPs in (0, 1] (default: 0.5)")
    o.set_defaults(run=_model)

    k = sub.add_parser("peaks", help="dense peak FLOP/s per GPU")
    k.set_defaults(run=_peaks)
    return p


def main(argv: Sequence[str] | None = None, prog: str = "plan") -> int:
    """Run the planner; 0 on success, 2 (and one ``error:`` line on stderr) on bad input."""
    try:
        args = build_parser(prog).parse_args(argv)
        run: Callable[[argparse.Namespace], str] = args.run
        print(run(args))
    except UsageExit as e:  # the parser's, its line printed
        return int(e.code)
    except (PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
