"""The README's tour, run as written: each command exits 0, or fails in the lines the README shows.

The commands run in a folder of the test's own, which holds by link what they read (configs, sweep files, the test
data, the prepared-data cache, the launch scripts and what ``make`` reads), so that the ``runs/`` they write is the
test's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_WORDS = " ".join(README.split())  # an inline command may break across lines


def tour_command(text: str) -> list[str]:
    """``text`` as the README writes it (the test fails when the README no longer does), as an argv."""
    assert f"`{text}`" in README_WORDS, f"the README's tour no longer shows `{text}`"
    words = text.split()
    return [sys.executable, *words[1:]] if words[0] == "python" else words


def run(folder: Path, text: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(tour_command(text), cwd=folder, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def folder(tmp_path) -> Path:
    (ROOT / "data").mkdir(exist_ok=True)  # the prepared-data cache, shared as a run in the checkout shares it
    for name in ("configs", "sweeps", "tests", "data", "launch", "pyproject.toml", "constraints-cpu.txt"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _shown_lines(after: str) -> list[str]:
    """The lines of the README's first fenced block after ``after``."""
    block = README[README.index(after):].split("```\n", 2)[1]
    return block.splitlines()


@pytest.mark.slow
def test_the_tours_plan_and_the_fit_of_the_recorded_sweep(folder):
    proc = run(folder, "python -m sweeps plan sweeps/tour.toml", 60)
    assert proc.returncode == 0 and proc.stdout.startswith("sweep tour → "), proc
    assert proc.stdout.splitlines()[-1].startswith("6 runs, 1.2e+11 FLOPs")
    proc = run(folder, "python -m analysis fit tests/analysis/data/default-sweep.csv --out runs/default-fit "
                       "--bootstrap 200", 120)
    assert proc.returncode == 0 and "fitted 62 runs (6 budgets)" in proc.stdout, proc
    proc = run(folder, "python -m analysis plan runs/default-fit/fit.json --flops 8e12 --gpu H100 --n-gpus 1 "
                       "--mfu 0.4", 60)
    assert proc.returncode == 0 and "\nlaw         approach 3 (parametric): it is identified" in proc.stdout, proc


@pytest.mark.slow
@pytest.mark.long
def test_the_tours_sweep_its_status_export_and_fit(folder):
    assert run(folder, "python -m sweeps run sweeps/tour.toml", 600).returncode == 0
    proc = run(folder, "python -m sweeps status runs/sweeps/tour", 60)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-2] == \
        "done 6 | running 0 | planned 0 | failed 0 | interrupted 0 | cancelled 0", proc
    proc = run(folder, "python -m sweeps export runs/sweeps/tour", 60)
    assert proc.returncode == 0 and (folder / "runs" / "sweeps" / "tour-runs.csv").is_file(), proc
    start = time.monotonic()
    proc = run(folder, "python -m analysis fit runs/sweeps/tour --out runs/tour-fit", 60)
    assert time.monotonic() - start < 20
    assert proc.returncode == 3 and proc.stderr.splitlines() == _shown_lines("exits 3 in about 3 s"), proc


@pytest.mark.slow
@pytest.mark.long
def test_the_tours_demo_and_zero2_on_two_ranks(folder):
    make = tour_command("make demo") + ["-f", str(ROOT / "Makefile"), f"VENV={ROOT / '.venv'}"]  # the checkout's
    proc = subprocess.run(make, cwd=folder,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "done (completed): 98 steps" in proc.stdout, proc
    proc = run(folder, "python -m lab train --nproc-per-node 2 --strategy zero2 --config configs/demo.toml "
                       "--train.stop_after 20 --run-dir runs/tour-zero2", 600)
    assert proc.returncode == 0 and "done (stopped): 20 steps" in proc.stdout, proc
