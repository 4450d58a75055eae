"""How wide approach 1's bootstrap interval of a is by design: the default sweep's grid and alternatives, simulated.

    python benchmarks/sweep/approach1_design.py [RUNS_CSV]   # default: benchmarks/sweep/sweep-3seeds-runs.csv

The truth is approach 3's law fitted to the sweep's runs (form auto, as `make sweep` fits it); the noise is the
sweep's own seed noise, a power law in the run's steps fitted to its experiments' seed spreads (each experiment's
standard deviation over its seeds, unbiased by c4). Each design lays out
its budgets and sizes (centred on 40 tokens per parameter, as the default file), draws losses, and takes approach
1's interval exactly as `analysis fit` does: the final-loss frontier (seed replicates averaged) refitted on 1,000
bootstrap resamples drawn within budgets. Printed per design: the median width over 20 noise draws, how often it is
under the identification bound (0.2), the same without noise, and the runs and FLOPs the design costs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.special import gammaln

from analysis.bootstrap import chunk_weights, interval
from analysis.envelope import build_frontier
from analysis.fit import FitConfig, fit_runs
from analysis.identify import MAX_A_WIDTH
from analysis.parametric import predict_loss
from analysis.table import load_runs

BUDGETS = (6e10, 1.2e11, 2.5e11, 5e11, 1e12, 2e12)
BATCH = 512
DRAWS = 20
RESAMPLES = 1000


def design(budgets=BUDGETS, per_budget=7, decades=0.5, seeds=lambda c: 3 if c < 1e12 else 1) -> pd.DataFrame:
    """The runs of a design: each budget's sizes log-spaced around 40 tokens per parameter, ``seeds(C)`` of each."""
    rows = []
    for c in budgets:
        centre = np.sqrt(c / (6 * 40))
        for j, n in enumerate(np.geomspace(centre / 10 ** decades, centre * 10 ** decades, per_budget)):
            rows += [{"c": c, "n": n, "d": c / (6 * n), "experiment": f"{c:g}-{j}"} for _ in range(seeds(c))]
    return pd.DataFrame(rows)


def widths(runs: pd.DataFrame, law, noise) -> tuple[float, float, float]:
    """Median width of approach 1's interval over noise draws, the share under the bound, the noiseless width."""
    c, n, d = (runs[k].to_numpy(float) for k in ("c", "n", "d"))
    experiments = pd.factorize(runs["experiment"])[0]
    strata = pd.factorize(runs["c"])[0]
    weights = np.concatenate([chunk_weights(len(n), 0, j, 100, strata) for j in range(RESAMPLES // 100)])
    expected = law(n, d)

    def width(loss: np.ndarray) -> float:
        frontier = build_frontier(c, n, d, loss, c, experiments)
        lo, hi = interval(frontier.power_laws(weights).a, 0.95)
        return hi - lo

    rng = np.random.default_rng(0)
    noisy = [width(expected + rng.standard_normal(len(n)) * noise(d / BATCH)) for _ in range(DRAWS)]
    return float(np.median(noisy)), float(np.mean(np.array(noisy) <= MAX_A_WIDTH)), width(expected)


def main(path: Path) -> None:
    table = load_runs(path)
    fit = fit_runs(table, FitConfig(n_bootstrap=0, form="auto", progress=False))
    theta, form = fit.parametric.theta, fit.parametric.form

    def law(n: np.ndarray, d: np.ndarray) -> np.ndarray:
        return predict_loss(theta, n, d, form)

    runs = pd.read_csv(path)
    groups = runs[runs["role"] == "sweep"].groupby("experiment").agg(
        steps=("steps", "first"), sd=("loss", "std"), count=("loss", "size"))
    groups = groups[groups["count"] >= 2]
    k = groups["count"].to_numpy(float)
    c4 = np.sqrt(2 / (k - 1)) * np.exp(gammaln(k / 2) - gammaln((k - 1) / 2))  # E[sample sd] = c4 sigma
    slope, intercept = np.polyfit(np.log(groups["steps"]), np.log(groups["sd"] / c4), 1)

    def noise(steps: np.ndarray) -> np.ndarray:
        return np.exp(intercept) * steps ** slope

    print(f"law: approach 3 ({form.name}) fitted to {len(table.n)} runs of {path}")
    print(f"seed noise: sigma = {np.exp(intercept):.3g} x steps^{slope:.2f} from {len(groups)} experiments with seeds "
          f"({noise(np.array([300.0]))[0]:.3f} nats at 300 steps, {noise(np.array([3000.0]))[0]:.4f} at 3,000)")
    cases = {
        "7 sizes, +-0.5 decade, 2 seeds below 1e12": design(seeds=lambda c: 2 if c < 1e12 else 1),
        "the default: 3 seeds below 1e12": design(),
        "9 sizes, 3 seeds below 1e12": design(per_budget=9),
        "11 sizes, 3 seeds below 1e12": design(per_budget=11),
        "2 seeds everywhere": design(seeds=lambda c: 2),
        "3 seeds below 1e12, 2 above": design(seeds=lambda c: 3 if c < 1e12 else 2),
        "9 sizes, +-0.4 decade, 2 seeds everywhere": design(per_budget=9, decades=0.4, seeds=lambda c: 2),
        "11 budgets (x sqrt 2 apart), 3 seeds below 1e12": design(budgets=tuple(np.geomspace(6e10, 2e12, 11))),
        "a 7th budget, 4e12, 3 seeds below 1e12": design(budgets=BUDGETS + (4e12,)),
    }
    print(f"{'design':<52} {'runs':>4} {'FLOPs':>8} {'width':>6} {'<= 0.2':>6} {'no noise':>8}")
    for name, runs_of in cases.items():
        median, share, noiseless = widths(runs_of, law, noise)
        flops = float((runs_of["c"]).sum())
        print(f"{name:<52} {len(runs_of):>4} {flops:>8.3g} {median:>6.3f} {share:>6.0%} {noiseless:>8.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/sweep/sweep-3seeds-runs.csv"))
