"""The strategy interface, the registry and the [parallel] section, on one process.

Multi-rank behaviour (DDP family, equivalence, meters, mismatched ranks) is in test_distributed.py.
"""

import ast
import re
from pathlib import Path

import pytest
import torch

from lab.runtime.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
from lab.measure.device import Precision
from lab.model import GPT
from lab.training.optim import adamw_factory, param_groups
from lab.parallel import STRATEGIES, LoopSettings, World, strategy_class
from lab.training.plan import check_layout, create

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
FP32 = Precision("cpu")
LOOP = LoopSettings(micro_batch=1, accum_steps=1, grad_clip=1.0)
SHAPE = ModelConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=50)


def built(strategy="single", **options):
    s = create(ParallelConfig(strategy=strategy, **options), WORLD, FP32, LOOP)
    s.build(lambda: GPT(SHAPE, seed=0), lambda m: param_groups(m, 0.1), adamw_factory(RunConfig().train, WORLD.device))
    return s


def test_registry_knows_the_strategies_and_rejects_unknown_names():
    assert set(STRATEGIES) == {"single", "ddp_naive", "ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp",
                               "deepspeed"}
    assert strategy_class("single") is STRATEGIES["single"]
    with pytest.raises(ConfigError, match="unknown strategy 'zero7' \\(known: .*single"):
        strategy_class("zero7")
    with pytest.raises(ConfigError, match="at most 1 process"):
        check_layout(ParallelConfig(strategy="single"), 2, LOOP)


@pytest.mark.parametrize("options, message", [
    ({"strategy": "single", "bucket_mb": 5.0}, "parallel.bucket_mb has no effect under strategy 'single' "
                                               "(it applies to: ddp, torch_ddp, zero1, zero2)"),
    ({"strategy": "torch_ddp", "overlap": False}, "parallel.overlap has no effect under strategy 'torch_ddp'"),
    ({"strategy": "ddp", "bucket_mb": 0.0}, "parallel.bucket_mb must be positive"),
    ({"strategy": "ddp", "timeout_s": -1.0}, "parallel.timeout_s must be positive"),
])
def test_parallel_options_are_validated_up_front(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        check_layout(ParallelConfig(**options), 2, LOOP)


def test_weight_decay_is_decided_by_name_and_role_before_any_flattening():
    model = GPT(ModelConfig(arch="modern", n_layer=2, n_head=2, n_kv_head=1, d_model=16, block_size=8,
                            vocab_size=50, bias=True))
    model.blocks[0].attn.qkv.weight.requires_grad_(False)  # frozen: in no group
    decay, no_decay = param_groups(model, 0.1)
    assert decay.weight_decay == 0.1 and no_decay.weight_decay == 0.0
    assert "wte.weight" in decay.names and "blocks.1.mlp.up.weight" in decay.names
    assert "blocks.0.norm1.weight" in no_decay.names and "blocks.1.mlp.up.bias" in no_decay.names
    assert "blocks.0.attn.qkv.weight" not in decay.names + no_decay.names
    params = dict(model.named_parameters())
    assert all(params[n].dim() >= 2 for n in decay.names) and all(params[n].dim() == 1 for n in no_decay.names)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(params[n].numel() for n in decay.names + no_decay.names) == trainable  # the tied table once


@pytest.mark.parametrize("max_norm", [0.0, 1e-3])
def test_clip_grad_norm_returns_the_norm_before_clipping(max_norm):
    s = built()
    x = torch.randint(0, 50, (2, 8))
    s.backward(s.forward(x, x, sync=True))
    before = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in s.module.parameters()]))
    reported = s.clip_grad_norm(max_norm)
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in s.module.parameters()]))
    assert reported.item() == pytest.approx(before.item(), rel=1e-6)
    assert after.item() == pytest.approx(before.item() if max_norm == 0 else max_norm, rel=1e-4)


def test_step_sets_the_learning_rate_updates_and_clears_gradients():
    s = built()
    assert s.strategy.optimizer.defaults["fused"] is True  # fused AdamW where the device supports it
    before = [p.detach().clone() for p in s.module.parameters()]
    x = torch.randint(0, 50, (2, 8))
    s.backward(s.forward(x, x, sync=True))
    s.step(lr=0.0123)
    assert {g["lr"] for g in s.strategy.optimizer.param_groups} == {0.0123}
    assert all(p.grad is None for p in s.module.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, s.module.parameters()))


def test_skip_step_leaves_the_weights_and_clears_gradients():
    s = built()
    before = [p.detach().clone() for p in s.module.parameters()]
    x = torch.randint(0, 50, (2, 8))
    s.backward(s.forward(x, x, sync=True))
    s.skip_step()
    assert all(p.grad is None for p in s.module.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, s.module.parameters()))


def test_single_meters_measure_sixteen_bytes_per_parameter_and_no_traffic():
    s = built()
    x = torch.randint(0, 50, (2, 8))
    s.backward(s.forward(x, x, sync=True))
    s.step(lr=1e-3)
    s.take_step_meters()
    m = s.accounts.meters()
    psi = sum(p.numel() for p in s.module.parameters())
    assert m["model_state_bytes_theory"] == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi,
                                             "total": 16 * psi}
    measured = m["model_state_bytes"]
    assert (measured["params"], measured["grads"]) == (4 * psi, 4 * psi)
    # AdamW keeps one 4-byte step counter per tensor beside its two moments
    assert measured["optimizer"] == 8 * psi + 4 * len(list(s.module.parameters()))
    assert set(m["comm_bytes_per_step"].values()) == {0.0} == set(m["comm_bytes_per_step_theory"].values())


STEP = {"step": 3, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e3, "mfu": 0.01, "comm_time_s": 0.0,
        "mem_peak_bytes": 2**20}


def test_a_transform_added_to_the_one_list_is_applied_and_shows_its_fragment_in_the_step_line(monkeypatch):
    """A new transform is one entry in ``axes.kinds``: the strategy applies it where its ``on`` says, its record reaches
    the step's record, and the step line shows its fragment, with no other list to edit."""
    from lab.parallel import axes
    from lab.training.runlog import format_step

    class Probe(axes.Transform):
        name = "probe"

        @classmethod
        def on(cls, mesh, cfg, loop, saved):
            return cls()

        def record(self):
            return {"probe_count": 7}

        @staticmethod
        def line(rec):
            return f" | probe {rec['probe_count']}" if "probe_count" in rec else ""

    kinds = axes.kinds
    monkeypatch.setattr(axes, "kinds", lambda: (*kinds(), Probe), raising=False)
    strategy = built()
    assert [type(t) for t in strategy.transforms] == [Probe]
    line = format_step(STEP | strategy.take_record(), 8, 0.0)
    assert line.endswith(" | probe 7") and line.startswith("step     3/8 | loss 4.0000")


def test_the_step_lines_fragments_keep_their_order():
    """The loss scale, the pipeline's bubble, the router and the experts' exchanges, in that order (as before the
    line was gathered from the transforms' list), each part's own fragment."""
    from lab.model.gpt import RouterFigures
    from lab.parallel import step_line
    from lab.parallel.axes.experts import ExpertParallel
    from lab.parallel.axes.pipeline import Pipeline
    from lab.parallel.precision import LossScaler

    rec = STEP | {"loss_scale": 1024.0, "pp_bubble": [0.25, 0.5], "pp_bubble_theory": 0.2, "pp_sent_bytes": 4096,
                  "pp_sent_bytes_theory": 4096, "moe_load_max_over_mean": 1.5, "moe_tokens_per_expert": [3, 5],
                  "moe_dropped_tokens": 0, "moe_router_entropy": 0.6, "ep_a2a_bytes": 2048,
                  "ep_a2a_bytes_theory": 1024}
    fragments = [part.line(rec) for part in (LossScaler, Pipeline, RouterFigures, ExpertParallel)]
    assert all(fragments) and step_line(rec) == "".join(fragments)
    assert step_line(STEP) == ""


def test_the_loop_names_no_strategy_and_asks_no_strategy_its_type():
    source = Path(__file__).resolve().parents[1] / "lab" / "training" / "train.py"
    tree = ast.parse(source.read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not strings & set(STRATEGIES), strings & set(STRATEGIES)
    assert not names & {cls.__name__ for cls in STRATEGIES.values()}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") in
             ("isinstance", "type", "issubclass")]
    assert not [ast.unparse(c) for c in calls if "strateg" in ast.unparse(c).lower()]
    assert "param_groups" not in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # lr via step(lr)
    assert not re.search(r"(?<!strategy)\.backward\(", source.read_text())  # backward through the strategy only


def test_gradients_are_packed_into_buckets_in_arrival_order_and_a_large_one_alone():
    from lab.parallel.comm import buckets

    assert buckets([4, 4, 4, 9, 1, 1], cap=8) == [[0, 1], [2], [3], [4, 5]]
    assert buckets([], cap=8) == []
