"""The whole fit: bootstrap intervals, hold-out check, predictions and warnings."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.bootstrap import bootstrap_parametric, draw_weights
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
    return fit_runs(table, FitConfig(n_bootstrap=200, seed=7, predict=(1e21, 1e22, 1e24), progress=False))


def test_draw_weights_are_seeded_resamples():
    w = draw_weights(50, 30, seed=3)
    assert w.shape == (30, 50) and np.all(w.sum(axis=1) == 50)
    np.testing.assert_array_equal(w, draw_weights(50, 30, seed=3))
    assert not np.array_equal(w, draw_weights(50, 30, seed=4))


def test_same_seed_gives_the_same_intervals(table, fitted):
    again = fit_runs(table, FitConfig(n_bootstrap=200, seed=7, predict=(1e21, 1e22, 1e24), progress=False))
    first, second = fitted.to_dict(), again.to_dict()
    assert first["approach3"]["ci"] == second["approach3"]["ci"]
    assert first["isoflop"]["ci"] == second["isoflop"]["ci"]
    assert first["predictions"] == second["predictions"]
    other = fit_runs(table, FitConfig(n_bootstrap=200, seed=8, holdout=False, progress=False)).to_dict()
    assert other["approach3"]["ci"]["alpha"] != first["approach3"]["ci"]["alpha"]


def test_process_pool_gives_the_same_refits_as_one_process(table):
    n, d, loss = table.n, table.d, table.loss
    theta = fit_parametric(n, d, loss).theta
    w = draw_weights(len(n), 12, seed=0)
    serial = bootstrap_parametric(theta, n, d, loss, w, workers=1, progress=False)
    pooled = bootstrap_parametric(theta, n, d, loss, w, workers=2, progress=False)
    np.testing.assert_allclose(serial[0], pooled[0], rtol=1e-10)
    assert not np.allclose(serial[0][0], serial[0][1])  # the resamples really differ


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
        assert p["ci"]["params"][0] <= n_true[0] <= p["ci"]["params"][1]
        assert p["ci"]["loss"][0] <= law_loss(n_true, d_true)[0] <= p["ci"]["loss"][1]


def test_predictions_follow_the_fit_and_far_ones_warn(fitted):
    doc = fitted.to_dict()
    a3 = doc["approach3"]
    for p in doc["predictions"]:
        assert 6 * p["params"] * p["tokens"] == pytest.approx(p["flops"], rel=1e-9)
        assert p["params"] == pytest.approx(a3["G"] * (p["flops"] / 6) ** a3["a"], rel=1e-9)
        assert p["tokens_per_param"] == pytest.approx(p["tokens"] / p["params"])
        assert p["isoflop"]["params"] == pytest.approx(doc["isoflop"]["k_N"] * p["flops"] ** doc["isoflop"]["a"])
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


def test_result_is_json_clean(fitted):
    import json

    text = json.dumps(fitted.to_dict(), allow_nan=False)
    assert '"approach3"' in text and "NaN" not in text
