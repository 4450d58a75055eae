"""The hyperparameter search a sweep runs first (``[search]``), and the laws fitted to its best values.

Two grids, in the manner of DeepSeek LLM (2024), who fitted the optimal learning rate and batch as
power laws of compute:

1. learning rates: every rate of ``lr`` for each size of ``sizes``, at the search ``budget``, or with
   ``tokens_per_param`` r at each size's own budget C = F r N (F its FLOPs per token): every size then trains
   as long, relative to its size, as the sweep's runs near their optimum do; the best rate per size is the vertex of a parabola through the lowest loss and its two neighbours in log LR
   (the lowest rate itself when it lies at the grid's edge, with a warning), and
   LR(N) = c N^e is fitted to those by least squares in log-log;
2. batches (optional): every batch of ``batch_tokens`` at each of ``batch_budgets``, for the budget's
   prior N_opt (the sweep's centre) or the middle search size, at LR(N); the best batch per budget
   gives batch(C) = c C^e the same way (a constant with one budget).

The sweep's runs then take their learning rate and batch from these laws instead of ``[rules]``.
A search run that failed (a diverged learning rate) counts as the worst of its grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lab.measure import accounting
from lab.runtime.files import save_json

from sweeps import centre as centring
from sweeps.driver import EXIT_OK, EXIT_UNFINISHED, execute
from sweeps.executors.attempt import Executor
from sweeps.runs import PlannedRun, Tuned, family_shapes, format_flops, planned_run
from sweeps.registry import Registry
from sweeps.shapes import count, model_config
from sweeps.sweep import PowerRule, Sweep

FOLDER = "search"  # inside the sweep folder: runs/, laws.json and search.png
ROLE = "search"


@dataclass(frozen=True)
class GridResult:
    """One grid: the values tried at one size (LR) or budget (batch), their losses and the best value."""

    at: float  # N (learning rates) or C (batches)
    values: list[float]
    losses: list[float]  # inf for a failed run
    best: float
    interior: bool  # the lowest loss has a tried value on each side


@dataclass(frozen=True)
class Law:
    """A fitted power law ``value × (x / reference) ** exponent`` and the grid results it was fitted to."""

    rule: PowerRule
    grids: list[GridResult]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.rule), "grids": [asdict(g) for g in self.grids]}


@dataclass(frozen=True)
class SearchResult:
    lr: Law
    batch_tokens: Law | None
    warnings: list[str]

    @property
    def tuned(self) -> Tuned:
        return Tuned(lr=self.lr.rule, batch_tokens=None if self.batch_tokens is None else self.batch_tokens.rule)

    def to_dict(self) -> dict[str, Any]:
        return {"lr": self.lr.to_dict(), "batch_tokens": None if self.batch_tokens is None
                else self.batch_tokens.to_dict(), "warnings": self.warnings}


# ---------------------------------------------------------------- the runs


def _lr_name(budget: float, shape: str, lr: float) -> str:
    return f"search-C{format_flops(budget)}-{shape}-lr{lr:.3g}"


def _batch_name(budget: float, shape: str, batch: float) -> str:
    return f"search-C{format_flops(budget)}-{shape}-b{batch:g}"


def lr_runs(sweep: Sweep) -> tuple[list[PlannedRun], list[str]]:
    """The learning-rate grid's runs and one refusal line per run that cannot be planned."""
    search = sweep.search
    shapes, refused, _ = family_shapes(sweep, list(search.sizes), "search, ")
    runs: list[PlannedRun] = []
    for shape_name, target, shape, entry_launch in shapes:
        budget = search.budget or lr_budget(sweep, shape)
        for lr in search.lr:
            _add(runs, refused, planned_run(sweep, budget, shape_name, target, shape, entry_launch, lr=lr,
                                            role=ROLE, name=_lr_name(budget, shape_name, lr)))
    return runs, refused


def lr_budget(sweep: Sweep, shape: dict) -> float:
    """The budget of a shape's learning-rate grid under ``tokens_per_param`` r: F r N, to 3 significant digits."""
    cfg = model_config(sweep.base, shape)
    flops = accounting.flops_per_token(cfg) * sweep.search.tokens_per_param * count(cfg, sweep.count)
    return float(f"{flops:.3g}")


def _add(runs: list[PlannedRun], refused: list[str], run: PlannedRun | str) -> None:
    """Add a planned run, or its refusal; a run computing what an earlier one does is refused."""
    if isinstance(run, str):
        refused.append(run)
        return
    twin = next((r.name for r in runs if r.config_hash == run.config_hash), None)
    if twin is not None:
        refused.append(f"search run {run.name} is the same run as {twin} (a batch rounds to whole micro-steps of "
                       f"{run.launch.world_size} process(es))")
        return
    runs.append(run)


def batch_target(sweep: Sweep, budget: float) -> float:
    """The size the batch grid runs at a budget: the centre's prior N_opt, else the middle search size."""
    if sweep.centre is not None:
        return centring.prior_at(sweep, budget).params
    sizes = sweep.search.sizes
    return math.sqrt(sizes[0] * sizes[-1])


def batch_runs(sweep: Sweep, lr: PowerRule) -> tuple[list[PlannedRun], list[str]]:
    """The batch grid's runs (learning rate from ``lr``) and one refusal line per run that cannot be planned."""
    search = sweep.search
    runs: list[PlannedRun] = []
    refused: list[str] = []
    for budget in search.batch_budgets:
        shapes, shape_refused, _ = family_shapes(sweep, [batch_target(sweep, budget)], "search, ")
        refused += shape_refused
        for shape_name, target, shape, entry_launch in shapes:
            for batch in search.batch_tokens:
                _add(runs, refused, planned_run(sweep, budget, shape_name, target, shape, entry_launch,
                                                Tuned(lr, None), batch_tokens=batch, role=ROLE,
                                                name=_batch_name(budget, shape_name, batch)))
    return runs, refused


# ---------------------------------------------------------------- the fits (pure)


def best_of(values: list[float], losses: list[float]) -> tuple[float, bool]:
    """The best value of a grid and whether it is interior: the vertex of the parabola through the lowest loss
    and its neighbours in log value (kept between those neighbours), else the lowest value itself."""
    order = np.argsort(values)
    v, y = np.asarray(values, float)[order], np.asarray(losses, float)[order]
    x = np.log(v)
    i = int(np.argmin(y))
    if i == 0 or i == len(x) - 1 or not np.all(np.isfinite(y[i - 1:i + 2])):
        return float(v[i]), False
    a, b, _ = np.polyfit(x[i - 1:i + 2], y[i - 1:i + 2], 2)
    vertex = -b / (2 * a) if a > 0 else x[i]
    return float(np.exp(np.clip(vertex, x[i - 1], x[i + 1]))), True


def power_law(x: list[float], y: list[float]) -> PowerRule:
    """Least-squares fit of log y = log c + e log x, as a rule referenced at the geometric mean of x."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    reference = float(np.exp(lx.mean()))
    exponent = float(np.polyfit(lx, ly, 1)[0]) if len(set(x)) > 1 else 0.0
    value = float(np.exp(ly.mean()))  # the fitted line passes through the means
    return PowerRule(value=value, exponent=exponent, reference=reference)


def grid(at: float, values: list[float], losses: list[float]) -> GridResult:
    best, interior = best_of(values, losses)
    return GridResult(at=at, values=list(values), losses=list(losses), best=best, interior=interior)


def _grids(runs: list[tuple[PlannedRun, float]], key: str, value: str) -> list[GridResult]:
    """Group (run, loss) pairs by ``key`` (the run's N or C) and take each group's best ``value``."""
    groups: dict[float, list[tuple[float, float]]] = {}
    for run, loss in runs:
        groups.setdefault(float(getattr(run, key)), []).append((float(getattr(run, value)), loss))
    return [grid(at, *map(list, zip(*sorted(pairs)))) for at, pairs in sorted(groups.items())]


def _edge_warnings(grids: list[GridResult], what: str, at: str) -> list[str]:
    return [f"{what} grid at {at} {g.at:.3g}: the lowest loss is at the grid's edge ({g.best:.3g}); widen the grid"
            for g in grids if not g.interior]


def fit_lr(runs: list[tuple[PlannedRun, float]]) -> tuple[Law, list[str]]:
    """LR(N) from the learning-rate grid's (run, final loss) pairs; warnings for grids whose best is at an edge."""
    grids = _grids(runs, "params", "lr")
    return Law(power_law([g.at for g in grids], [g.best for g in grids]), grids), _edge_warnings(grids, "LR", "N")


def fit_batch(runs: list[tuple[PlannedRun, float]]) -> tuple[Law, list[str]]:
    """batch(C) from the batch grid's (run, final loss) pairs."""
    grids = _grids(runs, "budget", "batch_tokens")
    return (Law(power_law([g.at for g in grids], [g.best for g in grids]), grids),
            _edge_warnings(grids, "batch", "C"))


# ---------------------------------------------------------------- running it


def _run_dir(folder: Path) -> Callable[[str], Path]:
    return lambda name: folder / FOLDER / "runs" / name


def _results(registry: Registry, runs: list[PlannedRun]) -> list[tuple[PlannedRun, float]] | None:
    """(run, final loss) of every run (inf for a failed one), or None while any is unfinished."""
    out = []
    for run in runs:
        row = registry.get(run.name)
        if row is None or row.status not in ("done", "failed"):
            return None
        loss = row.final_loss
        out.append((run, math.inf if row.status == "failed" or loss is None else float(loss)))
    return out


def _stage(folder: Path, registry: Registry, runs: list[PlannedRun], executor: Executor,
           progress: bool) -> list[tuple[PlannedRun, float]] | int:
    """Run one grid (finished runs are skipped); its results, or the driver's exit code when it stopped short."""
    registry.sync(runs, _run_dir(folder))
    code = execute(folder, registry, [r.name for r in runs], executor, progress)
    results = _results(registry, runs)
    if results is None:
        return code if code != EXIT_OK else EXIT_UNFINISHED
    if not any(math.isfinite(loss) for _, loss in results):
        raise SearchFailed("every run of the search failed; see its logs under " + str(folder / "logs"))
    return results


class SearchFailed(RuntimeError):
    """No run of a grid finished."""


def finished(sweep: Sweep, registry: Registry | None) -> SearchResult | None:
    """The laws of a search whose runs have all ended (recorded in ``registry``), else None."""
    if registry is None:
        return None
    lr_results = _results(registry, lr_runs(sweep)[0])
    if lr_results is None:
        return None
    lr, warnings = fit_lr(lr_results)
    if not sweep.search.batch_tokens:
        return SearchResult(lr, None, warnings)
    batch_results = _results(registry, batch_runs(sweep, lr.rule)[0])
    if batch_results is None:
        return None
    batch, batch_warnings = fit_batch(batch_results)
    return SearchResult(lr, batch, warnings + batch_warnings)


def refusals(sweep: Sweep) -> list[str]:
    """Runs of the search that cannot be planned (checked before anything runs)."""
    return lr_runs(sweep)[1] + (batch_runs(sweep, sweep.lr)[1] if sweep.search.batch_tokens else [])


def run(sweep: Sweep, registry: Registry, executor: Executor, progress: bool = True) -> SearchResult | int:
    """Run the grids one after the other (finished runs are skipped), fit their laws and write
    ``search/laws.json`` and ``search/search.png``; the laws, or the driver's exit code when a grid stopped short."""
    folder = sweep.folder
    results = _stage(folder, registry, lr_runs(sweep)[0], executor, progress)
    if isinstance(results, int):
        return results
    lr, warnings = fit_lr(results)
    batch = None
    if sweep.search.batch_tokens:
        results = _stage(folder, registry, batch_runs(sweep, lr.rule)[0], executor, progress)
        if isinstance(results, int):
            return results
        batch, batch_warnings = fit_batch(results)
        warnings += batch_warnings
    result = SearchResult(lr, batch, warnings)
    (folder / FOLDER).mkdir(parents=True, exist_ok=True)
    save_json(folder / FOLDER / "laws.json", result.to_dict())
    plot(result, folder / FOLDER / "search.png")
    return result


def describe(result: SearchResult) -> list[str]:
    """The fitted laws, one line each."""
    lines = [f"LR(N) = {result.lr.rule.value:.4g} × (N / {result.lr.rule.reference:.4g})^{result.lr.rule.exponent:.3f}"
             f" from the best rate of {len(result.lr.grids)} sizes"]
    if result.batch_tokens is not None:
        b = result.batch_tokens
        lines.append(f"batch(C) = {b.rule.value:.4g} × (C / {b.rule.reference:.3g})^{b.rule.exponent:.3f} tokens "
                     f"from the best batch of {len(b.grids)} budget(s)")
    return lines


# ---------------------------------------------------------------- the figure


def plot(result: SearchResult, path: Path) -> None:
    """Loss against each grid, coloured by size or budget, and the fitted laws through the best values."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    laws = [("learning rate", "N", result.lr)] + ([("batch (tokens)", "C", result.batch_tokens)]
                                                   if result.batch_tokens is not None else [])
    fig, axes = plt.subplots(len(laws), 2, figsize=(11, 4.2 * len(laws)), squeeze=False)
    for (what, at, law), (ax_grid, ax_law) in zip(laws, axes):
        colours = plt.cm.viridis(np.linspace(0, 0.9, len(law.grids)))
        for g, colour in zip(law.grids, colours):
            finite = np.isfinite(g.losses)
            ax_grid.plot(np.asarray(g.values)[finite], np.asarray(g.losses)[finite], "o-", color=colour,
                         label=f"{at} = {g.at:,.0f}" if at == "N" else f"{at} = {g.at:.3g}")
            ax_grid.axvline(g.best, color=colour, lw=0.8, ls=":")
        ax_grid.set(xscale="log", xlabel=what, ylabel="final eval loss (nats/token)",
                    title=f"{what} grid (dotted: best, parabola vertex)")
        grid_values = sorted({v for g in law.grids for v in g.values})
        ax_grid.set_xticks(grid_values, [f"{v:.4g}" for v in grid_values])
        ax_grid.minorticks_off()
        ax_grid.legend(fontsize=8)
        xs = np.array([g.at for g in law.grids])
        ax_law.plot(xs, [g.best for g in law.grids], "o", color="C3", label="best of each grid")
        line = np.geomspace(xs.min() / 1.5, xs.max() * 1.5, 50)
        ax_law.plot(line, [law.rule.at(x) for x in line], "-", color="C0",
                    label=f"fit: {law.rule.value:.3g} × ({at} / {law.rule.reference:.3g})^{law.rule.exponent:.3f}")
        bests = [g.best for g in law.grids] + [law.rule.at(x) for x in line]
        ax_law.set(xscale="log", yscale="log", xlabel=f"{at} ({'parameters' if at == 'N' else 'FLOPs'})",
                   ylabel=f"best {what}", title=f"best {what} against {at}",
                   ylim=(min(bests) / 1.6, max(bests) * 1.6))
        ticks = np.geomspace(min(bests) / 1.4, max(bests) * 1.4, 5)
        ax_law.set_yticks(ticks, [f"{v:.3g}" for v in ticks])
        ax_law.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax_law.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax_law.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=150)
    plt.close(fig)
    tmp.replace(path)
