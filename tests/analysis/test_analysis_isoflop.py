"""Approach 2: budget grouping, minima, edge handling, power laws, and skipping."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.fit import FitConfig, fit_runs
from analysis.isoflop import budget_minima, group_budgets
from analysis.synthetic import CHINCHILLA, isoflop_runs, law_loss, law_optimum
from analysis.table import load_runs

TRUE_A = CHINCHILLA["beta"] / (CHINCHILLA["alpha"] + CHINCHILLA["beta"])
BUDGETS = np.geomspace(1e18, 1e21, 7)


def _minima(runs, tol=0.05):
    n, loss, c = runs["params"].to_numpy(), runs["loss"].to_numpy(), runs["flops"].to_numpy()
    labels = group_budgets(c, tol)
    return budget_minima(n, loss, c, labels, np.ones((1, len(n)))), labels


def test_grouping_within_tolerance():
    rng = np.random.default_rng(0)
    nominal = np.repeat([1e18, 1e19, 1e20], 5)
    flops = nominal * (1 + rng.uniform(-0.02, 0.02, nominal.size))  # budgets not shared exactly
    labels = group_budgets(flops, 0.05)
    np.testing.assert_array_equal(labels, np.repeat([0, 1, 2], 5))
    assert len(np.unique(group_budgets(flops, 0.001))) > 3  # a tighter tolerance splits them
    assert len(np.unique(group_budgets(flops, 200.0))) == 1  # a loose one merges them


@pytest.mark.parametrize("method", ["vertex", "lowest"])
def test_known_optimum_gives_back_a_and_b(method):
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.0)
    minima, _ = _minima(runs)
    law = minima.power_laws(method, False, runs["params"].to_numpy(), runs["tokens"].to_numpy())
    # Noise-free and centred on the true optimum: exact up to rounding (the lowest run is the
    # grid point at the optimum, and the parabola's bias is the same factor at every budget).
    assert law.a[0] == pytest.approx(TRUE_A, abs=1e-6)
    assert law.b[0] == pytest.approx(1 - TRUE_A, abs=1e-6)
    assert law.n_budgets[0] == len(BUDGETS)
    if method == "lowest":
        n_opt, _ = law_optimum(BUDGETS)
        np.testing.assert_allclose(law.k_n[0] * BUDGETS ** law.a[0], n_opt, rtol=1e-6)


def test_noisy_isoflop_recovers_a_within_tolerance():
    # 0.5% loss noise: the vertex exponent stays within 0.03 of the truth (worst of 20 seeds: 0.019).
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0)
    minima, _ = _minima(runs)
    law = minima.power_laws("vertex", False, runs["params"].to_numpy(), runs["tokens"].to_numpy())
    assert law.a[0] == pytest.approx(TRUE_A, abs=0.03)


def test_edge_minima_are_flagged_and_excluded_unless_asked(tmp_path):
    centred = isoflop_runs(BUDGETS[:4], per_budget=7, spread=6, noise=0.0)
    # The largest budget samples only N far above its optimum: its lowest run is its smallest N.
    shifted = isoflop_runs(BUDGETS[4:5], per_budget=7, spread=3, offset=20.0, noise=0.0)
    runs = pd.concat([centred, shifted.assign(run_id=shifted["run_id"] + "s")], ignore_index=True)
    minima, labels = _minima(runs)
    assert list(minima.edge[0]) == [False] * 4 + [True]
    n, d = runs["params"].to_numpy(), runs["tokens"].to_numpy()
    assert minima.power_laws("vertex", False, n, d).n_budgets[0] == 4
    assert minima.power_laws("lowest", True, n, d).n_budgets[0] == 5
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    doc = fit_runs(load_runs(path), FitConfig(n_bootstrap=0, progress=False, holdout=False)).to_dict()
    assert [m["edge"] for m in doc["isoflop"]["minima"]] == [False] * 4 + [True]
    assert doc["isoflop"]["minima"][-1]["used"] == {"vertex": False, "lowest": False}
    assert any(w["code"] == "edge_minimum" and "excluded" in w["message"] for w in doc["warnings"])
    assert doc["isoflop"]["a"] == pytest.approx(TRUE_A, abs=1e-6)  # the edge budget did not bias it


def test_isoflop_is_skipped_with_a_warning_while_approach_3_runs(tmp_path):
    # N and D drawn log-uniformly: budgets hold one or two runs, so no budget has a parabola.
    rng = np.random.default_rng(0)
    n = np.exp(rng.uniform(np.log(1e7), np.log(1e9), 24))
    d = np.exp(rng.uniform(np.log(1e9), np.log(1e11), 24))
    assert np.bincount(group_budgets(6 * n * d, 0.05)).max() < 3
    runs = pd.DataFrame({"params": n, "tokens": d, "flops": 6 * n * d, "loss": law_loss(n, d)})
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    doc = fit_runs(load_runs(path), FitConfig(n_bootstrap=20, progress=False)).to_dict()
    assert doc["isoflop"]["skipped"] is True
    assert doc["isoflop"]["a"] is None
    assert any(w["code"] == "isoflop_skipped" and "no budget has 3 or more runs" in w["message"]
               for w in doc["warnings"])
    assert doc["approach3"]["alpha"] == pytest.approx(CHINCHILLA["alpha"], rel=1e-4)
    assert doc["approach3"]["ci"]["alpha"] is not None
    assert all(p["isoflop"] is None and p["params"] > 0 for p in doc["predictions"])
