"""The strategy interface and registry, on the reference single-process strategy."""

import pytest
import torch

from lab.config import ConfigError, ModelConfig, RunConfig
from lab.model import GPT
from lab.parallel import STRATEGIES, World, create, strategy_class
from lab.train import adamw_factory, param_groups

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def tiny_model():
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=50))


def test_registry_knows_single_and_rejects_unknown_names():
    assert strategy_class("single") is STRATEGIES["single"]
    with pytest.raises(ConfigError, match="unknown strategy 'zero7' \\(known: .*single"):
        strategy_class("zero7")
    with pytest.raises(ConfigError, match="at most 1 process"):
        create("single", World(rank=0, world_size=2, local_rank=0, device=torch.device("cpu")))


def test_weight_decay_applies_to_matrices_only():
    model = tiny_model()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for p in decay["params"]) + sum(p.numel() for p in no_decay["params"])
    assert n == model.param_counts().total  # every parameter once, the tied one included


@pytest.mark.parametrize("max_norm", [0.0, 1e-3])
def test_clip_grad_norm_returns_the_norm_before_clipping(max_norm):
    strategy = create("single", WORLD)
    model = strategy.wrap(tiny_model())
    strategy.make_optimizer(adamw_factory(RunConfig(), WORLD.device), param_groups(model, 0.1))
    x = torch.randint(0, 50, (2, 8))
    model(x, x).backward()
    before = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    reported = strategy.clip_grad_norm(max_norm)
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert reported.item() == pytest.approx(before.item(), rel=1e-6)
    assert after.item() == pytest.approx(before.item() if max_norm == 0 else max_norm, rel=1e-4)


def test_step_updates_parameters_and_clears_gradients():
    strategy = create("single", WORLD)
    model = strategy.wrap(tiny_model())
    opt = strategy.make_optimizer(adamw_factory(RunConfig(), WORLD.device), param_groups(model, 0.1))
    assert opt.defaults["fused"] is True  # fused AdamW where the device supports it
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, 50, (2, 8))
    model(x, x).backward()
    strategy.step()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))

