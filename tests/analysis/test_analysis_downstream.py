"""The loss → task error link (Gadre et al. 2024) recovers the parameters that generated its data."""

import numpy as np
import pytest

from analysis.downstream import fit_task, predict_score, task_error

TRUE = np.array([0.75, 5.0, 1.2])  # ε (chance error of a 4-way task), k, γ


@pytest.mark.slow
def test_fit_recovers_known_parameters_and_predicts_the_score_within_its_interval():
    rng = np.random.default_rng(3)
    loss = np.linspace(2.0, 4.5, 14)
    score = 1.0 - task_error(TRUE, loss) + rng.normal(0.0, 0.004, loss.size)
    fit = fit_task(loss, score, n_boot=100)
    got = np.array([fit["eps"], fit["k"], fit["gamma"]])
    assert got == pytest.approx(TRUE, rel=0.1)
    for name, value in zip(("eps", "k", "gamma"), TRUE):
        lo, hi = fit["ci"][name]
        assert lo <= value <= hi, (name, lo, hi)
    assert fit["rmse"] < 0.01
    # extrapolated to a lower loss than any run's, as at a larger compute-optimal budget
    at = predict_score(fit, 1.8, [1.75, 1.85])
    truth = 1.0 - task_error(TRUE, 1.8)
    assert at["ci"][0] <= truth <= at["ci"][1] and at["score"] == pytest.approx(truth, abs=0.02)
    assert at["ci"][1] - at["ci"][0] > 0


def test_too_few_scored_runs_are_skipped_with_a_reason():
    out = fit_task(np.array([2.0, 3.0, np.nan, 4.0]), np.array([0.5, 0.4, 0.3, np.nan]))
    assert out["skipped"] and "2 run(s)" in out["reason"]


@pytest.mark.slow  # a whole fit with its bootstrap
def test_analysis_fit_fits_task_columns_and_reports_the_predicted_score(tmp_path):
    import json

    from analysis.cli import main
    from analysis.synthetic import isoflop_runs, write_sweep

    runs = isoflop_runs(np.geomspace(1e18, 1e20, 3), per_budget=5, spread=6, noise=0.01)
    dirs = write_sweep(runs, tmp_path / "sweep")
    rng = np.random.default_rng(0)
    for d, loss in zip(dirs, runs["loss"]):
        score = float(1.0 - task_error(TRUE, loss) + rng.normal(0.0, 0.003))
        (d / "eval.json").write_text(json.dumps({"tasks": {"tiny": {"step": 1, "metrics": {"acc": score}}}}))
    out = tmp_path / "out"
    assert main(["fit", str(tmp_path / "sweep"), "--out", str(out), "--bootstrap", "30", "--workers", "1",
                 "--predict", "1e21"]) in (0, 3)
    doc = json.loads((out / "fit.json").read_text())
    (task,) = doc["downstream"]
    assert task["task"] == "tiny" and task["runs"] == len(runs) and not task["skipped"]
    (at,) = task["predictions"]
    loss = next(p["approach3"]["loss"] for p in doc["predictions"] if p["flops"] == 1e21)
    assert at["loss"] == loss and at["ci"][0] <= at["score"] <= at["ci"][1]
    assert at["score"] == pytest.approx(1.0 - task_error(TRUE, loss), abs=0.03)
    report = (out / "report.md").read_text()
    assert "## Downstream tasks" in report and "downstream.png" in report
    assert (out / "downstream.png").stat().st_size > 10_000
