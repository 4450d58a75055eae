"""``python -m analysis predict`` and ``analysis.predict``: a fit's loss at any (N, D), with bootstrap intervals."""

import json

import numpy as np
import pytest

from analysis.cli import main
from analysis.parametric import predict_loss
from analysis.predict import FAR, load_law
from analysis.synthetic import isoflop_runs


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A Chinchilla-law IsoFLOP grid, fitted with 60 bootstrap resamples."""
    folder = tmp_path_factory.mktemp("predict")
    runs = isoflop_runs(np.geomspace(1e18, 1e21, 5), per_budget=7, spread=6, noise=0.005, seed=3)
    runs.to_csv(folder / "runs.csv", index=False)
    out = folder / "fit"
    assert main(["fit", str(folder / "runs.csv"), "--out", str(out), "--bootstrap", "60", "--workers", "1",
                 "--no-progress", "--form", "chinchilla", "--predict", "1e21"]) == 0
    return out / "fit.json"


@pytest.mark.slow
def test_predict_from_python_matches_the_law_with_intervals_and_flags(fitted):
    law = load_law(fitted)
    doc = json.loads(fitted.read_text())
    at = doc["predictions"][0]["approach3"]  # the fit's own prediction at its compute-optimal N, D
    lo_ratio, hi_ratio = doc["data"]["tokens_per_param"]
    n = np.array([at["params"], 1e9, 1e9])
    d = np.array([at["tokens"], 1e9 * hi_ratio * FAR * 3, 1e9 * np.sqrt(lo_ratio * hi_ratio)])
    table = law.predict(n, d)
    assert table["loss"].iloc[0] == pytest.approx(at["loss"], rel=1e-9)
    assert np.allclose(table["loss"], predict_loss(law.theta, n, d))
    assert law.thetas.shape == (60, 5)
    assert (table["lo"] < table["loss"]).all() and (table["loss"] < table["hi"]).all()
    assert table["flag"].iloc[0] == "" and table["flag"].iloc[2] == ""
    assert table["flag"].iloc[1].startswith("over-trained")
    # over-training widens the interval: the D term is extrapolated far
    width = (table["hi"] - table["lo"]) / table["loss"]
    assert width.iloc[1] > width.iloc[2]


@pytest.mark.slow
def test_predict_cli_pairs_csv_json_and_bad_input(fitted, tmp_path, capsys):
    assert main(["predict", str(fitted), "--params", "1e9", "1e8", "--tokens", "2e10", "1e13"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "95% bootstrap intervals over 60 resamples" in lines[0] and len(lines) == 3
    assert "FLAGGED" not in lines[1] and "FLAGGED over-trained" in lines[2]
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("params,tokens\n1e9,2e10\n1e8,1e13\n")
    assert main(["predict", str(fitted), "--csv", str(pairs), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    expected = load_law(fitted).predict([1e9, 1e8], [2e10, 1e13])
    assert [r["loss"] for r in rows] == pytest.approx(expected["loss"].tolist())
    assert rows[0]["flag"] == "" and rows[1]["flag"].startswith("over-trained")
    for argv, message in [
        (["--params", "1e9", "2e9", "--tokens", "2e10"], "give pairs"),
        (["--params", "1e9"], "give --params"),
        (["--csv", str(pairs), "--params", "1e9", "--tokens", "1e9"], "not both"),
        (["--params", "-1", "--tokens", "1e9"], "positive"),
        (["--csv", str(tmp_path / "none.csv")], "cannot read"),
    ]:
        assert main(["predict", str(fitted), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err
    bad = tmp_path / "bad.csv"
    bad.write_text("n,tokens\n1,2\n")
    assert main(["predict", str(fitted), "--csv", str(bad)]) == 2
    assert "no column(s) params" in capsys.readouterr().err


def test_the_training_loop_evaluates_every_form_and_a_fit_as_the_analysis_does(fitted):
    """lab.training.expect (what --train.expect runs, without the analysis) against analysis.parametric and
    analysis.predict: each form's loss from its named parameters, and a fit.json's loss and bootstrap interval."""
    from lab.measure.laws import FORMS, point_loss
    from lab.training.expect import watcher

    n, d = np.geomspace(1e6, 1e10, 5), np.geomspace(1e8, 1e13, 5)
    named = {"chinchilla": {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28},
             "shared": {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.31},
             "kaplan-e": {"E": 1.5, "N_c": 8.8e13, "D_c": 5.4e13, "alpha_N": 0.076, "alpha_D": 0.095}}
    for name, form in FORMS.items():
        theta = form.theta_of(named[name])[0]
        assert point_loss(name, named[name], n, d) == pytest.approx(predict_loss(theta, n, d, form), rel=1e-12)
    law, batch_tokens = load_law(fitted), 2 ** 20
    w = watcher(fitted, 3e8, np.full(100, 1e-3), batch_tokens)
    for step in (10, 100):
        expected = law.predict([3e8], [step * batch_tokens]).iloc[0]
        assert w.law(step) == pytest.approx((expected["loss"], expected["lo"], expected["hi"]), rel=1e-12)
