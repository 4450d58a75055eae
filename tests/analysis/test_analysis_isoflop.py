"""Approach 2: budget clustering, windowed minima, edge and one-sided profiles, power laws, skipping."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.budgets import group_budgets
from analysis.fit import FitConfig, fit_runs
from analysis.isoflop import budget_minima
from analysis.synthetic import CHINCHILLA, continuous_runs, isoflop_runs, law_optimum
from analysis.table import load_runs

TRUE_A = CHINCHILLA["beta"] / (CHINCHILLA["alpha"] + CHINCHILLA["beta"])
BUDGETS = np.geomspace(1e18, 1e21, 7)
EPOCH = {"E": 1.82, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}


def _minima(runs, tol=0.05):
    n, loss, c = runs["params"].to_numpy(), runs["loss"].to_numpy(), runs["flops"].to_numpy()
    budgets = group_budgets(c, tol)
    return budget_minima(n, loss, budgets.labels, budgets.flops, np.ones((1, len(n)))), budgets


def _table(tmp_path, runs):
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    return load_runs(path)


def test_jittered_budgets_group_within_tolerance():
    rng = np.random.default_rng(0)
    nominal = np.repeat([1e18, 1e19, 1e20], 5)
    flops = nominal * (1 + rng.uniform(-0.02, 0.02, nominal.size))  # budgets not shared exactly
    budgets = group_budgets(flops, 0.05)
    np.testing.assert_array_equal(budgets.labels, np.repeat([0, 1, 2], 5))
    np.testing.assert_allclose(budgets.flops, [1e18, 1e19, 1e20], rtol=0.02)
    assert not budgets.continuous and not budgets.single and budgets.wide == []
    tight = group_budgets(flops, 0.001)  # a tolerance below the jitter links no runs: no budgets at all
    assert tight.count == 0 and tight.continuous
    assert group_budgets(flops, 200.0).count == 1  # a loose one merges them


def test_a_ladder_of_exact_budgets_stays_a_ladder():
    # Four budgets 1% apart, each with seven sizes at exactly its C: closer than the 5% tolerance,
    # yet four budgets. The grouping before this change put them into one.
    flops = np.repeat(1e19 * 1.01 ** np.arange(4), 7)
    budgets = group_budgets(flops, 0.05)
    assert budgets.count == 4
    np.testing.assert_array_equal(budgets.labels, np.repeat(np.arange(4), 7))
    assert not budgets.single
    # A stray run within the tolerance joins the nearest budget.
    with_stray = group_budgets(np.append(flops, 1e19 * 1.012), 0.05)
    assert with_stray.labels[-1] == 1


def test_three_seeds_of_one_size_are_not_a_budget_of_their_own():
    # Two budgets of 7 sizes whose C differ a little from size to size (rounded shapes), each size trained with
    # three seeds: every size's C occurs three times exactly, which is no designed budget of one size.
    sizes = np.geomspace(1e4, 1e5, 7)
    jitter = 1 + np.linspace(-0.01, 0.01, 7)
    flops = np.repeat(np.concatenate([1e12 * jitter, 4e12 * jitter]), 3)
    params = np.repeat(np.concatenate([sizes, 2 * sizes]), 3)
    budgets = group_budgets(flops, 0.05, params)
    assert budgets.count == 2
    np.testing.assert_array_equal(budgets.labels, np.repeat([0, 1], 21))
    assert group_budgets(flops, 0.05).count == 14  # counting runs, not sizes: each size a "budget"


def test_continuous_budgets_form_no_groups_and_chains_are_reported():
    runs = continuous_runs(245, seed=0)
    budgets = group_budgets(runs["flops"].to_numpy(), 0.05)
    assert budgets.continuous and budgets.count == 0 and np.all(budgets.labels == -1)
    assert sum(w["n_runs"] for w in budgets.wide) > 100  # runs chained into ranges wider than 5%
    # One budget's worth of runs is "single"; two budgets are not.
    assert group_budgets(np.full(9, 1e20), 0.05).single
    assert not group_budgets(np.repeat([1e19, 1e20], 5), 0.05).single


@pytest.mark.parametrize("method", ["vertex", "lowest"])
def test_known_optimum_gives_back_a_and_b(method):
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.0)
    minima, _ = _minima(runs)
    law = minima.power_laws(method, runs["params"].to_numpy(), runs["tokens"].to_numpy(), 6.0)
    # Noise-free and centred on the true optimum: every profile has the same shape in log N, so the
    # windowed vertex is off by the same factor in every budget and the exponents are exact.
    assert law.a[0] == pytest.approx(TRUE_A, abs=1e-6)
    assert law.b[0] == pytest.approx(1 - TRUE_A, abs=1e-6)
    assert law.n_points[0] == len(BUDGETS)
    if method == "lowest":
        n_opt, _ = law_optimum(BUDGETS)
        np.testing.assert_allclose(law.at(BUDGETS)[0][0], n_opt, rtol=1e-6)


def test_noisy_isoflop_recovers_a_within_tolerance():
    # 0.5% loss noise: the vertex exponent stays within 0.03 of the truth.
    runs = isoflop_runs(BUDGETS, per_budget=9, spread=6, noise=0.005, seed=0)
    minima, _ = _minima(runs)
    law = minima.power_laws("vertex", runs["params"].to_numpy(), runs["tokens"].to_numpy(), 6.0)
    assert law.a[0] == pytest.approx(TRUE_A, abs=0.03)


def _full_parabola_vertex(runs: pd.DataFrame) -> np.ndarray:
    """log10 N of the vertex of a parabola through each budget's whole profile (the method before windows)."""
    out = []
    for _, group in runs.groupby("flops"):
        c2, c1, _ = np.polyfit(np.log10(group["params"]), group["loss"], 2)
        out.append(-c1 / (2 * c2))
    return np.array(out)


@pytest.mark.parametrize("law", [CHINCHILLA, EPOCH], ids=["chinchilla", "epoch"])
@pytest.mark.parametrize("offset,spread,sizes", [(5.0, 10.0, 12), (0.2, 10.0, 12), (4.0, 16.0, 14)])
def test_window_shrinks_the_vertex_error_on_lopsided_profiles(law, offset, spread, sizes):
    # Sizes from N_opt*offset/spread to N_opt*offset*spread: many more on one side of the minimum.
    runs = isoflop_runs(BUDGETS, per_budget=sizes, spread=spread, offset=offset, noise=0.0, law=law)
    truth = np.log10(law_optimum(BUDGETS, law)[0])
    minima, _ = _minima(runs)
    assert minima.vertex_ok[0].all() and minima.sided[0].all()
    windowed = np.abs(minima.vertex_log_n[0] / np.log(10) - truth)
    full = np.abs(_full_parabola_vertex(runs) - truth)
    assert windowed.max() <= 0.01, windowed
    assert windowed.mean() < full.mean() / 3, (windowed, full)
    # The window is symmetric about the lowest run: it cut the long side down.
    assert (minima.in_window[0] < sizes).all()


@pytest.mark.slow
def test_edge_and_one_sided_profiles_are_flagged_and_left_out(tmp_path):
    centred = isoflop_runs(BUDGETS[:4], per_budget=7, spread=6, noise=0.0)
    # Budget 5 samples only N far above its optimum: its lowest run is its smallest N (edge).
    edge = isoflop_runs(BUDGETS[4:5], per_budget=7, spread=3, offset=20.0, noise=0.0)
    # Budget 6 has one size below its lowest run: one-sided.
    one_sided = isoflop_runs(BUDGETS[5:6], per_budget=9, spread=10, offset=6.0, noise=0.0)
    runs = pd.concat([centred, edge.assign(run_id=edge["run_id"] + "e"),
                      one_sided.assign(run_id=one_sided["run_id"] + "o")], ignore_index=True)
    minima, _ = _minima(runs)
    assert list(minima.edge[0]) == [False] * 4 + [True, False]
    assert list(minima.sided[0]) == [True] * 4 + [False, False]
    assert (minima.left[0, 5], minima.right[0, 5]) == (1, 7)
    n, d = runs["params"].to_numpy(), runs["tokens"].to_numpy()
    assert minima.power_laws("vertex", n, d, 6.0).n_points[0] == 4
    assert minima.power_laws("lowest", n, d, 6.0).n_points[0] == 4
    doc = fit_runs(_table(tmp_path, runs), FitConfig(isoflop_minimum="vertex", n_bootstrap=0, progress=False,
                                                     holdout=False)).to_dict()
    statuses = [m["status"].split(":")[0] for m in doc["isoflop"]["minima"]]
    assert statuses == ["ok"] * 4 + ["edge", "one-sided"]
    assert doc["isoflop"]["minima"][4]["used"] == {"vertex": False, "lowest": False, "akima": False}
    # Akima's spline needs no sizes beyond the minimum's neighbours: one below the lowest run is enough.
    assert doc["isoflop"]["minima"][5]["used"] == {"vertex": False, "lowest": False, "akima": True}
    codes = {w["code"]: w["message"] for w in doc["warnings"]}
    assert f"{BUDGETS[4]:.3g}" in codes["isoflop_edge"] and f"{BUDGETS[5]:.3g}" in codes["isoflop_one_sided"]
    assert doc["isoflop"]["a"] == pytest.approx(TRUE_A, abs=1e-6)  # the flagged budgets did not bias it
    # The report shows the lowest run beside the vertex for each budget.
    low = doc["isoflop"]["minima"][0]
    assert low["lowest"]["params"] > 0 and low["vertex"]["params"] > 0 and low["sizes_below"] == 3


@pytest.mark.slow
def test_isoflop_is_skipped_on_continuous_budgets_while_approaches_1_and_3_run(tmp_path):
    runs = continuous_runs(40, noise=0.0, seed=1)
    doc = fit_runs(_table(tmp_path, runs), FitConfig(n_bootstrap=20, progress=False)).to_dict()
    assert doc["data"]["budgets"]["mode"] == "continuous"
    assert doc["isoflop"]["skipped"] is True and doc["isoflop"]["minima"] == []
    assert "continuous" in doc["isoflop"]["reason"]
    assert any(w["code"] == "budgets_continuous" for w in doc["warnings"])
    assert doc["envelope"]["skipped"] is False and doc["envelope"]["source"].startswith("final losses")
    assert doc["approach3"]["alpha"] == pytest.approx(CHINCHILLA["alpha"], rel=1e-4)
    assert all(p["isoflop"] is None and p["approach3"]["params"] > 0 for p in doc["predictions"])
