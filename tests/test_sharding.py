"""The sharded strategies (zero1-3 by hand, FSDP2) with offload and activation checkpointing, on real ranks.

Every strategy and every option runs at least once on 2 and on 4 gloo ranks; the full matrix is
one command recorded in benchmarks/ (see the README). The reference is ``single`` accumulating the
same micro-batches (lab.commands.equivalence).
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lab.measure import accounting, memory
from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from lab.measure.device import Precision
from lab.commands.equivalence import TINY, Setup, batch, compare, equivalence, reference, train_tiny
from lab.model import GPT
from lab.training.optim import adamw_factory, param_groups
from lab.parallel import LoopSettings, World, parse_spec
from lab.training.plan import create
from lab.parallel.axes.activations import SavedBytes, apply
from lab.parallel.comm import Comm
from pool import run_pooled
from lab.training.train import train_step
from test_distributed import GPTWithSometimesUnusedLayer, frozen_gpt, rank_dependent_gpt

LOOP = LoopSettings(micro_batch=2, accum_steps=1, grad_clip=1.0)  # as the direct train_step calls
SHARDED = ["zero1", "zero2", "zero3", "fsdp", "fsdp:reshard_after_forward=false"]
OFFLOADED = ["zero1:offload=optimizer", "zero2:offload=optimizer", "zero3:offload=optimizer", "fsdp:offload=optimizer"]
CHECKPOINTED = ["ddp:activation_checkpointing=full", "torch_ddp:activation_checkpointing=full",
                "zero1:activation_checkpointing=full", "zero2:activation_checkpointing=full",
                "zero3:activation_checkpointing=full", "fsdp:activation_checkpointing=full",
                "zero2:activation_checkpointing=selective", "fsdp:activation_checkpointing=selective"]


@pytest.mark.slow
def test_every_sharded_variant_reproduces_single_bit_for_bit_on_two_ranks():
    # One micro-batch per rank on 2 ranks: sums of two numbers and exact halving (see lab.commands.equivalence).
    # Clipping off: the sharded gradient norm is summed shard by shard, so it may differ in the last bits.
    results = run_pooled(equivalence, 2, ["ddp", *SHARDED, *OFFLOADED, *CHECKPOINTED], Setup(steps=4, grad_clip=0))[0]
    for spec, r in results.items():
        assert r.same_losses and r.same_params, (spec, r)
        assert r.max_rel_grad_norm_diff <= 1e-6, (spec, r)


@pytest.mark.slow
def test_the_norm_of_large_shards_matches_single():
    # an MLP unit's shard here (two d × 4d matrices on 2 ranks: 262,144 elements) spans many parameters' ranges
    model = ModelConfig(n_layer=1, n_head=2, d_model=256, block_size=8, vocab_size=64)
    results = run_pooled(equivalence, 2, ["zero2", "zero3"], Setup(steps=2, grad_clip=0, model=model))[0]
    for spec, r in results.items():
        assert r.same_losses and r.same_params, (spec, r)
        assert r.max_rel_grad_norm_diff <= 1e-6, (spec, r)


@pytest.mark.long
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
    s = create(ParallelConfig(strategy="zero3"), world, Precision("cpu"), LOOP)
    s.build(lambda: GPT(ODD, seed=0), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    return {"results": results, "units": [(u.numel, u.padded) for u in s.strategy.units]}


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
                                  for spec in ("zero1", "zero2", "zero3", "fsdp")
                                  if (label, spec) != ("unused", "fsdp")])
def test_frozen_and_unused_parameters_under_each_stage(odd_parameters, case):
    r = odd_parameters[case]
    assert r.same_losses and r.same_params, r  # the tied embedding is in every one of these models


@pytest.fixture(scope="module")
def odd_parameters():
    return run_pooled(_odd_parameters, 2)[0]


def test_activation_checkpointing_saves_what_it_promises():
    """Saved-for-backward bytes of one micro-step, and the gradients are the same in every mode."""
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=64, vocab_size=512)
    x = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    saved, grads = {}, {}
    for mode in ("none", "full", "selective"):
        model, meter = GPT(cfg, seed=0), SavedBytes()
        apply(model, model.parallel_plan(), mode, meter)
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
    results = run_pooled(equivalence, 2, SHARDED, dataclasses.replace(Setup(steps=3), dtype="bf16"))[0]
    for spec, r in results.items():
        assert r.max_rel_loss_diff <= 1e-3, (spec, r)


WIDE = ModelConfig(n_layer=6, n_head=2, d_model=64, block_size=8, vocab_size=64)  # weights outweigh activations


def _peak_bytes_by_kind(world: World, spec: str) -> dict:
    """Tensor storages tracked by allocation (lab.measure.memory) over two steps after the build, by kind."""
    meter = memory.Meter(world.device)
    with meter.running():
        s = create(parse_spec(spec), world, Precision("cpu"), LOOP)
        s.build(lambda: GPT(WIDE, seed=0), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
        built = meter.live.take_peaks()[1]
        for step in range(2):
            x, y = batch(Setup(model=WIDE), step, 4)
            train_step(s, world, [(x[2 * world.rank:2 * world.rank + 2], y[2 * world.rank:2 * world.rank + 2])], 1,
                       1e-3, 1.0)
        phases, kinds = meter.live.take_peaks()
    return {"built": built, "kinds": kinds, "phases": phases, "shard": sum(u.chunk for u in s.strategy.units) * 4,
            "units": [u.padded * 4 for u in s.strategy.units],
            "largest_param": max(p.numel() for p in s.strategy.units[0].params) * 4,
            "largest_vector": max(p.numel() for u in s.strategy.units for p in u.params if p.dim() == 1) * 4}


@pytest.mark.slow
def test_zero3_peak_parameter_bytes_are_one_shard_and_two_units_measured_by_allocation():
    m = run_pooled(_peak_bytes_by_kind, 2, "zero3")[0]
    *blocks, root = m["units"]
    assert len(blocks) == 2 * WIDE.n_layer  # half blocks: the attention with its norm, the MLP with its own
    bound = m["shard"] + root + 2 * max(blocks)  # its shard, the root unit, the unit at work and the next one
    assert m["shard"] + root < m["kinds"]["params"] <= bound < sum(m["units"]), m
    assert m["built"]["params"] == m["shard"]  # built from the meta device: only this rank's chunks ever existed


def _storages_grown_by_gathers(world: World) -> dict:
    """The sizes storages were given by ``resize_`` (nonzero: fresh memory) during zero3's third step."""
    s = create(parse_spec("zero3"), world, Precision("cpu"), LOOP)
    s.build(lambda: GPT(WIDE, seed=0), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    resize, grown = torch.UntypedStorage.resize_, []

    def counted(storage: torch.UntypedStorage, size: int) -> None:
        grown.extend([size] if size else [])
        resize(storage, size)

    for step in range(3):
        x, y = batch(Setup(model=WIDE), step, 4)
        torch.UntypedStorage.resize_ = counted if step == 2 else resize
        try:
            train_step(s, world, [(x[2 * world.rank:2 * world.rank + 2], y[2 * world.rank:2 * world.rank + 2])], 1,
                       1e-3, 1.0)
        finally:
            torch.UntypedStorage.resize_ = resize
    return {"grown": grown}


@pytest.mark.slow
def test_zero3_gathers_reuse_resident_buffers_after_the_first_step():
    # every unit is gathered twice a step (13 units here); each gather borrows a pool buffer's memory instead
    for rank in run_pooled(_storages_grown_by_gathers, 2):
        assert rank["grown"] == [], rank


@pytest.mark.slow
def test_zero2_peak_gradient_bytes_are_one_shard_and_the_buckets_in_flight_measured_by_allocation():
    m = run_pooled(_peak_bytes_by_kind, 2, "zero2:bucket_mb=0.1")[0]
    assert len(m["units"]) >= 6, m
    # this rank's gradient shard, one bucket filling and one reduce-scattering, and one node's fresh gradients (a
    # linear hands its weight's and its bias's over together: seen once, 768 bytes over without the bias)
    bound = m["shard"] + 2 * max(m["units"]) + m["largest_param"] + m["largest_vector"]
    assert m["shard"] < m["kinds"]["grads"] <= bound, m


def _resident_growth(world: World) -> dict:
    """The kernel's high-water mark over the resident set (VmHWM, reset through /proc/self/clear_refs) during the
    lab's all-gather and reduce-scatter of 16 MiB on gloo, with every tensor they write already resident."""
    memory.return_freed_memory_to_kernel()
    comm, n, me = Comm(world.world_size), 2**22, world.rank
    gathered, shard = torch.zeros(n), torch.full((n // world.world_size,), float(me))
    summed, grads = torch.zeros(n // world.world_size), torch.arange(n, dtype=torch.float32) * (me + 1)

    def growth(collective) -> int:
        Path("/proc/self/clear_refs").write_text("5")
        before = memory.proc_kib_field("/proc/self/status", "VmRSS")
        collective()
        return memory.peak_rss_bytes() - before

    out = {"gather": growth(lambda: comm.all_gather(gathered, shard)),
           "scatter": growth(lambda: comm.reduce_scatter(summed, grads))}
    expected = torch.arange(n, dtype=torch.float32).view(world.world_size, -1)[me] * 3  # ranks multiply by 1 and 2
    out["right"] = (torch.equal(gathered, torch.arange(world.world_size).repeat_interleave(n // world.world_size)
                                .float()) and torch.equal(summed, expected))
    return out


@pytest.mark.slow
def test_gloo_all_gather_and_reduce_scatter_hold_no_hidden_copy_by_the_kernels_count():
    # gloo's own all_gather_into_tensor receives into a 16 MiB buffer of its own (+16 MiB resident, unseen by the
    # lab's tensor meter); the lab's receives in place. Its reduce-scatter receives the other rank's 8 MiB chunk
    # straight into the output and sums there.
    for rank in run_pooled(_resident_growth, 2):
        assert rank["right"], rank
        assert rank["gather"] < 4 * 2**20, rank
        assert rank["scatter"] < 4 * 2**20, rank


def _rank_dependent_frozen_gpt(seed: int) -> GPT:
    """Frozen weights and a buffer that differ between ranks: the strategy must start every rank from rank 0's."""
    model = frozen_gpt(seed + dist.get_rank())
    model.register_buffer("scale", torch.full((3,), float(dist.get_rank())))
    return model


def _start_values(world: World) -> dict:
    out = {}
    for spec in ("zero1", "zero2"):
        s = create(parse_spec(spec), world, Precision("cpu"), LOOP)
        s.build(lambda: _rank_dependent_frozen_gpt(0), lambda m: param_groups(m, 0.1),
                adamw_factory(TrainConfig(), world.device))
        frozen = {n: p.detach().clone() for n, p in s.module.named_parameters() if not p.requires_grad}
        out[spec] = frozen | {n: b.clone() for n, b in s.module.named_buffers()}
    s = create(ParallelConfig(strategy="zero3"), world, Precision("cpu"), LOOP)
    try:
        s.build(lambda: rank_dependent_gpt(0), lambda m: param_groups(m, 0.1),
                adamw_factory(TrainConfig(), world.device))
    except ConfigError as e:
        out["zero3"] = str(e)
    return out


def test_every_stage_starts_every_rank_from_the_same_values():
    rank0, rank1 = run_pooled(_start_values, 2)
    for spec in ("zero1", "zero2"):  # frozen parameters and buffers broadcast from rank 0, not only the trainable
        assert set(rank0[spec]) == {"wpe.weight", "blocks.0.norm1.weight", "scale"}
        assert all(torch.equal(rank0[spec][n], rank1[spec][n]) for n in rank0[spec]), spec
    # zero3 builds each rank's shard from the model's init: ranks whose initial values differ are refused
    assert rank0["zero3"] == rank1["zero3"]
    assert "initial weights" in rank0["zero3"] and "differs between ranks" in rank0["zero3"]
    assert "\n" not in rank0["zero3"]


THEORY = ModelConfig(n_layer=8, n_head=4, d_model=256, block_size=16, vocab_size=256)  # states dominate, 8 units


def _peak_against_theory(world: World, cases: list[tuple[str, int]]) -> dict:
    """Per case, the measured peak bytes of each phase of the second step over peak_bytes_theory, less one."""
    out = {}
    for spec, accum in cases:
        meter = memory.Meter(world.device)
        with meter.running():
            s = create(parse_spec(spec), world, Precision("cpu"), LoopSettings(1, accum, 1.0))
            s.build(lambda: GPT(THEORY, seed=0), lambda m: param_groups(m, 0.1),
                    adamw_factory(TrainConfig(), world.device))
            for step in range(2):  # the second step holds the optimizer's states from the start
                x, y = batch(Setup(model=THEORY), step, 2 * accum)
                mine = range(world.rank * accum, (world.rank + 1) * accum)
                train_step(s, world, [(x[i:i + 1], y[i:i + 1]) for i in mine], accum, 1e-3, 1.0)
                peaks = meter.take_step_peaks()
        activations = accounting.activation_bytes(THEORY, 1, 4, s.cfg.activation_checkpointing == "full")
        theory = s.accounts.peak_bytes_theory(activations)
        out[f"{spec} accumulating {accum}"] = {phase: peaks[phase] / theory[phase] - 1 for phase in theory}
    return out


@pytest.mark.long
@pytest.mark.slow
def test_peak_bytes_match_theory_under_accumulation_offload_and_checkpointing():
    cases = [("zero1:bucket_mb=4", 2), ("zero2:bucket_mb=4", 2), ("zero3", 2), ("ddp", 2),
             ("zero2:bucket_mb=4,offload=optimizer", 1), ("zero3:offload=optimizer", 1),
             ("zero3:activation_checkpointing=full", 1)]
    for case, gaps in run_pooled(_peak_against_theory, 2, cases)[0].items():
        assert all(abs(gap) <= 0.1 for gap in gaps.values()), (case, gaps)
