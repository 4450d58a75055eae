"""Compute budgets: runs clustered in log C, or no budgets at all when C is continuous.

Runs that share one C exactly (to 1e-6) in groups of at least ``MIN_BUDGET_RUNS`` sizes are designed budgets (seed
replicates of one size share its C too, so with ``params`` given distinct sizes are counted): each is a budget of
its own however close its neighbour is (a ladder of budgets 1 % apart stays a ladder). Every other run joins the
nearest such budget within the tolerance ``tol`` (relative C). The rest are linked, sorted by C, wherever
neighbours differ by at most ``tol``; such a chain is a budget when it has at least ``MIN_BUDGET_RUNS`` runs and
spans at most ``tol`` from its smallest to its largest C. A longer chain is "wide": neighbouring C values, not one
budget, so its runs belong to no budget and a warning names it.

When fewer than half of the runs end up in budgets, the data has continuous budgets (every run
its own C, as in tables read off published plots): then there are no budgets at all, and the
IsoFLOP approach is skipped instead of fitting fake profiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_BUDGET_RUNS = 3
_SAME_C = 1e-6  # relative difference below which two runs share one C


@dataclass
class Budgets:
    """Budget of each run and what the clustering found."""

    labels: np.ndarray  # (runs,) budget index by increasing C, -1 for runs in no budget
    flops: np.ndarray  # (G,) geometric mean C of each budget
    spread: np.ndarray  # (G,) largest C / smallest C - 1 within each budget
    tol: float
    continuous: bool  # fewer than half of the runs lie in budgets: no budgets are formed
    single: bool  # every run within tol of one C, in at most one budget
    wide: list[dict]  # chains spanning more than tol: {"flops": [lo, hi], "n_runs": k}

    @property
    def count(self) -> int:
        return len(self.flops)


def _runs(sorted_x: np.ndarray, gap: float) -> list[np.ndarray]:
    """Positions of sorted_x split wherever neighbours differ by more than gap."""
    if len(sorted_x) == 0:
        return []
    cuts = np.flatnonzero(np.diff(sorted_x) > gap) + 1
    return np.split(np.arange(len(sorted_x)), cuts)


def group_budgets(flops: np.ndarray, tol: float, params: np.ndarray | None = None) -> Budgets:
    """Cluster runs into budgets by their C (``params``: each run's N, to tell seed replicates of one size from a
    budget's sizes); see the module docstring."""
    if not tol >= 0:
        raise ValueError("budget tolerance must be >= 0")
    log_c = np.log(np.asarray(flops, float))
    limit = np.log1p(tol) + _SAME_C
    order = np.argsort(log_c, kind="stable")
    xs = log_c[order]
    members: list[list[int]] = []  # positions in xs of each budget
    loose = []
    sizes = None if params is None else np.asarray(params, float)[order]
    for atom in _runs(xs, _SAME_C):
        designed = len(atom) if sizes is None else len(np.unique(sizes[atom]))
        (members.append(list(atom)) if designed >= MIN_BUDGET_RUNS else loose.extend(atom))
    seeds = np.array([xs[m[0]] for m in members])
    unplaced = []
    for i in loose:
        nearest = int(np.argmin(np.abs(seeds - xs[i]))) if len(seeds) else -1
        if nearest >= 0 and abs(seeds[nearest] - xs[i]) <= limit:
            members[nearest].append(i)
        else:
            unplaced.append(i)
    wide = []
    unplaced = np.array(unplaced, int)
    for chain in _runs(xs[unplaced], limit):
        pos = unplaced[chain]
        if xs[pos[-1]] - xs[pos[0]] > limit:
            wide.append({"flops": [float(np.exp(xs[pos[0]])), float(np.exp(xs[pos[-1]]))], "n_runs": len(pos)})
        elif len(pos) >= MIN_BUDGET_RUNS:
            members.append(list(pos))
    members.sort(key=lambda m: xs[m].mean())
    labels = np.full(len(xs), -1)
    for g, m in enumerate(members):
        labels[order[m]] = g
    single = bool(np.ptp(xs) <= limit and len(members) <= 1)
    continuous = bool(np.sum(labels >= 0) < 0.5 * len(xs))
    if continuous:
        labels[:] = -1
        members = []
    return Budgets(labels=labels, flops=np.array([np.exp(xs[m].mean()) for m in members]),
                   spread=np.array([np.expm1(np.ptp(xs[m])) for m in members]), tol=float(tol),
                   continuous=continuous, single=single, wide=wide)
