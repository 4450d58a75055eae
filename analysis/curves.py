"""The loss curve with the learning-rate schedule in it: Tissue et al. (2024), extended to model size.

At step s of a run of N parameters whose learning rate at step i is eta_i, its configured peak eta_max (train.lr),

    L(N, s) = E + (B / N^beta + A / S1(s))^alpha - C * S2(s) + K * exp(-S1(s) / tau)

- S1(s) = sum_{i <= s} eta_i / eta_max, the forward area in steps at the peak rate: how far the optimiser has moved;
- S2(s) = sum_{i <= s} m_i, m_i = lambda * m_{i-1} + (eta_{i-1} - eta_i) / eta_max, the annealing area: each drop of
  the learning rate lowers the loss, taking effect over about 1 / (1 - lambda) steps. As in the paper the drops count
  from the peak on (the warm-up's rises are no annealing), and lambda is fitted (the paper: about 0.999);
- K exp(-S1 / tau), the early transient: a model first learns the symbols' frequencies and their commonest pairs, a
  fast drop that no power of S1 follows. On the default sweep's byte-level one-layer models it is about 0.3-0.4
  nats fading over about 320-340 peak-rate steps; without it the first evals after warm-up were predicted 2-8 % high
  and the fit bent its power to reach them (``benchmarks/curves/README.md``).

Tissue et al. fit L0 + A S1^-alpha - C S2 per model size. Across sizes, this law joins the size and the area as
Kaplan et al. (2020) join N and D, inside one power: early in a run (A / S1 large) every size follows the same curve
A^alpha S1^-alpha, and each size leaves it for its own floor E + B^alpha N^(-alpha beta). That is what the lab's
default sweep shows (``benchmarks/curves/README.md``): at the same step, runs of 5k to 290k parameters sit on one
curve until the smaller ones flatten. The first extension, L0 = E + B / N^beta added to a shared A S1^-alpha, cannot
do that: it gives every size the same drop below its floor, and, fitted up to 1e12 FLOPs, missed the 2e12 runs' curves
by 1.9-9.9 %. The areas count in steps at the run's own peak rate because the sweep tunes the rate per size (its
peak falls about as N^-0.93): across sizes the absolute summed rate measures the rule, not progress, and with
absolute areas the same form missed the held-out runs by 2-29 %. So the peak rate's own effect is not in the law:
it predicts a run at the peak rate its sizes were fitted with; the schedule's shape (cosine, WSD, constant) is.

``fit_curves`` is a pure function of the curves (each run's N, its schedule and its (step, loss) points after
warm-up): starts on a grid of (beta, alpha, lambda), (B, A) by non-negative least squares on loss^(1/alpha), are
refined on log-loss residuals (Huber, scale ``HUBER_SCALE``) by the fitting engine (``analysis.robust``) with the
analytic Jacobian, and bootstrap resamples of whole runs are refitted from the optimum. ``predict`` gives the curve of
any (N, schedule, steps) with its interval. The law itself is ``lab.measure.laws`` (``CurvePoints``), which the training
loop's expectation (``lab.training.expect``) evaluates too.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from analysis import robust
from analysis.bootstrap import draw_weights, interval
from analysis.table import InputError, step_records
from lab.measure.laws import CURVE_LAW, CURVE_NAMES, Curve, CurvePoints, curve_named
from lab.runtime.files import read_json

HUBER_SCALE = 0.01  # log-loss residuals beyond this count linearly: eval-loss spikes weigh less
TRANSIENT_START = 0.1  # nats: where the fit starts K
TAU_QUANTILES = (0.1, 0.5)
GRID = {"beta": (0.5, 1.0, 1.5), "alpha": (0.1, 0.2, 0.4, 0.7), "lambda": (0.99, 0.995, 0.999)}
MIN_RUNS = 3


def schedule_lr(kind: str, peak: float, total_steps: int, warmup: float = 0.05, decay: float = 0.2,
                min_lr_ratio: float = 0.1) -> np.ndarray:
    """The lab's schedule (lab.training.schedule) as an array of every step's rate."""
    from lab.runtime.config import TrainConfig
    from lab.training.schedule import learning_rate, validate

    cfg = TrainConfig(lr=peak, schedule=kind, warmup=warmup, decay=decay, min_lr_ratio=min_lr_ratio)
    try:
        validate(cfg)
    except Exception as exc:
        raise InputError(str(exc)) from None
    if total_steps < 1:
        raise InputError(f"a schedule needs at least one step, got {total_steps}")
    return np.array([learning_rate(s, total_steps, cfg) for s in range(total_steps)])


def law_loss(theta: np.ndarray, curves: list[Curve]) -> np.ndarray:
    """The law at every point of ``curves``; theta in ``CURVE_THETA`` order."""
    return CurvePoints(curves).loss_jac(np.asarray(theta, float), jac=False)[0]


def _starts(design: CurvePoints, loss: np.ndarray) -> list[np.ndarray]:
    """The grid point of (beta, alpha, lambda) whose (B, A), by NNLS of loss^(1/alpha) on (N^-beta, 1/S1) with E, C
    and K small, has the smallest squared error of log loss; once with the transient's tau at each of
    ``TAU_QUANTILES`` of the points' S1 (a fit started with the transient too short can end with it switched off)."""
    best, best_err = None, np.inf
    for beta, alpha, lam in itertools.product(GRID["beta"], GRID["alpha"], GRID["lambda"]):
        features = np.column_stack([np.exp(-beta * design.log_n), design.inv_s1])
        (b, a), _ = nnls(features, loss ** (1.0 / alpha))
        theta = np.array([math.log(1e-3), math.log(max(b, 1e-8)), beta, math.log(max(a, 1e-8)), alpha,
                          math.log(1e-4), math.log(1.0 - lam), math.log(TRANSIENT_START), 0.0])
        err = float(np.sum((np.log(np.maximum(design.loss_jac(theta, jac=False)[0], 1e-12)) - np.log(loss)) ** 2))
        if err < best_err:
            best_err, best = err, theta
    return [np.concatenate([best[:-1], [math.log(float(np.quantile(design.s1, q)))]]) for q in TAU_QUANTILES]


_BOUNDS = (np.array([-10, -20, 0.01, -20, 0.01, -30, math.log(1e-5), -20, 0.0]),
           np.array([5, 60, 4.0, 60, 3.0, 10, math.log(0.5), 3.0, math.log(1e6)]))


def _problem(design: CurvePoints, log_loss: np.ndarray) -> robust.Problem:
    """The engine's problem: the law's log loss at every point, with its analytic Jacobian, against ``log_loss``."""
    def model(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        loss, jac = design.loss_jac(theta)
        floor = np.maximum(loss, 1e-12)
        return np.log(floor), jac * (1.0 / floor)[:, None]
    return robust.Problem(model, log_loss, HUBER_SCALE, _BOUNDS, scale="jac")


@dataclass
class CurveFit:
    """The fitted law, its resamples and how well it fits."""

    theta: np.ndarray
    thetas: np.ndarray | None  # (B, 7) bootstrap refits over whole runs
    converged: bool
    rmse_log_loss: float
    n_runs: int
    n_points: int
    level: float

    @property
    def params(self) -> dict[str, float]:
        return curve_named(self.theta)

    def ci(self) -> dict[str, list[float] | None] | None:
        if self.thetas is None:
            return None
        named = [curve_named(t) for t in self.thetas]
        return {k: interval(np.array([p[k] for p in named]), self.level) for k in CURVE_NAMES}

    def predict(self, params: float, lr: np.ndarray, steps: np.ndarray | None = None, peak: float = 0.0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(steps, loss, lo, hi) of a run of ``params`` with the rate ``lr`` at every step, at ``steps`` (1-based;
        default every step), the areas counted at ``peak`` (default the largest rate of ``lr``); lo and hi NaN without
        resamples."""
        steps = np.arange(1, len(lr) + 1) if steps is None else np.asarray(steps, int)
        probe = [Curve("predicted", float(params), np.asarray(lr, float), steps, np.zeros(len(steps)), peak=peak)]
        design = CurvePoints(probe)
        loss = design.loss_jac(self.theta, jac=False)[0]
        lo = hi = np.full(len(steps), np.nan)
        if self.thetas is not None:
            samples = np.array([design.loss_jac(t, jac=False)[0] for t in self.thetas])
            tail = 50.0 * (1.0 - self.level)
            lo, hi = np.nanpercentile(samples, [tail, 100.0 - tail], axis=0)
        return steps, loss, lo, hi

    def to_dict(self) -> dict:
        return {"law": CURVE_LAW, "params": self.params,
                "ci": self.ci(), "level": self.level, "converged": self.converged,
                "rmse_log_loss": self.rmse_log_loss, "n_runs": self.n_runs, "n_points": self.n_points,
                "bootstrap": None if self.thetas is None else len(self.thetas), "theta": list(self.theta),
                "resamples": None if self.thetas is None else self.thetas.tolist()}


def load_fit(doc: dict) -> CurveFit:
    """The CurveFit of a curves.json document (``python -m analysis curves``)."""
    try:
        fit = doc["fit"]
        if fit["law"] != CURVE_LAW:
            raise InputError(f"a curves law of another form ('{fit['law']}', not '{CURVE_LAW}'): fit it again")
        thetas = None if fit["resamples"] is None else np.array(fit["resamples"], float).reshape(-1, len(CURVE_NAMES))
        return CurveFit(theta=np.array(fit["theta"], float), thetas=thetas, converged=bool(fit["converged"]),
                        rmse_log_loss=float(fit["rmse_log_loss"]), n_runs=int(fit["n_runs"]),
                        n_points=int(fit["n_points"]), level=float(fit["level"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"not a curves.json written by 'python -m analysis curves': {exc}") from None


LOSS_KEYS = {"eval": "eval_loss", "train": "loss"}
# how a run logs more points of each loss: the option to raise
MORE_POINTS = {"eval": "log the held-out loss more often (train.eval_every; a sweep's [sweep] evals)",
               "train": "log the training loss more often (train.log_every)"}


def fit_curves(curves: list[Curve], n_bootstrap: int = 200, seed: int = 0, level: float = 0.95,
               loss_kind: str = "eval") -> CurveFit:
    """Fit the law to every point of ``curves`` (see the module docstring); bootstrap over whole runs.
    ``loss_kind`` (eval or train) names the loss the points are, for the advice when there are too few."""
    if len(curves) < MIN_RUNS or len({c.params for c in curves}) < 2:
        raise InputError(f"the curve law needs at least {MIN_RUNS} runs of at least 2 sizes, got {len(curves)} "
                         f"run(s) of {len({c.params for c in curves})} size(s)")
    short = [c.run_id for c in curves if len(c.steps) < 3]
    if short:
        raise InputError(f"{len(short)} run(s) have fewer than 3 {loss_kind}-loss points after warm-up "
                         f"({', '.join(short[:3])}): {MORE_POINTS[loss_kind]}")
    loss = np.concatenate([c.loss for c in curves])
    design = CurvePoints(curves)
    problem = _problem(design, np.log(loss))
    res, _ = robust.fit(problem, _starts(design, loss))
    thetas = None
    if n_bootstrap > 0:
        counts = draw_weights(len(curves), n_bootstrap, seed)  # each run's points count as often as the run is drawn
        thetas, _ = robust.refit(problem, res.x, np.repeat(counts, [len(c.steps) for c in curves], axis=1))
    rmse = float(np.sqrt(np.mean((np.log(design.loss_jac(res.x, jac=False)[0]) - np.log(loss)) ** 2)))
    return CurveFit(theta=res.x, thetas=thetas, converged=bool(res.success), rmse_log_loss=rmse,
                    n_runs=len(curves), n_points=len(loss), level=level)


MAX_FINAL_WIDTH = 0.1  # the widest interval of a fitted run's final loss, as a fraction of it, an identified law has
POINTS_PER_PARAMETER = 2


def identification(fit: CurveFit, curves: list[Curve]) -> list[str]:
    """Why the law fitted to ``curves`` is not identified by them (empty when it is): the fit did not converge, fewer
    than 3 sizes fix the power of N, fewer than 2 points per parameter, or (with resamples) a fitted run's final loss
    whose interval spans more than ``MAX_FINAL_WIDTH`` of it. On the default sweep's 55 curves up to 1e12 FLOPs
    (20 resamples) the widest is 1.8 %, though E's own interval spans four decades: the law is judged by what it
    predicts, as E and the size term trade off."""
    problems = [] if fit.converged else ["the least-squares fit did not converge"]
    sizes = len({c.params for c in curves})
    if sizes < 3:
        problems.append(f"{sizes} sizes (the power of N needs 3)")
    needed = POINTS_PER_PARAMETER * len(CURVE_NAMES)
    if fit.n_points < needed:
        problems.append(f"{fit.n_points} points for {len(CURVE_NAMES)} parameters (need {needed})")
    if fit.thetas is not None:
        def width(c: Curve) -> tuple[float, float, float, float]:
            _, loss, lo, hi = fit.predict(c.params, c.lr, np.array([len(c.lr)]), c.reference)
            return float((hi[0] - lo[0]) / loss[0]), float(loss[0]), float(lo[0]), float(hi[0])

        widest, curve = max((width(c), c) for c in curves)
        if widest[0] > MAX_FINAL_WIDTH:
            problems.append(f"the {fit.level:.0%} interval of {curve.run_id}'s final loss {widest[1]:.4g} is "
                            f"[{widest[2]:.4g}, {widest[3]:.4g}], {widest[0]:.0%} of it (> {MAX_FINAL_WIDTH:.0%})")
    return problems


def relative_errors(fit: CurveFit, curve: Curve) -> np.ndarray:
    """(predicted - observed) / observed at each point of ``curve``."""
    _, predicted, _, _ = fit.predict(curve.params, curve.lr, curve.steps, curve.reference)
    return (predicted - curve.loss) / curve.loss


def read_run(run_dir: Path, loss: str = "eval") -> tuple[Curve, dict]:
    """One run folder's curve (its ``loss`` points after warm-up) and facts for the report: run_id, params, flops,
    steps, schedule, peak lr. The schedule is rebuilt from config.json as lab.training.schedule runs it."""
    try:
        cfg = read_json(run_dir / "config.json")["train"]
        summary = read_json(run_dir / "summary.json")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{run_dir}: not a finished run folder (config.json, summary.json): "
                         f"{' '.join(str(exc).split())}") from None
    total = int(summary.get("total_steps") or cfg["tokens"] // cfg["batch_tokens"])
    lr = schedule_lr(cfg.get("schedule", "cosine"), float(cfg["lr"]), total, cfg.get("warmup", 0.05),
                     cfg.get("decay", 0.2), cfg.get("min_lr_ratio", 0.1))
    key, points = LOSS_KEYS[loss], {}
    for rec in step_records(run_dir / "metrics.jsonl"):
        value = rec.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            points[rec["step"]] = float(value)  # a resumed run logs a step again: the last record counts
    warmup = round(cfg.get("warmup", 0.05) * total)
    steps = np.array(sorted(s for s in points if warmup < s <= total), int)
    curve = Curve(run_dir.name, float(summary["params"]), lr, steps, np.array([points[s] for s in steps]),
                  cfg.get("schedule", "cosine"), float(cfg["lr"]))
    facts = {"run_id": run_dir.name, "params": curve.params, "flops": float(summary.get("flops") or 0.0),
             "steps": total, "schedule": curve.schedule, "lr": float(cfg["lr"]), "points": len(steps)}
    return curve, facts


def load_curves(paths: list[str | Path], loss: str = "eval") -> tuple[list[Curve], pd.DataFrame]:
    """Every finished run under ``paths`` (run folders, or sweep folders searched for summary.json)."""
    if loss not in LOSS_KEYS:
        raise InputError(f"--loss must be one of {', '.join(LOSS_KEYS)}, got '{loss}'")
    folders: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise InputError(f"no such folder: {path}")
        folders += [path] if (path / "summary.json").is_file() else sorted(p.parent for p in path.rglob("summary.json"))
    if not folders:
        raise InputError(f"no run folders (summary.json) in {', '.join(map(str, paths))}")
    read = [read_run(f, loss) for f in folders]
    return [c for c, _ in read], pd.DataFrame([facts for _, facts in read])


@dataclass(frozen=True)
class Request:
    """A curve to predict: a run of ``params`` on ``schedule`` for ``steps`` at peak rate ``lr``."""

    params: float
    schedule: str
    steps: int
    lr: float

    @staticmethod
    def parse(text: str) -> "Request":
        """``N,SCHEDULE,STEPS,LR``, e.g. ``1e5,wsd,4000,8e-3``."""
        parts = text.split(",")
        try:
            n, kind, steps, lr = parts
            request = Request(float(n), kind.strip(), int(float(steps)), float(lr))
        except ValueError:
            raise InputError(f"--predict takes N,SCHEDULE,STEPS,LR (e.g. 1e5,wsd,4000,8e-3), got '{text}'") from None
        if not (request.params > 0 and request.steps >= 1 and request.lr > 0):
            raise InputError(f"--predict '{text}': N, STEPS and LR must be positive")
        schedule_lr(request.schedule, request.lr, 1)  # refuses an unknown schedule before any work
        return request

    def lr_array(self) -> np.ndarray:
        return schedule_lr(self.schedule, self.lr, self.steps)


def held_out(facts: pd.DataFrame, condition: str | None) -> np.ndarray:
    """Which runs (rows of ``load_curves``'s facts) a pandas condition holds out; none without one."""
    if not condition:
        return np.zeros(len(facts), bool)
    try:
        held = np.asarray(facts.eval(condition), bool)
    except Exception as exc:
        raise InputError(f"--hold-out '{condition}': {' '.join(str(exc).split())}") from None
    if held.shape != (len(facts),) or held.all() or not held.any():
        raise InputError(f"--hold-out '{condition}' matches {int(held.sum()) if held.ndim else '?'} of {len(facts)} "
                         "runs: it must leave some runs to fit and some to predict")
    return held


def describe(doc: dict) -> list[str]:
    """What ``python -m analysis curves`` prints: the law with intervals, its fit, the held-out runs, predictions."""
    fit, ci = doc["fit"], doc["fit"]["ci"] or {}
    params = ", ".join(f"{k}={v:.4g}" + (f" [{ci[k][0]:.4g}, {ci[k][1]:.4g}]" if ci.get(k) else "")
                       for k, v in fit["params"].items())
    lines = [f"{fit['law']}: {params}",
             f"fitted {fit['n_points']} {doc['loss']}-loss points of {fit['n_runs']} runs after warm-up: RMSE of log "
             f"loss {fit['rmse_log_loss']:.3g}" + ("" if fit["converged"] else " (NOT converged)")
             + (f"; {fit['level']:.0%} intervals over {fit['bootstrap']} resamples of runs"
                if fit["bootstrap"] else "")]
    if fit.get("problems"):
        lines.append(f"warning [unidentified]: the curve law is not identified by these runs: "
                     f"{'; '.join(fit['problems'])}; its intervals and predictions are not to be trusted (more runs, "
                     f"sizes and evaluations pin it down)")
    for h in doc["holdout"] or []:
        lines.append(f"held out {h['run_id']} (N={h['params']:.3g}, {h['schedule']}): mean relative error "
                     f"{h['mean_rel_error']:.2%} over {h['points']} points (largest {h['max_rel_error']:.2%}, "
                     f"bias {h['bias']:+.2%})")
    for p in doc["predictions"]:
        lines.append(f"predicted N={p['params']:.3g}, {p['schedule']}, {p['steps']} steps, lr {p['lr']:.3g}: final "
                     f"loss {p['final_loss']:.4f}" + (f" [{p['final_ci'][0]:.4f}, {p['final_ci'][1]:.4f}]"
                                                     if p["final_ci"][0] is not None else ""))
    return lines


def holdout(fit: CurveFit, curves: list[Curve]) -> list[dict]:
    """Each held-out curve predicted: the mean and largest relative error over its points after warm-up."""
    out = []
    for c in curves:
        err = relative_errors(fit, c)
        out.append({"run_id": c.run_id, "params": c.params, "schedule": c.schedule, "points": len(c.steps),
                    "mean_rel_error": float(np.mean(np.abs(err))), "max_rel_error": float(np.max(np.abs(err))),
                    "bias": float(np.mean(err))})
    return out


def figure(fit: CurveFit, fitted: list[Curve], held: list[Curve]):
    """Observed (dots) against the law (lines) for every run, coloured by size (a colour bar, not a legend: sweeps have
    dozens of runs), held-out runs dashed; relative residuals along the steps below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.lines import Line2D

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True, height_ratios=(2, 1))
    sizes = [c.params for c in fitted + held]
    norm = LogNorm(min(sizes), max(sizes) * (1.01 if min(sizes) == max(sizes) else 1.0))
    cmap = plt.get_cmap("viridis")
    for c in fitted + held:
        colour, style = cmap(norm(c.params)), "--" if c in held else "-"
        steps, loss, lo, hi = fit.predict(c.params, c.lr, np.arange(max(1, int(c.steps[0])), len(c.lr) + 1),
                                          c.reference)
        top.plot(steps, loss, color=colour, ls=style, lw=1.6 if c in held else 0.9)
        if np.isfinite(lo).any():
            top.fill_between(steps, lo, hi, color=colour, alpha=0.15, lw=0)
        top.scatter(c.steps, c.loss, color=colour, s=6, marker="x" if c in held else "o")
        bottom.plot(c.steps, 100 * relative_errors(fit, c), color=colour, ls=style, lw=1.6 if c in held else 0.7)
    top.set(xscale="log", yscale="log", ylabel="loss (nats per token)",
            title="L(N, s) = E + (B/N^beta + A/S1)^alpha - C S2 + K exp(-S1/tau)\n(after Tissue et al. 2024)")
    bottom.axhline(0, color="black", lw=0.6)
    bottom.set(xscale="log", xlabel="step", ylabel="predicted - observed (%)")
    handles = [Line2D([], [], color="grey", ls="-", marker="o", ms=3, label=f"fitted ({len(fitted)} runs)")]
    if held:
        handles.append(Line2D([], [], color="grey", ls="--", marker="x", ms=4, label=f"held out ({len(held)} runs)"))
    top.legend(handles=handles, fontsize=8, loc="upper right")
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=[top, bottom], label="parameters N")
    return fig
