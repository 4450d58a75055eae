"""Identification: each check of identify.py fails where it should, and the fit applies them."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis import identify
from analysis.fit import FitConfig, fit_runs
from analysis.parametric import fit_parametric, gauss_newton_condition
from analysis.synthetic import CHINCHILLA, isoflop_runs, law_optimum
from analysis.table import load_runs

BUDGETS = np.geomspace(1e18, 1e21, 7)
GOOD = {"E": 1.7, "alpha": 0.34, "beta": 0.28}
CI = {"alpha": [0.32, 0.36], "beta": [0.26, 0.30], "a": [0.43, 0.47]}


def _parametric(**changes):
    args = {"params": GOOD, "converged": True, "condition": 1e3, "n_distinct": 63, "d_distinct": 63,
            "min_loss": 2.3, "single_budget": False, "ci": CI, "boot_converged": 1.0, "level": 0.95}
    return identify.parametric(**{**args, **changes})


def test_a_clean_parametric_fit_passes_every_check():
    ident = _parametric()
    assert ident.identified and ident.reasons == []
    assert [c.name for c in ident.checks] == ["budgets", "sizes", "converged", "bounds", "conditioning",
                                              "exponent intervals", "bootstrap refits", "bootstrap"]


@pytest.mark.parametrize("changes,reason", [
    ({"single_budget": True}, "one compute budget"),
    ({"d_distinct": 2}, "2 distinct D"),
    ({"converged": False}, "did not converge"),
    ({"params": {**GOOD, "alpha": 59.0}}, "alpha = 59"),
    ({"params": {**GOOD, "beta": -0.1}}, "beta = -0.1"),
    ({"params": {**GOOD, "E": 2.5}}, "E = 2.5 >= the lowest loss 2.3"),
    ({"condition": 1e9}, "condition number of J^T J 1e+09 (> 1e+06)"),
    ({"ci": {**CI, "alpha": [0.1, 2.7]}}, "not inside (0, 2)"),
    ({"boot_converged": 0.5}, "50% of bootstrap refits converged"),
    ({"ci": {**CI, "a": [0.3, 0.6]}}, "width 0.3 (> 0.2)"),
])
def test_each_parametric_check_fails_on_its_own(changes, reason):
    ident = _parametric(**changes)
    assert not ident.identified
    assert len(ident.reasons) == 1 and reason in ident.reasons[0], ident.reasons


def test_power_law_checks():
    law = {"a": 0.5, "b": 0.5}
    assert identify.power_law(law, 5, "budgets", [0.45, 0.55], 0.95).identified
    assert "2 budgets (need 3)" in identify.power_law(law, 2, "budgets", [0.45, 0.55], 0.95).reasons[0]
    assert "not both in (0, 1)" in identify.power_law({"a": 1.3, "b": -0.3}, 5, "budgets", None, 0.95).reasons[0]
    assert "width 0.5" in identify.power_law(law, 5, "budgets", [0.2, 0.7], 0.95).reasons[0]
    assert not identify.refused("a single compute budget").identified


@pytest.mark.slow
def test_conditioning_separates_several_budgets_from_one():
    many = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0)
    one = isoflop_runs(BUDGETS[3:4], per_budget=30, spread=8, noise=0.002, seed=0)
    conds = []
    for runs in (many, one):
        n, d, loss = (runs[c].to_numpy() for c in ("params", "tokens", "loss"))
        conds.append(gauss_newton_condition(fit_parametric(n, d, loss).theta, n, d))
    assert conds[0] < 1e4 < 1e8 < conds[1], conds


@pytest.mark.slow
def test_the_fit_marks_a_sparse_noisy_isoflop_law_unidentified_and_plans_from_approach_3(tmp_path):
    # Four budgets of seven sizes at 1% noise: approach 3 pins the law down from all 28 runs, while
    # approach 2's exponent, from four minima, has an interval too wide to use.
    runs = isoflop_runs(BUDGETS[::2], per_budget=7, spread=6, noise=0.01, seed=4)
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    doc = fit_runs(load_runs(path), FitConfig(n_bootstrap=200, progress=False, holdout=False)).to_dict()
    iso = doc["isoflop"]["identification"]
    assert iso["identified"] is False and any("interval of a" in r for r in iso["reasons"])
    assert any(w["code"] == "unidentified" and w["message"].startswith("approach 2") for w in doc["warnings"])
    assert doc["approach3"]["identification"]["identified"] is True
    assert doc["comparison"]["preferred"] == "approach3"
    assert all(p["isoflop"]["identified"] is False for p in doc["predictions"])


@pytest.mark.slow
def test_flops_per_param_token_sets_the_allocation(tmp_path):
    # FLOPs of 7ND (an attention term, say): predictions spend exactly C = 7ND and nothing is flagged.
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.0)
    runs["flops"] *= 7.0 / 6.0
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    doc = fit_runs(load_runs(path), FitConfig(n_bootstrap=0, progress=False, holdout=False)).to_dict()
    assert doc["data"]["flops_per_param_token"]["k"] == pytest.approx(7.0, rel=1e-12)
    assert not [w for w in doc["warnings"] if w["code"].startswith("flops")]
    for p in doc["predictions"]:
        for key in ("approach3", "isoflop"):
            assert 7 * p[key]["params"] * p[key]["tokens"] == pytest.approx(p["flops"], rel=1e-9)
        n_true, _ = law_optimum(np.array([p["flops"] * 6.0 / 7.0]))  # the optimum along C = 7ND
        assert p["approach3"]["params"] == pytest.approx(n_true[0], rel=1e-6)
    runs["flops"] *= 22.0 / 7.0  # C = 22ND: N is not the count the FLOPs were computed with
    runs.to_csv(path, index=False)
    assert any(w[0] == "flops_k" and "22" in w[1] for w in load_runs(path).warnings)


def test_duplicates_are_averaged_on_request_with_their_curves_kept_or_refused(tmp_path):
    from analysis.synthetic import write_sweep
    from analysis.table import InputError

    runs = isoflop_runs(BUDGETS[:3], per_budget=5, spread=4, noise=0.01, seed=0)
    repeat = runs.iloc[[2]].assign(run_id="seed2", loss=runs["loss"].iloc[2] * 1.02)
    write_sweep(pd.concat([runs, repeat], ignore_index=True), tmp_path / "sweep")
    assert len(load_runs(tmp_path / "sweep").runs) == 16  # by default each run is its own point
    table = load_runs(tmp_path / "sweep", duplicates="mean")
    assert len(table.runs) == 15 and len(table.curves) == 16
    row = int(np.flatnonzero(table.runs["run_id"].str.contains(r"\+1 repeat"))[0])
    assert table.loss[row] == pytest.approx(runs["loss"].iloc[2] * 1.01)
    assert sum(c.row == row for c in table.curves) == 2
    assert table.duplicates[0]["loss_spread"] == pytest.approx(0.02 / 1.01)
    with pytest.raises(InputError, match="duplicate runs: 2 runs share N and D"):
        load_runs(tmp_path / "sweep", duplicates="refuse")


@pytest.mark.slow
def test_single_budget_holdout_and_envelope_on_continuous_data(tmp_path):
    from analysis.synthetic import continuous_runs

    runs = continuous_runs(120, noise=0.002, seed=2)
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    doc = fit_runs(load_runs(path), FitConfig(n_bootstrap=50, progress=False)).to_dict()
    assert doc["holdout"]["skipped"] is False and "20%" in doc["holdout"]["held_out"]
    assert doc["holdout"]["n_holdout"] == 24
    assert doc["approach3"]["alpha"] == pytest.approx(CHINCHILLA["alpha"], abs=0.05)


@pytest.mark.slow
def test_a_law_without_an_optimum_is_reported_not_used(tmp_path, capsys):
    from analysis.cli import main

    # Loss that grows with N at every budget: alpha comes out negative, so there is no compute-optimal
    # allocation; every minimum is at the edge. The fit still writes its report and says why.
    runs = isoflop_runs(BUDGETS[::2], per_budget=7, spread=6, noise=0.0)
    runs["loss"] = 2 + 400 / runs["tokens"] ** 0.3 + 0.05 * np.log(runs["params"] / 1e6)
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    assert main(["fit", str(path), "--out", str(tmp_path / "out"), "--bootstrap", "30", "--no-progress",
                 "--workers", "1"]) == 3
    doc = json.loads((tmp_path / "out" / "fit.json").read_text())
    assert doc["approach3"]["alpha"] < 0 and doc["approach3"]["a"] is None
    assert any(r.startswith("alpha = -0.0") for r in doc["approach3"]["identification"]["reasons"])
    assert all(p["approach3"] is None for p in doc["predictions"])
    assert "0 budget(s) with a located minimum" in doc["comparison"]["why"]
    assert "No approach gives an identified law" in (tmp_path / "out" / "report.md").read_text()
    assert capsys.readouterr().err.startswith("error: no approach is identified")
