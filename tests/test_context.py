"""Context parallelism (``parallel.cp``): each sequence's tokens split over the cp ranks, attention as a ring.

Against ``single`` accumulating the same micro-batches: the ring merges each query's attention over the key/value
blocks by log-sum-exp (another order of the same sums than one kernel's), so losses agree to 1e-6 relative,
gradient norms to 1e-5 and the weights to 1e-3 after 3 clipped steps at lr 1e-2 (measured: 2e-7, 1e-6 and 5e-5),
gpt2 and modern (one key/value head for two query heads: the ring sends the key/value heads only).
"""

import dataclasses
from pathlib import Path

import pytest
import torch

from lab.commands.equivalence import TINY, Setup, batch, equivalence
from lab.measure import accounting
from lab.measure.device import Precision
from lab.measure.memory import LiveBytes
from lab.model import GPT
from lab.parallel import Layout, LoopSettings, World, parse_spec, strategy_class
from lab.training.plan import check_layout, check_model, create
from lab.parallel.axes.context import chunks, token_indices
from lab.runtime import checkpoint
from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from lab.training.optim import adamw_factory, param_groups
from lab.training.train import train_step
from pool import run_pooled

MODERN = dataclasses.replace(TINY, arch="modern", n_kv_head=1)
CLIP = 0.05  # below every step's norm: clipping acts, so a wrong global norm changes the weights
LONG = ModelConfig(n_layer=2, n_head=4, d_model=64, block_size=2048, vocab_size=256)


def _close(c) -> bool:
    return c.max_rel_loss_diff <= 1e-6 and c.max_rel_grad_norm_diff <= 1e-5 and c.max_param_diff <= 1e-3


# ---------------------------------------------------------------- no ranks


def test_the_zigzag_split_gives_every_rank_two_chunks_and_the_same_causal_work():
    """Rank r of n holds chunks r and 2n − 1 − r of 2n; every rank scores (2n + 1)·c² query-key pairs of chunks of c
    tokens (chunk i scores i full chunks and itself causally), where the contiguous split gives rank r (r + ½)·c'²."""
    n, length = 4, 32
    held = [token_indices(length, r, n, "zigzag") for r in range(n)]
    assert sorted(torch.cat(held).tolist()) == list(range(length))
    assert held[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    c = length // (2 * n)
    work = [sum(i * c * c + c * (c + 1) // 2 for i, _ in chunks(length, r, n, "zigzag")) for r in range(n)]
    assert len(set(work)) == 1
    assert [i for i, _ in chunks(length, 3, n, "contiguous")] == [3]


@pytest.mark.parametrize("options, world_size, message", [
    ({"cp": 0}, 2, "parallel.cp must be at least 1, got 0"),
    ({"cp": 3}, 4, r"parallel.tp × parallel.pp × parallel.cp \(1 × 1 × 3\) must divide the world size \(4\)"),
    ({"cp": 2, "strategy": "single"}, 2, "strategy 'single' does not run with parallel.cp > 1: the cp ranks' "
                                         "gradients are averaged"),
    ({"cp": 2, "strategy": "deepspeed"}, 2, "strategy 'deepspeed' does not run with parallel.cp > 1: its engine"),
    ({"cp": 2, "cp_split": "zigzig"}, 2, "parallel.cp_split must be one of zigzag, contiguous, got 'zigzig'"),
    ({"cp_impl": "allgather"}, 2, "parallel.cp_impl has no effect with parallel.cp 1"),
    ({"cp": 2, "tp": 2, "sequence_parallel": True}, 4, "parallel.cp > 1 runs with the hand-rolled tensor "
                                                       "parallelism without sequence parallelism"),
])
def test_context_parallelism_is_validated_up_front(options, world_size, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(ParallelConfig(**{"strategy": "ddp", **options}), world_size, LoopSettings(4, 1, 1.0))


@pytest.mark.parametrize("model, message", [
    (dict(block_size=30), r"model.block_size \(30\) must be a multiple of 4 \(parallel.cp 2, zigzag split"),
    (dict(moe_experts=4), "parallel.cp > 1 cannot shard a mixture of experts' tokens"),
    (dict(dropout=0.1), r"parallel.cp > 1 runs without dropout"),
])
def test_models_context_parallelism_cannot_split_are_refused(model, message):
    with pytest.raises(ConfigError, match=message):
        check_model(ParallelConfig(strategy="ddp", cp=2), dataclasses.replace(TINY, **model))


@pytest.mark.slow
def test_a_context_not_divisible_by_two_cp_is_refused_before_any_rank_starts(capsys, tmp_path, args):
    from lab.commands.cli import run_main

    assert run_main([*args, "--nproc-per-node", "2", "--strategy", "ddp", "--parallel.cp", "2", "--model.block_size",
                     "30", "--train.batch_tokens", "120", "--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: model.block_size (30) must be a multiple of 4 (parallel.cp 2, zigzag split: 4 chunks of the sequence)"]
    assert not (tmp_path / "r").exists()


def test_the_planner_proposes_context_parallelism_for_a_long_context(capsys):
    """At 131k tokens nothing fits in 8 GB without splitting the sequence: the mesh planner prices cp and picks it."""
    from lab.commands.resources import main

    assert main(["mesh", "--preset", "small-modern", "--vocab", "32000", "--seq-len", "131072", "--n-gpus", "8",
                 "--memory-gb", "8"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits without splitting the sequence" in out
    choice = next(line for line in out.splitlines() if line.startswith("choice:"))
    assert "--parallel.cp " in choice


# ---------------------------------------------------------------- equivalence with single


def _both_archs(world: World, specs: list[str], setup: Setup) -> dict:
    return {arch: equivalence(world, specs, dataclasses.replace(setup, model=model))
            for arch, model in (("gpt2", TINY), ("modern", MODERN))}


def _check(results: dict, specs: list[str]) -> None:
    for arch, by_spec in results.items():
        assert set(by_spec) == set(specs)
        for spec, c in by_spec.items():
            assert _close(c), (arch, spec, c)


@pytest.mark.slow
def test_cp2_reproduces_single_with_the_ring_both_splits_and_the_reference():
    specs = ["ddp:cp=2", "zero3:cp=2", "ddp:cp=2,cp_split=contiguous", "ddp:cp=2,cp_impl=allgather"]
    _check(run_pooled(_both_archs, 2, specs, Setup(steps=3, accum=2, micro_batch=4, grad_clip=CLIP))[0], specs)


@pytest.mark.slow
def test_cp4_and_cp_by_dp_tp_pp_reproduce_single_on_four_ranks():
    specs = ["ddp:cp=4", "zero2:cp=2", "fsdp:cp=2,tp=2", "zero1:cp=2,pp=2", "torch_ddp:cp=2"]
    _check(run_pooled(_both_archs, 4, specs, Setup(steps=3, accum=2, micro_batch=4, grad_clip=CLIP))[0], specs)


def _logits(world: World, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's logits (no targets) under ``spec`` (gathered in sequence order) and under single."""
    x, _ = batch(Setup(model=MODERN), 0, 2)
    out = []
    for parallel, on in ((parse_spec(spec), world), (ParallelConfig(), World(0, 1, 0, world.device))):
        strategy = create(parallel, on, Precision("cpu"), LoopSettings(2, 1, 1.0))
        strategy.build(lambda: GPT(MODERN), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), on.device))
        with torch.no_grad():
            out.append(strategy.strategy.model(x))
    return out[0], out[1]


@pytest.mark.slow
def test_the_logits_of_a_batch_under_cp4_are_singles():
    for sharded, whole in run_pooled(_logits, 4, "ddp:cp=4"):
        assert sharded.shape == whole.shape and torch.allclose(sharded, whole, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- meters


def _step_record(world: World, spec: str) -> dict:
    model = dataclasses.replace(TINY, block_size=64)
    strategy = create(parse_spec(spec), world, Precision("cpu"), LoopSettings(4, 1, 1.0))
    strategy.build(lambda: GPT(model), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    replica, replicas = Layout.of(parse_spec(spec), world.world_size).data_replica(world.rank)
    x, y = batch(Setup(model=model), 0, 4 * replicas)
    train_step(strategy, world, [(x[4 * replica:4 * replica + 4], y[4 * replica:4 * replica + 4])], 1, 1e-2, 1.0)
    return strategy.take_step_meters().layout


@pytest.mark.slow
def test_the_balanced_split_spreads_the_work_and_the_ring_sends_its_theory():
    """cp 4: the zigzag split's query-key pairs per rank (counted from the blocks each rank ran) are within 5 % of their
    mean, the contiguous split's last rank scores far more than the mean; the key/value bytes each rank sent (the
    ring's and the all-gather reference's, with activation checkpointing's second forward too) equal theory."""
    for spec, balanced in (("ddp:cp=4", True), ("ddp:cp=4,cp_split=contiguous", False),
                           ("ddp:cp=4,cp_impl=allgather", True), ("ddp:cp=4,activation_checkpointing=full", True)):
        for record in run_pooled(_step_record, 4, spec):
            assert record["cp_kv_bytes"] == record["cp_kv_bytes_theory"] > 0, (spec, record)
            ratio = record["cp_work_max_over_mean"]
            assert ratio <= 1.05 if balanced else ratio > 1.5, (spec, ratio)


def _activation_peak(world: World, spec: str) -> int:
    """The most bytes live during one forward and backward (every tensor allocation, ``LiveBytes``), the gradients
    (as many on every rank) left out."""
    strategy = create(parse_spec(spec), world, Precision("cpu"), LoopSettings(1, 1, 1.0))
    strategy.build(lambda: GPT(LONG), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    x, y = batch(Setup(model=LONG), 0, 1)
    with LiveBytes() as meter:
        meter.enter_phase("forward")
        strategy.backward(strategy.forward(x, y, sync=True))
        peaks, _ = meter.take_peaks()
    return max(peaks.values()) - sum(p.numel() * 4 for p in strategy.module.parameters())


@pytest.mark.slow
def test_cp4_holds_a_quarter_of_the_activations_and_the_planner_says_so():
    """A 2,048-token context: each rank of cp 4 holds at most 0.35 of one process's activations at the peak (measured:
    0.25), and ``accounting.activation_peak_bytes`` is within 10 % of both measured peaks."""
    single = _activation_peak(World(0, 1, 0, torch.device("cpu")), "single")
    sharded = run_pooled(_activation_peak, 4, "ddp:cp=4")
    assert max(sharded) <= 0.35 * single, (sharded, single)
    for measured, cp in ((single, 1), (max(sharded), 4)):
        assert accounting.activation_peak_bytes(LONG, 1, 4, cp=cp) == pytest.approx(measured, rel=0.10), cp


def test_the_memory_check_refuses_one_process_and_admits_cp4():
    """Under a 20 MiB budget a process cannot hold a 2,048-token context's activations; a rank of cp 4 can."""
    from lab.measure.device import Peak
    from lab.runtime.config import RunConfig
    from lab.training.admission import check_resources

    def estimate(ranks: int, **parallel: object) -> float:
        cfg = RunConfig(model=LONG, parallel=ParallelConfig(**parallel))
        cfg.train.micro_batch, cfg.train.batch_tokens, cfg.train.memory_budget = 1, 2048 * ranks, 20 / 1024
        layout = Layout.of(cfg.parallel, ranks, strategy_class(cfg.parallel.strategy))
        return check_resources(cfg, layout, World(0, ranks, 0, torch.device("cpu")), Precision("cpu"), Peak(1e12, "t"),
                               256, 20 * 2**20).memory_bytes

    with pytest.raises(ConfigError, match="parallel.cp splits every sequence"):
        estimate(1)
    assert estimate(4, strategy="ddp", cp=4) <= 20 * 2**20


# ---------------------------------------------------------------- checkpoints


def _train_and_save(world: World, spec: str, folder: Path) -> None:
    strategy = create(parse_spec(spec), world, Precision("cpu"), LoopSettings(4, 1, 1.0))
    strategy.build(lambda: GPT(MODERN), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    replica, replicas = Layout.of(parse_spec(spec), world.world_size).data_replica(world.rank)
    x, y = batch(Setup(model=MODERN), 0, 4 * replicas)
    train_step(strategy, world, [(x[4 * replica:4 * replica + 4], y[4 * replica:4 * replica + 4])], 1, 1e-2, 1.0)
    checkpoint.save(folder, 1, world.rank, world.world_size, strategy.checkpoint_state(), {}, 1)


def _load_and_save(world: World, spec: str, source: Path, target: Path) -> None:
    strategy = create(parse_spec(spec), world, Precision("cpu"), LoopSettings(4, 1, 1.0))
    strategy.build(lambda: GPT(MODERN), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    checkpoint.load(checkpoint.latest(source), world.rank, world.world_size, strategy.checkpoint_state())
    strategy.after_load()
    checkpoint.save(target, 1, world.rank, world.world_size, strategy.checkpoint_state(), {}, 1)


@pytest.mark.slow
def test_a_checkpoint_moves_between_context_parallel_degrees_intact(tmp_path):
    """zero2 · cp 2 · dp 2 → ddp · cp 4 → one process: every weight, moment and step counter the same bits."""
    first, second, third = tmp_path / "zero2-cp2", tmp_path / "ddp-cp4", tmp_path / "single"
    run_pooled(_train_and_save, 4, "zero2:cp=2", first)
    run_pooled(_load_and_save, 4, "ddp:cp=4", first, second)
    _load_and_save(World(0, 1, 0, torch.device("cpu")), "single", second, third)
    stored = [checkpoint.load_everything(checkpoint.latest(folder)) for folder in (first, second, third)]
    for other in stored[1:]:
        assert other.keys() == stored[0].keys() and all(torch.equal(other[k], stored[0][k]) for k in other)
