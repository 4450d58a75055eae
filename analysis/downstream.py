"""From loss to downstream task error (Gadre et al. 2024, "Language models scale reliably with over-training and
on downstream tasks"): a task's top-1 error follows the model's loss as error = ε − k·exp(−γ·L), saturating at ε
(chance) for a model that has learnt nothing and falling as the loss falls. Fitted on the runs that carry a task
column (``task_NAME`` scores from ``python -m lab eval``), it turns the compute-optimal loss predicted by the
scaling law into a predicted task score, with an interval from resampling the runs.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import curve_fit

from analysis.bootstrap import interval

MIN_RUNS = 4  # three parameters and at least one degree of freedom
GAMMAS = np.logspace(-2, 1.5, 60)  # starting points for γ, in 1/nats


def task_error(theta: np.ndarray, loss: np.ndarray | float) -> np.ndarray:
    """ε − k·exp(−γ·L) for theta = (ε, k, γ) (rows of thetas broadcast against losses)."""
    theta = np.asarray(theta, dtype=float)
    eps, k, gamma = (theta[..., i, None] if theta.ndim > 1 else theta[i] for i in range(3))
    return eps - k * np.exp(-gamma * np.asarray(loss, dtype=float))


def _linear_start(loss: np.ndarray, error: np.ndarray) -> np.ndarray:
    """For each γ of the grid, (ε, k) by least squares (the model is linear in them); the best triple."""
    best, start = np.inf, np.array([error.max(), 1.0, 1.0])
    for gamma in GAMMAS:
        design = np.column_stack([np.ones_like(loss), -np.exp(-gamma * loss)])
        (eps, k), *_ = np.linalg.lstsq(design, error, rcond=None)
        sse = float(np.sum((design @ [eps, k] - error) ** 2))
        if k > 0 and sse < best:
            best, start = sse, np.array([eps, k, gamma])
    return start


def fit_error(loss: np.ndarray, error: np.ndarray) -> np.ndarray:
    """(ε, k, γ) by least squares from a grid of starts; k and γ kept positive."""
    start = _linear_start(loss, error)
    try:
        theta, _ = curve_fit(lambda x, e, k, g: e - k * np.exp(-g * x), loss, error, p0=start,
                             bounds=([-np.inf, 0.0, 0.0], [np.inf, np.inf, np.inf]), maxfev=20_000)
    except RuntimeError:  # no convergence: the best linear start stands
        theta = start
    return np.asarray(theta, dtype=float)


def fit_task(loss: np.ndarray, score: np.ndarray, level: float = 0.95, n_boot: int = 200,
             seed: int = 0) -> dict:
    """The link from loss to a task's error (1 − score) on the runs that have both, with bootstrap intervals."""
    keep = np.isfinite(loss) & np.isfinite(score)
    loss, error = np.asarray(loss, float)[keep], 1.0 - np.asarray(score, float)[keep]
    if len(loss) < MIN_RUNS:
        return {"skipped": True, "reason": f"{len(loss)} run(s) with a score; the fit needs {MIN_RUNS}"}
    theta = fit_error(loss, error)
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, len(loss), len(loss)) for _ in range(n_boot)]
    thetas = np.array([fit_error(loss[i], error[i]) for i in draws if len(np.unique(loss[i])) >= 3])
    rmse = float(np.sqrt(np.mean((task_error(theta, loss) - error) ** 2)))
    return {"skipped": False, "runs": int(len(loss)), "eps": float(theta[0]), "k": float(theta[1]),
            "gamma": float(theta[2]), "rmse": rmse,
            "ci": {name: interval(thetas[:, i], level) for i, name in enumerate(("eps", "k", "gamma"))},
            "theta": theta, "thetas": thetas}


def predict_score(fit: dict, loss: float, loss_ci: list | None, level: float = 0.95) -> dict:
    """The task's score (1 − error) at ``loss``; its interval spans the resampled links at the loss and at both
    ends of the loss's own interval (the two uncertainties together, conservatively)."""
    score = float(1.0 - task_error(fit["theta"], loss))
    losses = [loss, *(loss_ci or [])[:2]]
    ends = [interval(1.0 - task_error(fit["thetas"], x)[:, 0], level) for x in losses if x is not None]
    return {"loss": loss, "score": score, "ci": [min(e[0] for e in ends), max(e[1] for e in ends)]}
