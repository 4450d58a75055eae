"""A sweep as the planner reads it: :class:`Sweep` and the sections of its file, typed dataclasses whose fields
declare their bounds (``lab.runtime.config.checked``), which ``sweeps.spec`` resolves a sweep file into.

``Sweep``'s own checked fields are the keys of ``[sweep]``, ``[rules]``, ``[estimate]`` and ``[local]``
(``spec.TABLE_KEYS``); ``Family`` is ``[shapes]``, ``Launch`` ``[launch]``, ``Search`` ``[search]``, ``Slurm``
``[slurm]``, ``CriticalBatch`` ``[critical_batch]`` (with ``HeldOut`` inside it); ``Centre``, ``Cooldowns`` and
``Routing`` are tables inside ``[sweep]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.runtime.config import TrainConfig, checked

CENTRE_PRIORS = ("tokens_per_param", "fit")
# Bounds that keep planning finite and small: a budget far past any training run (the largest published are a few
# 1e26 FLOPs), more sizes than a profile needs, or a size no shape search should walk to, is refused in one line.
MAX_BUDGET_FLOPS = 1e30
MAX_SIZE_PARAMS = 1e16
BUDGET = {"positive": True, "maximum": MAX_BUDGET_FLOPS, "unit": "FLOPs"}  # a budget's checks (``checked``)
SIZE = {"positive": True, "maximum": MAX_SIZE_PARAMS, "unit": "parameters"}  # a target N's
FIT_APPROACHES = ("preferred", "envelope", "isoflop", "approach3")  # fit.json keys


@dataclass(frozen=True)
class PowerRule:
    """``value × (N / reference) ** exponent``: a per-model hyperparameter from its parameter count."""

    value: float = checked(positive=True)
    exponent: float = 0.0
    reference: float = checked(1e5, positive=True)

    def at(self, params: float) -> float:
        return self.value * (params / self.reference) ** self.exponent


@dataclass(frozen=True)
class Family:
    """``[shapes]``: the depth/width rule that turns a target N into a shape (see ``sweeps.shapes``)."""

    aspect: float = checked(32.0, positive=True)
    width_multiple: int = checked(64, minimum=1)
    head_dim: int = checked(64, minimum=1)
    max_layers: int = checked(48, minimum=1)
    ffn_ratio: float | None = checked(None, positive=True)  # d_ff = round(ffn_ratio × d_model); None: the arch's


@dataclass(frozen=True)
class Launch:
    """``[launch]``: how one run is started and what it may use."""

    strategy: str = checked("single", nonempty=True)
    nproc: int = checked(1, minimum=1)  # processes per node (torchrun --nproc_per_node)
    nodes: int = checked(1, minimum=1)  # > 1: an sbatch script running torchrun with c10d rendezvous on every node
    cpus_per_proc: int = checked(1, minimum=1)
    gpus_per_proc: int = checked(0, minimum=0)
    mem_gb: float = checked(4.0, positive=True)  # per node
    time_min: int = checked(60, minimum=1)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nodes


@dataclass(frozen=True)
class LaunchRule:
    """``[[launch.by_size]]``: launch settings for runs whose N lies in [min_params, max_params)."""

    min_params: float = 0.0
    max_params: float = checked(float("inf"), positive=True)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ShapeEntry:
    """An explicit shape from ``[[shapes.list]]``: model fields plus optional launch settings."""

    name: str
    model: dict[str, Any]
    launch: dict[str, Any]


@dataclass(frozen=True)
class Centre:
    """``[sweep] centre``: a prior N_opt(C) each budget's sizes are centred on (symmetric in log N).

    ``prior = "tokens_per_param"``: D = r N with r = ``tokens_per_param``; ``prior = "fit"``: the
    N_opt = k_N C^a law of a fit.json written by ``python -m analysis fit`` (``approach``: the one its
    comparison prefers, or a named identified one). The file (a path from the working directory, like
    ``folder``) is read when the sweep is planned, so ``status`` and ``export`` work without it.
    """

    prior: str = checked(choices=CENTRE_PRIORS)
    tokens_per_param: float = checked(0.0, positive=True)
    path: str | None = checked(None, nonempty=True)
    approach: str = checked("preferred", choices=FIT_APPROACHES)


@dataclass(frozen=True)
class Search:
    """``[search]``: hyperparameter grids run before the sweep, whose fitted laws the sweep's runs then use.

    The learning-rate grid runs, for each size of ``sizes``, at ``budget``, or with ``tokens_per_param`` at each
    size's own budget (D = tokens_per_param x N); the best rate per size gives
    LR(N) = c N^e. With ``batch_tokens``, that grid runs at each of ``batch_budgets`` (default: ``budget``)
    for the budget's prior N_opt (the centre) or the middle search size, at LR(N); the best batch per
    budget gives batch(C) = c C^e (constant with one budget).
    """

    sizes: tuple[float, ...] = checked(**SIZE, distinct=True)
    lr: tuple[float, ...] = checked(positive=True, distinct=True)
    budget: float | None = checked(None, **BUDGET)  # None: each size at tokens_per_param
    tokens_per_param: float | None = checked(None, positive=True)
    batch_tokens: tuple[float, ...] = checked((), positive=True, distinct=True)
    batch_budgets: tuple[float, ...] = checked((), **BUDGET, distinct=True)


@dataclass(frozen=True)
class HeldOut:
    """``[critical_batch.held_out]``: sizes whose batch grid is trained to test the law the grid's sizes fit."""

    sizes: tuple[float, ...] = checked(**SIZE, distinct=True)
    targets: tuple[float, ...] = checked(positive=True, distinct=True)  # held-out losses B_crit is predicted at
    tokens: float | None = checked(None, positive=True)  # run length (default: the grid's)
    steps: int | None = checked(None, minimum=1)
    lr_factors: tuple[float, ...] = checked((), positive=True, distinct=True)  # default: the grid's


@dataclass(frozen=True)
class CriticalBatch:
    """``[critical_batch]``: every size of ``sizes`` at every batch of ``batch_tokens``, each at the learning rates
    ``lr_factors`` x lr(B) x lr_size(N), with ``lr`` a power rule of the batch and ``lr_size`` one of the size
    (``sweeps.critical_batch``).

    Each run trains ``tokens + steps x B`` tokens on a constant schedule after ``warmup_steps``: the frontier's own
    shape E(B) = E_min + S_min B, so that ``tokens`` and ``steps`` above E_min and S_min of the lowest target let
    every batch reach every target, whatever the critical batch. ``targets`` are the held-out losses the analysis
    reads steps and tokens at (``python -m analysis critical-batch``).
    """

    sizes: tuple[float, ...] = checked(**SIZE, distinct=True)
    batch_tokens: tuple[float, ...] = checked(positive=True, distinct=True)
    lr: PowerRule  # of B: value x (B / reference) ** exponent
    lr_size: PowerRule  # a factor of N on lr(B): value x (N / reference) ** exponent
    tokens: float = checked(positive=True)
    steps: int = checked(minimum=1)
    targets: tuple[float, ...] = checked(positive=True, distinct=True)
    lr_factors: tuple[float, ...] = checked((1.0,), positive=True, distinct=True)
    warmup_steps: int = checked(50, minimum=0)
    held_out: HeldOut | None = None


@dataclass(frozen=True)
class Cooldowns:
    """``[sweep] cooldowns = { fraction = F }``: WSD end points as cooldowns branched from one stable phase.

    The runs of one size that differ only in their length (its IsoFLOP points at each budget) become branches
    of one parent run that trains the stable phase once (``sweeps.cooldowns``); each branch decays over the
    last ``fraction`` of its own steps, as a separate WSD run would (Hägele et al. 2024). ``at``: more end points
    per size, as increasing fractions of its longest end point's tokens.
    """

    fraction: float = checked(positive=True)
    at: tuple[float, ...] = checked((), positive=True, distinct=True)


@dataclass(frozen=True)
class Routing:
    """One of ``[sweep] routing``: a mixture of experts' routing (experts = 0: the dense model)."""

    experts: int = checked(minimum=0)
    top_k: int = checked(1, minimum=0)
    granularity: int = checked(1, minimum=0)
    shared_experts: int = checked(0, minimum=0)


@dataclass(frozen=True)
class Slurm:
    """``[slurm]``: the SLURM executor's settings (those not given are left to the cluster)."""

    partition: str | None = checked(None, nonempty=True)
    account: str | None = checked(None, nonempty=True)
    qos: str | None = checked(None, nonempty=True)
    constraint: str | None = checked(None, nonempty=True)
    array_parallelism: int | None = checked(None, minimum=1)
    setup: tuple[str, ...] | None = None  # shell lines run before each run
    poll_s: float | None = checked(None, positive=True)


def routing_name(fields: dict[str, int]) -> str:
    """A routing's part of a run name: 'dense', or 'E8k2G2' (with '-S1' for shared experts)."""
    if not fields.get("moe_experts"):
        return "dense"
    shared = fields.get("moe_shared_experts", 0)
    return (f"E{fields['moe_experts']}k{fields.get('moe_top_k', 1)}G{fields.get('moe_granularity', 1)}"
            + (f"S{shared}" if shared else ""))


@dataclass(frozen=True)
class Sweep:
    name: str = checked(nonempty=True)
    budgets: tuple[float, ...] = checked((), **BUDGET, distinct=True)  # training FLOPs per run
    family: Family | None = None  # None with an explicit list of shapes
    shapes: tuple[ShapeEntry, ...] = ()
    lr: PowerRule = PowerRule(TrainConfig().lr)
    batch_tokens: PowerRule = PowerRule(TrainConfig().batch_tokens)
    launch: Launch = Launch()
    launch_rules: tuple[LaunchRule, ...] = ()
    base: dict[str, dict[str, Any]] = field(default_factory=dict)  # [base] tables, as a run config file holds them
    folder: Path = Path()
    sizes: tuple[float, ...] = checked((), **SIZE, distinct=True)  # target N for the family (or a centre)
    count: str = checked("total", choices=("total", "non_embedding"))  # what sizes and launch rules count as N
    flops_per_s: float = checked(3e10, positive=True)  # assumed model FLOP/s per process, for the time estimate
    step_s: float = 0.0  # fixed cost of one optimizer step (dominant for tiny models on a CPU)
    overhead_s: float = 5.0  # start-up per run
    parallel: int = checked(1, minimum=1)  # local executor: runs at once
    threads: int = checked(0, minimum=0)  # local executor: threads per process (0: cores / (parallel × nproc))
    slurm: dict[str, Any] = field(default_factory=dict)  # partition, account, qos, array_parallelism, ...
    launch_overrides: dict[str, Any] = field(default_factory=dict)  # from the command line: over every run's launch
    source: str = ""  # the file's text, kept in the sweep folder
    centre: Centre | None = None  # sizes centred per budget on a prior N_opt(C), instead of fixed sizes
    decades_each_side: float = checked(0.5, positive=True, maximum=4.0)  # with a centre: N_opt / 10^x to × 10^x
    per_budget: int = checked(7, minimum=5, maximum=100)  # with a centre: sizes per budget, log-spaced
    search: Search | None = None  # hyperparameter grids run first; their laws replace [rules]
    mup_base_width: int | None = checked(None, minimum=1)  # every run under μP, at one tuned learning rate
    seeds: tuple[int, ...] = checked((), minimum=0, distinct=True, nonempty=True)  # each run once per seed
    seeds_below: float | None = checked(None, positive=True)  # repeat only the budgets below this C
    evals: int = checked(0, minimum=0)  # held-out evaluations per run, evenly spaced in steps (0: at the end only)
    cooldowns: Cooldowns | None = None  # end points branched from one stable phase per size
    routing: tuple[dict[str, int], ...] = ()  # each shape once per routing (its model.moe_* fields)
    critical_batch: CriticalBatch | None = None  # a batch sweep: sizes x batches x learning rates to target losses

    def mup_model_fields(self) -> dict[str, Any]:
        """The [model] options μP adds to every run's command line (none without ``mup_base_width``)."""
        if self.mup_base_width is None:
            return {}
        return {"parametrization": "mup", "mup_base_width": self.mup_base_width}
