"""Tensor and sequence parallelism (``parallel.tp``, ``parallel.sequence_parallel``) on real gloo ranks.

The reference is ``single`` accumulating the micro-batches of every data-parallel replica (lab.equivalence).
Tensor parallelism sums partial matmul products over the group (g's all-reduce, the loss's sums over
vocabulary shards) in another order than one process's matmul, so nothing is bitwise: losses and the
losses agree to ~1e-7 relative (tested at 1e-6). AdamW, which divides by the root of tiny second moments,
carries last-bit gradient differences into the weights at up to ~1e-4 after a few steps at lr 1e-2
(tested at 1e-3, a tenth of one step, as the data-parallel suite does); the gradient norm of the later
steps, taken at those weights, then differs by up to ~3e-6 relative (tested at 1e-5, as there).
"""

import dataclasses
import math

import pytest
import torch

from lab import accounting, checkpoint
from lab.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from lab.device import Precision
from lab.equivalence import TINY, Setup, equivalence, loop_settings, train_tiny
from lab.parallel import LoopSettings, World, create, parse_spec, validate, validate_model
from lab.parallel.spawn import run_pooled
from lab.parallel.tensor import Split

MODERN = ModelConfig(arch="modern", n_layer=2, n_head=4, n_kv_head=2, d_model=32, block_size=32, vocab_size=96)
ARCHS = {"gpt2": TINY, "modern": MODERN}
CLIP = 0.05  # below every step's norm: clipping acts, so a wrong global norm changes the weights


def _close(r) -> bool:
    return r.max_rel_loss_diff <= 1e-6 and r.max_rel_grad_norm_diff <= 1e-5 and r.max_param_diff <= 1e-3


# ---------------------------------------------------------------- validation, no ranks


@pytest.mark.parametrize("options, world_size, message", [
    ({"tp": 3}, 4, r"parallel.tp \(3\) must divide the world size \(4\)"),
    ({"tp": 0}, 4, "parallel.tp must be at least 1"),
    ({"sequence_parallel": True}, 2, "sequence_parallel needs parallel.tp > 1"),
    ({"strategy": "deepspeed", "tp": 2}, 4, "strategy 'deepspeed' does not run with parallel.tp > 1"),
    ({"strategy": "single", "tp": 2}, 4, "strategy 'single' runs on at most 1 process"),
])
def test_the_mesh_is_validated_up_front(options, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate(ParallelConfig(**options), world_size, LoopSettings(micro_batch=2, accum_steps=1, grad_clip=1.0))


@pytest.mark.parametrize("model, options, message", [
    (dict(n_head=3, d_model=48), {}, r"must divide model.n_head, which is 3"),
    (dict(n_head=4, n_kv_head=1), {}, r"must divide model.n_kv_head"),
    (dict(vocab_size=97), {}, r"set model.pad_vocab_to to a multiple of 2"),
    (dict(block_size=33), {"sequence_parallel": True}, "must divide model.block_size"),
])
def test_shapes_the_group_cannot_split_are_refused(model, options, message):
    with pytest.raises(ConfigError, match=message):
        validate_model(ParallelConfig(tp=2, **options), dataclasses.replace(TINY, **model))


def test_a_run_with_a_bad_degree_fails_in_one_line_before_any_work(capsys, tmp_path):
    from lab.cli import run_main

    assert run_main(["--parallel.tp", "3", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: parallel.tp (3) must divide the world size (1)"]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("shape, dim, blocks", [((12, 4), 0, (4, 4, 4)), ((3, 8), 1, (8,)), ((8,), 0, (4, 4))])
def test_a_split_takes_assembles_and_places_every_element_once(shape, dim, blocks):
    whole = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    split = Split(shape, dim, blocks)
    shards = [split.take(whole, r, 2) for r in range(2)]
    assert torch.equal(split.assemble(shards), whole)
    placed = torch.full((whole.numel(),), -1.0)
    for r, shard in enumerate(shards):
        flat = shard.reshape(-1)
        for lo, hi in ((0, 3), (3, flat.numel())):  # two ranges of the shard, as a ZeRO chunk boundary cuts it
            for start, view in split.flat_pieces(r, 2, lo, flat[lo:hi]):
                assert (placed[start:start + view.numel()] == -1).all()
                placed[start:start + view.numel()] = view
    assert torch.equal(placed, whole.reshape(-1))


# ---------------------------------------------------------------- equivalence with single


def _both_archs(world: World, specs: list[str], setup: Setup) -> dict:
    return {arch: equivalence(world, specs, dataclasses.replace(setup, model=model)) for arch, model in ARCHS.items()}


def test_tp2_reproduces_single_under_every_data_parallel_strategy_on_two_ranks():
    specs = ["single:tp=2", "ddp:tp=2", "zero2:tp=2", "zero3:tp=2", "torch_ddp:tp=2", "fsdp:tp=2",
             "zero1:tp=2,activation_checkpointing=full"]
    results = run_pooled(_both_archs, 2, specs, Setup(steps=3, grad_clip=CLIP))[0]
    for arch, by_spec in results.items():
        assert set(by_spec) == set(specs)
        for spec, r in by_spec.items():
            assert _close(r), (arch, spec, r)


@pytest.mark.slow
def test_tp2_by_dp2_reproduces_single_with_accumulation_and_clipping_on_four_ranks():
    specs = ["ddp:tp=2", "zero2:tp=2", "zero3:tp=2", "fsdp:tp=2", "zero2:tp=2,sequence_parallel=true"]
    results = run_pooled(_both_archs, 4, specs, Setup(steps=3, accum=2, grad_clip=CLIP))[0]
    for arch, by_spec in results.items():
        for spec, r in by_spec.items():
            assert _close(r), (arch, spec, r)


def test_sequence_parallel_reproduces_single_on_two_ranks():
    specs = ["ddp:tp=2,sequence_parallel=true", "zero3:tp=2,sequence_parallel=true"]
    results = run_pooled(_both_archs, 2, specs, Setup(steps=3, accum=2, grad_clip=CLIP))[0]
    for arch, by_spec in results.items():
        for spec, r in by_spec.items():
            assert _close(r), (arch, spec, r)
