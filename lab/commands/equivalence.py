"""Do the strategies train the same model as one process? Train and compare.

    python -m lab equivalence --strategies single,ddp_naive,ddp,torch_ddp --nproc 2 --steps 8 --accum 1
    python -m lab equivalence --strategies zero1,zero3,fsdp --dtype bf16 --precision mixed

Trains the tiny GPT (dropout 0, fp32 unless ``--dtype`` and ``--precision`` say otherwise, CPU) from one seed
under each strategy on ``--nproc`` gloo
ranks, through the loop's own ``train_step``, on a fixed stream of random token batches (the
global batch of a step is the same for every world size), and prints a table per strategy: the
largest relative difference from ``single``'s logged loss and global gradient norm at any step,
the largest absolute difference of any final parameter, and whether all are bitwise equal. The
gradient norm matters: AdamW is invariant to the gradient's scale, so a strategy that summed
instead of averaging would still match losses and weights closely. ``single`` runs
on every rank alone, with the same micro-batches accumulated in order (``--accum`` × world size
micro-steps), which is the computation the others distribute.

Where to expect bits: the gradient of a step is a sum of micro-batch gradients. On 2 ranks with one
micro-batch each, the all-reduce (or reduce-scatter) adds two numbers (order-free) and the division
by 2 is exact, so every strategy reproduces ``single``'s losses and weights bit for bit. The sharded
strategies compute the global gradient norm from per-shard squared sums, a different order than
``single``'s per-tensor norms, so the norm can differ in its last bits, and with clipping active the
clip factor with it (``--grad-clip 0`` removes that path). With accumulation (blocks of micro-batches
summed per rank, then across ranks) or 4 ranks (the ring adds partial sums in a rank-dependent
order) the additions are regrouped and the results differ in the last bits; AdamW then carries
those differences forward, so parameters agree to a tolerance, not bitwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from dataclasses import dataclass

import torch

from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from lab.measure.device import Precision
from lab.runtime import checkpoint
from lab.runtime.files import write_atomic
from lab.model import GPT
from lab.training.optim import optimizer_factory, param_groups
from lab.parallel import Layout, LoopSettings, RunEngine, World, parse_spec
from lab.parallel.axes.pipeline import microbatches
from lab.commands.ranks import RankFailed, run_ranks
from lab.training.steps import StepPlan
from lab.training.plan import check_layout, create
from lab.training.train import StepResult, train_step

TINY = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=96)


@dataclass(frozen=True)
class Setup:
    """One equivalence experiment: what to train and how the batch is split."""

    steps: int = 8
    accum: int = 1  # micro-steps per rank per step
    micro_batch: int = 2
    lr: float = 1e-2
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "fp32"  # what the matmuls compute in (lab.measure.device.Precision)
    mixed: bool = False  # train.precision mixed: 16-bit weights and gradients, fp32 masters (else autocast)
    compile: bool = False  # the strategy compiles the model (train.compile)
    noise_scale: bool = False  # the engine measures the gradient noise scale (train.noise_scale)
    optimizer: str = "adamw"  # or muon (train.optimizer)
    muon_ns_steps: int = 5  # Muon's Newton-Schulz iterations (train.muon_ns_steps)
    counting: bool = False  # each sequence counts up by one (mod the vocabulary) from a random token: a pattern to
    # learn, so that the gradient has a signal beside its noise (random tokens have almost none to learn)
    model: ModelConfig = dataclasses.field(default_factory=lambda: dataclasses.replace(TINY))


@dataclass
class Trace:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]  # the final weights (rank 0), under the model's names
    meters: dict = dataclasses.field(default_factory=dict)  # this rank's accounts and the last step's record
    records: list[dict] = dataclasses.field(default_factory=list)  # each step's record of its parts' figures
    resumed_diff: float | None = None  # saved at the end and loaded into a fresh engine: how far its next step is


def loop_settings(setup: Setup) -> LoopSettings:
    """What ``train_tiny``'s loop does each step, for the strategy's config."""
    return LoopSettings(micro_batch=setup.micro_batch, accum_steps=setup.accum, grad_clip=setup.grad_clip,
                        compile=setup.compile, noise_scale=setup.noise_scale, optimizer=setup.optimizer)


def precision(setup: Setup) -> Precision:
    """The setup's precision policy on the CPU."""
    return Precision("cpu", setup.dtype, setup.mixed)


def batch(setup: Setup, step: int, global_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: random tokens, the same for every world size."""
    g = torch.Generator().manual_seed(setup.seed * 100_003 + step)
    vocab, shape = setup.model.vocab_size, (global_sequences, setup.model.block_size + 1)
    if setup.counting:
        tokens = (torch.randint(0, vocab, (global_sequences, 1), generator=g) + torch.arange(shape[1])) % vocab
    else:
        tokens = torch.randint(0, vocab, shape, generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_tiny(world: World, setup: Setup, parallel: ParallelConfig, model_factory=None,
               resume_dir: Path | None = None) -> Trace:
    """Train ``setup`` under ``parallel.strategy`` on ``world``; the losses and (on rank 0) the final weights. With
    ``resume_dir`` (the same folder on every rank) the run also evaluates and saves a checkpoint at its end there, as
    the loop does, and ``Trace.resumed_diff`` is how far a fresh engine loaded from it trains a step more from the run
    going on: the larger of the loss's relative difference and the weights' largest absolute one (rank 0; 0.0 bit for
    bit; a reduction over more than two data ranks may regroup its sums in a fresh engine: torch's DDP rebuilds its
    buckets after its first step)."""
    engine = _built(world, setup, parallel, model_factory)
    replica, replicas = engine.mesh.layout.data_replica(world.rank)
    plan = StepPlan(global_sequences=setup.micro_batch * setup.accum * replicas, accum_steps=setup.accum,
                    total_steps=setup.steps + 1, micro_batch=setup.micro_batch, world_size=replicas)

    def step(engine: RunEngine, step: int) -> StepResult:
        x, y = batch(setup, step, plan.global_sequences)
        micro = [(x[lo:hi], y[lo:hi]) for lo, hi in (plan.micro_range(replica, m) for m in range(plan.accum_steps))]
        return train_step(engine, world, micro, plan.accum_steps, setup.lr, setup.grad_clip)

    trace = Trace([], [], {})
    for i in range(setup.steps):
        result = step(engine, i)
        trace.losses.append(result.loss)
        trace.grad_norms.append(result.grad_norm)
        step_record = engine.take_step_meters().layout
        trace.records.append(engine.take_record())
    trace.params = engine.full_state_dict()
    trace.meters = engine.accounts.meters() | {"step": step_record}
    if resume_dir is not None:  # as the loop ends: an evaluation, the finiteness check, the save
        x, y = batch(setup, setup.steps, setup.micro_batch)
        engine.eval_loss(x, y)
        if not engine.params_finite():
            raise ValueError("weights are not finite at the end; not saved")
        saved = checkpoint.save(resume_dir, setup.steps, world.rank, world.world_size, engine.checkpoint_state(),
                                engine.checkpoint_meta(), keep=1)
        resumed = _built(world, setup, parallel, model_factory)
        meta = checkpoint.load(saved, world.rank, world.world_size, resumed.checkpoint_state())
        resumed.after_load()
        resumed.load_checkpoint_meta(meta)
        going_on, again = step(engine, setup.steps), step(resumed, setup.steps)
        weights, reloaded = engine.full_state_dict(), resumed.full_state_dict()
        if world.is_main:
            if weights.keys() != reloaded.keys():
                raise ValueError(f"the resumed weights differ in names: {sorted(weights.keys() ^ reloaded.keys())}")
            trace.resumed_diff = max([abs(going_on.loss - again.loss) / abs(going_on.loss)]
                                     + [(weights[k] - reloaded[k]).abs().max().item() for k in weights])
    return trace


def _built(world: World, setup: Setup, parallel: ParallelConfig, model_factory=None) -> RunEngine:
    engine = create(parallel, world, precision(setup), loop_settings(setup))
    engine.build(model_factory or (lambda: GPT(setup.model, seed=setup.seed)),
                 lambda m: param_groups(m, 0.1, setup.optimizer == "muon"),
                 optimizer_factory(TrainConfig(optimizer=setup.optimizer, muon_ns_steps=setup.muon_ns_steps),
                                   world.device))
    return engine


def reference(world: World, setup: Setup, model_factory=None, replicas: int | None = None, split: int = 1) -> Trace:
    """``single`` on this process alone, accumulating the micro-batches of every data-parallel replica (by default
    every rank) in order, each cut in ``split`` (a pipeline's microbatches: a mixture of experts balances each one)."""
    alone = World(rank=0, world_size=1, local_rank=0, device=world.device)
    return train_tiny(alone, dataclasses.replace(setup, accum=setup.accum * (replicas or world.world_size) * split,
                                                 micro_batch=setup.micro_batch // split),
                      ParallelConfig(strategy="single"), model_factory)


@dataclass(frozen=True)
class Comparison:
    max_rel_loss_diff: float
    max_rel_grad_norm_diff: float
    max_param_diff: float
    same_losses: bool  # bitwise
    same_params: bool  # bitwise
    rel_param_diff: float = 0.0  # ‖Δw‖ / ‖w‖ over every weight: a few elements off by a step (16-bit sums) weigh little

    @property
    def bitwise(self) -> bool:
        return self.same_losses and self.same_params and self.max_rel_grad_norm_diff == 0


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def compare(ref: Trace, got: Trace) -> Comparison:
    if ref.params.keys() != got.params.keys():
        raise ValueError(f"parameter names differ: {sorted(ref.params.keys() ^ got.params.keys())}")
    diff = max((ref.params[k] - got.params[k]).abs().max().item() for k in ref.params)
    squares = [((ref.params[k].double() - got.params[k].double()).square().sum().item(),
                ref.params[k].double().square().sum().item()) for k in ref.params]
    rel = (sum(d for d, _ in squares) / sum(w for _, w in squares)) ** 0.5
    return Comparison(_max_rel(ref.losses, got.losses), _max_rel(ref.grad_norms, got.grad_norms), diff,
                      ref.losses == got.losses, all(torch.equal(ref.params[k], got.params[k]) for k in ref.params), rel)


def equivalence(world: World, specs: list[str], setup: Setup, refs: dict | None = None,
                traces: dict | None = None, resume_dir: Path | None = None) -> dict[str, Comparison]:
    """Every strategy (``name[:key=value,...]``) against ``single`` (rank 0's view; run on every rank); ``refs`` keeps
    the references between calls of one setup, ``traces`` gets this rank's trace of each; with ``resume_dir`` each
    also saves at its end and resumes (``train_tiny``)."""
    refs = {} if refs is None else refs
    out = {}
    for spec in specs:
        parallel = parse_spec(spec)
        replicas = Layout.of(parallel, world.world_size).dp  # what single accumulates (for ``single`` too)
        key = replicas, microbatches(parallel) if parallel.pp > 1 else 1
        if key not in refs:
            refs[key] = reference(world, setup, replicas=replicas, split=key[1])
        ref = refs[key]
        trace = ref if spec == "single" else train_tiny(world, setup, parallel, resume_dir=resume_dir)
        if world.is_main:
            out[spec] = compare(ref, trace)
        if traces is not None:
            traces[spec] = trace
    return out


def format_table(results: dict[str, Comparison]) -> str:
    width = max(12, *(len(name) for name in results))
    lines = [f"{'strategy':<{width}} {'max rel loss diff':>18} {'max rel grad-norm diff':>23} {'max |Δparam|':>13} "
             f"{'‖Δw‖/‖w‖':>9} {'bitwise':>8}"]
    for name, c in results.items():
        lines.append(f"{name:<{width}} {c.max_rel_loss_diff:>18.3g} {c.max_rel_grad_norm_diff:>23.3g} "
                     f"{c.max_param_diff:>13.3g} {c.rel_param_diff:>9.2g} {'yes' if c.bitwise else 'no':>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m lab equivalence") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--strategies", default="single,ddp_naive,ddp,torch_ddp",
                   help="space-separated specs name[:key=value,...], e.g. 'zero2 zero3:offload=optimizer'; or "
                        "comma-separated plain names")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=1, help="micro-steps per rank per step")
    p.add_argument("--grad-clip", type=float, default=Setup.grad_clip, help="0: no clipping")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="what the matmuls compute in (16 bits: then compare with a tolerance)")
    p.add_argument("--precision", choices=("autocast", "mixed"), default="autocast",
                   help="autocast over fp32 weights, or mixed: 16-bit weights and gradients, fp32 masters")
    p.add_argument("--out", help="also append the header and the table to this Markdown file")
    args = p.parse_args(argv)
    text = args.strategies
    specs = text.split() if " " in text.strip() or ":" in text else [s for s in text.split(",") if s]
    setup = Setup(steps=args.steps, accum=args.accum, grad_clip=args.grad_clip, dtype=args.dtype,
                  mixed=args.precision == "mixed")
    try:
        if args.nproc < 1 or args.steps < 1 or args.accum < 1 or args.grad_clip < 0:
            raise ConfigError("--nproc, --steps and --accum must be positive and --grad-clip >= 0")
        if setup.mixed and setup.dtype == "fp32":
            raise ConfigError("--precision mixed needs --dtype bf16 or fp16")
        for spec in specs:
            check_layout(parse_spec(spec), args.nproc, loop_settings(setup)) if spec != "single" else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in GPT(setup.model).parameters())
    header = (f"tiny GPT ({params:,} params), {precision(setup).name}, CPU, {args.nproc} gloo "
              f"ranks, {setup.steps} steps, {setup.accum} micro-step(s) of {setup.micro_batch} sequences per rank, "
              f"grad clip {setup.grad_clip:g}; against single accumulating {setup.accum * args.nproc} micro-steps")
    print(header, flush=True)
    try:
        results = run_ranks(equivalence, args.nproc, specs, setup)[0]
    except (RankFailed, ConfigError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    table = format_table(results)
    print(table)
    if args.out:  # appended, but written whole: an interrupted run leaves the file as it was
        out = Path(args.out)
        write_atomic(out, (out.read_text() if out.exists() else "") + f"{header}\n\n```\n{table}\n```\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
