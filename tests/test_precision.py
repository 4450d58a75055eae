"""Mixed precision as ZeRO and FSDP run it (``train.precision mixed``) and fp16's dynamic loss scale.

The policy and its refusals; every strategy under the bf16 policy against single under it (bit for bit on 2 ranks
with one micro-step each, within the 16-bit tolerance on 4 ranks with accumulation); the meters in the policy's widths
(model states within 5 % of ``lab plan memory``'s mixed rows, collectives at half of fp32's bytes and at their
theory); the start-of-run check in the policy's widths; fp16's scale through an injected overflow, a checkpoint and
a resume; the tensor, pipeline and context axes' transfers in the compute dtype (the matrix's meters).
"""

import dataclasses
import json
import math
import re

import pytest
import torch

from lab.commands import matrix
from lab.commands import resources as planner
from lab.commands.cli import run_main
from lab.commands.equivalence import Setup, batch, equivalence, loop_settings, train_tiny
from lab.measure import accounting
from lab.measure.device import Peak, Precision, resolve_precision
from lab.model import GPT
from lab.parallel import Layout, World, parse_spec, strategy_class
from lab.training.plan import create
from lab.parallel.precision import LossScaler
from lab.runtime import checkpoint
from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from lab.training.optim import adamw_factory, param_groups
from lab.training.admission import check_resources
from lab.training.steps import StepPlan
from lab.training.train import train_step
from pool import run_pooled

BF16 = Setup(steps=3, dtype="bf16", mixed=True)
DATA_PARALLEL = ["ddp_naive", "ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp"]
# the width of the meters' model (d_model 64): states of a few hundred kB, where a step counter's 4 bytes are noise
METERED = dataclasses.replace(Setup(steps=2), model=ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=32,
                                                                vocab_size=96))


# ---------------------------------------------------------------- the policy


def test_the_loss_scale_halves_at_an_overflow_and_doubles_after_a_window_of_clean_steps():
    scaler = LossScaler(1024.0, window=3)
    seen = []
    for finite in (True, True, True, False, True, True, False, True, True, True):
        scaler.observe(finite)
        seen.append(scaler.scale)
    assert seen == [1024, 1024, 2048, 1024, 1024, 1024, 512, 512, 512, 1024]
    again = LossScaler(1.0, window=3)
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict() == {"scale": 1024.0, "clean_steps": 0}


def test_the_policy_names_its_dtypes():
    mixed = Precision("cpu", "bf16", mixed=True)
    assert (mixed.param_dtype, mixed.reduce_dtype, mixed.state_widths) == (torch.bfloat16, torch.bfloat16, "mixed")
    assert not mixed.autocasts and not mixed.scales_loss
    reduce32 = Precision("cpu", "bf16", mixed=True, reduce="fp32")
    assert (reduce32.param_dtype, reduce32.reduce_dtype) == (torch.bfloat16, torch.float32)
    autocast = Precision("cpu", "bf16")
    assert (autocast.param_dtype, autocast.reduce_dtype, autocast.state_widths) == (torch.float32, torch.float32,
                                                                                     "fp32")
    assert autocast.autocasts and Precision("cpu", "fp16", mixed=True).scales_loss
    assert mixed.name == "bf16 mixed (bf16 weights and gradients, bf16 reduce, fp32 master weights and moments)"


@pytest.mark.parametrize("arguments, message", [
    (("fp32", "mixed"), "train.precision mixed keeps 16-bit weights beside fp32 masters: set train.dtype bf16 or "
                        "fp16"),
    (("bf16", "mixd"), "train.precision must be one of autocast, mixed, got 'mixd' (did you mean mixed?)"),
    (("bf16", "autocast", "bf16"), "train.reduce_dtype bf16 needs train.precision mixed"),
    (("bf61",), "train.dtype must be one of auto, fp32, bf16, fp16, got 'bf61' (did you mean bf16?)"),
    (("fp16", "mixed", "auto", 0.0), "fp16 needs train.loss_scale > 0"),
])
def test_a_policy_that_cannot_run_is_refused_in_one_line(arguments, message):
    dtype, *rest = arguments
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_precision(dtype, torch.device("cpu"), *rest)


def test_an_fp16_run_under_deepspeed_is_refused_before_any_work(tmp_path, args, capsys):
    pytest.importorskip("deepspeed")
    argv = [*args, "--train.dtype", "fp16", "--strategy", "deepspeed", "--run-dir", str(tmp_path / "r")]
    assert run_main(argv) == 2
    assert "strategy 'deepspeed' does not run train.dtype fp16" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- every strategy against single under the policy


def test_every_strategy_under_the_bf16_policy_is_single_bit_for_bit_on_two_ranks():
    """One micro-step per rank: a sum of two 16-bit gradients and a halving are exact, so the weights (fp32 masters)
    and losses are single's bits; clipping at 1 is active (norms near 1)."""
    results = run_pooled(equivalence, 2, DATA_PARALLEL, BF16)[0]
    assert set(results) == set(DATA_PARALLEL)
    for spec, r in results.items():
        assert r.same_losses and r.same_params, (spec, r)
        assert r.max_rel_grad_norm_diff <= 1e-6, (spec, r)  # a sharded norm adds its squares in another order


def _regrouped(specs: list[str], steps: int) -> dict:
    return run_pooled(equivalence, 4, specs, dataclasses.replace(BF16, steps=steps, accum=2))[0]


def _within_16_bit_tolerance(results: dict) -> None:
    for spec, r in results.items():
        assert r.max_rel_loss_diff <= matrix.TOLERANCE_16["loss"], (spec, r)
        assert r.max_rel_grad_norm_diff <= matrix.TOLERANCE_16["grad_norm"], (spec, r)
        assert r.rel_param_diff <= matrix.TOLERANCE_16["rel_params"]["dense"], (spec, r)
        assert not r.same_losses or spec == "single"  # 16-bit sums regrouped: not the same bits (the check can fail)


def test_on_four_ranks_with_accumulation_a_sample_stays_within_the_16_bit_tolerance():
    _within_16_bit_tolerance(_regrouped(["ddp", "zero3"], steps=3))


@pytest.mark.long
def test_on_four_ranks_with_accumulation_every_strategy_stays_within_the_16_bit_tolerance():
    results = _regrouped(DATA_PARALLEL, steps=4)
    assert set(results) == set(DATA_PARALLEL)
    _within_16_bit_tolerance(results)


def test_tensor_pipeline_and_context_parallel_transfers_move_the_compute_dtype():
    """Under the bf16 policy each axis's bytes (measured from the tensors sent) equal its theory at 2 bytes a value
    (``matrix.meter_problems``: tp's all-reduces, pp's activations, cp's key/value blocks), and the layouts reproduce
    single under the same policy within the 16-bit tolerance."""
    base = dataclasses.replace(matrix.SETUP, dtype="bf16", mixed=True)
    cells = [matrix.Cell("zero2", 1, 2, 1, 1, "dense", "gpt2"), matrix.Cell("zero3", 1, 1, 2, 1, "dense", "modern"),
             matrix.Cell("ddp", 1, 1, 1, 1, "dense", "gpt2", cp=2),
             matrix.Cell("fsdp", 1, 1, 2, 1, "dense", "gpt2")]
    rows = run_pooled(matrix._run, 2, cells, base)[0]
    assert len(rows) == len(cells)
    for row in rows:
        assert row.passed, matrix.format_row(row)


def test_tensor_parallel_theory_counts_activations_at_the_policys_width_and_the_loss_in_fp32():
    """What the matrix's tp meters are held to under the policy: the activations' and gradients' all-reduces at 2
    bytes a value (half of fp32's), the loss's three figures per token at 4 (``logits.float()``)."""
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=96)
    fp32 = accounting.tensor_parallel_comm_bytes(cfg, 4, 2, 2)
    bf16 = accounting.tensor_parallel_comm_bytes(cfg, 4, 2, 2, bytes_per_element=2)
    loss = accounting.ring_elements_sent("all_reduce", 3 * 4 * 32, 2) * 4 * 2  # fp32 whatever the policy
    assert bf16["all_reduce"] - loss == pytest.approx((fp32["all_reduce"] - loss) / 2)


@pytest.mark.long
@pytest.mark.slow
def test_deepspeed_bf16_engine_reproduces_single_under_the_policy_bit_for_bit():
    pytest.importorskip("deepspeed")
    stages = [f"deepspeed:zero_stage={n}" for n in (1, 2, 3)]
    results = run_pooled(equivalence, 2, stages, BF16, deadline_s=600)[0]
    for spec, r in results.items():
        assert r.same_losses and r.same_params, (spec, r)


# ---------------------------------------------------------------- meters


def _meters_both_ways(world: World, specs: list[str]) -> dict:
    out = {}
    for spec in specs:
        for policy, setup in (("fp32", METERED), ("mixed", dataclasses.replace(METERED, dtype="bf16", mixed=True))):
            out[spec, policy] = train_tiny(world, setup, parse_spec(spec)).meters
    return out


@pytest.fixture(scope="module")
def meters() -> dict:
    """Rank 0's meters under fp32 and the bf16 policy, for each strategy, trained in this session."""
    return run_pooled(_meters_both_ways, 2, DATA_PARALLEL)[0]


def _plan_bytes_per_param(capsys) -> dict[str, float]:
    """``lab plan memory --n-gpus 2 --precision mixed``'s bytes per parameter on each GPU, by strategy."""
    assert planner.main(["memory", "--n-gpus", "2", "--precision", "mixed"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    return {row[0]: float(row[2]) for row in rows if len(row) > 2 and row[1] == "mixed"}


def test_model_states_under_the_policy_are_the_planners_mixed_rows(meters, capsys):
    """Rank 0's weights, gradients and optimizer states, measured from its tensors after the first step, within 5 %
    of what ``lab plan memory`` prices for mixed precision on 2 GPUs (2 + 2 + 12 bytes per parameter, sharded as
    each ZeRO stage shards them), where fp32 holds 16."""
    per_param = _plan_bytes_per_param(capsys)
    psi = sum(p.numel() for p in GPT(METERED.model).parameters())
    for spec, row in (("ddp_naive", "ddp"), ("ddp", "ddp"), ("torch_ddp", "ddp"), ("zero1", "zero1"),
                      ("zero2", "zero2"), ("zero3", "zero3")):
        held = meters[spec, "mixed"]["model_state_bytes"]["total"]
        assert held == pytest.approx(per_param[row] * psi, rel=0.05), (spec, held / psi, per_param[row])
        parts = accounting.model_state_bytes(psi, row, 2, "mixed")
        for part in ("params", "grads", "optimizer"):
            assert meters[spec, "mixed"]["model_state_bytes"][part] == pytest.approx(getattr(parts, part), rel=0.05)
        fp32 = meters[spec, "fp32"]["model_state_bytes"]["total"]
        assert fp32 == pytest.approx(accounting.model_state_bytes(psi, row, 2, "fp32").total, rel=0.05)


def test_every_collective_sends_half_of_fp32s_bytes_and_its_theory(meters):
    """The weights and gradients the collectives move are 16-bit: a strategy that still sent fp32 gradients or
    gathered fp32 weights would send fp32's bytes (and leave its theory at 2 bytes a value)."""
    for spec in DATA_PARALLEL:
        mixed, fp32 = meters[spec, "mixed"], meters[spec, "fp32"]
        assert sum(fp32["comm_bytes_per_step"].values()) > 0, spec
        for kind, sent in mixed["comm_bytes_per_step"].items():
            assert sent == mixed["comm_bytes_per_step_theory"][kind], (spec, kind)
            assert sent == fp32["comm_bytes_per_step"][kind] / 2, (spec, kind)


def test_fsdp_keeps_fp32_shards_and_sends_16_bit_ones(meters):
    """FSDP2's MixedPrecisionPolicy: fp32 shards of weights and gradients at rest (its states those of fp32), bf16
    gathers and reduce-scatters."""
    mixed, fp32 = meters["fsdp", "mixed"], meters["fsdp", "fp32"]
    for part in ("params", "grads"):
        assert mixed["model_state_bytes"][part] == mixed["model_state_bytes_theory"][part] == \
            fp32["model_state_bytes"][part]


def test_the_memory_check_prices_the_policy_the_run_uses():
    """A budget between the mixed and the fp32 estimate of zero1's states on 2 ranks admits the bf16 policy and
    refuses autocast (whose weights, gradients and collectives stay fp32)."""
    cfg = RunConfig(model=ModelConfig(n_layer=8, n_head=8, d_model=512, block_size=64, vocab_size=4096),
                    parallel=ParallelConfig(strategy="zero1"))
    cfg.train.micro_batch, cfg.train.batch_tokens = 1, 128
    world = World(0, 2, 0, torch.device("cpu"))
    psi = accounting.param_counts(cfg.model).total
    budget = (accounting.model_state_bytes(psi, "zero1", 2, "mixed").total +
              accounting.model_state_bytes(psi, "zero1", 2, "fp32").total) / 2

    def check(precision: Precision) -> float:
        layout = Layout.of(cfg.parallel, world.world_size, strategy_class(cfg.parallel.strategy))
        return check_resources(cfg, layout, world, precision, Peak(1e12, "t"), 4096, budget).memory_bytes

    assert check(Precision("cpu", "bf16", mixed=True)) <= budget
    with pytest.raises(ConfigError, match="model states"):
        check(Precision("cpu", "bf16"))


# ---------------------------------------------------------------- fp16: an overflow survived


def _fp16_run(world: World, spec: str, poisoned: int | None, skipped_by_hand: int | None) -> dict:
    """Six steps of the tiny GPT under the fp16 policy (scale 1024, doubled after 2 clean steps). ``poisoned``: rank 1's
    loss gets an infinite gradient in that step (its backward overflows); ``skipped_by_hand``: that step is not run and
    the scale is halved by the test."""
    setup = Setup(steps=6, dtype="fp16", mixed=True)
    precision = Precision("cpu", "fp16", mixed=True, loss_scale=1024.0, loss_scale_window=2)
    strategy = create(parse_spec(spec), world, precision, loop_settings(setup))
    strategy.build(lambda: GPT(setup.model, seed=setup.seed), lambda m: param_groups(m, 0.1),
                   adamw_factory(TrainConfig(), world.device))
    forward, step = strategy.forward, {"now": 0}

    def forward_poisoned(x, y, *, sync):
        loss = forward(x, y, sync=sync)
        if step["now"] == poisoned and world.rank == 1:
            loss.register_hook(lambda g: g * math.inf)
        return loss

    strategy.forward = forward_poisoned
    plan = StepPlan(global_sequences=2 * world.world_size, accum_steps=1, total_steps=6, micro_batch=2,
                    world_size=world.world_size)
    out = {"losses": [], "stepped": [], "scales": []}
    for step["now"] in range(setup.steps):
        if step["now"] == skipped_by_hand:
            scaler = strategy.precision_step.scaler
            scaler.load_state_dict({"scale": scaler.scale / 2, "clean_steps": 0})
        else:
            x, y = batch(setup, step["now"], plan.global_sequences)
            lo, hi = plan.micro_range(world.rank, 0)
            result = train_step(strategy, world, [(x[lo:hi], y[lo:hi])], 1, setup.lr, setup.grad_clip)
            out["losses"].append(result.loss)
            out["stepped"].append(result.stepped)
        out["scales"].append(strategy.precision_step.scaler.scale)
    out["weights"] = strategy.full_state_dict()
    return out


@pytest.mark.parametrize("spec", ["ddp", "zero2", "fsdp"])
def test_an_injected_overflow_skips_its_step_halves_the_scale_and_training_goes_on_as_if_skipped_by_hand(spec):
    hit = run_pooled(_fp16_run, 2, spec, 2, None)[0]
    by_hand = run_pooled(_fp16_run, 2, spec, None, 2)[0]
    assert hit["stepped"] == [True, True, False, True, True, True]  # every rank skipped it: rank 0's loss was finite
    # doubled after 2 clean steps, halved at the overflow, doubled after the next 2 clean ones
    assert hit["scales"] == [1024, 2048, 1024, 1024, 2048, 2048] == by_hand["scales"]
    assert all(math.isfinite(loss) for loss in hit["losses"])
    assert hit["losses"][:2] + hit["losses"][3:] == by_hand["losses"]
    assert all(torch.equal(hit["weights"][k], by_hand["weights"][k]) for k in by_hand["weights"])


def _fp16_args(args: tuple[str, ...]) -> list[str]:
    """The tiny run, 5 steps, under the fp16 policy from a scale of 2^18: its second step's gradients overflow fp16."""
    return [*args, "--train.dtype", "fp16", "--train.precision", "mixed", "--train.loss_scale", str(2.0**18),
            "--train.loss_scale_window", "2", "--train.tokens", "1280"]  # fp16 matmuls are slow on a CPU


def _steps(run_dir) -> list[dict]:
    return [r for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(line))]


@pytest.mark.slow
def test_fp16s_scale_is_in_the_step_line_the_records_the_summary_and_the_checkpoint(tmp_path, args, capsys):
    """An overflowing step is skipped (no gradient norm) and halves the scale; 2 clean steps double it; the step line,
    the records, the summary and the checkpoint's metadata carry the scale."""
    assert run_main([*_fp16_args(args), "--run-dir", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ") and "loss scale" in line]
    steps = _steps(tmp_path)
    assert [r["grad_norm"] is None for r in steps][:4] == [False, True, False, False]
    assert [r["loss_scale"] for r in steps][:4] == [2.0**18, 2.0**17, 2.0**17, 2.0**18]
    assert len(lines) == len(steps) == 5
    for r in steps:
        assert f"loss scale {r['loss_scale']:g}" in lines[r["step"] - 1]
        assert ("grad skipped (non-finite)" in lines[r["step"] - 1]) == (r["grad_norm"] is None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["loss_scale"] == steps[-1]["loss_scale"] and summary["precision"].startswith("fp16 mixed")
    assert summary["skipped_steps"] == sum(r["grad_norm"] is None for r in steps)
    meta = checkpoint.read_meta(checkpoint.latest(tmp_path))
    assert meta["loss_scale"] == {"scale": summary["loss_scale"], "clean_steps": meta["loss_scale"]["clean_steps"]}


@pytest.mark.long
@pytest.mark.slow
def test_a_resumed_fp16_run_goes_on_from_its_checkpoints_scale(tmp_path, args):
    """Stopped after 3 steps (clean once since its scale was halved) and resumed: the same losses, scales and weights
    as the run that was not stopped (a resume from the initial scale would overflow again)."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run_main([*_fp16_args(args), "--run-dir", str(whole)]) == 0
    assert run_main([*_fp16_args(args), "--run-dir", str(part), "--train.stop_after", "3"]) == 0
    assert checkpoint.read_meta(checkpoint.latest(part))["loss_scale"] == {"scale": 2.0**17, "clean_steps": 1}
    assert run_main([*_fp16_args(args), "--run-dir", str(part), "--resume"]) == 0
    assert [(r["loss"], r["loss_scale"]) for r in _steps(part)] == [(r["loss"], r["loss_scale"]) for r in _steps(whole)]
    final = [checkpoint.load_everything(checkpoint.latest(run)) for run in (whole, part)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_every_layout_of_the_matrix_under_the_bf16_policy_reproduces_single_under_it(ranks):
    """Every strategy × tp × pp × ep × cp the matrix trains, under the bf16 policy against single under it: within
    ``matrix.TOLERANCE_16``, every meter at its theory in the policy's widths."""
    base = dataclasses.replace(matrix.SETUP, dtype="bf16", mixed=True)
    cells = [cell for cell in matrix.layouts(8, list(matrix.STRATEGIES), ["dense", "moe"], ["gpt2", "modern"])
             if cell.ranks == ranks and matrix.refusal(cell) is None]
    assert cells
    rows = run_pooled(matrix._run, ranks, cells, base, deadline_s=1200)[0]
    assert len(rows) == len(cells)
    for row in rows:
        assert row.passed, matrix.format_row(row)
