"""Seeded bootstrap over runs.

A resample draws as many runs as the table has, with replacement; it is stored as a count per
run (a weight matrix, resamples x runs), so every approach refits the same resamples by weighting
the same arrays. The parametric refits start from the full-data optimum and run one L-BFGS each,
in this process or spread over a process pool (``workers``); the IsoFLOP and envelope refits are
vectorised across resamples. With OPENBLAS_NUM_THREADS=1 (the CLI sets it) 1,000 refits of 300 runs
take about 3 s on one core; with BLAS threads on a small machine they take several times the CPU,
since the threads only spin on L-BFGS's tiny matrices (see benchmarks/results-analysis.md).
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np
from tqdm import tqdm

from analysis.parametric import fit_weighted


def draw_weights(n_runs: int, n_resamples: int, seed: int) -> np.ndarray:
    """Counts (n_resamples, n_runs) of each run in each resample, from ``seed``."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n_runs, size=(n_resamples, n_runs))
    counts = np.zeros((n_resamples, n_runs), int)
    np.add.at(counts, (np.arange(n_resamples)[:, None], picks), 1)
    return counts


def interval(samples: np.ndarray, level: float) -> list[float] | None:
    """Percentile interval of the finite samples at ``level`` (e.g. 0.95), or None if there are none."""
    finite = np.asarray(samples, float)
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return None
    tail = 50.0 * (1.0 - level)
    lo, hi = np.percentile(finite, [tail, 100.0 - tail])
    return [float(lo), float(hi)]


def bootstrap_parametric(theta0: np.ndarray, n: np.ndarray, d: np.ndarray, loss: np.ndarray,
                         weights: np.ndarray, workers: int = 1, progress: bool = True
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Refit L(N, D) for every resample (row of ``weights``); returns thetas (B, 5) and converged (B,)."""
    n_resamples = len(weights)
    thetas = np.empty((n_resamples, 5))
    converged = np.empty(n_resamples, bool)
    size = max(1, min(25, math.ceil(n_resamples / (4 * max(1, workers)))))
    starts = range(0, n_resamples, size)
    bar = tqdm(total=n_resamples, desc="bootstrap", unit="fit", file=sys.stderr, disable=not progress,
               leave=False)
    with bar:
        if workers <= 1:
            for lo in starts:
                thetas[lo:lo + size], converged[lo:lo + size] = fit_weighted(
                    theta0, n, d, loss, weights[lo:lo + size])
                bar.update(len(weights[lo:lo + size]))
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                futures = {pool.submit(fit_weighted, theta0, n, d, loss, weights[lo:lo + size]): lo
                           for lo in starts}
                for future in as_completed(futures):
                    lo = futures[future]
                    th, ok = future.result()
                    thetas[lo:lo + len(th)], converged[lo:lo + len(th)] = th, ok
                    bar.update(len(th))
    return thetas, converged
