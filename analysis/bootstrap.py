"""Seeded bootstrap over runs, refitting every approach on the same resamples.

A resample draws, with replacement, as many runs of each compute budget as the budget has (runs in no budget
form one more group), so every resample keeps the sweep's design, budgets and their sizes; it is stored as a
count per run (a weight row), so every approach refits the same resample by weighting the same arrays. Runs are
drawn in a canonical order (by C, N, D and loss), not the table's, so a sweep folder and its export, which list
the same runs in different orders, get the same resamples.
Resamples come in chunks of ``CHUNK``: chunk j is drawn from the seed sequence (seed, j), so the
result does not depend on how chunks are spread over processes, and no more than one chunk of
weights (CHUNK x runs) exists per process at a time. Per chunk, approach 3 runs one least-squares fit
per resample from the full-data optimum; the IsoFLOP and envelope refits are vectorised over the
chunk. With OPENBLAS_NUM_THREADS=1 (the CLI sets it) BLAS threads do not fight the processes.
"""

from __future__ import annotations

import signal
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from analysis.envelope import Envelope, Frontier
from analysis.isoflop import METHODS, PowerLaws, budget_minima
from lab.measure.laws import CHINCHILLA, Form
from lab.runtime.progress import progress as progress_bar
from analysis.parametric import fit_weighted
from analysis.robust import HUBER_DELTA

CHUNK = 50


def chunk_weights(n_runs: int, seed: int, chunk: int, size: int, strata: np.ndarray | None = None) -> np.ndarray:
    """Counts (size, n_runs) of each run in the resamples of chunk ``chunk``; with ``strata`` (a label per run) each
    stratum's runs are drawn from that stratum alone."""
    rng = np.random.default_rng([seed, chunk])
    if strata is None:
        picks = rng.integers(0, n_runs, size=(size, n_runs))
    else:
        picks = np.empty((size, n_runs), int)
        for label in np.unique(strata):
            members = np.flatnonzero(strata == label)
            picks[:, members] = members[rng.integers(0, len(members), size=(size, len(members)))]
    picks = picks + (np.arange(size) * n_runs)[:, None]
    return np.bincount(picks.ravel(), minlength=size * n_runs).reshape(size, n_runs)


def canonical_order(c: np.ndarray, n: np.ndarray, d: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """The permutation that lists runs by C, then N, D and loss: the order resamples are drawn in."""
    return np.lexsort((loss, d, n, c))


def _chunk_sizes(n_resamples: int) -> list[int]:
    return [min(CHUNK, n_resamples - lo) for lo in range(0, n_resamples, CHUNK)]


def draw_weights(n_runs: int, n_resamples: int, seed: int) -> np.ndarray:
    """All resamples' counts (n_resamples, n_runs), chunk by chunk as the bootstrap draws them."""
    parts = [chunk_weights(n_runs, seed, j, size) for j, size in enumerate(_chunk_sizes(n_resamples))]
    return np.concatenate(parts) if parts else np.zeros((0, n_runs), int)


def interval(samples: np.ndarray, level: float) -> list[float] | None:
    """Percentile interval of the finite samples at ``level`` (e.g. 0.95), or None if there are none."""
    finite = np.asarray(samples, float)
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return None
    tail = 50.0 * (1.0 - level)
    lo, hi = np.percentile(finite, [tail, 100.0 - tail])
    return [float(lo), float(hi)]


@dataclass
class Problem:
    """What a resample refits: the runs, approach 3's start, the budgets and the envelope."""

    theta0: np.ndarray
    n: np.ndarray
    d: np.ndarray
    loss: np.ndarray
    labels: np.ndarray  # budget of each run, -1 for none: the strata resamples are drawn within
    budget_flops: np.ndarray  # (G,); empty when approach 2 is not run
    flops_k: float
    envelope: Envelope | Frontier | None
    seed: int
    huber_delta: float = HUBER_DELTA
    form: Form = CHINCHILLA
    order: np.ndarray | None = None  # canonical_order of the runs; None: the table's own
    experiments: np.ndarray | None = None  # RunTable.experiments: seed replicates, averaged by the spline
    noiseless_envelope: Frontier | None = None  # the frontier of approach 3's losses at the same runs
    fit_weights: np.ndarray | None = None  # RunTable.replicate_weights: approach 3's weight of each run

    def weights(self, chunk: int, size: int) -> np.ndarray:
        """Chunk ``chunk``'s resamples as counts per run, in the table's order."""
        order = np.arange(len(self.n)) if self.order is None else self.order
        drawn = chunk_weights(len(self.n), self.seed, chunk, size, self.labels[order])
        w = np.empty_like(drawn)
        w[:, order] = drawn
        return w


@dataclass
class Resamples:
    """Every approach refitted per resample; rows aligned across approaches."""

    thetas: np.ndarray  # (B, P), P the form's parameter count
    converged: np.ndarray  # (B,)
    isoflop: dict[str, PowerLaws]  # by minimum method; empty when approach 2 is not run
    envelope: PowerLaws | None
    noiseless_envelope: PowerLaws | None = None  # Problem.noiseless_envelope on the same resamples


def _refit(problem: Problem, chunk: int, size: int) -> Resamples:
    w = problem.weights(chunk, size)
    counts = w if problem.fit_weights is None else w * problem.fit_weights
    thetas, converged = fit_weighted(problem.theta0, problem.n, problem.d, problem.loss, counts, problem.huber_delta,
                                     problem.form)
    isoflop = {}
    if len(problem.budget_flops):
        minima = budget_minima(problem.n, problem.loss, problem.labels, problem.budget_flops, w, problem.experiments)
        isoflop = {m: minima.power_laws(m, problem.n, problem.d, problem.flops_k) for m in METHODS}
    envelope = None if problem.envelope is None else problem.envelope.power_laws(w)
    noiseless = None if problem.noiseless_envelope is None else problem.noiseless_envelope.power_laws(w)
    return Resamples(thetas, converged, isoflop, envelope, noiseless)


_PROBLEM: Problem | None = None


def _init_worker(problem: Problem) -> None:
    global _PROBLEM
    _PROBLEM = problem
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles interrupts and stops the pool


def _refit_in_worker(chunk: int, size: int) -> Resamples:
    return _refit(_PROBLEM, chunk, size)


def bootstrap(problem: Problem, n_resamples: int, workers: int = 1, progress: bool = True) -> Resamples:
    """Refit every approach on ``n_resamples`` resamples, over ``workers`` processes."""
    sizes = _chunk_sizes(n_resamples)
    bar = progress_bar(n_resamples, "bootstrap", "fit", progress, leave=False)
    parts: list[Resamples] = []
    with bar:
        if workers <= 1 or len(sizes) <= 1:
            for j, size in enumerate(sizes):
                parts.append(_refit(problem, j, size))
                bar.update(size)
        else:
            with ProcessPoolExecutor(max_workers=min(workers, len(sizes)), initializer=_init_worker,
                                     initargs=(problem,)) as pool:
                try:
                    for part in pool.map(_refit_in_worker, range(len(sizes)), sizes):
                        parts.append(part)
                        bar.update(len(part.thetas))
                except BaseException:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
    envelope = None if problem.envelope is None else PowerLaws.concat([p.envelope for p in parts])
    noiseless = (None if problem.noiseless_envelope is None
                 else PowerLaws.concat([p.noiseless_envelope for p in parts]))
    return Resamples(thetas=np.concatenate([p.thetas for p in parts]),
                     converged=np.concatenate([p.converged for p in parts]),
                     isoflop={m: PowerLaws.concat([p.isoflop[m] for p in parts]) for m in parts[0].isoflop},
                     envelope=envelope, noiseless_envelope=noiseless)
