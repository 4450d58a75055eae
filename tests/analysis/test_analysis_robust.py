"""The one fitting engine (analysis/robust.py) stops at a converged optimum: a second optimiser (Newton's method,
benchmarks/refactor-fits/compare.py) from its solution on the default sweep's runs moves no named parameter by more
than 1e-6 of itself."""

import importlib.util
from pathlib import Path

import pytest

from analysis.other_laws import fit_kaplan
from analysis.parametric import fit_parametric
from analysis.table import load_runs
from lab.measure.laws import KAPLAN

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location("refactor_fits", ROOT / "benchmarks" / "refactor-fits" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("law", ["chinchilla", "kaplan-e", "kaplan"])
def test_the_engine_stops_at_a_converged_optimum_on_the_default_sweep(law):
    bench = _benchmark()
    runs = load_runs(ROOT / "tests" / "analysis" / "data" / "default-sweep.csv", exclude=["role == 'verify'"])
    data = (runs.n, runs.d, runs.loss)
    if law == "kaplan":
        theta = KAPLAN.theta_of(fit_kaplan(*data, reference_rmse=0.0)["params"])[0]
    else:
        theta = fit_parametric(*data, form=bench.FORMS[law]).theta
    optimum = bench.to_optimum(law, data, theta)
    assert optimum["to_polished"] < 1e-6, optimum
    assert optimum["polished_objective"] <= optimum["objective"] * (1 + 1e-14)
