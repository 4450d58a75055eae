"""The gradient noise scale (lab.parallel.noise): its estimators recover a known noise scale, its meter reads each
micro-batch's gradient, and every layout that runs it measures the same figures from the same batches."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lab.commands.equivalence import TINY, Setup, batch, loop_settings, train_tiny
from lab.model import GPT
from lab.parallel import Layout, World, parse_spec
from lab.parallel.noise import noise_estimates
from lab.runtime.config import ConfigError, ParallelConfig
from lab.training.plan import check_layout
from pool import run_pooled

SETUP = Setup(steps=3, micro_batch=2, noise_scale=True, counting=True)
MICRO_BATCHES = 4  # K: every layout reads the step's 8 sequences as 4 micro-batches of 2
FIGURES = ("noise_small_sq", "noise_big_sq", "noise_trace", "noise_grad_sq", "noise_scale")
ALONE = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_the_estimators_recover_a_known_noise_scale():
    """Micro-batch gradients G + ε drawn with a known |G|² and tr(Σ): the estimates average to them."""
    g = torch.Generator().manual_seed(0)
    dim, small_tokens, k, draws = 50, 64, 8, 4000
    signal = torch.randn(dim, generator=g, dtype=torch.float64)
    spread = torch.rand(dim, generator=g, dtype=torch.float64) * 3  # Σ's diagonal: per-token variances
    grads = signal + torch.randn(draws, k, dim, generator=g, dtype=torch.float64) * (spread / small_tokens).sqrt()
    small_sq = grads.square().sum(-1).mean(-1)
    big_sq = grads.mean(1).square().sum(-1)
    estimates = [noise_estimates(s, b, small_tokens, small_tokens * k) for s, b in zip(small_sq.tolist(),
                                                                                   big_sq.tolist())]
    grad_sq = sum(e[0] for e in estimates) / draws
    trace = sum(e[1] for e in estimates) / draws
    assert grad_sq == pytest.approx(signal.square().sum().item(), rel=0.02)
    assert trace == pytest.approx(spread.sum().item(), rel=0.02)


def test_the_meter_reads_each_micro_batch_gradient():
    """Under single with accumulation, the first step's figures equal a plain loop's: each micro-batch's gradient
    alone, and their mean."""
    setup = dataclasses.replace(SETUP, accum=MICRO_BATCHES, steps=1)
    trace = train_tiny(ALONE, setup, ParallelConfig(strategy="single"))
    model = GPT(setup.model, seed=setup.seed)
    x, y = batch(setup, 0, setup.micro_batch * MICRO_BATCHES)
    grads = []
    for lo in range(0, len(x), setup.micro_batch):
        model.zero_grad()
        model(x[lo:lo + setup.micro_batch], y[lo:lo + setup.micro_batch]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    small = sum(g.square().sum() for g in grads).item() / len(grads)
    big = (sum(grads) / len(grads)).square().sum().item()
    assert trace.records[0]["noise_small_sq"] == pytest.approx(small, rel=1e-5)
    assert trace.records[0]["noise_big_sq"] == pytest.approx(big, rel=1e-5)
    assert big < small / 2  # the micro-batches' gradients differ: a mean of four is shorter than each


@pytest.mark.parametrize("dtype, mixed", [("fp16", False), ("bf16", True), ("fp16", True)])
def test_a_16_bit_policy_measures_what_fp32_does(dtype, mixed):
    """fp16's loss scale (65,536) and the 16-bit gradients undone: the first step's figures within 1 % of fp32's."""
    setup = dataclasses.replace(SETUP, accum=MICRO_BATCHES, steps=1)
    fp32 = train_tiny(ALONE, setup, ParallelConfig(strategy="single")).records[0]
    low = train_tiny(ALONE, dataclasses.replace(setup, dtype=dtype, mixed=mixed), ParallelConfig(strategy="single"))
    for key in FIGURES:
        assert low.records[0][key] == pytest.approx(fp32[key], rel=1e-2), key


def _noise_by_layout(world: World, specs: list[str], setup: Setup) -> dict:
    """Each layout's per-step figures on this world, with the step's micro-batches split as the layout splits them;
    and, for the first, whether the run without the meter trains the same bits."""
    out = {}
    for spec in specs:
        parallel = parse_spec(spec)
        replicas = Layout.of(parallel, world.world_size).dp
        run = dataclasses.replace(setup, accum=MICRO_BATCHES // replicas)
        trace = train_tiny(world, run, parallel)
        out[spec] = [{k: r[k] for k in FIGURES} for r in trace.records]
        if spec == specs[0]:
            plain = train_tiny(world, dataclasses.replace(run, noise_scale=False), parallel)
            out["unchanged"] = (plain.losses, plain.grad_norms) == (trace.losses, trace.grad_norms)
    reference = train_tiny(ALONE, dataclasses.replace(setup, accum=MICRO_BATCHES), ParallelConfig(strategy="single"))
    out["single"] = [{k: r[k] for k in FIGURES} for r in reference.records]
    return out


def _assert_agree(by_layout: dict, specs: list[str]) -> None:
    reference = by_layout["single"]
    assert all(r["noise_scale"] is not None and r["noise_scale"] > 0 for r in reference), reference
    for spec in specs:
        for step, (ref, got) in enumerate(zip(reference, by_layout[spec], strict=True)):
            for key in FIGURES:
                assert got[key] == pytest.approx(ref[key], rel=1e-3), (spec, step, key, got[key], ref[key])


@pytest.mark.parametrize("model", [TINY, dataclasses.replace(TINY, arch="modern", tie_embeddings=False)],
                         ids=["gpt2", "modern"])
def test_every_layout_measures_the_same_noise_scale_on_two_ranks(model):
    """ddp, zero2, zero3, fsdp, torch_ddp, a tensor split, a pipeline (its microbatches' parts added up, a tied
    weight's two stages' parts too) and a context split (each sequence's two shards' parts added up) against single accumulating the same four micro-batches: within 1e-3; and the
    meter leaves the training's bits as they are."""
    specs = ["ddp", "zero2", "zero3", "fsdp", "torch_ddp", "zero1:tp=2", "ddp:pp=2", "zero2:cp=2"]
    by_layout = run_pooled(_noise_by_layout, 2, specs, dataclasses.replace(SETUP, model=model))[0]
    assert by_layout["unchanged"]
    _assert_agree(by_layout, specs)


MOE = dataclasses.replace(TINY, moe_experts=4, moe_top_k=2, moe_granularity=2, moe_shared_experts=1)


@pytest.mark.slow
def test_a_mixture_of_experts_measures_the_same_noise_scale_with_its_experts_split_on_two_ranks():
    """Expert parallelism: a rank's experts take both ranks' tokens in one backward, and each source's part is read
    at its use; against single (and ddp, fsdp, zero3 holding every expert) within 1e-3."""
    specs = ["ddp:ep=2", "zero2:ep=2", "fsdp:ep=2", "zero3:ep=2", "ddp"]
    by_layout = run_pooled(_noise_by_layout, 2, specs, dataclasses.replace(SETUP, model=MOE))[0]
    assert by_layout["unchanged"]
    _assert_agree(by_layout, specs)


@pytest.mark.parametrize("spec, ranks, message", [
    ("deepspeed", 2, "does not run under strategy 'deepspeed'"),
    ("ddp:ep=2,pp=2", 4, "parallel.ep > 1 and parallel.pp > 1 together"),
    ("ddp:ep=2,cp=2", 4, "parallel.ep > 1 and parallel.cp > 1 together"),
    ("single", 1, "two or more micro-batches a step"),
])
def test_layouts_the_meter_cannot_read_are_refused_in_one_line(spec, ranks, message):
    loop = loop_settings(dataclasses.replace(SETUP, accum=1))
    with pytest.raises(ConfigError, match=message) as refused:
        check_layout(parse_spec(spec), ranks, loop)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_data_parallel_composed_with_a_split_measures_the_same_noise_scale_on_four_ranks():
    """dp 2 × tp 2 (the hand-rolled split and the DTensor reference), dp 2 × pp 2, dp 2 × cp 2, cp 2 × tp 2, and
    experts split two ways over four data-parallel ranks and beside tp 2, against single."""
    specs = ["zero2:tp=2", "fsdp:tp=2", "zero3:pp=2", "ddp:tp=2,tp_impl=torch", "zero3:cp=2", "ddp:cp=2,tp=2"]
    by_layout = run_pooled(_noise_by_layout, 4, specs, SETUP, deadline_s=240)[0]
    assert by_layout["unchanged"]
    _assert_agree(by_layout, specs)
    moe_specs = ["zero2:ep=2", "ddp:ep=2,tp=2"]  # two expert groups of 2 (each expert on 2 ranks); ep beside tp
    by_layout = run_pooled(_noise_by_layout, 4, moe_specs, dataclasses.replace(SETUP, model=MOE), deadline_s=240)[0]
    _assert_agree(by_layout, moe_specs)


def _last_record(run_dir) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "noise_scale" in r][-1]


@pytest.mark.slow
def test_a_run_reports_the_noise_scale_and_a_resumed_one_goes_on_from_its_averages(args, tmp_path, capsys):
    """The tiny run (2 micro-steps a step): the step line, the metrics and the summary carry the noise scale, and a
    run stopped at step 5 and resumed logs the uninterrupted run's figures at its last step, to the last digit."""
    from lab.commands.cli import run_main

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    noise = [*args, "--train.noise_scale", "true"]
    assert run_main([*noise, "--run-dir", str(whole)]) == 0
    assert " | B_noise " in capsys.readouterr().out
    assert run_main([*noise, "--train.stop_after", "5", "--run-dir", str(parts)]) == 0
    assert run_main([*noise, "--resume", "latest", "--run-dir", str(parts)]) == 0
    ended, resumed = _last_record(whole), _last_record(parts)
    assert ended["step"] == resumed["step"] == 8
    assert {k: ended[k] for k in FIGURES} == {k: resumed[k] for k in FIGURES}
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["noise_scale"] == ended["noise_scale"] > 0
