"""Approach 3: fit L(N, D) = E + A/N^alpha + B/D^beta as in Hoffmann et al. (2022), appendix D.

With theta = (a, b, e, alpha, beta), A = e^a, B = e^b, E = e^e, the objective is

    sum_i w_i * Huber_delta( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i ),  delta = 1e-3,

minimised by L-BFGS. The paper starts L-BFGS from every point of a 4,500-point grid. Here the
objective is evaluated on the whole grid at once (vectorised over grid points and runs; on at
most ``GRID_RUNS`` runs, since it only ranks starting points), and L-BFGS (scipy, analytic
gradient, all runs) runs only from the ``n_starts`` best grid points; the best result is kept.
Internally log N and log D are centred on their means, which leaves the minimiser unchanged but
makes a and alpha (b and beta) far less correlated, so L-BFGS needs fewer iterations.
Convergence is reported, with how many starts reached the best objective.

Whether the data pin the five parameters down at all is measured by ``gauss_newton_condition``:
the condition number of J^T J, J the Jacobian of the predicted log loss with respect to theta
(centred, columns scaled to unit length). It is about 1e3 for IsoFLOP grids over several
budgets and above 1e8 when all runs share one budget or too few distinct N or D exist.

The compute-optimal allocation minimises L(N, D) along C = k N D: k = 6 by convention, or the
table's own k (``RunTable.flops_k``), so that approach 3 speaks of the same C as the data.

Bootstrap refits (``fit_weighted``) start from the full-data optimum instead of the grid: each
resample is a reweighting of the same runs, so its optimum lies close by, and L-BFGS runs in
coordinates preconditioned there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import OptimizeResult, minimize

HUBER_DELTA = 1e-3
# Hoffmann et al.'s grid of starting points, in theta order (a, b, e, alpha, beta).
GRID_AXES: tuple[np.ndarray, ...] = (
    np.arange(0.0, 25.1, 5.0),  # a
    np.arange(0.0, 25.1, 5.0),  # b
    np.arange(-1.0, 1.01, 0.5),  # e
    np.arange(0.0, 2.01, 0.5),  # alpha
    np.arange(0.0, 2.01, 0.5),  # beta
)
GRID_RUNS = 2000
# L-BFGS stopping: the objective is tiny (residuals near delta), so scipy's default relative
# tolerance on it (floored at an absolute 2.2e-9) stops far too early.
_LBFGS_OPTIONS = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 3000, "maxfun": 6000}
# Starts agree when their objectives are within a relative 1e-6 of the best, or, where the best is near zero
# (noiseless data: 1e-18 to 1e-16), within this much per run absolutely: residuals of 1e-6 in log loss, far below
# any measured loss's precision, so a relative test there only compares rounding.
OBJECTIVE_ATOL_PER_RUN = 0.5 * 1e-6 ** 2


def huber_lse_objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray,
                        weights: np.ndarray | None = None, delta: float = HUBER_DELTA
                        ) -> tuple[float, np.ndarray]:
    """Objective and gradient at theta = (a, b, e, alpha, beta), with x = log N, y = log D.

    The log-sum-exp subtracts the largest term and the gradient uses the softmax weights of the
    three terms, so neither overflows for any finite theta.
    """
    a, b, e, alpha, beta = theta
    u1 = a - alpha * x
    u2 = b - beta * y
    top = np.maximum(np.maximum(u1, u2), e)
    s1, s2, s3 = np.exp(u1 - top), np.exp(u2 - top), np.exp(e - top)
    total = s1 + s2 + s3
    r = top + np.log(total) - log_loss
    dh = np.clip(r, -delta, delta)  # Huber'(r); Huber(r) = dh (r - dh/2) on both branches
    wdh = dh if weights is None else dh * weights
    value = float(np.dot(wdh, r - 0.5 * dh))
    g = wdh / total
    g1, g2 = g * s1, g * s2
    grad = np.array([g1.sum(), g2.sum(), np.dot(g, s3), -np.dot(g1, x), -np.dot(g2, y)])
    return value, grad


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
        abs_r = np.abs(r)
        values += np.where(abs_r <= delta, 0.5 * r * r, delta * (abs_r - 0.5 * delta)).sum(axis=-1).ravel()
    points = np.stack([m.ravel() for m in np.meshgrid(*GRID_AXES, indexing="ij")], axis=1)
    return points, values


@dataclass(frozen=True)
class Centring:
    """Shift of log N and log D by their means; maps theta to and from the centred coordinates."""

    x0: float
    y0: float

    def to_centred(self, theta: np.ndarray) -> np.ndarray:
        a, b, e, alpha, beta = theta
        return np.array([a - alpha * self.x0, b - beta * self.y0, e, alpha, beta])

    def from_centred(self, theta: np.ndarray) -> np.ndarray:
        a, b, e, alpha, beta = theta
        return np.array([a + alpha * self.x0, b + beta * self.y0, e, alpha, beta])


@dataclass
class ParametricFit:
    """Fitted L(N, D) with the optimiser's diagnostics."""

    theta: np.ndarray  # (a, b, e, alpha, beta) = (log A, log B, log E, alpha, beta)
    objective: float
    converged: bool
    message: str
    n_iter: int
    n_starts: int
    starts_agreeing: int  # starts that reached the best objective (relative 1e-6, or OBJECTIVE_ATOL_PER_RUN per run)
    best_start: np.ndarray  # the grid point the winning L-BFGS run started from

    @property
    def params(self) -> dict[str, float]:
        return params_from_theta(self.theta)

    def params_at(self, flops_k: float) -> dict[str, float]:
        """Named parameters with the allocation along C = flops_k N D."""
        return params_from_theta(self.theta, flops_k)

    @property
    def optimum_inside_grid(self) -> bool:
        """Whether the optimum lies within the box spanned by the grid of starts."""
        return all(ax[0] <= v <= ax[-1] for v, ax in zip(self.theta, GRID_AXES))


def params_from_theta(theta: np.ndarray, flops_k: float = 6.0) -> dict[str, float]:
    """Named parameters of one theta (see named_samples); a, b, G, k_N, k_D are NaN unless alpha, beta > 0."""
    return {k: float(v[0]) for k, v in named_samples(np.asarray(theta, float)[None], flops_k).items()}


def named_samples(thetas: np.ndarray, flops_k: float = 6.0) -> dict[str, np.ndarray]:
    """E, A, B, alpha, beta and the allocation a = beta/(alpha+beta), b = alpha/(alpha+beta),
    G = (alpha A / (beta B))^(1/(alpha+beta)), k_N, k_D for each row of thetas (K, 5)."""
    th = np.asarray(thetas, float)
    alpha, beta = th[:, 3], th[:, 4]
    with np.errstate(all="ignore"):
        ok = (alpha > 0) & (beta > 0)
        s = np.where(ok, alpha + beta, np.nan)
        log_g = (np.log(np.where(ok, alpha, np.nan)) + th[:, 0]
                 - np.log(np.where(ok, beta, np.nan)) - th[:, 1]) / s
        a, b = beta / s, alpha / s
        # N_opt = G (C/k)^a = k_N C^a and D_opt = k_D C^b, comparable with the other approaches.
        k_n, k_d = np.exp(log_g - a * np.log(flops_k)), np.exp(-log_g - b * np.log(flops_k))
        return {"E": np.exp(th[:, 2]), "A": np.exp(th[:, 0]), "B": np.exp(th[:, 1]), "alpha": alpha,
                "beta": beta, "a": a, "b": b, "G": np.exp(log_g), "k_N": k_n, "k_D": k_d}


def predict_loss(thetas: np.ndarray, n: np.ndarray, d: np.ndarray) -> np.ndarray:
    """L(N, D) for each theta row (shape (K, 5) or (5,)) at points n, d; broadcasts to (K, len(n))."""
    th = np.atleast_2d(np.asarray(thetas, float))
    n, d = np.asarray(n, float), np.asarray(d, float)
    out = (np.exp(th[:, 2, None]) + np.exp(th[:, 0, None] - th[:, 3, None] * np.log(n))
           + np.exp(th[:, 1, None] - th[:, 4, None] * np.log(d)))
    return out if np.ndim(thetas) == 2 else out[0]


def compute_optimal(thetas: np.ndarray, flops: np.ndarray, flops_k: float = 6.0
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N_opt = G (C/k)^a, D_opt = G^-1 (C/k)^b and L(N_opt, D_opt), each (K, len(flops)).

    NaN where alpha or beta is not positive (no compute-optimal allocation exists).
    """
    th = np.atleast_2d(np.asarray(thetas, float))
    log_c6 = np.log(np.atleast_1d(np.asarray(flops, float)) / flops_k)
    alpha, beta = th[:, 3, None], th[:, 4, None]
    with np.errstate(all="ignore"):
        ok = (alpha > 0) & (beta > 0)
        s = np.where(ok, alpha + beta, np.nan)
        log_g = (np.log(np.where(ok, alpha, np.nan)) + th[:, 0, None]
                 - np.log(np.where(ok, beta, np.nan)) - th[:, 1, None]) / s
        n_opt = np.exp(log_g + beta / s * log_c6)
        d_opt = np.exp(-log_g + alpha / s * log_c6)
        loss = (np.exp(th[:, 2, None]) + np.exp(th[:, 0, None] - alpha * np.log(n_opt))
                + np.exp(th[:, 1, None] - beta * np.log(d_opt)))
    return n_opt, d_opt, loss


def _lbfgs(theta0: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray,
           weights: np.ndarray | None, delta: float) -> OptimizeResult:
    return minimize(huber_lse_objective, theta0, args=(x, y, log_loss, weights, delta), jac=True,
                    method="L-BFGS-B", options=_LBFGS_OPTIONS)


def fit_parametric(n: np.ndarray, d: np.ndarray, loss: np.ndarray, n_starts: int = 8,
                   delta: float = HUBER_DELTA) -> ParametricFit:
    """Fit L(N, D) to runs: grid of starts evaluated at once, L-BFGS from the best ``n_starts``.

    Only choosing starts, the grid is evaluated on at most ``GRID_RUNS`` runs (every k-th, in C order).
    """
    x, y, log_loss = np.log(n), np.log(d), np.log(loss)
    every = np.argsort(x + y, kind="stable")[::max(1, -(-len(x) // GRID_RUNS))]
    points, values = grid_objective(x[every], y[every], log_loss[every], delta)
    order = np.argsort(values, kind="stable")[:max(1, n_starts)]
    centring = Centring(float(x.mean()), float(y.mean()))
    xc, yc = x - centring.x0, y - centring.y0
    results = [_lbfgs(centring.to_centred(points[i]), xc, yc, log_loss, None, delta) for i in order]
    finals = np.array([r.fun if np.isfinite(r.fun) else np.inf for r in results])
    best = int(np.argmin(finals))
    res = results[best]
    tol = max(1e-6 * abs(finals[best]), OBJECTIVE_ATOL_PER_RUN * len(x))
    agreeing = int(np.sum(np.abs(finals - finals[best]) <= tol))
    return ParametricFit(theta=centring.from_centred(res.x), objective=float(res.fun),
                         converged=bool(res.success), message=str(res.message), n_iter=int(res.nit),
                         n_starts=len(order), starts_agreeing=agreeing, best_start=points[order[best]])


def _log_loss_jacobian(theta_c: np.ndarray, xc: np.ndarray, yc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Predicted log L and its Jacobian (runs, 5) at centred theta, for centred log N and log D."""
    a, b, e, alpha, beta = theta_c
    u1, u2 = a - alpha * xc, b - beta * yc
    top = np.maximum(np.maximum(u1, u2), e)
    s1, s2, s3 = np.exp(u1 - top), np.exp(u2 - top), np.exp(e - top)
    total = s1 + s2 + s3
    return top + np.log(total), np.stack([s1, s2, s3, -s1 * xc, -s2 * yc], axis=1) / total[:, None]


def gauss_newton_condition(theta: np.ndarray, n: np.ndarray, d: np.ndarray) -> float:
    """Condition number of J^T J at theta (see the module docstring); inf when J is rank-deficient."""
    x, y = np.log(n), np.log(d)
    centring = Centring(float(x.mean()), float(y.mean()))
    _, jac = _log_loss_jacobian(centring.to_centred(np.asarray(theta, float)), x - centring.x0, y - centring.y0)
    norms = np.linalg.norm(jac, axis=0)
    if not np.all(norms > 0):
        return float("inf")
    singular = np.linalg.svd(jac / norms, compute_uv=False)
    return float((singular[0] / singular[-1]) ** 2) if singular[-1] > 0 else float("inf")


def _preconditioner(theta_c: np.ndarray, xc: np.ndarray, yc: np.ndarray, log_loss: np.ndarray,
                    delta: float) -> np.ndarray:
    """T such that, with theta = theta_c + T z, the objective near theta_c is about isotropic in z.

    T = L^-T for L L^T = J^T diag(min(1, delta/|r|)) J, the curvature that iteratively reweighted
    least squares gives the Huber loss; the identity when that matrix is not positive definite.
    """
    predicted, jac = _log_loss_jacobian(theta_c, xc, yc)
    weights = np.minimum(1.0, delta / np.maximum(np.abs(predicted - log_loss), 1e-300))
    try:
        lower = np.linalg.cholesky(jac.T @ (jac * weights[:, None]))
    except np.linalg.LinAlgError:
        return np.eye(5)
    return np.linalg.inv(lower).T


def fit_weighted(theta0: np.ndarray, n: np.ndarray, d: np.ndarray, loss: np.ndarray,
                 weights: np.ndarray, delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Refit for each row of ``weights`` (K, n_runs) from theta0; returns thetas (K, 5), converged (K,).

    L-BFGS runs in coordinates preconditioned at theta0 (``_preconditioner``): resamples' optima lie
    close to it, and there this cuts the objective evaluations per refit two- to three-fold.
    """
    x, y, log_loss = np.log(n), np.log(d), np.log(loss)
    centring = Centring(float(x.mean()), float(y.mean()))
    xc, yc = x - centring.x0, y - centring.y0
    start = centring.to_centred(np.asarray(theta0, float))
    scale = _preconditioner(start, xc, yc, log_loss, delta)

    def objective(z: np.ndarray, *args: Any) -> tuple[float, np.ndarray]:
        value, grad = huber_lse_objective(start + scale @ z, *args)
        return value, scale.T @ grad

    thetas = np.empty((len(weights), 5))
    converged = np.empty(len(weights), bool)
    for k, w in enumerate(np.asarray(weights, float)):
        drawn = w > 0  # runs left out of a resample cost nothing
        res = minimize(objective, np.zeros(5), args=(xc[drawn], yc[drawn], log_loss[drawn], w[drawn], delta),
                       jac=True, method="L-BFGS-B", options=_LBFGS_OPTIONS)
        thetas[k] = centring.from_centred(start + scale @ res.x)
        converged[k] = res.success
    return thetas, converged
