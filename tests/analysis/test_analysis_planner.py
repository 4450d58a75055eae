"""The planner: budget in FLOPs or GPU-hours -> compute-optimal N, D, loss and wall-clock time."""

from __future__ import annotations

import json

import numpy as np
import pytest

from analysis.__main__ import main
from analysis.planner import plan
from analysis.table import InputError

E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28
H100_PEAK = 989e12  # dense bf16, lab.accounting
FIT = {"approach3": {"E": E, "A": A, "B": B, "alpha": ALPHA, "beta": BETA},
       "isoflop": {"a": 0.5, "k_N": 0.1}, "data": {"flops": [1e18, 1e21]}, "config": {"ci_level": 0.9}}


def _closed_form(flops: float) -> tuple[float, float, float]:
    g = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    n = g * (flops / 6) ** (BETA / (ALPHA + BETA))
    d = (flops / 6) ** (ALPHA / (ALPHA + BETA)) / g
    return n, d, E + A / n**ALPHA + B / d**BETA


def test_plan_from_flops():
    p = plan(FIT, "H100", 64, 0.4, flops=1e22)
    n, d, loss = _closed_form(1e22)
    assert 6 * p.params * p.tokens == pytest.approx(1e22, rel=1e-12)
    assert (p.params, p.tokens, p.loss) == pytest.approx((n, d, loss), rel=1e-12)
    assert p.seconds == pytest.approx(1e22 / (64 * H100_PEAK * 0.4), rel=1e-12)
    assert p.gpu_hours == pytest.approx(p.seconds * 64 / 3600)
    assert p.extrapolation == pytest.approx(10.0)
    assert p.isoflop_params == pytest.approx(0.1 * 1e22**0.5)
    assert p.ci is None


def test_plan_from_gpu_hours():
    p = plan(FIT, "NVIDIA H100 80GB HBM3", 8, 0.5, gpu_hours=1000.0)
    flops = 1000.0 * 3600 * H100_PEAK * 0.5
    assert p.flops == pytest.approx(flops, rel=1e-12)
    assert p.seconds == pytest.approx(1000.0 * 3600 / 8, rel=1e-12)
    assert p.params == pytest.approx(_closed_form(flops)[0], rel=1e-12)


def test_plan_intervals_from_bootstrap_samples():
    thetas = np.array([[np.log(A * f), np.log(B), np.log(E), ALPHA, BETA] for f in np.linspace(0.8, 1.2, 41)])
    p = plan(FIT, "A100", 1, 0.3, flops=1e21, samples=thetas, level=0.9)
    lo, hi = p.ci["params"]
    assert lo < p.params < hi  # a larger A shifts the optimum to larger N


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
        plan(FIT, **args)


def test_plan_cli(tmp_path, capsys):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(FIT))
    assert main(["plan", str(path), "--gpu", "H100", "--n-gpus", "64", "--mfu", "0.4", "--flops", "1e22",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == pytest.approx(_closed_form(1e22)[0], rel=1e-12)
    assert main(["plan", str(path), "--gpu", "H100", "--n-gpus", "64", "--mfu", "0.4", "--gpu-hours", "100"]) == 0
    assert "N_opt" in capsys.readouterr().out
    assert main(["plan", str(tmp_path / "missing.json"), "--gpu", "H100", "--n-gpus", "1", "--mfu", "0.4",
                 "--flops", "1e20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot read fit")
