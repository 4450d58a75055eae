"""Mixture of experts: the dense model unchanged, the router's losses and capacity, the accounting of active
parameters, bad input, a tiny run end to end and the data-parallel strategies against single."""

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from lab.commands import hf
from lab.commands.cli import run_main, sample_main
from lab.commands.resources import main as plan_main
from lab.commands.equivalence import TINY, Setup, equivalence
from lab.measure import accounting
from lab.model import GPT, MoE, router_meters
from lab.parallel import activations
from lab.runtime.config import ConfigError, ModelConfig, resolve
from pool import run_pooled

SMALL = dict(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=64)


def moe_config(arch: str = "gpt2", **kw) -> ModelConfig:
    return ModelConfig(arch=arch, **SMALL, **({"moe_experts": 4, "moe_top_k": 2} | kw))


def tokens(n: int = 2, length: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 64, (n, length + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def dense_reference_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of a dense GPT composed here from torch's functions and the model's own weights, as the model
    computed it before mixtures of experts existed: embeddings, per block x + attn(norm1 x) and
    x + mlp(norm2 x) with the MLP written out, the final norm, the tied head and the cross-entropy; no router,
    no auxiliary loss. Attention is the model's own module, which the MoE code does not touch."""
    cfg = model.cfg
    h = model.wte(x) + (model.wpe(torch.arange(x.shape[1])) if model.wpe is not None else 0)
    rope = (model.rope_cos, model.rope_sin) if cfg.arch == "modern" else None
    for block in model.blocks:
        h = h + block.attn(block.norm1(h), rope)
        up = F.linear(block.norm2(h), block.mlp.up.weight, block.mlp.up.bias)
        if cfg.arch == "modern":
            gate, up = up.chunk(2, dim=-1)
            up = F.silu(gate) * up
        else:
            up = F.gelu(up, approximate="tanh")
        h = h + F.linear(up, block.mlp.down.weight, block.mlp.down.bias)
    logits = F.linear(model.norm_f(h), model.wte.weight)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_a_dense_model_is_unchanged_bit_for_bit(arch):
    """moe_experts 0 builds and trains the dense model: the router options change none of its weights, and its
    training loss and every gradient equal, bit for bit, those of the dense computation written out in this test
    (run on the same CPU, so any instruction set gives both the same bits)."""
    cfg = ModelConfig(arch=arch, n_layer=2, n_head=2, n_kv_head=1 if arch == "modern" else None, d_model=32,
                      block_size=16, vocab_size=64)
    model = GPT(cfg, seed=3)
    routed_options = GPT(dataclasses.replace(cfg, moe_top_k=2, moe_normalize_gates=False,
                                             moe_aux_loss_coef=1.0, moe_capacity_factor=1.0), seed=3)
    weights = model.state_dict()
    assert list(weights) == list(routed_options.state_dict())
    assert all(torch.equal(weights[name], value) for name, value in routed_options.state_dict().items())
    assert not any(".router" in name or ".experts." in name for name in weights)
    reference = copy.deepcopy(model)
    x, y = tokens(length=cfg.block_size, seed=0)
    loss, expected = model(x, y), dense_reference_loss(reference, x, y)
    loss.backward()
    expected.backward()
    assert loss.item().hex() == expected.item().hex()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
    assert model.moe_layers() == [] and model.take_router_counts() is None


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_training_loss_adds_the_router_losses_and_eval_is_plain_cross_entropy(arch):
    model = GPT(moe_config(arch, moe_granularity=2, moe_shared_experts=1), seed=1)
    x, y = tokens()
    loss = model(x, y)
    aux = [moe.aux_loss for moe in model.moe_layers()]
    assert len(aux) == 2 and all(a.requires_grad and a > 0 for a in aux)
    model.eval()
    with torch.no_grad():
        ce = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        assert model(x, y).item() == pytest.approx(ce.item(), rel=1e-6)
    assert loss.item() == pytest.approx(ce.item() + sum(a.item() for a in aux), rel=1e-6)
    expert = model.blocks[0].mlp.experts[0]
    assert expert.gated == (arch == "modern") and expert.down.in_features == accounting.ffn_width(model.cfg) // 2


def test_load_balancing_loss_drives_a_skewed_router_toward_balance():
    torch.manual_seed(0)
    moe = MoE(moe_config(moe_experts=4, moe_top_k=1, moe_aux_loss_coef=1.0, moe_z_loss_coef=0.0))
    x = torch.randn(256, 32)
    x[:, 0] = 1.0  # a constant feature: through it the router favours expert 0 for every token
    with torch.no_grad():
        moe.router.weight.mul_(5)  # a sharp router
        moe.router.weight[:, 0] = 0.0
        moe.router.weight[0, 0] = 5.0
    optimizer = torch.optim.Adam(moe.router.parameters(), lr=0.05)
    loads, losses = [], []
    for _ in range(30):
        moe(x)
        losses.append(moe.aux_loss.item())
        loads.append(router_meters(moe.take_counts()[None], top_k=1)["moe_load_max_over_mean"])
        optimizer.zero_grad()
        moe.aux_loss.backward()
        optimizer.step()
    assert loads[0] > 2.5 and losses[0] > 2.0  # 4 experts: 4 and 4 when one takes all
    assert loads[-1] < 1.3 and losses[-1] < 1.1  # 1 and 1 when balanced


def test_capacity_drops_the_assignments_past_each_experts_capacity():
    moe = MoE(moe_config(moe_experts=4, moe_top_k=2, moe_capacity_factor=0.5))
    # 3 tokens × 2 choices over 4 experts at factor 0.5: capacity ceil(0.5 · 3 · 2 / 4) = 1 per expert.
    # First choices in token order: t0→0 kept, t1→0 dropped, t2→1 kept; then the second: t0→1 dropped
    # (expert 1 is full), t1→2 kept, t2→0 dropped.
    choice = torch.tensor([[0, 1], [0, 2], [1, 0]])
    assert moe.kept(choice).tolist() == [[True, False], [False, True], [True, False]]
    moe.capacity_factor = 1.0  # capacity 2: only t2's second choice (expert 0's third) is dropped
    assert moe.kept(choice).tolist() == [[True, True], [True, True], [True, False]]


def test_a_forward_counts_its_drops_and_a_fully_dropped_token_passes_through_as_zero():
    moe = MoE(moe_config(moe_experts=2, moe_top_k=1, moe_capacity_factor=1.0))
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 1.0  # feature 0 positive: expert 0, else expert 1
    x = torch.randn(8, 32)
    x[:, 0] = torch.tensor([1.0, 1, 1, 1, 1, 1, -1, -1])  # 6 tokens want expert 0, which takes ceil(8/2) = 4
    out = moe(x)
    counts = moe.take_counts()
    assert counts[:2].tolist() == [6, 2] and counts[2].item() == 2 and counts[4].item() == 8
    assert torch.all(out[4:6] == 0) and torch.all(out[:4].abs().sum(dim=1) > 0)
    assert router_meters(counts[None], 1)["moe_dropped_tokens"] == 2


def test_gates_are_the_top_k_probabilities_or_with_normalize_gates_those_over_their_sum():
    x = torch.randn(6, 32)
    moe = MoE(moe_config(moe_experts=4, moe_top_k=2, moe_normalize_gates=True))
    gate, choice = moe.router(x).softmax(dim=-1).topk(2, dim=-1)

    def weighted(scale: torch.Tensor) -> torch.Tensor:
        return torch.stack([sum(moe.experts[int(e)](x[t:t + 1])[0] * g * scale[t] for e, g in zip(choice[t], gate[t]))
                            for t in range(len(x))])

    torch.testing.assert_close(moe(x), weighted(1 / gate.sum(dim=-1)), rtol=1e-5, atol=1e-6)
    moe.normalize_gates = False
    torch.testing.assert_close(moe(x), weighted(torch.ones(len(x))), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_dropless_and_capacity_agree_when_nothing_is_dropped(arch):
    x, y = tokens()
    dropless = GPT(moe_config(arch), seed=2)
    roomy = GPT(moe_config(arch, moe_capacity_factor=4.0), seed=2)  # capacity ≥ every assignment
    a, b = dropless(x, y), roomy(x, y)
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for (name, p), q in zip(dropless.named_parameters(), roomy.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert roomy.take_router_counts()[:, -3].sum() == 0


@pytest.mark.parametrize("arch, extra", [("gpt2", {}), ("modern", {"moe_granularity": 2, "moe_shared_experts": 2}),
                                         ("gpt2", {"moe_experts": 8, "moe_top_k": 1, "tie_embeddings": False})])
def test_active_and_total_parameters_match_the_built_model(arch, extra):
    cfg = moe_config(arch, **extra)
    model = GPT(cfg, seed=0)
    counts = accounting.param_counts(cfg)
    assert counts == model.param_counts()
    assert counts.total == sum(p.numel() for p in model.parameters())
    # One token: the experts it skips get an all-zero gradient, and they are exactly the inactive weights.
    model(*tokens(n=1, length=1)).backward()
    skipped = sum(p.numel() for moe in model.moe_layers() for expert in moe.experts for p in expert.parameters()
                  if not p.grad.any())
    assert skipped == counts.inactive == cfg.n_layer * (cfg.moe_experts - cfg.moe_top_k) * accounting.mlp_params(
        cfg, accounting.expert_width(cfg))
    attention = 12 * cfg.n_layer * cfg.d_model * cfg.block_size
    assert accounting.flops_per_token(cfg) == 6 * (counts.matmul - counts.inactive) + attention
    dense = dataclasses.replace(cfg, moe_experts=0, moe_top_k=1, moe_granularity=1, moe_shared_experts=0)
    router = cfg.n_layer * cfg.d_model * cfg.moe_experts
    if cfg.moe_top_k * accounting.expert_width(cfg) == accounting.ffn_width(cfg) and not cfg.moe_shared_experts:
        assert counts.active == accounting.param_counts(dense).total + router  # same active width, plus the router


@pytest.mark.parametrize("extra, message", [
    (["--model.moe_top_k", "5"], "model.moe_top_k must be in [1, model.moe_experts = 4], got 5"),
    (["--model.moe_granularity", "3"], "model.moe_granularity (3) must be a positive divisor of the MLP width (128)"),
    (["--model.moe_capacity_factor", "0"], "model.moe_capacity_factor must be positive"),
    (["--model.moe_capacity_factor", "-1"], "model.moe_capacity_factor must be positive"),
])
def test_bad_moe_input_fails_before_training_with_one_line(tmp_path, args, capsys, extra, message):
    r = tmp_path / "bad"
    assert run_main([*args, "--model.moe_experts", "4", *extra, "--run-dir", str(r)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not r.exists() or not any(r.iterdir())


@pytest.mark.slow
def test_a_tiny_moe_run_trains_and_reports_its_router(tmp_path, args, capsys):
    r = tmp_path / "moe"
    assert run_main([*args, "--model.arch", "modern", "--model.moe_experts", "4", "--model.moe_top_k", "2",
                     "--model.moe_granularity", "2", "--model.moe_shared_experts", "1", "--run-dir", str(r)]) == 0
    out = capsys.readouterr().out
    assert "mixture of 4 experts (top 2, granularity 2, 1 shared)" in out and "moe load max/mean" in out
    records = [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()]
    steps = [rec for rec in records if "loss" in rec]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert all(rec["moe_load_max_over_mean"] >= 1 and rec["moe_dropped_tokens"] == 0
               and 0 < rec["moe_router_entropy"] <= math.log(4) for rec in steps)
    summary = json.loads((r / "summary.json").read_text())
    assert summary["params_active"] < summary["params"] and summary["final_eval_loss"] is not None
    capsys.readouterr()
    assert sample_main(["--run-dir", str(r), "--prompt", "Fellow citizens", "--tokens", "8", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("Fellow citizens")


def test_hugging_face_export_refuses_a_mixture_of_experts_in_one_line():
    with pytest.raises(ConfigError, match=r"^model.moe_experts \(4\): the Hugging Face export"):
        hf.check_exportable(moe_config())


@pytest.mark.slow
def test_two_rank_data_parallel_strategies_train_a_moe_as_single_does():
    """Dropless routing, no clipping: losses and weights bitwise equal; the sharded strategies' gradient norm
    sums its squares in another order (the last bits)."""
    cfg = dataclasses.replace(TINY, moe_experts=4, moe_top_k=2, moe_granularity=2, moe_shared_experts=1)
    results = run_pooled(equivalence, 2, ["ddp", "zero2", "fsdp"], Setup(steps=3, grad_clip=0, model=cfg))[0]
    assert results["ddp"].bitwise
    for name in ("zero2", "fsdp"):
        assert results[name].same_losses and results[name].same_params, name
        assert results[name].max_rel_grad_norm_diff < 1e-6, name


def test_plan_model_names_total_and_active_parameters_and_active_flops(capsys):
    assert plan_main(["model", "--preset", "tiny-modern", "--vocab", "512", "--moe-experts", "8", "--moe-top-k", "2",
                      "--moe-granularity", "2", "--moe-shared-experts", "1", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    cfg = dataclasses.replace(resolve({"model": {"preset": "tiny-modern", "vocab_size": 512}}).model, moe_experts=8,
                              moe_top_k=2, moe_granularity=2, moe_shared_experts=1)
    counts = accounting.param_counts(cfg)
    assert counts.active < counts.total
    for text in (f"params (total)  {counts.total:,}", f"params (active per token)  {counts.active:,}",
                 f"router included)  {accounting.flops_per_token(cfg):.4g}",
                 f"training FLOPs (active)  {accounting.flops_per_token(cfg) * 1e9:.4g}"):
        assert text.replace("  ", " ") in " ".join(out.split()), text
    assert plan_main(["model", "--preset", "tiny", "--vocab", "512", "--moe-experts", "4", "--moe-top-k", "5"]) == 2
    err = capsys.readouterr().err
    assert err == "error: model.moe_top_k must be in [1, model.moe_experts = 4], got 5\n"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_a_moe_without_counting_it_twice(mode):
    x, y = tokens()
    plain, recomputed = GPT(moe_config(), seed=4), GPT(moe_config(), seed=4)
    activations.apply(recomputed, recomputed.parallel_plan(), mode, activations.SavedBytes())
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute whole blocks, the counting too
        for model in (plain, recomputed):
            model(x, y).backward()
    assert torch.equal(plain.take_router_counts(), recomputed.take_router_counts())
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(p.grad, q.grad), name
