"""Approach 1: the envelope of training curves read from a sweep folder."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.envelope import build_envelope, build_frontier
from analysis.fit import FitConfig, fit_runs
from analysis.synthetic import CHINCHILLA, continuous_runs, isoflop_runs, law_loss, write_sweep
from analysis.table import load_runs

TRUE_A = CHINCHILLA["beta"] / (CHINCHILLA["alpha"] + CHINCHILLA["beta"])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    runs = isoflop_runs(np.geomspace(1e18, 1e21, 4), per_budget=8, spread=8, noise=0.0)
    write_sweep(runs, root, noise=0.0)
    return root


def test_curves_are_read_with_flops_per_record(sweep):
    table = load_runs(sweep)
    assert len(table.curves) == len(table.runs) == 32
    assert table.curve_loss == "eval"  # every curve has eval records
    for curve in table.curves:
        run = table.runs.iloc[curve.row]
        np.testing.assert_allclose(curve.flops, run["flops"] / run["tokens"] * curve.tokens, rtol=1e-12)
        np.testing.assert_allclose(curve.loss[:-1], law_loss(run["params"], curve.tokens[:-1]), rtol=1e-9)


def test_envelope_recovers_the_allocation_exponents(sweep):
    table = load_runs(sweep)
    env = build_envelope(table.curves)
    best, valid = env.winners(np.ones((1, len(table.runs))))
    # At every grid point the winner is the lowest of the curves that cover it.
    for k in np.flatnonzero(valid[0]):
        assert env.loss[best[0, k], k] == np.nanmin(env.loss[:, k])
    law = env.power_laws(np.ones((1, len(table.runs))))
    # Noise-free curves: only the discreteness of the N grid separates the envelope from the true
    # optimum, so a and b are within 0.01.
    assert law.a[0] == pytest.approx(TRUE_A, abs=0.01)
    assert law.b[0] == pytest.approx(1 - TRUE_A, abs=0.01)


def test_fit_reports_the_envelope_with_intervals(sweep):
    doc = fit_runs(load_runs(sweep), FitConfig(n_bootstrap=30, progress=False, holdout=False)).to_dict()
    env = doc["envelope"]
    assert env["skipped"] is False and env["source"] == "training curves (eval loss)" and env["n_curves"] == 32
    assert env["ci"]["a"][0] <= env["a"] <= env["ci"]["a"][1]
    assert env["identification"]["identified"] is True
    assert all(p["loss"] > 0 and p["tokens"] == pytest.approx(p["flops"] / (6 * p["params"]), rel=1e-9)
               for p in env["points"])


def test_envelope_is_skipped_without_curves(tmp_path):
    runs = isoflop_runs(np.geomspace(1e18, 1e20, 3), per_budget=5, noise=0.0)
    runs.to_csv(tmp_path / "runs.csv", index=False)
    doc = fit_runs(load_runs(tmp_path / "runs.csv"), FitConfig(n_bootstrap=0, progress=False)).to_dict()
    env = doc["envelope"]
    assert (env["skipped"], env["reason"]) == (True, "no training curves (metrics.jsonl) in the input")
    assert env["identification"]["identified"] is False


def test_frontier_of_final_losses_recovers_a_on_continuous_budgets():
    # Without curves and without budgets, approach 1 is the frontier of final losses.
    runs = continuous_runs(3000, noise=0.0, seed=0)
    frontier = build_frontier(*(runs[c].to_numpy() for c in ("flops", "params", "tokens", "loss")))
    on = frontier.winners(np.ones((1, len(runs))))[0]
    best = np.minimum.accumulate(frontier.loss)
    assert np.all(frontier.loss[on] == best[on]) and on.sum() >= 10
    law = frontier.power_laws(np.ones((1, len(runs))))
    # Dense noise-free runs: the frontier's sizes follow N_opt(C) to within the spread of the sample.
    assert law.a[0] == pytest.approx(TRUE_A, abs=0.05)
