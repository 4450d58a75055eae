"""Tensor and sequence parallelism (``parallel.tp``, ``parallel.sequence_parallel``) on real gloo ranks.

The reference is ``single`` accumulating the micro-batches of every data-parallel replica (lab.commands.equivalence).
Tensor parallelism sums partial matmul products over the group (g's all-reduce, the loss's sums over
vocabulary shards) in another order than one process's matmul, so nothing is bitwise: losses and the
losses agree to 2.1e-7 relative at most (tested at 1e-6). AdamW, which divides by the root of tiny second
moments, carries last-bit gradient differences into the weights: up to 2.7e-5 after 3 steps at lr 1e-2
(tested at 1e-3, a tenth of one step, as the data-parallel suite does); the gradient norm of the later
steps, taken at those weights, then differs by up to 2.7e-6 relative (tested at 1e-5, as there).
"""

import dataclasses
import functools
import math

import pytest
import torch

from lab.measure import accounting

from lab.runtime import checkpoint
from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from lab.measure.device import Precision
from lab.commands.equivalence import TINY, Setup, equivalence, loop_settings
from lab.model import GPT
from lab.training.optim import adamw_factory, param_groups
from lab.parallel import Layout, LoopSettings, World, parse_spec, strategy_class
from lab.training.plan import check_layout, check_model, create
from pool import run_pooled
from lab.parallel.axes.tensor import Split

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
    ({"strategy": "ddp", "tp_impl": "torch"}, 2, r"tp_impl torch \(the DTensor reference\) needs parallel.tp > 1"),
    ({"tp": 2, "tp_impl": "torh"}, 2, r"must be one of lab, torch, got 'torh' \(did you mean torch\?\)"),
])
def test_the_mesh_is_validated_up_front(options, world_size, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(ParallelConfig(**options), world_size, LoopSettings(micro_batch=2, accum_steps=1, grad_clip=1.0))


@pytest.mark.parametrize("model, options, message", [
    (dict(n_head=3, d_model=48), {}, r"must divide model.n_head, which is 3"),
    (dict(n_head=6, n_kv_head=3, d_model=48), {"tp": 2}, r"must divide model.n_kv_head"),
    (dict(vocab_size=97), {}, r"set model.pad_vocab_to to a multiple of 2"),
    (dict(block_size=33), {"sequence_parallel": True}, "must divide model.block_size"),
    (dict(pad_vocab_to=64), {"tp_impl": "torch"}, "tp_impl torch cannot leave padding rows out of its loss"),
])
def test_shapes_the_group_cannot_split_are_refused(model, options, message):
    with pytest.raises(ConfigError, match=message):
        check_model(ParallelConfig(**{"tp": 2, **options}), dataclasses.replace(TINY, **model))


@pytest.mark.parametrize("impl", ["lab", "torch"])
def test_fewer_key_value_heads_than_the_degree_must_divide_it(impl):
    degree = ParallelConfig(tp=4, tp_impl=impl)
    with pytest.raises(ConfigError, match=r"model.n_kv_head \(3\) must divide parallel.tp \(4\)"):
        check_model(degree, dataclasses.replace(TINY, n_head=12, n_kv_head=3, d_model=48))
    check_model(degree, dataclasses.replace(TINY, n_head=4, n_kv_head=2))  # replicated, accepted


def test_a_run_with_a_bad_degree_fails_in_one_line_before_any_work(capsys, tmp_path, args):
    from lab.commands.cli import run_main

    assert run_main(["--parallel.tp", "3", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: parallel.tp (3) must divide the world size (1)"]
    assert run_main([*args, "--nproc-per-node", "2", "--parallel.tp", "2", "--model.d_ff", "99",
                     "--run-dir", str(tmp_path / "r")]) == 2  # checked for 2 ranks before any starts
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: parallel.tp (2) must divide the MLP width (model.d_ff), which is 99"]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("shape, dim, blocks", [((12, 4), 0, (4, 4, 4)), ((16, 8), 1, (8,)), ((8,), 0, (4, 4))])
def test_a_split_takes_and_places_every_element_once(shape, dim, blocks):
    """Every element of the whole weight is handed over once, from two ranges of each shard; a column shard as at
    most three rectangles per range (not one range per row: DCP's cost grows with the pieces)."""
    whole = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    split = Split(shape, dim, blocks)
    shards = [split.take(whole, r, 2) for r in range(2)]
    placed = torch.full(shape, -1.0)
    for r, shard in enumerate(shards):
        flat = shard.reshape(-1)
        for lo, hi in ((0, 3), (3, flat.numel())):  # two ranges of the shard, as a ZeRO chunk boundary cuts it
            held = split.checkpoint_pieces(r, 2, lo, flat[lo:hi])
            if dim == 1:
                assert held.shape == shape and len(held.blocks) <= 3
                spots = [(placed[row:row + v.shape[0], col:col + v.shape[1]], v) for row, col, v in held.blocks]
            else:
                spots = [(placed.view(-1)[start:start + v.numel()], v) for start, v in held.pieces]
            for spot, view in spots:
                assert (spot == -1).all()
                spot.copy_(view)
    assert torch.equal(placed, whole)


@pytest.mark.parametrize("model", [
    dataclasses.replace(TINY, n_head=4), MODERN, dataclasses.replace(TINY, n_head=4, n_kv_head=1, bias=True),
    dataclasses.replace(MODERN, n_kv_head=1, tie_embeddings=False, pad_vocab_to=64)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_parameters_a_rank_holds_under_tp_are_counted_in_theory(model, tp):
    """``accounting.tensor_parallel_params`` is what each rank of the hand-rolled split holds (built on meta)."""
    from lab.parallel.axes.tensor import TensorParallel

    for rank in range(tp):
        with torch.device("meta"):
            split = GPT(model)
        if tp > 1:
            TensorParallel(World(rank=rank, world_size=tp, local_rank=rank, device=torch.device("cpu")),
                           False).parallelize(split, split.parallel_plan())
        assert sum(p.numel() for p in split.parameters()) == accounting.tensor_parallel_params(model, tp), rank


def test_the_resource_check_divides_what_tp_divides():
    """Per process, tp 2 × dp 2 holds half the split weights (sharded by zero3 over 2 replicas, not 4) and tp's
    share of the activations: a memory budget between the two estimates refuses tp 1 and admits tp 2."""
    from lab.runtime.config import RunConfig
    from lab.measure.device import Peak
    from lab.training.admission import check_resources

    world, peak = World(rank=0, world_size=4, local_rank=0, device=torch.device("cpu")), Peak(1e12, "test")
    precision = Precision("cpu")

    def estimate(available: float, **parallel: object):
        cfg = RunConfig(model=MODERN, parallel=ParallelConfig(strategy="zero3", **parallel))
        layout = Layout.of(cfg.parallel, world.world_size, strategy_class(cfg.parallel.strategy))
        return check_resources(cfg, layout, world, precision, peak, MODERN.vocab_size, available)

    sp = estimate(1e12, tp=2, sequence_parallel=True).memory_bytes
    states = accounting.model_state_bytes(accounting.tensor_parallel_params(MODERN, 2), "zero3", 2, "fp32").total
    activations = accounting.activation_bytes(MODERN, TrainConfig().micro_batch, 4, tp=2, sequence_parallel=True)
    assert sp == states + activations
    whole, split = estimate(1e12).memory_bytes, estimate(1e12, tp=2).memory_bytes
    assert sp < split < whole
    with pytest.raises(ConfigError, match="GiB per process"):
        estimate((split + whole) / 2)
    assert estimate((split + whole) / 2, tp=2).memory_bytes == split


def test_the_resource_check_divides_what_pp_and_ep_divide():
    """Per process, pp 2 holds the fullest stage and ep 2 half the routed experts: a memory budget between each
    estimate and the whole model's refuses the whole model and admits the split one (before, the check counted
    the whole model under pp and ep)."""
    from lab.runtime.config import RunConfig
    from lab.measure.device import Peak
    from lab.training.admission import check_resources

    world, peak = World(rank=0, world_size=4, local_rank=0, device=torch.device("cpu")), Peak(1e12, "test")
    precision = Precision("cpu")

    def estimate(available: float, model=MODERN, **parallel: object) -> float:
        cfg = RunConfig(model=model, parallel=ParallelConfig(strategy="ddp", **parallel))
        layout = Layout.of(cfg.parallel, world.world_size, strategy_class(cfg.parallel.strategy))
        return check_resources(cfg, layout, world, precision, peak, MODERN.vocab_size, available).memory_bytes

    activations = accounting.activation_bytes(MODERN, TrainConfig().micro_batch, 4)
    whole, staged = estimate(1e12), estimate(1e12, pp=2)
    stage = accounting.model_state_bytes(accounting.stage_params(MODERN, 2), "ddp", 2, "fp32").total
    assert staged == pytest.approx(stage + activations, rel=1e-12) and staged < whole
    moe = dataclasses.replace(MODERN, moe_experts=4, moe_top_k=1)
    full, split = estimate(1e12, moe), estimate(1e12, moe, ep=2)
    half = accounting.model_state_bytes(accounting.routed_expert_params(moe) / 2, "ddp", 2, "fp32").total
    assert full - split == pytest.approx(half, rel=1e-12)  # ddp keeps every state: ep 2 drops half the experts'
    for smaller, larger, model, split_by in ((staged, whole, MODERN, {"pp": 2}), (split, full, moe, {"ep": 2})):
        with pytest.raises(ConfigError, match="GiB per process"):
            estimate((smaller + larger) / 2, model)
        assert estimate((smaller + larger) / 2, model, **split_by) == smaller


# ---------------------------------------------------------------- equivalence with single


def _both_archs(world: World, specs: list[str], setup: Setup) -> dict:
    return {arch: equivalence(world, specs, dataclasses.replace(setup, model=model)) for arch, model in ARCHS.items()}


@pytest.mark.parametrize("specs", [
    ["single:tp=2", "ddp:tp=2", "zero2:tp=2", "zero3:tp=2", "single:tp=2,tp_impl=torch", "zero2:tp=2,tp_impl=torch"],
    pytest.param(["torch_ddp:tp=2", "fsdp:tp=2", "zero1:tp=2,activation_checkpointing=full",
                  "zero2:tp=2,activation_checkpointing=selective", "fsdp:tp=2,tp_impl=torch",
                  "zero3:tp=2,tp_impl=torch,activation_checkpointing=full"], marks=pytest.mark.slow)])
def test_tp2_reproduces_single_under_every_data_parallel_strategy_on_two_ranks(specs):
    results = run_pooled(_both_archs, 2, specs, Setup(steps=3, grad_clip=CLIP))[0]
    for arch, by_spec in results.items():
        assert set(by_spec) == set(specs)
        for spec, r in by_spec.items():
            assert _close(r), (arch, spec, r)


@pytest.mark.long
@pytest.mark.slow
def test_the_torch_reference_composes_with_every_data_parallel_strategy_on_four_ranks():
    """The DTensor reference on tp 2 × dp 2: the data-parallel strategies run over its weights' local parts."""
    specs = ["ddp:tp=2,tp_impl=torch", "zero2:tp=2,tp_impl=torch,sequence_parallel=true", "fsdp:tp=2,tp_impl=torch",
             "torch_ddp:tp=2,tp_impl=torch", "zero3:tp=2,tp_impl=torch"]
    results = run_pooled(_both_archs, 4, specs, Setup(steps=3, accum=2, grad_clip=CLIP), deadline_s=180)[0]
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


GQA_ONE = dataclasses.replace(MODERN, n_kv_head=1)  # one key/value head for 2 or 4 ranks: replicated
GQA_BIAS = dataclasses.replace(TINY, n_head=4, n_kv_head=1, bias=True)  # gpt2 with biases: the qkv bias replicated


def _gqa(world: World, specs: list[str], setup: Setup, models: dict[str, ModelConfig] | None = None) -> dict:
    models = models or {"modern": GQA_ONE, "gpt2": GQA_BIAS}
    return {name: equivalence(world, specs, dataclasses.replace(setup, model=model)) for name, model in models.items()}


@pytest.mark.long
@pytest.mark.parametrize("ranks, specs, models", [
    (2, ["ddp:tp=2", "zero2:tp=2", "zero2:tp=2,sequence_parallel=true", "fsdp:tp=2"], None),
    (2, ["single:tp=2,tp_impl=torch", "zero2:tp=2,tp_impl=torch,sequence_parallel=true"], None),
    pytest.param(4, ["ddp:tp=4", "zero2:tp=4", "zero2:tp=2", "fsdp:tp=2", "fsdp:tp=2,sequence_parallel=true"], None,
                 marks=pytest.mark.slow),
    pytest.param(4, ["ddp:tp=4,tp_impl=torch", "fsdp:tp=2,tp_impl=torch,sequence_parallel=true"], None,
                 marks=pytest.mark.slow),
    # two key/value heads on four ranks: the reference's mesh of (key/value heads × sharers) is 2 × 2
    pytest.param(4, ["ddp:tp=4,tp_impl=torch", "zero2:tp=4,tp_impl=torch,sequence_parallel=true"],
                 {"modern": MODERN}, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_key_value_heads_fewer_than_the_degree_are_replicated_and_reproduce_single(ranks, specs, models):
    """Each rank holds the key/value head its query heads use; the replicas' gradients are summed over the ranks
    holding them and counted once in the clipped norm, so the losses, norms and weights are single's. The same under
    the torch reference (sequence parallel too), whose key/value weights are replicated DTensors over the sharers."""
    results = run_pooled(_gqa, ranks, specs, Setup(steps=3, accum=2, grad_clip=CLIP), models)[0]
    for name, by_spec in results.items():
        assert set(by_spec) == set(specs)
        for spec, r in by_spec.items():
            assert _close(r), (name, spec, r)


@pytest.mark.long
@pytest.mark.slow
def test_sequence_parallel_reproduces_single_on_two_ranks():
    specs = ["ddp:tp=2,sequence_parallel=true", "zero3:tp=2,sequence_parallel=true",
             "single:tp=2,tp_impl=torch,sequence_parallel=true"]
    results = run_pooled(_both_archs, 2, specs, Setup(steps=3, accum=2, grad_clip=CLIP))[0]
    for arch, by_spec in results.items():
        for spec, r in by_spec.items():
            assert _close(r), (arch, spec, r)


def _compiled_and_eager(world: World, spec: str, setup: Setup) -> tuple:
    """Traces of ``spec`` with the model compiled (``train.compile``: the strategy compiles the model after the split
    and checkpointing) and eager."""
    from lab.commands.equivalence import train_tiny

    return (train_tiny(world, dataclasses.replace(setup, compile=True), parse_spec(spec)),
            train_tiny(world, setup, parse_spec(spec)))


@pytest.mark.long
@pytest.mark.slow
def test_a_compiled_model_under_tp_reproduces_the_eager_losses():
    """torch.compile with the hand-rolled split under sequence parallelism (its all-gathers and reduce-scatters and
    the all-reduces of the whole norm weights' gradients; the modern arch): dynamo breaks the graph at the group's
    collectives, which run eagerly; the losses and gradient norms are the eager run's. One configuration: each
    compiles for about 15 s on 2 cores."""
    spec = "ddp:tp=2,sequence_parallel=true"
    compiled, eager = run_pooled(_compiled_and_eager, 2, spec, Setup(steps=2, accum=2, grad_clip=CLIP, model=MODERN),
                                 deadline_s=300)[0]
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-6)
    assert compiled.grad_norms == pytest.approx(eager.grad_norms, rel=1e-5)


# ---------------------------------------------------------------- meters


def _tp_meters(world: World, specs: list[str], accum: int, models: dict[str, ModelConfig] = ARCHS) -> dict:
    """The tensor-parallel bytes of one step (measured, theory) under each spec, on each of ``models``."""
    from lab.commands.equivalence import batch
    from lab.training.steps import StepPlan
    from lab.training.train import train_step

    out = {}
    for arch, model in models.items():
        setup = Setup(model=model, accum=accum)
        for spec in specs:
            parallel = parse_spec(spec)
            strategy = create(parallel, world, Precision("cpu"), loop_settings(setup))
            strategy.build(lambda: GPT(model, seed=0), lambda m: param_groups(m, 0.1),
                           adamw_factory(TrainConfig(), world.device))
            replica, replicas = Layout.of(parallel, world.world_size).data_replica(world.rank)
            plan = StepPlan(setup.micro_batch * accum * replicas, accum, 1, setup.micro_batch, replicas)
            x, y = batch(setup, 0, plan.global_sequences)
            micro = [(x[lo:hi], y[lo:hi]) for lo, hi in (plan.micro_range(replica, m) for m in range(accum))]
            train_step(strategy, world, micro, accum, 1e-2, 1.0)
            strategy.take_step_meters()
            strategy.eval_loss(x[:2], y[:2])  # not a training step's traffic
            meters = strategy.accounts.meters()
            out[(arch, spec)] = (meters["tp_comm_bytes_per_step"], meters["tp_comm_bytes_per_step_theory"])
    return out


@pytest.mark.slow
def test_tensor_parallel_bytes_per_step_equal_their_theory():
    results = run_pooled(_tp_meters, 2, ["ddp:tp=2", "zero2:tp=2,sequence_parallel=true"], 2)[0]
    for (arch, spec), (measured, theory) in results.items():
        assert measured == pytest.approx(theory, rel=1e-12), (arch, spec)
        assert measured["all_reduce"] > 0
        if "sequence_parallel" in spec:
            assert measured["all_gather"] == pytest.approx(measured["reduce_scatter"])
            assert measured["all_gather"] > 0
        else:
            assert measured["all_gather"] == measured["reduce_scatter"] == 0
    shape, b, s, h = TINY, 2, TINY.block_size, TINY.d_model  # 2 micro-steps, 2 ranks: 2(N-1)/N = 1
    assert results[("gpt2", "ddp:tp=2")][1]["all_reduce"] == 2 * 4 * ((4 * shape.n_layer + 2) * b * s * h + 3 * b * s)


@pytest.mark.slow
def test_replicated_key_value_gradients_are_counted_in_the_bytes():
    """With one key/value head on 2 ranks, each block's key and value rows' gradients (with the qkv bias) are
    all-reduced once per micro-step besides the activations."""
    models = {"modern": GQA_ONE, "gpt2": GQA_BIAS}
    results = run_pooled(_tp_meters, 2, ["ddp:tp=2", "zero2:tp=2,sequence_parallel=true"], 2, models)[0]
    for key, (measured, theory) in results.items():
        assert measured == pytest.approx(theory, rel=1e-12), key
    without = accounting.tensor_parallel_comm_bytes(dataclasses.replace(GQA_BIAS, n_kv_head=2), 2, 2, 2)
    head_dim = GQA_BIAS.d_model // GQA_BIAS.n_head  # 2 blocks × 2 (k, v) × 1 slot × one head's rows and bias
    extra = 2 * 4 * GQA_BIAS.n_layer * 2 * head_dim * (GQA_BIAS.d_model + 1)
    assert results[("gpt2", "ddp:tp=2")][1]["all_reduce"] == without["all_reduce"] + extra


ACTIVATIONS = ModelConfig(n_layer=4, n_head=4, d_model=64, block_size=64, vocab_size=256)  # GPT-2 blocks, 4h MLP


def _saved_bytes(world: World, specs: list[str]) -> dict:
    """The bytes one micro-step of 2 sequences saved for its backward on this rank, under each spec."""
    from lab.commands.equivalence import batch
    from lab.training.train import train_step

    out, setup = {}, Setup(model=ACTIVATIONS)
    for spec in specs:
        strategy = _built(world, spec, setup)
        x, y = batch(setup, 0, setup.micro_batch)
        train_step(strategy, world, [(x, y)], 1, setup.lr, 1.0)
        strategy.take_step_meters()
        out[spec] = strategy.accounts.meters()["activation_saved_bytes"]
    return out


@pytest.mark.slow
def test_saved_activation_bytes_are_within_a_tenth_of_their_theory_under_tp_and_sequence_parallel():
    specs = {"ddp": (1, False), "ddp:tp=2": (2, False), "ddp:tp=2,sequence_parallel=true": (2, True)}
    measured = run_pooled(_saved_bytes, 2, list(specs))[0]
    theory = {spec: accounting.activation_bytes(ACTIVATIONS, 2, 4, tp=tp, sequence_parallel=sp)
              for spec, (tp, sp) in specs.items()}
    for spec in specs:
        assert abs(measured[spec] / theory[spec] - 1) <= 0.1, (spec, measured[spec], theory[spec])
    # the three theories lie more than the tolerance apart: the test tells the layouts apart
    assert theory["ddp:tp=2"] < 0.9 * theory["ddp"] and theory["ddp:tp=2,sequence_parallel=true"] < 0.9 * theory[
        "ddp:tp=2"]


# ---------------------------------------------------------------- checkpoints across layouts


def _built(world: World, spec: str, setup: Setup):
    strategy = create(parse_spec(spec), world, Precision("cpu"), loop_settings(setup))
    strategy.build(lambda: GPT(setup.model, seed=setup.seed), lambda m: param_groups(m, 0.1),
                   adamw_factory(TrainConfig(), world.device))
    return strategy


def _steps(world: World, strategy, spec: str, setup: Setup, steps: range) -> None:
    from lab.commands.equivalence import batch
    from lab.training.steps import StepPlan
    from lab.training.train import train_step

    replica, replicas = Layout.of(parse_spec(spec), world.world_size).data_replica(world.rank)
    plan = StepPlan(8, 1, len(steps), 8 // replicas, replicas)  # one global batch of 8 sequences for every layout
    for step in steps:
        x, y = batch(setup, step, plan.global_sequences)
        lo, hi = plan.micro_range(replica, 0)
        train_step(strategy, world, [(x[lo:hi], y[lo:hi])], 1, setup.lr, 0.0)


def _reshard(world: World, run_dir, saved: str, loaders: list[str], model: ModelConfig = MODERN) -> dict:
    """Train 2 steps under ``saved`` and checkpoint; load that into each of ``loaders`` (fresh) and compare the
    weights; then one more step under each (the moments must have come along too)."""
    setup = Setup(model=model)
    original = _built(world, saved, setup)
    _steps(world, original, saved, setup, range(2))
    checkpoint.save(run_dir, 2, world.rank, world.world_size, original.checkpoint_state(), {}, keep=1)
    before = original.full_state_dict()
    _steps(world, original, saved, setup, range(2, 3))
    after = original.full_state_dict()
    out = {}
    for spec in loaders:
        strategy = _built(world, spec, setup)
        checkpoint.load(checkpoint.latest(run_dir), world.rank, world.world_size, strategy.checkpoint_state())
        strategy.after_load()
        loaded = strategy.full_state_dict()
        _steps(world, strategy, spec, setup, range(2, 3))
        stepped = strategy.full_state_dict()
        if world.is_main:
            out[spec] = (max((loaded[k] - before[k]).abs().max().item() for k in before),
                         max((stepped[k] - after[k]).abs().max().item() for k in after))
    if world.is_main:
        shapes = {k: v.shape for k, v in before.items() if not k.startswith("rope")}
        whole = checkpoint.load_model(checkpoint.latest(run_dir), shapes)  # no group: export and sample read this
        out["single"] = (max((whole[k] - before[k]).abs().max().item() for k in shapes), 0.0)
    return out


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("saved, loaders, model", [
    ("single:tp=2,tp_impl=torch", ["single:tp=2", "ddp"], MODERN),
    ("zero2:tp=2,tp_impl=torch,sequence_parallel=true", ["single:tp=2,sequence_parallel=true"], MODERN),
    ("zero2:tp=2", ["fsdp:tp=2,tp_impl=torch"], MODERN),
    ("single:tp=2,tp_impl=torch", ["zero2:tp=2", "ddp"], GQA_ONE),
    ("zero2:tp=2", ["single:tp=2,tp_impl=torch", "fsdp:tp=2,tp_impl=torch,sequence_parallel=true"], GQA_ONE)])
def test_the_torch_reference_holds_the_hand_rolled_shards(tmp_path, saved, loaders, model):
    """A checkpoint of the DTensor reference (under single or zero2) loads into the hand-rolled split (sequence
    parallel too) and into ddp bit for bit, one of the hand-rolled split into the reference under fsdp, and
    training goes on alike; with one key/value head too (replicated: a holder the load missed would drift)."""
    out = run_pooled(_reshard, 2, tmp_path, saved, loaders, model, deadline_s=120)[0]
    assert set(out) == {*loaders, "single"}
    for spec, (loaded, stepped) in out.items():
        assert loaded == 0.0 and stepped <= 1e-5, spec


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("model", [GQA_ONE, MODERN], ids=["one_kv_head", "two_kv_heads"])
def test_the_torch_reference_on_tp4_holds_the_hand_rolled_replicated_key_value_heads(tmp_path, model):
    """tp 4 with one key/value head (all four ranks hold it) or two (each pair of ranks holds one): the reference's
    checkpoint loads into the hand-rolled split and ddp bit for bit, and one of the hand-rolled split into it."""
    torch_tp4 = "ddp:tp=4,tp_impl=torch"
    for saved, loaders in ((torch_tp4, ["zero2:tp=4", "ddp"]), ("zero2:tp=4", [torch_tp4])):
        out = run_pooled(_reshard, 4, tmp_path / saved, saved, loaders, model, deadline_s=120)[0]
        assert set(out) == {*loaders, "single"}
        for spec, (loaded, stepped) in out.items():
            assert loaded == 0.0 and stepped <= 1e-5, (saved, spec)


def _norm_input_tokens(world: World, spec: str) -> dict[str, int]:
    """The tokens per sequence that each norm and the first block's QKV see on this rank in one forward."""
    setup = Setup(model=TINY)
    strategy, seen = _built(world, spec, setup), {}
    names = [name for name, m in strategy.module.named_modules() if name.endswith(("norm1", "norm2", "norm_f"))]

    def record(name: str, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen[name] = (out.to_local() if hasattr(out, "to_local") else out).shape[1]

    for name in [*names, "blocks.0.attn.qkv"]:
        strategy.module.get_submodule(name).register_forward_hook(functools.partial(record, name))
    from lab.commands.equivalence import batch

    strategy.forward(*batch(setup, 0, 2), sync=True)
    return seen


def test_the_torch_reference_runs_norms_on_sequence_shards():
    """Under sequence_parallel the reference's norms see half the tokens on 2 ranks; its QKV the whole sequence."""
    seen = run_pooled(_norm_input_tokens, 2, "single:tp=2,tp_impl=torch,sequence_parallel=true")[0]
    assert seen.pop("blocks.0.attn.qkv") == TINY.block_size
    assert len(seen) == 2 * TINY.n_layer + 1 and set(seen.values()) == {TINY.block_size // 2}


@pytest.mark.slow
def test_replicated_key_value_heads_are_saved_once_and_reach_every_holder_on_load(tmp_path):
    """tp 2 with one key/value head: the first holder saves the replicated rows; a load under tp 2 (ddp, zero2)
    gives them to both holders (a rank left at its initial rows would move away from single at the next step)."""
    loaders = ["ddp", "ddp:tp=2", "zero2:tp=2", "fsdp:tp=2"]
    out = run_pooled(_reshard, 2, tmp_path, "zero2:tp=2", loaders, GQA_ONE, deadline_s=120)[0]
    assert set(out) == {*loaders, "single"}
    for spec, (loaded, stepped) in out.items():
        assert loaded == 0.0 and stepped <= 1e-5, spec


@pytest.mark.long
@pytest.mark.slow
def test_replicated_key_value_heads_under_fsdp_on_tp2_by_dp2_save_and_load_across_layouts(tmp_path):
    """FSDP shards each replica's rows over the data axis: its checkpoint loads under zero2 (tp 2 × dp 2), ddp (dp 4)
    and single, and one of zero2 loads back under fsdp."""
    for saved, loaders in (("fsdp:tp=2", ["zero2:tp=2", "ddp"]), ("zero2:tp=2", ["fsdp:tp=2"])):
        out = run_pooled(_reshard, 4, tmp_path / saved, saved, loaders, GQA_ONE, deadline_s=120)[0]
        assert set(out) == {*loaders, "single"}
        for spec, (loaded, stepped) in out.items():
            assert loaded == 0.0 and stepped <= 1e-5, (saved, spec)


def _pieces_of_row_parallel_weights(folder, model: ModelConfig) -> dict[str, int]:
    """How many pieces DCP stored of each row-parallel weight (split along its columns) and its moments."""
    rows = GPT(model).parallel_plan().tensor.row
    stored = checkpoint.read_dcp_metadata(folder).state_dict_metadata
    out = {key: len(md.chunks) for key, md in stored.items()
           if key.split("/")[1].removesuffix(".weight") in rows and not key.endswith("/step")}
    assert len(out) == 3 * len(rows) and all(len(stored[key].size) == 2 for key in out)  # weight, exp_avg, exp_avg_sq
    return out


@pytest.mark.long
@pytest.mark.slow
def test_a_tp2_by_dp2_checkpoint_loads_under_tp1_by_dp4_tp2_by_dp2_and_single(tmp_path):
    """zero3 over the data axis holds a range of each shard: a column shard is saved as at most three rectangles per
    rank (it was one range per row, 32 per rank here)."""
    loaders = ["ddp", "zero2", "ddp:tp=2", "zero1:tp=2,sequence_parallel=true"]
    out = run_pooled(_reshard, 4, tmp_path, "zero3:tp=2", loaders, deadline_s=120)[0]
    assert max(_pieces_of_row_parallel_weights(checkpoint.latest(tmp_path), MODERN).values()) <= 3 * 4
    assert set(out) == {"ddp", "zero2", "ddp:tp=2", "zero1:tp=2,sequence_parallel=true", "single"}
    for spec, (loaded, stepped) in out.items():
        assert loaded == 0.0, spec  # the weights come back bit for bit
        assert stepped <= 1e-5, spec  # and so do the moments: zeros would move a weight by about lr (1e-2)


@pytest.mark.slow
def test_a_flat_checkpoint_loads_under_tp_as_one_written_before_blocks(tmp_path):
    """A checkpoint that stores every weight flat (zero2 without tp; every tp checkpoint before column shards were
    stored as 2-D blocks did too) loads under tp 2, a column shard read row by row, bit for bit."""
    out = run_pooled(_reshard, 2, tmp_path, "zero2", ["zero2:tp=2"], MODERN, deadline_s=120)[0]
    stored = checkpoint.read_dcp_metadata(checkpoint.latest(tmp_path)).state_dict_metadata
    assert all(len(md.size) <= 1 for md in stored.values())
    assert set(out) == {"zero2:tp=2", "single"}
    for spec, (loaded, stepped) in out.items():
        assert loaded == 0.0 and stepped <= 1e-5, spec


# ---------------------------------------------------------------- the loop


def _train(world: World, tree: dict, data_dir, run_dir) -> dict:
    from lab.runtime.config import resolve
    from lab.training.lifecycle import train

    cfg = resolve(tree)
    cfg.model.vocab_size = 512
    return train(cfg, data_dir, run_dir, world)


@pytest.mark.slow
def test_the_loop_trains_with_tp2_and_a_single_process_resumes_it(tiny_data_config, tiny_prepared, args, tmp_path):
    """The real loop on 2 ranks (tp 2, zero2 over a data axis of one): the logged losses are single's; its
    checkpoint resumes under single in one process, which ends where an uninterrupted single run ends."""
    import json

    from lab.commands.cli import run_main

    tree = {"model": {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32},
            "data": {"corpus": tiny_data_config.corpus, "cache_dir": tiny_data_config.cache_dir, "vocab_size": 512},
            "train": {"tokens": 2048, "batch_tokens": 256, "micro_batch": 4, "eval_tokens": 512, "lr": 1e-2,
                      "log_every": 1, "stop_after": 4, "checkpoint_every": 4},
            "parallel": {"strategy": "zero2", "tp": 2}}
    summaries = run_pooled(_train, 2, tree, tiny_prepared, tmp_path / "tp")
    assert summaries[0]["status"] == "stopped" and summaries[0]["tp_comm_bytes_per_step"]["all_reduce"] > 0
    assert run_main([*args, "--run-dir", str(tmp_path / "tp"), "--resume"]) == 0
    assert run_main([*args, "--run-dir", str(tmp_path / "single")]) == 0

    def losses(run: str) -> list[float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r]

    assert len(losses("tp")) == len(losses("single")) == 8
    assert losses("tp") == pytest.approx(losses("single"), rel=1e-5)


# ---------------------------------------------------------------- export and sample


BYTES_MODEL = dataclasses.replace(GQA_ONE, vocab_size=257, pad_vocab_to=64)  # the bytes tokenizer's vocabulary


def _tp_checkpoint(world: World, run_dir, model: ModelConfig) -> dict:
    """Two steps under zero2 with tp 2, a checkpoint in ``run_dir``; the whole weights the group gathers."""
    setup = Setup(model=model)
    strategy = _built(world, "zero2:tp=2", setup)
    _steps(world, strategy, "zero2:tp=2", setup, range(2))
    checkpoint.save(run_dir, 2, world.rank, world.world_size, strategy.checkpoint_state(), {}, keep=1)
    return strategy.full_state_dict()


@pytest.mark.slow
def test_export_and_sample_read_a_tp2_checkpoint_as_a_single_process_one_of_the_same_weights(tmp_path, capsys):
    """``python -m lab export`` and ``sample`` on a checkpoint written by 2 tensor-parallel ranks (vocabulary
    padded, one key/value head replicated) give the gathered weights bit for bit, and what they give on a
    checkpoint that one process wrote of those weights."""
    from lab.commands.cli import export_main, sample_main
    from lab.runtime.config import RunConfig
    from lab.data.tokenizer import BytesTokenizer
    from lab.runtime.files import save_json

    runs = {layout: tmp_path / layout for layout in ("tp", "single")}
    for run in runs.values():
        run.mkdir()
        save_json(run / "config.json", RunConfig(model=BYTES_MODEL).to_dict())
        BytesTokenizer().save(run / "tokenizer")
    weights = run_pooled(_tp_checkpoint, 2, runs["tp"], BYTES_MODEL)[0]
    pieces = _pieces_of_row_parallel_weights(checkpoint.latest(runs["tp"]), BYTES_MODEL)
    assert set(pieces.values()) == {2}  # one rectangle per rank (one range per row: 2 × 32)
    single = _built(World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), "single",
                    Setup(model=BYTES_MODEL))
    with torch.no_grad():
        for name, p in single.module.named_parameters():
            p.copy_(weights[name])
    checkpoint.save(runs["single"], 2, 0, 1, single.checkpoint_state(), {}, keep=1)

    exported, samples = {}, {}
    for layout, run in runs.items():
        assert export_main([str(run), "--out", str(tmp_path / f"{layout}.pt")]) == 0
        exported[layout] = torch.load(tmp_path / f"{layout}.pt", weights_only=True)["model"]
        capsys.readouterr()
        assert sample_main(["--run-dir", str(run), "--prompt", "the ", "--tokens", "24", "--seed", "3"]) == 0
        samples[layout] = capsys.readouterr().out
    assert set(exported["tp"]) == set(exported["single"]) == {n for n, _ in single.module.named_parameters()}
    for name, value in exported["tp"].items():
        assert torch.equal(value, weights[name]) and torch.equal(value, exported["single"][name]), name
    assert samples["tp"] == samples["single"] and samples["tp"].startswith("the ")
