"""Two CPU runs side by side against one alone: does sharing the cores collapse a run (issue 37)?

Run: ``.venv/bin/python benchmarks/threads/bench_threads.py`` from the repository root (a few minutes on 2 cores).

Each case starts one or two tiny runs (the demo's model, 6 steps of 4,096 tokens, no checkpoints) through
``python -m lab train`` at the same time, with the given environment, and reads the median step time of steps
2-6 from each run's ``metrics.jsonl``; "vs one alone" compares with the first case. The machine's 1-minute load
average before each case is printed beside it: on a shared machine other work slows every case alike.
Prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = ["-m", "lab", "train", "--config", "configs/demo.toml", "--train.stop_after", "6", "--train.log_every", "1",
       "--train.checkpoint_every", "0", "--train.eval_every", "0", "--train.peak_flops", "1e11"]
SPIN = {"OMP_WAIT_POLICY": "ACTIVE"}  # OpenMP's threads spin while they wait (libgomp's default spins a while)
# (name, runs at once, environment added to each); the lab's default since issue 37 is OMP_WAIT_POLICY=PASSIVE
CASES = (("one alone, spinning threads", 1, SPIN),
         ("two side by side, spinning threads", 2, SPIN),
         ("one alone, the lab's default (passive threads)", 1, {}),
         ("two side by side, the lab's default", 2, {}),
         ("two side by side, OMP_NUM_THREADS=1 each", 2, {"OMP_NUM_THREADS": "1"}))


def median_step_s(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > 1)


def case(runs: int, env: dict[str, str], folder: Path) -> list[float]:
    dirs = [folder / f"run-{i}" for i in range(runs)]
    procs = [subprocess.Popen([sys.executable, *RUN, "--run-dir", str(d)], env={**os.environ, **env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for d in dirs]
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a run failed ({p.returncode}): {err.strip().splitlines()[-1:]}")
    return [median_step_s(d) for d in dirs]


def main() -> None:
    print(f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| case | load before | median step s per run | vs one alone |\n|---|---:|---|---:|")
    alone = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, runs, env) in enumerate(CASES):
            load = os.getloadavg()[0]
            times = case(runs, env, Path(tmp) / str(i))
            alone = alone or times[0]
            print(f"| {name} | {load:.2f} | {', '.join(f'{t:.3f}' for t in times)} | "
                  f"{max(times) / alone:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
