"""The laws of loss the lab fits and predicts with, each written once: numpy only (scipy.signal where the curve
law's areas need it, imported there), nothing of training, the analysis or the command line, so that the fits
(``analysis``) and the training run's expectation (``lab.training.expect``) evaluate the same code.

Point forms L(N, D), each with its parameters theta:

- ``chinchilla`` (Hoffmann et al. 2022): L = E + A/N^alpha + B/D^beta, theta = (log A, log B, log E, alpha,
  beta). Along C = kND: N_opt = G (C/k)^a with a = beta/(alpha+beta), G = (alpha A/(beta B))^(1/(alpha+beta)).
- ``kaplan-e``: Kaplan et al.'s (2020) equation 1.5 with an irreducible loss added (as Henighan et al. 2020
  did for other modalities): L = E + ((N_c/N)^(alpha_N/alpha_D) + D_c/D)^alpha_D, theta = (log N_c, log D_c,
  log E, alpha_N, alpha_D). Its N and D terms interact, so the loss keeps falling with D for longer than the
  additive form allows. With q = alpha_N/alpha_D: N_opt = G (C/k)^a, a = 1/(1+q) = alpha_D/(alpha_N+alpha_D),
  G = (q N_c^q / D_c)^a.
- ``shared`` (Gadre et al. 2024's default): Chinchilla's form with one exponent for N and D, L = E + A/N^alpha +
  B/D^alpha, theta = (log A, log B, log E, alpha). One fewer free parameter, so it can be fitted from five runs;
  a = 1/2 and G = (A/B)^(1/(2 alpha)).
- ``kaplan`` (``KAPLAN``, not one of approach 3's ``FORMS``): Kaplan et al.'s equation 1.5 as published, kaplan-e
  without E: theta = (log N_c, log D_c, alpha_N, alpha_D).
- the data-constrained law (Muennighoff et al. 2023, ``data_constrained_log_loss``): Chinchilla's form at an
  effective N' and D' where repeated data and excess parameters count less.

Each form gives its log loss and the Jacobian with respect to theta in coordinates where log N and log D are
centred (``shift``: theta[0] moves by shift[0] * mean log N, theta[1] by shift[1] * mean log D), its allocation
(log G, a) and its named parameters.

The curve law ``CURVE_LAW`` (Tissue et al. 2024, extended to model size; ``analysis.curves`` tells its derivation)
gives the loss at step s of a run of N parameters from the run's learning-rate schedule: ``CurvePoints`` evaluates it
and its Jacobian at the points of several runs, ``curve_loss`` along one run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

Array = np.ndarray


@dataclass(frozen=True)
class Form:
    """One form of L(N, D); the functions take theta rows (K, P), P = len(theta_names), unless named otherwise."""

    name: str
    formula: str
    theta_names: tuple[str, ...]  # theta's coordinates, in order
    names: tuple[str, ...]  # the named parameters (fit.json, bootstrap.csv, the report)
    exponents: tuple[str, str]  # the N and D exponents that identification bounds
    shift: Callable[[Array], tuple[float, float]]  # one theta: multipliers of mean log N, mean log D
    log_loss_jac: Callable[[Array, Array, Array], tuple[Array, Array]]  # one centred theta -> (runs,), (runs, P)
    log_loss: Callable[[Array, Array, Array], Array]  # (K, P), log N and log D as (R,) or (K, R) -> (K, R)
    allocation: Callable[[Array], tuple[Array, Array]]  # (K, P) -> log G (K,), a (K,); NaN where none exists
    named: Callable[[Array], dict[str, Array]]  # (K, P) -> each of ``names``
    theta_of: Callable[[dict], Array]  # named parameters (one dict, or columns of a frame) -> theta (K, P)

    @property
    def size(self) -> int:
        """P, the number of free parameters."""
        return len(self.theta_names)


def _softmax3(u1: Array, u2: Array, u3: Array) -> tuple[Array, Array, Array, Array]:
    top = np.maximum(np.maximum(u1, u2), u3)
    s1, s2, s3 = np.exp(u1 - top), np.exp(u2 - top), np.exp(u3 - top)
    total = s1 + s2 + s3
    return top + np.log(total), s1 / total, s2 / total, s3 / total


def _chinchilla_jac(theta: Array, x: Array, y: Array) -> tuple[Array, Array]:
    a, b, e, alpha, beta = theta
    pred, w1, w2, w3 = _softmax3(a - alpha * x, b - beta * y, np.full_like(x, e))
    return pred, np.stack([w1, w2, w3, -w1 * x, -w2 * y], axis=1)


def _chinchilla_log_loss(th: Array, x: Array, y: Array) -> Array:
    u1 = th[:, 0, None] - th[:, 3, None] * x
    u2 = th[:, 1, None] - th[:, 4, None] * y
    return _softmax3(u1, u2, np.broadcast_to(th[:, 2, None], u1.shape))[0]


def _chinchilla_allocation(th: Array) -> tuple[Array, Array]:
    alpha, beta = th[:, 3], th[:, 4]
    with np.errstate(all="ignore"):
        ok = (alpha > 0) & (beta > 0)
        s = np.where(ok, alpha + beta, np.nan)
        log_g = (np.log(np.where(ok, alpha, np.nan)) + th[:, 0] - np.log(np.where(ok, beta, np.nan)) - th[:, 1]) / s
        return log_g, beta / s


def _kaplan_e_parts(th: Array, x: Array, y: Array) -> tuple[Array, ...]:
    """For each row: q, the two inner log terms, their log-sum m and the log reducible loss R = alpha_D m."""
    q = th[:, 3, None] / th[:, 4, None]
    s1, s2 = q * (th[:, 0, None] - x), th[:, 1, None] - y
    m = np.logaddexp(s1, s2)
    return q, s1, s2, m, th[:, 4, None] * m


def _kaplan_e_log_loss(th: Array, x: Array, y: Array) -> Array:
    with np.errstate(all="ignore"):
        return np.logaddexp(th[:, 2, None], _kaplan_e_parts(th, x, y)[4])


def _kaplan_e_jac(theta: Array, x: Array, y: Array) -> tuple[Array, Array]:
    log_nc, _, e, alpha_n, alpha_d = theta
    q, s1, _, m, reducible = (v[0] for v in _kaplan_e_parts(np.asarray(theta, float)[None], x, y))
    pred = np.logaddexp(e, reducible)
    p_e = np.exp(e - pred)  # d log L / d log E
    p_r = 1.0 - p_e  # d log L / d R
    w1 = np.exp(s1 - m)  # the N term's share of the inner sum
    dr = np.stack([alpha_n * w1, alpha_d * (1.0 - w1), np.zeros_like(x), w1 * (log_nc - x),
                   m - q * w1 * (log_nc - x)], axis=1)
    jac = dr * p_r[:, None]
    jac[:, 2] = p_e
    return pred, jac


def _kaplan_e_allocation(th: Array) -> tuple[Array, Array]:
    alpha_n, alpha_d = th[:, 3], th[:, 4]
    with np.errstate(all="ignore"):
        ok = (alpha_n > 0) & (alpha_d > 0)
        q = np.where(ok, alpha_n / alpha_d, np.nan)
        a = 1.0 / (1.0 + q)
        return a * (np.log(q) + q * th[:, 0] - th[:, 1]), a


def _column(params: dict, key: str) -> Array:
    return np.atleast_1d(np.asarray(params[key], float))


def _additive_named(th: Array, beta_column: int) -> dict[str, Array]:
    """E, A, B, alpha and beta of an additive form's thetas (log A, log B, log E, alpha[, beta])."""
    return {"E": np.exp(th[:, 2]), "A": np.exp(th[:, 0]), "B": np.exp(th[:, 1]), "alpha": th[:, 3],
            "beta": th[:, beta_column]}


def _additive_theta(params: dict, exponents: tuple[str, ...]) -> Array:
    return np.column_stack([np.log(_column(params, "A")), np.log(_column(params, "B")), np.log(_column(params, "E")),
                            *(_column(params, e) for e in exponents)])


CHINCHILLA = Form(
    name="chinchilla",
    formula="E + A/N^alpha + B/D^beta",
    theta_names=("log A", "log B", "log E", "alpha", "beta"),
    names=("E", "A", "B", "alpha", "beta"),
    exponents=("alpha", "beta"),
    shift=lambda theta: (float(theta[3]), float(theta[4])),
    log_loss_jac=_chinchilla_jac,
    log_loss=_chinchilla_log_loss,
    allocation=_chinchilla_allocation,
    named=lambda th: _additive_named(th, 4),
    theta_of=lambda p: _additive_theta(p, ("alpha", "beta")),
)

KAPLAN_E = Form(
    name="kaplan-e",
    formula="E + ((N_c/N)^(alpha_N/alpha_D) + D_c/D)^alpha_D",
    theta_names=("log N_c", "log D_c", "log E", "alpha_N", "alpha_D"),
    names=("E", "N_c", "D_c", "alpha_N", "alpha_D"),
    exponents=("alpha_N", "alpha_D"),
    shift=lambda theta: (1.0, 1.0),
    log_loss_jac=_kaplan_e_jac,
    log_loss=_kaplan_e_log_loss,
    allocation=_kaplan_e_allocation,
    named=lambda th: {"E": np.exp(th[:, 2]), "N_c": np.exp(th[:, 0]), "D_c": np.exp(th[:, 1]),
                      "alpha_N": th[:, 3], "alpha_D": th[:, 4]},
    theta_of=lambda p: np.column_stack([np.log(_column(p, "N_c")), np.log(_column(p, "D_c")),
                                        np.log(_column(p, "E")), _column(p, "alpha_N"), _column(p, "alpha_D")]),
)


def _shared_jac(theta: Array, x: Array, y: Array) -> tuple[Array, Array]:
    a, b, e, alpha = theta
    pred, w1, w2, w3 = _softmax3(a - alpha * x, b - alpha * y, np.full_like(x, e))
    return pred, np.stack([w1, w2, w3, -w1 * x - w2 * y], axis=1)


def _shared_log_loss(th: Array, x: Array, y: Array) -> Array:
    return _chinchilla_log_loss(np.column_stack([th, th[:, 3]]), x, y)


def _shared_allocation(th: Array) -> tuple[Array, Array]:
    return _chinchilla_allocation(np.column_stack([th, th[:, 3]]))


SHARED = Form(
    name="shared",
    formula="E + A/N^alpha + B/D^alpha",
    theta_names=("log A", "log B", "log E", "alpha"),
    names=("E", "A", "B", "alpha"),
    exponents=("alpha", "alpha"),
    shift=lambda theta: (float(theta[3]), float(theta[3])),
    log_loss_jac=_shared_jac,
    log_loss=_shared_log_loss,
    allocation=_shared_allocation,
    named=lambda th: _additive_named(th, 3),  # beta = alpha too, to read against the other forms' tables
    theta_of=lambda p: _additive_theta(p, ("alpha",)),
)

FORMS = {f.name: f for f in (CHINCHILLA, KAPLAN_E, SHARED)}
"""Approach 3's forms, by name."""


def _without_e(th: Array) -> Array:
    """Kaplan's thetas as kaplan-e's with log E = -inf: E = 0 adds nothing to the loss and takes no share of it."""
    return np.insert(np.atleast_2d(th), 2, -np.inf, axis=1)


def _kaplan_jac(theta: Array, x: Array, y: Array) -> tuple[Array, Array]:
    pred, jac = _kaplan_e_jac(_without_e(theta)[0], x, y)
    return pred, np.delete(jac, 2, axis=1)


KAPLAN = Form(
    name="kaplan",
    formula="((N_c/N)^(alpha_N/alpha_D) + D_c/D)^alpha_D",
    theta_names=("log N_c", "log D_c", "alpha_N", "alpha_D"),
    names=("N_c", "D_c", "alpha_N", "alpha_D"),
    exponents=("alpha_N", "alpha_D"),
    shift=lambda theta: (1.0, 1.0),
    log_loss_jac=_kaplan_jac,
    log_loss=lambda th, x, y: _kaplan_e_log_loss(_without_e(th), x, y),
    allocation=lambda th: _kaplan_e_allocation(_without_e(th)),
    named=lambda th: {"N_c": np.exp(th[:, 0]), "D_c": np.exp(th[:, 1]), "alpha_N": th[:, 2], "alpha_D": th[:, 3]},
    theta_of=lambda p: np.column_stack([np.log(_column(p, "N_c")), np.log(_column(p, "D_c")), _column(p, "alpha_N"),
                                        _column(p, "alpha_D")]),
)


def point_loss(form: str, named: dict, n: Array | float, d: Array | float) -> Array:
    """L(N, D) of approach 3's ``form`` from its named parameters (numbers, or arrays of resamples), broadcast
    elementwise with N and D."""
    f = FORMS[form]
    columns = np.broadcast_arrays(*(np.asarray(named[k], float) for k in f.names), np.log(n), np.log(d))
    flat = [c.reshape(-1) for c in columns]
    theta = f.theta_of(dict(zip(f.names, flat[:-2])))
    return np.exp(f.log_loss(theta, flat[-2][:, None], flat[-1][:, None]))[:, 0].reshape(columns[0].shape)


# ---------------------------------------------------------------- the data-constrained law


def effective(n: Array, d: Array, unique: Array, theta: Array, r_d: float, r_n: float) -> tuple[Array, Array]:
    """N' and D' of the data-constrained law for theta = (log A, log B, log E, alpha, beta): with U_D unique tokens,
    R_D = D/U_D - 1 repetitions and D' = U_D (1 + R_D* (1 - exp(-R_D/R_D*))); with U_N = min(N, the compute-optimal N
    for U_D tokens under the law's own allocation), R_N = N/U_N - 1 and N' = U_N (1 + R_N* (1 - exp(-R_N/R_N*)))."""
    a, b, _, alpha, beta = theta
    repeats = np.maximum(d / unique - 1.0, 0.0)
    d_eff = unique * (1.0 + r_d * -np.expm1(-repeats / r_d))
    # compute-optimal N for D = U under C = 6ND: N = G (U G)^(beta/alpha)
    log_g = (np.log(alpha) + a - np.log(beta) - b) / (alpha + beta)
    unique_n = np.minimum(n, np.exp(log_g + beta / alpha * (np.log(unique) + log_g)))
    excess = np.maximum(n / unique_n - 1.0, 0.0)
    return unique_n * (1.0 + r_n * -np.expm1(-excess / r_n)), d_eff


def data_constrained_log_loss(theta7: Array, n: Array, d: Array, unique: Array) -> Array:
    """log L of the data-constrained law at (log A, log B, log E, alpha, beta, log R_D*, log R_N*)."""
    theta, (r_d, r_n) = theta7[:5], np.exp(theta7[5:])
    n_eff, d_eff = effective(n, d, unique, theta, r_d, r_n)
    return _chinchilla_log_loss(np.asarray(theta, float)[None], np.log(n_eff), np.log(d_eff))[0]


# ---------------------------------------------------------------- the curve law

CURVE_LAW = ("L(N, s) = E + (B/N^beta + A/S1(s))^alpha - C*S2(s) + K*exp(-S1(s)/tau), S1 and S2 in steps at the "
             "configured peak rate")
CURVE_THETA = ("log E", "log B", "beta", "log A", "alpha", "log C", "log(1 - lambda)", "log K", "log tau")
CURVE_NAMES = ("E", "B", "beta", "A", "alpha", "C", "lambda", "K", "tau")


@dataclass(frozen=True)
class Curve:
    """One run's loss curve: its size, its learning rate at every step and its (step, loss) points."""

    run_id: str
    params: float
    lr: Array  # (total_steps,): the rate of step i (1-based step i + 1)
    steps: Array  # 1-based steps of the points, after warm-up
    loss: Array
    schedule: str = ""
    peak: float = 0.0  # the configured peak rate the areas count in; 0: the largest rate of ``lr``

    @property
    def reference(self) -> float:
        return self.peak or float(np.max(self.lr))


def drops(lr: Array) -> Array:
    """eta_{i-1} - eta_i at each step, zero up to the peak."""
    out = np.zeros_like(lr)
    out[1:] = lr[:-1] - lr[1:]
    out[: int(np.argmax(lr)) + 1] = 0.0
    return out


def _annealed(dropped: Array, lam: float) -> Array:
    """m_i = lambda m_{i-1} + drop_i at each step."""
    from scipy.signal import lfilter  # imported here: scipy.signal costs a training run's startup about a second

    return lfilter([1.0], [1.0, -lam], dropped)


def areas(lr: Array, lam: float) -> tuple[Array, Array]:
    """S1 and S2 after each step (arrays as long as ``lr``); S2's drops count from the peak on."""
    return np.cumsum(lr), np.cumsum(_annealed(drops(lr), lam))


class CurvePoints:
    """The points of several runs' curves with what does not depend on theta computed once: log N, S1 and the drops
    (in steps at each run's peak rate)."""

    def __init__(self, curves: Sequence[Curve]):
        self.log_n = np.concatenate([np.full(len(c.steps), math.log(c.params)) for c in curves])
        self.s1 = np.concatenate([np.cumsum(c.lr / c.reference)[c.steps - 1] for c in curves])
        self.inv_s1 = 1.0 / self.s1
        self.parts = [(drops(c.lr / c.reference), c.steps - 1) for c in curves]

    def s2(self, lam: float, derivative: bool = False) -> tuple[Array, Array | None]:
        """S2 at every point and, when asked, dS2/dlambda (m' = lambda m'_prev + m_prev, summed)."""
        values, slopes = [], []
        for dropped, idx in self.parts:
            m = _annealed(dropped, lam)
            values.append(np.cumsum(m)[idx])
            if derivative:
                previous = np.concatenate([[0.0], m[:-1]])
                slopes.append(np.cumsum(_annealed(previous, lam))[idx])
        return np.concatenate(values), np.concatenate(slopes) if derivative else None

    def loss_jac(self, theta: Array, jac: bool = True) -> tuple[Array, Array | None]:
        """The law at every point and its Jacobian with respect to theta (``CURVE_THETA`` order)."""
        log_e, log_b, beta, log_a, alpha, log_c, log_gap, log_k, log_tau = theta
        gap = math.exp(log_gap)
        s2, ds2 = self.s2(1.0 - gap, jac)
        n_term = np.exp(log_b - beta * self.log_n)
        s_term = math.exp(log_a) * self.inv_s1
        inner = n_term + s_term
        core = inner ** alpha
        c = math.exp(log_c)
        transient = math.exp(log_k) * np.exp(-self.s1 / math.exp(log_tau))
        loss = math.exp(log_e) + core - c * s2 + transient
        if not jac:
            return loss, None
        slope = alpha * core / inner  # d core / d inner
        columns = [np.full(len(loss), math.exp(log_e)), slope * n_term, -slope * n_term * self.log_n, slope * s_term,
                   core * np.log(inner), -c * s2, c * gap * ds2, transient,
                   transient * self.s1 / math.exp(log_tau)]
        return loss, np.column_stack(columns)


def curve_loss(theta: Array, params: float, lr: Array, steps: Sequence[int], peak: float = 0.0) -> Array:
    """``CURVE_LAW`` (theta in ``CURVE_THETA`` order) at 1-based ``steps`` of a run of ``params`` with rates ``lr``, its
    areas counted in steps at ``peak`` (the configured peak rate; 0: the largest rate of ``lr``)."""
    steps = np.asarray(steps, int)
    run = Curve("", float(params), np.asarray(lr, float), steps, np.zeros(len(steps)), peak=peak)
    return CurvePoints([run]).loss_jac(np.asarray(theta, float), jac=False)[0]


def curve_named(theta: Array) -> dict[str, float]:
    """The curve law's named parameters (``CURVE_NAMES``) of one theta."""
    log_e, log_b, beta, log_a, alpha, log_c, log_gap, log_k, log_tau = (float(v) for v in theta)
    return {"E": math.exp(log_e), "B": math.exp(log_b), "beta": beta, "A": math.exp(log_a), "alpha": alpha,
            "C": math.exp(log_c), "lambda": 1.0 - math.exp(log_gap), "K": math.exp(log_k), "tau": math.exp(log_tau)}


def curve_theta(p: dict[str, float]) -> Array:
    """Theta of the curve law's named parameters."""
    return np.array([math.log(p["E"]), math.log(p["B"]), p["beta"], math.log(p["A"]), p["alpha"], math.log(p["C"]),
                     math.log(1.0 - p["lambda"]), math.log(p["K"]), math.log(p["tau"])])
