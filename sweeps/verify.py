"""Predict, then verify: ``python -m sweeps verify SWEEP --budget C``.

The finished sweep is fitted (``python -m analysis fit`` with ``--predict C``, written to
``SWEEP/verify/fit-C/``); the law the fit prefers gives N_opt at the held-out budget C with its
interval, and the parametric law L(N, D) the loss. The family's shape nearest N_opt and its
neighbours one size step either side (the sweep's own step between sizes) are trained at C, with
the search's learning-rate and batch laws when the sweep has a search; while the lowest of them is at
an edge, one more size step that way (at most ``MAX_EXTENSIONS``). Achieved against predicted:
N_opt (the vertex of a parabola in log N through the three runs, when the lowest is the middle one)
inside the predicted interval, and the best run's loss within ``LOSS_TOLERANCE`` of the loss L(N, D)
predicts for it. The comparison goes to the terminal, ``SWEEP/verify/verify-C.json`` and ``.md``, the
fit's report and the registry (meta key ``verify C``). ``check``, ``check_sweep`` and ``verify`` are the
workflow the command line runs; what they refuse raises ``VerifyError``.
"""

from __future__ import annotations

import html
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lab.runtime.files import save_json, write_atomic

from sweeps import runs as planner
from sweeps.driver import driver_lock, execute
from sweeps.executors.attempt import Executor
from sweeps.runs import PlannedRun, Tuned, format_flops
from sweeps.registry import Registry
from sweeps.spec import check_budget
from sweeps.sweep import Sweep

FOLDER = "verify"
ROLE = "verify"
HELD_OUT_FACTOR = 4.0  # a budget this many times the largest swept one is a real extrapolation
LOSS_TOLERANCE = 0.01  # relative
MAX_EXTENSIONS = 2  # size steps added beyond the three shapes while the lowest run is at an edge


class VerifyError(ValueError):
    """Bad input for verify, or runs it cannot plan: one line per problem."""


@dataclass(frozen=True)
class Request:
    """What ``python -m sweeps verify`` asks for: the held-out budget and how to fit the sweep."""

    budget: float
    exclude: tuple[str, ...] = ()
    drop_highest_loss: int = 0
    drop_outliers: bool = False
    n_bootstrap: int = 1000
    progress: bool = True


def check(request: Request) -> None:
    """VerifyError (or SpecError) for a budget or bootstrap count that cannot work."""
    if not (math.isfinite(request.budget) and request.budget > 0):
        raise VerifyError(f"--budget must be a positive number of FLOPs, got {request.budget}")
    check_budget(request.budget, "--budget")
    if request.n_bootstrap < 0:
        raise VerifyError(f"--bootstrap must be 0 or more, got {request.n_bootstrap}")


def check_sweep(registry: Registry, budget: float) -> None:
    """VerifyError unless every run of the sweep is done and ``budget`` lies above its budgets; a warning when it
    lies less than HELD_OUT_FACTOR above them."""
    rows = [r for r in registry.rows() if r.plan.role == "sweep"]
    unfinished = [r for r in rows if r.status != "done"]
    if not rows or unfinished:
        example = f" ({unfinished[0].name} is {unfinished[0].status})" if unfinished else ""
        raise VerifyError(f"{len(unfinished) or 'no'} run(s) of the sweep are not done{example}; finish the sweep "
                          "first")
    largest = max(r.plan.budget for r in rows)
    if budget <= largest:
        raise VerifyError(f"--budget {budget:.3g} is not held out: the sweep runs budgets up to {largest:.3g}")
    if budget < HELD_OUT_FACTOR * largest:
        print(f"warning: --budget {budget:.3g} is only {budget / largest:.2g}x the largest swept budget; "
              f"{HELD_OUT_FACTOR:g}x or more tests an extrapolation", file=sys.stderr)


def verify(folder: Path, sweep: Sweep, registry: Registry, executor: Executor, request: Request) -> int:
    """Fit the finished sweep, train the predicted optimum and its neighbours at the held-out budget, compare and
    record; the exit code (0 verified, 1 not verified or a run unfinished, 3 no identified law)."""
    from analysis.cli import EXIT_UNIDENTIFIED
    from analysis.outputs import summary_lines
    from analysis.table import InputError
    from sweeps import search  # pandas, scipy, matplotlib: only here

    budget = request.budget
    with driver_lock(folder):
        found = search.finished(sweep, registry) if sweep.search is not None else None
        if sweep.search is not None and found is None:
            raise VerifyError("the sweep's search has not finished; run the sweep first")
        tuned = found.tuned if found else None
        try:
            result, doc, fit_dir = fit(folder, budget, request.progress, request.exclude, request.drop_highest_loss,
                                       request.drop_outliers, request.n_bootstrap)
        except InputError as e:  # an --exclude that matches nothing, too few runs left
            raise VerifyError(str(e)) from None
        print("\n".join(summary_lines(doc)))
        if doc["comparison"]["preferred"] is None:
            print(f"error: {result.why}; {fit_dir / 'report.html'} says why", file=sys.stderr)
            return EXIT_UNIDENTIFIED
        predicted = prediction(doc, budget)
        runs, refused = plan_runs(sweep, budget, predicted.n_opt, tuned)
        if refused:
            raise VerifyError("\n".join(refused))
        losses: list[tuple[PlannedRun, float]] = []
        for _ in range(1 + MAX_EXTENSIONS):  # three shapes, then a step further while the lowest is at an edge
            registry.sync(runs, lambda name: folder / FOLDER / "runs" / name)
            code = execute(folder, registry, [r.name for r in runs], executor, request.progress)
            rows = [registry.get(r.name) for r in runs]
            if any(row.status != "done" for row in rows):
                return code if code != 0 else 1
            losses += [(run, float(row.final_loss)) for run, row in zip(runs, rows)]
            runs = extension(sweep, budget, losses, tuned)
            if isinstance(runs, str):
                raise VerifyError(runs)
            if not runs:
                break
            print(f"the lowest of the runs at {budget:.3g} is at an edge: one size step further ({runs[0].name})")
        verdict = judge(predicted, losses, result.parametric.theta, result.thetas, result.config.ci_level)
        md = record(folder, registry, fit_dir, verdict)
        print("\n".join(describe(verdict)))
        print(f"wrote {md} and the verification section of {fit_dir / 'report.md'}")
        return 0 if verdict.verified else 1


def size_step(sweep: Sweep) -> float:
    """The ratio between neighbouring sizes of the sweep: the centre's log spacing, else the sizes' geometric mean."""
    if sweep.centre is not None:
        return 10 ** (2 * sweep.decades_each_side / (sweep.per_budget - 1))
    sizes = sorted(sweep.sizes)
    return (sizes[-1] / sizes[0]) ** (1 / (len(sizes) - 1)) if len(sizes) > 1 else 2.0


def plan_runs(sweep: Sweep, budget: float, n_opt: float, tuned: Tuned | None) -> tuple[list[PlannedRun], list[str]]:
    """The shape nearest ``n_opt`` and its neighbours one size step either side, at ``budget``; refusals."""
    step = size_step(sweep)
    return plan_runs_at(sweep, budget, [n_opt / step, n_opt, n_opt * step], tuned)


def plan_runs_at(sweep: Sweep, budget: float, sizes: list[float], tuned: Tuned | None
                 ) -> tuple[list[PlannedRun], list[str]]:
    """The family's shapes for ``sizes`` at ``budget`` (each once), as verify runs; refusals."""
    shapes, refused, _ = planner.family_shapes(sweep, sizes, f"verify at {budget:.3g}, ")
    runs = []
    for shape_name, target, shape, entry_launch in shapes:
        run = planner.planned_run(sweep, budget, shape_name, target, shape, entry_launch, tuned, role=ROLE,
                                  name=f"verify-C{format_flops(budget)}-{shape_name}")
        (refused if isinstance(run, str) else runs).append(run)
    return runs, refused


def extension(sweep: Sweep, budget: float, runs: list[tuple[PlannedRun, float]], tuned: Tuned | None
              ) -> list[PlannedRun] | str:
    """One more shape a size step beyond the edge run when the lowest of ``runs`` is at an edge (none when it is
    interior: the minimum is located), or the line refusing it."""
    ordered = sorted(runs, key=lambda rl: rl[0].params)
    i = min(range(len(ordered)), key=lambda k: ordered[k][1])
    if 0 < i < len(ordered) - 1:
        return []
    edge = ordered[i][0].params
    target = edge / size_step(sweep) if i == 0 else edge * size_step(sweep)
    planned, refused = plan_runs_at(sweep, budget, [target], tuned)
    if refused:
        return refused[0]
    known = {r.name for r, _ in runs}
    return [r for r in planned if r.name not in known]


@dataclass(frozen=True)
class Prediction:
    """What the fit predicts at the held-out budget."""

    budget: float
    approach: str  # the law N_opt comes from (the fit's preferred one)
    n_opt: float
    n_opt_ci: list[float] | None
    loss_opt: float | None  # L(N_opt, D_opt) of the parametric law
    loss_opt_ci: list[float] | None
    form: str = "chinchilla"  # the parametric law's form (lab.measure.laws)


@dataclass(frozen=True)
class RunOutcome:
    name: str
    params: int
    tokens: int
    loss: float
    predicted_loss: float
    predicted_loss_ci: list[float] | None


@dataclass(frozen=True)
class Verdict:
    prediction: Prediction
    runs: list[RunOutcome]
    n_opt: float  # achieved
    n_opt_located: bool  # the lowest run had a neighbour on each side
    best: str  # the run with the lowest loss
    loss_error: float  # (achieved - predicted) / predicted, for the best run
    n_opt_inside: bool
    loss_within: bool

    @property
    def verified(self) -> bool:
        return self.n_opt_inside and self.loss_within

    def to_dict(self) -> dict:
        return {**asdict(self), "verified": self.verified, "loss_tolerance": LOSS_TOLERANCE}


def prediction(doc: dict, budget: float) -> Prediction:
    """The fit's prediction at ``budget`` (fit.json's ``predictions`` entry for it)."""
    entry = next(p for p in doc["predictions"] if math.isclose(p["flops"], budget, rel_tol=1e-9))
    approach = doc["comparison"]["preferred"]
    alloc = entry[approach]
    a3 = entry.get("approach3") or {}
    return Prediction(budget=budget, approach=approach, n_opt=alloc["params"],
                      n_opt_ci=(alloc.get("ci") or {}).get("params"), loss_opt=a3.get("loss"),
                      loss_opt_ci=(a3.get("ci") or {}).get("loss"), form=doc["approach3"].get("form", "chinchilla"))


def judge(pred: Prediction, runs: list[tuple[PlannedRun, float]], theta: np.ndarray, thetas: np.ndarray | None,
          level: float) -> Verdict:
    """Achieved against predicted, from the finished verify runs and the parametric law's parameters in the
    prediction's form (pure)."""
    from lab.measure.laws import FORMS
    from analysis.parametric import predict_loss

    form = FORMS[pred.form]
    runs = sorted(runs, key=lambda rl: rl[0].params)
    n = np.array([r.params for r, _ in runs], float)
    d = np.array([r.tokens for r, _ in runs], float)
    losses = np.array([loss for _, loss in runs], float)
    predicted = predict_loss(theta, n, d, form)
    bands = None
    if thetas is not None:
        samples = predict_loss(thetas, n, d, form)
        tail = (1 - level) / 2
        bands = [list(np.nanquantile(samples[:, i], [tail, 1 - tail])) for i in range(len(runs))]
    outcomes = [RunOutcome(r.name, r.params, r.tokens, float(loss), float(p), None if bands is None else
                           [float(v) for v in bands[i]]) for i, ((r, loss), p) in enumerate(zip(runs, predicted))]
    i = int(np.argmin(losses))
    located = 0 < i < len(runs) - 1
    n_opt = n[i]
    if located:
        x = np.log(n[i - 1:i + 2])
        a, b, _ = np.polyfit(x, losses[i - 1:i + 2], 2)
        n_opt = float(np.exp(np.clip(-b / (2 * a), x[0], x[-1]))) if a > 0 else n[i]
    error = float((losses[i] - predicted[i]) / predicted[i])
    inside = pred.n_opt_ci is not None and pred.n_opt_ci[0] <= n_opt <= pred.n_opt_ci[1]
    return Verdict(prediction=pred, runs=outcomes, n_opt=float(n_opt), n_opt_located=located, best=runs[i][0].name,
                   loss_error=error, n_opt_inside=bool(inside and located), loss_within=abs(error) <= LOSS_TOLERANCE)


def _interval(ci: list[float] | None, fmt: str) -> str:
    return "" if ci is None else f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def describe(v: Verdict) -> list[str]:
    """The comparison as text lines (terminal and Markdown alike)."""
    p = v.prediction
    n_opt = f"{p.n_opt:,.0f}{_interval(p.n_opt_ci, ',.0f')}"
    lines = [f"prediction at C = {p.budget:.3g} ({p.approach} law; approach 3 in {p.form} form): N_opt = {n_opt}"
             + ("" if p.loss_opt is None else f", loss at the optimum {p.loss_opt:.4f}"
                f"{_interval(p.loss_opt_ci, '.4f')}"),
             "",
             "| run | N | D (tokens) | loss | predicted L(N, D) | error |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in v.runs:
        error = (r.loss - r.predicted_loss) / r.predicted_loss
        lines.append(f"| {r.name} | {r.params:,} | {r.tokens:,} | {r.loss:.4f} | {r.predicted_loss:.4f}"
                     f"{_interval(r.predicted_loss_ci, '.4f')} | {error:+.2%} |")
    where = ("vertex of the parabola through the three runs" if v.n_opt_located
             else "the lowest run is at an edge of the three: N_opt not located")
    lines += ["",
              f"achieved N_opt = {v.n_opt:,.0f} ({where}): "
              + ("inside" if v.n_opt_inside else "NOT inside") + " the predicted interval",
              f"best run {v.best}: loss {v.loss_error:+.2%} from its prediction: "
              + ("within" if v.loss_within else "NOT within") + f" {LOSS_TOLERANCE:.0%}",
              "verified" if v.verified else "NOT verified"]
    return lines


def record(folder: Path, registry: Registry, fit_dir: Path, v: Verdict) -> Path:
    """Write verify-C.json and .md, add the comparison to the fit's reports and to the registry; the .md's path."""
    tag = f"C{format_flops(v.prediction.budget)}"
    save_json(folder / FOLDER / f"verify-{tag}.json", v.to_dict())
    text = "\n".join(describe(v))
    section = f"\n## Verification at the held-out budget C = {v.prediction.budget:.3g}\n\n{text}\n"
    md = folder / FOLDER / f"verify-{tag}.md"
    write_atomic(md, f"# Predict, then verify: {tag}\n\nFit: {fit_dir / 'report.md'}\n{section}")
    report = fit_dir / "report.md"
    if report.is_file():
        write_atomic(report, report.read_text() + section)
    page = fit_dir / "report.html"
    if page.is_file() and "</body>" in (body := page.read_text()):
        block = (f"<h2>Verification at the held-out budget C = {v.prediction.budget:.3g}</h2>\n<pre>"
                 f"{html.escape(text)}</pre>\n")
        write_atomic(page, body.replace("</body>", block + "</body>", 1))
    registry.set_meta(f"verify {v.prediction.budget:.6g}", json.dumps(v.to_dict()))
    return md


def fit(folder: Path, budget: float, progress: bool, exclude: tuple[str, ...] = (),
        drop_highest_loss: int = 0, drop_outliers: bool = False, n_bootstrap: int = 1000) -> tuple[object, dict, Path]:
    """Fit the sweep's finished runs (less those ``exclude`` and ``drop_highest_loss`` leave out, as in
    ``python -m analysis fit``) with a prediction at ``budget`` and ``n_bootstrap`` resamples; with
    ``drop_outliers``, fit again without the runs the first fit flags as outliers. (FitResult, fit.json document,
    fit folder)."""
    from analysis.outputs import write_outputs
    from analysis.fit import FitConfig, fit_runs, fit_without_outliers
    from analysis.table import RunTable, load_runs

    config = FitConfig(predict=(budget,), progress=progress, workers=len(os.sched_getaffinity(0)), form="auto",
                       n_bootstrap=n_bootstrap)
    def load(flagged: tuple[str, ...]) -> RunTable:
        return load_runs(folder, exclude=exclude + flagged, drop_highest_loss=drop_highest_loss)

    if drop_outliers:
        result, flagged = fit_without_outliers(load, config)
        if flagged:
            print(f"dropped the {len(flagged)} run(s) the first fit flagged as outliers: {', '.join(flagged)}")
    else:
        result = fit_runs(load(()), config)
    doc = result.to_dict()
    out = folder / FOLDER / f"fit-C{format_flops(budget)}"
    write_outputs(result, doc, out)
    return result, doc, out
