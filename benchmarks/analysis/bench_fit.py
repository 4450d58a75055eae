"""Time ``python -m analysis fit`` end to end, and its parts, on synthetic tables of runs.

Run: ``.venv/bin/python benchmarks/analysis/bench_fit.py [--resamples 1000] [--repeats 3] [--large 20000]``.

End to end means what a user waits for: a fresh ``python -m analysis fit TABLE --out DIR`` (imports,
loading, all approaches, the bootstrap, the hold-out, every figure and both reports), timed as a
subprocess with its wall-clock, CPU (its own and its workers') and peak memory. Tables: about 250
runs and ``--large`` runs, each as IsoFLOP budgets (7 x 35 and 40 x 500) and with continuous budgets
(N and D drawn independently, as in tables read off published plots). The load average is printed
before and after, since the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the CLI does

import numpy as np  # noqa: E402

from analysis.synthetic import continuous_runs, isoflop_runs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _tables(large: int) -> dict[str, object]:
    per_budget = large // 40
    return {
        "245 runs, 7 IsoFLOP budgets x 35": isoflop_runs(np.geomspace(1e18, 1e21, 7), per_budget=35, spread=8,
                                                         noise=0.01, seed=0),
        "245 runs, continuous budgets": continuous_runs(245, noise=0.01, seed=0),
        f"{40 * per_budget} runs, 40 IsoFLOP budgets x {per_budget}": isoflop_runs(
            np.geomspace(1e18, 1e22, 40), per_budget=per_budget, spread=8, noise=0.01, seed=0),
        f"{large} runs, continuous budgets": continuous_runs(large, noise=0.01, seed=0),
    }


def _run(path: Path, out: Path, resamples: int, repo: Path) -> tuple[float, float, int, int]:
    """Wall seconds, CPU seconds, peak RSS (MB) of the largest process, exit code of one fit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "analysis", "fit", str(path), "--out", str(out), "--bootstrap",
                           str(resamples), "--no-progress"], cwd=repo, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 3):
        sys.exit(f"fit failed on {path}: {proc.stderr.strip()}")
    return wall, cpu, after.ru_maxrss // 1024, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="fits per table; the fastest and slowest are shown")
    parser.add_argument("--large", type=int, default=20000, help="runs in the large tables")
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="checkout whose analysis package to time (another one, to compare versions)")
    parser.add_argument("--only", help="time only the tables whose name contains this")
    args = parser.parse_args()
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; analysis package of {args.repo}; {os.cpu_count()} CPU(s), "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{len(os.sched_getaffinity(0))} worker process(es); load average before: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    with tempfile.TemporaryDirectory() as tmp:
        for name, runs in _tables(args.large).items():
            if args.only and args.only not in name:
                continue
            path = Path(tmp) / "runs.csv"
            runs.to_csv(path, index=False)
            results = [_run(path, Path(tmp) / "out", args.resamples, args.repo) for _ in range(args.repeats)]
            walls = sorted(r[0] for r in results)
            print(f"{name}: python -m analysis fit with {args.resamples} resamples, all figures and reports: "
                  f"wall {walls[0]:.2f}-{walls[-1]:.2f} s over {args.repeats} runs, CPU {results[0][1]:.2f} s, "
                  f"peak RSS {max(r[2] for r in results)} MB, exit {results[0][3]}")
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
