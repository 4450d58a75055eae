"""The data-parallel strategies wrap any ``nn.Module``, not only the lab's GPT: one with no parallel plan of its
own (``lab.model.plan.default_plan``), a weight tied between two of its children, a frozen layer and a buffer,
trains under each of them on 2 gloo ranks as it trains in one process. And a new strategy is one class: the
worked example of docs/parallelism.md, run as written."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.runtime.config import TrainConfig
from lab.measure.device import Precision
from lab.commands.equivalence import TINY, Setup, batch, compare, loop_settings, reference, train_tiny
from lab.model import GPT
from lab.model.plan import default_plan, plan_of, segments
from lab.training.optim import adamw_factory, param_groups
from lab.parallel import World, parse_spec, register
from lab.training.plan import create
from pool import run_pooled

STRATEGIES = ["ddp_naive", "ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp", "zero3:activation_checkpointing=full"]


class TiedMLP(nn.Module):
    """Token ids -> embedding -> residual MLP -> a frozen mixing layer scaled by a buffer -> a head tied to the
    embedding (registered in both children) -> cross-entropy."""

    def __init__(self, vocab: int = TINY.vocab_size, width: int = 16):
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.mix = nn.Linear(width, width).requires_grad_(False)
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.hidden(h)
        return F.cross_entropy(self.head(self.mix(h) * self.scale).flatten(0, 1), y.flatten())


def test_the_default_plan_cuts_along_children_and_keeps_shared_weights_at_the_root():
    model = TiedMLP()
    plan = default_plan(model, plan_of(model, TiedMLP).initial_value)
    assert plan.units == ["hidden", "mix"] and plan.head is None and plan.tensor is None  # embed, head: tied
    assert segments(model, plan) == [["hidden.0"], ["hidden.2"], ["mix"]]
    with torch.device("meta"):
        on_meta = TiedMLP()
    values = plan_of(on_meta, TiedMLP).initial_value  # read from a copy built on the host
    assert torch.equal(values("hidden.0.weight"), model.hidden[0].weight) and torch.equal(values("scale"),
                                                                                          model.scale)


def _train_each(world: World) -> dict:
    setup = Setup(steps=3, grad_clip=0)
    ref = reference(world, setup, TiedMLP)
    traces = {spec: train_tiny(world, setup, parse_spec(spec), TiedMLP) for spec in STRATEGIES}
    if not world.is_main:  # the final weights are on rank 0
        return {}
    return {spec: compare(ref, trace) for spec, trace in traces.items()} | {"first_loss": ref.losses[0],
                                                                          "last_loss": ref.losses[-1]}


@pytest.mark.slow
def test_every_data_parallel_strategy_trains_a_module_that_is_not_a_gpt_as_one_process_does():
    results = run_pooled(_train_each, 2)[0]
    assert results.pop("last_loss") < results.pop("first_loss")  # it trains
    for spec, r in results.items():
        # 2 ranks, one micro-batch each, no clipping: sums of two and exact halving (lab.commands.equivalence)
        assert r.same_losses and r.same_params, (spec, r)


def docs_strategy() -> str:
    """The worked example of a new strategy in docs/parallelism.md, as written there."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "parallelism.md").read_text()
    start = text.index("```python\n# a module of your own") + len("```python\n")
    return text[start:text.index("```", start)]


def _train_docs_strategy(world: World, code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "docs/parallelism.md", "exec"), namespace)
    register(namespace["FlatDDP"])
    setup = Setup(steps=3, accum=2)
    ref, trace = reference(world, setup), train_tiny(world, setup, parse_spec("ddp_flat"))
    out = {"flat": compare(ref, trace) if world.is_main else None}
    strategy = create(parse_spec("ddp_flat"), world, Precision("cpu"), loop_settings(setup))
    strategy.build(lambda: GPT(TINY), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    x, y = batch(setup, 0, 2 * world.world_size)
    strategy.backward(strategy.forward(x[:2], y[:2], sync=False))  # an accumulation's first micro-step
    out["sent_before_sync"] = strategy.take_step_meters().comm_bytes["all_reduce"]
    strategy.backward(strategy.forward(x[2:4], y[2:4], sync=True))
    out["sent_at_sync"] = strategy.take_step_meters().comm_bytes["all_reduce"]
    return out


@pytest.mark.slow
def test_the_docs_new_strategy_is_one_file_and_a_registry_line_and_trains_as_single():
    r = run_pooled(_train_docs_strategy, 2, docs_strategy())[0]
    # with accumulation the sums are regrouped (last bits, carried by AdamW): test_distributed's tolerances
    assert r["flat"].max_rel_loss_diff <= 1e-6 and r["flat"].max_rel_grad_norm_diff <= 1e-5, r
    assert r["flat"].max_param_diff <= 1e-3, r
    assert r["sent_before_sync"] == 0 and r["sent_at_sync"] > 0, r
