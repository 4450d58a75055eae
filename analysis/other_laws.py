"""Other forms of L(N, D) than Chinchilla's, fitted beside approach 3 on request (``--law``).

- Kaplan et al. (2020), equation 1.5: L = ((N_c/N)^(alpha_N/alpha_D) + D_c/D)^alpha_D, no irreducible
  loss. Along C = kND its optimum is N_opt ~ C^a with a = alpha_D/(alpha_N + alpha_D).
- Muennighoff et al. (2023), the data-constrained law: L = E + A/N'^alpha + B/D'^beta, where repeated
  data and excess parameters count less. With U_D unique tokens, R_D = D/U_D - 1 repetitions and
  D' = U_D (1 + R_D* (1 - exp(-R_D/R_D*))); with U_N = min(N, the compute-optimal N for U_D tokens
  under the law's own allocation), R_N = N/U_N - 1 and N' = U_N (1 + R_N* (1 - exp(-R_N/R_N*))).
  It needs each run's unique tokens (a ``unique_tokens`` column); with U_D >= D and N <= U_N it is
  Chinchilla's form.

Both laws are ``lab.measure.laws``' and are fitted as approach 3 is, by the fitting engine (``analysis.robust``):
Huber loss (the same delta) of log-space residuals, summed over the runs, from the best points of a grid of starts
(the data-constrained law starts from approach 3's optimum). No bootstrap: these fits are for comparing forms,
approach 3 carries the intervals.
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy.optimize import OptimizeResult

from analysis import robust
from analysis.robust import HUBER_DELTA
from lab.measure.laws import KAPLAN, data_constrained_log_loss

LAWS = ("chinchilla", "kaplan", "data-constrained")
# Starts: N_c and D_c from 1e9 to 1e15 (Kaplan et al. report constants near 1e13 to 1e14), exponents 0.03 to 0.3.
KAPLAN_GRID = (np.log([1e9, 1e12, 1e15]), np.log([1e9, 1e12, 1e15]), (0.03, 0.08, 0.3), (0.03, 0.1, 0.3))
DATA_CONSTRAINED_GRID = ((2.0, 5.0, 15.0, 50.0), (1.0, 5.0, 20.0))  # R_D*, R_N*
_BEST_STARTS = 4


def law_line(section: dict) -> str:
    """One line on a fitted law (fit.json's ``law``) for the terminal and the report."""
    params = " ".join(f"{k}={v:.4g}" for k, v in section["params"].items())
    return (f"{section['form']} law: {params}, a={section['a']:.4g}; RMSE of log loss {section['rmse_log_loss']:.3g} "
            f"(approach 3: {section['approach3_rmse_log_loss']:.3g}); no bootstrap"
            + ("" if section["converged"] else "; NOT converged"))


def _fit(problem: robust.Problem, starts: list[np.ndarray]) -> OptimizeResult:
    """The engine from the ``_BEST_STARTS`` starts with the lowest objective; the best result."""
    with np.errstate(all="ignore"):
        values = np.array([robust.objective(problem, s)[0] for s in starts])
    order = np.argsort(np.where(np.isfinite(values), values, np.inf), kind="stable")[:_BEST_STARTS]
    return robust.fit(problem, [starts[i] for i in order])[0]


def _summary(form: str, params: dict, a: float | None, predicted_log: np.ndarray, log_loss: np.ndarray,
             objective: float, converged: bool, reference_rmse: float, delta: float) -> dict:
    return {"form": form, "params": params, "a": a, "b": None if a is None else 1.0 - a,
            "objective": objective, "converged": converged, "huber_delta": delta,
            "rmse_log_loss": float(np.sqrt(np.mean((predicted_log - log_loss) ** 2))),
            "approach3_rmse_log_loss": reference_rmse, "bootstrap": None}


def fit_kaplan(n: np.ndarray, d: np.ndarray, loss: np.ndarray, reference_rmse: float,
               delta: float = HUBER_DELTA) -> dict:
    """Kaplan's form fitted to the runs (see the module docstring)."""
    x, y, log_loss = np.log(n), np.log(d), np.log(loss)
    problem = robust.Problem(lambda theta: KAPLAN.log_loss_jac(theta, x, y), log_loss, delta,
                             bounds=([-np.inf, -np.inf, 1e-4, 1e-4], [np.inf, np.inf, 3.0, 3.0]))
    res = _fit(problem, [np.array(p, float) for p in itertools.product(*KAPLAN_GRID)])
    params = {k: float(v[0]) for k, v in KAPLAN.named(res.x[None]).items()}
    return _summary("kaplan", params, float(KAPLAN.allocation(res.x[None])[1][0]), problem.model(res.x)[0], log_loss,
                    float(res.cost), bool(res.success), reference_rmse, delta)


def fit_data_constrained(n: np.ndarray, d: np.ndarray, unique: np.ndarray, loss: np.ndarray, theta0: np.ndarray,
                         reference_rmse: float, delta: float = HUBER_DELTA) -> dict:
    """The data-constrained law fitted to the runs, from approach 3's theta0 and a grid of R_D*, R_N*."""
    def model(theta7: np.ndarray) -> tuple[np.ndarray, None]:
        with np.errstate(all="ignore"):
            return data_constrained_log_loss(theta7, n, d, unique), None

    log_loss = np.log(loss)
    problem = robust.Problem(model, log_loss, delta, analytic=False,
                             bounds=([-np.inf] * 3 + [1e-3] * 2 + [np.log(0.1)] * 2,
                                     [np.inf] * 3 + [3.0] * 2 + [np.log(1e4)] * 2))
    starts = [np.concatenate([theta0, np.log([r_d, r_n])]) for r_d, r_n in itertools.product(*DATA_CONSTRAINED_GRID)]
    res = _fit(problem, starts)
    a, b, e, alpha, beta, log_rd, log_rn = res.x
    params = {"E": float(np.exp(e)), "A": float(np.exp(a)), "B": float(np.exp(b)), "alpha": float(alpha),
              "beta": float(beta), "R_D*": float(np.exp(log_rd)), "R_N*": float(np.exp(log_rn))}
    return _summary("data-constrained", params, float(beta / (alpha + beta)), model(res.x)[0], log_loss,
                    float(res.cost), bool(res.success), reference_rmse, delta)
