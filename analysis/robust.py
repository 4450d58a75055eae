"""The analysis's one fitting engine: a robust loss on log-loss residuals, bounds, several starts and weighted refits
for the bootstrap, solved by ``scipy.optimize.least_squares`` (trust-region reflective, with the law's analytic
Jacobian where it has one, columns scaled by it).

A :class:`Problem` is a law's predicted log loss at theta for the fitted points, against their observed log loss. Its
objective is

    sum_i w_i * Huber_delta(r_i),   r_i = predicted - observed log loss of point i,

with w_i = 1, or a bootstrap resample's count of point i (a point drawn twice counts as two copies of it), and
Huber_delta(r) = r^2 / 2 within delta, delta (|r| - delta / 2) beyond: points far off the law pull linearly, not
quadratically. ``delta`` None is plain least squares. ``fit`` solves from every start and keeps the lowest
objective; ``refit`` solves each resample's weights from one theta (the full data's optimum, close to each
resample's). Approach 3 (``analysis.parametric``), the curve law (``analysis.curves``), the routed law
(``analysis.routed``) and Kaplan's and the data-constrained law (``analysis.other_laws``) are its callers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeResult, least_squares

HUBER_DELTA = 1e-3  # Hoffmann et al.'s threshold on log-loss residuals
TOLERANCE = 1e-12  # least_squares' xtol and gtol: the objective near an optimum is tiny (residuals near delta)
# least_squares' ftol, the relative decrease of the objective a step must exceed to go on: along the flat valleys of
# these laws a step of 1e-6 in the parameters changes the objective by ~1e-14 of itself, so 1e-12 stopped approach 3
# on the default sweep 1.2e-6 short of the optimum (benchmarks/refactor-fits)
OBJECTIVE_TOLERANCE = 1e-15
MAX_EVALUATIONS = 4000

Model = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]


@dataclass(frozen=True)
class Problem:
    """A law's predicted log loss and its Jacobian (None: differences taken numerically) at theta, for the fitted
    points, against their observed ``log_loss``; ``bounds`` on theta and ``scale`` as least_squares takes them
    (its x_scale: "jac" steps each coordinate by the inverse of its Jacobian column's norm, which suits laws whose
    coordinates act on very different scales, but lets a coordinate that barely moves the loss take huge steps: the
    point forms, whose exponents can run off to where a term vanishes, step in theta's own units)."""

    model: Model
    log_loss: np.ndarray
    delta: float | None = HUBER_DELTA
    bounds: tuple = (-np.inf, np.inf)
    analytic: bool = True  # whether ``model`` gives the Jacobian
    scale: str | float = 1.0


def huber(r: np.ndarray, delta: float) -> np.ndarray:
    """Huber_delta of each residual."""
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def objective(problem: Problem, theta: np.ndarray, weights: np.ndarray | None = None
              ) -> tuple[float, np.ndarray | None]:
    """The objective at theta and its gradient (None without an analytic Jacobian)."""
    predicted, jac = problem.model(np.asarray(theta, float))
    r = predicted - problem.log_loss
    delta = np.inf if problem.delta is None else problem.delta
    dh = np.clip(r, -delta, delta)  # Huber'(r); Huber(r) = dh (r - dh/2) on both branches
    wdh = dh if weights is None else dh * weights
    return float(np.dot(wdh, r - 0.5 * dh)), None if jac is None else (jac * wdh[:, None]).sum(axis=0)


class _Evaluated:
    """The model at the last theta asked for: least_squares asks for the residuals and then the Jacobian there."""

    def __init__(self, model: Model):
        self.model, self.theta, self.value = model, None, None

    def __call__(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        if self.theta is None or not np.array_equal(theta, self.theta):
            self.theta, self.value = np.array(theta), self.model(theta)
        return self.value


def _weighted_huber(weights: np.ndarray, delta: float) -> Callable[[np.ndarray], np.ndarray]:
    """least_squares' loss rho(z), z = r^2, with rho and its two derivatives, such that 0.5 sum rho = the objective."""
    def rho(z: np.ndarray) -> np.ndarray:
        inside = z <= delta * delta
        root = np.sqrt(np.where(inside, delta * delta, z))
        return weights * np.stack([np.where(inside, z, 2.0 * delta * root - delta * delta),
                                   np.where(inside, 1.0, delta / root),
                                   np.where(inside, 0.0, -0.5 * delta / root ** 3)])
    return rho


def solve(problem: Problem, start: np.ndarray, weights: np.ndarray | None = None) -> OptimizeResult:
    """The optimum reached from ``start`` (moved inside the bounds); ``cost`` is the objective there."""
    evaluated = _Evaluated(problem.model)
    if problem.delta is None:
        loss: str | Callable = "linear"
    elif weights is None:
        loss = "huber"
    else:
        loss = _weighted_huber(np.asarray(weights, float), problem.delta)
    start = np.clip(start, *problem.bounds)
    return least_squares(lambda theta: evaluated(theta)[0] - problem.log_loss, start,
                         jac=(lambda theta: evaluated(theta)[1]) if problem.analytic else "2-point",
                         bounds=problem.bounds, loss=loss,
                         f_scale=problem.delta if loss == "huber" else 1.0, x_scale=problem.scale, xtol=TOLERANCE,
                         ftol=OBJECTIVE_TOLERANCE, gtol=TOLERANCE, max_nfev=MAX_EVALUATIONS)


def fit(problem: Problem, starts: Sequence[np.ndarray], weights: np.ndarray | None = None
        ) -> tuple[OptimizeResult, np.ndarray]:
    """The lowest optimum reached from ``starts`` (each point's term times ``weights``, when given), and the objective
    each start reached (inf where not finite)."""
    results = [solve(problem, s, weights) for s in starts]
    costs = np.array([r.cost if np.isfinite(r.cost) else np.inf for r in results])
    return results[int(np.argmin(costs))], costs


def refit(problem: Problem, theta0: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row of ``weights`` (K, points), the optimum from theta0; returns thetas (K, P), converged (K,)."""
    thetas = np.empty((len(weights), len(theta0)))
    converged = np.empty(len(weights), bool)
    for k, w in enumerate(np.asarray(weights, float)):
        result = solve(problem, theta0, w)
        thetas[k], converged[k] = result.x, result.success
    return thetas, converged
