"""Expert parallelism (``--parallel.ep``): validation up front, ep2 and ep2×dp2 against single on gloo ranks, the
all-to-all bytes against what the routing sent and the formula, the global router counts, and checkpoints that
resume across ep degrees.

Tolerances. ep2 on 2 ranks is bitwise: each expert runs on each source rank's rows apart (single's matmuls), an
expert's gradient is the sum of two micro-batches' (order-free), and the other weights' all-reduce adds two
numbers; the norm's squares are summed per rank then over the pair, which for these models gave single's bits too,
so it is compared to 1e-6. On 4 ranks (ep2×dp2, ep4) the data axis's all-reduce adds four micro-batches' gradients
in the ring's order where single accumulates them in rank order, as plain ddp on 4 ranks does: measured over 3 steps
at lr 1e-2, losses 1.1e-7 relative, the norm 1.4e-7, weights 7.1e-6 absolute (ddp without ep: the same loss and
7.1e-6); asserted at 1e-6, 1e-6 and 5e-5.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lab.commands.cli import run_main
from lab.training.lifecycle import resolve_vocab, train
from lab.commands.equivalence import TINY, Setup, batch, equivalence
from lab.measure import accounting
from lab.measure.device import Precision
from lab.model import GPT
from lab.parallel import LoopSettings, World, parse_spec
from lab.training.plan import check_layout, check_model, create
from lab.parallel.comm import buckets
from lab.runtime import checkpoint
from lab.data import load_tokenizer, prepare
from lab.runtime.config import ConfigError, ParallelConfig, TrainConfig, build_parser, config_from_args
from lab.training.optim import adamw_factory, param_groups
from lab.training.runlog import format_step
from lab.training.steps import StepPlan
from lab.training.train import train_step
from pool import run_pooled

MOE = dataclasses.replace(TINY, moe_experts=4, moe_top_k=2, moe_granularity=2, moe_shared_experts=1)
LOOP = LoopSettings(micro_batch=4, accum_steps=1, grad_clip=1.0)


@pytest.mark.parametrize("options, world_size, message", [
    ({"ep": 0}, 2, "parallel.ep must be at least 1, got 0"),
    ({"ep": 3}, 4, r"parallel.ep \(3\) must divide the data-parallel ranks \(4 = world size / \(tp · pp\)\)"),
    ({"ep": 2, "strategy": "deepspeed"}, 2, "strategy 'deepspeed' does not run with parallel.ep > 1: its engine "
                                            "owns the whole step"),
    ({"ep": 2, "tp": 2, "tp_impl": "torch"}, 4, r"parallel.ep > 1 runs with the hand-rolled tensor parallelism only"),
    ({"ep": 2, "pp": 2, "pp_impl": "torch", "strategy": "single"}, 4, "parallel.pp_impl torch runs without "
                                                                      "parallel.ep"),
    ({"ep": 2, "compile": True}, 2, "train.compile with parallel.ep > 1 is not supported yet"),
])
def test_expert_parallelism_is_validated_up_front(options, world_size, message):
    loop = dataclasses.replace(LOOP, compile=options.pop("compile", False))
    with pytest.raises(ConfigError, match=message):
        check_layout(ParallelConfig(**{"strategy": "ddp", **options}), world_size, loop)
    with pytest.raises(ConfigError, match=r"parallel.ep \(3\) must divide model.moe_experts \(4\)"):
        check_model(ParallelConfig(ep=3), MOE)
    with pytest.raises(ConfigError, match=r"parallel.ep \(2\) splits a mixture of experts: set model.moe_experts"):
        check_model(ParallelConfig(ep=2), TINY)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel cannot split a mixture of experts' tokens"):
        check_model(ParallelConfig(ep=2, tp=2, sequence_parallel=True), MOE)
    check_layout(ParallelConfig(strategy="ddp_naive", ep=2), 4, LOOP)
    for strategy in ("zero3", "fsdp", "torch_ddp"):  # every data-parallel strategy, and with tp and pp
        check_layout(ParallelConfig(strategy=strategy, ep=2, tp=2), 4, LOOP)
        check_layout(ParallelConfig(strategy=strategy, ep=2, pp=2), 4, LOOP)
    check_model(ParallelConfig(ep=4), MOE)
    check_model(ParallelConfig(ep=2, tp=2, pp=2), MOE)


def test_a_run_with_bad_expert_parallelism_fails_in_one_line_before_any_rank_starts(capsys, tmp_path, args):
    run = [*args, "--nproc-per-node", "2", "--strategy", "ddp", "--model.moe_experts", "3", "--parallel.ep", "2"]
    assert run_main([*run, "--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: parallel.ep (2) must divide model.moe_experts (3): every rank of an expert-parallel group holds as "
        "many experts"]
    assert run_main([*run[:-6], "--model.moe_experts", "4", "--parallel.ep", "2", "--strategy", "deepspeed",
                     "--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[0].startswith(
        "error: strategy 'deepspeed' does not run with parallel.ep > 1: its engine owns the whole step")
    assert not (tmp_path / "r").exists()


def test_gradient_buckets_never_mix_experts_with_weights_reduced_over_another_group():
    assert buckets([4, 4, 4, 4, 4], 12) == [[0, 1, 2], [3, 4]]
    assert buckets([4, 4, 4, 4, 4], 12, [False, True, True, False, False]) == [[0], [1, 2], [3, 4]]


def test_the_all_to_all_formula_counts_rows_both_ways_and_the_split_sizes():
    """2 layers × (forward + backward) × (dispatch + combine) × 128 tokens × top 2 × half to the other rank × 32 × 4
    bytes, plus the 2 row counts (8 bytes) each forward sends the other rank; recomputation adds a forward."""
    rows = 2 * 128 * 2 * 0.5 * 32 * 4
    assert accounting.expert_all_to_all_bytes(MOE, 128, 2) == 2 * (2 * rows + 2 * 8)
    assert accounting.expert_all_to_all_bytes(MOE, 128, 2, forwards=2) == 2 * (3 * rows + 2 * 2 * 8)
    assert accounting.expert_all_to_all_bytes(MOE, 128, 4) == 2 * (2 * rows * 1.5 + 3 * 8)


# ---------------------------------------------------------------- on gloo ranks


def _exchanges(world: World, spec: str, accum: int) -> dict:
    """One training step under ``spec`` after an evaluation: the exchanges' bytes (measured, theory), and the same
    bytes computed from what this rank's router sent where (its counts, and every rank's)."""
    parallel = parse_spec(spec)
    loop = LoopSettings(micro_batch=4, accum_steps=accum, grad_clip=1.0)
    strategy = create(parallel, world, Precision("cpu"), loop)
    strategy.build(lambda: GPT(MOE, seed=0), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    plan = StepPlan(4 * accum * world.world_size, accum, 1, 4, world.world_size)
    x, y = batch(Setup(model=MOE), 0, plan.global_sequences)
    strategy.eval_loss(x[:2], y[:2])  # not a training step's traffic
    strategy.module.take_router_counts()
    micro = [(x[lo:hi], y[lo:hi]) for lo, hi in (plan.micro_range(world.rank, m) for m in range(accum))]
    train_step(strategy, world, micro, accum, 1e-2, 1.0)
    layout = strategy.take_step_meters().layout
    mine = strategy.module.take_router_counts()[:, :MOE.moe_experts]  # [layer, expert]: this rank's assignments
    everyone = world.sum(mine)
    ep, per = parallel.ep, MOE.moe_experts // parallel.ep
    experts = next(t for t in strategy.transforms if t.name == "ep")
    held = range(experts.rank * per, (experts.rank + 1) * per)
    elsewhere = [e for e in range(MOE.moe_experts) if e not in held]
    group = experts.axis.sum(mine)  # the expert group's assignments
    rows = mine[:, elsewhere].sum() + (group - mine)[:, list(held)].sum()  # sent away, and sent back
    forwards = 1 if parallel.activation_checkpointing == "none" else 2
    counted = (forwards + 1) * rows.item() * MOE.d_model * 4 + forwards * accum * MOE.n_layer * per * (ep - 1) * 8
    meters = strategy.accounts.meters()
    return {"sent": layout["ep_a2a_bytes"], "theory": layout["ep_a2a_bytes_theory"], "counted": counted,
            "global": everyone.tolist(), "held": list(held), "synced": meters["comm_bytes_per_step"],
            "synced_theory": meters["comm_bytes_per_step_theory"], "states": meters["model_state_bytes"],
            "states_theory": meters["model_state_bytes_theory"]}


def _two_rank_checks(world: World, specs: list[str], clipped: list[str], bytes_specs: list[tuple[str, int]]) -> dict:
    exact = Setup(steps=3, grad_clip=0, model=MOE)
    return {"exact": equivalence(world, specs, exact),
            "clipped": equivalence(world, clipped, dataclasses.replace(exact, grad_clip=0.05)) if clipped else {},
            "bytes": [_exchanges(world, spec, accum) for spec, accum in bytes_specs]}


def _check_two_ranks(specs: list[str], clipped: list[str], bytes_specs: list[tuple[str, int]]) -> None:
    ranks = run_pooled(_two_rank_checks, 2, specs, clipped, bytes_specs)
    for spec, c in ranks[0]["exact"].items():
        assert c.same_losses and c.same_params and c.max_rel_grad_norm_diff < 1e-6, (spec, c)
    for spec, c in ranks[0]["clipped"].items():
        assert c.max_rel_loss_diff < 1e-6 and c.max_param_diff < 5e-5, (spec, c)
    for r in ranks:
        for spec, got in zip(bytes_specs, r["bytes"]):
            assert got["sent"] == got["counted"], (spec, got)
            assert 0.5 < got["sent"] / got["theory"] < 1.5, (spec, got)
    for first, second in zip(ranks[0]["bytes"], ranks[1]["bytes"]):
        assert first["global"] == second["global"] and first["held"] == [0, 1] and second["held"] == [2, 3]
        tokens = 2 * bytes_specs[0][1] * 4 * MOE.block_size  # 2 ranks × accum × micro-batch × block
        assert sum(map(sum, first["global"])) == MOE.n_layer * MOE.moe_top_k * tokens


@pytest.mark.slow
def test_ep2_trains_a_moe_as_single_does_and_counts_its_exchanges():
    """Bitwise under ddp (gradient clipping off: its norm is summed in another order, compared to 1e-6). The bytes
    sent equal those the routing implies (rows to the other rank's experts and back, forward and backward), near the
    balanced-routing theory; the router counts are global (each expert's summed over ranks, each rank's tokens
    counted once: layers × top_k × tokens) and the same on both ranks."""
    _check_two_ranks(["ddp:ep=2"], [], [("ddp:ep=2", 2)])


@pytest.mark.long
@pytest.mark.slow
def test_ep2_under_ddp_naive_zero_and_activation_checkpointing_trains_a_moe_as_single_does():
    """Bitwise under ddp_naive, zero1, zero2 (with the update offloaded too) and with full checkpointing; with
    clipping active and selective checkpointing, to the last bits; the recomputation's forward exchanges again, and
    is counted."""
    _check_two_ranks(["ddp_naive:ep=2", "ddp:ep=2,activation_checkpointing=full", "zero1:ep=2", "zero2:ep=2",
                      "zero2:ep=2,offload=optimizer"],
                     ["ddp:ep=2,activation_checkpointing=selective"],
                     [("ddp:ep=2,activation_checkpointing=full", 1), ("ddp_naive:ep=2", 1), ("zero2:ep=2", 1)])


def _four_rank_checks(world: World) -> tuple[dict, list[dict]]:
    setup = Setup(steps=3, grad_clip=1.0, model=MOE)
    return (equivalence(world, ["ddp", "ddp:ep=2", "ddp_naive:ep=2", "ddp:ep=4", "zero1:ep=2", "zero2:ep=2"], setup),
            [_exchanges(world, spec, 1) for spec in ("ddp:ep=2", "zero2:ep=2")])


@pytest.mark.long
@pytest.mark.slow
def test_ep2_by_dp2_and_ep4_train_a_moe_as_single_does_on_four_ranks():
    """To the tolerance of the module docstring (the four-term sums of plain ddp on 4 ranks). The gradient sync's
    bytes follow the ring formulas, and the model states (zero2: sharded) the ZeRO formulas, with the experts over
    their two ranks and the rest over all four."""
    ranks = run_pooled(_four_rank_checks, 4)
    for spec, c in ranks[0][0].items():
        assert c.max_rel_loss_diff < 1e-6 and c.max_rel_grad_norm_diff < 1e-6 and c.max_param_diff < 5e-5, (spec, c)
    for _, exchanges in ranks:
        for got in exchanges:
            del got["synced"]["broadcast"], got["synced_theory"]["broadcast"]  # ddp's first step: rank 0's bucket order
            assert got["sent"] == got["counted"] and got["synced"] == got["synced_theory"], got
            assert got["synced"]["all_reduce"] + got["synced"]["reduce_scatter"] > 0, got
            for kind in ("params", "grads", "optimizer"):  # AdamW's step counters are measured, not in the formula
                assert got["states"][kind] == pytest.approx(got["states_theory"][kind], rel=0.05), (kind, got)


# ---------------------------------------------------------------- runs end to end


def _train(world: World, argv: list[str], run_dir: Path, resume: bool) -> str:
    """What launch/run.py does on each rank once the group is up; the final status."""
    cfg = config_from_args(build_parser("launch/run.py", "").parse_args([*argv, "--run-dir", str(run_dir)]))
    data_dir = prepare(cfg.data, progress=False)
    resolve_vocab(cfg, load_tokenizer(data_dir / "tokenizer").vocab_size)
    return train(cfg, data_dir, run_dir, world, resume=resume)["status"]


def _records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.long
@pytest.mark.slow
def test_checkpoints_resume_across_ep_degrees(args, tmp_path):
    """A run under ep 2 (ddp, 2 ranks) stopped after 4 of 8 steps resumes under ep 2 and in one process (ep 1), and
    a single run's checkpoint resumes under ep 2: every continuation gives the losses of an uninterrupted single run
    (the 2-rank steps sum two micro-batches' gradients in another order than single's accumulation: 1e-6), and the
    final checkpoints hold every expert once (whole weights in one process, as export reads them). The records carry
    the exchanges' bytes and tokens per expert, the step line names them, the summary the bytes per step."""
    moe = [*args, "--model.moe_experts", "4", "--model.moe_top_k", "2"]
    ep2 = [*moe, "--strategy", "ddp", "--parallel.ep", "2"]
    assert run_main([*moe, "--run-dir", str(tmp_path / "single")]) == 0
    assert run_pooled(_train, 2, [*ep2, "--train.stop_after", "4"], tmp_path / "ep", False) == ["stopped"] * 2
    shutil.copytree(tmp_path / "ep", tmp_path / "ep-then-single")
    assert run_pooled(_train, 2, ep2, tmp_path / "ep", True) == ["completed"] * 2
    assert run_main([*moe, "--resume", "--run-dir", str(tmp_path / "ep-then-single")]) == 0
    assert run_main([*moe, "--train.stop_after", "4", "--run-dir", str(tmp_path / "single-then-ep")]) == 0
    assert run_pooled(_train, 2, ep2, tmp_path / "single-then-ep", True) == ["completed"] * 2

    reference = [r["loss"] for r in _records(tmp_path / "single")]
    cfg = dataclasses.replace(MOE, block_size=32, vocab_size=512, moe_granularity=1, moe_shared_experts=0)
    shapes = {name: p.shape for name, p in GPT(cfg).named_parameters()}
    ref = checkpoint.load_model(checkpoint.latest(tmp_path / "single"), shapes)
    for run in ("ep", "ep-then-single", "single-then-ep"):
        losses = [r["loss"] for r in _records(tmp_path / run)]
        assert len(losses) == 8 and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(reference, losses)), run
        whole = checkpoint.load_model(checkpoint.latest(tmp_path / run), shapes)
        assert max((whole[k] - ref[k]).abs().max().item() for k in ref) <= 1e-4, run
    rec = _records(tmp_path / "ep")[-1]
    assert rec["ep_a2a_bytes"] > 0 and rec["ep_a2a_bytes_theory"] > 0 and len(rec["moe_tokens_per_expert"]) == 4
    assert sum(rec["moe_tokens_per_expert"]) == cfg.n_layer * cfg.moe_top_k * 256  # a step's tokens, both ranks
    assert " | a2a " in format_step(rec, 8, 0.0)
    summary = json.loads((tmp_path / "ep" / "summary.json").read_text())
    assert summary["ep_a2a_bytes_per_step"] == rec["ep_a2a_bytes"] and summary["resumed_from_step"] == 4
    # export and sample read the checkpoint the ep layout wrote, as they read single's
    from lab.commands.cli import export_main, sample_main

    for run in ("ep", "single"):
        assert export_main([str(tmp_path / run), "--out", str(tmp_path / f"{run}.pt")]) == 0
    exported = [torch.load(tmp_path / f"{run}.pt", weights_only=True)["model"] for run in ("ep", "single")]
    assert exported[0].keys() == exported[1].keys()
    assert max((exported[0][k] - exported[1][k]).abs().max().item() for k in exported[1]) <= 1e-4
    assert sample_main([str(tmp_path / "ep"), "--prompt", "The", "--tokens", "5", "--temperature", "0"]) == 0
    assert summary["moe_last_step"]["moe_tokens_per_expert"] == rec["moe_tokens_per_expert"]
    for run in ("ep", "ep-then-single", "single-then-ep"):  # the held-out loss, evaluated through the exchanges too
        final = json.loads((tmp_path / run / "summary.json").read_text())["final_eval_loss"]
        assert math.isclose(final, json.loads((tmp_path / "single" / "summary.json").read_text())["final_eval_loss"],
                            rel_tol=1e-5), run
