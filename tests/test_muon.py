"""Muon for the hidden matrices beside AdamW (lab.training.muon): torch.optim.Muon's update to the bit, the matrices
it takes, its options' refusals, checkpoints, and each matrix orthogonalized once across a data axis."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lab.commands.equivalence import TINY, Setup, batch, loop_settings, train_tiny
from lab.model import GPT
from lab.parallel import Layout, World, parse_spec
from lab.runtime.config import ConfigError, ParallelConfig, TrainConfig, resolve
from lab.training.optim import param_groups
from lab.training.plan import check_layout, check_optimizer
from pool import run_pooled

ALONE = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
MODERN = dataclasses.replace(TINY, arch="modern", tie_embeddings=False)
MOE = dataclasses.replace(TINY, moe_experts=4, moe_top_k=2, moe_granularity=2, moe_shared_experts=1)
SETUP = Setup(steps=4, accum=2, grad_clip=0.0, optimizer="muon")


def _torch_reference(setup: Setup) -> dict[str, torch.Tensor]:
    """torch.optim.Muon (RMS-matched to AdamW) on the lab's Muon group and torch.optim.AdamW on the rest, over the
    same micro-batches: the final weights."""
    model = GPT(setup.model, seed=setup.seed)
    named = dict(model.named_parameters())
    cfg = TrainConfig()
    groups = param_groups(model, 0.1, muon=True)
    muon = torch.optim.Muon([named[n] for g in groups if g.muon for n in g.names], lr=setup.lr, weight_decay=0.1,
                            momentum=cfg.muon_momentum, nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [named[n] for n in g.names], "weight_decay": g.weight_decay}
                               for g in groups if not g.muon and g.names], lr=setup.lr, betas=(cfg.beta1, cfg.beta2),
                              eps=1e-8, fused=True)
    for step in range(setup.steps):
        x, y = batch(setup, step, setup.micro_batch * setup.accum)
        for lo in range(0, len(x), setup.micro_batch):
            (model(x[lo:lo + setup.micro_batch], y[lo:lo + setup.micro_batch]) / setup.accum).backward()
        muon.step()
        adamw.step()
        model.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model", [TINY, MODERN, MOE], ids=["gpt2", "modern", "moe"])
def test_the_lab_s_muon_is_torch_s_to_the_bit(model):
    setup = dataclasses.replace(SETUP, model=model)
    got = train_tiny(ALONE, setup, ParallelConfig(strategy="single")).params
    ref = _torch_reference(setup)
    assert got.keys() == ref.keys()
    differ = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not differ, differ
    adamw_only = train_tiny(ALONE, dataclasses.replace(setup, optimizer="adamw"), ParallelConfig(strategy="single"))
    assert not torch.equal(adamw_only.params["blocks.0.attn.qkv.weight"], got["blocks.0.attn.qkv.weight"])


def test_muon_takes_the_blocks_linear_weights_and_adamw_the_rest():
    model = GPT(MOE)
    groups = param_groups(model, 0.1, muon=True)
    muon = {n for g in groups if g.muon for n in g.names}
    rest = {n for g in groups if not g.muon for n in g.names}
    assert "blocks.0.attn.qkv.weight" in muon and "blocks.1.mlp.experts.3.down.weight" in muon
    assert "blocks.0.mlp.shared.up.weight" in muon
    assert {"wte.weight", "wpe.weight", "blocks.0.mlp.router.weight", "blocks.0.attn.qkv.bias",
            "blocks.0.norm1.weight"} <= rest
    assert not muon & rest and muon | rest == {n for n, _ in model.named_parameters()}
    assert all(model.get_parameter(n).dim() == 2 for n in muon)
    assert [g for g in groups if g.muon][0].weight_decay == 0.1


@pytest.mark.parametrize("train, message", [
    ({"optimizer": "sgd"}, "train.optimizer must be one of adamw, muon"),
    ({"optimizer": "muon", "muon_ns_steps": 0}, "train.muon_ns_steps must be in 1..99"),
    ({"optimizer": "muon", "muon_momentum": 1.0}, r"train.muon_momentum must be in \[0, 1\)"),
    ({"optimizer": "muon", "muon_ns_coefficients": "3.4,-4.7"}, "three numbers a,b,c"),
])
def test_bad_muon_options_are_refused_in_one_line(train, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_optimizer(resolve({"train": train}))
    assert "\n" not in str(refused.value)


def test_deepspeed_refuses_muon_in_one_line():
    with pytest.raises(ConfigError, match="its engine steps its own optimizer") as refused:
        check_layout(parse_spec("deepspeed"), 2, loop_settings(SETUP))
    assert "\n" not in str(refused.value)


def _by_layout(world: World, specs: list[str], setup: Setup) -> dict:
    """Each layout's trace on this world (the step's micro-batches split over its data-parallel ranks), and single's
    over all of them on this process (its threads run the same kernels as the ranks')."""
    out, references = {}, {}
    for spec in specs:
        parallel = parse_spec(spec)
        trace = train_tiny(world, setup, parallel)
        replicas = Layout.of(parallel, world.world_size).dp
        if replicas not in references:
            alone = dataclasses.replace(setup, accum=setup.accum * replicas)
            references[replicas] = train_tiny(ALONE, alone, ParallelConfig(strategy="single")).params
        out[spec] = {"params": trace.params, "records": trace.records, "single": references[replicas]}
    out["single"] = references[Layout.of(parse_spec(specs[0]), world.world_size).dp]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model", [TINY, MOE], ids=["gpt2", "moe"])
def test_replicated_data_parallel_muon_is_single_s_to_the_bit_on_two_ranks(model):
    """ddp_naive, ddp, torch_ddp (owners) and ddp with every rank orthogonalizing everything, against single
    accumulating both ranks' micro-batches: the same bits (one micro-batch a rank: the sync's sums are exact)."""
    setup = dataclasses.replace(SETUP, accum=1, model=model)
    specs = ["ddp_naive", "ddp", "torch_ddp", "ddp:muon_redundant=true"]
    got = run_pooled(_by_layout, 2, specs, setup)
    ref = got[0]["single"]
    for spec in specs:
        differ = [n for n in ref if not torch.equal(got[0][spec]["params"][n], ref[n])]
        assert not differ, (spec, differ)
    matrices = sum(1 for g in param_groups(GPT(model), 0.1, muon=True) if g.muon for _ in g.names)
    for spec in specs[:3]:  # owners: each matrix once over the two ranks, each rank some
        done = [rank[spec]["records"][-1]["muon_orthogonalized"] for rank in got]
        assert sum(done) == matrices and min(done) > 0, (spec, done)
    redundant = [rank["ddp:muon_redundant=true"]["records"][-1] for rank in got]
    assert [r["muon_orthogonalized"] for r in redundant] == [matrices] * 2
    assert all(r["muon_sent_bytes"] == 0 for r in redundant)


@pytest.mark.slow
def test_four_owners_share_the_work_and_send_what_theory_says():
    """On 4 ranks: each matrix orthogonalized once over the ranks in every step, the owners' Newton-Schulz FLOPs
    within 1.3 of their mean, the bytes all-gathered equal to theory, and the weights single's within the
    equivalence tolerance (the sync regroups the sums)."""
    setup = dataclasses.replace(SETUP, accum=1, micro_batch=1)
    got = run_pooled(_by_layout, 4, ["ddp"], setup)
    matrices = sum(len(g.names) for g in param_groups(GPT(TINY), 0.1, muon=True) if g.muon)
    for step in range(setup.steps):
        records = [rank["ddp"]["records"][step] for rank in got]
        assert sum(r["muon_orthogonalized"] for r in records) == matrices
        for r in records:
            assert r["muon_sent_bytes"] == r["muon_sent_bytes_theory"] > 0
            assert r["muon_owner_load"] <= 1.3
    ref = got[0]["single"]
    params = got[0]["ddp"]["params"]
    assert max((params[n] - ref[n]).abs().max().item() for n in ref) <= 1e-3


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    from lab.runtime import checkpoint

    return {k: v for k, v in checkpoint.load_everything(checkpoint.latest(run_dir)).items()
            if k.startswith(("model/", "optim/"))}


@pytest.mark.slow
def test_a_muon_run_resumes_with_its_momentum_on_one_rank_and_from_two(args, tmp_path, capsys):
    """The tiny run under Muon: stopped at step 5 and resumed, its final weights and moments (Muon's momentum
    buffers among them) are the uninterrupted run's to the bit; saved by ddp on 2 ranks at step 4 and resumed by
    single, within the equivalence tolerance. The step line shows Muon's time and gather."""
    from lab.commands.cli import run_main
    from test_checkpoints import train_argv

    muon = [*args, "--train.optimizer", "muon"]
    whole, parts, moved = tmp_path / "whole", tmp_path / "parts", tmp_path / "moved"
    assert run_main([*muon, "--run-dir", str(whole)]) == 0
    assert " | muon " in capsys.readouterr().out
    assert run_main([*muon, "--train.stop_after", "5", "--run-dir", str(parts)]) == 0
    assert run_main([*muon, "--resume", "latest", "--run-dir", str(parts)]) == 0
    ref, got = _final_weights(whole), _final_weights(parts)
    assert any(k.endswith("/momentum_buffer") for k in ref) and any(k.endswith("/exp_avg") for k in ref)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert run_pooled(train_argv, 2, [*muon, "--parallel.strategy", "ddp", "--train.stop_after", "4"],
                      moved) == ["stopped"] * 2
    assert run_main([*muon, "--resume", "latest", "--run-dir", str(moved)]) == 0
    resumed = _final_weights(moved)
    assert max((resumed[k] - ref[k]).abs().max().item() for k in ref if k.startswith("model/")) <= 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("model, mixed", [(TINY, False), (MODERN, False), (TINY, True)],
                         ids=["gpt2", "modern", "gpt2-bf16-mixed"])
def test_sharded_muon_gathers_each_matrix_to_its_owner_and_trains_single_s_bits(model, mixed):
    """zero1, zero2, zero3 (flat chunks cut across matrices) and fsdp (row blocks) on 2 ranks, in fp32 and under
    bf16 mixed precision (fp32 masters and momentum, the iteration in bf16): single's bits; each matrix
    orthogonalized once over the ranks; the bytes each rank sends to owners and back equal theory."""
    setup = dataclasses.replace(SETUP, accum=1, model=model, dtype="bf16" if mixed else "fp32", mixed=mixed)
    specs = ["zero1", "zero2", "zero3", "fsdp"] + (["ddp"] if mixed else [])
    got = run_pooled(_by_layout, 2, specs, setup)
    ref = got[0]["single"]
    matrices = sum(len(g.names) for g in param_groups(GPT(model), 0.1, muon=True) if g.muon)
    for spec in specs:
        differ = [n for n in ref if not torch.equal(got[0][spec]["params"][n], ref[n])]
        assert not differ, (spec, differ)
        for step in range(setup.steps):
            records = [rank[spec]["records"][step] for rank in got]
            assert sum(r["muon_orthogonalized"] for r in records) == matrices, (spec, step)
            assert all(r["muon_sent_bytes"] == r["muon_sent_bytes_theory"] > 0 for r in records), (spec, records)


@pytest.mark.slow
def test_sharded_muon_on_four_ranks_balances_its_owners():
    """zero2, zero3 and fsdp on 4 ranks: within the equivalence tolerance of single, owners within 1.3 of the mean,
    bytes at theory."""
    setup = dataclasses.replace(SETUP, accum=1, micro_batch=1)
    specs = ["zero2", "zero3", "fsdp"]
    got = run_pooled(_by_layout, 4, specs, setup)
    ref = got[0]["single"]
    for spec in specs:
        params = got[0][spec]["params"]
        assert max((params[n] - ref[n]).abs().max().item() for n in ref) <= 1e-3, spec
        for r in (rank[spec]["records"][-1] for rank in got):
            assert r["muon_owner_load"] <= 1.3 and r["muon_sent_bytes"] == r["muon_sent_bytes_theory"]


@pytest.mark.slow
def test_a_sharded_muon_run_resumes_under_another_strategy_and_world_size(args, tmp_path):
    """Saved by zero3 on 2 ranks at step 4 (each matrix's momentum cut across the ranks' chunks), resumed by zero1 on
    2 ranks and, from fsdp's save, by single: the uninterrupted single run's final weights within the equivalence
    tolerance."""
    from lab.commands.cli import run_main
    from test_checkpoints import train_argv

    muon = [*args, "--train.optimizer", "muon"]
    assert run_main([*muon, "--run-dir", str(tmp_path / "whole")]) == 0
    ref = _final_weights(tmp_path / "whole")
    for saved, resumed in (("zero3", "zero1"), ("fsdp", None)):
        run_dir = tmp_path / saved
        assert run_pooled(train_argv, 2, [*muon, "--parallel.strategy", saved, "--train.stop_after", "4"],
                          run_dir) == ["stopped"] * 2
        if resumed is None:
            assert run_main([*muon, "--resume", "latest", "--run-dir", str(run_dir)]) == 0
        else:
            assert run_pooled(train_argv, 2, [*muon, "--parallel.strategy", resumed, "--resume", "latest"],
                              run_dir) == ["completed"] * 2
        got = _final_weights(run_dir)
        assert got.keys() == ref.keys(), (saved, sorted(got.keys() ^ ref.keys()))
        assert max((got[k] - ref[k]).abs().max().item() for k in ref if k.startswith("model/")) <= 1e-3, saved
        momenta = [k for k in ref if k.endswith("/momentum_buffer")]
        # a momentum restarted from zero at step 4 would be off by tens of percent after 4 more steps (μ = 0.95)
        assert momenta and max((got[k] - ref[k]).norm() / ref[k].norm() for k in momenta) <= 2e-2, saved



# Where a layout's gradients differ from single's in their last bits (regrouped sums: accumulation, a pipeline's
# microbatches, a context or tensor split), Muon's weights differ by more than AdamW's: the quintic's slope at small
# singular values (a = 3.4 per iteration, 3.4^5 ≈ 450 over 5) amplifies a flipped bf16 rounding of the update. On the
# tiny models with 5 iterations the weights stray up to 1e-2 from single's in 4 steps (tp_impl torch, GQA), with 1
# iteration 2e-5, as AdamW's (1e-5): the split-axis tests run 1 iteration, so that a wrong gather (a run missing or
# misplaced: 3e-2 and more) cannot hide in the tolerance.
SPLIT_TOLERANCE = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("model, specs", [
    (MODERN, ["ddp:pp=2", "zero2:pp=2", "fsdp:pp=2", "zero3:cp=2", "fsdp:cp=2"]),
    (MOE, ["ddp:ep=2", "zero1:ep=2", "zero3:ep=2", "fsdp:ep=2"]),
], ids=["pp-cp", "ep"])
def test_muon_under_a_pipeline_a_context_split_and_experts_split_on_two_ranks(model, specs):
    """Each stage orthogonalizes its own matrices; the cp ranks share theirs as data-parallel ranks do; an expert's
    matrices are orthogonalized among the ranks holding that expert (here each rank alone), the others over the data
    axis. Against single accumulating the same micro-batches, every matrix orthogonalized once a step over the ranks,
    and the weights within ``SPLIT_TOLERANCE`` (see there)."""
    _assert_split_layouts(dataclasses.replace(SETUP, model=model, muon_ns_steps=1), specs)


def _assert_split_layouts(setup: Setup, specs: list[str]) -> None:
    """On 2 ranks, each layout within ``SPLIT_TOLERANCE`` of single, each matrix orthogonalized once a step over the
    ranks, the bytes at theory."""
    got = run_pooled(_by_layout, 2, specs, setup)
    matrices = sum(len(g.names) for g in param_groups(GPT(setup.model), 0.1, muon=True) if g.muon)
    for spec in specs:
        ref, params = got[0][spec]["single"], got[0][spec]["params"]
        assert max((params[n] - ref[n]).abs().max().item() for n in ref) <= SPLIT_TOLERANCE, spec
        for step in range(setup.steps):
            records = [rank[spec]["records"][step] for rank in got]
            assert sum(r["muon_orthogonalized"] for r in records) == matrices, (spec, step, records)
            assert all(r["muon_sent_bytes"] == r["muon_sent_bytes_theory"] for r in records), (spec, records)


GQA = dataclasses.replace(MODERN, n_head=4, n_kv_head=1)  # one key/value head on 2 tensor ranks: its rows replicated


@pytest.mark.slow
@pytest.mark.parametrize("model, specs", [
    (TINY, ["ddp:tp=2", "single:tp=2", "zero2:tp=2", "zero3:tp=2", "fsdp:tp=2"]),
    (GQA, ["zero2:tp=2", "ddp:tp=2,tp_impl=torch"]),
], ids=["gpt2", "gqa"])
def test_muon_gathers_a_matrix_split_over_tensor_ranks_on_two_ranks(model, specs):
    """A matrix split over the tensor ranks (columns or rows; a replicated key/value head's rows held by both) is
    brought whole to its owner among the ranks of its pipeline stage, from the first holder of each run, and its
    result sent to every holder: within ``SPLIT_TOLERANCE`` of single, each matrix orthogonalized once a step, bytes
    at theory."""
    _assert_split_layouts(dataclasses.replace(SETUP, accum=1, model=model, muon_ns_steps=1), specs)


@pytest.mark.slow
def test_muon_under_composed_axes_on_four_ranks():
    """tp 2 × dp 2 (zero2, fsdp, the DTensor reference under ddp, sequence parallelism under zero1), tp 2 × pp 2
    under zero3, and experts split beside tp (ddp, zero2, zero3, fsdp: a sharded tensor holding pieces of matrices
    of three groups, the stage's, the data axis's and an expert's): within ``SPLIT_TOLERANCE`` of single."""
    for model, specs in ((MODERN, ["zero2:tp=2", "fsdp:tp=2", "ddp:tp=2,tp_impl=torch",
                                   "zero1:tp=2,sequence_parallel=true", "zero3:tp=2,pp=2"]),
                         (MOE, ["ddp:ep=2,tp=2", "zero2:ep=2,tp=2", "zero3:ep=2,tp=2", "fsdp:ep=2,tp=2"])):
        got = run_pooled(_by_layout, 4, specs, dataclasses.replace(SETUP, accum=1, model=model, muon_ns_steps=1),
                         deadline_s=240)
        matrices = sum(len(g.names) for g in param_groups(GPT(model), 0.1, muon=True) if g.muon)
        for spec in specs:
            ref, params = got[0][spec]["single"], got[0][spec]["params"]
            assert max((params[n] - ref[n]).abs().max().item() for n in ref) <= SPLIT_TOLERANCE, spec
            # each matrix once over the ranks (a pipeline's stages each their own; under ep beside tp the experts
            # and the shared one, whole on every tensor rank, once per tensor rank)
            if model is MODERN:
                assert sum(rank[spec]["records"][-1]["muon_orthogonalized"] for rank in got) == matrices, spec


def _losses(run_dir) -> dict[int, float]:
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


@pytest.mark.slow
def test_a_muon_checkpoint_of_zero3_pp2_tp2_resumes_under_zero1_and_under_single(args, tmp_path):
    """Saved at step 4 by zero3 on a pipeline of 2 stages each split over 2 tensor ranks (4 ranks), resumed by zero1
    on 2 ranks and by single: steps 5-8 log the uninterrupted single run's losses (within 1e-4; one Newton-Schulz
    iteration, as the split-axis tests) and end with its momentum buffers (within 1e-3: a momentum lost at the load
    would be off by tens of percent)."""
    import shutil

    from lab.commands.cli import run_main
    from test_checkpoints import train_argv

    muon = [*args, "--train.optimizer", "muon", "--train.muon_ns_steps", "1"]
    assert run_main([*muon, "--run-dir", str(tmp_path / "whole")]) == 0
    saved = tmp_path / "saved"
    assert run_pooled(train_argv, 4, [*muon, "--parallel.strategy", "zero3", "--parallel.pp", "2", "--parallel.tp",
                                      "2", "--train.stop_after", "4"], saved) == ["stopped"] * 4
    shutil.copytree(saved, tmp_path / "zero1")
    assert run_pooled(train_argv, 2, [*muon, "--parallel.strategy", "zero1", "--resume", "latest"],
                      tmp_path / "zero1") == ["completed"] * 2
    assert run_main([*muon, "--resume", "latest", "--run-dir", str(saved)]) == 0
    ref, ref_state = _losses(tmp_path / "whole"), _final_weights(tmp_path / "whole")
    momenta = [k for k in ref_state if k.endswith("/momentum_buffer")]
    for run_dir in (tmp_path / "zero1", saved):
        got, state = _losses(run_dir), _final_weights(run_dir)
        assert all(abs(got[step] - ref[step]) <= 1e-4 * ref[step] for step in range(5, 9)), (run_dir.name, got, ref)
        assert momenta and max((state[k] - ref_state[k]).norm() / ref_state[k].norm() for k in momenta) <= 1e-3


def test_the_plan_counts_one_moment_for_muon_s_share(capsys):
    """``lab plan memory --muon-share``: Muon's elements hold one fp32 moment (4 B fewer each, sharded where the
    optimizer is), so each row's bytes per parameter fall by 4 · share (ddp) or 4 · share / N_d (zero1-3)."""
    from lab.commands.resources import main
    from lab.measure import accounting

    for row, n in (("ddp", 8), ("zero1", 8), ("zero3", 8)):
        adamw = accounting.model_state_bytes(1.0, row, n, "mixed")
        muon = accounting.model_state_bytes(1.0, row, n, "mixed", one_moment=0.95)
        assert adamw.total - muon.total == pytest.approx(4 * 0.95 / (1 if row == "ddp" else n))
    assert main(["memory", "--n-gpus", "8", "--precision", "mixed", "--muon-share", "0.95"]) == 0
    out = capsys.readouterr().out
    assert "12.2" in out and "Muon on 95% of Ψ" in out
