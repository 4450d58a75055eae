"""The matrix of layouts: every data-parallel strategy × tp × pp × ep × cp that fits on a few gloo ranks, each trained
a few steps against single.

    python -m lab matrix [--max-ranks 8] [--models dense,moe] [--archs gpt2,modern] [--strategies zero3,fsdp]
    python -m lab matrix --dtype bf16 --precision mixed   # every layout and single under the bf16 mixed policy
    python -m lab matrix --optimizer muon                 # every layout and single under Muon (one iteration)

Each layout is data parallel over dp ∈ {1, 2} replicas (expert parallelism carved out of them), tensor parallel over
tp ∈ {1, 2}, pipelined over pp ∈ {1, 2} stages, expert parallel over ep ∈ {1, 2} (a mixture of experts only) and
context parallel over cp ∈ {1, 2} (a dense model: each sequence's tokens in two shards, ring attention), on
dp · tp · pp · cp ranks. The tiny GPT (2 blocks, width 32, 4 experts with top-2 routing for ``moe``) trains 3 steps of 2
micro-steps, clipped (so a wrong global norm changes the weights), under the layout and under ``single``
accumulating the same micro-batches (a pipeline's microbatches: ``lab.commands.equivalence``). A row gives the
largest relative difference of the logged loss and of the gradient norm over the steps, the largest absolute
difference of any final weight, the seconds the layout took, and whether it is held to its tolerance: the same
bits where the math allows it (2 ranks of plain data parallelism, one micro-step each, unclipped: there a sum of two
and a halving are exact; checked by the tests), else 1e-6 (loss), 1e-5 (gradient norm) and 1e-3 (weights: a tenth
of one AdamW step at the learning rate 1e-2). A layout the lab refuses prints its one-line reason, which
``lab.training.plan.check_layout`` gives before any rank starts.

Under a 16-bit policy (``--dtype``, ``--precision``) both the layout and single run it, and every regrouped sum rounds
to 8 (bf16) or 11 (fp16) bits: the tolerances are ``TOLERANCE_16`` (the weights by their relative difference over
the whole model, ``Comparison.rel_param_diff``: AdamW turns a near-zero gradient's rounding into a whole step of a
few elements), and the meters are held to their theory in the policy's widths alike (docs/precision.md).

Under Muon (``--optimizer muon``) both run one Newton-Schulz iteration (``MUON``): with five, the quintic amplifies
the layouts' last-bit gradient differences past these tolerances (docs/optimizers.md, Sensitivity); with one, a
layout is held to AdamW's tolerances, so a matrix whose pieces were gathered wrong cannot pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lab.commands.equivalence import TINY, Setup, equivalence, loop_settings, precision
from lab.commands.ranks import RankFailed, run_ranks
from lab.parallel import STRATEGIES, parse_spec
from lab.parallel.layout import World
from lab.runtime.config import ConfigError, ModelConfig
from lab.runtime.files import write_atomic
from lab.training.plan import check_layout

TOLERANCE = {"loss": 1e-6, "grad_norm": 1e-5, "params": 1e-3}
# a layout saved at its end and resumed in a fresh engine, against the run going on, one step later: the loss
# (relative) and every weight (absolute) within this; a load that missed a moment or a weight moves them by a step
RESUMED = 1e-6
# 16-bit policies (docs/precision.md): the weights by ‖Δw‖ / ‖w‖, a mixture of experts' looser (a routed token whose
# top-k flips under a regrouped 16-bit sum moves two experts by whole AdamW steps)
TOLERANCE_16 = {"loss": 1e-3, "grad_norm": 3e-2, "rel_params": {"dense": 5e-2, "moe": 0.15}}
MOE = {"moe_experts": 4, "moe_top_k": 2}
ARCHS = {"gpt2": TINY, "modern": dataclasses.replace(TINY, arch="modern", n_kv_head=1)}
SETUP = Setup(steps=3, accum=2, micro_batch=4, grad_clip=0.05)
MUON = {"optimizer": "muon", "muon_ns_steps": 1}  # --optimizer muon's setup


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix."""

    strategy: str
    dp: int
    tp: int
    pp: int
    ep: int
    model: str  # dense or moe
    arch: str
    cp: int = 1

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def spec(self) -> str:
        options = [f"{axis}={n}" for axis, n in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("cp", self.cp))
                   if n > 1]
        return f"{self.strategy}:{','.join(options)}" if options else self.strategy

    def model_config(self) -> ModelConfig:
        base = ARCHS[self.arch]
        return dataclasses.replace(base, **MOE) if self.model == "moe" else base


@dataclass(frozen=True)
class Row:
    layout: Cell
    loss: float | None = None
    grad_norm: float | None = None
    params: float | None = None
    seconds: float = 0.0
    refused: str | None = None
    meters: tuple[str, ...] = ()  # where a rank's measured bytes left their theory
    resumed: float | None = None  # saved at its end and resumed: how far the next step is (``RESUMED``)
    rel_params: float | None = None  # under a 16-bit policy: ‖Δw‖ / ‖w‖ (held to TOLERANCE_16 instead of params)

    @property
    def passed(self) -> bool:
        if self.refused is not None or self.meters or (self.resumed is not None and self.resumed > RESUMED):
            return False
        if self.rel_params is not None:
            return self.loss <= TOLERANCE_16["loss"] and self.grad_norm <= TOLERANCE_16["grad_norm"] and \
                self.rel_params <= TOLERANCE_16["rel_params"][self.layout.model]
        return self.loss <= TOLERANCE["loss"] and self.grad_norm <= TOLERANCE["grad_norm"] and \
            self.params <= TOLERANCE["params"]


# the experts' exchanges against their theory at balanced routing: a tiny router is not balanced (128 tokens a
# micro-step, top 2 of 4 experts on 2 ranks: 44.5 % of the rows went to the other rank where the theory has 50 %)
EXPERT_BYTES = 0.25


def meter_problems(meters: dict) -> list[str]:
    """Where one rank's meters leave their theory: the bytes sent over the data axis, the tensor-parallel group and
    the pipeline's links must equal it; the model states' bytes be within 5 % and the
    experts' exchanges within ``EXPERT_BYTES``."""
    out = []
    pairs = [("comm_bytes_per_step", "comm_bytes_per_step_theory"),
             ("tp_comm_bytes_per_step", "tp_comm_bytes_per_step_theory")]
    for measured, theory in pairs:
        for kind, sent in meters.get(measured, {}).items():
            if abs(sent - meters[theory][kind]) > 1e-9 * max(sent, 1.0):
                out.append(f"{measured}.{kind} {sent:.0f} B, theory {meters[theory][kind]:.0f}")
    for part in ("params", "grads", "optimizer"):
        held, theory = meters["model_state_bytes"][part], meters["model_state_bytes_theory"][part]
        if abs(held - theory) > 0.05 * theory:
            out.append(f"model_state_bytes.{part} {held:.0f} B, theory {theory:.0f}")
    step = meters["step"]
    for sent in ("pp_sent_bytes", "cp_kv_bytes"):
        if sent in step and step[sent] != step[f"{sent}_theory"]:
            out.append(f"{sent} {step[sent]:.0f}, theory {step[f'{sent}_theory']:.0f}")
    if "ep_a2a_bytes" in step and abs(step["ep_a2a_bytes"] - step["ep_a2a_bytes_theory"]) > \
            EXPERT_BYTES * step["ep_a2a_bytes_theory"]:
        out.append(f"ep_a2a_bytes {step['ep_a2a_bytes']:.0f}, theory {step['ep_a2a_bytes_theory']:.0f}")
    return out


def layouts(max_ranks: int, strategies: list[str], models: list[str], archs: list[str],
            cps: tuple[int, ...] = (1, 2)) -> list[Cell]:
    """Every cell: strategy × dp × tp × pp × ep × cp (ep ≤ dp, a mixture of experts only; cp a dense model only) on 2 to
    ``max_ranks`` ranks."""
    out = []
    degrees = [(dp, tp, pp, ep, cp) for dp in (1, 2) for tp in (1, 2) for pp in (1, 2) for ep in (1, 2) for cp in cps]
    for strategy in strategies:
        for dp, tp, pp, ep, cp in degrees:
            if ep > dp or not 2 <= dp * tp * pp * cp <= max_ranks or (strategy == "single" and dp * cp > 1):
                continue
            for model in models:
                for arch in archs:
                    if (ep == 1 or model == "moe") and (cp == 1 or model == "dense"):
                        out.append(Cell(strategy, dp, tp, pp, ep, model, arch, cp))
    return out


def refusal(layout: Cell, base: Setup = SETUP) -> str | None:
    """The one line the lab refuses ``layout`` with before any rank starts under ``base``, or None when it runs."""
    try:
        check_layout(parse_spec(layout.spec), layout.ranks, loop_settings(base))
    except ConfigError as e:
        return str(e)
    return None


def _run(world: World, cells: list[Cell], base: Setup = SETUP, folder: Path | None = None) -> list[Row]:
    """Every cell on this world under ``base``'s precision, against single (the references shared between cells of
    one model), every rank's meters against their theory (``meter_problems``), and (given a ``folder``) its
    checkpoint at the end, saved there and resumed."""
    import torch.distributed as dist

    rows, references = [], {}
    for i, cell in enumerate(cells):
        setup = dataclasses.replace(base, model=cell.model_config())
        started, traces = time.perf_counter(), {}
        result = equivalence(world, [cell.spec], setup, references.setdefault((cell.model, cell.arch), {}), traces,
                             resume_dir=None if folder is None else folder / f"{world.world_size}-ranks-{i}")
        seconds = time.perf_counter() - started
        problems: list = [None] * world.world_size
        dist.all_gather_object(problems, meter_problems(traces[cell.spec].meters) if cell.strategy != "deepspeed"
                               else [])
        if world.is_main:
            c = result[cell.spec]
            found = tuple(f"rank {r}: {p}" for r, ps in enumerate(problems) for p in ps)
            rows.append(Row(cell, c.max_rel_loss_diff, c.max_rel_grad_norm_diff, c.max_param_diff, seconds,
                            meters=found, rel_params=c.rel_param_diff if setup.dtype != "fp32" else None,
                            resumed=traces[cell.spec].resumed_diff))
            print(format_row(rows[-1]), flush=True)
    return rows


HEADER = (f"{'strategy':<10} {'dp':>2} {'tp':>2} {'pp':>2} {'ep':>2} {'cp':>2} {'ranks':>5} {'model':<5} {'arch':<6} "
          f"{'loss':>9} {'grad norm':>9} {'|Δw|':>9} {'s':>5}  result")


def format_row(row: Row) -> str:
    c = row.layout
    head = (f"{c.strategy:<10} {c.dp:>2} {c.tp:>2} {c.pp:>2} {c.ep:>2} {c.cp:>2} {c.ranks:>5} {c.model:<5} "
            f"{c.arch:<6} ")
    if row.refused is not None:
        return head + f"{'':>9} {'':>9} {'':>9} {'':>5}  refused: {row.refused}"
    weights = f"{row.params:>9.2e}" + (f" ({row.rel_params:.1e} rel)" if row.rel_params is not None else "")
    return head + (f"{row.loss:>9.2e} {row.grad_norm:>9.2e} {weights} {row.seconds:>5.1f}  "
                   f"{'pass' if row.passed else 'FAIL'}{'; meters: ' + row.meters[0] if row.meters else ''}"
                   f"{f'; resumed {row.resumed:.1e} from going on' if (row.resumed or 0) > RESUMED else ''}")


def run(cells: list[Cell], deadline_s: float = 1800.0, base: Setup = SETUP) -> list[Row]:
    """Every cell: refused ones from ``refusal``, the others trained under ``base``'s precision on worlds of their rank
    count (one each), their checkpoints in a temporary folder removed at the end."""
    rows = [Row(cell, refused=reason) for cell in cells if (reason := refusal(cell, base)) is not None]
    for row in rows:
        print(format_row(row), flush=True)
    runnable = [cell for cell in cells if refusal(cell, base) is None]
    with tempfile.TemporaryDirectory(prefix="lab-matrix-") as folder:
        for n in sorted({cell.ranks for cell in runnable}):
            rows += run_ranks(_run, n, [cell for cell in runnable if cell.ranks == n], base, Path(folder),
                              deadline_s=deadline_s)[0]
    return rows


def summary(rows: list[Row]) -> str:
    """Per strategy: the layouts trained (and on how many ranks), how many held their tolerance and their meters, the
    worst differences over them, and the refused ones."""
    lines = ["| strategy | layouts trained | ranks | within tolerance | worst loss | worst grad norm | worst weight | "
             "refused |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name in STRATEGIES:
        mine = [r for r in rows if r.layout.strategy == name]
        ran = [r for r in mine if r.refused is None]
        if not mine:
            continue
        ranks = ", ".join(str(n) for n in sorted({r.layout.ranks for r in ran})) or "-"
        worst = [max((getattr(r, k) for r in ran), default=0.0) for k in ("loss", "grad_norm", "params")]
        relative = [r.rel_params for r in ran if r.rel_params is not None]
        weight = f"{worst[2]:.1e}" + (f" ({max(relative):.1e} rel)" if relative else "")
        lines.append(f"| {name} | {len(ran)} | {ranks} | {sum(r.passed for r in ran)} | {worst[0]:.1e} | "
                     f"{worst[1]:.1e} | {weight} | {len(mine) - len(ran)} |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[Row]) -> str:
    lines = ["| strategy | dp | tp | pp | ep | cp | ranks | model | arch | loss | grad norm | max abs weight | s | "
             "result |", "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|"]
    for row in sorted(rows, key=lambda r: (list(STRATEGIES).index(r.layout.strategy), r.layout.ranks, r.layout.tp,
                                           r.layout.pp, r.layout.ep, r.layout.cp, r.layout.model, r.layout.arch)):
        c = row.layout
        cells = [c.strategy, c.dp, c.tp, c.pp, c.ep, c.cp, c.ranks, c.model, c.arch]
        if row.refused is not None:
            cells += ["", "", "", "", f"refused: {row.refused}"]
        else:
            weight = f"{row.params:.1e}" + (f" ({row.rel_params:.1e} rel)" if row.rel_params is not None else "")
            cells += [f"{row.loss:.1e}", f"{row.grad_norm:.1e}", weight, f"{row.seconds:.1f}",
                      "pass" if row.passed else "**FAIL**" + (f" (meters: {row.meters[0]})" if row.meters else "")]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, prog: str = "python -m lab matrix") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--max-ranks", type=int, default=8, help="the most gloo ranks a layout may take (2, 4 or 8)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategy names")
    p.add_argument("--models", default="dense,moe", help="dense, moe or both")
    p.add_argument("--archs", default="gpt2,modern", help="gpt2, modern or both")
    p.add_argument("--cp", default="1,2", help="context-parallel degrees: 1, 2 or both")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="what the matmuls compute in")
    p.add_argument("--precision", choices=("autocast", "mixed"), default="autocast",
                   help="autocast over fp32 weights, or mixed: 16-bit weights and gradients, fp32 masters")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="every layout and single under this optimizer (muon: one Newton-Schulz iteration)")
    p.add_argument("--out", help="also write the table as Markdown to this file")
    args = p.parse_args(argv)
    if args.precision == "mixed" and args.dtype == "fp32":
        print("error: --precision mixed needs --dtype bf16 or fp16", file=sys.stderr)
        return 2
    base = dataclasses.replace(SETUP, dtype=args.dtype, mixed=args.precision == "mixed",
                               **(MUON if args.optimizer == "muon" else {}))
    strategies, models, archs = (text.split(",") for text in (args.strategies, args.models, args.archs))
    for given, known, what in ((strategies, STRATEGIES, "strategy"), (models, ("dense", "moe"), "model"),
                               (archs, ARCHS, "arch")):
        unknown = [name for name in given if name not in known]
        if unknown:
            print(f"error: unknown {what} '{unknown[0]}' (known: {', '.join(known)})", file=sys.stderr)
            return 2
    if args.max_ranks < 2:
        print("error: --max-ranks must be at least 2", file=sys.stderr)
        return 2
    try:
        cps = tuple(int(n) for n in args.cp.split(","))
    except ValueError:
        cps = ()
    if not cps or any(n not in (1, 2) for n in cps):
        print(f"error: --cp takes 1, 2 or both, got '{args.cp}'", file=sys.stderr)
        return 2
    cells = layouts(args.max_ranks, strategies, models, archs, cps)
    header = (f"{len(cells)} layouts on up to {args.max_ranks} gloo ranks, each against single ({SETUP.steps} steps of "
              f"{SETUP.accum} micro-steps, clipped at {SETUP.grad_clip}, {precision(base).name}, {args.optimizer}); "
              f"{time.strftime('%Y-%m-%d')}, "
              f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the start")
    print(header, flush=True)
    print(HEADER, flush=True)
    started = time.perf_counter()
    try:
        rows = run(cells, base=base)
    except RankFailed as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    failed = [row for row in rows if row.refused is None and not row.passed]
    ran = sum(row.refused is None for row in rows)
    footer = (f"{ran} trained, {len(rows) - ran} refused, {len(failed)} outside tolerance, "
              f"{time.perf_counter() - started:.0f} s (load {os.getloadavg()[0]:.1f} at the end)")
    print(footer, flush=True)
    print(summary(rows), flush=True)
    if args.out:
        write_atomic(Path(args.out), f"`{prog} {' '.join(argv or sys.argv[1:])}`: {header}; {footer}.\n\n"
                                     f"{summary(rows)}\n{markdown(rows)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
