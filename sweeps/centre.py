"""Sizes that bracket each budget's minimum: targets centred on a prior N_opt(C), symmetric in log N.

Two priors (``[sweep] centre``):

- ``tokens_per_param`` r: C = k N D with D = r N gives N_opt = sqrt(C / (k r)). k is F / N of the
  family's own shape at that N (F from ``lab.measure.accounting.flops_per_token``, N counted as the sweep's
  ``count``), not 6: F adds the attention FLOPs and counts only the parameters used in matmuls, so
  k moves with the shape (6.5-6.8 for the default sweep's family at 2.5e11-4e12 FLOPs and 20 tokens
  per parameter). Since k depends on the shape and the shape on N, N_opt is iterated to a fixed
  point.
- ``fit``: N_opt = k_N C^a of a fit.json written by ``python -m analysis fit``; the file is read as
  JSON (the sweep driver does not import the analysis), and only an identified law is used.

Each budget gets ``per_budget`` targets from N_opt / 10^x to N_opt × 10^x (x = ``decades_each_side``),
log-spaced; the family turns them into shapes (``sweeps.shapes``). Where its widths are coarser than the targets'
spacing (the smallest models), two targets would give one shape; each target then takes a shape of its own
among those the family has within one target step beyond the outermost targets (``distinct_targets``), or,
with fewer such shapes than targets, each of them is planned once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lab.measure import accounting
from lab.runtime.files import read_json

from sweeps.shapes import count, family_shape, model_config
from sweeps.spec import SpecError
from sweeps.sweep import Sweep

FIT_SCHEMA = 2  # fit.json's schema_version this reader understands
FIXED_POINT_STEPS = 6


@dataclass(frozen=True)
class Prior:
    """A budget's prior N_opt and how it was obtained (one line for the plan)."""

    budget: float
    params: float
    how: str


def fit_law(sweep: Sweep) -> tuple[float, float, str]:
    """(k_N, a, description) of the fit.json law ``[sweep] centre`` names; SpecError if it is unusable."""
    centre = sweep.centre
    where = f"[sweep] centre: {centre.path}"
    try:
        doc = read_json(centre.path, follow=True)
    except (OSError, ValueError) as e:
        raise SpecError(f"{where}: cannot read ({' '.join(str(e).split())})") from None
    if not isinstance(doc, dict) or doc.get("schema_version") != FIT_SCHEMA:
        raise SpecError(f"{where}: not a fit.json of schema {FIT_SCHEMA} written by 'python -m analysis fit'")
    key = centre.approach
    if key == "preferred":
        key = (doc.get("comparison") or {}).get("preferred")
        if key is None:
            raise SpecError(f"{where}: the fit identifies no law, so it cannot centre the sizes")
    section = doc.get(key) or {}
    if not (section.get("identification") or {}).get("identified"):
        raise SpecError(f"{where}: its {key} law is not identified, so it cannot centre the sizes")
    k_n, a = section.get("k_N"), section.get("a")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (k_n, a)) or k_n <= 0:
        raise SpecError(f"{where}: its {key} law has no finite k_N and a")
    counted = doc.get("params_count")
    if counted != sweep.count:
        raise SpecError(f"{where}: the fit counts N as {counted!r}, the sweep as {sweep.count!r} ([sweep] count)")
    return float(k_n), float(a), f"{key} law of {centre.path}: N_opt = {k_n:.4g} C^{a:.4g}"


def _flops_per_param(sweep: Sweep, params: float) -> float:
    """F / N of the family's shape for a target N."""
    cfg = model_config(sweep.base, family_shape(params, sweep.family, sweep.count, sweep.base))
    return accounting.flops_per_token(cfg) / count(cfg, sweep.count)


def priors(sweep: Sweep) -> list[Prior]:
    """The prior N_opt of every budget of a centred sweep."""
    return [prior_at(sweep, c) for c in sweep.budgets]


def prior_at(sweep: Sweep, budget: float) -> Prior:
    """The prior N_opt of a centred sweep at one budget."""
    centre = sweep.centre
    if centre.prior == "fit":
        k_n, a, how = fit_law(sweep)
        return Prior(budget, k_n * budget ** a, how)
    r = centre.tokens_per_param
    k = 6.0
    for _ in range(FIXED_POINT_STEPS):
        k = _flops_per_param(sweep, math.sqrt(budget / (k * r)))
    return Prior(budget, math.sqrt(budget / (k * r)), f"{r:g} tokens per parameter, C = k N D with k = F/N = "
                                                      f"{k:.3g} of the family's shape there")


def targets(sweep: Sweep, prior: float) -> list[float]:
    """``per_budget`` sizes log-spaced from prior / 10^x to prior × 10^x."""
    return [float(v) for v in prior * np.logspace(-sweep.decades_each_side, sweep.decades_each_side,
                                                  sweep.per_budget)]


def distinct_targets(sweep: Sweep, prior: float) -> tuple[list[tuple[float, float]], list[str]]:
    """(target, N of its shape) with distinct shapes for the targets of a budget (see the module docstring), and a
    note when there are fewer shapes than targets (each then paired with its nearest target).

    The candidates are the family's shapes within one target step beyond the outermost targets; with more of them
    than targets, each target takes one, in order, at the least total distance in log N (a monotone assignment).
    """
    def size(target: float) -> float:
        return float(count(model_config(sweep.base, family_shape(target, sweep.family, sweep.count, sweep.base)),
                           sweep.count))

    raw = targets(sweep, prior)
    own = [size(t) for t in raw]
    if len(set(own)) == len(own):  # each target's own shape is its nearest: nothing to share
        return list(zip(raw, own)), []
    step = 10 ** (2 * sweep.decades_each_side / (sweep.per_budget - 1))
    grid = np.geomspace(raw[0] / step, raw[-1] * step, 8 * (len(raw) + 1) + 1)
    within = {n for n in map(size, grid) if grid[0] <= n <= grid[-1]}
    sizes = sorted(within | set(own))  # the targets' own shapes, even beyond reach
    cost = np.abs(np.log(np.asarray(raw))[:, None] - np.log(np.asarray(sizes))[None, :])
    if len(sizes) <= len(raw):
        note = [] if len(sizes) == len(raw) else [f"the family has {len(sizes)} shapes within reach of its "
                                                  f"{len(raw)} targets: each planned once"]
        return [(raw[int(np.argmin(cost[:, j]))], n) for j, n in enumerate(sizes)], note
    total = np.full(cost.shape, np.inf)  # total[i, j]: targets 0..i placed, target i on candidate j
    total[0] = cost[0]
    for i in range(1, len(raw)):
        best_before = np.minimum.accumulate(total[i - 1])
        total[i, 1:] = best_before[:-1] + cost[i, 1:]
    picks = [int(np.argmin(total[-1]))]
    for i in range(len(raw) - 1, 0, -1):
        picks.append(int(np.argmin(total[i - 1, :picks[-1]])))
    return [(t, sizes[j]) for t, j in zip(raw, reversed(picks))], []
