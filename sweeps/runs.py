"""The planner: budgets × shapes → runs, each with its shape, token count, learning rate, batch and launch.

For a budget C and a shape with F FLOPs per token (``lab.measure.accounting.flops_per_token``), the run's
token count is D = C / F rounded to whole batches, so it spends C to within half a batch; its
schedule spans exactly those tokens. The learning rate and the batch (in tokens) come from the
sweep's power rules at the shape's N; the batch is rounded to a multiple of what one micro-step of
all processes takes (micro_batch × block_size × world size). Entries that cannot run (a shape that
cannot exist, D below one batch, two entries giving the same run) are refused with one line each.

With ``[sweep] centre`` each budget gets its own sizes, centred on a prior N_opt(C) (``sweeps.centre``);
targets that would round to one shape move to the family's next width outward (or are left out), and a budget
whose shapes do not put ``BRACKET_SIDE`` sizes on each side of its prior gets a warning: its minimum may not be
bracketed.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from lab.measure import accounting, hardware
from lab.runtime.config import RunConfig

from sweeps import centre as centring
from sweeps.shapes import count, family_shape, model_config, vocab_size
from sweeps.spec import SpecError, check_name
from sweeps.sweep import Launch, PowerRule, Sweep, routing_name

BRACKET_SIDE = 2  # sizes each side of the minimum that the IsoFLOP analysis needs to locate it


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: what it is (its command-line options) and how it is launched."""

    name: str
    budget: float  # C asked for
    target: float | None  # the size it was planned for (family), else None
    shape: dict[str, int]
    params: int
    params_non_embedding: int
    flops_per_token: float
    tokens: int  # D
    batch_tokens: int
    lr: float
    launch: Launch
    args: tuple[str, ...]  # launch/run.py options, without --run-dir and --resume
    est_seconds: float
    role: str = "sweep"  # or "search" (a hyperparameter grid run first), "verify" (a held-out budget) or "parent"
    parent: str | None = None  # a cooldown branch: the parent run whose checkpoint at branch_step it starts from
    branch_step: int = 0  # a branch's first step (the parent's step it starts from); 0 for every other run

    @property
    def flops(self) -> float:
        """Compute of the end point as a run of its own: F × D (a branch's includes its parent's share)."""
        return self.flops_per_token * self.tokens

    @property
    def flops_spent(self) -> float:
        """Compute this run itself spends: a branch only its cooldown, F × (D - branch_step × batch)."""
        return self.flops_per_token * (self.tokens - self.branch_step * self.batch_tokens)

    @property
    def config_hash(self) -> str:
        """Identity of what the run computes: its options, process count and nodes (not its name)."""
        identity = {"args": list(self.args), "nproc": self.launch.nproc, "nodes": self.launch.nodes}
        if self.role != "sweep":  # a search or verify run may compute what a sweep run does; both are kept
            identity["role"] = self.role
        if self.parent is not None:  # a branch is what it starts from, too
            identity |= {"parent": self.parent, "branch_step": self.branch_step}
        key = json.dumps(identity)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["args"] = list(self.args)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlannedRun":
        return cls(**{**d, "launch": Launch(**d["launch"]), "args": tuple(d["args"])})


@dataclass
class Plan:
    runs: list[PlannedRun]
    refused: list[str]  # one line per entry that cannot run
    warnings: list[str] = dataclasses.field(default_factory=list)  # one line each: budgets not bracketed, ...
    priors: list[str] = dataclasses.field(default_factory=list)  # with a centre: each budget's prior N_opt
    moved: list[str] = dataclasses.field(default_factory=list)  # with a centre: targets moved or left out


def format_flops(c: float) -> str:
    """3e12, 1.5e13: short and stable, for run names."""
    mantissa, exponent = f"{c:.3g}".split("e") if "e" in f"{c:.3g}" else (f"{c:.3g}", "0")
    return f"{mantissa}e{int(exponent)}"


def option_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def run_args(base: dict[str, dict[str, Any]], planned: dict[str, dict[str, Any]]) -> tuple[str, ...]:
    """``--section.field value`` options for ``[base]`` with the planner's fields on top, sorted."""
    tree = copy.deepcopy(base)
    for section, values in planned.items():
        tree.setdefault(section, {}).update(values)
    return tuple(item for section in sorted(tree) for key in sorted(tree[section])
                 for item in (f"--{section}.{key}", option_text(tree[section][key])))


def launch_for(sweep: Sweep, params: float, entry_launch: dict[str, Any]) -> Launch:
    """Sweep defaults, then each matching ``[[launch.by_size]]`` rule in order, then the shape's own settings,
    then the command line's overrides."""
    launch = sweep.launch
    for rule in sweep.launch_rules:
        if rule.min_params <= params < rule.max_params:
            launch = dataclasses.replace(launch, **rule.settings)
    return dataclasses.replace(launch, **{**entry_launch, **sweep.launch_overrides})


Shape = tuple[str, float | None, dict, dict]  # (shape name, target size, model fields, launch settings)


def family_shapes(sweep: Sweep, sizes: list[float], where: str = "") -> tuple[list[Shape], list[str], list[str]]:
    """The family's shape for each size, refusals, and a warning for each size whose shape repeats an earlier one."""
    shapes: list[Shape] = []
    refused, repeats = [], []
    for size in sizes:
        try:
            s = family_shape(size, sweep.family, sweep.count, sweep.base)
        except SpecError as e:
            refused.append(f"{where}size {size:.3g}: {e}")
            continue
        name = f"L{s['n_layer']}-d{s['d_model']}"
        same = next((t for n, t, _, _ in shapes if n == name), None)
        if where and same is not None:  # centred sizes: one run per shape
            repeats.append(f"{where}target sizes {same:.3g} and {size:.3g} give the same shape {name}; planned once")
            continue
        shapes.append((name, size, s, {}))
    return shapes, refused, repeats


def _bracket_warning(sweep: Sweep, prior: centring.Prior, shapes: list[Shape]) -> str | None:
    """A warning when fewer than BRACKET_SIDE distinct sizes lie on either side of the prior."""
    sizes = {count(model_config(sweep.base, s), sweep.count) for _, _, s, _ in shapes}
    below, above = sum(n < prior.params for n in sizes), sum(n > prior.params for n in sizes)
    if below >= BRACKET_SIDE and above >= BRACKET_SIDE:
        return None
    return (f"budget {prior.budget:.3g}: the shapes the family allows put {below} size(s) below and {above} above "
            f"the prior N_opt {prior.params:.3g} (need {BRACKET_SIDE} each side): its minimum may not be bracketed")


def _shapes(sweep: Sweep, budget: float, fixed: list[Shape] | None, prior: centring.Prior | None
            ) -> tuple[list[Shape], list[str], list[str], list[str]]:
    """Shapes of one budget, refusals, warnings and targets moved: the explicit list, fixed sizes or sizes centred
    on a prior."""
    if sweep.family is None:
        return [(e.name, None, e.model, e.launch) for e in sweep.shapes], [], [], []
    if prior is None:
        return fixed, [], [], []
    pairs, moved = centring.distinct_targets(sweep, prior.params)
    shapes, refused, warnings = family_shapes(sweep, [n for _, n in pairs], f"budget {budget:.3g}, ")
    target = dict((n, t) for t, n in pairs)
    shapes = [(name, target[n], s, launch) for name, n, s, launch in shapes]  # each with the target it stands for
    bracket = _bracket_warning(sweep, prior, shapes)
    return shapes, refused, warnings + ([bracket] if bracket else []), [f"budget {budget:.3g}: {m}" for m in moved]


@dataclass(frozen=True)
class Tuned:
    """Hyperparameter laws that replace ``[rules]``: LR(N) and, when searched, batch(C) (``sweeps.search``)."""

    lr: PowerRule  # of N
    batch_tokens: PowerRule | None  # of C; None: ``[rules] batch_tokens``


def planned_run(sweep: Sweep, budget: float, shape_name: str, target: float | None, shape: dict[str, Any],
                entry_launch: dict[str, Any], tuned: Tuned | None = None, *, lr: float | None = None,
                batch_tokens: float | None = None, role: str = "sweep", name: str | None = None,
                seed: int | None = None) -> PlannedRun | str:
    """One run of ``shape`` at ``budget``, or the one line that refuses it.

    The learning rate and batch are ``lr`` / ``batch_tokens`` when given, else from ``tuned``'s laws, else
    from ``[rules]``; the batch is rounded to whole micro-steps of every process. ``seed``: the run's
    ``train.seed`` (and a name ending ``-s<seed>``) when it is not ``[base.train]``'s.
    """
    where = _where(budget, shape_name, target)
    try:
        cfg = model_config(sweep.base, shape)
    except SpecError as e:
        return f"{where}: {e}"
    train = RunConfig.from_dict({"train": sweep.base.get("train", {})}).train
    seed = train.seed if seed is None else seed
    counts = accounting.param_counts(cfg)
    n = (counts.total if sweep.count == "total" else counts.non_embedding) - counts.inactive  # a routed model: active
    launch = launch_for(sweep, n, entry_launch)
    unit = train.micro_batch * cfg.block_size * launch.world_size
    if batch_tokens is None:
        batch_tokens = (tuned.batch_tokens.at(budget) if tuned is not None and tuned.batch_tokens is not None
                        else sweep.batch_tokens.at(n))
    batch = unit * max(1, round(batch_tokens / unit))
    fpt = accounting.flops_per_token(cfg)
    tokens = budget / fpt
    if tokens < batch:
        return f"{where}: D = {tokens:,.0f} tokens is below one batch ({batch:,} tokens)"
    tokens = batch * round(tokens / batch)
    if lr is None:
        lr = (tuned.lr if tuned is not None else sweep.lr).at(n)
    lr = float(f"{lr:.4g}")
    args = run_args(sweep.base, {
        "model": {**shape, "vocab_size": vocab_size(sweep.base), **sweep.mup_model_fields()},
        "train": {"tokens": tokens, "lr": lr, "batch_tokens": batch} | ({} if seed == train.seed else {"seed": seed})
                 | ({"eval_every": max(1, tokens // batch // sweep.evals)} if sweep.evals else {}),
        "parallel": {"strategy": launch.strategy},
    })
    eval_flops = fpt / 3 * train.eval_tokens * max(1, min(sweep.evals, tokens // batch))  # forward only
    est = (sweep.overhead_s + tokens // batch * sweep.step_s
           + (fpt * tokens + eval_flops) / (sweep.flops_per_s * launch.world_size))
    name = (name or f"C{format_flops(budget)}-{shape_name}") + ("" if seed == train.seed else f"-s{seed}")
    try:
        check_name(name, "run name")
    except SpecError as e:
        return f"{where}: {e}"
    return PlannedRun(name=name, budget=budget, target=target, shape=dict(shape), params=counts.total,
                      params_non_embedding=counts.non_embedding, flops_per_token=fpt, tokens=tokens,
                      batch_tokens=batch, lr=lr, launch=launch, args=args, est_seconds=est, role=role)


def _where(budget: float, shape_name: str, target: float | None) -> str:
    """How a refusal names a planned entry."""
    return f"budget {budget:.3g}, " + (f"size {target:.3g} ({shape_name})" if target else f"shape {shape_name}")


def _repeat(run: PlannedRun, where: str, by_name: dict[str, str], by_hash: dict[str, str]) -> str | None:
    """A refusal when ``run`` repeats an earlier run's name or config; else record it."""
    if run.name in by_name:
        return f"{where}: duplicate run '{run.name}' (same name as {by_name[run.name]})"
    if run.config_hash in by_hash:
        return f"{where}: same config as run '{by_hash[run.config_hash]}'"
    by_name[run.name], by_hash[run.config_hash] = where, run.name
    return None


def plan(sweep: Sweep, tuned: Tuned | None = None) -> Plan:
    """Every run of ``sweep`` in budget order, a one-line refusal for each entry that cannot run, and warnings.

    ``tuned``: the laws of the sweep's search, in place of ``[rules]``.
    """
    refused: list[str] = []
    warnings: list[str] = []
    fixed = None
    if sweep.family is not None and sweep.centre is None:
        fixed, refused, _ = family_shapes(sweep, list(sweep.sizes))
    priors = {p.budget: p for p in centring.priors(sweep)} if sweep.centre is not None else {}
    runs: list[PlannedRun] = []
    by_name: dict[str, str] = {}
    by_hash: dict[str, str] = {}
    moved: list[str] = []
    for budget in sweep.budgets:
        shapes, budget_refused, budget_warnings, budget_moved = _shapes(sweep, budget, fixed, priors.get(budget))
        refused += budget_refused
        warnings += budget_warnings
        moved += budget_moved
        repeated = sweep.seeds and (sweep.seeds_below is None or budget < sweep.seeds_below)
        seeds = sweep.seeds if repeated else sweep.seeds[:1] or (None,)
        routings = sweep.routing or ({},)
        for (shape_name, target, shape, entry_launch), seed, routing in itertools.product(shapes, seeds, routings):
            if sweep.routing:
                shape_name, shape = f"{shape_name}-{routing_name(routing)}", {**shape, **routing}
            run = planned_run(sweep, budget, shape_name, target, shape, entry_launch, tuned, seed=seed)
            if isinstance(run, str):
                refused.append(run)
                continue
            problem = _repeat(run, _where(budget, shape_name, target), by_name, by_hash)
            if problem:
                refused.append(problem)
                continue
            runs.append(run)
    return Plan(runs=runs, refused=refused, warnings=warnings,
                priors=[f"budget {p.budget:.3g}: prior N_opt {p.params:.4g} ({p.how})" for p in priors.values()],
                moved=moved)


def table(runs: list[PlannedRun], count_which: str = "total", parallel: int = 1) -> str:
    """The plan as a fixed-width text table, with totals (``parallel``: local runs at once)."""
    width = max([24] + [len(r.name) for r in runs])
    head = f"{'run':<{width}} {'N':>10} {'shape':>14} {'D (tokens)':>12} {'C (FLOPs)':>10} {'batch':>7} " \
           f"{'lr':>8} {'launch':>14} {'est. time':>9}"
    lines = [head, "-" * len(head)]
    for r in runs:
        branch = f"  ← {r.parent} @ step {r.branch_step}" if r.parent else ""
        n = r.params if count_which == "total" else r.params_non_embedding
        shape = f"{r.shape['n_layer']}×{r.shape['d_model']}/{r.shape['n_head']}h"
        launch = f"{r.launch.strategy}×{r.launch.world_size}"
        lines.append(f"{r.name:<{width}} {n:>10,} {shape:>14} {r.tokens:>12,} {r.flops:>10.3g} {r.batch_tokens:>7,} "
                     f"{r.lr:>8.3g} {launch:>14} {hardware.duration(r.est_seconds):>9}{branch}")
    total = sum(r.est_seconds for r in runs)
    at_once = f", about {hardware.duration(total / parallel)} with {parallel} at once" if parallel > 1 else ""
    spent = sum(r.flops_spent for r in runs)
    branched = sum(r.parent is not None for r in runs)
    flops = f"{spent:.3g} FLOPs" + (f" spent ({branched} cooldown branches: C is each end point's)" if branched else "")
    lines.append(f"{len(runs)} runs, {flops}, estimated {hardware.duration(total)} one after another{at_once}")
    return "\n".join(lines)
