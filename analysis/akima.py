"""Porian et al. (2024)'s IsoFLOP estimator: each budget's minimum from an Akima interpolation, seed-noise intervals.

Read from their released code (github.com/formll/resolving-scaling-law-discrepancies, ``analysis.py``:
``interpolation``, ``vectorized_interp_with_seed_noise``, ``fit_compute_optimal_power_laws``; MIT licence):

1. per budget, the lowest loss of each size; log loss is interpolated in log N by Akima's spline through every
   size, and N* is the argmin of the spline on a grid of ``PER_GAP`` points per gap between sizes (log-spaced
   from the smallest to the largest); a minimum at either end of the grid is not one (the budget is left out);
2. seed noise: the losses plus Gaussian noise of a fixed standard deviation in nats (theirs: 0.002 on
   RefinedWeb, 0.01 on OpenWebText2), ``DRAWS`` times; the budget is kept when at least half the draws have an
   interior minimum; N*'s spread is sd(log N*) over those, at least a third of the mean gap between sizes in
   log N, divided by the fraction kept; the budget's N* is the median over the draws;
3. N_opt = k C^a by least squares in log-log, each budget weighted by 1 / spread^2; the 95 % interval of a from
   the same fit to the i-th draw of every budget, i = 1 .. the fewest kept draws of any budget.

Against the lab's default (``analysis.isoflop``: the vertex of a parabola fitted in a window symmetric about the
lowest run, budgets unweighted, intervals by resampling runs), the spline goes through every point, so it
follows a lopsided profile near its minimum where a parabola cannot; it needs no sizes beyond the neighbours of
the minimum; and its interval is the scatter that seed noise of the given size would cause, not the runs'
own scatter. Both are offered by ``python -m analysis fit --isoflop-minimum``; benchmarks/published-isoflop
compares them on the published sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis.table import replicate_means

PER_GAP = 25  # interpolation points per gap between sizes (their interp_num_multiplier)
DRAWS = 1000  # seed-noise draws per budget (their bootstrap_iters)
MIN_SPREAD = 0.33  # N*'s spread is at least this fraction of the mean gap between sizes in log N
MIN_SIZES = 3  # sizes a budget needs


def profile(log_n: np.ndarray, loss: np.ndarray, experiments: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """One budget's distinct sizes (ascending log N) with the lowest loss of each: the lowest over a size's
    experiments (their tuned settings), each experiment's seed replicates averaged first (``experiments``: one
    integer per run, None: every run an experiment of its own)."""
    best = size_losses(np.asarray(log_n, float), np.asarray(loss, float)[None, :], np.ones((1, len(loss))),
                       experiments)
    sizes = np.unique(np.asarray(log_n, float))
    return sizes, best[0]


def size_losses(log_n: np.ndarray, loss: np.ndarray, weights: np.ndarray, experiments: np.ndarray | None
                ) -> np.ndarray:
    """(B, sizes) per weight row: each distinct size's lowest experiment loss, an experiment's loss the
    weight-averaged loss of its drawn seed replicates; inf where a row draws no run of the size. ``loss``
    (1, runs) or (B, runs)."""
    sizes, by_size = np.unique(log_n, return_inverse=True)
    by_size = by_size.ravel()
    exp = np.arange(len(log_n)) if experiments is None else np.asarray(experiments)
    mean = replicate_means(loss, weights, by_size * (exp.max(initial=0) + 1) + exp)  # one size's replicates
    best = np.full((len(weights), len(sizes)), np.inf)
    np.minimum.at(best.T, by_size, mean.T)
    return best


def grid(log_n: np.ndarray) -> np.ndarray:
    """The interpolation grid in log N: PER_GAP points per gap between sizes, end to end."""
    return np.linspace(log_n[0], log_n[-1], (len(log_n) - 1) * PER_GAP)


def curve(log_n: np.ndarray, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The grid and the spline's log loss on it, (grid,) and (grid, rows), for rows of losses at sizes ``log_n``."""
    from scipy.interpolate import Akima1DInterpolator

    x = grid(log_n)
    return x, Akima1DInterpolator(log_n, np.log(np.atleast_2d(losses)).T)(x)


def minima(log_n: np.ndarray, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log N* and L* of each row of ``losses`` (rows of one profile's losses at sizes ``log_n``); NaN where the
    spline's minimum lies at an end of the grid."""
    losses = np.atleast_2d(losses)
    x, values = curve(log_n, losses)
    at = np.argmin(values, axis=0)
    interior = (at > 0) & (at < len(x) - 1)
    best = np.exp(values[at, np.arange(losses.shape[0])])
    return np.where(interior, x[at], np.nan), np.where(interior, best, np.nan)


@dataclass
class BudgetOptimum:
    """One budget's N* by the spline, with its seed-noise draws."""

    flops: float
    log_n: float  # the noiseless spline's minimum (NaN at an edge)
    draws: np.ndarray  # log N* of the draws with an interior minimum, in draw order
    spread: float  # NaN when under half the draws have an interior minimum
    median: float  # median of the draws' log N*

    @property
    def usable(self) -> bool:
        return bool(np.isfinite(self.log_n) and np.isfinite(self.spread))


def budget_optimum(flops: float, log_n: np.ndarray, loss: np.ndarray, noise: float,
                   rng: np.random.Generator | np.random.RandomState) -> BudgetOptimum:
    """The spline's N* of one budget's runs and its seed-noise draws (``noise``: sd of the loss in nats)."""
    log_n, loss = profile(log_n, loss)
    if len(log_n) < MIN_SIZES:
        return BudgetOptimum(flops, np.nan, np.zeros(0), np.nan, np.nan)
    centre = float(minima(log_n, loss)[0][0])
    noisy = loss[None, :] + noise * rng.normal(0, 1, (DRAWS, len(loss)))
    stars = minima(log_n, noisy)[0]
    draws = stars[np.isfinite(stars)]
    if len(draws) < DRAWS // 2:
        return BudgetOptimum(flops, centre, draws, np.nan, np.nan)
    floor = MIN_SPREAD * (log_n[-1] - log_n[0]) / (len(log_n) - 1)
    spread = max(float(np.std(draws)), floor) * DRAWS / len(draws)
    return BudgetOptimum(flops, centre, draws, spread, float(np.median(draws)))


def weighted_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Slope and intercept of the weighted least-squares line y = a x + c."""
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    slope = float(np.sum(w * (x - xm) * (y - ym)) / np.sum(w * (x - xm) ** 2))
    return slope, float(ym - slope * xm)


@dataclass
class Exponent:
    """N_opt = k_N C^a by the spline's minima, with the seed-noise interval of a."""

    a: float
    k_n: float
    interval: tuple[float, float]
    samples: np.ndarray
    budgets: list[BudgetOptimum]


def exponent(flops: np.ndarray, log_n: np.ndarray, loss: np.ndarray, noise: float, seed: int = 0,
             level: float = 0.95) -> Exponent | None:
    """a and its interval from runs at budgets ``flops`` (one value per run); None with fewer than 2 usable budgets.

    ``seed`` seeds numpy's legacy generator, as the published code does (np.random.seed(42) reproduces it).
    """
    rng = np.random.RandomState(seed)
    flops, log_n, loss = (np.asarray(v, float) for v in (flops, log_n, loss))
    budgets = [budget_optimum(c, log_n[flops == c], loss[flops == c], noise, rng) for c in np.unique(flops)]
    used = [b for b in budgets if b.usable]
    if len(used) < 2:
        return None
    x, w = np.log([b.flops for b in used]), 1.0 / np.square([b.spread for b in used])
    a, c = weighted_line(x, np.array([b.median for b in used]), w)
    count = min(len(b.draws) for b in used)
    samples = np.array([weighted_line(x, np.array([b.draws[i] for b in used]), w)[0] for i in range(count)])
    tail = 50.0 * (1.0 - level)
    lo, hi = np.percentile(samples, [tail, 100.0 - tail])
    return Exponent(a, float(np.exp(c)), (float(lo), float(hi)), samples, budgets)


def budget_minima(n: np.ndarray, loss: np.ndarray, labels: np.ndarray, n_budgets: int,
                  weights: np.ndarray, experiments: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """log N* and L* of the spline per weight row and budget, (B, G) each; NaN where not located.

    A row's budget takes the sizes its runs drawn (weight > 0) hold, each at its lowest experiment's loss
    (seed replicates averaged over their draws: ``size_losses``), as ``analysis.isoflop.budget_minima`` takes
    runs; rows drawing the same sizes share one interpolation.
    """
    weights = np.atleast_2d(np.asarray(weights, float))
    log_n, loss = np.log(np.asarray(n, float)), np.asarray(loss, float)
    out_n = np.full((len(weights), n_budgets), np.nan)
    out_loss = np.full_like(out_n, np.nan)
    for g in range(n_budgets):
        rows = np.flatnonzero(labels == g)
        sizes = np.unique(log_n[rows])
        best = size_losses(log_n[rows], loss[rows][None, :], weights[:, rows],
                           None if experiments is None else np.asarray(experiments)[rows])
        drawn = np.isfinite(best)
        patterns, which = np.unique(drawn, axis=0, return_inverse=True)
        for p, pattern in enumerate(patterns):
            if pattern.sum() < MIN_SIZES:
                continue
            members = np.flatnonzero(which.ravel() == p)
            out_n[members, g], out_loss[members, g] = minima(sizes[pattern], best[np.ix_(members, pattern)])
    return out_n, out_loss
