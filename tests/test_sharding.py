"""The sharded strategies (zero1-3 by hand, FSDP2) with offload and activation checkpointing, on real ranks.

Every strategy and every option runs at least once on 2 and on 4 gloo ranks; the full matrix is
one command recorded in benchmarks/ (see the README). The reference is ``single`` accumulating the
same micro-batches (lab.equivalence).
"""

import dataclasses

import pytest
import torch

from lab.config import ModelConfig, ParallelConfig, TrainConfig
from lab.device import Precision
from lab.equivalence import TINY, Setup, batch, compare, equivalence, reference, train_tiny
from lab.model import GPT
from lab.optim import adamw_factory, param_groups
from lab.parallel import LoopSettings, World, create, parse_spec
from lab.parallel.activations import SavedBytes, apply
from lab.parallel.spawn import run_pooled
from lab.train import train_step
from test_distributed import GPTWithSometimesUnusedLayer, frozen_gpt

LOOP = LoopSettings(micro_batch=2, accum_steps=1, grad_clip=1.0)  # as the direct train_step calls
SHARDED = ["zero1", "zero2", "zero3", "fsdp", "fsdp:reshard_after_forward=false"]
OFFLOADED = ["zero1:offload=optimizer", "zero2:offload=optimizer", "zero3:offload=optimizer", "fsdp:offload=optimizer"]
CHECKPOINTED = ["ddp:activation_checkpointing=full", "torch_ddp:activation_checkpointing=full",
                "zero1:activation_checkpointing=full", "zero2:activation_checkpointing=full",
                "zero3:activation_checkpointing=full", "fsdp:activation_checkpointing=full",
                "zero2:activation_checkpointing=selective", "fsdp:activation_checkpointing=selective"]


def test_every_sharded_variant_reproduces_single_bit_for_bit_on_two_ranks():
    # One micro-batch per rank on 2 ranks: sums of two numbers and exact halving (see lab.equivalence).
    # Clipping off: the sharded gradient norm is summed shard by shard, so it may differ in the last bits.
    results = run_pooled(equivalence, 2, ["ddp", *SHARDED, *OFFLOADED, *CHECKPOINTED], Setup(steps=4, grad_clip=0))[0]
    for spec, r in results.items():
        assert r.same_losses and r.same_params, (spec, r)
        assert r.max_rel_grad_norm_diff <= 1e-6, (spec, r)


@pytest.mark.slow
def test_every_sharded_variant_matches_single_on_four_ranks_with_accumulation():
    specs = [*SHARDED, *OFFLOADED, "zero1:activation_checkpointing=full", "zero3:activation_checkpointing=full",
             "fsdp:activation_checkpointing=full", "zero2:activation_checkpointing=selective"]
    results = run_pooled(equivalence, 4, specs, Setup(steps=4, accum=4))[0]
    for spec, r in results.items():
        # regrouped fp32 sums: last-bit differences, carried by AdamW (tolerance as in test_distributed)
        assert r.max_rel_loss_diff <= 1e-6 and r.max_rel_grad_norm_diff <= 1e-5, (spec, r)
        assert r.max_param_diff <= 1e-3, (spec, r)


ODD = ModelConfig(n_layer=2, n_head=3, d_model=30, block_size=16, vocab_size=97)  # sizes that 4 does not divide


def _odd_sizes(world: World) -> dict:
    setup = Setup(steps=3, model=ODD)
    results = equivalence(world, ["zero1", "zero2", "zero3", "fsdp"], setup)
    s = create(ParallelConfig(strategy="zero3"), world, Precision("cpu", False), LOOP)
    s.build(lambda: GPT(ODD, seed=0), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    return {"results": results, "units": [(u.numel, u.padded) for u in s.units]}


@pytest.mark.slow
def test_parameter_counts_that_the_world_size_does_not_divide_are_padded():
    out = run_pooled(_odd_sizes, 4)[0]
    assert any(numel % 4 for numel, _ in out["units"]) and all(padded % 4 == 0 for _, padded in out["units"])
    for spec, r in out["results"].items():
        assert r.max_rel_loss_diff <= 1e-6 and r.max_param_diff <= 1e-3, (spec, r)


class GPTWithUnusedLayer(GPTWithSometimesUnusedLayer):
    """The extra weight never enters the loss: unused on every rank in every step."""

    def forward(self, idx, targets=None):
        return GPT.forward(self, idx, targets)


def _odd_parameters(world: World) -> dict:
    setup, out = Setup(steps=4, grad_clip=0), {}
    cases = {"frozen": lambda: frozen_gpt(setup.seed),
             # used by one rank and not the other in the same step; FSDP2 needs every rank to agree on which
             # parameters have gradients (its reduce-scatter is built from them), so it gets the next case
             "unused": lambda: GPTWithSometimesUnusedLayer(TINY, setup.seed),
             "never used": lambda: GPTWithUnusedLayer(TINY, setup.seed)}
    for label, factory in cases.items():
        ref = reference(world, setup, factory)
        for spec in ["zero1", "zero2", "zero3", "fsdp"]:
            if (label, spec) != ("unused", "fsdp"):
                got = train_tiny(world, setup, parse_spec(spec), factory)
                out[f"{label} {spec}"] = compare(ref, got) if world.is_main else None
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{label} {spec}" for label in ("frozen", "unused", "never used")
                                  for spec in ("zero1", "zero2", "zero3", "fsdp") if (label, spec) != ("unused", "fsdp")])
def test_frozen_and_unused_parameters_under_each_stage(odd_parameters, case):
    r = odd_parameters[case]
    assert r.same_losses and r.same_params, r  # the tied embedding is in every one of these models


@pytest.fixture(scope="module")
def odd_parameters():
    return run_pooled(_odd_parameters, 2)[0]


DEEP = ModelConfig(n_layer=6, n_head=2, d_model=64, block_size=32, vocab_size=64)


def _zero3_memory(world: World) -> dict:
    s = create(ParallelConfig(strategy="zero3"), world, Precision("cpu", False), LOOP)
    s.build(lambda: GPT(DEEP, seed=0), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    built = s.take_peak_param_bytes()
    x, y = batch(Setup(model=DEEP), 0, 4)
    train_step(s, world, [(x[2 * world.rank:2 * world.rank + 2], y[2 * world.rank:2 * world.rank + 2])], 1, 1e-3, 1.0)
    return {"built": built, "step": s.take_peak_param_bytes(), "shard": sum(u.chunk for u in s.units) * 4,
            "root": s.units[-1].padded * 4, "block": s.units[0].padded * 4, "model": sum(u.numel for u in s.units) * 4}


def test_zero3_never_holds_the_whole_model():
    m = run_pooled(_zero3_memory, 2)[0]
    bound = m["shard"] + m["root"] + 2 * m["block"]  # its shard, the root unit, about two blocks at once
    assert m["built"] == m["shard"]  # built from the meta device: only this rank's chunks ever existed
    assert m["shard"] < m["step"] <= bound < m["model"], m


def test_activation_checkpointing_saves_what_it_promises():
    """Saved-for-backward bytes of one micro-step, and the gradients are the same in every mode."""
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=64, vocab_size=512)
    x = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    saved, grads = {}, {}
    for mode in ("none", "full", "selective"):
        model, meter = GPT(cfg, seed=0), SavedBytes()
        apply(model, mode, meter)
        with meter.counting(model):
            loss = model(x, x)
        loss.backward()
        saved[mode], grads[mode] = meter.take(), [p.grad for p in model.parameters()]
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["full"] <= 0.3 * saved["none"]
    for mode in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[mode])), mode


@pytest.mark.slow
def test_bf16_autocast_runs_under_every_sharded_strategy():
    results = run_pooled(equivalence, 2, SHARDED, dataclasses.replace(Setup(steps=3), bf16=True))[0]
    for spec, r in results.items():
        assert r.max_rel_loss_diff <= 1e-3, (spec, r)
