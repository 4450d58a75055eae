"""The planner: budget -> compute-optimal N, D, loss and wall-clock time, from an identified law only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.cli import main
from analysis.allocate import Unidentified, plan
from analysis.table import InputError

E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28
H100_PEAK = 989e12  # dense bf16, lab.measure.accounting
GOOD = {"identified": True, "reasons": [], "checks": []}


def _closed_form(flops: float, k: float = 6.0) -> tuple[float, float, float]:
    g = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    n = g * (flops / k) ** (BETA / (ALPHA + BETA))
    d = (flops / k) ** (ALPHA / (ALPHA + BETA)) / g
    return n, d, E + A / n**ALPHA + B / d**BETA


def _fit(a3_ok: bool = True, iso_ok: bool = True, iso_scale: float = 1.0, k: float = 6.0) -> dict:
    """A fit.json with approach 3 (the law above) and an IsoFLOP law with the same a, N_opt times iso_scale."""
    a = BETA / (ALPHA + BETA)
    n_ref = _closed_form(1e21, k)[0]
    k_n = iso_scale * n_ref / 1e21 ** a
    bad = {"identified": False, "reasons": ["condition number of J^T J 1e+12 (> 1e+06)"], "checks": []}
    return {"schema_version": 2, "config": {"ci_level": 0.9}, "data": {"flops": [1e18, 1e21]},
            "approach3": {"E": E, "A": A, "B": B, "alpha": ALPHA, "beta": BETA, "a": a, "b": 1 - a,
                          "k_N": _closed_form(1.0, k)[0], "k_D": _closed_form(1.0, k)[1], "fit": {"flops_k": k},
                          "identification": GOOD if a3_ok else bad},
            "isoflop": {"a": a, "b": 1 - a, "k_N": k_n, "k_D": 1 / (k * k_n),
                        "identification": GOOD if iso_ok else {**bad, "reasons": ["2 budgets (need 3)"]}},
            "envelope": {"skipped": True, "reason": "no training curves"},
            "comparison": {"preferred": "approach3" if a3_ok else "isoflop" if iso_ok else None, "why": "",
                           "disagreements": []}}


def _samples(fit: dict, spread: float = 0.02, count: int = 200) -> pd.DataFrame:
    """Bootstrap-like resamples: A scaled by a few percent, the IsoFLOP k_N by the same factors."""
    f = np.exp(np.random.default_rng(0).normal(0.0, spread, count))
    iso = fit["isoflop"]
    return pd.DataFrame({"E": E, "A": A * f, "B": B, "alpha": ALPHA, "beta": BETA,
                         "isoflop_a": iso["a"], "isoflop_k_N": iso["k_N"] * f ** (1 / (ALPHA + BETA)),
                         "isoflop_b": iso["b"], "isoflop_k_D": iso["k_D"] / f ** (1 / (ALPHA + BETA))})


def test_plan_from_flops_uses_approach_3_and_shows_approach_2_beside_it():
    p = plan(_fit(), "H100", 64, 0.4, flops=1e22)
    n, d, loss = _closed_form(1e22)
    assert p.approach == "approach3" and "predicts the loss" in p.why
    assert 6 * p.params * p.tokens == pytest.approx(1e22, rel=1e-12)
    assert (p.params, p.tokens, p.loss) == pytest.approx((n, d, loss), rel=1e-12)
    assert p.seconds == pytest.approx(1e22 / (64 * H100_PEAK * 0.4), rel=1e-12)
    assert p.gpu_hours == pytest.approx(p.seconds * 64 / 3600)
    assert p.extrapolation == pytest.approx(10.0)
    assert set(p.approaches) == {"approach3", "isoflop"}
    assert p.approaches["isoflop"]["params"] == pytest.approx(n, rel=1e-9)
    assert p.ci is None and p.disagreements == []


def test_plan_uses_the_fits_flops_per_parameter_token():
    p = plan(_fit(k=7.0), "H100", 8, 0.4, flops=1e22)
    assert 7 * p.params * p.tokens == pytest.approx(1e22, rel=1e-12)
    assert p.params == pytest.approx(_closed_form(1e22, 7.0)[0], rel=1e-12)


def test_plan_from_gpu_hours():
    p = plan(_fit(), "NVIDIA H100 80GB HBM3", 8, 0.5, gpu_hours=1000.0)
    flops = 1000.0 * 3600 * H100_PEAK * 0.5
    assert p.flops == pytest.approx(flops, rel=1e-12)
    assert p.seconds == pytest.approx(1000.0 * 3600 / 8, rel=1e-12)
    assert p.params == pytest.approx(_closed_form(flops)[0], rel=1e-12)


def test_plan_intervals_from_bootstrap_samples():
    fit = _fit()
    p = plan(fit, "A100", 1, 0.3, flops=1e21, samples=_samples(fit), level=0.9)
    lo, hi = p.ci["params"]
    assert lo < p.params < hi  # a larger A shifts the optimum to larger N
    assert p.ci["loss"][0] < p.loss < p.ci["loss"][1]
    assert p.approaches["isoflop"]["ci"]["params"][0] < p.approaches["isoflop"]["params"]
    assert p.disagreements == []  # the two laws agree


def test_plan_warns_loudly_when_approaches_disagree(tmp_path, capsys):
    fit = _fit(iso_scale=2.5)
    p = plan(fit, "H100", 64, 0.4, flops=1e22, samples=_samples(fit), level=0.9)
    assert p.approach == "approach3"
    [x] = p.disagreements
    assert x["approaches"] == ["isoflop", "approach3"] and x["ratio"] == pytest.approx(2.5, rel=1e-6)
    assert x["ci"][0] > 1.0
    path = _write(fit, tmp_path, samples=_samples(fit))
    assert main(["plan", str(path), "--gpu", "H100", "--n-gpus", "64", "--mfu", "0.4", "--flops", "1e22"]) == 0
    out = capsys.readouterr().out
    assert "APPROACHES DISAGREE" in out and "approach 2 (IsoFLOP)" in out and "approach 3 (parametric)" in out
    # the law in use is named as one of the pair on the line that names it, not only in a trailing warning
    [law] = [line for line in out.splitlines() if line.startswith("law ")]
    assert "approach 3 (parametric)" in law and "WARNING: it DISAGREES with approach 2 (IsoFLOP)" in law


def test_a_law_that_agrees_carries_no_disagreement_note(tmp_path, capsys):
    fit = _fit()
    path = _write(fit, tmp_path, samples=_samples(fit))
    assert main(["plan", str(path), "--gpu", "H100", "--n-gpus", "64", "--mfu", "0.4", "--flops", "1e22"]) == 0
    out = capsys.readouterr().out
    assert "DISAGREE" not in out and "law         approach 3 (parametric): it is identified" in out


def test_plan_falls_back_to_an_identified_approach():
    p = plan(_fit(a3_ok=False), "H100", 8, 0.4, flops=1e22)
    assert p.approach == "isoflop" and "approach 3 is not identified" in p.why
    assert p.loss is None and p.params == pytest.approx(_closed_form(1e22)[0], rel=1e-9)
    assert p.approaches["approach3"]["identified"] is False


def test_plan_refuses_an_unidentified_law(tmp_path, capsys):
    with pytest.raises(Unidentified, match=r"refusing to plan: no approach is identified .*condition number"):
        plan(_fit(a3_ok=False, iso_ok=False), "H100", 8, 0.4, flops=1e22)
    with pytest.raises(Unidentified, match="refusing to plan from approach 3 .*condition number"):
        plan(_fit(a3_ok=False), "H100", 8, 0.4, flops=1e22, approach="approach3")
    path = _write(_fit(a3_ok=False, iso_ok=False), tmp_path)
    assert main(["plan", str(path), "--gpu", "H100", "--n-gpus", "8", "--mfu", "0.4", "--flops", "1e22"]) == 3
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("error: refusing to plan")


def test_plan_refuses_a_fit_without_identification(tmp_path):
    old = _fit()
    old["schema_version"] = 1
    path = _write(old, tmp_path)
    assert main(["plan", str(path), "--gpu", "H100", "--n-gpus", "8", "--mfu", "0.4", "--flops", "1e22"]) == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"gpu": "TPUv9", "flops": 1e21}, "unknown GPU 'TPUv9'"),
    ({"mfu": 0.0, "flops": 1e21}, "--mfu must be in"),
    ({"n_gpus": 0, "flops": 1e21}, "--n-gpus must be >= 1"),
    ({"flops": 1e21, "gpu_hours": 5.0}, "exactly one budget"),
    ({"flops": -1.0}, "must be a positive number"),
])
def test_plan_rejects_bad_input(kwargs, message):
    args = {"gpu": "H100", "n_gpus": 8, "mfu": 0.4, **kwargs}
    with pytest.raises(InputError, match=message):
        plan(_fit(), **args)


def _write(fit: dict, folder: Path, samples: pd.DataFrame | None = None) -> Path:
    """fit.json (and bootstrap.csv) in folder, as 'fit' writes them."""
    (folder / "fit.json").write_text(json.dumps(fit))
    if samples is not None:
        samples.to_csv(folder / "bootstrap.csv", index=False)
    return folder / "fit.json"


def test_plan_cli(tmp_path, capsys):
    path = _write(_fit(), tmp_path)
    assert main(["plan", str(path), "--gpu", "H100", "--n-gpus", "64", "--mfu", "0.4", "--flops", "1e22",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == pytest.approx(_closed_form(1e22)[0], rel=1e-12)
    assert out["approach"] == "approach3" and set(out["approaches"]) == {"approach3", "isoflop"}
    assert main(["plan", str(path), "--gpu", "H100", "--n-gpus", "64", "--mfu", "0.4", "--gpu-hours", "100"]) == 0
    text = capsys.readouterr().out
    assert "N_opt" in text and "law         approach 3 (parametric)" in text
    assert main(["plan", str(tmp_path / "missing.json"), "--gpu", "H100", "--n-gpus", "1", "--mfu", "0.4",
                 "--flops", "1e20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot read fit")
