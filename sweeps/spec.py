"""Sweep files: a TOML description of an IsoFLOP grid, parsed and checked into a :class:`Sweep`.

Every problem raises :class:`SpecError` with one line meant for the user; see ``sweeps/tiny_isoflop.toml``
for a commented example and the README section "Sweeps" for each table.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.runtime.config import ConfigError, RunConfig, TrainConfig
from lab.commands.slurm import SETTING_PATTERNS


class SpecError(ValueError):
    """A sweep file that cannot be planned; the message is one line."""


# Fields the planner sets for every run; a sweep file may not fix them in [base].
PLANNED_FIELDS = {"model": ("n_layer", "d_model", "n_head"), "train": ("tokens", "lr", "batch_tokens"),
                  "parallel": ("strategy",)}
SHAPE_KEYS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")
NAME_RE = re.compile(r"[^/\x00-\x1f\x7f]+")  # one path component, printable on one line (fullmatch it)


@dataclass(frozen=True)
class PowerRule:
    """``value × (N / reference) ** exponent``: a per-model hyperparameter from its parameter count."""

    value: float
    exponent: float = 0.0
    reference: float = 1e5

    def at(self, params: float) -> float:
        return self.value * (params / self.reference) ** self.exponent


@dataclass(frozen=True)
class Family:
    """The depth/width rule that turns a target N into a shape (see ``sweeps.shapes``)."""

    aspect: float = 32.0
    width_multiple: int = 64
    head_dim: int = 64
    max_layers: int = 48
    ffn_ratio: float | None = None  # MLP width d_ff = round(ffn_ratio × d_model); None: the architecture's default


@dataclass(frozen=True)
class Launch:
    """How one run is started and what it may use."""

    strategy: str = "single"
    nproc: int = 1  # processes per node (torchrun --nproc_per_node)
    nodes: int = 1  # > 1: an sbatch script running torchrun with c10d rendezvous on every node
    cpus_per_proc: int = 1
    gpus_per_proc: int = 0
    mem_gb: float = 4.0  # per node
    time_min: int = 60

    @property
    def world_size(self) -> int:
        return self.nproc * self.nodes


@dataclass(frozen=True)
class LaunchRule:
    """``[[launch.by_size]]``: launch settings for runs whose N lies in [min_params, max_params)."""

    min_params: float
    max_params: float
    settings: dict[str, Any]


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

    prior: str
    tokens_per_param: float = 0.0
    path: Path | None = None
    approach: str = "preferred"


@dataclass(frozen=True)
class Search:
    """``[search]``: hyperparameter grids run before the sweep, whose fitted laws the sweep's runs then use.

    The learning-rate grid runs, for each size of ``sizes``, at ``budget``, or with ``tokens_per_param`` at each
    size's own budget (D = tokens_per_param x N); the best rate per size gives
    LR(N) = c N^e. With ``batch_tokens``, that grid runs at each of ``batch_budgets`` (default: ``budget``)
    for the budget's prior N_opt (the centre) or the middle search size, at LR(N); the best batch per
    budget gives batch(C) = c C^e (constant with one budget).
    """

    budget: float | None  # None: each size at tokens_per_param
    sizes: tuple[float, ...]
    lr: tuple[float, ...]
    batch_tokens: tuple[float, ...] = ()
    batch_budgets: tuple[float, ...] = ()
    tokens_per_param: float | None = None


@dataclass(frozen=True)
class Cooldowns:
    """``[sweep] cooldowns = { fraction = F }``: WSD end points as cooldowns branched from one stable phase.

    The runs of one size that differ only in their length (its IsoFLOP points at each budget) become branches
    of one parent run that trains the stable phase once (``sweeps.cooldowns``); each branch decays over the
    last ``fraction`` of its own steps, as a separate WSD run would (Hägele et al. 2024).
    """

    fraction: float
    at: tuple[float, ...] = ()  # more end points per size: fractions of its longest end point's tokens, increasing


@dataclass(frozen=True)
class Sweep:
    name: str
    folder: Path
    budgets: tuple[float, ...]
    sizes: tuple[float, ...]  # target N for the family (empty with an explicit list or a centre)
    count: str  # which count the sizes and launch rules refer to: total or non_embedding
    family: Family | None
    shapes: tuple[ShapeEntry, ...]
    lr: PowerRule
    batch_tokens: PowerRule
    launch: Launch
    launch_rules: tuple[LaunchRule, ...]
    base: dict[str, dict[str, Any]]  # [base] tables, as a run config file would hold them
    flops_per_s: float  # assumed model FLOP/s per process, for the plan's time estimate
    step_s: float  # fixed cost of one optimizer step (dominant for tiny models on a CPU)
    overhead_s: float  # start-up per run
    parallel: int  # local executor: runs at once
    threads: int  # local executor: threads per process (0: cores / (parallel × nproc))
    slurm: dict[str, Any] = field(default_factory=dict)  # partition, account, qos, array_parallelism, ...
    launch_overrides: dict[str, Any] = field(default_factory=dict)  # from the command line: over every run's launch
    source: str = ""  # the file's text, kept in the sweep folder
    centre: Centre | None = None  # sizes centred per budget on a prior N_opt(C), instead of fixed sizes
    decades_each_side: float = 0.5  # with a centre: sizes from N_opt / 10^x to N_opt × 10^x
    per_budget: int = 7  # with a centre: sizes per budget, log-spaced
    search: Search | None = None  # hyperparameter grids run first; their laws replace [rules]
    mup_base_width: int | None = None  # [rules] mup_base_width: every run under μP, at one tuned learning rate
    seeds: tuple[int, ...] = ()  # [sweep] seeds: each run once per seed (empty: once, at [base.train]'s seed)
    seeds_below: float | None = None  # [sweep] seeds_below: repeat only the budgets below this C (short, noisy runs)
    evals: int = 0  # [sweep] evals: held-out evaluations per run, evenly spaced in steps (0: at the end only)
    cooldowns: Cooldowns | None = None  # [sweep] cooldowns: end points branched from one stable phase per size
    routing: tuple[dict[str, int], ...] = ()  # [sweep] routing: each shape once per routing (model.moe_* fields)

    def mup_model_fields(self) -> dict[str, Any]:
        """The [model] options μP adds to every run's command line (none without ``mup_base_width``)."""
        if self.mup_base_width is None:
            return {}
        return {"parametrization": "mup", "mup_base_width": self.mup_base_width}


_TABLES = {
    "sweep": {"name", "folder", "budgets", "sizes", "count", "centre", "decades_each_side", "per_budget", "seeds",
              "seeds_below", "evals", "cooldowns", "routing"},
    "shapes": {"family", "aspect", "width_multiple", "head_dim", "max_layers", "ffn_ratio", "list"},
    "rules": {"lr", "batch_tokens", "mup_base_width"},
    "launch": {f.name for f in dataclasses.fields(Launch)} | {"by_size"},
    "base": {"model", "data", "train", "parallel", "log"},
    "estimate": {"flops_per_s", "step_s", "overhead_s"},
    "local": {"parallel", "threads"},
    "slurm": {"partition", "account", "qos", "constraint", "array_parallelism", "setup", "poll_s"},
    "search": {"budget", "tokens_per_param", "sizes", "lr", "batch_tokens", "batch_budgets"},
}
SEARCH_GRID_MIN = 3  # values a grid needs for its best value to be located between neighbours


def _table(doc: dict, name: str) -> dict[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise SpecError(f"[{name}] must be a table")
    unknown = sorted(set(value) - _TABLES[name])
    if unknown:
        raise SpecError(f"[{name}]: unknown key '{unknown[0]}' (known: {', '.join(sorted(_TABLES[name]))})")
    return value


def _number(value: Any, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{where} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise SpecError(f"{where} must be positive, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _numbers(value: Any, where: str) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise SpecError(f"{where} must be a list of numbers")
    numbers = tuple(_number(v, f"{where}[{i}]") for i, v in enumerate(value))
    if len(set(numbers)) != len(numbers):
        raise SpecError(f"{where} has duplicate values")
    return numbers


def check_name(name: Any, where: str) -> str:
    """A run or sweep name: any text that is one path component (no '/', no control characters, no leading '.')."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name.startswith(".") or len(name) > 120:
        raise SpecError(f"{where} must be 1-120 characters with no '/', no control characters and no leading '.', "
                        f"got {name!r}")
    return name


def _rule(value: Any, where: str, default: float) -> PowerRule:
    if value is None:
        return PowerRule(default)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return PowerRule(_number(value, where))
    if not isinstance(value, dict) or set(value) - {"value", "exponent", "reference"} or "value" not in value:
        raise SpecError(f"{where} must be a number or {{ value = V, exponent = E, reference = N }}")
    return PowerRule(_number(value["value"], f"{where}.value"),
                     _number(value.get("exponent", 0.0), f"{where}.exponent", positive=False),
                     _number(value.get("reference", 1e5), f"{where}.reference"))


def _launch_value(key: str, value: Any, where: str) -> None:
    """Check one launch setting; ``where`` names it in the message."""
    if key == "strategy":
        if not isinstance(value, str) or not value:
            raise SpecError(f"{where} must be a non-empty string")
    elif key == "mem_gb":
        _number(value, where)
    else:
        _integer(value, where, minimum=0 if key == "gpus_per_proc" else 1)


def check_launch(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate launch settings (a subset of :class:`Launch`'s fields) and return them."""
    known = [f.name for f in dataclasses.fields(Launch)]
    for key, value in settings.items():
        if key not in known:
            raise SpecError(f"{where}: unknown launch setting '{key}' (known: {', '.join(known)})")
        _launch_value(key, value, f"{where}.{key}")
    return dict(settings)


def _base(value: dict[str, Any]) -> dict[str, dict[str, Any]]:
    try:
        RunConfig.from_dict(value)  # unknown sections or options, wrong types
    except ConfigError as e:
        raise SpecError(f"[base]: {e}") from None
    for section, fields in PLANNED_FIELDS.items():
        for name in fields:
            if name in value.get(section, {}):
                raise SpecError(f"[base.{section}] sets '{name}', which the planner sets for every run")
    if "preset" in value.get("model", {}):
        raise SpecError("[base.model] sets 'preset'; give the fields it would set instead")
    for name in ("parametrization", "mup_base_width"):
        if name in value.get("model", {}):
            raise SpecError(f"[base.model] sets '{name}'; ask for μP with [rules] mup_base_width = W (the width the "
                            f"learning rate was tuned at)")
    return value


def _shape_list(items: Any) -> tuple[ShapeEntry, ...]:
    if not isinstance(items, list) or not items:
        raise SpecError("[[shapes.list]] must hold at least one shape")
    entries = []
    for i, item in enumerate(items):
        where = f"shapes.list[{i}]"
        if not isinstance(item, dict):
            raise SpecError(f"{where} must be a table")
        item = dict(item)
        name = check_name(item.pop("name", None), f"{where}.name")
        launch = check_launch(item.pop("launch", {}), f"{where}.launch")
        for key in ("n_layer", "d_model", "n_head"):
            if key not in item:
                raise SpecError(f"{where} ({name}) needs '{key}'")
        unknown = sorted(set(item) - set(SHAPE_KEYS))
        if unknown:
            known = ", ".join(["name", "launch", *SHAPE_KEYS])
            raise SpecError(f"{where} ({name}): unknown key '{unknown[0]}' (known: {known})")
        entries.append(ShapeEntry(name=name, model=item, launch=launch))
    return tuple(entries)


def _shape_source(sweep: dict[str, Any], shapes: dict[str, Any]) -> tuple[Family | None, tuple[float, ...],
                                                                           tuple[ShapeEntry, ...]]:
    """(family, sizes, explicit shapes) from [sweep] and [shapes]."""
    family_name = shapes.get("family", "aspect")
    if family_name == "list":
        for key in ("sizes", "centre"):
            if key in sweep:
                raise SpecError(f"[sweep] {key} is for the 'aspect' family; an explicit list sets its own shapes")
        return None, (), _shape_list(shapes.get("list"))
    if family_name != "aspect":
        raise SpecError(f"[shapes] family must be 'aspect' or 'list', got {family_name!r}")
    if "list" in shapes:
        raise SpecError("[shapes] has a list but family is 'aspect'; set family = \"list\"")
    if "sizes" in sweep and "centre" in sweep:
        raise SpecError("[sweep] gives both 'sizes' and 'centre'; use one")
    if "sizes" not in sweep and "centre" not in sweep:
        raise SpecError("[sweep] needs 'sizes' (target N) or 'centre' (a prior N_opt) with the 'aspect' shape family")
    family = Family(aspect=_number(shapes.get("aspect", Family.aspect), "[shapes] aspect"),
                    width_multiple=_integer(shapes.get("width_multiple", Family.width_multiple),
                                            "[shapes] width_multiple"),
                    head_dim=_integer(shapes.get("head_dim", Family.head_dim), "[shapes] head_dim"),
                    max_layers=_integer(shapes.get("max_layers", Family.max_layers), "[shapes] max_layers"),
                    ffn_ratio=_number(shapes["ffn_ratio"], "[shapes] ffn_ratio") if "ffn_ratio" in shapes else None)
    if family.width_multiple % family.head_dim:
        raise SpecError(f"[shapes] head_dim ({family.head_dim}) must divide width_multiple "
                        f"({family.width_multiple}) so that heads divide every width")
    return family, _numbers(sweep["sizes"], "[sweep] sizes") if "sizes" in sweep else (), ()


CENTRE_KEYS = {"tokens_per_param": {"prior", "tokens_per_param"}, "fit": {"prior", "path", "approach"}}
FIT_APPROACHES = ("preferred", "envelope", "isoflop", "approach3")  # fit.json keys


def _centre(sweep: dict[str, Any]) -> tuple[Centre, float, int]:
    """``[sweep] centre``, ``decades_each_side`` and ``per_budget``, checked."""
    value = sweep["centre"]
    usage = ('[sweep] centre must be { prior = "tokens_per_param", tokens_per_param = R } '
             'or { prior = "fit", path = "fit.json" }')
    if not isinstance(value, dict) or value.get("prior") not in CENTRE_KEYS:
        raise SpecError(usage)
    prior = value["prior"]
    unknown = sorted(set(value) - CENTRE_KEYS[prior])
    if unknown:
        raise SpecError(f"[sweep] centre: unknown key '{unknown[0]}' for prior '{prior}' "
                        f"(known: {', '.join(sorted(CENTRE_KEYS[prior]))})")
    if prior == "tokens_per_param":
        if "tokens_per_param" not in value:
            raise SpecError(usage)
        centre = Centre(prior, tokens_per_param=_number(value["tokens_per_param"], "[sweep] centre.tokens_per_param"))
    else:
        if not isinstance(value.get("path"), str) or not value["path"]:
            raise SpecError(usage)
        approach = value.get("approach", "preferred")
        if approach not in FIT_APPROACHES:
            raise SpecError(f"[sweep] centre.approach must be one of {', '.join(FIT_APPROACHES)}, got {approach!r}")
        centre = Centre(prior, path=Path(value["path"]), approach=approach)
    decades = _number(sweep.get("decades_each_side", Sweep.decades_each_side), "[sweep] decades_each_side")
    per_budget = _integer(sweep.get("per_budget", Sweep.per_budget), "[sweep] per_budget", minimum=5)
    return centre, decades, per_budget


def _search(search: dict[str, Any], family: Family | None) -> Search | None:
    """``[search]``, checked; None when the file has none."""
    if not search:
        return None
    if family is None:
        raise SpecError("[search] needs the 'aspect' shape family: it plans its sizes like [sweep] sizes")
    for key in ("sizes", "lr"):
        if key not in search:
            raise SpecError(f"[search] needs '{key}'")
    if ("budget" in search) == ("tokens_per_param" in search):
        raise SpecError("[search] needs one of 'budget' (every size at one budget) and 'tokens_per_param' "
                        "(each size at its own)")
    lrs = _numbers(search["lr"], "[search] lr")
    batches = _numbers(search.get("batch_tokens", []), "[search] batch_tokens")
    for key, grid in (("lr", lrs), ("batch_tokens", batches)):
        if grid and len(grid) < SEARCH_GRID_MIN:
            raise SpecError(f"[search] {key} needs at least {SEARCH_GRID_MIN} values, got {len(grid)}")
    if "batch_budgets" in search and not batches:
        raise SpecError("[search] batch_budgets needs batch_tokens (the batch grid)")
    sizes = _numbers(search["sizes"], "[search] sizes")
    if len(sizes) < 2:
        raise SpecError("[search] sizes needs at least 2 sizes to fit LR(N)")
    budget = _number(search["budget"], "[search] budget") if "budget" in search else None
    tokens_per_param = (_number(search["tokens_per_param"], "[search] tokens_per_param")
                        if "tokens_per_param" in search else None)
    if batches and budget is None and "batch_budgets" not in search:
        raise SpecError("[search] batch_tokens with tokens_per_param needs batch_budgets")
    batch_budgets = _numbers(search.get("batch_budgets", [budget] if batches else []), "[search] batch_budgets")
    return Search(budget=budget, sizes=tuple(sorted(sizes)), lr=tuple(sorted(lrs)), batch_tokens=tuple(sorted(batches)),
                  batch_budgets=tuple(sorted(batch_budgets)), tokens_per_param=tokens_per_param)


def _launch_rules(by_size: Any) -> tuple[LaunchRule, ...]:
    if not isinstance(by_size, list):
        raise SpecError("[[launch.by_size]] must be a list of tables")
    rules = []
    for i, rule in enumerate(by_size):
        where = f"launch.by_size[{i}]"
        if not isinstance(rule, dict):
            raise SpecError(f"{where} must be a table")
        rule = dict(rule)
        lo = _number(rule.pop("min_params", 0.0), f"{where}.min_params", positive=False)
        hi = _number(rule.pop("max_params"), f"{where}.max_params") if "max_params" in rule else math.inf
        rules.append(LaunchRule(lo, hi, check_launch(rule, where)))
    return tuple(rules)


def _slurm(slurm: dict[str, Any], name: Callable[[str], str] = "[slurm] {}".format) -> dict[str, Any]:
    """Check ``[slurm]`` settings; ``name(key)`` names one in a message."""
    for key, allowed in SETTING_PATTERNS.items():
        if key in slurm and (not isinstance(slurm[key], str) or not slurm[key]):
            raise SpecError(f"{name(key)} must be a non-empty string")
        if key in slurm and not allowed.fullmatch(slurm[key]):
            raise SpecError(f"{name(key)} {slurm[key]!r} holds characters SLURM would not read as written")
    if "array_parallelism" in slurm:
        _integer(slurm["array_parallelism"], name("array_parallelism"))
    if "poll_s" in slurm:
        _number(slurm["poll_s"], name("poll_s"))
    if "setup" in slurm and not (isinstance(slurm["setup"], list) and all(isinstance(x, str) for x in slurm["setup"])):
        raise SpecError("[slurm] setup must be a list of shell lines")
    return slurm


def _mup_base_width(rules: dict[str, Any], lr: PowerRule, doc: dict[str, Any]) -> int | None:
    """``[rules] mup_base_width``, checked: μP transfers one learning rate to every width, so it takes a
    single tuned rate (no exponent) and no [search] for LR(N)."""
    if "mup_base_width" not in rules:
        return None
    width = _integer(rules["mup_base_width"], "[rules] mup_base_width")
    if lr.exponent != 0:
        raise SpecError("[rules] lr: with mup_base_width, give the one rate tuned at the base width (no exponent): "
                        "μP transfers it to every width")
    if "search" in doc:
        raise SpecError("[search] fits LR(N) per size; with [rules] mup_base_width give the rate tuned at the base "
                        "width as [rules] lr instead")
    return width


def parse(text: str, source: str = "sweep file", folder: str | Path | None = None) -> Sweep:
    """Parse and check a sweep file's text; ``folder`` overrides ``[sweep] folder``."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{source}: invalid TOML ({e})") from None
    unknown = sorted(set(doc) - set(_TABLES))
    if unknown:
        raise SpecError(f"{source}: unknown table [{unknown[0]}] (known: {', '.join(_TABLES)})")
    sweep, shapes, rules = _table(doc, "sweep"), _table(doc, "shapes"), _table(doc, "rules")
    launch, estimate, local = dict(_table(doc, "launch")), _table(doc, "estimate"), _table(doc, "local")
    base = _base(_table(doc, "base"))

    name = check_name(sweep.get("name"), "[sweep] name")
    if folder is None and not isinstance(sweep.get("folder", ""), str):
        raise SpecError("[sweep] folder must be a path (a string)")
    if "budgets" not in sweep:
        raise SpecError("[sweep] needs 'budgets' (training FLOPs per run)")
    budgets = _numbers(sweep["budgets"], "[sweep] budgets")
    count = sweep.get("count", "total")
    if count not in ("total", "non_embedding"):
        raise SpecError(f"[sweep] count must be total or non_embedding, got {count!r}")

    family, sizes, entries = _shape_source(sweep, shapes)
    if "centre" not in sweep:
        for key in ("decades_each_side", "per_budget"):
            if key in sweep:
                raise SpecError(f"[sweep] {key} needs 'centre' (sizes centred on a prior N_opt)")
    centre, decades, per_budget = _centre(sweep) if "centre" in sweep else (None, Sweep.decades_each_side,
                                                                           Sweep.per_budget)
    launch_rules = _launch_rules(launch.pop("by_size", []))
    slurm = _slurm(_table(doc, "slurm"))

    defaults = TrainConfig()
    lr = _rule(rules.get("lr"), "[rules] lr", defaults.lr)
    mup_base_width = _mup_base_width(rules, lr, doc)
    return Sweep(
        name=name,
        folder=Path(folder if folder is not None else sweep.get("folder", Path("runs/sweeps") / name)).absolute(),
        budgets=budgets, sizes=sizes, count=count, family=family, shapes=entries,
        lr=lr,
        batch_tokens=_rule(rules.get("batch_tokens"), "[rules] batch_tokens", defaults.batch_tokens),
        launch=Launch(**check_launch(launch, "[launch]")), launch_rules=launch_rules, base=base,
        flops_per_s=_number(estimate.get("flops_per_s", 3e10), "[estimate] flops_per_s"),
        step_s=_number(estimate.get("step_s", 0.0), "[estimate] step_s", positive=False),
        overhead_s=_number(estimate.get("overhead_s", 5.0), "[estimate] overhead_s", positive=False),
        parallel=_integer(local.get("parallel", 1), "[local] parallel"),
        threads=_integer(local.get("threads", 0), "[local] threads", minimum=0),
        slurm=slurm, source=text, centre=centre, decades_each_side=decades, per_budget=per_budget,
        search=_search(_table(doc, "search"), family), mup_base_width=mup_base_width, **_seeds(sweep),
        evals=_integer(sweep.get("evals", 0), "[sweep] evals", minimum=0),
        cooldowns=_cooldowns(sweep["cooldowns"], base) if "cooldowns" in sweep else None,
        routing=_routing(sweep["routing"], sweep, base) if "routing" in sweep else (),
    )


ROUTING_KEYS = {"experts": "moe_experts", "top_k": "moe_top_k", "granularity": "moe_granularity",
                "shared_experts": "moe_shared_experts"}


def routing_name(fields: dict[str, int]) -> str:
    """A routing's part of a run name: 'dense', or 'E8k2G2' (with '-S1' for shared experts)."""
    if not fields.get("moe_experts"):
        return "dense"
    shared = fields.get("moe_shared_experts", 0)
    return (f"E{fields['moe_experts']}k{fields.get('moe_top_k', 1)}G{fields.get('moe_granularity', 1)}"
            + (f"S{shared}" if shared else ""))


def _routing(value: Any, sweep: dict[str, Any], base: dict[str, dict[str, Any]]) -> tuple[dict[str, int], ...]:
    """``[sweep] routing``: a list of { experts = E, top_k = k, granularity = G, shared_experts = S } (experts = 0:
    the dense model), each a distinct routing every shape is trained with; their model.moe_* fields."""
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        raise SpecError("[sweep] routing must be a non-empty list of tables such as { experts = 8, top_k = 2 }")
    if "cooldowns" in sweep:
        raise SpecError("[sweep] routing and cooldowns cannot be combined yet: a cooldown's parent is one per size")
    fixed = sorted(k for k in base.get("model", {}) if k.startswith("moe_"))
    if fixed:
        raise SpecError(f"[base.model] {fixed[0]} and [sweep] routing both set the routing: keep one")
    out = []
    for i, entry in enumerate(value):
        unknown = sorted(set(entry) - set(ROUTING_KEYS))
        if unknown or "experts" not in entry:
            raise SpecError(f"[sweep] routing[{i}]: " + (f"unknown key '{unknown[0]}' (known: "
                            f"{', '.join(ROUTING_KEYS)})" if unknown else "needs 'experts' (0: the dense model)"))
        fields = {ROUTING_KEYS[k]: _integer(v, f"[sweep] routing[{i}].{k}", minimum=0) for k, v in entry.items()}
        if not fields["moe_experts"] and len(fields) > 1:
            raise SpecError(f"[sweep] routing[{i}]: experts = 0 is the dense model; it takes no other key")
        out.append({} if not fields["moe_experts"] else fields)
    names = [routing_name(f) for f in out]
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated:
        raise SpecError(f"[sweep] routing lists {repeated} twice")
    return tuple(out)


def _cooldowns(value: Any, base: dict[str, dict[str, Any]]) -> Cooldowns:
    """``[sweep] cooldowns``, checked against ``[base.train]``: the schedule must be WSD, whose decay is the
    cooldown (a fraction in (0, 1) that leaves room for the warmup; [base.train] decay, if set, must agree)."""
    if not isinstance(value, dict) or "fraction" not in value or set(value) - {"fraction", "at"}:
        raise SpecError("[sweep] cooldowns must be { fraction = F } or { fraction = F, at = [a, b, ...] }: each end "
                        "point decays over the last F of its steps")
    fraction = _number(value["fraction"], "[sweep] cooldowns.fraction")
    at = _numbers(value.get("at", []), "[sweep] cooldowns.at")
    if list(at) != sorted(at) or at and at[-1] > 1:
        raise SpecError(f"[sweep] cooldowns.at must be increasing fractions in (0, 1] of each size's longest end "
                        f"point, got {list(at)}")
    train = RunConfig.from_dict({"train": base.get("train", {})}).train
    if train.schedule != "wsd":
        raise SpecError(f"[sweep] cooldowns needs [base.train] schedule = \"wsd\" (a cooldown branches from a "
                        f"stable phase), got {train.schedule!r}")
    if not fraction < 1 or fraction + train.warmup > 1:
        raise SpecError(f"[sweep] cooldowns.fraction must be below 1 and leave room for the warmup "
                        f"({train.warmup:g}), got {fraction:g}")
    if "decay" in base.get("train", {}) and train.decay != fraction:
        raise SpecError(f"[base.train] decay ({train.decay:g}) and [sweep] cooldowns.fraction ({fraction:g}) differ; "
                        f"the cooldown is the WSD decay: set one of them")
    return Cooldowns(fraction, at)


def _seeds(sweep: dict[str, Any]) -> dict[str, Any]:
    """``[sweep] seeds`` (distinct integers >= 0) and ``seeds_below`` (FLOPs), checked."""
    if "seeds" not in sweep:
        if "seeds_below" in sweep:
            raise SpecError("[sweep] seeds_below needs 'seeds' (the seeds to repeat runs with)")
        return {}
    seeds = sweep["seeds"]
    if not isinstance(seeds, list) or not seeds:
        raise SpecError("[sweep] seeds must be a non-empty list of integers")
    seeds = tuple(_integer(v, f"[sweep] seeds[{i}]", minimum=0) for i, v in enumerate(seeds))
    if len(set(seeds)) != len(seeds):
        raise SpecError("[sweep] seeds has duplicate values")
    below = sweep.get("seeds_below")
    return {"seeds": seeds, "seeds_below": None if below is None else _number(below, "[sweep] seeds_below")}


def option_name(key: str) -> str:
    """The command-line option that overrides a ``[launch]`` or ``[slurm]`` key: mem_gb → --mem-gb."""
    return "--" + key.replace("_", "-")


def with_overrides(sweep: Sweep, launch: dict[str, Any], slurm: dict[str, Any]) -> Sweep:
    """``sweep`` with command-line values checked like the file's: ``launch`` applies to every run, over
    ``[launch]``, ``[[launch.by_size]]`` and the shapes' own settings; ``slurm`` over ``[slurm]``."""
    for key, value in launch.items():
        _launch_value(key, value, option_name(key))
    _slurm(slurm, option_name)
    return dataclasses.replace(sweep, launch_overrides={**sweep.launch_overrides, **launch},
                               slurm={**sweep.slurm, **slurm})


def load(path: str | Path, folder: str | Path | None = None) -> Sweep:
    """Read and parse a sweep file."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"sweep file not found: {p}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p} is not UTF-8 text (byte {e.start}); a TOML sweep file is expected") from None
    except OSError as e:
        raise SpecError(f"{p} is unreadable ({e.strerror or e})") from None
    return parse(text, source=str(p), folder=folder)
