"""Sweep files: a TOML description of an IsoFLOP grid, read into a :class:`~sweeps.sweep.Sweep`.

Each table resolves into the dataclasses of ``sweeps.sweep`` by the run configuration's machinery
(``lab.runtime.config``: the fields' types and bounds, unknown keys with a suggestion, one-line errors); this module
adds what ties keys and tables together. Every problem raises :class:`SpecError` with one line meant for the user;
see ``sweeps/tiny_isoflop.toml`` for a commented example and the README section "Sweeps" for each table.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.runtime.config import (SLURM_SETTINGS, ConfigError, RunConfig, check_value, coerce_field, parse_toml,
                                read_toml_text, resolve_keys, resolve_table)
from lab.runtime.files import check_path, unprintable
from sweeps.sweep import (BUDGET, CENTRE_PRIORS, Centre, Cooldowns, CriticalBatch, Family, HeldOut, Launch,
                          LaunchRule, PowerRule, Routing, Search, ShapeEntry, Slurm, Sweep, routing_name)


SpecError = ConfigError  # a sweep file that cannot be planned, as a run config that cannot run: one line for the user


# Fields the planner sets for every run; a sweep file may not fix them in [base].
PLANNED_FIELDS = {"model": ("n_layer", "d_model", "n_head"), "train": ("tokens", "lr", "batch_tokens"),
                  "parallel": ("strategy",)}
SHAPE_KEYS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")
NAME_RE = re.compile(r"[^/]+")  # one path component (fullmatch it), printable on one line (``unprintable``)
SEARCH_GRID_MIN = 3  # values a grid needs for its best value to be located between neighbours
BATCH_SPAN_MIN = 16.0  # [critical_batch]: the batches' span, largest / smallest, that brackets a critical batch
# The keys of each table that are Sweep's own fields; the others resolve into their own dataclasses.
TABLE_KEYS = {"sweep": ("name", "folder", "budgets", "sizes", "count", "centre", "decades_each_side", "per_budget",
                        "seeds", "seeds_below", "evals", "cooldowns", "routing"),
              "rules": ("lr", "batch_tokens", "mup_base_width"), "estimate": ("flops_per_s", "step_s", "overhead_s"),
              "local": ("parallel", "threads"), "shapes": (), "launch": (), "base": (), "slurm": (), "search": (),
              "critical_batch": ()}
CENTRE_KEYS = {"tokens_per_param": {"prior", "tokens_per_param"}, "fit": {"prior", "path", "approach"}}
ROUTING_KEYS = {"experts": "moe_experts", "top_k": "moe_top_k", "granularity": "moe_granularity",
                "shared_experts": "moe_shared_experts"}


def _nested(cls: type, table: Any, where: str) -> Any:
    """A table inside another (``where``: its name; a key of it is named ``where.key``) as the dataclass ``cls``."""
    return resolve_table(cls, table, where, lambda key: f"{where}.{key}")


def check_budget(budget: Any, where: str) -> float:
    """A budget given outside the file (``--budget``): positive FLOPs, at most ``MAX_BUDGET_FLOPS``."""
    return check_value(budget, float, where, **BUDGET)


def check_name(name: Any, where: str) -> str:
    """A run or sweep name: any text that is one path component (no '/', no control characters, no leading '.')."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name.startswith(".") or len(name) > 120 or \
            unprintable(name) is not None:
        raise SpecError(f"{where} must be 1-120 characters with no '/', no control characters and no leading '.', "
                        f"got {name!r}")
    return name


def _rule(value: Any, where: str, default: PowerRule) -> PowerRule:
    """``[rules] lr`` or ``batch_tokens``: a number, or a PowerRule's table."""
    if value is None:
        return default
    return _nested(PowerRule, value, where) if isinstance(value, dict) else PowerRule(
        coerce_field(PowerRule, "value", value, where))


def check_launch(settings: Any, where: str, name_of: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The launch settings given (any of :class:`Launch`'s fields), checked; ``name_of(key)`` names one."""
    launch = resolve_table(Launch, settings, where, name_of or (lambda key: f"{where}.{key}"))
    return {key: getattr(launch, key) for key in settings}


def _slurm(settings: Any, where: str, name_of: Callable[[str], str]) -> dict[str, Any]:
    """The ``[slurm]`` settings given, checked: a resource setting must read in an #SBATCH line as written."""
    slurm = resolve_table(Slurm, settings, where, name_of)
    for key, allowed in SLURM_SETTINGS.items():
        if key in settings and not allowed.fullmatch(getattr(slurm, key)):
            raise SpecError(f"{name_of(key)} {settings[key]!r} holds characters SLURM would not read as written")
    return {key: list(slurm.setup) if key == "setup" else getattr(slurm, key) for key in settings}  # submitit: a list


def _base(value: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``[base]``: a run config's tables, without what the planner sets for every run."""
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
    if not isinstance(items, list) or not items or not all(isinstance(item, dict) for item in items):
        raise SpecError("[[shapes.list]] must hold at least one shape, each a table")
    entries = []
    for i, item in enumerate(items):
        where, model = f"shapes.list[{i}]", {k: v for k, v in item.items() if k not in ("name", "launch")}
        name = check_name(item.get("name"), f"{where}.name")
        missing = [key for key in SHAPE_KEYS[:3] if key not in model]
        unknown = sorted(set(model) - set(SHAPE_KEYS))
        if missing or unknown:
            raise SpecError(f"{where} ({name}) " + (f"needs '{missing[0]}'" if missing else
                            f"has an unknown key '{unknown[0]}' (known: name, launch, {', '.join(SHAPE_KEYS)})"))
        entries.append(ShapeEntry(name, model, check_launch(item.get("launch", {}), f"{where}.launch")))
    return tuple(entries)


def _shapes(sweep: dict[str, Any], shapes: dict[str, Any], batch_only: bool = False
            ) -> tuple[Family | None, tuple[ShapeEntry, ...]]:
    """(family, explicit shapes) from [sweep] and [shapes]; ``batch_only``: a batch sweep without budgets, whose
    sizes are its own."""
    shapes = dict(shapes)
    kind, entries = shapes.pop("family", "aspect"), shapes.pop("list", None)
    family = resolve_table(Family, shapes, "[shapes]", "[shapes] {}".format)
    if kind == "list":
        for key in ("sizes", "centre"):
            if key in sweep:
                raise SpecError(f"[sweep] {key} is for the 'aspect' family; an explicit list sets its own shapes")
        return None, _shape_list(entries)
    if kind != "aspect":
        raise SpecError(f"[shapes] family must be 'aspect' or 'list', got {kind!r}")
    if entries is not None:
        raise SpecError("[shapes] has a list but family is 'aspect'; set family = \"list\"")
    if ("sizes" in sweep) == ("centre" in sweep) and not (batch_only and "sizes" not in sweep):
        raise SpecError("[sweep] gives both 'sizes' and 'centre'; use one" if "sizes" in sweep else
                        "[sweep] needs 'sizes' (target N) or 'centre' (a prior N_opt) with the 'aspect' shape family")
    if family.width_multiple % family.head_dim:
        raise SpecError(f"[shapes] head_dim ({family.head_dim}) must divide width_multiple "
                        f"({family.width_multiple}) so that heads divide every width")
    return family, ()


def _centre(value: Any) -> Centre:
    """``[sweep] centre``, with its prior's keys."""
    usage = ('[sweep] centre must be { prior = "tokens_per_param", tokens_per_param = R } '
             'or { prior = "fit", path = "fit.json" }')
    if not isinstance(value, dict) or value.get("prior") not in CENTRE_PRIORS:
        raise SpecError(usage)
    keys = CENTRE_KEYS[value["prior"]]
    unknown = sorted(set(value) - keys)
    if unknown:
        raise SpecError(f"[sweep] centre: unknown key '{unknown[0]}' for prior '{value['prior']}' "
                        f"(known: {', '.join(sorted(keys))})")
    if not keys - {"approach"} <= set(value):
        raise SpecError(usage)
    return _nested(Centre, value, "[sweep] centre")


def _search(table: dict[str, Any], family: Family | None) -> Search | None:
    """``[search]`` with its grids sorted (``batch_budgets`` by default ``budget``); None when the file has none."""
    if not table:
        return None
    if family is None:
        raise SpecError("[search] needs the 'aspect' shape family: it plans its sizes like [sweep] sizes")
    search = resolve_table(Search, table, "[search]", "[search] {}".format)
    if (search.budget is None) == (search.tokens_per_param is None):
        raise SpecError("[search] needs one of 'budget' (every size at one budget) and 'tokens_per_param' "
                        "(each size at its own)")
    if search.batch_tokens and search.budget is None and not search.batch_budgets:
        raise SpecError("[search] batch_tokens with tokens_per_param needs batch_budgets")
    for key in ("lr", "batch_tokens"):
        if 0 < len(getattr(search, key)) < SEARCH_GRID_MIN:
            raise SpecError(f"[search] {key} needs at least {SEARCH_GRID_MIN} values, got {len(getattr(search, key))}")
    if search.batch_budgets and not search.batch_tokens:
        raise SpecError("[search] batch_budgets needs batch_tokens (the batch grid)")
    if len(search.sizes) < 2:
        raise SpecError("[search] sizes needs at least 2 sizes to fit LR(N)")
    budgets = search.batch_budgets or ((search.budget,) if search.batch_tokens else ())
    return dataclasses.replace(search, sizes=tuple(sorted(search.sizes)), lr=tuple(sorted(search.lr)),
                               batch_tokens=tuple(sorted(search.batch_tokens)), batch_budgets=tuple(sorted(budgets)))


def _launch_rules(by_size: Any) -> tuple[LaunchRule, ...]:
    if not isinstance(by_size, list) or not all(isinstance(rule, dict) for rule in by_size):
        raise SpecError("[[launch.by_size]] must be a list of tables")
    rules = []
    for i, rule in enumerate(by_size):
        where = f"launch.by_size[{i}]"
        bounds = {key: rule[key] for key in ("min_params", "max_params") if key in rule}
        settings = check_launch({k: v for k, v in rule.items() if k not in bounds}, where)
        rules.append(LaunchRule(**resolve_keys(LaunchRule, bounds, where, lambda key: f"{where}.{key}"),
                                settings=settings))
    return tuple(rules)


def _table(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """The keys of ``[name]`` that are Sweep's own fields, resolved."""
    return resolve_keys(Sweep, doc.get(name, {}), f"[{name}]", f"[{name}] {{}}".format, TABLE_KEYS[name])


def parse(text: str, source: str = "sweep file", folder: str | Path | None = None) -> Sweep:
    """Parse and check a sweep file's text; ``folder`` overrides ``[sweep] folder``."""
    doc = parse_toml(text, source)
    unknown = sorted(set(doc) - set(TABLE_KEYS))
    if unknown:
        raise SpecError(f"{source}: unknown table [{unknown[0]}] (known: {', '.join(TABLE_KEYS)})")
    bad = next((name for name, value in doc.items() if not isinstance(value, dict)), None)
    if bad:
        raise SpecError(f"[{bad}] must be a table")
    raw, rules = doc.get("sweep", {}), _table(doc, "rules")
    sweep = _table(doc, "sweep")
    for key, needs in (("seeds_below", "seeds"), ("decades_each_side", "centre"), ("per_budget", "centre")):
        if key in raw and needs not in raw:
            raise SpecError(f"[sweep] {key} needs '{needs}'")
    name = check_name(sweep["name"], "[sweep] name")
    where = "--folder" if folder is not None else "[sweep] folder"
    if folder is None:
        folder = check_value(sweep.get("folder", f"runs/sweeps/{name}"), str, "[sweep] folder", nonempty=True)
    folder = check_path(folder, where)  # it reaches the SLURM scripts and the job's log lines
    if folder.exists() and not folder.is_dir():
        raise SpecError(f"{where} {folder} is a file, not a folder")
    base = _base(doc.get("base", {}))
    if "budgets" not in raw and "critical_batch" not in doc:
        raise SpecError("[sweep] needs 'budgets' (or a [critical_batch] table: a batch sweep)")
    family, shapes = _shapes(raw, doc.get("shapes", {}), batch_only="budgets" not in raw)
    launch = {k: v for k, v in doc.get("launch", {}).items() if k != "by_size"}
    lr = _rule(rules.get("lr"), "[rules] lr", Sweep.lr)
    if rules.get("mup_base_width") is not None and lr.exponent != 0:
        raise SpecError("[rules] lr: with mup_base_width, give the one rate tuned at the base width (no exponent): "
                        "μP transfers it to every width")
    if rules.get("mup_base_width") is not None and "search" in doc:
        raise SpecError("[search] fits LR(N) per size; with [rules] mup_base_width give the rate tuned at the "
                        "base width as [rules] lr instead")
    own = {k: v for k, v in sweep.items() if k not in ("folder", "centre", "cooldowns", "routing")}
    return Sweep(**own, **_table(doc, "estimate"), **_table(doc, "local"), folder=Path(folder).absolute(),
                 family=family, shapes=shapes, lr=lr,
                 batch_tokens=_rule(rules.get("batch_tokens"), "[rules] batch_tokens", Sweep.batch_tokens),
                 mup_base_width=rules.get("mup_base_width"), base=base,
                 launch=resolve_table(Launch, launch, "[launch]", "[launch] {}".format),
                 launch_rules=_launch_rules(doc.get("launch", {}).get("by_size", [])),
                 slurm=_slurm(doc.get("slurm", {}), "[slurm]", "[slurm] {}".format), source=text,
                 centre=_centre(sweep["centre"]) if "centre" in raw else None,
                 search=_search(doc.get("search", {}), family),
                 cooldowns=_cooldowns(sweep["cooldowns"], base) if "cooldowns" in raw else None,
                 routing=_routing(sweep["routing"], raw, base) if "routing" in raw else (),
                 critical_batch=_critical_batch(doc["critical_batch"], family, base) if "critical_batch" in doc
                 else None)


def _critical_batch(table: dict[str, Any], family: Family | None, base: dict[str, dict[str, Any]]) -> CriticalBatch:
    """``[critical_batch]`` (with its ``held_out`` table), checked against ``[base.train]``: at least 3 batches over
    ``BATCH_SPAN_MIN``x or more, a constant schedule whose warmup the table sets, targets sorted high to low."""
    where = "[critical_batch]"
    if family is None:
        raise SpecError(f"{where} needs the 'aspect' shape family: it plans its sizes like [sweep] sizes")
    nested = ("lr", "lr_size", "held_out")
    own = [f.name for f in dataclasses.fields(CriticalBatch) if f.name not in nested]
    rest = {k: v for k, v in table.items() if k not in nested}
    values = resolve_keys(CriticalBatch, rest, where, f"{where} {{}}".format, own)
    if "lr" not in table:
        raise SpecError(f"{where} needs 'lr' (a rate, or {{ value, exponent, reference }}: lr(B) of the batch)")
    held = table.get("held_out")
    if held is not None:
        held = _nested(HeldOut, held, f"{where} held_out")
        held = dataclasses.replace(held, sizes=tuple(sorted(held.sizes)), lr_factors=tuple(sorted(held.lr_factors)),
                                   targets=tuple(sorted(held.targets, reverse=True)))
    cb = CriticalBatch(**values, lr=_rule(table["lr"], f"{where} lr", PowerRule(1.0)),
                       lr_size=_rule(table.get("lr_size"), f"{where} lr_size", PowerRule(1.0)), held_out=held)
    batches = sorted(cb.batch_tokens)
    if len(batches) < SEARCH_GRID_MIN:
        raise SpecError(f"{where} batch_tokens needs at least {SEARCH_GRID_MIN} batches (the frontier has two "
                        f"parameters), got {len(batches)}")
    if batches[-1] / batches[0] < BATCH_SPAN_MIN:
        raise SpecError(f"{where} batch_tokens span {batches[-1] / batches[0]:.3g}x ({batches[0]:g} to "
                        f"{batches[-1]:g}); the frontier needs at least {BATCH_SPAN_MIN:g}x, from well below to well "
                        f"above the critical batch")
    train = base.get("train", {})
    if RunConfig.from_dict({"train": train}).train.schedule != "constant":
        raise SpecError(f"{where} needs [base.train] schedule = \"constant\": under a decay the steps to a target "
                        f"depend on the decay's length, which differs from batch to batch")
    for key, why in (("warmup", f"{where} warmup_steps sets every run's warmup in steps"),
                     ("micro_batch", "the batch sweep trains each batch in one micro-step (no accumulation)")):
        if key in train:
            raise SpecError(f"[base.train] sets '{key}'; {why}")
    return dataclasses.replace(cb, sizes=tuple(sorted(cb.sizes)), batch_tokens=tuple(batches),
                               lr_factors=tuple(sorted(cb.lr_factors)),
                               targets=tuple(sorted(cb.targets, reverse=True)))


def _routing(value: Any, sweep: dict[str, Any], base: dict[str, dict[str, Any]]) -> tuple[dict[str, int], ...]:
    """``[sweep] routing``: a list of distinct routings (``Routing``) every shape is trained with, each as the
    model.moe_* fields it gives."""
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        raise SpecError("[sweep] routing must be a non-empty list of tables such as { experts = 8, top_k = 2 }")
    if "cooldowns" in sweep:
        raise SpecError("[sweep] routing and cooldowns cannot be combined yet: a cooldown's parent is one per size")
    fixed = sorted(k for k in base.get("model", {}) if k.startswith("moe_"))
    if fixed:
        raise SpecError(f"[base.model] {fixed[0]} and [sweep] routing both set the routing: keep one")
    out = []
    for i, entry in enumerate(value):
        where = f"[sweep] routing[{i}]"
        if "experts" not in entry and set(entry) <= set(ROUTING_KEYS):
            raise SpecError(f"{where}: needs 'experts' (0: the dense model)")
        routing = _nested(Routing, entry, where)
        if not routing.experts and len(entry) > 1:
            raise SpecError(f"{where}: experts = 0 is the dense model; it takes no other key")
        out.append({ROUTING_KEYS[k]: getattr(routing, k) for k in entry} if routing.experts else {})
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
    cooldowns = _nested(Cooldowns, value, "[sweep] cooldowns")
    fraction, at = cooldowns.fraction, cooldowns.at
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
    return cooldowns


def option_name(key: str) -> str:
    """The command-line option that overrides a ``[launch]`` or ``[slurm]`` key: mem_gb → --mem-gb."""
    return "--" + key.replace("_", "-")


def with_overrides(sweep: Sweep, launch: dict[str, Any], slurm: dict[str, Any]) -> Sweep:
    """``sweep`` with command-line values checked like the file's: ``launch`` applies to every run, over
    ``[launch]``, ``[[launch.by_size]]`` and the shapes' own settings; ``slurm`` over ``[slurm]``."""
    launch, slurm = check_launch(launch, "options", option_name), _slurm(slurm, "options", option_name)
    return dataclasses.replace(sweep, launch_overrides={**sweep.launch_overrides, **launch},
                               slurm={**sweep.slurm, **slurm})


def load(path: str | Path, folder: str | Path | None = None) -> Sweep:
    """Read and parse a sweep file."""
    return parse(read_toml_text(path, "sweep file"), source=str(path), folder=folder)
