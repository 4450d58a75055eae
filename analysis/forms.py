"""The forms of L(N, D) that approach 3 can fit, each with its parameters theta (five, or four when shared).

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

Each form gives its log loss and the Jacobian with respect to theta in coordinates where log N and log D are
centred (``shift``: theta[0] moves by shift[0] * mean log N, theta[1] by shift[1] * mean log D), its
allocation (log G, a) and its named parameters. ``analysis.parametric`` fits any of them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

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
    grid_axes: tuple[Array, ...]  # starting points of L-BFGS (their product)
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

    def grid(self) -> Array:
        """Every starting point, (G, P)."""
        return np.array(list(itertools.product(*self.grid_axes)), float)


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
    # Hoffmann et al.'s grid of starting points, in theta order.
    grid_axes=(np.arange(0.0, 25.1, 5.0), np.arange(0.0, 25.1, 5.0), np.arange(-1.0, 1.01, 0.5),
               np.arange(0.0, 2.01, 0.5), np.arange(0.0, 2.01, 0.5)),
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
    # N_c and D_c from 1e3 to 1e15, E from 0.37 to 2.7 nats, exponents 0.1 to 1.
    grid_axes=(np.log([1e3, 1e6, 1e9, 1e12, 1e15]), np.log([1e3, 1e6, 1e9, 1e12, 1e15]), np.array([-1.0, 0.0, 1.0]),
               np.array([0.1, 0.3, 1.0]), np.array([0.1, 0.3, 1.0])),
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
    grid_axes=CHINCHILLA.grid_axes[:4],
    shift=lambda theta: (float(theta[3]), float(theta[3])),
    log_loss_jac=_shared_jac,
    log_loss=_shared_log_loss,
    allocation=_shared_allocation,
    named=lambda th: _additive_named(th, 3),  # beta = alpha too, to read against the other forms' tables
    theta_of=lambda p: _additive_theta(p, ("alpha",)),
)

FORMS = {f.name: f for f in (CHINCHILLA, KAPLAN_E, SHARED)}
