"""Pipeline parallelism (``parallel.pp``, ``parallel.pp_schedule``, ``parallel.pp_microbatches``) on real gloo ranks.

The reference is ``single`` accumulating the micro-batches of every data-parallel replica (lab.commands.equivalence).
A stage changes no operation of the model, so with one microbatch per micro-step and an untied head the losses,
gradient norms and weights are ``single``'s bits (asserted). Otherwise three sums are regrouped: the batch's mean
loss becomes a mean of M microbatch means and its gradient a sum of M microbatch gradients (as accumulation does);
a tied embedding's gradient is summed per stage, then between the first and the last stage, where ``single`` adds
head and embedding per micro-step; and the squared gradient norm is summed per stage, then over stages. Measured on
these tiny fp32 models over every spec below: losses within 2.1e-7 relative, gradient norms within 2.8e-6 relative
(pp 4, tied: AdamW carries last-bit differences into the weights, and the later steps' norms are taken at them),
weights within 3.0e-5 after 3 steps at lr 1e-2 with clipping active. Tested at the tensor-parallel suite's
tolerances: 1e-6 (loss), 1e-5 (gradient norm), 1e-3 (weights, a tenth of one step).
"""

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.training.lifecycle import resolve_vocab, train
from lab.commands.equivalence import TINY, Setup, batch, equivalence
from lab.data import load_tokenizer, prepare
from lab.model import GPT
from lab.measure.device import Precision
from lab.parallel import LoopSettings, World, parse_spec
from lab.training.plan import check_layout, check_model, create
from lab.parallel.axes.pipeline import Pipeline, interleaved, schedule
from lab.measure.accounting import stage_units as balanced_split
from lab.runtime import checkpoint
from lab.runtime.checkpoint import Held
from lab.runtime.config import ConfigError, ParallelConfig, TrainConfig, build_parser, config_from_args
from lab.training.optim import adamw_factory, param_groups
from pool import run_pooled

ROOT = Path(__file__).resolve().parents[1]
UNTIED = dataclasses.replace(TINY, tie_embeddings=False)
FOUR = dataclasses.replace(TINY, n_layer=4)  # a block per stage at pp 4
CLIP = 0.05  # below every step's norm: clipping acts, so a wrong global norm changes the weights
LOOP = LoopSettings(micro_batch=4, accum_steps=1, grad_clip=1.0)


def _close(r) -> bool:
    return r.max_rel_loss_diff <= 1e-6 and r.max_rel_grad_norm_diff <= 1e-5 and r.max_param_diff <= 1e-3


# ---------------------------------------------------------------- no ranks


@pytest.mark.parametrize("name, stages, m", [("gpipe", 4, 6), ("1f1b", 4, 6), ("1f1b", 2, 2), ("1f1b", 4, 4)])
def test_a_schedule_runs_each_microbatch_once_forward_before_backward(name, stages, m):
    """Every stage runs each forward and backward once, a backward after its forward, backwards in microbatch order;
    GPipe holds all m microbatches at its peak, 1F1B at most stages − stage on stage ``stage``."""
    for stage in range(stages):
        order = schedule(name, stage, stages, m)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert [i for kind, i in order if kind == "B"] == list(range(m))
        held = peak = 0
        for kind, i in order:
            assert kind == "F" or order.index(("F", i)) < order.index(("B", i))
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        assert peak == (m if name == "gpipe" else min(stages - stage, m)), (stage, order)


@pytest.mark.parametrize("stages, virtual, m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (3, 3, 6), (4, 1, 4)])
def test_the_interleaved_schedule_runs_without_deadlock_and_in_matching_order(stages, virtual, m):
    """Each rank runs each of its virtual stages' forwards and backwards once; executed in lockstep with sends that
    do not block and receives that do (as ``Pipeline.train`` runs them), every rank finishes (no deadlock), and on
    every link the receiver takes the messages in the order the sender sent them, activations and gradients
    together (at pp 2 rank 1 sends rank 0 both: in-order matching holds even where tags are ignored, as NCCL's).
    A tick is one forward or backward of a virtual stage: the run takes 2 (m · V + p − 1) ticks, whose idle
    2 (p − 1) per rank last 1/V of 1F1B's (there a tick is a whole stage's). With V = 1 it is 1F1B."""
    total = stages * virtual
    orders = [interleaved(r, stages, m, virtual) for r in range(stages)]
    for r, order in enumerate(orders):
        assert sorted(order) == sorted((kind, v, i) for kind in "FB" for v in range(virtual) for i in range(m))
        if virtual == 1:
            assert [(kind, i) for kind, _, i in order] == schedule("1f1b", r, stages, m)
    done, at, ticks = set(), [0] * stages, 0
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}

    def ready(kind: str, stage: int, i: int) -> bool:
        if kind == "F":
            return stage == 0 or ("F", stage - 1, i) in done
        return ("F", stage, i) in done and (stage == total - 1 or ("B", stage + 1, i) in done)

    while any(at[r] < len(orders[r]) for r in range(stages)):
        now = []
        for r in range(stages):
            if at[r] < len(orders[r]):
                kind, v, i = orders[r][at[r]]
                if ready(kind, r + v * stages, i):
                    now.append((kind, r + v * stages, i))
                    at[r] += 1
        assert now, f"deadlock after {ticks} ticks at {at}"
        for kind, stage, i in now:
            done.add((kind, stage, i))
            if (kind == "F" and stage < total - 1) or (kind == "B" and stage > 0):
                link = (stage % stages, (stage + (1 if kind == "F" else -1)) % stages)
                sent.setdefault(link, []).append((kind, stage, i))
            if (kind == "F" and stage > 0) or (kind == "B" and stage < total - 1):
                source = stage - 1 if kind == "F" else stage + 1
                received.setdefault((source % stages, stage % stages), []).append((kind, source, i))
        ticks += 1
    assert sent == received
    assert ticks == 2 * (m * virtual + stages - 1)  # the bubble: 2 (p − 1) slots of a virtual stage, 1/V of 1F1B's


def test_stages_are_balanced_by_parameters():
    assert balanced_split([5] * 4, 2) == [range(0, 2), range(2, 4)]
    assert balanced_split([1, 1, 1, 1, 4], 2) == [range(0, 4), range(4, 5)]
    assert balanced_split([3, 1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 4)]  # ties: the later runs longer


def _staged(pipe: Pipeline, model: GPT) -> GPT:
    """``model`` cut to the stages ``pipe`` holds."""
    pipe.split(model, model.parallel_plan())
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_each_stage_holds_its_blocks_under_the_models_names(tied):
    """Stage s of 2 keeps blocks 2s and 2s + 1, the first the embedding, the last the final norm and head (a tied
    embedding on both: one weight, counted once); together they hold the whole model, with single's initial
    weights; the split is named with its parameters."""
    model = dataclasses.replace(FOUR, tie_embeddings=tied)
    whole = dict(GPT(model).named_parameters())
    held = []
    for stage in range(2):
        pipe = Pipeline(World(rank=stage, world_size=2, local_rank=stage, device=torch.device("cpu")),
                        ParallelConfig(pp=2), accum_steps=1)
        part = dict(_staged(pipe, GPT(model)).named_parameters())
        held.append(part)
        blocks = {name.split(".")[1] for name in part if name.startswith("blocks.")}
        assert blocks == {str(2 * stage), str(2 * stage + 1)}
        assert ("wpe.weight" in part) == (stage == 0) and ("norm_f.weight" in part) == (stage == 1)
        assert ("wte.weight" in part) == (tied or stage == 0) and ("lm_head.weight" in part) == (not tied and stage)
        assert all(torch.equal(p, whole[name]) for name, p in part.items())
        assert pipe.tied == (["wte.weight"] if tied else [])
        replicas = pipe.replicas("wte.weight")  # counted by the first of the stages that hold it
        assert (replicas is None or replicas.is_first) == (stage == 0 or not tied)  # untied: only stage 0 holds it
    assert held[0].keys() | held[1].keys() == whole.keys()
    assert sum(pipe.stage_params) == sum(p.numel() for p in whole.values()) + (whole["wte.weight"].numel() if tied
                                                                                 else 0)
    assert pipe.describe("ddp").startswith(f"ddp (pp 2, 1f1b, 2 microbatches: stage 0: embedding + blocks 0-1 "
                                           f"({pipe.stage_params[0]:,} params); stage 1: blocks 2-3 + head")


def test_interleaved_ranks_hold_every_pp_th_virtual_stage():
    """pp 2 × V 2 over 4 blocks: rank 0 holds virtual stages 0 and 2 (the embedding, blocks 0 and 2), rank 1 stages 1
    and 3 (blocks 1 and 3, the head); the start line names each virtual stage's rank; the bubble's theory is
    (p − 1)/(V · m + p − 1)."""
    cfg = ParallelConfig(pp=2, pp_schedule="interleaved", pp_virtual=2, pp_microbatches=4)
    for stage in range(2):
        pipe = Pipeline(World(rank=stage, world_size=2, local_rank=stage, device=torch.device("cpu")), cfg, 1)
        part = dict(_staged(pipe, GPT(FOUR)).named_parameters())
        assert {name.split(".")[1] for name in part if name.startswith("blocks.")} == {str(stage), str(stage + 2)}
        assert ("wpe.weight" in part) == (stage == 0) and ("norm_f.weight" in part) == (stage == 1)
        assert pipe.theory == 1 / (2 * 4 + 1)
    assert pipe.describe("single").startswith("single (pp 2, interleaved × 2, 4 microbatches: stage 0 (rank 0): "
                                              "embedding + block 0 (")
    assert "; stage 3 (rank 1): block 3 + head (" in pipe.describe("single")


@pytest.mark.parametrize("options, world_size, message", [
    ({"pp": 3}, 4, r"parallel.tp × parallel.pp \(1 × 3\) must divide the world size \(4\)"),
    ({"pp": 2, "tp": 2}, 6, r"parallel.tp × parallel.pp \(2 × 2\) must divide the world size \(6\)"),
    ({"pp": 0}, 2, "parallel.pp must be at least 1"),
    ({"pp": 4, "pp_microbatches": 2}, 4, r"1f1b needs at least parallel.pp \(4\) microbatches, got "
                                         r"parallel.pp_microbatches 2"),
    ({"pp": 2, "pp_microbatches": 3}, 2, r"parallel.pp_microbatches \(3\) must divide train.micro_batch \(4\)"),
    ({"pp": 2, "pp_schedule": "1fib"}, 2,
     r"must be one of gpipe, 1f1b, interleaved, got '1fib' \(did you mean 1f1b\?\)"),
    ({"pp_schedule": "gpipe"}, 2, "parallel.pp_schedule has no effect with parallel.pp 1"),
    ({"pp_virtual": 2}, 2, "parallel.pp_virtual has no effect with parallel.pp 1"),
    ({"pp_impl": "torch"}, 2, "parallel.pp_impl has no effect with parallel.pp 1"),
    ({"pp": 2, "pp_impl": "touch"}, 2, r"parallel.pp_impl must be one of lab, torch, got 'touch' \(did you mean torch"),
    ({"pp": 2, "pp_impl": "torch"}, 4, "parallel.pp_impl torch runs under strategy single or ddp_naive without "
                                       "parallel.tp only"),
    ({"pp": 2, "pp_virtual": 2}, 2, "parallel.pp_virtual 2 needs parallel.pp_schedule interleaved"),
    ({"pp": 2, "pp_virtual": 0, "pp_schedule": "interleaved"}, 2, "parallel.pp_virtual must be at least 1, got 0"),
    ({"pp": 4, "pp_schedule": "interleaved", "pp_virtual": 2, "pp_microbatches": 2}, 4,
     r"interleaved needs parallel.pp_microbatches a multiple of parallel.pp \(4\), got 2: microbatches go round"),
    ({"strategy": "deepspeed", "pp": 2}, 2, "strategy 'deepspeed' does not run with parallel.pp > 1: its engine "
                                            "owns the whole step"),
    ({"pp": 2, "tp": 2, "sequence_parallel": True}, 4, "parallel.pp > 1 runs with the hand-rolled tensor "
                                                        "parallelism without sequence parallelism only"),
    ({"pp": 2, "tp": 2, "tp_impl": "torch"}, 4, "parallel.pp > 1 runs with the hand-rolled tensor parallelism"),
    ({"pp": 2, "compile": True}, 2, "train.compile with parallel.pp > 1 is not supported yet"),
])
def test_the_pipeline_is_validated_up_front(options, world_size, message):
    loop = dataclasses.replace(LOOP, compile=options.pop("compile", False))
    with pytest.raises(ConfigError, match=message):
        check_layout(ParallelConfig(**{"strategy": "ddp", **options}), world_size, loop)


def test_a_pipeline_accepts_what_it_runs():
    check_layout(ParallelConfig(pp=2), 2, LOOP)  # single over one replica per stage
    check_layout(ParallelConfig(strategy="ddp_naive", pp=2, pp_schedule="gpipe", pp_microbatches=1), 4, LOOP)
    check_layout(ParallelConfig(strategy="zero2", pp=2), 4, LOOP)
    for strategy in ("zero3", "fsdp", "torch_ddp"):  # every data-parallel strategy runs the stages
        check_layout(ParallelConfig(strategy=strategy, pp=2), 4, LOOP)
    check_model(ParallelConfig(pp=4), FOUR)
    check_model(ParallelConfig(pp=2), dataclasses.replace(TINY, moe_experts=4))  # a mixture of experts in stages


@pytest.mark.parametrize("model, message", [
    (dict(n_layer=3), r"parallel.pp \(2\) must divide model.n_layer \(3\)"),
    (dict(n_layer=6), r"parallel.pp × parallel.pp_virtual \(2 × 2\) must divide model.n_layer \(6\): virtual"),
])
def test_models_the_pipeline_cannot_split_are_refused(model, message):
    cfg = ParallelConfig(pp=2, pp_schedule="interleaved", pp_virtual=2) if model.get("n_layer") == 6 else \
        ParallelConfig(pp=2)
    with pytest.raises(ConfigError, match=message):
        check_model(cfg, dataclasses.replace(TINY, **model))


def test_a_run_with_a_bad_pipeline_fails_in_one_line_before_any_rank_starts(capsys, tmp_path, args):
    from lab.commands.cli import run_main

    assert run_main([*args, "--nproc-per-node", "2", "--parallel.pp", "2", "--model.n_layer", "3",
                     "--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: parallel.pp (2) must divide model.n_layer (3): stages hold equal numbers of blocks"]
    assert run_main([*args, "--nproc-per-node", "2", "--parallel.pp", "2", "--strategy", "deepspeed",
                     "--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[0].startswith(
        "error: strategy 'deepspeed' does not run with parallel.pp > 1: ")
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- equivalence with single


def _both_heads(world: World, specs: list[str], setup: Setup) -> dict:
    return {tied: equivalence(world, specs, dataclasses.replace(setup, model=dataclasses.replace(setup.model,
                                                                                                tie_embeddings=tied)))
            for tied in (True, False)}


def _eval_losses(world: World, spec: str) -> tuple[float, float]:
    """The held-out loss of one batch under ``spec`` (run through the stages in one piece) and under single."""
    x, y = batch(Setup(), 0, 8)
    losses = []
    for parallel, on in ((parse_spec(spec), world), (ParallelConfig(), World(0, 1, 0, world.device))):
        strategy = create(parallel, on, Precision("cpu"), LOOP)
        strategy.build(lambda: GPT(TINY), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
        losses.append(strategy.eval_loss(x, y).item())
    return losses[0], losses[1]


def _check(results: dict, specs: list[str]) -> None:
    for tied, by_spec in results.items():
        assert set(by_spec) == set(specs)
        for spec, r in by_spec.items():
            assert _close(r), (tied, spec, r)


@pytest.mark.slow
def test_every_schedule_at_pp2_reproduces_single_on_two_ranks():
    specs = ["single:pp=2,pp_schedule=gpipe,pp_microbatches=1", "ddp:pp=2,pp_schedule=gpipe,pp_microbatches=4",
             "single:pp=2,pp_schedule=1f1b,pp_microbatches=4",
             "single:pp=2,pp_microbatches=2,activation_checkpointing=full"]
    results = run_pooled(_both_heads, 2, specs, Setup(steps=3, micro_batch=4, grad_clip=CLIP))[0]
    _check(results, specs)
    assert results[False][specs[0]].bitwise  # one microbatch, untied: the same operations in the same order
    evaluated = run_pooled(_eval_losses, 2, "single:pp=2")
    assert evaluated[0] == evaluated[1] and evaluated[0][0] == evaluated[0][1]  # on every stage, single's bits


@pytest.mark.slow
def test_pp4_pp2_by_dp2_and_pp2_by_tp2_reproduce_single_on_four_ranks():
    """Every schedule over 4 stages, 2 stages × 2 data-parallel replicas under ddp and ddp_naive, and 2 stages × 2
    tensor-parallel ranks, with accumulation (the replicas' gradients averaged by the strategy, the tied one summed
    between stages: under tp each rank its vocabulary shard, with the rank of the other stage that holds it)."""
    specs = ["single:pp=4,pp_schedule=gpipe,pp_microbatches=2", "single:pp=4,pp_schedule=1f1b,pp_microbatches=4",
             "ddp:pp=2,pp_schedule=1f1b,pp_microbatches=2", "ddp_naive:pp=2,pp_schedule=gpipe,pp_microbatches=2",
             "single:pp=2,tp=2,pp_microbatches=2"]
    results = run_pooled(_both_heads, 4, specs, Setup(steps=3, accum=2, micro_batch=4, grad_clip=CLIP, model=FOUR))[0]
    _check(results, specs)


@pytest.mark.slow
def test_interleaved_1f1b_at_pp2_with_two_virtual_stages_reproduces_single():
    """Each rank holds two virtual stages (rank 0 the embedding with blocks 0 and 2, rank 1 blocks 1 and 3 with the
    head), activations going round the two ranks twice."""
    specs = ["single:pp=2,pp_schedule=interleaved,pp_virtual=2,pp_microbatches=2",
             "single:pp=2,pp_schedule=interleaved,pp_virtual=2,pp_microbatches=4"]
    _check(run_pooled(_both_heads, 2, specs, Setup(steps=3, accum=2, micro_batch=4, grad_clip=CLIP, model=FOUR))[0],
           specs)


@pytest.mark.slow
def test_torch_pipelining_runs_the_same_stages_as_the_reference():
    """``parallel.pp_impl torch``: the same split run by torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B
    and ScheduleInterleaved1F1B gives single's losses, gradient norms and weights at the tolerances the hand-rolled
    schedules meet (a tied head: its gradients summed between the stages after the schedule's step)."""
    specs = ["single:pp=2,pp_impl=torch,pp_schedule=gpipe,pp_microbatches=2",
             "ddp_naive:pp=2,pp_impl=torch,pp_schedule=1f1b,pp_microbatches=2",
             "single:pp=2,pp_impl=torch,pp_schedule=interleaved,pp_virtual=2,pp_microbatches=2",
             "single:pp=2,pp_schedule=interleaved,pp_virtual=2,pp_microbatches=2"]
    _check({True: run_pooled(equivalence, 2, specs, Setup(steps=3, accum=2, micro_batch=4, grad_clip=CLIP,
                                                          model=FOUR))[0]}, specs)


@pytest.mark.long
@pytest.mark.slow
def test_every_schedule_at_pp4_reproduces_single_by_hand_and_through_torch():
    """Four stages of a model of 8 blocks: torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B (2 virtual
    stages per rank), and the hand-rolled interleaved one, each gives single's losses, norms and weights."""
    specs = ["single:pp=4,pp_impl=torch,pp_schedule=gpipe,pp_microbatches=4",
             "single:pp=4,pp_impl=torch,pp_schedule=1f1b,pp_microbatches=4",
             "single:pp=4,pp_impl=torch,pp_schedule=interleaved,pp_virtual=2,pp_microbatches=4",
             "single:pp=4,pp_schedule=interleaved,pp_virtual=2,pp_microbatches=4"]
    setup = Setup(steps=3, accum=2, micro_batch=4, grad_clip=CLIP, model=dataclasses.replace(FOUR, n_layer=8))
    _check({True: run_pooled(equivalence, 4, specs, setup)[0]}, specs)


@pytest.mark.slow
def test_pp2_by_dp2_under_zero1_and_zero2_reproduces_single():
    """2 stages × 2 data-parallel replicas, the optimizer states (zero1) and the gradients (zero2) sharded within a
    stage's replicas, with accumulation and a tied embedding, whose gradient is summed between the first and the
    last stage before it is reduce-scattered (without that sum this fails: checked)."""
    specs = ["zero2:pp=2,pp_schedule=1f1b,pp_microbatches=2", "zero1:pp=2,pp_schedule=gpipe,pp_microbatches=2",
             "zero2:pp=2,pp_schedule=interleaved,pp_virtual=2,pp_microbatches=2"]
    results = run_pooled(equivalence, 4, specs, Setup(steps=3, accum=2, micro_batch=4, grad_clip=CLIP, model=FOUR))[0]
    _check({True: results}, specs)


@pytest.mark.long
@pytest.mark.slow
def test_pp2_by_tp2_by_dp2_reproduces_single_on_eight_ranks():
    """The three axes at once on 8 ranks (stage outermost, tensor innermost), a tied embedding (summed between the
    stages shard by shard, under zero2 before its reduce-scatter), with accumulation."""
    specs = ["ddp:pp=2,tp=2,pp_schedule=1f1b,pp_microbatches=2", "zero2:pp=2,tp=2,pp_schedule=gpipe,pp_microbatches=2"]
    results = run_pooled(equivalence, 8, specs, Setup(steps=3, accum=2, micro_batch=4, grad_clip=CLIP, model=FOUR))[0]
    _check({True: results}, specs)


# ---------------------------------------------------------------- a run end to end


def _resume(world: World, argv: list[str], run_dir: Path, resume: bool = True) -> str:
    """What launch/run.py (--resume) does on each rank once the group is up; the final status."""
    cfg = config_from_args(build_parser("launch/run.py", "").parse_args([*argv, "--run-dir", str(run_dir)]))
    data_dir = prepare(cfg.data, progress=False)
    resolve_vocab(cfg, load_tokenizer(data_dir / "tokenizer").vocab_size)
    return train(cfg, data_dir, run_dir, world, resume=resume)["status"]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _sent_bytes(world: World, spec: str, layers: int, accum: int) -> dict:
    """The bytes one training step sent between stages on this rank (measured, theory), after an evaluation."""
    from lab.training.steps import StepPlan
    from lab.training.train import train_step

    model = dataclasses.replace(TINY, n_layer=layers)
    setup = Setup(model=model, accum=accum, micro_batch=4)
    strategy = create(parse_spec(spec), world, Precision("cpu"),
                      LoopSettings(micro_batch=4, accum_steps=accum, grad_clip=1.0))
    strategy.build(lambda: GPT(model, seed=0), lambda m: param_groups(m, 0.1),
                   adamw_factory(TrainConfig(), world.device))
    plan = StepPlan(4 * accum, accum, 1, 4, 1)
    x, y = batch(setup, 0, plan.global_sequences)
    strategy.eval_loss(x[:2], y[:2])  # not a training step's traffic
    train_step(strategy, world, [(x[lo:hi], y[lo:hi]) for lo, hi in (plan.micro_range(0, m) for m in range(accum))],
               accum, 1e-2, 1.0)
    layout = strategy.take_step_meters().layout
    return {"sent": layout["pp_sent_bytes"], "theory": layout["pp_sent_bytes_theory"], "stage": world.rank}


@pytest.mark.slow
@pytest.mark.parametrize("spec, ranks, layers", [("single:pp=2,pp_schedule=1f1b,pp_microbatches=2", 2, 2),
                                                 ("single:pp=4,pp_schedule=gpipe,pp_microbatches=4", 4, 4),
                                                 ("single:pp=2,pp_schedule=interleaved,pp_virtual=2,"
                                                  "pp_microbatches=2", 2, 4)])
def test_the_bytes_sent_between_stages_are_b_s_h_per_boundary_and_direction(spec, ranks, layers):
    """Counted from the tensors each stage hands to isend; theory: each micro-step's batch × block size × width × 4
    bytes, once per boundary a rank's stages have and direction (the first and last stage one, a middle stage two;
    interleaved, each of a rank's V virtual stages: 2 V − 1 on the first and last rank)."""
    accum = 2
    hidden = 4 * TINY.block_size * TINY.d_model * 4  # a micro-step's b · s · h in fp32
    virtual = 2 if "pp_virtual=2" in spec else 1
    for r in run_pooled(_sent_bytes, ranks, spec, layers, accum):
        boundaries = 2 * virtual - (r["stage"] == 0) - (r["stage"] == ranks - 1)
        assert r["sent"] == r["theory"] == accum * boundaries * hidden, (spec, r)


@pytest.mark.long
@pytest.mark.slow
def test_torchrun_trains_in_two_stages_and_its_checkpoint_resumes(args, tmp_path):
    """launch/run.py under torchrun with pp 2 (the split in the start line, the bubble in the step line), stopped after
    4 steps, then resumed from its checkpoint in the same layout, and in one process: both give the losses of an
    uninterrupted single run (within the tolerance above); the checkpoint holds every weight of the model once (it
    loads whole, in one process, as export does)."""
    from lab.commands.cli import run_main

    assert run_main([*args, "--run-dir", str(tmp_path / "single")]) == 0
    pp = [*args, "--parallel.pp", "2", "--parallel.pp_microbatches", "2"]
    first = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "launch/run.py", *pp, "--train.stop_after", "4", "--run-dir", str(tmp_path / "pp")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    start = first.stdout.splitlines()[0]
    assert "strategy single (pp 2, 1f1b, 2 microbatches: stage 0: embedding + block 0 (" in start
    assert "; stage 1: block 1 + head (" in start
    shutil.copytree(tmp_path / "pp", tmp_path / "pp-then-single")
    assert run_pooled(_resume, 2, pp, tmp_path / "pp") == ["completed"] * 2
    assert run_main([*args, "--resume", "--run-dir", str(tmp_path / "pp-then-single")]) == 0  # pp 2 → one process
    summary = json.loads((tmp_path / "pp" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["world_size"] == 2
    reference = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert math.isclose(summary["final_eval_loss"], reference["final_eval_loss"], rel_tol=1e-5)
    assert summary["pp_bubble_theory"] == 1 / 3 and len(summary["pp_bubble"]) == 2  # (p − 1)/(m + p − 1), measured
    assert all(0 < b < 1 for b in summary["pp_bubble"])
    assert "(theory 33%)" in first.stdout.splitlines()[1]  # the step line: bubble per stage

    def losses(run: str) -> list[float]:
        return _losses(tmp_path / run)

    shapes = {name: p.shape for name, p in GPT(dataclasses.replace(TINY, vocab_size=512)).named_parameters()}
    ref = checkpoint.load_model(checkpoint.latest(tmp_path / "single"), shapes)
    for run in ("pp", "pp-then-single"):
        assert len(losses(run)) == 8
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(losses("single"), losses(run))), losses(run)
        whole = checkpoint.load_model(checkpoint.latest(tmp_path / run), shapes)
        assert max((whole[k] - ref[k]).abs().max().item() for k in ref) <= 1e-3


def _reloaded(world: World, source: str, target: str, run_dir: Path) -> tuple[object, Path]:
    """A step under ``source``, its checkpoint (in ``run_dir``) loaded under ``target``: that strategy, the folder."""
    from lab.training.train import train_step

    def built(spec: str):
        strategy = create(parse_spec(spec), world, Precision("cpu"), LOOP)
        strategy.build(lambda: GPT(FOUR), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
        return strategy

    strategy = built(source)
    x, y = batch(Setup(model=FOUR), world.rank, 4)
    train_step(strategy, world, [(x, y)], 1, 1e-2, 1.0)
    saved = checkpoint.save(run_dir, 1, world.rank, world.world_size, strategy.checkpoint_state(), {}, 1)
    strategy = built(target)
    checkpoint.load(saved, world.rank, world.world_size, strategy.checkpoint_state())
    strategy.after_load()
    return strategy, saved


def _saved_again(world: World, source: str, target: str, run_dir: Path) -> bool | None:
    """Whether ``_reloaded``'s checkpoint, saved again under ``target``, holds every entry (weights, moments, steps)
    of the first bit for bit (on rank 0)."""
    strategy, saved = _reloaded(world, source, target, run_dir / "source")
    again = checkpoint.save(run_dir / "again", 1, world.rank, world.world_size, strategy.checkpoint_state(), {}, 1)
    if not world.is_main:
        return None
    first, second = checkpoint.load_everything(saved), checkpoint.load_everything(again)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def _loaded_as_saved(world: World, source: str, target: str, run_dir: Path) -> bool:
    """Whether every weight and moment this rank holds after ``_reloaded`` is the saved one's bits (no tensor
    parallelism: each rank holds ranges of the whole flattened tensors)."""
    strategy, saved = _reloaded(world, source, target, run_dir)
    stored = checkpoint.load_everything(saved)
    held = {}  # as this rank holds them, before the pipeline's transform: the last stage's parts of the tied weight too
    for piece in strategy.strategy.holding():
        for key, view in piece.views():
            held[key] = Held(piece.numel, piece.lo if view.numel() else 0, view) if piece.sharded else view
    return all(torch.equal(value.view, stored[key][value.lo:value.lo + value.view.numel()])
               if isinstance(value, Held) else torch.equal(value.flatten(), stored[key].flatten())
               for key, value in held.items())


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.long)])
def test_a_pipeline_checkpoint_loads_into_another_sharding(tmp_path, ranks):
    """pp2 (× dp2 on 4 ranks) under zero2 → zero1 with units of 8 KiB (other unit boundaries): every weight and moment
    each rank holds is the saved bits, the last stage's parts of the tied embedding (saved by the first stage, sent
    to it after the load) included; before, the save failed (DCP found the two stages' parts of it overlapping)."""
    target = "zero1:pp=2,pp_microbatches=2,bucket_mb=0.0078125"
    assert run_pooled(_loaded_as_saved, ranks, "zero2:pp=2,pp_microbatches=2", target, tmp_path) == [True] * ranks


@pytest.mark.long
@pytest.mark.slow
def test_a_pipeline_checkpoint_loads_into_pp_by_tp_bit_for_bit(tmp_path):
    """pp2×dp2 under zero2 → pp2×tp2 (vocabulary rows and column blocks): every entry saved again is the same bits."""
    target = "ddp:pp=2,tp=2,pp_microbatches=2"
    assert run_pooled(_saved_again, 4, "zero2:pp=2,pp_microbatches=2", target, tmp_path) == [True, None, None, None]


@pytest.mark.long
@pytest.mark.slow
def test_a_checkpoint_reshards_across_pipeline_and_data_layouts(args, tmp_path, capsys):
    """pp2×dp2 (zero2, sharded within each stage) → pp1×dp4 (zero1) → one process, and back: one process → pp2×dp2;
    each chain logs the losses of an uninterrupted one-process run (the same micro-batches, regrouped: within 1e-5)
    and ends with its weights. Export and sample read the checkpoint the pp layout wrote: the weights one process
    has after the same steps."""
    from lab.commands.cli import export_main, run_main, sample_main

    common = [*args, "--train.micro_batch", "2", "--train.checkpoint_every", "2", "--train.keep_checkpoints", "8"]
    pp_dp = ["--strategy", "zero2", "--parallel.pp", "2", "--parallel.pp_microbatches", "2"]
    there, back = tmp_path / "there", tmp_path / "back"
    assert run_main([*common, "--run-dir", str(tmp_path / "single")]) == 0
    assert run_pooled(_resume, 4, [*common, *pp_dp, "--train.stop_after", "2"], there, False) == ["stopped"] * 4
    for run, out in ((there, "pp.pt"), (tmp_path / "single", "single.pt")):
        assert export_main([str(run), "--checkpoint", str(run / "checkpoints" / "step-000002"),
                            "--out", str(tmp_path / out)]) == 0
    exported = [torch.load(tmp_path / out, weights_only=True)["model"] for out in ("pp.pt", "single.pt")]
    assert exported[0].keys() == exported[1].keys()
    assert max((exported[0][k] - exported[1][k]).abs().max().item() for k in exported[1]) <= 1e-4
    capsys.readouterr()
    assert sample_main([str(there), "--prompt", "The", "--tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    assert run_pooled(_resume, 4, [*common, "--strategy", "zero1", "--train.stop_after", "4"], there) == ["stopped"] * 4
    assert run_main([*common, "--resume", "--run-dir", str(there)]) == 0
    assert run_main([*common, "--train.stop_after", "2", "--run-dir", str(back)]) == 0
    assert run_pooled(_resume, 4, [*common, *pp_dp], back) == ["completed"] * 4

    reference = _losses(tmp_path / "single")
    shapes = {name: p.shape for name, p in GPT(dataclasses.replace(TINY, vocab_size=512)).named_parameters()}
    final = checkpoint.load_model(checkpoint.latest(tmp_path / "single"), shapes)
    for run in (there, back):
        assert len(_losses(run)) == len(reference) == 8
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(reference, _losses(run))), (run, _losses(run))
        whole = checkpoint.load_model(checkpoint.latest(run), shapes)
        assert max((whole[k] - final[k]).abs().max().item() for k in final) <= 1e-3


def _in_flight(world: World) -> dict:
    """Per schedule (gpipe, 1f1b), one step of pp 2 with 8 microbatches of one sequence with the allocation meter
    running: the pipeline's in-flight meter (measured, theory) and the allocation meter's peak of the schedule."""
    from lab.measure import memory
    from lab.training.train import train_step

    model = dataclasses.replace(TINY, n_layer=2, block_size=64)
    x, y = batch(Setup(model=model, micro_batch=8), 0, 8)
    out = {}
    for name in ("gpipe", "1f1b"):
        meter = memory.Meter(world.device)
        with meter.running():
            strategy = create(parse_spec(f"single:pp=2,pp_schedule={name},pp_microbatches=8"), world,
                              Precision("cpu"), LoopSettings(micro_batch=8, accum_steps=1, grad_clip=1.0))
            strategy.build(lambda: GPT(model, seed=0), lambda m: param_groups(m, 0.1),
                           adamw_factory(TrainConfig(), world.device))
            for _ in range(2):  # the second step holds the optimizer's states from its start, as every later step
                train_step(strategy, world, [(x, y)], 1, 1e-3, 1.0)
                peaks = meter.take_step_peaks()
                layout = strategy.take_step_meters().layout
        out[name] = {"measured": layout["pp_in_flight_bytes"], "theory": layout["pp_in_flight_bytes_theory"],
                     "peak": peaks["forward"]}  # the schedule, backwards included, runs in the loop's forward phase
    return out


@pytest.mark.slow
def test_1f1b_holds_the_activations_of_p_microbatches_where_gpipe_holds_m():
    """The activation bytes held for microbatches awaiting their backward (saved-tensor hooks per microbatch's
    forward, summed over the forwards outstanding): GPipe holds all 8 on both stages; 1F1B 2 on the first stage and 1
    on the last (Narayanan et al. 2021). The allocation meter's peak of the schedule sees the same difference."""
    runs = run_pooled(_in_flight, 2)[0]
    gpipe, one_f_one_b = runs["gpipe"], runs["1f1b"]
    per_microbatch = [b / 8 for b in gpipe["measured"]]
    for stage, held in enumerate((2, 1)):
        assert gpipe["measured"][stage] == pytest.approx(gpipe["theory"][stage], rel=0.01)
        assert one_f_one_b["measured"][stage] == pytest.approx(held * per_microbatch[stage], rel=0.02)
        assert one_f_one_b["measured"][stage] == pytest.approx(one_f_one_b["theory"][stage], rel=0.02)
    saved = gpipe["measured"][0] - one_f_one_b["measured"][0]  # 6 microbatches' activations on the first stage
    assert gpipe["peak"] - one_f_one_b["peak"] == pytest.approx(saved, rel=0.2), (gpipe, one_f_one_b)
