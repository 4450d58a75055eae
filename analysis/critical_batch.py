"""The critical batch: steps and tokens to target losses, the frontier between them, and its laws.

McCandlish et al. (2018) found that the steps S and tokens E = B S a run needs to reach a given loss trade off along
one hyperbola, (S / S_min - 1)(E / E_min - 1) = 1, S_min the fewest steps (at an unbounded batch), E_min the fewest
tokens (at a vanishing one); with E = B S that is S(B) = S_min + E_min / B, and the critical batch B_crit = E_min /
S_min is where a run takes twice the fewest steps and twice the fewest tokens. Kaplan et al. (2020) fitted
B_crit(L) = B* L^(-1/alpha_B) (B* about 2e8 tokens and alpha_B about 0.21 on WebText2); Zhang et al. (2024) defined
it as the batch whose tokens to the target exceed the fewest by 20 % and found it grows with the data seen, hardly
with the model.

Everything here is a pure function of a table of evaluation points (``POINT_COLUMNS``: each run's held-out loss, and
the measured gradient noise scale where the run logs one, at its steps):

- ``crossings``: per run and target, the steps to it, read from the eval curve made monotone (isotonic regression:
  the best loss so far, with the noise of a constant rate pooled rather than its lucky dips taken), interpolated
  linearly in log steps between the two evaluations around the target; tokens E = B S;
- ``frontier_points`` and ``fit_frontier``: per size and target, each batch at the rate that got there in the fewest
  steps, and the hyperbola fitted by the analysis's one engine (``analysis.robust``) on log S, with a residual
  bootstrap (the runs have one seed: the scatter about the hyperbola is what can be resampled);
- ``fit_law``: log-linear laws of B_crit (Kaplan's of L; Zhang et al.'s decoupled one of E_min and N), refitted on
  the frontiers' resamples;
- ``compare``: a law's prediction at held-out sizes or losses against the batch measured there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy.optimize import isotonic_regression

from analysis import robust
from analysis.bootstrap import interval
from analysis.table import InputError

POINT_COLUMNS = ("run_id", "part", "params", "batch_tokens", "lr", "seed", "step", "eval_loss", "noise_scale")
GRID, HELD_OUT = "grid", "held-out"
MIN_BATCHES = 3  # the frontier has two parameters
ZHANG_OVERHEAD = 0.2  # Zhang et al.'s critical batch: 20 % more tokens than the fewest
FACTOR = 1.5  # the prediction is verified within this factor of the measured batch


class CriticalBatchError(InputError):
    """Input the analysis cannot use; the message is one line."""


# ---------------------------------------------------------------- steps to a target


def steps_to_target(steps: np.ndarray, losses: np.ndarray, target: float) -> float:
    """The step at which a loss curve first reaches ``target``, NaN when it never does or already had at its first
    point: the curve made non-increasing by isotonic regression, then interpolated linearly in log step between the
    last point above the target and the first at or below it."""
    order = np.argsort(steps)
    s, y = np.asarray(steps, float)[order], np.asarray(losses, float)[order]
    if len(s) == 0:
        return math.nan
    fitted = isotonic_regression(y, increasing=False).x
    below = np.flatnonzero(fitted <= target)
    if len(below) == 0 or below[0] == 0:
        return math.nan
    i = below[0]
    share = (fitted[i - 1] - target) / (fitted[i - 1] - fitted[i])
    return float(np.exp(np.log(s[i - 1]) + share * (np.log(s[i]) - np.log(s[i - 1]))))


def _at_step(steps: np.ndarray, values: np.ndarray, step: float) -> float:
    """``values`` interpolated linearly in log step at ``step`` (NaN without values or outside them)."""
    keep = np.isfinite(values) & (steps > 0)
    if not keep.any() or not math.isfinite(step):
        return math.nan
    s, v = steps[keep], values[keep]
    order = np.argsort(s)
    s, v = s[order], v[order]
    if step < s[0] or step > s[-1]:
        return math.nan
    return float(np.interp(np.log(step), np.log(s), v))


def crossings(points: pd.DataFrame, targets: dict[str, list[float]]) -> pd.DataFrame:
    """Per run and target of its part: steps S and tokens E to the target (NaN: not reached, or reached before the
    first evaluation, ``status`` says which) and the noise scale at S (NaN where not measured)."""
    rows = []
    for run_id, run in points.groupby("run_id", sort=True):
        first = run.iloc[0]
        evals = run[np.isfinite(run["eval_loss"])]
        steps, losses = evals["step"].to_numpy(float), evals["eval_loss"].to_numpy(float)
        for target in targets.get(first["part"], []):
            s = steps_to_target(steps, losses, target)
            status = "reached" if math.isfinite(s) else (
                "not reached" if len(losses) == 0 or np.min(losses) > target else "before the first evaluation")
            noise = _at_step(run["step"].to_numpy(float), run["noise_scale"].to_numpy(float), s)
            rows.append({"run_id": run_id, "part": first["part"], "params": first["params"],
                         "batch_tokens": first["batch_tokens"], "lr": first["lr"], "seed": first["seed"],
                         "target": target, "steps": s, "tokens": s * first["batch_tokens"], "status": status,
                         "noise_scale": noise})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- the frontier


@dataclass
class FrontierPoints:
    """One size and target: each batch at its best rate (the fewest steps to the target)."""

    part: str
    params: float
    target: float
    batch: np.ndarray
    steps: np.ndarray
    lr: np.ndarray
    lr_at_edge: np.ndarray  # the best rate is the lowest or highest tried at that batch
    noise_scale: np.ndarray  # at the best run's crossing; NaN where not measured


def frontier_points(table: pd.DataFrame, part: str, params: float, target: float) -> FrontierPoints:
    """The best rate of each batch at one size and target (a rate's seeds averaged in log steps); batches where no
    rate reached the target are left out."""
    mine = table[(table["part"] == part) & (table["params"] == params) & (table["target"] == target)]
    rows = []
    for batch, group in mine.groupby("batch_tokens", sort=True):
        by_lr = group.groupby("lr")["steps"].apply(lambda s: float(np.exp(np.mean(np.log(s)))))
        reached = by_lr[np.isfinite(by_lr.to_numpy())]
        if reached.empty:
            continue
        best = float(reached.idxmin())
        rates = sorted(group["lr"].unique())
        edge = len(rates) > 1 and best in (rates[0], rates[-1])
        noise = group.loc[group["lr"] == best, "noise_scale"].to_numpy(float)
        rows.append((float(batch), float(reached.min()), best, edge,
                     float(np.nanmedian(noise)) if np.isfinite(noise).any() else math.nan))
    b, s, lr, edge, noise = (np.array(c) for c in zip(*rows)) if rows else [np.array([])] * 5
    return FrontierPoints(part, float(params), float(target), b.astype(float), s.astype(float), lr.astype(float),
                          edge.astype(bool), noise.astype(float))


def _frontier_model(inverse_batch: np.ndarray):
    """log S = log(S_min + E_min / B) at theta = (log S_min, log E_min), with its Jacobian."""
    def model(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s_min, e_min = np.exp(theta)
        steps = s_min + e_min * inverse_batch
        return np.log(steps), np.column_stack([s_min / steps, e_min * inverse_batch / steps])
    return model


def _frontier_starts(batch: np.ndarray, steps: np.ndarray) -> list[np.ndarray]:
    """Least squares of S on 1/B (kept positive), and the two ends' own estimates."""
    design = np.column_stack([np.ones_like(batch), 1.0 / batch])
    s_min, e_min = np.linalg.lstsq(design, steps, rcond=None)[0]
    floor = steps.min() / 100
    return [np.log([max(s_min, floor), max(e_min, floor * batch.min())]),
            np.log([steps.min() / 2, steps.max() * batch.min() / 2])]


@dataclass
class Frontier:
    """The hyperbola S = S_min + E_min / B at one size and target, with resamples of (log S_min, log E_min)."""

    points: FrontierPoints
    theta: np.ndarray  # (log S_min, log E_min)
    samples: np.ndarray  # (K, 2)
    rmse_log: float
    level: float
    zhang: float  # the batch whose tokens exceed the fewest measured by ZHANG_OVERHEAD (NaN beyond the batches)
    zhang_samples: np.ndarray
    notes: list[str] = field(default_factory=list)

    @property
    def s_min(self) -> float:
        return float(np.exp(self.theta[0]))

    @property
    def e_min(self) -> float:
        return float(np.exp(self.theta[1]))

    @property
    def b_crit(self) -> float:
        return self.e_min / self.s_min

    def b_crit_samples(self) -> np.ndarray:
        return np.exp(self.samples[:, 1] - self.samples[:, 0])

    def ci(self, values: np.ndarray) -> list[float] | None:
        return interval(values, self.level)


def zhang_batch(batch: np.ndarray, tokens: np.ndarray, overhead: float = ZHANG_OVERHEAD) -> float:
    """Zhang et al.'s critical batch: going up from the batch with the fewest tokens, where the tokens first exceed
    that fewest by ``overhead`` (interpolated linearly in log tokens against log batch); NaN when no batch does."""
    order = np.argsort(batch)
    b, e = batch[order], tokens[order]
    start = int(np.argmin(e))
    limit = e[start] * (1 + overhead)
    above = np.flatnonzero(e[start:] > limit)
    if len(above) == 0:
        return math.nan
    i = start + above[0]
    share = (np.log(limit) - np.log(e[i - 1])) / (np.log(e[i]) - np.log(e[i - 1]))
    return float(np.exp(np.log(b[i - 1]) + share * (np.log(b[i]) - np.log(b[i - 1]))))


def resample_indices(n: int, n_resamples: int, seed: int) -> np.ndarray:
    """(K, n) indices drawn with replacement; the same for every frontier of n points, so that the targets' and
    sizes' resamples stay paired (a law refitted on resample k uses every frontier's resample k)."""
    return np.random.default_rng([seed, n]).integers(0, n, size=(n_resamples, n))


def fit_frontier(points: FrontierPoints, n_resamples: int = 1000, seed: int = 0, level: float = 0.95) -> Frontier:
    """The hyperbola through ``points`` by least squares on log S (the engine, ``analysis.robust``), and a residual
    bootstrap: the fitted log S plus residuals drawn with replacement (scaled by sqrt(n / (n - 2))), refitted."""
    n = len(points.batch)
    if n < MIN_BATCHES:
        raise CriticalBatchError(f"size {points.params:,.0f} at target {points.target:g}: {n} batch(es) reached it, "
                                 f"the frontier needs {MIN_BATCHES} or more")
    model = _frontier_model(1.0 / points.batch)
    log_s = np.log(points.steps)
    best, _ = robust.fit(robust.Problem(model, log_s, delta=None), _frontier_starts(points.batch, points.steps))
    fitted = model(best.x)[0]
    residuals = (log_s - fitted) * math.sqrt(n / (n - 2)) if n > 2 else np.zeros(n)
    samples, zhang = np.empty((n_resamples, 2)), np.empty(n_resamples)
    for k, idx in enumerate(resample_indices(n, n_resamples, seed)):
        drawn = fitted + residuals[idx]
        samples[k] = robust.solve(robust.Problem(model, drawn, delta=None), best.x).x
        zhang[k] = zhang_batch(points.batch, points.batch * np.exp(drawn))
    frontier = Frontier(points, best.x, samples, float(np.sqrt(np.mean((log_s - fitted) ** 2))), level,
                        zhang_batch(points.batch, points.batch * points.steps), zhang)
    frontier.notes += _frontier_notes(frontier)
    return frontier


def _frontier_notes(f: Frontier) -> list[str]:
    """What limits a frontier: a critical batch outside the batches tried, best rates at the rate grid's edge."""
    p, notes = f.points, []
    where = f"size {p.params:,.0f}, target {p.target:g}"
    if not p.batch.min() / 2 <= f.b_crit <= 2 * p.batch.max():
        notes.append(f"{where}: B_crit {f.b_crit:.3g} lies beyond the batches tried ({p.batch.min():g}-"
                     f"{p.batch.max():g}); the frontier extrapolates")
    edges = p.batch[p.lr_at_edge]
    if len(edges):
        notes.append(f"{where}: the best rate is at the edge of the rates tried at batch(es) "
                     f"{', '.join(f'{b:g}' for b in edges)}: their steps may be too many")
    return notes


# ---------------------------------------------------------------- laws of B_crit


@dataclass
class Law:
    """log B_crit = X theta: a linear law in logs, fitted by the engine, with resamples of theta."""

    name: str
    columns: list[str]  # what each entry of theta multiplies
    theta: np.ndarray
    samples: np.ndarray
    rmse_log: float
    n: int
    level: float

    def predict(self, row: np.ndarray, samples: bool = False) -> np.ndarray | float:
        """B_crit at one design row (or each resample's)."""
        return np.exp(self.samples @ row) if samples else float(np.exp(self.theta @ row))


def fit_law(name: str, columns: list[str], design: np.ndarray, log_b: np.ndarray, log_b_samples: np.ndarray,
            level: float = 0.95) -> Law:
    """log B_crit = design @ theta by least squares (the engine, ``analysis.robust``), refitted on each resample's
    log B_crit (``log_b_samples``, (K, n): the frontiers' paired resamples), resamples that are not finite left out."""
    if len(log_b) < design.shape[1] + 1:
        raise CriticalBatchError(f"the law {name} has {design.shape[1]} parameters and {len(log_b)} critical "
                                 f"batch(es): it needs at least {design.shape[1] + 1}")
    def model(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return design @ theta, design
    start = np.linalg.lstsq(design, log_b, rcond=None)[0]
    best = robust.solve(robust.Problem(model, log_b, delta=None), start)
    keep = np.all(np.isfinite(log_b_samples), axis=1)
    samples = np.array([robust.solve(robust.Problem(model, row, delta=None), best.x).x
                        for row in log_b_samples[keep]]).reshape(-1, design.shape[1])
    rmse = float(np.sqrt(np.mean((design @ best.x - log_b) ** 2)))
    return Law(name, columns, best.x, samples, rmse, len(log_b), level)


def kaplan_law(frontiers: list[Frontier], level: float = 0.95) -> Law:
    """B_crit(L) = B* L^(-1/alpha_B): theta = (log B*, -1/alpha_B)."""
    design = np.column_stack([np.ones(len(frontiers)), np.log([f.points.target for f in frontiers])])
    return fit_law("B_crit = B* L^(-1/alpha_B)", ["log B*", "-1/alpha_B"], design, _log_b(frontiers),
                   _log_b_samples(frontiers), level)


def zhang_law(frontiers: list[Frontier], level: float = 0.95) -> Law:
    """Zhang et al.'s decoupled form, B_crit = B_0 (E_min / 1e6)^b_D (N / 1e4)^b_N, E_min the tokens the target
    takes at the smallest batches (the data seen); without N's column when the frontiers have one size."""
    e_min = np.log([f.e_min / 1e6 for f in frontiers])
    sizes = np.log([f.points.params / 1e4 for f in frontiers])
    columns = ["log B_0", "b_D (tokens)"] + (["b_N (size)"] if len(set(sizes)) > 1 else [])
    design = np.column_stack([np.ones(len(frontiers)), e_min] + ([sizes] if len(columns) == 3 else []))
    # each resample's E_min moves with its B_crit: the design is the full data's, the response resampled
    return fit_law("B_crit = B_0 (E_min / 1e6)^b_D (N / 1e4)^b_N", columns, design, _log_b(frontiers),
                   _log_b_samples(frontiers), level)


def _log_b(frontiers: list[Frontier]) -> np.ndarray:
    return np.log([f.b_crit for f in frontiers])


def _log_b_samples(frontiers: list[Frontier]) -> np.ndarray:
    return np.column_stack([np.log(f.b_crit_samples()) for f in frontiers])


def loss_row(loss: float) -> np.ndarray:
    """Kaplan's law's design row at a loss."""
    return np.array([1.0, math.log(loss)])


# ---------------------------------------------------------------- predict, then verify


def compare(law: Law, measured: list[Frontier]) -> list[dict]:
    """Kaplan's law at each held-out frontier's target against the batch measured there, both with intervals;
    ``within``: the measured batch is within ``FACTOR`` of the predicted one."""
    out = []
    for f in measured:
        row = loss_row(f.points.target)
        predicted = law.predict(row)
        ratio = f.b_crit / predicted
        out.append({"params": f.points.params, "target": f.points.target, "predicted": predicted,
                    "predicted_ci": interval(law.predict(row, samples=True), law.level), "measured": f.b_crit,
                    "measured_ci": f.ci(f.b_crit_samples()), "ratio": ratio,
                    "within": bool(1 / FACTOR <= ratio <= FACTOR)})
    return out


def trade(b_crit: float, batch: float) -> tuple[float, float]:
    """On the frontier, the steps and tokens a run at ``batch`` takes, as multiples of S_min and E_min."""
    return 1 + b_crit / batch, 1 + batch / b_crit


# ---------------------------------------------------------------- the whole analysis


def check_points(points: pd.DataFrame, targets: dict[str, list[float]]) -> None:
    """CriticalBatchError (one line) for a table the analysis cannot use, before any fit."""
    missing = [c for c in POINT_COLUMNS if c not in points.columns]
    if missing:
        raise CriticalBatchError(f"the table lacks column(s) {', '.join(missing)} (known: {', '.join(POINT_COLUMNS)})")
    if not targets.get(GRID):
        raise CriticalBatchError("no target losses for the grid: give --targets (a sweep folder's "
                                 "critical_batch.json names them)")
    grid = points[points["part"] == GRID]
    batches = grid["batch_tokens"].nunique()
    if batches < MIN_BATCHES:
        raise CriticalBatchError(f"the grid's runs have {batches} batch size(s); the frontier needs {MIN_BATCHES} "
                                 f"or more")
    for part, losses in targets.items():
        evals = points.loc[(points["part"] == part), "eval_loss"].to_numpy(float)
        lowest = np.nanmin(evals) if np.isfinite(evals).any() else math.inf
        unreached = [t for t in losses if t < lowest]
        if unreached:
            raise CriticalBatchError(f"target {unreached[0]:g} is reached by no run of the {part} part (its lowest "
                                     f"held-out loss is {lowest:.4g}): train longer or aim higher")


def analyse(points: pd.DataFrame, targets: dict[str, list[float]], n_resamples: int = 1000, seed: int = 0,
            level: float = 0.95) -> dict:
    """Crossings, a frontier per part, size and target, the laws fitted to the grid's frontiers and their
    predictions at the held-out ones, as a JSON-ready document (``check_points`` first)."""
    check_points(points, targets)
    table = crossings(points, targets)
    frontiers, warnings = [], []
    for (part, params), group in table.groupby(["part", "params"], sort=True):
        for target in sorted(group["target"].unique(), reverse=True):
            try:
                frontiers.append(fit_frontier(frontier_points(table, part, params, target), n_resamples, seed, level))
            except CriticalBatchError as e:
                warnings.append(f"left out: {e}")
    grid = [f for f in frontiers if f.points.part == GRID]
    if len(grid) < 2:
        raise CriticalBatchError(f"{len(grid)} frontier(s) of the grid could be fitted; the laws need 2 or more "
                                 f"(targets reached by {MIN_BATCHES} or more batches)")
    laws = {"loss": kaplan_law(grid, level), "tokens_size": zhang_law(grid, level)} if len(grid) >= 3 else \
        {"loss": kaplan_law(grid, level)}
    warnings += [note for f in frontiers for note in f.notes]
    held = [f for f in frontiers if f.points.part == HELD_OUT]
    return {"level": level, "resamples": n_resamples, "targets": targets,
            "crossings": table.to_dict(orient="records"),
            "frontiers": [_frontier_doc(f) for f in frontiers],
            "laws": {key: _law_doc(law, grid) for key, law in laws.items()},
            "prediction": compare(laws["loss"], held) if held else [], "warnings": warnings}


def _frontier_doc(f: Frontier) -> dict:
    p = f.points
    noise = p.noise_scale[np.isfinite(p.noise_scale)]
    return {"part": p.part, "params": p.params, "target": p.target,
            "points": [{"batch": b, "steps": s, "tokens": b * s, "lr": lr, "lr_at_edge": bool(edge),
                        "noise_scale": None if not math.isfinite(ns) else ns}
                       for b, s, lr, edge, ns in zip(p.batch, p.steps, p.lr, p.lr_at_edge, p.noise_scale)],
            "s_min": f.s_min, "s_min_ci": f.ci(np.exp(f.samples[:, 0])), "e_min": f.e_min,
            "e_min_ci": f.ci(np.exp(f.samples[:, 1])), "b_crit": f.b_crit, "b_crit_ci": f.ci(f.b_crit_samples()),
            "zhang_batch": None if not math.isfinite(f.zhang) else f.zhang,
            "zhang_ci": f.ci(f.zhang_samples), "zhang_beyond": int(np.sum(~np.isfinite(f.zhang_samples))),
            "noise_scale": float(np.median(noise)) if len(noise) else None, "rmse_log_steps": f.rmse_log}


def _law_doc(law: Law, frontiers: list[Frontier]) -> dict:
    named = {c: float(v) for c, v in zip(law.columns, law.theta)}
    cis = {c: interval(law.samples[:, i], law.level) for i, c in enumerate(law.columns)}
    doc = {"form": law.name, "columns": law.columns, "theta": [float(v) for v in law.theta], "values": named,
           "ci": cis, "rmse_log": law.rmse_log, "n": law.n, "samples": law.samples.tolist(),
           "losses": [min(f.points.target for f in frontiers), max(f.points.target for f in frontiers)]}
    if law.columns[0] == "log B*":
        alpha = -1 / law.samples[:, 1]
        doc.update(B_star=math.exp(law.theta[0]), B_star_ci=interval(np.exp(law.samples[:, 0]), law.level),
                   alpha_B=-1 / law.theta[1], alpha_B_ci=interval(alpha, law.level))
    return doc


def at_loss(law_doc: dict, loss: float) -> tuple[float, list[float] | None]:
    """A critical_batch.json law of the loss (``laws.loss``) at ``loss``: B_crit and its interval."""
    row = loss_row(loss)
    samples = np.array(law_doc["samples"], float).reshape(-1, 2)
    level = law_doc.get("level", 0.95)
    return float(np.exp(np.array(law_doc["theta"], float) @ row)), interval(np.exp(samples @ row), level)
