"""Approach 3: fit L(N, D) = E + A/N^alpha + B/D^beta as in Hoffmann et al. (2022), appendix D.

Every function takes a ``form`` (``lab.measure.laws``): Chinchilla's, described here, by default, or
``kaplan-e``, whose N and D terms interact, or ``shared``, one exponent for both; all are fitted the same way.

With theta = (a, b, e, alpha, beta), A = e^a, B = e^b, E = e^e, the objective is

    sum_i w_i * Huber_delta( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i ),  delta = 1e-3,

minimised by the analysis's fitting engine (``analysis.robust``: least squares with the Huber loss, trust-region
reflective with the form's analytic Jacobian). The paper starts L-BFGS from every point of a 4,500-point grid. Here
the objective is evaluated on the whole grid at once (vectorised over grid points and runs; on at most
``GRID_RUNS`` runs, since it only ranks starting points), and the engine runs only from the ``n_starts`` best grid
points; the best result is kept. Internally log N and log D are centred on their means, which leaves the minimiser
unchanged but makes a and alpha (b and beta) far less correlated. Convergence is reported, with how many starts
reached the best objective.

Whether the data pin the parameters down at all is measured by ``gauss_newton_condition``:
the condition number of J^T J, J the Jacobian of the predicted log loss with respect to theta
(centred, columns scaled to unit length). It is about 1e3 for IsoFLOP grids over several
budgets and above 1e8 when all runs share one budget or too few distinct N or D exist.

The compute-optimal allocation minimises L(N, D) along C = k N D: k = 6 by convention, or the
table's own k (``RunTable.flops_k``), so that approach 3 speaks of the same C as the data.

Bootstrap refits (``fit_weighted``) start from the full-data optimum instead of the grid: each
resample is a reweighting of the same runs, so its optimum lies close by.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from analysis import robust
from analysis.robust import HUBER_DELTA
from lab.measure.laws import CHINCHILLA, Form

# Each form's starting points (the product of these axes), in theta order.
START_GRIDS = {
    # Hoffmann et al.'s grid
    "chinchilla": (np.arange(0.0, 25.1, 5.0), np.arange(0.0, 25.1, 5.0), np.arange(-1.0, 1.01, 0.5),
                   np.arange(0.0, 2.01, 0.5), np.arange(0.0, 2.01, 0.5)),
    # N_c and D_c from 1e3 to 1e15, E from 0.37 to 2.7 nats, exponents 0.1 to 1
    "kaplan-e": (np.log([1e3, 1e6, 1e9, 1e12, 1e15]), np.log([1e3, 1e6, 1e9, 1e12, 1e15]), np.array([-1.0, 0.0, 1.0]),
                 np.array([0.1, 0.3, 1.0]), np.array([0.1, 0.3, 1.0])),
}
START_GRIDS["shared"] = START_GRIDS["chinchilla"][:4]
GRID_AXES = START_GRIDS["chinchilla"]
GRID_RUNS = 2000
# Starts agree when their objectives are within a relative 1e-6 of the best, or, where the best is near zero
# (noiseless data: 1e-18 to 1e-16), within this much per run absolutely: residuals of 1e-6 in log loss, far below
# any measured loss's precision, so a relative test there only compares rounding.
OBJECTIVE_ATOL_PER_RUN = 0.5 * 1e-6 ** 2


def problem(form: Form, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, delta: float = HUBER_DELTA
            ) -> robust.Problem:
    """The engine's problem of ``form`` at x = log N, y = log D (centred or not)."""
    return robust.Problem(lambda theta: form.log_loss_jac(theta, x, y), log_loss, delta)


def huber_lse_objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray,
                        weights: np.ndarray | None = None, delta: float = HUBER_DELTA, form: Form = CHINCHILLA
                        ) -> tuple[float, np.ndarray]:
    """Objective and gradient at theta, with x = log N, y = log D.

    The form's log loss is a log-sum-exp that subtracts its largest term, and the gradient uses the
    softmax weights of the terms, so neither overflows for any finite theta.
    """
    return robust.objective(problem(form, x, y, log_loss, delta), theta, weights)


def grid_objective(x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, delta: float = HUBER_DELTA,
                   chunk: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """Objective at every grid point at once: returns (points (G, 5), values (G,)).

    a - alpha*x depends only on (a, alpha) and b - beta*y only on (b, beta), so their
    exponentials are computed once per pair and combined by broadcasting; a per-run shift by the
    largest exponent keeps them finite. Runs are taken ``chunk`` at a time to bound memory.
    """
    a, b, e, alpha, beta = GRID_AXES
    values = np.zeros(np.prod([len(ax) for ax in GRID_AXES]))
    for lo in range(0, len(x), chunk):
        xs, ys, ls = x[lo:lo + chunk], y[lo:lo + chunk], log_loss[lo:lo + chunk]
        u1 = a[:, None, None] - alpha[None, :, None] * xs  # (a, alpha, run)
        u2 = b[:, None, None] - beta[None, :, None] * ys  # (b, beta, run)
        top = np.maximum(np.maximum(u1.max(axis=(0, 1)), u2.max(axis=(0, 1))), e.max())
        e1, e2, e3 = np.exp(u1 - top), np.exp(u2 - top), np.exp(e[:, None] - top)
        # Axes (a, b, e, alpha, beta, run), matching the theta order of the points below.
        total = (e1[:, None, None, :, None, :] + e2[None, :, None, None, :, :]) + e3[None, None, :, None, None, :]
        r = np.log(total) + (top - ls)
        values += robust.huber(r, delta).sum(axis=-1).ravel()
    points = np.stack([m.ravel() for m in np.meshgrid(*GRID_AXES, indexing="ij")], axis=1)
    return points, values


def _grid_values(form: Form, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, delta: float,
                 chunk: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """(points, objective at each): ``grid_objective`` for Chinchilla's form, the form's log loss otherwise."""
    if form is CHINCHILLA:
        return grid_objective(x, y, log_loss, delta)
    points = start_grid(form)
    values = np.zeros(len(points))
    for lo in range(0, len(x), chunk):
        r = form.log_loss(points, x[lo:lo + chunk], y[lo:lo + chunk]) - log_loss[lo:lo + chunk]
        values += robust.huber(r, delta).sum(axis=1)
    return points, np.where(np.isfinite(values), values, np.inf)


def start_grid(form: Form) -> np.ndarray:
    """Every starting point of ``form``, (G, P)."""
    return np.array(list(itertools.product(*START_GRIDS[form.name])), float)


@dataclass(frozen=True)
class Centring:
    """Shift of log N and log D by their means; maps theta to and from the centred coordinates."""

    x0: float
    y0: float
    form: Form = CHINCHILLA

    def to_centred(self, theta: np.ndarray) -> np.ndarray:
        return np.asarray(theta, float) - self._offset(theta)

    def from_centred(self, theta: np.ndarray) -> np.ndarray:
        return np.asarray(theta, float) + self._offset(theta)

    def _offset(self, theta: np.ndarray) -> np.ndarray:
        sx, sy = self.form.shift(theta)
        offset = np.zeros(self.form.size)
        offset[:2] = sx * self.x0, sy * self.y0
        return offset


@dataclass
class ParametricFit:
    """Fitted L(N, D) with the optimiser's diagnostics."""

    theta: np.ndarray  # the form's theta; Chinchilla's: (a, b, e, alpha, beta) = (log A, log B, log E, alpha, beta)
    objective: float
    converged: bool
    message: str
    n_evaluations: int  # of the model, by the winning start
    n_starts: int
    starts_agreeing: int  # starts that reached the best objective (relative 1e-6, or OBJECTIVE_ATOL_PER_RUN per run)
    best_start: np.ndarray  # the grid point the winning start
    form: Form = CHINCHILLA

    @property
    def params(self) -> dict[str, float]:
        return params_from_theta(self.theta, form=self.form)

    def params_at(self, flops_k: float) -> dict[str, float]:
        """Named parameters with the allocation along C = flops_k N D."""
        return params_from_theta(self.theta, flops_k, self.form)

    @property
    def optimum_inside_grid(self) -> bool:
        """Whether the optimum lies within the box spanned by the grid of starts."""
        return all(ax.min() <= v <= ax.max() for v, ax in zip(self.theta, START_GRIDS[self.form.name]))


def params_from_theta(theta: np.ndarray, flops_k: float = 6.0, form: Form = CHINCHILLA) -> dict[str, float]:
    """Named parameters of one theta (see named_samples); a, b, G, k_N, k_D are NaN unless the exponents are > 0."""
    return {k: float(v[0]) for k, v in named_samples(np.asarray(theta, float)[None], flops_k, form).items()}


def named_samples(thetas: np.ndarray, flops_k: float = 6.0, form: Form = CHINCHILLA) -> dict[str, np.ndarray]:
    """The form's named parameters and the allocation N_opt = G (C/k)^a, D_opt = (C/k)/N_opt for each row of thetas
    (K, P): a, b = 1 - a, G, and k_N, k_D such that N_opt = k_N C^a, D_opt = k_D C^b."""
    th = np.atleast_2d(np.asarray(thetas, float))
    log_g, a = form.allocation(th)
    with np.errstate(all="ignore"):
        k_n, k_d = np.exp(log_g - a * np.log(flops_k)), np.exp(-log_g - (1.0 - a) * np.log(flops_k))
        return {**form.named(th), "a": a, "b": 1.0 - a, "G": np.exp(log_g), "k_N": k_n, "k_D": k_d}


def predict_loss(thetas: np.ndarray, n: np.ndarray, d: np.ndarray, form: Form = CHINCHILLA) -> np.ndarray:
    """L(N, D) for each theta row (shape (K, P) or (P,)) at points n, d; broadcasts to (K, len(n))."""
    th = np.atleast_2d(np.asarray(thetas, float))
    x, y = np.log(np.asarray(n, float)), np.log(np.asarray(d, float))
    out = np.exp(form.log_loss(th, np.atleast_1d(x), np.atleast_1d(y)))
    return out if np.ndim(thetas) == 2 else out[0]


def rmse_log_loss(theta: np.ndarray, n: np.ndarray, d: np.ndarray, loss: np.ndarray, form: Form = CHINCHILLA
                  ) -> float:
    """Root mean square of log(loss) - log(L(N, D)) over the runs, for one theta."""
    return float(np.sqrt(np.mean((np.log(loss) - np.log(predict_loss(theta, n, d, form))) ** 2)))


def compute_optimal(thetas: np.ndarray, flops: np.ndarray, flops_k: float = 6.0, form: Form = CHINCHILLA
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N_opt = G (C/k)^a, D_opt = (C/k)/N_opt and L(N_opt, D_opt), each (K, len(flops)).

    NaN where an exponent is not positive (no compute-optimal allocation exists).
    """
    th = np.atleast_2d(np.asarray(thetas, float))
    log_c6 = np.log(np.atleast_1d(np.asarray(flops, float)) / flops_k)
    log_g, a = form.allocation(th)
    with np.errstate(all="ignore"):
        log_n = log_g[:, None] + a[:, None] * log_c6
        log_d = log_c6 - log_n
        loss = np.exp(form.log_loss(th, log_n, log_d))  # each row's theta at its own (K, len(flops)) points
    return np.exp(log_n), np.exp(log_d), loss


def fit_parametric(n: np.ndarray, d: np.ndarray, loss: np.ndarray, n_starts: int = 8,
                   delta: float = HUBER_DELTA, form: Form = CHINCHILLA, weights: np.ndarray | None = None
                   ) -> ParametricFit:
    """Fit L(N, D) to runs: grid of starts evaluated at once, the engine from the best ``n_starts``; ``weights``
    (one per run, e.g. ``RunTable.replicate_weights``) scale each run's term of the objective.

    Only choosing starts, the grid is evaluated on at most ``GRID_RUNS`` runs (every k-th, in C order).
    """
    x, y, log_loss = np.log(n), np.log(d), np.log(loss)
    every = np.argsort(x + y, kind="stable")[::max(1, -(-len(x) // GRID_RUNS))]
    points, values = _grid_values(form, x[every], y[every], log_loss[every], delta)
    order = np.argsort(values, kind="stable")[:max(1, n_starts)]
    centring = Centring(float(x.mean()), float(y.mean()), form)
    centred = problem(form, x - centring.x0, y - centring.y0, log_loss, delta)
    res, finals = robust.fit(centred, [centring.to_centred(points[i]) for i in order], weights)
    best = int(np.argmin(finals))
    tol = max(1e-6 * abs(finals[best]), OBJECTIVE_ATOL_PER_RUN * len(x))
    agreeing = int(np.sum(np.abs(finals - finals[best]) <= tol))
    return ParametricFit(theta=centring.from_centred(res.x), objective=float(res.cost),
                         converged=bool(res.success), message=str(res.message), n_evaluations=int(res.nfev),
                         n_starts=len(order), starts_agreeing=agreeing, best_start=points[order[best]], form=form)


def gauss_newton_condition(theta: np.ndarray, n: np.ndarray, d: np.ndarray, form: Form = CHINCHILLA) -> float:
    """Condition number of J^T J at theta (see the module docstring); inf when J is rank-deficient."""
    x, y = np.log(n), np.log(d)
    centring = Centring(float(x.mean()), float(y.mean()), form)
    _, jac = form.log_loss_jac(centring.to_centred(theta), x - centring.x0, y - centring.y0)
    norms = np.linalg.norm(jac, axis=0)
    if not np.all(norms > 0):
        return float("inf")
    singular = np.linalg.svd(jac / norms, compute_uv=False)
    return float((singular[0] / singular[-1]) ** 2) if singular[-1] > 0 else float("inf")


def fit_weighted(theta0: np.ndarray, n: np.ndarray, d: np.ndarray, loss: np.ndarray,
                 weights: np.ndarray, delta: float = HUBER_DELTA, form: Form = CHINCHILLA
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Refit for each row of ``weights`` (K, n_runs) from theta0; returns thetas (K, P), converged (K,)."""
    x, y = np.log(n), np.log(d)
    centring = Centring(float(x.mean()), float(y.mean()), form)
    centred = problem(form, x - centring.x0, y - centring.y0, np.log(loss), delta)
    thetas, converged = robust.refit(centred, centring.to_centred(np.asarray(theta0, float)), weights)
    return np.array([centring.from_centred(t) for t in thetas]).reshape(thetas.shape), converged
