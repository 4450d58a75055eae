"""The whole fit: bootstrap intervals, hold-out check, predictions, identification and warnings."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.bootstrap import CHUNK, Problem, bootstrap, chunk_weights, draw_weights
from analysis.budgets import group_budgets
from analysis.envelope import build_frontier
from analysis.fit import FitConfig, fit_runs
from analysis.parametric import fit_parametric
from analysis.synthetic import CHINCHILLA, isoflop_runs, law_loss, law_optimum
from analysis.table import load_runs

TRUTH = {**CHINCHILLA, "a": CHINCHILLA["beta"] / (CHINCHILLA["alpha"] + CHINCHILLA["beta"]),
         "b": CHINCHILLA["alpha"] / (CHINCHILLA["alpha"] + CHINCHILLA["beta"])}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    # The recovery setting: 7 budgets x 9 sizes, 0.5% loss noise.
    path = tmp_path_factory.mktemp("fit") / "runs.csv"
    isoflop_runs(np.geomspace(1e18, 1e21, 7), per_budget=9, spread=6, noise=0.005, seed=0).to_csv(path, index=False)
    return load_runs(path)


@pytest.fixture(scope="module")
def fitted(table):
    # Independent 0.5 % noise per run: the vertex smooths it, the default spline follows it (its a is 3-5 times as
    # noisy here: benchmarks/isoflop-bias/README.md), so these checks of the fit's intervals take the vertex.
    return fit_runs(table, FitConfig(n_bootstrap=200, seed=7, predict=(1e21, 1e22, 1e24), isoflop_minimum="vertex",
                                     progress=False))


def test_draw_weights_are_seeded_resamples_drawn_chunk_by_chunk():
    w = draw_weights(50, 2 * CHUNK + 7, seed=3)
    assert w.shape == (2 * CHUNK + 7, 50) and np.all(w.sum(axis=1) == 50)
    np.testing.assert_array_equal(w, draw_weights(50, 2 * CHUNK + 7, seed=3))
    assert not np.array_equal(w, draw_weights(50, 2 * CHUNK + 7, seed=4))
    np.testing.assert_array_equal(w[CHUNK:2 * CHUNK], chunk_weights(50, 3, 1, CHUNK))
    # Counts of a resample are multinomial(50, 1/50): every run appears about once on average.
    assert w.mean() == pytest.approx(1.0) and 0.2 < (w == 0).mean() < 0.5


@pytest.mark.slow
def test_same_seed_gives_the_same_intervals(table, fitted):
    again = fit_runs(table, FitConfig(n_bootstrap=200, seed=7, predict=(1e21, 1e22, 1e24), isoflop_minimum="vertex",
                                      progress=False))
    first, second = fitted.to_dict(), again.to_dict()
    assert first["approach3"]["ci"] == second["approach3"]["ci"]
    assert first["isoflop"]["ci"] == second["isoflop"]["ci"]
    assert first["predictions"] == second["predictions"]
    other = fit_runs(table, FitConfig(n_bootstrap=200, seed=8, holdout=False, progress=False)).to_dict()
    assert other["approach3"]["ci"]["alpha"] != first["approach3"]["ci"]["alpha"]


@pytest.mark.slow
def test_process_pool_gives_the_same_refits_as_one_process(table):
    n, d, loss, c = table.n, table.d, table.loss, table.c
    budgets = group_budgets(c, 0.05)
    problem = Problem(theta0=fit_parametric(n, d, loss).theta, n=n, d=d, loss=loss, labels=budgets.labels,
                      budget_flops=budgets.flops, flops_k=6.0, envelope=build_frontier(c, n, d, loss), seed=0)
    serial = bootstrap(problem, CHUNK + 10, workers=1, progress=False)
    pooled = bootstrap(problem, CHUNK + 10, workers=2, progress=False)
    np.testing.assert_allclose(serial.thetas, pooled.thetas, rtol=1e-10)
    np.testing.assert_array_equal(serial.isoflop["vertex"].a, pooled.isoflop["vertex"].a)
    np.testing.assert_array_equal(serial.envelope.a, pooled.envelope.a)
    assert len(serial.thetas) == CHUNK + 10
    assert not np.allclose(serial.thetas[0], serial.thetas[1])  # the resamples really differ


@pytest.mark.slow
def test_intervals_contain_the_truth(fitted):
    doc = fitted.to_dict()
    ci = doc["approach3"]["ci"]
    assert ci["level"] == 0.95
    for name, truth in TRUTH.items():
        lo, hi = ci[name]
        assert lo <= truth <= hi, (name, lo, truth, hi)
        assert lo <= doc["approach3"][name] <= hi
    lo, hi = doc["isoflop"]["ci"]["a"]
    assert lo <= TRUTH["a"] <= hi
    for p in doc["predictions"]:
        n_true, d_true = law_optimum(np.array([p["flops"]]))
        ci = p["approach3"]["ci"]
        assert ci["params"][0] <= n_true[0] <= ci["params"][1]
        assert ci["loss"][0] <= law_loss(n_true, d_true)[0] <= ci["loss"][1]
        iso = p["isoflop"]["ci"]
        assert iso["params"][0] <= n_true[0] <= iso["params"][1]
        assert iso["tokens"][0] <= d_true[0] <= iso["tokens"][1]


@pytest.mark.slow
def test_predictions_follow_the_fit_and_far_ones_warn(fitted):
    doc = fitted.to_dict()
    a3 = doc["approach3"]
    assert doc["data"]["flops_per_param_token"]["k"] == pytest.approx(6.0, rel=1e-12)
    for p in doc["predictions"]:
        p3 = p["approach3"]
        assert 6 * p3["params"] * p3["tokens"] == pytest.approx(p["flops"], rel=1e-9)
        assert p3["params"] == pytest.approx(a3["G"] * (p["flops"] / 6) ** a3["a"], rel=1e-9)
        assert p3["tokens_per_param"] == pytest.approx(p3["tokens"] / p3["params"])
        iso = p["isoflop"]
        assert iso["params"] == pytest.approx(doc["isoflop"]["k_N"] * p["flops"] ** doc["isoflop"]["a"])
        assert 6 * iso["params"] * iso["tokens"] == pytest.approx(p["flops"], rel=1e-9)  # D_opt of the vertex
    far = [w for w in doc["warnings"] if w["code"] == "extrapolation"]
    assert len(far) == 1 and "1e+24" in far[0]["message"] and "1e+22" not in far[0]["message"]


def test_holdout_predicts_the_largest_budget(fitted):
    hold = fitted.to_dict()["holdout"]
    assert hold["skipped"] is False
    assert hold["budget_flops"] == pytest.approx(1e21)
    assert (hold["n_train"], hold["n_holdout"]) == (54, 9)
    # Noise is 0.5%, so a fit on the smaller budgets predicts the held-out losses to about that.
    assert hold["approach3"]["mean_rel_error"] < 0.01
    runs = hold["approach3"]["runs"]
    mae = np.mean([abs(r["predicted"] - r["loss"]) for r in runs])
    assert hold["approach3"]["mean_abs_error"] == pytest.approx(mae)
    assert hold["isoflop"]["rel_error"] < 0.3


@pytest.mark.slow
def test_holdout_warns_when_the_held_out_budget_lies_off_the_law(fitted, tmp_path):
    assert fitted.to_dict()["holdout"]["approach3"]["bias"] == pytest.approx(0, abs=0.01)
    assert "holdout_bias" not in {w["code"] for w in fitted.to_dict()["warnings"]}
    runs = isoflop_runs(np.geomspace(1e18, 1e21, 7), per_budget=9, spread=6, noise=0.005, seed=0)
    runs.loc[runs["flops"] > 5e20, "loss"] *= 0.97  # the largest budget does better than the law of the others
    runs.to_csv(tmp_path / "runs.csv", index=False)
    doc = fit_runs(load_runs(tmp_path / "runs.csv"), FitConfig(n_bootstrap=0, progress=False)).to_dict()
    assert doc["holdout"]["approach3"]["bias"] > 0.02 and doc["holdout"]["approach3"]["too_high"] >= 8
    warning = next(w["message"] for w in doc["warnings"] if w["code"] == "holdout_bias")
    assert "too high on average" in warning and "likely too high" in warning


def test_result_is_json_clean(fitted):
    import json

    text = json.dumps(fitted.to_dict(), allow_nan=False)
    assert '"approach3"' in text and "NaN" not in text
