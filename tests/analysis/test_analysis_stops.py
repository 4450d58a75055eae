"""A fit that says why it stopped: too few runs end it before the bootstrap in two lines, its report states only
checks that ran, the runs it names are named as --exclude takes them, and its progress shows in a log."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from analysis.cli import EXIT_UNIDENTIFIED, main
from analysis.synthetic import isoflop_runs, write_sweep
from analysis.table import load_runs
from lab.runtime.progress import Lines

TOUR = Path(__file__).parent / "data" / "tour-sweep.csv"  # the README tour's six runs, as `sweeps status` lists them
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tour_sweep_stops_before_the_bootstrap_with_two_lines(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "analysis", "fit", str(TOUR), "--out", str(tmp_path / "fit")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == EXIT_UNIDENTIFIED and proc.stdout == "", proc
    first, second = proc.stderr.splitlines()
    assert first == ("error: no approach can be identified from 6 runs at 2 budget(s), so the fit stopped before "
                     "its bootstrap")
    assert second.startswith("enough: 3 or more budgets, each with 3 or more sizes") and len(second) < 160
    assert took < 20 and not (tmp_path / "fit").exists()


@pytest.mark.slow  # a few seconds: `make test`, not the edit loop
def test_without_a_bootstrap_the_report_claims_no_agreement(tmp_path):
    assert main(["fit", str(TOUR), "--out", str(tmp_path / "fit"), "--bootstrap", "0", "--no-progress"]) == \
        EXIT_UNIDENTIFIED
    report = (tmp_path / "fit" / "report.md").read_text()
    assert "agree within" not in report and "their agreement was not checked" in report


def test_a_sweep_folder_names_its_runs_as_the_sweep_does(tmp_path):
    runs = isoflop_runs(np.geomspace(1e18, 1e20, 3), per_budget=4, noise=0.0)
    write_sweep(runs, tmp_path / "sweep" / "runs")
    (tmp_path / "sweep" / "sweep.db").write_bytes(b"")
    table = load_runs(tmp_path / "sweep", exclude=[str(runs["run_id"].iloc[0])])
    assert sorted(table.runs["run_id"]) == sorted(runs["run_id"].iloc[1:])
    assert [d["run_id"] for d in table.dropped] == [runs["run_id"].iloc[0]]


def test_progress_off_a_terminal_is_a_line_every_few_seconds(monkeypatch):
    clock = iter([0.0, 1.0, 6.0, 7.0, 12.5])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    lines = Lines(100, "bootstrap", "fit", out, every_s=5.0)  # starts at 0 s
    for _ in range(4):  # at 1, 6, 7 and 12.5 s
        lines.update(25)
    assert out.getvalue().splitlines() == ["bootstrap: 50/100 fits after 6 s", "bootstrap: 100/100 fits after 12 s"]
