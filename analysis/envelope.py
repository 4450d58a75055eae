"""Approach 1: the lower envelope of final losses (end points), or of training curves when asked.

By default approach 1 uses end points only. A point of a training curve is the loss a run of that
length would reach only if its schedule ended there; the lab's runs each follow one cosine
schedule over their own D, so their intermediate points are not (the learning rate has not
decayed there), and an envelope of such curves mixes mid-schedule points with end points: on the
default sweep it gave a = 0.046, N_opt almost constant in C (issue 24). The frontier of final
losses keeps, per compute budget (or per run's own C when budgets are continuous), the lowest
final loss, where it beats every run of smaller budget. ``--envelope curves`` builds the envelope of
the training curves instead, for runs whose every logged point is an end point (a cooldown from
each checkpoint, or synthetic curves that follow L(N, D) as in ``analysis.synthetic``).

With curves, each run's curve (loss against FLOPs spent so far) is interpolated linearly in log C
onto a shared log-spaced grid of FLOP counts, only within the span the run covers; at every grid
point the run with the lowest loss gives N_opt(C), and D_opt(C) is the tokens that run had seen at
C. On continuous budgets the frontier of final losses is a rough estimator: where the sampled sizes
do not reach N_opt(C) it follows the nearest edge, and on synthetic continuous tables its a comes
out 0.04-0.08 above the truth (tests/analysis/test_analysis_envelope.py), which the comparison with
approach 3 then reports as a disagreement. Power laws N_opt = k_N C^a and D_opt = k_D C^b are
fitted to the envelope's points by least squares in log space. As with the IsoFLOP analysis,
everything is computed for a matrix of run weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis.isoflop import PowerLaws, fit_power_law
from analysis.table import Curve, replicate_means


@dataclass
class Envelope:
    """Curves sampled on a shared FLOP grid."""

    grid: np.ndarray  # (K,) FLOP counts
    loss: np.ndarray  # (R, K) interpolated loss, NaN outside each run's span
    rows: np.ndarray  # (R,) run index in the table of each curve
    params: np.ndarray  # (R,)
    tokens_per_flop: np.ndarray  # (R,)

    def winners(self, weights: np.ndarray, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
        """Index of the lowest curve at each grid point (B, K) and whether any curve covers it.

        Resamples are taken ``chunk`` at a time to bound the (chunk, R, K) intermediate.
        """
        present = np.atleast_2d(weights)[:, self.rows] > 0
        loss = np.where(np.isfinite(self.loss), self.loss, np.inf)
        best = np.empty((len(present), loss.shape[1]), int)
        valid = np.empty(best.shape, bool)
        for lo in range(0, len(present), chunk):
            masked = np.where(present[lo:lo + chunk, :, None], loss[None], np.inf)
            best[lo:lo + chunk] = np.argmin(masked, axis=1)
            valid[lo:lo + chunk] = np.isfinite(np.min(masked, axis=1))
        return best, valid

    def power_laws(self, weights: np.ndarray) -> PowerLaws:
        best, valid = self.winners(weights)
        log_c = np.log(self.grid)
        log_n = np.where(valid, np.log(self.params[best]), 0.0)
        log_d = np.where(valid, log_c[None, :] + np.log(self.tokens_per_flop[best]), 0.0)
        a, k_n = fit_power_law(log_c, log_n, valid)
        b, k_d = fit_power_law(log_c, log_d, valid)
        return PowerLaws(a=a, k_n=k_n, b=b, k_d=k_d, n_points=valid.sum(axis=1))

    def points(self) -> list[dict]:
        """The full-data envelope: one point per covered grid FLOP count."""
        best, valid = self.winners(np.ones((1, int(self.rows.max()) + 1)))
        return [{"flops": float(c), "params": float(self.params[j]), "tokens": float(c * self.tokens_per_flop[j]),
                 "loss": float(self.loss[j, k]), "row": int(self.rows[j])}
                for k, (c, j, ok) in enumerate(zip(self.grid, best[0], valid[0])) if ok]


@dataclass
class Frontier:
    """Final losses sorted by budget, then loss; a budget's lowest run is on the frontier when it beats
    every run of smaller budget."""

    flops: np.ndarray  # (R,) each run's own C
    params: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    rows: np.ndarray  # run index in the table
    group: np.ndarray  # (R,) budget of each position, consecutive from 0
    starts: np.ndarray  # (G,) first position of each budget
    experiments: np.ndarray | None = None  # (R,) RunTable.experiments in this order: seed replicates, averaged

    def winners(self, weights: np.ndarray) -> np.ndarray:
        """(B, R) whether each run, in budget order, is on the frontier of the runs drawn (a run's loss the
        average over the drawn seed replicates of its experiment)."""
        drawn = np.atleast_2d(weights)[:, self.rows]
        present = drawn > 0
        runs = np.arange(len(self.rows)) if self.experiments is None else self.experiments
        loss = replicate_means(self.loss, drawn, self.group * (runs.max(initial=0) + 1) + runs)
        lowest = np.minimum.reduceat(loss, self.starts, axis=1)  # (B, G)
        before = np.concatenate([np.full((len(loss), 1), np.inf), np.minimum.accumulate(lowest, axis=1)[:, :-1]],
                                axis=1)
        candidate = present & (loss == lowest[:, self.group])
        seen = np.cumsum(candidate, axis=1)
        seen_before = np.concatenate([np.zeros((len(loss), 1), int), seen[:, self.starts[1:] - 1]], axis=1)
        first = candidate & (seen - seen_before[:, self.group] == 1)  # one run per budget, even on ties
        return first & (lowest < before)[:, self.group]

    def power_laws(self, weights: np.ndarray) -> PowerLaws:
        on = self.winners(weights)
        log_c = np.log(self.flops)
        a, k_n = fit_power_law(log_c, np.broadcast_to(np.log(self.params), on.shape), on)
        b, k_d = fit_power_law(log_c, np.broadcast_to(np.log(self.tokens), on.shape), on)
        return PowerLaws(a=a, k_n=k_n, b=b, k_d=k_d, n_points=on.sum(axis=1))

    def points(self) -> list[dict]:
        on = self.winners(np.ones((1, int(self.rows.max()) + 1)))[0]
        return [{"flops": float(self.flops[i]), "params": float(self.params[i]), "tokens": float(self.tokens[i]),
                 "loss": float(self.loss[i]), "row": int(self.rows[i])} for i in np.flatnonzero(on)]


def build_frontier(flops: np.ndarray, params: np.ndarray, tokens: np.ndarray, loss: np.ndarray,
                   budget: np.ndarray | None = None, experiments: np.ndarray | None = None) -> Frontier:
    """The final-loss frontier of a table of runs; ``budget``: each run's budget C (default: its own C);
    ``experiments``: which runs are seed replicates of one experiment (``RunTable.experiments``)."""
    key = flops if budget is None else np.asarray(budget, float)
    order = np.lexsort((loss, key))
    starts = np.flatnonzero(np.r_[True, np.diff(key[order]) != 0])
    group = np.cumsum(np.r_[True, np.diff(key[order]) != 0]) - 1
    return Frontier(flops=flops[order], params=params[order], tokens=tokens[order], loss=loss[order], rows=order,
                    group=group, starts=starts, experiments=None if experiments is None else experiments[order])


def build_envelope(curves: list[Curve], n_points: int = 40) -> Envelope:
    """Interpolate every curve onto ``n_points`` log-spaced FLOP counts spanning all curves."""
    lo = min(float(c.flops[0]) for c in curves)
    hi = max(float(c.flops[-1]) for c in curves)
    grid = np.geomspace(lo, hi, n_points)
    log_grid = np.log(grid)
    loss = np.full((len(curves), n_points), np.nan)
    for i, c in enumerate(curves):
        log_f = np.log(c.flops)
        inside = (log_grid >= log_f[0]) & (log_grid <= log_f[-1])
        loss[i, inside] = np.interp(log_grid[inside], log_f, c.loss)
    return Envelope(grid=grid, loss=loss, rows=np.array([c.row for c in curves]),
                    params=np.array([c.params for c in curves]),
                    tokens_per_flop=np.array([c.tokens[-1] / c.flops[-1] for c in curves]))
