"""Every axis composes: the layout record, the matrix of layouts against single, and checkpoints that move between
any two of them.

The matrix (``lab.commands.matrix``) trains the tiny GPT under every data-parallel strategy × tp × pp × ep on up to 8
gloo ranks, dense and a mixture of experts, gpt2 and modern, and holds each layout to single's losses, gradient norms
and weights (1e-6, 1e-5, 1e-3) and every rank's meters to their theory (bytes over the data axis, the tensor group
and the pipeline's links equal; model states within 5 %). CI runs a sample of it; the long tier runs it all.
"""

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from lab.commands import matrix
from lab.commands.equivalence import TINY, Setup, batch
from lab.measure.device import Precision
from lab.model import GPT
from lab.parallel import Layout, LoopSettings, World, axes, parse_spec, step_line, strategy_class
from lab.training.plan import check_layout, create
from lab.runtime import checkpoint
from lab.runtime.config import ConfigError, ParallelConfig, TrainConfig
from lab.training.optim import adamw_factory, param_groups
from lab.training.train import train_step
from pool import run_pooled

MOE = dataclasses.replace(TINY, moe_experts=4, moe_top_k=2)
LOOP = LoopSettings(micro_batch=4, accum_steps=1, grad_clip=1.0)


# ---------------------------------------------------------------- the record


def test_one_record_places_every_rank_on_every_axis():
    """pp 2 × dp 2 × tp 2 with ep 2 carved out of dp: tensor groups are consecutive ranks, then data, then stages."""
    layout = Layout.of(ParallelConfig(tp=2, pp=2, ep=2), 8)
    assert (layout.pp, layout.dp, layout.tp, layout.ep) == (2, 2, 2, 2)
    place = [(c["pp"], c["dp"], c["tp"], c["ep"], c["edp"]) for c in map(layout.coordinates, (0, 1, 2, 5))]
    assert place == [(0, 0, 0, 0, 0), (0, 0, 1, 0, 0), (0, 1, 0, 1, 0), (1, 0, 1, 0, 0)]
    assert [layout.data_replica(r) for r in (0, 3, 6)] == [(0, 2), (1, 2), (1, 2)]
    assert Layout.of(ParallelConfig(strategy="zero2", tp=2), 4, strategy_class("zero2")).shards == "gradients"


@pytest.mark.parametrize("options, world_size, message", [
    ({"tp": 3}, 4, r"parallel.tp \(3\) must divide the world size \(4\)"),
    ({"ep": 4, "tp": 2}, 4, r"parallel.ep \(4\) must divide the data-parallel ranks \(2"),
    ({"strategy": "deepspeed", "tp": 2}, 4, "strategy 'deepspeed' does not run with parallel.tp > 1: its engine owns"),
])
def test_a_layout_that_cannot_run_is_refused_in_one_line(options, world_size, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(ParallelConfig(**options), world_size, LOOP)


def test_the_share_of_a_rank_is_the_parameters_it_holds():
    """``Layout.share`` (``accounting.rank_params``) is what the fullest stage's rank holds after the split, the cut
    and the experts' split, for every (tp, pp, ep) of a mixture of experts (built on meta, no ranks)."""
    from lab.parallel.axes.experts import ExpertParallel
    from lab.parallel.axes.pipeline import Pipeline
    from lab.parallel.axes.tensor import TensorParallel
    from lab.parallel.layout import Mesh

    cpu = torch.device("cpu")
    for tp, pp, ep in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)):
        layout = Layout.of(ParallelConfig(tp=tp, pp=pp, ep=ep), tp * pp * ep)
        counts = []
        for stage in range(pp):
            with torch.device("meta"):
                model = GPT(MOE)
            plan = model.parallel_plan()
            if tp > 1:
                plan = TensorParallel(World(0, tp, 0, cpu), False).split(model, plan)
            if ep > 1:
                axes = {"ep": World(0, ep, 0, cpu), "expert_data": World(0, 1, 0, cpu)}
                plan = ExpertParallel(Mesh(World(0, ep, 0, cpu), axes), ParallelConfig(ep=ep), LOOP).split(model, plan)
            if pp > 1:
                plan = Pipeline(World(stage, pp, stage, cpu), ParallelConfig(pp=pp), 1).split(model, plan)
            counts.append(sum(p.numel() for p in model.parameters()))
        assert layout.share(MOE, "ddp").params == max(counts), (tp, pp, ep)


# ---------------------------------------------------------------- the matrix


def _matrix(world: World, cells: list, folder: Path) -> list:
    return matrix._run(world, cells, matrix.SETUP, folder)


def _check(rows: list) -> None:
    for row in rows:
        assert row.passed and row.resumed is not None, matrix.format_row(row)


@pytest.mark.slow
def test_a_sample_of_the_matrix_reproduces_single_on_two_and_four_ranks(tmp_path):
    """The combinations this issue added, on 2 and 4 ranks: zero3, fsdp and torch_ddp under pp; ep with tp and pp and
    under zero3, fsdp and torch_ddp; a mixture of experts in stages; each within its tolerance, meters at theory (the
    experts' exchanges under stages too), and each saves at its end and resumes from it to the same next step."""
    two = [matrix.Cell(s, 1, 1, 2, 1, "moe", "gpt2") for s in ("zero3", "fsdp")] + \
          [matrix.Cell(s, 2, 1, 1, 2, "moe", "modern") for s in ("zero3", "fsdp", "torch_ddp")]
    four = [matrix.Cell("torch_ddp", 2, 1, 2, 1, "dense", "gpt2"), matrix.Cell("zero3", 2, 1, 2, 2, "moe", "gpt2"),
            matrix.Cell("fsdp", 2, 2, 1, 2, "moe", "modern"), matrix.Cell("zero2", 2, 2, 1, 2, "moe", "gpt2")]
    _check(run_pooled(_matrix, 2, two, tmp_path)[0])
    _check(run_pooled(_matrix, 4, four, tmp_path)[0])


def _muon_matrix(world: World, cells: list, folder: Path) -> list:
    return matrix._run(world, cells, dataclasses.replace(matrix.SETUP, **matrix.MUON), folder)


@pytest.mark.slow
def test_a_sample_of_the_matrix_reproduces_single_under_muon(tmp_path):
    """Under Muon, layouts of every kind of placement of its matrices on 2 and 4 ranks: replicated (ddp), flat chunks
    (zero2, zero3), row blocks (fsdp), a tensor split beside them, stages, experts apart and a context split; each
    within AdamW's tolerance of single, meters at theory (Muon's theory of one moment among them), saved and
    resumed."""
    two = [matrix.Cell("ddp", 1, 2, 1, 1, "dense", "modern"), matrix.Cell("zero3", 2, 1, 1, 2, "moe", "gpt2"),
           matrix.Cell("fsdp", 1, 1, 1, 1, "dense", "gpt2", 2)]
    four = [matrix.Cell("zero2", 2, 2, 1, 1, "dense", "gpt2"), matrix.Cell("fsdp", 1, 2, 2, 1, "dense", "modern"),
            matrix.Cell("zero3", 2, 2, 1, 2, "moe", "modern")]
    _check(run_pooled(_muon_matrix, 2, two, tmp_path)[0])
    _check(run_pooled(_muon_matrix, 4, four, tmp_path)[0])


MATRIX = [cell for cell in matrix.layouts(8, list(matrix.STRATEGIES), ["dense", "moe"], ["gpt2", "modern"])
          if matrix.refusal(cell) is None]
MUON_BASE = dataclasses.replace(matrix.SETUP, **matrix.MUON)
MUON_MATRIX = [cell for cell in MATRIX if matrix.refusal(cell, MUON_BASE) is None]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("ranks, strategy", sorted({(cell.ranks, cell.strategy) for cell in MATRIX}))
def test_every_layout_of_the_matrix_reproduces_single(ranks, strategy, tmp_path):
    _check(run_pooled(_matrix, ranks, [c for c in MATRIX if (c.ranks, c.strategy) == (ranks, strategy)], tmp_path)[0])


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("ranks, strategy", sorted({(cell.ranks, cell.strategy) for cell in MUON_MATRIX}))
def test_every_layout_of_the_matrix_reproduces_single_under_muon(ranks, strategy, tmp_path):
    _check(run_pooled(_muon_matrix, ranks, [c for c in MUON_MATRIX if (c.ranks, c.strategy) == (ranks, strategy)],
                      tmp_path)[0])


def test_the_matrix_refuses_only_what_owns_the_step():
    """Every refusal left in the matrix is DeepSpeed's engine with another axis, said before any rank starts."""
    refused = [cell for cell in matrix.layouts(8, list(matrix.STRATEGIES), ["dense", "moe"], ["gpt2"])
               if matrix.refusal(cell) is not None]
    assert refused and all(cell.strategy == "deepspeed" and (cell.tp, cell.pp, cell.ep, cell.cp) != (1, 1, 1, 1)
                           for cell in refused)


# ---------------------------------------------------------------- checkpoints between layouts


def _built(world: World, spec: str):
    strategy = create(parse_spec(spec), world, Precision("cpu"), LOOP)
    strategy.build(lambda: GPT(MOE), lambda m: param_groups(m, 0.1), adamw_factory(TrainConfig(), world.device))
    return strategy


def _train_and_save(world: World, spec: str, folder: Path) -> None:
    strategy = _built(world, spec)
    replica, replicas = Layout.of(parse_spec(spec), world.world_size).data_replica(world.rank)
    x, y = batch(Setup(model=MOE), 0, 4 * replicas)
    train_step(strategy, world, [(x[4 * replica:4 * replica + 4], y[4 * replica:4 * replica + 4])], 1, 1e-2, 1.0)
    checkpoint.save(folder, 1, world.rank, world.world_size, strategy.checkpoint_state(), {}, 1)


def _load_and_save(world: World, spec: str, source: Path, target: Path) -> None:
    strategy = _built(world, spec)
    checkpoint.load(checkpoint.latest(source), world.rank, world.world_size, strategy.checkpoint_state())
    strategy.after_load()
    checkpoint.save(target, 1, world.rank, world.world_size, strategy.checkpoint_state(), {}, 1)


def _same(a: Path, b: Path) -> bool:
    first, second = (checkpoint.load_everything(checkpoint.latest(folder)) for folder in (a, b))
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.slow
def test_a_checkpoint_moves_between_layouts_every_weight_and_moment_intact(tmp_path):
    """A mixture of experts trained a step under zero3 · pp2 · tp2, loaded under zero2 · ep2 · dp4 and saved again,
    then loaded by one process and saved again: every weight, AdamW moment and step counter the same bits each
    time. Before, zero2 at ep2 could not save at all (the ranks holding other experts named no part of them)."""
    zero3, zero2, single = tmp_path / "zero3-pp2-tp2", tmp_path / "zero2-ep2", tmp_path / "single"
    run_pooled(_train_and_save, 4, "zero3:pp=2,tp=2,pp_microbatches=2", zero3)
    run_pooled(_load_and_save, 4, "zero2:ep=2", zero3, zero2)
    _load_and_save(World(0, 1, 0, torch.device("cpu")), "single", zero2, single)
    assert _same(zero3, zero2) and _same(zero2, single)
    stored = checkpoint.load_everything(checkpoint.latest(single))
    assert {f"optim/{n}/exp_avg" for n, _ in GPT(MOE).named_parameters()} <= stored.keys()


# ---------------------------------------------------------------- the experts' exchanges beside other axes


def _exchanged(world: World, spec: str) -> dict:
    """One step under ``spec``: the bytes this rank's exchanges sent, and the bytes its router's counts imply (rows
    to the experts on other ranks and back, forward and backward, plus each microbatch's count exchange)."""
    parallel = parse_spec(spec)
    strategy = _built(world, spec)
    replica, replicas = Layout.of(parallel, world.world_size).data_replica(world.rank)
    x, y = batch(Setup(model=MOE), 0, 4 * replicas)
    strategy.module.take_router_counts()
    train_step(strategy, world, [(x[4 * replica:4 * replica + 4], y[4 * replica:4 * replica + 4])], 1, 1e-2, 1.0)
    sent = strategy.take_step_meters().layout["ep_a2a_bytes"]
    experts = next(t for t in strategy.transforms if t.name == "ep")
    mine = strategy.module.take_router_counts()[:, :MOE.moe_experts]  # [layer, expert]: this rank's assignments
    group = experts.axis.sum(mine)
    held = list(experts.local)
    elsewhere = [e for e in range(MOE.moe_experts) if e not in held]
    rows = mine[:, elsewhere].sum() + (group - mine)[:, held].sum()
    layers = sum(1 for block in strategy.module.blocks if block is not None)
    counts = strategy.microbatches * layers * len(held) * (experts.n - 1) * 8
    return {"sent": sent, "implied": 2 * rows.item() * MOE.d_model * 4 + counts}


@pytest.mark.slow
def test_the_exchanges_send_what_the_routing_implies_beside_tp_and_pp():
    """ep 2 with tp 2 (each tensor rank exchanges with its expert group at its own tensor coordinate) and with pp 2
    (each stage's layers, every microbatch): the all-to-all bytes measured equal those the router's counts imply."""
    for spec in ("ddp:ep=2,tp=2", "zero2:ep=2,pp=2,pp_microbatches=2"):
        for got in run_pooled(_exchanged, 4, spec):
            assert got["sent"] == got["implied"] and got["sent"] > 0, (spec, got)


# ---------------------------------------------------------------- the code's shape


def test_no_data_parallel_strategy_names_an_axis():
    """The strategies (``lab/parallel/data/``) and the base they loop in name no axis: each axis lives in its own file
    of ``lab/parallel/axes/`` and answers the ``Transform`` protocol; an axis that is off is absent from the list,
    not a stand-in."""
    import re

    root = Path(__file__).resolve().parents[1] / "lab" / "parallel"
    axis = re.compile(r"\b(pipeline|pipelined|experts?|tensor[- ]parallel\w*|tp|pp|ep|cp|context[- ]parallel\w*)\b",
                      re.IGNORECASE)
    for path in [*sorted((root / "data").glob("*.py")), *(root / f"{name}.py" for name in (
            "base", "engine", "holding", "meters", "precision"))]:
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        found = [m.group(0) for m in axis.finditer(code)]
        assert not found, (path.name, found[:5])
    assert not re.search(r"class (Unsplit|Unpiped)\b", "".join(p.read_text() for p in root.rglob("*.py")))


# ---------------------------------------------------------------- a new axis is one list entry


class ToyAxis(axes.Transform):
    """An axis defined here, as a newcomer would write one: it counts the forwards of the model's units (hooks placed at
    ``split``) and sums the count over the data axis each step (its own collective, paused in evaluation), names
    itself in the start line and shows its fragment in the step line."""

    name = "toy"
    line_place = 90

    @classmethod
    def on(cls, mesh, cfg, loop, saved):
        return cls(mesh)

    def __init__(self, mesh):
        self.data, self.forwards, self.counting = mesh.data, 0, True

    def describe(self, layout):
        return f"{layout} (toy axis)"

    def split(self, model, plan):
        for name in plan.units:
            model.get_submodule(name).register_forward_pre_hook(lambda *_: self._count())
        return plan

    def _count(self):
        self.forwards += self.counting

    def take_meters(self):
        total = self.data.sum(torch.tensor(float(self.forwards)))
        self.forwards = 0
        return axes.AxisMeters(record={"toy_unit_forwards": total.item()})

    @contextlib.contextmanager
    def paused(self):
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    @staticmethod
    def line(rec):
        return f" | toy {rec['toy_unit_forwards']:.0f}" if "toy_unit_forwards" in rec else ""


def _with_toy_axis(world: World, setup: Setup) -> dict:
    from lab.commands.equivalence import reference, train_tiny

    kinds = axes.kinds
    axes.kinds = lambda: (*kinds(), ToyAxis)  # the one list entry
    try:
        engine = create(parse_spec("ddp"), world, Precision("cpu"), LOOP)
        described = engine.describe()
        trace = train_tiny(world, setup, parse_spec("ddp"))
        line = step_line(trace.meters["step"])
    finally:
        axes.kinds = kinds
    ref = reference(world, setup)
    return {"described": described, "record": trace.meters["step"], "line": line,
            "same": world.is_main and ref.losses == trace.losses and ref.params.keys() == trace.params.keys()
            and all(torch.equal(ref.params[k], trace.params[k]) for k in ref.params)}


@pytest.mark.slow
def test_a_toy_axis_added_with_one_list_entry_trains_as_single_does():
    """A transform written in this test and added to ``axes.kinds`` alone is applied by every layout's engine: ddp on
    2 ranks with it trains to single's losses and weights bit for bit (one micro-step each, unclipped), its
    collective reports every unit forward of both ranks, and it names itself where the run is described."""
    setup = Setup(steps=3, accum=1, grad_clip=0.0)
    out = run_pooled(_with_toy_axis, 2, setup)[0]
    assert out["same"], out
    assert out["described"] == "ddp (toy axis)"
    units = len(GPT(TINY).parallel_plan().units)
    assert out["record"] == {"toy_unit_forwards": 2 * units}  # the last step: one forward of every unit on each rank
    assert out["line"] == f" | toy {2 * units}"


def test_the_strategy_only_places_syncs_and_steps():
    """The base strategy stays small (at most 200 lines and 20 methods), no strategy overrides more than 8 of its
    methods, and DeepSpeed's engine is its own class, not a strategy overriding most of the base."""
    import inspect

    from lab.parallel import STRATEGIES, Strategy
    from lab.parallel.data.deepspeed import DeepSpeed

    source = inspect.getsource(inspect.getmodule(Strategy))
    own = [name for name, value in vars(Strategy).items() if inspect.isfunction(value) or isinstance(value, property)]
    assert len(source.splitlines()) <= 200 and len(own) <= 20, (len(source.splitlines()), own)
    for cls in STRATEGIES.values():
        if cls is DeepSpeed:
            assert not issubclass(cls, Strategy)
            continue
        overridden = {name for klass in cls.__mro__[:cls.__mro__.index(Strategy)] for name in vars(klass)
                      if name in own}
        assert len(overridden) <= 8, (cls.name, sorted(overridden))
