"""Time the scaling-law fit and its bootstrap on a few hundred synthetic runs.

Run: ``.venv/bin/python benchmarks/bench_fit.py [--runs-per-budget 30] [--resamples 1000]``.
Prints wall-clock and CPU seconds of: the approach-3 fit (vectorised grid of 4,500 starts plus
L-BFGS from the best 8), the 1,000-resample parametric bootstrap in one process and over a
process pool, and the whole ``fit_runs`` (all approaches, bootstrap, hold-out).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Callable, TypeVar

# As in the CLI: BLAS threads only add overhead on these short vectors.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from analysis.bootstrap import Problem, bootstrap  # noqa: E402
from analysis.budgets import group_budgets  # noqa: E402
from analysis.fit import FitConfig, fit_runs  # noqa: E402
from analysis.parametric import fit_parametric  # noqa: E402
from analysis.synthetic import isoflop_runs  # noqa: E402
from analysis.table import RunTable  # noqa: E402

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """(result, wall seconds, CPU seconds of this process and its finished children)."""
    cpu0 = time.process_time() + _children_cpu()
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0, time.process_time() + _children_cpu() - cpu0


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, default=10)
    parser.add_argument("--runs-per-budget", type=int, default=30)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2, help="processes for the pooled bootstrap")
    args = parser.parse_args()

    runs = isoflop_runs(np.geomspace(1e18, 1e22, args.budgets), per_budget=args.runs_per_budget,
                        spread=8.0, noise=0.01, seed=0)
    n, d, loss = (runs[c].to_numpy() for c in ("params", "tokens", "loss"))
    print(f"{len(runs)} synthetic runs ({args.budgets} budgets x {args.runs_per_budget}), 1% loss noise; "
          f"{os.cpu_count()} CPU(s), {platform.processor() or platform.machine()}, "
          f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}")

    fit, wall, cpu = timed(lambda: fit_parametric(n, d, loss))
    print(f"approach-3 fit (grid + {fit.n_starts} L-BFGS starts): {wall:.3f} s wall, {cpu:.3f} s CPU "
          f"(converged={fit.converged}, alpha={fit.params['alpha']:.4f}, beta={fit.params['beta']:.4f})")

    budgets = group_budgets(runs["flops"].to_numpy(), 0.05)
    problem = Problem(theta0=fit.theta, n=n, d=d, loss=loss, labels=budgets.labels, budget_flops=budgets.flops,
                      flops_k=6.0, envelope=None, seed=0)
    for workers in (1, args.workers):
        res, wall, cpu = timed(lambda: bootstrap(problem, args.resamples, workers, progress=False))
        print(f"bootstrap (approaches 2 and 3), {args.resamples} resamples, {workers} process(es): {wall:.2f} s wall, "
              f"{cpu:.2f} s CPU ({res.converged.sum()} converged)")

    table = RunTable(runs=runs, source="synthetic", params_count="total")
    config = FitConfig(n_bootstrap=args.resamples, progress=False)
    result, wall, cpu = timed(lambda: fit_runs(table, config))
    print(f"whole fit_runs (approaches 2 and 3, {args.resamples}-resample bootstrap, hold-out), 1 process: "
          f"{wall:.2f} s wall, {cpu:.2f} s CPU ({len(result.warnings)} warning(s))")


if __name__ == "__main__":
    main()
