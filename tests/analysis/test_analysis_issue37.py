"""Issue 37: a table's verify and search rows are left out of its fit as a sweep folder's are (in one line), and
``analysis compare`` shows each fit's own form and parameters."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis.cli import main
from analysis.table import load_runs

SWEEP_CSV = Path(__file__).parent / "data" / "default-sweep.csv"  # the default sweep's 62 runs and 6 verify runs
SIDE_LINE = ("left out 6 verify row(s) (column role): a sweep's search and verify runs are not its grid; "
             "--side-runs fits them too")


def test_a_tables_verify_rows_are_left_out_unless_asked_for():
    table = load_runs(SWEEP_CSV)
    assert len(table.runs) == 62 and table.side_runs == SIDE_LINE
    assert not table.runs["run_id"].str.startswith("verify-").any()
    everything = load_runs(SWEEP_CSV, side_runs=True)
    assert len(everything.runs) == 68 and everything.side_runs is None


@pytest.mark.long
@pytest.mark.slow  # three fits of 62 runs: over a minute on 2 loaded cores
def test_fit_says_so_and_gives_the_readmes_law_and_compare_names_each_form(tmp_path, capsys):
    common = ["--bootstrap", "20", "--no-progress", "--workers", "1", "--no-holdout"]
    assert main(["fit", str(SWEEP_CSV), "--out", str(tmp_path / "kaplan"), "--form", "kaplan-e", *common]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == SIDE_LINE and out[1] == "fitted 62 runs (6 budgets)"
    assert out[3].startswith("approach 2 (IsoFLOP): a=0.5757 [")  # the README's figure (the spline, the default)
    assert main(["fit", str(SWEEP_CSV), "--out", str(tmp_path / "chinchilla"), "--form", "chinchilla", *common]) == 0
    assert main(["compare", str(tmp_path / "kaplan"), str(tmp_path / "chinchilla"), "--out", str(tmp_path / "c"),
                 "--bootstrap", "20", "--workers", "1"]) == 0
    table = pd.read_csv(tmp_path / "c" / "compare.csv", index_col="quantity")
    assert table.loc["approach 3: form"].tolist() == ["kaplan-e", "chinchilla"]
    for name in ("E", "N_c", "D_c", "alpha_N", "alpha_D", "A", "B", "alpha", "beta", "a", "b"):
        kaplan, chinchilla = table.loc[f"approach 3: {name}"]
        own = name in ("E", "N_c", "D_c", "alpha_N", "alpha_D", "a", "b"), name in ("E", "A", "B", "alpha", "beta",
                                                                                      "a", "b")
        for cell, has in zip((kaplan, chinchilla), own):
            assert (cell == "not in its form") != has and cell != "-"
            if has:
                float(cell.split()[0])  # a number, with its interval
